//! `roce-trace gen`: RoCEv2 traffic that behaves like RDMA NICs, for hosts without them.
//!
//! A process both sends (RC requesters: WRITE/SEND messages split at the path MTU, paced,
//! DCQCN reaction point, go-back-N on NAK) and responds (ACK on AckReq, NAK on a PSN gap,
//! CNP on CE, as a DCQCN notification point). Packets are UDP datagrams from the kernel's
//! stack with DF set, so they route like any traffic and their ICRC is exact.
//!
//! QP numbering: sender QP `i` has local QPN `qp_base + 2i` and talks to remote QPN
//! `qp_base + 2i + 1`; a responder answers QPN `q` on QPN `q ^ 1`.
//!
//! UDP source ports: as a NIC does, each QP sends everything — requests and its ACKs and
//! NAKs alike — from a port of its own ([`reply_port`] for a responder's QP), so replies
//! spread over ECMP like requests; CNPs leave from one port per address (as ConnectX
//! sends them).

pub mod dcqcn;
pub mod net;
pub mod requester;
pub mod responder;

use std::{
    collections::HashMap,
    io,
    net::{IpAddr, SocketAddr, UdpSocket},
    os::fd::AsRawFd,
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use roce_trace_common::{
    parse::{Packet, SlicePacket},
    roce::{self, AckKind, OP_CNP, op},
    wire::{Aeth, Bth, Header, ICRC_LEN, ROCEV2_UDP_PORT, UdpHdr},
};
use serde::Serialize;
use thiserror::Error;

use crate::frame::{RoceFrame, ext, icrc_finish, icrc_prefix};
use dcqcn::{Dcqcn, DcqcnParams, DcqcnState};
use requester::{AckTimeout, Requester, RequesterStats, Verb};
use responder::{Reply, ResponderQp, ResponderStats};

#[derive(Debug, Error)]
pub enum GenError {
    #[error("invalid option: {0}")]
    Invalid(String),
    /// A size or rate that does not parse (the message quotes it).
    #[error("{0}")]
    Value(String),
    #[error("{what}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> GenError {
    let what = what.into();
    move |source| GenError::Io { what, source }
}

/// Sending rate of each QP.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Rate {
    BitsPerSec(f64),
    PacketsPerSec(f64),
    /// As fast as the host sends (DCQCN then works from a nominal 100 Gbit/s).
    Max,
}

impl std::str::FromStr for Rate {
    type Err = GenError;
    fn from_str(s: &str) -> Result<Self, GenError> {
        let t = s.trim().to_ascii_lowercase();
        if t == "max" {
            return Ok(Rate::Max);
        }
        let split = t
            .find(|c: char| c.is_ascii_alphabetic())
            .ok_or_else(|| GenError::Value(format!("rate `{s}` needs a unit")))?;
        let (num, unit) = t.split_at(split);
        let v: f64 = num
            .parse()
            .map_err(|_| GenError::Value(format!("bad number in rate `{s}`")))?;
        let r = match unit {
            "bit" | "bps" => Rate::BitsPerSec(v),
            "kbit" => Rate::BitsPerSec(v * 1e3),
            "mbit" => Rate::BitsPerSec(v * 1e6),
            "gbit" => Rate::BitsPerSec(v * 1e9),
            "pps" => Rate::PacketsPerSec(v),
            "kpps" => Rate::PacketsPerSec(v * 1e3),
            "mpps" => Rate::PacketsPerSec(v * 1e6),
            _ => {
                return Err(GenError::Value(format!(
                    "unknown rate unit `{unit}` (bit, kbit, mbit, gbit, pps, kpps, mpps, or max)"
                )));
            }
        };
        match r {
            Rate::BitsPerSec(x) | Rate::PacketsPerSec(x) if x <= 0.0 || !x.is_finite() => {
                Err(GenError::Value(format!("rate `{s}` must be positive")))
            }
            r => Ok(r),
        }
    }
}

/// Parses a byte size: `4096`, `64KiB`, `1MiB`, `2k`.
pub fn parse_size(s: &str) -> Result<u32, GenError> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: u64 = num
        .parse()
        .map_err(|_| GenError::Value(format!("bad size `{s}`")))?;
    let mul = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" | "kb" => 1024,
        "m" | "mib" | "mb" => 1024 * 1024,
        _ => {
            return Err(GenError::Value(format!(
                "unknown size unit in `{s}` (B, KiB, MiB)"
            )));
        }
    };
    v.checked_mul(mul)
        .and_then(|v| u32::try_from(v).ok())
        .filter(|&v| v > 0)
        .ok_or_else(|| GenError::Value(format!("size `{s}` out of range")))
}

/// IB path MTUs: what a RoCE NIC can be configured with.
pub const PATH_MTUS: [u32; 5] = [256, 512, 1024, 2048, 4096];

#[derive(Clone, Debug)]
pub struct SenderOptions {
    pub dst: IpAddr,
    pub qps: u32,
    pub verb: Verb,
    pub msg_size: u32,
    pub mtu: u32,
    pub dscp: u8,
    pub ecn: u8,
    pub rate: Rate,
    pub sport_base: u16,
    pub qp_base: u32,
    pub dcqcn: bool,
    /// Packets per sendmmsg.
    pub batch: usize,
    pub tx: TxMode,
    /// Local ACK timeout and retry count of every QP.
    pub ack_timeout: AckTimeout,
    /// Messages per QP: each QP starts this many, then drains; gen ends when all have
    /// (or at --duration, whichever comes first). None: until --duration or Ctrl-C.
    pub messages: Option<u64>,
}

/// How requests leave the host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TxMode {
    /// UDP sockets: routed by the kernel like any traffic.
    Socket,
    /// Raw frames out of one interface to a given next-hop MAC, optionally 802.1Q-tagged.
    Packet {
        iface: String,
        dst_mac: [u8; 6],
        vlan: Option<(u16, u8)>,
    },
}

#[derive(Clone, Debug)]
pub struct GenOptions {
    /// Local addresses: replies and requests arrive on UDP 4791 there.
    pub bind: Vec<IpAddr>,
    pub sender: Option<SenderOptions>,
    pub duration: Option<Duration>,
    pub cnp_dscp: u8,
    pub cnp_interval: Duration,
    /// Class of ACKs and NAKs (DSCP); the ECN bits are ECT(0).
    pub ack_dscp: u8,
}

impl GenOptions {
    pub fn validate(&self) -> Result<(), GenError> {
        let bad = |m: String| Err(GenError::Invalid(m));
        if self.bind.is_empty() {
            return bad("nothing to bind: give --bind ADDR (or --to DST)".into());
        }
        for d in [self.cnp_dscp, self.ack_dscp] {
            if d > 63 {
                return bad(format!("DSCP {d} is out of range 0..=63"));
            }
        }
        if let Some(s) = &self.sender {
            if !PATH_MTUS.contains(&s.mtu) {
                return bad(format!("path MTU {} is not one of {PATH_MTUS:?}", s.mtu));
            }
            if s.qps == 0 || s.qps > 4096 {
                return bad(format!("--qps {} must be 1..=4096", s.qps));
            }
            if s.dscp > 63 || s.ecn > 3 {
                return bad("DSCP must be 0..=63 and ECN 0..=3".into());
            }
            if s.messages == Some(0) {
                return bad("--messages must be at least 1".into());
            }
            if s.ack_timeout.timeout.is_zero() || s.ack_timeout.retries > 7 {
                return bad("--ack-timeout must be positive and --retry-count 0..=7 (RC's 3 bits)".into());
            }
            if s.batch == 0 || s.batch > 1024 {
                return bad("--batch must be 1..=1024".into());
            }
            if !self.bind.iter().any(|b| b.is_ipv4() == s.dst.is_ipv4()) {
                return bad(format!("no --bind address of the same IP version as {}", s.dst));
            }
            if s.qp_base + 2 * s.qps > roce::PSN_MASK {
                return bad("QP numbers exceed 24 bits".into());
            }
            if let TxMode::Packet {
                vlan: Some((vid, pcp)),
                ..
            } = &s.tx
                && (*vid > 4094 || *pcp > 7)
            {
                return bad(format!("VLAN {vid} / PCP {pcp} out of range (1..=4094, 0..=7)"));
            }
        }
        Ok(())
    }
}

/// Builds UDP payloads (BTH … ICRC), or whole frames, for one flow; the ICRC's header
/// part and the headers are cached per datagram length.
pub struct PayloadBuilder {
    template: RoceFrame,
    prefixes: HashMap<u16, (crc32fast::Hasher, Vec<u8>)>,
}

impl PayloadBuilder {
    pub fn new(src: IpAddr, dst: IpAddr, sport: u16, dscp: u8, ecn: u8) -> Self {
        let template = RoceFrame {
            src,
            dst,
            udp_sport: sport,
            udp_dport: ROCEV2_UDP_PORT,
            dscp,
            ecn,
            ..Default::default()
        };
        Self {
            template,
            prefixes: HashMap::new(),
        }
    }

    /// Writes BTH, `ext`, `payload_len` zero bytes, `pad` bytes and the ICRC into `buf`.
    pub fn build(&mut self, bth: &Bth, ext: &[u8], payload_len: usize, pad: u8, buf: &mut Vec<u8>) {
        buf.clear();
        buf.extend_from_slice(bth.as_bytes());
        buf.extend_from_slice(ext);
        buf.resize(buf.len() + payload_len + pad as usize, 0);
        let udp_len = (UdpHdr::LEN + buf.len() + ICRC_LEN) as u16;
        let (prefix, _) = self.headers(udp_len);
        let icrc = icrc_finish(prefix.clone(), buf);
        buf.extend_from_slice(&icrc);
    }

    /// The ICRC a packet of this flow with this UDP payload (up to the ICRC) must carry.
    pub fn icrc_of(&mut self, upto_icrc: &[u8]) -> [u8; 4] {
        let udp_len = (UdpHdr::LEN + upto_icrc.len() + ICRC_LEN) as u16;
        let (prefix, _) = self.headers(udp_len);
        icrc_finish(prefix.clone(), upto_icrc)
    }

    fn headers(&mut self, udp_len: u16) -> &(crc32fast::Hasher, Vec<u8>) {
        let template = &self.template;
        self.prefixes.entry(udp_len).or_insert_with(|| {
            let h = template.ip_udp_headers(udp_len);
            (icrc_prefix(&h), h)
        })
    }

    /// A whole Ethernet frame for the same packet: `l2` (Ethernet header and tags), IP,
    /// UDP (with its checksum on IPv6), then [`Self::build`]'s payload.
    pub fn build_frame(
        &mut self,
        l2: &[u8],
        bth: &Bth,
        ext: &[u8],
        payload_len: usize,
        pad: u8,
        buf: &mut Vec<u8>,
    ) {
        let mut payload = std::mem::take(buf);
        self.build(bth, ext, payload_len, pad, &mut payload);
        let udp_len = (UdpHdr::LEN + payload.len()) as u16;
        let (_, hdrs) = self.headers(udp_len);
        let mut frame = Vec::with_capacity(l2.len() + hdrs.len() + payload.len());
        frame.extend_from_slice(l2);
        frame.extend_from_slice(hdrs);
        let udp_off = frame.len() - UdpHdr::LEN;
        frame.extend_from_slice(&payload);
        if let (IpAddr::V6(s), IpAddr::V6(d)) = (self.template.src, self.template.dst) {
            let c = crate::frame::udp6_checksum(&s, &d, &frame[udp_off..]);
            frame[udp_off + 6..udp_off + 8].copy_from_slice(&c.to_be_bytes());
        }
        *buf = frame;
    }
}

fn bth(opcode: u8, dest_qp: u32, psn: u32, ack_req: bool, pad: u8, becn: bool) -> Bth {
    RoceFrame {
        opcode,
        dest_qp,
        psn,
        ack_req,
        pad_cnt: pad,
        becn,
        ..Default::default()
    }
    .bth()
}

#[derive(Clone, Debug, Serialize)]
pub struct SenderReport {
    pub dst: IpAddr,
    pub qp: u32,
    pub dest_qp: u32,
    pub udp_sport: u16,
    #[serde(flatten)]
    pub stats: RequesterStats,
    /// Packets the local stack refused (socket buffer full); the responder NAKs them.
    pub tx_dropped: u64,
    /// Final DCQCN state (rates in bit/s); null without DCQCN.
    pub dcqcn: Option<DcqcnState>,
    /// Current rate every 100 ms: (milliseconds since start, Gbit/s).
    pub rate_timeline: Vec<(u64, f64)>,
    /// Messages still unacknowledged when gen stopped (after draining: in flight when the
    /// drain gave up, or on a QP in error).
    pub unacked_at_end: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct ResponderReport {
    pub peer: IpAddr,
    pub qp: u32,
    #[serde(flatten)]
    pub stats: ResponderStats,
}

#[derive(Clone, Debug, Serialize)]
pub struct GenReport {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub duration_s: f64,
    /// Of it, the time after --duration spent finishing started messages and waiting for
    /// their acknowledgements (no new messages are started then).
    pub drain_s: f64,
    pub senders: Vec<SenderReport>,
    pub responders: Vec<ResponderReport>,
    /// Requests dropped for a bad ICRC, as a RoCE NIC drops them (probes among them).
    pub icrc_errors: u64,
    /// Replies that could not be sent (a peer address with no route, one that refuses,
    /// no socket left for a new QP) and requests of QPs past [`MAX_RESPONDER_QPS`], left
    /// unanswered. A request (spoofed, say) never stops the responder.
    pub unanswered: u64,
}

/// Responder QPs (peer address, QPN) answered at most: each holds a reply socket. Past
/// it, requests of new QPs are counted unanswered.
pub const MAX_RESPONDER_QPS: usize = 4096;

struct SenderQp {
    req: Requester,
    dcqcn: Dcqcn,
    builder: PayloadBuilder,
    /// Sends in socket mode; in packet mode it only holds the source port.
    sock: UdpSocket,
    next_send: Duration,
    report: SenderReport,
}

/// The UDP source port a responder's QP `qpn` sends its ACKs and NAKs from: 0xC000 plus
/// the QPN's low 14 bits, so each QP is a flow of its own and runs are repeatable (the
/// Huawei capture in ../shared shows a NIC using the QPN itself).
pub fn reply_port(qpn: u32) -> u16 {
    0xC000 | (qpn & 0x3fff) as u16
}

struct Rx {
    sock: UdpSocket,
    /// Per responder QP (peer, QPN answered): the socket its ACKs and NAKs leave from.
    reply_socks: HashMap<(IpAddr, u32), (UdpSocket, u16)>,
    /// CNPs leave from their own port, as NICs send them apart from ACKs (ConnectX uses
    /// source port 0), so they form a flow of their own.
    cnp_sock: UdpSocket,
    cnp_sport: u16,
    local: IpAddr,
    /// Per (peer, source port).
    builders: HashMap<(IpAddr, u16), PayloadBuilder>,
    cnp_builders: HashMap<(IpAddr, u16), PayloadBuilder>,
    /// ICRC checkers for arriving requests, per (peer, source port).
    checkers: HashMap<(IpAddr, u16), PayloadBuilder>,
    icrc_errors: u64,
    unanswered: u64,
}

/// The first PSN of QP `qpn`.
pub fn initial_psn(qpn: u32) -> u32 {
    qpn.wrapping_mul(0x9e37_79b1).rotate_left(7) & roce::PSN_MASK
}

/// Wire bytes of a datagram with `udp_payload` bytes (Ethernet, IP, UDP headers, FCS).
fn wire_bytes(udp_payload: usize, v6: bool) -> f64 {
    (udp_payload + UdpHdr::LEN + if v6 { 40 } else { 20 } + 14 + 4) as f64
}

/// Runs until `duration` passes or `stop` is set.
pub fn run(opts: &GenOptions, stop: &AtomicBool) -> Result<GenReport, GenError> {
    opts.validate()?;
    let started = Instant::now();
    let ack_tos = (opts.ack_dscp << 2) | 0b10;
    let cnp_tos = (opts.cnp_dscp << 2) | 0b10;

    let mut qps: Vec<SenderQp> = Vec::new();
    let mut rate_bps = 0.0;
    // Packet mode: the raw socket and the Ethernet header (with its tag) every frame starts with.
    let mut packet_tx: Option<(net::PacketTx, Vec<u8>)> = None;
    if let Some(SenderOptions {
        tx: TxMode::Packet { iface, dst_mac, vlan },
        dst,
        ..
    }) = &opts.sender
    {
        let ifindex = net::ifindex(iface)
            .ok_or_else(|| GenError::Invalid(format!("unknown interface `{iface}` (see `ip link`)")))?;
        let src_mac = net::mac_of(iface).map_err(io_err(format!("reading the MAC of {iface}")))?;
        let tags: Vec<(u16, u16)> = vlan
            .iter()
            .map(|&(vid, pcp)| (roce_trace_common::wire::ETH_P_8021Q, (pcp as u16) << 13 | vid))
            .collect();
        let ethertype = if dst.is_ipv4() {
            roce_trace_common::wire::ETH_P_IPV4
        } else {
            roce_trace_common::wire::ETH_P_IPV6
        };
        let mut l2 = crate::frame::ethernet(*dst_mac, src_mac, &tags, ethertype, &[]);
        l2.truncate(14 + 4 * tags.len());
        let tx =
            net::PacketTx::open(ifindex).map_err(io_err(format!("opening a packet socket on {iface}")))?;
        packet_tx = Some((tx, l2));
    }
    if let Some(s) = &opts.sender {
        let src = *opts
            .bind
            .iter()
            .find(|b| b.is_ipv4() == s.dst.is_ipv4())
            .expect("validated");
        let full = wire_bytes(Bth::LEN + s.mtu as usize + ICRC_LEN, s.dst.is_ipv6());
        rate_bps = match s.rate {
            Rate::BitsPerSec(b) => b,
            Rate::PacketsPerSec(p) => p * full * 8.0,
            Rate::Max => 0.0,
        };
        let line = if rate_bps > 0.0 { rate_bps } else { 100e9 };
        for i in 0..s.qps {
            let sport = s
                .sport_base
                .checked_add(i as u16)
                .ok_or_else(|| GenError::Invalid("UDP source ports overflow".into()))?;
            let tos = (s.dscp << 2) | s.ecn;
            let sock = net::bind_sender(SocketAddr::new(src, sport), tos)
                .map_err(io_err(format!("binding {src} UDP {sport}")))?;
            let qp = s.qp_base + 2 * i;
            qps.push(SenderQp {
                // NICs start each QP at a random PSN; a fixed scramble of the QPN keeps
                // runs repeatable (and lets the collector tell QPs apart by PSN).
                req: Requester::new(s.verb, s.msg_size, s.mtu, initial_psn(qp)),
                dcqcn: Dcqcn::new(DcqcnParams::for_line_rate(line), Duration::ZERO),
                builder: PayloadBuilder::new(src, s.dst, sport, s.dscp, s.ecn),
                sock,
                next_send: Duration::ZERO,
                report: SenderReport {
                    dst: s.dst,
                    qp,
                    dest_qp: qp + 1,
                    udp_sport: sport,
                    stats: RequesterStats::default(),
                    tx_dropped: 0,
                    dcqcn: None,
                    rate_timeline: Vec::new(),
                    unacked_at_end: 0,
                },
            });
        }
    }
    // The receivers bind after the senders: the CNP socket takes any free port, which
    // must not be a sender's source port (they lie in the kernel's ephemeral range).
    let mut rxs: Vec<Rx> = opts
        .bind
        .iter()
        .map(|&ip| {
            let sock = net::bind(SocketAddr::new(ip, ROCEV2_UDP_PORT), ack_tos)
                .map_err(io_err(format!("binding {ip} UDP {ROCEV2_UDP_PORT}")))?;
            let cnp_sock = net::bind(SocketAddr::new(ip, 0), cnp_tos)
                .map_err(io_err(format!("binding {ip} for CNPs")))?;
            let cnp_sport = cnp_sock
                .local_addr()
                .map_err(io_err("CNP socket address"))?
                .port();
            Ok(Rx {
                sock,
                reply_socks: HashMap::new(),
                cnp_sock,
                cnp_sport,
                local: ip,
                builders: HashMap::new(),
                cnp_builders: HashMap::new(),
                checkers: HashMap::new(),
                icrc_errors: 0,
                unanswered: 0,
            })
        })
        .collect::<Result<_, GenError>>()?;
    let sender = opts.sender.clone();
    let mut responders: HashMap<(IpAddr, u32), ResponderQp> = HashMap::new();
    let mut bufs: Vec<Vec<u8>> = (0..sender.as_ref().map_or(1, |s| s.batch))
        .map(|_| Vec::with_capacity(4200))
        .collect();
    let mut rbufs: Vec<Vec<u8>> = (0..64).map(|_| vec![0; net::MAX_DATAGRAM]).collect();
    let mut dgrams = Vec::new();
    let mut reply = Vec::with_capacity(64);
    let mut next_timeline = Duration::ZERO;
    // After --duration a sender drains: it starts no new message, finishes the ones
    // started and waits for their acknowledgements (retransmitting on NAK or timeout),
    // for at most every retry's timeout and a little more. A responder-only gen stops.
    let drain_limit = sender.as_ref().map_or(Duration::ZERO, |s| {
        s.ack_timeout.timeout * (s.ack_timeout.retries + 2) + Duration::from_millis(100)
    });
    let mut drain_since: Option<Duration> = None;

    loop {
        let now = started.elapsed();
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let quota_done = |q: &SenderQp| {
            sender
                .as_ref()
                .and_then(|s| s.messages)
                .is_some_and(|m| q.req.stats.messages_sent >= m)
        };
        if drain_since.is_none()
            && (opts.duration.is_some_and(|d| now >= d) || (!qps.is_empty() && qps.iter().all(quota_done)))
        {
            drain_since = Some(now);
        }
        if let Some(since) = drain_since {
            let settled = qps
                .iter()
                .all(|q| !q.req.usable() || (q.req.unacked() == 0 && !q.req.mid_message()));
            if settled || now >= since + drain_limit {
                break;
            }
        }
        // Receive: requests (answer them), ACK/NAK/CNP (feed the requesters).
        for rx in &mut rxs {
            loop {
                let n = net::recv_batch(&rx.sock, &mut rbufs, &mut dgrams).map_err(io_err("receiving"))?;
                for (d, buf) in dgrams.iter().zip(&rbufs) {
                    handle(
                        &buf[..d.len],
                        d,
                        started,
                        opts,
                        rx,
                        &mut responders,
                        &mut qps,
                        sender.as_ref(),
                        &mut reply,
                        ack_tos,
                        cnp_tos,
                    )?;
                }
                if n < rbufs.len() {
                    break;
                }
            }
        }
        // Send what is due on each QP.
        let mut soonest: Option<Duration> = None;
        if let Some(s) = &sender {
            let dst = SocketAddr::new(s.dst, ROCEV2_UDP_PORT);
            for q in &mut qps {
                if s.dcqcn {
                    q.dcqcn.tick(now);
                }
                q.req.check_timeout(now, s.ack_timeout);
                // Never burst to catch up more than a millisecond of lateness.
                if q.next_send + Duration::from_millis(1) < now {
                    q.next_send = now;
                }
                let mut k = 0;
                while k < bufs.len()
                    && (rate_bps == 0.0 || q.next_send <= now)
                    && q.req.usable()
                    && ((drain_since.is_none() && !quota_done(q)) || q.req.mid_message())
                {
                    let plan = q.req.next_packet();
                    let ext = plan
                        .reth_len
                        .map(|l| ext::reth(0x1000, 0x1234, l))
                        .unwrap_or_default();
                    let b = bth(
                        plan.opcode,
                        q.report.dest_qp,
                        plan.psn,
                        plan.ack_req,
                        plan.pad,
                        false,
                    );
                    let len = plan.payload_len as usize;
                    let bits = match &packet_tx {
                        Some((_, l2)) => {
                            q.builder.build_frame(l2, &b, &ext, len, plan.pad, &mut bufs[k]);
                            (bufs[k].len() + 4) as f64 * 8.0
                        }
                        None => {
                            q.builder.build(&b, &ext, len, plan.pad, &mut bufs[k]);
                            wire_bytes(bufs[k].len(), s.dst.is_ipv6()) * 8.0
                        }
                    };
                    if rate_bps > 0.0 {
                        let rate = if s.dcqcn { q.dcqcn.rate() } else { rate_bps };
                        q.next_send += Duration::from_secs_f64(bits / rate);
                    }
                    k += 1;
                }
                if k > 0 {
                    let sent = match &packet_tx {
                        Some((tx, _)) => tx.send_batch(&bufs[..k]),
                        None => net::send_batch(&q.sock, &dst, &bufs[..k]),
                    }
                    .map_err(io_err(format!("sending to {dst}")))?;
                    q.report.tx_dropped += (k - sent) as u64;
                }
                soonest = Some(soonest.map_or(q.next_send, |t: Duration| t.min(q.next_send)));
            }
            if now >= next_timeline {
                for q in &mut qps {
                    let r = if s.dcqcn { q.dcqcn.rate() } else { rate_bps };
                    q.report.rate_timeline.push((now.as_millis() as u64, r / 1e9));
                }
                next_timeline += Duration::from_millis(100);
            }
        }
        // Wait for replies or the next send time.
        let wait = match (soonest, rate_bps > 0.0 || sender.is_none()) {
            // Draining sends only what is due again: wait for replies.
            _ if drain_since.is_some() => Duration::from_millis(1),
            (_, false) => Duration::ZERO,
            (Some(t), true) => t.saturating_sub(started.elapsed()).min(Duration::from_millis(10)),
            (None, true) => Duration::from_millis(10),
        };
        if wait >= Duration::from_micros(50) {
            poll_readable(&rxs, wait);
        }
    }

    let duration_s = started.elapsed().as_secs_f64();
    let senders = qps
        .into_iter()
        .map(|q| {
            let mut r = q.report;
            r.stats = q.req.stats;
            r.unacked_at_end = q.req.unacked() as u64;
            r.dcqcn = sender
                .as_ref()
                .is_some_and(|s| s.dcqcn && rate_bps > 0.0)
                .then(|| q.dcqcn.state());
            r
        })
        .collect();
    let mut responders: Vec<ResponderReport> = responders
        .into_iter()
        .map(|((peer, qp), r)| ResponderReport {
            peer,
            qp,
            stats: r.stats,
        })
        .collect();
    responders.sort_by_key(|r| (r.peer, r.qp));
    Ok(GenReport {
        kind: "gen",
        duration_s,
        drain_s: drain_since.map_or(0.0, |d| duration_s - d.as_secs_f64()),
        senders,
        responders,
        icrc_errors: rxs.iter().map(|r| r.icrc_errors).sum(),
        unanswered: rxs.iter().map(|r| r.unanswered).sum(),
    })
}

/// The report as a network engineer reads it.
pub fn render_report(r: &GenReport) -> String {
    let mut s = format!(
        "gen ran {:.1}s ({:.2}s of it draining); {} requests dropped for a bad ICRC, {} unanswered\n",
        r.duration_s, r.drain_s, r.icrc_errors, r.unanswered
    );
    if !r.senders.is_empty() {
        s.push_str(&format!(
            "{:<39} {:>8} {:>6} {:>10} {:>12} {:>7} {:>7} {:>8} {:>8} {:>5} {:>6} {:>6} {:>6} {:>9} {:>9}\n",
            "SENT TO",
            "QP",
            "SPORT",
            "PACKETS",
            "BYTES",
            "RETX",
            "TXDROP",
            "MSGS",
            "MSGS OK",
            "T/O",
            "ACKS",
            "NAKS",
            "CNPS",
            "MIN GB/S",
            "END GB/S"
        ));
        for q in &r.senders {
            let (min, end) = q.dcqcn.map_or((f64::NAN, f64::NAN), |d| {
                (d.min_rate_seen / 1e9, d.current_rate / 1e9)
            });
            s.push_str(&format!(
                "{:<39} {:>#8x} {:>6} {:>10} {:>12} {:>7} {:>7} {:>8} {:>8} {:>5} {:>6} {:>6} {:>6} {:>9.3} {:>9.3}{}\n",
                q.dst.to_string(),
                q.qp,
                q.udp_sport,
                q.stats.packets,
                q.stats.bytes,
                q.stats.retransmitted,
                q.tx_dropped,
                q.stats.messages_sent,
                q.stats.messages_acked,
                q.stats.timeouts,
                q.stats.acks,
                q.stats.naks_psn_seq_err + q.stats.naks_other,
                q.stats.cnps,
                min,
                end,
                if q.stats.retry_exceeded {
                    "  retry exceeded: QP in error"
                } else {
                    ""
                }
            ));
        }
    }
    if !r.responders.is_empty() {
        s.push_str(&format!(
            "{:<39} {:>8} {:>10} {:>9} {:>6} {:>7} {:>8} {:>7} {:>6} {:>6}\n",
            "ANSWERED", "QP", "PACKETS", "IN ORDER", "DUPS", "OUT SEQ", "CE", "ACKS", "NAKS", "CNPS"
        ));
        for q in &r.responders {
            s.push_str(&format!(
                "{:<39} {:>#8x} {:>10} {:>9} {:>6} {:>7} {:>8} {:>7} {:>6} {:>6}\n",
                q.peer.to_string(),
                q.qp,
                q.stats.packets,
                q.stats.in_order,
                q.stats.duplicates,
                q.stats.out_of_sequence,
                q.stats.ce_marked,
                q.stats.acks_sent,
                q.stats.naks_sent,
                q.stats.cnps_sent
            ));
        }
    }
    s
}

fn poll_readable(rxs: &[Rx], wait: Duration) {
    let mut fds: Vec<libc::pollfd> = rxs
        .iter()
        .map(|r| libc::pollfd {
            fd: r.sock.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    // SAFETY: fds is a valid array of pollfd for the call.
    unsafe {
        libc::poll(
            fds.as_mut_ptr(),
            fds.len() as libc::nfds_t,
            wait.as_millis().max(1) as i32,
        )
    };
}

#[expect(clippy::too_many_arguments, reason = "the loop's state, passed explicitly")]
fn handle(
    payload: &[u8],
    d: &net::Datagram,
    started: Instant,
    opts: &GenOptions,
    rx: &mut Rx,
    responders: &mut HashMap<(IpAddr, u32), ResponderQp>,
    qps: &mut [SenderQp],
    sender: Option<&SenderOptions>,
    reply: &mut Vec<u8>,
    ack_tos: u8,
    cnp_tos: u8,
) -> Result<(), GenError> {
    let view = SlicePacket::new(payload);
    let Some(b) = view.header::<Bth>(0) else {
        return Ok(()); // not RoCE: ignored
    };
    // The time of this packet, not of the loop's start: a CNP interval is judged by when
    // each CNP leaves, however long a batch of arrivals takes.
    let now = started.elapsed();
    let opcode = b.opcode;
    let qpn = b.dest_qp();
    let peer = d.from.ip();
    if roce::is_request(opcode) {
        // A NIC drops a request whose ICRC is wrong before any QP sees it.
        let n = payload.len();
        // One checker per (peer, port) kept, as many as there are QPs at most; past that
        // a checker is made for this request alone.
        let key = (peer, d.from.port());
        let mut once = None;
        let checker = if rx.checkers.contains_key(&key) || rx.checkers.len() < MAX_RESPONDER_QPS {
            rx.checkers
                .entry(key)
                .or_insert_with(|| PayloadBuilder::new(peer, rx.local, d.from.port(), 0, 0))
        } else {
            once.insert(PayloadBuilder::new(peer, rx.local, d.from.port(), 0, 0))
        };
        if n < Bth::LEN + ICRC_LEN || checker.icrc_of(&payload[..n - ICRC_LEN]) != payload[n - ICRC_LEN..] {
            rx.icrc_errors += 1;
            return Ok(());
        }
        if !responders.contains_key(&(peer, qpn)) && responders.len() >= MAX_RESPONDER_QPS {
            rx.unanswered += 1;
            return Ok(());
        }
        let ce = d.tos & 3 == 3;
        let r = responders.entry((peer, qpn)).or_default();
        let replies = r.on_request(opcode, b.psn(), b.ack_req(), ce, now, opts.cnp_interval);
        let dst = SocketAddr::new(peer, ROCEV2_UDP_PORT);
        if !replies.is_empty() && !rx.reply_socks.contains_key(&(peer, qpn)) {
            // The responder QP's own port; when it is taken (another program, or one of
            // our senders), any free port still makes the QP a flow of its own.
            let port = reply_port(qpn);
            let sock = net::bind_sender(SocketAddr::new(rx.local, port), ack_tos)
                .or_else(|_| net::bind(SocketAddr::new(rx.local, 0), ack_tos))
                .and_then(|sock| Ok((sock.local_addr()?.port(), sock)));
            match sock {
                Ok((port, sock)) => {
                    rx.reply_socks.insert((peer, qpn), (sock, port));
                }
                Err(e) => {
                    // Out of descriptors or ports: this QP goes unanswered, the rest go on.
                    if rx.unanswered == 0 {
                        eprintln!("gen: no reply socket for {peer} QP {qpn:#x} on {}: {e}", rx.local);
                    }
                    rx.unanswered += 1;
                    return Ok(());
                }
            }
        }
        for rep in replies {
            let (tos, builder_map, sport, sock) = match rep {
                Reply::Cnp => (cnp_tos, &mut rx.cnp_builders, rx.cnp_sport, &rx.cnp_sock),
                _ => {
                    let (sock, port) = &rx.reply_socks[&(peer, qpn)];
                    (ack_tos, &mut rx.builders, *port, sock)
                }
            };
            let key = (peer, sport);
            let builder = builder_map
                .entry(key)
                .or_insert_with(|| PayloadBuilder::new(rx.local, peer, sport, tos >> 2, tos & 3));
            match rep {
                Reply::Ack { psn, msn } => builder.build(
                    &bth(op::ACKNOWLEDGE, qpn ^ 1, psn, false, 0, false),
                    &ext::aeth(0x1f, msn),
                    0,
                    0,
                    reply,
                ),
                Reply::NakPsnSeqErr { psn, msn } => builder.build(
                    &bth(op::ACKNOWLEDGE, qpn ^ 1, psn, false, 0, false),
                    &ext::aeth(roce::SYNDROME_NAK_PSN_SEQ_ERR, msn),
                    0,
                    0,
                    reply,
                ),
                Reply::Cnp => {
                    builder.build(&bth(OP_CNP, qpn ^ 1, 0, false, 0, true), &ext::cnp(), 0, 0, reply)
                }
            }
            if let Err(e) = net::send_with_tos(sock, &dst, tos, reply) {
                // A full socket buffer loses a reply, as a congested NIC would; a peer
                // that cannot be replied to (no route, refused: a spoofed source) is
                // counted and the responder goes on.
                if e.kind() != io::ErrorKind::WouldBlock {
                    if rx.unanswered == 0 {
                        eprintln!("gen: cannot reply to {dst}: {e}");
                    }
                    rx.unanswered += 1;
                }
            }
        }
        return Ok(());
    }
    let Some(s) = sender else { return Ok(()) };
    if qpn < s.qp_base || (qpn - s.qp_base) % 2 != 0 || (qpn - s.qp_base) / 2 >= s.qps {
        return Ok(()); // not one of our QPs
    }
    let q = &mut qps[((qpn - s.qp_base) / 2) as usize];
    if opcode == OP_CNP {
        q.req.stats.cnps += 1;
        if s.dcqcn {
            q.dcqcn.on_cnp(now);
        }
    } else if roce::is_ack_opcode(opcode) {
        let Some(aeth) = view.header::<Aeth>(Bth::LEN) else {
            return Ok(());
        };
        match roce::ack_kind(aeth.syndrome) {
            AckKind::Ack => q.req.on_ack(b.psn()),
            AckKind::NakPsnSeqErr => q.req.on_nak_psn_seq_err(b.psn()),
            AckKind::RnrNak | AckKind::NakOther => q.req.on_nak_other(),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_and_sizes_parse() {
        assert_eq!("10gbit".parse::<Rate>().unwrap(), Rate::BitsPerSec(10e9));
        assert_eq!("250Mbit".parse::<Rate>().unwrap(), Rate::BitsPerSec(250e6));
        assert_eq!("100kpps".parse::<Rate>().unwrap(), Rate::PacketsPerSec(1e5));
        assert_eq!("max".parse::<Rate>().unwrap(), Rate::Max);
        let err = |r: Result<Rate, GenError>| r.unwrap_err().to_string();
        assert!(err("10".parse()).contains("needs a unit"));
        assert!(err("10furlongs".parse()).contains("unknown rate unit"));
        assert!("0gbit".parse::<Rate>().is_err());
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("64KiB").unwrap(), 65536);
        assert_eq!(parse_size("1MiB").unwrap(), 1 << 20);
        assert!(parse_size("1TiB").is_err());
        // Past u64 once scaled: refused, not an overflow.
        assert!(parse_size("18446744073709551615MiB").is_err());
        assert!(parse_size("0").is_err());
    }

    #[test]
    fn payloads_carry_the_icrc_of_the_packet_the_kernel_sends() {
        let src: IpAddr = "10.0.0.1".parse().unwrap();
        let dst: IpAddr = "10.0.0.2".parse().unwrap();
        let mut b = PayloadBuilder::new(src, dst, 49152, 26, 2);
        let mut buf = Vec::new();
        let h = bth(op::WRITE_FIRST, 0x101, 7, false, 0, false);
        let reth = ext::reth(0x1000, 0x1234, 4096);
        b.build(&h, &reth, 1024, 0, &mut buf);
        let want = RoceFrame {
            src,
            dst,
            udp_sport: 49152,
            opcode: op::WRITE_FIRST,
            dest_qp: 0x101,
            psn: 7,
            ext: reth,
            payload: vec![0; 1024],
            ..Default::default()
        }
        .ip_packet();
        assert_eq!(
            &buf[..],
            &want[28..],
            "same bytes as the frame builder, ICRC included"
        );
    }
}
