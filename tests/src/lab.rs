//! The virtual fabric (`roce-trace-lab`), and roce-trace observing it: a collector on
//! its management network and an agent on every node.

pub use roce_trace_lab::*;

/// A collector on the lab's management network (agents at `MGMT_COLLECTOR:4792`, its
/// report written to `report`) and an agent on every node sampling 1 in 4.
pub struct Observers {
    collector: Option<crate::Daemon>,
    agents: Vec<crate::Daemon>,
    report: std::path::PathBuf,
    /// The collector's namespace and arguments, for [`Observers::restart_collector`].
    collector_ns: String,
    collector_args: Vec<String>,
}

impl Observers {
    /// `extra`: more collector arguments (`--http ADDR`, `--trace`).
    pub fn start(lab: &Lab, report: std::path::PathBuf, token: &str, extra: &[&str]) -> Self {
        Self::start_with(lab, report, token, extra, |_| Vec::new())
    }

    /// As [`Observers::start`], with more arguments for each node's agent.
    pub fn start_with(
        lab: &Lab,
        report: std::path::PathBuf,
        token: &str,
        extra: &[&str],
        agent_extra: impl Fn(&str) -> Vec<String>,
    ) -> Self {
        let listen = format!("{MGMT_COLLECTOR}:4792");
        let mut args = vec![
            "collect",
            "--listen",
            &listen,
            "--token",
            token,
            "--quiet",
            "--report",
            report.to_str().expect("utf-8 path"),
            // The default: an agent starved of CPU for a moment (2 cores, 8 agents, the
            // generators) must not turn its late observations into "lost".
            "--trajectory-timeout",
            "2s",
        ];
        args.extend_from_slice(extra);
        let collector = crate::Daemon::start(&lab.ns("mgmt"), &args, "collecting on");
        let collector_args = args.iter().map(|a| (*a).to_owned()).collect();
        let mut agents = Vec::new();
        for n in Lab::nodes() {
            let mut a = lab.agent_args(&n, &listen, token, 4).expect("agent arguments");
            a.extend(agent_extra(&n));
            let a: Vec<&str> = a.iter().map(String::as_str).collect();
            agents.push(crate::Daemon::start(&lab.ns(&n), &a, "connected to collector"));
        }
        Self {
            collector: Some(collector),
            agents,
            report,
            collector_ns: lab.ns("mgmt"),
            collector_args,
        }
    }

    /// Stops the collector (SIGINT: it writes its report and exits) and starts it again
    /// with the same arguments; the agents reconnect on their own.
    pub fn restart_collector(&mut self) {
        self.collector.take().expect("running").stop();
        let args: Vec<&str> = self.collector_args.iter().map(String::as_str).collect();
        self.collector = Some(crate::Daemon::start(&self.collector_ns, &args, "collecting on"));
    }

    /// What the collector printed on stderr so far.
    pub fn collector_log(&self) -> String {
        self.collector
            .as_ref()
            .map(|c| c.stderr.lock().unwrap().clone())
            .unwrap_or_default()
    }

    /// Stops the agents, then the collector; the report it wrote.
    pub fn stop(mut self) -> std::path::PathBuf {
        for a in self.agents.drain(..) {
            a.stop();
        }
        self.collector.take().expect("running").stop();
        self.report.clone()
    }
}

impl Drop for Observers {
    fn drop(&mut self) {
        for a in self.agents.drain(..) {
            a.kill();
        }
        if let Some(c) = self.collector.take() {
            c.kill();
        }
    }
}

/// h1 → h3 and h2 → h4 on 8 QPs each at 2 Mbit/s for `secs` (every host, leaf and spine
/// on some path; the responders outlive the senders by 3 s), QPs 0x100… and 0x200…,
/// source ports 49252… and 49352….
pub fn two_pairs_traffic(lab: &Lab, secs: u64) -> Vec<crate::Proc> {
    let mut v = Vec::new();
    for (from, to) in [(1u8, 3u8), (2, 4)] {
        v.push(crate::spawn_gen(
            &lab.ns(&format!("h{to}")),
            &[
                "--bind",
                &format!("10.10.{to}.2"),
                "--duration",
                &format!("{}s", secs + 3),
            ],
        ));
        std::thread::sleep(std::time::Duration::from_millis(300));
        v.push(crate::spawn_gen(
            &lab.ns(&format!("h{from}")),
            &[
                "--to",
                &format!("10.10.{to}.2"),
                "--qps",
                "8",
                "--rate",
                "2mbit",
                "--duration",
                &format!("{secs}s"),
                "--sport-base",
                &format!("{}", 49152 + 100 * u32::from(from)),
                "--qp-base",
                &format!("{:#x}", 0x100 * u32::from(from)),
            ],
        ));
    }
    v
}
