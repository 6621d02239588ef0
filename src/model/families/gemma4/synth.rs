//! Synthetic Gemma 4 files (the E2B/E4B layout) as llama.cpp's converter writes them (model/
//! gemma4.rs and model/blocks/ple.rs read them back): sliding-window layers of `head_dim` and every
//! sixth layer global with its own head size, the last layers reading earlier layers' caches,
//! per-layer embeddings, a scalar per layer; for `synth-model`, `bench-model` and gpu-check.

use crate::formats::gguf::GgufValue;
use crate::gpu::wformat::WFormat;
use crate::model::families::llama::synth_llama;
use crate::model::families::{SynthEntry, SynthLayout, BASE};
use crate::model::synth::{Fill, SynthShape, SynthTensor};

/// Gemma 4's synthetic files. The tiny variant has twelve layers (two global of 128 per head, a
/// window of 8, per-layer embeddings of 32, the last six reading the caches of layers 4 and 5).
pub(crate) const SYNTH: SynthLayout = SynthLayout {
    // (The synthetic tokenizer is byte-level BPE whatever the shape.)
    shapes: &[SynthEntry {
        name: "gemma-4-e4b",
        shape: || {
            let base = synth_llama("gemma-4-e4b", [2560, 8, 2, 10240, 262144, 42], true, 1e6, "default");
            gemma4_e4b(SynthShape { rms_eps: 1e-6, ..base })
        },
        tiny: |base| {
            let gemma4 = SynthGemma4 { global_head_dim: 128, ple: 32, window: 8, kv_shared: 6 };
            (SynthShape { gemma4: Some(gemma4), ..base }, 12)
        },
    }],
    layer: Some(|s, format, l, layers| {
        s.gemma4.as_ref().map_or_else(Vec::new, |g| layer_tensors(s, g, format, l, layers))
    }),
    globals: |s, format, layers| s.gemma4.as_ref().map_or_else(Vec::new, |g| global_tensors(s, g, format, layers)),
    metadata: |s, layers| s.gemma4.as_ref().map_or_else(Vec::new, |g| metadata(s, g, layers)),
    ..BASE.synth
};

/// What a Gemma 4 shape has beyond the common fields.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SynthGemma4 {
    /// The global layers' head size.
    pub global_head_dim: usize,
    pub window: usize,
    /// Floats per layer of the per-layer embeddings.
    pub ple: usize,
    /// KV-sharing layers of the full depth (fewer layers share proportionally fewer).
    pub kv_shared: usize,
}

impl SynthGemma4 {
    /// Whether layer `l` of `layers` is a sliding-window layer: five of every six, the last
    /// layer global.
    pub fn sliding(&self, l: usize, layers: usize) -> bool {
        !(l + 1).is_multiple_of(6) && l + 1 != layers
    }

    /// The KV-sharing layers of a file of `layers` of a shape of `full` layers: about the same
    /// share, arranged as in the real files, where the last layer with its own cache is global
    /// and the one before it sliding (llama.cpp's loader shares exactly those two; transformers
    /// the last of each kind, the same layers there). None where no such count exists.
    pub fn shared(&self, layers: usize, full: usize) -> usize {
        let fits =
            |n: usize| n + 2 <= layers && !self.sliding(layers - n - 1, layers) && self.sliding(layers - n - 2, layers);
        (1..=self.kv_shared * layers / full.max(1)).rev().find(|&n| fits(n)).unwrap_or(0)
    }

    /// Proportional RoPE's per-pair divisors of the global layers (`rope_freqs.weight`, as the
    /// converter writes them): a quarter of the pairs rotate, the rest are held still by 1e30.
    pub fn rotated_pairs(&self) -> usize {
        self.global_head_dim / 8
    }
}

/// Gemma 4 E4B: 42 layers (five sliding-window layers of 512 to one global), 8 heads / 2 KV
/// heads of 256 (512 on the global layers), FFN 10240, per-layer embeddings of 256, the last 18
/// layers reading earlier layers' caches, vocabulary 262144, tied.
pub fn gemma4_e4b(base: SynthShape) -> SynthShape {
    SynthShape {
        arch: crate::model::config::Arch::Gemma4,
        head_dim: 256,
        rope_theta: 1e6,
        context_length: 131072,
        gemma4: Some(SynthGemma4 { global_head_dim: 512, window: 512, ple: 256, kv_shared: 18 }),
        ..base
    }
}

/// The per-layer embeddings' model-level tensors and the global layers' RoPE divisors of a file of `layers` layers.
fn global_tensors(shape: &SynthShape, g: &SynthGemma4, format: WFormat, layers: usize) -> Vec<SynthTensor> {
    let wide = layers * g.ple;
    vec![
        SynthTensor::matrix(format, "per_layer_token_embd.weight".into(), shape.vocab, wide),
        SynthTensor::matrix(format, "per_layer_model_proj.weight".into(), wide, shape.hidden),
        SynthTensor::vector("per_layer_proj_norm.weight".into(), g.ple, Fill::Norm),
        SynthTensor::vector("rope_freqs.weight".into(), g.global_head_dim / 2, Fill::Freqs(g.rotated_pairs())),
    ]
}

/// Layer `l`'s tensors (of `layers`): attention (queries only on a KV-sharing layer), the FFN,
/// the four norms, the per-layer embedding block and the scalar.
fn layer_tensors(shape: &SynthShape, g: &SynthGemma4, format: WFormat, l: usize, layers: usize) -> Vec<SynthTensor> {
    let p = format!("blk.{l}");
    let m = |name: &str, rows: usize, cols: usize| SynthTensor::matrix(format, format!("{p}.{name}"), rows, cols);
    let v = |name: &str, len: usize, fill: Fill| SynthTensor::vector(format!("{p}.{name}"), len, fill);
    let (h, i) = (shape.hidden, shape.intermediate);
    let hd = if g.sliding(l, layers) { shape.head_dim } else { g.global_head_dim };
    let (q, kv) = (shape.heads * hd, shape.kv_heads * hd);
    let shared = l >= layers - g.shared(layers, shape.layers);
    let mut t =
        vec![v("attn_norm.weight", h, Fill::Norm), m("attn_q.weight", q, h), v("attn_q_norm.weight", hd, Fill::Norm)];
    if !shared {
        t.extend([m("attn_k.weight", kv, h), m("attn_v.weight", kv, h), v("attn_k_norm.weight", hd, Fill::Norm)]);
    }
    t.extend([
        m("attn_output.weight", h, q),
        v("post_attention_norm.weight", h, Fill::Norm),
        v("ffn_norm.weight", h, Fill::Norm),
        m("ffn_gate.weight", i, h),
        m("ffn_up.weight", i, h),
        m("ffn_down.weight", h, i),
        v("post_ffw_norm.weight", h, Fill::Norm),
        m("inp_gate.weight", g.ple, h),
        m("proj.weight", h, g.ple),
        v("post_norm.weight", h, Fill::Norm),
        v("layer_output_scale.weight", 1, Fill::Norm),
    ]);
    t
}

/// The Gemma 4 keys of a file of `layers` layers (the global layers' head size as key_length).
fn metadata(shape: &SynthShape, g: &SynthGemma4, layers: usize) -> Vec<(String, GgufValue)> {
    let k = |suffix: &str| format!("{}.{suffix}", shape.arch_name());
    let u = |v: usize| GgufValue::U32(v as u32);
    let pattern = (0..layers).map(|l| GgufValue::Bool(g.sliding(l, layers))).collect();
    vec![
        (k("attention.key_length"), u(g.global_head_dim)),
        (k("attention.value_length"), u(g.global_head_dim)),
        (k("attention.key_length_swa"), u(shape.head_dim)),
        (k("attention.value_length_swa"), u(shape.head_dim)),
        (k("rope.dimension_count"), u(g.global_head_dim)),
        (k("rope.dimension_count_swa"), u(shape.head_dim)),
        (k("rope.freq_base_swa"), GgufValue::F32(10000.0)),
        (k("attention.sliding_window"), u(g.window)),
        (k("attention.sliding_window_pattern"), GgufValue::Array(pattern)),
        (k("attention.shared_kv_layers"), u(g.shared(layers, shape.layers))),
        (k("embedding_length_per_layer_input"), u(g.ple)),
        (k("final_logit_softcapping"), GgufValue::F32(30.0)),
    ]
}
