//! gpt-oss (HF `GptOssForCausalLM`, GGUF `gpt-oss`): what its configs say beyond Llama's and
//! how its expert tensors are read. Its layers are the dense recipe's attention (q/k/v and output
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
//! as `ffn_gate_up_exps`) with `ffn_*_exps.bias`. All become model/blocks/moe.rs's layout: per expert
//! its gate rows then its up rows.

use super::{Arch, Family, SynthEntry, SynthLayout, BASE};
use crate::formats::gguf::{GgufFile, GgufValue};
use crate::gpu::wformat::WFormat;
use crate::model::blocks::moe::{gate_up_apart, HostMoe, MoeConfig};
use crate::model::config::{LayerStyle, ModelConfig, RopeScaling};
use crate::model::layers::{TensorNames, WeightSource, GGUF_NAMES, HF_NAMES};
use crate::model::synth::{SynthMoe, SynthShape};
use crate::model::synth_tiny::TINY_EXPERTS;
use crate::weights::mxfp4_hf;
use crate::weights::tensor::QTensor;
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
    experts: load_experts,
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

/// Hugging Face names of gpt-oss: the router and the fused expert tensors (`up_exps` empty: gate
/// and up share one tensor).
pub(crate) const GPTOSS_HF_NAMES: TensorNames = TensorNames {
    router: "mlp.router.weight",
    gate_exps: "mlp.experts.gate_up_proj",
    up_exps: "",
    down_exps: "mlp.experts.down_proj",
    ..HF_NAMES
};

/// llama.cpp's names of gpt-oss: the FFN's norm is `post_attention_norm`.
pub(crate) const GPTOSS_GGUF_NAMES: TensorNames = TensorNames { ffn_norm: "post_attention_norm.weight", ..GGUF_NAMES };

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

/// Layer `t`'s experts, router and their biases (`n`: GPTOSS_HF_NAMES or GPTOSS_GGUF_NAMES).
pub(crate) fn load_experts(
    w: &dyn WeightSource,
    n: &TensorNames,
    t: &dyn Fn(&str) -> String,
    cfg: &ModelConfig,
) -> Result<HostMoe> {
    let (_, (h, e, f)) = crate::model::blocks::moe::expert_dims(cfg)?;
    let router = w.matrix(&t(n.router), e, h)?;
    let router_bias = Some(w.vector(&t(&n.router.replace("weight", "bias")), e)?);
    let layer_err = |err: anyhow::Error| anyhow!("{}: layer {}: {err}", w.path().display(), t(""));
    let (gate_up, down, biases) = if !n.up_exps.is_empty() {
        gguf_experts(w, n, t, (h, e, f))?
    } else {
        // Hugging Face: gate and up fused, alternating; biases [experts, 2 * ffn] and [experts, hidden].
        let (gub, _) = w.array(&t(&format!("{}_bias", n.gate_exps)), &[e, 2 * f])?;
        let (dnb, _) = w.array(&t(&format!("{}_bias", n.down_exps)), &[e, h])?;
        let bias =
            (0..e).flat_map(|x| (0..2 * f).map(move |r| (x, r))).map(|(x, r)| gub[x * 2 * f + gate_up_row(r, f)]);
        let (gate_up, down) = if w.has(&t(&format!("{}_blocks", n.gate_exps))) {
            hf_mxfp4_experts(w, n, t, (h, e, f)).map_err(layer_err)?
        } else {
            hf_float_experts(w, n, t, (h, e, f)).map_err(layer_err)?
        };
        (gate_up, down, (bias.collect(), dnb))
    };
    Ok(HostMoe { router, router_bias, gate_up, down, biases: Some(biases), shared: None, parallel: None })
}

/// Within one expert, the stored (interleaved) row of our row `r` (gate rows, then up rows).
fn gate_up_row(r: usize, f: usize) -> usize {
    if r < f {
        2 * r
    } else {
        2 * (r - f) + 1
    }
}

/// Hugging Face's float experts (as transformers saves them): `gate_up_proj` [experts, hidden,
/// 2 * ffn] and `down_proj` [experts, ffn, hidden], transposed into rows.
fn hf_float_experts(
    w: &dyn WeightSource,
    n: &TensorNames,
    t: &dyn Fn(&str) -> String,
    (h, e, f): (usize, usize, usize),
) -> Result<(QTensor, QTensor)> {
    let (gu, gu_f32) = w.array(&t(n.gate_exps), &[e, h, 2 * f])?;
    let (dn, dn_f32) = w.array(&t(n.down_exps), &[e, f, h])?;
    let mut rows = Vec::with_capacity(gu.len());
    for x in 0..e {
        let ex = &gu[x * h * 2 * f..(x + 1) * h * 2 * f];
        for r in 0..2 * f {
            let col = gate_up_row(r, f);
            rows.extend((0..h).map(|c| ex[c * 2 * f + col]));
        }
    }
    let mut down = Vec::with_capacity(dn.len());
    for x in 0..e {
        let ex = &dn[x * f * h..(x + 1) * f * h];
        for r in 0..h {
            down.extend((0..f).map(|c| ex[c * h + r]));
        }
    }
    let tensor = |rows: usize, cols: usize, v: &[f32], f32: bool| {
        if f32 {
            QTensor::from_f32(rows, cols, v)
        } else {
            QTensor::from_f32_as_f16(rows, cols, v)
        }
    };
    Ok((tensor(e * 2 * f, h, &rows, gu_f32)?, tensor(e * h, f, &down, dn_f32)?))
}

/// The published checkpoints' MXFP4 experts: `*_blocks` [experts, rows, cols / 32, 16] and
/// `*_scales` [experts, rows, cols / 32] (rows: gate and up interleaved, or hidden), kept in
/// MXFP4.
fn hf_mxfp4_experts(
    w: &dyn WeightSource,
    n: &TensorNames,
    t: &dyn Fn(&str) -> String,
    (h, e, f): (usize, usize, usize),
) -> Result<(QTensor, QTensor)> {
    let read = |name: &str, rows: usize, cols: usize, order: Option<&[usize]>| -> Result<QTensor> {
        if !cols.is_multiple_of(32) {
            bail!("MXFP4 {name} has rows of {cols} (a multiple of 32 is needed)");
        }
        let blocks = w.bytes(&t(&format!("{name}_blocks")), &[e, rows, cols / 32, 16])?;
        let scales = w.bytes(&t(&format!("{name}_scales")), &[e, rows, cols / 32])?;
        let order: Option<Vec<usize>> =
            order.map(|o| (0..e).flat_map(|x| o.iter().map(move |r| x * rows + r)).collect());
        let bytes = mxfp4_hf::gguf_bytes(&blocks, &scales, e * rows, cols, order.as_deref())?;
        QTensor::from_gguf_blocks(WFormat::MXFP4, e * rows, cols, &bytes)
    };
    let order: Vec<usize> = (0..2 * f).map(|r| gate_up_row(r, f)).collect();
    Ok((read(n.gate_exps, 2 * f, h, Some(&order))?, read(n.down_exps, h, f, None)?))
}

/// Per-expert biases of gate/up (in their row order) and of down.
type ExpertBiases = (Vec<f32>, Vec<f32>);

/// llama.cpp's layout: gate and up apart (or, from newer converters, fused as
/// `ffn_gate_up_exps`, gate rows then up rows per expert), biases `[experts, rows]` beside them.
fn gguf_experts(
    w: &dyn WeightSource,
    n: &TensorNames,
    t: &dyn Fn(&str) -> String,
    (h, e, f): (usize, usize, usize),
) -> Result<(QTensor, QTensor, ExpertBiases)> {
    let bias_of = |name: &str| name.replace(".weight", ".bias");
    let fused = n.gate_exps.replace("ffn_gate_exps", "ffn_gate_up_exps");
    let (gate_up, bias) = if w.has(&t(&fused)) {
        (w.experts(&t(&fused), e, 2 * f, h)?, w.array(&t(&bias_of(&fused)), &[e, 2 * f])?.0)
    } else {
        let gate_up = gate_up_apart(w, n, t, (h, e, f))?;
        let (gb, _) = w.array(&t(&bias_of(n.gate_exps)), &[e, f])?;
        let (ub, _) = w.array(&t(&bias_of(n.up_exps)), &[e, f])?;
        let bias = (0..e).flat_map(|x| gb[x * f..(x + 1) * f].iter().chain(&ub[x * f..(x + 1) * f])).copied().collect();
        (gate_up, bias)
    };
    let (db, _) = w.array(&t(&bias_of(n.down_exps)), &[e, h])?;
    Ok((gate_up, w.experts(&t(n.down_exps), e, h, f)?, (bias, db)))
}
