//! Tiny variants of the synthetic shapes: the same layer kinds, names and metadata as the full
//! shape (model/synth.rs), at a width where F32 weights are cheap (hidden 256, heads of 64, a
//! 2048-token vocabulary, a few layers): for the isolation tests and the comparison with
//! llama.cpp (scripts/llama-compare.sh), where quantization noise would hide a real difference.

use super::synth::{synth_shape, SynthMoe, SynthShape};
use super::synth_gemma4::SynthGemma4;
use super::synth_hybrid::SynthLinear;

/// The vocabulary of every tiny variant (its last three ids are the synthetic tokenizer's
/// special tokens).
pub const TINY_VOCAB: usize = 2048;

/// The tiny variant of shape `name` and its layer count, or None for an unknown shape. Hybrids
/// keep Qwen3.5's key and value heads of 128 (one key head, two value heads; llama.cpp reads one
/// size for both) and four layers (three Gated DeltaNet, one attention); mixtures have 8 experts
/// of 256 with 2 per token; Gemma 4 twelve layers (two global of 128 per head, a window of 8,
/// per-layer embeddings of 32, the last six reading the caches of layers 4 and 5).
pub fn tiny_shape(name: &str) -> Option<(SynthShape, usize)> {
    let real = synth_shape(name)?;
    let base =
        SynthShape { hidden: 256, heads: 4, kv_heads: 2, head_dim: 64, intermediate: 512, vocab: TINY_VOCAB, ..real };
    let experts = SynthMoe { experts: 8, top_k: 2, ffn: 256 };
    let lin = |l: SynthLinear| SynthLinear { k_heads: 1, v_heads: 2, k_dim: 128, v_dim: 128, rotary_dim: 16, ..l };
    let (shape, layers) = match name {
        "qwen3.5-9b" | "qwen3.6-35b-a3b" => {
            (SynthShape { linear: real.linear.map(lin), moe: real.moe.map(|_| experts), ..base }, 4)
        }
        "qwen3-30b-a3b" => (SynthShape { moe: Some(experts), ..base }, 2),
        "gpt-oss-20b" => (SynthShape { heads: 8, intermediate: 256, moe: Some(experts), ..base }, 2),
        "gemma-4-e4b" => {
            let gemma4 = SynthGemma4 { global_head_dim: 128, ple: 32, window: 8, kv_shared: 6 };
            (SynthShape { gemma4: Some(gemma4), ..base }, 12)
        }
        _ => (base, 2),
    };
    // The tiny variant is a shape of its own depth (Gemma 4's shared layers count from it).
    Some((SynthShape { layers, ..shape }, layers))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_shape_has_a_tiny_variant_of_its_own_kinds() {
        for name in super::super::synth::SYNTH_SHAPES {
            let (real, (tiny, layers)) = (synth_shape(name).unwrap(), tiny_shape(name).unwrap());
            assert_eq!((tiny.arch, tiny.name, tiny.tied, tiny.vocab), (real.arch, real.name, real.tied, TINY_VOCAB));
            assert_eq!(
                (tiny.moe.is_some(), tiny.linear.is_some(), tiny.gemma4.is_some()),
                (real.moe.is_some(), real.linear.is_some(), real.gemma4.is_some()),
                "{name}"
            );
            assert!(layers >= 2 && layers <= real.layers && tiny.layers == layers, "{name}");
            if let Some(g) = tiny.gemma4 {
                assert_eq!(g.shared(layers, tiny.layers), 6);
            }
        }
        assert!(tiny_shape("gpt-5").is_none());
    }
}
