//! Reading a host's NIC and PFC counters: the RDMA port's `hw_counters` from sysfs and the
//! netdev's ethtool statistics through the `SIOCETHTOOL` ioctls (no `ethtool` process),
//! mapped onto the canonical names of [`roce_trace_common::nic`]; and what changed between
//! two reads ([`Tracker`]): deltas and rates over the real time between the reads, 32-bit
//! wraps, resets (a counter going down, a new boot, a driver reload) never reported as
//! deltas, and counters that are not there said to be not there, with the reason.
//!
//! A [`Root`] other than the system's reads a fixture: a directory laid out like `/sys`
//! (`class/net/…`, `class/infiniband/…`), with the ethtool statistics of each netdev in
//! `ethtool/<netdev>` (the text `ethtool -S` prints) and the boot id in `boot_id`. Tests
//! and `--sysfs-root` use it; nothing else differs.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    io,
    path::{Path, PathBuf},
};

pub use roce_trace_common::nic::*;

/// Where counters are read from.
#[derive(Clone, Debug)]
pub struct Root {
    sysfs: PathBuf,
    fixture: bool,
}

impl Root {
    /// This host: `/sys`, ethtool through the ioctl, the kernel's boot id.
    pub fn system() -> Self {
        Self {
            sysfs: "/sys".into(),
            fixture: false,
        }
    }

    /// A fixture tree (see the module's documentation).
    pub fn fixture(dir: impl Into<PathBuf>) -> Self {
        Self {
            sysfs: dir.into(),
            fixture: true,
        }
    }

    pub fn path(&self) -> &Path {
        &self.sysfs
    }

    pub fn is_fixture(&self) -> bool {
        self.fixture
    }

    /// The boot id: a change means every counter started again.
    pub fn boot_id(&self) -> io::Result<[u8; 16]> {
        let p = if self.fixture {
            self.sysfs.join("boot_id")
        } else {
            PathBuf::from("/proc/sys/kernel/random/boot_id")
        };
        let text = std::fs::read_to_string(&p)?;
        parse_uuid(text.trim())
            .ok_or_else(|| io::Error::other(format!("{}: not a boot id: {:?}", p.display(), text.trim())))
    }

    /// The ethtool statistics of `netdev`: (name, value) in the driver's order. `Ok(None)`
    /// when it has none.
    pub fn ethtool_stats(&self, netdev: &str) -> io::Result<Option<Vec<(String, u64)>>> {
        if self.fixture {
            let p = self.sysfs.join("ethtool").join(netdev);
            match std::fs::read_to_string(&p) {
                Ok(t) => parse_ethtool_s(&t)
                    .map(Some)
                    .map_err(|e| io::Error::other(format!("{}: {e}", p.display()))),
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(io::Error::new(e.kind(), format!("{}: {e}", p.display()))),
            }
        } else {
            ethtool::stats(netdev)
        }
    }
}

/// A UUID as `/proc/sys/kernel/random/boot_id` prints it.
fn parse_uuid(s: &str) -> Option<[u8; 16]> {
    let hex: Vec<u8> = s.bytes().filter(|&b| b != b'-').collect();
    if hex.len() != 32 || s.len() != 36 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        let t = std::str::from_utf8(&hex[2 * i..2 * i + 2]).ok()?;
        *o = u8::from_str_radix(t, 16).ok()?;
    }
    Some(out)
}

/// The text `ethtool -S IFACE` prints: a header line, then `name: value` lines.
pub fn parse_ethtool_s(text: &str) -> Result<Vec<(String, u64)>, String> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let l = line.trim();
        if l.is_empty() || l.ends_with("statistics:") {
            continue;
        }
        let (name, value) = l
            .rsplit_once(':')
            .ok_or_else(|| format!("line {}: not `name: value`: {l:?}", n + 1))?;
        let value = value
            .trim()
            .parse::<u64>()
            .map_err(|e| format!("line {}: {name}: {e}", n + 1))?;
        out.push((name.trim().to_owned(), value));
    }
    Ok(out)
}

/// One RDMA port behind a netdev.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaPort {
    pub device: String,
    pub port: u32,
    /// The RDMA device's kernel driver (`mlx5_ib`, `bnxt_re`, …), when sysfs says.
    pub driver: Option<String>,
}

/// A netdev and what is behind it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Port {
    pub netdev: String,
    pub ifindex: u32,
    /// The netdev's kernel driver (`mlx5_core`, `veth`, …).
    pub driver: Option<String>,
    pub rdma: Option<RdmaPort>,
}

impl Port {
    /// The driver family whose names apply (the RDMA device's, else the netdev's).
    pub fn family(&self) -> Driver {
        let from = |d: &Option<String>| d.as_deref().map(Driver::from_kernel);
        match (
            from(&self.rdma.as_ref().and_then(|r| r.driver.clone())),
            from(&self.driver),
        ) {
            (Some(d), _) if d != Driver::Other => d,
            (_, Some(d)) => d,
            (Some(d), None) => d,
            (None, None) => Driver::Other,
        }
    }
}

fn basename_of_link(p: &Path) -> Option<String> {
    let t = std::fs::read_link(p).ok()?;
    Some(t.file_name()?.to_string_lossy().into_owned())
}

fn read_trimmed(p: &Path) -> io::Result<String> {
    Ok(std::fs::read_to_string(p)?.trim().to_owned())
}

/// The netdevs of this root (or only those named), with their RDMA ports. A named netdev
/// that does not exist is an error.
pub fn ports(root: &Root, only: &[String]) -> io::Result<Vec<Port>> {
    let net = root.sysfs.join("class/net");
    let names: Vec<String> = if only.is_empty() {
        let mut v: Vec<String> = std::fs::read_dir(&net)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", net.display())))?
            .filter_map(Result::ok)
            .map(|d| d.file_name().to_string_lossy().into_owned())
            .filter(|n| n != "lo" && !n.contains('/'))
            .collect();
        v.sort();
        v
    } else {
        for n in only {
            if n.contains('/') || !net.join(n).exists() {
                return Err(io::Error::new(
                    io::ErrorKind::NotFound,
                    format!("no interface `{n}` in {}", net.display()),
                ));
            }
        }
        only.to_vec()
    };
    let rdma = rdma_ports(root)?;
    let mut out = Vec::new();
    for n in names {
        let dir = net.join(&n);
        let ifindex = read_trimmed(&dir.join("ifindex"))
            .ok()
            .and_then(|t| t.parse().ok())
            .unwrap_or(0);
        let driver = basename_of_link(&dir.join("device/driver"))
            .or_else(|| (!root.fixture).then(|| crate::sys::driver(&n)).flatten());
        out.push(Port {
            rdma: rdma.get(&n).cloned(),
            netdev: n,
            ifindex,
            driver,
        });
    }
    Ok(out)
}

/// netdev → its RDMA port: from `class/infiniband/<dev>/device/net/<netdev>` (a PCI
/// function's netdev) or `ports/<p>/gid_attrs/ndevs/0` (what a port's GIDs are on: how
/// Soft-RoCE and bonds say it). A netdev with several RDMA ports gets the first.
fn rdma_ports(root: &Root) -> io::Result<HashMap<String, RdmaPort>> {
    let ib = root.sysfs.join("class/infiniband");
    let mut out = HashMap::new();
    let devs = match std::fs::read_dir(&ib) {
        Ok(d) => d,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(io::Error::new(e.kind(), format!("{}: {e}", ib.display()))),
    };
    let mut devs: Vec<String> = devs
        .filter_map(Result::ok)
        .map(|d| d.file_name().to_string_lossy().into_owned())
        .collect();
    devs.sort();
    for dev in devs {
        let d = ib.join(&dev);
        let driver = basename_of_link(&d.join("device/driver"));
        let mut port_nums: Vec<u32> = std::fs::read_dir(d.join("ports"))
            .map(|r| {
                r.filter_map(Result::ok)
                    .filter_map(|e| e.file_name().to_str()?.parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        port_nums.sort();
        let mut netdevs: Vec<(String, u32)> = Vec::new();
        for &p in &port_nums {
            if let Ok(n) = read_trimmed(&d.join(format!("ports/{p}/gid_attrs/ndevs/0")))
                && !n.is_empty()
            {
                netdevs.push((n, p));
            }
        }
        if let Ok(r) = std::fs::read_dir(d.join("device/net")) {
            let first = port_nums.first().copied().unwrap_or(1);
            for e in r.filter_map(Result::ok) {
                netdevs.push((e.file_name().to_string_lossy().into_owned(), first));
            }
        }
        for (n, p) in netdevs {
            out.entry(n).or_insert_with(|| RdmaPort {
                device: dev.clone(),
                port: p,
                driver: driver.clone(),
            });
        }
    }
    Ok(out)
}

/// One counter's value and where it came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Value {
    pub value: u64,
    /// The driver's own name for it.
    pub raw: String,
}

/// Why a counter is missing, and the error text when it could not be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Absent {
    pub why: Missing,
    pub detail: Option<String>,
}

/// One read of a port's counters.
#[derive(Clone, Debug)]
pub struct Reading {
    /// CLOCK_BOOTTIME, nanoseconds: rates divide by the real time between reads, suspend
    /// included.
    pub at_ns: u64,
    pub epoch: Epoch,
    pub driver: Driver,
    pub values: BTreeMap<CounterId, Value>,
    /// Every canonical counter this port has no value for, with the reason.
    pub missing: BTreeMap<CounterId, Absent>,
    /// The counters no canonical name covers, by source (for `--all`).
    pub other: Vec<(Source, String, u64)>,
}

/// Every canonical counter: each kind, per priority 0–7 where it has priorities.
pub fn all_ids() -> impl Iterator<Item = CounterId> {
    SPECS.iter().flat_map(|s| {
        let prios: Vec<Option<u8>> = match s.suffix {
            Some(_) => (0..8).map(Some).collect(),
            None => vec![None],
        };
        prios
            .into_iter()
            .map(move |prio| CounterId { kind: s.kind, prio })
    })
}

pub fn boottime_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The `hw_counters` of an RDMA port, then those of its device (where mana keeps its CNP
/// and ECN counters): `Ok(None)` when neither directory exists.
fn hw_counters(root: &Root, r: &RdmaPort) -> io::Result<Option<Vec<(String, u64)>>> {
    let dev = root.sysfs.join(format!("class/infiniband/{}", r.device));
    let port = counter_dir(&dev.join(format!("ports/{}/hw_counters", r.port)))?;
    let device = counter_dir(&dev.join("hw_counters"))?;
    Ok(match (port, device) {
        (None, None) => None,
        (p, d) => Some(
            p.into_iter()
                .chain(d)
                .flatten()
                .chain(ib_counters(&dev.join(format!("ports/{}/counters", r.port))))
                .collect(),
        ),
    })
}

/// The IB port counters (`ports/<p>/counters/`: `port_xmit_data` in 4-byte words,
/// `port_rcv_errors`, `link_downed`, …; no canonical name covers them, `--all` shows
/// them). Files that do not read as a number are left out: on RoCE some of these answer
/// reads with an error.
fn ib_counters(dir: &Path) -> Vec<(String, u64)> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<(String, u64)> = rd
        .filter_map(Result::ok)
        .filter_map(|e| {
            let v = read_trimmed(&e.path()).ok()?.parse().ok()?;
            Some((format!("counters/{}", e.file_name().to_string_lossy()), v))
        })
        .collect();
    out.sort();
    out
}

fn counter_dir(dir: &Path) -> io::Result<Option<Vec<(String, u64)>>> {
    let rd = match std::fs::read_dir(dir) {
        Ok(d) => d,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io::Error::new(e.kind(), format!("{}: {e}", dir.display()))),
    };
    let mut out = Vec::new();
    for e in rd.filter_map(Result::ok) {
        let name = e.file_name().to_string_lossy().into_owned();
        // `lifespan` is the cache period in ms, not a counter.
        if name == "lifespan" {
            continue;
        }
        let p = e.path();
        let v = read_trimmed(&p)
            .and_then(|t| {
                t.parse::<u64>()
                    .map_err(|err| io::Error::other(format!("{t:?}: {err}")))
            })
            .map_err(|err| io::Error::new(err.kind(), format!("{}: {err}", p.display())))?;
        out.push((name, v));
    }
    out.sort();
    Ok(Some(out))
}

/// Reads one port's counters now.
pub fn read(root: &Root, port: &Port) -> Reading {
    let driver = port.family();
    let boot_id = root.boot_id().unwrap_or([0; 16]);
    let mut r = Reading {
        at_ns: boottime_ns(),
        epoch: Epoch {
            boot_id,
            ifindex: port.ifindex,
        },
        driver,
        values: BTreeMap::new(),
        missing: BTreeMap::new(),
        other: Vec::new(),
    };
    // Per source: whether it was read, and the error when it could not be.
    let mut source_state: HashMap<Source, Result<bool, String>> = HashMap::new();
    let eth = root.ethtool_stats(&port.netdev);
    source_state.insert(
        Source::Ethtool,
        eth.as_ref().map(Option::is_some).map_err(ToString::to_string),
    );
    if let Ok(Some(stats)) = eth {
        take(&mut r, driver, Source::Ethtool, stats);
    }
    match &port.rdma {
        None => {}
        Some(rp) => {
            let hw = hw_counters(root, rp);
            source_state.insert(
                Source::Rdma,
                hw.as_ref().map(Option::is_some).map_err(ToString::to_string),
            );
            if let Ok(Some(c)) = hw {
                take(&mut r, driver, Source::Rdma, c);
            }
        }
    }
    // The optional counters exist only through RDMA netlink, once enabled: read there for
    // this host's RDMA ports (a fixture has none), and say why not when it cannot be.
    let mut netlink_why = None;
    if let (Some(rp), false) = (&port.rdma, root.fixture) {
        match crate::rdma_netlink::Socket::open().and_then(|s| s.port_counters(&rp.device, rp.port)) {
            Ok(v) => {
                let optional: Vec<(String, u64)> = v
                    .into_iter()
                    .filter(|(n, _)| CounterId::parse(n).is_some_and(|id| id.spec().optional))
                    .collect();
                take(&mut r, driver, Source::Rdma, optional);
            }
            Err(e) => netlink_why = Some(crate::rdma_netlink::unavailable(&e)),
        }
    }
    let pause_seen: BTreeSet<Kind> = r
        .values
        .keys()
        .filter(|id| id.kind.is_pause() && id.prio.is_some())
        .map(|id| id.kind)
        .collect();
    let any_pause = !pause_seen.is_empty();
    for id in all_ids() {
        if r.values.contains_key(&id) {
            continue;
        }
        let spec = id.spec();
        let state = source_state.get(&spec.source);
        let absent = |why| Absent { why, detail: None };
        let a = match (spec.source, state) {
            (_, Some(Err(e))) => Absent {
                why: Missing::Unreadable,
                detail: Some(e.clone()),
            },
            (Source::Rdma, None) => absent(Missing::NoRdmaDevice),
            (Source::Rdma, Some(Ok(false))) => absent(Missing::NoHwCounters),
            (Source::Ethtool, None | Some(Ok(false))) => absent(Missing::NoEthtoolStats),
            _ if !driver_names(driver, id.kind) => absent(Missing::NotInDriver),
            _ if spec.optional => Absent {
                why: Missing::Optional,
                detail: netlink_why.clone(),
            },
            _ if id.kind.is_pause() && any_pause => absent(Missing::PfcNotEnabled),
            _ if id.kind.is_pause() => absent(Missing::NoPerPriorityPause),
            _ => absent(Missing::NotExposed),
        };
        r.missing.insert(id, a);
    }
    r
}

fn take(r: &mut Reading, driver: Driver, source: Source, stats: Vec<(String, u64)>) {
    for (name, value) in stats {
        match alias(driver, source, &name) {
            // The first name for a counter wins (a driver showing an old and a new name).
            Some(id) if !r.values.contains_key(&id) => {
                r.values.insert(id, Value { value, raw: name });
            }
            Some(_) => {}
            None => r.other.push((source, name, value)),
        }
    }
}

/// What one counter did between two reads.
#[derive(Clone, Debug, PartialEq)]
pub struct Change {
    pub id: CounterId,
    pub value: u64,
    pub step: Step,
}

/// What a port's counters did between two reads.
#[derive(Clone, Debug)]
pub struct Interval {
    pub netdev: String,
    /// Real time between the reads (CLOCK_BOOTTIME).
    pub elapsed_ns: u64,
    /// Every counter reset: a new boot or a new interface (driver reload).
    pub epoch_changed: bool,
    pub changes: Vec<Change>,
    /// What is missing now (those present at the previous read say [`Missing::Gone`]).
    pub missing: BTreeMap<CounterId, Absent>,
}

impl Interval {
    /// The change of one counter.
    pub fn get(&self, id: CounterId) -> Option<&Change> {
        self.changes.iter().find(|c| c.id == id)
    }

    /// The increase per second, when it is known.
    pub fn rate(&self, id: CounterId) -> Option<f64> {
        let d = self.get(id)?.step.delta()?;
        (self.elapsed_ns > 0).then(|| d as f64 * 1e9 / self.elapsed_ns as f64)
    }
}

/// The previous reading of every port, to turn readings into [`Interval`]s.
#[derive(Default)]
pub struct Tracker {
    prev: HashMap<String, Reading>,
    /// Counters seen above 2^32 − 1: 64-bit, so a fall is a reset, never a wrap.
    wide: BTreeSet<(String, CounterId)>,
}

impl Tracker {
    /// The interval since `netdev`'s previous reading; `None` for its first.
    pub fn update(&mut self, netdev: &str, now: Reading) -> Option<Interval> {
        for (id, v) in &now.values {
            if v.value > u32::MAX as u64 {
                self.wide.insert((netdev.to_owned(), *id));
            }
        }
        let prev = self.prev.insert(netdev.to_owned(), now);
        let now = &self.prev[netdev];
        let prev = prev?;
        let epoch_changed = prev.epoch != now.epoch;
        let mut changes = Vec::new();
        for (id, v) in &now.values {
            let Some(p) = prev.values.get(id) else {
                continue; // appeared: no delta from a value we never had
            };
            let width = if self.wide.contains(&(netdev.to_owned(), *id)) {
                Width::Bits64
            } else {
                Width::Bits32
            };
            let s = if epoch_changed {
                Step::Reset
            } else {
                step(p.value, v.value, width)
            };
            changes.push(Change {
                id: *id,
                value: v.value,
                step: s,
            });
        }
        let mut missing = now.missing.clone();
        for (id, a) in missing.iter_mut() {
            if prev.values.contains_key(id) {
                a.why = Missing::Gone;
            }
        }
        Some(Interval {
            netdev: netdev.to_owned(),
            elapsed_ns: now.at_ns.saturating_sub(prev.at_ns),
            epoch_changed,
            changes,
            missing,
        })
    }
}

/// The ethtool statistics ioctls: `ETHTOOL_GSSET_INFO`, `ETHTOOL_GSTRINGS` and
/// `ETHTOOL_GSTATS` on an `AF_INET` datagram socket (none needs a capability).
pub mod ethtool {
    use std::io;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    const ETHTOOL_GSTRINGS: u32 = 0x1b;
    const ETHTOOL_GSTATS: u32 = 0x1d;
    const ETHTOOL_GSSET_INFO: u32 = 0x37;
    const ETH_SS_STATS: u32 = 1;
    const ETH_GSTRING_LEN: usize = 32;
    /// More statistics than any driver has (mlx5 with many rings: a few thousand).
    const MAX_STATS: u32 = 1 << 16;

    fn socket() -> io::Result<OwnedFd> {
        // SAFETY: plain socket(2).
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a descriptor just returned by socket(2), owned by nothing else.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Writes a `u32` field at byte offset `off` of a command buffer.
    fn put(buf: &mut [u64], off: usize, v: u32) {
        // SAFETY: viewing the u64 buffer as bytes; `off + 4` is checked by the slice.
        let b: &mut [u8] = unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr().cast(), buf.len() * 8) };
        b[off..off + 4].copy_from_slice(&v.to_ne_bytes());
    }

    /// Reads the `u32` field at byte offset `off`.
    fn get(buf: &[u64], off: usize) -> u32 {
        u32::from_ne_bytes(bytes(buf)[off..off + 4].try_into().expect("4 bytes"))
    }

    fn bytes(buf: &[u64]) -> &[u8] {
        // SAFETY: viewing the u64 buffer as bytes.
        unsafe { std::slice::from_raw_parts(buf.as_ptr().cast(), buf.len() * 8) }
    }

    /// SIOCETHTOOL on `iface` with `data` (a command struct beginning with its `cmd`).
    fn ioctl(fd: &OwnedFd, iface: &str, data: &mut [u64]) -> io::Result<()> {
        // SAFETY: a zeroed ifreq is valid.
        let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
        if iface.len() >= req.ifr_name.len() || iface.bytes().any(|b| b == 0) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("bad interface name `{iface}`"),
            ));
        }
        for (d, b) in req.ifr_name.iter_mut().zip(iface.bytes()) {
            *d = b as libc::c_char;
        }
        req.ifr_ifru.ifru_data = data.as_mut_ptr().cast();
        // SAFETY: `req` names the interface and points at `data`, which outlives the call
        // and is as large as the command's struct with the lengths it declares.
        let r = unsafe { libc::ioctl(fd.as_raw_fd(), libc::SIOCETHTOOL, &mut req) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// The number of statistics: `struct ethtool_sset_info { cmd, reserved, u64
    /// sset_mask, u32 data[] }`. `None` when the driver has no statistics.
    fn count(fd: &OwnedFd, iface: &str) -> io::Result<Option<u32>> {
        let mut buf = [0u64; 3];
        put(&mut buf, 0, ETHTOOL_GSSET_INFO); // then reserved = 0
        buf[1] = 1 << ETH_SS_STATS;
        match ioctl(fd, iface, &mut buf) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => return Ok(None),
            Err(e) => return Err(e),
        }
        if buf[1] & (1 << ETH_SS_STATS) == 0 {
            return Ok(None);
        }
        let n = get(&buf, 16);
        Ok((n > 0).then_some(n))
    }

    /// `iface`'s statistics, names and values. `Ok(None)` when it has none. The set can
    /// change between the calls (mlx5 adds and drops per-priority pause counters as PFC
    /// is configured): then it is read again, a few times.
    pub fn stats(iface: &str) -> io::Result<Option<Vec<(String, u64)>>> {
        let mut tries = 0;
        loop {
            match stats_once(iface) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted && tries < 3 => tries += 1,
                r => return r,
            }
        }
    }

    fn stats_once(iface: &str) -> io::Result<Option<Vec<(String, u64)>>> {
        let ctx = |e: io::Error| io::Error::new(e.kind(), format!("ethtool statistics of {iface}: {e}"));
        let fd = socket().map_err(ctx)?;
        let Some(n) = count(&fd, iface).map_err(ctx)? else {
            return Ok(None);
        };
        if n > MAX_STATS {
            return Err(ctx(io::Error::other(format!(
                "{n} statistics is more than any driver has"
            ))));
        }
        let n = n as usize;
        // A kernel since late 2025 answers a count that is no longer the driver's with 0
        // and no data; older ones write as many entries as the driver has at the time of
        // the call, whatever we ask for: room for the set to grow between the calls.
        let room = (2 * n).max(n + 1024);
        // struct ethtool_gstrings { cmd, string_set, len, data[len * 32] }: 12 bytes then
        // the strings, in u64 words to keep the buffer aligned.
        let mut strings = vec![0u64; (12 + room * ETH_GSTRING_LEN).div_ceil(8)];
        put(&mut strings, 0, ETHTOOL_GSTRINGS);
        put(&mut strings, 4, ETH_SS_STATS);
        put(&mut strings, 8, n as u32);
        ioctl(&fd, iface, &mut strings).map_err(ctx)?;
        let got = get(&strings, 8) as usize;
        let bytes = bytes(&strings);
        // struct ethtool_stats { cmd, n_stats, u64 data[n_stats] }.
        let mut values = vec![0u64; 1 + room];
        put(&mut values, 0, ETHTOOL_GSTATS);
        put(&mut values, 4, n as u32);
        ioctl(&fd, iface, &mut values).map_err(ctx)?;
        let got_values = get(&values, 4) as usize;
        // The driver's set changed between the calls (a reconfiguration): read again.
        if got != n || got_values != n {
            return Err(ctx(io::Error::new(
                io::ErrorKind::Interrupted,
                format!(
                    "the driver's statistics changed while reading ({n} announced, {got} names, {got_values} values)"
                ),
            )));
        }
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let s = &bytes[12 + i * ETH_GSTRING_LEN..12 + (i + 1) * ETH_GSTRING_LEN];
            let end = s.iter().position(|&b| b == 0).unwrap_or(ETH_GSTRING_LEN);
            out.push((String::from_utf8_lossy(&s[..end]).into_owned(), values[1 + i]));
        }
        Ok(Some(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ethtool_s_text_parses_and_garbage_is_refused() {
        let t = "NIC statistics:\n     rx_prio3_pause: 12\n     tx_pause_ctrl_phy: 0\n";
        assert_eq!(
            parse_ethtool_s(t).unwrap(),
            [
                ("rx_prio3_pause".to_owned(), 12),
                ("tx_pause_ctrl_phy".to_owned(), 0)
            ]
        );
        assert!(parse_ethtool_s("  x: -1\n").is_err());
        assert!(parse_ethtool_s("  no colon\n").is_err());
    }

    #[test]
    fn boot_ids_parse() {
        let id = parse_uuid("0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0").unwrap();
        assert_eq!(id[0], 0x0f);
        assert_eq!(id[15], 0xf0);
        assert!(parse_uuid("0f1e2d3c4b5a69788796a5b4c3d2e1f0").is_none());
        assert!(parse_uuid("zz1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0").is_none());
    }
}
