//! Shared by the packet harnesses: RoCEv2 frames built from fuzz input by the product's
//! frame builder (`roce_trace::frame`), and what the parser must make of them.
#![allow(dead_code)]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use arbitrary::{Result, Unstructured};
use roce_trace::frame::{IcrcMode, Mirror, RoceFrame};
use roce_trace_common::{
    datapath::{MIRROR_ERSPAN_II, MIRROR_ERSPAN_III, MIRROR_GRE},
    parse::MAX_VLAN_DEPTH,
    roce::ext_layout,
    wire::{ERSPAN_SESSION_MASK, ETH_P_8021AD, ETH_P_8021Q, ROCEV2_UDP_PORT},
};

/// A frame and what parsing it must give.
pub struct Built {
    pub spec: RoceFrame,
    pub frame: Vec<u8>,
    /// `Some` when the parser must accept it.
    pub want: Option<Want>,
}

/// The fields a parse must yield (beyond those `spec` states).
pub struct Want {
    pub l3_off: usize,
    pub vlan_depth: u8,
    pub pcp: Option<u8>,
    /// Switch (mapped), session, `MIRROR_*`.
    pub mirror: Option<([u8; 16], u32, u8)>,
    pub aeth: Option<(u8, u32)>,
    pub reth_dma_len: Option<u32>,
    pub deth_src_qp: Option<u32>,
    pub icrc: [u8; 4],
}

pub fn mapped(a: IpAddr) -> [u8; 16] {
    match a {
        IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
        IpAddr::V6(a) => a.octets(),
    }
}

fn addr(u: &mut Unstructured, v6: bool) -> Result<IpAddr> {
    Ok(if v6 {
        IpAddr::V6(Ipv6Addr::from(u.arbitrary::<[u8; 16]>()?))
    } else {
        IpAddr::V4(Ipv4Addr::from(u.arbitrary::<[u8; 4]>()?))
    })
}

fn bytes(u: &mut Unstructured, max: usize) -> Result<Vec<u8>> {
    let n = u.int_in_range(0..=max)?;
    let mut v = vec![0u8; n];
    u.fill_buffer(&mut v)?;
    Ok(v)
}

/// A RoCEv2 frame — any opcode, flags, tags, IPv4 options or IPv6, extended headers of
/// any length, sometimes mirrored through GRE/ERSPAN — and what it must parse to.
pub fn roce_frame(u: &mut Unstructured) -> Result<Built> {
    let v6 = u.arbitrary()?;
    let n_tags = u.int_in_range(0..=MAX_VLAN_DEPTH)?;
    let mut vlans = Vec::new();
    for _ in 0..n_tags {
        let tpid = if u.arbitrary()? { ETH_P_8021Q } else { ETH_P_8021AD };
        vlans.push((tpid, u.arbitrary()?));
    }
    let spec = RoceFrame {
        src_mac: u.arbitrary()?,
        dst_mac: u.arbitrary()?,
        vlans,
        src: addr(u, v6)?,
        dst: addr(u, v6)?,
        // At most 40 bytes: the IHL is 4 bits.
        ipv4_options: if v6 { Vec::new() } else { bytes(u, 40)? },
        dscp: u.int_in_range(0..=63)?,
        ecn: u.int_in_range(0..=3)?,
        ttl: u.arbitrary()?,
        udp_sport: u.arbitrary()?,
        udp_dport: ROCEV2_UDP_PORT,
        opcode: u.arbitrary()?,
        solicited: u.arbitrary()?,
        mig_req: u.arbitrary()?,
        pad_cnt: u.int_in_range(0..=3)?,
        pkey: u.arbitrary()?,
        fecn: u.arbitrary()?,
        becn: u.arbitrary()?,
        dest_qp: u.int_in_range(0..=0xff_ffff)?,
        ack_req: u.arbitrary()?,
        psn: u.int_in_range(0..=0xff_ffff)?,
        ext: bytes(u, 40)?,
        payload: bytes(u, 600)?,
        icrc: if u.ratio(1, 8)? {
            IcrcMode::Fixed(u.arbitrary()?)
        } else {
            IcrcMode::Correct
        },
    };
    let mirror = match u.int_in_range(0..=7)? {
        0 => Some(Mirror::GreEthernet { key: u.arbitrary()? }),
        1 => Some(Mirror::GreIp { key: u.arbitrary()? }),
        2 => Some(Mirror::ErspanII {
            session: u.arbitrary()?,
            seq: u.arbitrary()?,
            index: u.arbitrary()?,
        }),
        3 => Some(Mirror::ErspanIII {
            session: u.arbitrary()?,
            seq: u.arbitrary()?,
            timestamp: u.arbitrary()?,
            platform: u.arbitrary()?,
        }),
        _ => None,
    };
    let inner = spec.build();
    let ip = spec.ip_packet();
    let icrc: [u8; 4] = ip[ip.len() - 4..].try_into().unwrap();
    let tags = spec.vlans.len();
    // The UDP payload after the BTH: where the extended headers are read.
    let after_bth = {
        let mut v = spec.ext.clone();
        v.extend_from_slice(&spec.payload);
        v.extend(std::iter::repeat_n(0u8, spec.pad_cnt as usize));
        v
    };
    let layout = ext_layout(spec.opcode);
    let fits = after_bth.len() >= layout.min_len as usize;
    let field = |at: Option<u8>, len: usize| at.map(|at| after_bth[at as usize..at as usize + len].to_vec());
    let mut want = Want {
        l3_off: 14 + 4 * tags,
        vlan_depth: tags as u8,
        pcp: spec.vlans.first().map(|v| (v.1 >> 13) as u8),
        mirror: None,
        aeth: None,
        reth_dma_len: None,
        deth_src_qp: None,
        icrc,
    };
    if fits {
        want.aeth = field(layout.aeth, 4).map(|b| (b[0], u32::from_be_bytes([0, b[1], b[2], b[3]])));
        want.reth_dma_len = field(layout.reth, 16).map(|b| u32::from_be_bytes([b[12], b[13], b[14], b[15]]));
        want.deth_src_qp = field(layout.deth, 8).map(|b| u32::from_be_bytes([0, b[5], b[6], b[7]]));
    }
    let frame = match mirror {
        None => inner,
        Some(m) => {
            let outer_v6 = u.arbitrary()?;
            let sw = addr(u, outer_v6)?;
            let coll = addr(u, outer_v6)?;
            let outer_ip = if outer_v6 { 40 } else { 20 };
            let (kind, session, hdrs) = match m {
                Mirror::GreEthernet { key } => (MIRROR_GRE, key.unwrap_or(0), 4 + 4 * key.is_some() as usize),
                Mirror::GreIp { key } => (MIRROR_GRE, key.unwrap_or(0), 4 + 4 * key.is_some() as usize),
                Mirror::ErspanII { session, .. } => {
                    (MIRROR_ERSPAN_II, (session & ERSPAN_SESSION_MASK) as u32, 8 + 8)
                }
                Mirror::ErspanIII {
                    session, platform, ..
                } => (
                    MIRROR_ERSPAN_III,
                    (session & ERSPAN_SESSION_MASK) as u32,
                    8 + 12 + 8 * platform as usize,
                ),
            };
            let inner_off = 14 + outer_ip + hdrs;
            if let Mirror::GreIp { .. } = m {
                // The IP packet alone: no tags, so no PCP.
                want.l3_off = inner_off;
                want.vlan_depth = 0;
                want.pcp = None;
            } else {
                want.l3_off += inner_off;
            }
            want.mirror = Some((mapped(sw), session, kind));
            m.encapsulate(sw, coll, &inner)
        }
    };
    Ok(Built {
        want: fits.then_some(want),
        spec,
        frame,
    })
}
