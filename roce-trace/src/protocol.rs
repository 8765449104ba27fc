//! The agent → collector wire protocol (see PROTOCOL.md): length-delimited binary frames,
//! versioned, sequence-numbered, opened by a handshake that names the node and carries a
//! shared token. Decoding never trusts a length or a count it has not checked.

use bytes::{Buf, BufMut, Bytes, BytesMut};
pub use roce_trace_correlate::report::{ProbeHop, ProbeResult};
use thiserror::Error;

use crate::observation::{
    CounterDelta, FlowId, NicCounter, NicDelta, NicValue, Observation, PacketId, PointDecl, PointHealth,
};
use roce_trace_common::datapath::Counts;

/// 2: points name their node (mirror sessions) and may be declared at any time. 3: the
/// collector acknowledges what it has processed (ACK) and says in WELCOME how much of the
/// node's previous connection it processed, so the agent re-sends exactly the rest. 4: the
/// agent reports each point's health per interval (HEALTH), without which the collector
/// proves no loss, and POINTS carry each point's MTU (declared again when it changes). 6:
/// the collector sends HEARTBEATs too (keepalives both ways), and refuses a second
/// session of a node whose connection is live. 7: NIC frames (a port's NIC and PFC
/// counters per interval). 8: the identity hash's per-packet finish is MurmurHash3's
/// fmix64 (`sampling::identity_finish`), so points of 7 and 8 sample different packets;
/// as with every version, a collector refuses an agent of another (and a fleet member
/// skips its messages), so no join compares two sampling schemes.
pub const VERSION: u16 = 8;
/// Largest frame either side accepts (length field included).
pub const MAX_FRAME: usize = 4 << 20;
/// Now, Unix nanoseconds: the time a HEARTBEAT carries (either way) and agents stamp
/// their health intervals with.
pub fn unix_now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as u64
}

/// A connection's byte stream between an agent and a collector: TCP, or TLS over it.
pub trait Stream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Stream for T {}
pub type StreamReader = tokio::io::ReadHalf<Box<dyn Stream>>;
pub type StreamWriter = tokio::io::WriteHalf<Box<dyn Stream>>;

/// Observations per OBSERVATIONS frame a sender should not exceed.
pub const MAX_BATCH: usize = 4096;

#[derive(Clone, Debug, PartialEq)]
pub enum Frame {
    Hello {
        version: u16,
        node: String,
        token: String,
        clock_synced: bool,
    },
    Welcome {
        version: u16,
        /// This connection's id (never 0).
        connection: u64,
        /// The id of the node's previous connection the collector knows of (0: none) and
        /// how many of its frames it processed: those with a lower sequence number.
        previous: u64,
        previous_frames: u64,
    },
    Points(Vec<PointDecl>),
    Observations(Vec<Observation>),
    Counters(Vec<CounterDelta>),
    Dropped {
        observations: u64,
        counters: u64,
    },
    Heartbeat {
        unix_ns: u64,
    },
    Bye {
        reason: String,
    },
    /// Collector → agent: trace this flow (the agent is on its source host).
    TraceRequest {
        id: u32,
        flow: FlowId,
        dscp: u8,
        ecn: u8,
    },
    /// Agent → collector: the hops of a traced flow.
    TraceResult(ProbeResult),
    /// Collector → agent: every frame of this connection up to sequence number `seq` has
    /// been processed (its observations and counters are in the join).
    Ack {
        seq: u64,
    },
    /// Agent → collector: each point's health over the agent's last interval.
    Health(Vec<PointHealth>),
    /// Agent → collector: its ports' NIC and PFC counters over its last interval.
    Nic(Vec<NicDelta>),
}

/// Why reading a frame failed: the peer broke the protocol, or the connection ended.
#[derive(Debug, Error)]
pub enum ReadError {
    #[error("{0}")]
    Protocol(ProtoError),
    #[error("{0}")]
    Io(std::io::Error),
    #[error("stream ended inside a frame ({0} bytes)")]
    EndedInsideFrame(usize),
}

/// Reads until one whole frame is decoded; `Ok(None)` on a clean end of stream (at a
/// frame boundary). The one reader of frames off a stream, for agents and collectors.
pub async fn read_frame(
    sock: &mut (impl tokio::io::AsyncRead + Unpin),
    buf: &mut BytesMut,
    dec: &mut Decoder,
) -> Result<Option<Frame>, ReadError> {
    use tokio::io::AsyncReadExt as _;
    loop {
        if let Some(f) = dec.decode(buf).map_err(ReadError::Protocol)? {
            return Ok(Some(f));
        }
        let n = sock.read_buf(buf).await.map_err(ReadError::Io)?;
        if n == 0 {
            return if buf.is_empty() {
                Ok(None)
            } else {
                Err(ReadError::EndedInsideFrame(buf.len()))
            };
        }
    }
}

impl Frame {
    /// The frame's type as PROTOCOL.md names it (for logs and errors).
    pub fn name(&self) -> &'static str {
        match self {
            Frame::Hello { .. } => "HELLO",
            Frame::Welcome { .. } => "WELCOME",
            Frame::Points(_) => "POINTS",
            Frame::Observations(_) => "OBSERVATIONS",
            Frame::Counters(_) => "COUNTERS",
            Frame::Dropped { .. } => "DROPPED",
            Frame::Heartbeat { .. } => "HEARTBEAT",
            Frame::Bye { .. } => "BYE",
            Frame::TraceRequest { .. } => "TRACE_REQUEST",
            Frame::TraceResult(_) => "TRACE_RESULT",
            Frame::Ack { .. } => "ACK",
            Frame::Health(_) => "HEALTH",
            Frame::Nic(_) => "NIC",
        }
    }

    /// BYE with `reason`, cut at a character boundary to fit its u16-long string (a
    /// reason quoting a long node name, say).
    pub fn bye(reason: impl Into<String>) -> Self {
        let mut reason = reason.into();
        let mut n = reason.len().min(u16::MAX as usize);
        while !reason.is_char_boundary(n) {
            n -= 1;
        }
        reason.truncate(n);
        Frame::Bye { reason }
    }

    fn kind(&self) -> u8 {
        match self {
            Frame::Hello { .. } => 1,
            Frame::Welcome { .. } => 2,
            Frame::Points(_) => 3,
            Frame::Observations(_) => 4,
            Frame::Counters(_) => 5,
            Frame::Dropped { .. } => 6,
            Frame::Heartbeat { .. } => 7,
            Frame::Bye { .. } => 8,
            Frame::TraceRequest { .. } => 9,
            Frame::TraceResult(_) => 10,
            Frame::Ack { .. } => 11,
            Frame::Health(_) => 12,
            Frame::Nic(_) => 13,
        }
    }
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum ProtoError {
    #[error("frame of {0} bytes exceeds the {1}-byte limit")]
    Oversized(usize, usize),
    #[error("malformed frame: {0}")]
    Malformed(&'static str),
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("frame out of order: sequence {got}, expected {want}")]
    OutOfOrder { got: u64, want: u64 },
    #[error("protocol version {0} is not supported (this side speaks {VERSION})")]
    Version(u16),
    /// The encoder's refusal: a value the wire format cannot carry (a count or string
    /// past its u16 field, a frame past [`MAX_FRAME`], a value that is the field's
    /// "none" marker). Wrapping or truncating it would send something else.
    #[error("cannot encode: {0}")]
    Unrepresentable(&'static str),
}

const OBS_LEN: usize = 2 + 8 + 16 + 16 + 1 + 2 + 4 + 4 + 1 + 4 + 2 + 1 + 1 + 1 + 1 + 2 + 1 + 1 + 1;
const FLOW_LEN: usize = 16 + 16 + 1 + 2 + 4;
const DELTA_LEN: usize = 2 + FLOW_LEN + 8 * 2 + 8 * Counts::LEN + 3;
const HEALTH_LEN: usize = 2 + 8 * 8;
// A full batch of either fits one frame.
const _: () =
    assert!(13 + 4 + MAX_BATCH * OBS_LEN <= MAX_FRAME && 13 + 4 + MAX_BATCH * DELTA_LEN <= MAX_FRAME);

fn put_str(b: &mut BytesMut, s: &str) -> Result<(), ProtoError> {
    let n =
        u16::try_from(s.len()).map_err(|_| ProtoError::Unrepresentable("string longer than 65,535 bytes"))?;
    b.put_u16(n);
    b.put_slice(s.as_bytes());
    Ok(())
}

/// `n` as a u16 count field.
fn count16(n: usize, what: &'static str) -> Result<u16, ProtoError> {
    u16::try_from(n).map_err(|_| ProtoError::Unrepresentable(what))
}

/// Bytes a point takes in a POINTS frame.
fn point_len(p: &PointDecl) -> usize {
    2 + 1 + 4 + 4 + 2 + p.iface.len() + 2 + p.node.len()
}

/// Points in a POINTS frame at most (its count is a u16).
pub const MAX_POINTS: usize = u16::MAX as usize;

/// `points` as POINTS frames that each fit the format: at most [`MAX_POINTS`] and
/// [`MAX_FRAME`] bytes a frame, in order. A point that cannot fit any frame (a string
/// past 65,535 bytes) is left to [`encode`] to refuse, in a frame of its own.
pub fn points_frames(points: &[PointDecl]) -> Vec<Frame> {
    const ROOM: usize = MAX_FRAME - 4 - 9 - 2;
    let mut frames = Vec::new();
    let mut chunk: Vec<PointDecl> = Vec::new();
    let mut size = 0;
    for p in points {
        let n = point_len(p);
        if !chunk.is_empty() && (chunk.len() == MAX_POINTS || size + n > ROOM) {
            frames.push(Frame::Points(std::mem::take(&mut chunk)));
            size = 0;
        }
        chunk.push(p.clone());
        size += n;
    }
    if !chunk.is_empty() || frames.is_empty() {
        frames.push(Frame::Points(chunk));
    }
    frames
}

fn put_flow(b: &mut BytesMut, f: &FlowId) {
    b.put_slice(&f.src);
    b.put_slice(&f.dst);
    b.put_u8(f.ip_version);
    b.put_u16(f.udp_sport);
    b.put_u32(f.dest_qp);
}

/// Encodes `f` as frame number `seq`; refuses what the format cannot carry (see
/// [`ProtoError::Unrepresentable`]) rather than sending something else.
pub fn encode(f: &Frame, seq: u64) -> Result<Bytes, ProtoError> {
    let mut b = BytesMut::with_capacity(64);
    b.put_u32(0); // length, filled in below
    b.put_u8(f.kind());
    b.put_u64(seq);
    match f {
        Frame::Hello {
            version,
            node,
            token,
            clock_synced,
        } => {
            b.put_u16(*version);
            b.put_u8(*clock_synced as u8);
            put_str(&mut b, node)?;
            put_str(&mut b, token)?;
        }
        Frame::Welcome {
            version,
            connection,
            previous,
            previous_frames,
        } => {
            // 0 says "none" in `previous`: a connection with id 0 could never be named there.
            if *connection == 0 {
                return Err(ProtoError::Unrepresentable("connection id 0"));
            }
            b.put_u16(*version);
            b.put_u64(*connection);
            b.put_u64(*previous);
            b.put_u64(*previous_frames);
        }
        Frame::Points(points) => {
            b.put_u16(count16(points.len(), "more than 65,535 points in one frame")?);
            for p in points {
                b.put_u16(p.index);
                b.put_u8(p.direction);
                b.put_u32(p.ifindex);
                b.put_u32(p.mtu);
                put_str(&mut b, &p.iface)?;
                put_str(&mut b, &p.node)?;
            }
        }
        Frame::Observations(obs) => {
            if obs.len() > (MAX_FRAME - 4 - 9 - 4) / OBS_LEN {
                return Err(ProtoError::Unrepresentable("observations past the frame limit"));
            }
            b.reserve(4 + obs.len() * OBS_LEN);
            b.put_u32(obs.len() as u32);
            for o in obs {
                b.put_u16(o.point);
                b.put_u64(o.time_ns);
                put_flow(&mut b, &o.id.flow);
                b.put_u32(o.id.psn);
                b.put_u8(o.id.opcode);
                b.put_slice(&o.id.icrc);
                b.put_u16(o.udp_dport);
                b.put_u8(o.dscp);
                b.put_u8(o.ecn);
                b.put_u8(o.ttl);
                b.put_u8(o.pcp);
                b.put_u16(o.frame_len);
                b.put_u8(o.reasons);
                b.put_u8(o.aeth_syndrome);
                b.put_u8(o.flags);
            }
        }
        Frame::Counters(deltas) => {
            if deltas.len() > (MAX_FRAME - 4 - 9 - 4) / DELTA_LEN {
                return Err(ProtoError::Unrepresentable("counter deltas past the frame limit"));
            }
            b.reserve(4 + deltas.len() * DELTA_LEN);
            b.put_u32(deltas.len() as u32);
            for d in deltas {
                b.put_u16(d.point);
                put_flow(&mut b, &d.flow);
                b.put_u64(d.start_ns);
                b.put_u64(d.end_ns);
                for v in d.counts.values() {
                    b.put_u64(*v);
                }
                b.put_u8(d.last_dscp);
                b.put_u8(d.last_pcp);
                b.put_u8(d.last_ttl);
            }
        }
        Frame::Dropped {
            observations,
            counters,
        } => {
            b.put_u64(*observations);
            b.put_u64(*counters);
        }
        Frame::Heartbeat { unix_ns } => b.put_u64(*unix_ns),
        Frame::Bye { reason } => put_str(&mut b, reason)?,
        Frame::TraceRequest { id, flow, dscp, ecn } => {
            b.put_u32(*id);
            put_flow(&mut b, flow);
            b.put_u8(*dscp);
            b.put_u8(*ecn);
        }
        Frame::TraceResult(r) => {
            b.put_u32(r.id);
            put_flow(&mut b, &r.flow);
            b.put_u8(r.reached as u8);
            // 0 and 255 (u32::MAX for the RTT) say "none": a value equal to one cannot be sent.
            let some = |v: Option<u8>, none: u8, what| match v {
                Some(x) if x == none => Err(ProtoError::Unrepresentable(what)),
                v => Ok(v.unwrap_or(none)),
            };
            b.put_u8(some(r.class_changed_at, 0, "class change at hop 0")?);
            b.put_u16(count16(r.hops.len(), "more than 65,535 hops")?);
            for h in &r.hops {
                b.put_u8(h.ttl);
                let (has, addr) = match h.addr {
                    Some(std::net::IpAddr::V4(a)) => (4u8, a.to_ipv6_mapped().octets()),
                    Some(std::net::IpAddr::V6(a)) => (6, a.octets()),
                    None => (0, [0; 16]),
                };
                b.put_u8(has);
                b.put_slice(&addr);
                b.put_u8(some(h.dscp, 0xff, "DSCP 255")?);
                b.put_u8(some(h.ecn, 0xff, "ECN 255")?);
                if h.rtt_avg_us == Some(u32::MAX) {
                    return Err(ProtoError::Unrepresentable("RTT of u32::MAX µs"));
                }
                b.put_u32(h.rtt_avg_us.unwrap_or(u32::MAX));
            }
        }
        Frame::Ack { seq } => b.put_u64(*seq),
        Frame::Health(v) => {
            if v.len() > (MAX_FRAME - 4 - 9 - 4) / HEALTH_LEN {
                return Err(ProtoError::Unrepresentable("health records past the frame limit"));
            }
            b.reserve(4 + v.len() * HEALTH_LEN);
            b.put_u32(v.len() as u32);
            for h in v {
                b.put_u16(h.point);
                for x in [
                    h.start_ns,
                    h.end_ns,
                    h.ringbuf_full,
                    h.unparsed,
                    h.agent_dropped,
                    h.if_rx_dropped,
                    h.if_tx_dropped,
                    h.qdisc_dropped,
                ] {
                    b.put_u64(x);
                }
            }
        }
        Frame::Nic(ports) => {
            b.put_u16(count16(ports.len(), "more than 65,535 ports")?);
            for p in ports {
                put_str(&mut b, &p.iface)?;
                b.put_u8(p.driver);
                put_str(&mut b, &p.rdma_device)?;
                b.put_u16(count16(p.addrs.len(), "more than 65,535 addresses")?);
                for a in &p.addrs {
                    b.put_slice(a);
                }
                b.put_u64(p.start_ns);
                b.put_u64(p.end_ns);
                b.put_u8(p.epoch_changed as u8);
                b.put_u16(count16(p.values.len(), "more than 65,535 NIC counters")?);
                for v in &p.values {
                    b.put_u8(v.counter.kind);
                    b.put_u8(v.counter.prio);
                    b.put_u64(v.total);
                    b.put_u8(v.delta.is_some() as u8);
                    b.put_u64(v.delta.unwrap_or(0));
                }
                b.put_u16(count16(p.missing.len(), "more than 65,535 missing NIC counters")?);
                for (c, why) in &p.missing {
                    b.put_u8(c.kind);
                    b.put_u8(c.prio);
                    b.put_u8(*why);
                }
            }
        }
    }
    if b.len() > MAX_FRAME {
        return Err(ProtoError::Unrepresentable("frame longer than the 4 MiB limit"));
    }
    let len = (b.len() - 4) as u32;
    b[..4].copy_from_slice(&len.to_be_bytes());
    Ok(b.freeze())
}

/// Reads frames from a byte stream and enforces their order.
pub struct Decoder {
    next_seq: u64,
    /// The largest frame taken ([`MAX_FRAME`], or [`MAX_HELLO`] before a peer is known).
    limit: usize,
}

impl Default for Decoder {
    fn default() -> Self {
        Self {
            next_seq: 0,
            limit: MAX_FRAME,
        }
    }
}

/// The largest HELLO (a node name and a token of the most their u16 lengths carry): what
/// a peer not yet authenticated can make the collector hold.
pub const MAX_HELLO: usize = 4 + 9 + 3 + 2 * (2 + u16::MAX as usize);

fn need(b: &impl Buf, n: usize) -> Result<(), ProtoError> {
    if b.remaining() < n {
        Err(ProtoError::Malformed("body shorter than its fields"))
    } else {
        Ok(())
    }
}

/// A u32 record count, and a body holding exactly that many records of `len` bytes.
fn records(b: &mut Bytes, len: usize, mismatch: &'static str) -> Result<usize, ProtoError> {
    need(b, 4)?;
    let n = b.get_u32() as usize;
    if b.remaining() != n * len {
        return Err(ProtoError::Malformed(mismatch));
    }
    Ok(n)
}

fn get_str(b: &mut Bytes) -> Result<String, ProtoError> {
    need(b, 2)?;
    let n = b.get_u16() as usize;
    need(b, n)?;
    String::from_utf8(b.split_to(n).to_vec()).map_err(|_| ProtoError::Malformed("string is not UTF-8"))
}

fn get_flow(b: &mut Bytes) -> FlowId {
    let mut src = [0; 16];
    let mut dst = [0; 16];
    b.copy_to_slice(&mut src);
    b.copy_to_slice(&mut dst);
    FlowId {
        src,
        dst,
        ip_version: b.get_u8(),
        udp_sport: b.get_u16(),
        dest_qp: b.get_u32(),
    }
}

impl Decoder {
    /// A decoder for a connection's first frame, the HELLO: a length past [`MAX_HELLO`]
    /// is refused before any of it is buffered. [`Decoder::authenticated`] lifts it.
    pub fn handshake() -> Self {
        Self {
            limit: MAX_HELLO,
            ..Self::default()
        }
    }

    /// Frames up to [`MAX_FRAME`] from now on (the peer was authenticated).
    pub fn authenticated(&mut self) {
        self.limit = MAX_FRAME;
    }

    /// The sequence number the next frame must carry: how many frames were decoded.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// The next whole frame in `buf`, if one is there; consumed from `buf`.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Frame>, ProtoError> {
        if buf.len() < 4 {
            return Ok(None);
        }
        let len = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
        if len + 4 > self.limit {
            return Err(ProtoError::Oversized(len + 4, self.limit));
        }
        if len < 9 {
            return Err(ProtoError::Malformed("frame shorter than its header"));
        }
        if buf.len() < 4 + len {
            buf.reserve(4 + len - buf.len());
            return Ok(None);
        }
        buf.advance(4);
        let mut b = buf.split_to(len).freeze();
        let kind = b.get_u8();
        let seq = b.get_u64();
        if seq != self.next_seq {
            return Err(ProtoError::OutOfOrder {
                got: seq,
                want: self.next_seq,
            });
        }
        self.next_seq += 1;
        let f = match kind {
            1 => {
                need(&b, 3)?;
                let version = b.get_u16();
                let clock_synced = b.get_u8() != 0;
                let node = get_str(&mut b)?;
                let token = get_str(&mut b)?;
                Frame::Hello {
                    version,
                    node,
                    token,
                    clock_synced,
                }
            }
            2 => {
                need(&b, 2 + 3 * 8)?;
                let version = b.get_u16();
                let connection = b.get_u64();
                if connection == 0 {
                    return Err(ProtoError::Malformed("WELCOME with connection id 0"));
                }
                Frame::Welcome {
                    version,
                    connection,
                    previous: b.get_u64(),
                    previous_frames: b.get_u64(),
                }
            }
            3 => {
                need(&b, 2)?;
                let n = b.get_u16() as usize;
                let mut v = Vec::with_capacity(n.min(1024));
                for _ in 0..n {
                    need(&b, 11)?;
                    let index = b.get_u16();
                    let direction = b.get_u8();
                    let ifindex = b.get_u32();
                    let mtu = b.get_u32();
                    let iface = get_str(&mut b)?;
                    v.push(PointDecl {
                        index,
                        direction,
                        ifindex,
                        mtu,
                        iface,
                        node: get_str(&mut b)?,
                    });
                }
                Frame::Points(v)
            }
            4 => {
                let n = records(
                    &mut b,
                    OBS_LEN,
                    "observation count does not match the frame length",
                )?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    let point = b.get_u16();
                    let time_ns = b.get_u64();
                    let flow = get_flow(&mut b);
                    let psn = b.get_u32();
                    let opcode = b.get_u8();
                    let mut icrc = [0; 4];
                    b.copy_to_slice(&mut icrc);
                    v.push(Observation {
                        point,
                        time_ns,
                        id: PacketId {
                            flow,
                            psn,
                            opcode,
                            icrc,
                        },
                        udp_dport: b.get_u16(),
                        dscp: b.get_u8(),
                        ecn: b.get_u8(),
                        ttl: b.get_u8(),
                        pcp: b.get_u8(),
                        frame_len: b.get_u16(),
                        reasons: b.get_u8(),
                        aeth_syndrome: b.get_u8(),
                        flags: b.get_u8(),
                    });
                }
                Frame::Observations(v)
            }
            5 => {
                let n = records(&mut b, DELTA_LEN, "counter count does not match the frame length")?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    let point = b.get_u16();
                    let flow = get_flow(&mut b);
                    let (start_ns, end_ns) = (b.get_u64(), b.get_u64());
                    let mut counts = Counts::default();
                    for x in counts.values_mut() {
                        *x = b.get_u64();
                    }
                    v.push(CounterDelta {
                        point,
                        flow,
                        start_ns,
                        end_ns,
                        counts,
                        last_dscp: b.get_u8(),
                        last_pcp: b.get_u8(),
                        last_ttl: b.get_u8(),
                    });
                }
                Frame::Counters(v)
            }
            6 => {
                need(&b, 16)?;
                Frame::Dropped {
                    observations: b.get_u64(),
                    counters: b.get_u64(),
                }
            }
            7 => {
                need(&b, 8)?;
                Frame::Heartbeat { unix_ns: b.get_u64() }
            }
            8 => Frame::Bye {
                reason: get_str(&mut b)?,
            },
            9 => {
                need(&b, 4 + FLOW_LEN + 2)?;
                let id = b.get_u32();
                let flow = get_flow(&mut b);
                Frame::TraceRequest {
                    id,
                    flow,
                    dscp: b.get_u8(),
                    ecn: b.get_u8(),
                }
            }
            10 => {
                need(&b, 4 + FLOW_LEN + 4)?;
                let id = b.get_u32();
                let flow = get_flow(&mut b);
                let reached = b.get_u8() != 0;
                let changed = b.get_u8();
                let n = b.get_u16() as usize;
                if b.remaining() != n * 24 {
                    return Err(ProtoError::Malformed("hop count does not match the frame length"));
                }
                let mut hops = Vec::with_capacity(n);
                for _ in 0..n {
                    let ttl = b.get_u8();
                    let has = b.get_u8();
                    let mut a = [0u8; 16];
                    b.copy_to_slice(&mut a);
                    let addr = match has {
                        4 => Some(std::net::IpAddr::V4(
                            std::net::Ipv6Addr::from(a)
                                .to_ipv4_mapped()
                                .unwrap_or(std::net::Ipv4Addr::UNSPECIFIED),
                        )),
                        6 => Some(std::net::IpAddr::V6(a.into())),
                        _ => None,
                    };
                    let dscp = b.get_u8();
                    let ecn = b.get_u8();
                    let rtt = b.get_u32();
                    hops.push(ProbeHop {
                        ttl,
                        addr,
                        dscp: (dscp != 0xff).then_some(dscp),
                        ecn: (ecn != 0xff).then_some(ecn),
                        rtt_avg_us: (rtt != u32::MAX).then_some(rtt),
                    });
                }
                Frame::TraceResult(ProbeResult {
                    id,
                    flow,
                    reached,
                    class_changed_at: (changed != 0).then_some(changed),
                    hops,
                })
            }
            11 => {
                need(&b, 8)?;
                Frame::Ack { seq: b.get_u64() }
            }
            12 => {
                let n = records(&mut b, HEALTH_LEN, "health count does not match the frame length")?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    let point = b.get_u16();
                    let mut x = [0u64; 8];
                    for y in &mut x {
                        *y = b.get_u64();
                    }
                    v.push(PointHealth {
                        point,
                        start_ns: x[0],
                        end_ns: x[1],
                        ringbuf_full: x[2],
                        unparsed: x[3],
                        agent_dropped: x[4],
                        if_rx_dropped: x[5],
                        if_tx_dropped: x[6],
                        qdisc_dropped: x[7],
                    });
                }
                Frame::Health(v)
            }
            13 => {
                need(&b, 2)?;
                let n = b.get_u16() as usize;
                let mut ports = Vec::with_capacity(n.min(1024));
                for _ in 0..n {
                    let iface = get_str(&mut b)?;
                    need(&b, 1)?;
                    let driver = b.get_u8();
                    let rdma_device = get_str(&mut b)?;
                    need(&b, 2)?;
                    let na = b.get_u16() as usize;
                    need(&b, na * 16)?;
                    let mut addrs = Vec::with_capacity(na);
                    for _ in 0..na {
                        let mut a = [0u8; 16];
                        b.copy_to_slice(&mut a);
                        addrs.push(a);
                    }
                    need(&b, 8 + 8 + 1 + 2)?;
                    let (start_ns, end_ns) = (b.get_u64(), b.get_u64());
                    let epoch_changed = match b.get_u8() {
                        0 => false,
                        1 => true,
                        _ => return Err(ProtoError::Malformed("NIC epoch flag is not 0 or 1")),
                    };
                    let nv = b.get_u16() as usize;
                    need(&b, nv * 19)?;
                    let mut values = Vec::with_capacity(nv);
                    for _ in 0..nv {
                        let counter = NicCounter {
                            kind: b.get_u8(),
                            prio: b.get_u8(),
                        };
                        let total = b.get_u64();
                        let has = b.get_u8();
                        let d = b.get_u64();
                        let delta = match has {
                            0 if d == 0 => None,
                            1 => Some(d),
                            _ => return Err(ProtoError::Malformed("NIC delta flag is not 0 or 1")),
                        };
                        values.push(NicValue {
                            counter,
                            total,
                            delta,
                        });
                    }
                    need(&b, 2)?;
                    let nm = b.get_u16() as usize;
                    need(&b, nm * 3)?;
                    let mut missing = Vec::with_capacity(nm);
                    for _ in 0..nm {
                        let c = NicCounter {
                            kind: b.get_u8(),
                            prio: b.get_u8(),
                        };
                        missing.push((c, b.get_u8()));
                    }
                    ports.push(NicDelta {
                        iface,
                        driver,
                        rdma_device,
                        addrs,
                        start_ns,
                        end_ns,
                        epoch_changed,
                        values,
                        missing,
                    });
                }
                Frame::Nic(ports)
            }
            k => return Err(ProtoError::UnknownKind(k)),
        };
        if b.has_remaining() {
            return Err(ProtoError::Malformed("trailing bytes after the frame's fields"));
        }
        Ok(Some(f))
    }
}

/// Stamps outgoing frames with their sequence numbers.
#[derive(Default)]
pub struct Encoder {
    next_seq: u64,
}

impl Encoder {
    /// The sequence number the next frame encoded gets.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// The next frame; a refused one takes no sequence number.
    pub fn encode(&mut self, f: &Frame) -> Result<Bytes, ProtoError> {
        let b = encode(f, self.next_seq)?;
        self.next_seq += 1;
        Ok(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use roce_trace_common::datapath::DIR_MIRROR;

    fn obs(i: u32) -> Observation {
        Observation {
            point: 3,
            time_ns: 1_700_000_000_000_000_000 + i as u64,
            id: PacketId {
                flow: FlowId {
                    src: [1; 16],
                    dst: [2; 16],
                    ip_version: 6,
                    udp_sport: 49152,
                    dest_qp: 0x101,
                },
                psn: i,
                opcode: 7,
                icrc: [1, 2, 3, 4],
            },
            udp_dport: 4791,
            dscp: 26,
            ecn: 2,
            ttl: 63,
            pcp: 3,
            frame_len: 1090,
            reasons: 1,
            aeth_syndrome: 0,
            flags: 1,
        }
    }

    fn all_frames() -> Vec<Frame> {
        vec![
            Frame::Hello {
                version: VERSION,
                node: "h1".into(),
                token: "s3cret".into(),
                clock_synced: true,
            },
            Frame::Welcome {
                version: VERSION,
                connection: 0x1234_5678_9abc_def0,
                previous: 7,
                previous_frames: 12,
            },
            Frame::Points(vec![
                PointDecl {
                    index: 0,
                    node: String::new(),
                    iface: "eth0".into(),
                    ifindex: 2,
                    mtu: 0,
                    direction: 1,
                },
                PointDecl {
                    index: 1,
                    node: "192.0.2.9".into(),
                    iface: "erspan-7".into(),
                    ifindex: 2,
                    mtu: 0,
                    direction: DIR_MIRROR,
                },
            ]),
            Frame::Observations((0..100).map(obs).collect()),
            Frame::Counters(vec![CounterDelta {
                point: 1,
                start_ns: 4,
                end_ns: 5,
                counts: Counts {
                    packets: 10,
                    ecn: [1, 2, 3, 4],
                    ..Default::default()
                },
                last_pcp: 0xff,
                ..Default::default()
            }]),
            Frame::Dropped {
                observations: 7,
                counters: 1,
            },
            Frame::Heartbeat { unix_ns: 42 },
            Frame::Bye {
                reason: "shutdown".into(),
            },
            Frame::TraceRequest {
                id: 3,
                flow: FlowId {
                    udp_sport: 9,
                    ..Default::default()
                },
                dscp: 26,
                ecn: 2,
            },
            Frame::TraceResult(ProbeResult {
                id: 3,
                flow: FlowId {
                    udp_sport: 9,
                    ..Default::default()
                },
                reached: true,
                class_changed_at: Some(2),
                hops: vec![
                    ProbeHop {
                        ttl: 1,
                        addr: Some("10.0.0.1".parse().unwrap()),
                        dscp: Some(26),
                        ecn: Some(2),
                        rtt_avg_us: Some(90),
                    },
                    ProbeHop {
                        ttl: 2,
                        addr: Some("fd00::1".parse().unwrap()),
                        dscp: Some(0),
                        ecn: Some(2),
                        rtt_avg_us: Some(120),
                    },
                    ProbeHop {
                        ttl: 3,
                        addr: None,
                        dscp: None,
                        ecn: None,
                        rtt_avg_us: None,
                    },
                ],
            }),
            Frame::Ack { seq: u64::MAX - 1 },
            Frame::Health(vec![PointHealth {
                point: 3,
                start_ns: 1,
                end_ns: 2,
                ringbuf_full: 3,
                unparsed: 7,
                agent_dropped: 4,
                if_rx_dropped: 5,
                if_tx_dropped: 6,
                qdisc_dropped: u64::MAX,
            }]),
            Frame::Nic(vec![
                NicDelta {
                    iface: "eth0".into(),
                    driver: 0,
                    rdma_device: "mlx5_0".into(),
                    addrs: vec![
                        [0xfd; 16],
                        std::net::Ipv4Addr::new(10, 0, 0, 1).to_ipv6_mapped().octets(),
                    ],
                    start_ns: 1,
                    end_ns: u64::MAX,
                    epoch_changed: false,
                    values: vec![
                        NicValue {
                            counter: NicCounter { kind: 0, prio: 3 },
                            total: u64::MAX,
                            delta: Some(0),
                        },
                        NicValue {
                            counter: NicCounter {
                                kind: 22,
                                prio: NicCounter::NO_PRIO,
                            },
                            total: 5,
                            delta: None,
                        },
                    ],
                    missing: vec![(NicCounter { kind: 0, prio: 0 }, 4)],
                },
                NicDelta {
                    epoch_changed: true,
                    ..Default::default()
                },
            ]),
        ]
    }

    /// Before a peer is known, a frame longer than the largest HELLO is refused from its
    /// length alone (nothing of it buffered); the largest HELLO is taken; once the peer is
    /// authenticated, frames up to MAX_FRAME are.
    #[test]
    fn an_unauthenticated_peer_cannot_announce_more_than_a_hello() {
        let hello = Frame::Hello {
            version: VERSION,
            node: "n".repeat(u16::MAX as usize),
            token: "t".repeat(u16::MAX as usize),
            clock_synced: true,
        };
        let wire = Encoder::default().encode(&hello).unwrap();
        assert_eq!(wire.len(), MAX_HELLO);
        let mut dec = Decoder::handshake();
        let mut b = BytesMut::from(&wire[..]);
        assert_eq!(dec.decode(&mut b).unwrap(), Some(hello));
        let big = Frame::Observations(vec![Observation::default(); MAX_BATCH]);
        let mut enc = Encoder::default();
        enc.encode(&Frame::Ack { seq: 0 }).unwrap();
        let big = enc.encode(&big).unwrap();
        assert!(big.len() > MAX_HELLO);
        let mut b = BytesMut::from(&big[..4]);
        assert_eq!(
            Decoder::handshake().decode(&mut b),
            Err(ProtoError::Oversized(big.len(), MAX_HELLO))
        );
        dec.authenticated();
        let mut b = BytesMut::from(&big[..]);
        assert!(matches!(dec.decode(&mut b), Ok(Some(Frame::Observations(_)))));
    }

    #[test]
    fn every_frame_round_trips_even_split_into_single_bytes() {
        let frames = all_frames();
        let mut enc = Encoder::default();
        let wire: Vec<u8> = frames
            .iter()
            .flat_map(|f| enc.encode(f).unwrap().to_vec())
            .collect();
        let mut dec = Decoder::default();
        let mut buf = BytesMut::new();
        let mut got = Vec::new();
        for byte in wire {
            buf.put_u8(byte);
            while let Some(f) = dec.decode(&mut buf).unwrap() {
                got.push(f);
            }
        }
        assert_eq!(got, frames);
    }

    /// A NIC frame whose flags are not 0 or 1, or whose counts run past its end, is
    /// refused, never read as something else.
    #[test]
    fn malformed_nic_frames_are_refused() {
        let f = Frame::Nic(vec![NicDelta {
            iface: "e".into(),
            values: vec![NicValue {
                counter: NicCounter { kind: 0, prio: 1 },
                total: 1,
                delta: None,
            }],
            ..Default::default()
        }]);
        let mut enc = Encoder::default();
        enc.encode(&Frame::Ack { seq: 0 }).unwrap();
        let good = enc.encode(&f).unwrap().to_vec();
        let decode = |bytes: Vec<u8>| {
            let mut dec = Decoder::default();
            dec.decode(&mut BytesMut::from(
                &Encoder::default().encode(&Frame::Ack { seq: 0 }).unwrap()[..],
            ))
            .unwrap();
            dec.decode(&mut BytesMut::from(&bytes[..]))
        };
        assert_eq!(decode(good.clone()), Ok(Some(f)));
        // Header 13, then u16 ports, "e" (2+1), driver, "" (2), no address (2), two times,
        // the epoch flag.
        let epoch = 13 + 2 + 3 + 1 + 2 + 2 + 16;
        let mut bad = good.clone();
        bad[epoch] = 2;
        assert!(matches!(decode(bad), Err(ProtoError::Malformed(_))));
        // The delta flag (after kind, prio, total).
        let flag = epoch + 1 + 2 + 2 + 8;
        let mut bad = good.clone();
        bad[flag] = 7;
        assert!(matches!(decode(bad), Err(ProtoError::Malformed(_))));
        // No delta with a value behind it is not "no delta".
        let mut bad = good.clone();
        bad[flag + 8] = 1;
        assert!(matches!(decode(bad), Err(ProtoError::Malformed(_))));
        // A value count past the end of the frame.
        let mut bad = good;
        bad[epoch + 1] = 0x7f;
        assert!(matches!(decode(bad), Err(ProtoError::Malformed(_))));
    }

    #[test]
    fn bad_input_is_refused_with_a_reason() {
        let mut dec = Decoder::default();
        let mut b = BytesMut::from(&[0xff, 0xff, 0xff, 0xff][..]);
        assert!(matches!(dec.decode(&mut b), Err(ProtoError::Oversized(..))));

        let mut dec = Decoder::default();
        let mut b = BytesMut::from(&encode(&Frame::Heartbeat { unix_ns: 1 }, 5).unwrap()[..]);
        assert_eq!(
            dec.decode(&mut b),
            Err(ProtoError::OutOfOrder { got: 5, want: 0 })
        );

        let mut dec = Decoder::default();
        let mut f = encode(&Frame::Observations(vec![obs(1), obs(2)]), 0)
            .unwrap()
            .to_vec();
        f[13] = 3; // claims 3 observations, carries 2
        assert!(matches!(
            dec.decode(&mut BytesMut::from(&f[..])),
            Err(ProtoError::Malformed(_))
        ));

        let mut dec = Decoder::default();
        let mut f = encode(&Frame::Heartbeat { unix_ns: 1 }, 0).unwrap().to_vec();
        f[4] = 99;
        assert_eq!(
            dec.decode(&mut BytesMut::from(&f[..])),
            Err(ProtoError::UnknownKind(99))
        );

        let mut dec = Decoder::default();
        let f = encode(
            &Frame::Hello {
                version: 1,
                node: "n".into(),
                token: "t".into(),
                clock_synced: false,
            },
            0,
        )
        .unwrap();
        let mut cut = f.to_vec();
        cut.truncate(cut.len() - 1);
        let l = (cut.len() - 4) as u32;
        cut[..4].copy_from_slice(&l.to_be_bytes());
        assert!(matches!(
            dec.decode(&mut BytesMut::from(&cut[..])),
            Err(ProtoError::Malformed(_))
        ));

        // A partial frame is not an error: more bytes may come.
        let mut dec = Decoder::default();
        let f = encode(&Frame::Heartbeat { unix_ns: 1 }, 0).unwrap();
        assert_eq!(dec.decode(&mut BytesMut::from(&f[..6])), Ok(None));
    }

    fn mirror_points(n: usize) -> Vec<PointDecl> {
        (0..n)
            .map(|i| PointDecl {
                index: i as u16,
                node: format!("fd00::{:x}", i >> 4),
                iface: format!("erspan-{i}"),
                ifindex: 2,
                mtu: 0,
                direction: DIR_MIRROR,
            })
            .collect()
    }

    /// Found by the `protocol` fuzz harness: 65,536 points (as many as an agent can
    /// declare) wrapped the u16 count to 0, and the collector closed every reconnection
    /// at the trailing bytes.
    #[test]
    fn a_points_frame_of_65536_points_is_refused_not_wrapped() {
        let points = mirror_points(65_536);
        assert_eq!(
            encode(&Frame::Points(points), 0),
            Err(ProtoError::Unrepresentable(
                "more than 65,535 points in one frame"
            ))
        );
        let mut enc = Encoder::default();
        assert!(enc.encode(&Frame::Points(mirror_points(65_536))).is_err());
        // A refused frame takes no sequence number.
        let f = enc.encode(&Frame::Heartbeat { unix_ns: 1 }).unwrap();
        assert_eq!(
            Decoder::default().decode(&mut BytesMut::from(&f[..])),
            Ok(Some(Frame::Heartbeat { unix_ns: 1 }))
        );
    }

    #[test]
    fn points_frames_split_every_point_into_frames_the_collector_takes() {
        let points = mirror_points(65_536);
        let frames = points_frames(&points);
        assert!(frames.len() >= 2, "65,536 points need two frames at least");
        let mut enc = Encoder::default();
        let mut dec = Decoder::default();
        let mut got = Vec::new();
        for f in &frames {
            let wire = enc.encode(f).expect("every frame encodes");
            assert!(wire.len() <= MAX_FRAME);
            match dec.decode(&mut BytesMut::from(&wire[..])) {
                Ok(Some(Frame::Points(p))) => got.extend(p),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(got, points, "every point, in order");
        // Big names: the 4 MiB limit splits before the count does.
        let long: Vec<PointDecl> = mirror_points(300)
            .into_iter()
            .map(|p| PointDecl {
                node: "n".repeat(30_000),
                ..p
            })
            .collect();
        let frames = points_frames(&long);
        assert_eq!(frames.len(), 3);
        for f in &frames {
            assert!(encode(f, 0).unwrap().len() <= MAX_FRAME);
        }
        assert_eq!(points_frames(&[]), vec![Frame::Points(Vec::new())]);
    }

    #[test]
    fn values_the_format_cannot_carry_are_refused() {
        let long = "é".repeat(40_000);
        for f in [
            Frame::Bye { reason: long.clone() },
            Frame::Hello {
                version: VERSION,
                node: long.clone(),
                token: "t".into(),
                clock_synced: false,
            },
            Frame::Observations((0..61_000).map(obs).collect()),
            // 0 is "none" where WELCOME names the previous connection.
            Frame::Welcome {
                version: VERSION,
                connection: 0,
                previous: 0,
                previous_frames: 0,
            },
        ] {
            assert!(matches!(encode(&f, 0), Err(ProtoError::Unrepresentable(_))));
        }
        let r = ProbeResult {
            id: 1,
            flow: FlowId::default(),
            reached: false,
            class_changed_at: None,
            hops: Vec::new(),
        };
        let hop = ProbeHop {
            ttl: 1,
            addr: None,
            dscp: None,
            ecn: None,
            rtt_avg_us: None,
        };
        for bad in [
            ProbeResult {
                class_changed_at: Some(0),
                ..r.clone()
            },
            ProbeResult {
                hops: vec![ProbeHop {
                    dscp: Some(255),
                    ..hop.clone()
                }],
                ..r.clone()
            },
            ProbeResult {
                hops: vec![ProbeHop {
                    rtt_avg_us: Some(u32::MAX),
                    ..hop.clone()
                }],
                ..r.clone()
            },
        ] {
            assert!(encode(&Frame::TraceResult(bad), 0).is_err());
        }
        // BYE cuts its reason instead, at a character boundary.
        let Frame::Bye { reason } = Frame::bye(long.clone()) else {
            unreachable!()
        };
        assert_eq!(reason.len(), 65_534);
        assert!(long.starts_with(&reason));
        let wire = encode(
            &Frame::Bye {
                reason: reason.clone(),
            },
            0,
        )
        .unwrap();
        assert_eq!(
            Decoder::default().decode(&mut BytesMut::from(&wire[..])),
            Ok(Some(Frame::Bye { reason }))
        );
    }

    /// Version 3's frames under the encoder's checks: ACK and WELCOME carry any value but
    /// a connection id of 0 (the "none" of `previous`), which the decoder refuses too; a
    /// refused WELCOME takes no sequence number.
    #[test]
    fn welcome_and_ack_round_trip_and_connection_0_is_refused_both_ways() {
        let mut enc = Encoder::default();
        let zero = Frame::Welcome {
            version: VERSION,
            connection: 0,
            previous: 3,
            previous_frames: 9,
        };
        assert_eq!(
            enc.encode(&zero),
            Err(ProtoError::Unrepresentable("connection id 0"))
        );
        assert_eq!(enc.next_seq(), 0);
        let frames = [
            Frame::Welcome {
                version: VERSION,
                connection: u64::MAX,
                previous: 0,
                previous_frames: 0,
            },
            Frame::Ack { seq: 0 },
            Frame::Ack { seq: u64::MAX },
        ];
        let mut dec = Decoder::default();
        for f in &frames {
            let wire = enc.encode(f).unwrap();
            assert_eq!(dec.decode(&mut BytesMut::from(&wire[..])), Ok(Some(f.clone())));
        }
        assert_eq!((enc.next_seq(), dec.next_seq()), (3, 3));
        // WELCOME naming connection 0, as a peer could send it.
        let mut wire = encode(
            &Frame::Welcome {
                version: VERSION,
                connection: 1,
                previous: 0,
                previous_frames: 0,
            },
            0,
        )
        .unwrap()
        .to_vec();
        wire[13 + 2 + 7] = 0;
        assert_eq!(
            Decoder::default().decode(&mut BytesMut::from(&wire[..])),
            Err(ProtoError::Malformed("WELCOME with connection id 0"))
        );
    }
}
