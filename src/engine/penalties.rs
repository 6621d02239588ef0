//! A sequence's logit adjustments (repetition, frequency and presence penalties, `logit_bias`),
//! kept up to date token by token: built once from the prompt, then one binary search and at
//! most one insertion per generated token, instead of a map rebuilt over the whole prompt at
//! every step.

use crate::sampling::Adjust;

/// The adjustments of one sequence, sorted by token id (the sampler's order).
#[derive(Clone, Debug, Default)]
pub struct Penalties {
    list: Vec<Adjust>,
    /// Whether generated tokens are counted (some penalty is on).
    counting: bool,
}

impl Penalties {
    /// `in_prompt` is marked for the prompt's tokens when `repetition` is on; `counting`:
    /// generated tokens are counted (any penalty on); `bias` is added per token id.
    pub fn new(prompt: &[u32], repetition: bool, counting: bool, bias: &[(u32, f32)]) -> Penalties {
        let mut ids: Vec<u32> = if repetition { prompt.to_vec() } else { Vec::new() };
        ids.extend(bias.iter().map(|&(t, _)| t));
        ids.sort_unstable();
        ids.dedup();
        let mut list: Vec<Adjust> =
            ids.into_iter().map(|id| Adjust { id, count: 0, in_prompt: false, bias: 0.0 }).collect();
        if repetition {
            for &t in prompt {
                let i = list.binary_search_by_key(&t, |a| a.id).expect("inserted above");
                list[i].in_prompt = true;
            }
        }
        for &(t, b) in bias {
            let i = list.binary_search_by_key(&t, |a| a.id).expect("inserted above");
            list[i].bias += b;
        }
        Penalties { list, counting }
    }

    /// Counts one generated token.
    pub fn push(&mut self, id: u32) {
        if !self.counting {
            return;
        }
        match self.list.binary_search_by_key(&id, |a| a.id) {
            Ok(i) => self.list[i].count += 1,
            Err(i) => self.list.insert(i, Adjust { id, count: 1, in_prompt: false, bias: 0.0 }),
        }
    }

    /// The adjustments now, sorted by token id.
    pub fn list(&self) -> &[Adjust] {
        &self.list
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{BTreeMap, HashMap};

    /// What the engine built from scratch before (the reference).
    fn rebuilt(
        prompt: &[u32],
        generated: &[u32],
        repetition: bool,
        counting: bool,
        bias: &[(u32, f32)],
    ) -> Vec<Adjust> {
        let mut counts: HashMap<u32, u32> = HashMap::new();
        for &t in generated {
            *counts.entry(t).or_insert(0) += 1;
        }
        let mut adj: BTreeMap<u32, Adjust> = BTreeMap::new();
        let new = |t| Adjust { id: t, count: 0, in_prompt: false, bias: 0.0 };
        if counting {
            if repetition {
                for &t in prompt {
                    adj.entry(t).or_insert(new(t)).in_prompt = true;
                }
            }
            for (&t, &c) in &counts {
                adj.entry(t).or_insert(new(t)).count = c;
            }
        }
        for &(t, b) in bias {
            adj.entry(t).or_insert(new(t)).bias += b;
        }
        adj.into_values().collect()
    }

    #[test]
    fn incremental_equals_rebuilt() {
        let mut rng = crate::sampling::Rng::new(7);
        for case in 0..200 {
            let n = |rng: &mut crate::sampling::Rng, k: u64| (rng.next_u64() % k) as u32;
            let prompt: Vec<u32> = (0..n(&mut rng, 40)).map(|_| n(&mut rng, 30)).collect();
            let bias: Vec<(u32, f32)> = (0..n(&mut rng, 4)).map(|_| (n(&mut rng, 30), 0.5)).collect();
            let counting = case % 4 != 0;
            let repetition = counting && case % 3 != 0;
            let mut p = Penalties::new(&prompt, repetition, counting, &bias);
            let mut generated = Vec::new();
            for _ in 0..n(&mut rng, 50) {
                let t = n(&mut rng, 40);
                generated.push(t);
                p.push(t);
                assert_eq!(p.list(), &rebuilt(&prompt, &generated, repetition, counting, &bias)[..], "case {case}");
            }
            assert_eq!(p.list(), &rebuilt(&prompt, &generated, repetition, counting, &bias)[..], "case {case}");
        }
    }
}
