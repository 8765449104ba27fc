//! The programs' per-CPU working memory: what the kernel side parses into, beside the
//! global counters (`GLOBALS`). Apart from `datapath` (the records) and `parse` (the
//! parser), which both stand below it.

use crate::{
    datapath::{CpuGlobals, FlowKey, GlobalCounter},
    parse::{INNER_HEAD_LEN, Parsed},
};

/// The programs' working memory for one packet, written by every RoCE packet the fast
/// path does not count (too big for the 512-byte BPF stack once the compiler makes its
/// copies): the key, then the parsed headers, in three lines after the counters.
#[repr(C)]
pub struct Work {
    pub key: FlowKey,
    pub parsed: Parsed,
}

/// Working memory only a mirrored copy touches, after the working memory `Work`.
#[repr(C)]
pub struct Cold {
    /// The inner frame of a mirrored copy, copied out for parsing. Not last: the parser
    /// checks each header against the frame's length, but the verifier bounds some reads
    /// only by the buffer's start, and `_tail` after it keeps those inside the value.
    pub inner: [u8; INNER_HEAD_LEN],
    pub _tail: [u8; COLD_TAIL],
}

/// Bytes after the inner frame: at least the longest header the parser reads from it (an
/// IPv6 header), and enough to make a CPU's globals a whole number of cache lines.
const COLD_TAIL: usize = {
    let used = 16
        + 8 * crate::datapath::GLOBAL_COUNTERS_LEN as usize
        + 8 * crate::datapath::GLOBALS_PAD_WORDS
        + core::mem::size_of::<Work>()
        + INNER_HEAD_LEN;
    let min = used + 48;
    min.div_ceil(64) * 64 - used
};

/// A CPU's element of `GLOBALS` as the programs use it.
pub type Globals = CpuGlobals<Work, Cold>;

/// [`CpuGlobals`] as userspace reads it.
pub type CpuGlobalsBytes = CpuGlobals<[u8; core::mem::size_of::<Work>()], [u8; core::mem::size_of::<Cold>()]>;

const _: () = {
    assert!(core::mem::size_of::<Globals>() == core::mem::size_of::<CpuGlobalsBytes>());
    assert!(core::mem::offset_of!(Globals, counters) == core::mem::offset_of!(CpuGlobalsBytes, counters));
    // Whole lines: the array's elements (one per CPU) share none.
    assert!(core::mem::size_of::<Globals>().is_multiple_of(64));
    // What the fast path touches is the first line: the clock and the `RoceV2` counters
    // of both directions.
    assert!(core::mem::offset_of!(Globals, counters) + 8 * GlobalCounter::RoceV2.index(1) as usize + 8 <= 64);
    // The full path's working memory starts a line and takes three.
    assert!(core::mem::offset_of!(Globals, work).is_multiple_of(64));
    assert!(core::mem::size_of::<Work>() <= 192);
    // The slot marks are lines of their own: the reader reads them, the programs write
    // them once a slot.
    assert!(core::mem::offset_of!(Globals, occupied).is_multiple_of(64));
};

#[cfg(feature = "user")]
// SAFETY: repr(C) of u64s and bytes, its size a multiple of 8 (asserted equal to the
// kernel's type): no padding.
unsafe impl aya::Pod for CpuGlobalsBytes {}
