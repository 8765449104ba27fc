//! The observation records roce-trace emits (JSON Lines): one definition, used by
//! `capture` and by everything later that reads or forwards observations.

use std::net::IpAddr;

pub use roce_trace_common::flow::{ip_of, ip_of_mapped};
use roce_trace_common::{datapath::*, roce};
use serde::{Deserialize, Serialize};

use crate::{
    mirror::{MirrorSession, MirrorTable},
    sys::KernelClock,
};

pub use roce_trace_common::datapath::direction_name;

/// The mirror session a record's packets arrived through (GRE/ERSPAN from a switch).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct MirrorRecord {
    /// Outer source address: the switch that mirrored the packet.
    pub src_ip: IpAddr,
    /// ERSPAN session id, or the GRE key (0 without one).
    pub session: u32,
    /// `gre`, `erspan1`, `erspan2`, `erspan3`.
    pub kind: String,
}

impl MirrorRecord {
    pub fn of_session(m: &MirrorSession) -> Self {
        Self {
            src_ip: m.src,
            session: m.session,
            kind: m.kind_name().into(),
        }
    }
}

pub const ECN_NAMES: [&str; 4] = ["not_ect", "ect1", "ect0", "ce"];

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct AethRecord {
    pub syndrome: u8,
    pub msn: u32,
    /// `ack`, `rnr_nak`, `nak_psn_seq_err`, `nak_other`; for read responses `response`.
    pub kind: String,
}

/// One sampled packet at one observation point.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct SampleRecord {
    #[serde(rename = "type")]
    pub kind: String,
    /// Unix time, nanoseconds.
    pub time_ns: u64,
    pub iface: String,
    pub ifindex: u32,
    pub direction: String,
    pub src_ip: IpAddr,
    pub dst_ip: IpAddr,
    pub udp_sport: u16,
    pub udp_dport: u16,
    pub dst_qp: u32,
    pub opcode: u8,
    pub opcode_name: String,
    pub psn: u32,
    pub dscp: u8,
    pub ecn: String,
    pub ttl: u8,
    pub pcp: Option<u8>,
    pub vlan_depth: u8,
    pub frame_len: u32,
    pub udp_len: u16,
    pub solicited: bool,
    pub mig_req: bool,
    pub pad_cnt: u8,
    pub pkey: u16,
    pub fecn: bool,
    pub becn: bool,
    pub ack_req: bool,
    pub aeth: Option<AethRecord>,
    pub reth_dma_len: Option<u32>,
    pub deth_src_qp: Option<u32>,
    /// Wire bytes as hex, e.g. "82fd002a"; null when the ICRC could not be read.
    pub icrc: Option<String>,
    /// Why it was reported: `hash`, `cnp`, `ce`, `nak`, `unexpected_dscp`.
    pub reasons: Vec<String>,
    /// Present for a mirrored copy: the switch and session it came through.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mirror: Option<MirrorRecord>,
    /// The ICRC recomputed from the sample's header bytes, when they hold the whole packet
    /// (small packets: CNPs, ACKs); null otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub icrc_ok: Option<bool>,
}

impl SampleRecord {
    pub fn from_sample(s: &Sample, clock: &KernelClock, iface: &str) -> Self {
        let has = |b: u8| s.present & b != 0;
        let aeth = has(HAS_AETH).then(|| AethRecord {
            syndrome: s.aeth_syndrome,
            msn: s.aeth_msn,
            kind: if roce::is_ack_opcode(s.opcode) {
                match roce::ack_kind(s.aeth_syndrome) {
                    roce::AckKind::Ack => "ack",
                    roce::AckKind::RnrNak => "rnr_nak",
                    roce::AckKind::NakPsnSeqErr => "nak_psn_seq_err",
                    roce::AckKind::NakOther => "nak_other",
                }
            } else {
                "response"
            }
            .to_owned(),
        });
        let mut reasons = Vec::new();
        for (bit, name) in [
            (REASON_HASH, "hash"),
            (REASON_CNP, "cnp"),
            (REASON_CE, "ce"),
            (REASON_NAK, "nak"),
            (REASON_UNEXPECTED_DSCP, "unexpected_dscp"),
        ] {
            if s.reasons & bit != 0 {
                reasons.push(name.to_owned());
            }
        }
        let k = &s.key;
        Self {
            kind: "sample".into(),
            time_ns: clock.to_unix_ns(s.ts_ns),
            iface: iface.to_owned(),
            ifindex: k.ifindex,
            direction: direction_name(k.direction).into(),
            src_ip: ip_of(k.ip_version, &k.src),
            dst_ip: ip_of(k.ip_version, &k.dst),
            udp_sport: k.udp_sport,
            udp_dport: s.udp_dport,
            dst_qp: k.dest_qp,
            opcode: s.opcode,
            opcode_name: roce::opcode_name(s.opcode).into(),
            psn: s.psn,
            dscp: s.dscp,
            ecn: ECN_NAMES[(s.ecn & 3) as usize].into(),
            ttl: s.ttl,
            pcp: has(HAS_PCP).then_some(s.pcp),
            vlan_depth: s.vlan_depth,
            frame_len: s.frame_len,
            udp_len: s.udp_len,
            solicited: s.bth_flags & 0x80 != 0,
            mig_req: s.bth_flags & 0x40 != 0,
            pad_cnt: (s.bth_flags >> 4) & 3,
            pkey: s.pkey,
            fecn: s.bth_fecn_becn & 0x80 != 0,
            becn: s.bth_fecn_becn & 0x40 != 0,
            ack_req: s.bth_ack_req & 0x80 != 0,
            aeth,
            reth_dma_len: has(HAS_RETH).then_some(s.reth_dma_len),
            deth_src_qp: has(HAS_DETH).then_some(s.deth_src_qp),
            icrc: has(HAS_ICRC).then(|| s.icrc.iter().map(|b| format!("{b:02x}")).collect()),
            reasons,
            mirror: s
                .mirror()
                .map(|m| MirrorRecord::of_session(&MirrorSession::of_info(&m))),
            icrc_ok: sample_icrc_ok(s),
        }
    }
}

/// Whether a sample's ICRC is right, judged from its header bytes when they hold the
/// whole packet; `None` when they do not (or the ICRC could not be read).
pub fn sample_icrc_ok(s: &Sample) -> Option<bool> {
    if s.present & HAS_ICRC == 0 {
        return None;
    }
    let head = &s.head[..(s.head_len as usize).min(SAMPLE_HEAD_LEN)];
    roce_trace_common::icrc::check_icrc(head, s.l3_off as usize, Some(s.icrc))
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct EcnCounts {
    pub not_ect: u64,
    pub ect1: u64,
    pub ect0: u64,
    pub ce: u64,
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct NakCounts {
    pub psn_seq_err: u64,
    pub rnr: u64,
    pub other: u64,
}

/// Exact counters of one flow at one observation point, cumulative since capture start.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct FlowRecord {
    #[serde(rename = "type")]
    pub kind: String,
    /// The last record of this flow in this capture.
    #[serde(rename = "final")]
    pub is_final: bool,
    pub time_ns: u64,
    pub iface: String,
    pub ifindex: u32,
    pub direction: String,
    pub ip_version: u8,
    pub src_ip: IpAddr,
    pub dst_ip: IpAddr,
    pub udp_sport: u16,
    pub dst_qp: u32,
    pub packets: u64,
    pub bytes: u64,
    /// DSCP of the newest packet.
    pub dscp: u8,
    /// Packets whose DSCP differed from the flow's first.
    pub dscp_changed: u64,
    pub pcp: Option<u8>,
    pub ttl: u8,
    pub ecn: EcnCounts,
    pub cnp: u64,
    pub ack: u64,
    pub nak: NakCounts,
    pub psn_gaps: u64,
    pub first_seen_ns: u64,
    pub last_seen_ns: u64,
    /// Rates over the last refresh interval.
    pub pps: f64,
    pub gbps: f64,
    /// Packets whose ICRC was wrong (corrupted in flight); only where the whole packet was
    /// seen (pcap input).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub icrc_errors: Option<u64>,
    /// Present when the flow was seen through a mirror session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mirror: Option<MirrorRecord>,
}

impl FlowRecord {
    /// `mirrors` names the key's mirror session, if it has one.
    pub fn new(
        k: &FlowKey,
        c: &FlowCounters,
        clock: &KernelClock,
        iface: &str,
        now_ns: u64,
        mirrors: &MirrorTable,
    ) -> Self {
        Self {
            kind: "flow".into(),
            is_final: false,
            time_ns: now_ns,
            iface: iface.to_owned(),
            ifindex: k.ifindex,
            direction: direction_name(k.direction).into(),
            ip_version: k.ip_version,
            src_ip: ip_of(k.ip_version, &k.src),
            dst_ip: ip_of(k.ip_version, &k.dst),
            udp_sport: k.udp_sport,
            dst_qp: k.dest_qp,
            packets: c.counts.packets,
            bytes: c.counts.bytes,
            dscp: c.last_dscp,
            dscp_changed: c.counts.dscp_changed,
            pcp: (c.last_pcp != PCP_NONE).then_some(c.last_pcp),
            ttl: c.last_ttl,
            ecn: EcnCounts {
                not_ect: c.counts.ecn[0],
                ect1: c.counts.ecn[1],
                ect0: c.counts.ecn[2],
                ce: c.counts.ecn[3],
            },
            cnp: c.counts.cnp,
            ack: c.counts.ack,
            nak: NakCounts {
                psn_seq_err: c.counts.nak_psn_seq_err,
                rnr: c.counts.nak_rnr,
                other: c.counts.nak_other,
            },
            psn_gaps: c.counts.psn_gaps,
            first_seen_ns: clock.to_unix_ns(c.first_ns),
            last_seen_ns: clock.to_unix_ns(c.last_ns),
            pps: 0.0,
            gbps: 0.0,
            icrc_errors: None,
            mirror: mirrors.session(k).as_ref().map(MirrorRecord::of_session),
        }
    }

    pub fn ce_percent(&self) -> f64 {
        if self.packets == 0 {
            0.0
        } else {
            100.0 * self.ecn.ce as f64 / self.packets as f64
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct HookRecord {
    pub iface: String,
    pub hook: String,
    pub mode: String,
}

/// End of a capture: totals, and everything that was not seen or not kept.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct SummaryRecord {
    #[serde(rename = "type")]
    pub kind: String,
    pub time_ns: u64,
    pub duration_s: f64,
    /// `duration`, `count`, `signal`.
    pub stopped_by: String,
    pub hooks: Vec<HookRecord>,
    pub flows: u64,
    pub packets: u64,
    pub bytes: u64,
    pub samples_received: u64,
    /// Samples the kernel could not queue (ring buffer full); the packets passed.
    pub ringbuf_drops: u64,
    pub parse_failures: std::collections::BTreeMap<String, u64>,
    /// Every global counter, per direction.
    pub counters: std::collections::BTreeMap<String, std::collections::BTreeMap<String, u64>>,
    /// Where a live capture's `frames_seen` and `non_roce` come from: `interface
    /// counters` (the kernel counts no non-RoCE frame; these are the hooked interfaces'
    /// packet counters over the capture, less the frames the datapath counted). Absent
    /// when they are the parser's own counts (pcap input, exact).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frames_from: Option<String>,
}
