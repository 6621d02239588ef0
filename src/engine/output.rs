//! A step's results applied to its sequences: computed positions, prefix-cache registration,
//! sliding-window release, prompt logprobs, accepted tokens (stops, grammar, detokenized text),
//! and each finished sequence's end.

use super::core::{EngineCore, InFlight};
use super::runner::Row;
use super::scheduler::SchedulerConfig;
use super::sequence::Seq;
use crate::engine::request::{Event, FinishReason, PromptLogprob};
use crate::exec::{StageFailure, StepResult};
use crate::kv::BlockManager;

use crate::gpu::GpuFault;
use crate::sampling::Sampled;
use crate::tokenizer::Tokenizer;
use std::sync::atomic::Ordering::Relaxed;

impl EngineCore {
    /// Ends a sequence that is in neither queue any more: frees its blocks, tells the caller.
    pub(crate) fn finish(&mut self, mut s: Seq, reason: FinishReason) {
        self.sched.bm.release(&s.table[s.released..]);
        s.table.clear();
        s.released = 0;
        for slot in [s.state_slot.take(), s.backup_slot.take()].into_iter().flatten() {
            self.sched.slots.release(slot);
        }
        let counter = match reason {
            FinishReason::Abort => &self.metrics.requests_aborted,
            FinishReason::Error(_) => &self.metrics.requests_failed,
            _ => &self.metrics.requests_finished,
        };
        counter.fetch_add(1, Relaxed);
        let mut text = std::mem::take(&mut s.pending);
        if matches!(reason, FinishReason::Length | FinishReason::Stop) {
            text.push_str(&s.detok.finish(&self.tok));
        }
        let _ = s.out.send(Event::Done { text, reason, usage: s.usage() });
    }

    /// Applies the oldest step's result, then keeps (or, where the step failed or its sequence
    /// is gone, gives back) the state snapshots it took; the snapshots it read are unpinned.
    pub(crate) fn complete(&mut self, r: StepResult) {
        let Some(step) = self.in_flight.pop_front() else { return };
        let snaps: Vec<(u64, u32, usize)> =
            step.plan.iter().filter_map(|p| p.snap.map(|(s, b)| (p.id, s, b))).collect();
        let done = self.apply_step(step, r);
        for (id, slot, block) in snaps {
            let key = self.sched.running.iter().find(|s| s.id == id).and_then(|s| s.keys.get(block).copied());
            match key {
                Some(key) if done.is_some() => self.sched.slots.store(key, slot),
                _ => self.sched.slots.release(slot),
            }
        }
        for (id, reason) in done.unwrap_or_default() {
            if let Some(i) = self.sched.running.iter().position(|s| s.id == id) {
                let s = self.sched.running.remove(i);
                self.finish(s, reason);
            }
        }
    }

    /// Applies a step's result: the sequences it finished, with why, or None where it failed.
    fn apply_step(&mut self, step: InFlight, r: StepResult) -> Option<Vec<(u64, FinishReason)>> {
        if step.epoch != self.epoch {
            // Submitted before a stage failure: its sequences were already failed or requeued,
            // and `busy` was reset then (it may count their new steps by now).
            return None;
        }
        let got = r.id;
        if got != step.id {
            // Results must come back in submission order; one that does not could hand tokens to
            // the wrong sequences, so nothing of it is applied.
            self.fault_all(&format!("engine step {} returned the result of step {got}", step.id));
            return None;
        }
        for p in &step.plan {
            if let Some(n) = self.sched.busy.get_mut(&p.id) {
                *n -= 1;
                if *n == 0 {
                    self.sched.busy.remove(&p.id);
                }
            }
        }
        let mut out = match r.result {
            Ok(out) => out,
            Err(e) => {
                if let Some(f) = e.downcast_ref::<StageFailure>() {
                    self.stage_failed(f);
                    return None;
                }
                if let Some(GpuFault::Lost(_)) = e.downcast_ref::<GpuFault>() {
                    self.device_lost(&format!("{e:#}"));
                    return None;
                }
                tracing::error!("step {} failed: {e:#}", step.id);
                self.metrics.step_failures.fetch_add(1, Relaxed);
                // Only this step's sequences end; what they wrote of this step is in their own
                // (now freed, never registered) blocks, so the others and the prefix cache are intact.
                let msg = format!("engine step failed: {e:#}");
                for p in &step.plan {
                    if let Some(i) = self.sched.running.iter().position(|s| s.id == p.id) {
                        let s = self.sched.running.remove(i);
                        self.finish(s, FinishReason::Error(msg.clone()));
                    }
                }
                return None;
            }
        };
        self.metrics.steps.fetch_add(1, Relaxed);
        let hidden = std::mem::take(&mut out.hidden);
        for p in &step.plan {
            // Aborted while in flight: nothing to apply. A verification is applied with its
            // rows (engine/speculate.rs).
            let Some(s) = self.sched.running.iter_mut().find(|s| s.id == p.id) else { continue };
            if !p.draft.is_empty() {
                continue;
            }
            let decode = p.len == 1 && p.start + 1 == s.tokens.len() && s.generated() > 0;
            if !decode {
                self.metrics.prefill_tokens.fetch_add(p.len as u64, Relaxed);
            }
            s.computed += p.len;
            commit_computed(&mut self.sched.bm, &self.sched.cfg, s);
            if !decode && s.params.progress && s.computed <= s.prompt_len {
                let (processed, total) = (s.computed, s.prompt_len);
                // A send fails only when the client has gone: the abort comes from there.
                let _ = s.out.send(Event::Progress { processed, cached: s.cached_tokens.unwrap_or(0), total });
            }
        }
        if !hidden.is_empty() {
            if let Some(e) = &self.embed {
                e.pool(&step.plan, &hidden, &mut self.sched.running);
            }
        }
        let mut done: Vec<(u64, FinishReason)> = Vec::new();
        // A sequence's rows are consecutive: its prompt logprobs (if any), then its next token
        // (or, verifying proposals, a row per proposal and one after them).
        let mut lps: Vec<PromptLogprob> = Vec::new();
        let mut results = out.sampled.into_iter();
        let mut k = 0;
        while let (Some(&(id, row)), Some(r)) = (step.sampled.get(k), results.next()) {
            k += 1;
            if let Some(p) = step.plan.iter().find(|p| p.id == id && !p.draft.is_empty() && row == Row::Next) {
                let mut rows = vec![r];
                rows.extend(results.by_ref().take(p.draft.len()));
                k += p.draft.len();
                if let Some(reason) = self.sched.apply_verified(&self.tok, id, &p.draft, rows) {
                    done.push((id, reason));
                }
                continue;
            }
            let Some(s) = self.sched.running.iter_mut().find(|s| s.id == id) else { continue };
            if row == Row::Prompt {
                s.lp_done += 1;
                lps.push(PromptLogprob { id: r.id, logprob: r.logprob, top: r.top });
                let more = step.sampled.get(k) == Some(&(id, Row::Prompt));
                if !more && s.out.send(Event::PromptLogprobs(std::mem::take(&mut lps))).is_err() {
                    done.push((id, FinishReason::Abort));
                }
                continue;
            }
            // An embedding request ends once its prompt is computed, with its vector.
            if let Some(acc) = s.embed.take() {
                let reason = match acc.finish() {
                    Some(v) => match s.out.send(Event::Embedding(v)) {
                        Ok(()) => FinishReason::Stop,
                        Err(_) => FinishReason::Abort,
                    },
                    None => FinishReason::Error("the prompt's hidden states were not all computed".into()),
                };
                done.push((id, reason));
                continue;
            }
            self.metrics.decode_tokens.fetch_add(1, Relaxed);
            if let Some(reason) = accept(&self.tok, s, r, self.sched.cfg.max_seq_len) {
                done.push((id, reason));
            }
        }
        if !hidden.is_empty() {
            if let Some(d) = self.draft.as_mut() {
                d.0.observe(&step.plan, &hidden, &mut self.sched.running);
            }
        }
        Some(done)
    }

    pub(crate) fn fault_all(&mut self, msg: &str) {
        tracing::error!("{msg}");
        self.metrics.step_failures.fetch_add(1, Relaxed);
        self.epoch += 1;
        self.sched.busy.clear();
        for s in std::mem::take(&mut self.sched.running) {
            self.finish(s, FinishReason::Error(msg.to_string()));
        }
        self.sched.bm.drop_prefix_cache();
        self.sched.slots.drop_snapshots();
    }

    /// The device is gone: every request fails, /health answers 503 from now on, and new
    /// requests are refused (an orchestrator restarts the server).
    pub(crate) fn device_lost(&mut self, msg: &str) {
        self.metrics.set_down(msg.to_string());
        self.fault_all(msg);
        for s in std::mem::take(&mut self.sched.waiting) {
            self.finish(s, FinishReason::Error(msg.to_string()));
        }
    }

    /// A pipeline stage failed: its KV cache is gone or new. Every running sequence is failed
    /// (worker down) or recomputed from its tokens (worker restarted and answering), steps still
    /// in flight are discarded when they finish, and the prefix cache is dropped.
    pub(crate) fn stage_failed(&mut self, f: &StageFailure) {
        tracing::error!("{f}");
        self.metrics.stage_failures.fetch_add(1, Relaxed);
        self.epoch += 1;
        self.sched.busy.clear();
        let seqs = std::mem::take(&mut self.sched.running);
        if f.restarted {
            // Newest first, so the oldest ends up first in line.
            for s in seqs.into_iter().rev() {
                self.sched.requeue(s);
            }
        } else {
            for s in seqs {
                self.finish(s, FinishReason::Error(f.to_string()));
            }
        }
        self.sched.bm.drop_prefix_cache();
        self.sched.slots.drop_snapshots();
    }
}

/// Appends a sampled token, streams its text, and says whether the sequence is finished.
pub(crate) fn accept(tok: &Tokenizer, s: &mut Seq, r: Sampled, max_seq_len: usize) -> Option<FinishReason> {
    let id = r.id;
    if let Some(e) = s.constraint_error.take() {
        return Some(FinishReason::Error(e));
    }
    s.tokens.push(id);
    s.penalties.push(id);
    let stop = &s.params.stop;
    if (!stop.ignore_eos && tok.is_eos(id)) || stop.stop_token_ids.contains(&id) {
        return Some(FinishReason::Stop);
    }
    // Structured outputs: advance the grammar; once it is complete the request stops (the
    // token's text is still sent below).
    let mut grammar_done = false;
    if let Some(c) = s.params.constraint.as_mut().filter(|_| s.thinking.is_none()) {
        if let Err(e) = c.accept(id) {
            return Some(FinishReason::Error(e));
        }
        grammar_done = c.is_stopped();
    }
    let piece = s.detok.push(tok, id);
    // A grammar that waits for the end of the thinking starts with the next token.
    if let (Some(tail), Some(tag)) = (s.thinking.as_mut(), s.params.constraint_after.as_deref()) {
        tail.push_str(&piece);
        if tail.contains(tag) {
            s.thinking = None;
        } else {
            let mut cut = tail.len().saturating_sub(tag.len());
            while !tail.is_char_boundary(cut) {
                cut -= 1;
            }
            tail.drain(..cut);
        }
    }
    s.pending.push_str(&piece);
    let mut reason = None;
    let hit = stop.stop.iter().enumerate().filter_map(|(i, st)| s.pending.find(st.as_str()).map(|p| (p, i))).min();
    let text = if let Some((pos, i)) = hit {
        let t = s.pending[..pos].to_string();
        s.pending.clear();
        s.stopped_by = Some(i);
        reason = Some(FinishReason::Stop);
        t
    } else {
        let hold = held_suffix(&s.pending, &stop.stop);
        let cut = s.pending.len() - hold;
        let t = s.pending[..cut].to_string();
        s.pending.drain(..cut);
        t
    };
    if s.out.send(Event::Token { id, text, logprob: r.logprob, top: r.top }).is_err() {
        return Some(FinishReason::Abort);
    }
    if grammar_done {
        reason.get_or_insert(FinishReason::Stop);
    }
    if reason.is_none() && (s.generated() >= s.max_tokens || s.tokens.len() >= max_seq_len) {
        reason = Some(FinishReason::Length);
    }
    reason
}

/// Brings `s`'s cache state to its `computed` positions: blocks that just became full are
/// registered in the prefix cache (their keys from the sequence's tokens), and with a sliding
/// window the blocks every later query has left behind are freed.
pub(crate) fn commit_computed(bm: &mut BlockManager, cfg: &SchedulerConfig, s: &mut Seq) {
    let bs = cfg.block_size;
    let full = s.computed / bs;
    let salted = s.params.cache_salt.is_some();
    while s.keys.len() < full {
        let i = s.keys.len();
        let parent = if i == 0 { s.root } else { s.keys[i - 1] };
        let key = bm.register(s.table[i], &parent, i == 0, &s.tokens[i * bs..(i + 1) * bs], salted);
        s.keys.push(key);
    }
    // Sliding window: the next query (position `computed`) and every later one attend to
    // positions >= computed + 1 - window only; whole blocks before that are freed (they stay in
    // the prefix cache while unreferenced).
    if let Some(w) = cfg.sliding_window {
        let gone = ((s.computed + 1).saturating_sub(w) / bs).min(s.table.len());
        if gone > s.released {
            bm.release(&s.table[s.released..gone]);
            s.released = gone;
        }
    }
}

/// Longest suffix of `s` that is a proper prefix of one of `stops` (bytes, on a char boundary).
pub(crate) fn held_suffix(s: &str, stops: &[String]) -> usize {
    let mut best = 0;
    for stop in stops {
        for (i, _) in s.char_indices() {
            let suffix = &s[i..];
            if suffix.len() < stop.len() && stop.starts_with(suffix) {
                best = best.max(suffix.len());
                break;
            }
        }
    }
    best
}
