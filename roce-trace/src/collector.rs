//! `roce-trace collect`: accepts many agents, joins what they observe (correlate.rs), and
//! serves the result: a live view, JSON over HTTP, Prometheus metrics, a report on exit.

pub use roce_trace_correlate::report::{AgentInfo, CollectorReport};
use std::{
    collections::{BTreeMap, HashMap},
    future::Future,
    net::SocketAddr,
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::Context as _;
use bytes::BytesMut;

use tokio::{io::AsyncWriteExt, net::TcpListener};

use crate::{
    correlate::{Direction, FlowReport, JoinConfig, JoinView, Joiner, Point, PointId, PointInfo, Snapshot},
    http::{self, Response},
    protocol::{Decoder, Encoder, Frame, ProtoError, ReadError, VERSION, read_frame},
};

#[derive(Clone, Debug)]
pub struct CollectorOptions {
    pub listen: SocketAddr,
    pub http: Option<SocketAddr>,
    /// The agents' shared token (empty: none; then `tls` is required).
    pub token: String,
    /// Mutual TLS on the agents' port: this collector's certificate, and every agent's
    /// required, signed by the CA, naming the node its HELLO claims ([`crate::tls`]).
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// An agent's connection silent this long is closed (agents send a HEARTBEAT at
    /// least every 5 s); the collector sends its own every third of it. A node whose
    /// connection is open and was heard from within it cannot open a second one.
    pub agent_timeout: Duration,
    /// Where the report is written: at start (an empty one: the path is checked before
    /// anything is collected), every `report_every` while running (zero: never), and on
    /// exit — each time whole, replacing the last ([`crate::sys::write_atomically`]).
    pub report: Option<PathBuf>,
    pub report_every: Duration,
    pub join: JoinConfig,
    /// Print the flow view every interval.
    pub live: bool,
    /// Ask each flow's source agent to trace it once (in-band probes); hops in the report.
    pub trace: bool,
    pub interval: Duration,
    /// The HTTP API's bearer token: every request must carry it (`Authorization: Bearer
    /// …`), and a member of a group sends it to the others. Required to serve the API
    /// beyond loopback.
    pub http_token: Option<String>,
    /// Fleet mode: also join a group of collectors on NATS JetStream, reading the
    /// partitions this member owns (agents publish there instead of connecting here).
    pub fleet: Option<FleetOptions>,
    /// Continuous verification (`--policy`): the policy judged every window, its
    /// history, metrics and alerts ([`crate::verdicts`]).
    pub continuous: Option<crate::verdicts::ContinuousOptions>,
}

#[derive(Clone, Debug)]
pub struct FleetOptions {
    pub nats: crate::fleet::NatsOptions,
    /// This member's id in the group (unique: two members with one id would read the
    /// same partitions).
    pub member_id: String,
}

/// A group member's own view of the group, refreshed every second.
#[derive(Default)]
struct Group {
    id: String,
    members: Vec<crate::fleet::MemberInfo>,
    owned: Vec<u32>,
    consumed: crate::fleet::ConsumeStats,
    /// Frames from NATS the join could not take (a point never declared), skipped.
    refused_frames: u64,
}

/// A connection, as the node's next connection needs it: the next one's WELCOME says
/// how much of it was processed.
struct ConnRec {
    id: u64,
    /// Still being served (cleared when its task processes nothing more).
    open: AtomicBool,
    /// When its last frame arrived (the collector's clock, ns since start).
    heard_ns: AtomicU64,
    /// Frames processed (the next sequence number): those below are in the join.
    processed: AtomicU64,
    /// The last connection before it that processed anything past its HELLO — the one its
    /// agent may still hold frames of, when this one got no further than the handshake
    /// (its agent may never have seen the WELCOME).
    before: Mutex<Option<Arc<ConnRec>>>,
}

/// A node's latest connection, and how to end it when the node connects again (it must
/// stop processing before the new one can say how much it processed).
struct Conn {
    rec: Arc<ConnRec>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    /// Resolves once that connection's task processes nothing more.
    done: Option<tokio::sync::oneshot::Receiver<()>>,
}

#[derive(Default)]
struct State {
    joiner: Option<Joiner>,
    agents: BTreeMap<String, AgentInfo>,
    refused: u64,
    /// Per node, its latest connection.
    conns: HashMap<String, Conn>,
    /// The last connection id given out (random start: ids differ across restarts).
    last_conn: u64,
    /// Per connected agent, where to send it requests (and the connection's id).
    requesters: HashMap<String, (u64, tokio::sync::mpsc::UnboundedSender<Frame>)>,
    /// Probe results per flow, and the flows a trace was asked for.
    probes: HashMap<crate::observation::FlowId, crate::protocol::ProbeResult>,
    traced: std::collections::HashSet<crate::observation::FlowId>,
    /// Flows with a path whose trace could not be asked for yet (no agent on their source).
    untraced: Vec<crate::observation::FlowId>,
    /// Fleet mode: the group this collector is a member of.
    group: Option<Group>,
    next_trace: u32,
    /// `/trace` is served (`--trace`), within a budget for the whole collector.
    trace_on_request: bool,
    trace_budget: TraceBudget,
    /// The HTTP API's bearer token, sent to the group's other members.
    http_token: Option<String>,
    /// The agents' NIC and PFC counters, per port.
    nic: roce_trace_correlate::NicTable,
    /// The web view's main fragment as last built, when, and how long building it took:
    /// however many browsers refresh, it is built at most once per [`ui_reuse`].
    ui_main: Option<(Instant, Duration, Arc<String>)>,
    /// Continuous verification, behind a lock of its own: judging never holds the join's.
    judge: Option<Arc<parking_lot::Mutex<crate::verdicts::Judge>>>,
}

/// How long a built `/ui/main` is served again: half the page's refresh period, or four
/// times what building it took (a large table: the map then costs at most a quarter of a
/// core, however many look).
fn ui_reuse(took: Duration) -> Duration {
    Duration::from_millis(crate::pictures::html::REFRESH_MS / 2).max(took * 4)
}

/// `/ui/main` as built lately, if still fresh.
fn ui_cached(st: &Shared) -> Option<Arc<String>> {
    st.lock()
        .ui_main
        .as_ref()
        .filter(|(at, took, _)| at.elapsed() < ui_reuse(*took))
        .map(|(_, _, page)| page.clone())
}

/// Keeps a `/ui/main` built from `started` on.
fn ui_keep(st: &Shared, started: Instant, page: String) -> Arc<String> {
    // The checks judged continuously (`--policy`), below the map.
    let page = Arc::new(match ui_verdicts(st) {
        Some(v) => crate::pictures::html::main_with_verdicts(&page, &v),
        None => page,
    });
    st.lock().ui_main = Some((Instant::now(), started.elapsed(), page.clone()));
    page
}

/// `/trace` requests the whole collector takes: a burst of [`TraceBudget::BURST`], then
/// [`TraceBudget::PER_SECOND`] a second (a token bucket). Each asks an agent to send
/// probes into the fabric: no client may make the agents flood it.
struct TraceBudget(crate::budget::TokenBucket);

impl TraceBudget {
    const BURST: u32 = 20;
    const PER_SECOND: f64 = 5.0;

    fn take(&mut self, now: Instant) -> bool {
        self.0.take(now)
    }
}

impl Default for TraceBudget {
    fn default() -> Self {
        Self(crate::budget::TokenBucket::new(Self::BURST, Self::PER_SECOND))
    }
}

/// What a reader takes from the state while the agents' frames wait: the join's flows
/// by pointer, the agents and the probes. Every report is built from it afterwards, with
/// the lock released.
struct Taken {
    snapshot: Snapshot,
    agents: Vec<AgentInfo>,
    refused: u64,
    probes: HashMap<crate::observation::FlowId, crate::protocol::ProbeResult>,
    nic: Vec<roce_trace_correlate::NicPortReport>,
}

impl Taken {
    fn of(s: &State) -> Self {
        Self {
            snapshot: s.joiner.as_ref().expect("joiner").snapshot(),
            agents: s.agents.values().cloned().collect(),
            refused: s.refused,
            probes: s.probes.clone(),
            nic: s.nic.report(),
        }
    }

    /// The report, built without the lock.
    fn report(self) -> CollectorReport {
        let view = self.snapshot.view();
        let flows = flow_reports(&view, &self.probes);
        let mut anomalies = view.anomalies();
        anomalies.extend(roce_trace_correlate::nic::pause_anomalies(&flows, &self.nic));
        CollectorReport {
            kind: "collector_report".into(),
            stats: view.stats,
            refused_connections: self.refused,
            agents: self.agents,
            points: view.points().to_vec(),
            health: view.health_summary(),
            flows,
            anomalies,
            nic: self.nic,
        }
    }
}

/// Every flow's report in label order, with the probe result of each traced flow.
fn flow_reports(
    view: &JoinView,
    probes: &HashMap<crate::observation::FlowId, crate::protocol::ProbeResult>,
) -> Vec<FlowReport> {
    view.flow_ids()
        .filter_map(|id| {
            view.flow_report(id).map(|mut r| {
                r.probe = probes.get(id).cloned();
                r
            })
        })
        .collect()
}

/// Flows read under the lock at a time by `/flows`.
const FLOWS_CHUNK: usize = 1024;

/// Every flow's report in label order, read from the join a chunk at a time
/// ([`Joiner::chunk_view`]): the lock is held only to take each chunk, and the join copies
/// a flow it changes only while that flow's chunk is being built, so a client polling
/// `/flows` on a large table costs the agents' ingest next to nothing. Each report is as
/// of its chunk.
fn flows_a_chunk_at_a_time(st: &StateLock) -> Vec<FlowReport> {
    let mut out = Vec::new();
    each_flow_a_chunk_at_a_time(st, |r| {
        out.push(r);
        Ok::<_, std::convert::Infallible>(())
    })
    .unwrap_or_else(|never| match never {});
    out
}

/// `/flows` of one collector as JSON, each report serialised as soon as it is built and
/// streamed to the client ([`Response::json_streamed`]): a chunk of reports and a few
/// chunks of text at a time in memory, never the table's worth.
struct FlowsJson(Shared);

impl serde::Serialize for FlowsJson {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq as _;
        let mut seq = s.serialize_seq(None)?;
        each_flow_a_chunk_at_a_time(&self.0, |r| seq.serialize_element(&r))?;
        seq.end()
    }
}

/// Calls `each` with every flow's report in label order, reading the join a chunk at a
/// time (see [`flows_a_chunk_at_a_time`]); stops at its first error.
fn each_flow_a_chunk_at_a_time<E>(
    st: &StateLock,
    mut each: impl FnMut(FlowReport) -> Result<(), E>,
) -> Result<(), E> {
    let mut cursor = None;
    loop {
        let (ids, view, probes) = {
            let s = st.lock();
            let (ids, view) = s
                .joiner
                .as_ref()
                .expect("joiner")
                .chunk_view(cursor.as_ref(), FLOWS_CHUNK);
            let probes: Vec<_> = ids.iter().map(|id| s.probes.get(id).cloned()).collect();
            (ids, view, probes)
        };
        let Some(last) = ids.last() else {
            return Ok(());
        };
        cursor = Some(*last);
        // The chunk's reports built first and the view let go of before they are
        // written out: while a view holds a flow, the join copies the flow to change it.
        let reports: Vec<FlowReport> = {
            let view = view.view();
            ids.iter()
                .zip(probes)
                .filter_map(|(id, probe)| {
                    let mut r = view.flow_report(id)?;
                    r.probe = probe;
                    Some(r)
                })
                .collect()
        };
        for r in reports {
            each(r)?;
        }
    }
}

impl State {
    /// Asks the agent on the flow's source node to trace it; where it went.
    fn request_trace(&mut self, id: crate::observation::FlowId) -> Option<String> {
        let (node, dscp, ecn) = self.joiner.as_ref()?.trace_target(&id)?;
        let (_, tx) = self.requesters.get(&node)?;
        self.next_trace += 1;
        tx.send(Frame::TraceRequest {
            id: self.next_trace,
            flow: id,
            dscp,
            ecn,
        })
        .ok()?;
        self.traced.insert(id);
        Some(node)
    }
}

/// The collector's state, behind a lock that is handed over fairly: the agents' frames
/// take it back to back under load, and a lock that lets the last holder take it again
/// would starve a view's short turns (`/flows` takes it once per chunk); parking_lot's
/// hands it to a thread that waited more than half a millisecond.
type StateLock = parking_lot::Mutex<State>;
type Shared = Arc<StateLock>;

/// Agents' connections handshaking at once, at most: more are refused (counted) until
/// one is done. With [`crate::protocol::MAX_HELLO`] each, what unauthenticated peers can make the
/// collector hold is bounded (64 × 128 KiB = 8 MiB of frames, plus their sockets).
const MAX_HANDSHAKES: usize = 64;
/// Agents' connections at once, at most (a fleet larger than this reports through NATS).
const MAX_CONNECTIONS: usize = 16_384;
/// How long a new connection has to present its HELLO, and a refused one to take its
/// BYE.
const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(5);

/// How long an agent's connection may stay silent before it is closed (the default of
/// `--agent-timeout`): three of the agents' 5 s heartbeats missed.
pub const AGENT_TIMEOUT: Duration = Duration::from_secs(16);

/// Flows waiting for their source's agent to trace them, at most.
const MAX_UNTRACED: usize = 10_000;

fn now_ns(start: Instant) -> u64 {
    start.elapsed().as_nanos() as u64
}

/// Writes the report whole, replacing the last one (a reader, or a crash, never sees a
/// part of it).
fn write_report(path: &std::path::Path, r: &CollectorReport) -> anyhow::Result<()> {
    let bytes = serde_json::to_vec_pretty(r)?;
    crate::sys::write_atomically(path, &bytes)
        .with_context(|| format!("writing the report {}", path.display()))
}

/// The report: taken under the lock (a pointer per flow), built without it.
fn report(st: &Shared) -> CollectorReport {
    let taken = Taken::of(&st.lock());
    taken.report()
}

/// Runs until `shutdown`; `ready` gets the bound agent and HTTP addresses.
pub async fn run(
    opts: CollectorOptions,
    shutdown: impl Future<Output = ()>,
    ready: impl FnOnce(SocketAddr, Option<SocketAddr>),
) -> anyhow::Result<CollectorReport> {
    anyhow::ensure!(
        !opts.token.is_empty() || opts.tls.is_some(),
        "agents must authenticate: give a token (--token-file) or TLS certificates (--tls-cert, --tls-key, --tls-ca)"
    );
    anyhow::ensure!(
        opts.agent_timeout >= Duration::from_secs(6),
        "--agent-timeout must be at least 6s: agents send a HEARTBEAT every 5 s"
    );
    let start = Instant::now();
    let mut joiner = Joiner::new(opts.join);
    if opts.trace {
        joiner.note_new_paths();
    }
    if let Some(addr) = opts.http {
        anyhow::ensure!(
            addr.ip().is_loopback() || opts.http_token.is_some(),
            "--http {addr} would serve the API beyond this host to anyone: give --http-token-file FILE (clients then send `Authorization: Bearer <token>`), or listen on a loopback address"
        );
    }
    let judge = opts
        .continuous
        .clone()
        .map(crate::verdicts::Judge::new)
        .transpose()?
        .map(|j| Arc::new(parking_lot::Mutex::new(j)));
    let state: Shared = Arc::new(StateLock::new(State {
        judge: judge.clone(),
        joiner: Some(joiner),
        trace_on_request: opts.trace,
        http_token: opts.http_token.clone(),
        nic: Default::default(),
        last_conn: std::hash::BuildHasher::hash_one(&std::collections::hash_map::RandomState::new(), start),
        ..State::default()
    }));
    if let Some(path) = &opts.report {
        // The output path is checked before anything is collected: an empty report.
        write_report(path, &report(&state))?;
    }
    let listener = TcpListener::bind(opts.listen)
        .await
        .with_context(|| format!("listening on {}", opts.listen))?;
    let local = listener.local_addr()?;
    let mut http_addr = None;
    if let Some(addr) = opts.http {
        let st = state.clone();
        let bearer = opts.http_token.as_deref().map(Arc::from);
        let (bound, serve) = http::bind(addr, bearer, move |path, query| api(&st, path, query))
            .await
            .with_context(|| format!("HTTP on {addr}"))?;
        http_addr = Some(bound);
        tokio::spawn(serve);
    }
    // Fleet mode: a member of the group, reading the partitions it owns from NATS.
    let mut group = None;
    if let Some(f) = &opts.fleet {
        use crate::fleet::{GroupMember, MemberOptions};
        let http = http_addr.context("fleet mode needs --http: every member serves the group's view")?;
        let fleet = crate::fleet::connect(f.nats.clone())
            .await
            .context("fleet mode: connecting to NATS")?;
        let (tx, rx) = tokio::sync::mpsc::channel(256);
        let member = Arc::new(
            GroupMember::join(
                &fleet,
                MemberOptions {
                    id: f.member_id.clone(),
                    http: http.to_string(),
                },
                tx,
            )
            .await
            .context("fleet mode: joining the group")?,
        );
        state.lock().group = Some(Group {
            id: f.member_id.clone(),
            ..Group::default()
        });
        tokio::spawn(fleet_ingest(rx, state.clone(), start, f.nats.partitions));
        let (st, m) = (state.clone(), member.clone());
        let refresh = tokio::spawn(async move {
            loop {
                let members = m.members().await;
                {
                    let mut s = st.lock();
                    if let Some(g) = &mut s.group {
                        if let Ok(v) = members {
                            g.members = v;
                        }
                        g.owned = m.owned();
                        g.consumed = m.stats();
                    }
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
        tracing::info!(
            "fleet: member `{}` of the group on NATS {}",
            f.member_id,
            f.nats.urls.join(",")
        );
        group = Some((member, refresh));
    }
    ready(local, http_addr);

    let token = Arc::new(opts.token.clone());
    let tls = opts.tls.clone().map(tokio_rustls::TlsAcceptor::from);
    let agent_timeout = opts.agent_timeout;
    let st = state.clone();
    let accept = async move {
        let handshakes = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
        let connections = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
        loop {
            let (sock, peer) = match listener.accept().await {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors (or memory): a pause, not a spin, until a
                    // connection closes.
                    tracing::warn!("accepting an agent's connection: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let (Ok(conn), Ok(hs)) = (
                connections.clone().try_acquire_owned(),
                handshakes.clone().try_acquire_owned(),
            ) else {
                st.lock().refused += 1;
                tracing::warn!(
                    "agent {peer}: refused: {MAX_CONNECTIONS} connections or {MAX_HANDSHAKES} handshakes under way"
                );
                continue;
            };
            let st = st.clone();
            let token = token.clone();
            let tls = tls.clone();
            tokio::spawn(async move {
                let _conn = conn;
                let why = match tls {
                    None => {
                        let sock: Box<dyn Stream> = Box::new(sock);
                        serve_agent(sock, None, peer, &st, &token, start, hs, agent_timeout).await
                    }
                    Some(tls) => match tokio::time::timeout(HANDSHAKE_DEADLINE, tls.accept(sock)).await {
                        Ok(Ok(s)) => {
                            let cert = s.get_ref().1.peer_certificates().and_then(|c| c.first()).cloned();
                            let sock: Box<dyn Stream> = Box::new(s);
                            serve_agent(sock, cert, peer, &st, &token, start, hs, agent_timeout).await
                        }
                        Ok(Err(e)) => {
                            st.lock().refused += 1;
                            Closed::Tls(e)
                        }
                        Err(_) => {
                            st.lock().refused += 1;
                            Closed::NoHello
                        }
                    },
                };
                tracing::warn!("agent {peer}: connection closed: {why}");
            });
        }
    };
    let st = state.clone();
    let live = opts.live;
    let trace_flows = opts.trace;
    let (report_path, report_every) = (opts.report.clone(), opts.report_every);
    let ticker = async move {
        let mut t = tokio::time::interval(Duration::from_millis(200));
        let mut last_view = Instant::now();
        // The live view is built and printed on a thread of its own, one at a time: a
        // large table never holds up the agents' frames, and a slow terminal only
        // delays the next view.
        let mut printing: Option<tokio::task::JoinHandle<()>> = None;
        // The report, written every `report_every` on a thread of its own, one at a time.
        let mut writing: Option<tokio::task::JoinHandle<()>> = None;
        let mut last_report = Instant::now();
        let mut gave_back = 0;
        loop {
            t.tick().await;
            let mut s = st.lock();
            s.joiner.as_mut().expect("joiner").tick(now_ns(start));
            let now_gave_back = s.joiner.as_ref().expect("joiner").gave_back();
            if now_gave_back != gave_back {
                // A burst's state was freed: hand what the allocator keeps back to the
                // system, on a thread of its own, outside the lock.
                gave_back = now_gave_back;
                tokio::task::spawn_blocking(release_freed_memory);
            }
            if trace_flows {
                // Each flow is traced once, from its source, as soon as it has a path.
                // A flow whose source agent is not connected yet is tried again at each
                // tick (the oldest forgotten past a bound).
                let new = s.joiner.as_mut().expect("joiner").take_new_paths();
                let mut untraced = std::mem::take(&mut s.untraced);
                untraced.extend(new);
                untraced.retain(|id| !s.traced.contains(id) && s.request_trace(*id).is_none());
                let over = untraced.len().saturating_sub(MAX_UNTRACED);
                untraced.drain(..over);
                s.untraced = untraced;
            }
            if let Some(path) = &report_path
                && !report_every.is_zero()
                && last_report.elapsed() >= report_every
                && writing.as_ref().is_none_or(|w| w.is_finished())
            {
                last_report = Instant::now();
                let taken = Taken::of(&s);
                let path = path.clone();
                writing = Some(tokio::task::spawn_blocking(move || {
                    if let Err(e) = write_report(&path, &taken.report()) {
                        tracing::warn!("{e:#}");
                    }
                }));
            }
            if live
                && last_view.elapsed() >= opts.interval
                && printing.as_ref().is_none_or(|p| p.is_finished())
            {
                last_view = Instant::now();
                let taken = Taken::of(&s);
                printing = Some(tokio::task::spawn_blocking(move || {
                    use std::io::Write as _;
                    // A closed stdout (EPIPE) ends the view, not the collector.
                    let _ = std::io::stdout()
                        .lock()
                        .write_all(render(&taken.report()).as_bytes());
                }));
            }
        }
    };
    let judging = continuous(state.clone(), judge);
    tokio::select! {
        _ = shutdown => {}
        _ = accept => {}
        _ = ticker => {}
        _ = judging => {}
    }
    if let Some((member, refresh)) = group {
        refresh.abort();
        let _ = refresh.await;
        // Handing the partitions over at once (the others replay them) rather than when
        // the lease lapses.
        if let Ok(m) = Arc::try_unwrap(member)
            && let Err(e) = m.leave().await
        {
            tracing::warn!("fleet: leaving the group: {e}");
        }
    }
    state.lock().joiner.as_mut().expect("joiner").flush();
    let r = report(&state);
    if let Some(path) = &opts.report {
        write_report(path, &r)?;
    }
    Ok(r)
}

/// Continuous verification: every `--verify-every` a report (in a group, the group's,
/// by the member that judges: the one with the least id), the window since the report
/// `--verify-window` before it, judged on a thread of its own — one at a time, reading
/// the join a chunk of flows at a time ([`judged_report`]).
async fn continuous(st: Shared, judge: Option<Arc<parking_lot::Mutex<crate::verdicts::Judge>>>) {
    let Some(judge) = judge else {
        return std::future::pending().await;
    };
    let (every, window) = {
        let j = judge.lock();
        (j.opts.every, j.opts.window)
    };
    let mut t = tokio::time::interval(every);
    t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let snapshots = Arc::new(parking_lot::Mutex::new(crate::verdicts::Snapshots::default()));
    let mut running: Option<tokio::task::JoinHandle<()>> = None;
    loop {
        t.tick().await;
        let judging = {
            let s = st.lock();
            // In a group, once the leases are read: the member with the least id.
            s.group
                .as_ref()
                .is_none_or(|g| g.members.iter().map(|m| m.id.as_str()).min() == Some(g.id.as_str()))
        };
        let was = std::mem::replace(&mut judge.lock().judging, judging);
        if !judging {
            if was {
                tracing::info!("verdict: another member of the group judges now");
            }
            // Another member judges: its windows, not a stale base, when this one takes over.
            *snapshots.lock() = Default::default();
            continue;
        }
        if running.as_ref().is_some_and(|r| !r.is_finished()) {
            judge.lock().skipped_busy += 1;
            continue;
        }
        let at_ms = crate::verdicts::unix_ms();
        let started = Instant::now();
        let grouped = st.lock().group.is_some();
        let (st2, judge2, snapshots2) = (st.clone(), judge.clone(), snapshots.clone());
        running = Some(tokio::task::spawn_blocking(move || {
            let mut now = judged_report(&st2);
            if grouped {
                match from_members::<CollectorReport>(&st2, "/report", "") {
                    Ok(others) => {
                        let mut all = vec![now];
                        all.extend(others);
                        now = CollectorReport::merge(all);
                    }
                    Err(_) => {
                        judge2.lock().skipped_partial += 1;
                        return;
                    }
                }
            }
            let Some((w, report)) = snapshots2.lock().window(at_ms, now, window, every / 2) else {
                return;
            };
            let (policy, load) = {
                let j = judge2.lock();
                (j.opts.policy.clone(), j.opts.load)
            };
            let checks = crate::verify::checks::judge(&policy, &report, load);
            let took = started.elapsed().as_micros() as u64;
            judge2.lock().record(w, at_ms, report.flows.len(), checks, took);
            // A window's reports are a burst: what the allocator keeps of them goes back.
            drop(report);
            release_freed_memory();
        }));
    }
}

/// The report a window is judged on: every flow's report read a chunk at a time (as
/// `/flows` reads them: the join copies a flow it changes only while that flow's chunk
/// is being built, so judging a large table costs the agents' ingest next to nothing;
/// each flow as of its chunk), the points and the NIC ports — not the anomalies, agents
/// or health, which no check reads.
fn judged_report(st: &Shared) -> CollectorReport {
    let flows = flows_a_chunk_at_a_time(st);
    let s = st.lock();
    let j = s.joiner.as_ref().expect("joiner");
    CollectorReport {
        kind: "collector_report".into(),
        stats: j.stats,
        refused_connections: s.refused,
        agents: Vec::new(),
        points: j.points().to_vec(),
        health: Vec::new(),
        flows,
        anomalies: Vec::new(),
        nic: s.nic.report(),
    }
}

use crate::protocol::{Stream, StreamReader as AgentReader, StreamWriter as AgentWriter};

/// One agent's connection: handshake, then frames into the join, until it ends (why).
/// Any protocol error closes this connection only. `cert`: the agent's certificate, when
/// it connected over TLS (verified against the CA already): it must name the node.
#[expect(
    clippy::too_many_arguments,
    reason = "one connection's setting, passed down once"
)]
async fn serve_agent(
    mut sock: Box<dyn Stream>,
    cert: Option<rustls_pki_types::CertificateDer<'static>>,
    peer: SocketAddr,
    st: &Shared,
    token: &str,
    start: Instant,
    handshake: tokio::sync::OwnedSemaphorePermit,
    timeout: Duration,
) -> Closed {
    // Before the peer is known it can make this connection hold a HELLO's worth at most.
    let mut buf = BytesMut::with_capacity(4 * 1024);
    let mut dec = Decoder::handshake();
    let mut enc = Encoder::default();
    let first = tokio::time::timeout(HANDSHAKE_DEADLINE, read_frame(&mut sock, &mut buf, &mut dec)).await;
    let hello = match first {
        Ok(Ok(Some(Frame::Hello {
            version,
            node,
            token: t,
            clock_synced,
        }))) => {
            // With TLS the certificate speaks for the node (and a token, if one is set,
            // must be right too); without, the token alone.
            let identity = cert.as_ref().map(|c| crate::tls::cert_names_node(c, &node));
            if version != VERSION {
                Err(Closed::Version(ProtoError::Version(version)))
            } else if !token.is_empty() && !http::same_secret(t.as_bytes(), token.as_bytes()) {
                Err(Closed::WrongToken(node))
            } else if let Some(Err(why)) = identity {
                Err(Closed::WrongIdentity { node, why })
            } else {
                Ok((node, clock_synced))
            }
        }
        Ok(Ok(_)) => Err(Closed::NotHello),
        Ok(Err(e)) => Err(Closed::Handshake(e)),
        Err(_) => Err(Closed::NoHello),
    };
    let (node, clock_synced) = match hello {
        Ok(h) => h,
        Err(why) => {
            let told = matches!(
                why,
                Closed::Version(_) | Closed::WrongToken(_) | Closed::WrongIdentity { .. }
            );
            return refuse(st, &mut sock, why, told).await;
        }
    };
    dec.authenticated();
    drop(handshake);
    let (conn, stop, done, previous) = match take_over(st, &node, dec.next_seq(), start, timeout).await {
        Ok(c) => c,
        Err(why) => return refuse(st, &mut sock, why, true).await,
    };
    let welcome = Frame::Welcome {
        version: VERSION,
        connection: conn.id,
        previous: previous.map_or(0, |p| p.0),
        previous_frames: previous.map_or(0, |p| p.1),
    };
    let written = match enc.encode(&welcome) {
        Ok(wire) => sock.write_all(&wire).await.map_err(Closed::Welcoming),
        Err(e) => Err(Closed::Welcome(e)),
    };
    if let Err(e) = written {
        drop(done);
        return e;
    }
    tracing::info!("agent `{node}` connected from {peer}");
    {
        let mut s = st.lock();
        let a = s.agents.entry(node.clone()).or_default();
        a.node = node.clone();
        a.peer = peer.to_string();
        a.connected = true;
        a.connections += 1;
        a.clock_synced = clock_synced;
    }
    // Frames to this agent (ACKs, traces, BYE) go through a writer task; reading stays
    // here. ACKs go through a watch: only the latest counts, so an agent that does not
    // read them costs no memory.
    let (rd, wr) = tokio::io::split(sock);
    let (req_tx, req_rx) = tokio::sync::mpsc::unbounded_channel::<Frame>();
    let (ack_tx, ack_rx) = tokio::sync::watch::channel(0u64);
    st.lock()
        .requesters
        .insert(node.clone(), (conn.id, req_tx.clone()));
    let writer = tokio::spawn(write_to_agent(
        wr,
        enc,
        req_rx,
        ack_rx,
        (timeout / 3).min(Duration::from_secs(5)),
    ));
    let closed = serve_frames(
        rd,
        buf,
        dec,
        st,
        &node,
        clock_synced,
        start,
        &conn,
        stop,
        &ack_tx,
        timeout,
    )
    .await;
    conn.open.store(false, Ordering::SeqCst);
    let reason = closed.to_string();
    {
        let mut s = st.lock();
        if s.requesters.get(&node).is_some_and(|(id, _)| *id == conn.id) {
            s.requesters.remove(&node);
        }
        if let Some(a) = s.agents.get_mut(&node) {
            a.connected = false;
            a.last_disconnect = Some(reason.clone());
        }
    }
    // Nothing more of this connection is processed: a new one from the node may go on.
    drop(done);
    // The agent is told why, when it is still there to hear it.
    if closed.is_violation() {
        // Cut to fit its u16-long string (a reason may quote a long node name).
        let _ = req_tx.send(Frame::bye(reason));
    }
    drop(req_tx);
    let mut writer = writer;
    if tokio::time::timeout(Duration::from_secs(1), &mut writer)
        .await
        .is_err()
    {
        writer.abort();
    }
    drop(ack_tx);
    closed
}

/// A connection refused at its handshake: counted, and told why with BYE when `tell`
/// (within the handshake deadline); `why` is handed back.
async fn refuse(st: &Shared, sock: &mut Box<dyn Stream>, why: Closed, tell: bool) -> Closed {
    st.lock().refused += 1;
    if tell && let Ok(bye) = Encoder::default().encode(&Frame::bye(why.to_string())) {
        let _ = tokio::time::timeout(HANDSHAKE_DEADLINE, sock.write_all(&bye)).await;
    }
    why
}

/// Why an agent's connection ended: refused at the handshake (counted as refused; a
/// wrong version or token is told with BYE), a protocol violation after it (told with
/// BYE), or the agent going away.
#[derive(Debug, thiserror::Error)]
enum Closed {
    #[error("handshake: {0}")]
    Handshake(ReadError),
    #[error("no HELLO within 5 s")]
    NoHello,
    #[error("the first frame was not HELLO")]
    NotHello,
    #[error("{0}")]
    Version(ProtoError),
    #[error("node `{0}` presented a wrong token")]
    WrongToken(String),
    #[error("TLS handshake: {0}")]
    Tls(std::io::Error),
    #[error("HELLO for node `{node}` refused: {why}")]
    WrongIdentity { node: String, why: String },
    #[error(
        "node `{node}` is connected already (from {peer}, heard from within {}s): one session per node",
        timeout.as_secs()
    )]
    AlreadyConnected {
        node: String,
        peer: String,
        timeout: Duration,
    },
    #[error("nothing from the agent for {}s", .0.as_secs())]
    Silent(Duration),
    #[error("handshake: {0}")]
    Welcome(ProtoError),
    #[error("{0}")]
    Welcoming(std::io::Error),
    #[error("{0}")]
    BadFrame(ProtoError),
    #[error("node `{0}` connected again: this connection is replaced")]
    Replaced(String),
    #[error("{what} undeclared point {point}")]
    UndeclaredPoint { what: &'static str, point: u16 },
    #[error("a frame an agent does not send")]
    WrongFrame,
    #[error("the agent went away")]
    WentAway,
    #[error("{0}")]
    Lost(ReadError),
    #[error("agent said goodbye: {0}")]
    Goodbye(String),
}

/// The first point of `used` the agent never declared, as the reason to close.
fn undeclared(
    points: &HashMap<u16, PointId>,
    mut used: impl Iterator<Item = u16>,
    what: &'static str,
) -> Option<Closed> {
    used.find(|p| !points.contains_key(p))
        .map(|point| Closed::UndeclaredPoint { what, point })
}

impl Closed {
    /// The agent broke the protocol (or was replaced) after its handshake: it is told why.
    fn is_violation(&self) -> bool {
        matches!(
            self,
            Self::BadFrame(_)
                | Self::Replaced(_)
                | Self::UndeclaredPoint { .. }
                | Self::WrongFrame
                | Self::Silent(_)
        )
    }
}

/// Registers a new connection from `node` (`processed` frames so far: the HELLO) as its
/// latest, after stopping the one before (one open but silent for `timeout`: its agent
/// gave up on it) and waiting until it processes nothing more; returns the new
/// connection's record, stop signal and done guard, and the id and frames processed of
/// the node's previous connection that counts. Refused while the node's connection is
/// open and was heard from within `timeout`: one session per node.
async fn take_over(
    st: &Shared,
    node: &str,
    processed: u64,
    start: Instant,
    timeout: Duration,
) -> Result<
    (
        Arc<ConnRec>,
        tokio::sync::oneshot::Receiver<()>,
        tokio::sync::oneshot::Sender<()>,
        Option<(u64, u64)>,
    ),
    Closed,
> {
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let (rec, old) = {
        let mut s = st.lock();
        let now = now_ns(start);
        if let Some(c) = s.conns.get(node)
            && c.rec.open.load(Ordering::SeqCst)
            && now.saturating_sub(c.rec.heard_ns.load(Ordering::SeqCst)) < timeout.as_nanos() as u64
        {
            return Err(Closed::AlreadyConnected {
                node: node.to_owned(),
                peer: s.agents.get(node).map_or_else(String::new, |a| a.peer.clone()),
                timeout,
            });
        }
        s.last_conn = s.last_conn.wrapping_add(1).max(1);
        let rec = Arc::new(ConnRec {
            id: s.last_conn,
            open: AtomicBool::new(true),
            heard_ns: AtomicU64::new(now),
            processed: AtomicU64::new(processed),
            before: Mutex::new(None),
        });
        let conn = Conn {
            rec: rec.clone(),
            stop: Some(stop_tx),
            done: Some(done_rx),
        };
        (rec, s.conns.insert(node.to_owned(), conn))
    };
    let mut previous = None;
    if let Some(mut old) = old {
        if let Some(stop) = old.stop.take() {
            let _ = stop.send(());
        }
        if let Some(done) = old.done.take() {
            let _ = tokio::time::timeout(Duration::from_secs(5), done).await;
        }
        let older = old.rec.before.lock().expect("conn").take();
        let last = if old.rec.processed.load(Ordering::SeqCst) > 1 {
            Some(old.rec)
        } else {
            older
        };
        previous = last.as_ref().map(|r| (r.id, r.processed.load(Ordering::SeqCst)));
        *rec.before.lock().expect("conn") = last;
    }
    Ok((rec, stop_rx, done_tx, previous))
}

/// Writes requests, ACKs (the latest frame processed), a HEARTBEAT every `beat` (so the
/// agent knows the collector is there) and the closing BYE to the agent.
async fn write_to_agent(
    mut wr: AgentWriter,
    mut enc: Encoder,
    mut req_rx: tokio::sync::mpsc::UnboundedReceiver<Frame>,
    mut ack_rx: tokio::sync::watch::Receiver<u64>,
    beat: Duration,
) {
    let mut acks = true;
    let mut beats = tokio::time::interval_at(tokio::time::Instant::now() + beat, beat);
    beats.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let f = tokio::select! {
            biased;
            _ = beats.tick() => Frame::Heartbeat { unix_ns: crate::protocol::unix_now_ns() },
            f = req_rx.recv() => match f {
                Some(f) => f,
                None => break,
            },
            changed = ack_rx.changed(), if acks => match changed {
                Ok(()) => Frame::Ack { seq: *ack_rx.borrow_and_update() },
                Err(_) => {
                    acks = false;
                    continue;
                }
            },
        };
        // Nothing sent here is past what the format carries (a BYE is cut to fit); a
        // refused frame takes no sequence number and is left out, logged.
        let wire = match enc.encode(&f) {
            Ok(wire) => wire,
            Err(e) => {
                tracing::warn!("left out a frame the agent could not take: {e}");
                continue;
            }
        };
        if wr.write_all(&wire).await.is_err() {
            break;
        }
    }
}

/// The agent's frames into the join until the connection ends, `stop` fires (the node
/// connected again) or a frame breaks the protocol. Each OBSERVATIONS or COUNTERS frame
/// is acknowledged once processed.
#[expect(
    clippy::too_many_arguments,
    reason = "one connection's state, passed down once"
)]
async fn serve_frames(
    mut rd: AgentReader,
    mut buf: BytesMut,
    mut dec: Decoder,
    st: &Shared,
    node: &str,
    clock_synced: bool,
    start: Instant,
    conn: &ConnRec,
    mut stop: tokio::sync::oneshot::Receiver<()>,
    ack: &tokio::sync::watch::Sender<u64>,
    timeout: Duration,
) -> Closed {
    let mut points: HashMap<u16, PointId> = HashMap::new();
    loop {
        let f = tokio::select! {
            _ = tokio::time::sleep(timeout) => return Closed::Silent(timeout),
            f = read_frame(&mut rd, &mut buf, &mut dec) => match f {
                Ok(Some(f)) => f,
                Ok(None) => return Closed::WentAway,
                Err(ReadError::Protocol(e)) => return Closed::BadFrame(e),
                Err(e) => return Closed::Lost(e),
            },
            _ = &mut stop => return Closed::Replaced(node.to_owned()),
        };
        let now = now_ns(start);
        conn.heard_ns.store(now, Ordering::SeqCst);
        let data = match ingest(&mut st.lock(), node, clock_synced, true, &mut points, f, now) {
            Ok(data) => data,
            Err(closed) => return closed,
        };
        conn.processed.store(dec.next_seq(), Ordering::SeqCst);
        if data {
            ack.send_replace(dec.next_seq() - 1);
        }
    }
}

/// One frame from `node` into the join (its points mapped through `points`, which its
/// POINTS frames fill); whether it was data the agent wants acknowledged. The agents'
/// TCP connections and fleet mode's NATS consumers both come through here; `in_order`:
/// HEALTH follows the observations made before it (TCP), so it says how far the agent
/// has reported.
fn ingest(
    s: &mut State,
    node: &str,
    clock_synced: bool,
    in_order: bool,
    points: &mut HashMap<u16, PointId>,
    f: Frame,
    now: u64,
) -> Result<bool, Closed> {
    let mut data = false;
    match f {
        Frame::TraceResult(r) => {
            s.probes.insert(r.flow, r);
        }
        Frame::Points(decls) => {
            let j = s.joiner.as_mut().expect("joiner");
            for d in decls {
                let p = j.point(PointInfo {
                    // A mirror session is the switch's point, not the agent's.
                    node: if d.node.is_empty() {
                        node.to_owned()
                    } else {
                        d.node
                    },
                    iface: d.iface,
                    direction: Direction::of_datapath(d.direction),
                    clock_synced,
                    mtu: (d.mtu != 0).then_some(d.mtu),
                    mtu_history: Vec::new(),
                });
                points.insert(d.index, p);
            }
        }
        Frame::Observations(obs) => {
            if let Some(closed) = undeclared(points, obs.iter().map(|o| o.point), "observation from") {
                return Err(closed);
            }
            let State { joiner, agents, .. } = s;
            let j = joiner.as_mut().expect("joiner");
            for o in &obs {
                j.add(points[&o.point], o, now);
            }
            agents.get_mut(node).expect("registered").observations += obs.len() as u64;
            data = true;
        }
        Frame::Counters(deltas) => {
            if let Some(closed) = undeclared(points, deltas.iter().map(|d| d.point), "counters from") {
                return Err(closed);
            }
            let State { joiner, agents, .. } = s;
            let j = joiner.as_mut().expect("joiner");
            for d in &deltas {
                j.add_counters(points[&d.point], d, now);
            }
            agents.get_mut(node).expect("registered").counter_deltas += deltas.len() as u64;
            data = true;
        }
        Frame::Nic(v) => {
            for d in &v {
                s.nic.add(node, d);
            }
            data = true;
        }
        Frame::Health(v) => {
            if let Some(closed) = undeclared(points, v.iter().map(|h| h.point), "health of") {
                return Err(closed);
            }
            let j = s.joiner.as_mut().expect("joiner");
            for h in &v {
                j.add_health(points[&h.point], h);
                if in_order {
                    j.reported_to(points[&h.point], h.end_ns);
                }
            }
            data = true;
        }
        Frame::Dropped {
            observations,
            counters,
        } => {
            let a = s.agents.get_mut(node).expect("registered");
            a.dropped_observations = observations;
            a.dropped_counters = counters;
        }
        Frame::Heartbeat { .. } => {}
        Frame::Bye { reason } => return Err(Closed::Goodbye(reason)),
        Frame::Hello { .. } | Frame::Welcome { .. } | Frame::TraceRequest { .. } | Frame::Ack { .. } => {
            return Err(Closed::WrongFrame);
        }
    }
    Ok(data)
}

/// Fleet mode: what this member's NATS consumers deliver, into the join. A partition
/// lost is forgotten (gained again, it is replayed from the stream's start); a frame the
/// join cannot take is counted and skipped, and the next one goes on.
async fn fleet_ingest(
    mut rx: tokio::sync::mpsc::Receiver<crate::fleet::FleetEvent>,
    st: Shared,
    start: Instant,
    partitions: u32,
) {
    use crate::fleet::{Delivered, FleetEvent, partition_of};
    let mut points: HashMap<String, HashMap<u16, PointId>> = HashMap::new();
    while let Some(ev) = rx.recv().await {
        let now = now_ns(start);
        let mut s = st.lock();
        match ev {
            FleetEvent::Gained(p) => tracing::info!("fleet: partition {p} is ours: replaying it"),
            FleetEvent::Lost(p) => {
                let n = s
                    .joiner
                    .as_mut()
                    .expect("joiner")
                    .forget_where(|id| partition_of(id, partitions) == p);
                tracing::info!("fleet: partition {p} went to another member ({n} flows handed over)");
            }
            FleetEvent::Frame(Delivered {
                node,
                clock_synced,
                subject,
                frame,
            }) => {
                let a = s.agents.entry(node.clone()).or_default();
                if a.node.is_empty() {
                    a.node = node.clone();
                    a.peer = "NATS".into();
                    a.connected = true;
                    a.connections = 1;
                }
                let pts = points.entry(node.clone()).or_default();
                // Agents in fleet mode send no HELLO: whether their clock is synchronised
                // (one-way delays count) comes on every message but the point table (read
                // from the bucket), which takes what the node's messages last said.
                let synced = if matches!(frame, Frame::Points(_)) {
                    a.clock_synced
                } else {
                    if a.clock_synced != clock_synced {
                        a.clock_synced = clock_synced;
                        let j = s.joiner.as_mut().expect("joiner");
                        for pid in pts.values() {
                            let mut info = j.points()[*pid as usize].clone();
                            info.clock_synced = clock_synced;
                            j.point(info);
                        }
                    }
                    clock_synced
                };
                // HEALTH comes on a subject of its own, read apart from the partitions:
                // it may overtake the observations it follows (`in_order` false).
                if let Err(why) = ingest(&mut s, &node, synced, false, pts, frame, now) {
                    if let Some(g) = &mut s.group {
                        g.refused_frames += 1;
                    }
                    tracing::warn!("fleet: skipped a frame of `{node}` on {subject}: {why}");
                }
            }
        }
    }
}

/// Whether a request asks for this member's own part only (`local=1`), as members ask
/// each other when they build the group's view.
fn local_only(query: &str) -> bool {
    query.split('&').any(|kv| kv == "local=1")
}

/// Fleet mode: the group's other members, as the last refresh of the leases saw them
/// (none outside a group).
fn others(st: &Shared) -> Vec<crate::fleet::MemberInfo> {
    let s = st.lock();
    s.group
        .as_ref()
        .map(|g| g.members.iter().filter(|m| m.id != g.id).cloned().collect())
        .unwrap_or_default()
}

/// Fleet mode: `path` (with `query`, and `local=1`) from every other member of the
/// group; the first that fails makes the whole view fail (a partial view would be
/// taken for the fabric's).
fn from_members<T: serde::de::DeserializeOwned>(
    st: &Shared,
    path: &str,
    query: &str,
) -> Result<Vec<T>, Response> {
    let q = if query.is_empty() {
        "local=1".to_owned()
    } else {
        format!("{query}&local=1")
    };
    let mut out = Vec::new();
    let bearer = st.lock().http_token.clone();
    for m in others(st) {
        let got = m
            .http
            .parse()
            .map_err(anyhow::Error::from)
            .and_then(|addr| http::get_json_as(addr, &format!("{path}?{q}"), bearer.as_deref()));
        match got {
            Ok(v) => out.push(v),
            Err(e) => {
                return Err(Response::text(
                    503,
                    format!(
                        "the group's view is incomplete: member `{}` ({}) did not answer: {e:#}\n",
                        m.id, m.http
                    ),
                ));
            }
        }
    }
    Ok(out)
}

/// The HTTP API (fleet mode: the group's view, merged from every member).
fn api(st: &Shared, path: &str, query: &str) -> Response {
    match group_api(st, path, query) {
        Ok(Some(r)) | Err(r) => r,
        Ok(None) => local_api(st, path, query),
    }
}

/// Fleet mode's views of the whole group: this member's part and every other member's,
/// merged (`None`: not a group view, or `local=1`).
fn group_api(st: &Shared, path: &str, query: &str) -> Result<Option<Response>, Response> {
    if local_only(query) || st.lock().group.is_none() {
        return Ok(None);
    }
    Ok(Some(match path {
        "/flows" => {
            let mut flows = flows_a_chunk_at_a_time(st);
            for v in from_members::<Vec<FlowReport>>(st, path, query)? {
                flows.extend(v);
            }
            Response::json(&crate::correlate::merge_flows(flows))
        }
        "/flow" => match local_api(st, path, query) {
            r if r.status == 200 => r,
            local => group_flow(st, &query_id(query)).map_or(local, |r| Response::json(&r)),
        },
        "/metrics" | "/metrics.json" => {
            let mut v = MetricValues::of(&st.lock());
            for o in from_members::<MetricValues>(st, "/metrics.json", query)? {
                v.merge(&o);
            }
            if path == "/metrics" {
                Response::metrics(v.render())
            } else {
                Response::json(&v)
            }
        }
        "/ui/main" => ui_main(st, || {
            let mut all = vec![report(st)];
            all.extend(from_members::<CollectorReport>(st, "/report", query)?);
            Ok(CollectorReport::merge(all))
        })?,
        "/ui/flow" => {
            // The flow and the flows carrying its CNPs, each from the member that owns it.
            let id = query_id(query);
            match one_flow(st, &id).or_else(|| group_flow(st, &id)) {
                Some(f) => {
                    let cnp: Vec<FlowReport> = f
                        .answered_by
                        .flows
                        .iter()
                        .filter_map(|c| one_flow(st, c).or_else(|| group_flow(st, c)))
                        .collect();
                    Response::html(crate::pictures::html::flow_fragment(
                        &f,
                        &cnp.iter().collect::<Vec<_>>(),
                    ))
                }
                None => Response::text(404, format!("no flow `{id}` (see /flows)\n")),
            }
        }
        "/verdicts" => {
            let (check, since) = verdicts_query(query)?;
            // Every member runs with the same --policy: one without it is an error here.
            let mut all: Vec<crate::verify::continuous::Verdicts> = local_verdicts(st).into_iter().collect();
            all.extend(from_members::<crate::verify::continuous::Verdicts>(
                st,
                "/verdicts",
                "",
            )?);
            match merge_verdicts(all) {
                Some(v) => Response::json(&v.select(check.as_deref(), since)),
                None => verdicts_off(),
            }
        }
        "/report" | "/anomalies" | "/agents" | "/stats" => {
            let mut all = vec![report(st)];
            all.extend(from_members::<CollectorReport>(st, "/report", query)?);
            let r = CollectorReport::merge(all);
            match path {
                "/anomalies" => Response::json(&r.anomalies),
                "/agents" => Response::json(&r.agents),
                "/stats" => Response::json(&r.stats),
                _ => Response::json(&r),
            }
        }
        _ => return Ok(None),
    }))
}

/// The HTTP API. It runs on a blocking thread, never the agents' runtime; it holds the
/// lock the agents' frames need only to take what it reads (a pointer per flow for the
/// views of every flow, one address pair's flows for `/flow`, counters for `/metrics`).
fn local_api(st: &Shared, path: &str, query: &str) -> Response {
    let flow_id = || query_id(query);
    match path {
        "/trace" => {
            let id = flow_id();
            let mut s = st.lock();
            if !s.trace_on_request {
                return Response::text(
                    403,
                    "tracing is off: start the collector with --trace to have agents probe flows\n".into(),
                );
            }
            let Some(f) = s.joiner.as_ref().expect("joiner").find(&id) else {
                return Response::text(404, format!("no flow `{id}` (see /flows)\n"));
            };
            if s.traced.contains(&f) {
                return Response::text(
                    409,
                    format!("`{id}` was traced already: its hops are in /flow?id=…\n"),
                );
            }
            if !s.trace_budget.take(Instant::now()) {
                return Response::text(
                    429,
                    format!(
                        "too many traces asked for: {} at once, then {} a second for the whole collector\n",
                        TraceBudget::BURST,
                        TraceBudget::PER_SECOND
                    ),
                );
            }
            match s.request_trace(f) {
                Some(node) => Response::json(&serde_json::json!({ "requested": id, "from": node })),
                None => Response::text(409, format!("no connected agent on the source node of `{id}`\n")),
            }
        }
        "/flows" => Response::json_streamed(FlowsJson(st.clone())),
        "/flow" => {
            let label = flow_id();
            match one_flow(st, &label) {
                Some(r) => Response::json(&r),
                None => Response::text(404, format!("no flow `{label}` (see /flows)\n")),
            }
        }
        "/anomalies" => {
            let snapshot = st
                .lock()
                .joiner
                .as_ref()
                .expect("joiner")
                .snapshot();
            Response::json(&snapshot.view().anomalies())
        }
        "/agents" => Response::json(&st.lock().agents.values().collect::<Vec<_>>()),
        "/stats" => Response::json(&st.lock().joiner.as_ref().expect("joiner").stats),
        "/report" => Response::json(&report(st)),
        "/" => Response::html(crate::pictures::html::app_page()),
        "/ui/main" => {
            let flows = st.lock().joiner.as_ref().expect("joiner").flow_count();
            if flows <= FULL_MAP_FLOWS {
                ui_main(st, || Ok(report(st))).unwrap_or_else(|r| r)
            } else {
                ui_main_a_chunk_at_a_time(st)
            }
        }
        "/ui/flow" => {
            // One flow and the flows carrying its CNPs, not the whole report.
            let label = flow_id();
            match one_flow(st, &label) {
                Some(f) => {
                    let cnp: Vec<FlowReport> =
                        f.answered_by.flows.iter().filter_map(|id| one_flow(st, id)).collect();
                    Response::html(crate::pictures::html::flow_fragment(&f, &cnp.iter().collect::<Vec<_>>()))
                }
                None => Response::text(404, format!("no flow `{label}` (see /flows)\n")),
            }
        }
        "/metrics" => Response::metrics(MetricValues::of(&st.lock()).render()),
        "/metrics.json" => Response::json(&MetricValues::of(&st.lock())),
        "/verdicts" => match verdicts_query(query) {
            Err(r) => r,
            Ok((check, since)) => match local_verdicts(st) {
                Some(v) => Response::json(&v.select(check.as_deref(), since)),
                None => verdicts_off(),
            },
        },
        "/verdict" => match st.lock().judge.clone() {
            None => verdicts_off(),
            Some(j) => match j.lock().last_verdict.clone() {
                Some(v) => Response::json(&v),
                None => Response::text(503, "no window judged yet\n".into()),
            },
        },
        _ => Response::text(
            404,
            "try / (the web view), /flows, /flow?id=…, /trace?id=…, /anomalies, /agents, /stats, /report, /verdicts, /verdict, /metrics, /metrics.json\n".into(),
        ),
    }
}

/// The verdicts the web view shows: this collector's, or in a group the group's (none
/// when a member does not answer: the map is shown without them).
fn ui_verdicts(st: &Shared) -> Option<crate::verify::continuous::Verdicts> {
    let local = local_verdicts(st)?;
    if st.lock().group.is_none() {
        return Some(local);
    }
    let mut all = vec![local];
    all.extend(from_members::<crate::verify::continuous::Verdicts>(st, "/verdicts", "").ok()?);
    merge_verdicts(all)
}

fn local_verdicts(st: &Shared) -> Option<crate::verify::continuous::Verdicts> {
    let j = st.lock().judge.clone()?;
    Some(j.lock().verdicts())
}

fn verdicts_off() -> Response {
    Response::text(
        404,
        "continuous verification is off: start the collector with --policy FILE (and --verify-every, --verify-window)\n".into(),
    )
}

/// `/verdicts`' `check=NAME` and `since=` (Unix ms, or a duration back from now: `1h`).
fn verdicts_query(query: &str) -> Result<(Option<String>, Option<u64>), Response> {
    let mut check = None;
    let mut since = None;
    for kv in query.split('&').filter(|kv| !kv.is_empty()) {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        let v = http::percent_decode(v);
        match k {
            "check" => check = Some(v),
            "since" => {
                since = Some(match v.parse::<u64>() {
                    Ok(ms) => ms,
                    Err(_) => match humantime::parse_duration(&v) {
                        Ok(d) => crate::verdicts::unix_ms().saturating_sub(d.as_millis() as u64),
                        Err(e) => {
                            return Err(Response::text(
                                400,
                                format!("since={v}: neither Unix ms nor a duration ({e})\n"),
                            ));
                        }
                    },
                })
            }
            "local" => {}
            _ => {
                return Err(Response::text(
                    400,
                    format!("/verdicts takes check= and since=, not `{k}`\n"),
                ));
            }
        }
    }
    Ok((check, since))
}

/// A group's verdicts: the judging member's state, every member's history (each
/// member keeps the changes it judged), merged in time order.
fn merge_verdicts(
    all: Vec<crate::verify::continuous::Verdicts>,
) -> Option<crate::verify::continuous::Verdicts> {
    let mut events = Vec::new();
    let mut lead: Option<crate::verify::continuous::Verdicts> = None;
    for mut v in all {
        events.append(&mut v.events);
        if lead.as_ref().is_none_or(|l| v.judging && !l.judging) {
            lead = Some(v);
        }
    }
    let mut v = lead?;
    events.sort_by_key(|e| (e.at_ms, e.seq));
    v.events = events;
    Some(v)
}

/// `/ui/main` from `report` (this collector's, or its group's), or as built lately
/// ([`ui_reuse`]): many browsers cost one report.
fn ui_main(
    st: &Shared,
    report: impl FnOnce() -> Result<CollectorReport, Response>,
) -> Result<Response, Response> {
    let page = match ui_cached(st) {
        Some(p) => p,
        None => {
            let started = Instant::now();
            ui_keep(st, started, crate::pictures::html::main_fragment(&report()?))
        }
    };
    Ok(Response::html(page.as_str().to_owned()))
}

/// Up to this many tracked flows, `/ui/main` is built from the whole report (path-MTU
/// marks need every flow's largest frames at once); beyond, a chunk of flows at a time,
/// as `/flows` reads them, holding one chunk's reports at most.
const FULL_MAP_FLOWS: usize = 100_000;

/// `/ui/main` of a table too large to hold every report at once: the fabric built flow
/// by flow (a chunk under the lock at a time), PFC pauses judged a batch of flows at a
/// time. Path-MTU marks need the whole report, so this map says it has none.
fn ui_main_a_chunk_at_a_time(st: &Shared) -> Response {
    if let Some(p) = ui_cached(st) {
        return Response::html(p.as_str().to_owned());
    }
    let started = Instant::now();
    let (snapshot, agents, nic) = {
        let s = st.lock();
        (
            s.joiner.as_ref().expect("joiner").snapshot(),
            s.agents.values().cloned().collect::<Vec<_>>(),
            s.nic.report(),
        )
    };
    // The anomalies and points, and the snapshot let go of before the flows are read.
    let (points, mut anomalies) = {
        let view = snapshot.view();
        (view.points().to_vec(), view.anomalies())
    };
    let mut fabric = crate::pictures::Fabric::new(&points);
    let (mut flows, mut batch) = (0usize, Vec::with_capacity(FLOWS_CHUNK));
    let pauses = |batch: &mut Vec<FlowReport>, anomalies: &mut Vec<crate::correlate::Anomaly>| {
        if !nic.is_empty() {
            anomalies.extend(roce_trace_correlate::nic::pause_anomalies(batch, &nic));
        }
        batch.clear();
    };
    each_flow_a_chunk_at_a_time(st, |r| {
        fabric.add_flow(&r);
        flows += 1;
        batch.push(r);
        if batch.len() == FLOWS_CHUNK {
            pauses(&mut batch, &mut anomalies);
        }
        Ok::<_, std::convert::Infallible>(())
    })
    .unwrap_or_else(|never| match never {});
    pauses(&mut batch, &mut anomalies);
    fabric.add_anomalies(&anomalies);
    let note = format!(
        "{flows} flows: the map is built a chunk of flows at a time, without path-MTU marks (they need every flow at once, kept up to {FULL_MAP_FLOWS}); verify judges path MTU at any size."
    );
    let page = ui_keep(
        st,
        started,
        crate::pictures::html::main_parts(&fabric, flows, &anomalies, &agents, Some(&note)),
    );
    Response::html(page.as_str().to_owned())
}

/// One flow's report, with what probes found along it (`/flow?id=…`).
fn one_flow(st: &Shared, label: &str) -> Option<FlowReport> {
    let (id, view, probe) = {
        let s = st.lock();
        let j = s.joiner.as_ref().expect("joiner");
        j.find(label)
            .and_then(|id| Some((id, j.flow_view(&id)?, s.probes.get(&id).cloned())))?
    };
    let mut r = view.flow_report(&id)?;
    r.probe = probe;
    Some(r)
}

/// A flow's report from the other member that owns its partition (the others answer
/// 404), asked with `local=1`.
fn group_flow(st: &Shared, id: &str) -> Option<FlowReport> {
    let bearer = st.lock().http_token.clone();
    others(st)
        .iter()
        .filter_map(|m| m.http.parse().ok())
        .find_map(|addr| {
            http::get_json_as::<FlowReport>(
                addr,
                &format!("/flow?id={}&local=1", http::percent_encode(id)),
                bearer.as_deref(),
            )
            .ok()
        })
}

/// The `id=` of a query, decoded.
fn query_id(query: &str) -> String {
    query
        .split('&')
        .find_map(|kv| kv.strip_prefix("id="))
        .map(http::percent_decode)
        .unwrap_or_default()
}

/// Every number `/metrics` shows, as one member has them (`/metrics.json?local=1`, which
/// members ask each other for) or merged for the group.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize, PartialEq)]
struct MetricValues {
    stats: crate::correlate::JoinStats,
    refused: u64,
    group: Option<GroupValues>,
    /// Per agent's node: connected (to any member, in the group).
    agents: BTreeMap<String, bool>,
    /// Anomalies of the tracked flows by kind name.
    anomalies: BTreeMap<String, u64>,
    /// Sampled packets judged lost, by the two points they were lost between.
    #[serde(default)]
    lost: BTreeMap<String, BTreeMap<String, u64>>,
    /// NIC ports: reporting, paused in the intervals kept, refused past the table's bound,
    /// and counters of kinds this collector does not know (every member hears every
    /// node's NIC frames: merged, the most).
    #[serde(default)]
    nic: [u64; 4],
    /// Continuous verification (`--policy`), if on.
    #[serde(default)]
    verify: Option<crate::verdicts::VerifyMetrics>,
}

#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize, PartialEq)]
struct GroupValues {
    /// Live members, as the leases say (the same for every member; merged: the most).
    members: u64,
    /// Partitions read (merged: by the whole group).
    partitions_owned: u64,
    consumed: crate::fleet::ConsumeStats,
    refused_frames: u64,
}

impl MetricValues {
    fn of(s: &State) -> Self {
        let j = s.joiner.as_ref().expect("joiner");
        Self {
            stats: j.stats,
            refused: s.refused,
            group: s.group.as_ref().map(|g| GroupValues {
                members: g.members.len() as u64,
                partitions_owned: g.owned.len() as u64,
                consumed: g.consumed,
                refused_frames: g.refused_frames,
            }),
            agents: s.agents.values().map(|a| (a.node.clone(), a.connected)).collect(),
            anomalies: j
                .anomaly_counts()
                .into_iter()
                .map(|(k, v)| (k.name().to_owned(), v))
                .collect(),
            lost: j
                .lost_between()
                .into_iter()
                .fold(BTreeMap::new(), |mut m, (a, b, n)| {
                    m.entry(a.to_string())
                        .or_insert_with(BTreeMap::new)
                        .insert(b.to_string(), n);
                    m
                }),
            nic: [
                s.nic.ports() as u64,
                s.nic.paused_ports() as u64,
                s.nic.refused,
                s.nic.unknown_counters,
            ],
            verify: s.judge.as_ref().map(|j| j.lock().metrics()),
        }
    }

    /// The group's: counts summed (each member counts its own partitions' flows), the
    /// membership as the members agree on it, an agent connected if it is to any member.
    fn merge(&mut self, o: &Self) {
        self.stats.merge(&o.stats);
        self.refused += o.refused;
        if let Some(og) = &o.group {
            let g = self.group.get_or_insert_with(GroupValues::default);
            g.members = g.members.max(og.members);
            g.partitions_owned += og.partitions_owned;
            g.consumed.frames += og.consumed.frames;
            g.consumed.malformed += og.consumed.malformed;
            g.consumed.misrouted += og.consumed.misrouted;
            g.consumed.undeclared += og.consumed.undeclared;
            g.refused_frames += og.refused_frames;
        }
        for (node, c) in &o.agents {
            *self.agents.entry(node.clone()).or_default() |= *c;
        }
        for (k, v) in &o.anomalies {
            *self.anomalies.entry(k.clone()).or_default() += v;
        }
        for (a, bs) in &o.lost {
            let m = self.lost.entry(a.clone()).or_default();
            for (b, n) in bs {
                *m.entry(b.clone()).or_default() += n;
            }
        }
        for (a, b) in self.nic.iter_mut().zip(o.nic) {
            *a = (*a).max(b);
        }
        match (&mut self.verify, &o.verify) {
            (Some(v), Some(ov)) => v.merge(ov),
            (None, Some(ov)) => self.verify = Some(ov.clone()),
            _ => {}
        }
    }

    fn render(&self) -> String {
        use crate::metrics::{Scrape, labels};
        let st = self.stats;
        let mut m = Scrape::default();
        for (name, help, v) in [
            (
                "roce_trace_collector_observations_total",
                "Observations received.",
                st.observations,
            ),
            (
                "roce_trace_collector_duplicates_total",
                "Duplicate observations dropped.",
                st.duplicates,
            ),
            (
                "roce_trace_collector_trajectories_total",
                "Trajectories completed.",
                st.trajectories,
            ),
            (
                "roce_trace_collector_retransmissions_total",
                "Packet identities seen again at a point.",
                st.retransmissions,
            ),
            (
                "roce_trace_collector_pending_dropped_total",
                "Identities dropped: pending limit reached.",
                st.pending_dropped,
            ),
            (
                "roce_trace_collector_flows_evicted_total",
                "Longest-idle flows forgotten to make room: flow limit reached.",
                st.flows_evicted,
            ),
            (
                "roce_trace_collector_flows_expired_total",
                "Idle flows forgotten.",
                st.flows_expired,
            ),
            (
                "roce_trace_collector_agent_lag_gave_up_total",
                "Trajectories judged without a path node whose agent never reported that far (max-agent-lag ran out).",
                st.agent_lag_gave_up,
            ),
            (
                "roce_trace_collector_refused_connections_total",
                "Connections refused (handshake, token, version).",
                self.refused,
            ),
        ] {
            m.counter1(name, help, v);
        }
        m.gauge1("roce_trace_collector_flows", "Flows tracked.", st.flows);
        m.gauge1(
            "roce_trace_collector_pending",
            "Packet identities waiting for their trajectory.",
            st.pending,
        );
        if let Some(g) = &self.group {
            m.gauge1(
                "roce_trace_collector_fleet_members",
                "Live members of the group (leases).",
                g.members,
            );
            m.gauge1(
                "roce_trace_collector_fleet_partitions_owned",
                "Partitions read (by this member with local=1, else by the group).",
                g.partitions_owned,
            );
            m.counter1(
                "roce_trace_collector_fleet_frames_total",
                "Frames read from NATS.",
                g.consumed.frames,
            );
            m.counter1(
                "roce_trace_collector_fleet_malformed_total",
                "NATS messages skipped as malformed.",
                g.consumed.malformed,
            );
            m.counter1(
                "roce_trace_collector_fleet_misrouted_total",
                "Records on a partition their flow does not hash to.",
                g.consumed.misrouted,
            );
            m.counter1(
                "roce_trace_collector_fleet_refused_frames_total",
                "Frames from NATS the join could not take (undeclared points).",
                g.refused_frames,
            );
        }
        m.gauge(
            "roce_trace_collector_agent_connected",
            "Agents, 1 while connected.",
            self.agents
                .iter()
                .map(|(node, c)| (labels(&[("node", node)]), u64::from(*c))),
        );
        m.gauge1(
            "roce_trace_collector_nic_ports",
            "Ports whose agents report NIC and PFC counters.",
            self.nic[0],
        );
        m.gauge1(
            "roce_trace_collector_nic_paused_ports",
            "NIC ports that paused (PFC) in the last five minutes; their flows carry pfc_pause anomalies.",
            self.nic[1],
        );
        m.counter1(
            "roce_trace_collector_nic_ports_refused_total",
            "NIC reports of ports past the 4,096 kept, refused.",
            self.nic[2],
        );
        m.counter1(
            "roce_trace_collector_nic_unknown_counters_total",
            "NIC counters of kinds this collector does not know (a newer agent), skipped.",
            self.nic[3],
        );
        m.gauge(
            "roce_trace_collector_anomalies",
            "Anomalies (one per flow and place) of the tracked flows, by kind.",
            self.anomalies.iter().map(|(k, v)| (labels(&[("kind", k)]), *v)),
        );
        m.gauge(
            "roce_trace_collector_lost_samples",
            "Sampled packets judged lost between two consecutive points (each stands for --sample-rate packets), over the collector's life; a judged loss that arrives late is taken back. Labels: the last point that saw them (from) and the next (to): the link or node they vanished in.",
            self.lost.iter().flat_map(|(a, bs)| {
                bs.iter()
                    .map(move |(b, n)| (labels(&[("from", a.as_str()), ("to", b.as_str())]), *n))
            }),
        );
        if let Some(v) = &self.verify {
            v.render(&mut m);
        }
        m.render()
    }
}

/// `node/iface<` (ingress) or `node/iface>` (egress, mirror); a node alone as itself.
fn short(point: &Point) -> String {
    match point.direction {
        Some(d) => format!(
            "{}/{}{}",
            point.node,
            point.iface,
            if d == Direction::Ingress { "<" } else { ">" }
        ),
        None => point.node.clone(),
    }
}

/// The live view: per flow its path, and what happened along it.
pub fn render(r: &CollectorReport) -> String {
    let mut s = format!(
        "roce-trace collect — {} agents ({} connected), {} flows, {} observations, {} trajectories\n",
        r.agents.len(),
        r.agents.iter().filter(|a| a.connected).count(),
        r.flows.len(),
        r.stats.observations,
        r.stats.trajectories
    );
    for f in r.flows.iter().filter(|f| !f.path.is_empty()) {
        let dscps: Vec<String> = f.class.iter().map(|c| c.dscp.to_string()).collect();
        s.push_str(&format!(
            "{:<44} path {}  dscp {}",
            f.id,
            f.path.iter().map(short).collect::<Vec<_>>().join(" "),
            dscps.join("/")
        ));
        for c in &f.class_changes {
            s.push_str(&format!(
                "  CLASS {}→{} between {} and {}",
                c.from_dscp,
                c.to_dscp,
                short(&c.between[0]),
                short(&c.between[1])
            ));
        }
        for l in &f.lost {
            s.push_str(&format!(
                "  LOST {} between {} and {}",
                l.span.packets,
                short(&l.between[0]),
                short(&l.between[1])
            ));
        }
        if let Some(c) = f.ce_onset.first() {
            s.push_str(&format!("  CE from {}", short(&c.at)));
        }
        if let Some(x) = f.answered_by.cnps_per_ce_mark {
            s.push_str(&format!("  CNP/CE {x:.2}"));
        }
        if f.path_history.len() > 1 {
            s.push_str(&format!("  MOVED ({} paths)", f.path_history.len()));
        }
        s.push('\n');
        if let Some(p) = &f.probe {
            let hops: Vec<String> = p
                .hops
                .iter()
                .map(|h| match (h.addr, h.dscp) {
                    (Some(a), Some(d)) => format!("{a}({d})"),
                    (Some(a), None) => a.to_string(),
                    _ => "*".into(),
                })
                .collect();
            s.push_str(&format!(
                "{:<44} hops {}{}\n",
                "",
                hops.join(" "),
                p.class_changed_at
                    .map(|t| format!("  class changed at hop {t}"))
                    .unwrap_or_default()
            ));
        }
    }
    s
}

/// Hands the heap's free memory back to the operating system (glibc keeps freed chunks
/// for reuse; after a burst of waiting identities that is tens of megabytes the process
/// no longer needs). Called when the join says it gave a large amount of state back
/// ([`Joiner::gave_back`]), never on the ingest path; it takes the allocator's locks
/// for as long as it walks the free lists (milliseconds).
pub fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only reads and returns the allocator's free memory; it has no
    // preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The budget for `/trace`: a burst of 20 at once, then 5 a second, never more
    /// however long it was idle.
    #[test]
    fn trace_requests_are_budgeted_for_the_whole_collector() {
        let t0 = Instant::now();
        let mut b = TraceBudget::default();
        let burst = (0..100).filter(|_| b.take(t0)).count();
        assert_eq!(burst, 20);
        let s = |ms: u64| t0 + Duration::from_millis(ms);
        assert!(!b.take(s(100)), "half a token after 100 ms");
        assert!(b.take(s(200)), "one after 200 ms");
        assert!(!b.take(s(250)));
        // A second refills five.
        assert_eq!((0..100).filter(|_| b.take(s(1_200))).count(), 5);
        // An hour idle refills the burst, no more.
        assert_eq!((0..100).filter(|_| b.take(s(3_600_000))).count(), 20);
    }
}
