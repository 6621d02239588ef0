//! gpt-oss (HF `GptOssForCausalLM`, GGUF `gpt-oss`): what its configs say beyond Llama's and
//! how its expert tensors are named and laid out. Its layers are the dense recipe's attention (q/k/v and output
//! biases, a learned sink logit per head in the softmax's denominator, sliding-window layers of
//! 128 alternating with full ones from layer 0, YaRN RoPE) and model/blocks/moe.rs's mixture: a router
//! with a bias, the top k experts' logits softmaxed (the same as renormalising the softmax over
//! all), per-expert biases, and the clamped SwiGLU `min(g, 7) * sigmoid(1.702 * min(g, 7)) *
//! (clamp(u, -7, 7) + 1)`.
//!
//! Expert tensors: transformers saves each projection fused over the experts and transposed
//! (`gate_up_proj` [experts, hidden, 2 * ffn] with gate and up in alternate columns, `down_proj`
//! [experts, ffn, hidden], biases `*_bias`); the published checkpoints keep them in MXFP4
//! (`*_blocks` / `*_scales`, rows not transposed, gate and up rows alternating), kept in MXFP4
//! here; llama.cpp's converter writes gate and up apart ([experts, ffn, hidden] each, or fused
//! as `ffn_gate_up_exps`) with `ffn_*_exps.bias`. The one expert loader (model/blocks/experts.rs)
//! reads them all into model/blocks/moe.rs's layout: per expert its gate rows then its up rows.

use super::{Arch, Family, SynthEntry, SynthLayout, BASE};
use crate::formats::gguf::{GgufFile, GgufValue};
use crate::gpu::wformat::WFormat;
use crate::model::blocks::experts::ExpertNames;
use crate::model::blocks::moe::MoeConfig;
use crate::model::config::{LayerStyle, ModelConfig, RopeScaling};
use crate::model::layers::{TensorNames, GGUF_NAMES, HF_NAMES};
use crate::model::synth::{SynthMoe, SynthShape};
use crate::model::synth_tiny::TINY_EXPERTS;
use anyhow::{anyhow, bail, Result};
use serde_json::Value;

/// The clamped SwiGLU's alpha (fixed in gpt-oss's code, not in its configs).
pub const SWIGLU_ALPHA: f32 = 1.702;
/// The clamp where a config does not give `swiglu_limit` (gpt-oss's, and llama.cpp's fixed one).
pub const SWIGLU_LIMIT: f32 = 7.0;
/// The window of gpt-oss's sliding layers when a GGUF file does not say.
pub const GPTOSS_WINDOW: usize = 128;

pub(crate) const GPTOSS: Family = Family {
    arch: Arch::GptOss,
    hf_archs: &["GptOssForCausalLM"],
    gguf_archs: &["gpt-oss"],
    qkv_bias: true,
    ffn_optional: true,
    hf_config,
    gguf_config,
    hf_names: |_| &GPTOSS_HF_NAMES,
    gguf_names: &GPTOSS_GGUF_NAMES,
    synth: SynthLayout {
        // gpt-oss-20b: 32 experts of 2880 (in MXFP4, as its files have them), 4 per token, on all
        // 24 layers; 64 query heads of 64 (4096 > hidden 2880), q/k/v/output biases, sinks,
        // windows of 128 on the even layers, YaRN (32x of 4096) as its GGUF has it; the o200k
        // pre-tokenizer.
        shapes: &[SynthEntry {
            name: "gpt-oss-20b",
            shape: || SynthShape {
                arch: Arch::GptOss,
                head_dim: 64,
                rope_theta: 150000.0,
                rms_eps: 1e-5,
                context_length: 131072,
                pre_tokenizer: "gpt-4o",
                moe: Some(SynthMoe { experts: 32, top_k: 4, ffn: 2880 }),
                ..super::qwen::synth_qwen2("gpt-oss-20b", [2880, 64, 8, 2880, 201088, 24], false)
            },
            tiny: |base| (SynthShape { heads: 8, intermediate: 256, moe: Some(TINY_EXPERTS), ..base }, 2),
        }],
        metadata: synth_metadata,
        out_bias_sinks: true,
        expert_format: Some(WFormat::MXFP4),
        expert_biases: true,
        ..BASE.synth
    },
    ..BASE
};

/// A synthetic file's windows and YaRN keys, as gpt-oss's GGUF files have them.
fn synth_metadata(shape: &SynthShape, _layers: usize) -> Vec<(String, GgufValue)> {
    let k = |suffix: &str| format!("{}.{suffix}", shape.arch_name());
    vec![
        (k("attention.sliding_window"), GgufValue::U32(GPTOSS_WINDOW as u32)),
        (k("rope.scaling.type"), GgufValue::Str("yarn".into())),
        (k("rope.scaling.factor"), GgufValue::F32(32.0)),
        (k("rope.scaling.original_context_length"), GgufValue::U32(4096)),
    ]
}

/// Hugging Face names of gpt-oss: its router, and its experts as one tensor per projection
/// (float [experts, cols, rows], or MXFP4 blocks and scales [experts, rows, ...]; the gate's and
/// up's rows alternating), with biases.
pub(crate) const GPTOSS_HF_NAMES: TensorNames = TensorNames { experts: &HF_EXPERTS, ..HF_NAMES };

const HF_EXPERTS: ExpertNames = ExpertNames {
    router: "mlp.router.weight",
    router_bias: "mlp.router.bias",
    gate_up: "mlp.experts.gate_up_proj",
    gate_up_bias: "mlp.experts.gate_up_proj_bias",
    gate: "",
    up: "",
    down: "mlp.experts.down_proj",
    down_bias: "mlp.experts.down_proj_bias",
    alternating: true,
    transposed: true,
    ..crate::model::blocks::experts::HF_EXPERTS
};

/// llama.cpp's names of gpt-oss: the FFN's norm is `post_attention_norm`; biases beside the
/// router and the experts.
pub(crate) const GPTOSS_GGUF_NAMES: TensorNames =
    TensorNames { ffn_norm: "post_attention_norm.weight", experts: &GGUF_EXPERTS, ..GGUF_NAMES };

const GGUF_EXPERTS: ExpertNames = ExpertNames {
    router_bias: "ffn_gate_inp.bias",
    gate_up_bias: "ffn_gate_up_exps.bias",
    gate_bias: "ffn_gate_exps.bias",
    up_bias: "ffn_up_exps.bias",
    down_bias: "ffn_down_exps.bias",
    ..crate::model::blocks::experts::GGUF_EXPERTS
};

/// The style gpt-oss's layers have, with `sliding` saying which layers are windowed.
fn style(sliding: Vec<bool>) -> LayerStyle {
    LayerStyle { sliding_layers: Some(sliding), out_bias: true, attn_sinks: true, ..LayerStyle::default() }
}

/// Layers windowed from layer 0 on, every other one (gpt-oss's pattern, as llama.cpp has it).
fn alternating(layers: usize) -> Vec<bool> {
    (0..layers).map(|l| l % 2 == 0).collect()
}

/// A gpt-oss config.json on top of the fields every family has (`cfg`): num_local_experts,
/// num_experts_per_tok, intermediate_size (each expert's), swiglu_limit, layer_types,
/// sliding_window, attention_bias.
pub(crate) fn hf_config(mut cfg: ModelConfig, v: &Value, src: &str) -> Result<ModelConfig> {
    let int = |k: &str| v[k].as_u64().map(|x| x as usize).ok_or_else(|| anyhow!("{src}: field '{k}' is missing"));
    let sliding = match crate::model::config::layer_types(v, src)? {
        Some(kinds) => kinds,
        None => alternating(cfg.layers),
    };
    let limit = v["swiglu_limit"].as_f64().map_or(SWIGLU_LIMIT, |x| x as f32);
    let moe = MoeConfig {
        experts: int("num_local_experts")?,
        top_k: int("num_experts_per_tok")?,
        ffn: cfg.intermediate,
        norm_topk: true,
        sparse_layers: vec![true; cfg.layers],
        clamped: Some((SWIGLU_ALPHA, limit)),
        shared_ffn: 0,
    };
    if v["attention_bias"].as_bool() == Some(false) {
        bail!("{src}: gpt-oss without attention biases (attention_bias false) is not supported");
    }
    cfg.qkv_bias = true;
    cfg.sliding_window = Some(v["sliding_window"].as_u64().map_or(GPTOSS_WINDOW, |w| w as usize));
    cfg.style = style(sliding);
    cfg.moe = Some(moe);
    Ok(cfg)
}

/// A gpt-oss GGUF's metadata on top of the keys every family has: the experts (every layer's),
/// the window (`attention.sliding_window`) on the even layers.
pub(crate) fn gguf_config(mut cfg: ModelConfig, g: &GgufFile, arch_name: &str) -> Result<ModelConfig> {
    let mut moe = crate::model::blocks::moe::gguf_config(g, arch_name, cfg.layers, true)?;
    if let Some(l) = moe.sparse_layers.iter().position(|s| !s) {
        bail!("{}: gpt-oss layer {l} has no router (blk.{l}.ffn_gate_inp.weight)", g.path.display());
    }
    moe.norm_topk = true;
    moe.clamped = Some((SWIGLU_ALPHA, SWIGLU_LIMIT));
    cfg.qkv_bias = true;
    cfg.sliding_window = Some(cfg.sliding_window.unwrap_or(GPTOSS_WINDOW));
    cfg.style = style(alternating(cfg.layers));
    // gpt-oss was trained with YaRN's ramp bounds as they fall (its config says `truncate:
    // false`; OpenAI's reference, transformers and vLLM keep them), where llama.cpp rounds them.
    if let RopeScaling::Yarn { truncate, .. } = &mut cfg.rope_scaling {
        *truncate = false;
    }
    cfg.moe = Some(moe);
    Ok(cfg)
}
