//! Failure drills: while traffic runs, take a link (or a spine) away and bring it back,
//! and measure what the flows went through — sampled packets lost during the event, the
//! time until every affected flow is on a remaining path, the spread over what is left,
//! and whether each flow returns to its path from before once the repair is done.
//!
//! The failure is an action: a command roce-trace runs (the lab's `cargo xtask lab fault
//! …`, a switch CLI over ssh), or, without one, the user doing it when asked. Times come
//! from the agents' clocks, so they must agree with this host's (NTP/PTP; in the lab they
//! are one clock).

use std::{
    collections::BTreeMap,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::Context as _;
use serde::{Deserialize, Serialize};

use super::{
    checks::{CheckResult, Evidence, Role, Status, ecmp_shares, role},
    policy::Policy,
};
use crate::{
    collector::CollectorReport,
    correlate::{FlowReport, path_nodes},
};

#[derive(Clone, Debug)]
pub struct DrillOptions {
    /// Shell command that causes the failure; none: the user is asked to.
    pub down: Option<String>,
    /// Shell command that repairs it; none: the user is asked to.
    pub up: Option<String>,
    /// How long traffic runs before, during and after the failure.
    pub hold: Duration,
}

/// What the drill measured (also in the checks' evidence).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DrillReport {
    pub down_at_ns: u64,
    pub up_at_ns: u64,
    /// Data flows whose path changed or that lost packets during the failure.
    pub affected: Vec<String>,
    /// Sampled packets lost during the failure, per flow.
    pub lost: BTreeMap<String, u64>,
    /// Exact PSN gaps the receivers saw during the failure, per flow.
    pub psn_gaps: BTreeMap<String, u64>,
    /// Per affected flow: ms from the failure to its first packet on a remaining path.
    pub recovery_ms: BTreeMap<String, f64>,
    /// Affected flows that never reached another path.
    pub not_recovered: Vec<String>,
    /// Data flows per spine (policy `ecmp.via`) before, during and after.
    pub spread_before: BTreeMap<String, usize>,
    pub spread_during: BTreeMap<String, usize>,
    pub spread_after: BTreeMap<String, usize>,
    /// Data flows not back on their path from before after the repair.
    pub not_returned: Vec<String>,
}

fn unix_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

async fn act(cmd: &Option<String>, what: &str) -> anyhow::Result<u64> {
    match cmd {
        Some(c) => {
            let t = unix_ns();
            tracing::info!("drill: {what}: running `{c}`");
            let c2 = c.clone();
            let st = tokio::task::spawn_blocking(move || {
                std::process::Command::new("sh").args(["-c", &c2]).status()
            })
            .await?
            .with_context(|| format!("running `{c}`"))?;
            anyhow::ensure!(st.success(), "drill: `{c}` failed ({st})");
            Ok(t)
        }
        None => {
            // The event happens somewhere between the question and the answer: times are
            // measured from the question, so they include the operator's delay.
            let t = unix_ns();
            eprintln!("drill: {what} now, then press Enter");
            let n = tokio::task::spawn_blocking(|| {
                let mut l = String::new();
                std::io::stdin().read_line(&mut l)
            })
            .await?
            .context("waiting for Enter")?;
            anyhow::ensure!(
                n > 0,
                "drill: stdin closed while waiting for Enter (use --down/--up to run commands)"
            );
            Ok(t)
        }
    }
}

/// The collector's view before, during and after the failure, and when it began and
/// ended (Unix ns).
pub struct Snapshots {
    pub reports: [CollectorReport; 3],
    pub down_at_ns: u64,
    pub up_at_ns: u64,
}

/// Runs the drill against a collector reachable at `http`.
pub async fn run(http: std::net::SocketAddr, opts: &DrillOptions) -> anyhow::Result<Snapshots> {
    let fetch = || super::fetch_report(http);
    tracing::info!(
        "drill: traffic for {} before the failure",
        humantime::format_duration(opts.hold)
    );
    tokio::time::sleep(opts.hold).await;
    let before = fetch().await?;
    anyhow::ensure!(
        before.flows.iter().any(|f| role(f) == Some(Role::Data)),
        "drill: no RDMA data flow seen before the failure; start the traffic first"
    );
    let down_at_ns = act(&opts.down, "cause the failure").await?;
    tokio::time::sleep(opts.hold).await;
    let during = fetch().await?;
    let up_at_ns = act(&opts.up, "repair it").await?;
    tokio::time::sleep(opts.hold).await;
    let after = fetch().await?;
    Ok(Snapshots {
        reports: [before, during, after],
        down_at_ns,
        up_at_ns,
    })
}

fn data(r: &CollectorReport) -> Vec<&FlowReport> {
    r.flows.iter().filter(|f| role(f) == Some(Role::Data)).collect()
}

fn by_id(r: &CollectorReport) -> BTreeMap<&str, &FlowReport> {
    r.flows.iter().map(|f| (f.id.as_str(), f)).collect()
}

/// What the three snapshots say about the failure at `down_at_ns` and the repair at
/// `up_at_ns`.
pub fn measure(
    [before, during, after]: &[CollectorReport; 3],
    down_at_ns: u64,
    up_at_ns: u64,
    via: &[String],
) -> DrillReport {
    let mut d = DrillReport {
        down_at_ns,
        up_at_ns,
        ..Default::default()
    };
    let a = by_id(after);
    // What happened while the failure lasted.
    let window = super::since(before, during.clone());
    for f in data(&window) {
        let lost: u64 = f.lost.iter().map(|l| l.span.packets).sum();
        let gaps_now = f.counters.values().map(|c| c.psn_gaps).max().unwrap_or(0);
        let moved = f
            .path_history
            .iter()
            .find(|p| p.since_ns >= down_at_ns && p.since_ns < up_at_ns);
        if lost > 0 {
            d.lost.insert(f.id.clone(), lost);
        }
        if gaps_now > 0 {
            d.psn_gaps.insert(f.id.clone(), gaps_now);
        }
        if lost == 0 && moved.is_none() {
            continue;
        }
        d.affected.push(f.id.clone());
        match moved {
            Some(p) => {
                d.recovery_ms
                    .insert(f.id.clone(), (p.since_ns - down_at_ns) as f64 / 1e6);
            }
            None => d.not_recovered.push(f.id.clone()),
        }
    }
    d.spread_before = ecmp_shares(&data(before), via);
    d.spread_during = ecmp_shares(&data(during), via);
    d.spread_after = ecmp_shares(&data(after), via);
    for f in data(before) {
        if let Some(x) = a.get(f.id.as_str())
            && path_nodes(&x.path) != path_nodes(&f.path)
        {
            d.not_returned.push(f.id.clone());
        }
    }
    d
}

fn shares(m: &BTreeMap<String, usize>) -> String {
    if m.is_empty() {
        return "(no [ecmp] via in the policy)".into();
    }
    m.iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The drill's checks, from the policy's `[drill]` section.
pub fn judge(policy: &Policy, d: &DrillReport) -> Vec<CheckResult> {
    let p = policy.drill.clone().unwrap_or(super::policy::DrillPolicy {
        max_lost: None,
        max_recovery_ms: None,
        must_return: false,
    });
    let mut out = Vec::new();
    let ev = |flow: &str, detail: String| Evidence {
        flow: flow.to_owned(),
        at: Vec::new(),
        detail,
    };
    let total_lost: u64 = d.lost.values().sum();
    let gaps: u64 = d.psn_gaps.values().sum();
    let mut loss = CheckResult {
        check: "drill_loss".into(),
        rule: match p.max_lost {
            Some(m) => format!("at most {m} sampled packets lost during the failure"),
            None => "packets lost during the failure (measured)".into(),
        },
        status: Status::Pass,
        checked: d.affected.len(),
        summary: format!(
            "{total_lost} sampled packets lost, {gaps} PSN gaps, {} flow(s) affected",
            d.affected.len()
        ),
        evidence: Vec::new(),
    };
    if let Some(m) = p.max_lost
        && total_lost > m
    {
        loss.status = Status::Fail;
        loss.evidence = d
            .lost
            .iter()
            .map(|(f, n)| ev(f, format!("{n} sampled packets lost")))
            .collect();
    }
    out.push(loss);

    let worst = d
        .recovery_ms
        .values()
        .cloned()
        .fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.max(x))));
    let mut rec = CheckResult {
        check: "drill_recovery".into(),
        rule: match p.max_recovery_ms {
            Some(m) => format!("every affected flow on a remaining path within {m} ms"),
            None => "time until every affected flow is on a remaining path (measured)".into(),
        },
        status: Status::Pass,
        checked: d.affected.len(),
        summary: match worst {
            Some(w) => format!(
                "{} flow(s) moved, the last after {w:.0} ms; spines before: {}, during: {}",
                d.recovery_ms.len(),
                shares(&d.spread_before),
                shares(&d.spread_during)
            ),
            None => format!("no flow moved; spines during: {}", shares(&d.spread_during)),
        },
        evidence: Vec::new(),
    };
    for f in &d.not_recovered {
        rec.evidence
            .push(ev(f, "lost packets and never moved to another path".into()));
    }
    if let Some(m) = p.max_recovery_ms {
        for (f, ms) in &d.recovery_ms {
            if *ms > m as f64 {
                rec.evidence
                    .push(ev(f, format!("back on a remaining path after {ms:.0} ms")));
            }
        }
    }
    if d.affected.is_empty() {
        rec.status = Status::NoData;
        rec.summary = "no flow was affected: did the failure hit their paths?".into();
    } else if !rec.evidence.is_empty() {
        rec.status = Status::Fail;
    }
    out.push(rec);

    let mut ret = CheckResult {
        check: "drill_return".into(),
        rule: "after the repair every flow is back on its path from before".into(),
        status: Status::Pass,
        checked: d.spread_before.values().sum(),
        summary: format!(
            "{} flow(s) not back; spines after: {}",
            d.not_returned.len(),
            shares(&d.spread_after)
        ),
        evidence: d
            .not_returned
            .iter()
            .map(|f| ev(f, "on another path than before the failure".into()))
            .collect(),
    };
    if p.must_return && !ret.evidence.is_empty() {
        ret.status = Status::Fail;
    }
    out.push(ret);
    out
}
