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
//! go on without it.

use super::core::EngineCore;
use super::scheduler::Planned;
use crate::config::{EngineConfig, SpecMethod, SpecSettings};
use crate::exec::{Executor, Inline};
use crate::model::{kv_block_bytes, loader::HostModel, Model, StepInput, StepLimits};
use crate::sampling::SampleParams;
use crate::tokenizer::Tokenizer;
use anyhow::{anyhow, bail, Context, Result};

/// The draft model (or the model's MTP head, engine/mtp.rs) and its step limits.
pub struct DraftModel {
    runner: Runner,
    pub(crate) limits: StepLimits,
    vocab: usize,
    next_step: u64,
}

enum Runner {
    Draft(Box<dyn Executor>),
    /// The head's model takes hidden states beside its tokens (no executor passes them).
    Mtp(Box<Model>, super::mtp::MtpHead),
}

impl DraftModel {
    pub fn new(exec: Box<dyn Executor>) -> DraftModel {
        DraftModel { limits: exec.limits(), vocab: exec.vocab(), runner: Runner::Draft(exec), next_step: 0 }
    }

    /// The MTP head's model (`emit_hidden` on) and what the engine needs of the head.
    pub(crate) fn new_mtp(model: Model, head: super::mtp::MtpHead) -> DraftModel {
        let (limits, vocab) = (model.limits, model.cfg.vocab);
        DraftModel { limits, vocab, runner: Runner::Mtp(Box::new(model), head), next_step: 0 }
    }

    /// Whether this is the model's MTP head.
    pub fn is_mtp(&self) -> bool {
        matches!(self.runner, Runner::Mtp(..))
    }

    pub(crate) fn mtp(&self) -> Option<&super::mtp::MtpHead> {
        match &self.runner {
            Runner::Mtp(_, h) => Some(h),
            Runner::Draft(_) => None,
        }
    }

    fn step(&mut self, input: StepInput) -> Result<Vec<u32>> {
        Ok(self.run(input, None)?.sampled.into_iter().map(|s| s.id).collect())
    }

    /// One step; `rows`: the MTP head's hidden states, one per token. A panic in it (a bug, a
    /// driver failure) is this step's error.
    pub(crate) fn run(&mut self, input: StepInput, rows: Option<&[f32]>) -> Result<crate::exec::StepOutput> {
        self.next_step += 1;
        match &mut self.runner {
            Runner::Draft(exec) => {
                exec.submit(self.next_step, input);
                let r = exec.recv().ok_or_else(|| anyhow!("the draft model returned no result"))?;
                r.result
            }
            Runner::Mtp(model, _) => {
                let bytes: &[u8] = bytemuck::cast_slice(rows.unwrap_or_default());
                let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| model.run(&input, Some(bytes))))
                    .unwrap_or_else(|p| Err(anyhow!("the MTP head panicked: {}", crate::exec::panic_message(&*p))))?;
                match out {
                    crate::model::StageOutput::Sampled(sampled) => {
                        Ok(crate::exec::StepOutput { sampled, logits: None, hidden: model.take_hidden() })
                    }
                    crate::model::StageOutput::Hidden(_) => bail!("the MTP head gave no tokens"),
                }
            }
        }
    }

    /// Whether the draft may propose `k` tokens for a sequence of `tokens` with `table_len`
    /// blocks: every position and block within its limits, every token in its vocabulary.
    fn fits(&self, tokens: &[u32], table_len: usize, k: usize) -> bool {
        let l = &self.limits;
        tokens.len() + k <= l.max_seq_len
            && table_len <= l.max_seq_len.div_ceil(l.block_size)
            && tokens.iter().all(|&t| (t as usize) < self.vocab)
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

/// One speculating sequence in a draft round: where it is in `running`, its tokens so far, its
/// proposals.
pub(crate) struct Drafting {
    plan: usize,
    pub(crate) seq: usize,
    pub(crate) k: usize,
    pub(crate) proposals: Vec<u32>,
}

impl EngineCore {
    /// Fills the proposals of `plan`'s speculating sequences (planned with placeholders) with
    /// the draft model's. Sequences the draft cannot serve, and all of them when a draft step
    /// fails, verify nothing in this step (their step shrinks to their last token).
    pub(crate) fn fill_drafts(&mut self, plan: &mut [Planned]) {
        let Some(mut draft) = self.draft.take() else {
            for p in plan.iter_mut() {
                p.len -= p.draft.len();
                p.draft.clear();
            }
            return;
        };
        let index: std::collections::HashMap<u64, usize> =
            self.sched.running.iter().enumerate().map(|(i, s)| (s.id, i)).collect();
        let mut work = Vec::new();
        for (pi, p) in plan.iter_mut().enumerate() {
            if p.draft.is_empty() {
                continue;
            }
            let s = &self.sched.running[index[&p.id]];
            if draft.fits(&s.tokens, s.table.len(), p.draft.len()) {
                work.push(Drafting { plan: pi, seq: index[&p.id], k: p.draft.len(), proposals: Vec::new() });
            } else {
                p.len -= p.draft.len();
                p.draft.clear();
            }
        }
        let mtp = draft.is_mtp();
        let run = if mtp { self.run_mtp(&mut draft, &mut work) } else { self.run_draft(&mut draft, &mut work) };
        match run {
            Ok(()) => {
                for w in work {
                    let p = &mut plan[w.plan];
                    // Ids past the model's vocabulary (a draft with more rows) end the proposal.
                    let n = w.proposals.iter().take_while(|&&t| (t as usize) < self.exec.vocab()).count();
                    p.len -= p.draft.len() - n;
                    p.draft = w.proposals[..n].to_vec();
                    // (The MTP head's catch-up keeps its own count.)
                    let s = &mut self.sched.running[w.seq];
                    if !mtp {
                        s.draft_computed = s.tokens.len() - 1 + w.k;
                    }
                }
                self.draft = Some(draft);
            }
            Err(e) => {
                tracing::error!("the draft model / MTP head failed ({e:#}); speculative decoding is off from now on");
                if mtp {
                    // Nothing reads the model's hidden states any more.
                    self.exec.emit_hidden(false);
                }
                for p in plan.iter_mut() {
                    p.len -= p.draft.len();
                    p.draft.clear();
                }
                self.sched.cfg.spec = SpecSettings::off();
            }
        }
    }

    /// The draft's catch-up steps (positions its cache lacks, up to each sequence's last
    /// token), then its rounds: round r gives every sequence with k > r its (r+1)-th proposal.
    fn run_draft(&mut self, draft: &mut DraftModel, work: &mut [Drafting]) -> Result<()> {
        let bs = self.sched.cfg.block_size;
        let running = &self.sched.running;
        let slot = |s: &super::sequence::Seq, pos: usize| s.table[pos / bs] * bs as u32 + (pos % bs) as u32;
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
                let room = draft.limits.max_tokens - input.tokens.len();
                if room == 0 {
                    break;
                }
                let s = &running[work[*wi].seq];
                let end = (*a + room).min(*b);
                let j = input.block_tables.len() as u32;
                for pos in *a..end {
                    input.tokens.push(s.tokens[pos]);
                    input.positions.push(pos as u32);
                    input.slots.push(slot(s, pos));
                    input.seq_of_token.push(j);
                }
                input.block_tables.push(s.table.clone());
                *a = end;
            }
            draft.step(input)?;
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
                push_round(&mut input, t, (pos, slot(s, pos)), &s.table);
                who.push(wi);
            }
            let ids = draft.step(input)?;
            if ids.len() != who.len() {
                bail!("the draft model sampled {} rows of {}", ids.len(), who.len());
            }
            for (wi, t) in who.into_iter().zip(ids) {
                work[wi].proposals.push(t);
            }
        }
        Ok(())
    }
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
