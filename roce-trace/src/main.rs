use std::{path::PathBuf, process::ExitCode, time::Duration};

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use roce_trace::{
    capture::{self, CaptureOptions},
    datapath::{DatapathOptions, IngressHook, XdpModeChoice},
};
use roce_trace_common::datapath::DEFAULT_MAX_FLOWS;
use tracing_subscriber::EnvFilter;

#[derive(Parser)]
#[command(
    name = "roce-trace",
    version,
    about = "See what a RoCE fabric does to RDMA traffic"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Count and sample RoCEv2 traffic on this host's interfaces.
    Capture(CaptureArgs),
    /// Send RoCEv2 like an RDMA NIC (RC requester with DCQCN) and answer it like one
    /// (ACK, NAK, CNP), for fabrics and hosts without RDMA NICs.
    Gen(GenArgs),
    /// Continuous sampling service: stream observations and counters to a collector.
    Agent(AgentArgs),
    /// Join what the agents observe into each flow's path and class.
    Collect(CollectArgs),
    /// In-band probes on a flow's own 5-tuple and class: its hops, and its class at each.
    Trace(TraceArgs),
    /// Check the fabric against a policy: pass/fail per rule with evidence (exit 0 pass,
    /// 1 a check failed, 2 error, 3 a check could not be made).
    Verify(VerifyArgs),
}

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["report", "collector_http", "interfaces"])))]
struct VerifyArgs {
    /// The policy (TOML; see dist/fabric-policy.toml).
    #[arg(long)]
    policy: PathBuf,
    /// Judge a report the collector wrote (`collect --report`), `-` for stdin.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Judge a running collector (its --http address) after --window.
    #[arg(long)]
    collector_http: Option<std::net::SocketAddr>,
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

#[derive(clap::Args)]
struct TraceArgs {
    /// Destination host (omit with --flow).
    dst: Option<std::net::IpAddr>,
    /// UDP source port of the flow to follow.
    #[arg(long, default_value_t = 49152, conflicts_with = "flow")]
    sport: u16,
    /// Follow a flow the collector (its id, as in /flows) or a capture knows (the same
    /// `src:sport>dst/0xqp` form), with its addresses, port and class.
    #[arg(long)]
    flow: Option<String>,
    /// Where --flow comes from: a `roce-trace capture -w` JSON Lines file.
    #[arg(long, conflicts_with = "collector_http")]
    capture_file: Option<PathBuf>,
    /// Where --flow comes from: the collector's HTTP address.
    #[arg(long)]
    collector_http: Option<std::net::SocketAddr>,
    /// Source address (default: the one the kernel uses to reach DST).
    #[arg(long)]
    src: Option<std::net::IpAddr>,
    #[arg(long, default_value_t = 26, value_parser = clap::value_parser!(u8).range(0..=63))]
    dscp: u8,
    #[arg(long, value_enum, default_value_t = EcnArg::Ect0)]
    ecn: EcnArg,
    #[arg(long, default_value_t = 16)]
    max_hops: u8,
    /// Probes per hop.
    #[arg(long, default_value_t = 3)]
    probes: u32,
    /// Wait this long for the answers of one hop.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "1s")]
    timeout: Duration,
    /// Probes per second at most.
    #[arg(long, default_value_t = 100)]
    rate: u32,
    /// Map ECMP: vary the source port until new ports stop revealing new paths.
    #[arg(long)]
    paths: bool,
    /// With --paths: stop after this many ports in a row with no new path.
    #[arg(long, default_value_t = 16)]
    patience: u32,
    /// With --paths: try at most this many ports.
    #[arg(long, default_value_t = 256)]
    max_ports: u32,
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct AgentArgs {
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
    /// Serve Prometheus metrics on ADDR (e.g. 127.0.0.1:9464).
    #[arg(long)]
    metrics: Option<std::net::SocketAddr>,
    #[command(flatten)]
    ingress: IngressArgs,
}

#[derive(clap::Args)]
struct TokenArgs {
    /// Shared secret of agents and collector (or ROCE_TRACE_TOKEN).
    #[arg(long, env = "ROCE_TRACE_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Read the token from FILE (first line).
    #[arg(long)]
    token_file: Option<PathBuf>,
}

fn read_token(
    t: &TokenArgs,
    file_from_config: Option<&PathBuf>,
    from_config: Option<&String>,
) -> anyhow::Result<String> {
    if let Some(t) = &t.token {
        return Ok(t.clone());
    }
    if let Some(f) = t.token_file.as_ref().or(file_from_config) {
        let s =
            std::fs::read_to_string(f).with_context(|| format!("reading the token file {}", f.display()))?;
        let tok = s.lines().next().unwrap_or("").trim().to_owned();
        anyhow::ensure!(!tok.is_empty(), "the token file {} is empty", f.display());
        return Ok(tok);
    }
    from_config
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("a token is required: --token, --token-file or ROCE_TRACE_TOKEN"))
}

#[derive(clap::Args)]
struct CollectArgs {
    /// Address agents connect to.
    #[arg(long, default_value = "0.0.0.0:4792")]
    listen: std::net::SocketAddr,
    /// Serve the JSON API and Prometheus metrics on ADDR.
    #[arg(long)]
    http: Option<std::net::SocketAddr>,
    #[command(flatten)]
    token: TokenArgs,
    /// Write the final report (JSON) here on exit.
    #[arg(long, default_value = "roce-trace-report.json")]
    report: PathBuf,
    /// Stop after this long.
    #[arg(long, value_parser = humantime::parse_duration)]
    duration: Option<Duration>,
    /// A packet's trajectory is complete this long after its first observation.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "2s")]
    trajectory_timeout: Duration,
    /// Flows tracked at most (more are refused and counted).
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
    /// Live view refresh.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "2s")]
    interval: Duration,
}

/// What the traffic in the window was meant to be.
#[derive(Clone, Copy, ValueEnum)]
enum LoadArg {
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

#[derive(Clone, Copy, ValueEnum)]
enum VerbArg {
    Write,
    Send,
}

#[derive(Clone, Copy, ValueEnum)]
enum EcnArg {
    NotEct,
    Ect1,
    Ect0,
    Ce,
}

#[derive(clap::Args)]
struct GenArgs {
    /// Local address to send from and answer on (UDP 4791); repeat for IPv4 and IPv6.
    /// Default with --to: the address the kernel uses to reach DST.
    #[arg(long)]
    bind: Vec<std::net::IpAddr>,
    /// Send to this host (without it, only answer).
    #[arg(long)]
    to: Option<std::net::IpAddr>,
    /// Queue pairs, each with its own UDP source port and DestQP.
    #[arg(long, default_value_t = 1)]
    qps: u32,
    #[arg(long, value_enum, default_value_t = VerbArg::Write)]
    verb: VerbArg,
    /// Message size (e.g. 4096, 64KiB, 1MiB).
    #[arg(long, default_value = "64KiB", value_parser = roce_trace::traffic::parse_size)]
    msg_size: u32,
    /// RoCE path MTU: 256, 512, 1024, 2048 or 4096.
    #[arg(long, default_value_t = 1024)]
    mtu: u32,
    #[arg(long, default_value_t = 26, value_parser = clap::value_parser!(u8).range(0..=63))]
    dscp: u8,
    #[arg(long, value_enum, default_value_t = EcnArg::Ect0)]
    ecn: EcnArg,
    /// Per-QP rate: e.g. 1gbit, 200mbit, 50kpps, or max.
    #[arg(long, default_value = "1gbit")]
    rate: roce_trace::traffic::Rate,
    /// Stop after this long (default: until Ctrl-C).
    #[arg(long, value_parser = humantime::parse_duration)]
    duration: Option<Duration>,
    /// UDP source port of the first QP (the next QPs count up).
    #[arg(long, default_value_t = 49152)]
    sport_base: u16,
    /// Local QPN of the first QP (see `roce-trace gen --help` on numbering).
    #[arg(long, default_value = "0x100", value_parser = parse_qpn)]
    qp_base: u32,
    /// Send at a fixed rate, ignoring CNPs.
    #[arg(long)]
    no_dcqcn: bool,
    /// DSCP of the CNPs this host sends.
    #[arg(long, default_value_t = 48, value_parser = clap::value_parser!(u8).range(0..=63))]
    cnp_dscp: u8,
    /// At most one CNP per QP per interval.
    #[arg(long, default_value = "50us", value_parser = humantime::parse_duration)]
    cnp_interval: Duration,
    /// DSCP of the ACKs and NAKs this host sends.
    #[arg(long, default_value_t = 26, value_parser = clap::value_parser!(u8).range(0..=63))]
    ack_dscp: u8,
    /// Packets per sendmmsg call.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// RC local ACK timeout: with messages outstanding and nothing acknowledged for this
    /// long, go back to the oldest unacknowledged message (default: 4.096 µs × 2^14).
    #[arg(long, default_value = "67108864ns", value_parser = humantime::parse_duration)]
    ack_timeout: Duration,
    /// Messages per QP: start this many, finish them, then stop (with --duration, at
    /// whichever comes first).
    #[arg(long)]
    messages: Option<u64>,
    /// Timeouts in a row before the QP gives up (retry exceeded), 0..=7 as in RC.
    #[arg(long, default_value_t = 7, value_parser = clap::value_parser!(u32).range(0..=7))]
    retry_count: u32,
    /// Print the final report as JSON.
    #[arg(long)]
    json: bool,
    /// How requests leave: `socket` (UDP, routed by the kernel) or `packet` (raw frames
    /// out of --iface to --dst-mac, optionally tagged; faster, exact framing).
    #[arg(long, value_enum, default_value_t = TxArg::Socket)]
    tx: TxArg,
    /// Interface for --tx packet.
    #[arg(long, required_if_eq("tx", "packet"))]
    iface: Option<String>,
    /// Next-hop MAC for --tx packet (e.g. 02:00:00:00:00:01).
    #[arg(long, required_if_eq("tx", "packet"), value_parser = parse_mac)]
    dst_mac: Option<[u8; 6]>,
    /// 802.1Q VLAN ID for --tx packet.
    #[arg(long, requires = "pcp")]
    vlan: Option<u16>,
    /// PCP of the 802.1Q tag for --tx packet.
    #[arg(long, requires = "vlan", value_parser = clap::value_parser!(u8).range(0..=7))]
    pcp: Option<u8>,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum TxArg {
    Socket,
    Packet,
}

fn parse_mac(s: &str) -> Result<[u8; 6], String> {
    roce_trace::traffic::net::parse_mac(s).ok_or_else(|| format!("bad MAC address `{s}`"))
}

fn parse_qpn(s: &str) -> Result<u32, String> {
    let v = match s.strip_prefix("0x") {
        Some(h) => u32::from_str_radix(h, 16),
        None => s.parse(),
    }
    .map_err(|_| format!("bad QP number `{s}`"))?;
    if v > 0xff_ffff {
        Err(format!("QP number `{s}` exceeds 24 bits"))
    } else {
        Ok(v)
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum Direction {
    Ingress,
    Egress,
    Both,
}

#[derive(Clone, Copy, ValueEnum)]
enum XdpModeArg {
    /// Native (driver) XDP, falling back to generic with a warning.
    Auto,
    Native,
    Generic,
}

#[derive(Clone, Copy, Default, ValueEnum)]
enum IngressArg {
    /// Native XDP; TC on veth (XDP there makes the kernel copy every packet) and where
    /// native XDP is unavailable.
    #[default]
    Auto,
    /// XDP, in the mode `--xdp-mode` gives (auto: native, else generic).
    Xdp,
    /// TC ingress (a tcx link; a clsact filter before Linux 6.6).
    Tc,
}

/// How arriving packets are observed (capture and agent).
#[derive(clap::Args)]
struct IngressArgs {
    /// Hook observing arriving packets.
    #[arg(long, value_enum, default_value_t)]
    ingress_hook: IngressArg,
    /// XDP attachment mode (implies `--ingress-hook xdp`).
    #[arg(long, value_enum)]
    xdp_mode: Option<XdpModeArg>,
}

impl IngressArgs {
    /// The ingress hook the flags ask for: `--xdp-mode` alone means XDP in that mode.
    fn hook(&self) -> anyhow::Result<IngressHook> {
        let mode = |m: XdpModeArg| match m {
            XdpModeArg::Auto => XdpModeChoice::Auto,
            XdpModeArg::Native => XdpModeChoice::Native,
            XdpModeArg::Generic => XdpModeChoice::Generic,
        };
        Ok(match (self.ingress_hook, self.xdp_mode) {
            (IngressArg::Auto, None) => IngressHook::Auto,
            (IngressArg::Auto | IngressArg::Xdp, Some(m)) => IngressHook::Xdp(mode(m)),
            (IngressArg::Xdp, None) => IngressHook::Xdp(XdpModeChoice::Auto),
            (IngressArg::Tc, None) => IngressHook::Tc,
            (IngressArg::Tc, Some(_)) => anyhow::bail!("--xdp-mode applies to XDP, not to --ingress-hook tc"),
        })
    }
}

#[derive(clap::Args)]
struct CaptureArgs {
    /// Interface to observe (repeat for several).
    #[arg(short = 'i', long = "interface", required_unless_present = "read")]
    interfaces: Vec<String>,
    /// Read a pcap or pcapng file instead (`-` for stdin), e.g. a NIC sniffer's capture:
    /// `tcpdump -i mlx5_0 -w - | roce-trace capture -r -`.
    #[arg(short = 'r', long, conflicts_with_all = ["interfaces", "duration", "count"])]
    read: Option<PathBuf>,
    /// Stop after this long (e.g. 30s, 5m).
    #[arg(long, value_parser = humantime::parse_duration)]
    duration: Option<Duration>,
    /// Stop after this many RoCEv2 packets (all interfaces and directions).
    #[arg(short = 'c', long)]
    count: Option<u64>,
    /// Sample 1 in N packets by identity hash (0: report anomalies only).
    #[arg(long, default_value_t = 1000)]
    sample_rate: u32,
    /// Sampling seed; use the same on every host so they sample the same packets.
    #[arg(long, default_value_t = 0)]
    seed: u32,
    /// DSCPs RDMA traffic should carry; packets with any other are always reported.
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u8).range(0..=63))]
    expect_dscp: Vec<u8>,
    /// RoCEv2 UDP destination port.
    #[arg(long, default_value_t = 4791)]
    port: u16,
    /// Which side to observe: XDP (or TC) on ingress, TC on egress.
    #[arg(long, value_enum, default_value_t = Direction::Both)]
    direction: Direction,
    #[command(flatten)]
    ingress: IngressArgs,
    /// Flows the kernel keeps besides its per-CPU flow table (up to 2048 slots a CPU,
    /// direct mapped): those whose slot is taken; the idlest are evicted beyond this many.
    #[arg(long, default_value_t = DEFAULT_MAX_FLOWS)]
    max_flows: u32,
    /// JSON Lines on stdout instead of the live view.
    #[arg(long)]
    json: bool,
    /// Also write to FILE (repeatable): the sampled packets as pcapng when FILE ends in
    /// `.pcapng` (headers, original length, one interface per observation point), JSON
    /// Lines otherwise.
    #[arg(short = 'w', long = "write", value_name = "FILE")]
    write: Vec<PathBuf>,
    /// Refresh interval of the live view and of periodic flow records.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "1s")]
    interval: Duration,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")))
        .with_target(false)
        .init();
    let cli = Cli::parse();
    if let Command::Verify(a) = cli.cmd {
        // Its own exit codes: 0 pass, 1 a check failed, 2 error, 3 could not check.
        return match run_verify(a) {
            Ok(code) => ExitCode::from(code),
            Err(e) => {
                eprintln!("roce-trace: error: {e:#}");
                ExitCode::from(2)
            }
        };
    }
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("roce-trace: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting runtime")?;
    match cli.cmd {
        Command::Gen(a) => rt.block_on(run_gen(a)),
        Command::Agent(a) => rt.block_on(run_agent(a)),
        Command::Collect(a) => rt.block_on(run_collect(a)),
        Command::Trace(a) => run_trace(a),
        Command::Verify(_) => unreachable!("handled in main"),
        Command::Capture(a) => {
            let opts = CaptureOptions {
                ifaces: a.interfaces,
                ingress: matches!(a.direction, Direction::Ingress | Direction::Both)
                    .then(|| a.ingress.hook())
                    .transpose()?,
                egress: matches!(a.direction, Direction::Egress | Direction::Both),
                duration: a.duration,
                count: a.count,
                datapath: DatapathOptions {
                    udp_port: a.port,
                    sample_rate: a.sample_rate,
                    seed: a.seed,
                    expected_dscp: a.expect_dscp,
                    max_flows: a.max_flows,
                    batch_wakeups: true,
                    ..DatapathOptions::default()
                },
                json_stdout: a.json,
                write: a.write,
                interval: a.interval,
            };
            if let Some(path) = &a.read {
                capture::run_offline(&opts, path)?;
                return Ok(());
            }
            rt.block_on(async {
                capture::run(opts, shutdown_signal(), |hooks| {
                    let list: Vec<String> = hooks
                        .iter()
                        .map(|h| format!("{} {} ({})", h.iface, h.hook, h.mode))
                        .collect();
                    tracing::info!("capturing on {}", list.join(", "));
                })
                .await
            })?;
            Ok(())
        }
    }
}

/// Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
    }
}

async fn run_gen(a: GenArgs) -> anyhow::Result<()> {
    use roce_trace::traffic::{self, GenOptions, SenderOptions, TxMode, requester::Verb};
    if a.vlan.is_some() && a.tx != TxArg::Packet {
        anyhow::bail!("--vlan/--pcp need --tx packet (a socket cannot tag frames)");
    }
    use std::sync::{Arc, atomic::AtomicBool};
    let mut bind = a.bind;
    if let Some(dst) = a.to
        && !bind.iter().any(|b| b.is_ipv4() == dst.is_ipv4())
    {
        bind.push(traffic::net::source_for(dst).with_context(|| format!("finding a route to {dst}"))?);
    }
    let opts = GenOptions {
        bind,
        sender: a.to.map(|dst| SenderOptions {
            dst,
            qps: a.qps,
            verb: match a.verb {
                VerbArg::Write => Verb::Write,
                VerbArg::Send => Verb::Send,
            },
            msg_size: a.msg_size,
            mtu: a.mtu,
            dscp: a.dscp,
            ecn: a.ecn as u8,
            rate: a.rate,
            sport_base: a.sport_base,
            qp_base: a.qp_base,
            dcqcn: !a.no_dcqcn,
            batch: a.batch,
            ack_timeout: roce_trace::traffic::requester::AckTimeout {
                timeout: a.ack_timeout,
                retries: a.retry_count,
            },
            messages: a.messages,
            tx: match (a.tx, &a.iface, a.dst_mac) {
                (TxArg::Packet, Some(iface), Some(dst_mac)) => TxMode::Packet {
                    iface: iface.clone(),
                    dst_mac,
                    vlan: a.vlan.zip(a.pcp),
                },
                _ => TxMode::Socket,
            },
        }),
        duration: a.duration,
        cnp_dscp: a.cnp_dscp,
        cnp_interval: a.cnp_interval,
        ack_dscp: a.ack_dscp,
    };
    opts.validate()?;
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let mut task = tokio::task::spawn_blocking(move || {
        tracing::info!(
            "gen: answering on {}{}",
            opts.bind
                .iter()
                .map(|b| b.to_string())
                .collect::<Vec<_>>()
                .join(", "),
            opts.sender
                .as_ref()
                .map(|s| format!("; sending to {} on {} QP(s)", s.dst, s.qps))
                .unwrap_or_default()
        );
        traffic::run(&opts, &stop2)
    });
    let report = tokio::select! {
        r = &mut task => r,
        _ = shutdown_signal() => {
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            task.await
        }
    }
    .context("generator thread")??;
    if a.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", traffic::render_report(&report));
    }
    Ok(())
}

async fn run_agent(a: AgentArgs) -> anyhow::Result<()> {
    use roce_trace::agent::{self, AgentConfig, AgentOptions};
    let cfg = match &a.config {
        Some(p) => AgentConfig::load(p)?,
        None => AgentConfig::default(),
    };
    let token = read_token(&a.token, cfg.token_file.as_ref(), cfg.token.as_ref())?;
    let interval = match (a.interval, &cfg.interval) {
        (Some(i), _) => i,
        (None, Some(s)) => humantime::parse_duration(s)?,
        (None, None) => Duration::from_secs(2),
    };
    let opts = AgentOptions {
        collector: a
            .collector
            .or(cfg.collector)
            .context("no collector: --collector HOST:PORT or `collector` in the config")?,
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
            batch_wakeups: false,
            ..DatapathOptions::default()
        },
        interval,
        queue: a.queue.or(cfg.queue).unwrap_or(100_000),
        clock_synced: a.clock_synced || cfg.clock_synced.unwrap_or(false),
        metrics: a.metrics.or(cfg.metrics),
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

async fn run_collect(a: CollectArgs) -> anyhow::Result<()> {
    use roce_trace::{collector, correlate::JoinConfig};
    let token = read_token(&a.token, None, None)?;
    let opts = collector::CollectorOptions {
        listen: a.listen,
        http: a.http,
        token,
        report: Some(a.report.clone()),
        join: JoinConfig {
            trajectory_timeout_ns: a.trajectory_timeout.as_nanos() as u64,
            flow_idle_ns: a.flow_idle.as_nanos() as u64,
            max_flows: a.max_flows,
            ..JoinConfig::default()
        },
        live: !a.quiet,
        trace: a.trace,
        interval: a.interval,
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

fn run_verify(a: VerifyArgs) -> anyhow::Result<u8> {
    use roce_trace::{
        local::{self, Source},
        verify::{self, baseline::Baseline, drill, output},
    };
    let load: verify::checks::Load = a.load.into();
    let policy = local::load_policy(&a.policy)?;
    let source = if let Some(r) = a.report.clone() {
        anyhow::ensure!(!a.drill, "--drill needs a live window: --collector-http or -i");
        Source::Report(r)
    } else if let Some(http) = a.collector_http {
        Source::Collector {
            http,
            window: a.window,
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
                token: String::new(),
                datapath: DatapathOptions {
                    udp_port: a.port,
                    sample_rate: a.sample_rate,
                    seed: 0,
                    expected_dscp: Vec::new(),
                    batch_wakeups: false,
                    ..DatapathOptions::default()
                },
                interval: Duration::from_millis(500),
                queue: 1_000_000,
                clock_synced: true,
                metrics: None,
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
    let (checks, flows) = if a.drill {
        let opts = local::DrillOptions {
            down: a.down.clone(),
            up: a.up.clone(),
            hold: a.hold,
        };
        let snaps = rt.block_on(async {
            match &source {
                Source::Collector { http, .. } => local::run_drill(*http, &opts).await,
                Source::Local { agent, .. } => {
                    Ok(
                        local::with_local(agent, |http| async move { local::run_drill(http, &opts).await })
                            .await?
                            .0,
                    )
                }
                Source::Report(_) => unreachable!("refused above"),
            }
        })?;
        let via = policy.ecmp.as_ref().map(|e| e.via.clone()).unwrap_or_default();
        let d = drill::measure(&snaps, &via);
        (drill::judge(&policy, &d), snaps.during.flows.len())
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
        (checks, report.flows.len())
    };
    let v = output::Verdict::new(source.describe(), load, flows, checks);
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_vec_pretty(&v)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    if let Some(p) = &a.junit {
        std::fs::write(p, output::junit(&v)).with_context(|| format!("writing {}", p.display()))?;
    }
    if a.json_stdout {
        println!("{}", serde_json::to_string(&v)?);
    } else {
        print!("{}", output::table(&v));
    }
    Ok(v.exit_code())
}

fn run_trace(a: TraceArgs) -> anyhow::Result<()> {
    use roce_trace::trace::{self, TraceOptions};
    let (dst, src, sport, dscp, ecn) = match (&a.flow, a.collector_http) {
        (Some(id), None) => {
            let file = a
                .capture_file
                .as_ref()
                .context("--flow needs --collector-http or --capture-file")?;
            let text =
                std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
            let f = text
                .lines()
                .filter_map(|l| serde_json::from_str::<roce_trace::record::FlowRecord>(l).ok())
                .filter(|f| f.kind == "flow" && f.direction == "egress")
                .find(|f| format!("{}:{}>{}/{:#x}", f.src_ip, f.udp_sport, f.dst_ip, f.dst_qp) == *id)
                .with_context(|| format!("no egress flow `{id}` in {}", file.display()))?;
            // The class the sender sets: its DSCP, and its most common ECN codepoint short
            // of CE (which the fabric sets).
            let e = f.ecn;
            let ecn = [(0u8, e.not_ect), (1, e.ect1), (2, e.ect0)]
                .into_iter()
                .max_by_key(|x| x.1)
                .map(|x| x.0)
                .unwrap_or(2);
            (f.dst_ip, Some(f.src_ip), f.udp_sport, f.dscp, ecn)
        }
        (Some(id), Some(http)) => {
            let enc = roce_trace::http::percent_encode(id);
            let f: serde_json::Value = roce_trace::http::get_json(http, &format!("/flow?id={enc}"))?;
            let ip = |k: &str| -> anyhow::Result<std::net::IpAddr> {
                Ok(f[k].as_str().context("flow without addresses")?.parse()?)
            };
            let class = &f["class"][0];
            (
                ip("dst_ip")?,
                Some(ip("src_ip")?),
                f["udp_sport"].as_u64().context("flow without a port")? as u16,
                class["dscp"].as_u64().map(|d| d as u8).unwrap_or(a.dscp),
                class["ecn"].as_u64().map(|e| e as u8).unwrap_or(a.ecn as u8),
            )
        }
        _ => (
            a.dst.context("give DST, or --flow ID with --collector-http")?,
            a.src,
            a.sport,
            a.dscp,
            a.ecn as u8,
        ),
    };
    let src = match a.src.or(src) {
        Some(s) => s,
        None => roce_trace::traffic::net::source_for(dst).with_context(|| format!("no route to {dst}"))?,
    };
    let opts = TraceOptions {
        dst,
        src,
        sport,
        dscp,
        ecn,
        max_hops: a.max_hops,
        probes: a.probes,
        timeout: a.timeout,
        rate: a.rate,
    };
    if a.paths {
        let r = trace::paths(&opts, a.patience, a.max_ports)?;
        if a.json {
            println!("{}", serde_json::to_string(&r)?);
        } else {
            print!("{}", trace::render_paths(&r));
        }
    } else {
        let r = trace::trace(&opts)?;
        if a.json {
            println!("{}", serde_json::to_string(&r)?);
        } else {
            print!("{}", trace::render(&r));
        }
    }
    Ok(())
}

/// The agent's last line (tests read it).
fn log_agent_stats(stats: &roce_trace::agent::AgentStats) {
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
