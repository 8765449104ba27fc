//! What the collector shows, built from a snapshot of the join: each flow's report (its
//! path, class, losses, and the CNPs and ACKs of the reverse flows that answered it),
//! the fabric's anomalies and each point's health. A view holds its flows by reference
//! count: taking one costs the join a copy of a pointer per flow, and the join goes on
//! (copy on write) while reports are built from the view on another thread.

use roce_trace_common::sat::SaturatingSum as _;
use std::{
    collections::{HashMap, VecDeque},
    sync::Arc,
};

use roce_trace_common::datapath::PCP_NONE;
use roce_trace_common::flow::FlowId;

use crate::{
    join::{FlowJoin, JoinConfig, PointId, Topology},
    observation::{CounterDelta, PointHealth},
    report::*,
    small::{PointTotals, VecMap},
};

/// A consistent picture of the join at one instant (see the module's doc).
pub struct JoinView {
    pub(crate) cfg: JoinConfig,
    pub(crate) now_ns: u64,
    pub(crate) flushed: bool,
    pub(crate) topo: Arc<Topology>,
    pub(crate) health: HashMap<PointId, Arc<VecDeque<PointHealth>>>,
    pub(crate) host_of: Arc<HashMap<[u8; 16], (u32, u8)>>,
    /// Sorted by id, so the flows of one address pair (one direction) are contiguous.
    pub(crate) flows: Vec<(FlowId, Arc<FlowJoin>)>,
    pub stats: JoinStats,
}

/// A view before its flows are put in order: what [`crate::Joiner::snapshot`] takes while
/// the join waits (a pointer per flow); [`Snapshot::view`] sorts them without it.
pub struct Snapshot(pub(crate) JoinView);

impl Snapshot {
    pub fn view(mut self) -> JoinView {
        self.0.flows.sort_unstable_by_key(|a| a.0);
        self.0
    }
}

impl JoinView {
    /// Flows in the view, in label order.
    pub fn flow_ids(&self) -> impl ExactSizeIterator<Item = &FlowId> {
        self.flows.iter().map(|(id, _)| id)
    }

    pub fn len(&self) -> usize {
        self.flows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.flows.is_empty()
    }

    /// Every flow's report, in label order, built as the iterator is read.
    pub fn flow_reports(&self) -> impl Iterator<Item = FlowReport> + '_ {
        self.flows.iter().filter_map(|(id, _)| self.flow_report(id))
    }

    pub(crate) fn get(&self, id: &FlowId) -> Option<&FlowJoin> {
        self.flows
            .binary_search_by(|(k, _)| k.cmp(id))
            .ok()
            .map(|i| &*self.flows[i].1)
    }

    /// The flows from `src` to `dst`, found by bisection: a report needs those of its
    /// own pair and of the reverse one, never a scan of every flow.
    pub(crate) fn pair<'a>(
        &'a self,
        src: &'a [u8; 16],
        dst: &'a [u8; 16],
    ) -> impl Iterator<Item = (&'a FlowId, &'a FlowJoin)> + 'a {
        let lo = self.flows.partition_point(|(k, _)| (&k.src, &k.dst) < (src, dst));
        self.flows[lo..]
            .iter()
            .take_while(move |(k, _)| k.src == *src && k.dst == *dst)
            .map(|(k, f)| (k, &**f))
    }

    pub(crate) fn label(&self, p: PointId) -> Point {
        self.topo.label(p)
    }

    /// Each reporting point's health over the intervals kept: what was covered, where
    /// reports were missing, what was lost on the way and what the kernel dropped.
    pub fn health_summary(&self) -> Vec<HealthSummary> {
        let mut v: Vec<HealthSummary> = self
            .health
            .iter()
            .filter(|(_, h)| !h.is_empty())
            .map(|(&p, h)| {
                let mut hs: Vec<&PointHealth> = h.iter().collect();
                hs.sort_by_key(|x| x.start_ns);
                let gaps = hs.windows(2).filter(|w| w[1].start_ns > w[0].end_ns).count() as u64;
                HealthSummary {
                    point: self.label(p),
                    intervals: hs.len() as u64,
                    from_ns: hs[0].start_ns,
                    to_ns: hs.iter().map(|x| x.end_ns).max().unwrap_or(0),
                    gaps,
                    samples_lost: hs.iter().map(|x| x.samples_lost()).saturating_sum(),
                    rx_dropped: hs.iter().map(|x| x.if_rx_dropped).saturating_sum(),
                    tx_dropped: hs.iter().map(|x| x.if_tx_dropped).saturating_sum(),
                    qdisc_dropped: hs.iter().map(|x| x.qdisc_dropped).saturating_sum(),
                }
            })
            .collect();
        v.sort_by(|a, b| a.point.cmp(&b.point));
        v
    }

    pub fn points(&self) -> &[PointInfo] {
        &self.topo.points
    }

    /// The kernel's drop counters at the two ends of a link over a span of time: what
    /// `a` dropped sending (interface and qdisc) and `b` dropped receiving.
    fn kernel_drops(&self, a: PointId, b: PointId, span: &Span) -> Vec<KernelDrop> {
        let (lo, hi) = (
            span.first_ns.saturating_sub(1_000_000_000),
            span.last_ns.saturating_add(1_000_000_000),
        );
        let sum = |p: PointId, f: fn(&PointHealth) -> u64| -> Option<u64> {
            let h = self.health.get(&p)?;
            let over: Vec<&PointHealth> = h.iter().filter(|x| x.end_ns >= lo && x.start_ns <= hi).collect();
            (!over.is_empty()).then(|| over.iter().map(|x| f(x)).saturating_sum())
        };
        let mut v = Vec::new();
        type Counter = (PointId, &'static str, fn(&PointHealth) -> u64);
        let counters: [Counter; 3] = [
            (a, "tx_dropped", |x| x.if_tx_dropped),
            (a, "qdisc_dropped", |x| x.qdisc_dropped),
            (b, "rx_dropped", |x| x.if_rx_dropped),
        ];
        for (p, counter, f) in counters {
            let egress = self
                .topo
                .points
                .get(p as usize)
                .is_some_and(|i| i.direction == Direction::Egress);
            // A sender's counters mean something at an egress point, a receiver's at an
            // ingress point.
            if (counter == "rx_dropped") == egress {
                continue;
            }
            if let Some(n) = sum(p, f) {
                v.push(KernelDrop {
                    point: self.label(p),
                    counter: counter.into(),
                    packets: n,
                });
            }
        }
        v
    }

    /// A flow's points in path order from its exact counters alone: higher TTL first, and
    /// at equal TTL a link's egress before the far end's ingress (routers decrement
    /// between their own ingress and egress).
    fn counter_path(&self, totals: &VecMap<PointId, PointTotals>) -> Vec<PointId> {
        let mut v: Vec<(PointId, u8, bool)> = totals
            .iter()
            .filter(|(_, c)| c.counts.packets > 0)
            .map(|(p, c)| {
                let ingress = self
                    .topo
                    .points
                    .get(*p as usize)
                    .is_some_and(|i| i.direction != Direction::Egress);
                (*p, c.last_ttl, ingress)
            })
            .collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.2.cmp(&b.2)));
        v.into_iter().map(|x| x.0).collect()
    }

    /// CNPs `point` had counted [`JoinConfig::counter_settle_ns`] ago (all of them once
    /// the agents are gone): what every later point has reported by now.
    fn cnps_settled(&self, f: &FlowJoin, point: PointId) -> u64 {
        let Some(h) = f.marks().cnp_counts.get(&point) else {
            return 0;
        };
        if self.flushed {
            return h.back().map_or(0, |x| x.1);
        }
        h.iter()
            .rev()
            .find(|(at, _)| at.saturating_add(self.cfg.counter_settle_ns) <= self.now_ns)
            .map_or(0, |x| x.1)
    }

    /// Where a flow's CNPs went, from exact counts at every point they cross (each CNP is
    /// counted at each point): how many left, how many reached the host of the sender
    /// they throttle, and between which points the rest vanished. `None` for a flow
    /// without CNPs.
    fn cnp_delivery(&self, id: &FlowId, f: &FlowJoin) -> Option<CnpDelivery> {
        let totals = f.totals();
        if !totals.values().any(|c| c.counts.cnp > 0) {
            return None;
        }
        let path = self.counter_path(&totals);
        let cnps = |p: &PointId| totals.get(p).map_or(0, |c| c.counts.cnp);
        let first = *path.iter().find(|p| cnps(p) > 0)?;
        let mut lost = Vec::new();
        for w in path.windows(2) {
            let n = self.cnps_settled(f, w[0]).saturating_sub(cnps(&w[1]));
            if n > 0 {
                lost.push(CountedLoss {
                    between: [self.label(w[0]), self.label(w[1])],
                    packets: n,
                });
            }
        }
        // The throttled sender's host: where flows from the CNPs' destination start.
        let host = self.host_of.get(&id.dst).map(|&(n, _)| n);
        let watched_in = |node: u32| {
            self.topo
                .points
                .iter()
                .enumerate()
                .filter(move |(i, p)| self.topo.point_node[*i] == node && p.direction != Direction::Egress)
                .map(|(i, _)| i as PointId)
        };
        let (mut reached, mut reached_at) = (None, None);
        if let Some(host) = host
            && let Some(at) = watched_in(host).next()
        {
            let there: Vec<PointId> = path
                .iter()
                .copied()
                .filter(|p| self.topo.point_node[*p as usize] == host && cnps(p) > 0)
                .collect();
            let n: u64 = there.iter().map(cnps).saturating_sum();
            reached = Some(n);
            reached_at = Some(self.label(there.first().copied().unwrap_or(at)));
            // CNPs that never reached the host at all: lost after the last point that
            // counted them (the host's ingress, when one, names the far end).
            let last = *path.last().expect("non-empty");
            if self.topo.point_node[last as usize] != host {
                let n = self.cnps_settled(f, last);
                let mut ins = watched_in(host);
                let far = match (ins.next(), ins.next()) {
                    (Some(p), None) => self.label(p),
                    _ => Point::node(&self.topo.nodes[host as usize]),
                };
                if n > 0 {
                    lost.push(CountedLoss {
                        between: [self.label(last), far],
                        packets: n,
                    });
                }
            }
        }
        Some(CnpDelivery {
            sent: cnps(&first),
            sent_at: self.label(first),
            reached,
            reached_at,
            lost,
        })
    }

    /// The forward flow a reverse flow (ACKs, NAKs, CNPs) answers: same IP pair reversed,
    /// its ACK PSNs inside the forward flow's recent request PSNs; a lone candidate wins.
    fn pair_of(&self, rev_id: &FlowId, rev: &FlowJoin) -> Option<FlowId> {
        let cands: Vec<(&FlowId, &FlowJoin)> = self
            .pair(&rev_id.dst, &rev_id.src)
            .filter(|(_, f)| !f.carries_cnp && (f.request_psns.is_some() || !f.counters.is_empty()))
            .collect();
        if cands.len() == 1 {
            return Some(*cands[0].0);
        }
        let score = |f: &FlowJoin| {
            let Some((lo, hi)) = f.request_psns else { return 0 };
            rev.ack_psns.iter().filter(|p| (lo..=hi + 1).contains(*p)).count()
        };
        let best = cands
            .iter()
            .map(|(id, f)| (score(f), **id))
            .max_by_key(|(s, _)| *s)?;
        (best.0 > 0).then_some(best.1)
    }

    /// Everything the collector knows of one flow.
    pub fn flow_report(&self, id: &FlowId) -> Option<FlowReport> {
        let f = self.get(id)?;
        let l = |p: &PointId| self.label(*p);
        let between = |a: &PointId, b: &PointId| [l(a), l(b)];
        // CNPs that answered this flow: reverse flows paired with it, whose requester QP
        // is shared by their ACKs and CNPs.
        let reverse: Vec<(&FlowId, &FlowJoin)> = self
            .pair(&id.dst, &id.src)
            .filter(|(_, r)| r.carries_cnp || !r.ack_psns.is_empty())
            .collect();
        let acked_qps: Vec<u32> = reverse
            .iter()
            .filter(|(rid, r)| !r.ack_psns.is_empty() && self.pair_of(rid, r) == Some(*id))
            .map(|(rid, _)| rid.dest_qp)
            .collect();
        let lone = self.pair(&id.src, &id.dst).count() == 1;
        let cnp_flows: Vec<&(&FlowId, &FlowJoin)> = reverse
            .iter()
            .filter(|(rid, r)| r.carries_cnp && (acked_qps.contains(&rid.dest_qp) || lone))
            .collect();
        let max_over_points = |c: &VecMap<PointId, PointTotals>, g: fn(&PointTotals) -> u64| {
            c.values().map(g).max().unwrap_or(0)
        };
        // CNPs count where they reach the sender they throttle (the most downstream point
        // that counted them when its host is not watched).
        let mut cnps_sent = 0u64;
        let mut cnps = 0u64;
        let mut cnps_lost = Vec::new();
        for (rid, r) in &cnp_flows {
            let Some(d) = self.cnp_delivery(rid, r) else {
                continue;
            };
            cnps_sent = d.sent.saturating_add(cnps_sent);
            cnps = cnps.saturating_add(d.reached.unwrap_or_else(|| {
                let totals = r.totals();
                self.counter_path(&totals)
                    .last()
                    .and_then(|p| totals.get(p))
                    .map_or(0, |c| c.counts.cnp)
            }));
            cnps_lost.extend(d.lost);
        }
        let totals = f.totals();
        let ce = max_over_points(&totals, |d| d.counts.ecn[3]);
        let mut ce_to_cnp = Delay::default();
        for (_, r) in &cnp_flows {
            for &(node, t) in &r.marks().cnp_times {
                // The CE mark that drew it: the latest before it, on the same node (clock).
                if let Some(ce_t) = f
                    .marks()
                    .ce_times
                    .iter()
                    .filter(|(n, c)| *n == node && *c <= t)
                    .map(|(_, c)| *c)
                    .max()
                    && t - ce_t < 100_000_000
                {
                    ce_to_cnp.add((t - ce_t) as i64);
                }
            }
        }
        // A flow of CNPs alone makes no trajectories: its path is its counters'.
        let (path, hops): (Vec<PointId>, Vec<u8>) = if f.path.is_empty() && f.carries_cnp {
            let p = self.counter_path(&totals);
            let ttl = |x: &PointId| totals.get(x).map_or(0, |c| c.last_ttl);
            let h = p
                .windows(2)
                .map(|w| ttl(&w[0]).saturating_sub(ttl(&w[1])))
                .collect();
            (p, h)
        } else {
            let h = f
                .path
                .windows(2)
                .map(|w| f.hops.get(&(w[0], w[1])).copied().unwrap_or(0))
                .collect();
            (f.path.to_vec(), h)
        };
        Some(FlowReport {
            id: id.to_string(),
            src_ip: id.src_ip(),
            dst_ip: id.dst_ip(),
            udp_sport: id.udp_sport,
            dest_qp: id.dest_qp,
            path: path.iter().map(l).collect(),
            hops,
            class: path
                .iter()
                .filter_map(|p| f.at.get(p)?.class.map(|c| ClassAt::new(l(p), c)))
                .collect(),
            cnp_class: f
                .marks()
                .cnp_class_at
                .iter()
                .map(|(p, c)| ClassAt::new(l(p), *c))
                .collect(),
            max_frame: f.at.iter().map(|(p, a)| (l(p), a.max_frame)).collect(),
            class_seen: f
                .seen
                .iter()
                .map(|(&(p, cnp, dscp, pcp), s)| ClassSeen {
                    point: l(&p),
                    cnp,
                    dscp,
                    pcp: (pcp != PCP_NONE).then_some(pcp),
                    span: *s,
                })
                .collect(),
            delivery: f.delivery.iter().collect(),
            class_changes: f
                .marks()
                .changes
                .iter()
                .map(|(&(a, b, from, to), s)| ClassChange {
                    between: between(&a, &b),
                    from_dscp: from,
                    to_dscp: to,
                    span: *s,
                })
                .collect(),
            ce_onset: f
                .marks()
                .ce_onset
                .iter()
                .map(|(&(a, b), s)| CeOnset {
                    after: a.map(|a| l(&a)),
                    at: l(&b),
                    span: *s,
                })
                .collect(),
            lost: f
                .marks()
                .lost
                .iter()
                .map(|(&(a, b), s)| Lost {
                    between: between(&a, &b),
                    span: *s,
                    largest_frame: f.marks().lost_frames.get(&(a, b)).copied(),
                    kernel_drops: self.kernel_drops(a, b, s),
                })
                .collect(),
            unobserved: f
                .marks()
                .unseen
                .iter()
                .map(|(&(a, b, why), s)| Unobserved {
                    between: between(&a, &b),
                    why,
                    reason: why.reason().into(),
                    span: *s,
                })
                .collect(),
            delays: f
                .delays
                .iter()
                .map(|(&(a, b), d)| DelayReport {
                    between: between(&a, &b),
                    delay: *d,
                })
                .collect(),
            path_history: f
                .paths()
                .map(|(t, p)| PathAt {
                    since_ns: t,
                    path: p.iter().map(l).collect(),
                })
                .collect(),
            counters: totals
                .iter()
                .map(|(p, c)| {
                    let d = CounterDelta {
                        counts: c.counts,
                        last_dscp: c.last_dscp,
                        last_pcp: c.last_pcp,
                        last_ttl: c.last_ttl,
                        ..Default::default()
                    };
                    (l(p), d)
                })
                .collect(),
            trajectories: f.trajectories,
            probe: None,
            cnp_delivery: self.cnp_delivery(id, f),
            answered_by: Answers {
                flows: cnp_flows.iter().map(|(rid, _)| rid.to_string()).collect(),
                cnps_sent,
                cnps,
                cnps_lost,
                ce_marks: ce,
                cnps_per_ce_mark: (ce > 0).then(|| cnps as f64 / ce as f64),
                ce_to_cnp: (ce_to_cnp.n > 0).then_some(ce_to_cnp),
            },
        })
    }

    /// What is wrong, fabric-wide: class changes, losses, CE onsets, path changes.
    pub fn anomalies(&self) -> Vec<Anomaly> {
        let mut v = Vec::new();
        for (id, _) in &self.flows {
            let Some(r) = self.flow_report(id) else { continue };
            for c in &r.class_changes {
                v.push(Anomaly {
                    kind: AnomalyKind::ClassChange,
                    flow: r.id.clone(),
                    between: c.between.to_vec(),
                    detail: format!("DSCP {} -> {}", c.from_dscp, c.to_dscp),
                    packets: c.span.packets,
                });
            }
            for l in &r.lost {
                v.push(Anomaly {
                    kind: AnomalyKind::Lost,
                    flow: r.id.clone(),
                    between: l.between.to_vec(),
                    detail: String::new(),
                    packets: l.span.packets,
                });
            }
            for c in &r.ce_onset {
                let mut between: Vec<Point> = c.after.iter().cloned().collect();
                between.push(c.at.clone());
                v.push(Anomaly {
                    kind: AnomalyKind::CeOnset,
                    flow: r.id.clone(),
                    between,
                    detail: String::new(),
                    packets: c.span.packets,
                });
            }
            if r.path_history.len() > 1 {
                v.push(Anomaly {
                    kind: AnomalyKind::PathChange,
                    flow: r.id.clone(),
                    between: r.path.clone(),
                    detail: format!("{} paths over time", r.path_history.len()),
                    packets: 0,
                });
            }
        }
        v
    }
}
