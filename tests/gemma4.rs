//! Gemma 4 (text, dense): the tiny model of scripts/fixtures/gen_tiny_gemma4.py (sliding-window
//! layers of 16-wide heads and 2 KV heads; full-attention layers of 32-wide heads and 1 KV head
//! whose keys are the values, proportional RoPE over a quarter of the head; plain-weight norms, a
//! v norm, unscaled scores, a scalar per layer, soft-capped logits) from its Hugging Face directory
//! against transformers' float32 logits and greedy tokens, in both kernel profiles; and the
//! engine's properties with two attention geometries in one model: batching invariance, prefix
//! cache on == off, preemption.

mod common;

use common::tiny::{self, local, reference};
use torus_wgpu::config::{EngineConfig, KernelProfile};
use torus_wgpu::model::config::{Arch, RopeScaling};
use torus_wgpu::model::loader::read_config;

#[test]
fn gemma4_config_from_hf() {
    let c = read_config(&local("tiny-gemma4")).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!((c.arch, c.sliding_window), (Arch::Gemma4, Some(8)));
    assert_eq!(c.style.sliding_layers.as_deref(), Some(&[true, true, false, true, true, false][..]));
    let (s, f) = (c.geom(0), c.geom(2));
    assert_eq!((s.heads, s.kv_heads, s.head_dim), (4, 2, 16));
    assert_eq!((f.heads, f.kv_heads, f.head_dim), (4, 1, 32));
    assert!(c.k_eq_v(2) && c.k_eq_v(5) && !c.k_eq_v(0));
    assert_eq!(c.rope_scaling, RopeScaling::Proportional { pairs: 4 });
    assert_eq!((c.rope_theta, c.style.local_rope_theta), (1e6, Some(1e4)));
    assert_eq!(c.style.attn_scale, Some(1.0));
    assert!(c.style.v_norm && c.style.layer_scalar && c.qk_norm && c.style.post_norms);
}

/// Every prompt's last-position logits within 1e-3 of transformers and its greedy tokens, from
/// the HF directory, in both kernel profiles (the gpu profile runs the split and the query-tiled
/// attention of each geometry).
#[test]
fn gemma4_matches_transformers() {
    let r = reference("tiny-gemma4-reference.json");
    for profile in [KernelProfile::Cpu, KernelProfile::Gpu] {
        tiny::assert_matches_reference("tiny-gemma4", &r, profile);
    }
}

/// Batching invariance and prefix cache on == off, with the two KV geometries in one cache.
#[test]
fn gemma4_engine_batched_and_prefix_cache_requests_equal_alone() {
    tiny::assert_batched_equals_alone_and_prefix_cache_on_equals_off("tiny-gemma4");
}

/// Requests that preempt each other in a small cache give the tokens they give alone; the cache
/// holds exactly the blocks its size pays for, each block sized by its layers' own K/V widths.
#[test]
fn gemma4_preemption() {
    let c = read_config(&local("tiny-gemma4")).unwrap();
    let floats: usize = (0..c.layers).map(|l| c.geom(l).kv_dim()).sum();
    // 4 sliding layers of 2 x 16 and 2 full ones of 1 x 32 floats per token.
    assert_eq!(floats, 4 * 32 + 2 * 32);
    let block_size = EngineConfig::default().block_size;
    // K and V, f16.
    tiny::assert_preemption_keeps_outputs("tiny-gemma4", 12, (2 * block_size * floats * 2) as u64);
}
