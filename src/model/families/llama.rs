//! Llama 3.x and Mistral: the dense recipe as it is (model/recipe.rs), with Mistral's sliding
//! window where its config gives one. Mistral's GGUF files say `llama`; llama.cpp's converter
//! stores their q/k rows permuted for interleaved RoPE, put back in Hugging Face order at load.

use super::{Arch, Family, BASE};
use crate::model::config::ModelConfig;
use anyhow::Result;
use serde_json::Value;

pub(crate) const LLAMA: Family = Family {
    arch: Arch::Llama,
    hf_archs: &["LlamaForCausalLM"],
    gguf_archs: &["llama"],
    gguf_unpermute_qk: true,
    ..BASE
};

pub(crate) const MISTRAL: Family =
    Family { arch: Arch::Mistral, hf_archs: &["MistralForCausalLM"], hf_config: mistral_hf, ..BASE };

/// Mistral's window applies to every layer whenever its config gives one.
fn mistral_hf(mut cfg: ModelConfig, v: &Value, _: &str) -> Result<ModelConfig> {
    cfg.sliding_window = v["sliding_window"].as_u64().map(|w| w as usize);
    Ok(cfg)
}
