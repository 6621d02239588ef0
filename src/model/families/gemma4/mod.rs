//! Gemma 4 (text): what its config says beyond Gemma 3's, read into `LayerStyle` and
//! `FullAttn`. Its layers are the dense recipe of model/recipe.rs: sliding-window layers (head
//! size `head_dim`, RoPE base 10000 over the whole head) interleaved with full-attention layers
//! of their own geometry (`global_head_dim`, `num_global_key_value_heads`, keys that are also the
//! values when `attention_k_eq_v`, `proportional` RoPE: the pairs (i, i + d/2) of the whole head,
//! only the first partial_rotary_factor of them rotated); q/k norms with weights and a v norm
//! without; attention scores unscaled (1.0); norms that multiply by their plain weight (not
//! Gemma 2/3's 1 + w); each layer's output multiplied by its `layer_scalar`; logits soft-capped.
//!
//! GGUF: llama.cpp's `gemma4` files (`gguf_config`), with the same layers (its norms are stored
//! as they are: no 1 + w).
//!
//! E2B / E4B: per-layer embeddings (model/blocks/ple.rs), the last `num_kv_shared_layers` layers
//! attending over the cache of the last earlier layer of their kind (queries only), double-wide
//! FFNs on those. 26B-A4B: a dense MLP beside the experts on every layer (model/blocks/parallel_moe.rs).

pub mod synth;

use super::gemma::GEMMA_HF_NAMES;
use super::{Arch, Family, BASE};
use crate::formats::gguf::GgufFile;
use crate::model::blocks::experts::ExpertNames;
use crate::model::config::{FullAttn, LayerStyle, ModelConfig, RopeScaling};
use crate::model::layers::TensorNames;
use anyhow::{anyhow, bail, Result};
use serde_json::Value;

pub(crate) const GEMMA4: Family = Family {
    arch: Arch::Gemma4,
    hf_archs: &["Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"],
    gguf_archs: &["gemma4"],
    // Gemma 4 may give an FFN size per layer (read by its own config).
    ffn_optional: true,
    hf_config,
    gguf_config,
    hf_names: |w| super::vl_or_text(w, &VL_HF_NAMES, &GEMMA4_HF_NAMES),
    // Its norms multiply by their plain weights.
    hf_add_one: false,
    dense_beside_experts: true,
    synth: synth::SYNTH,
    ..BASE
};

/// Hugging Face names of Gemma 4: Gemma's, with its experts as one 3-D tensor per projection
/// (gate rows then up rows per expert) beside its own router.
pub(crate) const GEMMA4_HF_NAMES: TensorNames = TensorNames { experts: &HF_EXPERTS, ..GEMMA_HF_NAMES };

const HF_EXPERTS: ExpertNames = ExpertNames {
    router: "router.proj.weight",
    gate_up: "experts.gate_up_proj",
    gate: "",
    up: "",
    down: "experts.down_proj",
    ..crate::model::blocks::experts::HF_EXPERTS
};

/// Hugging Face names of the language model inside `Gemma4ForConditionalGeneration` (its vision
/// and audio towers are not read).
pub(crate) const VL_HF_NAMES: TensorNames =
    TensorNames { ple: &crate::model::blocks::ple::VL_HF_PLE, ..super::language_model(GEMMA4_HF_NAMES) };

/// Gemma 4's layers when a config does not list them: five sliding-window layers to one global.
const PATTERN: usize = 6;
/// The full-attention layers' head size when a config does not say (transformers' default).
const GLOBAL_HEAD_DIM: usize = 512;
/// The sliding-window layers' RoPE base when a config does not say.
const LOCAL_ROPE_THETA: f64 = 10000.0;

/// A Gemma 4 text config (config.json, or its `text_config`) on top of the fields every family
/// has (`cfg`).
pub(crate) fn hf_config(mut cfg: ModelConfig, v: &Value, src: &str) -> Result<ModelConfig> {
    if let Some(act) = v["hidden_activation"].as_str() {
        if act != "gelu_pytorch_tanh" && act != "gelu_tanh" {
            bail!("{src}: hidden_activation '{act}' is not supported (supported: gelu_pytorch_tanh)");
        }
    }
    let count = |k: &str| v[k].as_u64().unwrap_or(0) as usize;
    let ple = match count("hidden_size_per_layer_input") {
        0 => None,
        p => Some((p, count("vocab_size_per_layer_input").max(1))),
    };
    let extras = Extras {
        ple,
        kv_shared: count("num_kv_shared_layers"),
        double_wide: v["use_double_wide_mlp"].as_bool() == Some(true),
    };
    if v["enable_moe_block"].as_bool() == Some(true) {
        let (experts, top_k, ffn) = (count("num_experts"), count("top_k_experts"), count("moe_intermediate_size"));
        cfg.moe = Some(moe_config(cfg.layers, experts, top_k, ffn));
    }
    if !v["use_bidirectional_attention"].is_null() {
        bail!("{src}: use_bidirectional_attention is not supported");
    }
    if v["attention_bias"].as_bool() == Some(true) {
        bail!("{src}: attention_bias is not supported for Gemma 4");
    }
    let window =
        v["sliding_window"].as_u64().filter(|&w| w > 0).ok_or_else(|| anyhow!("{src}: sliding_window is missing"))?;
    cfg.sliding_window = Some(window as usize);
    let mut kinds = crate::model::config::layer_types(v, src)?
        .unwrap_or_else(|| (0..cfg.layers).map(|l| (l + 1) % PATTERN != 0).collect());
    // transformers makes the last layer global whatever the list says.
    if let Some(last) = kinds.last_mut() {
        *last = false;
    }

    // The full-attention layers' geometry: per_layer_config (transformers 5 writes it), else
    // global_head_dim / num_global_key_value_heads (the released configs).
    let k_eq_v = v["attention_k_eq_v"].as_bool().unwrap_or(false);
    let (mut head_dim, mut kv_heads) = (GLOBAL_HEAD_DIM, cfg.kv_heads);
    if let Some(g) = v["global_head_dim"].as_u64() {
        head_dim = g as usize;
    }
    if let Some(k) = v["num_global_key_value_heads"].as_u64().filter(|_| k_eq_v) {
        kv_heads = k as usize;
    }
    if let Some(per) = v["per_layer_config"].as_object() {
        let mut global: Option<(usize, usize)> = None;
        for (layer, o) in per {
            let l: usize =
                layer.parse().map_err(|_| anyhow!("{src}: per_layer_config key '{layer}' is not a layer"))?;
            if kinds.get(l) != Some(&false) {
                bail!("{src}: per_layer_config overrides layer {l}, which is not a full-attention layer");
            }
            let d = o["head_dim"].as_u64().map_or(cfg.head_dim, |d| d as usize);
            let k = o["num_key_value_heads"].as_u64().map_or(cfg.kv_heads, |k| k as usize);
            if global.is_some_and(|g| g != (d, k)) {
                bail!("{src}: per_layer_config gives the full-attention layers different geometries");
            }
            global = Some((d, k));
        }
        // Full-attention layers without an entry keep the model's geometry.
        let listed = per.len();
        let full = kinds.iter().filter(|&&s| !s).count();
        match global {
            Some(_) if listed != full => {
                bail!("{src}: per_layer_config covers {listed} of {full} full-attention layers")
            }
            Some((d, k)) => (head_dim, kv_heads) = (d, k),
            None => (head_dim, kv_heads) = (cfg.head_dim, cfg.kv_heads),
        }
    }
    cfg.full_attn = Some(FullAttn { kv_heads, head_dim, k_eq_v });

    // RoPE per layer kind.
    let rope = &v["rope_parameters"];
    let full = &rope["full_attention"];
    let local = &rope["sliding_attention"];
    if local["rope_type"].as_str().is_some_and(|t| t != "default") {
        bail!("{src}: rope scaling on the sliding-window layers is not supported");
    }
    cfg.rope_theta = full["rope_theta"].as_f64().unwrap_or(1e6);
    cfg.rope_scaling = match full["rope_type"].as_str().unwrap_or("default") {
        "default" => RopeScaling::None,
        "proportional" => {
            let factor = full["partial_rotary_factor"].as_f64().unwrap_or(1.0);
            if !(factor > 0.0 && factor <= 1.0) {
                bail!("{src}: partial_rotary_factor {factor} must be in (0, 1]");
            }
            if full["factor"].as_f64().is_some_and(|f| f != 1.0) {
                bail!("{src}: a proportional RoPE 'factor' other than 1 is not supported");
            }
            RopeScaling::Proportional { pairs: (factor * head_dim as f64 / 2.0).floor() as usize }
        }
        other => bail!("{src}: rope_type '{other}' on the full-attention layers is not supported"),
    };
    let softcap = v["final_logit_softcapping"].as_f64().map(|c| c as f32);
    Ok(with_style(cfg, kinds, softcap, local["rope_theta"].as_f64().unwrap_or(LOCAL_ROPE_THETA), extras))
}

/// The 26B-A4B block on every layer: softmax over all experts, top-k renormalised (the per-expert
/// scales and the extra norms are the layer's tensors).
fn moe_config(layers: usize, experts: usize, top_k: usize, ffn: usize) -> crate::model::blocks::moe::MoeConfig {
    crate::model::blocks::moe::MoeConfig {
        experts,
        top_k,
        ffn,
        norm_topk: true,
        sparse_layers: vec![true; layers],
        clamped: None,
        shared_ffn: 0,
    }
}

/// The E2B/E4B parts of a config: per-layer embeddings (floats per layer, token-table rows), the
/// KV-sharing layers at the end, and whether those have double-wide FFNs.
struct Extras {
    ple: Option<(usize, usize)>,
    kv_shared: usize,
    double_wide: bool,
}

/// What every Gemma 4 has: scaled embeddings, post-norms, GeGLU, unscaled scores, q/k/v norms, a
/// scalar per layer; the layer kinds (true: sliding window), the logits' soft cap and the
/// sliding-window layers' RoPE base.
fn with_style(
    mut cfg: ModelConfig,
    kinds: Vec<bool>,
    softcap: Option<f32>,
    local_theta: f64,
    e: Extras,
) -> ModelConfig {
    cfg.style = LayerStyle {
        embed_scale: Some((cfg.hidden as f32).sqrt()),
        post_norms: true,
        gelu: true,
        attn_scale: Some(1.0),
        final_softcap: softcap,
        sliding_layers: Some(kinds),
        local_rope_theta: Some(local_theta),
        v_norm: true,
        layer_scalar: true,
        ple: e.ple,
        kv_shared: e.kv_shared,
        double_wide: e.double_wide,
        ..LayerStyle::default()
    };
    cfg.qk_norm = true;
    cfg.qkv_bias = false;
    cfg
}

/// A Gemma 4 GGUF's metadata as llama.cpp's converter writes it, on top of the keys every family
/// has: `sliding_window_pattern` (true: sliding), `head_count_kv` per layer, `key_length` (the
/// full-attention layers' head size) and `key_length_swa`, `rope.freq_base_swa`; proportional
/// RoPE arrives as `rope_freqs.weight` (1 for the rotated pairs, 1e30 for the rest), and a
/// full-attention layer without `attn_v` has keys that are its values.
pub(crate) fn gguf_config(mut cfg: ModelConfig, g: &GgufFile, arch: &str) -> Result<ModelConfig> {
    let src = g.path.display().to_string();
    let key = |k: &str| format!("{arch}.{k}");
    let count = |k: &str| g.get_u64(&key(k)).unwrap_or(0) as usize;
    let ple = match count("embedding_length_per_layer_input") {
        0 => None,
        // The token table's rows: its second dimension (llama.cpp's ne order).
        p => {
            let t = g
                .tensor(crate::model::blocks::ple::GGUF_PLE.embed)
                .ok_or_else(|| anyhow!("{src}: per_layer_token_embd.weight is missing"))?;
            Some((p, t.dims.get(1).copied().unwrap_or(0) as usize))
        }
    };
    let kv_shared = count("attention.shared_kv_layers");
    if count("expert_count") > 0 {
        let (top_k, ffn) = (count("expert_used_count"), count("expert_feed_forward_length"));
        cfg.moe = Some(moe_config(cfg.layers, count("expert_count"), top_k, ffn));
    }
    let layers = cfg.layers;
    // Per-layer arrays (or one value for all).
    let per_layer = |k: &str| -> Result<Option<Vec<u64>>> {
        match g.get(&key(k)) {
            None => Ok(None),
            Some(v) => match (v.as_u64(), v.as_array()) {
                (Some(x), _) => Ok(Some(vec![x; layers])),
                (None, Some(a)) if a.len() == layers => a
                    .iter()
                    .map(|x| x.as_u64().ok_or_else(|| anyhow!("{src}: {} holds a non-integer", key(k))))
                    .collect::<Result<_>>()
                    .map(Some),
                _ => bail!("{src}: {} must be an integer or one per layer", key(k)),
            },
        }
    };
    let kinds: Vec<bool> = match g.get_array(&key("attention.sliding_window_pattern")) {
        Some(a) if a.len() == layers => a
            .iter()
            .map(|x| x.as_bool().ok_or_else(|| anyhow!("{src}: attention.sliding_window_pattern holds a non-bool")))
            .collect::<Result<_>>()?,
        Some(_) => bail!("{src}: attention.sliding_window_pattern needs one entry per layer"),
        None => (0..layers).map(|l| (l + 1) % PATTERN != 0 && l + 1 != layers).collect(),
    };
    if cfg.sliding_window.is_none() {
        bail!("{src}: attention.sliding_window is missing");
    }
    // One value per kind of layer.
    let by_kind = |v: &[u64], sliding: bool, what: &str| -> Result<Option<usize>> {
        let mut of_kind = v.iter().zip(&kinds).filter(|(_, &s)| s == sliding).map(|(x, _)| *x as usize);
        let first = of_kind.next();
        if of_kind.any(|x| Some(x) != first) {
            bail!("{src}: {what} differs between layers of one kind");
        }
        Ok(first)
    };
    let kv = per_layer("attention.head_count_kv")?.unwrap_or(vec![cfg.heads as u64; layers]);
    let full_hd = cfg.head_dim;
    let swa_hd = g.get_u64(&key("attention.key_length_swa")).map_or(full_hd, |d| d as usize);
    for (k, want) in [("attention.value_length", full_hd), ("attention.value_length_swa", swa_hd)] {
        if let Some(d) = g.get_u64(&key(k)).filter(|&d| d as usize != want) {
            bail!("{src}: {} {d} differs from the key length {want}", key(k));
        }
    }
    for (k, want) in [("rope.dimension_count", full_hd), ("rope.dimension_count_swa", swa_hd)] {
        if let Some(d) = g.get_u64(&key(k)).filter(|&d| d as usize != want) {
            bail!("{src}: {} {d}: partial rotation other than through rope_freqs is not supported", key(k));
        }
    }
    cfg.head_dim = swa_hd;
    cfg.kv_heads = by_kind(&kv, true, "head_count_kv")?.unwrap_or(cfg.heads);
    let full_kv = by_kind(&kv, false, "head_count_kv")?.unwrap_or(cfg.kv_heads);
    // Keys as values: the full-attention layers have no value projection.
    // (The KV-sharing layers have no key or value projection at all.)
    let full_layers: Vec<usize> = (0..layers - kv_shared.min(layers)).filter(|&l| !kinds[l]).collect();
    let no_v = |l: &usize| g.tensor(&format!("blk.{l}.attn_v.weight")).is_none();
    let k_eq_v = full_layers.iter().any(no_v);
    if k_eq_v && !full_layers.iter().all(no_v) {
        bail!("{src}: some full-attention layers have attn_v and some do not");
    }
    cfg.full_attn = Some(FullAttn { kv_heads: full_kv, head_dim: full_hd, k_eq_v });
    // One width, or twice it on the KV-sharing layers (double-wide FFNs).
    let mut double_wide = false;
    if let Some(ffn) = per_layer("feed_forward_length")? {
        let first_shared = layers - kv_shared.min(layers);
        let base = ffn[0];
        double_wide = ffn[first_shared..].iter().any(|&f| f == 2 * base) && base > 0;
        let want = |l: usize| if double_wide && l >= first_shared { 2 * base } else { base };
        if (0..layers).any(|l| ffn[l] != want(l)) {
            bail!("{src}: feed_forward_length must be one width, or twice it on the KV-sharing layers");
        }
        cfg.intermediate = base as usize;
    }
    let softcap = g.get_f32(&key("final_logit_softcapping")).filter(|&c| c > 0.0);
    let local = g.get_f32(&key("rope.freq_base_swa")).map_or(LOCAL_ROPE_THETA, |b| b as f64);
    Ok(with_style(cfg, kinds, softcap, local, Extras { ple, kv_shared, double_wide }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::ModelConfig;

    fn config(extra: serde_json::Value) -> Result<ModelConfig> {
        let mut v = serde_json::json!({
            "architectures": ["Gemma4ForCausalLM"],
            "hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "intermediate_size": 128, "vocab_size": 512, "sliding_window": 8,
            "attention_k_eq_v": true, "global_head_dim": 32, "num_global_key_value_heads": 1,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}
            },
            "final_logit_softcapping": 30.0
        });
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("torus-gemma4-config-{}-{n}.json", std::process::id()));
        std::fs::write(&p, v.to_string()).unwrap();
        let c = ModelConfig::from_hf_json(&p);
        let _ = std::fs::remove_file(&p);
        c
    }

    #[test]
    fn reads_the_full_attention_geometry_and_rope() {
        let c = config(serde_json::json!({})).unwrap();
        // Layers 5 (every sixth) and the last are global.
        assert_eq!(c.style.sliding_layers.as_deref(), Some(&[true, true, true, true, true, false][..]));
        assert_eq!((c.geom(0).kv_heads, c.geom(0).head_dim), (2, 16));
        assert_eq!((c.geom(5).kv_heads, c.geom(5).head_dim), (1, 32));
        assert!(c.k_eq_v(5) && !c.k_eq_v(0));
        // 0.25 of the 16 pairs of a 32-wide head rotate.
        assert_eq!(c.rope_scaling, RopeScaling::Proportional { pairs: 4 });
        let (f, _) = c.rope_scaling.inv_freq(c.rope_theta, c.rope_dim());
        assert_eq!(f.len(), 16);
        assert!(f[3] > 0.0 && f[4] == 0.0 && f[15] == 0.0);
        assert!((f[1] - 1e6f64.powf(-2.0 / 32.0)).abs() < 1e-12);
        assert_eq!((c.rope_dim(), c.layer_rope_dim(0), c.layer_rope_dim(5)), (32, 16, 32));
        assert_eq!((c.q_dim(), c.kv_dim(), c.qkv_dim()), (128, 32, 4 * 32 + 2 * 32));
        assert_eq!(c.style.attn_scale, Some(1.0));
    }

    #[test]
    fn per_layer_config_overrides_like_transformers_writes_it() {
        let per = serde_json::json!({"per_layer_config": {"2": {"head_dim": 32, "num_key_value_heads": 1}}, "layer_types": [
            "sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"]});
        // Layer 5 is global too but has no entry: refused rather than guessed.
        assert!(config(per).unwrap_err().to_string().contains("covers 1 of 2"));
        let per = serde_json::json!({"per_layer_config": {"5": {"head_dim": 64, "num_key_value_heads": 2}}});
        let c = config(per).unwrap();
        assert_eq!((c.geom(5).kv_heads, c.geom(5).head_dim), (2, 64));
    }

    #[test]
    fn refuses_what_it_does_not_run() {
        for (extra, what) in [
            (
                serde_json::json!({"enable_moe_block": true, "num_experts": 600, "top_k_experts": 2, "moe_intermediate_size": 32}),
                "600 experts",
            ),
            (serde_json::json!({"hidden_activation": "silu"}), "hidden_activation"),
        ] {
            let e = config(extra).unwrap_err().to_string();
            assert!(e.contains(what), "{e}");
        }
    }
}
