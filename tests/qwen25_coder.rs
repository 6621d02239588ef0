//! A real K-quant model end to end: Qwen2.5-Coder-0.5B-Instruct Q4_K_M (tensor types Q5_0, Q8_0,
//! Q6_K, Q4_K, F32; q/k/v of mixed formats in some layers) against an independent float32
//! reference (numpy over the gguf package's dequantized weights, tokenized with the Hugging Face
//! `tokenizers` library): tests/fixtures/qwen2.5-coder-0.5b-reference.json, made by
//! scripts/fixtures/qwen25_reference.py. The model is fetched by scripts/setup.sh.

mod common;

use common::{floats, ids, logits_steps};
use serde_json::Value;
use std::sync::Arc;
use torus_wgpu::config::{EngineConfig, KernelProfile, KvDtype};
use torus_wgpu::engine::load_model;
use torus_wgpu::gpu::Gpu;
use torus_wgpu::model::Model;
use torus_wgpu::tokenizer::Tokenizer;

fn reference() -> Value {
    let p = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/qwen2.5-coder-0.5b-reference.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn load(kv: KvDtype, profile: KernelProfile) -> (Model, Tokenizer) {
    let gpu = Arc::new(Gpu::new(None).expect("a wgpu adapter (lavapipe in CI)"));
    let cfg = EngineConfig {
        max_num_batched_tokens: 512,
        max_sequence_length: 512,
        total_cache_size: 64 << 20,
        kv_cache_dtype: kv,
        kernel_profile: profile,
        ..Default::default()
    };
    load_model(&common::qwen25_coder(), &cfg, gpu, &|_, _| {}).unwrap()
}

/// The reference prompts a profile is checked on: all of them, or for the gpu profile (about 3x
/// slower than the cpu profile on lavapipe) those under 100 tokens and their first 6 steps
/// (prefill and 5 decode steps), so the suite stays quick.
fn prompts(reference: &Value, profile: KernelProfile) -> Vec<&Value> {
    let all = reference["prompts"].as_array().unwrap().iter();
    all.filter(|p| profile != KernelProfile::Gpu || p["input_ids"].as_array().unwrap().len() < 100).collect()
}

/// Per prompt: (name, input ids, reference greedy ids, per-step logits under teacher forcing).
fn run_prompts(kv: KvDtype, profile: KernelProfile) -> (Value, Vec<Vec<Vec<f32>>>) {
    let reference = reference();
    let (mut model, tok) = load(kv, profile);
    assert_eq!(model.limits.profile == KernelProfile::Gpu, profile == KernelProfile::Gpu);
    let mut all = Vec::new();
    for p in prompts(&reference, profile) {
        let name = p["name"].as_str().unwrap();
        let input = ids(&p["input_ids"]);
        // Our GGUF tokenizer (pre-tokenizer qwen2) against the reference's independent one.
        assert_eq!(tok.encode(p["text"].as_str().unwrap()).unwrap(), input, "{name}: tokenization");
        let greedy = ids(&p["greedy_ids"]);
        // The gpu profile: the prefill and the first 5 decode steps.
        let steps = if profile == KernelProfile::Gpu { 5 } else { greedy.len() - 1 };
        all.push(logits_steps(&mut model, &input, &greedy[..steps.min(greedy.len() - 1)]));
    }
    (reference, all)
}

/// With an f32 KV cache the only differences from the reference are f32 summation orders: the
/// reference's top-5 logits at every step agree within 1e-3.
#[test]
fn top5_logits_match_reference_with_f32_kv_cache() {
    top5_logits_match(KernelProfile::Auto);
}

/// The gpu kernel profile (forced on lavapipe) against the same reference.
#[test]
fn gpu_profile_top5_logits_match_reference() {
    top5_logits_match(KernelProfile::Gpu);
}

fn top5_logits_match(profile: KernelProfile) {
    let (reference, logits) = run_prompts(KvDtype::F32, profile);
    let mut worst = 0f32;
    let checked = prompts(&reference, profile);
    assert!(checked.len() >= 3, "{profile:?}: {} prompts checked", checked.len());
    for (p, steps) in checked.into_iter().zip(&logits) {
        let name = p["name"].as_str().unwrap();
        let top5 = p["top5"].as_array().unwrap();
        assert!(steps.len() >= 6 && steps.len() <= top5.len(), "{name}: {} steps", steps.len());
        for (s, (row, want)) in steps.iter().zip(top5).enumerate() {
            for (id, w) in ids(&want["ids"]).iter().zip(floats(&want["logits"])) {
                let got = row[*id as usize];
                worst = worst.max((got - w).abs());
                assert!((got - w).abs() < 1e-3, "{name} step {s} token {id}: logit {got}, reference {w}");
            }
        }
    }
    eprintln!("{profile:?}: max |logit - reference| over every step's top-5: {worst}");
}

/// With the default f16 KV cache, the greedy token of every step whose reference top-1/top-2
/// margin exceeds 0.1 is the reference's.
#[test]
fn greedy_tokens_match_reference_with_f16_kv_cache() {
    let (reference, logits) = run_prompts(KvDtype::F16, KernelProfile::Auto);
    let (mut compared, mut worst) = (0, 0f32);
    for (p, steps) in reference["prompts"].as_array().unwrap().iter().zip(&logits) {
        let name = p["name"].as_str().unwrap();
        let want = ids(&p["greedy_ids"]);
        let margins = floats(&p["argmax_margins"]);
        let top5 = p["top5"].as_array().unwrap();
        for (s, row) in steps.iter().enumerate() {
            for (id, w) in ids(&top5[s]["ids"]).iter().zip(floats(&top5[s]["logits"])) {
                worst = worst.max((row[*id as usize] - w).abs());
            }
            if margins[s] <= 0.1 {
                continue;
            }
            let argmax = (0..row.len()).fold(0, |b, i| if row[i] > row[b] { i } else { b });
            assert_eq!(argmax as u32, want[s], "{name} step {s}: greedy token (reference margin {})", margins[s]);
            compared += 1;
        }
    }
    eprintln!("{compared} greedy tokens compared; max |logit - reference| (f16 KV cache): {worst}");
    assert!(compared >= 50, "only {compared} steps had a margin above 0.1");
}
