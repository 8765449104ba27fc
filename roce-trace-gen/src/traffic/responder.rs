//! An RC responder's reply logic, as a receiving NIC behaves: ACK requests that ask for
//! it, NAK a PSN gap once, and — as a DCQCN notification point — answer CE marks with a
//! CNP to the sending QP, at most one per QP per interval.

use std::time::Duration;

use roce_trace_common::roce::{self, PSN_MASK, op, psn_ahead};
use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reply {
    Ack { psn: u32, msn: u32 },
    NakPsnSeqErr { psn: u32, msn: u32 },
    Cnp,
}

#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq, Eq)]
pub struct ResponderStats {
    pub packets: u64,
    pub in_order: u64,
    pub duplicates: u64,
    pub out_of_sequence: u64,
    pub ce_marked: u64,
    pub acks_sent: u64,
    pub naks_sent: u64,
    pub cnps_sent: u64,
    pub messages: u64,
}

#[derive(Default)]
pub struct ResponderQp {
    epsn: Option<u32>,
    msn: u32,
    nak_outstanding: bool,
    last_cnp: Option<Duration>,
    pub stats: ResponderStats,
}

fn ends_message(opcode: u8) -> bool {
    matches!(
        roce::operation(opcode),
        op::SEND_LAST
            | op::SEND_LAST_IMM
            | op::SEND_ONLY
            | op::SEND_ONLY_IMM
            | op::WRITE_LAST
            | op::WRITE_LAST_IMM
            | op::WRITE_ONLY
            | op::WRITE_ONLY_IMM
            | op::READ_REQUEST
    )
}

impl ResponderQp {
    /// One request packet arrived; returns the replies to send, in order.
    pub fn on_request(
        &mut self,
        opcode: u8,
        psn: u32,
        ack_req: bool,
        ce: bool,
        now: Duration,
        cnp_interval: Duration,
    ) -> Vec<Reply> {
        let mut out = Vec::new();
        self.stats.packets += 1;
        if ce {
            self.stats.ce_marked += 1;
            if self
                .last_cnp
                .is_none_or(|t| now.saturating_sub(t) >= cnp_interval)
            {
                self.last_cnp = Some(now);
                self.stats.cnps_sent += 1;
                out.push(Reply::Cnp);
            }
        }
        let epsn = *self.epsn.get_or_insert(psn);
        match psn_ahead(epsn, psn) {
            Some(0) => {
                self.stats.in_order += 1;
                self.epsn = Some((psn + 1) & PSN_MASK);
                self.nak_outstanding = false;
                if ends_message(opcode) {
                    self.msn = (self.msn + 1) & PSN_MASK;
                    self.stats.messages += 1;
                }
                if ack_req {
                    self.stats.acks_sent += 1;
                    out.push(Reply::Ack { psn, msn: self.msn });
                }
            }
            Some(_) => {
                self.stats.out_of_sequence += 1;
                // One NAK per gap: the requester goes back, and until the expected PSN
                // arrives further packets are dropped silently.
                if !self.nak_outstanding {
                    self.nak_outstanding = true;
                    self.stats.naks_sent += 1;
                    out.push(Reply::NakPsnSeqErr {
                        psn: epsn,
                        msn: self.msn,
                    });
                }
            }
            None => {
                self.stats.duplicates += 1;
                if ack_req {
                    self.stats.acks_sent += 1;
                    out.push(Reply::Ack {
                        psn: epsn.wrapping_sub(1) & PSN_MASK,
                        msn: self.msn,
                    });
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);
    const CNP: Duration = Duration::from_micros(50);

    #[test]
    fn acks_on_ackreq_and_counts_messages() {
        let mut r = ResponderQp::default();
        assert_eq!(r.on_request(op::WRITE_FIRST, 10, false, false, US, CNP), []);
        assert_eq!(
            r.on_request(op::WRITE_LAST, 11, true, false, US, CNP),
            [Reply::Ack { psn: 11, msn: 1 }]
        );
        assert_eq!(
            r.on_request(op::SEND_ONLY, 12, true, false, US, CNP),
            [Reply::Ack { psn: 12, msn: 2 }]
        );
    }

    #[test]
    fn a_gap_is_naked_once_then_resumes() {
        let mut r = ResponderQp::default();
        r.on_request(op::SEND_ONLY, 0, true, false, US, CNP);
        assert_eq!(
            r.on_request(op::SEND_ONLY, 2, true, false, US, CNP),
            [Reply::NakPsnSeqErr { psn: 1, msn: 1 }]
        );
        assert_eq!(r.on_request(op::SEND_ONLY, 3, true, false, US, CNP), []);
        assert_eq!(
            r.on_request(op::SEND_ONLY, 1, true, false, US, CNP),
            [Reply::Ack { psn: 1, msn: 2 }]
        );
        // A duplicate is re-acknowledged with the last good PSN.
        assert_eq!(
            r.on_request(op::SEND_ONLY, 0, true, false, US, CNP),
            [Reply::Ack { psn: 1, msn: 2 }]
        );
        assert_eq!(r.stats.naks_sent, 1);
        assert_eq!(r.stats.out_of_sequence, 2);
        assert_eq!(r.stats.duplicates, 1);
    }

    #[test]
    fn cnps_are_rate_limited_per_qp() {
        let mut r = ResponderQp::default();
        let mut cnps = 0;
        // 1000 CE-marked packets 10 µs apart: 10 ms, so 200 CNPs at one per 50 µs.
        for i in 0..1000u32 {
            let replies = r.on_request(op::WRITE_MIDDLE, i, false, true, US * (10 * i), CNP);
            cnps += replies.iter().filter(|x| **x == Reply::Cnp).count();
        }
        assert_eq!(cnps, 200);
        assert_eq!(r.stats.ce_marked, 1000);
    }
}
