//! What the host must offer before the datapath loads: privileges, kernel version,
//! interfaces; and the clock that turns kernel timestamps into wall-clock time.

use std::ffi::CString;

use thiserror::Error;

#[derive(Debug, Error)]
pub enum SysError {
    #[error(
        "missing privileges: loading eBPF programs needs CAP_BPF and CAP_NET_ADMIN (or CAP_SYS_ADMIN); \
         run as root or grant them, e.g. `sudo setcap cap_bpf,cap_net_admin,cap_perfmon+ep $(which roce-trace)`"
    )]
    MissingCapabilities,
    #[error("unknown interface `{0}` (see `ip link`)")]
    UnknownInterface(String),
    #[error("kernel {0}.{1} is too old: roce-trace needs Linux 5.8 or newer (BPF ring buffer, BPF links)")]
    KernelTooOld(u32, u32),
}

const CAP_NET_ADMIN: u32 = 12;
const CAP_SYS_ADMIN: u32 = 21;
const CAP_BPF: u32 = 39;

/// Effective capability bits of this process, from /proc/self/status.
pub fn effective_caps() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .unwrap_or(0)
}

pub fn check_privileges() -> Result<(), SysError> {
    let caps = effective_caps();
    let has = |c: u32| caps & (1u64 << c) != 0;
    if (has(CAP_BPF) || has(CAP_SYS_ADMIN)) && (has(CAP_NET_ADMIN) || has(CAP_SYS_ADMIN)) {
        Ok(())
    } else {
        Err(SysError::MissingCapabilities)
    }
}

/// (major, minor) of the running kernel.
pub fn kernel_version() -> (u32, u32) {
    // SAFETY: uname fills the zeroed struct; the release field is NUL-terminated.
    let release = unsafe {
        let mut u: libc::utsname = std::mem::zeroed();
        if libc::uname(&mut u) != 0 {
            return (0, 0);
        }
        std::ffi::CStr::from_ptr(u.release.as_ptr())
            .to_string_lossy()
            .into_owned()
    };
    parse_kernel_release(&release)
}

pub fn parse_kernel_release(release: &str) -> (u32, u32) {
    let mut it = release
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty());
    let major = it.next().and_then(|s| s.parse().ok()).unwrap_or(0);
    let minor = it.next().and_then(|s| s.parse().ok()).unwrap_or(0);
    (major, minor)
}

pub fn check_kernel() -> Result<(u32, u32), SysError> {
    let (maj, min) = kernel_version();
    if (maj, min) < (5, 8) {
        Err(SysError::KernelTooOld(maj, min))
    } else {
        Ok((maj, min))
    }
}

pub fn ifindex(name: &str) -> Result<u32, SysError> {
    let c = CString::new(name).map_err(|_| SysError::UnknownInterface(name.to_owned()))?;
    // SAFETY: `c` is a valid NUL-terminated string.
    let idx = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if idx == 0 {
        Err(SysError::UnknownInterface(name.to_owned()))
    } else {
        Ok(idx)
    }
}

/// The driver behind an interface (`veth`, `mlx5_core`, …), from ETHTOOL_GDRVINFO; None
/// when the interface does not say.
pub fn driver(iface: &str) -> Option<String> {
    const ETHTOOL_GDRVINFO: u32 = 0x3;
    // struct ethtool_drvinfo: cmd, then driver[32] and more we do not read.
    #[repr(C)]
    struct DrvInfo {
        cmd: u32,
        driver: [u8; 32],
        rest: [u8; 160],
    }
    let mut info = DrvInfo {
        cmd: ETHTOOL_GDRVINFO,
        driver: [0; 32],
        rest: [0; 160],
    };
    // SAFETY: a zeroed ifreq is valid.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    let name = iface.as_bytes();
    if name.len() >= req.ifr_name.len() {
        return None;
    }
    for (d, &b) in req.ifr_name.iter_mut().zip(name) {
        *d = b as libc::c_char;
    }
    req.ifr_ifru.ifru_data = (&mut info as *mut DrvInfo).cast();
    // SAFETY: plain socket creation.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: `req` names the interface and points at `info`, which outlives the call and
    // is as large as the kernel's ethtool_drvinfo.
    let r = unsafe { libc::ioctl(fd, libc::SIOCETHTOOL, &mut req) };
    // SAFETY: our own fd.
    unsafe { libc::close(fd) };
    if r < 0 {
        return None;
    }
    let end = info
        .driver
        .iter()
        .position(|&b| b == 0)
        .unwrap_or(info.driver.len());
    Some(String::from_utf8_lossy(&info.driver[..end]).into_owned())
}

/// An interface's MTU (IP bytes), in this network namespace.
pub fn mtu(iface: &str) -> std::io::Result<u32> {
    if iface.len() >= libc::IFNAMSIZ {
        return Err(std::io::Error::other(format!(
            "interface name `{iface}` is too long"
        )));
    }
    // SAFETY: plain socket(2); the descriptor is owned below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a descriptor just returned by socket(2), owned by nothing else.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    // SAFETY: ifreq is plain data; all zeroes is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(iface.bytes()) {
        *d = s as libc::c_char;
    }
    // SAFETY: SIOCGIFMTU reads the name and writes the MTU into `req`, which outlives the call.
    let r = unsafe { libc::ioctl(std::os::fd::AsRawFd::as_raw_fd(&fd), libc::SIOCGIFMTU, &mut req) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel filled the MTU member of the union.
    Ok(unsafe { req.ifr_ifru.ifru_mtu } as u32)
}

pub fn ifname(index: u32) -> Option<String> {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: buf holds IF_NAMESIZE bytes as if_indextoname requires.
    let p = unsafe { libc::if_indextoname(index, buf.as_mut_ptr()) };
    if p.is_null() {
        return None;
    }
    // SAFETY: on success buf holds a NUL-terminated name.
    Some(
        unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned(),
    )
}

/// The RDMA device (e.g. `mlx5_0`) an interface belongs to, from
/// `<sysfs>/class/infiniband/*/device/net/<iface>`.
pub fn rdma_device_of(sysfs: &std::path::Path, iface: &str) -> Option<String> {
    let dir = std::fs::read_dir(sysfs.join("class/infiniband")).ok()?;
    dir.filter_map(Result::ok)
        .find(|d| d.path().join("device/net").join(iface).exists())
        .map(|d| d.file_name().to_string_lossy().into_owned())
}

/// Logs [`kernel_bypass_warning`] for each interface that has one.
pub fn warn_kernel_bypass(ifaces: &[String]) {
    for iface in ifaces {
        if let Some(w) = kernel_bypass_warning(iface) {
            tracing::warn!("{w}");
        }
    }
}

/// What to tell a user observing an interface whose RoCE traffic the NIC handles itself:
/// on hardware RoCE, data and CNPs never reach XDP or TC.
pub fn kernel_bypass_warning(iface: &str) -> Option<String> {
    let sysfs = std::env::var_os("ROCE_TRACE_SYSFS")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| "/sys".into());
    rdma_device_of(&sysfs, iface).map(|dev| {
        format!(
            "{iface} belongs to RDMA device {dev}: its RoCE data, ACKs and CNPs are sent and received by the NIC \
             and never reach XDP or TC, so counts here cover only RoCE the kernel itself sends (Soft-RoCE, \
             generators). To see the NIC's RoCE, capture with its sniffer (`tcpdump -i {dev} -w …`, ibdump) \
             or mirror it from a switch, or observe from a Linux host in the path"
        )
    })
}

fn clock_ns(clock: libc::clockid_t) -> i128 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid timespec to fill.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec as i128 * 1_000_000_000 + ts.tv_nsec as i128
}

/// Converts `bpf_ktime_get_ns` (CLOCK_MONOTONIC) readings to Unix time in nanoseconds.
#[derive(Clone, Copy, Debug)]
pub struct KernelClock {
    offset_ns: i128,
}

impl KernelClock {
    /// For times that are Unix nanoseconds already (pcap input).
    pub const UNIX: Self = Self { offset_ns: 0 };

    pub fn now() -> Self {
        let mono = clock_ns(libc::CLOCK_MONOTONIC);
        let real = clock_ns(libc::CLOCK_REALTIME);
        Self {
            offset_ns: real - mono,
        }
    }
    pub fn to_unix_ns(&self, mono_ns: u64) -> u64 {
        (mono_ns as i128 + self.offset_ns).max(0) as u64
    }
    pub fn mono_now_ns() -> u64 {
        clock_ns(libc::CLOCK_MONOTONIC) as u64
    }
}

/// This host's name: the node of its observation points.
pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: buf is writable for its length.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) };
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    if r == 0 {
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        "unknown".into()
    }
}

/// How many CPU ids a program may run under (`bpf_get_smp_processor_id`): the highest
/// possible CPU's id + 1, from `/sys/devices/system/cpu/possible`. Arrays indexed by CPU
/// are sized by it; where the possible CPUs have gaps (`0-3,8-11`) it is more than their
/// count.
pub fn cpu_id_count() -> std::io::Result<usize> {
    const POSSIBLE: &str = "/sys/devices/system/cpu/possible";
    let s = std::fs::read_to_string(POSSIBLE)?;
    parse_cpu_id_count(&s).ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{POSSIBLE} says {:?}: not a CPU list", s.trim()),
        )
    })
}

/// The highest id + 1 of a kernel CPU list (`0-3,8-11`, `0`), or `None` when it is not one.
pub fn parse_cpu_id_count(list: &str) -> Option<usize> {
    let mut highest = None;
    for part in list.trim().split(',') {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let (a, b): (usize, usize) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
        if b < a {
            return None;
        }
        highest = highest.max(Some(b));
    }
    highest.map(|h| h + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_give_the_highest_id_plus_one() {
        assert_eq!(parse_cpu_id_count("0-3\n"), Some(4));
        assert_eq!(parse_cpu_id_count("0"), Some(1));
        assert_eq!(
            parse_cpu_id_count("0-3,8-11"),
            Some(12),
            "gaps count up to the highest id"
        );
        assert_eq!(parse_cpu_id_count("0,2,5"), Some(6));
        assert_eq!(parse_cpu_id_count(""), None);
        assert_eq!(parse_cpu_id_count("3-1"), None);
        assert_eq!(parse_cpu_id_count("0-x"), None);
        assert!(cpu_id_count().unwrap() >= 1);
    }

    #[test]
    fn kernel_release_strings() {
        assert_eq!(parse_kernel_release("6.18.44-fc-v857"), (6, 18));
        assert_eq!(parse_kernel_release("5.4.0-150-generic"), (5, 4));
        assert_eq!(parse_kernel_release("garbage"), (0, 0));
    }

    #[test]
    fn rdma_devices_are_found_through_sysfs() {
        let root = std::env::temp_dir().join(format!("rt-sysfs-{}", std::process::id()));
        std::fs::create_dir_all(root.join("class/infiniband/mlx5_0/device/net/ens1f0")).unwrap();
        std::fs::create_dir_all(root.join("class/infiniband/rxe0/device/net/eth9")).unwrap();
        assert_eq!(rdma_device_of(&root, "ens1f0").as_deref(), Some("mlx5_0"));
        assert_eq!(rdma_device_of(&root, "eth9").as_deref(), Some("rxe0"));
        assert_eq!(rdma_device_of(&root, "veth0"), None);
        assert_eq!(rdma_device_of(std::path::Path::new("/nonexistent"), "eth0"), None);
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn unknown_interface_is_a_clear_error() {
        let e = ifindex("no-such-if0").unwrap_err();
        assert_eq!(e.to_string(), "unknown interface `no-such-if0` (see `ip link`)");
        assert!(ifindex("lo").is_ok());
    }
}

/// Writes `bytes` into a new file at `path` with `mode`, synced: never over an existing
/// file, never through a symbolic link (O_EXCL|O_NOFOLLOW).
pub fn write_new(path: &std::path::Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

/// Writes `bytes` to `path` so that a reader (or a crash) sees the old file or the new one
/// whole, never a part: into a new file beside it (created, never opened through a
/// symbolic link), synced, renamed over `path` (which replaces a link at `path` rather
/// than writing where it points), and the directory synced.
pub fn write_atomically(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => std::path::Path::new("."),
    };
    let name = path.file_name().ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{} names no file", path.display()),
        )
    })?;
    let tmp = dir.join(format!(".{}.{}.tmp", name.to_string_lossy(), std::process::id()));
    // A leftover of this process's own earlier attempt (unlink never follows a link).
    let _ = std::fs::remove_file(&tmp);
    let written = (|| {
        write_new(&tmp, bytes, 0o644)?;
        std::fs::rename(&tmp, path)?;
        std::fs::File::open(dir)?.sync_all()
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Creates (or truncates) `path` for writing as a stream, never through a symbolic link
/// at `path` (O_NOFOLLOW: refused with an error that says so), so output written as root
/// cannot be aimed at another file by a link planted there.
pub fn create_nofollow(path: &std::path::Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| {
            if e.raw_os_error() == Some(libc::ELOOP) {
                std::io::Error::new(
                    e.kind(),
                    format!(
                        "{} is a symbolic link: not written through (remove it, or name the file itself)",
                        path.display()
                    ),
                )
            } else {
                e
            }
        })
}

#[cfg(test)]
mod write_tests {
    use super::write_atomically;

    /// The file is replaced whole; a symbolic link at the path is replaced, not written
    /// through; a directory that is not there is an error that leaves nothing behind.
    #[test]
    fn a_file_written_atomically_replaces_the_old_one_and_never_a_link_target() {
        let dir = std::env::temp_dir().join(format!("rt-atomic-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("report.json");
        write_atomically(&p, b"old").unwrap();
        write_atomically(&p, b"new and longer").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"new and longer");
        let victim = dir.join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let link = dir.join("link.json");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        write_atomically(&link, b"report").unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert!(!std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
        assert!(write_atomically(&dir.join("nope/report.json"), b"x").is_err());
        let mut left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        left.sort();
        assert_eq!(left, ["link.json", "report.json", "victim"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// A file holding a secret (`what`: "token file", "private key") must be the reader's
/// own, or root's, and readable by nobody else (as ssh requires of a private key): a
/// secret others can read is no secret.
pub fn check_secret_file(f: &std::path::Path, what: &str) -> std::io::Result<()> {
    use std::os::unix::fs::MetadataExt as _;
    let m = std::fs::metadata(f)
        .map_err(|e| std::io::Error::new(e.kind(), format!("reading the {what} {}: {e}", f.display())))?;
    let mode = m.mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(std::io::Error::other(format!(
            "the {what} {} can be read by others (mode {mode:03o}): chmod 600 it",
            f.display()
        )));
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if m.uid() != me && m.uid() != 0 {
        return Err(std::io::Error::other(format!(
            "the {what} {} belongs to uid {}, not to this user ({me}) or root",
            f.display(),
            m.uid()
        )));
    }
    Ok(())
}

/// An interface's IP addresses in this network namespace (IPv4 mapped into IPv6), from
/// getifaddrs(3); none when it has none or they cannot be read.
pub fn iface_addrs(iface: &str) -> Vec<[u8; 16]> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return out;
    }
    let mut p = head;
    while !p.is_null() {
        // SAFETY: `p` is a node of the list getifaddrs returned, not yet freed.
        let ifa = unsafe { &*p };
        p = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) };
        if name.to_bytes() != iface.as_bytes() {
            continue;
        }
        // SAFETY: ifa_addr points at a sockaddr whose family says its real type.
        match unsafe { (*ifa.ifa_addr).sa_family } as i32 {
            libc::AF_INET => {
                // SAFETY: an AF_INET address is a sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                let v4 = std::net::Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
                out.push(v4.to_ipv6_mapped().octets());
            }
            libc::AF_INET6 => {
                // SAFETY: an AF_INET6 address is a sockaddr_in6.
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                out.push(sin6.sin6_addr.s6_addr);
            }
            _ => {}
        }
    }
    // SAFETY: the list getifaddrs returned, freed once.
    unsafe { libc::freeifaddrs(head) };
    out
}
