//! gpt-oss end to end: the tiny models of scripts/fixtures/gen_tiny_gptoss.py (sinks, biases,
//! windows of 8 on alternate layers, YaRN without truncation, 8 experts with biases and the
//! clamped SwiGLU on every layer) from the Hugging Face directory as transformers saves it, the
//! published MXFP4 layout (`*_blocks` / `*_scales`), and their GGUF conversions (F32 and MXFP4
//! experts), against transformers' float32 logits and greedy tokens in both kernel profiles and
//! over 2 pipeline stages; and the engine's properties on it.

use crate::common::tiny::{self, local, reference};
use torus_wgpu::config::KernelProfile;
use torus_wgpu::model::config::{Arch, RopeScaling};
use torus_wgpu::model::loader::read_config;

#[test]
fn gptoss_config_from_hf_and_gguf() {
    for f in ["tiny-gptoss", "tiny-gptoss.gguf", "tiny-gptoss-mxfp4", "tiny-gptoss-mxfp4.gguf"] {
        let c = read_config(&local(f)).unwrap_or_else(|e| panic!("{f}: {e:#}"));
        assert_eq!(c.arch, Arch::GptOss, "{f}");
        assert!(c.qkv_bias && c.style.out_bias && c.style.attn_sinks, "{f}");
        assert_eq!(c.sliding_window, Some(8), "{f}");
        assert_eq!(c.style.sliding_layers.as_deref(), Some(&[true, false, true, false][..]), "{f}");
        let m = c.moe.as_ref().unwrap();
        assert_eq!((m.experts, m.top_k, m.ffn, m.norm_topk), (8, 2, 32, true), "{f}");
        assert_eq!(m.clamped, Some((1.702, 7.0)), "{f}");
        assert_eq!(m.sparse_layers, [true; 4], "{f}");
        match c.rope_scaling {
            RopeScaling::Yarn { factor, original_max, truncate, .. } => {
                assert_eq!((factor, original_max, truncate), (4.0, 32.0, false), "{f}")
            }
            ref other => panic!("{f}: rope scaling {other:?}"),
        }
    }
    for name in ["tiny-gptoss", "tiny-gptoss-mxfp4"] {
        let r = reference(&format!("{name}-reference.json"));
        let len = std::fs::metadata(local(&format!("{name}.gguf"))).unwrap().len();
        assert_eq!(len, r["gguf"]["size"].as_u64().unwrap(), "{name}.gguf is the file its reference describes");
    }
}

#[test]
fn gptoss_matches_transformers() {
    let r = reference("tiny-gptoss-reference.json");
    for f in ["tiny-gptoss", "tiny-gptoss.gguf"] {
        for profile in [KernelProfile::Cpu, KernelProfile::Gpu] {
            tiny::assert_matches_reference(f, &r, profile);
        }
    }
}

/// The experts kept in MXFP4 from both layouts: HF's blocks (two codes a byte, low nibble
/// first) re-packed at load, and the GGUF's blocks as they are.
#[test]
fn gptoss_mxfp4_matches_transformers() {
    let r = reference("tiny-gptoss-mxfp4-reference.json");
    for f in ["tiny-gptoss-mxfp4", "tiny-gptoss-mxfp4.gguf"] {
        for profile in [KernelProfile::Cpu, KernelProfile::Gpu] {
            tiny::assert_matches_reference(f, &r, profile);
        }
    }
}

/// Two stages: a windowed and a full layer each.
#[test]
fn gptoss_in_two_pipeline_stages() {
    tiny::assert_stages_match_reference(
        "tiny-gptoss.gguf",
        &reference("tiny-gptoss-reference.json"),
        &[(0, 2), (2, 4)],
    );
}

#[test]
fn gptoss_batched_equals_alone_and_prefix_cache_on_equals_off() {
    tiny::assert_batched_equals_alone_and_prefix_cache_on_equals_off("tiny-gptoss");
}

#[test]
fn gptoss_preemption() {
    // One 16-token block of K+V over 4 layers: 4 * 2 * 16 * 32 * 2 bytes (f16) = 8 KiB.
    tiny::assert_preemption_keeps_outputs("tiny-gptoss", 12, 8192);
}
