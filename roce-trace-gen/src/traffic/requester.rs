//! An RC requester's send side: messages split at the path MTU into PSN-numbered packets,
//! go-back-N retransmission from a NAKed PSN, completion on ACK, and — as an RC QP does —
//! a local ACK timeout: when nothing is acknowledged for the timeout after a packet asked
//! for an acknowledgement, it goes back to the oldest unacknowledged message, up to a retry count,
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
    /// The transport timer: started when a packet asking for an acknowledgement (AckReq)
    /// leaves while it is stopped; stopped by progress (an ACK completing a message) and by
    /// going back (it restarts with the retransmitted AckReq). `ack_req_sent`: one left
    /// since the last check, which knows the time.
    timer: Option<Duration>,
    ack_req_sent: bool,
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
            timer: None,
            ack_req_sent: false,
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
    /// acknowledged for `t.timeout` since an AckReq packet left, go back to the oldest
    /// unacknowledged message; after `t.retries` timeouts in a row the QP is in error.
    /// (The timer runs from the AckReq, not the message's first packet: a paced sender's
    /// long message is not a timeout.) Returns true when it timed out.
    pub fn check_timeout(&mut self, now: Duration, t: AckTimeout) -> bool {
        let sent = std::mem::take(&mut self.ack_req_sent);
        if self.outstanding.is_empty() || !self.usable() {
            self.timer = None;
            return false;
        }
        match self.timer {
            None => {
                if sent {
                    self.timer = Some(now);
                }
                return false;
            }
            Some(started) if now.saturating_sub(started) < t.timeout => return false,
            Some(_) => {}
        }
        self.timer = None;
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
            self.ack_req_sent = true;
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
        self.timer = None;
    }

    /// An acknowledgement completed a message: the timer restarts, the retries reset.
    fn progress(&mut self) {
        self.retries_in_row = 0;
        self.timer = None;
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
    /// timeout — running from the first AckReq sent after the last progress — goes back to
    /// the oldest unacknowledged message; only timeouts with no acknowledgement in between
    /// count towards the retry limit.
    #[test]
    fn ack_timeout_goes_back_to_the_oldest_unacked_message_then_gives_up() {
        let ms = Duration::from_millis;
        let t = AckTimeout {
            timeout: ms(10),
            retries: 2,
        };
        let mut r = Requester::new(Verb::Write, 2 * 1024, 1024, 0);
        assert!(!r.check_timeout(ms(0), t), "nothing outstanding");
        take(&mut r, 1);
        assert!(!r.check_timeout(ms(1), t));
        assert!(
            !r.check_timeout(ms(50), t),
            "a slow message is no timeout: no AckReq yet"
        );
        take(&mut r, 5); // AckReqs on PSNs 1, 3, 5: messages at 0, 2, 4
        assert!(!r.check_timeout(ms(51), t), "the timer starts");
        r.on_ack(1); // message 0 done: the timer stops
        assert!(!r.check_timeout(ms(60), t));
        assert!(
            !r.check_timeout(ms(80), t),
            "stopped until the next AckReq leaves"
        );
        take(&mut r, 2); // message 6
        assert!(!r.check_timeout(ms(81), t));
        assert!(!r.check_timeout(ms(90), t), "9 ms since the AckReq");
        assert!(r.check_timeout(ms(91), t), "10 ms without progress");
        assert_eq!(r.stats.timeouts, 1);
        assert!(r.mid_message());
        let p = take(&mut r, 7);
        assert_eq!(p.iter().map(|x| x.psn).collect::<Vec<_>>(), [2, 3, 4, 5, 6, 7, 8]);
        assert!(p[..6].iter().all(|x| x.retransmission) && !p[6].retransmission);
        assert_eq!(p[0].opcode, op::WRITE_FIRST);
        assert_eq!(r.stats.messages_sent, 5);
        r.on_ack(3); // the retransmission got through: retries reset
        assert!(!r.check_timeout(ms(95), t), "no AckReq since the progress");
        take(&mut r, 1); // PSN 9, AckReq
        assert!(!r.check_timeout(ms(100), t));
        assert!(r.check_timeout(ms(110), t));
        take(&mut r, 2);
        assert!(!r.check_timeout(ms(111), t));
        assert!(r.check_timeout(ms(121), t));
        assert_eq!(r.stats.timeouts, 3);
        assert!(r.usable(), "two in a row is the limit, not past it");
        take(&mut r, 2);
        assert!(!r.check_timeout(ms(122), t));
        assert!(
            r.check_timeout(ms(132), t),
            "the third in a row exceeds 2 retries"
        );
        assert!(r.stats.retry_exceeded && !r.usable());
        assert_eq!(r.stats.timeouts, 3);
        assert!(!r.check_timeout(ms(200), t), "an errored QP stays quiet");
        assert_eq!(r.unacked(), 3, "messages 4, 6 and 8");
    }
}
