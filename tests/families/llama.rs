//! Llama and Mistral (model/families/llama.rs): the tiny models of
//! scripts/fixtures/gen_tiny_models.py against transformers' float32 references: Llama 3's RoPE
//! scaling from the config and from llama.cpp's rope_freqs.weight (q/k rows permuted), Mistral's
//! sliding window.

use crate::common::tiny::{self, local, max_diff, reference};
use crate::common::{floats, ids, logits_steps};
use std::sync::Arc;
use torus_wgpu::config::KernelProfile;
use torus_wgpu::engine::load_model;
use torus_wgpu::gpu::Gpu;
use torus_wgpu::model::config::{Arch, RopeScaling};
use torus_wgpu::model::loader::read_config;

#[test]
fn llama3_rope_scaling_from_hf_config() {
    let cfg = read_config(&local("tiny-llama3")).unwrap();
    assert!(matches!(cfg.rope_scaling, RopeScaling::Llama3 { .. }), "{:?}", cfg.rope_scaling);
    // Our inverse frequencies are the ones transformers computed.
    let r = reference("tiny-llama3-reference.json");
    let (inv, attn) = cfg.rope_scaling.inv_freq(cfg.rope_theta, cfg.head_dim);
    let want: Vec<f64> = r["rope"]["inv_freq"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    assert_eq!(inv.len(), want.len());
    for (a, b) in inv.iter().zip(&want) {
        assert!((a - b).abs() <= 1e-6 * b.abs(), "inv_freq {a} vs {b}");
    }
    assert_eq!(attn, 1.0);
    tiny::assert_matches_reference("tiny-llama3", &r, KernelProfile::Cpu);
}

/// llama.cpp's form of the same model: q/k rows permuted, the scaling as rope_freqs.weight.
#[test]
fn llama3_rope_scaling_from_gguf_rope_freqs() {
    let cfg = read_config(&local("tiny-llama3.gguf")).unwrap();
    assert!(matches!(cfg.rope_scaling, RopeScaling::Freqs(_)), "{:?}", cfg.rope_scaling);
    let r = reference("tiny-llama3-reference.json");
    tiny::assert_matches_reference("tiny-llama3.gguf", &r, KernelProfile::Cpu);
    // Without the tensor the file runs unscaled RoPE (transformers' logits without scaling), which
    // is far from the scaled model's: the tensor is what makes the difference.
    let gpu = Arc::new(Gpu::new(None).expect("a wgpu adapter (lavapipe in CI)"));
    let (mut model, _) =
        load_model(&local("tiny-llama3-noscale.gguf"), &tiny::cfg(KernelProfile::Cpu), gpu, &|_, _| {}).unwrap();
    let plain = &r["prompts"][0];
    let got = logits_steps(&mut model, &ids(&plain["input_ids"]), &[]).remove(0);
    let noscale = floats(&r["gguf_noscale_last_logits_plain"]);
    assert!(max_diff(&got, &noscale) < 1e-3, "unscaled GGUF vs transformers without scaling");
    let scaled = floats(&plain["last_position_logits_full"]);
    assert!(max_diff(&got, &scaled) > 0.1, "the scaling must change the logits for this test to mean anything");
}

#[test]
fn mistral_sliding_window() {
    let cfg = read_config(&local("tiny-mistral")).unwrap();
    assert_eq!((cfg.arch, cfg.sliding_window), (Arch::Mistral, Some(8)));
    tiny::assert_matches_reference("tiny-mistral", &reference("tiny-mistral-reference.json"), KernelProfile::Cpu);
}
