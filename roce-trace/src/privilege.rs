//! Least privilege for the agent: loading and attaching eBPF programs takes CAP_BPF,
//! CAP_NET_ADMIN and CAP_PERFMON, but once the programs are attached the agent only reads
//! their maps through descriptors it already holds. So right after attaching it gives up
//! everything it no longer needs — for the rest of its life — and, with `--user`, the
//! root identity too:
//!
//! | capability | kept when | why |
//! |---|---|---|
//! | CAP_NET_RAW | it streams to a collector (traces on request) | the raw ICMP socket that hears the probes' answers |
//! | CAP_NET_ADMIN | a hook is a clsact filter (kernels without tcx) | removing the filter at exit (tcx and XDP links go with their descriptor) |
//! | CAP_BPF | the kernel is older than 6.5 and `kernel.unprivileged_bpf_disabled` is set | those kernels refuse every bpf() call without it, map reads included |
//!
//! Everything else (CAP_PERFMON, CAP_SYS_ADMIN, …) goes; ambient capabilities are
//! cleared and no_new_privs set. Capabilities are per thread: this runs before the agent
//! starts any thread, and refuses to run after.

use std::ffi::CString;

use anyhow::Context as _;

pub const CAP_NET_ADMIN: u32 = 12;
pub const CAP_NET_RAW: u32 = 13;
pub const CAP_BPF: u32 = 39;

/// A capability's name, for messages.
pub fn cap_name(c: u32) -> String {
    match c {
        CAP_NET_ADMIN => "CAP_NET_ADMIN".into(),
        CAP_NET_RAW => "CAP_NET_RAW".into(),
        21 => "CAP_SYS_ADMIN".into(),
        38 => "CAP_PERFMON".into(),
        CAP_BPF => "CAP_BPF".into(),
        n => format!("capability {n}"),
    }
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const CAP_V3: u32 = 0x2008_0522;

fn capget() -> std::io::Result<[CapData; 2]> {
    let mut h = CapHeader {
        version: CAP_V3,
        pid: 0,
    };
    let mut d = [CapData::default(); 2];
    // SAFETY: header and two data structs, as capget(2) takes for version 3.
    let r = unsafe { libc::syscall(libc::SYS_capget, &mut h as *mut CapHeader, d.as_mut_ptr()) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(d)
}

fn capset(d: &[CapData; 2]) -> std::io::Result<()> {
    let mut h = CapHeader {
        version: CAP_V3,
        pid: 0,
    };
    // SAFETY: as capget; the kernel only reads `d`.
    let r = unsafe { libc::syscall(libc::SYS_capset, &mut h as *mut CapHeader, d.as_ptr()) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The capabilities in this thread's effective set.
pub fn effective() -> std::io::Result<Vec<u32>> {
    let d = capget()?;
    Ok((0..64u32)
        .filter(|&c| d[(c / 32) as usize].effective & (1 << (c % 32)) != 0)
        .collect())
}

/// Whether this kernel refuses bpf() map reads to a process without CAP_BPF: before
/// 6.5 the `kernel.unprivileged_bpf_disabled` check covered every command.
pub fn map_reads_need_cap_bpf() -> bool {
    let disabled = std::fs::read_to_string("/proc/sys/kernel/unprivileged_bpf_disabled")
        .map(|s| s.trim() != "0")
        .unwrap_or(true);
    if !disabled {
        return false;
    }
    // SAFETY: uname fills the struct it is given.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    if unsafe { libc::uname(&mut u) } != 0 {
        return true;
    }
    // SAFETY: the kernel NUL-terminates release.
    let release = unsafe { std::ffi::CStr::from_ptr(u.release.as_ptr()) }.to_string_lossy();
    let mut it = release
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse::<u32>().ok());
    let (major, minor) = (it.next().unwrap_or(0), it.next().unwrap_or(0));
    (major, minor) < (6, 5)
}

/// What [`drop_privileges`] left.
#[derive(Debug)]
pub struct Dropped {
    pub uid: u32,
    pub gid: u32,
    pub kept: Vec<u32>,
}

impl std::fmt::Display for Dropped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kept: Vec<String> = self.kept.iter().map(|c| cap_name(*c)).collect();
        write!(
            f,
            "running as uid {} gid {} with {}",
            self.uid,
            self.gid,
            if kept.is_empty() {
                "no capabilities".into()
            } else {
                kept.join(", ")
            }
        )
    }
}

/// Threads of this process.
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count())
}

/// Becomes `user` (when given: needs root), keeps only `keep` of the capabilities this
/// process has, clears the ambient set and sets no_new_privs — irreversibly. Must run
/// before any other thread exists (capabilities are per thread).
pub fn drop_privileges(user: Option<&str>, keep: &[u32]) -> anyhow::Result<Dropped> {
    let n = threads();
    anyhow::ensure!(
        n == 1,
        "dropping privileges needs a process of one thread ({n} now): capabilities are per thread"
    );
    // SAFETY: plain syscalls on this process; the passwd buffer outlives its use.
    unsafe {
        if let Some(user) = user {
            anyhow::ensure!(
                libc::geteuid() == 0,
                "--user {user} needs the agent started as root (or start it as {user} with ambient capabilities, as the shipped unit does)"
            );
            let name = CString::new(user).context("user name")?;
            let mut pw: libc::passwd = std::mem::zeroed();
            let mut buf = vec![0 as libc::c_char; 16 * 1024];
            let mut out: *mut libc::passwd = std::ptr::null_mut();
            let r = libc::getpwnam_r(name.as_ptr(), &mut pw, buf.as_mut_ptr(), buf.len(), &mut out);
            anyhow::ensure!(r == 0 && !out.is_null(), "--user {user}: no such user");
            let (uid, gid) = (pw.pw_uid, pw.pw_gid);
            anyhow::ensure!(uid != 0, "--user {user} is root: nothing would be dropped");
            let ok = |r: libc::c_int, what: &str| -> anyhow::Result<()> {
                anyhow::ensure!(r == 0, "{what}: {}", std::io::Error::last_os_error());
                Ok(())
            };
            ok(
                libc::prctl(libc::PR_SET_KEEPCAPS, 1, 0, 0, 0),
                "keeping capabilities across setuid",
            )?;
            ok(
                libc::setgroups(0, std::ptr::null()),
                "dropping supplementary groups",
            )?;
            ok(libc::setresgid(gid, gid, gid), "setting the group")?;
            ok(libc::setresuid(uid, uid, uid), "setting the user")?;
            ok(libc::prctl(libc::PR_SET_KEEPCAPS, 0, 0, 0, 0), "PR_SET_KEEPCAPS")?;
        }
    }
    let have = capget().context("reading capabilities")?;
    let mut want = [CapData::default(); 2];
    let mut kept = Vec::new();
    for &c in keep {
        let (i, bit) = ((c / 32) as usize, 1u32 << (c % 32));
        if have[i].permitted & bit != 0 {
            want[i].permitted |= bit;
            want[i].effective |= bit;
            kept.push(c);
        }
    }
    capset(&want).context("dropping capabilities")?;
    // SAFETY: prctl with constant arguments.
    unsafe {
        // Ambient capabilities (the unit's) would survive an exec; none is ever made,
        // but they go all the same.
        libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
        anyhow::ensure!(
            libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0,
            "no_new_privs: {}",
            std::io::Error::last_os_error()
        );
    }
    // SAFETY: no preconditions.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    Ok(Dropped { uid, gid, kept })
}
