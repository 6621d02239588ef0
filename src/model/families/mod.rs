//! The model families, one recipe file each, and the table that lists them ([`FAMILIES`]).
//!
//! A family is a value ([`Family`]) that says everything the rest of the model room asks of an
//! architecture: the names it answers to in a Hugging Face config.json and in a GGUF file, what
//! its config says beyond the fields every family has (into `ModelConfig`'s `LayerStyle`, its
//! mixture of experts, its recurrent layers), and its tensor names in either source (its
//! experts' names and layout among them: one loader, model/blocks/experts.rs, reads them all). The config parsers, the loaders and the layer
//! loop read this table; none of them names a family. The layers themselves are the shared
//! recipe (model/recipe.rs) driven by the config's data, with the shared blocks in
//! model/blocks/ (mixture of experts, the Gated DeltaNet, per-layer embeddings, the MTP head).
//!
//! Adding a family: a file here with its `Family` value (its configs and names), a row in
//! [`FAMILIES`], an `Arch` variant; its synthetic shapes (`Family::synth`) where a real model of it is worth
//! measuring without its files.

use super::config::ModelConfig;
use super::layers::{TensorNames, WeightSource, GGUF_NAMES, HF_NAMES};
use super::synth::{SynthShape, SynthTensor};
use crate::formats::gguf::{GgufFile, GgufValue};
use crate::gpu::wformat::WFormat;
use anyhow::Result;
use serde_json::Value;

pub use gemma4::synth::SynthGemma4;
pub use qwen35::synth::SynthLinear;

pub mod gemma;
pub mod gemma4;
pub mod gptoss;
pub mod llama;
pub mod phi3;
pub mod qwen;
pub mod qwen35;

/// Which family a model is (the key of [`FAMILIES`]; what a family is lies in its [`Family`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    /// Llama's layers with an optional sliding attention window.
    Mistral,
    /// Qwen2 without q/k/v biases, with per-head RMSNorm of q and k before RoPE.
    Qwen3,
    /// Qwen3's attention with mixture-of-experts FFNs (model/blocks/moe.rs), dense on the layers
    /// its config names.
    Qwen3Moe,
    /// Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (QKV bias) with a mixture of
    /// experts beside a gated shared expert.
    Qwen2Moe,
    /// Gemma 2: scaled embeddings, norms before and after attention and the FFN, GeGLU,
    /// soft-capped attention scores and logits, sliding-window and global layers alternating.
    Gemma2,
    /// Gemma 3: Gemma 2's layers without the soft caps, with Qwen3's q/k norms, five
    /// sliding-window layers (their own RoPE base) to one global.
    Gemma3,
    /// gpt-oss (families/gptoss.rs): biased attention with sinks, alternating sliding-window and
    /// full layers, YaRN, a mixture of experts with the clamped SwiGLU on every layer.
    GptOss,
    /// Qwen3.5 (families/qwen35.rs): Gated DeltaNet layers with a gated full-attention layer
    /// every few, partial RoPE, zero-centred norms.
    Qwen35,
    /// Gemma 4 (families/gemma4.rs): Gemma 3's layers with full-attention layers of their own
    /// geometry (wider heads, keys as values, proportional RoPE), plain-weight norms, a v norm,
    /// unscaled scores and a scalar per layer.
    Gemma4,
    /// Phi-3 and Phi-4-mini (families/phi3.rs): Llama's layers with fused q/k/v and gate/up
    /// tensors, partial RoPE (Phi-4-mini), a sliding window on every layer where given.
    Phi3,
}

/// What the engine asks of a family.
pub struct Family {
    pub arch: Arch,
    /// The `architectures` of a Hugging Face config.json it answers to.
    pub hf_archs: &'static [&'static str],
    /// The `general.architecture` of a GGUF file it answers to (the first is written for a dense
    /// model, the second, where there is one, for a mixture of experts).
    pub gguf_archs: &'static [&'static str],
    /// q/k/v projections carry a bias whatever the config says.
    pub qkv_bias: bool,
    /// Per-head RMSNorm of q and k before RoPE.
    pub qk_norm: bool,
    /// A GGUF file may give no dense FFN size (every layer a mixture of experts).
    pub ffn_optional: bool,
    /// What a config.json says beyond the fields every family has (`cfg`, read by
    /// `ModelConfig::from_hf_json`); `src` names the file in errors.
    pub(crate) hf_config: fn(ModelConfig, &Value, &str) -> Result<ModelConfig>,
    /// The same for a GGUF file's metadata (its keys start with the file's architecture name).
    pub(crate) gguf_config: fn(ModelConfig, &GgufFile, &str) -> Result<ModelConfig>,
    /// The Hugging Face tensor names of the checkpoint `w` (a multimodal checkpoint's language
    /// model has names of its own).
    pub(crate) hf_names: fn(&dyn WeightSource) -> &'static TensorNames,
    /// Hugging Face checkpoints store the RMSNorm weights less one (1 + w is added at load).
    pub hf_add_one: bool,
    pub(crate) gguf_names: &'static TensorNames,
    /// llama.cpp's converter stores the q/k rows permuted for interleaved RoPE (put back at load).
    pub gguf_unpermute_qk: bool,
    /// A dense FFN runs beside the experts on every sparse layer (model/blocks/parallel_moe.rs).
    pub dense_beside_experts: bool,
    /// Its synthetic models (model/synth.rs writes them).
    pub synth: SynthLayout,
}

/// Writes layer `l` of a synthetic file of `layers` layers.
pub type SynthLayer = fn(&SynthShape, WFormat, usize, usize) -> Vec<SynthTensor>;

/// A family's synthetic models: the named shapes of its real models, and where its files differ
/// from the common layers (attention, then a gated FFN or experts) that model/synth.rs writes.
pub struct SynthLayout {
    pub shapes: &'static [SynthEntry],
    /// Layer `l`'s tensors of a file of `layers` layers, where the family's layers are not the
    /// common ones.
    pub layer: Option<SynthLayer>,
    /// Tensors after the layers (of a file of `layers` layers), before the final norm.
    pub globals: fn(&SynthShape, WFormat, usize) -> Vec<SynthTensor>,
    /// Metadata keys of a file of `layers` layers, in place of the common keys of the same name.
    pub metadata: fn(&SynthShape, usize) -> Vec<(String, GgufValue)>,
    /// The common attention's output projection has a bias and each head a sink logit.
    pub out_bias_sinks: bool,
    /// The experts' format whatever the file's other matrices are (but in an all-F32 file).
    pub expert_format: Option<WFormat>,
    /// The router and every expert's projections have biases.
    pub expert_biases: bool,
}

/// A named synthetic shape: the real model's, and its tiny variant (model/synth_tiny.rs) from
/// the common tiny base (which keeps the real shape's other fields), with its layer count.
pub struct SynthEntry {
    pub name: &'static str,
    pub shape: fn() -> SynthShape,
    pub tiny: fn(SynthShape) -> (SynthShape, usize),
}

/// The common layers and no named shapes.
const NO_SYNTH: SynthLayout = SynthLayout {
    shapes: &[],
    layer: None,
    globals: |_, _, _| Vec::new(),
    metadata: |_, _| Vec::new(),
    out_bias_sinks: false,
    expert_format: None,
    expert_biases: false,
};

/// The names of a multimodal wrapper's language model (`model.language_model.*`), the text
/// model's `text` otherwise.
pub(crate) const fn language_model(text: TensorNames) -> TensorNames {
    TensorNames {
        embed: "model.language_model.embed_tokens.weight",
        final_norm: "model.language_model.norm.weight",
        layer: "model.language_model.layers.{l}",
        ..text
    }
}

/// The names of a checkpoint that is either a multimodal wrapper (`vl`, recognised by its
/// embedding's name) or the text model alone (`text`).
pub(crate) fn vl_or_text(
    w: &dyn WeightSource,
    vl: &'static TensorNames,
    text: &'static TensorNames,
) -> &'static TensorNames {
    if w.has(vl.embed) {
        vl
    } else {
        text
    }
}

fn same_config<S: ?Sized>(cfg: ModelConfig, _: &S, _: &str) -> Result<ModelConfig> {
    Ok(cfg)
}

/// Llama's answers; families state where they differ.
pub(crate) const BASE: Family = Family {
    arch: Arch::Llama,
    hf_archs: &[],
    gguf_archs: &[],
    qkv_bias: false,
    qk_norm: false,
    ffn_optional: false,
    hf_config: same_config::<Value>,
    gguf_config: same_config::<GgufFile>,
    hf_names: |_| &HF_NAMES,
    hf_add_one: false,
    gguf_names: &GGUF_NAMES,
    gguf_unpermute_qk: false,
    dense_beside_experts: false,
    synth: NO_SYNTH,
};

/// Every family.
pub static FAMILIES: [&Family; 12] = [
    &llama::LLAMA,
    &llama::MISTRAL,
    &qwen::QWEN2,
    &qwen::QWEN3,
    &qwen::QWEN2_MOE,
    &qwen::QWEN3_MOE,
    &gemma::GEMMA2,
    &gemma::GEMMA3,
    &gptoss::GPTOSS,
    &qwen35::QWEN35,
    &gemma4::GEMMA4,
    &phi3::PHI3,
];

impl Arch {
    /// The family's row of [`FAMILIES`].
    pub fn family(self) -> &'static Family {
        FAMILIES.iter().find(|f| f.arch == self).expect("every Arch has a row in FAMILIES")
    }
}

/// The family of a config.json's `architectures` entry.
pub fn by_hf(name: &str) -> Option<&'static Family> {
    FAMILIES.iter().copied().find(|f| f.hf_archs.contains(&name))
}

/// The family of a GGUF file's `general.architecture`.
pub fn by_gguf(name: &str) -> Option<&'static Family> {
    FAMILIES.iter().copied().find(|f| f.gguf_archs.contains(&name))
}

/// The Hugging Face architectures this engine runs, for errors.
pub fn hf_names_supported() -> String {
    FAMILIES.iter().flat_map(|f| f.hf_archs.iter().copied()).collect::<Vec<_>>().join(", ")
}

/// The GGUF architectures this engine runs, for errors.
pub fn gguf_names_supported() -> String {
    FAMILIES.iter().flat_map(|f| f.gguf_archs.iter().copied()).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_belongs_to_one_family() {
        for (i, f) in FAMILIES.iter().enumerate() {
            assert_eq!(f.arch.family().arch, f.arch);
            for g in &FAMILIES[i + 1..] {
                assert_ne!(f.arch, g.arch);
                assert!(f.hf_archs.iter().all(|n| !g.hf_archs.contains(n)), "{n:?}", n = f.hf_archs);
                assert!(f.gguf_archs.iter().all(|n| !g.gguf_archs.contains(n)), "{n:?}", n = f.gguf_archs);
            }
        }
        assert_eq!(by_gguf("llama").map(|f| f.arch), Some(Arch::Llama));
        assert_eq!(by_hf("MistralForCausalLM").map(|f| f.arch), Some(Arch::Mistral));
        assert!(by_hf("DeepseekV3ForCausalLM").is_none());
    }
}
