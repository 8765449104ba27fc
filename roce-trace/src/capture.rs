//! `roce-trace capture`: attach to interfaces, stream samples and flow snapshots, show a
//! live view, summarise at the end.

use std::{
    collections::{BTreeMap, HashMap},
    fs::File,
    future::Future,
    io::{BufWriter, IsTerminal, Write},
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use aya::maps::{MapData, RingBuf};
use roce_trace_common::datapath::*;
use tokio::io::unix::AsyncFd;

use crate::{
    datapath::{Attachment, Datapath, DatapathOptions, GlobalTotals, IngressHook},
    observation::{MirrorSession, MirrorTable},
    record::{FlowRecord, HookRecord, SampleRecord, SummaryRecord},
    sys::KernelClock,
    timer::Periodic,
};

#[derive(Clone, Debug)]
pub struct CaptureOptions {
    pub ifaces: Vec<String>,
    /// The hook that observes arriving packets; None: ingress is not observed.
    pub ingress: Option<IngressHook>,
    pub egress: bool,
    pub duration: Option<Duration>,
    /// Stop once this many RoCEv2 packets were counted (both directions, all interfaces).
    pub count: Option<u64>,
    pub datapath: DatapathOptions,
    /// JSON Lines on stdout instead of the live view.
    pub json_stdout: bool,
    /// Files to write as well: pcapng of the sampled packets for `*.pcapng`, JSON Lines
    /// otherwise.
    pub write: Vec<PathBuf>,
    pub interval: Duration,
    /// Where the NIC and PFC counters of the interfaces are read (None: not read).
    pub nic: Option<crate::nic::Root>,
}

/// Where JSON Lines go.
pub(crate) struct JsonSink {
    pub(crate) outs: Vec<Box<dyn Write + Send>>,
}

impl JsonSink {
    pub(crate) fn emit<T: serde::Serialize>(&mut self, rec: &T) -> anyhow::Result<()> {
        if self.outs.is_empty() {
            return Ok(());
        }
        let mut line = serde_json::to_vec(rec)?;
        line.push(b'\n');
        for o in &mut self.outs {
            o.write_all(&line).context("writing JSON output")?;
        }
        Ok(())
    }
    pub(crate) fn flush(&mut self) -> anyhow::Result<()> {
        for o in &mut self.outs {
            o.flush().context("flushing JSON output")?;
        }
        Ok(())
    }
}

type PcapOut = crate::pcap::PcapNgOut<BufWriter<File>>;

/// The outputs a capture writes: JSON Lines (stdout and files) and pcapng files.
pub(crate) struct Outputs {
    pub(crate) json: JsonSink,
    pcaps: Vec<PcapOut>,
    /// This host's name, the node of its points in pcapng.
    node: String,
    /// ICRC errors per flow among samples that held their whole packet; a flow is here
    /// once one of its samples could be checked.
    icrc_errors: HashMap<FlowKey, u64>,
    /// Names the mirror ids of flow keys: from the datapath, and from samples (which carry
    /// their session).
    mirrors: MirrorTable,
}

impl Outputs {
    fn open(opts: &CaptureOptions) -> anyhow::Result<Self> {
        let mut json = JsonSink { outs: Vec::new() };
        if opts.json_stdout {
            json.outs.push(Box::new(BufWriter::new(std::io::stdout())));
        }
        let mut pcaps = Vec::new();
        for path in &opts.write {
            let f =
                crate::sys::create_nofollow(path).with_context(|| format!("creating {}", path.display()))?;
            if path.extension().is_some_and(|e| e == "pcapng") {
                pcaps.push(
                    crate::pcap::PcapNgOut::new(BufWriter::new(f))
                        .with_context(|| format!("writing {}", path.display()))?,
                );
            } else {
                json.outs.push(Box::new(BufWriter::new(f)));
            }
        }
        Ok(Self {
            json,
            pcaps,
            node: crate::sys::hostname(),
            icrc_errors: HashMap::new(),
            mirrors: MirrorTable::default(),
        })
    }

    /// One sample seen on `iface`: its JSON record, its packet in pcapng, and its ICRC
    /// checked when it carries the whole packet.
    fn sample(&mut self, s: &Sample, clock: &KernelClock, iface: &str) -> anyhow::Result<()> {
        let rec = SampleRecord::from_sample(s, clock, iface);
        let mirror = self.mirrors.learn_sample(s);
        if let Some(ok) = rec.icrc_ok {
            *self.icrc_errors.entry(s.key).or_default() += (!ok) as u64;
        }
        if !self.pcaps.is_empty() {
            let point = point_name(&self.node, iface, &s.key, mirror.as_ref());
            let head = &s.head[..(s.head_len as usize).min(SAMPLE_HEAD_LEN)];
            let comment = format!(
                "roce-trace {} psn={} reasons={}",
                rec.opcode_name,
                rec.psn,
                rec.reasons.join(",")
            );
            for p in &mut self.pcaps {
                p.write(&point, rec.time_ns, s.frame_len, head, comment.clone())
                    .context("writing pcapng")?;
            }
        }
        self.json.emit(&rec)
    }

    fn flush(&mut self) -> anyhow::Result<()> {
        for p in &mut self.pcaps {
            p.flush().context("flushing pcapng")?;
        }
        self.json.flush()
    }
}

/// The observation point of a packet as named in pcapng: `node/iface/direction`, or for
/// a mirrored copy (`mirror`: its session) `switch/erspan-<session>/mirror` (`gre-<key>` for
/// plain GRE).
pub fn point_name(node: &str, iface: &str, k: &FlowKey, mirror: Option<&MirrorSession>) -> String {
    match mirror {
        Some(m) => format!("{}/{}/mirror", m.node(), m.iface()),
        None => format!("{node}/{iface}/{}", crate::record::direction_name(k.direction)),
    }
}

/// Runs a capture until `shutdown` resolves, the duration passes or the count is reached.
/// `ready` is called once every hook is attached (tests start traffic then).
pub async fn run(
    opts: CaptureOptions,
    shutdown: impl Future<Output = ()>,
    ready: impl FnOnce(&[Attachment]),
) -> anyhow::Result<SummaryRecord> {
    anyhow::ensure!(!opts.ifaces.is_empty(), "no interface given (use -i IFACE)");
    anyhow::ensure!(
        opts.ingress.is_some() || opts.egress,
        "neither ingress nor egress selected"
    );
    anyhow::ensure!(!opts.interval.is_zero(), "--interval must be longer than zero");
    crate::sys::warn_kernel_bypass(&opts.ifaces);
    let mut dp = Datapath::load(&opts.datapath)?;
    let hooks = dp.attach_all(&opts.ifaces, opts.ingress, opts.egress)?;
    // The kernel does not count non-RoCE frames: the summary takes every frame from the
    // interfaces' own counters, read now and at the end.
    let if_before = crate::netstat::read_if_drops();
    let names: HashMap<u32, String> = hooks.iter().map(|h| (h.ifindex, h.iface.clone())).collect();
    let name_of = |idx: u32| names.get(&idx).cloned().unwrap_or_else(|| idx.to_string());

    let mut out = Outputs::open(&opts)?;
    let live = !opts.json_stdout;
    let tty = std::io::stdout().is_terminal();

    let clock = KernelClock::now();
    let ring = dp.take_samples()?;
    // SAFETY: the RingBuf owns its map fd and keeps it open until it is dropped, which only
    // happens when this AsyncFd is dropped.
    let mut ring = unsafe { AsyncFd::register(ring) }
        .map_err(|e| anyhow::anyhow!("polling the sample ring buffer: {e}"))?;
    ready(&hooks);

    let mut nic = opts
        .nic
        .clone()
        .and_then(|root| crate::nic::NicWatch::open(root, &opts.ifaces));
    if let Some(w) = &mut nic {
        nic_tick(w, &HashMap::new(), &HashMap::new(), &mut out)?;
    }
    let started = Instant::now();
    let mut samples_received = 0u64;
    let mut prev: HashMap<FlowKey, FlowCounters> = HashMap::new();
    let mut last_tick = Instant::now();
    // Kernel timers: one wake-up a period (see `Periodic`), the first one period from now.
    let mut tick = Periodic::new(opts.interval).context("the interval timer")?;
    let mut poll = tokio::time::interval(Duration::from_millis(50));
    // Samples below a batch are read on the interval's tick when it comes at least every
    // `SAMPLE_DRAIN_MS` (the default 1 s does): one wake-up a period, not two timers a
    // moment apart. A longer interval gets a drain timer of its own.
    let drain_every = Duration::from_millis(roce_trace_common::datapath::SAMPLE_DRAIN_MS);
    let mut drain_tick = if opts.interval > drain_every {
        Some(Periodic::new(drain_every).context("the drain timer")?)
    } else {
        None
    };
    let deadline = opts.duration.map(|d| tokio::time::Instant::now() + d);
    let sleep_until = async {
        match deadline {
            Some(d) => tokio::time::sleep_until(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(shutdown, sleep_until);

    let stopped_by = loop {
        tokio::select! {
            _ = &mut shutdown => break "signal",
            _ = &mut sleep_until => break "duration",
            guard = ring.readable_mut() => {
                let mut guard = guard.context("waiting for samples")?;
                samples_received +=
                    Datapath::read_ready(&mut guard, |ring| drain(ring, &clock, &name_of, &mut out))?;
            }
            // Samples below a batch, when the interval is longer than the drain period.
            ticked = async { drain_tick.as_mut().expect("checked by the guard").tick().await },
                if drain_tick.is_some() =>
            {
                ticked.context("the drain timer")?;
                samples_received += drain(ring.get_mut(), &clock, &name_of, &mut out)?;
            }
            _ = poll.tick(), if opts.count.is_some() => {
                let g = dp.globals()?;
                if g.total(GlobalCounter::RoceV2) >= opts.count.unwrap_or(u64::MAX) {
                    break "count";
                }
            }
            ticked = tick.tick() => {
                ticked.context("the interval timer")?;
                if drain_tick.is_none() {
                    samples_received += drain(ring.get_mut(), &clock, &name_of, &mut out)?;
                }
                let now = Instant::now();
                let flows = dp.flows()?;
                dp.resolve_mirrors(&mut out.mirrors, flows.keys())?;
                let recs = snapshot(&flows, &prev, now - last_tick, &clock, &name_of, &out, false);
                // Periodic records only for flows that moved since the last snapshot.
                for (k, r) in &recs {
                    if prev.get(k).map(|p| p.counts.packets) != Some(r.packets) {
                        out.json.emit(r)?;
                    }
                }
                let nic_lines = match &mut nic {
                    Some(w) => nic_tick(w, &flows, &prev, &mut out)?,
                    None => Vec::new(),
                };
                out.flush()?;
                if live {
                    let g = dp.globals()?;
                    let recs: Vec<FlowRecord> = recs.into_iter().map(|(_, r)| r).collect();
                    print_live(&recs, &g, samples_received, started.elapsed(), tty, &nic_lines);
                }
                prev = flows;
                last_tick = now;
            }
        }
    };

    // Whatever the kernel queued before we stopped still counts.
    samples_received += drain(ring.get_mut(), &clock, &name_of, &mut out)?;
    let flows = dp.flows()?;
    dp.resolve_mirrors(&mut out.mirrors, flows.keys())?;
    let globals = dp.globals()?;
    let recs: Vec<FlowRecord> = snapshot(
        &flows,
        &prev,
        Instant::now() - last_tick,
        &clock,
        &name_of,
        &out,
        true,
    )
    .into_iter()
    .map(|(_, r)| r)
    .collect();
    for r in &recs {
        out.json.emit(r)?;
    }
    let nic_lines = match &mut nic {
        Some(w) => nic_tick(w, &flows, &prev, &mut out)?,
        None => Vec::new(),
    };
    let if_frames = match (if_before, crate::netstat::read_if_drops()) {
        (Ok(was), Ok(now)) => Some(interface_frames(&hooks, &was, &now)),
        (Err(e), _) | (_, Err(e)) => {
            tracing::warn!("reading /proc/net/dev: {e}; the summary leaves non-RoCE frames out");
            None
        }
    };
    let summary = summarize(
        &hooks,
        &recs,
        &globals,
        if_frames,
        samples_received,
        started.elapsed(),
        stopped_by,
        &clock,
    );
    out.json.emit(&summary)?;
    out.flush()?;
    if live {
        print_live(
            &recs,
            &globals,
            samples_received,
            started.elapsed(),
            false,
            &nic_lines,
        );
        print_summary(&summary);
        if let Some(w) = &nic {
            print_nic_summary(w);
        }
    }
    Ok(summary)
}

fn drain(
    ring: &mut RingBuf<MapData>,
    clock: &KernelClock,
    name_of: &impl Fn(u32) -> String,
    out: &mut Outputs,
) -> anyhow::Result<u64> {
    let mut n = 0;
    while let Some(item) = ring.next() {
        if item.len() < std::mem::size_of::<Sample>() {
            tracing::warn!("short sample of {} bytes ignored", item.len());
            continue;
        }
        // SAFETY: the kernel wrote a whole `Sample` (size checked); read_unaligned copes
        // with the ring's 8-byte alignment guarantees or lack of them.
        let s: Sample = unsafe { std::ptr::read_unaligned(item.as_ptr() as *const Sample) };
        drop(item);
        out.sample(&s, clock, &name_of(s.key.ifindex))?;
        n += 1;
    }
    Ok(n)
}

fn snapshot(
    flows: &HashMap<FlowKey, FlowCounters>,
    prev: &HashMap<FlowKey, FlowCounters>,
    elapsed: Duration,
    clock: &KernelClock,
    name_of: &impl Fn(u32) -> String,
    out: &Outputs,
    is_final: bool,
) -> Vec<(FlowKey, FlowRecord)> {
    let now_ns = clock.to_unix_ns(KernelClock::mono_now_ns());
    let secs = elapsed.as_secs_f64().max(1e-3);
    let mut keys: Vec<&FlowKey> = flows.keys().collect();
    keys.sort();
    keys.into_iter()
        .map(|k| {
            let c = &flows[k];
            let mut r = FlowRecord::new(k, c, clock, &name_of(k.ifindex), now_ns, &out.mirrors);
            let (pp, pb) = prev
                .get(k)
                .map(|p| (p.counts.packets, p.counts.bytes))
                .unwrap_or((0, 0));
            r.pps = c.counts.packets.saturating_sub(pp) as f64 / secs;
            r.gbps = c.counts.bytes.saturating_sub(pb) as f64 * 8.0 / secs / 1e9;
            r.is_final = is_final;
            r.icrc_errors = out.icrc_errors.get(k).copied();
            (*k, r)
        })
        .collect()
}

/// Frames the hooked interfaces counted between two reads of their counters, by
/// direction (`[ingress, egress]`): received on the ingress hooks' interfaces, sent on the
/// egress hooks'.
fn interface_frames(
    hooks: &[Attachment],
    was: &HashMap<String, crate::netstat::IfDrops>,
    now: &HashMap<String, crate::netstat::IfDrops>,
) -> [u64; 2] {
    let mut v = [0u64; 2];
    for h in hooks {
        let (Some(a), Some(b)) = (was.get(&h.iface), now.get(&h.iface)) else {
            continue;
        };
        let (d, n) = if h.direction == DIR_EGRESS {
            (1, b.tx_packets.saturating_sub(a.tx_packets))
        } else {
            (0, b.rx_packets.saturating_sub(a.rx_packets))
        };
        v[d] = v[d].saturating_add(n);
    }
    v
}

/// The summary record. `if_frames`: a live capture's frames by direction from the
/// interfaces' counters (the kernel counts no non-RoCE frame); `frames_seen` is then that
/// and `non_roce` what it holds beyond the frames the datapath counted. `None` (pcap
/// input): both as the parser counted them, exact.
#[expect(clippy::too_many_arguments, reason = "one record from the capture's parts")]
pub(crate) fn summarize(
    hooks: &[Attachment],
    recs: &[FlowRecord],
    g: &GlobalTotals,
    if_frames: Option<[u64; 2]>,
    samples_received: u64,
    elapsed: Duration,
    stopped_by: &str,
    clock: &KernelClock,
) -> SummaryRecord {
    let mut parse_failures = BTreeMap::new();
    let mut counters = BTreeMap::new();
    for (dir, name) in [(DIR_INGRESS, "ingress"), (DIR_EGRESS, "egress")] {
        let mut m = BTreeMap::new();
        for c in GlobalCounter::ALL {
            m.insert(c.name().to_owned(), g.get(c, dir));
        }
        if let Some(f) = if_frames {
            let frames = f[dir as usize];
            let counted = g.get(GlobalCounter::FramesSeen, dir);
            m.insert(GlobalCounter::FramesSeen.name().to_owned(), frames.max(counted));
            m.insert(
                GlobalCounter::NonRoce.name().to_owned(),
                frames.saturating_sub(counted),
            );
        }
        counters.insert(name.to_owned(), m);
    }
    for c in GlobalCounter::ALL.into_iter().filter(|c| c.is_parse_failure()) {
        parse_failures.insert(c.name().to_owned(), g.total(c));
    }
    SummaryRecord {
        kind: "summary".into(),
        time_ns: clock.to_unix_ns(KernelClock::mono_now_ns()),
        duration_s: elapsed.as_secs_f64(),
        stopped_by: stopped_by.into(),
        hooks: hooks
            .iter()
            .map(|h| HookRecord {
                iface: h.iface.clone(),
                hook: h.hook.into(),
                mode: h.mode.into(),
            })
            .collect(),
        flows: recs.len() as u64,
        packets: recs.iter().map(|r| r.packets).sum(),
        bytes: recs.iter().map(|r| r.bytes).sum(),
        samples_received,
        ringbuf_drops: g.total(GlobalCounter::RingbufFull),
        parse_failures,
        counters,
        frames_from: if_frames.map(|_| "interface counters".to_owned()),
    }
}

/// The flow table as a network engineer reads it.
pub fn render_flows(recs: &[FlowRecord]) -> String {
    let mut s = String::new();
    // Address columns as wide as the widest address shown (IPv4 tables stay narrow).
    let w = recs
        .iter()
        .map(|r| r.src_ip.to_string().len().max(r.dst_ip.to_string().len()))
        .max()
        .unwrap_or(3)
        .max(3);
    s.push_str(&format!(
        "{:<10} {:<3} {:>w$} {:>w$} {:>5} {:>8} {:>4} {:>23} {:>6} {:>6} {:>6} {:>5} {:>9} {:>7}\n",
        "IFACE",
        "DIR",
        "SRC",
        "DST",
        "SPORT",
        "QP",
        "DSCP",
        "ECN not/ect1/ect0/ce",
        "CE%",
        "CNP",
        "NAK",
        "GAPS",
        "PPS",
        "GBIT/S"
    ));
    for r in recs {
        let dscp = if r.dscp_changed > 0 {
            format!("{}*", r.dscp)
        } else {
            r.dscp.to_string()
        };
        s.push_str(&format!(
            "{:<10} {:<3} {:>w$} {:>w$} {:>5} {:>#8x} {:>4} {:>23} {:>6.2} {:>6} {:>6} {:>5} {:>9.0} {:>7.3}\n",
            r.iface,
            if r.direction == "ingress" { "in" } else { "out" },
            r.src_ip.to_string(),
            r.dst_ip.to_string(),
            r.udp_sport,
            r.dst_qp,
            dscp,
            format!("{}/{}/{}/{}", r.ecn.not_ect, r.ecn.ect1, r.ecn.ect0, r.ecn.ce),
            r.ce_percent(),
            r.cnp,
            r.nak.psn_seq_err + r.nak.rnr + r.nak.other,
            r.psn_gaps,
            r.pps,
            r.gbps
        ));
    }
    s
}

/// Reads the NIC counters, emits their records (with what the kernel counted on the same
/// interface since the previous refresh: its own flows, not mirrored copies), and returns
/// the lines the live view shows: PFC per active priority, and the NIC's CNP/ECN counters
/// beside the kernel's.
fn nic_tick(
    w: &mut crate::nic::NicWatch,
    flows: &HashMap<FlowKey, FlowCounters>,
    prev: &HashMap<FlowKey, FlowCounters>,
    out: &mut Outputs,
) -> anyhow::Result<Vec<String>> {
    let mut lines = Vec::new();
    for t in w.tick() {
        let mut rec = crate::nic::record(t.port, &t.reading, t.interval.as_ref(), false);
        let Some(iv) = &t.interval else {
            out.json.emit(&rec)?;
            continue;
        };
        lines.extend(crate::nic::pfc_lines(iv));
        let mut k = crate::nic::KernelCounts::default();
        for (key, c) in flows
            .iter()
            .filter(|(key, _)| key.ifindex == t.port.ifindex && key.mirror == 0)
        {
            let p = prev.get(key).map(|p| p.counts).unwrap_or_default();
            let cnp = c.counts.cnp.saturating_sub(p.cnp);
            if key.direction == DIR_EGRESS {
                k.cnp_tx += cnp;
            } else {
                k.cnp_rx += cnp;
                k.ce_rx += c.counts.ecn[3].saturating_sub(p.ecn[3]);
            }
        }
        rec.kernel = Some(k);
        out.json.emit(&rec)?;
        lines.extend(crate::nic::nic_line(iv, Some(k)));
    }
    Ok(lines)
}

/// The NIC counters over the whole capture.
fn print_nic_summary(w: &crate::nic::NicWatch) {
    for iv in w.whole() {
        let mut lines = crate::nic::pfc_lines(&iv);
        lines.extend(crate::nic::nic_line(&iv, None));
        if lines.is_empty() {
            println!(
                "  {}: no PFC pause and no NIC congestion counters moved",
                iv.netdev
            );
        }
        for l in lines {
            println!("  {l} (whole capture)");
        }
    }
}

fn print_live(
    recs: &[FlowRecord],
    g: &GlobalTotals,
    samples: u64,
    elapsed: Duration,
    clear: bool,
    nic_lines: &[String],
) {
    let mut out = String::new();
    if clear {
        out.push_str("\x1b[H\x1b[2J");
    }
    out.push_str(&format!(
        "roce-trace capture — {:.0}s, {} flows, {} RoCEv2 frames, {} samples, {} ring drops, {} parse failures{}\n",
        elapsed.as_secs_f64(),
        recs.len(),
        g.total(GlobalCounter::RoceV2),
        samples,
        g.total(GlobalCounter::RingbufFull),
        GlobalCounter::ALL.iter().filter(|c| c.is_parse_failure()).map(|&c| g.total(c)).sum::<u64>(),
        if clear { "   (Ctrl-C to stop; * = DSCP changed within the flow)" } else { "" },
    ));
    out.push_str(&render_flows(recs));
    for l in nic_lines {
        out.push_str(l);
        out.push('\n');
    }
    let mut stdout = std::io::stdout().lock();
    let _ = stdout.write_all(out.as_bytes());
    let _ = stdout.flush();
}

pub(crate) fn print_summary(s: &SummaryRecord) {
    let mut out = format!(
        "\nsummary: stopped by {} after {:.1}s — {} flows, {} packets, {} bytes; {} samples received, {} lost to a full ring buffer\n",
        s.stopped_by, s.duration_s, s.flows, s.packets, s.bytes, s.samples_received, s.ringbuf_drops
    );
    for h in &s.hooks {
        out.push_str(&format!("  hook: {} {} ({})\n", h.iface, h.hook, h.mode));
    }
    let failures: Vec<String> = s
        .parse_failures
        .iter()
        .filter(|(_, v)| **v > 0)
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    out.push_str(&format!(
        "  parse failures: {}\n",
        if failures.is_empty() {
            "none".to_owned()
        } else {
            failures.join(", ")
        }
    ));
    for (dir, m) in &s.counters {
        out.push_str(&format!(
            "  {dir}: frames {} rocev2 {} rocev1 {} non-roce {}\n",
            m[GlobalCounter::FramesSeen.name()],
            m[GlobalCounter::RoceV2.name()],
            m[GlobalCounter::RoceV1.name()],
            m[GlobalCounter::NonRoce.name()]
        ));
    }
    if let Some(from) = &s.frames_from {
        out.push_str(&format!(
            "  (frames and non-roce from the {from}: the datapath counts no non-RoCE frame)\n"
        ));
    }
    print!("{out}");
}

/// `capture -r FILE`: the same records from a pcap/pcapng file (`-`: stdin).
/// A flow's final record from a capture: its counters, rates over its own span and ICRC
/// errors.
fn final_record(
    k: &FlowKey,
    c: &FlowCounters,
    icrc_errors: u64,
    clock: &KernelClock,
    iface: &str,
    now: u64,
    mirrors: &MirrorTable,
) -> FlowRecord {
    let mut r = FlowRecord::new(k, c, clock, iface, now, mirrors);
    r.is_final = true;
    let secs = (c.last_ns.saturating_sub(c.first_ns)) as f64 / 1e9;
    if secs > 0.0 {
        r.pps = c.counts.packets as f64 / secs;
        r.gbps = c.counts.bytes as f64 * 8.0 / secs / 1e9;
    }
    r.icrc_errors = Some(icrc_errors);
    r
}

pub fn run_offline(opts: &CaptureOptions, path: &std::path::Path) -> anyhow::Result<SummaryRecord> {
    let started = Instant::now();
    let input = crate::pcap::open(path)?;
    let mut out = Outputs::open(opts)?;
    let iface = format!("pcap:{}", path.display());
    let clock = KernelClock::UNIX;
    let mut samples = 0u64;
    let mut write_error = None;
    let mut off = crate::pcap::Offline::new(&opts.datapath)?;
    // An endless stream (`tcpdump … | roce-trace capture -r -`) holds a bounded table:
    // every 4,096 frames, flows idle for 2 minutes of capture time, and the least recently
    // seen past --max-flows, get their final record then and are forgotten.
    let max_flows = (opts.datapath.max_flows as usize).max(64);
    let mut expired = (0u64, 0u64, 0u64, 0u64); // flows, packets, bytes, ICRC errors
    crate::pcap::read_frames(input, |fr| {
        let now_ns = fr.time_ns;
        off.frame(&fr, |s| {
            samples += 1;
            if let Err(e) = out.sample(s, &clock, &iface)
                && write_error.is_none()
            {
                write_error = Some(e);
            }
        });
        if off.frames % 4096 == 0 || off.flows.len() > max_flows {
            let keep = if off.flows.len() > max_flows {
                max_flows - max_flows / 64
            } else {
                max_flows
            };
            for (k, c, icrc) in off.expire(now_ns, crate::agent::OFFLINE_FLOW_IDLE_NS, keep) {
                let r = final_record(
                    &k,
                    &c,
                    icrc,
                    &clock,
                    &iface,
                    clock.to_unix_ns(now_ns),
                    &off.mirrors,
                );
                expired.0 += 1;
                expired.1 = expired.1.saturating_add(r.packets);
                expired.2 = expired.2.saturating_add(r.bytes);
                expired.3 = expired.3.saturating_add(icrc);
                if let Err(e) = out.json.emit(&r)
                    && write_error.is_none()
                {
                    write_error = Some(e);
                }
            }
        }
    })
    .with_context(|| format!("reading {}", path.display()))?;
    if let Some(e) = write_error {
        return Err(e);
    }
    let mut keys: Vec<&FlowKey> = off.flows.keys().collect();
    keys.sort();
    let now = clock.to_unix_ns(off.flows.values().map(|(_, c)| c.last_ns).max().unwrap_or(0));
    let recs: Vec<FlowRecord> = keys
        .into_iter()
        .map(|k| {
            let icrc = off.icrc_errors.get(k).copied().unwrap_or(0);
            final_record(k, &off.flows[k].1, icrc, &clock, &iface, now, &off.mirrors)
        })
        .collect();
    for r in &recs {
        out.json.emit(r)?;
    }
    let hooks = [Attachment {
        iface: iface.clone(),
        ifindex: 0,
        hook: "pcap",
        direction: DIR_INGRESS,
        mode: "offline",
        warning: None,
    }];
    let mut summary = summarize(
        &hooks,
        &recs,
        &off.globals,
        None,
        samples,
        started.elapsed(),
        "end of input",
        &clock,
    );
    // Flows whose final record went out earlier count too.
    summary.flows += expired.0;
    summary.packets = summary.packets.saturating_add(expired.1);
    summary.bytes = summary.bytes.saturating_add(expired.2);
    out.json.emit(&summary)?;
    out.flush()?;
    if !opts.json_stdout {
        print_live(&recs, &off.globals, samples, started.elapsed(), false, &[]);
        let bad: u64 = recs.iter().filter_map(|r| r.icrc_errors).sum::<u64>() + expired.3;
        println!(
            "{} frames read; {} RoCEv2 packets with a wrong ICRC",
            off.frames, bad
        );
        print_summary(&summary);
    }
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{EcnCounts, NakCounts};

    fn rec(src: &str, dst: &str) -> FlowRecord {
        FlowRecord {
            kind: "flow".into(),
            is_final: true,
            time_ns: 0,
            iface: "eth0".into(),
            ifindex: 2,
            direction: "ingress".into(),
            ip_version: 4,
            src_ip: src.parse().unwrap(),
            dst_ip: dst.parse().unwrap(),
            udp_sport: 49152,
            dst_qp: 0x101,
            packets: 200,
            bytes: 200_000,
            dscp: 26,
            dscp_changed: 3,
            pcp: None,
            ttl: 61,
            ecn: EcnCounts {
                not_ect: 0,
                ect1: 0,
                ect0: 150,
                ce: 50,
            },
            cnp: 4,
            ack: 0,
            nak: NakCounts {
                psn_seq_err: 1,
                rnr: 1,
                other: 0,
            },
            psn_gaps: 2,
            first_seen_ns: 0,
            last_seen_ns: 0,
            pps: 1000.0,
            gbps: 0.008,
            icrc_errors: None,
            mirror: None,
        }
    }

    #[test]
    fn the_flow_table_lines_up_and_shows_what_matters() {
        let t = render_flows(&[rec("10.0.0.1", "10.0.0.2"), rec("fd00::1", "fd00:10:3::2")]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3);
        // Every line is as long as the header: the columns line up.
        assert!(lines.iter().all(|l| l.len() == lines[0].len()), "{t}");
        assert!(
            lines[1].contains("26*"),
            "a DSCP that changed within the flow is starred"
        );
        assert!(
            lines[1].contains("0/0/150/50") && lines[1].contains("25.00"),
            "{t}"
        );
        // IPv4-only tables stay narrow.
        let narrow = render_flows(&[rec("10.0.0.1", "10.0.0.2")]);
        assert!(narrow.lines().next().unwrap().len() < lines[0].len());
    }
}
