//! Types shared by the roce-trace eBPF datapath and userspace.
//!
//! One definition of every header ([`wire`]), of RoCE opcode semantics ([`roce`]), of the
//! parser that walks a frame ([`parse`]), of the sampling hash ([`sampling`]) and of every
//! record that crosses the kernel/user line ([`datapath`]). The kernel runs the same
//! parser over packet memory that host tests and pcap input run over byte slices.
#![no_std]

pub mod account;
pub mod datapath;
pub mod flow;
#[cfg(feature = "icrc")]
pub mod icrc;
pub mod nic;
pub mod parse;
pub mod roce;
pub mod sampling;
pub mod sat;
pub mod scratch;
pub mod wire;

/// Marks the branch it is in as rarely taken, for code placement alone: the eBPF programs'
/// common packet then runs a straighter line. Only the BPF build places code by it (the
/// pinned nightly builds it); elsewhere it is nothing, as `core::hint::cold_path` is newer
/// than the workspace's minimum Rust.
#[inline(always)]
pub fn cold_path() {
    #[cfg(target_arch = "bpf")]
    #[allow(
        clippy::incompatible_msrv,
        reason = "compiled for the BPF target only, by the pinned nightly"
    )]
    core::hint::cold_path();
}
