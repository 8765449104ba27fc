use std::{path::PathBuf, time::Duration};

use super::*;

#[derive(clap::Args)]
pub struct CollectArgs {
    /// Address agents connect to.
    #[arg(long, default_value = "0.0.0.0:4792")]
    listen: std::net::SocketAddr,
    /// Serve the JSON API and Prometheus metrics on ADDR (a loopback address, or any
    /// with --http-token-file).
    #[arg(long)]
    http: Option<std::net::SocketAddr>,
    /// Every HTTP request must carry this bearer token (--http-token-file): required to
    /// serve beyond loopback.
    #[command(flatten)]
    http_token: HttpTokenArgs,
    #[command(flatten)]
    token: TokenArgs,
    /// Mutual TLS on the agents' port: this collector's certificate and key, and the CA
    /// every agent's certificate must be signed by (`roce-trace certs` makes them). With
    /// it the token is optional (checked too when given).
    #[command(flatten)]
    tls: TlsArgs,
    /// Close an agent's connection silent this long (agents send a HEARTBEAT every 5 s);
    /// until then a second session from its node is refused.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "16s")]
    agent_timeout: Duration,
    /// Write the report (JSON) here: at start (the path is checked), every
    /// --report-every, and on exit; each time whole, replacing the last.
    #[arg(long, default_value = "roce-trace-report.json")]
    report: PathBuf,
    /// How often the report is written while running (0s: only at start and exit): what
    /// a collector killed mid-run leaves behind.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "30s")]
    report_every: Duration,
    /// Stop after this long.
    #[arg(long, value_parser = humantime::parse_duration)]
    duration: Option<Duration>,
    /// A packet's trajectory is complete this long after its first observation.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "2s")]
    trajectory_timeout: Duration,
    /// How much longer a trajectory that lacks a point of its flow's path waits for that
    /// point's agent to catch up (agents deliver late after an outage of NATS or the
    /// collector): it completes as soon as that agent has reported past the packet's
    /// time, or after this (counted in /stats and /metrics as `agent_lag_gave_up`).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10s")]
    max_agent_lag: Duration,
    /// Flows tracked at most (past it, the longest-idle are forgotten to make room, and
    /// counted).
    #[arg(long, default_value_t = 100_000)]
    max_flows: usize,
    /// Forget flows idle this long.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "5m")]
    flow_idle: Duration,
    /// No live view on stdout.
    #[arg(long)]
    quiet: bool,
    /// Have each flow traced once from its source agent (in-band probes), and attach the
    /// hops to its path.
    #[arg(long)]
    trace: bool,
    /// Fleet mode (`--nats-url`): a member of a group of collectors on NATS JetStream.
    #[command(flatten)]
    nats: roce_trace::fleet::NatsArgs,
    /// This collector's id in the group (default: the hostname and the HTTP port).
    #[arg(long)]
    member_id: Option<String>,
    /// Continuous verification: judge this policy (the same checks as `verify`, see
    /// dist/fabric-policy.toml) over a sliding window of the collector's own view, every
    /// --verify-every; each check's status in /metrics and /verdicts, every change in the
    /// history (--verdict-history) and to --alert-url. In a group every member takes the
    /// same flags; the member with the least id judges the group's merged view.
    #[arg(long)]
    policy: Option<PathBuf>,
    /// How often a window is judged.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "30s", requires = "policy")]
    verify_every: Duration,
    /// How much of the recent past each judgement covers (at least --verify-every, at
    /// most 10 times it).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "60s", requires = "policy")]
    verify_window: Duration,
    /// Windows in a row a check must fail before it counts as failing, and pass (or
    /// skip) before it counts as recovered; likewise for no data. 1: every window counts.
    #[arg(long, default_value_t = 2, requires = "policy")]
    fail_after: u32,
    /// What the traffic is meant to be: CE marks are a fault when idle; under
    /// `congested` a lack of CE marks is.
    #[arg(long, value_enum, default_value_t = super::verify::LoadArg::Idle, requires = "policy")]
    verify_load: super::verify::LoadArg,
    /// The history of verdict changes (JSON lines), read at start (a restart keeps it)
    /// and appended to at every change.
    #[arg(long, default_value = "roce-trace-verdicts.jsonl", requires = "policy")]
    verdict_history: PathBuf,
    /// Changes the history keeps (the file holds at most twice this before it is cut
    /// back to it).
    #[arg(long, default_value_t = 1000, requires = "policy")]
    verdict_history_max: usize,
    /// POST every verdict change as JSON to this http:// URL (retried with backoff, in
    /// order, never holding up the collector; a first status that is ok is not sent).
    #[arg(long, requires = "policy")]
    alert_url: Option<roce_trace::verdicts::AlertUrl>,
    /// Live view refresh.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "2s")]
    interval: Duration,
}

pub(super) async fn run_collect(a: CollectArgs) -> anyhow::Result<()> {
    use roce_trace::{collector, correlate::JoinConfig};
    let tls = a
        .tls
        .files()
        .map(|f| roce_trace::tls::server_config(&f))
        .transpose()?;
    let token = if tls.is_some() && !token_given(&a.token, None, None) {
        String::new()
    } else {
        read_token(&a.token, None, None)?
    };
    let continuous = match &a.policy {
        None => None,
        Some(p) => {
            let o = roce_trace::verdicts::ContinuousOptions {
                policy: roce_trace::local::load_policy(p)?,
                policy_name: p.display().to_string(),
                every: a.verify_every,
                window: a.verify_window,
                fail_after: a.fail_after,
                load: a.verify_load.into(),
                history: a.verdict_history.clone(),
                history_max: a.verdict_history_max,
                alert_url: a.alert_url.clone(),
            };
            o.validate()?;
            Some(o)
        }
    };
    let opts = collector::CollectorOptions {
        continuous,
        listen: a.listen,
        http: a.http,
        token,
        report: Some(a.report.clone()),
        tls,
        agent_timeout: a.agent_timeout,
        report_every: a.report_every,
        join: JoinConfig {
            trajectory_timeout_ns: a.trajectory_timeout.as_nanos() as u64,
            flow_idle_ns: a.flow_idle.as_nanos() as u64,
            max_flows: a.max_flows,
            max_agent_lag_ns: a.max_agent_lag.as_nanos() as u64,
            ..JoinConfig::default()
        },
        live: !a.quiet,
        trace: a.trace,
        interval: a.interval,
        http_token: a.http_token.read()?,
        fleet: if a.nats.urls.is_empty() {
            None
        } else {
            Some(collector::FleetOptions {
                nats: a.nats.options()?,
                member_id: a.member_id.clone().unwrap_or_else(|| {
                    format!(
                        "{}-{}",
                        roce_trace::sys::hostname(),
                        a.http.map_or(0, |h| h.port())
                    )
                }),
            })
        },
    };
    let stop = async {
        match a.duration {
            Some(d) => tokio::select! { _ = tokio::time::sleep(d) => {}, _ = shutdown_signal() => {} },
            None => shutdown_signal().await,
        }
    };
    let r = collector::run(opts, stop, |listen, http| {
        tracing::info!(
            "collecting on {listen}{}",
            http.map(|h| format!(", API on http://{h}/flows"))
                .unwrap_or_default()
        );
    })
    .await?;
    print!("{}", collector::render(&r));
    tracing::info!("report written to {}", a.report.display());
    Ok(())
}
