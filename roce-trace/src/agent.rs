//! `roce-trace agent`: the datapath as `capture` runs it, streaming sampled observations
//! and per-flow counter deltas to a collector. The datapath never waits for the network:
//! a bounded queue sits between them, and what overflows it is counted and reported.

use crate::observation::{FlowId, PointHealth};
use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    future::Future,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::Context as _;
use bytes::BytesMut;
use roce_trace_common::datapath::*;
use serde::Serialize;
use tokio::{io::AsyncWriteExt, net::TcpStream, sync::Notify};

use crate::{
    datapath::{Attachment, Datapath, DatapathOptions, IngressHook},
    http::{self, Response},
    observation::{CounterDelta, Observation, PointDecl, PointTable},
    protocol::{
        Decoder, Encoder, Frame, ProtoError, ReadError, Stream, StreamReader, StreamWriter, VERSION,
        points_frames, read_frame,
    },
    record::{ECN_NAMES, direction_name},
    sys::KernelClock,
};

#[derive(Clone, Debug)]
pub struct AgentOptions {
    /// host:port of the collector.
    pub collector: String,
    pub ifaces: Vec<String>,
    /// The hook that observes arriving packets; None: ingress is not observed.
    pub ingress: Option<IngressHook>,
    pub egress: bool,
    pub node: String,
    /// The shared token (empty: none; then `tls` is required).
    pub token: String,
    /// Mutual TLS to the collector: the client configuration (the CA that signed the
    /// collector's certificate, this node's certificate) and the name the collector's
    /// certificate must carry.
    pub tls: Option<(Arc<rustls::ClientConfig>, rustls_pki_types::ServerName<'static>)>,
    pub datapath: DatapathOptions,
    /// Counter deltas are sent this often.
    pub interval: Duration,
    /// Observations (and, separately, counter deltas) held while the collector is away.
    pub queue: usize,
    /// This host's clock is synchronised (PTP/NTP): one-way delays are meaningful.
    pub clock_synced: bool,
    pub metrics: Option<SocketAddr>,
    /// The metrics endpoint's bearer token: every scrape must carry it. Required to serve
    /// metrics beyond loopback.
    pub metrics_token: Option<String>,
    /// Fleet mode: publish to NATS JetStream instead of streaming to `collector`.
    pub fleet: Option<crate::fleet::NatsOptions>,
    /// Which mirror sessions (GRE/ERSPAN from switches) become points.
    pub mirrors: crate::observation::MirrorPolicy,
    /// What the agent gives up once its programs are attached ([`crate::privilege`]).
    pub privileges: Privileges,
    /// Where the interfaces' NIC and PFC counters are read (None: not read).
    pub nic: Option<crate::nic::Root>,
}

/// What an agent does with its privileges once attached.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Privileges {
    /// Keeps them (an agent inside another process, e.g. `verify`'s).
    #[default]
    Keep,
    /// Drops every capability it no longer needs, and becomes `user` when given.
    Drop { user: Option<String> },
}

impl AgentOptions {
    /// What every agent needs, whatever it reads from.
    fn check(&self) -> anyhow::Result<()> {
        // Fleet mode authenticates to NATS with NATS's own credentials instead.
        anyhow::ensure!(
            self.fleet.is_some() || !self.token.is_empty() || self.tls.is_some(),
            "the collector needs to know this agent: give a token (--token-file) or TLS certificates (--tls-cert, --tls-key, --tls-ca)"
        );
        // HELLO carries both as u16-long strings: one longer could never be sent.
        anyhow::ensure!(
            self.token.len() <= u16::MAX as usize && self.node.len() <= u16::MAX as usize,
            "the token and the node name must be at most 65,535 bytes"
        );
        anyhow::ensure!(self.queue > 0, "--queue must be at least 1");
        if let Some(addr) = self.metrics {
            anyhow::ensure!(
                addr.ip().is_loopback() || self.metrics_token.is_some(),
                "--metrics {addr} would serve this host's traffic counts beyond it to anyone: give --metrics-token-file FILE (Prometheus then sends `authorization: credentials_file`), or a loopback address"
            );
        }
        anyhow::ensure!(!self.interval.is_zero(), "--interval must be longer than zero");
        Ok(())
    }
}

mod outbox;
mod traces;

/// A reader of a capture (`agent -r`) forgets a flow idle this long in capture time (its
/// last counter delta was sent before), as the kernel's tables let idle flows go.
pub const OFFLINE_FLOW_IDLE_NS: u64 = 120_000_000_000;

/// How long the agent waits without a frame from the collector (which sends a
/// HEARTBEAT every third of its `--agent-timeout`, 16 s by default) before it gives the
/// connection up and connects again.
const COLLECTOR_TIMEOUT: Duration = Duration::from_secs(20);

pub use outbox::Delivery;
use outbox::Outbox;

/// What the agent did, for its last line and its metrics.
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq, Eq)]
pub struct AgentStats {
    pub observations: Delivery,
    pub counters: Delivery,
    /// Handshakes that succeeded.
    pub connections: u64,
    pub ringbuf_drops: u64,
}

impl Outbox {
    fn stats(&self) -> AgentStats {
        AgentStats {
            observations: self.observations(),
            counters: self.counters(),
            connections: self.connections,
            ringbuf_drops: self.ringbuf_drops,
        }
    }
}

/// Per (interface, direction): totals for the Prometheus endpoint.
#[derive(Clone, Debug, Default)]
struct PointMetrics {
    /// Packets and bytes by the flow's current DSCP.
    packets_by_dscp: BTreeMap<u8, (u64, u64)>,
    /// Every flow's counters, summed.
    counts: Counts,
}

struct Shared {
    /// Locked before `outbox` when both are needed.
    points: Mutex<PointTable>,
    outbox: Mutex<Outbox>,
    /// Results of traces the collector asked for, waiting to be sent.
    traces: Mutex<VecDeque<crate::protocol::ProbeResult>>,
    notify: Notify,
    metrics: Mutex<(Vec<(String, PointMetrics)>, GlobalTotals)>,
    /// Samples of no declared point (given up: counted in every point's health).
    unplaced: std::sync::atomic::AtomicU64,
    /// Which traces the collector may have: of flows seen leaving this host, budgeted.
    gate: Mutex<traces::Gate>,
    /// Traces running at once, at most.
    trace_slots: Arc<tokio::sync::Semaphore>,
    /// Per point index: one of this host's own egress points (where its flows leave).
    own_egress: Vec<bool>,
    /// Each NIC port's latest reading (the metrics).
    nic: Mutex<Vec<(crate::nic::Port, crate::nic::Reading)>>,
}

use crate::datapath::GlobalTotals;

impl Shared {
    fn new(queue: usize, points: Vec<PointDecl>, mirrors: crate::observation::MirrorPolicy) -> Self {
        let own_egress = points
            .iter()
            .map(|p| p.node.is_empty() && p.direction == DIR_EGRESS)
            .collect();
        Self {
            gate: Mutex::new(traces::Gate::default()),
            trace_slots: Arc::new(tokio::sync::Semaphore::new(traces::MAX_RUNNING)),
            own_egress,
            nic: Mutex::new(Vec::new()),
            points: Mutex::new(PointTable::new(points).with_policy(mirrors)),
            outbox: Mutex::new(Outbox::new(queue)),
            traces: Mutex::new(VecDeque::new()),
            notify: Notify::new(),
            metrics: Mutex::new((Vec::new(), GlobalTotals::default())),
            unplaced: std::sync::atomic::AtomicU64::new(0),
        }
    }
}

pub async fn run(
    opts: AgentOptions,
    shutdown: impl Future<Output = ()>,
    ready: impl FnOnce(&[Attachment], Option<SocketAddr>),
) -> anyhow::Result<AgentStats> {
    opts.check()?;
    anyhow::ensure!(!opts.ifaces.is_empty(), "no interface given (use -i IFACE)");
    crate::sys::warn_kernel_bypass(&opts.ifaces);
    let mut dp = Datapath::load(&opts.datapath)?;
    let hooks = dp.attach_all(&opts.ifaces, opts.ingress, opts.egress)?;
    let points: Vec<PointDecl> = hooks
        .iter()
        .enumerate()
        .map(|(i, h)| PointDecl {
            index: i as u16,
            node: String::new(),
            mtu: crate::sys::mtu(&h.iface).unwrap_or(0),
            iface: h.iface.clone(),
            ifindex: h.ifindex,
            direction: h.direction,
        })
        .collect();
    let shared = Arc::new(Shared::new(opts.queue, points, opts.mirrors.clone()));

    let mut metrics_addr = None;
    if let Some(addr) = opts.metrics {
        let sh = shared.clone();
        let bearer = opts.metrics_token.as_deref().map(Arc::from);
        let (bound, serve) = http::bind(addr, bearer, move |path, _| match path {
            "/metrics" => Response::metrics(render_metrics(&sh)),
            _ => Response::text(404, "try /metrics\n".into()),
        })
        .await
        .with_context(|| format!("metrics on {addr}"))?;
        metrics_addr = Some(bound);
        tokio::spawn(serve);
    }

    let clock = KernelClock::now();
    let ring = dp.take_samples()?;
    if let Privileges::Drop { user } = &opts.privileges {
        use crate::privilege::*;
        let mut keep = Vec::new();
        if opts.fleet.is_none() {
            keep.push(CAP_NET_RAW);
        }
        if hooks.iter().any(|h| h.mode == "clsact") {
            keep.push(CAP_NET_ADMIN);
        }
        if map_reads_need_cap_bpf() {
            keep.push(CAP_BPF);
        }
        let dropped = drop_privileges(user.as_deref(), &keep)?;
        dp.globals().map_err(|e| {
            anyhow::anyhow!("with privileges dropped ({dropped}) the agent cannot read its maps: {e}")
        })?;
        tracing::info!("privileges dropped: {dropped}");
    }
    // SAFETY: the RingBuf owns its map fd and keeps it open for as long as this AsyncFd.
    let mut ring = unsafe { tokio::io::unix::AsyncFd::register(ring) }
        .map_err(|e| anyhow::anyhow!("polling the sample ring buffer: {e}"))?;
    let sender = start_sender(&opts, &shared).await?;
    ready(&hooks, metrics_addr);

    // Per flow: its counters at the last reading, and where the interval of its next
    // delta starts (its last report, or the reading before it first appeared).
    let mut prev: HashMap<FlowKey, (FlowCounters, u64)> = HashMap::new();
    let mut last_read_ns = clock.to_unix_ns(KernelClock::mono_now_ns());
    let mut health = HealthMeter::new();
    let mut nic = opts
        .nic
        .clone()
        .and_then(|root| crate::nic::NicWatch::open(root, &opts.ifaces));
    let mut nic_from_ns = crate::protocol::unix_now_ns();
    if let Some(w) = &mut nic {
        nic_interval(w, &shared, &mut nic_from_ns);
    }
    // Kernel timers: one wake-up a period (`Periodic`), the first one period from now.
    let mut tick = crate::timer::Periodic::new(opts.interval).context("the interval timer")?;
    let mut drain_tick = crate::timer::Periodic::new(std::time::Duration::from_millis(
        roce_trace_common::datapath::AGENT_SAMPLE_DRAIN_MS,
    ))
    .context("the drain timer")?;
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            guard = ring.readable_mut() => {
                let mut guard = guard.context("waiting for samples")?;
                let Ok(n) = Datapath::read_ready(&mut guard, |ring| {
                    Ok::<_, std::convert::Infallible>(drain(ring, &clock, &shared) as u64)
                });
                if n > 0 {
                    shared.notify.notify_one();
                }
            }
            // Wake-ups are batched: below a batch, samples are read here, at most
            // AGENT_SAMPLE_DRAIN_MS after they were taken.
            ticked = drain_tick.tick() => {
                ticked.context("the drain timer")?;
                if drain(ring.get_mut(), &clock, &shared) > 0 {
                    shared.notify.notify_one();
                }
            }
            ticked = tick.tick() => {
                ticked.context("the interval timer")?;
                read_interval(&mut dp, &clock, &shared, &mut prev, &mut last_read_ns, &mut health)?;
                if let Some(w) = &mut nic {
                    nic_interval(w, &shared, &mut nic_from_ns);
                }
                shared.notify.notify_one();
            }
        }
    }
    // Whatever the kernel queued still goes, with the last (partial) interval's counter
    // deltas and health, and the sender gets a moment to deliver.
    drain(ring.get_mut(), &clock, &shared);
    if let Err(e) = read_interval(
        &mut dp,
        &clock,
        &shared,
        &mut prev,
        &mut last_read_ns,
        &mut health,
    ) {
        tracing::warn!("the last interval's counters could not be read: {e:#}");
    }
    if let Some(w) = &mut nic {
        nic_interval(w, &shared, &mut nic_from_ns);
    }
    shared.notify.notify_one();
    Ok(finish(&shared, sender, Duration::from_secs(2)).await)
}

/// One interval of the NIC ports' counters: a NIC record per port for the collector
/// (from the previous read to now, by this host's clock), the latest readings for the
/// metrics.
fn nic_interval(w: &mut crate::nic::NicWatch, shared: &Shared, from_ns: &mut u64) {
    use crate::observation::{NicCounter, NicDelta, NicValue};
    let now = crate::protocol::unix_now_ns();
    let mut latest = Vec::new();
    let mut out = Vec::new();
    for t in w.tick() {
        if let Some(iv) = &t.interval {
            out.push(NicDelta {
                iface: t.port.netdev.clone(),
                driver: t.reading.driver as u8,
                rdma_device: t.port.rdma.as_ref().map(|r| r.device.clone()).unwrap_or_default(),
                addrs: crate::sys::iface_addrs(&t.port.netdev),
                start_ns: *from_ns,
                end_ns: now,
                epoch_changed: iv.epoch_changed,
                values: t
                    .reading
                    .values
                    .iter()
                    .map(|(id, v)| NicValue {
                        counter: NicCounter::of(*id),
                        total: v.value,
                        delta: iv.get(*id).and_then(|c| c.step.delta()),
                    })
                    .collect(),
                missing: iv
                    .missing
                    .iter()
                    .map(|(id, a)| (NicCounter::of(*id), a.why as u8))
                    .collect(),
            });
        }
        latest.push((t.port.clone(), t.reading));
    }
    *from_ns = now;
    {
        let mut ob = shared.outbox.lock().expect("outbox");
        for d in out {
            ob.push_nic(d);
        }
    }
    *shared.nic.lock().expect("nic") = latest;
}

/// One interval's reading of the kernel's flow table: each flow's counter delta since
/// its last report, each point's health, the metrics; also what the table says this host
/// sent (the flows it may trace).
fn read_interval(
    dp: &mut Datapath,
    clock: &KernelClock,
    shared: &Shared,
    prev: &mut HashMap<FlowKey, (FlowCounters, u64)>,
    last_read_ns: &mut u64,
    health: &mut HealthMeter,
) -> anyhow::Result<()> {
    let flows = dp.flows()?;
    let read_ns = clock.to_unix_ns(KernelClock::mono_now_ns());
    let globals = dp.globals()?;
    let mut next = HashMap::with_capacity(flows.len());
    let mut by_point: BTreeMap<u16, PointMetrics> = BTreeMap::new();
    let mut left = Vec::new();
    let points = {
        let mut table = shared.points.lock().expect("points");
        dp.resolve_mirrors(&mut table.mirrors, flows.keys())?;
        let mut ob = shared.outbox.lock().expect("outbox");
        for (k, c) in &flows {
            let (before, start_ns) = prev.get(k).map_or((None, *last_read_ns), |(b, s)| (Some(b), *s));
            let Some(p) = table.index_of(k) else {
                next.insert(*k, (*c, start_ns));
                continue;
            };
            let d = CounterDelta::between(p, k, c, before, [start_ns, read_ns]);
            let reported = d.counts.packets > 0;
            if reported && shared.own_egress.get(p as usize) == Some(&true) {
                left.push((FlowId::of_key(k), source_class(c)));
            }
            if reported {
                ob.push_counter(d);
            }
            next.insert(*k, (*c, if reported { read_ns } else { start_ns }));
            let m = by_point.entry(p).or_default();
            let e = m.packets_by_dscp.entry(c.last_dscp).or_default();
            e.0 += c.counts.packets;
            e.1 += c.counts.bytes;
            m.counts.add(&c.counts);
        }
        ob.ringbuf_drops = globals.total(GlobalCounter::RingbufFull);
        // A port's MTU may change under us (a fault, a repair): declared again.
        let own: Vec<(u16, String)> = table
            .decls()
            .iter()
            .filter(|d| d.node.is_empty())
            .map(|d| (d.index, d.iface.clone()))
            .collect();
        for (i, iface) in own {
            if let Ok(m) = crate::sys::mtu(&iface) {
                table.set_mtu(i, m);
            }
        }
        let dropped = ob.dropped().0 + shared.unplaced.load(std::sync::atomic::Ordering::Relaxed);
        for h in health.interval(table.decls(), &globals, dropped) {
            ob.push_health(h);
        }
        table.decls().to_vec()
    };
    *shared.metrics.lock().expect("metrics") = (
        points
            .iter()
            .map(|p| {
                let iface = if p.node.is_empty() {
                    p.iface.clone()
                } else {
                    format!("{}/{}", p.node, p.iface)
                };
                (
                    format!("{iface}\t{}", direction_name(p.direction)),
                    by_point.remove(&p.index).unwrap_or_default(),
                )
            })
            .collect(),
        globals,
    );
    {
        let now = Instant::now();
        let mut gate = shared.gate.lock().expect("gate");
        gate.sources.expire(now);
        for (f, c) in left {
            gate.sources.saw(f, c, now);
        }
    }
    *prev = next;
    *last_read_ns = read_ns;
    Ok(())
}

fn drain(ring: &mut aya::maps::RingBuf<aya::maps::MapData>, clock: &KernelClock, sh: &Shared) -> usize {
    let mut batch = Vec::new();
    let mut left = Vec::new();
    while let Some(item) = ring.next() {
        if item.len() < std::mem::size_of::<Sample>() {
            // Not a sample this agent can read: lost, and said so in every point's health.
            sh.unplaced.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            continue;
        }
        // SAFETY: a whole Sample (size checked); read_unaligned copes with any alignment.
        let s: Sample = unsafe { std::ptr::read_unaligned(item.as_ptr() as *const Sample) };
        if let Some(p) = sh.points.lock().expect("points").index_of_sample(&s) {
            if sh.own_egress.get(p as usize) == Some(&true) {
                left.push((
                    FlowId::of_key(&s.key),
                    traces::SourceClass {
                        dscp: s.dscp,
                        ecn: s.ecn,
                    },
                ));
            }
            batch.push(Observation::from_sample(&s, p, clock.to_unix_ns(s.ts_ns)));
        } else {
            sh.unplaced.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
    if !left.is_empty() {
        let now = Instant::now();
        let mut gate = sh.gate.lock().expect("gate");
        for (f, c) in left {
            gate.sources.saw(f, c, now);
        }
    }
    let n = batch.len();
    let mut ob = sh.outbox.lock().expect("outbox");
    for o in batch {
        ob.push_obs(o);
    }
    n
}

/// Connects, shakes hands, streams; on any failure waits (100 ms doubling to 5 s) and
/// connects again. Never touches the datapath.
async fn send_loop(opts: AgentOptions, sh: Arc<Shared>) {
    const FIRST: Duration = Duration::from_millis(100);
    let mut backoff = FIRST;
    let mut last_error = String::new();
    loop {
        let connections = sh.outbox.lock().expect("outbox").connections;
        let Err(e) = session(&opts, &sh).await;
        let e = e.to_string();
        if e != last_error {
            tracing::warn!("collector {}: {e}; retrying", opts.collector);
            last_error = e;
        }
        // A connection that got past the handshake starts the backoff afresh.
        if sh.outbox.lock().expect("outbox").connections != connections {
            backoff = FIRST;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

/// What sends the agent's frames: a connection to the collector (reconnecting), or fleet
/// mode's publisher to NATS JetStream (set once NATS has been reached).
struct Sender {
    task: tokio::task::JoinHandle<()>,
    publisher: Arc<std::sync::OnceLock<Arc<crate::fleet::Publisher>>>,
}

/// Starts the sender `opts` ask for. Fleet mode tries NATS once here, so a setting NATS
/// refuses (the stream's partition count, a bad name or credentials file) stops the
/// agent at the start; an unreachable server does not: the agent starts, buffers
/// (bounded, counted, as for a collector that is away) and keeps trying.
async fn start_sender(opts: &AgentOptions, sh: &Arc<Shared>) -> anyhow::Result<Sender> {
    let slot = Arc::new(std::sync::OnceLock::new());
    let Some(nats) = opts.fleet.clone() else {
        return Ok(Sender {
            task: tokio::spawn(send_loop(opts.clone(), sh.clone())),
            publisher: slot,
        });
    };
    let publisher_opts = crate::fleet::PublisherOptions {
        queue: opts.queue,
        clock_synced: opts.clock_synced,
        ..Default::default()
    };
    let first = match crate::fleet::connect(nats.clone()).await {
        Ok(f) => Some(f),
        Err(e) if e.is_transient() => {
            tracing::warn!(
                "fleet mode: NATS unreachable ({e}); buffering and retrying every {} s at most",
                RETRY_MAX.as_secs()
            );
            None
        }
        Err(e) => return Err(anyhow::Error::new(e).context("fleet mode: connecting to NATS")),
    };
    let (node, sh, out) = (opts.node.clone(), sh.clone(), slot.clone());
    let task = tokio::spawn(async move {
        let mut fleet = first;
        let mut backoff = Duration::from_millis(200);
        let fleet = loop {
            if let Some(f) = fleet.take() {
                break f;
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(RETRY_MAX);
            match crate::fleet::connect(nats.clone()).await {
                Ok(f) => break f,
                Err(e) => tracing::warn!("fleet mode: NATS: {e}; retrying"),
            }
        };
        let publisher = match crate::fleet::Publisher::new(&fleet, &node, publisher_opts) {
            Ok(p) => Arc::new(p),
            Err(e) => {
                tracing::error!("fleet mode: {e}");
                return;
            }
        };
        let _ = out.set(publisher.clone());
        tracing::info!("fleet mode: publishing to NATS {}", nats.urls.join(","));
        fleet_send_loop(publisher, sh).await
    });
    Ok(Sender {
        task,
        publisher: slot,
    })
}

/// The longest pause between attempts to reach NATS when it was not there at the start.
const RETRY_MAX: Duration = Duration::from_secs(5);

/// Fleet mode: hands the outbox's frames, the point table and the drop counts to the
/// publisher, which partitions, holds (bounded) and delivers them. (Traces are not
/// carried in fleet mode.)
async fn fleet_send_loop(publisher: Arc<crate::fleet::Publisher>, sh: Arc<Shared>) {
    let mut declared = None;
    let mut last_dropped = (u64::MAX, u64::MAX);
    loop {
        let _ = tokio::time::timeout(Duration::from_millis(500), sh.notify.notified()).await;
        // The whole table whenever it changed (a mirror session, an MTU): the publisher
        // stores it before anything queued after it.
        let table = {
            let t = sh.points.lock().expect("points");
            let now = (t.decls().len(), t.changes());
            (declared != Some(now)).then(|| {
                declared = Some(now);
                t.decls().to_vec()
            })
        };
        if let Some(points) = table
            && let Err(e) = publisher.send(Frame::Points(points))
        {
            tracing::warn!("fleet mode: the point table was not taken: {e}");
        }
        loop {
            let Some(f) = sh.outbox.lock().expect("outbox").hand_over() else {
                break;
            };
            if let Err(e) = publisher.send(f) {
                tracing::warn!("fleet mode: a frame was not taken: {e}");
            }
        }
        let dropped = sh.outbox.lock().expect("outbox").dropped();
        if dropped != last_dropped {
            last_dropped = dropped;
            let _ = publisher.send(Frame::Dropped {
                observations: dropped.0,
                counters: dropped.1,
            });
        }
    }
}

/// Waits (at most `patience`) until the collector (or NATS) has acknowledged everything
/// made, then stops the sender; what became of everything.
async fn finish(sh: &Shared, sender: Sender, patience: Duration) -> AgentStats {
    sh.notify.notify_one();
    let deadline = Instant::now() + patience;
    while Instant::now() < deadline && !sh.outbox.lock().expect("outbox").is_empty() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if let Some(p) = sender.publisher.get() {
        // One more round hands over what the last interval queued.
        sh.notify.notify_one();
        tokio::time::sleep(Duration::from_millis(50)).await;
        if !p.flush(deadline.saturating_duration_since(Instant::now())).await {
            tracing::warn!("fleet mode: NATS did not acknowledge everything before the agent stopped");
        }
    }
    sender.task.abort();
    let stats = sh.outbox.lock().expect("outbox").stats();
    match sender.publisher.get() {
        Some(p) => fleet_stats(stats, &p.stats()),
        None => stats,
    }
}

/// Fleet mode's account: the outbox counts a record handed to the publisher as
/// acknowledged, but only JetStream's acknowledgement delivers it. What the agent made
/// (and the outbox dropped before the hand-over) is the outbox's; what was sent,
/// acknowledged and dropped after it is the publisher's.
fn fleet_stats(mut stats: AgentStats, p: &crate::fleet::PublishStats) -> AgentStats {
    let take = |d: &mut Delivery, p: &Delivery| {
        d.sent = p.sent;
        d.resent = p.resent;
        d.acked = p.acked;
        d.dropped += p.dropped;
    };
    take(&mut stats.observations, &p.observations);
    take(&mut stats.counters, &p.counters);
    stats
}

/// WELCOME's fields.
struct Welcome {
    connection: u64,
    previous: u64,
    previous_frames: u64,
}

/// A connection past the handshake: its socket, its encoder and decoder, what was read
/// beyond WELCOME, and WELCOME.
struct Connected {
    sock: Box<dyn Stream>,
    enc: Encoder,
    dec: Decoder,
    buf: BytesMut,
    welcome: Welcome,
}

/// Why a connection to the collector ended (logged when it differs from the last one;
/// the agent connects again).
#[derive(Debug, thiserror::Error)]
enum SessionEnd {
    #[error("connect timed out")]
    ConnectTimeout,
    #[error("connect: {0}")]
    Connect(std::io::Error),
    #[error("TLS handshake with the collector: {0}")]
    Tls(std::io::Error),
    #[error("nothing from the collector for {}s", COLLECTOR_TIMEOUT.as_secs())]
    Silent,
    #[error("no answer to HELLO within 5 s")]
    NoWelcome,
    #[error("{0}")]
    Handshake(ReadError),
    #[error("the collector closed the connection during the handshake")]
    ClosedInHandshake,
    #[error("the collector speaks protocol version {0}, this agent {VERSION}")]
    Version(u16),
    #[error("refused: {0}")]
    Refused(String),
    #[error("unexpected answer to HELLO: {0}")]
    NotWelcome(&'static str),
    #[error("handshake: {0}")]
    Hello(ProtoError),
    #[error("sending: {0}")]
    Send(std::io::Error),
    #[error("receiving: {0}")]
    Receive(ReadError),
    #[error("the collector sent a bad frame: {0}")]
    BadFrame(ProtoError),
    #[error("the collector closed the connection")]
    Closed,
    #[error("the collector closed the connection: {0}")]
    Bye(String),
    #[error("the collector sent {0}, which it never should")]
    Unexpected(&'static str),
    #[error("reading the collector's frames stopped: {0}")]
    Reader(tokio::task::JoinError),
}

/// Connects and sends HELLO; refuses a collector that does not speak this version (one
/// that would not acknowledge what it receives).
async fn handshake(opts: &AgentOptions) -> Result<Connected, SessionEnd> {
    let sock = tokio::time::timeout(Duration::from_secs(3), TcpStream::connect(&opts.collector))
        .await
        .map_err(|_| SessionEnd::ConnectTimeout)?
        .map_err(SessionEnd::Connect)?;
    let _ = sock.set_nodelay(true);
    let mut sock: Box<dyn Stream> = match &opts.tls {
        None => Box::new(sock),
        Some((cfg, name)) => {
            let tls = tokio_rustls::TlsConnector::from(cfg.clone());
            let s = tokio::time::timeout(Duration::from_secs(5), tls.connect(name.clone(), sock))
                .await
                .map_err(|_| SessionEnd::NoWelcome)?
                .map_err(SessionEnd::Tls)?;
            Box::new(s)
        }
    };
    let mut enc = Encoder::default();
    let hello = Frame::Hello {
        version: VERSION,
        node: opts.node.clone(),
        token: opts.token.clone(),
        clock_synced: opts.clock_synced,
    };
    let hello = enc.encode(&hello).map_err(SessionEnd::Hello)?;
    sock.write_all(&hello).await.map_err(SessionEnd::Send)?;
    let mut buf = BytesMut::new();
    // What a collector sends (WELCOME, ACK, TRACE_REQUEST, BYE) is small: nothing it
    // sends can make the agent hold more than a HELLO's worth.
    let mut dec = Decoder::handshake();
    let reply = tokio::time::timeout(Duration::from_secs(5), read_frame(&mut sock, &mut buf, &mut dec))
        .await
        .map_err(|_| SessionEnd::NoWelcome)?
        .map_err(SessionEnd::Handshake)?
        .ok_or(SessionEnd::ClosedInHandshake)?;
    let welcome = match reply {
        Frame::Welcome {
            version,
            connection,
            previous,
            previous_frames,
        } if version == VERSION => Welcome {
            connection,
            previous,
            previous_frames,
        },
        Frame::Welcome { version, .. } => return Err(SessionEnd::Version(version)),
        Frame::Bye { reason } => return Err(SessionEnd::Refused(reason)),
        other => return Err(SessionEnd::NotWelcome(other.name())),
    };
    Ok(Connected {
        sock,
        enc,
        dec,
        buf,
        welcome,
    })
}

/// One connection: handshake, then everything queued, until the connection fails or the
/// collector closes it. What was in flight stays for the next handshake to settle.
async fn session(opts: &AgentOptions, sh: &Arc<Shared>) -> Result<std::convert::Infallible, SessionEnd> {
    let Connected {
        sock,
        mut enc,
        dec,
        buf,
        welcome,
    } = handshake(opts).await?;
    sh.outbox
        .lock()
        .expect("outbox")
        .welcome(welcome.connection, welcome.previous, welcome.previous_frames);
    tracing::info!("connected to collector {}", opts.collector);
    let (points, mut declared_changes) = {
        let t = sh.points.lock().expect("points");
        (t.decls().to_vec(), t.changes())
    };
    let mut declared = points.len();
    let (rd, mut sock) = tokio::io::split(sock);
    // As many POINTS frames as the format needs: one too big for its count or the frame
    // limit would close the connection, again after every reconnection.
    for f in points_frames(&points) {
        send(&mut sock, &mut enc, &f).await?;
    }
    // The collector's frames (ACKs, trace requests) are read beside the sending below.
    struct AbortOnDrop(tokio::task::JoinHandle<SessionEnd>);
    impl Drop for AbortOnDrop {
        fn drop(&mut self) {
            self.0.abort();
        }
    }
    let mut reader = AbortOnDrop(tokio::spawn(read_collector(
        rd,
        dec,
        buf,
        sh.clone(),
        welcome.connection,
    )));
    let mut last_dropped = (u64::MAX, u64::MAX);
    let mut last_beat = Instant::now();
    loop {
        tokio::select! {
            why = &mut reader.0 => return Err(why.unwrap_or_else(SessionEnd::Reader)),
            _ = tokio::time::timeout(Duration::from_millis(500), sh.notify.notified()) => {}
        }
        loop {
            let mut wrote = false;
            // Points first: what is queued may name a mirror session seen since.
            let (new_points, changes) = {
                let t = sh.points.lock().expect("points");
                if t.changes() != declared_changes {
                    // A point changed (its MTU): every point again, the collector updates.
                    declared = 0;
                }
                (t.decls()[declared..].to_vec(), t.changes())
            };
            declared_changes = changes;
            if !new_points.is_empty() {
                declared += new_points.len();
                for f in points_frames(&new_points) {
                    send(&mut sock, &mut enc, &f).await?;
                }
            }
            let frames: Vec<Result<bytes::Bytes, ProtoError>> = {
                let mut ob = sh.outbox.lock().expect("outbox");
                // Two frames a round at most: the datapath waits on this lock.
                [ob.next_frame(&mut enc), ob.next_frame(&mut enc)]
                    .into_iter()
                    .flatten()
                    .collect()
            };
            for f in frames {
                // A batch the format cannot carry (none of at most MAX_BATCH records is)
                // takes no sequence number and is counted as dropped by the outbox.
                match f {
                    Ok(f) => write(&mut sock, &f).await?,
                    Err(e) => tracing::warn!("dropped a batch the collector could not take: {e}"),
                }
                wrote = true;
            }
            let dropped = sh.outbox.lock().expect("outbox").dropped();
            if dropped != last_dropped {
                let f = Frame::Dropped {
                    observations: dropped.0,
                    counters: dropped.1,
                };
                send(&mut sock, &mut enc, &f).await?;
                last_dropped = dropped;
            }
            let traces: Vec<crate::protocol::ProbeResult> =
                sh.traces.lock().expect("traces").drain(..).collect();
            for t in traces {
                send(&mut sock, &mut enc, &Frame::TraceResult(t)).await?;
            }
            if last_beat.elapsed() >= Duration::from_secs(5) {
                send(
                    &mut sock,
                    &mut enc,
                    &Frame::Heartbeat {
                        unix_ns: crate::protocol::unix_now_ns(),
                    },
                )
                .await?;
                last_beat = Instant::now();
            }
            if !wrote {
                break;
            }
        }
    }
}

async fn write(sock: &mut StreamWriter, frame: &[u8]) -> Result<(), SessionEnd> {
    sock.write_all(frame).await.map_err(SessionEnd::Send)
}

/// Encodes `f` and writes it; a frame the format cannot carry is left out (logged) and
/// takes no sequence number. Sending it anyway would make the collector close the
/// connection, and the frame would come back after every reconnection: leaving it out is
/// what keeps the agent going.
async fn send(sock: &mut StreamWriter, enc: &mut Encoder, f: &Frame) -> Result<(), SessionEnd> {
    match enc.encode(f) {
        Ok(b) => write(sock, &b).await,
        Err(e) => {
            tracing::warn!("left out a {} frame the collector could not take: {e}", f.name());
            Ok(())
        }
    }
}

/// What each point's health is measured against: the running totals at the last tick.
struct HealthMeter {
    since_ns: u64,
    ringbuf: [u64; 2],
    unparsed: [u64; 2],
    dropped: u64,
    ifs: HashMap<String, crate::netstat::IfDrops>,
    qdiscs: HashMap<u32, u64>,
    warned: bool,
}

impl HealthMeter {
    fn new() -> Self {
        let mut m = Self {
            since_ns: crate::protocol::unix_now_ns(),
            ringbuf: [0; 2],
            unparsed: [0; 2],
            dropped: 0,
            ifs: HashMap::new(),
            qdiscs: HashMap::new(),
            warned: false,
        };
        (m.ifs, m.qdiscs) = m.kernel();
        m
    }

    /// The kernel's interface and qdisc drop counters; none (and one warning) when they
    /// cannot be read: the health still says what the agent lost.
    fn kernel(&mut self) -> (HashMap<String, crate::netstat::IfDrops>, HashMap<u32, u64>) {
        let ifs = crate::netstat::read_if_drops();
        let qd = crate::netstat::root_qdisc_drops();
        if let (Err(e), _) | (_, Err(e)) = (&ifs, &qd)
            && !self.warned
        {
            tracing::warn!("reading interface drop counters: {e}; losses will not quote them");
            self.warned = true;
        }
        (ifs.unwrap_or_default(), qd.unwrap_or_default())
    }

    /// Every point's health since the last call, from the datapath's counters (by
    /// direction: ring-buffer failures, RoCE packets it could not parse) and what the
    /// agent gave up (running totals).
    fn interval(&mut self, points: &[PointDecl], globals: &GlobalTotals, dropped: u64) -> Vec<PointHealth> {
        let by_dir = |of: fn(GlobalCounter) -> bool| {
            [DIR_INGRESS, DIR_EGRESS].map(|d| {
                GlobalCounter::ALL
                    .into_iter()
                    .filter(|&c| of(c))
                    .map(|c| globals.get(c, d))
                    .sum::<u64>()
            })
        };
        let ringbuf = by_dir(|c| c == GlobalCounter::RingbufFull);
        let unparsed = by_dir(|c| c.kind() == CounterKind::RoceParseFailure);
        let now = crate::protocol::unix_now_ns();
        let (ifs, qdiscs) = self.kernel();
        let agent_dropped = dropped.saturating_sub(self.dropped);
        let v = points
            .iter()
            .map(|p| {
                let dir = if p.direction == DIR_EGRESS { 1 } else { 0 };
                let mut h = PointHealth {
                    point: p.index,
                    start_ns: self.since_ns,
                    end_ns: now,
                    ringbuf_full: ringbuf[dir].saturating_sub(self.ringbuf[dir]),
                    unparsed: unparsed[dir].saturating_sub(self.unparsed[dir]),
                    agent_dropped,
                    ..Default::default()
                };
                if p.node.is_empty() {
                    let d = |m: &HashMap<String, crate::netstat::IfDrops>| {
                        m.get(&p.iface).copied().unwrap_or_default()
                    };
                    let (now_if, was_if) = (d(&ifs), d(&self.ifs));
                    if p.direction == DIR_EGRESS {
                        h.if_tx_dropped = now_if.tx_dropped.saturating_sub(was_if.tx_dropped);
                        let q = |m: &HashMap<u32, u64>| m.get(&p.ifindex).copied().unwrap_or_default();
                        h.qdisc_dropped = q(&qdiscs).saturating_sub(q(&self.qdiscs));
                    } else {
                        h.if_rx_dropped = now_if.rx_dropped.saturating_sub(was_if.rx_dropped);
                    }
                }
                h
            })
            .collect();
        self.since_ns = now;
        self.ringbuf = ringbuf;
        self.unparsed = unparsed;
        self.dropped = dropped;
        self.ifs = ifs;
        self.qdiscs = qdiscs;
        v
    }
}

/// Reads the collector's frames on connection `connection` until it ends; why it ended.
async fn read_collector(
    mut rd: StreamReader,
    mut dec: Decoder,
    mut buf: BytesMut,
    sh: Arc<Shared>,
    connection: u64,
) -> SessionEnd {
    loop {
        // The collector sends a HEARTBEAT every few seconds: silence means it (or the
        // way to it) is gone, and the agent connects again.
        let f = match tokio::time::timeout(COLLECTOR_TIMEOUT, read_frame(&mut rd, &mut buf, &mut dec)).await {
            Err(_) => return SessionEnd::Silent,
            Ok(f) => f,
        };
        let f = match f {
            Ok(Some(f)) => f,
            Ok(None) => return SessionEnd::Closed,
            Err(ReadError::Protocol(e)) => return SessionEnd::BadFrame(e),
            Err(e) => return SessionEnd::Receive(e),
        };
        match f {
            Frame::Ack { seq } => sh.outbox.lock().expect("outbox").ack(connection, seq),
            // The request's class is not used: the probes carry the class the flow was
            // seen leaving with.
            Frame::TraceRequest { id, flow, .. } => trace_for_collector(&sh, id, flow),
            Frame::Heartbeat { .. } => {}
            Frame::Bye { reason } => return SessionEnd::Bye(reason),
            other => return SessionEnd::Unexpected(other.name()),
        }
    }
}

/// The class a flow's counters say it left with: its last DSCP, and its most frequent
/// ECN codepoint other than CE (which the sender does not set).
fn source_class(c: &FlowCounters) -> traces::SourceClass {
    let ecn = (0..3u8).max_by_key(|&i| c.counts.ecn[i as usize]).unwrap_or(0);
    traces::SourceClass {
        dscp: c.last_dscp,
        ecn,
    }
}

/// Traces `flow` from this host, if it is a flow this host was seen sending and the
/// budget allows (see [`traces`]), with the class it was seen leaving with; queues the
/// result for the collector. Refusals are counted and logged.
fn trace_for_collector(sh: &Arc<Shared>, id: u32, flow: FlowId) {
    let class = {
        let mut gate = sh.gate.lock().expect("gate");
        match gate.admit(&flow, Instant::now()) {
            Ok(c) => c,
            Err(why) => {
                let n = gate.outcomes.unseen + gate.outcomes.budget + gate.outcomes.busy;
                // The first refusal, then one in a hundred: a collector cannot fill the log.
                if n % 100 == 1 {
                    tracing::warn!(
                        "trace of {flow} asked by the collector refused ({}): {n} refused so far",
                        why.why()
                    );
                }
                return;
            }
        }
    };
    let sh = sh.clone();
    tokio::spawn(async move {
        let Ok(_slot) = sh.trace_slots.clone().acquire_owned().await else {
            return;
        };
        let opts = crate::trace::TraceOptions {
            dst: flow.dst_ip(),
            src: flow.src_ip(),
            sport: flow.udp_sport,
            dscp: class.dscp,
            ecn: class.ecn,
            max_hops: 16,
            probes: 2,
            timeout: Duration::from_millis(300),
            rate: 200,
        };
        let r = tokio::task::spawn_blocking(move || crate::trace::trace(&opts)).await;
        let ok = matches!(r, Ok(Ok(_)));
        sh.gate.lock().expect("gate").finished(ok);
        match r {
            Ok(Ok(r)) => {
                sh.traces
                    .lock()
                    .expect("traces")
                    .push_back(crate::protocol::ProbeResult {
                        id,
                        flow,
                        reached: r.reached,
                        class_changed_at: r.class_changed_at,
                        hops: r
                            .hops
                            .iter()
                            .map(|h| crate::protocol::ProbeHop {
                                ttl: h.ttl,
                                addr: h.addr,
                                dscp: h.dscp,
                                ecn: h.ecn,
                                // u32::MAX µs (71 min) says "none" on the wire.
                                rtt_avg_us: h.rtt_avg_us.map(|u| (u as u32).min(u32::MAX - 1)),
                            })
                            .collect(),
                    });
                sh.notify.notify_one();
            }
            Ok(Err(e)) => tracing::warn!("trace of {flow} asked by the collector: {e:#}"),
            Err(e) => tracing::warn!("trace of {flow} asked by the collector: {e}"),
        }
    });
}

fn render_metrics(sh: &Shared) -> String {
    use crate::metrics::{Labels, Scrape, labels};
    let (points, globals) = sh.metrics.lock().expect("metrics").clone();
    let stats = sh.outbox.lock().expect("outbox").stats();
    let mut m = Scrape::default();
    let lp = |k: &str, more: &[(&str, &str)]| -> Labels {
        let (iface, dir) = k.split_once('\t').unwrap_or((k, ""));
        let mut l = labels(&[("interface", iface), ("direction", dir)]);
        l.extend(labels(more));
        l
    };
    let mut pk = Vec::new();
    let mut by = Vec::new();
    let mut ecn = Vec::new();
    let (mut ce, mut cnp, mut nak, mut gaps) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (k, p) in &points {
        for (dscp, (n, b)) in &p.packets_by_dscp {
            let dscp = dscp.to_string();
            pk.push((lp(k, &[("dscp", &dscp)]), *n));
            by.push((lp(k, &[("dscp", &dscp)]), *b));
        }
        let c = &p.counts;
        for (i, name) in ECN_NAMES.iter().enumerate() {
            ecn.push((lp(k, &[("ecn", name)]), c.ecn[i]));
        }
        ce.push((lp(k, &[]), c.ecn[3]));
        cnp.push((lp(k, &[]), c.cnp));
        for (kind, n) in [
            ("psn_seq_err", c.nak_psn_seq_err),
            ("rnr", c.nak_rnr),
            ("other", c.nak_other),
        ] {
            nak.push((lp(k, &[("kind", kind)]), n));
        }
        gaps.push((lp(k, &[]), c.psn_gaps));
    }
    m.counter(
        "roce_trace_packets_total",
        "RoCEv2 packets, by the flow's current DSCP.",
        pk,
    );
    m.counter(
        "roce_trace_bytes_total",
        "RoCEv2 bytes, by the flow's current DSCP.",
        by,
    );
    m.counter(
        "roce_trace_ecn_packets_total",
        "RoCEv2 packets by ECN codepoint.",
        ecn,
    );
    m.counter("roce_trace_ce_marks_total", "CE-marked RoCEv2 packets.", ce);
    m.counter("roce_trace_cnp_total", "CNPs.", cnp);
    m.counter("roce_trace_nak_total", "NAKs by kind.", nak);
    m.counter(
        "roce_trace_psn_gaps_total",
        "Request PSNs that skipped ahead.",
        gaps,
    );
    m.counter(
        "roce_trace_ringbuf_drops_total",
        "Samples the kernel could not queue (the packets passed).",
        [(DIR_INGRESS, "ingress"), (DIR_EGRESS, "egress")]
            .iter()
            .map(|(d, n)| {
                (
                    labels(&[("direction", n)]),
                    globals.get(GlobalCounter::RingbufFull, *d),
                )
            }),
    );
    for (kind, what, d) in [
        ("samples", "Observations", stats.observations),
        ("counter_deltas", "Counter deltas", stats.counters),
    ] {
        for (name, help, v) in [
            ("total", "made", d.made),
            ("sent_total", "written to a collector, re-sends included", d.sent),
            (
                "resent_total",
                "written again after reconnecting: the collector had not processed them",
                d.resent,
            ),
            ("acked_total", "acknowledged: processed by a collector", d.acked),
            (
                "dropped_total",
                "dropped: the buffer was full (while the collector was away or slow)",
                d.dropped,
            ),
        ] {
            m.counter1(
                &format!("roce_trace_{kind}_{name}"),
                &format!("{what} {help}."),
                v,
            );
        }
    }
    let (outcomes, sent, unremembered) = {
        let g = sh.gate.lock().expect("gate");
        (g.outcomes, g.sources.len() as u64, g.sources.full)
    };
    m.gauge1(
        "roce_trace_sent_flows",
        "Flows this host was seen sending in the last 5 minutes: the ones a collector may have it trace.",
        sent,
    );
    m.counter1(
        "roce_trace_sent_flows_unremembered_total",
        "Flows seen leaving this host while the table of sent flows was full (65,536): they cannot be traced.",
        unremembered,
    );
    m.counter(
        "roce_trace_trace_requests_total",
        "Traces the collector asked for, by outcome: traced, failed (admitted, tracing failed), or refused: unseen (not a flow this host sent lately), budget, busy.",
        outcomes
            .rows()
            .into_iter()
            .map(|(outcome, n)| (labels(&[("outcome", outcome)]), n)),
    );
    let refused = sh.points.lock().expect("points").mirrors_refused();
    m.counter(
        "roce_trace_mirror_sessions_refused_total",
        "Mirror sessions (GRE/ERSPAN) that became no point: from a switch outside --mirror-from, or past --max-mirror-sessions.",
        [("source", refused.source), ("cap", refused.over_cap)]
            .into_iter()
            .map(|(why, n)| (labels(&[("reason", why)]), n)),
    );
    nic_metrics(&mut m, &sh.nic.lock().expect("nic"));
    m.render()
}

/// The NIC ports' counters as Prometheus counters: one family per canonical metric
/// (`roce_trace_nic_pfc_pause_frames_total`, `roce_trace_rdma_np_cnp_sent_total`, …),
/// labelled `interface`, `device` (the RDMA device for its counters, the interface for
/// ethtool's), `port` (the RDMA port), `priority` and `direction` where the counter has
/// them; and per interface how many canonical counters are not available, by reason
/// (never a 0 standing in for them).
fn nic_metrics(m: &mut crate::metrics::Scrape, ports: &[(crate::nic::Port, crate::nic::Reading)]) {
    use crate::metrics::labels;
    use crate::nic::Source;
    type Rows = Vec<(crate::metrics::Labels, u64)>;
    let mut families: BTreeMap<&'static str, (&'static str, Rows)> = BTreeMap::new();
    let mut missing: BTreeMap<(String, &'static str), u64> = BTreeMap::new();
    for (p, r) in ports {
        for (id, v) in &r.values {
            let s = id.spec();
            let (device, port) = match (s.source, &p.rdma) {
                (Source::Rdma, Some(rp)) => (rp.device.clone(), rp.port.to_string()),
                _ => (p.netdev.clone(), String::new()),
            };
            let prio = id.prio.map(|x| x.to_string());
            let mut l = vec![("interface", p.netdev.as_str()), ("device", device.as_str())];
            if !port.is_empty() {
                l.push(("port", &port));
            }
            if let Some(pr) = &prio {
                l.push(("priority", pr));
            }
            if let Some(d) = s.dir {
                l.push(("direction", d.as_str()));
            }
            families
                .entry(s.metric)
                .or_insert((s.help, Vec::new()))
                .1
                .push((labels(&l), v.value));
        }
        for a in r.missing.values() {
            *missing.entry((p.netdev.clone(), a.why.as_str())).or_default() += 1;
        }
    }
    for (name, (help, rows)) in families {
        m.counter(&format!("roce_trace_{name}"), help, rows);
    }
    if !ports.is_empty() {
        m.gauge(
            "roce_trace_nic_counters_not_available",
            "Canonical NIC counters an interface does not have, by reason (pfc_not_enabled, not_in_driver, no_rdma_device, ...).",
            missing
                .into_iter()
                .map(|((i, why), n)| (labels(&[("interface", &i), ("reason", why)]), n)),
        );
    }
}

/// The agent's config file (TOML). Every key is optional; flags override it.
#[derive(Clone, Debug, Default, serde::Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    pub collector: Option<String>,
    pub interfaces: Option<Vec<String>>,
    pub node: Option<String>,
    pub token: Option<String>,
    pub token_file: Option<std::path::PathBuf>,
    /// Mutual TLS: this node's certificate and key, the CA of the collector's, and the
    /// name the collector's certificate must carry (default: the host of `collector`).
    pub tls_cert: Option<std::path::PathBuf>,
    pub tls_key: Option<std::path::PathBuf>,
    pub tls_ca: Option<std::path::PathBuf>,
    pub tls_server_name: Option<String>,
    pub sample_rate: Option<u32>,
    pub seed: Option<u32>,
    pub expect_dscp: Option<Vec<u8>>,
    pub port: Option<u16>,
    /// e.g. "2s".
    pub interval: Option<String>,
    pub queue: Option<usize>,
    pub clock_synced: Option<bool>,
    pub metrics: Option<SocketAddr>,
    /// The metrics endpoint's bearer token, from this file (mode 600).
    pub metrics_token_file: Option<std::path::PathBuf>,
    /// Once attached, become this user.
    pub user: Option<String>,
}

impl AgentConfig {
    /// Reads and validates a config file; errors name the file, and the line and column.
    pub fn load(path: &std::path::Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Self::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
    }

    /// Parses and validates config text; the error names the line and column, or the key.
    pub fn parse(text: &str) -> Result<Self, String> {
        let c: Self = toml::from_str(text).map_err(|e| e.to_string().trim_end().to_owned())?;
        c.validate()?;
        Ok(c)
    }

    pub fn validate(&self) -> Result<(), String> {
        if let Some(d) = self
            .expect_dscp
            .as_ref()
            .and_then(|v| v.iter().find(|&&d| d > 63))
        {
            return Err(format!("expect_dscp: {d} is out of range 0..=63"));
        }
        if let Some(i) = &self.interval {
            humantime::parse_duration(i).map_err(|e| format!("interval `{i}`: {e}"))?;
        }
        if self.queue == Some(0) {
            return Err("queue must be at least 1".into());
        }
        if self.interfaces.as_ref().is_some_and(|v| v.is_empty()) {
            return Err("interfaces is empty".into());
        }
        Ok(())
    }
}

/// The agent fed by a pcap/pcapng stream (`-` for stdin, e.g. an RDMA NIC's sniffer
/// through tcpdump) instead of the datapath: one observation point, `NODE:pcap:ingress`,
/// with the same sampling and counters, so the collector joins it with eBPF-fed points.
pub async fn run_pcap(
    opts: AgentOptions,
    input: std::path::PathBuf,
    shutdown: impl Future<Output = ()>,
    ready: impl FnOnce(&[Attachment], Option<SocketAddr>),
) -> anyhow::Result<AgentStats> {
    opts.check()?;
    let reader = crate::pcap::open(&input)?;
    if let Privileges::Drop { user } = &opts.privileges {
        // A reader of captures needs no capability at all.
        let dropped = crate::privilege::drop_privileges(user.as_deref(), &[])?;
        tracing::info!("privileges dropped: {dropped}");
    }
    let mut offline = crate::pcap::Offline::new(&opts.datapath)?;
    let points = vec![PointDecl {
        mtu: 0,
        index: 0,
        node: String::new(),
        iface: "pcap".into(),
        ifindex: 0,
        direction: DIR_INGRESS,
    }];
    let shared = Arc::new(Shared::new(opts.queue, points, opts.mirrors.clone()));
    let sender = start_sender(&opts, &shared).await?;
    ready(
        &[Attachment {
            iface: format!("pcap:{}", input.display()),
            ifindex: 0,
            hook: "pcap",
            direction: DIR_INGRESS,
            mode: "offline",
            warning: None,
        }],
        None,
    );
    let sh = shared.clone();
    let interval = opts.interval;
    let max_flows = (opts.datapath.max_flows as usize).max(64);
    let reading = tokio::task::spawn_blocking(move || {
        // Per flow: its counters at its last report and that report's capture time. A
        // capture's clock is its packets' timestamps: each delta covers the capture time
        // from the flow's previous report (or from the capture's previous reading, for a
        // new flow) to the last packet read.
        let mut prev: HashMap<FlowKey, (FlowCounters, u64)> = HashMap::new();
        let mut last = Instant::now();
        let mut read_ns: [u64; 2] = [0, 0];
        let deltas = |off: &crate::pcap::Offline,
                      prev: &mut HashMap<FlowKey, (FlowCounters, u64)>,
                      [before_ns, now_ns]: [u64; 2]| {
            let mut table = sh.points.lock().expect("points");
            table.mirrors.extend(off.mirrors.iter());
            let mut ob = sh.outbox.lock().expect("outbox");
            for (k, (_, c)) in &off.flows {
                let was = prev.get(k);
                if was.map(|(p, _)| p.counts.packets) != Some(c.counts.packets) {
                    if let Some(p) = table.index_of(k) {
                        let start_ns = was.map_or(before_ns, |(_, t)| *t);
                        ob.push_counter(CounterDelta::between(
                            p,
                            k,
                            c,
                            was.map(|(b, _)| b),
                            [start_ns, now_ns],
                        ));
                    }
                    prev.insert(*k, (*c, now_ns));
                }
            }
            drop(table);
            drop(ob);
            sh.notify.notify_one();
        };
        // The point's health, by capture time: the stretch of the capture read since the
        // last report, and what the agent gave up in it (a capture itself loses nothing
        // here; what the capturing side dropped is not in the file).
        let mut covered: Option<(u64, u64)> = None;
        let mut reported_dropped = 0;
        let health = |covered: &mut Option<(u64, u64)>, reported_dropped: &mut u64| {
            let Some((start, end)) = covered.take() else {
                return;
            };
            let mut ob = sh.outbox.lock().expect("outbox");
            let dropped = ob.dropped().0 + sh.unplaced.load(std::sync::atomic::Ordering::Relaxed);
            ob.push_health(PointHealth {
                point: 0,
                start_ns: start,
                end_ns: end,
                agent_dropped: dropped - *reported_dropped,
                ..Default::default()
            });
            *reported_dropped = dropped;
            *covered = Some((end, end));
        };
        let result = crate::pcap::read_frames(reader, |fr| {
            if read_ns == [0, 0] {
                read_ns = [fr.time_ns, fr.time_ns];
            }
            read_ns[1] = read_ns[1].max(fr.time_ns);
            offline.frame(&fr, |s| {
                if let Some(p) = sh.points.lock().expect("points").index_of_sample(s) {
                    let o = Observation::from_sample(s, p, KernelClock::UNIX.to_unix_ns(s.ts_ns));
                    let c = covered.get_or_insert((o.time_ns, o.time_ns));
                    c.1 = c.1.max(o.time_ns);
                    sh.outbox.lock().expect("outbox").push_obs(o);
                } else {
                    sh.unplaced.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            });
            // Each interval, and whenever the table outgrows its bound: every flow's
            // delta first, then the idle (by capture time) and the oldest past the bound
            // forgotten — an endless stream holds a bounded table.
            let full = offline.flows.len() > max_flows;
            if full || last.elapsed() >= interval {
                last = Instant::now();
                deltas(&offline, &mut prev, read_ns);
                read_ns[0] = read_ns[1];
                health(&mut covered, &mut reported_dropped);
                // Past the bound, 1/64 of it goes at once, so the next frames do not each
                // pay for a sort.
                let keep = if full {
                    max_flows - max_flows / 64
                } else {
                    max_flows
                };
                for (k, _, _) in offline.expire(read_ns[1], OFFLINE_FLOW_IDLE_NS, keep) {
                    prev.remove(&k);
                }
            }
        });
        deltas(&offline, &mut prev, read_ns);
        // The capture is over: its last packet's time ends the last interval.
        health(&mut covered, &mut reported_dropped);
        result
    });
    tokio::pin!(shutdown);
    tokio::select! {
        r = reading => {
            r.context("pcap reader")?.context("reading the capture")?;
        }
        _ = &mut shutdown => {}
    }
    // Deliver what is queued before stopping.
    Ok(finish(&shared, sender, Duration::from_secs(5)).await)
}

#[cfg(test)]
mod tests {
    /// NIC counters as metrics: the canonical names, the labels a dashboard joins on,
    /// and what is not available counted by reason (never a 0 series for it).
    #[test]
    fn nic_counters_are_metrics_under_their_canonical_names() {
        use crate::nic::*;
        let port = Port {
            netdev: "eth0".into(),
            ifindex: 2,
            driver: Some("mlx5_core".into()),
            rdma: Some(RdmaPort {
                device: "mlx5_0".into(),
                port: 1,
                driver: Some("mlx5_ib".into()),
            }),
        };
        let v = |value: u64, raw: &str| Value {
            value,
            raw: raw.into(),
        };
        let reading = Reading {
            at_ns: 0,
            epoch: Epoch {
                boot_id: [0; 16],
                ifindex: 2,
            },
            driver: Driver::Mlx5,
            values: [
                (CounterId::prio(Kind::RxPause, 3), v(5, "rx_prio3_pause")),
                (
                    CounterId::prio(Kind::TxPauseDuration, 3),
                    v(7, "tx_prio3_pause_duration"),
                ),
                (CounterId::port(Kind::NpCnpSent), v(11, "np_cnp_sent")),
            ]
            .into(),
            missing: [
                (
                    CounterId::prio(Kind::RxPause, 0),
                    Absent {
                        why: Missing::PfcNotEnabled,
                        detail: None,
                    },
                ),
                (
                    CounterId::prio(Kind::RxPause, 1),
                    Absent {
                        why: Missing::PfcNotEnabled,
                        detail: None,
                    },
                ),
            ]
            .into(),
            other: Vec::new(),
        };
        let mut m = crate::metrics::Scrape::default();
        super::nic_metrics(&mut m, &[(port, reading)]);
        let text = m.render();
        for line in [
            r#"roce_trace_nic_pfc_pause_frames_total{interface="eth0",device="eth0",priority="3",direction="rx"} 5"#,
            r#"roce_trace_nic_pfc_pause_duration_microseconds_total{interface="eth0",device="eth0",priority="3",direction="tx"} 7"#,
            r#"roce_trace_rdma_np_cnp_sent_total{interface="eth0",device="mlx5_0",port="1",direction="tx"} 11"#,
            r#"roce_trace_nic_counters_not_available{interface="eth0",reason="pfc_not_enabled"} 2"#,
        ] {
            assert!(text.contains(line), "{line} missing in\n{text}");
        }
        assert!(
            !text.contains(r#"priority="0""#),
            "no series for what is not there"
        );
    }

    use super::*;

    /// A reader of an endless capture holds a bounded table: flows idle for
    /// OFFLINE_FLOW_IDLE_NS of capture time are forgotten, then the least recently seen
    /// past the bound; a flow seen again starts from zero. Fails if `expire` forgets
    /// nothing (the table grows with every flow ever seen) or forgets a flow still busy.
    #[test]
    fn an_offline_reader_forgets_idle_flows_and_stays_within_its_bound() {
        let mut off = crate::pcap::Offline::new(&DatapathOptions::default()).unwrap();
        let frame = |sport: u16, psn: u32, time_ns: u64| crate::pcap::CapturedFrame {
            time_ns,
            data: crate::frame::RoceFrame {
                udp_sport: sport,
                psn,
                ..Default::default()
            }
            .build(),
            orig_len: 0,
        };
        let s = 1_000_000_000u64;
        // Flow 1 at 0 s; flows 2..=6 at 100..104 s; flow 7 at 200 s.
        off.frame(&frame(1, 0, 0), |_| {});
        for sport in 2..=6u16 {
            off.frame(&frame(sport, 0, (98 + sport as u64) * s), |_| {});
        }
        off.frame(&frame(7, 0, 200 * s), |_| {});
        assert_eq!(off.flows.len(), 7);
        let sports = |off: &crate::pcap::Offline| {
            let mut v: Vec<u16> = off.flows.keys().map(|k| k.udp_sport).collect();
            v.sort();
            v
        };
        // At 200 s: flow 1 is idle past 120 s; a bound of 4 then drops the two oldest.
        let mut gone: Vec<u16> = off
            .expire(200 * s, OFFLINE_FLOW_IDLE_NS, 4)
            .iter()
            .map(|(k, c, _)| {
                assert_eq!(c.counts.packets, 1, "the flow's last counters come back");
                k.udp_sport
            })
            .collect();
        gone.sort();
        assert_eq!(gone, [1, 2, 3]);
        assert_eq!(sports(&off), [4, 5, 6, 7]);
        assert!(off.icrc_errors.keys().all(|k| k.udp_sport >= 4));
        // Flow 1 again: counted from zero.
        off.frame(&frame(1, 1, 201 * s), |_| {});
        let k = off.flows.keys().find(|k| k.udp_sport == 1).copied().unwrap();
        assert_eq!(off.flows[&k].1.counts.packets, 1);
        // Nothing idle, within the bound: nothing forgotten.
        assert!(off.expire(201 * s, OFFLINE_FLOW_IDLE_NS, 10).is_empty());
    }

    /// In fleet mode a record handed to the publisher is not delivered until JetStream
    /// acknowledges it: the agent's last line must not call it acknowledged before.
    #[test]
    fn fleet_mode_counts_what_jetstream_acknowledged() {
        let d = |made, sent, resent, acked, dropped| Delivery {
            made,
            sent,
            resent,
            acked,
            dropped,
        };
        // The outbox made 100, dropped 10 and handed 90 over (acknowledged, to it).
        let outbox = AgentStats {
            observations: d(100, 90, 0, 90, 10),
            counters: d(50, 50, 0, 50, 0),
            connections: 0,
            ringbuf_drops: 3,
        };
        // NATS stored 70 of them, 5 were dropped while it was away, 15 are in flight.
        let published = crate::fleet::PublishStats {
            observations: d(90, 80, 4, 70, 5),
            counters: d(50, 50, 0, 50, 0),
            ..Default::default()
        };
        let s = fleet_stats(outbox, &published);
        assert_eq!(s.observations, d(100, 80, 4, 70, 15));
        assert_eq!(s.observations.pending(), 15);
        assert_eq!(s.counters, d(50, 50, 0, 50, 0));
        assert_eq!(s.ringbuf_drops, 3);
    }

    #[test]
    fn the_shipped_example_config_is_valid() {
        let p = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../dist/agent.toml"));
        let c = AgentConfig::load(p).unwrap();
        assert_eq!(c.collector.as_deref(), Some("collector.example.net:4792"));
        assert_eq!(c.expect_dscp, Some(vec![26, 48]));
        assert_eq!(
            c.tls_cert.as_deref(),
            Some(std::path::Path::new("/etc/roce-trace/node.pem"))
        );
        assert!(c.tls_key.is_some() && c.tls_ca.is_some() && c.token_file.is_none());
    }

    /// HELLO carries the node and the token as u16-long strings: an agent with a longer
    /// one could never connect, and would retry for ever; it is refused at the start.
    #[test]
    fn a_token_or_node_hello_cannot_carry_is_refused_at_the_start() {
        let opts = AgentOptions {
            collector: "127.0.0.1:4792".into(),
            ifaces: Vec::new(),
            ingress: None,
            egress: false,
            node: "h1".into(),
            token: "t".into(),
            tls: None,
            datapath: DatapathOptions::default(),
            interval: Duration::from_secs(1),
            queue: 1,
            clock_synced: false,
            metrics: None,
            metrics_token: None,
            fleet: None,
            mirrors: Default::default(),
            nic: None,
            privileges: Privileges::Keep,
        };
        assert!(opts.check().is_ok());
        // Metrics beyond loopback only with a bearer token.
        let open = AgentOptions {
            metrics: Some("0.0.0.0:9464".parse().unwrap()),
            ..opts.clone()
        };
        assert!(
            open.check()
                .unwrap_err()
                .to_string()
                .contains("--metrics-token-file")
        );
        assert!(
            AgentOptions {
                metrics_token: Some("s3cret".into()),
                ..open.clone()
            }
            .check()
            .is_ok()
        );
        assert!(
            AgentOptions {
                metrics: Some("127.0.0.1:9464".parse().unwrap()),
                ..opts.clone()
            }
            .check()
            .is_ok()
        );
        for (node, token) in [("h1", "t".repeat(65_536)), (&*"n".repeat(65_536), "t".into())] {
            let e = AgentOptions {
                node: node.into(),
                token,
                ..opts.clone()
            }
            .check()
            .unwrap_err();
            assert!(e.to_string().contains("65,535 bytes"), "{e}");
        }
    }

    #[test]
    fn unknown_keys_and_bad_values_are_refused_with_the_line() {
        let e = toml::from_str::<AgentConfig>("collector = \"x:1\"\nsampel_rate = 5\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unknown field `sampel_rate`") && e.contains("line 2"),
            "{e}"
        );
        let c: AgentConfig = toml::from_str("expect_dscp = [26, 99]").unwrap();
        assert!(c.validate().unwrap_err().contains("99"));
        let c: AgentConfig = toml::from_str("interval = \"soon\"").unwrap();
        assert!(c.validate().unwrap_err().contains("soon"));
    }
}
