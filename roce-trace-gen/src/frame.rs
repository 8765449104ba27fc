//! Builds RoCEv2 frames from the shared header definitions, with a correct ICRC: test
//! input for the datapath and the base of the traffic generator.

use std::net::IpAddr;

pub use roce_trace_common::icrc::{check_icrc, icrc, icrc_finish, icrc_prefix};
use roce_trace_common::wire::*;

/// Extended headers, serialised from the shared definitions.
pub mod ext {
    use super::*;

    pub fn reth(va: u64, rkey: u32, dma_len: u32) -> Vec<u8> {
        Reth {
            va: va.to_be_bytes(),
            rkey: rkey.to_be_bytes(),
            dma_len: dma_len.to_be_bytes(),
        }
        .as_bytes()
        .to_vec()
    }
    pub fn aeth(syndrome: u8, msn: u32) -> Vec<u8> {
        Aeth {
            syndrome,
            msn: be24(msn),
        }
        .as_bytes()
        .to_vec()
    }
    pub fn deth(qkey: u32, src_qp: u32) -> Vec<u8> {
        Deth {
            qkey: qkey.to_be_bytes(),
            reserved: 0,
            src_qp: be24(src_qp),
        }
        .as_bytes()
        .to_vec()
    }
    /// The 16 reserved bytes after a CNP's BTH.
    pub fn cnp() -> Vec<u8> {
        vec![0; 16]
    }
}

fn be24(v: u32) -> [u8; 3] {
    let b = v.to_be_bytes();
    [b[1], b[2], b[3]]
}

/// What to put in the ICRC slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IcrcMode {
    Correct,
    Fixed([u8; 4]),
}

/// One RoCEv2 frame to build. Defaults: IPv4 10.0.0.1 → 10.0.0.2, DSCP 26, ECT(0), TTL 64,
/// UDP 49152 → 4791, RC SEND ONLY to QP 0x11 at PSN 0, P_Key 0xFFFF, M set.
#[derive(Clone, Debug)]
pub struct RoceFrame {
    pub src_mac: [u8; 6],
    pub dst_mac: [u8; 6],
    /// (TPID, TCI), outermost first.
    pub vlans: Vec<(u16, u16)>,
    pub src: IpAddr,
    pub dst: IpAddr,
    /// Raw IPv4 options (padded to 4 bytes by the builder).
    pub ipv4_options: Vec<u8>,
    pub dscp: u8,
    pub ecn: u8,
    pub ttl: u8,
    pub udp_sport: u16,
    pub udp_dport: u16,
    pub opcode: u8,
    pub solicited: bool,
    pub mig_req: bool,
    pub pad_cnt: u8,
    pub pkey: u16,
    pub fecn: bool,
    pub becn: bool,
    pub dest_qp: u32,
    pub ack_req: bool,
    pub psn: u32,
    /// Extended headers, in wire order (see [`ext`]).
    pub ext: Vec<u8>,
    pub payload: Vec<u8>,
    pub icrc: IcrcMode,
}

impl Default for RoceFrame {
    fn default() -> Self {
        Self {
            src_mac: [0x02, 0, 0, 0, 0, 1],
            dst_mac: [0x02, 0, 0, 0, 0, 2],
            vlans: Vec::new(),
            src: IpAddr::from([10, 0, 0, 1]),
            dst: IpAddr::from([10, 0, 0, 2]),
            ipv4_options: Vec::new(),
            dscp: 26,
            ecn: 0b10,
            ttl: 64,
            udp_sport: 49152,
            udp_dport: ROCEV2_UDP_PORT,
            opcode: roce_trace_common::roce::op::SEND_ONLY,
            solicited: false,
            mig_req: true,
            pad_cnt: 0,
            pkey: 0xffff,
            fecn: false,
            becn: false,
            dest_qp: 0x11,
            ack_req: false,
            psn: 0,
            ext: Vec::new(),
            payload: Vec::new(),
            icrc: IcrcMode::Correct,
        }
    }
}

impl RoceFrame {
    pub fn bth(&self) -> Bth {
        Bth {
            opcode: self.opcode,
            flags: (self.solicited as u8) << 7 | (self.mig_req as u8) << 6 | (self.pad_cnt & 3) << 4,
            pkey: self.pkey.to_be_bytes(),
            fecn_becn: (self.fecn as u8) << 7 | (self.becn as u8) << 6,
            dest_qp: be24(self.dest_qp),
            ack_req: (self.ack_req as u8) << 7,
            psn: be24(self.psn & 0x00ff_ffff),
        }
    }

    /// UDP payload: BTH, extended headers, payload, pad bytes, and a zero ICRC slot (the
    /// ICRC covers the IP header, so only [`Self::ip_packet`] can fill it in).
    pub fn udp_payload(&self) -> Vec<u8> {
        let mut p = self.bth().as_bytes().to_vec();
        p.extend_from_slice(&self.ext);
        p.extend_from_slice(&self.payload);
        p.extend(std::iter::repeat_n(0u8, self.pad_cnt as usize));
        p.extend_from_slice(&[0; ICRC_LEN]);
        p
    }

    /// IP and UDP headers for a UDP datagram of `udp_len` bytes, as a RoCE NIC (or a Linux
    /// UDP socket with DF set and no connection) sends them: IPv4 ID 0 and DF, UDP checksum
    /// 0 (IPv6: filled in by [`Self::ip_packet`]).
    pub fn ip_udp_headers(&self, udp_len: u16) -> Vec<u8> {
        let tos = (self.dscp << 2) | (self.ecn & 3);
        let mut out = ip_header(
            self.src,
            self.dst,
            tos,
            self.ttl,
            IPPROTO_UDP,
            udp_len,
            &self.ipv4_options,
        );
        let udp = UdpHdr {
            src_port: self.udp_sport.to_be_bytes(),
            dst_port: self.udp_dport.to_be_bytes(),
            len: udp_len.to_be_bytes(),
            check: [0, 0],
        };
        out.extend_from_slice(udp.as_bytes());
        out
    }

    /// The IP packet (IP header to the ICRC), ICRC filled in per [`IcrcMode`].
    pub fn ip_packet(&self) -> Vec<u8> {
        let payload = self.udp_payload();
        let udp_len = (UdpHdr::LEN + payload.len()) as u16;
        let mut out = self.ip_udp_headers(udp_len);
        let udp_off = out.len() - UdpHdr::LEN;
        out.extend_from_slice(&payload);
        let icrc = match self.icrc {
            IcrcMode::Correct => icrc(&out).expect("well-formed packet"),
            IcrcMode::Fixed(b) => b,
        };
        let n = out.len();
        out[n - ICRC_LEN..].copy_from_slice(&icrc);
        if let (IpAddr::V6(s), IpAddr::V6(d)) = (self.src, self.dst) {
            // IPv6 requires a UDP checksum (IPv4 RoCE sends 0); it covers the ICRC.
            let c = udp6_checksum(&s, &d, &out[udp_off..]);
            out[udp_off + 6..udp_off + 8].copy_from_slice(&c.to_be_bytes());
        }
        out
    }

    /// The whole Ethernet frame, padded to the 60-byte minimum.
    pub fn build(&self) -> Vec<u8> {
        let ip = self.ip_packet();
        let ethertype = if self.src.is_ipv4() {
            ETH_P_IPV4
        } else {
            ETH_P_IPV6
        };
        ethernet(self.dst_mac, self.src_mac, &self.vlans, ethertype, &ip)
    }
}

/// An IPv4 (DF set, ID 0, checksum filled in; `ipv4_options` padded to 4 bytes) or IPv6
/// header for `payload_len` bytes of protocol `proto`.
pub fn ip_header(
    src: IpAddr,
    dst: IpAddr,
    tos: u8,
    ttl: u8,
    proto: u8,
    payload_len: u16,
    ipv4_options: &[u8],
) -> Vec<u8> {
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let mut opts = ipv4_options.to_vec();
            while !opts.len().is_multiple_of(4) {
                opts.push(0);
            }
            let ihl = (Ipv4Hdr::LEN + opts.len()) / 4;
            let tot = (ihl * 4) as u16 + payload_len;
            let hdr = Ipv4Hdr {
                version_ihl: 0x40 | ihl as u8,
                tos,
                tot_len: tot.to_be_bytes(),
                id: [0, 0],
                frag_off: 0x4000u16.to_be_bytes(), // DF, as RoCE NICs send
                ttl,
                protocol: proto,
                check: [0, 0],
                src: s.octets(),
                dst: d.octets(),
            };
            let mut v = hdr.as_bytes().to_vec();
            v.extend_from_slice(&opts);
            let c = inet_checksum(&v, 0);
            v[10..12].copy_from_slice(&c.to_be_bytes());
            v
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let vtcfl = (6u32 << 28) | (tos as u32) << 20;
            Ipv6Hdr {
                vtcfl: vtcfl.to_be_bytes(),
                payload_len: payload_len.to_be_bytes(),
                next_hdr: proto,
                hop_limit: ttl,
                src: s.octets(),
                dst: d.octets(),
            }
            .as_bytes()
            .to_vec()
        }
        _ => panic!("source and destination must be the same IP version"),
    }
}

/// How a switch mirrors a frame to a remote analyser.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mirror {
    /// Plain GRE, transparent Ethernet bridging (0x6558), optional key.
    GreEthernet { key: Option<u32> },
    /// Plain GRE carrying the IP packet (0x0800 / 0x86DD), optional key.
    GreIp { key: Option<u32> },
    /// ERSPAN type II: GRE with a sequence number, 0x88BE, 8-byte ERSPAN header.
    ErspanII { session: u16, seq: u32, index: u32 },
    /// ERSPAN type III: GRE with a sequence number, 0x22EB, 12-byte header, and the
    /// 8-byte platform-specific subheader when `platform` is set.
    ErspanIII {
        session: u16,
        seq: u32,
        timestamp: u32,
        platform: bool,
    },
}

impl Mirror {
    /// The mirrored copy of `frame` (an Ethernet frame) as the switch `src` sends it to
    /// the analyser `dst`: outer Ethernet, IP (TTL 64, DSCP 0), GRE, ERSPAN, the frame —
    /// or for [`Mirror::GreIp`], the frame's IP packet.
    pub fn encapsulate(&self, src: IpAddr, dst: IpAddr, frame: &[u8]) -> Vec<u8> {
        let gre = |proto: u16, key: Option<u32>, seq: Option<u32>| {
            let flags = if key.is_some() { GRE_KEY } else { 0 } | if seq.is_some() { GRE_SEQ } else { 0 };
            let mut v = GreHdr {
                flags_version: flags.to_be_bytes(),
                protocol: proto.to_be_bytes(),
            }
            .as_bytes()
            .to_vec();
            for f in [key, seq].into_iter().flatten() {
                v.extend_from_slice(&f.to_be_bytes());
            }
            v
        };
        // Where the frame's IP packet starts, and its EtherType (for GRE carrying IP).
        let mut l3 = EthHdr::LEN - 2;
        while matches!(
            u16::from_be_bytes([frame[l3], frame[l3 + 1]]),
            ETH_P_8021Q | ETH_P_8021AD
        ) {
            l3 += VlanHdr::LEN;
        }
        let ip_type = u16::from_be_bytes([frame[l3], frame[l3 + 1]]);
        l3 += 2;
        let mut payload = match *self {
            Mirror::GreEthernet { key } => gre(GRE_PROTO_TEB, key, None),
            Mirror::GreIp { key } => gre(ip_type, key, None),
            Mirror::ErspanII { session, seq, index } => {
                let mut v = gre(GRE_PROTO_ERSPAN_II, None, Some(seq));
                let hdr = ErspanIIHdr {
                    ver_vlan: ((ERSPAN_II_VERSION as u16) << 12).to_be_bytes(),
                    cos_en_t_session: (session & ERSPAN_SESSION_MASK).to_be_bytes(),
                    reserved_index: (index & 0x000f_ffff).to_be_bytes(),
                };
                v.extend_from_slice(hdr.as_bytes());
                v
            }
            Mirror::ErspanIII {
                session,
                seq,
                timestamp,
                platform,
            } => {
                let mut v = gre(GRE_PROTO_ERSPAN_III, None, Some(seq));
                let hdr = ErspanIIIHdr {
                    ver_vlan: ((ERSPAN_III_VERSION as u16) << 12).to_be_bytes(),
                    cos_bso_t_session: (session & ERSPAN_SESSION_MASK).to_be_bytes(),
                    timestamp: timestamp.to_be_bytes(),
                    sgt: [0, 0],
                    // Frame type 0 (Ethernet), granularity 3 (IEEE 1588), O as asked.
                    flags: [0, 0b110 | platform as u8],
                };
                v.extend_from_slice(hdr.as_bytes());
                if platform {
                    v.extend_from_slice(
                        ErspanIIIPlatformHdr {
                            bytes: [0x0c, 0, 0, 0x05, 0, 0, 0, 0],
                        }
                        .as_bytes(),
                    );
                }
                v
            }
        };
        match self {
            Mirror::GreIp { .. } => payload.extend_from_slice(&frame[l3..]),
            _ => payload.extend_from_slice(frame),
        }
        let ip = ip_header(src, dst, 0, 64, IPPROTO_GRE, payload.len() as u16, &[]);
        let et = if src.is_ipv4() { ETH_P_IPV4 } else { ETH_P_IPV6 };
        let mut inner = ip;
        inner.extend_from_slice(&payload);
        ethernet(
            [0x02, 0, 0, 0, 0, 0xaa],
            [0x02, 0, 0, 0, 0, 0xbb],
            &[],
            et,
            &inner,
        )
    }
}

/// Ethernet framing around `payload`, tags outermost first, padded to 60 bytes.
pub fn ethernet(dst: [u8; 6], src: [u8; 6], vlans: &[(u16, u16)], ethertype: u16, payload: &[u8]) -> Vec<u8> {
    let first_type = vlans.first().map(|v| v.0).unwrap_or(ethertype);
    let mut f = EthHdr {
        dst,
        src,
        ether_type: first_type.to_be_bytes(),
    }
    .as_bytes()
    .to_vec();
    for (i, &(_, tci)) in vlans.iter().enumerate() {
        let next = vlans.get(i + 1).map(|v| v.0).unwrap_or(ethertype);
        f.extend_from_slice(
            VlanHdr {
                tci: tci.to_be_bytes(),
                ether_type: next.to_be_bytes(),
            }
            .as_bytes(),
        );
    }
    f.extend_from_slice(payload);
    if f.len() < 60 {
        f.resize(60, 0);
    }
    f
}

/// UDP checksum over IPv6 (`udp`: the datagram with a zero checksum field).
pub fn udp6_checksum(src: &std::net::Ipv6Addr, dst: &std::net::Ipv6Addr, udp: &[u8]) -> u16 {
    let mut pseudo = [0u8; 40];
    pseudo[..16].copy_from_slice(&src.octets());
    pseudo[16..32].copy_from_slice(&dst.octets());
    pseudo[32..36].copy_from_slice(&(udp.len() as u32).to_be_bytes());
    pseudo[39] = IPPROTO_UDP;
    match inet_checksum(udp, ones_sum(&pseudo, 0)) {
        0 => 0xffff,
        c => c,
    }
}

fn ones_sum(data: &[u8], init: u32) -> u32 {
    let mut sum = init;
    for chunk in data.chunks(2) {
        let w = if chunk.len() == 2 {
            u16::from_be_bytes([chunk[0], chunk[1]])
        } else {
            (chunk[0] as u16) << 8
        };
        sum += w as u32;
    }
    sum
}

/// The Internet checksum of `data` with a running one's-complement sum `init`.
pub fn inet_checksum(data: &[u8], init: u32) -> u16 {
    let mut sum = ones_sum(data, init);
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

#[cfg(test)]
mod tests {
    use super::*;
    use roce_trace_common::parse::{SlicePacket, parse};

    /// The ICRC is a packet identity because it ignores exactly what the fabric may change.
    #[test]
    fn icrc_masks_exactly_the_variant_fields() {
        let f = RoceFrame {
            opcode: 0x81,
            becn: true,
            dest_qp: 0x118,
            ext: ext::cnp(),
            ..Default::default()
        };
        let a = f.ip_packet();
        // Changing a variant field (TOS, TTL, UDP checksum, BTH byte 4) keeps the ICRC...
        let mut b = a.clone();
        b[1] = 0x03;
        b[8] = 3;
        b[20 + 6] = 0x12;
        b[20 + 8 + 4] = 0x00;
        assert_eq!(icrc(&a), icrc(&b));
        // ...an invariant one (DestQP) does not.
        let mut c = a.clone();
        c[20 + 8 + 7] ^= 1;
        assert_ne!(icrc(&a), icrc(&c));
    }

    /// Found by the `packet` fuzz harness: an IPv4 IHL of 0 put the UDP header at the
    /// IP header's start and `icrc_prefix` indexed past the 8 bytes it was given.
    #[test]
    fn icrc_of_an_ipv4_header_shorter_than_20_bytes_is_none() {
        let a = RoceFrame::default().ip_packet();
        for ihl in 0..5u8 {
            let mut b = a.clone();
            b[0] = 0x40 | ihl;
            assert_eq!(icrc(&b), None, "IHL {ihl}");
            assert_eq!(check_icrc(&b, 0, Some([0; 4])), None, "IHL {ihl}");
        }
        // The shape of the fuzzer's input (fuzz/corpus/packet/crash-icrc-ipv4-ihl0):
        // version 4, IHL 0, and at bytes 4..6 a UDP length the slice holds.
        let mut short = vec![0x40, 0, 0, 0, 0, 24];
        short.resize(24, 0);
        assert_eq!(icrc(&short), None);
        assert!(icrc(&a).is_some());
    }

    #[test]
    fn built_frame_parses_back() {
        let f = RoceFrame {
            vlans: vec![(ETH_P_8021AD, (5 << 13) | 100), (ETH_P_8021Q, (3 << 13) | 200)],
            opcode: 0x06,
            ext: ext::reth(0x1000, 0xabcd, 4096),
            payload: vec![7; 100],
            psn: 0xfffffe,
            ..Default::default()
        };
        let bytes = f.build();
        let p = parse(&SlicePacket::new(&bytes), ROCEV2_UDP_PORT).unwrap();
        assert_eq!(p.vlan_depth, 2);
        assert_eq!(p.pcp(), Some(5));
        assert_eq!(p.bth.psn(), 0xfffffe);
        assert_eq!(p.reth_dma_len(), Some(4096));
        let ip = &bytes[22..];
        assert_eq!(p.icrc(), icrc(ip));
    }

    #[test]
    fn ipv4_header_checksum_is_valid() {
        let ip = RoceFrame {
            ipv4_options: vec![1, 1, 1, 0],
            ..Default::default()
        }
        .ip_packet();
        assert_eq!(ip[0] & 0x0f, 6);
        assert_eq!(inet_checksum(&ip[..24], 0), 0);
    }
}
