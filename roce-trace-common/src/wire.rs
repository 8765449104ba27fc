//! Wire headers as byte arrays (alignment 1, safe on unaligned packet data), with
//! big-endian getters and a `LEN`. See `shared/ROCE_WIRE.md`.

/// A header that can be viewed in place on packet bytes.
///
/// # Safety
/// Implementors are `#[repr(C)]` structs made only of `u8` and `[u8; N]` fields, so any
/// byte sequence of `LEN` bytes is a valid value and alignment is 1.
pub unsafe trait Header: Sized {
    const LEN: usize = core::mem::size_of::<Self>();

    /// The header's wire bytes (for building frames from the same definitions).
    fn as_bytes(&self) -> &[u8] {
        // SAFETY: `Self` is a byte struct of `LEN` bytes with no padding (trait contract).
        unsafe { core::slice::from_raw_parts(self as *const Self as *const u8, Self::LEN) }
    }
}

// SAFETY: a byte array: any bytes are valid, alignment 1 (a 4-byte field read in place).
unsafe impl Header for [u8; 4] {}

pub const ETH_P_IPV4: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86DD;
pub const ETH_P_8021Q: u16 = 0x8100;
pub const ETH_P_8021AD: u16 = 0x88A8;
/// RoCEv1: BTH straight after a GRH, no IP/UDP. Counted, not parsed as v2.
pub const ETH_P_ROCEV1: u16 = 0x8915;
pub const IPPROTO_UDP: u8 = 17;
pub const IPPROTO_GRE: u8 = 47;
pub const ROCEV2_UDP_PORT: u16 = 4791;
/// GRE protocol types of mirrored traffic: transparent Ethernet bridging (plain GRE
/// carrying a whole frame), ERSPAN type I/II, ERSPAN type III. GRE may also carry IP
/// directly (`ETH_P_IPV4` / `ETH_P_IPV6`).
pub const GRE_PROTO_TEB: u16 = 0x6558;
pub const GRE_PROTO_ERSPAN_II: u16 = 0x88BE;
pub const GRE_PROTO_ERSPAN_III: u16 = 0x22EB;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EthHdr {
    pub dst: [u8; 6],
    pub src: [u8; 6],
    pub ether_type: [u8; 2],
}
// SAFETY: only byte fields.
unsafe impl Header for EthHdr {}
impl EthHdr {
    #[inline(always)]
    pub fn ether_type(&self) -> u16 {
        u16::from_be_bytes(self.ether_type)
    }
}

/// 802.1Q / 802.1ad tag as it follows the outer EtherType: TCI, then the inner EtherType.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VlanHdr {
    pub tci: [u8; 2],
    pub ether_type: [u8; 2],
}
// SAFETY: only byte fields.
unsafe impl Header for VlanHdr {}
impl VlanHdr {
    #[inline(always)]
    pub fn tci(&self) -> u16 {
        u16::from_be_bytes(self.tci)
    }
    #[inline(always)]
    pub fn pcp(&self) -> u8 {
        pcp_of_tci(self.tci())
    }
    #[inline(always)]
    pub fn ether_type(&self) -> u16 {
        u16::from_be_bytes(self.ether_type)
    }
}

/// Priority code point: the top 3 bits of a TCI.
#[inline(always)]
pub const fn pcp_of_tci(tci: u16) -> u8 {
    (tci >> 13) as u8
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ipv4Hdr {
    pub version_ihl: u8,
    pub tos: u8,
    pub tot_len: [u8; 2],
    pub id: [u8; 2],
    pub frag_off: [u8; 2],
    pub ttl: u8,
    pub protocol: u8,
    pub check: [u8; 2],
    pub src: [u8; 4],
    pub dst: [u8; 4],
}
// SAFETY: only byte fields.
unsafe impl Header for Ipv4Hdr {}
impl Ipv4Hdr {
    #[inline(always)]
    pub fn version(&self) -> u8 {
        self.version_ihl >> 4
    }
    /// Header length in bytes, from IHL (options included).
    #[inline(always)]
    pub fn header_len(&self) -> usize {
        ((self.version_ihl & 0x0f) as usize) * 4
    }
    #[inline(always)]
    pub fn tot_len(&self) -> u16 {
        u16::from_be_bytes(self.tot_len)
    }
    /// More-fragments flag set or a non-zero fragment offset.
    #[inline(always)]
    pub fn is_fragment(&self) -> bool {
        u16::from_be_bytes(self.frag_off) & 0x3fff != 0
    }
    #[inline(always)]
    pub fn dscp(&self) -> u8 {
        self.tos >> 2
    }
    #[inline(always)]
    pub fn ecn(&self) -> u8 {
        self.tos & 0x3
    }
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ipv6Hdr {
    /// Version (4 bits), traffic class (8), flow label (20).
    pub vtcfl: [u8; 4],
    pub payload_len: [u8; 2],
    pub next_hdr: u8,
    pub hop_limit: u8,
    pub src: [u8; 16],
    pub dst: [u8; 16],
}
// SAFETY: only byte fields.
unsafe impl Header for Ipv6Hdr {}
impl Ipv6Hdr {
    #[inline(always)]
    pub fn version(&self) -> u8 {
        self.vtcfl[0] >> 4
    }
    #[inline(always)]
    pub fn traffic_class(&self) -> u8 {
        (self.vtcfl[0] << 4) | (self.vtcfl[1] >> 4)
    }
    #[inline(always)]
    pub fn payload_len(&self) -> u16 {
        u16::from_be_bytes(self.payload_len)
    }
    #[inline(always)]
    pub fn dscp(&self) -> u8 {
        self.traffic_class() >> 2
    }
    #[inline(always)]
    pub fn ecn(&self) -> u8 {
        self.traffic_class() & 0x3
    }
}

pub const IPV6_EXT_HOP_BY_HOP: u8 = 0;
pub const IPV6_EXT_ROUTING: u8 = 43;
pub const IPV6_EXT_FRAGMENT: u8 = 44;
pub const IPV6_EXT_AUTH: u8 = 51;
pub const IPV6_EXT_DEST_OPTS: u8 = 60;

/// The first two bytes every IPv6 extension header shares.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ipv6ExtHdr {
    pub next_hdr: u8,
    pub hdr_ext_len: u8,
}
// SAFETY: only byte fields.
unsafe impl Header for Ipv6ExtHdr {}
impl Ipv6ExtHdr {
    /// Length of this extension header in bytes (`kind` is the header's own type).
    #[inline(always)]
    pub fn length(&self, kind: u8) -> usize {
        if kind == IPV6_EXT_AUTH {
            (self.hdr_ext_len as usize + 2) * 4
        } else {
            (self.hdr_ext_len as usize + 1) * 8
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UdpHdr {
    pub src_port: [u8; 2],
    pub dst_port: [u8; 2],
    pub len: [u8; 2],
    pub check: [u8; 2],
}
// SAFETY: only byte fields.
unsafe impl Header for UdpHdr {}
impl UdpHdr {
    #[inline(always)]
    pub fn src_port(&self) -> u16 {
        u16::from_be_bytes(self.src_port)
    }
    #[inline(always)]
    pub fn dst_port(&self) -> u16 {
        u16::from_be_bytes(self.dst_port)
    }
    /// UDP header plus payload, in bytes.
    #[inline(always)]
    pub fn length(&self) -> u16 {
        u16::from_be_bytes(self.len)
    }
}

/// InfiniBand Base Transport Header (12 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bth {
    pub opcode: u8,
    /// SE(7) M(6) PadCnt(5:4) TVer(3:0).
    pub flags: u8,
    pub pkey: [u8; 2],
    /// FECN(7) BECN(6) reserved(5:0) — some NICs set reserved bits; never reject on them.
    pub fecn_becn: u8,
    pub dest_qp: [u8; 3],
    /// AckReq(7) reserved(6:0).
    pub ack_req: u8,
    pub psn: [u8; 3],
}
// SAFETY: only byte fields.
unsafe impl Header for Bth {}
impl Bth {
    #[inline(always)]
    pub fn solicited(&self) -> bool {
        self.flags & 0x80 != 0
    }
    #[inline(always)]
    pub fn mig_req(&self) -> bool {
        self.flags & 0x40 != 0
    }
    #[inline(always)]
    pub fn pad_count(&self) -> u8 {
        (self.flags >> 4) & 0x3
    }
    #[inline(always)]
    pub fn tver(&self) -> u8 {
        self.flags & 0x0f
    }
    #[inline(always)]
    pub fn pkey(&self) -> u16 {
        u16::from_be_bytes(self.pkey)
    }
    #[inline(always)]
    pub fn fecn(&self) -> bool {
        self.fecn_becn & 0x80 != 0
    }
    #[inline(always)]
    pub fn becn(&self) -> bool {
        self.fecn_becn & 0x40 != 0
    }
    #[inline(always)]
    pub fn dest_qp(&self) -> u32 {
        u24(self.dest_qp)
    }
    #[inline(always)]
    pub fn ack_req(&self) -> bool {
        self.ack_req & 0x80 != 0
    }
    #[inline(always)]
    pub fn psn(&self) -> u32 {
        u24(self.psn)
    }
}

/// ACK Extended Transport Header: syndrome and MSN.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Aeth {
    pub syndrome: u8,
    pub msn: [u8; 3],
}
// SAFETY: only byte fields.
unsafe impl Header for Aeth {}
impl Aeth {
    #[inline(always)]
    pub fn msn(&self) -> u32 {
        u24(self.msn)
    }
}

/// RDMA Extended Transport Header: virtual address, R_Key, DMA length.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reth {
    pub va: [u8; 8],
    pub rkey: [u8; 4],
    pub dma_len: [u8; 4],
}
// SAFETY: only byte fields.
unsafe impl Header for Reth {}
impl Reth {
    #[inline(always)]
    pub fn va(&self) -> u64 {
        u64::from_be_bytes(self.va)
    }
    #[inline(always)]
    pub fn rkey(&self) -> u32 {
        u32::from_be_bytes(self.rkey)
    }
    #[inline(always)]
    pub fn dma_len(&self) -> u32 {
        u32::from_be_bytes(self.dma_len)
    }
}

/// Datagram Extended Transport Header (UD): Q_Key and source QP.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Deth {
    pub qkey: [u8; 4],
    pub reserved: u8,
    pub src_qp: [u8; 3],
}
// SAFETY: only byte fields.
unsafe impl Header for Deth {}
impl Deth {
    #[inline(always)]
    pub fn qkey(&self) -> u32 {
        u32::from_be_bytes(self.qkey)
    }
    #[inline(always)]
    pub fn src_qp(&self) -> u32 {
        u24(self.src_qp)
    }
}

/// GRE base header (RFC 2784/2890): flags and version, protocol type. Checksum (C),
/// key (K) and sequence number (S) each add 4 bytes, in that order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GreHdr {
    /// C(15) R(14) K(13) S(12) s(11) Recur(10:8) Flags(7:3) Ver(2:0).
    pub flags_version: [u8; 2],
    pub protocol: [u8; 2],
}
// SAFETY: only byte fields.
unsafe impl Header for GreHdr {}
pub const GRE_CHECKSUM: u16 = 0x8000;
/// RFC 1701 routing present: the header length is then unbounded; never sent for mirrors.
pub const GRE_ROUTING: u16 = 0x4000;
pub const GRE_KEY: u16 = 0x2000;
pub const GRE_SEQ: u16 = 0x1000;
impl GreHdr {
    #[inline(always)]
    pub fn flags(&self) -> u16 {
        u16::from_be_bytes(self.flags_version)
    }
    #[inline(always)]
    pub fn version(&self) -> u8 {
        self.flags_version[1] & 0x7
    }
    #[inline(always)]
    pub fn protocol(&self) -> u16 {
        u16::from_be_bytes(self.protocol)
    }
    /// Offset of the key field from the start of the GRE header (valid with `GRE_KEY`).
    #[inline(always)]
    pub fn key_offset(&self) -> usize {
        Self::LEN + if self.flags() & GRE_CHECKSUM != 0 { 4 } else { 0 }
    }
    /// The whole GRE header: base, checksum, key and sequence number as flagged.
    #[inline(always)]
    pub fn header_len(&self) -> usize {
        let f = self.flags();
        Self::LEN
            + if f & GRE_CHECKSUM != 0 { 4 } else { 0 }
            + if f & GRE_KEY != 0 { 4 } else { 0 }
            + if f & GRE_SEQ != 0 { 4 } else { 0 }
    }
}

pub const ERSPAN_II_VERSION: u8 = 1;
pub const ERSPAN_III_VERSION: u8 = 2;
/// Session ids are 10 bits.
pub const ERSPAN_SESSION_MASK: u16 = 0x03ff;

/// ERSPAN type II header (8 bytes, after a GRE header with a sequence number):
/// Ver(4)=1 VLAN(12) | COS(3) En(2) T(1) Session ID(10) | Reserved(12) Index(20).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ErspanIIHdr {
    pub ver_vlan: [u8; 2],
    pub cos_en_t_session: [u8; 2],
    pub reserved_index: [u8; 4],
}
// SAFETY: only byte fields.
unsafe impl Header for ErspanIIHdr {}
/// The first four bytes ERSPAN II and III share: Ver(4) VLAN(12) | COS(3) x(2) T(1)
/// Session ID(10), where x is En (II) or BSO (III).
pub trait ErspanCommon {
    fn ver_vlan(&self) -> [u8; 2];
    fn cos_x_t_session(&self) -> [u8; 2];
    #[inline(always)]
    fn version(&self) -> u8 {
        self.ver_vlan()[0] >> 4
    }
    #[inline(always)]
    fn vlan(&self) -> u16 {
        u16::from_be_bytes(self.ver_vlan()) & 0x0fff
    }
    #[inline(always)]
    fn cos(&self) -> u8 {
        self.cos_x_t_session()[0] >> 5
    }
    /// The two bits after COS: En (type II) or BSO (type III).
    #[inline(always)]
    fn x_bits(&self) -> u8 {
        (self.cos_x_t_session()[0] >> 3) & 0x3
    }
    /// The mirrored frame was truncated by the switch.
    #[inline(always)]
    fn truncated(&self) -> bool {
        self.cos_x_t_session()[0] & 0x04 != 0
    }
    #[inline(always)]
    fn session_id(&self) -> u16 {
        u16::from_be_bytes(self.cos_x_t_session()) & ERSPAN_SESSION_MASK
    }
}

impl ErspanCommon for ErspanIIHdr {
    #[inline(always)]
    fn ver_vlan(&self) -> [u8; 2] {
        self.ver_vlan
    }
    #[inline(always)]
    fn cos_x_t_session(&self) -> [u8; 2] {
        self.cos_en_t_session
    }
}

impl ErspanIIHdr {
    /// How the original frame carried its VLAN: 0 untagged, 1 ISL, 2 802.1Q, 3 tag kept.
    #[inline(always)]
    pub fn encap_type(&self) -> u8 {
        self.x_bits()
    }
    #[inline(always)]
    pub fn index(&self) -> u32 {
        u32::from_be_bytes(self.reserved_index) & 0x000f_ffff
    }
}

/// ERSPAN type III header (12 bytes): Ver(4)=2 VLAN(12) | COS(3) BSO(2) T(1) Session ID(10)
/// | Timestamp(32) | SGT(16) | P(1) FT(5) HW ID(6) D(1) Gra(2) O(1). With O set, an
/// 8-byte platform-specific subheader follows.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ErspanIIIHdr {
    pub ver_vlan: [u8; 2],
    pub cos_bso_t_session: [u8; 2],
    pub timestamp: [u8; 4],
    pub sgt: [u8; 2],
    pub flags: [u8; 2],
}
// SAFETY: only byte fields.
unsafe impl Header for ErspanIIIHdr {}
/// The 8-byte platform-specific subheader of ERSPAN type III (its layout depends on the
/// platform id; only skipped over).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ErspanIIIPlatformHdr {
    pub bytes: [u8; 8],
}
// SAFETY: only byte fields.
unsafe impl Header for ErspanIIIPlatformHdr {}
impl ErspanIIIPlatformHdr {
    /// Platform id (top 6 bits).
    #[inline(always)]
    pub fn platform_id(&self) -> u8 {
        self.bytes[0] >> 2
    }
}
/// Type III frame type of a mirrored Ethernet frame (the only one decapsulated).
pub const ERSPAN_III_FT_ETHERNET: u8 = 0;
impl ErspanCommon for ErspanIIIHdr {
    #[inline(always)]
    fn ver_vlan(&self) -> [u8; 2] {
        self.ver_vlan
    }
    #[inline(always)]
    fn cos_x_t_session(&self) -> [u8; 2] {
        self.cos_bso_t_session
    }
}

impl ErspanIIIHdr {
    /// Bad/short/oversized frame status.
    #[inline(always)]
    pub fn bso(&self) -> u8 {
        self.x_bits()
    }
    #[inline(always)]
    pub fn timestamp(&self) -> u32 {
        u32::from_be_bytes(self.timestamp)
    }
    #[inline(always)]
    pub fn sgt(&self) -> u16 {
        u16::from_be_bytes(self.sgt)
    }
    #[inline(always)]
    pub fn frame_type(&self) -> u8 {
        (self.flags[0] >> 2) & 0x1f
    }
    #[inline(always)]
    pub fn hw_id(&self) -> u8 {
        ((u16::from_be_bytes(self.flags) >> 4) & 0x3f) as u8
    }
    /// 0: ingress, 1: egress traffic of the monitored port.
    #[inline(always)]
    pub fn direction(&self) -> u8 {
        (self.flags[1] >> 3) & 1
    }
    #[inline(always)]
    pub fn granularity(&self) -> u8 {
        (self.flags[1] >> 1) & 0x3
    }
    #[inline(always)]
    pub fn has_platform_subheader(&self) -> bool {
        self.flags[1] & 1 != 0
    }
    /// This header plus the optional platform-specific subheader.
    #[inline(always)]
    pub fn header_len(&self) -> usize {
        Self::LEN
            + if self.has_platform_subheader() {
                ErspanIIIPlatformHdr::LEN
            } else {
                0
            }
    }
}

/// Length of the invariant CRC that ends every RoCEv2 packet.
pub const ICRC_LEN: usize = 4;

#[inline(always)]
pub const fn u24(b: [u8; 3]) -> u32 {
    ((b[0] as u32) << 16) | ((b[1] as u32) << 8) | b[2] as u32
}

const _: () = {
    assert!(EthHdr::LEN == 14);
    assert!(VlanHdr::LEN == 4);
    assert!(Ipv4Hdr::LEN == 20);
    assert!(Ipv6Hdr::LEN == 40);
    assert!(UdpHdr::LEN == 8);
    assert!(Bth::LEN == 12);
    assert!(Aeth::LEN == 4);
    assert!(Reth::LEN == 16);
    assert!(Deth::LEN == 8);
    assert!(GreHdr::LEN == 4);
    assert!(ErspanIIHdr::LEN == 8);
    assert!(ErspanIIIHdr::LEN == 12);
    assert!(ErspanIIIPlatformHdr::LEN == 8);
};
