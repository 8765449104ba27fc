//! The README's first command: the virtual leaf-spine fabric, RoCEv2 traffic between host
//! pairs, a roce-trace agent on every node (hosts and switches) streaming to a collector,
//! faults injected mid-run, and what roce-trace found: each flow's path, where its class
//! changed, where CE marks began and the CNPs that answered them. Exits non-zero when
//! roce-trace did not see the injected faults.

use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail, ensure};
use roce_trace_lab::{Fault, Lab, MGMT_COLLECTOR};
use serde_json::Value;

fn say(s: &str) {
    println!("\x1b[1m== {s}\x1b[0m");
}

const QPS: u32 = 8;
const TOKEN: &str = "demo";

/// Tears the lab down (and every process in it) however the demo ends.
struct Run {
    lab: Lab,
}

impl Drop for Run {
    fn drop(&mut self) {
        say("tearing the lab down");
        if let Err(e) = self.lab.down() {
            eprintln!("lab down: {e:#}");
        }
    }
}

/// Starts roce-trace in `node`, waits for `ready` on its stderr, passes warnings on.
fn spawn(lab: &Lab, node: &str, bin: &Path, args: &[&str], ready: &str) -> anyhow::Result<Child> {
    let mut c = Command::new("ip")
        .args(["netns", "exec", &lab.ns(node)])
        .arg(bin)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting roce-trace in {node}"))?;
    let mut err = BufReader::new(c.stderr.take().expect("piped"));
    let mut line = String::new();
    loop {
        line.clear();
        if err.read_line(&mut line)? == 0 {
            bail!("roce-trace {} in {node} exited before `{ready}`", args[0]);
        }
        if line.contains("WARN") || line.contains("error") {
            eprint!("  [{node}] {line}");
        }
        if line.contains(ready) {
            break;
        }
    }
    let node = node.to_owned();
    std::thread::spawn(move || {
        for l in err.lines().map_while(Result::ok) {
            if l.contains("ERROR") || l.contains("error:") {
                eprintln!("  [{node}] {l}");
            }
        }
    });
    Ok(c)
}

/// Set by SIGINT or SIGTERM while the demo waits with everything kept up.
static INTERRUPTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Blocks until SIGINT or SIGTERM, caught (whichever thread takes it) so that the demo
/// tears the lab down after rather than dying with it up.
fn wait_for_interrupt() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: installing a handler that only stores to an atomic (signal-safe).
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
    while !INTERRUPTED.load(std::sync::atomic::Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn interrupt_and_wait(c: Child, what: &str) -> anyhow::Result<String> {
    // SAFETY: signalling our own child.
    unsafe { libc::kill(c.id() as i32, libc::SIGINT) };
    let out = c.wait_with_output()?;
    ensure!(out.status.success(), "{what} failed ({})", out.status);
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Fleet mode's collectors in the demo: three members of one group.
const MEMBERS: u16 = 3;

/// The group's view, once its join has taken everything the agents published: nothing
/// pending twice in a row with the observation count still, then past the CNP settle
/// time; its report, from the first member.
fn group_report(lab: &Lab, https: &[String]) -> anyhow::Result<Value> {
    // Asked from the management network, where the collectors listen.
    let get = |path: &str| -> anyhow::Result<Value> {
        let body = lab.exec(
            "mgmt",
            &[
                "curl",
                "-sS",
                "--fail-with-body",
                &format!("http://{}{path}", https[0]),
            ],
        )?;
        serde_json::from_str(&body).with_context(|| format!("{path}: not the expected JSON"))
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = None;
    let mut still = 0;
    while still < 2 {
        ensure!(
            Instant::now() < deadline,
            "the group's join did not settle within a minute"
        );
        std::thread::sleep(Duration::from_millis(500));
        let st = get("/stats")?;
        let now = (st["observations"].as_u64(), st["trajectories"].as_u64());
        still = if st["pending"] == 0 && last == Some(now) {
            still + 1
        } else {
            0
        };
        last = Some(now);
    }
    std::thread::sleep(Duration::from_millis(3500));
    get("/report")
}

/// Continuous verification during the demo: the collector's verdict changes (at `http`,
/// from the management network) printed with their time from the fault; what is wrong
/// with them (none: `data_class` failed while s1 rewrote DSCP and passed again once the
/// rewrite was cleared, while traffic still ran).
fn continuous_events(lab: &Lab, http: &str, fault_at: u64, clear_at: u64) -> anyhow::Result<Vec<String>> {
    let body = lab.exec(
        "mgmt",
        &[
            "curl",
            "-sS",
            "--fail-with-body",
            &format!("http://{http}/verdicts"),
        ],
    )?;
    let v: roce_trace::verify::continuous::Verdicts =
        serde_json::from_str(&body).context("/verdicts: not the collector's verdicts")?;
    say(&format!(
        "continuous verification (collect --policy): {} windows of {} s judged every {} s; the verdict changes",
        v.windows,
        v.window_ms / 1000,
        v.every_ms / 1000
    ));
    let rel = |t: u64| (t as f64 - fault_at as f64) / 1000.0;
    println!(
        "(times from the fault; the rewrite was cleared at {:+.1} s)",
        rel(clear_at)
    );
    let (mut failed, mut passed) = (None, None);
    for e in &v.events {
        for c in &e.changes {
            println!(
                "  {:+6.1} s  {:<16} {:>7} -> {:<7} (its windows from {:+.1} s)  {}",
                rel(e.at_ms),
                c.check,
                c.from.map_or("-", |s| s.name()),
                c.to.name(),
                rel(c.began_ms),
                c.summary
            );
            if c.check == "data_class" {
                use roce_trace::verify::checks::Status;
                if c.to == Status::Fail && c.began_ms >= fault_at && failed.is_none() {
                    failed = Some(e.at_ms);
                }
                if c.to == Status::Pass && c.from == Some(Status::Fail) && c.began_ms >= clear_at {
                    passed = Some(e.at_ms);
                }
            }
        }
    }
    let mut wrong = Vec::new();
    match (failed, passed) {
        (Some(f), Some(p)) if f < clear_at + 2_000 && p > f => {}
        _ => wrong.push(format!(
            "continuous verification: data_class should fail after the fault ({failed:?}) and pass after the repair ({passed:?}); fault at {fault_at}, cleared at {clear_at}"
        )),
    }
    Ok(wrong)
}

/// Relays `127.0.0.1:PORT` on this host to `target` in network namespace `ns` (the lab's
/// management network, where the collectors' HTTP listens): what makes the web view
/// reachable from a browser on this machine. The address it listens on.
fn relay(ns: &str, target: std::net::SocketAddr) -> anyhow::Result<std::net::SocketAddr> {
    use std::net::{TcpListener, TcpStream};
    let l = TcpListener::bind("127.0.0.1:9480")
        .or_else(|_| TcpListener::bind("127.0.0.1:0"))
        .context("listening for the web view")?;
    let addr = l.local_addr()?;
    let path = format!("/var/run/netns/{ns}");
    std::thread::spawn(move || {
        for client in l.incoming().map_while(Result::ok) {
            let path = path.clone();
            std::thread::spawn(move || {
                // This thread alone enters the namespace; the socket keeps it.
                let Ok(netns) = std::fs::File::open(&path) else {
                    return;
                };
                use std::os::fd::AsRawFd as _;
                // SAFETY: an open netns file; setns changes only this thread.
                if unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    return;
                }
                let Ok(up) = TcpStream::connect(target) else {
                    return;
                };
                let (Ok(mut c2), Ok(mut u2)) = (client.try_clone(), up.try_clone()) else {
                    return;
                };
                let back = std::thread::spawn(move || {
                    let _ = std::io::copy(&mut u2, &mut c2);
                    let _ = c2.shutdown(std::net::Shutdown::Write);
                });
                let (mut c, mut u) = (client, up);
                let _ = std::io::copy(&mut c, &mut u);
                let _ = u.shutdown(std::net::Shutdown::Write);
                let _ = back.join();
            });
        }
    });
    Ok(addr)
}

pub fn run(seconds: u64, nats: bool, keep: bool) -> anyhow::Result<()> {
    let bin = Path::new("target/release/roce-trace");
    ensure!(
        bin.exists(),
        "{} missing: run `cargo build --release --bins` first (scripts/demo does)",
        bin.display()
    );
    let bin = bin.canonicalize()?;
    ensure!(
        seconds >= 12,
        "--seconds {seconds}: at least 12 (the rewrite must be on, and then off, for several of the continuous verification's windows)"
    );
    let started = Instant::now();
    let lab = Lab::default();
    let run = Run { lab: lab.clone() };

    say(
        "building the virtual fabric: 2 spines, 2 leaves, 4 hosts (Linux namespaces), ECMP on the UDP source port",
    );
    lab.down()?;
    lab.up()?;
    print!("{}", lab.status()?);

    let dir = std::env::temp_dir().join(format!("roce-trace-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let report = dir.join("report.json");
    let listen = format!("{MGMT_COLLECTOR}:4792");
    say(&format!(
        "roce-trace collect on the management network ({listen})"
    ));
    let rep = report.to_string_lossy().into_owned();
    // Fleet mode: a JetStream server on the management network and a group of
    // collectors; otherwise one collector the agents connect to.
    let nats_url = format!("nats://{MGMT_COLLECTOR}:4222");
    // What every collector of the demo is given; fleet mode adds its own.
    // Continuous verification: the class rules judged every second over the last two,
    // a window enough to turn a check (--fail-after 1), each member its own history.
    let policy = dir.join("continuous-policy.toml");
    std::fs::write(&policy, "[class]\ndata_dscp = 26\nno_change = true\n")?;
    let policy = policy.to_string_lossy().into_owned();
    let collect_args = |listen: &str, report: &str| -> Vec<String> {
        let history = format!("{}-verdicts.jsonl", report.trim_end_matches(".json"));
        [
            "collect",
            "--listen",
            listen,
            "--token",
            TOKEN,
            "--quiet",
            "--report",
            report,
            "--trajectory-timeout",
            "1s",
            "--policy",
            &policy,
            "--verify-every",
            "1s",
            "--verify-window",
            "2s",
            "--fail-after",
            "1",
            "--verdict-history",
            &history,
        ]
        .map(String::from)
        .to_vec()
    };
    let mut nats_server = None;
    let mut collectors = Vec::new();
    let mut https = Vec::new();
    if nats {
        say(&format!("NATS JetStream on the management network ({nats_url})"));
        let store = dir.join("jetstream");
        let mut n = Command::new("ip")
            .args([
                "netns",
                "exec",
                &lab.ns("mgmt"),
                "nats-server",
                "-js",
                "-a",
                MGMT_COLLECTOR,
                "-p",
                "4222",
                "-sd",
            ])
            .arg(&store)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting nats-server (scripts/setup installs it)")?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while lab
            .exec(
                "mgmt",
                &["bash", "-c", &format!("exec 3<>/dev/tcp/{MGMT_COLLECTOR}/4222")],
            )
            .is_err()
        {
            if Instant::now() > deadline {
                let _ = n.kill();
                bail!("nats-server did not start");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        nats_server = Some(n);
        say(&format!(
            "{MEMBERS} roce-trace collectors as a group (members c1..c{MEMBERS}), each serving the group's view"
        ));
        for m in 1..=MEMBERS {
            let (id, http, listen, rep) = (
                format!("c{m}"),
                format!("127.0.0.1:{}", 9470 + m),
                format!("{MGMT_COLLECTOR}:{}", 4792 + m),
                dir.join(format!("c{m}.json")).to_string_lossy().into_owned(),
            );
            let mut args = collect_args(&listen, &rep);
            args.extend(
                [
                    "--http",
                    &http,
                    "--nats-url",
                    &nats_url,
                    "--member-id",
                    &id,
                    "--nats-partitions",
                    "16",
                    "--nats-lease-ttl",
                    "3s",
                ]
                .map(String::from),
            );
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            collectors.push(spawn(&lab, "mgmt", &bin, &args, "collecting on")?);
            https.push(http);
        }
    } else {
        let http = "127.0.0.1:8080".to_string();
        let mut args = collect_args(&listen, &rep);
        args.extend(["--http".to_string(), http.clone()]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        collectors.push(spawn(&lab, "mgmt", &bin, &args, "collecting on")?);
        https.push(http);
    }
    let web = relay(&lab.ns("mgmt"), https[0].parse()?)?;
    say(&format!(
        "the fabric map, live: http://{web}/ (the collector's web view{})",
        if keep {
            ""
        } else {
            ", while the demo runs; --keep leaves it up"
        }
    ));
    say(
        "a roce-trace agent on every node: XDP ingress + TC egress on every port of hosts, leaves and spines",
    );
    let mut agents = Vec::new();
    for n in Lab::nodes() {
        let mut args = lab.agent_args(&n, &listen, TOKEN, 10)?;
        let ready = if nats {
            // The same agent, publishing to NATS instead of connecting to a collector.
            let at = args
                .iter()
                .position(|a| a == "--collector")
                .context("agent args")?;
            args.drain(at..at + 2);
            let at = args.iter().position(|a| a == "--token").context("agent args")?;
            args.drain(at..at + 2);
            args.extend([
                "--nats-url".to_owned(),
                nats_url.clone(),
                "--nats-partitions".into(),
                "16".into(),
            ]);
            "fleet mode: publishing to NATS"
        } else {
            "connected to collector"
        };
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        agents.push(spawn(&lab, &n, &bin, &a, ready)?);
    }
    say("RDMA responders on h3 and h4 (ACK, NAK on PSN gaps, CNP on CE)");
    let mut responders = Vec::new();
    for h in [3u8, 4] {
        let ip = Lab::host_ip(h, false).to_string();
        let dur = format!("{}s", seconds + 1);
        responders.push(spawn(
            &lab,
            &format!("h{h}"),
            &bin,
            &["gen", "--bind", &ip, "--duration", &dur, "--json"],
            "answering",
        )?);
    }
    say(&format!(
        "traffic for {seconds}s: h1 -> h3 and h2 -> h4, {QPS} QPs each (RDMA WRITE 64 KiB, MTU 1024, DSCP 26, ECT(0), 5 Mbit/s per QP, DCQCN)"
    ));
    let mut senders = Vec::new();
    for (src, dst) in [(1u8, 3u8), (2, 4)] {
        let ip = Lab::host_ip(dst, false).to_string();
        let dur = format!("{seconds}s");
        let q = QPS.to_string();
        senders.push(spawn(
            &lab,
            &format!("h{src}"),
            &bin,
            &[
                "gen",
                "--to",
                &ip,
                "--qps",
                &q,
                "--rate",
                "5mbit",
                "--duration",
                &dur,
                "--json",
            ],
            "answering",
        )?);
    }
    std::thread::sleep(Duration::from_secs(seconds / 4));
    say("fault injected: spine s1 remarks DSCP 26 -> 0; leaf l2 CE-marks 5% of what it sends to h4");
    let rewrite = Fault::DscpRewrite {
        spine: 1,
        from: 26,
        to: 0,
    };
    let fault_at = roce_trace::verdicts::unix_ms();
    lab.apply(&rewrite)?;
    lab.apply(&Fault::CeMark {
        node: "l2".into(),
        iface: "h4".into(),
        percent: 5,
    })?;
    std::thread::sleep(Duration::from_secs(seconds * 3 / 8));
    say(
        "the rewrite cleared at s1 (CE marking stays): the collector's continuous verification must turn green again",
    );
    let clear_at = roce_trace::verdicts::unix_ms();
    lab.clear(&rewrite)?;

    for c in senders {
        let out = c.wait_with_output()?;
        ensure!(out.status.success(), "gen failed");
    }
    for c in responders {
        let out = c.wait_with_output()?;
        ensure!(out.status.success(), "gen responder failed");
    }
    std::thread::sleep(Duration::from_millis(1500)); // the last counters and samples
    let continuous = continuous_events(&lab, &https[0], fault_at, clear_at)?;
    // --keep: the agents and collectors stay up for a person to look; their report is
    // read over HTTP, as fleet mode's is.
    let mut kept = Vec::new();
    if keep {
        kept.extend(agents);
    } else {
        for a in agents {
            interrupt_and_wait(a, "roce-trace agent")?;
        }
    }
    let view = if keep {
        let r = group_report(&lab, &https)?;
        std::fs::write(&report, serde_json::to_vec_pretty(&r)?)?;
        kept.extend(collectors);
        let r: roce_trace::collector::CollectorReport = serde_json::from_value(r)?;
        roce_trace::collector::render(&r)
    } else if nats {
        // The group's view, from any member, once the agents' last frames are joined.
        let r = group_report(&lab, &https)?;
        std::fs::write(&report, serde_json::to_vec_pretty(&r)?)?;
        for c in collectors {
            interrupt_and_wait(c, "roce-trace collect")?;
        }
        if let Some(mut n) = nats_server.take() {
            let _ = n.kill();
            let _ = n.wait();
        }
        let r: roce_trace::collector::CollectorReport = serde_json::from_value(r)?;
        roce_trace::collector::render(&r)
    } else {
        let mut out = String::new();
        for c in collectors {
            out.push_str(&interrupt_and_wait(c, "roce-trace collect")?);
        }
        out
    };

    say(if nats {
        "what the group of collectors found (path: node/port, < in, > out)"
    } else {
        "what the collector found (path: node/port, < in, > out)"
    });
    print!("{view}");
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&report)?)?;

    say("roce-trace verify: the same window judged against the lab's policy (dist/fabric-policy.toml)");
    let verdict = dir.join("verdict.json");
    let out = std::process::Command::new(&bin)
        .args(["verify", "--policy", "dist/fabric-policy.toml", "--report"])
        .arg(&report)
        .arg("--json")
        .arg(&verdict)
        .output()?;
    print!("{}", String::from_utf8_lossy(&out.stdout));
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&verdict)?)?;
    if std::env::var_os("ROCE_TRACE_KEEP").is_some_and(|v| v == "1") {
        println!("(report and verdict kept in {})", dir.display());
    } else {
        let _ = std::fs::remove_dir_all(&dir);
    }
    let verify_failed: std::collections::BTreeSet<&str> = v["checks"]
        .as_array()
        .map(|c| {
            c.iter()
                .filter(|c| c["status"] == "fail")
                .filter_map(|c| c["check"].as_str())
                .collect()
        })
        .unwrap_or_default();

    println!(
        "\nper QP: the spine the leaf's FIB picks, where roce-trace saw the class change, CE onset, CNPs per CE mark"
    );
    println!(
        "{:<10} {:>6} {:>6}  {:<36} {:<32} {:>8}  verdict",
        "FLOW", "SPORT", "SPINE", "CLASS CHANGE", "CE MARKS BEGIN", "CNP/CE"
    );
    let mut failures = continuous;
    // The two faults break exactly the class rules and the idle-fabric CE budget.
    let want: std::collections::BTreeSet<&str> = ["data_class", "no_class_change", "ce_fraction"].into();
    if out.status.code() != Some(1) || verify_failed != want {
        failures.push(format!(
            "verify failed {verify_failed:?} (exit {:?}), expected {want:?}",
            out.status.code()
        ));
    }
    let mut rewrites_seen = 0;
    for (src, dst) in [(1u8, 3u8), (2, 4)] {
        for i in 0..QPS as u16 {
            let sport = 49152 + i;
            let spine = lab.spine_for(src, dst, sport, false)?;
            let f = r["flows"].as_array().and_then(|v| {
                v.iter().find(|f| {
                    f["src_ip"] == Lab::host_ip(src, false).to_string()
                        && f["dst_ip"] == Lab::host_ip(dst, false).to_string()
                        && f["udp_sport"] == sport
                })
            });
            let Some(f) = f else {
                failures.push(format!("h{src}->h{dst} sport {sport}: not seen by the collector"));
                continue;
            };
            let change = f["class_changes"].as_array().and_then(|c| c.first()).map(|c| {
                format!(
                    "{}->{} {} .. {}",
                    c["from_dscp"],
                    c["to_dscp"],
                    c["between"][0].as_str().unwrap_or(""),
                    c["between"][1].as_str().unwrap_or("")
                )
            });
            let ce = f["ce_onset"]
                .as_array()
                .and_then(|c| c.first())
                .map(|c| c["at"].as_str().unwrap_or("").to_owned());
            let per = f["answered_by"]["cnps_per_ce_mark"].as_f64();
            let ok_class = match (spine, &change) {
                (1, Some(c)) => c.contains("s1:l1:ingress .. s1:l2:egress") && c.starts_with("26->0"),
                (2, None) => true,
                _ => false,
            };
            let ok_ce = dst != 4 || (ce.as_deref() == Some("l2:h4:egress") && per.is_some_and(|p| p > 0.0));
            if spine == 1 && ok_class {
                rewrites_seen += 1;
            }
            let verdict = match (ok_class, ok_ce) {
                (true, true) if spine == 1 => "rewrite located at s1",
                (true, true) => "class kept",
                _ => "UNEXPECTED",
            };
            if !ok_class || !ok_ce {
                failures.push(format!(
                    "h{src}->h{dst} sport {sport} via s{spine}: change {change:?}, CE {ce:?}, CNP/CE {per:?}"
                ));
            }
            println!(
                "h{src}->h{dst} {sport:>8} {:>6}  {:<36} {:<32} {:>8}  {verdict}",
                format!("s{spine}"),
                change.unwrap_or_else(|| "-".into()),
                ce.unwrap_or_else(|| "-".into()),
                per.map(|p| format!("{p:.2}")).unwrap_or_else(|| "-".into()),
            );
        }
    }
    if keep {
        say(&format!(
            "kept up: the lab, the agents and the collector; the map at http://{web}/ — Ctrl-C tears it all down"
        ));
        wait_for_interrupt();
        for c in kept {
            let _ = interrupt_and_wait(c, "roce-trace");
        }
        if let Some(mut n) = nats_server.take() {
            let _ = n.kill();
            let _ = n.wait();
        }
    }
    drop(run);
    println!("demo took {:.0}s", started.elapsed().as_secs_f64());
    ensure!(
        rewrites_seen > 0,
        "no flow went through s1 (change --seconds or the seed)"
    );
    if failures.is_empty() {
        say(&format!(
            "roce-trace saw the faults: the rewrite located at s1 on the {rewrites_seen} flows through it, flows through s2 intact, CE marks from l2's port to h4 and the CNPs that answered them; verify failed exactly the class and CE rules"
        ));
        Ok(())
    } else {
        bail!("roce-trace missed injected faults:\n  {}", failures.join("\n  "))
    }
}
