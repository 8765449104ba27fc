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
    correlate::JoinConfig,
    observation::{FlowId, Observation, PacketId, PointDecl},
    protocol::{Encoder, Frame, VERSION},
};
use roce_trace_common::datapath::REASON_HASH;
use serde_json::Value;

struct Running {
    agents: SocketAddr,
    http: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    done: Option<std::thread::JoinHandle<CollectorReport>>,
}

impl Running {
    fn start() -> Self {
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
                    join: JoinConfig {
                        trajectory_timeout_ns: 100_000_000,
                        ..JoinConfig::default()
                    },
                    live: false,
                    trace: false,
                    interval: Duration::from_secs(1),
                };
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
        let mut s = TcpStream::connect(self.http).unwrap();
        write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        let status = out.split_whitespace().nth(1).unwrap().parse().unwrap();
        (status, out.split_once("\r\n\r\n").unwrap().1.to_owned())
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

/// An agent speaking the protocol by hand.
struct FakeAgent {
    s: TcpStream,
    enc: Encoder,
}

impl FakeAgent {
    fn connect(c: &Running, node: &str, token: &str) -> (Self, Option<Frame>) {
        let s = TcpStream::connect(c.agents).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut a = Self {
            s,
            enc: Encoder::default(),
        };
        a.send(&Frame::Hello {
            version: VERSION,
            node: node.into(),
            token: token.into(),
            clock_synced: false,
        });
        let reply = a.read_frame();
        (a, reply)
    }
    fn send(&mut self, f: &Frame) {
        let b = self.enc.encode(f).unwrap();
        self.s.write_all(&b).unwrap();
    }
    fn read_frame(&mut self) -> Option<Frame> {
        let mut dec = roce_trace::protocol::Decoder::default();
        let mut buf = bytes::BytesMut::new();
        let mut chunk = [0u8; 4096];
        loop {
            if let Ok(Some(f)) = dec.decode(&mut buf) {
                return Some(f);
            }
            match self.s.read(&mut chunk) {
                Ok(0) | Err(_) => return None,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    }
    /// True once the collector has closed the connection.
    fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.s.read(&mut b), Ok(0) | Err(_))
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
    let (mut good, reply) = FakeAgent::connect(&c, "good", "t0ken");
    assert_eq!(reply, Some(Frame::Welcome { version: VERSION }));
    good.send(&Frame::Points(vec![PointDecl {
        index: 0,
        node: String::new(),
        iface: "eth0".into(),
        ifindex: 2,
        direction: 0,
    }]));
    good.send(&Frame::Observations((0..10).map(|p| obs(0, p, 64, 26)).collect()));

    // Wrong token: refused, told why, closed.
    let (mut bad, reply) = FakeAgent::connect(&c, "intruder", "guess");
    match reply {
        Some(Frame::Bye { reason }) => assert!(reason.contains("wrong token"), "{reason}"),
        other => panic!("expected BYE, got {other:?}"),
    }
    assert!(bad.closed());

    // Garbage instead of a HELLO.
    let mut g = TcpStream::connect(c.agents).unwrap();
    g.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    g.write_all(b"GET / HTTP/1.1\r\nHost: collector\r\n\r\n").unwrap();
    let mut b = [0u8; 1];
    assert!(matches!(g.read(&mut b), Ok(0) | Err(_)), "garbage is cut off");

    // A frame out of order, after a good handshake.
    let (mut ooo, _) = FakeAgent::connect(&c, "skipper", "t0ken");
    ooo.enc = Encoder::default(); // restarts at sequence 0: a replayed frame
    ooo.send(&Frame::Heartbeat { unix_ns: 1 });
    assert!(ooo.closed());

    // Observations from a point never declared.
    let (mut undeclared, _) = FakeAgent::connect(&c, "sloppy", "t0ken");
    undeclared.send(&Frame::Observations(vec![obs(7, 1, 64, 26)]));
    assert!(undeclared.closed());

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
    assert_eq!(r.refused_connections, 2, "wrong token and garbage");
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
        direction: 1,
    }]));
    let (mut b, _) = FakeAgent::connect(&c, "s1", "t0ken");
    b.send(&Frame::Points(vec![
        PointDecl {
            index: 0,
            node: String::new(),
            iface: "l1".into(),
            ifindex: 2,
            direction: 0,
        },
        PointDecl {
            index: 1,
            node: String::new(),
            iface: "l2".into(),
            ifindex: 3,
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
    use roce_trace::frame::{Mirror, RoceFrame};
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
