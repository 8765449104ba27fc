//! Project tasks: `cargo xtask lint | bench | demo`. The README's commands run
//! scripts/setup first, then these.

mod bench;
mod demo;
mod lab;
/// The eBPF toolchain pin, read as the datapath build reads it (one parser).
#[path = "../../roce-trace-datapath/toolchain.rs"]
mod toolchain;

use std::process::{Command, ExitCode};

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "xtask")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// cargo fmt --check, and clippy -D warnings on the workspace and the eBPF crate.
    Lint,
    /// Benchmarks: datapath per-packet cost, generator rate, capture cost vs tcpdump.
    Bench {
        /// datapath, gen, capture, or all.
        #[arg(default_value = "all")]
        which: String,
        /// Iterations per run of a row (datapath; each row is run 15 times, the empty
        /// program between, and the median printed).
        #[arg(long, default_value_t = 200_000)]
        repeat: u32,
        /// Another build's eBPF object, timed beside this build's in the same runs
        /// (datapath): e.g. target/release/build/roce-trace-datapath-*/out/roce-trace of
        /// a checkout of an older commit with this build's maps (f12decb or later: the
        /// loader refuses an older one, naming the map).
        #[arg(long)]
        baseline: Option<std::path::PathBuf>,
        /// Another build's roce-trace binary, run beside this build's (capture): the
        /// two alternate run by run on the same lab, and each one's median is printed.
        #[arg(long)]
        baseline_bin: Option<std::path::PathBuf>,
        /// What the datapath's cold table evicts before each packet: both the caches and
        /// the TLB, the caches alone (the eviction buffer on huge pages), or the TLB alone.
        #[arg(long, value_enum, default_value_t = bench::Cold::Both)]
        cold: bench::Cold,
    },
    /// The virtual leaf-spine fabric: up, down, status, faults.
    Lab(lab::LabArgs),
    /// The lab, RoCEv2 between host pairs, roce-trace on every host, a DSCP rewrite and
    /// CE marking injected mid-run, and what roce-trace saw.
    Demo {
        /// How long traffic runs (the rewrite is on from a quarter of it to five eighths;
        /// at least 12 s, for the continuous verification to see it come and go).
        #[arg(long, default_value_t = 16)]
        seconds: u64,
        /// Fleet mode: a NATS JetStream server and three collectors as a group; agents
        /// publish to NATS, and the group's merged view is judged.
        #[arg(long)]
        nats: bool,
        /// Leave the lab, the agents and the collector up after the checks, for a person
        /// to look at the map (its URL is printed); Ctrl-C tears everything down.
        #[arg(long)]
        keep: bool,
    },
}

/// The eBPF crate's pinned nightly, as `roce-trace-ebpf/rust-toolchain.toml` names it
/// (the one place it is written).
pub fn ebpf_toolchain() -> anyhow::Result<String> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../roce-trace-ebpf/rust-toolchain.toml"
    );
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
    toolchain::channel(&text)
        .map(str::to_owned)
        .with_context(|| format!("{path}: no channel"))
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.cmd {
        Cmd::Lint => lint(),
        Cmd::Bench {
            which,
            repeat,
            baseline,
            baseline_bin,
            cold,
        } => bench::run(&which, repeat, baseline.as_deref(), baseline_bin.as_deref(), cold),
        Cmd::Demo { seconds, nats, keep } => demo::run(seconds, nats, keep),
        Cmd::Lab(a) => lab::run(a),
    }
}

pub fn step(cmd: &mut Command) -> anyhow::Result<()> {
    eprintln!("xtask: $ {cmd:?}");
    let status = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed ({status})");
    }
    Ok(())
}

fn lint() -> anyhow::Result<()> {
    step(Command::new("cargo").args(["fmt", "--all", "--", "--check"]))?;
    // The fuzz harnesses are a workspace of their own; formatting needs no nightly build.
    let fuzz = concat!(env!("CARGO_MANIFEST_DIR"), "/../fuzz/Cargo.toml");
    step(Command::new("cargo").args(["fmt", "--manifest-path", fuzz, "--", "--check"]))?;
    step(Command::new("cargo").args(["clippy", "--all-targets", "--", "-D", "warnings"]))?;
    step(
        Command::new("cargo")
            .arg(format!("+{}", ebpf_toolchain()?))
            .args([
                "clippy",
                "-p",
                "roce-trace-ebpf",
                "--target",
                "bpfel-unknown-none",
                "-Z",
                "build-std=core",
            ])
            .args(["--target-dir", "target/ebpf-clippy", "--", "-D", "warnings"])
            .env("RUSTFLAGS", "--cfg bpf_target_arch=\"x86_64\""),
    )
}
