//! Phi-3 (Phi-3-mini, Phi-3-medium; Phi-4-mini's layers too): Llama's layers with q, k and v stored as one
//! tensor and the FFN's gate and up as one (gate rows first), split at load. RoPE is the
//! half-rotation of Hugging Face's checkpoints in both sources (llama.cpp's converter keeps the
//! rows as they are), over the first `partial_rotary_factor` of each head (Phi-4-mini: 0.75).
//! A config.json's sliding window applies to every layer, as transformers applies it; a GGUF
//! file's is ignored, as llama.cpp ignores it for phi3 (they differ past the window: 2047
//! tokens for Phi-3-mini-4k). The long-context variants' `longrope` scaling (per-dimension
//! short and long factors) is refused when the config is read.

use super::{Arch, Family, SynthEntry, SynthLayout, BASE};
use crate::formats::gguf::{GgufFile, GgufValue};
use crate::gpu::wformat::WFormat;
use crate::model::config::ModelConfig;
use crate::model::layers::{TensorNames, GGUF_NAMES, HF_NAMES};
use crate::model::synth::{Fill, SynthShape, SynthTensor};
use anyhow::{bail, Result};
use serde_json::Value;

pub(crate) const PHI3: Family = Family {
    arch: Arch::Phi3,
    hf_archs: &["Phi3ForCausalLM"],
    gguf_archs: &["phi3"],
    hf_config: phi3_hf,
    gguf_config: phi3_gguf,
    hf_names: |_| &PHI3_HF_NAMES,
    gguf_names: &PHI3_GGUF_NAMES,
    synth: SynthLayout {
        shapes: &[SynthEntry {
            name: "phi-3-mini",
            shape: || SynthShape {
                rms_eps: 1e-5,
                ..SynthShape::dense(Arch::Phi3, "phi-3-mini", [3072, 32, 32, 8192, 32064, 32], false)
            },
            tiny: |base| (base, 2),
        }],
        layer: Some(synth_layer),
        // llama.cpp sets the attributes of `</s>`, `<unk>` and `<s>` (SentencePiece's, which the
        // synthetic byte-level vocabulary lacks) for a file whose name says "phi-3" or "phi3",
        // and fails to load it without them: the name avoids both spellings.
        metadata: |_, _| vec![("general.name".into(), GgufValue::Str("synthetic Phi 3 mini".into()))],
        ..BASE.synth
    },
    ..BASE
};

/// A synthetic layer as llama.cpp's converter writes Phi-3's: q/k/v as one `attn_qkv`, the
/// gate's rows then the up's as one `ffn_up`.
fn synth_layer(shape: &SynthShape, format: WFormat, l: usize, _layers: usize) -> Vec<SynthTensor> {
    let p = format!("blk.{l}");
    let m = |name: &str, rows: usize, cols: usize| SynthTensor::matrix(format, format!("{p}.{name}"), rows, cols);
    let v = |name: &str, len: usize| SynthTensor::vector(format!("{p}.{name}"), len, Fill::Norm);
    let (h, i) = (shape.hidden, shape.intermediate);
    vec![
        v("attn_norm.weight", h),
        m("attn_qkv.weight", shape.q_dim() + 2 * shape.kv_dim(), h),
        m("attn_output.weight", h, shape.q_dim()),
        v("ffn_norm.weight", h),
        m("ffn_up.weight", 2 * i, h),
        m("ffn_down.weight", h, i),
    ]
}

const PHI3_HF_NAMES: TensorNames =
    TensorNames { qkv: "self_attn.qkv_proj.weight", gate_up: "mlp.gate_up_proj.weight", ..HF_NAMES };

/// llama.cpp writes the fused gate/up as `ffn_up` (2 * ffn rows).
const PHI3_GGUF_NAMES: TensorNames = TensorNames { qkv: "attn_qkv.weight", gate_up: "ffn_up.weight", ..GGUF_NAMES };

/// The window (every layer) and the rotary part of each head (`partial_rotary_factor`, at the
/// top level or, from newer transformers, in `rope_parameters`).
fn phi3_hf(mut cfg: ModelConfig, v: &Value, src: &str) -> Result<ModelConfig> {
    let scaling = [&v["rope_scaling"], &v["rope_parameters"]];
    if scaling.iter().any(|s| !s["long_factor"].is_null() || !s["short_factor"].is_null()) {
        bail!("{src}: longrope scaling (short and long factors) is not supported");
    }
    cfg.sliding_window = v["sliding_window"].as_u64().map(|w| w as usize);
    let factor = v["partial_rotary_factor"].as_f64().or_else(|| v["rope_parameters"]["partial_rotary_factor"].as_f64());
    if let Some(f) = factor.filter(|&f| f != 1.0) {
        if !(f > 0.0 && f < 1.0) {
            bail!("{src}: partial_rotary_factor {f} is outside (0, 1]");
        }
        cfg.style.rotary_dim = Some((cfg.head_dim as f64 * f) as usize);
    }
    Ok(cfg)
}

/// llama.cpp's converter writes no key length: the head is hidden / heads and
/// `rope.dimension_count` its rotary part (which the common reader took for the head).
fn phi3_gguf(mut cfg: ModelConfig, g: &GgufFile, src: &str) -> Result<ModelConfig> {
    if g.tensor("rope_factors_long.weight").is_some() || g.tensor("rope_factors_short.weight").is_some() {
        bail!("{src}: longrope scaling (rope_factors_long/short) is not supported");
    }
    cfg.sliding_window = None;
    let arch = g.get_str("general.architecture").unwrap_or("phi3");
    if g.get_u64(&format!("{arch}.attention.key_length")).is_none() && cfg.heads > 0 {
        let head_dim = cfg.hidden / cfg.heads;
        if cfg.head_dim != head_dim {
            cfg.style.rotary_dim = Some(cfg.head_dim);
            cfg.head_dim = head_dim;
        }
    }
    Ok(cfg)
}
