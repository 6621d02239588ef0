//! Qwen3.5 (HF `Qwen3_5ForCausalLM`, the text model of `Qwen3_5ForConditionalGeneration`; GGUF
//! `qwen35`): what its configs say and how its weights are read. Three of every four layers are
//! Gated DeltaNet layers (`LinearConfig`, mixer in model/blocks/delta_net.rs); the others are Qwen3's
//! attention with partial RoPE and an output gate: `q_proj` gives per head the query then a gate
//! (split apart at load), and attention's output is multiplied by the gate's sigmoid. Its
//! RMSNorms multiply by 1 + w in Hugging Face checkpoints (+1 at load, as llama.cpp's converter
//! does), except the DeltaNet's gated norm. Text positions only: the multimodal RoPE sections all
//! carry the same position, which is plain RoPE.
//!
//! GGUF (llama.cpp's converter): A_log is stored as A = -exp(A_log) (`ssm_a`); when value heads
//! outnumber key heads their order is tiled (value head h uses key head h % k_heads), which the
//! kernels follow; `block_count` includes the NextN (MTP) layers (`nextn_predict_layers`), which
//! are loaded apart, as the MTP head (model/blocks/mtp.rs).

pub mod synth;

use super::{Arch, Family, BASE};
use crate::formats::gguf::{GgufFile, GgufValue};
use crate::model::blocks::delta_net::LinearConfig;
use crate::model::config::ModelConfig;
use crate::model::layers::{TensorNames, GGUF_NAMES, HF_NAMES};
use crate::ops::delta::DeltaDims;
use anyhow::{anyhow, bail, Result};
use serde_json::Value;

pub(crate) const QWEN35: Family = Family {
    arch: Arch::Qwen35,
    hf_archs: &[
        "Qwen3_5ForCausalLM",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5MoeForConditionalGeneration",
    ],
    gguf_archs: &["qwen35", "qwen35moe"],
    ffn_optional: true,
    hf_config,
    gguf_config,
    hf_names: |w| super::vl_or_text(w, &VL_HF_NAMES, &HF_NAMES),
    hf_add_one: true,
    gguf_names: &QWEN35_GGUF_NAMES,
    synth: synth::SYNTH,
    ..BASE
};

/// Hugging Face names of the language model inside `Qwen3_5ForConditionalGeneration`.
pub(crate) const VL_HF_NAMES: TensorNames = super::language_model(HF_NAMES);

/// llama.cpp's names of Qwen3.5: the FFN's norm is `post_attention_norm`.
pub(crate) const QWEN35_GGUF_NAMES: TensorNames = TensorNames { ffn_norm: "post_attention_norm.weight", ..GGUF_NAMES };

/// A Qwen3.5 config.json on top of the fields every family has (`cfg`).
pub(crate) fn hf_config(mut cfg: ModelConfig, v: &Value, src: &str) -> Result<ModelConfig> {
    let int = |k: &str, d: u64| v[k].as_u64().unwrap_or(d) as usize;
    let dims = DeltaDims {
        k_heads: int("linear_num_key_heads", 16),
        v_heads: int("linear_num_value_heads", 32),
        k_dim: int("linear_key_head_dim", 128),
        v_dim: int("linear_value_head_dim", 128),
        kernel: int("linear_conv_kernel_dim", 4),
    };
    let layers = match v["layer_types"].as_array() {
        Some(types) => types
            .iter()
            .map(|t| match t.as_str() {
                Some("linear_attention") => Ok(true),
                Some("full_attention") => Ok(false),
                other => Err(anyhow!("{src}: layer type {other:?} (expected linear_attention / full_attention)")),
            })
            .collect::<Result<Vec<_>>>()?,
        None => interval_layers(cfg.layers, int("full_attention_interval", 4)),
    };
    let factor = v["rope_parameters"]["partial_rotary_factor"]
        .as_f64()
        .or_else(|| v["partial_rotary_factor"].as_f64())
        .unwrap_or(0.25);
    if !(factor > 0.0 && factor <= 1.0) {
        bail!("{src}: partial_rotary_factor {factor} must be in (0, 1]");
    }
    cfg.style.rotary_dim = Some((cfg.head_dim as f64 * factor) as usize);
    let sections =
        v["rope_parameters"]["mrope_section"].as_array().or_else(|| v["rope_scaling"]["mrope_section"].as_array());
    if let Some(a) = sections {
        let s: Vec<i64> = a.iter().map(|x| x.as_i64().unwrap_or(-1)).collect();
        check_rope_sections(&s, (cfg.head_dim as f64 * factor) as usize)
            .map_err(|e| anyhow!("{src}: mrope_section: {e}"))?;
    }
    cfg.style.attn_gate = true;
    cfg.qk_norm = true;
    cfg.qkv_bias = v["attention_bias"].as_bool().unwrap_or(false);
    let mtp_layers = int("mtp_num_hidden_layers", 0);
    cfg.linear = Some(LinearConfig { dims, layers, tiled: false, mtp_layers });
    if v["num_experts"].as_u64().is_some() {
        // Qwen3.5-MoE: every layer's FFN a mixture (renormalised top k) beside a gated shared
        // expert (checkpoints store each expert's projections apart, as Qwen2-MoE's).
        let mut m = crate::model::blocks::moe::hf_config(v, cfg.layers, src)?;
        m.norm_topk = true;
        cfg.moe = Some(m);
    }
    Ok(cfg)
}

/// Every layer recurrent but every `interval`-th (Qwen3.5's full_attention_interval).
fn interval_layers(layers: usize, interval: usize) -> Vec<bool> {
    (0..layers).map(|l| !(l + 1).is_multiple_of(interval.max(1))).collect()
}

/// A `qwen35` GGUF's metadata on top of the keys every family has: the `ssm.*` sizes,
/// `full_attention_interval`, `rope.dimension_count` (the rotated part), and `block_count` less
/// the NextN layers.
pub(crate) fn gguf_config(mut cfg: ModelConfig, g: &GgufFile, arch: &str) -> Result<ModelConfig> {
    let src = g.path.display().to_string();
    let key = |k: &str| format!("{arch}.{k}");
    let req = |k: &str| -> Result<usize> { Ok(g.require_u64(&key(k))? as usize) };
    let nextn = g.get_u64(&key("nextn_predict_layers")).unwrap_or(0) as usize;
    if nextn >= cfg.layers {
        bail!("{src}: {nextn} NextN layers of {} blocks", cfg.layers);
    }
    cfg.layers -= nextn;
    let v_heads = req("ssm.time_step_rank")?;
    let dims = DeltaDims {
        k_heads: req("ssm.group_count")?,
        v_heads,
        k_dim: req("ssm.state_size")?,
        v_dim: req("ssm.inner_size")? / v_heads.max(1),
        kernel: req("ssm.conv_kernel")?,
    };
    let interval = g.get_u64(&key("full_attention_interval")).unwrap_or(4) as usize;
    let rotated = g.get_u64(&key("rope.dimension_count")).map_or(cfg.head_dim, |d| d as usize);
    if let Some(a) = g.get_array(&key("rope.dimension_sections")) {
        let s: Vec<i64> = a.iter().map(|x| x.as_i64().unwrap_or(-1)).collect();
        check_rope_sections(&s, rotated).map_err(|e| anyhow!("{src}: {}: {e}", key("rope.dimension_sections")))?;
    }
    cfg.style.rotary_dim = Some(rotated).filter(|&d| d < cfg.head_dim);
    cfg.style.attn_gate = true;
    cfg.qk_norm = true;
    cfg.qkv_bias = false;
    let layers = match g.get_array(&key("attention.recurrent_layers")) {
        Some(a) => recurrent_layers(a, cfg.layers, nextn)
            .map_err(|e| anyhow!("{src}: {}: {e}", key("attention.recurrent_layers")))?,
        None => interval_layers(cfg.layers, interval),
    };
    cfg.linear = Some(LinearConfig { dims, layers, tiled: true, mtp_layers: nextn });
    if arch == "qwen35moe" {
        cfg.moe = Some(crate::model::blocks::moe::gguf_config(g, arch, cfg.layers, true)?);
    }
    Ok(cfg)
}

/// Checks M-RoPE sections (`rope.dimension_sections`, which llama.cpp's loader requires of these
/// files) against the `rotated` dimensions. Text positions give every section the same position
/// and the fourth (the vision encoder's) position 0; interleaved M-RoPE (llama.cpp's IMROPE, as
/// transformers applies it) gives rotary pair k the section of k mod (their sum), taken in turn
/// t, h, w while each lasts, the fourth otherwise. So where every pair falls in the first three,
/// this is plain rotation of the first `rotated` elements (what this engine does); a pair that
/// would take the fourth section (not rotated at all for text) is refused.
fn check_rope_sections(s: &[i64], rotated: usize) -> Result<()> {
    if s.is_empty() || s.len() > 4 || s.iter().any(|&x| !(0..=1 << 16).contains(&x)) || s.iter().sum::<i64>() == 0 {
        bail!("must be 1 to 4 non-negative integers, not all 0, found {s:?}");
    }
    let sect = |i: usize| s.get(i).copied().unwrap_or(0) as usize;
    let sum: usize = s.iter().map(|&x| x as usize).sum();
    for pair in 0..rotated / 2 {
        let sector = pair % sum;
        if sector >= 3 * sect(sector % 3) {
            bail!(
                "{s:?}: rotary pair {pair} of {} falls in the fourth M-RoPE section (left unrotated for text); \
                 not supported",
                rotated / 2
            );
        }
    }
    Ok(())
}

/// `attention.recurrent_layers`: one bool per block, the `nextn` MTP blocks last and not
/// recurrent; the first `layers` entries.
fn recurrent_layers(a: &[GgufValue], layers: usize, nextn: usize) -> Result<Vec<bool>> {
    if a.len() != layers + nextn {
        bail!("{} entries for {} blocks", a.len(), layers + nextn);
    }
    let flags = a.iter().map(|x| x.as_bool().ok_or_else(|| anyhow!("holds a non-bool"))).collect::<Result<Vec<_>>>()?;
    if flags[layers..].iter().any(|&r| r) {
        bail!("marks an MTP block recurrent");
    }
    if !flags[..layers].contains(&false) {
        bail!("marks every layer recurrent (at least one attention layer is needed)");
    }
    Ok(flags[..layers].to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_fourth_layer_attends() {
        assert_eq!(interval_layers(8, 4), [true, true, true, false, true, true, true, false]);
    }

    #[test]
    fn rope_sections_must_cover_the_rotated_elements() {
        let v = |s: &[i64]| s.to_vec();
        // Qwen3.5's own (32 pairs of 64 rotated elements), the synthetic tiny shapes' and the
        // transformers fixtures' (which llama.cpp runs as transformers does).
        for (ok, rotated) in [(&[11, 11, 10, 0][..], 64), (&[3, 3, 2, 0], 16), (&[1, 1, 0, 0], 8), (&[11, 11, 10], 64)]
        {
            check_rope_sections(&v(ok), rotated).unwrap();
        }
        for (bad, rotated, why) in [
            (v(&[11, 11, 9, 1]), 64, "pair 29 of 32 falls in the fourth"),
            (v(&[16, 16, 0, 0]), 64, "pair 2 of 32"),
            (v(&[0, 0, 0, 0]), 64, "not all 0"),
            (v(&[12, 10, 10, 0, 0]), 64, "1 to 4"),
            (v(&[20, 20, -8, 0]), 64, "non-negative"),
        ] {
            let e = check_rope_sections(&bad, rotated).unwrap_err();
            assert!(e.to_string().contains(why), "{e}");
        }
    }

    #[test]
    fn recurrent_layers_are_read_with_the_mtp_block_last() {
        let b = |s: &[bool]| s.iter().map(|&x| GgufValue::Bool(x)).collect::<Vec<_>>();
        assert_eq!(recurrent_layers(&b(&[true, false, true, true, false]), 4, 1).unwrap(), [true, false, true, true]);
        for (bad, why) in [
            (b(&[true, true, true, false]), "4 entries for 5 blocks"),
            (b(&[true, true, true, false, true]), "MTP block"),
            (b(&[true, true, true, true, false]), "every layer"),
        ] {
            let e = recurrent_layers(&bad, 4, 1).unwrap_err();
            assert!(e.to_string().contains(why), "{e}");
        }
    }
}
