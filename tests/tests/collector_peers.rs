//! The collector's agent listener against peers that are not agents: what they can make
//! it hold before they are authenticated, and that it goes on serving.

use std::{
    io::{BufRead, BufReader, Write},
    net::{SocketAddr, TcpStream},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use roce_trace_tests::*;

/// A collector on loopback: the process, its agent listener and its HTTP API.
fn collector() -> (Proc, SocketAddr, SocketAddr) {
    collector_with(&[])
}

fn collector_with(args: &[&str]) -> (Proc, SocketAddr, SocketAddr) {
    let mut c = Proc::spawn(
        Command::new(roce_trace_bin())
            .args(["collect", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0"])
            .args(args)
            .env("ROCE_TRACE_TOKEN", "the-token")
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped()),
    );
    let mut lines = BufReader::new(c.stderr.take().unwrap()).lines();
    let (listen, http) = loop {
        let l = lines.next().expect("collector exited").unwrap();
        if let Some(rest) = l.split("collecting on ").nth(1) {
            let (a, h) = rest.split_once(", API on http://").unwrap();
            break (
                a.trim().parse().unwrap(),
                h.trim_end_matches("/flows").parse().unwrap(),
            );
        }
    };
    std::thread::spawn(move || lines.for_each(drop));
    (c, listen, http)
}

fn rss_kib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap()
}

fn metric(http: SocketAddr, name: &str) -> f64 {
    let (_, body) = roce_trace::http::get(http, "/metrics", Duration::from_secs(10)).unwrap();
    let body = String::from_utf8(body).unwrap();
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} not in /metrics"))
}

/// 1,000 connections, none of them an agent, made at once: 500 announce a frame of almost
/// 4 MiB and send 2 MiB of it; then 500 announce the largest HELLO and send 120 KiB of it,
/// and stall. The collector refuses the first kind from their first four bytes, lets 64
/// handshakes at most wait, refuses the rest at once, and ends the waiting ones at the
/// handshake deadline; it never holds more than a bound: 32 MiB more resident, measured
/// while the stalled ones wait (64 × a HELLO's 128 KiB is 8 MiB; the rest is slack for
/// sockets and the allocator). Without the HELLO limit the first 64 held 2 MiB each;
/// without the cap on handshakes all 500 stalled ones held 120 KiB each.
#[test]
fn unauthenticated_peers_cannot_make_the_collector_hold_their_frames() {
    let (c, listen, http) = collector();
    let before = rss_kib(c.id());
    let junk = vec![0u8; 2 << 20];
    let mut held = Vec::new();
    let t = Instant::now();
    for k in 0..1000 {
        let mut s = TcpStream::connect(listen).unwrap();
        s.set_write_timeout(Some(Duration::from_secs(1))).unwrap();
        let (len, send) = if k < 500 {
            ((4u32 << 20) - 8, &junk[..])
        } else {
            ((roce_trace::protocol::MAX_HELLO - 4) as u32, &junk[..120 << 10])
        };
        // Refused connections fail these writes: what matters is what the collector kept.
        let _ = s.write_all(&len.to_be_bytes());
        let _ = s.write_all(send);
        held.push(s);
    }
    std::thread::sleep(Duration::from_millis(300));
    let grew = rss_kib(c.id()).saturating_sub(before);
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "measured before the handshake deadline ({:?})",
        t.elapsed()
    );
    assert!(
        grew < 32 * 1024,
        "the collector grew by {grew} KiB for 1,000 junk connections"
    );
    // Every one refused, the stalled ones at the handshake deadline; and it still answers.
    let deadline = Instant::now() + Duration::from_secs(30);
    while metric(http, "roce_trace_collector_refused_connections_total") < 1000.0 {
        assert!(Instant::now() < deadline, "every junk connection refused");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        metric(http, "roce_trace_collector_refused_connections_total"),
        1000.0
    );
    drop(held);
    let status = c.interrupt();
    assert!(status.success(), "{status:?}");
}

/// A wrong token is refused whatever its length, and the refusal says so.
#[test]
fn a_wrong_token_is_refused_with_its_reason() {
    use roce_trace::protocol::{Decoder, Encoder, Frame, VERSION};
    let (c, listen, http) = collector();
    for token in ["the-tokem", "the-token-and-more", "", "x"] {
        let mut s = TcpStream::connect(listen).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let hello = Frame::Hello {
            version: VERSION,
            node: "n1".into(),
            token: token.into(),
            clock_synced: false,
        };
        s.write_all(&Encoder::default().encode(&hello).unwrap()).unwrap();
        let mut got = Vec::new();
        let _ = std::io::Read::read_to_end(&mut s, &mut got);
        let mut buf = bytes::BytesMut::from(&got[..]);
        match Decoder::handshake().decode(&mut buf) {
            Ok(Some(Frame::Bye { reason })) => assert!(reason.contains("wrong token"), "{reason}"),
            other => panic!("token {token:?}: {other:?}"),
        }
    }
    assert_eq!(
        metric(http, "roce_trace_collector_refused_connections_total"),
        4.0
    );
    assert!(c.interrupt().success());
}

/// The HTTP API serves beyond loopback only with a bearer token; with one, a request
/// without it, or with another, gets 401 and nothing else.
#[test]
fn the_api_beyond_loopback_needs_a_bearer_token() {
    use std::os::unix::fs::PermissionsExt as _;
    let out = Command::new(roce_trace_bin())
        .args([
            "collect",
            "--listen",
            "127.0.0.1:0",
            "--http",
            "0.0.0.0:0",
            "--duration",
            "1s",
        ])
        .env("ROCE_TRACE_TOKEN", "the-token")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--http-token-file"),
        "{err}"
    );

    let dir = TempDir::new("http-token");
    let f = dir.path("http-token");
    std::fs::write(&f, "bearer-secret\n").unwrap();
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
    let (c, _, http) = collector_with(&["--http-token-file", f.to_str().unwrap()]);
    let t = Duration::from_secs(10);
    for bearer in [
        None,
        Some("bearer-secreT"),
        Some("bearer-secret-and-more"),
        Some(""),
    ] {
        for path in [
            "/stats",
            "/flows",
            "/metrics",
            "/report",
            "/trace?id=x",
            "/ui/main",
            "/ui/flow?id=x",
            "/index.html",
        ] {
            let (status, body) = roce_trace::http::get_as(http, path, t, bearer).unwrap();
            assert_eq!(
                status,
                401,
                "{path} with {bearer:?}: {}",
                String::from_utf8_lossy(&body)
            );
        }
    }
    // The web view's page alone is served without the token: it holds no data (its
    // script asks for the token, then fetches the fragments with it).
    let (status, body) = roce_trace::http::get_as(http, "/", t, None).unwrap();
    let page = String::from_utf8_lossy(&body);
    assert_eq!(status, 200, "{page}");
    assert!(
        page.contains("<section id=\"main\"></section>") && !page.contains("<svg"),
        "{page}"
    );
    let (status, body) = roce_trace::http::get_as(http, "/ui/main", t, Some("bearer-secret")).unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let (status, body) = roce_trace::http::get_as(http, "/stats", t, Some("bearer-secret")).unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let stats: serde_json::Value =
        roce_trace::http::get_json_as(http, "/stats", Some("bearer-secret")).unwrap();
    assert_eq!(stats["flows"], 0);
    assert!(c.interrupt().success());
}

/// A collector killed mid-run (SIGKILL: no clean exit) leaves its last periodic report
/// whole and readable, with the flows it had; a report path it cannot write is refused
/// at start, before anything is collected.
#[test]
fn a_collector_killed_mid_run_leaves_its_last_report_readable() {
    use roce_trace::{
        observation::{FlowId, Observation, PacketId, PointDecl},
        protocol::{Encoder, Frame, VERSION},
    };
    let t = Instant::now();
    let out = Command::new(roce_trace_bin())
        .args([
            "collect",
            "--listen",
            "127.0.0.1:0",
            "--report",
            "/nonexistent/dir/r.json",
            "--duration",
            "10s",
        ])
        .env("ROCE_TRACE_TOKEN", "the-token")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("writing the report /nonexistent/dir/r.json"),
        "{err}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "refused at start, not at the end of its run"
    );

    let dir = TempDir::new("report-every");
    let path = dir.path("report.json");
    let (c, listen, http) = collector_with(&[
        "--report",
        path.to_str().unwrap(),
        "--report-every",
        "500ms",
        "--trajectory-timeout",
        "100ms",
    ]);
    let mut s = TcpStream::connect(listen).unwrap();
    let mut enc = Encoder::default();
    let flows = 3u32;
    let obs = (0..flows).map(|q| Observation {
        point: 0,
        time_ns: 1_000 + u64::from(q),
        id: PacketId {
            flow: FlowId {
                src: [10; 16],
                dst: [20; 16],
                ip_version: 6,
                udp_sport: 49152,
                dest_qp: 0x300 + q,
            },
            psn: 1,
            opcode: 7,
            icrc: [1, 2, 3, q as u8],
        },
        udp_dport: 4791,
        dscp: 26,
        ecn: 2,
        ttl: 64,
        reasons: roce_trace_common::datapath::REASON_HASH as u8,
        ..Default::default()
    });
    for f in [
        Frame::Hello {
            version: VERSION,
            node: "h1".into(),
            token: "the-token".into(),
            clock_synced: false,
        },
        Frame::Points(vec![PointDecl {
            index: 0,
            node: String::new(),
            iface: "eth0".into(),
            ifindex: 2,
            mtu: 0,
            direction: 1,
        }]),
        Frame::Observations(obs.collect()),
    ] {
        s.write_all(&enc.encode(&f).unwrap()).unwrap();
    }
    let read = || -> Option<serde_json::Value> { serde_json::from_slice(&std::fs::read(&path).ok()?).ok() };
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if read().is_some_and(|r| r["flows"].as_array().map(Vec::len) == Some(flows as usize)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the periodic report never had the flows: {:?}",
            read()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let stats: serde_json::Value = roce_trace::http::get_json(http, "/stats").unwrap();
    assert_eq!(stats["flows"], flows);
    c.signal(libc::SIGKILL);
    std::thread::sleep(Duration::from_millis(300));
    let r = read().expect("the report parses after the kill");
    assert_eq!(r["flows"].as_array().map(Vec::len), Some(flows as usize), "{r}");
    let left: Vec<_> = std::fs::read_dir(&dir.0)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left.len(), 1, "only the report, no temporary file: {left:?}");
    drop(s);
}
