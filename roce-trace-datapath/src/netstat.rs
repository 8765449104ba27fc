//! The kernel's drop counters for the interfaces an agent watches: each interface's own
//! (`/proc/net/dev`, the drop columns) and its root qdisc's (rtnetlink, `RTM_GETQDISC`).
//! Both are read in the agent's network namespace. The collector quotes them when it
//! locates a loss on a link, so a user sees whether the kernel at either end dropped it.

use std::{collections::HashMap, io};

/// One interface's packet and drop counters (running totals since it came up).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IfDrops {
    pub rx_packets: u64,
    pub tx_packets: u64,
    pub rx_dropped: u64,
    pub tx_dropped: u64,
}

/// Parses `/proc/net/dev`: per interface name, the receive and transmit `packets` and
/// `drop` columns.
/// Lines that do not parse are skipped (the two header lines among them).
pub fn parse_proc_net_dev(text: &str) -> HashMap<String, IfDrops> {
    let mut m = HashMap::new();
    for line in text.lines() {
        let Some((name, rest)) = line.split_once(':') else {
            continue;
        };
        let v: Vec<u64> = match rest.split_whitespace().map(str::parse).collect() {
            Ok(v) => v,
            Err(_) => continue,
        };
        // rx: bytes packets errs drop fifo frame compressed multicast; tx: bytes packets
        // errs drop fifo colls carrier compressed.
        if v.len() < 16 {
            continue;
        }
        m.insert(
            name.trim().to_owned(),
            IfDrops {
                rx_packets: v[1],
                tx_packets: v[9],
                rx_dropped: v[3],
                tx_dropped: v[11],
            },
        );
    }
    m
}

pub fn read_if_drops() -> io::Result<HashMap<String, IfDrops>> {
    Ok(parse_proc_net_dev(&std::fs::read_to_string("/proc/net/dev")?))
}

const NLMSG_HDR: usize = 16;
const TCMSG_LEN: usize = 20;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const RTM_NEWQDISC: u16 = 36;
const RTM_GETQDISC: u16 = 38;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_DUMP: u16 = 0x300;
/// `struct tc_stats` (legacy statistics, still sent with every qdisc): drops at byte 12.
const TCA_STATS: u16 = 3;
const TC_H_ROOT: u32 = 0xFFFF_FFFF;

/// Reads one rtnetlink `RTM_GETQDISC` dump's messages from `buf` into `out` (interface
/// index → its root qdisc's drops). `Ok(true)` at the end of the dump.
pub fn parse_qdisc_dump(buf: &[u8], out: &mut HashMap<u32, u64>) -> Result<bool, &'static str> {
    let mut off = 0;
    while off + NLMSG_HDR <= buf.len() {
        let u32_at = |i: usize| u32::from_ne_bytes(buf[i..i + 4].try_into().expect("4 bytes"));
        let u16_at = |i: usize| u16::from_ne_bytes(buf[i..i + 2].try_into().expect("2 bytes"));
        let len = u32_at(off) as usize;
        let kind = u16_at(off + 4);
        if len < NLMSG_HDR || off + len > buf.len() {
            return Err("netlink message length runs past the datagram");
        }
        match kind {
            NLMSG_DONE => return Ok(true),
            NLMSG_ERROR => return Err("the kernel refused the qdisc dump"),
            RTM_NEWQDISC if len >= NLMSG_HDR + TCMSG_LEN => {
                let t = off + NLMSG_HDR;
                let ifindex = u32_at(t + 4);
                let parent = u32_at(t + 12);
                let mut a = t + TCMSG_LEN;
                while a + 4 <= off + len {
                    let alen = u16_at(a) as usize;
                    let atype = u16_at(a + 2) & 0x3fff;
                    if alen < 4 || a + alen > off + len {
                        return Err("netlink attribute length runs past its message");
                    }
                    if atype == TCA_STATS && alen >= 4 + 16 && parent == TC_H_ROOT {
                        out.insert(ifindex, u32_at(a + 4 + 12) as u64);
                    }
                    a += (alen + 3) & !3;
                }
            }
            _ => {}
        }
        off += (len + 3) & !3;
    }
    Ok(false)
}

/// Every interface's root qdisc drops (interface index → drops), from the kernel.
pub fn root_qdisc_drops() -> io::Result<HashMap<u32, u64>> {
    // SAFETY: plain socket(2); the descriptor is owned below.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor just returned by socket(2), owned by nothing else.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
    let mut req = [0u8; NLMSG_HDR + TCMSG_LEN];
    req[0..4].copy_from_slice(&((NLMSG_HDR + TCMSG_LEN) as u32).to_ne_bytes());
    req[4..6].copy_from_slice(&RTM_GETQDISC.to_ne_bytes());
    req[6..8].copy_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    req[8..12].copy_from_slice(&1u32.to_ne_bytes());
    // SAFETY: `req` is a valid buffer of its length; a netlink socket sends to the kernel.
    let n = unsafe { libc::send(raw, req.as_ptr().cast(), req.len(), 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut out = HashMap::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // SAFETY: `buf` is a valid writable buffer of its length.
        let n = unsafe { libc::recv(raw, buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n == 0 {
            return Ok(out);
        }
        match parse_qdisc_dump(&buf[..n as usize], &mut out) {
            Ok(true) => return Ok(out),
            Ok(false) => {}
            Err(e) => return Err(io::Error::other(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_net_dev_gives_each_interfaces_drop_columns() {
        let text = "Inter-|   Receive                                                |  Transmit\n \
             face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed\n\
                 lo:  1000      10    0    0    0     0          0         0     1000      10    0    0    0     0       0          0\n\
               s1: 98765     432    1    7    0     0          0         0   123456     789    0    3    0     0       0          0\n\
             bad: x y z\n";
        let m = parse_proc_net_dev(text);
        assert_eq!(m.len(), 2);
        assert_eq!(
            m["s1"],
            IfDrops {
                rx_packets: 432,
                tx_packets: 789,
                rx_dropped: 7,
                tx_dropped: 3
            }
        );
        assert_eq!(
            m["lo"],
            IfDrops {
                rx_packets: 10,
                tx_packets: 10,
                ..Default::default()
            }
        );
    }

    /// One RTM_NEWQDISC message: interface, parent, and a TCA_STATS with `drops`.
    fn qdisc_msg(ifindex: u32, parent: u32, drops: u32) -> Vec<u8> {
        let mut stats = vec![0u8; 36];
        stats[12..16].copy_from_slice(&drops.to_ne_bytes());
        let mut attr = Vec::new();
        attr.extend_from_slice(&((4 + stats.len()) as u16).to_ne_bytes());
        attr.extend_from_slice(&TCA_STATS.to_ne_bytes());
        attr.extend_from_slice(&stats);
        // TCA_KIND "tbf\0", to be skipped.
        let kind = [8u8, 0, 1, 0, b't', b'b', b'f', 0];
        let mut m = vec![0u8; NLMSG_HDR + TCMSG_LEN];
        m[4..6].copy_from_slice(&RTM_NEWQDISC.to_ne_bytes());
        m[NLMSG_HDR + 4..NLMSG_HDR + 8].copy_from_slice(&ifindex.to_ne_bytes());
        m[NLMSG_HDR + 12..NLMSG_HDR + 16].copy_from_slice(&parent.to_ne_bytes());
        m.extend_from_slice(&kind);
        m.extend_from_slice(&attr);
        let len = m.len() as u32;
        m[0..4].copy_from_slice(&len.to_ne_bytes());
        m
    }

    #[test]
    fn a_qdisc_dump_gives_root_qdisc_drops_only() {
        let mut buf = qdisc_msg(4, TC_H_ROOT, 17);
        buf.extend(qdisc_msg(4, 0x0001_0001, 5)); // a child class's qdisc: in the root's
        buf.extend(qdisc_msg(5, 0xFFFF_FFF1, 9)); // ingress
        let mut done = vec![0u8; NLMSG_HDR + 4];
        done[0..4].copy_from_slice(&((NLMSG_HDR + 4) as u32).to_ne_bytes());
        done[4..6].copy_from_slice(&NLMSG_DONE.to_ne_bytes());
        buf.extend(done);
        let mut out = HashMap::new();
        assert_eq!(parse_qdisc_dump(&buf, &mut out), Ok(true));
        assert_eq!(out, HashMap::from([(4, 17)]));
        // Garbage: a length past the end is an error, not a panic.
        let mut bad = qdisc_msg(4, TC_H_ROOT, 1);
        bad[0] = 0xff;
        assert!(parse_qdisc_dump(&bad, &mut HashMap::new()).is_err());
        let mut bad = qdisc_msg(4, TC_H_ROOT, 1);
        bad[NLMSG_HDR + TCMSG_LEN] = 0xff; // attribute length
        assert!(parse_qdisc_dump(&bad, &mut HashMap::new()).is_err());
    }

    #[test]
    fn the_kernel_answers_a_qdisc_dump() {
        // Loopback always has a root qdisc (noqueue counts nothing, but answers).
        assert!(root_qdisc_drops().is_ok());
    }
}
