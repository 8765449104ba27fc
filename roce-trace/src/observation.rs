//! Observations as they leave a host: one sampled packet at one observation point, and
//! per-flow counter deltas. The agent makes them from the datapath's records; the
//! collector joins them. One definition, shared by both ends of the wire protocol.

use std::{
    collections::{HashMap, HashSet},
    net::IpAddr,
};

use roce_trace_common::datapath::*;
use serde::Serialize;

use roce_trace_common::flow::ip_of_mapped;
pub use roce_trace_common::flow::{FlowId, PacketId};
pub use roce_trace_correlate::observation::*;

/// A mirror session as an observation point: the switch (outer source) that mirrored the
/// packets, its session id (ERSPAN) or key (GRE), and the encapsulation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MirrorSession {
    pub src: IpAddr,
    pub session: u32,
    pub kind: u8,
}

impl MirrorSession {
    pub fn of_info(m: &MirrorInfo) -> Self {
        Self {
            src: ip_of_mapped(&m.addr()),
            session: m.session,
            kind: m.kind,
        }
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
            mtu: 0,
        }
    }
}

/// Mirror sessions by id (`FlowKey::mirror`): what the kernel's `MIRRORS` map holds, or
/// for pcap input what its own parse found. The first session to claim an id keeps it,
/// as in the kernel; samples carry their own session, so a disagreement (two sessions on
/// one id: their flow counters are merged) is noticed and logged, once per id.
#[derive(Clone, Debug, Default)]
pub struct MirrorTable {
    by_id: HashMap<u32, MirrorInfo>,
    warned: HashSet<u32>,
}

impl MirrorTable {
    /// Records `info` under `id` unless the id is taken (the kernel's `BPF_NOEXIST`).
    pub fn insert(&mut self, id: u32, info: MirrorInfo) {
        self.by_id.entry(id).or_insert(info);
    }

    /// Every entry of `other` whose id is not taken here.
    pub fn extend(&mut self, other: impl IntoIterator<Item = (u32, MirrorInfo)>) {
        for (id, info) in other {
            self.insert(id, info);
        }
    }

    pub fn get(&self, id: u32) -> Option<&MirrorInfo> {
        self.by_id.get(&id)
    }

    pub fn iter(&self) -> impl Iterator<Item = (u32, MirrorInfo)> + '_ {
        self.by_id.iter().map(|(&id, &m)| (id, m))
    }

    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// A mirrored flow key whose id the table does not know (yet).
    pub fn missing(&self, k: &FlowKey) -> bool {
        k.mirror != 0 && !self.by_id.contains_key(&k.mirror)
    }

    /// The mirror session of a flow key: `None` when it was not mirrored, or when its id
    /// is unknown (see [`MirrorTable::warn_missing`]).
    pub fn session(&self, k: &FlowKey) -> Option<MirrorSession> {
        if k.mirror == 0 {
            return None;
        }
        self.by_id.get(&k.mirror).map(MirrorSession::of_info)
    }

    /// The session of a sample (its own, which it carries), learnt into the table; a
    /// warning when the table holds another session under the sample's id.
    pub fn learn_sample(&mut self, s: &Sample) -> Option<MirrorSession> {
        let info = s.mirror()?;
        let id = s.key.mirror;
        let known = *self.by_id.entry(id).or_insert(info);
        if known != info && self.warned.insert(id) {
            let (a, b) = (MirrorSession::of_info(&known), MirrorSession::of_info(&info));
            tracing::warn!(
                "mirror sessions {}/{} ({}) and {}/{} ({}) share id {id:#010x}: their flows' \
                 counters are merged under the first",
                a.node(),
                a.iface(),
                a.kind_name(),
                b.node(),
                b.iface(),
                b.kind_name()
            );
        }
        Some(MirrorSession::of_info(&info))
    }

    /// Logs once per id each mirrored key the table cannot name (the kernel's map was
    /// full); such flows are reported without their session.
    pub fn warn_missing<'a>(&mut self, keys: impl IntoIterator<Item = &'a FlowKey>) {
        for k in keys {
            if self.missing(k) && self.warned.insert(k.mirror) {
                tracing::warn!(
                    "mirror session id {:#010x} is not in the mirror table ({} sessions known); \
                     its flows are reported without their session",
                    k.mirror,
                    self.by_id.len()
                );
            }
        }
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
    /// The interface's MTU (IP bytes) when the point was declared; 0: not known (a
    /// mirror session, a capture).
    pub mtu: u32,
}

/// The observation points of one agent: its hooks, declared up front, and the mirror
/// sessions it receives, declared as they are first seen. Keys map to point indexes, a
/// mirrored key through [`PointTable::mirrors`].
#[derive(Debug, Default)]
pub struct PointTable {
    decls: Vec<PointDecl>,
    hooks: HashMap<(u32, u8), u16>,
    sessions: HashMap<MirrorSession, u16>,
    changes: u64,
    /// Names the mirror ids of flow keys; the agent fills it from the datapath (or the
    /// pcap reader) and from samples.
    pub mirrors: MirrorTable,
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
            sessions: Default::default(),
            changes: 0,
            mirrors: Default::default(),
        }
    }

    /// The point of a flow key: its hook's, or its mirror session's (declared now if new).
    /// `None` once 65,536 points exist, or for a mirror id the table cannot name.
    pub fn index_of(&mut self, k: &FlowKey) -> Option<u16> {
        if k.mirror == 0 {
            return self.hooks.get(&(k.ifindex, k.direction)).copied();
        }
        let m = self.mirrors.session(k)?;
        self.session_index(m, k.ifindex)
    }

    /// The point of a sample: as [`PointTable::index_of`], a mirrored copy by the session
    /// it carries (which is also learnt into the mirror table).
    pub fn index_of_sample(&mut self, s: &Sample) -> Option<u16> {
        match self.mirrors.learn_sample(s) {
            Some(m) => self.session_index(m, s.key.ifindex),
            None if s.key.mirror == 0 => self.hooks.get(&(s.key.ifindex, s.key.direction)).copied(),
            // A mirror id without the mirror bit: not a sample the datapath makes.
            None => None,
        }
    }

    fn session_index(&mut self, m: MirrorSession, ifindex: u32) -> Option<u16> {
        if let Some(&i) = self.sessions.get(&m) {
            return Some(i);
        }
        let i = u16::try_from(self.decls.len()).ok()?;
        self.decls.push(m.point(i, ifindex));
        self.sessions.insert(m, i);
        Some(i)
    }

    /// Every point declared so far, in index order.
    pub fn decls(&self) -> &[PointDecl] {
        &self.decls
    }

    /// Records the MTU of point `index`; true when it changed (the point is declared
    /// again, so the collector knows what the port can carry now).
    pub fn set_mtu(&mut self, index: u16, mtu: u32) -> bool {
        match self.decls.get_mut(index as usize) {
            Some(d) if d.mtu != mtu => {
                d.mtu = mtu;
                self.changes += 1;
                true
            }
            _ => false,
        }
    }

    /// How many times a declared point changed (see [`PointTable::set_mtu`]).
    pub fn changes(&self) -> u64 {
        self.changes
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
            mtu: 0,
            direction: DIR_INGRESS,
        }]);
        let plain = FlowKey {
            ifindex: 2,
            direction: DIR_INGRESS,
            ..Default::default()
        };
        let mut info = MirrorInfo {
            kind: MIRROR_ERSPAN_II,
            session: 7,
            src: words_of_addr(std::net::Ipv4Addr::new(192, 0, 2, 9).to_ipv6_mapped().octets()),
            _pad: [0; 3],
        };
        let mut sw = FlowKey {
            mirror: info.id(),
            ..plain
        };
        assert_eq!(t.index_of(&plain), Some(0));
        assert_eq!(t.index_of(&sw), None, "an id the mirror table cannot name yet");
        t.mirrors.insert(info.id(), info);
        assert_eq!(t.index_of(&sw), Some(1));
        assert_eq!(t.index_of(&sw), Some(1), "declared once");
        info.session = 8;
        sw.mirror = info.id();
        // A sample names its session by itself, and teaches the table.
        let sample = Sample {
            key: sw,
            present: HAS_MIRROR,
            mirror: info,
            ..Sample::default()
        };
        assert_eq!(
            t.index_of_sample(&sample),
            Some(2),
            "another session is another point"
        );
        assert_eq!(t.index_of(&sw), Some(2), "learnt from the sample");
        let d = &t.decls()[1];
        assert_eq!(
            (d.node.as_str(), d.iface.as_str(), d.direction),
            ("192.0.2.9", "erspan-7", DIR_MIRROR)
        );
        let other_hook = FlowKey { ifindex: 3, ..plain };
        assert_eq!(t.index_of(&other_hook), None);
        let plain_sample = Sample {
            key: plain,
            ..Sample::default()
        };
        assert_eq!(t.index_of_sample(&plain_sample), Some(0));
    }

    #[test]
    fn the_first_session_keeps_an_id_and_a_disagreeing_sample_is_told_apart() {
        let a = MirrorInfo {
            src: words_of_addr(std::net::Ipv4Addr::new(192, 0, 2, 9).to_ipv6_mapped().octets()),
            session: 1,
            kind: MIRROR_ERSPAN_III,
            _pad: [0; 3],
        };
        let b = MirrorInfo { session: 2, ..a };
        // Pretend both hashed to a's id (a collision).
        let id = a.id();
        let mut t = MirrorTable::default();
        t.insert(id, a);
        t.insert(id, b);
        assert_eq!(t.get(id), Some(&a), "first wins, like BPF_NOEXIST");
        let key = FlowKey {
            mirror: id,
            ..Default::default()
        };
        let s = Sample {
            key,
            present: HAS_MIRROR,
            mirror: b,
            ..Sample::default()
        };
        // The sample keeps its own session; the table keeps the first (and warns).
        assert_eq!(t.learn_sample(&s), Some(MirrorSession::of_info(&b)));
        assert_eq!(t.session(&key), Some(MirrorSession::of_info(&a)));
        assert_eq!(t.len(), 1);
        assert!(!t.missing(&key));
        assert!(t.missing(&FlowKey { mirror: 5, ..key }));
        assert!(!t.missing(&FlowKey::default()), "not mirrored");
        assert_eq!(t.session(&FlowKey::default()), None);
    }
}
