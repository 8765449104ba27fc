//! The typed report between correlate and judge: what the join found per flow and
//! fabric-wide (paths, classes, CE onsets, losses, delays, CNP answers), the points it
//! found it at, the agents it came from, and in-band probes' hops. The collector serves
//! and writes it; `verify` judges it.

use std::{collections::BTreeMap, fmt, net::IpAddr, str::FromStr};

use roce_trace_common::{
    datapath::{DIR_EGRESS, DIR_INGRESS, DIR_MIRROR, PCP_NONE, direction_name},
    flow::FlowId,
};
use serde::{Deserialize, Serialize};

use crate::observation::CounterDelta;

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PointInfo {
    pub node: String,
    pub iface: String,
    pub direction: Direction,
    pub clock_synced: bool,
    /// The port's MTU (IP bytes) as its agent last declared it; absent when not known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtu: Option<u32>,
    /// Every MTU the port was declared with, and when (collector time): a port whose MTU
    /// was lowered for a while could not carry big frames then.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mtu_history: Vec<MtuAt>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MtuAt {
    pub at_ns: u64,
    pub mtu: u32,
}

impl PointInfo {
    pub fn point(&self) -> Point {
        Point::new(&self.node, &self.iface, self.direction)
    }
}

/// Which way an observation point watches its interface (`mirror`: copies a switch
/// mirrored to the agent).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    #[default]
    Ingress,
    Egress,
    Mirror,
}

impl Direction {
    /// From the datapath's `DIR_*`.
    pub fn of_datapath(d: u8) -> Self {
        match d {
            DIR_INGRESS => Self::Ingress,
            DIR_MIRROR => Self::Mirror,
            _ => Self::Egress,
        }
    }

    /// The datapath's `DIR_*`.
    pub fn datapath(self) -> u8 {
        match self {
            Self::Ingress => DIR_INGRESS,
            Self::Egress => DIR_EGRESS,
            Self::Mirror => DIR_MIRROR,
        }
    }

    pub fn name(self) -> &'static str {
        direction_name(self.datapath())
    }
}

impl fmt::Display for Direction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Direction {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        match s {
            "ingress" => Ok(Self::Ingress),
            "egress" => Ok(Self::Egress),
            "mirror" => Ok(Self::Mirror),
            _ => Err(()),
        }
    }
}

/// Where something was seen: an observation point — node, interface, direction; in JSON
/// and text `node:iface:direction` — or, where none of a node's points is watched, the
/// node alone (`iface` empty, no direction). A node may be an IPv6 address (a mirroring
/// switch): the text splits from the right, interfaces and directions hold no `:`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Point {
    pub node: String,
    pub iface: String,
    pub direction: Option<Direction>,
}

impl Point {
    pub fn new(node: &str, iface: &str, direction: Direction) -> Self {
        Self {
            node: node.into(),
            iface: iface.into(),
            direction: Some(direction),
        }
    }

    /// The label's bytes as [`Display`](fmt::Display) writes them, without building
    /// the string: what points are ordered and compared to text by.
    fn label_bytes(&self) -> impl Iterator<Item = u8> + '_ {
        let tail = self.direction.map(|d| (self.iface.as_str(), d.name()));
        self.node.bytes().chain(tail.into_iter().flat_map(|(iface, d)| {
            std::iter::once(b':')
                .chain(iface.bytes())
                .chain(std::iter::once(b':'))
                .chain(d.bytes())
        }))
    }

    /// A node with no watched point.
    pub fn node(node: &str) -> Self {
        Self {
            node: node.into(),
            ..Self::default()
        }
    }
}

impl fmt::Display for Point {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.direction {
            Some(d) => write!(f, "{}:{}:{d}", self.node, self.iface),
            None => f.write_str(&self.node),
        }
    }
}

impl FromStr for Point {
    type Err = std::convert::Infallible;
    /// Never fails: text that is no `node:iface:direction` is a node.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut it = s.rsplitn(3, ':');
        if let (Some(d), Some(i), Some(n)) = (it.next(), it.next(), it.next())
            && let Ok(d) = d.parse()
        {
            return Ok(Self::new(n, i, d));
        }
        Ok(Self::node(s))
    }
}

/// In the order of their text (reports list points, and key maps by them, as before
/// points were typed).
impl Ord for Point {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.label_bytes().cmp(o.label_bytes())
    }
}

impl PartialOrd for Point {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

/// A label read as a point (every text is one: see [`FromStr`]).
impl From<&str> for Point {
    fn from(label: &str) -> Self {
        label
            .parse()
            .unwrap_or_else(|e: std::convert::Infallible| match e {})
    }
}

/// A point is its label (tests and look-ups compare them to text).
impl PartialEq<str> for Point {
    fn eq(&self, label: &str) -> bool {
        self.label_bytes().eq(label.bytes())
    }
}

impl PartialEq<&str> for Point {
    fn eq(&self, label: &&str) -> bool {
        *self == **label
    }
}

impl Serialize for Point {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Point {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Ok(s.parse().unwrap_or_else(|e: std::convert::Infallible| match e {}))
    }
}

/// The nodes a path crosses, in order, each once per visit.
pub fn path_nodes(path: &[Point]) -> Vec<&str> {
    let mut v: Vec<&str> = Vec::new();
    for p in path {
        if v.last() != Some(&p.node.as_str()) {
            v.push(&p.node);
        }
    }
    v
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct JoinStats {
    pub observations: u64,
    /// Observations of roce-trace's own probes (QP 0xFFFFFF), left out of the join.
    pub probe_observations: u64,
    pub duplicates: u64,
    pub trajectories: u64,
    pub retransmissions: u64,
    /// Trajectories that were only the tail of the flow's path (observations that came
    /// after their packet's trajectory was complete): neither a path nor a loss. (Absent
    /// from reports of older collectors: read as 0.)
    #[serde(default)]
    pub fragments: u64,
    /// Of those, the ones that showed a packet judged lost had arrived after all (the
    /// loss was taken back).
    #[serde(default)]
    pub late_arrivals: u64,
    /// Identities dropped unjoined because `max_pending` was reached.
    pub pending_dropped: u64,
    pub flows_expired: u64,
    /// Flows forgotten to make room for new ones when `max_flows` were tracked: the
    /// longest-idle first. (Absent from reports of older collectors: read as 0.)
    #[serde(default)]
    pub flows_evicted: u64,
    /// Trajectories judged without a node of their flow's path whose agent never
    /// reported as far as the packet's time: the wait for it (`max_agent_lag`) ran out,
    /// or the collector stopped first. (Absent from older reports: read as 0.)
    #[serde(default)]
    pub agent_lag_gave_up: u64,
    pub pending: u64,
    pub flows: u64,
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Span {
    pub first_ns: u64,
    pub last_ns: u64,
    pub packets: u64,
}

impl Span {
    pub(crate) fn hit(&mut self, t: u64) {
        if self.packets == 0 || t < self.first_ns {
            self.first_ns = t;
        }
        self.last_ns = self.last_ns.max(t);
        self.packets += 1;
    }
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Delay {
    pub min_ns: i64,
    pub max_ns: i64,
    pub sum_ns: i64,
    pub n: u64,
}

impl Delay {
    pub(crate) fn add(&mut self, d: i64) {
        if self.n == 0 {
            self.min_ns = d;
            self.max_ns = d;
        }
        self.min_ns = self.min_ns.min(d);
        self.max_ns = self.max_ns.max(d);
        self.sum_ns += d;
        self.n += 1;
    }
}

/// Why a sampled packet that went missing between two points is not counted as lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Unseen {
    /// The agent of the next point sent no health for that time (an older agent, a
    /// disconnection, or its report is late): nothing proves it would have seen it.
    NoReport,
    /// The agent of the next point lost samples then (ring buffer or queue full).
    SamplesLost,
}

impl Unseen {
    pub fn reason(self) -> &'static str {
        match self {
            Unseen::NoReport => "no health report from that point's agent for that time",
            Unseen::SamplesLost => "that point's agent lost samples then (ring buffer or queue full)",
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ClassAt {
    pub point: Point,
    pub dscp: u8,
    pub ecn: u8,
    pub pcp: Option<u8>,
}

impl ClassAt {
    /// From the join's (DSCP, ECN, PCP or `PCP_NONE`).
    pub(crate) fn new(point: Point, (dscp, ecn, pcp): (u8, u8, u8)) -> Self {
        Self {
            point,
            dscp,
            ecn,
            pcp: (pcp != PCP_NONE).then_some(pcp),
        }
    }
}

/// One class at one point over a stretch of the window.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ClassSeen {
    pub point: Point,
    /// CNPs (their class is judged apart from the flow's other packets).
    pub cnp: bool,
    pub dscp: u8,
    pub pcp: Option<u8>,
    #[serde(flatten)]
    pub span: Span,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ClassChange {
    pub between: [Point; 2],
    pub from_dscp: u8,
    pub to_dscp: u8,
    #[serde(flatten)]
    pub span: Span,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct CeOnset {
    /// The last point that saw the packet unmarked (null: marked before the first point).
    pub after: Option<Point>,
    pub at: Point,
    #[serde(flatten)]
    pub span: Span,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Lost {
    pub between: [Point; 2],
    #[serde(flatten)]
    pub span: Span,
    /// The largest frame (bytes) among the packets lost there.
    #[serde(default)]
    pub largest_frame: Option<u16>,
    /// The kernel's drop counters at the two ends around that time (what moved, or zero;
    /// absent when an end is not a local interface of a reporting agent).
    #[serde(default)]
    pub kernel_drops: Vec<KernelDrop>,
}

/// A kernel drop counter at one point over a span of time.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct KernelDrop {
    pub point: Point,
    /// `tx_dropped`, `qdisc_dropped` (sending end) or `rx_dropped` (receiving end).
    pub counter: String,
    pub packets: u64,
}

/// One point's health over the intervals the collector keeps (five minutes).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct HealthSummary {
    pub point: Point,
    pub intervals: u64,
    pub from_ns: u64,
    pub to_ns: u64,
    /// Places where one interval does not start where the one before ended (the agent
    /// was away): losses there are unobserved.
    pub gaps: u64,
    pub samples_lost: u64,
    pub rx_dropped: u64,
    pub tx_dropped: u64,
    pub qdisc_dropped: u64,
}

/// Sampled packets missing between two points whose absence proves no loss: the
/// second point's agent could not have reported them.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Unobserved {
    pub between: [Point; 2],
    pub why: Unseen,
    pub reason: String,
    #[serde(flatten)]
    pub span: Span,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct DelayReport {
    pub between: [Point; 2],
    #[serde(flatten)]
    pub delay: Delay,
}

/// Bytes one counter delta reported at a flow's last point, over the interval the agent
/// counted them in (Unix ns on that agent's clock: the reading before and the reading that
/// found them; a pcap agent's are capture times).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct DeliveryAt {
    pub start_ns: u64,
    pub end_ns: u64,
    pub bytes: u64,
    /// Packets in those bytes, and how many of them arrived CE-marked.
    #[serde(default)]
    pub packets: u64,
    #[serde(default)]
    pub ce: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct PathAt {
    pub since_ns: u64,
    pub path: Vec<Point>,
}

/// Packets that vanished between two points, by exact counts (not samples).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct CountedLoss {
    pub between: [Point; 2],
    pub packets: u64,
}

/// Where one flow's CNPs went, by exact per-point counts.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct CnpDelivery {
    /// CNPs counted at the first point that saw them (the notifying host's side).
    pub sent: u64,
    pub sent_at: Point,
    /// CNPs counted arriving at the host of the sender they throttle; null when that
    /// host is not watched.
    pub reached: Option<u64>,
    pub reached_at: Option<Point>,
    /// Where the others vanished. Counts a point had three seconds ago (all of them
    /// once the collector has stopped) against what the next point has counted, so
    /// CNPs in flight are not lost.
    pub lost: Vec<CountedLoss>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Answers {
    /// Reverse flows carrying this flow's CNPs.
    pub flows: Vec<String>,
    /// CNPs those flows carried as they left the notifying host.
    #[serde(default)]
    pub cnps_sent: u64,
    /// CNPs that reached this flow's sender (its host's ingress; where its host is not
    /// watched, the most downstream point that counted them).
    pub cnps: u64,
    /// Where the others vanished.
    #[serde(default)]
    pub cnps_lost: Vec<CountedLoss>,
    pub ce_marks: u64,
    pub cnps_per_ce_mark: Option<f64>,
    pub ce_to_cnp: Option<Delay>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct FlowReport {
    pub id: String,
    pub src_ip: IpAddr,
    pub dst_ip: IpAddr,
    pub udp_sport: u16,
    pub dest_qp: u32,
    /// Observation points in order, and hops (TTL decrements) between neighbours.
    pub path: Vec<Point>,
    pub hops: Vec<u8>,
    pub class: Vec<ClassAt>,
    /// Class of this flow's CNPs at each point that saw them.
    #[serde(default)]
    pub cnp_class: Vec<ClassAt>,
    /// A flow that carries CNPs: how many left, how many reached the sender they
    /// throttle, and where the rest vanished (exact counts).
    #[serde(default)]
    pub cnp_delivery: Option<CnpDelivery>,
    /// Largest frame (bytes) seen at each point.
    #[serde(default)]
    pub max_frame: BTreeMap<Point, u16>,
    /// Every class each point saw over the window (CNPs apart), with when and how many
    /// packets: what checks of class judge.
    #[serde(default)]
    pub class_seen: Vec<ClassSeen>,
    /// Bytes delivered at its most downstream point, per counter interval (the last 64).
    #[serde(default)]
    pub delivery: Vec<DeliveryAt>,
    pub class_changes: Vec<ClassChange>,
    pub ce_onset: Vec<CeOnset>,
    pub lost: Vec<Lost>,
    /// Sampled packets missing where nothing proves they were lost.
    #[serde(default)]
    pub unobserved: Vec<Unobserved>,
    pub delays: Vec<DelayReport>,
    pub path_history: Vec<PathAt>,
    pub counters: BTreeMap<Point, CounterDelta>,
    pub trajectories: u64,
    pub answered_by: Answers,
    /// Hops found by in-band probes from the flow's source (`collect --trace`).
    pub probe: Option<ProbeResult>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Anomaly {
    pub kind: AnomalyKind,
    pub flow: String,
    pub between: Vec<Point>,
    pub detail: String,
    pub packets: u64,
}

/// What is wrong with a flow, fabric-wide (`/anomalies`, the collector's metrics).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
/// (Declared in the order of their names: metrics list them so.)
pub enum AnomalyKind {
    /// CE marks begin at a point.
    CeOnset,
    /// Its DSCP changed between two points.
    ClassChange,
    /// Sampled packets seen at one point never reached the next.
    Lost,
    /// It took more than one path over the window.
    PathChange,
    /// It crosses a port whose NIC paused (PFC) over the intervals kept.
    PfcPause,
}

impl AnomalyKind {
    pub fn name(self) -> &'static str {
        match self {
            Self::ClassChange => "class_change",
            Self::Lost => "lost",
            Self::CeOnset => "ce_onset",
            Self::PathChange => "path_change",
            Self::PfcPause => "pfc_pause",
        }
    }
}

impl fmt::Display for AnomalyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The collector's report: everything it joined (`collect --report`, `/report`), what
/// `verify` judges.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CollectorReport {
    #[serde(rename = "type")]
    pub kind: String,
    pub stats: JoinStats,
    pub refused_connections: u64,
    pub agents: Vec<AgentInfo>,
    pub points: Vec<PointInfo>,
    /// Each point's health as its agent reported it (what proves a loss).
    #[serde(default)]
    pub health: Vec<HealthSummary>,
    pub flows: Vec<FlowReport>,
    pub anomalies: Vec<Anomaly>,
    /// Each port's NIC and PFC counters as its agent reported them.
    #[serde(default)]
    pub nic: Vec<crate::nic::NicPortReport>,
}

impl JoinStats {
    /// Adds another collector's figures: a group of collectors joins disjoint flows, so
    /// the group's figures are the sums.
    pub fn merge(&mut self, o: &Self) {
        self.observations += o.observations;
        self.probe_observations += o.probe_observations;
        self.duplicates += o.duplicates;
        self.trajectories += o.trajectories;
        self.retransmissions += o.retransmissions;
        self.fragments += o.fragments;
        self.late_arrivals += o.late_arrivals;
        self.pending_dropped += o.pending_dropped;
        self.flows_expired += o.flows_expired;
        self.flows_evicted += o.flows_evicted;
        self.agent_lag_gave_up += o.agent_lag_gave_up;
        self.pending += o.pending;
        self.flows += o.flows;
    }
}

impl CollectorReport {
    /// A report of nothing: no agent, point or flow.
    pub fn empty() -> Self {
        Self {
            kind: "collector_report".into(),
            stats: JoinStats::default(),
            refused_connections: 0,
            agents: Vec::new(),
            points: Vec::new(),
            health: Vec::new(),
            flows: Vec::new(),
            anomalies: Vec::new(),
            nic: Vec::new(),
        }
    }

    /// One report of a group of collectors, each joining its own share of the flows
    /// (partitioned by address pair): flows by label, each once (the first report's
    /// when two hold one, as during a hand-over); agents by node, their counts summed
    /// (each collector counts what it received of them); points and health by point.
    pub fn merge(reports: Vec<CollectorReport>) -> CollectorReport {
        let mut it = reports.into_iter();
        let mut out = it.next().unwrap_or_else(CollectorReport::empty);
        for r in it {
            out.stats.merge(&r.stats);
            out.refused_connections += r.refused_connections;
            out.agents = merge_agents(std::mem::take(&mut out.agents), r.agents);
            for p in r.points {
                if !out.points.iter().any(|q| q.point() == p.point()) {
                    out.points.push(p);
                }
            }
            for h in r.health {
                if !out.health.iter().any(|g| g.point == h.point) {
                    out.health.push(h);
                }
            }
            // Every collector of a group hears every node's NIC counters: each port once.
            for n in r.nic {
                if !out.nic.iter().any(|m| m.node == n.node && m.iface == n.iface) {
                    out.nic.push(n);
                }
            }
            out.flows.extend(r.flows);
            out.anomalies.extend(r.anomalies);
        }
        out.flows = merge_flows(std::mem::take(&mut out.flows));
        let kept: std::collections::HashSet<&str> = out.flows.iter().map(|f| f.id.as_str()).collect();
        let mut seen = std::collections::HashSet::new();
        let anomalies = std::mem::take(&mut out.anomalies);
        out.anomalies = anomalies
            .into_iter()
            .filter(|a| {
                kept.contains(a.flow.as_str()) && seen.insert((a.flow.clone(), a.kind, a.between.clone()))
            })
            .collect();
        out.anomalies
            .sort_by(|a, b| a.flow.cmp(&b.flow).then(a.kind.cmp(&b.kind)));
        out.health.sort_by(|a, b| a.point.cmp(&b.point));
        out.nic
            .sort_by(|a, b| (&a.node, &a.iface).cmp(&(&b.node, &b.iface)));
        out
    }
}

/// Flows of several collectors, each label once (the first seen wins), in label order.
pub fn merge_flows(flows: Vec<FlowReport>) -> Vec<FlowReport> {
    let mut seen = std::collections::HashSet::new();
    let mut v: Vec<FlowReport> = flows.into_iter().filter(|f| seen.insert(f.id.clone())).collect();
    v.sort_by(|a, b| a.id.cmp(&b.id));
    v
}

/// Agents as several collectors know them: one per node, counts summed.
pub fn merge_agents(mut a: Vec<AgentInfo>, b: Vec<AgentInfo>) -> Vec<AgentInfo> {
    for x in b {
        match a.iter_mut().find(|y| y.node == x.node) {
            Some(y) => {
                y.connected |= x.connected;
                y.connections += x.connections;
                y.observations += x.observations;
                y.counter_deltas += x.counter_deltas;
                y.dropped_observations = y.dropped_observations.max(x.dropped_observations);
                y.dropped_counters = y.dropped_counters.max(x.dropped_counters);
            }
            None => a.push(x),
        }
    }
    a.sort_by(|x, y| x.node.cmp(&y.node));
    a
}

/// What the collector knows of one agent.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct AgentInfo {
    pub node: String,
    pub peer: String,
    pub connected: bool,
    pub connections: u64,
    pub clock_synced: bool,
    pub observations: u64,
    pub counter_deltas: u64,
    /// What the agent reported it had to drop (its queue was full while we were away).
    pub dropped_observations: u64,
    pub dropped_counters: u64,
    pub last_disconnect: Option<String>,
}

/// What in-band probes found along one flow, as carried back to the collector.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeResult {
    #[serde(skip)]
    pub id: u32,
    #[serde(skip)]
    pub flow: FlowId,
    pub reached: bool,
    /// First hop (TTL) whose quoted class differs from the flow's.
    pub class_changed_at: Option<u8>,
    pub hops: Vec<ProbeHop>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeHop {
    pub ttl: u8,
    pub addr: Option<IpAddr>,
    pub dscp: Option<u8>,
    pub ecn: Option<u8>,
    pub rtt_avg_us: Option<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A direction keeps its datapath value and its name both ways.
    #[test]
    fn directions_round_trip_through_the_datapath_value_and_the_name() {
        for d in [Direction::Ingress, Direction::Egress, Direction::Mirror] {
            assert_eq!(Direction::of_datapath(d.datapath()), d);
            assert_eq!(d.name().parse(), Ok(d));
        }
        assert_eq!(
            [DIR_INGRESS, DIR_EGRESS, DIR_MIRROR].map(direction_name),
            ["ingress", "egress", "mirror"]
        );
    }
}
