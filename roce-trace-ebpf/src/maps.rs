//! Every map and global of the datapath, each with its purpose.

use aya_ebpf::{
    bindings::BPF_F_MMAPABLE,
    macros::map,
    maps::{Array, HashMap, LruHashMap, LruPerCpuHashMap, RingBuf},
};
use roce_trace_common::{datapath::*, scratch::Globals};

/// Load-time configuration (port, sampling, expected DSCPs), overridden by the loader.
#[unsafe(no_mangle)]
pub static CONFIG: LoadTime<DatapathConfig> = LoadTime(DatapathConfig::DEFAULT);

/// A global the loader overrides (`EbpfLoader::set_global`, in `.rodata`, frozen), read
/// in place through [`LoadTime::get`]: a plain read of an immutable static would be folded
/// to its initial value at compile time, and a volatile copy of a whole `DatapathConfig`
/// is eleven loads and as many stack stores on every packet.
#[repr(transparent)]
pub struct LoadTime<T>(T);

impl<T> LoadTime<T> {
    /// The value in place: each field is loaded where it is used, and only on the paths
    /// that use it. The pointer passes through an empty `asm!`, so the compiler cannot
    /// tell which static it points at and fold those loads to the initial value; the
    /// verifier still sees a pointer into the frozen map, whose values it knows.
    #[inline(always)]
    pub fn get(&self) -> &T {
        let mut p: *const T = &self.0;
        // SAFETY: an empty template (a comment): the register comes back as it went in,
        // nothing is read or written through it.
        #[expect(
            clippy::pointers_in_nomem_asm_block,
            reason = "the pointer is only passed through, never dereferenced in the asm"
        )]
        unsafe {
            core::arch::asm!("/* {0} */", inout(reg) p, options(pure, nomem, nostack))
        };
        // SAFETY: `p` is still `&self.0`.
        unsafe { &*p }
    }
}

/// The flow table every packet looks in first: one per CPU, direct-mapped by
/// [`FlowKey::slot`], so a lookup is an index and six word compares. A flow finds its slot
/// taken by another busy flow only by collision; it is then counted in `FLOWS`. CPU
/// `cpu`'s slot `i` is entry `i % SLOTS_PER_CHUNK` of element
/// `cpu << flow_chunk_bits(slot_bits) | i / SLOTS_PER_CHUNK`; the loader sizes it for the
/// possible CPUs. A plain array rather than a per-CPU one: its lookup is arithmetic on
/// immediates (a per-CPU array's loads the element's pointer from the map, a cache line
/// a packet). Mmapable, so the values start on a page (each slot on a cache line) and
/// userspace reads them in place.
#[map]
pub static FLOW_SLOTS: Array<FlowSlotChunk> =
    Array::with_max_entries(MAX_FLOW_SLOTS / SLOTS_PER_CHUNK, BPF_F_MMAPABLE);

/// Exact per-flow counters, per CPU, for flows without a slot on that CPU, and flows moved
/// out of an idle slot; LRU so a flood of new flows evicts idle ones.
#[map]
pub static FLOWS: LruPerCpuHashMap<FlowKey, FlowCounters> =
    LruPerCpuHashMap::with_max_entries(DEFAULT_MAX_FLOWS, 0);

/// The CPU that last saw each flow, and its first DSCP, shared by all CPUs: read only for
/// packets not in sequence on their CPU (see `FlowState`).
#[map]
pub static FLOW_OWNER: LruHashMap<FlowKey, FlowOwner> = LruHashMap::with_max_entries(DEFAULT_MAX_FLOWS, 0);

/// Mirror sessions by id (`FlowKey::mirror`), so userspace can name them. Touched only by
/// mirrored copies; the first session to claim an id keeps it.
#[map]
pub static MIRRORS: HashMap<u32, MirrorInfo> = HashMap::with_max_entries(MAX_MIRRORS, 0);

/// The address ranges mirrored copies are taken from (`DatapathConfig::mirror_from` of
/// them are set). Read only for mirrored copies.
#[map]
pub static MIRROR_FROM: Array<AddrPrefix> = Array::with_max_entries(MAX_MIRROR_FROM, 0);

/// Global counters and working memory, element `cpu` for each possible CPU (see
/// [`CpuGlobals`]; a plain array for the reason `FLOW_SLOTS` is one; sized by the loader).
#[map]
pub static GLOBALS: Array<Globals> = Array::with_max_entries(1, BPF_F_MMAPABLE);

/// The ring's producer position when a sample last woke a batching reader
/// (`DatapathConfig::wakeup_bytes`): shared by all CPUs, written once a batch.
#[map]
pub static SAMPLES_WOKEN_AT: Array<u64> = Array::with_max_entries(1, 0);

/// Sampled and anomalous packets to userspace.
#[map]
pub static SAMPLES: RingBuf = RingBuf::with_byte_size(SAMPLE_RING_BYTES, 0);
