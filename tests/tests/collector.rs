//! The collector under bad input: wrong tokens, garbage, truncated and out-of-order
//! frames, agents that vanish — each closes that connection with a reason while
//! everyone else keeps being served. Runs the real collector in-process on loopback.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    time::Duration,
};

use roce_trace::{
    collector::{self, CollectorOptions, CollectorReport},
    observation::{CounterDelta, Counts, FlowId, Observation, PacketId, PointDecl},
    protocol::{Encoder, Frame, VERSION},
};
use roce_trace_common::datapath::REASON_HASH;
use roce_trace_correlate::JoinConfig;
use serde_json::Value;

struct Running {
    agents: SocketAddr,
    http: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    done: Option<std::thread::JoinHandle<CollectorReport>>,
}

impl Running {
    fn start() -> Self {
        Self::start_with(|_| {})
    }

    /// A collector with its options changed by `with` first.
    fn start_with(with: impl FnOnce(&mut CollectorOptions) + Send + 'static) -> Self {
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let (atx, arx) = std::sync::mpsc::channel();
        let done = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let opts = CollectorOptions {
                    listen: "127.0.0.1:0".parse().unwrap(),
                    http: Some("127.0.0.1:0".parse().unwrap()),
                    token: "t0ken".into(),
                    report: None,
                    tls: None,
                    agent_timeout: roce_trace::collector::AGENT_TIMEOUT,
                    report_every: Duration::ZERO,
                    join: JoinConfig {
                        trajectory_timeout_ns: 100_000_000,
                        ..JoinConfig::default()
                    },
                    live: false,
                    trace: false,
                    interval: Duration::from_secs(1),
                    fleet: None,
                    continuous: None,
                    http_token: None,
                };
                let mut opts = opts;
                with(&mut opts);
                collector::run(
                    opts,
                    async {
                        let _ = rx.await;
                    },
                    move |a, h| atx.send((a, h.unwrap())).unwrap(),
                )
                .await
                .unwrap()
            })
        });
        let (agents, http) = arx.recv_timeout(Duration::from_secs(10)).unwrap();
        Self {
            agents,
            http,
            stop: Some(tx),
            done: Some(done),
        }
    }

    fn get(&self, path: &str) -> (u16, String) {
        let (status, body) = roce_trace::http::get(self.http, path, Duration::from_secs(30)).unwrap();
        (status, String::from_utf8(body).unwrap())
    }

    fn json(&self, path: &str) -> Value {
        let (status, body) = self.get(path);
        assert_eq!(status, 200, "{path}: {body}");
        serde_json::from_str(&body).unwrap()
    }

    fn finish(mut self) -> CollectorReport {
        self.stop.take().unwrap().send(()).unwrap();
        self.done.take().unwrap().join().unwrap()
    }
}

/// A test that fails half-way stops its collector all the same.
impl Drop for Running {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

fn obs(point: u16, psn: u32, ttl: u8, dscp: u8) -> Observation {
    Observation {
        point,
        time_ns: 1_000 + psn as u64,
        id: PacketId {
            flow: FlowId {
                src: [10; 16],
                dst: [20; 16],
                ip_version: 6,
                udp_sport: 49152,
                dest_qp: 0x101,
            },
            psn,
            opcode: 7,
            icrc: [1, 2, 3, psn as u8],
        },
        udp_dport: 4791,
        dscp,
        ecn: 2,
        ttl,
        reasons: REASON_HASH as u8,
        ..Default::default()
    }
}

/// What a read on a connection the peer should have closed must find: the end of the
/// stream (or a reset: the peer closed with our bytes unread). A read timing out means
/// the connection is still open, and fails.
fn assert_closed(s: &mut dyn Conn, what: &str) {
    use std::io::ErrorKind::*;
    let mut b = [0u8; 256];
    match s.read(&mut b) {
        Ok(0) => {}
        Err(e) if matches!(e.kind(), ConnectionReset | BrokenPipe) => {}
        Ok(n) => panic!("{what}: {n} more bytes where the connection should have ended"),
        Err(e) if matches!(e.kind(), WouldBlock | TimedOut) => {
            panic!("{what}: the connection is still open after 5 s")
        }
        Err(e) => panic!("{what}: {e}"),
    }
}

/// A fake agent's byte stream: TCP, or TLS over it.
trait Conn: Read + Write + Send {}
impl<T: Read + Write + Send> Conn for T {}

/// An agent speaking the protocol by hand.
struct FakeAgent {
    s: Box<dyn Conn>,
    enc: Encoder,
    dec: roce_trace::protocol::Decoder,
    buf: bytes::BytesMut,
}

impl FakeAgent {
    /// Connects and sends HELLO (protocol `version`); the collector's answer.
    fn hello(c: &Running, node: &str, token: &str, version: u16) -> (Self, Frame) {
        let s = TcpStream::connect(c.agents).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let (a, reply) = Self::hello_on(Box::new(s), node, token, version);
        (
            a,
            reply.unwrap_or_else(|| panic!("{node}: the collector closed without answering HELLO")),
        )
    }

    /// Sends HELLO on `s`; the collector's answer, or None when it closed the connection.
    fn hello_on(s: Box<dyn Conn>, node: &str, token: &str, version: u16) -> (Self, Option<Frame>) {
        let mut a = Self {
            s,
            enc: Encoder::default(),
            dec: Default::default(),
            buf: Default::default(),
        };
        a.send(&Frame::Hello {
            version,
            node: node.into(),
            token: token.into(),
            clock_synced: false,
        });
        let reply = a.read_frame();
        (a, reply)
    }

    fn connect(c: &Running, node: &str, token: &str) -> (Self, Frame) {
        Self::hello(c, node, token, VERSION)
    }

    /// Connects; WELCOME's connection id, previous connection id and its frames processed.
    fn welcomed(c: &Running, node: &str) -> (Self, (u64, u64, u64)) {
        match Self::connect(c, node, "t0ken") {
            (
                a,
                Frame::Welcome {
                    version,
                    connection,
                    previous,
                    previous_frames,
                },
            ) => {
                assert_eq!(version, VERSION);
                assert_ne!(connection, 0);
                (a, (connection, previous, previous_frames))
            }
            (_, other) => panic!("{node}: expected WELCOME, got {other:?}"),
        }
    }

    fn send(&mut self, f: &Frame) {
        let b = self.enc.encode(f).unwrap();
        self.s.write_all(&b).unwrap();
    }

    /// The collector's next frame but HEARTBEATs (as an agent, it takes them for a sign
    /// of life); `None` when it closed the connection (or refused the TLS handshake).
    /// Fails when nothing comes within 5 s.
    fn read_frame(&mut self) -> Option<Frame> {
        loop {
            match self.next_any() {
                Some(Frame::Heartbeat { .. }) => {}
                f => return f,
            }
        }
    }

    /// The collector's next frame, whatever it is.
    fn next_any(&mut self) -> Option<Frame> {
        use std::io::ErrorKind::*;
        let mut chunk = [0u8; 4096];
        loop {
            if let Some(f) = self
                .dec
                .decode(&mut self.buf)
                .expect("the collector's frames decode")
            {
                return Some(f);
            }
            match self.s.read(&mut chunk) {
                Ok(0) => return None,
                // A TLS alert (the collector refused the certificate) reads as invalid data.
                Err(e)
                    if matches!(
                        e.kind(),
                        ConnectionReset | BrokenPipe | InvalidData | UnexpectedEof
                    ) =>
                {
                    return None;
                }
                Err(e) if matches!(e.kind(), WouldBlock | TimedOut) => {
                    panic!("nothing from the collector within 5 s")
                }
                Err(e) => panic!("reading from the collector: {e}"),
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
            }
        }
    }

    /// The collector's next ACK (frames processed up to it), whatever ACKs came before.
    fn read_ack(&mut self) -> u64 {
        match self.read_frame() {
            Some(Frame::Ack { seq }) => seq,
            other => panic!("expected ACK, got {other:?}"),
        }
    }

    /// Reads ACKs until one acknowledges frame `seq`: they only go up and never past it.
    fn acked_up_to(&mut self, seq: u64) -> usize {
        let (mut last, mut n) = (0, 0);
        while last < seq {
            let a = self.read_ack();
            assert!(
                a > last && a <= seq,
                "ACK {a} after {last}, last frame sent {seq}"
            );
            last = a;
            n += 1;
        }
        n
    }

    /// The collector says goodbye with a reason containing `why` (ACKs may come first),
    /// then closes the connection.
    fn assert_bye(&mut self, why: &str) {
        loop {
            match self.read_frame() {
                Some(Frame::Ack { .. }) => {}
                Some(Frame::Bye { reason }) => {
                    assert!(reason.contains(why), "BYE `{reason}`, expected `{why}`");
                    break;
                }
                other => panic!("expected BYE ({why}), got {other:?}"),
            }
        }
        assert!(self.buf.is_empty(), "bytes after BYE");
        assert_closed(&mut self.s, why);
    }

    /// The next frame the encoder numbers.
    fn next_seq(&self) -> u64 {
        self.enc.next_seq()
    }
}

fn point(index: u16, iface: &str) -> PointDecl {
    PointDecl {
        index,
        node: String::new(),
        iface: iface.into(),
        ifindex: 2,
        mtu: 0,
        direction: 0,
    }
}

fn wait_for(c: &Running, path: &str, pred: impl Fn(&Value) -> bool) -> Value {
    for _ in 0..100 {
        let v = c.json(path);
        if pred(&v) {
            return v;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{path} never satisfied the condition: {}", c.json(path));
}

#[test]
fn bad_peers_are_cut_off_and_good_ones_keep_being_served() {
    let c = Running::start();
    let (mut good, (_, previous, _)) = FakeAgent::welcomed(&c, "good");
    assert_eq!(previous, 0, "a node's first connection has none before it");
    good.send(&Frame::Points(vec![point(0, "eth0")]));
    good.send(&Frame::Observations((0..10).map(|p| obs(0, p, 64, 26)).collect()));

    // Wrong token: refused, told why, closed.
    let (mut bad, reply) = FakeAgent::connect(&c, "intruder", "guess");
    match reply {
        Frame::Bye { reason } => assert!(
            reason.contains("node `intruder` presented a wrong token"),
            "{reason}"
        ),
        other => panic!("expected BYE, got {other:?}"),
    }
    assert_closed(&mut bad.s, "wrong token");

    // An agent of the previous protocol version (it would not expect ACKs): refused.
    let (mut old, reply) = FakeAgent::hello(&c, "old", "t0ken", VERSION - 1);
    let want = format!(
        "protocol version {} is not supported (this side speaks {VERSION})",
        VERSION - 1
    );
    assert_eq!(reply, Frame::Bye { reason: want });
    assert_closed(&mut old.s, "old version");

    // Garbage instead of a HELLO.
    let mut g = TcpStream::connect(c.agents).unwrap();
    g.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    g.write_all(b"GET / HTTP/1.1\r\nHost: collector\r\n\r\n").unwrap();
    assert_closed(&mut g, "garbage is cut off");

    // A frame out of order, after a good handshake.
    let (mut ooo, _) = FakeAgent::connect(&c, "skipper", "t0ken");
    ooo.enc = Encoder::default(); // restarts at sequence 0: a replayed frame
    ooo.send(&Frame::Heartbeat { unix_ns: 1 });
    ooo.assert_bye("frame out of order: sequence 0, expected 1");

    // Observations from a point never declared.
    let (mut undeclared, _) = FakeAgent::connect(&c, "sloppy", "t0ken");
    undeclared.send(&Frame::Observations(vec![obs(7, 1, 64, 26)]));
    undeclared.assert_bye("observation from undeclared point 7");

    // An agent vanishing in the middle of a frame.
    let (mut vanish, _) = FakeAgent::connect(&c, "vanisher", "t0ken");
    let half = vanish
        .enc
        .encode(&Frame::Observations(vec![obs(0, 1, 64, 26)]))
        .unwrap();
    vanish.s.write_all(&half[..half.len() / 2]).unwrap();
    drop(vanish);

    // The good agent is still served: its later observations are joined.
    good.send(&Frame::Observations(
        (10..20).map(|p| obs(0, p, 64, 26)).collect(),
    ));
    let agents = wait_for(&c, "/agents", |v| {
        v.as_array()
            .unwrap()
            .iter()
            .any(|a| a["node"] == "vanisher" && a["connected"] == false)
            && v.as_array()
                .unwrap()
                .iter()
                .any(|a| a["node"] == "good" && a["observations"] == 20)
    });
    let by = |n: &str| {
        agents
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["node"] == n)
            .unwrap()
            .clone()
    };
    assert_eq!(by("good")["connected"], true);
    assert!(
        by("vanisher")["last_disconnect"]
            .as_str()
            .unwrap()
            .contains("inside a frame"),
        "{}",
        by("vanisher")
    );
    assert!(
        by("skipper")["last_disconnect"]
            .as_str()
            .unwrap()
            .contains("out of order")
    );
    assert!(
        by("sloppy")["last_disconnect"]
            .as_str()
            .unwrap()
            .contains("undeclared point")
    );
    assert!(
        agents.as_array().unwrap().iter().all(|a| a["node"] != "intruder"),
        "refused agents are not registered"
    );
    let stats = c.json("/stats");
    assert_eq!(stats["observations"], 20);
    let r = c.finish();
    assert_eq!(r.refused_connections, 3, "wrong token, old version and garbage");
}

/// Each OBSERVATIONS and COUNTERS frame is acknowledged once it is in the join — the ACK
/// never runs ahead of what the collector holds — and a burst may be acknowledged at once.
#[test]
fn data_frames_are_acknowledged_once_they_are_in_the_join() {
    let c = Running::start();
    let (mut a, _) = FakeAgent::welcomed(&c, "acker");
    a.send(&Frame::Points(vec![point(0, "eth0")]));
    a.send(&Frame::Observations((0..10).map(|p| obs(0, p, 64, 26)).collect()));
    assert_eq!(a.read_ack(), 2, "HELLO 0, POINTS 1, OBSERVATIONS 2");
    // Acknowledged means in the join: no waiting.
    assert_eq!(c.json("/stats")["observations"], 10);
    a.send(&Frame::Counters(vec![CounterDelta {
        point: 0,
        counts: Counts {
            packets: 5,
            ..Default::default()
        },
        ..Default::default()
    }]));
    assert_eq!(a.read_ack(), 3, "counters too");
    let agents = c.json("/agents");
    assert_eq!(agents[0]["counter_deltas"], 1);
    // A burst: ACKs only go up, and the last one covers the last frame.
    for i in 0..200 {
        a.send(&Frame::Observations(vec![obs(0, 100 + i, 64, 26)]));
    }
    let last = a.next_seq() - 1;
    let acks = a.acked_up_to(last);
    assert!((1..=200).contains(&acks), "{acks} ACKs");
    assert_eq!(c.json("/stats")["observations"], 210);
    // A frame that breaks the protocol is not acknowledged: BYE instead.
    a.send(&Frame::Observations(vec![obs(3, 1, 64, 26)]));
    a.assert_bye("observation from undeclared point 3");
    assert_eq!(c.json("/stats")["observations"], 210);
    c.finish();
}

/// Waits until the collector has let go of `node`'s connection.
fn wait_disconnected(c: &Running, node: &str) {
    let t = std::time::Instant::now();
    loop {
        let agents = c.json("/agents");
        let a = agents
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["node"] == node)
            .cloned();
        if a.is_some_and(|a| a["connected"] == false) {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "`{node}` still connected: {agents}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One session per node: while a node's connection is open and heard from, a second
/// HELLO with its name is refused (BYE, counted) and the first goes on — whoever holds the
/// token cannot take a live agent's place. Once the node's connection is gone it connects
/// again, and WELCOME says how many of its previous connection's frames were processed, so
/// the agent sends again exactly the rest. A connection that got no further than its
/// handshake does not count; another node's connections are not this node's. Fails if a
/// second session replaces the first (as it did: the first was told "connected again").
#[test]
fn a_node_connecting_again_learns_how_much_of_its_previous_connection_counts() {
    let c = Running::start();
    let (mut a1, (id1, prev, _)) = FakeAgent::welcomed(&c, "again");
    assert_eq!(prev, 0);
    a1.send(&Frame::Points(vec![point(0, "eth0")]));
    a1.send(&Frame::Observations(vec![obs(0, 1, 64, 26)]));
    a1.send(&Frame::Observations(vec![obs(0, 2, 64, 26)]));
    a1.acked_up_to(3);

    // A second session while a1 is live: refused with its reason; a1 is still served.
    let (mut dup, reply) = FakeAgent::connect(&c, "again", "t0ken");
    match reply {
        Frame::Bye { reason } => assert!(reason.contains("is connected already"), "{reason}"),
        other => panic!("a second session got {other:?}"),
    }
    assert_closed(&mut dup.s, "second session");
    a1.send(&Frame::Observations(vec![obs(0, 5, 64, 26)]));
    assert_eq!(a1.read_ack(), 4, "the first session goes on");
    drop(a1); // gone without a word
    wait_disconnected(&c, "again");

    let (mut a2, (id2, prev, frames)) = FakeAgent::welcomed(&c, "again");
    assert_ne!(id2, id1);
    assert_eq!(
        (prev, frames),
        (id1, 5),
        "HELLO, POINTS and three OBSERVATIONS processed"
    );
    a2.send(&Frame::Points(vec![point(0, "eth0")]));
    a2.send(&Frame::Observations(vec![obs(0, 3, 64, 26)]));
    assert_eq!(a2.read_ack(), 2);
    drop(a2);
    wait_disconnected(&c, "again");

    // Handshake only, then gone: it does not replace a2 as the one to resume from.
    let (a3, (id3, prev, frames)) = FakeAgent::welcomed(&c, "again");
    assert_eq!((prev, frames), (id2, 3));
    drop(a3);
    wait_disconnected(&c, "again");
    let (mut a4, (id4, prev, frames)) = FakeAgent::welcomed(&c, "again");
    assert!(id4 != id3 && id4 != id2);
    assert_eq!((prev, frames), (id2, 3), "a3 processed nothing past its HELLO");

    let (_, (_, prev, _)) = FakeAgent::welcomed(&c, "other");
    assert_eq!(prev, 0, "another node's connections are not its own");

    a4.send(&Frame::Points(vec![point(0, "eth0")]));
    a4.send(&Frame::Observations(vec![obs(0, 4, 64, 26)]));
    assert_eq!(a4.read_ack(), 2);
    let agents = c.json("/agents");
    let again = agents
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["node"] == "again")
        .unwrap();
    assert_eq!(again["connections"], 4, "the refused session is no connection");
    assert_eq!(again["connected"], true, "{again}");
    assert_eq!(again["observations"], 5);
    c.finish();
}

/// Keepalives both ways. The collector sends a HEARTBEAT every third of
/// `--agent-timeout` (at most 5 s): an agent can tell a live collector from a dead one.
/// An agent silent for `--agent-timeout` is closed with its reason, and its node may
/// connect again at once; one that sends its heartbeats stays. Fails without the
/// collector's heartbeats (nothing comes within 3 s) and without the timeout (the silent
/// connection stays open: a dead host would hold its node's session for good).
#[test]
fn silent_agents_are_closed_and_the_collector_sends_heartbeats() {
    let c = Running::start_with(|o| o.agent_timeout = Duration::from_secs(6));
    let (mut quiet, _) = FakeAgent::welcomed(&c, "quiet");
    let t = std::time::Instant::now();
    match quiet.next_any() {
        Some(Frame::Heartbeat { unix_ns }) => assert!(unix_ns > 1_600_000_000_000_000_000),
        other => panic!("expected HEARTBEAT, got {other:?}"),
    }
    let first = t.elapsed();
    assert!(
        first > Duration::from_millis(1500) && first < Duration::from_secs(3),
        "{first:?}"
    );
    let (mut chatty, _) = FakeAgent::welcomed(&c, "chatty");
    let beating = std::thread::spawn(move || {
        for _ in 0..9 {
            chatty.send(&Frame::Heartbeat { unix_ns: 1 });
            std::thread::sleep(Duration::from_secs(1));
        }
        chatty
    });
    quiet.assert_bye("nothing from the agent for 6s");
    let closed = t.elapsed();
    assert!(
        closed > Duration::from_millis(5500) && closed < Duration::from_secs(8),
        "{closed:?}"
    );
    let mut chatty = beating.join().unwrap();
    chatty.send(&Frame::Points(vec![point(0, "eth0")]));
    // POINTS is not acknowledged: the next frame that comes is the ACK of this one.
    chatty.send(&Frame::Observations(vec![obs(0, 1, 64, 26)]));
    match chatty.read_frame() {
        Some(Frame::Ack { .. }) => {}
        other => panic!("chatty should stay: {other:?}"),
    }
    let agents = c.json("/agents");
    let chatty_now = agents
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["node"] == "chatty")
        .unwrap();
    assert_eq!(chatty_now["connected"], true, "{agents}");
    // The silent node connects again at once.
    FakeAgent::welcomed(&c, "quiet");
    c.finish();
}

/// Mutual TLS on the agents' port (the collector with certificates and no token): an
/// agent needs a certificate from the collector's CA, and it speaks for its own node only.
/// Refused: a peer speaking plain TCP, a TLS peer without a certificate, one with a
/// certificate from another CA, and h1's certificate claiming node h2 (told why). h1's
/// certificate for h1 is welcomed and served. Each refusal fails without its check.
#[test]
fn over_tls_an_agent_needs_a_certificate_naming_its_own_node() {
    use roce_trace::tls::{TlsFiles, client_config, create, load_certs, server_config};
    use std::sync::Arc;
    let dir = roce_trace_tests::TempDir::new("tls-peers");
    create(
        &dir.0.join("ours"),
        &["127.0.0.1".into()],
        &["h1".into(), "h2".into()],
    )
    .unwrap();
    create(&dir.0.join("theirs"), &["127.0.0.1".into()], &["h1".into()]).unwrap();
    let files = |ca: &str, leaf: &str| TlsFiles {
        cert: dir.0.join(format!("{ca}/{leaf}.pem")),
        key: dir.0.join(format!("{ca}/{leaf}.key")),
        ca: dir.0.join(format!("{ca}/ca.pem")),
    };
    let server = server_config(&files("ours", "collector")).unwrap();
    let c = Running::start_with(move |o| {
        o.token = String::new();
        o.tls = Some(server);
    });
    let tcp = || {
        let s = TcpStream::connect(c.agents).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s
    };
    let over_tls = |cfg: Arc<rustls::ClientConfig>| -> Box<dyn Conn> {
        let name =
            rustls::pki_types::ServerName::IpAddress("127.0.0.1".parse::<std::net::IpAddr>().unwrap().into());
        let conn = rustls::ClientConnection::new(cfg, name).unwrap();
        Box::new(rustls::StreamOwned::new(conn, tcp()))
    };
    let hello = |s: Box<dyn Conn>, node: &str| {
        // A refused handshake fails the first write or read: either way, no WELCOME.
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            FakeAgent::hello_on(s, node, "", VERSION).1
        }))
        .unwrap_or(None)
    };

    // Plain TCP: the collector speaks TLS, so no frame ever comes back.
    assert_eq!(hello(Box::new(tcp()), "h1"), None, "plain TCP");
    // TLS without a certificate.
    let roots = {
        let mut r = rustls::RootCertStore::empty();
        for cert in load_certs(&dir.0.join("ours/ca.pem")).unwrap() {
            r.add(cert).unwrap();
        }
        r
    };
    let anonymous =
        rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
    assert_eq!(hello(over_tls(Arc::new(anonymous)), "h1"), None, "no certificate");
    // h1's certificate from another CA (trusting ours for the collector's).
    let mut foreign = files("theirs", "h1");
    foreign.ca = dir.0.join("ours/ca.pem");
    assert_eq!(
        hello(over_tls(client_config(&foreign).unwrap()), "h1"),
        None,
        "another CA"
    );
    // h1's certificate, claiming h2.
    match hello(over_tls(client_config(&files("ours", "h1")).unwrap()), "h2") {
        Some(Frame::Bye { reason }) => assert!(
            reason.contains("the certificate is not for node `h2`"),
            "{reason}"
        ),
        other => panic!("h1 as h2: {other:?}"),
    }
    // h1's certificate for h1: welcomed, and its frames served.
    let (mut h1, reply) = FakeAgent::hello_on(
        over_tls(client_config(&files("ours", "h1")).unwrap()),
        "h1",
        "",
        VERSION,
    );
    assert!(matches!(reply, Some(Frame::Welcome { .. })), "{reply:?}");
    h1.send(&Frame::Points(vec![point(0, "eth0")]));
    h1.send(&Frame::Observations(vec![obs(0, 1, 64, 26)]));
    assert_eq!(h1.read_ack(), 2);
    let agents = c.json("/agents");
    assert_eq!(agents.as_array().unwrap().len(), 1, "{agents}");
    assert_eq!(agents[0]["node"], "h1");
    assert_eq!(c.json("/stats")["observations"], 1);
    c.finish();
}

#[test]
fn the_api_serves_flows_paths_and_class_changes() {
    let c = Running::start();
    let (mut a, _) = FakeAgent::connect(&c, "h1", "t0ken");
    a.send(&Frame::Points(vec![PointDecl {
        index: 0,
        node: String::new(),
        iface: "eth0".into(),
        ifindex: 2,
        mtu: 0,
        direction: 1,
    }]));
    let (mut b, _) = FakeAgent::connect(&c, "s1", "t0ken");
    b.send(&Frame::Points(vec![
        PointDecl {
            index: 0,
            node: String::new(),
            iface: "l1".into(),
            ifindex: 2,
            mtu: 0,
            direction: 0,
        },
        PointDecl {
            index: 1,
            node: String::new(),
            iface: "l2".into(),
            ifindex: 3,
            mtu: 0,
            direction: 1,
        },
    ]));
    a.send(&Frame::Observations((0..5).map(|p| obs(0, p, 64, 26)).collect()));
    b.send(&Frame::Observations(
        (0..5)
            .flat_map(|p| [obs(0, p, 63, 26), obs(1, p, 62, 0)])
            .collect(),
    ));
    let flows = wait_for(&c, "/flows", |v| {
        v.as_array()
            .is_some_and(|f| f.first().is_some_and(|f| f["trajectories"] == 5))
    });
    let f = &flows[0];
    assert_eq!(
        f["path"],
        serde_json::json!(["h1:eth0:egress", "s1:l1:ingress", "s1:l2:egress"])
    );
    assert_eq!(
        f["class_changes"][0]["between"],
        serde_json::json!(["s1:l1:ingress", "s1:l2:egress"])
    );
    let id = f["id"].as_str().unwrap();
    let enc = roce_trace::http::percent_encode(id);
    let one = c.json(&format!("/flow?id={enc}"));
    assert_eq!(one["id"], id);
    assert_eq!(c.get("/flow?id=nope").0, 404);
    let anomalies = c.json("/anomalies");
    assert_eq!(anomalies[0]["kind"], "class_change");
    let (status, metrics) = c.get("/metrics");
    assert_eq!(status, 200);
    assert!(
        metrics.contains("roce_trace_collector_observations_total 15"),
        "{metrics}"
    );
    assert!(metrics.contains("roce_trace_collector_anomalies{kind=\"class_change\"} 1"));
    c.finish();
}

/// Mirrored copies of the same packets from two switches (ERSPAN II from one, ERSPAN III
/// from the next, the inner TTL one lower) reach one analyser host, whose agent reads them
/// from a pcap: each mirror session becomes its switch's observation point, and the
/// collector joins them into a two-hop path.
#[test]
fn mirrored_copies_from_two_switches_join_into_a_two_hop_path() {
    use roce_trace_gen::frame::{Mirror, RoceFrame};
    use roce_trace_tests::{TempDir, roce_trace_bin, write_pcap};
    let c = Running::start();
    let analyser = "192.0.2.100".parse().unwrap();
    let mut frames = Vec::new();
    for psn in 0..5u32 {
        let at = |ttl| {
            RoceFrame {
                psn,
                ttl,
                payload: vec![psn as u8; 64],
                ..Default::default()
            }
            .build()
        };
        frames.push(
            Mirror::ErspanII {
                session: 1,
                seq: psn,
                index: 3,
            }
            .encapsulate("198.51.100.7".parse().unwrap(), analyser, &at(63)),
        );
        frames.push(
            Mirror::ErspanIII {
                session: 2,
                seq: psn,
                timestamp: psn,
                platform: false,
            }
            .encapsulate("198.51.100.8".parse().unwrap(), analyser, &at(62)),
        );
    }
    let dir = TempDir::new("mirror-agent");
    let pcap = dir.path("mirrored.pcap");
    write_pcap(&pcap, &frames);
    let out = std::process::Command::new(roce_trace_bin())
        .args(["agent", "-r"])
        .arg(&pcap)
        .args(["--collector", &c.agents.to_string()])
        .args([
            "--node",
            "analyser",
            "--token",
            "t0ken",
            "--sample-rate",
            "1",
            "--interval",
            "100ms",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let flows = wait_for(&c, "/flows", |v| {
        v.as_array()
            .is_some_and(|f| f.first().is_some_and(|f| f["trajectories"] == 5))
    });
    let f = &flows[0];
    assert_eq!(
        f["path"],
        serde_json::json!(["198.51.100.7:erspan-1:mirror", "198.51.100.8:erspan-2:mirror"]),
        "{f}"
    );
    assert_eq!(f["hops"], serde_json::json!([1]), "{f}");
    assert_eq!(flows.as_array().unwrap().len(), 1);
    let report = c.finish();
    let points: Vec<String> = report
        .points
        .iter()
        .map(|p| format!("{}:{}:{}", p.node, p.iface, p.direction))
        .collect();
    assert!(
        points.contains(&"198.51.100.7:erspan-1:mirror".to_owned())
            && points.contains(&"198.51.100.8:erspan-2:mirror".to_owned()),
        "{points:?}"
    );
}

/// A collector of another protocol version would not acknowledge what it receives: the
/// agent is refused by an older collector (BYE naming the versions) and itself refuses a
/// WELCOME of another version; either way it sends nothing past its HELLO, keeps
/// retrying, and its last line says everything went undelivered.
#[test]
fn an_agent_and_a_collector_of_another_version_part_cleanly() {
    use roce_trace_gen::frame::RoceFrame;
    use roce_trace_tests::{Proc, TempDir, roce_trace_bin, write_pcap};
    use std::net::TcpListener;
    let dir = TempDir::new("version-agent");
    let pcap = dir.path("few.pcap");
    write_pcap(
        &pcap,
        &(0..5u32)
            .map(|psn| {
                RoceFrame {
                    psn,
                    ..Default::default()
                }
                .build()
            })
            .collect::<Vec<_>>(),
    );
    let old = VERSION - 1;
    let answers = [
        Frame::Bye {
            reason: format!("protocol version {VERSION} is not supported (this side speaks {old})"),
        },
        Frame::Welcome {
            version: old,
            connection: 1,
            previous: 0,
            previous_frames: 0,
        },
    ];
    let mut runs = Vec::new();
    for answer in answers {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        // The fake collector: answers every HELLO, then reads until the agent hangs up.
        let fake = std::thread::spawn(move || {
            let mut connections = 0;
            l.set_nonblocking(false).unwrap();
            for s in l.incoming() {
                let mut s = s.unwrap();
                s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                let mut dec = roce_trace::protocol::Decoder::default();
                let mut buf = bytes::BytesMut::new();
                let mut frames = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    while let Some(f) = dec.decode(&mut buf).unwrap() {
                        if frames.is_empty() {
                            s.write_all(&Encoder::default().encode(&answer).unwrap()).unwrap();
                        }
                        frames.push(f);
                    }
                    match s.read(&mut chunk) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                assert!(
                    matches!(frames.as_slice(), [Frame::Hello { version: VERSION, .. }]),
                    "only a HELLO: {frames:?}"
                );
                connections += 1;
                if connections == 3 {
                    return connections;
                }
            }
            unreachable!()
        });
        let agent = Proc::spawn(
            std::process::Command::new(roce_trace_bin())
                .args(["agent", "-r"])
                .arg(&pcap)
                .args(["--collector", &addr.to_string()])
                .args(["--node", "n", "--token", "t0ken", "--sample-rate", "1"])
                .stderr(std::process::Stdio::piped()),
        );
        runs.push((agent, fake));
    }
    let wants = [
        format!("refused: protocol version {VERSION} is not supported (this side speaks {old})"),
        format!("the collector speaks protocol version {old}, this agent {VERSION}"),
    ];
    for ((agent, fake), want) in runs.into_iter().zip(wants) {
        let out = agent.wait_with_output();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{err}");
        assert!(err.contains(&want), "`{want}` in {err}");
        assert!(
            err.contains("observations 5 made, 0 sent, 0 resent, 0 acknowledged, 0 dropped, 5 undelivered"),
            "{err}"
        );
        assert_eq!(fake.join().unwrap(), 3, "the agent kept trying");
    }
}

/// `/trace` makes an agent send probes into the fabric: refused unless the collector was
/// started with `--trace`, and once per flow (the budget for the whole collector is
/// checked in the collector's unit tests).
#[test]
fn traces_on_request_need_trace_and_come_once_per_flow() {
    let flows = |a: &mut FakeAgent| {
        a.send(&Frame::Points(vec![PointDecl {
            index: 0,
            node: String::new(),
            iface: "eth0".into(),
            ifindex: 2,
            mtu: 0,
            direction: 1,
        }]));
        a.send(&Frame::Observations(
            (0..30)
                .map(|q| {
                    let mut o = obs(0, 7, 64, 26);
                    o.id.flow.dest_qp = 0x200 + q;
                    o
                })
                .collect(),
        ));
    };
    let ids = |c: &Running| -> Vec<String> {
        let v = wait_for(c, "/flows", |v| {
            v.as_array()
                .is_some_and(|f| f.len() == 30 && f.iter().all(|f| !f["path"].as_array().unwrap().is_empty()))
        });
        v.as_array()
            .unwrap()
            .iter()
            .map(|f| f["id"].as_str().unwrap().to_owned())
            .collect()
    };
    let trace = |c: &Running, id: &str| c.get(&format!("/trace?id={}", roce_trace::http::percent_encode(id)));

    let off = Running::start();
    let (mut a, _) = FakeAgent::connect(&off, "h1", "t0ken");
    flows(&mut a);
    let (status, body) = trace(&off, &ids(&off)[0]);
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("--trace"), "{body}");
    off.finish();

    let on = Running::start_with(|o| o.trace = true);
    let (mut a, _) = FakeAgent::connect(&on, "h1", "t0ken");
    flows(&mut a);
    // Each flow is traced once (by the collector itself as its path appears, or by the
    // first request): asking again is refused.
    for id in &ids(&on)[..3] {
        let (first, body) = trace(&on, id);
        assert!(first == 200 || first == 409, "{first} {body}");
        let (again, body) = trace(&on, id);
        assert_eq!(again, 409, "{body}");
        assert!(body.contains("traced already"), "{body}");
    }
    on.finish();
}

/// Counts an agent sends are not trusted to be small: counter deltas and health records
/// near u64::MAX, summed by the join, the views and the judge, stop at u64::MAX instead of
/// wrapping into small numbers — or, in this debug build, panicking the agent's task and
/// every view. Fails without the saturating sums (the second delta overflows).
#[test]
fn absurd_counts_saturate_instead_of_crashing_the_collector() {
    use roce_trace::observation::PointHealth;
    let c = Running::start();
    let (mut a, _) = FakeAgent::welcomed(&c, "huge");
    a.send(&Frame::Points(vec![point(0, "eth0")]));
    let huge = CounterDelta {
        point: 0,
        counts: Counts {
            packets: u64::MAX - 1,
            bytes: u64::MAX,
            cnp: u64::MAX,
            psn_gaps: u64::MAX,
            ..Default::default()
        },
        start_ns: 1,
        end_ns: 2,
        ..Default::default()
    };
    a.send(&Frame::Counters(vec![huge, huge]));
    a.send(&Frame::Counters(vec![huge]));
    let health = PointHealth {
        point: 0,
        start_ns: 1,
        end_ns: 2,
        ringbuf_full: u64::MAX,
        unparsed: u64::MAX,
        agent_dropped: u64::MAX,
        if_rx_dropped: u64::MAX,
        ..Default::default()
    };
    a.send(&Frame::Health(vec![health, health]));
    a.acked_up_to(a.next_seq() - 1);
    let r = c.json("/report");
    let f = &r["flows"][0];
    let packets: Vec<u64> = f["counters"]
        .as_object()
        .unwrap()
        .values()
        .map(|d| d["packets"].as_u64().unwrap())
        .collect();
    assert_eq!(packets, [u64::MAX], "{f}");
    let h = &r["health"][0];
    assert_eq!(h["samples_lost"], u64::MAX, "{h}");
    assert_eq!(h["rx_dropped"], u64::MAX, "{h}");
    // The judge sums them too.
    let report: CollectorReport = serde_json::from_value(r).unwrap();
    let policy =
        roce_trace_verify::policy::Policy::parse("[reliability]\nmax_psn_gap_ppm = 10\nmax_loss_ppm = 10\n")
            .unwrap();
    let results = roce_trace_verify::checks::judge(&policy, &report, roce_trace_verify::checks::Load::Idle);
    assert!(!results.is_empty());
    c.finish();
}
