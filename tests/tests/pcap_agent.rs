//! An agent fed by a NIC-sniffer-style pcap stream (`tcpdump -w - | roce-trace agent -r -`)
//! and an eBPF agent, one collector: the pcap-fed point joins the eBPF-fed one on the same
//! packets, as on a host whose RDMA NIC keeps RoCE away from XDP/TC.

use std::{process::Command, time::Duration};

use roce_trace_tests::*;
use serde_json::Value;

#[test]
fn a_pcap_fed_point_joins_an_ebpf_fed_one() {
    if !require_root() {
        return;
    }
    let pair = VethPair::new("pcapag");
    let dir = TempDir::new("pcap-agent");
    let report = dir.path("report.json").to_string_lossy().into_owned();
    let collector = Daemon::start(
        &pair.b.name,
        &[
            "collect",
            "--listen",
            "10.99.0.2:4792",
            "--token",
            "tk",
            "--quiet",
            "--report",
            &report,
        ],
        "collecting on",
    );
    let ebpf = Daemon::start(
        &pair.b.name,
        &[
            "agent",
            "--collector",
            "10.99.0.2:4792",
            "--node",
            "b",
            "-i",
            &pair.b_if,
            "--token",
            "tk",
            "--sample-rate",
            "2",
            "--interval",
            "1s",
        ],
        "connected to collector",
    );
    // The sniffer: tcpdump on a's side, its pcap stream piped into an agent.
    let pipeline = format!(
        "timeout 6 tcpdump -i {} -U -w - udp port 4791 2>/dev/null | {} agent -r - --collector 10.99.0.2:4792 --node a-sniffer --token tk --sample-rate 2 --interval 1s",
        pair.a_if,
        roce_trace_bin().display()
    );
    // Its own process group: a failing test kills the shell, tcpdump and the agent alike.
    let mut sniffer = Proc::spawn_group(
        Command::new("ip")
            .args(["netns", "exec", &pair.a.name, "sh", "-c", &pipeline])
            .stderr(std::process::Stdio::piped()),
    );
    std::thread::sleep(Duration::from_secs(1));
    let resp = spawn_gen(&pair.b.name, &["--bind", "10.99.0.2", "--duration", "4s"]);
    std::thread::sleep(Duration::from_millis(300));
    let send = spawn_gen(
        &pair.a.name,
        &[
            "--to",
            "10.99.0.2",
            "--qps",
            "2",
            "--rate",
            "2mbit",
            "--duration",
            "2s",
        ],
    );
    gen_report(send);
    gen_report(resp);
    let st = sniffer.wait().unwrap(); // tcpdump stops at 6 s; the agent drains and exits
    assert!(st.success(), "sniffer pipeline failed");
    std::thread::sleep(Duration::from_secs(1));
    ebpf.stop();
    collector.stop();
    let r: Value = serde_json::from_str(&std::fs::read_to_string(dir.path("report.json")).unwrap()).unwrap();
    let data: Vec<&Value> = r["flows"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["src_ip"] == "10.99.0.1" && f["dst_ip"] == "10.99.0.2")
        .collect();
    assert_eq!(data.len(), 2, "{}", r["flows"]);
    for f in data {
        assert_eq!(
            f["path"],
            serde_json::json!(["a-sniffer:pcap:ingress", format!("b:{}:ingress", pair.b_if)]),
            "{f}"
        );
        assert!(f["trajectories"].as_u64().unwrap() > 100);
        assert!(f["lost"].as_array().unwrap().is_empty());
        // Counters from both points agree on the packets.
        let c = f["counters"].as_object().unwrap();
        let at = |p: &str| c[p]["packets"].as_u64().unwrap();
        assert_eq!(
            at("a-sniffer:pcap:ingress"),
            at(&format!("b:{}:ingress", pair.b_if))
        );
    }
}
