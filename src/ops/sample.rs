//! The sampler's two kernels over the sampled rows' logits: logit adjustments (penalties,
//! logit_bias, the structured-output token mask; logit_adjust.wgsl), then sampling (sample.wgsl).
//! The per-row parameters are the 16-word rows of `sampling::row`.

use super::cost::Cost;
use super::{bindings, Dispatch, FamilyOp, Op, OpKind, Program, Recorder, StepShape};
use crate::gpu::family::Family;
use crate::gpu::shader::Shader;
use crate::gpu::shared::gpu_struct;
use crate::gpu::Gpu;
use anyhow::Result;

gpu_struct! {
    /// The parameters of both sampler kernels (WGSL `SamplerParams`).
    wgsl SamplerParams;
    pub struct SamplerParams {
        pub vocab: u32,
        /// Where the rows' sampling parameters start in the metadata.
        pub off_params: u32,
        pub _p0: u32,
        pub _p1: u32,
    }
}

bindings! {
    /// logit_adjust.wgsl: each row's adjustment entries (and token mask) in `adj`.
    AdjustBinds {
        step: Uniform @ 0,
        p: Uniform @ 1,
        md: Read @ 2,
        adj: Read @ 3,
        logits: ReadWrite @ 4,
    }
}

bindings! {
    /// sample.wgsl: one result record per row in `result`.
    SampleBinds {
        step: Uniform @ 0,
        p: Uniform @ 1,
        md: Read @ 2,
        logits: Read @ 3,
        result: ReadWrite @ 4,
    }
}

/// Invocations per row of the sampler, in both profiles: on a GPU many loads in flight for one
/// row's logits; on llvmpipe each invocation's share of a row small enough that its sweeps (two
/// for the maximum and the sum, up to four per histogram threshold, one per top log-probability)
/// stay within the loop limit (`Gpu::loop_limit`), which 64 per row passed at Qwen's vocabulary.
pub const SAMPLE_WG: u32 = 256;
/// The sampler's shaders (sample.wgsl, logit_adjust.wgsl) with the constants they share with Rust.
fn sampler_source(label: &str, body: &str) -> Shader {
    Shader::new(label, body)
        .after(super::wgsl::common())
        .after(SamplerParams::WGSL)
        .after(crate::sampling::row::wgsl_constants())
}

/// The sampler (both profiles): SAMPLE_WG invocations per row, its top-k / top-p thresholds by
/// histogram (sample_hist.wgsl). The cpu profile's earlier one (64 per row, 32 bisection sweeps
/// per threshold) overran llvmpipe's loop limit at Qwen's vocabulary, and was slower there.
pub fn sample_source() -> Result<String> {
    sampler_source("sample", include_str!("../../shaders/sample/sample.wgsl"))
        .after(include_str!("../../shaders/sample/sample_hist.wgsl"))
        .fill("WG", SAMPLE_WG)
        .build()
}

/// The logit adjustment kernel (logit_adjust.wgsl).
pub fn logit_adjust_source() -> Result<String> {
    sampler_source("logit_adjust", include_str!("../../shaders/sample/logit_adjust.wgsl")).build()
}

/// Every program of the family.
pub fn sources() -> super::Sources {
    vec![
        Program::new("sample", sample_source(), SampleBinds::BINDS),
        Program::new("logit_adjust", logit_adjust_source(), AdjustBinds::BINDS),
    ]
}

/// The sampler family's kernels (both bind as `SampleBinds`: `AdjustBinds::SLOTS` has the
/// same accesses).
pub struct SampleKernels {
    pub family: Family,
    pub sample: wgpu::ComputePipeline,
    pub logit_adjust: wgpu::ComputePipeline,
}

impl SampleKernels {
    pub fn new(gpu: &Gpu) -> Result<SampleKernels> {
        let family = Family::new(gpu, &super::layout_of(SampleBinds::SLOTS));
        let sample = family.pipeline(gpu, "sample", &sample_source()?, "main")?;
        let logit_adjust = family.pipeline(gpu, "logit_adjust", &logit_adjust_source()?, "main")?;
        Ok(SampleKernels { family, sample, logit_adjust })
    }
}

/// The family's ops over rows of `vocab` logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SampleOp {
    /// The logit adjustments (penalties, biases, grammar masks) of the sampled rows.
    LogitAdjust { vocab: u32 },
    /// The sampler.
    Sample { vocab: u32 },
}

/// The adjustments of rows of `vocab` logits.
pub fn logit_adjust(k: &SampleKernels, g: &Gpu, b: &AdjustBinds, vocab: usize) -> Op {
    let kind = OpKind::from(SampleOp::LogitAdjust { vocab: vocab as u32 });
    Op { kind, label: kind.family(), bind: k.family.bind(g, &b.entries()), bind_x: None }
}

/// The sampler over rows of `vocab` logits.
pub fn sample(k: &SampleKernels, g: &Gpu, b: &SampleBinds, vocab: usize) -> Op {
    let kind = OpKind::from(SampleOp::Sample { vocab: vocab as u32 });
    Op { kind, label: kind.family(), bind: k.family.bind(g, &b.entries()), bind_x: None }
}

impl FamilyOp for SampleOp {
    fn family(&self) -> &'static str {
        match self {
            SampleOp::LogitAdjust { .. } => "logit_adjust",
            SampleOp::Sample { .. } => "sample",
        }
    }

    /// The adjustments read and write each sampled row (none in a step without adjustments);
    /// the sampler reads each.
    fn cost(&self, s: &StepShape, _kv_bytes: u64) -> Cost {
        let ns = s.n_sample as u64;
        match *self {
            SampleOp::LogitAdjust { .. } if !s.any_adjust => Cost::default(),
            SampleOp::LogitAdjust { vocab } => Cost { bytes: 8 * ns * vocab as u64, flops: ns * vocab as u64 },
            SampleOp::Sample { vocab } => Cost { bytes: 4 * ns * vocab as u64, flops: 4 * ns * vocab as u64 },
        }
    }

    /// A workgroup per sampled row (the adjustments only when any row has some).
    fn dispatches<'a>(&self, op: &'a Op, r: &Recorder<'a>, s: &StepShape, mut out: impl FnMut(Dispatch<'a>)) {
        let pipe = match self {
            SampleOp::LogitAdjust { .. } if !s.any_adjust => return,
            SampleOp::LogitAdjust { .. } => &r.kernels.sample.logit_adjust,
            SampleOp::Sample { .. } => &r.kernels.sample.sample,
        };
        if s.n_sample > 0 {
            out(r.folded(pipe, &op.bind, s.n_sample));
        }
    }
}
