use std::{path::PathBuf, time::Duration};

use super::*;

#[derive(clap::Args)]
pub struct AgentArgs {
    /// The collector, host:port.
    #[arg(long)]
    collector: Option<String>,
    /// Interface to observe (repeat for several).
    #[arg(short = 'i', long = "interface")]
    interfaces: Vec<String>,
    /// Observe a pcap/pcapng stream instead (`-` for stdin), e.g. an RDMA NIC's sniffer:
    /// `tcpdump -i mlx5_0 -w - | roce-trace agent -r - …`.
    #[arg(short = 'r', long, conflicts_with = "interfaces")]
    read: Option<PathBuf>,
    /// Node name of this host's observation points (default: the hostname).
    #[arg(long)]
    node: Option<String>,
    /// Config file (TOML; see dist/agent.toml). Flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    #[command(flatten)]
    token: TokenArgs,
    /// Mutual TLS to the collector: this node's certificate (its DNS name is the node's
    /// name) and key, and the CA that signed the collector's (`roce-trace certs`). With
    /// it the token is optional.
    #[command(flatten)]
    tls: TlsArgs,
    /// The name the collector's certificate must carry (default: the host of
    /// --collector).
    #[arg(long, requires = "peer_tls_cert")]
    tls_server_name: Option<String>,
    #[arg(long)]
    sample_rate: Option<u32>,
    #[arg(long)]
    seed: Option<u32>,
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u8).range(0..=63))]
    expect_dscp: Vec<u8>,
    #[arg(long)]
    port: Option<u16>,
    /// How often counter deltas are sent.
    #[arg(long, value_parser = humantime::parse_duration)]
    interval: Option<Duration>,
    /// Observations held while the collector is away.
    #[arg(long)]
    queue: Option<usize>,
    /// This host's clock is synchronised (PTP/NTP).
    #[arg(long)]
    clock_synced: bool,
    /// Serve Prometheus metrics on ADDR (e.g. 127.0.0.1:9464; beyond loopback only with
    /// --metrics-token-file).
    #[arg(long)]
    metrics: Option<std::net::SocketAddr>,
    /// Every scrape must carry this bearer token, read from FILE (first line; readable by
    /// its owner alone): required to serve metrics beyond loopback.
    #[arg(long, value_name = "FILE", env = "ROCE_TRACE_METRICS_TOKEN_FILE")]
    metrics_token_file: Option<PathBuf>,
    /// Take mirrored copies (GRE/ERSPAN) only from switches in these ranges (repeat, or
    /// comma-separated: `10.0.0.0/8,2001:db8::/32`; a bare address is one switch).
    /// Without it, from any source, up to --max-mirror-sessions.
    #[arg(long, value_name = "CIDR", value_delimiter = ',')]
    mirror_from: Vec<roce_trace::observation::Cidr>,
    /// Mirror sessions that become points, at most; more are refused and counted
    /// (`roce_trace_mirror_sessions_refused_total`).
    #[arg(long, default_value_t = roce_trace::observation::MirrorPolicy::MAX_SESSIONS)]
    max_mirror_sessions: usize,
    /// Do not read the interfaces' NIC and PFC counters (RDMA hw_counters, ethtool
    /// statistics; read where an interface has an RDMA device or PFC counters).
    #[arg(long)]
    no_nic: bool,
    /// Read NIC and PFC counters from a fixture tree laid out like /sys (see `roce-trace
    /// nic --sysfs-root`) instead of this host's.
    #[arg(long, value_name = "DIR", conflicts_with = "no_nic")]
    sysfs_root: Option<PathBuf>,
    /// Once attached, become this user (the agent must start as root); capabilities it
    /// no longer needs are dropped either way (README: least privilege).
    #[arg(id = "run_as_user", long = "user", value_name = "USER")]
    user: Option<String>,
    #[command(flatten)]
    ingress: IngressArgs,
    /// Fleet mode (`--nats-url`): publish to NATS JetStream, for a group of collectors,
    /// instead of streaming to one collector.
    #[command(flatten)]
    nats: roce_trace::fleet::NatsArgs,
}

pub(super) async fn run_agent(a: AgentArgs) -> anyhow::Result<()> {
    use roce_trace::agent::{self, AgentConfig, AgentOptions};
    let cfg = match &a.config {
        Some(p) => AgentConfig::load(p)?,
        None => AgentConfig::default(),
    };
    let fleet = if a.nats.urls.is_empty() {
        None
    } else {
        Some(a.nats.options()?)
    };
    let tls_files = a.tls.files().or_else(|| {
        Some(roce_trace::tls::TlsFiles {
            cert: cfg.tls_cert.clone()?,
            key: cfg.tls_key.clone()?,
            ca: cfg.tls_ca.clone()?,
        })
    });
    let token = if fleet.is_some()
        || (tls_files.is_some() && !token_given(&a.token, cfg.token_file.as_ref(), cfg.token.as_ref()))
    {
        String::new()
    } else {
        read_token(&a.token, cfg.token_file.as_ref(), cfg.token.as_ref())?
    };
    let interval = match (a.interval, &cfg.interval) {
        (Some(i), _) => i,
        (None, Some(s)) => humantime::parse_duration(s)?,
        (None, None) => Duration::from_secs(2),
    };
    let collector = match (a.collector.or(cfg.collector), &fleet) {
        (Some(c), _) => c,
        (None, Some(nats)) => format!("NATS {}", nats.urls.join(",")),
        (None, None) => {
            anyhow::bail!("no collector: --collector HOST:PORT or `collector` in the config, or --nats-url")
        }
    };
    let tls = match tls_files {
        Some(f) => Some((
            roce_trace::tls::client_config(&f)?,
            roce_trace::tls::server_name(
                &collector,
                a.tls_server_name.as_deref().or(cfg.tls_server_name.as_deref()),
            )?,
        )),
        None => None,
    };
    let opts = AgentOptions {
        collector,
        tls,
        ifaces: if a.interfaces.is_empty() {
            cfg.interfaces.unwrap_or_default()
        } else {
            a.interfaces
        },
        ingress: Some(a.ingress.hook()?),
        egress: true,
        node: a.node.or(cfg.node).unwrap_or_else(roce_trace::sys::hostname),
        token,
        datapath: DatapathOptions {
            udp_port: a.port.or(cfg.port).unwrap_or(4791),
            sample_rate: a.sample_rate.or(cfg.sample_rate).unwrap_or(1000),
            seed: a.seed.or(cfg.seed).unwrap_or(0),
            expected_dscp: if a.expect_dscp.is_empty() {
                cfg.expect_dscp.unwrap_or_default()
            } else {
                a.expect_dscp
            },
            batch_wakeups: true,
            mirror_from: a.mirror_from.iter().map(|c| c.prefix()).collect(),
            ..DatapathOptions::default()
        },
        interval,
        queue: a.queue.or(cfg.queue).unwrap_or(100_000),
        clock_synced: a.clock_synced || cfg.clock_synced.unwrap_or(false),
        metrics: a.metrics.or(cfg.metrics),
        metrics_token: a
            .metrics_token_file
            .or(cfg.metrics_token_file)
            .as_deref()
            .map(read_secret_file)
            .transpose()?,
        fleet,
        privileges: agent::Privileges::Drop {
            user: a.user.or(cfg.user),
        },
        mirrors: roce_trace::observation::MirrorPolicy {
            from: a.mirror_from,
            max_sessions: a.max_mirror_sessions,
        },
        nic: nic_root(a.no_nic, a.sysfs_root)?,
    };
    let node = opts.node.clone();
    let collector = opts.collector.clone();
    if let Some(input) = a.read {
        let stats = agent::run_pcap(opts, input, shutdown_signal(), |hooks, _| {
            tracing::info!(
                "agent `{node}` reading {}, streaming to {collector}",
                hooks[0].iface
            );
        })
        .await?;
        log_agent_stats(&stats);
        return Ok(());
    }
    let stats = agent::run(opts, shutdown_signal(), |hooks, metrics| {
        let list: Vec<String> = hooks
            .iter()
            .map(|h| format!("{} {} ({})", h.iface, h.hook, h.mode))
            .collect();
        tracing::info!(
            "agent `{node}` observing on {}, streaming to {collector}{}",
            list.join(", "),
            metrics
                .map(|m| format!(", metrics on http://{m}/metrics"))
                .unwrap_or_default()
        );
    })
    .await?;
    log_agent_stats(&stats);
    Ok(())
}

/// The agent's last line (tests read it).
pub(super) fn log_agent_stats(stats: &roce_trace::agent::AgentStats) {
    let d = |d: &roce_trace::agent::Delivery| {
        format!(
            "{} made, {} sent, {} resent, {} acknowledged, {} dropped, {} undelivered",
            d.made,
            d.sent,
            d.resent,
            d.acked,
            d.dropped,
            d.pending()
        )
    };
    tracing::info!(
        "agent stopped: observations {}; counter deltas {}; {} connections, {} ring-buffer drops",
        d(&stats.observations),
        d(&stats.counters),
        stats.connections,
        stats.ringbuf_drops
    );
}
