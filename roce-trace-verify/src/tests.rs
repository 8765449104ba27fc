//! The judge on hand-made windows of the lab's shape: a healthy fabric passes every rule,
//! and each fault fails exactly the rules it breaks.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use roce_trace_correlate::{
    Answers, ClassAt, ClassChange, ClassSeen, CnpDelivery, CollectorReport, CountedLoss, DeliveryAt,
    FlowReport, Lost, MtuAt, PathAt, Point, PointInfo, Span,
    observation::{CounterDelta, Counts},
};

use crate::{
    baseline::Baseline,
    checks::{CheckResult, Load, Status, judge},
    drill,
    output::{Verdict, junit, table},
    policy::Policy,
    window::since,
};

const POLICY: &str = include_str!("../../dist/fabric-policy.toml");

fn h(n: u8) -> IpAddr {
    format!("10.10.{n}.2").parse().unwrap()
}

/// Points from host `a` to host `b` through `spine` (None: same leaf).
fn points(a: u8, b: u8, spine: Option<u8>) -> Vec<Point> {
    let la = if a <= 2 { 1 } else { 2 };
    let lb = if b <= 2 { 1 } else { 2 };
    let mut v = vec![format!("h{a}:eth0:egress"), format!("l{la}:h{a}:ingress")];
    if let Some(s) = spine {
        v.push(format!("s{s}:l{la}:ingress"));
        v.push(format!("l{lb}:s{s}:ingress"));
    }
    v.push(format!("h{b}:eth0:ingress"));
    v.iter().map(|l| Point::from(l.as_str())).collect()
}

/// One counter delta a second at the flow's last point, a partial one first and last.
fn steady() -> Vec<DeliveryAt> {
    let mut v: Vec<DeliveryAt> = (0..7)
        .map(|i| DeliveryAt {
            start_ns: i * 1_000_000_000,
            end_ns: (i + 1) * 1_000_000_000,
            bytes: 157_000,
            ..DeliveryAt::default()
        })
        .collect();
    v[0].bytes = 60_000;
    v[6].bytes = 20_000;
    v
}

fn counters(packets: u64, ecn: [u64; 4]) -> CounterDelta {
    CounterDelta {
        counts: Counts {
            packets,
            bytes: packets * 1100,
            ecn,
            ..Default::default()
        },
        last_dscp: 26,
        last_ttl: 64,
        ..Default::default()
    }
}

fn flow(a: u8, b: u8, sport: u16, spine: Option<u8>) -> FlowReport {
    let path = points(a, b, spine);
    let mut hops = vec![0];
    hops.extend(std::iter::repeat_n(1, path.len() - 2));
    FlowReport {
        id: format!("{}:{sport}>{}/{:#x}", h(a), h(b), 0x100 + sport as u32),
        src_ip: h(a),
        dst_ip: h(b),
        udp_sport: sport,
        dest_qp: 0x100 + sport as u32,
        hops,
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
        class_seen: Vec::new(),
        max_frame: path.iter().map(|p| (p.clone(), 1100)).collect(),
        delivery: steady(),
        class_changes: Vec::new(),
        ce_onset: Vec::new(),
        lost: Vec::new(),
        unobserved: Vec::new(),
        delays: Vec::new(),
        path_history: vec![PathAt {
            since_ns: 1_000,
            path: path.clone(),
        }],
        counters: path
            .iter()
            .map(|p| (p.clone(), counters(1000, [0, 0, 1000, 0])))
            .collect(),
        trajectories: 250,
        cnp_delivery: None,
        answered_by: Answers {
            flows: Vec::new(),
            cnps_sent: 0,
            cnps_lost: Vec::new(),
            cnps: 0,
            ce_marks: 0,
            cnps_per_ce_mark: None,
            ce_to_cnp: None,
        },
        probe: None,
        path,
    }
}

/// ACKs back from `b` to `a`.
fn acks(a: u8, b: u8, sport: u16, spine: Option<u8>) -> FlowReport {
    let mut f = flow(b, a, sport, spine);
    for c in f.counters.values_mut() {
        c.counts.packets = 100;
        c.counts.ack = 100;
    }
    f
}

fn report(flows: Vec<FlowReport>) -> CollectorReport {
    CollectorReport {
        flows,
        ..CollectorReport::empty()
    }
}

/// 8 QPs h1→h3 split over both spines, 2 QPs h1→h2, and their ACKs.
fn healthy() -> Vec<FlowReport> {
    let mut v = Vec::new();
    for i in 0..8u16 {
        let spine = Some(1 + (i % 2) as u8);
        v.push(flow(1, 3, 49152 + i, spine));
        v.push(acks(1, 3, 49152 + i, spine));
    }
    for i in 0..2u16 {
        v.push(flow(1, 2, 50000 + i, None));
    }
    v
}

fn failing(flows: Vec<FlowReport>, load: Load) -> BTreeSet<String> {
    let p = Policy::parse(POLICY).unwrap();
    judge(&p, &report(flows), load)
        .into_iter()
        .filter(|c| c.status == Status::Fail)
        .map(|c| c.check)
        .collect()
}

fn set(v: &[&str]) -> BTreeSet<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn via_s1(f: &FlowReport) -> bool {
    f.path.iter().any(|p| p.node == "s1")
}

#[test]
fn a_healthy_fabric_passes_every_rule() {
    let p = Policy::parse(POLICY).unwrap();
    let checks = judge(&p, &report(healthy()), Load::Idle);
    let v = Verdict::new("test".into(), Load::Idle, 18, checks);
    assert_eq!(v.exit_code(), 0, "{}", table(&v));
    // Every rule of the example policy ran; CNP rules had nothing to judge.
    let names: Vec<&str> = v.checks.iter().map(|c| c.check.as_str()).collect();
    assert_eq!(names.len(), 15, "{names:?}");
    for c in &v.checks {
        let want = if c.check.starts_with("cnp_") {
            Status::Skip
        } else {
            Status::Pass
        };
        assert_eq!(c.status, want, "{}: {}", c.check, c.summary);
    }
}

#[test]
fn a_dscp_rewrite_at_a_spine_fails_the_class_rules_with_where() {
    let mut v = healthy();
    for f in v.iter_mut().filter(|f| via_s1(f) && f.src_ip == h(1)) {
        for c in f.class.iter_mut().skip(3) {
            c.dscp = 0;
        }
        f.class_changes.push(ClassChange {
            between: [f.path[2].clone(), f.path[3].clone()],
            from_dscp: 26,
            to_dscp: 0,
            span: Span {
                first_ns: 1,
                last_ns: 2,
                packets: 200,
            },
        });
    }
    assert_eq!(
        failing(v.clone(), Load::Idle),
        set(&["data_class", "no_class_change"])
    );
    let p = Policy::parse(POLICY).unwrap();
    let c = judge(&p, &report(v), Load::Idle);
    let change = c.iter().find(|c| c.check == "no_class_change").unwrap();
    assert_eq!(change.evidence.len(), 4, "the four flows through s1");
    assert_eq!(change.evidence[0].at, vec!["s1:l1:ingress", "l2:s1:ingress"]);
    assert!(change.evidence[0].detail.contains("26 -> 0"));
}

#[test]
fn ce_marks_on_an_idle_fabric_fail_and_unanswered_ones_fail_twice() {
    let mut v = healthy();
    let f = &mut v[0];
    f.counters
        .get_mut(&Point::from("h3:eth0:ingress"))
        .unwrap()
        .counts
        .ecn = [0, 0, 900, 100];
    f.answered_by.ce_marks = 100;
    assert_eq!(
        failing(v.clone(), Load::Idle),
        set(&["ce_fraction", "cnp_answers_ce"])
    );
    // Answered by CNPs in their class: only the idle CE budget is broken.
    v[0].answered_by.cnps = 40;
    let mut cnp = acks(1, 3, 60000, Some(1));
    for c in cnp.counters.values_mut() {
        c.counts.ack = 0;
        c.counts.cnp = 100;
    }
    cnp.cnp_class = cnp
        .path
        .iter()
        .map(|p| ClassAt {
            point: p.clone(),
            dscp: 48,
            ecn: 0,
            pcp: None,
        })
        .collect();
    v.push(cnp.clone());
    assert_eq!(failing(v.clone(), Load::Idle), set(&["ce_fraction"]));
    // … and under deliberate congestion that is what is wanted.
    assert_eq!(failing(v.clone(), Load::Congested), set(&[]));
    // CNPs remarked on the way.
    let last = v.len() - 1;
    v[last].cnp_class[3].dscp = 0;
    assert_eq!(failing(v, Load::Congested), set(&["cnp_class"]));
}

/// The fabric the defect was found on: h3 answers every CE mark with CNPs, and leaf l1
/// drops every CNP arriving from the spines. CNPs are seen leaving h3 and entering l1,
/// never leaving toward h1.
#[test]
fn cnps_that_never_reach_the_sender_fail_cnp_answers_ce_and_loss_naming_the_leaf() {
    let mut v = healthy();
    let ce = |v: &mut Vec<FlowReport>, cnps: u64, lost: Vec<CountedLoss>| {
        let f = &mut v[0];
        f.counters
            .get_mut(&Point::from("h3:eth0:ingress"))
            .unwrap()
            .counts
            .ecn = [0, 0, 800, 200];
        f.answered_by.ce_marks = 200;
        f.answered_by.cnps_sent = 200;
        f.answered_by.cnps = cnps;
        f.answered_by.cnps_lost = lost;
    };
    let mut cnp = acks(1, 3, 60000, Some(1));
    for c in cnp.counters.values_mut() {
        c.counts.ack = 0;
        c.counts.cnp = 200;
        c.counts.packets = 200;
    }
    cnp.trajectories = 0;
    // Healthy: all 200 reach h1.
    cnp.cnp_delivery = Some(CnpDelivery {
        sent: 200,
        sent_at: "h3:eth0:egress".into(),
        reached: Some(200),
        reached_at: Some("h1:eth0:ingress".into()),
        lost: Vec::new(),
    });
    let mut healthy_v = v.clone();
    ce(&mut healthy_v, 200, Vec::new());
    healthy_v.push(cnp.clone());
    assert_eq!(failing(healthy_v, Load::Congested), set(&[]));
    // Dropped inside l1: none reaches h1.
    let lost = vec![CountedLoss {
        between: ["l1:s1:ingress".into(), "h1:eth0:ingress".into()],
        packets: 200,
    }];
    ce(&mut v, 0, lost.clone());
    let d = cnp.cnp_delivery.as_mut().unwrap();
    d.reached = Some(0);
    d.lost = lost;
    v.push(cnp);
    assert_eq!(
        failing(v.clone(), Load::Congested),
        set(&["cnp_answers_ce", "loss"])
    );
    let p = Policy::parse(POLICY).unwrap();
    let checks = judge(&p, &report(v), Load::Congested);
    let c = checks.iter().find(|c| c.check == "cnp_answers_ce").unwrap();
    assert_eq!(c.evidence[0].at, ["l1:s1:ingress", "h1:eth0:ingress"]);
    assert!(
        c.evidence[0]
            .detail
            .contains("200 CNPs sent back, 0 reached the sender"),
        "{}",
        c.evidence[0].detail
    );
    let l = checks.iter().find(|c| c.check == "loss").unwrap();
    assert!(
        l.evidence
            .iter()
            .any(|e| e.at == ["l1:s1:ingress", "h1:eth0:ingress"] && e.detail.contains("200 CNPs lost here"))
    );
}

/// A spine rewrote DSCP 26 → 0 for 8 s in the middle of the window, then stopped: each
/// point shows DSCP 26 at the end, but the class it had for a while fails data_class.
#[test]
fn a_class_rewrite_for_part_of_the_window_fails_data_class() {
    let mut v = healthy();
    for f in v.iter_mut() {
        f.class_seen = f
            .class
            .iter()
            .map(|c| ClassSeen {
                point: c.point.clone(),
                cnp: false,
                dscp: 26,
                pcp: None,
                span: Span {
                    first_ns: 0,
                    last_ns: 24_000_000_000,
                    packets: 150,
                },
            })
            .collect();
    }
    assert_eq!(failing(v.clone(), Load::Idle), set(&[]));
    for f in v.iter_mut().filter(|f| via_s1(f) && f.src_ip == h(1)) {
        for p in f.path[3..].iter().cloned() {
            f.class_seen.push(ClassSeen {
                point: p,
                cnp: false,
                dscp: 0,
                pcp: None,
                span: Span {
                    first_ns: 8_000_000_000,
                    last_ns: 16_000_000_000,
                    packets: 100,
                },
            });
        }
    }
    let p = Policy::parse(POLICY).unwrap();
    let c = judge(&p, &report(v), Load::Idle);
    let d = c.iter().find(|c| c.check == "data_class").unwrap();
    assert_eq!(d.status, Status::Fail);
    assert_eq!(d.evidence.len(), 8, "4 flows × 2 points past s1");
    assert!(
        d.evidence[0]
            .detail
            .contains("DSCP 0 (expected 26), 100 packet(s) over 8.0 s"),
        "{}",
        d.evidence[0].detail
    );
}

/// CNPs dropped for a third of the window: two thirds still reach the sender, well
/// above the per-mark minimum, yet the senders went unthrottled meanwhile.
#[test]
fn cnps_lost_for_part_of_the_window_fail_cnp_answers_ce() {
    let mut v = healthy();
    let f = &mut v[0];
    f.counters
        .get_mut(&Point::from("h3:eth0:ingress"))
        .unwrap()
        .counts
        .ecn = [0, 0, 800, 200];
    f.answered_by.ce_marks = 200;
    f.answered_by.cnps_sent = 200;
    f.answered_by.cnps = 133;
    assert_eq!(failing(v.clone(), Load::Congested), set(&[]));
    v[0].answered_by.cnps_lost = vec![CountedLoss {
        between: ["l1:s1:ingress".into(), "h1:eth0:ingress".into()],
        packets: 67,
    }];
    assert_eq!(failing(v, Load::Congested), set(&["cnp_answers_ce"]));
}

#[test]
fn congestion_without_ecn_marking_fails() {
    assert_eq!(failing(healthy(), Load::Congested), set(&["ce_fraction"]));
}

#[test]
fn a_spine_down_or_l3_hashing_fails_the_ecmp_spread() {
    let mut v = healthy();
    for f in v.iter_mut().filter(|f| via_s1(f)) {
        *f = if f.src_ip == h(1) {
            flow(1, 3, f.udp_sport, Some(2))
        } else {
            acks(1, 3, f.udp_sport, Some(2))
        };
    }
    let p = Policy::parse(POLICY).unwrap();
    let c = judge(&p, &report(v.clone()), Load::Idle);
    let e = c.iter().find(|c| c.check == "ecmp_spread").unwrap();
    assert_eq!(e.status, Status::Fail);
    assert_eq!(e.evidence[0].at, vec!["s2"]);
    assert!(
        e.evidence[0].detail.starts_with("8 of 8"),
        "{}",
        e.evidence[0].detail
    );
    assert_eq!(failing(v, Load::Idle), set(&["ecmp_spread"]));
}

/// A link MTU below the frame size on l1's way to s1: the full-size frames die at l1,
/// the short last frame of each message crosses. A flow whose sampled packets were all
/// full-size has a path that ends at l1, but its exact counters at s1 place it there;
/// a flow that nothing of crossed is placed nowhere.
#[test]
fn a_flow_whose_samples_die_before_the_spine_is_placed_by_its_counters() {
    let spread = |v: Vec<FlowReport>| {
        let p = Policy::parse(POLICY).unwrap();
        let c = judge(&p, &report(v), Load::Idle);
        let e = c.into_iter().find(|c| c.check == "ecmp_spread").unwrap();
        (e.status, e.summary)
    };
    let mut v = healthy();
    let cut: Vec<usize> = (0..v.len())
        .filter(|&i| via_s1(&v[i]) && v[i].src_ip == h(1))
        .collect();
    assert_eq!(cut.len(), 4);
    for &i in &cut {
        let f = &mut v[i];
        f.path.truncate(2);
        f.path_history[0].path.truncate(2);
        for (p, c) in f.counters.iter_mut() {
            if p.node != "h1" && p.node != "l1" {
                c.counts.packets = 100;
            }
        }
    }
    assert_eq!(spread(v.clone()), (Status::Pass, "s1 4, s2 4 of 8 flows".into()));
    // The drill's spread is where flows go now: by path alone, the cut flows nowhere.
    let data: Vec<&FlowReport> = v
        .iter()
        .filter(|f| super::checks::role(f) == Some(super::checks::Role::Data))
        .collect();
    assert_eq!(
        super::checks::ecmp_shares(&data, &via()),
        BTreeMap::from([("s1".to_string(), 0), ("s2".to_string(), 4)])
    );
    // Nothing of one of them crossed: the spines saw 7 data flows, too few to judge.
    let f = &mut v[cut[0]];
    f.counters.retain(|p, _| p.node == "h1" || p.node == "l1");
    let (status, summary) = spread(v);
    assert_eq!(status, Status::NoData, "{summary}");
    assert!(summary.starts_with("7 data flow(s)"), "{summary}");
}

/// Every data flow hashed onto s1 (l1 hashing on L3 alone) behind that small link: no
/// sampled packet reaches a spine, yet the counters put all eight on s1 — the
/// imbalance fails, where the paths alone could not judge it.
#[test]
fn flows_all_on_one_spine_fail_the_spread_when_their_samples_die_before_it() {
    let mut v = healthy();
    for f in v.iter_mut().filter(|f| f.src_ip == h(1) && f.dst_ip == h(3)) {
        *f = flow(1, 3, f.udp_sport, Some(1));
        f.path.truncate(2);
        f.path_history[0].path.truncate(2);
        for (p, c) in f.counters.iter_mut() {
            if p.node != "h1" && p.node != "l1" {
                c.counts.packets = 100;
            }
        }
    }
    let p = Policy::parse(POLICY).unwrap();
    let c = judge(&p, &report(v), Load::Idle);
    let e = c.iter().find(|c| c.check == "ecmp_spread").unwrap();
    assert_eq!(e.status, Status::Fail, "{}", e.summary);
    assert_eq!(e.evidence[0].at, vec!["s1"]);
    assert!(
        e.evidence[0].detail.starts_with("8 of 8"),
        "{}",
        e.evidence[0].detail
    );
}

#[test]
fn a_small_link_mtu_fails_the_path_mtu_at_the_link() {
    let mut v = healthy();
    for f in v.iter_mut().filter(|f| via_s1(f) && f.src_ip == h(1)) {
        let beyond = f.path[2..].to_owned();
        for p in beyond {
            f.max_frame.insert(p, 300);
        }
        let between = [f.path[1].clone(), f.path[2].clone()];
        f.lost.push(Lost {
            between,
            span: Span {
                first_ns: 1,
                last_ns: 2,
                packets: 100,
            },
            ..Default::default()
        });
        f.counters
            .get_mut(&Point::from("h3:eth0:ingress"))
            .unwrap()
            .counts
            .psn_gaps = 50;
    }
    // The big frames vanish at the small link; the losses and gaps are its doing too.
    assert_eq!(
        failing(v.clone(), Load::Idle),
        set(&["path_mtu", "loss", "psn_gaps"])
    );
    let p = Policy::parse(POLICY).unwrap();
    let c = judge(&p, &report(v), Load::Idle);
    let m = c.iter().find(|c| c.check == "path_mtu").unwrap();
    assert_eq!(m.evidence[0].at, vec!["l1:h1:ingress", "s1:l1:ingress"]);
}

#[test]
fn a_flow_black_holed_from_its_start_is_loss_where_it_stops() {
    let mut v = healthy();
    // Its packets never get past l1 (an ACL, a route to nowhere): no longer path of its
    // own to compare with, but the other flows to h3 reach h3.
    let f = &mut v[0];
    f.path.truncate(2);
    f.hops.truncate(1);
    f.class.truncate(2);
    f.path_history[0].path.truncate(2);
    let kept: Vec<Point> = f.path.clone();
    f.counters.retain(|p, _| kept.contains(p));
    f.max_frame.retain(|p, _| kept.contains(p));
    let p = Policy::parse(POLICY).unwrap();
    let c = judge(&p, &report(v.clone()), Load::Idle);
    let l = c.iter().find(|c| c.check == "loss").unwrap();
    assert_eq!(l.status, Status::Fail, "{l:?}");
    assert_eq!(l.evidence.len(), 1);
    assert_eq!(l.evidence[0].at, vec!["l1:h1:ingress"]);
    assert!(
        l.evidence[0].detail.contains("reach h3"),
        "{}",
        l.evidence[0].detail
    );
    // Only loss: where it vanishes is no hop count (it never crossed the fabric), so the
    // hops rule leaves it out rather than blame routing for a black hole.
    assert_eq!(failing(v.clone(), Load::Idle), set(&["loss"]));
    let hops = c
        .iter()
        .find(|c| c.check.starts_with("hops 10.10.1.0/24 <-> 10.10.3.0/24"))
        .unwrap();
    assert_eq!(hops.status, Status::Pass, "{hops:?}");
    assert_eq!(
        hops.checked,
        v.iter().filter(|f| f.dst_ip == h(3) || f.src_ip == h(3)).count() - 1
    );
}

/// 8 QPs of 64 KiB writes at RoCE MTU 1024: every data frame is 1098 bytes, none is
/// smaller. The flows through s1 lose every frame at s1's port from l1.
fn all_full_size_black_holed_at_s1() -> Vec<FlowReport> {
    let mut v = healthy();
    for f in v.iter_mut().filter(|f| f.src_ip == h(1) && f.dst_ip == h(3)) {
        for m in f.max_frame.values_mut() {
            *m = 1098;
        }
        if via_s1(f) {
            let beyond = f.path[2..].to_owned();
            f.max_frame.retain(|p, _| !beyond.contains(p));
            f.lost.push(Lost {
                between: [f.path[1].clone(), f.path[2].clone()],
                span: Span {
                    first_ns: 1,
                    last_ns: 2,
                    packets: 400,
                },
                largest_frame: Some(1098),
                ..Default::default()
            });
        }
    }
    v
}

fn with_points(flows: Vec<FlowReport>, points: Vec<PointInfo>) -> CollectorReport {
    let mut r = report(flows);
    r.points = points;
    r
}

fn port(label: &str, mtu: Option<u32>, history: &[u32]) -> PointInfo {
    let mut it = label.split(':');
    PointInfo {
        node: it.next().unwrap().into(),
        iface: it.next().unwrap().into(),
        direction: it.next().unwrap().parse().unwrap(),
        clock_synced: true,
        mtu,
        mtu_history: history
            .iter()
            .enumerate()
            .map(|(i, &mtu)| MtuAt { at_ns: i as u64, mtu })
            .collect(),
    }
}

fn path_mtu(r: &CollectorReport) -> CheckResult {
    let p = Policy::parse(POLICY).unwrap();
    judge(&p, r, Load::Idle)
        .into_iter()
        .find(|c| c.check == "path_mtu")
        .unwrap()
}

/// The fabric: a port whose MTU (1000) cannot carry 1098-byte frames fails
/// path_mtu, naming the port, though no smaller frame of the flow shows the contrast.
#[test]
fn a_port_that_cannot_carry_the_frames_fails_path_mtu_when_every_frame_is_full_size() {
    let v = all_full_size_black_holed_at_s1();
    let ports = vec![
        port("s1:l1:ingress", Some(1000), &[1000]),
        port("s2:l1:ingress", Some(1500), &[1500]),
    ];
    let c = path_mtu(&with_points(v.clone(), ports));
    assert_eq!(c.status, Status::Fail, "{c:?}");
    assert_eq!(c.evidence.len(), 4, "the 4 flows through s1: {c:?}");
    assert!(c.evidence.iter().all(|e| e.at == ["s1:l1:ingress"]));
    assert!(
        c.evidence[0]
            .detail
            .contains("1098-byte frames (1084-byte IP packets) cannot cross s1:l1:ingress: its MTU was 1000"),
        "{}",
        c.evidence[0].detail
    );
    // The same port at 1500: the MTU is no reason (the loss check names the loss).
    let ports = vec![port("s1:l1:ingress", Some(1500), &[1500])];
    assert_eq!(path_mtu(&with_points(v, ports)).status, Status::Pass);
}

/// No MTU known there (a mirror session, an older agent): the full-size frames vanish
/// at a point that carries only smaller frames — that alone fails path_mtu.
#[test]
fn full_size_frames_that_vanish_where_only_smaller_ones_pass_fail_path_mtu() {
    let mut v = all_full_size_black_holed_at_s1();
    // Another QP of small messages (300-byte frames) crosses s1 fine.
    let mut small = flow(1, 3, 49300, Some(1));
    for m in small.max_frame.values_mut() {
        *m = 300;
    }
    v.push(small);
    let c = path_mtu(&report(v.clone()));
    assert_eq!(c.status, Status::Fail, "{c:?}");
    assert_eq!(c.evidence.len(), 4);
    assert_eq!(c.evidence[0].at, ["l1:h1:ingress", "s1:l1:ingress"]);
    assert!(
        c.evidence[0]
            .detail
            .contains("nothing larger than 300 bytes got past s1:l1:ingress")
    );
    // A lossy link that still carries full-size frames is loss, not an MTU problem.
    let mut big = flow(1, 3, 49301, Some(1));
    for m in big.max_frame.values_mut() {
        *m = 1098;
    }
    v.push(big);
    assert_eq!(path_mtu(&report(v)).status, Status::Pass);
}

/// A port lowered for part of the window (a fault that came and went) fails as well,
/// saying what it is now.
#[test]
fn a_port_lowered_for_part_of_the_window_fails_path_mtu() {
    let v = all_full_size_black_holed_at_s1();
    let ports = vec![port("s1:l1:ingress", Some(1500), &[1500, 1000, 1500])];
    let c = path_mtu(&with_points(v, ports));
    assert_eq!(c.status, Status::Fail);
    assert!(
        c.evidence[0].detail.ends_with("its MTU was 1000 (now 1500)"),
        "{}",
        c.evidence[0].detail
    );
}

#[test]
fn frames_over_the_roce_mtu_fail() {
    let mut v = healthy();
    for m in v[0].max_frame.values_mut() {
        *m = 2200;
    }
    assert_eq!(failing(v, Load::Idle), set(&["path_mtu"]));
}

#[test]
fn naks_hops_ect_and_spread_fail_on_their_own() {
    let mut v = healthy();
    v[1].counters
        .values_mut()
        .for_each(|c| c.counts.nak_psn_seq_err = 10);
    assert_eq!(failing(v, Load::Idle), set(&["naks"]));

    let mut v = healthy();
    v[0].hops = vec![0, 1, 2, 1];
    assert_eq!(
        failing(v, Load::Idle),
        set(&["hops 10.10.1.0/24 <-> 10.10.3.0/24"])
    );

    let mut v = healthy();
    v[0].counters
        .get_mut(&Point::from("h1:eth0:egress"))
        .unwrap()
        .counts
        .ecn = [1000, 0, 0, 0];
    assert_eq!(failing(v, Load::Idle), set(&["data_ect"]));

    let mut v = healthy();
    v[0].counters.values_mut().for_each(|c| c.counts.bytes /= 2);
    assert_eq!(failing(v, Load::Idle), set(&["throughput_spread"]));
}

#[test]
fn a_flow_whose_rate_dips_over_time_fails_rate_stability_only() {
    let mut v = healthy();
    // Two seconds at a third of its rate (a flapping link, a PFC storm), same total bytes.
    let d = &mut v[0].delivery;
    d[2].bytes = 52_000;
    d[3].bytes = 52_000;
    d[4].bytes = 367_000;
    assert_eq!(failing(v.clone(), Load::Idle), set(&["rate_stability"]));
    let p = Policy::parse(POLICY).unwrap();
    let c = judge(&p, &report(v), Load::Idle);
    let r = c.iter().find(|c| c.check == "rate_stability").unwrap();
    assert_eq!(r.evidence.len(), 1);
    assert!(
        r.evidence[0].detail.contains("over 5 intervals: 0.42 Mbit/s"),
        "{}",
        r.evidence[0].detail
    );
    // A partial first or last interval is no dip.
    let mut v = healthy();
    v[0].delivery[0].bytes = 1;
    v[0].delivery[6].bytes = 1;
    assert_eq!(failing(v, Load::Idle), set(&[]));
}

/// Delivery over the agent's own intervals: a tick that came late carries more bytes over a
/// longer interval — no change of rate — while a flow that stalls for two ticks and resumes
/// reports one delta over three seconds, and that is a dip.
#[test]
fn rate_stability_reads_the_agents_intervals_not_when_reports_arrive() {
    let mut v = healthy();
    let d = &mut v[0].delivery;
    // Ticks at 1, 2.4, 2.9, 4.3, 5, 6, 7 s: the same 157 kB/s in every interval.
    for (i, end) in [1.0, 2.4, 2.9, 4.3, 5.0, 6.0, 7.0].into_iter().enumerate() {
        d[i].end_ns = (end * 1e9) as u64;
        if i > 0 {
            d[i].start_ns = d[i - 1].end_ns;
            d[i].bytes = ((d[i].end_ns - d[i].start_ns) as f64 * 157e-6) as u64;
        }
    }
    assert_eq!(failing(v, Load::Idle), set(&[]));
    // Nothing delivered from 2 s to 4 s: the delta at 5 s covers [2 s, 5 s] with one
    // second's bytes (the agent reports no empty delta).
    let mut v = healthy();
    let d = &mut v[0].delivery;
    d.remove(2);
    d.remove(2);
    d[2].start_ns = 2_000_000_000;
    assert_eq!(d.len(), 5);
    assert_eq!(failing(v, Load::Idle), set(&["rate_stability"]));
}

#[test]
fn no_traffic_cannot_be_checked_and_says_so() {
    let p = Policy::parse(POLICY).unwrap();
    let v = Verdict::new(
        "test".into(),
        Load::Idle,
        0,
        judge(&p, &report(Vec::new()), Load::Idle),
    );
    assert_eq!(v.exit_code(), 3);
    assert!(
        v.checks
            .iter()
            .all(|c| matches!(c.status, Status::NoData | Status::Skip))
    );
    assert!(table(&v).contains("NO DATA"));
}

#[test]
fn junit_has_one_case_per_check_and_escapes_evidence() {
    let mut v = healthy();
    v[0].counters
        .get_mut(&Point::from("h1:eth0:egress"))
        .unwrap()
        .counts
        .ecn = [1000, 0, 0, 0];
    v[0].id = "<odd & \"id\">".into();
    let p = Policy::parse(POLICY).unwrap();
    let verdict = Verdict::new("a&b".into(), Load::Idle, 1, judge(&p, &report(v), Load::Idle));
    let x = junit(&verdict);
    assert_eq!(x.matches("<testcase ").count(), verdict.checks.len());
    assert_eq!(x.matches("<failure ").count(), 1);
    assert_eq!(x.matches("<skipped ").count(), 2);
    assert!(x.contains("&lt;odd &amp; &quot;id&quot;&gt;"));
    assert!(!x.contains("<odd"));
}

#[test]
fn a_baseline_reports_moves_class_changes_and_vanished_paths() {
    let base = Baseline::of(&report(healthy()), 100);
    assert_eq!(base.compare(&base, 0.1).status, Status::Pass);
    // Through its JSON and back; what is not a baseline says so.
    let base = Baseline::from_json(std::str::from_utf8(&base.to_json()).unwrap(), "b.json").unwrap();
    let e = Baseline::from_json("{\"type\":\"verify\"}", "x.json").unwrap_err();
    assert!(
        e.to_string().starts_with("x.json is not a roce-trace baseline"),
        "{e}"
    );

    let mut v = healthy();
    v[0] = flow(1, 3, 49152, Some(2)); // was via s1
    v[2].class[4].dscp = 10;
    let now = Baseline::of(&report(v), 100);
    let c = base.compare(&now, 0.1);
    assert_eq!(c.status, Status::Fail);
    let details: Vec<&str> = c.evidence.iter().map(|e| e.detail.as_str()).collect();
    assert!(
        details.iter().any(|d| d.starts_with("moved from h1 > l1 > s1")),
        "{details:?}"
    );
    assert!(details.iter().any(|d| d.contains("DSCP 26 -> 10")), "{details:?}");
    assert!(
        !details.iter().any(|d| d.contains("no longer used")),
        "s1 still carries flows"
    );

    // Spine 1 gone entirely: its path vanished.
    let v: Vec<FlowReport> = healthy()
        .into_iter()
        .map(|f| {
            if via_s1(&f) {
                flow(1, 3, f.udp_sport, Some(2))
            } else {
                f
            }
        })
        .collect();
    let c = base.compare(&Baseline::of(&report(v), 100), 0.1);
    assert!(
        c.evidence
            .iter()
            .any(|e| e.detail.contains("h1 > l1 > s1 > l2 > h3 no longer used"))
    );
}

/// The same flows after as much traffic again.
fn later(mut v: Vec<FlowReport>) -> Vec<FlowReport> {
    for f in &mut v {
        for c in f.counters.values_mut() {
            let once = *c;
            c.add(&once);
        }
        f.trajectories *= 2;
        let after = f.delivery.last().map_or(0, |d| d.end_ns);
        f.delivery.extend(steady().into_iter().map(|d| DeliveryAt {
            start_ns: after + d.start_ns,
            end_ns: after + d.end_ns,
            ..d
        }));
    }
    v
}

#[test]
fn a_window_counts_only_what_happened_in_it() {
    let mut start = healthy();
    let between = [start[0].path[1].clone(), start[0].path[2].clone()];
    start[0].lost.push(Lost {
        between,
        span: Span {
            first_ns: 1,
            last_ns: 2,
            packets: 5,
        },
        ..Default::default()
    });
    let mut end = later(start.clone());
    // Flow 2 stopped before the window; flow 4 changed class during it.
    end[2] = start[2].clone();
    let between = [end[4].path[2].clone(), end[4].path[3].clone()];
    end[4].class_changes.push(ClassChange {
        between,
        from_dscp: 26,
        to_dscp: 0,
        span: Span {
            first_ns: 5,
            last_ns: 6,
            packets: 7,
        },
    });
    let w = since(&report(start.clone()), report(end.clone()));
    // What a continuous judge keeps of a window's start makes the same window.
    let from_base = since(&crate::window::base(&report(start.clone())), report(end.clone()));
    assert_eq!(
        serde_json::to_value(&from_base).unwrap(),
        serde_json::to_value(&w).unwrap()
    );
    assert_eq!(w.flows.len(), start.len() - 1, "the idle flow is left out");
    assert!(!w.flows.iter().any(|f| f.id == start[2].id));
    let f0 = w.flows.iter().find(|f| f.id == start[0].id).unwrap();
    assert!(f0.lost.is_empty(), "the loss happened before the window");
    assert_eq!(f0.trajectories, 250);
    assert!(
        f0.counters
            .values()
            .all(|c| c.counts.packets == 1000 && c.counts.ecn[2] == 1000)
    );
    let f4 = w.flows.iter().find(|f| f.id == start[4].id).unwrap();
    assert_eq!(f4.class_changes[0].span.packets, 7);
    assert_eq!(f0.delivery.len(), 7, "only the deltas counted in the window");
    assert!(f0.delivery.iter().all(|d| d.start_ns >= 7_000_000_000));
}

const DOWN: u64 = 10_000_000_000;
const UP: u64 = 20_000_000_000;

fn host(ip: &IpAddr) -> u8 {
    ip.to_string().split('.').nth(2).unwrap().parse().unwrap()
}

/// `f` on a path through `spine` from `after_ms` into the failure on.
fn move_to(f: &mut FlowReport, spine: u8, after_ms: u64) {
    let p = points(host(&f.src_ip), host(&f.dst_ip), Some(spine));
    if f.path_history.iter().all(|x| x.since_ns < DOWN) {
        f.path_history.push(PathAt {
            since_ns: DOWN + after_ms * 1_000_000,
            path: p.clone(),
        });
    }
    f.path = p;
}

/// `packets` sampled packets of `f` lost (in all) past the point `at` of its path.
fn lose(f: &mut FlowReport, at: usize, packets: u64) {
    f.lost = vec![Lost {
        between: [f.path[at].clone(), f.path[at + 1].clone()],
        span: Span {
            first_ns: DOWN,
            last_ns: DOWN + 1,
            packets,
        },
        ..Default::default()
    }];
}

/// Nothing of `f` gets past the point `at` of its path since `was`: the points beyond
/// count no more than they did then.
fn stop_past(f: &mut FlowReport, was: &FlowReport, at: usize) {
    for p in &f.path[at + 1..] {
        f.counters.insert(p.clone(), was.counters[p]);
    }
}

fn is_ack(f: &FlowReport) -> bool {
    f.src_ip == h(3)
}

/// A drill's views of the collector's (cumulative) report: at the start; before the
/// failure, after as much traffic again; half-way through it and at its end (`fail`
/// shapes the flows of both, given the flow as it was before the failure); and after
/// the repair, back as before.
fn drill_snapshots(fail: impl Fn(&mut FlowReport, &FlowReport, bool)) -> drill::Snapshots {
    let before = later(healthy());
    let mut mid = later(before.clone());
    for (f, was) in mid.iter_mut().zip(&before) {
        fail(f, was, false);
    }
    let mut end = later(mid.clone());
    for (f, was) in end.iter_mut().zip(&before) {
        fail(f, was, true);
    }
    drill::Snapshots {
        start: report(healthy()),
        before: report(before),
        settled: report(mid),
        during: report(end),
        after: report(later(later(later(later(healthy()))))),
        down_at_ns: DOWN,
        up_at_ns: UP,
    }
}

fn via() -> Vec<String> {
    vec!["s1".to_string(), "s2".to_string()]
}

fn drill_checks(p: &Policy, s: &drill::Snapshots) -> BTreeMap<String, super::checks::CheckResult> {
    drill::judge(p, &drill::measure(s, &via()))
        .into_iter()
        .map(|c| (c.check.clone(), c))
        .collect()
}

/// The example policy without a loss budget: only flows that stop fail `drill_loss`.
fn policy_without_loss_budget() -> Policy {
    let text: String = POLICY
        .lines()
        .filter(|l| !l.starts_with("max_lost"))
        .map(|l| format!("{l}\n"))
        .collect();
    let p = Policy::parse(&text).unwrap();
    assert_eq!(p.drill.as_ref().unwrap().max_lost, None);
    p
}

#[test]
fn a_drill_measures_loss_recovery_and_return_in_both_directions() {
    // The s1 flows lose a few sampled packets and move to s2: the requests 40 ms after
    // the failure, their ACKs (routed back by the far leaf) 300 ms after.
    let s = drill_snapshots(|f, _, _| {
        if !via_s1(f) && f.path_history.len() == 1 {
            return;
        }
        if is_ack(f) {
            lose(f, 2, 2);
            move_to(f, 2, 300);
        } else {
            lose(f, 1, 3);
            move_to(f, 2, 40);
        }
    });
    let d = drill::measure(&s, &via());
    assert_eq!(d.flows.len(), 18, "8 QPs' data and ACKs, and 2 QPs' data");
    let affected: Vec<&drill::DrillFlow> = d.affected().map(|(_, f)| f).collect();
    assert_eq!(affected.len(), 8);
    assert_eq!(affected.iter().filter(|f| f.way == drill::Way::Acks).count(), 4);
    for f in &affected {
        let (lost, ms, dir) = match f.way {
            drill::Way::Data => (3, 40.0, "data 10.10.1.2→10.10.3.2"),
            _ => (2, 300.0, "replies (ACKs) 10.10.3.2→10.10.1.2"),
        };
        assert_eq!(f.lost_packets(), lost);
        assert!((f.moved_after_ms.unwrap() - ms).abs() < 1e-6);
        assert_eq!(f.direction, dir);
        assert!(f.stopped.is_none());
    }
    let all_s2 = BTreeMap::from([("s1".to_string(), 0), ("s2".to_string(), 8)]);
    assert_eq!(d.spread_during, all_s2);
    assert_eq!(d.reply_spread_during, all_s2);
    assert!(d.flows.values().all(|f| !f.not_back));
    let p = Policy::parse(POLICY).unwrap();
    let c = drill_checks(&p, &s);
    assert!(c.values().all(|c| c.status == Status::Pass), "{c:#?}");
    assert!(
        c["drill_loss"]
            .summary
            .starts_with("20 sampled packets lost (12 data, 8 replies)"),
        "{}",
        c["drill_loss"].summary
    );
    assert!(
        c["drill_recovery"]
            .summary
            .starts_with("8 flow(s) moved (4 data, 4 replies), the last after 300 ms"),
        "{}",
        c["drill_recovery"].summary
    );

    // Flows that stay on the dead path, and flows that do not come back, fail — the
    // replies as much as the data.
    let mut stuck = drill_snapshots(|f, _, _| {
        if via_s1(f) {
            lose(f, if is_ack(f) { 2 } else { 1 }, 2);
        }
    });
    stuck.after = stuck.during.clone();
    stuck.after.flows.iter_mut().filter(|f| via_s1(f)).for_each(|f| {
        move_to(f, 2, 0);
    });
    let c = drill_checks(&p, &stuck);
    let failed: Vec<&str> = c
        .values()
        .filter(|c| c.status == Status::Fail)
        .map(|c| c.check.as_str())
        .collect();
    assert_eq!(failed, vec!["drill_recovery", "drill_return"]);
    for check in ["drill_recovery", "drill_return"] {
        let e = &c[check].evidence;
        assert_eq!(e.len(), 8, "{check}: {e:#?}");
        assert_eq!(
            e.iter()
                .filter(|e| e.detail.starts_with("replies (ACKs) 10.10.3.2→10.10.1.2: "))
                .count(),
            4,
            "{check}: {e:#?}"
        );
    }
}

/// The fault from the field: l1 stops using its dead link to s1 at once, so the requests
/// move and lose nothing, but l2 keeps hashing h1's traffic onto s1, which drops it —
/// the collector locates the loss on the ACK flows, and that alone must fail the drill.
#[test]
fn a_drill_where_only_the_replies_lose_packets_fails_naming_them() {
    let s = drill_snapshots(|f, _, settled| {
        if !via_s1(f) && f.path_history.len() == 1 {
            return;
        }
        if is_ack(f) {
            lose(f, 2, if settled { 30 } else { 15 });
        } else {
            move_to(f, 2, 0);
        }
    });
    let p = Policy::parse(POLICY).unwrap();
    let c = drill_checks(&p, &s);
    let loss = &c["drill_loss"];
    assert_eq!(loss.status, Status::Fail, "{loss:#?}");
    assert!(
        loss.summary
            .starts_with("120 sampled packets lost (0 data, 120 replies)"),
        "{}",
        loss.summary
    );
    assert_eq!(loss.evidence.len(), 4, "{loss:#?}");
    for e in &loss.evidence {
        assert_eq!(
            e.detail,
            "replies (ACKs) 10.10.3.2→10.10.1.2: 30 sampled packets lost during the failure"
        );
        assert_eq!(e.at, ["s1:l2:ingress", "l1:s1:ingress"]);
    }
    // They never moved off s1 either.
    let rec = &c["drill_recovery"];
    assert_eq!(rec.status, Status::Fail);
    assert!(rec.evidence.iter().all(|e| {
        e.detail
            .starts_with("replies (ACKs) 10.10.3.2→10.10.1.2: lost packets")
    }));
    assert_eq!(rec.evidence.len(), 4);
}

/// The same black hole seen by the exact counters: the ACKs through s1 still leave h3
/// but none reach h1 once the failure has settled. Stopping is no matter of a loss
/// budget: it fails without one, where the ACKs stop.
#[test]
fn replies_that_stop_getting_through_fail_the_drill_without_a_loss_budget() {
    let s = drill_snapshots(|f, was, _| {
        if !via_s1(f) && f.path_history.len() == 1 {
            return;
        }
        if is_ack(f) {
            stop_past(f, was, 2);
            lose(f, 2, 1);
        } else {
            move_to(f, 2, 0);
        }
    });
    let c = drill_checks(&policy_without_loss_budget(), &s);
    let loss = &c["drill_loss"];
    assert_eq!(loss.status, Status::Fail, "{loss:#?}");
    assert!(
        loss.summary.contains("4 flow(s) stopped (0 data, 4 replies)"),
        "{}",
        loss.summary
    );
    let stops: Vec<_> = loss
        .evidence
        .iter()
        .filter(|e| e.detail.contains("since the failure settled"))
        .collect();
    assert_eq!(stops.len(), 4, "{loss:#?}");
    for e in stops {
        assert_eq!(
            e.detail,
            "replies (ACKs) 10.10.3.2→10.10.1.2: none of its 400 packets since the failure settled reached h1"
        );
        assert_eq!(e.at, ["s1:l2:ingress", "l1:s1:ingress"]);
    }
    // A healthy drill passes without the budget too.
    let healthy = drill_snapshots(|_, _, _| {});
    let c = drill_checks(&policy_without_loss_budget(), &healthy);
    assert_eq!(c["drill_loss"].status, Status::Pass, "{:#?}", c["drill_loss"]);
}

/// A requester whose ACKs vanished sends nothing once its retries ran out; a responder
/// that stops answering leaves its requester waiting. Both stall their connection.
#[test]
fn a_connection_that_stalls_during_the_drill_fails_it() {
    let first = |f: &FlowReport| f.udp_sport == 49152 && f.dst_ip != h(2);
    // QP 0's data and ACKs: silent once the failure has settled (nothing new at all).
    let stalled = drill_snapshots(|f, _, settled| {
        if first(f) {
            if !is_ack(f) {
                lose(f, 2, 4);
            }
            if settled {
                let mut was = f.clone();
                for c in was.counters.values_mut() {
                    c.counts.packets /= 2;
                }
                f.counters = was.counters;
                f.trajectories /= 2;
            }
        }
    });
    let d = drill::measure(&stalled, &via());
    let stops: Vec<(&String, &drill::Stop)> = d
        .flows
        .iter()
        .filter_map(|(id, f)| f.stopped.as_ref().map(|s| (id, s)))
        .collect();
    assert_eq!(stops.len(), 1, "{stops:#?}");
    assert_eq!(stops[0].0, "10.10.1.2:49152>10.10.3.2/0xc100");
    assert!(stops[0].1.detail.contains("its connection stalled"));
    assert_eq!(stops[0].1.at, ["s1:l1:ingress", "l2:s1:ingress"]);
    let p = Policy::parse(POLICY).unwrap();
    assert_eq!(drill_checks(&p, &stalled)["drill_loss"].status, Status::Fail);

    // Its ACKs alone silent while every request of the host pair is delivered.
    let unanswered = drill_snapshots(|f, _, settled| {
        if first(f) && is_ack(f) && settled {
            for c in f.counters.values_mut() {
                c.counts.packets /= 2;
            }
            f.trajectories /= 2;
        }
    });
    let d = drill::measure(&unanswered, &via());
    let f = &d.flows["10.10.3.2:49152>10.10.1.2/0xc100"];
    let s = f.stopped.as_ref().expect("stopped");
    assert!(
        s.detail.starts_with(
            "sent nothing once the failure had settled, while data 10.10.1.2→10.10.3.2 delivered"
        ),
        "{}",
        s.detail
    );
    assert_eq!(d.flows.values().filter(|f| f.stopped.is_some()).count(), 1);
}

/// Requests carry the responder's QP, replies the requester's: only the collector's
/// pairing (the CNP flow it charged to a data flow) joins one QP's two directions; other
/// flows go with every flow of the other way between the same two hosts.
#[test]
fn reply_flows_go_with_their_own_data_flow_when_the_collector_paired_them() {
    let mut v = healthy();
    // QP 0's ACKs and CNPs come back to requester QP 0x100; the collector charged the
    // CNPs to QP 0's data flow.
    let mut cnp = acks(1, 3, 60000, Some(1));
    for c in cnp.counters.values_mut() {
        c.counts.ack = 0;
        c.counts.cnp = 100;
    }
    cnp.dest_qp = 0x100;
    cnp.id = format!("{}:60000>{}/0x100", h(3), h(1));
    v[1].dest_qp = 0x100;
    v[1].id = format!("{}:49152>{}/0x100", h(3), h(1));
    v[0].answered_by.flows = vec![cnp.id.clone()];
    v.push(cnp.clone());
    let s = drill::Snapshots {
        start: report(v.clone()),
        before: report(later(v.clone())),
        settled: report(later(later(v.clone()))),
        during: report(later(later(later(v.clone())))),
        after: report(later(later(later(later(v))))),
        down_at_ns: DOWN,
        up_at_ns: UP,
    };
    let d = drill::measure(&s, &via());
    let data0 = &d.flows["10.10.1.2:49152>10.10.3.2/0xc100"];
    assert!(data0.peers_exact);
    assert_eq!(
        data0.peers,
        ["10.10.3.2:49152>10.10.1.2/0x100".to_string(), cnp.id.clone()]
    );
    let c = &d.flows[&cnp.id];
    assert_eq!(c.way, drill::Way::Cnps);
    assert_eq!(c.direction, "replies (CNPs) 10.10.3.2→10.10.1.2");
    assert!(c.peers_exact);
    assert_eq!(c.peers, ["10.10.1.2:49152>10.10.3.2/0xc100"]);
    // QP 1's ACKs: the collector did not pair them, so with all 8 data flows h1 → h3.
    let ack1 = &d.flows["10.10.3.2:49153>10.10.1.2/0xc101"];
    assert!(!ack1.peers_exact);
    assert_eq!(ack1.peers.len(), 8);
}

mod nic_checks {
    use roce_trace_correlate::{NicIntervalReport, NicPortReport};

    use super::*;

    const S: u64 = 1_000_000_000;

    /// A port reporting `available` counters and one interval a second with `deltas`.
    fn port(node: &str, available: &[&str], intervals: &[&[(&str, u64)]]) -> NicPortReport {
        NicPortReport {
            node: node.into(),
            iface: "eth0".into(),
            names: "mlx5".into(),
            rdma_device: Some("mlx5_0".into()),
            addrs: vec![h(node[1..].parse().unwrap())],
            intervals: intervals
                .iter()
                .enumerate()
                .map(|(i, d)| NicIntervalReport {
                    start_ns: i as u64 * S,
                    end_ns: (i as u64 + 1) * S,
                    reset: false,
                    deltas: d.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
                })
                .collect(),
            available: available.iter().map(|s| s.to_string()).collect(),
            not_available: BTreeMap::new(),
        }
    }

    fn judged(p: &str, r: &CollectorReport) -> Vec<CheckResult> {
        judge(&Policy::parse(p).unwrap(), r, Load::Idle)
    }

    fn with_nic(nic: Vec<NicPortReport>) -> CollectorReport {
        CollectorReport {
            nic,
            ..report(Vec::new())
        }
    }

    const PFC3: &[&str] = &[
        "rx_prio3_pause",
        "tx_prio3_pause",
        "rx_prio3_pause_duration",
        "tx_prio3_pause_duration",
    ];

    #[test]
    fn pause_on_a_priority_that_is_not_lossless_fails_naming_host_port_and_priority() {
        let mut avail = PFC3.to_vec();
        avail.extend(["tx_prio5_pause", "tx_prio5_pause_duration"]);
        let ok = port(
            "h1",
            PFC3,
            &[&[("rx_prio3_pause", 50)], &[("rx_prio3_pause", 10)]],
        );
        // Paused sending on priority 5 in the second interval only: a fault that comes
        // and goes, in the transmit direction.
        let bad = port(
            "h3",
            &avail,
            &[&[], &[("tx_prio5_pause", 7), ("tx_prio5_pause_duration", 900)]],
        );
        let no_pfc = port("h2", &["np_cnp_sent"], &[&[]]);
        let policy = "[pfc]\nlossless_priorities = [3]\n";
        let r = &judged(policy, &with_nic(vec![ok.clone(), bad, no_pfc.clone()]))[0];
        assert_eq!(r.status, Status::Fail, "{r:#?}");
        assert_eq!(r.evidence.len(), 1, "{r:#?}");
        assert_eq!(r.evidence[0].at, ["h3/eth0 (mlx5_0)", "priority 5"]);
        assert!(
            r.evidence[0].detail.contains("7 pause frames sent on priority 5"),
            "{r:#?}"
        );
        assert!(
            r.summary.contains("h2/eth0 (mlx5_0)"),
            "the port not judged is named: {}",
            r.summary
        );
        let r = &judged(policy, &with_nic(vec![ok]))[0];
        assert_eq!(r.status, Status::Pass, "{r:#?}");
        // No port with per-priority pause counters: no data, never a pass.
        let r = &judged(policy, &with_nic(vec![no_pfc]))[0];
        assert_eq!(r.status, Status::NoData, "{r:#?}");
        let r = &judged(policy, &with_nic(Vec::new()))[0];
        assert_eq!(r.status, Status::NoData, "{r:#?}");
    }

    #[test]
    fn pause_time_over_the_ratio_in_any_interval_fails_either_direction() {
        let policy = "[pfc]\nmax_pause_ratio = 0.1\n";
        for (dir, name) in [
            ("rx", "rx_prio3_pause_duration"),
            ("tx", "tx_prio3_pause_duration"),
        ] {
            // 5% then 25% of a second then nothing: the average (10%) is not over the
            // limit, one interval is.
            let p = port("h1", PFC3, &[&[(name, 50_000)], &[(name, 250_000)], &[]]);
            let r = &judged(policy, &with_nic(vec![p]))[0];
            assert_eq!(r.status, Status::Fail, "{dir}: {r:#?}");
            assert!(r.evidence[0].detail.contains("25.0%"), "{r:#?}");
            assert!(r.evidence[0].at.contains(&"priority 3".to_string()));
        }
        let p = port("h1", PFC3, &[&[("rx_prio3_pause_duration", 99_000)]]);
        assert_eq!(judged(policy, &with_nic(vec![p]))[0].status, Status::Pass);
    }

    #[test]
    fn a_storm_is_two_intervals_paused_or_the_nics_own_events() {
        let policy = "[pfc]\nno_storm = true\n";
        let d = "tx_prio3_pause_duration";
        let storm = port("h1", PFC3, &[&[(d, 960_000)], &[(d, 990_000)]]);
        let r = &judged(policy, &with_nic(vec![storm]))[0];
        assert_eq!(r.status, Status::Fail, "{r:#?}");
        // Two long pauses that are not consecutive are not a storm.
        let gaps = port("h1", PFC3, &[&[(d, 960_000)], &[(d, 100)], &[(d, 990_000)]]);
        assert_eq!(judged(policy, &with_nic(vec![gaps]))[0].status, Status::Pass);
        let mut avail = PFC3.to_vec();
        avail.push("tx_pause_storm_error_events");
        let events = port("h1", &avail, &[&[("tx_pause_storm_error_events", 1)]]);
        let r = &judged(policy, &with_nic(vec![events]))[0];
        assert_eq!(r.status, Status::Fail);
        assert!(r.evidence[0].detail.contains("tx_pause_storm_error_events"));
    }

    #[test]
    fn sequence_errors_and_timeouts_per_port() {
        let avail = [
            "packet_seq_err",
            "out_of_sequence",
            "tx_vport_rdma_unicast_packets",
            "rx_vport_rdma_unicast_packets",
            "local_ack_timeout_err",
        ];
        let policy = "[nic]\nmax_seq_err_ppm = 100\nmax_timeout_per_s = 1.0\n";
        let quiet = port(
            "h1",
            &avail,
            &[&[
                ("tx_vport_rdma_unicast_packets", 100_000),
                ("rx_vport_rdma_unicast_packets", 100_000),
            ]],
        );
        // The responder side: out-of-sequence packets over what the port received.
        let ooo = port(
            "h3",
            &avail,
            &[&[
                ("tx_vport_rdma_unicast_packets", 100_000),
                ("rx_vport_rdma_unicast_packets", 100_000),
                ("out_of_sequence", 50),
            ]],
        );
        let slow = port(
            "h4",
            &avail,
            &[&[("local_ack_timeout_err", 3)], &[("local_ack_timeout_err", 2)]],
        );
        let r = judged(policy, &with_nic(vec![quiet.clone(), ooo, slow]));
        assert_eq!(r[0].status, Status::Fail, "{r:#?}");
        assert_eq!(r[0].evidence.len(), 1);
        assert!(
            r[0].evidence[0]
                .detail
                .starts_with("responder: 50 sequence errors"),
            "{r:#?}"
        );
        assert_eq!(r[1].status, Status::Fail, "{r:#?}");
        assert!(r[1].evidence[0].at[0].starts_with("h4/"), "{r:#?}");
        assert!(r[1].evidence[0].detail.contains("(2.50/s)"), "{r:#?}");
        let r = judged(policy, &with_nic(vec![quiet]));
        assert!(r.iter().all(|c| c.status == Status::Pass), "{r:#?}");
        // Without RDMA packet counts the sequence errors cannot be judged.
        let bare = port("h1", &["packet_seq_err"], &[&[("packet_seq_err", 5)]]);
        assert_eq!(judged(policy, &with_nic(vec![bare]))[0].status, Status::NoData);
    }

    /// CNPs from h3 to h1: `n` at every point.
    fn cnps(n: u64) -> FlowReport {
        let mut f = flow(3, 1, 0, Some(2));
        for c in f.counters.values_mut() {
            c.counts.packets = n;
            c.counts.cnp = n;
            c.counts.ecn = [0; 4];
        }
        f
    }

    #[test]
    fn nic_cnps_that_the_wire_does_not_show_fail_naming_the_port() {
        let policy = "[nic]\ncnp_consistency = 0.1\n";
        let avail = ["np_cnp_sent", "rp_cnp_handled"];
        let h3 = |sent: u64| port("h3", &avail, &[&[("np_cnp_sent", sent)]]);
        let h1 = |got: u64| port("h1", &avail, &[&[("rp_cnp_handled", got)]]);
        let r = |nic: Vec<NicPortReport>, wire: u64| {
            let mut rep = with_nic(nic);
            rep.flows = vec![cnps(wire)];
            judged(policy, &rep).remove(0)
        };
        assert_eq!(r(vec![h3(100), h1(100)], 100).status, Status::Pass);
        assert_eq!(r(vec![h3(105), h1(96)], 100).status, Status::Pass, "within 10%");
        // h3's NIC sent 200, the wire saw 100: h3 named, h1 (which handled what came) not.
        let bad = r(vec![h3(200), h1(100)], 100);
        assert_eq!(bad.status, Status::Fail, "{bad:#?}");
        assert_eq!(bad.evidence.len(), 1);
        assert_eq!(bad.evidence[0].at[0], "h3/eth0 (mlx5_0)");
        assert!(bad.evidence[0].detail.contains("fewer on the wire"), "{bad:#?}");
        // The receiving side: h1's NIC handled fewer than the wire delivered.
        let bad = r(vec![h3(100), h1(40)], 100);
        assert_eq!(bad.evidence[0].at[0], "h1/eth0 (mlx5_0)");
        // A NIC without CNP counters (rxe): no data.
        assert_eq!(
            r(vec![port("h3", &["out_of_sequence"], &[&[]])], 100).status,
            Status::NoData
        );
    }

    /// CE marks the NIC says it received against the CE marks on the data arriving at its
    /// addresses (at the flow's last point).
    #[test]
    fn nic_ce_marks_that_the_wire_does_not_show_fail() {
        let policy = "[nic]\ncnp_consistency = 0.1\n";
        let mut data = flow(1, 3, 7, Some(1));
        let last = data.path.last().unwrap().clone();
        data.counters.get_mut(&last).unwrap().counts.ecn = [0, 0, 950, 50];
        let h3 = |ce: u64| {
            port(
                "h3",
                &["np_ecn_marked_roce_packets"],
                &[&[("np_ecn_marked_roce_packets", ce)]],
            )
        };
        let r = |nic| {
            let mut rep = with_nic(vec![nic]);
            rep.flows = vec![data.clone()];
            judged(policy, &rep).remove(0)
        };
        assert_eq!(r(h3(50)).status, Status::Pass);
        let bad = r(h3(500));
        assert_eq!(bad.status, Status::Fail, "{bad:#?}");
        assert!(
            bad.evidence[0].detail.contains("received CE-marked 500 packets"),
            "{bad:#?}"
        );
        assert!(bad.evidence[0].detail.contains("the wire shows 50"), "{bad:#?}");
    }

    #[test]
    fn a_window_keeps_only_the_intervals_after_its_start() {
        let p = port("h1", PFC3, &[&[("rx_prio3_pause", 5)], &[("rx_prio3_pause", 7)]]);
        let mut start = with_nic(vec![p.clone()]);
        start.nic[0].intervals.truncate(1);
        let w = since(&start, with_nic(vec![p.clone()]));
        let from_base = since(&crate::window::base(&start), with_nic(vec![p]));
        assert_eq!(
            serde_json::to_value(&from_base).unwrap(),
            serde_json::to_value(&w).unwrap()
        );
        assert_eq!(w.nic[0].intervals.len(), 1);
        assert_eq!(w.nic[0].intervals[0].deltas["rx_prio3_pause"], 7);
    }
}
