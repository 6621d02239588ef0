//! Llama 3.x and Mistral: the dense recipe as it is (model/recipe.rs), with Mistral's sliding
//! window where its config gives one. Mistral's GGUF files say `llama`; llama.cpp's converter
//! stores their q/k rows permuted for interleaved RoPE, put back in Hugging Face order at load.

use super::{Arch, Family, SynthEntry, SynthLayout, BASE};
use crate::model::config::ModelConfig;
use crate::model::synth::SynthShape;
use anyhow::Result;
use serde_json::Value;

pub(crate) const LLAMA: Family = Family {
    arch: Arch::Llama,
    hf_archs: &["LlamaForCausalLM"],
    gguf_archs: &["llama"],
    gguf_unpermute_qk: true,
    synth: SynthLayout {
        shapes: &[
            SynthEntry {
                name: "smollm2-135m",
                shape: || synth_llama("smollm2-135m", [576, 9, 3, 1536, 49152, 30], true, 100000.0, "smollm"),
                tiny: |base| (base, 2),
            },
            SynthEntry {
                name: "llama-3-8b",
                shape: || synth_llama("llama-3-8b", [4096, 32, 8, 14336, 128256, 32], false, 500000.0, "llama-bpe"),
                tiny: |base| (base, 2),
            },
        ],
        ..BASE.synth
    },
    ..BASE
};

/// A Llama-style synthetic shape (`dims` as `SynthShape::dense` takes them): RMS epsilon 1e-5,
/// 8192 positions, the real model's RoPE base and pre-tokenizer.
pub(crate) fn synth_llama(
    name: &'static str,
    dims: [usize; 6],
    tied: bool,
    rope_theta: f32,
    pre_tokenizer: &'static str,
) -> SynthShape {
    SynthShape {
        rope_theta,
        rms_eps: 1e-5,
        context_length: 8192,
        pre_tokenizer,
        ..SynthShape::dense(Arch::Llama, name, dims, tied)
    }
}

pub(crate) const MISTRAL: Family =
    Family { arch: Arch::Mistral, hf_archs: &["MistralForCausalLM"], hf_config: mistral_hf, ..BASE };

/// Mistral's window applies to every layer whenever its config gives one.
fn mistral_hf(mut cfg: ModelConfig, v: &Value, _: &str) -> Result<ModelConfig> {
    cfg.sliding_window = v["sliding_window"].as_u64().map(|w| w as usize);
    Ok(cfg)
}
