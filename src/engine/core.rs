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
//! Here: the commands, the loop, step submission and faults; `sequence`: a sequence's state;
//! `scheduler`: what runs next; `runner`: the plan as step input; `output`: results applied.

use super::embed::EmbedHead;
use super::metrics::EngineMetrics;
use super::propose::{self, DraftModel};
use super::request::{Event, FinishReason, Request, Usage};
use super::runner::Row;
use super::scheduler::{Planned, Scheduler, SchedulerConfig};
use super::sequence::Seq;
use crate::config::SpecSettings;
use crate::exec::{Executor, Fault};
use crate::kv::{BlockKey, BlockManager, KvEvent};
use crate::tokenizer::Tokenizer;
use std::collections::VecDeque;
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
    /// Test-only: arm a fault (see `exec::Fault`).
    Fault(Fault),
    /// The keys of the prefix cache's blocks, and how many KV-event batches were handed to the
    /// publisher so far (tests compare the cached set with the events).
    CachedBlocks(std::sync::mpsc::Sender<(Vec<BlockKey>, u64)>),
    /// Turn embeddings on (engine/embed.rs); answers the embedding size or why not.
    EnableEmbeddings(std::sync::mpsc::Sender<Result<usize, String>>),
    /// Every sequence's state (running first, then waiting), for `GET /slots`.
    Slots(tokio::sync::oneshot::Sender<Vec<super::slots::SlotState>>),
}

/// A step submitted and not yet finished.
pub(crate) struct InFlight {
    pub(crate) id: u64,
    /// Steps from before a stage failure are discarded when they finish.
    pub(crate) epoch: u64,
    pub(crate) plan: Vec<Planned>,
    /// What each sample row of this step is for, in sample-row order.
    pub(crate) sampled: Vec<(u64, Row)>,
    /// A decode-only step on a single device: when it began (its draft rounds included) and
    /// whether it verified proposals, for the cost gate.
    pub(crate) timing: Option<(std::time::Instant, bool)>,
}

pub(crate) struct EngineCore {
    pub(crate) exec: Box<dyn Executor>,
    pub(crate) in_flight: VecDeque<InFlight>,
    pub(crate) next_step: u64,
    pub(crate) epoch: u64,
    pub(crate) tok: Arc<Tokenizer>,
    pub(crate) sched: Scheduler,
    pub(crate) metrics: Arc<EngineMetrics>,
    pub(crate) draining: bool,
    /// Where each step's KV-cache events go (`--kv-events-endpoint`), with the batches sent.
    pub(crate) kv_events: Option<(std::sync::mpsc::Sender<Vec<KvEvent>>, u64)>,
    /// Speculative decoding's proposer: the draft model or the MTP head (engine/propose.rs).
    pub(crate) draft: Option<DraftModel>,
    /// Whether speculating pays here, measured (single device only).
    pub(crate) gate: crate::spec::CostGate,
    /// Embeddings are on: the final norm applied to the emitted rows (engine/embed.rs).
    pub(crate) embed: Option<EmbedHead>,
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
        let slots = exec.state_slots();
        let mut bm = BlockManager::new(exec.num_blocks(), cfg.block_size, enable_prefix_cache);
        if kv_events.is_some() {
            bm = bm.with_events();
        }
        let mut core = EngineCore {
            exec,
            in_flight: VecDeque::new(),
            next_step: 0,
            epoch: 0,
            tok,
            sched: Scheduler::new(cfg, bm, metrics.clone()),
            metrics,
            draining: false,
            kv_events: kv_events.map(|tx| (tx, 0)),
            draft: None,
            embed: None,
            gate: crate::spec::CostGate::with_min_backoff(match cfg.spec.method.uses_model() {
                true => crate::spec::gate::DRAFT_BACKOFF_MIN,
                false => crate::spec::gate::BACKOFF_MIN,
            }),
        };
        core.sched.slots = crate::kv::StateSlots::new(slots);
        core.sched.turn_ends = core.tok.eos_token_ids().to_vec();
        core.publish();
        core
    }

    pub(crate) fn run(mut self, rx: std::sync::mpsc::Receiver<Command>) {
        loop {
            let idle = self.sched.is_idle() && self.in_flight.is_empty();
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
                let slots_left = self.exec.depth().saturating_sub(self.in_flight.len());
                let spec = &self.sched.cfg.spec;
                self.sched.spec_allowed =
                    self.exec.depth() > 1 || !spec.enabled() || !spec.cost_gate || self.gate.allow();
                let plan = self.sched.schedule(self.exec.limits().max_seqs, slots_left);
                if plan.is_empty() {
                    break;
                }
                self.submit_step(plan);
            }
            if self.in_flight.is_empty() {
                if self.sched.running.is_empty() {
                    if let Some(s) = self.sched.waiting.pop_front() {
                        // Cannot happen for requests that passed validation; never spin on it.
                        self.finish(s, FinishReason::Error("request does not fit in the KV cache".into()));
                    }
                }
                self.publish();
                continue;
            }
            match self.exec.recv() {
                Some(r) => {
                    let timing = self.in_flight.front().and_then(|f| f.timing);
                    let before = self.metrics.decode_tokens.load(Relaxed);
                    self.complete(r);
                    self.time_step(timing, before);
                }
                // Cannot happen (the executor counts the same steps); never wait forever on it.
                None => {
                    self.in_flight.clear();
                    self.sched.busy.clear();
                }
            }
            self.publish();
        }
    }

    /// Returns false when the loop must stop now.
    pub(crate) fn handle(&mut self, cmd: Command) -> bool {
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
                self.sched.waiting.push_back(Seq::new(id, *req, out, self.sched.cfg.max_seq_len));
            }
            Command::Abort(id) => self.abort(id),
            Command::Shutdown { drain } => {
                if !drain {
                    let ids: Vec<u64> = self
                        .sched
                        .running
                        .iter()
                        .map(|s| s.id)
                        .chain(self.sched.waiting.iter().map(|s| s.id))
                        .collect();
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
                let _ = reply.send((self.sched.bm.cached_keys(), sent));
            }
            Command::EnableEmbeddings(reply) => {
                let head = EmbedHead::enable(&mut *self.exec);
                let _ = reply.send(head.map(|h| self.embed.insert(h).dim()));
            }
            Command::Slots(reply) => {
                use super::slots::SlotState;
                let running = self.sched.running.iter().map(|s| SlotState::of(s, true));
                let _ = reply.send(running.chain(self.sched.waiting.iter().map(|s| SlotState::of(s, false))).collect());
            }
            Command::Fault(f) => match f {
                Fault::EnginePanic => panic!("injected fault: the engine thread panics"),
                f => self.exec.inject(f),
            },
        }
        true
    }

    pub(crate) fn abort(&mut self, id: u64) {
        if let Some(i) = self.sched.waiting.iter().position(|s| s.id == id) {
            let s = self.sched.waiting.remove(i).expect("index from position");
            self.finish(s, FinishReason::Abort);
        } else if let Some(i) = self.sched.running.iter().position(|s| s.id == id) {
            let s = self.sched.running.remove(i);
            self.finish(s, FinishReason::Abort);
        }
    }

    /// Aborts requests whose receiver is gone (client disconnected, stream dropped).
    pub(crate) fn reap_closed(&mut self) {
        let ids: Vec<u64> = self
            .sched
            .running
            .iter()
            .chain(self.sched.waiting.iter())
            .filter(|s| s.out.is_closed())
            .map(|s| s.id)
            .collect();
        for id in ids {
            self.abort(id);
        }
    }

    pub(crate) fn submit_step(&mut self, mut plan: Vec<Planned>) {
        let t0 = std::time::Instant::now();
        // The MTP head reads every step's hidden states: it catches up after each step.
        let mtp = self.draft.as_ref().is_some_and(|d| d.is_mtp());
        if self.sched.cfg.spec.method.uses_model() && (mtp || plan.iter().any(|p| !p.draft.is_empty())) {
            self.fill_drafts(&mut plan);
        }
        self.sched.grammar_drafts(&mut plan, self.exec.vocab().div_ceil(32));
        let (input, sampled) = self.sched.step_input(&plan, self.exec.vocab().div_ceil(32));
        if !self.in_flight.is_empty() {
            self.metrics.steps_overlapped.fetch_add(1, Relaxed);
        }
        self.next_step += 1;
        let id = self.next_step;
        // Decode-only: every planned sequence computes its last token (and proposals) only.
        let timed = self.exec.depth() == 1
            && self.sched.cfg.spec.enabled()
            && self.sched.cfg.spec.cost_gate
            && plan.iter().all(|p| p.len - p.draft.len() == 1)
            && sampled.iter().all(|(_, row)| *row == Row::Next);
        let timing = timed.then(|| (t0, plan.iter().any(|p| !p.draft.is_empty())));
        self.in_flight.push_back(InFlight { id, epoch: self.epoch, plan, sampled, timing });
        self.exec.submit(id, input);
    }

    /// Fills the proposals of `plan`'s speculating sequences (planned with placeholders) from
    /// the draft model or the MTP head (engine/propose.rs). Without one, or when it fails
    /// (speculative decoding is then off from now on, logged), they verify nothing in this step.
    pub(crate) fn fill_drafts(&mut self, plan: &mut [Planned]) {
        let Some(draft) = self.draft.as_mut() else {
            plan.iter_mut().for_each(propose::clear);
            return;
        };
        let (vocab, bs) = (self.exec.vocab(), self.sched.cfg.block_size);
        if let Err(e) = propose::fill(&mut *draft.0, &mut self.sched.running, plan, vocab, bs) {
            tracing::error!("the draft model / MTP head failed ({e:#}); speculative decoding is off from now on");
            if draft.is_mtp() {
                // Nothing reads the model's hidden states any more.
                self.exec.emit_hidden(false);
            }
            plan.iter_mut().for_each(propose::clear);
            self.sched.cfg.spec = SpecSettings::off();
            self.draft = None;
        }
    }

    /// The cost gate learns a decode-only step's seconds per token (`timing`: when it began and
    /// whether it verified proposals; `before`: the decode-token count before its result).
    pub(crate) fn time_step(&mut self, timing: Option<(std::time::Instant, bool)>, before: u64) {
        let Some((t0, spec)) = timing else { return };
        let tokens = self.metrics.decode_tokens.load(Relaxed).saturating_sub(before);
        let backoffs = self.gate.backoffs;
        let (plain, spec_cost) = self.gate.costs();
        self.gate.record(spec, t0.elapsed().as_secs_f64(), tokens as usize);
        if self.gate.backoffs > backoffs {
            let msg = format!(
                "speculative decoding costs more per token than plain decoding here ({:.1} vs {:.1} ms); off for {} steps, then measured again",
                spec_cost.unwrap_or(0.0) * 1e3,
                plain.unwrap_or(0.0) * 1e3,
                self.gate.backing_off_for()
            );
            // The first time on stderr (the default log shows errors only).
            if self.gate.backoffs == 1 {
                eprintln!("torus-wgpu: {msg}");
            }
            tracing::info!("{msg}");
        }
    }

    /// Hands the KV-cache events recorded since the last call to the publisher, as one batch.
    pub(crate) fn flush_kv_events(&mut self) {
        let Some((tx, sent)) = self.kv_events.as_mut() else { return };
        let events = self.sched.bm.take_events();
        if events.is_empty() {
            return;
        }
        if tx.send(events).is_ok() {
            *sent += 1;
        }
    }

    /// Exports the counters, and the step's KV-cache events.
    pub(crate) fn publish(&mut self) {
        self.flush_kv_events();
        let m = &self.metrics;
        let st = self.sched.bm.stats();
        m.waiting.store(self.sched.waiting.len() as u64, Relaxed);
        m.running.store(self.sched.running.len() as u64, Relaxed);
        m.kv_blocks_total.store(st.total as u64, Relaxed);
        m.kv_blocks_used.store(st.in_use as u64, Relaxed);
        m.kv_blocks_free.store((st.free + st.cached_idle) as u64, Relaxed);
        let slots = &self.sched.slots;
        m.state_slots_total.store((slots.in_use() + slots.available()) as u64, Relaxed);
        m.state_slots_used.store(slots.in_use() as u64, Relaxed);
        m.prefix_queries.store(st.prefix_queries, Relaxed);
        m.prefix_hits.store(st.prefix_hits, Relaxed);
    }
}
