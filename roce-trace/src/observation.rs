//! Observations as they leave a host: one sampled packet at one observation point, and
//! per-flow counter deltas. The agent makes them from the datapath's records; the
//! collector joins them. One definition, shared by both ends of the wire protocol.

use std::net::IpAddr;

use roce_trace_common::datapath::*;
use serde::Serialize;

use crate::{
    record::{ip_of, ip_of_mapped},
    sys::KernelClock,
};

/// A mirror session as an observation point: the switch (outer source) that mirrored the
/// packets, its session id (ERSPAN) or key (GRE), and the encapsulation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MirrorSession {
    pub src: IpAddr,
    pub session: u32,
    pub kind: u8,
}

impl MirrorSession {
    pub fn of_key(k: &FlowKey) -> Option<Self> {
        (k.mirror_kind != MIRROR_NONE).then(|| Self {
            src: ip_of_mapped(&k.mirror_addr()),
            session: k.mirror_session,
            kind: k.mirror_kind,
        })
    }
    pub fn kind_name(&self) -> &'static str {
        match self.kind {
            MIRROR_GRE => "gre",
            MIRROR_ERSPAN_I => "erspan1",
            MIRROR_ERSPAN_II => "erspan2",
            _ => "erspan3",
        }
    }
    /// The point's node: the switch.
    pub fn node(&self) -> String {
        self.src.to_string()
    }
    /// The point's interface: `erspan-<session>`, or `gre-<key>` for plain GRE.
    pub fn iface(&self) -> String {
        match self.kind {
            MIRROR_GRE => format!("gre-{}", self.session),
            _ => format!("erspan-{}", self.session),
        }
    }
    /// The point it is: node = the switch, direction [`DIR_MIRROR`].
    pub fn point(&self, index: u16, ifindex: u32) -> PointDecl {
        PointDecl {
            index,
            node: self.node(),
            iface: self.iface(),
            ifindex,
            direction: DIR_MIRROR,
        }
    }
}

/// What stays the same for one RDMA QP direction everywhere in the fabric.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FlowId {
    pub src: [u8; 16],
    pub dst: [u8; 16],
    pub ip_version: u8,
    pub udp_sport: u16,
    pub dest_qp: u32,
}

impl FlowId {
    pub fn of_key(k: &FlowKey) -> Self {
        Self {
            src: k.src,
            dst: k.dst,
            ip_version: k.ip_version,
            udp_sport: k.udp_sport,
            dest_qp: k.dest_qp,
        }
    }
    pub fn src_ip(&self) -> IpAddr {
        ip_of(self.ip_version, &self.src)
    }
    pub fn dst_ip(&self) -> IpAddr {
        ip_of(self.ip_version, &self.dst)
    }
    /// A stable text id, for URLs and reports: `src:sport>dst/qp`.
    pub fn label(&self) -> String {
        format!(
            "{}:{}>{}/{:#x}",
            self.src_ip(),
            self.udp_sport,
            self.dst_ip(),
            self.dest_qp
        )
    }
}

/// What stays the same for one packet everywhere: flow, PSN, opcode and the ICRC (over
/// exactly the fields the fabric may not change). Retransmissions share it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PacketId {
    pub flow: FlowId,
    pub psn: u32,
    pub opcode: u8,
    pub icrc: [u8; 4],
}

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
    pub fn from_sample(s: &Sample, point: u16, clock: &KernelClock) -> Self {
        let mut flags = 0;
        if s.present & HAS_PCP != 0 {
            flags |= OBS_HAS_PCP;
        }
        if s.present & HAS_AETH != 0 {
            flags |= OBS_HAS_AETH;
        }
        Self {
            point,
            time_ns: clock.to_unix_ns(s.ts_ns),
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
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct CounterDelta {
    #[serde(skip)]
    pub point: u16,
    #[serde(skip)]
    pub flow: FlowId,
    pub packets: u64,
    pub bytes: u64,
    pub ecn: [u64; 4],
    pub cnp: u64,
    pub ack: u64,
    pub nak_psn_seq_err: u64,
    pub nak_rnr: u64,
    pub nak_other: u64,
    pub psn_gaps: u64,
    pub dscp_changed: u64,
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
            packets: c.packets,
            bytes: c.bytes,
            ecn: c.ecn,
            cnp: c.cnp,
            ack: c.ack,
            nak_psn_seq_err: c.nak_psn_seq_err,
            nak_rnr: c.nak_rnr,
            nak_other: c.nak_other,
            psn_gaps: c.psn_gaps,
            dscp_changed: c.dscp_changed,
            last_dscp: c.last_dscp,
            last_pcp: c.last_pcp,
            last_ttl: c.last_ttl,
        }
    }

    /// `now - before` (a flow the LRU evicted and re-created counts from zero again).
    pub fn between(point: u16, key: &FlowKey, now: &FlowCounters, before: Option<&FlowCounters>) -> Self {
        let now_t = Self::totals(point, key, now);
        match before {
            Some(b) if b.packets <= now.packets => now_t.less(&Self::totals(point, key, b)),
            _ => now_t,
        }
    }

    /// `self - before` of two running totals of one flow at one point (the last-seen
    /// fields are `self`'s).
    pub fn less(&self, before: &CounterDelta) -> Self {
        let d = |x: u64, y: u64| x.saturating_sub(y);
        Self {
            packets: d(self.packets, before.packets),
            bytes: d(self.bytes, before.bytes),
            ecn: [0, 1, 2, 3].map(|i| d(self.ecn[i], before.ecn[i])),
            cnp: d(self.cnp, before.cnp),
            ack: d(self.ack, before.ack),
            nak_psn_seq_err: d(self.nak_psn_seq_err, before.nak_psn_seq_err),
            nak_rnr: d(self.nak_rnr, before.nak_rnr),
            nak_other: d(self.nak_other, before.nak_other),
            psn_gaps: d(self.psn_gaps, before.psn_gaps),
            dscp_changed: d(self.dscp_changed, before.dscp_changed),
            ..*self
        }
    }

    pub fn add(&mut self, o: &CounterDelta) {
        self.packets += o.packets;
        self.bytes += o.bytes;
        for i in 0..4 {
            self.ecn[i] += o.ecn[i];
        }
        self.cnp += o.cnp;
        self.ack += o.ack;
        self.nak_psn_seq_err += o.nak_psn_seq_err;
        self.nak_rnr += o.nak_rnr;
        self.nak_other += o.nak_other;
        self.psn_gaps += o.psn_gaps;
        self.dscp_changed += o.dscp_changed;
        self.last_dscp = o.last_dscp;
        self.last_pcp = o.last_pcp;
        self.last_ttl = o.last_ttl;
    }
}

/// An observation point as the agent declares it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PointDecl {
    pub index: u16,
    /// Empty: the agent's own node. A mirror session names its switch.
    pub node: String,
    pub iface: String,
    pub ifindex: u32,
    pub direction: u8,
}

/// The observation points of one agent: its hooks, declared up front, and the mirror
/// sessions it receives, declared as they are first seen. Keys map to point indexes.
#[derive(Debug, Default)]
pub struct PointTable {
    decls: Vec<PointDecl>,
    hooks: std::collections::HashMap<(u32, u8), u16>,
    mirrors: std::collections::HashMap<MirrorSession, u16>,
}

impl PointTable {
    pub fn new(hooks: Vec<PointDecl>) -> Self {
        let map = hooks
            .iter()
            .map(|p| ((p.ifindex, p.direction), p.index))
            .collect();
        Self {
            decls: hooks,
            hooks: map,
            mirrors: Default::default(),
        }
    }

    /// The point of a flow key: its hook's, or its mirror session's (declared now if new;
    /// `None` once 65,536 points exist).
    pub fn index_of(&mut self, k: &FlowKey) -> Option<u16> {
        let Some(m) = MirrorSession::of_key(k) else {
            return self.hooks.get(&(k.ifindex, k.direction)).copied();
        };
        if let Some(&i) = self.mirrors.get(&m) {
            return Some(i);
        }
        let i = u16::try_from(self.decls.len()).ok()?;
        self.decls.push(m.point(i, k.ifindex));
        self.mirrors.insert(m, i);
        Some(i)
    }

    /// Every point declared so far, in index order.
    pub fn decls(&self) -> &[PointDecl] {
        &self.decls
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mirror_sessions_become_points_once_each() {
        let mut t = PointTable::new(vec![PointDecl {
            index: 0,
            node: String::new(),
            iface: "eth0".into(),
            ifindex: 2,
            direction: DIR_INGRESS,
        }]);
        let plain = FlowKey {
            ifindex: 2,
            direction: DIR_INGRESS,
            ..Default::default()
        };
        let mut sw = FlowKey {
            mirror_kind: MIRROR_ERSPAN_II,
            mirror_session: 7,
            mirror_src: words_of_addr(std::net::Ipv4Addr::new(192, 0, 2, 9).to_ipv6_mapped().octets()),
            ..plain
        };
        assert_eq!(t.index_of(&plain), Some(0));
        assert_eq!(t.index_of(&sw), Some(1));
        assert_eq!(t.index_of(&sw), Some(1), "declared once");
        sw.mirror_session = 8;
        assert_eq!(t.index_of(&sw), Some(2), "another session is another point");
        let d = &t.decls()[1];
        assert_eq!(
            (d.node.as_str(), d.iface.as_str(), d.direction),
            ("192.0.2.9", "erspan-7", DIR_MIRROR)
        );
        let other_hook = FlowKey { ifindex: 3, ..plain };
        assert_eq!(t.index_of(&other_hook), None);
    }
}
