//! A self-contained demo on two hosts (network namespaces) joined by a veth link: RoCEv2
//! traffic on three QPs, two faults injected in host A's egress path with iptables (a
//! DSCP rewrite on one QP, CE marking on another), and roce-trace capture on host B
//! showing both. Exits non-zero when roce-trace did not see the faults.

use std::{
    io::{BufRead, BufReader},
    net::UdpSocket,
    os::fd::AsRawFd,
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail, ensure};
use roce_trace::frame::RoceFrame;
use roce_trace_common::roce::op;
use roce_trace_tests::VethPair;
use serde_json::Value;

const HEALTHY: u16 = 49152;
const REWRITTEN: u16 = 49153;
const CONGESTED: u16 = 49154;

fn say(s: &str) {
    println!("\x1b[1m== {s}\x1b[0m");
}

pub fn run(seconds: u64) -> anyhow::Result<()> {
    let bin = Path::new("target/release/roce-trace");
    ensure!(
        bin.exists(),
        "{} missing: run `cargo build --release --bins` first (scripts/demo does)",
        bin.display()
    );
    let bin = bin.canonicalize()?;

    say("two hosts: A (10.99.0.1) and B (10.99.0.2), network namespaces joined by a veth link");
    let pair = VethPair::new("demo");
    say(&format!(
        "injecting faults on A's egress: UDP sport {REWRITTEN} remarked DSCP 26 -> 0; 20% of sport {CONGESTED} CE-marked"
    ));
    pair.a.exec(&[
        "iptables",
        "-t",
        "mangle",
        "-A",
        "POSTROUTING",
        "-p",
        "udp",
        "--dport",
        "4791",
        "--sport",
        &REWRITTEN.to_string(),
        "-j",
        "DSCP",
        "--set-dscp",
        "0",
    ]);
    pair.a.exec(&[
        "iptables",
        "-t",
        "mangle",
        "-A",
        "POSTROUTING",
        "-p",
        "udp",
        "--dport",
        "4791",
        "--sport",
        &CONGESTED.to_string(),
        "-m",
        "statistic",
        "--mode",
        "random",
        "--probability",
        "0.2",
        "-j",
        "ECN",
        "--ecn-ip-ect",
        "3",
    ]);

    let out = std::env::temp_dir().join(format!("roce-trace-demo-{}.jsonl", std::process::id()));
    say(&format!(
        "starting roce-trace capture on B (XDP ingress), JSON to {}",
        out.display()
    ));
    let mut cap = Command::new("ip")
        .args(["netns", "exec", &pair.b.name])
        .arg(&bin)
        .args([
            "capture",
            "-i",
            &pair.b_if,
            "--direction",
            "ingress",
            "--expect-dscp",
            "26,48",
        ])
        .args(["--duration", &format!("{}s", seconds + 2), "-w"])
        .arg(&out)
        .stderr(Stdio::piped())
        .spawn()
        .context("starting roce-trace")?;
    let mut err = BufReader::new(cap.stderr.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        if err.read_line(&mut line)? == 0 {
            bail!("roce-trace exited before attaching");
        }
        eprint!("{line}");
        if line.contains("capturing on") {
            break;
        }
    }
    std::thread::spawn(move || {
        for l in err.lines().map_while(Result::ok) {
            eprintln!("{l}");
        }
    });

    say(&format!(
        "A sends RDMA WRITEs on 3 QPs for {seconds}s (DSCP 26, ECT(0), 1 KiB, ~2000 packets/s each)"
    ));
    let sent = pair.a.run(move || send(seconds));
    let sent = sent?;
    let status = cap.wait()?;
    ensure!(status.success(), "roce-trace capture failed ({status})");

    say("what roce-trace saw");
    let text = std::fs::read_to_string(&out)?;
    let _ = std::fs::remove_file(&out);
    let recs: Vec<Value> = text.lines().map(serde_json::from_str).collect::<Result<_, _>>()?;
    let flow = |sport: u16| {
        recs.iter()
            .find(|r| r["type"] == "flow" && r["final"] == true && r["udp_sport"] == sport)
            .cloned()
    };
    let mut failures = Vec::new();
    for (sport, what) in [
        (HEALTHY, "healthy"),
        (REWRITTEN, "DSCP rewrite"),
        (CONGESTED, "CE marking"),
    ] {
        let Some(f) = flow(sport) else {
            failures.push(format!("no flow seen for sport {sport}"));
            continue;
        };
        let packets = f["packets"].as_u64().unwrap_or(0);
        let dscp = f["dscp"].as_u64().unwrap_or(99);
        let ce = f["ecn"]["ce"].as_u64().unwrap_or(0);
        println!(
            "  QP flow sport {sport} ({what}): {packets} of {sent} packets, DSCP {dscp}, CE {ce} ({:.1}%)",
            100.0 * ce as f64 / packets.max(1) as f64
        );
        match sport {
            HEALTHY if dscp != 26 || ce != 0 => failures.push(format!("healthy flow looks faulty: {f}")),
            REWRITTEN if dscp != 0 => failures.push("the DSCP rewrite was not seen".into()),
            CONGESTED if ce == 0 => failures.push("no CE marks seen".into()),
            _ => {}
        }
    }
    let unexpected = recs
        .iter()
        .filter(|r| {
            r["type"] == "sample"
                && r["reasons"]
                    .as_array()
                    .is_some_and(|a| a.iter().any(|x| x == "unexpected_dscp"))
        })
        .count();
    println!(
        "  samples flagged with an unexpected DSCP (always reported, whatever the sampling rate): {unexpected}"
    );
    if unexpected == 0 {
        failures.push("no sample flagged the rewritten class".into());
    }
    if failures.is_empty() {
        say("roce-trace saw both injected faults");
        Ok(())
    } else {
        bail!("roce-trace missed injected faults: {}", failures.join("; "))
    }
}

/// Sends RC WRITE MIDDLE packets from three UDP sockets (kernel-built IP/UDP, so netfilter
/// applies the faults). Returns the packets sent per QP.
fn send(seconds: u64) -> anyhow::Result<u64> {
    let socks: Vec<(UdpSocket, u32)> = [HEALTHY, REWRITTEN, CONGESTED]
        .iter()
        .enumerate()
        .map(|(i, &sport)| {
            let s = UdpSocket::bind(("10.99.0.1", sport))?;
            let tos: libc::c_int = (26 << 2) | 0b10;
            // SAFETY: setsockopt with a valid int option on an open socket.
            let r = unsafe {
                libc::setsockopt(
                    s.as_raw_fd(),
                    libc::IPPROTO_IP,
                    libc::IP_TOS,
                    &tos as *const _ as *const libc::c_void,
                    std::mem::size_of::<libc::c_int>() as u32,
                )
            };
            ensure!(r == 0, "IP_TOS: {}", std::io::Error::last_os_error());
            Ok((s, 0x100 + i as u32))
        })
        .collect::<anyhow::Result<_>>()?;
    let start = Instant::now();
    let mut psn = 0u32;
    while start.elapsed() < Duration::from_secs(seconds) {
        for (s, qp) in &socks {
            let f = RoceFrame {
                opcode: op::WRITE_MIDDLE,
                dest_qp: *qp,
                psn,
                payload: vec![0; 1024],
                ..Default::default()
            };
            s.send_to(&f.udp_payload(), ("10.99.0.2", 4791))?;
        }
        psn += 1;
        // ~2000 packets/s per QP.
        let next = Duration::from_micros(500) * psn;
        if let Some(wait) = next.checked_sub(start.elapsed()) {
            std::thread::sleep(wait);
        }
    }
    Ok(psn as u64)
}
