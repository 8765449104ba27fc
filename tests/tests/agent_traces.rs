//! A collector can ask an agent to trace a flow: the agent then sends probes into the
//! fabric from its host. A collector (or whoever holds its connection) must not be able to
//! aim them: the agent traces only flows it saw its host send, with the class it saw them
//! leave with. A real agent on a veth pair, a scripted collector speaking the protocol.

use std::{
    io::{Read, Write},
    net::TcpListener,
    time::{Duration, Instant},
};

use bytes::BytesMut;
use roce_trace::protocol::{Decoder, Encoder, Frame, ProbeResult, VERSION};
use roce_trace_common::flow::FlowId;
use roce_trace_gen::frame::RoceFrame;
use roce_trace_tests::*;

/// What the scripted collector saw.
struct Seen {
    /// Trace results by request id.
    results: Vec<ProbeResult>,
}

/// Accepts the agent, welcomes it, waits for an observation of the flow with UDP source
/// port `sport` (the agent's host sent it), then asks for two traces: (1) a flow from the
/// same host it never sent, with the data class; (2) the sent flow, asking for DSCP 0 and
/// Not-ECT. Reads until the second's result and 3 s more.
fn scripted_collector(listener: TcpListener, sport: u16) -> Seen {
    let (mut sock, _) = listener.accept().unwrap();
    sock.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    let mut dec = Decoder::handshake();
    let mut enc = Encoder::default();
    let mut buf = BytesMut::new();
    // Within the agent's 20 s patience with a collector that sends no HEARTBEAT.
    let deadline = Instant::now() + Duration::from_secs(15);
    let next = |sock: &mut std::net::TcpStream, dec: &mut Decoder, buf: &mut BytesMut| -> Option<Frame> {
        loop {
            if let Some(f) = dec.decode(buf).unwrap() {
                return Some(f);
            }
            assert!(Instant::now() < deadline, "the agent went quiet");
            let mut chunk = [0u8; 65536];
            match sock.read(&mut chunk) {
                Ok(0) => panic!("the agent closed the connection"),
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return None;
                }
                Err(e) => panic!("reading the agent: {e}"),
            }
        }
    };
    let hello = loop {
        if let Some(f) = next(&mut sock, &mut dec, &mut buf) {
            break f;
        }
    };
    assert!(matches!(hello, Frame::Hello { .. }), "{hello:?}");
    dec.authenticated();
    let welcome = Frame::Welcome {
        version: VERSION,
        connection: 1,
        previous: 0,
        previous_frames: 0,
    };
    sock.write_all(&enc.encode(&welcome).unwrap()).unwrap();
    // The sent flow, as the agent observed it.
    let sent: FlowId = loop {
        if let Some(Frame::Observations(obs)) = next(&mut sock, &mut dec, &mut buf)
            && let Some(o) = obs.iter().find(|o| o.id.flow.udp_sport == sport)
        {
            break o.id.flow;
        }
    };
    let never = FlowId {
        udp_sport: sport + 1,
        dest_qp: sent.dest_qp + 1,
        ..sent
    };
    for (id, flow, dscp, ecn) in [(1, never, 26, 2), (2, sent, 0, 0)] {
        let f = Frame::TraceRequest { id, flow, dscp, ecn };
        sock.write_all(&enc.encode(&f).unwrap()).unwrap();
    }
    let mut results = Vec::new();
    let mut until = deadline;
    while Instant::now() < until {
        if let Some(Frame::TraceResult(r)) = next(&mut sock, &mut dec, &mut buf) {
            if r.id == 2 {
                until = Instant::now() + Duration::from_secs(3);
            }
            results.push(r);
        }
    }
    Seen { results }
}

/// The agent traces a flow its host sent with the class it left with (DSCP 26, ECT(0)),
/// not the class asked for (0, Not-ECT); a flow from the same address it never sent is
/// refused and counted. Fails if the agent takes the request's class (the hops quote DSCP
/// 0) or traces any flow asked for (a result for request 1).
#[test]
fn an_agent_traces_only_flows_it_sent_with_the_class_they_left_with() {
    if !require_root() {
        return;
    }
    traced_by_an_agent("atr", &[]);
}

/// The capabilities the shipped systemd unit gives the agent (its AmbientCapabilities).
fn unit_capabilities() -> Vec<String> {
    let unit = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../dist/roce-trace-agent.service"
    ))
    .unwrap();
    let line = unit
        .lines()
        .find_map(|l| l.strip_prefix("AmbientCapabilities="))
        .expect("the unit sets AmbientCapabilities");
    line.split_whitespace()
        .map(|c| c.trim_start_matches("CAP_").to_lowercase())
        .collect()
}

/// The agent as the shipped unit runs it: an unprivileged user (nobody) holding only the
/// unit's capabilities (setpriv, as systemd's AmbientCapabilities= does). It attaches,
/// streams, answers a trace — and, once attached, holds CAP_NET_RAW alone (the traces'
/// raw socket). Fails if the unit lacks a capability the agent needs (CAP_NET_RAW was
/// missing: every trace failed), or if the agent keeps what it no longer needs.
#[test]
fn an_agent_under_the_shipped_units_capabilities_attaches_streams_and_traces() {
    if !require_root() {
        return;
    }
    let caps: Vec<String> = unit_capabilities().iter().map(|c| format!("+{c}")).collect();
    let caps = caps.join(",");
    let inh = format!("--inh-caps=-all,{caps}");
    let amb = format!("--ambient-caps={caps}");
    let bound = format!("--bounding-set=-all,{caps}");
    let wrapper = [
        "setpriv",
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        &inh,
        &amb,
        &bound,
    ];
    traced_by_an_agent("aup", &wrapper);
}

fn traced_by_an_agent(tag: &str, wrapper: &[&str]) {
    let pair = VethPair::new(tag);
    let sport = 49_500;
    let listener = pair.b.run(|| TcpListener::bind("10.99.0.2:4792").unwrap());
    let collector = std::thread::spawn(move || scripted_collector(listener, sport));
    let agent = Daemon::start_under(
        &pair.a.name,
        wrapper,
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
            "--metrics",
            "127.0.0.1:9464",
        ],
        "connected to collector",
    );
    // RDMA writes from this host, DSCP 26 and ECT(0), out of its veth (TC egress).
    let frames: Vec<Vec<u8>> = (0..20)
        .map(|psn| {
            RoceFrame {
                src: "10.99.0.1".parse().unwrap(),
                dst: "10.99.0.2".parse().unwrap(),
                udp_sport: sport,
                dest_qp: 0x200,
                psn,
                dscp: 26,
                ecn: 0b10,
                payload: vec![7; 256],
                ..Default::default()
            }
            .build()
        })
        .collect();
    let a_if = pair.a_if.clone();
    pair.a.run(move || send_frames(&a_if, &frames));
    let seen = collector.join().unwrap();
    // What the agent holds once attached: CAP_NET_RAW alone (on this kernel: ≥ 6.5, tcx),
    // and the user it was started as.
    let status = std::fs::read_to_string(format!("/proc/{}/status", agent.child.id())).unwrap();
    let field = |k: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(k))
            .unwrap_or_else(|| panic!("{k}: {status}"))
            .trim()
            .to_owned()
    };
    assert_eq!(
        field("CapEff:"),
        "0000000000002000",
        "CAP_NET_RAW alone: {status}"
    );
    assert_eq!(field("CapPrm:"), "0000000000002000", "{status}");
    assert_eq!(field("CapAmb:"), "0000000000000000", "{status}");
    assert_eq!(field("NoNewPrivs:"), "1");
    let want_uid = if wrapper.is_empty() { "0" } else { "65534" };
    assert_eq!(
        field("Uid:").split_whitespace().next(),
        Some(want_uid),
        "{status}"
    );
    let (_, metrics) = pair.a.run(|| {
        roce_trace::http::get(
            "127.0.0.1:9464".parse().unwrap(),
            "/metrics",
            Duration::from_secs(10),
        )
        .unwrap()
    });
    let metrics = String::from_utf8(metrics).unwrap();
    let log = agent.stderr.lock().unwrap().clone();
    agent.stop();

    let ids: Vec<u32> = seen.results.iter().map(|r| r.id).collect();
    assert_eq!(ids, [2], "only the sent flow is traced: {log}");
    let r = &seen.results[0];
    assert!(r.reached, "{r:?}");
    let last = r.hops.last().expect("hops");
    assert_eq!(last.addr, Some("10.99.0.2".parse().unwrap()), "{r:?}");
    // The destination quotes the probe as it arrived: the class the flow left with.
    assert_eq!((last.dscp, last.ecn), (Some(26), Some(0b10)), "{r:?}");
    for (outcome, n) in [
        ("traced", 1),
        ("unseen", 1),
        ("failed", 0),
        ("budget", 0),
        ("busy", 0),
    ] {
        let series = format!("roce_trace_trace_requests_total{{outcome=\"{outcome}\"}} {n}");
        assert!(metrics.lines().any(|l| l == series), "{series}: {metrics}");
    }
    assert!(
        log.contains("refused (this host has not sent that flow lately)"),
        "{log}"
    );
}
