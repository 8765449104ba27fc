//! The collector's side of fleet mode: one member of the group that shares the partitions.
//! Membership is a lease — a key in the `-members` bucket, whose TTL removes it unless the
//! member puts it again — and ownership is computed by every member alike from the live
//! leases ([`super::owner_of`]). Each owned partition is read by an ordered consumer that
//! starts at the beginning of the stream, so a member taking a partition over rebuilds its
//! join state from everything retained; HEALTH, DROPPED and every node's points reach every
//! member.

use std::{
    collections::{BTreeSet, HashMap, HashSet},
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use async_nats::jetstream::{
    self,
    consumer::{DeliverPolicy, pull::OrderedConfig},
    kv,
};
use futures_util::{StreamExt as _, TryStreamExt as _};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use super::{
    CLOCK_HEADER, Fleet, FleetError, NODE_HEADER, PROTOCOL_HEADER, PayloadError, check_name, check_protocol,
    decode_payload, decode_points, kv_key, kv_key_name, partition_of,
};
use crate::protocol::Frame;

/// A member as its lease describes it: what a merged group view needs to reach it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberInfo {
    pub id: String,
    /// The member's HTTP address (host:port), for the group view.
    pub http: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberOptions {
    /// Unique in the group: two members with one id would both own the same partitions.
    pub id: String,
    pub http: String,
}

/// One frame as a member received it.
#[derive(Clone, Debug, PartialEq)]
pub struct Delivered {
    /// The agent's node (its `Roce-Node` header; a point table's key).
    pub node: String,
    /// Its clock is synchronised (its `Roce-Clock-Synced` header; false for a point
    /// table, read from the bucket).
    pub clock_synced: bool,
    pub subject: String,
    pub frame: Frame,
}

/// What a member hands its caller, in order per partition.
#[derive(Clone, Debug, PartialEq)]
pub enum FleetEvent {
    /// This member owns `partition` from now on: its frames follow, from the start of the
    /// stream.
    Gained(u32),
    /// No more frames of `partition` follow. If it is gained again it is replayed from the
    /// start: the caller drops the partition's join state here.
    Lost(u32),
    Frame(Delivered),
}

/// What the member's consumers read.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ConsumeStats {
    /// Frames delivered to the caller (points included).
    pub frames: u64,
    /// Messages or point tables skipped as malformed.
    pub malformed: u64,
    /// Records on a partition their flow does not hash to (delivered all the same).
    pub misrouted: u64,
    /// Frames naming a point their node had not declared, even after reading its table
    /// again (delivered all the same: the caller decides).
    pub undeclared: u64,
}

struct Shared {
    fleet: Fleet,
    id: String,
    tx: mpsc::Sender<FleetEvent>,
    stats: Mutex<ConsumeStats>,
    owned: Mutex<BTreeSet<u32>>,
    /// Per node, the point indexes its table declares (as last delivered).
    declared: Mutex<HashMap<String, HashSet<u16>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A task stopped when its handle is dropped.
struct Task(tokio::task::JoinHandle<()>);

impl Drop for Task {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Task {
    /// Stops the task and waits until it has, so nothing it sends comes after what the
    /// caller sends next.
    async fn stop(mut self) {
        self.0.abort();
        let h = std::mem::replace(&mut self.0, tokio::spawn(async {}));
        let _ = h.await;
    }
}

/// A collector's membership of the group. Dropping it stops every consumer and the lease
/// refresh (the others take over when the lease lapses); [`GroupMember::leave`] hands the
/// partitions over at once.
pub struct GroupMember {
    sh: Arc<Shared>,
    _tasks: Vec<Task>,
}

impl GroupMember {
    /// Joins: puts the lease, then follows every node's points and the HEALTH/DROPPED
    /// subject, and takes up the partitions it owns (within a lease refresh of joining).
    /// Events go to `tx`; a full channel holds the consumers back, never the lease.
    pub async fn join(
        fleet: &Fleet,
        opts: MemberOptions,
        tx: mpsc::Sender<FleetEvent>,
    ) -> Result<Self, FleetError> {
        check_name(&opts.id)?;
        let info = MemberInfo {
            id: opts.id.clone(),
            http: opts.http,
        };
        put_lease(fleet, &info).await?;
        let sh = Arc::new(Shared {
            fleet: fleet.clone(),
            id: opts.id,
            tx,
            stats: Mutex::new(ConsumeStats::default()),
            owned: Mutex::new(BTreeSet::new()),
            declared: Mutex::new(HashMap::new()),
        });
        let refresh = fleet.lease_ttl / 3;
        let tasks = vec![
            Task(tokio::spawn(keep_lease(fleet.clone(), info, refresh))),
            Task(tokio::spawn(watch_points(sh.clone()))),
            Task(tokio::spawn(consume(sh.clone(), sh.fleet.subjects().all(), None))),
            Task(tokio::spawn(follow_ownership(sh.clone(), refresh))),
        ];
        Ok(Self { sh, _tasks: tasks })
    }

    /// The live members, by id, as their leases say.
    pub async fn members(&self) -> Result<Vec<MemberInfo>, FleetError> {
        live_members(&self.sh.fleet).await
    }

    /// The partitions this member reads now.
    pub fn owned(&self) -> Vec<u32> {
        lock(&self.sh.owned).iter().copied().collect()
    }

    pub fn id(&self) -> &str {
        &self.sh.id
    }

    pub fn stats(&self) -> ConsumeStats {
        *lock(&self.sh.stats)
    }

    /// Leaves the group now: stops reading and deletes the lease, so the others take
    /// the partitions over at their next refresh rather than after the TTL.
    pub async fn leave(self) -> Result<(), FleetError> {
        let fleet = self.sh.fleet.clone();
        let key = kv_key(&self.sh.id);
        drop(self);
        fleet.members.delete(key).await.map_err(|e| FleetError::Bucket {
            bucket: fleet.opts.members_bucket(),
            source: e.into(),
        })
    }
}

pub(super) async fn put_lease(fleet: &Fleet, info: &MemberInfo) -> Result<(), FleetError> {
    let err = |source: async_nats::Error| FleetError::Bucket {
        bucket: fleet.opts.members_bucket(),
        source,
    };
    let value = serde_json::to_vec(info).map_err(|e| err(e.into()))?;
    fleet
        .members
        .put(kv_key(&info.id), value.into())
        .await
        .map_err(|e| err(e.into()))?;
    Ok(())
}

/// Puts the lease again every `refresh` (a third of its TTL): two refreshes may fail
/// before the others count this member gone.
async fn keep_lease(fleet: Fleet, info: MemberInfo, refresh: Duration) {
    loop {
        tokio::time::sleep(refresh).await;
        if let Err(e) = put_lease(&fleet, &info).await {
            tracing::warn!(member = %info.id, "refreshing the lease: {e}");
        }
    }
}

/// The members whose leases are live, sorted by id (within twice the request timeout: a
/// listing cut by a server restart must not hold ownership up for ever). A lease that
/// does not read as one is skipped (and logged): another member's bad value must not
/// stop this one.
pub(super) async fn live_members(fleet: &Fleet) -> Result<Vec<MemberInfo>, FleetError> {
    match tokio::time::timeout(2 * fleet.opts.request_timeout, list_members(fleet)).await {
        Ok(r) => r,
        Err(_) => Err(FleetError::Bucket {
            bucket: fleet.opts.members_bucket(),
            source: "listing the leases timed out".into(),
        }),
    }
}

async fn list_members(fleet: &Fleet) -> Result<Vec<MemberInfo>, FleetError> {
    let err = |source: async_nats::Error| FleetError::Bucket {
        bucket: fleet.opts.members_bucket(),
        source,
    };
    // The bucket's keys from one stream-info request, answered by the server from one
    // state of the stream: each subject once. Not `Store::keys()`: its consumer lists a
    // lease renewed during the listing twice (the group's view would merge that member's
    // counts twice), and when a renewal replaces an entry not yet delivered it waits for
    // an idle heartbeat (seconds) before it ends.
    let subjects = format!("{}>", fleet.members.prefix);
    let mut listed = fleet
        .members
        .stream
        .info_with_subjects(&subjects)
        .await
        .map_err(|e| err(e.into()))?;
    let mut keys = std::collections::BTreeSet::new();
    while let Some((subject, _count)) = listed.try_next().await.map_err(|e| err(e.into()))? {
        if let Some(key) = subject.strip_prefix(fleet.members.prefix.as_str()) {
            keys.insert(key.to_string());
        }
    }
    let mut out = Vec::new();
    for key in keys {
        let Some(entry) = fleet
            .members
            .entry(key.clone())
            .await
            .map_err(|e| err(e.into()))?
        else {
            continue;
        };
        if entry.operation != kv::Operation::Put {
            continue;
        }
        match serde_json::from_slice::<MemberInfo>(&entry.value) {
            Ok(m) if kv_key_name(&key).as_deref() == Some(m.id.as_str()) => out.push(m),
            Ok(m) => tracing::warn!(%key, "skipped a lease naming another member ({:?})", m.id),
            Err(e) => tracing::warn!(%key, "skipped a malformed lease: {e}"),
        }
    }
    out.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(out)
}

/// Every `refresh`: the live members, the partitions this member owns among them, and the
/// consumers started or stopped to match. The consumer of a partition lost is stopped
/// before `Lost` is sent, so no frame of it follows.
async fn follow_ownership(sh: Arc<Shared>, refresh: Duration) {
    let partitions = sh.fleet.opts.partitions;
    let mut running: HashMap<u32, Task> = HashMap::new();
    loop {
        match live_members(&sh.fleet).await {
            Ok(members) => {
                let ids: Vec<&str> = members.iter().map(|m| m.id.as_str()).collect();
                // This member counts itself live even when its lease is not (yet) listed:
                // it is refreshing it.
                let me = sh.id.as_str();
                let with_me: Vec<&str> = if ids.contains(&me) {
                    ids
                } else {
                    ids.into_iter().chain([me]).collect()
                };
                let want: BTreeSet<u32> = (0..partitions)
                    .filter(|p| super::owner_of(*p, with_me.iter().copied()) == Some(me))
                    .collect();
                let lost: Vec<u32> = running.keys().filter(|p| !want.contains(p)).copied().collect();
                for p in lost {
                    if let Some(t) = running.remove(&p) {
                        t.stop().await;
                    }
                    lock(&sh.owned).remove(&p);
                    tracing::info!(member = %sh.id, partition = p, "partition handed over");
                    if sh.tx.send(FleetEvent::Lost(p)).await.is_err() {
                        return;
                    }
                }
                for p in want {
                    if running.contains_key(&p) {
                        continue;
                    }
                    tracing::info!(member = %sh.id, partition = p, "partition taken: replaying it");
                    if sh.tx.send(FleetEvent::Gained(p)).await.is_err() {
                        return;
                    }
                    lock(&sh.owned).insert(p);
                    let subject = sh.fleet.subjects().data(p);
                    running.insert(p, Task(tokio::spawn(consume(sh.clone(), subject, Some(p)))));
                }
            }
            Err(e) => tracing::warn!(member = %sh.id, "listing the group: {e}; ownership unchanged"),
        }
        tokio::time::sleep(refresh).await;
    }
}

/// Reads `subject` from the start of the stream, then live, and hands every well-formed
/// frame to the caller. Where the ordered consumer gives up (the server restarted, say),
/// a new one resumes after the last message read, so nothing is delivered twice.
async fn consume(sh: Arc<Shared>, subject: String, partition: Option<u32>) {
    let mut resume: Option<u64> = None;
    loop {
        let config = OrderedConfig {
            filter_subject: subject.clone(),
            deliver_policy: match resume {
                None => DeliverPolicy::All,
                Some(start_sequence) => DeliverPolicy::ByStartSequence { start_sequence },
            },
            ..Default::default()
        };
        let messages = match sh
            .fleet
            .js
            .create_consumer_on_stream(config, &sh.fleet.opts.stream)
            .await
        {
            Ok(c) => c.messages().await.map_err(async_nats::Error::from),
            Err(e) => Err(e.into()),
        };
        let mut messages = match messages {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(%subject, "starting a consumer: {e}; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let mut connections = sh.fleet.connections.clone();
        connections.mark_unchanged();
        loop {
            let m = tokio::select! {
                m = messages.next() => m,
                // Reconnected: the server may have restarted without this consumer.
                _ = connections.changed() => {
                    tracing::info!(%subject, "reconnected: resuming the consumer");
                    break;
                }
            };
            match m {
                Some(Ok(msg)) => {
                    if let Ok(info) = msg.info() {
                        resume = Some(info.stream_sequence + 1);
                    }
                    if !handle(&sh, partition, &msg).await {
                        return;
                    }
                }
                Some(Err(e)) => {
                    tracing::warn!(%subject, "reading: {e}; resuming");
                    break;
                }
                None => break,
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Which frames a subject carries.
fn fits(sh: &Shared, partition: Option<u32>, subject: &str, f: &Frame) -> Result<(), PayloadError> {
    let subjects = sh.fleet.subjects();
    let want = match partition {
        Some(_) if matches!(f, Frame::Observations(_) | Frame::Counters(_)) => return Ok(()),
        Some(_) => "OBSERVATIONS or COUNTERS",
        None if subject == subjects.health() && matches!(f, Frame::Health(_) | Frame::Nic(_)) => {
            return Ok(());
        }
        None if subject == subjects.dropped() && matches!(f, Frame::Dropped { .. }) => return Ok(()),
        None if subject == subjects.health() => "HEALTH or NIC",
        None if subject == subjects.dropped() => "DROPPED",
        None => "nothing",
    };
    Err(PayloadError::WrongKind { got: f.name(), want })
}

/// One message: checked, delivered; a malformed one counted, logged with its subject and
/// skipped. False once the caller is gone.
async fn handle(sh: &Arc<Shared>, partition: Option<u32>, msg: &jetstream::Message) -> bool {
    let subject = msg.subject.to_string();
    let read = || -> Result<(String, Frame), PayloadError> {
        let node = msg
            .headers
            .as_ref()
            .and_then(|h| h.get(NODE_HEADER))
            .map(|v| v.as_str().to_string())
            .filter(|n| !n.is_empty())
            .ok_or(PayloadError::NoNode)?;
        check_protocol(
            msg.headers
                .as_ref()
                .and_then(|h| h.get(PROTOCOL_HEADER))
                .map(|v| v.as_str()),
        )?;
        let frame = decode_payload(&msg.payload)?;
        fits(sh, partition, &subject, &frame)?;
        Ok((node, frame))
    };
    let clock_synced = msg
        .headers
        .as_ref()
        .and_then(|h| h.get(CLOCK_HEADER))
        .is_some_and(|v| v.as_str() == "1");
    let (node, frame) = match read() {
        Ok(x) => x,
        Err(e) => {
            lock(&sh.stats).malformed += 1;
            tracing::warn!(%subject, "skipped a malformed message: {e}");
            return true;
        }
    };
    if let Some(p) = partition {
        let parts = sh.fleet.opts.partitions;
        let (misrouted, points): (usize, HashSet<u16>) = match &frame {
            Frame::Observations(v) => (
                v.iter().filter(|o| partition_of(&o.id.flow, parts) != p).count(),
                v.iter().map(|o| o.point).collect(),
            ),
            Frame::Counters(v) => (
                v.iter().filter(|d| partition_of(&d.flow, parts) != p).count(),
                v.iter().map(|d| d.point).collect(),
            ),
            _ => (0, HashSet::new()),
        };
        if misrouted > 0 {
            lock(&sh.stats).misrouted += misrouted as u64;
            tracing::warn!(%subject, %node, "{misrouted} records of another partition");
        }
        if !ensure_declared(sh, &node, &points).await {
            return false;
        }
    }
    lock(&sh.stats).frames += 1;
    sh.tx
        .send(FleetEvent::Frame(Delivered {
            node,
            clock_synced,
            subject,
            frame,
        }))
        .await
        .is_ok()
}

/// Makes sure the caller has the node's points a data frame names before the frame: the
/// points bucket and the partition are read apart, so the table may not have arrived yet
/// (the publisher stores it first). Reads it again and delivers it when a point is
/// missing. False once the caller is gone.
async fn ensure_declared(sh: &Arc<Shared>, node: &str, points: &HashSet<u16>) -> bool {
    let missing = |sh: &Shared| {
        let d = lock(&sh.declared);
        let have = d.get(node);
        points.iter().any(|p| have.is_none_or(|h| !h.contains(p)))
    };
    if !missing(sh) {
        return true;
    }
    let key = kv_key(node);
    match sh.fleet.points.entry(key.clone()).await {
        Ok(Some(entry)) if entry.operation == kv::Operation::Put => {
            if !deliver_points(sh, node, &entry).await {
                return false;
            }
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(%node, "reading the node's points: {e}"),
    }
    if missing(sh) {
        lock(&sh.stats).undeclared += 1;
    }
    true
}

/// A node's point table from its KV entry, to the caller. False once the caller is gone.
async fn deliver_points(sh: &Shared, node: &str, entry: &kv::Entry) -> bool {
    let subject = format!("$KV.{}.{}", entry.bucket, entry.key);
    match decode_points(&entry.value) {
        Ok(points) => {
            lock(&sh.declared).insert(node.to_string(), points.iter().map(|p| p.index).collect());
            lock(&sh.stats).frames += 1;
            sh.tx
                .send(FleetEvent::Frame(Delivered {
                    node: node.to_string(),
                    clock_synced: false,
                    subject,
                    frame: Frame::Points(points),
                }))
                .await
                .is_ok()
        }
        Err(e) => {
            lock(&sh.stats).malformed += 1;
            tracing::warn!(%subject, "skipped a malformed point table: {e}");
            true
        }
    }
}

/// Every node's point table: all of them on joining, then each as it changes.
async fn watch_points(sh: Arc<Shared>) {
    loop {
        let mut watch = match sh.fleet.points.watch_with_history(">").await {
            Ok(w) => w,
            Err(e) => {
                tracing::warn!("watching the points bucket: {e}; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let mut connections = sh.fleet.connections.clone();
        connections.mark_unchanged();
        loop {
            let entry = tokio::select! {
                e = watch.next() => e,
                // Reconnected: the server may have restarted without this watch.
                _ = connections.changed() => break,
            };
            let entry = match entry {
                Some(Ok(e)) => e,
                Some(Err(e)) => {
                    tracing::warn!("watching the points bucket: {e}; again");
                    break;
                }
                None => break,
            };
            if entry.operation != kv::Operation::Put {
                continue;
            }
            let Some(node) = kv_key_name(&entry.key) else {
                lock(&sh.stats).malformed += 1;
                tracing::warn!(key = %entry.key, "skipped a point table under a key no node has");
                continue;
            };
            if !deliver_points(&sh, &node, &entry).await {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
