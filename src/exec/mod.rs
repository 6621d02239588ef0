//! What runs the engine's steps: the `Executor` trait and its implementations — one model on
//! this process's device (`inline`), a pipeline of stages on local devices and worker processes
//! (`stages`, `remote`), and, for tests only, fault injection as a wrapper (`faults`); building
//! the executor a config describes (`build`).
//!
//! Owns: executors, pipeline stages, worker processes (client, worker, auth, wire).
//! May use: model, gpu, config, sampling, shutdown.
//! Never uses: engine, server, tokenizer, kv, kv_events.
//!
//! An executor takes step inputs (`submit`) and hands back their results in submission order
//! (`recv`); up to `depth` steps may be in flight at once.

pub mod proto {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("torus.stage");
}
mod build;
pub mod faults;
mod inline;
pub mod remote;
mod stages;

pub use build::{build, check_ranges, configured_stages, split_layers, stage_ranges, step_limits};
pub use faults::{Fault, FaultInjector};
pub use inline::Inline;
pub use stages::{Pipeline, Stage, StageExec, StageHealth};

use crate::model::{Model, StepInput, StepLimits};
use crate::sampling::Sampled;
use anyhow::Result;
use std::sync::Arc;

/// Runs steps: one model, or a pipeline of stages.
pub trait Executor: Send {
    /// The step budget every submitted step keeps within.
    fn limits(&self) -> StepLimits;
    /// KV blocks per layer (the same ids on every stage).
    fn num_blocks(&self) -> usize;
    fn vocab(&self) -> usize;
    /// Recurrent-state slots (models with recurrent layers; 0: none): a running sequence holds
    /// one, so at most this many run at once.
    fn state_slots(&self) -> usize {
        0
    }
    /// One line for the start-up log: devices, kernel profile, memory.
    fn describe(&self) -> String;
    /// Steps that may be in flight at once (one per stage).
    fn depth(&self) -> usize {
        1
    }
    /// The stages' liveness, for /health (pipelines only).
    fn health(&self) -> Option<Arc<Vec<Arc<StageHealth>>>> {
        None
    }
    /// The device's fault record (single device; a pipeline reports through its stages'
    /// health), so /health sees a device lost while no step runs.
    fn gpu_faults(&self) -> Option<Arc<crate::gpu::GpuFaults>> {
        None
    }
    /// The device the whole model runs on (single device only): a draft model for speculative
    /// decoding is loaded there.
    fn device(&self) -> Option<Arc<crate::gpu::Gpu>> {
        None
    }
    /// Turns on (or off) handing back every token's hidden state after the last layer with each
    /// step's result (`StepOutput::hidden`; an MTP head reads them); false where the executor
    /// cannot (a pipeline).
    fn emit_hidden(&mut self, _on: bool) -> bool {
        false
    }
    /// The final norm (weights, epsilon) that turns an emitted residual into the last hidden
    /// state (embeddings pool it); None where the executor cannot emit (a pipeline).
    fn final_norm(&self) -> Option<(Vec<f32>, f32)> {
        None
    }
    /// The model's embedding and LM head on its device (single device only), for the MTP head
    /// to share instead of a copy of its own.
    fn shared_io(&self) -> Option<crate::model::SharedIo> {
        None
    }
    /// Queues a step; its result comes back from `recv`, in submission order.
    fn submit(&mut self, id: u64, input: StepInput);
    /// The oldest step's result (None when nothing is in flight).
    fn recv(&mut self) -> Option<StepResult>;
    /// Arms a test-only fault for the next step; only `FaultInjector` takes them.
    #[doc(hidden)]
    fn inject(&mut self, _f: Fault) {}
}

impl From<Model> for Box<dyn Executor> {
    fn from(model: Model) -> Box<dyn Executor> {
        Box::new(Inline::new(model))
    }
}

impl From<Pipeline> for Box<dyn Executor> {
    fn from(p: Pipeline) -> Box<dyn Executor> {
        Box::new(p)
    }
}

impl From<FaultInjector> for Box<dyn Executor> {
    fn from(f: FaultInjector) -> Box<dyn Executor> {
        Box::new(f)
    }
}

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

/// The last stage's output of one step, with the sampled rows' logits when asked for.
pub struct StepOutput {
    pub sampled: Vec<Sampled>,
    pub logits: Option<Vec<f32>>,
    /// Every token's residual after the last layer ([tokens, hidden]) while `emit_hidden` is on;
    /// else empty.
    pub hidden: Vec<f32>,
}

/// A finished step: its id and the last stage's output, or the first stage error.
pub struct StepResult {
    pub id: u64,
    pub result: Result<StepOutput>,
}

/// The text of a caught panic's payload.
pub fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default()
}
