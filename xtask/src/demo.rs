//! The README's first command: the virtual leaf-spine fabric, RoCEv2 traffic between host
//! pairs, roce-trace capture on every host, a fault injected mid-run, and what roce-trace
//! saw. Exits non-zero when roce-trace did not see the injected faults.

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail, ensure};
use roce_trace::{capture::render_flows, record::FlowRecord};
use roce_trace_tests::lab::{Fault, Lab};
use serde_json::Value;

fn say(s: &str) {
    println!("\x1b[1m== {s}\x1b[0m");
}

const QPS: u32 = 8;

struct Run {
    lab: Lab,
    children: Vec<Child>,
}

impl Drop for Run {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        say("tearing the lab down");
        if let Err(e) = self.lab.down() {
            eprintln!("lab down: {e:#}");
        }
    }
}

fn spawn(lab: &Lab, node: &str, bin: &Path, args: &[&str], wait_for: Option<&str>) -> anyhow::Result<Child> {
    let mut c = Command::new("ip")
        .args(["netns", "exec", &lab.ns(node)])
        .arg(bin)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting roce-trace in {node}"))?;
    let mut err = BufReader::new(c.stderr.take().unwrap());
    if let Some(w) = wait_for {
        let mut line = String::new();
        loop {
            line.clear();
            if err.read_line(&mut line)? == 0 {
                bail!("roce-trace in {node} exited before `{w}`");
            }
            if line.contains("WARN") || line.contains("error") {
                eprint!("  [{node}] {line}");
            }
            if line.contains(w) {
                break;
            }
        }
    }
    let node = node.to_owned();
    std::thread::spawn(move || {
        for l in err.lines().map_while(Result::ok) {
            if l.contains("WARN") || l.contains("error") {
                eprintln!("  [{node}] {l}");
            }
        }
    });
    Ok(c)
}

fn finish(c: Child, what: &str) -> anyhow::Result<String> {
    let out = c.wait_with_output()?;
    ensure!(out.status.success(), "{what} failed ({})", out.status);
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub fn run(seconds: u64) -> anyhow::Result<()> {
    let bin = Path::new("target/release/roce-trace");
    ensure!(
        bin.exists(),
        "{} missing: run `cargo build --release --bins` first (scripts/demo does)",
        bin.display()
    );
    let bin = bin.canonicalize()?;
    let started = Instant::now();
    let lab = Lab::default();
    let mut run = Run {
        lab: lab.clone(),
        children: Vec::new(),
    };

    say(
        "building the virtual fabric: 2 spines, 2 leaves, 4 hosts (Linux namespaces), ECMP on the UDP source port",
    );
    lab.down()?;
    lab.up()?;
    print!("{}", lab.status()?);

    let dir = std::env::temp_dir().join(format!("roce-trace-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let json = |h: u8| -> PathBuf { dir.join(format!("h{h}.jsonl")) };
    let total = seconds + 3;
    say(&format!(
        "roce-trace capture on every host (XDP ingress + TC egress on eth0) for {total}s"
    ));
    for h in [1u8, 2, 3, 4] {
        let file = json(h);
        let dur = format!("{total}s");
        let args = [
            "capture",
            "-i",
            "eth0",
            "--json",
            "--expect-dscp",
            "26,48",
            "--sample-rate",
            "100",
            "--duration",
            &dur,
            "-w",
        ];
        let mut a: Vec<&str> = args.to_vec();
        let f = file.to_string_lossy().into_owned();
        a.push(&f);
        run.children
            .push(spawn(&lab, &format!("h{h}"), &bin, &a, Some("capturing on"))?);
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
            Some("answering"),
        )?);
    }
    say(&format!(
        "traffic for {seconds}s: h1 -> h3 and h2 -> h4, {QPS} QPs each (RDMA WRITE 64 KiB, MTU 1024, DSCP 26, ECT(0), 20 Mbit/s per QP, DCQCN)"
    ));
    let mut senders = Vec::new();
    for (src, dst) in [(1u8, 3u8), (2, 4)] {
        let ip = Lab::host_ip(dst, false).to_string();
        let dur = format!("{seconds}s");
        let q = QPS.to_string();
        senders.push((
            src,
            spawn(
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
                    "20mbit",
                    "--duration",
                    &dur,
                    "--json",
                ],
                Some("answering"),
            )?,
        ));
    }
    std::thread::sleep(Duration::from_secs(seconds / 2));
    let rewrite = Fault::DscpRewrite {
        spine: 1,
        from: 26,
        to: 0,
    };
    let congestion = Fault::CeMark {
        node: "l2".into(),
        iface: "h4".into(),
        percent: 5,
    };
    say("fault injected: spine s1 remarks DSCP 26 -> 0; leaf l2 CE-marks 5% of what it sends to h4");
    lab.apply(&rewrite)?;
    lab.apply(&congestion)?;

    let mut sent: BTreeMap<(u8, u16), Value> = BTreeMap::new();
    for (src, c) in senders {
        let r: Value = serde_json::from_str(&finish(c, "gen")?)?;
        for q in r["senders"].as_array().cloned().unwrap_or_default() {
            sent.insert((src, q["udp_sport"].as_u64().unwrap_or(0) as u16), q);
        }
    }
    for c in responders {
        finish(c, "gen responder")?;
    }
    for c in run.children.drain(..) {
        finish(c, "roce-trace capture")?;
    }

    say("what roce-trace saw");
    let flows = |h: u8| -> anyhow::Result<Vec<FlowRecord>> {
        let text = std::fs::read_to_string(json(h))?;
        let mut v = Vec::new();
        for line in text.lines() {
            let r: Value = serde_json::from_str(line)?;
            if r["type"] == "flow" && r["final"] == true {
                v.push(serde_json::from_value(r)?);
            }
        }
        Ok(v)
    };
    for h in [3u8, 2] {
        println!("h{h} (final flow counters):");
        print!("{}", render_flows(&flows(h)?));
    }

    println!(
        "\nper QP: class sent (h1/h2 egress) vs class received (h3/h4 ingress), hops from TTL, spine from the leaf's FIB"
    );
    println!(
        "{:<10} {:>6} {:>6} {:>9} {:>9} {:>5} {:>8} {:>6} {:>6}  verdict",
        "FLOW", "SPORT", "SPINE", "DSCP OUT", "DSCP IN", "HOPS", "CHANGED", "CE", "CNP"
    );
    let mut failures = Vec::new();
    let mut rewrites_seen = 0;
    for (src, dst) in [(1u8, 3u8), (2, 4)] {
        let out = flows(src)?;
        let inn = flows(dst)?;
        for i in 0..QPS as u16 {
            let sport = 49152 + i;
            let spine = lab.spine_for(src, dst, sport, false)?;
            let tx = out
                .iter()
                .find(|f| f.direction == "egress" && f.udp_sport == sport && f.dst_qp != 0);
            let rx = inn
                .iter()
                .find(|f| f.direction == "ingress" && f.udp_sport == sport);
            let cnp: u64 = out
                .iter()
                .filter(|f| f.direction == "ingress" && tx.is_some_and(|t| f.dst_qp == t.dst_qp - 1))
                .map(|f| f.cnp)
                .sum();
            let (Some(tx), Some(rx)) = (tx, rx) else {
                failures.push(format!("h{src}->h{dst} sport {sport}: not seen on both ends"));
                continue;
            };
            let hops = tx.ttl.saturating_sub(rx.ttl);
            let changed = rx.dscp_changed > 0;
            let verdict = match (spine, changed, rx.dscp) {
                (1, true, 0) => {
                    rewrites_seen += 1;
                    "class rewritten on the way (through s1)".to_owned()
                }
                (2, false, 26) => "class kept".to_owned(),
                _ => {
                    failures.push(format!(
                        "h{src}->h{dst} sport {sport} via s{spine}: DSCP {} changed={changed}",
                        rx.dscp
                    ));
                    "UNEXPECTED".to_owned()
                }
            };
            println!(
                "h{src}->h{dst} {sport:>8} {:>6} {:>9} {:>9} {hops:>5} {:>8} {:>6} {cnp:>6}  {verdict}",
                format!("s{spine}"),
                tx.dscp,
                rx.dscp,
                rx.dscp_changed,
                rx.ecn.ce
            );
            if dst == 4 && rx.ecn.ce == 0 {
                failures.push(format!(
                    "h{src}->h{dst} sport {sport}: no CE marks seen behind the marking leaf"
                ));
            }
            if dst == 4 && cnp == 0 {
                failures.push(format!("h{src}->h{dst} sport {sport}: no CNP seen coming back"));
            }
            if let Some(q) = sent.get(&(src, sport))
                && q["packets"].as_u64().unwrap_or(0) != tx.packets
            {
                failures.push(format!(
                    "sport {sport}: gen sent {} packets, capture counted {}",
                    q["packets"], tx.packets
                ));
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    drop(run);
    println!("demo took {:.0}s", started.elapsed().as_secs_f64());
    ensure!(
        rewrites_seen > 0,
        "no flow went through s1 (change --seconds or the seed)"
    );
    if failures.is_empty() {
        say(&format!(
            "roce-trace saw the faults: {rewrites_seen} flows through s1 rewritten, flows through s2 intact, CE marks and CNPs on h2 -> h4"
        ));
        Ok(())
    } else {
        bail!("roce-trace missed injected faults:\n  {}", failures.join("\n  "))
    }
}
