use std::{path::PathBuf, time::Duration};

use anyhow::Context as _;

use super::*;

#[derive(clap::Args)]
pub struct TraceArgs {
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
    /// The collector API's bearer token, from a file (--http-token-file).
    #[command(flatten)]
    http_token: HttpTokenArgs,
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

pub(super) fn run_trace(a: TraceArgs) -> anyhow::Result<()> {
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
            let bearer = a.http_token.read()?;
            let f: serde_json::Value =
                roce_trace::http::get_json_as(http, &format!("/flow?id={enc}"), bearer.as_deref())?;
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
