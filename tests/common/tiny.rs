//! The tiny random models of tests/fixtures (scripts/fixtures/gen_tiny_*.py) against their
//! transformers references: last-position logits and greedy tokens of every prompt, in one model
//! or split over pipeline stages; and the engine properties every family must keep (batching
//! invariance, prefix cache on == off, preemption).

use super::{assert_greedy_matches, floats, greedy_req, ids, logits_steps, F32_MARGIN};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use torus_wgpu::config::{EngineConfig, KernelProfile, KvDtype, StageConfig};
use torus_wgpu::engine::{generate, load_model, EngineHandle, Request};
use torus_wgpu::exec as pipeline;
use torus_wgpu::gpu::Gpu;
use torus_wgpu::model::{Model, StepInput};
use torus_wgpu::sampling::{SampleParams, SamplingParams};

/// A file or directory of tests/fixtures.
pub fn local(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// A reference JSON of tests/fixtures.
pub fn reference(name: &str) -> Value {
    let p = local(name);
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).unwrap()
}

pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max)
}

/// The engine settings of these tests: an f32 KV cache (the references are f32), small budgets.
pub fn cfg(profile: KernelProfile) -> EngineConfig {
    EngineConfig {
        max_num_batched_tokens: 128,
        max_sequence_length: 160,
        total_cache_size: 8 << 20,
        kv_cache_dtype: KvDtype::F32,
        kernel_profile: profile,
        max_decode_batch_size: 8,
        max_prefill_batch_size: 4,
        ..Default::default()
    }
}

/// Every prompt of reference `r`: tokenization, last-position logits within 1e-3 and the greedy
/// tokens (margin-aware), from `file` under `profile`.
pub fn assert_matches_reference(file: &str, r: &Value, profile: KernelProfile) {
    assert_matches_reference_on(Gpu::new(None).expect("a wgpu adapter (lavapipe in CI)"), file, r, profile)
}

/// `assert_matches_reference` on `gpu` (a device with changed limits).
pub fn assert_matches_reference_on(gpu: Gpu, file: &str, r: &Value, profile: KernelProfile) {
    let gpu = Arc::new(gpu);
    let (mut model, tok) =
        load_model(&local(file), &cfg(profile), gpu, &|_, _| {}).unwrap_or_else(|e| panic!("{file} loads: {e:#}"));
    for p in r["prompts"].as_array().unwrap() {
        let what = format!("{file} {profile:?} {}", p["name"].as_str().unwrap());
        assert_eq!(tok.encode(p["text"].as_str().unwrap()).unwrap(), ids(&p["input_ids"]), "{what}: tokenization");
    }
    assert_model_matches(&mut model, r, &format!("{file} {profile:?}"), 1e-3, F32_MARGIN);
}

/// Every prompt of reference `r` on `model`: last-position logits within `logit_tol`, and the
/// greedy tokens up to the first step whose reference margin is under `margin`.
pub fn assert_model_matches(model: &mut Model, r: &Value, what: &str, logit_tol: f32, margin: f32) {
    for p in r["prompts"].as_array().unwrap() {
        let what = format!("{what} {}", p["name"].as_str().unwrap());
        let input = ids(&p["input_ids"]);
        let got = logits_steps(model, &input, &[]).remove(0);
        let d = max_diff(&got, &floats(&p["last_position_logits_full"]));
        assert!(d < logit_tol, "{what}: last-position logits differ by {d}");
        let want = ids(&p["greedy_ids"]);
        let out = generate(model, &input, want.len(), &SamplingParams::default(), |_, _| true).unwrap().generated;
        assert_greedy_matches(&out, &want, &floats(&p["argmax_margins"]), margin, &what);
    }
}

/// In-process pipeline stages over `ranges` of layers: every prompt's last-position logits
/// within 1e-3 of reference `r`, and its first greedy token.
pub fn assert_stages_match_reference(file: &str, r: &Value, ranges: &[(usize, usize)]) {
    let path = local(file);
    let stages: Vec<StageConfig> = ranges
        .iter()
        .map(|&(a, b)| StageConfig { stage_start_layer: Some(a), stage_end_layer: Some(b), ..Default::default() })
        .collect();
    let c = EngineConfig {
        model: Some(path.display().to_string()),
        enable_pipeline_parallel: true,
        world_size: ranges.len(),
        stages,
        ..cfg(KernelProfile::Cpu)
    };
    let mut p = pipeline::build(&c, &path, &|_, _| {}, &|_| {}).unwrap();
    assert_eq!(p.depth(), ranges.len());
    for pr in r["prompts"].as_array().unwrap() {
        let input = ids(&pr["input_ids"]);
        let n = input.len() as u32;
        let pos: Vec<u32> = (0..n).collect();
        let s = StepInput {
            tokens: input.clone(),
            positions: pos.clone(),
            slots: pos,
            seq_of_token: vec![0; n as usize],
            block_tables: vec![(0..10).collect()],
            sample_rows: vec![n - 1],
            sampling: vec![SampleParams::default()],
            state_slots: Vec::new(),
        };
        let out = p.step(s, true).unwrap();
        let d = max_diff(&out.logits.unwrap(), &floats(&pr["last_position_logits_full"]));
        assert!(d < 1e-3, "{file} {}: last-position logits differ by {d} ({})", pr["name"], p.describe());
        assert_eq!(out.sampled[0].id, ids(&pr["greedy_ids"])[0]);
    }
}

/// An engine on `file` (f16 KV cache, cpu profile), settings changed by `f`.
pub fn engine(file: &str, f: impl FnOnce(&mut EngineConfig)) -> EngineHandle {
    let gpu = Arc::new(Gpu::new(None).expect("a wgpu adapter"));
    let mut c = EngineConfig { kv_cache_dtype: KvDtype::F16, max_decode_batch_size: 16, ..cfg(KernelProfile::Cpu) };
    f(&mut c);
    let (model, tok) = load_model(&local(file), &c, gpu, &|_, _| {}).unwrap();
    EngineHandle::start(model, tok, &c)
}

/// `n` greedy requests for `new` tokens: prompts of 41..60 tokens from a fixed generator, all
/// starting with a shared 40-token prefix (ids below 500).
pub fn shared_prefix_requests(n: usize, new: usize) -> Vec<Request> {
    let mut rng = torus_wgpu::sampling::Rng::new(5);
    let system: Vec<u32> = (0..40).map(|i| (i * 7 % 500) as u32).collect();
    (0..n)
        .map(|i| {
            let own: Vec<u32> = (0..1 + (i * 13) % 20).map(|_| (rng.next_u64() % 500) as u32).collect();
            greedy_req(&[system.clone(), own].concat(), new)
        })
        .collect()
}

/// Each request on its own, one after another.
pub fn run_alone(e: &EngineHandle, reqs: &[Request]) -> Vec<Vec<u32>> {
    reqs.iter().map(|r| e.submit(r.clone()).unwrap().collect_blocking().ids).collect()
}

/// All requests at once.
pub fn run_together(e: &EngineHandle, reqs: &[Request]) -> Vec<Vec<u32>> {
    let streams: Vec<_> = reqs.iter().map(|r| e.submit(r.clone()).unwrap()).collect();
    streams.into_iter().map(|s| s.collect_blocking().ids).collect()
}

/// Batching invariance and prefix cache on == off on `file`.
pub fn assert_batched_equals_alone_and_prefix_cache_on_equals_off(file: &str) {
    let reqs = shared_prefix_requests(6, 12);
    let off = engine(file, |c| c.enable_prefix_cache = false);
    let alone = run_alone(&off, &reqs);
    assert_eq!(run_together(&off, &reqs), alone, "{file}: batched != alone");
    let on = engine(file, |c| c.enable_prefix_cache = true);
    assert_eq!(run_alone(&on, &reqs), alone, "{file}: prefix cache on != off");
    let m = on.metrics.snapshot();
    assert!(m.prefix_hits > 0, "{file}: {m:?}");
    assert_eq!(run_together(&on, &reqs), alone, "{file}: batched with the prefix cache != alone");
}

/// Preemption on `file` with a cache of `blocks` blocks of `block_bytes`: requests that must
/// preempt each other give the tokens they give alone.
pub fn assert_preemption_keeps_outputs(file: &str, blocks: usize, block_bytes: u64) {
    let e = engine(file, |c| {
        c.total_cache_size = blocks as u64 * block_bytes;
        c.enable_prefix_cache = false;
    });
    assert_eq!(e.info.num_blocks, blocks, "{file}: the cache holds the blocks the test sized");
    let reqs = shared_prefix_requests(6, 40);
    let alone = run_alone(&e, &reqs);
    assert_eq!(e.metrics.snapshot().preemptions, 0);
    let together = run_together(&e, &reqs);
    assert!(e.metrics.snapshot().preemptions > 0, "{file}: expected preemption: {:?}", e.metrics.snapshot());
    assert_eq!(together, alone, "{file}: preempted != alone");
}
