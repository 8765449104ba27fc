//! What the fuzz harnesses (`fuzz/`) reach that the crate keeps private. Not an API: it
//! exists so the harnesses call the product's own code, and nothing else uses it.

use std::net::IpAddr;

/// An ICMP(v6) error matched to a `trace` probe (see `trace::parse_answer`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IcmpAnswer {
    pub from: IpAddr,
    /// `time-exceeded`, `port-unreachable`, …
    pub kind: String,
    pub final_hop: bool,
    /// The quoted IP header's TOS / traffic class: the probe's class as the hop got it.
    pub tos: u8,
    /// The probe's PSN, which numbers it.
    pub psn: u32,
}

/// `trace`'s parser of ICMP answers: `msg` from the ICMP header on, sent by `from`, for a
/// probe of `sport` → `dst`:4791.
pub fn icmp_answer(msg: &[u8], from: IpAddr, v6: bool, sport: u16, dst: IpAddr) -> Option<IcmpAnswer> {
    crate::trace::parse_answer(msg, from, v6, sport, dst).map(|a| IcmpAnswer {
        from: a.from,
        kind: a.kind,
        final_hop: a.final_hop,
        tos: a.tos,
        psn: a.psn,
    })
}
