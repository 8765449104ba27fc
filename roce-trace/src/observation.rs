//! Observations as they leave a host: one sampled packet at one observation point, and
//! per-flow counter deltas. The agent makes them from the datapath's records; the
//! collector joins them. One definition, shared by both ends of the wire protocol.

use std::collections::HashMap;

use roce_trace_common::datapath::*;
use serde::Serialize;

pub use roce_trace_common::flow::{FlowId, PacketId};
pub use roce_trace_correlate::observation::*;
pub use roce_trace_datapath::mirror::{MirrorSession, MirrorTable};

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

impl PointDecl {
    /// A mirror session's point: node = the switch, direction [`DIR_MIRROR`].
    pub fn of_mirror(m: &MirrorSession, index: u16, ifindex: u32) -> Self {
        PointDecl {
            index,
            node: m.node(),
            iface: m.iface(),
            ifindex,
            direction: DIR_MIRROR,
            mtu: 0,
        }
    }
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
        self.decls.push(PointDecl::of_mirror(&m, i, ifindex));
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
