//! roce-trace datapath: XDP on ingress, TC on egress, one parser (`roce_trace_common::parse`)
//! for both. Counts every RoCEv2 packet per flow, samples consistently, reports anomalies.
//! Every path returns pass; no packet is written.
#![no_std]
#![no_main]

mod ctx;
mod maps;

use aya_ebpf::{
    bindings::{TC_ACT_UNSPEC, xdp_action::XDP_PASS},
    helpers::bpf_ktime_get_ns,
    macros::{classifier, xdp},
    programs::{TcContext, XdpContext},
};
use roce_trace_common::{
    datapath::*,
    parse::{Packet, Parsed, load_icrc, parse_into},
    roce::{self, AckKind, OP_CNP},
    sampling::identity_hash,
};

use crate::{
    ctx::{TcPacket, XdpPacket},
    maps::{CONFIG, FLOW_STATE, FLOWS, GLOBALS, SAMPLES, SCRATCH, Scratch},
};

#[xdp]
pub fn roce_xdp(ctx: XdpContext) -> u32 {
    let pkt = XdpPacket::new(&ctx);
    observe(&pkt, DIR_INGRESS, pkt.ifindex(), pkt.frame_len());
    XDP_PASS
}

#[classifier]
pub fn roce_tc(ctx: TcContext) -> i32 {
    let pkt = TcPacket::new(&ctx);
    observe(&pkt, DIR_EGRESS, pkt.ifindex(), pkt.frame_len());
    // UNSPEC: continue with the next program / the default action (tcx and clsact alike).
    TC_ACT_UNSPEC
}

/// Inserted for a new flow; a static so the 128 bytes never sit on the BPF stack.
static ZERO_COUNTERS: FlowCounters = FlowCounters {
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
    first_ns: 0,
    last_ns: 0,
    last_dscp: 0,
    last_pcp: 0,
    last_ttl: 0,
    _pad: [0; 5],
};

#[inline(always)]
fn bump(counter: GlobalCounter, dir: u8) {
    if let Some(c) = GLOBALS.get_ptr_mut(counter.index(dir)) {
        // SAFETY: per-CPU slot, no other writer while this program runs on this CPU.
        unsafe { *c += 1 };
    }
}

#[inline(always)]
fn observe<P: Packet>(pkt: &P, dir: u8, ifindex: u32, frame_len: u32) {
    bump(GlobalCounter::FramesSeen, dir);
    let cfg = CONFIG.load();
    let Some(scratch) = SCRATCH.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: per-CPU slot; programs do not nest on one CPU for these hooks.
    let scratch = unsafe { &mut *scratch };
    match parse_into(pkt, cfg.udp_port, &mut scratch.parsed) {
        Ok(()) => {
            bump(GlobalCounter::RoceV2, dir);
            // SAFETY: bpf_ktime_get_ns has no preconditions.
            let now = unsafe { bpf_ktime_get_ns() };
            let reasons = account(scratch, &cfg, dir, ifindex, frame_len, now);
            if reasons != 0 {
                load_icrc(pkt, &mut scratch.parsed);
                emit(&scratch.parsed, &scratch.key, now, frame_len, reasons);
            }
        }
        Err(reason) => bump(reason, dir),
    }
}

#[inline(always)]
/// Counts the packet on its flow; returns why it must be reported (0: it need not be).
fn account(
    scratch: &mut Scratch,
    cfg: &DatapathConfig,
    dir: u8,
    ifindex: u32,
    frame_len: u32,
    now: u64,
) -> u32 {
    let p = &scratch.parsed;
    scratch.key = FlowKey {
        src: p.src,
        dst: p.dst,
        ifindex,
        dest_qp: p.bth.dest_qp(),
        udp_sport: p.udp_sport,
        direction: dir,
        ip_version: p.ip_version,
    };
    let key = &scratch.key;
    let opcode = p.bth.opcode;
    let psn = p.bth.psn();
    let ack_kind = p.ack_kind();
    let is_nak = matches!(
        ack_kind,
        Some(AckKind::RnrNak | AckKind::NakPsnSeqErr | AckKind::NakOther)
    );

    // Shared per-flow state: PSN sequence and the first DSCP.
    let mut psn_gap = false;
    let mut dscp_changed = false;
    match FLOW_STATE.get_ptr_mut(key) {
        Some(st) => {
            // SAFETY: valid map value pointer; a racing CPU on the same flow can at worst
            // misjudge one packet's gap, never corrupt memory.
            let st = unsafe { &mut *st };
            dscp_changed = st.first_dscp != p.dscp;
            if roce::is_request(opcode) {
                if st.flags & STATE_PSN_VALID != 0 {
                    match roce::psn_ahead(st.next_psn, psn) {
                        Some(0) => {}
                        Some(_) => psn_gap = st.flags & STATE_AFTER_READ == 0,
                        None => bump(GlobalCounter::PsnRegressions, dir),
                    }
                }
                // Track the newest PSN; a retransmission (behind) does not move it back.
                if st.flags & STATE_PSN_VALID == 0 || roce::psn_ahead(st.next_psn, psn).is_some() {
                    st.next_psn = (psn + 1) & roce::PSN_MASK;
                }
                st.flags = STATE_PSN_VALID
                    | if roce::is_read_request(opcode) {
                        STATE_AFTER_READ
                    } else {
                        0
                    };
            }
        }
        None => {
            let request = roce::is_request(opcode);
            let st = FlowState {
                next_psn: (psn + 1) & roce::PSN_MASK,
                first_dscp: p.dscp,
                flags: if request {
                    STATE_PSN_VALID
                        | if roce::is_read_request(opcode) {
                            STATE_AFTER_READ
                        } else {
                            0
                        }
                } else {
                    0
                },
                _pad: [0; 2],
            };
            let _ = FLOW_STATE.insert(key, st, 0);
        }
    }

    let counters = match FLOWS.get_ptr_mut(key) {
        Some(c) => Some(c),
        None => {
            #[expect(
                clippy::needless_borrows_for_generic_args,
                reason = "by value would copy 128 bytes onto the 512-byte BPF stack"
            )]
            let inserted = FLOWS.insert(key, &ZERO_COUNTERS, 0);
            if inserted.is_err() {
                bump(GlobalCounter::FlowInsertFailed, dir);
            }
            FLOWS.get_ptr_mut(key)
        }
    };
    if let Some(c) = counters {
        // SAFETY: per-CPU map value: only this CPU writes this copy.
        let c = unsafe { &mut *c };
        if c.packets == 0 {
            c.first_ns = now;
        }
        c.packets += 1;
        c.bytes += frame_len as u64;
        c.ecn[(p.ecn & 3) as usize] += 1;
        if opcode == OP_CNP {
            c.cnp += 1;
        }
        match ack_kind {
            Some(AckKind::Ack) => c.ack += 1,
            Some(AckKind::NakPsnSeqErr) => c.nak_psn_seq_err += 1,
            Some(AckKind::RnrNak) => c.nak_rnr += 1,
            Some(AckKind::NakOther) => c.nak_other += 1,
            None => {}
        }
        if psn_gap {
            c.psn_gaps += 1;
        }
        if dscp_changed {
            c.dscp_changed += 1;
        }
        c.last_ns = now;
        c.last_dscp = p.dscp;
        c.last_pcp = if p.present & HAS_PCP != 0 { p.pcp } else { PCP_NONE };
        c.last_ttl = p.ttl;
    }

    let mut reasons = 0u32;
    if opcode == OP_CNP {
        reasons |= REASON_CNP;
    }
    if p.ecn == 3 {
        reasons |= REASON_CE;
    }
    if is_nak {
        reasons |= REASON_NAK;
    }
    if cfg.expected_dscp_mask != 0 && (cfg.expected_dscp_mask >> (p.dscp & 63)) & 1 == 0 {
        reasons |= REASON_UNEXPECTED_DSCP;
    }
    if cfg.sample_enabled != 0
        && identity_hash(
            cfg.seed,
            &p.src,
            &p.dst,
            p.udp_sport,
            p.udp_dport,
            key.dest_qp,
            psn,
            opcode,
        ) <= cfg.sample_threshold
    {
        reasons |= REASON_HASH;
    }
    reasons
}

#[inline(always)]
fn emit(p: &Parsed, key: &FlowKey, now: u64, frame_len: u32, reasons: u32) {
    let dir = key.direction;
    let Some(mut entry) = SAMPLES.reserve::<Sample>(0) else {
        // Full ring: counted, and the packet passes untouched all the same.
        bump(GlobalCounter::RingbufFull, dir);
        return;
    };
    let s = entry.as_mut_ptr();
    // SAFETY: `s` points at a reserved, exclusively owned `Sample` slot in the ring; every
    // field is written here (field by field, so no 104-byte copy lands on the BPF stack).
    unsafe {
        (*s).ts_ns = now;
        (*s).key = *key;
        (*s).psn = p.bth.psn();
        (*s).frame_len = frame_len;
        (*s).reth_dma_len = p.reth_dma_len;
        (*s).aeth_msn = p.aeth.msn();
        (*s).deth_src_qp = p.deth_src_qp;
        (*s).icrc = p.icrc;
        (*s).pkey = p.bth.pkey();
        (*s).udp_dport = p.udp_dport;
        (*s).udp_len = p.udp_len;
        (*s).opcode = p.bth.opcode;
        (*s).bth_flags = p.bth.flags;
        (*s).bth_fecn_becn = p.bth.fecn_becn;
        (*s).bth_ack_req = p.bth.ack_req;
        (*s).dscp = p.dscp;
        (*s).ecn = p.ecn;
        (*s).ttl = p.ttl;
        (*s).pcp = p.pcp;
        (*s).aeth_syndrome = p.aeth.syndrome;
        (*s).vlan_depth = p.vlan_depth;
        (*s).present = p.present;
        (*s)._pad = [0; 3];
        (*s).reasons = reasons;
        (*s)._pad2 = 0;
    }
    entry.submit(0);
    bump(GlobalCounter::SamplesEmitted, dir);
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
