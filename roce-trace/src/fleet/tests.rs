//! Each test that needs NATS starts its own `nats-server -js` (random port, temporary store)
//! and kills it when dropped. A missing `nats-server` fails the test: it is never skipped.

use std::{
    collections::{BTreeMap, HashMap},
    net::TcpListener,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use async_nats::jetstream::message::PublishMessage;
use tokio::sync::mpsc;

use super::*;
use crate::observation::PacketId;

/// A nats-server of this test's own.
struct NatsServer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    extra: Vec<String>,
}

fn nats_server_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("NATS_SERVER") {
        return p.into();
    }
    for dir in std::env::var("PATH")
        .unwrap_or_default()
        .split(':')
        .chain(["/usr/sbin", "/usr/local/sbin"])
    {
        let p = PathBuf::from(dir).join("nats-server");
        if p.is_file() {
            return p;
        }
    }
    panic!(
        "nats-server is not installed: `apt-get install nats-server` (scripts/setup does), or set NATS_SERVER"
    );
}

impl NatsServer {
    fn start(extra: &[&str]) -> Self {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let dir = std::env::temp_dir().join(format!("roce-trace-nats-{}-{port}", std::process::id()));
        let mut s = Self {
            child: None,
            port,
            dir,
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        s.run();
        s
    }

    fn run(&mut self) {
        let child = Command::new(nats_server_binary())
            .args(["-js", "-a", "127.0.0.1", "-p", &self.port.to_string(), "-sd"])
            .arg(&self.dir)
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting nats-server");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "nats-server did not listen within 10 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn test_options(srv: &NatsServer) -> NatsOptions {
    NatsOptions {
        urls: vec![srv.url()],
        stream: "T".into(),
        prefix: "t".into(),
        partitions: 16,
        lease_ttl: Duration::from_millis(900),
        request_timeout: Duration::from_secs(1),
        ..NatsOptions::default()
    }
}

/// Connects, retrying while the new server's JetStream comes up.
async fn fleet(opts: NatsOptions) -> Fleet {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match connect(opts.clone()).await {
            Ok(f) => return f,
            Err(e) if Instant::now() < deadline => {
                eprintln!("connect: {e}; again");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("connect: {e}"),
        }
    }
}

/// Member `c1`, alone in its group, once it owns every partition; what it delivers.
async fn sole_member(f: &Fleet) -> (GroupMember, mpsc::Receiver<FleetEvent>) {
    let (tx, rx) = mpsc::channel(1024);
    let m = GroupMember::join(
        f,
        MemberOptions {
            id: "c1".into(),
            http: "-".into(),
        },
        tx,
    )
    .await
    .expect("joins");
    until("c1 to own every partition", Duration::from_secs(10), || {
        m.owned().len() == 16
    })
    .await;
    (m, rx)
}

fn v4(a: [u8; 4]) -> [u8; 16] {
    std::net::Ipv4Addr::from(a).to_ipv6_mapped().octets()
}

fn flow(src: [u8; 4], dst: [u8; 4], sport: u16, qp: u32) -> FlowId {
    FlowId {
        src: v4(src),
        dst: v4(dst),
        ip_version: 4,
        udp_sport: sport,
        dest_qp: qp,
    }
}

fn obs(flow: FlowId, psn: u32) -> Observation {
    Observation {
        point: 0,
        time_ns: 1_700_000_000_000_000_000 + psn as u64,
        id: PacketId {
            flow,
            psn,
            opcode: 4,
            icrc: [0; 4],
        },
        udp_dport: 4791,
        dscp: 26,
        ecn: 2,
        ttl: 64,
        pcp: 3,
        frame_len: 1090,
        reasons: 1,
        aeth_syndrome: 0,
        flags: 1,
    }
}

fn point(index: u16) -> PointDecl {
    PointDecl {
        index,
        node: String::new(),
        iface: format!("eth{index}"),
        ifindex: 2 + index as u32,
        direction: 0,
        mtu: 4200,
    }
}

/// `n` observations over 100 host pairs, each with a unique PSN (its identity here).
fn observations(n: u32) -> Vec<Observation> {
    (0..n)
        .map(|i| {
            let k = (i % 100) as u8;
            obs(flow([10, 0, 0, k], [10, 0, 1, k], 49152, 0x100 + i % 7), i)
        })
        .collect()
}

async fn until(what: &str, patience: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + patience;
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What one member's channel carried, in order.
#[derive(Default)]
struct Received {
    /// PSN → partition of the subject it came on.
    obs: HashMap<u32, u32>,
    duplicates: u64,
    gained: Vec<u32>,
    lost: Vec<u32>,
    points: Vec<(String, Vec<PointDecl>)>,
    dropped: Vec<(u64, u64)>,
}

impl Received {
    fn take(&mut self, subjects: &Subjects, rx: &mut mpsc::Receiver<FleetEvent>) {
        while let Ok(e) = rx.try_recv() {
            match e {
                FleetEvent::Gained(p) => self.gained.push(p),
                FleetEvent::Lost(p) => {
                    self.lost.push(p);
                    self.obs.retain(|_, q| *q != p);
                }
                FleetEvent::Frame(d) => match d.frame {
                    Frame::Observations(v) => {
                        let p = subjects.partition_of_subject(&d.subject).expect("a data subject");
                        for o in v {
                            assert_eq!(
                                partition_of(&o.id.flow, 16),
                                p,
                                "an observation on another partition"
                            );
                            if self.obs.insert(o.id.psn, p).is_some() {
                                self.duplicates += 1;
                            }
                        }
                    }
                    Frame::Points(p) => self.points.push((d.node, p)),
                    Frame::Dropped {
                        observations,
                        counters,
                    } => self.dropped.push((observations, counters)),
                    _ => {}
                },
            }
        }
    }
}

// ---------------------------------------------------------------------------------------

#[test]
fn partition_key_is_the_unordered_host_pair_and_nothing_else() {
    let a = [10, 1, 2, 3];
    let b = [10, 9, 8, 7];
    let p = partition_of(&flow(a, b, 49152, 0x11), 64);
    for (src, dst) in [(a, b), (b, a)] {
        for sport in [1, 49152, 65535] {
            for qp in [0, 0x11, 0xff_ffff] {
                let f = flow(src, dst, sport, qp);
                assert_eq!(partition_of(&f, 64), p, "{f}");
                // Class and TTL are not in the key: a packet remarked or routed keeps it.
                for (dscp, ecn, ttl) in [(0, 0, 64), (26, 2, 63), (46, 3, 1)] {
                    let o = Observation {
                        dscp,
                        ecn,
                        ttl,
                        ..obs(f, 7)
                    };
                    let split = split_observations(vec![o], 64);
                    assert_eq!(split.len(), 1);
                    assert_eq!(split[0].0, p);
                }
            }
        }
    }
    // Pinned (FNV-1a 64 of ::ffff:10.1.2.3 then ::ffff:10.9.8.7, then fmix64; worked out
    // apart in Python):
    // a change of hash would split a fleet of mixed versions.
    assert_eq!(pair_hash(&flow(a, b, 0, 0)), 0x2156_0251_cd6f_9a5a);
    assert_eq!(partition_of(&flow(a, b, 0, 0), 64), 26);
    assert_eq!(partition_of(&flow(b, a, 0, 0), 1000), 122);
    // 4096 host pairs over 16 partitions: each gets 256 ± 25 %.
    let mut per = [0u32; 16];
    for i in 0..4096u32 {
        let [_, _, x, y] = i.to_be_bytes();
        per[partition_of(&flow([10, 0, x, y], [10, 1, y, x], 0, 0), 16) as usize] += 1;
    }
    assert!(per.iter().all(|n| (192..=320).contains(n)), "{per:?}");
}

#[test]
fn batches_split_per_partition_keep_order_and_fit_a_frame() {
    let obs: Vec<Observation> = (0..10_000)
        .map(|i| obs(flow([10, 0, 0, 1], [10, 0, 0, 2], 1, 1), i))
        .collect();
    let split = split_observations(obs, 16);
    assert_eq!(
        split.iter().map(|(_, v)| v.len()).collect::<Vec<_>>(),
        [4096, 4096, 1808]
    );
    let psns: Vec<u32> = split
        .iter()
        .flat_map(|(_, v)| v.iter().map(|o| o.id.psn))
        .collect();
    assert_eq!(psns, (0..10_000).collect::<Vec<_>>());
}

#[test]
fn ownership_is_shared_and_moves_only_from_the_member_that_left() {
    let three = ["c1", "c2", "c3"];
    let owners: Vec<&str> = (0..64).map(|p| owner_of(p, three).expect("an owner")).collect();
    for m in three {
        let n = owners.iter().filter(|o| **o == m).count();
        assert!((10..=32).contains(&n), "{m} owns {n} of 64");
    }
    for p in 0..64 {
        let after = owner_of(p, ["c1", "c3"]).expect("an owner");
        if owners[p as usize] != "c2" {
            assert_eq!(after, owners[p as usize], "partition {p} moved between survivors");
        }
    }
}

#[test]
fn kv_keys_carry_any_name_and_back() {
    for name in ["h1", "switch 7.lab", "fd00::1", "é/ü=", "a.b"] {
        let k = kv_key(name);
        assert!(
            k.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_=".contains(&b)),
            "{k}"
        );
        assert_eq!(kv_key_name(&k).as_deref(), Some(name));
    }
    assert_eq!(kv_key_name("=Z1"), None);
}

#[test]
fn cli_auth_flags_are_one_method_at_a_time() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        nats: NatsArgs,
    }
    let parse = |args: &[&str]| {
        Cli::try_parse_from(["x"].iter().chain(args))
            .expect("parses")
            .nats
            .options()
    };
    assert_eq!(
        parse(&[
            "--nats-url",
            "nats://a:4222",
            "--nats-user",
            "u",
            "--nats-password",
            "p"
        ])
        .map(|o| o.auth),
        Ok(NatsAuth::UserPassword {
            user: "u".into(),
            password: "p".into()
        })
    );
    assert_eq!(
        parse(&["--nats-url", "nats://a", "--nats-user", "u", "--nats-creds", "/c"]),
        Err(OptionsError::ManyAuth)
    );
    assert_eq!(
        parse(&["--nats-url", "nats://a", "--nats-user", "u"]),
        Err(OptionsError::UserWithoutPassword)
    );
    assert_eq!(
        parse(&["--nats-url", "nats://a", "--nats-tls-key", "k"]),
        Err(OptionsError::CertWithoutKey)
    );
    assert_eq!(parse(&[]), Err(OptionsError::NoUrl));
    let o = parse(&[
        "--nats-url",
        "nats://a",
        "--nats-tls-ca",
        "/ca.pem",
        "--nats-partitions",
        "8",
    ])
    .expect("valid");
    assert!(o.tls.enabled());
    assert_eq!(o.partitions, 8);
}

// ---------------------------------------------------------------------------------------

/// Two members share the partitions, each observation reaches exactly one of them; when
/// one dies (its lease lapses) the other takes its partitions over and replays them from
/// the start of the stream: it ends up with every observation of those partitions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_delivers_once_and_a_survivor_replays_the_partitions_of_a_member_that_died() {
    let srv = NatsServer::start(&[]);
    let f = fleet(test_options(&srv)).await;
    let subjects = f.subjects();
    let (tx1, mut rx1) = mpsc::channel(4096);
    let (tx2, mut rx2) = mpsc::channel(4096);
    let m1 = GroupMember::join(
        &f,
        MemberOptions {
            id: "c1".into(),
            http: "10.0.0.1:9100".into(),
        },
        tx1,
    )
    .await
    .expect("c1 joins");
    let m2 = GroupMember::join(
        &f,
        MemberOptions {
            id: "c2".into(),
            http: "10.0.0.2:9100".into(),
        },
        tx2,
    )
    .await
    .expect("c2 joins");
    until(
        "the two members to share all partitions",
        Duration::from_secs(10),
        || {
            let (a, b) = (m1.owned(), m2.owned());
            !a.is_empty() && !b.is_empty() && a.len() + b.len() == 16 && a.iter().all(|p| !b.contains(p))
        },
    )
    .await;
    let members = m1.members().await.expect("members");
    assert_eq!(
        members
            .iter()
            .map(|m| (m.id.as_str(), m.http.as_str()))
            .collect::<Vec<_>>(),
        [("c1", "10.0.0.1:9100"), ("c2", "10.0.0.2:9100")]
    );
    let owned2 = m2.owned();

    let publisher = Publisher::new(&f, "h1", PublisherOptions::default()).expect("publisher");
    publisher.send(Frame::Points(vec![point(0)])).expect("points");
    let all = observations(3000);
    let mut per_partition: BTreeMap<u32, usize> = BTreeMap::new();
    for o in &all {
        *per_partition.entry(partition_of(&o.id.flow, 16)).or_default() += 1;
    }
    for chunk in all.chunks(500) {
        publisher
            .send(Frame::Observations(chunk.to_vec()))
            .expect("observations");
    }
    assert!(
        publisher.flush(Duration::from_secs(10)).await,
        "{:?}",
        publisher.stats()
    );
    assert_eq!(publisher.stats().observations.acked, 3000);

    let (mut r1, mut r2) = (Received::default(), Received::default());
    until("every observation", Duration::from_secs(10), || {
        r1.take(&subjects, &mut rx1);
        r2.take(&subjects, &mut rx2);
        r1.obs.len() + r2.obs.len() >= 3000
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    r1.take(&subjects, &mut rx1);
    r2.take(&subjects, &mut rx2);
    assert_eq!((r1.duplicates, r2.duplicates), (0, 0));
    assert_eq!(
        r1.obs.len() + r2.obs.len(),
        3000,
        "each observation once across the group"
    );
    assert!(r1.obs.keys().all(|psn| !r2.obs.contains_key(psn)));
    assert!(r2.obs.values().all(|p| owned2.contains(p)));
    // Both have the node's points, delivered before its observations.
    assert!(r1.points.iter().any(|(n, p)| n == "h1" && p == &[point(0)]));
    assert!(r2.points.iter().any(|(n, p)| n == "h1" && p == &[point(0)]));

    // c1 may have owned every partition for a moment before it saw c2's lease (it
    // listed the group before c2 joined): each partition it gained and lost since, it
    // has handed over; it holds exactly its share now.
    let (gains_before_death, losses_before_death) = (r1.gained.len(), r1.lost.len());
    for p in 0..16u32 {
        let gains = r1.gained.iter().filter(|q| **q == p).count();
        let losses = r1.lost.iter().filter(|q| **q == p).count();
        assert_eq!(
            gains as i64 - losses as i64,
            i64::from(!owned2.contains(&p)),
            "partition {p}: gained {gains}, lost {losses} before c2 died"
        );
    }

    // c2 dies: no leave, its lease lapses.
    drop(m2);
    until("c1 to own every partition", Duration::from_secs(10), || {
        m1.owned().len() == 16
    })
    .await;
    let want: usize = owned2.iter().filter_map(|p| per_partition.get(p)).sum();
    until("c1 to replay c2's partitions", Duration::from_secs(10), || {
        r1.take(&subjects, &mut rx1);
        r1.obs.len() >= 3000
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    r1.take(&subjects, &mut rx1);
    let mut gained = r1.gained[gains_before_death..].to_vec();
    gained.sort();
    assert_eq!(gained, owned2, "c2's partitions gained once each when it died");
    assert_eq!(r1.lost.len(), losses_before_death, "nothing lost since");
    assert_eq!(r1.duplicates, 0);
    let replayed = r1.obs.values().filter(|p| owned2.contains(p)).count();
    assert_eq!(replayed, want, "every observation of c2's partitions, replayed");
    assert_eq!(r1.obs.len(), 3000);
    assert_eq!(m1.stats().malformed, 0);
    assert_eq!(m1.members().await.expect("members").len(), 1);
}

/// NATS restarts while the agent publishes: what fitted the bound is delivered once it is
/// back, exactly; what did not is counted as dropped and reported with DROPPED.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_publisher_buffers_through_a_server_restart_and_counts_what_it_dropped() {
    let mut srv = NatsServer::start(&[]);
    let f = fleet(test_options(&srv)).await;
    let publisher = Publisher::new(
        &f,
        "h1",
        PublisherOptions {
            queue: 1000,
            window: 64,
            ..Default::default()
        },
    )
    .expect("publisher");
    // One host pair: one partition, one message of 100 per send.
    let one_pair = |from: u32| -> Vec<Observation> {
        (from..from + 100)
            .map(|i| obs(flow([10, 0, 0, 1], [10, 0, 0, 2], 1, 1), i))
            .collect()
    };
    for k in 0..10 {
        publisher
            .send(Frame::Observations(one_pair(k * 100)))
            .expect("send");
    }
    assert!(publisher.flush(Duration::from_secs(10)).await);
    assert_eq!(publisher.stats().observations.acked, 1000);

    srv.stop();
    for k in 10..40 {
        publisher
            .send(Frame::Observations(one_pair(k * 100)))
            .expect("send");
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let during = publisher.stats();
    assert_eq!(
        during.observations.acked, 1000,
        "nothing acknowledged while NATS is down"
    );
    assert_eq!(
        during.observations.dropped, 2000,
        "3000 sent into a bound of 1000"
    );
    assert!(during.failures > 0);
    srv.run();
    assert!(
        publisher.flush(Duration::from_secs(20)).await,
        "delivered after the restart: {:?}",
        publisher.stats()
    );
    let s = publisher.stats().observations;
    assert_eq!((s.made, s.acked, s.dropped, s.pending()), (4000, 2000, 2000, 0));

    // The stream holds each acknowledged observation once.
    let (tx, mut rx) = mpsc::channel(4096);
    let m = GroupMember::join(
        &f,
        MemberOptions {
            id: "c1".into(),
            http: "-".into(),
        },
        tx,
    )
    .await
    .expect("joins");
    let subjects = f.subjects();
    let mut r = Received::default();
    until("the stream's observations", Duration::from_secs(10), || {
        r.take(&subjects, &mut rx);
        r.obs.len() >= 2000 && r.dropped.contains(&(2000, 0))
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    r.take(&subjects, &mut rx);
    assert_eq!((r.obs.len(), r.duplicates), (2000, 0));
    assert!((0..1000).all(|psn| r.obs.contains_key(&psn)));
    assert_eq!(m.stats().malformed, 0);
}

/// Bad input on a partition subject is what it is on TCP, minus the closed connection:
/// counted, logged with its subject, skipped; the consumer goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_message_is_counted_and_skipped_and_later_ones_arrive() {
    let srv = NatsServer::start(&[]);
    let f = fleet(test_options(&srv)).await;
    let (m, mut rx) = sole_member(&f).await;
    let subjects = f.subjects();
    let good = |psn| obs(flow([10, 0, 0, 1], [10, 0, 0, 2], 1, 1), psn);
    let p = partition_of(&good(0).id.flow, 16);
    let data = subjects.data(p);
    let js = f.jetstream();
    let with_node = |payload: Bytes| {
        PublishMessage::build()
            .payload(payload)
            .header(NODE_HEADER, "h1")
            .header(PROTOCOL_HEADER, crate::protocol::VERSION.to_string())
    };
    let valid = encode(&Frame::Observations(vec![good(1)]), 0).expect("encodes");
    // A valid frame from an agent of another protocol version, or of one before the
    // header (whose points sample other packets).
    let of_version = |v: Option<&str>| {
        let m = PublishMessage::build()
            .payload(valid.clone())
            .header(NODE_HEADER, "h1");
        match v {
            Some(v) => m.header(PROTOCOL_HEADER, v),
            None => m,
        }
    };
    let mut trailing = valid.to_vec();
    trailing.push(0);
    let health = encode(&Frame::Health(Vec::new()), 0).expect("encodes");
    for msg in [
        with_node(Bytes::from_static(b"\x00\x00\x00\x05garbage")),
        PublishMessage::build().payload(valid.clone()),
        with_node(Bytes::from(trailing)),
        with_node(health),
        with_node(valid.slice(..valid.len() - 3)),
        of_version(None),
        of_version(Some("7")),
    ] {
        js.send_publish(data.clone(), msg)
            .await
            .expect("publish")
            .await
            .expect("ack");
    }
    js.send_publish(
        subjects.health(),
        with_node(Bytes::from_static(b"\xff\xff\xff\xff")),
    )
    .await
    .expect("publish")
    .await
    .expect("ack");
    js.send_publish(data.clone(), with_node(valid.clone()))
        .await
        .expect("publish")
        .await
        .expect("ack");
    let mut r = Received::default();
    until("the valid observation", Duration::from_secs(10), || {
        r.take(&subjects, &mut rx);
        r.obs.contains_key(&1)
    })
    .await;
    assert_eq!(m.stats().malformed, 8);
    // Still reading.
    let again = encode(&Frame::Observations(vec![good(2)]), 0).expect("encodes");
    js.send_publish(data, with_node(again))
        .await
        .expect("publish")
        .await
        .expect("ack");
    until("the next one", Duration::from_secs(10), || {
        r.take(&subjects, &mut rx);
        r.obs.contains_key(&2)
    })
    .await;
    assert_eq!(m.stats().malformed, 8);
    assert_eq!(r.obs.len(), 2);
}

/// The server's own authentication: no credentials, no fleet; the right ones connect and
/// publish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_with_a_password_refuses_clients_without_it() {
    let srv = NatsServer::start(&["--user", "roce", "--pass", "s3cret"]);
    let opts = test_options(&srv);
    // Once the server takes the right credentials, the wrong ones are refused for what
    // they are, not for a server still starting.
    let good = NatsOptions {
        auth: NatsAuth::UserPassword {
            user: "roce".into(),
            password: "s3cret".into(),
        },
        ..opts.clone()
    };
    let f = fleet(good).await;
    for auth in [
        NatsAuth::None,
        NatsAuth::UserPassword {
            user: "roce".into(),
            password: "wrong".into(),
        },
    ] {
        let r = connect(NatsOptions { auth, ..opts.clone() }).await;
        assert!(matches!(r, Err(FleetError::Connect { .. })), "{:?}", r.err());
    }
    let publisher = Publisher::new(&f, "h1", PublisherOptions::default()).expect("publisher");
    publisher
        .send(Frame::Observations(observations(10)))
        .expect("send");
    assert!(publisher.flush(Duration::from_secs(10)).await);
    assert_eq!(publisher.stats().observations.acked, 10);
}

/// A throwaway CA and a server certificate for 127.0.0.1, made with the `openssl` CLI.
fn make_certs(dir: &std::path::Path) -> (PathBuf, PathBuf, PathBuf) {
    std::fs::create_dir_all(dir).expect("cert dir");
    let run = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("running openssl (apt-get install openssl)");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=roce-trace test CA",
    ]);
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=127.0.0.1",
    ]);
    std::fs::write(dir.join("ext.cnf"), "subjectAltName=IP:127.0.0.1\n").expect("ext");
    run(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "1",
        "-extfile",
        "ext.cnf",
    ]);
    // A client certificate from the same CA, for servers that verify clients (X.509 v3:
    // rustls takes no v1 certificate).
    std::fs::write(dir.join("client.cnf"), "extendedKeyUsage=clientAuth\n").expect("ext");
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "client.key",
        "-out",
        "client.csr",
        "-subj",
        "/CN=roce-trace agent",
    ]);
    run(&[
        "x509",
        "-req",
        "-in",
        "client.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "client.pem",
        "-days",
        "1",
        "-extfile",
        "client.cnf",
    ]);
    (dir.join("ca.pem"), dir.join("server.pem"), dir.join("server.key"))
}

/// TLS as configured: a client given the server's CA connects; one without it (the
/// system's CAs only) is refused, as is one that does not ask for TLS at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_server_is_reached_with_its_ca_and_not_without() {
    let certs = std::env::temp_dir().join(format!("roce-trace-nats-certs-{}", std::process::id()));
    let (ca, cert, key) = make_certs(&certs);
    let (cert, key) = (cert.display().to_string(), key.display().to_string());
    let srv = NatsServer::start(&["--tls", "--tlscert", &cert, "--tlskey", &key]);
    let opts = test_options(&srv);
    let f = fleet(NatsOptions {
        tls: NatsTls {
            ca: Some(ca.clone()),
            ..NatsTls::default()
        },
        ..opts.clone()
    })
    .await;
    let publisher = Publisher::new(&f, "h1", PublisherOptions::default()).expect("publisher");
    publisher
        .send(Frame::Observations(observations(5)))
        .expect("send");
    assert!(publisher.flush(Duration::from_secs(10)).await);
    assert_eq!(publisher.stats().observations.acked, 5);
    let without_ca = connect(NatsOptions {
        tls: NatsTls {
            required: true,
            ..NatsTls::default()
        },
        ..opts.clone()
    })
    .await;
    assert!(
        matches!(without_ca, Err(FleetError::Connect { .. })),
        "{:?}",
        without_ca.err()
    );
    let plain = connect(opts).await;
    assert!(
        matches!(plain, Err(FleetError::Connect { .. })),
        "{:?}",
        plain.err()
    );
    let _ = std::fs::remove_dir_all(&certs);
}

/// Mutual TLS: a server that verifies clients takes one with a certificate from its CA
/// and refuses one without.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_verifying_clients_takes_a_client_certificate_and_refuses_none() {
    let certs = std::env::temp_dir().join(format!("roce-trace-nats-mtls-{}", std::process::id()));
    let (ca, cert, key) = make_certs(&certs);
    let (client_cert, client_key) = (certs.join("client.pem"), certs.join("client.key"));
    let (ca_s, cert, key) = (
        ca.display().to_string(),
        cert.display().to_string(),
        key.display().to_string(),
    );
    let srv = NatsServer::start(&[
        "--tlsverify",
        "--tlscert",
        &cert,
        "--tlskey",
        &key,
        "--tlscacert",
        &ca_s,
    ]);
    let opts = test_options(&srv);
    let f = fleet(NatsOptions {
        tls: NatsTls {
            ca: Some(ca.clone()),
            client: Some((client_cert, client_key)),
            required: false,
        },
        ..opts.clone()
    })
    .await;
    let publisher = Publisher::new(&f, "h1", PublisherOptions::default()).expect("publisher");
    publisher
        .send(Frame::Observations(observations(3)))
        .expect("send");
    assert!(publisher.flush(Duration::from_secs(10)).await);
    assert_eq!(publisher.stats().observations.acked, 3);
    let no_client_cert = connect(NatsOptions {
        tls: NatsTls {
            ca: Some(ca),
            ..NatsTls::default()
        },
        ..opts
    })
    .await;
    assert!(
        matches!(no_client_cert, Err(FleetError::Connect { .. })),
        "{:?}",
        no_client_cert.err()
    );
    let _ = std::fs::remove_dir_all(&certs);
}

/// NKey authentication: the server knows the user's public key; the client signs the
/// server's nonce with its seed. The right seed connects and publishes, another user's
/// seed or none is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_with_nkey_users_takes_the_seed_and_refuses_others() {
    let user = nkeys::KeyPair::new_user();
    let stranger = nkeys::KeyPair::new_user();
    let conf = std::env::temp_dir().join(format!("roce-trace-nats-nkey-{}.conf", std::process::id()));
    std::fs::write(
        &conf,
        format!(
            "authorization {{ users = [ {{ nkey: \"{}\" }} ] }}\n",
            user.public_key()
        ),
    )
    .expect("server config");
    let srv = NatsServer::start(&["-c", &conf.display().to_string()]);
    let opts = test_options(&srv);
    let f = fleet(NatsOptions {
        auth: NatsAuth::NkeySeed(user.seed().expect("seed")),
        ..opts.clone()
    })
    .await;
    for auth in [NatsAuth::None, NatsAuth::NkeySeed(stranger.seed().expect("seed"))] {
        let r = connect(NatsOptions { auth, ..opts.clone() }).await;
        assert!(matches!(r, Err(FleetError::Connect { .. })), "{:?}", r.err());
    }
    let publisher = Publisher::new(&f, "h1", PublisherOptions::default()).expect("publisher");
    publisher
        .send(Frame::Observations(observations(4)))
        .expect("send");
    assert!(publisher.flush(Duration::from_secs(10)).await);
    assert_eq!(publisher.stats().observations.acked, 4);
    let _ = std::fs::remove_file(&conf);
}

/// Whether an agent's clock is synchronised (what HELLO says on TCP) reaches the member
/// on every data message: one-way delays count only between synchronised points.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_synchronised_clock_is_said_on_every_message() {
    let srv = NatsServer::start(&[]);
    let f = fleet(test_options(&srv)).await;
    let (_member, mut rx) = sole_member(&f).await;
    for (node, synced) in [("ptp", true), ("free", false)] {
        let p = Publisher::new(
            &f,
            node,
            PublisherOptions {
                clock_synced: synced,
                ..Default::default()
            },
        )
        .expect("publisher");
        p.send(Frame::Observations(observations(5))).expect("send");
        assert!(p.flush(Duration::from_secs(10)).await);
    }
    let mut seen: BTreeMap<String, BTreeSet<bool>> = BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while seen.values().map(|v| v.len()).sum::<usize>() < 2 || seen.len() < 2 {
        assert!(Instant::now() < deadline, "both nodes' observations: {seen:?}");
        if let Ok(Some(FleetEvent::Frame(d))) =
            tokio::time::timeout(Duration::from_millis(200), rx.recv()).await
            && matches!(d.frame, Frame::Observations(_))
        {
            seen.entry(d.node).or_default().insert(d.clock_synced);
        }
    }
    assert_eq!(seen["ptp"], BTreeSet::from([true]));
    assert_eq!(seen["free"], BTreeSet::from([false]));
}

/// The members listed while leases are being renewed are each listed once, none missed,
/// and the listing ends: a lease put during the listing must not make its member appear
/// twice (the group's view would merge that member's counts twice; CI saw one member's
/// flows and observations counted twice in the group's /metrics), nor hold the listing
/// until the consumer's idle heartbeat (CI saw "listing the leases timed out").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_are_listed_once_while_their_leases_are_renewed() {
    use super::member::{live_members, put_lease};
    let srv = NatsServer::start(&[]);
    let f = fleet(test_options(&srv)).await;
    let infos: Vec<MemberInfo> = (0..3)
        .map(|k| MemberInfo {
            id: format!("c{k}"),
            http: format!("127.0.0.1:{}", 9000 + k),
        })
        .collect();
    for i in &infos {
        put_lease(&f, i).await.unwrap();
    }
    let renewing = {
        let (f, infos) = (f.clone(), infos.clone());
        tokio::spawn(async move {
            // Far more often than members renew (a third of the TTL): with the keys of a
            // KV listing, a listing during these renewals waited for an idle heartbeat.
            loop {
                for i in &infos {
                    put_lease(&f, i).await.unwrap();
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
    };
    for _ in 0..200 {
        let mut ids: Vec<String> = live_members(&f)
            .await
            .unwrap()
            .into_iter()
            .map(|m| m.id)
            .collect();
        let n = ids.len();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), n, "a member listed twice: {ids:?}");
        // Every lease is renewed far within its TTL: every listing has all three.
        assert_eq!(ids, ["c0", "c1", "c2"], "a live member missed");
    }
    renewing.abort();
}
