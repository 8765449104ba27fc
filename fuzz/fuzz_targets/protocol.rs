//! The agent → collector wire protocol (roce-trace/src/protocol.rs).
//!
//! - Arbitrary bytes, fed to one `Decoder` in arbitrary pieces, never panic; every frame
//!   it returns encodes again and decodes to itself.
//! - Frames built from the input (every kind: version 3's WELCOME and ACK, version 4's HEALTH too) encode and
//!   decode to the same frame (version 7's NIC too) — or the encoder refuses them, and then only for what the
//!   format cannot carry (a count or a string past its u16 field, a frame past 4 MiB, a
//!   value that is a field's "none" marker, a WELCOME's connection id 0); a refused frame
//!   takes no sequence number.
#![no_main]

use arbitrary::{Result, Unstructured};
use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use roce_trace::{
    observation::{
        CounterDelta, Counts, FlowId, NicCounter, NicDelta, NicValue, Observation, PacketId, PointDecl,
        PointHealth,
    },
    protocol::{Decoder, Encoder, Frame, MAX_FRAME, ProbeHop, ProbeResult, ProtoError},
};

/// A string, now and then blown up past what a u16 length can say.
fn string(u: &mut Unstructured) -> Result<String> {
    let s: String = u.arbitrary()?;
    Ok(if !s.is_empty() && u.ratio(1, 256)? {
        s.repeat(65_536 / s.len() + u.int_in_range(0..=2)?)
    } else {
        s
    })
}

/// Up to 64 items.
fn some<T>(u: &mut Unstructured, item: impl Fn(&mut Unstructured) -> Result<T>) -> Result<Vec<T>> {
    let mut v = Vec::new();
    while v.len() < 64 && u.arbitrary()? {
        v.push(item(u)?);
    }
    Ok(v)
}

/// Whether this input may build a frame at the edge of a u16 count. Such a frame takes
/// about 100 ms to round-trip, a thousand times an ordinary input: a hash of the input
/// allows it for 1 input in 1024, so mutations of such an input are cheap again 1023
/// times in 1024 and the fuzzer keeps its pace. Deterministic: every finding reproduces.
static EDGE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn edge_allowed(data: &[u8]) -> bool {
    // FNV-1a.
    let h = data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    h % 1024 == 0
}

/// As [`some`], or (see [`edge_allowed`]) a count at the edge of a u16 field, where the
/// encoder used to wrap: copies of `plain`, an item that owns no memory.
fn some_or_edge<T: Clone>(
    u: &mut Unstructured,
    item: impl Fn(&mut Unstructured) -> Result<T>,
    plain: impl Fn(T) -> T,
) -> Result<Vec<T>> {
    let v = some(u, item)?;
    match v.first() {
        Some(x) if EDGE.load(std::sync::atomic::Ordering::Relaxed) && u.arbitrary()? => {
            let n = *u.choose(&[65_535, 65_536])?;
            Ok(vec![plain(x.clone()); n])
        }
        _ => Ok(v),
    }
}

fn flow(u: &mut Unstructured) -> Result<FlowId> {
    Ok(FlowId {
        src: u.arbitrary()?,
        dst: u.arbitrary()?,
        ip_version: u.arbitrary()?,
        udp_sport: u.arbitrary()?,
        dest_qp: u.arbitrary()?,
    })
}

fn point(u: &mut Unstructured) -> Result<PointDecl> {
    Ok(PointDecl {
        index: u.arbitrary()?,
        node: string(u)?,
        iface: string(u)?,
        ifindex: u.arbitrary()?,
        mtu: 0,
        direction: u.arbitrary()?,
    })
}

fn observation(u: &mut Unstructured) -> Result<Observation> {
    Ok(Observation {
        point: u.arbitrary()?,
        time_ns: u.arbitrary()?,
        id: PacketId {
            flow: flow(u)?,
            psn: u.arbitrary()?,
            opcode: u.arbitrary()?,
            icrc: u.arbitrary()?,
        },
        udp_dport: u.arbitrary()?,
        dscp: u.arbitrary()?,
        ecn: u.arbitrary()?,
        ttl: u.arbitrary()?,
        pcp: u.arbitrary()?,
        frame_len: u.arbitrary()?,
        reasons: u.arbitrary()?,
        aeth_syndrome: u.arbitrary()?,
        flags: u.arbitrary()?,
    })
}

fn delta(u: &mut Unstructured) -> Result<CounterDelta> {
    Ok(CounterDelta {
        point: u.arbitrary()?,
        flow: flow(u)?,
        start_ns: u.arbitrary()?,
        end_ns: u.arbitrary()?,
        counts: Counts::from_values(u.arbitrary()?),
        last_dscp: u.arbitrary()?,
        last_pcp: u.arbitrary()?,
        last_ttl: u.arbitrary()?,
    })
}

fn hop(u: &mut Unstructured) -> Result<ProbeHop> {
    Ok(ProbeHop {
        ttl: u.arbitrary()?,
        addr: u.arbitrary()?,
        dscp: u.arbitrary()?,
        ecn: u.arbitrary()?,
        rtt_avg_us: u.arbitrary()?,
    })
}

fn frame(u: &mut Unstructured) -> Result<Frame> {
    Ok(match u.int_in_range(0..=12)? {
        0 => Frame::Hello {
            version: u.arbitrary()?,
            node: string(u)?,
            token: string(u)?,
            clock_synced: u.arbitrary()?,
        },
        // Connection id 0 now and then (a value the encoder must refuse).
        1 => Frame::Welcome {
            version: u.arbitrary()?,
            connection: if u.ratio(1, 16)? { 0 } else { u.arbitrary()? },
            previous: u.arbitrary()?,
            previous_frames: u.arbitrary()?,
        },
        2 => Frame::Points(some_or_edge(u, point, |p| PointDecl {
            node: String::new(),
            iface: String::new(),
            ..p
        })?),
        3 => Frame::Observations(some(u, observation)?),
        4 => Frame::Counters(some(u, delta)?),
        5 => Frame::Dropped {
            observations: u.arbitrary()?,
            counters: u.arbitrary()?,
        },
        6 => Frame::Heartbeat {
            unix_ns: u.arbitrary()?,
        },
        7 => Frame::Bye { reason: string(u)? },
        8 => Frame::TraceRequest {
            id: u.arbitrary()?,
            flow: flow(u)?,
            dscp: u.arbitrary()?,
            ecn: u.arbitrary()?,
        },
        10 => Frame::Ack { seq: u.arbitrary()? },
        11 => Frame::Health(some(u, |u| {
            Ok(PointHealth {
                point: u.arbitrary()?,
                start_ns: u.arbitrary()?,
                end_ns: u.arbitrary()?,
                ringbuf_full: u.arbitrary()?,
                unparsed: u.arbitrary()?,
                agent_dropped: u.arbitrary()?,
                if_rx_dropped: u.arbitrary()?,
                if_tx_dropped: u.arbitrary()?,
                qdisc_dropped: u.arbitrary()?,
            })
        })?),
        12 => Frame::Nic(some(u, |u| {
            let counter = |u: &mut Unstructured| -> Result<NicCounter> {
                Ok(NicCounter {
                    kind: u.arbitrary()?,
                    prio: u.arbitrary()?,
                })
            };
            Ok(NicDelta {
                iface: string(u)?,
                driver: u.arbitrary()?,
                rdma_device: string(u)?,
                addrs: some(u, |u| u.arbitrary())?,
                start_ns: u.arbitrary()?,
                end_ns: u.arbitrary()?,
                epoch_changed: u.arbitrary()?,
                values: some(u, |u| {
                    Ok(NicValue {
                        counter: counter(u)?,
                        total: u.arbitrary()?,
                        delta: u.arbitrary()?,
                    })
                })?,
                missing: some(u, |u| Ok((counter(u)?, u.arbitrary()?)))?,
            })
        })?),
        _ => Frame::TraceResult(ProbeResult {
            id: u.arbitrary()?,
            flow: flow(u)?,
            reached: u.arbitrary()?,
            class_changed_at: u.arbitrary()?,
            hops: some_or_edge(u, hop, |h| h)?,
        }),
    })
}

/// Whether the format can carry `f`; what the encoder must accept exactly.
fn representable(f: &Frame) -> bool {
    let s = |s: &String| s.len() <= u16::MAX as usize;
    let fits = match f {
        Frame::Hello { node, token, .. } => s(node) && s(token),
        Frame::Points(p) => p.len() <= u16::MAX as usize && p.iter().all(|p| s(&p.node) && s(&p.iface)),
        Frame::Bye { reason } => s(reason),
        Frame::Nic(v) => v.iter().all(|p| s(&p.iface) && s(&p.rdma_device)),
        // 0 is "none" where WELCOME names the previous connection.
        Frame::Welcome { connection, .. } => *connection != 0,
        Frame::TraceResult(r) => {
            r.hops.len() <= u16::MAX as usize
                && r.class_changed_at != Some(0)
                && r.hops
                    .iter()
                    .all(|h| h.dscp != Some(0xff) && h.ecn != Some(0xff) && h.rtt_avg_us != Some(u32::MAX))
        }
        _ => true,
    };
    fits && wire_len(f) <= MAX_FRAME
}

/// The encoded length of `f`, from PROTOCOL.md's field sizes.
fn wire_len(f: &Frame) -> usize {
    const FLOW: usize = 39;
    13 + match f {
        Frame::Hello { node, token, .. } => 3 + 2 + node.len() + 2 + token.len(),
        Frame::Welcome { .. } => 2 + 3 * 8,
        Frame::Points(p) => 2 + p.iter().map(|p| 15 + p.node.len() + p.iface.len()).sum::<usize>(),
        Frame::Observations(o) => 4 + 69 * o.len(),
        Frame::Counters(deltas) => 4 + (2 + FLOW + 16 + 8 * Counts::LEN + 3) * deltas.len(),
        Frame::Dropped { .. } => 16,
        Frame::Heartbeat { .. } => 8,
        Frame::Bye { reason } => 2 + reason.len(),
        Frame::TraceRequest { .. } => 4 + FLOW + 2,
        Frame::TraceResult(r) => 4 + FLOW + 4 + 24 * r.hops.len(),
        Frame::Ack { .. } => 8,
        Frame::Health(v) => 4 + 66 * v.len(),
        Frame::Nic(v) => {
            2 + v
                .iter()
                .map(|p| {
                    2 + p.iface.len()
                        + 1
                        + 2
                        + p.rdma_device.len()
                        + 2
                        + 16 * p.addrs.len()
                        + 17
                        + 2
                        + 19 * p.values.len()
                        + 2
                        + 3 * p.missing.len()
                })
                .sum::<usize>()
        }
    }
}

fn decode_all(wire: &[u8], pieces: &[usize]) -> (Vec<Frame>, Option<ProtoError>) {
    let mut dec = Decoder::default();
    let mut buf = BytesMut::new();
    let mut out = Vec::new();
    let mut at = 0;
    let mut cuts = pieces.iter().copied().chain(std::iter::repeat(usize::MAX));
    while at < wire.len() {
        let n = cuts.next().unwrap_or(usize::MAX).clamp(1, wire.len() - at);
        buf.extend_from_slice(&wire[at..at + n]);
        at += n;
        loop {
            match dec.decode(&mut buf) {
                Ok(Some(f)) => out.push(f),
                Ok(None) => break,
                Err(e) => return (out, Some(e)),
            }
        }
    }
    (out, None)
}

fn round_trip(frames: &[Frame]) {
    let mut enc = Encoder::default();
    let mut wire = Vec::new();
    let mut sent = Vec::new();
    for f in frames {
        match enc.encode(f) {
            Ok(b) => {
                assert!(
                    representable(f),
                    "encoded what the format cannot carry: {}",
                    brief(f)
                );
                assert_eq!(b.len(), wire_len(f), "length of {}", brief(f));
                wire.extend_from_slice(&b);
                sent.push(f.clone());
            }
            Err(ProtoError::Unrepresentable(why)) => {
                assert!(
                    !representable(f),
                    "refused ({why}) what the format carries: {}",
                    brief(f)
                )
            }
            Err(e) => panic!("encoding: unexpected {e:?}"),
        }
    }
    // Numbered without gaps (the decoder checks each): a refused frame took no number.
    assert_eq!(
        enc.next_seq(),
        sent.len() as u64,
        "a refused frame took a sequence number"
    );
    let (got, err) = decode_all(&wire, &[1, 7, 4096]);
    assert_eq!(err, None, "decoding what was encoded");
    assert_eq!(got.len(), sent.len(), "frames out as in");
    for (g, s) in got.iter().zip(&sent) {
        assert!(g == s, "round trip changed {}", brief(s));
    }
}

/// A frame's kind and sizes (the frames themselves can be megabytes).
fn brief(f: &Frame) -> String {
    match f {
        Frame::Points(p) => format!("POINTS of {}", p.len()),
        Frame::Observations(o) => format!("OBSERVATIONS of {}", o.len()),
        Frame::Counters(deltas) => format!("COUNTERS of {}", deltas.len()),
        Frame::TraceResult(r) => format!(
            "{:?}",
            ProbeResult {
                hops: r.hops.iter().take(4).cloned().collect(),
                ..r.clone()
            }
        ),
        Frame::Hello { node, token, .. } => format!("HELLO node {} token {} bytes", node.len(), token.len()),
        Frame::Bye { reason } => format!("BYE reason {} bytes", reason.len()),
        f => format!("{f:?}"),
    }
}

// Input: a mode byte, then the bytes. An even mode feeds the bytes to the decoder in
// pieces of `mode / 2 + 1` bytes (seeds: `0x00` and encoded frames); an odd mode builds
// frames from them.
fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode % 2 == 0 {
        let (got, _) = decode_all(rest, &[mode as usize / 2 + 1; 64]);
        // Whatever the decoder accepted, the encoder can send again, unchanged.
        round_trip(&got);
    } else {
        EDGE.store(edge_allowed(data), std::sync::atomic::Ordering::Relaxed);
        let mut u = Unstructured::new(rest);
        let mut frames = Vec::new();
        while frames.len() < 8 {
            match frame(&mut u) {
                // One frame at the edge of a count is enough work for one input.
                Ok(f) if wire_len(&f) > 64 << 10 => {
                    frames.push(f);
                    break;
                }
                Ok(f) => frames.push(f),
                Err(_) => break,
            }
        }
        round_trip(&frames);
    }
});
