//! Gemma 2 and Gemma 3: what their configs say beyond Llama's (read into `LayerStyle`), and the
//! one change their Hugging Face weights need (RMSNorm's `1 + weight`). Their layers are the
//! dense recipe of model/recipe.rs, driven by that style: embeddings times sqrt(hidden), norms
//! after attention and the FFN, GeGLU, query_pre_attn_scalar, Gemma 2's soft caps, and
//! sliding-window layers interleaved with global ones (Gemma 3's with a RoPE base of their own).
//!
//! Memory: every layer shares one block table, so a windowed layer keeps the KV blocks of the
//! whole sequence although it reads only its window (Gemma 3 270M at 32k tokens: 15 of 18 layers
//! hold 32k instead of 512 positions, about 5x the KV memory a per-kind pool would need). Blocks
//! are freed as they leave the window only when every layer is windowed (`uniform_window`); a
//! block pool per layer kind (vLLM's hybrid KV-cache manager) would take the window layers'
//! tables apart from the global ones.

use super::{Arch, Family, BASE};
use crate::formats::gguf::GgufFile;
use crate::model::config::{LayerStyle, ModelConfig, RopeScaling};
use crate::model::layers::{TensorNames, HF_NAMES};
use anyhow::{bail, Result};
use serde_json::Value;

pub(crate) const GEMMA2: Family = Family {
    arch: Arch::Gemma2,
    hf_archs: &["Gemma2ForCausalLM"],
    gguf_archs: &["gemma2"],
    hf_config,
    gguf_config,
    hf_names: |_| &GEMMA_HF_NAMES,
    hf_add_one: true,
    ..BASE
};

pub(crate) const GEMMA3: Family =
    Family { arch: Arch::Gemma3, hf_archs: &["Gemma3ForCausalLM"], gguf_archs: &["gemma3"], ..GEMMA2 };

/// Hugging Face names of Gemma 2 and 3: `post_attention_layernorm` is the norm after
/// attention, the FFN's own norm is `pre_feedforward_layernorm`.
pub(crate) const GEMMA_HF_NAMES: TensorNames = TensorNames {
    ffn_norm: "pre_feedforward_layernorm.weight",
    post_attn_norm: "post_attention_layernorm.weight",
    post_ffn_norm: "post_feedforward_layernorm.weight",
    ..HF_NAMES
};

/// Gemma 3's layers: five windowed to one global (layer l is global when (l + 1) % 6 == 0).
pub const GEMMA3_PATTERN: usize = 6;
/// Gemma 3's RoPE base on the windowed layers when a file does not say (llama.cpp's too).
pub const GEMMA3_LOCAL_ROPE_THETA: f64 = 10000.0;

/// Which layers are windowed in a pattern of `n`: all but every n-th (Gemma 2: n = 2, the even
/// layers; Gemma 3: n = 6).
pub fn sliding_pattern(layers: usize, n: usize) -> Vec<bool> {
    (0..layers).map(|l| (l + 1) % n != 0).collect()
}

/// The style both Gemmas share, for `arch` with `hidden` and the given score scale.
fn base_style(arch: Arch, hidden: usize, layers: usize, attn_scale: f32) -> LayerStyle {
    LayerStyle {
        embed_scale: Some((hidden as f32).sqrt()),
        post_norms: true,
        gelu: true,
        attn_scale: Some(attn_scale),
        sliding_layers: Some(sliding_pattern(layers, if arch == Arch::Gemma2 { 2 } else { GEMMA3_PATTERN })),
        ..LayerStyle::default()
    }
}

/// A Gemma config.json on top of the fields every family has (`cfg`).
pub(crate) fn hf_config(mut cfg: ModelConfig, v: &Value, src: &str) -> Result<ModelConfig> {
    if let Some(act) = v["hidden_activation"].as_str().or_else(|| v["hidden_act"].as_str()) {
        if act != "gelu_pytorch_tanh" && act != "gelu_tanh" {
            bail!("{src}: hidden_activation '{act}' is not supported (supported: gelu_pytorch_tanh)");
        }
    }
    let scalar = v["query_pre_attn_scalar"].as_f64().unwrap_or(cfg.head_dim as f64);
    if !(scalar > 0.0 && scalar.is_finite()) {
        bail!("{src}: query_pre_attn_scalar must be positive");
    }
    let mut style = base_style(cfg.arch, cfg.hidden, cfg.layers, (1.0 / scalar.sqrt()) as f32);
    if v["use_bidirectional_attention"].as_bool() == Some(true) {
        bail!("{src}: use_bidirectional_attention (an embedding model) is not supported");
    }
    // Gemma 2's configs set both caps, Gemma 3's leave them null; either is honoured.
    let cap = |k: &str| v[k].as_f64().map(|c| c as f32);
    style.attn_softcap = cap("attn_logit_softcapping");
    style.final_softcap = cap("final_logit_softcapping");
    // Newer configs list each layer's kind; older ones give Gemma 3's pattern length.
    if let Some(kinds) = crate::model::config::layer_types(v, src)? {
        style.sliding_layers = Some(kinds);
    } else if let Some(n) = v["sliding_window_pattern"].as_u64().filter(|_| cfg.arch == Arch::Gemma3) {
        style.sliding_layers = Some(sliding_pattern(cfg.layers, n.max(1) as usize));
    }
    // RoPE: transformers 5 nests rope_parameters per layer kind; older configs give rope_theta,
    // rope_scaling and (Gemma 3) rope_local_base_freq.
    let nested = &v["rope_parameters"];
    if nested["full_attention"].is_object() || nested["sliding_attention"].is_object() {
        let full = &nested["full_attention"];
        cfg.rope_theta = full["rope_theta"].as_f64().unwrap_or(cfg.rope_theta);
        let typed =
            full.as_object().filter(|o| o.get("rope_type").and_then(|t| t.as_str()).is_some_and(|t| t != "default"));
        cfg.rope_scaling = RopeScaling::from_hf(typed, cfg.max_positions as f64, src)?;
        let local = &nested["sliding_attention"];
        if local["rope_type"].as_str().is_some_and(|t| t != "default") {
            bail!("{src}: rope scaling on the sliding-window layers is not supported");
        }
        style.local_rope_theta = local["rope_theta"].as_f64();
    } else if cfg.arch == Arch::Gemma3 {
        style.local_rope_theta = Some(v["rope_local_base_freq"].as_f64().unwrap_or(GEMMA3_LOCAL_ROPE_THETA));
    }
    if style.local_rope_theta == Some(cfg.rope_theta) && cfg.rope_scaling == RopeScaling::None {
        style.local_rope_theta = None;
    }
    cfg.sliding_window = v["sliding_window"].as_u64().map(|w| w as usize);
    if cfg.sliding_window.is_none() {
        style.sliding_layers = None;
    }
    cfg.qk_norm = cfg.arch == Arch::Gemma3;
    cfg.qkv_bias = v["attention_bias"].as_bool().unwrap_or(false);
    cfg.style = style;
    Ok(cfg)
}

/// A Gemma GGUF's metadata on top of the keys every family has, as llama.cpp reads it: the
/// score scale from the head size (hidden / heads for the 27B models), Gemma 2's soft caps and
/// alternating layers, Gemma 3's pattern of six with the windowed layers' RoPE base 10000.
pub(crate) fn gguf_config(mut cfg: ModelConfig, g: &GgufFile, arch_name: &str) -> Result<ModelConfig> {
    let key = |k: &str| format!("{arch_name}.{k}");
    let big = match cfg.arch {
        Arch::Gemma2 => cfg.layers == 46,
        _ => cfg.layers == 62,
    };
    let scale_dim = if big { cfg.hidden / cfg.heads.max(1) } else { cfg.head_dim };
    let mut style = base_style(cfg.arch, cfg.hidden, cfg.layers, 1.0 / (scale_dim as f32).sqrt());
    style.attn_softcap = g.get_f32(&key("attn_logit_softcapping")).filter(|&c| c > 0.0);
    style.final_softcap = g.get_f32(&key("final_logit_softcapping")).filter(|&c| c > 0.0);
    if cfg.arch == Arch::Gemma3 {
        let local = g.get_f32(&key("rope.freq_base_swa")).map_or(GEMMA3_LOCAL_ROPE_THETA, |b| b as f64);
        style.local_rope_theta = Some(local);
    }
    if cfg.sliding_window.is_none() {
        style.sliding_layers = None;
    }
    cfg.qk_norm = cfg.arch == Arch::Gemma3;
    cfg.qkv_bias = false;
    cfg.style = style;
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_the_families() {
        // Gemma 2: even layers windowed; Gemma 3: every sixth layer global.
        assert_eq!(sliding_pattern(4, 2), [true, false, true, false]);
        let g3 = sliding_pattern(12, GEMMA3_PATTERN);
        assert_eq!(g3.iter().filter(|&&w| !w).count(), 2);
        assert!(!g3[5] && !g3[11] && g3[0] && g3[4] && g3[6]);
    }
}
