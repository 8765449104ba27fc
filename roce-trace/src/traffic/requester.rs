//! An RC requester's send side: messages split at the path MTU into PSN-numbered packets,
//! go-back-N retransmission from a NAKed PSN, completion on ACK, and — as an RC QP does —
//! a local ACK timeout: when nothing is acknowledged for the timeout while messages are
//! outstanding, it goes back to the oldest unacknowledged message, up to a retry count,
//! after which the QP is in error and stops (a lost retransmission or a lost NAK never
//! stalls it for good).

use std::{collections::VecDeque, time::Duration};

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
    /// Messages started (first packet sent for the first time).
    pub messages_sent: u64,
    /// Local ACK timeouts: nothing acknowledged for the timeout, went back to the oldest
    /// unacknowledged message.
    pub timeouts: u64,
    /// The QP gave up after its retry count of timeouts in a row (as an RC QP moves to the
    /// error state with a retry-exceeded completion).
    pub retry_exceeded: bool,
}

/// RC's local ACK timeout and retry count. Defaults as a NIC is commonly configured:
/// timeout exponent 14 (4.096 µs × 2^14 ≈ 67 ms) and 7 retries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AckTimeout {
    pub timeout: Duration,
    pub retries: u32,
}

impl Default for AckTimeout {
    fn default() -> Self {
        Self {
            timeout: Duration::from_nanos(4096 << 14),
            retries: 7,
        }
    }
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
    /// When the requester last made progress (an ACK completed a message, or it had
    /// nothing outstanding), and the timeouts in a row since.
    last_progress: Duration,
    progressed: bool,
    retries_in_row: u32,
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
            last_progress: Duration::ZERO,
            progressed: false,
            retries_in_row: 0,
            stats: RequesterStats::default(),
        }
    }

    /// Whether the next packet belongs to a message already started (the rest of it, or a
    /// retransmission) rather than a new message.
    pub fn mid_message(&self) -> bool {
        self.idx != 0 || self.msg_start != self.high
    }

    /// Messages sent and not yet acknowledged.
    pub fn unacked(&self) -> usize {
        self.outstanding.len()
    }

    /// Whether the QP may send: not in error.
    pub fn usable(&self) -> bool {
        !self.stats.retry_exceeded
    }

    /// The local ACK timeout at `now`: when messages are outstanding and nothing was
    /// acknowledged for `t.timeout`, go back to the oldest unacknowledged message; after
    /// `t.retries` timeouts in a row the QP is in error. Returns true when it timed out.
    pub fn check_timeout(&mut self, now: Duration, t: AckTimeout) -> bool {
        if std::mem::take(&mut self.progressed) || self.outstanding.is_empty() || !self.usable() {
            self.last_progress = now;
            return false;
        }
        if now.saturating_sub(self.last_progress) < t.timeout {
            return false;
        }
        self.last_progress = now;
        if self.retries_in_row >= t.retries {
            self.stats.retry_exceeded = true;
            return true;
        }
        self.retries_in_row += 1;
        self.stats.timeouts += 1;
        let oldest = *self.outstanding.front().expect("not empty");
        self.msg_start = oldest;
        self.idx = 0;
        true
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
            self.stats.messages_sent += 1;
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
                self.progress();
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

    /// An acknowledgement completed a message: the timer restarts, the retries reset.
    fn progress(&mut self) {
        self.retries_in_row = 0;
        // The timer restarts at the next check, which knows the time.
        self.progressed = true;
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
        assert_eq!(r.stats.messages_sent, 3);
    }

    /// A lost retransmission (or a lost NAK) leaves the responder silent: the local ACK
    /// timeout goes back to the oldest unacknowledged message, and only a timeout with no
    /// acknowledgement in between counts towards the retry limit.
    #[test]
    fn ack_timeout_goes_back_to_the_oldest_unacked_message_then_gives_up() {
        let ms = Duration::from_millis;
        let t = AckTimeout {
            timeout: ms(10),
            retries: 2,
        };
        let mut r = Requester::new(Verb::Write, 2 * 1024, 1024, 0);
        assert!(!r.check_timeout(ms(0), t), "nothing outstanding");
        take(&mut r, 6); // messages at 0, 2, 4
        assert!(!r.check_timeout(ms(5), t));
        r.on_ack(1); // message 0 done: progress restarts the timer
        assert!(!r.check_timeout(ms(9), t));
        assert!(!r.check_timeout(ms(18), t), "9 ms since the progress");
        assert!(r.check_timeout(ms(19), t), "10 ms without progress");
        assert_eq!(r.stats.timeouts, 1);
        assert!(r.mid_message());
        let p = take(&mut r, 5);
        assert_eq!(p.iter().map(|x| x.psn).collect::<Vec<_>>(), [2, 3, 4, 5, 6]);
        assert!(p[..4].iter().all(|x| x.retransmission) && !p[4].retransmission);
        assert_eq!(p[0].opcode, op::WRITE_FIRST);
        assert_eq!(r.stats.messages_sent, 4);
        r.on_ack(3); // the retransmission got through: retries reset
        assert!(!r.check_timeout(ms(25), t));
        assert!(r.check_timeout(ms(35), t));
        assert!(r.check_timeout(ms(45), t));
        assert_eq!(r.stats.timeouts, 3);
        assert!(r.usable(), "two in a row is the limit, not past it");
        assert!(r.check_timeout(ms(55), t), "the third in a row exceeds 2 retries");
        assert!(r.stats.retry_exceeded && !r.usable());
        assert_eq!(r.stats.timeouts, 3);
        assert!(!r.check_timeout(ms(100), t), "an errored QP stays quiet");
        assert_eq!(r.unacked(), 2);
    }
}
