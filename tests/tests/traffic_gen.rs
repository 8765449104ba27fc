//! `roce-trace gen` between two namespaces: what it puts on the wire (checked by tshark
//! and scapy), how its responder answers (ACK, NAK, CNP), and how its sender reacts
//! (retransmission, DCQCN).

use std::{sync::Mutex, time::Duration};

use roce_trace_tests::*;
use serde_json::Value;

static SERIAL: Mutex<()> = Mutex::new(());

fn n(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

/// Requests and ACKs on the wire: opcodes, PSNs, QPs as tshark decodes them, and every
/// ICRC as scapy recomputes it — IPv4 and IPv6.
#[test]
fn generated_packets_decode_in_tshark_and_carry_scapys_icrc() {
    if !require_root() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let pair = VethPair::new("gwire");
    let dir = TempDir::new("genwire");
    for (src, dst) in [("10.99.0.1", "10.99.0.2"), ("fd99::1", "fd99::2")] {
        let pcap = dir.path(&format!("gen-{}.pcap", if src.contains(':') { 6 } else { 4 }));
        let dump = start_tcpdump(&pair.b.name, &pair.b_if, &pcap, "udp port 4791");
        let resp = spawn_gen(&pair.b.name, &["--bind", dst, "--duration", "3s"]);
        std::thread::sleep(Duration::from_millis(300));
        let send = spawn_gen(
            &pair.a.name,
            &[
                "--bind",
                src,
                "--to",
                dst,
                "--qps",
                "2",
                "--msg-size",
                "4KiB",
                "--mtu",
                "1024",
                "--rate",
                "20mbit",
                "--duration",
                "1s",
            ],
        );
        let s = gen_report(send);
        let r = gen_report(resp);
        std::thread::sleep(Duration::from_millis(300));
        interrupt(dump);

        let senders = s["senders"].as_array().unwrap();
        assert_eq!(senders.len(), 2);
        let sent: u64 = senders.iter().map(|q| n(&q["packets"])).sum();
        assert!(sent > 1000, "{sent} packets at 20 Mbit/s per QP for 1s");
        let answered: u64 = r["responders"]
            .as_array()
            .unwrap()
            .iter()
            .map(|q| n(&q["in_order"]))
            .sum();
        assert_eq!(answered, sent, "every request arrived in order");

        let rows = tshark_fields(
            &pcap,
            &[
                "infiniband.bth.opcode",
                "infiniband.bth.destqp",
                "infiniband.bth.psn",
                "udp.srcport",
                "infiniband.bth.a",
            ],
        );
        // Per QP: WRITE FIRST, MIDDLE, MIDDLE, LAST (4 KiB at MTU 1024), PSN +1 each,
        // AckReq on LAST; ACKs back to the requester's QP (the responder's QP ^ 1).
        for (qp, sport) in [(0x101u64, 49152u64), (0x103, 49153)] {
            let reqs: Vec<&Vec<String>> = rows
                .iter()
                .filter(|r| u64::from_str_radix(r[1].trim_start_matches("0x"), 16).unwrap() == qp)
                .collect();
            let sent = senders
                .iter()
                .find(|q| n(&q["dest_qp"]) == qp)
                .map(|q| n(&q["packets"]))
                .unwrap();
            // tcpdump may lose the last packet or two of its ring when stopped.
            assert!(
                reqs.len() as u64 <= sent && reqs.len() as u64 + 2 >= sent,
                "{} of {sent}",
                reqs.len()
            );
            for (i, r) in reqs.iter().enumerate() {
                let want_op = [6, 7, 7, 8][i % 4];
                assert_eq!(r[0], want_op.to_string(), "QP {qp:#x} packet {i} opcode");
                // Each QP starts at its own PSN, as NICs do.
                let psn = (roce_trace::traffic::initial_psn(qp as u32 - 1) + i as u32) & 0xff_ffff;
                assert_eq!(r[2], psn.to_string(), "QP {qp:#x} packet {i} PSN");
                assert_eq!(r[3], sport.to_string());
                assert_eq!(
                    r[4],
                    if i % 4 == 3 { "1" } else { "0" },
                    "AckReq on the last packet"
                );
            }
            let acks = rows
                .iter()
                .filter(|r| {
                    r[0] == "17" && u64::from_str_radix(r[1].trim_start_matches("0x"), 16).unwrap() == qp ^ 1
                })
                .count();
            assert!(
                (acks as u64).abs_diff(sent / 4) <= 1,
                "one ACK per message: {acks} for {sent} packets"
            );
        }
        // Every ICRC on the wire is the one scapy computes.
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/scapy_icrc.py");
        let theirs = python_lines(&[script.as_ref(), pcap.as_os_str()]);
        let wire = tshark_fields(&pcap, &["infiniband.invariant.crc"]);
        assert_eq!(theirs.len(), wire.len());
        let mut checked = 0;
        for (t, w) in theirs.iter().zip(&wire) {
            if !w[0].is_empty() {
                assert_eq!(format!("0x{t}"), w[0]);
                checked += 1;
            }
        }
        assert_eq!(
            checked,
            wire.len(),
            "tshark shows the ICRC of every WRITE and ACK"
        );
    }
}

/// Drop 1 in 200 requests on the way in: the responder NAKs each gap once, the sender
/// goes back to the NAKed PSN, and every message completes.
#[test]
fn losses_are_naked_and_retransmitted() {
    if !require_root() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let pair = VethPair::new("gnak");
    pair.b.exec(&[
        "iptables",
        "-A",
        "INPUT",
        "-p",
        "udp",
        "--dport",
        "4791",
        "-m",
        "statistic",
        "--mode",
        "nth",
        "--every",
        "200",
        "--packet",
        "0",
        "-j",
        "DROP",
    ]);
    let resp = spawn_gen(&pair.b.name, &["--bind", "10.99.0.2", "--duration", "4s"]);
    std::thread::sleep(Duration::from_millis(300));
    let send = spawn_gen(
        &pair.a.name,
        &[
            "--to",
            "10.99.0.2",
            "--msg-size",
            "16KiB",
            "--rate",
            "50mbit",
            "--duration",
            "2s",
        ],
    );
    let s = gen_report(send);
    let r = gen_report(resp);
    let q = &s["senders"][0];
    let rq = &r["responders"][0];
    assert!(n(&rq["naks_sent"]) > 0, "gaps were NAKed: {rq}");
    assert_eq!(
        n(&q["naks_psn_seq_err"]),
        n(&rq["naks_sent"]),
        "every NAK reached the sender"
    );
    assert!(
        n(&q["retransmitted"]) >= n(&q["naks_psn_seq_err"]),
        "each NAK caused a go-back"
    );
    assert!(n(&rq["out_of_sequence"]) > 0, "{rq}");
    // Messages the responder completed were all acknowledged, less any whose ACK was in
    // flight when the sender stopped.
    let done = n(&rq["messages"]);
    let acked = n(&q["messages_acked"]);
    assert!(
        acked <= done && done - acked <= 2,
        "acked {acked}, completed {done}"
    );
    assert!(done > 10, "{done} messages");
}

/// CE-mark everything leaving A for 2 s, then stop marking: the responder answers with
/// CNPs (format as a ConnectX sends them, at most one per QP per 50 µs), the sender's
/// rate falls, and recovers once marking stops.
#[test]
fn ce_marks_draw_rate_limited_cnps_and_dcqcn_reacts() {
    if !require_root() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let pair = VethPair::new("gcnp");
    let dir = TempDir::new("gencnp");
    let pcap = dir.path("cnp.pcap");
    let rule = [
        "-t",
        "mangle",
        "POSTROUTING",
        "-p",
        "udp",
        "--dport",
        "4791",
        "-j",
        "ECN",
        "--ecn-ip-ect",
        "3",
    ];
    let add: Vec<&str> = ["iptables", rule[0], rule[1], "-A"]
        .into_iter()
        .chain(rule[2..].iter().copied())
        .collect();
    let del: Vec<&str> = ["iptables", rule[0], rule[1], "-D"]
        .into_iter()
        .chain(rule[2..].iter().copied())
        .collect();
    pair.a.exec(&add);
    let dump = start_tcpdump(&pair.a.name, &pair.a_if, &pcap, "udp port 4791 and inbound");
    let resp = spawn_gen(&pair.b.name, &["--bind", "10.99.0.2", "--duration", "6s"]);
    std::thread::sleep(Duration::from_millis(300));
    let send = spawn_gen(
        &pair.a.name,
        &["--to", "10.99.0.2", "--rate", "100mbit", "--duration", "4s"],
    );
    std::thread::sleep(Duration::from_secs(2));
    pair.a.exec(&del);
    let s = gen_report(send);
    let r = gen_report(resp);
    interrupt(dump);

    let q = &s["senders"][0];
    let rq = &r["responders"][0];
    assert!(n(&rq["ce_marked"]) > 1000, "{rq}");
    let cnps = n(&rq["cnps_sent"]);
    assert!(cnps > 10, "{cnps} CNPs");
    assert_eq!(n(&q["cnps"]), cnps, "every CNP reached the sender");
    // Rate limit: at most one CNP per 50 µs over the ~2 s of marking.
    assert!(cnps <= 2_000_000 / 50 + 1, "{cnps} CNPs");

    // DCQCN: cut well below line rate while marked, back to it at the end.
    let d = &q["dcqcn"];
    let line = 100e6;
    assert!(d["min_rate_seen"].as_f64().unwrap() < line / 4.0, "{d}");
    assert!(
        d["current_rate"].as_f64().unwrap() > line * 0.95,
        "recovered: {d}"
    );
    let timeline: Vec<(u64, f64)> = q["rate_timeline"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (n(&p[0]), p[1].as_f64().unwrap()))
        .collect();
    let during = timeline
        .iter()
        .filter(|(t, _)| (500..1800).contains(t))
        .map(|(_, r)| *r)
        .fold(0.0, f64::max);
    assert!(
        during < line / 1e9 * 0.6,
        "rate stays down while marked: {timeline:?}"
    );

    // CNP format on the wire: opcode 0x81 to the sender's QP, DSCP 48, ECT(0), BECN, 16
    // reserved bytes, UDP 4791.
    let rows = tshark_fields(
        &pcap,
        &[
            "infiniband.bth.opcode",
            "infiniband.bth.destqp",
            "ip.dsfield.dscp",
            "ip.dsfield.ecn",
            "udp.length",
            "data.data",
        ],
    );
    let cnp_rows: Vec<_> = rows.iter().filter(|r| r[0] == "129").collect();
    // tcpdump may lose the tail of its ring when stopped.
    assert!(
        cnp_rows.len() as u64 <= cnps && cnp_rows.len() as u64 * 100 >= cnps * 99,
        "{} of {cnps}",
        cnp_rows.len()
    );
    for r in &cnp_rows {
        assert_eq!(
            u64::from_str_radix(r[1].trim_start_matches("0x"), 16).unwrap(),
            0x100,
            "to the sender's QP"
        );
        assert_eq!((r[2].as_str(), r[3].as_str()), ("48", "2"));
        assert_eq!(r[4], (8 + 12 + 16 + 4).to_string());
    }
    let frames = read_pcap(&pcap);
    let cnp = frames
        .iter()
        .find(|f| f.len() > 42 && f[42] == 0x81)
        .expect("a CNP frame");
    assert_eq!(cnp[42 + 4] & 0x40, 0x40, "BECN set");
    assert_eq!(&cnp[54..70], &[0u8; 16], "16 reserved bytes");
}
