//! The cpu profile's matmul (matmul.wgsl): register tiles of tokens x weight rows per thread,
//! x read from storage or, on llvmpipe, through uniform windows (`plan_x`); and the embedding
//! lookup (embed.wgsl), which both profiles run.

use super::matmul_shader;
use crate::gpu::family::Family;
use crate::gpu::shader::Shader;
use crate::gpu::wformat::WFormat;
use crate::gpu::Gpu;
use anyhow::Result;

/// Register tiles (tokens x weight rows per thread) of the matmul variants: decode-sized steps
/// use the small ones, prefill the last. A step of m rows uses the first tile with TM >= m
/// (the last for larger steps), so each weight is loaded once per TM tokens.
pub const MATMUL_TILES: [(u32, u32); 5] = [(1, 4), (2, 4), (4, 4), (8, 4), (16, 4)];
pub const MATMUL_WG: u32 = 64;

/// Index into MATMUL_TILES for a step of `m` rows.
pub fn tile_for_rows(m: u32) -> usize {
    MATMUL_TILES.iter().position(|t| t.0 >= m).unwrap_or(MATMUL_TILES.len() - 1)
}

pub enum XPlan {
    Storage { tile: usize },
    Uniform { tile: usize, windows: Vec<(u32, u32, u32)> },
}

/// Byte stride of the entries of the window buffer (a dynamic-offset alignment multiple).
pub fn window_stride(gpu: &Gpu) -> u32 {
    gpu.device.limits().min_uniform_buffer_offset_alignment.max(256)
}

/// The window buffer: entry 0 = the single window, entry w + 1 = window w.
pub fn window_entries(n: usize, stride: u32) -> Vec<u32> {
    let words = (stride / 4) as usize;
    let mut v = vec![0u32; (n + 1) * words];
    v[1] = 1;
    for w in 0..n {
        v[(w + 1) * words] = w as u32;
    }
    v
}

/// Plans a matmul of m rows of x_vec4 vec4s each (`uniform`: the uniform-x variant is bound).
pub fn plan_x(m: u32, x_vec4: u32, uniform: bool, align: u32, win_stride: u32) -> XPlan {
    let cap = UNIFORM_X_VEC4 / x_vec4;
    if !uniform || cap == 0 {
        return XPlan::Storage { tile: tile_for_rows(m) };
    }
    if m <= cap {
        return XPlan::Uniform { tile: tile_for_rows(m), windows: vec![(0, 0, m)] };
    }
    // Several windows: the largest tile that fits one, windows a whole number of tiles (as
    // window_size in the shader computes it), each starting at an aligned offset.
    let tile = MATMUL_TILES.iter().rposition(|t| t.0 <= cap).unwrap_or(0);
    let tm = MATMUL_TILES[tile].0;
    let rows = cap / tm * tm;
    let bytes = rows * x_vec4 * 16;
    if !bytes.is_multiple_of(align) {
        return XPlan::Storage { tile: tile_for_rows(m) };
    }
    let windows = (0..m.div_ceil(rows)).map(|w| (w * bytes, (w + 1) * win_stride, rows.min(m - w * rows))).collect();
    XPlan::Uniform { tile, windows }
}

pub use crate::gpu::{UNIFORM_X_BYTES, UNIFORM_X_VEC4};

const WINDOW_ALL: &str =
    "fn window_base() -> u32 {\n    return 0u;\n}\n\nfn window_rows(m: u32) -> u32 {\n    return m;\n}";

/// Uniform-x window: x is bound at a dynamic offset, `win` says which window of rows this
/// dispatch covers (`single`: the whole step fits one window starting at row 0).
const WINDOW_UNIFORM: &str = "struct Window {
    index: u32,
    single: u32,
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(7) var<uniform> win: Window;

// Rows per window: a whole number of tiles (the largest tile that fits, see plan_x).
fn window_size() -> u32 {
    return {{UX}}u / p.x_stride4 / TM * TM;
}

fn window_base() -> u32 {
    return select(win.index * window_size(), 0u, win.single == 1u);
}

fn window_rows(m: u32) -> u32 {
    return select(min(m - window_base(), window_size()), m, win.single == 1u);
}";

/// The matmul program for a weight format and register tile. With `uniform_x`, the activations
/// are read through a uniform binding: every thread of a workgroup reads the same x values, which
/// llvmpipe then loads once per SIMD batch instead of once per lane (steps whose x fits 64 KiB).
pub fn matmul_source(f: WFormat, tm: u32, tn: u32, uniform_x: bool) -> Result<String> {
    let (x, window) = if uniform_x {
        (format!("@group(0) @binding(2) var<uniform> x: array<vec4<f32>, {UNIFORM_X_VEC4}>;"), WINDOW_UNIFORM)
    } else {
        ("@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;".to_string(), WINDOW_ALL)
    };
    matmul_shader(
        Shader::new(format!("matmul_{}_{tm}x{tn}", f.name()), include_str!("../../../shaders/matmul/matmul.wgsl")),
        f,
    )
    .fill("X_BINDING", x)
    .fill("WINDOW", window)
    .fill_if(uniform_x, "UX", UNIFORM_X_VEC4)
    .fill("TM", tm)
    .fill("TN", tn)
    .fill("WG", MATMUL_WG)
    .build()
}

/// The embedding lookup of format `f` (embed.wgsl).
pub fn embed_source(f: WFormat) -> Result<String> {
    Shader::new(format!("embed_{}", f.name()), include_str!("../../../shaders/matmul/embed.wgsl"))
        .after(crate::ops::wgsl::common())
        .after(super::EmbedParams::WGSL)
        .after(f.snippet())
        .build()
}

crate::ops::bindings! {
    /// The uniform-x variant of matmul.wgsl (`MatmulBinds` with x a uniform window of
    /// UNIFORM_X_BYTES and `win`, the window entry, both at dynamic offsets).
    MatmulUxBinds {
        step: Uniform @ 0,
        p: Uniform @ 1,
        x: UniformDyn @ 2,
        wq: Read @ 3,
        ws: Read @ 4,
        bias: Read @ 5,
        y: ReadWrite @ 6,
        win: UniformDyn @ 7,
    }
}

/// The cpu profile's matmuls of one weight format.
pub struct MatmulPipelines {
    /// One per MATMUL_TILES entry.
    pub plain: Vec<wgpu::ComputePipeline>,
    /// Fused gate/up SwiGLU, one per MATMUL_TILES entry.
    pub swiglu: Vec<wgpu::ComputePipeline>,
    /// The same with x read through a uniform binding (matmul_u_family).
    pub plain_u: Vec<wgpu::ComputePipeline>,
    pub swiglu_u: Vec<wgpu::ComputePipeline>,
}

impl MatmulPipelines {
    /// Every register tile of `f`, plain and SwiGLU, x from storage (`family`) and through a
    /// uniform window (`u_family`).
    pub fn new(gpu: &Gpu, family: &Family, u_family: &Family, f: WFormat) -> Result<MatmulPipelines> {
        let n = f.name();
        let (mut plain, mut swiglu, mut plain_u, mut swiglu_u) = (vec![], vec![], vec![], vec![]);
        for &(tm, tn) in &MATMUL_TILES {
            let src = matmul_source(f, tm, tn, false)?;
            plain.push(family.pipeline(gpu, &format!("matmul_{n}_{tm}x{tn}"), &src, "main")?);
            swiglu.push(family.pipeline(gpu, &format!("swiglu_{n}_{tm}x{tn}"), &src, "main_swiglu")?);
            let src = matmul_source(f, tm, tn, true)?;
            plain_u.push(u_family.pipeline(gpu, &format!("matmul_{n}_{tm}x{tn}_ux"), &src, "main")?);
            swiglu_u.push(u_family.pipeline(gpu, &format!("swiglu_{n}_{tm}x{tn}_ux"), &src, "main_swiglu")?);
        }
        Ok(MatmulPipelines { plain, swiglu, plain_u, swiglu_u })
    }

    pub fn get(&self, tile: usize, swiglu: bool, uniform_x: bool) -> &wgpu::ComputePipeline {
        match (swiglu, uniform_x) {
            (false, false) => &self.plain[tile],
            (true, false) => &self.swiglu[tile],
            (false, true) => &self.plain_u[tile],
            (true, true) => &self.swiglu_u[tile],
        }
    }
}
