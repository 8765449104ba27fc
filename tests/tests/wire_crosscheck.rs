//! Our frames and our parser against independent decoders: tshark's dissector and
//! scapy's ICRC; and the real Huawei hardware capture in ../shared.

use roce_trace_common::{
    datapath::*,
    parse::{SlicePacket, parse},
    roce::op,
    wire::*,
};
use roce_trace_datapath::loader::DatapathOptions;
use roce_trace_gen::frame::{RoceFrame, ext, icrc};
use roce_trace_tests::*;

fn specs() -> Vec<RoceFrame> {
    let f = |opcode| RoceFrame {
        opcode,
        ..Default::default()
    };
    let v6 = |s: RoceFrame| RoceFrame {
        src: "fd00::1".parse().unwrap(),
        dst: "fd00::2".parse().unwrap(),
        ..s
    };
    [
        RoceFrame {
            psn: 100,
            ext: ext::reth(0x1000, 5, 4096),
            payload: vec![1; 1024],
            ..f(op::WRITE_FIRST)
        },
        RoceFrame {
            psn: 0xabcdef,
            dest_qp: 0xfedcba,
            payload: vec![1; 1024],
            ..f(op::WRITE_MIDDLE)
        },
        RoceFrame {
            pad_cnt: 2,
            payload: vec![1; 6],
            ack_req: true,
            ..f(op::SEND_ONLY)
        },
        RoceFrame {
            ext: ext::reth(0x1000, 5, 8192),
            ..f(op::READ_REQUEST)
        },
        RoceFrame {
            ext: ext::aeth(0x1f, 9),
            ..f(op::ACKNOWLEDGE)
        },
        RoceFrame {
            ext: ext::aeth(0x60, 9),
            dscp: 0,
            ..f(op::ACKNOWLEDGE)
        },
        RoceFrame {
            opcode: 0x81,
            dscp: 48,
            udp_sport: 0,
            becn: true,
            dest_qp: 0x118,
            ext: ext::cnp(),
            ..Default::default()
        },
        RoceFrame {
            ext: ext::deth(0x1111_1111, 0x42),
            payload: vec![2; 64],
            ..f(0x64)
        },
        RoceFrame {
            ecn: 3,
            ext: ext::reth(0, 1, 32),
            payload: vec![3; 32],
            ..f(op::WRITE_ONLY)
        },
        v6(RoceFrame {
            dscp: 46,
            ecn: 1,
            payload: vec![4; 100],
            ..f(op::SEND_ONLY)
        }),
        RoceFrame {
            vlans: vec![(ETH_P_8021Q, (3 << 13) | 100)],
            ..f(op::SEND_ONLY)
        },
        RoceFrame {
            vlans: vec![(ETH_P_8021AD, (5 << 13) | 7), (ETH_P_8021Q, (3 << 13) | 100)],
            ..f(op::SEND_ONLY)
        },
        RoceFrame {
            ipv4_options: vec![0x94, 4, 0, 0],
            ..f(op::SEND_ONLY)
        },
    ]
    .to_vec()
}

const FIELDS: [&str; 12] = [
    "infiniband.bth.opcode",
    "infiniband.bth.destqp",
    "infiniband.bth.psn",
    "infiniband.invariant.crc",
    "ip.dsfield.dscp",
    "ip.dsfield.ecn",
    "ipv6.tclass.dscp",
    "ipv6.tclass.ecn",
    "vlan.priority",
    "udp.srcport",
    "infiniband.aeth.syndrome",
    // tshark names an 802.1ad (QinQ outer) tag apart from 802.1Q ones.
    "ieee8021ad.priority",
];

/// What tshark says of one frame, in our types.
#[derive(Debug, PartialEq, Eq)]
struct Decoded {
    opcode: u8,
    dest_qp: u32,
    psn: u32,
    icrc: Option<[u8; 4]>,
    dscp: u8,
    ecn: u8,
    pcp: Option<u8>,
    sport: u16,
    syndrome: Option<u8>,
}

fn num(s: &str) -> u64 {
    match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16).unwrap(),
        None => s.parse().unwrap_or_else(|_| panic!("not a number: {s:?}")),
    }
}

fn from_tshark(row: &[String]) -> Decoded {
    let opt = |i: usize| (!row[i].is_empty()).then(|| num(&row[i]));
    let v4 = !row[4].is_empty();
    Decoded {
        opcode: num(&row[0]) as u8,
        dest_qp: num(&row[1]) as u32,
        psn: num(&row[2]) as u32,
        // tshark shows the ICRC as the big-endian number of its wire bytes; it shows none
        // when it hands a SEND payload to another dissector.
        icrc: opt(3).map(|v| (v as u32).to_be_bytes()),
        dscp: num(&row[if v4 { 4 } else { 6 }]) as u8,
        ecn: num(&row[if v4 { 5 } else { 7 }]) as u8,
        pcp: opt(11).or(opt(8)).map(|v| v as u8),
        sport: num(&row[9]) as u16,
        syndrome: opt(10).map(|v| v as u8),
    }
}

fn from_sample(s: &Sample) -> Decoded {
    Decoded {
        opcode: s.opcode,
        dest_qp: s.key.dest_qp,
        psn: s.psn,
        icrc: (s.present & HAS_ICRC != 0).then_some(s.icrc),
        dscp: s.dscp,
        ecn: s.ecn,
        pcp: (s.present & HAS_PCP != 0).then_some(s.pcp),
        sport: s.key.udp_sport,
        syndrome: (s.present & HAS_AETH != 0 && roce_trace_common::roce::is_ack_opcode(s.opcode))
            .then_some(s.aeth_syndrome),
    }
}

fn from_host_parse(frame: &[u8]) -> Option<Decoded> {
    let p = parse(&SlicePacket::new(frame), ROCEV2_UDP_PORT).ok()?;
    Some(Decoded {
        opcode: p.bth.opcode,
        dest_qp: p.bth.dest_qp(),
        psn: p.bth.psn(),
        icrc: p.icrc(),
        dscp: p.dscp,
        ecn: p.ecn,
        pcp: p.pcp(),
        sport: p.udp_sport,
        syndrome: p.ack_kind().map(|_| p.aeth.syndrome),
    })
}

/// The kernel's samples (rate 1) for `frames`, run through XDP, one per RoCEv2 frame.
fn kernel_samples(frames: &[Vec<u8>]) -> Vec<Sample> {
    let mut t = ProgTest::new(&DatapathOptions {
        sample_rate: 1,
        ..Default::default()
    });
    for f in frames {
        assert_eq!(t.run_xdp(f), XDP_PASS);
    }
    t.samples()
}

#[test]
fn our_frames_decode_the_same_in_tshark_host_parser_and_kernel() {
    if !require_root() {
        return;
    }
    let dir = TempDir::new("tshark");
    let pcap = dir.path("frames.pcap");
    let specs = specs();
    let frames: Vec<Vec<u8>> = specs.iter().map(RoceFrame::build).collect();
    write_pcap(&pcap, &frames);
    let rows = tshark_fields(&pcap, &FIELDS);
    assert_eq!(rows.len(), frames.len());
    let samples = kernel_samples(&frames);
    assert_eq!(samples.len(), frames.len());
    let mut tshark_icrcs = 0;
    for (i, (((row, frame), sample), spec)) in rows.iter().zip(&frames).zip(&samples).zip(&specs).enumerate()
    {
        let mut want = from_tshark(row);
        match want.icrc {
            Some(_) => tshark_icrcs += 1,
            // Where tshark shows no ICRC, the one we read must be the one we built.
            None => want.icrc = icrc(&spec.ip_packet()),
        }
        assert_eq!(
            from_host_parse(frame).as_ref(),
            Some(&want),
            "frame {i}: host parser vs tshark"
        );
        assert_eq!(from_sample(sample), want, "frame {i}: kernel vs tshark");
    }
    // tshark 4.0 shows none for SEND ONLY frames (5 of 13 here).
    assert!(tshark_icrcs >= 8, "tshark decoded {tshark_icrcs} ICRCs");
}

#[test]
fn our_icrc_matches_scapy() {
    let dir = TempDir::new("scapy");
    let pcap = dir.path("frames.pcap");
    let frames: Vec<Vec<u8>> = specs().iter().map(RoceFrame::build).collect();
    write_pcap(&pcap, &frames);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/scapy_icrc.py");
    let theirs = python_lines(&[script.as_ref(), pcap.as_os_str()]);
    assert_eq!(theirs.len(), frames.len());
    for (i, (frame, theirs)) in frames.iter().zip(&theirs).enumerate() {
        let ours = parse(&SlicePacket::new(frame), ROCEV2_UDP_PORT)
            .unwrap()
            .icrc()
            .unwrap();
        let ours: String = ours.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(&ours, theirs, "frame {i}");
    }
}

/// Real hardware frames: every RoCEv2 frame of the Huawei capture parses (host parser and
/// kernel) to exactly what tshark decodes, and its ICRC is the one we compute.
#[test]
fn huawei_capture_matches_tshark() {
    let Some(shared) = shared_dir() else {
        cannot_run("../shared is absent, so captures/huawei-rc-send.pcap is not available");
        return;
    };
    if !require_root() {
        return;
    }
    let pcap = shared.join("captures/huawei-rc-send.pcap");
    let frames = read_pcap(&pcap);
    assert_eq!(frames.len(), 123);
    let mut fields = FIELDS.to_vec();
    fields.push("udp.dstport");
    let rows = tshark_fields(&pcap, &fields);
    assert_eq!(rows.len(), frames.len());
    let roce: Vec<(Decoded, &Vec<u8>)> = rows
        .iter()
        .zip(&frames)
        .filter(|(r, _)| r[12] == "4791")
        .map(|(r, f)| (from_tshark(r), f))
        .collect();
    assert_eq!(roce.len(), 105, "ROCE_WIRE.md: 105 RoCEv2 frames");
    let samples = kernel_samples(&frames);
    assert_eq!(
        samples.len(),
        105,
        "the kernel reports every RoCEv2 frame at rate 1, and no other"
    );
    for (i, ((want, frame), sample)) in roce.iter().zip(&samples).enumerate() {
        assert_eq!(
            from_host_parse(frame).as_ref(),
            Some(want),
            "RoCE frame {i}: host parser"
        );
        assert_eq!(&from_sample(sample), want, "RoCE frame {i}: kernel");
        let l3 = &frame[14..];
        assert!(want.icrc.is_some(), "RoCE frame {i}: tshark shows the ICRC");
        assert_eq!(icrc(l3), want.icrc, "RoCE frame {i}: ICRC as computed");
    }
    // The capture's shape, as ROCE_WIRE.md describes it.
    assert!(roce.iter().all(|(d, _)| d.dscp == 0 && d.ecn == 2));
    let sends = roce.iter().filter(|(d, _)| d.dest_qp == 0x45).count();
    let acks = roce.iter().filter(|(d, _)| d.opcode == 0x11).count();
    assert!(sends > 0 && acks > 0, "sends {sends}, acks {acks}");
}
