//! NIC counters and packets in the lab, telling one story: fixture counters stand in for
//! the NICs (there is no RDMA NIC here) on real lab ports, while real traffic crosses
//! them. A pause storm on l2's port to spine 1 shows on exactly the flows that cross that
//! port and fails `pfc.no_storm` naming it; h3's NIC claiming far more CNPs than the wire
//! carries from h3, and counting none of the CE marks the wire delivers to it, fails
//! `nic.cnp_consistency` naming h3's port twice, while the CNPs h3 really sends (CE marks
//! on l2's port to h3) are on the wire.

use std::time::Duration;

use roce_trace_tests::{
    lab::{
        Fault, LabGuard, Observers,
        nic_fixture::{Fixture, NicDriver},
    },
    *,
};
use serde_json::Value;

const TOKEN: &str = "nic-lab-token";
const HTTP: &str = "127.0.0.1:8080";

/// The NIC policy the repository ships.
fn policy() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../dist/nic-policy.toml")
}

#[test]
fn a_pause_storm_and_nic_cnps_the_wire_does_not_show_are_told_with_the_flows() {
    if !require_root() {
        return;
    }
    let lab = LabGuard::up("rtnl");
    let dir = TempDir::new("nic-lab");
    let ifindex = |node: &str, iface: &str| -> u32 {
        lab.0
            .exec(node, &["cat", &format!("/sys/class/net/{iface}/ifindex")])
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    };
    // l2's port to spine 1: a switch port with PFC on priority 3 and no RDMA device.
    let l2 = Fixture::create(dir.path("l2")).unwrap();
    l2.add("s1", ifindex("l2", "s1"), NicDriver::Mlx5, &[3], None)
        .unwrap();
    // h3's port: a ConnectX with its RDMA device.
    let h3_if = lab.0.fabric_ports("h3").unwrap().remove(0);
    let h3 = Fixture::create(dir.path("h3")).unwrap();
    h3.add(
        &h3_if,
        ifindex("h3", &h3_if),
        NicDriver::Mlx5,
        &[3],
        Some("mlx5_0"),
    )
    .unwrap();
    let (l2_root, h3_root) = (dir.path("l2"), dir.path("h3"));
    let obs = Observers::start_with(&lab.0, dir.path("report.json"), TOKEN, &["--http", HTTP], |n| {
        let root = match n {
            "l2" => &l2_root,
            "h3" => &h3_root,
            _ => return Vec::new(),
        };
        vec!["--sysfs-root".into(), root.to_str().unwrap().into()]
    });
    // CE marks on the way to h3: h3 answers with real CNPs.
    let ce = Fault::CeMark {
        node: "l2".into(),
        iface: "h3".into(),
        percent: 20,
    };
    lab.0.apply(&ce).unwrap();
    let resp = spawn_gen(
        &lab.0.ns("h3"),
        &["--bind", "10.10.3.2", "--duration", "14s", "--cnp-dscp", "48"],
    );
    std::thread::sleep(Duration::from_millis(300));
    let sender = spawn_gen(
        &lab.0.ns("h1"),
        &[
            "--to",
            "10.10.3.2",
            "--qps",
            "8",
            "--rate",
            "4mbit",
            "--duration",
            "12s",
            "--cnp-dscp",
            "48",
        ],
    );
    // While the traffic runs: l2's port paused all the time on priority 3 (a storm: its
    // pause time grows with the clock), and h3's NIC counting 1,500 CNPs a second, far
    // more than it sends.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let storm = std::thread::spawn({
        let (l2, h3, h3_if) = (
            Fixture::open(dir.path("l2")),
            Fixture::open(dir.path("h3")),
            h3_if.clone(),
        );
        let stop = stop.clone();
        move || {
            let mut last = std::time::Instant::now();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(20));
                let us = last.elapsed().as_micros() as u64;
                last = std::time::Instant::now();
                l2.bump("s1", "rx_prio3_pause", 4).unwrap();
                l2.bump("s1", "rx_prio3_pause_duration", us).unwrap();
                h3.bump(&h3_if, "np_cnp_sent", 30).unwrap();
            }
        }
    });
    std::thread::sleep(Duration::from_secs(2));
    let json = dir.path("verdict.json");
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", &lab.0.ns("mgmt")])
        .arg(roce_trace_bin())
        .args(["verify", "--collector-http", HTTP, "--window", "6s", "--json"])
        .arg(&json)
        .arg("--policy")
        .arg(policy())
        .output()
        .unwrap();
    println!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(out.status.code(), Some(1), "a check fails: {v:#}");
    let check = |name: &str| -> Value {
        v["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["check"] == name)
            .unwrap_or_else(|| panic!("no {name} in {v:#}"))
            .clone()
    };
    let storm_check = check("pfc_storm");
    assert_eq!(storm_check["status"], "fail", "{storm_check:#}");
    let ev = storm_check["evidence"].as_array().unwrap();
    assert!(
        !ev.is_empty()
            && ev
                .iter()
                .all(|e| e["at"][0] == "l2/s1" && e["at"][1] == "priority 3"),
        "the storm is named at l2/s1, priority 3 only: {storm_check:#}"
    );
    let ratio = check("pfc_pause_ratio");
    assert_eq!(ratio["status"], "fail", "{ratio:#}");
    assert!(
        ratio["evidence"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["at"][0] == "l2/s1")
    );
    // Pause only on priority 3, the lossless one: that rule holds.
    let lossless = check("pfc_lossless");
    assert_eq!(lossless["status"], "pass", "{lossless:#}");
    assert_eq!(lossless["checked"], 2, "l2/s1 and h3's port: {lossless:#}");
    // h3's NIC counted no sequence error and no timeout: those hold where they could be
    // judged (l2's switch port has no RDMA counters: named, not judged).
    for name in ["nic_seq_err", "nic_timeouts"] {
        let c = check(name);
        assert_eq!(c["status"], "pass", "{c:#}");
        assert!(c["summary"].as_str().unwrap().contains("l2/s1"), "{c:#}");
    }
    let cnp = check("nic_cnp_consistency");
    assert_eq!(cnp["status"], "fail", "{cnp:#}");
    let ev = cnp["evidence"].as_array().unwrap();
    // Two disagreements, both at h3's port: the CNPs its NIC claims, and the CE marks it
    // did not count (the fixture's np_ecn_marked_roce_packets stays 0 while CE-marked data
    // arrives).
    assert_eq!(ev.len(), 2, "{cnp:#}");
    assert!(
        ev.iter()
            .all(|e| e["at"][0] == format!("h3/{h3_if} (mlx5_0)").as_str()),
        "{cnp:#}"
    );
    let ce_detail = ev[1]["detail"].as_str().unwrap();
    assert!(
        ce_detail.starts_with("the NIC received CE-marked 0 packets")
            && ce_detail.contains("more CE marks on the wire"),
        "{ce_detail}"
    );
    let detail = ev[0]["detail"].as_str().unwrap();
    assert!(detail.contains("fewer on the wire"), "{detail}");
    // The wire did carry CNPs from h3: the NIC's claim is what disagrees, not silence.
    let wire: u64 = detail
        .split("the wire shows ")
        .nth(1)
        .and_then(|s| s.split(':').next())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(|| panic!("{detail}"));
    assert!(wire > 0, "{detail}");

    // The collector's metrics: two NIC ports, one of them paused.
    let metrics = in_netns(&lab.0.ns("mgmt"), || {
        use std::io::{Read, Write};
        let mut c = std::net::TcpStream::connect(HTTP).unwrap();
        c.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut s = String::new();
        c.read_to_string(&mut s).unwrap();
        s
    });
    for line in [
        "roce_trace_collector_nic_ports 2\n",
        "roce_trace_collector_nic_paused_ports 1\n",
    ] {
        assert!(metrics.contains(line), "{line} in {metrics}");
    }
    gen_report(sender);
    interrupt(resp);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    storm.join().unwrap();
    lab.0.clear(&ce).unwrap();
    let report: Value = serde_json::from_str(&std::fs::read_to_string(obs.stop()).unwrap()).unwrap();
    // Every flow whose path crosses l2's port from spine 1 has a pfc_pause anomaly there,
    // and no other flow has one.
    let crosses = |f: &Value| {
        f["path"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p.as_str().is_some_and(|p| p.starts_with("l2:s1:")))
    };
    let paused: std::collections::BTreeSet<String> = report["anomalies"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["kind"] == "pfc_pause")
        .map(|a| a["flow"].as_str().unwrap().to_string())
        .collect();
    let through: std::collections::BTreeSet<String> = report["flows"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| crosses(f))
        .map(|f| f["id"].as_str().unwrap().to_string())
        .collect();
    assert!(!through.is_empty(), "some flows cross l2/s1");
    assert_eq!(paused, through, "pfc_pause on exactly the flows through l2/s1");
    let nic = report["nic"].as_array().unwrap();
    assert_eq!(nic.len(), 2, "two ports report NIC counters: {nic:#?}");
}
