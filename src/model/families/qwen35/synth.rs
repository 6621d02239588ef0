//! Synthetic Qwen3.5 (Gated DeltaNet hybrid) files: the recurrent layers' tensors and metadata as
//! llama.cpp's converter names them (model/families/qwen35.rs and model/blocks/delta_net.rs read them back), with the MTP (NextN)
//! head as the last block, for `synth-model`, `bench-model` and gpu-check.

use crate::formats::gguf::GgufValue;
use crate::gpu::wformat::WFormat;
use crate::model::families::qwen::synth_qwen2;
use crate::model::families::{SynthEntry, SynthLayout, BASE};
use crate::model::synth::{Fill, SynthMoe, SynthShape, SynthTensor};
use crate::model::synth_tiny::TINY_EXPERTS;

/// Qwen3.5's and Qwen3.6's synthetic files. Their tiny variants keep the key and value heads of
/// 128 (one key head, two value heads; llama.cpp reads one size for both) and four layers (three
/// Gated DeltaNet, one attention).
pub(crate) const SYNTH: SynthLayout = SynthLayout {
    shapes: &[
        SynthEntry {
            name: "qwen3.5-9b",
            shape: || qwen35_9b(synth_qwen2("qwen3.5-9b", [4096, 16, 4, 12288, 248320, 32], false)),
            tiny,
        },
        SynthEntry {
            name: "qwen3.6-35b-a3b",
            shape: || qwen36_35b_a3b(synth_qwen2("qwen3.6-35b-a3b", [2048, 16, 2, 512, 248320, 40], false)),
            tiny,
        },
    ],
    layer: Some(|s, format, l, _| s.linear.as_ref().map_or_else(Vec::new, |lin| layer_tensors(s, lin, format, l))),
    globals: |s, format, layers| s.linear.as_ref().map_or_else(Vec::new, |lin| mtp_tensors(s, lin, format, layers)),
    metadata: |s, layers| s.linear.as_ref().map_or_else(Vec::new, |lin| metadata(s, lin, layers)),
    ..BASE.synth
};

fn tiny(base: SynthShape) -> (SynthShape, usize) {
    let lin = |l: SynthLinear| SynthLinear { k_heads: 1, v_heads: 2, k_dim: 128, v_dim: 128, rotary_dim: 16, ..l };
    (SynthShape { linear: base.linear.map(lin), moe: base.moe.map(|_| TINY_EXPERTS), ..base }, 4)
}

/// A hybrid shape's Gated DeltaNet layers: every layer but each `interval`-th.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SynthLinear {
    pub k_heads: usize,
    pub v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
    pub kernel: usize,
    pub interval: usize,
    /// Elements of each attention head that RoPE rotates.
    pub rotary_dim: usize,
}

impl SynthLinear {
    fn is_linear(&self, l: usize) -> bool {
        !(l + 1).is_multiple_of(self.interval)
    }
}

/// Qwen3.5-9B (transformers' Qwen3_5TextConfig defaults): 32 layers, every 4th gated attention
/// (16 heads / 4 KV heads of 256, a quarter rotated), the others Gated DeltaNet (16 key heads,
/// 32 value heads of 128, conv kernel 4); vocabulary 248320, rope_theta 1e7.
pub fn qwen35_9b(base: SynthShape) -> SynthShape {
    SynthShape {
        arch: crate::model::config::Arch::Qwen35,
        head_dim: 256,
        rope_theta: 1e7,
        context_length: 262144,
        linear: Some(SynthLinear {
            k_heads: 16,
            v_heads: 32,
            k_dim: 128,
            v_dim: 128,
            kernel: 4,
            interval: 4,
            rotary_dim: 64,
        }),
        ..base
    }
}

/// Qwen3.6-35B-A3B (Qwen3.5-MoE's code; transformers' Qwen3_5MoeTextConfig defaults): 40 layers,
/// every 4th gated attention (16 heads / 2 KV heads of 256), the others Gated DeltaNet (16 key
/// heads, 32 value heads of 128); every FFN 256 experts of 512, 8 per token, beside a gated
/// shared expert of 512.
pub fn qwen36_35b_a3b(base: SynthShape) -> SynthShape {
    SynthShape { head_dim: 256, moe: Some(SynthMoe { experts: 256, top_k: 8, ffn: 512 }), ..qwen35_9b(base) }
}

/// Layer `l`'s tensors: a Gated DeltaNet mixer or gated attention (q_proj with the gate rows),
/// then the dense FFN with `post_attention_norm` as its norm.
fn layer_tensors(shape: &SynthShape, lin: &SynthLinear, format: WFormat, l: usize) -> Vec<SynthTensor> {
    let p = format!("blk.{l}");
    let m = |name: &str, rows: usize, cols: usize| SynthTensor::matrix(format, format!("{p}.{name}"), rows, cols);
    let v = |name: &str, len: usize, fill: Fill| SynthTensor::vector(format!("{p}.{name}"), len, fill);
    let h = shape.hidden;
    let mut t = vec![v("attn_norm.weight", h, Fill::Norm)];
    if lin.is_linear(l) {
        let (key, value) = (lin.k_heads * lin.k_dim, lin.v_heads * lin.v_dim);
        let conv = 2 * key + value;
        t.push(m("attn_qkv.weight", conv, h));
        t.push(m("attn_gate.weight", value, h));
        t.push(m("ssm_beta.weight", lin.v_heads, h));
        t.push(m("ssm_alpha.weight", lin.v_heads, h));
        t.push(SynthTensor::matrix(WFormat::F32, format!("{p}.ssm_conv1d.weight"), conv, lin.kernel));
        t.push(v("ssm_dt.bias", lin.v_heads, Fill::DtBias));
        t.push(v("ssm_a", lin.v_heads, Fill::Decay));
        t.push(v("ssm_norm.weight", lin.v_dim, Fill::Norm));
        t.push(m("ssm_out.weight", h, value));
    } else {
        let (q, kv) = (shape.q_dim(), shape.kv_dim());
        t.push(m("attn_q.weight", 2 * q, h));
        t.push(m("attn_k.weight", kv, h));
        t.push(m("attn_v.weight", kv, h));
        t.push(v("attn_q_norm.weight", shape.head_dim, Fill::Norm));
        t.push(v("attn_k_norm.weight", shape.head_dim, Fill::Norm));
        t.push(m("attn_output.weight", h, q));
    }
    t.push(v("post_attention_norm.weight", h, Fill::Norm));
    let Some(e) = shape.moe else {
        let i = shape.intermediate;
        t.extend([m("ffn_gate.weight", i, h), m("ffn_up.weight", i, h), m("ffn_down.weight", h, i)]);
        return t;
    };
    // The router in f32 (as real files keep it), each projection's experts one 3-D tensor, the
    // shared expert (as large as one routed expert) and its gate.
    t.push(SynthTensor::matrix(WFormat::F32, format!("{p}.ffn_gate_inp.weight"), e.experts, h));
    for (name, rows, cols) in [("gate", e.ffn, h), ("up", e.ffn, h), ("down", h, e.ffn)] {
        let mut x = m(&format!("ffn_{name}_exps.weight"), rows, cols);
        x.spec.dims.push(e.experts as u64);
        t.push(x);
    }
    t.extend([
        m("ffn_gate_shexp.weight", e.ffn, h),
        m("ffn_up_shexp.weight", e.ffn, h),
        m("ffn_down_shexp.weight", h, e.ffn),
    ]);
    t.push(v("ffn_gate_inp_shexp.weight", h, Fill::Bias));
    t
}

/// The MTP (NextN) head after `layers` layers, as llama.cpp's Qwen3.5 files carry it: block
/// `layers` is a gated attention layer with the model's FFN, plus `nextn.eh_proj` [hidden, 2
/// hidden] and the three norms.
fn mtp_tensors(shape: &SynthShape, lin: &SynthLinear, format: WFormat, layers: usize) -> Vec<SynthTensor> {
    let attention = SynthLinear { interval: 1, ..*lin };
    let mut t = layer_tensors(shape, &attention, format, layers);
    let p = format!("blk.{layers}.nextn");
    let h = shape.hidden;
    t.push(SynthTensor::matrix(format, format!("{p}.eh_proj.weight"), h, 2 * h));
    for n in ["enorm", "hnorm", "shared_head_norm"] {
        t.push(SynthTensor::vector(format!("{p}.{n}.weight"), h, Fill::Norm));
    }
    t
}

/// The M-RoPE sections of `rotary_dim` rotated elements as Qwen3.5's converted files carry
/// them: the checkpoints' [11, 11, 10] (of 32 rotated pairs) scaled to the pairs there are, and
/// no fourth section. With text positions (the same position in every section) this is plain
/// rotation of the first `rotary_dim` elements.
pub fn rope_sections(rotary_dim: usize) -> [i32; 4] {
    let pairs = rotary_dim / 2;
    let s = (pairs * 11 + 16) / 32;
    [s as i32, s as i32, (pairs - 2 * s) as i32, 0]
}

/// The `ssm.*` keys, the attention interval, the rotated dimensions and their M-RoPE sections,
/// and which of the `layers` blocks (and the MTP block after them) are recurrent.
fn metadata(shape: &SynthShape, lin: &SynthLinear, layers: usize) -> Vec<(String, GgufValue)> {
    let k = |suffix: &str| format!("{}.{suffix}", shape.arch_name());
    let u = |v: usize| GgufValue::U32(v as u32);
    let sections = rope_sections(lin.rotary_dim).into_iter().map(GgufValue::I32).collect();
    let recurrent = (0..=layers).map(|l| GgufValue::Bool(l < layers && lin.is_linear(l))).collect();
    let shared = shape.moe.map(|e| (k("expert_shared_feed_forward_length"), u(e.ffn)));
    shared
        .into_iter()
        .chain([
            (k("ssm.conv_kernel"), u(lin.kernel)),
            (k("ssm.state_size"), u(lin.k_dim)),
            (k("ssm.group_count"), u(lin.k_heads)),
            (k("ssm.time_step_rank"), u(lin.v_heads)),
            (k("ssm.inner_size"), u(lin.v_heads * lin.v_dim)),
            (k("full_attention_interval"), u(lin.interval)),
            (k("rope.dimension_count"), u(lin.rotary_dim)),
            (k("rope.dimension_sections"), GgufValue::Array(sections)),
            (k("attention.recurrent_layers"), GgufValue::Array(recurrent)),
            (k("nextn_predict_layers"), u(1)),
        ])
        .collect()
}
