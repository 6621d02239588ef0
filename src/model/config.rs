//! Model hyper-parameters, read from a Hugging Face config.json or GGUF metadata.

use anyhow::{anyhow, bail, Result};
use serde_json::Value;
use std::path::Path;

pub use super::families::Arch;
use super::families::Family;
pub use super::rope_scaling::{yarn_mscale, RopeScaling};

/// Where a family's layers differ from Llama's; the default is Llama's.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LayerStyle {
    /// The embedding is multiplied by it (Gemma: sqrt(hidden)).
    pub embed_scale: Option<f32>,
    /// RMSNorm of the attention output and of the FFN output before each is added into the
    /// residual (Gemma's post_attention_norm, post_ffw_norm).
    pub post_norms: bool,
    /// The gated FFN's activation is tanh-GELU (GeGLU), not SiLU.
    pub gelu: bool,
    /// Attention scores are scaled by it instead of head_dim^-1/2 (Gemma's
    /// query_pre_attn_scalar^-1/2).
    pub attn_scale: Option<f32>,
    /// Attention scores become cap * tanh(score / cap) (Gemma 2).
    pub attn_softcap: Option<f32>,
    /// Logits become cap * tanh(logit / cap) (Gemma 2).
    pub final_softcap: Option<f32>,
    /// Per layer, whether it attends within `sliding_window` (None: every layer does, when
    /// there is a window).
    pub sliding_layers: Option<Vec<bool>>,
    /// RoPE base of the sliding-window layers, with no scaling (Gemma 3's
    /// rope_local_base_freq); None: the model's own.
    pub local_rope_theta: Option<f64>,
    /// The attention's output projection has a bias (gpt-oss).
    pub out_bias: bool,
    /// A learned logit per head joins each attention softmax's denominator (gpt-oss's sinks).
    pub attn_sinks: bool,
    /// The query projection also gives a gate per output element: attention's output is
    /// multiplied by its sigmoid (Qwen3.5).
    pub attn_gate: bool,
    /// RoPE rotates only the first `n` elements of each head (partial rotary); None: all.
    pub rotary_dim: Option<usize>,
    /// Each value head is RMS-normed (no weight) before the cache (Gemma 4's v_norm).
    pub v_norm: bool,
    /// Each layer's output (the residual) is multiplied by a learned scalar (Gemma 4).
    pub layer_scalar: bool,
    /// Per-layer embeddings (Gemma 4 E2B/E4B, model/blocks/ple.rs): floats per layer and token, and the
    /// rows of their token table; None: none.
    pub ple: Option<(usize, usize)>,
    /// The last `n` layers compute no keys or values: each attends over the cache of the last
    /// earlier layer of its kind (Gemma 4's num_kv_shared_layers).
    pub kv_shared: usize,
    /// The KV-sharing layers' FFNs are twice as wide (Gemma 4's use_double_wide_mlp).
    pub double_wide: bool,
}

/// HF's `layer_types`: per layer whether it is `sliding_attention` (else `full_attention`);
/// None when the config has no such list.
pub(crate) fn layer_types(v: &Value, src: &str) -> Result<Option<Vec<bool>>> {
    let Some(types) = v["layer_types"].as_array() else { return Ok(None) };
    let kinds: Option<Vec<bool>> = types
        .iter()
        .map(|t| match t.as_str() {
            Some("sliding_attention") => Some(true),
            Some("full_attention") => Some(false),
            _ => None,
        })
        .collect();
    kinds
        .map(Some)
        .ok_or_else(|| anyhow!("{src}: layer_types holds a kind other than sliding_attention / full_attention"))
}

/// The attention geometry of a layer: query heads, KV heads and the head size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AttnGeom {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl AttnGeom {
    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }
    /// Floats per token of the q/k/v rows.
    pub fn qkv_dim(&self) -> usize {
        self.q_dim() + 2 * self.kv_dim()
    }
    /// (heads, KV heads, head size).
    pub fn dims(&self) -> (usize, usize, usize) {
        (self.heads, self.kv_heads, self.head_dim)
    }
    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads.max(1)
    }
}

/// The full-attention layers' own geometry where it differs from the sliding-window layers'
/// (Gemma 4: 512-wide heads, fewer KV heads, keys that are also the values).
#[derive(Clone, Debug, PartialEq)]
pub struct FullAttn {
    pub kv_heads: usize,
    pub head_dim: usize,
    /// The key projection's output is the value too (no v_proj: Gemma 4's attention_k_eq_v).
    pub k_eq_v: bool,
}

#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub vocab: usize,
    pub rope_theta: f64,
    pub rms_eps: f32,
    pub max_positions: usize,
    /// q/k/v projections carry a bias (Qwen2).
    pub qkv_bias: bool,
    pub rope_scaling: RopeScaling,
    /// Attention sees only the last `n` positions (Mistral's sliding window), when set.
    pub sliding_window: Option<usize>,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Where the layers differ from Llama's (Gemma).
    pub style: LayerStyle,
    /// The mixture-of-experts layers (Qwen3-MoE), or None for a dense model.
    pub moe: Option<super::blocks::moe::MoeConfig>,
    /// The recurrent (Gated DeltaNet) layers of a hybrid model (Qwen3.5), or None.
    pub linear: Option<super::blocks::delta_net::LinearConfig>,
    /// The full-attention layers' own geometry (Gemma 4), or None: every attention layer has
    /// heads x head_dim with kv_heads.
    pub full_attn: Option<FullAttn>,
}

impl ModelConfig {
    /// The model's family (its row of the families' table).
    pub fn family(&self) -> &'static Family {
        self.arch.family()
    }

    /// The geometry of the model's attention layers (of the sliding-window ones where the
    /// full-attention layers have their own).
    pub fn base_geom(&self) -> AttnGeom {
        AttnGeom { heads: self.heads, kv_heads: self.kv_heads, head_dim: self.head_dim }
    }

    /// The attention geometry of layer `l`.
    pub fn geom(&self, l: usize) -> AttnGeom {
        match &self.full_attn {
            Some(f) if self.layer_window(l).is_none() => {
                AttnGeom { heads: self.heads, kv_heads: f.kv_heads, head_dim: f.head_dim }
            }
            _ => self.base_geom(),
        }
    }

    /// Every attention geometry the model's layers have, in order (one for most models).
    pub fn geoms(&self) -> Vec<AttnGeom> {
        let mut g: Vec<AttnGeom> = (0..self.layers).filter(|&l| !self.is_linear(l)).map(|l| self.geom(l)).collect();
        g.push(self.base_geom());
        g.sort();
        g.dedup();
        g
    }

    /// Whether layer `l`'s keys are its values too (Gemma 4's full-attention layers).
    pub fn k_eq_v(&self, l: usize) -> bool {
        self.full_attn.as_ref().is_some_and(|f| f.k_eq_v) && self.layer_window(l).is_none()
    }

    /// The layer whose KV cache layer `l` attends over when it computes no keys or values of its
    /// own (Gemma 4's KV sharing): the last layer of its kind before the sharing ones. None: its
    /// own.
    pub fn kv_source(&self, l: usize) -> Option<usize> {
        let first = self.layers - self.style.kv_shared.min(self.layers);
        if l < first || self.is_linear(l) {
            return None;
        }
        let sliding = self.layer_window(l).is_some();
        (0..first).rev().find(|&p| !self.is_linear(p) && self.layer_window(p).is_some() == sliding)
    }

    /// Layer `l`'s FFN width (twice the model's on Gemma 4's double-wide KV-sharing layers).
    pub fn layer_ffn(&self, l: usize) -> usize {
        if self.style.double_wide && self.kv_source(l).is_some() {
            2 * self.intermediate
        } else {
            self.intermediate
        }
    }

    /// The widest layer's q floats per token.
    pub fn q_dim(&self) -> usize {
        self.geoms().iter().map(|g| g.q_dim()).max().unwrap_or(0)
    }
    /// The widest layer's K (or V) floats per token.
    pub fn kv_dim(&self) -> usize {
        self.geoms().iter().map(|g| g.kv_dim()).max().unwrap_or(0)
    }
    /// The widest layer's q/k/v floats per token.
    pub fn qkv_dim(&self) -> usize {
        self.geoms().iter().map(|g| g.qkv_dim()).max().unwrap_or(0)
    }

    /// Floats per token of the FFN's activations: the dense intermediate size, or the top_k
    /// experts' (a mixture of experts).
    pub fn act_width(&self) -> usize {
        let dense = (0..self.layers).map(|l| self.layer_ffn(l)).max().unwrap_or(0).max(self.ple_dim());
        self.moe.as_ref().map_or(dense, |m| dense.max(m.top_k * m.ffn).max(m.shared_ffn))
    }

    /// Floats per layer and token of the per-layer embeddings (0: none).
    pub fn ple_dim(&self) -> usize {
        self.style.ple.map_or(0, |(d, _)| d)
    }

    /// Whether layer `l` is a recurrent (linear-attention) layer.
    pub fn is_linear(&self, l: usize) -> bool {
        self.linear.as_ref().is_some_and(|c| c.layers.get(l).copied().unwrap_or(false))
    }

    /// Layers with attention (and a KV cache) among `range`.
    pub fn attn_layers_in(&self, range: std::ops::Range<usize>) -> usize {
        range.filter(|&l| !self.is_linear(l)).count()
    }

    /// Elements of each head that RoPE rotates on the full-attention layers (the model's RoPE
    /// table): the rotary part, or the full-attention layers' whole head (Gemma 4).
    pub fn rope_dim(&self) -> usize {
        match &self.full_attn {
            Some(f) => f.head_dim,
            None => self.style.rotary_dim.unwrap_or(self.head_dim),
        }
    }

    /// Elements of each head that RoPE rotates on layer `l`: the sliding-window layers with a
    /// table of their own (`local_rope_theta`) rotate their whole head.
    pub fn layer_rope_dim(&self, l: usize) -> usize {
        if self.style.local_rope_theta.is_some() && self.layer_window(l).is_some() {
            self.head_dim
        } else {
            self.rope_dim()
        }
    }

    /// The window layer `l` attends within (None: every earlier position).
    pub fn layer_window(&self, l: usize) -> Option<usize> {
        match &self.style.sliding_layers {
            Some(s) if !s.get(l).copied().unwrap_or(false) => None,
            _ => self.sliding_window,
        }
    }

    /// The window when every layer has it (then blocks that left it can be freed), else None.
    pub fn uniform_window(&self) -> Option<usize> {
        let all = self.style.sliding_layers.as_ref().is_none_or(|s| s.iter().all(|&w| w));
        self.sliding_window.filter(|_| all)
    }

    pub fn validate(&self, src: &str) -> Result<()> {
        let bad = |what: String| Err(anyhow!("{src}: {what}"));
        if self.hidden == 0 || self.layers == 0 || self.heads == 0 || self.kv_heads == 0 || self.vocab == 0 {
            return bad("hidden size, layers, heads, kv heads and vocab must be positive".into());
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return bad(format!("{} attention heads is not a multiple of {} kv heads", self.heads, self.kv_heads));
        }
        if !self.head_dim.is_multiple_of(4) || self.head_dim == 0 {
            return bad(format!("head_dim {} must be a positive multiple of 4", self.head_dim));
        }
        for (name, v) in [("hidden_size", self.hidden), ("intermediate_size", self.intermediate)] {
            if v % 32 != 0 {
                return bad(format!("{name} {v} must be a multiple of 32"));
            }
        }
        let dense_layers = self.moe.as_ref().map_or(self.layers, |m| m.sparse_layers.iter().filter(|s| !**s).count());
        if dense_layers > 0 && self.intermediate == 0 {
            return bad("intermediate_size must be positive".into());
        }
        if let Some(m) = &self.moe {
            m.validate(self.layers, src)?;
        }
        if self.sliding_window == Some(0) {
            return bad("sliding_window must be positive".into());
        }
        if let Some(s) = &self.style.sliding_layers {
            if s.len() != self.layers {
                return bad(format!("{} per-layer attention kinds for {} layers", s.len(), self.layers));
            }
        }
        let positive = |x: Option<f32>| x.is_none_or(|x| x > 0.0 && x.is_finite());
        let st = &self.style;
        if !(positive(st.embed_scale)
            && positive(st.attn_scale)
            && positive(st.attn_softcap)
            && positive(st.final_softcap))
            || st.local_rope_theta.is_some_and(|t| !(t > 1.0 && t.is_finite()))
        {
            return bad("scales, soft caps and RoPE bases must be positive and finite".into());
        }
        if let RopeScaling::Freqs(f) = &self.rope_scaling {
            if f.len() != self.rope_dim() / 2 || f.iter().any(|x| !(*x > 0.0 && x.is_finite())) {
                return bad(format!("rope_freqs must hold {} positive factors", self.rope_dim() / 2));
            }
        }
        if let Some(r) = self.style.rotary_dim {
            if r == 0 || r > self.head_dim || !r.is_multiple_of(4) {
                return bad(format!("the rotary dimensions {r} must be a positive multiple of 4 up to head_dim"));
            }
        }
        if let Some(l) = &self.linear {
            l.validate(self.layers, src)?;
        }
        if let Some(f) = &self.full_attn {
            if f.kv_heads == 0
                || !self.heads.is_multiple_of(f.kv_heads)
                || f.head_dim == 0
                || !f.head_dim.is_multiple_of(4)
            {
                return bad(format!(
                    "the full-attention layers' {} KV heads of {} must divide the {} heads, and their size be a multiple of 4",
                    f.kv_heads, f.head_dim, self.heads
                ));
            }
            if f.head_dim > 1024 {
                return bad(format!("the full-attention layers' head size {} is above 1024", f.head_dim));
            }
        }
        if self.style.kv_shared > 0
            && (0..self.layers).any(|l| self.kv_source(l).is_none() && l + self.style.kv_shared >= self.layers)
        {
            return bad(format!(
                "{} KV-sharing layers leave a kind of layer with no layer to read",
                self.style.kv_shared
            ));
        }
        if let Some((d, v)) = self.style.ple {
            if d == 0 || !d.is_multiple_of(4) || v == 0 {
                return bad(format!("per-layer embeddings of {d} floats over {v} tokens"));
            }
        }
        if let RopeScaling::Proportional { pairs } = self.rope_scaling {
            if pairs > self.rope_dim() / 2 {
                return bad(format!("{pairs} rotated pairs of a {}-wide head", self.rope_dim()));
            }
        }
        if !self.q_dim().is_multiple_of(32) {
            return bad(format!("heads * head_dim = {} must be a multiple of 32", self.q_dim()));
        }
        Ok(())
    }

    /// Parses a Hugging Face config.json (the architectures of model/families/).
    pub fn from_hf_json(path: &Path) -> Result<ModelConfig> {
        let src = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| anyhow!("{src}: {e}"))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| anyhow!("{src}: invalid JSON: {e}"))?;
        let archs = v["architectures"].as_array().cloned().unwrap_or_default();
        // A multimodal checkpoint's language model has its own config (Qwen3.5's text_config).
        let v = match v.get("text_config") {
            Some(t) if t.is_object() => merged_text_config(&v, t),
            _ => v,
        };
        let arch_name = archs.first().and_then(|a| a.as_str()).unwrap_or("");
        if arch_name.is_empty() {
            bail!("{src}: field 'architectures' is missing");
        }
        let family = super::families::by_hf(arch_name).ok_or_else(|| {
            anyhow!(
                "{src}: unsupported architecture {arch_name} (supported: {})",
                super::families::hf_names_supported()
            )
        })?;
        let arch = family.arch;
        let int = |k: &str| -> Result<usize> {
            v[k].as_u64().map(|x| x as usize).ok_or_else(|| anyhow!("{src}: field '{k}' is missing or not an integer"))
        };
        let hidden = int("hidden_size")?;
        let heads = int("num_attention_heads")?;
        let kv_heads = v["num_key_value_heads"].as_u64().map(|x| x as usize).unwrap_or(heads);
        let head_dim = v["head_dim"].as_u64().map(|x| x as usize).unwrap_or(hidden / heads.max(1));
        let rope_theta =
            v["rope_theta"].as_f64().or_else(|| v["rope_parameters"]["rope_theta"].as_f64()).unwrap_or(10000.0);
        let max_positions = v["max_position_embeddings"].as_u64().unwrap_or(4096) as usize;
        // Newer transformers write `rope_parameters` (with rope_theta and rope_type), older
        // `rope_scaling`; a non-default type in either counts.
        let scaling_obj =
            [&v["rope_scaling"], &v["rope_parameters"]].into_iter().filter_map(|x| x.as_object()).find(|o| {
                o.get("rope_type").or_else(|| o.get("type")).and_then(|t| t.as_str()).is_some_and(|t| t != "default")
            });
        let rope_scaling = RopeScaling::from_hf(scaling_obj, max_positions as f64, &src)?;
        let cfg = ModelConfig {
            arch,
            hidden,
            layers: int("num_hidden_layers")?,
            heads,
            kv_heads,
            head_dim,
            // Qwen3.5-MoE's configs give only the experts' sizes.
            intermediate: match v["num_experts"].as_u64() {
                Some(_) if v["intermediate_size"].is_null() => 0,
                _ => int("intermediate_size")?,
            },
            vocab: int("vocab_size")?,
            rope_theta,
            rms_eps: v["rms_norm_eps"].as_f64().unwrap_or(1e-6) as f32,
            max_positions,
            qkv_bias: family.qkv_bias || v["attention_bias"].as_bool().unwrap_or(false),
            rope_scaling,
            sliding_window: None,
            qk_norm: family.qk_norm,
            style: LayerStyle::default(),
            moe: None,
            linear: None,
            full_attn: None,
        };
        let cfg = (family.hf_config)(cfg, &v, &src)?;
        cfg.validate(&src)?;
        Ok(cfg)
    }
}

/// The text model's config of a multimodal checkpoint: `text_config` with the top level's
/// `architectures` (and its tie_word_embeddings where the text config has none).
pub(crate) fn merged_text_config(top: &Value, text: &Value) -> Value {
    let mut t = text.clone();
    if let Some(o) = t.as_object_mut() {
        o.insert("architectures".into(), top["architectures"].clone());
        if !o.contains_key("tie_word_embeddings") {
            o.insert("tie_word_embeddings".into(), top["tie_word_embeddings"].clone());
        }
    }
    t
}
