//! Mixture-of-experts models end to end: the tiny Qwen3-MoE of scripts/fixtures/gen_tiny_moe.py
//! (a dense layer between two sparse ones) from its Hugging Face directory and its GGUF
//! conversion, against transformers' float32 logits and greedy tokens, in both kernel profiles
//! and split over 2 pipeline stages; and the engine's properties on it: a prompt alone and
//! inside a busy batch gives the same greedy tokens, prefix cache on == off, preemption.

mod common;

use common::{assert_greedy_matches, floats, greedy_req, ids, logits_steps, F32_MARGIN};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use torus_wgpu::config::{EngineConfig, KernelProfile, KvDtype, StageConfig};
use torus_wgpu::engine::{generate, load_model, EngineHandle, Request};
use torus_wgpu::exec as pipeline;
use torus_wgpu::gpu::Gpu;
use torus_wgpu::model::config::Arch;
use torus_wgpu::model::loader::read_config;
use torus_wgpu::model::StepInput;
use torus_wgpu::sampling::{SampleParams, SamplingParams};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn reference() -> Value {
    let p = fixture("tiny-qwen3moe-reference.json");
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

fn cfg(profile: KernelProfile) -> EngineConfig {
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

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max)
}

fn last_logits(p: &Value) -> Vec<f32> {
    floats(&p["last_position_logits_full"])
}

#[test]
fn qwen3_moe_config_from_hf_and_gguf() {
    for f in ["tiny-qwen3moe", "tiny-qwen3moe.gguf"] {
        let c = read_config(&fixture(f)).unwrap();
        assert_eq!(c.arch, Arch::Qwen3Moe, "{f}");
        assert!(c.qk_norm, "{f}");
        let m = c.moe.as_ref().unwrap();
        assert_eq!((m.experts, m.top_k, m.ffn, m.norm_topk), (8, 2, 32, true), "{f}");
        assert_eq!(m.sparse_layers, [true, false, true], "{f}");
        assert_eq!(c.act_width(), 128, "{f}");
    }
    // The GGUF holds what the reference says it holds.
    let r = reference();
    let len = std::fs::metadata(fixture("tiny-qwen3moe.gguf")).unwrap().len();
    assert_eq!(len, r["gguf"]["size"].as_u64().unwrap());
}

/// Every prompt's last-position logits within 1e-3 of transformers and its 20 greedy tokens, from
/// the HF directory and the GGUF, in both kernel profiles.
#[test]
fn qwen3_moe_matches_transformers() {
    let r = reference();
    for f in ["tiny-qwen3moe", "tiny-qwen3moe.gguf"] {
        for profile in [KernelProfile::Cpu, KernelProfile::Gpu] {
            let gpu = Arc::new(Gpu::new(None).expect("a wgpu adapter (lavapipe in CI)"));
            let (mut model, tok) = load_model(&fixture(f), &cfg(profile), gpu, &|_, _| {}).unwrap();
            for p in r["prompts"].as_array().unwrap() {
                let what = format!("{f} {profile:?} {}", p["name"].as_str().unwrap());
                let input = ids(&p["input_ids"]);
                assert_eq!(tok.encode(p["text"].as_str().unwrap()).unwrap(), input, "{what}: tokenization");
                let got = logits_steps(&mut model, &input, &[]).remove(0);
                let d = max_diff(&got, &last_logits(p));
                assert!(d < 1e-3, "{what}: last-position logits differ by {d}");
                let want = ids(&p["greedy_ids"]);
                let out = generate(&mut model, &input, want.len(), &SamplingParams::default(), |_, _| true)
                    .unwrap()
                    .generated;
                assert_greedy_matches(&out, &want, &floats(&p["argmax_margins"]), F32_MARGIN, &what);
            }
        }
    }
}

/// Two in-process pipeline stages (a sparse layer, then the dense and the other sparse one): the
/// last-position logits of every prompt within 1e-3 of transformers.
#[test]
fn qwen3_moe_in_two_pipeline_stages() {
    let r = reference();
    let path = fixture("tiny-qwen3moe.gguf");
    let stages = [(0, 1), (1, 3)].map(|(a, b)| StageConfig {
        stage_start_layer: Some(a),
        stage_end_layer: Some(b),
        ..Default::default()
    });
    let c = EngineConfig {
        model: Some(path.display().to_string()),
        enable_pipeline_parallel: true,
        world_size: 2,
        stages: stages.to_vec(),
        ..cfg(KernelProfile::Cpu)
    };
    let mut p = pipeline::build(&c, &path, &|_, _| {}, &|_| {}).unwrap();
    assert_eq!(p.depth(), 2);
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
        };
        let out = p.step(s, true).unwrap();
        let d = max_diff(&out.logits.unwrap(), &last_logits(pr));
        assert!(d < 1e-3, "{}: last-position logits differ by {d} ({})", pr["name"], p.describe());
        assert_eq!(out.sampled[0].id, ids(&pr["greedy_ids"])[0]);
    }
}

fn engine(f: impl FnOnce(&mut EngineConfig)) -> EngineHandle {
    let gpu = Arc::new(Gpu::new(None).expect("a wgpu adapter"));
    let mut c = EngineConfig { kv_cache_dtype: KvDtype::F16, max_decode_batch_size: 16, ..cfg(KernelProfile::Cpu) };
    f(&mut c);
    let (model, tok) = load_model(&fixture("tiny-qwen3moe"), &c, gpu, &|_, _| {}).unwrap();
    EngineHandle::start(model, tok, &c)
}

/// Prompts of 1..60 tokens from a fixed generator, all starting with a shared 40-token prefix.
fn requests(n: usize, new: usize) -> Vec<Request> {
    let mut rng = torus_wgpu::sampling::Rng::new(5);
    let system: Vec<u32> = (0..40).map(|i| (i * 7 % 500) as u32).collect();
    (0..n)
        .map(|i| {
            let own: Vec<u32> = (0..1 + (i * 13) % 20).map(|_| (rng.next_u64() % 500) as u32).collect();
            greedy_req(&[system.clone(), own].concat(), new)
        })
        .collect()
}

fn run_alone(e: &EngineHandle, reqs: &[Request]) -> Vec<Vec<u32>> {
    reqs.iter().map(|r| e.submit(r.clone()).unwrap().collect_blocking().ids).collect()
}

fn run_together(e: &EngineHandle, reqs: &[Request]) -> Vec<Vec<u32>> {
    let streams: Vec<_> = reqs.iter().map(|r| e.submit(r.clone()).unwrap()).collect();
    streams.into_iter().map(|s| s.collect_blocking().ids).collect()
}

/// Batching invariance and prefix cache on == off: the experts a token is routed to do not
/// depend on the other tokens of its step.
#[test]
fn qwen3_moe_batched_equals_alone_and_prefix_cache_on_equals_off() {
    let reqs = requests(6, 12);
    let off = engine(|c| c.enable_prefix_cache = false);
    let alone = run_alone(&off, &reqs);
    assert_eq!(run_together(&off, &reqs), alone);
    let on = engine(|c| c.enable_prefix_cache = true);
    assert_eq!(run_alone(&on, &reqs), alone);
    let m = on.metrics.snapshot();
    assert!(m.prefix_hits > 0, "{m:?}");
    assert_eq!(run_together(&on, &reqs), alone);
}

#[test]
fn qwen3_moe_preemption() {
    // One 16-token block of K+V over 3 layers: 3 * 2 * 16 * 32 * 2 bytes (f16) = 6 KiB.
    let e = engine(|c| {
        c.total_cache_size = 12 * 6144;
        c.enable_prefix_cache = false;
    });
    assert_eq!(e.info.num_blocks, 12);
    let reqs = requests(6, 40);
    let alone = run_alone(&e, &reqs);
    assert_eq!(e.metrics.snapshot().preemptions, 0);
    let together = run_together(&e, &reqs);
    assert!(e.metrics.snapshot().preemptions > 0, "expected preemption: {:?}", e.metrics.snapshot());
    assert_eq!(together, alone);
}
