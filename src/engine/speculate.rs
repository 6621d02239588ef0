//! Speculative decoding in the engine: which decoding sequences propose tokens in a step (and
//! how many), and a verification's result applied.
//!
//! A sequence that speculates puts its last token and k proposed tokens into one step (the
//! token budget and the row limit count them) with a sample row at each: row i samples the
//! token that follows the proposals before it, with the sequence's own sampling parameters,
//! penalties counting those proposals, and the uniform the token at that place would draw
//! without speculation. Its tokens are then taken in order while each equals the proposal it
//! verifies; the first that differs (or the one after the last proposal) ends the run. So the
//! output is the one the sequence gives without speculation, greedy or sampled with a seed
//! alike (for proposals that do not depend on random draws, such as n-gram lookups, this is
//! exact rejection sampling: a proposal is kept with its probability, and a rejected one is
//! replaced by a draw from the rest of the distribution). Only accepted tokens enter the
//! sequence, its penalties, its KV blocks' prefix keys and KV events; the cache slots of
//! rejected proposals are written again when their positions are computed.
//!
//! Under a grammar, row i's mask is the grammar's after the proposals before it (computed on a
//! copy of its state), and the proposals end before the first one the grammar refuses.
//!
//! When to speculate: only while a step has at most `speculative_max_batch` decoding
//! sequences (beyond that a step is no longer bound by reading the weights, so verifying
//! proposals costs real work), not while a grammar waits for a reasoning span to end, and each
//! sequence proposes as many tokens as it recently got accepted
//! (`spec::AdaptiveK`). On a single device the loop also times decode-only steps with and
//! without verification and stops speculating for a while where it costs more per token than
//! it saves (`spec::CostGate`).

use super::output::{accept, commit_computed};
use super::request::FinishReason;
use super::scheduler::{Planned, Scheduler};
use super::sequence::Seq;
use crate::sampling::Sampled;
use crate::tokenizer::Tokenizer;
use std::sync::atomic::Ordering::Relaxed;

impl Scheduler {
    /// Whether sequences speculate in this step: on, and at most `max_batch` of the idle
    /// running sequences are decoding (the step takes at most `decode_cap` of them).
    pub(crate) fn speculates(&self, decode_cap: usize) -> bool {
        let spec = &self.cfg.spec;
        if !spec.enabled() || !self.spec_allowed {
            return false;
        }
        let decoding = self
            .running
            .iter()
            .filter(|s| {
                !self.busy.contains_key(&s.id) && s.tokens.len() == s.scheduled + 1 && s.computed == s.scheduled
            })
            .count();
        decoding.min(decode_cap) <= spec.max_batch
    }

    /// The tokens decoding sequence `s` proposes, at most `room` (what the step's token budget
    /// and rows leave), none past its `max_tokens` or the longest sequence.
    pub(crate) fn draft(&self, s: &Seq, room: usize) -> Vec<u32> {
        let spec = &self.cfg.spec;
        if !s.may_speculate() {
            return Vec::new();
        }
        let k = s
            .spec_k
            .get()
            .min(spec.max_tokens)
            .min(room)
            .min(self.cfg.max_seq_len.saturating_sub(s.tokens.len() + 1))
            .min(s.max_tokens.saturating_sub(s.generated() + 1));
        if k == 0 {
            return Vec::new();
        }
        if spec.method.uses_model() {
            // Placeholders, filled by the draft model (or the MTP head) before the step is built
            // (engine/draft.rs).
            return vec![0; k];
        }
        crate::spec::propose(spec, &s.tokens, k)
    }

    /// Proposals under a grammar: each verifying row gets the grammar's mask after the
    /// proposals before it, and a proposal the grammar refuses ends the draft (it would be
    /// rejected). A sequence left with no proposal samples as without speculation.
    pub(crate) fn grammar_drafts(&mut self, plan: &mut [Planned], words: usize) {
        for p in plan.iter_mut().filter(|p| !p.draft.is_empty()) {
            let Some(s) = self.running.iter_mut().find(|s| s.id == p.id) else { continue };
            let before = p.draft.len();
            p.masks = s.draft_masks(&mut p.draft, words);
            p.len -= before - p.draft.len();
            if p.draft.is_empty() {
                p.masks = None;
            }
        }
    }

    /// Sequence `id`'s verification of `draft`: its `rows` (one per proposal, and one after the
    /// last) taken in order while each matches its proposal, then its computed positions, prefix
    /// keys and sampler state brought to the accepted tokens (`tok` detokenizes the taken ones).
    /// Returns why it finished, if it did.
    pub(crate) fn apply_verified(
        &mut self,
        tok: &Tokenizer,
        id: u64,
        draft: &[u32],
        rows: Vec<Sampled>,
    ) -> Option<FinishReason> {
        let max_seq_len = self.cfg.max_seq_len;
        let s = self.running.iter_mut().find(|s| s.id == id)?;
        // The sequence's own tokens (every one computed in this step) end here.
        let own_end = s.tokens.len();
        let (mut taken, mut accepted, mut reason) = (0, 0, None);
        for (i, r) in rows.into_iter().enumerate() {
            let hit = draft.get(i) == Some(&r.id);
            self.metrics.decode_tokens.fetch_add(1, Relaxed);
            taken += 1;
            reason = accept(tok, s, r, max_seq_len);
            if reason.is_some() || !hit {
                break;
            }
            accepted += 1;
        }
        // The generator moves on by the draws the taken tokens used, as without speculation.
        for _ in 0..taken {
            s.rng.uniform();
        }
        s.spec_k.update(draft.len(), accepted);
        self.metrics.spec_drafts.fetch_add(1, Relaxed);
        self.metrics.spec_draft_tokens.fetch_add(draft.len() as u64, Relaxed);
        self.metrics.spec_accepted_tokens.fetch_add(accepted as u64, Relaxed);
        for pos in 0..accepted {
            self.metrics.spec_accepted_per_pos[pos].fetch_add(1, Relaxed);
        }
        // Every token but the last taken one has its K/V in the cache now; the draft's cache
        // holds the accepted ones it was given.
        let start = s.computed;
        s.computed = s.tokens.len() - 1;
        s.draft_computed = s.draft_computed.min(s.computed);
        s.scheduled = s.computed;
        // A recurrent state took every proposal in: where one was rejected, the sequence goes on
        // from its state after its own tokens, before the proposals (kept in the backup slot),
        // and computes its accepted proposals again (the next step's chunk, with the token after
        // them; their K/V are rewritten the same).
        if let Some(backup) = s.backup_slot.take() {
            if accepted < draft.len() && reason.is_none() {
                if let Some(old) = s.state_slot.replace(backup) {
                    self.slots.release(old);
                }
                s.computed = own_end.max(start);
                s.scheduled = s.computed;
                s.draft_computed = s.draft_computed.min(s.computed);
            } else {
                self.slots.release(backup);
            }
        }
        commit_computed(&mut self.bm, &self.cfg, s);
        reason
    }
}
