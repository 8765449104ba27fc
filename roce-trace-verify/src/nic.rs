//! The lossless fabric's own evidence: checks over the NIC and PFC counters the agents
//! report per port (`[pfc]` and `[nic]` in the policy), each failure naming the host,
//! port and priority. A port without the counter a check needs is not judged and says
//! why; a check no port could be judged by has no data, never a pass.

use roce_trace_common::nic::{CounterId, Kind};
use roce_trace_correlate::{CollectorReport, FlowReport, NicIntervalReport, NicPortReport};

use crate::checks::{CheckResult, Evidence, Role, Status, role};

fn ev(p: &NicPortReport, at: Vec<String>, detail: String) -> Evidence {
    let mut a = vec![p.label()];
    a.extend(at);
    Evidence {
        flow: String::new(),
        at: a,
        detail,
    }
}

fn result(check: &str, rule: String) -> CheckResult {
    CheckResult {
        check: check.into(),
        rule,
        status: Status::Pass,
        checked: 0,
        summary: String::new(),
        evidence: Vec::new(),
    }
}

/// Pass, fail or no data from what was judged; `unjudged` names the ports that could not
/// be and why.
fn finish(mut r: CheckResult, what: &str, unjudged: Vec<String>) -> CheckResult {
    let not = if unjudged.is_empty() {
        String::new()
    } else {
        format!("; not judged: {}", unjudged.join("; "))
    };
    if r.checked == 0 {
        r.status = Status::NoData;
        r.summary = format!("no port reports {what}{not}");
    } else {
        r.status = if r.evidence.is_empty() {
            Status::Pass
        } else {
            Status::Fail
        };
        if r.summary.is_empty() {
            r.summary = format!("{} port(s) checked", r.checked);
        }
        r.summary.push_str(&not);
    }
    r
}

fn why(p: &NicPortReport, id: CounterId) -> String {
    let reason = p
        .why_not(id)
        .map_or("not reported".to_string(), |w| w.explain().to_string());
    format!("{}: {id} {reason}", p.label())
}

fn delta(i: &NicIntervalReport, id: CounterId) -> u64 {
    i.deltas.get(&id.to_string()).copied().unwrap_or(0)
}

const PAUSE: [(Kind, Kind, &str); 2] = [
    (Kind::RxPause, Kind::RxPauseDuration, "received"),
    (Kind::TxPause, Kind::TxPauseDuration, "sent"),
];

/// Whether a port reports any per-priority pause counter (frames or time, either way).
fn has_prio_pause(p: &NicPortReport) -> bool {
    (0..8).any(|pr| {
        PAUSE
            .iter()
            .any(|(f, d, _)| p.has(CounterId::prio(*f, pr)) || p.has(CounterId::prio(*d, pr)))
    })
}

/// `pfc.lossless_priorities`: pause frames or pause time on any other priority fail.
pub fn lossless(ports: &[NicPortReport], lossless: &[u8]) -> CheckResult {
    let mut r = result(
        "pfc_lossless",
        format!(
            "PFC pause only on the lossless priorities ({}), both directions, every port",
            lossless.iter().map(u8::to_string).collect::<Vec<_>>().join(", ")
        ),
    );
    let mut unjudged = Vec::new();
    let mut paused_ok = 0u64;
    for p in ports {
        if !has_prio_pause(p) {
            unjudged.push(why(
                p,
                CounterId::prio(Kind::RxPause, lossless.first().copied().unwrap_or(3)),
            ));
            continue;
        }
        r.checked += 1;
        for pr in 0..8u8 {
            for (frames, time, way) in PAUSE {
                let (f, d) = (CounterId::prio(frames, pr), CounterId::prio(time, pr));
                let n: u64 = p.intervals.iter().map(|i| delta(i, f)).sum();
                let us: u64 = p.intervals.iter().map(|i| delta(i, d)).sum();
                if n == 0 && us == 0 {
                    continue;
                }
                if lossless.contains(&pr) {
                    paused_ok += n;
                    continue;
                }
                r.evidence.push(ev(
                    p,
                    vec![format!("priority {pr}")],
                    format!(
                        "{n} pause frames {way} on priority {pr} (paused {:.1} ms), which is not lossless",
                        us as f64 / 1e3
                    ),
                ));
            }
        }
    }
    r.summary = format!(
        "{} port(s) with per-priority pause counters; {paused_ok} pause frames on lossless priorities",
        r.checked
    );
    finish(r, "per-priority pause counters", unjudged)
}

/// The share of an interval a port spent paused on `id` (pause time in µs).
fn ratio(i: &NicIntervalReport, id: CounterId) -> Option<f64> {
    let len_us = i.end_ns.saturating_sub(i.start_ns) as f64 / 1e3;
    (len_us > 0.0).then(|| delta(i, id) as f64 / len_us)
}

/// `pfc.max_pause_ratio`: pause time per second, per port, priority and direction, in
/// every interval.
pub fn pause_ratio(ports: &[NicPortReport], max: f64) -> CheckResult {
    let mut r = result(
        "pfc_pause_ratio",
        format!(
            "no port paused more than {:.1}% of any interval on any priority, either direction",
            max * 100.0
        ),
    );
    let mut unjudged = Vec::new();
    let mut worst = 0.0f64;
    for p in ports {
        let ids: Vec<(u8, CounterId, &str)> = (0..8u8)
            .flat_map(|pr| {
                PAUSE
                    .iter()
                    .map(move |(_, d, w)| (pr, CounterId::prio(*d, pr), *w))
            })
            .filter(|(_, id, _)| p.has(*id))
            .collect();
        if ids.is_empty() {
            unjudged.push(why(p, CounterId::prio(Kind::RxPauseDuration, 3)));
            continue;
        }
        r.checked += 1;
        for (pr, id, way) in ids {
            let over: Vec<(f64, &NicIntervalReport)> = p
                .intervals
                .iter()
                .filter_map(|i| ratio(i, id).map(|x| (x, i)))
                .collect();
            let Some(&(top, at)) = over.iter().max_by(|a, b| a.0.total_cmp(&b.0)) else {
                continue;
            };
            worst = worst.max(top);
            if top > max {
                let n = over.iter().filter(|(x, _)| *x > max).count();
                r.evidence.push(ev(
                    p,
                    vec![format!("priority {pr}")],
                    format!(
                        "paused ({way}) {:.1}% of an interval on priority {pr}, {n} of {} interval(s) over {:.1}% (worst at {})",
                        top * 100.0,
                        over.len(),
                        max * 100.0,
                        at.start_ns
                    ),
                ));
            }
        }
    }
    r.summary = format!(
        "{} port(s) with pause time counters; worst {:.1}% of an interval",
        r.checked,
        worst * 100.0
    );
    finish(r, "pause time per priority", unjudged)
}

/// A storm without storm counters: paused at least this share of two intervals in a row.
pub const STORM_RATIO: f64 = 0.95;

/// `pfc.no_storm`: the NIC's pause storm events, or a priority paused (nearly) all the
/// time for two intervals in a row.
pub fn no_storm(ports: &[NicPortReport]) -> CheckResult {
    let mut r = result(
        "pfc_storm",
        format!(
            "no pause storm: no storm warning or error events, no priority paused {:.0}% of two intervals in a row",
            STORM_RATIO * 100.0
        ),
    );
    let mut unjudged = Vec::new();
    for p in ports {
        let storm = [Kind::TxPauseStormWarning, Kind::TxPauseStormError].map(CounterId::port);
        let has_events = storm.iter().any(|id| p.has(*id));
        let durations: Vec<(u8, CounterId)> = (0..8u8)
            .flat_map(|pr| PAUSE.iter().map(move |(_, d, _)| (pr, CounterId::prio(*d, pr))))
            .filter(|(_, id)| p.has(*id))
            .collect();
        if !has_events && durations.is_empty() {
            unjudged.push(why(p, storm[0]));
            continue;
        }
        r.checked += 1;
        for id in storm {
            let n: u64 = p.intervals.iter().map(|i| delta(i, id)).sum();
            if n > 0 {
                r.evidence.push(ev(p, Vec::new(), format!("{n} {id}")));
            }
        }
        for (pr, id) in durations {
            let run = p
                .intervals
                .windows(2)
                .find(|w| w.iter().all(|i| ratio(i, id).is_some_and(|x| x >= STORM_RATIO)));
            if let Some(w) = run {
                r.evidence.push(ev(
                    p,
                    vec![format!("priority {pr}")],
                    format!(
                        "{id}: paused {:.0}% and {:.0}% of two intervals in a row (from {})",
                        ratio(&w[0], id).unwrap_or(0.0) * 100.0,
                        ratio(&w[1], id).unwrap_or(0.0) * 100.0,
                        w[0].start_ns
                    ),
                ));
            }
        }
    }
    finish(r, "pause storm events or pause time", unjudged)
}

fn total(p: &NicPortReport, k: Kind) -> Option<u64> {
    p.total_since(CounterId::port(k), 0)
}

fn ppm(n: u64, of: u64) -> u64 {
    n.saturating_mul(1_000_000).checked_div(of).unwrap_or(0)
}

/// `nic.max_seq_err_ppm`: PSN sequence errors per million RDMA packets, per port — the
/// requester's (NAKs and implied NAKs) over what it sent, the responder's out-of-sequence
/// packets over what it received.
pub fn seq_err(ports: &[NicPortReport], max: u64) -> CheckResult {
    let mut r = result(
        "nic_seq_err",
        format!("at most {max} PSN sequence errors per million RDMA packets, per port and side"),
    );
    let mut unjudged = Vec::new();
    for p in ports {
        let sides = [
            (
                "requester",
                [Kind::PacketSeqErr, Kind::ImpliedNakSeqErr].as_slice(),
                Kind::TxVportRdmaPackets,
            ),
            (
                "responder",
                [Kind::OutOfSequence].as_slice(),
                Kind::RxVportRdmaPackets,
            ),
        ];
        let mut judged = false;
        for (side, errs, pkts) in sides {
            let e: Vec<u64> = errs.iter().filter_map(|k| total(p, *k)).collect();
            let (Some(n), false) = (total(p, pkts), e.is_empty()) else {
                continue;
            };
            judged = true;
            let errs: u64 = e.iter().sum();
            if errs > 0 && ppm(errs, n) > max {
                r.evidence.push(ev(
                    p,
                    Vec::new(),
                    format!(
                        "{side}: {errs} sequence errors for {n} RDMA packets ({} ppm)",
                        ppm(errs, n)
                    ),
                ));
            }
        }
        if judged {
            r.checked += 1;
        } else {
            // Name what it lacks: the error counters first, then the packet counts.
            let lacks = [
                Kind::PacketSeqErr,
                Kind::OutOfSequence,
                Kind::TxVportRdmaPackets,
                Kind::RxVportRdmaPackets,
            ]
            .map(CounterId::port)
            .into_iter()
            .find(|id| !p.has(*id))
            .unwrap_or(CounterId::port(Kind::PacketSeqErr));
            unjudged.push(why(p, lacks));
        }
    }
    finish(r, "sequence errors with RDMA packet counts", unjudged)
}

/// `nic.max_timeout_per_s`: local ACK timeouts per second, per port.
pub fn timeouts(ports: &[NicPortReport], max: f64) -> CheckResult {
    let mut r = result(
        "nic_timeouts",
        format!("at most {max} local ACK timeouts per second, per port"),
    );
    let mut unjudged = Vec::new();
    for p in ports {
        let id = CounterId::port(Kind::LocalAckTimeoutErr);
        let (Some(n), secs) = (
            total(p, Kind::LocalAckTimeoutErr),
            p.covered_ns_since(0) as f64 / 1e9,
        ) else {
            unjudged.push(why(p, id));
            continue;
        };
        if secs <= 0.0 {
            unjudged.push(format!("{}: no interval reported", p.label()));
            continue;
        }
        r.checked += 1;
        let rate = n as f64 / secs;
        if rate > max {
            r.evidence.push(ev(
                p,
                Vec::new(),
                format!("{n} local ACK timeouts in {secs:.1} s ({rate:.2}/s)"),
            ));
        }
    }
    finish(r, "local ACK timeouts", unjudged)
}

/// CNPs seen on the wire from and to a port's addresses (each CNP flow's count at its
/// busiest point), and CE marks on the data arriving at them (each data flow's at its
/// last point: what the NIC received).
fn wire_cnps(flows: &[FlowReport], p: &NicPortReport) -> (u64, u64, u64) {
    let (mut sent, mut got, mut ce) = (0u64, 0u64, 0u64);
    for f in flows {
        match role(f) {
            Some(Role::Cnp) => {
                let n = f.counters.values().map(|c| c.counts.cnp).max().unwrap_or(0);
                if p.addrs.contains(&f.src_ip) {
                    sent = sent.saturating_add(n);
                }
                if p.addrs.contains(&f.dst_ip) {
                    got = got.saturating_add(n);
                }
            }
            Some(Role::Data) if p.addrs.contains(&f.dst_ip) => {
                let at_end = f.path.last().and_then(|x| f.counters.get(x));
                ce = ce.saturating_add(at_end.map_or(0, |c| c.counts.ecn[3]));
            }
            _ => {}
        }
    }
    (sent, got, ce)
}

/// Counts that may differ by this much whatever the tolerance: a NIC's interval and the
/// flows' window do not end at the same instant.
pub const CNP_SLACK: u64 = 2;

/// `nic.cnp_consistency`: the CNPs a port's NIC says it sent (and handled) against those
/// seen on the wire from (and to) its addresses, within a tolerance. Fewer on the wire:
/// CNPs lost, or sent in a class the fabric drops; more: CNPs the NIC does not count.
pub fn cnp_consistency(report: &CollectorReport, tol: f64) -> CheckResult {
    let mut r = result(
        "nic_cnp_consistency",
        format!(
            "the CNPs each NIC sent and handled, and the CE marks it received, match the wire within {:.0}% (± {CNP_SLACK})",
            tol * 100.0
        ),
    );
    let mut unjudged = Vec::new();
    for p in &report.nic {
        if p.addrs.is_empty() {
            unjudged.push(format!("{}: its agent reported no address", p.label()));
            continue;
        }
        let (wire_sent, wire_got, wire_ce) = wire_cnps(&report.flows, p);
        let mut judged = false;
        for (k, wire, what) in [
            (Kind::NpCnpSent, wire_sent, "sent"),
            (Kind::RpCnpHandled, wire_got, "handled"),
            (Kind::NpEcnMarkedRocePackets, wire_ce, "received CE-marked"),
        ] {
            let Some(nic) = total(p, k) else {
                continue;
            };
            judged = true;
            let diff = nic.abs_diff(wire);
            if diff > CNP_SLACK && diff as f64 > tol * nic.max(wire) as f64 {
                let (unit, hint) = match (k, wire < nic) {
                    (Kind::NpEcnMarkedRocePackets, true) => (
                        "packets",
                        "fewer CE marks on the wire: marked after the last observed point",
                    ),
                    (Kind::NpEcnMarkedRocePackets, false) => {
                        ("packets", "more CE marks on the wire than the NIC counted")
                    }
                    (_, true) => ("CNPs", "fewer on the wire: CNPs lost or in a class not observed"),
                    (_, false) => ("CNPs", "more on the wire than the NIC counted"),
                };
                r.evidence.push(ev(
                    p,
                    Vec::new(),
                    format!(
                        "the NIC {what} {nic} {unit} ({}), the wire shows {wire}: {hint}",
                        CounterId::port(k)
                    ),
                ));
            }
        }
        if judged {
            r.checked += 1;
        } else {
            unjudged.push(why(p, CounterId::port(Kind::NpCnpSent)));
        }
    }
    finish(r, "CNP counters", unjudged)
}
