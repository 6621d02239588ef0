//! Gemma 2 and Gemma 3 (model/families/gemma.rs): the tiny models of
//! scripts/fixtures/gen_tiny_gemma.py against transformers' float32 references (the 270M model
//! against its own reference is gemma3_270m.rs).

use crate::common::tiny::{self, local, reference};
use torus_wgpu::config::KernelProfile;
use torus_wgpu::model::config::Arch;
use torus_wgpu::model::loader::read_config;

/// Gemma 2 (transformers' Gemma2ForCausalLM): a windowed and a global layer, soft-capped scores
/// and logits, query_pre_attn_scalar, GeGLU, the extra norms with their 1 + w weights.
#[test]
fn gemma2_from_hf() {
    let cfg = read_config(&local("tiny-gemma2")).unwrap();
    assert_eq!((cfg.arch, cfg.sliding_window, cfg.uniform_window()), (Arch::Gemma2, Some(8), None));
    assert_eq!(cfg.style.sliding_layers.as_deref(), Some(&[true, false][..]));
    assert_eq!((cfg.style.attn_softcap, cfg.style.final_softcap), (Some(2.0), Some(10.0)));
    tiny::assert_matches_reference("tiny-gemma2", &reference("tiny-gemma2-reference.json"), KernelProfile::Cpu);
}

/// Gemma 3 (transformers' Gemma3ForCausalLM): windowed / global / windowed layers with their own
/// RoPE bases, q/k norms, query_pre_attn_scalar, GeGLU, the extra norms.
#[test]
fn gemma3_from_hf() {
    let cfg = read_config(&local("tiny-gemma3")).unwrap();
    assert_eq!((cfg.arch, cfg.sliding_window, cfg.qk_norm), (Arch::Gemma3, Some(8), true));
    assert_eq!(cfg.style.sliding_layers.as_deref(), Some(&[true, false, true][..]));
    assert_eq!((cfg.rope_theta, cfg.style.local_rope_theta), (1e6, Some(1e4)));
    tiny::assert_matches_reference("tiny-gemma3", &reference("tiny-gemma3-reference.json"), KernelProfile::Cpu);
}
