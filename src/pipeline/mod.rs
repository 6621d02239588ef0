//! Pipeline parallelism: the model's layers split into stages, each on its own wgpu device (in
//! this process) or in a `torus-wgpu worker` process reached over gRPC. Every stage holds its
//! layers' weights and KV cache; block tables are shared (the same block ids on every stage).
//! The first stage embeds tokens, the last applies the final norm, the LM head and the sampler;
//! hidden states cross between stages through host memory as raw f32 bytes.
//!
//! Each stage runs on its own thread, fed in order through a channel, so several steps are in
//! flight at once: while stage i computes step k, stage i+1 computes step k-1. The engine keeps
//! up to one step per stage in flight, each over different sequences (see engine::core).

pub mod proto {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("torus.stage");
}
pub mod remote;

use crate::config::{EngineConfig, StageConfig};
use crate::gpu::Gpu;
use crate::model::config::ModelConfig;
use crate::model::forward::{kv_blocks, Model, Sampled, StageOutput, StepInput, StepLimits};
use crate::model::loader::HostModel;
use anyhow::{anyhow, bail, Result};
use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};

/// A stage failed. Its KV cache may be gone (worker down), or is known to be new (`restarted`):
/// every sequence with KV on it must be failed or recomputed, and the prefix cache dropped.
#[derive(Debug)]
pub struct StageFailure {
    pub stage: usize,
    pub name: String,
    pub restarted: bool,
    pub message: String,
}

impl std::fmt::Display for StageFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pipeline stage {} ({}) failed: {}", self.stage, self.name, self.message)
    }
}

impl std::error::Error for StageFailure {}

/// Liveness of one stage, shared with the server's /health.
#[derive(Debug)]
pub struct StageHealth {
    pub stage: usize,
    pub name: String,
    /// host:port of a remote stage.
    pub address: Option<String>,
    /// How to reach the remote stage (its token and TLS settings).
    pub link: remote::Link,
    pub layers: Range<usize>,
    ok: AtomicBool,
    error: Mutex<String>,
}

impl StageHealth {
    pub fn new(stage: usize, name: String, address: Option<String>, layers: Range<usize>) -> StageHealth {
        StageHealth {
            stage,
            name,
            address,
            link: remote::Link::default(),
            layers,
            ok: AtomicBool::new(true),
            error: Mutex::new(String::new()),
        }
    }

    pub fn set(&self, r: std::result::Result<(), String>) {
        self.ok.store(r.is_ok(), Relaxed);
        if let Ok(mut e) = self.error.lock() {
            *e = r.err().unwrap_or_default();
        }
    }

    /// Ok, or the last error.
    pub fn get(&self) -> std::result::Result<(), String> {
        if self.ok.load(Relaxed) {
            Ok(())
        } else {
            Err(self.error.lock().map(|e| e.clone()).unwrap_or_default())
        }
    }
}

/// The last stage's output of one step, with the sampled rows' logits when asked for.
pub struct StepOutput {
    pub sampled: Vec<Sampled>,
    pub logits: Option<Vec<f32>>,
}

/// One stage, local or remote.
pub trait StageExec: Send {
    fn run(
        &mut self,
        s: &StepInput,
        hidden: Option<Vec<u8>>,
        want_logits: bool,
    ) -> Result<(StageOutput, Option<Vec<f32>>)>;
}

/// A stage with its health entry.
pub type Stage = (Box<dyn StageExec>, Arc<StageHealth>);

/// A stage on a device of this process (also what a worker process serves).
pub(crate) struct LocalStage(pub(crate) Model);

impl StageExec for LocalStage {
    fn run(
        &mut self,
        s: &StepInput,
        hidden: Option<Vec<u8>>,
        want_logits: bool,
    ) -> Result<(StageOutput, Option<Vec<f32>>)> {
        let out = self.0.run(s, hidden.as_deref())?;
        let logits = match (&out, want_logits) {
            (StageOutput::Sampled(r), true) => Some(self.0.last_logits(r.len())?),
            _ => None,
        };
        Ok((out, logits))
    }
}

struct Job {
    id: u64,
    input: Arc<StepInput>,
    hidden: Option<Vec<u8>>,
    want_logits: bool,
    /// Set once a stage fails; later stages pass the job on untouched.
    error: Option<anyhow::Error>,
}

/// A finished step: its id and the last stage's output, or the first stage error.
pub struct StepResult {
    pub id: u64,
    pub result: Result<StepOutput>,
}

/// Stages on their own threads, chained by channels.
pub struct Pipeline {
    tx: Option<Sender<Job>>,
    rx: Receiver<StepResult>,
    threads: Vec<std::thread::JoinHandle<()>>,
    pub health: Arc<Vec<Arc<StageHealth>>>,
    pub limits: StepLimits,
    pub num_blocks: usize,
    pub vocab: usize,
    /// Ids of the steps in flight, oldest first.
    in_flight: VecDeque<u64>,
}

impl Pipeline {
    /// Starts one thread per stage. `stages` are in layer order with their health entries.
    pub fn new(stages: Vec<Stage>, limits: StepLimits, num_blocks: usize, vocab: usize) -> Result<Pipeline> {
        if stages.is_empty() {
            bail!("a pipeline needs at least one stage");
        }
        let (out_tx, rx) = channel::<StepResult>();
        let (tx, mut next_rx) = channel::<Job>();
        let n = stages.len();
        let mut threads = Vec::new();
        let health: Vec<Arc<StageHealth>> = stages.iter().map(|(_, h)| h.clone()).collect();
        for (i, (mut stage, h)) in stages.into_iter().enumerate() {
            let job_rx = next_rx;
            let (fwd_tx, fwd_rx) = channel::<Job>();
            next_rx = fwd_rx;
            let out = out_tx.clone();
            let last = i + 1 == n;
            let t = std::thread::Builder::new().name(format!("torus-stage-{i}")).spawn(move || {
                for mut job in job_rx {
                    if job.error.is_none() {
                        let (input, hidden, want) = (&job.input, job.hidden.take(), job.want_logits && last);
                        // A panic in a stage (a driver or validation failure) fails this step
                        // like any other stage error instead of taking the pipeline down.
                        let r =
                            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| stage.run(input, hidden, want)))
                                .unwrap_or_else(|p| Err(anyhow!("the stage panicked: {}", panic_message(&*p))));
                        match r {
                            Ok((StageOutput::Hidden(hd), _)) if !last => job.hidden = Some(hd),
                            Ok((StageOutput::Sampled(sampled), logits)) if last => {
                                h.set(Ok(()));
                                let _ = out.send(StepResult { id: job.id, result: Ok(StepOutput { sampled, logits }) });
                                continue;
                            }
                            Ok(_) => job.error = Some(anyhow!("stage {i} returned the wrong kind of output")),
                            Err(e) => {
                                h.set(Err(format!("{e:#}")));
                                job.error = Some(match e.downcast::<StageFailure>() {
                                    Ok(f) => f.into(),
                                    Err(e) => {
                                        let message = format!("{e:#}");
                                        StageFailure { stage: i, name: h.name.clone(), restarted: false, message }
                                            .into()
                                    }
                                });
                            }
                        }
                        if job.error.is_none() {
                            h.set(Ok(()));
                        }
                    }
                    if last {
                        let e = job.error.unwrap_or_else(|| anyhow!("stage {i} produced no output"));
                        let _ = out.send(StepResult { id: job.id, result: Err(e) });
                    } else if let Err(std::sync::mpsc::SendError(job)) = fwd_tx.send(job) {
                        let e = job.error.unwrap_or_else(|| {
                            let message = "its thread has stopped".to_string();
                            StageFailure { stage: i + 1, name: "pipeline".into(), restarted: false, message }.into()
                        });
                        let _ = out.send(StepResult { id: job.id, result: Err(e) });
                    }
                }
            })?;
            threads.push(t);
        }
        drop(next_rx);
        Ok(Pipeline {
            tx: Some(tx),
            rx,
            threads,
            health: Arc::new(health),
            limits,
            num_blocks,
            vocab,
            in_flight: VecDeque::new(),
        })
    }
}

impl Pipeline {
    pub fn depth(&self) -> usize {
        self.health.len()
    }

    /// Queues a step; results come back from `recv` in submission order.
    pub fn submit(&mut self, id: u64, input: StepInput, want_logits: bool) {
        let job = Job { id, input: Arc::new(input), hidden: None, want_logits, error: None };
        self.in_flight.push_back(id);
        // A send to a stopped first stage is answered by recv.
        if let Some(tx) = &self.tx {
            let _ = tx.send(job);
        }
    }

    /// Waits for the oldest step in flight. Should every stage thread be gone, each step still
    /// in flight gets an error, so the engine never waits for a result that cannot come.
    pub fn recv(&mut self) -> Option<StepResult> {
        let id = self.in_flight.pop_front()?;
        Some(self.rx.recv().unwrap_or_else(|_| {
            StepResult {
                id,
                result: Err(StageFailure {
                    stage: 0,
                    name: "pipeline".into(),
                    restarted: false,
                    message: "the pipeline's stage threads have stopped".into(),
                }
                .into()),
            }
        }))
    }

    /// Runs one step through every stage and waits for it (tests and tools).
    pub fn step(&mut self, input: StepInput, want_logits: bool) -> Result<StepOutput> {
        while self.recv().is_some() {}
        self.submit(0, input, want_logits);
        self.recv().ok_or_else(|| anyhow!("the pipeline has stopped"))?.result
    }

    pub fn describe(&self) -> String {
        let parts: Vec<String> =
            self.health.iter().map(|h| format!("stage {} layers {:?}: {}", h.stage, h.layers, h.name)).collect();
        parts.join("; ")
    }
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        self.tx = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The text of a caught panic's payload.
pub fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default()
}

/// Test-only faults, injected through `EngineHandle::inject_fault` to exercise the paths that
/// real failures take (tests/faults.rs). The step faults apply to a single-device executor.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The next step panics inside the executor.
    StepPanic,
    /// The next step's GPU work raises a wgpu validation error (caught by its error scope).
    StepGpuError,
    /// The device is destroyed before the next step (the device-lost handler runs).
    DeviceLost,
    /// The next step's result comes back under the wrong step id.
    StepIdMismatch,
    /// The engine thread panics.
    EnginePanic,
}

/// What runs the engine's steps: one model on one device, or a pipeline of stages.
pub enum Executor {
    Single { model: Box<Model>, done: VecDeque<StepResult>, fault: Option<Fault> },
    Pipeline(Pipeline),
}

impl From<Model> for Executor {
    fn from(model: Model) -> Executor {
        Executor::Single { model: Box::new(model), done: VecDeque::new(), fault: None }
    }
}

impl From<Pipeline> for Executor {
    fn from(p: Pipeline) -> Executor {
        Executor::Pipeline(p)
    }
}

impl Executor {
    pub fn limits(&self) -> StepLimits {
        match self {
            Executor::Single { model, .. } => model.limits,
            Executor::Pipeline(p) => p.limits,
        }
    }

    pub fn num_blocks(&self) -> usize {
        match self {
            Executor::Single { model, .. } => model.kv.num_blocks,
            Executor::Pipeline(p) => p.num_blocks,
        }
    }

    pub fn vocab(&self) -> usize {
        match self {
            Executor::Single { model, .. } => model.cfg.vocab,
            Executor::Pipeline(p) => p.vocab,
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Executor::Single { model, .. } => format!(
                "{} (kernel profile {}; memory: {})",
                model.gpu.describe(),
                model.limits.profile.name(),
                model.plan
            ),
            Executor::Pipeline(p) => p.describe(),
        }
    }

    /// Steps that may be in flight at once (one per stage).
    pub fn depth(&self) -> usize {
        match self {
            Executor::Single { .. } => 1,
            Executor::Pipeline(p) => p.depth(),
        }
    }

    pub fn health(&self) -> Option<Arc<Vec<Arc<StageHealth>>>> {
        match self {
            Executor::Single { .. } => None,
            Executor::Pipeline(p) => Some(p.health.clone()),
        }
    }

    pub fn submit(&mut self, id: u64, input: StepInput) {
        match self {
            Executor::Single { model, done, fault } => {
                let fault = fault.take();
                // A panic in the step (a bug, a driver failure surfacing as one) fails this step's
                // requests; the engine goes on with the next.
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    match fault {
                        Some(Fault::StepPanic) => panic!("injected fault: a panic in the step"),
                        Some(Fault::StepGpuError) => model.provoke_gpu_error = true,
                        Some(Fault::DeviceLost) => model.gpu.device.destroy(),
                        _ => {}
                    }
                    model.step(&input)
                }))
                .unwrap_or_else(|p| Err(anyhow!("the step panicked: {}", panic_message(&*p))))
                .map(|sampled| StepOutput { sampled, logits: None });
                done.push_back(StepResult { id, result });
            }
            Executor::Pipeline(p) => p.submit(id, input, false),
        }
    }

    /// Arms a test-only step fault for the next step (single device only; ignored otherwise).
    #[doc(hidden)]
    pub fn inject(&mut self, f: Fault) {
        if let Executor::Single { fault, .. } = self {
            *fault = Some(f);
        }
    }

    /// The device's fault record (single device; a pipeline reports through its stages'
    /// health), so /health sees a device lost while no step runs.
    pub fn gpu_faults(&self) -> Option<Arc<crate::gpu::GpuFaults>> {
        match self {
            Executor::Single { model, .. } => Some(model.gpu.faults.clone()),
            Executor::Pipeline(_) => None,
        }
    }

    /// The oldest step's result (None when nothing is in flight).
    pub fn recv(&mut self) -> Option<StepResult> {
        match self {
            Executor::Single { done, .. } => done.pop_front(),
            Executor::Pipeline(p) => p.recv(),
        }
    }
}

/// Checks explicit layer ranges (end exclusive): contiguous, from 0, covering `total` layers.
pub fn check_ranges(ranges: &[Range<usize>], total: usize) -> Result<()> {
    let mut expect = 0;
    for (i, r) in ranges.iter().enumerate() {
        if r.start >= r.end {
            bail!("stage {i}: stage_start_layer {} must be below stage_end_layer {}", r.start, r.end);
        }
        if r.end > total {
            bail!("stage {i}: stage_end_layer {} is beyond the model's {total} layers", r.end);
        }
        if r.start > expect {
            let prev = if i == 0 {
                "the model starts at layer 0".to_string()
            } else {
                format!("stage {} ends at layer {expect}", i - 1)
            };
            bail!("gap: layers {expect}..{} belong to no stage ({prev}, stage {i} starts at {})", r.start, r.start);
        }
        if r.start < expect {
            bail!(
                "overlap: layers {}..{expect} are in both stage {} and stage {i} (stage {i} starts at {})",
                r.start,
                i - 1,
                r.start
            );
        }
        expect = r.end;
    }
    if expect != total {
        bail!("the stages end at layer {expect} but the model has {total} layers: layers {expect}..{total} belong to no stage");
    }
    Ok(())
}

/// Splits `total` layers into `weights.len()` contiguous stages in proportion to the weights
/// (adapter memory), evenly where any is unknown; every stage gets at least one layer.
pub fn split_layers(total: usize, weights: &[Option<u64>]) -> Result<Vec<Range<usize>>> {
    let n = weights.len();
    if n == 0 || n > total {
        bail!("cannot split {total} layers into {n} stages (each stage needs at least one layer)");
    }
    let w: Vec<f64> = if weights.iter().all(|w| w.is_some_and(|w| w > 0)) {
        weights.iter().map(|w| w.unwrap_or(1) as f64).collect()
    } else {
        vec![1.0; n]
    };
    let sum: f64 = w.iter().sum();
    let mut ranges = Vec::with_capacity(n);
    let (mut start, mut acc) = (0usize, 0f64);
    for (i, wi) in w.iter().enumerate() {
        acc += wi;
        // Leave at least one layer for each later stage, take at least one.
        let ideal = (acc / sum * total as f64).round() as usize;
        let end = if i + 1 == n { total } else { ideal.clamp(start + 1, total - (n - i - 1)) };
        ranges.push(start..end);
        start = end;
    }
    Ok(ranges)
}

/// The layer range of every stage the config names: explicit ranges (all or none), else a split.
pub fn stage_ranges(stages: &[StageConfig], total: usize) -> Result<Vec<Range<usize>>> {
    let given: Vec<Option<Range<usize>>> = stages
        .iter()
        .map(|s| match (s.stage_start_layer, s.stage_end_layer) {
            (Some(a), Some(b)) => Some(a..b),
            _ => None,
        })
        .collect();
    if given.iter().all(Option::is_some) {
        let ranges: Vec<Range<usize>> = given.into_iter().flatten().collect();
        check_ranges(&ranges, total)?;
        Ok(ranges)
    } else if given.iter().all(Option::is_none) {
        split_layers(total, &stages.iter().map(|s| s.memory_bytes).collect::<Vec<_>>())
    } else {
        bail!("give stage_start_layer/stage_end_layer for every stage or for none");
    }
}

/// The stages of a pipeline config: the `stages` list, or `world_size` stages on `adapter`.
pub fn configured_stages(cfg: &EngineConfig) -> Vec<StageConfig> {
    if cfg.stages.is_empty() {
        (0..cfg.world_size).map(|_| StageConfig { adapter: cfg.adapter.clone(), ..Default::default() }).collect()
    } else {
        cfg.stages.clone()
    }
}

/// The step limits an engine config asks for, on a model with `model` hyper-parameters.
pub fn step_limits(cfg: &EngineConfig, model: &ModelConfig) -> StepLimits {
    StepLimits {
        max_tokens: cfg.max_num_batched_tokens,
        max_seqs: (cfg.max_decode_batch_size + cfg.max_prefill_batch_size).min(cfg.max_num_batched_tokens).max(1),
        max_seq_len: cfg.max_sequence_length.min(model.max_positions.max(1)),
        block_size: cfg.block_size,
        cache_bytes: cfg.total_cache_size,
        max_binding: 0,
        kv_dtype: cfg.kv_cache_dtype,
        profile: cfg.kernel_profile,
        sliding_window: model.sliding_window,
    }
}

/// Builds the pipeline a config describes: local stages load their layers on their adapters
/// (each its own device, also when several share an adapter); remote stages are connected
/// lazily, so a worker that is down now is picked up once it answers.
pub fn build(
    cfg: &EngineConfig,
    path: &std::path::Path,
    progress: &dyn Fn(usize, usize),
    on_stage: &dyn Fn(&str),
) -> Result<Pipeline> {
    let mut stages = configured_stages(cfg);
    let mcfg = crate::model::loader::read_config(path)?;
    // Open every local stage's device first, so a wrong adapter fails before weights load, and
    // so the split can follow the adapters' memory.
    let mut gpus: Vec<Option<Arc<Gpu>>> = Vec::new();
    for (i, st) in stages.iter_mut().enumerate() {
        gpus.push(match st.address {
            Some(_) => None,
            None => {
                let gpu = Gpu::new(st.adapter.as_deref()).map_err(|e| anyhow!("stage {i}: {e:#}"))?;
                st.memory_bytes = st.memory_bytes.or(gpu.memory);
                Some(Arc::new(gpu))
            }
        });
    }
    let ranges = stage_ranges(&stages, mcfg.layers)?;
    let mut limits = step_limits(cfg, &mcfg);
    // Only the layers of the local stages are read from the file.
    let local = ranges.iter().zip(&stages).filter(|(_, s)| s.address.is_none()).map(|(r, _)| r);
    let span = local.clone().map(|r| r.start).min().zip(local.map(|r| r.end).max()).map(|(a, b)| a..b);
    let host = match span {
        Some(span) => Some(HostModel::load_layers(path, Some(span), progress)?),
        None => None,
    };
    let mut num_blocks = kv_blocks(&mcfg, &limits);
    let mut local: Vec<Option<Stage>> = Vec::new();
    for (i, (gpu, range)) in gpus.into_iter().zip(&ranges).enumerate() {
        let (Some(gpu), Some(host)) = (gpu, host.as_ref()) else {
            local.push(None);
            continue;
        };
        let name = gpu.describe();
        on_stage(&format!("stage {i}: layers {}..{} on {name}", range.start, range.end));
        let mut m = Model::new_stage(gpu, host, limits, range.clone()).map_err(|e| anyhow!("stage {i}: {e:#}"))?;
        m.warm_up()?;
        num_blocks = num_blocks.min(m.kv.num_blocks);
        limits.max_seqs = m.limits.max_seqs;
        local.push(Some((Box::new(LocalStage(m)), Arc::new(StageHealth::new(i, name, None, range.clone())))));
    }
    if num_blocks == 0 {
        bail!("total_cache_size {} holds no KV block; raise it", cfg.total_cache_size);
    }
    // The worker token and TLS settings, when any stage is a worker.
    let link = match stages.iter().any(|s| s.address.is_some()) {
        true => remote::Link::from_config(cfg)?,
        false => remote::Link::default(),
    };
    let mut built: Vec<Stage> = Vec::new();
    for (i, ((st, range), l)) in stages.iter().zip(&ranges).zip(local).enumerate() {
        if let Some(l) = l {
            built.push(l);
            continue;
        }
        let addr = st.address.clone().unwrap_or_default();
        on_stage(&format!("stage {i}: layers {}..{} on worker {addr}", range.start, range.end));
        let want = remote::Expect {
            stage: i,
            layers: range.clone(),
            total_layers: mcfg.layers,
            hidden: mcfg.hidden,
            vocab: mcfg.vocab,
            limits,
            num_blocks,
            timeout: std::time::Duration::from_secs_f64(cfg.stage_timeout_s),
        };
        let mut h = StageHealth::new(i, format!("worker {addr}"), Some(addr.clone()), range.clone());
        h.link = link.clone();
        built.push((Box::new(remote::RemoteStage::new(&addr, want, link.clone())?), Arc::new(h)));
    }
    Pipeline::new(built, limits, num_blocks, mcfg.vocab)
}
