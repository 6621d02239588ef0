//! The engine loop: one thread owns the model (or the pipeline of stages) and the KV cache,
//! schedules every step (vLLM-style: running sequences first, then waiting ones in arrival
//! order, within a token budget, with chunked prefill and preemption), runs it, and streams
//! each request's tokens back through its channel.
//!
//! With a pipeline of S stages, up to S steps are in flight at once, each over sequences that
//! are in no other step in flight (a sequence's next token depends on its previous one), so
//! stage i can compute step k while stage i+1 computes step k-1. Running decodes are spread
//! over the in-flight steps; sequences in flight are never preempted.

use super::metrics::EngineMetrics;
use super::penalties::Penalties;
use super::request::{Event, FinishReason, PromptLogprob, Request, RequestParams, Usage};
use crate::gpu::GpuFault;
use crate::kv::{root_key, BlockId, BlockKey, BlockManager, KvEvent};
use crate::model::forward::{SampleParams, Sampled, StepInput};
use crate::pipeline::{Executor, Fault, StageFailure, StepResult};
use crate::sampling::Rng;
use crate::tokenizer::{IncrementalDecoder, Tokenizer};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use tokio::sync::mpsc::UnboundedSender;

pub(crate) enum Command {
    Submit {
        id: u64,
        req: Box<Request>,
        out: UnboundedSender<Event>,
    },
    Abort(u64),
    /// Stop: with `drain`, finish what is in flight first (new submissions are refused).
    Shutdown {
        drain: bool,
    },
    /// Test-only: arm a fault (see `pipeline::Fault`).
    Fault(Fault),
    /// The keys of the prefix cache's blocks, and how many KV-event batches were handed to the
    /// publisher so far (tests compare the cached set with the events).
    CachedBlocks(std::sync::mpsc::Sender<(Vec<BlockKey>, u64)>),
}

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
}

struct Seq {
    id: u64,
    /// Prompt then generated tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Tokens whose K/V are in the cache.
    computed: usize,
    /// Tokens submitted in steps (>= computed): later prompt chunks may be submitted while
    /// earlier ones are still in the pipeline, as each stage runs its steps in order.
    scheduled: usize,
    table: Vec<BlockId>,
    /// Leading table entries already released because they left the sliding window (their
    /// ids stay as placeholders; attention never reads them).
    released: usize,
    /// Prefix-cache keys of the table's full blocks, in order.
    keys: Vec<BlockKey>,
    /// The parent key of the first block: one per cache salt.
    root: BlockKey,
    params: RequestParams,
    max_tokens: usize,
    rng: Rng,
    out: UnboundedSender<Event>,
    detok: IncrementalDecoder,
    /// Released-by-the-detokenizer text held back because it may start a stop string.
    pending: String,
    /// Logit adjustments (penalties, logit_bias), kept up to date as tokens are generated.
    penalties: Penalties,
    cached_tokens: Option<usize>,
    /// Structured outputs: why the grammar could not give a mask (the sequence then fails).
    constraint_error: Option<String>,
    /// Prompt log-probabilities delivered so far (of tokens 1..=lp_done).
    lp_done: usize,
    /// Steps in which a request behind it started while it waited (see `schedule`).
    passed_over: u32,
}

impl Seq {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Whether position `pos` (in a chunk being scheduled) gets a prompt-logprob row: its
    /// logits predict prompt token `pos + 1`, not yet delivered.
    fn wants_prompt_row(&self, pos: usize) -> bool {
        self.params.prompt_logprobs.is_some() && pos >= self.lp_done && pos + 1 < self.prompt_len
    }

    /// Prompt positions from which prompt-logprob rows are still needed (`prompt_len` if none).
    fn prompt_rows_from(&self) -> usize {
        match self.params.prompt_logprobs {
            Some(_) if self.lp_done + 1 < self.prompt_len => self.lp_done,
            _ => self.prompt_len,
        }
    }

    /// Sample rows the chunk `start..start + len` adds to a step (prompt-logprob rows and the
    /// row that samples the next token).
    fn rows_in(&self, start: usize, len: usize) -> usize {
        let from = self.prompt_rows_from().max(start);
        let forced = (start + len).min(self.prompt_len.saturating_sub(1)).saturating_sub(from);
        forced + usize::from(start + len == self.tokens.len())
    }

    /// The longest chunk from `start` (at most `len`) whose rows fit in `room`.
    fn chunk_within_rows(&self, start: usize, len: usize, room: usize) -> usize {
        if self.rows_in(start, len) <= room {
            return len;
        }
        // Rows grow by at most one per token: shrink until they fit (at least one token, whose
        // row count is at most 1 <= room).
        let mut l = len.min(room.max(1));
        while l > 1 && self.rows_in(start, l) > room {
            l -= 1;
        }
        l
    }

    fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt_len,
            completion_tokens: self.generated(),
            cached_tokens: self.cached_tokens.unwrap_or(0),
        }
    }

    /// This row's sampling parameters; `mask_words`: the model vocabulary's mask length.
    fn sample_params(&mut self, mask_words: usize) -> SampleParams {
        // Structured outputs: the grammar's allowed tokens (computed here, while no step of
        // this sequence is in flight; see BENCHMARKS.md for its cost).
        let mask = match self.params.constraint.as_mut() {
            Some(c) if self.constraint_error.is_none() => match c.mask(mask_words) {
                Ok(m) => Some(m),
                Err(e) => {
                    self.constraint_error = Some(e);
                    None
                }
            },
            _ => None,
        };
        let p = &self.params;
        SampleParams {
            temperature: p.sampling.temperature,
            top_p: p.sampling.top_p,
            top_k: p.sampling.top_k,
            min_p: p.sampling.min_p,
            u: self.rng.uniform(),
            repetition_penalty: p.repetition_penalty,
            frequency_penalty: p.frequency_penalty,
            presence_penalty: p.presence_penalty,
            n_top: p.logprobs.unwrap_or(0),
            adjust: self.penalties.list().to_vec(),
            mask,
            force: None,
        }
    }
}

/// One sequence's share of a step.
struct Planned {
    id: u64,
    start: usize,
    len: usize,
}

/// A step submitted and not yet finished.
struct InFlight {
    id: u64,
    /// Steps from before a stage failure are discarded when they finish.
    epoch: u64,
    plan: Vec<Planned>,
    /// What each sample row of this step is for, in sample-row order.
    sampled: Vec<(u64, Row)>,
}

/// A sample row's purpose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Row {
    /// The sequence's next token.
    Next,
    /// The log-probability of the prompt token after this position.
    Prompt,
}

pub(crate) struct EngineCore {
    exec: Executor,
    in_flight: VecDeque<InFlight>,
    /// Sequences in steps in flight, with how many steps each.
    busy: HashMap<u64, usize>,
    next_step: u64,
    epoch: u64,
    tok: Arc<Tokenizer>,
    bm: BlockManager,
    cfg: SchedulerConfig,
    waiting: VecDeque<Seq>,
    /// In admission order: admitted sequences are pushed last and removals keep the order, so
    /// the newest (the first to preempt) is last.
    running: Vec<Seq>,
    metrics: Arc<EngineMetrics>,
    draining: bool,
    /// Test-only: the next result is taken as another step's.
    mismatch_next: bool,
    /// Where each step's KV-cache events go (`--kv-events-endpoint`), with the batches sent.
    kv_events: Option<(std::sync::mpsc::Sender<Vec<KvEvent>>, u64)>,
}

/// Longest suffix of `s` that is a proper prefix of one of `stops` (bytes, on a char boundary).
fn held_suffix(s: &str, stops: &[String]) -> usize {
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

impl EngineCore {
    pub(crate) fn new(
        exec: Executor,
        tok: Arc<Tokenizer>,
        cfg: SchedulerConfig,
        enable_prefix_cache: bool,
        metrics: Arc<EngineMetrics>,
        kv_events: Option<std::sync::mpsc::Sender<Vec<KvEvent>>>,
    ) -> EngineCore {
        let mut bm = BlockManager::new(exec.num_blocks(), cfg.block_size, enable_prefix_cache);
        if kv_events.is_some() {
            bm = bm.with_events();
        }
        let mut core = EngineCore {
            exec,
            in_flight: VecDeque::new(),
            busy: HashMap::new(),
            next_step: 0,
            epoch: 0,
            tok,
            bm,
            cfg,
            waiting: VecDeque::new(),
            running: Vec::new(),
            metrics,
            draining: false,
            mismatch_next: false,
            kv_events: kv_events.map(|tx| (tx, 0)),
        };
        core.publish();
        core
    }

    pub(crate) fn run(mut self, rx: std::sync::mpsc::Receiver<Command>) {
        loop {
            let idle = self.waiting.is_empty() && self.running.is_empty() && self.in_flight.is_empty();
            if idle {
                if self.draining {
                    return;
                }
                match rx.recv() {
                    Ok(cmd) => {
                        if !self.handle(cmd) {
                            return;
                        }
                    }
                    Err(_) => return,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(cmd) => {
                        if !self.handle(cmd) {
                            return;
                        }
                    }
                    Err(std::sync::mpsc::TryRecvError::Empty) => break,
                    // Every handle is gone: finish what is in flight, then stop.
                    Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                        self.draining = true;
                        break;
                    }
                }
            }
            self.reap_closed();
            // Fill the pipeline: up to one step per stage, over sequences not already in flight.
            while self.in_flight.len() < self.exec.depth() {
                let plan = self.schedule();
                if plan.is_empty() {
                    break;
                }
                self.submit_step(plan);
            }
            if self.in_flight.is_empty() {
                if self.running.is_empty() {
                    if let Some(s) = self.waiting.pop_front() {
                        // Cannot happen for requests that passed validation; never spin on it.
                        self.finish(s, FinishReason::Error("request does not fit in the KV cache".into()));
                    }
                }
                self.publish();
                continue;
            }
            match self.exec.recv() {
                Some(r) => self.complete(r),
                // Cannot happen (the executor counts the same steps); never wait forever on it.
                None => {
                    self.in_flight.clear();
                    self.busy.clear();
                }
            }
            self.publish();
        }
    }

    /// Returns false when the loop must stop now.
    fn handle(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Submit { id, req, out } => {
                let refuse = if self.draining {
                    Some("the engine is shutting down".to_string())
                } else {
                    self.metrics.down().map(|why| format!("the engine cannot serve: {why}"))
                };
                if let Some(msg) = refuse {
                    self.metrics.requests_failed.fetch_add(1, Relaxed);
                    let _ = out.send(Event::Done {
                        text: String::new(),
                        reason: FinishReason::Error(msg),
                        usage: Usage::default(),
                    });
                    return true;
                }
                let prompt_len = req.prompt.len();
                let max_tokens = req.params.stop.max_tokens.unwrap_or(self.cfg.max_seq_len - prompt_len);
                let seed = req.params.sampling.seed;
                let skip_special = req.params.skip_special_tokens;
                let p = &req.params;
                let repetition = p.repetition_penalty != 1.0;
                let counting = repetition || p.frequency_penalty != 0.0 || p.presence_penalty != 0.0;
                let penalties = Penalties::new(&req.prompt, repetition, counting, &p.logit_bias);
                self.waiting.push_back(Seq {
                    id,
                    tokens: req.prompt,
                    prompt_len,
                    computed: 0,
                    scheduled: 0,
                    table: vec![],
                    released: 0,
                    keys: vec![],
                    root: root_key(req.params.cache_salt.as_deref()),
                    params: req.params,
                    max_tokens,
                    rng: seed.map(Rng::new).unwrap_or_else(Rng::from_entropy),
                    out,
                    detok: IncrementalDecoder::new(skip_special),
                    pending: String::new(),
                    penalties,
                    cached_tokens: None,
                    constraint_error: None,
                    lp_done: 0,
                    passed_over: 0,
                });
            }
            Command::Abort(id) => self.abort(id),
            Command::Shutdown { drain } => {
                if !drain {
                    let ids: Vec<u64> =
                        self.running.iter().map(|s| s.id).chain(self.waiting.iter().map(|s| s.id)).collect();
                    for id in ids {
                        self.abort(id);
                    }
                    self.publish();
                    return false;
                }
                self.draining = true;
            }
            Command::CachedBlocks(reply) => {
                self.flush_kv_events();
                let sent = self.kv_events.as_ref().map_or(0, |(_, n)| *n);
                let _ = reply.send((self.bm.cached_keys(), sent));
            }
            Command::Fault(f) => match f {
                Fault::EnginePanic => panic!("injected fault: the engine thread panics"),
                Fault::StepIdMismatch => self.mismatch_next = true,
                f => self.exec.inject(f),
            },
        }
        true
    }

    fn abort(&mut self, id: u64) {
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            let s = self.waiting.remove(i).expect("index from position");
            self.finish(s, FinishReason::Abort);
        } else if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let s = self.running.remove(i);
            self.finish(s, FinishReason::Abort);
        }
    }

    /// Aborts requests whose receiver is gone (client disconnected, stream dropped).
    fn reap_closed(&mut self) {
        let ids: Vec<u64> =
            self.running.iter().chain(self.waiting.iter()).filter(|s| s.out.is_closed()).map(|s| s.id).collect();
        for id in ids {
            self.abort(id);
        }
    }

    /// Ends a sequence that is in neither queue any more: frees its blocks, tells the caller.
    fn finish(&mut self, mut s: Seq, reason: FinishReason) {
        self.bm.release(&s.table[s.released..]);
        s.table.clear();
        s.released = 0;
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

    fn preempt(&mut self, idx: usize) {
        let s = self.running.remove(idx);
        self.requeue(s);
    }

    /// Frees a sequence's blocks and puts it first in line, to be recomputed from its tokens.
    fn requeue(&mut self, mut s: Seq) {
        self.bm.release(&s.table[s.released..]);
        s.table.clear();
        s.released = 0;
        s.keys.clear();
        s.computed = 0;
        s.scheduled = 0;
        self.metrics.preemptions.fetch_add(1, Relaxed);
        self.waiting.push_front(s);
    }

    fn schedule(&mut self) -> Vec<Planned> {
        let bs = self.cfg.block_size;
        let max_seqs = self.exec.limits().max_seqs;
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut plan = Vec::new();
        let (mut n_decode, mut n_prefill) = (0, 0);
        // With steps still to submit before the pipeline is full, leave running sequences for them.
        let slots_left = self.exec.depth().saturating_sub(self.in_flight.len()).max(1);
        let idle = self.running.iter().filter(|s| !self.busy.contains_key(&s.id)).count();
        let decode_cap = self.cfg.max_decode_batch_size.min(idle.div_ceil(slots_left).max(1));

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
            let s = &self.running[i];
            rows += s.rows_in(s.scheduled, len);
            plan.push(Planned { id: s.id, start: s.scheduled, len });
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
            // Reuse cached full blocks, but always compute the last token (its logits are needed),
            // and every position whose prompt logprob is still wanted.
            let reusable = (s.tokens.len() - 1).min(s.prompt_rows_from());
            let hit = self.bm.lookup_prefix(&s.tokens, reusable, &s.root);
            let computed = hit.blocks.len() * bs;
            let len = s.chunk_within_rows(computed, (s.tokens.len() - computed).min(budget), max_seqs - rows);
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
            for _ in 0..need {
                s.table.push(self.bm.allocate().expect("checked available"));
            }
            s.keys = keys;
            s.computed = computed;
            s.scheduled = computed;
            s.cached_tokens.get_or_insert(computed.min(s.prompt_len));
            rows += s.rows_in(computed, len);
            plan.push(Planned { id: s.id, start: computed, len });
            budget -= len;
            n_prefill += 1;
            self.running.push(s);
        }
        plan
    }

    fn submit_step(&mut self, plan: Vec<Planned>) {
        let bs = self.cfg.block_size as u32;
        let mask_words = self.exec.vocab().div_ceil(32);
        let index: HashMap<u64, usize> = self.running.iter().enumerate().map(|(i, s)| (s.id, i)).collect();
        let mut input = StepInput::default();
        let mut sampled = Vec::new();
        for (j, p) in plan.iter().enumerate() {
            let s = &mut self.running[index[&p.id]];
            for pos in p.start..p.start + p.len {
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
            input.block_tables.push(s.table.clone());
            if p.start + p.len == s.tokens.len() {
                input.sample_rows.push(input.tokens.len() as u32 - 1);
                input.sampling.push(s.sample_params(mask_words));
                sampled.push((p.id, Row::Next));
            }
            s.scheduled = p.start + p.len;
            *self.busy.entry(p.id).or_insert(0) += 1;
        }
        if !self.in_flight.is_empty() {
            self.metrics.steps_overlapped.fetch_add(1, Relaxed);
        }
        self.next_step += 1;
        let id = self.next_step;
        self.in_flight.push_back(InFlight { id, epoch: self.epoch, plan, sampled });
        self.exec.submit(id, input);
    }

    /// Applies the oldest step's result.
    fn complete(&mut self, r: StepResult) {
        let Some(step) = self.in_flight.pop_front() else { return };
        if step.epoch != self.epoch {
            // Submitted before a stage failure: its sequences were already failed or requeued,
            // and `busy` was reset then (it may count their new steps by now).
            return;
        }
        let got = if std::mem::take(&mut self.mismatch_next) { r.id.wrapping_add(1) } else { r.id };
        if got != step.id {
            // Results must come back in submission order; one that does not could hand tokens to
            // the wrong sequences, so nothing of it is applied.
            self.fault_all(&format!("engine step {} returned the result of step {got}", step.id));
            return;
        }
        for p in &step.plan {
            if let Some(n) = self.busy.get_mut(&p.id) {
                *n -= 1;
                if *n == 0 {
                    self.busy.remove(&p.id);
                }
            }
        }
        let out = match r.result {
            Ok(out) => out,
            Err(e) => {
                if let Some(f) = e.downcast_ref::<StageFailure>() {
                    self.stage_failed(f);
                    return;
                }
                if let Some(GpuFault::Lost(_)) = e.downcast_ref::<GpuFault>() {
                    self.device_lost(&format!("{e:#}"));
                    return;
                }
                tracing::error!("step {} failed: {e:#}", step.id);
                self.metrics.step_failures.fetch_add(1, Relaxed);
                // Only this step's sequences end; what they wrote of this step is in their own
                // (now freed, never registered) blocks, so the others and the prefix cache are intact.
                let msg = format!("engine step failed: {e:#}");
                for p in &step.plan {
                    if let Some(i) = self.running.iter().position(|s| s.id == p.id) {
                        let s = self.running.remove(i);
                        self.finish(s, FinishReason::Error(msg.clone()));
                    }
                }
                return;
            }
        };
        self.metrics.steps.fetch_add(1, Relaxed);
        let bs = self.cfg.block_size;
        for p in &step.plan {
            // Aborted while in flight: nothing to apply.
            let Some(s) = self.running.iter_mut().find(|s| s.id == p.id) else { continue };
            let decode = p.len == 1 && p.start + 1 == s.tokens.len() && s.generated() > 0;
            if !decode {
                self.metrics.prefill_tokens.fetch_add(p.len as u64, Relaxed);
            }
            s.computed += p.len;
            // Register blocks that just became full in the prefix cache.
            let full = s.computed / bs;
            let salted = s.params.cache_salt.is_some();
            while s.keys.len() < full {
                let i = s.keys.len();
                let parent = if i == 0 { s.root } else { s.keys[i - 1] };
                let key = self.bm.register(s.table[i], &parent, i == 0, &s.tokens[i * bs..(i + 1) * bs], salted);
                s.keys.push(key);
            }
            // Sliding window: the next query (position `computed`) and every later one attend
            // to positions >= computed + 1 - window only; whole blocks before that are freed
            // (they stay in the prefix cache while unreferenced).
            if let Some(w) = self.cfg.sliding_window {
                let gone = ((s.computed + 1).saturating_sub(w) / bs).min(s.table.len());
                if gone > s.released {
                    self.bm.release(&s.table[s.released..gone]);
                    s.released = gone;
                }
            }
        }
        let mut done: Vec<(u64, FinishReason)> = Vec::new();
        // A sequence's rows are consecutive: its prompt logprobs (if any), then its next token.
        let mut lps: Vec<PromptLogprob> = Vec::new();
        for (k, (&(id, row), r)) in step.sampled.iter().zip(out.sampled).enumerate() {
            let Some(s) = self.running.iter_mut().find(|s| s.id == id) else { continue };
            if row == Row::Prompt {
                s.lp_done += 1;
                lps.push(PromptLogprob { id: r.id, logprob: r.logprob, top: r.top });
                let more = step.sampled.get(k + 1) == Some(&(id, Row::Prompt));
                if !more && s.out.send(Event::PromptLogprobs(std::mem::take(&mut lps))).is_err() {
                    done.push((id, FinishReason::Abort));
                }
                continue;
            }
            self.metrics.decode_tokens.fetch_add(1, Relaxed);
            if let Some(reason) = Self::accept(&self.tok, s, r, self.cfg.max_seq_len) {
                done.push((id, reason));
            }
        }
        for (id, reason) in done {
            if let Some(i) = self.running.iter().position(|s| s.id == id) {
                let s = self.running.remove(i);
                self.finish(s, reason);
            }
        }
    }

    /// A step's result cannot be trusted to belong to its sequences: every running sequence is
    /// failed, steps still in flight are discarded, and the prefix cache is dropped (their K/V
    /// may have been written for other positions). Waiting requests are served afterwards.
    fn fault_all(&mut self, msg: &str) {
        tracing::error!("{msg}");
        self.metrics.step_failures.fetch_add(1, Relaxed);
        self.epoch += 1;
        self.busy.clear();
        for s in std::mem::take(&mut self.running) {
            self.finish(s, FinishReason::Error(msg.to_string()));
        }
        self.bm.drop_prefix_cache();
    }

    /// The device is gone: every request fails, /health answers 503 from now on, and new
    /// requests are refused (an orchestrator restarts the server).
    fn device_lost(&mut self, msg: &str) {
        self.metrics.set_down(msg.to_string());
        self.fault_all(msg);
        for s in std::mem::take(&mut self.waiting) {
            self.finish(s, FinishReason::Error(msg.to_string()));
        }
    }

    /// A pipeline stage failed: its KV cache is gone or new. Every running sequence is failed
    /// (worker down) or recomputed from its tokens (worker restarted and answering), steps still
    /// in flight are discarded when they finish, and the prefix cache is dropped.
    fn stage_failed(&mut self, f: &StageFailure) {
        tracing::error!("{f}");
        self.metrics.stage_failures.fetch_add(1, Relaxed);
        self.epoch += 1;
        self.busy.clear();
        let seqs = std::mem::take(&mut self.running);
        if f.restarted {
            // Newest first, so the oldest ends up first in line.
            for s in seqs.into_iter().rev() {
                self.requeue(s);
            }
        } else {
            for s in seqs {
                self.finish(s, FinishReason::Error(f.to_string()));
            }
        }
        self.bm.drop_prefix_cache();
    }

    /// Appends a sampled token, streams its text, and says whether the sequence is finished.
    fn accept(tok: &Tokenizer, s: &mut Seq, r: Sampled, max_seq_len: usize) -> Option<FinishReason> {
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
        if let Some(c) = s.params.constraint.as_mut() {
            if let Err(e) = c.accept(id) {
                return Some(FinishReason::Error(e));
            }
            grammar_done = c.is_stopped();
        }
        s.pending.push_str(&s.detok.push(tok, id));
        let mut reason = None;
        let text = if let Some(pos) = stop.stop.iter().filter_map(|st| s.pending.find(st.as_str())).min() {
            let t = s.pending[..pos].to_string();
            s.pending.clear();
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

    /// Hands the KV-cache events recorded since the last call to the publisher, as one batch.
    fn flush_kv_events(&mut self) {
        let Some((tx, sent)) = self.kv_events.as_mut() else { return };
        let events = self.bm.take_events();
        if events.is_empty() {
            return;
        }
        if tx.send(events).is_ok() {
            *sent += 1;
        }
    }

    /// Exports the counters, and the step's KV-cache events.
    fn publish(&mut self) {
        self.flush_kv_events();
        let m = &self.metrics;
        let st = self.bm.stats();
        m.waiting.store(self.waiting.len() as u64, Relaxed);
        m.running.store(self.running.len() as u64, Relaxed);
        m.kv_blocks_total.store(st.total as u64, Relaxed);
        m.kv_blocks_used.store(st.in_use as u64, Relaxed);
        m.kv_blocks_free.store((st.free + st.cached_idle) as u64, Relaxed);
        m.prefix_queries.store(st.prefix_queries, Relaxed);
        m.prefix_hits.store(st.prefix_hits, Relaxed);
    }
}
