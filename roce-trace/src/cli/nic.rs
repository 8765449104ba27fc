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
    /// Also the per-QP counters of each RDMA port (RDMA netlink; QPs are counted only once
    /// bound: `rdma statistic qp set link DEV/PORT auto type on` before they are created).
    #[arg(long)]
    qp: bool,
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
            let qp = if a.qp {
                per_qp(&root, p, a.json)?
            } else {
                String::new()
            };
            // A closed pipe (`| head`) ends the command quietly.
            if writeln!(out, "{text}")
                .and_then(|_| {
                    if qp.is_empty() {
                        Ok(())
                    } else {
                        writeln!(out, "{qp}")
                    }
                })
                .and_then(|_| out.flush())
                .is_err()
            {
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

/// The per-QP counters of a port's RDMA device, or why there are none: text, or `nic_qp`
/// JSON records (one per bound counter).
fn per_qp(root: &Root, p: &nic::Port, json: bool) -> anyhow::Result<String> {
    use roce_trace::nic::{Source, alias};
    let Some(rp) = &p.rdma else {
        return Ok(String::new());
    };
    let record = |fields: serde_json::Value| -> anyhow::Result<String> {
        let mut m = serde_json::json!({
            "type": "nic_qp",
            "interface": p.netdev,
            "rdma_device": rp.device,
            "port": rp.port,
        });
        m.as_object_mut()
            .expect("an object")
            .extend(fields.as_object().cloned().unwrap_or_default());
        Ok(serde_json::to_string(&m)?)
    };
    let got = if root.is_fixture() {
        Err("a fixture has no RDMA netlink".to_string())
    } else {
        roce_trace::rdma_netlink::Socket::open()
            .and_then(|s| s.qp_counters(&rp.device, rp.port))
            .map_err(|e| roce_trace::rdma_netlink::unavailable(&e))
    };
    let driver = p.family();
    match got {
        Err(why) if json => record(serde_json::json!({ "not_available": why })),
        Err(why) => Ok(format!("  per-QP counters: not available: {why}")),
        Ok(v) if v.is_empty() => {
            let why = format!(
                "no QP is bound to a counter (`rdma statistic qp set link {}/{} auto type on`, then create the QPs)",
                rp.device, rp.port
            );
            if json {
                record(serde_json::json!({ "not_available": why }))
            } else {
                Ok(format!("  per-QP counters: {why}"))
            }
        }
        Ok(v) => {
            let mut lines = Vec::new();
            for c in v {
                let named: std::collections::BTreeMap<String, u64> = c
                    .counters
                    .iter()
                    .map(|(n, x)| {
                        let name = alias(driver, Source::Rdma, n).map_or(n.clone(), |id| id.to_string());
                        (name, *x)
                    })
                    .collect();
                let qps: Vec<String> = c.qps.iter().map(|q| format!("{q:#x}")).collect();
                lines.push(if json {
                    record(serde_json::json!({ "counter": c.id, "qps": c.qps, "counters": named }))?
                } else {
                    format!(
                        "  QP counter {} (QPs {}): {}",
                        c.id,
                        qps.join(", "),
                        named
                            .iter()
                            .filter(|(_, x)| **x > 0)
                            .map(|(n, x)| format!("{n} {x}"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                });
            }
            Ok(lines.join("\n"))
        }
    }
}
