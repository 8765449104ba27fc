//! `roce-trace trace`: in-band probes that ride a flow's own 5-tuple and class, varying
//! only the TTL (Paris-traceroute style, so every probe hashes onto the flow's path), and
//! report per hop the router, RTTs, and the DSCP/ECN the probe had *as that hop received
//! it* (from the IP header the ICMP Time Exceeded quotes) — so a class rewrite is located
//! at the first hop where it shows.
//!
//! A probe's payload is a BTH to a QP number no QP uses, with a deliberately wrong ICRC:
//! a RoCE NIC drops it, so a probe that reaches the destination never touches a QP.

use std::{
    collections::{BTreeMap, HashMap},
    io,
    mem::zeroed,
    net::{IpAddr, SocketAddr},
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    time::{Duration, Instant},
};

use roce_trace_common::{
    parse::{Packet as _, SlicePacket},
    wire::{Bth, Header as _, IPPROTO_UDP, Ipv4Hdr, Ipv6Hdr, ROCEV2_UDP_PORT, UdpHdr},
};
use serde::Serialize;
use thiserror::Error;

use crate::frame::RoceFrame;

mod paths;
pub use paths::{PathPorts, PathsReport, UnresolvedPort, paths, render_paths};

pub use roce_trace_common::flow::PROBE_QP;

#[derive(Debug, Error)]
pub enum TraceError {
    #[error("{0}")]
    Invalid(String),
    #[error("{what}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> TraceError {
    let what = what.into();
    move |source| TraceError::Io { what, source }
}

#[derive(Clone, Debug)]
pub struct TraceOptions {
    pub dst: IpAddr,
    pub src: IpAddr,
    pub sport: u16,
    pub dscp: u8,
    pub ecn: u8,
    pub max_hops: u8,
    /// Probes per hop.
    pub probes: u32,
    pub timeout: Duration,
    /// Probes per second at most.
    pub rate: u32,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Hop {
    pub ttl: u8,
    /// None: silent (no answer to any probe).
    pub addr: Option<IpAddr>,
    pub sent: u32,
    pub answered: u32,
    pub rtt_min_us: Option<f64>,
    pub rtt_avg_us: Option<f64>,
    pub rtt_max_us: Option<f64>,
    /// The probe's class as this hop received it (from the quoted IP header).
    pub dscp: Option<u8>,
    pub ecn: Option<u8>,
    /// `time-exceeded`, `port-unreachable` (the destination), `net-unreachable`, …
    pub answer: Option<String>,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct TraceReport {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub src: IpAddr,
    pub dst: IpAddr,
    pub udp_sport: u16,
    pub dscp: u8,
    pub ecn: u8,
    pub hops: Vec<Hop>,
    /// The destination answered (port unreachable) — or nothing answered past the last
    /// router, as when a RoCE NIC or a responder silently drops the probe.
    pub reached: bool,
    /// The first hop whose quoted class differs from what was sent.
    pub class_changed_at: Option<u8>,
    pub probes_sent: u32,
}

/// One answer: who, what it quoted, which probe.
pub(crate) struct Answer {
    pub(crate) from: IpAddr,
    pub(crate) kind: String,
    pub(crate) final_hop: bool,
    pub(crate) tos: u8,
    pub(crate) psn: u32,
}

fn raw_icmp(v6: bool) -> io::Result<OwnedFd> {
    let (family, proto) = if v6 {
        (libc::AF_INET6, libc::IPPROTO_ICMPV6)
    } else {
        (libc::AF_INET, libc::IPPROTO_ICMP)
    };
    // SAFETY: plain socket creation; the fd is owned below.
    let fd = unsafe { libc::socket(family, libc::SOCK_RAW | libc::SOCK_NONBLOCK, proto) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh socket we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn set_int(fd: i32, level: i32, name: i32, v: i32) -> io::Result<()> {
    // SAFETY: a valid int option on an open socket.
    let r = unsafe { libc::setsockopt(fd, level, name, &v as *const i32 as *const libc::c_void, 4) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Parses an ICMP(v6) error addressed to a probe of (`sport` → `dst`:4791). `msg` starts
/// at the ICMP header; `from` is its source.
pub(crate) fn parse_answer(msg: &[u8], from: IpAddr, v6: bool, sport: u16, dst: IpAddr) -> Option<Answer> {
    let (ty, code) = (*msg.first()?, *msg.get(1)?);
    let (kind, final_hop) = match (v6, ty, code) {
        (false, 11, _) | (true, 3, _) => ("time-exceeded", false),
        (false, 3, 3) | (true, 1, 4) => ("port-unreachable", true),
        (false, 3, 0) | (true, 1, 0) => ("net-unreachable", true),
        (false, 3, 1) | (true, 1, 3) => ("host-unreachable", true),
        (false, 3, 4) => ("fragmentation-needed", true),
        (true, 2, _) => ("packet-too-big", true),
        (false, 3, _) | (true, 1, _) => ("unreachable", true),
        _ => return None,
    };
    // The quote: the probe's IP header, UDP header and BTH, read with the shared
    // header definitions.
    let quote = SlicePacket::new(msg.get(8..)?);
    let (tos, to, udp_off) = if v6 {
        let ip = quote.header::<Ipv6Hdr>(0)?;
        if ip.version() != 6 || ip.next_hdr != IPPROTO_UDP {
            return None;
        }
        (ip.traffic_class(), IpAddr::from(ip.dst), Ipv6Hdr::LEN)
    } else {
        let ip = quote.header::<Ipv4Hdr>(0)?;
        if ip.version() != 4 || ip.protocol != IPPROTO_UDP || ip.header_len() < Ipv4Hdr::LEN {
            return None;
        }
        (ip.tos, IpAddr::from(ip.dst), ip.header_len())
    };
    let udp = quote.header::<UdpHdr>(udp_off)?;
    let bth = quote.header::<Bth>(udp_off + UdpHdr::LEN)?;
    if to != dst || udp.src_port() != sport || udp.dst_port() != ROCEV2_UDP_PORT || bth.dest_qp() != PROBE_QP
    {
        return None;
    }
    let psn = bth.psn();
    Some(Answer {
        from,
        kind: kind.into(),
        final_hop,
        tos,
        psn,
    })
}

/// The probe datagram: a SEND ONLY to [`PROBE_QP`], PSN = probe number, wrong ICRC.
fn probe_payload(opts: &TraceOptions, psn: u32) -> Vec<u8> {
    let f = RoceFrame {
        src: opts.src,
        dst: opts.dst,
        udp_sport: opts.sport,
        dscp: opts.dscp,
        ecn: opts.ecn,
        dest_qp: PROBE_QP,
        psn,
        payload: vec![0; 4],
        ..Default::default()
    };
    let mut p = f.udp_payload();
    let good = crate::frame::icrc(&f.ip_packet()).expect("well formed");
    let n = p.len();
    // Deliberately invalid: the correct ICRC with every bit flipped.
    p[n - 4..].copy_from_slice(&good.map(|b| !b));
    p
}

/// Traces one flow's path.
pub fn trace(opts: &TraceOptions) -> Result<TraceReport, TraceError> {
    if opts.src.is_ipv4() != opts.dst.is_ipv4() {
        return Err(TraceError::Invalid(format!(
            "{} and {} are not the same IP version",
            opts.src, opts.dst
        )));
    }
    if opts.max_hops == 0 || opts.probes == 0 || opts.rate == 0 {
        return Err(TraceError::Invalid(
            "--max-hops, --probes and --rate must be at least 1".into(),
        ));
    }
    let mut prober = Prober::open(opts)?;
    trace_with(opts, |ttl, psn| prober.probe(ttl, psn))
}

/// The sockets that send one flow's probes and hear their answers.
struct Prober<'a> {
    opts: &'a TraceOptions,
    v6: bool,
    icmp: OwnedFd,
    sock: std::net::UdpSocket,
    dst: SocketAddr,
    gap: Duration,
    last_send: Instant,
}

impl<'a> Prober<'a> {
    fn open(opts: &'a TraceOptions) -> Result<Self, TraceError> {
        let v6 = opts.dst.is_ipv6();
        let icmp = raw_icmp(v6).map_err(io_err("opening a raw ICMP socket (needs CAP_NET_RAW)"))?;
        let sock = crate::traffic::net::bind_shared(SocketAddr::new(opts.src, opts.sport)).map_err(
            io_err(format!(
                "binding {}:{} (is the flow's source this host?)",
                opts.src, opts.sport
            )),
        )?;
        let fd = sock.as_raw_fd();
        let tos = ((opts.dscp << 2) | (opts.ecn & 3)) as i32;
        if v6 {
            set_int(fd, libc::IPPROTO_IPV6, libc::IPV6_TCLASS, tos).map_err(io_err("IPV6_TCLASS"))?;
            set_int(fd, libc::IPPROTO_IPV6, libc::IPV6_DONTFRAG, 1).map_err(io_err("IPV6_DONTFRAG"))?;
        } else {
            set_int(fd, libc::IPPROTO_IP, libc::IP_TOS, tos).map_err(io_err("IP_TOS"))?;
            set_int(
                fd,
                libc::IPPROTO_IP,
                libc::IP_MTU_DISCOVER,
                libc::IP_PMTUDISC_PROBE,
            )
            .map_err(io_err("IP_MTU_DISCOVER"))?;
        }
        let gap = Duration::from_secs_f64(1.0 / opts.rate as f64);
        Ok(Prober {
            opts,
            v6,
            icmp,
            sock,
            dst: SocketAddr::new(opts.dst, ROCEV2_UDP_PORT),
            gap,
            last_send: Instant::now() - gap,
        })
    }

    /// Sends probe `psn` with `ttl` and waits for its answer. One probe at a time, its
    /// answer awaited: the RTT is the answer's arrival.
    fn probe(&mut self, ttl: u8, psn: u32) -> Result<Option<(Answer, Duration)>, TraceError> {
        let fd = self.sock.as_raw_fd();
        if self.v6 {
            set_int(fd, libc::IPPROTO_IPV6, libc::IPV6_UNICAST_HOPS, ttl as i32)
                .map_err(io_err("IPV6_UNICAST_HOPS"))?;
        } else {
            set_int(fd, libc::IPPROTO_IP, libc::IP_TTL, ttl as i32).map_err(io_err("IP_TTL"))?;
        }
        if let Some(wait) = (self.last_send + self.gap).checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let p = probe_payload(self.opts, psn);
        let sent_at: HashMap<u32, Instant> = [(psn, Instant::now())].into();
        self.last_send = Instant::now();
        self.sock
            .send_to(&p, self.dst)
            .map_err(io_err(format!("sending a probe to {}", self.dst)))?;
        Ok(collect(&self.icmp, self.v6, self.opts, &sent_at)?
            .into_iter()
            .next())
    }
}

/// The trace, given a way to send one probe (TTL, PSN) and hear its answer: which hops
/// answered, and where the destination is (its answer, or the silence past the last router).
pub(crate) fn trace_with(
    opts: &TraceOptions,
    mut probe: impl FnMut(u8, u32) -> Result<Option<(Answer, Duration)>, TraceError>,
) -> Result<TraceReport, TraceError> {
    let mut hops = Vec::new();
    let mut psn = 1u32;
    let mut reached = false;
    let mut silent_run = 0;
    for ttl in 1..=opts.max_hops {
        let mut answers = Vec::new();
        for _ in 0..opts.probes {
            answers.extend(probe(ttl, psn)?);
            psn += 1;
        }
        let mut hop = Hop {
            ttl,
            addr: None,
            sent: opts.probes,
            answered: answers.len() as u32,
            rtt_min_us: None,
            rtt_avg_us: None,
            rtt_max_us: None,
            dscp: None,
            ecn: None,
            answer: None,
        };
        if let Some((a, _)) = answers.first() {
            hop.addr = Some(a.from);
            hop.dscp = Some(a.tos >> 2);
            hop.ecn = Some(a.tos & 3);
            hop.answer = Some(a.kind.clone());
            let rtts: Vec<f64> = answers.iter().map(|(_, r)| r.as_secs_f64() * 1e6).collect();
            hop.rtt_min_us = rtts.iter().copied().reduce(f64::min);
            hop.rtt_max_us = rtts.iter().copied().reduce(f64::max);
            hop.rtt_avg_us = Some(rtts.iter().sum::<f64>() / rtts.len() as f64);
        }
        let done = answers.iter().any(|(a, _)| a.final_hop);
        silent_run = if hop.addr.is_none() { silent_run + 1 } else { 0 };
        hops.push(hop);
        if done {
            reached = answers
                .iter()
                .any(|(a, _)| a.kind == "port-unreachable" && a.from == opts.dst);
            break;
        }
        // Two silent hops after routers that answered: the destination took the probe
        // without a word (a RoCE NIC or responder drops it).
        if silent_run >= 2 && hops.len() > 2 {
            hops.truncate(hops.len() - 1);
            reached = true;
            break;
        }
    }
    let class_changed_at = hops
        .iter()
        .find(|h| h.dscp.is_some_and(|d| d != opts.dscp))
        .map(|h| h.ttl);
    Ok(TraceReport {
        kind: "trace",
        src: opts.src,
        dst: opts.dst,
        udp_sport: opts.sport,
        dscp: opts.dscp,
        ecn: opts.ecn,
        hops,
        reached,
        class_changed_at,
        probes_sent: psn - 1,
    })
}

/// Waits up to the timeout for the answers to `sent`; returns them with their RTTs.
fn collect(
    icmp: &OwnedFd,
    v6: bool,
    opts: &TraceOptions,
    sent: &HashMap<u32, Instant>,
) -> Result<Vec<(Answer, Duration)>, TraceError> {
    let deadline = Instant::now() + opts.timeout;
    let mut got: BTreeMap<u32, (Answer, Duration)> = BTreeMap::new();
    let mut buf = vec![0u8; 2048];
    while got.len() < sent.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        let mut pfd = libc::pollfd {
            fd: icmp.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut pfd, 1, left.as_millis().max(1) as i32) };
        loop {
            // SAFETY: zeroed sockaddr_storage is valid; recvfrom fills it.
            let mut from: libc::sockaddr_storage = unsafe { zeroed() };
            let mut len = std::mem::size_of::<libc::sockaddr_storage>() as u32;
            // SAFETY: buf and from are valid for the lengths given.
            let n = unsafe {
                libc::recvfrom(
                    icmp.as_raw_fd(),
                    buf.as_mut_ptr() as *mut libc::c_void,
                    buf.len(),
                    0,
                    &mut from as *mut _ as *mut libc::sockaddr,
                    &mut len,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::WouldBlock {
                    break;
                }
                return Err(io_err("receiving ICMP")(e));
            }
            let now = Instant::now();
            let data = &buf[..n as usize];
            let (src, msg) = if v6 {
                // SAFETY: an AF_INET6 raw socket reports sockaddr_in6 sources.
                let a = unsafe { &*(&from as *const _ as *const libc::sockaddr_in6) };
                (IpAddr::from(a.sin6_addr.s6_addr), data)
            } else {
                // Raw IPv4 sockets deliver the IP header too.
                if data.len() < 20 {
                    continue;
                }
                let ihl = ((data[0] & 0x0f) as usize) * 4;
                let s: [u8; 4] = data[12..16].try_into().expect("4 bytes");
                (IpAddr::from(s), &data[ihl.min(data.len())..])
            };
            if let Some(a) = parse_answer(msg, src, v6, opts.sport, opts.dst)
                && let Some(t) = sent.get(&a.psn)
            {
                let rtt = now - *t;
                got.entry(a.psn).or_insert((a, rtt));
            }
        }
    }
    Ok(got.into_values().collect())
}

pub fn render(r: &TraceReport) -> String {
    let mut s = format!(
        "trace {}:{} -> {}:4791, DSCP {} ECN {}, Paris-style (only the TTL varies)\n",
        r.src,
        r.udp_sport,
        r.dst,
        r.dscp,
        crate::record::ECN_NAMES[(r.ecn & 3) as usize]
    );
    for h in &r.hops {
        match h.addr {
            None => s.push_str(&format!("{:>3}  *  ({} probes, no answer)\n", h.ttl, h.sent)),
            Some(a) => {
                let changed = h.dscp.is_some_and(|d| d != r.dscp);
                s.push_str(&format!(
                    "{:>3}  {:<39} {:>8.1} / {:>8.1} / {:>8.1} us   as received: DSCP {}{} ECN {}   {}\n",
                    h.ttl,
                    a.to_string(),
                    h.rtt_min_us.unwrap_or(0.0),
                    h.rtt_avg_us.unwrap_or(0.0),
                    h.rtt_max_us.unwrap_or(0.0),
                    h.dscp.map(|d| d.to_string()).unwrap_or_else(|| "?".into()),
                    if changed { " (CHANGED)" } else { "" },
                    h.ecn.map(|e| crate::record::ECN_NAMES[e as usize]).unwrap_or("?"),
                    h.answer.as_deref().unwrap_or("")
                ));
            }
        }
    }
    match (r.reached, r.class_changed_at) {
        (_, Some(t)) => s.push_str(&format!("class rewritten: first seen changed at hop {t}\n")),
        (true, None) => s.push_str("class kept all the way\n"),
        (false, None) => s.push_str("destination not reached\n"),
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probes_carry_a_bad_icrc_and_the_unused_qp() {
        let o = TraceOptions {
            dst: "10.0.0.2".parse().unwrap(),
            src: "10.0.0.1".parse().unwrap(),
            sport: 50000,
            dscp: 26,
            ecn: 2,
            max_hops: 8,
            probes: 1,
            timeout: Duration::from_millis(100),
            rate: 100,
        };
        let p = probe_payload(&o, 77);
        assert_eq!(u32::from_be_bytes([0, p[5], p[6], p[7]]), PROBE_QP);
        assert_eq!(u32::from_be_bytes([0, p[9], p[10], p[11]]), 77);
        let good = RoceFrame {
            src: o.src,
            dst: o.dst,
            udp_sport: 50000,
            dscp: 26,
            ecn: 2,
            dest_qp: PROBE_QP,
            psn: 77,
            payload: vec![0; 4],
            ..Default::default()
        }
        .ip_packet();
        assert_ne!(
            &p[p.len() - 4..],
            &good[good.len() - 4..],
            "the ICRC is wrong on purpose"
        );
    }

    #[test]
    fn a_time_exceeded_quote_gives_hop_class_and_probe() {
        let dst: IpAddr = "10.0.0.2".parse().unwrap();
        let f = RoceFrame {
            dst,
            udp_sport: 50000,
            dscp: 0,
            ecn: 3,
            ttl: 1,
            dest_qp: PROBE_QP,
            psn: 9,
            payload: vec![0; 4],
            ..Default::default()
        };
        let mut icmp = vec![11, 0, 0, 0, 0, 0, 0, 0];
        icmp.extend_from_slice(&f.ip_packet());
        let a = parse_answer(&icmp, "10.1.1.1".parse().unwrap(), false, 50000, dst).unwrap();
        assert_eq!(
            (a.kind.as_str(), a.final_hop, a.tos >> 2, a.tos & 3, a.psn),
            ("time-exceeded", false, 0, 3, 9)
        );
        // Another flow's error, or a non-probe, is not ours.
        assert!(parse_answer(&icmp, "10.1.1.1".parse().unwrap(), false, 50001, dst).is_none());
        let mut unreachable = vec![3, 3, 0, 0, 0, 0, 0, 0];
        unreachable.extend_from_slice(&f.ip_packet());
        assert!(
            parse_answer(&unreachable, dst, false, 50000, dst)
                .unwrap()
                .final_hop
        );
    }

    /// ICMPv6: time exceeded (type 3) and packet too big (type 2) quote the probe's IPv6
    /// header; a quote cut inside the BTH, or of another destination, is no answer.
    #[test]
    fn an_icmpv6_quote_gives_hop_class_and_probe() {
        let dst: IpAddr = "fd00::2".parse().unwrap();
        let f = RoceFrame {
            src: "fd00::1".parse().unwrap(),
            dst,
            udp_sport: 50000,
            dscp: 26,
            ecn: 2,
            ttl: 1,
            dest_qp: PROBE_QP,
            psn: 7,
            payload: vec![0; 4],
            ..Default::default()
        };
        let quoted = |ty: u8, quote: &[u8]| {
            let mut icmp = vec![ty, 0, 0, 0, 0, 0, 0, 0];
            icmp.extend_from_slice(quote);
            icmp
        };
        let ip = f.ip_packet();
        let from: IpAddr = "fd00::9".parse().unwrap();
        let a = parse_answer(&quoted(3, &ip), from, true, 50000, dst).unwrap();
        assert_eq!(
            (a.kind.as_str(), a.final_hop, a.tos >> 2, a.tos & 3, a.psn),
            ("time-exceeded", false, 26, 2, 7)
        );
        let big = parse_answer(&quoted(2, &ip), from, true, 50000, dst).unwrap();
        assert_eq!((big.kind.as_str(), big.final_hop), ("packet-too-big", true));
        // 40 (IPv6) + 8 (UDP) + 11: one byte short of the BTH.
        assert!(parse_answer(&quoted(3, &ip[..59]), from, true, 50000, dst).is_none());
        let other: IpAddr = "fd00::3".parse().unwrap();
        assert!(parse_answer(&quoted(3, &ip), from, true, 50000, other).is_none());
        // An IPv4 quote in an ICMPv6 message is not ours.
        let v4 = RoceFrame {
            src: "10.0.0.1".parse().unwrap(),
            dst: "10.0.0.2".parse().unwrap(),
            ..f.clone()
        };
        assert!(parse_answer(&quoted(3, &v4.ip_packet()), from, true, 50000, dst).is_none());
    }

    /// A quoted IPv4 header with an IHL below 5 is no header: with IHL 0 the quote's own
    /// IP header was read as the probe's UDP header and BTH.
    #[test]
    fn a_quote_with_an_ihl_below_5_is_not_an_answer() {
        let dst: IpAddr = "10.0.0.2".parse().unwrap();
        // Read from offset 0: source port 0x4000 (version 4, IHL 0, TOS 0), destination
        // port 4791 (the total length), DestQP 0xFFFFFF (the source address' last three
        // bytes), PSN 0x000002 (the destination's).
        let mut quote = vec![0x40, 0, 0x12, 0xb7, 0, 0, 0, 0, 64, 17, 0, 0];
        quote.extend_from_slice(&[10, 0xff, 0xff, 0xff, 10, 0, 0, 2]);
        let mut icmp = vec![11, 0, 0, 0, 0, 0, 0, 0];
        icmp.extend_from_slice(&quote);
        assert!(parse_answer(&icmp, "10.1.1.1".parse().unwrap(), false, 0x4000, dst).is_none());
    }
}
