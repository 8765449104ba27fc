//! Where `verify`'s windows come from — a saved report, a live collector, or an
//! in-process collector fed by this host's own datapath — and a drill's actions and
//! timing. The judge (`roce-trace-verify`) does no I/O: everything it reads is fetched
//! here.

use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use anyhow::Context as _;
use roce_trace_verify::{
    drill::{self, Snapshots},
    window::since,
};

use crate::{
    agent::AgentOptions,
    collector::{self, CollectorOptions, CollectorReport},
    correlate::JoinConfig,
};

/// Where a window's observations come from.
#[derive(Clone, Debug)]
pub enum Source {
    /// A report the collector wrote (`collect --report`), `-` for stdin.
    Report(PathBuf),
    /// A running collector's HTTP API: its report after `window`.
    Collector {
        http: SocketAddr,
        window: Duration,
        /// The API's bearer token, when it asks for one.
        bearer: Option<String>,
    },
    /// This host's own interfaces, through an in-process agent and collector.
    Local {
        agent: Box<AgentOptions>,
        window: Duration,
    },
}

impl Source {
    pub fn describe(&self) -> String {
        match self {
            Source::Report(p) => format!("report {}", p.display()),
            Source::Collector { http, window, .. } => {
                format!(
                    "collector http://{http} over {}",
                    humantime::format_duration(*window)
                )
            }
            Source::Local { agent, window } => format!(
                "local capture on {} over {}",
                agent.ifaces.join(","),
                humantime::format_duration(*window)
            ),
        }
    }
}

/// A report the collector wrote (`-`: stdin).
pub fn read_report(path: &std::path::Path) -> anyhow::Result<CollectorReport> {
    let text = if path.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin()).context("reading the report from stdin")?
    } else {
        std::fs::read_to_string(path).with_context(|| format!("reading the report {}", path.display()))?
    };
    Ok(roce_trace_verify::parse_report(
        &text,
        &path.display().to_string(),
    )?)
}

/// The collector's current report, over its HTTP API.
pub async fn fetch_report(http: SocketAddr, bearer: Option<&str>) -> anyhow::Result<CollectorReport> {
    let bearer = bearer.map(str::to_owned);
    tokio::task::spawn_blocking(move || {
        crate::http::get_json_as::<CollectorReport>(http, "/report", bearer.as_deref())
    })
    .await
    .context("fetching the report")?
}

/// An in-process collector on loopback, fed by an in-process agent on this host's
/// interfaces; `body` runs while they do, with the collector's HTTP address.
pub async fn with_local<T, F, Fut>(agent: &AgentOptions, body: F) -> anyhow::Result<(T, CollectorReport)>
where
    F: FnOnce(SocketAddr) -> Fut,
    Fut: Future<Output = anyhow::Result<T>>,
{
    // The in-process collector listens on loopback: any local user could connect with a
    // guessable token, so it is random.
    let token = random_token()?;
    let (ctx, crx) = tokio::sync::oneshot::channel();
    let (stop_c, stopped_c) = tokio::sync::oneshot::channel::<()>();
    let copts = CollectorOptions {
        listen: "127.0.0.1:0".parse().expect("address"),
        http: Some("127.0.0.1:0".parse().expect("address")),
        token: token.clone(),
        report: None,
        tls: None,
        agent_timeout: crate::collector::AGENT_TIMEOUT,
        report_every: Duration::ZERO,
        join: JoinConfig {
            trajectory_timeout_ns: 1_000_000_000,
            ..JoinConfig::default()
        },
        live: false,
        trace: false,
        interval: Duration::from_secs(3600),
        fleet: None,
        continuous: None,
        http_token: None,
    };
    let coll = tokio::spawn(collector::run(
        copts,
        async {
            let _ = stopped_c.await;
        },
        move |listen, http| {
            let _ = ctx.send((listen, http.expect("http requested")));
        },
    ));
    let (listen, http) = match crx.await {
        Ok(a) => a,
        Err(_) => {
            return Err(coll
                .await
                .context("collector task")?
                .err()
                .unwrap_or_else(|| anyhow::anyhow!("collector stopped")));
        }
    };
    let mut aopts = agent.clone();
    aopts.collector = listen.to_string();
    aopts.token = token;
    let (atx, arx) = tokio::sync::oneshot::channel();
    let (stop_a, stopped_a) = tokio::sync::oneshot::channel::<()>();
    let interval = aopts.interval;
    let ag = tokio::spawn(crate::agent::run(
        aopts,
        async {
            let _ = stopped_a.await;
        },
        move |_, _| {
            let _ = atx.send(());
        },
    ));
    if arx.await.is_err() {
        let _ = stop_c.send(());
        return Err(ag
            .await
            .context("agent task")?
            .err()
            .unwrap_or_else(|| anyhow::anyhow!("agent stopped")));
    }
    let out = body(http).await;
    // The last counter deltas, then the agent's last samples, then the join's flush.
    tokio::time::sleep(interval + Duration::from_millis(300)).await;
    let _ = stop_a.send(());
    ag.await.context("agent task")??;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = stop_c.send(());
    let report = coll.await.context("collector task")??;
    Ok((out?, report))
}

/// One window's report from `source`.
pub async fn window_report(source: &Source) -> anyhow::Result<CollectorReport> {
    match source {
        Source::Report(p) => read_report(p),
        Source::Collector { http, window, bearer } => {
            // What the collector learnt during the window: its view at the end less its
            // view at the start (which also fails early on a wrong address).
            let start = fetch_report(*http, bearer.as_deref()).await?;
            tokio::time::sleep(*window).await;
            Ok(since(&start, fetch_report(*http, bearer.as_deref()).await?))
        }
        Source::Local { agent, window } => {
            let w = *window;
            Ok(with_local(agent, |_| async move {
                tokio::time::sleep(w).await;
                Ok(())
            })
            .await?
            .1)
        }
    }
}

#[derive(Clone, Debug)]
pub struct DrillOptions {
    /// Shell command that causes the failure; none: the user is asked to.
    pub down: Option<String>,
    /// Shell command that repairs it; none: the user is asked to.
    pub up: Option<String>,
    /// How long traffic runs before, during and after the failure.
    pub hold: Duration,
    /// How long `down` and `up` may each run before they are killed.
    pub timeout: Duration,
}

use crate::protocol::unix_now_ns as unix_ns;

/// Set when the future waiting for a drill command is dropped (the drill was interrupted
/// or failed around it): the command and everything it started are killed.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Runs `sh -c cmd` in a process group of its own, at most `timeout`: past it, or when the
/// caller stops waiting, the whole group is killed. When it ran and how it ended is said
/// on stderr (the drill says what it did).
async fn run_command(cmd: &str, what: &str, timeout: Duration) -> anyhow::Result<u64> {
    use std::os::unix::process::CommandExt as _;
    let t = unix_ns();
    eprintln!("drill: {what}: running `{cmd}`");
    let mut child = std::process::Command::new("sh")
        .args(["-c", cmd])
        .process_group(0)
        .spawn()
        .with_context(|| format!("drill: starting `{cmd}`"))?;
    let cancel = Arc::new(AtomicBool::new(false));
    let _guard = CancelOnDrop(cancel.clone());
    let started = std::time::Instant::now();
    let c = cmd.to_owned();
    let ended = tokio::task::spawn_blocking(move || -> anyhow::Result<std::process::ExitStatus> {
        loop {
            if let Some(st) = child.try_wait()? {
                return Ok(st);
            }
            let late = started.elapsed() >= timeout;
            if late || cancel.load(Ordering::Relaxed) {
                // SAFETY: kill(2) on the group we created; no memory is involved.
                unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
                let _ = child.wait();
                anyhow::bail!(
                    "drill: `{c}` {} after {:.1} s; killed it and everything it started",
                    if late { "timed out" } else { "was interrupted" },
                    started.elapsed().as_secs_f64()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    })
    .await??;
    let took = started.elapsed().as_secs_f64();
    anyhow::ensure!(ended.success(), "drill: `{cmd}` failed ({ended}, {took:.1} s)");
    eprintln!("drill: {what}: `{cmd}` done ({ended}, {took:.1} s)");
    Ok(t)
}

async fn act(cmd: &Option<String>, what: &str, timeout: Duration) -> anyhow::Result<u64> {
    match cmd {
        Some(c) => run_command(c, what, timeout).await,
        None => {
            // The event happens somewhere between the question and the answer: times are
            // measured from the question, so they include the operator's delay.
            let t = unix_ns();
            eprintln!("drill: {what} now, then press Enter");
            let n = tokio::task::spawn_blocking(|| {
                let mut l = String::new();
                std::io::stdin().read_line(&mut l)
            })
            .await?
            .context("waiting for Enter")?;
            anyhow::ensure!(
                n > 0,
                "drill: stdin closed while waiting for Enter (use --down/--up to run commands)"
            );
            Ok(t)
        }
    }
}

/// SIGINT (Ctrl-C) and SIGTERM, caught from the moment the drill breaks something: they
/// end the drill, never the repair.
struct Interrupts {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
}

impl Interrupts {
    fn catch() -> anyhow::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            int: signal(SignalKind::interrupt()).context("catching SIGINT")?,
            term: signal(SignalKind::terminate()).context("catching SIGTERM")?,
        })
    }

    /// The next one to come: its name.
    async fn next(&mut self) -> &'static str {
        tokio::select! {
            _ = self.int.recv() => "SIGINT",
            _ = self.term.recv() => "SIGTERM",
        }
    }

    /// One that came already, if any.
    async fn came(&mut self) -> Option<&'static str> {
        tokio::select! {
            biased;
            s = self.next() => Some(s),
            () = std::future::ready(()) => None,
        }
    }
}

/// Runs the drill against a collector reachable at `http`: the collector's reports
/// before, through and after the failure, for [`drill::measure`]. Once `--down` has
/// started, `--up` runs whatever happens next — `--down` failing or timing out, the
/// collector not answering, Ctrl-C or SIGTERM (which wait for the repair) — and the
/// drill says so before it fails.
pub async fn run_drill(
    http: std::net::SocketAddr,
    bearer: Option<&str>,
    opts: &DrillOptions,
) -> anyhow::Result<Snapshots> {
    let fetch = || fetch_report(http, bearer);
    let start = fetch().await?;
    tracing::info!(
        "drill: traffic for {} before the failure",
        humantime::format_duration(opts.hold)
    );
    tokio::time::sleep(opts.hold).await;
    let before = fetch().await?;
    anyhow::ensure!(
        drill::data(&since(&start, before.clone())).next().is_some(),
        "drill: no RDMA data flow ran before the failure; start the traffic first"
    );
    let mut signals = Interrupts::catch()?;
    let failed = async {
        let down_at_ns = act(&opts.down, "cause the failure", opts.timeout).await?;
        let half = opts.hold / 2;
        tokio::time::sleep(half).await;
        let settled = fetch().await?;
        tokio::time::sleep(opts.hold - half).await;
        let during = fetch().await?;
        anyhow::Ok((down_at_ns, settled, during))
    };
    let outcome = tokio::select! {
        r = failed => r,
        sig = signals.next() => Err(anyhow::anyhow!("drill: {sig} during the failure")),
    };
    // The repair runs whatever happened; a signal meanwhile waits for it.
    if let Err(e) = &outcome {
        eprintln!("drill: {e:#}; repairing");
    }
    let repaired = act(&opts.up, "repair it", opts.timeout).await;
    let ((down_at_ns, settled, during), up_at_ns) = match (outcome, repaired) {
        (Ok(o), Ok(up_at_ns)) => (o, up_at_ns),
        (Err(e), Ok(_)) if opts.up.is_some() => {
            return Err(e.context("drill stopped; the failure was repaired with --up"));
        }
        (Err(e), Ok(_)) => return Err(e.context("drill stopped; the failure was repaired by hand")),
        (Err(e), Err(up)) => {
            return Err(e.context(format!("drill stopped, and the repair failed too: {up:#}")));
        }
        (Ok(_), Err(up)) => return Err(up.context("drill: the repair failed")),
    };
    if let Some(sig) = signals.came().await {
        anyhow::bail!("drill: {sig} during the repair; the failure was repaired, the drill not judged");
    }
    let after = tokio::select! {
        () = tokio::time::sleep(opts.hold) => fetch().await?,
        sig = signals.next() => {
            anyhow::bail!("drill: {sig} after the repair; the failure was repaired, the drill not judged")
        }
    };
    Ok(Snapshots {
        start,
        before,
        settled,
        during,
        after,
        down_at_ns,
        up_at_ns,
    })
}

/// The policy file, parsed and checked.
pub fn load_policy(path: &std::path::Path) -> anyhow::Result<roce_trace_verify::policy::Policy> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading the policy {}", path.display()))?;
    roce_trace_verify::policy::Policy::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// A baseline `verify --save-baseline` wrote.
pub fn load_baseline(path: &std::path::Path) -> anyhow::Result<roce_trace_verify::baseline::Baseline> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading the baseline {}", path.display()))?;
    Ok(roce_trace_verify::baseline::Baseline::from_json(
        &text,
        &path.display().to_string(),
    )?)
}

/// Writes a baseline.
pub fn save_baseline(
    b: &roce_trace_verify::baseline::Baseline,
    path: &std::path::Path,
) -> anyhow::Result<()> {
    crate::sys::write_atomically(path, &b.to_json()).with_context(|| format!("writing {}", path.display()))
}

/// 128 random bits from the kernel, as hex.
fn random_token() -> anyhow::Result<String> {
    let mut b = [0u8; 16];
    // SAFETY: getrandom writes at most `b.len()` bytes into `b`.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    anyhow::ensure!(
        n == b.len() as isize,
        "getrandom: {}",
        std::io::Error::last_os_error()
    );
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}
