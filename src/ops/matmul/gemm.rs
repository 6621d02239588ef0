//! The gpu profile's GEMM for steps of many rows (batched decode, speculative verification,
//! prefill): its variants (matmul_tiled.wgsl's tile shapes and operand types, the
//! cooperative-matrix kernel), the plan that says which kernel a step of m rows runs, where a
//! plan comes from (the environment, the tuner's cache, the default) and the pipelines of a plan.

use super::decode::{decode_pipelines, int8_pipelines, GPU_DECODE_MAX_ROWS, MATMUL_GPU_WGSL};
use super::{both, matmul_shader};
use crate::gpu::coop::CoopShape;
use crate::gpu::family::Family;
use crate::gpu::shader::Shader;
use crate::gpu::tune_cache::{fnv, GemmRecord, TuneCache};
use crate::gpu::wformat::WFormat;
use crate::gpu::Gpu;
use anyhow::{anyhow, Result};

/// Steps of this many rows or more take the plan's `large` GEMM (prefill-sized), fewer its
/// `small` one (batched decode, speculative verification).
pub const LARGE_ROWS: u32 = 64;
/// Sets the fewest rows a step has for the gpu profile's matmuls to take a GEMM instead of the
/// decode kernel (over the tuner's choice; default GPU_DECODE_MAX_ROWS + 1).
pub const GEMM_MIN_ROWS_ENV: &str = "TORUS_GEMM_MIN_ROWS";
/// Sets the GEMM variant (a GemmKernel name: tile64, tile32, tile64h, tile32h) for every step
/// that takes a GEMM, over the tuner's choice.
pub const GEMM_TILE_ENV: &str = "TORUS_GEMM_TILE";

/// What a matmul of a step runs on the gpu profile.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GemmKernel {
    /// The decode kernel (matmul_gpu.wgsl): a matrix-vector product per group of up to 16 rows.
    Decode,
    /// matmul_tiled.wgsl with tiles of `bm` tokens (32, 64 or 128) x `cols()` weight rows, the
    /// tiles' elements in f16 (`f16`, where the device has shader-f16) or f32; f32 accumulation
    /// either way.
    Tile { bm: u32, f16: bool },
    /// matmul_coop.wgsl on the device's cooperative-matrix shape (gpu::coop): 64 x 64 tiles.
    Coop,
}

impl GemmKernel {
    /// The default GEMM: 64 x 64 tiles in f32.
    pub const TILE64: GemmKernel = GemmKernel::Tile { bm: 64, f16: false };
    /// Every tiled variant.
    pub const TILES: [GemmKernel; 6] = [
        GemmKernel::TILE64,
        GemmKernel::Tile { bm: 32, f16: false },
        GemmKernel::Tile { bm: 128, f16: false },
        GemmKernel::Tile { bm: 64, f16: true },
        GemmKernel::Tile { bm: 32, f16: true },
        GemmKernel::Tile { bm: 128, f16: true },
    ];

    pub fn name(self) -> String {
        match self {
            GemmKernel::Decode => "decode".into(),
            GemmKernel::Tile { bm, f16 } => format!("tile{bm}{}", if f16 { "h" } else { "" }),
            GemmKernel::Coop => "coop".into(),
        }
    }

    pub fn parse(s: &str) -> Option<GemmKernel> {
        match s.trim() {
            "decode" => Some(GemmKernel::Decode),
            "coop" => Some(GemmKernel::Coop),
            s => GemmKernel::TILES.into_iter().find(|k| k.name() == s),
        }
    }

    /// Tokens per workgroup of a GEMM variant (0 for the decode kernel, which groups by 16).
    pub fn tokens(self) -> u32 {
        match self {
            GemmKernel::Decode => 0,
            GemmKernel::Tile { bm, .. } => bm,
            GemmKernel::Coop => 64,
        }
    }

    /// Weight rows per workgroup of a GEMM variant (gate+up rows for SwiGLU: half as many
    /// outputs); 0 for the decode kernel.
    pub fn cols(self) -> u32 {
        match self {
            GemmKernel::Decode => 0,
            GemmKernel::Tile { bm: 128, .. } => 128,
            GemmKernel::Tile { .. } | GemmKernel::Coop => 64,
        }
    }

    /// Invocations per workgroup of a tiled variant (64, or 256 for 128 x 128 tiles).
    fn invocations(self) -> u32 {
        if self.cols() == 128 {
            256
        } else {
            64
        }
    }

    /// Workgroup memory of a tiled variant: a 32-deep block of its x and weight tiles.
    fn workgroup_bytes(self) -> u32 {
        match self {
            GemmKernel::Tile { bm, f16 } => 32 * (bm + self.cols()) * if f16 { 2 } else { 4 },
            _ => 0,
        }
    }

    /// Whether `gpu` can build it: f16 tiles need shader-f16, every tile its workgroup memory and
    /// invocations, Coop the cooperative-matrix shape.
    pub fn runs_on(self, gpu: &Gpu) -> bool {
        let l = gpu.device.limits();
        match self {
            GemmKernel::Decode => true,
            GemmKernel::Tile { f16, .. } => {
                (!f16 || gpu.f16)
                    && self.workgroup_bytes() <= l.max_compute_workgroup_storage_size
                    && self.invocations() <= l.max_compute_invocations_per_workgroup.min(l.max_compute_workgroup_size_x)
            }
            GemmKernel::Coop => gpu.coop.is_some(),
        }
    }

    /// The GEMM variants `gpu` can build (what the tuner measures).
    pub fn available(gpu: &Gpu) -> Vec<GemmKernel> {
        GemmKernel::TILES.into_iter().chain([GemmKernel::Coop]).filter(|k| k.runs_on(gpu)).collect()
    }
}

/// Which kernel a step of m rows runs, for one weight format: the decode kernel below
/// `min_rows`, `small` from there to LARGE_ROWS, `large` from there on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmPlan {
    pub min_rows: u32,
    pub small: GemmKernel,
    pub large: GemmKernel,
}

impl Default for GemmPlan {
    /// The plan without a tuner's choice: the decode kernel up to GPU_DECODE_MAX_ROWS rows, the
    /// 64 x 64 f32 tiles above.
    fn default() -> GemmPlan {
        GemmPlan { min_rows: GPU_DECODE_MAX_ROWS + 1, small: GemmKernel::TILE64, large: GemmKernel::TILE64 }
    }
}

impl GemmPlan {
    /// One GEMM variant for every step of `min_rows` rows or more.
    pub fn only(kernel: GemmKernel, min_rows: u32) -> GemmPlan {
        GemmPlan { min_rows, small: kernel, large: kernel }
    }

    pub fn kernel_for(&self, m: u32) -> GemmKernel {
        if m < self.min_rows {
            GemmKernel::Decode
        } else if m < LARGE_ROWS {
            self.small
        } else {
            self.large
        }
    }

    /// The GEMM variants the plan runs (each once).
    pub fn kernels(&self) -> Vec<GemmKernel> {
        let mut v: Vec<GemmKernel> =
            [self.small, self.large].into_iter().filter(|&k| k != GemmKernel::Decode).collect();
        v.dedup();
        v
    }

    pub fn describe(&self) -> String {
        format!(
            "decode below {} rows, {} below {LARGE_ROWS}, {} from {LARGE_ROWS}",
            self.min_rows,
            self.small.name(),
            self.large.name()
        )
    }

    pub fn record(&self) -> GemmRecord {
        GemmRecord { min_rows: self.min_rows, small: self.small.name(), large: self.large.name() }
    }

    /// A cached record read back (None when it names a kernel this binary does not have).
    pub fn from_record(r: &GemmRecord) -> Option<GemmPlan> {
        let plan = GemmPlan {
            min_rows: r.min_rows.max(1),
            small: GemmKernel::parse(&r.small)?,
            large: GemmKernel::parse(&r.large)?,
        };
        (plan.small != GemmKernel::Decode && plan.large != GemmKernel::Decode).then_some(plan)
    }

    /// The plan for `format` on `gpu`: the tuner's cached choice for this adapter (or the
    /// default), under the environment's overrides (GEMM_MIN_ROWS_ENV, GEMM_TILE_ENV,
    /// gpu::coop::COOP_ENV=1); a variant the device cannot build gives way to the 64 x 64 tiles.
    pub fn for_device(gpu: &Gpu, format: WFormat, cache: Option<&TuneCache>) -> Result<GemmPlan> {
        let mut plan = cache
            .and_then(|c| c.gemm(&gpu.info, tuned_kernels(), format.name()))
            .and_then(GemmPlan::from_record)
            .unwrap_or_default();
        if let Some(n) = env_min_rows()? {
            plan.min_rows = n;
        }
        if let Ok(v) = std::env::var(GEMM_TILE_ENV) {
            let k = GemmKernel::parse(&v).filter(|&k| k != GemmKernel::Decode).ok_or_else(|| {
                anyhow!("{GEMM_TILE_ENV} must be one of tile64, tile32, tile64h, tile32h, coop; got {v:?}")
            })?;
            plan.small = k;
            plan.large = k;
        }
        if crate::gpu::coop::opted_in() && gpu.coop.is_some() {
            plan.small = GemmKernel::Coop;
            plan.large = GemmKernel::Coop;
        }
        for k in [&mut plan.small, &mut plan.large] {
            if !k.runs_on(gpu) {
                tracing::info!(
                    "GEMM variant {} cannot run on this device: {} instead",
                    k.name(),
                    GemmKernel::TILE64.name()
                );
                *k = GemmKernel::TILE64;
            }
        }
        if plan != GemmPlan::default() {
            tracing::info!("{} matmuls: {}", format.name(), plan.describe());
        }
        Ok(plan)
    }
}

/// GEMM_MIN_ROWS_ENV, when set.
fn env_min_rows() -> Result<Option<u32>> {
    match std::env::var(GEMM_MIN_ROWS_ENV) {
        Err(_) => Ok(None),
        Ok(v) => match v.trim().parse::<u32>() {
            Ok(n) if n >= 1 => {
                tracing::info!("{GEMM_MIN_ROWS_ENV}={n}: steps of {n} rows or more take a GEMM");
                Ok(Some(n))
            }
            _ => Err(anyhow!("{GEMM_MIN_ROWS_ENV} must be a positive number of rows, got {v:?}")),
        },
    }
}

/// Tokens per invocation of a tiled variant of `bm` tokens.
fn tokens_per_invocation(bm: u32) -> u32 {
    if bm == 32 {
        4
    } else {
        8
    }
}

/// The multiply-adds of one k of matmul_tiled.wgsl, unrolled (acc indices constant, so the
/// accumulators stay in registers): the x vec4 of tokens q BM/2 + 4ty.. times both row halves.
pub(crate) fn tiled_fma(bm: u32) -> String {
    let mut s = String::new();
    for q in 0..tokens_per_invocation(bm) / 4 {
        s += &format!("            let x{q} = vec4<f32>(xt[k * XQ + {}u + ty]);\n", q * bm / 8);
        for c in 0..4 {
            let j = 4 * q + c;
            let comp = ["x", "y", "z", "w"][c as usize];
            s += &format!("            acc[{}] += x{q}.{comp} * wa;\n", 2 * j);
            s += &format!("            acc[{}] += x{q}.{comp} * wb;\n", 2 * j + 1);
        }
    }
    s
}

const TILED_WGSL: &str = include_str!("../../../shaders/matmul/matmul_tiled.wgsl");
const COOP_WGSL: &str = include_str!("../../../shaders/matmul/matmul_coop.wgsl");

/// The hash the tuner keys its choices by (gpu::tune_cache): this binary's version and the
/// sources of the kernels it chooses among (the decode matmul, the tiled and cooperative
/// GEMMs, the tiled experts). A change to any of them makes the cached choices stale.
pub fn tuned_kernels() -> u64 {
    let moe = crate::ops::moe::MOE_TILED_WGSL;
    fnv(&[env!("CARGO_PKG_VERSION"), MATMUL_GPU_WGSL, TILED_WGSL, TILE_LOAD, TILE_ROW, moe, COOP_WGSL])
}

pub(crate) const TILE_LOAD: &str = include_str!("../../../shaders/matmul/matmul_tile_load.wgsl");
pub(crate) const TILE_ROW: &str = include_str!("../../../shaders/matmul/matmul_tile_row.wgsl");
/// The prefill-sized matmul on cooperative matrices of `shape` (see matmul_coop.wgsl and
/// gpu::coop): the `enable` directives first, then the usual parts.
pub fn matmul_coop_source(f: WFormat, swiglu: bool, shape: CoopShape) -> Result<String> {
    let enables =
        if shape.f16 { "enable f16;\nenable wgpu_cooperative_matrix;" } else { "enable wgpu_cooperative_matrix;" };
    let to_ab = if shape.f16 { "return f16(clamp(v, -65504.0, 65504.0));" } else { "return v;" };
    Shader::new(format!("matmul_coop_{}_{}", f.name(), shape.side), COOP_WGSL)
        .after(enables)
        .after(crate::ops::wgsl::common())
        .after(f.snippet())
        .after(super::matmul_common())
        .after(TILE_LOAD)
        .after(TILE_ROW)
        .fill("MS", shape.side)
        .fill("SG", shape.subgroup)
        .fill("AB", if shape.f16 { "f16" } else { "f32" })
        .fill("TO_AB", to_ab)
        .fill("SWIGLU", swiglu)
        .build()
}

/// Every cooperative-matrix GEMM the engine can build (each format, SwiGLU or not, the shapes
/// gpu::coop chooses), with a label: what the naga and SPIR-V test checks.
pub fn coop_sources() -> Vec<(String, String)> {
    let shapes = [(16, true, 32), (16, true, 64), (16, true, 16), (8, false, 32), (8, false, 16)];
    let mut v = Vec::new();
    for f in WFormat::ALL {
        for (side, f16, subgroup) in shapes {
            for swiglu in [false, true] {
                let shape = CoopShape { side, f16, subgroup };
                let label = format!("matmul_coop_{}_{side}_{subgroup}_{swiglu}", f.name());
                let src = matmul_coop_source(f, swiglu, shape).unwrap_or_else(|e| panic!("{label}: {e:#}"));
                v.push((label, src));
            }
        }
    }
    v
}

/// A tiled GEMM variant's program (see matmul_tiled.wgsl).
pub fn matmul_tiled_source(f: WFormat, swiglu: bool, bm: u32, f16: bool) -> Result<String> {
    let label = format!("matmul_tiled_{}_{bm}{}", f.name(), if f16 { "h" } else { "" });
    let shader = if f16 { Shader::new(label, TILED_WGSL).after("enable f16;") } else { Shader::new(label, TILED_WGSL) };
    let k = GemmKernel::Tile { bm, f16 };
    matmul_shader(shader, f)
        .after(TILE_LOAD)
        .after(TILE_ROW)
        .fill("SWIGLU", swiglu)
        .fill("BM", bm)
        .fill("BN", k.cols())
        .fill("WG", k.invocations())
        .fill("NJ", tokens_per_invocation(bm))
        .fill("AB", if f16 { "f16" } else { "f32" })
        .fill("TO_AB", if f16 { "return f16(clamp(v, -65504.0, 65504.0));" } else { "return v;" })
        .fill("FMA", tiled_fma(bm))
        .build()
}

/// The program of GEMM variant `k` (not Decode) for `f`, or why it cannot be built here.
pub fn gemm_source(gpu: &Gpu, k: GemmKernel, f: WFormat, swiglu: bool) -> Result<String> {
    match k {
        GemmKernel::Decode => Err(anyhow!("the decode kernel is not a GEMM variant")),
        GemmKernel::Tile { bm, f16 } => matmul_tiled_source(f, swiglu, bm, f16),
        GemmKernel::Coop => {
            let shape = gpu.coop.ok_or_else(|| anyhow!("this device has no cooperative matrices"))?;
            matmul_coop_source(f, swiglu, shape)
        }
    }
}

/// The gpu profile's matmuls of `f` for `plan`: the decode kernels and the plan's GEMMs.
pub fn gpu_matmul_pipelines(
    gpu: &Gpu,
    family: &Family,
    f: WFormat,
    plan: GemmPlan,
    int8: bool,
) -> Result<GpuMatmulPipelines> {
    let decode = decode_pipelines(gpu, family, f)?;
    let int8 = if int8 { Some(int8_pipelines(gpu, family, f)?) } else { None };
    let mut p = GpuMatmulPipelines { decode, gemm: Vec::new(), plan, int8 };
    for k in plan.kernels() {
        add_gemm(gpu, family, f, &mut p, k)?;
    }
    Ok(p)
}

/// The gpu profile's matmuls of one weight format (`gpu_matmul_pipelines` builds them).
pub struct GpuMatmulPipelines {
    /// Decode-sized, one per GPU_DECODE_TM entry: [plain, swiglu].
    pub decode: Vec<[wgpu::ComputePipeline; 2]>,
    /// The GEMM variants built ([plain, swiglu] each): those of `plan` (and, in the kernel
    /// harness, any other it was asked for).
    pub gemm: Vec<(GemmKernel, [wgpu::ComputePipeline; 2])>,
    /// Which kernel a step of m rows runs.
    pub plan: GemmPlan,
    /// The one-token decode kernel on int8 activations ([plain, swiglu]), where `int8_wanted`.
    pub int8: Option<[wgpu::ComputePipeline; 2]>,
}

impl GpuMatmulPipelines {
    /// The pipelines of GEMM variant `k` (built with the plan).
    pub fn gemm(&self, k: GemmKernel) -> &[wgpu::ComputePipeline; 2] {
        &self.gemm.iter().find(|(g, _)| *g == k).expect("a GEMM variant of the plan is built with it").1
    }
}

/// Builds GEMM variant `k` of `f` into `p` unless it is there.
pub fn add_gemm(gpu: &Gpu, family: &Family, f: WFormat, p: &mut GpuMatmulPipelines, k: GemmKernel) -> Result<()> {
    if k == GemmKernel::Decode || p.gemm.iter().any(|(g, _)| *g == k) {
        return Ok(());
    }
    let name = format!("matmul_{}_{}", k.name(), f.name());
    let pipes = both(gpu, family, &|sw| (format!("{name}_{sw}"), gemm_source(gpu, k, f, sw)))?;
    p.gemm.push((k, pipes));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_pick_by_rows_and_read_back() {
        let plan = GemmPlan { min_rows: 8, small: GemmKernel::Tile { bm: 32, f16: true }, large: GemmKernel::Coop };
        assert_eq!(plan.kernel_for(7), GemmKernel::Decode);
        assert_eq!(plan.kernel_for(8), plan.small);
        assert_eq!(plan.kernel_for(63), plan.small);
        assert_eq!(plan.kernel_for(64), GemmKernel::Coop);
        assert_eq!(GemmPlan::from_record(&plan.record()), Some(plan));
        let d = GemmPlan::default();
        assert_eq!(d.kernel_for(64), GemmKernel::Decode);
        assert_eq!(d.kernel_for(65), GemmKernel::TILE64);
        assert_eq!(d.kernels(), vec![GemmKernel::TILE64]);
        for k in GemmKernel::TILES.into_iter().chain([GemmKernel::Coop, GemmKernel::Decode]) {
            assert_eq!(GemmKernel::parse(&k.name()), Some(k));
        }
        // A record naming a kernel this binary lacks (or the decode kernel as a GEMM) is ignored.
        let bad = GemmRecord { min_rows: 8, small: "tile256".into(), large: "tile64".into() };
        assert_eq!(GemmPlan::from_record(&bad), None);
        let bad = GemmRecord { min_rows: 8, small: "decode".into(), large: "tile64".into() };
        assert_eq!(GemmPlan::from_record(&bad), None);
    }

    #[test]
    fn every_tiled_variant_assembles_and_validates() {
        for f in WFormat::ALL {
            for k in GemmKernel::TILES {
                let GemmKernel::Tile { bm, f16 } = k else { unreachable!() };
                for sw in [false, true] {
                    let src = matmul_tiled_source(f, sw, bm, f16).unwrap();
                    crate::gpu::validate_wgsl(&format!("{} {f:?} {sw}", k.name()), &src).unwrap();
                }
            }
        }
    }
}
