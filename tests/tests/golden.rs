//! Goldens: what a user reads from roce-trace — capture's JSON Lines, the collector's
//! report, HTTP views and closing table, verify's table, JSON and JUnit — byte for byte on
//! fixed input (`tests/golden/`). Code may move between crates; these outputs may not
//! change unless a golden is re-blessed on purpose (`ROCE_TRACE_BLESS=1`, then review
//! the diff). A mismatch leaves the output beside the golden as `NAME.actual`.
//!
//! The input is a mirror capture of a three-switch path (ERSPAN II from s1, s2, s3), and
//! the first QP's data also as the sender's sniffer saw it, not encapsulated:
//! a data QP whose DSCP is rewritten at s3, CE-marked from s3 on for its second half and
//! with six packets missing at s3; its ACKs and CNPs coming back; a second data QP
//! (large frames) and an IPv6 QP that cross healthy.

use std::{
    io::{BufRead, BufReader, Read},
    net::{IpAddr, SocketAddr, TcpStream},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use roce_trace_common::roce::{OP_CNP, op};
use roce_trace_gen::frame::{Mirror, RoceFrame, ext};
use roce_trace_tests::*;
use serde_json::Value;

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("golden")
}

fn bless() -> bool {
    std::env::var_os("ROCE_TRACE_BLESS").is_some_and(|v| v == "1")
}

/// Compares `actual` with the golden `name` (or writes it, when blessing).
fn check(name: &str, actual: &[u8]) {
    let path = golden_dir().join(name);
    if bless() {
        // Tests run in parallel and several read the golden capture: an unchanged golden is
        // left alone, a changed one replaced whole (never seen half written).
        if std::fs::read(&path).ok().as_deref() != Some(actual) {
            let tmp = golden_dir().join(format!(".{name}.{}", std::process::id()));
            std::fs::write(&tmp, actual).unwrap();
            std::fs::rename(&tmp, &path).unwrap();
        }
        return;
    }
    let want = std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "golden {} ({e}): bless it with ROCE_TRACE_BLESS=1",
            path.display()
        )
    });
    if want != actual {
        let out = golden_dir().join(format!("{name}.actual"));
        std::fs::write(&out, actual).unwrap();
        let (w, a) = (String::from_utf8_lossy(&want), String::from_utf8_lossy(actual));
        let line = w
            .lines()
            .zip(a.lines())
            .position(|(x, y)| x != y)
            .unwrap_or(w.lines().count().min(a.lines().count()));
        panic!(
            "{name} differs from its golden at line {}:\n  golden: {}\n  actual: {}\n(whole output in {})",
            line + 1,
            w.lines().nth(line).unwrap_or("<end>"),
            a.lines().nth(line).unwrap_or("<end>"),
            out.display()
        );
    }
}

const SWITCHES: [&str; 3] = ["198.51.100.1", "198.51.100.2", "198.51.100.3"];

/// The fabric seen through three switches' mirror sessions, in capture order.
fn fabric_frames() -> Vec<(Duration, Vec<u8>)> {
    let analyser: IpAddr = "192.0.2.100".parse().unwrap();
    let sw: Vec<IpAddr> = SWITCHES.iter().map(|s| s.parse().unwrap()).collect();
    let mut out = Vec::new();
    let mut direct = Vec::new();
    let mut seq = [0u32; 3];
    let base = Duration::from_secs(1_700_000_000);
    // One packet crossing switches `hops` in order, 2 µs per hop, each copy as that
    // switch mirrors it (TTL one less per switch, `class(hop)` its DSCP/ECN there).
    let mut cross = |t_us: u64, hops: &[usize], f: &RoceFrame, class: &dyn Fn(usize) -> (u8, u8)| {
        for (n, &s) in hops.iter().enumerate() {
            let (dscp, ecn) = class(n);
            let copy = RoceFrame {
                ttl: f.ttl - n as u8,
                dscp,
                ecn,
                ..f.clone()
            }
            .build();
            seq[s] += 1;
            let m = Mirror::ErspanII {
                session: 10 + s as u16,
                seq: seq[s],
                index: 1,
            };
            out.push((
                base + Duration::from_micros(t_us + 2 * n as u64),
                m.encapsulate(sw[s], analyser, &copy),
            ));
        }
    };
    let h1: IpAddr = "10.0.0.1".parse().unwrap();
    let h2: IpAddr = "10.0.0.2".parse().unwrap();
    let h3: IpAddr = "10.0.0.3".parse().unwrap();
    for i in 0..120u32 {
        let t = 100 * i as u64;
        // The faulty QP: DSCP 26 rewritten to 0 at s3, CE from s3 on in its second half,
        // PSNs 90..96 never reach s3.
        let data = RoceFrame {
            src: h1,
            dst: h2,
            ttl: 64,
            dscp: 26,
            ecn: 0b10,
            udp_sport: 49152,
            opcode: if i % 4 == 0 {
                op::WRITE_FIRST
            } else {
                op::WRITE_MIDDLE
            },
            ext: if i % 4 == 0 {
                ext::reth(0x1000, 7, 4096)
            } else {
                Vec::new()
            },
            dest_qp: 0x100,
            ack_req: i % 4 == 3,
            psn: i,
            payload: vec![i as u8; 512],
            ..Default::default()
        };
        // The sender's own NIC sniffer sees it first, not encapsulated (the agent's
        // `pcap:ingress` point), one hop before s1.
        direct.push((
            base + Duration::from_micros(t) - Duration::from_nanos(500),
            RoceFrame {
                ttl: 65,
                ..data.clone()
            }
            .build(),
        ));
        let hops: &[usize] = if (90..96).contains(&i) {
            &[0, 1]
        } else {
            &[0, 1, 2]
        };
        cross(t, hops, &data, &|n| {
            let ecn = if n == 2 && i >= 60 { 0b11 } else { 0b10 };
            (if n == 2 { 0 } else { 26 }, ecn)
        });
        // Its ACK every fourth packet, back through s3, s2, s1 in class 26.
        if i % 4 == 3 {
            let ack = RoceFrame {
                src: h2,
                dst: h1,
                ttl: 64,
                dscp: 26,
                ecn: 0b10,
                udp_sport: 49153,
                opcode: op::ACKNOWLEDGE,
                ext: ext::aeth(0x1f, i / 4),
                dest_qp: 0x200,
                psn: i,
                ..Default::default()
            };
            cross(t + 50, &[2, 1, 0], &ack, &|_| (26, 0b10));
        }
        // A CNP for every eighth CE mark, class 48.
        if i >= 60 && i % 8 == 0 && !(90..96).contains(&i) {
            let cnp = RoceFrame {
                src: h2,
                dst: h1,
                ttl: 64,
                dscp: 48,
                ecn: 0b01,
                udp_sport: 49154,
                opcode: OP_CNP,
                ext: ext::cnp(),
                dest_qp: 0x100,
                psn: 0,
                ..Default::default()
            };
            cross(t + 60, &[2, 1, 0], &cnp, &|_| (48, 0b01));
        }
        // A healthy QP with large frames, every fourth slot.
        if i % 4 == 1 {
            let big = RoceFrame {
                src: h3,
                dst: h2,
                ttl: 64,
                dscp: 26,
                ecn: 0b10,
                udp_sport: 50000,
                opcode: op::SEND_MIDDLE,
                dest_qp: 0x300,
                psn: 1000 + i / 4,
                payload: vec![0xab; 2048],
                ..Default::default()
            };
            cross(t + 20, &[0, 1, 2], &big, &|_| (26, 0b10));
        }
        // An IPv6 QP, every sixth slot, crossing s2 then s1.
        if i % 6 == 0 {
            let v6 = RoceFrame {
                src: "fd00::1".parse().unwrap(),
                dst: "fd00::2".parse().unwrap(),
                ttl: 64,
                dscp: 26,
                ecn: 0b01,
                udp_sport: 51000,
                opcode: op::SEND_ONLY,
                dest_qp: 0x400,
                psn: i / 6,
                payload: vec![0x66; 256],
                ..Default::default()
            };
            cross(t + 30, &[1, 0], &v6, &|_| (26, 0b01));
        }
    }
    // In capture order (no two frames share a time).
    out.extend(direct);
    out.sort_by_key(|(t, _)| *t);
    out
}

/// The input: the checked-in capture, which the frame builder must still make.
fn fabric_pcap() -> PathBuf {
    let path = golden_dir().join("fabric.pcap");
    check("fabric.pcap", &pcap_bytes(&fabric_frames()));
    path
}

#[test]
fn the_frame_builder_makes_the_golden_capture() {
    fabric_pcap();
}

/// Runs roce-trace in the golden directory (input paths, as outputs name them, are
/// relative: the same in every checkout).
fn run(args: &[&str]) -> (Vec<u8>, String) {
    let out = Command::new(roce_trace_bin())
        .args(args)
        .current_dir(golden_dir())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.code().is_some_and(|c| c <= 1), "{args:?}: {err}");
    (out.stdout, err)
}

/// The summary line's own clock (`time_ns`, `duration_s`: when the capture ran, how long
/// reading took) zeroed; every other byte as printed.
fn capture_clock_zeroed(out: &[u8]) -> Vec<u8> {
    let text = String::from_utf8(out.to_vec()).unwrap();
    let mut v = String::new();
    for line in text.lines() {
        let mut l = line.to_owned();
        if l.starts_with(r#"{"type":"summary""#) {
            for key in [r#""time_ns":"#, r#""duration_s":"#] {
                let at = l.find(key).expect(key) + key.len();
                let end = at + l[at..].find([',', '}']).unwrap();
                l.replace_range(at..end, "0");
            }
        }
        v.push_str(&l);
        v.push('\n');
    }
    v.into_bytes()
}

/// The table's own clock (how long reading took: the header's `— 0s,` and the summary's
/// `after 0.0s`) zeroed.
fn table_clock_zeroed(out: &[u8]) -> Vec<u8> {
    let text = String::from_utf8(out.to_vec()).unwrap();
    let mut v = String::new();
    for line in text.lines() {
        let mut l = line.to_owned();
        for (before, after) in [("capture — ", ","), (" after ", " —")] {
            if let Some(at) = l.find(before).map(|i| i + before.len())
                && let Some(end) = l[at..].find(after).map(|e| at + e)
                && l[at..end].ends_with('s')
            {
                l.replace_range(at..end, "0s");
            }
        }
        v.push_str(&l);
        v.push('\n');
    }
    v.into_bytes()
}

#[test]
fn capture_json_lines_are_golden() {
    fabric_pcap();
    let p = "fabric.pcap";
    let (out, err) = run(&["capture", "-r", p, "--json", "--sample-rate", "1"]);
    assert!(!out.is_empty(), "{err}");
    check("capture-rate1.jsonl", &capture_clock_zeroed(&out));
    let (out, _) = run(&["capture", "-r", p, "--json", "--sample-rate", "8"]);
    check("capture-rate8.jsonl", &capture_clock_zeroed(&out));
    let (out, _) = run(&["capture", "-r", p]);
    check("capture-table.txt", &table_clock_zeroed(&out));
}

/// Fields that hold the collector's own clock (when something reached it): they differ
/// from run to run, so they are zeroed before comparing.
/// (`peer` is the agent's ephemeral address.)
const COLLECTOR_TIME: &[&str] = &["at_ns", "since_ns", "peer"];

fn normalize(v: &mut Value) {
    match v {
        Value::Object(m) => {
            for (k, x) in m.iter_mut() {
                if COLLECTOR_TIME.contains(&k.as_str()) && !x.is_null() {
                    *x = if x.is_string() {
                        Value::from("-")
                    } else {
                        Value::from(0)
                    };
                } else {
                    normalize(x);
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(normalize),
        _ => {}
    }
}

fn pretty(body: &str) -> Vec<u8> {
    let mut v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
    normalize(&mut v);
    let mut s = serde_json::to_string_pretty(&v).unwrap();
    s.push('\n');
    s.into_bytes()
}

fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let (status, body) = roce_trace::http::get(addr, path, std::time::Duration::from_secs(30)).unwrap();
    (status, String::from_utf8(body).unwrap())
}

#[test]
fn the_collector_report_views_and_table_are_golden() {
    fabric_pcap();
    let dir = TempDir::new("golden-collector");
    let report = dir.path("report.json");
    let mut collector = Proc::spawn(
        Command::new(roce_trace_bin())
            .args(["collect", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0"])
            .args([
                "--token",
                "tk",
                "--quiet",
                "--trajectory-timeout",
                "100ms",
                "--report",
            ])
            .arg(&report)
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    let mut lines = BufReader::new(collector.stderr.take().unwrap()).lines();
    let (listen, http) = loop {
        let l = lines.next().expect("collector exited").unwrap();
        if let Some(rest) = l.split("collecting on ").nth(1) {
            let (a, h) = rest.split_once(", API on http://").unwrap();
            break (
                a.trim().to_owned(),
                h.trim_end_matches("/flows").parse::<SocketAddr>().unwrap(),
            );
        }
    };
    std::thread::spawn(move || lines.for_each(drop));
    let agent = Command::new(roce_trace_bin())
        .current_dir(golden_dir())
        .args(["agent", "-r", "fabric.pcap", "--collector", &listen])
        .args([
            "--node",
            "sniffer",
            "--token",
            "tk",
            "--sample-rate",
            "1",
            "--interval",
            "1h",
        ])
        .output()
        .unwrap();
    assert!(
        agent.status.success(),
        "{}",
        String::from_utf8_lossy(&agent.stderr)
    );
    // Everything is in the join and every trajectory complete.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, s) = http_get(http, "/stats");
        let st: Value = serde_json::from_str(&s).unwrap();
        if st["pending"] == 0 && st["flows"].as_u64() > Some(0) && st["trajectories"].as_u64() > Some(0) {
            break;
        }
        assert!(Instant::now() < deadline, "the join never settled: {s}");
        std::thread::sleep(Duration::from_millis(200));
    }
    // CNP delivery compares counts three seconds old (by arrival): past that, all are.
    std::thread::sleep(Duration::from_millis(3500));
    let flows: Value = serde_json::from_str(&http_get(http, "/flows").1).unwrap();
    let first = flows[0]["id"].as_str().unwrap().to_owned();
    for (name, path) in [
        ("collector-flows.json", "/flows".to_owned()),
        // Flow ids in URLs are percent-encoded (`>` and `/` are no query characters).
        (
            "collector-flow.json",
            format!("/flow?id={}", roce_trace::http::percent_encode(&first)),
        ),
        ("collector-anomalies.json", "/anomalies".into()),
        ("collector-stats.json", "/stats".into()),
        ("collector-agents.json", "/agents".into()),
        ("collector-report-http.json", "/report".into()),
    ] {
        let (status, body) = http_get(http, &path);
        assert_eq!(status, 200, "{path}: {body}");
        check(name, &pretty(&body));
    }
    let (status, metrics) = http_get(http, "/metrics");
    assert_eq!(status, 200);
    check("collector-metrics.txt", metrics.as_bytes());
    let (status, body) = http_get(http, "/flow?id=nope");
    check("collector-flow-404.txt", format!("{status} {body}").as_bytes());
    let mut table = String::new();
    let mut stdout = collector.stdout.take().unwrap();
    assert!(collector.interrupt().success());
    stdout.read_to_string(&mut table).unwrap();
    check("collector-table.txt", table.as_bytes());
    let written = std::fs::read_to_string(&report).unwrap();
    check("collector-report.json", &pretty(&written));
}

/// verify on a fixed report: the table, `--json` and `--junit`, for each load.
#[test]
fn verify_table_json_and_junit_are_golden() {
    let dir = TempDir::new("golden-verify");
    for (tag, report, load) in [
        ("mirror-idle", "collector-report.json", "idle"),
        ("mirror-congested", "collector-report.json", "congested"),
    ] {
        let (json, junit) = (dir.path("v.json"), dir.path("v.xml"));
        let base = dir.path("baseline.json");
        let verify = |more: &[&str]| {
            let args = [
                "verify",
                "--policy",
                "policy.toml",
                "--report",
                report,
                "--load",
                load,
            ];
            run(&[&args[..], more].concat())
        };
        let (out, err) = verify(&[
            "--json",
            json.to_str().unwrap(),
            "--junit",
            junit.to_str().unwrap(),
            "--save-baseline",
            base.to_str().unwrap(),
        ]);
        assert!(!out.is_empty(), "{err}");
        check(&format!("verify-{tag}.txt"), &out);
        check(&format!("verify-{tag}.json"), &std::fs::read(&json).unwrap());
        check(
            &format!("verify-{tag}.junit.xml"),
            &std::fs::read(&junit).unwrap(),
        );
        check(
            &format!("verify-{tag}.baseline.json"),
            &std::fs::read(&base).unwrap(),
        );
        let (out, _) = verify(&["--baseline", base.to_str().unwrap(), "--json-stdout"]);
        check(&format!("verify-{tag}-vs-baseline.json"), &out);
    }
}

/// A `nats-server -js` of the test's own on a free port, killed on drop.
struct Nats {
    _proc: Proc,
    url: String,
    _dir: TempDir,
}

impl Nats {
    fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        Self::start_on(port)
    }

    fn start_on(port: u16) -> Self {
        let bin = nats_server_bin();
        // One directory per server: tests run side by side in one process.
        let dir = TempDir::new(&format!("fleet-nats-{port}"));
        let proc = Proc::spawn(
            Command::new(bin)
                .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
                .arg(dir.path("js"))
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "nats-server did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        Self {
            _proc: proc,
            url: format!("nats://127.0.0.1:{port}"),
            _dir: dir,
        }
    }
}

/// A collector in fleet mode (a member of the group on `nats`); its HTTP address.
fn fleet_collector(nats: &Nats, id: &str, dir: &TempDir) -> (Proc, SocketAddr) {
    let mut c = Proc::spawn(
        Command::new(roce_trace_bin())
            .args([
                "collect",
                "--listen",
                "127.0.0.1:0",
                "--http",
                "127.0.0.1:0",
                "--token",
                "tk",
                "--quiet",
            ])
            .args(["--trajectory-timeout", "100ms", "--report"])
            .arg(dir.path(&format!("{id}.json")))
            .args([
                "--nats-url",
                &nats.url,
                "--nats-partitions",
                "8",
                "--nats-lease-ttl",
                "2s",
                "--member-id",
                id,
            ])
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped()),
    );
    let mut lines = BufReader::new(c.stderr.take().unwrap()).lines();
    let http = loop {
        let l = lines.next().expect("collector exited").unwrap();
        if let Some(rest) = l.split(", API on http://").nth(1) {
            break rest.trim_end_matches("/flows").parse::<SocketAddr>().unwrap();
        }
    };
    std::thread::spawn(move || lines.for_each(drop));
    (c, http)
}

/// A gauge or counter of the collector's own `/metrics` (`local=1`: this member's part,
/// not the group's).
fn metric(http: SocketAddr, name: &str) -> u64 {
    let (_, m) = http_get(http, "/metrics?local=1");
    m.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0)
}

/// Waits until the members at `https` are the whole group and own every partition.
fn group_settles(https: &[SocketAddr]) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let members: Vec<u64> = https
            .iter()
            .map(|h| metric(*h, "roce_trace_collector_fleet_members"))
            .collect();
        let owned: u64 = https
            .iter()
            .map(|h| metric(*h, "roce_trace_collector_fleet_partitions_owned"))
            .sum();
        if members.iter().all(|m| *m == https.len() as u64) && owned == 8 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the group never settled: members {members:?}, partitions owned {owned}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Waits until the group's join (asked of `http`) holds `trajectories` and nothing is
/// pending, then past the CNP settle time.
fn group_joined(http: SocketAddr, trajectories: u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, s) = http_get(http, "/stats");
        if status == 200 {
            let st: Value = serde_json::from_str(&s).unwrap();
            if st["pending"] == 0 && st["trajectories"].as_u64() == Some(trajectories) {
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "the group's join never held all {trajectories} trajectories: {s}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    std::thread::sleep(Duration::from_millis(3500));
}

/// Fleet mode: the golden capture published by a pcap agent to NATS JetStream and joined
/// by a group of three collectors, each owning a share of the partitions. Every member's
/// view of the group is the one collector's golden view: every flow once, located as
/// with one collector, the same counts. Then the member owning the most partitions is
/// killed (SIGKILL: no hand-over): its partitions move to the survivors, which replay
/// them from the stream — and the group's view is the golden view again, to the packet.
#[test]
fn a_group_of_collectors_on_nats_joins_as_one_collector_and_survives_losing_a_member() {
    let golden = |name: &str| std::fs::read(golden_dir().join(name)).unwrap();
    let stats: Value = serde_json::from_slice(&golden("collector-stats.json")).unwrap();
    let trajectories = stats["trajectories"].as_u64().unwrap();
    let nats = Nats::start();
    let dir = TempDir::new("fleet-group");
    let mut members: Vec<(Proc, SocketAddr)> = ["c0", "c1", "c2"]
        .iter()
        .map(|id| fleet_collector(&nats, id, &dir))
        .collect();
    let https: Vec<SocketAddr> = members.iter().map(|m| m.1).collect();
    group_settles(&https);
    let agent = Command::new(roce_trace_bin())
        .current_dir(golden_dir())
        .args([
            "agent",
            "-r",
            "fabric.pcap",
            "--nats-url",
            &nats.url,
            "--nats-partitions",
            "8",
        ])
        .args(["--node", "sniffer", "--sample-rate", "1", "--interval", "1h"])
        .output()
        .unwrap();
    assert!(
        agent.status.success(),
        "{}",
        String::from_utf8_lossy(&agent.stderr)
    );
    // Every member's view of the group is the one collector's golden view.
    let views_are_golden = |https: &[SocketAddr], when: &str| {
        // The group's metrics, from any member: the one collector's counts and anomalies.
        let series = |m: &str, names: &[&str]| -> Vec<String> {
            m.lines()
                .filter(|l| names.iter().any(|n| l.starts_with(n)))
                .map(str::to_owned)
                .collect()
        };
        let golden_metrics = String::from_utf8(golden("collector-metrics.txt")).unwrap();
        let names = [
            "roce_trace_collector_observations_total",
            "roce_trace_collector_trajectories_total",
            "roce_trace_collector_flows ",
            "roce_trace_collector_anomalies{",
        ];
        for h in https {
            let (status, m) = http_get(*h, "/metrics");
            assert_eq!(status, 200, "{when}, {h}/metrics: {m}");
            assert_eq!(
                series(&m, &names),
                series(&golden_metrics, &names),
                "{when}, {h}/metrics: the group's counts"
            );
            assert!(
                m.contains("roce_trace_collector_fleet_partitions_owned 8\n"),
                "{when}, {h}/metrics: every partition read by the group: {m}"
            );
        }
        for h in https {
            for (path, name) in [
                ("/flows", "collector-flows.json"),
                ("/stats", "collector-stats.json"),
            ] {
                let (status, body) = http_get(*h, path);
                assert_eq!(status, 200, "{when}, {h}{path}: {body}");
                assert!(
                    pretty(&body) == golden(name),
                    "{when}, {h}{path} differs from one collector's ({name}):\n{}",
                    String::from_utf8_lossy(&pretty(&body))
                );
            }
        }
    };
    group_joined(https[0], trajectories);
    views_are_golden(&https, "with every member");
    // Each member joined a share, not everything: the flows of the capture's host pairs
    // are split between members, so a member that left another's share out of the
    // group's view would show too few.
    let own: Vec<u64> = https
        .iter()
        .map(|h| metric(*h, "roce_trace_collector_fleet_partitions_owned"))
        .collect();
    assert!(own.iter().all(|n| *n < 8), "partitions owned: {own:?}");
    let local: Vec<usize> = https
        .iter()
        .map(|h| {
            serde_json::from_str::<Vec<Value>>(&http_get(*h, "/flows?local=1").1)
                .unwrap()
                .len()
        })
        .collect();
    let all = serde_json::from_slice::<Vec<Value>>(&golden("collector-flows.json"))
        .unwrap()
        .len();
    assert_eq!(
        local.iter().sum::<usize>(),
        all,
        "each flow joined by one member: {local:?}"
    );
    assert!(
        local.iter().filter(|n| **n > 0).count() >= 2,
        "the flows are split: {local:?}"
    );
    let (dead, _) = own.iter().enumerate().max_by_key(|(_, n)| **n).unwrap();
    let (killed, _) = members.remove(dead);
    killed.signal(libc::SIGKILL);
    drop(killed);
    let survivors: Vec<SocketAddr> = members.iter().map(|m| m.1).collect();
    group_settles(&survivors);
    group_joined(survivors[0], trajectories);
    views_are_golden(&survivors, "after losing a member");
}

/// Fleet mode with NATS away when the agent starts: the agent starts all the same,
/// buffers what it reads and keeps trying; once the server is up it delivers every
/// record, and the group's view is the one collector's golden view, to the packet.
#[test]
fn an_agent_started_before_nats_buffers_and_delivers_everything() {
    let golden = |name: &str| std::fs::read(golden_dir().join(name)).unwrap();
    let stats: Value = serde_json::from_slice(&golden("collector-stats.json")).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("nats://127.0.0.1:{port}");
    let mut agent = Proc::spawn(
        Command::new(roce_trace_bin())
            .current_dir(golden_dir())
            .args(["agent", "-r", "fabric.pcap", "--nats-url", &url])
            .args(["--nats-partitions", "8", "--node", "sniffer"])
            .args(["--sample-rate", "1", "--interval", "1h"])
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped()),
    );
    let mut lines = BufReader::new(agent.stderr.take().unwrap()).lines();
    let mut log = String::new();
    loop {
        let l = lines.next().expect("the agent exited without NATS").unwrap();
        log.push_str(&l);
        log.push('\n');
        assert!(!l.contains("publishing to NATS"), "no NATS yet: {log}");
        if l.contains("NATS unreachable") {
            break;
        }
    }
    // The capture is read and buffered by now; NATS comes up, then a collector.
    std::thread::sleep(Duration::from_millis(500));
    let nats = Nats::start_on(port);
    let dir = TempDir::new("fleet-late");
    let (_c, http) = fleet_collector(&nats, "c0", &dir);
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let st = agent.wait().unwrap();
    log.push_str(&rest.join("\n"));
    assert!(st.success(), "{log}");
    assert!(log.contains("publishing to NATS"), "{log}");
    let last = rest
        .iter()
        .find(|l| l.contains("agent stopped"))
        .unwrap_or_else(|| panic!("no last line: {log}"));
    assert!(
        last.contains("0 dropped, 0 undelivered"),
        "every record delivered: {last}"
    );
    group_joined(http, stats["trajectories"].as_u64().unwrap());
    for (path, name) in [
        ("/flows", "collector-flows.json"),
        ("/stats", "collector-stats.json"),
    ] {
        let (status, body) = http_get(http, path);
        assert_eq!(status, 200, "{path}: {body}");
        assert!(
            pretty(&body) == golden(name),
            "{path} differs from one collector's ({name}):\n{}",
            String::from_utf8_lossy(&pretty(&body))
        );
    }
}
