//! End-to-end model checks against the independent PyTorch reference outputs in
//! ../shared/fixtures (tiny-qwen2 in HF format, and the SmolLM2 Q4_1 GGUF).

mod common;

use common::{floats, ids, logits_steps};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use torus_wgpu::config::{EngineConfig, KvDtype};
use torus_wgpu::engine::{generate, load_model};
use torus_wgpu::gpu::Gpu;
use torus_wgpu::model::forward::{Model, SampleParams, StepInput};
use torus_wgpu::sampling::SamplingParams;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures")
}

fn json(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join(name)).unwrap()).unwrap()
}

fn load(path: &Path, max_tokens: usize) -> (Model, torus_wgpu::tokenizer::Tokenizer) {
    let gpu = Arc::new(Gpu::new(None).expect("a wgpu adapter (lavapipe in CI)"));
    // An f32 KV cache: the references are float32 end to end (tests/qwen25_coder.rs checks the
    // default f16 cache against a reference).
    let cfg = EngineConfig {
        max_num_batched_tokens: max_tokens,
        max_sequence_length: 512,
        total_cache_size: 64 << 20,
        kv_cache_dtype: KvDtype::F32,
        ..Default::default()
    };
    load_model(path, &cfg, gpu, &|_, _| {}).unwrap()
}

/// Logits at the last prompt position: one prefill step that samples only that row.
fn last_logits(model: &mut Model, prompt: &[u32]) -> Vec<f32> {
    let n = prompt.len();
    let pos: Vec<u32> = (0..n as u32).collect();
    let blocks = n.div_ceil(model.limits.block_size) as u32;
    let step = StepInput {
        tokens: prompt.to_vec(),
        positions: pos.clone(),
        slots: pos,
        seq_of_token: vec![0; n],
        block_tables: vec![(0..blocks).collect()],
        sample_rows: vec![n as u32 - 1],
        sampling: vec![SampleParams::default()],
    };
    model.step(&step).unwrap();
    model.last_logits(1).unwrap()
}

fn greedy(model: &mut Model, prompt: &[u32], n: usize) -> Vec<u32> {
    generate(model, prompt, n, &SamplingParams::default(), |_, _| true).unwrap().generated
}

#[test]
fn tiny_qwen2_logits_and_greedy_match_reference() {
    let reference = json("tiny-qwen2-reference.json");
    let (mut model, tok) = load(&fixtures().join("tiny-qwen2"), 128);
    for p in reference["prompts"].as_array().unwrap() {
        let name = p["name"].as_str().unwrap();
        let input = ids(&p["input_ids"]);
        if let Some(text) = p["text"].as_str() {
            assert_eq!(tok.encode(text).unwrap(), input, "{name}: tokenization");
        }
        let want = floats(&p["last_position_logits_full"]);
        let got = last_logits(&mut model, &input);
        assert_eq!(got.len(), want.len());
        let max_diff = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(max_diff < 1e-3, "{name}: last-position logits differ by {max_diff}");
        let want_greedy = ids(&p["greedy_ids"]);
        assert_eq!(greedy(&mut model, &input, want_greedy.len()), want_greedy, "{name}: greedy tokens");
    }
}

/// The same prompt prefilled in chunks of 3 tokens (crossing KV blocks) gives the same tokens.
#[test]
fn tiny_qwen2_chunked_prefill_matches() {
    let reference = json("tiny-qwen2-reference.json");
    let (mut model, _) = load(&fixtures().join("tiny-qwen2"), 3);
    for p in reference["prompts"].as_array().unwrap() {
        let input = ids(&p["input_ids"]);
        let want = ids(&p["greedy_ids"]);
        assert_eq!(greedy(&mut model, &input, want.len()), want);
    }
}

fn smollm2_path() -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if p.exists() {
        Some(p)
    } else {
        eprintln!("SKIPPED: {} is missing (run scripts/fetch-model.sh)", p.display());
        None
    }
}

/// Absolute tolerance on SmolLM2 logits (reference: the same Q4_1/Q8_0 weights dequantized to
/// f32 in PyTorch). Greedy tokens are compared until the first step whose reference top-1/top-2
/// margin is below it.
const SMOLLM2_TOL: f32 = 1e-3;

#[test]
fn smollm2_logits_and_greedy_match_reference() {
    let Some(path) = smollm2_path() else { return };
    let reference = json("smollm2-reference.json");
    let (mut model, tok) = load(&path, 128);
    let mut worst = 0f32;
    for p in reference["prompts"].as_array().unwrap() {
        let name = p["name"].as_str().unwrap();
        let input = ids(&p["input_ids"]);
        assert_eq!(tok.encode(p["prompt_text"].as_str().unwrap()).unwrap(), input, "{name}: tokenization");
        let want_ids = ids(&p["greedy"]["generated_ids"]);
        let margins = floats(&p["greedy"]["argmax_margins"]);
        let steps = p["first_decode_steps_top5"].as_array().unwrap();
        let logits = logits_steps(&mut model, &input, &want_ids[..steps.len() - 1]);
        for (s, st) in steps.iter().enumerate() {
            let top_ids = ids(&st["top5_ids"]);
            let top_logits = floats(&st["top5_logits"]);
            for (id, want) in top_ids.iter().zip(&top_logits) {
                let got = logits[s][*id as usize];
                worst = worst.max((got - want).abs());
                assert!((got - want).abs() < SMOLLM2_TOL, "{name} step {s} id {id}: logit {got} vs {want}");
            }
        }
        let got_ids = greedy(&mut model, &input, want_ids.len());
        let trusted = margins.iter().position(|&m| m < SMOLLM2_TOL).unwrap_or(margins.len());
        assert_eq!(got_ids[..trusted], want_ids[..trusted], "{name}: greedy tokens (first {trusted} steps)");
        eprintln!("{name}: {trusted} greedy tokens compared");
    }
    eprintln!("max |logit diff| over the top-5 of the first 4 steps: {worst}");
    // The plain prompt's top-20 at its last position.
    let last = &reference["plain_prompt_last_position_logits"];
    let l = logits_steps(&mut model, &ids(&last["input_ids"]), &[]);
    for (id, want) in ids(&last["top20_ids"]).iter().zip(floats(&last["top20_logits"])) {
        assert!((l[0][*id as usize] - want).abs() < SMOLLM2_TOL, "top-20 id {id}");
    }
}
