//! RMSNorm (of every token row, or gathered sampled rows; stored, or added into the output) and
//! the per-head q/k RMSNorm of Qwen3 and Gemma 3: parameters, bindings and constructors.

use super::kernels::Kernels;
use super::{bindings, div_up, Dispatch, Op, OpKind, Recorder, StepShape};
use crate::gpu::shared::gpu_struct;
use crate::gpu::Gpu;

gpu_struct! {
    /// rmsnorm.wgsl's parameters (WGSL `NormParams`).
    wgsl NormParams;
    pub struct NormParams {
        /// vec4s per row.
        pub dim4: u32,
        pub eps: f32,
        /// 1: output row r normalises the row of sampled row r (its index in the metadata).
        pub gather: u32,
        /// Where the sampled rows' indices start in the metadata.
        pub off_sample: u32,
        /// 1: y += the normalised row (Gemma's norms after attention and the FFN), else y =.
        pub accumulate: u32,
        /// With accumulate: the sum is multiplied by it (Gemma 4's layer_scalar; 1: none).
        pub out_scale: f32,
        pub _p1: u32,
        pub _p2: u32,
    }
}

gpu_struct! {
    /// head_norm.wgsl's parameters (WGSL `HeadNormParams`).
    wgsl HeadNormParams;
    pub struct HeadNormParams {
        pub n_heads: u32,
        pub n_kv_heads: u32,
        pub head_dim: u32,
        /// Floats per qkv row.
        pub qkv_stride: u32,
        pub eps: f32,
        /// V heads after the KV heads normed too, with no weight (Gemma 4's v_norm).
        pub n_v_heads: u32,
        pub _p1: u32,
        pub _p2: u32,
    }
}

bindings! {
    /// rmsnorm.wgsl.
    NormBinds {
        step: Uniform @ 0,
        p: Uniform @ 1,
        x: Read @ 2,
        weight: Read @ 3,
        md: Read @ 4,
        y: ReadWrite @ 5,
    }
}

bindings! {
    /// head_norm.wgsl: q weights then k weights, applied to qkv in place.
    HeadNormBinds {
        step: Uniform @ 0,
        p: Uniform @ 1,
        weight: Read @ 2,
        qkv: ReadWrite @ 3,
    }
}

impl NormParams {
    /// RMSNorm over rows of `dim` floats; `gather`: of the sampled rows listed from `off_sample`.
    pub fn new(dim: usize, eps: f32, gather: bool, off_sample: usize) -> NormParams {
        NormParams {
            dim4: (dim / 4) as u32,
            eps,
            gather: gather as u32,
            off_sample: off_sample as u32,
            ..Default::default()
        }
    }

    /// RMSNorm of every token's row added into y (a post-norm into the residual).
    pub fn accumulating(dim: usize, eps: f32) -> NormParams {
        NormParams { accumulate: 1, out_scale: 1.0, ..NormParams::new(dim, eps, false, 0) }
    }

    /// The same, the sum then multiplied by `scale`: y = (y + norm(x)) * scale.
    pub fn accumulating_scaled(dim: usize, eps: f32, scale: f32) -> NormParams {
        NormParams { out_scale: scale, ..NormParams::accumulating(dim, eps) }
    }
}

impl HeadNormParams {
    pub fn new(heads: usize, kv_heads: usize, head_dim: usize, eps: f32) -> HeadNormParams {
        HeadNormParams {
            n_heads: heads as u32,
            n_kv_heads: kv_heads as u32,
            head_dim: head_dim as u32,
            qkv_stride: ((heads + 2 * kv_heads) * head_dim) as u32,
            eps,
            ..Default::default()
        }
    }

    /// The value heads normed too, without a weight.
    pub fn with_v_norm(self, on: bool) -> HeadNormParams {
        HeadNormParams { n_v_heads: if on { self.n_kv_heads } else { 0 }, ..self }
    }

    /// The q heads only (a layer with no keys or values of its own).
    pub fn q_only(self, on: bool) -> HeadNormParams {
        if on {
            HeadNormParams { n_kv_heads: 0, n_v_heads: 0, ..self }
        } else {
            self
        }
    }
}

/// The RMSNorm op over rows of `dim` floats; `sampled`: over the sampled rows (the params
/// gather them).
pub fn norm(k: &Kernels, g: &Gpu, b: &NormBinds, sampled: bool, dim: usize) -> Op {
    let kind = OpKind::Norm { sampled, dim: dim as u32 };
    Op { kind, label: kind.family(), bind: k.norm_family.bind(g, &b.entries()), bind_x: None }
}

/// The per-head q/k (and v) norm op over `heads` query + KV (+ V) heads of `head_dim`.
pub fn head_norm(k: &Kernels, g: &Gpu, b: &HeadNormBinds, heads: usize, head_dim: usize) -> Op {
    let kind = OpKind::HeadNorm { heads: heads as u32, head_dim: head_dim as u32 };
    Op { kind, label: kind.family(), bind: k.head_norm_family.bind(g, &b.entries()), bind_x: None }
}

/// RMSNorm's grid: a workgroup per row.
pub(super) fn norm_dispatches<'a>(
    op: &'a Op,
    r: &Recorder<'a>,
    s: &StepShape,
    sampled: bool,
    mut out: impl FnMut(Dispatch<'a>),
) {
    let m = if sampled { s.n_sample } else { s.n_tokens };
    if m > 0 {
        out(r.folded(&r.kernels.rmsnorm, &op.bind, m));
    }
}

/// The q/k norm's grid: a thread per (token, head).
pub(super) fn head_norm_dispatches<'a>(
    op: &'a Op,
    r: &Recorder<'a>,
    s: &StepShape,
    heads: u32,
    mut out: impl FnMut(Dispatch<'a>),
) {
    out(r.folded(&r.kernels.head_norm, &op.bind, div_up(s.n_tokens * heads, 64)));
}
