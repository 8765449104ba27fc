//! An agent under a collector that dies and comes back: it keeps sampling, buffers while
//! the collector is away, reconnects with backoff, delivers what it buffered, and reports
//! what a too-small buffer made it drop. Real processes across a veth pair.

use std::{io::Read, net::TcpStream, sync::Mutex, time::Duration};

use roce_trace_tests::*;
use serde_json::Value;

static SERIAL: Mutex<()> = Mutex::new(());

/// GET /agents from the collector in namespace b.
fn agents(pair: &VethPair) -> Value {
    let body = pair.b.run(|| {
        use std::io::Write;
        let mut s = TcpStream::connect("10.99.0.2:8080").unwrap();
        write!(s, "GET /agents HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut body = String::new();
        s.read_to_string(&mut body).unwrap();
        body
    });
    serde_json::from_str(body.split_once("\r\n\r\n").unwrap().1).unwrap()
}

/// From the agent's last line: (made, sent, dropped, connections).
fn agent_totals(stderr: &str) -> (u64, u64, u64, u64) {
    let line = stderr
        .lines()
        .find(|l| l.contains("agent stopped:"))
        .unwrap_or_else(|| panic!("no summary: {stderr}"));
    let summary = line.split("agent stopped:").nth(1).unwrap();
    let n: Vec<u64> = summary
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    // X observations (Y sent, Z dropped …), C counter deltas sent, N connections, R drops
    (n[0], n[1], n[2], n[4])
}

fn collector(pair: &VethPair, tag: &str, dir: &TempDir) -> Daemon {
    let report = dir.path(&format!("{tag}.json")).to_string_lossy().into_owned();
    Daemon::start(
        &pair.b.name,
        &[
            "collect",
            "--listen",
            "10.99.0.2:4792",
            "--http",
            "10.99.0.2:8080",
            "--token",
            "tk",
            "--quiet",
            "--report",
            &report,
        ],
        "collecting on",
    )
}

fn agent(pair: &VethPair, queue: &str) -> Daemon {
    Daemon::start(
        &pair.a.name,
        &[
            "agent",
            "--collector",
            "10.99.0.2:4792",
            "--node",
            "a",
            "-i",
            &pair.a_if,
            "--token",
            "tk",
            "--sample-rate",
            "1",
            "--interval",
            "1s",
            "--queue",
            queue,
            "--metrics",
            "10.99.0.1:9464",
        ],
        "connected to collector",
    )
}

/// Stops a daemon and returns everything it wrote to stderr.
fn stop_and_log(d: Daemon) -> String {
    let log = d.stderr.clone();
    d.stop();
    std::thread::sleep(Duration::from_millis(300)); // the reader thread takes the last lines
    log.lock().unwrap().clone()
}

fn run_with_outage(queue: &str, tag: &str) -> (u64, u64, u64, u64, u64, Value) {
    let pair = VethPair::new(tag);
    let dir = TempDir::new(tag);
    let c1 = collector(&pair, "c1", &dir);
    let a = agent(&pair, queue);
    let resp = spawn_gen(&pair.b.name, &["--bind", "10.99.0.2", "--duration", "12s"]);
    std::thread::sleep(Duration::from_millis(300));
    let send = spawn_gen(
        &pair.a.name,
        &["--to", "10.99.0.2", "--rate", "2mbit", "--duration", "8s"],
    );
    std::thread::sleep(Duration::from_secs(2));
    let before = agents(&pair)[0]["observations"].as_u64().unwrap();
    c1.kill(); // no goodbye: the agent finds out when it next writes
    std::thread::sleep(Duration::from_secs(3));
    let c2 = collector(&pair, "c2", &dir);
    gen_report(send);
    interrupt(resp);
    std::thread::sleep(Duration::from_secs(2));
    let metrics = pair.a.run(|| {
        use std::io::Write;
        let mut s = TcpStream::connect("10.99.0.1:9464").unwrap();
        write!(s, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut body = String::new();
        s.read_to_string(&mut body).unwrap();
        body
    });
    let metric = |name: &str| -> u64 {
        metrics
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing: {metrics}"))
    };
    let iface = pair.a_if.clone();
    assert!(
        metric(&format!(
            "roce_trace_packets_total{{interface=\"{iface}\",direction=\"egress\",dscp=\"26\"}}"
        )) > 1000
    );
    assert!(
        metric(&format!(
            "roce_trace_ecn_packets_total{{interface=\"{iface}\",direction=\"egress\",ecn=\"ect0\"}}"
        )) > 1000
    );
    assert!(metric("roce_trace_samples_sent_total") > 0);
    let log = stop_and_log(a);
    c2.stop();
    let r2: Value = serde_json::from_str(&std::fs::read_to_string(dir.path("c2.json")).unwrap()).unwrap();
    let (made, sent, dropped, connections) = agent_totals(&log);
    assert_eq!(connections, 2, "reconnected once: {log}");
    (
        made,
        sent,
        dropped,
        before,
        r2["agents"][0]["observations"].as_u64().unwrap(),
        r2,
    )
}

#[test]
fn collector_restart_loses_nothing_the_buffer_holds() {
    if !require_root() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (made, sent, dropped, at_c1, at_c2, _) = run_with_outage("100000", "arst");
    assert!(made > 1000, "{made} observations");
    assert_eq!(dropped, 0, "the buffer held the outage");
    assert_eq!(sent, made, "everything made was sent");
    // What reached the first collector before it died, plus everything the second got,
    // is everything — but for what was still in flight when it was killed.
    assert!(at_c1 + at_c2 <= made);
    assert!(at_c1 + at_c2 + 600 >= made, "c1 {at_c1} + c2 {at_c2} of {made}");
    assert!(
        at_c2 > made / 3,
        "the outage's observations reached the new collector"
    );
}

#[test]
fn a_full_buffer_drops_the_oldest_and_says_so() {
    if !require_root() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (made, sent, dropped, _, _, r2) = run_with_outage("100", "afull");
    assert!(dropped > 0, "a 100-observation queue overflows in a 3 s outage");
    assert_eq!(sent + dropped, made);
    assert_eq!(
        r2["agents"][0]["dropped_observations"].as_u64().unwrap(),
        dropped,
        "the collector was told"
    );
}
