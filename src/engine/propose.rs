//! What the core asks of a model that proposes tokens for speculative decoding (the draft
//! model, engine/draft.rs; the model's MTP head, engine/mtp.rs): proposals in, through one
//! interface; the core verifies them (engine/speculate.rs) and keeps only the tokens the model
//! itself samples. A proposer sees the running sequences and the step's hidden states, never
//! the core.

use super::scheduler::Planned;
use super::sequence::Seq;
use crate::model::{StepInput, StepLimits};
use crate::sampling::SampleParams;
use anyhow::Result;

/// A model that proposes the next tokens of speculating sequences.
pub(crate) trait Proposer: Send {
    /// Whether it reads every step's hidden states (`observe`): the model must hand them back.
    fn reads_hidden(&self) -> bool {
        false
    }

    /// Whether it may propose `k` tokens for a sequence of `tokens` with `table_len` blocks.
    fn fits(&self, tokens: &[u32], table_len: usize, k: usize) -> bool;

    /// Fills each of `work`'s proposals (up to its `k`) for its sequence in `running`, whose
    /// block tables (of `block_size` positions a block) address its KV cache too; it keeps
    /// `Seq::draft_computed`, the positions its cache holds, up to date.
    fn propose(&mut self, running: &mut [Seq], work: &mut [Drafting], block_size: usize) -> Result<()>;

    /// A step's hidden states ([tokens, hidden] in `plan`'s token order), after its sampled
    /// tokens were appended to `running`.
    fn observe(&mut self, _plan: &[Planned], _hidden: &[f32], _running: &mut [Seq]) {}
}

/// Speculative decoding's proposer, as `load_draft` gives it (the draft model or the MTP head).
pub struct DraftModel(pub(crate) Box<dyn Proposer>);

impl DraftModel {
    /// Whether this is the model's MTP head (it reads the model's hidden states).
    pub fn is_mtp(&self) -> bool {
        self.0.reads_hidden()
    }
}

/// One speculating sequence in a proposal round: where it is in the step's plan and in
/// `running`, how many tokens it may propose, its proposals.
pub(crate) struct Drafting {
    pub(crate) plan: usize,
    pub(crate) seq: usize,
    pub(crate) k: usize,
    pub(crate) proposals: Vec<u32>,
}

/// Whether a proposer of `limits` and `vocab` may propose `k` tokens for a sequence of `tokens`
/// with `table_len` blocks: every position and block within its limits, every token in its
/// vocabulary.
pub(crate) fn fits(limits: &StepLimits, vocab: usize, tokens: &[u32], table_len: usize, k: usize) -> bool {
    tokens.len() + k <= limits.max_seq_len
        && table_len <= limits.max_seq_len.div_ceil(limits.block_size)
        && tokens.iter().all(|&t| (t as usize) < vocab)
}

/// The KV slot of position `pos` of `s` (blocks of `bs` positions).
pub(crate) fn slot(s: &Seq, pos: usize, bs: usize) -> u32 {
    s.table[pos / bs] * bs as u32 + (pos % bs) as u32
}

/// A proposal round's entry for one sequence: its token `t` at (position, KV slot), as a
/// sequence of its own in `input` with `table`, sampled greedily.
pub(crate) fn push_round(input: &mut StepInput, t: u32, (pos, slot): (usize, u32), table: &[u32]) {
    input.tokens.push(t);
    input.positions.push(pos as u32);
    input.slots.push(slot);
    input.seq_of_token.push(input.block_tables.len() as u32);
    input.block_tables.push(table.to_vec());
    input.sample_rows.push(input.tokens.len() as u32 - 1);
    input.sampling.push(SampleParams::default());
}

/// `plan`'s proposals from `proposer`: the speculating sequences (planned with placeholder
/// proposals) it can serve propose up to their k tokens, ids past the model's `vocab` ending a
/// proposal; the others verify nothing in this step (their step shrinks to their last token).
/// On an error the plan is left for the caller to clear.
pub(crate) fn fill(
    proposer: &mut dyn Proposer,
    running: &mut [Seq],
    plan: &mut [Planned],
    vocab: usize,
    block_size: usize,
) -> Result<()> {
    let index: std::collections::HashMap<u64, usize> = running.iter().enumerate().map(|(i, s)| (s.id, i)).collect();
    let mut work = Vec::new();
    for (pi, p) in plan.iter_mut().enumerate() {
        if p.draft.is_empty() {
            continue;
        }
        let s = &running[index[&p.id]];
        if proposer.fits(&s.tokens, s.table.len(), p.draft.len()) {
            work.push(Drafting { plan: pi, seq: index[&p.id], k: p.draft.len(), proposals: Vec::new() });
        } else {
            clear(p);
        }
    }
    proposer.propose(running, &mut work, block_size)?;
    for w in work {
        let p = &mut plan[w.plan];
        let n = w.proposals.iter().take_while(|&&t| (t as usize) < vocab).count();
        p.len -= p.draft.len() - n;
        p.draft = w.proposals[..n].to_vec();
    }
    Ok(())
}

/// A planned sequence verifies nothing: its step is its own tokens.
pub(crate) fn clear(p: &mut Planned) {
    p.len -= p.draft.len();
    p.draft.clear();
}
