//! Types shared by the roce-trace eBPF datapath and userspace.
//!
//! One definition of every header ([`wire`]), of RoCE opcode semantics ([`roce`]), of the
//! parser that walks a frame ([`parse`]), of the sampling hash ([`sampling`]) and of every
//! record that crosses the kernel/user line ([`datapath`]). The kernel runs the same
//! parser over packet memory that host tests and pcap input run over byte slices.
#![no_std]
// `opaque` is inline asm, which the BPF target has behind a feature (the pinned nightly).
#![cfg_attr(target_arch = "bpf", feature(asm_experimental_arch))]

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

/// `x`, as a value the optimiser cannot see through. Arithmetic written to decide without
/// a branch (`account::news`, `account::reasons`) stays arithmetic: LLVM turns `(x | -x) >> 63` back into
/// `x != 0`, which the BPF target (no conditional moves) compiles to a branch. Nothing in
/// other builds.
#[inline(always)]
pub fn opaque(x: u64) -> u64 {
    #[cfg(target_arch = "bpf")]
    {
        let mut x = x;
        // SAFETY: a register moved onto itself: no memory, no effect.
        unsafe {
            core::arch::asm!("{0} = {0}", inout(reg) x, options(pure, nomem, nostack, preserves_flags));
        }
        x
    }
    #[cfg(not(target_arch = "bpf"))]
    x
}

/// 1 when `x` is not 0, else 0, without a branch (see [`opaque`]).
#[inline(always)]
pub fn nonzero(x: u64) -> u64 {
    opaque(x | x.wrapping_neg()) >> 63
}
