//! Architectures beyond Llama/Qwen2 against float32 references from Hugging Face transformers
//! (tests/fixtures/tiny-*, made by scripts/fixtures/gen_tiny_models.py): Llama 3 rope scaling
//! (HF config and GGUF rope_freqs.weight), YaRN, Mistral's sliding window, Qwen3's q/k norms.

mod common;

use common::{floats, ids, logits_steps};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use torus_wgpu::config::{EngineConfig, KvDtype};
use torus_wgpu::engine::{generate, load_model};
use torus_wgpu::gpu::Gpu;
use torus_wgpu::model::config::{Arch, RopeScaling};
use torus_wgpu::model::loader::read_config;
use torus_wgpu::model::Model;
use torus_wgpu::sampling::SamplingParams;
use torus_wgpu::tokenizer::Tokenizer;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn reference(name: &str) -> Value {
    let p = dir().join(format!("{name}-reference.json"));
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).unwrap()
}

fn load(path: &Path) -> (Model, Tokenizer) {
    load_on(Gpu::new(None).expect("a wgpu adapter (lavapipe in CI)"), path)
}

fn load_on(gpu: Gpu, path: &Path) -> (Model, Tokenizer) {
    let gpu = Arc::new(gpu);
    let cfg = EngineConfig {
        max_num_batched_tokens: 128,
        max_sequence_length: 128,
        total_cache_size: 8 << 20,
        kv_cache_dtype: KvDtype::F32,
        ..Default::default()
    };
    load_model(path, &cfg, gpu, &|_, _| {}).unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max)
}

/// Every prompt: tokenization, all logits at the last prompt position within 1e-3, and the 20
/// greedy tokens (the smallest reference margin is above 0.03).
fn check_model(path: &Path, name: &str) {
    check_model_on(Gpu::new(None).expect("a wgpu adapter (lavapipe in CI)"), path, name)
}

fn check_model_on(gpu: Gpu, path: &Path, name: &str) {
    let r = reference(name);
    let (mut model, tok) = load_on(gpu, path);
    for p in r["prompts"].as_array().unwrap() {
        let what = format!("{} {}", path.display(), p["name"].as_str().unwrap());
        let input = ids(&p["input_ids"]);
        assert_eq!(tok.encode(p["text"].as_str().unwrap()).unwrap(), input, "{what}: tokenization");
        let want: Vec<f32> =
            p["last_position_logits_full"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
        let got = logits_steps(&mut model, &input, &[]).remove(0);
        let d = max_diff(&got, &want);
        assert!(d < 1e-3, "{what}: last-position logits differ by {d}");
        let greedy = ids(&p["greedy_ids"]);
        let out =
            generate(&mut model, &input, greedy.len(), &SamplingParams::default(), |_, _| true).unwrap().generated;
        common::assert_greedy_matches(&out, &greedy, &floats(&p["argmax_margins"]), common::F32_MARGIN, &what);
    }
}

#[test]
fn llama3_rope_scaling_from_hf_config() {
    let cfg = read_config(&dir().join("tiny-llama3")).unwrap();
    assert!(matches!(cfg.rope_scaling, RopeScaling::Llama3 { .. }), "{:?}", cfg.rope_scaling);
    // Our inverse frequencies are the ones transformers computed.
    let r = reference("tiny-llama3");
    let (inv, attn) = cfg.rope_scaling.inv_freq(cfg.rope_theta, cfg.head_dim);
    let want: Vec<f64> = r["rope"]["inv_freq"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    assert_eq!(inv.len(), want.len());
    for (a, b) in inv.iter().zip(&want) {
        assert!((a - b).abs() <= 1e-6 * b.abs(), "inv_freq {a} vs {b}");
    }
    assert_eq!(attn, 1.0);
    check_model(&dir().join("tiny-llama3"), "tiny-llama3");
}

/// llama.cpp's form of the same model: q/k rows permuted, the scaling as rope_freqs.weight.
#[test]
fn llama3_rope_scaling_from_gguf_rope_freqs() {
    let cfg = read_config(&dir().join("tiny-llama3.gguf")).unwrap();
    assert!(matches!(cfg.rope_scaling, RopeScaling::Freqs(_)), "{:?}", cfg.rope_scaling);
    check_model(&dir().join("tiny-llama3.gguf"), "tiny-llama3");
    // Without the tensor the file runs unscaled RoPE (transformers' logits without scaling), which
    // is far from the scaled model's: the tensor is what makes the difference.
    let r = reference("tiny-llama3");
    let (mut model, _) = load(&dir().join("tiny-llama3-noscale.gguf"));
    let plain = &r["prompts"][0];
    let got = logits_steps(&mut model, &ids(&plain["input_ids"]), &[]).remove(0);
    let noscale: Vec<f32> =
        r["gguf_noscale_last_logits_plain"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
    assert!(max_diff(&got, &noscale) < 1e-3, "unscaled GGUF vs transformers without scaling");
    let scaled: Vec<f32> =
        plain["last_position_logits_full"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
    assert!(max_diff(&got, &scaled) > 0.1, "the scaling must change the logits for this test to mean anything");
}

#[test]
fn yarn_rope_scaling() {
    let cfg = read_config(&dir().join("tiny-yarn")).unwrap();
    let RopeScaling::Yarn { attention_factor, .. } = cfg.rope_scaling else { panic!("{:?}", cfg.rope_scaling) };
    let r = reference("tiny-yarn");
    let want = r["rope"]["attention_scaling"].as_f64().unwrap();
    assert!((attention_factor - want).abs() < 1e-6, "attention factor {attention_factor} vs {want}");
    check_model(&dir().join("tiny-yarn"), "tiny-yarn");
}

#[test]
fn mistral_sliding_window() {
    let cfg = read_config(&dir().join("tiny-mistral")).unwrap();
    assert_eq!((cfg.arch, cfg.sliding_window), (Arch::Mistral, Some(8)));
    check_model(&dir().join("tiny-mistral"), "tiny-mistral");
}

#[test]
fn qwen3_qk_norm() {
    let cfg = read_config(&dir().join("tiny-qwen3")).unwrap();
    assert!(cfg.qk_norm && cfg.arch == Arch::Qwen3 && cfg.head_dim * cfg.heads != cfg.hidden);
    check_model(&dir().join("tiny-qwen3"), "tiny-qwen3");
    // llama.cpp's form (arch qwen3: attn_q_norm / attn_k_norm, rows not permuted, tied head).
    let g = read_config(&dir().join("tiny-qwen3.gguf")).unwrap();
    assert!(g.qk_norm && g.arch == Arch::Qwen3 && g.head_dim == cfg.head_dim);
    check_model(&dir().join("tiny-qwen3.gguf"), "tiny-qwen3");
    // Every 1-D grid (the head norm's included) folded into 2-D at 2 workgroups per dimension.
    let mut gpu = Gpu::new(None).unwrap();
    gpu.max_grid = 2;
    check_model_on(gpu, &dir().join("tiny-qwen3"), "tiny-qwen3");
}

/// Config errors name the file and the problem.
#[test]
fn unsupported_architecture_and_rope_scaling_are_refused() {
    let tmp = std::env::temp_dir().join(format!("torus-arch-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let base: Value =
        serde_json::from_str(&std::fs::read_to_string(dir().join("tiny-llama3/config.json")).unwrap()).unwrap();
    let write = |v: &Value| {
        std::fs::write(tmp.join("config.json"), serde_json::to_string(v).unwrap()).unwrap();
        read_config(&tmp).expect_err("must be refused").to_string()
    };
    let mut v = base.clone();
    v["architectures"] = serde_json::json!(["GPTNeoXForCausalLM"]);
    let err = write(&v);
    assert!(
        err.contains("config.json") && err.contains("GPTNeoXForCausalLM") && err.contains("Qwen3ForCausalLM"),
        "{err}"
    );
    let mut v = base.clone();
    v["rope_scaling"] = serde_json::json!({"rope_type": "longrope", "factor": 4.0});
    v.as_object_mut().unwrap().remove("rope_parameters");
    let err = write(&v);
    assert!(err.contains("longrope") && err.contains("llama3"), "{err}");
    std::fs::remove_dir_all(&tmp).ok();
}

/// Gemma 2 (transformers' Gemma2ForCausalLM): a windowed and a global layer, soft-capped scores
/// and logits, query_pre_attn_scalar, GeGLU, the extra norms with their 1 + w weights.
#[test]
fn gemma2_from_hf() {
    let cfg = read_config(&dir().join("tiny-gemma2")).unwrap();
    assert_eq!((cfg.arch, cfg.sliding_window, cfg.uniform_window()), (Arch::Gemma2, Some(8), None));
    assert_eq!(cfg.style.sliding_layers.as_deref(), Some(&[true, false][..]));
    assert_eq!((cfg.style.attn_softcap, cfg.style.final_softcap), (Some(2.0), Some(10.0)));
    check_model(&dir().join("tiny-gemma2"), "tiny-gemma2");
}

/// Gemma 3 (transformers' Gemma3ForCausalLM): windowed / global / windowed layers with their own
/// RoPE bases, q/k norms, query_pre_attn_scalar, GeGLU, the extra norms.
#[test]
fn gemma3_from_hf() {
    let cfg = read_config(&dir().join("tiny-gemma3")).unwrap();
    assert_eq!((cfg.arch, cfg.sliding_window, cfg.qk_norm), (Arch::Gemma3, Some(8), true));
    assert_eq!(cfg.style.sliding_layers.as_deref(), Some(&[true, false, true][..]));
    assert_eq!((cfg.rope_theta, cfg.style.local_rope_theta), (1e6, Some(1e4)));
    check_model(&dir().join("tiny-gemma3"), "tiny-gemma3");
}
