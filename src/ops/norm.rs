//! RMSNorm (of every token row, or gathered sampled rows; stored, or added into the output) and
//! the per-head q/k RMSNorm of Qwen3 and Gemma 3 (rmsnorm.wgsl, head_norm.wgsl): parameters,
//! bindings, constructors, grids and kernels.

use super::cost::Cost;
use super::{bindings, div_up, Dispatch, FamilyOp, Op, OpKind, Program, Recorder, StepShape};
use crate::gpu::family::Family;
use crate::gpu::shader::Shader;
use crate::gpu::shared::gpu_struct;
use crate::gpu::Gpu;
use anyhow::Result;

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

pub fn rmsnorm_source() -> Result<String> {
    Shader::new("rmsnorm", include_str!("../../shaders/norm/rmsnorm.wgsl"))
        .after(super::wgsl::common())
        .after(NormParams::WGSL)
        .build()
}

pub fn head_norm_source() -> Result<String> {
    Shader::new("head_norm", include_str!("../../shaders/norm/head_norm.wgsl"))
        .after(super::wgsl::common())
        .after(HeadNormParams::WGSL)
        .build()
}

/// Every program of the family.
pub fn sources() -> super::Sources {
    vec![
        Program::new("rmsnorm", rmsnorm_source(), NormBinds::BINDS),
        Program::new("head_norm", head_norm_source(), HeadNormBinds::BINDS),
    ]
}

/// The norm family's kernels.
pub struct NormKernels {
    /// `NormBinds`.
    pub family: Family,
    pub rmsnorm: wgpu::ComputePipeline,
    /// `HeadNormBinds`.
    pub head_family: Family,
    pub head_norm: wgpu::ComputePipeline,
}

impl NormKernels {
    pub fn new(gpu: &Gpu) -> Result<NormKernels> {
        let family = Family::new(gpu, &super::layout_of(NormBinds::SLOTS));
        let rmsnorm = family.pipeline(gpu, "rmsnorm", &rmsnorm_source()?, "main")?;
        let head_family = Family::new(gpu, &super::layout_of(HeadNormBinds::SLOTS));
        let head_norm = head_family.pipeline(gpu, "head_norm", &head_norm_source()?, "main")?;
        Ok(NormKernels { family, rmsnorm, head_family, head_norm })
    }
}

/// The family's ops.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum NormOp {
    /// RMSNorm of every token row, or of the sampled rows, `dim` floats each.
    Rows { sampled: bool, dim: u32 },
    /// Per-head RMSNorm of q and k (and v): `heads` = query + KV (+ V) heads.
    Heads { heads: u32, head_dim: u32 },
}

/// The RMSNorm op over rows of `dim` floats; `sampled`: over the sampled rows (the params
/// gather them).
pub fn norm(k: &NormKernels, g: &Gpu, b: &NormBinds, sampled: bool, dim: usize) -> Op {
    let kind = OpKind::from(NormOp::Rows { sampled, dim: dim as u32 });
    Op { kind, label: kind.family(), bind: k.family.bind(g, &b.entries()), bind_x: None }
}

/// The per-head q/k (and v) norm op over `heads` query + KV (+ V) heads of `head_dim`.
pub fn head_norm(k: &NormKernels, g: &Gpu, b: &HeadNormBinds, heads: usize, head_dim: usize) -> Op {
    let kind = OpKind::from(NormOp::Heads { heads: heads as u32, head_dim: head_dim as u32 });
    Op { kind, label: kind.family(), bind: k.head_family.bind(g, &b.entries()), bind_x: None }
}

impl FamilyOp for NormOp {
    fn family(&self) -> &'static str {
        match self {
            NormOp::Rows { .. } => "rmsnorm",
            NormOp::Heads { .. } => "head_norm",
        }
    }

    /// RMSNorm reads and writes each row and its weights; the per-head norm each head and its
    /// q and k weights.
    fn cost(&self, s: &StepShape, _kv_bytes: u64) -> Cost {
        match *self {
            NormOp::Rows { sampled, dim } => {
                let m = if sampled { s.n_sample } else { s.n_tokens } as u64;
                Cost { bytes: 8 * m * dim as u64 + 4 * dim as u64, flops: 4 * m * dim as u64 }
            }
            NormOp::Heads { heads, head_dim } => {
                let e = s.n_tokens as u64 * heads as u64 * head_dim as u64;
                Cost { bytes: 8 * e + 8 * head_dim as u64, flops: 4 * e }
            }
        }
    }

    /// RMSNorm: a workgroup per row; the per-head norm: a thread per (token, head).
    fn dispatches<'a>(&self, op: &'a Op, r: &Recorder<'a>, s: &StepShape, mut out: impl FnMut(Dispatch<'a>)) {
        match *self {
            NormOp::Rows { sampled, .. } => {
                let m = if sampled { s.n_sample } else { s.n_tokens };
                if m > 0 {
                    out(r.folded(&r.kernels.norm.rmsnorm, &op.bind, m));
                }
            }
            NormOp::Heads { heads, .. } => {
                out(r.folded(&r.kernels.norm.head_norm, &op.bind, div_up(s.n_tokens * heads, 64)))
            }
        }
    }
}
