//! `roce-trace verify` as a user meets it: bad policies and reports refused with where
//! and why (exit 2), no traffic is "could not check" (exit 3), and a one-host window from
//! this host's own interfaces judged pass or fail (exit 0 / 1).

use std::{process::Command, time::Duration};

use roce_trace_tests::*;
use serde_json::Value;

fn verify(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(roce_trace_bin())
        .arg("verify")
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const CLASS_POLICY: &str = "[class]\ndata_dscp = 26\n\n[ecn]\ndata_ect = true\n";

#[test]
fn a_bad_policy_is_refused_with_file_line_and_reason() {
    let dir = TempDir::new("verify-policy");
    let p = dir.path("fabric.toml");
    std::fs::write(&p, "[class]\ndata_dscp = 26\ncnp_dscp = 64\n").unwrap();
    let report = dir.path("r.json");
    std::fs::write(&report, "{}").unwrap();
    let (code, _, err) = verify(&[
        "--policy",
        p.to_str().unwrap(),
        "--report",
        report.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("fabric.toml") && err.contains("line 3") && err.contains("DSCP (0..=63)"),
        "{err}"
    );

    std::fs::write(
        &p,
        "[class]\ndata_dscp = 26\n\n[ecmp]\nvia = [\"s1\", \"s2\"]\nmax_shar = 0.5\n",
    )
    .unwrap();
    let (code, _, err) = verify(&[
        "--policy",
        p.to_str().unwrap(),
        "--report",
        report.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("line 6") && err.contains("max_shar"), "{err}");

    let (code, _, err) = verify(&[
        "--policy",
        dir.path("none.toml").to_str().unwrap(),
        "--report",
        "x",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("reading the policy"), "{err}");
}

#[test]
fn broken_reports_and_flags_are_refused() {
    let dir = TempDir::new("verify-report");
    let p = dir.path("fabric.toml");
    std::fs::write(&p, CLASS_POLICY).unwrap();
    let policy = p.to_str().unwrap();
    let r = dir.path("r.json");
    for (text, why) in [
        ("{\"type\": \"coll", "is not a roce-trace collector report"),
        ("[1, 2]", "is not a roce-trace collector report"),
    ] {
        std::fs::write(&r, text).unwrap();
        let (code, _, err) = verify(&["--policy", policy, "--report", r.to_str().unwrap()]);
        assert_eq!(code, 2, "{err}");
        assert!(err.contains(why), "{err}");
    }
    let (code, _, err) = verify(&[
        "--policy",
        policy,
        "--report",
        dir.path("missing.json").to_str().unwrap(),
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("reading the report"), "{err}");
    // A source is required, and a drill needs a live one.
    let (code, _, err) = verify(&["--policy", policy]);
    assert_eq!(code, 2);
    assert!(
        err.contains("--report") && err.contains("--collector-http"),
        "{err}"
    );
    std::fs::write(&r, EMPTY).unwrap();
    let (code, _, err) = verify(&["--policy", policy, "--report", r.to_str().unwrap(), "--drill"]);
    assert_eq!(code, 2);
    assert!(err.contains("--drill needs a live window"), "{err}");
    let (code, _, err) = verify(&[
        "--policy",
        policy,
        "--collector-http",
        "127.0.0.1:1",
        "--window",
        "1s",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("connecting to 127.0.0.1:1"), "{err}");
}

const EMPTY: &str = r#"{"type":"collector_report","stats":{"observations":0,"probe_observations":0,"duplicates":0,"trajectories":0,"retransmissions":0,"pending_dropped":0,"flows_expired":0,"flows_refused":0,"pending":0,"flows":0},"refused_connections":0,"agents":[],"points":[],"flows":[],"anomalies":[]}"#;

#[test]
fn no_traffic_is_could_not_check() {
    let dir = TempDir::new("verify-empty");
    std::fs::write(dir.path("p.toml"), CLASS_POLICY).unwrap();
    std::fs::write(dir.path("r.json"), EMPTY).unwrap();
    let junit = dir.path("j.xml");
    // The report arrives on stdin, as from `curl …/report | roce-trace verify --report -`.
    let mut child = Proc::spawn(
        Command::new(roce_trace_bin())
            .args([
                "verify",
                "--policy",
                dir.path("p.toml").to_str().unwrap(),
                "--report",
                "-",
            ])
            .args(["--junit", junit.to_str().unwrap()])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped()),
    );
    use std::io::Write;
    child.stdin.take().unwrap().write_all(EMPTY.as_bytes()).unwrap();
    let o = child.wait_with_output();
    let (code, out, err) = (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    );
    assert_eq!(code, 3, "{out}{err}");
    assert!(
        out.contains("NO DATA") && out.contains("no RDMA data flow seen"),
        "{out}"
    );
    let x = std::fs::read_to_string(junit).unwrap();
    assert_eq!(x.matches("<error type=\"no_data\"").count(), 2, "{x}");
}

/// verify -i on one host: a generator sends in DSCP `dscp`; the local window judges it.
fn local_window(dscp: u8) -> (i32, Value) {
    let pair = VethPair::new(&format!("vf{dscp}"));
    let dir = TempDir::new(&format!("verify-local-{dscp}"));
    std::fs::write(dir.path("p.toml"), CLASS_POLICY).unwrap();
    let json = dir.path("v.json");
    let verify = Proc::spawn(
        Command::new("ip")
            .args(["netns", "exec", &pair.a.name])
            .arg(roce_trace_bin())
            .args([
                "verify",
                "--policy",
                dir.path("p.toml").to_str().unwrap(),
                "-i",
                &pair.a_if,
            ])
            .args([
                "--window",
                "3s",
                "--sample-rate",
                "2",
                "--json",
                json.to_str().unwrap(),
            ])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped()),
    );
    std::thread::sleep(Duration::from_millis(800));
    let resp = spawn_gen(&pair.b.name, &["--bind", "10.99.0.2", "--duration", "3s"]);
    std::thread::sleep(Duration::from_millis(200));
    let d = dscp.to_string();
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
            "1500ms",
            "--dscp",
            &d,
        ],
    );
    gen_report(send);
    let out = verify.wait_with_output();
    interrupt(resp);
    let code = out.status.code().unwrap_or(-1);
    let v: Value = serde_json::from_str(
        &std::fs::read_to_string(&json)
            .unwrap_or_else(|_| panic!("no verdict: {}", String::from_utf8_lossy(&out.stderr))),
    )
    .unwrap();
    (code, v)
}

#[test]
fn a_local_window_judges_this_hosts_own_traffic() {
    if !require_root() {
        return;
    }
    let (code, v) = local_window(26);
    assert_eq!(code, 0, "{v:#}");
    assert_eq!(v["checks"][0]["check"], "data_class");
    assert_eq!(v["checks"][0]["checked"], 2, "{v:#}");
    let (code, v) = local_window(10);
    assert_eq!(code, 1, "{v:#}");
    let c = &v["checks"][0];
    assert_eq!(c["status"], "fail");
    assert_eq!(c["evidence"].as_array().unwrap().len(), 2, "{c:#}");
    assert!(
        c["evidence"][0]["detail"]
            .as_str()
            .unwrap()
            .contains("DSCP 10 (expected 26)")
    );
    assert_eq!(v["checks"][1]["status"], "pass", "ECT(0) data: {v:#}");
}

/// A collector's HTTP API as a drill sees it: the first `/report` has no flows, every
/// later one the golden report's (so data flowed "before the failure"); after `answers`
/// requests it stops answering (the collector host died).
fn fake_collector(answers: usize) -> std::net::SocketAddr {
    use std::io::{Read as _, Write as _};
    let golden: Value = serde_json::from_str(
        &std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("golden/collector-report-http.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let mut empty = golden.clone();
    empty["flows"] = Value::Array(Vec::new());
    let bodies = [empty.to_string(), golden.to_string()];
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for k in 0..answers {
            let Ok((mut c, _)) = l.accept() else { return };
            let mut req = Vec::new();
            let mut buf = [0u8; 1024];
            while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                match c.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => req.extend_from_slice(&buf[..n]),
                }
            }
            let body = &bodies[usize::from(k > 0)];
            let _ = write!(
                c,
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    addr
}

/// `verify --drill` against `collector`, `--down`/`--up` given; (exit code, stderr) once
/// it ends, with `during` run once `--down` has begun (its marker file exists).
fn drill_with(
    collector: std::net::SocketAddr,
    dir: &TempDir,
    down: &str,
    extra: &[&str],
    during: impl FnOnce(u32),
) -> (i32, String) {
    let policy = dir.path("fabric.toml");
    std::fs::write(&policy, CLASS_POLICY).unwrap();
    let up = format!("touch {}", dir.path("up").display());
    let c = Command::new(roce_trace_bin())
        .args(["verify", "--policy", policy.to_str().unwrap(), "--collector-http"])
        .arg(collector.to_string())
        .args(["--drill", "--hold", "1s", "--down", down, "--up", &up])
        .args(extra)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !dir.path("down").exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(dir.path("down").exists(), "--down never began");
    during(c.id());
    let out = c.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A drill always repairs: whatever stops it once `--down` has begun — SIGTERM or Ctrl-C
/// while the fabric is broken, `--down` failing or hanging past `--drill-timeout`, the
/// collector going away — `--up` runs, what `--down` started is killed, and the drill
/// says it repaired the failure and fails.
#[test]
fn a_drill_always_repairs_whatever_stops_it() {
    let started = std::time::Instant::now();
    for (name, down_tail, answers, signal, extra) in [
        (
            "sigterm",
            "sleep 30; touch {late}",
            100,
            Some(libc::SIGTERM),
            &[][..],
        ),
        (
            "sigint",
            "sleep 30; touch {late}",
            100,
            Some(libc::SIGINT),
            &[][..],
        ),
        ("down fails", "exit 3", 100, None, &[][..]),
        (
            "down hangs",
            "sleep 30; touch {late}",
            100,
            None,
            &["--drill-timeout", "1s"][..],
        ),
        ("collector gone", "true", 2, None, &[][..]),
    ] {
        let dir = TempDir::new("verify-drill-repair");
        let late = dir.path("late");
        let down = format!(
            "touch {}; {}",
            dir.path("down").display(),
            down_tail.replace("{late}", late.to_str().unwrap())
        );
        let (code, err) = drill_with(fake_collector(answers), &dir, &down, extra, |pid| {
            if let Some(sig) = signal {
                std::thread::sleep(Duration::from_millis(300));
                // SAFETY: a signal to the child this test started.
                unsafe { libc::kill(pid as i32, sig) };
            }
        });
        assert_eq!(code, 2, "{name}: the drill stopped without a verdict\n{err}");
        assert!(dir.path("up").exists(), "{name}: --up ran\n{err}");
        assert!(
            err.contains("repaired with --up") && err.contains("repair it: `touch"),
            "{name}: says it repaired\n{err}"
        );
        std::thread::sleep(Duration::from_millis(100));
        let left = Command::new("pgrep")
            .args(["-f", dir.path("late").to_str().unwrap()])
            .output()
            .unwrap();
        assert!(
            left.stdout.is_empty() && !late.exists(),
            "{name}: what --down started was killed: {}\n{err}",
            String::from_utf8_lossy(&left.stdout)
        );
        match name {
            "sigterm" => assert!(err.contains("SIGTERM during the failure"), "{err}"),
            "sigint" => assert!(err.contains("SIGINT during the failure"), "{err}"),
            "down fails" => assert!(err.contains("failed (exit status: 3"), "{err}"),
            "down hangs" => assert!(err.contains("timed out after 1."), "{err}"),
            _ => assert!(
                err.contains("fetching the report") || err.contains("127.0.0.1"),
                "{err}"
            ),
        }
    }
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "nothing waited for --down's 30 s"
    );
}
