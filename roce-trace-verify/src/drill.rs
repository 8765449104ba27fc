//! Failure drills: while traffic runs, take a link (or a spine) away and bring it back,
//! and measure what the connections went through — sampled packets lost during the
//! event, flows that stopped getting through, the time until every affected flow is on a
//! remaining path, the spread over what is left, and whether each flow returns to its
//! path from before once the repair is done.
//!
//! Both directions of every connection are judged: the requests (data) and what answers
//! them (ACKs and NAKs, CNPs). A fabric that reroutes the requests but keeps sending the
//! replies into the dead link stalls the connection just the same — the requester's
//! retries run out.
//!
//! The failure is an action: a command roce-trace runs (the lab's `cargo xtask lab fault
//! …`, a switch CLI over ssh), or, without one, the user doing it when asked. Times come
//! from the agents' clocks, so they must agree with this host's (NTP/PTP; in the lab they
//! are one clock).

use std::collections::{BTreeMap, BTreeSet};

use roce_trace_correlate::{CollectorReport, FlowReport, Lost, Point, path_nodes};
use serde::{Deserialize, Serialize};

use crate::{
    checks::{CheckResult, Evidence, Role, Status, ecmp_shares, labels, role},
    policy::{DrillPolicy, Policy},
    window::since,
};

/// Which way a flow goes in its connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Way {
    /// Requests: RDMA data.
    Data,
    /// ACKs and NAKs back to the requester (and CNPs, when they share the flow key).
    Acks,
    /// CNPs only.
    Cnps,
}

impl Way {
    fn of(r: Role) -> Self {
        match r {
            Role::Data => Way::Data,
            Role::Ack => Way::Acks,
            Role::Cnp => Way::Cnps,
        }
    }

    fn words(self) -> &'static str {
        match self {
            Way::Data => "data",
            Way::Acks => "replies (ACKs)",
            Way::Cnps => "replies (CNPs)",
        }
    }

    fn is_reply(self) -> bool {
        self != Way::Data
    }
}

/// Where a flow's packets stopped getting through, and how that shows.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Stop {
    /// The last point that saw them and the next on its path (empty: not known).
    pub at: Vec<String>,
    pub detail: String,
}

/// What one flow — one direction of a connection — went through.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DrillFlow {
    pub way: Way,
    /// The way and the addresses: `data 10.10.1.2→10.10.3.2`,
    /// `replies (ACKs) 10.10.3.2→10.10.1.2`.
    pub direction: String,
    /// The other direction of its connection: a reply flow's data flows, a data flow's
    /// reply flows. Exact when the collector paired them (a data flow's CNP flow carries
    /// its requester QP, which its ACKs share), else every such flow of the host pair.
    pub peers: Vec<String>,
    pub peers_exact: bool,
    /// Sampled packets lost during the failure, and where.
    pub lost: Vec<Lost>,
    /// Exact PSN gaps its receiver saw during the failure.
    pub psn_gaps: u64,
    /// From the failure to its first packet on another path (none: it did not move).
    pub moved_after_ms: Option<f64>,
    /// Nothing of it got through once the failure had settled.
    pub stopped: Option<Stop>,
    /// After the repair, on another path than before the failure.
    pub not_back: bool,
}

impl DrillFlow {
    pub fn lost_packets(&self) -> u64 {
        self.lost.iter().map(|l| l.span.packets).sum()
    }

    /// Lost packets, moved or stopped during the failure.
    pub fn affected(&self) -> bool {
        !self.lost.is_empty() || self.moved_after_ms.is_some() || self.stopped.is_some()
    }
}

/// What the drill measured (also in the checks' evidence).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DrillReport {
    pub down_at_ns: u64,
    pub up_at_ns: u64,
    /// Every flow that ran before the failure, data and replies, by id.
    pub flows: BTreeMap<String, DrillFlow>,
    /// Data flows per spine (policy `ecmp.via`) before, during and after.
    pub spread_before: BTreeMap<String, usize>,
    pub spread_during: BTreeMap<String, usize>,
    pub spread_after: BTreeMap<String, usize>,
    /// Reply flows per spine before and during.
    pub reply_spread_before: BTreeMap<String, usize>,
    pub reply_spread_during: BTreeMap<String, usize>,
}

impl DrillReport {
    pub fn affected(&self) -> impl Iterator<Item = (&String, &DrillFlow)> {
        self.flows.iter().filter(|(_, f)| f.affected())
    }
}

/// The collector's view through the drill, and when the failure began and ended (Unix
/// ns).
pub struct Snapshots {
    /// When the drill began: what ran before the failure is `before` less this.
    pub start: CollectorReport,
    /// After `hold` of traffic, just before the failure.
    pub before: CollectorReport,
    /// Half-way through the failure: from here to `during` is the failure once the
    /// fabric has had time to settle (`hold` should be at least twice the agents'
    /// counter interval, so this window holds none of the traffic from before it).
    pub settled: CollectorReport,
    /// At the end of the failure, just before the repair.
    pub during: CollectorReport,
    /// `hold` after the repair.
    pub after: CollectorReport,
    pub down_at_ns: u64,
    pub up_at_ns: u64,
}

pub fn data(r: &CollectorReport) -> impl Iterator<Item = &FlowReport> {
    r.flows.iter().filter(|f| role(f) == Some(Role::Data))
}

fn by_id(r: &CollectorReport) -> BTreeMap<&str, &FlowReport> {
    r.flows.iter().map(|f| (f.id.as_str(), f)).collect()
}

fn direction(way: Way, f: &FlowReport) -> String {
    format!("{} {}→{}", way.words(), f.src_ip, f.dst_ip)
}

/// The other direction of each flow's connection: (peers, exact). Requests carry the
/// responder's QP and replies the requester's, so only the collector's pairing (the CNP
/// flows it charged to a data flow, whose DestQP is the requester QP that the ACKs share)
/// joins one QP's two directions; otherwise a flow goes with every flow of the other way
/// between the same two hosts.
fn connections<'a>(flows: &[(&'a FlowReport, Way)]) -> BTreeMap<&'a str, (Vec<String>, bool)> {
    let reverse = |a: &FlowReport, b: &FlowReport| a.src_ip == b.dst_ip && a.dst_ip == b.src_ip;
    // Exact: data id -> its reply flows.
    let mut exact: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (d, _) in flows.iter().filter(|(_, w)| *w == Way::Data) {
        let qps: Vec<u32> = flows
            .iter()
            .filter(|(c, _)| d.answered_by.flows.contains(&c.id))
            .map(|(c, _)| c.dest_qp)
            .collect();
        let replies: Vec<&str> = flows
            .iter()
            .filter(|(r, w)| w.is_reply() && reverse(d, r) && qps.contains(&r.dest_qp))
            .map(|(r, _)| r.id.as_str())
            .collect();
        if !replies.is_empty() {
            exact.insert(&d.id, replies);
        }
    }
    let mut out = BTreeMap::new();
    for (f, w) in flows {
        let mine: Vec<String> = if *w == Way::Data {
            exact
                .get(f.id.as_str())
                .map_or(Vec::new(), |r| r.iter().map(|s| s.to_string()).collect())
        } else {
            exact
                .iter()
                .filter(|(_, r)| r.contains(&f.id.as_str()))
                .map(|(d, _)| d.to_string())
                .collect()
        };
        let entry = if mine.is_empty() {
            let all = flows
                .iter()
                .filter(|(o, ow)| reverse(f, o) && ow.is_reply() != w.is_reply())
                .map(|(o, _)| o.id.clone())
                .collect();
            (all, false)
        } else {
            (mine, true)
        };
        out.insert(f.id.as_str(), entry);
    }
    out
}

/// Packets a flow sent (its most upstream point counts the most) and delivered (at
/// `end`, the node its packets reached before the failure) in a window.
fn sent_delivered(w: &FlowReport, end: &str) -> (u64, u64) {
    let sent = w.counters.values().map(|c| c.counts.packets).max().unwrap_or(0);
    let delivered = w
        .counters
        .iter()
        .filter(|(p, _)| p.node == end)
        .map(|(_, c)| c.counts.packets)
        .max()
        .unwrap_or(0);
    (sent, delivered)
}

/// Where a flow's packets stop in a window: the last point of its path that counted
/// any and the next one (else where its sampled packets were lost).
fn stops_at(w: &FlowReport, before: &FlowReport) -> Vec<String> {
    let path = if w.path.is_empty() { &before.path } else { &w.path };
    match path
        .iter()
        .rposition(|p| w.counters.get(p).is_some_and(|c| c.counts.packets > 0))
    {
        Some(i) => labels(&path[i..(i + 2).min(path.len())]),
        None => w
            .lost
            .iter()
            .max_by_key(|l| l.span.packets)
            .map(|l| labels(&l.between))
            .unwrap_or_default(),
    }
}

/// The collector's view of the flows before the failure, while it lasted, and once it
/// had settled (its second half).
struct Views<'a> {
    before: BTreeMap<&'a str, &'a FlowReport>,
    failure: BTreeMap<&'a str, &'a FlowReport>,
    settled: BTreeMap<&'a str, &'a FlowReport>,
    /// Points whose agents reported counters once the failure had settled: a flow absent
    /// there sent nothing (rather than went unreported).
    reporting: BTreeSet<&'a Point>,
}

impl Views<'_> {
    /// Whether flow `b` (as before the failure) stopped getting through once the failure
    /// had settled, and where.
    fn stopped(&self, b: &FlowReport, way: Way, peers: &[String]) -> Option<Stop> {
        // Where its packets arrived before the failure.
        let end = b.path.last()?.node.as_str();
        if let Some(l) = self.settled.get(b.id.as_str()) {
            let (sent, delivered) = sent_delivered(l, end);
            return (sent > 0 && delivered == 0).then(|| Stop {
                at: stops_at(l, b),
                detail: format!("none of its {sent} packets since the failure settled reached {end}"),
            });
        }
        if !b.path.first().is_some_and(|p| self.reporting.contains(p)) {
            return None;
        }
        match way {
            // A stalled requester: its QP ran before the failure and sends nothing now
            // (a retry-exceeded QP is in error). Where: where its connection lost packets.
            Way::Data => {
                let at = std::iter::once(&b.id)
                    .chain(peers)
                    .filter_map(|id| self.failure.get(id.as_str()))
                    .flat_map(|x| &x.lost)
                    .max_by_key(|l| l.span.packets)
                    .map(|l| labels(&l.between))
                    .unwrap_or_default();
                Some(Stop {
                    at,
                    detail:
                        "sent nothing once the failure had settled (it ran before): its connection stalled"
                            .into(),
                })
            }
            // No replies although every data flow they answer was delivered: the
            // requester waits for them in vain.
            Way::Acks => {
                let delivered: Vec<u64> = peers
                    .iter()
                    .map(|p| {
                        let pb = self.before.get(p.as_str())?;
                        let (_, n) = sent_delivered(self.settled.get(p.as_str())?, &pb.path.last()?.node);
                        (n > 0).then_some(n)
                    })
                    .collect::<Option<_>>()?;
                (!delivered.is_empty()).then(|| Stop {
                    at: Vec::new(),
                    detail: format!(
                        "sent nothing once the failure had settled, while data {}→{} delivered {} packets to {}",
                        b.dst_ip,
                        b.src_ip,
                        delivered.iter().sum::<u64>(),
                        b.src_ip
                    ),
                })
            }
            // CNPs come only with CE marks.
            Way::Cnps => None,
        }
    }
}

/// What the snapshots say about the failure at `down_at_ns` and the repair at
/// `up_at_ns`, for every flow that ran before it, in both directions.
pub fn measure(s: &Snapshots, via: &[String]) -> DrillReport {
    let (down_at_ns, up_at_ns) = (s.down_at_ns, s.up_at_ns);
    let mut d = DrillReport {
        down_at_ns,
        up_at_ns,
        ..Default::default()
    };
    // Roles and paths from everything seen up to the failure; the flows judged are those
    // that ran in the hold before it.
    let ran = since(&s.start, s.before.clone());
    let before = by_id(&s.before);
    let judged: Vec<(&FlowReport, Way)> = ran
        .flows
        .iter()
        .filter_map(|f| {
            let b = *before.get(f.id.as_str())?;
            Some((b, Way::of(role(b)?)))
        })
        .collect();
    let peers = connections(&judged);
    // What happened while the failure lasted, and once it had settled.
    let window = since(&s.before, s.during.clone());
    let settled = since(&s.settled, s.during.clone());
    let views = Views {
        before,
        failure: by_id(&window),
        settled: by_id(&settled),
        reporting: settled.flows.iter().flat_map(|f| f.counters.keys()).collect(),
    };
    let (w, after) = (&views.failure, by_id(&s.after));
    for &(b, way) in &judged {
        let wf = w.get(b.id.as_str()).copied();
        let (peer_ids, peers_exact) = peers.get(b.id.as_str()).cloned().unwrap_or_default();
        let stopped = views.stopped(b, way, &peer_ids);
        let f = DrillFlow {
            way,
            direction: direction(way, b),
            peers: peer_ids,
            peers_exact,
            lost: wf.map(|x| x.lost.clone()).unwrap_or_default(),
            psn_gaps: wf
                .and_then(|x| x.counters.values().map(|c| c.counts.psn_gaps).max())
                .unwrap_or(0),
            moved_after_ms: wf
                .and_then(|x| {
                    x.path_history
                        .iter()
                        .find(|p| p.since_ns >= down_at_ns && p.since_ns < up_at_ns)
                })
                .map(|p| (p.since_ns - down_at_ns) as f64 / 1e6),
            stopped,
            not_back: after
                .get(b.id.as_str())
                .is_some_and(|x| path_nodes(&x.path) != path_nodes(&b.path)),
        };
        d.flows.insert(b.id.clone(), f);
    }
    d.spread_before = ecmp_shares(&of_way(&s.before, &d, false), via);
    d.spread_during = ecmp_shares(&of_way(&s.during, &d, false), via);
    d.spread_after = ecmp_shares(&of_way(&s.after, &d, false), via);
    d.reply_spread_before = ecmp_shares(&of_way(&s.before, &d, true), via);
    d.reply_spread_during = ecmp_shares(&of_way(&s.during, &d, true), via);
    d
}

/// The judged flows of a report: the replies or the data.
fn of_way<'a>(r: &'a CollectorReport, d: &DrillReport, replies: bool) -> Vec<&'a FlowReport> {
    r.flows
        .iter()
        .filter(|f| d.flows.get(&f.id).is_some_and(|x| x.way.is_reply() == replies))
        .collect()
}

fn shares(m: &BTreeMap<String, usize>) -> String {
    if m.is_empty() {
        return "(no [ecmp] via in the policy)".into();
    }
    m.iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn ev(id: &str, at: Vec<String>, f: &DrillFlow, what: String) -> Evidence {
    Evidence {
        flow: id.to_owned(),
        at,
        detail: format!("{}: {what}", f.direction),
    }
}

/// "3 data, 6 replies".
fn split(n: (usize, usize)) -> String {
    format!("{} data, {} replies", n.0, n.1)
}

fn count<'a>(it: impl Iterator<Item = &'a DrillFlow>) -> (usize, usize) {
    it.fold(
        (0, 0),
        |(d, r), f| {
            if f.way.is_reply() { (d, r + 1) } else { (d + 1, r) }
        },
    )
}

/// The drill's checks, from the policy's `[drill]` section.
pub fn judge(policy: &Policy, d: &DrillReport) -> Vec<CheckResult> {
    let p = policy.drill.clone().unwrap_or(DrillPolicy {
        max_lost: None,
        max_recovery_ms: None,
        must_return: false,
    });
    vec![loss(&p, d), recovery(&p, d), ret(&p, d)]
}

fn loss(p: &DrillPolicy, d: &DrillReport) -> CheckResult {
    let lost = |replies: bool| -> u64 {
        d.flows
            .values()
            .filter(|f| f.way.is_reply() == replies)
            .map(DrillFlow::lost_packets)
            .sum()
    };
    let (data_lost, reply_lost) = (lost(false), lost(true));
    let total = data_lost + reply_lost;
    let gaps: u64 = d.flows.values().map(|f| f.psn_gaps).sum();
    let stopped = count(d.flows.values().filter(|f| f.stopped.is_some()));
    let affected = count(d.flows.values().filter(|f| f.affected()));
    let mut r = CheckResult {
        check: "drill_loss".into(),
        rule: match p.max_lost {
            Some(m) => format!(
                "at most {m} sampled packets lost during the failure, data and replies; no flow stops getting through"
            ),
            None => {
                "packets lost during the failure, data and replies (measured); no flow stops getting through"
                    .into()
            }
        },
        status: Status::Pass,
        checked: d.flows.len(),
        summary: format!(
            "{total} sampled packets lost ({data_lost} data, {reply_lost} replies), {gaps} PSN gaps; {} flow(s) stopped ({}); {} of {} flow(s) affected ({})",
            stopped.0 + stopped.1,
            split(stopped),
            affected.0 + affected.1,
            d.flows.len(),
            split(affected)
        ),
        evidence: Vec::new(),
    };
    let over = p.max_lost.is_some_and(|m| total > m);
    if stopped.0 + stopped.1 == 0 && !over {
        return r;
    }
    r.status = Status::Fail;
    // The flows that stopped first (replies first among them: what a drill of the data
    // alone misses), then every loss, the largest first.
    let mut stops: Vec<(&String, &DrillFlow, &Stop)> = d
        .flows
        .iter()
        .filter_map(|(id, f)| f.stopped.as_ref().map(|s| (id, f, s)))
        .collect();
    stops.sort_by_key(|(_, f, _)| !f.way.is_reply());
    for (id, f, s) in stops {
        r.evidence.push(ev(id, s.at.clone(), f, s.detail.clone()));
    }
    let mut losses: Vec<(&String, &DrillFlow, &Lost)> = d
        .flows
        .iter()
        .flat_map(|(id, f)| f.lost.iter().map(move |l| (id, f, l)))
        .collect();
    losses.sort_by_key(|(_, _, l)| std::cmp::Reverse(l.span.packets));
    for (id, f, l) in losses {
        r.evidence.push(ev(
            id,
            labels(&l.between),
            f,
            format!("{} sampled packets lost during the failure", l.span.packets),
        ));
    }
    r
}

fn recovery(p: &DrillPolicy, d: &DrillReport) -> CheckResult {
    let moved = count(d.flows.values().filter(|f| f.moved_after_ms.is_some()));
    let worst = d
        .flows
        .values()
        .filter_map(|f| f.moved_after_ms)
        .fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.max(x))));
    let spines = format!(
        "data via before: {}, during: {}; replies via before: {}, during: {}",
        shares(&d.spread_before),
        shares(&d.spread_during),
        shares(&d.reply_spread_before),
        shares(&d.reply_spread_during)
    );
    let mut r = CheckResult {
        check: "drill_recovery".into(),
        rule: match p.max_recovery_ms {
            Some(m) => format!("every affected flow, data and replies, on a remaining path within {m} ms"),
            None => {
                "time until every affected flow, data and replies, is on a remaining path (measured)".into()
            }
        },
        status: Status::Pass,
        checked: d.affected().count(),
        summary: match worst {
            Some(w) => format!(
                "{} flow(s) moved ({}), the last after {w:.0} ms; {spines}",
                moved.0 + moved.1,
                split(moved)
            ),
            None => format!("no flow moved; {spines}"),
        },
        evidence: Vec::new(),
    };
    for (id, f) in d.affected() {
        match f.moved_after_ms {
            None => {
                let why = if f.stopped.is_some() {
                    "stopped getting through and never moved to another path"
                } else {
                    "lost packets and never moved to another path"
                };
                let at = f.lost.first().map(|l| labels(&l.between)).unwrap_or_default();
                r.evidence.push(ev(id, at, f, why.into()));
            }
            Some(ms) if p.max_recovery_ms.is_some_and(|m| ms > m as f64) => {
                r.evidence.push(ev(
                    id,
                    Vec::new(),
                    f,
                    format!("back on a remaining path after {ms:.0} ms"),
                ));
            }
            Some(_) => {}
        }
    }
    if r.checked == 0 {
        r.status = Status::NoData;
        r.summary = "no flow was affected: did the failure hit their paths?".into();
    } else if !r.evidence.is_empty() {
        r.status = Status::Fail;
    }
    r
}

fn ret(p: &DrillPolicy, d: &DrillReport) -> CheckResult {
    let not_back = count(d.flows.values().filter(|f| f.not_back));
    let mut r = CheckResult {
        check: "drill_return".into(),
        rule: "after the repair every flow, data and replies, is back on its path from before".into(),
        status: Status::Pass,
        checked: d.flows.len(),
        summary: format!(
            "{} flow(s) not back ({}); data via after: {}",
            not_back.0 + not_back.1,
            split(not_back),
            shares(&d.spread_after)
        ),
        evidence: d
            .flows
            .iter()
            .filter(|(_, f)| f.not_back)
            .map(|(id, f)| {
                ev(
                    id,
                    Vec::new(),
                    f,
                    "on another path than before the failure".into(),
                )
            })
            .collect(),
    };
    if p.must_return && !r.evidence.is_empty() {
        r.status = Status::Fail;
    }
    r
}
