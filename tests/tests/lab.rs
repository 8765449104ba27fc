//! The virtual fabric guards itself: up/down/up is clean, ECMP spreads source ports over
//! both spines exactly as the leaves' FIB says, and every fault shows with plain tools.

use std::{collections::BTreeMap, sync::Mutex, time::Duration};

use roce_trace_tests::{
    lab::{Fault, Lab, LabGuard},
    *,
};
use serde_json::Value;

static SERIAL: Mutex<()> = Mutex::new(());

fn lab() -> Lab {
    Lab {
        prefix: "rtlt".into(),
        ..Lab::default()
    }
}

/// Runs `qps` QPs from host `src` to host `dst` for `secs` at `rate` per QP; returns the
/// sender's and the responder's reports.
fn traffic(l: &Lab, src: u8, dst: u8, qps: u32, rate: &str, secs: &str) -> (Value, Value) {
    let d = Lab::host_ip(dst, false).to_string();
    let resp = spawn_gen(&l.ns(&format!("h{dst}")), &["--bind", &d, "--duration", "6s"]);
    std::thread::sleep(Duration::from_millis(300));
    let q = qps.to_string();
    let send = spawn_gen(
        &l.ns(&format!("h{src}")),
        &[
            "--to",
            &d,
            "--qps",
            &q,
            "--msg-size",
            "4KiB",
            "--rate",
            rate,
            "--duration",
            secs,
        ],
    );
    let s = gen_report(send);
    // The responder runs for a fixed 6 s; stop it early.
    // SAFETY: signalling our own child.
    unsafe { libc::kill(resp.id() as i32, libc::SIGINT) };
    (s, gen_report(resp))
}

/// (UDP source port → set of (DSCP, ECN)) of the RoCE requests in a capture.
/// Per UDP source port of the requests in `pcap`: the (DSCP, ECN) classes seen, and how
/// many requests.
fn classes_by_sport(pcap: &std::path::Path) -> BTreeMap<u16, (std::collections::BTreeSet<(u8, u8)>, u64)> {
    let mut m: BTreeMap<u16, (std::collections::BTreeSet<(u8, u8)>, u64)> = BTreeMap::new();
    for r in tshark_fields(
        pcap,
        &["udp.srcport", "ip.dsfield.dscp", "ip.dsfield.ecn", "udp.dstport"],
    ) {
        if r[3] == "4791" && r[0] != "4791" {
            let e = m.entry(r[0].parse().unwrap()).or_default();
            e.0.insert((r[1].parse().unwrap(), r[2].parse().unwrap()));
            e.1 += 1;
        }
    }
    m
}

/// h1 → h3 on 8 QPs for a second; the classes each source port arrived at h3 with
/// (tcpdump on h3's port). Every QP's requests all arrived — a fault that drops instead
/// of remarking, or a capture that saw nothing, fails here.
fn classes_arriving_at_h3(
    l: &Lab,
    dir: &TempDir,
    name: &str,
) -> BTreeMap<u16, std::collections::BTreeSet<(u8, u8)>> {
    let pcap = dir.path(&format!("{name}.pcap"));
    let dump = start_tcpdump(
        &l.ns("h3"),
        "eth0",
        &pcap,
        "udp dst port 4791 and dst host 10.10.3.2",
    );
    let (s, _) = traffic(l, 1, 3, 8, "2mbit", "1s");
    interrupt(dump);
    let got = classes_by_sport(&pcap);
    let sent: BTreeMap<u16, u64> = s["senders"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| {
            (
                q["udp_sport"].as_u64().unwrap() as u16,
                q["packets"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(sent.len(), 8, "{s}");
    assert_eq!(
        got.iter().map(|(p, (_, n))| (*p, *n)).collect::<BTreeMap<_, _>>(),
        sent,
        "{name}: every request of every QP arrived at h3 (port: requests)"
    );
    assert!(sent.values().all(|&n| n > 100), "{sent:?}");
    got.into_iter().map(|(p, (c, _))| (p, c)).collect()
}

fn spines_by_sport(l: &Lab, src: u8, dst: u8, qps: u16) -> BTreeMap<u16, u8> {
    (0..qps)
        .map(|i| (49152 + i, l.spine_for(src, dst, 49152 + i, false).unwrap()))
        .collect()
}

#[test]
fn up_down_up_leaves_nothing_behind() {
    if !require_root() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let l = lab();
    l.down().unwrap();
    let root_links = sh(&["ip", "-o", "link"]);
    l.up().unwrap();
    l.up().unwrap(); // idempotent
    assert!(l.is_up().unwrap());
    for (src, dst, v6) in [(1u8, 3u8, false), (2, 4, true), (4, 1, false)] {
        let d = Lab::host_ip(dst, v6).to_string();
        l.exec(&format!("h{src}"), &["ping", "-c", "1", "-W", "2", &d])
            .unwrap();
    }
    l.down().unwrap();
    l.down().unwrap(); // idempotent
    let left = sh(&["ip", "netns", "list"]);
    assert!(!left.contains("rtlt-"), "namespaces left: {left}");
    assert_eq!(
        sh(&["ip", "-o", "link"]),
        root_links,
        "no link left in the root namespace"
    );
    l.up().unwrap();
    l.exec("h1", &["ping", "-c", "1", "-W", "2", "fd00:10:3::2"])
        .unwrap();
    l.down().unwrap();
}

#[test]
fn ecmp_spreads_source_ports_over_both_spines() {
    if !require_root() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let up = LabGuard::up("rtlt");
    let l = &up.0;
    for v6 in [false, true] {
        let per: Vec<u8> = (0..64)
            .map(|i| l.spine_for(1, 3, 49152 + i, v6).unwrap())
            .collect();
        let on_s1 = per.iter().filter(|&&s| s == 1).count();
        assert!((16..=48).contains(&on_s1), "v6={v6}: {on_s1} of 64 ports on s1");
    }
    // Real traffic follows the FIB: count h1's requests on each spine.
    for s in [1, 2] {
        l.exec(&format!("s{s}"), &["nft", "add", "table", "inet", "rtlt_count"])
            .unwrap();
        l.exec(
            &format!("s{s}"),
            &[
                "nft",
                "add",
                "chain",
                "inet",
                "rtlt_count",
                "c",
                "{ type filter hook forward priority 0; }",
            ],
        )
        .unwrap();
        l.exec(
            &format!("s{s}"),
            &[
                "nft",
                "add",
                "rule",
                "inet",
                "rtlt_count",
                "c",
                "ip",
                "saddr",
                "10.10.1.2",
                "udp",
                "dport",
                "4791",
                "counter",
            ],
        )
        .unwrap();
    }
    let map = spines_by_sport(l, 1, 3, 8);
    let (s, _) = traffic(l, 1, 3, 8, "5mbit", "1s");
    let mut want = [0u64; 3];
    for q in s["senders"].as_array().unwrap() {
        want[map[&(q["udp_sport"].as_u64().unwrap() as u16)] as usize] += q["packets"].as_u64().unwrap();
    }
    for sp in [1, 2] {
        let out = l
            .exec(&format!("s{sp}"), &["nft", "list", "table", "inet", "rtlt_count"])
            .unwrap();
        let got: u64 = out
            .split("packets ")
            .nth(1)
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(got, want[sp as usize], "spine {sp}");
        assert!(got > 0, "spine {sp} carried traffic");
    }
}

#[test]
fn each_fault_shows_with_plain_tools() {
    if !require_root() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let up = LabGuard::up("rtlt");
    let l = &up.0;
    let dir = TempDir::new("labfaults");
    let map = spines_by_sport(l, 1, 3, 8);
    assert!(
        map.values().any(|&s| s == 1) && map.values().any(|&s| s == 2),
        "{map:?}"
    );

    // DSCP rewrite at s1: requests through s1 arrive with DSCP 0, through s2 with 26.
    let f = Fault::DscpRewrite {
        spine: 1,
        from: 26,
        to: 0,
    };
    l.apply(&f).unwrap();
    for (sport, classes) in classes_arriving_at_h3(l, &dir, "dscp") {
        let want = if map[&sport] == 1 { 0 } else { 26 };
        assert_eq!(
            classes.iter().map(|c| c.0).collect::<Vec<_>>(),
            [want],
            "sport {sport}"
        );
    }
    l.clear(&f).unwrap();
    l.clear(&f).unwrap(); // clearing twice is fine

    // CE marking on l1's port to s1: requests through s1 arrive CE, through s2 ECT(0).
    let f = Fault::CeMark {
        node: "l1".into(),
        iface: "s1".into(),
        percent: 100,
    };
    l.apply(&f).unwrap();
    for (sport, classes) in classes_arriving_at_h3(l, &dir, "ce") {
        let ecn = if map[&sport] == 1 { 3 } else { 2 };
        assert_eq!(
            classes.iter().map(|c| c.1).collect::<Vec<_>>(),
            [ecn],
            "sport {sport}"
        );
    }
    l.clear(&f).unwrap();

    // Bottleneck: a token bucket on l2's port to h3 drops what exceeds it.
    let f = Fault::Bottleneck {
        node: "l2".into(),
        iface: "h3".into(),
        rate: "10mbit".into(),
    };
    l.apply(&f).unwrap();
    traffic(l, 1, 3, 4, "20mbit", "1s");
    let q = l.exec("l2", &["tc", "-s", "qdisc", "show", "dev", "h3"]).unwrap();
    assert!(q.contains("tbf") && q.contains("rate 10Mbit"), "{q}");
    let dropped: u64 = q
        .split("dropped ")
        .nth(1)
        .unwrap()
        .split(',')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(dropped > 100, "{q}");
    l.clear(&f).unwrap();
    assert!(
        !l.exec("l2", &["tc", "qdisc", "show", "dev", "h3"])
            .unwrap()
            .contains("tbf")
    );

    // Link down: l1's port to s1 is down and every flow takes s2; traffic still flows.
    let f = Fault::LinkDown { leaf: 1, spine: 1 };
    l.apply(&f).unwrap();
    assert!(
        l.exec("l1", &["ip", "-br", "link", "show", "s1"])
            .unwrap()
            .contains("DOWN")
    );
    assert!(spines_by_sport(l, 1, 3, 8).values().all(|&s| s == 2));
    l.exec("h1", &["ping", "-c", "1", "-W", "2", "10.10.3.2"])
        .unwrap();
    l.clear(&f).unwrap();
    assert_eq!(
        spines_by_sport(l, 1, 3, 8),
        map,
        "the same ports take the same spines again"
    );

    // Link down without a routing protocol: l1 stops using s1 at once (every port of
    // h1 → h3 takes s2), but l2 is not told and still hashes traffic to h1 onto s1, which
    // has no route there any more.
    let f = Fault::LinkDownStatic { leaf: 1, spine: 1 };
    l.apply(&f).unwrap();
    assert!(spines_by_sport(l, 1, 3, 8).values().all(|&s| s == 2));
    let back = spines_by_sport(l, 3, 1, 8);
    assert!(back.values().any(|&s| s == 1), "{back:?}");
    let err = l.exec("s1", &["ip", "route", "get", "10.10.1.2"]).unwrap_err();
    assert!(format!("{err:#}").contains("unreachable"), "{err:#}");
    l.clear(&f).unwrap();
    assert_eq!(spines_by_sport(l, 1, 3, 8), map);
    assert_eq!(spines_by_sport(l, 3, 1, 8), back);
    l.exec("s1", &["ip", "route", "get", "10.10.1.2"]).unwrap();

    // Spine down: everything through s1.
    let f = Fault::SpineDown { spine: 2 };
    l.apply(&f).unwrap();
    assert!(spines_by_sport(l, 1, 3, 8).values().all(|&s| s == 1));
    l.exec("h2", &["ping", "-6", "-c", "1", "-W", "2", "fd00:10:4::2"])
        .unwrap();
    l.clear(&f).unwrap();
    assert_eq!(spines_by_sport(l, 1, 3, 8), map);

    // ECMP imbalance: l1 hashes on addresses only, so every port of a host pair takes one
    // spine (`ip route get` with the ports is what the FIB decides).
    let f = Fault::EcmpL3 { leaf: 1 };
    l.apply(&f).unwrap();
    let one: std::collections::BTreeSet<u8> = spines_by_sport(l, 1, 3, 8).into_values().collect();
    assert_eq!(one.len(), 1, "{one:?}");
    assert!(l.status().unwrap().contains("ecmp_l3"));
    l.clear(&f).unwrap();
    assert_eq!(spines_by_sport(l, 1, 3, 8), map);

    // MTU below the RoCE path MTU on l1–s1: 1 KiB RoCE packets (1068-byte IP, DF) through
    // s1 never arrive; through s2 they do.
    let f = Fault::Mtu {
        leaf: 1,
        spine: 1,
        mtu: 1000,
    };
    l.apply(&f).unwrap();
    assert!(
        l.exec("l1", &["ip", "link", "show", "s1"])
            .unwrap()
            .contains("mtu 1000")
    );
    let (_, r) = traffic(l, 1, 3, 8, "2mbit", "1s");
    let arrived: BTreeMap<u64, u64> = r["responders"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| (q["qp"].as_u64().unwrap(), q["in_order"].as_u64().unwrap()))
        .collect();
    for (i, (_, spine)) in map.iter().enumerate() {
        let qp = 0x100 + 2 * i as u64 + 1;
        let n = arrived.get(&qp).copied().unwrap_or(0);
        if *spine == 1 {
            assert_eq!(n, 0, "QP {qp:#x} through the small-MTU link");
        } else {
            assert!(n > 0, "QP {qp:#x} through s2");
        }
    }
    l.clear(&f).unwrap();

    // Asymmetric class: what h3 sends is remarked at l2, what h1 sends is not.
    let f = Fault::AsymClass {
        leaf: 2,
        from: 26,
        to: 0,
    };
    l.apply(&f).unwrap();
    let (p1, p3) = (dir.path("at-h1.pcap"), dir.path("at-h3.pcap"));
    let d1 = start_tcpdump(
        &l.ns("h1"),
        "eth0",
        &p1,
        "udp dst port 4791 and src host 10.10.3.2",
    );
    let d3 = start_tcpdump(
        &l.ns("h3"),
        "eth0",
        &p3,
        "udp dst port 4791 and src host 10.10.1.2",
    );
    traffic(l, 1, 3, 2, "2mbit", "1s");
    traffic(l, 3, 1, 2, "2mbit", "1s");
    interrupt(d1);
    interrupt(d3);
    let at_h1 = tshark_fields(&p1, &["ip.dsfield.dscp"]);
    let at_h3 = tshark_fields(&p3, &["ip.dsfield.dscp"]);
    assert!(!at_h1.is_empty() && !at_h3.is_empty());
    assert!(at_h1.iter().all(|r| r[0] == "0"), "h3 → h1 remarked");
    assert!(at_h3.iter().all(|r| r[0] == "26"), "h1 → h3 untouched");
    l.clear(&f).unwrap();
    assert!(
        !l.status().unwrap().contains("faults:"),
        "{}",
        l.status().unwrap()
    );
}
