//! The engine loop: one thread owns the model (or the pipeline of stages) and the KV cache,
//! schedules every step (vLLM-style: running sequences first, then waiting ones in arrival
//! order, within a token budget, with chunked prefill and preemption), runs it, and streams
//! each request's tokens back through its channel.
//!
//! With a pipeline of S stages, up to S steps are in flight at once, each over sequences that
//! are in no other step in flight (a sequence's next token depends on its previous one), so
//! stage i can compute step k while stage i+1 computes step k-1. Running decodes are spread
//! over the in-flight steps; sequences in flight are never preempted.
//!
//! Here: the commands, the loop, step submission (plan to step input) and faults;
//! `sequence`: a sequence's state; `schedule`: what runs next; `output`: results applied.

mod output;
mod schedule;
mod sequence;

use super::metrics::EngineMetrics;
use super::penalties::Penalties;
use super::request::{Event, FinishReason, Request, Usage};
use crate::exec::{Executor, Fault, StageFailure};
use crate::kv::{root_key, BlockKey, BlockManager, KvEvent};
use crate::model::forward::{SampleParams, StepInput};
use crate::sampling::Rng;
use crate::tokenizer::{IncrementalDecoder, Tokenizer};
use sequence::Seq;
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
    exec: Box<dyn Executor>,
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
    /// Where each step's KV-cache events go (`--kv-events-endpoint`), with the batches sent.
    kv_events: Option<(std::sync::mpsc::Sender<Vec<KvEvent>>, u64)>,
}

impl EngineCore {
    pub(crate) fn new(
        exec: Box<dyn Executor>,
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
