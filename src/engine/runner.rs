//! A step plan turned into the executor's step input: each planned token's position, KV slot
//! and sequence, the block tables, and the sample rows (the next token, prompt logprobs) with
//! their sampling parameters.

use super::scheduler::{Planned, Scheduler};
use crate::model::step::SeqState;
use crate::model::StepInput;
use crate::sampling::SampleParams;

/// A sample row's purpose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Row {
    /// The sequence's next token.
    Next,
    /// The log-probability of the prompt token after this position.
    Prompt,
}

impl Scheduler {
    /// The step input of `plan`, and what each of its sample rows is for (in row order). Marks
    /// the planned tokens scheduled and their sequences busy. `mask_words`: the vocabulary's
    /// token-mask length.
    pub(crate) fn step_input(&mut self, plan: &[Planned], mask_words: usize) -> (StepInput, Vec<(u64, Row)>) {
        let bs = self.cfg.block_size as u32;
        let index: std::collections::HashMap<u64, usize> =
            self.running.iter().enumerate().map(|(i, s)| (s.id, i)).collect();
        let mut input = StepInput::default();
        let mut sampled = Vec::new();
        for (j, p) in plan.iter().enumerate() {
            let s = &mut self.running[index[&p.id]];
            let own = p.len - p.draft.len();
            for pos in p.start..p.start + own {
                input.tokens.push(s.tokens[pos]);
                input.positions.push(pos as u32);
                input.slots.push(s.table[pos / bs as usize] * bs + pos as u32 % bs);
                input.seq_of_token.push(j as u32);
                if s.wants_prompt_row(pos) {
                    // Reports the next prompt token's logprob instead of sampling.
                    input.sample_rows.push(input.tokens.len() as u32 - 1);
                    input.sampling.push(SampleParams {
                        n_top: s.params.prompt_logprobs.unwrap_or(0),
                        force: Some(s.tokens[pos + 1]),
                        ..Default::default()
                    });
                    sampled.push((p.id, Row::Prompt));
                }
            }
            // Proposed tokens (speculative decoding) after the sequence's last one.
            for (i, &t) in p.draft.iter().enumerate() {
                let pos = (s.tokens.len() + i) as u32;
                input.tokens.push(t);
                input.positions.push(pos);
                input.slots.push(s.table[(pos / bs) as usize] * bs + pos % bs);
                input.seq_of_token.push(j as u32);
            }
            input.block_tables.push(s.table.clone());
            if let Some(slot) = s.state_slot {
                // A backup taken for proposals that were all dropped since (grammar, draft
                // model) goes back.
                if p.draft.is_empty() {
                    if let Some(b) = s.backup_slot.take() {
                        self.slots.release(b);
                    }
                }
                // Verifying proposals: the state after the sequence's own tokens (before the
                // proposals) is kept in the backup slot, through the snapshot (a verifying step
                // takes no prefix-cache snapshot).
                let snapshot = match s.backup_slot {
                    Some(b) => Some((b, own as u32 - 1)),
                    None => p.snap.map(|(b, block)| (b, snap_at(p, block, bs))),
                };
                let st = SeqState { slot, src: p.src, backup: None, snapshot };
                input.state_slots.extend(st.encode());
            }
            if p.start + own == s.tokens.len() && p.draft.is_empty() {
                input.sample_rows.push(input.tokens.len() as u32 - 1);
                input.sampling.push(s.sample_params(mask_words));
                sampled.push((p.id, Row::Next));
            } else if p.start + own == s.tokens.len() {
                // A row at the last token and at each proposal: the tokens that follow each.
                let first = input.tokens.len() - p.draft.len() - 1;
                for (i, params) in s.verify_params(&p.draft, p.masks.as_deref()).into_iter().enumerate() {
                    input.sample_rows.push((first + i) as u32);
                    input.sampling.push(params);
                    sampled.push((p.id, Row::Next));
                }
            }
            // Proposals are not the sequence's tokens until accepted.
            s.scheduled = p.start + own;
            *self.busy.entry(p.id).or_insert(0) += 1;
        }
        (input, sampled)
    }
}

/// The token of `p`'s step (counted from its first) after which the state covers block `block`
/// of `bs` tokens: the block's last token.
fn snap_at(p: &Planned, block: usize, bs: u32) -> u32 {
    ((block + 1) * bs as usize - 1 - p.start) as u32
}
