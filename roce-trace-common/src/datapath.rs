//! Records that cross the kernel/user line: map keys and values, the sample event, the
//! load-time configuration and the global counter index. All `#[repr(C)]`, explicit
//! padding, sizes asserted at compile time.

/// Packets the program saw arriving (XDP).
pub const DIR_INGRESS: u8 = 0;
/// Packets the program saw leaving (TC egress).
pub const DIR_EGRESS: u8 = 1;
/// Direction of a mirror-session observation point (userspace only: the kernel keys a
/// mirrored copy by the hook that received it and by its mirror session).
pub const DIR_MIRROR: u8 = 2;

/// A `DIR_*`'s name in every output (JSON, labels, tables): `ingress`, `egress`, `mirror`.
pub const fn direction_name(d: u8) -> &'static str {
    match d {
        DIR_INGRESS => "ingress",
        DIR_MIRROR => "mirror",
        _ => "egress",
    }
}

/// How a mirrored copy reached us (`MirrorInfo::kind`); 0: it was not mirrored.
pub const MIRROR_NONE: u8 = 0;
/// Plain GRE carrying an Ethernet frame (0x6558) or an IP packet.
pub const MIRROR_GRE: u8 = 1;
/// ERSPAN type I: GRE protocol 0x88BE without a sequence number, no ERSPAN header.
pub const MIRROR_ERSPAN_I: u8 = 2;
pub const MIRROR_ERSPAN_II: u8 = 3;
pub const MIRROR_ERSPAN_III: u8 = 4;

/// Map and global names, shared so the loader and the programs cannot disagree.
pub const MAP_FLOWS: &str = "FLOWS";
pub const MAP_FLOW_OWNER: &str = "FLOW_OWNER";
pub const MAP_FLOW_SLOTS: &str = "FLOW_SLOTS";
pub const MAP_GLOBALS: &str = "GLOBALS";
pub const MAP_SAMPLES: &str = "SAMPLES";
pub const MAP_MIRRORS: &str = "MIRRORS";
pub const MAP_MIRROR_FROM: &str = "MIRROR_FROM";
pub const GLOBAL_CONFIG: &str = "CONFIG";
pub const PROG_XDP: &str = "roce_xdp";
pub const PROG_TC: &str = "roce_tc";
pub const PROG_TC_INGRESS: &str = "roce_tc_in";
/// Every program of the object, by name.
pub const PROGRAMS: [&str; 3] = [PROG_XDP, PROG_TC, PROG_TC_INGRESS];

pub const DEFAULT_MAX_FLOWS: u32 = 65_536;
/// Slots of the direct-mapped flow table per CPU (a power of two): a host's busy flows
/// fit many times over; a flow whose slot is taken is counted in `FLOWS`.
pub const MAX_FLOW_SLOTS: u32 = 2048;
/// Slots per element of `FLOW_SLOTS` (24 KiB): element `cpu << chunk_bits | chunk` is
/// CPU `cpu`'s chunk (see [`flow_chunk_bits`]).
pub const SLOTS_PER_CHUNK: u32 = 128;
/// Each CPU's element of `GLOBALS` (a plain array indexed by CPU, not a per-CPU map: its
/// lookup is arithmetic on immediates, where a per-CPU map's loads the element's pointer
/// from the map, one more cache line a packet). The first line is all a packet the
/// kernel's fast path counts in sequence and does not report touches: the coarse clock and
/// the global counters' first six (`RoceV2` of both directions among them); then the rest
/// of the counters, the working memory `W` (the flow key and the parsed headers, three
/// lines: every packet of the full path, and one the fast path parses whole to catch its
/// flow up or to report it), the cold working memory `C` (a mirrored copy's inner
/// frame), and the marks of the flow-table slots that have held a flow (four lines, read
/// by userspace each interval, written once a slot). Userspace reads `W` and `C` as bytes. A
/// multiple of 64 bytes, so no two CPUs share a line.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CpuGlobals<W, C> {
    /// `jiffies` when `coarse_ns` was read: the coarse clock is read once a tick per CPU.
    pub clock_jiffies: u64,
    pub coarse_ns: u64,
    /// Indexed by [`GlobalCounter::index`].
    pub counters: [u64; GLOBAL_COUNTERS_LEN as usize],
    /// So that `work` starts a line.
    pub _pad: [u64; GLOBALS_PAD_WORDS],
    pub work: W,
    pub cold: C,
    /// The slots of this CPU's flow table that have held a flow, a bit each (slot `i`: bit
    /// `i % 64` of word `i / 64`). Set by the programs before they hand an empty slot its
    /// first flow and never cleared (a slot is handed over, never emptied), so the reader
    /// visits these slots alone rather than a line of every slot of every CPU.
    pub occupied: [u64; OCCUPIED_WORDS],
}

/// Words of [`CpuGlobals::occupied`]: a bit for each slot a CPU's flow table can have.
pub const OCCUPIED_WORDS: usize = MAX_FLOW_SLOTS as usize / 64;

/// Words between the counters and the working memory of [`CpuGlobals`].
pub const GLOBALS_PAD_WORDS: usize = (64 - (16 + 8 * GLOBAL_COUNTERS_LEN as usize) % 64) % 64 / 8;

/// `log2` of the chunks of `FLOW_SLOTS` each CPU has with `1 << slot_bits` slots (at least
/// one chunk): CPU `cpu`'s chunk `c` is element `cpu << chunk_bits | c`.
#[inline(always)]
pub const fn flow_chunk_bits(slot_bits: u32) -> u32 {
    // `slot_bits.saturating_sub(7)` in arithmetic: every packet computes it. LLVM makes
    // this one select (BPF has no conditional move), which the verifier folds away with
    // the frozen configuration's `slot_bits`; `saturating_sub` was two branches the JIT
    // kept. 0 below 7, where the difference wraps to a negative i32 (`slot_bits` is at
    // most 32).
    let d = slot_bits.wrapping_sub(SLOTS_PER_CHUNK.trailing_zeros());
    d & !(((d as i32) >> 31) as u32)
}

/// Where CPU `cpu`'s slot `i` of a flow table of `1 << slot_bits` slots a CPU lives: the
/// element of `FLOW_SLOTS` (its chunk `i / SLOTS_PER_CHUNK`) and the entry in it. The one
/// placement the programs, the reader and the tests use.
#[inline(always)]
pub const fn slot_place(cpu: u32, i: u32, slot_bits: u32) -> (u32, u32) {
    (
        (cpu << flow_chunk_bits(slot_bits)) | (i / SLOTS_PER_CHUNK),
        i % SLOTS_PER_CHUNK,
    )
}

/// A chunk of the flow table: one element of `FLOW_SLOTS`.
pub type FlowSlotChunk = [FlowSlot; SLOTS_PER_CHUNK as usize];
/// A slot whose flow has been idle this long is handed to a new flow (its counters move to
/// `FLOWS`). Far longer than any reader's interval between reads.
pub const DEFAULT_SLOT_IDLE_MS: u32 = 30_000;
pub const SAMPLE_RING_BYTES: u32 = 4 << 20;
/// Capture drains the sample ring at least this often besides when the kernel wakes it
/// (with batched wake-ups, the longest a sample waits below a batch): on the interval's
/// tick when that comes as often (the default interval, 1 s, does), so an idle capture
/// wakes once a second; a longer interval gets a drain timer of its own.
pub const SAMPLE_DRAIN_MS: u64 = 1000;
/// The agent's drain period: it batches wake-ups too (a wake-up per sample is an IRQ-work
/// self-IPI, about 27 µs in a VM without posted interrupts: `bench datapath`, cold rows),
/// and delivers a sample at most this late.
pub const AGENT_SAMPLE_DRAIN_MS: u64 = 20;
/// [`DatapathConfig::wakeup_bytes`] of a reader that batches: about 480 samples.
pub const SAMPLE_BATCH_BYTES: u32 = 128 << 10;
/// A [`Sample`] in the ring: its 8-byte record header and the sample.
pub const RING_RECORD_BYTES: u32 = 8 + core::mem::size_of::<Sample>() as u32;
/// Mirror sessions the kernel remembers (`MIRRORS`): switches × sessions, far below this.
pub const MAX_MIRRORS: u32 = 1024;
/// Address ranges mirrored copies are taken from (`MIRROR_FROM`), at most.
pub const MAX_MIRROR_FROM: u32 = 8;

/// An address range in the datapath's form: address and mask as the words of a mapped
/// address ([`words_of_addr`]), so a match is four masked word compares whatever the
/// byte order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AddrPrefix {
    pub addr: [u32; 4],
    pub mask: [u32; 4],
}

impl AddrPrefix {
    /// `net/len` (IPv4 ranges as their IPv4-mapped IPv6 range).
    pub fn new(net: core::net::IpAddr, len: u8) -> Self {
        let (bytes, len) = match net {
            core::net::IpAddr::V4(a) => (a.to_ipv6_mapped().octets(), len.min(32) + 96),
            core::net::IpAddr::V6(a) => (a.octets(), len.min(128)),
        };
        let mut mask = [0u8; 16];
        for (i, m) in mask.iter_mut().enumerate() {
            let bits = (len as usize).saturating_sub(i * 8).min(8);
            *m = if bits == 0 { 0 } else { 0xffu8 << (8 - bits) };
        }
        let mut addr = bytes;
        for (a, m) in addr.iter_mut().zip(mask) {
            *a &= m;
        }
        Self {
            addr: words_of_addr(addr),
            mask: words_of_addr(mask),
        }
    }

    /// Whether `a` (the words of a mapped address, as [`MirrorInfo::src`]) is in range.
    #[inline(always)]
    pub fn contains(&self, a: &[u32; 4]) -> bool {
        a[0] & self.mask[0] == self.addr[0]
            && a[1] & self.mask[1] == self.addr[1]
            && a[2] & self.mask[2] == self.addr[2]
            && a[3] & self.mask[3] == self.addr[3]
    }
}

/// One RDMA QP direction as seen at one observation point: interface + direction, and for
/// a mirrored copy also the mirror session (as its [`MirrorInfo::id`]), so counters per
/// mirror session are exact. 48 bytes: every packet hashes it (`FLOWS`), so what only
/// mirrored copies need lives in `MIRRORS`, keyed by the id. Aligned to 8 so the kernel
/// can hash and compare it as six words ([`FlowKey::words`]).
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FlowKey {
    /// IPv6 address, or IPv4 mapped as `::ffff:a.b.c.d`.
    pub src: [u8; 16],
    pub dst: [u8; 16],
    pub ifindex: u32,
    pub dest_qp: u32,
    /// 0: not mirrored. Else the [`MirrorInfo::id`] of the mirror session the copy came
    /// through; the kernel's `MIRRORS` map (userspace: its mirror table) says which.
    pub mirror: u32,
    pub udp_sport: u16,
    pub direction: u8,
    /// 4 or 6.
    pub ip_version: u8,
}

impl FlowKey {
    /// The key as six words, for hashing and comparing in the kernel without byte loops.
    #[inline(always)]
    pub fn words(&self) -> &[u64; 6] {
        // SAFETY: repr(C, align(8)), 48 bytes without padding (asserted below): every
        // byte is initialised and the alignment is that of u64.
        unsafe { &*core::ptr::from_ref(self).cast::<[u64; 6]>() }
    }

    /// The key's words to write: any six words are a valid key (no padding, every field
    /// an integer or bytes).
    #[inline(always)]
    pub fn words_mut(&mut self) -> &mut [u64; 6] {
        // SAFETY: as in `words`; any bit pattern is a valid `FlowKey`.
        unsafe { &mut *core::ptr::from_mut(self).cast::<[u64; 6]>() }
    }

    /// The word holding two adjacent 32-bit fields, `first` at the lower address (the
    /// key's memory layout whatever the byte order).
    #[inline(always)]
    pub const fn word(first: u32, second: u32) -> u64 {
        if cfg!(target_endian = "little") {
            first as u64 | (second as u64) << 32
        } else {
            (first as u64) << 32 | second as u64
        }
    }

    /// Whether two keys are the same flow: six word compares (`==` on the byte arrays
    /// would be a `bcmp` call, which BPF has not).
    #[inline(always)]
    pub fn same(&self, other: &FlowKey) -> bool {
        self.same_words(other.words())
    }

    /// Whether this key's words are `b` ([`FlowKey::words`] of another key).
    #[inline(always)]
    pub fn same_words(&self, b: &[u64; 6]) -> bool {
        let a = self.words();
        (a[0] ^ b[0]) | (a[1] ^ b[1]) | (a[2] ^ b[2]) | (a[3] ^ b[3]) | (a[4] ^ b[4]) | (a[5] ^ b[5]) == 0
    }

    /// The key's slot in the direct-mapped flow table (`FLOW_SLOTS`) of `1 << bits`
    /// slots (`bits` < 32).
    #[inline(always)]
    pub fn slot(&self, bits: u32) -> u32 {
        Self::slot_of(self.words(), bits)
    }

    /// [`FlowKey::slot`] of the key whose words are `w`: the top `bits` bits of a
    /// multiplicative hash. The words are mixed independently (an IPv4 address or IPv6
    /// interface id each, the interface and QP, the port, direction and mirror session,
    /// the two IPv6 prefixes together), each by its own odd multiplier, then together. A
    /// product's top bits depend on every bit of its factor only through the factor's low
    /// bits, so each factor first folds its high half onto its low half (a bijection):
    /// without the fold, flows to consecutive hosts (an IPv4 address sits in a word's high
    /// half) used half the slots. Each word's multiplier fits an instruction's 32-bit
    /// immediate, and no word is rotated: the kernel's every packet computes this.
    #[inline(always)]
    pub fn slot_of(w: &[u64; 6], bits: u32) -> u32 {
        const K: u64 = 0x9E37_79B9_7F4A_7C15;
        let fold = |x: u64| x ^ (x >> 32);
        let x = fold(w[1]).wrapping_mul(0x1656_67B1)
            ^ fold(w[3]).wrapping_mul(0x61C8_8647)
            ^ fold(w[4]).wrapping_mul(0x5BD1_E995)
            ^ fold(w[5]).wrapping_mul(0x7FEB_352D)
            ^ fold(w[0] ^ w[2].rotate_left(32)).wrapping_mul(0x119D_E1F3);
        let h = fold(x).wrapping_mul(K);
        // In two steps, so that 0 bits is slot 0 without a shift by 64.
        ((h >> (63 - bits)) >> 1) as u32
    }
}

/// One entry of the kernel's direct-mapped flow table (`FLOW_SLOTS`, one table per CPU):
/// the flow that holds it and its counters on that CPU. Empty while
/// `counters.counts.packets` is 0. Three cache lines: the table starts on a page and each
/// slot on a line, so a packet's 128 hot bytes (key and state; the last packet's time and
/// class, packets, bytes, ECN) are two lines, never three.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowSlot {
    pub key: FlowKey,
    pub counters: FlowCounters,
}

/// A mirror session: the switch that mirrored a copy (its outer source), the session id
/// and the encapsulation. Written only for mirrored copies.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MirrorInfo {
    /// Outer source address, mapped like [`FlowKey::src`], its 16 bytes held as words in
    /// memory order (word copies stay inline in the kernel, byte arrays become calls). See
    /// [`MirrorInfo::addr`].
    pub src: [u32; 4],
    /// ERSPAN session id, or the GRE key of plain GRE (0 without one).
    pub session: u32,
    /// `MIRROR_*`.
    pub kind: u8,
    pub _pad: [u8; 3],
}

impl MirrorInfo {
    /// The switch's address bytes, mapped like [`FlowKey::src`].
    pub fn addr(&self) -> [u8; 16] {
        addr_of_words(self.src)
    }

    /// The session's id in [`FlowKey::mirror`]: a 32-bit hash of (outer source, session,
    /// kind), never 0. Two sessions sharing an id (about 1 in 2^31 for a pair) share their
    /// flows' counters; the kernel keeps the first one's info.
    #[inline(always)]
    pub fn id(&self) -> u32 {
        crate::sampling::mirror_hash(self.src, self.session, self.kind)
    }
}

/// 16 address bytes as four words in memory order, and back.
#[inline(always)]
pub fn words_of_addr(a: [u8; 16]) -> [u32; 4] {
    let w = |i: usize| u32::from_ne_bytes([a[i], a[i + 1], a[i + 2], a[i + 3]]);
    [w(0), w(4), w(8), w(12)]
}

/// The inverse of [`words_of_addr`].
pub fn addr_of_words(w: [u32; 4]) -> [u8; 16] {
    let mut a = [0u8; 16];
    for (i, x) in w.iter().enumerate() {
        a[4 * i..4 * i + 4].copy_from_slice(&x.to_ne_bytes());
    }
    a
}

/// The one counter set: a flow's exact counts at one point. The kernel keeps it in
/// [`FlowCounters`], the agent sends its changes (`CounterDelta`, the wire and JSON type),
/// capture prints it. A new counter is a field here (and its place in PROTOCOL.md):
/// adding, subtracting and the wire encoding iterate the fields through [`Counts::values`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Counts {
    pub packets: u64,
    pub bytes: u64,
    /// Indexed by ECN codepoint: Not-ECT, ECT(1), ECT(0), CE.
    pub ecn: [u64; 4],
    pub cnp: u64,
    pub ack: u64,
    pub nak_psn_seq_err: u64,
    pub nak_rnr: u64,
    pub nak_other: u64,
    /// Request packets whose PSN skipped ahead of the next expected one.
    pub psn_gaps: u64,
    /// Packets whose DSCP differs from the first DSCP seen on the flow.
    pub dscp_changed: u64,
}

impl Counts {
    /// How many u64 values the set holds ([`Counts::values`]).
    pub const LEN: usize = 13;

    /// The values in field order.
    #[inline(always)]
    pub fn values(&self) -> &[u64; Self::LEN] {
        // SAFETY: repr(C) of LEN u64 (an array of u64 among them), so no padding and the
        // layout of [u64; LEN] (size and alignment asserted below).
        unsafe { &*(self as *const Self as *const [u64; Self::LEN]) }
    }

    #[inline(always)]
    pub fn values_mut(&mut self) -> &mut [u64; Self::LEN] {
        // SAFETY: as in `values`.
        unsafe { &mut *(self as *mut Self as *mut [u64; Self::LEN]) }
    }

    /// The set holding `v` (in the order of [`Counts::values`]).
    pub fn from_values(v: [u64; Self::LEN]) -> Self {
        let mut c = Self::default();
        *c.values_mut() = v;
        c
    }

    /// Adds every value of `o`.
    #[inline(always)]
    pub fn add(&mut self, o: &Counts) {
        let o = o.values();
        // Saturating: counts from an agent are not trusted to be small.
        for (x, y) in self.values_mut().iter_mut().zip(o) {
            *x = x.saturating_add(*y);
        }
    }

    /// `self - before`, each value floored at 0.
    pub fn saturating_sub(&self, before: &Counts) -> Counts {
        let mut c = *self;
        for (x, y) in c.values_mut().iter_mut().zip(before.values()) {
            *x = x.saturating_sub(*y);
        }
        c
    }
}

/// Exact per-flow counters, one copy per CPU (summed in userspace). What every packet reads
/// or writes comes first, so that in a flow slot ([`FlowSlot`]) the key and the sequence
/// state fill the first 64 bytes and the last packet's time and class, packets, bytes and
/// ECN counts the next 64: a data packet in sequence touches those 128 bytes and no
/// others.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowCounters {
    /// The flow's PSN sequence and first DSCP as this CPU last left them (kernel
    /// bookkeeping, not a counter: merging per-CPU copies drops it).
    pub state: FlowState,
    /// Last packet, `CLOCK_MONOTONIC` to a scheduler tick (the kernel's coarse clock;
    /// samples carry precise times).
    pub last_ns: u64,
    pub last_dscp: u8,
    /// PCP of the outermost VLAN tag; [`PCP_NONE`] when untagged.
    pub last_pcp: u8,
    pub last_ttl: u8,
    pub _pad: [u8; 5],
    pub counts: Counts,
    /// First packet, as `last_ns`: written once, so after the counts, off the lines every
    /// packet writes.
    pub first_ns: u64,
}

pub const PCP_NONE: u8 = 0xff;

impl FlowCounters {
    /// Adds another copy of the same flow's counters (another CPU's, or one the kernel
    /// moved out of its flow table): sums, the earliest first and the latest last packet
    /// with its class. The kernel's PSN state is not a counter and is left as it is.
    #[inline(always)]
    pub fn absorb(&mut self, v: &FlowCounters) {
        if v.counts.packets == 0 {
            return;
        }
        self.counts.add(&v.counts);
        if self.first_ns == 0 || v.first_ns < self.first_ns {
            self.first_ns = v.first_ns;
        }
        if v.last_ns >= self.last_ns {
            self.last_ns = v.last_ns;
            self.last_dscp = v.last_dscp;
            self.last_pcp = v.last_pcp;
            self.last_ttl = v.last_ttl;
        }
    }
}

/// A flow's PSN sequence and first DSCP. The kernel keeps it in each CPU's copy of the
/// flow's counters, so a packet in sequence on the CPU its flow already runs on touches
/// nothing shared; a flow that moves CPU picks it up from the CPU it left (see
/// [`FlowOwner`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowState {
    pub next_psn: u32,
    /// The identity hash's state after the flow's constant fields
    /// (`sampling::identity_flow_state`; 0 when hash sampling is off): a packet's
    /// sampling decision then costs the finish (`sampling::identity_finish`), not the
    /// rounds over its addresses, ports and QP.
    pub sample_state: u32,
    pub first_dscp: u8,
    /// [`STATE_INIT`] | [`STATE_PSN_VALID`] | [`STATE_AFTER_READ`] | [`STATE_REPEAT`] |
    /// [`STATE_REPEAT_RESPONSE`].
    pub flags: u8,
    /// With [`STATE_REPEAT`]: the IPv4 TOS byte and the opcode of the flow's last plain
    /// request (`account::repeats`), or with [`STATE_REPEAT_RESPONSE`] too, of its last
    /// plain response (`account::repeats_response`).
    pub repeat: [u8; 2],
    /// With [`STATE_REPEAT`]: that packet's IPv4 total length and UDP length
    /// (`parse::PlainV4::lens`), so a packet like it is known to pass the same length
    /// checks without making them.
    pub repeat_lens: u32,
}
pub const STATE_PSN_VALID: u8 = 1;
/// The last request was a READ REQUEST: the next PSN may jump by the response count.
pub const STATE_AFTER_READ: u8 = 2;
/// The state holds the flow's first DSCP (it has seen the flow).
pub const STATE_INIT: u8 = 4;
/// The flow's last request was plain (`account::news`, `account::reasons`), not a READ
/// REQUEST, and `FlowState::repeat` holds its TOS and opcode: a request with the same
/// two and the expected PSN is plain as well, but for its sampling (`account::repeats`).
/// What the kernel's fast path remembers, not what the flow is: every test of the state
/// but that one leaves it out, and a request it does not take clears it.
pub const STATE_REPEAT: u8 = 8;
/// With [`STATE_REPEAT`]: what `FlowState::repeat` holds is the flow's last plain
/// *response* (an acknowledgement, a READ response), not a request: a response with the
/// same TOS, opcode and lengths, and no NAK, is plain but for its sampling, whatever its
/// PSN (`account::repeats_response`). A request it never matches. Cleared with
/// [`STATE_REPEAT`] by a request; like it, what the fast path remembers, not what the
/// flow is.
pub const STATE_REPEAT_RESPONSE: u8 = 16;
/// The flags that say what the fast path remembers ([`STATE_REPEAT`],
/// [`STATE_REPEAT_RESPONSE`]): every test of what the flow is leaves them out.
pub const STATE_REMEMBERED: u8 = STATE_REPEAT | STATE_REPEAT_RESPONSE;

/// Which CPU last saw a flow (shared by all CPUs; touched only when a packet is not in
/// sequence on its CPU: a new flow, a flow that moved CPU, a gap or a retransmission).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowOwner {
    pub cpu: u32,
    pub first_dscp: u8,
    pub _pad: [u8; 3],
}

/// Why a packet was emitted as a sample (bit set).
pub const REASON_HASH: u32 = 1;
pub const REASON_CNP: u32 = 1 << 1;
pub const REASON_CE: u32 = 1 << 2;
pub const REASON_NAK: u32 = 1 << 3;
pub const REASON_UNEXPECTED_DSCP: u32 = 1 << 4;

/// `Sample::present` bits: which optional fields hold a value.
pub const HAS_AETH: u8 = 1;
pub const HAS_RETH: u8 = 1 << 1;
pub const HAS_DETH: u8 = 1 << 2;
pub const HAS_ICRC: u8 = 1 << 3;
pub const HAS_PCP: u8 = 1 << 4;
/// Decapsulated from GRE/ERSPAN: `Sample::mirror` holds the session, the key its id.
pub const HAS_MIRROR: u8 = 1 << 5;

/// Leading frame bytes a sample carries (headers; whole small packets such as CNPs and
/// ACKs, whose ICRC userspace can then verify).
pub const SAMPLE_HEAD_LEN: usize = 128;

/// One sampled packet at one observation point, sent through the ring buffer.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample {
    /// `bpf_ktime_get_ns` (CLOCK_MONOTONIC) when the program ran.
    pub ts_ns: u64,
    pub key: FlowKey,
    pub psn: u32,
    pub frame_len: u32,
    pub reth_dma_len: u32,
    pub aeth_msn: u32,
    pub deth_src_qp: u32,
    /// ICRC as on the wire (little-endian CRC-32 bytes).
    pub icrc: [u8; 4],
    pub pkey: u16,
    pub udp_dport: u16,
    pub udp_len: u16,
    /// Bytes of `head` that hold frame data: `min(frame_len, SAMPLE_HEAD_LEN)`, or 0 when
    /// they could not be read.
    pub head_len: u16,
    /// Offset of the (inner, for mirrored copies) IP header in the frame.
    pub l3_off: u16,
    pub opcode: u8,
    /// BTH byte 1: SE, M, PadCnt, TVer.
    pub bth_flags: u8,
    /// BTH byte 4: FECN, BECN, reserved.
    pub bth_fecn_becn: u8,
    /// BTH byte 8: AckReq, reserved.
    pub bth_ack_req: u8,
    pub dscp: u8,
    pub ecn: u8,
    pub ttl: u8,
    pub pcp: u8,
    pub aeth_syndrome: u8,
    pub vlan_depth: u8,
    /// `HAS_*` bits.
    pub present: u8,
    pub _pad: [u8; 3],
    /// `REASON_*` bits.
    pub reasons: u32,
    /// The mirror session of a mirrored copy (`HAS_MIRROR`; zero otherwise), carried so a
    /// sample names its session by itself.
    pub mirror: MirrorInfo,
    pub _pad2: u32,
    /// The frame's first `head_len` bytes, as received (outer headers of a mirrored copy
    /// included).
    pub head: [u8; SAMPLE_HEAD_LEN],
}

impl Sample {
    /// The mirror session of a mirrored copy.
    pub fn mirror(&self) -> Option<MirrorInfo> {
        (self.present & HAS_MIRROR != 0).then_some(self.mirror)
    }
}

impl Default for Sample {
    fn default() -> Self {
        Self {
            ts_ns: 0,
            key: FlowKey::default(),
            psn: 0,
            frame_len: 0,
            reth_dma_len: 0,
            aeth_msn: 0,
            deth_src_qp: 0,
            icrc: [0; 4],
            pkey: 0,
            udp_dport: 0,
            udp_len: 0,
            head_len: 0,
            l3_off: 0,
            opcode: 0,
            bth_flags: 0,
            bth_fecn_becn: 0,
            bth_ack_req: 0,
            dscp: 0,
            ecn: 0,
            ttl: 0,
            pcp: 0,
            aeth_syndrome: 0,
            vlan_depth: 0,
            present: 0,
            _pad: [0; 3],
            reasons: 0,
            mirror: MirrorInfo::default(),
            _pad2: 0,
            head: [0; SAMPLE_HEAD_LEN],
        }
    }
}

/// Load-time configuration, set with `EbpfLoader::override_global(GLOBAL_CONFIG, …)`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DatapathConfig {
    pub udp_port: u16,
    /// Mirrored copies are taken only from the first this many ranges of `MIRROR_FROM`
    /// (0: from any source); others are counted (`mirror_refused`) and go no further.
    pub mirror_from: u16,
    pub seed: u32,
    /// Sampled when the identity hash is `<=` this (see `sampling::threshold_for_rate`).
    pub sample_threshold: u32,
    /// 0: hash sampling off (anomalies are still emitted).
    pub sample_enabled: u32,
    /// Bit `d` set: DSCP `d` is expected. 0: no expectation.
    pub expected_dscp_mask: u64,
    /// `sampling::v4_prefix_state(seed)`: the identity hash's state after the constant
    /// words of two IPv4-mapped addresses, so IPv4 packets skip those rounds.
    pub v4_prefix_state: u32,
    /// 0: wake the sample reader whenever it has caught up (the kernel's policy). Else wake
    /// it only when this many bytes wait (once, as a sample takes the fill past it): for a
    /// reader that does not need samples promptly and drains on a timer besides.
    pub wakeup_bytes: u32,
    /// `FLOW_SLOTS` has `1 << slot_bits` slots per CPU.
    pub slot_bits: u32,
    /// A slot idle this long goes to a new flow that hashes to it.
    pub slot_idle_ms: u32,
}

impl DatapathConfig {
    pub const DEFAULT: Self = Self::with(0, u32::MAX / 1000, 1, 0);

    /// A configuration with its derived field filled in.
    pub const fn with(
        seed: u32,
        sample_threshold: u32,
        sample_enabled: u32,
        expected_dscp_mask: u64,
    ) -> Self {
        Self {
            udp_port: crate::wire::ROCEV2_UDP_PORT,
            mirror_from: 0,
            seed,
            sample_threshold,
            sample_enabled,
            expected_dscp_mask,
            v4_prefix_state: crate::sampling::v4_prefix_state(seed),
            wakeup_bytes: 0,
            slot_bits: MAX_FLOW_SLOTS.trailing_zeros(),
            slot_idle_ms: DEFAULT_SLOT_IDLE_MS,
        }
    }
}

/// What a global counter counts, and so which lists it is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CounterKind {
    /// Every frame: the sum of the outcomes, not counted apart.
    AllFrames,
    /// An outcome: the frame is RoCEv2 and was parsed.
    Roce,
    /// An outcome: the frame is not RoCEv2.
    NotRoce,
    /// An outcome: the parser gave up on the frame before it knew it was RoCEv2.
    ParseFailure,
    /// An outcome: the frame is RoCEv2 (UDP to its port) but its RoCE headers could not
    /// be parsed. A parse failure too.
    RoceParseFailure,
    /// Counted for some frames beside their outcome.
    Event,
}

/// The one table of global counters: each counter's index (its `repr(u32)` value, dense
/// from 0 in table order), its stable snake_case name (JSON, metrics) and its
/// [`CounterKind`]. Generates [`GlobalCounter`], [`GlobalCounter::ALL`],
/// [`GlobalCounter::name`] and [`GlobalCounter::kind`]; every other list derives from them.
macro_rules! global_counters {
    ($($(#[$doc:meta])* $variant:ident = $value:literal => $name:literal, $kind:ident;)*) => {
        /// Global counters, one array per CPU (each CPU's element of `GLOBALS`), indexed
        /// by [`GlobalCounter::index`] — the two directions of a counter side by side, so
        /// the one every RoCE packet bumps (`RoceV2`, both directions) sits in one cache
        /// line (frames seen is the sum of the outcomes, not bumped).
        #[repr(u32)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum GlobalCounter {
            $($(#[$doc])* $variant = $value,)*
        }

        impl GlobalCounter {
            /// Every counter, in index order.
            pub const ALL: [GlobalCounter; [$(Self::$variant),*].len()] = [$(Self::$variant),*];

            /// Stable snake_case name used in JSON and metrics.
            pub const fn name(self) -> &'static str {
                match self {
                    $(Self::$variant => $name,)*
                }
            }

            pub const fn kind(self) -> CounterKind {
                match self {
                    $(Self::$variant => CounterKind::$kind,)*
                }
            }
        }
    };
}

global_counters! {
    FramesSeen = 0 => "frames_seen", AllFrames;
    RoceV2 = 1 => "rocev2", Roce;
    NonRoce = 2 => "non_roce", NotRoce;
    RoceV1 = 3 => "rocev1", NotRoce;
    TruncatedL2 = 4 => "truncated_l2", ParseFailure;
    VlanTooDeep = 5 => "vlan_too_deep", ParseFailure;
    TruncatedIp = 6 => "truncated_ip", ParseFailure;
    BadIpHeader = 7 => "bad_ip_header", ParseFailure;
    Fragment = 8 => "fragment", ParseFailure;
    Ipv6ExtTooDeep = 9 => "ipv6_ext_too_deep", ParseFailure;
    TruncatedUdp = 10 => "truncated_udp", ParseFailure;
    BadUdpLength = 11 => "bad_udp_length", ParseFailure;
    TruncatedBth = 12 => "truncated_bth", RoceParseFailure;
    TruncatedExtHeader = 13 => "truncated_ext_header", RoceParseFailure;
    IcrcUnreadable = 14 => "icrc_unreadable", Event;
    SamplesEmitted = 15 => "samples_emitted", Event;
    RingbufFull = 16 => "ringbuf_full", Event;
    FlowInsertFailed = 17 => "flow_insert_failed", Event;
    PsnRegressions = 18 => "psn_regressions", Event;
    /// A GRE or ERSPAN header (or its optional fields) runs past the frame.
    TruncatedEncap = 19 => "truncated_encap", ParseFailure;
    /// GRE version or routing, ERSPAN version or frame type we cannot decapsulate.
    BadEncap = 20 => "bad_encap", ParseFailure;
    /// RoCEv2 packets decapsulated from GRE/ERSPAN (mirrored copies), also in `RoceV2`.
    Mirrored = 21 => "mirrored", Event;
    /// TC frames whose headers were pulled into the skb's linear area (a write the kernel
    /// may pay a copy for): RoCEv2 and GRE candidates only, whose headers were not there.
    HeadersPulled = 22 => "headers_pulled", Event;
    /// Mirrored copies (GRE/ERSPAN) from a source outside the mirror ranges
    /// (`--mirror-from`): not decapsulated further, no session remembered, not counted
    /// as RoCEv2.
    MirrorRefused = 23 => "mirror_refused", NotRoce;
}

pub const GLOBAL_COUNTERS_PER_DIR: u32 = 32;
pub const GLOBAL_COUNTERS_LEN: u32 = GLOBAL_COUNTERS_PER_DIR * 2;
/// Bookkeeping in the last element of `CpuGlobals::counters`, past every
/// [`GlobalCounter`] (no counter's index reaches it; not reported): how many times this
/// CPU wrote a flow's copy into `FLOWS` (a new flow without a slot, or an idle flow moved
/// out of its slot), bumped before each write. While every CPU's is 0 `FLOWS` is empty,
/// and a reader skips its walk (the kernel visits every bucket to find none).
pub const FLOWS_WRITES: usize = GLOBAL_COUNTERS_LEN as usize - 1;

/// How many counters of [`GlobalCounter::ALL`] are outcomes.
const OUTCOMES_LEN: usize = {
    let (mut n, mut i) = (0, 0);
    while i < GlobalCounter::ALL.len() {
        if GlobalCounter::ALL[i].is_outcome() {
            n += 1;
        }
        i += 1;
    }
    n
};

impl GlobalCounter {
    /// What became of a frame: each frame the programs see is counted in exactly one of
    /// these (every reason the parser gives up, or RoCEv2), so `FramesSeen` is their sum
    /// and not counted apart. [`GlobalCounter::ALL`] filtered by [`Self::is_outcome`].
    pub const OUTCOMES: [GlobalCounter; OUTCOMES_LEN] = {
        let mut out = [Self::FramesSeen; OUTCOMES_LEN];
        let (mut n, mut i) = (0, 0);
        while i < Self::ALL.len() {
            if Self::ALL[i].is_outcome() {
                out[n] = Self::ALL[i];
                n += 1;
            }
            i += 1;
        }
        out
    };

    #[inline(always)]
    pub const fn index(self, direction: u8) -> u32 {
        self as u32 * 2 + direction as u32
    }

    /// One of [`Self::OUTCOMES`].
    pub const fn is_outcome(self) -> bool {
        !matches!(self.kind(), CounterKind::AllFrames | CounterKind::Event)
    }

    /// A frame that could not be parsed (as opposed to one that is simply not RoCEv2).
    pub const fn is_parse_failure(self) -> bool {
        matches!(
            self.kind(),
            CounterKind::ParseFailure | CounterKind::RoceParseFailure
        )
    }
}

const _: () = {
    assert!(core::mem::size_of::<FlowKey>() == 48);
    assert!(core::mem::size_of::<MirrorInfo>() == 24);
    assert!(core::mem::size_of::<Counts>() == core::mem::size_of::<[u64; Counts::LEN]>());
    assert!(core::mem::align_of::<Counts>() == core::mem::align_of::<[u64; Counts::LEN]>());
    assert!(core::mem::size_of::<FlowCounters>() == 144);
    assert!(core::mem::size_of::<FlowState>() == 16);
    assert!(core::mem::size_of::<FlowOwner>() == 8);
    assert!(core::mem::size_of::<Sample>() == 264);
    assert!(core::mem::offset_of!(Sample, head) == 136);
    assert!(core::mem::offset_of!(Sample, head) + SAMPLE_HEAD_LEN == core::mem::size_of::<Sample>());
    assert!(core::mem::size_of::<DatapathConfig>() == 40);
    assert!(core::mem::size_of::<FlowSlot>() == 192);
    // The hot part of a slot: key and state; then the last time and class, packets,
    // bytes and ECN.
    assert!(core::mem::offset_of!(FlowSlot, counters) + core::mem::offset_of!(FlowCounters, last_ns) == 64);
    assert!(
        core::mem::offset_of!(FlowSlot, counters)
            + core::mem::offset_of!(FlowCounters, counts)
            + core::mem::offset_of!(Counts, ecn)
            + core::mem::size_of::<[u64; 4]>()
            == 128
    );
    assert!(
        core::mem::offset_of!(FlowSlot, counters)
            + core::mem::offset_of!(FlowCounters, counts)
            + core::mem::offset_of!(Counts, cnp)
            == 128
    );
    assert!(MAX_FLOW_SLOTS.is_power_of_two() && SLOTS_PER_CHUNK.is_power_of_two());
    // The chunks' arithmetic is the saturating difference it stands for.
    let mut b = 0;
    while b <= 32 {
        assert!(flow_chunk_bits(b) == b.saturating_sub(SLOTS_PER_CHUNK.trailing_zeros()));
        b += 1;
    }
    assert!(MAX_FLOW_SLOTS.is_multiple_of(SLOTS_PER_CHUNK));
    // Each CPU's chunks start on a page (the map's values do).
    assert!(core::mem::size_of::<FlowSlotChunk>().is_multiple_of(4096));
    assert!((GlobalCounter::ALL.len() as u32) < GLOBAL_COUNTERS_PER_DIR);
    // FLOWS_WRITES is no counter's slot in either direction.
    assert!(GlobalCounter::ALL.len() * 2 <= FLOWS_WRITES);
    // The table's values are its order: `ALL[i]` is index `i`.
    let mut i = 0;
    while i < GlobalCounter::ALL.len() {
        assert!(GlobalCounter::ALL[i] as usize == i);
        i += 1;
    }
};

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY: all are #[repr(C)] plain integers and byte arrays with explicit padding,
    // so every bit pattern is valid and there are no implicit padding bytes.
    unsafe impl aya::Pod for FlowKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for MirrorInfo {}
    // SAFETY: as above.
    unsafe impl aya::Pod for FlowCounters {}
    // SAFETY: repr(C) of Pod fields and explicit padding (192 bytes asserted).
    unsafe impl aya::Pod for FlowSlot {}
    // SAFETY: as above.
    unsafe impl aya::Pod for FlowState {}
    // SAFETY: as above.
    unsafe impl aya::Pod for FlowOwner {}
    // SAFETY: as above.
    unsafe impl aya::Pod for Sample {}
    // SAFETY: as above.
    unsafe impl aya::Pod for DatapathConfig {}
    // SAFETY: as above.
    unsafe impl aya::Pod for AddrPrefix {}
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `values` is the fields in declaration order (the wire order), and adding and
    /// subtracting go through every one of them.
    #[test]
    fn the_counter_set_iterates_every_field_in_order() {
        let c = Counts {
            packets: 1,
            bytes: 2,
            ecn: [3, 4, 5, 6],
            cnp: 7,
            ack: 8,
            nak_psn_seq_err: 9,
            nak_rnr: 10,
            nak_other: 11,
            psn_gaps: 12,
            dscp_changed: 13,
        };
        assert_eq!(*c.values(), core::array::from_fn(|i| i as u64 + 1));
        assert_eq!(Counts::from_values(*c.values()), c);
        let mut twice = c;
        twice.add(&c);
        assert_eq!(*twice.values(), core::array::from_fn(|i| 2 * (i as u64 + 1)));
        assert_eq!(twice.saturating_sub(&c), c);
        assert_eq!(*c.saturating_sub(&twice).values(), [0; Counts::LEN]);
    }

    /// Counter names are distinct snake_case keys (JSON objects, metric labels).
    #[test]
    fn counter_names_are_distinct_snake_case() {
        for (i, a) in GlobalCounter::ALL.iter().enumerate() {
            let n = a.name();
            assert!(
                !n.is_empty()
                    && n.bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
            );
            assert!(GlobalCounter::ALL[..i].iter().all(|b| b.name() != n), "{n} twice");
        }
        // Outcomes are the table in its order, less the total and the events.
        let outcomes = GlobalCounter::ALL.iter().filter(|c| c.is_outcome());
        assert!(outcomes.eq(GlobalCounter::OUTCOMES.iter()));
        assert_eq!(GlobalCounter::FramesSeen.kind(), CounterKind::AllFrames);
    }

    /// A key's slot depends on every bit of it: flipping any one bit of a flow key (the
    /// direction, the high bits of the UDP source port, the IP version as well as the
    /// addresses) moves the flow to another slot, for this key and table size. With the
    /// hash's low half a flow's two directions shared a slot.
    #[test]
    fn every_bit_of_the_key_moves_the_slot() {
        let key = FlowKey {
            src: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 10, 1, 2],
            dst: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 10, 3, 2],
            ifindex: 7,
            dest_qp: 0x11,
            mirror: 0,
            udp_sport: 0xc001,
            direction: DIR_INGRESS,
            ip_version: 4,
        };
        let bits = MAX_FLOW_SLOTS.trailing_zeros();
        let slot = key.slot(bits);
        assert!(slot < MAX_FLOW_SLOTS);
        let (mut same, mut first) = (0, None);
        for word in 0..6 {
            for bit in 0..64 {
                let mut k = key;
                // SAFETY: FlowKey is 48 bytes of plain integers, aligned to 8.
                let w = unsafe { &mut *core::ptr::from_mut(&mut k).cast::<[u64; 6]>() };
                w[word] ^= 1 << bit;
                if k.slot(bits) == slot {
                    same += 1;
                    first = first.or(Some((word, bit)));
                }
            }
        }
        // 288 flips into 2048 slots: a chance match or two, not whole fields.
        assert!(same <= 2, "{same} flips keep the slot, the first {first:?}");
        let other_way = FlowKey {
            direction: DIR_EGRESS,
            ..key
        };
        assert_ne!(other_way.slot(bits), slot);
        assert_eq!(key.slot(0), 0, "one slot");
        assert!(key.slot(1) < 2);
    }

    /// Flows that differ the way a fabric's flows do (consecutive QPs, consecutive hosts,
    /// UDP source ports, interfaces and directions, host pairs, mirror sessions, IPv6
    /// hosts of one prefix) spread over the slots at least as well as random keys:
    /// 2,048 random keys in 2,048 slots fill about 1 − 1/e of them (1,295 ± 20), and no
    /// slot holds a pile.
    #[test]
    fn structured_flows_spread_like_random_keys() {
        let bits = MAX_FLOW_SLOTS.trailing_zeros();
        let n = MAX_FLOW_SLOTS;
        let v4 = |host: u32| {
            let mut a = [0u8; 16];
            a[10] = 0xff;
            a[11] = 0xff;
            a[12..].copy_from_slice(&(0x0a00_0000 | host).to_be_bytes());
            a
        };
        let base = FlowKey {
            src: v4(1),
            dst: v4(2),
            ifindex: 3,
            dest_qp: 0x100,
            mirror: 0,
            udp_sport: 0xc000,
            direction: DIR_EGRESS,
            ip_version: 4,
        };
        /// The `i`th flow of a kind, from a base key.
        type Flow = fn(FlowKey, u32) -> FlowKey;
        let sets: [(&str, Flow); 7] = [
            ("QPs", |k, i| FlowKey {
                dest_qp: 0x100 + i,
                ..k
            }),
            ("hosts", |k, i| {
                let mut dst = k.dst;
                dst[14..].copy_from_slice(&(i as u16).to_be_bytes());
                FlowKey { dst, ..k }
            }),
            ("ports", |k, i| FlowKey {
                udp_sport: 0xc000 + i as u16,
                ..k
            }),
            ("interfaces and directions", |k, i| FlowKey {
                ifindex: i / 2,
                direction: (i % 2) as u8,
                ..k
            }),
            ("host pairs", |k, i| {
                let (mut src, mut dst) = (k.src, k.dst);
                src[15] = (i % 64) as u8;
                dst[15] = (i / 64) as u8;
                FlowKey { src, dst, ..k }
            }),
            ("mirror sessions", |k, i| FlowKey {
                mirror: i.wrapping_mul(0x9E37_79B9) | 1,
                ..k
            }),
            ("IPv6 hosts", |k, i| {
                let mut src = [0u8; 16];
                src[..8].copy_from_slice(&0xfd00_0000_0000_0001u64.to_be_bytes());
                src[8..].copy_from_slice(&u64::from(i).to_be_bytes());
                FlowKey {
                    src,
                    ip_version: 6,
                    ..k
                }
            }),
        ];
        for (name, make) in sets {
            let mut per_slot = [0u32; MAX_FLOW_SLOTS as usize];
            for i in 0..n {
                per_slot[make(base, i).slot(bits) as usize] += 1;
            }
            let used = per_slot.iter().filter(|c| **c != 0).count();
            let deepest = per_slot.iter().max().copied().unwrap_or(0);
            assert!(
                used >= 1_220 && deepest <= 7,
                "{name}: {used} of {n} slots used, up to {deepest} flows in one"
            );
        }
    }
}
