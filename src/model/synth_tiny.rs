//! Tiny variants of the synthetic shapes: the same layer kinds, names and metadata as the full
//! shape (model/synth.rs), at a width where F32 weights are cheap (hidden 256, heads of 64, a
//! 2048-token vocabulary, a few layers): for the isolation tests and the comparison with
//! llama.cpp (scripts/llama-compare.sh), where quantization noise would hide a real difference.

use super::synth::{synth_entry, SynthMoe, SynthShape};

/// The vocabulary of every tiny variant (its last three ids are the synthetic tokenizer's
/// special tokens).
pub const TINY_VOCAB: usize = 2048;

/// The experts of every tiny mixture: 8 of 256, 2 per token.
pub const TINY_EXPERTS: SynthMoe = SynthMoe { experts: 8, top_k: 2, ffn: 256 };

/// The tiny variant of shape `name` and its layer count, or None for an unknown shape: the
/// common base (hidden 256, 4 heads / 2 KV heads of 64, FFN 512, the tiny vocabulary, the real
/// shape's other fields) made the family's way (`SynthEntry::tiny`: two layers unless it says
/// otherwise, its own experts, recurrent or global layers at a tiny size).
pub fn tiny_shape(name: &str) -> Option<(SynthShape, usize)> {
    let entry = synth_entry(name)?;
    let real = (entry.shape)();
    let base =
        SynthShape { hidden: 256, heads: 4, kv_heads: 2, head_dim: 64, intermediate: 512, vocab: TINY_VOCAB, ..real };
    let (shape, layers) = (entry.tiny)(base);
    // The tiny variant is a shape of its own depth (Gemma 4's shared layers count from it).
    Some((SynthShape { layers, ..shape }, layers))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_shape_has_a_tiny_variant_of_its_own_kinds() {
        for name in &super::super::synth::synth_shape_names() {
            let (real, (tiny, layers)) = (super::super::synth::synth_shape(name).unwrap(), tiny_shape(name).unwrap());
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
