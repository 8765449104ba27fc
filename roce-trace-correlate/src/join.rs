//! The join: observations of one packet identity from many points become a
//! trajectory (ordered by TTL, then time); trajectories make each flow's path, its class
//! at each point and where it changed, where CE marks begin, where sampled packets were
//! lost, one-way delays, and path changes over time. Counters explain how much. Pure
//! logic with time passed in, so it is tested without a network.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, VecDeque},
    sync::Arc,
};

use roce_trace_common::flow::{FlowId, PROBE_QP, PacketId};
use roce_trace_common::{datapath::PCP_NONE, roce};

use crate::{
    observation::{CounterDelta, OBS_HAS_PCP, Observation, PointHealth},
    report::*,
    small::{DeliveryLog, PackedCounts, PointTotals, VecMap, push_tight},
    view::{JoinView, Snapshot},
};

/// An observation point, collector-wide.
pub type PointId = u32;

/// MTU changes kept per point.
const MTU_HISTORY: usize = 16;

#[derive(Clone, Copy, Debug)]
pub struct JoinConfig {
    /// A trajectory is complete this long after its first observation arrived.
    pub trajectory_timeout_ns: u64,
    /// Flows with no observation or counter for this long are forgotten.
    pub flow_idle_ns: u64,
    pub max_flows: usize,
    /// Packet identities waiting for their trajectory to complete.
    pub max_pending: usize,
    /// Counts from one point are compared with the next point's only once they are this
    /// old (by arrival): every agent has reported what crossed it by then (agents report
    /// every second by default), so packets in flight between two reports are no loss.
    pub counter_settle_ns: u64,
    /// How long past its timeout a trajectory missing a point of its flow's path may wait
    /// for that point's agent to catch up. Agents deliver late after an outage (NATS or
    /// the collector away, a slow link): a trajectory completed before a lagging agent's
    /// observations arrive would show a false class change or loss. It completes once
    /// every node of the path it lacks has reported an observation past the packet's time
    /// (plus [`PROOF_WINDOW_NS`]), or after this much more.
    pub max_agent_lag_ns: u64,
}

impl Default for JoinConfig {
    fn default() -> Self {
        Self {
            trajectory_timeout_ns: 2_000_000_000,
            flow_idle_ns: 300_000_000_000,
            max_flows: 100_000,
            max_pending: 1_000_000,
            counter_settle_ns: 3_000_000_000,
            max_agent_lag_ns: 10_000_000_000,
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Obs {
    point: PointId,
    time_ns: u64,
    frame_len: u16,
    dscp: u8,
    ecn: u8,
    ttl: u8,
    pcp: u8,
}

struct Pending {
    /// Every observation of this identity; split into transmissions when complete.
    obs: Vec<Obs>,
}

const RECENT: usize = 64;

impl FlowJoin {
    /// The flow's rarer state (empty when it has none).
    pub(crate) fn marks(&self) -> &Marks {
        self.marks.as_deref().unwrap_or(&NO_MARKS)
    }

    /// The flow's rarer state, made on first use.
    pub(crate) fn marks_mut(&mut self) -> &mut Marks {
        self.marks.get_or_insert_with(Box::default)
    }

    /// Every path the flow took, oldest first, with when each began: the earlier ones
    /// and the current one (none before its first trajectory).
    pub(crate) fn paths(&self) -> impl DoubleEndedIterator<Item = (u64, &[PointId])> {
        self.marks()
            .history
            .iter()
            .map(|(t, p)| (*t, &p[..]))
            .chain((!self.path.is_empty()).then_some((self.path_since_ns, &self.path[..])))
    }

    /// A point's running counters of this flow.
    pub(crate) fn totals_at(&self, p: PointId) -> Option<PointTotals> {
        self.counters.get(p)
    }

    /// Every point's running counters, in point order.
    pub(crate) fn totals(&self) -> VecMap<PointId, PointTotals> {
        let mut m = VecMap::default();
        for (p, t) in self.counters.iter() {
            m.insert(p, t);
        }
        m
    }
}

#[derive(Clone, Default)]
pub struct FlowJoin {
    pub(crate) path: Box<[PointId]>,
    pub(crate) path_since_ns: u64,
    pub(crate) hops: VecMap<(PointId, PointId), u8>,
    /// Per point: the class (DSCP, ECN, PCP) of the flow's latest trajectory there, and
    /// the largest frame seen there.
    pub(crate) at: VecMap<PointId, AtPoint>,
    /// Every class each point saw, CNPs apart, with when and how many: a class that was
    /// wrong for a while is wrong, whatever the point shows at the end.
    pub(crate) seen: VecMap<(PointId, bool, u8, u8), Span>,
    pub(crate) delays: VecMap<(PointId, PointId), Delay>,
    pub(crate) counters: PackedCounts,
    pub(crate) trajectories: u64,
    /// The span of sampled request PSNs, and recent ACK PSNs: the two directions of a
    /// connection agree on PSNs (QPs start at random PSNs, so flows rarely overlap).
    pub(crate) request_psns: Option<(u32, u32)>,
    pub(crate) ack_psns: VecDeque<u32>,
    pub(crate) carries_cnp: bool,
    /// Bytes delivered at the flow's most downstream point per counter delta, by arrival
    /// time; that point (lowest TTL, ingress before egress at equal TTL), known from the
    /// counters themselves so delivery starts with the first deltas, not the first path.
    pub(crate) delivery: DeliveryLog,
    pub(crate) delivery_point: Option<(PointId, u8, bool)>,
    /// What this flow added to the join's running totals.
    pub(crate) share: Share,
    /// What most flows never have (anomalies, CE and CNP state, earlier paths), in a box
    /// made on first use: a healthy flow does not pay for its empty vectors.
    marks: Option<Box<Marks>>,
}

/// What a flow keeps about each point it was seen at ([`FlowJoin::at`]).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct AtPoint {
    /// (DSCP, ECN, PCP) of its latest trajectory through the point.
    pub(crate) class: Option<(u8, u8, u8)>,
    pub(crate) max_frame: u16,
}

/// A flow's rarer state ([`FlowJoin::marks`]).
#[derive(Clone, Default)]
pub(crate) struct Marks {
    /// The paths before the current one, with when each began (the last
    /// [`PATH_HISTORY`]).
    pub(crate) history: Vec<(u64, Box<[PointId]>)>,
    pub(crate) changes: VecMap<(PointId, PointId, u8, u8), Span>,
    pub(crate) ce_onset: VecMap<(Option<PointId>, PointId), Span>,
    pub(crate) lost: VecMap<(PointId, PointId), Span>,
    /// The largest frame among the packets lost there.
    pub(crate) lost_frames: VecMap<(PointId, PointId), u16>,
    /// Sampled packets missing between two points that could have been seen there but
    /// whose absence proves nothing (see [`Unseen`]).
    pub(crate) unseen: VecMap<(PointId, PointId, Unseen), Span>,
    /// Recent CE-marked arrivals and CNP departures, per node: (node, time).
    pub(crate) ce_times: VecDeque<(u32, u64)>,
    pub(crate) cnp_times: VecDeque<(u32, u64)>,
    /// Class of the CNPs at each point (CNPs are always reported, so this is exact).
    pub(crate) cnp_class_at: VecMap<PointId, (u8, u8, u8)>,
    /// Each point's running CNP count after each counter delta, by arrival time (the last
    /// [`SETTLE_SAMPLES`]): what a point had counted long enough ago to compare.
    pub(crate) cnp_counts: VecMap<PointId, VecDeque<(u64, u64)>>,
}

static NO_MARKS: std::sync::LazyLock<Marks> = std::sync::LazyLock::new(Marks::default);

/// Pairs of points whose losses are tallied for `/metrics`, at most.
const MAX_LOST_HOPS: usize = 65_536;

/// Earlier paths kept per flow: a flow that keeps moving keeps its latest moves.
const PATH_HISTORY: usize = 64;

/// Counter deltas kept per flow for its delivery over time (a minute at 1 s intervals).
const DELIVERY_SAMPLES: usize = 64;

/// Health intervals kept per point (five minutes at 1 s).
const HEALTH_INTERVALS: usize = 300;

/// A packet last seen at time t would have reached the next point by t + this: the
/// next point's agent must have reported clean health over [t, t + this] for the packet
/// to count as lost.
const PROOF_WINDOW_NS: u64 = 100_000_000;

/// How long a missing packet waits for the health that proves or excuses it (collector
/// time): agents report every second by default.
const PROOF_PATIENCE_NS: u64 = 5_000_000_000;

/// A sampled packet seen at `a` and never at `b`, the next point of its path.
#[derive(Clone, Copy, Debug)]
struct Missing {
    id: PacketId,
    a: PointId,
    b: PointId,
    /// Its first point's time, and its time at `a` (agents' clocks).
    first_ns: u64,
    last_ns: u64,
    frame_len: u16,
    /// Collector time after which it is judged with whatever health is in.
    deadline_ns: u64,
}

/// Running CNP counts kept per point (16 s of 1 s intervals; the settle time is 3 s).
const SETTLE_SAMPLES: usize = 16;

fn push_recent<T>(q: &mut VecDeque<T>, v: T) {
    push_bounded(q, v, RECENT);
}

fn push_bounded<T>(q: &mut VecDeque<T>, v: T, cap: usize) {
    if q.len() == cap {
        q.pop_front();
    }
    q.push_back(v);
}

/// The observation points and their nodes, shared with views (copied only when a point
/// is added while a view holds them).
#[derive(Clone, Default)]
pub struct Topology {
    pub(crate) points: Vec<PointInfo>,
    /// Node index of every point (for per-node clocks).
    pub(crate) point_node: Vec<u32>,
    pub(crate) nodes: Vec<String>,
}

impl Topology {
    pub(crate) fn label(&self, p: PointId) -> Point {
        self.points
            .get(p as usize)
            .map(PointInfo::point)
            .unwrap_or_else(|| Point::node(&format!("point{p}")))
    }
}

/// A tracked flow: when it was last active (beside the pointer, so idle scans do not
/// touch the flow) and its state, shared with views until the join next changes it.
struct Slot {
    last_ns: u64,
    f: Arc<FlowJoin>,
}

impl Slot {
    /// The flow's state to change: copied first when a view still holds it (counted in
    /// `copies`).
    fn own(&mut self, copies: &mut u64) -> &mut FlowJoin {
        if Arc::strong_count(&self.f) > 1 {
            *copies += 1;
        }
        Arc::make_mut(&mut self.f)
    }
}

/// A flow's part of the join's running totals ([`JoinStats`]), given back when the flow is
/// handed to another collector ([`Joiner::forget_where`]), which counts it again as it
/// replays it: a group's merged totals then count each observation once. (A flow
/// forgotten for being idle or to make room keeps its part: it was joined here.)
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Share {
    observations: u64,
    trajectories: u64,
    duplicates: u32,
    retransmissions: u32,
    fragments: u32,
    late_arrivals: u32,
    pending_dropped: u32,
    agent_lag_gave_up: u32,
}

impl Share {
    /// Adds what the totals gained from `before` to `now`.
    fn add(&mut self, before: &JoinStats, now: &JoinStats) {
        let d = |a: u64, b: u64| a.saturating_sub(b);
        let d32 = |a: u64, b: u64| d(a, b).min(u32::MAX as u64) as u32;
        self.observations += d(now.observations, before.observations);
        self.trajectories += d(now.trajectories, before.trajectories);
        self.duplicates = self
            .duplicates
            .saturating_add(d32(now.duplicates, before.duplicates));
        self.retransmissions = self
            .retransmissions
            .saturating_add(d32(now.retransmissions, before.retransmissions));
        self.fragments = self
            .fragments
            .saturating_add(d32(now.fragments, before.fragments));
        self.late_arrivals = self
            .late_arrivals
            .saturating_add(d32(now.late_arrivals, before.late_arrivals));
        self.pending_dropped = self
            .pending_dropped
            .saturating_add(d32(now.pending_dropped, before.pending_dropped));
        self.agent_lag_gave_up = self
            .agent_lag_gave_up
            .saturating_add(d32(now.agent_lag_gave_up, before.agent_lag_gave_up));
    }

    /// Takes this share out of `stats`.
    fn give_back(&self, stats: &mut JoinStats) {
        stats.observations = stats.observations.saturating_sub(self.observations);
        stats.trajectories = stats.trajectories.saturating_sub(self.trajectories);
        stats.duplicates = stats.duplicates.saturating_sub(self.duplicates as u64);
        stats.retransmissions = stats.retransmissions.saturating_sub(self.retransmissions as u64);
        stats.fragments = stats.fragments.saturating_sub(self.fragments as u64);
        stats.late_arrivals = stats.late_arrivals.saturating_sub(self.late_arrivals as u64);
        stats.pending_dropped = stats.pending_dropped.saturating_sub(self.pending_dropped as u64);
        stats.agent_lag_gave_up = stats
            .agent_lag_gave_up
            .saturating_sub(self.agent_lag_gave_up as u64);
    }
}

/// Anomalies by kind (one per flow and place, as [`JoinView::anomalies`] lists them),
/// kept up to date as flows change so metrics never build a report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Tally([u64; 4]);

impl Tally {
    const KINDS: [AnomalyKind; 4] = [
        AnomalyKind::ClassChange,
        AnomalyKind::Lost,
        AnomalyKind::CeOnset,
        AnomalyKind::PathChange,
    ];

    fn of(f: &FlowJoin) -> Self {
        Self([
            f.marks().changes.len() as u64,
            f.marks().lost.len() as u64,
            f.marks().ce_onset.len() as u64,
            (!f.marks().history.is_empty()) as u64,
        ])
    }

    fn add(&mut self, o: Self) {
        for (a, b) in self.0.iter_mut().zip(o.0) {
            *a += b;
        }
    }

    fn sub(&mut self, o: Self) {
        for (a, b) in self.0.iter_mut().zip(o.0) {
            *a = a.saturating_sub(b);
        }
    }
}

pub struct Joiner {
    cfg: JoinConfig,
    topo: Arc<Topology>,
    pending: HashMap<PacketId, Pending>,
    order: VecDeque<(u64, PacketId)>,
    /// Identities past their timeout that lack a node of their flow's path whose agent
    /// has not reported that far yet (by arrival of their first observation).
    held: VecDeque<(u64, PacketId)>,
    /// Per node, how far (the agent's clock) its agent has delivered every observation,
    /// as HEALTH received in order with them says ([`Joiner::reported_to`]).
    reported_to_ns: Vec<u64>,
    /// Packets just judged lost (the link they vanished on), kept for one more trajectory
    /// timeout: when their late observations arrive after all, the loss is taken back.
    recent_losses: HashMap<PacketId, (PointId, PointId)>,
    recent_order: VecDeque<(u64, PacketId)>,
    /// Packets missing at a point, waiting for that point's health to prove or excuse it.
    awaiting: VecDeque<Missing>,
    /// The collector's time at the last tick (arrival clock, not the agents').
    now_ns: u64,
    /// Set by [`Joiner::flush`]: the agents are gone, every count is final.
    flushed: bool,
    /// Each point's health, interval by interval (the last [`HEALTH_INTERVALS`]).
    health: HashMap<PointId, Arc<VecDeque<PointHealth>>>,
    /// The node each source address sends from: the node of the most upstream egress
    /// point where a flow from it was counted (its host, when watched). Bounded like flows.
    host_of: Arc<HashMap<[u8; 16], (u32, u8)>>,
    flows: HashMap<FlowId, Slot>,
    /// Every tracked flow in label order: the flows of one address pair are a range, so
    /// a flow's report finds its pair's and the reverse pair's flows without a scan.
    ids: BTreeSet<FlowId>,
    /// Anomalies of the tracked flows, by kind.
    tally: Tally,
    /// Sampled packets judged lost between two consecutive points, over the join's life
    /// (a judged loss that arrives late is taken back): losses per link. At most
    /// [`MAX_LOST_HOPS`] pairs (consecutive points of paths: a fabric has far fewer).
    lost_between: BTreeMap<(PointId, PointId), u64>,
    /// When idle flows were last looked for (collector time).
    expired_at_ns: u64,
    /// Flows that just got their first path, for a caller that asked
    /// ([`Joiner::note_new_paths`]).
    new_paths: Option<Vec<FlowId>>,
    /// Ticks that gave a large amount of state back (see [`Joiner::gave_back`]).
    gave_back: u64,
    /// Flows the join changed while a view still held them (see
    /// [`Joiner::copied_for_views`]).
    copied_for_views: u64,
    pub stats: JoinStats,
}

impl Joiner {
    pub fn new(cfg: JoinConfig) -> Self {
        Self {
            cfg,
            topo: Arc::default(),
            pending: HashMap::new(),
            order: VecDeque::new(),
            held: VecDeque::new(),
            reported_to_ns: Vec::new(),
            recent_losses: HashMap::new(),
            recent_order: VecDeque::new(),
            awaiting: VecDeque::new(),
            now_ns: 0,
            flushed: false,
            health: HashMap::new(),
            host_of: Arc::default(),
            flows: HashMap::new(),
            ids: BTreeSet::new(),
            tally: Tally::default(),
            lost_between: BTreeMap::new(),
            expired_at_ns: 0,
            new_paths: None,
            gave_back: 0,
            copied_for_views: 0,
            stats: JoinStats::default(),
        }
    }

    /// Registers (or finds) an observation point.
    pub fn point(&mut self, mut info: PointInfo) -> PointId {
        let now = self.now_ns;
        let note_mtu = |p: &mut PointInfo, mtu: Option<u32>| {
            if let Some(m) = mtu
                && p.mtu_history.last().is_none_or(|x| x.mtu != m)
            {
                if p.mtu_history.len() == MTU_HISTORY {
                    p.mtu_history.remove(0);
                }
                p.mtu_history.push(MtuAt { at_ns: now, mtu: m });
            }
            p.mtu = mtu;
        };
        let topo = Arc::make_mut(&mut self.topo);
        if let Some(i) = topo
            .points
            .iter()
            .position(|p| p.node == info.node && p.iface == info.iface && p.direction == info.direction)
        {
            topo.points[i].clock_synced = info.clock_synced;
            note_mtu(&mut topo.points[i], info.mtu);
            return i as PointId;
        }
        let mtu = info.mtu;
        info.mtu_history.clear();
        note_mtu(&mut info, mtu);
        let node = match topo.nodes.iter().position(|n| *n == info.node) {
            Some(n) => n as u32,
            None => {
                topo.nodes.push(info.node.clone());
                (topo.nodes.len() - 1) as u32
            }
        };
        topo.points.push(info);
        topo.point_node.push(node);
        (topo.points.len() - 1) as PointId
    }

    pub fn points(&self) -> &[PointInfo] {
        &self.topo.points
    }

    /// The flow, made active now; a new one when it is not tracked (the longest-idle
    /// flows make room when the table is full).
    fn flow(&mut self, id: FlowId, now_ns: u64) -> &mut FlowJoin {
        if !self.flows.contains_key(&id) {
            if self.flows.len() >= self.cfg.max_flows.max(1) {
                self.evict_idle();
            }
            self.flows.insert(
                id,
                Slot {
                    last_ns: now_ns,
                    f: Arc::default(),
                },
            );
            self.ids.insert(id);
        }
        let s = self.flows.get_mut(&id).expect("inserted");
        s.last_ns = now_ns;
        s.own(&mut self.copied_for_views)
    }

    /// A tracked flow's state to change (copied first when a view still holds it).
    fn flow_mut(&mut self, id: &FlowId) -> Option<&mut FlowJoin> {
        let copies = &mut self.copied_for_views;
        self.flows.get_mut(id).map(|s| s.own(copies))
    }

    fn forget(&mut self, id: &FlowId) {
        if let Some(s) = self.flows.remove(id) {
            self.ids.remove(id);
            self.tally.sub(Tally::of(&s.f));
        }
    }

    /// The table is full: forgets the longest-idle 1/64 of it (at least one flow), so a
    /// new flow always finds room and each eviction pass pays for many new flows.
    fn evict_idle(&mut self) {
        let n = (self.flows.len() / 64).max(1);
        let mut times: Vec<u64> = self.flows.values().map(|s| s.last_ns).collect();
        let (_, &mut cut, _) = times.select_nth_unstable(n - 1);
        drop(times);
        let mut idle: Vec<FlowId> = self
            .flows
            .iter()
            .filter(|(_, s)| s.last_ns < cut)
            .map(|(id, _)| *id)
            .collect();
        // Flows idle since exactly `cut` fill the rest.
        idle.extend(
            self.flows
                .iter()
                .filter(|(_, s)| s.last_ns == cut)
                .map(|(id, _)| *id)
                .take(n.saturating_sub(idle.len())),
        );
        for id in &idle {
            self.forget(id);
        }
        self.stats.flows_evicted += idle.len() as u64;
    }

    /// Records what changed in a flow's anomalies (`before`: its tally before the change).
    fn retally(&mut self, id: &FlowId, before: Option<Tally>) {
        if let Some(s) = self.flows.get(id) {
            self.tally.add(Tally::of(&s.f));
        }
        if let Some(b) = before {
            self.tally.sub(b);
        }
    }

    fn tally_of(&self, id: &FlowId) -> Option<Tally> {
        self.flows.get(id).map(|s| Tally::of(&s.f))
    }

    /// One observation from `point` (already mapped to a collector point), arriving at
    /// collector time `now_ns`.
    pub fn add(&mut self, point: PointId, o: &Observation, now_ns: u64) {
        self.stats.observations += 1;
        if o.id.flow.dest_qp == PROBE_QP {
            // Our own in-band probes: they expire on purpose, so they are no flow's loss.
            self.stats.probe_observations += 1;
            return;
        }
        let obs = Obs {
            point,
            time_ns: o.time_ns,
            frame_len: o.frame_len,
            dscp: o.dscp,
            ecn: o.ecn,
            ttl: o.ttl,
            pcp: if o.flags & OBS_HAS_PCP != 0 {
                o.pcp
            } else {
                PCP_NONE
            },
        };
        // Evidence that needs no join: CE arrivals, CNP departures, ACK/request PSNs.
        let node = self.topo.point_node[point as usize];
        let opcode = o.id.opcode;
        let f = self.flow(o.id.flow, now_ns);
        f.share.observations += 1;
        if o.ecn == 3 {
            push_recent(&mut f.marks_mut().ce_times, (node, o.time_ns));
        }
        f.seen
            .entry_or_default((point, opcode == roce::OP_CNP, obs.dscp, obs.pcp))
            .hit(o.time_ns);
        let m = &mut f.at.entry_or_default(point).max_frame;
        *m = (*m).max(o.frame_len);
        if opcode == roce::OP_CNP {
            f.carries_cnp = true;
            f.marks_mut()
                .cnp_class_at
                .insert(point, (obs.dscp, obs.ecn, obs.pcp));
            push_recent(&mut f.marks_mut().cnp_times, (node, o.time_ns));
            // Every CNP of a QP is the same packet (PSN 0, one ICRC): no identity tells
            // two apart, so they make no trajectories. Their path and where they vanish
            // come from the exact per-point counters instead (`cnp_delivery`).
            return;
        } else if roce::is_ack_opcode(opcode) {
            // The same ACK is reported at every point it crosses: keep it once.
            if !f.ack_psns.contains(&o.id.psn) {
                push_recent(&mut f.ack_psns, o.id.psn);
            }
        } else if roce::is_request(opcode) && o.hash_sampled() {
            let p = o.id.psn;
            f.request_psns = Some(match f.request_psns {
                // A jump of half the PSN space is a wrap: start the span again.
                Some((lo, hi)) if lo.abs_diff(p) < 0x80_0000 && hi.abs_diff(p) < 0x80_0000 => {
                    (lo.min(p), hi.max(p))
                }
                _ => (p, p),
            });
        }
        if !o.hash_sampled() {
            // Anomaly reports are partial by design (a CE mark reported downstream has no
            // report upstream): they explain, they do not make trajectories.
            return;
        }
        if !self.pending.contains_key(&o.id) {
            if self.pending.len() >= self.cfg.max_pending {
                self.stats.pending_dropped += 1;
                if let Some(f) = self.flow_mut(&o.id.flow) {
                    f.share.pending_dropped = f.share.pending_dropped.saturating_add(1);
                }
                return;
            }
            self.pending.insert(o.id, Pending { obs: Vec::new() });
            self.order.push_back((now_ns, o.id));
        }
        let p = self.pending.get_mut(&o.id).expect("inserted");
        if p.obs
            .iter()
            .any(|x| x.point == point && x.time_ns == obs.time_ns && x.ttl == obs.ttl)
        {
            self.stats.duplicates += 1;
            if let Some(f) = self.flow_mut(&o.id.flow) {
                f.share.duplicates = f.share.duplicates.saturating_add(1);
            }
            return;
        }
        p.obs.push(obs);
    }

    /// Splits one identity's observations into transmissions: in time order, a packet
    /// passes each node at most once each way, so seeing a (node, direction) again starts
    /// the next transmission (a retransmission of the same PSN). An observation that
    /// continues an earlier transmission — one lacking that (node, direction) whose last
    /// point is known (from this flow's trajectories) to lead to it — goes there first: a
    /// packet held in a queue while its retransmission went ahead (go-back-N overtaking a
    /// congested queue) arrives after the retransmission started, and must not end the
    /// retransmission's trajectory early nor stand alone as a one-point path. This needs
    /// clocks that agree to better than the retransmission interval.
    fn transmissions(&self, flow: &FlowId, mut obs: Vec<Obs>) -> Vec<Vec<Obs>> {
        obs.sort_by_key(|o| o.time_ns);
        let key = |o: &Obs| {
            (
                self.topo.point_node[o.point as usize],
                self.topo.points[o.point as usize].direction == Direction::Ingress,
            )
        };
        let hops = self.flows.get(flow).map(|s| &s.f.hops);
        let leads_to = |a: PointId, b: PointId| hops.is_some_and(|h| h.contains_key(&(a, b)));
        let mut out: Vec<Vec<Obs>> = Vec::new();
        for o in obs {
            let lacks = |cur: &Vec<Obs>| !cur.iter().any(|x| key(x) == key(&o));
            if let Some(cur) = out
                .iter_mut()
                .find(|cur| lacks(cur) && cur.last().is_some_and(|l| leads_to(l.point, o.point)))
            {
                cur.push(o);
                continue;
            }
            match out.last_mut() {
                Some(cur) if lacks(cur) => cur.push(o),
                _ => out.push(vec![o]),
            }
        }
        out
    }

    fn complete(&mut self, id: PacketId, p: Pending) {
        let before = self.stats;
        self.complete_in(id, p);
        self.credit(&id.flow, &before);
    }

    /// Credits the flow with what the totals gained since `before`.
    fn credit(&mut self, flow: &FlowId, before: &JoinStats) {
        let now = self.stats;
        if let Some(f) = self.flow_mut(flow) {
            f.share.add(before, &now);
        }
    }

    fn complete_in(&mut self, id: PacketId, p: Pending) {
        let instances = self.transmissions(&id.flow, p.obs);
        self.stats.retransmissions += instances.len().saturating_sub(1) as u64;
        for inst in instances {
            self.finish(id, inst);
        }
    }

    /// Counter deltas from `point`.
    pub fn add_counters(&mut self, point: PointId, d: &CounterDelta, now_ns: u64) {
        if d.flow.dest_qp == PROBE_QP {
            return;
        }
        let not_egress = self
            .topo
            .points
            .get(point as usize)
            .is_some_and(|p| p.direction != Direction::Egress);
        let node = self.topo.point_node.get(point as usize).copied();
        let max_hosts = self.cfg.max_flows;
        if let Some(node) = node
            && !not_egress
            && d.counts.packets > 0
        {
            // Written only when it changes: a view may hold the map.
            let change = match self.host_of.get(&d.flow.src) {
                Some(&(_, ttl)) => d.last_ttl > ttl,
                None => self.host_of.len() < max_hosts,
            };
            if change {
                Arc::make_mut(&mut self.host_of).insert(d.flow.src, (node, d.last_ttl));
            }
        }
        {
            let f = self.flow(d.flow, now_ns);
            let mut total = f.totals_at(point).unwrap_or_default();
            total.counts.add(&d.counts);
            (total.last_dscp, total.last_pcp, total.last_ttl) = (d.last_dscp, d.last_pcp, d.last_ttl);
            f.counters.set(point, &total);
            let cnps = total.counts.cnp;
            if d.counts.cnp > 0 {
                f.carries_cnp = true;
            }
            if cnps > 0 {
                push_bounded(
                    f.marks_mut().cnp_counts.entry_or_default(point),
                    (now_ns, cnps),
                    SETTLE_SAMPLES,
                );
            }
            // Delivery over time: what reached the end of its path, interval by interval.
            let here = (point, d.last_ttl, not_egress);
            let further = match f.delivery_point {
                None => true,
                Some((p, ..)) if p == point => false,
                Some((_, ttl, ingress)) => here.1 < ttl || (here.1 == ttl && here.2 && !ingress),
            };
            if further {
                f.delivery.clear();
                f.delivery_point = Some(here);
            }
            if f.delivery_point.is_some_and(|(p, ..)| p == point) {
                f.delivery.push(
                    DeliveryAt {
                        start_ns: d.start_ns,
                        end_ns: d.end_ns,
                        bytes: d.counts.bytes,
                        packets: d.counts.packets,
                        ce: d.counts.ecn[3],
                    },
                    DELIVERY_SAMPLES,
                );
            }
        }
    }

    /// Completes trajectories whose time is up, forgets idle flows.
    pub fn tick(&mut self, now_ns: u64) {
        self.now_ns = now_ns;
        while let Some(&(t, id)) = self.order.front() {
            if t + self.cfg.trajectory_timeout_ns > now_ns {
                break;
            }
            self.order.pop_front();
            if let Some(p) = self.pending.get(&id) {
                if self.lagging(&id, p) {
                    self.held.push_back((t, id));
                } else if let Some(p) = self.pending.remove(&id) {
                    self.complete(id, p);
                }
            }
        }
        if !self.held.is_empty() {
            let cap = self.cfg.trajectory_timeout_ns + self.cfg.max_agent_lag_ns;
            let held = std::mem::take(&mut self.held);
            for (t, id) in held {
                let Some(p) = self.pending.get(&id) else { continue };
                let capped = t.saturating_add(cap) <= now_ns;
                if capped || !self.lagging(&id, p) {
                    let p = self.pending.remove(&id).expect("pending");
                    let before = self.stats;
                    self.stats.agent_lag_gave_up += capped as u64;
                    self.credit(&id.flow, &before);
                    self.complete(id, p);
                } else {
                    self.held.push_back((t, id));
                }
            }
        }
        self.judge_awaiting();
        // A lost packet's late observations come within one more timeout, or never.
        while let Some(&(t, id)) = self.recent_order.front() {
            if t + 3 * self.cfg.trajectory_timeout_ns > now_ns {
                break;
            }
            self.recent_order.pop_front();
            self.recent_losses.remove(&id);
        }
        // Idle flows, looked for once a second at most (an eighth of the idle time when
        // that is shorter): the scan reads every slot, so not at every tick.
        let every = (self.cfg.flow_idle_ns / 8).min(1_000_000_000);
        if now_ns >= self.expired_at_ns.saturating_add(every) {
            self.expired_at_ns = now_ns;
            let idle = self.cfg.flow_idle_ns;
            let gone: Vec<FlowId> = self
                .flows
                .iter()
                .filter(|(_, s)| s.last_ns.saturating_add(idle) <= now_ns)
                .map(|(id, _)| *id)
                .collect();
            for id in &gone {
                self.forget(id);
            }
            self.stats.flows_expired += gone.len() as u64;
            if gone.len() >= 4096 {
                self.gave_back += 1;
            }
        }
        // After a burst the waiting identities' tables keep their peak size: it is given
        // back once they are far below it, keeping room for twice what waits.
        let (n, cap) = (self.pending.len(), self.pending.capacity());
        if cap > 4 * n + 4096 {
            self.pending.shrink_to(2 * n);
            self.order.shrink_to(2 * self.order.len());
            self.gave_back += 1;
        }
        self.stats.pending = self.pending.len() as u64;
        self.stats.flows = self.flows.len() as u64;
    }

    /// How many ticks gave a large amount of state back: waiting identities' tables far
    /// below their peak, or thousands of idle flows forgotten at once. The allocator
    /// keeps freed memory for reuse; a caller that sees this move may hand it back to the
    /// operating system (the collector does), so the process's resident set follows its
    /// state down after a burst.
    pub fn gave_back(&self) -> u64 {
        self.gave_back
    }

    /// How many times the join copied a flow's state to change it because a view
    /// ([`Joiner::snapshot`], [`Joiner::chunk_view`], [`Joiner::flow_view`]) still held
    /// it: what readers cost the join beyond the lock.
    pub fn copied_for_views(&self) -> u64 {
        self.copied_for_views
    }

    /// Whether `p` lacks a node of its flow's path whose agent has not yet reported past
    /// the packet's time: its observation may still be on its way. How far a node has
    /// reported: its in-order HEALTH ([`Joiner::reported_to`]), or its latest observation
    /// of this same flow — an agent delivers a flow's observations in order, but not
    /// its flows in order with each other (fleet mode reads them on separate
    /// partitions), so another flow's observation says nothing.
    fn lagging(&self, id: &PacketId, p: &Pending) -> bool {
        let Some(s) = self.flows.get(&id.flow) else {
            return false;
        };
        let Some(t) = p.obs.iter().map(|o| o.time_ns).max() else {
            return false;
        };
        let due = t.saturating_add(PROOF_WINDOW_NS);
        let node = |pt: PointId| self.topo.point_node[pt as usize];
        s.f.path.iter().any(|&pt| {
            let n = node(pt);
            if p.obs.iter().any(|o| node(o.point) == n)
                || self.reported_to_ns.get(n as usize).is_some_and(|&to| to >= due)
            {
                return false;
            }
            !s.f.seen
                .iter()
                .any(|((q, ..), span)| node(*q) == n && span.last_ns >= due)
        })
    }

    /// Completes every pending trajectory now (on exit).
    pub fn flush(&mut self) {
        self.flushed = true;
        // The held ones are the oldest; they are judged without their lagging agents.
        let held: Vec<PacketId> = self.held.iter().map(|(_, id)| *id).collect();
        for id in &held {
            if self.pending.contains_key(id) {
                let before = self.stats;
                self.stats.agent_lag_gave_up += 1;
                self.credit(&id.flow, &before);
            }
        }
        let ids: Vec<PacketId> = self
            .held
            .drain(..)
            .chain(self.order.drain(..))
            .map(|(_, id)| id)
            .collect();
        for id in ids {
            if let Some(p) = self.pending.remove(&id) {
                self.complete(id, p);
            }
        }
        self.judge_awaiting();
    }

    fn finish(&mut self, id: PacketId, t: Vec<Obs>) {
        let before = self.tally_of(&id.flow);
        self.finish_in(id, t);
        self.retally(&id.flow, before);
    }

    fn finish_in(&mut self, id: PacketId, mut t: Vec<Obs>) {
        let flow = id.flow;
        // Upstream first: higher TTL; at equal TTL the earlier time — but two points of
        // equal TTL on two nodes are one link's ends (a router's egress, the next node's
        // ingress: routers decrement between their own ingress and egress), so the egress
        // comes first whatever the clocks say (datapath timestamps are coarse: the two
        // often tie); on one node (no decrement: a bridge) the ingress does.
        t.sort_by(|a, b| b.ttl.cmp(&a.ttl).then(a.time_ns.cmp(&b.time_ns)));
        let mut i = 0;
        while i < t.len() {
            let run = t[i..].iter().take_while(|o| o.ttl == t[i].ttl).count();
            if run == 2 {
                let (a, b) = (&t[i], &t[i + 1]);
                let ingress = |o: &Obs| self.topo.points[o.point as usize].direction == Direction::Ingress;
                let same_node =
                    self.topo.point_node[a.point as usize] == self.topo.point_node[b.point as usize];
                if ingress(a) != ingress(b) && ingress(a) != same_node {
                    t.swap(i, i + 1);
                }
            }
            i += run;
        }
        self.stats.trajectories += 1;
        let synced: Vec<bool> = t
            .iter()
            .map(|o| self.topo.points[o.point as usize].clock_synced)
            .collect();
        let copies = &mut self.copied_for_views;
        let Some(f) = self.flows.get_mut(&flow).map(|s| s.own(copies)) else {
            return;
        };
        f.trajectories += 1;
        let path: Vec<PointId> = t.iter().map(|o| o.point).collect();
        let first_time = t[0].time_ns;
        for (i, o) in t.iter().enumerate() {
            f.at.entry_or_default(o.point).class = Some((o.dscp, o.ecn, o.pcp));
            if let Some(n) = t.get(i + 1) {
                f.hops.insert((o.point, n.point), o.ttl.saturating_sub(n.ttl));
                if o.dscp != n.dscp {
                    f.marks_mut()
                        .changes
                        .entry_or_default((o.point, n.point, o.dscp, n.dscp))
                        .hit(n.time_ns);
                }
                if synced[i] && synced[i + 1] {
                    f.delays
                        .entry_or_default((o.point, n.point))
                        .add(n.time_ns as i64 - o.time_ns as i64);
                }
            }
            if o.ecn == 3 && (i == 0 || t[i - 1].ecn != 3) {
                let before = if i == 0 { None } else { Some(t[i - 1].point) };
                f.marks_mut()
                    .ce_onset
                    .entry_or_default((before, o.point))
                    .hit(o.time_ns);
            }
        }
        // Path: a strict prefix of the path in force when the packet was sent means it was
        // lost after its last point; anything else that differs is the flow moving.
        // (Trajectories complete in arrival order, so an older one can finish after the
        // flow has moved: it is judged against the path of its own time.)
        if f.path.is_empty() {
            f.path = path.into_boxed_slice();
            f.path_since_ns = first_time;
            if let Some(v) = &mut self.new_paths {
                v.push(flow);
            }
            return;
        }
        let then = {
            let mut paths = f.paths();
            let oldest = paths.next().expect("a path");
            let mut paths = std::iter::once(oldest).chain(paths);
            let found = paths.by_ref().rev().find(|(t, _)| *t <= first_time);
            found.unwrap_or(oldest).1
        };
        if path == then {
            return;
        }
        let then = then.to_vec();
        if path.len() < then.len() && then.starts_with(&path) {
            let last = *path.last().expect("non-empty");
            let next = then[path.len()];
            let last_time = t.last().map_or(first_time, |o| o.time_ns);
            let missing = Missing {
                id,
                a: last,
                b: next,
                first_ns: first_time,
                last_ns: last_time,
                frame_len: t.iter().map(|o| o.frame_len).max().unwrap_or(0),
                deadline_ns: self.now_ns + PROOF_PATIENCE_NS,
            };
            if self.proof_due(&missing) {
                // Inside `finish`, which counts the flow's anomalies once for both.
                let unseen = self.unseen_at(missing.b, missing.last_ns);
                self.judge_missing_in(missing, unseen);
            } else if self.awaiting.len() < self.cfg.max_pending {
                self.awaiting.push_back(missing);
            } else {
                self.stats.pending_dropped += 1;
            }
        } else if path.len() < then.len() && then.ends_with(&path) {
            // The tail of the path alone: observations that arrived after their packet's
            // trajectory was complete (a slow agent, a retransmission straddling the
            // timeout). Not a path; and if that packet was judged lost just where this
            // tail begins, it was not.
            self.stats.fragments += 1;
            if let Some(k) = self.awaiting.iter().position(|m| m.id == id && m.b == path[0]) {
                // Not judged yet, and now it never will be: it arrived.
                self.awaiting.remove(k);
                self.stats.late_arrivals += 1;
            } else if let Some((a, b)) = self.recent_losses.remove(&id)
                && b == path[0]
                && let Some(marks) = f.marks.as_deref_mut()
                && let Some(span) = marks.lost.get_mut(&(a, b))
            {
                self.stats.late_arrivals += 1;
                if let Some(n) = self.lost_between.get_mut(&(a, b)) {
                    *n = n.saturating_sub(1);
                }
                span.packets -= 1;
                if span.packets == 0 {
                    marks.lost.remove(&(a, b));
                }
            }
        } else if first_time >= f.path_since_ns {
            let was = (
                f.path_since_ns,
                std::mem::replace(&mut f.path, path.into_boxed_slice()),
            );
            f.path_since_ns = first_time;
            let history = &mut f.marks_mut().history;
            if history.len() == PATH_HISTORY {
                history.remove(0);
            }
            push_tight(history, was);
        }
    }

    /// The agent of `point`'s node has delivered every observation it made up to `t_ns`
    /// (its clock), of every flow: a HEALTH interval's end says so where it comes in
    /// order with them (one TCP connection), not where it may overtake them (fleet
    /// mode's separate subject). Trajectories lacking that node wait for it, or for a
    /// later observation of their own flow there ([`JoinConfig::max_agent_lag_ns`]).
    pub fn reported_to(&mut self, point: PointId, t_ns: u64) {
        let Some(&node) = self.topo.point_node.get(point as usize) else {
            return;
        };
        let node = node as usize;
        if self.reported_to_ns.len() <= node {
            self.reported_to_ns.resize(node + 1, 0);
        }
        let to = &mut self.reported_to_ns[node];
        *to = (*to).max(t_ns);
    }

    /// One point's health over one agent interval.
    pub fn add_health(&mut self, point: PointId, h: &PointHealth) {
        let q = Arc::make_mut(self.health.entry(point).or_default());
        push_bounded(q, *h, HEALTH_INTERVALS);
    }

    /// Why a packet last seen at `t` (by its previous point) and never at `b` proves
    /// nothing, or `None` when `b`'s agent reported clean intervals covering
    /// [t, t + PROOF_WINDOW_NS]: then it would have seen the packet.
    fn unseen_at(&self, b: PointId, t: u64) -> Option<Unseen> {
        let (lo, hi) = (t, t.saturating_add(PROOF_WINDOW_NS));
        let Some(h) = self.health.get(&b) else {
            return Some(Unseen::NoReport);
        };
        let mut over: Vec<&PointHealth> = h.iter().filter(|x| x.end_ns >= lo && x.start_ns <= hi).collect();
        over.sort_by_key(|x| x.start_ns);
        if over.iter().any(|x| x.samples_lost() > 0) {
            return Some(Unseen::SamplesLost);
        }
        // Covered without a gap: each interval starts where the one before ended.
        let mut reach = lo;
        for x in &over {
            if x.start_ns > reach {
                break;
            }
            reach = reach.max(x.end_ns);
        }
        (reach < hi).then_some(Unseen::NoReport)
    }

    /// Whether the health that decides a missing packet is in: the next point's agent has
    /// reported past the proof window, or waiting is over (its patience, or the
    /// collector stopping).
    fn proof_due(&self, m: &Missing) -> bool {
        let hi = m.last_ns.saturating_add(PROOF_WINDOW_NS);
        self.flushed
            || self.now_ns >= m.deadline_ns
            || self
                .health
                .get(&m.b)
                .is_some_and(|h| h.iter().any(|x| x.end_ns >= hi))
    }

    /// A sampled packet seen at `a` and not at `b`: lost, when `b`'s agent would have
    /// reported it; else unobserved, with the reason.
    fn judge_missing(&mut self, m: Missing) {
        let unseen = self.unseen_at(m.b, m.last_ns);
        let before = self.tally_of(&m.id.flow);
        self.judge_missing_in(m, unseen);
        self.retally(&m.id.flow, before);
    }

    fn judge_missing_in(&mut self, m: Missing, unseen: Option<Unseen>) {
        let Some(f) = self.flow_mut(&m.id.flow) else {
            return;
        };
        if let Some(why) = unseen {
            f.marks_mut()
                .unseen
                .entry_or_default((m.a, m.b, why))
                .hit(m.first_ns);
            return;
        }
        let marks = f.marks_mut();
        marks.lost.entry_or_default((m.a, m.b)).hit(m.first_ns);
        let big = marks.lost_frames.entry_or_default((m.a, m.b));
        *big = (*big).max(m.frame_len);
        if self.lost_between.len() < MAX_LOST_HOPS || self.lost_between.contains_key(&(m.a, m.b)) {
            *self.lost_between.entry((m.a, m.b)).or_default() += 1;
        }
        if self.recent_losses.len() < self.cfg.max_pending {
            self.recent_losses.insert(m.id, (m.a, m.b));
            self.recent_order.push_back((self.now_ns, m.id));
        }
    }

    /// Judges the missing packets whose proof is due.
    fn judge_awaiting(&mut self) {
        let mut keep = VecDeque::with_capacity(self.awaiting.len());
        while let Some(m) = self.awaiting.pop_front() {
            if self.proof_due(&m) {
                self.judge_missing(m);
            } else {
                keep.push_back(m);
            }
        }
        self.awaiting = keep;
    }

    /// All flows as they are now, taken in time linear in the flows with no copy of
    /// any flow's state (build the reports from [`Snapshot::view`], after letting go of
    /// the join).
    pub fn snapshot(&self) -> Snapshot {
        Snapshot(self.view_of(self.flows.iter().map(|(id, s)| (*id, s.f.clone())).collect()))
    }

    /// The next `n` tracked flows after `after` (from the first when none), in label
    /// order, and a view holding what their reports need: them and every flow of their
    /// address pairs, both ways. A reader that goes through a large table this way, one
    /// chunk under the lock at a time, shares each flow with the join only while its
    /// chunk's reports are built, so the join seldom has to copy a flow it changes (a
    /// snapshot of the whole table makes it copy every flow it touches until the last
    /// report is built). Each flow's report is as of its chunk, not of one moment for all.
    /// The snapshot is made a view ([`Snapshot::view`]) outside the lock.
    pub fn chunk_view(&self, after: Option<&FlowId>, n: usize) -> (Vec<FlowId>, Snapshot) {
        use std::ops::Bound::{Excluded, Unbounded};
        let from = after.map_or(Unbounded, Excluded);
        let ids: Vec<FlowId> = self.ids.range((from, Unbounded)).take(n).copied().collect();
        let pairs: BTreeSet<([u8; 16], [u8; 16])> = ids
            .iter()
            .flat_map(|id| [(id.src, id.dst), (id.dst, id.src)])
            .collect();
        let mut flows = Vec::with_capacity(ids.len());
        for (src, dst) in pairs {
            flows.extend(self.pair_ids(src, dst).map(|k| (*k, self.flows[k].f.clone())));
        }
        (ids, Snapshot(self.view_of(flows)))
    }

    /// The tracked flows from `src` to `dst`, from the label index.
    fn pair_ids(&self, src: [u8; 16], dst: [u8; 16]) -> impl Iterator<Item = &FlowId> {
        let lo = FlowId {
            src,
            dst,
            ip_version: 0,
            udp_sport: 0,
            dest_qp: 0,
        };
        let hi = FlowId {
            ip_version: u8::MAX,
            udp_sport: u16::MAX,
            dest_qp: u32::MAX,
            ..lo
        };
        self.ids.range(lo..=hi)
    }

    /// What one flow's report needs, in time proportional to that flow's own pairs: the
    /// flows between its two addresses, both ways (ACKs, NAKs and CNPs answer it there).
    pub fn flow_view(&self, id: &FlowId) -> Option<JoinView> {
        self.flows.get(id)?;
        let mut flows = Vec::new();
        for (src, dst) in [(id.src, id.dst), (id.dst, id.src)] {
            flows.extend(self.pair_ids(src, dst).map(|k| (*k, self.flows[k].f.clone())));
        }
        Some(Snapshot(self.view_of(flows)).view())
    }

    fn view_of(&self, flows: Vec<(FlowId, Arc<FlowJoin>)>) -> JoinView {
        JoinView {
            cfg: self.cfg,
            now_ns: self.now_ns,
            flushed: self.flushed,
            topo: self.topo.clone(),
            health: self.health.clone(),
            host_of: self.host_of.clone(),
            flows,
            stats: self.stats,
        }
    }

    /// Everything the collector knows of one flow.
    pub fn flow_report(&self, id: &FlowId) -> Option<FlowReport> {
        self.flow_view(id)?.flow_report(id)
    }

    /// What is wrong, fabric-wide (every flow's report: see [`Joiner::anomaly_counts`]
    /// for the counts alone).
    pub fn anomalies(&self) -> Vec<Anomaly> {
        self.snapshot().view().anomalies()
    }

    /// How many anomalies [`Joiner::anomalies`] would list, by kind, without building a
    /// report: kept up to date as flows change.
    /// Sampled packets judged lost between consecutive points over the join's life, late
    /// arrivals taken back (the per-link losses `/metrics` shows).
    pub fn lost_between(&self) -> Vec<(Point, Point, u64)> {
        let point = |p: PointId| self.topo.points[p as usize].point();
        self.lost_between
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(&(a, b), &n)| (point(a), point(b), n))
            .collect()
    }

    pub fn anomaly_counts(&self) -> BTreeMap<AnomalyKind, u64> {
        Tally::KINDS
            .into_iter()
            .zip(self.tally.0)
            .filter(|(_, n)| *n > 0)
            .collect()
    }

    /// Tracked flows in label order.
    pub fn flow_ids(&self) -> Vec<FlowId> {
        self.ids.iter().copied().collect()
    }

    pub fn flow_count(&self) -> usize {
        self.flows.len()
    }

    /// A tracked flow by its label.
    pub fn find(&self, label: &str) -> Option<FlowId> {
        let id: FlowId = label.parse().ok()?;
        self.flows.contains_key(&id).then_some(id)
    }

    /// Where to trace a flow from: the node of its first point, and the class it left with.
    pub fn trace_target(&self, id: &FlowId) -> Option<(String, u8, u8)> {
        let f = &self.flows.get(id)?.f;
        let first = *f.path.first()?;
        let (dscp, ecn, _) = f.at.get(&first)?.class?;
        Some((self.topo.points[first as usize].node.clone(), dscp, ecn))
    }

    /// Forgets every flow `drop` picks, with its packets waiting to be joined (a group
    /// member that lost the flows' partition: if it gains it again, it replays it from the
    /// start). How many flows went.
    pub fn forget_where(&mut self, drop: impl Fn(&FlowId) -> bool) -> usize {
        let gone: Vec<FlowId> = self.flows.keys().filter(|id| drop(id)).copied().collect();
        for id in &gone {
            if let Some(s) = self.flows.get(id) {
                s.f.share.give_back(&mut self.stats);
            }
            self.forget(id);
        }
        self.pending.retain(|id, _| !drop(&id.flow));
        self.awaiting.retain(|m| !drop(&m.id.flow));
        self.recent_losses.retain(|id, _| !drop(&id.flow));
        self.stats.flows = self.flows.len() as u64;
        self.stats.pending = self.pending.len() as u64;
        gone.len()
    }

    /// From now on, note each flow that gets its first path ([`Joiner::take_new_paths`]).
    pub fn note_new_paths(&mut self) {
        self.new_paths.get_or_insert_with(Vec::new);
    }

    /// The flows that got their first path since the last call.
    pub fn take_new_paths(&mut self) -> Vec<FlowId> {
        self.new_paths.as_mut().map(std::mem::take).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use roce_trace_common::datapath::{Counts, REASON_CE, REASON_CNP, REASON_HASH};

    use super::*;

    #[test]
    fn anomaly_kinds_order_as_their_names() {
        let kinds = [
            AnomalyKind::PathChange,
            AnomalyKind::Lost,
            AnomalyKind::ClassChange,
            AnomalyKind::CeOnset,
        ];
        let mut by_kind = kinds;
        by_kind.sort();
        let mut by_name = kinds;
        by_name.sort_by_key(|k| k.name());
        assert_eq!(by_kind, by_name, "metrics list kinds in this order");
    }

    #[test]
    fn points_read_back_from_the_right_so_ipv6_switches_stay_whole() {
        let p: Point = "h1:eth0:egress".parse().unwrap();
        assert_eq!(p, Point::new("h1", "eth0", Direction::Egress));
        let m: Point = "2001:db8::7:erspan-5:mirror".parse().unwrap();
        assert_eq!(m, Point::new("2001:db8::7", "erspan-5", Direction::Mirror));
        assert_eq!(m.to_string(), "2001:db8::7:erspan-5:mirror");
        // A node alone (no watched point), an IPv6 one too, reads back as itself.
        for n in ["nolabel", "2001:db8::7", "a:b:c"] {
            let p: Point = n.parse().unwrap();
            assert_eq!((p.node.as_str(), p.direction), (n, None), "{n}");
            assert_eq!(p.to_string(), n);
        }
        let path = [
            "h1:eth0:egress",
            "l1:h1:ingress",
            "l1:s1:egress",
            "2001:db8::7:erspan-5:mirror",
        ]
        .map(|l| l.parse::<Point>().unwrap());
        assert_eq!(path_nodes(&path), vec!["h1", "l1", "2001:db8::7"]);
        // Ordered as their text: maps keyed by points serialise as before they were typed.
        let mut by_type = vec!["a-b:x:ingress", "a:x:egress", "a:x-1:egress", "a:x:ingress", "a"]
            .into_iter()
            .map(|l| l.parse::<Point>().unwrap())
            .collect::<Vec<_>>();
        by_type.sort();
        let mut by_text: Vec<String> = by_type.iter().map(Point::to_string).collect();
        let sorted = by_text.clone();
        by_text.sort();
        assert_eq!(sorted, by_text);
    }

    const MS: u64 = 1_000_000;

    /// A 5-point lab path for flow A→B: h1 egress, l1 in, s1 in, l2 in, h3 in.
    fn lab() -> (Joiner, Vec<PointId>) {
        let (mut j, pts) = lab_without_health();
        // Every agent reports clean health for the first 100 s: what it missed, it was
        // never sent.
        for p in pts {
            clean(&mut j, p, 0, 100_000 * MS);
        }
        (j, pts.to_vec())
    }

    /// The same path, no health reported yet.
    fn lab_without_health() -> (Joiner, [PointId; 5]) {
        let mut j = Joiner::new(JoinConfig {
            trajectory_timeout_ns: 100 * MS,
            ..Default::default()
        });
        let pts = [
            ("h1", "eth0", "egress"),
            ("l1", "h1", "ingress"),
            ("s1", "l1", "ingress"),
            ("l2", "s1", "ingress"),
            ("h3", "eth0", "ingress"),
        ]
        .map(|(n, i, d)| {
            j.point(PointInfo {
                node: n.into(),
                iface: i.into(),
                direction: d.parse().unwrap(),
                clock_synced: true,
                ..Default::default()
            })
        });
        (j, pts)
    }

    /// A clean health interval of `p` over [from, to], in order with the observations
    /// (as on TCP): `p`'s agent has reported everything up to `to`.
    fn clean(j: &mut Joiner, p: PointId, from: u64, to: u64) {
        j.add_health(
            p,
            &PointHealth {
                start_ns: from,
                end_ns: to,
                ..Default::default()
            },
        );
        j.reported_to(p, to);
    }

    /// The lab path through s2 instead of s1.
    fn via_s2(j: &mut Joiner, pts: &[PointId]) -> Vec<PointId> {
        let mut s2 = pts.to_vec();
        s2[2] = j.point(PointInfo {
            node: "s2".into(),
            iface: "l1".into(),
            direction: Direction::Ingress,
            clock_synced: true,
            ..Default::default()
        });
        s2[3] = j.point(PointInfo {
            node: "l2".into(),
            iface: "s2".into(),
            direction: Direction::Ingress,
            clock_synced: true,
            ..Default::default()
        });
        clean(j, s2[2], 0, 100_000 * MS);
        clean(j, s2[3], 0, 100_000 * MS);
        s2
    }

    fn flow() -> FlowId {
        FlowId {
            src: [1; 16],
            dst: [3; 16],
            ip_version: 4,
            udp_sport: 49152,
            dest_qp: 0x101,
        }
    }

    fn obs(psn: u32, ttl: u8, t: u64, dscp: u8, ecn: u8) -> Observation {
        Observation {
            point: 0,
            time_ns: t,
            id: PacketId {
                flow: flow(),
                psn,
                opcode: 7,
                icrc: [psn as u8, 1, 2, 3],
            },
            udp_dport: 4791,
            dscp,
            ecn,
            ttl,
            reasons: REASON_HASH as u8,
            ..Default::default()
        }
    }

    /// The TTL each of the 5 points sees (egress and first ingress before any hop).
    const TTLS: [u8; 5] = [64, 64, 63, 62, 61];

    fn send(
        j: &mut Joiner,
        pts: &[PointId],
        psn: u32,
        at: u64,
        skip: &[usize],
        dscp_at: impl Fn(usize) -> u8,
        arrival: u64,
    ) {
        for (i, p) in pts.iter().enumerate() {
            if !skip.contains(&i) {
                j.add(
                    *p,
                    &obs(psn, TTLS[i], at + 1000 * i as u64, dscp_at(i), 2),
                    arrival,
                );
            }
        }
    }

    #[test]
    fn out_of_order_arrival_still_orders_by_ttl() {
        let (mut j, pts) = lab();
        // Points report in reverse, the downstream agent first.
        for (i, p) in pts.iter().enumerate().rev() {
            j.add(*p, &obs(1, TTLS[i], 1000 * i as u64, 26, 2), 0);
        }
        j.tick(200 * MS);
        let r = j.flow_report(&flow()).unwrap();
        assert_eq!(
            r.path,
            [
                "h1:eth0:egress",
                "l1:h1:ingress",
                "s1:l1:ingress",
                "l2:s1:ingress",
                "h3:eth0:ingress"
            ]
        );
        assert_eq!(r.hops, [0, 1, 1, 1]);
        assert_eq!(j.stats.trajectories, 1);
    }

    #[test]
    fn delivery_over_time_is_kept_at_the_most_downstream_point() {
        let (mut j, pts) = lab();
        // The agents count each delta over [t-1, t] s on their own clocks; it reaches the
        // collector 7 ms later.
        let delta = |p: usize, bytes: u64| CounterDelta {
            flow: flow(),
            start_ns: (bytes / 1000 - 1) * 1000 * MS,
            end_ns: bytes / 1000 * 1000 * MS,
            counts: Counts {
                packets: bytes / 1000,
                bytes,
                ..Default::default()
            },
            last_ttl: TTLS[p],
            ..Default::default()
        };
        // No trajectory yet: the counters' TTLs say which point is furthest. The sender's
        // delta comes first, then the receiver's takes over (lower TTL) for good.
        for (t, p) in [(1, 0), (1, 4), (1, 3), (2, 0), (2, 4), (3, 4)] {
            j.add_counters(pts[p], &delta(p, 1000 * t), t * 1_000 * MS + 7 * MS);
        }
        let r = j.flow_report(&flow()).unwrap();
        let d: Vec<(u64, u64, u64)> = r
            .delivery
            .iter()
            .map(|d| (d.start_ns / MS, d.end_ns / MS, d.bytes))
            .collect();
        assert_eq!(d, [(0, 1000, 1000), (1000, 2000, 2000), (2000, 3000, 3000)]);
    }

    #[test]
    fn clock_skew_does_not_reorder_a_trajectory() {
        let (mut j, pts) = lab();
        // s1's clock runs 5 ms behind: its time is earlier than h1's, TTL still orders it.
        for (i, p) in pts.iter().enumerate() {
            let t = if i == 2 {
                10 * MS - 5 * MS
            } else {
                10 * MS + 1000 * i as u64
            };
            j.add(*p, &obs(1, TTLS[i], t, 26, 2), 0);
        }
        j.tick(200 * MS);
        let r = j.flow_report(&flow()).unwrap();
        assert_eq!(r.path[2], "s1:l1:ingress");
        let skewed = r.delays.iter().find(|d| d.between[1] == "s1:l1:ingress").unwrap();
        assert!(
            skewed.delay.min_ns < 0,
            "the skew shows as a negative one-way delay"
        );
    }

    #[test]
    fn at_equal_ttl_a_links_egress_comes_before_the_far_ingress_whatever_the_clocks() {
        let (mut j, pts) = lab();
        // h1's egress and l1's ingress see TTL 64: coarse datapath clocks tie them, or
        // put l1's first; the link's egress end still comes first. Twice, in both orders
        // of arrival, so no tie is broken by luck.
        for (psn, (t0, t1)) in [(1u32, (10 * MS, 10 * MS)), (2, (20 * MS, 20 * MS - 100))] {
            for &i in &[1usize, 0, 2, 3, 4] {
                let t = match i {
                    0 => t0,
                    1 => t1,
                    _ => t0 + 1000 * i as u64,
                };
                j.add(pts[i], &obs(psn, TTLS[i], t, 26, 2), 0);
            }
        }
        // A bridge: its ingress and egress see the same TTL on one node; ingress first.
        let br_in = j.point(PointInfo {
            node: "br".into(),
            iface: "a".into(),
            direction: Direction::Ingress,
            clock_synced: true,
            ..Default::default()
        });
        let br_out = j.point(PointInfo {
            node: "br".into(),
            iface: "b".into(),
            direction: Direction::Egress,
            clock_synced: true,
            ..Default::default()
        });
        j.tick(200 * MS);
        let r = j.flow_report(&flow()).unwrap();
        assert_eq!(r.path[..2], ["h1:eth0:egress", "l1:h1:ingress"]);
        assert_eq!(r.path_history.len(), 1, "{:?}", r.path_history);
        let mut f2 = flow();
        f2.udp_sport = 1;
        for (p, t) in [(br_out, 5 * MS), (br_in, 5 * MS)] {
            let mut o = obs(1, 60, t, 26, 2);
            o.id.flow = f2;
            j.add(p, &o, 300 * MS);
        }
        j.tick(500 * MS);
        assert_eq!(j.flow_report(&f2).unwrap().path, ["br:a:ingress", "br:b:egress"]);
    }

    #[test]
    fn duplicates_are_dropped_and_retransmissions_are_new_trajectories() {
        let (mut j, pts) = lab();
        send(&mut j, &pts, 7, 0, &[], |_| 26, 0);
        send(&mut j, &pts, 7, 0, &[], |_| 26, 0); // the same reports again
        send(&mut j, &pts, 7, 50 * MS, &[], |_| 26, 0); // the same PSN sent again later
        j.tick(200 * MS);
        assert_eq!(j.stats.duplicates, 5);
        assert_eq!(j.stats.retransmissions, 1);
        assert_eq!(j.stats.trajectories, 2);
        assert!(j.flow_report(&flow()).unwrap().lost.is_empty());
    }

    #[test]
    fn a_queued_packet_overtaken_by_its_retransmission_is_neither_lost_nor_a_path() {
        let (mut j, pts) = lab();
        // The flow's path is known from earlier packets.
        send(&mut j, &pts, 1, 0, &[], |_| 26, 0);
        j.tick(200 * MS);
        // PSN 7 waits 300 ms in l2's queue to h3; meanwhile (go-back-N after a NAK for an
        // earlier gap) it is sent again, 10 ms later, and also queued: the original
        // arrives at h3 after the retransmission left h1.
        let at = 300 * MS;
        for (i, p) in pts.iter().enumerate().take(4) {
            j.add(*p, &obs(7, TTLS[i], at + 1000 * i as u64, 26, 2), at);
        }
        for (i, p) in pts.iter().enumerate().take(4) {
            j.add(*p, &obs(7, TTLS[i], at + 10 * MS + 1000 * i as u64, 26, 2), at);
        }
        j.add(pts[4], &obs(7, TTLS[4], at + 300 * MS, 26, 2), at);
        j.add(pts[4], &obs(7, TTLS[4], at + 310 * MS, 26, 2), at);
        j.tick(at + 1000 * MS);
        let r = j.flow_report(&flow()).unwrap();
        assert_eq!(r.path.len(), 5, "no one-point path: {:?}", r.path);
        assert_eq!(r.path_history.len(), 1, "{:?}", r.path_history);
        assert!(r.lost.is_empty(), "both copies arrived: {:?}", r.lost);
        assert_eq!(j.stats.retransmissions, 1);
        assert_eq!(j.stats.trajectories, 3);
    }

    #[test]
    fn observations_after_their_trajectory_completed_are_a_late_arrival_not_a_path() {
        let (mut j, pts) = lab();
        send(&mut j, &pts, 1, 0, &[], |_| 26, 0);
        j.tick(200 * MS);
        // PSN 2's h3 observation comes after the 100 ms trajectory timeout: first judged
        // lost between l2 and h3, then taken back when it arrives; the lone h3 point is
        // no path.
        send(&mut j, &pts, 2, 300 * MS, &[4], |_| 26, 300 * MS);
        j.tick(450 * MS);
        let r = j.flow_report(&flow()).unwrap();
        assert_eq!(r.lost.len(), 1, "judged lost at first");
        assert_eq!(j.lost_between().len(), 1);
        j.add(pts[4], &obs(2, TTLS[4], 300 * MS + 4000, 26, 2), 460 * MS);
        j.tick(600 * MS);
        assert!(j.lost_between().is_empty(), "taken back: {:?}", j.lost_between());
        let r = j.flow_report(&flow()).unwrap();
        assert_eq!(r.path.len(), 5, "{:?}", r.path);
        assert_eq!(r.path_history.len(), 1);
        assert!(r.lost.is_empty(), "{:?}", r.lost);
        assert_eq!((j.stats.fragments, j.stats.late_arrivals), (1, 1));
        // A tail that no loss waits for (its packet was never judged lost) is only a
        // fragment; a real loss stays.
        send(&mut j, &pts, 3, 700 * MS, &[3, 4], |_| 26, 700 * MS);
        j.tick(900 * MS);
        j.add(pts[4], &obs(9, TTLS[4], 950 * MS, 26, 2), 950 * MS);
        j.tick(1200 * MS);
        let r = j.flow_report(&flow()).unwrap();
        assert_eq!(r.lost.len(), 1);
        assert_eq!(r.lost[0].between, ["s1:l1:ingress", "l2:s1:ingress"]);
        assert_eq!((j.stats.fragments, j.stats.late_arrivals), (2, 1));
    }

    /// Fleet mode after a NATS outage: the agents of h1 and l1 deliver their backlog
    /// at once, those of s1, l2 and h3 seconds later (their health, on a subject of its
    /// own, says nothing of how far their observations have come). A trajectory judged
    /// on its time alone would be h1, l1 and nothing: a loss after l1, and the rewrite at
    /// s1 moved to wherever the path resumed. It waits for the lagging agents instead,
    /// and the flow reads as it was: one path, the rewrite between l1 and s1, no loss.
    #[test]
    fn a_lagging_agent_is_waited_for_not_taken_for_a_loss_or_a_class_change() {
        let (mut j, pts) = lab_without_health();
        let rewrite = |i: usize| if i >= 2 { 0 } else { 26 };
        // Ten packets delivered as they go: the flow's path is known.
        for psn in 0..10 {
            let at = psn as u64 * 10 * MS;
            send(&mut j, &pts, psn, at, &[], rewrite, at);
            j.tick(at);
        }
        // Ten more during the outage: h1 and l1 deliver at 300 ms …
        for psn in 10..20 {
            let at = psn as u64 * 10 * MS;
            send(&mut j, &pts, psn, at, &[2, 3, 4], rewrite, 300 * MS);
        }
        for t in [400, 1_000, 2_900] {
            j.tick(t * MS);
        }
        assert_eq!(j.stats.pending, 10, "waiting for s1, l2 and h3");
        // … s1, l2 and h3 at 3 s.
        for psn in 10..20 {
            let at = psn as u64 * 10 * MS;
            for i in 2..5 {
                j.add(
                    pts[i],
                    &obs(psn, TTLS[i], at + 1000 * i as u64, rewrite(i), 2),
                    3_000 * MS,
                );
            }
        }
        j.tick(3_050 * MS);
        assert_eq!(j.stats.pending, 0);
        let r = j.flow_report(&flow()).unwrap();
        assert!(
            r.lost.is_empty() && r.unobserved.is_empty(),
            "{:?} {:?}",
            r.lost,
            r.unobserved
        );
        assert_eq!(r.path_history.len(), 1, "one path");
        assert_eq!(r.class_changes.len(), 1, "{:?}", r.class_changes);
        assert_eq!(r.class_changes[0].between, ["l1:h1:ingress", "s1:l1:ingress"]);
        assert_eq!(r.class_changes[0].span.packets, 20);
        assert_eq!(r.trajectories, 20);
        assert_eq!((j.stats.fragments, j.stats.agent_lag_gave_up), (0, 0));
    }

    #[test]
    fn a_missing_downstream_observation_is_a_loss_between_two_points() {
        let (mut j, pts) = lab();
        for psn in 0..10 {
            // PSN 4 and 5 never reach l2 (so neither h3).
            let skip: &[usize] = if psn == 4 || psn == 5 { &[3, 4] } else { &[] };
            send(&mut j, &pts, psn, psn as u64 * MS, skip, |_| 26, psn as u64);
        }
        j.tick(500 * MS);
        let r = j.flow_report(&flow()).unwrap();
        assert_eq!(r.lost.len(), 1);
        assert_eq!(r.lost[0].between, ["s1:l1:ingress", "l2:s1:ingress"]);
        assert_eq!(r.lost[0].span.packets, 2);
        assert_eq!(r.path.len(), 5, "the path is not shortened by a loss");
        // The per-link tally /metrics shows: those two, on that hop alone.
        let tally: Vec<(String, String, u64)> = j
            .lost_between()
            .into_iter()
            .map(|(a, b, n)| (a.to_string(), b.to_string(), n))
            .collect();
        assert_eq!(
            tally,
            [("s1:l1:ingress".to_string(), "l2:s1:ingress".to_string(), 2)]
        );
    }

    /// The packet a point did not report is proof of loss only if that point's agent
    /// would have reported it: one that lost samples then (its ring buffer was full), or
    /// sent no health for that time, proves nothing.
    #[test]
    fn a_sample_missing_where_the_agent_could_not_report_it_is_unobserved_not_lost() {
        let (mut j, pts) = lab_without_health();
        for &p in &pts[..3] {
            clean(&mut j, p, 0, 100_000 * MS);
        }
        // l2's agent: clean for the first 20 ms, then its ring buffer overflowed for
        // 20 ms, then nothing for 60 ms (it was restarting), then clean again.
        clean(&mut j, pts[3], 0, 20 * MS);
        j.add_health(
            pts[3],
            &PointHealth {
                start_ns: 20 * MS,
                end_ns: 40 * MS,
                ringbuf_full: 12,
                ..Default::default()
            },
        );
        clean(&mut j, pts[3], 100 * MS, 100_000 * MS);
        clean(&mut j, pts[4], 0, 100_000 * MS);
        for psn in 0..300 {
            // Every 10th packet is not reported by l2 nor h3 from l2 on.
            let skip: &[usize] = if psn % 10 == 5 { &[3, 4] } else { &[] };
            send(&mut j, &pts, psn, psn as u64 * MS, skip, |_| 26, psn as u64);
        }
        j.tick(1_000 * MS);
        let r = j.flow_report(&flow()).unwrap();
        // PSN 5 (at 5 ms: its window [5, 105] ms reaches into the overflow): unobserved;
        // 15, 25, 35: the overflow; 45 .. 95: no report covers them; from 105 on, lost.
        let between = ["s1:l1:ingress", "l2:s1:ingress"].map(|l| l.parse::<Point>().unwrap());
        assert_eq!(r.lost.len(), 1, "{:?}", r.lost);
        assert_eq!(r.lost[0].between, between);
        assert_eq!(r.lost[0].span.packets, 20, "PSN 105, 115, … 295");
        let unseen: Vec<(Unseen, u64)> = r.unobserved.iter().map(|u| (u.why, u.span.packets)).collect();
        assert!(r.unobserved.iter().all(|u| u.between == between));
        assert_eq!(unseen, [(Unseen::NoReport, 6), (Unseen::SamplesLost, 4)]);
    }

    /// A retransmission completes its trajectory moments after it was sent, before the
    /// next point's agent has reported that second: the verdict waits for its report
    /// (and, when none comes, says so after a while).
    #[test]
    fn a_missing_packet_waits_for_the_health_that_decides_it() {
        let mut j = Joiner::new(JoinConfig {
            trajectory_timeout_ns: 100 * MS,
            ..Default::default()
        });
        let pts: Vec<PointId> = [
            ("l1", "h1", "ingress"),
            ("s1", "l1", "ingress"),
            ("l2", "s1", "ingress"),
        ]
        .map(|(n, i, d)| {
            j.point(PointInfo {
                node: n.into(),
                iface: i.into(),
                direction: d.parse().unwrap(),
                clock_synced: true,
                ..Default::default()
            })
        })
        .to_vec();
        for &p in &pts {
            clean(&mut j, p, 0, 1_000 * MS);
        }
        let ttls = [64, 63, 62];
        for psn in 0..4u32 {
            for (i, &p) in pts.iter().enumerate() {
                // PSN 1 (at 900 ms) and PSN 3 (at 3 s) never reach l2.
                if (psn == 1 || psn == 3) && i == 2 {
                    continue;
                }
                let at = [100, 900, 950, 3_000][psn as usize] * MS + i as u64 * 1000;
                j.add(p, &obs(psn, ttls[i], at, 26, 2), at);
            }
        }
        j.tick(1_200 * MS);
        let r = j.flow_report(&flow()).unwrap();
        assert_eq!(
            (r.lost.len(), r.unobserved.len()),
            (0, 0),
            "waiting for l2's next report"
        );
        clean(&mut j, pts[2], 1_000 * MS, 2_000 * MS);
        j.tick(1_300 * MS);
        let r = j.flow_report(&flow()).unwrap();
        assert_eq!(r.lost.len(), 1);
        assert_eq!(r.lost[0].span.packets, 1, "PSN 1, proven by l2's next interval");
        // PSN 3: l2's agent never reports that time. Its trajectory waits for l2 to catch
        // up (`max_agent_lag`, 10 s), then is judged without it: l2 is missing, and five
        // seconds on, with no health of l2 for that time, it is unobserved.
        j.tick(3_200 * MS);
        j.tick(8_300 * MS);
        assert_eq!(j.flow_report(&flow()).unwrap().unobserved.len(), 0);
        assert_eq!((j.stats.pending, j.stats.agent_lag_gave_up), (1, 0));
        j.tick(13_200 * MS);
        assert_eq!((j.stats.pending, j.stats.agent_lag_gave_up), (0, 1));
        j.tick(18_100 * MS);
        assert_eq!(j.flow_report(&flow()).unwrap().unobserved.len(), 0);
        j.tick(18_300 * MS);
        let r = j.flow_report(&flow()).unwrap();
        assert_eq!(r.unobserved.len(), 1);
        assert_eq!(
            (r.unobserved[0].why, r.unobserved[0].span.packets),
            (Unseen::NoReport, 1)
        );
        assert_eq!(r.lost[0].span.packets, 1);
    }

    #[test]
    fn a_loss_quotes_the_kernel_drop_counters_at_both_ends_of_the_link() {
        let (mut j, pts) = lab();
        let s1_out = j.point(PointInfo {
            node: "s1".into(),
            iface: "l2".into(),
            direction: Direction::Egress,
            clock_synced: true,
            ..Default::default()
        });
        // The path h1 → l1 → s1 (in) → s1 (out) → l2 → h3; s1's port to l2 dropped 2
        // packets in the second second, l2's port from s1 none.
        j.add_health(
            s1_out,
            &PointHealth {
                start_ns: 1_000 * MS,
                end_ns: 2_000 * MS,
                if_tx_dropped: 2,
                qdisc_dropped: 1,
                ..Default::default()
            },
        );
        clean(&mut j, s1_out, 0, 1_000 * MS);
        clean(&mut j, s1_out, 2_000 * MS, 100_000 * MS);
        let path = [pts[0], pts[1], pts[2], s1_out, pts[3], pts[4]];
        let ttls = [64, 64, 63, 62, 62, 61];
        for psn in 0..10u32 {
            for (i, &p) in path.iter().enumerate() {
                if psn == 4 && i >= 4 {
                    continue;
                }
                let at = 1_100 * MS + psn as u64 * MS + i as u64 * 1000;
                j.add(p, &obs(psn, ttls[i], at, 26, 2), 0);
            }
        }
        j.tick(10_000 * MS);
        let r = j.flow_report(&flow()).unwrap();
        assert_eq!(r.lost.len(), 1);
        assert_eq!(r.lost[0].between, ["s1:l2:egress", "l2:s1:ingress"]);
        let quoted: Vec<(String, &str, u64)> = r.lost[0]
            .kernel_drops
            .iter()
            .map(|d| (d.point.to_string(), d.counter.as_str(), d.packets))
            .collect();
        assert_eq!(
            quoted,
            [
                ("s1:l2:egress".to_string(), "tx_dropped", 2),
                ("s1:l2:egress".to_string(), "qdisc_dropped", 1),
                ("l2:s1:ingress".to_string(), "rx_dropped", 0)
            ]
        );
    }

    #[test]
    fn a_class_change_is_located_between_the_last_old_and_first_new_point() {
        let (mut j, pts) = lab();
        for psn in 0..3 {
            send(
                &mut j,
                &pts,
                psn,
                psn as u64 * MS,
                &[],
                |i| if i >= 3 { 0 } else { 26 },
                0,
            );
        }
        j.tick(500 * MS);
        let r = j.flow_report(&flow()).unwrap();
        assert_eq!(r.class_changes.len(), 1);
        let c = &r.class_changes[0];
        assert_eq!(c.between, ["s1:l1:ingress", "l2:s1:ingress"]);
        assert_eq!((c.from_dscp, c.to_dscp, c.span.packets), (26, 0, 3));
        assert_eq!(
            r.class.iter().map(|c| c.dscp).collect::<Vec<_>>(),
            [26, 26, 26, 0, 0]
        );
        let a = j.anomalies();
        assert!(
            a.iter()
                .any(|a| a.kind == AnomalyKind::ClassChange && a.detail == "DSCP 26 -> 0")
        );
    }

    #[test]
    fn a_class_seen_for_a_while_is_kept_though_the_point_shows_another_at_the_end() {
        let (mut j, pts) = lab();
        for psn in 0..30u32 {
            let rewritten = (10..20).contains(&psn);
            send(
                &mut j,
                &pts,
                psn,
                psn as u64 * MS,
                &[],
                |i| if rewritten && i >= 3 { 0 } else { 26 },
                0,
            );
        }
        j.tick(500 * MS);
        let r = j.flow_report(&flow()).unwrap();
        assert!(
            r.class.iter().all(|c| c.dscp == 26),
            "the end shows 26 everywhere"
        );
        let zero: Vec<(String, u64, u64, u64)> = r
            .class_seen
            .iter()
            .filter(|c| c.dscp == 0)
            .map(|c| {
                (
                    c.point.to_string(),
                    c.span.packets,
                    c.span.first_ns,
                    c.span.last_ns,
                )
            })
            .collect();
        assert_eq!(
            zero,
            [
                ("l2:s1:ingress".to_string(), 10, 10 * MS + 3000, 19 * MS + 3000),
                ("h3:eth0:ingress".to_string(), 10, 10 * MS + 4000, 19 * MS + 4000)
            ]
        );
    }

    #[test]
    fn ce_onset_and_path_change() {
        let (mut j, pts) = lab();
        let s2 = via_s2(&mut j, &pts);
        // Through s1, CE-marked from l2 on; later the flow moves to s2.
        for psn in 0..4 {
            for (i, p) in pts.iter().enumerate() {
                j.add(
                    *p,
                    &obs(
                        psn,
                        TTLS[i],
                        psn as u64 * MS + i as u64,
                        26,
                        if i >= 3 { 3 } else { 2 },
                    ),
                    0,
                );
            }
        }
        for psn in 4..8 {
            send(&mut j, &s2, psn, 100 * MS + psn as u64 * MS, &[], |_| 26, 0);
        }
        j.tick(500 * MS);
        let r = j.flow_report(&flow()).unwrap();
        assert_eq!(r.ce_onset.len(), 1);
        assert_eq!(
            r.ce_onset[0].after.as_ref().map(Point::to_string).as_deref(),
            Some("s1:l1:ingress")
        );
        assert_eq!(r.ce_onset[0].at, "l2:s1:ingress");
        assert_eq!(r.path_history.len(), 2);
        assert_eq!(r.path[2], "s2:l1:ingress");
        assert!(r.lost.is_empty(), "a move is not a loss");
    }

    /// A flow that keeps moving (ECMP flapping between two spines) keeps its latest
    /// moves, oldest first, each with when it began, and its path is the latest; a
    /// healthy flow's rarer state is never made (a flow that never moved, lost or saw
    /// CE pays nothing for it).
    #[test]
    fn a_flapping_flow_keeps_its_latest_moves_and_a_healthy_one_no_marks() {
        let (mut j, pts) = lab();
        let s2 = via_s2(&mut j, &pts);
        for psn in 0..3 {
            send(&mut j, &pts, psn, psn as u64 * MS, &[], |_| 26, 0);
        }
        j.tick(200 * MS);
        let f = j.flows.get(&flow()).unwrap();
        assert!(f.f.marks.is_none(), "a healthy flow makes no marks");
        assert_eq!(j.flow_report(&flow()).unwrap().path_history.len(), 1);
        // 100 moves, 10 ms apart, one packet each.
        let moves = 100u32;
        for k in 0..moves {
            let path = if k % 2 == 0 { &s2 } else { &pts };
            let t = (300 + 10 * u64::from(k)) * MS;
            send(&mut j, path, 10 + k, t, &[], |_| 26, t);
            j.tick(t + 150 * MS);
        }
        let r = j.flow_report(&flow()).unwrap();
        assert_eq!(
            r.path_history.len(),
            PATH_HISTORY + 1,
            "the bound, and the path now"
        );
        let since: Vec<u64> = r.path_history.iter().map(|p| p.since_ns).collect();
        assert!(since.windows(2).all(|w| w[0] < w[1]), "oldest first: {since:?}");
        let last = r.path_history.last().unwrap();
        assert_eq!(last.since_ns, (300 + 10 * u64::from(moves - 1)) * MS);
        assert_eq!(last.path, r.path, "the latest entry is the path in force");
        assert_eq!(r.path[2], "s1:l1:ingress", "the 100th move went back through s1");
        assert!(r.lost.is_empty(), "moving is not losing: {:?}", r.lost);
    }

    /// After a burst the join gives its waiting tables back at the next tick, and says so
    /// (the collector then hands the freed memory to the system).
    #[test]
    fn a_burst_once_joined_is_given_back() {
        let (mut j, pts) = lab();
        j.tick(0);
        assert_eq!(j.gave_back(), 0);
        for psn in 0..20_000u32 {
            send(&mut j, &pts, psn, u64::from(psn) * 1000, &[], |_| 26, 0);
        }
        j.tick(1);
        assert_eq!(j.gave_back(), 0, "nothing given back while the burst waits");
        j.tick(10_000 * MS);
        assert_eq!(j.stats.pending, 0);
        assert_eq!(j.gave_back(), 1, "the tables of 20,000 identities given back");
        j.tick(20_000 * MS);
        assert_eq!(j.gave_back(), 1, "once");
    }

    #[test]
    fn losses_before_a_move_count_even_when_they_complete_after_it() {
        let (mut j, pts) = lab();
        let s2 = via_s2(&mut j, &pts);
        // Through s1 first; PSN 3 and 4 stop at s1 (a dead link); then through s2.
        for psn in 0..3 {
            send(&mut j, &pts, psn, psn as u64 * MS, &[], |_| 26, 0);
        }
        j.tick(200 * MS);
        // The flow's new path arrives and completes first...
        for psn in 5..8 {
            send(&mut j, &s2, psn, psn as u64 * MS, &[], |_| 26, 210 * MS);
        }
        j.tick(400 * MS);
        // ...then the blackholed packets, sent before the move, complete.
        for psn in 3..5 {
            send(&mut j, &pts, psn, psn as u64 * MS, &[3, 4], |_| 26, 410 * MS);
        }
        j.tick(600 * MS);
        let r = j.flow_report(&flow()).unwrap();
        assert_eq!(r.path_history.len(), 2);
        assert_eq!(r.path[2], "s2:l1:ingress");
        assert_eq!(r.lost.len(), 1, "{:?}", r.lost);
        assert_eq!(r.lost[0].between, ["s1:l1:ingress", "l2:s1:ingress"]);
        assert_eq!(r.lost[0].span.packets, 2);
    }

    #[test]
    fn psn_wrap_around_makes_distinct_identities() {
        let (mut j, pts) = lab();
        for psn in [0xff_fffe, 0xff_ffff, 0, 1] {
            send(&mut j, &pts, psn, 0, &[], |_| 26, 0);
        }
        j.tick(500 * MS);
        assert_eq!(j.stats.trajectories, 4);
        assert_eq!(j.stats.retransmissions, 0);
    }

    #[test]
    fn cnps_are_charged_to_the_flow_they_throttle() {
        let (mut j, pts) = lab();
        let h3_out = j.point(PointInfo {
            node: "h3".into(),
            iface: "eth0".into(),
            direction: Direction::Egress,
            clock_synced: true,
            ..Default::default()
        });
        // Data A→B: two CE-marked packets arrive at h3 at 10 ms and 20 ms.
        for (k, t) in [10 * MS, 20 * MS].into_iter().enumerate() {
            let mut o = obs(100 + k as u32, 61, t, 26, 3);
            o.reasons = REASON_CE as u8;
            j.add(pts[4], &o, 0);
        }
        j.add_counters(
            pts[4],
            &CounterDelta {
                flow: flow(),
                counts: Counts {
                    packets: 50,
                    ecn: [0, 0, 48, 2],
                    ..Default::default()
                },
                ..Default::default()
            },
            0,
        );
        // B's ACKs and CNPs to A's QP 0x100; the CNPs leave h3 30 µs after each mark.
        let rev = |sport: u16| FlowId {
            src: [3; 16],
            dst: [1; 16],
            ip_version: 4,
            udp_sport: sport,
            dest_qp: 0x100,
        };
        let ack = Observation {
            id: PacketId {
                flow: rev(4791),
                psn: 100,
                opcode: 0x11,
                icrc: [0; 4],
            },
            ..obs(0, 64, 21 * MS, 26, 2)
        };
        j.add(h3_out, &ack, 0);
        for t in [10 * MS + 30_000, 20 * MS + 30_000] {
            let mut c = Observation {
                id: PacketId {
                    flow: rev(40000),
                    psn: 0,
                    opcode: 0x81,
                    icrc: [0; 4],
                },
                ..obs(0, 64, t, 48, 2)
            };
            c.reasons = REASON_CNP as u8;
            j.add(h3_out, &c, 0);
        }
        j.add_counters(
            h3_out,
            &CounterDelta {
                flow: rev(40000),
                counts: Counts {
                    packets: 2,
                    cnp: 2,
                    ..Default::default()
                },
                ..Default::default()
            },
            0,
        );
        j.tick(500 * MS);
        let r = j.flow_report(&flow()).unwrap();
        assert_eq!(r.answered_by.flows, [rev(40000).to_string()]);
        assert_eq!((r.answered_by.cnps, r.answered_by.ce_marks), (2, 2));
        assert_eq!(r.answered_by.cnps_per_ce_mark, Some(1.0));
        let d = r.answered_by.ce_to_cnp.unwrap();
        assert_eq!((d.min_ns, d.max_ns, d.n), (30_000, 30_000, 2));
    }

    /// The CNP path back from h3 to h1 (h3's egress first) and the data flow's source
    /// host known from its counters at h1's egress.
    fn cnp_lab() -> (Joiner, Vec<PointId>, FlowId) {
        let mut j = Joiner::new(JoinConfig::default());
        let back = [
            ("h3", "eth0", "egress"),
            ("l2", "h3", "ingress"),
            ("l2", "s1", "egress"),
            ("s1", "l2", "ingress"),
            ("s1", "l1", "egress"),
            ("l1", "s1", "ingress"),
            ("l1", "h1", "egress"),
            ("h1", "eth0", "ingress"),
        ]
        .map(|(n, i, d)| {
            j.point(PointInfo {
                node: n.into(),
                iface: i.into(),
                direction: d.parse().unwrap(),
                clock_synced: true,
                ..Default::default()
            })
        });
        let h1_out = j.point(PointInfo {
            node: "h1".into(),
            iface: "eth0".into(),
            direction: Direction::Egress,
            clock_synced: true,
            ..Default::default()
        });
        j.add_counters(
            h1_out,
            &CounterDelta {
                flow: flow(),
                counts: Counts {
                    packets: 1000,
                    ecn: [0, 0, 800, 200],
                    ..Default::default()
                },
                last_ttl: 64,
                ..Default::default()
            },
            0,
        );
        let cnp_flow = FlowId {
            src: [3; 16],
            dst: [1; 16],
            ip_version: 4,
            udp_sport: 4791,
            dest_qp: 0x101,
        };
        (j, back.to_vec(), cnp_flow)
    }

    /// `n` CNPs counted at each of `pts` (TTLs as routers decrement them), at `at`.
    fn cnps_at(j: &mut Joiner, flow: FlowId, pts: &[PointId], n: &[u64], at: u64) {
        let ttls = [64, 64, 63, 63, 62, 62, 61, 61];
        for (k, (&p, &c)) in pts.iter().zip(n).enumerate() {
            if c > 0 {
                j.add_counters(
                    p,
                    &CounterDelta {
                        flow,
                        counts: Counts {
                            packets: c,
                            cnp: c,
                            ..Default::default()
                        },
                        last_ttl: ttls[k],
                        ..Default::default()
                    },
                    at,
                );
            }
        }
    }

    #[test]
    fn cnps_dropped_inside_a_leaf_never_reach_the_sender_and_the_leaf_is_named() {
        let (mut j, back, cnp) = cnp_lab();
        // Every CNP enters l1 from s1 and none leaves toward h1.
        cnps_at(
            &mut j,
            cnp,
            &back,
            &[870, 870, 870, 870, 870, 870, 0, 0],
            1_000 * MS,
        );
        j.tick(10_000 * MS);
        let d = j.flow_report(&cnp).unwrap().cnp_delivery.unwrap();
        assert_eq!((d.sent, d.reached), (870, Some(0)));
        assert_eq!(d.sent_at, "h3:eth0:egress");
        assert_eq!(
            d.lost,
            [CountedLoss {
                between: ["l1:s1:ingress".into(), "h1:eth0:ingress".into()],
                packets: 870,
            }]
        );
        let a = j.flow_report(&flow()).unwrap().answered_by;
        assert_eq!((a.cnps_sent, a.cnps, a.ce_marks), (870, 0, 200));
        assert_eq!(a.cnps_lost, d.lost);
    }

    #[test]
    fn cnps_count_where_they_reach_the_sender_and_a_few_lost_on_a_link_are_located() {
        let (mut j, back, cnp) = cnp_lab();
        cnps_at(
            &mut j,
            cnp,
            &back,
            &[500, 500, 500, 500, 500, 497, 497, 497],
            1_000 * MS,
        );
        j.tick(10_000 * MS);
        let r = j.flow_report(&cnp).unwrap();
        assert_eq!(r.path.first().unwrap(), "h3:eth0:egress");
        assert_eq!(r.path.last().unwrap(), "h1:eth0:ingress");
        assert_eq!(
            r.path.len(),
            8,
            "the CNP flow's path, from its counters: {:?}",
            r.path
        );
        let d = r.cnp_delivery.unwrap();
        assert_eq!((d.sent, d.reached), (500, Some(497)));
        assert_eq!(
            d.reached_at.as_ref().map(Point::to_string).as_deref(),
            Some("h1:eth0:ingress")
        );
        assert_eq!(
            d.lost,
            [CountedLoss {
                between: ["s1:l1:egress".into(), "l1:s1:ingress".into()],
                packets: 3,
            }]
        );
        assert_eq!(j.flow_report(&flow()).unwrap().answered_by.cnps, 497);
    }

    #[test]
    fn cnps_in_flight_between_two_reports_are_not_lost() {
        let (mut j, back, cnp) = cnp_lab();
        // Settled: all 100 arrived everywhere.
        cnps_at(&mut j, cnp, &back, &[100; 8], 1_000 * MS);
        // Just now, upstream agents have reported 40 more that the downstream agents
        // have not reported yet (their interval has not ended).
        cnps_at(&mut j, cnp, &back[..4], &[40; 4], 5_000 * MS);
        j.tick(5_500 * MS);
        let d = j.flow_report(&cnp).unwrap().cnp_delivery.unwrap();
        assert_eq!(d.lost, [], "in flight is not lost");
        assert_eq!((d.sent, d.reached), (140, Some(100)));
        // They never arrive: once the counts settle, they are lost where they stopped.
        j.tick(9_000 * MS);
        let d = j.flow_report(&cnp).unwrap().cnp_delivery.unwrap();
        assert_eq!(
            d.lost,
            [CountedLoss {
                between: ["s1:l2:ingress".into(), "s1:l1:egress".into()],
                packets: 40,
            }]
        );
        // When the collector stops, every count is final at once.
        cnps_at(&mut j, cnp, &back[..4], &[7; 4], 9_000 * MS);
        j.flush();
        let d = j.flow_report(&cnp).unwrap().cnp_delivery.unwrap();
        assert_eq!(d.lost[0].packets, 47);
    }

    /// Every CNP of a QP is the same packet (PSN 0, one ICRC). 200 of them 60 µs apart,
    /// each reported at every point by agents whose clocks disagree by up to 40 µs: no
    /// identity tells which report is which CNP, so none may be judged lost.
    #[test]
    fn identical_cnps_under_load_are_not_lost_by_the_join() {
        let (mut j, back, cnp) = cnp_lab();
        let skew = [0i64, 35_000, -20_000, 40_000, -40_000, 10_000, -35_000, 25_000];
        for k in 0..200u64 {
            for (i, &p) in back.iter().enumerate() {
                let t = (1_000 * MS + k * 60_000 + i as u64 * 2_000) as i64 + skew[(i + k as usize) % 8];
                let mut o = obs(0, [64, 64, 63, 63, 62, 62, 61, 61][i], t as u64, 48, 0);
                o.id = PacketId {
                    flow: cnp,
                    psn: 0,
                    opcode: 0x81,
                    icrc: [9, 9, 9, 9],
                };
                o.reasons = (REASON_CNP | REASON_HASH) as u8;
                j.add(p, &o, 1_000 * MS);
            }
        }
        cnps_at(&mut j, cnp, &back, &[200; 8], 1_500 * MS);
        j.tick(10_000 * MS);
        j.flush();
        let r = j.flow_report(&cnp).unwrap();
        assert_eq!(r.lost, [], "no CNP lost");
        assert_eq!(r.path.len(), 8, "{:?}", r.path);
        let d = r.cnp_delivery.unwrap();
        assert_eq!((d.sent, d.reached, d.lost.len()), (200, Some(200), 0));
        assert_eq!(r.cnp_class.len(), 8);
    }

    #[test]
    fn state_is_bounded() {
        let mut j = Joiner::new(JoinConfig {
            max_flows: 2,
            max_pending: 3,
            trajectory_timeout_ns: MS,
            flow_idle_ns: 10 * MS,
            counter_settle_ns: MS,
            max_agent_lag_ns: MS,
        });
        let p = j.point(PointInfo {
            node: "h".into(),
            iface: "e".into(),
            direction: Direction::Ingress,
            clock_synced: false,
            ..Default::default()
        });
        let qp = |q: u32| FlowId { dest_qp: q, ..flow() };
        // QP 0 first, then QP 1, then QP 0 again: QP 1 is the longest idle when QP 2
        // needs room, though QP 0 came first.
        for (psn, q, t) in [(0, 0, 0), (1, 1, MS), (2, 0, 2 * MS), (3, 2, 3 * MS)] {
            let mut o = obs(psn, 64, t, 26, 2);
            o.id.flow.dest_qp = q;
            j.add(p, &o, t);
        }
        assert_eq!(j.flow_ids(), [qp(0), qp(2)], "the longest-idle flow made room");
        assert_eq!(j.stats.flows_evicted, 1);
        assert_eq!(j.stats.pending_dropped, 1, "three identities wait at most");
        // The table stays full and new flows keep coming: each takes the idlest's place.
        for q in 3..10u32 {
            let mut o = obs(100 + q, 64, 4 * MS, 26, 2);
            o.id.flow.dest_qp = q;
            j.add(p, &o, (3 + q as u64) * MS);
        }
        assert_eq!(j.flow_ids(), [qp(8), qp(9)]);
        assert_eq!(j.stats.flows_evicted, 8);
        assert_eq!(j.stats.pending_dropped, 8);
        j.tick(30 * MS);
        assert_eq!(j.stats.flows, 0, "idle flows expire");
        assert_eq!(j.stats.flows_expired, 2);
    }

    /// The anomaly counts kept as flows change (metrics read them, never a report) are
    /// the anomalies the reports list, through class changes, losses taken back by late
    /// arrivals, path changes and flows evicted.
    #[test]
    fn anomaly_counts_follow_the_reports() {
        let (mut j, pts) = lab();
        let s2 = via_s2(&mut j, &pts);
        let count = |j: &Joiner| {
            let mut m = BTreeMap::new();
            for a in j.anomalies() {
                *m.entry(a.kind).or_insert(0u64) += 1;
            }
            m
        };
        let mut t = 0;
        for psn in 0..40u32 {
            t += 10 * MS;
            let path = if psn < 20 { &pts } else { &s2 };
            // A class rewrite at s1 for a while, a loss after l1 now and then, CE from l2.
            let skip: &[usize] = if psn % 7 == 3 { &[2, 3, 4] } else { &[] };
            let rewrite = psn < 10;
            for (i, p) in path.iter().enumerate() {
                if skip.contains(&i) {
                    continue;
                }
                let dscp = if rewrite && i >= 2 { 0 } else { 26 };
                let ecn = if i >= 3 && psn % 5 == 0 { 3 } else { 2 };
                j.add(*p, &obs(psn, TTLS[i], t + 1000 * i as u64, dscp, ecn), t);
            }
            j.tick(t);
            assert_eq!(j.anomaly_counts(), count(&j), "after packet {psn}");
        }
        // A loss whose proof comes later: the next points' agents have not reported that
        // far when the trajectory's time is up, so it waits, and is judged when their
        // health arrives.
        let late = 150_000 * MS;
        for (i, p) in s2.iter().enumerate().take(3) {
            j.add(*p, &obs(100, TTLS[i], late + 1000 * i as u64, 26, 2), t);
        }
        j.tick(t + 200 * MS);
        let before = j.anomaly_counts();
        clean(&mut j, s2[3], 100_000 * MS, 200_000 * MS);
        clean(&mut j, s2[4], 100_000 * MS, 200_000 * MS);
        j.tick(t + 300 * MS);
        assert_eq!(j.anomaly_counts(), count(&j));
        assert_ne!(j.anomaly_counts(), before, "the late proof found a loss");
        j.tick(t + 10_000 * MS);
        let all = count(&j);
        assert_eq!(j.anomaly_counts(), all);
        for k in [
            AnomalyKind::ClassChange,
            AnomalyKind::Lost,
            AnomalyKind::CeOnset,
            AnomalyKind::PathChange,
        ] {
            assert!(all.contains_key(&k), "{k} is among them: {all:?}");
        }
        // Forgotten flows take their anomalies with them.
        j.tick(t + 1_000_000 * MS);
        assert_eq!(j.stats.flows, 0);
        assert_eq!(j.anomaly_counts(), BTreeMap::new());
    }

    /// `n` RC flows, each between its own two hosts and answered by an ACK flow, every
    /// packet seen at the sender's egress and the receiver's ingress (as the issue's
    /// independent agents fed the collector).
    fn fabric(n: u32) -> Joiner {
        let mut j = Joiner::new(JoinConfig {
            trajectory_timeout_ns: MS,
            ..Default::default()
        });
        let (out, inn) = (
            j.point(PointInfo {
                node: "a".into(),
                iface: "e".into(),
                direction: Direction::Egress,
                clock_synced: true,
                ..Default::default()
            }),
            j.point(PointInfo {
                node: "b".into(),
                iface: "e".into(),
                direction: Direction::Ingress,
                clock_synced: true,
                ..Default::default()
            }),
        );
        for i in 0..n {
            let mut src = [0u8; 16];
            src[..4].copy_from_slice(&i.to_be_bytes());
            let mut dst = src;
            dst[15] = 1;
            let fwd = FlowId {
                src,
                dst,
                ip_version: 6,
                udp_sport: 49152,
                dest_qp: i & 0xff_ffff,
            };
            let ack = FlowId {
                src: dst,
                dst: src,
                ..fwd
            };
            for psn in 0..4u32 {
                for (flow, opcode) in [(fwd, 7), (ack, 0x11)] {
                    let mut o = obs(psn, 64, u64::from(i) * 1000 + u64::from(psn), 26, 2);
                    o.id.flow = flow;
                    o.id.opcode = opcode;
                    j.add(out, &o, 0);
                    o.ttl = 63;
                    j.add(inn, &o, 0);
                }
            }
        }
        j.tick(10 * MS);
        assert_eq!(j.stats.trajectories, u64::from(n) * 8);
        j
    }

    /// A group member handing a partition over forgets its flows, and gives back their
    /// part of its running totals: the member that takes the partition over replays it
    /// and counts it again, so the group's merged totals count every observation once.
    #[test]
    fn flows_handed_over_take_their_part_of_the_totals_with_them() {
        let mut j = fabric(4);
        assert_eq!((j.stats.observations, j.stats.trajectories), (64, 32));
        // One observation of host pair 0 arrives twice.
        let first = *j.ids.iter().next().unwrap();
        let mut o = obs(9, 64, 50 * MS, 26, 2);
        o.id.flow = first;
        j.add(0, &o, 20 * MS);
        j.add(0, &o, 20 * MS);
        j.tick(30 * MS);
        let mut before = j.stats;
        // (Its trajectory waits for b, which has not reported that far.)
        assert_eq!(
            (before.observations, before.duplicates, before.pending),
            (66, 1, 1)
        );
        let pair0 = |f: &FlowId| f.src[..4] == [0; 4] || f.dst[..4] == [0; 4];
        assert_eq!(j.forget_where(pair0), 2);
        // Pair 0 had 16 + 2 observations, 8 trajectories and the duplicate.
        before.observations -= 18;
        before.trajectories -= 8;
        before.duplicates -= 1;
        before.flows = 6;
        before.pending = 0;
        assert_eq!(j.stats, before);
        // Flows that went idle keep their part: they were joined here.
        j.tick(1_000_000 * MS);
        assert_eq!(
            (j.stats.flows, j.stats.observations, j.stats.trajectories),
            (0, 48, 24)
        );
    }

    /// The collector's views were quadratic (each flow's report scanned every flow for
    /// its reverse flows: 2,000 → 16,000 flows took 64× as long). Every report of a
    /// fabric eight times larger must now take well under 16× as long (linear is 8×),
    /// and one flow's report must not grow with the fabric at all.
    /// Read a chunk at a time, every flow's report is the one a snapshot of the whole
    /// table gives (its pair and reverse pair come with it), whatever the chunk size; a
    /// flow added behind the cursor is read, one forgotten ahead of it is not.
    #[test]
    fn reports_read_a_chunk_at_a_time_are_the_snapshots() {
        let mut j = fabric(300);
        // Every tenth pair's receiver sends CNPs back: their reports need the reverse pair.
        for i in (0..300u32).step_by(10) {
            let mut src = [0u8; 16];
            src[..4].copy_from_slice(&i.to_be_bytes());
            let mut dst = src;
            dst[15] = 1;
            let cnp = FlowId {
                src: dst,
                dst: src,
                ip_version: 6,
                udp_sport: 4792,
                dest_qp: i,
            };
            let d = CounterDelta {
                flow: cnp,
                counts: Counts {
                    packets: 3,
                    cnp: 3,
                    ..Default::default()
                },
                ..Default::default()
            };
            j.add_counters(0, &d, 0);
        }
        let whole: Vec<FlowReport> = j.snapshot().view().flow_reports().collect();
        assert_eq!(whole.len(), 630);
        assert_eq!(
            whole.iter().filter(|r| !r.answered_by.flows.is_empty()).count(),
            30,
            "the CNPs' flows answer theirs through the reverse pair"
        );
        let read = |j: &Joiner, mut cursor: Option<FlowId>, n: usize| {
            let mut out = Vec::new();
            loop {
                let (ids, view) = j.chunk_view(cursor.as_ref(), n);
                let view = view.view();
                if ids.is_empty() {
                    return out;
                }
                out.extend(ids.iter().map(|id| view.flow_report(id).unwrap()));
                cursor = ids.last().copied();
            }
        };
        for n in [1, 2, 7, 64, 10_000] {
            assert_eq!(read(&j, None, n), whole, "chunks of {n}");
        }
        // The table changes between chunks: the last flow goes, a new one comes last.
        let (ids, view) = j.chunk_view(None, 100);
        let view = view.view();
        let mut got: Vec<FlowReport> = ids.iter().map(|id| view.flow_report(id).unwrap()).collect();
        drop(view);
        let last = *j.flow_ids().last().unwrap();
        j.forget(&last);
        let mut late = last;
        late.dest_qp += 1;
        let mut o = obs(1, 64, 0, 26, 2);
        o.id.flow = late;
        j.add(0, &o, 0);
        got.extend(read(&j, ids.last().copied(), 100));
        assert_eq!(got.len(), 630, "one gone, one new");
        assert_eq!(got[..629], whole[..629]);
        assert_eq!(got[629].dest_qp, late.dest_qp);
    }

    #[test]
    fn reports_take_time_linear_in_the_flows() {
        use std::time::{Duration, Instant};
        let all = |j: &Joiner| {
            (0..3)
                .map(|_| {
                    let t = Instant::now();
                    let v = j.snapshot().view();
                    assert_eq!(v.flow_reports().count(), j.flow_count());
                    t.elapsed()
                })
                .min()
                .unwrap_or_default()
        };
        let one = |j: &Joiner| {
            let id = j.flow_ids()[j.flow_count() / 2];
            (0..3)
                .map(|_| {
                    let t = Instant::now();
                    for _ in 0..200 {
                        assert!(j.flow_report(&id).is_some());
                    }
                    t.elapsed()
                })
                .min()
                .unwrap_or_default()
        };
        let (small, big) = (fabric(2_000), fabric(16_000));
        let (a, b) = (all(&small), all(&big));
        assert!(b < a * 16, "every report: {a:?} at 4,000 flows, {b:?} at 32,000");
        let (a, b) = (one(&small), one(&big));
        assert!(
            b < a * 4 + Duration::from_millis(5),
            "one report: {a:?} at 4,000 flows, {b:?} at 32,000"
        );
        // Each forward flow is answered by its ACK flow, found through the pair index.
        let id = big.flow_ids().into_iter().find(|f| f.dst[15] == 1).unwrap();
        assert!(
            big.flow_report(&id).unwrap().answered_by.flows.is_empty(),
            "ACKs are no CNPs"
        );
    }
}
