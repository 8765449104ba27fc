//! The one RoCEv2 parser. It walks a frame with a cursor, bounds-checking each header
//! through [`Packet`], which the eBPF programs implement over packet memory (XDP and TC)
//! and userspace implements over byte slices (tests, pcap input). Everything is
//! `#[inline(always)]` so the kernel build is straight-line code the verifier accepts.

use crate::datapath::{GlobalCounter, HAS_AETH, HAS_DETH, HAS_ICRC, HAS_PCP, HAS_RETH};
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
    /// The outermost VLAN TCI when the NIC or stack removed the tag from packet data.
    fn offload_vlan_tci(&self) -> Option<u16>;
}

/// The fields of one RoCEv2 packet that the datapath records.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Parsed {
    pub ip_version: u8,
    /// IPv6, or IPv4 mapped as `::ffff:a.b.c.d`.
    pub src: [u8; 16],
    pub dst: [u8; 16],
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
    /// `datapath::HAS_*` bits. Plain fields plus bits rather than `Option`s: writing a
    /// `None` leaves undefined bytes, which the verifier rejects.
    pub present: u8,
}

/// Why a frame is not a parsed RoCEv2 packet: the global counter it bumps.
pub type Skip = GlobalCounter;

#[inline(always)]
fn mapped_v4(a: [u8; 4]) -> [u8; 16] {
    [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, a[0], a[1], a[2], a[3]]
}

/// Parses `p` into a new [`Parsed`], ICRC included (host use; the kernel uses
/// [`parse_into`]).
pub fn parse<P: Packet>(p: &P, udp_port: u16) -> Result<Parsed, Skip> {
    let mut out = Parsed::default();
    parse_into(p, udp_port, &mut out)?;
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
/// On error `out` holds a partial parse and must not be used.
#[inline(always)]
pub fn parse_into<P: Packet>(p: &P, udp_port: u16, out: &mut Parsed) -> Result<(), Skip> {
    let eth: &EthHdr = p.header(0).ok_or(Skip::TruncatedL2)?;
    let mut ether_type = eth.ether_type();
    let mut off = EthHdr::LEN;

    out.present = 0;
    if let Some(tci) = p.offload_vlan_tci() {
        out.pcp = pcp_of_tci(tci);
        out.present |= HAS_PCP;
    }
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

    let tos;
    // Bytes from the start of the UDP header to the end of the IP payload.
    let l4_len: usize;
    match ether_type {
        ETH_P_IPV4 => {
            let ip: &Ipv4Hdr = p.header(off).ok_or(Skip::TruncatedIp)?;
            let ihl = ip.header_len();
            let tot = ip.tot_len() as usize;
            if ip.version() != 4 || ihl < Ipv4Hdr::LEN || tot < ihl {
                return Err(Skip::BadIpHeader);
            }
            if ip.protocol != IPPROTO_UDP {
                return Err(Skip::NonRoce);
            }
            if ip.is_fragment() {
                return Err(Skip::Fragment);
            }
            out.ip_version = 4;
            out.src = mapped_v4(ip.src);
            out.dst = mapped_v4(ip.dst);
            tos = ip.tos;
            out.ttl = ip.ttl;
            l4_len = tot - ihl;
            off += ihl;
        }
        ETH_P_IPV6 => {
            let ip: &Ipv6Hdr = p.header(off).ok_or(Skip::TruncatedIp)?;
            if ip.version() != 6 {
                return Err(Skip::BadIpHeader);
            }
            out.ip_version = 6;
            out.src = ip.src;
            out.dst = ip.dst;
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
            if next != IPPROTO_UDP {
                return Err(match next {
                    IPV6_EXT_HOP_BY_HOP | IPV6_EXT_ROUTING | IPV6_EXT_DEST_OPTS | IPV6_EXT_AUTH => {
                        Skip::Ipv6ExtTooDeep
                    }
                    _ => Skip::NonRoce,
                });
            }
            l4_len = remaining;
        }
        ETH_P_ROCEV1 => return Err(Skip::RoceV1),
        _ => return Err(Skip::NonRoce),
    }

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
    out.bth = *bth;
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
    out.icrc_off = (udp_off + udp_len as usize - ICRC_LEN) as u32;
    out.dscp = tos >> 2;
    out.ecn = tos & 0x3;
    out.udp_sport = udp.src_port();
    out.udp_dport = udp_dport;
    out.udp_len = udp_len;
    Ok(())
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
    fn load4(&self, off: usize) -> Option<[u8; 4]> {
        let b = self.data.get(off..off.checked_add(4)?)?;
        Some([b[0], b[1], b[2], b[3]])
    }

    fn offload_vlan_tci(&self) -> Option<u16> {
        self.vlan_tci
    }
}
