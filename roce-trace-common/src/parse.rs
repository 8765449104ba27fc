//! The one RoCEv2 parser. It walks a frame with a cursor, bounds-checking each header
//! through [`Packet`], which the eBPF programs implement over packet memory (XDP and TC)
//! and userspace implements over byte slices (tests, pcap input). Everything is
//! `#[inline(always)]` so the kernel build is straight-line code the verifier accepts.

use crate::datapath::{
    FlowKey, GlobalCounter, HAS_AETH, HAS_DETH, HAS_ICRC, HAS_MIRROR, HAS_PCP, HAS_RETH, MIRROR_ERSPAN_I,
    MIRROR_ERSPAN_II, MIRROR_ERSPAN_III, MIRROR_GRE, MirrorInfo, PCP_NONE, SAMPLE_HEAD_LEN, Sample,
};
use crate::roce::{self, ext_layout};
use crate::wire::*;

/// At least two tags (QinQ); deeper stacks are counted as `VlanTooDeep`.
pub const MAX_VLAN_DEPTH: usize = 4;
/// IPv6 extension headers walked before giving up (`Ipv6ExtTooDeep`). NICs send none.
pub const MAX_IPV6_EXT: usize = 4;

/// Bounds-checked access to one frame's bytes.
pub trait Packet {
    /// A view of `T` at byte offset `off`, when the packet holds all of it.
    fn header<T: Header>(&self, off: usize) -> Option<&T>;
    /// The 4 bytes at `off`, which may lie past the part `header` can reach (TC/XDP
    /// fragments).
    fn load4(&self, off: usize) -> Option<[u8; 4]>;
    /// The 4 bytes `b` (inside a header `header` returned) as one native-endian word. The
    /// kernel's packets read it with one load: the compiler, which cannot know the
    /// alignment, would make it four byte loads and the shifts to join them.
    #[inline(always)]
    fn word(&self, b: &[u8; 4]) -> u32 {
        u32::from_ne_bytes(*b)
    }
    /// Whether the part of the packet `header` reaches holds `len` bytes (a test only:
    /// for headers that must be there and are not read).
    fn holds(&self, len: usize) -> bool;
    /// The outermost VLAN TCI when the NIC or stack removed the tag from packet data.
    fn offload_vlan_tci(&self) -> Option<u16>;
    /// The PCP of that tag, [`PCP_NONE`] without one.
    #[inline(always)]
    fn offload_pcp(&self) -> u8 {
        match self.offload_vlan_tci() {
            Some(tci) => pcp_of_tci(tci),
            None => PCP_NONE,
        }
    }
    /// Copies the frame's first `min(frame length, SAMPLE_HEAD_LEN)` bytes into `dst`;
    /// how many (0 when they could not be read). Only reported packets pay for it.
    fn load_head(&self, dst: &mut [u8; SAMPLE_HEAD_LEN]) -> u16;
    /// Copies `min(frame length - off, INNER_HEAD_LEN)` bytes from `off` into `dst`; how
    /// many (0 when none could be read).
    fn copy_out(&self, off: usize, dst: &mut [u8; INNER_HEAD_LEN]) -> usize;
}

/// Bytes of a mirrored copy's inner frame the parser looks at (Ethernet, tags, IP with
/// some extension headers, UDP, BTH, extended headers).
pub const INNER_HEAD_LEN: usize = 256;

/// The inner frame of a mirrored copy, copied out of the packet into a buffer of fixed
/// size. Parsing a copy keeps the verifier's work additive: the inner parse starts from the
/// same buffer whatever outer headers (tags, options, GRE fields) came before it.
pub struct InnerPacket<'a> {
    buf: &'a [u8; INNER_HEAD_LEN],
    len: usize,
}

impl<'a> InnerPacket<'a> {
    #[inline(always)]
    pub fn new(buf: &'a [u8; INNER_HEAD_LEN], len: usize) -> Self {
        Self { buf, len }
    }
}

impl Packet for InnerPacket<'_> {
    #[inline(always)]
    fn header<T: Header>(&self, off: usize) -> Option<&T> {
        // The first test bounds `off` within the buffer for the verifier; the second
        // within the bytes that were copied.
        if off > INNER_HEAD_LEN - T::LEN || off + T::LEN > self.len {
            return None;
        }
        // SAFETY: [off, off + LEN) lies inside `buf` (checked above); `Header` types are
        // alignment-1 byte structs valid for any bytes.
        Some(unsafe { &*(self.buf.as_ptr().add(off) as *const T) })
    }

    #[inline(always)]
    fn load4(&self, off: usize) -> Option<[u8; 4]> {
        self.header::<[u8; 4]>(off).copied()
    }

    #[inline(always)]
    fn holds(&self, len: usize) -> bool {
        len <= self.len.min(INNER_HEAD_LEN)
    }

    #[inline(always)]
    fn offload_vlan_tci(&self) -> Option<u16> {
        None
    }

    #[inline(always)]
    fn load_head(&self, dst: &mut [u8; SAMPLE_HEAD_LEN]) -> u16 {
        let n = if self.len < SAMPLE_HEAD_LEN {
            self.len
        } else {
            SAMPLE_HEAD_LEN
        };
        dst[..n].copy_from_slice(&self.buf[..n]);
        n as u16
    }

    #[inline(always)]
    fn copy_out(&self, off: usize, dst: &mut [u8; INNER_HEAD_LEN]) -> usize {
        let n = self.len.saturating_sub(off);
        dst[..n].copy_from_slice(&self.buf[off..off + n]);
        n
    }
}

/// The fields of one RoCEv2 packet that the datapath records. `repr(C)` with the
/// addresses first, so they sit word-aligned: the kernel build then writes and copies them
/// with word stores instead of calls to byte-loop `memset`/`memmove`.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Parsed {
    /// IPv6, or IPv4 mapped as `::ffff:a.b.c.d`.
    pub src: [u8; 16],
    pub dst: [u8; 16],
    pub ip_version: u8,
    pub dscp: u8,
    pub ecn: u8,
    /// TTL or hop limit.
    pub ttl: u8,
    /// PCP of the outermost tag (offloaded or in data), valid with `HAS_PCP`.
    pub pcp: u8,
    pub vlan_depth: u8,
    pub udp_sport: u16,
    pub udp_dport: u16,
    pub udp_len: u16,
    pub bth: Bth,
    /// Valid with `HAS_AETH`.
    pub aeth: Aeth,
    /// Valid with `HAS_RETH`.
    pub reth_dma_len: u32,
    /// Valid with `HAS_DETH`.
    pub deth_src_qp: u32,
    /// Valid with `HAS_ICRC`, after [`load_icrc`]. Located from the UDP length, never from
    /// the frame end (Ethernet padding).
    pub icrc: [u8; 4],
    /// Offset of the ICRC in the frame.
    pub icrc_off: u32,
    /// Offset of the IP header (the inner one of a mirrored copy).
    pub l3_off: u16,
    /// 0 unless mirrored; then `mirror_info.id()` (the flow key's `mirror`). The only
    /// mirror field an ordinary packet writes.
    pub mirror_id: u32,
    /// Valid with `HAS_MIRROR`: the outer source (mapped like `src`), the ERSPAN session id
    /// or GRE key, and `datapath::MIRROR_*`. Stale otherwise (not cleared per packet).
    pub mirror_info: MirrorInfo,
    /// `datapath::HAS_*` bits. Plain fields plus bits rather than `Option`s: writing a
    /// `None` leaves undefined bytes, which the verifier rejects.
    pub present: u8,
}

/// Why a frame is not a parsed RoCEv2 packet: the global counter it bumps.
pub type Skip = GlobalCounter;

impl Parsed {
    /// Sets both addresses from their 64-bit words in memory order, as two stores each:
    /// the flow key reads them back as the same words, and a load that spans two
    /// narrower stores just made cannot be forwarded from them (the CPU waits for the
    /// stores to reach the cache, on every packet).
    #[inline(always)]
    fn set_addrs(&mut self, src: [u64; 2], dst: [u64; 2]) {
        // SAFETY: `Parsed` is repr(C, align(8)) with `src` and `dst` at offsets 0 and 16
        // (asserted below), so both are valid, aligned `[u64; 2]` places; any bytes are
        // valid `u8`s.
        unsafe {
            core::ptr::from_mut(&mut self.src).cast::<[u64; 2]>().write(src);
            core::ptr::from_mut(&mut self.dst).cast::<[u64; 2]>().write(dst);
        }
    }

    /// The source address as two 64-bit words in memory order (as [`Parsed::set_addrs`]
    /// wrote them).
    #[inline(always)]
    pub fn src_dwords(&self) -> [u64; 2] {
        // SAFETY: `src` is at offset 0 of a repr(C) struct aligned to 8 (asserted
        // below): a valid, aligned `[u64; 2]` place; any bytes are valid `u64`s.
        unsafe { core::ptr::from_ref(&self.src).cast::<[u64; 2]>().read() }
    }

    /// The destination address, likewise.
    #[inline(always)]
    pub fn dst_dwords(&self) -> [u64; 2] {
        // SAFETY: `dst` is at offset 16, as above.
        unsafe { core::ptr::from_ref(&self.dst).cast::<[u64; 2]>().read() }
    }

    /// The source address as 32-bit words in memory order (each inside one of the
    /// stores [`Parsed::set_addrs`] made).
    #[inline(always)]
    pub fn src_words(&self) -> [u32; 4] {
        // SAFETY: `src` is at offset 0 of a repr(C) struct aligned to 8: a valid, aligned
        // `[u32; 4]` place; any bytes are valid `u32`s.
        unsafe { core::ptr::from_ref(&self.src).cast::<[u32; 4]>().read() }
    }

    /// The destination address, likewise.
    #[inline(always)]
    pub fn dst_words(&self) -> [u32; 4] {
        // SAFETY: `dst` is at offset 16, as above.
        unsafe { core::ptr::from_ref(&self.dst).cast::<[u32; 4]>().read() }
    }
}

const _: () = {
    assert!(core::mem::offset_of!(Parsed, src) == 0);
    assert!(core::mem::offset_of!(Parsed, dst) == 16);
    assert!(core::mem::align_of::<Parsed>() == 8);
};

/// An IPv4 address mapped as `::ffff:a.b.c.d`, as 64-bit words in memory order.
#[inline(always)]
fn mapped_v4(a: [u8; 4]) -> [u64; 2] {
    [0, u64::from_ne_bytes([0, 0, 0xff, 0xff, a[0], a[1], a[2], a[3]])]
}

/// [`mapped_v4`] of the address whose bytes are the native-endian word `w`.
#[inline(always)]
fn mapped_v4_word(w: u32) -> [u64; 2] {
    [0, FlowKey::word(u32::from_ne_bytes([0, 0, 0xff, 0xff]), w)]
}

/// 16 address bytes as two 64-bit words in memory order.
#[inline(always)]
fn dwords_of_addr(a: [u8; 16]) -> [u64; 2] {
    let w = |i: usize| {
        u64::from_ne_bytes([
            a[i],
            a[i + 1],
            a[i + 2],
            a[i + 3],
            a[i + 4],
            a[i + 5],
            a[i + 6],
            a[i + 7],
        ])
    };
    [w(0), w(8)]
}

/// Parses `p` into a new [`Parsed`], ICRC included (host use; the kernel uses
/// [`parse_into`]).
pub fn parse<P: Packet>(p: &P, udp_port: u16) -> Result<Parsed, Skip> {
    let mut out = Parsed::default();
    let mut inner = [0u8; INNER_HEAD_LEN];
    parse_into(p, udp_port, &mut out, &mut inner)?;
    load_icrc(p, &mut out);
    Ok(out)
}

/// Reads the ICRC of a parsed packet. Kept apart from [`parse_into`]: the ICRC sits at
/// the far end of the packet, a cache line nothing else touches, so the kernel reads it
/// only for the packets it reports.
#[inline(always)]
pub fn load_icrc<P: Packet>(p: &P, out: &mut Parsed) {
    if let Some(icrc) = p.load4(out.icrc_off as usize) {
        out.icrc = icrc;
        out.present |= HAS_ICRC;
    }
}

/// Parses `p` as Ethernet → VLANs → IPv4/IPv6 → UDP(`udp_port`) → BTH → extended headers,
/// writing into `out` (in the kernel a per-CPU scratch slot: the BPF stack is 512 bytes).
/// A mirrored copy — IP → GRE (plain, ERSPAN I/II/III) → Ethernet or IP — is
/// decapsulated once: its inner frame is copied into `inner` and parsed there, and the
/// outer source and the session are recorded (`HAS_MIRROR`, `mirror_info`, `mirror_id`).
/// On error `out` holds a partial parse and must not be used.
#[inline(always)]
pub fn parse_into<P: Packet>(
    p: &P,
    udp_port: u16,
    out: &mut Parsed,
    inner: &mut [u8; INNER_HEAD_LEN],
) -> Result<(), Skip> {
    out.present = 0;
    if let Some(tci) = p.offload_vlan_tci() {
        out.pcp = pcp_of_tci(tci);
        out.present |= HAS_PCP;
    }
    let (ether_type, off) = parse_l2(p, 0, out)?;
    let (proto, off, l4_len) = parse_ip(p, ether_type, off, out)?;
    if proto == IPPROTO_GRE {
        out.mirror_info.src = out.src_words();
        out.mirror_info._pad = [0; 3];
        let (inner_type, inner_off) = parse_mirror(p, off, l4_len, out)?;
        out.mirror_id = out.mirror_info.id();
        // The class that matters is the mirrored packet's: the outer tags belong to the
        // mirror's transport.
        out.present = HAS_MIRROR;
        let n = p.copy_out(inner_off, inner);
        let q = InnerPacket::new(inner, n);
        let (et, off) = if inner_type == GRE_PROTO_TEB {
            parse_l2(&q, 0, out)?
        } else {
            out.vlan_depth = 0;
            (inner_type, 0)
        };
        let (proto, off, l4_len) = parse_ip(&q, et, off, out)?;
        if proto != IPPROTO_UDP {
            return Err(Skip::NonRoce);
        }
        out.l3_off += inner_off as u16;
        return parse_roce(&q, off, l4_len, udp_port, inner_off, out);
    }
    // One store: the mirror session itself is written only for mirrored copies.
    out.mirror_id = 0;
    parse_roce(p, off, l4_len, udp_port, 0, out)
}

/// What the datapath's first test on every frame, before it touches a map, makes of it
/// from its first headers with loads and compares alone ([`first_look`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Look {
    /// Surely neither RoCEv2 nor a mirrored copy: exactly the frames [`parse_into`] gives
    /// up on as [`Skip::NonRoce`] at their first look — an EtherType that is neither IP, a
    /// tag nor RoCEv1 (after up to [`MAX_VLAN_DEPTH`] tags); IPv4 without options or IPv6
    /// without extension headers carrying neither UDP nor GRE; UDP to another port. The
    /// kernel counts none of them (the interface's own counters have them).
    NotRoce,
    /// The common shape, checked up to the UDP port: untagged IPv4 without options, not a
    /// fragment, a total length that holds its header, UDP to the RoCEv2 port.
    /// [`parse_plain_v4_into`] takes it from there without walking it again.
    PlainV4,
    /// Anything else (tags, IPv6, options, GRE, short or malformed headers): the parser
    /// walks it and counts what it finds.
    Other,
}

/// Whether `p` is surely neither RoCEv2 nor a mirrored copy ([`Look::NotRoce`]).
#[inline(always)]
pub fn surely_not_roce<P: Packet>(p: &P, udp_port: u16) -> bool {
    first_look(p, udp_port) == Look::NotRoce
}

/// The first look at `p` (see [`Look`]).
#[inline(always)]
pub fn first_look<P: Packet>(p: &P, udp_port: u16) -> Look {
    let Some(eth) = p.header::<EthHdr>(0) else {
        return Look::Other;
    };
    let mut ether_type = eth.ether_type();
    // Untagged IPv4, most frames, goes straight on: no tag tests, and RoCE there is plain.
    if ether_type == ETH_P_IPV4 {
        return look_v4(p, EthHdr::LEN, udp_port, Look::PlainV4);
    }
    let mut off = EthHdr::LEN;
    for _ in 0..MAX_VLAN_DEPTH {
        if ether_type != ETH_P_8021Q && ether_type != ETH_P_8021AD {
            break;
        }
        let Some(tag) = p.header::<VlanHdr>(off) else {
            return Look::Other;
        };
        ether_type = tag.ether_type();
        off += VlanHdr::LEN;
    }
    let udp_off = match ether_type {
        ETH_P_IPV4 => return look_v4(p, off, udp_port, Look::Other),
        ETH_P_IPV6 => {
            let Some(ip) = p.header::<Ipv6Hdr>(off) else {
                return Look::Other;
            };
            if ip.version() != 6 {
                return Look::Other;
            }
            match ip.next_hdr {
                IPPROTO_UDP => off + Ipv6Hdr::LEN,
                IPPROTO_GRE | IPV6_EXT_HOP_BY_HOP | IPV6_EXT_ROUTING | IPV6_EXT_FRAGMENT | IPV6_EXT_AUTH
                | IPV6_EXT_DEST_OPTS => return Look::Other,
                _ => return Look::NotRoce,
            }
        }
        ETH_P_8021Q | ETH_P_8021AD | ETH_P_ROCEV1 => return Look::Other,
        _ => return Look::NotRoce,
    };
    look_udp(p, udp_off, udp_port, Look::Other)
}

/// [`first_look`] from an IPv4 header at `off`; `roce`: what RoCEv2 there is.
#[inline(always)]
fn look_v4<P: Packet>(p: &P, off: usize, udp_port: u16, roce: Look) -> Look {
    let Some(ip) = p.header::<Ipv4Hdr>(off) else {
        return Look::Other;
    };
    // Version 4 without options, a total length that holds the header: else the parser
    // has a failure to count.
    if ip.version_ihl != 0x45 || (ip.tot_len() as usize) < Ipv4Hdr::LEN {
        return Look::Other;
    }
    if ip.protocol != IPPROTO_UDP {
        return if ip.protocol == IPPROTO_GRE {
            Look::Other
        } else {
            Look::NotRoce
        };
    }
    if ip.is_fragment() {
        return Look::Other;
    }
    look_udp(p, off + Ipv4Hdr::LEN, udp_port, roce)
}

/// [`first_look`] from a UDP header at `udp_off`; `roce`: what RoCEv2 there is.
#[inline(always)]
fn look_udp<P: Packet>(p: &P, udp_off: usize, udp_port: u16, roce: Look) -> Look {
    match p.header::<UdpHdr>(udp_off) {
        Some(udp) if udp.dst_port() != udp_port => Look::NotRoce,
        Some(_) => roce,
        None => Look::Other,
    }
}

/// What accounting (`account`) reads of one packet: from [`Parsed`] ([`Facts::of`]), or
/// straight from a plain packet's headers ([`plain_v4`]), so both count alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Facts {
    pub opcode: u8,
    pub psn: u32,
    pub dscp: u8,
    pub ecn: u8,
    pub ttl: u8,
    /// The outermost PCP, [`PCP_NONE`](crate::datapath::PCP_NONE) without a tag.
    pub pcp: u8,
    /// The AETH syndrome of an acknowledgement opcode (ACK, ATOMIC ACK: [`Facts::ack`]),
    /// 0 for any other opcode (a read response's AETH acknowledges nothing). A number, not
    /// an `Option`, so that tests of it need no branch (`account::reasons`).
    pub syndrome: u8,
}

impl Facts {
    /// The acknowledgement an acknowledgement opcode carries.
    #[inline(always)]
    pub fn ack(&self) -> Option<roce::AckKind> {
        if roce::is_ack_opcode(self.opcode) {
            Some(roce::ack_kind(self.syndrome))
        } else {
            None
        }
    }

    #[inline(always)]
    pub fn of(p: &Parsed) -> Self {
        Self {
            opcode: p.bth.opcode,
            psn: p.bth.psn(),
            dscp: p.dscp,
            ecn: p.ecn,
            ttl: p.ttl,
            pcp: if p.present & HAS_PCP != 0 { p.pcp } else { PCP_NONE },
            syndrome: if p.ack_kind().is_some() {
                p.aeth.syndrome
            } else {
                0
            },
        }
    }
}

/// What the kernel's fast path reads of a plain IPv4 RoCEv2 packet ([`plain_v4`]): the
/// flow key's fields and what accounting reads ([`Facts`]), in registers rather than
/// written out as a [`Parsed`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlainV4 {
    pub key: PlainV4Key,
    pub facts: Facts,
    /// The IPv4 total length (low half) and the UDP length (high half): with the opcode,
    /// all that [`plain_v4_checks`] tests of a frame that holds
    /// [`PLAIN_V4_REQUEST_LEN`] bytes.
    pub lens: u32,
}

/// The flow key's fields of a plain IPv4 RoCEv2 packet ([`PlainV4`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlainV4Key {
    /// The addresses mapped as `::ffff:a.b.c.d`, two words each in memory order (as
    /// [`Parsed::src_dwords`] reads them).
    pub src: [u64; 2],
    pub dst: [u64; 2],
    pub udp_sport: u16,
    pub dest_qp: u32,
}

/// The headers of a plain IPv4 RoCEv2 frame as [`plain_v4_headers`] finds them: Ethernet,
/// IPv4 without options, UDP and the BTH (its first word, then the QP's and the PSN's
/// words), in place behind one bounds test. Read apart, [`PlainV4Headers::key`] and
/// [`PlainV4Headers::facts`], so that the kernel reads the facts after the calls that find
/// the flow's slot rather than holding them across (on the stack).
#[repr(C)]
pub struct PlainV4Headers {
    eth: EthHdr,
    ip: Ipv4Hdr,
    udp: UdpHdr,
    /// The BTH's first word: the opcode first.
    bth_head: [u8; 4],
    /// The QP is its low 24 bits.
    qp_word: [u8; 4],
    /// The PSN is its low 24 bits.
    psn_word: [u8; 4],
}
// SAFETY: only byte structs and byte arrays.
unsafe impl Header for PlainV4Headers {}
const _: () = assert!(PlainV4Headers::LEN == EthHdr::LEN + Ipv4Hdr::LEN + UdpHdr::LEN + Bth::LEN);

impl PlainV4Headers {
    /// The flow key's fields.
    #[inline(always)]
    pub fn key<P: Packet>(&self, p: &P) -> PlainV4Key {
        PlainV4Key {
            src: mapped_v4_word(p.word(&self.ip.src)),
            dst: mapped_v4_word(p.word(&self.ip.dst)),
            udp_sport: self.udp.src_port(),
            dest_qp: u32::from_be(p.word(&self.qp_word)) & roce::QPN_MASK,
        }
    }

    /// What accounting reads, the syndrome 0 ([`plain_v4_checks`] has an
    /// acknowledgement's).
    #[inline(always)]
    pub fn facts<P: Packet>(&self, p: &P) -> Facts {
        Facts {
            opcode: self.bth_head[0],
            psn: u32::from_be(p.word(&self.psn_word)) & roce::PSN_MASK,
            dscp: self.ip.tos >> 2,
            ecn: self.ip.tos & 0x3,
            ttl: self.ip.ttl,
            pcp: p.offload_pcp(),
            syndrome: 0,
        }
    }

    /// [`PlainV4::lens`].
    #[inline(always)]
    pub fn lens(&self) -> u32 {
        self.ip.tot_len() as u32 | (self.udp.length() as u32) << 16
    }
}

/// Where a plain IPv4 frame's extended headers start: right after its BTH.
const PLAIN_V4_EXT_OFF: usize = PlainV4Headers::LEN;

/// The most bytes after the BTH that any request opcode's extended headers the parser
/// reads take ([`roce::ext_end`] over the requests): a plain IPv4 frame that holds
/// [`PLAIN_V4_EXT_OFF`] + this many bytes holds the extended headers of whatever request
/// it carries, and its [`plain_v4_checks`] then depend on its [`PlainV4::lens`] and opcode
/// alone.
pub const REQUEST_EXT_END: usize = {
    let mut max = 0;
    let mut o = 0;
    while o < 256 {
        if roce::is_request(o as u8) && roce::ext_end(o as u8) > max {
            max = roce::ext_end(o as u8);
        }
        o += 1;
    }
    max
};

/// The bytes a plain IPv4 frame must hold for [`REQUEST_EXT_END`].
pub const PLAIN_V4_REQUEST_LEN: usize = PLAIN_V4_EXT_OFF + REQUEST_EXT_END;

/// A frame [`first_look`] called [`Look::PlainV4`], read for the kernel's fast path: `Some`
/// only when [`parse_plain_v4_into`] would parse it (`Ok`), and then with the same
/// addresses, port, QP and [`Facts`] (`Facts::of` the `Parsed`); `None` for every frame
/// the parser would refuse or count as a failure, which the full path then counts. Reads
/// the headers in place and writes nothing. What `first_look` established it does not
/// test again: the UDP port (so it takes none), the IPv4 header's version and length.
/// [`plain_v4_fields`], then [`plain_v4_checks`].
#[inline(always)]
pub fn plain_v4<P: Packet>(p: &P) -> Option<PlainV4> {
    let mut q = plain_v4_fields(p)?;
    q.facts.syndrome = plain_v4_checks(p, q.facts.opcode, q.lens)?;
    Some(q)
}

/// The headers [`plain_v4`] reads, behind one bounds test (the BTH's end) and none of its
/// checks.
#[inline(always)]
pub fn plain_v4_headers<P: Packet>(p: &P) -> Option<&PlainV4Headers> {
    p.header(0)
}

/// What [`plain_v4`] reads, behind one bounds test (the BTH's end) and none of its
/// checks, the syndrome 0: the same as `plain_v4`'s when that is `Some`. The kernel's fast
/// path reads the same from [`plain_v4_headers`] first; a request like its flow's last plain one
/// (the same opcode and [`PlainV4::lens`]) in a frame that holds [`PLAIN_V4_REQUEST_LEN`]
/// bytes passes the checks that one passed and has no syndrome, so it is counted without
/// them (`account::repeats`); any other packet goes through [`plain_v4_checks`].
#[inline(always)]
pub fn plain_v4_fields<P: Packet>(p: &P) -> Option<PlainV4> {
    let h = plain_v4_headers(p)?;
    Some(PlainV4 {
        key: h.key(p),
        facts: h.facts(p),
        lens: h.lens(),
    })
}

/// [`plain_v4`]'s checks of a frame [`plain_v4_fields`] read, of `opcode` and `lens`
/// ([`PlainV4::lens`]): `parse_roce`'s (the port is first_look's) on the lengths and the
/// opcode, and that the frame holds the extended headers the parser reads. The syndrome
/// when they pass: an acknowledgement opcode's (its AETH is there: `ext_end` covers it), 0
/// for any other opcode.
#[inline(always)]
pub fn plain_v4_checks<P: Packet>(p: &P, opcode: u8, lens: u32) -> Option<u8> {
    if !plain_v4_lengths(opcode, lens) {
        return None;
    }
    plain_v4_syndrome(p, opcode)
}

/// The first half of [`plain_v4_checks`], on the lengths and the opcode alone: the UDP
/// length holds the BTH, the opcode's fixed extended bytes and the ICRC, and fits the IP
/// payload.
#[inline(always)]
pub fn plain_v4_lengths(opcode: u8, lens: u32) -> bool {
    // first_look saw a total length that holds the header.
    let l4_len = ((lens & 0xffff) as usize).wrapping_sub(Ipv4Hdr::LEN);
    let udp_len = (lens >> 16) as usize;
    // (So at least the BTH and the ICRC: parse_roce's first test.)
    let min_len = ext_layout(opcode).min_len as usize;
    UdpHdr::LEN + Bth::LEN + min_len + ICRC_LEN <= udp_len && udp_len <= l4_len
}

/// The second half of [`plain_v4_checks`], the one that reads the frame: that it holds
/// the extended headers the parser reads for `opcode` (none of them is read here but an
/// acknowledgement's AETH), and the syndrome (an acknowledgement opcode's, 0 for any
/// other). A frame whose lengths and opcode passed the first half before passes it
/// again, so a response like its flow's last plain one is checked by this alone
/// (`account::repeats_response`).
#[inline(always)]
pub fn plain_v4_syndrome<P: Packet>(p: &P, opcode: u8) -> Option<u8> {
    // The extended headers the parser reads, in one test.
    if !p.holds(PLAIN_V4_EXT_OFF + roce::ext_end(opcode)) {
        return None;
    }
    // Read whatever the opcode where the frame holds the bytes, and masked, so a data
    // packet does not jump over an acknowledgement's code.
    let ack = 0u8.wrapping_sub(roce::is_ack_opcode(opcode) as u8);
    Some(
        match p.header::<Aeth>(PLAIN_V4_EXT_OFF + roce::ACK_AETH_AT as usize) {
            Some(aeth) => aeth.syndrome & ack,
            None => 0,
        },
    )
}

/// [`parse_into`] of a frame [`first_look`] called [`Look::PlainV4`], without walking
/// its Ethernet and IPv4 headers again: the same `Parsed`, the same errors.
#[inline(always)]
pub fn parse_plain_v4_into<P: Packet>(p: &P, udp_port: u16, out: &mut Parsed) -> Result<(), Skip> {
    out.present = 0;
    if let Some(tci) = p.offload_vlan_tci() {
        out.pcp = pcp_of_tci(tci);
        out.present |= HAS_PCP;
    }
    out.vlan_depth = 0;
    let off = EthHdr::LEN;
    out.l3_off = off as u16;
    let ip: &Ipv4Hdr = p.header(off).ok_or(Skip::TruncatedIp)?;
    out.ip_version = 4;
    out.set_addrs(mapped_v4(ip.src), mapped_v4(ip.dst));
    out.ttl = ip.ttl;
    out.dscp = ip.tos >> 2;
    out.ecn = ip.tos & 0x3;
    let l4_len = (ip.tot_len() as usize).saturating_sub(Ipv4Hdr::LEN);
    out.mirror_id = 0;
    parse_roce(p, off + Ipv4Hdr::LEN, l4_len, udp_port, 0, out)
}

/// UDP(`udp_port`) at `off` of an IP payload of `l4_len` bytes, the BTH and extended
/// headers. `base`: where `p` starts in the frame (a mirrored copy's inner frame), so the
/// ICRC offset is the frame's.
#[inline(always)]
fn parse_roce<P: Packet>(
    p: &P,
    off: usize,
    l4_len: usize,
    udp_port: u16,
    base: usize,
    out: &mut Parsed,
) -> Result<(), Skip> {
    let mut off = off;
    let udp: &UdpHdr = p.header(off).ok_or(Skip::TruncatedUdp)?;
    let udp_dport = udp.dst_port();
    if udp_dport != udp_port {
        return Err(Skip::NonRoce);
    }
    let udp_len = udp.length();
    let udp_off = off;
    // A RoCEv2 datagram holds at least a BTH and an ICRC, and fits its IP payload.
    if (udp_len as usize) < UdpHdr::LEN + Bth::LEN + ICRC_LEN || udp_len as usize > l4_len {
        return Err(Skip::BadUdpLength);
    }
    off += UdpHdr::LEN;

    let bth: &Bth = p.header(off).ok_or(Skip::TruncatedBth)?;
    // Field by field: a whole-struct copy from packet memory becomes a `memmove` call.
    out.bth = Bth {
        opcode: bth.opcode,
        flags: bth.flags,
        pkey: [bth.pkey[0], bth.pkey[1]],
        fecn_becn: bth.fecn_becn,
        dest_qp: [bth.dest_qp[0], bth.dest_qp[1], bth.dest_qp[2]],
        ack_req: bth.ack_req,
        psn: [bth.psn[0], bth.psn[1], bth.psn[2]],
    };
    off += Bth::LEN;

    let layout = ext_layout(out.bth.opcode);
    if UdpHdr::LEN + Bth::LEN + layout.min_len as usize + ICRC_LEN > udp_len as usize {
        return Err(Skip::TruncatedExtHeader);
    }
    if let Some(at) = layout.aeth {
        out.aeth = *p
            .header::<Aeth>(off + at as usize)
            .ok_or(Skip::TruncatedExtHeader)?;
        out.present |= HAS_AETH;
    }
    if let Some(at) = layout.reth {
        out.reth_dma_len = p
            .header::<Reth>(off + at as usize)
            .ok_or(Skip::TruncatedExtHeader)?
            .dma_len();
        out.present |= HAS_RETH;
    }
    if let Some(at) = layout.deth {
        out.deth_src_qp = p
            .header::<Deth>(off + at as usize)
            .ok_or(Skip::TruncatedExtHeader)?
            .src_qp();
        out.present |= HAS_DETH;
    }
    out.icrc_off = (base + udp_off + udp_len as usize - ICRC_LEN) as u32;
    out.udp_sport = udp.src_port();
    out.udp_dport = udp_dport;
    out.udp_len = udp_len;
    Ok(())
}

/// Ethernet and its VLAN tags from `off`: the EtherType after the tags and where the L3
/// header starts. The first tag seen gives the PCP unless one is already known.
#[inline(always)]
fn parse_l2<P: Packet>(p: &P, off: usize, out: &mut Parsed) -> Result<(u16, usize), Skip> {
    let eth: &EthHdr = p.header(off).ok_or(Skip::TruncatedL2)?;
    let mut ether_type = eth.ether_type();
    let mut off = off + EthHdr::LEN;
    out.vlan_depth = 0;
    for _ in 0..MAX_VLAN_DEPTH {
        if ether_type != ETH_P_8021Q && ether_type != ETH_P_8021AD {
            break;
        }
        let tag: &VlanHdr = p.header(off).ok_or(Skip::TruncatedL2)?;
        if out.present & HAS_PCP == 0 {
            out.pcp = tag.pcp();
            out.present |= HAS_PCP;
        }
        ether_type = tag.ether_type();
        off += VlanHdr::LEN;
        out.vlan_depth += 1;
    }
    if ether_type == ETH_P_8021Q || ether_type == ETH_P_8021AD {
        return Err(Skip::VlanTooDeep);
    }
    Ok((ether_type, off))
}

/// The IP header at `off` (`ether_type` says which): addresses, class and TTL into `out`;
/// returns the payload's protocol (UDP or GRE; anything else is not ours), where it
/// starts and how long it is.
#[inline(always)]
fn parse_ip<P: Packet>(
    p: &P,
    ether_type: u16,
    off: usize,
    out: &mut Parsed,
) -> Result<(u8, usize, usize), Skip> {
    out.l3_off = off as u16;
    let tos;
    let proto;
    let l4_len: usize;
    let mut off = off;
    match ether_type {
        ETH_P_IPV4 => {
            let ip: &Ipv4Hdr = p.header(off).ok_or(Skip::TruncatedIp)?;
            let ihl = ip.header_len();
            let tot = ip.tot_len() as usize;
            if ip.version() != 4 || ihl < Ipv4Hdr::LEN || tot < ihl {
                return Err(Skip::BadIpHeader);
            }
            if ip.protocol != IPPROTO_UDP && ip.protocol != IPPROTO_GRE {
                return Err(Skip::NonRoce);
            }
            if ip.is_fragment() {
                return Err(Skip::Fragment);
            }
            out.ip_version = 4;
            out.set_addrs(mapped_v4(ip.src), mapped_v4(ip.dst));
            tos = ip.tos;
            out.ttl = ip.ttl;
            proto = ip.protocol;
            l4_len = tot - ihl;
            off += ihl;
        }
        ETH_P_IPV6 => {
            let ip: &Ipv6Hdr = p.header(off).ok_or(Skip::TruncatedIp)?;
            if ip.version() != 6 {
                return Err(Skip::BadIpHeader);
            }
            out.ip_version = 6;
            out.set_addrs(dwords_of_addr(ip.src), dwords_of_addr(ip.dst));
            tos = ip.traffic_class();
            out.ttl = ip.hop_limit;
            let mut next = ip.next_hdr;
            let mut remaining = ip.payload_len() as usize;
            off += Ipv6Hdr::LEN;
            for _ in 0..MAX_IPV6_EXT {
                match next {
                    IPV6_EXT_HOP_BY_HOP | IPV6_EXT_ROUTING | IPV6_EXT_DEST_OPTS | IPV6_EXT_AUTH => {
                        let ext: &Ipv6ExtHdr = p.header(off).ok_or(Skip::TruncatedIp)?;
                        let len = ext.length(next);
                        if len > remaining {
                            return Err(Skip::BadIpHeader);
                        }
                        next = ext.next_hdr;
                        remaining -= len;
                        off += len;
                    }
                    IPV6_EXT_FRAGMENT => return Err(Skip::Fragment),
                    _ => break,
                }
            }
            if next != IPPROTO_UDP && next != IPPROTO_GRE {
                return Err(match next {
                    IPV6_EXT_HOP_BY_HOP | IPV6_EXT_ROUTING | IPV6_EXT_DEST_OPTS | IPV6_EXT_AUTH => {
                        Skip::Ipv6ExtTooDeep
                    }
                    _ => Skip::NonRoce,
                });
            }
            proto = next;
            l4_len = remaining;
        }
        ETH_P_ROCEV1 => return Err(Skip::RoceV1),
        _ => return Err(Skip::NonRoce),
    }
    out.dscp = tos >> 2;
    out.ecn = tos & 0x3;
    Ok((proto, off, l4_len))
}

/// The GRE header at `off` (and the ERSPAN header after it) of an IP payload of `len`
/// bytes: records the mirror kind and session in `out`; returns what follows —
/// [`GRE_PROTO_TEB`] for an Ethernet frame, or an IP EtherType — and where.
#[inline(always)]
fn parse_mirror<P: Packet>(p: &P, off: usize, len: usize, out: &mut Parsed) -> Result<(u16, usize), Skip> {
    let gre: &GreHdr = p.header(off).ok_or(Skip::TruncatedEncap)?;
    let flags = gre.flags();
    if gre.version() != 0 || flags & GRE_ROUTING != 0 {
        return Err(Skip::BadEncap);
    }
    let gre_len = gre.header_len();
    if gre_len > len {
        return Err(Skip::TruncatedEncap);
    }
    let mut inner = off + gre_len;
    out.mirror_info.session = 0;
    match gre.protocol() {
        GRE_PROTO_ERSPAN_II if flags & GRE_SEQ == 0 => {
            // Type I: the mirrored frame follows the bare GRE header.
            out.mirror_info.kind = MIRROR_ERSPAN_I;
            Ok((GRE_PROTO_TEB, inner))
        }
        GRE_PROTO_ERSPAN_II => {
            let e: &ErspanIIHdr = p.header(inner).ok_or(Skip::TruncatedEncap)?;
            if e.version() != ERSPAN_II_VERSION {
                return Err(Skip::BadEncap);
            }
            out.mirror_info.kind = MIRROR_ERSPAN_II;
            out.mirror_info.session = e.session_id() as u32;
            Ok((GRE_PROTO_TEB, inner + ErspanIIHdr::LEN))
        }
        GRE_PROTO_ERSPAN_III => {
            let e: &ErspanIIIHdr = p.header(inner).ok_or(Skip::TruncatedEncap)?;
            if e.version() != ERSPAN_III_VERSION || e.frame_type() != ERSPAN_III_FT_ETHERNET {
                return Err(Skip::BadEncap);
            }
            out.mirror_info.kind = MIRROR_ERSPAN_III;
            out.mirror_info.session = e.session_id() as u32;
            inner += ErspanIIIHdr::LEN;
            if e.has_platform_subheader() {
                p.header::<ErspanIIIPlatformHdr>(inner)
                    .ok_or(Skip::TruncatedEncap)?;
                inner += ErspanIIIPlatformHdr::LEN;
            }
            Ok((GRE_PROTO_TEB, inner))
        }
        proto @ (GRE_PROTO_TEB | ETH_P_IPV4 | ETH_P_IPV6) => {
            out.mirror_info.kind = MIRROR_GRE;
            if flags & GRE_KEY != 0 {
                let key = p.load4(off + gre.key_offset()).ok_or(Skip::TruncatedEncap)?;
                out.mirror_info.session = u32::from_be_bytes(key);
            }
            Ok((proto, inner))
        }
        _ => Err(Skip::NonRoce),
    }
}

impl Parsed {
    #[inline(always)]
    fn has(&self, bit: u8) -> bool {
        self.present & bit != 0
    }
    /// The AETH's meaning, for ACK / ATOMIC ACK opcodes (not read responses).
    #[inline(always)]
    pub fn ack_kind(&self) -> Option<roce::AckKind> {
        if self.has(HAS_AETH) && roce::is_ack_opcode(self.bth.opcode) {
            Some(roce::ack_kind(self.aeth.syndrome))
        } else {
            None
        }
    }
    pub fn pcp(&self) -> Option<u8> {
        self.has(HAS_PCP).then_some(self.pcp)
    }
    pub fn aeth(&self) -> Option<Aeth> {
        self.has(HAS_AETH).then_some(self.aeth)
    }
    pub fn reth_dma_len(&self) -> Option<u32> {
        self.has(HAS_RETH).then_some(self.reth_dma_len)
    }
    pub fn deth_src_qp(&self) -> Option<u32> {
        self.has(HAS_DETH).then_some(self.deth_src_qp)
    }
    pub fn icrc(&self) -> Option<[u8; 4]> {
        self.has(HAS_ICRC).then_some(self.icrc)
    }
    /// The mirror session of a mirrored copy (its id is `mirror_id`).
    pub fn mirror(&self) -> Option<MirrorInfo> {
        self.has(HAS_MIRROR).then_some(self.mirror_info)
    }
}

/// [`Packet`] over a byte slice: host tests and pcap input.
pub struct SlicePacket<'a> {
    pub data: &'a [u8],
    pub vlan_tci: Option<u16>,
}

impl<'a> SlicePacket<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Self { data, vlan_tci: None }
    }
}

impl Packet for SlicePacket<'_> {
    #[inline]
    fn header<T: Header>(&self, off: usize) -> Option<&T> {
        let bytes = self.data.get(off..off.checked_add(T::LEN)?)?;
        // SAFETY: `Header` types are alignment-1 byte structs valid for any bytes, and
        // `bytes` holds exactly `T::LEN` of them.
        Some(unsafe { &*(bytes.as_ptr() as *const T) })
    }

    #[inline]
    fn holds(&self, len: usize) -> bool {
        len <= self.data.len()
    }

    #[inline]
    fn load4(&self, off: usize) -> Option<[u8; 4]> {
        let b = self.data.get(off..off.checked_add(4)?)?;
        Some([b[0], b[1], b[2], b[3]])
    }

    fn offload_vlan_tci(&self) -> Option<u16> {
        self.vlan_tci
    }

    fn load_head(&self, dst: &mut [u8; SAMPLE_HEAD_LEN]) -> u16 {
        let n = self.data.len().min(SAMPLE_HEAD_LEN);
        dst[..n].copy_from_slice(&self.data[..n]);
        n as u16
    }

    fn copy_out(&self, off: usize, dst: &mut [u8; INNER_HEAD_LEN]) -> usize {
        let src = self.data.get(off..).unwrap_or_default();
        let n = src.len().min(INNER_HEAD_LEN);
        dst[..n].copy_from_slice(&src[..n]);
        n
    }
}

/// The one fill of a sample (here, beside the parser whose result it reads).
impl Sample {
    /// Fills every field: the sample of packet `pkt`, parsed into `p` (its ICRC loaded by
    /// `parse::load_icrc`), of flow `key`. The one fill of the kernel's ring slot and of
    /// pcap input. Field by field, so in the kernel no 264-byte copy lands on the BPF stack
    /// and the head bytes go straight from the packet into the ring; bytes of `head` past
    /// `head_len` are left as they are.
    #[inline(always)]
    pub fn fill<P: Packet>(
        &mut self,
        pkt: &P,
        p: &Parsed,
        key: &FlowKey,
        ts_ns: u64,
        frame_len: u32,
        reasons: u32,
    ) {
        self.head_len = pkt.load_head(&mut self.head);
        self.l3_off = p.l3_off;
        self.ts_ns = ts_ns;
        self.key = *key;
        self.psn = p.bth.psn();
        self.frame_len = frame_len;
        self.reth_dma_len = p.reth_dma_len;
        self.aeth_msn = p.aeth.msn();
        self.deth_src_qp = p.deth_src_qp;
        self.icrc = p.icrc;
        self.pkey = p.bth.pkey();
        self.udp_dport = p.udp_dport;
        self.udp_len = p.udp_len;
        self.opcode = p.bth.opcode;
        self.bth_flags = p.bth.flags;
        self.bth_fecn_becn = p.bth.fecn_becn;
        self.bth_ack_req = p.bth.ack_req;
        self.dscp = p.dscp;
        self.ecn = p.ecn;
        self.ttl = p.ttl;
        self.pcp = p.pcp;
        self.aeth_syndrome = p.aeth.syndrome;
        self.vlan_depth = p.vlan_depth;
        self.present = p.present;
        self._pad = [0; 3];
        self.reasons = reasons;
        if p.present & HAS_MIRROR != 0 {
            self.mirror = p.mirror_info;
        } else {
            let m = &mut self.mirror;
            m.src = [0; 4];
            m.session = 0;
            m.kind = 0;
            m._pad = [0; 3];
        }
        self._pad2 = 0;
    }
}
