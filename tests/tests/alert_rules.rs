//! The Prometheus alerting rules that ship (dist/roce-trace-alerts.yml): valid for
//! Prometheus's own `promtool`, firing as they should on series shaped as the collector
//! exports them (tests/alerts.test.yml), and querying only metric and label names a
//! running collector with continuous verification really exports.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use roce_trace_tests::*;

fn dist(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../dist").join(name)
}

fn promtool(args: &[&str], dir: &Path) -> String {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("promtool ({e}): scripts/setup installs Debian's prometheus package"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?}:\n{text}");
    text
}

#[test]
fn the_rules_are_valid_and_fire_as_written() {
    let t = promtool(
        &["check", "rules", dist("roce-trace-alerts.yml").to_str().unwrap()],
        Path::new("."),
    );
    assert!(t.contains("SUCCESS: 6 rules found"), "{t}");
    let t = promtool(
        &["test", "rules", "alerts.test.yml"],
        Path::new(env!("CARGO_MANIFEST_DIR")),
    );
    assert!(t.contains("SUCCESS"), "{t}");
}

/// A collector judging continuously (no agents: the families are exported all the same,
/// named in `/metrics` without series): every name and label the rules use is there.
#[test]
fn the_rules_query_only_what_the_collector_exports() {
    let dir = TempDir::new("alert-rules");
    let policy = dir.path("policy.toml");
    std::fs::write(&policy, "[class]\ndata_dscp = 26\nno_change = true\n").unwrap();
    let token = dir.path("token");
    std::fs::write(&token, "alert-rules-token\n").unwrap();
    std::fs::set_permissions(&token, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let http = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let listen = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let (http_s, listen_s) = (http.to_string(), listen.to_string());
    let report = dir.path("report.json");
    let history = dir.path("verdicts.jsonl");
    let mut c = Proc::spawn(
        Command::new(roce_trace_bin())
            .args(["collect", "--quiet", "--listen", &listen_s, "--http", &http_s])
            .arg("--token-file")
            .arg(&token)
            .arg("--report")
            .arg(&report)
            .arg("--policy")
            .arg(&policy)
            .args(["--verify-every", "200ms", "--verify-window", "400ms"])
            .arg("--verdict-history")
            .arg(&history)
            .args(["--alert-url", "http://127.0.0.1:9/hook"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null()),
    );
    let t = Instant::now();
    let text = loop {
        match roce_trace::http::get(http, "/metrics", Duration::from_secs(5)) {
            Ok((200, body)) => {
                let text = String::from_utf8(body).unwrap();
                // A window judged: the judge runs.
                if text
                    .lines()
                    .any(|l| l.starts_with("roce_trace_verify_windows_total ") && !l.ends_with(" 0"))
                {
                    break text;
                }
            }
            _ if c.try_wait().unwrap().is_some() => panic!("the collector exited"),
            _ => {}
        }
        assert!(t.elapsed() < Duration::from_secs(20), "no window judged in 20 s");
        std::thread::sleep(Duration::from_millis(100));
    };
    c.interrupt();
    let names = promql::exported(&text);
    let rules = std::fs::read_to_string(dist("roce-trace-alerts.yml")).unwrap();
    let exprs = promql::rule_exprs(&rules);
    assert_eq!(exprs.len(), 6);
    promql::check_exprs(&exprs, &names).unwrap();
    // The check itself fails on a name the binary does not export.
    let wrong = vec!["roce_trace_verify_check_state{status=\"fail\"} == 1".to_string()];
    assert!(promql::check_exprs(&wrong, &names).is_err());
}
