//! Real traffic between two network namespaces: `roce-trace capture` on each side (TC
//! egress where it leaves, XDP and TC ingress where it arrives) reports exact per-flow
//! counts.

use std::{collections::BTreeMap, net::IpAddr, sync::Mutex, time::Duration};

use roce_trace_common::{
    datapath::{PROG_TC, PROG_TC_INGRESS, PROG_XDP, PROGRAMS},
    roce::op,
};
use roce_trace_gen::frame::{RoceFrame, ethernet, ext};
use roce_trace_tests::*;
use serde_json::Value;

/// These tests attach to interfaces and look at loaded programs: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// Expected per-flow totals.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Want {
    packets: u64,
    bytes: u64,
    ecn: [u64; 4],
    cnp: u64,
    ack: u64,
    nak: [u64; 3],
    psn_gaps: u64,
    dscp: u64,
}

struct Traffic {
    frames: Vec<Vec<u8>>,
    flows: BTreeMap<(String, u16, u32), Want>,
    roce_packets: u64,
    noise: u64,
}

/// A known mix: several QPs, DSCP/ECN combinations, CNPs, ACK/NAKs, a PSN gap, IPv6, and
/// non-RoCE noise, interleaved.
fn traffic(src_mac: [u8; 6], dst_mac: [u8; 6]) -> Traffic {
    let a4: IpAddr = "10.99.0.1".parse().unwrap();
    let b4: IpAddr = "10.99.0.2".parse().unwrap();
    let a6: IpAddr = "fd99::1".parse().unwrap();
    let b6: IpAddr = "fd99::2".parse().unwrap();
    let base = RoceFrame {
        src_mac,
        dst_mac,
        src: a4,
        dst: b4,
        ..Default::default()
    };
    let mut specs: Vec<RoceFrame> = Vec::new();
    for psn in 0..50 {
        specs.push(RoceFrame {
            udp_sport: 49152,
            dest_qp: 0x100,
            psn,
            payload: vec![1; 1024],
            opcode: op::WRITE_MIDDLE,
            ..base.clone()
        });
    }
    for psn in 0..30 {
        let ecn = if psn % 3 == 0 { 3 } else { 2 };
        specs.push(RoceFrame {
            udp_sport: 49153,
            dest_qp: 0x101,
            psn,
            ecn,
            payload: vec![2; 512],
            ..base.clone()
        });
    }
    for psn in 0..20 {
        specs.push(RoceFrame {
            udp_sport: 49154,
            dest_qp: 0x102,
            psn,
            dscp: 0,
            ecn: 0,
            ..base.clone()
        });
    }
    for psn in 0..25 {
        specs.push(RoceFrame {
            udp_sport: 49155,
            dest_qp: 0x103,
            psn,
            src: a6,
            dst: b6,
            payload: vec![3; 256],
            ..base.clone()
        });
    }
    for _ in 0..7 {
        specs.push(RoceFrame {
            opcode: 0x81,
            udp_sport: 0,
            dest_qp: 0x200,
            dscp: 48,
            becn: true,
            ext: ext::cnp(),
            ..base.clone()
        });
    }
    for (i, syn) in [0x1f, 0x1f, 0x60, 0x1f, 0x2e, 0x1f, 0x60, 0x1f]
        .into_iter()
        .enumerate()
    {
        specs.push(RoceFrame {
            opcode: op::ACKNOWLEDGE,
            udp_sport: 49160,
            dest_qp: 0x201,
            psn: i as u32,
            ext: ext::aeth(syn, i as u32),
            ..base.clone()
        });
    }
    for psn in (0..10).filter(|p| *p != 5) {
        specs.push(RoceFrame {
            udp_sport: 49161,
            dest_qp: 0x202,
            psn,
            ..base.clone()
        });
    }

    let mut flows: BTreeMap<(String, u16, u32), Want> = BTreeMap::new();
    let mut frames = Vec::new();
    for s in &specs {
        let fr = s.build();
        let w = flows
            .entry((s.src.to_string(), s.udp_sport, s.dest_qp))
            .or_default();
        w.packets += 1;
        w.bytes += fr.len() as u64;
        w.ecn[s.ecn as usize] += 1;
        w.dscp = s.dscp as u64;
        if s.opcode == 0x81 {
            w.cnp += 1;
        }
        if s.opcode == op::ACKNOWLEDGE {
            match s.ext[0] {
                0x1f => w.ack += 1,
                0x60 => w.nak[0] += 1,
                0x2e => w.nak[1] += 1,
                _ => w.nak[2] += 1,
            }
        }
        frames.push(fr);
    }
    flows.get_mut(&(a4.to_string(), 49161, 0x202)).unwrap().psn_gaps = 1;
    let roce_packets = frames.len() as u64;

    // Noise: UDP to another port, TCP, ARP — interleaved with the RoCE frames.
    let mut noise = Vec::new();
    for i in 0..10 {
        noise.push(
            RoceFrame {
                udp_dport: 5000 + i,
                ..base.clone()
            }
            .build(),
        );
    }
    for _ in 0..5 {
        let mut tcp = base.build();
        tcp[14 + 9] = 6;
        noise.push(tcp);
    }
    for _ in 0..3 {
        noise.push(ethernet(
            [0xff; 6],
            src_mac,
            &[],
            0x0806,
            &[0, 1, 8, 0, 6, 4, 0, 1, 0, 0, 0, 0, 0, 0],
        ));
    }
    let n_noise = noise.len() as u64;
    let mut mixed = Vec::new();
    let stride = frames.len() / noise.len();
    for (i, f) in frames.into_iter().enumerate() {
        if i % stride == 0 && !noise.is_empty() {
            mixed.push(noise.pop().unwrap());
        }
        mixed.push(f);
    }
    mixed.extend(noise);
    Traffic {
        frames: mixed,
        flows,
        roce_packets,
        noise: n_noise,
    }
}

fn final_flows(recs: &[Value], direction: &str) -> BTreeMap<(String, u16, u32), Want> {
    recs.iter()
        .filter(|r| r["type"] == "flow" && r["final"] == true && r["direction"] == direction)
        .map(|r| {
            let n = |v: &Value| v.as_u64().unwrap();
            (
                (
                    r["src_ip"].as_str().unwrap().to_owned(),
                    n(&r["udp_sport"]) as u16,
                    n(&r["dst_qp"]) as u32,
                ),
                Want {
                    packets: n(&r["packets"]),
                    bytes: n(&r["bytes"]),
                    ecn: [
                        n(&r["ecn"]["not_ect"]),
                        n(&r["ecn"]["ect1"]),
                        n(&r["ecn"]["ect0"]),
                        n(&r["ecn"]["ce"]),
                    ],
                    cnp: n(&r["cnp"]),
                    ack: n(&r["ack"]),
                    nak: [
                        n(&r["nak"]["psn_seq_err"]),
                        n(&r["nak"]["rnr"]),
                        n(&r["nak"]["other"]),
                    ],
                    psn_gaps: n(&r["psn_gaps"]),
                    dscp: n(&r["dscp"]),
                },
            )
        })
        .collect()
}

#[test]
fn capture_reports_exact_per_flow_counts_on_xdp_and_tc_both_ways() {
    if !require_root() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let pair = VethPair::new("cap");
    let t = traffic(mac_of(&pair.a, &pair.a_if), mac_of(&pair.b, &pair.b_if));
    let count = t.roce_packets.to_string();
    let common = [
        "--json",
        "--sample-rate",
        "1",
        "--expect-dscp",
        "26,48",
        "-c",
        &count,
        "--duration",
        "60s",
    ];
    // Arriving packets through XDP and, at the same time, through TC ingress (what
    // `--ingress-hook auto` picks on veth): the same counts from both.
    let mut rx_xdp_args = vec![
        "-i",
        &pair.b_if,
        "--direction",
        "ingress",
        "--ingress-hook",
        "xdp",
    ];
    rx_xdp_args.extend_from_slice(&common);
    let mut rx_tc_args = vec!["-i", &pair.b_if, "--direction", "ingress"];
    rx_tc_args.extend_from_slice(&common);
    let mut tx_args = vec!["-i", &pair.a_if, "--direction", "egress"];
    tx_args.extend_from_slice(&common);
    let rx_xdp = CaptureProc::start(&pair.b, &rx_xdp_args);
    let rx_tc = CaptureProc::start(&pair.b, &rx_tc_args);
    let tx = CaptureProc::start(&pair.a, &tx_args);

    let frames = t.frames.clone();
    let a_if = pair.a_if.clone();
    pair.a.run(move || send_frames(&a_if, &frames));

    for (side, proc_, dir, hook) in [
        ("XDP", rx_xdp, "ingress", "xdp"),
        ("TC ingress", rx_tc, "ingress", "tc-ingress"),
        ("TC egress", tx, "egress", "tc-egress"),
    ] {
        let recs = proc_.finish();
        let summary = recs
            .iter()
            .find(|r| r["type"] == "summary")
            .expect("summary record");
        assert_eq!(summary["hooks"][0]["hook"], hook, "{side}: the hook attached");
        assert_eq!(
            summary["hooks"].as_array().map(Vec::len),
            Some(1),
            "{side}: one hook"
        );
        let got = final_flows(&recs, dir);
        assert_eq!(got, t.flows, "{side}: exact per-flow counts");
        let samples = recs.iter().filter(|r| r["type"] == "sample").count() as u64;
        assert_eq!(samples, t.roce_packets, "{side}: one sample per packet at rate 1");
        let summary = recs
            .iter()
            .find(|r| r["type"] == "summary")
            .expect("summary record");
        assert_eq!(summary["stopped_by"], "count");
        assert_eq!(summary["packets"], t.roce_packets);
        assert_eq!(summary["ringbuf_drops"], 0);
        let non_roce = summary["counters"][dir]["non_roce"].as_u64().unwrap();
        // The kernel counts no non-RoCE frame: these are the interface's counters, less
        // what the datapath counted; the kernel may add its own frames (IPv6 neighbour
        // discovery) to our noise.
        assert_eq!(summary["frames_from"], "interface counters", "{side}");
        assert!(non_roce >= t.noise, "{side}: non-RoCE {non_roce} < {}", t.noise);
        let frames = summary["counters"][dir]["frames_seen"].as_u64().unwrap();
        assert!(
            frames >= t.roce_packets + t.noise,
            "{side}: {frames} frames seen, fewer than the {} RoCE and {} other frames sent",
            t.roce_packets,
            t.noise
        );
        // Samples carry the class: the DSCP 0 flow's are flagged unexpected.
        let flagged = recs
            .iter()
            .filter(|r| r["type"] == "sample" && r["dst_qp"] == 0x102)
            .all(|r| {
                r["reasons"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|x| x == "unexpected_dscp")
            });
        assert!(flagged, "{side}: DSCP 0 samples flagged");
    }
}

/// The roce-trace programs process `pid` holds (through its program and link fds): their
/// ids, and their names sorted. Other roce-trace processes on the host (another test, a
/// lab's agents) do not count.
fn programs_of(pid: u32) -> (Vec<u32>, Vec<String>) {
    let mut ids = std::collections::BTreeSet::new();
    for fd in std::fs::read_dir(format!("/proc/{pid}/fdinfo"))
        .unwrap()
        .flatten()
    {
        let Ok(info) = std::fs::read_to_string(fd.path()) else {
            continue;
        };
        ids.extend(
            info.lines()
                .filter_map(|l| l.strip_prefix("prog_id:"))
                .map(|v| v.trim().parse::<u32>().unwrap()),
        );
    }
    let mut names: Vec<String> = aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .filter(|p| ids.contains(&p.id()))
        .filter_map(|p| p.name_as_str().map(str::to_owned))
        .filter(|n| PROGRAMS.contains(&n.as_str()))
        .collect();
    names.sort();
    (ids.into_iter().collect(), names)
}

/// Which of `ids` are still loaded.
fn still_loaded(ids: &[u32]) -> Vec<u32> {
    aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .map(|p| p.id())
        .filter(|id| ids.contains(id))
        .collect()
}

/// Programs hang off BPF links owned by the process: SIGKILL must not leave them behind,
/// whichever hook observes ingress.
#[test]
fn programs_detach_when_capture_is_killed() {
    if !require_root() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let pair = VethPair::new("kill");
    for (extra, loaded) in [
        (None, [PROG_TC, PROG_TC_INGRESS]),
        (Some("xdp"), [PROG_TC, PROG_XDP]),
    ] {
        let mut args = vec!["-i", &pair.b_if, "--json"];
        if let Some(h) = extra {
            args.extend(["--ingress-hook", h]);
        }
        let mut p = CaptureProc::start(&pair.b, &args);
        // `ip netns exec` execs the capture: the child's pid is the capture's.
        let (ids, names) = programs_of(p.child.id());
        assert_eq!(names, loaded, "loaded while capturing ({extra:?})");
        let link = pair.b.exec(&["ip", "link", "show", "dev", &pair.b_if]);
        assert_eq!(
            link.contains("xdp"),
            extra.is_some(),
            "XDP attached only when asked: {link}"
        );
        p.child.kill().unwrap(); // SIGKILL
        p.child.wait().unwrap();
        // Give the kernel a moment to release the links.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !still_loaded(&ids).is_empty() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(
            still_loaded(&ids),
            Vec::<u32>::new(),
            "programs gone after SIGKILL"
        );
        let link = pair.b.exec(&["ip", "link", "show", "dev", &pair.b_if]);
        assert!(!link.contains("xdp"), "XDP detached: {link}");
    }
}

/// Voluntary context switches of every thread of `pid`: how often it went to sleep.
fn sleeps_of(pid: u32) -> u64 {
    let mut n = 0;
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let status = std::fs::read_to_string(t.unwrap().path().join("status")).unwrap_or_default();
        n += status
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
    }
    n
}

/// An idle capture sleeps until its timer is due: it reads its tables and drains the
/// sample ring on one tick a second — not five times (a drain timer beside the interval's,
/// the two a moment apart), nor ten, as with tokio's intervals, whose entries beyond the
/// timer wheel's first level (64 ms) wake the process once more a period to move down a
/// level. On every port all the time, each wake-up costs (about 90 µs of CPU in this VM).
#[test]
fn an_idle_capture_wakes_only_when_its_timers_are_due() {
    if !require_root() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let pair = VethPair::new("idl");
    let mut p = CaptureProc::start(&pair.b, &["-i", &pair.b_if, "--json"]);
    // `ip netns exec` execs the capture: the child's pid is the capture's.
    let pid = p.child.id();
    std::thread::sleep(Duration::from_secs(1));
    let before = sleeps_of(pid);
    std::thread::sleep(Duration::from_secs(4));
    let woke = sleeps_of(pid) - before;
    p.child.kill().unwrap();
    p.child.wait().unwrap();
    // 4 s: 4 ticks are due; a drain timer of its own made 16–20, tokio's intervals about 40.
    assert!(
        (2..=6).contains(&woke),
        "an idle capture woke {woke} times in 4 s (its timer is due 4 times)"
    );
}

/// `capture -i … -w FILE.pcapng` on live traffic: tshark reads the file back with the same
/// fields the JSON samples carry, one interface per observation point (the XDP hook and a
/// switch's ERSPAN session), original lengths kept; small packets carried whole have
/// their ICRC checked, and a corrupted one is counted on its flow.
#[test]
fn live_capture_writes_pcapng_that_tshark_decodes_the_same() {
    use roce_trace_gen::frame::{IcrcMode, Mirror};
    if !require_root() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let pair = VethPair::new("7w");
    let (src_mac, dst_mac) = (mac_of(&pair.a, &pair.a_if), mac_of(&pair.b, &pair.b_if));
    let base = RoceFrame {
        src_mac,
        dst_mac,
        src: "10.99.0.1".parse().unwrap(),
        dst: "10.99.0.2".parse().unwrap(),
        ..Default::default()
    };
    let mut frames = Vec::new();
    for psn in 0..10 {
        frames.push(
            RoceFrame {
                psn,
                dest_qp: 0x100,
                payload: vec![1; 1024],
                opcode: op::WRITE_MIDDLE,
                ..base.clone()
            }
            .build(),
        );
    }
    for psn in 0..5 {
        frames.push(
            RoceFrame {
                src: "fd99::1".parse().unwrap(),
                dst: "fd99::2".parse().unwrap(),
                psn,
                dest_qp: 0x200,
                dscp: 10,
                ecn: 1,
                payload: vec![3; 16],
                ..base.clone()
            }
            .build(),
        );
    }
    let cnp = RoceFrame {
        opcode: 0x81,
        dscp: 48,
        udp_sport: 0,
        becn: true,
        dest_qp: 0x118,
        ext: ext::cnp(),
        ..base.clone()
    };
    for psn in 0..3 {
        frames.push(RoceFrame { psn, ..cnp.clone() }.build());
    }
    frames.push(
        RoceFrame {
            psn: 3,
            icrc: IcrcMode::Fixed([0xde, 0xad, 0xbe, 0xef]),
            ..cnp.clone()
        }
        .build(),
    );
    let switch: IpAddr = "198.51.100.7".parse().unwrap();
    for psn in 0..4 {
        let ack = RoceFrame {
            psn,
            dest_qp: 0x300,
            ttl: 61,
            ecn: 3,
            opcode: op::ACKNOWLEDGE,
            ext: ext::aeth(0x1f, psn),
            ..base.clone()
        };
        frames.push(
            Mirror::ErspanII {
                session: 5,
                seq: psn,
                index: 1,
            }
            .encapsulate(switch, "10.99.0.2".parse().unwrap(), &ack.build()),
        );
    }
    let n = frames.len();
    let dir = TempDir::new("rt7-pcapng");
    let out = dir.path("live.pcapng");
    let out_s = out.to_str().unwrap().to_owned();
    let count = n.to_string();
    let rx = CaptureProc::start(
        &pair.b,
        &[
            "-i",
            &pair.b_if,
            "--direction",
            "ingress",
            "--json",
            "--sample-rate",
            "1",
            "-c",
            &count,
            "--duration",
            "60s",
            "-w",
            &out_s,
        ],
    );
    let a_if = pair.a_if.clone();
    pair.a.run(move || send_frames(&a_if, &frames));
    let recs = rx.finish();
    let samples: Vec<&Value> = recs.iter().filter(|r| r["type"] == "sample").collect();
    assert_eq!(samples.len(), n, "one sample per packet at rate 1");

    let fields = [
        "frame.interface_name",
        "ip.src",
        "ip.dst",
        "ipv6.src",
        "ipv6.dst",
        "udp.srcport",
        "infiniband.bth.opcode",
        "infiniband.bth.destqp",
        "infiniband.bth.psn",
        "ip.dsfield.dscp",
        "ip.dsfield.ecn",
        "ipv6.tclass.dscp",
        "ipv6.tclass.ecn",
        "frame.len",
        "frame.cap_len",
    ];
    // The inner (mirrored) packet's fields where a frame has two IP headers.
    let rows = tshark_fields_occurrence(&out, &fields, 'l');
    assert_eq!(rows.len(), n, "every sample is a packet in the pcapng");
    let num = |s: &str| match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16).unwrap(),
        None => s.parse::<u64>().unwrap_or_else(|_| panic!("not a number: {s:?}")),
    };
    let host = roce_trace_datapath::sys::hostname();
    let ecn_names = ["not_ect", "ect1", "ect0", "ce"];
    let mut mirrored = 0;
    for (i, (row, s)) in rows.iter().zip(&samples).enumerate() {
        let v6 = !row[3].is_empty();
        let (src, dst, dscp, ecn) = if v6 {
            (&row[3], &row[4], &row[11], &row[12])
        } else {
            (&row[1], &row[2], &row[9], &row[10])
        };
        assert_eq!(s["src_ip"], src.as_str(), "{i}: src");
        assert_eq!(s["dst_ip"], dst.as_str(), "{i}: dst");
        assert_eq!(s["udp_sport"], num(&row[5]), "{i}: udp sport");
        assert_eq!(s["opcode"], num(&row[6]), "{i}: opcode");
        assert_eq!(s["dst_qp"], num(&row[7]), "{i}: destqp");
        assert_eq!(s["psn"], num(&row[8]), "{i}: psn");
        assert_eq!(s["dscp"], num(dscp), "{i}: dscp");
        assert_eq!(s["ecn"], ecn_names[num(ecn) as usize], "{i}: ecn");
        assert_eq!(s["frame_len"], num(&row[13]), "{i}: original length");
        assert_eq!(num(&row[14]), num(&row[13]).min(128), "{i}: leading bytes kept");
        let want_if = match s.get("mirror") {
            Some(m) => {
                mirrored += 1;
                assert_eq!(m["src_ip"], "198.51.100.7");
                assert_eq!(m["session"], 5);
                "198.51.100.7/erspan-5/mirror".to_owned()
            }
            None => format!("{host}/{}/ingress", pair.b_if),
        };
        assert_eq!(row[0], want_if, "{i}: interface = observation point");
    }
    assert_eq!(mirrored, 4);
    // Whole small packets (small SENDs, CNPs, mirrored ACKs) are ICRC-checked; the bad one
    // is counted.
    let checked: Vec<(u64, bool)> = samples
        .iter()
        .filter(|s| s.get("icrc_ok").is_some())
        .map(|s| (s["psn"].as_u64().unwrap(), s["icrc_ok"].as_bool().unwrap()))
        .collect();
    assert_eq!(
        checked.len(),
        13,
        "5 small IPv6 SENDs, 3 + 1 CNPs and 4 mirrored ACKs: {checked:?}"
    );
    assert_eq!(checked.iter().filter(|c| !c.1).count(), 1);
    let cnp_flow = recs
        .iter()
        .find(|r| r["type"] == "flow" && r["final"] == true && r["dst_qp"] == 0x118)
        .expect("CNP flow");
    assert_eq!(cnp_flow["icrc_errors"], 1, "{cnp_flow}");
    let write_flow = recs
        .iter()
        .find(|r| r["type"] == "flow" && r["final"] == true && r["dst_qp"] == 0x100)
        .expect("WRITE flow");
    assert!(
        write_flow.get("icrc_errors").is_none(),
        "big packets are not checked"
    );
    // Flow keys carry only a mirror id: the flow record names its session through the
    // kernel's MIRRORS map; plain flows have none.
    let finals: Vec<&Value> = recs
        .iter()
        .filter(|r| r["type"] == "flow" && r["final"] == true)
        .collect();
    let ack_flow = finals
        .iter()
        .find(|r| r["dst_qp"] == 0x300)
        .expect("mirrored ACK flow");
    assert_eq!(
        ack_flow["mirror"],
        serde_json::json!({"src_ip": "198.51.100.7", "session": 5, "kind": "erspan2"}),
        "{ack_flow}"
    );
    assert_eq!(ack_flow["packets"], 4, "{ack_flow}");
    assert!(
        finals
            .iter()
            .filter(|r| r["dst_qp"] != 0x300)
            .all(|r| r.get("mirror").is_none()),
        "{finals:?}"
    );
}

/// TC reads what a host sends without writing to it: `bpf_skb_pull_data` (which may copy
/// an skb's head) runs only for a RoCEv2 or GRE candidate whose headers are not all in the
/// linear area. A TCP bulk transfer (payload in page fragments, as TCP sends it) and UDP to
/// another port with its headers linear and its payload paged are never pulled; 4 KiB RoCE
/// writes whose headers sit in fragments (only Ethernet, or only up to UDP, linear) are
/// pulled and counted exactly. Fails if TC pulls every packet with a short linear area (as
/// it did: `headers_pulled` counts the TCP segments) or never pulls (the RoCE frames with
/// paged headers come out `truncated_ip` / `truncated_bth`, not RoCE).
#[test]
fn tc_pulls_headers_only_for_roce_candidates_whose_headers_are_paged() {
    if !require_root() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let pair = VethPair::new("pul");
    for (ns, ifn) in [(&pair.a, &pair.a_if), (&pair.b, &pair.b_if)] {
        ns.exec(&["ip", "link", "set", ifn, "mtu", "9000"]);
    }
    let (src_mac, dst_mac) = (mac_of(&pair.a, &pair.a_if), mac_of(&pair.b, &pair.b_if));
    let roce = |sport: u16, n: u32| -> Vec<Vec<u8>> {
        (0..n)
            .map(|psn| {
                RoceFrame {
                    src_mac,
                    dst_mac,
                    src: "10.99.0.1".parse().unwrap(),
                    dst: "10.99.0.2".parse().unwrap(),
                    udp_sport: sport,
                    dest_qp: 0x300,
                    psn,
                    opcode: op::WRITE_MIDDLE,
                    payload: vec![5; 4096],
                    ..Default::default()
                }
                .build()
            })
            .collect()
    };
    let eth_only = roce(49160, 12);
    let to_udp = roce(49161, 8);
    let frame_len = eth_only[0].len() as u64;
    // UDP to port 9999, headers linear, 4 KiB of payload paged: not a candidate.
    let other_udp: Vec<Vec<u8>> = {
        let mut f = roce(49162, 10);
        for fr in &mut f {
            // The UDP destination port (after 14 + 20 bytes) → 9999; the UDP checksum is
            // zero in these frames, so nothing else changes.
            fr[36..38].copy_from_slice(&9999u16.to_be_bytes());
        }
        f
    };
    let args = [
        "-i",
        &pair.a_if,
        "--direction",
        "egress",
        "--json",
        "--sample-rate",
        "1",
        "-c",
        "20",
        "--duration",
        "60s",
    ];
    let cap = CaptureProc::start(&pair.a, &args);
    // TCP: 32 MiB from a to b, in 64 KiB writes.
    let listener = pair
        .b
        .run(|| std::net::TcpListener::bind("10.99.0.2:5201").unwrap());
    let sink = std::thread::spawn(move || {
        use std::io::Read;
        let (mut s, _) = listener.accept().unwrap();
        let mut buf = vec![0u8; 1 << 16];
        let mut n = 0usize;
        while let Ok(k) = s.read(&mut buf) {
            if k == 0 {
                break;
            }
            n += k;
        }
        n
    });
    pair.a.run(|| {
        use std::io::Write;
        let mut s = std::net::TcpStream::connect("10.99.0.2:5201").unwrap();
        let chunk = vec![0x5a; 1 << 16];
        for _ in 0..512 {
            s.write_all(&chunk).unwrap();
        }
    });
    assert_eq!(sink.join().unwrap(), 32 << 20);
    let a_if = pair.a_if.clone();
    pair.a.run(move || {
        send_frames_paged(&a_if, &other_udp, 42);
        send_frames_paged(&a_if, &eth_only, 14);
        send_frames_paged(&a_if, &to_udp, 42);
    });
    let recs = cap.finish();
    let summary = recs
        .iter()
        .find(|r| r["type"] == "summary")
        .expect("summary record");
    let c = &summary["counters"]["egress"];
    assert_eq!(
        c["headers_pulled"], 20,
        "only the RoCE frames with paged headers: {c}"
    );
    assert_eq!(c["rocev2"], 20, "{c}");
    assert!(
        c["non_roce"].as_u64().unwrap() >= 10 + 100,
        "TCP and UDP counted: {c}"
    );
    let flows = final_flows(&recs, "egress");
    for (sport, n) in [(49160u16, 12u64), (49161, 8)] {
        let (_, f) = flows
            .iter()
            .find(|((_, s, _), _)| *s == sport)
            .unwrap_or_else(|| panic!("flow {sport}: {flows:?}"));
        assert_eq!(f.packets, n, "sport {sport}");
        assert_eq!(f.bytes, n * frame_len, "sport {sport}");
    }
}
