//! roce-trace datapath: XDP (or TC) on ingress, TC on egress, one parser (`roce_trace_common::parse`)
//! for both. Counts every RoCEv2 packet per flow, samples consistently, reports anomalies.
//! Every path returns pass; no packet is written.
#![no_std]
#![no_main]
// Inline asm keeps the bounds of helper lengths visible to the verifier (ctx.rs).
#![feature(asm_experimental_arch)]

/// `if $a != $b { $rare }` with the common case, `$a == $b`, falling through: a jump to
/// `$rare` out of line. The BPF backend does not analyse conditional branches, so it
/// cannot turn one around: LLVM's `cold_path` does not take a rare block out of the
/// common packet's way, and the common packet may be the one that jumps. A taken branch
/// costs a cold predictor a misprediction, and at light load every packet meets one.
macro_rules! rare_if_ne {
    ($a:expr, $b:expr, $rare:block) => {
        // SAFETY: a compare and a jump to the label block; no memory, no stack.
        unsafe {
            core::arch::asm!(
                "if {a} != {b} goto {rare}",
                a = in(reg) ($a) as u64,
                b = in(reg) ($b) as u64,
                rare = label $rare,
                options(nostack),
            )
        }
    };
}
pub(crate) use rare_if_ne;

/// `if` the packet `$pkt` ([`ctx::Span`]) holds fewer than `$len` bytes `{ $rare }`, the
/// common case (it holds them) falling through, as [`rare_if_ne!`] (written as an `if`,
/// the common case jumped over the jump to the rare block).
macro_rules! rare_if_short {
    ($pkt:expr, $len:expr, $rare:block) => {
        // SAFETY: a compare of a packet pointer with the packet's end and a jump to the
        // label block; no memory, no stack.
        unsafe {
            core::arch::asm!(
                "if {at} > {end} goto {rare}",
                at = in(reg) $pkt.start() + $len,
                end = in(reg) $pkt.end(),
                rare = label $rare,
                options(nostack),
            )
        }
    };
}

mod ctx;
mod maps;

use aya_ebpf::{
    bindings::{
        BPF_NOEXIST, BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP, BPF_RB_PROD_POS,
        TC_ACT_UNSPEC, xdp_action::XDP_PASS,
    },
    helpers::{
        bpf_get_smp_processor_id, bpf_jiffies64, bpf_ktime_get_coarse_ns, bpf_ktime_get_ns,
        generated::bpf_map_lookup_percpu_elem,
    },
    macros::{classifier, xdp},
    programs::{TcContext, XdpContext},
};
use roce_trace_common::{
    account,
    datapath::*,
    parse::{
        Facts, Look, PLAIN_V4_REQUEST_LEN, Packet, Parsed, first_look, load_icrc, parse_into,
        parse_plain_v4_into, plain_v4_headers, plain_v4_lengths, plain_v4_syndrome,
    },
    scratch::{Globals, Work},
};

use crate::{
    ctx::{Span, TcPacket, XdpPacket},
    maps::{CONFIG, FLOW_OWNER, FLOW_SLOTS, FLOWS, GLOBALS, MIRROR_FROM, MIRRORS, SAMPLES, SAMPLES_WOKEN_AT},
};

#[xdp]
#[inline(always)]
pub fn roce_xdp(ctx: XdpContext) -> u32 {
    let pkt = XdpPacket::new(&ctx);
    // Most frames are not RoCE: told from their first headers, before any map is
    // touched, and not counted (the interface's own counters have them).
    let look = first_look(&pkt, CONFIG.get().udp_port);
    if look != Look::NotRoce {
        watch(&pkt, look, DIR_INGRESS, pkt.ifindex(), pkt.frame_len());
    }
    XDP_PASS
}

/// A candidate frame: a plain IPv4 packet of a flow that holds its slot here is counted by
/// the fast path ([`fast`]); any other by the full one ([`observe`]).
#[inline(always)]
fn watch<P: Packet + Span>(pkt: &P, look: Look, dir: u8, ifindex: u32, frame_len: u32) {
    if look != Look::PlainV4 || !fast(pkt, dir, ifindex, frame_len) {
        observe(pkt, look, dir, ifindex, frame_len);
    }
}

#[classifier]
#[inline(always)]
pub fn roce_tc(ctx: TcContext) -> i32 {
    tc(&ctx, DIR_EGRESS);
    // UNSPEC: continue with the next program / the default action (tcx and clsact alike).
    TC_ACT_UNSPEC
}

/// Ingress where XDP would cost the traffic a copy (veth copies every packet it hands to
/// XDP) or where the driver has no native XDP.
#[classifier]
#[inline(always)]
pub fn roce_tc_in(ctx: TcContext) -> i32 {
    tc(&ctx, DIR_INGRESS);
    TC_ACT_UNSPEC
}

/// Both TC hooks: a frame surely not RoCE goes by untouched (no pull, no map); any other
/// has its headers pulled when they are not linear, and is observed.
#[inline(always)]
fn tc(ctx: &TcContext, dir: u8) {
    let mut pkt = TcPacket::new(ctx);
    let udp_port = CONFIG.get().udp_port;
    let look = first_look(&pkt, udp_port);
    if look == Look::NotRoce {
        return;
    }
    // The headers the first look read stay where they are when pulled. Counted when
    // pulled: nothing of the pull stays live across the packet's accounting.
    if pkt.pull_if_candidate(udp_port) {
        count_pull(dir);
    }
    watch(&pkt, look, dir, pkt.ifindex(), pkt.frame_len());
}

/// Counts a packet whose headers TC had to pull into the skb's linear area (rare: only
/// candidates, and only when the sender left headers in fragments).
#[inline(always)]
fn count_pull(dir: u8) {
    if let Some(g) = GLOBALS.get_ptr_mut(this_cpu()) {
        // SAFETY: this CPU's element; programs do not nest on one CPU for these hooks.
        bump(unsafe { &mut (*g).counters }, GlobalCounter::HeadersPulled, dir);
    }
}

/// Inserted for a new flow; a static so its 144 bytes never sit on the BPF stack.
static ZERO_COUNTERS: FlowCounters = FlowCounters {
    state: FlowState {
        next_psn: 0,
        sample_state: 0,
        first_dscp: 0,
        flags: 0,
        repeat: [0; 2],
        repeat_lens: 0,
    },
    last_ns: 0,
    last_dscp: 0,
    last_pcp: 0,
    last_ttl: 0,
    _pad: [0; 5],
    first_ns: 0,
    counts: Counts {
        packets: 0,
        bytes: 0,
        ecn: [0; 4],
        cnp: 0,
        ack: 0,
        nak_psn_seq_err: 0,
        nak_rnr: 0,
        nak_other: 0,
        psn_gaps: 0,
        dscp_changed: 0,
    },
};

/// The CPU the program runs on (the verifier inlines the helper: one per-CPU load). A
/// program runs on one CPU from start to end, so its elements of `GLOBALS` and
/// `FLOW_SLOTS` are its alone.
#[inline(always)]
fn this_cpu() -> u32 {
    // SAFETY: no preconditions.
    unsafe { bpf_get_smp_processor_id() }
}

/// This CPU's global counters (`CpuGlobals::counters`), passed down from `fast` or `observe`.
type Counters = [u64; GLOBAL_COUNTERS_LEN as usize];

/// Counts one event in this CPU's global counters.
#[inline(always)]
fn bump(counters: &mut Counters, counter: GlobalCounter, dir: u8) {
    if let Some(c) = counters.get_mut(counter.index(dir) as usize) {
        *c += 1;
    }
}

/// The fast path: a plain IPv4 packet whose flow holds its slot on this CPU — the common
/// packet — counted from its headers read in place. A request that repeats its flow's
/// last plain one (`account::repeats`) is told by two words and its PSN, without the
/// headers' checks (its lengths and opcode are the last one's, which passed them); any
/// other is checked and, plain (in sequence, no news for its flow's state, nothing to
/// report: `account::news`, `account::reasons`), told by one test ([`fast_checked`]);
/// before it, a response (an acknowledgement, a READ response) like its flow's last plain
/// one is told by its syndrome's read and two words (`account::repeats_response`).
/// Both are counted in straight-line code; they touch the flow's slot
/// and the first line of this CPU's globals only: no working memory, no flow key written
/// out. Any other goes to [`fast_rest`]: a packet out of sequence (a retransmission, a
/// flow that moved here) is parsed whole for what `catch_up` needs, and a packet to
/// report (sampled, CE, a CNP, a NAK) after it is counted. Whether it counted `pkt`; when
/// not (not plain IPv4, its headers not what the parser parses, the flow not in its
/// slot), nothing was counted and [`observe`] takes the packet whole. The same `account`
/// functions as the full path, so both count a packet alike.
#[inline(always)]
fn fast<P: Packet + Span>(pkt: &P, dir: u8, ifindex: u32, frame_len: u32) -> bool {
    let cfg = CONFIG.get();
    let cpu = this_cpu();
    let Some(h) = plain_v4_headers(pkt) else {
        return false;
    };
    let words = account::plain_v4_key_words(&h.key(pkt), ifindex, dir);
    let Some(slot) = flow_slot(cpu, FlowKey::slot_of(&words, cfg.slot_bits), cfg.slot_bits) else {
        return false;
    };
    // SAFETY: this CPU's slot, as in `account`.
    let slot = unsafe { &mut *slot };
    if slot.counters.counts.packets == 0 || !slot.key.same_words(&words) {
        return false;
    }
    // This CPU's globals (the clock, the count) right after the slot's first loads: at
    // light load both lines miss, and a miss holds what follows it only as far as the
    // core looks ahead. Read before the slot, as they were, the globals' line was some
    // 180 instructions earlier, and the two misses came one after the other.
    let Some(g) = GLOBALS.get_ptr_mut(cpu) else {
        return false;
    };
    // SAFETY: this CPU's element; programs do not nest on one CPU for these hooks.
    let g = unsafe { &mut *g };
    let now = coarse_now(g);
    let c = &mut slot.counters;
    // What accounting reads, read here, after the calls that find the slot and the
    // globals (the verifier inlines them, but LLVM holds across a call what it read
    // before, on the stack).
    let f = &h.facts(pkt);
    let lens = h.lens();
    // Nearly every packet: a request like the flow's last plain one (its TOS, opcode and
    // lengths), at the expected PSN, in a frame that holds any request's extended
    // headers. Two words and the PSN tell it, where the checks and the plain packet's
    // tests are a dozen facts; then its sampling, then straight-line stores. Both rare
    // sides break to one copy of the checked path.
    'checked: {
        rare_if_ne!(account::repeats(&c.state, f, lens), 0, {
            break 'checked;
        });
        rare_if_short!(pkt, PLAIN_V4_REQUEST_LEN, {
            break 'checked;
        });
        let sampled = account::sampled(f, cfg, c.state.sample_state);
        rare_if_ne!(sampled, 0, {
            return fast_rest(pkt, cfg, g, c, f, words, cpu, dir, frame_len, now, sampled);
        });
        bump(&mut g.counters, GlobalCounter::RoceV2, dir);
        account::count_repeat(c, f, frame_len, now);
        return true;
    }
    // An acknowledgement or READ response like the flow's last plain response (its TOS,
    // opcode and lengths), in a frame that holds its opcode's extended headers, not a
    // NAK: told by the syndrome's read and two words, whatever its PSN; then its
    // sampling, then straight-line stores. Out of the request's way: its first test is
    // the one a repeated request passed.
    // The checks' half that reads the frame, made once for the response's test and the
    // checked path (when it fails, nothing is counted: the full path takes the frame).
    let Some(syndrome) = plain_v4_syndrome(pkt, f.opcode) else {
        return false;
    };
    let f = &Facts { syndrome, ..*f };
    'checked_response: {
        rare_if_ne!(account::repeats_response(&c.state, f, lens), 0, {
            break 'checked_response;
        });
        // Sampled: the checked path, which reports it (one copy of the reporting code).
        rare_if_ne!(account::sampled(f, cfg, c.state.sample_state), 0, {
            break 'checked_response;
        });
        bump(&mut g.counters, GlobalCounter::RoceV2, dir);
        account::count_response_but_ack(c, f, frame_len, now);
        // An acknowledgement's count is on the slot's third line, as in `fast_checked`.
        rare_if_ne!(account::plain_ack(f), 0, {
            c.counts.ack += 1;
        });
        return true;
    }
    fast_checked(pkt, cfg, g, c, f, lens, words, cpu, dir, frame_len, now)
}

/// [`fast`] of a packet that does not repeat its flow's last plain request or response
/// (another opcode, TOS or length, the flow's first packet in its slot, a frame shorter
/// than any request's extended headers, a NAK, a sampled response), whose frame [`fast`]
/// has seen hold its extended headers and whose syndrome `f` holds
/// (`parse::plain_v4_syndrome`): its lengths checked as `parse::plain_v4` checks them
/// (when they fail, nothing is counted: the full path takes the frame), then plain (no
/// news, nothing to report) or not.
#[inline(always)]
#[expect(
    clippy::too_many_arguments,
    reason = "what fast has in registers, passed flat"
)]
fn fast_checked<P: Packet>(
    pkt: &P,
    cfg: &DatapathConfig,
    g: &mut Globals,
    c: &mut FlowCounters,
    f: &Facts,
    lens: u32,
    words: [u64; 6],
    cpu: u32,
    dir: u8,
    frame_len: u32,
    now: u64,
) -> bool {
    if !plain_v4_lengths(f.opcode, lens) {
        return false;
    }
    let reasons = account::reasons(f, cfg, c.state.sample_state);
    // The plain packet (no news, nothing to report): one test, both sides arithmetic,
    // then straight-line stores.
    rare_if_ne!(account::news(&c.state, f) | reasons as u64, 0, {
        return fast_rest(pkt, cfg, g, c, f, words, cpu, dir, frame_len, now, reasons);
    });
    bump(&mut g.counters, GlobalCounter::RoceV2, dir);
    account::count_plain_but_ack(c, f, frame_len, now);
    account::note_repeat(&mut c.state, f, lens);
    // An acknowledgement's count is on the slot's third line: a jump out of line, so a
    // data packet, which counts none, leaves that line alone.
    rare_if_ne!(account::plain_ack(f), 0, {
        c.counts.ack += 1;
    });
    true
}

/// [`fast`] of a packet that is not plain: out of sequence, with news for its flow's
/// state, or to report for `reasons` (`account::reasons` before the state's update).
#[inline(always)]
#[expect(
    clippy::too_many_arguments,
    reason = "what fast has in registers, passed flat"
)]
fn fast_rest<P: Packet>(
    pkt: &P,
    cfg: &DatapathConfig,
    g: &mut Globals,
    c: &mut FlowCounters,
    f: &Facts,
    words: [u64; 6],
    cpu: u32,
    dir: u8,
    frame_len: u32,
    now: u64,
    reasons: u32,
) -> bool {
    let in_sequence = account::in_sequence(&c.state, f);
    if !in_sequence {
        roce_trace_common::cold_path();
        // It parses (`plain_v4` read it); the key and the headers as the full path has them.
        if parse_plain_v4_into(pkt, cfg.udp_port, &mut g.work.parsed).is_err() {
            return false;
        }
        *g.work.key.words_mut() = words;
    }
    bump(&mut g.counters, GlobalCounter::RoceV2, dir);
    let update = if in_sequence {
        account::update_state(&mut c.state, f)
    } else {
        roce_trace_common::cold_path();
        catch_up(&mut c.state, &g.work.key, cfg, cpu, &g.work.parsed, f)
    };
    if update.psn_regression {
        roce_trace_common::cold_path();
        bump(&mut g.counters, GlobalCounter::PsnRegressions, dir);
    }
    account::count(c, f, frame_len, now, &update);
    // An update in sequence leaves the flow's hash state as it was; catching up may have
    // given it another CPU's copy.
    let reasons = if in_sequence {
        reasons
    } else {
        account::reasons(f, cfg, c.state.sample_state)
    };
    if reasons != 0 {
        // Sampled, CE-marked, a CNP or a NAK: the few; their code goes out of line.
        roce_trace_common::cold_path();
        if in_sequence {
            // It parses, as above; were it ever not to, the packet stays counted and
            // unreported rather than reported with another packet's headers.
            if parse_plain_v4_into(pkt, cfg.udp_port, &mut g.work.parsed).is_err() {
                return true;
            }
            *g.work.key.words_mut() = words;
        }
        report(pkt, g, cfg, frame_len, reasons);
    }
    true
}

/// Reports a counted packet whose key and parsed headers are in the working memory.
#[inline(always)]
fn report<P: Packet>(pkt: &P, g: &mut Globals, cfg: &DatapathConfig, frame_len: u32, reasons: u32) {
    load_icrc(pkt, &mut g.work.parsed);
    emit(
        pkt,
        &g.work.parsed,
        &g.work.key,
        &mut g.counters,
        frame_len,
        reasons,
        cfg.wakeup_bytes,
    );
}

/// The coarse clock: a flow's first and last packet to a tick, read once a tick on each
/// CPU (`jiffies` is one load); reported packets get the precise one.
#[inline(always)]
fn coarse_now(g: &mut Globals) -> u64 {
    // SAFETY: no preconditions.
    let jiffies = unsafe { bpf_jiffies64() };
    if g.clock_jiffies != jiffies {
        // Once a tick.
        roce_trace_common::cold_path();
        g.clock_jiffies = jiffies;
        // SAFETY: no preconditions.
        g.coarse_ns = unsafe { bpf_ktime_get_coarse_ns() };
    }
    g.coarse_ns
}

#[inline(always)]
fn observe<P: Packet>(pkt: &P, look: Look, dir: u8, ifindex: u32, frame_len: u32) {
    let cfg = CONFIG.get();
    let cpu = this_cpu();
    let Some(g) = GLOBALS.get_ptr_mut(cpu) else {
        return;
    };
    // SAFETY: this CPU's element; programs do not nest on one CPU for these hooks.
    let g = unsafe { &mut *g };
    // Every frame is counted once, by what became of it (`GlobalCounter::OUTCOMES`).
    let parsed = if look == Look::PlainV4 {
        parse_plain_v4_into(pkt, cfg.udp_port, &mut g.work.parsed)
    } else {
        parse_into(pkt, cfg.udp_port, &mut g.work.parsed, &mut g.cold.inner)
    };
    match parsed {
        Ok(()) => {
            // A mirrored copy from outside the mirror ranges is not ours: no session is
            // remembered for it, no flow counted (a forged GRE flood cannot fill MIRRORS).
            if g.work.parsed.present & HAS_MIRROR != 0
                && cfg.mirror_from != 0
                && !mirror_allowed(cfg.mirror_from, &g.work.parsed.mirror_info.src)
            {
                bump(&mut g.counters, GlobalCounter::MirrorRefused, dir);
                return;
            }
            bump(&mut g.counters, GlobalCounter::RoceV2, dir);
            if g.work.parsed.present & HAS_MIRROR != 0 {
                bump(&mut g.counters, GlobalCounter::Mirrored, dir);
                remember_mirror(&g.work.parsed);
            }
            let coarse = coarse_now(g);
            let reasons = account(
                &mut g.work,
                &mut g.counters,
                &mut g.occupied,
                cfg,
                cpu,
                dir,
                ifindex,
                frame_len,
                coarse,
            );
            if reasons != 0 {
                report(pkt, g, cfg, frame_len, reasons);
            }
        }
        // Not counted, like the frames `first_look` let by (those the parser reaches only
        // through tags, options or extension headers it had to walk).
        Err(GlobalCounter::NonRoce) => {}
        Err(reason) => bump(&mut g.counters, reason, dir),
    }
}

/// Whether a mirror's outer source `src` is in one of the first `n` ranges of
/// `MIRROR_FROM`.
#[inline(always)]
fn mirror_allowed(n: u16, src: &[u32; 4]) -> bool {
    for i in 0..MAX_MIRROR_FROM {
        if i >= u32::from(n) {
            break;
        }
        if let Some(p) = MIRROR_FROM.get(i)
            && p.contains(src)
        {
            return true;
        }
    }
    false
}

/// Records a mirrored copy's session under its id (before its flow exists, so userspace
/// can name every flow it reads). The first session to claim an id keeps it.
#[inline(always)]
fn remember_mirror(p: &Parsed) {
    let id = p.mirror_id;
    if MIRRORS.get_ptr(id).is_none() {
        // Full, or another CPU just inserted it: either way nothing more to do here.
        #[expect(
            clippy::needless_borrows_for_generic_args,
            reason = "the value straight from the scratch slot, no copy on the BPF stack"
        )]
        let _ = MIRRORS.insert(id, &p.mirror_info, BPF_NOEXIST as u64);
    }
}

/// Counts the packet on its flow; returns why it must be reported (0: it need not be).
#[inline(always)]
#[expect(
    clippy::too_many_arguments,
    reason = "what observe has in registers, passed flat rather than through the BPF stack"
)]
fn account(
    work: &mut Work,
    counters: &mut Counters,
    occupied: &mut [u64; OCCUPIED_WORDS],
    cfg: &DatapathConfig,
    cpu: u32,
    dir: u8,
    ifindex: u32,
    frame_len: u32,
    now: u64,
) -> u32 {
    let p = &work.parsed;
    let words = account::set_flow_key(&mut work.key, p, ifindex, dir);
    let key = &work.key;

    let i = FlowKey::slot_of(&words, cfg.slot_bits);
    let flow = match flow_slot(cpu, i, cfg.slot_bits) {
        // SAFETY: this CPU's slot: only this CPU writes it (`take_over` on another CPU
        // clears only its state's flags, which this packet does not read first).
        Some(slot) if unsafe { (*slot).counters.counts.packets != 0 && (*slot).key.same_words(&words) } => {
            // SAFETY: as above.
            Some(unsafe { core::ptr::addr_of_mut!((*slot).counters) })
        }
        // SAFETY: as above; the slot is not the flow's: taken, or handed to it here.
        Some(slot) => slot_or_flows(unsafe { &mut *slot }, i, occupied, key, counters, cfg, dir, now),
        None => flows_entry(key, counters, dir),
    };
    let f = Facts::of(p);
    let flow_state = if let Some(c) = flow {
        // SAFETY: per-CPU map value: only this CPU writes this copy.
        let c = unsafe { &mut *c };
        let update = if account::in_sequence(&c.state, &f) {
            account::update_state(&mut c.state, &f)
        } else {
            catch_up(&mut c.state, key, cfg, cpu, p, &f)
        };
        if update.psn_regression {
            bump(counters, GlobalCounter::PsnRegressions, dir);
        }
        account::count(c, &f, frame_len, now, &update);
        c.state.sample_state
    } else {
        // No room for the flow: its hash state is computed for this packet alone.
        account::sample_state(p, cfg)
    };
    account::reasons(&f, cfg, flow_state)
}

/// A flow without its slot on this CPU: the slot is handed to it when free or idle for
/// `slot_idle_ms` (an idle flow's counters move to `FLOWS` first), unless this CPU
/// already counts the flow in `FLOWS` (a flow's copy on a CPU lives in one place); else
/// the flow is counted in `FLOWS`.
#[inline(always)]
#[expect(
    clippy::too_many_arguments,
    reason = "what account has in registers, passed flat"
)]
fn slot_or_flows(
    slot: &mut FlowSlot,
    i: u32,
    occupied: &mut [u64; OCCUPIED_WORDS],
    key: &FlowKey,
    counters: &mut Counters,
    cfg: &DatapathConfig,
    dir: u8,
    now: u64,
) -> Option<*mut FlowCounters> {
    let held = slot.counters.counts.packets != 0;
    if held && now.saturating_sub(slot.counters.last_ns) < cfg.slot_idle_ms as u64 * 1_000_000 {
        return flows_entry(key, counters, dir);
    }
    if let Some(c) = FLOWS.get_ptr_mut(key) {
        // SAFETY: per-CPU map value: only this CPU writes this copy.
        if unsafe { (*c).counts.packets } != 0 {
            return Some(c);
        }
    }
    if held {
        note_flows_write(counters);
        // The idle flow's copy moves to FLOWS (this CPU's copy there is empty: it held
        // the slot). Readers read the slots first, then FLOWS, and count a copy in both
        // once, so the move is neither missed nor counted twice.
        #[expect(
            clippy::needless_borrows_for_generic_args,
            reason = "straight from the map value: by value would copy 136 bytes onto the BPF stack"
        )]
        let moved = FLOWS.insert(&slot.key, &slot.counters, 0);
        if moved.is_err() {
            // The idle flow keeps its slot (nothing lost); this one goes to FLOWS.
            return flows_entry(key, counters, dir);
        }
    }
    if !held {
        // The slot's first flow: the reader visits the slots marked here, so the mark
        // comes before the slot is written.
        if let Some(w) = occupied.get_mut((i / 64) as usize) {
            *w |= 1 << (i % 64);
        }
        core::sync::atomic::compiler_fence(core::sync::atomic::Ordering::Release);
    }
    // Empty first (a reader skips a slot without packets), then the new key.
    // SAFETY: valid, exclusively owned per-CPU value.
    unsafe {
        core::ptr::write_volatile(core::ptr::addr_of_mut!(slot.counters.counts.packets), 0);
    }
    core::sync::atomic::compiler_fence(core::sync::atomic::Ordering::Release);
    slot.counters = ZERO_COUNTERS;
    slot.key = *key;
    core::sync::atomic::compiler_fence(core::sync::atomic::Ordering::Release);
    Some(core::ptr::addr_of_mut!(slot.counters))
}

/// CPU `cpu`'s slot `i` of the flow table, which has `1 << slot_bits` slots a CPU.
#[inline(always)]
fn flow_slot(cpu: u32, i: u32, slot_bits: u32) -> Option<*mut FlowSlot> {
    let (chunk, entry) = slot_place(cpu, i, slot_bits);
    let chunk: *mut FlowSlotChunk = FLOW_SLOTS.get_ptr_mut(chunk)?;
    // SAFETY: a valid `FLOW_SLOTS` value; `get_mut` checks the index against its length.
    unsafe { (*chunk).get_mut(entry as usize) }.map(core::ptr::from_mut)
}

/// Counts a write into `FLOWS` before it is made (`FLOWS_WRITES`): a reader that reads
/// the slots and then finds no CPU has written one skips the walk of an empty `FLOWS`;
/// a copy moved out of a slot is written after this and the slot emptied after that, so
/// a reader that saw the slot empty sees the write counted.
#[inline(always)]
fn note_flows_write(counters: &mut Counters) {
    if let Some(c) = counters.get_mut(FLOWS_WRITES) {
        *c += 1;
    }
    core::sync::atomic::compiler_fence(core::sync::atomic::Ordering::Release);
}

/// The flow's counters in `FLOWS`, inserted when new.
#[inline(always)]
fn flows_entry(key: &FlowKey, counters: &mut Counters, dir: u8) -> Option<*mut FlowCounters> {
    if let Some(c) = FLOWS.get_ptr_mut(key) {
        return Some(c);
    }
    note_flows_write(counters);
    #[expect(
        clippy::needless_borrows_for_generic_args,
        reason = "by value would copy 136 bytes onto the 512-byte BPF stack"
    )]
    let inserted = FLOWS.insert(key, &ZERO_COUNTERS, 0);
    if inserted.is_err() {
        bump(counters, GlobalCounter::FlowInsertFailed, dir);
    }
    FLOWS.get_ptr_mut(key)
}

/// A packet not in sequence on this CPU: the flow is new here, moved here from another
/// CPU, or really skipped or repeated PSNs. `FLOW_OWNER` says which CPU saw the flow
/// last; when that is another CPU, its copy of the state is the flow's latest, so it is
/// taken over before `p` is judged. The flow's first DSCP lives there too.
#[inline(always)]
fn catch_up(
    st: &mut FlowState,
    key: &FlowKey,
    cfg: &DatapathConfig,
    cpu: u32,
    p: &Parsed,
    f: &Facts,
) -> account::StateUpdate {
    let first_dscp = match FLOW_OWNER.get_ptr_mut(key) {
        None => {
            // A new flow (or one whose owner record was evicted: this CPU's state stands).
            let first_dscp = if st.flags & STATE_INIT != 0 {
                st.first_dscp
            } else {
                p.dscp
            };
            let _ = FLOW_OWNER.insert(
                key,
                FlowOwner {
                    cpu,
                    first_dscp,
                    _pad: [0; 3],
                },
                0,
            );
            first_dscp
        }
        Some(owner) => {
            // SAFETY: valid map value pointer; CPUs racing on one flow can at worst
            // misjudge a packet, never corrupt memory.
            let owner = unsafe { &mut *owner };
            if owner.cpu != cpu {
                let left = owner.cpu;
                owner.cpu = cpu;
                take_over(st, key, cfg.slot_bits, left);
                st.first_dscp = owner.first_dscp;
            }
            owner.first_dscp
        }
    };
    if st.flags & STATE_INIT == 0 {
        *st = account::new_state(p, cfg);
        st.first_dscp = first_dscp;
        return account::StateUpdate {
            dscp_changed: p.dscp != first_dscp,
            ..Default::default()
        };
    }
    account::update_state(st, f)
}

/// Takes the flow's state over from CPU `left`, which saw it last, and marks it unknown
/// there when it follows requests' PSNs, so that the CPU the flow left cannot judge a
/// later request in sequence by what it saw before (a retransmission that happens to
/// continue its old PSN). A flow of responses alone (acknowledgements, READ responses)
/// has no PSN to follow, and its state there (seen, its first DSCP) stays as good as the
/// latest: so when it comes back, as a responder's thread moving between CPUs sends it
/// back and forth, it is in sequence there without catching up again.
#[inline(always)]
fn take_over(st: &mut FlowState, key: &FlowKey, slot_bits: u32, left: u32) {
    // That CPU's copy of the flow: in its slot when it holds it, else in FLOWS.
    let slot = flow_slot(left, key.slot(slot_bits), slot_bits);
    // SAFETY: a valid slot of that CPU's chunk.
    let theirs = if let Some(slot) = slot.filter(|&s| unsafe { (*s).key.same(key) }) {
        // SAFETY: as above.
        unsafe { core::ptr::addr_of_mut!((*slot).counters) }
    } else {
        // SAFETY: FLOWS is a per-CPU hash map of FlowCounters; the helper returns that
        // CPU's copy of the key's value, or null.
        (unsafe {
            bpf_map_lookup_percpu_elem(
                core::ptr::addr_of!(FLOWS).cast_mut().cast(),
                core::ptr::from_ref(key).cast_mut().cast(),
                left,
            )
        }) as *mut FlowCounters
    };
    if theirs.is_null() {
        return;
    }
    // SAFETY: non-null: a valid value of that CPU; only its state is touched.
    let theirs = unsafe { &mut (*theirs).state };
    if theirs.flags & STATE_INIT != 0 {
        *st = *theirs;
        if theirs.flags & STATE_PSN_VALID != 0 {
            theirs.flags = 0;
        }
    }
}

#[inline(always)]
fn emit<P: Packet>(
    pkt: &P,
    p: &Parsed,
    key: &FlowKey,
    counters: &mut Counters,
    frame_len: u32,
    reasons: u32,
    wakeup_bytes: u32,
) {
    let dir = key.direction;
    let Some(mut entry) = SAMPLES.reserve::<Sample>(0) else {
        // Full ring: counted, and the packet passes untouched all the same.
        bump(counters, GlobalCounter::RingbufFull, dir);
        return;
    };
    // SAFETY: bpf_ktime_get_ns has no preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    // SAFETY: `as_mut_ptr` points at a reserved, exclusively owned `Sample` slot in the
    // ring, memory the kernel handed over (any bytes are a valid `Sample`); `fill` writes
    // every field but the head bytes past `head_len`.
    let s = unsafe { &mut *entry.as_mut_ptr() };
    s.fill(pkt, p, key, now, frame_len, reasons);
    // By default the kernel's own policy: wake the reader when it had caught up, so a busy
    // reader is not woken per sample. A batching reader (capture, the agent) is woken once
    // a batch waits and drains on a timer besides: a reader that keeps up would otherwise
    // cost every sample a wake-up (an IRQ-work self-IPI).
    let flags = if wakeup_bytes == 0 {
        0
    } else {
        batch_wakeup(wakeup_bytes as u64)
    };
    entry.submit(flags);
    bump(counters, GlobalCounter::SamplesEmitted, dir);
}

/// The wake-up flag for a sample about to be submitted to a batching reader: wake it
/// when `at` bytes or more wait and a batch has been produced since the last wake-up
/// (`SAMPLES_WOKEN_AT`). Whichever CPU finds that wakes it, so samples reserved on two
/// CPUs at once cannot both step past the moment (a fill inside one record past `at`, as
/// it was, could be missed that way and leave a full batch to the reader's timer); and a
/// reader that lags is woken once a batch, not once a sample.
#[inline(always)]
fn batch_wakeup(at: u64) -> u64 {
    if SAMPLES.query(BPF_RB_AVAIL_DATA as u64) < at {
        return BPF_RB_NO_WAKEUP as u64;
    }
    let Some(woken) = SAMPLES_WOKEN_AT.get_ptr_mut(0) else {
        return BPF_RB_FORCE_WAKEUP as u64;
    };
    let produced = SAMPLES.query(BPF_RB_PROD_POS as u64);
    // SAFETY: the map's one value; CPUs racing here each store a recent position, and
    // either wakes the reader.
    unsafe {
        if produced < core::ptr::read_volatile(woken).saturating_add(at) {
            return BPF_RB_NO_WAKEUP as u64;
        }
        core::ptr::write_volatile(woken, produced);
    }
    BPF_RB_FORCE_WAKEUP as u64
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
