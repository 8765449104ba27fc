//! Agents on every node of the lab (hosts and the Linux switches) and a collector on the
//! management network: the collector locates a DSCP rewrite at the spine that does it,
//! only for the flows through it; finds where CE marks begin and the CNPs that answer
//! them; and, when a link fails, the packets lost and the path change.

use std::{collections::BTreeMap, sync::Mutex, time::Duration};

use roce_trace_tests::{
    lab::{Fault, Lab, Observers},
    *,
};
use serde_json::Value;

static SERIAL: Mutex<()> = Mutex::new(());
const TOKEN: &str = "lab-token";

struct Fabric {
    lab: Lab,
    _dir: TempDir,
    obs: Option<Observers>,
}

impl Fabric {
    fn up(tag: &str) -> Self {
        let lab = Lab {
            prefix: format!("rtc{tag}"),
            ..Lab::default()
        };
        lab.down().unwrap();
        lab.up().unwrap();
        let dir = TempDir::new(&format!("collab-{tag}"));
        let obs = Observers::start(&lab, dir.path("report.json"), TOKEN, &["--trace"]);
        Self {
            lab,
            _dir: dir,
            obs: Some(obs),
        }
    }

    /// Stops agents, then the collector; returns its report.
    fn report(&mut self) -> Value {
        let report = self.obs.take().unwrap().stop();
        serde_json::from_str(&std::fs::read_to_string(report).unwrap()).unwrap()
    }
}

impl Drop for Fabric {
    fn drop(&mut self) {
        self.obs.take();
        let _ = self.lab.down();
    }
}

/// h1 → h3 on 8 QPs for `secs`; runs `during` halfway.
fn traffic(l: &Lab, secs: u64, during: impl FnOnce()) {
    let resp = spawn_gen(
        &l.ns("h3"),
        &["--bind", "10.10.3.2", "--duration", &format!("{}s", secs + 2)],
    );
    std::thread::sleep(Duration::from_millis(300));
    let send = spawn_gen(
        &l.ns("h1"),
        &[
            "--to",
            "10.10.3.2",
            "--qps",
            "8",
            "--rate",
            "4mbit",
            "--duration",
            &format!("{secs}s"),
        ],
    );
    std::thread::sleep(Duration::from_secs(secs / 2));
    during();
    gen_report(send);
    interrupt(resp);
    std::thread::sleep(Duration::from_millis(1500)); // last counters and samples in
}

fn data_flows(r: &Value) -> BTreeMap<u16, Value> {
    r["flows"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["src_ip"] == "10.10.1.2" && f["dst_ip"] == "10.10.3.2")
        .map(|f| (f["udp_sport"].as_u64().unwrap() as u16, f.clone()))
        .collect()
}

#[test]
fn class_rewrite_is_located_at_the_spine_and_ce_marks_draw_cnps() {
    if !require_root() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut fab = Fabric::up("a");
    let l = fab.lab.clone();
    l.apply(&Fault::DscpRewrite {
        spine: 1,
        from: 26,
        to: 0,
    })
    .unwrap();
    l.apply(&Fault::CeMark {
        node: "l2".into(),
        iface: "h3".into(),
        percent: 20,
    })
    .unwrap();
    traffic(&l, 6, || {});
    let r = fab.report();
    let flows = data_flows(&r);
    assert_eq!(flows.len(), 8, "{:?}", flows.keys());
    let mut through_s1 = 0;
    for (sport, f) in &flows {
        let spine = l.spine_for(1, 3, *sport, false).unwrap();
        let path: Vec<&str> = f["path"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_str().unwrap())
            .collect();
        assert_eq!(
            path.len(),
            8,
            "h1 out, l1 in/out, spine in/out, l2 in/out, h3 in: {path:?}"
        );
        assert_eq!(path[3], format!("s{spine}:l1:ingress"), "sport {sport}");
        assert_eq!(
            f["hops"],
            serde_json::json!([0, 1, 0, 1, 0, 1, 0]),
            "TTL drops at each router"
        );
        let changes = f["class_changes"].as_array().unwrap();
        if spine == 1 {
            through_s1 += 1;
            assert_eq!(changes.len(), 1, "sport {sport}: {changes:?}");
            assert_eq!(
                changes[0]["between"],
                serde_json::json!(["s1:l1:ingress", "s1:l2:egress"])
            );
            assert_eq!(
                (changes[0]["from_dscp"].as_u64(), changes[0]["to_dscp"].as_u64()),
                (Some(26), Some(0))
            );
        } else {
            assert!(
                changes.is_empty(),
                "sport {sport} through s2 keeps its class: {changes:?}"
            );
        }
        // CE marks begin at l2's port to h3.
        let ce = f["ce_onset"].as_array().unwrap();
        assert_eq!(ce.len(), 1, "sport {sport}: {ce:?}");
        assert_eq!(ce[0]["at"], "l2:h3:egress");
        assert_eq!(ce[0]["after"], format!("l2:s{spine}:ingress"));
        // … and the CNPs that answered them, charged to this flow.
        let ans = &f["answered_by"];
        assert_eq!(ans["flows"].as_array().unwrap().len(), 1, "sport {sport}: {ans}");
        let per = ans["cnps_per_ce_mark"].as_f64().unwrap();
        assert!(
            per > 0.5 && per <= 1.0,
            "sport {sport}: {per} CNPs per CE mark at 4 Mbit/s (one per 50 µs at most)"
        );
        assert!(ans["ce_to_cnp"]["n"].as_u64().unwrap() > 0);
        assert!(
            f["lost"].as_array().unwrap().is_empty(),
            "sport {sport}: nothing lost"
        );
        // The collector had h1's agent trace the flow: its hops, and the class each saw.
        let probe = &f["probe"];
        let hops: Vec<&str> = probe["hops"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h["addr"].as_str().unwrap_or("*"))
            .collect();
        let want_spine = format!("10.21.{spine}.2");
        let want_leaf = format!("10.22.{spine}.1");
        assert_eq!(
            &hops[..3],
            ["10.10.1.1", want_spine.as_str(), want_leaf.as_str()],
            "sport {sport}: {probe}"
        );
        let want_change = if spine == 1 {
            serde_json::json!(2)
        } else {
            Value::Null
        };
        assert_eq!(probe["class_changed_at"], want_change, "sport {sport}");
    }
    assert!(through_s1 > 0 && through_s1 < 8);
    let kinds: Vec<&str> = r["anomalies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["kind"].as_str().unwrap())
        .collect();
    // The ACKs of each QP leave h3 from that QP's own port (as a NIC sends them), so some
    // take s1 too and are rewritten: a class change each, on the reverse flow.
    let acks_through_s1 = (0..8u32)
        .filter(|i| {
            let port = roce_trace_gen::traffic::reply_port(0x101 + 2 * i);
            l.spine_for(3, 1, port, false).unwrap() == 1
        })
        .count();
    assert_eq!(
        kinds.iter().filter(|k| **k == "class_change").count(),
        through_s1 + acks_through_s1
    );
}

#[test]
fn a_failed_link_shows_lost_packets_then_the_new_path() {
    if !require_root() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut fab = Fabric::up("b");
    let l = fab.lab.clone();
    traffic(&l, 8, || {
        // s1 loses its link to l2; routing takes a second to notice.
        l.exec("s1", &["ip", "link", "set", "l2", "down"]).unwrap();
        std::thread::sleep(Duration::from_secs(1));
        l.routes().unwrap();
    });
    let r = fab.report();
    let flows = data_flows(&r);
    let moved: Vec<_> = flows
        .iter()
        .filter(|(_, f)| f["path_history"].as_array().unwrap().len() > 1)
        .collect();
    assert!(!moved.is_empty(), "some flows went through s1");
    for (sport, f) in &moved {
        let lost = f["lost"].as_array().unwrap();
        // Dropped at s1 (no route once its port to l2 is down) — and possibly a packet
        // already on that link when it went down.
        let at_s1 = lost
            .iter()
            .find(|l| l["between"] == serde_json::json!(["s1:l1:ingress", "s1:l2:egress"]))
            .unwrap_or_else(|| panic!("sport {sport}: {lost:?}"));
        assert!(at_s1["packets"].as_u64().unwrap() > 0);
        // Anything lost elsewhere is at most a stray packet (a veth under a loaded CI
        // machine can really drop one; the collector then says where): the failure's
        // losses are all at s1 or on its link to l2.
        let elsewhere: u64 = lost
            .iter()
            .filter(|l| {
                l["between"] != serde_json::json!(["s1:l1:ingress", "s1:l2:egress"])
                    && l["between"] != serde_json::json!(["s1:l2:egress", "l2:s1:ingress"])
            })
            .map(|l| l["packets"].as_u64().unwrap())
            .sum();
        assert!(elsewhere <= 1, "sport {sport}: losses away from s1: {lost:?}");
        let hist = f["path_history"].as_array().unwrap();
        assert!(
            hist[0]["path"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p == "s1:l1:ingress")
        );
        assert!(
            hist.last().unwrap()["path"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p == "s2:l1:ingress")
        );
    }
    for (sport, f) in flows
        .iter()
        .filter(|(_, f)| f["path_history"].as_array().unwrap().len() == 1)
    {
        assert!(
            f["lost"].as_array().unwrap().is_empty(),
            "sport {sport} stayed on s2 and lost nothing"
        );
    }
}
