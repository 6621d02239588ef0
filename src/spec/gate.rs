//! Whether speculation pays on this device, measured: the seconds per generated token of
//! decode steps with verification (a draft model's rounds included) against those without.
//! Where a verifying step costs more per token than plain decoding (a compute-bound device
//! such as llvmpipe, a draft model too large for its target, proposals that rarely hold), the
//! engine stops speculating for a while and then measures again.
//!
//! The rule: an exponential average of each kind's seconds per token. While fewer than
//! `MIN_SAMPLES` plain steps are known, every other step is plain; after that one step in
//! `EXPLORE_EVERY`. Once both kinds have `MIN_SAMPLES`, a speculating average above the plain
//! one stops speculation for a backoff, after which it is measured afresh: `BACKOFF_MIN` steps,
//! doubled after each backoff up to `BACKOFF_MAX`, and back to `BACKOFF_MIN` once speculation
//! measures faster. So a passing phase of poor proposals (the preamble before a code edit's
//! copied lines) costs a few steps, and a device where speculation never pays soon probes it
//! rarely.

/// Samples of each kind before the averages decide anything.
pub const MIN_SAMPLES: u32 = 4;
/// One step in this many is plain while speculating, to keep the plain average current.
pub const EXPLORE_EVERY: u64 = 32;
/// Steps without speculation after it was first measured slower.
pub const BACKOFF_MIN: u64 = 16;
/// The shortest backoff of a draft model (its cache catches up on what was generated meanwhile).
pub const DRAFT_BACKOFF_MIN: u64 = 256;
/// The longest backoff.
pub const BACKOFF_MAX: u64 = 4096;
/// Weight of a new sample in the averages.
const ALPHA: f64 = 0.25;

#[derive(Clone, Debug, Default)]
pub struct CostGate {
    plain: Option<f64>,
    spec: Option<f64>,
    n_plain: u32,
    n_spec: u32,
    step: u64,
    off_until: u64,
    /// The next backoff's length (0: the shortest).
    backoff: u64,
    /// The shortest backoff (0: BACKOFF_MIN).
    min_backoff: u64,
    /// Times speculation was found slower and stopped.
    pub backoffs: u64,
}

impl CostGate {
    /// A gate whose shortest backoff is `min` steps: a draft model must catch up on every token
    /// generated while it was off, so probing it often costs more than with n-gram lookups.
    pub fn with_min_backoff(min: u64) -> CostGate {
        CostGate { min_backoff: min, ..Default::default() }
    }

    fn shortest(&self) -> u64 {
        if self.min_backoff == 0 {
            BACKOFF_MIN
        } else {
            self.min_backoff
        }
    }

    /// Whether the next step that could speculate may do so.
    pub fn allow(&mut self) -> bool {
        self.step += 1;
        if self.step < self.off_until {
            return false;
        }
        let every = if self.n_plain < MIN_SAMPLES { 2 } else { EXPLORE_EVERY };
        !self.step.is_multiple_of(every)
    }

    /// A decode-only step took `secs` and gave `tokens` tokens; `speculated`: whether any of its
    /// sequences verified proposals.
    pub fn record(&mut self, speculated: bool, secs: f64, tokens: usize) {
        if tokens == 0 || !secs.is_finite() || secs < 0.0 {
            return;
        }
        let c = secs / tokens as f64;
        let (avg, n) = match speculated {
            true => (&mut self.spec, &mut self.n_spec),
            false => (&mut self.plain, &mut self.n_plain),
        };
        *avg = Some(avg.map_or(c, |a| a + ALPHA * (c - a)));
        *n += 1;
        if let (true, Some(s), Some(p)) =
            (self.n_spec >= MIN_SAMPLES && self.n_plain >= MIN_SAMPLES, self.spec, self.plain)
        {
            if s > p {
                let len = self.backoff.max(self.shortest());
                self.off_until = self.step + len;
                self.backoff = (len * 2).min(BACKOFF_MAX);
                self.spec = None;
                self.n_spec = 0;
                self.backoffs += 1;
            } else {
                self.backoff = self.shortest();
            }
        }
    }

    /// The averages (plain, speculating), seconds per token, once measured.
    pub fn costs(&self) -> (Option<f64>, Option<f64>) {
        (self.plain, self.spec)
    }

    /// The length of the backoff in force (0 when speculating).
    pub fn backing_off_for(&self) -> u64 {
        self.off_until.saturating_sub(self.step)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `steps` steps where a plain token costs `plain` and a speculating step gives
    /// `per_step` tokens for `spec` seconds; returns the share of steps that speculated.
    fn simulate(g: &mut CostGate, steps: usize, plain: f64, spec: f64, per_step: usize) -> f64 {
        let mut n = 0;
        for _ in 0..steps {
            if g.allow() {
                n += 1;
                g.record(true, spec, per_step);
            } else {
                g.record(false, plain, 1);
            }
        }
        n as f64 / steps as f64
    }

    #[test]
    fn speculation_that_pays_goes_on_and_one_that_does_not_backs_off() {
        // 4 tokens for 2x a plain step: keeps speculating, bar the exploring steps.
        let mut g = CostGate::default();
        let share = simulate(&mut g, 1000, 0.3, 0.6, 4);
        assert!(share > 0.95, "{share}");
        assert_eq!(g.backoffs, 0);
        // 2 tokens for 3x a plain step: off most of the time, probed again after each backoff.
        let mut g = CostGate::default();
        let share = simulate(&mut g, 1000, 0.3, 0.9, 2);
        assert!(share < 0.05, "{share}");
        assert!(g.backoffs >= 5, "{}", g.backoffs);
        // Backoffs grow: later probes are rarer.
        assert!(g.backoff >= 8 * BACKOFF_MIN, "{}", g.backoff);
        // The device changes its mind: speculation comes back after a backoff.
        let share = simulate(&mut g, 2000, 0.9, 0.3, 2);
        assert!(share > 0.5, "{share}");
        // A passing phase of poor proposals costs a short backoff only.
        let mut g = CostGate::default();
        simulate(&mut g, 200, 0.3, 0.6, 4);
        simulate(&mut g, 8, 0.3, 0.9, 1);
        assert_eq!(g.backoffs, 1);
        let share = simulate(&mut g, 200, 0.3, 0.6, 4);
        assert!(share > 0.85, "{share}");
        // Nothing decided before both kinds have samples.
        let mut g = CostGate::default();
        for _ in 0..MIN_SAMPLES - 1 {
            g.record(true, 10.0, 1);
            g.record(false, 0.1, 1);
        }
        assert_eq!(g.backoffs, 0);
        assert!(g.costs().0.is_some() && g.costs().1.is_some());
    }
}
