//! Qwen2, Qwen3 and their mixtures of experts (model/families/qwen.rs): the tiny models of
//! scripts/fixtures/gen_tiny_models.py and gen_tiny_moe.py against transformers' float32
//! references: YaRN (Qwen2), Qwen3's per-head q/k norms from the HF directory and llama.cpp's
//! layout; Qwen3-MoE and Qwen2-MoE (with its gated shared expert; a dense layer between two
//! sparse ones) from their directories and GGUF conversions, in both kernel profiles and split
//! over 2 pipeline stages, and the engine's properties on them: a prompt alone and inside a busy
//! batch gives the same greedy tokens, prefix cache on == off, preemption.

use crate::common::tiny::{self, local, reference};
use torus_wgpu::config::KernelProfile;
use torus_wgpu::gpu::Gpu;
use torus_wgpu::model::config::{Arch, RopeScaling};
use torus_wgpu::model::loader::read_config;

#[test]
fn yarn_rope_scaling() {
    let cfg = read_config(&local("tiny-yarn")).unwrap();
    let RopeScaling::Yarn { attention_factor, .. } = cfg.rope_scaling else { panic!("{:?}", cfg.rope_scaling) };
    let r = reference("tiny-yarn-reference.json");
    let want = r["rope"]["attention_scaling"].as_f64().unwrap();
    assert!((attention_factor - want).abs() < 1e-6, "attention factor {attention_factor} vs {want}");
    tiny::assert_matches_reference("tiny-yarn", &r, KernelProfile::Cpu);
}

#[test]
fn qwen3_qk_norm() {
    let cfg = read_config(&local("tiny-qwen3")).unwrap();
    assert!(cfg.qk_norm && cfg.arch == Arch::Qwen3 && cfg.head_dim * cfg.heads != cfg.hidden);
    let r = reference("tiny-qwen3-reference.json");
    tiny::assert_matches_reference("tiny-qwen3", &r, KernelProfile::Cpu);
    // llama.cpp's form (arch qwen3: attn_q_norm / attn_k_norm, rows not permuted, tied head).
    let g = read_config(&local("tiny-qwen3.gguf")).unwrap();
    assert!(g.qk_norm && g.arch == Arch::Qwen3 && g.head_dim == cfg.head_dim);
    tiny::assert_matches_reference("tiny-qwen3.gguf", &r, KernelProfile::Cpu);
    // Every 1-D grid (the head norm's included) folded into 2-D at 2 workgroups per dimension.
    let mut gpu = Gpu::new(None).unwrap();
    gpu.max_grid = 2;
    tiny::assert_matches_reference_on(gpu, "tiny-qwen3", &r, KernelProfile::Cpu);
}

#[test]
fn qwen3_moe_config_from_hf_and_gguf() {
    for f in ["tiny-qwen3moe", "tiny-qwen3moe.gguf"] {
        let c = read_config(&local(f)).unwrap();
        assert_eq!(c.arch, Arch::Qwen3Moe, "{f}");
        assert!(c.qk_norm, "{f}");
        let m = c.moe.as_ref().unwrap();
        assert_eq!((m.experts, m.top_k, m.ffn, m.norm_topk), (8, 2, 32, true), "{f}");
        assert_eq!(m.sparse_layers, [true, false, true], "{f}");
        assert_eq!(c.act_width(), 128, "{f}");
    }
    // The GGUF holds what the reference says it holds.
    let r = reference("tiny-qwen3moe-reference.json");
    let len = std::fs::metadata(local("tiny-qwen3moe.gguf")).unwrap().len();
    assert_eq!(len, r["gguf"]["size"].as_u64().unwrap());
}

#[test]
fn qwen2_moe_config_from_hf_and_gguf() {
    for f in ["tiny-qwen2moe", "tiny-qwen2moe.gguf"] {
        let c = read_config(&local(f)).unwrap_or_else(|e| panic!("{f}: {e:#}"));
        assert_eq!(c.arch, Arch::Qwen2Moe, "{f}");
        assert!(c.qkv_bias && !c.qk_norm, "{f}");
        let m = c.moe.as_ref().unwrap();
        assert_eq!((m.experts, m.top_k, m.ffn, m.norm_topk, m.shared_ffn), (8, 2, 32, false, 64), "{f}");
        assert_eq!(m.sparse_layers, [true, false, true], "{f}");
    }
}

/// Every prompt's last-position logits within 1e-3 of transformers and its 20 greedy tokens, from
/// the HF directory and the GGUF, in both kernel profiles.
#[test]
fn qwen3_moe_matches_transformers() {
    let r = reference("tiny-qwen3moe-reference.json");
    for f in ["tiny-qwen3moe", "tiny-qwen3moe.gguf"] {
        for profile in [KernelProfile::Cpu, KernelProfile::Gpu] {
            tiny::assert_matches_reference(f, &r, profile);
        }
    }
}

/// The shared expert (its gate/up, the sigmoid of its gate, its down projection added beside
/// the routed experts'), from the HF directory and the GGUF, in both kernel profiles.
#[test]
fn qwen2_moe_matches_transformers() {
    let r = reference("tiny-qwen2moe-reference.json");
    for f in ["tiny-qwen2moe", "tiny-qwen2moe.gguf"] {
        for profile in [KernelProfile::Cpu, KernelProfile::Gpu] {
            tiny::assert_matches_reference(f, &r, profile);
        }
    }
    tiny::assert_stages_match_reference("tiny-qwen2moe.gguf", &r, &[(0, 2), (2, 3)]);
}

/// Two in-process pipeline stages (a sparse layer, then the dense and the other sparse one): the
/// last-position logits of every prompt within 1e-3 of transformers.
#[test]
fn qwen3_moe_in_two_pipeline_stages() {
    tiny::assert_stages_match_reference(
        "tiny-qwen3moe.gguf",
        &reference("tiny-qwen3moe-reference.json"),
        &[(0, 1), (1, 3)],
    );
}

/// Batching invariance and prefix cache on == off: the experts a token is routed to do not
/// depend on the other tokens of its step.
#[test]
fn qwen3_moe_batched_equals_alone_and_prefix_cache_on_equals_off() {
    tiny::assert_batched_equals_alone_and_prefix_cache_on_equals_off("tiny-qwen3moe");
}

#[test]
fn qwen3_moe_preemption() {
    // One 16-token block of K+V over 3 layers: 3 * 2 * 16 * 32 * 2 bytes (f16) = 6 KiB.
    tiny::assert_preemption_keeps_outputs("tiny-qwen3moe", 12, 6144);
}
