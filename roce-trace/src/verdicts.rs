//! Continuous verification's I/O (`collect --policy`): the windows' reports kept for the
//! judge, the history of verdict changes on disk, the alert webhook, and what `/verdicts`
//! and `/metrics` show. The judging itself is the pure judge's
//! ([`crate::verify::checks::judge`], [`crate::verify::continuous::Tracker`]).

use std::{
    collections::VecDeque,
    io::{BufRead as _, Write as _},
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use anyhow::{Context as _, bail, ensure};

use crate::{
    correlate::CollectorReport,
    verify::{
        checks::Load,
        continuous::{Event, Tracker, Verdicts, Window},
        output::Verdict,
        policy::Policy,
    },
};

/// Windows one judgement may span, in units of `--verify-every`: each costs a report
/// kept in memory.
pub const MAX_WINDOWS_KEPT: u64 = 10;

/// How the collector judges continuously.
#[derive(Clone, Debug)]
pub struct ContinuousOptions {
    pub policy: Policy,
    /// The policy's file, as given.
    pub policy_name: String,
    pub every: Duration,
    pub window: Duration,
    pub fail_after: u32,
    pub load: Load,
    /// The history of changes (JSON lines), and how many events it keeps.
    pub history: PathBuf,
    pub history_max: usize,
    pub alert_url: Option<AlertUrl>,
}

impl ContinuousOptions {
    pub fn validate(&self) -> anyhow::Result<()> {
        ensure!(!self.every.is_zero(), "--verify-every must be more than 0s");
        ensure!(
            self.window >= self.every,
            "--verify-window ({}) must be at least --verify-every ({}): windows would leave time unjudged",
            humantime::format_duration(self.window),
            humantime::format_duration(self.every)
        );
        ensure!(
            self.window.as_nanos() <= self.every.as_nanos() * u128::from(MAX_WINDOWS_KEPT),
            "--verify-window may be at most {MAX_WINDOWS_KEPT} times --verify-every (a report is kept in memory per --verify-every of the window)"
        );
        ensure!(self.fail_after >= 1, "--fail-after must be at least 1");
        ensure!(self.history_max >= 1, "--verdict-history-max must be at least 1");
        Ok(())
    }
}

/// Unix time now, in ms.
pub fn unix_ms() -> u64 {
    crate::protocol::unix_now_ns() / 1_000_000
}

/// What the windows are cut from: of each report, one per `--verify-every` back to the
/// start of the next window ([`MAX_WINDOWS_KEPT`] + 2 at most), only what a window's
/// start needs ([`crate::verify::window::base`]).
#[derive(Default)]
pub struct Snapshots {
    kept: VecDeque<(u64, CollectorReport)>,
}

impl Snapshots {
    /// `now` (taken at `at_ms`) less the newest report at least `window` older — within
    /// `slack` (half a period: the ticks that took them are not exactly a period apart):
    /// the window's report and its bounds; `None` for the first report (nothing to judge
    /// against yet). Reports no later window needs are let go.
    pub fn window(
        &mut self,
        at_ms: u64,
        now: CollectorReport,
        window: Duration,
        slack: Duration,
    ) -> Option<(Window, CollectorReport)> {
        let kept = crate::verify::window::base(&now);
        let want = (at_ms + slack.as_millis() as u64).saturating_sub(window.as_millis() as u64);
        let base = self
            .kept
            .iter()
            .rposition(|(t, _)| *t <= want)
            .or((!self.kept.is_empty()).then_some(0));
        let out = base.map(|i| {
            let (start, ref b) = self.kept[i];
            (
                Window {
                    start_ms: start,
                    end_ms: at_ms,
                },
                crate::verify::window::since(b, now),
            )
        });
        if let Some(i) = base {
            self.kept.drain(..i);
        }
        self.kept.push_back((at_ms, kept));
        out
    }

    pub fn len(&self) -> usize {
        self.kept.len()
    }

    pub fn is_empty(&self) -> bool {
        self.kept.is_empty()
    }
}

/// The history of verdict changes: JSON lines, one event each, oldest first, appended
/// as they happen and rewritten to the newest `max` once it holds twice that (so the
/// file holds at most `2 × max` events); the newest `max` in memory.
pub struct History {
    path: PathBuf,
    max: usize,
    events: VecDeque<Event>,
    in_file: usize,
}

impl History {
    /// Reads the history at `path` (none yet: an empty one, and the path is checked by
    /// creating it). A last line cut short (the collector stopped while writing it) is
    /// dropped with a warning; any other line that is not an event is an error naming
    /// it: the file is not overwritten.
    pub fn open(path: &Path, max: usize) -> anyhow::Result<Self> {
        let mut events = VecDeque::new();
        let mut in_file = 0;
        match std::fs::File::open(path) {
            Ok(f) => {
                let mut lines = std::io::BufReader::new(f).split(b'\n').enumerate().peekable();
                let mut cut = false;
                while let Some((i, line)) = lines.next() {
                    let line =
                        line.with_context(|| format!("reading the verdict history {}", path.display()))?;
                    let last = lines.peek().is_none();
                    if line.iter().all(u8::is_ascii_whitespace) {
                        continue;
                    }
                    match serde_json::from_slice::<Event>(&line) {
                        Ok(e) if e.kind == "verdict_change" => {
                            in_file += 1;
                            events.push_back(e);
                            if events.len() > max {
                                events.pop_front();
                            }
                        }
                        Ok(e) => bail!(
                            "{}:{}: not a verdict change (type `{}`); move the file aside to start a new history",
                            path.display(),
                            i + 1,
                            e.kind
                        ),
                        Err(_) if last && !ends_with_newline(path)? => {
                            tracing::warn!(
                                "{}:{}: the last line was cut short (the collector stopped while writing it): dropped",
                                path.display(),
                                i + 1
                            );
                            cut = true;
                        }
                        Err(e) => bail!(
                            "{}:{}: not a verdict change ({e}); move the file aside to start a new history",
                            path.display(),
                            i + 1
                        ),
                    }
                }
                let mut h = Self {
                    path: path.into(),
                    max,
                    events,
                    in_file,
                };
                if cut {
                    h.rewrite()?;
                }
                Ok(h)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .with_context(|| format!("creating the verdict history {}", path.display()))?;
                Ok(Self {
                    path: path.into(),
                    max,
                    events,
                    in_file,
                })
            }
            Err(e) => Err(e).with_context(|| format!("reading the verdict history {}", path.display())),
        }
    }

    pub fn events(&self) -> &VecDeque<Event> {
        &self.events
    }

    /// Appends `e` (written through before this returns).
    pub fn append(&mut self, e: Event) -> anyhow::Result<()> {
        let mut line = serde_json::to_vec(&e)?;
        line.push(b'\n');
        self.events.push_back(e);
        if self.events.len() > self.max {
            self.events.pop_front();
        }
        if self.in_file + 1 > 2 * self.max {
            return self.rewrite();
        }
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(&self.path)
            .with_context(|| format!("appending to the verdict history {}", self.path.display()))?;
        f.write_all(&line)
            .and_then(|()| f.sync_data())
            .with_context(|| format!("appending to the verdict history {}", self.path.display()))?;
        self.in_file += 1;
        Ok(())
    }

    /// The file replaced, whole, by the events in memory.
    fn rewrite(&mut self) -> anyhow::Result<()> {
        let mut bytes = Vec::new();
        for e in &self.events {
            serde_json::to_writer(&mut bytes, e)?;
            bytes.push(b'\n');
        }
        crate::sys::write_atomically(&self.path, &bytes)
            .with_context(|| format!("rewriting the verdict history {}", self.path.display()))?;
        self.in_file = self.events.len();
        Ok(())
    }
}

fn ends_with_newline(path: &Path) -> anyhow::Result<bool> {
    use std::io::{Read as _, Seek as _};
    let mut f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    if len == 0 {
        return Ok(true);
    }
    f.seek(std::io::SeekFrom::Start(len - 1))?;
    let mut b = [0u8];
    f.read_exact(&mut b)?;
    Ok(b[0] == b'\n')
}

/// Where alerts are POSTed: `http://host[:port]/path`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AlertUrl {
    pub host: String,
    pub port: u16,
    pub path: String,
}

impl std::str::FromStr for AlertUrl {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Self> {
        let Some(rest) = s.strip_prefix("http://") else {
            if s.starts_with("https://") {
                bail!(
                    "--alert-url {s}: https is not supported; give an http:// receiver (a relay on this host or the cluster's network)"
                );
            }
            bail!("--alert-url {s}: not an http:// URL");
        };
        let (hostport, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        ensure!(!hostport.is_empty(), "--alert-url {s}: no host");
        ensure!(
            !hostport.contains('@'),
            "--alert-url {s}: credentials in the URL are not supported"
        );
        let (host, port) = match hostport.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(']') || h.starts_with('[') => match p.parse::<u16>() {
                Ok(p) if !h.is_empty() => (h.trim_start_matches('[').trim_end_matches(']'), p),
                _ => bail!("--alert-url {s}: `{p}` is not a port"),
            },
            _ => (hostport, 80),
        };
        ensure!(
            path.bytes().all(|b| b.is_ascii_graphic()),
            "--alert-url {s}: the path must be plain ASCII without spaces (percent-encode it)"
        );
        Ok(Self {
            host: host.into(),
            port,
            path: path.into(),
        })
    }
}

impl AlertUrl {
    /// `host:port` as a URL and a `Host:` header write it (an IPv6 address bracketed).
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

impl std::fmt::Display for AlertUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "http://{}{}", self.authority(), self.path)
    }
}

/// Alerts waiting to be sent at most; past it the newest is dropped, and counted.
pub const ALERT_QUEUE: usize = 256;
/// Tries per alert before it is given up (the waits between them double from 0.5 s to 30 s).
pub const ALERT_TRIES: u32 = 10;

/// What became of the alerts.
#[derive(Default, Debug)]
pub struct AlertCounts {
    pub delivered: AtomicU64,
    /// Tries that failed and were tried again.
    pub retried: AtomicU64,
    /// Given up after [`ALERT_TRIES`].
    pub gave_up: AtomicU64,
    /// The queue was full.
    pub dropped: AtomicU64,
}

/// The alert webhook: a thread of its own POSTs each event, one at a time in order,
/// retrying with backoff; the judge only puts events on its queue (never waits).
pub struct Alerter {
    tx: std::sync::mpsc::SyncSender<Event>,
    pub counts: Arc<AlertCounts>,
}

impl Alerter {
    pub fn start(url: AlertUrl) -> Self {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Event>(ALERT_QUEUE);
        let counts = Arc::new(AlertCounts::default());
        let c = counts.clone();
        std::thread::Builder::new()
            .name("alerts".into())
            .spawn(move || {
                for e in rx {
                    let body = match serde_json::to_vec(&e) {
                        Ok(b) => b,
                        Err(_) => continue,
                    };
                    let mut wait = Duration::from_millis(500);
                    for attempt in 1..=ALERT_TRIES {
                        match post(&url, &body) {
                            Ok(()) => {
                                c.delivered.fetch_add(1, Ordering::Relaxed);
                                break;
                            }
                            Err(err) if attempt == ALERT_TRIES => {
                                c.gave_up.fetch_add(1, Ordering::Relaxed);
                                tracing::warn!(
                                    "alert {} to {url}: given up after {attempt} tries: {err:#}",
                                    e.seq
                                );
                            }
                            Err(err) => {
                                c.retried.fetch_add(1, Ordering::Relaxed);
                                tracing::warn!("alert {} to {url}: {err:#}; again in {wait:?}", e.seq);
                                std::thread::sleep(wait);
                                wait = (wait * 2).min(Duration::from_secs(30));
                            }
                        }
                    }
                }
            })
            .expect("starting the alert thread");
        Self { tx, counts }
    }

    /// Queues `e` without waiting: a full queue drops it (counted).
    pub fn send(&self, e: Event) {
        if self.tx.try_send(e).is_err() {
            self.counts.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// One POST of `body` (JSON); a 2xx answer delivers it.
fn post(url: &AlertUrl, body: &[u8]) -> anyhow::Result<()> {
    use std::net::ToSocketAddrs as _;
    let addrs: Vec<_> = (url.host.as_str(), url.port)
        .to_socket_addrs()
        .with_context(|| format!("resolving {}", url.host))?
        .collect();
    let mut last = None;
    for addr in addrs {
        match post_to(addr, url, body) {
            Ok(status) if (200..300).contains(&status) => return Ok(()),
            Ok(status) => last = Some(anyhow::anyhow!("{addr} answered {status}")),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("{} has no address", url.host)))
}

fn post_to(addr: std::net::SocketAddr, url: &AlertUrl, body: &[u8]) -> anyhow::Result<u16> {
    let headers = format!(
        "Content-Type: application/json\r\nContent-Length: {}\r\nUser-Agent: roce-trace\r\n",
        body.len()
    );
    let (status, _) = crate::http::request(
        addr,
        "POST",
        &url.authority(),
        &url.path,
        &headers,
        body,
        Duration::from_secs(10),
    )?;
    Ok(status)
}

/// The continuous judge's state, as `/verdicts` and `/metrics` read it.
pub struct Judge {
    pub opts: ContinuousOptions,
    pub tracker: Tracker,
    pub history: History,
    pub alerter: Option<Alerter>,
    /// Judging now (in a group: this member is the one that judges).
    pub judging: bool,
    pub windows: u64,
    pub last_window: Option<Window>,
    /// The last window's whole verdict.
    pub last_verdict: Option<Verdict>,
    /// How long the last judgement took (report, window, judge), in µs.
    pub last_took_us: u64,
    /// Ticks skipped: the judgement before was still running, or a group member did not
    /// answer (a partial view is not judged).
    pub skipped_busy: u64,
    pub skipped_partial: u64,
    pub events: u64,
    pub history_errors: u64,
}

impl Judge {
    /// The history read, the tracker resumed from it, the webhook started.
    pub fn new(opts: ContinuousOptions) -> anyhow::Result<Self> {
        opts.validate()?;
        let history = History::open(&opts.history, opts.history_max)?;
        let tracker = Tracker::resume(opts.fail_after, history.events());
        let alerter = opts.alert_url.clone().map(Alerter::start);
        Ok(Self {
            opts,
            tracker,
            history,
            alerter,
            judging: false,
            windows: 0,
            last_window: None,
            last_verdict: None,
            last_took_us: 0,
            skipped_busy: 0,
            skipped_partial: 0,
            events: 0,
            history_errors: 0,
        })
    }

    /// One judged window's results (the pure judge's, made outside this lock): the
    /// tracker moves on; an event is written to the history,
    /// printed, and queued for the webhook.
    pub fn record(
        &mut self,
        window: Window,
        at_ms: u64,
        flows: usize,
        checks: Vec<crate::verify::checks::CheckResult>,
        took_us: u64,
    ) -> Option<Event> {
        let event = self.tracker.window(window, at_ms, flows, &checks);
        self.windows += 1;
        self.last_window = Some(window);
        self.last_took_us = took_us;
        self.last_verdict = Some(Verdict::new(
            format!("collector window {}..{}", window.start_ms, window.end_ms),
            self.opts.load,
            flows,
            checks,
        ));
        let e = event?;
        self.events += 1;
        for c in &e.changes {
            let from = c.from.map_or("(none)", |s| s.name());
            let line = format!(
                "verdict: {} {} -> {} (since {}): {}",
                c.check,
                from,
                c.to.name(),
                humantime::format_rfc3339_millis(std::time::UNIX_EPOCH + Duration::from_millis(c.began_ms)),
                c.summary
            );
            if c.to == crate::verify::checks::Status::Fail {
                tracing::warn!("{line}");
            } else {
                tracing::info!("{line}");
            }
        }
        if let Err(err) = self.history.append(e.clone()) {
            self.history_errors += 1;
            tracing::warn!("{err:#}");
        }
        if let (Some(a), Some(alert)) = (&self.alerter, e.alerting()) {
            a.send(alert);
        }
        Some(e)
    }

    pub fn verdicts(&self) -> Verdicts {
        Verdicts {
            kind: "verdicts".into(),
            judging: self.judging,
            policy: self.opts.policy_name.clone(),
            every_ms: self.opts.every.as_millis() as u64,
            window_ms: self.opts.window.as_millis() as u64,
            fail_after: self.opts.fail_after,
            load: self.opts.load,
            windows: self.windows,
            last_window: self.last_window,
            checks: self.tracker.states().cloned().collect(),
            events: self.history.events().iter().cloned().collect(),
        }
    }

    pub fn metrics(&self) -> VerifyMetrics {
        let a = self.alerter.as_ref().map(|a| {
            [
                a.counts.delivered.load(Ordering::Relaxed),
                a.counts.retried.load(Ordering::Relaxed),
                a.counts.gave_up.load(Ordering::Relaxed),
                a.counts.dropped.load(Ordering::Relaxed),
            ]
        });
        VerifyMetrics {
            judging: self.judging,
            every_s: self.opts.every.as_secs_f64(),
            windows: self.windows,
            last_window_end_s: self.last_window.map_or(0, |w| w.end_ms / 1000),
            last_took_us: self.last_took_us,
            skipped_busy: self.skipped_busy,
            skipped_partial: self.skipped_partial,
            events: self.events,
            history_errors: self.history_errors,
            alerts: a,
            checks: self.tracker.states().cloned().collect(),
        }
    }
}

/// Failing flows or items shown per check as labelled series, at most: the series a
/// scrape holds are bounded by the policy's checks times this.
pub const ITEMS_SHOWN: usize = 10;

/// Continuous verification's figures for `/metrics` (members send theirs in
/// `/metrics.json`; the group's are the judging member's).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct VerifyMetrics {
    pub judging: bool,
    pub every_s: f64,
    pub windows: u64,
    pub last_window_end_s: u64,
    pub last_took_us: u64,
    pub skipped_busy: u64,
    pub skipped_partial: u64,
    pub events: u64,
    pub history_errors: u64,
    /// Delivered, retried, gave up, dropped (`None`: no webhook).
    pub alerts: Option<[u64; 4]>,
    pub checks: Vec<crate::verify::continuous::CheckState>,
}

impl VerifyMetrics {
    /// The group's: the judging member's, else any.
    pub fn merge(&mut self, o: &Self) {
        if o.judging && !self.judging {
            *self = o.clone();
        }
    }

    pub fn render(&self, m: &mut crate::metrics::Scrape) {
        use crate::{
            metrics::labels,
            verify::checks::Status::{Fail, NoData, Pass, Skip},
        };
        m.gauge1(
            "roce_trace_verify_judging",
            "1 while this collector (in a group: the member answering) judges the policy continuously.",
            u64::from(self.judging),
        );
        m.gauge1(
            "roce_trace_verify_every_seconds",
            "How often a window is judged (--verify-every), in whole seconds rounded up.",
            self.every_s.ceil() as u64,
        );
        m.counter1("roce_trace_verify_windows_total", "Windows judged.", self.windows);
        m.gauge1(
            "roce_trace_verify_last_window_timestamp_seconds",
            "When the last judged window ended (Unix time; 0: none yet).",
            self.last_window_end_s,
        );
        m.gauge1(
            "roce_trace_verify_judge_microseconds",
            "How long judging the last window took (its report, the window, the checks).",
            self.last_took_us,
        );
        m.counter(
            "roce_trace_verify_windows_skipped_total",
            "Windows not judged: the judgement before was still running (busy), or a group member did not answer (partial).",
            [
                (labels(&[("reason", "busy")]), self.skipped_busy),
                (labels(&[("reason", "partial")]), self.skipped_partial),
            ],
        );
        m.counter1(
            "roce_trace_verify_events_total",
            "Verdict changes recorded in the history.",
            self.events,
        );
        m.counter1(
            "roce_trace_verify_history_errors_total",
            "Verdict changes the history file could not be written with.",
            self.history_errors,
        );
        m.counter(
            "roce_trace_verify_alerts_total",
            "Alerts to --alert-url: delivered, tries retried, given up after every try, dropped on a full queue.",
            self.alerts.iter().flat_map(|a| {
                ["delivered", "retried", "gave_up", "dropped"]
                    .into_iter()
                    .zip(*a)
                    .map(|(o, n)| (labels(&[("outcome", o)]), n))
            }),
        );
        let status_names = [
            (Some(Pass), "pass"),
            (Some(Skip), "skip"),
            (Some(NoData), "no_data"),
            (Some(Fail), "fail"),
            (None, "pending"),
        ];
        m.gauge(
            "roce_trace_verify_check_status",
            "Each check's established status (after --fail-after windows agree), 1 for it and 0 for the others: pass, skip, no_data, fail, or pending (not judged yet: no window had its traffic, or too few agreed).",
            self.checks.iter().flat_map(|c| {
                status_names
                    .iter()
                    .map(move |(x, name)| (labels(&[("check", &c.check), ("status", name)]), u64::from(*x == c.status)))
            }),
        );
        m.gauge(
            "roce_trace_verify_check_failing_items",
            "Flows (or items) the last window's evidence of each check names.",
            self.checks
                .iter()
                .map(|c| (labels(&[("check", &c.check)]), c.failing_items as u64)),
        );
        m.gauge(
            "roce_trace_verify_check_failing_windows",
            "Consecutive windows, up to the last, in which each check failed.",
            self.checks
                .iter()
                .map(|c| (labels(&[("check", &c.check)]), c.failing_windows)),
        );
        m.gauge(
            "roce_trace_verify_check_last_change_timestamp_seconds",
            "When each check's established status last changed (Unix time).",
            self.checks
                .iter()
                .filter_map(|c| c.changed_ms.map(|t| (labels(&[("check", &c.check)]), t / 1000))),
        );
        m.gauge(
            "roce_trace_verify_failing_item",
            "1 per flow (or item) failing a check in the last window, the first 10 of each check in order (bounded: checks times 10); roce_trace_verify_check_failing_items has how many.",
            self.checks.iter().flat_map(|c| {
                c.items
                    .iter()
                    .take(ITEMS_SHOWN)
                    .map(move |i| (labels(&[("check", &c.check), ("item", i)]), 1))
            }),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verify::{
        checks::{Evidence, Status},
        continuous::Change,
    };

    fn event(seq: u64, check: &str, to: Status) -> Event {
        Event {
            kind: "verdict_change".into(),
            seq,
            at_ms: 1_000 * seq + 2_000,
            window: Window {
                start_ms: 1_000 * seq,
                end_ms: 1_000 * seq + 2_000,
            },
            flows: 3,
            changes: vec![Change {
                check: check.into(),
                rule: "r".into(),
                from: Some(Status::Pass),
                to,
                began_ms: 1_000 * seq + 1_000,
                summary: "s".into(),
                checked: 3,
                evidence: vec![Evidence {
                    flow: "10.0.0.1:1>10.0.0.2/0x1".into(),
                    at: vec![],
                    detail: "d".into(),
                }],
                evidence_total: 1,
            }],
        }
    }

    fn temp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("roce-trace-verdicts-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d.join("h.jsonl")
    }

    #[test]
    fn the_history_survives_a_reopen_and_stays_bounded_on_disk() {
        let p = temp("bound");
        let mut h = History::open(&p, 3).unwrap();
        assert!(p.exists(), "the path is checked by creating it");
        for i in 1..=20 {
            h.append(event(i, "c", Status::Fail)).unwrap();
            let lines = std::fs::read_to_string(&p).unwrap().lines().count();
            assert!(lines <= 6, "{lines} events in the file after {i}");
        }
        let seqs: Vec<u64> = h.events().iter().map(|e| e.seq).collect();
        assert_eq!(seqs, [18, 19, 20]);
        let again = History::open(&p, 3).unwrap();
        let back: Vec<u64> = again.events().iter().map(|e| e.seq).collect();
        assert_eq!(back, [18, 19, 20]);
        assert_eq!(again.events().back(), h.events().back());
    }

    #[test]
    fn a_torn_last_line_is_dropped_and_a_broken_history_is_refused_not_overwritten() {
        let p = temp("torn");
        let mut h = History::open(&p, 10).unwrap();
        h.append(event(1, "c", Status::Fail)).unwrap();
        h.append(event(2, "c", Status::Pass)).unwrap();
        // A crash mid-write: half a line, no newline.
        let mut f = std::fs::OpenOptions::new().append(true).open(&p).unwrap();
        f.write_all(br#"{"type":"verdict_change","seq":3,"at_"#).unwrap();
        drop(f);
        let h = History::open(&p, 10).unwrap();
        assert_eq!(h.events().len(), 2);
        assert!(
            std::fs::read_to_string(&p).unwrap().ends_with("\n"),
            "rewritten without the torn line"
        );
        // A broken line in the middle (or a whole line that is something else).
        let good = std::fs::read_to_string(&p).unwrap();
        let bad = format!("garbage\n{good}");
        std::fs::write(&p, &bad).unwrap();
        let e = History::open(&p, 10).err().expect("refused").to_string();
        assert!(e.contains(":1:") && e.contains("move the file aside"), "{e}");
        assert_eq!(std::fs::read_to_string(&p).unwrap(), bad, "left as it was");
        std::fs::write(&p, format!("{good}{{\"type\":\"verify\"}}\n")).unwrap();
        let e = History::open(&p, 10).err().expect("refused").to_string();
        assert!(e.contains(":3:"), "{e}");
        // A directory where the file should be.
        let d = p.with_file_name("dir");
        std::fs::create_dir_all(&d).unwrap();
        assert!(History::open(&d, 10).is_err());
    }

    #[test]
    fn alert_urls() {
        let u: AlertUrl = "http://alerts.example:9093/hook?x=1".parse().unwrap();
        assert_eq!(
            (u.host.as_str(), u.port, u.path.as_str()),
            ("alerts.example", 9093, "/hook?x=1")
        );
        let u: AlertUrl = "http://10.0.0.1".parse().unwrap();
        assert_eq!((u.port, u.path.as_str()), (80, "/"));
        let u: AlertUrl = "http://[::1]:8080/a".parse().unwrap();
        assert_eq!((u.host.as_str(), u.port), ("::1", 8080));
        assert_eq!(u.to_string(), "http://[::1]:8080/a");
        for bad in [
            "https://x/",
            "ftp://x",
            "http://",
            "http://x:port/",
            "http://u:p@x/",
            "http://x/a b",
            "x",
        ] {
            assert!(bad.parse::<AlertUrl>().is_err(), "{bad}");
        }
        assert!(
            "https://x/"
                .parse::<AlertUrl>()
                .unwrap_err()
                .to_string()
                .contains("https is not supported")
        );
    }

    /// A receiver that answers `statuses` in turn (then 200), and the bodies it took with
    /// a 2xx.
    fn receiver(statuses: Vec<u16>) -> (AlertUrl, std::sync::mpsc::Receiver<Vec<u8>>) {
        use std::io::Read as _;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut statuses = statuses.into_iter();
            for s in l.incoming() {
                let mut s = s.unwrap();
                let mut req = Vec::new();
                let mut buf = [0u8; 4096];
                let body = loop {
                    let n = s.read(&mut buf).unwrap();
                    req.extend_from_slice(&buf[..n]);
                    if let Some(i) = req.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&req[..i]).to_ascii_lowercase();
                        let len: usize = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .unwrap()
                            .trim()
                            .parse()
                            .unwrap();
                        while req.len() < i + 4 + len {
                            let n = s.read(&mut buf).unwrap();
                            req.extend_from_slice(&buf[..n]);
                        }
                        assert!(head.starts_with("post /hook http/1.1"), "{head}");
                        break req[i + 4..i + 4 + len].to_vec();
                    }
                };
                let status = statuses.next().unwrap_or(200);
                let _ = write!(
                    s,
                    "HTTP/1.1 {status} X\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                );
                if status == 200 {
                    tx.send(body).unwrap();
                }
            }
        });
        (format!("http://127.0.0.1:{port}/hook").parse().unwrap(), rx)
    }

    #[test]
    fn alerts_are_retried_in_order_until_delivered() {
        let (url, rx) = receiver(vec![503, 500]);
        let a = Alerter::start(url);
        a.send(event(1, "c", Status::Fail));
        a.send(event(2, "c", Status::Pass));
        let got: Vec<Event> = (0..2)
            .map(|_| serde_json::from_slice(&rx.recv_timeout(Duration::from_secs(10)).unwrap()).unwrap())
            .collect();
        assert_eq!(got, [event(1, "c", Status::Fail), event(2, "c", Status::Pass)]);
        // The receiver hands a body over before the sender has read its answer.
        let t = std::time::Instant::now();
        while a.counts.delivered.load(Ordering::Relaxed) < 2 && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(a.counts.delivered.load(Ordering::Relaxed), 2);
        assert_eq!(a.counts.retried.load(Ordering::Relaxed), 2);
        assert!(
            rx.recv_timeout(Duration::from_millis(300)).is_err(),
            "each delivered once"
        );
    }

    #[test]
    fn a_full_alert_queue_drops_and_counts_without_waiting() {
        // Nobody listens: every send fails and is retried, so the queue fills.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url: AlertUrl = format!("http://127.0.0.1:{}/hook", l.local_addr().unwrap().port())
            .parse()
            .unwrap();
        drop(l);
        let a = Alerter::start(url);
        let t = std::time::Instant::now();
        for i in 0..(ALERT_QUEUE as u64 + 50) {
            a.send(event(i + 1, "c", Status::Fail));
        }
        assert!(t.elapsed() < Duration::from_millis(500), "send never waits");
        let dropped = a.counts.dropped.load(Ordering::Relaxed);
        assert!((49..=50).contains(&dropped), "{dropped}");
    }

    fn report_with(flows: usize) -> CollectorReport {
        let mut r: CollectorReport =
            serde_json::from_str(include_str!("../../tests/golden/collector-report.json")).unwrap();
        r.flows.truncate(flows);
        r
    }

    const SLACK: Duration = Duration::from_millis(500);

    #[test]
    fn each_window_starts_at_the_newest_report_old_enough_and_old_reports_go() {
        let mut s = Snapshots::default();
        let w = Duration::from_secs(3);
        assert!(
            s.window(1_000, report_with(0), w, SLACK).is_none(),
            "nothing to judge against yet"
        );
        let (win, _) = s.window(2_000, report_with(1), w, SLACK).unwrap();
        assert_eq!(
            (win.start_ms, win.end_ms),
            (1_000, 2_000),
            "the oldest, while the window is not full"
        );
        s.window(3_000, report_with(1), w, SLACK).unwrap();
        let (win, _) = s.window(4_000, report_with(1), w, SLACK).unwrap();
        assert_eq!(win.start_ms, 1_000);
        let (win, _) = s.window(5_000, report_with(1), w, SLACK).unwrap();
        assert_eq!(win.start_ms, 2_000);
        // A tick late or early by less than half a period still takes the report a
        // window before.
        let (win, _) = s.window(6_300, report_with(1), w, SLACK).unwrap();
        assert_eq!(win.start_ms, 3_000);
        let (win, _) = s.window(6_950, report_with(1), w, SLACK).unwrap();
        assert_eq!(win.start_ms, 4_000, "2.95 s back is the window, within the slack");
        assert!(s.len() <= 4, "{} kept", s.len());
        // The window holds only what happened in it: the same report twice, nothing.
        let r = report_with(2);
        assert!(!r.flows.is_empty());
        let mut s = Snapshots::default();
        s.window(10_000, r.clone(), w, SLACK);
        let (_, all) = s.window(11_000, r.clone(), w, SLACK).unwrap();
        assert!(
            all.flows.is_empty(),
            "{} flows in a window where nothing happened",
            all.flows.len()
        );
        let mut s = Snapshots::default();
        s.window(10_000, report_with(0), w, SLACK);
        let (_, all) = s.window(11_000, r.clone(), w, SLACK).unwrap();
        assert_eq!(all.flows.len(), r.flows.len());
    }
}
