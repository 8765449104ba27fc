//! The shared parser on the host, over byte slices: field extraction and every reason a
//! frame is skipped. (The same code runs in the kernel; tests/ checks it there.)

use roce_trace::frame::{RoceFrame, ethernet, ext};
use roce_trace_common::{
    datapath::GlobalCounter as Skip,
    parse::{SlicePacket, parse},
    roce::{AckKind, op},
    wire::*,
};

fn p(frame: &[u8]) -> Result<roce_trace_common::parse::Parsed, Skip> {
    parse(&SlicePacket::new(frame), ROCEV2_UDP_PORT)
}

#[test]
fn fields_of_a_write_first() {
    let s = RoceFrame {
        src: "192.0.2.1".parse().unwrap(),
        dst: "192.0.2.9".parse().unwrap(),
        dscp: 26,
        ecn: 2,
        ttl: 61,
        udp_sport: 0xc123,
        opcode: op::WRITE_FIRST,
        solicited: true,
        pkey: 0x8001,
        fecn: true,
        dest_qp: 0xabcdef,
        ack_req: true,
        psn: 0x123456,
        ext: ext::reth(0xdead_beef_0000, 0x55, 65536),
        payload: vec![0; 1024],
        ..Default::default()
    };
    let got = p(&s.build()).unwrap();
    assert_eq!(got.ip_version, 4);
    assert_eq!(&got.src[12..], &[192, 0, 2, 1]);
    assert_eq!(&got.src[..12], &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff]);
    assert_eq!((got.dscp, got.ecn, got.ttl), (26, 2, 61));
    assert_eq!(got.udp_sport, 0xc123);
    assert_eq!(got.udp_len as usize, 8 + 12 + 16 + 1024 + 4);
    assert_eq!(got.bth.opcode, op::WRITE_FIRST);
    assert!(got.bth.solicited() && got.bth.mig_req() && got.bth.fecn() && !got.bth.becn());
    assert_eq!(got.bth.pkey(), 0x8001);
    assert_eq!(got.bth.dest_qp(), 0xabcdef);
    assert!(got.bth.ack_req());
    assert_eq!(got.bth.psn(), 0x123456);
    assert_eq!(got.reth_dma_len(), Some(65536));
    assert_eq!(got.aeth(), None);
    assert_eq!(got.pcp(), None);
    assert_eq!(got.icrc(), roce_trace::frame::icrc(&s.ip_packet()));
}

#[test]
fn acks_naks_and_read_responses() {
    let ack = |syn| {
        p(&RoceFrame {
            opcode: op::ACKNOWLEDGE,
            ext: ext::aeth(syn, 77),
            ..Default::default()
        }
        .build())
        .unwrap()
    };
    assert_eq!(ack(0x1f).ack_kind(), Some(AckKind::Ack));
    assert_eq!(ack(0x1f).aeth().unwrap().msn(), 77);
    assert_eq!(ack(0x60).ack_kind(), Some(AckKind::NakPsnSeqErr));
    assert_eq!(ack(0x22).ack_kind(), Some(AckKind::RnrNak));
    assert_eq!(ack(0x63).ack_kind(), Some(AckKind::NakOther));
    let resp = p(&RoceFrame {
        opcode: op::READ_RESPONSE_LAST,
        ext: ext::aeth(0x1f, 1),
        ..Default::default()
    }
    .build())
    .unwrap();
    assert!(resp.aeth().is_some());
    assert_eq!(resp.ack_kind(), None, "a read response is not an ACK");
}

#[test]
fn icrc_is_found_from_the_udp_length_not_the_frame_end() {
    // A short CNP: Ethernet pads it to 60 bytes, so the frame's last 4 bytes are padding.
    let s = RoceFrame {
        opcode: 0x81,
        ext: ext::cnp(),
        ..Default::default()
    };
    let mut f = s.build();
    f.extend_from_slice(&[0xee; 8]); // extra trailer bytes, as some NICs capture
    assert_eq!(p(&f).unwrap().icrc(), roce_trace::frame::icrc(&s.ip_packet()));
}

#[test]
fn ipv6_and_tags() {
    let s = RoceFrame {
        src: "fd00::1".parse().unwrap(),
        dst: "fd00::2".parse().unwrap(),
        dscp: 46,
        ecn: 3,
        ttl: 2,
        vlans: vec![(ETH_P_8021Q, (6 << 13) | 42)],
        ..Default::default()
    };
    let got = p(&s.build()).unwrap();
    assert_eq!((got.ip_version, got.dscp, got.ecn, got.ttl), (6, 46, 3, 2));
    assert_eq!(got.pcp(), Some(6));
    assert_eq!(got.vlan_depth, 1);
    let offloaded = s.build();
    let mut sp = SlicePacket::new(&offloaded);
    sp.vlan_tci = Some(5 << 13);
    assert_eq!(
        parse(&sp, ROCEV2_UDP_PORT).unwrap().pcp(),
        Some(5),
        "the offloaded (outer) tag wins"
    );
}

#[test]
fn every_skip_reason() {
    let good = RoceFrame::default().build();
    assert_eq!(p(&good[..10]), Err(Skip::TruncatedL2));
    assert_eq!(p(&good[..14 + 12]), Err(Skip::TruncatedIp));
    assert_eq!(p(&good[..14 + 20 + 4]), Err(Skip::TruncatedUdp));
    assert_eq!(p(&good[..14 + 20 + 8 + 6]), Err(Skip::TruncatedBth));
    let mut bad_ihl = good.clone();
    bad_ihl[14] = 0x44;
    assert_eq!(p(&bad_ihl), Err(Skip::BadIpHeader));
    let mut frag = good.clone();
    frag[14 + 7] = 1; // fragment offset 8
    assert_eq!(p(&frag), Err(Skip::Fragment));
    let mut long_udp = good.clone();
    long_udp[14 + 20 + 4..14 + 20 + 6].copy_from_slice(&2000u16.to_be_bytes());
    assert_eq!(
        p(&long_udp),
        Err(Skip::BadUdpLength),
        "UDP longer than its IP payload"
    );
    let ack_no_aeth = RoceFrame {
        opcode: op::ACKNOWLEDGE,
        ..Default::default()
    }
    .build();
    assert_eq!(p(&ack_no_aeth), Err(Skip::TruncatedExtHeader));
    assert_eq!(
        p(&RoceFrame {
            udp_dport: 4790,
            ..Default::default()
        }
        .build()),
        Err(Skip::NonRoce)
    );
    let v1 = ethernet([1; 6], [2; 6], &[], ETH_P_ROCEV1, &[0; 60]);
    assert_eq!(p(&v1), Err(Skip::RoceV1));
    let deep: Vec<(u16, u16)> = (0..5).map(|i| (ETH_P_8021AD, i)).collect();
    assert_eq!(
        p(&RoceFrame {
            vlans: deep,
            ..Default::default()
        }
        .build()),
        Err(Skip::VlanTooDeep)
    );
    // IPv6 with five hop-by-hop headers in a row is too deep to walk.
    let s = RoceFrame {
        src: "fd00::1".parse().unwrap(),
        dst: "fd00::2".parse().unwrap(),
        ..Default::default()
    };
    let ip = s.ip_packet();
    let mut chain = ip[..40].to_vec();
    chain[6] = 0;
    for i in 0..5 {
        chain.extend_from_slice(&[if i == 4 { IPPROTO_UDP } else { 0 }, 0, 1, 4, 0, 0, 0, 0]);
    }
    let plen = u16::from_be_bytes([ip[4], ip[5]]) + 40;
    chain[4..6].copy_from_slice(&plen.to_be_bytes());
    chain.extend_from_slice(&ip[40..]);
    assert_eq!(
        p(&ethernet([1; 6], [2; 6], &[], ETH_P_IPV6, &chain)),
        Err(Skip::Ipv6ExtTooDeep)
    );
    let mut v6frag = s.build();
    v6frag[14 + 6] = IPV6_EXT_FRAGMENT;
    assert_eq!(p(&v6frag), Err(Skip::Fragment));
}

mod mirrored {
    use std::net::IpAddr;

    use roce_trace::frame::{Mirror, RoceFrame, check_icrc, ext};
    use roce_trace_common::{
        account::flow_key,
        datapath::{
            GlobalCounter as Skip, HAS_MIRROR, MIRROR_ERSPAN_I, MIRROR_ERSPAN_II, MIRROR_ERSPAN_III,
            MIRROR_GRE,
        },
        roce::op,
        wire::*,
    };

    use super::p;

    fn switch() -> IpAddr {
        "198.51.100.7".parse().unwrap()
    }
    fn analyser() -> IpAddr {
        "198.51.100.1".parse().unwrap()
    }
    fn inner() -> RoceFrame {
        RoceFrame {
            vlans: vec![(ETH_P_8021Q, (3 << 13) | 100)],
            dscp: 26,
            ecn: 3,
            ttl: 62,
            psn: 0x10203,
            dest_qp: 0x4455,
            opcode: op::ACKNOWLEDGE,
            ext: ext::aeth(0x1f, 7),
            ..Default::default()
        }
    }

    /// Every encapsulation decapsulates to the inner packet's fields, with the switch and
    /// the session recorded, and the ICRC found and correct at the inner packet's offset.
    #[test]
    fn every_mirror_encapsulation_yields_the_inner_packet() {
        let f = inner();
        let frame = f.build();
        let cases = [
            (
                Mirror::ErspanII {
                    session: 0x3ff,
                    seq: 9,
                    index: 0xfffff,
                },
                MIRROR_ERSPAN_II,
                0x3ff,
                true,
            ),
            (
                Mirror::ErspanIII {
                    session: 17,
                    seq: 1,
                    timestamp: 5,
                    platform: false,
                },
                MIRROR_ERSPAN_III,
                17,
                true,
            ),
            (
                Mirror::ErspanIII {
                    session: 18,
                    seq: 1,
                    timestamp: 5,
                    platform: true,
                },
                MIRROR_ERSPAN_III,
                18,
                true,
            ),
            (
                Mirror::GreEthernet {
                    key: Some(0xdead_beef),
                },
                MIRROR_GRE,
                0xdead_beef,
                true,
            ),
            (Mirror::GreEthernet { key: None }, MIRROR_GRE, 0, true),
            (Mirror::GreIp { key: Some(5) }, MIRROR_GRE, 5, false),
        ];
        for (m, kind, session, has_l2) in cases {
            let bytes = m.encapsulate(switch(), analyser(), &frame);
            let got = p(&bytes).unwrap_or_else(|e| panic!("{m:?}: {e:?}"));
            assert_eq!(&got.src[12..], &[10, 0, 0, 1], "{m:?}: inner source");
            assert_eq!(&got.dst[12..], &[10, 0, 0, 2], "{m:?}");
            assert_eq!(
                (got.dscp, got.ecn, got.ttl),
                (26, 3, 62),
                "{m:?}: inner class and TTL"
            );
            assert_eq!((got.bth.psn(), got.bth.dest_qp()), (0x10203, 0x4455), "{m:?}");
            assert_eq!(got.aeth().map(|a| a.syndrome), Some(0x1f), "{m:?}");
            assert_eq!(got.present & HAS_MIRROR, HAS_MIRROR, "{m:?}");
            let info = got.mirror().unwrap();
            assert_eq!(&info.addr()[12..], &[198, 51, 100, 7], "{m:?}: the switch");
            assert_eq!(
                (info.session, info.kind),
                (session, kind),
                "{m:?}: session and kind"
            );
            // The flow key carries the session as its id, and only the id.
            assert_eq!(got.mirror_id, info.id(), "{m:?}: mirror id");
            assert_ne!(got.mirror_id, 0, "{m:?}");
            assert_eq!(flow_key(&got, 0, 0).mirror, got.mirror_id, "{m:?}: key");
            // The inner tag gives the PCP; GRE carrying IP has none.
            assert_eq!(got.pcp(), has_l2.then_some(3), "{m:?}: pcp");
            assert_eq!(got.vlan_depth, has_l2 as u8, "{m:?}");
            assert_eq!(got.icrc(), roce_trace::frame::icrc(&f.ip_packet()), "{m:?}: icrc");
            assert_eq!(
                check_icrc(&bytes, got.l3_off as usize, got.icrc()),
                Some(true),
                "{m:?}"
            );
        }
    }

    #[test]
    fn ipv6_outer_and_inner_and_erspan_type_i() {
        let f = RoceFrame {
            src: "fd00::1".parse().unwrap(),
            dst: "fd00::2".parse().unwrap(),
            ..inner()
        };
        let bytes = Mirror::ErspanII {
            session: 1,
            seq: 0,
            index: 0,
        }
        .encapsulate(
            "2001:db8::7".parse().unwrap(),
            "2001:db8::1".parse().unwrap(),
            &f.build(),
        );
        let got = p(&bytes).unwrap();
        assert_eq!(got.ip_version, 6);
        assert_eq!(
            got.mirror().unwrap().addr(),
            "2001:db8::7".parse::<std::net::Ipv6Addr>().unwrap().octets()
        );
        // Type I: 0x88BE without a sequence number, the frame right after GRE.
        let mut t1 = Mirror::GreEthernet { key: None }.encapsulate(switch(), analyser(), &inner().build());
        t1[14 + 20 + 2..14 + 20 + 4].copy_from_slice(&GRE_PROTO_ERSPAN_II.to_be_bytes());
        let t1 = p(&t1).unwrap();
        assert_eq!(t1.mirror().unwrap().kind, MIRROR_ERSPAN_I);
        // Same switch, session 0, another kind: another id.
        let gre = p(&Mirror::GreEthernet { key: None }.encapsulate(switch(), analyser(), &inner().build()))
            .unwrap();
        assert_eq!(gre.mirror().unwrap().session, t1.mirror().unwrap().session);
        assert_ne!(gre.mirror_id, t1.mirror_id);
    }

    /// The kernel reuses one `Parsed` per CPU: a plain packet after a mirrored one must
    /// not inherit its session (the parser clears only the id, so the key is what counts).
    #[test]
    fn a_plain_packet_after_a_mirrored_one_has_no_mirror_id() {
        use roce_trace_common::parse::{INNER_HEAD_LEN, Parsed, SlicePacket, parse_into};
        let mut out = Parsed::default();
        let mut buf = [0u8; INNER_HEAD_LEN];
        let mirrored =
            Mirror::GreEthernet { key: Some(9) }.encapsulate(switch(), analyser(), &inner().build());
        parse_into(&SlicePacket::new(&mirrored), ROCEV2_UDP_PORT, &mut out, &mut buf).unwrap();
        assert_ne!(flow_key(&out, 1, 0).mirror, 0);
        parse_into(
            &SlicePacket::new(&inner().build()),
            ROCEV2_UDP_PORT,
            &mut out,
            &mut buf,
        )
        .unwrap();
        assert_eq!(out.present & HAS_MIRROR, 0);
        assert_eq!(out.mirror(), None);
        assert_eq!(flow_key(&out, 1, 0).mirror, 0);
    }

    /// Cut anywhere inside the GRE or ERSPAN header: a skip count, not a parse.
    #[test]
    fn truncated_and_bad_encapsulation_is_a_skip_reason() {
        let frame = inner().build();
        let enc = |m: Mirror| m.encapsulate(switch(), analyser(), &frame);
        let outer = 14 + 20;
        let cut = |mut b: Vec<u8>, at: usize| {
            b.truncate(at);
            // The outer IP length still claims the whole payload, as a snaplen cut leaves it.
            b
        };
        let e2 = enc(Mirror::ErspanII {
            session: 1,
            seq: 1,
            index: 1,
        });
        for at in [outer + 2, outer + 6, outer + 8 + 4] {
            assert_eq!(
                p(&cut(e2.clone(), at)),
                Err(Skip::TruncatedEncap),
                "ERSPAN II cut at {at}"
            );
        }
        let e3 = enc(Mirror::ErspanIII {
            session: 1,
            seq: 1,
            timestamp: 0,
            platform: true,
        });
        for at in [outer + 8 + 10, outer + 8 + 12 + 4] {
            assert_eq!(
                p(&cut(e3.clone(), at)),
                Err(Skip::TruncatedEncap),
                "ERSPAN III cut at {at}"
            );
        }
        let keyed = enc(Mirror::GreEthernet { key: Some(1) });
        assert_eq!(
            p(&cut(keyed, outer + 6)),
            Err(Skip::TruncatedEncap),
            "GRE key cut"
        );
        // An IP payload too short for the GRE header it announces.
        let mut short = enc(Mirror::GreEthernet { key: Some(1) });
        short[14 + 2..14 + 4].copy_from_slice(&(20u16 + 6).to_be_bytes());
        assert_eq!(p(&short), Err(Skip::TruncatedEncap));
        // Wrong versions: GRE version 1 (PPTP), ERSPAN II header saying version 2.
        let mut v1 = e2.clone();
        v1[outer + 1] |= 1;
        assert_eq!(p(&v1), Err(Skip::BadEncap));
        let mut bad = e2.clone();
        bad[outer + 8] = 0x20;
        assert_eq!(p(&bad), Err(Skip::BadEncap));
        // Type III frame type IP (not Ethernet): not decapsulated.
        let mut ft = enc(Mirror::ErspanIII {
            session: 1,
            seq: 1,
            timestamp: 0,
            platform: false,
        });
        ft[outer + 8 + 10] = 2 << 2;
        assert_eq!(p(&ft), Err(Skip::BadEncap));
        // The mirrored frame itself cut short: the inner layer's reason.
        assert_eq!(
            p(&cut(e2.clone(), outer + 16 + 14 + 4 + 10)),
            Err(Skip::TruncatedIp)
        );
        // GRE of another protocol (MPLS) is simply not RoCE; nor is GRE inside GRE.
        let mut mpls = enc(Mirror::GreEthernet { key: None });
        mpls[outer + 2..outer + 4].copy_from_slice(&0x8847u16.to_be_bytes());
        assert_eq!(p(&mpls), Err(Skip::NonRoce));
        let nested = Mirror::GreEthernet { key: None }.encapsulate(switch(), analyser(), &e2);
        assert_eq!(p(&nested), Err(Skip::NonRoce));
    }
}

/// The kernel's first test on every frame lets by only what the parser calls non-RoCE,
/// and lets by the plain non-RoCE frames: checked on frames of every shape (tags, IPv6,
/// options, mirrors, other protocols and ports) and on each of them with bytes changed
/// and cut short — a RoCEv2 packet or a counted failure let by would vanish from every
/// count.
#[test]
fn the_first_test_lets_by_only_what_the_parser_calls_non_roce() {
    use roce_trace::frame::Mirror;
    use roce_trace_common::{
        account,
        datapath::FlowKey,
        parse::{
            Facts, INNER_HEAD_LEN, Look, PLAIN_V4_REQUEST_LEN, Parsed, PlainV4, first_look, parse_into,
            parse_plain_v4_into, plain_v4, plain_v4_checks, plain_v4_fields, plain_v4_syndrome,
            surely_not_roce,
        },
        roce,
    };
    // A request's frame that holds PLAIN_V4_REQUEST_LEN bytes: whether it passes the
    // checks, by its lengths and opcode (the kernel counts a repeat without them).
    let mut by_lens = std::collections::HashMap::new();
    let mut repeats_judged = 0;
    // A response's frame that holds its opcode's extended headers
    // (`plain_v4_syndrome`): whether it passes the checks, by its lengths and opcode.
    let mut by_lens_resp = std::collections::HashMap::new();
    let mut responses_judged = 0;
    let v6 = |mut s: RoceFrame| {
        s.src = "fd00::1".parse().unwrap();
        s.dst = "fd00::2".parse().unwrap();
        s
    };
    let send = RoceFrame {
        opcode: op::SEND_ONLY,
        payload: vec![7; 64],
        ..Default::default()
    };
    let mut shapes: Vec<Vec<u8>> = vec![
        send.build(),
        v6(send.clone()).build(),
        RoceFrame {
            vlans: vec![(ETH_P_8021Q, 3 << 13 | 100)],
            ..send.clone()
        }
        .build(),
        RoceFrame {
            vlans: vec![(ETH_P_8021AD, 10), (ETH_P_8021Q, 100)],
            ..v6(send.clone())
        }
        .build(),
        RoceFrame {
            ipv4_options: vec![1, 1, 1, 1],
            ..send.clone()
        }
        .build(),
        RoceFrame {
            udp_dport: 53,
            ..send.clone()
        }
        .build(),
        RoceFrame {
            udp_dport: 53,
            ..v6(send.clone())
        }
        .build(),
        Mirror::ErspanII {
            session: 1,
            seq: 1,
            index: 1,
        }
        .encapsulate(
            "198.51.100.7".parse().unwrap(),
            "198.51.100.1".parse().unwrap(),
            &send.build(),
        ),
        ethernet([0xff; 6], [2; 6], &[], 0x0806, &[0, 1, 8, 0, 6, 4, 0, 1]),
        // The extended headers the fast path checks: an AETH (and NAKs by mutation), a
        // RETH, a DETH.
        RoceFrame {
            opcode: op::ACKNOWLEDGE,
            ext: roce_trace::frame::ext::aeth(0x1f, 9),
            payload: Vec::new(),
            ..send.clone()
        }
        .build(),
        RoceFrame {
            opcode: op::WRITE_FIRST,
            ext: roce_trace::frame::ext::reth(0x1000, 7, 4096),
            ..send.clone()
        }
        .build(),
        RoceFrame {
            opcode: roce_trace_common::roce::OP_UD_SEND_ONLY,
            ext: roce_trace::frame::ext::deth(0x1111, 0x22),
            ..send.clone()
        }
        .build(),
    ];
    for proto in [6u8, 1, 47, 17] {
        let mut f = send.build();
        f[14 + 9] = proto;
        shapes.push(f);
        let mut f = v6(send.clone()).build();
        f[14 + 6] = proto;
        shapes.push(f);
    }
    let mut x = 0x2545_f491u32;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        x
    };
    let (mut let_by, mut checked, mut plain, mut fast_read) = (0, 0, 0, 0);
    let mut check = |f: &[u8]| {
        checked += 1;
        let pkt = SlicePacket::new(f);
        match first_look(&pkt, ROCEV2_UDP_PORT) {
            Look::NotRoce => {
                let_by += 1;
                assert_eq!(p(f).err(), Some(Skip::NonRoce), "let by: {f:02x?}");
            }
            // The short way for the common shape gives the parser's every field and error.
            Look::PlainV4 => {
                plain += 1;
                let mut a = Parsed::default();
                let mut b = Parsed::default();
                let mut inner = [0u8; INNER_HEAD_LEN];
                let ra = parse_into(&pkt, ROCEV2_UDP_PORT, &mut a, &mut inner);
                let rb = parse_plain_v4_into(&pkt, ROCEV2_UDP_PORT, &mut b);
                assert_eq!(ra, rb, "{f:02x?}");
                if ra.is_ok() {
                    assert_eq!(a, b, "{f:02x?}");
                }
                // The kernel's fast path reads the same frame in place: it reads a frame
                // exactly when the parser parses it, and then what accounting and the flow
                // key take from the parsed headers, with a tag offloaded or not.
                for tci in [None, Some(5 << 13 | 7)] {
                    let mut pkt = SlicePacket::new(f);
                    pkt.vlan_tci = tci;
                    let q = plain_v4(&pkt);
                    let mut b = Parsed::default();
                    let rb = parse_plain_v4_into(&pkt, ROCEV2_UDP_PORT, &mut b);
                    assert_eq!(q.is_some(), rb.is_ok(), "{rb:?} {f:02x?}");
                    // What the fast path reads first, then checks: plain_v4 in two.
                    let fields = plain_v4_fields(&pkt);
                    let checked =
                        fields.and_then(|x| Some((x, plain_v4_checks(&pkt, x.facts.opcode, x.lens)?)));
                    assert_eq!(
                        checked.map(|(x, syndrome)| PlainV4 {
                            facts: Facts { syndrome, ..x.facts },
                            ..x
                        }),
                        q,
                        "{f:02x?}"
                    );
                    if let Some(x) = fields
                        && roce::is_request(x.facts.opcode)
                        && f.len() >= PLAIN_V4_REQUEST_LEN
                    {
                        // A request's checks in such a frame are its lengths' and opcode's,
                        // and it has no syndrome: what a repeat is counted by.
                        let passes = plain_v4_checks(&pkt, x.facts.opcode, x.lens);
                        assert!(matches!(passes, None | Some(0)), "{f:02x?}");
                        let first = by_lens
                            .entry((x.lens, x.facts.opcode))
                            .or_insert_with(|| (passes.is_some(), f.to_vec()));
                        assert_eq!(
                            passes.is_some(),
                            first.0,
                            "the same lengths and opcode, checked otherwise: {f:02x?} and {:02x?}",
                            first.1
                        );
                        repeats_judged += 1;
                    }
                    if let Some(x) = fields
                        && !roce::is_request(x.facts.opcode)
                        && let Some(syndrome) = plain_v4_syndrome(&pkt, x.facts.opcode)
                    {
                        // A response's checks in a frame that holds its extended headers
                        // are its lengths' and opcode's, and the syndrome is the one read:
                        // what a response's repeat is counted by.
                        let passes = plain_v4_checks(&pkt, x.facts.opcode, x.lens);
                        assert!(passes.is_none_or(|p| p == syndrome), "{f:02x?}");
                        let first = by_lens_resp
                            .entry((x.lens, x.facts.opcode))
                            .or_insert_with(|| (passes.is_some(), f.to_vec()));
                        assert_eq!(
                            passes.is_some(),
                            first.0,
                            "a response of the same lengths and opcode, checked otherwise: {f:02x?} \
                             and {:02x?}",
                            first.1
                        );
                        responses_judged += 1;
                    }
                    if let Some(q) = q {
                        fast_read += 1;
                        assert_eq!(q.facts, Facts::of(&b), "{f:02x?}");
                        for (ifindex, dir) in [(3, 0), (70_000, 1)] {
                            assert_eq!(
                                account::plain_v4_key_words(&q.key, ifindex, dir),
                                account::set_flow_key(&mut FlowKey::default(), &b, ifindex, dir),
                                "{f:02x?}"
                            );
                        }
                    }
                }
            }
            Look::Other => {}
        }
        assert_eq!(
            surely_not_roce(&pkt, ROCEV2_UDP_PORT),
            first_look(&pkt, ROCEV2_UDP_PORT) == Look::NotRoce
        );
    };
    for s in &shapes {
        check(s);
        for _ in 0..3000 {
            let mut f = s.clone();
            // Change one to three bytes among the first 80 (every header the test reads).
            for _ in 0..1 + next() % 3 {
                let at = next() as usize % f.len().min(80);
                f[at] = next() as u8;
            }
            if next() % 4 == 0 {
                f.truncate(next() as usize % f.len());
            }
            check(&f);
        }
    }
    // The plain non-RoCE shapes are let by (the point of the test: they cost nothing).
    for (i, f) in shapes.iter().enumerate() {
        let plain = p(f).err() == Some(Skip::NonRoce)
            && !matches!(u16::from_be_bytes([f[12], f[13]]), ETH_P_8021Q | ETH_P_8021AD)
            && !(f[12] == 8 && f[13] == 0 && f[14] != 0x45);
        assert_eq!(
            surely_not_roce(&SlicePacket::new(f), ROCEV2_UDP_PORT),
            plain,
            "shape {i}: {f:02x?}"
        );
    }
    assert!(
        let_by > 1000 && plain > 1000 && fast_read > 1000 && checked > 40_000,
        "{let_by} let by, {plain} plain IPv4 ({fast_read} read by the fast path) of {checked}"
    );
    // Frames judged against another of the same lengths and opcode, passing and not.
    let passing = by_lens.values().filter(|v| v.0).count();
    assert!(
        repeats_judged > 1000 && by_lens.len() > 100 && passing > 10 && passing < by_lens.len(),
        "{repeats_judged} requests judged by {} lengths and opcodes, {passing} passing",
        by_lens.len()
    );
    let passing = by_lens_resp.values().filter(|v| v.0).count();
    assert!(
        responses_judged > 1000 && by_lens_resp.len() > 20 && passing > 5 && passing < by_lens_resp.len(),
        "{responses_judged} responses judged by {} lengths and opcodes, {passing} passing",
        by_lens_resp.len()
    );
}

/// The kernel writes a packet's flow key as six words and hashes and compares those words
/// (`account::set_flow_key`): each field lands where `FlowKey` declares it, for IPv4,
/// IPv6, tagged and mirrored frames, and the slot of the words is the slot of the key.
#[test]
fn the_flow_key_written_as_words_is_the_key_field_by_field() {
    use roce_trace::frame::Mirror;
    use roce_trace_common::{
        account::set_flow_key,
        datapath::{FlowKey, MAX_FLOW_SLOTS},
    };
    let base = RoceFrame {
        opcode: op::SEND_ONLY,
        udp_sport: 0xc1f3,
        dest_qp: 0xa1b2c3,
        payload: vec![7; 64],
        ..Default::default()
    };
    let v6 = RoceFrame {
        src: "fd00::1:2:3".parse().unwrap(),
        dst: "fd00:9::8".parse().unwrap(),
        udp_sport: 0x1234,
        dest_qp: 0x00fe01,
        vlans: vec![(ETH_P_8021Q, 3 << 13 | 100)],
        ..base.clone()
    };
    let frames = [
        base.build(),
        v6.build(),
        Mirror::ErspanII {
            session: 5,
            seq: 1,
            index: 1,
        }
        .encapsulate(
            "198.51.100.7".parse().unwrap(),
            "198.51.100.1".parse().unwrap(),
            &base.build(),
        ),
    ];
    for f in &frames {
        let parsed = p(f).expect("parses");
        for (ifindex, dir) in [(1u32, 0u8), (0x8765_4321, 1)] {
            let mut k = FlowKey {
                src: [0xee; 16],
                dst: [0xee; 16],
                ifindex: 7,
                dest_qp: 7,
                mirror: 7,
                udp_sport: 7,
                direction: 7,
                ip_version: 7,
            };
            let words = set_flow_key(&mut k, &parsed, ifindex, dir);
            let want = FlowKey {
                src: parsed.src,
                dst: parsed.dst,
                ifindex,
                dest_qp: parsed.bth.dest_qp(),
                mirror: parsed.mirror_id,
                udp_sport: parsed.udp_sport,
                direction: dir,
                ip_version: parsed.ip_version,
            };
            assert_eq!(k, want);
            assert_eq!(&words, k.words());
            assert!(k.same_words(want.words()));
            for bits in [0, 1, 7, 11, 31] {
                assert_eq!(FlowKey::slot_of(&words, bits), want.slot(bits));
            }
            assert!(want.slot(MAX_FLOW_SLOTS.trailing_zeros()) < MAX_FLOW_SLOTS);
        }
    }
    assert_ne!(
        p(&frames[2]).unwrap().mirror_id,
        0,
        "the mirrored frame keys its session"
    );
}
