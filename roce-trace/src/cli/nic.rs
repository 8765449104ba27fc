use std::{io::Write as _, path::PathBuf, time::Duration};

use anyhow::Context as _;
use roce_trace::nic::{self, Root, Tracker};

/// `roce-trace nic`: one host's NIC and PFC counters.
#[derive(clap::Args)]
pub struct NicArgs {
    /// Interface to read (repeat for several); default: every interface but `lo`.
    #[arg(short = 'i', long = "interface")]
    interfaces: Vec<String>,
    /// Read again every INTERVAL and show what changed: deltas and rates over the real
    /// time between reads, PFC per priority, resets and wraps.
    #[arg(long, value_parser = humantime::parse_duration)]
    interval: Option<Duration>,
    /// With --interval: stop after this many intervals.
    #[arg(long, requires = "interval")]
    count: Option<u64>,
    /// JSON Lines (one `nic` record per interface and read).
    #[arg(long)]
    json: bool,
    /// Also the driver's counters no canonical name covers.
    #[arg(long)]
    all: bool,
    /// Read a fixture tree laid out like /sys instead of this host (ethtool statistics in
    /// DIR/ethtool/IFACE as `ethtool -S` prints them, the boot id in DIR/boot_id).
    #[arg(long, value_name = "DIR")]
    sysfs_root: Option<PathBuf>,
}

pub(super) fn run_nic(a: NicArgs) -> anyhow::Result<()> {
    if a.interval.is_some_and(|i| i.is_zero()) {
        anyhow::bail!("--interval must be more than 0");
    }
    let root = match &a.sysfs_root {
        Some(d) => {
            anyhow::ensure!(d.is_dir(), "--sysfs-root {}: not a directory", d.display());
            Root::fixture(d)
        }
        None => Root::system(),
    };
    let ports = nic::ports(&root, &a.interfaces).context("finding interfaces")?;
    anyhow::ensure!(
        !ports.is_empty(),
        "no interfaces to read in {}",
        root.path().display()
    );
    let mut tracker = Tracker::default();
    let mut out = std::io::stdout().lock();
    let mut read = |tracker: &mut Tracker, first: bool| -> anyhow::Result<()> {
        for p in &ports {
            let r = nic::read(&root, p);
            let iv = tracker.update(&p.netdev, r.clone());
            let text = if a.json {
                serde_json::to_string(&nic::record(p, &r, iv.as_ref(), a.all))?
            } else if first || iv.is_none() {
                nic::render_reading(p, &r, a.all)
            } else {
                nic::render_interval(p, iv.as_ref().expect("not the first"))
            };
            // A closed pipe (`| head`) ends the command quietly.
            if writeln!(out, "{text}").and_then(|_| out.flush()).is_err() {
                std::process::exit(0);
            }
        }
        Ok(())
    };
    read(&mut tracker, true)?;
    let Some(every) = a.interval else {
        return Ok(());
    };
    let mut n = 0u64;
    while a.count.is_none_or(|c| n < c) {
        std::thread::sleep(every);
        read(&mut tracker, false)?;
        n += 1;
    }
    Ok(())
}
