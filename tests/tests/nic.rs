//! NIC and PFC counters: every driver's names read into the canonical vocabulary from
//! fixture trees built from the kernel's documented names (there is no RDMA NIC here);
//! counters that move, wrap, reset and vanish between reads told apart; what a port does
//! not have said with its reason, never 0; and the ethtool ioctl path live on a veth,
//! matching `ethtool -S`.

use std::{collections::BTreeMap, process::Command};

use roce_trace::nic::{self, CounterId, Missing, Root, Step, Tracker};
use roce_trace_tests::{
    TempDir, VethPair,
    lab::nic_fixture::{Fixture, NicDriver},
    require_root, roce_trace_bin,
};
use serde_json::Value;

fn read_one(root: &Root, netdev: &str) -> (nic::Port, nic::Reading) {
    let ports = nic::ports(root, &[netdev.to_string()]).unwrap();
    let p = ports.into_iter().next().unwrap();
    let r = nic::read(root, &p);
    (p, r)
}

fn id(name: &str) -> CounterId {
    CounterId::parse(name).unwrap_or_else(|| panic!("{name} is not canonical"))
}

/// Each driver's own name for a counter, set to a distinct value, is read as the
/// canonical counter with that value.
#[test]
fn every_drivers_names_read_as_the_canonical_counters() {
    let dir = TempDir::new("nic-drivers");
    let f = Fixture::create(dir.path("sys")).unwrap();
    f.add("mlx0", 10, NicDriver::Mlx5, &[3], Some("mlx5_0")).unwrap();
    f.add("bnx0", 11, NicDriver::Bnxt, &[3], Some("bnxt_re0"))
        .unwrap();
    f.add("ion0", 12, NicDriver::Ionic, &[3], Some("ionic_0"))
        .unwrap();
    f.add("man0", 13, NicDriver::Mana, &[], Some("mana_0")).unwrap();
    f.add("rxe0v", 14, NicDriver::Rxe, &[], Some("rxe_0")).unwrap();
    let cases: &[(&str, &str, &str)] = &[
        ("mlx0", "np_cnp_sent", "np_cnp_sent"),
        ("mlx0", "rx_prio3_pause", "rx_prio3_pause"),
        ("mlx0", "rx_prio3_pause_duration", "rx_prio3_pause_duration"),
        ("mlx0", "tx_prio3_pause", "tx_prio3_pause"),
        ("mlx0", "rx_prio5_packets", "rx_prio5_packets"),
        ("mlx0", "rx_prio3_marked", "rx_prio3_marked"),
        (
            "mlx0",
            "tx_pause_storm_error_events",
            "tx_pause_storm_error_events",
        ),
        (
            "mlx0",
            "tx_vport_rdma_unicast_bytes",
            "tx_vport_rdma_unicast_bytes",
        ),
        ("mlx0", "rx_icrc_encapsulated", "rx_icrc_encapsulated"),
        ("bnx0", "tx_cnp_pkts", "np_cnp_sent"),
        ("bnx0", "rx_cnp_pkts", "rp_cnp_handled"),
        ("bnx0", "rx_ecn_marked_pkts", "np_ecn_marked_roce_packets"),
        ("bnx0", "seq_err_naks_rcvd", "packet_seq_err"),
        ("bnx0", "to_retransmits", "local_ack_timeout_err"),
        ("bnx0", "rx_pfc_ena_frames_pri3", "rx_prio3_pause"),
        ("bnx0", "pfc_pri3_rx_duration_us", "rx_prio3_pause_duration"),
        ("bnx0", "pfc_pri3_tx_transitions", "tx_prio3_pause_transition"),
        ("bnx0", "rx_pause_frames", "rx_pause_ctrl_phy"),
        ("bnx0", "rx_packets_pri6", "rx_prio6_packets"),
        ("ion0", "tx_rdma_cnp_pkts", "np_cnp_sent"),
        ("ion0", "rx_rdma_ecn_pkts", "np_ecn_marked_roce_packets"),
        ("ion0", "resp_rx_outouf_seq", "out_of_sequence"),
        ("ion0", "rx_pripause_3_1us_count", "rx_prio3_pause_duration"),
        ("ion0", "frames_rx_pri_2", "rx_prio2_packets"),
        ("man0", "sent_cnps", "np_cnp_sent"),
        ("man0", "received_cnps", "rp_cnp_handled"),
        ("man0", "received_ecns", "np_ecn_marked_roce_packets"),
        ("man0", "requester_timeout", "local_ack_timeout_err"),
        ("rxe0v", "out_of_seq_request", "out_of_sequence"),
        ("rxe0v", "rcvd_seq_err", "packet_seq_err"),
        ("rxe0v", "retry_exceeded_err", "req_transport_retries_exceeded"),
    ];
    for (i, (dev, raw, _)) in cases.iter().enumerate() {
        f.set(dev, raw, 1000 + i as u64).unwrap();
    }
    let root = Root::fixture(f.root());
    let mut wrong = Vec::new();
    for (i, (dev, raw, canon)) in cases.iter().enumerate() {
        let (_, r) = read_one(&root, dev);
        match r.values.get(&id(canon)) {
            Some(v) if v.value == 1000 + i as u64 && v.raw == *raw => {}
            other => wrong.push(format!("{dev} {raw} → {canon}: {other:?}")),
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    // The driver family comes from the RDMA device's driver.
    for (dev, fam) in [
        ("mlx0", "mlx5"),
        ("bnx0", "bnxt"),
        ("ion0", "ionic"),
        ("man0", "mana"),
        ("rxe0v", "rxe"),
    ] {
        assert_eq!(read_one(&root, dev).1.driver.as_str(), fam, "{dev}");
    }
}

/// What a port does not have is not 0: each absence carries its reason.
#[test]
fn a_counter_a_port_does_not_have_is_not_available_with_its_reason() {
    let dir = TempDir::new("nic-missing");
    let f = Fixture::create(dir.path("sys")).unwrap();
    f.add("mlx0", 10, NicDriver::Mlx5, &[3], Some("mlx5_0")).unwrap();
    f.add("mlx1", 11, NicDriver::Mlx5, &[], Some("mlx5_1")).unwrap();
    f.add("plain0", 12, NicDriver::Mlx5, &[3], None).unwrap();
    f.add("rxe0v", 13, NicDriver::Rxe, &[], Some("rxe_0")).unwrap();
    f.add("ion0", 14, NicDriver::Ionic, &[3], Some("ionic_0"))
        .unwrap();
    // A firmware without pause-storm detection.
    f.remove("mlx0", "tx_pause_storm_warning_events").unwrap();
    let root = Root::fixture(f.root());
    let why = |dev: &str, name: &str| -> Missing {
        let (_, r) = read_one(&root, dev);
        assert!(!r.values.contains_key(&id(name)), "{dev} has {name}");
        r.missing
            .get(&id(name))
            .unwrap_or_else(|| panic!("{dev} {name}: neither a value nor a reason"))
            .why
    };
    let cases = [
        ("mlx0", "rx_prio0_pause", Missing::PfcNotEnabled),
        ("mlx0", "tx_prio7_pause_duration", Missing::PfcNotEnabled),
        ("mlx1", "rx_prio3_pause", Missing::NoPerPriorityPause),
        ("mlx0", "tx_pause_storm_warning_events", Missing::NotExposed),
        ("mlx0", "cc_rx_ce_pkts", Missing::Optional),
        ("plain0", "np_cnp_sent", Missing::NoRdmaDevice),
        ("rxe0v", "np_cnp_sent", Missing::NotInDriver),
        ("rxe0v", "rx_prio3_pause", Missing::NotInDriver),
        ("ion0", "rx_prio3_pause", Missing::NotInDriver),
    ];
    let wrong: Vec<String> = cases
        .iter()
        .filter_map(|&(d, n, w)| {
            let got = why(d, n);
            (got != w).then(|| format!("{d} {n}: {got:?}, expected {w:?}"))
        })
        .collect();
    assert!(wrong.is_empty(), "{wrong:#?}");
    // Every canonical counter is either a value or a reason, on every port.
    for dev in ["mlx0", "mlx1", "plain0", "rxe0v", "ion0"] {
        let (_, r) = read_one(&root, dev);
        for c in nic::all_ids() {
            assert!(
                r.values.contains_key(&c) ^ r.missing.contains_key(&c),
                "{dev} {c}: value and reason must be exactly one"
            );
        }
    }
    // A counter file that does not hold a number makes the RDMA counters unreadable,
    // saying which file; the ethtool ones are still read.
    std::fs::write(
        f.root()
            .join("class/infiniband/mlx5_0/ports/1/hw_counters/np_cnp_sent"),
        "garbage\n",
    )
    .unwrap();
    let (_, r) = read_one(&root, "mlx0");
    let a = &r.missing[&id("rp_cnp_handled")];
    assert_eq!(a.why, Missing::Unreadable);
    assert!(a.detail.as_deref().unwrap().contains("np_cnp_sent"), "{a:?}");
    assert!(r.values.contains_key(&id("rx_prio3_pause")));
    // The IB port counters are read beside them, under their own names (a file there that
    // does not read as a number is left out, not an error).
    std::fs::write(
        f.root()
            .join("class/infiniband/mlx5_1/ports/1/counters/port_xmit_data"),
        "4096\n",
    )
    .unwrap();
    std::fs::write(
        f.root()
            .join("class/infiniband/mlx5_1/ports/1/counters/VL15_dropped"),
        "N/A\n",
    )
    .unwrap();
    let (_, r) = read_one(&root, "mlx1");
    assert!(
        r.other
            .iter()
            .any(|(_, n, v)| n == "counters/port_xmit_data" && *v == 4096),
        "{:?}",
        r.other
    );
    assert!(!r.other.iter().any(|(_, n, _)| n.contains("VL15")));
    assert!(r.missing.values().all(|a| a.why != Missing::Unreadable));
}

/// Between reads: deltas over the real elapsed time, a 32-bit counter's wrap counted
/// across it, a counter that went down reported as a reset (never as 2^64 − x), a
/// 64-bit counter's fall never taken for a wrap, a counter that disappeared said gone,
/// one that appeared given no delta, and a reboot or driver reload resetting all.
#[test]
fn counters_that_move_wrap_reset_and_vanish_are_told_apart() {
    let dir = TempDir::new("nic-steps");
    let f = Fixture::create(dir.path("sys")).unwrap();
    f.add("mlx0", 10, NicDriver::Mlx5, &[3], Some("mlx5_0")).unwrap();
    let root = Root::fixture(f.root());
    let port = nic::ports(&root, &["mlx0".into()]).unwrap().remove(0);
    let mut t = Tracker::default();
    f.set("mlx0", "np_cnp_sent", u32::MAX as u64 - 9).unwrap();
    f.set("mlx0", "out_of_sequence", 1_000).unwrap();
    f.set("mlx0", "tx_vport_rdma_unicast_bytes", 1 << 40).unwrap();
    f.set("mlx0", "rx_prio3_pause", 500).unwrap();
    assert!(
        t.update("mlx0", nic::read(&root, &port)).is_none(),
        "the first read has no interval"
    );
    std::thread::sleep(std::time::Duration::from_millis(50));
    f.bump("mlx0", "rx_prio3_pause", 100).unwrap();
    f.bump("mlx0", "rx_prio3_pause_duration", 250_000).unwrap();
    f.set("mlx0", "np_cnp_sent", 16).unwrap(); // wrapped: +26
    f.set("mlx0", "out_of_sequence", 3).unwrap(); // reset
    f.set("mlx0", "tx_vport_rdma_unicast_bytes", (1 << 40) - 5)
        .unwrap(); // reset
    f.remove("mlx0", "rx_prio3_pause_transition").unwrap(); // gone
    f.set("mlx0", "rx_prio5_pause", 7).unwrap(); // appeared (PFC turned on for 5)
    let iv = t.update("mlx0", nic::read(&root, &port)).unwrap();
    let step = |n: &str| iv.get(id(n)).map(|c| c.step);
    assert!(!iv.epoch_changed);
    assert!(iv.elapsed_ns >= 50_000_000, "{}", iv.elapsed_ns);
    assert_eq!(step("rx_prio3_pause"), Some(Step::Delta(100)));
    assert_eq!(step("rx_prio3_pause_duration"), Some(Step::Delta(250_000)));
    assert_eq!(step("np_cnp_sent"), Some(Step::Wrapped(26)));
    assert_eq!(step("out_of_sequence"), Some(Step::Reset));
    assert_eq!(step("tx_vport_rdma_unicast_bytes"), Some(Step::Reset));
    assert_eq!(
        step("rx_prio5_pause"),
        None,
        "no delta for a counter that just appeared"
    );
    assert_eq!(iv.missing[&id("rx_prio3_pause_transition")].why, Missing::Gone);
    let rate = iv.rate(id("rx_prio3_pause")).unwrap();
    assert!((rate - 100.0 * 1e9 / iv.elapsed_ns as f64).abs() < 1e-9, "{rate}");
    assert_eq!(iv.rate(id("out_of_sequence")), None, "a reset has no rate");
    // The PFC line: priority 3 paused, in pause frames and time.
    let lines = roce_trace::nic::pfc_lines(&iv);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].starts_with("pfc mlx0 prio 3: rx "), "{lines:?}");

    // The counter that appeared now has a delta.
    f.bump("mlx0", "rx_prio5_pause", 3).unwrap();
    let iv = t.update("mlx0", nic::read(&root, &port)).unwrap();
    assert_eq!(iv.get(id("rx_prio5_pause")).map(|c| c.step), Some(Step::Delta(3)));
    assert_eq!(
        iv.get(id("out_of_sequence")).map(|c| c.step),
        Some(Step::Delta(0))
    );

    // A reboot: every counter reset, whatever its values.
    f.set("mlx0", "rx_prio3_pause", 0).unwrap();
    f.reboot(2).unwrap();
    f.set("mlx0", "rx_prio3_pause", 10_000).unwrap(); // above its old value: still no delta
    let iv = t.update("mlx0", nic::read(&root, &port)).unwrap();
    assert!(iv.epoch_changed);
    assert!(
        iv.changes.iter().all(|c| c.step == Step::Reset),
        "{:?}",
        iv.changes
    );
    // A driver reload (a new interface index): the same.
    let port = nic::ports(&root, &["mlx0".into()]).unwrap().remove(0);
    f.reload("mlx0", 77).unwrap();
    let port2 = nic::ports(&root, &["mlx0".into()]).unwrap().remove(0);
    assert_ne!(port.ifindex, port2.ifindex);
    let iv = t.update("mlx0", nic::read(&root, &port2)).unwrap();
    assert!(iv.epoch_changed && iv.changes.iter().all(|c| c.step == Step::Reset));
    // Then deltas again.
    f.bump("mlx0", "rx_prio3_pause", 4).unwrap();
    let iv = t.update("mlx0", nic::read(&root, &port2)).unwrap();
    assert_eq!(iv.get(id("rx_prio3_pause")).map(|c| c.step), Some(Step::Delta(4)));
}

fn nic_cmd(args: &[&str]) -> std::process::Output {
    Command::new(roce_trace_bin())
        .arg("nic")
        .args(args)
        .output()
        .unwrap()
}

/// `roce-trace nic --json --interval` while the counters move: the deltas of the records
/// add up to exactly what the counter grew by, and the reset in the middle is a reset,
/// not a delta.
#[test]
fn the_nic_command_streams_exact_deltas_and_says_resets() {
    let dir = TempDir::new("nic-cli");
    let f = Fixture::create(dir.path("sys")).unwrap();
    f.add("mlx0", 10, NicDriver::Mlx5, &[3], Some("mlx5_0")).unwrap();
    let root = dir.path("sys");
    let child = Command::new(roce_trace_bin())
        .args([
            "nic",
            "--sysfs-root",
            root.to_str().unwrap(),
            "-i",
            "mlx0",
            "--json",
            "--interval",
            "150ms",
            "--count",
            "12",
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut grown = 0u64;
    for i in 0..14 {
        std::thread::sleep(std::time::Duration::from_millis(110));
        if i == 6 {
            // Reset: np_cnp_sent goes back to 0 (64-bit: values above 2^32 seen).
            f.set("mlx0", "np_cnp_sent", 0).unwrap();
            continue;
        }
        if i == 0 {
            f.set("mlx0", "np_cnp_sent", 1 << 33).unwrap();
        }
        f.bump("mlx0", "rx_prio3_pause", 37).unwrap();
        grown += 37;
    }
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let recs: Vec<Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(recs.len(), 13, "a first read and 12 intervals");
    let first = recs[0]["counters"]["rx_prio3_pause"]["value"].as_u64().unwrap();
    let last = recs.last().unwrap()["counters"]["rx_prio3_pause"]["value"]
        .as_u64()
        .unwrap();
    let sum: u64 = recs[1..]
        .iter()
        .map(|r| r["counters"]["rx_prio3_pause"]["delta"].as_u64().unwrap())
        .sum();
    assert_eq!(sum, last - first, "deltas add up to the growth");
    assert!(last - first <= grown && last - first > 0);
    assert_eq!(recs[0]["counters"]["rx_prio3_pause"]["step"], "first");
    let resets: Vec<&Value> = recs
        .iter()
        .filter(|r| r["counters"]["np_cnp_sent"]["step"] == "reset")
        .collect();
    assert_eq!(resets.len(), 1, "one reset of np_cnp_sent");
    assert!(resets[0]["counters"]["np_cnp_sent"].get("delta").is_none());
    // Reasons are grouped, and name the counters.
    let na = &recs[0]["not_available"];
    assert!(
        na["pfc_not_enabled"]["counters"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c == "rx_prio0_pause"),
        "{na}"
    );
    assert!(
        na["optional_disabled"]["why"]
            .as_str()
            .unwrap()
            .contains("rdma statistic")
    );
}

/// Bad input: a root that is not there, an interface that is not there, a zero
/// interval and a broken ethtool table each get a clear answer.
#[test]
fn bad_nic_input_gets_a_clear_error() {
    let dir = TempDir::new("nic-bad");
    let f = Fixture::create(dir.path("sys")).unwrap();
    f.add("mlx0", 10, NicDriver::Mlx5, &[3], Some("mlx5_0")).unwrap();
    let root = dir.path("sys");
    let root = root.to_str().unwrap();
    for (args, says) in [
        (vec!["--sysfs-root", "/nonexistent/x"], "not a directory"),
        (
            vec!["--sysfs-root", root, "-i", "nosuch0"],
            "no interface `nosuch0`",
        ),
        (vec!["--sysfs-root", root, "-i", "../x"], "no interface `../x`"),
        (vec!["--sysfs-root", root, "--interval", "0s"], "more than 0"),
        (vec!["--sysfs-root", root, "--count", "3"], "--interval"),
    ] {
        let out = nic_cmd(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(says), "{args:?}: {err}");
    }
    std::fs::write(
        f.root().join("ethtool/mlx0"),
        "NIC statistics:\n     rx_prio3_pause: lots\n",
    )
    .unwrap();
    let out = nic_cmd(&["--sysfs-root", root, "-i", "mlx0", "--json"]);
    assert!(out.status.success());
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    let u = &r["not_available"]["unreadable"];
    assert!(u["detail"].as_str().unwrap().contains("rx_prio3_pause"), "{r}");
    // The RDMA counters are still read.
    assert!(r["counters"]["np_cnp_sent"]["value"].is_u64(), "{r}");
}

/// The ethtool ioctls live, on a veth with traffic: the same names and values as
/// `ethtool -S`, read without an `ethtool` process.
#[test]
fn ethtool_statistics_of_a_veth_match_ethtool_s() {
    if !require_root() {
        return;
    }
    let pair = VethPair::new("nic");
    pair.a.exec(&["ping", "-c", "3", "-i", "0.2", "-q", "10.99.0.2"]);
    let name = pair.a_if.clone();
    let ours = pair
        .a
        .run(move || roce_trace::nic::ethtool::stats(&name))
        .unwrap()
        .unwrap();
    let theirs = nic::parse_ethtool_s(&pair.a.exec(&["ethtool", "-S", &pair.a_if])).unwrap();
    assert_eq!(ours, theirs);
    assert!(ours.iter().any(|(_, v)| *v > 0), "traffic shows: {ours:?}");
    // The command too, with --all: every statistic under its driver name.
    let out = pair.a.exec(&[
        roce_trace_bin().to_str().unwrap(),
        "nic",
        "-i",
        &pair.a_if,
        "--json",
        "--all",
    ]);
    let r: Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    assert_eq!(r["netdev_driver"], "veth");
    let other: BTreeMap<String, u64> = serde_json::from_value(r["other"].clone()).unwrap();
    for (n, v) in &theirs {
        assert_eq!(other.get(&format!("ethtool:{n}")), Some(v), "{n}");
    }
    assert!(
        r["not_available"]["no_rdma_device"]["counters"]
            .as_array()
            .unwrap()
            .len()
            > 10
    );
}

/// `capture` on an interface whose NIC counters a fixture gives (an mlx5 port with PFC on
/// priority 3): `nic` records with the NIC's deltas, and beside them what the kernel
/// counted on the same interface — CNPs sent over the wire that the NIC says it handled.
#[test]
fn capture_puts_the_nic_counters_beside_what_the_kernel_counted() {
    if !require_root() {
        return;
    }
    use roce_trace_gen::frame::{RoceFrame, ext};
    let pair = VethPair::new("nicc");
    let dir = TempDir::new("nic-capture");
    let f = Fixture::create(dir.path("sys")).unwrap();
    let ifindex: u32 = pair
        .b
        .exec(&["cat", &format!("/sys/class/net/{}/ifindex", pair.b_if)])
        .trim()
        .parse()
        .unwrap();
    f.add(&pair.b_if, ifindex, NicDriver::Mlx5, &[3], Some("mlx5_0"))
        .unwrap();
    let root = dir.path("sys");
    let cap = roce_trace_tests::CaptureProc::start(
        &pair.b,
        &[
            "-i",
            &pair.b_if,
            "--direction",
            "ingress",
            "--sysfs-root",
            root.to_str().unwrap(),
            "--json",
            "--sample-rate",
            "0",
            "--interval",
            "300ms",
            "--duration",
            "3s",
        ],
    );
    std::thread::sleep(std::time::Duration::from_millis(700));
    // 5 CNPs arrive; the NIC says it handled 5, paused 40 times on priority 3 for 120 ms.
    let cnp = RoceFrame {
        src_mac: roce_trace_tests::mac_of(&pair.a, &pair.a_if),
        dst_mac: roce_trace_tests::mac_of(&pair.b, &pair.b_if),
        src: "10.99.0.1".parse().unwrap(),
        dst: "10.99.0.2".parse().unwrap(),
        opcode: 0x81,
        dest_qp: 0x200,
        dscp: 48,
        becn: true,
        ext: ext::cnp(),
        ..Default::default()
    }
    .build();
    let a_if = pair.a_if.clone();
    pair.a
        .run(move || roce_trace_tests::send_frames(&a_if, &vec![cnp; 5]));
    f.bump(&pair.b_if, "rp_cnp_handled", 5).unwrap();
    for _ in 0..4 {
        f.bump(&pair.b_if, "rx_prio3_pause", 10).unwrap();
        f.bump(&pair.b_if, "rx_prio3_pause_duration", 30_000).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let recs = cap.finish();
    let nic: Vec<&Value> = recs.iter().filter(|r| r["type"] == "nic").collect();
    assert!(nic.len() >= 5, "a record per refresh: {}", nic.len());
    assert!(
        nic.iter()
            .all(|r| r["interface"] == pair.b_if.as_str() && r["rdma_device"] == "mlx5_0")
    );
    let sum = |name: &str| -> u64 {
        nic.iter()
            .filter_map(|r| r["counters"][name]["delta"].as_u64())
            .sum()
    };
    assert_eq!(sum("rp_cnp_handled"), 5);
    assert_eq!(sum("rx_prio3_pause"), 40);
    assert_eq!(sum("rx_prio3_pause_duration"), 120_000);
    let kernel_cnp_in: u64 = nic.iter().filter_map(|r| r["kernel"]["cnp_rx"].as_u64()).sum();
    assert_eq!(
        kernel_cnp_in, 5,
        "the kernel saw the 5 CNPs on the same interface"
    );
    assert_eq!(
        nic.iter()
            .filter_map(|r| r["kernel"]["cnp_tx"].as_u64())
            .sum::<u64>(),
        0
    );
}

/// Per-QP and optional counters come through RDMA netlink: where the kernel has no RDMA
/// core (as here) the reader says so; where it has one, asking for a device that does not
/// exist is a clear error — never an empty success.
#[test]
fn rdma_netlink_says_why_it_cannot_be_read() {
    use roce_trace::rdma_netlink::{Socket, unavailable};
    match Socket::open() {
        Err(e) => {
            assert_eq!(e.raw_os_error(), Some(libc::EPROTONOSUPPORT), "{e}");
            assert!(
                unavailable(&e).contains("not in this kernel"),
                "{}",
                unavailable(&e)
            );
        }
        Ok(s) => {
            let e = s.port_counters("no-such-rdma-dev0", 1).unwrap_err();
            assert!(e.to_string().contains("no RDMA device no-such-rdma-dev0"), "{e}");
        }
    }
    // A fixture port asked for its per-QP counters says why there are none.
    let dir = TempDir::new("nic-qp");
    let f = Fixture::create(dir.path("sys")).unwrap();
    f.add("mlx0", 10, NicDriver::Mlx5, &[3], Some("mlx5_0")).unwrap();
    let out = nic_cmd(&[
        "--sysfs-root",
        dir.path("sys").to_str().unwrap(),
        "-i",
        "mlx0",
        "--qp",
        "--json",
    ]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let qp: Value = serde_json::from_str(text.lines().nth(1).expect("a nic_qp record")).unwrap();
    assert_eq!(qp["type"], "nic_qp");
    assert_eq!(qp["rdma_device"], "mlx5_0");
    assert!(qp["not_available"].as_str().unwrap().contains("fixture"), "{qp}");
}
