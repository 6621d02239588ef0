//! What runs next: running sequences first (decodes, then prefill chunks), then waiting ones
//! in arrival order with fair admission, within the step's token budget, sequence caps and
//! row limit; preemption when blocks run out.
//!
//! Pure: sequences and the block manager in, a step plan out. It never sees the executor or a
//! device; the loop tells it the step's row limit and how many steps may still be submitted.

use super::metrics::EngineMetrics;
use super::sequence::Seq;
use crate::config::SpecSettings;
use crate::kv::{BlockManager, StateSlots};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// How many steps a waiting request that does not fit may see requests behind it start
/// before admission waits for it (fair admission, see `schedule`).
pub const MAX_PASSED_OVER: u32 = 32;
/// Most waiting requests passed over in one step.
const MAX_LOOKAHEAD: usize = 16;

#[derive(Clone, Copy, Debug)]
pub struct SchedulerConfig {
    pub max_num_batched_tokens: usize,
    pub max_decode_batch_size: usize,
    pub max_prefill_batch_size: usize,
    pub max_seq_len: usize,
    pub block_size: usize,
    /// The model attends to the last `n` positions only: blocks that left the window are freed.
    pub sliding_window: Option<usize>,
    /// Speculative decoding (engine/speculate.rs).
    pub spec: SpecSettings,
}

/// One sequence's share of a step: tokens `start..start + len` of it, the last `draft.len()`
/// of them proposed tokens after its last one (speculative decoding), verified in this step.
pub(crate) struct Planned {
    pub(crate) id: u64,
    pub(crate) start: usize,
    pub(crate) len: usize,
    pub(crate) draft: Vec<u32>,
    /// Under a grammar: the masks of the rows verifying `draft` (engine/speculate.rs).
    pub(crate) masks: Option<Vec<Vec<u32>>>,
    /// A hybrid model's state snapshot taken in this step (the prefix cache): the slot it goes
    /// to and the sequence's block it follows (`Scheduler::snapshot`).
    pub(crate) snap: Option<(u32, usize)>,
    /// A hybrid model's sequence starting after a cached prefix: the snapshot slot its state is
    /// read from in this step (pinned until the step is done).
    pub(crate) src: Option<u32>,
}

/// A step's per-token rows (`rows`: [tokens, width] in the plan's order) split by planned
/// sequence; None when their count does not match the plan's tokens.
pub(crate) fn rows_by_seq<'a>(
    plan: &'a [Planned],
    rows: &'a [f32],
    width: usize,
) -> Option<Vec<(&'a Planned, &'a [f32])>> {
    let total: usize = plan.iter().map(|p| p.len).sum();
    if width == 0 || rows.len() != total * width {
        return None;
    }
    let mut at = 0;
    Some(
        plan.iter()
            .map(|p| {
                let r = &rows[at * width..(at + p.len) * width];
                at += p.len;
                (p, r)
            })
            .collect(),
    )
}

/// The queues and the cache: what the scheduler decides over.
pub(crate) struct Scheduler {
    pub(crate) cfg: SchedulerConfig,
    pub(crate) bm: BlockManager,
    /// Recurrent-state slots (hybrid models): a running sequence holds one.
    pub(crate) slots: StateSlots,
    pub(crate) waiting: VecDeque<Seq>,
    /// In admission order: admitted sequences are pushed last and removals keep the order, so
    /// the newest (the first to preempt) is last.
    pub(crate) running: Vec<Seq>,
    /// Sequences in steps in flight, with how many steps each (never preempted).
    pub(crate) busy: HashMap<u64, usize>,
    pub(crate) metrics: Arc<EngineMetrics>,
    /// Whether the next step may speculate (the loop's cost gate, `spec::CostGate`).
    pub(crate) spec_allowed: bool,
    /// Tokens that end a chat turn (the tokenizer's end-of-sequence ids): a hybrid model's
    /// prefill chunks end before the prompt's first and last (`turn_cut`).
    pub(crate) turn_ends: Vec<u32>,
}

impl Scheduler {
    pub(crate) fn new(cfg: SchedulerConfig, bm: BlockManager, metrics: Arc<EngineMetrics>) -> Scheduler {
        let (waiting, running, busy) = (VecDeque::new(), Vec::new(), HashMap::new());
        let slots = StateSlots::new(0);
        Scheduler { cfg, bm, slots, waiting, running, busy, metrics, spec_allowed: true, turn_ends: Vec::new() }
    }

    pub(crate) fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    pub(crate) fn preempt(&mut self, idx: usize) {
        let s = self.running.remove(idx);
        self.requeue(s);
    }

    /// Frees a sequence's blocks and puts it first in line, to be recomputed from its tokens.
    pub(crate) fn requeue(&mut self, mut s: Seq) {
        self.bm.release(&s.table[s.released..]);
        s.table.clear();
        for slot in [s.state_slot.take(), s.backup_slot.take()].into_iter().flatten() {
            self.slots.release(slot);
        }
        s.released = 0;
        s.keys.clear();
        s.computed = 0;
        s.scheduled = 0;
        s.draft_computed = 0;
        s.mtp_rows = Vec::new();
        self.metrics.preemptions.fetch_add(1, Relaxed);
        self.waiting.push_front(s);
    }

    /// The next step's plan: which sequences run which token ranges. `max_seqs`: the step's
    /// sequence and sample-row limit; `slots_left`: steps that may still be submitted before the
    /// pipeline is full (running decodes are spread over them).
    pub(crate) fn schedule(&mut self, max_seqs: usize, slots_left: usize) -> Vec<Planned> {
        let slots_left = slots_left.max(1);
        let bs = self.cfg.block_size;
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut plan = Vec::new();
        let (mut n_decode, mut n_prefill) = (0, 0);
        let idle = self.running.iter().filter(|s| !self.busy.contains_key(&s.id)).count();
        let decode_cap = self.cfg.max_decode_batch_size.min(idle.div_ceil(slots_left).max(1));
        let speculate = self.speculates(decode_cap);

        // Sample rows so far: one per sequence that samples, plus prompt-logprob rows (at most
        // max_seqs in all, the step's row limit).
        let mut rows = 0;
        // Running sequences, oldest first: decode tokens and continuing prefill chunks.
        let mut i = 0;
        while i < self.running.len() && budget > 0 && plan.len() < max_seqs && rows < max_seqs {
            let s = &self.running[i];
            // In flight with its last token (it samples): wait for that result.
            let remaining = s.tokens.len() - s.scheduled;
            if remaining == 0 {
                i += 1;
                continue;
            }
            let decode = remaining == 1 && s.computed == s.scheduled;
            if (decode && n_decode >= decode_cap) || (!decode && n_prefill >= self.cfg.max_prefill_batch_size) {
                i += 1;
                continue;
            }
            let len = s.chunk_within_rows(s.scheduled, remaining.min(budget), max_seqs - rows);
            let len = if decode { len } else { self.turn_cut(s, s.scheduled, len) };
            // A hybrid model's sequence computing its accepted tokens again after a rejected
            // proposal (generated tokens only, all in this step) proposes after them too.
            let again = !decode
                && s.computed == s.scheduled
                && s.scheduled >= s.prompt_len
                && len == remaining
                && remaining <= crate::config::MAX_SPECULATIVE_TOKENS + 1;
            let mut draft = match (decode || again) && speculate {
                true => self.draft(s, (budget - len).min(max_seqs - rows - s.rows_in(s.scheduled, len))),
                false => Vec::new(),
            };
            let mut len = len + draft.len();
            let need = (s.scheduled + len).div_ceil(bs);
            let mut stop = false;
            while self.running[i].table.len() < need {
                match self.bm.allocate() {
                    Some(b) => self.running[i].table.push(b),
                    None => {
                        // Out of blocks: preempt the most recently admitted sequence that is
                        // not in flight (perhaps this one; planned ones are older). When all
                        // from here on are in flight, wait for their results.
                        let victim =
                            (i..self.running.len()).rev().find(|&v| !self.busy.contains_key(&self.running[v].id));
                        if let Some(v) = victim {
                            self.preempt(v);
                        }
                        if victim.is_none_or(|v| v == i) {
                            stop = true;
                            break;
                        }
                    }
                }
            }
            if stop {
                break;
            }
            // A hybrid model's sequence verifies proposals only with a free slot to keep its
            // state from before them in (engine/speculate.rs); without one it decodes plainly
            // (the blocks taken for the proposals serve its next tokens).
            if !draft.is_empty() && self.slots.needed() {
                match self.slots.acquire() {
                    Some(b) => self.running[i].backup_slot = Some(b),
                    None => {
                        len -= draft.len();
                        draft.clear();
                    }
                }
            }
            let s = &self.running[i];
            rows += s.rows_in(s.scheduled, len - draft.len()) + draft.len();
            // A verifying step's snapshot keeps the state before the proposals (engine/runner.rs).
            let snap = if draft.is_empty() { self.snapshot(s.scheduled, len) } else { None };
            let s = &self.running[i];
            plan.push(Planned { id: s.id, start: s.scheduled, len, draft, masks: None, snap, src: None });
            budget -= len;
            if decode {
                n_decode += 1;
            } else {
                n_prefill += 1;
            }
            i += 1;
        }

        // Waiting sequences in arrival order (preempted ones are at the front). One whose
        // chunk does not fit in the free blocks now is passed over for those behind it that
        // do (at most MAX_LOOKAHEAD looked at past it), but only MAX_PASSED_OVER times: from
        // then on nothing behind it starts until it does (running sequences finish and free
        // their blocks), so a large request is delayed, never starved.
        let mut at = 0;
        let mut skipped = 0;
        while budget > 0 && n_prefill < self.cfg.max_prefill_batch_size && plan.len() < max_seqs && rows < max_seqs {
            let Some(s) = self.waiting.get(at) else { break };
            // A hybrid model's sequence needs a state slot: none free, none behind it starts.
            if self.slots.needed() && self.slots.available() == 0 {
                break;
            }
            // Reuse cached full blocks, but always compute the last token (its logits are needed),
            // and every position whose prompt logprob is still wanted.
            let reusable = (s.tokens.len() - 1).min(s.prompt_rows_from());
            let mut hit = self.bm.lookup_prefix(&s.tokens, reusable, &s.root);
            // A hybrid model starts after a cached prefix only from a state snapshot of it: the
            // hit ends at the last block with one (kv/state.rs).
            if self.slots.needed() {
                let keep = hit.keys.iter().rposition(|k| self.slots.has(k)).map_or(0, |i| i + 1);
                self.bm.release(&hit.blocks[keep..]);
                hit.blocks.truncate(keep);
                hit.keys.truncate(keep);
            }
            let computed = hit.blocks.len() * bs;
            let len = s.chunk_within_rows(computed, (s.tokens.len() - computed).min(budget), max_seqs - rows);
            let len = self.turn_cut(s, computed, len);
            let need = (computed + len).div_ceil(bs) - hit.blocks.len();
            if self.bm.available() < need {
                self.bm.release(&hit.blocks);
                if s.passed_over >= MAX_PASSED_OVER || skipped >= MAX_LOOKAHEAD {
                    break;
                }
                skipped += 1;
                at += 1;
                continue;
            }
            // A hybrid model's sequence: a slot of its own, its state read from the snapshot
            // after its cached prefix in its first step (pinned first, so taking the slot cannot
            // give it up).
            let src = hit.keys.last().filter(|_| self.slots.needed()).and_then(|k| self.slots.read(k));
            let state_slot = if self.slots.needed() { self.slots.acquire() } else { None };
            if self.slots.needed() && state_slot.is_none() {
                if let Some(x) = src {
                    self.slots.unpin(x);
                }
                self.bm.release(&hit.blocks);
                break;
            }
            // Counted once per admitted request (a request waiting for room is looked up again
            // every step).
            self.bm.count_lookup(hit.queried, hit.blocks.len());
            if s.cached_tokens.is_none() {
                // Token-based, at first admission only (as vLLM counts: a preempted request's
                // recomputation is not a new query).
                self.metrics.prefix_query_tokens.fetch_add(s.tokens.len() as u64, Relaxed);
                self.metrics.prefix_hit_tokens.fetch_add(computed as u64, Relaxed);
            }
            let keys = hit.keys;
            let mut s = self.waiting.remove(at).expect("index exists");
            // Those before it were passed over once more.
            for w in self.waiting.iter_mut().take(at) {
                w.passed_over += 1;
            }
            s.table = hit.blocks;
            s.state_slot = state_slot;
            for _ in 0..need {
                s.table.push(self.bm.allocate().expect("checked available"));
            }
            s.keys = keys;
            s.computed = computed;
            s.scheduled = computed;
            s.cached_tokens.get_or_insert(computed.min(s.prompt_len));
            rows += s.rows_in(computed, len);
            let id = s.id;
            self.running.push(s);
            let snap = self.snapshot(computed, len);
            plan.push(Planned { id, start: computed, len, draft: Vec::new(), masks: None, snap, src });
            budget -= len;
            n_prefill += 1;
        }
        plan
    }

    /// A hybrid model's prefill chunk `start..start + len`, cut at the block boundary before the
    /// prompt's first end-of-turn token (the end of a system prompt), else before its last (the
    /// conversation so far), where the chunk crosses one: the chunk's last block is the one its
    /// state is snapshotted after (`snapshot`), so another request with the same system prompt or
    /// conversation starts after it instead of from zero. One more step for such a prompt.
    fn turn_cut(&self, s: &Seq, start: usize, len: usize) -> usize {
        if !self.slots.needed() || !self.bm.enable_prefix_cache || self.turn_ends.is_empty() {
            return len;
        }
        let bs = self.cfg.block_size;
        let prompt = &s.tokens[..s.prompt_len.min(s.tokens.len())];
        let first = prompt.iter().position(|t| self.turn_ends.contains(t));
        let last = prompt.iter().rposition(|t| self.turn_ends.contains(t));
        for end in [first, last].into_iter().flatten() {
            let b = (end + 1) / bs * bs;
            if b > start && b < start + len {
                return b - start;
            }
        }
        len
    }

    /// A state snapshot for the prefix cache (hybrid models): when a sequence's tokens
    /// `start..start + len` of this step complete a KV block, the state after the last such
    /// block goes to a slot of its own, stored under the block's key once the step is done
    /// (engine/output.rs). Only a slot that waiting requests can spare is taken (the oldest
    /// snapshot's, if none is free).
    fn snapshot(&mut self, start: usize, len: usize) -> Option<(u32, usize)> {
        let bs = self.cfg.block_size;
        let end = (start + len) / bs * bs;
        if !self.slots.needed()
            || !self.bm.enable_prefix_cache
            || end <= start
            || self.slots.available() <= self.waiting.len()
        {
            return None;
        }
        self.slots.acquire().map(|slot| (slot, end / bs - 1))
    }
}
