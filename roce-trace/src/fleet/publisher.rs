//! The agent's side of fleet mode: frames in, JetStream messages out. A publish counts as
//! delivered when JetStream acknowledges it (it is then stored in the stream, where the
//! partition's owner — or its successor — reads it). While NATS is away messages wait in
//! a bounded queue, oldest dropped first and counted, as the TCP agent's outbox does; a
//! message whose acknowledgement was lost is sent again with the same `Nats-Msg-Id`, so
//! the stream stores it once (within its duplicate window).

use std::{
    collections::{BTreeMap, VecDeque},
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use async_nats::jetstream::{Context, context::PublishAckFuture, kv, message::PublishMessage};
use bytes::Bytes;
use serde::Serialize;
use thiserror::Error;
use tokio::sync::Notify;

use super::{
    CLOCK_HEADER, Fleet, FleetError, NODE_HEADER, PROTOCOL_HEADER, Subjects, check_name, encode_points,
    kv_key,
};
use crate::{
    agent::Delivery,
    observation::PointDecl,
    protocol::{Frame, MAX_BATCH, encode},
};

/// How much a publisher holds and how many publishes it keeps unacknowledged at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PublisherOptions {
    /// Records held (queued or awaiting their acknowledgement) at most, per kind
    /// (observations, counter deltas, health records), as the agent's `--queue`.
    pub queue: usize,
    /// Publishes awaiting acknowledgement at most: the pipeline depth.
    pub window: usize,
    /// The node's clock is synchronised ([`CLOCK_HEADER`] on every message).
    pub clock_synced: bool,
}

impl Default for PublisherOptions {
    fn default() -> Self {
        Self {
            queue: 65_536,
            window: 64,
            clock_synced: false,
        }
    }
}

/// What the publisher did: per kind of record, every one made is acknowledged, dropped
/// or pending (see [`Delivery`]).
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq, Eq)]
pub struct PublishStats {
    pub observations: Delivery,
    pub counters: Delivery,
    /// HEALTH records.
    pub health: Delivery,
    /// Versions of the node's point table stored in the points bucket.
    pub points_stored: u64,
    /// Point tables that could not be stored (larger than the server's message limit, or
    /// not encodable): their points stay undeclared.
    pub points_refused: u64,
    /// Publishes, acknowledgements or KV puts that failed (each retried after a pause).
    pub failures: u64,
}

/// A frame that has no place on the fleet's subjects.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum SendError {
    #[error("a {0} frame is not published in fleet mode")]
    NotForFleet(&'static str),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Lane {
    Observations = 0,
    Counters = 1,
    Health = 2,
}

struct Message {
    /// None: DROPPED, which is never dropped itself (one is queued at a time).
    lane: Option<Lane>,
    records: usize,
    subject: String,
    payload: Bytes,
    /// `Nats-Msg-Id`: the same on every re-send.
    id: String,
    /// Sent before, not acknowledged.
    resend: bool,
}

enum Entry {
    Msg(Message),
    /// Store the node's point table now: a barrier — everything before it is acknowledged
    /// first, nothing after it is published before it is stored, so a point is declared
    /// before any record naming it can be read.
    Points,
    /// Publish the current DROPPED totals.
    Dropped,
}

struct State {
    queue: VecDeque<Entry>,
    /// Records held per lane: queued or in flight.
    held: [usize; 3],
    stats: PublishStats,
    points: BTreeMap<u16, PointDecl>,
    points_version: u64,
    points_stored_version: u64,
    points_queued: bool,
    dropped_queued: bool,
    /// The totals of the caller's last DROPPED frame (the agent's own outbox).
    caller_dropped: (u64, u64),
    /// Messages the sending task holds unacknowledged.
    in_flight: usize,
    next_id: u64,
}

impl State {
    fn lane(&mut self, l: Lane) -> &mut Delivery {
        match l {
            Lane::Observations => &mut self.stats.observations,
            Lane::Counters => &mut self.stats.counters,
            Lane::Health => &mut self.stats.health,
        }
    }
}

struct Shared {
    state: Mutex<State>,
    notify: Notify,
    cap: usize,
    node: String,
    /// Makes message ids unique across this node's publishers (restarts included).
    instance: String,
    subjects: Subjects,
    partitions: u32,
    clock_synced: bool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere while holding the lock leaves counters, not broken invariants.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Publishes one node's frames to the fleet's stream; see the module documentation.
/// Dropping it stops publishing (what is still queued is lost: [`Publisher::flush`] first).
pub struct Publisher {
    sh: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

const MIN_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(1);

impl Publisher {
    /// A publisher for `node` (the `Roce-Node` header and the key of its point table).
    pub fn new(fleet: &Fleet, node: impl Into<String>, opts: PublisherOptions) -> Result<Self, FleetError> {
        let node = node.into();
        check_name(&node)?;
        let instance = format!("{:x}.{:x}", std::process::id(), crate::protocol::unix_now_ns());
        let sh = Arc::new(Shared {
            state: Mutex::new(State {
                queue: VecDeque::new(),
                held: [0; 3],
                stats: PublishStats::default(),
                points: BTreeMap::new(),
                points_version: 0,
                points_stored_version: 0,
                points_queued: false,
                dropped_queued: false,
                caller_dropped: (0, 0),
                in_flight: 0,
                next_id: 0,
            }),
            notify: Notify::new(),
            cap: opts.queue.max(1),
            node,
            instance,
            subjects: fleet.subjects(),
            partitions: fleet.opts.partitions,
            clock_synced: opts.clock_synced,
        });
        let task = tokio::spawn(run(
            sh.clone(),
            fleet.js.clone(),
            fleet.points.clone(),
            fleet.client.clone(),
            opts.window.max(1),
        ));
        Ok(Self { sh, task })
    }

    /// Queues `frame` without waiting: POINTS update the node's point table (stored before
    /// anything queued after them is published), OBSERVATIONS and COUNTERS go to their
    /// partitions, HEALTH, NIC and DROPPED to every member. HEARTBEAT is accepted and not sent
    /// (NATS has its own liveness); the rest belong to the TCP protocol.
    pub fn send(&self, frame: Frame) -> Result<(), SendError> {
        let mut st = self.sh.lock();
        match frame {
            Frame::Points(points) => self.declare(&mut st, points),
            Frame::Observations(obs) => {
                for (p, batch) in super::split_observations(obs, self.sh.partitions) {
                    let n = batch.len();
                    self.push(
                        &mut st,
                        Lane::Observations,
                        n,
                        self.sh.subjects.data(p),
                        &Frame::Observations(batch),
                    );
                }
            }
            Frame::Counters(deltas) => {
                for (p, batch) in super::split_counters(deltas, self.sh.partitions) {
                    let n = batch.len();
                    self.push(
                        &mut st,
                        Lane::Counters,
                        n,
                        self.sh.subjects.data(p),
                        &Frame::Counters(batch),
                    );
                }
            }
            Frame::Health(mut records) => {
                while !records.is_empty() {
                    let rest = records.split_off(records.len().min(MAX_BATCH));
                    let n = records.len();
                    self.push(
                        &mut st,
                        Lane::Health,
                        n,
                        self.sh.subjects.health(),
                        &Frame::Health(records),
                    );
                    records = rest;
                }
            }
            // A node's NIC counters go where its health goes: every member hears them.
            Frame::Nic(ports) => {
                let n = ports.len();
                self.push(
                    &mut st,
                    Lane::Health,
                    n,
                    self.sh.subjects.health(),
                    &Frame::Nic(ports),
                );
            }
            Frame::Dropped {
                observations,
                counters,
            } => {
                st.caller_dropped = (observations, counters);
                queue_dropped(&mut st);
            }
            Frame::Heartbeat { .. } => return Ok(()),
            f => return Err(SendError::NotForFleet(f.name())),
        }
        drop(st);
        self.sh.notify.notify_one();
        Ok(())
    }

    fn declare(&self, st: &mut State, points: Vec<PointDecl>) {
        let mut changed = false;
        for p in points {
            if st.points.get(&p.index) != Some(&p) {
                st.points.insert(p.index, p);
                changed = true;
            }
        }
        if changed {
            st.points_version += 1;
            if !st.points_queued {
                st.points_queued = true;
                st.queue.push_back(Entry::Points);
            }
        }
    }

    /// Queues one message of `n` records, making room by dropping the oldest queued
    /// messages of its lane (never one awaiting its acknowledgement: the sending task
    /// holds those); the message itself when there is no room for it.
    fn push(&self, st: &mut State, lane: Lane, n: usize, subject: String, frame: &Frame) {
        st.lane(lane).made += n as u64;
        let payload = match encode(frame, 0) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(%subject, "dropped a batch of {n} the format cannot carry: {e}");
                st.lane(lane).dropped += n as u64;
                queue_dropped(st);
                return;
            }
        };
        let i = lane as usize;
        while st.held[i] + n > self.sh.cap {
            let oldest = st
                .queue
                .iter()
                .position(|e| matches!(e, Entry::Msg(m) if m.lane == Some(lane)));
            let Some(at) = oldest else {
                st.lane(lane).dropped += n as u64;
                queue_dropped(st);
                return;
            };
            if let Some(Entry::Msg(m)) = st.queue.remove(at) {
                st.held[i] -= m.records;
                st.lane(lane).dropped += m.records as u64;
            }
            queue_dropped(st);
        }
        st.held[i] += n;
        st.next_id += 1;
        let id = format!("{}.{}.{}", self.sh.node, self.sh.instance, st.next_id);
        st.queue.push_back(Entry::Msg(Message {
            lane: Some(lane),
            records: n,
            subject,
            payload,
            id,
            resend: false,
        }));
    }

    /// What was published, acknowledged and dropped so far.
    pub fn stats(&self) -> PublishStats {
        self.sh.lock().stats
    }

    /// Waits until everything queued is acknowledged (or dropped), `patience` at most;
    /// true when nothing is left.
    pub async fn flush(&self, patience: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + patience;
        loop {
            {
                let st = self.sh.lock();
                if st.queue.is_empty() && st.in_flight == 0 {
                    return true;
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

fn queue_dropped(st: &mut State) {
    if !st.dropped_queued {
        st.dropped_queued = true;
        st.queue.push_back(Entry::Dropped);
    }
}

/// The sending task: publishes the queue in order, up to `window` unacknowledged, and
/// puts everything unacknowledged back at the front of the queue when a publish or an
/// acknowledgement fails.
async fn run(sh: Arc<Shared>, js: Context, points_kv: kv::Store, client: async_nats::Client, window: usize) {
    let mut in_flight: VecDeque<(Message, PublishAckFuture)> = VecDeque::new();
    let mut backoff = MIN_BACKOFF;
    loop {
        let next = {
            let mut st = sh.lock();
            st.in_flight = in_flight.len();
            match st.queue.front() {
                // A barrier: the point table goes once everything before it is stored.
                Some(Entry::Points) if !in_flight.is_empty() => None,
                Some(_) if in_flight.len() >= window => None,
                _ => st.queue.pop_front(),
            }
        };
        let failed = match next {
            Some(Entry::Points) => {
                sh.lock().points_queued = false;
                match store_points(&sh, &points_kv, &client).await {
                    Ok(()) => false,
                    Err(e) => {
                        tracing::warn!(node = %sh.node, "storing the point table: {e}; retrying");
                        let mut st = sh.lock();
                        if !st.points_queued {
                            st.points_queued = true;
                            st.queue.push_front(Entry::Points);
                        }
                        true
                    }
                }
            }
            Some(Entry::Dropped) => {
                let m = dropped_message(&sh);
                publish(&sh, &js, m, &mut in_flight).await
            }
            Some(Entry::Msg(m)) => publish(&sh, &js, m, &mut in_flight).await,
            None => match in_flight.pop_front() {
                None => {
                    let _ = tokio::time::timeout(Duration::from_secs(1), sh.notify.notified()).await;
                    continue;
                }
                Some((m, ack)) => match ack.await {
                    Ok(_) => {
                        let mut st = sh.lock();
                        if let Some(l) = m.lane {
                            st.held[l as usize] -= m.records;
                            st.lane(l).acked += m.records as u64;
                        }
                        false
                    }
                    Err(e) => {
                        tracing::warn!(subject = %m.subject, "no JetStream acknowledgement: {e}; sending again");
                        requeue(&sh, std::iter::once(m).chain(in_flight.drain(..).map(|(m, _)| m)));
                        true
                    }
                },
            },
        };
        if failed {
            sh.lock().stats.failures += 1;
            sh.lock().in_flight = in_flight.len();
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        } else {
            backoff = MIN_BACKOFF;
        }
    }
}

/// DROPPED with the caller's totals and this publisher's own drops added.
fn dropped_message(sh: &Shared) -> Message {
    let mut st = sh.lock();
    st.dropped_queued = false;
    let f = Frame::Dropped {
        observations: st.caller_dropped.0 + st.stats.observations.dropped,
        counters: st.caller_dropped.1 + st.stats.counters.dropped,
    };
    st.next_id += 1;
    Message {
        lane: None,
        records: 0,
        subject: sh.subjects.dropped(),
        // Fixed-size fields only: always encodable.
        payload: encode(&f, 0).unwrap_or_default(),
        id: format!("{}.{}.{}", sh.node, sh.instance, st.next_id),
        resend: false,
    }
}

/// Publishes `m` behind what is in flight; false when it went out.
async fn publish(
    sh: &Shared,
    js: &Context,
    m: Message,
    in_flight: &mut VecDeque<(Message, PublishAckFuture)>,
) -> bool {
    let mut p = PublishMessage::build()
        .payload(m.payload.clone())
        .header(NODE_HEADER, sh.node.as_str())
        .header(PROTOCOL_HEADER, crate::protocol::VERSION.to_string())
        .message_id(&m.id);
    if sh.clock_synced {
        p = p.header(CLOCK_HEADER, "1");
    }
    match js.send_publish(m.subject.clone(), p).await {
        Ok(ack) => {
            let mut st = sh.lock();
            if let Some(l) = m.lane {
                let d = st.lane(l);
                d.sent += m.records as u64;
                if m.resend {
                    d.resent += m.records as u64;
                }
            }
            in_flight.push_back((m, ack));
            st.in_flight = in_flight.len();
            false
        }
        Err(e) => {
            tracing::warn!(subject = %m.subject, "publishing: {e}; retrying");
            requeue(sh, in_flight.drain(..).map(|(m, _)| m).chain(std::iter::once(m)));
            true
        }
    }
}

/// Puts `msgs` (oldest first) back at the front of the queue, to be sent again.
fn requeue(sh: &Shared, msgs: impl Iterator<Item = Message>) {
    let msgs: Vec<Message> = msgs.collect();
    let mut st = sh.lock();
    for mut m in msgs.into_iter().rev() {
        m.resend = true;
        st.queue.push_front(Entry::Msg(m));
    }
}

#[derive(Debug, Error)]
enum StoreError {
    #[error(transparent)]
    Put(#[from] async_nats::jetstream::kv::PutError),
}

/// Stores the node's point table, unless this version is stored already. A table the
/// server could never take is counted and left out rather than retried forever.
async fn store_points(
    sh: &Shared,
    points_kv: &kv::Store,
    client: &async_nats::Client,
) -> Result<(), StoreError> {
    let (version, table) = {
        let st = sh.lock();
        if st.points_version == st.points_stored_version {
            return Ok(());
        }
        (st.points_version, st.points.values().cloned().collect::<Vec<_>>())
    };
    let max = client.server_info().max_payload;
    let value = match encode_points(&table) {
        Ok(v) if max == 0 || v.len() <= max => v,
        Ok(v) => {
            tracing::warn!(node = %sh.node, "a point table of {} bytes exceeds the server's {max}-byte messages: not stored", v.len());
            refuse_points(sh, version);
            return Ok(());
        }
        Err(e) => {
            tracing::warn!(node = %sh.node, "the point table cannot be encoded: {e}");
            refuse_points(sh, version);
            return Ok(());
        }
    };
    points_kv.put(kv_key(&sh.node), value).await?;
    let mut st = sh.lock();
    st.points_stored_version = version;
    st.stats.points_stored += 1;
    Ok(())
}

fn refuse_points(sh: &Shared, version: u64) {
    let mut st = sh.lock();
    st.points_stored_version = version;
    st.stats.points_refused += 1;
}
