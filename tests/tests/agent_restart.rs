//! An agent under a collector that dies and comes back: it keeps sampling, buffers while
//! the collector is away, reconnects with backoff, sends again what the dead collector had
//! not acknowledged, delivers what it buffered, and reports what a too-small buffer made it
//! drop. Real processes across a veth pair; every count exact.

use std::{sync::Mutex, time::Duration};

use roce_trace_tests::*;
use serde_json::Value;

static SERIAL: Mutex<()> = Mutex::new(());

/// GET `path` from `addr`, a thread in `ns`; the body.
fn get(ns: &Netns, addr: &'static str, path: &'static str) -> String {
    let (_, body) = ns.run(move || {
        roce_trace::http::get(addr.parse().unwrap(), path, std::time::Duration::from_secs(30)).unwrap()
    });
    String::from_utf8(body).unwrap()
}

/// The collector's view of the agent (GET /agents, the only agent).
fn collector_view(pair: &VethPair) -> Value {
    let v: Value = serde_json::from_str(&get(&pair.b, "127.0.0.1:8080", "/agents")).unwrap();
    assert_eq!(v.as_array().map(Vec::len), Some(1), "{v}");
    v[0].clone()
}

/// The agent's metrics (its Prometheus endpoint).
struct Metrics(String);

impl Metrics {
    fn read(pair: &VethPair) -> Self {
        Self(get(&pair.a, "127.0.0.1:9464", "/metrics"))
    }
    /// The value of the series `name` (with its labels, if any).
    fn get(&self, name: &str) -> u64 {
        self.0
            .lines()
            .find_map(|l| l.rsplit_once(' ').filter(|(n, _)| *n == name))
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing: {}", self.0))
    }
}

/// What became of one kind of record, from the agent's last line.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Delivery {
    made: u64,
    sent: u64,
    resent: u64,
    acked: u64,
    dropped: u64,
    undelivered: u64,
}

/// The agent's last line: `agent stopped: observations N made, N sent, N resent, N
/// acknowledged, N dropped, N undelivered; counter deltas …; N connections, N ring-buffer
/// drops` — observations, counter deltas, connections.
fn agent_totals(stderr: &str) -> (Delivery, Delivery, u64) {
    let line = stderr
        .lines()
        .find_map(|l| l.split_once("agent stopped: ").map(|(_, s)| s))
        .unwrap_or_else(|| panic!("no summary: {stderr}"));
    // Each "N word" pair of a section, by word.
    let pairs = |section: &str| -> Vec<(String, u64)> {
        let words: Vec<&str> = section
            .split(|c: char| c == ',' || c.is_whitespace())
            .filter(|w| !w.is_empty())
            .collect();
        words
            .windows(2)
            .filter_map(|w| Some((w[1].to_owned(), w[0].parse().ok()?)))
            .collect()
    };
    let delivery = |section: &str| {
        let p = pairs(section);
        let get = |k: &str| {
            p.iter()
                .find(|(w, _)| w == k)
                .unwrap_or_else(|| panic!("no `{k}` in `{section}`"))
                .1
        };
        Delivery {
            made: get("made"),
            sent: get("sent"),
            resent: get("resent"),
            acked: get("acknowledged"),
            dropped: get("dropped"),
            undelivered: get("undelivered"),
        }
    };
    let sections: Vec<&str> = line.split(';').collect();
    assert_eq!(sections.len(), 3, "{line}");
    let obs = delivery(sections[0].strip_prefix("observations").expect(line));
    let counters = delivery(sections[1].trim().strip_prefix("counter deltas").expect(line));
    let connections = pairs(sections[2])
        .iter()
        .find(|(w, _)| w == "connections")
        .expect(line)
        .1;
    (obs, counters, connections)
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
            "127.0.0.1:8080",
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
    agent_with(
        pair,
        &[
            "--sample-rate",
            "1",
            "--interval",
            "1s",
            "--queue",
            queue,
            "--metrics",
            "127.0.0.1:9464",
        ],
    )
}

/// Node a's agent on its veth, streaming to the collector with the token, plus `more`.
fn agent_with(pair: &VethPair, more: &[&str]) -> Daemon {
    let mut args = vec![
        "agent",
        "--collector",
        "10.99.0.2:4792",
        "--node",
        "a",
        "-i",
        &pair.a_if,
        "--token",
        "tk",
    ];
    args.extend_from_slice(more);
    Daemon::start(&pair.a.name, &args, "connected to collector")
}

/// Stops a daemon and returns everything it wrote to stderr.
fn stop_and_log(d: Daemon) -> String {
    let log = d.stderr.clone();
    d.stop();
    std::thread::sleep(Duration::from_millis(300)); // the reader thread takes the last lines
    log.lock().unwrap().clone()
}

/// Cuts (or restores) the way from the agent to the collector: the collector's namespace
/// drops what arrives for port 4792. The collector's own frames still reach the agent.
fn cut(pair: &VethPair, on: bool) {
    if on {
        pair.b.exec(&["nft", "add", "table", "inet", "rtcut"]);
        pair.b.exec(&[
            "nft",
            "add",
            "chain",
            "inet",
            "rtcut",
            "input",
            "{ type filter hook input priority 0; policy accept; }",
        ]);
        pair.b.exec(&[
            "nft", "add", "rule", "inet", "rtcut", "input", "tcp", "dport", "4792", "drop",
        ]);
    } else {
        pair.b.exec(&["nft", "delete", "table", "inet", "rtcut"]);
    }
}

/// One run: traffic for 8 s; 2 s in, the way to collector 1 is cut (so that what it
/// processed can still be read off it), then it is killed (no goodbye) and the way
/// restored; 3 s later collector 2 starts.
#[derive(Debug)]
struct Outage {
    /// The agent's accounts at the end: observations, counter deltas.
    obs: Delivery,
    counters: Delivery,
    connections: u64,
    /// What collector 1 processed (observations, counter deltas), as it said itself.
    at_c1: (u64, u64),
    /// What the agent counted acknowledged while collector 1 was its collector.
    acked_by_c1: (u64, u64),
    /// Collector 2's report of the agent.
    at_c2: Value,
}

fn run_with_outage(queue: &str, tag: &str) -> Outage {
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
    cut(&pair, true);
    // Collector 1 processes and acknowledges what reached it; the agent keeps writing.
    std::thread::sleep(Duration::from_secs(1));
    let v = collector_view(&pair);
    let at_c1 = (
        v["observations"].as_u64().unwrap(),
        v["counter_deltas"].as_u64().unwrap(),
    );
    c1.kill();
    cut(&pair, false);
    std::thread::sleep(Duration::from_millis(500));
    // No collector: the agent's acknowledged counts are collector 1's and stay put.
    let m = Metrics::read(&pair);
    let acked_by_c1 = (
        m.get("roce_trace_samples_acked_total"),
        m.get("roce_trace_counter_deltas_acked_total"),
    );
    std::thread::sleep(Duration::from_millis(2500));
    let c2 = collector(&pair, "c2", &dir);
    gen_report(send);
    interrupt(resp);
    std::thread::sleep(Duration::from_millis(1500)); // the last counter deltas
    // The agent reconnects (its backoff may have grown to seconds) and delivers.
    let settled = |m: &Metrics| {
        ["samples", "counter_deltas"].iter().all(|k| {
            let n = |s: &str| m.get(&format!("roce_trace_{k}_{s}total"));
            n("acked_") + n("dropped_") == n("")
        })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let mut m = Metrics::read(&pair);
    while !settled(&m) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
        m = Metrics::read(&pair);
    }
    let iface = pair.a_if.clone();
    assert!(
        m.get(&format!(
            "roce_trace_packets_total{{interface=\"{iface}\",direction=\"egress\",dscp=\"26\"}}"
        )) > 1000
    );
    assert!(
        m.get(&format!(
            "roce_trace_ecn_packets_total{{interface=\"{iface}\",direction=\"egress\",ecn=\"ect0\"}}"
        )) > 1000
    );
    let log = stop_and_log(a);
    c2.stop();
    let r2: Value = serde_json::from_str(&std::fs::read_to_string(dir.path("c2.json")).unwrap()).unwrap();
    let (obs, counters, connections) = agent_totals(&log);
    assert_eq!(
        m.get("roce_trace_samples_total"),
        obs.made,
        "the metrics say what the last line says"
    );
    assert_eq!(r2["agents"].as_array().map(Vec::len), Some(1));
    Outage {
        obs,
        counters,
        connections,
        at_c1,
        acked_by_c1,
        at_c2: r2["agents"][0].clone(),
    }
}

/// Every observation and counter delta the agent made is accounted for exactly: collector
/// 1 acknowledged what it processed, and collector 2 got precisely the rest — what was
/// buffered during the outage, and what was written to collector 1 but never processed
/// (sent again) — with nothing dropped.
#[test]
fn collector_restart_loses_nothing_the_buffer_holds() {
    if !require_root() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let o = run_with_outage("100000", "arst");
    eprintln!("{o:#?}");
    let at_c2 = (
        o.at_c2["observations"].as_u64().unwrap(),
        o.at_c2["counter_deltas"].as_u64().unwrap(),
    );
    assert_eq!(o.connections, 2, "reconnected once");
    assert!(o.obs.made > 1000, "{:?}", o.obs);
    for (what, d, at_c1, acked_by_c1, at_c2) in [
        ("observations", o.obs, o.at_c1.0, o.acked_by_c1.0, at_c2.0),
        ("counter deltas", o.counters, o.at_c1.1, o.acked_by_c1.1, at_c2.1),
    ] {
        assert_eq!(d.dropped, 0, "{what}: the buffer held the outage: {d:?}");
        assert_eq!(
            (d.acked, d.undelivered),
            (d.made, 0),
            "{what}: everything made was acknowledged: {d:?}"
        );
        assert_eq!(
            at_c1, acked_by_c1,
            "{what}: collector 1 acknowledged exactly what it processed"
        );
        assert_eq!(
            at_c2,
            d.made - acked_by_c1,
            "{what}: collector 2 got everything collector 1 did not acknowledge: {d:?}, c1 {at_c1}"
        );
        assert_eq!(d.sent, d.made + d.resent, "{what}: {d:?}");
    }
    assert!(
        o.obs.resent > 0,
        "what was written while the way was cut was sent again: {:?}",
        o.obs
    );
    assert!(
        at_c2.0 > o.obs.made / 3,
        "the outage's observations reached the new collector"
    );
    assert_eq!(o.at_c2["dropped_observations"], 0);
}

/// A 100-observation buffer overflows in the outage: the oldest are dropped, counted, and
/// reported to the collector; every observation is still either acknowledged or dropped,
/// and collector 2 got exactly the acknowledged ones collector 1 did not have.
#[test]
fn a_full_buffer_drops_the_oldest_and_says_so() {
    if !require_root() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let o = run_with_outage("100", "afull");
    eprintln!("{o:#?}");
    let d = o.obs;
    assert_eq!(o.connections, 2, "reconnected once");
    assert!(
        d.dropped > 100,
        "a 100-observation queue overflows in a 3 s outage: {d:?}"
    );
    assert_eq!(
        (d.acked + d.dropped, d.undelivered),
        (d.made, 0),
        "each acknowledged or dropped: {d:?}"
    );
    assert_eq!(
        o.at_c1.0, o.acked_by_c1.0,
        "collector 1 acknowledged what it processed"
    );
    assert_eq!(
        o.at_c2["observations"].as_u64().unwrap(),
        d.made - d.dropped - o.acked_by_c1.0,
        "collector 2 got the rest but what was dropped: {d:?}"
    );
    assert_eq!(
        o.at_c2["dropped_observations"].as_u64().unwrap(),
        d.dropped,
        "the collector was told"
    );
}

/// The last interval is not lost at shutdown: an agent with a 60 s interval, stopped a
/// moment after its traffic, still reads its counters once more and delivers them — the
/// flow's one counter delta, acknowledged, with every packet. Fails when the agent stops
/// without that last reading (no counter delta at all: a stopped agent lost up to an
/// interval of every flow's counts).
#[test]
fn an_agent_stopped_mid_interval_delivers_its_last_counters() {
    if !require_root() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let pair = VethPair::new("lst");
    let dir = TempDir::new("lst");
    let c = collector(&pair, "c", &dir);
    let a = agent_with(&pair, &["--sample-rate", "0", "--interval", "60s"]);
    let frames: Vec<Vec<u8>> = (0..25)
        .map(|psn| {
            roce_trace_gen::frame::RoceFrame {
                src: "10.99.0.1".parse().unwrap(),
                dst: "10.99.0.2".parse().unwrap(),
                udp_sport: 49_700,
                psn,
                ..Default::default()
            }
            .build()
        })
        .collect();
    let a_if = pair.a_if.clone();
    pair.a.run(move || send_frames(&a_if, &frames));
    std::thread::sleep(Duration::from_millis(500));
    let log = stop_and_log(a);
    let (_, counters, _) = agent_totals(&log);
    assert_eq!((counters.made, counters.acked), (1, 1), "{log}");
    let v = collector_view(&pair);
    assert_eq!(v["counter_deltas"], 1, "{v}");
    c.stop();
    let r: Value = serde_json::from_str(&std::fs::read_to_string(dir.path("c.json")).unwrap()).unwrap();
    let flow = r["flows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["id"].as_str().is_some_and(|id| id.contains(":49700>")))
        .unwrap_or_else(|| panic!("no flow: {r}"));
    let packets: u64 = flow["counters"]
        .as_object()
        .unwrap()
        .values()
        .map(|d| d["packets"].as_u64().unwrap_or_else(|| panic!("{d}")))
        .sum();
    assert_eq!(packets, 25, "{flow}");
}
