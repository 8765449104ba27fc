//! The judge: each policy rule applied to every flow (one QP direction) of a collector
//! report, with the flows, QPs, points and hops that break it as evidence.

use roce_trace_correlate::sat::SaturatingSum as _;
use std::{collections::BTreeMap, net::IpAddr};

use serde::{Deserialize, Serialize};

use roce_trace_correlate::{
    CollectorReport, Direction as PointDirection, FlowReport, Point, PointInfo, Span,
    observation::CounterDelta,
};

use crate::policy::{HopRule, Policy};

/// What the traffic in the window was meant to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Load {
    /// No congestion: CE marks are a fault.
    Idle,
    /// Deliberate congestion (incast, a bottleneck): CE marks are expected.
    Congested,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Pass,
    /// The condition the check judges did not arise (no CE marks, so no CNPs to judge).
    Skip,
    /// Could not check: the traffic the check needs was not seen.
    NoData,
    Fail,
}

impl Status {
    pub fn name(self) -> &'static str {
        match self {
            Status::Pass => "PASS",
            Status::Skip => "SKIP",
            Status::NoData => "NO DATA",
            Status::Fail => "FAIL",
        }
    }
}

/// One piece of evidence: a flow (or a node), where, and what.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Evidence {
    /// Flow id (`src:sport>dst/qp`), or empty for fabric-wide evidence.
    pub flow: String,
    /// Observation points, nodes, hops or host pairs involved (as text).
    pub at: Vec<String>,
    pub detail: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CheckResult {
    pub check: String,
    /// The rule, in words.
    pub rule: String,
    pub status: Status,
    /// Flows (or items) judged.
    pub checked: usize,
    pub summary: String,
    pub evidence: Vec<Evidence>,
}

impl CheckResult {
    fn new(check: impl Into<String>, rule: impl Into<String>) -> Self {
        Self {
            check: check.into(),
            rule: rule.into(),
            status: Status::Pass,
            checked: 0,
            summary: String::new(),
            evidence: Vec::new(),
        }
    }

    /// Pass/fail from the evidence, or `none` when nothing was judged.
    fn done(mut self, none: Status, none_why: &str) -> Self {
        if self.checked == 0 {
            self.status = none;
            self.summary = none_why.into();
        } else if self.evidence.is_empty() {
            self.status = Status::Pass;
            if self.summary.is_empty() {
                self.summary = format!("{} flow(s) checked", self.checked);
            }
        } else {
            self.status = Status::Fail;
            let flows: std::collections::BTreeSet<&str> = self
                .evidence
                .iter()
                .map(|e| e.flow.as_str())
                .filter(|f| !f.is_empty())
                .collect();
            if !flows.is_empty() {
                let n = format!("{} of {} flow(s) break it", flows.len(), self.checked);
                self.summary = if self.summary.is_empty() {
                    n
                } else {
                    format!("{n}; {}", self.summary)
                };
            }
        }
        self
    }

    fn evidence(&mut self, flow: &FlowReport, at: Vec<String>, detail: String) {
        self.evidence.push(Evidence {
            flow: flow.id.clone(),
            at,
            detail,
        });
    }
}

/// Points as evidence names them.
pub(crate) fn labels(points: &[Point]) -> Vec<String> {
    points.iter().map(Point::to_string).collect()
}

/// What a flow carries, from its exact counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Requests (RDMA data).
    Data,
    /// ACKs and NAKs (and CNPs, when they share the flow key).
    Ack,
    /// CNPs only.
    Cnp,
}

fn naks(c: &CounterDelta) -> u64 {
    c.counts.nak_psn_seq_err + c.counts.nak_rnr + c.counts.nak_other
}

/// The counters of the point that saw most of the flow.
pub fn peak(f: &FlowReport) -> Option<&CounterDelta> {
    f.counters.values().max_by_key(|c| c.counts.packets)
}

pub fn role(f: &FlowReport) -> Option<Role> {
    let c = peak(f)?;
    if c.counts.packets == 0 {
        return None;
    }
    let answers = c.counts.ack + naks(c) + c.counts.cnp;
    Some(if answers < c.counts.packets {
        Role::Data
    } else if c.counts.cnp == c.counts.packets {
        Role::Cnp
    } else {
        Role::Ack
    })
}

/// Counters at the flow's first (sender-side) or last (receiver-side) point.
fn counters_at(f: &FlowReport, first: bool) -> Option<&CounterDelta> {
    let p = if first { f.path.first() } else { f.path.last() };
    p.and_then(|p| f.counters.get(p))
        .filter(|c| c.counts.packets > 0)
        .or_else(|| peak(f))
}

fn ppm(n: u64, of: u64) -> u64 {
    (n.saturating_mul(1_000_000)).checked_div(of).unwrap_or(0)
}

fn pct(x: f64) -> String {
    format!("{:.2}%", x * 100.0)
}

/// Every rule of `policy` that applies to one window's report.
pub fn judge(policy: &Policy, report: &CollectorReport, load: Load) -> Vec<CheckResult> {
    let flows = &report.flows;
    let data: Vec<&FlowReport> = flows.iter().filter(|f| role(f) == Some(Role::Data)).collect();
    let mut out = Vec::new();
    if let Some(c) = &policy.class {
        if c.data_dscp.is_some() || c.data_pcp.is_some() {
            out.push(data_class(
                &data,
                c.data_dscp.map(|d| d.0),
                c.data_pcp.map(|p| p.0),
            ));
        }
        if let Some(d) = c.cnp_dscp {
            out.push(cnp_class(flows, d.0));
        }
        if c.no_change {
            out.push(no_class_change(flows));
        }
    }
    if let Some(e) = &policy.ecn {
        if e.data_ect {
            out.push(data_ect(&data));
        }
        match (load, e.ce_max_idle, e.ce_min_congested) {
            (Load::Idle, Some(max), _) => out.push(ce_idle(&data, max.0)),
            (Load::Congested, _, Some(min)) => out.push(ce_congested(&data, min.0)),
            _ => {}
        }
        if e.cnp_answers_ce {
            out.push(cnp_answers(&data, e.min_cnps_per_ce.map(|m| m.0).unwrap_or(0.0)));
        }
    }
    for r in &policy.hops {
        out.push(hops(flows, r));
    }
    if let Some(e) = &policy.ecmp {
        out.push(ecmp(&data, &e.via, e.max_share.0, e.min_flows as usize));
    }
    if let Some(r) = &policy.reliability {
        if let Some(max) = r.max_nak_ppm {
            out.push(nak_rate(flows, max));
        }
        if let Some(max) = r.max_psn_gap_ppm {
            out.push(psn_gaps(&data, max));
        }
        if let Some(max) = r.max_loss_ppm {
            out.push(loss(flows, max));
        }
    }
    if let Some(m) = &policy.mtu {
        out.push(mtu(&data, m.roce_mtu.0, report));
    }
    if let Some(s) = &policy.stability {
        if let Some(max) = s.max_throughput_spread {
            out.push(stability(&data, max.0, s.min_packets).0);
        }
        if let Some(max) = s.max_rate_cv {
            out.push(rate_over_time(&data, max.0, s.min_intervals));
        }
    }
    if let Some(p) = &policy.pfc {
        if let Some(l) = &p.lossless_priorities {
            let l: Vec<u8> = l.iter().map(|x| x.0).collect();
            out.push(crate::nic::lossless(&report.nic, &l));
        }
        if let Some(max) = p.max_pause_ratio {
            out.push(crate::nic::pause_ratio(&report.nic, max.0));
        }
        if p.no_storm {
            out.push(crate::nic::no_storm(&report.nic));
        }
    }
    if let Some(n) = &policy.nic {
        if let Some(max) = n.max_seq_err_ppm {
            out.push(crate::nic::seq_err(&report.nic, max));
        }
        if let Some(max) = n.max_timeout_per_s {
            out.push(crate::nic::timeouts(&report.nic, max.0));
        }
        if let Some(tol) = n.cnp_consistency {
            out.push(crate::nic::cnp_consistency(report, tol.0));
        }
    }
    out
}

fn data_class(data: &[&FlowReport], dscp: Option<u8>, pcp: Option<u8>) -> CheckResult {
    let mut words = Vec::new();
    if let Some(d) = dscp {
        words.push(format!("DSCP {d}"));
    }
    if let Some(p) = pcp {
        words.push(format!("PCP {p}"));
    }
    let mut r = CheckResult::new(
        "data_class",
        format!("RDMA data in {} at every point", words.join(", ")),
    );
    for f in data {
        r.checked += 1;
        // Every class each point showed over the window; the latest one per point only
        // from collectors that do not keep them.
        let seen: Vec<(&Point, u8, Option<u8>, String)> = if f.class_seen.is_empty() {
            f.class
                .iter()
                .map(|c| (&c.point, c.dscp, c.pcp, String::new()))
                .collect()
        } else {
            f.class_seen
                .iter()
                .filter(|c| !c.cnp)
                .map(|c| (&c.point, c.dscp, c.pcp, during(&c.span)))
                .collect()
        };
        for (point, got_dscp, got_pcp, when) in seen {
            if let Some(want) = dscp
                && got_dscp != want
            {
                r.evidence(
                    f,
                    vec![point.to_string()],
                    format!("DSCP {got_dscp} (expected {want}){when}"),
                );
            }
            if let (Some(want), Some(got)) = (pcp, got_pcp)
                && got != want
            {
                r.evidence(
                    f,
                    vec![point.to_string()],
                    format!("PCP {got} (expected {want}){when}"),
                );
            }
        }
        // Counters are exact: a point whose last packet left in another class, where no
        // sample showed it.
        for (point, c) in &f.counters {
            if let Some(want) = dscp
                && c.counts.packets > 0
                && c.last_dscp != want
                && !f.class.iter().any(|x| &x.point == point)
            {
                r.evidence(
                    f,
                    vec![point.to_string()],
                    format!("DSCP {} (expected {want}), by counters", c.last_dscp),
                );
            }
        }
    }
    r.done(Status::NoData, "no RDMA data flow seen")
}

/// How long and how many packets a class was seen: `, 896 sampled packets over 7.9 s`.
fn during(s: &Span) -> String {
    format!(
        ", {} packet(s) over {:.1} s",
        s.packets,
        s.last_ns.saturating_sub(s.first_ns) as f64 / 1e9
    )
}

fn cnp_class(flows: &[FlowReport], want: u8) -> CheckResult {
    let mut r = CheckResult::new("cnp_class", format!("CNPs in DSCP {want} at every point"));
    for f in flows
        .iter()
        .filter(|f| !f.cnp_class.is_empty() || f.class_seen.iter().any(|c| c.cnp))
    {
        r.checked += 1;
        let seen: Vec<(&Point, u8, String)> = if f.class_seen.iter().any(|c| c.cnp) {
            f.class_seen
                .iter()
                .filter(|c| c.cnp)
                .map(|c| (&c.point, c.dscp, during(&c.span)))
                .collect()
        } else {
            f.cnp_class
                .iter()
                .map(|c| (&c.point, c.dscp, String::new()))
                .collect()
        };
        for (point, got, when) in seen {
            if got != want {
                r.evidence(
                    f,
                    vec![point.to_string()],
                    format!("CNP in DSCP {got} (expected {want}){when}"),
                );
            }
        }
    }
    r.done(Status::Skip, "no CNPs in the window (nothing was CE-marked)")
}

fn no_class_change(flows: &[FlowReport]) -> CheckResult {
    let mut r = CheckResult::new(
        "no_class_change",
        "no DSCP change along any path, either direction",
    );
    for f in flows.iter().filter(|f| f.path.len() >= 2) {
        r.checked += 1;
        for c in &f.class_changes {
            r.evidence(
                f,
                labels(&c.between),
                format!(
                    "DSCP {} -> {} ({} sampled packets)",
                    c.from_dscp, c.to_dscp, c.span.packets
                ),
            );
        }
    }
    r.done(Status::NoData, "no flow seen at two or more points")
}

fn data_ect(data: &[&FlowReport]) -> CheckResult {
    let mut r = CheckResult::new("data_ect", "RDMA data leaves the sender ECN-capable");
    for f in data {
        let Some(c) = counters_at(f, true) else { continue };
        r.checked += 1;
        if c.counts.ecn[0] > 0 {
            let at = f.path.first().cloned().unwrap_or_default();
            r.evidence(
                f,
                vec![at.to_string()],
                format!("{} of {} packets Not-ECT", c.counts.ecn[0], c.counts.packets),
            );
        }
    }
    r.done(Status::NoData, "no RDMA data flow seen")
}

fn ce_fraction(f: &FlowReport) -> Option<(u64, u64, Point)> {
    let c = counters_at(f, false)?;
    Some((
        c.counts.ecn[3],
        c.counts.packets,
        f.path.last().cloned().unwrap_or_default(),
    ))
}

fn ce_idle(data: &[&FlowReport], max: f64) -> CheckResult {
    let mut r = CheckResult::new(
        "ce_fraction",
        format!("at most {} of a data flow CE-marked (idle fabric)", pct(max)),
    );
    for f in data {
        let Some((ce, n, at)) = ce_fraction(f) else {
            continue;
        };
        r.checked += 1;
        if ce as f64 > max * n as f64 {
            // Where the marks begin (between the last point without and the first with).
            let onset: Vec<String> = f
                .ce_onset
                .iter()
                .map(|o| match &o.after {
                    Some(a) => format!("{a} .. {}", o.at),
                    None => format!("before {}", o.at),
                })
                .collect();
            let detail = format!("{ce} of {n} packets CE ({})", pct(ce as f64 / n as f64));
            let detail = if onset.is_empty() {
                detail
            } else {
                format!("{detail}, marked between {}", onset.join(", "))
            };
            r.evidence(f, vec![at.to_string()], detail);
        }
    }
    r.done(Status::NoData, "no RDMA data flow seen")
}

fn ce_congested(data: &[&FlowReport], min: f64) -> CheckResult {
    let mut r = CheckResult::new(
        "ce_fraction",
        format!("at least {} of the data CE-marked under congestion", pct(min)),
    );
    let (mut ce, mut n) = (0, 0);
    for f in data {
        let Some((c, p, _)) = ce_fraction(f) else { continue };
        r.checked += 1;
        ce += c;
        n += p;
    }
    if n > 0 && (ce as f64) < min * n as f64 {
        r.summary = format!(
            "{ce} of {n} data packets CE ({}): congestion without ECN marking",
            pct(ce as f64 / n as f64)
        );
        for f in data {
            if let Some((c, p, at)) = ce_fraction(f) {
                r.evidence(f, vec![at.to_string()], format!("{c} of {p} packets CE"));
            }
        }
    } else if n > 0 {
        r.summary = format!("{ce} of {n} data packets CE ({})", pct(ce as f64 / n as f64));
    }
    r.done(Status::NoData, "no RDMA data flow seen")
}

fn cnp_answers(data: &[&FlowReport], min_per_ce: f64) -> CheckResult {
    let mut r = CheckResult::new(
        "cnp_answers_ce",
        "CE-marked data flows get CNPs back: counted where they reach the sender",
    );
    for f in data.iter().filter(|f| f.answered_by.ce_marks > 0) {
        r.checked += 1;
        let a = &f.answered_by;
        let per = a.cnps as f64 / a.ce_marks as f64;
        // A CNP lost on the way left its sender unthrottled for a while, however many
        // others got through (a fault that came and went).
        let lost: u64 = a.cnps_lost.iter().map(|l| l.packets).saturating_sum();
        if a.cnps == 0 || per < min_per_ce || lost > 0 {
            // Where the CNPs that were sent vanished, or the receiver's side when none
            // were sent at all.
            let lost: Vec<String> = a
                .cnps_lost
                .iter()
                .map(|l| format!("{} lost between {} and {}", l.packets, l.between[0], l.between[1]))
                .collect();
            let at = match a.cnps_lost.iter().max_by_key(|l| l.packets) {
                Some(l) => labels(&l.between),
                None => f.path.last().map(Point::to_string).into_iter().collect(),
            };
            let mut detail = format!(
                "{} CE marks; {} CNPs sent back, {} reached the sender ({per:.3} per mark, at least {min_per_ce} expected)",
                a.ce_marks, a.cnps_sent, a.cnps
            );
            if !lost.is_empty() {
                detail = format!("{detail}: {}", lost.join(", "));
            }
            r.evidence(f, at, detail);
        }
    }
    r.done(Status::Skip, "no data flow was CE-marked")
}

/// Routed hops of a flow: from probes that reached the destination, else the TTL
/// decrements between its first and last observation points.
fn hop_count(f: &FlowReport) -> Option<(u8, &'static str)> {
    if let Some(p) = &f.probe
        && p.reached
        && let Some(last) = p.hops.last()
    {
        return Some((last.ttl.saturating_sub(1), "probes"));
    }
    (f.path.len() >= 2).then(|| (f.hops.iter().fold(0u8, |a, h| a.saturating_add(*h)), "TTL"))
}

fn hops(flows: &[FlowReport], rule: &HopRule) -> CheckResult {
    let mut r = CheckResult::new(
        format!("hops {} <-> {}", rule.from, rule.to),
        format!(
            "{} routed hop(s) between {} and {}, both directions",
            rule.count, rule.from, rule.to
        ),
    );
    // A flow whose packets stop short of where the others to its destination arrive
    // counts the hops to where they vanish, not to its destination: that is loss (the
    // `loss` check names the place), not a hop count — unless probes reached the end.
    let ends = terminals(flows);
    for f in flows {
        let (s, d) = (f.src_ip, f.dst_ip);
        let between =
            (rule.from.contains(s) && rule.to.contains(d)) || (rule.to.contains(s) && rule.from.contains(d));
        let Some((n, how)) = hop_count(f).filter(|_| between) else {
            continue;
        };
        let short = ends
            .get(&f.dst_ip)
            .is_some_and(|e| f.path.last().is_some_and(|l| l.node != *e));
        if how == "TTL" && short {
            continue;
        }
        r.checked += 1;
        if n != rule.count {
            r.evidence(
                f,
                labels(&f.path),
                format!("{n} hop(s) by {how} (expected {})", rule.count),
            );
        }
    }
    r.done(Status::NoData, "no flow between these groups seen at two points")
}

/// Which of `via` a flow crosses: a point of its path on that node, or a probe hop; or,
/// when neither names one and `by_counters`, the one whose points counted the most of
/// its packets.
///
/// The path is the flow's latest sampled trajectory. A fault that drops only some of a
/// flow's packets before the spine (a link MTU below the frame size: the full-size
/// frames die, the short last ones of each message cross) can leave every sampled
/// packet of a flow short of the spine while its exact counters show it crossing. The
/// counters cover the whole report, so they say where a flow went in the window, not
/// where it goes now: the drill's spread during a failure places flows by path alone.
fn via_of<'a>(f: &FlowReport, via: &'a [String], by_counters: bool) -> Option<&'a String> {
    via.iter()
        .find(|v| {
            f.path.iter().any(|p| p.node == v.as_str())
                || f.probe.as_ref().is_some_and(|p| {
                    p.hops
                        .iter()
                        .any(|h| h.addr.is_some_and(|a| a.to_string() == **v))
                })
        })
        .or_else(|| {
            if !by_counters {
                return None;
            }
            let counted = |v: &String| -> u64 {
                f.counters
                    .iter()
                    .filter(|(p, _)| p.node == v.as_str())
                    .map(|(_, c)| c.counts.packets)
                    .max()
                    .unwrap_or(0)
            };
            // Reversed: of equal counts, the first listed (max_by_key keeps the last).
            via.iter()
                .rev()
                .map(|v| (v, counted(v)))
                .filter(|(_, n)| *n > 0)
                .max_by_key(|(_, n)| *n)
                .map(|(v, _)| v)
        })
}

/// Data flows per `via` node, each placed by its current path (or probe) alone.
pub fn ecmp_shares(data: &[&FlowReport], via: &[String]) -> BTreeMap<String, usize> {
    shares(data, via, false)
}

fn shares(data: &[&FlowReport], via: &[String], by_counters: bool) -> BTreeMap<String, usize> {
    let mut n: BTreeMap<String, usize> = via.iter().map(|v| (v.clone(), 0)).collect();
    for f in data {
        if let Some(v) = via_of(f, via, by_counters) {
            *n.get_mut(v).expect("listed") += 1;
        }
    }
    n
}

fn ecmp(data: &[&FlowReport], via: &[String], max_share: f64, min_flows: usize) -> CheckResult {
    let mut r = CheckResult::new(
        "ecmp_spread",
        format!(
            "no one of {} carries more than {} of the data flows",
            via.join(", "),
            pct(max_share)
        ),
    );
    // Over the window: a flow whose sampled packets all died short of the spines is
    // placed where its counters say it crossed.
    let n = shares(data, via, true);
    let total: usize = n.values().sum();
    let shares = n
        .iter()
        .map(|(v, k)| format!("{v} {k}"))
        .collect::<Vec<_>>()
        .join(", ");
    if total < min_flows.max(1) {
        r.status = Status::NoData;
        r.summary = format!(
            "{total} data flow(s) seen through {} (at least {min_flows} needed)",
            via.join("/")
        );
        return r;
    }
    r.checked = total;
    r.summary = format!("{shares} of {total} flows");
    for (v, k) in &n {
        if *k as f64 > max_share * total as f64 {
            r.evidence.push(Evidence {
                flow: String::new(),
                at: vec![v.clone()],
                detail: format!("{k} of {total} data flows ({})", pct(*k as f64 / total as f64)),
            });
        }
    }
    if !r.evidence.is_empty() {
        r.summary = format!("imbalanced: {shares} of {total} flows");
    }
    r.done(Status::NoData, "")
}

fn nak_rate(flows: &[FlowReport], max: u64) -> CheckResult {
    let mut r = CheckResult::new(
        "naks",
        format!("at most {max} NAKs per million data packets, per direction"),
    );
    // NAKs travel back: charge them to the data sent the other way between the same
    // hosts (one direction), and name the QPs that sent them.
    let mut dirs: BTreeMap<(IpAddr, IpAddr), (u64, u64, Vec<&FlowReport>)> = BTreeMap::new();
    for f in flows {
        match (role(f), peak(f)) {
            (Some(Role::Data), _) => {
                r.checked += 1;
                dirs.entry((f.src_ip, f.dst_ip)).or_default().1 +=
                    counters_at(f, true).map_or(0, |c| c.counts.packets);
            }
            (Some(Role::Ack | Role::Cnp), Some(c)) if naks(c) > 0 => {
                let d = dirs.entry((f.dst_ip, f.src_ip)).or_default();
                d.0 += naks(c);
                d.2.push(f);
            }
            _ => {}
        }
    }
    let (mut all_naks, mut all_data) = (0, 0);
    for ((src, dst), (n, data, by)) in &dirs {
        all_naks += n;
        all_data += data;
        if ppm(*n, *data) > max {
            for f in by {
                let k = peak(f).map_or(0, naks);
                r.evidence(
                    f,
                    vec![format!("{src} -> {dst}")],
                    format!(
                        "{k} NAKs; the direction: {n} for {data} data packets ({} ppm)",
                        ppm(*n, *data)
                    ),
                );
            }
        }
    }
    r.summary = format!(
        "{all_naks} NAKs for {all_data} data packets ({} ppm)",
        ppm(all_naks, all_data)
    );
    r.done(Status::NoData, "no RDMA data flow seen")
}

fn psn_gaps(data: &[&FlowReport], max: u64) -> CheckResult {
    let mut r = CheckResult::new("psn_gaps", format!("at most {max} PSN gaps per million packets"));
    let mut total = (0, 0);
    for f in data {
        let Some((point, c)) = f.counters.iter().max_by_key(|(_, c)| c.counts.psn_gaps) else {
            continue;
        };
        r.checked += 1;
        let n = peak(f).map_or(0, |p| p.counts.packets);
        total.0 = c.counts.psn_gaps.saturating_add(total.0);
        total.1 = n.saturating_add(total.1);
        if c.counts.psn_gaps > 0 && ppm(c.counts.psn_gaps, n) > max {
            r.evidence(
                f,
                vec![point.to_string()],
                format!(
                    "{} PSN gaps in {n} packets ({} ppm)",
                    c.counts.psn_gaps,
                    ppm(c.counts.psn_gaps, n)
                ),
            );
        }
    }
    r.summary = format!(
        "{} PSN gaps in {} data packets ({} ppm)",
        total.0,
        total.1,
        ppm(total.0, total.1)
    );
    r.done(Status::NoData, "no RDMA data flow seen")
}

/// Where the packets to each destination address end: the last node of the flow to it
/// that crossed the most hops (a flow stopped short crossed fewer).
fn terminals(flows: &[FlowReport]) -> BTreeMap<IpAddr, &str> {
    let mut best: BTreeMap<IpAddr, (u32, &str)> = BTreeMap::new();
    for f in flows {
        let Some(last) = f.path.last() else { continue };
        let hops: u32 = f.hops.iter().map(|&h| h as u32).sum::<u32>() * 1000 + f.path.len() as u32;
        let e = best.entry(f.dst_ip).or_insert((0, last.node.as_str()));
        if hops > e.0 {
            *e = (hops, last.node.as_str());
        }
    }
    best.into_iter().map(|(d, (_, n))| (d, n)).collect()
}

/// One direction's sampled packets lost, sampled packets, and its flows (with the node
/// the others reach when the flow stops short).
type Direction<'a> = (u64, u64, Vec<(&'a FlowReport, Option<&'a str>)>);

/// Loss is judged per direction (host pair): one flow's few hundred samples cannot
/// resolve a rate of parts per million. The evidence names the flows and the links. A
/// flow whose packets never get as far as the others to its destination lost them all
/// after its last point (a black hole from the start leaves no longer path to compare).
fn loss(flows: &[FlowReport], max: u64) -> CheckResult {
    let mut r = CheckResult::new(
        "loss",
        format!("at most {max} per million sampled packets lost in the fabric, per direction"),
    );
    let ends = terminals(flows);
    let mut dirs: BTreeMap<(IpAddr, IpAddr), Direction> = BTreeMap::new();
    for f in flows.iter().filter(|f| f.trajectories > 0 && !f.path.is_empty()) {
        let end = ends.get(&f.dst_ip).copied();
        let short = end.filter(|e| f.path.last().is_some_and(|l| l.node != *e));
        if f.path.len() < 2 && short.is_none() {
            continue;
        }
        r.checked += 1;
        let d = dirs.entry((f.src_ip, f.dst_ip)).or_default();
        // A lost packet's trajectory (cut short) is one of the flow's trajectories.
        d.0 += match short {
            Some(_) => f.trajectories,
            None => f.lost.iter().map(|l| l.span.packets).saturating_sum(),
        };
        d.1 += f.trajectories;
        d.2.push((f, short));
    }
    // CNPs are counted at every point they cross: their loss is exact, not sampled.
    let mut cnps: BTreeMap<(IpAddr, IpAddr), (u64, u64, Vec<&FlowReport>)> = BTreeMap::new();
    for f in flows {
        let Some(d) = &f.cnp_delivery else { continue };
        r.checked += 1;
        let e = cnps.entry((f.src_ip, f.dst_ip)).or_default();
        e.0 = d
            .lost
            .iter()
            .map(|l| l.packets)
            .saturating_sum()
            .saturating_add(e.0);
        e.1 = d.sent.saturating_add(e.1);
        e.2.push(f);
    }
    for ((src, dst), (lost, sent, fs)) in &cnps {
        if ppm(*lost, *sent) <= max {
            continue;
        }
        let dir = format!(
            "CNPs {src} -> {dst}: {lost} of {sent} ({} ppm)",
            ppm(*lost, *sent)
        );
        for f in fs {
            for l in f.cnp_delivery.iter().flat_map(|d| &d.lost) {
                r.evidence(
                    f,
                    labels(&l.between),
                    format!("{} CNPs lost here (counted at every point); {dir}", l.packets),
                );
            }
        }
    }
    let cnp_lost: u64 = cnps.values().map(|x| x.0).saturating_sum();
    let cnp_sent: u64 = cnps.values().map(|x| x.1).saturating_sum();
    let (mut all_lost, mut all) = (0, 0);
    for ((src, dst), (lost, n, fs)) in &dirs {
        all_lost += lost;
        all += n;
        if ppm(*lost, *n) <= max {
            continue;
        }
        let dir = format!("{src} -> {dst}: {lost} of {n} ({} ppm)", ppm(*lost, *n));
        for (f, short) in fs {
            if let (Some(end), Some(last)) = (short, f.path.last()) {
                r.evidence(
                    f,
                    vec![last.to_string()],
                    format!(
                        "none of its {} sampled packets seen past here (others to {dst} reach {end}); {dir}",
                        f.trajectories
                    ),
                );
                continue;
            }
            for l in &f.lost {
                // What the kernel at either end counted dropped around then.
                let kernel = if l.kernel_drops.is_empty() {
                    String::new()
                } else {
                    let moved: Vec<String> = l
                        .kernel_drops
                        .iter()
                        .filter(|d| d.packets > 0)
                        .map(|d| format!("{} {} {}", d.point, d.counter, d.packets))
                        .collect();
                    if moved.is_empty() {
                        "; no kernel drop counter moved at either end".into()
                    } else {
                        format!("; kernel: {}", moved.join(", "))
                    }
                };
                r.evidence(
                    f,
                    labels(&l.between),
                    format!(
                        "{} of its {} sampled packets lost here{kernel}; {dir}",
                        l.span.packets, f.trajectories
                    ),
                );
            }
        }
    }
    // Missing where nothing proves a loss: said, not counted.
    let unseen: u64 = flows
        .iter()
        .flat_map(|f| &f.unobserved)
        .map(|u| u.span.packets)
        .saturating_sum();
    r.summary = format!(
        "{all_lost} of {all} sampled packets lost ({} ppm); {cnp_lost} of {cnp_sent} CNPs",
        ppm(all_lost, all)
    );
    if unseen > 0 {
        r.summary.push_str(&format!(
            "; {unseen} sampled packets unobserved (not counted: the agent could not have reported them)"
        ));
    }
    r.done(Status::NoData, "no flow seen at two or more points")
}

/// Ethernet + VLAN + IPv6 + UDP + BTH + RETH + ICRC: what a RoCE MTU of payload may
/// bring along, at most.
pub const MAX_ROCE_OVERHEAD: u16 = 14 + 4 + 40 + 8 + 12 + 16 + 4;

/// How much smaller a flow's largest frame may be at a later point without it meaning
/// "the big frames do not get through": a first packet's RETH (16 B) that did not happen
/// to pass there, a VLAN tag removed (4 B).
const SIZE_SLACK: u16 = 20;

/// Ethernet header bytes in front of the IP packet a frame carries (and 4 per VLAN tag).
const ETH_HEADER: u16 = 14;

/// The MTUs a point had while the report's window ran: the one in force at its start
/// and every one declared since (a port lowered for a while is as bad as one lowered
/// for good).
fn mtus(p: &PointInfo) -> Vec<u32> {
    let mut v: Vec<u32> = p.mtu_history.iter().map(|m| m.mtu).collect();
    v.extend(p.mtu);
    v.sort_unstable();
    v.dedup();
    v
}

fn mtu(data: &[&FlowReport], roce_mtu: u16, report: &CollectorReport) -> CheckResult {
    let mut r = CheckResult::new(
        "path_mtu",
        format!(
            "data frames fit a RoCE MTU of {roce_mtu}, every port on their path can carry them, and the largest cross every point"
        ),
    );
    let points: BTreeMap<Point, &PointInfo> = report.points.iter().map(|p| (p.point(), p)).collect();
    // The largest frame of any flow each point passed: a point that carries big frames
    // for someone is no MTU black hole.
    let mut biggest: BTreeMap<&Point, u16> = BTreeMap::new();
    for f in &report.flows {
        for (p, m) in &f.max_frame {
            let b = biggest.entry(p).or_default();
            *b = (*b).max(*m);
        }
    }
    let ends = terminals(&report.flows);
    for f in data {
        let sizes: Vec<(&Point, u16)> = f
            .path
            .iter()
            .filter_map(|p| f.max_frame.get(p).map(|m| (p, *m)))
            .collect();
        let Some(&(first, sent)) = sizes.first() else {
            continue;
        };
        r.checked += 1;
        if sent > roce_mtu + MAX_ROCE_OVERHEAD {
            r.evidence(
                f,
                vec![first.to_string()],
                format!("{sent}-byte frames exceed a RoCE MTU of {roce_mtu}"),
            );
        }
        // The IP packet those frames carry.
        let tagged = f.class.iter().any(|c| c.pcp.is_some());
        let ip_len = sent.saturating_sub(ETH_HEADER + if tagged { 4 } else { 0 }) as u32;
        // Every port the flow's packets crossed or were lost on the way to, over its
        // paths in the window; and, for a flow that stops short of where the others to
        // its destination arrive, the ports it could leave its last node by.
        let mut crossed: Vec<&Point> = f.path.iter().collect();
        crossed.extend(f.path_history.iter().flat_map(|h| &h.path));
        crossed.extend(f.lost.iter().flat_map(|l| &l.between));
        if let (Some(end), Some(last)) = (ends.get(&f.dst_ip), f.path.last())
            && last.node != *end
        {
            let node = last.node.as_str();
            crossed.extend(
                points
                    .iter()
                    .filter(|(_, p)| p.node == node && p.direction == PointDirection::Egress)
                    .map(|(l, _)| l),
            );
        }
        crossed.sort();
        crossed.dedup();
        for p in crossed {
            let Some(info) = points.get(p) else {
                continue;
            };
            let Some(&low) = mtus(info).first() else { continue };
            if ip_len > low {
                let now = match info.mtu {
                    Some(m) if m != low => format!(" (now {m})"),
                    _ => String::new(),
                };
                r.evidence(
                    f,
                    vec![p.to_string()],
                    format!(
                        "{sent}-byte frames ({ip_len}-byte IP packets) cannot cross {p}: its MTU was {low}{now}"
                    ),
                );
            }
        }
        if let Some(w) = sizes
            .windows(2)
            .find(|w| w[1].1 + SIZE_SLACK < sent && w[0].1 + SIZE_SLACK >= sent)
        {
            r.evidence(
                f,
                vec![w[0].0.to_string(), w[1].0.to_string()],
                format!(
                    "{sent}-byte frames sent, none larger than {} bytes got past here",
                    w[1].1
                ),
            );
        }
        // Full-size frames lost at a point that carries smaller ones (for anyone) and no
        // frame that big: whatever else the flow sends, the big ones die there.
        for l in &f.lost {
            let (Some(lost), Some(&seen)) = (l.largest_frame, biggest.get(&l.between[1])) else {
                continue;
            };
            if lost + SIZE_SLACK >= sent && seen + SIZE_SLACK < sent {
                r.evidence(
                    f,
                    labels(&l.between),
                    format!(
                        "{} sampled {sent}-byte frames lost here; nothing larger than {seen} bytes got past {}",
                        l.span.packets, l.between[1]
                    ),
                );
            }
        }
    }
    r.done(Status::NoData, "no RDMA data flow seen")
}

/// Per host pair, the spread of bytes over its data flows: (result, worst spread).
pub fn stability(data: &[&FlowReport], max: f64, min_packets: u64) -> (CheckResult, Option<f64>) {
    let mut r = CheckResult::new(
        "throughput_spread",
        format!(
            "the data flows of one host pair within {} of their mean",
            pct(max)
        ),
    );
    let mut groups: BTreeMap<(IpAddr, IpAddr), Vec<(&FlowReport, u64)>> = BTreeMap::new();
    for f in data {
        if let Some(c) = counters_at(f, false).filter(|c| c.counts.packets >= min_packets) {
            groups
                .entry((f.src_ip, f.dst_ip))
                .or_default()
                .push((f, c.counts.bytes));
        }
    }
    let mut worst: Option<f64> = None;
    for ((s, d), g) in groups.iter().filter(|(_, g)| g.len() >= 2) {
        r.checked += g.len();
        let mean = g.iter().map(|x| x.1 as f64).sum::<f64>() / g.len() as f64;
        let lo = g.iter().min_by_key(|x| x.1).expect("non-empty");
        let hi = g.iter().max_by_key(|x| x.1).expect("non-empty");
        let spread = if mean > 0.0 {
            (hi.1 - lo.1) as f64 / mean
        } else {
            0.0
        };
        worst = Some(worst.map_or(spread, |w: f64| w.max(spread)));
        if spread > max {
            let at = vec![format!("{s} -> {d}")];
            r.evidence(
                lo.0,
                at.clone(),
                format!(
                    "{} bytes, the least of {} flows (spread {})",
                    lo.1,
                    g.len(),
                    pct(spread)
                ),
            );
            r.evidence(hi.0, at, format!("{} bytes, the most", hi.1));
        }
    }
    if let (Some(w), true) = (worst, r.evidence.is_empty()) {
        r.summary = format!("{} flow(s) checked, worst spread {}", r.checked, pct(w));
    }
    (
        r.done(Status::NoData, "no host pair with two or more data flows"),
        worst,
    )
}

/// A flow's delivered rate (bytes/s) over its complete counter intervals at its most
/// downstream point: each delta's bytes over the interval the agent counted them in, on the
/// agent's clock (when the report reached the collector does not matter). The first
/// delta's interval is partial (the flow began inside it) and so is the last one (it ended
/// inside it): neither is a rate.
pub fn delivered_rates(f: &FlowReport) -> Vec<f64> {
    let d = &f.delivery;
    if d.len() < 3 {
        return Vec::new();
    }
    d[1..d.len() - 1]
        .iter()
        .filter(|d| d.end_ns > d.start_ns)
        .map(|d| d.bytes as f64 * 1e9 / (d.end_ns - d.start_ns) as f64)
        .collect()
}

fn mbit(bytes_per_s: f64) -> String {
    format!("{:.2} Mbit/s", bytes_per_s * 8.0 / 1e6)
}

fn rate_over_time(data: &[&FlowReport], max_cv: f64, min_intervals: usize) -> CheckResult {
    let mut r = CheckResult::new(
        "rate_stability",
        format!(
            "each data flow's delivered rate varies by at most {} over time (CV)",
            pct(max_cv)
        ),
    );
    let mut worst: Option<f64> = None;
    for f in data {
        let rates = delivered_rates(f);
        if rates.len() < min_intervals.max(2) {
            continue;
        }
        r.checked += 1;
        let n = rates.len() as f64;
        let mean = rates.iter().sum::<f64>() / n;
        let var = rates.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
        let cv = if mean > 0.0 { var.sqrt() / mean } else { 0.0 };
        worst = Some(worst.map_or(cv, |w: f64| w.max(cv)));
        if cv > max_cv {
            let lo = rates.iter().cloned().fold(f64::INFINITY, f64::min);
            let hi = rates.iter().cloned().fold(0.0, f64::max);
            let at = f.path.last().map(Point::to_string).into_iter().collect();
            r.evidence(
                f,
                at,
                format!(
                    "CV {} over {} intervals: {} to {}, mean {}",
                    pct(cv),
                    rates.len(),
                    mbit(lo),
                    mbit(hi),
                    mbit(mean)
                ),
            );
        }
    }
    if let (Some(w), true) = (worst, r.evidence.is_empty()) {
        r.summary = format!("{} flow(s) checked, worst CV {}", r.checked, pct(w));
    }
    r.done(
        Status::NoData,
        &format!("no data flow with {min_intervals} complete counter intervals at its most downstream point"),
    )
}
