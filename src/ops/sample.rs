//! The sampler's two kernels over the sampled rows' logits: logit adjustments (penalties,
//! logit_bias, the structured-output token mask; logit_adjust.wgsl), then sampling (sample.wgsl).
//! The per-row parameters are the 16-word rows of `sampling::row`.

use super::kernels::Kernels;
use super::{bindings, Dispatch, Op, OpKind, Recorder, StepShape};
use crate::gpu::shared::gpu_struct;
use crate::gpu::Gpu;

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

/// The adjustments of rows of `vocab` logits.
pub fn logit_adjust(k: &Kernels, g: &Gpu, b: &AdjustBinds, vocab: usize) -> Op {
    let kind = OpKind::LogitAdjust { vocab: vocab as u32 };
    Op { kind, label: kind.family(), bind: k.sample_family.bind(g, &b.entries()), bind_x: None }
}

/// The sampler over rows of `vocab` logits.
pub fn sample(k: &Kernels, g: &Gpu, b: &SampleBinds, vocab: usize) -> Op {
    let kind = OpKind::Sample { vocab: vocab as u32 };
    Op { kind, label: kind.family(), bind: k.sample_family.bind(g, &b.entries()), bind_x: None }
}

/// The adjustments' grid: a workgroup per sampled row, when any row has adjustments.
pub(super) fn logit_adjust_dispatches<'a>(
    op: &'a Op,
    r: &Recorder<'a>,
    s: &StepShape,
    mut out: impl FnMut(Dispatch<'a>),
) {
    if s.n_sample > 0 && s.any_adjust {
        out(r.folded(&r.kernels.logit_adjust, &op.bind, s.n_sample));
    }
}

/// The sampler's grid: a workgroup per sampled row.
pub(super) fn sample_dispatches<'a>(op: &'a Op, r: &Recorder<'a>, s: &StepShape, mut out: impl FnMut(Dispatch<'a>)) {
    if s.n_sample > 0 {
        out(r.folded(&r.kernels.sample, &op.bind, s.n_sample));
    }
}
