//! The pictures against hand-built reports: tiers from hop order whatever the names, marks
//! exactly where the join located them, hostile names escaped, lists bounded.

use std::net::IpAddr;

use roce_trace_correlate::report::{
    Anomaly, AnomalyKind, Answers, ClassAt, ClassChange, CollectorReport, DeliveryAt, Direction, FlowReport,
    Lost, Point, PointInfo, Span,
};
use roce_trace_verify::{
    checks::{CheckResult, Evidence, Load, Status},
    output::Verdict,
};

use crate::{
    esc,
    fabric::{Fabric, Mark, Place, natural},
    html, svg,
};

fn pt(s: &str) -> Point {
    s.parse().unwrap()
}

/// A flow along `path` (`node:iface:direction` each), DSCP 26 everywhere.
fn flow(id: &str, path: &[&str]) -> FlowReport {
    let path: Vec<Point> = path.iter().map(|p| pt(p)).collect();
    FlowReport {
        id: id.into(),
        src_ip: IpAddr::from([10, 0, 0, 1]),
        dst_ip: IpAddr::from([10, 0, 0, 2]),
        udp_sport: 49152,
        dest_qp: 0x101,
        hops: vec![0; path.len()],
        class: path
            .iter()
            .map(|p| ClassAt {
                point: p.clone(),
                dscp: 26,
                ecn: 2,
                pcp: None,
            })
            .collect(),
        cnp_class: Vec::new(),
        cnp_delivery: None,
        max_frame: Default::default(),
        class_seen: Vec::new(),
        delivery: (0..5)
            .map(|i| DeliveryAt {
                start_ns: i * 1_000_000_000,
                end_ns: (i + 1) * 1_000_000_000,
                bytes: 125_000,
                packets: 100,
                ce: i * 10,
            })
            .collect(),
        class_changes: Vec::new(),
        ce_onset: Vec::new(),
        lost: Vec::new(),
        unobserved: Vec::new(),
        delays: Vec::new(),
        path_history: Vec::new(),
        counters: Default::default(),
        trajectories: 10,
        answered_by: Answers {
            flows: Vec::new(),
            cnps_sent: 0,
            cnps: 0,
            cnps_lost: Vec::new(),
            ce_marks: 0,
            cnps_per_ce_mark: None,
            ce_to_cnp: None,
        },
        probe: None,
        path,
    }
}

fn point_info(p: &str) -> PointInfo {
    let p = pt(p);
    PointInfo {
        node: p.node,
        iface: p.iface,
        direction: p.direction.unwrap_or(Direction::Ingress),
        clock_synced: true,
        mtu: Some(1500),
        mtu_history: Vec::new(),
    }
}

/// Names that say nothing of a node's role: tiers must come from the paths. Hosts
/// `zeta` and `alpha` under leaf `m7`, `b2` under `m10`, spines `core` and `aa`; `lonely`
/// reports points but no path crosses it.
fn fabric_report() -> CollectorReport {
    let via = |spine: &str, id: &str| {
        flow(
            id,
            &[
                "zeta:e0:egress",
                "m7:zeta:ingress",
                &format!("m7:{spine}:egress"),
                &format!("{spine}:m7:ingress"),
                &format!("{spine}:m10:egress"),
                &format!("m10:{spine}:ingress"),
                "m10:b2:egress",
                "b2:e0:ingress",
            ],
        )
    };
    let mut hit = via("core", "zeta:1>b2/0x1");
    hit.class_changes.push(ClassChange {
        between: [pt("core:m7:ingress"), pt("core:m10:egress")],
        from_dscp: 26,
        to_dscp: 0,
        span: Span {
            first_ns: 1,
            last_ns: 2,
            packets: 7,
        },
    });
    hit.class[4].dscp = 0;
    hit.class[5].dscp = 0;
    hit.class[6].dscp = 0;
    hit.class[7].dscp = 0;
    let clean = via("aa", "zeta:2>b2/0x2");
    let local = flow(
        "alpha:3>zeta/0x3",
        &[
            "alpha:e0:egress",
            "m7:alpha:ingress",
            "m7:zeta:egress",
            "zeta:e0:ingress",
        ],
    );
    let mut lossy = via("aa", "alpha:4>b2/0x4");
    lossy.path[0] = pt("alpha:e0:egress");
    lossy.path[1] = pt("m7:alpha:ingress");
    lossy.lost.push(Lost {
        between: [pt("aa:m10:egress"), pt("m10:aa:ingress")],
        span: Span {
            first_ns: 1,
            last_ns: 2,
            packets: 3,
        },
        largest_frame: None,
        kernel_drops: Vec::new(),
    });
    let anomalies = vec![
        Anomaly {
            kind: AnomalyKind::ClassChange,
            flow: hit.id.clone(),
            between: vec![pt("core:m7:ingress"), pt("core:m10:egress")],
            detail: "DSCP 26 → 0".into(),
            packets: 7,
        },
        Anomaly {
            kind: AnomalyKind::Lost,
            flow: lossy.id.clone(),
            between: vec![pt("aa:m10:egress"), pt("m10:aa:ingress")],
            detail: "3 lost".into(),
            packets: 3,
        },
        Anomaly {
            kind: AnomalyKind::PathChange,
            flow: clean.id.clone(),
            between: vec![pt("m7:aa:egress")],
            detail: "moved".into(),
            packets: 1,
        },
    ];
    // Seen only from m10 on (the sender's host and leaf not watched for it).
    let partial = flow(
        "zeta:5>b2/0x5",
        &["m10:core:ingress", "m10:b2:egress", "b2:e0:ingress"],
    );
    let mut points: Vec<PointInfo> = [&hit, &clean, &local, &lossy, &partial]
        .iter()
        .flat_map(|f| f.path.iter().map(|p| point_info(&p.to_string())))
        .collect();
    points.push(point_info("lonely:e9:ingress"));
    CollectorReport {
        flows: vec![hit, clean, local, lossy, partial],
        anomalies,
        points,
        ..CollectorReport::empty()
    }
}

#[test]
fn tiers_come_from_hop_order_whatever_the_names() {
    let f = Fabric::of(&fabric_report());
    let tier = |n: &str| f.nodes[n].tier;
    for h in ["zeta", "alpha", "b2"] {
        assert_eq!(tier(h), Some(0), "{h}");
    }
    for l in ["m7", "m10"] {
        assert_eq!(tier(l), Some(1), "{l}");
    }
    for s in ["core", "aa"] {
        assert_eq!(tier(s), Some(2), "{s}");
    }
    assert_eq!(tier("lonely"), None);
    // Rows: hosts, leaves (m7 before m10: natural order), spines, then the unplaced.
    let rows: Vec<(Option<usize>, Vec<&str>)> = f
        .tiers()
        .into_iter()
        .map(|(t, v)| (t, v.into_iter().map(|n| n.name.as_str()).collect()))
        .collect();
    assert_eq!(
        rows,
        vec![
            (Some(0), vec!["alpha", "b2", "zeta"]),
            (Some(1), vec!["m7", "m10"]),
            (Some(2), vec!["aa", "core"]),
            (None, vec!["lonely"]),
        ]
    );
    // Links from consecutive points on different nodes, both ways as one.
    let links: Vec<(&str, &str)> = f.links.keys().map(|(a, b)| (a.as_str(), b.as_str())).collect();
    assert_eq!(
        links,
        vec![
            ("aa", "m10"),
            ("aa", "m7"),
            ("alpha", "m7"),
            ("b2", "m10"),
            ("core", "m10"),
            ("core", "m7"),
            ("m7", "zeta"),
        ]
    );
    assert_eq!(f.links[&("m7".into(), "zeta".into())].flows.len(), 3);
}

#[test]
fn marks_land_exactly_where_the_join_located_them() {
    let f = Fabric::of(&fabric_report());
    let marked: Vec<(String, Vec<Mark>)> = f
        .nodes
        .values()
        .filter(|n| !n.marks.is_empty())
        .map(|n| (n.name.clone(), n.marks.keys().copied().collect()))
        .chain(
            f.links
                .values()
                .filter(|l| !l.marks.is_empty())
                .map(|l| (format!("{}-{}", l.a, l.b), l.marks.keys().copied().collect())),
        )
        .collect();
    // The rewrite inside `core` marks `core` (not its links); the loss between aa's
    // egress and m10's ingress marks that link; a path change marks no place.
    assert_eq!(
        marked,
        vec![
            ("core".to_string(), vec![Mark::ClassChange]),
            ("aa-m10".to_string(), vec![Mark::Lost]),
        ]
    );
    assert!(f.nodes["core"].marks[&Mark::ClassChange].contains("zeta:1>b2/0x1"));
    // One port alone is the link it faces.
    assert_eq!(
        f.place_of(&[pt("m7:core:egress")]),
        Some(Place::Link("core".into(), "m7".into()))
    );
    assert_eq!(f.place_of(&[pt("lonely")]), Some(Place::Node("lonely".into())));
}

#[test]
fn the_map_carries_tiers_and_marks_escapes_names_and_bounds_its_lists() {
    let mut r = fabric_report();
    // A hostile node name, and a link with more flows than any element lists.
    r.points.push(point_info("<script>alert(1)</script>:e0:ingress"));
    for i in 0..(crate::MAX_LISTED + 5) {
        r.flows.push(flow(
            &format!("x:{i}>y/0x{i:x}"),
            &["x:e0:egress", "y:e0:ingress"],
        ));
    }
    let s = svg::map(&Fabric::of(&r));
    assert!(!s.contains("<script"), "unescaped name");
    assert!(
        s.contains("data-node=\"&lt;script&gt;alert(1)&lt;/script&gt;\""),
        "{s}"
    );
    assert_eq!(
        esc(r#"<a href="x">'&'</a>"#),
        "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;"
    );
    assert!(
        s.contains(r#"data-node="core" data-tier="2" data-marks="class_change""#),
        "{s}"
    );
    assert!(s.contains(r#"data-node="m10" data-tier="1" data-marks="""#));
    assert!(s.contains(r#"data-a="aa" data-b="m10" data-marks="lost""#));
    // A click lists the flows a mark names first, and each mark's flows are at hand.
    let core = s.split(r#"data-node="core""#).nth(1).unwrap();
    assert!(core.contains(r#"data-flows="zeta:1&gt;b2/0x1""#), "{core}");
    assert!(
        core.contains(r#" data-flows-class_change="zeta:1&gt;b2/0x1">"#),
        "{core}"
    );
    let aa_m10 = s.split(r#"data-a="aa" data-b="m10""#).nth(1).unwrap();
    assert!(aa_m10.contains(r#"data-flows="alpha:4&gt;b2/0x4 "#), "{aa_m10}");
    let xy = s.split(r#"data-a="x" data-b="y""#).nth(1).expect("the x–y link");
    let flows = xy
        .split("data-flows=\"")
        .nth(1)
        .unwrap()
        .split('"')
        .next()
        .unwrap();
    assert_eq!(flows.split(' ').count(), crate::MAX_LISTED);
    assert!(xy.contains(&format!(r#"data-flow-count="{}""#, crate::MAX_LISTED + 5)));
    // Well-formed enough for a browser: every element opened is closed.
    assert_eq!(s.matches("<g ").count(), s.matches("</g>").count());
}

#[test]
fn a_flow_page_draws_the_change_between_the_right_two_points() {
    let r = fabric_report();
    let f = &r.flows[0];
    let s = svg::flow_path(f);
    let hops: Vec<&str> = s.split("<g class=\"hop").skip(1).collect();
    assert_eq!(hops.len(), f.path.len() - 1);
    for (i, h) in hops.iter().enumerate() {
        let changed = h.starts_with(" marked\" data-from=\"core:m7:ingress\" data-to=\"core:m10:egress\"");
        assert_eq!(h.contains("class_change"), i == 3, "hop {i}: {h}");
        assert_eq!(changed, i == 3, "hop {i}");
    }
    assert!(s.contains("DSCP 26→0 (7 pkts)"));
    assert!(s.contains(r#"data-point="core:m10:egress" data-dscp="0""#));
    assert!(s.contains(r#"data-point="core:m7:ingress" data-dscp="26""#));
    let page = html::flow_fragment(f, &[]);
    assert!(page.contains("DSCP 26 → 0 between core:m7:ingress → core:m10:egress"));
    // The CE share of each interval: 0, 10, 20, 30, 40 % — now 40.
    assert!(page.contains("data-series=\"CE-marked %\""));
    assert!(page.contains("now 40.0 %"), "{page}");
}

fn verdict(checks: Vec<CheckResult>) -> Verdict {
    Verdict::new("test".into(), Load::Idle, 4, checks)
}

fn check(name: &str, status: Status, evidence: Vec<Evidence>) -> CheckResult {
    let mut c: CheckResult = serde_json::from_value(serde_json::json!({
        "check": name, "rule": "a rule", "status": "pass", "checked": 4, "summary": "s", "evidence": []
    }))
    .unwrap();
    c.status = status;
    c.evidence = evidence;
    c
}

#[test]
fn the_verify_report_marks_what_failing_checks_name_and_draws_their_flows() {
    let r = fabric_report();
    let failing = check(
        "class_per_hop",
        Status::Fail,
        vec![Evidence {
            flow: "zeta:1>b2/0x1".into(),
            at: vec!["core:m7:ingress".into(), "core:m10:egress".into()],
            detail: "DSCP 26 → 0 inside core".into(),
        }],
    );
    let passing = check(
        "ecn",
        Status::Pass,
        vec![Evidence {
            flow: "zeta:2>b2/0x2".into(),
            at: vec!["m7:aa:egress".into()],
            detail: "not a failure".into(),
        }],
    );
    let s = html::verify_report(&verdict(vec![failing, passing.clone()]), Some(&r));
    assert!(s.contains(r#"<span class="verdict fail" id="verdict">FAIL</span>"#));
    assert!(s.contains(r#"<section class="failure" id="check-class_per_hop">"#));
    assert!(!s.contains("id=\"check-ecn\""));
    // On the map: core carries the failing check; a passing check's places do not.
    assert!(s.contains(r#"data-node="core" data-tier="2" data-marks="check_failed class_change""#));
    assert!(s.contains(r#"data-a="aa" data-b="m7" data-marks="""#));
    assert!(s.contains(r#"<figure class="evidence-flow" data-flow="zeta:1&gt;b2/0x1">"#));
    // Self-contained: nothing fetched.
    for fetch in ["src=\"http", "href=\"http", "<script src", "@import", "url("] {
        assert!(!s.contains(fetch), "{fetch}");
    }
    let ok = html::verify_report(&verdict(vec![passing]), Some(&r));
    assert!(ok.contains("verdict pass") && !ok.contains("class=\"failure\""));
    assert!(!ok.contains("check_failed"));
}

#[test]
fn names_sort_naturally_and_ids_survive_a_url() {
    let mut v = vec!["h10", "h2", "h1", "s1", "h02", "l1"];
    v.sort_by(|a, b| natural(a, b));
    assert_eq!(v, vec!["h1", "h02", "h2", "h10", "l1", "s1"]);
    let id = "10.10.1.2:49152>[fd00::3]/0x101 #&?";
    let enc = html::percent_encode(id);
    assert!(!enc.contains(['#', '&', '?', ' ', '[', '>']));
    let dec: Vec<u8> = {
        let b = enc.as_bytes();
        let mut o = Vec::new();
        let mut i = 0;
        while i < b.len() {
            if b[i] == b'%' {
                o.push(u8::from_str_radix(&enc[i + 1..i + 3], 16).unwrap());
                i += 3;
            } else {
                o.push(b[i]);
                i += 1;
            }
        }
        o
    };
    assert_eq!(String::from_utf8(dec).unwrap(), id);
}

/// A table read a chunk at a time builds the same fabric as the whole report, whatever
/// order the flows come in.
#[test]
fn a_fabric_built_flow_by_flow_is_the_fabric_of_the_whole_report() {
    let r = fabric_report();
    let whole = Fabric::of(&r);
    let mut parts = Fabric::new(&r.points);
    for f in r.flows.iter().rev() {
        parts.add_flow(f);
    }
    parts.add_anomalies(&r.anomalies);
    assert_eq!(parts, whole);
    // The flows' own reports carry their class changes and losses: the anomalies add
    // nothing here.
    let mut bare = Fabric::new(&r.points);
    for f in &r.flows {
        bare.add_flow(f);
    }
    assert_eq!(bare, whole);
}

/// The continuously judged checks above the map: each check's established status (or
/// pending), the latest changes newest first and at most [`html::CHANGES_LISTED`],
/// names escaped.
#[test]
fn the_checks_judged_continuously_show_their_status_and_latest_changes() {
    use roce_trace_verify::continuous::{Tracker, Window};
    let mut t = Tracker::new(1);
    let r = |check: &str, status: Status| CheckResult {
        check: check.into(),
        rule: format!("rule <{check}>"),
        status,
        checked: 3,
        summary: format!("{check} is {}", status.name()),
        evidence: if status == Status::Fail {
            vec![Evidence {
                flow: "f1".into(),
                at: vec!["s1:l2:egress".into()],
                detail: "DSCP 0".into(),
            }]
        } else {
            vec![]
        },
    };
    let mut events = Vec::new();
    for i in 0..20u64 {
        let s = if i % 2 == 0 { Status::Pass } else { Status::Fail };
        let w = Window {
            start_ms: i * 1000,
            end_ms: i * 1000 + 1000,
        };
        events.extend(t.window(
            w,
            w.end_ms,
            3,
            &[
                r("data_class", s),
                r("<script>", Status::Pass),
                r("hops", Status::NoData),
            ],
        ));
    }
    let v = roce_trace_verify::continuous::Verdicts {
        kind: "verdicts".into(),
        judging: true,
        policy: "fabric.toml".into(),
        every_ms: 1000,
        window_ms: 2000,
        fail_after: 1,
        load: Load::Idle,
        windows: 20,
        last_window: None,
        checks: t.states().cloned().collect(),
        events,
    };
    let h = html::verdicts_section(&v);
    assert!(
        h.contains(r#"<tr class="check fail" data-check="data_class" data-status="fail"><td>data_class</td><td>FAIL</td>"#),
        "{h}"
    );
    assert!(h.contains(r#"data-check="hops" data-status="pending""#), "{h}");
    assert!(h.contains("&lt;script&gt;") && !h.contains("<script>"), "{h}");
    assert!(h.contains("rule &lt;data_class&gt;"));
    assert_eq!(
        h.matches(r#"<li class="change"#).count(),
        html::CHANGES_LISTED,
        "{h}"
    );
    // Below the map, above the anomalies.
    let page = html::main_with_verdicts(&html::main_fragment(&fabric_report()), &v);
    let (map, checks, anomalies) = (
        page.find(r#"<section id="map">"#).unwrap(),
        page.find(r#"<section id="verdicts">"#).unwrap(),
        page.find(r#"<section id="anomalies">"#).unwrap(),
    );
    assert!(map < checks && checks < anomalies, "{page}");
    // Newest first: the last window's change (data_class to FAIL, at 20 s) heads the list.
    let first = h.split(r#"<li class="change"#).nth(1).unwrap();
    assert!(
        first.starts_with(r#" fail" data-check="data_class">00:00:20.000 UTC"#),
        "{first}"
    );
}
