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
