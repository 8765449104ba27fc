//! A token bucket: what lets a burst through and then a steady rate. The collector's
//! `/trace` and each agent's probes on request are paced by one.

use std::time::Instant;

#[derive(Clone, Debug)]
pub struct TokenBucket {
    burst: f64,
    per_second: f64,
    tokens: f64,
    at: Option<Instant>,
}

impl TokenBucket {
    /// Full at first: `burst` at once, then `per_second`.
    pub fn new(burst: u32, per_second: f64) -> Self {
        Self {
            burst: f64::from(burst),
            per_second,
            tokens: f64::from(burst),
            at: None,
        }
    }

    pub fn burst(&self) -> f64 {
        self.burst
    }

    pub fn per_second(&self) -> f64 {
        self.per_second
    }

    /// Takes one token if there is one at `now`.
    pub fn take(&mut self, now: Instant) -> bool {
        if let Some(t) = self.at {
            let since = now.saturating_duration_since(t).as_secs_f64();
            self.tokens = (self.tokens + since * self.per_second).min(self.burst);
        }
        self.at = Some(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_burst_then_the_rate() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(3, 2.0);
        assert!((0..3).all(|_| b.take(t0)));
        assert!(!b.take(t0), "past the burst");
        // Half a second refills one token at 2 a second, and no more.
        let t1 = t0 + Duration::from_millis(500);
        assert!(b.take(t1));
        assert!(!b.take(t1));
        // A long pause refills to the burst, never beyond it.
        let t2 = t1 + Duration::from_secs(3600);
        assert_eq!((0..10).filter(|_| b.take(t2)).count(), 3);
        // A clock that goes back refills nothing.
        assert!(!b.take(t0));
    }
}
