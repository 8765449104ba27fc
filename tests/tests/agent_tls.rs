//! Agents and a collector over mutual TLS, as an operator sets them up: `roce-trace certs`
//! makes the CA and the certificates, the collector runs without a token, an agent streams
//! with its node's certificate. A host's certificate does not speak for another node, and
//! an agent does not talk to a collector its CA did not sign. Real processes across a
//! veth pair.

use std::time::{Duration, Instant};

use roce_trace_gen::frame::RoceFrame;
use roce_trace_tests::*;
use serde_json::Value;

fn certs(dir: &TempDir, sub: &str, nodes: &str) {
    let out = std::process::Command::new(roce_trace_bin())
        .args(["certs", "--out"])
        .arg(dir.path(sub))
        .args(["--collector-name", "10.99.0.2", "--node", nodes])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

fn agents(pair: &VethPair) -> Value {
    let (_, body) = pair.b.run(|| {
        roce_trace::http::get(
            "127.0.0.1:8080".parse().unwrap(),
            "/agents",
            Duration::from_secs(10),
        )
        .unwrap()
    });
    serde_json::from_slice(&body).unwrap()
}

/// Over mutual TLS with no token: node a's agent, with a's certificate, is welcomed and
/// its observations reach the collector; an agent presenting b's certificate as node a is
/// refused (it says why) and never listed; an agent asked to reach a collector whose
/// certificate another CA signed refuses it at the handshake. Fails if the collector
/// skips the certificate's name (the impostor is welcomed as a), or if the agent skips
/// the collector's certificate (it connects to the rogue collector).
#[test]
fn over_mutual_tls_agents_stream_as_their_own_node_only_to_their_collector() {
    if !require_root() {
        return;
    }
    let pair = VethPair::new("tls");
    let dir = TempDir::new("agent-tls");
    certs(&dir, "ours", "a,b");
    certs(&dir, "theirs", "a");
    let f = |set: &str, name: &str| dir.path(&format!("{set}/{name}")).to_string_lossy().into_owned();
    // The TLS flags of `leaf`'s certificate in `set` (its key, and the set's CA).
    let tls_args = |set: &str, leaf: &str| -> Vec<String> {
        vec![
            "--tls-cert".into(),
            f(set, &format!("{leaf}.pem")),
            "--tls-key".into(),
            f(set, &format!("{leaf}.key")),
            "--tls-ca".into(),
            f(set, "ca.pem"),
        ]
    };
    // A collector on `listen` with the collector certificate of `set`, plus `more`.
    let collect = |listen: &str, set: &str, report: &str, more: &[&str]| {
        let report = dir.path(report).to_string_lossy().into_owned();
        let mut args: Vec<String> = ["collect", "--listen", listen, "--quiet", "--report", &report]
            .map(String::from)
            .to_vec();
        args.extend(tls_args(set, "collector"));
        args.extend(more.iter().map(|a| a.to_string()));
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        Daemon::start(&pair.b.name, &argv, "collecting on")
    };
    let collector = collect(
        "10.99.0.2:4792",
        "ours",
        "report.json",
        &["--http", "127.0.0.1:8080"],
    );
    // A rogue collector, its certificate from another CA, names the same address.
    let rogue = collect("10.99.0.2:4793", "theirs", "rogue.json", &[]);
    let mut args: Vec<String> = [
        "agent",
        "--collector",
        "10.99.0.2:4792",
        "--node",
        "a",
        "-i",
        &pair.a_if,
        "--sample-rate",
        "1",
        "--interval",
        "1s",
    ]
    .map(String::from)
    .to_vec();
    args.extend(tls_args("ours", "a"));
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let agent = Daemon::start(&pair.a.name, &argv, "connected to collector");

    // An impostor: b's certificate, claiming node a (reading a capture: no hooks needed).
    let pcap = dir.path("one.pcap");
    let frame = RoceFrame {
        src: "10.99.0.1".parse().unwrap(),
        dst: "10.99.0.2".parse().unwrap(),
        ..Default::default()
    }
    .build();
    write_pcap(&pcap, &[frame]);
    let mut impostor: Vec<String> = ["agent", "--collector", "10.99.0.2:4792", "--node", "a", "-r"]
        .map(String::from)
        .to_vec();
    impostor.push(pcap.to_string_lossy().into_owned());
    impostor.extend(tls_args("ours", "b"));
    let argv: Vec<&str> = impostor.iter().map(String::as_str).collect();
    let impostor = Daemon::start(&pair.a.name, &argv, "the certificate is not for node `a`");
    // Our agent, pointed at the rogue collector: the handshake fails on its certificate.
    let mut misled: Vec<String> = ["agent", "--collector", "10.99.0.2:4793", "--node", "a", "-r"]
        .map(String::from)
        .to_vec();
    misled.push(pcap.to_string_lossy().into_owned());
    misled.extend(tls_args("ours", "a"));
    let argv: Vec<&str> = misled.iter().map(String::as_str).collect();
    let misled = Daemon::start(&pair.a.name, &argv, "TLS handshake with the collector");

    // Node a's traffic reaches the collector through its TLS session.
    let frames: Vec<Vec<u8>> = (0..20)
        .map(|psn| {
            RoceFrame {
                src: "10.99.0.1".parse().unwrap(),
                dst: "10.99.0.2".parse().unwrap(),
                udp_sport: 49_600,
                psn,
                ..Default::default()
            }
            .build()
        })
        .collect();
    let a_if = pair.a_if.clone();
    pair.a.run(move || send_frames(&a_if, &frames));
    let t = Instant::now();
    let seen = loop {
        let v = agents(&pair);
        let a = v.as_array().unwrap().iter().find(|a| a["node"] == "a").cloned();
        if let Some(a) = a.filter(|a| a["observations"] == 20) {
            break (v, a);
        }
        assert!(t.elapsed() < Duration::from_secs(20), "{v}");
        std::thread::sleep(Duration::from_millis(100));
    };
    let (all, a) = seen;
    assert_eq!(all.as_array().unwrap().len(), 1, "only node a, once: {all}");
    assert_eq!(a["connected"], true);
    assert_eq!(a["connections"], 1, "the impostor never took a's session: {a}");
    for d in [impostor, misled] {
        let log = d.stderr.lock().unwrap().clone();
        assert!(!log.contains("connected to collector"), "{log}");
        d.stop();
    }
    agent.stop();
    rogue.stop();
    collector.stop();
}
