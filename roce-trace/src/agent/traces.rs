//! Traces a collector asks an agent for. A trace sends probes into the fabric from this
//! host, so the agent decides what it sends, not the collector:
//!
//! - only a flow this host was seen **sending** (at one of its own egress points) within
//!   the last [`SOURCE_TTL`], and the probes carry the source, destination, port and
//!   class that were observed, never what the request says;
//! - at most [`MAX_RUNNING`] traces at once, [`MAX_WAITING`] more waiting, and a budget of
//!   [`BURST`] traces then [`PER_SECOND`] a second for the agent as a whole.
//!
//! Every request's outcome is counted (`roce_trace_trace_requests_total{outcome}`).

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use crate::{budget::TokenBucket, observation::FlowId};

/// How long a flow counts as this host's after its last packet was seen leaving.
pub const SOURCE_TTL: Duration = Duration::from_secs(300);
/// Flows remembered as this host's, at most (an entry is ~50 bytes: ≤ 3.5 MiB). Past it,
/// new flows are not remembered (and cannot be traced) until old ones expire.
pub const MAX_SOURCES: usize = 65_536;
/// Traces running at once (each is a blocking job sending up to 32 probes).
pub const MAX_RUNNING: usize = 2;
/// Requests waiting for a running trace to end, at most; more are refused as busy.
pub const MAX_WAITING: usize = 64;
/// The agent's trace budget: a burst, then a steady rate (a trace is ≤ 32 probes, so
/// ≤ 16 probes a second sustained).
pub const BURST: u32 = 32;
pub const PER_SECOND: f64 = 0.5;

/// The class a flow was seen leaving with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SourceClass {
    pub dscp: u8,
    pub ecn: u8,
}

/// Flows this host was seen sending: bounded in number and age.
#[derive(Default)]
pub struct Sources {
    seen: HashMap<FlowId, (SourceClass, Instant)>,
    /// New flows not remembered because the table was full.
    pub full: u64,
}

impl Sources {
    /// `flow` left this host at `now` with `class`.
    pub fn saw(&mut self, flow: FlowId, class: SourceClass, now: Instant) {
        let n = self.seen.len();
        match self.seen.get_mut(&flow) {
            Some(e) => *e = (class, now),
            None if n < MAX_SOURCES => {
                self.seen.insert(flow, (class, now));
            }
            None => self.full += 1,
        }
    }

    /// Forgets flows not seen leaving since `SOURCE_TTL` before `now`.
    pub fn expire(&mut self, now: Instant) {
        self.seen
            .retain(|_, (_, at)| now.saturating_duration_since(*at) <= SOURCE_TTL);
    }

    /// The class `flow` was last seen leaving with, if that was recent.
    pub fn class_of(&self, flow: &FlowId, now: Instant) -> Option<SourceClass> {
        let (c, at) = self.seen.get(flow)?;
        (now.saturating_duration_since(*at) <= SOURCE_TTL).then_some(*c)
    }

    pub fn len(&self) -> usize {
        self.seen.len()
    }
}

/// Why a request was not traced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// Not a flow this host was seen sending (lately).
    Unseen,
    /// Past the agent's budget.
    Budget,
    /// Too many traces running and waiting.
    Busy,
}

impl Refused {
    pub fn why(self) -> &'static str {
        match self {
            Refused::Unseen => "this host has not sent that flow lately",
            Refused::Budget => "past the agent's trace budget",
            Refused::Busy => "too many traces running and waiting",
        }
    }
}

/// What the agent did with the requests it got.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Outcomes {
    pub traced: u64,
    /// Admitted, but tracing failed (a socket, a bind): logged.
    pub failed: u64,
    pub unseen: u64,
    pub budget: u64,
    pub busy: u64,
}

impl Outcomes {
    pub fn rows(&self) -> [(&'static str, u64); 5] {
        [
            ("traced", self.traced),
            ("failed", self.failed),
            ("unseen", self.unseen),
            ("budget", self.budget),
            ("busy", self.busy),
        ]
    }
}

/// Decides which requests are traced: the flow, the budget, the queue.
pub struct Gate {
    pub sources: Sources,
    budget: TokenBucket,
    /// Admitted and not finished (running or waiting).
    in_flight: usize,
    pub outcomes: Outcomes,
}

impl Default for Gate {
    fn default() -> Self {
        Self {
            sources: Sources::default(),
            budget: TokenBucket::new(BURST, PER_SECOND),
            in_flight: 0,
            outcomes: Outcomes::default(),
        }
    }
}

impl Gate {
    /// A request to trace `flow` at `now`: the class to send it with, or why not. Each
    /// admitted request must be [`Gate::finished`] once.
    pub fn admit(&mut self, flow: &FlowId, now: Instant) -> Result<SourceClass, Refused> {
        let r = self.decide(flow, now);
        match r {
            Ok(_) => self.in_flight += 1,
            Err(Refused::Unseen) => self.outcomes.unseen += 1,
            Err(Refused::Budget) => self.outcomes.budget += 1,
            Err(Refused::Busy) => self.outcomes.busy += 1,
        }
        r
    }

    fn decide(&mut self, flow: &FlowId, now: Instant) -> Result<SourceClass, Refused> {
        let class = self.sources.class_of(flow, now).ok_or(Refused::Unseen)?;
        if self.in_flight >= MAX_RUNNING + MAX_WAITING {
            return Err(Refused::Busy);
        }
        if !self.budget.take(now) {
            return Err(Refused::Budget);
        }
        Ok(class)
    }

    /// An admitted trace ended, `ok` or not.
    pub fn finished(&mut self, ok: bool) {
        self.in_flight = self.in_flight.saturating_sub(1);
        if ok {
            self.outcomes.traced += 1;
        } else {
            self.outcomes.failed += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flow(sport: u16) -> FlowId {
        FlowId {
            src: [10, 10, 1, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            dst: [10, 10, 3, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            ip_version: 4,
            udp_sport: sport,
            dest_qp: 0x101,
        }
    }

    const DATA: SourceClass = SourceClass { dscp: 26, ecn: 2 };

    #[test]
    fn only_flows_seen_leaving_lately_are_traced_with_the_class_they_left_with() {
        let t0 = Instant::now();
        let mut g = Gate::default();
        assert_eq!(g.admit(&flow(1), t0), Err(Refused::Unseen), "never seen");
        g.sources.saw(flow(1), DATA, t0);
        assert_eq!(g.admit(&flow(1), t0), Ok(DATA));
        g.finished(true);
        // Another port of the same QP pair is another flow.
        assert_eq!(g.admit(&flow(2), t0), Err(Refused::Unseen));
        // Seen again with another class: that class.
        let cs1 = SourceClass { dscp: 8, ecn: 0 };
        g.sources.saw(flow(1), cs1, t0 + Duration::from_secs(1));
        assert_eq!(g.admit(&flow(1), t0 + Duration::from_secs(2)), Ok(cs1));
        g.finished(false);
        // Not seen for longer than the TTL: refused, and forgotten by expire.
        let late = t0 + Duration::from_secs(1) + SOURCE_TTL + Duration::from_millis(1);
        assert_eq!(g.admit(&flow(1), late), Err(Refused::Unseen));
        g.sources.expire(late);
        assert_eq!(g.sources.len(), 0);
        assert_eq!(
            g.outcomes,
            Outcomes {
                traced: 1,
                failed: 1,
                unseen: 3,
                ..Default::default()
            }
        );
    }

    #[test]
    fn the_budget_and_the_queue_bound_what_runs() {
        let t0 = Instant::now();
        let mut g = Gate::default();
        for s in 0..200 {
            g.sources.saw(flow(s), DATA, t0);
        }
        // The burst, all admitted at once (none finished): then busy before the budget
        // is spent only if the queue is shorter than the burst.
        let admitted = (0..200).filter(|s| g.admit(&flow(*s), t0).is_ok()).count();
        assert_eq!(admitted, (BURST as usize).min(MAX_RUNNING + MAX_WAITING));
        assert_eq!(g.outcomes.budget + g.outcomes.busy, 200 - admitted as u64);
        for _ in 0..admitted {
            g.finished(true);
        }
        // Two seconds refill one trace at 0.5 a second.
        let t1 = t0 + Duration::from_secs(2);
        assert!(g.admit(&flow(0), t1).is_ok());
        assert_eq!(g.admit(&flow(1), t1), Err(Refused::Budget));
    }

    #[test]
    fn a_full_queue_is_busy() {
        let t0 = Instant::now();
        let mut g = Gate {
            budget: TokenBucket::new(1_000, 1.0),
            ..Default::default()
        };
        g.sources.saw(flow(1), DATA, t0);
        for _ in 0..MAX_RUNNING + MAX_WAITING {
            assert!(g.admit(&flow(1), t0).is_ok());
        }
        assert_eq!(g.admit(&flow(1), t0), Err(Refused::Busy));
        g.finished(true);
        assert!(g.admit(&flow(1), t0).is_ok(), "room again once one ended");
    }

    #[test]
    fn the_table_of_sources_is_bounded() {
        let t0 = Instant::now();
        let mut s = Sources::default();
        for i in 0..MAX_SOURCES as u32 + 10 {
            let mut f = flow(1);
            f.dest_qp = i;
            s.saw(f, DATA, t0);
        }
        assert_eq!(s.len(), MAX_SOURCES);
        assert_eq!(s.full, 10);
        // A flow it holds is still renewed when full.
        s.saw(flow(1), DATA, t0 + Duration::from_secs(1));
        assert_eq!(s.len(), MAX_SOURCES);
    }
}
