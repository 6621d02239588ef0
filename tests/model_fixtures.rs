//! End-to-end model checks against the independent PyTorch reference outputs in
//! ../shared/fixtures (tiny-qwen2 in HF format, and the SmolLM2 Q4_1 GGUF).

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use torus_wgpu::config::EngineConfig;
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

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

fn load(path: &Path, max_tokens: usize) -> (Model, torus_wgpu::tokenizer::Tokenizer) {
    let gpu = Arc::new(Gpu::new(None).expect("a wgpu adapter (lavapipe in CI)"));
    let cfg = EngineConfig {
        max_num_batched_tokens: max_tokens,
        max_sequence_length: 512,
        total_cache_size: 64 << 20,
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
