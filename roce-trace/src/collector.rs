//! `roce-trace collect`: accepts many agents, joins what they observe (correlate.rs), and
//! serves the result: a live view, JSON over HTTP, Prometheus metrics, a report on exit.

use std::{
    collections::{BTreeMap, HashMap},
    future::Future,
    net::SocketAddr,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::Context as _;
use bytes::BytesMut;
use serde::Serialize;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};

use crate::{
    correlate::{Anomaly, FlowReport, JoinConfig, JoinStats, Joiner, PointId, PointInfo},
    http::{self, Response},
    protocol::{Decoder, Encoder, Frame, ProtoError, VERSION},
    record::direction_name,
};

#[derive(Clone, Debug)]
pub struct CollectorOptions {
    pub listen: SocketAddr,
    pub http: Option<SocketAddr>,
    pub token: String,
    pub report: Option<PathBuf>,
    pub join: JoinConfig,
    /// Print the flow view every interval.
    pub live: bool,
    /// Ask each flow's source agent to trace it once (in-band probes); hops in the report.
    pub trace: bool,
    pub interval: Duration,
}

/// What the collector knows of one agent.
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct AgentInfo {
    pub node: String,
    pub peer: String,
    pub connected: bool,
    pub connections: u64,
    pub clock_synced: bool,
    pub observations: u64,
    pub counter_deltas: u64,
    /// What the agent reported it had to drop (its queue was full while we were away).
    pub dropped_observations: u64,
    pub dropped_counters: u64,
    pub last_disconnect: Option<String>,
}

#[derive(Default)]
struct State {
    joiner: Option<Joiner>,
    agents: BTreeMap<String, AgentInfo>,
    refused: u64,
    /// Per connected agent, where to send it requests.
    requesters: HashMap<String, tokio::sync::mpsc::UnboundedSender<Frame>>,
    /// Probe results per flow, and the flows a trace was asked for.
    probes: HashMap<crate::observation::FlowId, crate::protocol::ProbeResult>,
    traced: std::collections::HashSet<crate::observation::FlowId>,
    next_trace: u32,
}

impl State {
    fn flow_reports(&self) -> Vec<FlowReport> {
        let j = self.joiner.as_ref().expect("joiner");
        j.flow_ids()
            .iter()
            .filter_map(|id| {
                j.flow_report(id).map(|mut r| {
                    r.probe = self.probes.get(id).cloned();
                    r
                })
            })
            .collect()
    }

    /// Asks the agent on the flow's source node to trace it; where it went.
    fn request_trace(&mut self, id: crate::observation::FlowId) -> Option<String> {
        let (node, dscp, ecn) = self.joiner.as_ref()?.trace_target(&id)?;
        let tx = self.requesters.get(&node)?;
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

type Shared = Arc<Mutex<State>>;

#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct CollectorReport {
    #[serde(rename = "type")]
    pub kind: String,
    pub stats: JoinStats,
    pub refused_connections: u64,
    pub agents: Vec<AgentInfo>,
    pub points: Vec<PointInfo>,
    pub flows: Vec<FlowReport>,
    pub anomalies: Vec<Anomaly>,
}

fn now_ns(start: Instant) -> u64 {
    start.elapsed().as_nanos() as u64
}

fn report(st: &State) -> CollectorReport {
    let j = st.joiner.as_ref().expect("joiner");
    CollectorReport {
        kind: "collector_report".into(),
        stats: j.stats,
        refused_connections: st.refused,
        agents: st.agents.values().cloned().collect(),
        points: j.points().to_vec(),
        flows: st.flow_reports(),
        anomalies: j.anomalies(),
    }
}

/// Runs until `shutdown`; `ready` gets the bound agent and HTTP addresses.
pub async fn run(
    opts: CollectorOptions,
    shutdown: impl Future<Output = ()>,
    ready: impl FnOnce(SocketAddr, Option<SocketAddr>),
) -> anyhow::Result<CollectorReport> {
    anyhow::ensure!(
        !opts.token.is_empty(),
        "a token is required (--token or --token-file)"
    );
    let start = Instant::now();
    let state: Shared = Arc::new(Mutex::new(State {
        joiner: Some(Joiner::new(opts.join)),
        ..State::default()
    }));
    let listener = TcpListener::bind(opts.listen)
        .await
        .with_context(|| format!("listening on {}", opts.listen))?;
    let local = listener.local_addr()?;
    let mut http_addr = None;
    if let Some(addr) = opts.http {
        let st = state.clone();
        let (bound, serve) = http::bind(addr, move |path, query| api(&st, path, query))
            .await
            .with_context(|| format!("HTTP on {addr}"))?;
        http_addr = Some(bound);
        tokio::spawn(serve);
    }
    ready(local, http_addr);

    let token = Arc::new(opts.token.clone());
    let st = state.clone();
    let accept = async move {
        loop {
            let Ok((sock, peer)) = listener.accept().await else {
                continue;
            };
            let st = st.clone();
            let token = token.clone();
            tokio::spawn(async move {
                if let Err(reason) = serve_agent(sock, peer, &st, &token, start).await {
                    tracing::warn!("agent {peer}: connection closed: {reason}");
                }
            });
        }
    };
    let st = state.clone();
    let live = opts.live;
    let trace_flows = opts.trace;
    let ticker = async move {
        let mut t = tokio::time::interval(Duration::from_millis(200));
        let mut last_view = Instant::now();
        loop {
            t.tick().await;
            let mut s = st.lock().expect("state");
            s.joiner.as_mut().expect("joiner").tick(now_ns(start));
            if trace_flows {
                // Each flow is traced once, from its source, as soon as it has a path.
                let ids: Vec<_> = s.joiner.as_ref().expect("joiner").flow_ids();
                for id in ids {
                    if !s.traced.contains(&id) {
                        s.request_trace(id);
                    }
                }
            }
            if live && last_view.elapsed() >= opts.interval {
                last_view = Instant::now();
                print!("{}", render(&report(&s)));
            }
        }
    };
    tokio::select! {
        _ = shutdown => {}
        _ = accept => {}
        _ = ticker => {}
    }
    let mut s = state.lock().expect("state");
    s.joiner.as_mut().expect("joiner").flush();
    let r = report(&s);
    if let Some(path) = &opts.report {
        std::fs::write(path, serde_json::to_vec_pretty(&r)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(r)
}

/// One agent's connection: handshake, then frames into the join. Any protocol error
/// closes this connection only.
async fn serve_agent(
    mut sock: TcpStream,
    peer: SocketAddr,
    st: &Shared,
    token: &str,
    start: Instant,
) -> Result<(), String> {
    let mut buf = BytesMut::with_capacity(64 * 1024);
    let mut dec = Decoder::default();
    let mut enc = Encoder::default();
    let first =
        match tokio::time::timeout(Duration::from_secs(5), read_frame(&mut sock, &mut buf, &mut dec)).await {
            Ok(Ok(f)) => f,
            Ok(Err(e)) => {
                st.lock().expect("state").refused += 1;
                return Err(format!("handshake: {e}"));
            }
            Err(_) => {
                st.lock().expect("state").refused += 1;
                return Err("no HELLO within 5 s".into());
            }
        };
    let Some(Frame::Hello {
        version,
        node,
        token: t,
        clock_synced,
    }) = first
    else {
        st.lock().expect("state").refused += 1;
        return Err("the first frame was not HELLO".into());
    };
    let refusal = if version != VERSION {
        Some(ProtoError::Version(version).to_string())
    } else if t != token {
        Some(format!("node `{node}` presented a wrong token"))
    } else {
        None
    };
    if let Some(why) = refusal {
        st.lock().expect("state").refused += 1;
        if let Ok(bye) = Encoder::default().encode(&Frame::bye(why.clone())) {
            let _ = sock.write_all(&bye).await;
        }
        return Err(why);
    }
    let welcome = enc
        .encode(&Frame::Welcome { version: VERSION })
        .map_err(|e| e.to_string())?;
    sock.write_all(&welcome).await.map_err(|e| e.to_string())?;
    tracing::info!("agent `{node}` connected from {peer}");
    {
        let mut s = st.lock().expect("state");
        let a = s.agents.entry(node.clone()).or_default();
        a.node = node.clone();
        a.peer = peer.to_string();
        a.connected = true;
        a.connections += 1;
        a.clock_synced = clock_synced;
    }
    // Requests to this agent (traces) go through a writer task; reading stays here.
    let (mut rd, mut wr) = sock.into_split();
    let (req_tx, mut req_rx) = tokio::sync::mpsc::unbounded_channel::<Frame>();
    st.lock().expect("state").requesters.insert(node.clone(), req_tx);
    let writer = tokio::spawn(async move {
        while let Some(f) = req_rx.recv().await {
            let Ok(wire) = enc.encode(&f) else {
                continue;
            };
            if wr.write_all(&wire).await.is_err() {
                break;
            }
        }
    });
    let mut points: HashMap<u16, PointId> = HashMap::new();
    let result = loop {
        let f = match read_frame(&mut rd, &mut buf, &mut dec).await {
            Ok(Some(f)) => f,
            Ok(None) => break Err("the agent went away".to_owned()),
            Err(e) => break Err(e),
        };
        let now = now_ns(start);
        let mut s = st.lock().expect("state");
        if let Frame::TraceResult(r) = f {
            s.probes.insert(r.flow, r);
            continue;
        }
        let State { joiner, agents, .. } = &mut *s;
        let j = joiner.as_mut().expect("joiner");
        let a = agents.get_mut(&node).expect("registered");
        match f {
            Frame::Points(decls) => {
                for d in decls {
                    let p = j.point(PointInfo {
                        // A mirror session is the switch's point, not the agent's.
                        node: if d.node.is_empty() { node.clone() } else { d.node },
                        iface: d.iface,
                        direction: direction_name(d.direction).into(),
                        clock_synced,
                    });
                    points.insert(d.index, p);
                }
            }
            Frame::Observations(obs) => {
                if let Some(o) = obs.iter().find(|o| !points.contains_key(&o.point)) {
                    break Err(format!("observation from undeclared point {}", o.point));
                }
                for o in &obs {
                    j.add(points[&o.point], o, now);
                }
                a.observations += obs.len() as u64;
            }
            Frame::Counters { deltas, .. } => {
                if let Some(d) = deltas.iter().find(|d| !points.contains_key(&d.point)) {
                    break Err(format!("counters from undeclared point {}", d.point));
                }
                for d in &deltas {
                    j.add_counters(points[&d.point], d, now);
                }
                a.counter_deltas += deltas.len() as u64;
            }
            Frame::Dropped {
                observations,
                counters,
            } => {
                a.dropped_observations = observations;
                a.dropped_counters = counters;
            }
            Frame::Heartbeat { .. } => {}
            Frame::Bye { reason } => break Err(format!("agent said goodbye: {reason}")),
            Frame::Hello { .. }
            | Frame::Welcome { .. }
            | Frame::TraceRequest { .. }
            | Frame::TraceResult(_) => {
                break Err("a frame an agent does not send".into());
            }
        }
    };
    writer.abort();
    st.lock().expect("state").requesters.remove(&node);
    match result {
        Err(reason) => close(st, &node, reason),
        Ok(()) => Ok(()),
    }
}

fn close(st: &Shared, node: &str, reason: String) -> Result<(), String> {
    let mut s = st.lock().expect("state");
    if let Some(a) = s.agents.get_mut(node) {
        a.connected = false;
        a.last_disconnect = Some(reason.clone());
    }
    Err(reason)
}

/// Reads until one whole frame is decoded; `Ok(None)` on a clean end of stream.
async fn read_frame(
    sock: &mut (impl tokio::io::AsyncRead + Unpin),
    buf: &mut BytesMut,
    dec: &mut Decoder,
) -> Result<Option<Frame>, String> {
    loop {
        if let Some(f) = dec.decode(buf).map_err(|e| e.to_string())? {
            return Ok(Some(f));
        }
        let n = sock.read_buf(buf).await.map_err(|e| e.to_string())?;
        if n == 0 {
            return if buf.is_empty() {
                Ok(None)
            } else {
                Err(format!("stream ended inside a frame ({} bytes)", buf.len()))
            };
        }
    }
}

fn api(st: &Shared, path: &str, query: &str) -> Response {
    let mut s = st.lock().expect("state");
    let flow_id = || {
        query
            .split('&')
            .find_map(|kv| kv.strip_prefix("id="))
            .map(http::percent_decode)
            .unwrap_or_default()
    };
    if path == "/trace" {
        let id = flow_id();
        let Some(f) = s.joiner.as_ref().expect("joiner").find(&id) else {
            return Response::text(404, format!("no flow `{id}` (see /flows)\n"));
        };
        return match s.request_trace(f) {
            Some(node) => Response::json(&serde_json::json!({ "requested": id, "from": node })),
            None => Response::text(409, format!("no connected agent on the source node of `{id}`\n")),
        };
    }
    let j = s.joiner.as_ref().expect("joiner");
    match path {
        "/flows" => Response::json(&s.flow_reports()),
        "/flow" => {
            let id = flow_id();
            match s.flow_reports().into_iter().find(|r| r.id == id) {
                Some(r) => Response::json(&r),
                None => Response::text(404, format!("no flow `{id}` (see /flows)\n")),
            }
        }
        "/anomalies" => Response::json(&j.anomalies()),
        "/agents" => Response::json(&s.agents.values().collect::<Vec<_>>()),
        "/stats" => Response::json(&j.stats),
        "/report" => Response::json(&report(&s)),
        "/metrics" => Response::metrics(metrics(&s)),
        _ => Response::text(
            404,
            "try /flows, /flow?id=…, /trace?id=…, /anomalies, /agents, /stats, /report, /metrics\n".into(),
        ),
    }
}

fn metrics(s: &State) -> String {
    let j = s.joiner.as_ref().expect("joiner");
    let st = j.stats;
    let mut m = String::new();
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
            "roce_trace_collector_flows_refused_total",
            "Observations of new flows refused: flow limit reached.",
            st.flows_refused,
        ),
        (
            "roce_trace_collector_flows_expired_total",
            "Idle flows forgotten.",
            st.flows_expired,
        ),
        (
            "roce_trace_collector_refused_connections_total",
            "Connections refused (handshake, token, version).",
            s.refused,
        ),
    ] {
        m.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}\n"
        ));
    }
    m.push_str(&format!(
        "# TYPE roce_trace_collector_flows gauge\nroce_trace_collector_flows {}\n",
        st.flows
    ));
    m.push_str(&format!(
        "# TYPE roce_trace_collector_pending gauge\nroce_trace_collector_pending {}\n",
        st.pending
    ));
    m.push_str("# TYPE roce_trace_collector_agent_connected gauge\n");
    for a in s.agents.values() {
        m.push_str(&format!(
            "roce_trace_collector_agent_connected{{node=\"{}\"}} {}\n",
            a.node, a.connected as u8
        ));
    }
    let mut kinds: BTreeMap<String, u64> = BTreeMap::new();
    for a in j.anomalies() {
        *kinds.entry(a.kind).or_default() += 1;
    }
    m.push_str("# HELP roce_trace_collector_anomalies Flows with an anomaly, by kind.\n# TYPE roce_trace_collector_anomalies gauge\n");
    for (k, v) in kinds {
        m.push_str(&format!("roce_trace_collector_anomalies{{kind=\"{k}\"}} {v}\n"));
    }
    m
}

fn short(point: &str) -> String {
    // node:iface:direction → node/iface(in|out)
    match crate::correlate::split_label(point) {
        Some((n, i, d)) => format!("{n}/{i}{}", if d == "ingress" { "<" } else { ">" }),
        None => point.to_owned(),
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
            f.path.iter().map(|p| short(p)).collect::<Vec<_>>().join(" "),
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
