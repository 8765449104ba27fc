use std::{path::PathBuf, process::ExitCode, time::Duration};

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use roce_trace::{
    capture::{self, CaptureOptions},
    datapath::{DatapathOptions, XdpModeChoice},
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

#[derive(clap::Args)]
struct CaptureArgs {
    /// Interface to observe (repeat for several).
    #[arg(short = 'i', long = "interface", required = true)]
    interfaces: Vec<String>,
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
    /// Which side to observe: XDP on ingress, TC on egress.
    #[arg(long, value_enum, default_value_t = Direction::Both)]
    direction: Direction,
    #[arg(long, value_enum, default_value_t = XdpModeArg::Auto)]
    xdp_mode: XdpModeArg,
    /// Flows tracked in the kernel (LRU beyond that).
    #[arg(long, default_value_t = DEFAULT_MAX_FLOWS)]
    max_flows: u32,
    /// JSON Lines on stdout instead of the live view.
    #[arg(long)]
    json: bool,
    /// Also write JSON Lines to FILE.
    #[arg(short = 'w', long = "write", value_name = "FILE")]
    write: Option<PathBuf>,
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
        Command::Capture(a) => {
            let opts = CaptureOptions {
                ifaces: a.interfaces,
                ingress: matches!(a.direction, Direction::Ingress | Direction::Both),
                egress: matches!(a.direction, Direction::Egress | Direction::Both),
                xdp_mode: match a.xdp_mode {
                    XdpModeArg::Auto => XdpModeChoice::Auto,
                    XdpModeArg::Native => XdpModeChoice::Native,
                    XdpModeArg::Generic => XdpModeChoice::Generic,
                },
                duration: a.duration,
                count: a.count,
                datapath: DatapathOptions {
                    udp_port: a.port,
                    sample_rate: a.sample_rate,
                    seed: a.seed,
                    expected_dscp: a.expect_dscp,
                    max_flows: a.max_flows,
                },
                json_stdout: a.json,
                write: a.write,
                interval: a.interval,
            };
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
