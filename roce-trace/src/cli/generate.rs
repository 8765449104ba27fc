use std::time::Duration;

use anyhow::Context as _;
use clap::ValueEnum;

use super::*;

#[derive(Clone, Copy, ValueEnum)]
pub(super) enum VerbArg {
    Write,
    Send,
}

#[derive(clap::Args)]
pub struct GenArgs {
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
pub(super) enum TxArg {
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

pub(super) async fn run_gen(a: GenArgs) -> anyhow::Result<()> {
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
