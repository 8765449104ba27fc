//! The real eBPF object under BPF_PROG_TEST_RUN, as a table: description, frames,
//! expected verdict (always pass), counters and sample fields. Every row runs through
//! both the XDP (ingress) and the TC (egress) program.

use std::net::IpAddr;

use roce_trace_common::{datapath::*, roce::op, wire::*};
use roce_trace_datapath::loader::{DatapathOptions, GlobalTotals};
use roce_trace_gen::frame::{Mirror, RoceFrame, check_icrc, ethernet, ext, icrc};
use roce_trace_tests::*;

/// What the table expects of a row.
enum Want {
    /// Parsed as RoCEv2: the flow's counters after all frames (timestamps ignored), and
    /// extended-header fields of the last sample.
    Roce { counters: FlowCounters, ext: ExtWant },
    /// Not a parsed RoCEv2 packet: the global counter every frame bumps.
    Skip(GlobalCounter),
}

#[derive(Default, Clone, Copy)]
struct ExtWant {
    aeth: Option<(u8, u32)>,
    reth_len: Option<u32>,
    deth_src_qp: Option<u32>,
    reasons: u32,
}

struct Row {
    desc: &'static str,
    specs: Vec<RoceFrame>,
    /// Frames to feed; built from `specs` unless given raw.
    frames: Vec<Vec<u8>>,
    want: Want,
    /// A mirrored copy: the switch (outer source), session and `MIRROR_*` the flow key and
    /// samples must carry.
    mirror: Option<(IpAddr, u32, u8)>,
}

fn raw(desc: &'static str, frames: Vec<Vec<u8>>, skip: GlobalCounter) -> Row {
    Row {
        desc,
        specs: Vec::new(),
        frames,
        want: Want::Skip(skip),
        mirror: None,
    }
}

fn send_frame() -> Vec<u8> {
    f(op::SEND_ONLY).build()
}

fn f(opcode: u8) -> RoceFrame {
    RoceFrame {
        opcode,
        ..Default::default()
    }
}

/// Counters of a flow of `n` packets, all ECT(0) unless changed by the caller.
fn counts(specs: &[RoceFrame], frames: &[Vec<u8>]) -> FlowCounters {
    let last = specs.last().unwrap();
    let mut c = FlowCounters {
        counts: Counts {
            packets: specs.len() as u64,
            bytes: frames.iter().map(|f| f.len() as u64).sum(),
            ..Default::default()
        },
        last_dscp: last.dscp,
        last_ttl: last.ttl,
        last_pcp: last.vlans.first().map(|v| pcp_of_tci(v.1)).unwrap_or(PCP_NONE),
        ..Default::default()
    };
    for s in specs {
        c.counts.ecn[s.ecn as usize] += 1;
    }
    c
}

const EXPECT_DSCP: [u8; 2] = [26, 48];

fn table() -> Vec<Row> {
    let v6 = |mut s: RoceFrame| {
        s.src = "fd00::1".parse().unwrap();
        s.dst = "fd00::2".parse().unwrap();
        s
    };
    let roce = |desc, specs: Vec<RoceFrame>, tweak: &dyn Fn(&mut FlowCounters), ext: ExtWant| {
        let frames: Vec<Vec<u8>> = specs.iter().map(RoceFrame::build).collect();
        let mut counters = counts(&specs, &frames);
        tweak(&mut counters);
        Row {
            desc,
            specs,
            frames,
            want: Want::Roce { counters, ext },
            mirror: None,
        }
    };
    let none = &|_: &mut FlowCounters| {};
    let hash = ExtWant {
        reasons: REASON_HASH,
        ..Default::default()
    };
    let mut rows = vec![
        roce(
            "RC WRITE FIRST with RETH",
            vec![RoceFrame {
                psn: 100,
                ext: ext::reth(0x7f00_0000_1000, 0x1234, 4096),
                payload: vec![0xab; 1024],
                ..f(op::WRITE_FIRST)
            }],
            none,
            ExtWant {
                reth_len: Some(4096),
                ..hash
            },
        ),
        roce(
            "RC WRITE MIDDLE",
            vec![RoceFrame {
                psn: 101,
                payload: vec![1; 1024],
                ..f(op::WRITE_MIDDLE)
            }],
            none,
            hash,
        ),
        roce(
            "RC WRITE LAST with AckReq",
            vec![RoceFrame {
                psn: 102,
                ack_req: true,
                payload: vec![2; 1024],
                ..f(op::WRITE_LAST)
            }],
            none,
            hash,
        ),
        roce(
            "RC WRITE ONLY",
            vec![RoceFrame {
                psn: 7,
                ext: ext::reth(0x1000, 9, 64),
                payload: vec![3; 64],
                ..f(op::WRITE_ONLY)
            }],
            none,
            ExtWant {
                reth_len: Some(64),
                ..hash
            },
        ),
        roce(
            "RC SEND ONLY with PadCnt 3",
            vec![RoceFrame {
                pad_cnt: 3,
                solicited: true,
                payload: vec![9; 5],
                ..f(op::SEND_ONLY)
            }],
            none,
            hash,
        ),
        roce(
            "RC READ REQUEST",
            vec![RoceFrame {
                psn: 20,
                ext: ext::reth(0x2000, 7, 8192),
                ..f(op::READ_REQUEST)
            }],
            none,
            ExtWant {
                reth_len: Some(8192),
                ..hash
            },
        ),
        roce(
            "RC READ RESPONSE FIRST with AETH (not an ACK)",
            vec![RoceFrame {
                psn: 20,
                ext: ext::aeth(0x1f, 5),
                payload: vec![4; 1024],
                ..f(op::READ_RESPONSE_FIRST)
            }],
            none,
            ExtWant {
                aeth: Some((0x1f, 5)),
                ..hash
            },
        ),
        roce(
            "RC READ RESPONSE MIDDLE",
            vec![RoceFrame {
                psn: 21,
                payload: vec![4; 1024],
                ..f(op::READ_RESPONSE_MIDDLE)
            }],
            none,
            hash,
        ),
        roce(
            "RC ACK",
            vec![RoceFrame {
                psn: 102,
                ext: ext::aeth(0x1f, 3),
                ..f(op::ACKNOWLEDGE)
            }],
            &|c| c.counts.ack = 1,
            ExtWant {
                aeth: Some((0x1f, 3)),
                ..hash
            },
        ),
        roce(
            "RC NAK PSN sequence error",
            vec![RoceFrame {
                psn: 50,
                ext: ext::aeth(0x60, 3),
                ..f(op::ACKNOWLEDGE)
            }],
            &|c| c.counts.nak_psn_seq_err = 1,
            ExtWant {
                aeth: Some((0x60, 3)),
                reasons: REASON_HASH | REASON_NAK,
                ..Default::default()
            },
        ),
        roce(
            "RC RNR NAK",
            vec![RoceFrame {
                psn: 51,
                ext: ext::aeth(0x2e, 3),
                ..f(op::ACKNOWLEDGE)
            }],
            &|c| c.counts.nak_rnr = 1,
            ExtWant {
                aeth: Some((0x2e, 3)),
                reasons: REASON_HASH | REASON_NAK,
                ..Default::default()
            },
        ),
        roce(
            "RC NAK remote access error",
            vec![RoceFrame {
                psn: 52,
                ext: ext::aeth(0x62, 3),
                ..f(op::ACKNOWLEDGE)
            }],
            &|c| c.counts.nak_other = 1,
            ExtWant {
                aeth: Some((0x62, 3)),
                reasons: REASON_HASH | REASON_NAK,
                ..Default::default()
            },
        ),
        roce(
            "CNP (ConnectX-4 Lx layout: DSCP 48, sport 0, BECN)",
            vec![RoceFrame {
                opcode: 0x81,
                dscp: 48,
                udp_sport: 0,
                becn: true,
                mig_req: false,
                dest_qp: 0x118,
                ext: ext::cnp(),
                ..Default::default()
            }],
            &|c| c.counts.cnp = 1,
            ExtWant {
                reasons: REASON_HASH | REASON_CNP,
                ..Default::default()
            },
        ),
        roce(
            "UD SEND ONLY with DETH",
            vec![RoceFrame {
                ext: ext::deth(0x1111_1111, 0x42),
                payload: vec![5; 256],
                ..f(0x64)
            }],
            none,
            ExtWant {
                deth_src_qp: Some(0x42),
                ..hash
            },
        ),
        roce(
            "CE-marked RC WRITE ONLY",
            vec![RoceFrame {
                ecn: 3,
                psn: 9,
                ext: ext::reth(0, 1, 32),
                payload: vec![6; 32],
                ..f(op::WRITE_ONLY)
            }],
            none,
            ExtWant {
                reth_len: Some(32),
                reasons: REASON_HASH | REASON_CE,
                ..Default::default()
            },
        ),
        roce(
            "IPv6 RC SEND ONLY, hop limit 63",
            vec![v6(RoceFrame {
                ttl: 63,
                payload: vec![7; 100],
                ..f(op::SEND_ONLY)
            })],
            none,
            hash,
        ),
        roce(
            "802.1Q tag, PCP 3",
            vec![RoceFrame {
                vlans: vec![(ETH_P_8021Q, (3 << 13) | 100)],
                ..f(op::SEND_ONLY)
            }],
            none,
            hash,
        ),
        roce(
            "QinQ: 802.1ad PCP 5 outside 802.1Q PCP 3",
            vec![RoceFrame {
                vlans: vec![(ETH_P_8021AD, (5 << 13) | 10), (ETH_P_8021Q, (3 << 13) | 100)],
                ..f(op::SEND_ONLY)
            }],
            none,
            hash,
        ),
        roce(
            "IPv4 with options (IHL 7)",
            vec![RoceFrame {
                ipv4_options: vec![0x94, 0x04, 0, 0, 1, 1, 1, 1],
                ..f(op::SEND_ONLY)
            }],
            none,
            hash,
        ),
        roce(
            "DSCP 0 from an untuned host is outside the expected set",
            vec![RoceFrame {
                dscp: 0,
                ..f(op::SEND_ONLY)
            }],
            none,
            ExtWant {
                reasons: REASON_HASH | REASON_UNEXPECTED_DSCP,
                ..Default::default()
            },
        ),
        roce(
            "PSN gap on requests is counted once",
            [10, 11, 13]
                .map(|psn| RoceFrame {
                    psn,
                    ..f(op::SEND_ONLY)
                })
                .to_vec(),
            &|c| c.counts.psn_gaps = 1,
            hash,
        ),
        roce(
            "PSN wrap-around is no gap",
            [0xff_fffe, 0xff_ffff, 0]
                .map(|psn| RoceFrame {
                    psn,
                    ..f(op::SEND_ONLY)
                })
                .to_vec(),
            none,
            hash,
        ),
        roce(
            "retransmission (PSN goes back) is no gap",
            [5, 6, 5, 6, 7]
                .map(|psn| RoceFrame {
                    psn,
                    ..f(op::SEND_ONLY)
                })
                .to_vec(),
            none,
            hash,
        ),
        roce(
            "PSN jump after READ REQUEST is no gap",
            vec![
                RoceFrame {
                    psn: 20,
                    ext: ext::reth(0, 1, 4096),
                    ..f(op::READ_REQUEST)
                },
                RoceFrame {
                    psn: 24,
                    ..f(op::SEND_ONLY)
                },
            ],
            none,
            hash,
        ),
        roce(
            "DSCP change within a flow is counted",
            [26, 26, 0]
                .map(|dscp| RoceFrame {
                    dscp,
                    ..f(op::SEND_ONLY)
                })
                .to_vec()
                .into_iter()
                .enumerate()
                .map(|(i, s)| RoceFrame { psn: i as u32, ..s })
                .collect(),
            &|c| c.counts.dscp_changed = 1,
            ExtWant {
                reasons: REASON_HASH | REASON_UNEXPECTED_DSCP,
                ..Default::default()
            },
        ),
        roce(
            "three VLAN tags still parse",
            vec![RoceFrame {
                vlans: vec![
                    (ETH_P_8021AD, 1 << 13 | 1),
                    (ETH_P_8021Q, 2 << 13 | 2),
                    (ETH_P_8021Q, 3 << 13 | 3),
                ],
                ..f(op::SEND_ONLY)
            }],
            none,
            hash,
        ),
    ];

    // IPv6 with a hop-by-hop extension header: spliced into a built frame.
    let mut spec = v6(f(op::SEND_ONLY));
    spec.payload = vec![1; 8];
    let ip = spec.ip_packet();
    let mut with_ext = ip[..40].to_vec();
    with_ext[6] = 0; // next header: hop-by-hop
    let plen = u16::from_be_bytes([ip[4], ip[5]]) + 8;
    with_ext[4..6].copy_from_slice(&plen.to_be_bytes());
    with_ext.extend_from_slice(&[IPPROTO_UDP, 0, 1, 4, 0, 0, 0, 0]); // PadN option
    with_ext.extend_from_slice(&ip[40..]);
    let frame = ethernet(spec.dst_mac, spec.src_mac, &[], ETH_P_IPV6, &with_ext);
    let counters = counts(std::slice::from_ref(&spec), std::slice::from_ref(&frame));
    rows.push(Row {
        desc: "IPv6 with a hop-by-hop header",
        specs: vec![spec],
        frames: vec![frame],
        want: Want::Roce { counters, ext: hash },
        mirror: None,
    });

    // Mirrored copies from switches: decapsulated, keyed and sampled per mirror session.
    let switch: IpAddr = "198.51.100.7".parse().unwrap();
    let switch6: IpAddr = "2001:db8::7".parse().unwrap();
    let collector: IpAddr = "198.51.100.1".parse().unwrap();
    let collector6: IpAddr = "2001:db8::1".parse().unwrap();
    let tagged = |s: RoceFrame| RoceFrame {
        vlans: vec![(ETH_P_8021Q, (5 << 13) | 30)],
        ..s
    };
    let cnp = RoceFrame {
        opcode: 0x81,
        dscp: 48,
        udp_sport: 0,
        becn: true,
        dest_qp: 0x118,
        ext: ext::cnp(),
        ttl: 63,
        ..Default::default()
    };
    let write = RoceFrame {
        psn: 300,
        ttl: 62,
        ext: ext::reth(0x1000, 9, 2048),
        payload: vec![6; 1024],
        ..f(op::WRITE_ONLY)
    };
    let mirrored = [
        (
            "ERSPAN II of a tagged CNP",
            tagged(cnp.clone()),
            Mirror::ErspanII {
                session: 0x3ff,
                seq: 1,
                index: 5,
            },
            switch,
            collector,
            0x3ff,
            MIRROR_ERSPAN_II,
            ExtWant {
                reasons: REASON_HASH | REASON_CNP,
                ..Default::default()
            },
            &(|c: &mut FlowCounters| c.counts.cnp = 1) as &dyn Fn(&mut FlowCounters),
        ),
        (
            "ERSPAN III with platform subheader of a WRITE ONLY",
            write.clone(),
            Mirror::ErspanIII {
                session: 42,
                seq: 7,
                timestamp: 1234,
                platform: true,
            },
            switch,
            collector,
            42,
            MIRROR_ERSPAN_III,
            ExtWant {
                reth_len: Some(2048),
                ..hash
            },
            none,
        ),
        (
            "ERSPAN III over IPv6 of an IPv6 ACK",
            v6(RoceFrame {
                ext: ext::aeth(0x1f, 2),
                ..f(op::ACKNOWLEDGE)
            }),
            Mirror::ErspanIII {
                session: 3,
                seq: 7,
                timestamp: 0,
                platform: false,
            },
            switch6,
            collector6,
            3,
            MIRROR_ERSPAN_III,
            ExtWant {
                aeth: Some((0x1f, 2)),
                ..hash
            },
            &(|c: &mut FlowCounters| c.counts.ack = 1) as &dyn Fn(&mut FlowCounters),
        ),
        (
            "GRE (0x6558) with key of a tagged WRITE ONLY",
            tagged(write.clone()),
            Mirror::GreEthernet { key: Some(0xabcd) },
            switch,
            collector,
            0xabcd,
            MIRROR_GRE,
            ExtWant {
                reth_len: Some(2048),
                ..hash
            },
            none,
        ),
        (
            "GRE carrying IPv4 directly",
            write.clone(),
            Mirror::GreIp { key: None },
            switch,
            collector,
            0,
            MIRROR_GRE,
            ExtWant {
                reth_len: Some(2048),
                ..hash
            },
            none,
        ),
    ];
    for (desc, spec, m, sw, coll, session, kind, ext, tweak) in mirrored {
        let frames = vec![m.encapsulate(sw, coll, &spec.build())];
        let mut counters = counts(std::slice::from_ref(&spec), &frames);
        tweak(&mut counters);
        rows.push(Row {
            desc,
            specs: vec![spec],
            frames,
            want: Want::Roce { counters, ext },
            mirror: Some((sw, session, kind)),
        });
    }
    let e2 = Mirror::ErspanII {
        session: 1,
        seq: 1,
        index: 1,
    }
    .encapsulate(switch, collector, &send_frame());
    rows.push(raw(
        "ERSPAN II header cut short",
        vec![e2[..14 + 20 + 8 + 4].to_vec()],
        GlobalCounter::TruncatedEncap,
    ));
    let e3 = Mirror::ErspanIII {
        session: 1,
        seq: 1,
        timestamp: 0,
        platform: true,
    }
    .encapsulate(switch, collector, &send_frame());
    rows.push(raw(
        "ERSPAN III platform subheader cut short",
        vec![e3[..14 + 20 + 8 + 12 + 4].to_vec()],
        GlobalCounter::TruncatedEncap,
    ));
    let keyed = Mirror::GreEthernet { key: Some(1) }.encapsulate(switch, collector, &send_frame());
    rows.push(raw(
        "GRE key cut short",
        vec![keyed[..14 + 20 + 6].to_vec()],
        GlobalCounter::TruncatedEncap,
    ));
    let mut bad = e2.clone();
    bad[14 + 20 + 8] = 0x20; // ERSPAN II header claiming version 2
    rows.push(raw(
        "ERSPAN II with a wrong version",
        vec![bad],
        GlobalCounter::BadEncap,
    ));

    // Frames that are not parsed RoCEv2.
    let send = f(op::SEND_ONLY).build();
    let l3 = 14 + 20 + 8;
    rows.push(raw(
        "truncated BTH",
        vec![send[..l3 + 6].to_vec()],
        GlobalCounter::TruncatedBth,
    ));
    let mut short_udp = RoceFrame {
        payload: vec![],
        ..f(op::SEND_ONLY)
    }
    .build();
    short_udp[14 + 20 + 4..14 + 20 + 6].copy_from_slice(&20u16.to_be_bytes());
    rows.push(raw(
        "UDP length shorter than BTH + ICRC",
        vec![short_udp],
        GlobalCounter::BadUdpLength,
    ));
    let ack_no_aeth = RoceFrame { ..f(op::ACKNOWLEDGE) }.build(); // 0x11 without its AETH
    rows.push(raw(
        "ACK without its AETH",
        vec![ack_no_aeth],
        GlobalCounter::TruncatedExtHeader,
    ));
    rows.push(raw(
        "UDP to another port",
        vec![
            RoceFrame {
                udp_dport: 4792,
                ..f(op::SEND_ONLY)
            }
            .build(),
        ],
        GlobalCounter::NonRoce,
    ));
    let mut frag = f(op::SEND_ONLY).build();
    frag[14 + 6] = 0x20; // MF set
    rows.push(raw("IPv4 fragment", vec![frag], GlobalCounter::Fragment));
    let mut tcp = f(op::SEND_ONLY).build();
    tcp[14 + 9] = 6;
    rows.push(raw("TCP", vec![tcp], GlobalCounter::NonRoce));
    let arp = ethernet(
        [0xff; 6],
        [2, 0, 0, 0, 0, 1],
        &[],
        0x0806,
        &[0, 1, 8, 0, 6, 4, 0, 1],
    );
    rows.push(raw("ARP", vec![arp], GlobalCounter::NonRoce));
    let mut v1 = vec![0x60, 0, 0, 0, 0, 28, 0x1b, 64];
    v1.extend_from_slice(&[0; 32]);
    v1.extend_from_slice(f(op::SEND_ONLY).bth().as_bytes());
    v1.extend_from_slice(&[0; 4]);
    rows.push(raw(
        "RoCEv1 (EtherType 0x8915)",
        vec![ethernet([2; 6], [3; 6], &[], ETH_P_ROCEV1, &v1)],
        GlobalCounter::RoceV1,
    ));
    let deep: Vec<(u16, u16)> = (0..5).map(|i| (ETH_P_8021Q, i)).collect();
    rows.push(raw(
        "five VLAN tags are too deep",
        vec![
            RoceFrame {
                vlans: deep,
                ..f(op::SEND_ONLY)
            }
            .build(),
        ],
        GlobalCounter::VlanTooDeep,
    ));
    rows.push(raw("runt frame", vec![vec![0u8; 14]], GlobalCounter::NonRoce));
    // Non-RoCE frames the kernel's first test leaves to the parser (a tag, IPv4 options,
    // an IPv6 extension header), and the plain ones it lets by: none is counted.
    let mut tagged_tcp = RoceFrame {
        vlans: vec![(ETH_P_8021Q, 3 << 13 | 100)],
        ..f(op::SEND_ONLY)
    }
    .build();
    tagged_tcp[18 + 9] = 6;
    rows.push(raw(
        "TCP behind an 802.1Q tag",
        vec![tagged_tcp],
        GlobalCounter::NonRoce,
    ));
    let mut v6_tcp = v6(f(op::SEND_ONLY)).build();
    v6_tcp[14 + 6] = 6;
    rows.push(raw("IPv6 TCP", vec![v6_tcp], GlobalCounter::NonRoce));
    let v6_udp = v6(RoceFrame {
        udp_dport: 53,
        ..f(op::SEND_ONLY)
    })
    .build();
    rows.push(raw(
        "IPv6 UDP to another port",
        vec![v6_udp],
        GlobalCounter::NonRoce,
    ));
    // IPv4 with 4 bytes of options (IHL 6) carrying TCP.
    let mut opts = f(op::SEND_ONLY).build();
    opts.splice(34..34, [1, 1, 1, 0]);
    opts[14] = 0x46;
    let tot = u16::from_be_bytes([opts[16], opts[17]]) + 4;
    opts[16..18].copy_from_slice(&tot.to_be_bytes());
    opts[14 + 9] = 6;
    rows.push(raw(
        "IPv4 with options carrying TCP",
        vec![opts],
        GlobalCounter::NonRoce,
    ));
    rows
}

fn mapped(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
        IpAddr::V6(a) => a.octets(),
    }
}

/// The three programs: XDP and TC on ingress, TC on egress.
#[derive(Clone, Copy, Debug)]
enum Hook {
    Xdp,
    TcIngress,
    TcEgress,
}

impl Hook {
    /// Runs `frame` through this hook's program; its verdict.
    fn run(self, t: &mut ProgTest, frame: &[u8]) -> u32 {
        match self {
            Hook::Xdp => t.run_xdp(frame),
            Hook::TcIngress => t.run_tc_in(frame),
            Hook::TcEgress => t.run_tc(frame),
        }
    }
}

fn check_row(t: &mut ProgTest, r: &Row, hook: Hook) {
    let dir = match hook {
        Hook::Xdp | Hook::TcIngress => DIR_INGRESS,
        Hook::TcEgress => DIR_EGRESS,
    };
    let ctx = format!("[{hook:?}] {}", r.desc);
    for fr in &r.frames {
        let pass = match hook {
            Hook::Xdp => XDP_PASS,
            Hook::TcIngress | Hook::TcEgress => TC_ACT_UNSPEC,
        };
        assert_eq!(hook.run(t, fr), pass, "{ctx}: verdict");
    }
    let g = t.globals();
    let n = r.frames.len() as u64;
    // Non-RoCE frames are not counted by the kernel (the interface's counters have them):
    // nothing at all moves for them, whichever test let them by.
    let counted = if matches!(r.want, Want::Skip(GlobalCounter::NonRoce)) {
        0
    } else {
        n
    };
    assert_eq!(
        g.get(GlobalCounter::FramesSeen, dir),
        counted,
        "{ctx}: frames counted"
    );
    let flows: Vec<_> = t
        .flows()
        .into_iter()
        .filter(|(k, _)| k.direction == dir)
        .collect();
    let samples: Vec<_> = t
        .samples()
        .into_iter()
        .filter(|s| s.key.direction == dir)
        .collect();
    match &r.want {
        Want::Skip(reason) => {
            assert_eq!(g.get(*reason, dir), counted, "{ctx}: {} counter", reason.name());
            assert_eq!(g.get(GlobalCounter::RoceV2, dir), 0, "{ctx}: not RoCEv2");
            assert!(flows.is_empty(), "{ctx}: no flow expected, got {flows:?}");
            assert!(t.mirrors().is_empty(), "{ctx}: no mirror session recorded");
            assert!(samples.is_empty(), "{ctx}: no sample expected");
        }
        Want::Roce { counters, ext } => {
            assert_eq!(g.get(GlobalCounter::RoceV2, dir), n, "{ctx}: RoCEv2 frames");
            assert_eq!(flows.len(), 1, "{ctx}: one flow, got {flows:?}");
            let (k, c) = flows[0];
            let last = r.specs.last().unwrap();
            assert_eq!(k.src, mapped(last.src), "{ctx}: src");
            assert_eq!(k.dst, mapped(last.dst), "{ctx}: dst");
            assert_eq!(
                k.ip_version,
                if last.src.is_ipv4() { 4 } else { 6 },
                "{ctx}: ip version"
            );
            assert_eq!(k.udp_sport, last.udp_sport, "{ctx}: udp sport");
            assert_eq!(k.dest_qp, last.dest_qp, "{ctx}: dest qp");
            assert_eq!(k.ifindex, 1, "{ctx}: test runs on lo");
            assert!(c.first_ns > 0 && c.last_ns >= c.first_ns, "{ctx}: timestamps");
            let got = FlowCounters {
                first_ns: 0,
                last_ns: 0,
                ..c
            };
            assert_eq!(&got, counters, "{ctx}: counters");
            assert_eq!(samples.len() as u64, n, "{ctx}: one sample per packet at rate 1");
            assert_eq!(
                g.get(GlobalCounter::SamplesEmitted, dir),
                n,
                "{ctx}: samples emitted"
            );
            let s = samples.last().unwrap();
            let fr = r.frames.last().unwrap();
            assert_eq!(s.key, k, "{ctx}: sample key");
            assert_eq!(s.opcode, last.opcode, "{ctx}: opcode");
            assert_eq!(s.psn, last.psn, "{ctx}: psn");
            assert_eq!(s.dscp, last.dscp, "{ctx}: dscp");
            assert_eq!(s.ecn, last.ecn, "{ctx}: ecn");
            assert_eq!(s.ttl, last.ttl, "{ctx}: ttl");
            assert_eq!(s.pkey, last.pkey, "{ctx}: pkey");
            assert_eq!(s.udp_dport, ROCEV2_UDP_PORT, "{ctx}: dport");
            assert_eq!(s.frame_len as usize, fr.len(), "{ctx}: frame length");
            assert_eq!(s.bth_flags, last.bth().flags, "{ctx}: SE/M/PadCnt");
            assert_eq!(s.bth_fecn_becn, last.bth().fecn_becn, "{ctx}: FECN/BECN");
            assert_eq!(s.bth_ack_req >> 7, last.ack_req as u8, "{ctx}: AckReq");
            assert_eq!(s.vlan_depth as usize, last.vlans.len(), "{ctx}: vlan depth");
            let want_pcp = last.vlans.first().map(|v| pcp_of_tci(v.1));
            assert_eq!(
                (s.present & HAS_PCP != 0).then_some(s.pcp),
                want_pcp,
                "{ctx}: pcp"
            );
            assert!(s.present & HAS_ICRC != 0, "{ctx}: icrc read");
            // The leading bytes of the frame travel with the sample.
            let head = fr.len().min(SAMPLE_HEAD_LEN);
            assert_eq!(s.head_len as usize, head, "{ctx}: head length");
            assert_eq!(&s.head[..head], &fr[..head], "{ctx}: head bytes");
            assert_eq!(k.mirror != 0, s.present & HAS_MIRROR != 0, "{ctx}: mirror bit");
            let table = t.mirrors();
            if let Some((sw, session, kind)) = r.mirror {
                // The sample names its session; the key carries its id; MIRRORS maps the
                // id back to the session.
                let m = s.mirror().expect("a mirrored sample carries its session");
                assert_eq!(m.addr(), mapped(sw), "{ctx}: the switch");
                assert_eq!((m.session, m.kind), (session, kind), "{ctx}: session");
                assert_eq!(k.mirror, m.id(), "{ctx}: the key's mirror id");
                assert_eq!(
                    table.into_iter().collect::<Vec<_>>(),
                    vec![(k.mirror, m)],
                    "{ctx}: MIRRORS names the id"
                );
                assert_eq!(g.get(GlobalCounter::Mirrored, dir), n, "{ctx}: mirrored count");
                // The ICRC is the inner packet's, found from the inner UDP length.
                assert_eq!(Some(s.icrc), icrc(&last.ip_packet()), "{ctx}: inner icrc");
                assert_eq!(
                    check_icrc(fr, s.l3_off as usize, Some(s.icrc)),
                    Some(true),
                    "{ctx}: inner IP header offset"
                );
            } else {
                assert_eq!(k.mirror, 0, "{ctx}: not mirrored");
                assert_eq!(s.mirror, MirrorInfo::default(), "{ctx}: no session in the sample");
                assert!(table.is_empty(), "{ctx}: MIRRORS untouched: {table:?}");
                assert_eq!(g.get(GlobalCounter::Mirrored, dir), 0, "{ctx}: mirrored count");
                // The ICRC is found from the UDP length: it must equal the one the builder
                // computed over the IP packet.
                let l3_start = 14 + 4 * last.vlans.len();
                assert_eq!(s.l3_off as usize, l3_start, "{ctx}: IP header offset");
                let ip_len = if last.src.is_ipv4() {
                    u16::from_be_bytes([fr[l3_start + 2], fr[l3_start + 3]]) as usize
                } else {
                    40 + u16::from_be_bytes([fr[l3_start + 4], fr[l3_start + 5]]) as usize
                };
                let l3 = &fr[l3_start..l3_start + ip_len];
                if r.desc.contains("hop-by-hop") {
                    assert_eq!(&s.icrc[..], &l3[l3.len() - 4..], "{ctx}: icrc bytes");
                } else {
                    assert_eq!(Some(s.icrc), icrc(l3), "{ctx}: icrc");
                }
            }
            let aeth = (s.present & HAS_AETH != 0).then_some((s.aeth_syndrome, s.aeth_msn));
            assert_eq!(aeth, ext.aeth, "{ctx}: aeth");
            assert_eq!(
                (s.present & HAS_RETH != 0).then_some(s.reth_dma_len),
                ext.reth_len,
                "{ctx}: reth"
            );
            assert_eq!(
                (s.present & HAS_DETH != 0).then_some(s.deth_src_qp),
                ext.deth_src_qp,
                "{ctx}: deth"
            );
            assert_eq!(s.reasons, ext.reasons, "{ctx}: reasons");
        }
    }
}

#[test]
fn every_frame_kind_through_xdp_and_tc_both_ways() {
    if !require_root() {
        return;
    }
    let opts = DatapathOptions {
        sample_rate: 1,
        expected_dscp: EXPECT_DSCP.to_vec(),
        ..Default::default()
    };
    let rows = table();
    assert!(rows.len() >= 30, "the table covers every case of the issue");
    for r in &rows {
        for hook in [Hook::Xdp, Hook::TcIngress, Hook::TcEgress] {
            let mut t = ProgTest::new(&opts);
            check_row(&mut t, r, hook);
        }
    }
}

/// The reader maps the flow table and the globals in place: every CPU's chunks, nothing
/// past the end; a map that is not mmapable, or whose values are not the type asked for,
/// is refused with the reason rather than read as something else.
#[test]
fn the_tables_are_mapped_whole_and_a_map_they_cannot_be_is_refused() {
    use roce_trace_datapath::mapped::MappedArray;
    if !require_root() {
        return;
    }
    let t = ProgTest::new(&DatapathOptions::default());
    let cpus = roce_trace_datapath::sys::cpu_id_count().unwrap();
    let table_slots = DatapathOptions::default().table_slots(cpus);
    let array = |name| match t.map(name) {
        aya::maps::Map::Array(data) => data,
        _ => panic!("{name} is not an array map"),
    };
    let slots = array(MAP_FLOW_SLOTS);
    let m = MappedArray::<FlowSlotChunk>::new(&slots).expect("the flow table maps");
    assert_eq!(
        m.len(),
        cpus << flow_chunk_bits(table_slots.trailing_zeros()),
        "every CPU's chunks"
    );
    assert!(m.get(m.len() - 1).is_some() && m.get(m.len()).is_none());
    let err = MappedArray::<u64>::new(&slots).err().expect("u64 values refused");
    assert!(
        err.to_string().contains("values of 24576 bytes, 8 expected"),
        "{err}"
    );
    let globals = array(MAP_GLOBALS);
    let g =
        MappedArray::<roce_trace_common::scratch::CpuGlobalsBytes>::new(&globals).expect("the globals map");
    assert_eq!(g.len(), cpus, "one element a CPU");
    let err = MappedArray::<AddrPrefix>::new(&array(MAP_MIRROR_FROM))
        .err()
        .expect("a plain array refused");
    assert!(err.to_string().contains("not mmapable"), "{err}");
}

/// Mirror sessions reach the flow key only as ids: each session (switch, id, kind) gets its
/// own flow and one `MIRRORS` entry, however many copies it sends, and stale sessions of a
/// CPU's previous packet never leak into a plain packet's key or sample.
#[test]
fn mirror_sessions_are_named_through_the_mirrors_map() {
    if !require_root() {
        return;
    }
    let mut t = ProgTest::new(&DatapathOptions {
        sample_rate: 1,
        ..Default::default()
    });
    let (a, b): (IpAddr, IpAddr) = ("198.51.100.7".parse().unwrap(), "198.51.100.8".parse().unwrap());
    let coll: IpAddr = "198.51.100.1".parse().unwrap();
    let e2 = |session| Mirror::ErspanII {
        session,
        seq: 1,
        index: 1,
    };
    let copies = [
        (a, e2(1), 1, MIRROR_ERSPAN_II),
        (a, e2(1), 1, MIRROR_ERSPAN_II),
        (a, e2(2), 2, MIRROR_ERSPAN_II),
        (b, e2(1), 1, MIRROR_ERSPAN_II),
        (a, Mirror::GreEthernet { key: Some(1) }, 1, MIRROR_GRE),
    ];
    for (sw, m, _, _) in &copies {
        t.run_xdp(&m.encapsulate(*sw, coll, &send_frame()));
        // A plain packet between mirrored ones: key and sample without a session.
        t.run_xdp(&send_frame());
    }
    let table = t.mirrors();
    assert_eq!(table.len(), 4, "one entry per session: {table:?}");
    let flows = t.flows();
    assert_eq!(flows.len(), 5, "four sessions and the plain flow: {flows:?}");
    let mut seen = std::collections::BTreeSet::new();
    for (k, c) in &flows {
        if k.mirror == 0 {
            assert_eq!(c.counts.packets, 5, "the plain flow");
            continue;
        }
        let m = table[&k.mirror];
        assert_eq!(m.id(), k.mirror);
        seen.insert((m.addr(), m.session, m.kind));
        let want = copies
            .iter()
            .filter(|(sw, _, s, kind)| (mapped(*sw), *s, *kind) == (m.addr(), m.session, m.kind))
            .count() as u64;
        assert_eq!(c.counts.packets, want, "{m:?}");
    }
    assert_eq!(seen.len(), 4);
    let samples = t.samples();
    assert_eq!(samples.len(), 10);
    for (i, s) in samples.iter().enumerate() {
        if i % 2 == 1 {
            assert_eq!(
                (s.key.mirror, s.mirror(), s.mirror),
                (0, None, MirrorInfo::default())
            );
        } else {
            let (sw, _, session, kind) = &copies[i / 2];
            let m = s.mirror().unwrap();
            assert_eq!((m.addr(), m.session, m.kind), (mapped(*sw), *session, *kind));
            assert_eq!(table[&s.key.mirror], m);
        }
    }
}

#[test]
fn retransmission_counts_a_psn_regression() {
    if !require_root() {
        return;
    }
    let mut t = ProgTest::new(&DatapathOptions::default());
    for psn in [5, 6, 5, 6, 7] {
        t.run_xdp(
            &RoceFrame {
                psn,
                ..f(op::SEND_ONLY)
            }
            .build(),
        );
    }
    // The second 5 and 6 are both behind the newest PSN (7 expected next).
    assert_eq!(t.globals().get(GlobalCounter::PsnRegressions, DIR_INGRESS), 2);
}

/// Runs the rest of the calling thread on `cpu` (BPF_PROG_TEST_RUN runs the program on the
/// caller's CPU); false when it cannot.
fn pin_to_cpu(cpu: usize) -> bool {
    // SAFETY: a zeroed cpu_set_t is empty; CPU_SET stays within it for cpu < CPU_SETSIZE.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

/// Whether this test can run its packets on CPU 0 alone (as root, the thread pinned
/// there: a flow's slot and its copy in `FLOWS` are per CPU); when not, says why
/// (`cannot_run`: a failure under CI).
fn can_run_on_cpu0() -> bool {
    if !require_root() {
        return false;
    }
    if !pin_to_cpu(0) {
        pin_to_cpu_any();
        cannot_run("cannot pin the thread to CPU 0");
        return false;
    }
    true
}

/// Whether this test can run a flow on CPU 0 and CPU 1 (as root, with both CPUs to pin
/// the thread to); when not, says why (`cannot_run`: a failure under CI).
fn can_move_between_cpus() -> bool {
    if !require_root() {
        return false;
    }
    if !pin_to_cpu(0) || !pin_to_cpu(1) {
        pin_to_cpu_any();
        cannot_run("needs two CPUs to move a flow between (cannot pin the thread to CPUs 0 and 1)");
        return false;
    }
    true
}

/// A flow's PSN sequence follows it from CPU to CPU (each CPU keeps its own copy of the
/// state; one that sees the flow after another takes that one's over): moving CPU is
/// neither a gap nor a retransmission, a real gap or retransmission on the new CPU still
/// is, and a DSCP change is judged against the flow's first DSCP everywhere.
#[test]
fn a_flow_moving_between_cpus_keeps_its_psn_sequence() {
    if !can_move_between_cpus() {
        return;
    }
    // The flow in its flow-table slot on each CPU; then in FLOWS, its slot taken by a
    // flow seen first.
    for squatter in [false, true] {
        moving_flow(squatter);
    }
    pin_to_cpu_any();
}

fn moving_flow(squatter: bool) {
    let mut t = ProgTest::new(&DatapathOptions {
        flow_slots: 1,
        ..Default::default()
    });
    if squatter {
        for cpu in [0, 1] {
            assert!(pin_to_cpu(cpu));
            let from = cpu as u32 * 3;
            for f in qp_frames(0x5157, from..from + 3) {
                t.run_xdp(&f);
            }
        }
    }
    let send = |t: &mut ProgTest, cpu: usize, psns: &[u32], dscp: u8| {
        assert!(pin_to_cpu(cpu));
        for &psn in psns {
            t.run_xdp(
                &RoceFrame {
                    psn,
                    dscp,
                    ..f(op::WRITE_MIDDLE)
                }
                .build(),
            );
        }
    };
    let state = |t: &ProgTest| {
        let flows = t.flows();
        assert_eq!(flows.len(), 1 + squatter as usize, "one flow (and the squatter)");
        let c = flows.iter().find(|(k, _)| k.dest_qp != 0x5157).unwrap().1;
        (
            c.counts.packets,
            c.counts.psn_gaps,
            t.globals().get(GlobalCounter::PsnRegressions, DIR_INGRESS),
            c.counts.dscp_changed,
        )
    };
    let run = |a: u32, b: u32| (a..b).collect::<Vec<_>>();
    send(&mut t, 0, &run(0, 10), 26);
    send(&mut t, 1, &run(10, 20), 26);
    send(&mut t, 0, &run(20, 30), 26);
    send(&mut t, 1, &run(30, 35), 26);
    send(&mut t, 0, &run(35, 40), 26);
    assert_eq!(
        state(&t),
        (40, 0, 0, 0),
        "moved four times, in sequence throughout"
    );
    // A gap right after a move (CPU 1 last saw 34; CPU 0 has seen up to 39).
    send(&mut t, 1, &[42, 43], 26);
    assert_eq!(state(&t), (42, 1, 0, 0), "a gap on the new CPU is a gap");
    // A retransmission right after a move back.
    send(&mut t, 0, &[40, 41, 42, 43, 44], 26);
    assert_eq!(state(&t), (47, 1, 4, 0), "going back is a retransmission");
    // A class change, on both CPUs: judged against the flow's first DSCP on each.
    send(&mut t, 1, &[45, 46], 0);
    send(&mut t, 0, &[47], 0);
    assert_eq!(state(&t), (50, 1, 4, 3), "DSCP changes counted on both CPUs");
    pin_to_cpu_any();
}

/// A flow of responses alone (acknowledgements) has no PSN to follow: once both CPUs have
/// seen it, its packets are in sequence on either (the fast path, no catch-up) however
/// often it moves, as a responder's thread moving between CPUs sends it. When requests
/// join the flow, their sequence follows it from CPU to CPU as any request flow's does:
/// no gap and no retransmission from moving, and a real gap still counted.
#[test]
fn a_response_flow_moving_between_cpus_does_not_catch_up_again() {
    if !can_move_between_cpus() {
        return;
    }
    let mut t = ProgTest::new(&DatapathOptions {
        sample_rate: 0,
        ..Default::default()
    });
    let frame = |opcode: u8, psn: u32| {
        let mut s = RoceFrame {
            dest_qp: 0x61,
            psn,
            ..f(opcode)
        };
        if opcode == op::ACKNOWLEDGE {
            s.ext = ext::aeth(0x1f, psn);
        }
        s.build()
    };
    // (CPU, opcode, PSNs, whether each packet takes the fast path)
    let steps: [(usize, u8, std::ops::Range<u32>, bool, &str); 8] = [
        (0, op::ACKNOWLEDGE, 0..1, false, "the flow's first packet"),
        (0, op::ACKNOWLEDGE, 1..4, true, "in sequence on CPU 0"),
        (1, op::ACKNOWLEDGE, 4..5, false, "CPU 1 catches up once"),
        (1, op::ACKNOWLEDGE, 5..8, true, "in sequence on CPU 1"),
        (
            0,
            op::ACKNOWLEDGE,
            8..12,
            true,
            "back on CPU 0: in sequence, no catch-up",
        ),
        (1, op::ACKNOWLEDGE, 12..16, true, "back on CPU 1 likewise"),
        (
            1,
            op::WRITE_MIDDLE,
            100..101,
            false,
            "a request: the PSN sequence starts",
        ),
        (
            1,
            op::WRITE_MIDDLE,
            101..104,
            true,
            "requests in sequence on CPU 1",
        ),
    ];
    for (cpu, opcode, psns, fast, what) in steps {
        assert!(pin_to_cpu(cpu));
        for psn in psns {
            let before = t.working_memory();
            t.run_xdp(&frame(opcode, psn));
            assert_eq!(before == t.working_memory(), fast, "PSN {psn}: {what}");
        }
    }
    // The requests move: each move catches up, and none is a gap or a retransmission.
    let requests = [(0, 104..108), (1, 108..112), (0, 112..116)];
    for (cpu, psns) in requests {
        assert!(pin_to_cpu(cpu));
        for psn in psns {
            t.run_xdp(&frame(op::WRITE_MIDDLE, psn));
        }
    }
    // An ACK on CPU 1, whose request state CPU 0 took over: it catches up; then a real gap
    // on CPU 1 is one.
    assert!(pin_to_cpu(1));
    t.run_xdp(&frame(op::ACKNOWLEDGE, 16));
    t.run_xdp(&frame(op::WRITE_MIDDLE, 120));
    let flows = t.flows();
    assert_eq!(flows.len(), 1, "one flow");
    let c = &flows[0].1;
    assert_eq!(
        (c.counts.packets, c.counts.ack, c.counts.psn_gaps),
        (16 + 4 + 12 + 1 + 1, 17, 1),
        "every packet counted once, every ACK, one gap"
    );
    assert_eq!(t.globals().get(GlobalCounter::PsnRegressions, DIR_INGRESS), 0);
    pin_to_cpu_any();
}

/// A flow's packets, in sequence from `psn`, on QP `qp`.
fn qp_frames(qp: u32, psns: std::ops::Range<u32>) -> Vec<Vec<u8>> {
    psns.map(|psn| {
        RoceFrame {
            dest_qp: qp,
            psn,
            ..f(op::WRITE_MIDDLE)
        }
        .build()
    })
    .collect()
}

/// A flow's QP, packets, PSN gaps and DSCP changes.
type QpCounts = (u32, u64, u64, u64);

/// Each flow's [`QpCounts`] by QP; PSN regressions and failed inserts overall.
fn per_qp(t: &ProgTest) -> (Vec<QpCounts>, u64, u64) {
    let mut v: Vec<_> = t
        .flows()
        .iter()
        .map(|(k, c)| {
            (
                k.dest_qp,
                c.counts.packets,
                c.counts.psn_gaps,
                c.counts.dscp_changed,
            )
        })
        .collect();
    v.sort();
    let g = t.globals();
    (
        v,
        g.total(GlobalCounter::PsnRegressions),
        g.total(GlobalCounter::FlowInsertFailed),
    )
}

/// More flows than flow-table slots (one slot here): the flows that find it taken are
/// counted in `FLOWS`, exactly, with their PSN sequences, interleaved packet by packet.
#[test]
fn flows_beyond_the_flow_table_are_counted_exactly() {
    if !require_root() {
        return;
    }
    let mut t = ProgTest::new(&DatapathOptions {
        flow_slots: 1,
        ..Default::default()
    });
    let qps = [0x11, 0x22, 0x33, 0x44, 0x55];
    let frames: Vec<_> = qps.iter().map(|&qp| qp_frames(qp, 0..40)).collect();
    for i in 0..40 {
        for (n, f) in frames.iter().enumerate() {
            // Uneven: QP n sends its first n * 5 packets only.
            if i < 40 - n * 5 {
                t.run_tc_in(&f[i]);
            }
            // The first flow fits the table: nothing is written to FLOWS, and the reader
            // skips it; the second is written there, and read.
            match (i, n) {
                (0, 0) => {
                    assert_eq!(t.flows_writes(), 0, "one flow, in its slot");
                    assert_eq!(per_qp(&t).0, [(0x11, 1, 0, 0)]);
                }
                (0, 1) => {
                    assert_eq!(t.flows_writes(), 1, "the second flow written to FLOWS");
                    assert_eq!(per_qp(&t).0, [(0x11, 1, 0, 0), (0x22, 1, 0, 0)]);
                }
                _ => {}
            }
        }
    }
    let want: Vec<_> = qps
        .iter()
        .enumerate()
        .map(|(n, &qp)| (qp, 40 - n as u64 * 5, 0, 0))
        .collect();
    assert_eq!(per_qp(&t), (want, 0, 0));
}

/// Where CPU 0 counts each flow: the flow holding its only flow-table slot, and the flows
/// in `FLOWS`, each as (QP, packets, PSN gaps). Nothing is counted on another CPU.
type Placement = (Option<(u32, u64, u64)>, Vec<(u32, u64, u64)>);

fn placement(t: &ProgTest) -> Placement {
    let counts = |k: &FlowKey, c: &FlowCounters| (k.dest_qp, c.counts.packets, c.counts.psn_gaps);
    let slots = t.slot_table(0);
    assert!(slots.len() <= 1, "one slot: {slots:?}");
    let mut flows: Vec<_> = t.flows_map(0).iter().map(|(k, c)| counts(k, c)).collect();
    flows.sort();
    for cpu in 1..roce_trace_datapath::sys::cpu_id_count().unwrap() {
        assert!(t.slot_table(cpu).is_empty(), "CPU {cpu} has a slot in use");
        assert!(t.flows_map(cpu).is_empty(), "CPU {cpu} counts in FLOWS");
    }
    (slots.first().map(|(_, k, c)| counts(k, c)), flows)
}

/// A slot whose flow went idle goes to the next flow that hashes to it; the idle flow's
/// counters move to `FLOWS` and it carries on there, in sequence, when it comes back. A
/// flow counted in `FLOWS` on a CPU does not take a slot there (one copy per CPU). Checked
/// where each flow is counted after every step — the slot or `FLOWS`, with exactly its
/// packets — so a datapath that never hands a slot over, or loses the idle flow's
/// counters in the move, fails.
#[test]
fn an_idle_flows_slot_goes_to_a_new_flow_and_nothing_is_lost() {
    // The slot and FLOWS are per CPU: all on one.
    if !can_run_on_cpu0() {
        return;
    }
    // Idle means 250 ms without a packet: far longer than a pause between two packets of
    // a step, even on a busy host, so only the sleeps below make a slot idle.
    let mut t = ProgTest::new(&DatapathOptions {
        flow_slots: 1,
        slot_idle_ms: 250,
        ..Default::default()
    });
    let send = |t: &mut ProgTest, qp, psns| {
        for f in qp_frames(qp, psns) {
            t.run_xdp(&f);
        }
    };
    // Longer than the idle time, in coarse-clock ticks (up to 10 ms each) to spare.
    let idle = || std::thread::sleep(std::time::Duration::from_millis(600));
    let (a, b, c, d) = (0xa, 0xb, 0xc, 0xd);
    send(&mut t, a, 0..10); // A takes the slot
    send(&mut t, b, 0..5); // B: slot busy, FLOWS
    assert_eq!(placement(&t), (Some((a, 10, 0)), vec![(b, 5, 0)]));
    idle();
    send(&mut t, c, 0..5); // C takes the idle slot, A moves to FLOWS
    assert_eq!(
        placement(&t),
        (Some((c, 5, 0)), vec![(a, 10, 0), (b, 5, 0)]),
        "the slot handed over, A's counters in FLOWS"
    );
    send(&mut t, a, 10..20); // A carries on in FLOWS
    send(&mut t, b, 5..10);
    assert_eq!(placement(&t), (Some((c, 5, 0)), vec![(a, 20, 0), (b, 10, 0)]));
    idle();
    send(&mut t, a, 20..25); // slot idle, but A has its copy in FLOWS: stays there
    assert_eq!(
        placement(&t),
        (Some((c, 5, 0)), vec![(a, 25, 0), (b, 10, 0)]),
        "a flow in FLOWS does not take the slot"
    );
    send(&mut t, d, 0..5); // D takes the slot, C moves
    assert_eq!(
        placement(&t),
        (Some((d, 5, 0)), vec![(a, 25, 0), (b, 10, 0), (c, 5, 0)]),
        "the slot handed over again, C's counters in FLOWS"
    );
    send(&mut t, c, 5..10); // C carries on in FLOWS
    send(&mut t, d, 5..10);
    pin_to_cpu_any();
    assert_eq!(
        placement(&t),
        (Some((d, 10, 0)), vec![(a, 25, 0), (b, 10, 0), (c, 10, 0)])
    );
    assert_eq!(
        per_qp(&t),
        (
            vec![(a, 25, 0, 0), (b, 10, 0, 0), (c, 10, 0, 0), (d, 10, 0, 0)],
            0,
            0
        )
    );
}

/// Lets the thread run anywhere again.
fn pin_to_cpu_any() {
    // SAFETY: a zeroed cpu_set_t is empty; CPU_SET stays within it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for cpu in 0..libc::CPU_SETSIZE as usize {
            libc::CPU_SET(cpu, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// The common packet — plain IPv4, its flow in its slot, in sequence, nothing to report —
/// is counted by the fast path, which never writes the full path's working memory (the
/// full path writes the flow key and the parsed headers there for every packet); a packet
/// out of sequence or to report is parsed whole into it, and IPv6, tagged packets and new
/// flows take the full path. The counts are the same either way (the frame table and the
/// sequence tests check every number).
#[test]
fn in_sequence_packets_take_the_fast_path_and_others_the_full_one() {
    // A flow's slot is per CPU: a packet run on another CPU than the last finds its flow
    // not in that CPU's slot and takes the full path.
    if !can_run_on_cpu0() {
        return;
    }
    let mut t = ProgTest::new(&DatapathOptions {
        sample_rate: 0,
        ..Default::default()
    });
    let frame = |psn: u32, ecn: u8, v6: bool, vlan: bool| {
        let mut s = RoceFrame {
            dest_qp: 0x42,
            psn,
            ecn,
            ..f(op::WRITE_MIDDLE)
        };
        if v6 {
            s.src = "fd00::1".parse().unwrap();
            s.dst = "fd00::2".parse().unwrap();
        }
        if vlan {
            // Its own flow (a key has no tag): its second packet is in sequence.
            s.vlans = vec![(0x8100, 3 << 13 | 10)];
            s.dest_qp = 0x43;
        }
        s.build()
    };
    // (frame, whether the full path's working memory is written, what it is)
    let steps = [
        (frame(10, 2, false, false), true, "a new flow: the full path"),
        (frame(11, 2, false, false), false, "in sequence: the fast path"),
        (frame(12, 2, false, false), false, "in sequence again"),
        (
            frame(12, 2, false, false),
            true,
            "a retransmission: parsed whole for the catch-up",
        ),
        (frame(13, 2, false, false), false, "in sequence after it"),
        (
            frame(14, 3, false, false),
            true,
            "CE: counted fast, parsed whole for its report",
        ),
        (frame(15, 2, false, false), false, "in sequence after the report"),
        (frame(100, 2, true, false), true, "an IPv6 flow: the full path"),
        (
            frame(101, 2, true, false),
            true,
            "IPv6 in sequence: the full path all the same",
        ),
        (frame(200, 2, false, true), true, "a tagged flow: the full path"),
        (
            frame(201, 2, false, true),
            true,
            "tagged in sequence: the full path all the same",
        ),
    ];
    for hook in [Hook::Xdp, Hook::TcIngress] {
        for (i, (frame, written, what)) in steps.iter().enumerate() {
            // Each full-path step's packet has another PSN than the last one the full path
            // saw, so its write shows.
            let before = t.working_memory();
            hook.run(&mut t, frame);
            let after = t.working_memory();
            assert_eq!(before != after, *written, "{hook:?} step {i}, {what}");
        }
        let samples = t.samples();
        assert_eq!(samples.len(), 1, "{hook:?}: the CE packet reported once");
        assert_eq!((samples[0].psn, samples[0].reasons), (14, REASON_CE), "{hook:?}");
        // Eleven packets, every one counted in its flow.
        let flows = t.flows();
        let packets: u64 = flows.iter().map(|(_, c)| c.counts.packets).sum();
        assert_eq!(flows.len(), 3, "{hook:?}: three flows");
        assert_eq!(packets, steps.len() as u64, "{hook:?}");
        // And in the global RoCEv2 count, the fast path's packets as the full path's.
        assert_eq!(
            t.globals().get(GlobalCounter::RoceV2, DIR_INGRESS),
            steps.len() as u64,
            "{hook:?}: RoCEv2 frames"
        );
        t = ProgTest::new(&DatapathOptions {
            sample_rate: 0,
            ..Default::default()
        });
    }
    pin_to_cpu_any();
}

/// Acknowledgements in a row are plain (an ACK has no PSN to follow): after a flow's
/// first, each takes the fast path, which counts an ACK apart from the rest of a plain
/// packet's counts (out of line: the ACK count is on the slot's third cache line, which a
/// data packet does not touch). Each ACK is counted once, a data packet's ACKs are none,
/// at every hook, whichever order they come in.
#[test]
fn plain_acks_are_counted_on_the_fast_path_and_data_packets_count_none() {
    if !can_run_on_cpu0() {
        return;
    }
    let ack = |psn: u32| {
        RoceFrame {
            dest_qp: 0x51,
            psn,
            ext: ext::aeth(0x1f, psn),
            ..f(op::ACKNOWLEDGE)
        }
        .build()
    };
    let data = |psn: u32| {
        RoceFrame {
            dest_qp: 0x52,
            psn,
            ..f(op::WRITE_MIDDLE)
        }
        .build()
    };
    for hook in [Hook::Xdp, Hook::TcIngress, Hook::TcEgress] {
        let mut t = ProgTest::new(&DatapathOptions {
            sample_rate: 0,
            ..Default::default()
        });
        for i in 0..6u32 {
            // Data and ACKs interleaved, each flow's first packet through the full path.
            for frame in [ack(100 + i), data(200 + i)] {
                let before = t.working_memory();
                hook.run(&mut t, &frame);
                let fast = before == t.working_memory();
                assert_eq!(fast, i > 0, "{hook:?} packet {i}: the fast path after the first");
            }
        }
        let flows = t.flows();
        let of = |qp: u32| {
            flows
                .iter()
                .filter(|(k, _)| k.dest_qp == qp)
                .map(|(_, c)| (c.counts.packets, c.counts.ack))
                .collect::<Vec<_>>()
        };
        assert_eq!(of(0x51), [(6, 6)], "{hook:?}: the ACKs, each counted once");
        assert_eq!(
            of(0x52),
            [(6, 0)],
            "{hook:?}: the data packets, no ACK among them"
        );
    }
    pin_to_cpu_any();
}

/// A request like its flow's last plain one is counted without its headers' checks only
/// when its lengths are the last one's and its frame holds any request's extended
/// headers: a frame of the same opcode, TOS and expected PSN whose UDP length does not fit
/// its IP payload, or is too short for a BTH, or that is cut inside its RETH, is refused
/// as the parser refuses it (counted as that failure, not in the flow), and one of other
/// lengths that parses is counted and remembered. Through each hook, a WRITE ONLY flow
/// (RETH) and a WRITE MIDDLE flow.
#[test]
fn a_request_like_the_last_but_for_its_lengths_is_checked_again() {
    if !can_run_on_cpu0() {
        return;
    }
    // Bytes of a plain IPv4 frame: the IPv4 total length and the UDP length.
    const TOT_LEN: usize = 16;
    const UDP_LEN: usize = 38;
    let set = |f: &mut Vec<u8>, at: usize, v: usize| {
        f[at..at + 2].copy_from_slice(&(v as u16).to_be_bytes());
    };
    for opcode in [op::WRITE_ONLY, op::WRITE_MIDDLE] {
        let frame = |psn: u32, payload: usize| {
            RoceFrame {
                dest_qp: 0x61,
                psn,
                ext: if opcode == op::WRITE_ONLY {
                    ext::reth(0x1000, 7, payload as u32)
                } else {
                    Vec::new()
                },
                payload: vec![0x5a; payload],
                ..f(opcode)
            }
            .build()
        };
        let ip_len = |f: &[u8]| f.len() - EthHdr::LEN;
        // (frame, counted in the flow, the failure it is counted as, what it is)
        let mut steps: Vec<(Vec<u8>, bool, Option<GlobalCounter>, &str)> = vec![
            (frame(10, 256), true, None, "the flow's first: the full path"),
            (frame(11, 256), true, None, "plain: checked, remembered"),
            (frame(12, 256), true, None, "its repeat"),
        ];
        // The UDP length past the IP payload, the rest as the repeat's.
        let mut long = frame(13, 256);
        let past = ip_len(&long) - Ipv4Hdr::LEN + 4;
        set(&mut long, UDP_LEN, past);
        steps.push((
            long,
            false,
            Some(GlobalCounter::BadUdpLength),
            "UDP length past the payload",
        ));
        // Shorter than a BTH and an ICRC.
        let mut short = frame(13, 256);
        set(&mut short, UDP_LEN, UdpHdr::LEN + Bth::LEN + 3);
        steps.push((
            short,
            false,
            Some(GlobalCounter::BadUdpLength),
            "UDP length short of a BTH",
        ));
        // Its lengths the repeat's, the frame cut inside the RETH (a WRITE MIDDLE has
        // none: cut there, its frame still holds what the parser reads).
        let mut cut = frame(13, 256);
        cut.truncate(EthHdr::LEN + Ipv4Hdr::LEN + UdpHdr::LEN + Bth::LEN + 10);
        let (counted, failure) = if opcode == op::WRITE_ONLY {
            (false, Some(GlobalCounter::TruncatedExtHeader))
        } else {
            (true, None)
        };
        steps.push((cut, counted, failure, "cut short, the lengths the repeat's"));
        let next = if counted { 14 } else { 13 };
        // Other lengths that parse: counted, then remembered.
        steps.push((frame(next, 64), true, None, "other lengths: checked, remembered"));
        steps.push((frame(next + 1, 64), true, None, "their repeat"));
        // The IP payload one byte longer than the UDP datagram (padding the parser
        // allows): other lengths again, not the repeat's.
        let mut padded = frame(next + 2, 64);
        padded.push(0);
        let l = ip_len(&padded);
        set(&mut padded, TOT_LEN, l);
        steps.push((padded, true, None, "IP padding: checked"));
        for hook in [Hook::Xdp, Hook::TcIngress, Hook::TcEgress] {
            let (mut t, dir) = unsampled(hook);
            let (mut packets, mut bytes) = (0u64, 0u64);
            for (i, (f, counted, failure, what)) in steps.iter().enumerate() {
                let before = t.globals();
                hook.run(&mut t, f);
                let after = t.globals();
                if *counted {
                    packets += 1;
                    bytes += f.len() as u64;
                }
                let flow: Vec<_> = t
                    .flows()
                    .into_iter()
                    .filter(|(k, _)| k.dest_qp == 0x61)
                    .map(|(_, c)| (c.counts.packets, c.counts.bytes, c.counts.psn_gaps))
                    .collect();
                assert_eq!(
                    flow,
                    [(packets, bytes, 0)],
                    "{hook:?} {opcode:#x} step {i}, {what}"
                );
                assert_counted_as(
                    (&before, &after, dir),
                    &[GlobalCounter::BadUdpLength, GlobalCounter::TruncatedExtHeader],
                    *counted,
                    *failure,
                    &format!("{hook:?} {opcode:#x} step {i}, {what}"),
                );
            }
        }
    }
    pin_to_cpu_any();
}

/// A datapath without hash sampling, to run frames through `hook`, and the hook's
/// direction.
fn unsampled(hook: Hook) -> (ProgTest, u8) {
    let t = ProgTest::new(&DatapathOptions {
        sample_rate: 0,
        ..Default::default()
    });
    let dir = if matches!(hook, Hook::TcEgress) {
        DIR_EGRESS
    } else {
        DIR_INGRESS
    };
    (t, dir)
}

/// What one frame moved among a hook's global counters (`before`, `after`, the hook's
/// direction): `RoceV2` by one when it was `counted`, each of `failures` by one when it
/// is the `failure` the frame was counted as, else not at all.
fn assert_counted_as(
    (before, after, dir): (&GlobalTotals, &GlobalTotals, u8),
    failures: &[GlobalCounter],
    counted: bool,
    failure: Option<GlobalCounter>,
    ctx: &str,
) {
    let moved = |g| after.get(g, dir) - before.get(g, dir);
    assert_eq!(moved(GlobalCounter::RoceV2), u64::from(counted), "{ctx}: RoceV2");
    for &g in failures {
        assert_eq!(moved(g), u64::from(failure == Some(g)), "{ctx}: {g:?}");
    }
}

/// An acknowledgement like its flow's last plain one (its TOS, opcode and lengths) is
/// counted without its headers' checks, at whatever PSN (`account::repeats_response`);
/// one that is not like it in what matters is judged as the parser and the full
/// accounting judge it. Through XDP, TC ingress and TC egress, an ACK flow and a READ
/// RESPONSE ONLY flow: after a plain one is remembered, ACKs with other credit counts and
/// PSNs (even one PSN twice) repeat; then a NAK (PSN sequence error) and an RNR NAK with the
/// repeat's lengths are counted as NAKs and reported, not as ACKs; a frame cut inside its
/// AETH with the repeat's lengths is refused (`truncated_ext_header`); a CE-marked one is
/// counted and reported; and the flow repeats again after them. The flow's packets,
/// bytes, ACKs, NAKs and CE marks are exact after every frame, and so are the reports.
#[test]
fn an_acknowledgement_like_the_last_is_counted_without_checks_and_a_nak_or_a_cut_one_is_not() {
    if !can_run_on_cpu0() {
        return;
    }
    #[derive(Clone, Copy, Default, PartialEq, Eq, Debug)]
    struct Flow {
        packets: u64,
        bytes: u64,
        ack: u64,
        nak_psn_seq_err: u64,
        nak_rnr: u64,
        ce: u64,
    }
    /// A frame, what it adds to the flow, the failure it is counted as, the reasons it is
    /// reported for, what it is.
    struct Step {
        frame: Vec<u8>,
        add: Flow,
        failure: Option<GlobalCounter>,
        reasons: u32,
        what: &'static str,
    }
    for opcode in [op::ACKNOWLEDGE, op::READ_RESPONSE_ONLY] {
        let ack = opcode == op::ACKNOWLEDGE;
        let frame = |psn: u32, syndrome: u8, ecn: u8| {
            RoceFrame {
                dest_qp: 0x62,
                psn,
                ecn,
                ext: ext::aeth(syndrome, psn),
                payload: if ack { Vec::new() } else { vec![0x3c; 128] },
                ..f(opcode)
            }
            .build()
        };
        let plain = |f: &Vec<u8>| Flow {
            packets: 1,
            bytes: f.len() as u64,
            ack: u64::from(ack),
            ..Flow::default()
        };
        let step = |frame: Vec<u8>, add: Flow, failure, reasons, what| Step {
            frame,
            add,
            failure,
            reasons,
            what,
        };
        let mut steps = Vec::new();
        for (psn, syndrome, what) in [
            (10, 0x1f, "the flow's first: the full path"),
            (11, 0x1f, "plain: checked, remembered"),
            (12, 0x00, "its repeat, another credit count"),
            (12, 0x05, "its repeat at the same PSN"),
            (9, 0x1f, "its repeat at an earlier PSN"),
        ] {
            let fr = frame(psn, syndrome, 2);
            steps.push(step(fr.clone(), plain(&fr), None, 0, what));
        }
        if ack {
            // A NAK (PSN sequence error) and an RNR NAK: what each adds.
            for (syndrome, what) in [
                (0x60, "a NAK with the repeat's lengths"),
                (0x2e, "an RNR NAK with the repeat's lengths"),
            ] {
                let nak = frame(13, syndrome, 2);
                let add = Flow {
                    packets: 1,
                    bytes: nak.len() as u64,
                    nak_psn_seq_err: u64::from(syndrome == 0x60),
                    nak_rnr: u64::from(syndrome == 0x2e),
                    ..Flow::default()
                };
                steps.push(step(nak, add, None, REASON_NAK, what));
            }
        }
        let mut cut = frame(14, 0x1f, 2);
        cut.truncate(EthHdr::LEN + Ipv4Hdr::LEN + UdpHdr::LEN + Bth::LEN + 2);
        steps.push(step(
            cut,
            Flow::default(),
            Some(GlobalCounter::TruncatedExtHeader),
            0,
            "cut inside the AETH, the lengths the repeat's",
        ));
        let ce = frame(15, 0x1f, 3);
        let add = Flow { ce: 1, ..plain(&ce) };
        steps.push(step(ce, add, None, REASON_CE, "CE-marked: checked, reported"));
        let again = frame(16, 0x1f, 2);
        steps.push(step(again.clone(), plain(&again), None, 0, "the repeat again"));
        for hook in [Hook::Xdp, Hook::TcIngress, Hook::TcEgress] {
            let (mut t, dir) = unsampled(hook);
            let mut want = Flow::default();
            for (
                i,
                Step {
                    frame: fr,
                    add,
                    failure,
                    reasons,
                    what,
                },
            ) in steps.iter().enumerate()
            {
                let before = t.globals();
                hook.run(&mut t, fr);
                let after = t.globals();
                want.packets += add.packets;
                want.bytes += add.bytes;
                want.ack += add.ack;
                want.nak_psn_seq_err += add.nak_psn_seq_err;
                want.nak_rnr += add.nak_rnr;
                want.ce += add.ce;
                let flow: Vec<Flow> = t
                    .flows()
                    .into_iter()
                    .filter(|(k, _)| k.dest_qp == 0x62)
                    .map(|(_, c)| Flow {
                        packets: c.counts.packets,
                        bytes: c.counts.bytes,
                        ack: c.counts.ack,
                        nak_psn_seq_err: c.counts.nak_psn_seq_err,
                        nak_rnr: c.counts.nak_rnr,
                        ce: c.counts.ecn[3],
                    })
                    .collect();
                assert_eq!(flow, [want], "{hook:?} {opcode:#x} step {i}, {what}");
                let got: Vec<u32> = t.samples().iter().map(|s| s.reasons).collect();
                let want_reports = if *reasons == 0 { vec![] } else { vec![*reasons] };
                assert_eq!(
                    got, want_reports,
                    "{hook:?} {opcode:#x} step {i}, {what}: reports"
                );
                assert_counted_as(
                    (&before, &after, dir),
                    &[GlobalCounter::TruncatedExtHeader],
                    add.packets == 1,
                    *failure,
                    &format!("{hook:?} {opcode:#x} step {i}, {what}"),
                );
            }
        }
    }
    pin_to_cpu_any();
}

/// The fast path and the first look judge by the loaded configuration, not the defaults:
/// with a UDP port other than 4791, an expected DSCP and a sampling rate, a flow's packets
/// after its first take the fast path on that port alone, and its reports (an unexpected
/// DSCP, the hash's picks) are what the configuration asks for. Frames to 4791 are then
/// not RoCE.
#[test]
fn the_configured_port_dscp_and_rate_reach_the_fast_path() {
    if !can_run_on_cpu0() {
        return;
    }
    use roce_trace_common::sampling::{identity_hash, threshold_for_rate};
    let (port, rate, seed) = (4792u16, 4u32, 0x5eed_0001u32);
    let frame = |dport: u16, psn: u32, dscp: u8| RoceFrame {
        udp_dport: dport,
        dest_qp: 0x61,
        psn,
        dscp,
        ..f(op::WRITE_MIDDLE)
    };
    for hook in [Hook::Xdp, Hook::TcIngress, Hook::TcEgress] {
        let mut t = ProgTest::new(&DatapathOptions {
            udp_port: port,
            sample_rate: rate,
            seed,
            expected_dscp: vec![26],
            ..Default::default()
        });
        let threshold = threshold_for_rate(rate).unwrap();
        let mut want = Vec::new();
        for i in 0..40u32 {
            // Every tenth packet (but the first) carries DSCP 0, which is not expected.
            let dscp = if i % 10 == 9 { 0 } else { 26 };
            let spec = frame(port, 1000 + i, dscp);
            let hashed = identity_hash(
                seed,
                &mapped(spec.src),
                &mapped(spec.dst),
                spec.udp_sport,
                port,
                0x61,
                1000 + i,
                op::WRITE_MIDDLE,
            ) <= threshold;
            let reasons =
                (u32::from(dscp != 26) * REASON_UNEXPECTED_DSCP) | (u32::from(hashed) * REASON_HASH);
            if reasons != 0 {
                want.push((1000 + i, reasons));
            }
            let before = t.working_memory();
            hook.run(&mut t, &spec.build());
            if i > 0 && reasons == 0 {
                assert_eq!(before, t.working_memory(), "{hook:?} packet {i}: the fast path");
            }
            // The standard port is not the configured one: not RoCE, not counted.
            hook.run(&mut t, &frame(4791, 5000 + i, 26).build());
        }
        let got: Vec<(u32, u32)> = t.samples().iter().map(|s| (s.psn, s.reasons)).collect();
        assert_eq!(got, want, "{hook:?}: the reports the configuration asks for");
        assert!(
            want.iter().any(|w| w.1 == REASON_HASH) && want.iter().any(|w| w.1 & REASON_UNEXPECTED_DSCP != 0),
            "the stream has both kinds of report"
        );
        let flows = t.flows();
        assert_eq!(flows.len(), 1, "{hook:?}: one flow, on port {port}");
        assert_eq!(flows[0].1.counts.packets, 40);
        assert_eq!(
            flows[0].1.counts.dscp_changed, 4,
            "{hook:?}: the four packets not in the flow's first DSCP"
        );
        let g = t.globals();
        assert_eq!(
            g.total(GlobalCounter::RoceV2),
            40,
            "{hook:?}: the 4791 frames are not RoCE"
        );
    }
    pin_to_cpu_any();
}

/// Anomalies are reported whatever the rate; ordinary packets are not when hash sampling
/// is off.
#[test]
fn anomalies_are_always_emitted() {
    if !require_root() {
        return;
    }
    let opts = DatapathOptions {
        sample_rate: 0,
        expected_dscp: EXPECT_DSCP.to_vec(),
        ..Default::default()
    };
    let mut t = ProgTest::new(&opts);
    let frames = [
        (f(op::SEND_ONLY), 0),
        (
            RoceFrame {
                ecn: 3,
                ..f(op::SEND_ONLY)
            },
            REASON_CE,
        ),
        (
            RoceFrame {
                opcode: 0x81,
                dscp: 48,
                ext: ext::cnp(),
                ..Default::default()
            },
            REASON_CNP,
        ),
        (
            RoceFrame {
                ext: ext::aeth(0x60, 1),
                ..f(op::ACKNOWLEDGE)
            },
            REASON_NAK,
        ),
        (
            RoceFrame {
                ext: ext::aeth(0x1f, 1),
                ..f(op::ACKNOWLEDGE)
            },
            0,
        ),
        (
            RoceFrame {
                dscp: 0,
                ..f(op::SEND_ONLY)
            },
            REASON_UNEXPECTED_DSCP,
        ),
    ];
    for (fr, _) in &frames {
        t.run_xdp(&fr.build());
    }
    let got: Vec<u32> = t.samples().iter().map(|s| s.reasons).collect();
    let want: Vec<u32> = frames.iter().map(|(_, r)| *r).filter(|r| *r != 0).collect();
    assert_eq!(got, want);
}

/// The kernel's sampling decision is the shared hash under the shared seed: a host
/// computes which packets every other host samples.
#[test]
fn kernel_samples_exactly_the_packets_the_shared_hash_selects() {
    if !require_root() {
        return;
    }
    use roce_trace_common::sampling::{identity_hash, threshold_for_rate};
    let (rate, seed) = (8, 0xdecafbad);
    let mut t = ProgTest::new(&DatapathOptions {
        sample_rate: rate,
        seed,
        ..Default::default()
    });
    let th = threshold_for_rate(rate).unwrap();
    let mut want = Vec::new();
    // An IPv4 flow, then an IPv6 one: the kernel keeps each flow's share of the hash
    // (its addresses, ports, QP) and finishes it per packet; IPv4 by its own shortcut.
    for psn in (0..400u32).chain(1000..1400) {
        let mut s = RoceFrame {
            psn,
            dest_qp: 0x33,
            ..f(op::WRITE_MIDDLE)
        };
        if psn >= 1000 {
            s.src = "fd00::1".parse().unwrap();
            s.dst = "fd00::2".parse().unwrap();
        }
        t.run_xdp(&s.build());
        let h = identity_hash(
            seed,
            &mapped(s.src),
            &mapped(s.dst),
            s.udp_sport,
            s.udp_dport,
            0x33,
            psn,
            s.opcode,
        );
        if h <= th {
            want.push(psn);
        }
    }
    let got: Vec<u32> = t.samples().iter().map(|s| s.psn).collect();
    assert_eq!(got, want);
    // 1 in 8 of 800, give or take the hash's spread.
    assert!((60..=140).contains(&got.len()), "sampled {}", got.len());
}

/// A full ring buffer loses samples, never packets: each failed reservation is counted
/// and the verdict is pass all the same.
#[test]
fn a_full_ring_is_counted_and_the_packet_passes() {
    if !require_root() {
        return;
    }
    let mut t = ProgTest::new(&DatapathOptions {
        sample_rate: 1,
        ..Default::default()
    });
    let frame = RoceFrame {
        payload: vec![0; 1024],
        ..f(op::WRITE_MIDDLE)
    }
    .build();
    // 4 MiB of 264-byte samples (plus ring headers) is about 15,000; send more, unread.
    let n = 60_000u64;
    t.time_xdp(&frame, n as u32);
    assert_eq!(t.run_xdp(&frame), XDP_PASS, "still passing with the ring full");
    let g = t.globals();
    let emitted = g.get(GlobalCounter::SamplesEmitted, DIR_INGRESS);
    let full = g.get(GlobalCounter::RingbufFull, DIR_INGRESS);
    assert!(full > 10_000, "{full} reservations failed");
    assert_eq!(
        emitted + full,
        n + 1,
        "every packet either sampled or counted as lost to the ring"
    );
    assert_eq!(
        g.get(GlobalCounter::RoceV2, DIR_INGRESS),
        n + 1,
        "and every packet counted"
    );
    assert_eq!(t.samples().len() as u64, emitted);
}

/// With mirror ranges set (the agent's --mirror-from), the datapath takes mirrored copies
/// only from them, before it remembers a session: a copy from a switch outside them
/// (IPv4 and IPv6) is counted `mirror_refused` (not RoCEv2, not mirrored), makes no flow
/// and no `MIRRORS` entry — so forged sessions cannot fill its 1,024 ids — while copies
/// from inside (an IPv4 /24, an IPv6 /64) are taken as before; XDP, TC and the pcap path
/// agree. Fails if the datapath ignores the ranges (the forged sessions take ids).
#[test]
fn mirrored_copies_are_taken_only_from_the_mirror_ranges() {
    if !require_root() {
        return;
    }
    let opts = DatapathOptions {
        sample_rate: 1,
        mirror_from: vec![
            AddrPrefix::new("198.51.100.0".parse().unwrap(), 24),
            AddrPrefix::new("2001:db8:1::".parse().unwrap(), 64),
        ],
        ..Default::default()
    };
    let mut t = ProgTest::new(&opts);
    let m = Mirror::ErspanII {
        session: 7,
        seq: 1,
        index: 1,
    };
    let inner = send_frame();
    let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
    let allowed = m.encapsulate(ip("198.51.100.7"), ip("198.51.100.1"), &inner);
    let allowed6 = m.encapsulate(ip("2001:db8:1::7"), ip("2001:db8:1::1"), &inner);
    let forged = m.encapsulate(ip("203.0.113.9"), ip("198.51.100.1"), &inner);
    let forged6 = m.encapsulate(ip("2001:db8:2::7"), ip("2001:db8:1::1"), &inner);
    for f in [&forged, &forged6] {
        assert_eq!(t.run_xdp(f), XDP_PASS);
        assert_eq!(t.run_tc(f), TC_ACT_UNSPEC);
    }
    let g = t.globals();
    for dir in [DIR_INGRESS, DIR_EGRESS] {
        assert_eq!(g.get(GlobalCounter::MirrorRefused, dir), 2);
        assert_eq!(g.get(GlobalCounter::RoceV2, dir), 0);
        assert_eq!(g.get(GlobalCounter::Mirrored, dir), 0);
    }
    assert!(t.mirrors().is_empty(), "{:?}", t.mirrors());
    assert!(t.flows().is_empty());
    for f in [&allowed, &allowed6] {
        assert_eq!(t.run_xdp(f), XDP_PASS);
    }
    let g = t.globals();
    assert_eq!(g.get(GlobalCounter::RoceV2, DIR_INGRESS), 2);
    assert_eq!(g.get(GlobalCounter::Mirrored, DIR_INGRESS), 2);
    assert_eq!(t.mirrors().len(), 2);
    assert_eq!(t.flows().len(), 2);
    // The pcap path (agent -r, capture -r) takes and refuses the same.
    let mut off = roce_trace_datapath::pcap::Offline::new(&opts).unwrap();
    for (i, f) in [&forged, &forged6, &allowed, &allowed6].into_iter().enumerate() {
        let fr = roce_trace_datapath::pcap::CapturedFrame {
            time_ns: i as u64,
            data: f.clone(),
            orig_len: f.len() as u32,
        };
        off.frame(&fr, |_| {});
    }
    assert_eq!(off.globals.get(GlobalCounter::MirrorRefused, DIR_INGRESS), 2);
    assert_eq!(off.globals.get(GlobalCounter::RoceV2, DIR_INGRESS), 2);
    assert_eq!(off.mirrors.len(), 2);
    // More ranges than the datapath checks are refused at load.
    let many = DatapathOptions {
        mirror_from: vec![AddrPrefix::new(ip("10.0.0.0"), 8); MAX_MIRROR_FROM as usize + 1],
        ..Default::default()
    };
    assert!(many.config().is_err());
}
