//! What the agent holds for the collector, and what became of it. Records (observations,
//! counter deltas) wait in a queue until written, then stay in flight until the collector
//! acknowledges the frame that carried them; a connection that breaks first leaves them to
//! the next handshake, whose WELCOME says how much of that connection the collector
//! processed: the rest is sent again. Queued and in-flight records share one bound; when it
//! is reached the oldest go first.

use std::collections::VecDeque;

use bytes::Bytes;
use serde::Serialize;

use crate::{
    observation::{CounterDelta, NicDelta, Observation, PointHealth},
    protocol::{Encoder, Frame, MAX_BATCH, ProtoError},
};

/// What became of one kind of record. Every record made is, at any moment, acknowledged,
/// dropped, or still held: `made == acked + dropped + pending()`.
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq, Eq)]
pub struct Delivery {
    /// Taken from the datapath (or the capture).
    pub made: u64,
    /// Written to a collector, re-sends included.
    pub sent: u64,
    /// Of `sent`, written again after a reconnection: the collector had not processed them.
    pub resent: u64,
    /// Processed by a collector: it acknowledged the frames that carried them.
    pub acked: u64,
    /// Given up because the buffer was full (the oldest first), unless a collector had
    /// processed them already.
    pub dropped: u64,
}

impl Delivery {
    /// Neither acknowledged nor dropped: still queued or in flight.
    pub fn pending(&self) -> u64 {
        self.made - self.acked - self.dropped
    }
}

/// A frame written on the current connection (or the last one, until the next handshake)
/// and not acknowledged yet.
struct InFlight<T> {
    seq: u64,
    /// Its records, kept to be sent again.
    records: VecDeque<T>,
    /// Its records given up to make room: acknowledged with the frame or dropped with it,
    /// never sent again.
    released: u64,
}

/// One kind of record on its way to the collector.
struct Lane<T> {
    /// Not yet written on the current connection, oldest first.
    queued: VecDeque<T>,
    /// How many of `queued`, from the front, were written on an earlier connection.
    requeued: usize,
    in_flight: VecDeque<InFlight<T>>,
    /// Records kept in `in_flight`.
    held: usize,
    cap: usize,
    stats: Delivery,
}

impl<T> Lane<T> {
    fn new(cap: usize) -> Self {
        Self {
            queued: VecDeque::new(),
            requeued: 0,
            in_flight: VecDeque::new(),
            held: 0,
            cap,
            stats: Delivery::default(),
        }
    }

    fn push(&mut self, r: T) {
        self.stats.made += 1;
        if self.queued.len() + self.held >= self.cap {
            self.give_up_oldest();
        }
        self.queued.push_back(r);
    }

    /// Makes room: the oldest record goes — the newest say most about now. One in flight
    /// is released (its fate is its frame's); a queued one is dropped.
    fn give_up_oldest(&mut self) {
        if let Some(f) = self.in_flight.iter_mut().find(|f| !f.records.is_empty()) {
            f.records.pop_front();
            f.released += 1;
            self.held -= 1;
        } else if self.queued.pop_front().is_some() {
            self.requeued = self.requeued.saturating_sub(1);
            self.stats.dropped += 1;
        }
    }

    /// Up to `max` queued records, oldest first, and how many of them were written on an
    /// earlier connection; `None` when none is. [`Lane::written`] or [`Lane::refused`]
    /// says what became of them.
    fn take(&mut self, max: usize) -> Option<(Vec<T>, usize)> {
        let n = self.queued.len().min(max);
        if n == 0 {
            return None;
        }
        let again = n.min(self.requeued);
        self.requeued -= again;
        Some((self.queued.drain(..n).collect(), again))
    }

    /// `records` (`again` of them sent before) were written as frame `seq`: counted as
    /// sent and held until it is acknowledged.
    fn written(&mut self, seq: u64, records: Vec<T>, again: usize) {
        self.stats.sent += records.len() as u64;
        self.stats.resent += again as u64;
        self.held += records.len();
        self.in_flight.push_back(InFlight {
            seq,
            records: records.into(),
            released: 0,
        });
    }

    /// The encoder refused the frame of `n` records (the format cannot carry it): they
    /// could never be sent, and are dropped. The frame took no sequence number.
    fn refused(&mut self, n: usize) {
        self.stats.dropped += n as u64;
    }

    /// Every frame up to `seq` was processed.
    fn ack(&mut self, seq: u64) {
        while self.in_flight.front().is_some_and(|f| f.seq <= seq) {
            let f = self.in_flight.pop_front().expect("front");
            self.held -= f.records.len();
            self.stats.acked += f.records.len() as u64 + f.released;
        }
    }

    /// The connection the frames in flight were written on is over; the collector processed
    /// its frames below `processed` (`None`: it does not know that connection). The rest go
    /// back to the front of the queue, to be sent again; released records of theirs are
    /// dropped.
    fn resume(&mut self, processed: Option<u64>) {
        let mut again = VecDeque::new();
        for f in self.in_flight.drain(..) {
            if processed.is_some_and(|n| f.seq < n) {
                self.stats.acked += f.records.len() as u64 + f.released;
            } else {
                self.stats.dropped += f.released;
                again.extend(f.records);
            }
        }
        self.held = 0;
        self.requeued += again.len();
        again.append(&mut self.queued);
        self.queued = again;
    }

    fn is_empty(&self) -> bool {
        self.queued.is_empty() && self.in_flight.is_empty()
    }
}

/// NIC records held at most (queued and in flight), whatever `--queue` says.
pub(super) const MAX_NIC_HELD: usize = 4096;

/// Observations and counter deltas for the collector (each kind bounded by `--queue`).
pub(super) struct Outbox {
    obs: Lane<Observation>,
    counters: Lane<CounterDelta>,
    /// Each point's health per interval: what proves a loss (or says it cannot be).
    health: Lane<PointHealth>,
    /// Each port's NIC and PFC counters per interval.
    nic: Lane<NicDelta>,
    /// The collector's id of the connection the frames in flight were written on (0: none).
    connection: u64,
    pub(super) connections: u64,
    pub(super) ringbuf_drops: u64,
    /// Frames handed to fleet mode's publisher (their own sequence, never on a connection).
    handed_over: u64,
}

impl Outbox {
    pub(super) fn new(cap: usize) -> Self {
        Self {
            obs: Lane::new(cap),
            counters: Lane::new(cap),
            health: Lane::new(cap),
            // A port's interval is a few kilobytes, not the few dozen bytes of the other
            // records: ten minutes of a busy host's ports at most.
            nic: Lane::new(cap.min(MAX_NIC_HELD)),
            connection: 0,
            connections: 0,
            ringbuf_drops: 0,
            handed_over: 0,
        }
    }

    pub(super) fn push_obs(&mut self, o: Observation) {
        self.obs.push(o);
    }

    pub(super) fn push_counter(&mut self, d: CounterDelta) {
        self.counters.push(d);
    }

    pub(super) fn push_health(&mut self, h: PointHealth) {
        self.health.push(h);
    }

    pub(super) fn push_nic(&mut self, d: NicDelta) {
        self.nic.push(d);
    }

    /// A handshake succeeded: WELCOME named the new connection and what the collector
    /// processed of the node's previous one. What was in flight on our previous connection
    /// is acknowledged as far as that is the same connection, and queued again beyond.
    pub(super) fn welcome(&mut self, connection: u64, previous: u64, previous_frames: u64) {
        let processed = (self.connection != 0 && previous == self.connection).then_some(previous_frames);
        self.obs.resume(processed);
        self.counters.resume(processed);
        self.health.resume(processed);
        self.nic.resume(processed);
        self.connection = connection;
        self.connections += 1;
    }

    /// ACK from the collector on connection `connection`: frames up to `seq` processed.
    pub(super) fn ack(&mut self, connection: u64, seq: u64) {
        if connection == self.connection {
            self.obs.ack(seq);
            self.counters.ack(seq);
            self.health.ack(seq);
            self.nic.ack(seq);
        }
    }

    /// The next data frame to write, stamped by `enc`, its records in flight from now on;
    /// `None` when nothing is queued. Observations go first, at most [`MAX_BATCH`] a
    /// frame (which always fits one). A frame the encoder refuses takes no sequence number
    /// and its records are dropped: the error says why.
    pub(super) fn next_frame(&mut self, enc: &mut Encoder) -> Option<Result<Bytes, ProtoError>> {
        self.next_frame_of(enc, MAX_BATCH)
    }

    fn next_frame_of(&mut self, enc: &mut Encoder, max: usize) -> Option<Result<Bytes, ProtoError>> {
        // The sequence number the frame gets if it is encoded (a refused one takes none).
        let seq = enc.next_seq();
        if let Some((obs, again)) = self.obs.take(max) {
            let f = Frame::Observations(obs);
            let bytes = enc.encode(&f);
            if let Frame::Observations(obs) = f {
                if bytes.is_ok() {
                    self.obs.written(seq, obs, again);
                } else {
                    self.obs.refused(obs.len());
                }
            }
            return Some(bytes);
        }
        if let Some((v, again)) = self.health.take(max) {
            let f = Frame::Health(v);
            let bytes = enc.encode(&f);
            if let Frame::Health(v) = f {
                if bytes.is_ok() {
                    self.health.written(seq, v, again);
                } else {
                    self.health.refused(v.len());
                }
            }
            return Some(bytes);
        }
        // A port's record is small (a few hundred bytes): 64 ports a frame fit any limit.
        if let Some((v, again)) = self.nic.take(max.min(64)) {
            let f = Frame::Nic(v);
            let bytes = enc.encode(&f);
            if let Frame::Nic(v) = f {
                if bytes.is_ok() {
                    self.nic.written(seq, v, again);
                } else {
                    self.nic.refused(v.len());
                }
            }
            return Some(bytes);
        }
        let (deltas, again) = self.counters.take(max)?;
        let f = Frame::Counters(deltas);
        let bytes = enc.encode(&f);
        if let Frame::Counters(deltas) = f {
            if bytes.is_ok() {
                self.counters.written(seq, deltas, again);
            } else {
                self.counters.refused(deltas.len());
            }
        }
        Some(bytes)
    }

    /// The next data frame, handed over for good: fleet mode's publisher holds, resends
    /// and counts it from here (its records count as sent and acknowledged here).
    pub(super) fn hand_over(&mut self) -> Option<Frame> {
        fn take<T: Clone>(lane: &mut Lane<T>, seq: &mut u64) -> Option<Vec<T>> {
            let (v, again) = lane.take(MAX_BATCH)?;
            *seq += 1;
            lane.written(*seq, v.clone(), again);
            lane.ack(*seq);
            Some(v)
        }
        let seq = &mut self.handed_over;
        if let Some(v) = take(&mut self.obs, seq) {
            return Some(Frame::Observations(v));
        }
        if let Some(v) = take(&mut self.health, seq) {
            return Some(Frame::Health(v));
        }
        if let Some(v) = take(&mut self.nic, seq) {
            return Some(Frame::Nic(v));
        }
        take(&mut self.counters, seq).map(Frame::Counters)
    }

    /// Everything made was acknowledged or dropped.
    pub(super) fn is_empty(&self) -> bool {
        self.obs.is_empty() && self.counters.is_empty() && self.health.is_empty() && self.nic.is_empty()
    }

    /// Observations and counter deltas dropped so far (the DROPPED frame).
    pub(super) fn dropped(&self) -> (u64, u64) {
        (self.obs.stats.dropped, self.counters.stats.dropped)
    }

    pub(super) fn observations(&self) -> Delivery {
        self.obs.stats
    }

    pub(super) fn counters(&self) -> Delivery {
        self.counters.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::BytesMut;

    use crate::protocol::Decoder;

    fn obs(psn: u32) -> Observation {
        let mut o = Observation::default();
        o.id.psn = psn;
        o
    }

    /// A connection past its HELLO (frame 0): frames stamped by `enc`, read back by `dec`.
    struct Wire {
        enc: Encoder,
        dec: Decoder,
    }

    impl Wire {
        fn new() -> Self {
            let mut w = Self {
                enc: Encoder::default(),
                dec: Decoder::default(),
            };
            let hello = w.enc.encode(&Frame::Heartbeat { unix_ns: 0 }).unwrap();
            w.dec.decode(&mut BytesMut::from(&hello[..])).unwrap();
            w
        }

        /// Writes everything queued; each frame's sequence number and PSNs (or number of
        /// counter deltas).
        fn write_all(&mut self, ob: &mut Outbox) -> Vec<(u64, Vec<u32>)> {
            let mut out = Vec::new();
            while let Some(b) = ob.next_frame(&mut self.enc) {
                let b = b.unwrap();
                let seq = self.dec.next_seq();
                match self.dec.decode(&mut BytesMut::from(&b[..])).unwrap() {
                    Some(Frame::Observations(v)) => out.push((seq, v.iter().map(|o| o.id.psn).collect())),
                    Some(Frame::Counters(deltas)) => out.push((seq, vec![deltas.len() as u32])),
                    other => panic!("{other:?}"),
                }
            }
            out
        }
    }

    fn invariant(ob: &Outbox) {
        for d in [ob.observations(), ob.counters()] {
            assert!(d.acked + d.dropped <= d.made, "{d:?}");
        }
        assert!(ob.obs.queued.len() + ob.obs.held <= ob.obs.cap);
        assert_eq!(
            ob.obs.held,
            ob.obs.in_flight.iter().map(|f| f.records.len()).sum::<usize>()
        );
    }

    /// NIC records are kilobytes each: their lane holds at most MAX_NIC_HELD whatever the
    /// queue allows, the oldest dropped first.
    #[test]
    fn nic_records_are_bounded_apart_from_the_queue() {
        let mut ob = Outbox::new(100_000);
        for i in 0..(MAX_NIC_HELD as u64 + 500) {
            ob.push_nic(NicDelta {
                start_ns: i,
                ..Default::default()
            });
        }
        assert_eq!(ob.nic.queued.len(), MAX_NIC_HELD);
        assert_eq!(ob.nic.stats.dropped, 500);
        assert_eq!(
            ob.nic.queued.front().map(|d| d.start_ns),
            Some(500),
            "the oldest went first"
        );
    }

    #[test]
    fn acknowledged_frames_leave_the_buffer_and_are_counted() {
        let mut ob = Outbox::new(100);
        ob.welcome(11, 0, 0);
        let mut w = Wire::new();
        for p in 0..10 {
            ob.push_obs(obs(p));
        }
        assert_eq!(w.write_all(&mut ob), vec![(1, (0..10).collect())]);
        for p in 10..15 {
            ob.push_obs(obs(p));
        }
        assert_eq!(w.write_all(&mut ob), vec![(2, (10..15).collect())]);
        ob.ack(11, 1);
        assert_eq!(ob.observations().acked, 10);
        ob.ack(99, 2); // another connection's ACK is not ours
        assert_eq!(ob.observations().acked, 10);
        ob.ack(11, 2);
        assert_eq!(
            ob.observations(),
            Delivery {
                made: 15,
                sent: 15,
                resent: 0,
                acked: 15,
                dropped: 0
            }
        );
        assert!(ob.is_empty());
        invariant(&ob);
    }

    /// The connection breaks with two frames in flight; the collector had processed the
    /// first. Only the second is sent again — or both, when the collector is another one
    /// (it does not know our connection).
    #[test]
    fn after_a_reconnection_exactly_what_was_not_processed_is_sent_again() {
        for (same_collector, want_again) in [(true, (5..8).collect::<Vec<u32>>()), (false, (0..8).collect())]
        {
            let mut ob = Outbox::new(100);
            ob.welcome(21, 0, 0);
            let mut w = Wire::new();
            (0..5).for_each(|p| ob.push_obs(obs(p)));
            w.write_all(&mut ob); // frame 1
            (5..8).for_each(|p| ob.push_obs(obs(p)));
            w.write_all(&mut ob); // frame 2
            (8..10).for_each(|p| ob.push_obs(obs(p))); // queued while away
            // Frames 0 and 1 processed: the next is 2.
            let previous = if same_collector { 21 } else { 77 };
            ob.welcome(22, previous, 2);
            let mut w = Wire::new();
            let again: Vec<u32> = want_again.iter().copied().chain(8..10).collect();
            assert_eq!(w.write_all(&mut ob), vec![(1, again)]);
            ob.ack(22, 1);
            let d = ob.observations();
            assert_eq!((d.made, d.acked, d.dropped), (10, 10, 0));
            assert_eq!(d.resent, want_again.len() as u64);
            assert_eq!(d.sent, 10 + d.resent);
            invariant(&ob);
        }
    }

    /// A full buffer: queued and in-flight records count together; the oldest in flight is
    /// released first — acknowledged if its frame is, dropped if the connection breaks
    /// before — then queued ones are dropped.
    #[test]
    fn a_full_buffer_gives_up_the_oldest_and_counts_each_exactly_once() {
        let mut ob = Outbox::new(4);
        ob.welcome(31, 0, 0);
        let mut w = Wire::new();
        (0..3).for_each(|p| ob.push_obs(obs(p)));
        w.write_all(&mut ob); // frame 1: 0, 1, 2 in flight
        (3..6).for_each(|p| ob.push_obs(obs(p))); // 0 and 1 released to make room
        invariant(&ob);
        assert_eq!(ob.obs.in_flight[0].released, 2);
        // Acknowledged: the released two were delivered all the same.
        ob.ack(31, 1);
        assert_eq!((ob.observations().acked, ob.observations().dropped), (3, 0));
        w.write_all(&mut ob); // frame 2: 3, 4, 5
        (6..9).for_each(|p| ob.push_obs(obs(p))); // 3, 4 released
        // The connection breaks; a collector that knows nothing of it.
        ob.welcome(32, 0, 0);
        let d = ob.observations();
        assert_eq!((d.acked, d.dropped, d.pending()), (3, 2, 4));
        assert_eq!(
            ob.obs.queued.iter().map(|o| o.id.psn).collect::<Vec<_>>(),
            vec![5, 6, 7, 8]
        );
        // More while full: queued ones go, the re-queued first.
        ob.push_obs(obs(9));
        assert_eq!(ob.observations().dropped, 3);
        let mut w = Wire::new();
        assert_eq!(w.write_all(&mut ob), vec![(1, vec![6, 7, 8, 9])]);
        ob.ack(32, 1);
        let d = ob.observations();
        assert_eq!(
            d,
            Delivery {
                made: 10,
                sent: 10,
                resent: 0, // 5 was dropped before it could be sent again
                acked: 7,
                dropped: 3
            }
        );
        assert_eq!(d.pending(), 0);
        invariant(&ob);
    }

    #[test]
    fn counter_deltas_travel_in_their_own_frames_and_are_acknowledged_alike() {
        let mut ob = Outbox::new(10);
        ob.welcome(41, 0, 0);
        let mut w = Wire::new();
        ob.push_obs(obs(1));
        (0..3).for_each(|_| ob.push_counter(CounterDelta::default()));
        assert_eq!(w.write_all(&mut ob), vec![(1, vec![1]), (2, vec![3])]);
        ob.ack(41, 1);
        assert_eq!((ob.observations().acked, ob.counters().acked), (1, 0));
        ob.ack(41, 2);
        assert_eq!(ob.counters().acked, 3);
        assert!(ob.is_empty());
    }

    /// A frame the encoder refuses takes no sequence number: its records are dropped (not
    /// held in flight under the next frame's number, where that frame's ACK would count
    /// them as processed), and the frames after it are numbered and acknowledged as ever.
    #[test]
    fn a_refused_frame_takes_no_sequence_number_and_its_records_are_dropped() {
        let mut ob = Outbox::new(100_000);
        ob.welcome(51, 0, 0);
        let mut w = Wire::new();
        // More observations than a frame can carry, in one batch: refused.
        (0..61_000).for_each(|p| ob.push_obs(obs(p)));
        let seq = w.enc.next_seq();
        let r = ob.next_frame_of(&mut w.enc, usize::MAX).expect("a batch");
        assert!(
            matches!(r, Err(crate::protocol::ProtoError::Unrepresentable(_))),
            "{r:?}"
        );
        assert_eq!(w.enc.next_seq(), seq, "the refused frame took no number");
        let d = ob.observations();
        assert_eq!((d.made, d.sent, d.dropped, d.pending()), (61_000, 0, 61_000, 0));
        // A refused frame of another kind between two data frames shifts nothing either.
        ob.push_obs(obs(1));
        assert_eq!(w.write_all(&mut ob), vec![(seq, vec![1])]);
        let point = crate::observation::PointDecl {
            index: 0,
            direction: 0,
            ifindex: 1,
            mtu: 0,
            iface: "eth0".into(),
            node: String::new(),
        };
        assert!(w.enc.encode(&Frame::Points(vec![point; 65_536])).is_err());
        ob.push_obs(obs(2));
        assert_eq!(w.write_all(&mut ob), vec![(seq + 1, vec![2])]);
        ob.ack(51, seq);
        assert_eq!(ob.observations().acked, 1);
        ob.ack(51, seq + 1);
        let d = ob.observations();
        assert_eq!((d.made, d.sent, d.acked, d.dropped), (61_002, 2, 2, 61_000));
        assert!(ob.is_empty());
        invariant(&ob);
        // The normal path never refuses: at most MAX_BATCH a frame, which always fits.
        (0..61_000).for_each(|p| ob.push_obs(obs(p)));
        let frames = w.write_all(&mut ob);
        assert_eq!(frames.len(), 61_000usize.div_ceil(MAX_BATCH));
        let d = ob.observations();
        assert_eq!((d.sent, d.dropped), (61_002, 61_000));
    }
}
