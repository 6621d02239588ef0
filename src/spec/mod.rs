//! Speculative decoding's proposers: what a sequence is likely to say next, offered to the
//! engine, which verifies the proposals in one step and keeps the longest accepted run.
//!
//! Owns: the n-gram (prompt lookup) proposer, the per-sequence adaptive proposal length and the
//! cost gate (whether speculating pays on this device, measured).
//! May use: config.
//! Never uses: engine, exec, model, server, gpu (a proposer sees only token ids).

pub mod gate;
pub mod ngram;

pub use gate::CostGate;

use crate::config::SpecSettings;

/// How many tokens a sequence proposes next: after a step whose proposals were all accepted
/// it proposes two more (up to the setting), after a rejection one more than it had accepted,
/// so a sequence whose guesses fail stops paying for long verifications, and one whose
/// guesses hold grows back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdaptiveK {
    k: usize,
    max: usize,
}

impl AdaptiveK {
    pub fn new(max: usize) -> AdaptiveK {
        AdaptiveK { k: max, max }
    }

    pub fn get(&self) -> usize {
        self.k
    }

    /// `accepted` of `proposed` tokens were accepted.
    pub fn update(&mut self, proposed: usize, accepted: usize) {
        self.k = if accepted >= proposed { (self.k + 2).min(self.max) } else { (accepted + 1).min(self.max) };
    }
}

/// Up to `k` tokens proposed to follow `tokens` under `s` (none when speculation is off; a
/// draft model's proposals come from the engine, which runs it).
pub fn propose(s: &SpecSettings, tokens: &[u32], k: usize) -> Vec<u32> {
    match s.method {
        crate::config::SpecMethod::Off | crate::config::SpecMethod::Draft | crate::config::SpecMethod::Mtp => {
            Vec::new()
        }
        crate::config::SpecMethod::Ngram => ngram::lookup(tokens, k, s.ngram_min, s.ngram_max),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn k_adapts_to_acceptance() {
        let mut a = AdaptiveK::new(6);
        assert_eq!(a.get(), 6);
        a.update(6, 1);
        assert_eq!(a.get(), 2);
        a.update(2, 0);
        assert_eq!(a.get(), 1);
        a.update(1, 1);
        assert_eq!(a.get(), 3);
        a.update(3, 3);
        a.update(5, 5);
        assert_eq!(a.get(), 6);
    }
}
