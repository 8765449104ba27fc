//! The fabric as the trajectories show it: nodes in tiers, the links between them, and
//! what was located on each. Nothing about the lab is assumed: tiers come from where
//! nodes stand in the paths the flows took, links from consecutive points of those paths.

use std::collections::{BTreeMap, BTreeSet};

use roce_trace_correlate::report::{Anomaly, AnomalyKind, CollectorReport, FlowReport, Point, PointInfo};
use roce_trace_verify::{
    checks::{Load, Status, judge},
    policy::{MtuPolicy, Policy, RoceMtu},
};

/// What was located at a node or on a link, most severe first (the order colours pick
/// the worst by).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Mark {
    /// A rule of `verify` failed here (the HTML report).
    CheckFailed,
    /// Sampled packets seen before this place never came out of it.
    Lost,
    /// A frame larger than the next point's MTU was sent into it.
    PathMtu,
    /// The DSCP changed here.
    ClassChange,
    /// A port here paused (PFC).
    PfcPause,
    /// CE marking began here.
    CeOnset,
}

impl Mark {
    pub const ALL: [Mark; 6] = [
        Mark::CheckFailed,
        Mark::Lost,
        Mark::PathMtu,
        Mark::ClassChange,
        Mark::PfcPause,
        Mark::CeOnset,
    ];

    /// As in JSON, CSS classes and data attributes.
    pub fn name(self) -> &'static str {
        match self {
            Mark::CheckFailed => "check_failed",
            Mark::Lost => "lost",
            Mark::PathMtu => "path_mtu",
            Mark::ClassChange => "class_change",
            Mark::PfcPause => "pfc_pause",
            Mark::CeOnset => "ce_onset",
        }
    }

    /// In words, for legends and tooltips.
    pub fn words(self) -> &'static str {
        match self {
            Mark::CheckFailed => "a verify rule failed",
            Mark::Lost => "packets lost",
            Mark::PathMtu => "frame over the path MTU",
            Mark::ClassChange => "class (DSCP) changed",
            Mark::PfcPause => "PFC pause",
            Mark::CeOnset => "CE marking begins",
        }
    }

    /// The colour a node or link takes when this is its worst mark.
    pub fn colour(self) -> &'static str {
        match self {
            Mark::CheckFailed => "#b00020",
            Mark::Lost => "#d32f2f",
            Mark::PathMtu => "#8e24aa",
            Mark::ClassChange => "#c2185b",
            Mark::PfcPause => "#ef6c00",
            Mark::CeOnset => "#f9a825",
        }
    }

    /// An anomaly's mark (a path change is the flow's, not a place's).
    pub fn of_anomaly(k: AnomalyKind) -> Option<Mark> {
        match k {
            AnomalyKind::CeOnset => Some(Mark::CeOnset),
            AnomalyKind::ClassChange => Some(Mark::ClassChange),
            AnomalyKind::Lost => Some(Mark::Lost),
            AnomalyKind::PfcPause => Some(Mark::PfcPause),
            AnomalyKind::PathChange => None,
        }
    }
}

/// The marks at one place: for each, the flows it was located on.
pub type Marks = BTreeMap<Mark, BTreeSet<String>>;

/// The worst of `m`, if any.
pub fn worst(m: &Marks) -> Option<Mark> {
    m.keys().next().copied()
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Node {
    pub name: String,
    /// Distance from the nearest end of the paths it stands on (0: hosts, 1: leaves, 2:
    /// spines in a leaf-spine fabric); `None`: on no path yet.
    pub tier: Option<usize>,
    /// Its observation points as `iface:direction`.
    pub points: BTreeSet<String>,
    /// Flows whose path crosses it.
    pub flows: BTreeSet<String>,
    /// Marks located inside it (between two of its own points, or at the node itself).
    pub marks: Marks,
}

/// The link between two nodes, both ways; `a` < `b` by name.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Link {
    pub a: String,
    pub b: String,
    /// The interfaces facing each other, as seen: `a`'s and `b`'s.
    pub a_ifaces: BTreeSet<String>,
    pub b_ifaces: BTreeSet<String>,
    pub flows: BTreeSet<String>,
    /// Bytes the flows crossing it delivered (their delivery log), for the link's width.
    pub bytes: u64,
    pub marks: Marks,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Fabric {
    /// By name.
    pub nodes: BTreeMap<String, Node>,
    /// By (a, b).
    pub links: BTreeMap<(String, String), Link>,
}

/// Where something was located: inside a node, or on the link between two.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Place {
    Node(String),
    Link(String, String),
}

impl Place {
    pub fn link(x: &str, y: &str) -> Place {
        if x <= y {
            Place::Link(x.into(), y.into())
        } else {
            Place::Link(y.into(), x.into())
        }
    }

    /// The place a list of points names: one point or one node is a node; two or more
    /// points on one node are that node; otherwise the first pair on different nodes.
    pub fn of_points(at: &[Point]) -> Option<Place> {
        let first = at.first()?;
        match at.iter().find(|p| p.node != first.node) {
            None => Some(Place::Node(first.node.clone())),
            Some(other) => {
                // The pair that crosses from one node to the next.
                let (x, y) = at
                    .windows(2)
                    .find(|w| w[0].node != w[1].node)
                    .map_or((first, other), |w| (&w[0], &w[1]));
                Some(Place::link(&x.node, &y.node))
            }
        }
    }
}

/// A flow's path as nodes, consecutive duplicates merged.
pub fn node_path(path: &[Point]) -> Vec<&str> {
    let mut v: Vec<&str> = Vec::with_capacity(path.len());
    for p in path {
        if v.last() != Some(&p.node.as_str()) {
            v.push(&p.node);
        }
    }
    v
}

impl Fabric {
    /// The fabric of a collector report: every observation point's node, the links the
    /// paths cross, and what was located on them — the join's anomalies and the judge's
    /// path-MTU failures.
    pub fn of(r: &CollectorReport) -> Fabric {
        let mut f = Fabric::new(&r.points);
        for flow in &r.flows {
            f.add_flow(flow);
        }
        f.add_anomalies(&r.anomalies);
        f.add_path_mtu(r);
        f
    }

    /// No flow yet: a node for every observation point's node.
    pub fn new(points: &[PointInfo]) -> Fabric {
        let mut f = Fabric::default();
        for p in points {
            f.node(&p.node)
                .points
                .insert(format!("{}:{}", p.iface, p.direction));
        }
        f
    }

    /// One flow: its nodes (and their tiers), the links it crosses, and the class
    /// changes, losses and CE onsets located on its path. Flows can be added one at a
    /// time (a large table a chunk at a time); links a flow crosses that no earlier flow
    /// did appear with it.
    pub fn add_flow(&mut self, flow: &FlowReport) {
        self.add_path(flow);
        self.place_tiers(std::iter::once(node_path(&flow.path)));
        for c in &flow.class_changes {
            if let Some(p) = self.place_of(&c.between) {
                self.mark(&p, Mark::ClassChange, &flow.id);
            }
        }
        for l in &flow.lost {
            if let Some(p) = self.place_of(&l.between) {
                self.mark(&p, Mark::Lost, &flow.id);
            }
        }
        for c in &flow.ce_onset {
            let at: Vec<Point> = c.after.iter().chain(std::iter::once(&c.at)).cloned().collect();
            if let Some(p) = self.place_of(&at) {
                self.mark(&p, Mark::CeOnset, &flow.id);
            }
        }
    }

    /// The join's anomalies (what a flow's own report does not say: PFC pauses on its
    /// ports).
    pub fn add_anomalies(&mut self, anomalies: &[Anomaly]) {
        for a in anomalies {
            if let Some(m) = Mark::of_anomaly(a.kind)
                && let Some(place) = self.place_of(&a.between)
            {
                self.mark(&place, m, &a.flow);
            }
        }
    }

    /// Path-MTU failures as the judge finds them (at RoCE MTU 4096, the largest: only
    /// what no fabric could carry, or what a port's own MTU stops). It needs the whole
    /// report: the largest frame any flow took through each point.
    pub fn add_path_mtu(&mut self, r: &CollectorReport) {
        let policy = Policy {
            mtu: Some(MtuPolicy {
                roce_mtu: RoceMtu(4096),
            }),
            ..Policy::default()
        };
        for c in judge(&policy, r, Load::Idle) {
            if c.status != Status::Fail {
                continue;
            }
            for e in &c.evidence {
                let at: Vec<Point> = e.at.iter().map(|s| s.parse().expect("infallible")).collect();
                if let Some(place) = self.place_of(&at) {
                    self.mark(&place, Mark::PathMtu, &e.flow);
                }
            }
        }
    }

    /// Where a list of points is: as [`Place::of_points`], except that one port alone is
    /// the link it faces when a path crossed that link through it.
    pub fn place_of(&self, at: &[Point]) -> Option<Place> {
        if let [p] = at
            && !p.iface.is_empty()
            && let Some(l) = self.links.values().find(|l| {
                (l.a == p.node && l.a_ifaces.contains(&p.iface))
                    || (l.b == p.node && l.b_ifaces.contains(&p.iface))
            })
        {
            return Some(Place::Link(l.a.clone(), l.b.clone()));
        }
        Place::of_points(at)
    }

    fn node(&mut self, name: &str) -> &mut Node {
        self.nodes.entry(name.to_string()).or_insert_with(|| Node {
            name: name.to_string(),
            ..Node::default()
        })
    }

    fn add_path(&mut self, flow: &FlowReport) {
        let bytes: u64 = flow.delivery.iter().map(|d| d.bytes).sum();
        for p in &flow.path {
            let n = self.node(&p.node);
            n.flows.insert(flow.id.clone());
            if let Some(d) = p.direction {
                n.points.insert(format!("{}:{d}", p.iface));
            }
        }
        for w in flow.path.windows(2) {
            let (x, y) = (&w[0], &w[1]);
            if x.node != y.node {
                let l = self.link(&x.node, &y.node);
                l.flows.insert(flow.id.clone());
                l.bytes += bytes;
                let (xi, yi) = if x.node <= y.node {
                    (&mut l.a_ifaces, &mut l.b_ifaces)
                } else {
                    (&mut l.b_ifaces, &mut l.a_ifaces)
                };
                if !x.iface.is_empty() {
                    xi.insert(x.iface.clone());
                }
                if !y.iface.is_empty() {
                    yi.insert(y.iface.clone());
                }
            }
        }
    }

    fn link(&mut self, x: &str, y: &str) -> &mut Link {
        let (a, b) = if x <= y { (x, y) } else { (y, x) };
        self.links
            .entry((a.to_string(), b.to_string()))
            .or_insert_with(|| Link {
                a: a.to_string(),
                b: b.to_string(),
                ..Link::default()
            })
    }

    /// Records `m` at `place` for `flow` (a link no path crossed is drawn all the same).
    pub fn mark(&mut self, place: &Place, m: Mark, flow: &str) {
        let marks = match place {
            Place::Node(n) => &mut self.node(n).marks,
            Place::Link(a, b) => {
                self.node(a);
                self.node(b);
                &mut self.link(a, b).marks
            }
        };
        let flows = marks.entry(m).or_default();
        if !flow.is_empty() {
            flows.insert(flow.to_string());
        }
    }

    /// Tiers from hop order: a node's tier is its distance from the nearer end of each
    /// path it stands on, the greatest over all paths — a path seen only in part (its
    /// hosts unwatched, a switch's mirror) starts mid-fabric and must not pull the
    /// switches it starts at down to the hosts' tier.
    fn place_tiers<'a>(&mut self, paths: impl Iterator<Item = Vec<&'a str>>) {
        for p in paths {
            let k = p.len().saturating_sub(1);
            for (i, n) in p.iter().enumerate() {
                let d = i.min(k - i);
                let node = self.node(n);
                node.tier = Some(node.tier.map_or(d, |t| t.max(d)));
            }
        }
    }

    /// The nodes of each tier, lowest tier first, each in natural order (`h2` before
    /// `h10`); nodes on no path last.
    pub fn tiers(&self) -> Vec<(Option<usize>, Vec<&Node>)> {
        let mut by: BTreeMap<(bool, usize), Vec<&Node>> = BTreeMap::new();
        for n in self.nodes.values() {
            by.entry((n.tier.is_none(), n.tier.unwrap_or(0)))
                .or_default()
                .push(n);
        }
        by.into_iter()
            .map(|((unplaced, t), mut v)| {
                v.sort_by(|x, y| natural(&x.name, &y.name));
                ((!unplaced).then_some(t), v)
            })
            .collect()
    }
}

/// Names compared with their digit runs as numbers: `h2` < `h10`.
pub fn natural(a: &str, b: &str) -> std::cmp::Ordering {
    fn split(s: &str) -> Vec<(bool, &str)> {
        let mut v = Vec::new();
        let mut start = 0;
        let b = s.as_bytes();
        for i in 1..=b.len() {
            if i == b.len() || b[i].is_ascii_digit() != b[start].is_ascii_digit() {
                v.push((b[start].is_ascii_digit(), &s[start..i]));
                start = i;
            }
        }
        v
    }
    let (x, y) = (split(a), split(b));
    for (p, q) in x.iter().zip(&y) {
        let o = match (p, q) {
            ((true, p), (true, q)) => {
                let (p, q) = (p.trim_start_matches('0'), q.trim_start_matches('0'));
                p.len().cmp(&q.len()).then_with(|| p.cmp(q))
            }
            ((_, p), (_, q)) => p.cmp(q),
        };
        if o.is_ne() {
            return o;
        }
    }
    x.len().cmp(&y.len()).then_with(|| a.cmp(b))
}
