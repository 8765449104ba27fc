//! What a user sees when something is wrong: a clear error and a non-zero exit.

use std::process::Command;

use roce_trace_tests::*;

fn run(args: &[&str]) -> (i32, String) {
    let out = Command::new(roce_trace_bin()).args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn unknown_interface_is_named() {
    if !require_root() {
        return;
    }
    let (code, err) = run(&["capture", "-i", "nosuch0", "--duration", "1s"]);
    assert_eq!(code, 1);
    assert!(err.contains("unknown interface `nosuch0`"), "{err}");
}

#[test]
fn bad_flags_are_rejected_before_anything_loads() {
    let (code, err) = run(&["capture", "-i", "lo", "--expect-dscp", "26,99"]);
    assert_eq!(code, 2);
    assert!(err.contains("99"), "{err}");
    let (code, err) = run(&["capture", "-i", "lo", "--duration", "soon"]);
    assert_eq!(code, 2);
    assert!(err.contains("--duration"), "{err}");
    let (code, err) = run(&["capture"]);
    assert_eq!(code, 2);
    assert!(err.contains("--interface"), "{err}");
    let (code, err) = run(&[
        "capture",
        "-i",
        "lo",
        "--ingress-hook",
        "tc",
        "--xdp-mode",
        "native",
    ]);
    assert_ne!(code, 0);
    assert!(err.contains("--xdp-mode applies to XDP"), "{err}");
}

#[test]
fn missing_privileges_say_what_is_needed() {
    // Drop every capability, staying uid 0 (so the binary stays reachable under /root).
    let out = Command::new("setpriv")
        .args(["--inh-caps=-all", "--bounding-set=-all"])
        .arg(roce_trace_bin())
        .args(["capture", "-i", "lo", "--duration", "1s"])
        .output()
        .expect("setpriv (util-linux)");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("missing privileges") && err.contains("CAP_BPF"),
        "{err}"
    );
}

#[test]
fn a_zero_interval_is_refused() {
    if !require_root() {
        return;
    }
    let (code, err) = run(&["capture", "-i", "lo", "--interval", "0s"]);
    assert_eq!(code, 1);
    assert!(err.contains("--interval must be longer than zero"), "{err}");
}

#[test]
fn an_rdma_nic_interface_is_called_out() {
    if !require_root() {
        return;
    }
    // A sysfs where `lo` belongs to an RDMA device.
    let dir = TempDir::new("sysfs");
    std::fs::create_dir_all(dir.path("class/infiniband/mlx5_0/device/net/lo")).unwrap();
    let out = std::process::Command::new(roce_trace_bin())
        .args(["capture", "-i", "lo", "--duration", "1s", "--json"])
        .env("ROCE_TRACE_SYSFS", &dir.0)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("lo belongs to RDMA device mlx5_0") && err.contains("never reach XDP or TC"),
        "{err}"
    );
}

/// A token file others can read is refused, the error naming the fix (as ssh refuses a
/// private key others can read);
/// one only its owner reads is taken.
#[test]
fn a_token_file_others_can_read_is_refused() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = TempDir::new("token-perms");
    let f = dir.path("token");
    std::fs::write(&f, "tk\n").unwrap();
    let f = f.to_str().unwrap();
    let collect = || {
        run(&[
            "collect",
            "--listen",
            "127.0.0.1:0",
            "--token-file",
            f,
            "--duration",
            "1s",
        ])
    };
    for mode in [0o644, 0o640, 0o604] {
        std::fs::set_permissions(f, std::fs::Permissions::from_mode(mode)).unwrap();
        let (code, err) = collect();
        assert_ne!(code, 0, "mode {mode:o}");
        assert!(
            err.contains("can be read by others") && err.contains("chmod 600"),
            "{err}"
        );
    }
    std::fs::set_permissions(f, std::fs::Permissions::from_mode(0o600)).unwrap();
    let (code, err) = collect();
    assert_eq!(code, 0, "{err}");
}

/// Endpoints that tell the world this host's traffic, or accept agents, are not opened
/// carelessly: agent metrics beyond loopback need a bearer token file; a collector needs a
/// token or TLS certificates; TLS files come in threes; a private key others can read is
/// refused. Each fails without its check (the agent would start serving, the collector
/// would take anyone).
#[test]
fn open_endpoints_need_credentials() {
    let (code, err) = run(&[
        "agent",
        "--collector",
        "127.0.0.1:1",
        "-i",
        "lo",
        "--token",
        "t",
        "--metrics",
        "0.0.0.0:9464",
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("--metrics-token-file"), "{err}");
    let (code, err) = run(&[
        "collect",
        "--listen",
        "127.0.0.1:0",
        "--quiet",
        "--duration",
        "1s",
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("a token is required") || err.contains("TLS certificates"),
        "{err}"
    );
    let (code, err) = run(&["collect", "--tls-cert", "c.pem", "--quiet"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--tls-key") && err.contains("--tls-ca"), "{err}");
    let dir = TempDir::new("cli-tls");
    let certs = || {
        run(&[
            "certs",
            "--out",
            &dir.0.to_string_lossy(),
            "--collector-name",
            "127.0.0.1",
        ])
    };
    let (code, err) = certs();
    assert_eq!(code, 0, "{err}");
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(dir.path("collector.key"), std::fs::Permissions::from_mode(0o640)).unwrap();
    let p = |f: &str| dir.path(f).to_string_lossy().into_owned();
    let (code, err) = run(&[
        "collect",
        "--listen",
        "127.0.0.1:0",
        "--tls-cert",
        &p("collector.pem"),
        "--tls-key",
        &p("collector.key"),
        "--tls-ca",
        &p("ca.pem"),
        "--quiet",
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("can be read by others"), "{err}");
    // `certs` never overwrites.
    let (code, err) = certs();
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("never overwritten"), "{err}");
}

/// Outputs written as root are never written through a symbolic link planted at their
/// path: `capture -w` refuses one (saying so) and leaves its target as it was; `verify
/// --json`/`--junit` replace the link with the file. Fails if either writes through the
/// link (the target is overwritten).
#[test]
fn outputs_are_never_written_through_a_symbolic_link() {
    let dir = TempDir::new("cli-links");
    let target = dir.path("precious");
    std::fs::write(&target, b"precious").unwrap();
    let pcap = dir.path("in.pcap");
    write_pcap(&pcap, &[roce_trace_gen::frame::RoceFrame::default().build()]);
    let link = dir.path("out.json");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let (code, err) = run(&[
        "capture",
        "-r",
        &pcap.to_string_lossy(),
        "-w",
        &link.to_string_lossy(),
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("is a symbolic link"), "{err}");
    assert_eq!(std::fs::read(&target).unwrap(), b"precious");
    // verify over a saved report, its verdict to the link: the link is replaced.
    let report = std::path::PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/golden/collector-report-http.json"
    ));
    let policy = dir.path("p.toml");
    std::fs::write(&policy, "[class]\ndata_dscp = 26\n").unwrap();
    let (_, err) = run(&[
        "verify",
        "--policy",
        &policy.to_string_lossy(),
        "--report",
        &report.to_string_lossy(),
        "--json",
        &link.to_string_lossy(),
    ]);
    assert_eq!(std::fs::read(&target).unwrap(), b"precious", "{err}");
    assert!(
        !std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink(),
        "{err}"
    );
}

/// Continuous verification's flags and files: refused with the reason before anything is
/// collected, and a broken history is left as it was.
#[test]
fn continuous_verification_flags_and_files_are_checked_before_collecting() {
    let dir = TempDir::new("cli-continuous");
    let policy = dir.path("p.toml");
    std::fs::write(&policy, "[class]\ndata_dscp = 26\n").unwrap();
    let token = dir.path("token");
    std::fs::write(&token, "t\n").unwrap();
    std::fs::set_permissions(&token, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let history = dir.path("h.jsonl");
    let (p, t, h, r) = (
        policy.to_str().unwrap(),
        token.to_str().unwrap(),
        history.to_str().unwrap(),
        dir.path("r.json"),
    );
    let r = r.to_str().unwrap();
    let collect = |extra: &[&str]| {
        let mut a = vec![
            "collect",
            "--quiet",
            "--listen",
            "127.0.0.1:0",
            "--token-file",
            t,
            "--report",
            r,
            "--duration",
            "1s",
        ];
        a.extend_from_slice(extra);
        run(&a)
    };
    let (code, err) = collect(&["--verify-every", "1s"]);
    assert_eq!(code, 2);
    assert!(err.contains("--policy"), "{err}");
    let (code, err) = collect(&[
        "--policy",
        p,
        "--verify-every",
        "2s",
        "--verify-window",
        "1s",
        "--verdict-history",
        h,
    ]);
    assert_ne!(code, 0);
    assert!(
        err.contains("--verify-window (1s) must be at least --verify-every (2s)"),
        "{err}"
    );
    let (code, err) = collect(&[
        "--policy",
        p,
        "--verify-every",
        "1s",
        "--verify-window",
        "11s",
        "--verdict-history",
        h,
    ]);
    assert_ne!(code, 0);
    assert!(err.contains("at most 10 times"), "{err}");
    let (code, err) = collect(&["--policy", p, "--fail-after", "0", "--verdict-history", h]);
    assert_ne!(code, 0);
    assert!(err.contains("--fail-after must be at least 1"), "{err}");
    let (code, err) = collect(&[
        "--policy",
        p,
        "--alert-url",
        "https://alerts.example/x",
        "--verdict-history",
        h,
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("https is not supported"), "{err}");
    let bad = dir.path("bad.toml");
    std::fs::write(&bad, "[class]\ndata_dscp = 99\n").unwrap();
    let (code, err) = collect(&["--policy", bad.to_str().unwrap(), "--verdict-history", h]);
    assert_ne!(code, 0);
    assert!(err.contains("99") && err.contains("line 2"), "{err}");
    // A history that is not one: named with its line, and left as it was.
    let text = "{\"type\":\"verdict_change\",\"seq\":1,\"at_ms\":1,\"window\":{\"start_ms\":0,\"end_ms\":1},\"flows\":0,\"changes\":[]}\nnot json\n";
    std::fs::write(&history, text).unwrap();
    let (code, err) = collect(&["--policy", p, "--verdict-history", h]);
    assert_ne!(code, 0);
    assert!(
        err.contains(&format!("{h}:2:")) && err.contains("move the file aside"),
        "{err}"
    );
    assert_eq!(std::fs::read_to_string(&history).unwrap(), text);
    // A good one is taken, and the collector runs.
    std::fs::write(&history, text.lines().next().unwrap().to_owned() + "\n").unwrap();
    let (code, err) = collect(&["--policy", p, "--verdict-history", h]);
    assert_eq!(code, 0, "{err}");
    // verify --since needs a collector, and one that judges.
    let (code, err) = run(&["verify", "--since", "1h"]);
    assert_eq!(code, 2);
    assert!(err.contains("--collector-http"), "{err}");
    let (code, err) = run(&[
        "verify",
        "--since",
        "1h",
        "--collector-http",
        "127.0.0.1:9",
        "--report",
        r,
    ]);
    assert_eq!(code, 2, "{err}");
}

/// `verify --since` against a collector that does not judge says so.
#[test]
fn verify_since_asks_a_collector_that_judges() {
    let dir = TempDir::new("cli-since");
    let token = dir.path("token");
    std::fs::write(&token, "t\n").unwrap();
    std::fs::set_permissions(&token, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let http = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let c = Proc::spawn(
        Command::new(roce_trace_bin())
            .args([
                "collect",
                "--quiet",
                "--listen",
                "127.0.0.1:0",
                "--http",
                &http,
                "--token-file",
            ])
            .arg(&token)
            .arg("--report")
            .arg(dir.path("r.json"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null()),
    );
    let t = std::time::Instant::now();
    while roce_trace::http::get(http.parse().unwrap(), "/stats", std::time::Duration::from_secs(2)).is_err() {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(20),
            "the collector did not start"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let (code, err) = run(&["verify", "--since", "1h", "--collector-http", &http]);
    assert_ne!(code, 0);
    assert!(err.contains("continuous verification is off"), "{err}");
    let (s, body) = roce_trace::http::get(
        http.parse().unwrap(),
        "/verdicts",
        std::time::Duration::from_secs(2),
    )
    .unwrap();
    assert_eq!(s, 404, "{}", String::from_utf8_lossy(&body));
    c.interrupt();
}
