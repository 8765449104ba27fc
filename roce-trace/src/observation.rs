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

/// An address range: an IPv4 or IPv6 network and its prefix length (`10.0.0.0/8`,
/// `2001:db8::/32`; a bare address is a /32 or /128).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr {
    net: std::net::IpAddr,
    len: u8,
}

impl std::str::FromStr for Cidr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (a, len) = s.split_once('/').map_or((s, None), |(a, l)| (a, Some(l)));
        let net: std::net::IpAddr = a
            .parse()
            .map_err(|_| format!("`{s}`: not an address or network"))?;
        let max = if net.is_ipv4() { 32 } else { 128 };
        let len = match len {
            None => max,
            Some(l) => l
                .parse::<u8>()
                .ok()
                .filter(|l| *l <= max)
                .ok_or_else(|| format!("`{s}`: the prefix length must be 0 to {max}"))?,
        };
        Ok(Self { net, len })
    }
}

impl Cidr {
    /// The range in the datapath's form (checked there before a session is remembered).
    pub fn prefix(&self) -> roce_trace_common::datapath::AddrPrefix {
        roce_trace_common::datapath::AddrPrefix::new(self.net, self.len)
    }

    pub fn contains(&self, ip: std::net::IpAddr) -> bool {
        use std::net::IpAddr::{V4, V6};
        let bits = |a: &[u8], b: &[u8], len: u8| {
            let (whole, rest) = (usize::from(len / 8), len % 8);
            a[..whole] == b[..whole] && (rest == 0 || (a[whole] ^ b[whole]) >> (8 - rest) == 0)
        };
        match (self.net, ip.to_canonical()) {
            (V4(n), V4(a)) => bits(&n.octets(), &a.octets(), self.len),
            (V6(n), V6(a)) => bits(&n.octets(), &a.octets(), self.len),
            _ => false,
        }
    }
}

/// Which mirror sessions an agent takes: from these switches only (empty: any), and at
/// most this many. A GRE/ERSPAN packet is easy to forge: without a bound, spoofed
/// sessions would each become a point until the agent's points could no longer be
/// declared.
#[derive(Clone, Debug)]
pub struct MirrorPolicy {
    pub from: Vec<Cidr>,
    pub max_sessions: usize,
}

impl MirrorPolicy {
    /// Mirror sessions an agent takes by default.
    pub const MAX_SESSIONS: usize = 1024;
}

impl Default for MirrorPolicy {
    fn default() -> Self {
        Self {
            from: Vec::new(),
            max_sessions: Self::MAX_SESSIONS,
        }
    }
}

/// Mirror sessions refused, by why (counted once per session).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MirrorsRefused {
    /// From a switch outside `--mirror-from`.
    pub source: u64,
    /// Past `--max-mirror-sessions`.
    pub over_cap: u64,
}

/// The observation points of one agent: its hooks, declared up front, and the mirror
/// sessions it receives, declared as they are first seen (those its [`MirrorPolicy`]
/// takes). Keys map to point indexes, a mirrored key through [`PointTable::mirrors`].
#[derive(Debug, Default)]
pub struct PointTable {
    decls: Vec<PointDecl>,
    hooks: HashMap<(u32, u8), u16>,
    sessions: HashMap<MirrorSession, u16>,
    policy: MirrorPolicy,
    /// Sessions refused, each once (bounded like the sessions taken: a flood of forged
    /// sessions past it is counted, not remembered).
    refused: std::collections::HashSet<MirrorSession>,
    refused_counts: MirrorsRefused,
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
            policy: MirrorPolicy::default(),
            refused: Default::default(),
            refused_counts: MirrorsRefused::default(),
            changes: 0,
            mirrors: Default::default(),
        }
    }

    /// The table with mirror sessions taken by `policy`.
    pub fn with_policy(mut self, policy: MirrorPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Refused mirror sessions remembered (each counted once); more are counted each time
    /// they are seen.
    const REFUSED_REMEMBERED: usize = 4096;

    /// Mirror sessions refused so far.
    pub fn mirrors_refused(&self) -> MirrorsRefused {
        self.refused_counts
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
        // A session the policy refuses is not learnt either: a flood of forged sessions
        // must not grow the mirror table.
        if let Some(info) = s.mirror() {
            let m = MirrorSession::of_info(&info);
            if !self.sessions.contains_key(&m) && self.refuses(m) {
                return None;
            }
        }
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
        if self.refuses(m) {
            return None;
        }
        let i = u16::try_from(self.decls.len()).ok()?;
        self.decls.push(PointDecl::of_mirror(&m, i, ifindex));
        self.sessions.insert(m, i);
        Some(i)
    }

    /// Whether the policy refuses new session `m` (counted when it does).
    fn refuses(&mut self, m: MirrorSession) -> bool {
        let allowed = self.policy.from.is_empty() || self.policy.from.iter().any(|c| c.contains(m.src));
        if !allowed || self.sessions.len() >= self.policy.max_sessions {
            // Counted once per session among the first refused ones remembered; one past
            // them, each time it is seen.
            if !self.refused.contains(&m) {
                if self.refused.len() < Self::REFUSED_REMEMBERED {
                    self.refused.insert(m);
                }
                if allowed {
                    self.refused_counts.over_cap += 1;
                } else {
                    self.refused_counts.source += 1;
                }
            }
            return true;
        }
        false
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

    /// A sample mirrored by switch `src` in session `session`.
    fn mirrored(src: std::net::IpAddr, session: u32) -> Sample {
        let octets = match src {
            std::net::IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
            std::net::IpAddr::V6(a) => a.octets(),
        };
        let info = MirrorInfo {
            kind: MIRROR_ERSPAN_II,
            session,
            src: words_of_addr(octets),
            _pad: [0; 3],
        };
        Sample {
            key: FlowKey {
                ifindex: 2,
                direction: DIR_INGRESS,
                mirror: info.id(),
                ..Default::default()
            },
            present: HAS_MIRROR,
            mirror: info,
            ..Sample::default()
        }
    }

    /// Mirrored copies from a switch outside `--mirror-from` (spoofed GRE) make no point,
    /// and are counted once per session; inside it they do.
    #[test]
    fn mirror_sessions_from_switches_not_allowed_make_no_point() {
        let policy = MirrorPolicy {
            from: vec!["192.0.2.0/24".parse().unwrap(), "2001:db8::/32".parse().unwrap()],
            ..MirrorPolicy::default()
        };
        let mut t = PointTable::new(vec![]).with_policy(policy);
        let ip = |s: &str| s.parse::<std::net::IpAddr>().unwrap();
        assert_eq!(t.index_of_sample(&mirrored(ip("192.0.2.9"), 1)), Some(0));
        assert_eq!(t.index_of_sample(&mirrored(ip("2001:db8::7"), 1)), Some(1));
        for _ in 0..3 {
            assert_eq!(t.index_of_sample(&mirrored(ip("198.51.100.1"), 1)), None);
            assert_eq!(t.index_of_sample(&mirrored(ip("192.0.3.9"), 1)), None);
            assert_eq!(t.index_of_sample(&mirrored(ip("2001:db9::7"), 1)), None);
        }
        assert_eq!(t.decls().len(), 2);
        assert_eq!(
            t.mirrors_refused(),
            MirrorsRefused {
                source: 3,
                over_cap: 0
            }
        );
    }

    /// 70,000 sessions from an allowed range: the first `max_sessions` become points, the
    /// rest are counted; the points stay few enough to be declared, so the agent stays
    /// connected (a POINTS frame past 65,535 points could never be sent).
    #[test]
    fn a_flood_of_mirror_sessions_stops_at_the_cap_and_is_counted() {
        let mut t = PointTable::new(vec![]).with_policy(MirrorPolicy {
            from: vec!["10.0.0.0/8".parse().unwrap()],
            max_sessions: 1024,
        });
        for k in 0..70_000u32 {
            let src = std::net::Ipv4Addr::from(0x0a00_0000 | (k / 7));
            t.index_of_sample(&mirrored(src.into(), k % 7));
        }
        assert_eq!(t.decls().len(), 1024);
        assert_eq!(t.mirrors_refused().over_cap, 70_000 - 1024);
        let frames = crate::protocol::points_frames(t.decls());
        assert!(!frames.is_empty());
    }

    #[test]
    fn address_ranges_parse_and_contain() {
        let c = |s: &str| s.parse::<Cidr>();
        let ip = |s: &str| s.parse::<std::net::IpAddr>().unwrap();
        assert!(c("10.1.0.0/16").unwrap().contains(ip("10.1.255.3")));
        assert!(!c("10.1.0.0/16").unwrap().contains(ip("10.2.0.3")));
        assert!(c("10.1.2.3").unwrap().contains(ip("10.1.2.3")));
        assert!(!c("10.1.2.3").unwrap().contains(ip("10.1.2.4")));
        assert!(c("10.0.0.0/7").unwrap().contains(ip("11.255.0.1")));
        assert!(!c("10.0.0.0/7").unwrap().contains(ip("12.0.0.1")));
        assert!(c("0.0.0.0/0").unwrap().contains(ip("203.0.113.1")));
        assert!(!c("0.0.0.0/0").unwrap().contains(ip("2001:db8::1")));
        assert!(
            c("10.0.0.0/8").unwrap().contains(ip("::ffff:10.9.9.9")),
            "mapped v4 is v4"
        );
        assert!(c("2001:db8::/33").unwrap().contains(ip("2001:db8:7fff::1")));
        assert!(!c("2001:db8::/33").unwrap().contains(ip("2001:db8:8000::1")));
        for bad in [
            "10.0.0.0/33",
            "2001:db8::/129",
            "10.0.0/8",
            "host",
            "10.0.0.0/x",
            "",
        ] {
            assert!(c(bad).is_err(), "{bad}");
        }
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
