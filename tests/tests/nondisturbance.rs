//! Proof that the tracer disturbs nothing: on the lab, the same traffic — over a million
//! RoCE requests on 16 QPs, a TCP stream and non-RoCE UDP datagrams — runs twice, once
//! with nothing watching and once with an agent on every port of every node streaming to a
//! collector. Each time, every frame that leaves h1 arrives at h3 byte for byte the same (a
//! digest of every frame, captured on both hosts, TTL and IP checksum aside), the
//! generator's responder finds every request in sequence with a valid ICRC, the TCP
//! stream's bytes and every UDP datagram arrive intact, and no kernel drop counter of any
//! port, qdisc, softnet queue or UDP socket of the fabric moves. And the two runs carry the
//! very same frames.

use std::{
    collections::{BTreeMap, HashMap},
    hash::{DefaultHasher, Hasher},
    io::{BufRead, BufReader, Read},
    process::{Child, Command, Stdio},
    sync::Mutex,
    thread::JoinHandle,
    time::Duration,
};

use roce_trace_tests::{
    lab::{Lab, LabGuard, Observers},
    *,
};
use serde_json::Value;

static SERIAL: Mutex<()> = Mutex::new(());

/// 16 QPs × 1,000 messages of 16 KiB at RoCE MTU 256: 64 requests a message.
const QPS: u64 = 16;
const MESSAGES: u64 = 1000;
const PKTS_PER_MSG: u64 = 64;
const UDP_DATAGRAMS: u64 = 20_000;
const TCP_BYTES: u64 = 40 << 20;
const H1: &str = "10.10.1.2";
const H3: &str = "10.10.3.2";

/// A child killed (and reaped) when dropped, so a failing assertion leaves nothing running.
struct Kid(Option<Child>);

impl Kid {
    fn spawn(cmd: &mut Command) -> Self {
        Self(Some(cmd.spawn().unwrap_or_else(|e| panic!("{cmd:?}: {e}"))))
    }
    fn child(&mut self) -> &mut Child {
        self.0.as_mut().expect("running")
    }
    /// Waits for it to exit by itself; its stdout's last line as JSON.
    fn json(mut self) -> Value {
        let out = self.0.take().expect("running").wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let s = String::from_utf8(out.stdout).unwrap();
        serde_json::from_str(s.lines().last().unwrap_or("")).unwrap_or_else(|e| panic!("{s:?}: {e}"))
    }
    fn interrupt(&mut self) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child().id() as i32, libc::SIGINT) };
    }
}

impl Drop for Kid {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn in_ns(lab: &Lab, node: &str) -> Command {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", &lab.ns(node)]);
    c
}

fn python(lab: &Lab, node: &str, args: &[&str]) -> Kid {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/background.py");
    Kid::spawn(
        in_ns(lab, node)
            .arg("python3")
            .arg(script)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    )
}

/// Reads the child's first stdout line (`{"ready": true}`) and keeps the rest for later.
fn ready(k: &mut Kid) -> JoinHandle<String> {
    let mut out = BufReader::new(k.child().stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert!(line.contains("ready"), "not ready: {line:?}");
    std::thread::spawn(move || {
        let mut rest = String::new();
        out.read_to_string(&mut rest).unwrap();
        rest
    })
}

fn finished(mut k: Kid, rest: JoinHandle<String>) -> Value {
    let status = k.0.take().unwrap().wait().unwrap();
    assert!(status.success());
    let s = rest.join().unwrap();
    serde_json::from_str(s.lines().last().unwrap_or("")).unwrap_or_else(|e| panic!("{s:?}: {e}"))
}

/// A capture on one port, digesting each frame as it arrives (nothing written to disk):
/// the multiset of digests of the IP packet with TTL and header checksum zeroed.
struct Digests {
    tcpdump: Kid,
    /// Frames digested so far.
    seen: std::sync::Arc<std::sync::atomic::AtomicU64>,
    reader: Option<JoinHandle<(Multiset, Multiset)>>,
    stderr: JoinHandle<String>,
}

impl Digests {
    fn start(lab: &Lab, node: &str, filter: &str) -> Self {
        let mut tcpdump = Kid::spawn(
            in_ns(lab, node)
                .args([
                    "tcpdump", "-i", "eth0", "-n", "-B", "131072", "-s", "0", "-U", "-w", "-",
                ])
                .arg(filter)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped()),
        );
        let mut err = BufReader::new(tcpdump.child().stderr.take().unwrap());
        let mut line = String::new();
        while err.read_line(&mut line).unwrap() > 0 && !line.contains("listening on") {
            line.clear();
        }
        assert!(line.contains("listening on"), "tcpdump did not start");
        let stderr = std::thread::spawn(move || {
            let mut rest = String::new();
            err.read_to_string(&mut rest).unwrap();
            rest
        });
        let out = tcpdump.child().stdout.take().unwrap();
        let seen = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counter = seen.clone();
        let reader = std::thread::spawn(move || {
            let mut r = pcap_file::pcap::PcapReader::new(BufReader::with_capacity(1 << 20, out)).unwrap();
            let (mut m, mut anon) = (Multiset::new(), Multiset::new());
            while let Some(p) = r.next_packet() {
                let p = p.unwrap();
                counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                *m.entry(digest(&p.data, false)).or_default() += 1;
                *anon.entry(digest(&p.data, true)).or_default() += 1;
            }
            (m, anon)
        });
        Self {
            tcpdump,
            seen,
            reader: Some(reader),
            stderr,
        }
    }

    /// Stops the capture: the digests (with and without the IPv4 ID), and what the kernel
    /// dropped before tcpdump read it.
    fn stop(mut self) -> ((Multiset, Multiset), u64) {
        // tcpdump discards what its ring still holds when interrupted (and does not
        // count it as dropped): wait until it has caught up — nothing new for half a
        // second (the traffic is over) — for at most a minute.
        let mut last = u64::MAX;
        for _ in 0..120 {
            let now = self.seen.load(std::sync::atomic::Ordering::Relaxed);
            if now == last {
                break;
            }
            last = now;
            std::thread::sleep(Duration::from_millis(500));
        }
        self.tcpdump.interrupt();
        let m = self.reader.take().unwrap().join().unwrap();
        self.tcpdump.0.take().unwrap().wait().unwrap();
        let err = std::mem::replace(&mut self.stderr, std::thread::spawn(String::new))
            .join()
            .unwrap();
        let dropped = err
            .lines()
            .find(|l| l.contains("dropped by kernel"))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no drop count from tcpdump: {err}"));
        (m, dropped)
    }
}

type Multiset = HashMap<u64, u32>;

/// The IPv4 packet of an Ethernet frame, TTL and header checksum zeroed (the routers
/// change them), hashed; `anonymous`: the IPv4 ID zeroed too (the kernel numbers a
/// socket's datagrams from a random start, so two runs differ there and only there).
fn digest(frame: &[u8], anonymous: bool) -> u64 {
    assert!(frame.len() > 34 && frame[12..14] == [0x08, 0x00], "an IPv4 frame");
    let mut ip = frame[14..].to_vec();
    if anonymous {
        ip[4] = 0;
        ip[5] = 0;
    }
    ip[8] = 0;
    ip[10] = 0;
    ip[11] = 0;
    let mut h = DefaultHasher::new();
    h.write(&ip);
    h.finish()
}

/// Every kernel drop counter of the fabric: per port (netdev statistics, the veth's own
/// ethtool counters, qdisc drops), per namespace (UDP receive errors), and the softnet
/// backlog drops (global).
fn drop_counters(lab: &Lab) -> BTreeMap<String, u64> {
    let mut m = BTreeMap::new();
    for node in Lab::nodes() {
        for port in lab.interfaces(&node).unwrap() {
            for stat in [
                "rx_dropped",
                "tx_dropped",
                "rx_missed_errors",
                "rx_fifo_errors",
                "tx_fifo_errors",
                "rx_errors",
                "tx_errors",
            ] {
                let v = lab
                    .exec(
                        &node,
                        &["cat", &format!("/sys/class/net/{port}/statistics/{stat}")],
                    )
                    .unwrap();
                m.insert(format!("{node}:{port}:{stat}"), v.trim().parse().unwrap());
            }
            if let Ok(s) = lab.exec(&node, &["ethtool", "-S", &port]) {
                for l in s.lines() {
                    if let Some((k, v)) = l.trim().split_once(':')
                        && (k.contains("drop") || k.contains("err"))
                        && let Ok(v) = v.trim().parse::<u64>()
                    {
                        m.insert(format!("{node}:{port}:ethtool:{k}"), v);
                    }
                }
            }
            let q = lab
                .exec(&node, &["tc", "-s", "qdisc", "show", "dev", &port])
                .unwrap();
            let dropped: u64 = q
                .split("dropped ")
                .skip(1)
                .filter_map(|t| t.split(',').next()?.trim().parse::<u64>().ok())
                .sum();
            m.insert(format!("{node}:{port}:qdisc_dropped"), dropped);
        }
        let snmp = lab.exec(&node, &["cat", "/proc/net/snmp"]).unwrap();
        let udp: Vec<&str> = snmp.lines().filter(|l| l.starts_with("Udp:")).collect();
        let (names, values) = (udp[0].split_whitespace(), udp[1].split_whitespace());
        for (k, v) in names.zip(values).skip(1) {
            if k.contains("Errors") {
                m.insert(format!("{node}:udp:{k}"), v.parse().unwrap());
            }
        }
    }
    let softnet = std::fs::read_to_string("/proc/net/softnet_stat").unwrap();
    let dropped: u64 = softnet
        .lines()
        .map(|l| u64::from_str_radix(l.split_whitespace().nth(1).unwrap(), 16).unwrap())
        .sum();
    m.insert("softnet:dropped".into(), dropped);
    m
}

struct Run {
    /// Frames leaving h1 for h3, and arriving at h3 from h1 (IPv4 ID left out).
    left: Multiset,
    arrived: Multiset,
    report: Option<Value>,
}

fn run(lab: &Lab, dir: &TempDir, watched: bool) -> Run {
    let name = if watched { "watched" } else { "unwatched" };
    let obs = watched.then(|| Observers::start(lab, dir.path(&format!("{name}.json")), "nd-token", &[]));
    let before = drop_counters(lab);
    let filter = format!("src host {H1} and dst host {H3} and udp");
    let at_h1 = Digests::start(lab, "h1", &filter);
    let at_h3 = Digests::start(lab, "h3", &filter);

    let mut tcp_rx = python(lab, "h3", &["tcp-recv", H3, "5001"]);
    let tcp_rx_out = ready(&mut tcp_rx);
    let mut udp_rx = python(
        lab,
        "h3",
        &["udp-recv", H3, "5002", &UDP_DATAGRAMS.to_string(), "5"],
    );
    let udp_rx_out = ready(&mut udp_rx);
    let mut responder = Kid::spawn(
        in_ns(lab, "h3")
            .arg(roce_trace_bin())
            .args(["gen", "--bind", H3, "--json"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    std::thread::sleep(Duration::from_millis(300));
    let (qps, msgs) = (QPS.to_string(), MESSAGES.to_string());
    let sender = Kid::spawn(
        in_ns(lab, "h1")
            .arg(roce_trace_bin())
            .args([
                "gen",
                "--to",
                H3,
                "--qps",
                &qps,
                "--messages",
                &msgs,
                "--msg-size",
                "16KiB",
                "--mtu",
                "256",
                "--rate",
                "6mbit",
                "--no-dcqcn",
                // A cap only: it ends after its messages. The tracer takes CPU from the
                // paced sender on a 2-core box (twice as long watched), so leave room.
                "--duration",
                "900s",
                // No loss is the premise: an ACK late because the machine's 2 cores are
                // busy must not look like one (a real loss still shows below).
                "--ack-timeout",
                "1s",
                "--json",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    let tcp_tx = python(
        lab,
        "h1",
        &["tcp-send", H3, "5001", &TCP_BYTES.to_string(), "2000000"],
    );
    let udp_tx = python(
        lab,
        "h1",
        &["udp-send", H1, H3, "5002", &UDP_DATAGRAMS.to_string(), "1000"],
    );
    let s = sender.json();
    let tcp_sent = tcp_tx.json();
    let udp_sent = udp_tx.json();
    std::thread::sleep(Duration::from_millis(500));
    responder.interrupt();
    let r = responder.json();
    let tcp_got = finished(tcp_rx, tcp_rx_out);
    let udp_got = finished(udp_rx, udp_rx_out);
    let ((left, left_anon), dropped_h1) = at_h1.stop();
    let ((arrived, arrived_anon), dropped_h3) = at_h3.stop();
    let report = obs.map(|o| serde_json::from_str(&std::fs::read_to_string(o.stop()).unwrap()).unwrap());
    let after = drop_counters(lab);

    let moved: Vec<String> = after
        .iter()
        .filter(|(k, v)| before.get(*k).is_some_and(|b| b != *v))
        .map(|(k, v)| format!("{k}: {} -> {v}", before[k]))
        .collect();
    let timeouts: u64 = s["senders"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| q["timeouts"].as_u64().unwrap())
        .sum();
    eprintln!(
        "{name}: {} RoCE requests in {:.1} s, {timeouts} ACK timeouts; tcpdump dropped {dropped_h1} at h1, \
         {dropped_h3} at h3; TCP {tcp_got}; UDP {udp_got}; drop counters moved: {moved:?}",
        s["senders"]
            .as_array()
            .unwrap()
            .iter()
            .map(|q| q["packets"].as_u64().unwrap())
            .sum::<u64>(),
        s["duration_s"].as_f64().unwrap(),
    );
    // The generator: every message of every QP sent once and acknowledged; every request
    // arrived in sequence with its ICRC intact.
    let mut requests = 0;
    for q in s["senders"].as_array().unwrap() {
        assert_eq!(q["messages_sent"], MESSAGES, "{name}: {q}");
        assert_eq!(q["messages_acked"], MESSAGES, "{name}: {q}");
        for k in ["retransmitted", "tx_dropped", "timeouts", "naks_psn_seq_err"] {
            assert_eq!(q[k], 0, "{name}: {k}: {q}");
        }
        requests += q["packets"].as_u64().unwrap();
    }
    assert_eq!(requests, QPS * MESSAGES * PKTS_PER_MSG, "{name}");
    assert_eq!(r["icrc_errors"], 0, "{name}: {r}");
    let in_order: u64 = r["responders"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| q["in_order"].as_u64().unwrap())
        .sum();
    assert_eq!(in_order, requests, "{name}: every request in sequence: {r}");
    for q in r["responders"].as_array().unwrap() {
        assert_eq!(
            (&q["duplicates"], &q["out_of_sequence"]),
            (&0.into(), &0.into()),
            "{name}: {q}"
        );
    }
    // TCP and UDP background: every byte and datagram.
    assert_eq!(tcp_got, tcp_sent, "{name}: the TCP stream");
    assert_eq!(tcp_got["bytes"], TCP_BYTES);
    assert_eq!(udp_sent["sent"], UDP_DATAGRAMS);
    assert_eq!(udp_got["received"], UDP_DATAGRAMS, "{name}: {udp_got}");
    assert_eq!(udp_got["corrupt"], 0, "{name}: {udp_got}");
    // Byte for byte: the frames that left h1 are the frames that arrived at h3.
    assert_eq!(
        (dropped_h1, dropped_h3),
        (0, 0),
        "{name}: tcpdump saw every frame"
    );
    let total: u64 = left.values().map(|&n| n as u64).sum();
    assert_eq!(
        total,
        requests + UDP_DATAGRAMS,
        "{name}: frames captured leaving h1"
    );
    let missing = left.iter().filter(|(d, n)| arrived.get(d) != Some(n)).count();
    assert_eq!(missing, 0, "{name}: {missing} digests differ between h1 and h3");
    assert_eq!(left, arrived, "{name}");
    // No kernel drop counter moved.
    assert!(moved.is_empty(), "{name}: drop counters moved: {moved:?}");
    Run {
        left: left_anon,
        arrived: arrived_anon,
        report,
    }
}

#[test]
fn agents_on_every_port_change_no_frame_and_drop_nothing() {
    if !require_root() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let up = LabGuard::up("rtnd");
    let lab = &up.0;
    let dir = TempDir::new("nondisturb");
    let plain = run(lab, &dir, false);
    let watched = run(lab, &dir, true);
    assert!(plain.report.is_none());
    // The agents really watched: the collector saw every QP's flow on its whole path.
    let report = watched.report.as_ref().unwrap();
    let data: Vec<&Value> = report["flows"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["src_ip"] == H1 && f["dst_ip"] == H3)
        .collect();
    assert_eq!(data.len() as u64, QPS, "{}", report["flows"]);
    for f in &data {
        assert_eq!(
            f["path"].as_array().unwrap().len(),
            8,
            "h1 → l1 → spine → l2 → h3: {f}"
        );
    }
    // The same frames with and without the tracer (but for the IPv4 IDs of the
    // background's datagrams, which the kernel numbers from a random start).
    assert_eq!(plain.left, watched.left, "what h1 sent");
    assert_eq!(plain.arrived, watched.arrived, "what h3 received");
}
