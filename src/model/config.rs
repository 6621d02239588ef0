//! Model hyper-parameters, read from a Hugging Face config.json or GGUF metadata.

use anyhow::{anyhow, bail, Result};
use serde_json::Value;
use std::path::Path;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
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
}

impl ModelConfig {
    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }
    pub fn qkv_dim(&self) -> usize {
        self.q_dim() + 2 * self.kv_dim()
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
        if !self.q_dim().is_multiple_of(32) {
            return bad(format!("heads * head_dim = {} must be a multiple of 32", self.q_dim()));
        }
        Ok(())
    }

    /// Parses a Hugging Face config.json (LlamaForCausalLM, Qwen2ForCausalLM).
    pub fn from_hf_json(path: &Path) -> Result<ModelConfig> {
        let src = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| anyhow!("{src}: {e}"))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| anyhow!("{src}: invalid JSON: {e}"))?;
        let archs = v["architectures"].as_array().cloned().unwrap_or_default();
        let arch_name = archs.first().and_then(|a| a.as_str()).unwrap_or("");
        let arch = match arch_name {
            "LlamaForCausalLM" => Arch::Llama,
            "Qwen2ForCausalLM" => Arch::Qwen2,
            "" => bail!("{src}: field 'architectures' is missing"),
            other => bail!("{src}: unsupported architecture {other} (supported: LlamaForCausalLM, Qwen2ForCausalLM)"),
        };
        let int = |k: &str| -> Result<usize> {
            v[k].as_u64().map(|x| x as usize).ok_or_else(|| anyhow!("{src}: field '{k}' is missing or not an integer"))
        };
        let hidden = int("hidden_size")?;
        let heads = int("num_attention_heads")?;
        let kv_heads = v["num_key_value_heads"].as_u64().map(|x| x as usize).unwrap_or(heads);
        let head_dim = v["head_dim"].as_u64().map(|x| x as usize).unwrap_or(hidden / heads.max(1));
        let rope_theta =
            v["rope_theta"].as_f64().or_else(|| v["rope_parameters"]["rope_theta"].as_f64()).unwrap_or(10000.0);
        if let Some(t) = v["rope_scaling"].as_object() {
            let kind = t.get("rope_type").or_else(|| t.get("type")).and_then(|x| x.as_str()).unwrap_or("");
            if kind != "default" && !kind.is_empty() {
                bail!("{src}: rope_scaling type '{kind}' is not supported");
            }
        }
        let cfg = ModelConfig {
            arch,
            hidden,
            layers: int("num_hidden_layers")?,
            heads,
            kv_heads,
            head_dim,
            intermediate: int("intermediate_size")?,
            vocab: int("vocab_size")?,
            rope_theta,
            rms_eps: v["rms_norm_eps"].as_f64().unwrap_or(1e-6) as f32,
            max_positions: v["max_position_embeddings"].as_u64().unwrap_or(4096) as usize,
            qkv_bias: arch == Arch::Qwen2 || v["attention_bias"].as_bool().unwrap_or(false),
        };
        cfg.validate(&src)?;
        Ok(cfg)
    }
}
