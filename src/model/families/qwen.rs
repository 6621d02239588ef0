//! Qwen2/2.5 and Qwen3, dense and mixture of experts (Qwen2-MoE, Qwen3-MoE): the dense recipe
//! with Qwen2's q/k/v biases or Qwen3's q/k norms, and model/blocks/moe.rs's experts (Qwen2-MoE's
//! with a gated shared expert). Their configs' sliding-window fields are unused unless
//! `use_sliding_window` is set, which (per-layer windows) is refused.

use super::{Arch, Family, SynthEntry, SynthLayout, BASE};
use crate::formats::gguf::GgufFile;
use crate::model::blocks::moe;
use crate::model::config::ModelConfig;
use crate::model::synth::{SynthMoe, SynthShape};
use crate::model::synth_tiny::TINY_EXPERTS;
use anyhow::{bail, Result};
use serde_json::Value;

pub(crate) const QWEN2: Family = Family {
    arch: Arch::Qwen2,
    hf_archs: &["Qwen2ForCausalLM"],
    gguf_archs: &["qwen2"],
    qkv_bias: true,
    hf_config: dense_hf,
    synth: SynthLayout {
        shapes: &[
            SynthEntry {
                name: "qwen2.5-0.5b",
                shape: || synth_qwen2("qwen2.5-0.5b", [896, 14, 2, 4864, 151936, 24], true),
                tiny: |base| (base, 2),
            },
            SynthEntry {
                name: "qwen2.5-7b",
                shape: || synth_qwen2("qwen2.5-7b", [3584, 28, 4, 18944, 152064, 28], false),
                tiny: |base| (base, 2),
            },
        ],
        ..BASE.synth
    },
    ..BASE
};

pub(crate) const QWEN3: Family = Family {
    arch: Arch::Qwen3,
    hf_archs: &["Qwen3ForCausalLM"],
    gguf_archs: &["qwen3"],
    qk_norm: true,
    hf_config: dense_hf,
    ..BASE
};

pub(crate) const QWEN2_MOE: Family = Family {
    arch: Arch::Qwen2Moe,
    hf_archs: &["Qwen2MoeForCausalLM"],
    gguf_archs: &["qwen2moe"],
    qkv_bias: true,
    ffn_optional: true,
    hf_config: moe_hf,
    gguf_config: |cfg, g, arch| moe_gguf(cfg, g, arch, false),
    ..BASE
};

pub(crate) const QWEN3_MOE: Family = Family {
    arch: Arch::Qwen3Moe,
    hf_archs: &["Qwen3MoeForCausalLM"],
    gguf_archs: &["qwen3moe"],
    qk_norm: true,
    ffn_optional: true,
    hf_config: moe_hf,
    gguf_config: |cfg, g, arch| moe_gguf(cfg, g, arch, true),
    synth: SynthLayout {
        // Qwen3-30B-A3B: 128 experts of 768, 8 per token, on all 48 layers; q/k norms; head_dim
        // 128 with 32 query heads (4096 > hidden 2048).
        shapes: &[SynthEntry {
            name: "qwen3-30b-a3b",
            shape: || SynthShape {
                arch: Arch::Qwen3Moe,
                head_dim: 128,
                context_length: 40960,
                moe: Some(SynthMoe { experts: 128, top_k: 8, ffn: 768 }),
                ..synth_qwen2("qwen3-30b-a3b", [2048, 32, 4, 6144, 151936, 48], false)
            },
            tiny: |base| (SynthShape { moe: Some(TINY_EXPERTS), ..base }, 2),
        }],
        ..BASE.synth
    },
    ..BASE
};

/// A Qwen2-style synthetic shape (`dims` as `SynthShape::dense` takes them): RoPE base 1e6, RMS
/// epsilon 1e-6, 32768 positions, Qwen2's pre-tokenizer.
pub(crate) fn synth_qwen2(name: &'static str, dims: [usize; 6], tied: bool) -> SynthShape {
    SynthShape {
        rope_theta: 1e6,
        rms_eps: 1e-6,
        context_length: 32768,
        pre_tokenizer: "qwen2",
        ..SynthShape::dense(Arch::Qwen2, name, dims, tied)
    }
}

fn dense_hf(cfg: ModelConfig, v: &Value, src: &str) -> Result<ModelConfig> {
    if v["use_sliding_window"].as_bool() == Some(true) {
        bail!("{src}: use_sliding_window with per-layer windows (max_window_layers) is not supported")
    }
    Ok(cfg)
}

fn moe_hf(cfg: ModelConfig, v: &Value, src: &str) -> Result<ModelConfig> {
    let cfg = dense_hf(cfg, v, src)?;
    Ok(ModelConfig { moe: Some(moe::hf_config(v, cfg.layers, src)?), ..cfg })
}

/// `norm_default`: whether the chosen experts' weights are renormalised when the file does not
/// say (llama.cpp's defaults: Qwen3-MoE yes, Qwen2-MoE no).
fn moe_gguf(cfg: ModelConfig, g: &GgufFile, arch: &str, norm_default: bool) -> Result<ModelConfig> {
    Ok(ModelConfig { moe: Some(moe::gguf_config(g, arch, cfg.layers, norm_default)?), ..cfg })
}
