//! Speculative decoding with a draft model: a smaller model with the same vocabulary, on the
//! same device, proposes each speculating sequence's next k tokens greedily before the step
//! that verifies them.
//!
//! The draft's KV cache has as many blocks as the model's, of the same size, so a sequence's
//! block table addresses both caches: the draft needs no allocator of its own, and preemption,
//! prefix sharing and freeing follow the model's blocks. Each sequence remembers how many of
//! its positions the draft's cache holds (`Seq::draft_computed`); before proposing, the draft
//! catches up on the rest (the prompt after admission, an accepted run's last token), then runs
//! k one-token rounds. Verification keeps only the tokens the model itself samples, so the
//! draft's quality (or a draft cache written by other sequences' identical prefixes) changes
//! the speed, never the output. A failed draft step stops draft speculation (logged); requests
//! go on without it. The core reaches it as a `Proposer` (engine/propose.rs).

use super::propose::{fits, push_round, slot, DraftModel, Drafting, Proposer};
use super::sequence::Seq;
use crate::config::{EngineConfig, SpecMethod};
use crate::exec::{Executor, Inline};
use crate::model::{kv_block_bytes, loader::HostModel, Model, StepInput, StepLimits};
use crate::tokenizer::Tokenizer;
use anyhow::{anyhow, bail, Context, Result};

/// A draft model on the model's device and its step limits.
pub(crate) struct DraftProposer {
    exec: Box<dyn Executor>,
    limits: StepLimits,
    vocab: usize,
    next_step: u64,
}

impl DraftModel {
    /// A draft model running on `exec`.
    pub fn new(exec: Box<dyn Executor>) -> DraftModel {
        DraftModel(Box::new(DraftProposer { limits: exec.limits(), vocab: exec.vocab(), exec, next_step: 0 }))
    }
}

impl DraftProposer {
    /// One step of the draft: its sampled ids.
    fn step(&mut self, input: StepInput) -> Result<Vec<u32>> {
        self.next_step += 1;
        self.exec.submit(self.next_step, input);
        let r = self.exec.recv().ok_or_else(|| anyhow!("the draft model returned no result"))?;
        Ok(r.result?.sampled.into_iter().map(|s| s.id).collect())
    }
}

impl Proposer for DraftProposer {
    fn fits(&self, tokens: &[u32], table_len: usize, k: usize) -> bool {
        fits(&self.limits, self.vocab, tokens, table_len, k)
    }

    /// The draft's catch-up steps (positions its cache lacks, up to each sequence's last
    /// token), then its rounds: round r gives every sequence with k > r its (r+1)-th proposal.
    fn propose(&mut self, running: &mut [Seq], work: &mut [Drafting], bs: usize) -> Result<()> {
        // Catch-up: every position from what the draft's cache holds (never in blocks released
        // from a sliding window) to the one before the last token, in steps of its token limit.
        let mut pending: Vec<(usize, usize, usize)> = work
            .iter()
            .enumerate()
            .map(|(wi, w)| {
                let s = &running[w.seq];
                (wi, s.draft_computed.max(s.released * bs), s.tokens.len() - 1)
            })
            .filter(|(_, a, b)| a < b)
            .collect();
        while !pending.is_empty() {
            let mut input = StepInput::default();
            for (wi, a, b) in pending.iter_mut() {
                let room = self.limits.max_tokens - input.tokens.len();
                if room == 0 {
                    break;
                }
                let s = &running[work[*wi].seq];
                let end = (*a + room).min(*b);
                let j = input.block_tables.len() as u32;
                for pos in *a..end {
                    input.tokens.push(s.tokens[pos]);
                    input.positions.push(pos as u32);
                    input.slots.push(slot(s, pos, bs));
                    input.seq_of_token.push(j);
                }
                input.block_tables.push(s.table.clone());
                *a = end;
            }
            self.step(input)?;
            pending.retain(|(_, a, b)| a < b);
        }
        let rounds = work.iter().map(|w| w.k).max().unwrap_or(0);
        for r in 0..rounds {
            let mut input = StepInput::default();
            let mut who = Vec::new();
            for (wi, w) in work.iter().enumerate().filter(|(_, w)| w.k > r) {
                let s = &running[w.seq];
                let pos = s.tokens.len() - 1 + r;
                let t = if r == 0 { s.tokens[pos] } else { w.proposals[r - 1] };
                push_round(&mut input, t, (pos, slot(s, pos, bs)), &s.table);
                who.push(wi);
            }
            let ids = self.step(input)?;
            if ids.len() != who.len() {
                bail!("the draft model sampled {} rows of {}", ids.len(), who.len());
            }
            for (wi, t) in who.into_iter().zip(ids) {
                work[wi].proposals.push(t);
            }
        }
        // Its cache now holds every position up to the last round's.
        for w in work.iter() {
            let s = &mut running[w.seq];
            s.draft_computed = s.tokens.len() - 1 + w.k;
        }
        Ok(())
    }
}

/// The draft model a config names (`draft_model`, speculative `draft`), loaded on the model's
/// device with a KV cache of `target`'s block count; None when the config uses no draft model.
/// Fails with the draft's path and the reason: a different vocabulary, a pipeline, no room.
pub fn load_draft(cfg: &EngineConfig, target: &dyn Executor, tok: &Tokenizer) -> Result<Option<DraftModel>> {
    match cfg.spec_settings()?.method {
        SpecMethod::Draft => {}
        SpecMethod::Mtp => return super::mtp::load(cfg, target).map(Some),
        _ => return Ok(None),
    }
    let path = cfg.draft_model_path().ok_or_else(|| anyhow!("speculative draft needs draft_model"))?;
    let ctx = || format!("draft model {}", path.display());
    if !path.exists() {
        bail!("{}: not found", ctx());
    }
    let gpu = target.device().ok_or_else(|| {
        anyhow!("{}: a draft model runs on the model's device; it does not combine with pipeline stages", ctx())
    })?;
    let dtok = Tokenizer::from_path(&path).with_context(ctx)?;
    same_vocabulary(tok, &dtok).with_context(ctx)?;
    let host = HostModel::open(&path, None, &|_, _| {}).with_context(ctx)?;
    if host.cfg.linear.is_some() {
        bail!("{}: a draft model with recurrent (linear-attention) layers is not supported", ctx());
    }
    let t = target.limits();
    let mut limits = crate::exec::step_limits(cfg, &host.cfg);
    limits.max_seq_len = limits.max_seq_len.min(t.max_seq_len);
    limits.profile = t.profile;
    let blocks = target.num_blocks();
    limits.cache_bytes = blocks as u64 * kv_block_bytes(&host.cfg, &limits) * 2 * host.cfg.layers as u64;
    let mut m = Model::new(gpu, &host, limits).with_context(ctx)?;
    if m.kv.num_blocks < blocks {
        bail!("{}: its KV cache holds {} blocks, fewer than the model's {blocks}", ctx(), m.kv.num_blocks);
    }
    m.warm_up().with_context(ctx)?;
    Ok(Some(DraftModel::new(Box::new(Inline::new(m)))))
}

/// The draft's tokenizer must give every id the model's token: proposals are ids.
fn same_vocabulary(target: &Tokenizer, draft: &Tokenizer) -> Result<()> {
    if target.vocab_size() != draft.vocab_size() {
        bail!(
            "its vocabulary has {} tokens, the model's {}: a draft model must share the model's tokenizer",
            draft.vocab_size(),
            target.vocab_size()
        );
    }
    for id in 0..target.vocab_size() as u32 {
        let (a, b) = (target.id_to_token(id), draft.id_to_token(id));
        if a != b {
            bail!("its token {id} is {b:?} where the model's is {a:?}: a draft model must share the model's tokenizer");
        }
    }
    Ok(())
}
