//! Differential: the kernel programs (the real eBPF object under BPF_PROG_TEST_RUN: XDP,
//! TC ingress, TC egress) against the host pipeline (`pcap::Offline`, the shared parser
//! on a byte slice) on the same frame. Both must reach the same outcome — RoCEv2 or the
//! same skip reason, mirrored or not, sampled or not — and the same sample: flow key,
//! BTH and extended-header fields, class, tags, ICRC, mirror session, reasons and the
//! leading bytes. Needs root (CAP_BPF, CAP_NET_ADMIN).
//!
//! Inputs are raw bytes, or frames built by the product's builder (see common/mod.rs),
//! cut short and patched here and there to reach every skip reason.
#![no_main]

#[path = "common/mod.rs"]
mod common;

use std::cell::RefCell;

use arbitrary::Unstructured;
use libfuzzer_sys::fuzz_target;
use roce_trace::{
    datapath::{DatapathOptions, GlobalTotals},
    pcap::{CapturedFrame, Offline},
};
use roce_trace_common::{
    datapath::*,
    parse::{
        INNER_HEAD_LEN, Look, Parsed, SlicePacket, first_look, parse, parse_into, parse_plain_v4_into,
        surely_not_roce,
    },
    wire::ROCEV2_UDP_PORT,
};
use roce_trace_tests::{ProgTest, TC_ACT_UNSPEC, XDP_PASS};

/// BPF_PROG_TEST_RUN takes at least an Ethernet header and at most about a page (less
/// headroom and skb_shared_info) of linear data.
const MIN_LEN: usize = 14;
const MAX_LEN: usize = 3000;

fn options() -> DatapathOptions {
    DatapathOptions {
        // 1 in 2 by hash, so hash decisions are compared too; DSCPs other than these are
        // always reported, so most fuzzed frames yield a sample to compare.
        sample_rate: 2,
        seed: 7,
        expected_dscp: vec![26, 48],
        ..Default::default()
    }
}

struct Kernel {
    t: ProgTest,
    last: GlobalTotals,
}

thread_local! {
    static KERNEL: RefCell<Option<Kernel>> = const { RefCell::new(None) };
}

/// A sample as both sides must agree on: fields valid per the `present` bits, the
/// observation point (interface, direction) and the time left out.
#[derive(Debug, PartialEq, Eq)]
struct Seen {
    key: FlowKey,
    psn: u32,
    frame_len: u32,
    opcode: u8,
    flags: (u8, u8, u8),
    pkey: u16,
    udp: (u16, u16),
    class: (u8, u8, u8),
    pcp: Option<u8>,
    vlan_depth: u8,
    l3_off: u16,
    present: u8,
    aeth: Option<(u8, u32)>,
    reth: Option<u32>,
    deth: Option<u32>,
    icrc: Option<[u8; 4]>,
    mirror: Option<MirrorInfo>,
    reasons: u32,
    head: Vec<u8>,
}

fn seen(s: &Sample) -> Seen {
    let has = |bit: u8| s.present & bit != 0;
    Seen {
        key: FlowKey {
            ifindex: 0,
            direction: 0,
            ..s.key
        },
        psn: s.psn,
        frame_len: s.frame_len,
        opcode: s.opcode,
        flags: (s.bth_flags, s.bth_fecn_becn, s.bth_ack_req),
        pkey: s.pkey,
        udp: (s.udp_dport, s.udp_len),
        class: (s.dscp, s.ecn, s.ttl),
        pcp: has(HAS_PCP).then_some(s.pcp),
        vlan_depth: s.vlan_depth,
        l3_off: s.l3_off,
        present: s.present,
        aeth: has(HAS_AETH).then_some((s.aeth_syndrome, s.aeth_msn)),
        reth: has(HAS_RETH).then_some(s.reth_dma_len),
        deth: has(HAS_DETH).then_some(s.deth_src_qp),
        icrc: has(HAS_ICRC).then_some(s.icrc),
        mirror: has(HAS_MIRROR).then_some(s.mirror),
        reasons: s.reasons,
        head: s.head[..s.head_len as usize].to_vec(),
    }
}

/// What became of one frame at one hook: the counters it moved (one outcome, and
/// `Mirrored` / `SamplesEmitted` with it) and its sample.
#[derive(Debug, PartialEq, Eq)]
struct Outcome {
    counters: Vec<(&'static str, u64)>,
    samples: Vec<Seen>,
}

/// Counters compared: every outcome and what goes with it. `PsnRegressions` depends on the
/// flow's history, which the kernel keeps across inputs (and per CPU).
fn moved(before: &GlobalTotals, after: &GlobalTotals, dir: u8) -> Vec<(&'static str, u64)> {
    GlobalCounter::OUTCOMES
        .iter()
        .chain(&[GlobalCounter::Mirrored, GlobalCounter::SamplesEmitted])
        .filter_map(|&c| {
            let d = after.get(c, dir) - before.get(c, dir);
            (d != 0).then_some((c.name(), d))
        })
        .collect()
}

fn host(frame: &[u8]) -> Outcome {
    let mut off = Offline::new(&options()).expect("valid options");
    let mut samples = Vec::new();
    off.frame(
        &CapturedFrame {
            time_ns: 1,
            data: frame.to_vec(),
            orig_len: frame.len() as u32,
        },
        |s| samples.push(seen(s)),
    );
    // The kernel counts no non-RoCE frame (the interface's counters have them); the host
    // pipeline does, and the target checks that apart (`fuzz_target!` below).
    let counters = moved(&GlobalTotals::default(), &off.globals, DIR_INGRESS)
        .into_iter()
        .filter(|(c, _)| *c != GlobalCounter::NonRoce.name())
        .collect();
    Outcome { counters, samples }
}

fn kernel(k: &mut Kernel, frame: &[u8], hook: usize) -> Outcome {
    let (verdict, pass, dir) = match hook {
        0 => (k.t.run_xdp(frame), XDP_PASS, DIR_INGRESS),
        1 => (k.t.run_tc_in(frame), TC_ACT_UNSPEC, DIR_INGRESS),
        _ => (k.t.run_tc(frame), TC_ACT_UNSPEC, DIR_EGRESS),
    };
    assert_eq!(verdict, pass, "every packet passes");
    let now = k.t.globals();
    let counters = moved(&k.last, &now, dir);
    k.last = now;
    let samples: Vec<Seen> =
        k.t.samples()
            .iter()
            .inspect(|s| assert_eq!(s.key.direction, dir, "sample direction"))
            .map(seen)
            .collect();
    Outcome { counters, samples }
}

/// Whether BPF_PROG_TEST_RUN takes `frame` for a TC program: it refuses (EINVAL) an skb
/// whose EtherType is IPv4 or IPv6 when the frame is shorter than that IP header (6.x).
/// A limit of the test harness in the kernel, not of the programs: such frames go through
/// XDP only.
fn tc_takes(frame: &[u8]) -> bool {
    match u16::from_be_bytes([frame[12], frame[13]]) {
        0x0800 => frame.len() >= 14 + 20,
        0x86dd => frame.len() >= 14 + 40,
        _ => true,
    }
}

/// The frame the input describes.
fn frame(data: &[u8]) -> Option<Vec<u8>> {
    let (&mode, rest) = data.split_first()?;
    if mode % 3 == 0 {
        return Some(rest.to_vec());
    }
    let mut u = Unstructured::new(rest);
    let mut f = common::roce_frame(&mut u).ok()?.frame;
    if mode % 3 == 2 {
        // Cut short, and a few bytes changed: every header's edge cases near valid frames.
        if u.ratio(1, 2).ok()? {
            let n = u.int_in_range(0..=f.len()).ok()?;
            f.truncate(n);
        }
        for _ in 0..u.int_in_range(0..=4).ok()? {
            let at = u.int_in_range(0..=f.len().saturating_sub(1)).ok()?;
            if let Some(b) = f.get_mut(at) {
                *b = u.arbitrary().ok()?;
            }
        }
    }
    Some(f)
}

fuzz_target!(|data: &[u8]| {
    let Some(f) = frame(data) else {
        return;
    };
    if !(MIN_LEN..=MAX_LEN).contains(&f.len()) {
        return;
    }
    let want = host(&f);
    // The kernel's first test lets by only what the parser calls non-RoCE: never a
    // RoCEv2 packet, a mirrored copy or a frame whose failure is counted.
    if surely_not_roce(&SlicePacket::new(&f), ROCEV2_UDP_PORT) {
        assert_eq!(
            parse(&SlicePacket::new(&f), ROCEV2_UDP_PORT),
            Err(GlobalCounter::NonRoce),
            "surely_not_roce let by a frame the parser does not call non-RoCE"
        );
        assert!(want.counters.is_empty() && want.samples.is_empty(), "{want:?}");
    }
    // The short way the kernel takes for plain IPv4 gives the parser's every field.
    if first_look(&SlicePacket::new(&f), ROCEV2_UDP_PORT) == Look::PlainV4 {
        let pkt = SlicePacket::new(&f);
        let (mut a, mut b) = (Parsed::default(), Parsed::default());
        let mut inner = [0u8; INNER_HEAD_LEN];
        let ra = parse_into(&pkt, ROCEV2_UDP_PORT, &mut a, &mut inner);
        let rb = parse_plain_v4_into(&pkt, ROCEV2_UDP_PORT, &mut b);
        assert_eq!(ra, rb);
        if ra.is_ok() {
            assert_eq!(a, b);
        }
    }
    KERNEL.with_borrow_mut(|k| {
        let k = k.get_or_insert_with(|| {
            let mut t = ProgTest::new(&options());
            let _ = t.samples();
            let last = t.globals();
            Kernel { t, last }
        });
        let hooks = if tc_takes(&f) { 3 } else { 1 };
        for (hook, name) in ["XDP", "TC ingress", "TC egress"].iter().enumerate().take(hooks) {
            let got = kernel(k, &f, hook);
            assert!(
                got == want,
                "{name} disagrees with the host parser\nkernel: {got:?}\nhost:   {want:?}"
            );
        }
    });
});
