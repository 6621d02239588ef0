//! Gated DeltaNet, the recurrent mixer of Qwen3.5's linear-attention layers (shaders/delta/delta.wgsl):
//! the causal convolution with its state, the q/k normalisation and per-head decay and beta,
//! the delta-rule recurrence over each sequence's tokens from its state slot, the gated RMSNorm;
//! and the sigmoid output gate of Qwen3.5's attention layers. Parameters, bindings, the op
//! constructor, grids, and the CPU reference of the whole mixer (`delta_ref`).

use super::cost::Cost;
use super::wgsl::unrolled;
use super::{bindings, div_up, Dispatch, FamilyOp, Op, OpKind, Program, Recorder, StepShape};
use crate::gpu::shader::Shader;
use crate::gpu::shared::gpu_struct;
use crate::gpu::Gpu;

gpu_struct! {
    /// delta.wgsl's parameters (WGSL `DeltaParams`).
    wgsl DeltaParams;
    pub struct DeltaParams {
        pub k_heads: u32,
        pub v_heads: u32,
        pub k_dim: u32,
        pub v_dim: u32,
        /// Taps of the causal convolution.
        pub kernel: u32,
        /// Floats per row of x (the projections).
        pub x_stride: u32,
        /// Columns of z, b and a in a row of x.
        pub off_z: u32,
        pub off_b: u32,
        pub off_a: u32,
        /// Where the sequences' state records start in the metadata.
        pub off_state: u32,
        /// Where A and dt_bias ([v_heads] each) and the norm weight ([v_dim]) start in w.
        pub w_a: u32,
        pub w_dt: u32,
        pub w_norm: u32,
        pub eps: f32,
        /// gate_main: floats per row of the gate and of its output.
        pub gate_width: u32,
        /// 1: value head h uses key head h % k_heads (llama.cpp's order), else h / (v_heads /
        /// k_heads) (Hugging Face's).
        pub tiled: u32,
    }
}

bindings! {
    /// delta.wgsl.
    DeltaBinds {
        step: Uniform @ 0,
        p: Uniform @ 1,
        md: Read @ 2,
        w: Read @ 3,
        x: ReadWrite @ 4,
        conv_state: ReadWrite @ 5,
        rec_state: ReadWrite @ 6,
        out: ReadWrite @ 7,
        chunks: ReadWrite @ 8,
    }
}

/// Tokens per chunk of the chunked delta rule (delta_chunk.wgsl): its workgroup holds two
/// CHUNK x CHUNK matrices (8 KiB).
pub const CHUNK: usize = 32;
/// A sequence of this many tokens in a step or more takes the chunked form; fewer (decode,
/// speculative verification), the per-token recurrence.
pub const CHUNK_MIN: usize = 16;
/// Value columns of the state per workgroup of the chunked form's state pass.
pub const CHUNK_COLS: usize = 16;

/// Benchmarks only: sequences shorter than this (at least CHUNK_MIN) keep the per-token
/// recurrence; a large value turns the chunked form off, to compare the two on one build.
pub const CHUNK_MIN_ENV: &str = "TORUS_DELTA_CHUNK_MIN";

/// The chunked form's threshold the kernels are built with: CHUNK_MIN, or CHUNK_MIN_ENV where
/// set higher.
pub fn chunk_min() -> usize {
    std::env::var(CHUNK_MIN_ENV).ok().and_then(|v| v.parse().ok()).map_or(CHUNK_MIN, |v: usize| v.max(CHUNK_MIN))
}

/// Most chunks of the chunked form in a step of `n_tokens` tokens and `n_seqs` sequences: each
/// sequence of CHUNK_MIN tokens or more has at most count / CHUNK + 2 (a short first chunk ends
/// at a snapshot).
pub fn chunk_slots(n_tokens: u32, n_seqs: u32) -> u32 {
    if (n_tokens as usize) < CHUNK_MIN {
        return 0;
    }
    n_tokens.div_ceil(CHUNK as u32) + 2 * n_seqs.min(n_tokens / CHUNK_MIN as u32)
}

/// The most tokens one sequence may have in a step on a device whose invocations stop their
/// loops after `limit` loop iterations in all (llvmpipe: `Gpu::loop_limit`), for keys of `k_dim`,
/// with the chunked form (`chunked`) or without. The per-token recurrence and the convolution run
/// one loop iteration per token (their inner loops are written out: delta.wgsl's LOOP_NOTE);
/// chunk_state_main runs per chunk, in each invocation of 256: the chunk's decays (CH, one
/// thread), y and q.S (2 CH CB / 256 values of k_dim terms), u and the outputs (CH CB / 256
/// values of up to CH terms each), the state update (k_dim CB / 256 values of CH terms) and its
/// snapshot, and the loops' own iterations; one chunk more for a short first chunk. A tenth of
/// the limit is kept spare. A longer step runs in sub-steps (model/plan.rs).
pub fn max_loop_tokens(k_dim: usize, chunked: bool, limit: usize) -> usize {
    let limit = limit - limit / 10;
    if !chunked {
        return limit;
    }
    let (ch, cb, threads) = (CHUNK, CHUNK_COLS, 256);
    let per = |values: usize| values.div_ceil(threads);
    let state_values = per(k_dim * cb);
    let per_chunk =
        1 + ch + per(2 * ch * cb) * (k_dim + 1) + 2 * per(ch * cb) * (ch + 1) + state_values * (ch + 1) + state_values;
    let chunks = limit.saturating_sub(2 * state_values) / per_chunk;
    (chunks.saturating_sub(1) * ch).clamp(CHUNK_MIN, limit)
}

/// Words of a sequence's state record in the step metadata: slot, first token row, tokens,
/// reset (its first token is at position 0, so it starts from a zero state), backup slot (its
/// state before the step is copied there first), snapshot slot and the token (counted from its
/// first) after which its state is copied there, the slot its state is read from (instead of
/// its own); NO_SLOT: none.
pub const STATE_RECORD: usize = 8;
/// Most taps of the convolution's state (delta.wgsl's MAX_KERNEL - 1): the kernel's statements
/// for them are written out.
pub const MAX_CONV_TAPS: u32 = 7;
pub const NO_SLOT: u32 = u32::MAX;

/// Gated DeltaNet's sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaDims {
    pub k_heads: usize,
    pub v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
    pub kernel: usize,
}

impl DeltaDims {
    pub fn key_dim(&self) -> usize {
        self.k_heads * self.k_dim
    }
    pub fn value_dim(&self) -> usize {
        self.v_heads * self.v_dim
    }
    /// Channels of the convolution: q, k and v.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// Floats per token of the projections: q, k, v, z, b, a.
    pub fn proj_width(&self) -> usize {
        self.conv_dim() + self.value_dim() + 2 * self.v_heads
    }
    /// Floats of one slot's convolution state and recurrent state.
    pub fn conv_state(&self) -> usize {
        (self.kernel - 1) * self.conv_dim()
    }
    pub fn rec_state(&self) -> usize {
        self.v_heads * self.k_dim * self.v_dim
    }
    /// Floats per token of the chunked form's matrices (`DeltaBinds::chunks`).
    pub fn chunk_width(&self) -> usize {
        self.v_heads * 2 * CHUNK
    }
}

impl DeltaParams {
    /// `off_state`: the state records' offset in the metadata; `gate_width`: the attention
    /// layers' gate width (heads * head_dim); `tiled`: llama.cpp's value-head order.
    pub fn new(d: &DeltaDims, eps: f32, off_state: usize, gate_width: usize, tiled: bool) -> DeltaParams {
        let conv = d.conv_dim();
        DeltaParams {
            k_heads: d.k_heads as u32,
            v_heads: d.v_heads as u32,
            k_dim: d.k_dim as u32,
            v_dim: d.v_dim as u32,
            kernel: d.kernel as u32,
            x_stride: d.proj_width() as u32,
            off_z: conv as u32,
            off_b: (conv + d.value_dim()) as u32,
            off_a: (conv + d.value_dim() + d.v_heads) as u32,
            off_state: off_state as u32,
            w_a: (conv * d.kernel) as u32,
            w_dt: (conv * d.kernel + d.v_heads) as u32,
            w_norm: (conv * d.kernel + 2 * d.v_heads) as u32,
            eps,
            gate_width: gate_width as u32,
            tiled: tiled as u32,
        }
    }
}

/// The entry points of delta.wgsl, in the order a layer runs them (and the attention gate).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeltaStage {
    Conv,
    Prep,
    Chunk,
    ChunkState,
    Recur,
    GatedNorm,
    Gate,
}

impl DeltaStage {
    /// Every stage in declaration order (`stage as usize` is its index): a linear-attention
    /// layer's stages in the order it runs them, then the attention gate.
    pub const ALL: [DeltaStage; 7] = [
        DeltaStage::Conv,
        DeltaStage::Prep,
        DeltaStage::Chunk,
        DeltaStage::ChunkState,
        DeltaStage::Recur,
        DeltaStage::GatedNorm,
        DeltaStage::Gate,
    ];

    /// A linear-attention layer's stages, in order (all but the attention gate).
    pub fn mixer() -> &'static [DeltaStage] {
        &Self::ALL[..Self::ALL.len() - 1]
    }

    pub fn entry(self) -> &'static str {
        match self {
            DeltaStage::Conv => "conv_main",
            DeltaStage::Prep => "prep_main",
            DeltaStage::Chunk => "chunk_main",
            DeltaStage::ChunkState => "chunk_state_main",
            DeltaStage::Recur => "delta_main",
            DeltaStage::GatedNorm => "gnorm_main",
            DeltaStage::Gate => "gate_main",
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            DeltaStage::Conv => "delta_conv",
            DeltaStage::Prep => "delta_prep",
            DeltaStage::Chunk => "delta_chunk",
            DeltaStage::ChunkState => "delta_chunk_state",
            DeltaStage::Recur => "delta_rule",
            DeltaStage::GatedNorm => "delta_norm",
            DeltaStage::Gate => "attn_gate",
        }
    }

    /// Threads (workgroups for the recurrence and the chunked form) per sequence or per token
    /// of the step: conv per sequence and channel, prep per token and head, the chunks per chunk
    /// and value head, the chunked state pass per sequence, value head and CHUNK_COLS columns,
    /// the recurrence per sequence, value head and 64 columns, the norm per token and value
    /// head, the gate per token and element.
    pub fn per_unit(self, d: &DeltaDims, gate_width: usize) -> u32 {
        (match self {
            DeltaStage::Conv => d.conv_dim(),
            DeltaStage::Prep => d.k_heads + d.v_heads,
            DeltaStage::Chunk => d.v_heads,
            DeltaStage::ChunkState => d.v_heads * d.v_dim.div_ceil(CHUNK_COLS),
            DeltaStage::Recur => d.v_heads * d.v_dim.div_ceil(64),
            DeltaStage::GatedNorm => d.v_heads,
            DeltaStage::Gate => gate_width,
        }) as u32
    }
}

// DeltaStage::ALL is in declaration order (`stage as usize` indexes it): checked at compile time.
const _: () = {
    let mut i = 0;
    while i < DeltaStage::ALL.len() {
        assert!(DeltaStage::ALL[i] as usize == i);
        i += 1;
    }
};

/// A Gated DeltaNet stage's op (`per`: `DeltaStage::per_unit`) with the model's DeltaNet
/// kernels (`Kernels::delta`: none were built for a model without linear-attention layers).
pub fn delta(k: Option<&DeltaKernels>, g: &Gpu, b: &DeltaBinds, stage: DeltaStage, per: u32) -> anyhow::Result<Op> {
    let fam = k.ok_or_else(|| anyhow::anyhow!("the Gated DeltaNet kernels were not built"))?;
    let kind = OpKind::from(DeltaOp { stage, per });
    Ok(Op { kind, label: stage.label(), bind: fam.family.bind(g, &b.entries()), bind_x: None })
}

/// A stage of the Gated DeltaNet mixer, or the attention's output gate: `per` threads
/// (workgroups for the recurrence) per token or sequence.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeltaOp {
    pub stage: DeltaStage,
    pub per: u32,
}

impl FamilyOp for DeltaOp {
    fn family(&self) -> &'static str {
        self.stage.label()
    }

    fn cost(&self, s: &StepShape, _kv_bytes: u64) -> Cost {
        cost(s, self.stage, self.per)
    }

    fn dispatches<'a>(&self, op: &'a Op, r: &Recorder<'a>, s: &StepShape, out: impl FnMut(Dispatch<'a>)) {
        dispatches(op, r, s, (self.stage, self.per), out)
    }
}

/// A stage's grid: `per` threads per sequence (conv) or token, 64 to a workgroup; the recurrence
/// `per` workgroups per sequence; the chunk stages `per` workgroups per chunk slot or sequence
/// (none in a step of fewer than CHUNK_MIN tokens, nor in the cpu profile).
fn dispatches<'a>(
    op: &'a Op,
    r: &Recorder<'a>,
    s: &StepShape,
    (stage, per): (DeltaStage, u32),
    mut out: impl FnMut(Dispatch<'a>),
) {
    let Some(fam) = r.kernels.delta.as_ref() else { return };
    let pipe = &fam.pipelines[stage as usize];
    let groups = match stage {
        DeltaStage::Conv => div_up(s.n_seqs * per, 64),
        DeltaStage::Recur => s.n_seqs * per,
        DeltaStage::Chunk | DeltaStage::ChunkState if !fam.chunked => 0,
        DeltaStage::Chunk => chunk_slots(s.n_tokens, s.n_seqs) * per,
        DeltaStage::ChunkState if chunk_slots(s.n_tokens, s.n_seqs) > 0 => s.n_seqs * per,
        DeltaStage::ChunkState => 0,
        _ => div_up(s.n_tokens * per, 64),
    };
    if groups > 0 {
        out(r.folded(pipe, &op.bind, groups));
    }
}

/// delta.wgsl and delta_chunk.wgsl for keys of `k_dim`; `chunked`: sequences of chunk_min()
/// tokens or more take the chunked form (else every sequence the per-token recurrence). The
/// per-token loops' inner loops (the state's k_dim rows, the convolution's taps) are written out
/// (the shader's LOOP_NOTE).
pub fn delta_source(k_dim: u32, chunked: bool) -> anyhow::Result<String> {
    let body = [include_str!("../../shaders/delta/delta.wgsl"), include_str!("../../shaders/delta/delta_chunk.wgsl")]
        .join("\n");
    let taps = MAX_CONV_TAPS;
    // The state's rows: read (from zero on a reset) and copied to the backup, decayed and read
    // against k, updated and read against q, copied to a snapshot, written back.
    let load = unrolled(k_dim, 1, "col[{i}] = select(rec_state[lbase + {i} * p.v_dim], 0.0, reset);");
    let backup = unrolled(k_dim, 2, "rec_state[bbase + {i} * p.v_dim] = col[{i}];");
    // The convolution's taps, statement j under j < taps; the shift puts the input last.
    let conv_load = "if ({i} < taps) { hist[{i}] = select(conv_state[lbase + {i} * conv_dim], 0.0, reset); \
                     if (backup) { conv_state[bbase + {i} * conv_dim] = hist[{i}]; } }";
    let shift = "if ({i+1} < taps) { hist[{i}] = hist[{i+1}]; } else if ({i+1} == taps) { hist[{i}] = v; }";
    Shader::new("delta", &body)
        .after(super::wgsl::common())
        .after(DeltaParams::WGSL)
        .fill("DK", k_dim)
        .fill("REC_LOAD", format!("{load}    if (backup) {{\n{backup}    }}"))
        .fill("REC_DECAY", unrolled(k_dim, 2, "col[{i}] *= decay; kv += col[{i}] * x[kb + {i}];"))
        .fill("REC_UPDATE", unrolled(k_dim, 2, "col[{i}] += x[kb + {i}] * delta; o += col[{i}] * x[qb + {i}];"))
        .fill("REC_SNAP", unrolled(k_dim, 3, "rec_state[nb + {i} * p.v_dim] = col[{i}];"))
        .fill("REC_STORE", unrolled(k_dim, 1, "rec_state[sbase + {i} * p.v_dim] = col[{i}];"))
        .fill("CONV_LOAD", unrolled(taps, 1, conv_load))
        .fill("CONV_ACC", unrolled(taps, 2, "if ({i} < taps) { acc += w[wb + {i}] * hist[{i}]; }"))
        .fill("CONV_SHIFT", unrolled(taps, 2, shift))
        .fill("CONV_SNAP", unrolled(taps, 3, "if ({i} < taps) { conv_state[nb + {i} * conv_dim] = hist[{i}]; }"))
        .fill("CONV_STORE", unrolled(taps, 1, "if ({i} < taps) { conv_state[sbase + {i} * conv_dim] = hist[{i}]; }"))
        .fill("CH", CHUNK)
        .fill("CHUNK_MIN", if chunked { chunk_min() as u32 } else { u32::MAX })
        .fill("CB", CHUNK_COLS)
        .build()
}

/// Every program of the family: per-token only, chunked, and at the larger key head.
pub fn sources() -> super::Sources {
    vec![
        Program::new("delta", delta_source(128, false), DeltaBinds::BINDS),
        Program::new("delta_chunked", delta_source(128, true), DeltaBinds::BINDS),
        Program::new("delta_256", delta_source(256, false), DeltaBinds::BINDS),
    ]
}

/// A stage's bytes and FLOPs (`per` as in its op).
fn cost(s: &StepShape, stage: DeltaStage, per: u32) -> Cost {
    let (n, per) = (s.n_tokens as u64, per as u64);
    match stage {
        // Each channel's taps and state read and written once, its inputs in place.
        DeltaStage::Conv => Cost { bytes: 8 * n * per + 16 * per, flops: 8 * n * per },
        // The recurrence: a workgroup's 64 columns of state read and written once per step; q, k
        // read per column per token (the FLOPs: 4 per state element and token, 64 k_dim-long
        // columns per workgroup, k_dim unknown here: the state traffic is the bound that matters).
        DeltaStage::Recur => Cost { bytes: 2 * 4 * 64 * 128 * s.n_seqs as u64 * per, flops: 0 },
        // Per token and value head: its rows of the two chunk matrices written, v read and
        // written; the q.k and k.k products of its chunk (k_dim unknown here: 128).
        DeltaStage::Chunk => {
            let c = CHUNK as u64;
            Cost { bytes: n * per * (8 * c + 8 * 128), flops: n * per * c * 4 * 128 }
        }
        // Per token and workgroup (CHUNK_COLS columns): q and k read, its chunk rows read; the
        // state block read and written once per sequence; 6 FLOPs per state element and token,
        // the chunk matrices' products (k_dim: 128).
        DeltaStage::ChunkState => {
            let (c, cols) = (CHUNK as u64, CHUNK_COLS as u64);
            Cost {
                bytes: n * per * (8 * 128 + 8 * c) + 8 * 128 * cols * s.n_seqs as u64 * per,
                flops: n * per * cols * (6 * 128 + 2 * c),
            }
        }
        _ => Cost { bytes: 8 * n * per, flops: 4 * n * per },
    }
}

/// The pipelines of delta.wgsl (one family), built for a model with linear-attention layers.
pub struct DeltaKernels {
    pub family: crate::gpu::family::Family,
    /// One per `DeltaStage::ALL` entry.
    pub pipelines: Vec<wgpu::ComputePipeline>,
    /// Whether long sequences take the chunked form (the gpu profile), else the chunk stages
    /// are not dispatched.
    pub chunked: bool,
}

impl DeltaKernels {
    /// `chunked`: the gpu profile's chunked form for prefill-sized sequences. The cpu profile
    /// keeps the per-token recurrence for all: on a CPU-shaped device (llvmpipe) its columns run
    /// as SIMD lanes over private state arrays, 9x faster than the chunked form's workgroup
    /// matrices (benches/kernels.rs `mixer_prefill`), and the chunked form does no less work.
    pub fn new(g: &Gpu, k_dim: u32, chunked: bool) -> anyhow::Result<DeltaKernels> {
        let family = crate::gpu::family::Family::new(g, &super::layout_of(DeltaBinds::SLOTS));
        let src = delta_source(k_dim, chunked)?;
        let pipelines = DeltaStage::ALL
            .iter()
            .map(|s| family.pipeline(g, &format!("{}_{k_dim}", s.label()), &src, s.entry()))
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(DeltaKernels { family, pipelines, chunked })
    }
}

/// One sequence's state for the CPU reference: the convolution's last kernel - 1 inputs per
/// channel and the delta rule's matrix per value head ([v_head][k_dim][v_dim]).
#[derive(Clone, Debug, PartialEq)]
pub struct DeltaState {
    pub conv: Vec<f32>,
    pub rec: Vec<f32>,
}

impl DeltaState {
    pub fn zero(d: &DeltaDims) -> DeltaState {
        DeltaState { conv: vec![0.0; d.conv_state()], rec: vec![0.0; d.rec_state()] }
    }
}

/// The weights the mixer's kernels read after the projections: conv [conv_dim, kernel], A
/// (-exp(A_log)) and dt_bias [v_heads], the norm [v_dim].
pub struct DeltaWeights<'a> {
    pub conv: &'a [f32],
    pub a: &'a [f32],
    pub dt_bias: &'a [f32],
    pub norm: &'a [f32],
}

fn silu(v: f32) -> f32 {
    v / (1.0 + (-v).exp())
}

fn sigmoid(v: f32) -> f32 {
    1.0 / (1.0 + (-v).exp())
}

/// The CPU reference of the mixer after its projections, written as transformers' recurrent
/// form (not the kernels' order): `x` holds `tokens` rows of [q | k | v | z | b | a] (the
/// projections, `DeltaDims::proj_width` each) of one sequence continuing from `state`; returns
/// the gated-norm outputs [tokens, value_dim] and updates `state`. Value head h uses key head
/// h / (v_heads / k_heads), or h % k_heads when `tiled` (llama.cpp's order).
pub fn delta_ref(
    d: &DeltaDims,
    w: &DeltaWeights,
    x: &[f32],
    state: &mut DeltaState,
    eps: f32,
    tiled: bool,
) -> Vec<f32> {
    let (pw, conv, kd, vd) = (d.proj_width(), d.conv_dim(), d.key_dim(), d.value_dim());
    let n = x.len() / pw;
    let taps = d.kernel - 1;
    let mut out = vec![0.0; n * vd];
    for t in 0..n {
        let row = &x[t * pw..(t + 1) * pw];
        // Convolution over [state | input], then SiLU.
        let mut c = vec![0.0f32; conv];
        for (ch, cv) in c.iter_mut().enumerate() {
            let mut acc = w.conv[ch * d.kernel + taps] * row[ch];
            for j in 0..taps {
                acc += w.conv[ch * d.kernel + j] * state.conv[j * conv + ch];
            }
            for j in 0..taps.saturating_sub(1) {
                state.conv[j * conv + ch] = state.conv[(j + 1) * conv + ch];
            }
            if taps > 0 {
                state.conv[(taps - 1) * conv + ch] = row[ch];
            }
            *cv = silu(acc);
        }
        let l2 = |v: &[f32]| -> Vec<f32> {
            let r = 1.0 / (v.iter().map(|a| a * a).sum::<f32>() + 1e-6).sqrt();
            v.iter().map(|a| a * r).collect()
        };
        for h in 0..d.v_heads {
            let kh = if tiled { h % d.k_heads } else { h / (d.v_heads / d.k_heads) };
            let q: Vec<f32> =
                l2(&c[kh * d.k_dim..(kh + 1) * d.k_dim]).iter().map(|v| v / (d.k_dim as f32).sqrt()).collect();
            let k = l2(&c[kd + kh * d.k_dim..kd + (kh + 1) * d.k_dim]);
            let v = &c[2 * kd + h * d.v_dim..2 * kd + (h + 1) * d.v_dim];
            let a = row[conv + vd + d.v_heads + h] + w.dt_bias[h];
            let sp = if a > 20.0 { a } else { a.exp().ln_1p() };
            let decay = (w.a[h] * sp).exp();
            let beta = sigmoid(row[conv + vd + h]);
            let s = &mut state.rec[h * d.k_dim * d.v_dim..(h + 1) * d.k_dim * d.v_dim];
            s.iter_mut().for_each(|e| *e *= decay);
            for j in 0..d.v_dim {
                let kv: f32 = (0..d.k_dim).map(|i| s[i * d.v_dim + j] * k[i]).sum();
                let delta = (v[j] - kv) * beta;
                for i in 0..d.k_dim {
                    s[i * d.v_dim + j] += k[i] * delta;
                }
            }
            let o: Vec<f32> = (0..d.v_dim).map(|j| (0..d.k_dim).map(|i| s[i * d.v_dim + j] * q[i]).sum()).collect();
            let r = 1.0 / (o.iter().map(|a| a * a).sum::<f32>() / d.v_dim as f32 + eps).sqrt();
            for j in 0..d.v_dim {
                let z = row[conv + h * d.v_dim + j];
                out[t * vd + h * d.v_dim + j] = w.norm[j] * (o[j] * r) * silu(z);
            }
        }
    }
    out
}
