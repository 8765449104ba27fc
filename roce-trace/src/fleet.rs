//! Fleet mode's transport: agents publish their frames to a NATS JetStream stream, and
//! collectors consume it as a group that shares the partitions out. Direct TCP
//! ([`crate::agent`] → [`crate::collector`]) stays the one-machine default.
//!
//! The join needs every sighting of a packet, its ACKs and its CNPs in one place, so data
//! is partitioned by the one key that never changes in flight and is the same for both
//! directions: a stable hash of the *unordered* IP pair ([`partition_of`]) — never DSCP,
//! ECN, TTL, ports or QP. Layout, for a stream `S` with subject prefix `P`:
//!
//! | what | where | read by |
//! |---|---|---|
//! | OBSERVATIONS, COUNTERS | stream `S`, subject `P.data.<partition>` | the partition's owner |
//! | HEALTH | stream `S`, subject `P.all.health` | every member |
//! | DROPPED | stream `S`, subject `P.all.dropped` | every member |
//! | POINTS (a node's whole table) | KV bucket `S-points`, key = node | every member |
//! | membership leases | KV bucket `S-members`, key = member id, TTL = lease | every member |
//!
//! Every message carries one frame in the TCP encoding ([`crate::protocol::encode`],
//! sequence number 0: each message stands alone) and the node in a `Roce-Node` header. A
//! member owns partition `p` when it scores highest for `p` among the live members
//! (rendezvous hashing over the lease keys), so every member computes the same owners
//! without talking to the others, and a member leaving moves only its own partitions. A
//! new owner replays the partition from the start of the stream: it must rebuild that
//! partition's join state, which an ack floor would not give it.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::PathBuf,
    sync::Arc,
    time::Duration,
};

use async_nats::jetstream::{
    self, Context, kv,
    stream::{self, StorageType},
};
use bytes::{Bytes, BytesMut};
use thiserror::Error;

use roce_trace_common::sampling::fmix64;

use crate::{
    observation::{CounterDelta, FlowId, Observation, PointDecl},
    protocol::{Decoder, Frame, MAX_BATCH, ProtoError, encode, points_frames},
};

// ---------------------------------------------------------------------------------------
// Partitioning

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

fn fnv1a64(seed: u64, bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(seed, |h, &b| (h ^ b as u64).wrapping_mul(FNV_PRIME))
}

/// The flow's host pair, lower address first: the same for both directions of it.
/// Finalised by MurmurHash3's [`fmix64`], in which every input bit moves every output
/// bit: FNV-1a alone leaves its low bits as the parity of its input's (all even with 16
/// partitions for host pairs that differ in step), and a modulo takes exactly those bits.
fn pair_hash(flow: &FlowId) -> u64 {
    let (a, b) = if flow.src <= flow.dst {
        (&flow.src, &flow.dst)
    } else {
        (&flow.dst, &flow.src)
    };
    fmix64(fnv1a64(fnv1a64(FNV_OFFSET, a), b))
}

/// The partition of `flow`: FNV-1a 64 over the 32 bytes of its ordered address pair
/// (`min(src, dst)`, `max(src, dst)`, IPv4 mapped), finalised by [`fmix64`], modulo
/// `partitions`. Fixed by this definition — agents and collectors of any version must
/// agree — so both directions of a host pair, every port, QP and class of it land
/// together. `partitions` 0 is taken as 1.
pub fn partition_of(flow: &FlowId, partitions: u32) -> u32 {
    (pair_hash(flow) % partitions.max(1) as u64) as u32
}

/// `records` grouped by partition (ascending), each group in its original order and cut
/// into batches of at most [`MAX_BATCH`].
fn split_by_partition<T>(
    records: Vec<T>,
    partitions: u32,
    flow: impl Fn(&T) -> &FlowId,
) -> Vec<(u32, Vec<T>)> {
    let mut by: BTreeMap<u32, Vec<T>> = BTreeMap::new();
    for r in records {
        by.entry(partition_of(flow(&r), partitions)).or_default().push(r);
    }
    let mut out = Vec::new();
    for (p, mut v) in by {
        while v.len() > MAX_BATCH {
            let rest = v.split_off(MAX_BATCH);
            out.push((p, std::mem::replace(&mut v, rest)));
        }
        out.push((p, v));
    }
    out
}

/// A batch of observations as per-partition batches (see [`split_by_partition`]).
pub fn split_observations(obs: Vec<Observation>, partitions: u32) -> Vec<(u32, Vec<Observation>)> {
    split_by_partition(obs, partitions, |o| &o.id.flow)
}

/// A batch of counter deltas as per-partition batches.
pub fn split_counters(deltas: Vec<CounterDelta>, partitions: u32) -> Vec<(u32, Vec<CounterDelta>)> {
    split_by_partition(deltas, partitions, |d| &d.flow)
}

/// The weight of `member` for `partition` in rendezvous hashing.
fn rendezvous_score(member: &str, partition: u32) -> u64 {
    fmix64(fnv1a64(
        fnv1a64(FNV_OFFSET, member.as_bytes()) ^ 0xff,
        &partition.to_be_bytes(),
    ))
}

/// The member that owns `partition` among `members` (highest score, then highest id);
/// `None` when there are none.
pub fn owner_of<'a>(partition: u32, members: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    members
        .into_iter()
        .max_by_key(|m| (rendezvous_score(m, partition), *m))
}

// ---------------------------------------------------------------------------------------
// Subjects and names

/// The subjects of one fleet, under its prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Subjects {
    prefix: String,
}

impl Subjects {
    pub fn new(prefix: impl Into<String>) -> Self {
        Self {
            prefix: prefix.into(),
        }
    }
    /// `<prefix>.data.<partition>`: OBSERVATIONS and COUNTERS of that partition.
    pub fn data(&self, partition: u32) -> String {
        format!("{}.data.{partition}", self.prefix)
    }
    /// `<prefix>.all.health`: every agent's HEALTH, read by every member.
    pub fn health(&self) -> String {
        format!("{}.all.health", self.prefix)
    }
    /// `<prefix>.all.dropped`: every agent's DROPPED, read by every member.
    pub fn dropped(&self) -> String {
        format!("{}.all.dropped", self.prefix)
    }
    /// What every member reads: HEALTH and DROPPED.
    pub fn all(&self) -> String {
        format!("{}.all.>", self.prefix)
    }
    /// The stream's subjects.
    pub fn stream_subjects(&self) -> Vec<String> {
        vec![format!("{}.data.*", self.prefix), self.all()]
    }
    /// The partition a data subject names.
    pub fn partition_of_subject(&self, subject: &str) -> Option<u32> {
        subject
            .strip_prefix(&self.prefix)?
            .strip_prefix(".data.")?
            .parse()
            .ok()
    }
}

/// The header naming the agent's node on every message.
pub const NODE_HEADER: &str = "Roce-Node";

/// The header carrying the publisher's protocol version ([`crate::protocol::VERSION`]) on
/// every message: what HELLO says on TCP. A member skips a message of another version
/// (or of none: an agent before version 8), as a collector refuses such an agent: points
/// of two versions may sample different packets, and a packet one sampled and the other
/// did not would be taken for a loss between them.
pub const PROTOCOL_HEADER: &str = "Roce-Protocol";

/// The header an agent whose clock is synchronised (PTP/NTP: `--clock-synced`) puts on
/// every message, value `1` (what HELLO says on TCP): its points' one-way delays count.
pub const CLOCK_HEADER: &str = "Roce-Clock-Synced";

/// `s` as a KV key: bytes outside `[A-Za-z0-9_-]` as `=XX` (KV keys allow `=`), so any
/// node name or member id maps to a valid key and back.
pub fn kv_key(s: &str) -> String {
    let mut k = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b == b'_' || b == b'-' {
            k.push(b as char);
        } else {
            k.push_str(&format!("={b:02X}"));
        }
    }
    k
}

/// The name [`kv_key`] encoded; `None` for a key it cannot have made.
pub fn kv_key_name(k: &str) -> Option<String> {
    let mut out = Vec::with_capacity(k.len());
    let b = k.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'=' {
            let hex = k.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

// ---------------------------------------------------------------------------------------
// Options

/// How the client proves who it is, as the NATS server is configured.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum NatsAuth {
    #[default]
    None,
    UserPassword {
        user: String,
        password: String,
    },
    Token(String),
    /// An nkey seed (`SU…`).
    NkeySeed(String),
    /// A `.creds` file (JWT and nkey seed), as `nsc` writes it.
    CredentialsFile(PathBuf),
}

/// TLS towards the server. Any field set turns TLS on (`require_tls`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NatsTls {
    /// CA certificates (PEM) to verify the server by, in addition to the system's.
    pub ca: Option<PathBuf>,
    /// Client certificate and key (PEM), for servers that verify clients.
    pub client: Option<(PathBuf, PathBuf)>,
    pub required: bool,
}

impl NatsTls {
    fn enabled(&self) -> bool {
        self.required || self.ca.is_some() || self.client.is_some()
    }
}

/// Everything fleet mode needs to reach its stream. Agents and collectors of one fleet
/// must agree on `stream`, `prefix` and `partitions` ([`connect`] checks the partition
/// count against the stream's).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NatsOptions {
    /// Server URLs (`nats://host:4222`, `tls://…`); the client fails over between them.
    pub urls: Vec<String>,
    /// Stream name; the KV buckets are named after it (`<stream>-points`, `<stream>-members`).
    pub stream: String,
    /// Subject prefix (`<prefix>.data.<p>`, `<prefix>.all.*`).
    pub prefix: String,
    pub partitions: u32,
    /// Copies of the stream and buckets in a cluster.
    pub replicas: usize,
    /// Retention: what a new partition owner can replay. Zero: unlimited.
    pub max_age: Duration,
    /// Retention in bytes; the oldest messages go first. -1: unlimited.
    pub max_bytes: i64,
    /// How long a member's lease lasts without a refresh (the `-members` bucket's TTL,
    /// fixed when the bucket is created). Members refresh every third of it.
    pub lease_ttl: Duration,
    /// How long a JetStream request or publish acknowledgement may take.
    pub request_timeout: Duration,
    pub auth: NatsAuth,
    pub tls: NatsTls,
}

impl Default for NatsOptions {
    fn default() -> Self {
        Self {
            urls: vec!["nats://127.0.0.1:4222".into()],
            stream: "ROCE_TRACE".into(),
            prefix: "roce".into(),
            partitions: 64,
            replicas: 1,
            max_age: Duration::from_secs(15 * 60),
            max_bytes: -1,
            lease_ttl: Duration::from_secs(10),
            request_timeout: Duration::from_secs(5),
            auth: NatsAuth::None,
            tls: NatsTls::default(),
        }
    }
}

/// Why fleet options are not usable.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum OptionsError {
    #[error("--nats-url: at least one server is needed")]
    NoUrl,
    #[error("--nats-partitions must be at least 1")]
    NoPartitions,
    #[error("stream name {0:?}: only letters, digits, '-' and '_'")]
    StreamName(String),
    #[error("subject prefix {0:?}: dot-separated tokens of letters, digits, '-' and '_'")]
    Prefix(String),
    #[error("the lease TTL must be at least 100 ms")]
    LeaseTtl,
    #[error("give one of user/password, token, nkey seed and credentials file, not several")]
    ManyAuth,
    #[error("--nats-user and --nats-password go together")]
    UserWithoutPassword,
    #[error("--nats-tls-cert and --nats-tls-key go together")]
    CertWithoutKey,
}

fn is_name(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

impl NatsOptions {
    pub fn validate(&self) -> Result<(), OptionsError> {
        if self.urls.is_empty() {
            return Err(OptionsError::NoUrl);
        }
        if self.partitions == 0 {
            return Err(OptionsError::NoPartitions);
        }
        if !is_name(&self.stream) {
            return Err(OptionsError::StreamName(self.stream.clone()));
        }
        if !self.prefix.split('.').all(is_name) {
            return Err(OptionsError::Prefix(self.prefix.clone()));
        }
        if self.lease_ttl < Duration::from_millis(100) {
            return Err(OptionsError::LeaseTtl);
        }
        Ok(())
    }

    pub fn subjects(&self) -> Subjects {
        Subjects::new(&self.prefix)
    }

    fn points_bucket(&self) -> String {
        format!("{}-points", self.stream)
    }

    fn members_bucket(&self) -> String {
        format!("{}-members", self.stream)
    }
}

/// Fleet options on the command line (flatten into an agent's or collector's clap args).
#[derive(Clone, Debug, clap::Args)]
pub struct NatsArgs {
    /// NATS server URL (repeat for a cluster): fleet mode instead of direct TCP.
    #[arg(long = "nats-url", value_name = "URL")]
    pub urls: Vec<String>,
    #[arg(long = "nats-stream", default_value = "ROCE_TRACE")]
    pub stream: String,
    #[arg(long = "nats-prefix", default_value = "roce")]
    pub prefix: String,
    #[arg(long = "nats-partitions", default_value_t = 64)]
    pub partitions: u32,
    #[arg(long = "nats-replicas", default_value_t = 1)]
    pub replicas: usize,
    /// What a collector taking over a partition can replay.
    #[arg(long = "nats-max-age", default_value = "15m", value_parser = humantime::parse_duration)]
    pub max_age: Duration,
    /// Stream size bound in bytes (-1: none).
    #[arg(long = "nats-max-bytes", default_value_t = -1, allow_negative_numbers = true)]
    pub max_bytes: i64,
    #[arg(long = "nats-lease-ttl", default_value = "10s", value_parser = humantime::parse_duration)]
    pub lease_ttl: Duration,
    #[arg(long = "nats-user")]
    pub user: Option<String>,
    #[arg(long = "nats-password", env = "NATS_PASSWORD", hide_env_values = true)]
    pub password: Option<String>,
    #[arg(
        long = "nats-token",
        id = "nats_token",
        env = "NATS_TOKEN",
        hide_env_values = true
    )]
    pub token: Option<String>,
    #[arg(long = "nats-nkey-seed", env = "NATS_NKEY_SEED", hide_env_values = true)]
    pub nkey_seed: Option<String>,
    #[arg(long = "nats-creds", value_name = "FILE")]
    pub creds: Option<PathBuf>,
    #[arg(long = "nats-tls-ca", value_name = "PEM")]
    pub tls_ca: Option<PathBuf>,
    #[arg(long = "nats-tls-cert", value_name = "PEM")]
    pub tls_cert: Option<PathBuf>,
    #[arg(long = "nats-tls-key", value_name = "PEM")]
    pub tls_key: Option<PathBuf>,
    /// Use TLS even without a CA or client certificate (server verified by the system's CAs).
    #[arg(long = "nats-tls")]
    pub tls: bool,
}

impl NatsArgs {
    /// The options these flags give, validated.
    pub fn options(&self) -> Result<NatsOptions, OptionsError> {
        let given = [
            self.user.is_some() || self.password.is_some(),
            self.token.is_some(),
            self.nkey_seed.is_some(),
            self.creds.is_some(),
        ];
        if given.iter().filter(|g| **g).count() > 1 {
            return Err(OptionsError::ManyAuth);
        }
        let auth = match (
            &self.user,
            &self.password,
            &self.token,
            &self.nkey_seed,
            &self.creds,
        ) {
            (Some(user), Some(password), ..) => NatsAuth::UserPassword {
                user: user.clone(),
                password: password.clone(),
            },
            (Some(_), None, ..) | (None, Some(_), ..) => return Err(OptionsError::UserWithoutPassword),
            (_, _, Some(t), ..) => NatsAuth::Token(t.clone()),
            (_, _, _, Some(s), _) => NatsAuth::NkeySeed(s.clone()),
            (_, _, _, _, Some(c)) => NatsAuth::CredentialsFile(c.clone()),
            _ => NatsAuth::None,
        };
        let client = match (&self.tls_cert, &self.tls_key) {
            (Some(c), Some(k)) => Some((c.clone(), k.clone())),
            (None, None) => None,
            _ => return Err(OptionsError::CertWithoutKey),
        };
        let o = NatsOptions {
            urls: self.urls.clone(),
            stream: self.stream.clone(),
            prefix: self.prefix.clone(),
            partitions: self.partitions,
            replicas: self.replicas,
            max_age: self.max_age,
            max_bytes: self.max_bytes,
            lease_ttl: self.lease_ttl,
            auth,
            tls: NatsTls {
                ca: self.tls_ca.clone(),
                client,
                required: self.tls,
            },
            ..NatsOptions::default()
        };
        o.validate()?;
        Ok(o)
    }
}

// ---------------------------------------------------------------------------------------
// Connecting

/// Why fleet mode could not start or talk to NATS.
#[derive(Debug, Error)]
pub enum FleetError {
    #[error(transparent)]
    Options(#[from] OptionsError),
    #[error("reading NATS credentials file {path}: {source}")]
    Credentials { path: PathBuf, source: std::io::Error },
    #[error("connecting to NATS ({urls}): {source}")]
    Connect {
        urls: String,
        source: async_nats::ConnectError,
    },
    #[error("JetStream stream {stream}: {source}")]
    Stream {
        stream: String,
        source: async_nats::Error,
    },
    #[error("stream {stream} has subjects {found:?}, this fleet needs {want:?}")]
    StreamSubjects {
        stream: String,
        found: Vec<String>,
        want: Vec<String>,
    },
    #[error("stream {stream} was made for {found:?} partitions, this process is set for {want}")]
    Partitions {
        stream: String,
        found: Option<u32>,
        want: u32,
    },
    #[error("KV bucket {bucket}: {source}")]
    Bucket {
        bucket: String,
        source: async_nats::Error,
    },
    #[error("node name or member id {0:?}: empty, or with control characters")]
    Name(String),
}

impl FleetError {
    /// Whether trying again later may succeed: the server, the stream or a bucket could
    /// not be reached (or answered with an error). Settings NATS refuses — options, a
    /// credentials file, the stream's partitions or subjects, a name — stay refused.
    pub fn is_transient(&self) -> bool {
        use async_nats::ConnectErrorKind as K;
        match self {
            FleetError::Connect { source, .. } => !matches!(
                source.kind(),
                K::ServerParse | K::AuthorizationViolation | K::Authentication | K::Tls
            ),
            FleetError::Stream { .. } | FleetError::Bucket { .. } => true,
            _ => false,
        }
    }
}

/// The stream's description: how the partition count is recorded (stream metadata needs
/// nats-server 2.10; Debian ships 2.9).
fn stream_description(partitions: u32) -> String {
    format!("roce-trace fleet, partitions={partitions}")
}

fn partitions_of_description(d: Option<&str>) -> Option<u32> {
    d?.strip_prefix("roce-trace fleet, partitions=")?.parse().ok()
}

/// A connection to one fleet's stream and buckets, shared by publishers and members.
#[derive(Clone)]
pub struct Fleet {
    client: async_nats::Client,
    js: Context,
    opts: NatsOptions,
    points: kv::Store,
    members: kv::Store,
    /// The members bucket's TTL as the server has it (it wins over `opts.lease_ttl`).
    lease_ttl: Duration,
    /// Counts the client's connections to a server: a change is a reconnection, after
    /// which consumers are started again at once (a restarted server has lost them, and
    /// the client would notice only after missing two idle heartbeats).
    connections: tokio::sync::watch::Receiver<u64>,
}

async fn connect_options(
    opts: &NatsOptions,
    connections: tokio::sync::watch::Sender<u64>,
) -> Result<async_nats::ConnectOptions, FleetError> {
    let mut c = match &opts.auth {
        NatsAuth::None => async_nats::ConnectOptions::new(),
        NatsAuth::UserPassword { user, password } => {
            async_nats::ConnectOptions::with_user_and_password(user.clone(), password.clone())
        }
        NatsAuth::Token(t) => async_nats::ConnectOptions::with_token(t.clone()),
        NatsAuth::NkeySeed(s) => async_nats::ConnectOptions::with_nkey(s.clone()),
        NatsAuth::CredentialsFile(path) => async_nats::ConnectOptions::with_credentials_file(path)
            .await
            .map_err(|source| FleetError::Credentials {
                path: path.clone(),
                source,
            })?,
    };
    if opts.tls.enabled() {
        c = c.require_tls(true);
    }
    if let Some(ca) = &opts.tls.ca {
        c = c.add_root_certificates(ca.clone());
    }
    if let Some((cert, key)) = &opts.tls.client {
        c = c.add_client_certificate(cert.clone(), key.clone());
    }
    let connections = Arc::new(connections);
    c = c.event_callback(move |ev| {
        let connections = connections.clone();
        async move {
            // (async-nats logs every event itself.)
            if matches!(ev, async_nats::Event::Connected) {
                connections.send_modify(|n| *n += 1);
            }
        }
    });
    Ok(c.connection_timeout(opts.request_timeout)
        .request_timeout(Some(opts.request_timeout))
        // Reconnect quickly at first, then every second at most: agents buffer meanwhile.
        .reconnect_delay_callback(|attempts| Duration::from_millis((50 * attempts as u64).min(1000))))
}

/// Connects and makes sure the stream and both KV buckets exist (creating what is
/// missing; an existing stream is checked, never changed: its subjects and partition
/// count must be this fleet's). Safe to call from every agent and member at once.
pub async fn connect(opts: NatsOptions) -> Result<Fleet, FleetError> {
    opts.validate()?;
    let urls = opts.urls.join(",");
    let addrs: Vec<async_nats::ServerAddr> = opts
        .urls
        .iter()
        .map(|u| u.parse())
        .collect::<Result<_, _>>()
        .map_err(|e: std::io::Error| FleetError::Connect {
            urls: urls.clone(),
            source: async_nats::ConnectError::with_source(async_nats::ConnectErrorKind::ServerParse, e),
        })?;
    let (tx, connections) = tokio::sync::watch::channel(0);
    let client = connect_options(&opts, tx)
        .await?
        .connect(addrs)
        .await
        .map_err(|source| FleetError::Connect { urls, source })?;
    let js = jetstream::ContextBuilder::new()
        .timeout(opts.request_timeout)
        .build(client.clone());
    ensure_stream(&js, &opts).await?;
    let points = ensure_bucket(
        &js,
        &opts.points_bucket(),
        "roce-trace fleet: each node's observation points",
        Duration::ZERO,
        opts.replicas,
    )
    .await?;
    let members = ensure_bucket(
        &js,
        &opts.members_bucket(),
        "roce-trace fleet: collector leases",
        opts.lease_ttl,
        opts.replicas,
    )
    .await?;
    let bucket_stream = format!("KV_{}", opts.members_bucket());
    let lease_ttl = js
        .get_stream(&bucket_stream)
        .await
        .map(|s| s.cached_info().config.max_age)
        .map_err(|e| FleetError::Bucket {
            bucket: opts.members_bucket(),
            source: e.into(),
        })?;
    Ok(Fleet {
        client,
        js,
        opts,
        points,
        members,
        // A bucket made by hand without a TTL keeps dead members until they leave:
        // refresh as if it were the default.
        lease_ttl: if lease_ttl.is_zero() {
            NatsOptions::default().lease_ttl
        } else {
            lease_ttl
        },
        connections,
    })
}

async fn ensure_stream(js: &Context, opts: &NatsOptions) -> Result<(), FleetError> {
    let subjects = opts.subjects().stream_subjects();
    let want = stream::Config {
        name: opts.stream.clone(),
        description: Some(stream_description(opts.partitions)),
        subjects: subjects.clone(),
        max_age: opts.max_age,
        max_bytes: opts.max_bytes,
        storage: StorageType::File,
        num_replicas: opts.replicas,
        // Re-sends after a lost acknowledgement are recognised by message id this long.
        duplicate_window: Duration::from_secs(120).min(if opts.max_age.is_zero() {
            Duration::from_secs(120)
        } else {
            opts.max_age
        }),
        ..Default::default()
    };
    let err = |source: async_nats::Error| FleetError::Stream {
        stream: opts.stream.clone(),
        source,
    };
    let mut s = js.get_or_create_stream(want).await.map_err(|e| err(e.into()))?;
    let info = s.info().await.map_err(|e| err(e.into()))?;
    let found = partitions_of_description(info.config.description.as_deref());
    if found != Some(opts.partitions) {
        return Err(FleetError::Partitions {
            stream: opts.stream.clone(),
            found,
            want: opts.partitions,
        });
    }
    // Retention and replicas are the operator's to tune on a live stream: the stream's
    // own win, and a process asking for others says so.
    let c = &info.config;
    if (c.max_age, c.max_bytes, c.num_replicas) != (opts.max_age, opts.max_bytes, opts.replicas) {
        tracing::warn!(
            "stream {} keeps max_age {:?}, max_bytes {}, replicas {} (this process asked for {:?}, {}, {}): the stream's settings apply",
            opts.stream,
            c.max_age,
            c.max_bytes,
            c.num_replicas,
            opts.max_age,
            opts.max_bytes,
            opts.replicas
        );
    }
    let have: BTreeSet<&String> = info.config.subjects.iter().collect();
    if have != subjects.iter().collect() {
        return Err(FleetError::StreamSubjects {
            stream: opts.stream.clone(),
            found: info.config.subjects.clone(),
            want: subjects,
        });
    }
    Ok(())
}

/// Opens the bucket, creating its stream first when missing. The stream is made here, in
/// the layout `async_nats` gives KV buckets (`KV_<bucket>`, `$KV.<bucket>.>`, one value per
/// key, roll-ups allowed, deletes denied, direct gets): its own `create_key_value` asks for
/// the account's info first, which it cannot parse from nats-server 2.9 (Debian's).
async fn ensure_bucket(
    js: &Context,
    bucket: &str,
    description: &str,
    max_age: Duration,
    replicas: usize,
) -> Result<kv::Store, FleetError> {
    let err = |source: async_nats::Error| FleetError::Bucket {
        bucket: bucket.to_string(),
        source,
    };
    let config = stream::Config {
        name: format!("KV_{bucket}"),
        description: Some(description.to_string()),
        subjects: vec![format!("$KV.{bucket}.>")],
        max_messages_per_subject: 1,
        max_age,
        storage: StorageType::File,
        num_replicas: replicas,
        allow_rollup: true,
        deny_delete: true,
        allow_direct: true,
        discard: stream::DiscardPolicy::New,
        duplicate_window: if max_age.is_zero() {
            Duration::from_secs(120)
        } else {
            max_age.min(Duration::from_secs(120))
        },
        ..Default::default()
    };
    js.get_or_create_stream(config).await.map_err(|e| err(e.into()))?;
    js.get_key_value(bucket).await.map_err(|e| err(e.into()))
}

impl Fleet {
    pub fn options(&self) -> &NatsOptions {
        &self.opts
    }
    pub fn subjects(&self) -> Subjects {
        self.opts.subjects()
    }
    /// The underlying client (tests, and callers that publish or request themselves).
    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }
    pub fn jetstream(&self) -> &Context {
        &self.js
    }
}

// ---------------------------------------------------------------------------------------
// Payloads

/// Why a message on a fleet subject was skipped. Like a frame that breaks the protocol on
/// TCP, except that one bad message does not stop the consumer: it is counted, logged
/// with its subject, and the next one is read.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum PayloadError {
    #[error("no {NODE_HEADER} header")]
    NoNode,
    #[error("no {PROTOCOL_HEADER} header (an agent before protocol 8; this side speaks {v})", v = crate::protocol::VERSION)]
    NoProtocol,
    #[error("protocol version {got:?} (this side speaks {v}): its points may sample other packets", v = crate::protocol::VERSION)]
    OtherProtocol { got: String },
    #[error(transparent)]
    Frame(#[from] ProtoError),
    #[error("payload ends inside its frame")]
    Truncated,
    #[error("bytes after the payload's frame")]
    Trailing,
    #[error("a {got} frame on a subject that carries {want}")]
    WrongKind { got: &'static str, want: &'static str },
}

/// Whether a message's [`PROTOCOL_HEADER`] value (`None`: absent) is this side's version.
pub fn check_protocol(value: Option<&str>) -> Result<(), PayloadError> {
    match value {
        None => Err(PayloadError::NoProtocol),
        Some(v) if v == crate::protocol::VERSION.to_string() => Ok(()),
        Some(v) => Err(PayloadError::OtherProtocol {
            got: v.chars().take(32).collect(),
        }),
    }
}

/// The one frame a message carries (encoded with sequence number 0).
pub fn decode_payload(payload: &[u8]) -> Result<Frame, PayloadError> {
    let mut buf = BytesMut::from(payload);
    match Decoder::default().decode(&mut buf)? {
        Some(f) if buf.is_empty() => Ok(f),
        Some(_) => Err(PayloadError::Trailing),
        None => Err(PayloadError::Truncated),
    }
}

/// A node's point table as a KV value: its POINTS frames back to back, numbered from 0.
fn encode_points(points: &[PointDecl]) -> Result<Bytes, ProtoError> {
    let mut v = BytesMut::new();
    for (seq, f) in points_frames(points).iter().enumerate() {
        v.extend_from_slice(&encode(f, seq as u64)?);
    }
    Ok(v.freeze())
}

fn decode_points(value: &[u8]) -> Result<Vec<PointDecl>, PayloadError> {
    let mut buf = BytesMut::from(value);
    let mut dec = Decoder::default();
    let mut points = Vec::new();
    while !buf.is_empty() {
        match dec.decode(&mut buf)? {
            Some(Frame::Points(p)) => points.extend(p),
            Some(f) => {
                return Err(PayloadError::WrongKind {
                    got: f.name(),
                    want: "POINTS",
                });
            }
            None => return Err(PayloadError::Truncated),
        }
    }
    Ok(points)
}

/// A node name or member id fit for a header value: not empty, no control characters.
fn check_name(s: &str) -> Result<(), FleetError> {
    if s.is_empty() || s.chars().any(char::is_control) {
        return Err(FleetError::Name(s.to_string()));
    }
    Ok(())
}

mod member;
mod publisher;

pub use member::{ConsumeStats, Delivered, FleetEvent, GroupMember, MemberInfo, MemberOptions};
pub use publisher::{PublishStats, Publisher, PublisherOptions, SendError};

#[cfg(test)]
mod tests;
