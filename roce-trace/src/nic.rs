//! NIC and PFC counters as a user sees them: `roce-trace nic`, the PFC and NIC lines of
//! `capture`, and their JSON records. The reading is `roce_trace_datapath::nic`.

use std::collections::BTreeMap;

use serde::Serialize;

pub use roce_trace_datapath::nic::*;

/// One counter in a record.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct CounterRecord {
    pub value: u64,
    /// The driver's own name, when it differs from the canonical one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub driver_name: Option<String>,
    /// The increase since the previous read: absent on the first read and after a reset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delta: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub per_second: Option<f64>,
    /// `first` (no previous read), `delta`, `wrapped` (a 32-bit counter passed its
    /// maximum; the delta counts across it) or `reset` (it went down: no delta).
    pub step: &'static str,
}

/// Counters that are not there, grouped by reason.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct AbsentRecord {
    pub why: &'static str,
    pub counters: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// One port's counters at one read: the `nic` JSON record (`roce-trace nic --json`,
/// `capture --json`).
#[derive(Clone, Debug, Serialize)]
pub struct NicRecord {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub time_ns: u64,
    pub interface: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub netdev_driver: Option<String>,
    pub names: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rdma_device: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rdma_port: Option<u32>,
    /// Real time since the previous read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub elapsed_ns: Option<u64>,
    /// Every counter started again since the previous read (a new boot or interface).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub counters_reset: bool,
    pub counters: BTreeMap<String, CounterRecord>,
    /// Keyed by reason (`pfc_not_enabled`, `no_rdma_device`, …).
    pub not_available: BTreeMap<&'static str, AbsentRecord>,
    /// The driver's counters no canonical name covers (with `--all`).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub other: BTreeMap<String, u64>,
    /// `capture`: what the kernel datapath counted on this interface over the same
    /// interval, beside the NIC's own counters.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kernel: Option<KernelCounts>,
}

/// The record of a read, with the interval since the previous one when there was one.
pub fn record(port: &Port, r: &Reading, iv: Option<&Interval>, all: bool) -> NicRecord {
    let mut counters = BTreeMap::new();
    for (id, v) in &r.values {
        let change = iv.and_then(|i| i.get(*id));
        let name = id.to_string();
        counters.insert(
            name.clone(),
            CounterRecord {
                value: v.value,
                driver_name: (v.raw != name).then(|| v.raw.clone()),
                delta: change.and_then(|c| c.step.delta()),
                per_second: iv.and_then(|i| i.rate(*id)),
                step: match change.map(|c| c.step) {
                    None => "first",
                    Some(Step::Delta(_)) => "delta",
                    Some(Step::Wrapped(_)) => "wrapped",
                    Some(Step::Reset) => "reset",
                },
            },
        );
    }
    let missing = iv.map(|i| &i.missing).unwrap_or(&r.missing);
    let mut not_available: BTreeMap<&'static str, AbsentRecord> = BTreeMap::new();
    for (id, a) in missing {
        let e = not_available
            .entry(a.why.as_str())
            .or_insert_with(|| AbsentRecord {
                why: a.why.explain(),
                counters: Vec::new(),
                detail: a.detail.clone(),
            });
        e.counters.push(id.to_string());
    }
    NicRecord {
        kind: "nic",
        time_ns: crate::protocol::unix_now_ns(),
        interface: port.netdev.clone(),
        netdev_driver: port.driver.clone(),
        names: r.driver.as_str(),
        rdma_device: port.rdma.as_ref().map(|p| p.device.clone()),
        rdma_port: port.rdma.as_ref().map(|p| p.port),
        elapsed_ns: iv.map(|i| i.elapsed_ns),
        counters_reset: iv.is_some_and(|i| i.epoch_changed),
        counters,
        not_available,
        other: if all {
            r.other
                .iter()
                .map(|(s, n, v)| {
                    let src = match s {
                        Source::Ethtool => "ethtool",
                        Source::Rdma => "rdma",
                    };
                    (format!("{src}:{n}"), *v)
                })
                .collect()
        } else {
            BTreeMap::new()
        },
        kernel: None,
    }
}

/// Counter names with their priorities folded: `rx_prio{0-2,4-7}_pause`.
pub fn compact(ids: &[CounterId]) -> Vec<String> {
    let mut by_kind: BTreeMap<Kind, Vec<u8>> = BTreeMap::new();
    let mut out = Vec::new();
    for id in ids {
        match id.prio {
            Some(p) => by_kind.entry(id.kind).or_default().push(p),
            None => out.push(id.to_string()),
        }
    }
    for (kind, mut ps) in by_kind {
        ps.sort_unstable();
        let s = kind.spec();
        let mut ranges: Vec<String> = Vec::new();
        let mut i = 0;
        while i < ps.len() {
            let mut j = i;
            while j + 1 < ps.len() && ps[j + 1] == ps[j] + 1 {
                j += 1;
            }
            ranges.push(if i == j {
                ps[i].to_string()
            } else {
                format!("{}-{}", ps[i], ps[j])
            });
            i = j + 1;
        }
        let prios = if ranges.len() == 1 && !ranges[0].contains('-') {
            ranges.remove(0)
        } else {
            format!("{{{}}}", ranges.join(","))
        };
        out.push(format!("{}{prios}{}", s.prefix, s.suffix.unwrap_or("")));
    }
    out
}

fn header(port: &Port, r: &Reading) -> String {
    let drv = port.driver.as_deref().unwrap_or("driver unknown");
    match &port.rdma {
        Some(rp) => format!(
            "{} ({drv}, RDMA {} port {}, {} names)",
            port.netdev,
            rp.device,
            rp.port,
            r.driver.as_str()
        ),
        None => format!(
            "{} ({drv}, no RDMA device, {} names)",
            port.netdev,
            r.driver.as_str()
        ),
    }
}

fn missing_lines(missing: &BTreeMap<CounterId, Absent>) -> Vec<String> {
    let mut by: BTreeMap<Missing, (Vec<CounterId>, Option<String>)> = BTreeMap::new();
    for (id, a) in missing {
        let e = by.entry(a.why).or_default();
        e.0.push(*id);
        if e.1.is_none() {
            e.1 = a.detail.clone();
        }
    }
    by.into_iter()
        .map(|(why, (ids, detail))| {
            let mut l = format!("  not available: {}: {}", why.explain(), compact(&ids).join(", "));
            if let Some(d) = detail {
                l.push_str(&format!(" ({d})"));
            }
            l
        })
        .collect()
}

/// `roce-trace nic` without an interval: every counter the port has, and what it has not.
pub fn render_reading(port: &Port, r: &Reading, all: bool) -> String {
    let mut out = vec![header(port, r)];
    let w = r.values.keys().map(|id| id.to_string().len()).max().unwrap_or(0);
    for (id, v) in &r.values {
        let name = id.to_string();
        let raw = if v.raw != name {
            format!("  ({})", v.raw)
        } else {
            String::new()
        };
        out.push(format!("  {name:<w$}  {:>16}{raw}", v.value));
    }
    out.extend(missing_lines(&r.missing));
    if all {
        for (s, n, v) in &r.other {
            out.push(format!(
                "  {:<7} {n}: {v}",
                if *s == Source::Rdma { "rdma" } else { "ethtool" }
            ));
        }
    }
    out.join("\n")
}

fn fmt_rate(x: f64) -> String {
    if x >= 100.0 || x == 0.0 {
        format!("{x:.0}")
    } else {
        format!("{x:.1}")
    }
}

/// PFC on one port over one interval: a line per priority with pause in either
/// direction, pause frames and pause time per second (pause time as a share of the
/// second too). Empty when no priority paused.
pub fn pfc_lines(iv: &Interval) -> Vec<String> {
    let mut out = Vec::new();
    for p in 0..8u8 {
        let frames = |k| iv.rate(CounterId::prio(k, p));
        let us = |k| iv.rate(CounterId::prio(k, p));
        let (rx, tx) = (frames(Kind::RxPause), frames(Kind::TxPause));
        let (rxd, txd) = (us(Kind::RxPauseDuration), us(Kind::TxPauseDuration));
        let active = [rx, tx, rxd, txd].iter().any(|x| x.is_some_and(|x| x > 0.0));
        if !active {
            continue;
        }
        let side = |f: Option<f64>, d: Option<f64>| match (f, d) {
            (None, None) => "n/a".to_string(),
            (f, d) => format!(
                "{} pause/s, {}",
                f.map_or("n/a".into(), fmt_rate),
                d.map_or("pause time n/a".into(), |d| format!(
                    "paused {:.1} ms/s ({:.1}%)",
                    d / 1e3,
                    d / 1e4
                ))
            ),
        };
        out.push(format!(
            "pfc {} prio {p}: rx {}; tx {}",
            iv.netdev,
            side(rx, rxd),
            side(tx, txd)
        ));
    }
    for (k, what) in [
        (Kind::TxPauseStormWarning, "pause storm warnings"),
        (
            Kind::TxPauseStormError,
            "pause storm errors (the NIC stopped sending pause)",
        ),
    ] {
        if let Some(d) = iv.get(CounterId::port(k)).and_then(|c| c.step.delta())
            && d > 0
        {
            out.push(format!("pfc {}: {d} {what}", iv.netdev));
        }
    }
    out
}

/// The NIC's congestion counters over one interval beside what roce-trace counted in the
/// kernel on the same interface (`None`: not counted there): CNPs sent and received, CE
/// marks received. `None` when the port has none of them.
pub fn nic_line(iv: &Interval, kernel: Option<KernelCounts>) -> Option<String> {
    let d = |k| iv.get(CounterId::port(k)).and_then(|c| c.step.delta());
    let (sent, handled, ce) = (
        d(Kind::NpCnpSent),
        d(Kind::RpCnpHandled),
        d(Kind::NpEcnMarkedRocePackets),
    );
    if sent.is_none() && handled.is_none() && ce.is_none() {
        return None;
    }
    let n = |x: Option<u64>| x.map_or("n/a".to_string(), |x| x.to_string());
    let mut l = format!(
        "nic {}: CNPs sent {}, CNPs handled {}, CE received {}",
        iv.netdev,
        n(sent),
        n(handled),
        n(ce)
    );
    if let Some(k) = kernel {
        l.push_str(&format!(
            " | kernel saw: CNPs out {}, CNPs in {}, CE in {}",
            k.cnp_tx, k.cnp_rx, k.ce_rx
        ));
    }
    Some(l)
}

/// What the kernel datapath counted on one interface over the same interval.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct KernelCounts {
    pub cnp_tx: u64,
    pub cnp_rx: u64,
    pub ce_rx: u64,
}

/// `roce-trace nic --interval`: what changed, rates, resets, and the PFC lines.
pub fn render_interval(port: &Port, iv: &Interval) -> String {
    let mut out = vec![format!(
        "{} over {:.2} s{}",
        port.netdev,
        iv.elapsed_ns as f64 / 1e9,
        if iv.epoch_changed {
            ": every counter was reset (new boot or interface) — no deltas this interval"
        } else {
            ""
        }
    )];
    out.extend(pfc_lines(iv).into_iter().map(|l| format!("  {l}")));
    for c in &iv.changes {
        match c.step {
            Step::Delta(0) => {}
            Step::Delta(d) => out.push(format!(
                "  {:<36} +{d} ({}/s)",
                c.id.to_string(),
                fmt_rate(iv.rate(c.id).unwrap_or(0.0))
            )),
            Step::Wrapped(d) => out.push(format!(
                "  {:<36} +{d} ({}/s), wrapped at 2^32",
                c.id.to_string(),
                fmt_rate(iv.rate(c.id).unwrap_or(0.0))
            )),
            Step::Reset if !iv.epoch_changed => out.push(format!(
                "  {:<36} reset (went down to {}): no delta",
                c.id.to_string(),
                c.value
            )),
            Step::Reset => {}
        }
    }
    let gone: Vec<CounterId> = iv
        .missing
        .iter()
        .filter(|(_, a)| a.why == Missing::Gone)
        .map(|(id, _)| *id)
        .collect();
    if !gone.is_empty() {
        out.push(format!(
            "  gone since the previous read: {}",
            compact(&gone).join(", ")
        ));
    }
    out.join("\n")
}

/// The NIC counters of the interfaces a capture observes, read at each refresh: the
/// interfaces with an RDMA device or PFC counters; the others have nothing to add.
pub struct NicWatch {
    root: Root,
    ports: Vec<Port>,
    tracker: Tracker,
    /// Per port: the sum of every known delta so far, and the time they cover.
    totals: std::collections::HashMap<String, (BTreeMap<CounterId, u64>, u64)>,
}

/// One port's read at a refresh.
pub struct NicTick<'a> {
    pub port: &'a Port,
    pub reading: Reading,
    pub interval: Option<Interval>,
}

impl NicWatch {
    /// `None` when none of `ifaces` has NIC counters worth showing (or they cannot be
    /// found: said once, the capture goes on).
    pub fn open(root: Root, ifaces: &[String]) -> Option<Self> {
        // Every interface the root has, then those observed: one the root does not have
        // (a fixture naming some ports only) simply has no NIC counters.
        let ports = match ports(&root, &[]) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!("NIC counters: {e}; going on without them");
                return None;
            }
        };
        let ports: Vec<Port> = ports
            .into_iter()
            .filter(|p| ifaces.contains(&p.netdev))
            .filter(|p| {
                p.rdma.is_some() || {
                    let r = read(&root, p);
                    r.values.keys().any(|id| id.kind.is_pause())
                }
            })
            .collect();
        if ports.is_empty() {
            return None;
        }
        for p in &ports {
            tracing::info!(
                "NIC counters of {}{}",
                p.netdev,
                p.rdma
                    .as_ref()
                    .map(|r| format!(" (RDMA {} port {})", r.device, r.port))
                    .unwrap_or_default()
            );
        }
        Some(Self {
            root,
            ports,
            tracker: Tracker::default(),
            totals: Default::default(),
        })
    }

    pub fn ports(&self) -> &[Port] {
        &self.ports
    }

    /// Reads every port now.
    pub fn tick(&mut self) -> Vec<NicTick<'_>> {
        let mut out = Vec::new();
        for p in &self.ports {
            let r = read(&self.root, p);
            let iv = self.tracker.update(&p.netdev, r.clone());
            if let Some(iv) = &iv {
                let (sums, ns) = self.totals.entry(p.netdev.clone()).or_default();
                *ns += iv.elapsed_ns;
                for c in &iv.changes {
                    if let Some(d) = c.step.delta() {
                        let s = sums.entry(c.id).or_default();
                        *s = s.saturating_add(d);
                    }
                }
            }
            out.push(NicTick {
                port: p,
                reading: r,
                interval: iv,
            });
        }
        out
    }

    /// Every port's whole capture as one interval: the sums of the deltas of every
    /// refresh (an interval in which a counter reset adds nothing for it).
    pub fn whole(&self) -> Vec<Interval> {
        self.ports
            .iter()
            .filter_map(|p| {
                let (sums, ns) = self.totals.get(&p.netdev)?;
                Some(Interval {
                    netdev: p.netdev.clone(),
                    elapsed_ns: *ns,
                    epoch_changed: false,
                    changes: sums
                        .iter()
                        .map(|(id, d)| Change {
                            id: *id,
                            value: 0,
                            step: Step::Delta(*d),
                        })
                        .collect(),
                    missing: BTreeMap::new(),
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priorities_fold_into_ranges() {
        let ids: Vec<CounterId> = [0, 1, 2, 4, 5, 6, 7]
            .iter()
            .map(|&p| CounterId::prio(Kind::RxPause, p))
            .chain([
                CounterId::prio(Kind::TxPause, 3),
                CounterId::port(Kind::NpCnpSent),
            ])
            .collect();
        assert_eq!(
            compact(&ids),
            ["np_cnp_sent", "rx_prio{0-2,4-7}_pause", "tx_prio3_pause"]
        );
    }
}
