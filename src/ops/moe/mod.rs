//! The mixture-of-experts FFN's ops (shaders/moe/moe_route.wgsl, shaders/moe/moe.wgsl): the router's
//! top-k selection of each token's experts and their weights, the selected experts' gate/up
//! projections (with the gated activation), and their down projections weighted and summed into
//! the residual. Each expert tensor is one matrix of `experts * rows_per_expert` rows, uploaded
//! in chunks of whole experts; an op per chunk reads only the rows of the experts routed to it,
//! so a token costs its k experts' weights, not all of them (ggml's `mul_mat_id`); on the gpu
//! profile a prefill-sized step can run the experts as a grouped GEMM (shaders/moe/moe_tiled.wgsl).
//! Here: the family's parameters, bindings and op kinds with their grids and costs; its
//! shaders are assembled and its kernels built in `pipelines` (`MoeKernels`); the CPU reference of
//! the whole block is `reference` (`moe_ref`).

mod pipelines;
mod reference;

pub(crate) use pipelines::MOE_TILED_WGSL;
pub use pipelines::{
    moe_route_source, moe_source, moe_tiled_source, sources, tiled_pipelines, tiled_wanted, wgsl_moe, MoeKernels,
    MoePipelines, MOE_GROUPED, MOE_TILED, MOE_TILED_ENV,
};
pub use reference::{moe_ref, route_ref};

use super::cost::Cost;
use super::{bindings, div_up, Dispatch, FamilyOp, Op, OpKind, Recorder, StepShape};
use crate::gpu::shared::gpu_struct;
use crate::gpu::{Gpu, WFormat};
use crate::weights::upload::GpuMatrix;

gpu_struct! {
    /// Parameters of the router and of one expert chunk's projection (WGSL `MoeParams`).
    wgsl MoeParams;
    pub struct MoeParams {
        /// Input columns / 32.
        pub k_blocks: u32,
        /// Outputs per expert (gate/up: the expert's intermediate size; down: hidden).
        pub n_out: u32,
        /// Weight rows per expert (gate/up: 2 * n_out, gate rows then up rows; down: n_out).
        pub rows_per_expert: u32,
        /// Experts e0..e1 are in this chunk.
        pub e0: u32,
        pub e1: u32,
        pub top_k: u32,
        pub n_experts: u32,
        /// vec4s per input row.
        pub x_stride4: u32,
        /// Floats per output row.
        pub y_stride: u32,
        /// MOE_* flags.
        pub flags: u32,
        /// gpt-oss's clamped SwiGLU (MOE_CLAMPED): gate * sigmoid(alpha * gate) * (up + 1).
        pub alpha: f32,
        pub limit: f32,
        /// Words of the route buffer (`RouteLayout`): the counts (then the runs' starts and
        /// end), each pair's rank, the grouped pairs.
        pub off_counts: u32,
        pub off_rank: u32,
        pub off_order: u32,
        /// Where the tiles of MOE_MT pairs before each expert are counted (moe_tiled.wgsl).
        pub off_tiles: u32,
    }
}

/// Pairs per thread of the grouped (prefill-sized) expert kernels: each weight part is loaded
/// once for MOE_TG tokens.
pub const MOE_TG: u32 = 4;
/// Pairs per tile of the gpu profile's tiled (grouped-GEMM) expert kernels (moe_tiled.wgsl).
pub const MOE_MT: u32 = 32;
/// Whether a step of `n_tokens` runs the grouped kernels: when its experts average two pairs or
/// more (a decode-sized step runs a thread per pair). TORUS_MOE_PER_PAIR=1 keeps every step on
/// the per-pair kernels (for comparisons).
pub fn grouped(n_tokens: u32, top_k: u32, experts: u32) -> bool {
    static PER_PAIR: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    n_tokens * top_k >= 2 * experts && !*PER_PAIR.get_or_init(|| std::env::var_os("TORUS_MOE_PER_PAIR").is_some())
}

/// The route buffer's words for steps of at most `t_max` tokens: 2 per pair (expert, weight),
/// the per-expert counts, the runs' starts and end, each pair's rank, the grouped pairs (each
/// expert's run padded to a multiple of MOE_TG), and the tiles of MOE_MT pairs before each
/// expert (and in all).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouteLayout {
    pub off_counts: usize,
    pub off_rank: usize,
    pub off_order: usize,
    pub off_tiles: usize,
    pub words: usize,
}

impl RouteLayout {
    pub fn new(t_max: usize, experts: usize, top_k: usize) -> RouteLayout {
        let pairs = t_max * top_k;
        let off_counts = 2 * pairs;
        let off_rank = off_counts + 2 * experts + 1;
        let off_order = off_rank + pairs;
        let off_tiles = off_order + pairs + experts * (MOE_TG as usize - 1);
        RouteLayout { off_counts, off_rank, off_order, off_tiles, words: off_tiles + experts + 1 }
    }

    fn fill(&self, p: MoeParams) -> MoeParams {
        MoeParams {
            off_counts: self.off_counts as u32,
            off_rank: self.off_rank as u32,
            off_order: self.off_order as u32,
            off_tiles: self.off_tiles as u32,
            ..p
        }
    }
}

/// Router flag: the chosen experts' weights are renormalised to sum to 1.
pub const MOE_NORM: u32 = 1;
/// Gate/up flag: tanh-GELU instead of SiLU.
pub const MOE_GELU: u32 = 2;
/// Gate/up flag: gpt-oss's clamped SwiGLU.
pub const MOE_CLAMPED: u32 = 4;
/// Gate/up and down flag: add the expert's bias.
pub const MOE_BIAS: u32 = 8;
/// Router flag: each chosen expert's weight is then multiplied by its own scale (binding 7:
/// Gemma 4's per_expert_scale). Combine flag: the sum is written, not added.
pub const MOE_SCALED: u32 = 16;

/// Outputs per thread of the expert kernels.
pub const MOE_TN: u32 = 4;
/// Most experts and experts per token the router handles; the router's loops run top_k * experts
/// times per token, kept within MAX_ROUTE_WORK (llvmpipe stops an invocation's loops after 65535
/// iterations in all).
pub const MAX_EXPERTS: usize = 512;
pub const MAX_TOP_K: usize = 128;
pub const MAX_ROUTE_WORK: usize = 32768;

bindings! {
    /// moe.wgsl (the router, moe_route.wgsl, binds x and route at 6 and the rest unused).
    MoeBinds {
        step: Uniform @ 0,
        p: Uniform @ 1,
        x: Read @ 2,
        wq: Read @ 3,
        ws: Read @ 4,
        route: Read @ 5,
        y: ReadWrite @ 6,
        bias: Read @ 7,
    }
}

/// How a MoE block routes and activates (the model's, as the ops need it).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeSpec {
    pub experts: usize,
    pub top_k: usize,
    /// Each expert's intermediate size.
    pub ffn: usize,
    /// The chosen experts' weights are renormalised (Qwen3-MoE's norm_topk_prob; gpt-oss's
    /// softmax over the chosen logits is the same).
    pub norm: bool,
    /// The activation: SiLU, tanh-GELU, or gpt-oss's clamped SwiGLU (alpha, limit).
    pub gelu: bool,
    pub clamped: Option<(f32, f32)>,
}

impl MoeSpec {
    fn act_flags(&self) -> (u32, f32, f32) {
        match self.clamped {
            Some((alpha, limit)) => (MOE_CLAMPED, alpha, limit),
            None if self.gelu => (MOE_GELU, 0.0, 0.0),
            None => (0, 0.0, 0.0),
        }
    }
}

/// The buffers of one MoE block's ops.
pub struct MoeIo<'a> {
    pub step: &'a wgpu::Buffer,
    /// The router's logits [tokens, experts] (its matmul's output).
    pub logits: &'a wgpu::Buffer,
    /// The (expert, weight) pairs, 2 words per (token, choice).
    pub route: &'a wgpu::Buffer,
    /// The normed input rows [tokens, hidden].
    pub x: &'a wgpu::Buffer,
    /// The gate/up outputs [tokens * top_k, ffn].
    pub act: &'a wgpu::Buffer,
    /// The down projections of the pairs [tokens * top_k, hidden].
    pub pair_out: &'a wgpu::Buffer,
    pub layout: RouteLayout,
    /// The residual [tokens, hidden], which the down projections add into.
    pub hidden: &'a wgpu::Buffer,
    /// Bound where nothing is (unused bindings, no bias).
    pub dummy: &'a wgpu::Buffer,
}

/// The router's ops over the step's tokens: each token's experts and weights, then (for
/// prefill-sized steps) the pairs grouped by expert.
/// `expert_scale`: each expert's factor its chosen weights are multiplied by (Gemma 4), or None.
pub fn route(
    k: &MoeKernels,
    g: &Gpu,
    spec: &MoeSpec,
    io: &MoeIo,
    expert_scale: Option<&wgpu::Buffer>,
) -> (Vec<Op>, Vec<wgpu::Buffer>) {
    let scaled = if expert_scale.is_some() { MOE_SCALED } else { 0 };
    let p = io.layout.fill(MoeParams {
        n_experts: spec.experts as u32,
        top_k: spec.top_k as u32,
        flags: if spec.norm { MOE_NORM } else { 0 } | scaled,
        ..Default::default()
    });
    let pb = g.uniform_init("moe_route_params", bytemuck::bytes_of(&p));
    let d = io.dummy;
    let scale = expert_scale.unwrap_or(d);
    let b = MoeBinds { step: io.step, p: &pb, x: io.logits, wq: d, ws: d, route: d, y: io.route, bias: scale };
    let (experts, top_k) = (spec.experts as u32, spec.top_k as u32);
    let ops = [
        MoeOp::Route { experts },
        MoeOp::Group { stage: 0, top_k, experts },
        MoeOp::Group { stage: 1, top_k, experts },
        MoeOp::Group { stage: 2, top_k, experts },
    ]
    .map(|kind| Op { kind: kind.into(), label: kind.family(), bind: k.family.bind(g, &b.entries()), bind_x: None });
    (ops.into(), vec![pb])
}

/// The op adding each token's weighted pair projections into the residual (`io.hidden`), or
/// (`set`) writing their sum there.
pub fn combine(k: &MoeKernels, g: &Gpu, spec: &MoeSpec, io: &MoeIo, hidden: usize, set: bool) -> (Op, wgpu::Buffer) {
    let p = MoeParams {
        n_out: hidden as u32,
        top_k: spec.top_k as u32,
        n_experts: spec.experts as u32,
        y_stride: hidden as u32,
        flags: if set { MOE_SCALED } else { 0 },
        ..Default::default()
    };
    let pb = g.uniform_init("moe_combine_params", bytemuck::bytes_of(&p));
    let d = io.dummy;
    let b = MoeBinds { step: io.step, p: &pb, x: io.pair_out, wq: d, ws: d, route: io.route, y: io.hidden, bias: d };
    let kind = OpKind::from(MoeOp::Combine { hidden: hidden as u32 });
    (Op { kind, label: kind.family(), bind: k.family.bind(g, &b.entries()), bind_x: None }, pb)
}

/// The op scaling the shared expert's activations `act` ([tokens, width]) by the sigmoid of
/// each token's gate logit (column 0 of `io.logits`, rows of `spec.experts`).
pub fn shared_gate(k: &MoeKernels, g: &Gpu, spec: &MoeSpec, io: &MoeIo, width: usize) -> (Op, wgpu::Buffer) {
    let p = MoeParams { n_out: width as u32, y_stride: spec.experts as u32, ..Default::default() };
    let pb = g.uniform_init("moe_shared_gate_params", bytemuck::bytes_of(&p));
    let d = io.dummy;
    let b = MoeBinds { step: io.step, p: &pb, x: io.logits, wq: d, ws: d, route: d, y: io.act, bias: d };
    let kind = OpKind::from(MoeOp::SharedGate { width: width as u32 });
    (Op { kind, label: kind.family(), bind: k.family.bind(g, &b.entries()), bind_x: None }, pb)
}

/// The experts' gate/up ops (`down` false: `m` holds each expert's gate rows then its up rows,
/// output into io.act) or down ops (`down`: each pair's projection into io.pair_out), one per
/// chunk of `m` (each chunk whole experts); `bias`: the per-expert biases [experts *
/// rows_per_expert].
pub fn experts(
    k: &MoeKernels,
    g: &Gpu,
    spec: &MoeSpec,
    m: &GpuMatrix,
    io: &MoeIo,
    down: bool,
    bias: Option<&wgpu::Buffer>,
) -> (Vec<Op>, Vec<wgpu::Buffer>) {
    let rows_per_expert = m.rows / spec.experts;
    let n_out = if down { rows_per_expert } else { rows_per_expert / 2 };
    let (act, alpha, limit) = spec.act_flags();
    let flags = if down { 0 } else { act } | if bias.is_some() { MOE_BIAS } else { 0 };
    let (x, y) = if down { (io.act, io.pair_out) } else { (io.x, io.act) };
    let mut ops = Vec::new();
    let mut params = Vec::new();
    for c in &m.chunks {
        let p = io.layout.fill(MoeParams {
            k_blocks: (m.cols / 32) as u32,
            n_out: n_out as u32,
            rows_per_expert: rows_per_expert as u32,
            e0: (c.row0 / rows_per_expert) as u32,
            e1: ((c.row0 + c.rows) / rows_per_expert) as u32,
            top_k: spec.top_k as u32,
            n_experts: spec.experts as u32,
            x_stride4: (m.cols / 4) as u32,
            y_stride: n_out as u32,
            flags,
            alpha,
            limit,
            ..Default::default()
        });
        let pb = g.uniform_init("moe_params", bytemuck::bytes_of(&p));
        let b = MoeBinds {
            step: io.step,
            p: &pb,
            x,
            wq: &c.q,
            ws: &c.s,
            route: io.route,
            y,
            bias: bias.unwrap_or(io.dummy),
        };
        let kind = OpKind::from(MoeOp::Experts {
            format: m.format,
            n_out: n_out as u32,
            top_k: spec.top_k as u32,
            down,
            cols: m.cols as u32,
            chunk_experts: p.e1 - p.e0,
            experts: spec.experts as u32,
        });
        ops.push(Op { kind, label: kind.family(), bind: k.family.bind(g, &b.entries()), bind_x: None });
        params.push(pb);
    }
    (ops, params)
}

/// The family's ops.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MoeOp {
    /// The router: each token's experts and weights.
    Route { experts: u32 },
    /// The grouping of a prefill-sized step's pairs by expert: count (stage 0), place the runs
    /// (1), scatter (2).
    Group { stage: u32, top_k: u32, experts: u32 },
    /// Each token's weighted pair projections added into the residual.
    Combine { hidden: u32 },
    /// The shared expert's activations scaled by the sigmoid of its gate's logit.
    SharedGate { width: u32 },
    /// One chunk of an expert tensor: gate/up (with the activation) of every (token, choice)
    /// routed to it, or (`down`) the weighted down projections added into the residual.
    Experts {
        format: WFormat,
        n_out: u32,
        top_k: u32,
        down: bool,
        /// Input columns, experts in this chunk and in the tensor (the cost model's).
        cols: u32,
        chunk_experts: u32,
        experts: u32,
    },
}

impl FamilyOp for MoeOp {
    fn family(&self) -> &'static str {
        match self {
            MoeOp::Route { .. } => "moe_route",
            MoeOp::Group { .. } => "moe_group",
            MoeOp::Combine { .. } => "moe_combine",
            MoeOp::SharedGate { .. } => "moe_shared_gate",
            MoeOp::Experts { down: false, .. } => "moe_gate_up",
            MoeOp::Experts { down: true, .. } => "moe_down",
        }
    }

    fn cost(&self, s: &StepShape, _kv_bytes: u64) -> Cost {
        match *self {
            MoeOp::Route { experts } => route_cost(s, experts),
            MoeOp::Group { top_k, .. } => group_cost(s, top_k),
            MoeOp::Combine { hidden } => combine_cost(s, hidden),
            MoeOp::SharedGate { width } => shared_gate_cost(s, width),
            MoeOp::Experts { format, n_out, top_k, down, cols, chunk_experts, experts } => {
                experts_cost(s, (format, n_out, top_k, down), (cols, chunk_experts, experts))
            }
        }
    }

    fn dispatches<'a>(&self, op: &'a Op, r: &Recorder<'a>, s: &StepShape, out: impl FnMut(Dispatch<'a>)) {
        match *self {
            MoeOp::Route { .. } => route_dispatches(op, r, s, out),
            MoeOp::Group { stage, top_k, experts } => group_dispatches(op, r, s, (stage, top_k, experts), out),
            MoeOp::Combine { hidden } => combine_dispatches(op, r, s, hidden, out),
            MoeOp::SharedGate { width } => shared_gate_dispatches(op, r, s, width, out),
            MoeOp::Experts { format, n_out, top_k, down, experts, .. } => {
                expert_dispatches(op, r, s, (format, n_out, top_k, down, experts), out)
            }
        }
    }
}

/// The router's grid: a thread per token.
fn route_dispatches<'a>(op: &'a Op, r: &Recorder<'a>, s: &StepShape, mut out: impl FnMut(Dispatch<'a>)) {
    if let (Some(route), true) = (&r.kernels.moe.route, s.n_tokens > 0) {
        out(r.folded(&route[0], &op.bind, div_up(s.n_tokens, 64)));
    }
}

/// The grouping's grids (prefill-sized steps only): a thread per pair to count, one to place
/// the runs, a thread per pair to scatter.
fn group_dispatches<'a>(
    op: &'a Op,
    r: &Recorder<'a>,
    s: &StepShape,
    (stage, top_k, experts): (u32, u32, u32),
    mut out: impl FnMut(Dispatch<'a>),
) {
    let Some(route) = &r.kernels.moe.route else { return };
    if s.n_tokens == 0 || !grouped(s.n_tokens, top_k, experts) {
        return;
    }
    let groups = if stage == 1 { 1 } else { div_up(s.n_tokens * top_k, 64) };
    out(r.folded(&route[1 + stage as usize], &op.bind, groups));
}

/// The combine's grid: a thread per (token, hidden output).
fn combine_dispatches<'a>(op: &'a Op, r: &Recorder<'a>, s: &StepShape, hidden: u32, mut out: impl FnMut(Dispatch<'a>)) {
    if let (Some(combine), true) = (&r.kernels.moe.combine, s.n_tokens > 0) {
        out(r.folded(combine, &op.bind, div_up(s.n_tokens * hidden, 64)));
    }
}

/// The shared gate's grid: a thread per (token, activation).
fn shared_gate_dispatches<'a>(
    op: &'a Op,
    r: &Recorder<'a>,
    s: &StepShape,
    width: u32,
    mut out: impl FnMut(Dispatch<'a>),
) {
    if let (Some(pipe), true) = (&r.kernels.moe.shared_gate, s.n_tokens > 0) {
        out(r.folded(pipe, &op.bind, div_up(s.n_tokens * width, 64)));
    }
}

/// An expert chunk's grid: a thread per (pair, MOE_TN outputs) for decode-sized steps, per
/// (MOE_TG grouped pairs, MOE_TN outputs) for prefill-sized ones, or (gpu profile, where
/// chosen) a workgroup per tile of MOE_MT grouped pairs.
fn expert_dispatches<'a>(
    op: &'a Op,
    r: &Recorder<'a>,
    s: &StepShape,
    (format, n_out, top_k, down, experts): (WFormat, u32, u32, bool, u32),
    mut out: impl FnMut(Dispatch<'a>),
) {
    if s.n_tokens == 0 {
        return;
    }
    let p = &r.kernels.moe.formats[&format];
    let pairs = s.n_tokens * top_k;
    let is_grouped = grouped(s.n_tokens, top_k, experts);
    if let (true, true, Some(t)) = (is_grouped, p.use_tiled, &p.tiled) {
        // A workgroup per (tile of MOE_MT pairs of one expert, 64 weight rows): at most one
        // partial tile per expert.
        let tiles = div_up(pairs, MOE_MT) + experts;
        let outs = if down { 64 } else { 32 };
        out(r.folded(&t[down as usize], &op.bind, tiles * div_up(n_out, outs)));
        return;
    }
    let (pipe, units) = match (is_grouped, down) {
        (false, false) => (&p.gate_up, pairs),
        (false, true) => (&p.down, pairs),
        (true, down) => {
            let slots = div_up(pairs + experts * (MOE_TG - 1), MOE_TG);
            (if down { &p.down_grouped } else { &p.gate_up_grouped }, slots)
        }
    };
    out(r.folded(pipe, &op.bind, div_up(units * div_up(n_out, MOE_TN), 64)));
}

/// The router's bytes and FLOPs: it reads each token's logits and writes 2 words per choice.
fn route_cost(s: &StepShape, experts: u32) -> Cost {
    let n = s.n_tokens as u64;
    Cost { bytes: 4 * n * experts as u64, flops: 4 * n * experts as u64 }
}

/// The grouping's bytes.
fn group_cost(s: &StepShape, top_k: u32) -> Cost {
    Cost { bytes: 16 * s.n_tokens as u64 * top_k as u64, flops: 0 }
}

/// The combine's bytes and FLOPs.
fn combine_cost(s: &StepShape, hidden: u32) -> Cost {
    let n = s.n_tokens as u64;
    Cost { bytes: 4 * n * hidden as u64 * 3, flops: 2 * n * hidden as u64 }
}

/// The shared gate's bytes and FLOPs.
fn shared_gate_cost(s: &StepShape, width: u32) -> Cost {
    let n = s.n_tokens as u64;
    Cost { bytes: 8 * n * width as u64, flops: 4 * n * width as u64 }
}

/// An expert chunk's bytes and FLOPs: the (token, choice) pairs routed to this chunk if routing
/// is even, and the experts they touch at most (all distinct); each touched expert's rows are
/// read once.
fn experts_cost(
    s: &StepShape,
    (format, n_out, top_k, down): (WFormat, u32, u32, bool),
    (cols, chunk_experts, experts): (u32, u32, u32),
) -> Cost {
    let n = s.n_tokens as u64;
    let (k, ce) = (cols as u64, chunk_experts as u64);
    let pairs = (n * top_k as u64 * ce).div_ceil(experts.max(1) as u64);
    let rows = if down { n_out as u64 } else { 2 * n_out as u64 };
    let weights = pairs.min(ce) * rows * format.row_bytes(k as usize) as u64;
    let outs = pairs * n_out as u64;
    Cost { bytes: weights + 4 * pairs * k + 4 * outs, flops: 2 * pairs * rows * k }
}
