//! The async handle to the engine thread: submit a request, get its token stream; dropping the
//! stream (or calling abort) ends the request and frees its KV blocks.

use super::core::{Command, EngineCore};
use super::metrics::EngineMetrics;
use super::request::{Event, FinishReason, PromptLogprob, Request, RequestParams, Usage};
use super::scheduler::SchedulerConfig;
use crate::config::EngineConfig;
use crate::exec::{panic_message, Executor, Fault, StageHealth};
use crate::sampling::row::MAX_TOP_LOGPROBS;
use crate::structured::Grammars;
use crate::tokenizer::Tokenizer;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, OnceLock};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// Facts about the running engine (for logs, /v1/models, validation).
#[derive(Clone, Debug)]
pub struct EngineInfo {
    pub max_seq_len: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    pub vocab: usize,
    pub adapter: String,
    /// Most KV blocks one sequence holds at once: all of its tokens' blocks, or with a sliding
    /// window only those of the window and one step's tokens (the others are freed).
    pub max_blocks_per_seq: Option<usize>,
    /// Where KV-cache events are published (`kv_events_endpoint`), as bound.
    pub kv_events_addr: Option<std::net::SocketAddr>,
}

impl EngineInfo {
    /// The longest sequence (prompt and completion) a request may have: the configured
    /// `max_sequence_length`, or fewer when the whole KV cache holds fewer tokens. What the
    /// API reports as `max_model_len` and checks requests against.
    pub fn max_model_len(&self) -> usize {
        self.max_seq_len.min(self.num_blocks * self.block_size)
    }
}

#[derive(Clone)]
pub struct EngineHandle {
    tx: Sender<Command>,
    next_id: Arc<AtomicU64>,
    thread: Arc<Mutex<Option<std::thread::JoinHandle<()>>>>,
    pub metrics: Arc<EngineMetrics>,
    pub tokenizer: Arc<Tokenizer>,
    pub info: Arc<EngineInfo>,
    /// Pipeline stages' liveness (None for a single device).
    pub stages: Option<Arc<Vec<Arc<StageHealth>>>>,
    /// The single device's fault record (a lost device shows in `health` at once).
    gpu_faults: Option<Arc<crate::gpu::GpuFaults>>,
    /// Structured outputs' grammar compiler for this tokenizer, built at first use.
    grammars: Arc<OnceLock<Result<Arc<Grammars>, String>>>,
    /// The embedding size once embeddings are on ([`EngineHandle::enable_embeddings`]).
    embedding_dim: Arc<OnceLock<usize>>,
}

/// A request's output. Ends with `Event::Done`.
#[derive(Debug)]
pub struct RequestStream {
    pub id: u64,
    rx: UnboundedReceiver<Event>,
    tx: Sender<Command>,
    finished: bool,
}

/// A request's whole output, gathered.
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    pub ids: Vec<u32>,
    pub text: String,
    pub logprobs: Vec<f32>,
    /// With `prompt_logprobs`: the prompt tokens' logprobs (from the second token).
    pub prompt_logprobs: Vec<PromptLogprob>,
    pub reason: FinishReason,
    pub usage: Usage,
}

impl RequestStream {
    fn note(&mut self, e: &Option<Event>) {
        if matches!(e, None | Some(Event::Done { .. })) {
            self.finished = true;
        }
    }

    pub async fn next(&mut self) -> Option<Event> {
        let e = self.rx.recv().await;
        self.note(&e);
        e
    }

    /// Blocking receive, for callers outside an async runtime.
    pub fn next_blocking(&mut self) -> Option<Event> {
        let e = self.rx.blocking_recv();
        self.note(&e);
        e
    }

    /// Ends the request now; its blocks are freed by the engine.
    pub fn abort(&mut self) {
        if !self.finished {
            let _ = self.tx.send(Command::Abort(self.id));
            self.finished = true;
        }
    }

    /// Waits for the whole output (outside an async runtime).
    pub fn collect_blocking(mut self) -> Completion {
        let mut c = Completion {
            ids: vec![],
            text: String::new(),
            logprobs: vec![],
            prompt_logprobs: vec![],
            reason: FinishReason::Error("stream ended early".into()),
            usage: Usage::default(),
        };
        while let Some(e) = self.next_blocking() {
            match e {
                Event::Token { id, text, logprob, .. } => {
                    c.ids.push(id);
                    c.text.push_str(&text);
                    c.logprobs.push(logprob);
                }
                Event::PromptLogprobs(lps) => c.prompt_logprobs.extend(lps),
                Event::Embedding(_) | Event::Progress { .. } => {}
                Event::Done { text, reason, usage } => {
                    c.text.push_str(&text);
                    c.reason = reason;
                    c.usage = usage;
                    break;
                }
            }
        }
        c
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        self.abort();
    }
}

impl EngineHandle {
    /// Starts the engine thread, which takes ownership of the model (or pipeline). Panics if
    /// `cfg.kv_events_endpoint` is set and cannot be bound (`try_start` returns the error).
    pub fn start(exec: impl Into<Box<dyn Executor>>, tokenizer: Tokenizer, cfg: &EngineConfig) -> EngineHandle {
        Self::try_start(exec, tokenizer, cfg).unwrap_or_else(|e| panic!("starting the engine: {e:#}"))
    }

    /// `start`, failing when the KV-events endpoint cannot be bound.
    pub fn try_start(
        exec: impl Into<Box<dyn Executor>>,
        tokenizer: Tokenizer,
        cfg: &EngineConfig,
    ) -> anyhow::Result<EngineHandle> {
        Self::try_start_with_draft(exec, None, tokenizer, cfg)
    }

    /// `try_start` with speculative decoding's draft model (`load_draft`), which the config's
    /// speculative method `draft` needs.
    pub fn try_start_with_draft(
        exec: impl Into<Box<dyn Executor>>,
        draft: Option<super::propose::DraftModel>,
        tokenizer: Tokenizer,
        cfg: &EngineConfig,
    ) -> anyhow::Result<EngineHandle> {
        let mut exec = exec.into();
        if cfg.spec_settings()?.method.uses_model() && draft.is_none() {
            anyhow::bail!(
                "speculative decoding: the draft model is not loaded (engine::load_draft loads it, or the MTP head)"
            );
        }
        // The MTP head reads the model's hidden states after every step.
        if draft.as_ref().is_some_and(|d| d.is_mtp()) && !exec.emit_hidden(true) {
            anyhow::bail!("speculative mtp needs the whole model on one device (not pipeline stages)");
        }
        let limits = exec.limits();
        let b = cfg.batch_budget(limits.max_tokens);
        let sched = SchedulerConfig {
            max_num_batched_tokens: b.max_num_batched_tokens,
            max_decode_batch_size: b.max_decode_batch_size,
            max_prefill_batch_size: b.max_prefill_batch_size,
            max_seq_len: limits.max_seq_len,
            block_size: limits.block_size,
            sliding_window: limits.sliding_window,
            spec: cfg.spec_settings()?,
        };
        let max_blocks_per_seq =
            limits.sliding_window.map(|w| (w + sched.max_num_batched_tokens).div_ceil(limits.block_size) + 1);
        let metrics = Arc::new(EngineMetrics::default());
        let (kv_events, kv_events_addr) = match &cfg.kv_events_endpoint {
            Some(ep) => {
                let pc = crate::kv_events::PubConfig {
                    endpoint: ep.clone(),
                    topic: cfg.kv_events_topic.clone(),
                    connect: cfg.kv_events_connect,
                };
                let (tx, addr) = crate::kv_events::start(&pc, limits.block_size, metrics.kv_events.clone())?;
                (Some(tx), Some(addr))
            }
            None => (None, None),
        };
        let info = Arc::new(EngineInfo {
            kv_events_addr,
            max_blocks_per_seq,
            max_seq_len: limits.max_seq_len,
            block_size: limits.block_size,
            num_blocks: exec.num_blocks(),
            vocab: exec.vocab(),
            adapter: exec.describe(),
        });
        let stages = exec.health();
        let gpu_faults = exec.gpu_faults();
        let tokenizer = Arc::new(tokenizer);
        let mut core =
            EngineCore::new(exec, tokenizer.clone(), sched, cfg.enable_prefix_cache, metrics.clone(), kv_events);
        core.draft = draft;
        let (tx, rx) = std::sync::mpsc::channel();
        let m = metrics.clone();
        let thread = std::thread::Builder::new()
            .name("torus-engine".into())
            // Structured outputs compute their masks here: room for the deepest grammar that
            // passes `structured::bounds` (a stack overflow would abort the process).
            .stack_size(crate::structured::bounds::COMPILE_STACK_BYTES)
            .spawn(move || {
                // However the loop ends, the engine is down from then on (/health 503). A panic
                // drops the core, and with it every request's channel: their streams end.
                let why = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || core.run(rx))) {
                    Ok(()) => "the engine has stopped".to_string(),
                    Err(p) => {
                        let why = format!("the engine thread panicked: {}", panic_message(&*p));
                        tracing::error!("{why}");
                        why
                    }
                };
                m.set_down(why);
            })
            .expect("spawn the engine thread");
        Ok(EngineHandle {
            tx,
            next_id: Arc::new(AtomicU64::new(1)),
            thread: Arc::new(Mutex::new(Some(thread))),
            metrics,
            tokenizer,
            info,
            stages,
            gpu_faults,
            grammars: Arc::new(OnceLock::new()),
            embedding_dim: Arc::new(OnceLock::new()),
        })
    }

    /// Test-only: the keys of the prefix cache's blocks, and how many KV-event batches the
    /// engine has handed to the publisher (every event up to that moment is in them). None when
    /// the engine has stopped.
    #[doc(hidden)]
    pub fn cached_blocks(&self) -> Option<(Vec<crate::kv::BlockKey>, u64)> {
        let (tx, rx) = std::sync::mpsc::channel();
        self.tx.send(Command::CachedBlocks(tx)).ok()?;
        rx.recv().ok()
    }

    /// Every sequence's state, running first then waiting (`GET /slots`); answered between
    /// steps. Err when the engine has stopped.
    pub async fn slots(&self) -> Result<Vec<super::slots::SlotState>, String> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.tx.send(Command::Slots(tx)).map_err(|_| "the engine has stopped".to_string())?;
        rx.await.map_err(|_| "the engine has stopped".to_string())
    }

    /// Turns embeddings on (`--task embed`): from now on every step hands back its hidden
    /// states, and requests with `pooling` are served. Returns the embedding size, or why this
    /// engine cannot (a pipeline).
    pub fn enable_embeddings(&self) -> Result<usize, String> {
        if let Some(&d) = self.embedding_dim.get() {
            return Ok(d);
        }
        let (tx, rx) = std::sync::mpsc::channel();
        self.tx.send(Command::EnableEmbeddings(tx)).map_err(|_| "the engine has stopped".to_string())?;
        let d = rx.recv().map_err(|_| "the engine has stopped".to_string())??;
        Ok(*self.embedding_dim.get_or_init(|| d))
    }

    /// The embedding size while embeddings are on.
    pub fn embedding_dim(&self) -> Option<usize> {
        self.embedding_dim.get().copied()
    }

    /// The grammar compiler of structured outputs (built on first use from the tokenizer's
    /// vocabulary; blocking, tens of milliseconds), or why this tokenizer cannot have one.
    pub fn grammars(&self) -> Result<Arc<Grammars>, String> {
        self.grammars.get_or_init(|| Grammars::new(&self.tokenizer).map(Arc::new).map_err(|e| format!("{e:#}"))).clone()
    }

    /// Ok while the engine serves; otherwise why not (its thread stopped or panicked, or its
    /// device was lost).
    pub fn health(&self) -> Result<(), String> {
        if let Some(why) = self.metrics.down() {
            return Err(why);
        }
        match self.gpu_faults.as_ref().and_then(|f| f.lost()) {
            Some(why) => Err(format!("the GPU device was lost: {why}")),
            None => Ok(()),
        }
    }

    /// Test-only: arms a fault in the engine (see `exec::Fault`).
    #[doc(hidden)]
    pub fn inject_fault(&self, f: Fault) {
        let _ = self.tx.send(Command::Fault(f));
    }

    /// Checks a request against the engine's limits; the error says what is wrong.
    pub fn validate(&self, req: &Request) -> Result<(), String> {
        self.validate_parts(&req.prompt, &req.params)
    }

    /// `validate` on a prompt and parameters that are not (yet) one request.
    pub fn validate_parts(&self, prompt: &[u32], params: &RequestParams) -> Result<(), String> {
        let n = prompt.len();
        let info = &self.info;
        if n == 0 {
            return Err("the prompt is empty".into());
        }
        if n >= info.max_seq_len {
            return Err(format!(
                "the prompt has {n} tokens, but max_sequence_length is {} (prompt plus at least one generated token must fit)",
                info.max_seq_len
            ));
        }
        let max_tokens = params.stop.max_tokens.unwrap_or(info.max_seq_len - n);
        if n + max_tokens > info.max_seq_len {
            return Err(format!(
                "the prompt ({n} tokens) plus max_tokens ({max_tokens}) exceeds max_sequence_length {}",
                info.max_seq_len
            ));
        }
        let need = (n + max_tokens).div_ceil(info.block_size).min(info.max_blocks_per_seq.unwrap_or(usize::MAX));
        if need > info.num_blocks {
            return Err(format!("the request needs {need} KV blocks, the cache has {}", info.num_blocks));
        }
        if params.pooling.is_some() && self.embedding_dim().is_none() {
            return Err("this server does not serve embeddings: start it with `--task embed`".into());
        }
        if let Some(&t) = prompt.iter().find(|&&t| t as usize >= info.vocab) {
            return Err(format!("token id {t} is outside the vocabulary ({})", info.vocab));
        }
        if let Some(&(t, _)) = params.logit_bias.iter().find(|(t, _)| *t as usize >= info.vocab) {
            return Err(format!("logit_bias token id {t} is outside the vocabulary ({})", info.vocab));
        }
        if params.logit_bias.len() > crate::sampling::MAX_LOGIT_BIAS {
            return Err(format!("at most {} logit_bias entries are allowed", crate::sampling::MAX_LOGIT_BIAS));
        }
        if params.logprobs.max(params.prompt_logprobs).unwrap_or(0) as usize > MAX_TOP_LOGPROBS {
            return Err(format!("at most {MAX_TOP_LOGPROBS} top logprobs can be returned"));
        }
        let s = &params.sampling;
        if !(s.temperature >= 0.0 && s.temperature.is_finite()) {
            return Err("temperature must be >= 0".into());
        }
        if !(s.top_p > 0.0 && s.top_p <= 1.0) {
            return Err("top_p must be in (0, 1]".into());
        }
        if !(s.min_p >= 0.0 && s.min_p <= 1.0) {
            return Err("min_p must be in [0, 1]".into());
        }
        if !(params.repetition_penalty > 0.0 && params.repetition_penalty.is_finite()) {
            return Err("repetition_penalty must be > 0".into());
        }
        Ok(())
    }

    /// Validates and queues a request; nothing is allocated for a rejected one.
    pub fn submit(&self, req: Request) -> Result<RequestStream, String> {
        self.validate(&req)?;
        let id = self.next_id.fetch_add(1, Relaxed);
        let (out, rx) = unbounded_channel();
        self.tx
            .send(Command::Submit { id, req: Box::new(req), out })
            .map_err(|_| "the engine has stopped".to_string())?;
        Ok(RequestStream { id, rx, tx: self.tx.clone(), finished: false })
    }

    /// Stops the engine thread: with `drain`, after finishing in-flight requests; otherwise
    /// aborting them. Waits for the thread to exit.
    pub fn shutdown(&self, drain: bool) {
        let _ = self.tx.send(Command::Shutdown { drain });
        if let Some(t) = self.thread.lock().ok().and_then(|mut g| g.take()) {
            let _ = t.join();
        }
    }
}
