//! The executor a config describes: layer ranges of the stages (explicit or split by adapter
//! memory), the step limits, and the pipeline built from local devices and workers.

use super::remote;
use super::stages::{LocalStage, Pipeline, Stage, StageHealth};
use crate::config::{EngineConfig, StageConfig};
use crate::gpu::Gpu;
use crate::model::config::ModelConfig;
use crate::model::loader::HostModel;
use crate::model::{kv_blocks, Model, StepLimits};
use anyhow::{anyhow, bail, Result};
use std::ops::Range;
use std::sync::Arc;

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

/// The step limits an engine config asks for (its step budget), on a model with `model`
/// hyper-parameters (which caps the sequence length and gives the sliding window).
pub fn step_limits(cfg: &EngineConfig, model: &ModelConfig) -> StepLimits {
    let b = cfg.step_budget();
    StepLimits {
        max_tokens: b.max_tokens,
        max_seqs: b.max_seqs,
        max_seq_len: b.max_seq_len.min(model.max_positions.max(1)),
        block_size: b.block_size,
        cache_bytes: b.cache_bytes,
        max_binding: 0,
        kv_dtype: b.kv_dtype,
        profile: b.profile,
        sliding_window: model.uniform_window(),
        int8: None,
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
        Some(span) => Some(HostModel::open(path, Some(span), progress)?),
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
    let mut p = Pipeline::new(built, limits, num_blocks, mcfg.vocab)?;
    // Every stage with recurrent layers holds a state slot per sequence of a step.
    p.state_slots = if mcfg.linear.is_some() { limits.max_seqs } else { 0 };
    Ok(p)
}
