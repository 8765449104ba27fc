//! The NIC and PFC counters the agents report, kept per port (node and interface) next to
//! the packet data: a bounded series of intervals each, and what each port lacks.

use std::collections::{BTreeMap, VecDeque};

use roce_trace_common::nic::{CounterId, Driver, Missing};
use serde::{Deserialize, Serialize};

use crate::observation::NicDelta;

/// Intervals kept per port (five minutes at 1 s).
pub const NIC_INTERVALS: usize = 300;
/// Ports kept at most (a node naming thousands of interfaces cannot grow the table
/// without bound): those past it are counted, not kept.
pub const MAX_NIC_PORTS: usize = 4096;

/// One port's counters over one interval: the canonical counters that moved.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NicIntervalReport {
    pub start_ns: u64,
    pub end_ns: u64,
    /// Every counter was reset in this interval (a reboot, a driver reload): it has no
    /// deltas.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reset: bool,
    /// Canonical name → increase, for the counters that moved.
    #[serde(default)]
    pub deltas: BTreeMap<String, u64>,
}

/// One port as the collector knows it (`/report`'s `nic`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NicPortReport {
    pub node: String,
    pub iface: String,
    /// Whose counter names were read (`mlx5`, `bnxt`, …).
    pub names: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdma_device: Option<String>,
    /// The interface's addresses: the flows it sends and receives.
    #[serde(default)]
    pub addrs: Vec<std::net::IpAddr>,
    /// Oldest first, at most [`NIC_INTERVALS`].
    pub intervals: Vec<NicIntervalReport>,
    /// The canonical counters the port has (at its latest report).
    pub available: Vec<String>,
    /// The canonical counters it has not, with the reason code (`pfc_not_enabled`, …).
    pub not_available: BTreeMap<String, String>,
}

impl NicPortReport {
    /// `host/iface (rdma)`: how evidence names a port.
    pub fn label(&self) -> String {
        match &self.rdma_device {
            Some(d) => format!("{}/{} ({d})", self.node, self.iface),
            None => format!("{}/{}", self.node, self.iface),
        }
    }

    pub fn has(&self, id: CounterId) -> bool {
        self.available.iter().any(|n| *n == id.to_string())
    }

    /// Why the port lacks `id`, when it does.
    pub fn why_not(&self, id: CounterId) -> Option<Missing> {
        self.not_available
            .get(&id.to_string())
            .and_then(|w| Missing::parse(w))
    }

    /// The sum of a counter's deltas over the intervals from `from_ns` on (intervals
    /// that reset add nothing); None when the port does not have it.
    pub fn total_since(&self, id: CounterId, from_ns: u64) -> Option<u64> {
        if !self.has(id) {
            return None;
        }
        let name = id.to_string();
        Some(
            self.intervals
                .iter()
                .filter(|i| i.start_ns >= from_ns)
                .filter_map(|i| i.deltas.get(&name))
                .fold(0u64, |a, b| a.saturating_add(*b)),
        )
    }

    /// The time the intervals from `from_ns` on cover.
    pub fn covered_ns_since(&self, from_ns: u64) -> u64 {
        self.intervals
            .iter()
            .filter(|i| i.start_ns >= from_ns)
            .map(|i| i.end_ns.saturating_sub(i.start_ns))
            .fold(0u64, u64::saturating_add)
    }
}

#[derive(Clone, Debug, Default)]
struct PortState {
    names: String,
    rdma_device: Option<String>,
    addrs: Vec<std::net::IpAddr>,
    intervals: VecDeque<NicIntervalReport>,
    available: Vec<String>,
    not_available: BTreeMap<String, String>,
}

/// Every port's NIC counters.
#[derive(Clone, Debug, Default)]
pub struct NicTable {
    ports: BTreeMap<(String, String), PortState>,
    /// Reports refused: a port past [`MAX_NIC_PORTS`].
    pub refused: u64,
    /// Counters named by codes this collector does not know (a newer agent): skipped.
    pub unknown_counters: u64,
}

impl NicTable {
    /// One port's interval from `node`'s agent.
    pub fn add(&mut self, node: &str, d: &NicDelta) {
        let key = (node.to_owned(), d.iface.clone());
        if !self.ports.contains_key(&key) && self.ports.len() >= MAX_NIC_PORTS {
            self.refused += 1;
            return;
        }
        let p = self.ports.entry(key).or_default();
        p.names = Driver::from_code(d.driver)
            .unwrap_or(Driver::Other)
            .as_str()
            .to_owned();
        p.rdma_device = (!d.rdma_device.is_empty()).then(|| d.rdma_device.clone());
        p.addrs = d
            .addrs
            .iter()
            .take(64)
            .map(|a| {
                let v6 = std::net::Ipv6Addr::from(*a);
                v6.to_ipv4_mapped()
                    .map_or(std::net::IpAddr::V6(v6), std::net::IpAddr::V4)
            })
            .collect();
        let mut deltas = BTreeMap::new();
        let mut available = Vec::with_capacity(d.values.len());
        for v in &d.values {
            let Some(id) = v.counter.id() else {
                self.unknown_counters += 1;
                continue;
            };
            let name = id.to_string();
            if let Some(x) = v.delta.filter(|x| *x > 0)
                && !d.epoch_changed
            {
                deltas.insert(name.clone(), x);
            }
            available.push(name);
        }
        let mut not_available = BTreeMap::new();
        for (c, why) in &d.missing {
            let (Some(id), Some(why)) = (c.id(), Missing::from_code(*why)) else {
                self.unknown_counters += 1;
                continue;
            };
            not_available.insert(id.to_string(), why.as_str().to_owned());
        }
        p.available = available;
        p.not_available = not_available;
        if p.intervals.len() == NIC_INTERVALS {
            p.intervals.pop_front();
        }
        p.intervals.push_back(NicIntervalReport {
            start_ns: d.start_ns,
            end_ns: d.end_ns,
            reset: d.epoch_changed,
            deltas,
        });
    }

    /// Ports reporting NIC counters.
    pub fn ports(&self) -> usize {
        self.ports.len()
    }

    /// Ports whose NIC paused (per-priority pause frames or time, or storm events) in the
    /// intervals kept — without building their reports.
    pub fn paused_ports(&self) -> usize {
        let pause = |name: &str| {
            CounterId::parse(name).is_some_and(|id| {
                id.kind.is_pause()
                    || matches!(
                        id.kind,
                        roce_trace_common::nic::Kind::TxPauseStormWarning
                            | roce_trace_common::nic::Kind::TxPauseStormError
                    )
            })
        };
        self.ports
            .values()
            .filter(|p| p.intervals.iter().any(|i| i.deltas.keys().any(|k| pause(k))))
            .count()
    }

    /// Every port, by node and interface.
    pub fn report(&self) -> Vec<NicPortReport> {
        self.ports
            .iter()
            .map(|((node, iface), p)| NicPortReport {
                node: node.clone(),
                iface: iface.clone(),
                names: p.names.clone(),
                rdma_device: p.rdma_device.clone(),
                addrs: p.addrs.clone(),
                intervals: p.intervals.iter().cloned().collect(),
                available: p.available.clone(),
                not_available: p.not_available.clone(),
            })
            .collect()
    }
}

/// What a port's NIC paused over its intervals: per priority and direction, frames and
/// time; the storm events. None when it did not pause.
pub fn pause_summary(p: &NicPortReport) -> Option<String> {
    use roce_trace_common::nic::Kind;
    let sum = |id: CounterId| -> u64 {
        let n = id.to_string();
        p.intervals
            .iter()
            .filter_map(|i| i.deltas.get(&n))
            .fold(0u64, |a, b| a.saturating_add(*b))
    };
    let mut parts = Vec::new();
    for pr in 0..8u8 {
        for (f, d, way) in [
            (Kind::RxPause, Kind::RxPauseDuration, "received"),
            (Kind::TxPause, Kind::TxPauseDuration, "sent"),
        ] {
            let (n, us) = (sum(CounterId::prio(f, pr)), sum(CounterId::prio(d, pr)));
            if n > 0 || us > 0 {
                parts.push(format!(
                    "priority {pr}: {n} pause frames {way}, paused {:.1} ms",
                    us as f64 / 1e3
                ));
            }
        }
    }
    for k in [Kind::TxPauseStormWarning, Kind::TxPauseStormError] {
        let n = sum(CounterId::port(k));
        if n > 0 {
            parts.push(format!("{n} {}", CounterId::port(k)));
        }
    }
    if parts.is_empty() {
        return None;
    }
    let (from, to) = (
        p.intervals.first().map_or(0, |i| i.start_ns),
        p.intervals.last().map_or(0, |i| i.end_ns),
    );
    Some(format!(
        "{} paused over {:.0} s: {}",
        p.label(),
        to.saturating_sub(from) as f64 / 1e9,
        parts.join("; ")
    ))
}

/// A `pfc_pause` anomaly for every flow that crosses a port whose NIC paused: the flows a
/// pause (or a storm) on that port holds up.
pub fn pause_anomalies(flows: &[crate::FlowReport], ports: &[NicPortReport]) -> Vec<crate::Anomaly> {
    let mut out = Vec::new();
    for p in ports {
        let Some(detail) = pause_summary(p) else {
            continue;
        };
        for f in flows {
            let at: Vec<crate::Point> = f
                .path
                .iter()
                .filter(|x| x.node == p.node && x.iface == p.iface)
                .cloned()
                .collect();
            if at.is_empty() {
                continue;
            }
            out.push(crate::Anomaly {
                kind: crate::AnomalyKind::PfcPause,
                flow: f.id.clone(),
                between: at,
                detail: detail.clone(),
                packets: 0,
            });
        }
    }
    out
}

/// The NIC ports of a window: each port's intervals that began at or after `from_ns`.
pub fn nic_since(ports: &[NicPortReport], from_ns: u64) -> Vec<NicPortReport> {
    ports
        .iter()
        .map(|p| {
            let mut p = p.clone();
            p.intervals.retain(|i| i.start_ns >= from_ns);
            p
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use roce_trace_common::nic::{Kind, Missing};

    use super::*;
    use crate::observation::{NicCounter, NicValue};

    fn delta(start: u64, vals: &[(CounterId, u64, Option<u64>)]) -> NicDelta {
        NicDelta {
            iface: "eth0".into(),
            driver: Driver::Mlx5 as u8,
            rdma_device: "mlx5_0".into(),
            addrs: vec![std::net::Ipv4Addr::new(10, 0, 0, 1).to_ipv6_mapped().octets()],
            start_ns: start,
            end_ns: start + 1_000_000_000,
            epoch_changed: false,
            values: vals
                .iter()
                .map(|(id, total, d)| NicValue {
                    counter: NicCounter::of(*id),
                    total: *total,
                    delta: *d,
                })
                .collect(),
            missing: vec![(
                NicCounter::of(CounterId::prio(Kind::RxPause, 0)),
                Missing::PfcNotEnabled as u8,
            )],
        }
    }

    #[test]
    fn ports_keep_a_bounded_series_and_sum_over_a_window() {
        let p3 = CounterId::prio(Kind::RxPause, 3);
        let mut t = NicTable::default();
        for i in 0..(NIC_INTERVALS as u64 + 10) {
            t.add("h1", &delta(i * 1_000_000_000, &[(p3, i * 5, Some(5))]));
        }
        let r = t.report();
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].intervals.len(), NIC_INTERVALS);
        assert_eq!(r[0].label(), "h1/eth0 (mlx5_0)");
        assert_eq!(r[0].total_since(p3, 0), Some(5 * NIC_INTERVALS as u64));
        assert_eq!(r[0].total_since(p3, 300 * 1_000_000_000), Some(50));
        assert_eq!(r[0].total_since(CounterId::port(Kind::NpCnpSent), 0), None);
        assert_eq!(
            r[0].why_not(CounterId::prio(Kind::RxPause, 0)),
            Some(Missing::PfcNotEnabled)
        );
        // A reset interval and an unknown code add nothing.
        let mut d = delta(0, &[(p3, 1, Some(9))]);
        d.epoch_changed = true;
        d.values.push(NicValue {
            counter: NicCounter {
                kind: 250,
                prio: 0xff,
            },
            total: 1,
            delta: Some(1),
        });
        let mut t = NicTable::default();
        t.add("h1", &d);
        assert_eq!(t.report()[0].total_since(p3, 0), Some(0));
        assert_eq!(t.unknown_counters, 1);
    }
}
