//! Fleet mode on the lab: a NATS JetStream server and three collectors as a group on the
//! management network, an agent on every node (hosts and switches) publishing to NATS,
//! RoCEv2 traffic through a spine that rewrites DSCP. Mid-run one collector is killed,
//! that spine's agent is cut off from NATS for 4 s, and the NATS server itself is killed
//! and restarted. At the end the group's view must be what one collector makes of
//! everything the agents published: every flow once, the rewrite located at the spine
//! for exactly the flows through it, nothing lost, and every sampled packet the agents
//! had acknowledged joined — exact counts.

use std::{
    collections::{BTreeMap, BTreeSet},
    process::{Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use roce_trace_tests::{
    lab::{Fault, Lab, MGMT_COLLECTOR, leaf_of},
    *,
};
use serde_json::Value;

const PARTITIONS: u64 = 16;
const NATS_PORT: u16 = 4222;

/// The lab, and every process the test started in it, gone however the test ends.
struct Fabric {
    lab: Lab,
    dir: TempDir,
    nats: Option<Proc>,
    collectors: BTreeMap<String, Daemon>,
    agents: Vec<(String, Daemon)>,
}

impl Drop for Fabric {
    fn drop(&mut self) {
        for (_, a) in self.agents.drain(..) {
            a.kill();
        }
        for (_, c) in std::mem::take(&mut self.collectors) {
            c.kill();
        }
        self.nats.take();
        let _ = self.lab.down();
    }
}

impl Fabric {
    fn nats_url() -> String {
        format!("nats://{MGMT_COLLECTOR}:{NATS_PORT}")
    }

    /// nats-server with JetStream on the management network, its store in the test's
    /// directory (the same store across a restart).
    fn start_nats(&mut self) {
        let bin = nats_server_bin();
        let n = Proc::spawn(
            Command::new("ip")
                .args([
                    "netns",
                    "exec",
                    &self.lab.ns("mgmt"),
                    bin,
                    "-js",
                    "-a",
                    MGMT_COLLECTOR,
                ])
                .args(["-p", &NATS_PORT.to_string(), "-sd"])
                .arg(self.dir.path("jetstream"))
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        let probe = format!("exec 3<>/dev/tcp/{MGMT_COLLECTOR}/{NATS_PORT}");
        while self.lab.exec("mgmt", &["bash", "-c", &probe]).is_err() {
            assert!(Instant::now() < deadline, "nats-server did not start");
            std::thread::sleep(Duration::from_millis(100));
        }
        self.nats = Some(n);
    }

    /// A collector in the group, serving HTTP on `127.0.0.1:9470+m` of the management
    /// namespace (where the other members and the test ask).
    fn start_collector(&mut self, id: &str, m: u16) {
        let (listen, http) = (
            format!("{MGMT_COLLECTOR}:{}", 4792 + m),
            format!("127.0.0.1:{}", 9470 + m),
        );
        let report = self.dir.path(&format!("{id}.json"));
        let history = self.dir.path(&format!("{id}-verdicts.jsonl"));
        let policy = self.dir.path("class-policy.toml");
        std::fs::write(&policy, "[class]\ndata_dscp = 26\nno_change = true\n").unwrap();
        let url = Self::nats_url();
        let args = [
            "collect",
            // Continuous verification of the group's merged view, by one member.
            "--policy",
            policy.to_str().unwrap(),
            "--verify-every",
            "1s",
            "--verify-window",
            "2s",
            "--fail-after",
            "1",
            "--verdict-history",
            history.to_str().unwrap(),
            "--listen",
            &listen,
            "--http",
            &http,
            "--token",
            "t",
            "--quiet",
            "--report",
            report.to_str().unwrap(),
            "--trajectory-timeout",
            "2s",
            "--nats-url",
            &url,
            "--member-id",
            id,
            "--nats-partitions",
            "16",
            "--nats-lease-ttl",
            "3s",
        ];
        let c = Daemon::start(&self.lab.ns("mgmt"), &args, "collecting on");
        self.collectors.insert(id.to_owned(), c);
    }

    fn http(id: &str) -> String {
        let m: u16 = id.trim_start_matches('c').parse().unwrap();
        format!("127.0.0.1:{}", 9470 + m)
    }

    fn get(&self, id: &str, path: &str) -> String {
        let url = format!("http://{}{path}", Self::http(id));
        self.lab
            .exec("mgmt", &["curl", "-sS", "--fail-with-body", &url])
            .unwrap_or_else(|e| panic!("GET {url}: {e:#}"))
    }

    fn json(&self, id: &str, path: &str) -> Value {
        serde_json::from_str(&self.get(id, path)).unwrap()
    }

    fn metric(&self, id: &str, name: &str) -> u64 {
        self.get(id, "/metrics?local=1")
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or(0)
    }

    /// The running collectors' last log lines, for a failure's message.
    fn logs(&self) -> String {
        let mut out = String::new();
        for (id, c) in &self.collectors {
            let all = c.stderr.lock().unwrap().clone();
            let lines: Vec<&str> = all.lines().collect();
            out.push_str(&format!(
                "--- {id}\n{}\n",
                lines[lines.len().saturating_sub(40)..].join("\n")
            ));
        }
        out
    }

    /// Waits until the running collectors are the whole group and own every partition.
    fn group_settles(&self) {
        let ids: Vec<&String> = self.collectors.keys().collect();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let members: Vec<u64> = ids
                .iter()
                .map(|id| self.metric(id, "roce_trace_collector_fleet_members"))
                .collect();
            let owned: u64 = ids
                .iter()
                .map(|id| self.metric(id, "roce_trace_collector_fleet_partitions_owned"))
                .sum();
            if members.iter().all(|m| *m == ids.len() as u64) && owned == PARTITIONS {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the group never settled: members {members:?}, partitions owned {owned}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    /// Waits until the group's join (asked of `id`) holds `observations` with nothing
    /// pending, then past the CNP settle time; the group's flows and stats.
    fn group_joined(&self, id: &str, observations: u64) -> (Value, Value) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let st = self.json(id, "/stats");
            if st["pending"] == 0 && st["observations"].as_u64() == Some(observations) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the group's join never held the {observations} observations the agents had acknowledged: {st}"
            );
            std::thread::sleep(Duration::from_millis(300));
        }
        std::thread::sleep(Duration::from_millis(3500));
        (self.json(id, "/flows"), self.json(id, "/stats"))
    }
}

/// The agent's last line's observation account: (made, acknowledged, dropped, undelivered).
fn observations_account(stderr: &str) -> (u64, u64, u64, u64) {
    let line = stderr
        .lines()
        .find(|l| l.contains("agent stopped: observations"))
        .unwrap_or_else(|| panic!("no last line: {stderr}"));
    let obs = line
        .split("observations ")
        .nth(1)
        .unwrap()
        .split(';')
        .next()
        .unwrap();
    let n = |what: &str| -> u64 {
        obs.split(", ")
            .find_map(|p| p.strip_suffix(what)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no `{what}` in {line}"))
    };
    (n(" made"), n(" acknowledged"), n(" dropped"), n(" undelivered"))
}

/// The data flows (h1 → h3, h2 → h4) by (source host, UDP source port).
fn flows_by_id(flows: &Value, id: &str) -> Option<Value> {
    flows.as_array()?.iter().find(|f| f["id"] == id).cloned()
}

fn data_flows(flows: &Value) -> BTreeMap<(u8, u16), Value> {
    let mut out = BTreeMap::new();
    for f in flows.as_array().unwrap() {
        for (src, dst) in [(1u8, 3u8), (2, 4)] {
            if f["src_ip"] == Lab::host_ip(src, false).to_string()
                && f["dst_ip"] == Lab::host_ip(dst, false).to_string()
            {
                let key = (src, f["udp_sport"].as_u64().unwrap() as u16);
                assert!(
                    out.insert(key, f.clone()).is_none(),
                    "{key:?} twice in the group's view"
                );
            }
        }
    }
    out
}

#[test]
fn a_group_on_nats_locates_a_rewrite_through_losing_a_member_and_a_nats_restart() {
    if !require_root() {
        return;
    }
    let lab = Lab {
        prefix: "rtf".into(),
        ..Lab::default()
    };
    lab.down().unwrap();
    lab.up().unwrap();
    let mut fab = Fabric {
        lab: lab.clone(),
        dir: TempDir::new("fleet-lab"),
        nats: None,
        collectors: BTreeMap::new(),
        agents: Vec::new(),
    };
    fab.start_nats();
    for m in 1..=3 {
        fab.start_collector(&format!("c{m}"), m);
    }
    fab.group_settles();
    let url = Fabric::nats_url();
    for n in Lab::nodes() {
        let mut args = lab.agent_args(&n, "unused:1", "unused", 4).unwrap();
        for flag in ["--collector", "--token"] {
            let at = args.iter().position(|a| a == flag).unwrap();
            args.drain(at..at + 2);
        }
        args.extend(["--nats-url", &url, "--nats-partitions", "16"].map(String::from));
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        let d = Daemon::start(&lab.ns(&n), &a, "publishing to NATS");
        fab.agents.push((n, d));
    }
    lab.apply(&Fault::DscpRewrite {
        spine: 1,
        from: 26,
        to: 0,
    })
    .unwrap();

    // Traffic for 16 s: h1 → h3 and h2 → h4, 8 QPs each.
    let secs = 16;
    let mut responders = Vec::new();
    for h in [3u8, 4] {
        let ip = Lab::host_ip(h, false).to_string();
        let dur = format!("{}s", secs + 2);
        responders.push(spawn_gen(
            &lab.ns(&format!("h{h}")),
            &["--bind", &ip, "--duration", &dur],
        ));
    }
    std::thread::sleep(Duration::from_millis(300));
    let mut senders = Vec::new();
    for (src, dst) in [(1u8, 3u8), (2, 4)] {
        let ip = Lab::host_ip(dst, false).to_string();
        let dur = format!("{secs}s");
        senders.push(spawn_gen(
            &lab.ns(&format!("h{src}")),
            &["--to", &ip, "--qps", "8", "--rate", "4mbit", "--duration", &dur],
        ));
    }
    let started = Instant::now();
    let at = |s: u64| {
        let t = started + Duration::from_secs(s);
        std::thread::sleep(t.saturating_duration_since(Instant::now()));
    };

    // At 3 s the member holding the most joined flows dies (SIGKILL: no hand-over). Only
    // two host pairs carry traffic, so only the partitions of those two have work; which
    // member owns them depends on the lease race, so the victim is chosen by what it
    // holds, not by how many partitions it owns. Later faults keep their spacing from it.
    at(3);
    let owned: Vec<u64> = fab
        .collectors
        .keys()
        .map(|id| fab.metric(id, "roce_trace_collector_fleet_partitions_owned"))
        .collect();
    assert!(
        owned.iter().all(|n| *n < PARTITIONS),
        "each owns a share: {owned:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(3);
    let (local, dead) = loop {
        let busiest = fab
            .collectors
            .keys()
            .map(|id| {
                let flows = serde_json::from_str::<Vec<Value>>(&fab.get(id, "/flows?local=1"));
                (flows.unwrap().len(), id.clone())
            })
            .max()
            .unwrap();
        if busiest.0 > 0 || Instant::now() >= deadline {
            break busiest;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        local > 0,
        "no member had joined a flow 6 s into the run\n{}",
        fab.logs()
    );
    let started = started + started.elapsed() - Duration::from_secs(3);
    let at = |s: u64| {
        let t = started + Duration::from_secs(s);
        std::thread::sleep(t.saturating_duration_since(Instant::now()));
    };
    fab.collectors.remove(&dead).unwrap().kill();

    // … from 4 s to 8 s the spine doing the rewrite cannot reach NATS (its management
    // link drops everything): its agent buffers and delivers seconds after the others,
    // long past the trajectory timeout …
    at(4);
    let cut = "add table inet rtlag; add chain inet rtlag out { type filter hook output priority 0; }; add rule inet rtlag out tcp dport 4222 drop";
    lab.exec("s1", &["nft", cut]).unwrap();
    at(8);
    lab.exec("s1", &["nft", "delete table inet rtlag"]).unwrap();

    // … at 10 s the NATS server dies too (SIGKILL), and comes back at 12 s on its store.
    at(10);
    let mut n = fab.nats.take().unwrap();
    n.signal(libc::SIGKILL);
    n.wait().unwrap();
    at(12);
    fab.start_nats();

    for s in senders {
        gen_report(s);
    }
    for r in responders {
        interrupt(r);
    }
    std::thread::sleep(Duration::from_millis(1500)); // the last counters and samples

    // Every agent delivered everything it made: NATS acknowledged each record.
    let mut acked = 0;
    for (node, a) in std::mem::take(&mut fab.agents) {
        let err: Arc<Mutex<String>> = a.stderr.clone();
        a.stop();
        // The last line, once the thread reading its stderr has it.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !err.lock().unwrap().contains("agent stopped") && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let log = err.lock().unwrap().clone();
        let (made, ack, dropped, undelivered) = observations_account(&log);
        assert_eq!(
            (ack, dropped, undelivered),
            (made, 0, 0),
            "{node}: every observation acknowledged by JetStream"
        );
        acked += ack;
    }
    assert!(acked > 1000, "{acked} observations");

    // The survivors took the dead member's partitions over and replayed them: the group
    // holds every observation acknowledged, each once.
    fab.group_settles();
    let survivor = fab.collectors.keys().next().unwrap().clone();
    let (flows, stats) = fab.group_joined(&survivor, acked);
    assert_eq!(stats["duplicates"], 0, "{stats}");

    // Continuous verification: one member judges the group's view (the least id among
    // the living, whichever died), and the group's history has the rewrite failing
    // data_class with flows through s1 as evidence.
    let judging: Vec<(String, u64)> = fab
        .collectors
        .keys()
        .map(|id| (id.clone(), fab.metric(id, "roce_trace_verify_judging")))
        .collect();
    assert_eq!(
        judging
            .iter()
            .filter(|(_, j)| *j == 1)
            .map(|(id, _)| id.as_str())
            .collect::<Vec<_>>(),
        vec![fab.collectors.keys().next().unwrap().as_str()],
        "{judging:?}"
    );
    let verdicts = fab.json(&survivor, "/verdicts?check=data_class");
    let failed: Vec<&Value> = verdicts["events"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|e| e["changes"].as_array().unwrap())
        .filter(|c| c["to"] == "fail")
        .collect();
    assert!(
        !failed.is_empty(),
        "data_class never failed in the group's history: {verdicts:#}"
    );
    for c in &failed {
        assert!(!c["evidence"].as_array().unwrap().is_empty(), "{c:#}");
        for e in c["evidence"].as_array().unwrap() {
            let f = flows_by_id(&flows, e["flow"].as_str().unwrap());
            assert!(
                f.is_some_and(|f| f["path"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|p| p.as_str().unwrap().starts_with("s1:"))),
                "{} is evidence but not through s1",
                e["flow"]
            );
        }
    }

    // Every flow once, with its path and the rewrite located at s1 for exactly the
    // flows through it.
    let ids: Vec<&Value> = flows.as_array().unwrap().iter().map(|f| &f["id"]).collect();
    let unique: BTreeSet<String> = ids.iter().map(|i| i.to_string()).collect();
    assert_eq!(unique.len(), ids.len(), "a flow twice in the group's view");
    let data = data_flows(&flows);
    assert_eq!(data.len(), 16, "{:?}", data.keys());
    let mut through_s1 = 0;
    for ((src, sport), f) in &data {
        let dst = src + 2;
        let spine = lab.spine_for(*src, dst, *sport, false).unwrap();
        let path: Vec<&str> = f["path"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_str().unwrap())
            .collect();
        assert_eq!(path.len(), 8, "h{src} sport {sport}: {path:?}");
        assert_eq!(
            path[3],
            format!("s{spine}:l{}:ingress", leaf_of(*src)),
            "h{src} sport {sport}"
        );
        let changes = f["class_changes"].as_array().unwrap();
        if spine == 1 {
            through_s1 += 1;
            assert_eq!(changes.len(), 1, "h{src} sport {sport}: {changes:?}");
            let leaf_in = format!("s1:l{}:ingress", leaf_of(*src));
            let leaf_out = format!("s1:l{}:egress", leaf_of(dst));
            assert_eq!(changes[0]["between"], serde_json::json!([leaf_in, leaf_out]));
            assert_eq!(
                (changes[0]["from_dscp"].as_u64(), changes[0]["to_dscp"].as_u64()),
                (Some(26), Some(0))
            );
        } else {
            assert!(changes.is_empty(), "h{src} sport {sport} through s2: {changes:?}");
        }
        assert!(
            f["lost"].as_array().unwrap().is_empty() && f["unobserved"].as_array().unwrap().is_empty(),
            "h{src} sport {sport}: nothing lost on a fabric that drops nothing: {} {}",
            f["lost"],
            f["unobserved"]
        );
    }
    assert!(through_s1 > 0 && through_s1 < 16, "{through_s1} of 16 through s1");
    // The group's map, from a member that holds only part of the flows: the whole fabric
    // in its tiers, the rewrite at s1 and nowhere else.
    let map = fab.get(&survivor, "/ui/main");
    for (node, tier, marks) in [
        ("h1", 0, ""),
        ("h2", 0, ""),
        ("h3", 0, ""),
        ("h4", 0, ""),
        ("l1", 1, ""),
        ("l2", 1, ""),
        ("s1", 2, "class_change"),
        ("s2", 2, ""),
    ] {
        let want = format!(r#"data-node="{node}" data-tier="{tier}" data-marks="{marks}""#);
        assert!(map.contains(&want), "{want} not in the group's map: {map}");
    }
    let marked = map
        .split("data-marks=\"")
        .skip(1)
        .filter(|m| m.split('"').next().unwrap().contains("class_change"))
        .count();
    assert_eq!(marked, 1, "one place marked for the rewrite: {map}");
    // Each rewritten flow's page, asked of that one member, wherever its partition is
    // read: the change drawn between s1's two points.
    for ((src, sport), f) in &data {
        if lab.spine_for(*src, src + 2, *sport, false).unwrap() != 1 {
            continue;
        }
        let id = f["id"].as_str().unwrap();
        let page = fab.get(
            &survivor,
            &format!("/ui/flow?id={}", roce_trace::http::percent_encode(id)),
        );
        let hop = format!(
            r#"<g class="hop marked" data-from="s1:l{}:ingress" data-to="s1:l{}:egress" data-marks="class_change">"#,
            leaf_of(*src),
            leaf_of(src + 2)
        );
        assert!(page.contains(&hop), "{id}: {hop} not in {page}");
    }

    // What one collector makes of everything in the stream: the survivors stop, one
    // fresh member joins alone and replays every partition. The group's view must be
    // the same, flow by flow, to the packet.
    for (_, c) in std::mem::take(&mut fab.collectors) {
        c.stop();
    }
    fab.start_collector("c9", 9);
    fab.group_settles();
    let (one_flows, one_stats) = fab.group_joined("c9", acked);
    let by_id = |flows: &Value| -> BTreeMap<String, Value> {
        flows
            .as_array()
            .unwrap()
            .iter()
            .map(|f| (f["id"].to_string(), f.clone()))
            .collect()
    };
    let (one, group) = (by_id(&one_flows), by_id(&flows));
    assert_eq!(
        one.keys().collect::<Vec<_>>(),
        group.keys().collect::<Vec<_>>(),
        "the same flows"
    );
    let differ: Vec<String> = group
        .iter()
        .filter(|(id, f)| **f != one[*id])
        .map(|(id, f)| {
            let keys: Vec<&String> = f
                .as_object()
                .unwrap()
                .iter()
                .filter(|(k, v)| one[id].get(k.as_str()) != Some(v))
                .map(|(k, _)| k)
                .collect();
            format!(
                "{id}: {keys:?} differ (trajectories {} vs {})",
                f["trajectories"], one[id]["trajectories"]
            )
        })
        .collect();
    assert!(
        differ.is_empty(),
        "the group's view differs from one collector's:\n{}",
        differ.join("\n")
    );
    assert_eq!(one_stats, stats, "the group's totals are one collector's");
}
