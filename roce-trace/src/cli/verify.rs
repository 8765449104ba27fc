use std::{path::PathBuf, time::Duration};

use anyhow::Context as _;
use clap::ValueEnum;

use super::*;

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["report", "collector_http", "interfaces"])))]
pub struct VerifyArgs {
    /// The policy (TOML; see dist/fabric-policy.toml).
    #[arg(long, required_unless_present = "since")]
    policy: Option<PathBuf>,
    /// What failed in the last DURATION (e.g. `1h`), and when it started: the history of
    /// a collector judging continuously (`collect --policy`), from --collector-http.
    /// Exit 1 if a check failed in it, 3 if one could not be judged, else 0.
    #[arg(long, value_parser = humantime::parse_duration, requires = "collector_http", conflicts_with_all = ["report", "interfaces", "drill", "baseline", "save_baseline", "html", "junit"])]
    since: Option<Duration>,
    /// Judge a report the collector wrote (`collect --report`), `-` for stdin.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Judge a running collector (its --http address) after --window.
    #[arg(long)]
    collector_http: Option<std::net::SocketAddr>,
    /// The collector API's bearer token, from a file (--http-token-file).
    #[command(flatten)]
    http_token: HttpTokenArgs,
    /// Judge this host alone: observe these interfaces for --window (repeat -i).
    #[arg(short = 'i', long = "interface")]
    interfaces: Vec<String>,
    /// How long to observe (live collector or local interfaces).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10s")]
    window: Duration,
    /// What the traffic in the window was meant to be: CE marks are a fault when idle,
    /// expected when congested.
    #[arg(long, value_enum, default_value_t = LoadArg::Idle)]
    load: LoadArg,
    /// Also write the verdict as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also write the verdict as JUnit XML (one test case per check).
    #[arg(long)]
    junit: Option<PathBuf>,
    /// Also write one self-contained HTML file (nothing fetched when opened): the
    /// checks, the fabric map with the places failing checks name marked, and each
    /// failure's evidence with its flows drawn.
    #[arg(long)]
    html: Option<PathBuf>,
    /// Record this window's paths, classes and spreads as a baseline.
    #[arg(long)]
    save_baseline: Option<PathBuf>,
    /// Report what changed since this baseline.
    #[arg(long)]
    baseline: Option<PathBuf>,
    /// Failure drill (needs --collector-http or -i): measure a failure while traffic runs.
    #[arg(long)]
    drill: bool,
    /// Drill: shell command that causes the failure (else you are asked to).
    #[arg(long, requires = "drill")]
    down: Option<String>,
    /// Drill: shell command that repairs it (else you are asked to).
    #[arg(long, requires = "drill")]
    up: Option<String>,
    /// Drill: traffic time before, during and after the failure (at least twice the
    /// agents' counter interval: the failure's second half is judged on its own).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "5s")]
    hold: Duration,
    /// Drill: how long `--down` and `--up` may each run before they are killed (with
    /// everything they started) and the drill fails; `--up` still runs after a `--down`
    /// that timed out.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "60s", requires = "drill")]
    drill_timeout: Duration,
    /// Local capture: 1 in N packets sampled.
    #[arg(long, default_value_t = 16)]
    sample_rate: u32,
    /// Local capture: the RoCEv2 UDP port.
    #[arg(long, default_value_t = 4791)]
    port: u16,
    /// Print the verdict as JSON on stdout instead of the table.
    #[arg(long)]
    json_stdout: bool,
}

/// What the traffic in the window was meant to be.
#[derive(Clone, Copy, ValueEnum)]
pub(super) enum LoadArg {
    /// No congestion: CE marks are a fault.
    Idle,
    /// Deliberate congestion (incast, a bottleneck): CE marks are expected.
    Congested,
}

impl From<LoadArg> for roce_trace::verify::checks::Load {
    fn from(l: LoadArg) -> Self {
        match l {
            LoadArg::Idle => Self::Idle,
            LoadArg::Congested => Self::Congested,
        }
    }
}

pub(super) fn run_verify(a: VerifyArgs) -> anyhow::Result<u8> {
    use roce_trace::{
        local::{self, Source},
        verify::{self, baseline::Baseline, drill, output},
    };
    if let (Some(since), Some(http)) = (a.since, a.collector_http) {
        return run_since(http, a.http_token.read()?.as_deref(), since, a.json_stdout);
    }
    let load: verify::checks::Load = a.load.into();
    let policy = local::load_policy(a.policy.as_deref().context("--policy is required")?)?;
    let source = if let Some(r) = a.report.clone() {
        anyhow::ensure!(!a.drill, "--drill needs a live window: --collector-http or -i");
        Source::Report(r)
    } else if let Some(http) = a.collector_http {
        Source::Collector {
            http,
            window: a.window,
            bearer: a.http_token.read()?,
        }
    } else {
        anyhow::ensure!(a.sample_rate > 0, "--sample-rate must be at least 1");
        Source::Local {
            agent: Box::new(roce_trace::agent::AgentOptions {
                collector: String::new(),
                ifaces: a.interfaces.clone(),
                ingress: Some(IngressHook::Auto),
                egress: true,
                node: roce_trace::sys::hostname(),
                tls: None,
                token: String::new(),
                datapath: DatapathOptions {
                    udp_port: a.port,
                    sample_rate: a.sample_rate,
                    seed: 0,
                    expected_dscp: Vec::new(),
                    batch_wakeups: true,
                    ..DatapathOptions::default()
                },
                interval: Duration::from_millis(500),
                queue: 1_000_000,
                clock_synced: true,
                privileges: roce_trace::agent::Privileges::Keep,
                metrics_token: None,
                metrics: None,
                fleet: None,
                mirrors: Default::default(),
                nic: Some(roce_trace::nic::Root::system()),
            }),
            window: a.window,
        }
    };
    let baseline = a.baseline.as_deref().map(local::load_baseline).transpose()?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting runtime")?;
    let min_packets = policy.stability.as_ref().map_or(100, |s| s.min_packets);
    let (checks, flows, judged) = if a.drill {
        let opts = local::DrillOptions {
            down: a.down.clone(),
            up: a.up.clone(),
            hold: a.hold,
            timeout: a.drill_timeout,
        };
        let snaps =
            rt.block_on(async {
                match &source {
                    Source::Collector { http, bearer, .. } => {
                        local::run_drill(*http, bearer.as_deref(), &opts).await
                    }
                    Source::Local { agent, .. } => Ok(local::with_local(agent, |http| async move {
                        local::run_drill(http, None, &opts).await
                    })
                    .await?
                    .0),
                    Source::Report(_) => unreachable!("refused above"),
                }
            })?;
        let via = policy.ecmp.as_ref().map(|e| e.via.clone()).unwrap_or_default();
        let d = drill::measure(&snaps, &via);
        (drill::judge(&policy, &d), snaps.during.flows.len(), snaps.during)
    } else {
        let report = rt.block_on(local::window_report(&source))?;
        let mut checks = verify::checks::judge(&policy, &report, load);
        let now = Baseline::of(&report, min_packets);
        if let Some(b) = &baseline {
            let growth = policy.baseline.as_ref().map_or(0.1, |b| b.max_spread_growth.0);
            checks.push(b.compare(&now, growth));
        }
        if let Some(p) = &a.save_baseline {
            local::save_baseline(&now, p)?;
            tracing::info!("baseline written to {}", p.display());
        }
        (checks, report.flows.len(), report)
    };
    let v = output::Verdict::new(source.describe(), load, flows, checks);
    if let Some(p) = &a.json {
        roce_trace::sys::write_atomically(p, &serde_json::to_vec_pretty(&v)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    if let Some(p) = &a.junit {
        roce_trace::sys::write_atomically(p, output::junit(&v).as_bytes())
            .with_context(|| format!("writing {}", p.display()))?;
    }
    if let Some(p) = &a.html {
        let page = roce_trace::pictures::html::verify_report(&v, Some(&judged));
        roce_trace::sys::write_atomically(p, page.as_bytes())
            .with_context(|| format!("writing {}", p.display()))?;
    }
    if a.json_stdout {
        println!("{}", serde_json::to_string(&v)?);
    } else {
        print!("{}", output::table(&v));
    }
    Ok(v.exit_code())
}

/// `verify --since`: the collector's history of verdict changes over the last `since`.
fn run_since(
    http: std::net::SocketAddr,
    bearer: Option<&str>,
    since: Duration,
    json: bool,
) -> anyhow::Result<u8> {
    use roce_trace::verify::continuous::{self, Health, Verdicts};
    let now = roce_trace::verdicts::unix_ms();
    let from = now.saturating_sub(since.as_millis() as u64);
    // The whole history (bounded by the collector): a stretch that began before the
    // period and lasted into it counts.
    let (status, body) = roce_trace::http::get_as(http, "/verdicts", Duration::from_secs(30), bearer)
        .with_context(|| format!("asking {http} for its verdicts"))?;
    anyhow::ensure!(
        status == 200,
        "{http}/verdicts: {status} {}",
        String::from_utf8_lossy(&body).trim()
    );
    let v: Verdicts = serde_json::from_slice(&body)
        .with_context(|| format!("{http}/verdicts: not the collector's verdicts"))?;
    let stretches = continuous::stretches(&v.events, from);
    let worst = if stretches.iter().any(|s| s.health == Health::Failing) {
        1
    } else if stretches.is_empty() {
        0
    } else {
        3
    };
    if json {
        let out: Vec<serde_json::Value> = stretches
            .iter()
            .map(|s| {
                serde_json::json!({
                    "check": s.check,
                    "status": s.began.to,
                    "from_ms": s.from_ms,
                    "until_ms": s.until_ms,
                    "summary": s.began.summary,
                    "evidence": s.began.evidence,
                    "evidence_total": s.began.evidence_total,
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::json!({ "type": "verdict_history", "since_ms": from, "now_ms": now, "judging": v.judging, "windows": v.windows, "stretches": out })
        );
        return Ok(worst);
    }
    let t = |ms: u64| {
        humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + Duration::from_millis(ms)).to_string()
    };
    println!(
        "{http}: policy {} judged every {} over {} (fail after {} window(s)), {} window(s); since {}",
        v.policy,
        humantime::format_duration(Duration::from_millis(v.every_ms)),
        humantime::format_duration(Duration::from_millis(v.window_ms)),
        v.fail_after,
        v.windows,
        t(from)
    );
    if !v.judging {
        println!("(no member is judging now: the history ends where judging stopped)");
    }
    if stretches.is_empty() {
        println!("nothing failed");
        return Ok(0);
    }
    let w = stretches.iter().map(|s| s.check.len()).max().unwrap_or(5).max(5);
    println!(
        "{:<w$}  {:<7}  {:<20}  {:<20}  EVIDENCE",
        "CHECK", "STATUS", "FROM", "UNTIL"
    );
    for s in &stretches {
        let until = s.until_ms.map_or_else(|| "still".to_owned(), t);
        println!(
            "{:<w$}  {:<7}  {:<20}  {:<20}  {}",
            s.check,
            s.began.to.name(),
            t(s.from_ms),
            until,
            s.began.summary
        );
        for e in s.began.evidence.iter().take(6) {
            let at = if e.at.is_empty() {
                String::new()
            } else {
                format!("at {}: ", e.at.join(" .. "))
            };
            println!("{:<w$}  {:<7}    {} {at}{}", "", "", e.flow, e.detail);
        }
        if s.began.evidence_total > 6 {
            println!("{:<w$}  {:<7}    … {} more", "", "", s.began.evidence_total - 6);
        }
    }
    Ok(worst)
}
