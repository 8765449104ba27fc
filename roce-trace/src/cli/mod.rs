//! The command line: one module per subcommand, each its flags and what it runs.

pub mod agent;
pub mod capture;
pub mod collect;
pub mod generate;
pub mod nic;
pub mod trace;
pub mod verify;

use std::path::PathBuf;

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use roce_trace::{
    capture::{self as capture_lib, CaptureOptions},
    datapath::{DatapathOptions, IngressHook, XdpModeChoice},
};
use roce_trace_common::datapath::DEFAULT_MAX_FLOWS;

use self::{
    agent::AgentArgs, capture::CaptureArgs, collect::CollectArgs, generate::GenArgs, nic::NicArgs,
    trace::TraceArgs, verify::VerifyArgs,
};

#[derive(Parser)]
#[command(
    name = "roce-trace",
    version,
    about = "See what a RoCE fabric does to RDMA traffic"
)]
pub struct Cli {
    #[command(subcommand)]
    pub cmd: Command,
}

#[derive(Subcommand)]
pub enum Command {
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
    /// Make a CA and certificates for mutual TLS between agents and the collector.
    Certs(CertsArgs),
    /// This host's NIC and PFC counters (RDMA hw_counters, ethtool statistics) in one
    /// vocabulary: pause per priority, CNPs, ECN, sequence errors; what is not available
    /// and why.
    Nic(NicArgs),
}

#[derive(clap::Args)]
pub struct CertsArgs {
    /// Directory to write ca.pem, ca.key, collector.pem/.key and NODE.pem/.key into
    /// (created; existing files are never overwritten).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// A name agents dial the collector by: a DNS name or an IP address (repeat, or
    /// comma-separated).
    #[arg(long, value_delimiter = ',', required = true)]
    collector_name: Vec<String>,
    /// A node to make a certificate for: its agent's --node (repeat, or comma-separated).
    #[arg(long, value_delimiter = ',')]
    node: Vec<String>,
}

fn run_certs(a: CertsArgs) -> anyhow::Result<()> {
    let issued = roce_trace::tls::create(&a.out, &a.collector_name, &a.node)?;
    for f in &issued.files {
        println!("{}", f.display());
    }
    tracing::info!(
        "collector: --tls-cert {0}/collector.pem --tls-key {0}/collector.key --tls-ca {0}/ca.pem; each agent: --tls-cert {0}/NODE.pem --tls-key {0}/NODE.key --tls-ca {0}/ca.pem (copy ca.key nowhere: it signs new certificates)",
        a.out.display()
    );
    Ok(())
}

/// Mutual TLS between agents and the collector: all three files, or none.
#[derive(clap::Args)]
struct TlsArgs {
    /// This side's certificate (PEM): the collector's, or an agent's naming its node.
    #[arg(id = "peer_tls_cert", long = "tls-cert", value_name = "FILE", requires_all = ["peer_tls_key", "peer_tls_ca"])]
    tls_cert: Option<PathBuf>,
    /// Its private key (PEM, readable by its owner alone).
    #[arg(id = "peer_tls_key", long = "tls-key", value_name = "FILE", requires_all = ["peer_tls_cert", "peer_tls_ca"])]
    tls_key: Option<PathBuf>,
    /// The CA that signed the other side's certificates (PEM).
    #[arg(id = "peer_tls_ca", long = "tls-ca", value_name = "FILE", requires_all = ["peer_tls_cert", "peer_tls_key"])]
    tls_ca: Option<PathBuf>,
}

impl TlsArgs {
    fn files(&self) -> Option<roce_trace::tls::TlsFiles> {
        Some(roce_trace::tls::TlsFiles {
            cert: self.tls_cert.clone()?,
            key: self.tls_key.clone()?,
            ca: self.tls_ca.clone()?,
        })
    }
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

#[derive(clap::Args)]
struct HttpTokenArgs {
    /// The HTTP API's bearer token, read from FILE (first line; readable by its owner
    /// alone).
    #[arg(long, value_name = "FILE", env = "ROCE_TRACE_HTTP_TOKEN_FILE")]
    http_token_file: Option<PathBuf>,
}

impl HttpTokenArgs {
    fn read(&self) -> anyhow::Result<Option<String>> {
        self.http_token_file.as_deref().map(read_secret_file).transpose()
    }
}

/// The secret in file `f` (its first line, trimmed): the file checked first
/// ([`check_secret_file`]), an empty one refused.
fn read_secret_file(f: &std::path::Path) -> anyhow::Result<String> {
    check_secret_file(f)?;
    let s = std::fs::read_to_string(f).with_context(|| format!("reading the token file {}", f.display()))?;
    let tok = s.lines().next().unwrap_or("").trim().to_owned();
    anyhow::ensure!(!tok.is_empty(), "the token file {} is empty", f.display());
    Ok(tok)
}

/// Whether a token was given at all (flag, environment, file, or config).
fn token_given(t: &TokenArgs, file_from_config: Option<&PathBuf>, from_config: Option<&String>) -> bool {
    t.token.is_some() || t.token_file.is_some() || file_from_config.is_some() || from_config.is_some()
}

fn read_token(
    t: &TokenArgs,
    file_from_config: Option<&PathBuf>,
    from_config: Option<&String>,
) -> anyhow::Result<String> {
    if let Some(tok) = &t.token {
        if std::env::var("ROCE_TRACE_TOKEN").ok().as_ref() != Some(tok) {
            tracing::warn!(
                "--token on the command line is visible to every user of this host (ps, /proc): prefer --token-file or ROCE_TRACE_TOKEN"
            );
        }
        return Ok(tok.clone());
    }
    if let Some(f) = t.token_file.as_ref().or(file_from_config) {
        return read_secret_file(f);
    }
    from_config
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("a token is required: --token, --token-file or ROCE_TRACE_TOKEN"))
}

fn check_secret_file(f: &std::path::Path) -> anyhow::Result<()> {
    Ok(roce_trace::sys::check_secret_file(f, "token file")?)
}

#[derive(Clone, Copy, ValueEnum)]
enum EcnArg {
    NotEct,
    Ect1,
    Ect0,
    Ce,
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

/// Runs a subcommand but `verify` (see [`run_verify`]).
pub fn run(cli: Cli) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting runtime")?;
    match cli.cmd {
        Command::Gen(a) => rt.block_on(generate::run_gen(a)),
        Command::Agent(a) => rt.block_on(agent::run_agent(a)),
        Command::Collect(a) => rt.block_on(collect::run_collect(a)),
        Command::Trace(a) => trace::run_trace(a),
        Command::Verify(_) => unreachable!("handled in main"),
        Command::Capture(a) => capture::run_capture(a, &rt),
        Command::Certs(a) => run_certs(a),
        Command::Nic(a) => nic::run_nic(a),
    }
}

/// `verify`, with its own exit codes: 0 pass, 1 a check failed, 3 could not check.
pub fn run_verify(a: VerifyArgs) -> anyhow::Result<u8> {
    verify::run_verify(a)
}

/// Where `capture` and `agent` read NIC counters: nowhere with `--no-nic`, a fixture tree
/// with `--sysfs-root` (which must be a directory), else this host.
fn nic_root(no_nic: bool, sysfs_root: Option<PathBuf>) -> anyhow::Result<Option<roce_trace::nic::Root>> {
    Ok(match (no_nic, sysfs_root) {
        (true, _) => None,
        (false, Some(d)) => {
            anyhow::ensure!(d.is_dir(), "--sysfs-root {}: not a directory", d.display());
            Some(roce_trace::nic::Root::fixture(d))
        }
        (false, None) => Some(roce_trace::nic::Root::system()),
    })
}

/// Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
    }
}

#[cfg(test)]
mod tests {
    /// Every subcommand's flags are consistent (unique names, valid `requires`): clap
    /// checks it only when a command is parsed, so a clash would fail at run time.
    #[test]
    fn the_command_line_is_consistent() {
        use clap::CommandFactory as _;
        super::Cli::command().debug_assert();
    }
}
