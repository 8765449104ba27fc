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

/// B's firewall drops every `n`th request arriving on UDP 4791 (deterministic: nth mode).
fn drop_every_nth_request(pair: &VethPair, n: u32) {
    let n = n.to_string();
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
        &n,
        "--packet",
        "0",
        "-j",
        "DROP",
    ]);
}

/// The responder QP of sender QP `q` in a responder's report.
fn responder_of<'a>(r: &'a Value, q: &Value) -> &'a Value {
    r["responders"]
        .as_array()
        .unwrap()
        .iter()
        .find(|rq| rq["qp"] == q["dest_qp"])
        .unwrap_or_else(|| panic!("no responder QP for {q}"))
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
                let psn = (roce_trace_gen::traffic::initial_psn(qp as u32 - 1) + i as u32) & 0xff_ffff;
                assert_eq!(r[2], psn.to_string(), "QP {qp:#x} packet {i} PSN");
                assert_eq!(r[3], sport.to_string());
                assert_eq!(
                    r[4],
                    if i % 4 == 3 { "1" } else { "0" },
                    "AckReq on the last packet"
                );
            }
            let acks: Vec<_> = rows
                .iter()
                .filter(|r| {
                    r[0] == "17" && u64::from_str_radix(r[1].trim_start_matches("0x"), 16).unwrap() == qp ^ 1
                })
                .collect();
            // Each responder QP replies from a port of its own, as NICs do, so the
            // replies of different QPs take different ECMP paths.
            let port = roce_trace_gen::traffic::reply_port(qp as u32).to_string();
            assert!(
                acks.iter().all(|r| r[3] == port),
                "ACKs of QP {qp:#x} from port {port}: {:?}",
                acks.first()
            );
            let acks = acks.len();
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

/// Drop 1 in 200 requests on the way in, over 4 QPs: the responder NAKs each gap once,
/// the sender goes back to the NAKed PSN (or, when a retransmission is lost too, to the
/// oldest unacknowledged message once the ACK timeout passes), and every message
/// completes: on every QP, messages completed == messages sent, exactly.
#[test]
fn losses_are_naked_and_retransmitted() {
    if !require_root() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let pair = VethPair::new("gnak");
    drop_every_nth_request(&pair, 200);
    let resp = spawn_gen(&pair.b.name, &["--bind", "10.99.0.2", "--duration", "5s"]);
    std::thread::sleep(Duration::from_millis(300));
    let send = spawn_gen(
        &pair.a.name,
        &[
            "--to",
            "10.99.0.2",
            "--qps",
            "4",
            "--msg-size",
            "16KiB",
            "--rate",
            "20mbit",
            "--duration",
            "2s",
            "--ack-timeout",
            "20ms",
        ],
    );
    let s = gen_report(send);
    let r = gen_report(resp);
    let senders = s["senders"].as_array().unwrap();
    assert_eq!(senders.len(), 4);
    let dropped = pair.b.exec(&["iptables", "-L", "INPUT", "-v", "-x", "-n"]);
    let drops: u64 = dropped
        .lines()
        .find(|l| l.contains("DROP"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no DROP counter in {dropped}"));
    assert!(drops > 10, "the rule dropped {drops} requests");
    let mut naks = 0;
    for q in senders {
        let rq = responder_of(&r, q);
        let sent = n(&q["messages_sent"]);
        // 20 Mbit/s for 2 s of 16 KiB messages (16 frames of 1098 bytes): ~140 each at
        // full rate, less the go-backs and ACK timeouts; 92 seen once on a CPU shared with
        // a compiler. At least 60: enough messages that each QP met several losses.
        assert!(sent > 60, "{sent} messages sent: {q}");
        assert_eq!(n(&q["messages_acked"]), sent, "every message completed: {q}");
        assert_eq!(
            n(&rq["messages"]),
            sent,
            "the responder completed each once: {rq}"
        );
        assert_eq!(n(&q["unacked_at_end"]), 0, "{q}");
        assert_eq!(q["retry_exceeded"], false, "{q}");
        assert!(n(&q["naks_psn_seq_err"]) <= n(&rq["naks_sent"]), "{q} {rq}");
        assert!(
            n(&q["retransmitted"]) >= n(&q["naks_psn_seq_err"]),
            "each NAK caused a go-back: {q}"
        );
        naks += n(&rq["naks_sent"]);
    }
    assert!(naks > 0, "gaps were NAKed: {r}");
}

/// Every NAK is lost on the way back (and 1 in 100 requests on the way in): nothing tells
/// the sender of a gap, so only RC's local ACK timeout can recover — each QP still
/// completes every message, with timeouts counted; and a QP whose peer is gone gives up
/// after its retry count instead of sending forever.
#[test]
fn lost_naks_are_recovered_by_the_ack_timeout_and_a_dead_peer_exceeds_the_retries() {
    if !require_root() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let pair = VethPair::new("gto");
    drop_every_nth_request(&pair, 100);
    // A PSN-sequence-error NAK: BTH opcode 0x11 (UDP payload byte 0) with AETH syndrome
    // 0x60 (byte 12).
    pair.a.exec(&["nft", "add", "table", "inet", "gto"]);
    pair.a.exec(&[
        "nft",
        "add",
        "chain",
        "inet",
        "gto",
        "in",
        "{ type filter hook input priority 0 ; }",
    ]);
    pair.a.exec(&[
        "nft",
        "add",
        "rule",
        "inet",
        "gto",
        "in",
        "udp",
        "dport",
        "4791",
        "@th,64,8",
        "0x11",
        "@th,160,8",
        "0x60",
        "counter",
        "drop",
    ]);
    let resp = spawn_gen(&pair.b.name, &["--bind", "10.99.0.2", "--duration", "5s"]);
    std::thread::sleep(Duration::from_millis(300));
    let send = spawn_gen(
        &pair.a.name,
        &[
            "--to",
            "10.99.0.2",
            "--qps",
            "2",
            "--msg-size",
            "16KiB",
            "--rate",
            "20mbit",
            "--duration",
            "2s",
            "--ack-timeout",
            "20ms",
        ],
    );
    let s = gen_report(send);
    let r = gen_report(resp);
    let nft = pair.a.exec(&["nft", "list", "table", "inet", "gto"]);
    let lost_naks: u64 = nft
        .split("packets ")
        .nth(1)
        .and_then(|t| t.split_whitespace().next())
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no counter in {nft}"));
    let naks_sent: u64 = r["responders"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| n(&q["naks_sent"]))
        .sum();
    assert!(naks_sent > 0, "{r}");
    assert_eq!(lost_naks, naks_sent, "every NAK was dropped");
    for q in s["senders"].as_array().unwrap() {
        assert_eq!(n(&q["naks_psn_seq_err"]), 0, "no NAK arrived: {q}");
        assert!(n(&q["timeouts"]) > 0, "gaps recovered by the timeout: {q}");
        let sent = n(&q["messages_sent"]);
        assert!(sent > 50, "{q}");
        assert_eq!(n(&q["messages_acked"]), sent, "every message completed: {q}");
        assert_eq!(q["retry_exceeded"], false, "{q}");
    }

    // The responder is gone: no ACK ever comes, so after 3 timeouts of 20 ms in a row the
    // next one puts the QP in error — it stops sending at once instead of for the whole
    // run, and gen ends without draining.
    let send = spawn_gen(
        &pair.a.name,
        &[
            "--to",
            "10.99.0.2",
            "--msg-size",
            "4KiB",
            "--rate",
            "10mbit",
            "--duration",
            "300ms",
            "--ack-timeout",
            "20ms",
            "--retry-count",
            "3",
        ],
    );
    let s = gen_report(send);
    let q = &s["senders"][0];
    assert_eq!(q["retry_exceeded"], true, "{q}");
    assert_eq!(n(&q["timeouts"]), 3, "{q}");
    assert_eq!(n(&q["messages_acked"]), 0, "{q}");
    assert_eq!(n(&q["unacked_at_end"]), n(&q["messages_sent"]), "{q}");
    // ~1,100 packets a second: about 80 ms of sending before the QP gave up, not 300.
    assert!(n(&q["packets"]) < 200, "stopped sending in error: {q}");
    assert!(s["drain_s"].as_f64().unwrap() < 0.05, "nothing to drain: {s}");
}

/// CE-mark everything leaving A for 2 s, then stop marking: the responder answers with
/// CNPs (format as a ConnectX sends them), the sender's rate falls, and recovers once
/// marking stops. (The rate limit is tested apart: `cnps_are_rate_limited_per_qp`.)
#[test]
fn ce_marks_draw_cnps_and_dcqcn_reacts() {
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
    let ce = n(&rq["ce_marked"]);
    assert!(ce > 1000, "{rq}");
    let cnps = n(&rq["cnps_sent"]);
    assert_eq!(n(&q["cnps"]), cnps, "every CNP reached the sender");
    // No more CNPs than CE marks, nor than one per 50 µs of the ~2 s of marking.
    assert!(
        cnps > 100 && cnps <= ce.min(2_000_000 / 50 + 1),
        "{cnps} CNPs for {ce} CE marks"
    );

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
        // Marking stops 2 s after the sender was spawned; its clock starts when it is up,
        // up to a few hundred ms later on a loaded machine.
        .filter(|(t, _)| (500..1400).contains(t))
        .map(|(_, r)| *r)
        .fold(0.0, f64::max);
    assert!(
        during < line / 1e9 * 0.6,
        "rate stays down while marked: {:?}",
        timeline.iter().filter(|(t, _)| *t < 2500).collect::<Vec<_>>()
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

/// A constant 100 Mbit/s (no DCQCN), every request CE-marked for 2 s, CNP interval 1 ms:
/// the responder sends at most one CNP per QP per millisecond — a tenth of the CE marks
/// or fewer — and never two closer than that on the wire.
#[test]
fn cnps_are_rate_limited_per_qp() {
    if !require_root() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let pair = VethPair::new("grl");
    let dir = TempDir::new("genrl");
    let pcap = dir.path("cnp.pcap");
    pair.a.exec(&[
        "iptables",
        "-t",
        "mangle",
        "-A",
        "POSTROUTING",
        "-p",
        "udp",
        "--dport",
        "4791",
        "-j",
        "ECN",
        "--ecn-ip-ect",
        "3",
    ]);
    let dump = start_tcpdump(&pair.b.name, &pair.b_if, &pcap, "udp port 4791 and outbound");
    let resp = spawn_gen(
        &pair.b.name,
        &["--bind", "10.99.0.2", "--duration", "3s", "--cnp-interval", "1ms"],
    );
    std::thread::sleep(Duration::from_millis(300));
    let send = spawn_gen(
        &pair.a.name,
        &[
            "--to",
            "10.99.0.2",
            "--qps",
            "2",
            "--rate",
            "100mbit",
            "--duration",
            "2s",
            "--no-dcqcn",
        ],
    );
    let s = gen_report(send);
    let r = gen_report(resp);
    interrupt(dump);
    let times: Vec<(u64, f64)> = tshark_fields(
        &pcap,
        &[
            "infiniband.bth.opcode",
            "infiniband.bth.destqp",
            "frame.time_epoch",
        ],
    )
    .iter()
    .filter(|r| r[0] == "129")
    .map(|r| {
        (
            u64::from_str_radix(r[1].trim_start_matches("0x"), 16).unwrap(),
            r[2].parse().unwrap(),
        )
    })
    .collect();
    for q in s["senders"].as_array().unwrap() {
        let rq = responder_of(&r, q);
        let (ce, cnps) = (n(&rq["ce_marked"]), n(&rq["cnps_sent"]));
        assert_eq!(ce, n(&rq["packets"]), "every request CE-marked: {rq}");
        assert!(ce > 5_000, "{rq}");
        // At most one per millisecond the sender ran (it sends in bursts, as a paced
        // sender must, so fewer: one per burst at most), and far fewer than CE marks.
        let ms = s["duration_s"].as_f64().unwrap() * 1000.0;
        assert!(
            cnps as f64 <= ms + 1.0 && cnps > 500,
            "{cnps} CNPs for {ce} CE marks in {ms} ms"
        );
        assert_eq!(n(&q["cnps"]), cnps, "every CNP arrived");
        let qp = n(&q["qp"]);
        let t: Vec<f64> = times.iter().filter(|(d, _)| *d == qp).map(|(_, t)| *t).collect();
        // tcpdump may lose the last packet or two of its ring when stopped.
        let seen = t.len() as u64;
        assert!(
            seen <= cnps && seen + 2 >= cnps,
            "QP {qp:#x}: {seen} of {cnps} CNPs on the wire"
        );
        // Timestamps taken as each CNP leaves the responder: a preempted send can land
        // late, so single gaps jitter by the scheduler's whims; any 11 CNPs still span at
        // least 9 intervals.
        let tightest = t.windows(11).map(|w| w[10] - w[0]).fold(f64::MAX, f64::min);
        assert!(tightest > 0.009, "QP {qp:#x}: 11 CNPs within {tightest} s");
    }
}

/// A request gen cannot answer never stops its responder: a request with a valid ICRC
/// from an address with no route back (spoofed), then a real sender's traffic. The
/// responder counts the reply it could not send and answers every message of the
/// sender. Fails if the failed reply ends the responder (as it did: gen exited with
/// "replying to 203.0.113.7:4791").
#[test]
fn a_request_that_cannot_be_answered_does_not_stop_the_responder() {
    if !require_root() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let pair = VethPair::new("gspf");
    let (src_mac, dst_mac) = (mac_of(&pair.a, &pair.a_if), mac_of(&pair.b, &pair.b_if));
    let resp = spawn_gen(&pair.b.name, &["--bind", "10.99.0.2", "--duration", "4s"]);
    std::thread::sleep(Duration::from_millis(300));
    let spoofed = roce_trace_gen::frame::RoceFrame {
        src_mac,
        dst_mac,
        src: "203.0.113.7".parse().unwrap(),
        dst: "10.99.0.2".parse().unwrap(),
        udp_sport: 49_999,
        dest_qp: 0x77,
        ack_req: true,
        payload: vec![1; 64],
        ..Default::default()
    }
    .build();
    let a_if = pair.a_if.clone();
    pair.a.run(move || send_frames(&a_if, &[spoofed]));
    std::thread::sleep(Duration::from_millis(300));
    let send = spawn_gen(
        &pair.a.name,
        &["--to", "10.99.0.2", "--duration", "2s", "--rate", "20mbit"],
    );
    let s = gen_report(send);
    let r = gen_report(resp);
    assert!(n(&r["unanswered"]) >= 1, "the spoofed request's reply: {r}");
    for q in s["senders"].as_array().unwrap() {
        let sent = n(&q["messages_sent"]);
        assert!(sent > 0, "{q}");
        assert_eq!(n(&q["messages_acked"]), sent, "every message completed: {q}");
        assert!(n(&responder_of(&r, q)["messages"]) >= sent, "{r}");
    }
}
