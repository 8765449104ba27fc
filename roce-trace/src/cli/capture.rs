use std::{path::PathBuf, time::Duration};

use clap::ValueEnum;

use super::*;

#[derive(Clone, Copy, ValueEnum)]
pub(super) enum Direction {
    Ingress,
    Egress,
    Both,
}

#[derive(clap::Args)]
pub struct CaptureArgs {
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
    /// Do not read the interfaces' NIC and PFC counters.
    #[arg(long)]
    no_nic: bool,
    /// Read NIC and PFC counters from a fixture tree laid out like /sys (see `roce-trace
    /// nic --sysfs-root`) instead of this host's.
    #[arg(long, value_name = "DIR", conflicts_with = "no_nic")]
    sysfs_root: Option<PathBuf>,
}

pub(super) fn run_capture(a: CaptureArgs, rt: &tokio::runtime::Runtime) -> anyhow::Result<()> {
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
        nic: nic_root(a.no_nic, a.sysfs_root)?,
    };
    if let Some(path) = &a.read {
        capture_lib::run_offline(&opts, path)?;
        return Ok(());
    }
    rt.block_on(async {
        capture_lib::run(opts, shutdown_signal(), |hooks| {
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
