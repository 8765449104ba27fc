//! roce-trace: see what a RoCE fabric does to RDMA traffic. The subcommands are in
//! [`cli`]; the pipeline's stages are the workspace's crates (README, "Architecture").

use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::EnvFilter;

mod cli;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")))
        .with_target(false)
        .init();
    let cli = cli::Cli::parse();
    if let cli::Command::Verify(a) = cli.cmd {
        // Its own exit codes: 0 pass, 1 a check failed, 2 error, 3 could not check.
        return match cli::run_verify(a) {
            Ok(code) => ExitCode::from(code),
            Err(e) => {
                eprintln!("roce-trace: error: {e:#}");
                ExitCode::from(2)
            }
        };
    }
    match cli::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("roce-trace: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
