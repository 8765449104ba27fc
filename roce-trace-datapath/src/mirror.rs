//! Mirror sessions (GRE, ERSPAN I/II/III) as observation points: the switch that
//! mirrored the copies, its session, and the table that names the mirror ids flow keys
//! carry — filled from the kernel's `MIRRORS` map, the pcap reader's own parse, and
//! samples.

use std::{
    collections::{HashMap, HashSet},
    net::IpAddr,
};

use roce_trace_common::{datapath::*, flow::ip_of_mapped};

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
