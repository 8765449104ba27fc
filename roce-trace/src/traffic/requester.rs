//! An RC requester's send side: messages split at the path MTU into PSN-numbered packets,
//! go-back-N retransmission from a NAKed PSN, completion on ACK.

use std::collections::VecDeque;

use roce_trace_common::roce::{PSN_MASK, op, psn_ahead};
use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verb {
    Write,
    Send,
}

/// One packet to send.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PacketPlan {
    pub opcode: u8,
    pub psn: u32,
    pub ack_req: bool,
    pub payload_len: u32,
    pub pad: u8,
    /// DMA length for the RETH of a WRITE FIRST / ONLY.
    pub reth_len: Option<u32>,
    pub retransmission: bool,
}

#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq, Eq)]
pub struct RequesterStats {
    pub packets: u64,
    pub bytes: u64,
    pub retransmitted: u64,
    pub messages_acked: u64,
    pub acks: u64,
    pub naks_psn_seq_err: u64,
    pub naks_other: u64,
    pub cnps: u64,
}

/// Messages kept for retransmission; older ones are forgotten (no responder, say).
const MAX_OUTSTANDING: usize = 1 << 16;

pub struct Requester {
    verb: Verb,
    msg_size: u32,
    mtu: u32,
    /// Packets per message.
    pkts: u32,
    /// First PSN of the message being sent, and the index of its next packet.
    msg_start: u32,
    idx: u32,
    /// One past the highest PSN ever sent: PSNs behind it are retransmissions.
    high: u32,
    /// Start PSNs of messages sent and not yet acknowledged, oldest first.
    outstanding: VecDeque<u32>,
    pub stats: RequesterStats,
}

impl Requester {
    pub fn new(verb: Verb, msg_size: u32, mtu: u32, first_psn: u32) -> Self {
        assert!(msg_size > 0 && mtu > 0);
        Self {
            verb,
            msg_size,
            mtu,
            pkts: msg_size.div_ceil(mtu),
            msg_start: first_psn & PSN_MASK,
            idx: 0,
            high: first_psn & PSN_MASK,
            outstanding: VecDeque::new(),
            stats: RequesterStats::default(),
        }
    }

    pub fn packets_per_message(&self) -> u32 {
        self.pkts
    }

    /// The next packet, advancing the sequence.
    pub fn next_packet(&mut self) -> PacketPlan {
        let (first, last) = (self.idx == 0, self.idx + 1 == self.pkts);
        let psn = (self.msg_start + self.idx) & PSN_MASK;
        let opcode = match (self.verb, first, last) {
            (Verb::Write, true, true) => op::WRITE_ONLY,
            (Verb::Write, true, false) => op::WRITE_FIRST,
            (Verb::Write, false, false) => op::WRITE_MIDDLE,
            (Verb::Write, false, true) => op::WRITE_LAST,
            (Verb::Send, true, true) => op::SEND_ONLY,
            (Verb::Send, true, false) => op::SEND_FIRST,
            (Verb::Send, false, false) => op::SEND_MIDDLE,
            (Verb::Send, false, true) => op::SEND_LAST,
        };
        let payload_len = if last {
            self.msg_size - self.mtu * (self.pkts - 1)
        } else {
            self.mtu
        };
        let retransmission = psn_ahead(self.high, psn).is_none();
        if first && !retransmission {
            self.outstanding.push_back(self.msg_start);
            if self.outstanding.len() > MAX_OUTSTANDING {
                self.outstanding.pop_front();
            }
        }
        if !retransmission {
            self.high = (psn + 1) & PSN_MASK;
        }
        self.stats.packets += 1;
        self.stats.bytes += payload_len as u64;
        self.stats.retransmitted += retransmission as u64;
        self.idx += 1;
        if last {
            self.idx = 0;
            self.msg_start = (self.msg_start + self.pkts) & PSN_MASK;
        }
        PacketPlan {
            opcode,
            psn,
            ack_req: last,
            payload_len,
            pad: if last {
                ((4 - payload_len % 4) % 4) as u8
            } else {
                0
            },
            reth_len: (self.verb == Verb::Write && first).then_some(self.msg_size),
            retransmission,
        }
    }

    /// An ACK for `psn`: every message whose last packet is at or before it is complete.
    pub fn on_ack(&mut self, psn: u32) {
        self.stats.acks += 1;
        while let Some(&start) = self.outstanding.front() {
            let last = (start + self.pkts - 1) & PSN_MASK;
            if psn_ahead(last, psn).is_some() {
                self.outstanding.pop_front();
                self.stats.messages_acked += 1;
            } else {
                break;
            }
        }
    }

    /// A PSN sequence error NAK: the responder expects `psn` next; go back to it.
    pub fn on_nak_psn_seq_err(&mut self, psn: u32) {
        self.stats.naks_psn_seq_err += 1;
        // Everything before `psn` arrived: complete the messages that ended before it.
        self.on_ack_silent((psn.wrapping_sub(1)) & PSN_MASK);
        let Some(&start) = self.outstanding.iter().find(|&&s| {
            let off = psn.wrapping_sub(s) & PSN_MASK;
            off < self.pkts
        }) else {
            return; // not a PSN we can resend (forgotten, or never sent)
        };
        self.msg_start = start;
        self.idx = psn.wrapping_sub(start) & PSN_MASK;
    }

    fn on_ack_silent(&mut self, psn: u32) {
        let acks = self.stats.acks;
        self.on_ack(psn);
        self.stats.acks = acks;
    }

    pub fn on_nak_other(&mut self) {
        self.stats.naks_other += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn take(r: &mut Requester, n: usize) -> Vec<PacketPlan> {
        (0..n).map(|_| r.next_packet()).collect()
    }

    #[test]
    fn write_split_at_mtu_with_increasing_psns() {
        let mut r = Requester::new(Verb::Write, 4096 + 10, 1024, 100);
        assert_eq!(r.packets_per_message(), 5);
        let p = take(&mut r, 6);
        let ops: Vec<u8> = p.iter().map(|x| x.opcode).collect();
        assert_eq!(
            ops,
            [
                op::WRITE_FIRST,
                op::WRITE_MIDDLE,
                op::WRITE_MIDDLE,
                op::WRITE_MIDDLE,
                op::WRITE_LAST,
                op::WRITE_FIRST
            ]
        );
        let psns: Vec<u32> = p.iter().map(|x| x.psn).collect();
        assert_eq!(psns, [100, 101, 102, 103, 104, 105]);
        assert_eq!(p[0].reth_len, Some(4106));
        assert_eq!(p[1].reth_len, None);
        assert_eq!(p[4].payload_len, 10);
        assert_eq!(p[4].pad, 2);
        assert!(p[4].ack_req && !p[3].ack_req);
        assert!(p.iter().all(|x| !x.retransmission));
    }

    #[test]
    fn small_messages_are_only_packets_and_psn_wraps() {
        let mut r = Requester::new(Verb::Send, 100, 1024, 0xff_fffe);
        let p = take(&mut r, 3);
        assert!(
            p.iter()
                .all(|x| x.opcode == op::SEND_ONLY && x.ack_req && x.payload_len == 100)
        );
        assert_eq!(
            p.iter().map(|x| x.psn).collect::<Vec<_>>(),
            [0xff_fffe, 0xff_ffff, 0]
        );
        let mut w = Requester::new(Verb::Write, 64, 1024, 0);
        assert_eq!(w.next_packet().opcode, op::WRITE_ONLY);
    }

    #[test]
    fn nak_goes_back_to_the_naked_psn_and_acks_complete_messages() {
        let mut r = Requester::new(Verb::Write, 3 * 1024, 1024, 0);
        take(&mut r, 7); // messages at 0, 3, and packet 6 of the third
        r.on_ack(2);
        assert_eq!(r.stats.messages_acked, 1);
        r.on_nak_psn_seq_err(4); // 3 arrived, 4 was lost
        let p = take(&mut r, 4);
        assert_eq!(p.iter().map(|x| x.psn).collect::<Vec<_>>(), [4, 5, 6, 7]);
        assert_eq!(p[0].opcode, op::WRITE_MIDDLE);
        assert!(p[0].retransmission && p[2].retransmission && !p[3].retransmission);
        assert_eq!(r.stats.retransmitted, 3);
        assert_eq!(r.stats.naks_psn_seq_err, 1);
        r.on_ack(8);
        assert_eq!(r.stats.messages_acked, 3);
        assert_eq!(r.stats.acks, 2);
    }
}
