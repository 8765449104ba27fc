//! Benchmarks: `cargo xtask bench [datapath|gen|capture]` (all by default). The figures
//! are recorded in BENCHMARKS.md.

use std::{
    io::{BufRead, BufReader},
    os::fd::{AsFd as _, AsRawFd as _},
    path::Path,
    process::{Child, Command, Stdio},
    time::Duration,
};

use anyhow::{Context as _, bail, ensure};
use roce_trace_common::{datapath::PROGRAMS, roce::op};
use roce_trace_datapath::loader::DatapathOptions;
use roce_trace_gen::frame::{RoceFrame, ethernet, ext};
use roce_trace_lab::Lab;
use roce_trace_tests::{ProgTest, VethPair};
use serde_json::Value;

/// The heap bytes this process has allocated and not freed: the benchmarks' exact
/// measure of what state costs (the resident set also holds what the allocator keeps
/// after a peak, such as the identities waiting for their trajectories).
struct Counting;

static LIVE: std::sync::atomic::AtomicIsize = std::sync::atomic::AtomicIsize::new(0);

// SAFETY: every call is passed on to the system allocator unchanged; only a counter is
// kept beside it.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: the caller's contract is the system allocator's.
        unsafe { std::alloc::System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        LIVE.fetch_sub(l.size() as isize, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { std::alloc::System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: std::alloc::Layout, new: usize) -> *mut u8 {
        LIVE.fetch_add(
            new as isize - l.size() as isize,
            std::sync::atomic::Ordering::Relaxed,
        );
        // SAFETY: as above.
        unsafe { std::alloc::System.realloc(p, l, new) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn live_bytes() -> i64 {
    LIVE.load(std::sync::atomic::Ordering::Relaxed) as i64
}

pub fn run(
    which: &str,
    repeat: u32,
    baseline: Option<&Path>,
    baseline_bin: Option<&Path>,
    cold: Cold,
) -> anyhow::Result<()> {
    let bin = Path::new("target/release/roce-trace");
    match which {
        "datapath" => datapath(repeat, baseline, cold),
        "gen" => generator(bin),
        "capture" => capture(bin, baseline_bin),
        "collector" => collector(),
        // Parts of `collector`, alone, for working on one of them.
        "collector-reader" => {
            ensure!(
                !cfg!(debug_assertions),
                "build it optimised: cargo run --release -p xtask -- bench collector-reader"
            );
            join_with_reader(20_000)
        }
        "collector-views" => {
            ensure!(
                !cfg!(debug_assertions),
                "build it optimised: cargo run --release -p xtask -- bench collector-views"
            );
            println!(
                "== the collector over TCP and HTTP: two agents, 4 sampled packets per flow, views best of 3"
            );
            [10_000, 100_000, 1_000_000]
                .into_iter()
                .try_for_each(collector_views)
        }
        "collector-verify" => {
            ensure!(
                !cfg!(debug_assertions),
                "build it optimised: cargo run --release -p xtask -- bench collector-verify"
            );
            println!(
                "== continuous verification's cost: the collector over TCP without and with --policy, the join's throughput while it judges"
            );
            collector_verify(10_000, 20)?;
            collector_verify(100_000, 6)
        }
        "pcap" => pcap_ingest(bin),
        "all" => {
            datapath(repeat, baseline, cold)?;
            generator(bin)?;
            capture(bin, baseline_bin)?;
            pcap_ingest(bin)?;
            collector()
        }
        other => bail!(
            "unknown benchmark `{other}` (datapath, gen, capture, pcap, collector, collector-reader, collector-views, collector-verify, all)"
        ),
    }
}

/// The path a bench row's frames must take through the datapath, checked from the global
/// counters, the flow table and the samples after the row: a figure is printed only for
/// the path it claims to time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Taken {
    /// Let by as not RoCE: no counter moves, no flow, no sample.
    NotRoce,
    /// RoCEv2 in sequence (a response, or requests with increasing PSNs): no PSN
    /// regression or gap; exactly the samples the identity hash selects.
    InSequence,
    /// One request PSN repeated: every packet after the first a regression (the
    /// retransmission path).
    Retransmission,
    /// Every packet reported (CNPs, rate 1).
    EveryPacketReported,
    /// A mirrored copy (ERSPAN), counted as RoCEv2 and as mirrored.
    Mirrored,
}

/// One row: a frame repeated in the kernel (`repeat`), as it is or behind the PSN stepper
/// (`stepped`: a stream of in-sequence requests).
struct Row {
    name: &'static str,
    frames: Vec<Vec<u8>>,
    /// What the frames are as RoCE (for the expected samples); empty when not RoCE.
    specs: Vec<RoceFrame>,
    rate: u32,
    path: Taken,
    /// A stream: the frame's PSN advanced before every packet (see [`Stepper`]).
    stepped: bool,
}

/// Datapath cost per packet: the real object under BPF_PROG_TEST_RUN, beside an empty
/// program of each type on the same frames in the same run.
fn datapath(repeat: u32, baseline: Option<&Path>, cold_kind: Cold) -> anyhow::Result<()> {
    let f = |opcode| RoceFrame {
        opcode,
        ..Default::default()
    };
    let write = || RoceFrame {
        payload: vec![0; 1024],
        ..f(op::WRITE_MIDDLE)
    };
    let ack = || RoceFrame {
        ext: ext::aeth(0x1f, 1),
        ..f(op::ACKNOWLEDGE)
    };
    let v6 = |r: RoceFrame| RoceFrame {
        src: "fd00::1".parse().unwrap(),
        dst: "fd00::2".parse().unwrap(),
        ..r
    };
    let one = |name, spec: RoceFrame, rate, path| Row {
        name,
        frames: vec![spec.build()],
        specs: vec![spec],
        rate,
        path,
        stepped: false,
    };
    let raw = |name, frame: Vec<u8>| Row {
        name,
        frames: vec![frame],
        specs: Vec::new(),
        rate: 1000,
        path: Taken::NotRoce,
        stepped: false,
    };
    // A stream: one request frame whose PSN the stepper program advances before every
    // run of the program timed, so each packet is the one its flow expects next.
    let stream = |name, spec: RoceFrame, rate| Row {
        name,
        frames: vec![spec.build()],
        specs: vec![spec],
        rate,
        path: Taken::InSequence,
        stepped: true,
    };
    // TCP: a RoCE-sized IPv4 frame whose protocol says TCP.
    let mut tcp = f(op::SEND_ONLY).build();
    tcp[14 + 9] = 6;
    let mut tagged_tcp = RoceFrame {
        vlans: vec![(0x8100, 3 << 13 | 100)],
        ..f(op::SEND_ONLY)
    }
    .build();
    tagged_tcp[18 + 9] = 6;
    let mirrored = roce_trace_gen::frame::Mirror::ErspanII {
        session: 1,
        seq: 1,
        index: 1,
    }
    .encapsulate("198.51.100.7".parse()?, "198.51.100.1".parse()?, &write().build());
    let rows = vec![
        raw("TCP (non-RoCE)", tcp),
        one(
            "UDP to another port (non-RoCE)",
            RoceFrame {
                udp_dport: 5000,
                ..f(op::SEND_ONLY)
            },
            1000,
            Taken::NotRoce,
        ),
        one(
            "IPv6 UDP to another port (non-RoCE)",
            v6(RoceFrame {
                udp_dport: 5000,
                ..f(op::SEND_ONLY)
            }),
            1000,
            Taken::NotRoce,
        ),
        raw(
            "ARP (non-RoCE)",
            ethernet(
                [0xff; 6],
                [2, 0, 0, 0, 0, 1],
                &[],
                0x0806,
                &[0, 1, 8, 0, 6, 4, 0, 1],
            ),
        ),
        raw("TCP, 802.1Q tagged (non-RoCE)", tagged_tcp),
        one("RC ACK (AETH)", ack(), 1000, Taken::InSequence),
        one("RC ACK, IPv6", v6(ack()), 1000, Taken::InSequence),
        one(
            "RC ACK, 802.1Q tagged (PCP 3)",
            RoceFrame {
                vlans: vec![(0x8100, 3 << 13 | 100)],
                ..ack()
            },
            1000,
            Taken::InSequence,
        ),
        one(
            "CNP (always reported)",
            RoceFrame {
                opcode: 0x81,
                dscp: 48,
                ext: ext::cnp(),
                ..Default::default()
            },
            1000,
            Taken::EveryPacketReported,
        ),
        one(
            "RC WRITE MIDDLE 1 KiB, one PSN, every packet sampled",
            write(),
            1,
            Taken::EveryPacketReported,
        ),
        one(
            "RC WRITE MIDDLE 1 KiB, one PSN repeated",
            write(),
            0,
            Taken::Retransmission,
        ),
        Row {
            name: "ERSPAN II mirrored WRITE MIDDLE, 1 in 1000",
            frames: vec![mirrored],
            specs: vec![write()],
            rate: 1000,
            path: Taken::Mirrored,
            stepped: false,
        },
        stream("RC WRITE MIDDLE 1 KiB, in sequence, not sampled", write(), 0),
        stream("RC WRITE MIDDLE 1 KiB, in sequence, 1 in 1000", write(), 1000),
        // What a sampled packet costs in the common case (the row above repeats one PSN).
        stream("RC WRITE MIDDLE 1 KiB, in sequence, all sampled", write(), 1),
        stream(
            "RC WRITE MIDDLE 1 KiB, IPv6, in sequence, 1 in 1000",
            v6(write()),
            1000,
        ),
        stream(
            "RC SEND ONLY 64 B, in sequence, 1 in 1000",
            RoceFrame {
                payload: vec![0; 64],
                ..f(op::SEND_ONLY)
            },
            1000,
        ),
    ];
    // One CPU for the whole run: BPF_PROG_TEST_RUN runs where the caller runs, and a
    // move between an empty program's figure and the datapath's would compare two caches.
    // SAFETY: a zeroed cpu_set_t with one bit set, for this thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        let cpu = libc::sched_getcpu().max(0) as usize;
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            bail!(
                "pinning the bench to CPU {cpu}: {}",
                std::io::Error::last_os_error()
            );
        }
    }
    // The floor: a program of two instructions of each type, loaded by the bench itself,
    // timed on the same frames in the same run — what any program costs under test run.
    let empty_xdp = EmptyProg::load(BPF_PROG_TYPE_XDP, 2)?; // XDP_PASS
    let empty_tc = EmptyProg::load(BPF_PROG_TYPE_SCHED_CLS, 0)?; // TC_ACT_OK
    // Before anything is printed: a buffer that cannot evict what was asked for ends the bench.
    let mut evict = Evict::new(cold_kind)?;
    let baseline = match baseline {
        Some(p) => {
            Some(std::fs::read(p).with_context(|| format!("reading the baseline object {}", p.display()))?)
        }
        None => None,
    };
    println!(
        "== datapath: BPF_PROG_TEST_RUN, {repeat} iterations a run, median of {RUNS} runs (mean ns per packet){}",
        if baseline.is_some() {
            "; base: the baseline object, new: this build"
        } else {
            ""
        }
    );
    print_header(baseline.is_some());
    let mut cold = Vec::new();
    // ROCE_TRACE_BENCH_ROWS=text: only the rows whose name holds it (while working on one
    // path).
    let only = std::env::var("ROCE_TRACE_BENCH_ROWS").ok();
    for r in rows
        .iter()
        .filter(|r| only.as_deref().is_none_or(|o| r.name.contains(o)))
    {
        let opts = DatapathOptions {
            sample_rate: r.rate,
            ..Default::default()
        };
        let mut t = ProgTest::new(&opts);
        let mut base = baseline.as_ref().map(|obj| ProgTest::with_object(&opts, obj));
        // A full ring is cheaper than a real sample and would flatter the numbers: when
        // every packet is emitted, run few enough that the 4 MiB ring of 264-byte samples
        // never fills.
        let n = if r.path == Taken::EveryPacketReported || r.rate == 1 {
            repeat.min(12_000)
        } else {
            repeat
        };
        // [empty, base, new] for XDP and for TC.
        let mut xs: [Vec<u64>; 3] = Default::default();
        let mut ts: [Vec<u64>; 3] = Default::default();
        let mut sampled = 0u64;
        if r.stepped {
            // Every program behind the same stepper: it advances the PSN in place and
            // tail-calls the program timed, so its own cost is in every figure.
            let spec = &r.specs[0];
            let psn_off = psn_offset(&r.frames[0])?;
            let sx = Stepper::load(BPF_PROG_TYPE_XDP, psn_off, 1)?; // XDP_DROP: never what a target returns
            let st = Stepper::load(BPF_PROG_TYPE_SCHED_CLS, psn_off, 2)?; // TC_ACT_SHOT, likewise
            let fds = |t: &mut ProgTest| -> anyhow::Result<(i32, i32)> {
                use roce_trace_common::datapath::PROG_TC;
                Ok((
                    t.dp.xdp()?.fd()?.as_fd().as_raw_fd(),
                    t.dp.tc(PROG_TC)?.fd()?.as_fd().as_raw_fd(),
                ))
            };
            let new_fds = fds(&mut t)?;
            let base_fds = match &mut base {
                Some(b) => Some(fds(b)?),
                None => None,
            };
            for run in 0..RUNS as u32 {
                // Run `run` starts where the last left off: its first packet is PSN
                // run * n + 1.
                let frame = RoceFrame {
                    psn: spec.psn + run * n,
                    ..spec.clone()
                }
                .build();
                for (stepper, empty, out, pick) in [
                    (&sx, &empty_xdp, &mut xs, 0usize),
                    (&st, &empty_tc, &mut ts, 1usize),
                ] {
                    let pick = |f: (i32, i32)| if pick == 0 { f.0 } else { f.1 };
                    stepper.target(empty.fd.as_raw_fd())?;
                    out[0].push(stepper.time(&frame, n)?);
                    if let (Some(b), Some(f)) = (&mut base, base_fds) {
                        stepper.target(pick(f))?;
                        out[1].push(stepper.time(&frame, n)?);
                        b.drain_samples();
                    }
                    stepper.target(pick(new_fds))?;
                    out[2].push(stepper.time(&frame, n)?);
                    sampled += t.samples().len() as u64;
                }
            }
        } else {
            let frame = &r.frames[0];
            for _ in 0..RUNS {
                xs[0].push(empty_xdp.time(frame, n)?);
                if let Some(b) = &mut base {
                    xs[1].push(b.time_xdp(frame, n).as_nanos() as u64);
                    b.drain_samples();
                }
                xs[2].push(t.time_xdp(frame, n).as_nanos() as u64);
                sampled += t.samples().len() as u64;
                ts[0].push(empty_tc.time(frame, n)?);
                if let Some(b) = &mut base {
                    ts[1].push(b.time_tc(frame, n).as_nanos() as u64);
                    b.drain_samples();
                }
                ts[2].push(t.time_tc(frame, n).as_nanos() as u64);
                sampled += t.samples().len() as u64;
            }
        }
        let per_hook = u64::from(n) * RUNS as u64;
        // The samples the identity hash selects, computed apart from the datapath: for a
        // stream every PSN from 1 on, else the one frame's every time.
        let expected = match (r.path, r.specs.first()) {
            (Taken::NotRoce, _) | (_, None) => 0,
            (Taken::EveryPacketReported, _) => 2 * per_hook,
            (_, Some(s)) => match roce_trace_common::sampling::threshold_for_rate(r.rate) {
                None => 0,
                Some(th) => {
                    let seed = DatapathOptions::default().config()?.seed;
                    let hit = |psn: u32| identity(seed, s, psn) <= th;
                    if r.stepped {
                        let psns = (1..=per_hook as u32).map(|i| (s.psn + i) & 0xff_ffff);
                        2 * psns.filter(|&psn| hit(psn)).count() as u64
                    } else if hit(s.psn) {
                        2 * per_hook
                    } else {
                        0
                    }
                }
            },
        };
        check_path(&t, r, per_hook, sampled, expected)?;
        // Cold after the path is checked: these packets are not in its counts. A stream
        // goes on from the PSN the hot runs reached.
        let first_psn = r.specs.first().map(|s| s.psn + RUNS as u32 * n);
        cold.push((
            r.name.to_string(),
            cold_row(
                &mut t,
                base.as_mut(),
                r,
                first_psn,
                [&empty_xdp, &empty_tc],
                &mut evict,
                false,
            )?,
        ));
        if r.path == Taken::EveryPacketReported {
            // A reader that keeps up (an agent's, with the kernel's default wake-up
            // policy) has read everything before the next sample: each one wakes it.
            t.drain_samples();
            for (batch_wakeups, how) in [(false, "woken for each sample"), (true, "wake-ups batched")] {
                let mut p = opts.clone();
                p.batch_wakeups = batch_wakeups;
                let mut w = ProgTest::new(&p);
                let figures = cold_row(
                    &mut w,
                    None,
                    r,
                    first_psn,
                    [&empty_xdp, &empty_tc],
                    &mut evict,
                    true,
                )?;
                cold.push((format!("  the reader kept up: {how}"), figures));
            }
        }
        print_row(r.name, base.is_some(), medians(xs), medians(ts));
    }
    println!(
        "(repeated rows: one frame run `repeat` times in the kernel, cache-hot; the RC WRITE\n \
         row that repeats one PSN times the retransmission path. Every row checked the path\n \
         it took: not-RoCE rows moved no counter, in-sequence rows no PSN regression or gap\n \
         and exactly the samples the identity hash selects, and so on.)"
    );
    println!(
        "\n== the same frames {}, then one packet timed (repeat 1);\n   \
         median of {COLD_RUNS}, each program alternating with the empty one (and the baseline, which of the two\n   \
         builds runs first alternating too: the second runs with some of the test run's own lines warm).\n   \
         A live hook sits between this and the cache-hot table: what runs between two of our packets evicts\n   \
         some of our lines.\n   \
         Sampled rows also as a reader that keeps up sees them, woken for each sample (the kernel's default)\n   \
         or with wake-ups batched (a wake-up is an IRQ-work self-IPI).",
        cold_kind.describe()
    );
    print_header(baseline.is_some());
    for (name, [x, t]) in cold {
        print_row(&name, baseline.is_some(), x, t);
    }
    verifier_stats()
}

/// What the cold table evicts before each packet (`bench datapath --cold`). A cold packet
/// waits on its cache lines and on the walks of its pages' tables (in a VM, through the
/// guest's tables and the host's); the three kinds tell the two apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Cold {
    /// 4 MiB written a line at a time on 4 KiB pages: the L1 and L2 (twice the L2 this VM
    /// reports; its L3 is too large to flush) and half the second-level data TLB.
    Both,
    /// The same 4 MiB on two 2 MiB pages (transparent huge pages, `madvise`): the caches,
    /// two TLB entries.
    Caches,
    /// One line of each of 8192 4 KiB pages: every TLB entry the CPU has for 4 KiB pages,
    /// 512 KiB of lines, all at a page's start (few of the L2's sets).
    Tlb,
}

impl Cold {
    fn describe(self) -> &'static str {
        match self {
            Cold::Both => {
                "with cold caches and TLB (--cold both): before each packet the bench writes 4 MiB on 4 KiB pages\n   \
                 (the CPU's L1 and L2 over again, half its second-level TLB; this VM reports 2 MiB of L2 and an L3 too\n   \
                 large to flush)"
            }
            Cold::Caches => {
                "with cold caches, the TLB warm (--cold caches): before each packet the bench writes 4 MiB on two\n   \
                 2 MiB huge pages (the L1 and L2 over again, two TLB entries)"
            }
            Cold::Tlb => {
                "with a cold TLB, the caches mostly warm (--cold tlb): before each packet the bench writes one line\n   \
                 at the start of each of 8192 4 KiB pages (every TLB entry, few of the L2's sets)"
            }
        }
    }
}

/// The memory the cold table writes before each packet.
struct Evict {
    mem: std::ptr::NonNull<u8>,
    len: usize,
    /// Bytes from one write to the next: a line, or a page.
    stride: usize,
    /// Where the writes start (a huge page's boundary for `Cold::Caches`).
    start: usize,
    bytes: usize,
    pass: u8,
}

impl Evict {
    fn new(kind: Cold) -> anyhow::Result<Self> {
        const HUGE: usize = 2 << 20;
        let (bytes, stride) = match kind {
            Cold::Both | Cold::Caches => (4 << 20, 64),
            Cold::Tlb => (8192 * 4096, 4096),
        };
        // For huge pages, room to start on a huge page's boundary.
        let len = if kind == Cold::Caches { bytes + HUGE } else { bytes };
        // SAFETY: a new private anonymous mapping; nothing else is at the address it returns.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        ensure!(
            p != libc::MAP_FAILED,
            "mapping the eviction buffer: {}",
            std::io::Error::last_os_error()
        );
        let mem = std::ptr::NonNull::new(p.cast::<u8>()).context("mmap returned null")?;
        let start = if kind == Cold::Caches {
            (HUGE - p as usize % HUGE) % HUGE
        } else {
            0
        };
        let mut e = Self {
            mem,
            len,
            stride,
            start,
            bytes,
            pass: 0,
        };
        match kind {
            Cold::Caches => {
                // SAFETY: advice on our own mapping.
                let r = unsafe { libc::madvise(p, len, libc::MADV_HUGEPAGE) };
                ensure!(
                    r == 0,
                    "madvise(MADV_HUGEPAGE): {}",
                    std::io::Error::last_os_error()
                );
                e.touch();
                let huge = anon_huge_kib()?;
                ensure!(
                    huge >= (bytes >> 10) as u64,
                    "--cold caches needs the eviction buffer on huge pages, and this process has {huge} KiB of them \
                     (/sys/kernel/mm/transparent_hugepage/enabled must allow madvise)"
                );
            }
            Cold::Both | Cold::Tlb => {
                // SAFETY: advice on our own mapping.
                unsafe { libc::madvise(p, len, libc::MADV_NOHUGEPAGE) };
                e.touch();
            }
        }
        Ok(e)
    }

    /// Writes a new value at every stride (none is skipped as already there).
    fn touch(&mut self) {
        self.pass = self.pass.wrapping_add(1);
        let mut off = self.start;
        while off < self.start + self.bytes {
            // SAFETY: inside the mapping (`start + bytes <= len`).
            unsafe { self.mem.as_ptr().add(off).write_volatile(self.pass) };
            off += self.stride;
        }
    }
}

impl Drop for Evict {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.mem.as_ptr().cast(), self.len) };
    }
}

/// This process's anonymous memory on transparent huge pages, in KiB.
fn anon_huge_kib() -> anyhow::Result<u64> {
    let s = std::fs::read_to_string("/proc/self/smaps_rollup").context("reading /proc/self/smaps_rollup")?;
    s.lines()
        .find_map(|l| l.strip_prefix("AnonHugePages:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no AnonHugePages in /proc/self/smaps_rollup")
}
const COLD_RUNS: usize = 301;

/// A row's packets one at a time after `evict` is rewritten: `[empty, baseline, this
/// build]` medians for XDP and for TC (no baseline: `None`), the baseline and this build
/// taking turns to run first. A stream's packets carry increasing PSNs from `first_psn`
/// (each run is its own frame: the stepper cannot carry a PSN across runs of one packet).
fn cold_row(
    t: &mut ProgTest,
    mut base: Option<&mut ProgTest>,
    r: &Row,
    first_psn: Option<u32>,
    [empty_xdp, empty_tc]: [&EmptyProg; 2],
    evict: &mut Evict,
    drain_each: bool,
) -> anyhow::Result<[[Option<u64>; 3]; 2]> {
    use roce_trace_common::datapath::PROG_TC;
    let mut frame = r.frames[0].clone();
    let psn_off = if r.stepped {
        Some(psn_offset(&frame)?)
    } else {
        None
    };
    // [empty, baseline, this build] for XDP and for TC.
    let mut out: [[Vec<u64>; 3]; 2] = Default::default();
    for i in 0..COLD_RUNS as u32 {
        if let (Some(off), Some(psn)) = (psn_off, first_psn) {
            // The same PSN on both hooks: XDP counts ingress, TC egress, two flows.
            let psn = (psn + i) & 0xff_ffff;
            frame[off..off + 3].copy_from_slice(&psn.to_be_bytes()[1..]);
        }
        for (hook, empty) in [(0, empty_xdp), (1, empty_tc)] {
            // The baseline and this build in turn first: the one after the other runs
            // with some of the test run's own lines still warm.
            for which in if i % 2 == 0 { [0, 1, 2] } else { [0, 2, 1] } {
                let mut dp = match which {
                    0 => None,
                    1 => match base.as_deref_mut() {
                        Some(b) => Some(b),
                        None => continue,
                    },
                    _ => Some(&mut *t),
                };
                evict.touch();
                let ns = match (dp.as_deref_mut(), hook) {
                    (None, _) => empty.time(&frame, 1)?,
                    (Some(d), 0) => test_run(d.dp.xdp()?.fd()?, &frame, 1)?.0,
                    (Some(d), _) => test_run(d.dp.tc(PROG_TC)?.fd()?, &frame, 1)?.0,
                };
                out[hook][which].push(ns);
                if drain_each && let Some(d) = dp {
                    d.drain_samples();
                }
            }
        }
    }
    t.drain_samples();
    if let Some(b) = base {
        b.drain_samples();
    }
    Ok(out.map(medians))
}

/// Where a RoCEv2 frame's 24-bit PSN is: the BTH's last three bytes, found by the
/// shared parser.
fn psn_offset(frame: &[u8]) -> anyhow::Result<usize> {
    use roce_trace_common::parse::{SlicePacket, parse};
    let p = parse(&SlicePacket::new(frame), roce_trace_common::wire::ROCEV2_UDP_PORT)
        .map_err(|e| anyhow::anyhow!("a stream row's frame is not RoCEv2: {}", e.name()))?;
    // The BTH follows the UDP header; the ICRC ends the UDP datagram.
    Ok(p.icrc_off as usize + 4 - p.udp_len as usize + 8 + 9)
}

fn print_header(baseline: bool) {
    if baseline {
        println!(
            "{:<52} {:>6} {:>5} {:>5} {:>5} {:>5} {:>6} {:>5} {:>5} {:>5} {:>5}",
            "frame", "empty", "base", "over", "new", "over", "empty", "base", "over", "new", "over"
        );
        println!("{:<52} {:^29} {:^30}", "", "XDP (ns)", "TC (ns)");
    } else {
        println!(
            "{:<52} {:>9} {:>7} {:>6} {:>9} {:>7} {:>6}",
            "frame", "empty XDP", "XDP ns", "over", "empty TC", "TC ns", "over"
        );
    }
}

/// `[empty, baseline, this build]` medians for XDP and for TC, in the columns
/// [`print_header`] printed (`baseline`: with the baseline's; a row the baseline did not
/// run shows `-` there).
fn print_row(name: &str, baseline: bool, x: [Option<u64>; 3], t: [Option<u64>; 3]) {
    let over = |v: Option<u64>, e: Option<u64>| v.unwrap_or(0) as i64 - e.unwrap_or(0) as i64;
    let mut line = format!("{name:<52}");
    for [e, b, n] in [x, t] {
        if baseline {
            let (b, bo) = match b {
                Some(b) => (b.to_string(), format!("{:+}", over(Some(b), e))),
                None => ("-".to_string(), "-".to_string()),
            };
            line.push_str(&format!(
                " {:>6} {:>5} {:>5} {:>5} {:>+5}",
                e.unwrap_or(0),
                b,
                bo,
                n.unwrap_or(0),
                over(n, e)
            ));
        } else {
            line.push_str(&format!(
                " {:>9} {:>7} {:>+6}",
                e.unwrap_or(0),
                n.unwrap_or(0),
                over(n, e)
            ));
        }
    }
    println!("{line}");
}

/// Checks that a row's `per_hook` packets on each of XDP (ingress) and TC (egress) took
/// the path the row claims; `sampled`: the samples read after it (both hooks).
fn check_path(t: &ProgTest, r: &Row, per_hook: u64, sampled: u64, expected: u64) -> anyhow::Result<()> {
    use roce_trace_common::datapath::{DIR_EGRESS, DIR_INGRESS, GlobalCounter as G};
    let g = t.globals();
    let flows = t.flows();
    let name = r.name;
    ensure!(
        g.total(G::RingbufFull) == 0,
        "{name}: ring-buffer drops would skew the figure"
    );
    let both = 2 * per_hook;
    match r.path {
        Taken::NotRoce => {
            ensure!(
                g.total(G::FramesSeen) == 0 && flows.is_empty() && sampled == 0,
                "{name}: a non-RoCE frame moved a counter or made a flow ({} frames counted, {} flows)",
                g.total(G::FramesSeen),
                flows.len()
            );
            return Ok(());
        }
        Taken::Mirrored => ensure!(
            g.total(G::Mirrored) == both,
            "{name}: {} of {both} counted mirrored",
            g.total(G::Mirrored)
        ),
        _ => {}
    }
    ensure!(
        g.total(G::RoceV2) == both,
        "{name}: {} of {both} counted RoCEv2",
        g.total(G::RoceV2)
    );
    for dir in [DIR_INGRESS, DIR_EGRESS] {
        let regressions = g.get(G::PsnRegressions, dir);
        let gaps: u64 = flows
            .iter()
            .filter(|(k, _)| k.direction == dir)
            .map(|(_, c)| c.counts.psn_gaps)
            .sum();
        // One request frame run over and over: every packet after the first goes back.
        let repeated_request = !r.stepped
            && r.specs
                .first()
                .is_some_and(|s| roce_trace_common::roce::is_request(s.opcode));
        ensure!(
            repeated_request || r.path != Taken::Retransmission,
            "{name}: a retransmission row must repeat one request"
        );
        let want = if repeated_request { per_hook - 1 } else { 0 };
        ensure!(
            regressions == want && gaps == 0,
            "{name}: {regressions} PSN regressions (want {want}) and {gaps} gaps: not the path it claims"
        );
    }
    ensure!(
        sampled == expected && g.total(G::SamplesEmitted) == expected,
        "{name}: {sampled} samples, {} emitted; the identity hash selects {expected}",
        g.total(G::SamplesEmitted)
    );
    Ok(())
}

/// The identity hash of a frame as built from `s` with PSN `psn`, computed apart from the
/// datapath.
fn identity(seed: u32, s: &RoceFrame, psn: u32) -> u32 {
    let m = |a: std::net::IpAddr| match a {
        std::net::IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
        std::net::IpAddr::V6(a) => a.octets(),
    };
    roce_trace_common::sampling::identity_hash(
        seed,
        &m(s.src),
        &m(s.dst),
        s.udp_sport,
        s.udp_dport,
        s.dest_qp,
        psn,
        s.opcode,
    )
}

/// The verifier's figures for each program: instructions it processed (every path it
/// walked) and the program's size after its rewrites and after the JIT.
fn verifier_stats() -> anyhow::Result<()> {
    let mut t = ProgTest::new(&DatapathOptions::default());
    println!("== verifier: instructions processed / translated / JIT bytes");
    for (name, info) in [
        ("XDP", t.dp.xdp()?.info()?),
        (
            "TC egress",
            t.dp.tc(roce_trace_common::datapath::PROG_TC)?.info()?,
        ),
        (
            "TC ingress",
            t.dp.tc(roce_trace_common::datapath::PROG_TC_INGRESS)?.info()?,
        ),
    ] {
        println!(
            "{:<12} {:>8} processed {:>6} insns {:>7} JIT bytes",
            name,
            info.verified_instruction_count().unwrap_or(0),
            info.size_translated().unwrap_or(0) / 8,
            info.size_jitted()
        );
    }
    Ok(())
}

/// Runs per row, each program's alternating with the empty program's on the same CPU;
/// the median is printed. Short runs, many of them: this VM's speed drifts over seconds,
/// and alternating keeps a figure and its floor in the same moment.
const RUNS: usize = 15;

fn median(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    v[v.len() / 2]
}

/// `[empty, baseline, this build]` medians of a row's runs on one hook; `None` for a
/// program not run (no baseline).
fn medians(v: [Vec<u64>; 3]) -> [Option<u64>; 3] {
    v.map(|v| if v.is_empty() { None } else { Some(median(v)) })
}

const BPF_PROG_LOAD: i64 = 5;
const BPF_PROG_TEST_RUN: i64 = 10;
const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
const BPF_PROG_TYPE_XDP: u32 = 6;
/// `enum bpf_attach_type`'s BPF_XDP.
const BPF_XDP: u32 = 37;

/// `union bpf_attr` for BPF_PROG_LOAD, up to `expected_attach_type` (the kernel zeroes
/// the rest).
#[repr(C)]
#[derive(Default)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
}

/// `union bpf_attr` for BPF_PROG_TEST_RUN.
#[repr(C)]
#[derive(Default)]
struct TestRunAttr {
    prog_fd: u32,
    retval: u32,
    data_size_in: u32,
    data_size_out: u32,
    data_in: u64,
    data_out: u64,
    repeat: u32,
    duration: u32,
    ctx_size_in: u32,
    ctx_size_out: u32,
    ctx_in: u64,
    ctx_out: u64,
    flags: u32,
    cpu: u32,
    batch_size: u32,
    _pad: u32,
}

/// `r0 = ret; exit`: the cheapest program of a type.
struct EmptyProg {
    fd: std::os::fd::OwnedFd,
    ret: i32,
}

impl EmptyProg {
    fn load(prog_type: u32, ret: i32) -> anyhow::Result<Self> {
        Self::named(prog_type, ret, "empty")
    }

    /// The same, under `name` (its JIT symbol is `bpf_prog_<tag>_<name>`).
    fn named(prog_type: u32, ret: i32, name: &str) -> anyhow::Result<Self> {
        let insns = [
            insn(0xb7, 0, 0, 0, ret), // r0 = ret
            insn(0x95, 0, 0, 0, 0),   // exit
        ];
        Ok(Self {
            fd: prog_load(prog_type, &insns, name)?,
            ret,
        })
    }

    /// Mean ns per run over `repeat` runs on `frame`; checks the program said `ret`.
    fn time(&self, frame: &[u8], repeat: u32) -> anyhow::Result<u64> {
        let (ns, ret) = test_run(&self.fd, frame, repeat)?;
        ensure!(
            ret as i32 == self.ret,
            "the empty program returned {ret} instead of {}",
            self.ret
        );
        Ok(ns)
    }
}

/// A program that adds one to the 24-bit PSN at `psn_off` of the frame, in place, then
/// tail-calls the program in slot 0 of its own program array: under BPF_PROG_TEST_RUN
/// with `repeat`, the program behind it sees a stream of requests each the one its flow
/// expects next, the frame staying in cache as in every other row. The empty program is
/// timed behind it too, so its cost (a few loads and stores and a tail call) is in both
/// figures and out of the difference.
struct Stepper {
    prog: std::os::fd::OwnedFd,
    map: std::os::fd::OwnedFd,
    /// What the stepper returns when the tail call fails (it must not: checked).
    fallback: i32,
}

impl Stepper {
    fn load(prog_type: u32, psn_off: usize, fallback: i32) -> anyhow::Result<Self> {
        use std::os::fd::{AsRawFd, FromRawFd};
        #[repr(C)]
        #[derive(Default)]
        struct MapCreateAttr {
            map_type: u32,
            key_size: u32,
            value_size: u32,
            max_entries: u32,
            map_flags: u32,
        }
        const BPF_MAP_CREATE: i64 = 0;
        const BPF_MAP_TYPE_PROG_ARRAY: u32 = 3;
        let mut attr = MapCreateAttr {
            map_type: BPF_MAP_TYPE_PROG_ARRAY,
            key_size: 4,
            value_size: 4,
            max_entries: 1,
            ..Default::default()
        };
        // SAFETY: bpf(2) reads `attr`, alive for the call, and returns a descriptor or -1.
        let fd = unsafe { sys_bpf(BPF_MAP_CREATE, &mut attr) };
        ensure!(
            fd >= 0,
            "creating the stepper's program array: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: a descriptor bpf(2) just returned, owned by nothing else.
        let map = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) };
        // The context's packet pointers: xdp_md.data/data_end, __sk_buff.data/data_end.
        let (data, data_end) = if prog_type == BPF_PROG_TYPE_XDP {
            (0, 4)
        } else {
            (76, 80)
        };
        let off = i16::try_from(psn_off).context("PSN offset")?;
        let insns = [
            insn(0xbf, 6, 1, 0, 0),               // r6 = r1 (ctx)
            insn(0x61, 2, 6, data, 0),            // r2 = ctx->data
            insn(0x61, 3, 6, data_end, 0),        // r3 = ctx->data_end
            insn(0xbf, 4, 2, 0, 0),               // r4 = r2
            insn(0x07, 4, 0, 0, off as i32 + 3),  // r4 += psn_off + 3
            insn(0x2d, 4, 3, 13, 0),              // if r4 > r3 goto tail
            insn(0x71, 5, 2, off, 0),             // r5 = psn[0]
            insn(0x67, 5, 0, 0, 16),              // r5 <<= 16
            insn(0x71, 7, 2, off + 1, 0),         // r7 = psn[1]
            insn(0x67, 7, 0, 0, 8),               // r7 <<= 8
            insn(0x4f, 5, 7, 0, 0),               // r5 |= r7
            insn(0x71, 7, 2, off + 2, 0),         // r7 = psn[2]
            insn(0x4f, 5, 7, 0, 0),               // r5 |= r7
            insn(0x07, 5, 0, 0, 1),               // r5 += 1
            insn(0x73, 2, 5, off + 2, 0),         // psn[2] = r5
            insn(0x77, 5, 0, 0, 8),               // r5 >>= 8
            insn(0x73, 2, 5, off + 1, 0),         // psn[1] = r5
            insn(0x77, 5, 0, 0, 8),               // r5 >>= 8
            insn(0x73, 2, 5, off, 0),             // psn[0] = r5
            insn(0xbf, 1, 6, 0, 0),               // tail: r1 = ctx
            insn(0x18, 2, 1, 0, map.as_raw_fd()), // r2 = the program array (ld_imm64, map fd)
            insn(0, 0, 0, 0, 0),
            insn(0xb7, 3, 0, 0, 0),        // r3 = 0
            insn(0x85, 0, 0, 0, 12),       // call bpf_tail_call
            insn(0xb7, 0, 0, 0, fallback), // r0 = fallback
            insn(0x95, 0, 0, 0, 0),        // exit
        ];
        let prog = prog_load(prog_type, &insns, "psn_stepper")?;
        Ok(Self { prog, map, fallback })
    }

    /// Puts the program `fd` in slot 0: the program the stepper runs next.
    fn target(&self, fd: std::os::fd::RawFd) -> anyhow::Result<()> {
        use std::os::fd::AsRawFd;
        #[repr(C)]
        struct ElemAttr {
            map_fd: u32,
            _pad: u32,
            key: u64,
            value: u64,
            flags: u64,
        }
        const BPF_MAP_UPDATE_ELEM: i64 = 2;
        let (key, value) = (0u32, fd as u32);
        let mut attr = ElemAttr {
            map_fd: self.map.as_raw_fd() as u32,
            _pad: 0,
            key: &key as *const u32 as u64,
            value: &value as *const u32 as u64,
            flags: 0,
        };
        // SAFETY: bpf(2) reads `attr` and the key and value it points at, all alive.
        let r = unsafe { sys_bpf(BPF_MAP_UPDATE_ELEM, &mut attr) };
        ensure!(
            r == 0,
            "putting a program behind the stepper: {}",
            std::io::Error::last_os_error()
        );
        Ok(())
    }

    /// Mean ns per run over `repeat` runs on `frame`; checks the tail call happened (the
    /// programs behind it return something other than the fallback).
    fn time(&self, frame: &[u8], repeat: u32) -> anyhow::Result<u64> {
        let (ns, ret) = test_run(&self.prog, frame, repeat)?;
        ensure!(
            ret as i32 != self.fallback,
            "the stepper's tail call failed (it returned its fallback {ret})"
        );
        Ok(ns)
    }
}

/// bpf(2) with `attr`, a prefix of `union bpf_attr` for `cmd` (the kernel zeroes the
/// rest): its return, -1 with errno set on failure.
///
/// # Safety
/// Every pointer in `attr` must be valid for what `cmd` reads or writes through it, for
/// the call.
unsafe fn sys_bpf<A>(cmd: i64, attr: &mut A) -> i64 {
    // SAFETY: `attr` is valid for `size_of::<A>()` bytes of reads and writes; the caller
    // vouches for the pointers in it.
    unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            core::ptr::from_mut(attr),
            std::mem::size_of::<A>(),
        )
    }
}

/// One BPF instruction: opcode, registers, offset, immediate.
fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[0] = code;
    b[1] = (src << 4) | (dst & 0xf);
    b[2..4].copy_from_slice(&off.to_ne_bytes());
    b[4..8].copy_from_slice(&imm.to_ne_bytes());
    b
}

/// Loads a program of `prog_type` from its instructions; on refusal, the verifier's log.
fn prog_load(prog_type: u32, insns: &[[u8; 8]], name: &str) -> anyhow::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    let code: Vec<u8> = insns.concat();
    let license = b"GPL\0";
    let mut prog_name = [0u8; 16];
    prog_name[..name.len().min(15)].copy_from_slice(&name.as_bytes()[..name.len().min(15)]);
    let mut log = vec![0u8; 64 * 1024];
    let mut attr = ProgLoadAttr {
        prog_type,
        // As aya loads the datapath's XDP program: the kernel lets a program array hold
        // only programs of the type and expected attach type of its first.
        expected_attach_type: if prog_type == BPF_PROG_TYPE_XDP {
            BPF_XDP
        } else {
            0
        },
        insn_cnt: insns.len() as u32,
        insns: code.as_ptr() as u64,
        license: license.as_ptr() as u64,
        log_level: 1,
        log_size: log.len() as u32,
        log_buf: log.as_mut_ptr() as u64,
        prog_name,
        ..Default::default()
    };
    // SAFETY: bpf(2) reads `attr` (and the instructions and license it points at) and
    // writes at most `log_size` bytes of `log`, all alive for the call; it returns a new
    // descriptor or -1.
    let fd = unsafe { sys_bpf(BPF_PROG_LOAD, &mut attr) };
    if fd < 0 {
        let err = std::io::Error::last_os_error();
        let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
        bail!(
            "loading the {name} program: {err}\n{}",
            String::from_utf8_lossy(&log[..end])
        );
    }
    // SAFETY: a descriptor bpf(2) just returned, owned by nothing else.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
}

/// BPF_PROG_TEST_RUN of `fd` on `frame`, `repeat` times: mean ns per run and the return.
fn test_run(fd: impl std::os::fd::AsFd, frame: &[u8], repeat: u32) -> anyhow::Result<(u64, u32)> {
    use std::os::fd::AsRawFd;
    let mut out = vec![0u8; frame.len() + 512];
    let mut attr = TestRunAttr {
        prog_fd: fd.as_fd().as_raw_fd() as u32,
        data_size_in: frame.len() as u32,
        data_size_out: out.len() as u32,
        data_in: frame.as_ptr() as u64,
        data_out: out.as_mut_ptr() as u64,
        repeat,
        ..Default::default()
    };
    // SAFETY: bpf(2) reads and writes `attr`, reads `frame` and writes at most
    // `data_size_out` bytes of `out`, all alive for the call.
    let r = unsafe { sys_bpf(BPF_PROG_TEST_RUN, &mut attr) };
    ensure!(r == 0, "test run: {}", std::io::Error::last_os_error());
    Ok((attr.duration as u64, attr.retval))
}

fn gen_json(ns: &str, bin: &Path, args: &[&str]) -> anyhow::Result<Value> {
    let out = Command::new("ip")
        .args(["netns", "exec", ns, "taskset", "-c", "0"])
        .arg(bin)
        .arg("gen")
        .args(args)
        .arg("--json")
        .output()
        .context("running roce-trace gen")?;
    ensure!(
        out.status.success(),
        "gen failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// Generator rate on one core (taskset -c 0) through a veth pair; the far end drops the
/// packets in its raw PREROUTING table, so what is measured is the sender and the link.
fn generator(bin: &Path) -> anyhow::Result<()> {
    let pair = VethPair::new("bgen");
    pair.b.exec(&[
        "iptables",
        "-t",
        "raw",
        "-A",
        "PREROUTING",
        "-p",
        "udp",
        "--dport",
        "4791",
        "-j",
        "DROP",
    ]);
    let mac = pair
        .b
        .exec(&["cat", &format!("/sys/class/net/{}/address", pair.b_if)]);
    let mac = mac.trim();
    println!(
        "== generator: 1 QP, RDMA WRITE 64 KiB at path MTU 1024 (1 KiB payload per packet), 3 s on one core, veth"
    );
    println!("{:<58} {:>12} {:>9}", "mode", "packets/s", "Gbit/s");
    let modes: Vec<(&str, Vec<&str>)> = vec![
        (
            "--tx packet (AF_PACKET, sendmmsg 64, qdisc bypass)",
            vec![
                "--tx",
                "packet",
                "--iface",
                &pair.a_if,
                "--dst-mac",
                mac,
                "--batch",
                "64",
            ],
        ),
        ("--tx socket (UDP, sendmmsg 64)", vec!["--batch", "64"]),
    ];
    for (name, extra) in modes {
        let mut args = vec![
            "--to",
            "10.99.0.2",
            "--rate",
            "max",
            "--no-dcqcn",
            "--duration",
            "3s",
        ];
        args.extend(extra);
        let r = gen_json(&pair.a.name, bin, &args)?;
        let q = &r["senders"][0];
        let secs = r["duration_s"].as_f64().unwrap_or(1.0);
        let pps = q["packets"].as_f64().unwrap_or(0.0) / secs;
        let gbps = q["bytes"].as_f64().unwrap_or(0.0) * 8.0 / secs / 1e9;
        ensure!(q["tx_dropped"] == 0, "{name}: the stack refused packets");
        println!("{name:<58} {pps:>12.0} {gbps:>9.2}");
    }
    Ok(())
}

const PERF_HZ: u32 = 4999;

/// `perf record` of every CPU with call stacks (software clock: no PMU needed), so that
/// kernel work done for a tool in softirq — which no process counter shows — is charged
/// to it.
struct Profiler {
    child: Child,
    data: std::path::PathBuf,
}

/// CPU time charged to each tool from the samples.
#[derive(Default)]
struct Charged {
    samples: u64,
    rt_process: Duration,
    rt_bpf: Duration,
    rt_veth_copy: Duration,
    td_process: Duration,
    td_kernel: Duration,
    /// roce-trace's hook samples by the innermost frame (the JIT'd program itself, a
    /// helper it called, or the hook's entry around it): where its kernel time goes.
    rt_bpf_at: std::collections::BTreeMap<String, Duration>,
    /// roce-trace's process samples by the innermost frame.
    rt_process_at: std::collections::BTreeMap<String, Duration>,
}

impl Charged {
    fn roce_trace(&self) -> Duration {
        self.rt_process + self.rt_bpf + self.rt_veth_copy
    }
    fn tcpdump(&self) -> Duration {
        self.td_process + self.td_kernel
    }
}

impl Profiler {
    fn start(out: &Path) -> anyhow::Result<Self> {
        let child = Command::new("perf")
            .args([
                "record",
                "-a",
                "-g",
                "-e",
                "cpu-clock",
                "-F",
                &PERF_HZ.to_string(),
                "-o",
            ])
            .arg(out)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("perf record (Debian package linux-perf; scripts/setup installs it)")?;
        // perf needs a moment to open its events on every CPU.
        std::thread::sleep(Duration::from_millis(700));
        Ok(Self {
            child,
            data: out.to_path_buf(),
        })
    }

    /// Stops recording and charges each sample: to the tool whose kernel hook is on its
    /// stack (our programs and the copy veth makes for XDP; tcpdump's packet socket), else
    /// to the tool whose process it interrupted, else to nobody.
    fn finish(mut self, rt_pid: u32, td_pid: u32) -> anyhow::Result<Charged> {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let status = self.child.wait()?;
        // perf stops on SIGINT by re-raising it once its data is written.
        ensure!(
            status.success() || std::os::unix::process::ExitStatusExt::signal(&status) == Some(libc::SIGINT),
            "perf record: {status}"
        );
        let data = &self.data;
        let script = Command::new("perf")
            .args(["script", "-F", "pid,period,ip,sym", "-i"])
            .arg(data)
            .stderr(Stdio::null())
            .output()
            .context("perf script")?;
        ensure!(script.status.success(), "perf script failed");
        Ok(charge(&String::from_utf8_lossy(&script.stdout), rt_pid, td_pid))
    }
}

/// Charges `perf script -F pid,period,ip,sym` samples (a `pid period` line, then one
/// `ip symbol` line per stack frame, innermost first; a blank line ends a sample).
fn charge(script: &str, rt_pid: u32, td_pid: u32) -> Charged {
    #[derive(PartialEq)]
    enum To {
        RtBpf,
        RtVethCopy,
        TdKernel,
    }
    let hook = |sym: &str| {
        // JIT symbols are `bpf_prog_<tag>_<name>`.
        // The empty program of the floor runs is charged by the same rule (only one of
        // the two is ever attached).
        let ours = || {
            PROGRAMS
                .iter()
                .chain([&EMPTY_TC])
                .any(|p| sym.strip_suffix(p).is_some_and(|s| s.ends_with('_')))
        };
        if sym.starts_with("bpf_prog_") && ours() {
            Some(To::RtBpf)
        } else if matches!(sym, "sch_handle_ingress" | "sch_handle_egress" | "tcx_run") {
            // The TC hook runs only because our programs are attached (nothing else is).
            Some(To::RtBpf)
        } else if matches!(sym, "tpacket_rcv" | "packet_rcv" | "dev_queue_xmit_nit") {
            Some(To::TdKernel)
        } else if sym == "skb_pp_cow_data" {
            Some(To::RtVethCopy)
        } else {
            None
        }
    };
    let mut c = Charged::default();
    let mut sample: Option<(u32, u64)> = None;
    let mut to: Option<To> = None;
    let mut innermost: Option<String> = None;
    let settle = |sample: Option<(u32, u64)>, to: Option<To>, innermost: Option<String>, c: &mut Charged| {
        let Some((pid, period)) = sample else { return };
        c.samples += 1;
        let d = Duration::from_nanos(period);
        match to {
            Some(To::RtBpf) => {
                c.rt_bpf += d;
                // JIT symbols carry the program's tag: one name per program.
                let at = innermost.unwrap_or_default();
                let at = match at.strip_prefix("bpf_prog_").and_then(|s| s.split_once('_')) {
                    Some((_, name)) => format!("program {name}"),
                    None => at,
                };
                *c.rt_bpf_at.entry(at).or_default() += d;
            }
            Some(To::RtVethCopy) => c.rt_veth_copy += d,
            Some(To::TdKernel) => c.td_kernel += d,
            None if pid == rt_pid => {
                c.rt_process += d;
                *c.rt_process_at.entry(innermost.unwrap_or_default()).or_default() += d;
            }
            None if pid == td_pid => c.td_process += d,
            None => {}
        }
    };
    for line in script.lines() {
        if line.trim().is_empty() {
            settle(sample.take(), to.take(), innermost.take(), &mut c);
        } else if line.starts_with('\t') {
            // `ip symbol`: the first hook found from the innermost frame decides.
            let sym = line.split_whitespace().nth(1).unwrap_or("");
            if innermost.is_none() {
                innermost = Some(sym.to_string());
            }
            if to.is_none() {
                to = hook(sym);
            }
        } else {
            let mut f = line.split_whitespace();
            let pid = f.next().and_then(|x| x.parse().ok());
            let period = f.next().and_then(|x| x.parse().ok());
            settle(sample.take(), to.take(), innermost.take(), &mut c);
            sample = pid.zip(period);
        }
    }
    settle(sample, to, innermost, &mut c);
    c
}

/// The eight largest shares of `total`, largest first: `symbol N %, …`.
fn top_frames(at: &std::collections::BTreeMap<String, Duration>, total: Duration) -> String {
    let mut at: Vec<(&String, &Duration)> = at.iter().collect();
    at.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
    let at: Vec<String> = at
        .iter()
        .take(8)
        .map(|(s, d)| {
            format!(
                "{s} {:.0} %",
                100.0 * d.as_secs_f64() / total.as_secs_f64().max(1e-9)
            )
        })
        .collect();
    at.join(", ")
}

/// CPU time (user + system) a running process has used so far, from /proc.
fn proc_cpu(pid: u32) -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces) start at field 3.
    let rest = stat.rsplit_once(')').context("/proc stat")?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f[11].parse::<u64>()? + f[12].parse::<u64>()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    Ok(Duration::from_nanos(ticks * 1_000_000_000 / hz))
}

/// CPU time of a child that has exited, from wait4's rusage.
fn wait_cpu(c: Child) -> anyhow::Result<(Duration, i32)> {
    let mut status = 0;
    // SAFETY: zeroed rusage is valid; wait4 fills it for our own child.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: waiting on our own child's pid.
    let r = unsafe { libc::wait4(c.id() as i32, &mut status, 0, &mut ru) };
    ensure!(r > 0, "wait4: {}", std::io::Error::last_os_error());
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    Ok((tv(ru.ru_utime) + tv(ru.ru_stime), status))
}

/// roce-trace capture against tcpdump -w on the same lab traffic, at the same time, on the
/// receiving host: CPU seconds per million RoCE packets, and the counts each reported.
/// With `baseline`, another build's binary runs the same loads, alternating with this
/// build's run by run (which goes first alternating too), so both see the same machine.
fn capture(bin: &Path, baseline: Option<&Path>) -> anyhow::Result<()> {
    if let Some(b) = baseline {
        let same = std::fs::canonicalize(b)
            .with_context(|| format!("the baseline binary {}", b.display()))?
            == std::fs::canonicalize(bin).with_context(|| format!("{}", bin.display()))?;
        ensure!(
            !same,
            "--baseline-bin is this build's own binary: copy another build's elsewhere"
        );
    }
    let lab = Lab {
        prefix: "rtbench".into(),
        ..Lab::default()
    };
    lab.down()?;
    lab.up()?;
    // tcx (Linux 6.6) attaches the floor's program; without it the floor is left out.
    let floor_runs = match attach_empty_tc(&lab.ns("h3"), "eth0") {
        Ok(_links) => true,
        Err(e) => {
            println!("(no floor: {e:#})");
            false
        }
    };
    // A light load (both CPUs mostly idle) and a heavy one (the lab's forwarding keeps
    // both busy): per-packet costs differ with how warm the caches stay.
    // Each three times: the figures move between runs with what else the two CPUs do.
    let result = [40, 150].into_iter().try_for_each(|mbit| {
        let mut new = Vec::new();
        let mut base = Vec::new();
        let mut floor = Vec::new();
        for run in 1..=CAPTURE_RUNS {
            // Each tool in turn, the order reversed every other run.
            let mut order = vec![Tool::ThisBuild(bin)];
            if floor_runs {
                order.push(Tool::EmptyTc);
            }
            if let Some(b) = baseline {
                order.insert(0, Tool::Baseline(b));
            }
            if run % 2 == 0 {
                order.reverse();
            }
            for tool in order {
                // This build's generator for every tool: the same traffic.
                let cost = again_if_tcpdump_missed(CAPTURE_ATTEMPTS, |attempt| {
                    if attempt > 1 {
                        println!("(run {run} again, attempt {attempt} of {CAPTURE_ATTEMPTS}: tcpdump missed packets the last time)");
                    }
                    capture_on_lab(&lab, tool, bin, mbit, run)
                })?;
                match tool {
                    Tool::ThisBuild(_) => new.push(cost),
                    Tool::Baseline(_) => base.push(cost),
                    Tool::EmptyTc => floor.push(cost),
                }
            }
        }
        print_capture_medians(
            mbit,
            if baseline.is_some() { " this build:" } else { "" },
            "roce-trace",
            &new,
        );
        if baseline.is_some() {
            print_capture_medians(mbit, " the baseline:", "roce-trace", &base);
        }
        if floor_runs {
            print_capture_medians(
                mbit,
                " the floor, an empty TC program at the same hooks:",
                "it",
                &floor,
            );
        }
        println!();
        Ok(())
    });
    lab.down()?;
    result
}

const CAPTURE_RUNS: u32 = 3;
/// How often one run is tried when tcpdump misses packets (its kernel ring overflows
/// when the VM stalls it: at the heavy load on the development VM, in about one run in
/// four, from a few to some fifteen thousand of a million packets).
const CAPTURE_ATTEMPTS: u32 = 3;

/// A run in which tcpdump captured fewer packets than the wire carried: its cost is of
/// other packets than roce-trace's, so the run gives no ratio (the bench runs it again).
#[derive(Debug)]
struct TcpdumpMissed {
    captured: u64,
    wire: u64,
}

impl std::fmt::Display for TcpdumpMissed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "tcpdump captured {}, the wire carried {}: its cost is not of the same packets",
            self.captured, self.wire
        )
    }
}

impl std::error::Error for TcpdumpMissed {}

/// `run(attempt)` (from 1) until it gives a result or an error other than
/// [`TcpdumpMissed`], at most `attempts` times; the last error stands.
fn again_if_tcpdump_missed<T>(
    attempts: u32,
    mut run: impl FnMut(u32) -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    let mut attempt = 1;
    loop {
        match run(attempt) {
            Err(e) if attempt < attempts && e.downcast_ref::<TcpdumpMissed>().is_some() => attempt += 1,
            r => return r,
        }
    }
}

/// What watches h3's `eth0` beside tcpdump in a capture run.
#[derive(Clone, Copy)]
enum Tool<'a> {
    /// `roce-trace capture` from this build's binary.
    ThisBuild(&'a Path),
    /// `roce-trace capture` from `--baseline-bin`.
    Baseline(&'a Path),
    /// An empty TC program (`return TC_ACT_UNSPEC`) attached with tcx at ingress and
    /// egress, as capture attaches roce-trace's: what any TC-based tool pays on this
    /// traffic before it does anything, charged by the same rule.
    EmptyTc,
}

/// The empty TC program's name: its JIT symbol is `bpf_prog_<tag>_rt_empty_tc`.
const EMPTY_TC: &str = "rt_empty_tc";
/// `bpf(2)` commands and `enum bpf_attach_type` values (Linux 6.6's tcx).
const BPF_LINK_CREATE: i64 = 28;
const BPF_TCX_INGRESS: u32 = 46;
const BPF_TCX_EGRESS: u32 = 47;

/// `union bpf_attr` for BPF_LINK_CREATE with tcx (the rest zero: no relative program, no
/// expected revision).
#[repr(C)]
#[derive(Default)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_ifindex: u32,
    attach_type: u32,
    flags: u32,
    _rest: [u64; 6],
}

/// The empty TC program attached at both tcx hooks of `iface` in network namespace
/// `ns`; detached when the links are dropped.
fn attach_empty_tc(ns: &str, iface: &str) -> anyhow::Result<Vec<std::os::fd::OwnedFd>> {
    use std::os::fd::FromRawFd;
    // TC_ACT_UNSPEC: go on as if nothing were attached, as roce-trace's programs do.
    let prog = EmptyProg::named(BPF_PROG_TYPE_SCHED_CLS, -1, EMPTY_TC)?.fd;
    let netns = std::fs::File::open(format!("/var/run/netns/{ns}"))
        .with_context(|| format!("network namespace {ns}"))?;
    let iface = std::ffi::CString::new(iface)?;
    // A thread of its own enters the namespace (to find the interface there); the links
    // it makes hold the attachment wherever their descriptors go.
    std::thread::scope(|sc| {
        sc.spawn(|| -> anyhow::Result<Vec<std::os::fd::OwnedFd>> {
            // SAFETY: setns on this thread only, with a namespace descriptor we own.
            ensure!(
                unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) } == 0,
                "entering {ns}: {}",
                std::io::Error::last_os_error()
            );
            // SAFETY: a NUL-terminated name.
            let ifindex = unsafe { libc::if_nametoindex(iface.as_ptr()) };
            ensure!(ifindex != 0, "no interface {iface:?} in {ns}");
            [BPF_TCX_INGRESS, BPF_TCX_EGRESS]
                .into_iter()
                .map(|attach_type| {
                    let mut attr = LinkCreateAttr {
                        prog_fd: prog.as_raw_fd() as u32,
                        target_ifindex: ifindex,
                        attach_type,
                        ..Default::default()
                    };
                    // SAFETY: bpf(2) reads `attr`, alive for the call; it returns a new
                    // link descriptor or -1.
                    let fd = unsafe { sys_bpf(BPF_LINK_CREATE, &mut attr) };
                    ensure!(
                        fd >= 0,
                        "attaching the empty TC program: {}",
                        std::io::Error::last_os_error()
                    );
                    // SAFETY: a descriptor bpf(2) just returned, owned by nothing else.
                    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
                })
                .collect()
        })
        .join()
        .map_err(|_| anyhow::anyhow!("the thread attaching the empty TC program panicked"))?
    })
}

/// One run's figures, whole system: roce-trace's and tcpdump's CPU seconds per million
/// packets, and their ratio.
#[derive(Clone, Copy)]
struct CaptureCost {
    ratio: f64,
    roce_trace: f64,
    tcpdump: f64,
}

fn print_capture_medians(mbit: u32, what: &str, who: &str, runs: &[CaptureCost]) {
    let median = |f: fn(&CaptureCost) -> f64| {
        let mut v: Vec<f64> = runs.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let list = |f: fn(&CaptureCost) -> f64| {
        runs.iter()
            .map(|c| format!("{:.3}", f(c)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "== {mbit} Mbit/s per QP:{what} {who} uses {:.3} of tcpdump's CPU per packet, whole system (median of {} runs: {}); CPU s per million packets: {who} {:.3} ({}), tcpdump {:.3} ({})",
        median(|c| c.ratio),
        runs.len(),
        list(|c| c.ratio),
        median(|c| c.roce_trace),
        list(|c| c.roce_trace),
        median(|c| c.tcpdump),
        list(|c| c.tcpdump),
    );
}

/// One run: both tools' CPU per packet, whole system, and their ratio.
fn capture_on_lab(
    lab: &Lab,
    tool: Tool,
    generator: &Path,
    mbit: u32,
    run: u32,
) -> anyhow::Result<CaptureCost> {
    let dir = std::env::temp_dir().join(format!("roce-trace-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    // The pcap and perf data are large: removed whether the run succeeds or not.
    let result = capture_run(lab, tool, generator, mbit, run, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn capture_run(
    lab: &Lab,
    tool: Tool,
    generator: &Path,
    mbit: u32,
    run: u32,
    dir: &Path,
) -> anyhow::Result<CaptureCost> {
    let secs = 10;
    // No BPF_ENABLE_STATS: timing every program run costs about 70 ns a packet (two clock
    // reads), which the sampled figure would charge to roce-trace.

    let json = dir.join("capture.jsonl");
    let mut line = String::new();
    // roce-trace capture, or the empty program's links (held until the run ends).
    let (which, mut cap, empty) = match tool {
        Tool::ThisBuild(bin) | Tool::Baseline(bin) => {
            let which = if matches!(tool, Tool::Baseline(_)) {
                " (baseline)"
            } else {
                ""
            };
            let mut cap = Command::new("ip")
                .args(["netns", "exec", &lab.ns("h3")])
                .arg(bin)
                .args([
                    "capture",
                    "-i",
                    "eth0",
                    "--json",
                    "--duration",
                    &format!("{}s", secs + 4),
                    "-w",
                ])
                .arg(&json)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()?;
            let mut err = BufReader::new(cap.stderr.take().unwrap());
            while err.read_line(&mut line)? > 0 && !line.contains("capturing on") {
                line.clear();
            }
            ensure!(line.contains("capturing on"), "capture did not start");
            (which, Some(cap), None)
        }
        Tool::EmptyTc => (
            " (the floor: an empty TC program)",
            None,
            Some(attach_empty_tc(&lab.ns("h3"), "eth0")?),
        ),
    };
    let pcap = dir.join("tcpdump.pcap");
    let mut dump = Command::new("ip")
        .args(["netns", "exec", &lab.ns("h3"), "tcpdump", "-i", "eth0", "-w"])
        .arg(&pcap)
        .args(["udp", "port", "4791"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut derr = BufReader::new(dump.stderr.take().unwrap());
    line.clear();
    while derr.read_line(&mut line)? > 0 && !line.contains("listening on") {
        line.clear();
    }

    // Steady state: what each tool costs while traffic flows, start-up (program
    // verification, tcpdump's set-up) excluded; both are reported.
    let cap0 = cap.as_ref().map(|c| proc_cpu(c.id())).transpose()?;
    let dump0 = proc_cpu(dump.id())?;
    let perf_data = dir.join("perf.data");
    let perf = Profiler::start(&perf_data)?;
    let resp = Command::new("ip")
        .args(["netns", "exec", &lab.ns("h3")])
        .arg(generator)
        .args([
            "gen",
            "--bind",
            "10.10.3.2",
            "--duration",
            &format!("{}s", secs + 2),
            "--json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    std::thread::sleep(Duration::from_millis(500));
    let send = Command::new("ip")
        .args(["netns", "exec", &lab.ns("h1")])
        .arg(generator)
        .args([
            "gen",
            "--to",
            "10.10.3.2",
            "--qps",
            "8",
            "--rate",
            &format!("{mbit}mbit"),
            "--duration",
            &format!("{secs}s"),
            "--json",
        ])
        .output()?;
    ensure!(send.status.success(), "sender failed");
    let sent: Value = serde_json::from_slice(&send.stdout)?;
    let r: Value = serde_json::from_slice(&resp.wait_with_output()?.stdout)?;
    std::thread::sleep(Duration::from_millis(500));
    let cap_steady = match (&cap, cap0) {
        (Some(c), Some(c0)) => Some(proc_cpu(c.id())? - c0),
        _ => None,
    };
    let dump_steady = proc_cpu(dump.id())? - dump0;
    // The empty program has no process: no pid is charged as its.
    let charged = perf.finish(cap.as_ref().map_or(u32::MAX, |c| c.id()), dump.id())?;
    drop(empty);
    // SAFETY: signalling our own child.
    unsafe { libc::kill(dump.id() as i32, libc::SIGINT) };
    let (dump_cpu, _) = wait_cpu(dump)?;
    let mut dump_report = String::new();
    for l in derr.lines().map_while(Result::ok) {
        dump_report.push_str(&l);
        dump_report.push(' ');
    }
    let cap_cpu = match cap.take() {
        Some(c) => {
            let (cpu, status) = wait_cpu(c)?;
            ensure!(status == 0, "capture exited with status {status}");
            Some(cpu)
        }
        None => None,
    };

    let requests: u64 = sent["senders"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| q["packets"].as_u64().unwrap())
        .sum();
    let replies: u64 = r["responders"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| {
            q["acks_sent"].as_u64().unwrap()
                + q["naks_sent"].as_u64().unwrap()
                + q["cnps_sent"].as_u64().unwrap()
        })
        .sum();
    // The empty program counts nothing: its cost is per packet on the wire.
    let counted = if cap_cpu.is_some() {
        let summary: Value = std::fs::read_to_string(&json)?
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|v| v["type"] == "summary")
            .context("capture summary")?;
        summary["packets"].as_u64().unwrap_or(0)
    } else {
        requests + replies
    };
    let captured: u64 = dump_report
        .split(" packets captured")
        .next()
        .and_then(|s| s.split_whitespace().last())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    let per_m = |d: Duration, n: u64| d.as_secs_f64() / (n.max(1) as f64 / 1e6);
    println!(
        "-- capture cost on the lab, run {run}{which}: h1 -> h3, 8 QPs x {mbit} Mbit/s for {secs}s, both tools on h3 eth0 at once"
    );
    println!(
        "RoCE packets on the wire at h3: {} requests in + {} replies out = {}",
        requests,
        replies,
        requests + replies
    );
    match (cap_steady, cap_cpu) {
        (Some(steady), Some(whole)) => println!(
            "roce-trace capture: counted {counted}; process time while traffic ran {:.3}s (whole run incl. loading {:.3}s)",
            steady.as_secs_f64(),
            whole.as_secs_f64(),
        ),
        _ => println!(
            "an empty TC program at ingress and egress (tcx), no process: charged per packet on the wire"
        ),
    }
    println!(
        "tcpdump -w udp port 4791: captured {captured}; process time while traffic ran {:.3}s (whole run {:.3}s)",
        dump_steady.as_secs_f64(),
        dump_cpu.as_secs_f64(),
    );
    println!("tcpdump said: {}", dump_report.trim());
    let c = &charged;
    println!(
        "whole system, sampled ({} samples of every CPU at {} Hz while traffic ran; kernel work charged to the tool whose hook is on the stack):",
        c.samples, PERF_HZ
    );
    let who = if cap_cpu.is_some() {
        "roce-trace"
    } else {
        "empty TC"
    };
    println!(
        "  {who}: process {:.3}s + its hooks (BPF programs, their helpers, the TC hook entry) {:.3}s + veth's copy for XDP {:.3}s = {:.3}s = {:.3} CPU s per million packets",
        c.rt_process.as_secs_f64(),
        c.rt_bpf.as_secs_f64(),
        c.rt_veth_copy.as_secs_f64(),
        c.roce_trace().as_secs_f64(),
        per_m(c.roce_trace(), counted),
    );
    println!(
        "    its hooks' time by innermost frame: {}",
        top_frames(&c.rt_bpf_at, c.rt_bpf)
    );
    println!(
        "    its process time by innermost frame: {}",
        top_frames(&c.rt_process_at, c.rt_process)
    );
    println!(
        "  tcpdump:    process {:.3}s + packet socket (filter, copy to the ring, clones of sent packets) {:.3}s = {:.3}s = {:.3} CPU s per million packets",
        c.td_process.as_secs_f64(),
        c.td_kernel.as_secs_f64(),
        c.tcpdump().as_secs_f64(),
        per_m(c.tcpdump(), captured),
    );
    let ratio = per_m(c.roce_trace(), counted) / per_m(c.tcpdump(), captured);
    println!("ratio, whole system: {who} uses {ratio:.3} of tcpdump's CPU per packet");
    ensure!(
        counted == requests + replies,
        "roce-trace counted {counted}, the wire carried {}",
        requests + replies
    );
    // A ratio is only a ratio when both sides were measured: tcpdump saw every packet
    // (else its share is of fewer packets), and perf found roce-trace's programs on the
    // stack (else their kernel time was charged to nobody and the ratio flatters us).
    if captured != requests + replies {
        return Err(TcpdumpMissed {
            captured,
            wire: requests + replies,
        }
        .into());
    }
    ensure!(
        !c.rt_bpf.is_zero(),
        "perf found none of {who}'s kernel frames (BPF program symbols): its kernel time would be missing from the ratio"
    );
    Ok(CaptureCost {
        ratio,
        roce_trace: per_m(c.roce_trace(), counted),
        tcpdump: per_m(c.tcpdump(), captured),
    })
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64
}

/// The collector's join on one core: a synthetic fabric of many agents, each packet seen
/// at 8 points (host out, leaf in/out, spine in/out, leaf in/out, host in).
fn collector() -> anyhow::Result<()> {
    use roce_trace_common::datapath::REASON_HASH;
    use roce_trace_common::flow::{FlowId, PacketId};
    use roce_trace_correlate::{
        JoinConfig, Joiner, PointInfo,
        observation::{CounterDelta, Counts, Observation},
    };
    ensure!(
        !cfg!(debug_assertions),
        "build it optimised: cargo run --release -p xtask -- bench collector"
    );
    const AGENTS: u32 = 64;
    const FLOWS: u32 = 20_000;
    const PACKETS_PER_FLOW: u32 = 25;
    let mut j = Joiner::new(JoinConfig {
        trajectory_timeout_ns: 1_000_000_000,
        ..JoinConfig::default()
    });
    // 64 nodes with 4 points each: 16 hosts' NICs, 24 leaves, 24 spines in spirit.
    let points: Vec<u32> = (0..AGENTS)
        .flat_map(|n| (0..4).map(move |i| (n, i)))
        .map(|(n, i)| {
            j.point(PointInfo {
                node: format!("node{n}"),
                iface: format!("p{}", i / 2),
                direction: if i % 2 == 0 {
                    roce_trace_correlate::Direction::Ingress
                } else {
                    roce_trace_correlate::Direction::Egress
                },
                clock_synced: true,
                ..Default::default()
            })
        })
        .collect();
    // Observations in the order a collector receives them: agent batches interleaved.
    let mut obs: Vec<(u32, Observation)> = Vec::with_capacity((FLOWS * PACKETS_PER_FLOW * 8) as usize);
    // Each flow and the 8 points it crosses, for its counter deltas.
    let mut flow_points: Vec<(FlowId, Vec<u32>)> = Vec::with_capacity(FLOWS as usize);
    for f in 0..FLOWS {
        let flow = FlowId {
            src: [(f % 250) as u8; 16],
            dst: [(f / 250) as u8; 16],
            ip_version: 6,
            udp_sport: 49152 + (f % 4096) as u16,
            dest_qp: f,
        };
        // A path across 4 nodes (8 points), chosen by the flow.
        let a = (f * 7) % AGENTS;
        let nodes = [a, (a + 1) % AGENTS, (a + 2) % AGENTS, (a + 3) % AGENTS];
        flow_points.push((
            flow,
            nodes
                .iter()
                .flat_map(|n| [points[(n * 4) as usize], points[(n * 4 + 1) as usize]])
                .collect(),
        ));
        for p in 0..PACKETS_PER_FLOW {
            let id = PacketId {
                flow,
                psn: p * 977,
                opcode: 7,
                icrc: (f ^ p).to_le_bytes(),
            };
            for (hop, n) in nodes.iter().enumerate() {
                for dir in 0..2u32 {
                    let point = points[(n * 4 + dir) as usize];
                    let ttl = 64 - hop as u8 - (dir == 1 && hop > 0) as u8;
                    obs.push((
                        point,
                        Observation {
                            point: 0,
                            // A packet per flow every 100 ms; flows staggered.
                            time_ns: (p as u64) * 100_000_000
                                + f as u64 * 4_000
                                + hop as u64 * 2000
                                + dir as u64 * 500,
                            id,
                            udp_dport: 4791,
                            dscp: 26,
                            ecn: 2,
                            ttl,
                            reasons: REASON_HASH as u8,
                            ..Default::default()
                        },
                    ));
                }
            }
        }
    }
    // Arrival order: by the time a packet was seen, the way batches from many agents mix.
    obs.sort_by_key(|(_, o)| o.time_ns);
    let n = obs.len() as u64;
    let rss0 = rss_bytes();
    let heap0 = live_bytes();
    let started = std::time::Instant::now();
    for (i, (p, o)) in obs.iter().enumerate() {
        // Collector time advances with the stream; ticks complete trajectories as it goes.
        let now = o.time_ns;
        j.add(*p, o, now);
        if i % 4096 == 0 {
            j.tick(now);
        }
    }
    j.flush();
    let secs = started.elapsed().as_secs_f64();
    // The collector's next tick (nothing waits now: the peak's tables are given back),
    // and what the collector does when a tick says so: the allocator's free memory goes
    // back to the system.
    j.tick(obs.last().map_or(0, |(_, o)| o.time_ns) + 1);
    let rss_kept = rss_bytes();
    ensure!(
        j.gave_back() > 0,
        "the tick after the burst gives its tables back"
    );
    roce_trace::collector::release_freed_memory();
    let rss1 = rss_bytes();
    println!(
        "== collector join: {AGENTS} agents x 4 points, {FLOWS} flows, {PACKETS_PER_FLOW} packets each seen at 8 points, one core"
    );
    println!(
        "{n} observations in {secs:.3}s = {:.0} observations/s; {} trajectories, {} flows tracked",
        n as f64 / secs,
        j.stats.trajectories,
        j.flow_ids().len()
    );
    println!(
        "memory: {:.1} MiB more resident for {} flows = {:.0} bytes per tracked flow (trajectories complete; {:.0} before the collector hands the burst's freed memory back)",
        rss1.saturating_sub(rss0) as f64 / (1 << 20) as f64,
        FLOWS,
        rss1.saturating_sub(rss0) as f64 / FLOWS as f64,
        rss_kept.saturating_sub(rss0) as f64 / FLOWS as f64
    );
    println!(
        "heap: {:.0} bytes per tracked flow (live allocations, nothing pending)",
        (live_bytes() - heap0) as f64 / f64::from(FLOWS)
    );
    ensure!(
        j.stats.trajectories == (FLOWS * PACKETS_PER_FLOW) as u64,
        "every packet joined"
    );

    // Then a minute of counter deltas, one a second from every point of every flow: the
    // per-point totals and the delivery over time at each flow's last point fill up.
    const SECONDS: u64 = 64;
    let t0 = obs.last().map_or(0, |(_, o)| o.time_ns) + 1;
    let started = std::time::Instant::now();
    let mut deltas = 0u64;
    for s in 0..SECONDS {
        for (flow, pts) in &flow_points {
            for p in pts {
                let d = CounterDelta {
                    flow: *flow,
                    start_ns: t0 + s * 1_000_000_000,
                    end_ns: t0 + (s + 1) * 1_000_000_000,
                    counts: Counts {
                        packets: 120,
                        bytes: 120 * 1100,
                        ecn: [0, 0, 120, 0],
                        ..Default::default()
                    },
                    ..Default::default()
                };
                j.add_counters(*p, &d, t0 + s * 1_000_000_000);
                deltas += 1;
            }
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let rss2 = rss_bytes();
    let delivered = j
        .flow_ids()
        .first()
        .and_then(|id| j.flow_report(id))
        .map_or(0, |r| r.delivery.len());
    println!(
        "{deltas} counter deltas in {secs:.3}s = {:.0} deltas/s; memory with a minute of counters: {:.0} bytes per tracked flow ({delivered} delivery intervals kept), heap {:.0} bytes per flow",
        deltas as f64 / secs,
        rss2.saturating_sub(rss0) as f64 / FLOWS as f64,
        (live_bytes() - heap0) as f64 / f64::from(FLOWS)
    );
    ensure!(delivered == 64, "the last minute of delivery is kept");
    drop(j);

    join_with_reader(20_000)?;
    println!("== the collector over TCP and HTTP: two agents, 4 sampled packets per flow, views best of 3");
    for n in [10_000, 100_000, 1_000_000] {
        collector_views(n)?;
    }
    Ok(())
}

/// pcap ingest: `roce-trace capture -r` against `tshark -r` decoding RoCE, same file.
fn pcap_ingest(bin: &Path) -> anyhow::Result<()> {
    const FRAMES: u32 = 200_000;
    let dir = std::env::temp_dir().join(format!("roce-trace-bench-pcap-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("roce.pcap");
    // 8 QPs of RDMA WRITE MIDDLE, 256-byte payloads, a few CNPs and ACKs.
    let frames: Vec<Vec<u8>> = (0..FRAMES)
        .map(|i| {
            let qp = i % 8;
            match i % 50 {
                0 => RoceFrame {
                    opcode: 0x81,
                    dscp: 48,
                    dest_qp: 0x100 + 2 * qp,
                    ext: ext::cnp(),
                    ..Default::default()
                }
                .build(),
                1 => RoceFrame {
                    opcode: op::ACKNOWLEDGE,
                    psn: i,
                    dest_qp: 0x100 + 2 * qp,
                    ext: ext::aeth(0x1f, i),
                    ..Default::default()
                }
                .build(),
                _ => RoceFrame {
                    opcode: op::WRITE_MIDDLE,
                    udp_sport: 49152 + qp as u16,
                    dest_qp: 0x101 + 2 * qp,
                    psn: i / 8,
                    payload: vec![0; 256],
                    ..Default::default()
                }
                .build(),
            }
        })
        .collect();
    roce_trace_tests::write_pcap(&path, &frames);
    let size = std::fs::metadata(&path)?.len();
    let time = |cmd: &mut Command| -> anyhow::Result<f64> {
        let t = std::time::Instant::now();
        let out = cmd.stdout(Stdio::null()).stderr(Stdio::piped()).output()?;
        ensure!(
            out.status.success(),
            "{cmd:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(t.elapsed().as_secs_f64())
    };
    let ours = time(
        Command::new("taskset")
            .args(["-c", "0"])
            .arg(bin)
            .args(["capture", "-r"])
            .arg(&path)
            .args(["--json", "-w", "/dev/null"]),
    )?;
    let theirs = time(
        Command::new("taskset")
            .args(["-c", "0", "tshark", "-r"])
            .arg(&path)
            .args([
                "-d",
                "udp.port==4791,infiniband",
                "-T",
                "fields",
                "-e",
                "infiniband.bth.destqp",
                "-e",
                "infiniband.bth.psn",
            ]),
    )?;
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "== pcap ingest: {FRAMES} RoCEv2 frames ({:.0} MB), one core",
        size as f64 / 1e6
    );
    println!(
        "roce-trace capture -r (flows, 1-in-1000 samples, JSON): {ours:.2}s = {:.0} packets/s",
        FRAMES as f64 / ours
    );
    println!(
        "tshark -r, decoding RoCE fields:                        {theirs:.2}s = {:.0} packets/s",
        FRAMES as f64 / theirs
    );
    println!("roce-trace is {:.1}x faster", theirs / ours);
    Ok(())
}

/// An agent speaking the wire protocol (the collector's real TCP path), fed prepared
/// frames; it reads nothing back (the collector's ACKs go to the socket's buffer).
struct WireAgent {
    s: std::net::TcpStream,
    enc: roce_trace::protocol::Encoder,
}

impl WireAgent {
    fn connect(
        addr: std::net::SocketAddr,
        node: &str,
        point: roce_trace::observation::PointDecl,
    ) -> anyhow::Result<Self> {
        use roce_trace::protocol::{Frame, VERSION};
        let s = std::net::TcpStream::connect(addr)?;
        let mut a = Self {
            s,
            enc: Default::default(),
        };
        a.send(&Frame::Hello {
            version: VERSION,
            node: node.into(),
            token: "bench".into(),
            clock_synced: true,
        })?;
        a.send(&Frame::Points(vec![point]))?;
        Ok(a)
    }

    fn send(&mut self, f: &roce_trace::protocol::Frame) -> anyhow::Result<()> {
        use std::io::Write as _;
        self.s.write_all(&self.enc.encode(f)?)?;
        Ok(())
    }
}

/// GET `path`; the body's length and how long the whole answer took.
fn timed_get(addr: std::net::SocketAddr, path: &str) -> anyhow::Result<(usize, f64)> {
    use std::io::Write as _;
    let t = std::time::Instant::now();
    let mut s = std::net::TcpStream::connect(addr)?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n"
    )?;
    // As a client that pipes the answer on (curl, jq) reads it: counted, not kept.
    let (status, len) = roce_trace::http::read_answer_to(
        std::io::BufReader::with_capacity(1 << 16, s),
        &mut std::io::sink(),
    )?;
    let secs = t.elapsed().as_secs_f64();
    ensure!(status == 200, "{path}: {status}");
    Ok((len as usize, secs))
}

/// The collector as a service, over its real TCP and HTTP paths, in this process: two
/// agents (a sender's egress, a receiver's ingress) report `n` flows, 4 hash-sampled
/// packets each and one counter delta per point, as the issue's independent agents did;
/// then `/flows` and `/metrics` are timed (best of 3) and the resident memory per flow is
/// read.
/// A collector over TCP and HTTP on loopback, on a thread of its own, judging
/// `continuous` if given; its agents' and HTTP addresses, and how to stop it.
struct BenchCollector {
    agents: std::net::SocketAddr,
    http: std::net::SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<anyhow::Result<()>>>,
}

impl BenchCollector {
    fn start(continuous: Option<roce_trace::verdicts::ContinuousOptions>) -> anyhow::Result<Self> {
        use roce_trace::collector::{CollectorOptions, run};
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || -> anyhow::Result<()> {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(run(
                CollectorOptions {
                    listen: "127.0.0.1:0".parse()?,
                    http: Some("127.0.0.1:0".parse()?),
                    token: "bench".into(),
                    report: None,
                    tls: None,
                    agent_timeout: roce_trace::collector::AGENT_TIMEOUT,
                    report_every: Duration::ZERO,
                    join: roce_trace_correlate::JoinConfig {
                        max_flows: 2_000_000,
                        max_pending: 10_000_000,
                        ..Default::default()
                    },
                    live: false,
                    trace: false,
                    interval: Duration::from_secs(2),
                    fleet: None,
                    continuous,
                    http_token: None,
                },
                async {
                    let _ = stop_rx.await;
                },
                move |a, h| {
                    let _ = addr_tx.send((a, h.expect("http")));
                },
            ))?;
            Ok(())
        });
        let (agents, http) = addr_rx.recv_timeout(Duration::from_secs(10))?;
        Ok(Self {
            agents,
            http,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    fn stop(mut self) -> anyhow::Result<()> {
        let _ = self.stop.take().expect("running").send(());
        self.thread
            .take()
            .expect("running")
            .join()
            .map_err(|_| anyhow::anyhow!("collector thread panicked"))?
    }
}

/// Two agents (a sender's egress, a receiver's ingress) feeding `n` flows of 4 sampled
/// packets at a time, and their counters.
struct BenchFeed {
    out: WireAgent,
    inn: WireAgent,
    n: u32,
}

impl BenchFeed {
    fn connect(agents: std::net::SocketAddr, n: u32) -> anyhow::Result<Self> {
        use roce_trace::observation::PointDecl;
        let decl = |direction| PointDecl {
            index: 0,
            node: String::new(),
            iface: "eth0".into(),
            ifindex: 2,
            direction,
            mtu: 4200,
        };
        Ok(Self {
            out: WireAgent::connect(agents, "sender", decl(1))?,
            inn: WireAgent::connect(agents, "receiver", decl(0))?,
            n,
        })
    }

    fn flow(i: u32) -> roce_trace_common::flow::FlowId {
        let mut src = [0u8; 16];
        src[..4].copy_from_slice(&(i / 16).to_be_bytes());
        let mut dst = src;
        dst[15] = 1;
        roce_trace_common::flow::FlowId {
            src,
            dst,
            ip_version: 6,
            udp_sport: 49152 + (i % 16) as u16,
            dest_qp: i & 0xff_ffff,
        }
    }

    /// Round `round` (0, 1, …): PSNs 4·round … 4·round+3 of every flow at both points, a
    /// second of time later than the round before, and each flow's counters for that
    /// second.
    fn round(&mut self, round: u32) -> anyhow::Result<()> {
        use roce_trace::{
            observation::{CounterDelta, Counts, Observation},
            protocol::{Frame, MAX_BATCH},
        };
        use roce_trace_common::{datapath::REASON_HASH, flow::PacketId};
        let n = self.n;
        let base_ns = 1_000_000_000 * (1 + u64::from(round));
        let mut batch = (Vec::new(), Vec::new());
        for i in 0..n {
            for k in 0..4u32 {
                let psn = 4 * round + k;
                let o = Observation {
                    point: 0,
                    time_ns: base_ns + u64::from(i) * 100 + u64::from(k) * 10,
                    id: PacketId {
                        flow: Self::flow(i),
                        psn,
                        opcode: 7,
                        icrc: (i ^ psn).to_le_bytes(),
                    },
                    udp_dport: 4791,
                    frame_len: 1100,
                    dscp: 26,
                    ecn: 2,
                    ttl: 64,
                    reasons: REASON_HASH as u8,
                    ..Default::default()
                };
                batch.0.push(o);
                batch.1.push(Observation {
                    ttl: 63,
                    time_ns: o.time_ns + 2000,
                    ..o
                });
            }
            if batch.0.len() >= MAX_BATCH - 4 || i + 1 == n {
                self.out
                    .send(&Frame::Observations(std::mem::take(&mut batch.0)))?;
                self.inn
                    .send(&Frame::Observations(std::mem::take(&mut batch.1)))?;
            }
        }
        for chunk in (0..n).collect::<Vec<_>>().chunks(MAX_BATCH) {
            for (a, ttl) in [(&mut self.out, 64), (&mut self.inn, 63)] {
                let deltas = chunk
                    .iter()
                    .map(|&i| CounterDelta {
                        point: 0,
                        flow: Self::flow(i),
                        start_ns: base_ns,
                        end_ns: base_ns + 1_000_000_000,
                        counts: Counts {
                            packets: 1000,
                            bytes: 1_100_000,
                            ecn: [0, 0, 1000, 0],
                            ..Default::default()
                        },
                        last_dscp: 26,
                        last_pcp: 0xff,
                        last_ttl: ttl,
                    })
                    .collect();
                a.send(&Frame::Counters(deltas))?;
            }
        }
        Ok(())
    }
}

/// Waits until the collector at `http` took `rounds` rounds of `n` flows (every
/// observation in, nothing pending, twice in a row: the pending count is the last
/// tick's, 200 ms at most); its `/stats`.
fn settled(http: std::net::SocketAddr, n: u32, rounds: u32) -> anyhow::Result<Value> {
    let want = u64::from(n) * 8 * u64::from(rounds);
    let deadline = std::time::Instant::now() + Duration::from_secs(600);
    let mut settled = 0;
    loop {
        let v: Value = roce_trace::http::get_json(http, "/stats")?;
        settled = if v["observations"].as_u64() == Some(want) && v["pending"].as_u64() == Some(0) {
            settled + 1
        } else {
            0
        };
        if settled == 2 {
            ensure!(
                v["flows"].as_u64() == Some(u64::from(n)),
                "every flow tracked: {v}"
            );
            ensure!(
                v["trajectories"].as_u64() == Some(u64::from(n) * 4 * u64::from(rounds)),
                "every packet joined once, at both points: {v}"
            );
            return Ok(v);
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "the collector did not take it all: {v}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn collector_views(n: u32) -> anyhow::Result<()> {
    // What earlier runs freed goes back to the system first: the collector hands freed
    // memory back after a burst, which would otherwise count against this run.
    roce_trace::collector::release_freed_memory();
    let rss0 = rss_bytes();
    let heap0 = live_bytes();
    let c = BenchCollector::start(None)?;
    let http = c.http;
    let mut feed = BenchFeed::connect(c.agents, n)?;
    let t_feed = std::time::Instant::now();
    feed.round(0)?;
    // Everything is in once the stats say so; trajectories complete a timeout later.
    settled(http, n, 1)?;
    let fed = t_feed.elapsed().as_secs_f64();
    let (rss, heap) = (rss_bytes(), live_bytes());
    let best = |path: &str| -> anyhow::Result<(usize, f64)> {
        let mut v = Vec::new();
        for _ in 0..3 {
            v.push(timed_get(http, path)?);
        }
        Ok(v.into_iter().min_by(|a, b| a.1.total_cmp(&b.1)).expect("three"))
    };
    let (flows_len, flows_s) = best("/flows")?;
    let (metrics_len, metrics_s) = best("/metrics")?;
    let (_, one_s) = best(&format!(
        "/flow?id={}",
        roce_trace::http::percent_encode(&BenchFeed::flow(n / 2).to_string())
    ))?;
    // The web view's map: built from the whole report once, then served again for a
    // while to every browser that refreshes.
    let (ui_len, ui_s) = timed_get(http, "/ui/main")?;
    let (_, ui_again_s) = timed_get(http, "/ui/main")?;
    println!(
        "{n:>8} flows: fed and joined in {fed:.1}s; /flows {flows_s:.3}s ({:.2} µs/flow, {:.0} MB); /metrics {:.2} ms ({metrics_len} B); /flow?id= {:.2} ms; /ui/main {:.3}s built ({:.1} KB), {:.2} ms again; per flow {:.0} bytes of heap, {:.0} resident",
        flows_s * 1e6 / f64::from(n),
        flows_len as f64 / 1e6,
        metrics_s * 1e3,
        one_s * 1e3,
        ui_s,
        ui_len as f64 / 1e3,
        ui_again_s * 1e3,
        (heap - heap0) as f64 / f64::from(n),
        rss.saturating_sub(rss0) as f64 / f64::from(n),
    );
    drop(feed);
    c.stop()
}

/// Continuous verification's cost at `n` flows: the same collector without and with
/// `--policy` (the shipped policy, judged every second over 2 s), side by side. Each
/// fills `n` flows, then takes `rounds` more rounds of every flow's packets and counters
/// (a second of traffic each) as fast as it joins them: the join's throughput while the
/// judge runs, the windows judged, the last judgement's time and the most memory held.
fn collector_verify(n: u32, rounds: u32) -> anyhow::Result<()> {
    let policy = roce_trace::local::load_policy(Path::new("dist/fabric-policy.toml"))?;
    let dir = std::env::temp_dir().join(format!("roce-trace-bench-verify-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let mut rows = Vec::new();
    // Three runs of each, alternating; the median run of each is printed.
    for judge in [false, true, false, true, false, true] {
        roce_trace::collector::release_freed_memory();
        let rss0 = rss_bytes();
        let continuous = judge.then(|| roce_trace::verdicts::ContinuousOptions {
            policy: policy.clone(),
            policy_name: "dist/fabric-policy.toml".into(),
            every: Duration::from_secs(1),
            window: Duration::from_secs(2),
            fail_after: 2,
            load: roce_trace::verify::checks::Load::Idle,
            history: dir.join(format!("verdicts-{n}.jsonl")),
            history_max: 1000,
            alert_url: None,
        });
        let _ = std::fs::remove_file(dir.join(format!("verdicts-{n}.jsonl")));
        let c = BenchCollector::start(continuous)?;
        let mut feed = BenchFeed::connect(c.agents, n)?;
        feed.round(0)?;
        settled(c.http, n, 1)?;
        let mut peak = rss_bytes();
        let t = std::time::Instant::now();
        for r in 1..=rounds {
            feed.round(r)?;
            peak = peak.max(rss_bytes());
        }
        settled(c.http, n, rounds + 1)?;
        let took = t.elapsed().as_secs_f64();
        peak = peak.max(rss_bytes());
        let m = String::from_utf8(roce_trace::http::get(c.http, "/metrics", Duration::from_secs(30))?.1)?;
        let metric = |name: &str| -> u64 {
            m.lines()
                .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0)
        };
        let windows = metric("roce_trace_verify_windows_total");
        if judge {
            ensure!(
                windows > 0,
                "no window judged while the traffic ran:
{m}"
            );
        }
        let obs = f64::from(n) * 8.0 * f64::from(rounds);
        rows.push((
            judge,
            obs / took,
            took,
            windows,
            metric("roce_trace_verify_judge_microseconds"),
            metric("roce_trace_verify_windows_skipped_total{reason=\"busy\"}"),
            peak.saturating_sub(rss0),
        ));
        drop(feed);
        c.stop()?;
    }
    let median = |judge: bool| {
        let mut of: Vec<_> = rows.iter().filter(|r| r.0 == judge).cloned().collect();
        of.sort_by(|a, b| a.1.total_cmp(&b.1));
        let rates: Vec<String> = of.iter().map(|r| format!("{:.2}", r.1 / 1e6)).collect();
        (of[of.len() / 2], rates.join(", "))
    };
    let (without, _) = median(false);
    let base = without.1;
    for judge in [false, true] {
        let ((judge, rate, took, windows, judge_us, busy, mem), all) = median(judge);
        println!("{n:>8} flows, M observations/s of the three runs: {all}");
        println!(
            "{n:>8} flows, {}: {rounds} s of traffic joined in {took:.1} s, {:.2} M observations/s ({:+.1}% of without, median run); windows judged {windows}, skipped busy {busy}, last judgement {:.0} ms; most memory {:.0} MB over the start",
            if judge {
                "judging every 1 s over 2 s"
            } else {
                "no --policy             "
            },
            rate / 1e6,
            (rate / base - 1.0) * 100.0,
            judge_us as f64 / 1e3,
            mem as f64 / 1e6,
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// The join's throughput alone and while a reader builds every flow's report (what
/// `/flows` does) once a second from a snapshot, the ingest holding the same lock the
/// collector's agent connections take per frame: observations fed in frames of
/// `MAX_BATCH`, in time order and then out of it.
fn join_with_reader(flows: u32) -> anyhow::Result<()> {
    use parking_lot::Mutex;
    use roce_trace_common::{
        datapath::REASON_HASH,
        flow::{FlowId, PacketId},
    };
    use roce_trace_correlate::{Direction, JoinConfig, Joiner, PointInfo, observation::Observation};
    use std::sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    };
    const PACKETS: u32 = 50;
    let build = || {
        let mut j = Joiner::new(JoinConfig {
            trajectory_timeout_ns: 1_000_000_000,
            ..Default::default()
        });
        let pts: Vec<u32> = (0..8)
            .map(|i| {
                j.point(PointInfo {
                    node: format!("n{}", i / 2),
                    iface: "p".into(),
                    direction: if i % 2 == 0 {
                        Direction::Egress
                    } else {
                        Direction::Ingress
                    },
                    clock_synced: true,
                    ..Default::default()
                })
            })
            .collect();
        (j, pts)
    };
    let (_, pts) = build();
    // Frames as agents send them: each agent's observations of one interval together.
    let mut obs: Vec<(u32, Observation)> = Vec::with_capacity((flows * PACKETS * 8) as usize);
    for p in 0..PACKETS {
        for f in 0..flows {
            let mut src = [0u8; 16];
            src[..4].copy_from_slice(&f.to_be_bytes());
            let flow = FlowId {
                src,
                dst: [9; 16],
                ip_version: 6,
                udp_sport: 49152,
                dest_qp: f & 0xff_ffff,
            };
            let id = PacketId {
                flow,
                psn: p,
                opcode: 7,
                icrc: (f ^ p).to_le_bytes(),
            };
            for (k, &pt) in pts.iter().enumerate() {
                obs.push((
                    pt,
                    Observation {
                        time_ns: u64::from(p) * 100_000_000 + u64::from(f) * 40 + k as u64 * 5,
                        id,
                        udp_dport: 4791,
                        dscp: 26,
                        ecn: 2,
                        ttl: 64 - (k as u8).div_ceil(2),
                        reasons: REASON_HASH as u8,
                        ..Default::default()
                    },
                ));
            }
        }
    }
    obs.sort_by_key(|(_, o)| o.time_ns);
    // Out of time order: each point's agent delivers its frames up to 0.8 s late, by a
    // delay of its own, so frames of one packet arrive far apart and interleaved.
    let mut late = obs.clone();
    late.sort_by_key(|(p, o)| o.time_ns + u64::from(*p) * 100_000_000);
    let total = obs.len() as u64;
    let feed =
        |stream: &[(u32, Observation)], reader: bool| -> anyhow::Result<(f64, u64, u64, f64, u64, f64)> {
            let (j, _) = build();
            let j = Arc::new(Mutex::new(j));
            let done = Arc::new(AtomicBool::new(false));
            let poller = reader.then(|| {
                let (j, done) = (j.clone(), done.clone());
                std::thread::spawn(move || {
                    let (mut reads, mut busy) = (0u64, Duration::ZERO);
                    while !done.load(Ordering::Relaxed) {
                        let t = std::time::Instant::now();
                        // As `/flows` reads: a chunk of flows under the lock at a time.
                        let (mut bytes, mut cursor) = (0, None);
                        loop {
                            let (ids, view) = j.lock().chunk_view(cursor.as_ref(), 1024);
                            let Some(last) = ids.last() else { break };
                            cursor = Some(*last);
                            // The chunk's reports built, the view let go of, then written
                            // out.
                            let reports: Vec<_> = {
                                let view = view.view();
                                ids.iter().filter_map(|id| view.flow_report(id)).collect()
                            };
                            for r in &reports {
                                bytes += serde_json::to_vec_pretty(r).map_or(0, |v| v.len());
                            }
                        }
                        std::hint::black_box(bytes);
                        reads += 1;
                        busy += t.elapsed();
                        while t.elapsed() < Duration::from_secs(1) && !done.load(Ordering::Relaxed) {
                            std::thread::sleep(Duration::from_millis(10));
                        }
                    }
                    (reads, busy)
                })
            });
            let t = std::time::Instant::now();
            // How long the join waited for the lock the reader takes its snapshots under.
            let mut waited = Duration::ZERO;
            for (k, frame) in stream.chunks(roce_trace::protocol::MAX_BATCH).enumerate() {
                let w = std::time::Instant::now();
                let mut j = j.lock();
                waited += w.elapsed();
                let now = frame[0].1.time_ns;
                for (p, o) in frame {
                    j.add(*p, o, now);
                }
                if k % 4 == 0 {
                    j.tick(now);
                }
            }
            let (trajectories, copies) = {
                let mut j = j.lock();
                j.flush();
                (j.stats.trajectories, j.copied_for_views())
            };
            let secs = t.elapsed().as_secs_f64();
            done.store(true, Ordering::Relaxed);
            let (reads, busy) = poller
                .map_or(Ok((0, Duration::ZERO)), |p| p.join())
                .map_err(|_| anyhow::anyhow!("reader panicked"))?;
            Ok((
                secs,
                trajectories,
                reads,
                waited.as_secs_f64(),
                copies,
                busy.as_secs_f64(),
            ))
        };
    println!(
        "== the join while a reader builds every report once a second as /flows does (1024 flows under the lock at a time): {flows} flows, {PACKETS} packets each at 8 points, {total} observations"
    );
    // Undisturbed and disturbed runs in adjacent pairs, which one goes first alternating:
    // this VM's speed drifts by up to 1.5× over a minute, so each pair is compared within
    // itself and the pairs' median is the figure (every pair is printed).
    const PAIRS: usize = 9;
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    for (name, stream) in [("in time order", &obs), ("out of time order", &late)] {
        let (mut alone, mut with, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        let (mut reads, mut waited, mut copies, mut busy) = (0u64, 0f64, 0u64, 0f64);
        for pair in 0..PAIRS {
            let mut rate = [0f64; 2];
            for reader in [pair % 2 == 1, pair % 2 == 0] {
                let (secs, trajectories, r, w, c, b) = feed(stream, reader)?;
                ensure!(
                    trajectories == u64::from(flows * PACKETS),
                    "{name}: every packet joined ({trajectories})"
                );
                rate[usize::from(reader)] = total as f64 / secs;
                reads += r;
                waited = waited.max(w);
                copies += c;
                busy += b;
            }
            alone.push(rate[0]);
            with.push(rate[1]);
            ratios.push(100.0 * rate[1] / rate[0]);
        }
        let each: Vec<String> = ratios.iter().map(|r| format!("{r:.0}")).collect();
        println!(
            "{name:>18}: alone {:.0} observations/s; with the reader {:.0} observations/s; {:.0} % (median of {PAIRS} adjacent pairs: {} %; {reads} full reads of {:.0} ms each, the join waited at most {:.1} ms in all for the lock and copied {copies} flows a reader held); every packet joined",
            median(&mut alone),
            median(&mut with),
            median(&mut ratios),
            each.join(", "),
            busy * 1e3 / reads.max(1) as f64,
            waited * 1e3
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run tcpdump missed packets in is run again, at most `attempts` times in all; any
    /// other failure (roce-trace miscounting, perf missing our frames) is not retried.
    #[test]
    fn only_a_run_tcpdump_missed_packets_in_is_run_again() {
        let missed = || -> anyhow::Result<u32> {
            Err(TcpdumpMissed {
                captured: 9,
                wire: 10,
            }
            .into())
        };
        // Missed twice, then both counted: the third attempt's figures.
        let mut tries = Vec::new();
        let r = again_if_tcpdump_missed(3, |a| {
            tries.push(a);
            if a < 3 { missed() } else { Ok(a) }
        });
        assert_eq!(r.unwrap(), 3);
        assert_eq!(tries, [1, 2, 3]);
        // Missed every time: the error stands after the last attempt.
        let mut n = 0;
        let e = again_if_tcpdump_missed(3, |_| {
            n += 1;
            missed()
        })
        .unwrap_err();
        assert_eq!(n, 3);
        assert!(e.downcast_ref::<TcpdumpMissed>().is_some(), "{e:#}");
        // Any other error is final at once.
        let mut n = 0;
        let e = again_if_tcpdump_missed(3, |_| -> anyhow::Result<u32> {
            n += 1;
            anyhow::bail!("roce-trace counted 9, the wire carried 10")
        })
        .unwrap_err();
        assert_eq!(n, 1);
        assert!(e.to_string().contains("roce-trace counted"));
    }

    #[test]
    fn samples_are_charged_by_hook_then_by_process() {
        let script = "\
 100     200000 \n\tffffffff81 lookup_nulls_elem_raw\n\tffffffffa0 bpf_prog_1d9b1231156af7b6_roce_xdp\n\tffffffff82 veth_xdp_rcv_skb\n\n\
 100     200000 \n\tffffffff81 memcpy\n\tffffffff83 skb_pp_cow_data\n\tffffffff82 veth_xdp_rcv_skb\n\n\
 7     200000 \n\tffffffff84 skb_copy_bits\n\tffffffff85 tpacket_rcv\n\tffffffff86 __netif_receive_skb_core\n\n\
 42     300000 \n\t    55 main\n\n\
 7     100000 \n\tffffffff87 do_sys_poll\n\n\
 8     200000 \n\tffffffff88 bpf_prog_aa_roce_tc_in\n\tffffffff89 dev_queue_xmit_nit\n\n\
 5     100000 \n\tffffffff91 sch_handle_ingress\n\tffffffff92 __netif_receive_skb_core\n\n\
 9     200000 \n\tffffffff90 ip_forward\n";
        let c = charge(script, 42, 7);
        assert_eq!(c.samples, 8);
        assert_eq!(c.rt_bpf, Duration::from_micros(500));
        assert_eq!(c.rt_veth_copy, Duration::from_micros(200));
        assert_eq!(c.rt_process, Duration::from_micros(300));
        assert_eq!(c.td_kernel, Duration::from_micros(200));
        assert_eq!(c.td_process, Duration::from_micros(100));
        assert_eq!(c.roce_trace(), Duration::from_micros(1000));
        assert_eq!(c.tcpdump(), Duration::from_micros(300));
        let at: Vec<(&str, u128)> = c
            .rt_bpf_at
            .iter()
            .map(|(s, d)| (s.as_str(), d.as_micros()))
            .collect();
        assert_eq!(
            at,
            [
                ("lookup_nulls_elem_raw", 200),
                ("program roce_tc_in", 200),
                ("sch_handle_ingress", 100)
            ]
        );
    }

    /// The floor runs: the empty TC program is charged by the rule roce-trace's programs
    /// are, and with no process to charge (`u32::MAX`), idle samples (pid 0) go to nobody.
    #[test]
    fn the_floors_empty_program_is_charged_like_the_datapath() {
        let script = "\
 0     200000 \n\tffffffffa0 bpf_prog_1d9b1231156af7b6_rt_empty_tc\n\tffffffff92 __netif_receive_skb_core\n\n\
 0     100000 \n\tffffffff87 default_idle\n\n\
 7     100000 \n\tffffffff85 tpacket_rcv\n";
        let c = charge(script, u32::MAX, 7);
        assert_eq!(c.samples, 3);
        assert_eq!(c.rt_bpf, Duration::from_micros(200));
        assert_eq!(c.rt_process, Duration::ZERO);
        assert_eq!(c.td_kernel, Duration::from_micros(100));
        let at: Vec<&str> = c.rt_bpf_at.keys().map(String::as_str).collect();
        assert_eq!(at, ["program rt_empty_tc"]);
    }
}
