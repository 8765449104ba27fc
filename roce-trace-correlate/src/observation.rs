//! Observations as they leave a host: one sampled packet at one observation point,
//! per-flow counter deltas, and each point's health. The agent makes them from the
//! datapath's records; the wire protocol carries them; the join consumes them.

use roce_trace_common::{
    datapath::*,
    flow::{FlowId, PacketId},
};
use serde::{Deserialize, Serialize};

/// The counter set a [`CounterDelta`] carries.
pub use roce_trace_common::datapath::Counts;

pub const OBS_HAS_PCP: u8 = 1;
pub const OBS_HAS_AETH: u8 = 2;

/// One packet at one observation point (the point is an index the agent declared).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Observation {
    pub point: u16,
    /// Unix nanoseconds by the agent's clock.
    pub time_ns: u64,
    pub id: PacketId,
    pub udp_dport: u16,
    pub dscp: u8,
    pub ecn: u8,
    pub ttl: u8,
    pub pcp: u8,
    pub frame_len: u16,
    /// `REASON_*` bits of the datapath.
    pub reasons: u8,
    pub aeth_syndrome: u8,
    /// `OBS_HAS_*` bits.
    pub flags: u8,
}

impl Observation {
    /// `time_ns`: the sample's time on the agent's clock, Unix nanoseconds.
    pub fn from_sample(s: &Sample, point: u16, time_ns: u64) -> Self {
        let mut flags = 0;
        if s.present & HAS_PCP != 0 {
            flags |= OBS_HAS_PCP;
        }
        if s.present & HAS_AETH != 0 {
            flags |= OBS_HAS_AETH;
        }
        Self {
            point,
            time_ns,
            id: PacketId {
                flow: FlowId::of_key(&s.key),
                psn: s.psn,
                opcode: s.opcode,
                icrc: s.icrc,
            },
            udp_dport: s.udp_dport,
            dscp: s.dscp,
            ecn: s.ecn,
            ttl: s.ttl,
            pcp: s.pcp,
            frame_len: s.frame_len.min(u16::MAX as u32) as u16,
            reasons: s.reasons as u8,
            aeth_syndrome: s.aeth_syndrome,
            flags,
        }
    }

    /// Selected by the shared hash (as opposed to reported only as an anomaly): only such
    /// packets are expected at every point, so only they say "lost".
    pub fn hash_sampled(&self) -> bool {
        self.reasons as u32 & REASON_HASH != 0
    }
}

/// Change of one flow's exact counters at one point over an interval.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CounterDelta {
    #[serde(skip)]
    pub point: u16,
    #[serde(skip)]
    pub flow: FlowId,
    /// The interval the change happened in, on the agent's clock (Unix ns, as
    /// observations): from the agent's previous report of this flow at this point (or its
    /// previous reading, for a flow new to it) to the reading that found the change. A
    /// pcap agent uses capture time. Rates are bytes over this interval, so neither the
    /// agent's sending nor the network's delivery of the report can distort them.
    #[serde(skip)]
    pub start_ns: u64,
    #[serde(skip)]
    pub end_ns: u64,
    #[serde(flatten)]
    pub counts: Counts,
    pub last_dscp: u8,
    pub last_pcp: u8,
    pub last_ttl: u8,
}

impl CounterDelta {
    /// A flow's running totals at one point, as the kernel keeps them.
    pub fn totals(point: u16, key: &FlowKey, c: &FlowCounters) -> Self {
        Self {
            point,
            flow: FlowId::of_key(key),
            start_ns: 0,
            end_ns: 0,
            counts: c.counts,
            last_dscp: c.last_dscp,
            last_pcp: c.last_pcp,
            last_ttl: c.last_ttl,
        }
    }

    /// `now - before` over `[start_ns, end_ns]` (a flow the LRU evicted and re-created
    /// counts from zero again).
    pub fn between(
        point: u16,
        key: &FlowKey,
        now: &FlowCounters,
        before: Option<&FlowCounters>,
        [start_ns, end_ns]: [u64; 2],
    ) -> Self {
        let counts = match before {
            Some(b) if b.counts.packets <= now.counts.packets => now.counts.saturating_sub(&b.counts),
            _ => now.counts,
        };
        Self {
            start_ns,
            end_ns,
            counts,
            ..Self::totals(point, key, now)
        }
    }

    /// `self - before` of two running totals of one flow at one point (the last-seen
    /// fields are `self`'s).
    pub fn less(&self, before: &CounterDelta) -> Self {
        Self {
            counts: self.counts.saturating_sub(&before.counts),
            ..*self
        }
    }

    /// Adds a later delta: sums, its last-seen class and the union of the intervals.
    pub fn add(&mut self, o: &CounterDelta) {
        self.counts.add(&o.counts);
        self.last_dscp = o.last_dscp;
        self.last_pcp = o.last_pcp;
        self.last_ttl = o.last_ttl;
        if self.start_ns == 0 {
            self.start_ns = o.start_ns;
        }
        self.end_ns = self.end_ns.max(o.end_ns);
    }
}

/// One observation point over one agent interval: what the agent could not deliver from
/// it, and what the kernel dropped on its interface. The collector needs it to tell a
/// packet lost in the fabric from a sample lost on the way (a loss is proven only where
/// the downstream point reported a clean interval), and quotes the kernel's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PointHealth {
    pub point: u16,
    /// The interval, Unix nanoseconds by the agent's clock (as observations).
    pub start_ns: u64,
    pub end_ns: u64,
    /// Samples the kernel could not hand over: the ring buffer was full (counted per
    /// direction on the host: every point of that direction gets it).
    pub ringbuf_full: u64,
    /// RoCEv2 packets the datapath could not parse (BTH or extension headers cut short),
    /// so it sampled none of them (counted per direction, like `ringbuf_full`).
    pub unparsed: u64,
    /// Observations the agent gave up (its queue was full), and samples it could not
    /// read or place at a point: agent-wide, every point gets them.
    pub agent_dropped: u64,
    /// The interface's own drop counters (`/proc/net/dev` drop columns) and its root
    /// qdisc's drops; zero for points that are not a local interface.
    pub if_rx_dropped: u64,
    pub if_tx_dropped: u64,
    pub qdisc_dropped: u64,
}

impl PointHealth {
    /// Samples from this point that never reached the collector.
    pub fn samples_lost(&self) -> u64 {
        self.ringbuf_full
            .saturating_add(self.unparsed)
            .saturating_add(self.agent_dropped)
    }
}

/// One port's NIC and PFC counters over one agent interval (the NIC frame): observations of
/// a port, not of a packet. Canonical counters only (`roce_trace_common::nic`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NicDelta {
    /// The interface, on the sending agent's node.
    pub iface: String,
    /// Whose names the port's counters were read in (`Driver` code).
    pub driver: u8,
    /// The RDMA device behind it, if any (`mlx5_0`).
    pub rdma_device: String,
    /// The interface's addresses (IPv4 mapped into IPv6): which flows are its own, so
    /// its NIC's CNP counters can be set beside the CNPs seen on the wire.
    pub addrs: Vec<[u8; 16]>,
    /// The interval, Unix nanoseconds by the agent's clock.
    pub start_ns: u64,
    pub end_ns: u64,
    /// Every counter was reset in the interval (a reboot, a driver reload): no deltas.
    pub epoch_changed: bool,
    pub values: Vec<NicValue>,
    /// The canonical counters the port does not have, with why (`Missing` code).
    pub missing: Vec<(NicCounter, u8)>,
}

/// A canonical counter on the wire: its kind's code and its priority (0xff: none).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct NicCounter {
    pub kind: u8,
    pub prio: u8,
}

impl NicCounter {
    pub const NO_PRIO: u8 = 0xff;

    pub fn of(id: roce_trace_common::nic::CounterId) -> Self {
        Self {
            kind: id.kind.code(),
            prio: id.prio.unwrap_or(Self::NO_PRIO),
        }
    }

    /// The canonical counter, when the codes name one (an unknown kind from a newer
    /// agent, or a priority past 7, do not).
    pub fn id(self) -> Option<roce_trace_common::nic::CounterId> {
        let kind = roce_trace_common::nic::Kind::from_code(self.kind)?;
        match (kind.per_priority(), self.prio) {
            (false, Self::NO_PRIO) => Some(roce_trace_common::nic::CounterId::port(kind)),
            (true, p @ 0..=7) => Some(roce_trace_common::nic::CounterId::prio(kind, p)),
            _ => None,
        }
    }
}

/// One counter of a port over one interval: its running total and its increase (None:
/// it was reset, or appeared, in the interval).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NicValue {
    pub counter: NicCounter,
    pub total: u64,
    pub delta: Option<u64>,
}
