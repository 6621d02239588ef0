//! The serving engine: continuous batching over the paged KV cache. `request` (what a caller
//! submits and gets back), `sequence` (a request's state), `scheduler` (pure: sequences and the
//! block manager in, a step plan out), `runner` (the plan as step input), `output` (results
//! applied: stops, detokenization, prefix registration, window release, failures), `core` (the
//! loop), `handle` (the thread and its API), `metrics`, `speculate` (speculative decoding's
//! verification), `propose` (what the core asks of a proposer) with its two, `draft` (a draft
//! model) and `mtp` (the model's MTP head), and `embed` (the embedding head); the proposers and
//! heads see sequences and hidden states, never the core; plus `generate`, one sequence straight
//! on a `Model` (the `generate` command), and the model loaders the commands share.
//!
//! Owns: requests, sequences, the scheduler, the runner, output handling, the loop and its
//! handle, engine metrics.
//! May use: exec, model, kv, kv_events, spec, tokenizer, structured, gpu, config, sampling, formats.
//! Never uses: server, HTTP.

pub mod core;
mod draft;
pub mod embed;
pub mod handle;
pub mod metrics;
mod mtp;
mod output;
mod penalties;
mod propose;
pub mod request;
mod runner;
mod scheduler;
#[cfg(test)]
mod scheduler_tests;
#[cfg(test)]
mod scripted;
mod sequence;
pub mod slots;
mod speculate;
#[cfg(test)]
mod trace_tests;

pub use draft::load_draft;
pub use handle::{Completion, EngineHandle, RequestStream};
pub use propose::DraftModel;
pub use request::{Event, FinishReason, Pooling, PromptLogprob, Request, RequestParams, StopConditions, Usage};

use crate::exec::Executor;
use crate::model::{Model, StepInput};
use crate::sampling::SampleParams;
use crate::sampling::{Rng, SamplingParams};
use anyhow::Context;
use anyhow::{bail, Result};
use std::time::{Duration, Instant};

#[derive(Clone, Debug, Default)]
pub struct GenStats {
    pub prompt_tokens: usize,
    pub generated: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub prefill_time: Duration,
    pub decode_time: Duration,
}

impl GenStats {
    pub fn prefill_tps(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_time.as_secs_f64().max(1e-9)
    }
    /// Decode rate: tokens after the first (which prefill produced) over the decode time.
    pub fn decode_tps(&self) -> f64 {
        self.generated.len().saturating_sub(1) as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
}

/// Generates up to `max_new` tokens after `prompt`. `on_token(id, logprob)` sees each token as
/// it is produced and returns false to stop (e.g. on an end-of-sequence id).
pub fn generate(
    model: &mut Model,
    prompt: &[u32],
    max_new: usize,
    params: &SamplingParams,
    mut on_token: impl FnMut(u32, f32) -> bool,
) -> Result<GenStats> {
    let lim = model.limits;
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    if !(0.0..=1.0).contains(&params.min_p) {
        bail!("min_p must be in [0, 1]");
    }
    if prompt.len() + max_new > lim.max_seq_len {
        bail!(
            "prompt of {} tokens plus {max_new} new tokens exceeds max_sequence_length {}",
            prompt.len(),
            lim.max_seq_len
        );
    }
    let blocks_needed = (prompt.len() + max_new).div_ceil(lim.block_size);
    if blocks_needed > model.kv.num_blocks {
        bail!("the KV cache holds {} blocks, this request needs {blocks_needed}", model.kv.num_blocks);
    }
    // One sequence owns blocks 0.. in order, so a token's slot is its position.
    let table: Vec<u32> = (0..blocks_needed as u32).collect();
    let mut rng = params.seed.map(Rng::new).unwrap_or_else(Rng::from_entropy);
    let draw = |rng: &mut Rng| SampleParams {
        temperature: params.temperature,
        top_p: params.top_p,
        top_k: params.top_k,
        min_p: params.min_p,
        u: rng.uniform(),
        ..Default::default()
    };
    let mut stats = GenStats { prompt_tokens: prompt.len(), ..Default::default() };
    if max_new == 0 {
        return Ok(stats);
    }

    let t0 = Instant::now();
    let mut last = (0u32, 0f32);
    for c0 in (0..prompt.len()).step_by(lim.max_tokens) {
        let c1 = (c0 + lim.max_tokens).min(prompt.len());
        let n = c1 - c0;
        let is_last = c1 == prompt.len();
        let pos: Vec<u32> = (c0 as u32..c1 as u32).collect();
        let step = StepInput {
            tokens: prompt[c0..c1].to_vec(),
            positions: pos.clone(),
            slots: pos,
            seq_of_token: vec![0; n],
            block_tables: vec![table.clone()],
            sample_rows: if is_last { vec![n as u32 - 1] } else { vec![] },
            sampling: if is_last { vec![draw(&mut rng)] } else { vec![] },
            state_slots: Vec::new(),
        };
        if let Some(r) = model.step(&step)?.first() {
            last = (r.id, r.logprob);
        }
    }
    stats.prefill_time = t0.elapsed();
    let t1 = Instant::now();
    let mut pos = prompt.len() as u32;
    loop {
        stats.generated.push(last.0);
        stats.logprobs.push(last.1);
        if !on_token(last.0, last.1) || stats.generated.len() >= max_new {
            break;
        }
        let step = StepInput {
            tokens: vec![last.0],
            positions: vec![pos],
            slots: vec![pos],
            seq_of_token: vec![0],
            block_tables: vec![table.clone()],
            sample_rows: vec![0],
            sampling: vec![draw(&mut rng)],
            state_slots: Vec::new(),
        };
        let r = &model.step(&step)?[0];
        last = (r.id, r.logprob);
        pos += 1;
    }
    stats.decode_time = t1.elapsed();
    Ok(stats)
}

/// Loads weights and tokenizer from `path` (Hugging Face directory or .gguf file) onto `gpu`,
/// sized by `cfg`. `progress(done, total)` is called as layers load.
pub fn load_model(
    path: &std::path::Path,
    cfg: &crate::config::EngineConfig,
    gpu: std::sync::Arc<crate::gpu::Gpu>,
    progress: &dyn Fn(usize, usize),
) -> Result<(Model, crate::tokenizer::Tokenizer)> {
    use crate::model::loader::HostModel;
    let host = HostModel::open(path, None, progress)?;
    let tok = load_tokenizer(path)?;
    let limits = crate::exec::step_limits(cfg, &host.cfg);
    let mut model = Model::new(gpu, &host, limits)?;
    model.warm_up()?;
    Ok((model, tok))
}

/// The tokenizer of the model at `path` (Hugging Face directory or .gguf file).
pub fn load_tokenizer(path: &std::path::Path) -> Result<crate::tokenizer::Tokenizer> {
    crate::tokenizer::Tokenizer::from_path(path)
}

/// Loads the model the config names (or the default model) with a progress bar on stderr:
/// on the adapter it names, or, with enable_pipeline_parallel, as a pipeline of stages (local
/// adapters and/or remote workers). Prints where each part runs.
pub fn load_configured(cfg: &crate::config::EngineConfig) -> Result<(Box<dyn Executor>, crate::tokenizer::Tokenizer)> {
    if cfg.enable_pipeline_parallel {
        let path = model_path(cfg)?;
        let pb = progress_bar(&path);
        let p = crate::exec::build(cfg, &path, &progress_fn(&pb), &|line| pb.println(line))
            .with_context(|| format!("loading {} as a pipeline", path.display()))?;
        pb.finish_and_clear();
        Ok((p.into(), load_tokenizer(&path)?))
    } else {
        let (m, t) = load_configured_model(cfg)?;
        Ok((m.into(), t))
    }
}

/// Loads the model the config names on one device (the adapter it names), with a progress bar.
pub fn load_configured_model(cfg: &crate::config::EngineConfig) -> Result<(Model, crate::tokenizer::Tokenizer)> {
    let path = model_path(cfg)?;
    let pb = progress_bar(&path);
    let gpu = std::sync::Arc::new(crate::gpu::Gpu::new(cfg.adapter.as_deref())?);
    eprintln!("adapter: {}", gpu.describe());
    let r = load_model(&path, cfg, gpu, &progress_fn(&pb)).with_context(|| format!("loading {}", path.display()))?;
    pb.finish_and_clear();
    Ok(r)
}

fn model_path(cfg: &crate::config::EngineConfig) -> Result<std::path::PathBuf> {
    let path = cfg.model_path();
    if !path.exists() {
        bail!(
            "{}: model not found (run scripts/fetch-model.sh for the default model, or pass --model)",
            path.display()
        );
    }
    Ok(path)
}

fn progress_bar(path: &std::path::Path) -> indicatif::ProgressBar {
    let pb = indicatif::ProgressBar::new(1);
    pb.set_style(
        indicatif::ProgressStyle::with_template("loading {msg} [{bar:30}] {pos}/{len} layers")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb.set_message(path.display().to_string());
    pb
}

fn progress_fn(pb: &indicatif::ProgressBar) -> impl Fn(usize, usize) + '_ {
    |done: usize, total: usize| {
        pb.set_length(total as u64);
        pb.set_position(done as u64);
    }
}
