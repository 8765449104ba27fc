//! `roce-trace verify`: the fabric's regression tests. The last stage — it judges what
//! the collector correlated (a saved report, a live collector, or an in-process
//! collector fed by this host's own datapath) against a policy, and reports pass/fail
//! with evidence; baselines say what changed, drills measure a failure.

pub mod baseline;
pub mod checks;
pub mod drill;
pub mod output;
pub mod policy;

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::Context as _;

use crate::{
    agent::AgentOptions,
    collector::{self, CollectorOptions, CollectorReport},
    correlate::JoinConfig,
};

/// Where a window's observations come from.
#[derive(Clone, Debug)]
pub enum Source {
    /// A report the collector wrote (`collect --report`), `-` for stdin.
    Report(PathBuf),
    /// A running collector's HTTP API: its report after `window`.
    Collector { http: SocketAddr, window: Duration },
    /// This host's own interfaces, through an in-process agent and collector.
    Local {
        agent: Box<AgentOptions>,
        window: Duration,
    },
}

impl Source {
    pub fn describe(&self) -> String {
        match self {
            Source::Report(p) => format!("report {}", p.display()),
            Source::Collector { http, window } => {
                format!(
                    "collector http://{http} over {}",
                    humantime::format_duration(*window)
                )
            }
            Source::Local { agent, window } => format!(
                "local capture on {} over {}",
                agent.ifaces.join(","),
                humantime::format_duration(*window)
            ),
        }
    }
}

pub fn read_report(path: &std::path::Path) -> anyhow::Result<CollectorReport> {
    let text = if path.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin()).context("reading the report from stdin")?
    } else {
        std::fs::read_to_string(path).with_context(|| format!("reading the report {}", path.display()))?
    };
    let r: CollectorReport = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a roce-trace collector report", path.display()))?;
    anyhow::ensure!(
        r.kind == "collector_report",
        "{} is not a collector report (type `{}`)",
        path.display(),
        r.kind
    );
    Ok(r)
}

/// The collector's current report, over its HTTP API.
pub async fn fetch_report(http: SocketAddr) -> anyhow::Result<CollectorReport> {
    tokio::task::spawn_blocking(move || crate::http::get_json::<CollectorReport>(http, "/report"))
        .await
        .context("fetching the report")?
}

/// An in-process collector on loopback, fed by an in-process agent on this host's
/// interfaces; `body` runs while they do, with the collector's HTTP address.
pub async fn with_local<T, F, Fut>(agent: &AgentOptions, body: F) -> anyhow::Result<(T, CollectorReport)>
where
    F: FnOnce(SocketAddr) -> Fut,
    Fut: Future<Output = anyhow::Result<T>>,
{
    let token = format!("verify-{}", std::process::id());
    let (ctx, crx) = tokio::sync::oneshot::channel();
    let (stop_c, stopped_c) = tokio::sync::oneshot::channel::<()>();
    let copts = CollectorOptions {
        listen: "127.0.0.1:0".parse().expect("address"),
        http: Some("127.0.0.1:0".parse().expect("address")),
        token: token.clone(),
        report: None,
        join: JoinConfig {
            trajectory_timeout_ns: 1_000_000_000,
            ..JoinConfig::default()
        },
        live: false,
        trace: false,
        interval: Duration::from_secs(3600),
    };
    let coll = tokio::spawn(collector::run(
        copts,
        async {
            let _ = stopped_c.await;
        },
        move |listen, http| {
            let _ = ctx.send((listen, http.expect("http requested")));
        },
    ));
    let (listen, http) = match crx.await {
        Ok(a) => a,
        Err(_) => {
            return Err(coll
                .await
                .context("collector task")?
                .err()
                .unwrap_or_else(|| anyhow::anyhow!("collector stopped")));
        }
    };
    let mut aopts = agent.clone();
    aopts.collector = listen.to_string();
    aopts.token = token;
    let (atx, arx) = tokio::sync::oneshot::channel();
    let (stop_a, stopped_a) = tokio::sync::oneshot::channel::<()>();
    let interval = aopts.interval;
    let ag = tokio::spawn(crate::agent::run(
        aopts,
        async {
            let _ = stopped_a.await;
        },
        move |_, _| {
            let _ = atx.send(());
        },
    ));
    if arx.await.is_err() {
        let _ = stop_c.send(());
        return Err(ag
            .await
            .context("agent task")?
            .err()
            .unwrap_or_else(|| anyhow::anyhow!("agent stopped")));
    }
    let out = body(http).await;
    // The last counter deltas, then the agent's last samples, then the join's flush.
    tokio::time::sleep(interval + Duration::from_millis(300)).await;
    let _ = stop_a.send(());
    ag.await.context("agent task")??;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = stop_c.send(());
    let report = coll.await.context("collector task")??;
    Ok((out?, report))
}

/// `end` less what `start` already held: counters, losses, class changes, CE onsets and
/// trajectories count only what happened in between; flows with nothing new are left
/// out. Paths, classes and sizes are the latest view.
pub fn since(start: &CollectorReport, mut end: CollectorReport) -> CollectorReport {
    use std::collections::HashMap;

    use crate::correlate::Span;
    let before: HashMap<&str, &crate::correlate::FlowReport> =
        start.flows.iter().map(|f| (f.id.as_str(), f)).collect();
    let less_counted = |now: &mut Vec<crate::correlate::CountedLoss>,
                        was: &[crate::correlate::CountedLoss]| {
        for l in now.iter_mut() {
            if let Some(w) = was.iter().find(|w| w.between == l.between) {
                l.packets = l.packets.saturating_sub(w.packets);
            }
        }
        now.retain(|l| l.packets > 0);
    };
    let less = |now: &mut Span, was: Option<&Span>| {
        if let Some(w) = was {
            now.packets = now.packets.saturating_sub(w.packets);
        }
    };
    // A port's MTUs in the window: the one in force at its start and those declared since.
    for p in &mut end.points {
        let Some(was) = start.points.iter().find(|x| x.label() == p.label()) else {
            continue;
        };
        let seen = was.mtu_history.last().map(|m| m.at_ns);
        p.mtu_history.retain(|m| seen.is_none_or(|t| m.at_ns > t));
        if let Some(m) = was.mtu {
            p.mtu_history.insert(
                0,
                crate::correlate::MtuAt {
                    at_ns: seen.unwrap_or(0),
                    mtu: m,
                },
            );
        }
    }
    end.flows.retain_mut(|f| {
        let Some(b) = before.get(f.id.as_str()) else {
            return true;
        };
        for (point, c) in f.counters.iter_mut() {
            if let Some(w) = b.counters.get(point) {
                *c = c.less(w);
            }
        }
        f.counters.retain(|_, c| c.packets > 0);
        f.trajectories = f.trajectories.saturating_sub(b.trajectories);
        for l in &mut f.lost {
            less(
                &mut l.span,
                b.lost.iter().find(|x| x.between == l.between).map(|x| &x.span),
            );
        }
        f.lost.retain(|l| l.span.packets > 0);
        for c in &mut f.class_seen {
            let was = b
                .class_seen
                .iter()
                .find(|x| x.point == c.point && x.cnp == c.cnp && x.dscp == c.dscp && x.pcp == c.pcp);
            less(&mut c.span, was.map(|x| &x.span));
        }
        f.class_seen.retain(|c| c.span.packets > 0);
        for u in &mut f.unobserved {
            let was = b
                .unobserved
                .iter()
                .find(|x| x.between == u.between && x.why == u.why);
            less(&mut u.span, was.map(|x| &x.span));
        }
        f.unobserved.retain(|u| u.span.packets > 0);
        for c in &mut f.class_changes {
            let was = b
                .class_changes
                .iter()
                .find(|x| x.between == c.between && x.from_dscp == c.from_dscp && x.to_dscp == c.to_dscp);
            less(&mut c.span, was.map(|x| &x.span));
        }
        f.class_changes.retain(|c| c.span.packets > 0);
        for o in &mut f.ce_onset {
            let was = b.ce_onset.iter().find(|x| x.after == o.after && x.at == o.at);
            less(&mut o.span, was.map(|x| &x.span));
        }
        f.ce_onset.retain(|o| o.span.packets > 0);
        let seen = b.delivery.iter().map(|x| x.at_ns).max().unwrap_or(0);
        f.delivery.retain(|x| x.at_ns > seen);
        if let (Some(d), Some(w)) = (&mut f.cnp_delivery, &b.cnp_delivery) {
            d.sent = d.sent.saturating_sub(w.sent);
            if let (Some(n), Some(m)) = (&mut d.reached, w.reached) {
                *n = n.saturating_sub(m);
            }
            less_counted(&mut d.lost, &w.lost);
        }
        let a = &mut f.answered_by;
        a.cnps_sent = a.cnps_sent.saturating_sub(b.answered_by.cnps_sent);
        less_counted(&mut a.cnps_lost, &b.answered_by.cnps_lost);
        a.cnps = a.cnps.saturating_sub(b.answered_by.cnps);
        a.ce_marks = a.ce_marks.saturating_sub(b.answered_by.ce_marks);
        a.cnps_per_ce_mark = (a.ce_marks > 0).then(|| a.cnps as f64 / a.ce_marks as f64);
        !f.counters.is_empty() || f.trajectories > 0
    });
    end
}

/// One window's report from `source`.
pub async fn window_report(source: &Source) -> anyhow::Result<CollectorReport> {
    match source {
        Source::Report(p) => read_report(p),
        Source::Collector { http, window } => {
            // What the collector learnt during the window: its view at the end less its
            // view at the start (which also fails early on a wrong address).
            let start = fetch_report(*http).await?;
            tokio::time::sleep(*window).await;
            Ok(since(&start, fetch_report(*http).await?))
        }
        Source::Local { agent, window } => {
            let w = *window;
            Ok(with_local(agent, |_| async move {
                tokio::time::sleep(w).await;
                Ok(())
            })
            .await?
            .1)
        }
    }
}

#[cfg(test)]
mod tests;
