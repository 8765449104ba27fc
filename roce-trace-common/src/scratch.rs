//! The programs' per-CPU working memory: what the kernel side parses into, beside the
//! global counters (`GLOBALS`). Apart from `datapath` (the records) and `parse` (the
//! parser), which both stand below it.

use crate::{
    datapath::{CpuGlobals, FlowKey},
    parse::{INNER_HEAD_LEN, Parsed},
};

/// The programs' working memory for one packet (too big for the 512-byte BPF stack once
/// the compiler makes its copies).
#[repr(C)]
pub struct Work {
    pub parsed: Parsed,
    /// The inner frame of a mirrored copy, copied out for parsing. Not last: the parser
    /// checks each header against the frame's length, but the verifier bounds some reads
    /// only by the buffer's start, and `key` after it keeps those inside the value.
    pub inner: [u8; INNER_HEAD_LEN],
    pub key: FlowKey,
}

/// [`CpuGlobals`] as userspace reads it.
pub type CpuGlobalsBytes = CpuGlobals<[u8; core::mem::size_of::<Work>()]>;

const _: () = {
    assert!(core::mem::size_of::<CpuGlobals<Work>>() == core::mem::size_of::<CpuGlobalsBytes>());
    assert!(core::mem::offset_of!(CpuGlobals<Work>, counters) == 16);
};

#[cfg(feature = "user")]
// SAFETY: repr(C) of u64s and bytes, its size a multiple of 8 (asserted equal to the
// kernel's type): no padding.
unsafe impl aya::Pod for CpuGlobalsBytes {}
