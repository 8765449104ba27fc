//! NIC counter fixtures: directory trees laid out like `/sys` (`class/net/…`,
//! `class/infiniband/…/hw_counters`) with each netdev's ethtool statistics in
//! `ethtool/<netdev>` (as `ethtool -S` prints them) and a `boot_id`, for `roce-trace nic
//! --sysfs-root` and `agent --sysfs-root`. The counter names are the drivers' own, from
//! the kernel sources and documentation named in `../shared/NIC_COUNTERS.md`; none was
//! read from a real NIC here.
//!
//! A fixture evolves while it is read: [`Fixture::set`], [`Fixture::bump`],
//! [`Fixture::remove`], [`Fixture::reboot`] and [`Fixture::reload`] replace files
//! atomically (write and rename), as the kernel's files change under a reader.

use std::{
    io,
    path::{Path, PathBuf},
};

/// The drivers fixtures can imitate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NicDriver {
    Mlx5,
    Bnxt,
    Ionic,
    Mana,
    Rxe,
}

impl NicDriver {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "mlx5" => Self::Mlx5,
            "bnxt" => Self::Bnxt,
            "ionic" => Self::Ionic,
            "mana" => Self::Mana,
            "rxe" => Self::Rxe,
            _ => return None,
        })
    }

    /// (netdev driver, RDMA driver, RDMA device name prefix).
    fn kernel(self) -> (&'static str, &'static str, &'static str) {
        match self {
            Self::Mlx5 => ("mlx5_core", "mlx5_ib", "mlx5_"),
            Self::Bnxt => ("bnxt_en", "bnxt_re", "bnxt_re"),
            Self::Ionic => ("ionic", "ionic_rdma", "ionic_"),
            Self::Mana => ("mana", "mana_ib", "mana_"),
            Self::Rxe => ("veth", "rdma_rxe", "rxe_"),
        }
    }

    /// The ethtool statistics: per priority with PFC enabled, per priority always, then
    /// port-wide (names with `{p}` for the priority).
    fn ethtool(
        self,
    ) -> (
        &'static [&'static str],
        &'static [&'static str],
        &'static [&'static str],
    ) {
        match self {
            Self::Mlx5 => (
                &[
                    "rx_prio{p}_pause",
                    "rx_prio{p}_pause_duration",
                    "tx_prio{p}_pause",
                    "tx_prio{p}_pause_duration",
                    "rx_prio{p}_pause_transition",
                ],
                &[
                    "rx_prio{p}_bytes",
                    "rx_prio{p}_packets",
                    "rx_prio{p}_discards",
                    "tx_prio{p}_bytes",
                    "tx_prio{p}_packets",
                    "rx_prio{p}_buf_discard",
                    "rx_prio{p}_cong_discard",
                    "rx_prio{p}_marked",
                ],
                &[
                    "rx_packets",
                    "tx_packets",
                    "rx_pause_ctrl_phy",
                    "tx_pause_ctrl_phy",
                    "rx_discards_phy",
                    "tx_discards_phy",
                    "tx_pause_storm_warning_events",
                    "tx_pause_storm_error_events",
                    "rx_crc_errors_phy",
                    "rx_vport_rdma_unicast_packets",
                    "rx_vport_rdma_unicast_bytes",
                    "tx_vport_rdma_unicast_packets",
                    "tx_vport_rdma_unicast_bytes",
                ],
            ),
            Self::Bnxt => (
                &[
                    "rx_pfc_ena_frames_pri{p}",
                    "tx_pfc_ena_frames_pri{p}",
                    "pfc_pri{p}_rx_duration_us",
                    "pfc_pri{p}_rx_transitions",
                    "pfc_pri{p}_tx_duration_us",
                    "pfc_pri{p}_tx_transitions",
                ],
                &[
                    "rx_bytes_pri{p}",
                    "rx_packets_pri{p}",
                    "tx_bytes_pri{p}",
                    "tx_packets_pri{p}",
                ],
                &[
                    "rx_ucast_packets",
                    "tx_ucast_packets",
                    "rx_pause_frames",
                    "tx_pause_frames",
                    "rx_pfc_frames",
                    "tx_pfc_frames",
                    "rx_stat_discard",
                    "tx_stat_discard",
                    "continuous_pause_events",
                ],
            ),
            Self::Ionic => (
                &["rx_pripause_{p}_1us_count", "tx_pripause_{p}_1us_count"],
                &["frames_rx_pri_{p}", "frames_tx_pri_{p}"],
                &[
                    "rx_packets",
                    "tx_packets",
                    "frames_rx_pripause",
                    "frames_tx_pripause",
                ],
            ),
            Self::Mana => (&[], &[], &["rx_packets", "tx_packets", "rx_dropped"]),
            // Soft-RoCE runs on an ordinary netdev: a veth has no PFC.
            Self::Rxe => (&[], &[], &["peer_ifindex", "rx_queue_0_xdp_packets"]),
        }
    }

    /// The RDMA port's `hw_counters`.
    fn hw_counters(self) -> &'static [&'static str] {
        match self {
            Self::Mlx5 => &[
                "rx_write_requests",
                "rx_read_requests",
                "rx_atomic_requests",
                "out_of_buffer",
                "out_of_sequence",
                "duplicate_request",
                "rnr_nak_retry_err",
                "packet_seq_err",
                "implied_nak_seq_err",
                "local_ack_timeout_err",
                "resp_local_length_error",
                "req_transport_retries_exceeded",
                "req_rnr_retries_exceeded",
                "rp_cnp_ignored",
                "rp_cnp_handled",
                "np_ecn_marked_roce_packets",
                "np_cnp_sent",
                "rx_icrc_encapsulated",
            ],
            Self::Bnxt => &[
                "active_qps",
                "rx_pkts",
                "tx_pkts",
                "to_retransmits",
                "seq_err_naks_rcvd",
                "max_retry_exceeded",
                "rnr_naks_rcvd",
                "missing_resp",
                "dup_req",
                "oos_drop_count",
                "tx_cnp_pkts",
                "rx_cnp_pkts",
                "rx_ecn_marked_pkts",
                "rx_out_of_buffer",
            ],
            Self::Ionic => &[
                "tx_rdma_ucast_pkts",
                "rx_rdma_ucast_pkts",
                "tx_rdma_cnp_pkts",
                "rx_rdma_cnp_pkts",
                "rx_rdma_ecn_pkts",
                "tx_rdma_ack_timeout",
                "req_rx_pkt_seq_err",
                "req_rx_impl_nak_seq_err",
                "resp_rx_outouf_seq",
                "resp_rx_outof_buf",
                "req_tx_retry_excd_err",
            ],
            Self::Mana => &[
                "requester_timeout",
                "requester_oos_nak",
                "requester_rnr_nak",
                "responder_rnr_nak",
                "responder_oos",
                "responder_dup_request",
                "requester_implicit_nak",
                "requester_retries_exceeded",
                "requester_rnr_nak_retries_exceeded",
                "received_cnps",
                "num_qps_congested",
                "rate_inc_events",
                "current_rate",
            ],
            Self::Rxe => &[
                "sent_pkts",
                "rcvd_pkts",
                "duplicate_request",
                "out_of_seq_request",
                "rcvd_rnr_err",
                "send_rnr_err",
                "rcvd_seq_err",
                "retry_exceeded_err",
                "retry_rnr_exceeded_err",
                "completer_retry_err",
                "send_err",
                "link_downed",
                "rdma_sends",
                "rdma_recvs",
            ],
        }
    }
}

/// A fixture tree.
pub struct Fixture {
    root: PathBuf,
}

/// Writes `p` by renaming a file written beside the tree (never inside a directory a
/// reader lists).
fn write_atomic(p: &Path, text: &str) -> io::Result<()> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    if let Some(d) = p.parent() {
        std::fs::create_dir_all(d)?;
    }
    let root = p
        .ancestors()
        .find(|a| a.join("boot_id").exists() || a.join("class").is_dir())
        .unwrap_or(Path::new("/tmp"));
    let tmp = root.join(format!(
        ".fixture-tmp-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, p)
}

fn boot_id(n: u64) -> String {
    format!("6b1f0c2e-0000-4000-8000-{n:012x}")
}

impl Fixture {
    /// A new tree at `root` (created), boot 1.
    pub fn create(root: impl Into<PathBuf>) -> io::Result<Self> {
        let root = root.into();
        std::fs::create_dir_all(root.join("class/net"))?;
        write_atomic(&root.join("boot_id"), &boot_id(1))?;
        Ok(Self { root })
    }

    /// A tree another handle created (a second writer, e.g. on another thread).
    pub fn open(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// A netdev imitating `driver`, PFC enabled on `pfc` (priorities), every counter 0.
    /// `rdma`: the RDMA device behind it (none for a plain netdev).
    pub fn add(
        &self,
        netdev: &str,
        ifindex: u32,
        driver: NicDriver,
        pfc: &[u8],
        rdma: Option<&str>,
    ) -> io::Result<()> {
        let (ndrv, rdrv, _) = driver.kernel();
        let net = self.root.join("class/net").join(netdev);
        write_atomic(&net.join("ifindex"), &format!("{ifindex}\n"))?;
        std::fs::create_dir_all(net.join("device"))?;
        let link = net.join("device/driver");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(format!("../../../../bus/pci/drivers/{ndrv}"), &link)?;
        let (per_pfc, per_prio, port) = driver.ethtool();
        let mut names = Vec::new();
        for p in 0..8u8 {
            if pfc.contains(&p) {
                names.extend(per_pfc.iter().map(|n| n.replace("{p}", &p.to_string())));
            }
            names.extend(per_prio.iter().map(|n| n.replace("{p}", &p.to_string())));
        }
        names.extend(port.iter().map(|n| n.to_string()));
        let table: String = std::iter::once("NIC statistics:\n".to_string())
            .chain(names.iter().map(|n| format!("     {n}: 0\n")))
            .collect();
        write_atomic(&self.root.join("ethtool").join(netdev), &table)?;
        if let Some(dev) = rdma {
            let d = self.root.join("class/infiniband").join(dev);
            std::fs::create_dir_all(d.join("device"))?;
            let link = d.join("device/driver");
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(format!("../../../../bus/pci/drivers/{rdrv}"), &link)?;
            // How a PCI function's RDMA device names its netdev; Soft-RoCE has no PCI
            // device and says it through the port's GID attributes.
            if driver == NicDriver::Rxe {
                write_atomic(&d.join("ports/1/gid_attrs/ndevs/0"), &format!("{netdev}\n"))?;
            } else {
                std::fs::create_dir_all(d.join("device/net").join(netdev))?;
            }
            let hw = d.join("ports/1/hw_counters");
            for n in driver.hw_counters() {
                write_atomic(&hw.join(n), "0\n")?;
            }
            write_atomic(&hw.join("lifespan"), "10\n")?;
            // The IB port counters beside them (no canonical name covers these).
            for n in [
                "port_xmit_data",
                "port_rcv_data",
                "port_xmit_discards",
                "link_downed",
            ] {
                write_atomic(&d.join("ports/1/counters").join(n), "0\n")?;
            }
            // mana keeps its CNP and ECN counters on the device, not the port.
            if driver == NicDriver::Mana {
                let dev_hw = d.join("hw_counters");
                for n in [
                    "sent_cnps",
                    "received_ecns",
                    "received_cnp_count",
                    "qp_congested_events",
                ] {
                    write_atomic(&dev_hw.join(n), "0\n")?;
                }
                write_atomic(&dev_hw.join("lifespan"), "10\n")?;
            }
        }
        Ok(())
    }

    /// The file holding `name` for `netdev`: its RDMA port's hw_counters file, else its
    /// ethtool table.
    fn hw_file(&self, netdev: &str, name: &str) -> Option<PathBuf> {
        let ib = std::fs::read_dir(self.root.join("class/infiniband")).ok()?;
        for d in ib.filter_map(Result::ok) {
            let p = d.path();
            let owns = p.join("device/net").join(netdev).exists()
                || std::fs::read_to_string(p.join("ports/1/gid_attrs/ndevs/0"))
                    .is_ok_and(|t| t.trim() == netdev);
            for f in [
                p.join("ports/1/hw_counters").join(name),
                p.join("hw_counters").join(name),
            ] {
                if owns && f.exists() {
                    return Some(f);
                }
            }
        }
        None
    }

    fn table(&self, netdev: &str) -> io::Result<Vec<(String, u64)>> {
        let t = std::fs::read_to_string(self.root.join("ethtool").join(netdev))?;
        Ok(t.lines()
            .skip(1)
            .filter_map(|l| {
                let (n, v) = l.trim().rsplit_once(':')?;
                Some((n.trim().to_string(), v.trim().parse().ok()?))
            })
            .collect())
    }

    fn write_table(&self, netdev: &str, rows: &[(String, u64)]) -> io::Result<()> {
        let text: String = std::iter::once("NIC statistics:\n".to_string())
            .chain(rows.iter().map(|(n, v)| format!("     {n}: {v}\n")))
            .collect();
        write_atomic(&self.root.join("ethtool").join(netdev), &text)
    }

    /// The value of the driver's counter `name` of `netdev`.
    pub fn get(&self, netdev: &str, name: &str) -> io::Result<u64> {
        if let Some(f) = self.hw_file(netdev, name) {
            return std::fs::read_to_string(f)?
                .trim()
                .parse()
                .map_err(io::Error::other);
        }
        self.table(netdev)?
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("{netdev} has no {name}")))
    }

    /// Sets the driver's counter `name` of `netdev` (its hw_counters file or ethtool row;
    /// a row that does not exist is added).
    pub fn set(&self, netdev: &str, name: &str, value: u64) -> io::Result<()> {
        if let Some(f) = self.hw_file(netdev, name) {
            return write_atomic(&f, &format!("{value}\n"));
        }
        let mut rows = self.table(netdev)?;
        match rows.iter_mut().find(|(n, _)| n == name) {
            Some(r) => r.1 = value,
            None => rows.push((name.to_string(), value)),
        }
        self.write_table(netdev, &rows)
    }

    /// Adds `by` to a counter (wrapping at 2^64, as the kernel's u64 would).
    pub fn bump(&self, netdev: &str, name: &str, by: u64) -> io::Result<()> {
        let v = self.get(netdev, name)?;
        self.set(netdev, name, v.wrapping_add(by))
    }

    /// Removes a counter (PFC turned off on a priority, a driver without it).
    pub fn remove(&self, netdev: &str, name: &str) -> io::Result<()> {
        if let Some(f) = self.hw_file(netdev, name) {
            return std::fs::remove_file(f);
        }
        let mut rows = self.table(netdev)?;
        rows.retain(|(n, _)| n != name);
        self.write_table(netdev, &rows)
    }

    /// A reboot: a new boot id, every counter of every netdev back to 0.
    pub fn reboot(&self, n: u64) -> io::Result<()> {
        self.zero_all()?;
        write_atomic(&self.root.join("boot_id"), &boot_id(n))
    }

    /// A driver reload of `netdev`: a new interface index, its counters back to 0.
    pub fn reload(&self, netdev: &str, ifindex: u32) -> io::Result<()> {
        self.zero(netdev)?;
        write_atomic(
            &self.root.join("class/net").join(netdev).join("ifindex"),
            &format!("{ifindex}\n"),
        )
    }

    fn zero(&self, netdev: &str) -> io::Result<()> {
        let rows: Vec<(String, u64)> = self.table(netdev)?.into_iter().map(|(n, _)| (n, 0)).collect();
        self.write_table(netdev, &rows)?;
        if let Ok(ib) = std::fs::read_dir(self.root.join("class/infiniband")) {
            for d in ib.filter_map(Result::ok) {
                if !d.path().join("device/net").join(netdev).exists()
                    && std::fs::read_to_string(d.path().join("ports/1/gid_attrs/ndevs/0"))
                        .map_or(true, |t| t.trim() != netdev)
                {
                    continue;
                }
                for dir in ["ports/1/hw_counters", "hw_counters"] {
                    let Ok(rd) = std::fs::read_dir(d.path().join(dir)) else {
                        continue;
                    };
                    for f in rd.filter_map(Result::ok) {
                        if f.file_name() != "lifespan" {
                            write_atomic(&f.path(), "0\n")?;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn zero_all(&self) -> io::Result<()> {
        for d in std::fs::read_dir(self.root.join("class/net"))?.filter_map(Result::ok) {
            self.zero(&d.file_name().to_string_lossy())?;
        }
        Ok(())
    }
}
