//! DCQCN reaction point (Zhu et al., SIGCOMM 2015): cut the rate on a CNP, then recover —
//! fast recovery towards the target rate, then additive increase — while alpha (the
//! congestion estimate) decays when no CNP comes. Time is passed in, so it is testable.

use std::time::Duration;

use serde::Serialize;

#[derive(Clone, Copy, Debug)]
pub struct DcqcnParams {
    /// Rate without congestion (and the ceiling), bits/s.
    pub line_rate: f64,
    pub min_rate: f64,
    /// Alpha gain.
    pub g: f64,
    /// Alpha decays once per this period without a CNP.
    pub alpha_period: Duration,
    /// The rate rises once per this period without a CNP.
    pub increase_period: Duration,
    /// Rate-increase steps of fast recovery before additive increase.
    pub fast_recovery_steps: u32,
    /// Additive increase of the target rate per step, bits/s.
    pub additive_increase: f64,
}

impl DcqcnParams {
    pub fn for_line_rate(line_rate: f64) -> Self {
        Self {
            line_rate,
            min_rate: (line_rate / 1000.0).max(1e6),
            g: 1.0 / 16.0,
            alpha_period: Duration::from_micros(55),
            increase_period: Duration::from_micros(300),
            fast_recovery_steps: 5,
            additive_increase: line_rate / 50.0,
        }
    }
}

#[derive(Clone, Copy, Debug, Serialize, PartialEq)]
pub struct DcqcnState {
    pub current_rate: f64,
    pub target_rate: f64,
    pub alpha: f64,
    pub cnps: u64,
    pub min_rate_seen: f64,
}

pub struct Dcqcn {
    p: DcqcnParams,
    s: DcqcnState,
    last_alpha: Duration,
    last_increase: Duration,
    stage: u32,
}

impl Dcqcn {
    pub fn new(p: DcqcnParams, now: Duration) -> Self {
        Self {
            s: DcqcnState {
                current_rate: p.line_rate,
                target_rate: p.line_rate,
                alpha: 1.0,
                cnps: 0,
                min_rate_seen: p.line_rate,
            },
            p,
            last_alpha: now,
            last_increase: now,
            stage: 0,
        }
    }

    pub fn rate(&self) -> f64 {
        self.s.current_rate
    }

    pub fn state(&self) -> DcqcnState {
        self.s
    }

    pub fn on_cnp(&mut self, now: Duration) {
        let s = &mut self.s;
        s.cnps += 1;
        s.target_rate = s.current_rate;
        s.current_rate = (s.current_rate * (1.0 - s.alpha / 2.0)).max(self.p.min_rate);
        s.alpha = (1.0 - self.p.g) * s.alpha + self.p.g;
        s.min_rate_seen = s.min_rate_seen.min(s.current_rate);
        self.stage = 0;
        self.last_alpha = now;
        self.last_increase = now;
    }

    /// Applies the timers up to `now`.
    pub fn tick(&mut self, now: Duration) {
        while now.saturating_sub(self.last_alpha) >= self.p.alpha_period {
            self.s.alpha *= 1.0 - self.p.g;
            self.last_alpha += self.p.alpha_period;
        }
        while now.saturating_sub(self.last_increase) >= self.p.increase_period {
            self.stage += 1;
            if self.stage > self.p.fast_recovery_steps {
                self.s.target_rate = (self.s.target_rate + self.p.additive_increase).min(self.p.line_rate);
            }
            self.s.current_rate = ((self.s.target_rate + self.s.current_rate) / 2.0).min(self.p.line_rate);
            self.last_increase += self.p.increase_period;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn cnp_cuts_and_time_recovers() {
        let mut d = Dcqcn::new(DcqcnParams::for_line_rate(10e9), Duration::ZERO);
        d.on_cnp(Duration::ZERO);
        // alpha starts at 1: the first CNP halves the rate.
        assert_eq!(d.rate(), 5e9);
        d.on_cnp(Duration::ZERO);
        let after_two = d.rate();
        assert!(after_two < 5e9 && after_two > 2.4e9, "{after_two}");
        // Fast recovery heads back to the target (5 Gbit/s) within a few periods...
        d.tick(2 * MS);
        assert!(d.rate() > 4.9e9, "{}", d.rate());
        // ...and additive increase returns to line rate without further CNPs.
        d.tick(200 * MS);
        assert_eq!(d.rate(), 10e9);
        assert_eq!(d.state().cnps, 2);
        assert!(d.state().alpha < 0.01, "alpha decays without CNPs");
        assert_eq!(d.state().min_rate_seen, after_two);
    }

    #[test]
    fn a_cnp_storm_holds_the_rate_down_but_not_below_the_floor() {
        let p = DcqcnParams::for_line_rate(10e9);
        let mut d = Dcqcn::new(p, Duration::ZERO);
        for i in 0..10_000u64 {
            let t = Duration::from_micros(50 * i);
            d.tick(t);
            d.on_cnp(t);
        }
        assert_eq!(d.rate(), p.min_rate);
    }
}
