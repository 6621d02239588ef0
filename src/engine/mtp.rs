//! Speculative decoding with the model's own MTP head (`--speculative mtp`, Qwen3.5 / Qwen3.6;
//! model/blocks/mtp.rs), a `Proposer` (engine/propose.rs) like the draft model
//! (engine/draft.rs), on the model's device.
//!
//! The head's position p reads the model's final-normed hidden state at p and the token at
//! p + 1. Every step of the model hands back its tokens' hidden states (`Executor::emit_hidden`);
//! each sequence keeps those of the positions whose tokens stand (a verification's rejected
//! proposals' are dropped), normed by the model's final norm (`Seq::mtp_rows`). Before the next
//! step the head catches up on them for every running sequence, writing its own KV cache (one
//! layer, the model's block tables); for a speculating sequence the last of them, at the
//! position before its last token, gives the first proposal, and each further proposal reads the
//! head's own final-normed output at the position before. A sequence whose positions before a
//! prefix-cache hit were never read by the head starts from what the cache's first owner wrote
//! there (or nothing): like the draft's cache, that changes proposals, never outputs, since the
//! model verifies every proposal.

use super::propose::{fits, push_round, slot, DraftModel, Drafting, Proposer};
use super::scheduler::Planned;
use super::sequence::Seq;
use crate::config::EngineConfig;
use crate::exec::{Executor, StepOutput};
use crate::model::blocks::mtp::{load_mtp, norm_rows};
use crate::model::{kv_block_bytes, Model, StageOutput, StepInput, StepLimits};
use crate::sampling::SampleParams;
use anyhow::{anyhow, bail, Context, Result};

/// The head's model (`emit_hidden` on: it takes hidden states beside its tokens, which no
/// executor passes) and the norms of the hidden states it reads.
pub(crate) struct MtpProposer {
    model: Box<Model>,
    limits: StepLimits,
    vocab: usize,
    target_norm: Vec<f32>,
    head_norm: Vec<f32>,
    eps: f32,
    hidden: usize,
}

/// The MTP head of the model `cfg` names, on `target`'s device with a KV cache of its block
/// count. Fails with the model's path and the reason: no head in the file, a pipeline, no room.
pub fn load(cfg: &EngineConfig, target: &dyn Executor) -> Result<DraftModel> {
    let path = cfg.model_path();
    let ctx = || "speculative mtp".to_string();
    let gpu = target.device().ok_or_else(|| {
        anyhow!("{}: the MTP head runs on the model's device; it does not combine with pipeline stages", ctx())
    })?;
    let mut head = load_mtp(&path).with_context(ctx)?;
    // The model's embedding and LM head serve the head too (no second copy on the device).
    let io = target.shared_io();
    if io.is_some() {
        head.model.embed = None;
        head.model.lm_head = None;
    }
    let t = target.limits();
    let c = &head.model.cfg;
    let mut limits = crate::exec::step_limits(cfg, c);
    limits.max_seq_len = limits.max_seq_len.min(t.max_seq_len);
    limits.profile = t.profile;
    let blocks = target.num_blocks();
    limits.cache_bytes = blocks as u64 * kv_block_bytes(c, &limits) * 2;
    let mut m = Model::new_mtp(gpu, &head, limits, io).with_context(ctx)?;
    if m.kv.num_blocks < blocks {
        bail!("{}: its KV cache holds {} blocks, fewer than the model's {blocks}", ctx(), m.kv.num_blocks);
    }
    m.emit_hidden(true);
    m.warm_up().with_context(ctx)?;
    let (eps, hidden, vocab) = (c.rms_eps, c.hidden, c.vocab);
    let (target_norm, head_norm) = (head.target_norm, head.model.final_norm);
    let model = Box::new(m);
    Ok(DraftModel(Box::new(MtpProposer { model, limits, vocab, target_norm, head_norm, eps, hidden })))
}

impl MtpProposer {
    /// One step of the head over `input` with `rows`, the hidden states it reads (one per
    /// token). A panic in it (a bug, a driver failure) is this step's error.
    fn run(&mut self, input: StepInput, rows: &[f32]) -> Result<StepOutput> {
        let model = &mut self.model;
        let bytes: &[u8] = bytemuck::cast_slice(rows);
        let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| model.run(&input, Some(bytes))))
            .unwrap_or_else(|p| Err(anyhow!("the MTP head panicked: {}", crate::exec::panic_message(&*p))))?;
        match out {
            StageOutput::Sampled(sampled) => Ok(StepOutput { sampled, logits: None, hidden: model.take_hidden() }),
            StageOutput::Hidden(_) => bail!("the MTP head gave no tokens"),
        }
    }
}

impl Seq {
    /// Keeps the head's input rows of positions `from..` (those the head has read are dropped;
    /// rows that do not follow the kept ones replace them).
    fn keep_mtp_rows(&mut self, mut from: usize, mut rows: Vec<f32>, h: usize) {
        let n = rows.len() / h;
        let read = self.draft_computed;
        if n == 0 || from + n <= read {
            return;
        }
        if from < read {
            rows.drain(..(read - from) * h);
            from = read;
        }
        let have = self.mtp_rows.len() / h;
        if self.mtp_rows.is_empty() || from < self.mtp_from || from > self.mtp_from + have {
            self.mtp_rows = rows;
            self.mtp_from = from;
        } else {
            self.mtp_rows.truncate((from - self.mtp_from) * h);
            self.mtp_rows.extend(rows);
        }
    }
}

/// One sequence's catch-up: positions `next..end` to read; `work`: its index in the round's
/// speculating sequences when `end` is the position before its last token.
struct CatchUp {
    seq: usize,
    next: usize,
    end: usize,
    work: Option<usize>,
}

impl Proposer for MtpProposer {
    fn reads_hidden(&self) -> bool {
        true
    }

    fn fits(&self, tokens: &[u32], table_len: usize, k: usize) -> bool {
        fits(&self.limits, self.vocab, tokens, table_len, k)
    }

    /// Keeps, per planned sequence, the hidden states (`hidden`, [tokens, hidden] in the step's
    /// token order) of the positions whose tokens stand, for the MTP head.
    fn observe(&mut self, plan: &[Planned], hidden: &[f32], running: &mut [Seq]) {
        let h = self.hidden;
        let Some(split) = super::scheduler::rows_by_seq(plan, hidden, h) else {
            let total: usize = plan.iter().map(|p| p.len).sum();
            tracing::warn!("the model gave {} hidden floats for {total} tokens; the MTP head skips them", hidden.len());
            return;
        };
        for (p, rows) in split {
            let Some(s) = running.iter_mut().find(|s| s.id == p.id) else { continue };
            // A proposal's row stands when it and every proposal before it were kept; a position
            // has the head's input only once the token after it is known.
            let own = p.len - p.draft.len();
            let kept = p.draft.iter().enumerate().take_while(|&(i, d)| s.tokens.get(p.start + own + i) == Some(d));
            let valid = (own + kept.count()).min((s.tokens.len() - 1).saturating_sub(p.start));
            let mut rows = rows[..valid * h].to_vec();
            norm_rows(&mut rows, &self.target_norm, self.eps);
            s.keep_mtp_rows(p.start, rows, h);
        }
    }

    /// The head's catch-up on every running sequence's kept rows, its first proposal for each
    /// speculating sequence (`work`) at the position before its last token, then its further
    /// rounds. A speculating sequence without the row it needs proposes nothing this step.
    fn propose(&mut self, running: &mut [Seq], work: &mut [Drafting], bs: usize) -> Result<()> {
        let (h, eps) = (self.hidden, self.eps);
        let head_norm = self.head_norm.clone();
        let mut jobs = Vec::new();
        for (i, s) in running.iter_mut().enumerate() {
            if s.mtp_rows.is_empty() {
                continue;
            }
            // Positions before the rows that the head never read keep what the cache holds.
            s.draft_computed = s.draft_computed.max(s.mtp_from);
            let end = (s.mtp_from + s.mtp_rows.len() / h).min(s.tokens.len() - 1);
            let work_i = work.iter().position(|w| w.seq == i).filter(|_| end + 1 == s.tokens.len());
            if s.draft_computed < end {
                jobs.push(CatchUp { seq: i, next: s.draft_computed, end, work: work_i });
            }
        }
        // Each speculating sequence's hidden state for its next round (the head's own, normed).
        let mut state: Vec<Option<Vec<f32>>> = vec![None; work.len()];
        let (max_tokens, max_seqs) = (self.limits.max_tokens, self.limits.max_seqs);
        while !jobs.is_empty() {
            let mut input = StepInput::default();
            let mut rows: Vec<f32> = Vec::new();
            let mut who = Vec::new();
            for j in jobs.iter_mut() {
                let room = max_tokens - input.tokens.len();
                if room == 0 || input.block_tables.len() == max_seqs {
                    break;
                }
                let s = &running[j.seq];
                let stop = (j.next + room).min(j.end);
                let idx = input.block_tables.len() as u32;
                for q in j.next..stop {
                    input.tokens.push(s.tokens[q + 1]);
                    input.positions.push(q as u32);
                    input.slots.push(slot(s, q, bs));
                    input.seq_of_token.push(idx);
                }
                let r = (j.next - s.mtp_from) * h..(stop - s.mtp_from) * h;
                rows.extend_from_slice(&s.mtp_rows[r]);
                input.block_tables.push(s.table.clone());
                if let Some(wi) = j.work.filter(|_| stop == j.end) {
                    input.sample_rows.push(input.tokens.len() as u32 - 1);
                    input.sampling.push(SampleParams::default());
                    who.push(wi);
                }
                j.next = stop;
            }
            let sample_rows = input.sample_rows.clone();
            let out = self.run(input, &rows)?;
            for (k, (wi, r)) in who.iter().zip(&out.sampled).enumerate() {
                work[*wi].proposals.push(r.id);
                let t = sample_rows[k] as usize;
                state[*wi] = normed(&out.hidden, t, h, &head_norm, eps);
            }
            jobs.retain(|j| j.next < j.end);
        }
        // What was read is dropped; the head holds positions up to each sequence's rows' end.
        for s in running.iter_mut().filter(|s| !s.mtp_rows.is_empty()) {
            let end = (s.mtp_from + s.mtp_rows.len() / h).min(s.tokens.len() - 1);
            let used = end.saturating_sub(s.mtp_from).min(s.mtp_rows.len() / h);
            s.mtp_rows.drain(..used * h);
            s.mtp_from += used;
            s.draft_computed = s.draft_computed.max(end);
        }
        // Rounds: proposal r reads proposal r - 1 at the position after the one before.
        let rounds = work.iter().map(|w| w.k).max().unwrap_or(0);
        for r in 1..rounds {
            let mut input = StepInput::default();
            let mut rows = Vec::new();
            let mut who = Vec::new();
            for (wi, w) in work.iter().enumerate() {
                let Some(hid) = state[wi].as_ref().filter(|_| w.k > r && w.proposals.len() == r) else { continue };
                let s = &running[w.seq];
                let pos = s.tokens.len() - 2 + r;
                push_round(&mut input, w.proposals[r - 1], (pos, slot(s, pos, bs)), &s.table);
                rows.extend_from_slice(hid);
                who.push(wi);
            }
            if who.is_empty() {
                break;
            }
            let out = self.run(input, &rows)?;
            if out.sampled.len() != who.len() {
                bail!("the MTP head sampled {} rows of {}", out.sampled.len(), who.len());
            }
            for (k, (wi, s)) in who.into_iter().zip(out.sampled).enumerate() {
                work[wi].proposals.push(s.id);
                state[wi] = normed(&out.hidden, k, h, &head_norm, eps);
            }
        }
        for w in work.iter() {
            let s = &running[w.seq];
            let first = w.proposals.first().copied().unwrap_or(u32::MAX);
            tracing::debug!(seq = s.id, last = s.tokens.len() - 1, first, n = w.proposals.len(), "mtp proposals");
        }
        Ok(())
    }
}

/// Row `t` of the head's hidden states (`h` wide), normed by its final norm: what its next
/// round reads (None where the head gave no such row).
fn normed(hidden: &[f32], t: usize, h: usize, norm: &[f32], eps: f32) -> Option<Vec<f32>> {
    let mut row = hidden.get(t * h..(t + 1) * h)?.to_vec();
    norm_rows(&mut row, norm, eps);
    Some(row)
}
