//! Matmul and embedding ops: y = x W^T over one weight matrix's row chunks (plain, fused
//! SwiGLU, or the up half of an unfused one), and the embedding lookup. Their parameters
//! (`MatParams`, `EmbedParams`), bindings, constructors and grids, and the family's kernels
//! (`MatmulKernels`): the cpu profile's register tiles and the embedding (`tiles`), the gpu
//! profile's decode kernels (`decode`) and GEMMs (`gemm`, with the plan of which runs when).

pub mod decode;
pub mod gemm;
pub mod tiles;

use super::cost::Cost;
use super::{bindings, div_up, Dispatch, FamilyOp, Op, OpKind, Program, Recorder, StepShape};
use crate::config::KernelProfile;
use crate::gpu::family::Family;
use crate::gpu::shader::Shader;
use crate::gpu::shared::gpu_struct;
use crate::gpu::tune_cache::TuneCache;
use crate::gpu::WFormat;
use crate::gpu::{Gpu, UNIFORM_X_BYTES};
use crate::weights::upload::{GpuChunk, GpuMatrix};
use anyhow::Result;
use decode::{int8_wanted, quantize_pipelines, GPU_DECODE_NR, GPU_DECODE_TM, INT8_MAX_ROWS};
use gemm::{gpu_matmul_pipelines, GemmKernel, GemmPlan, GpuMatmulPipelines};
use std::collections::BTreeMap;
use tiles::{embed_source, plan_x, MatmulPipelines, XPlan, MATMUL_TILES, MATMUL_WG};

gpu_struct! {
    /// Parameters of one row-chunk's matmul (matmul*.wgsl; WGSL `MatParams`).
    wgsl MatParams;
    pub struct MatParams {
        /// K / 32.
        pub k_blocks: u32,
        /// Rows of this chunk (for SwiGLU: rows of the gate half).
        pub n_rows: u32,
        /// First output column written by this chunk.
        pub row0: u32,
        /// Floats per output row.
        pub y_stride: u32,
        /// vec4s per input row.
        pub x_stride4: u32,
        /// 0: the step's n_tokens rows, 1: its n_sample rows.
        pub m_src: u32,
        /// MAT_* flags.
        pub flags: u32,
        /// The soft cap of MAT_SOFTCAP.
        pub cap: f32,
    }
}

gpu_struct! {
    /// Parameters of one row-chunk of the embedding lookup (embed.wgsl; WGSL `EmbedParams`).
    wgsl EmbedParams;
    pub struct EmbedParams {
        /// hidden / 32.
        pub k_blocks: u32,
        /// Rows (token ids) of this chunk of the table.
        pub n_rows: u32,
        /// First token id of this chunk.
        pub row0: u32,
        /// Every value is multiplied by it (Gemma's sqrt(hidden); else 1).
        pub scale: f32,
        /// 1: added into the output (Gemma 4's per-layer embeddings), else written.
        pub accumulate: u32,
        pub _p0: u32,
        pub _p1: u32,
        pub _p2: u32,
    }
}

/// MatParams flag: add the bias.
pub const MAT_BIAS: u32 = 1;
/// MatParams flag: add into y.
pub const MAT_ACCUMULATE: u32 = 2;
/// MatParams flag: y = silu(y) * result (the up half of an unfused SwiGLU; y holds the gate).
pub const MAT_SWIGLU_UP: u32 = 4;
/// MatParams flag: the gated FFN's activation is tanh-GELU (GeGLU) instead of SiLU.
pub const MAT_GELU: u32 = 8;
/// MatParams flag: every result becomes cap * tanh(result / cap) (MatParams::cap).
pub const MAT_SOFTCAP: u32 = 16;

/// The WGSL declarations of the matmul shaders: MatParams and its flags.
pub fn wgsl_matmul() -> String {
    format!(
        "{}const MAT_BIAS: u32 = {MAT_BIAS}u;\nconst MAT_ACCUMULATE: u32 = {MAT_ACCUMULATE}u;\n\
         const MAT_SWIGLU_UP: u32 = {MAT_SWIGLU_UP}u;\nconst MAT_GELU: u32 = {MAT_GELU}u;\n\
         const MAT_SOFTCAP: u32 = {MAT_SOFTCAP}u;\n",
        MatParams::WGSL
    )
}

bindings! {
    /// matmul.wgsl, matmul_gpu.wgsl, matmul_tiled.wgsl (the weight format's snippet declares
    /// wq and ws). The uniform-x variant binds x as a uniform window and adds `win` (7).
    MatmulBinds {
        step: Uniform @ 0,
        p: Uniform @ 1,
        x: Read @ 2,
        wq: Read @ 3,
        ws: Read @ 4,
        bias: Read @ 5,
        y: ReadWrite @ 6,
    }
}

bindings! {
    /// embed.wgsl, in the matmul family's layout (binding 5 unused).
    EmbedBinds {
        step: Uniform @ 0,
        p: Uniform @ 1,
        tokens: Read @ 2,
        wq: Read @ 3,
        ws: Read @ 4,
        unused: Read @ 5,
        hidden: ReadWrite @ 6,
    }
}

/// The matmul shaders' shared part after the weight format: MatParams, its flags, bindings and
/// epilogue.
fn matmul_common() -> String {
    format!("{}\n{}", wgsl_matmul(), include_str!("../../../shaders/matmul/matmul_common.wgsl"))
}

/// A matmul template after the shared declarations, the format's snippet and the matmul epilogue
/// (and after the parts `shader` has already, such as `enable` directives).
pub(crate) fn matmul_shader(shader: Shader, f: WFormat) -> Shader {
    shader.after(super::wgsl::common()).after(f.snippet()).after(matmul_common())
}

/// Every program of the family: each format's register tiles (storage and uniform x), its
/// embedding, decode kernels (f32 and int8 activations), tiled GEMMs, and the quantizations of x.
pub fn sources() -> super::Sources {
    let (mb, ub) = (MatmulBinds::BINDS, tiles::MatmulUxBinds::BINDS);
    let mut v: super::Sources = Vec::new();
    for f in WFormat::ALL {
        let n = f.name();
        for (tm, tn) in MATMUL_TILES {
            v.push(Program::new(format!("matmul_{n}_{tm}x{tn}"), tiles::matmul_source(f, tm, tn, false), mb));
            v.push(Program::new(format!("matmul_{n}_{tm}x{tn}_ux"), tiles::matmul_source(f, tm, tn, true), ub));
        }
        v.push(Program::new(format!("embed_{n}"), embed_source(f), EmbedBinds::BINDS));
        for swiglu in [false, true] {
            for tm in GPU_DECODE_TM {
                for sg in [false, true] {
                    let src = decode::matmul_gpu_source(f, tm, swiglu, sg);
                    v.push(Program::new(format!("matmul_gpu_{n}_{tm}_{swiglu}_{sg}"), src, mb));
                }
            }
            if f.has_int8() {
                for sg in [false, true] {
                    let src = decode::matmul_gpu_i8_source(f, swiglu, sg);
                    v.push(Program::new(format!("matmul_gpu_i8_{n}_{swiglu}_{sg}"), src, mb));
                }
            }
            for k in GemmKernel::TILES {
                if let GemmKernel::Tile { bm, f16 } = k {
                    let src = gemm::matmul_tiled_source(f, swiglu, bm, f16);
                    v.push(Program::new(format!("matmul_{}_{n}_{swiglu}", k.name()), src, mb));
                }
            }
        }
    }
    for xq in crate::gpu::wformat::XQuant::ALL {
        v.push(Program::new(decode::quantize_x8_label(xq), decode::quantize_x8_source(xq), mb));
    }
    v
}

/// Plain and SwiGLU pipelines of one program maker (label, source).
pub(crate) fn both(
    gpu: &Gpu,
    family: &Family,
    make: &dyn Fn(bool) -> (String, Result<String>),
) -> Result<[wgpu::ComputePipeline; 2]> {
    let (l0, s0) = make(false);
    let (l1, s1) = make(true);
    Ok([family.pipeline(gpu, &l0, &s0?, "main")?, family.pipeline(gpu, &l1, &s1?, "main")?])
}

/// The gpu profile's matmuls of a model's formats.
pub struct GpuMatmul {
    pub formats: BTreeMap<WFormat, GpuMatmulPipelines>,
    /// The activations' quantizations for the int8 matmuls (built where a format has them),
    /// in `XQuant` order.
    pub quantize_x8: Option<[wgpu::ComputePipeline; 3]>,
    /// Whether one-token steps run the int8 matmuls that were built (the tuner and tests turn
    /// it off to time and check the f32 ones).
    pub int8: bool,
}

impl GpuMatmul {
    /// Whether a step of `m` rows runs `format`'s int8 matmul (and quantizes x for it).
    pub fn int8_for(&self, format: WFormat, m: u32) -> bool {
        self.int8
            && m <= INT8_MAX_ROWS
            && self.formats.get(&format).is_some_and(|p| p.int8.is_some() && p.plan.kernel_for(m) == GemmKernel::Decode)
    }
}

/// The matmul family's kernels for a model's weight formats.
pub struct MatmulKernels {
    /// `MatmulBinds` (and `EmbedBinds`).
    pub family: Family,
    /// The same with binding 2 uniform (a UNIFORM_X_BYTES window of x) and the window entry
    /// at 7, both at dynamic offsets.
    pub u_family: Family,
    /// The embedding lookup per format (both profiles).
    pub embed: BTreeMap<WFormat, wgpu::ComputePipeline>,
    /// The cpu profile's register tiles per format (none on the gpu profile).
    pub tiles: BTreeMap<WFormat, MatmulPipelines>,
    /// The gpu profile's matmuls, when built for it.
    pub gpu: Option<GpuMatmul>,
}

impl MatmulKernels {
    /// The kernels of `formats` for `profile`; on the gpu profile the plans and the int8 choice
    /// come from `cache` (the tuner's) unless `int8` forces it (`KernelSpec::int8`).
    pub fn new(
        gpu: &Gpu,
        formats: &[WFormat],
        profile: KernelProfile,
        int8: Option<bool>,
        cache: Option<&TuneCache>,
    ) -> Result<MatmulKernels> {
        let family = Family::new(gpu, &super::layout_of(MatmulBinds::SLOTS));
        let u_family = Family::new(gpu, &super::layout_of(tiles::MatmulUxBinds::SLOTS));
        // Each format once.
        let formats: std::collections::BTreeSet<WFormat> = formats.iter().copied().collect();
        let mut embed = BTreeMap::new();
        let mut tiles = BTreeMap::new();
        for &f in &formats {
            embed.insert(f, family.pipeline(gpu, &format!("embed_{}", f.name()), &embed_source(f)?, "main")?);
            if profile != KernelProfile::Gpu {
                tiles.insert(f, MatmulPipelines::new(gpu, &family, &u_family, f)?);
            }
        }
        let gpu_matmul = if profile == KernelProfile::Gpu {
            let mut by_format = BTreeMap::new();
            for &f in &formats {
                let plan = GemmPlan::for_device(gpu, f, cache)?;
                let on = int8_wanted(gpu, f, int8, cache)?;
                by_format.insert(f, gpu_matmul_pipelines(gpu, &family, f, plan, on)?);
            }
            let quantize_x8 = if by_format.values().any(|p| p.int8.is_some()) {
                Some(quantize_pipelines(gpu, &family)?)
            } else {
                None
            };
            Some(GpuMatmul { formats: by_format, quantize_x8, int8: true })
        } else {
            None
        };
        Ok(MatmulKernels { family, u_family, embed, tiles, gpu: gpu_matmul })
    }
}

impl MatParams {
    /// Parameters of one row-chunk's matmul (see matmul.wgsl), writing output columns from
    /// `col0` + the chunk's first row.
    pub(crate) fn new(cols: usize, chunk: &GpuChunk, col0: usize, y_stride: usize, sampled: bool, flags: u32) -> Self {
        MatParams {
            k_blocks: (cols / 32) as u32,
            n_rows: chunk.rows as u32,
            row0: (col0 + chunk.row0) as u32,
            y_stride: y_stride as u32,
            x_stride4: (cols / 4) as u32,
            m_src: sampled as u32,
            flags,
            ..Default::default()
        }
    }
}

/// What a matmul reads and writes besides its weights.
pub struct MatmulIo<'a> {
    pub step: &'a wgpu::Buffer,
    pub x: &'a wgpu::Buffer,
    pub y: &'a wgpu::Buffer,
    /// The bias (bound whole; each chunk's row0 offsets into it), or a placeholder.
    pub bias: &'a wgpu::Buffer,
    /// The uniform-x window entries, to also build the uniform-x bind group (cpu profile).
    pub windows: Option<&'a wgpu::Buffer>,
    /// The soft cap of MAT_SOFTCAP (unused without it).
    pub cap: f32,
    /// gpu profile: where x is quantized for the int8 matmuls (at least `xq_bytes` of the
    /// matrix); None keeps every step on f32 activations.
    pub xq: Option<&'a wgpu::Buffer>,
}

/// Bytes of the int8 activations (quantize_x8.wgsl) of a matmul of `cols` columns: 48 per
/// 32-value block of INT8_MAX_ROWS rows.
pub fn xq_bytes(cols: usize) -> u64 {
    (cols / 32 * 48) as u64 * INT8_MAX_ROWS as u64
}

/// The ops of y (columns col0.. of rows of `y_stride` floats; flags: MAT_*) = x W^T for every
/// row chunk of `m`, over the sampled rows when `sampled`; `swiglu`: `m` holds gate and up.
/// Returns the ops and their parameter buffers (kept alive by the bind groups).
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    k: &MatmulKernels,
    g: &Gpu,
    m: &GpuMatrix,
    io: &MatmulIo,
    (col0, y_stride): (usize, usize),
    flags: u32,
    sampled: bool,
    swiglu: bool,
) -> (Vec<Op>, Vec<wgpu::Buffer>) {
    let mut ops = Vec::new();
    let mut params = Vec::new();
    // gpu profile: x quantized once for every chunk's int8 kernel.
    let xq =
        io.xq.filter(|_| k.gpu.as_ref().is_some_and(|gk| gk.formats.get(&m.format).is_some_and(|p| p.int8.is_some())));
    for c in &m.chunks {
        let pb = g.uniform_init(
            "matmul_params",
            bytemuck::bytes_of(&MatParams { cap: io.cap, ..MatParams::new(m.cols, c, col0, y_stride, sampled, flags) }),
        );
        let b = MatmulBinds { step: io.step, p: &pb, x: io.x, wq: &c.q, ws: &c.s, bias: io.bias, y: io.y };
        let entries = b.entries();
        let bind = k.family.bind(g, &entries);
        if let Some(xq) = xq.filter(|_| ops.is_empty()) {
            // The quantization reads x and writes xq (as its `y`); weights and bias unused.
            let q = MatmulBinds { step: io.step, p: &pb, x: io.x, wq: &c.q, ws: &c.s, bias: io.bias, y: xq };
            let kind = OpKind::from(MatmulOp::QuantizeX8 { format: m.format, k_blocks: (m.cols / 32) as u32, sampled });
            ops.push(Op { kind, label: kind.family(), bind: k.family.bind(g, &q.entries()), bind_x: None });
        }
        // (The gpu profile never reads x through uniform windows.)
        let bind_x = match (xq, io.windows) {
            (Some(xq), _) => Some(k.family.bind(g, &MatmulBinds { x: xq, ..b }.entries())),
            (None, Some(w)) => Some(k.u_family.bind_windows(g, &entries, &[(2, UNIFORM_X_BYTES)], &[(7, w, 16)])),
            (None, None) => None,
        };
        let kind = OpKind::from(MatmulOp::Matmul {
            format: m.format,
            rows: c.rows as u32,
            x_vec4: (m.cols / 4) as u32,
            sampled,
            swiglu,
        });
        ops.push(Op { kind, label: kind.family(), bind, bind_x });
        params.push(pb);
    }
    (ops, params)
}

/// The family's ops: the embedding, the matmuls and the int8 quantization of their x.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MatmulOp {
    /// Embedding rows of the step's tokens from one row-chunk of the table.
    Embed { format: WFormat, k_blocks: u32 },
    /// One row-chunk of a weight matrix: `rows` weight rows (gate rows for `swiglu`),
    /// `x_vec4` vec4s per activation row; over the sampled rows when `sampled`.
    Matmul { format: WFormat, rows: u32, x_vec4: u32, sampled: bool, swiglu: bool },
    /// The int8 quantization of a matmul's x (`k_blocks` 32-value blocks per row, the step's
    /// tokens or its sampled rows), for the matmuls of `format` after it; it runs only in the
    /// steps that run their int8 kernel (`GpuPipelines::int8_for`).
    QuantizeX8 { format: WFormat, k_blocks: u32, sampled: bool },
}

impl FamilyOp for MatmulOp {
    fn family(&self) -> &'static str {
        match self {
            MatmulOp::Embed { .. } => "embed",
            MatmulOp::Matmul { .. } => "matmul",
            MatmulOp::QuantizeX8 { .. } => "quantize_x8",
        }
    }

    fn cost(&self, s: &StepShape, _kv_bytes: u64) -> Cost {
        match *self {
            MatmulOp::Embed { format, k_blocks } => embed_cost(s, format, k_blocks),
            MatmulOp::Matmul { format, rows, x_vec4, sampled, swiglu } => {
                cost(s, (format, rows, x_vec4), (sampled, swiglu))
            }
            MatmulOp::QuantizeX8 { k_blocks, sampled, .. } => quantize_cost(s, k_blocks, sampled),
        }
    }

    fn dispatches<'a>(&self, op: &'a Op, r: &Recorder<'a>, s: &StepShape, out: impl FnMut(Dispatch<'a>)) {
        match *self {
            MatmulOp::Embed { format, k_blocks } => embed_dispatches(op, r, s, format, k_blocks, out),
            MatmulOp::Matmul { format, rows, x_vec4, sampled, swiglu } => {
                dispatches(op, r, s, (format, rows, x_vec4), (sampled, swiglu), out)
            }
            MatmulOp::QuantizeX8 { format, k_blocks, sampled } => {
                quantize_dispatches(op, r, s, (format, k_blocks, sampled), out)
            }
        }
    }
}

/// The quantization of x for the int8 matmuls: one invocation per 32-value block of each row,
/// quantized as the format's `int8_x` says, in the steps that run them.
fn quantize_dispatches<'a>(
    op: &'a Op,
    r: &Recorder<'a>,
    s: &StepShape,
    (format, k_blocks, sampled): (WFormat, u32, bool),
    mut out: impl FnMut(Dispatch<'a>),
) {
    let m = if sampled { s.n_sample } else { s.n_tokens };
    if let Some(gk) = r.kernels.matmul.gpu.as_ref().filter(|gk| m > 0 && gk.int8_for(format, m)) {
        if let Some(pipes) = &gk.quantize_x8 {
            let pipe = &pipes[format.int8_x() as usize];
            out(r.folded(pipe, &op.bind, div_up(m * k_blocks, 64)));
        }
    }
}

/// The embedding lookup of the step's tokens (`tokens`: the step metadata, whose first words
/// are the token ids) into `hidden`, one op per row chunk of the table `e`, every value times
/// `scale`.
#[allow(clippy::too_many_arguments)]
pub fn embed(
    k: &MatmulKernels,
    g: &Gpu,
    e: &GpuMatrix,
    (scale, accumulate): (f32, bool),
    step: &wgpu::Buffer,
    tokens: &wgpu::Buffer,
    placeholder: &wgpu::Buffer,
    hidden: &wgpu::Buffer,
) -> (Vec<Op>, Vec<wgpu::Buffer>) {
    let k_blocks = (e.cols / 32) as u32;
    let mut ops = Vec::new();
    let mut params = Vec::new();
    for c in &e.chunks {
        let p = EmbedParams {
            k_blocks,
            n_rows: c.rows as u32,
            row0: c.row0 as u32,
            scale,
            accumulate: accumulate as u32,
            ..Default::default()
        };
        let pb = g.uniform_init("embed_params", bytemuck::bytes_of(&p));
        let b = EmbedBinds { step, p: &pb, tokens, wq: &c.q, ws: &c.s, unused: placeholder, hidden };
        let kind = OpKind::from(MatmulOp::Embed { format: e.format, k_blocks });
        ops.push(Op { kind, label: kind.family(), bind: k.family.bind(g, &b.entries()), bind_x: None });
        params.push(pb);
    }
    (ops, params)
}

/// The embedding's grid: one thread per (token, 32-element block).
fn embed_dispatches<'a>(
    op: &'a Op,
    r: &Recorder<'a>,
    s: &StepShape,
    format: WFormat,
    k_blocks: u32,
    mut out: impl FnMut(Dispatch<'a>),
) {
    out(r.folded(&r.kernels.matmul.embed[&format], &op.bind, div_up(s.n_tokens * k_blocks, 64)));
}

/// A matmul's dispatches over the step's rows (or its sampled rows): the gpu profile's decode
/// kernel or a GEMM variant, as the format's GEMM plan says for m rows; on the cpu profile the register tile
/// for the rows, reading x from storage or through uniform windows (one dispatch per window).
fn dispatches<'a>(
    op: &'a Op,
    r: &Recorder<'a>,
    s: &StepShape,
    (format, rows, x_vec4): (WFormat, u32, u32),
    (sampled, swiglu): (bool, bool),
    mut out: impl FnMut(Dispatch<'a>),
) {
    let k = &r.kernels.matmul;
    let m = if sampled { s.n_sample } else { s.n_tokens };
    if m == 0 {
        return;
    }
    if let Some(gk) = &k.gpu {
        let p = &gk.formats[&format];
        let sw = swiglu as usize;
        if let (Some(i8), Some(bind_x), true) = (&p.int8, &op.bind_x, gk.int8_for(format, m)) {
            out(r.folded(&i8[sw], bind_x, div_up(rows, if swiglu { GPU_DECODE_NR / 2 } else { GPU_DECODE_NR })));
            return;
        }
        let last = GPU_DECODE_TM.len() - 1;
        let (pipe, tm, outs) = match (p.plan.kernel_for(m), GPU_DECODE_TM.iter().position(|&t| t >= m)) {
            (GemmKernel::Decode, Some(i)) => (&p.decode[i][sw], GPU_DECODE_TM[i], GPU_DECODE_NR),
            (GemmKernel::Decode, None) => (&p.decode[last][sw], GPU_DECODE_TM[last], GPU_DECODE_NR),
            (g, _) => (&p.gemm(g)[sw], g.tokens(), g.cols()),
        };
        let outs = if swiglu { outs / 2 } else { outs };
        out(r.folded(pipe, &op.bind, div_up(rows, outs) * div_up(m, tm)));
        return;
    }
    let mk = &k.tiles[&format];
    match (plan_x(m, x_vec4, op.bind_x.is_some(), r.align, r.win_stride), &op.bind_x) {
        (XPlan::Uniform { tile, windows }, Some(bind_x)) => {
            let (tm, tn) = MATMUL_TILES[tile];
            for (x_off, win_off, rows_w) in windows {
                out(Dispatch {
                    pipe: mk.get(tile, swiglu, true),
                    bind: bind_x,
                    offsets: Some([x_off, win_off]),
                    grid: (div_up(div_up(rows, tn), MATMUL_WG), div_up(rows_w, tm)),
                });
            }
        }
        (XPlan::Storage { tile }, _) | (XPlan::Uniform { tile, .. }, None) => {
            let tile = r.tile_override.unwrap_or(tile);
            let (tm, tn) = MATMUL_TILES[tile];
            out(Dispatch {
                pipe: mk.get(tile, swiglu, false),
                bind: &op.bind,
                offsets: None,
                grid: (div_up(div_up(rows, tn), MATMUL_WG), div_up(m, tm)),
            });
        }
    }
}

/// The embedding lookup's bytes and FLOPs in a step of shape `s`.
fn embed_cost(s: &StepShape, format: WFormat, k_blocks: u32) -> Cost {
    let (n, k) = (s.n_tokens as u64, k_blocks as u64 * 32);
    Cost { bytes: n * (format.row_bytes(k as usize) as u64 + 4 * k), flops: n * k }
}

/// A matmul chunk's bytes and FLOPs in a step of shape `s`.
fn cost(s: &StepShape, (format, rows, x_vec4): (WFormat, u32, u32), (sampled, swiglu): (bool, bool)) -> Cost {
    let m = if sampled { s.n_sample } else { s.n_tokens } as u64;
    if m == 0 {
        return Cost::default();
    }
    let k = x_vec4 as u64 * 4;
    // SwiGLU chunks hold gate and up rows and write one output per pair.
    let (w_rows, outs) = if swiglu { (2 * rows as u64, rows as u64) } else { (rows as u64, rows as u64) };
    let weights = w_rows * format.row_bytes(k as usize) as u64;
    Cost { bytes: weights + 4 * m * k + 4 * m * outs, flops: 2 * m * w_rows * k }
}

/// The quantization of x's bytes and FLOPs: it runs in one-token steps only (INT8_MAX_ROWS),
/// reads f32 x and writes 48 bytes per block.
fn quantize_cost(s: &StepShape, k_blocks: u32, sampled: bool) -> Cost {
    let m = if sampled { s.n_sample } else { s.n_tokens };
    if m != 1 {
        return Cost::default();
    }
    Cost { bytes: k_blocks as u64 * (128 + 48), flops: k_blocks as u64 * 32 * 3 }
}
