//! `trace`'s parser of ICMP and ICMPv6 answers (roce-trace/src/trace.rs, `parse_answer`).
//!
//! - Arbitrary messages: never a panic; an answer is only ever one that quotes a probe of
//!   the flow asked about (its ports, destination and the probe QP).
//! - The quote of a probe a router really sends — type and code of every kind, the
//!   probe's IP header with any class, TTL and IPv4 options, cut after the BTH or not —
//!   gives back the probe's PSN, its class as received, and the kind of answer.
#![no_main]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use arbitrary::Unstructured;
use libfuzzer_sys::fuzz_target;
use roce_trace::{frame::RoceFrame, fuzz_api::icmp_answer, trace::PROBE_QP};

/// An ICMP message off the socket, and the probe flow it is matched against.
struct Raw<'a> {
    v6: bool,
    sport: u16,
    dst: IpAddr,
    msg: &'a [u8],
}

/// Raw input: a flags byte (bit 0: IPv6), the probe's source port (2 bytes, big-endian),
/// its destination (4 or 16 bytes), then the ICMP message from its header on.
fn parse_raw(data: &[u8]) -> Option<Raw<'_>> {
    let (&flags, rest) = data.split_first()?;
    let v6 = flags & 1 == 1;
    let sport = u16::from_be_bytes([*rest.first()?, *rest.get(1)?]);
    let rest = &rest[2..];
    let (dst, msg) = if v6 {
        let a: [u8; 16] = rest.get(..16)?.try_into().ok()?;
        (IpAddr::V6(Ipv6Addr::from(a)), &rest[16..])
    } else {
        let a: [u8; 4] = rest.get(..4)?.try_into().ok()?;
        (IpAddr::V4(Ipv4Addr::from(a)), &rest[4..])
    };
    Some(Raw { v6, sport, dst, msg })
}

fn raw(r: Raw) {
    let from = IpAddr::V4(Ipv4Addr::LOCALHOST);
    if let Some(a) = icmp_answer(r.msg, from, r.v6, r.sport, r.dst) {
        // What it accepted quotes this flow's probe: find the quoted UDP header again.
        let quote = &r.msg[8..];
        let udp = if r.v6 {
            assert_eq!(quote[0] >> 4, 6);
            &quote[40..]
        } else {
            let ihl = (quote[0] & 0x0f) as usize * 4;
            assert!(ihl >= 20, "IHL {ihl}: not an IPv4 header");
            &quote[ihl..]
        };
        assert_eq!(u16::from_be_bytes([udp[0], udp[1]]), r.sport);
        assert_eq!(u16::from_be_bytes([udp[2], udp[3]]), 4791);
        assert_eq!(u32::from_be_bytes([0, udp[13], udp[14], udp[15]]), PROBE_QP);
        assert_eq!(a.psn, u32::from_be_bytes([0, udp[17], udp[18], udp[19]]));
    }
}

/// Type, code, kind, final: ICMP, then ICMPv6.
const KINDS: [[(u8, u8, &str, bool); 6]; 2] = [
    [
        (11, 0, "time-exceeded", false),
        (3, 3, "port-unreachable", true),
        (3, 0, "net-unreachable", true),
        (3, 1, "host-unreachable", true),
        (3, 4, "fragmentation-needed", true),
        (3, 13, "unreachable", true),
    ],
    [
        (3, 0, "time-exceeded", false),
        (1, 4, "port-unreachable", true),
        (1, 0, "net-unreachable", true),
        (1, 3, "host-unreachable", true),
        (2, 0, "packet-too-big", true),
        (1, 1, "unreachable", true),
    ],
];

fn quoted(u: &mut Unstructured) -> arbitrary::Result<()> {
    let v6: bool = u.arbitrary()?;
    let (src, dst) = if v6 {
        (
            IpAddr::V6(Ipv6Addr::from(u.arbitrary::<[u8; 16]>()?)),
            IpAddr::V6(Ipv6Addr::from(u.arbitrary::<[u8; 16]>()?)),
        )
    } else {
        (
            IpAddr::V4(Ipv4Addr::from(u.arbitrary::<[u8; 4]>()?)),
            IpAddr::V4(Ipv4Addr::from(u.arbitrary::<[u8; 4]>()?)),
        )
    };
    let mut options = vec![0u8; if v6 { 0 } else { u.int_in_range(0..=40)? }];
    u.fill_buffer(&mut options)?;
    let probe = RoceFrame {
        src,
        dst,
        udp_sport: u.arbitrary()?,
        dscp: u.int_in_range(0..=63)?,
        ecn: u.int_in_range(0..=3)?,
        ttl: u.arbitrary()?,
        ipv4_options: options,
        dest_qp: PROBE_QP,
        psn: u.int_in_range(0..=0xff_ffff)?,
        payload: vec![0; 4],
        ..Default::default()
    };
    let (ty, code, kind, last) = *u.choose(&KINDS[v6 as usize])?;
    let mut msg = vec![ty, code, 0, 0, 0, 0, 0, 0];
    let ip = probe.ip_packet();
    // Routers quote at least the IP header and 8 bytes; the BTH needs 20 after it.
    let hdr = ip.len() - (8 + 12 + 4 + 4);
    let cut = u.int_in_range(hdr + 20..=ip.len())?;
    msg.extend_from_slice(&ip[..cut]);
    let router = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1));
    let a = icmp_answer(&msg, router, v6, probe.udp_sport, dst).expect("a probe's quote is an answer");
    assert_eq!(a.psn, probe.psn);
    assert_eq!(a.tos, probe.dscp << 2 | probe.ecn, "class as received");
    assert_eq!((a.kind.as_str(), a.final_hop, a.from), (kind, last, router));
    // Another flow's probe is not an answer to this one.
    assert!(icmp_answer(&msg, router, v6, probe.udp_sport.wrapping_add(1), dst).is_none());
    Ok(())
}

// Input: a mode byte; odd: a probe's quote built from the rest, even: the rest raw (see
// [`parse_raw`]).
fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode % 2 == 1 {
        let _ = quoted(&mut Unstructured::new(rest));
    } else if let Some(r) = parse_raw(rest) {
        raw(r);
    }
});
