//! Continuous verification on the lab (`collect --policy`): agents on every node, traffic
//! on every host, and a DSCP rewrite at spine s1 that comes and goes. Many healthy
//! windows make no event; the fault turns `data_class` to fail within the windows
//! configured and back after it is cleared; exactly two events reach a webhook receiver
//! (the fail, with the flows through s1 as evidence, and the recovery), the first after
//! the receiver refused it once; a collector restart keeps the history and does not
//! repeat an alert; `verify --since` says what failed and when.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::{Read as _, Write as _},
    net::TcpListener,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use roce_trace_tests::{
    lab::{Fault, Lab, LabGuard, Observers},
    *,
};
use serde_json::Value;

const TOKEN: &str = "continuous-token";
const HTTP: &str = "127.0.0.1:8080";
const HOOK: &str = "127.0.0.1:9911";
const EVERY_MS: u64 = 1000;
const FAIL_AFTER: u64 = 2;

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// The shipped policy's data class, ECN and NAK rules: the rewrite breaks `data_class`
/// alone (`no_class_change` would fail too, a window or two later: its changes are
/// located from trajectories, which complete a timeout after the packets, while the
/// classes each point counted arrive with the counters — two checks, two events).
fn policy(dir: &TempDir) -> PathBuf {
    let p = dir.path("policy.toml");
    std::fs::write(
        &p,
        "[class]\ndata_dscp = 26\n\n[ecn]\ndata_ect = true\nce_max_idle = 0.001\n\n[reliability]\nmax_nak_ppm = 1000\n",
    )
    .unwrap();
    p
}

/// A webhook receiver in the management namespace: it refuses the first POST (503),
/// then takes every one (200); the bodies it took.
fn receiver(lab: &Lab) -> Arc<Mutex<Vec<Value>>> {
    let l: TcpListener = in_netns(&lab.ns("mgmt"), || {
        TcpListener::bind(HOOK).expect("binding the receiver")
    });
    let got = Arc::new(Mutex::new(Vec::new()));
    let g = got.clone();
    std::thread::spawn(move || {
        let mut refused = false;
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            let mut req = Vec::new();
            let mut buf = [0u8; 65536];
            let body = loop {
                let n = s.read(&mut buf).unwrap_or(0);
                if n == 0 {
                    break None;
                }
                req.extend_from_slice(&buf[..n]);
                if let Some(i) = req.windows(4).position(|w| w == b"\r\n\r\n") {
                    let head = String::from_utf8_lossy(&req[..i]).to_ascii_lowercase();
                    let len: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .map_or(0, |v| v.trim().parse().unwrap());
                    while req.len() < i + 4 + len {
                        let n = s.read(&mut buf).unwrap_or(0);
                        assert!(n > 0, "the collector closed mid-body");
                        req.extend_from_slice(&buf[..n]);
                    }
                    assert!(head.starts_with("post /hook "), "{head}");
                    assert!(head.contains("content-type: application/json"), "{head}");
                    break Some(req[i + 4..i + 4 + len].to_vec());
                }
            };
            let Some(body) = body else { continue };
            if !refused {
                refused = true;
                let _ = s.write_all(b"HTTP/1.1 503 Busy\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
                continue;
            }
            let _ = s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
            g.lock()
                .unwrap()
                .push(serde_json::from_slice(&body).expect("the alert is JSON"));
        }
    });
    got
}

fn get(lab: &Lab, path: &str) -> (u16, String) {
    let path = path.to_owned();
    in_netns(&lab.ns("mgmt"), move || {
        let (s, b) = roce_trace::http::get(HTTP.parse().unwrap(), &path, Duration::from_secs(10)).unwrap();
        (s, String::from_utf8(b).unwrap())
    })
}

fn verdicts(lab: &Lab) -> Value {
    let (s, b) = get(lab, "/verdicts");
    assert_eq!(s, 200, "{b}");
    serde_json::from_str(&b).unwrap()
}

/// The established status of `check` (as /metrics says it: the label whose series is 1).
fn status(lab: &Lab, check: &str) -> Option<String> {
    let (s, text) = get(lab, "/metrics");
    assert_eq!(s, 200);
    let want = format!("roce_trace_verify_check_status{{check=\"{check}\",status=\"");
    text.lines()
        .filter_map(|l| l.strip_prefix(&want))
        .find(|rest| rest.ends_with("} 1"))
        .map(|rest| rest.split('"').next().unwrap().to_owned())
}

/// `roce-trace verify ARGS` in the management namespace.
fn verify(lab: &Lab, args: &[&str]) -> std::process::Output {
    std::process::Command::new("ip")
        .args(["netns", "exec", &lab.ns("mgmt")])
        .arg(roce_trace_bin())
        .arg("verify")
        .args(args)
        .output()
        .unwrap()
}

fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
    t.elapsed()
}

/// The changes of an event, by check: (from, to).
fn changes(e: &Value) -> BTreeMap<String, (Value, Value)> {
    e["changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["check"].as_str().unwrap().to_owned(),
                (c["from"].clone(), c["to"].clone()),
            )
        })
        .collect()
}

#[test]
fn a_fault_that_comes_and_goes_fails_its_checks_and_recovers_with_two_alerts() {
    if !require_root() {
        return;
    }
    let lab = LabGuard::up("rtcv");
    let dir = TempDir::new("continuous-lab");
    let got = receiver(&lab.0);
    let policy = policy(&dir);
    let history = dir.path("verdicts.jsonl");
    let every = format!("{EVERY_MS}ms");
    let window = format!("{}ms", 2 * EVERY_MS);
    let fail_after = FAIL_AFTER.to_string();
    let hook = format!("http://{HOOK}/hook");
    let mut obs = Observers::start(
        &lab.0,
        dir.path("report.json"),
        TOKEN,
        &[
            "--http",
            HTTP,
            "--policy",
            policy.to_str().unwrap(),
            "--verify-every",
            &every,
            "--verify-window",
            &window,
            "--fail-after",
            &fail_after,
            "--verdict-history",
            history.to_str().unwrap(),
            "--alert-url",
            &hook,
        ],
    );
    let _gens = lab::two_pairs_traffic(&lab.0, 150);
    let checks = ["data_class", "data_ect", "ce_fraction", "naks"];

    // Healthy: every check established ok once the traffic is seen, then many windows
    // without an event.
    wait_for("every check ok", Duration::from_secs(40), || {
        checks
            .iter()
            .all(|c| matches!(status(&lab.0, c).as_deref(), Some("pass" | "skip")))
    });
    let v = verdicts(&lab.0);
    let first_events = v["events"].as_array().unwrap().len();
    let windows = v["windows"].as_u64().unwrap();
    for e in v["events"].as_array().unwrap() {
        for (check, (from, to)) in changes(e) {
            assert!(
                from.is_null() && (to == "pass" || to == "skip"),
                "{check}: {from} -> {to} on a healthy fabric:\n{e:#}"
            );
        }
    }
    std::thread::sleep(Duration::from_secs(13));
    let v = verdicts(&lab.0);
    assert!(
        v["windows"].as_u64().unwrap() >= windows + 10,
        "{} windows",
        v["windows"]
    );
    assert_eq!(
        v["events"].as_array().unwrap().len(),
        first_events,
        "a healthy fabric made events:\n{:#}",
        v["events"]
    );
    assert!(
        got.lock().unwrap().is_empty(),
        "alerts from a healthy fabric: {:?}",
        got.lock().unwrap()
    );

    // The fault comes: the class checks fail within the windows configured.
    let fault = Fault::DscpRewrite {
        spine: 1,
        from: 26,
        to: 0,
    };
    let fault_at = unix_ms();
    lab.0.apply(&fault).unwrap();
    // A window (2 s) must hold the rewritten packets' completed trajectories (2 s
    // timeout, 1 s counters), then FAIL_AFTER windows: about 6 s; 15 s allowed.
    let took = wait_for("data_class failing", Duration::from_secs(15), || {
        status(&lab.0, "data_class").as_deref() == Some("fail")
    });
    eprintln!("data_class failed {took:?} after the fault");
    let report: Value = serde_json::from_str(&get(&lab.0, "/report").1).unwrap();
    let through_s1: BTreeSet<String> = report["flows"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| {
            f["path"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p.as_str().unwrap().starts_with("s1:"))
        })
        .map(|f| f["id"].as_str().unwrap().to_owned())
        .collect();
    std::thread::sleep(Duration::from_secs(4));

    // ... and goes: they recover.
    let clear_at = unix_ms();
    lab.0.clear(&fault).unwrap();
    let took = wait_for("data_class passing again", Duration::from_secs(15), || {
        status(&lab.0, "data_class").as_deref() == Some("pass")
    });
    eprintln!("data_class passed {took:?} after the repair");
    std::thread::sleep(Duration::from_secs(5));

    // Exactly two alerts: the failure (refused once, retried) and the recovery.
    wait_for("two alerts delivered", Duration::from_secs(10), || {
        got.lock().unwrap().len() >= 2
    });
    std::thread::sleep(Duration::from_secs(2));
    let alerts = got.lock().unwrap().clone();
    assert_eq!(alerts.len(), 2, "alerts: {alerts:#?}");
    let (fail, pass) = (&alerts[0], &alerts[1]);
    assert_eq!(fail["type"], "verdict_change");
    let failed = changes(fail);
    assert_eq!(failed.keys().collect::<Vec<_>>(), ["data_class"], "{fail:#}");
    for (check, (from, to)) in &failed {
        assert_eq!(
            (from.as_str(), to.as_str()),
            (Some("pass"), Some("fail")),
            "{check}"
        );
    }
    for c in fail["changes"].as_array().unwrap() {
        let began = c["began_ms"].as_u64().unwrap();
        assert!(
            began >= fault_at && began < clear_at,
            "{}: began {began}, fault at {fault_at}",
            c["check"]
        );
        let flows: BTreeSet<&str> = c["evidence"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["flow"].as_str().unwrap())
            .collect();
        assert!(!flows.is_empty(), "{c:#}");
        for f in &flows {
            assert!(
                through_s1.contains(*f),
                "{f} is evidence of {} but not through s1",
                c["check"]
            );
        }
        // Each flow's evidence starts at s1: the wrong class from s1's egress on, never
        // before it (h1, l1, s1's ingress still see 26).
        for f in &flows {
            let of: Vec<&Value> = c["evidence"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|e| e["flow"] == *f)
                .collect();
            let at: Vec<&str> = of
                .iter()
                .flat_map(|e| e["at"].as_array().unwrap())
                .map(|p| p.as_str().unwrap())
                .collect();
            assert!(
                at.iter().any(|p| p.starts_with("s1:") && p.ends_with(":egress")),
                "{f}: not at s1's egress: {at:?}"
            );
            assert!(
                !at.iter().any(|p| ["h1:", "h2:", "l1:", "s1:l1:ingress"]
                    .iter()
                    .any(|b| p.starts_with(b))),
                "{f}: the wrong class before s1: {at:?}"
            );
        }
    }
    let passed = changes(pass);
    assert_eq!(
        passed.keys().collect::<Vec<_>>(),
        failed.keys().collect::<Vec<_>>(),
        "{pass:#}"
    );
    for (check, (from, to)) in &passed {
        assert_eq!(
            (from.as_str(), to.as_str()),
            (Some("fail"), Some("pass")),
            "{check}"
        );
    }
    for c in pass["changes"].as_array().unwrap() {
        assert!(c["began_ms"].as_u64().unwrap() >= clear_at, "{c:#}");
    }
    let (_, metrics) = get(&lab.0, "/metrics");
    assert!(
        metrics.contains("roce_trace_verify_alerts_total{outcome=\"delivered\"} 2"),
        "{metrics}"
    );
    assert!(
        metrics.contains("roce_trace_verify_alerts_total{outcome=\"retried\"} 1"),
        "{metrics}"
    );
    // The shipped alert rules query what this collector exports, labels included.
    let rules = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../dist/roce-trace-alerts.yml"
    ))
    .unwrap();
    promql::check_exprs(&promql::rule_exprs(&rules), &promql::exported(&metrics)).unwrap();
    let by_check: Value =
        serde_json::from_str(&get(&lab.0, "/verdicts?check=data_class&since=10m").1).unwrap();
    assert_eq!(by_check["checks"].as_array().unwrap().len(), 1);
    assert!(
        by_check["events"].as_array().unwrap().iter().all(|e| e["changes"]
            .as_array()
            .unwrap()
            .iter()
            .all(|c| c["check"] == "data_class")),
        "{by_check:#}"
    );
    assert_eq!(get(&lab.0, "/verdicts?since=later").0, 400);
    let before = verdicts(&lab.0)["events"].clone();

    // A restart keeps the history and repeats no alert.
    obs.restart_collector();
    wait_for(
        "windows judged after the restart",
        Duration::from_secs(20),
        || verdicts(&lab.0)["windows"].as_u64().unwrap() >= 8,
    );
    let after = verdicts(&lab.0);
    assert_eq!(after["events"], before, "the history after the restart");
    for c in checks {
        assert!(
            matches!(status(&lab.0, c).as_deref(), Some("pass" | "skip")),
            "{c} after the restart: {:?}",
            status(&lab.0, c)
        );
    }
    assert_eq!(got.lock().unwrap().len(), 2, "{:#?}", got.lock().unwrap());

    // verify --since: the failure, when it began and when it ended.
    let out = verify(&lab.0, &["--collector-http", HTTP, "--since", "10m"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = text.lines().filter(|l| l.starts_with("data_class ")).collect();
    assert_eq!(lines.len(), 1, "{text}");
    assert!(
        lines.iter().all(|l| l.contains("FAIL") && !l.contains("still")),
        "{text}"
    );
    let out = verify(
        &lab.0,
        &["--collector-http", HTTP, "--since", "10m", "--json-stdout"],
    );
    let j: Value = serde_json::from_slice(&out.stdout).unwrap();
    let s: Vec<&Value> = j["stretches"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["check"] == "data_class")
        .collect();
    assert_eq!(s.len(), 1, "{j:#}");
    let (from, until) = (
        s[0]["from_ms"].as_u64().unwrap(),
        s[0]["until_ms"].as_u64().unwrap(),
    );
    assert!(from >= fault_at && from < clear_at && until >= clear_at, "{j:#}");
    // Nothing failed in the last second.
    let out = verify(&lab.0, &["--collector-http", HTTP, "--since", "1s"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    eprintln!(
        "{}",
        obs.collector_log()
            .lines()
            .filter(|l| l.contains("verdict"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    obs.stop();
}
