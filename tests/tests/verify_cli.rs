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
