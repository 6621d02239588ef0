//! Gemma 4's per-layer input gate (ple.wgsl): the gate projection of the residual through
//! tanh-GELU, times the layer's slice of the per-layer embeddings: parameters, bindings and
//! constructor.

use super::cost::Cost;
use super::{bindings, div_up, Dispatch, FamilyOp, Op, OpKind, Program, Recorder, StepShape};
use crate::gpu::family::Family;
use crate::gpu::shader::Shader;
use crate::gpu::shared::gpu_struct;
use crate::gpu::Gpu;
use anyhow::Result;

gpu_struct! {
    /// ple.wgsl's parameters (WGSL `PleParams`).
    wgsl PleParams;
    pub struct PleParams {
        /// Floats per layer and token (the gate's rows).
        pub width: u32,
        /// Floats per token of the per-layer embeddings (layers x width).
        pub stride: u32,
        /// Where this layer's slice starts in a token's row.
        pub off: u32,
        pub _p0: u32,
    }
}

bindings! {
    /// ple.wgsl.
    PleBinds {
        step: Uniform @ 0,
        p: Uniform @ 1,
        ple: Read @ 2,
        y: ReadWrite @ 3,
    }
}

impl PleParams {
    /// Layer `layer`'s gate over rows of `width` floats, the per-layer embeddings holding
    /// `layers` slices per token.
    pub fn new(width: usize, layers: usize, layer: usize) -> PleParams {
        PleParams { width: width as u32, stride: (width * layers) as u32, off: (width * layer) as u32, _p0: 0 }
    }
}

pub fn ple_source() -> Result<String> {
    Shader::new("ple", include_str!("../../shaders/ple/ple.wgsl"))
        .after(super::wgsl::common())
        .after(PleParams::WGSL)
        .build()
}

/// Every program of the family.
pub fn sources() -> super::Sources {
    vec![Program::new("ple", ple_source(), PleBinds::BINDS)]
}

/// The per-layer input gate's kernel.
pub struct PleKernels {
    /// `PleBinds`.
    pub family: Family,
    pub gate: wgpu::ComputePipeline,
}

impl PleKernels {
    pub fn new(gpu: &Gpu) -> Result<PleKernels> {
        let family = Family::new(gpu, &super::layout_of(PleBinds::SLOTS));
        let gate = family.pipeline(gpu, "ple_gate", &ple_source()?, "main")?;
        Ok(PleKernels { family, gate })
    }
}

/// The gate over rows of `width` floats.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PleOp {
    pub width: u32,
}

/// The gate op of rows of `width` floats.
pub fn ple_gate(k: &PleKernels, g: &Gpu, b: &PleBinds, width: usize) -> Op {
    let kind = OpKind::from(PleOp { width: width as u32 });
    Op { kind, label: kind.family(), bind: k.family.bind(g, &b.entries()), bind_x: None }
}

impl FamilyOp for PleOp {
    fn family(&self) -> &'static str {
        "ple_gate"
    }

    fn cost(&self, s: &StepShape, _kv_bytes: u64) -> Cost {
        let n = s.n_tokens as u64;
        Cost { bytes: 12 * n * self.width as u64, flops: 12 * n * self.width as u64 }
    }

    /// A thread per (token, element).
    fn dispatches<'a>(&self, op: &'a Op, r: &Recorder<'a>, s: &StepShape, mut out: impl FnMut(Dispatch<'a>)) {
        if s.n_tokens > 0 {
            out(r.folded(&r.kernels.ple.gate, &op.bind, div_up(s.n_tokens * self.width, 64)));
        }
    }
}
