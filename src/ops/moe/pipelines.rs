//! The mixture-of-experts family's kernels: its WGSL assembled (the router, the per-pair and
//! grouped expert kernels of each weight format, the gpu profile's tiled ones), its programs,
//! and its pipelines (`MoeKernels`), with the choice of the tiled kernels for prefill-sized
//! steps.

use super::{MoeBinds, MoeParams, MOE_BIAS, MOE_CLAMPED, MOE_GELU, MOE_MT, MOE_NORM, MOE_SCALED, MOE_TG, MOE_TN};
use crate::config::KernelProfile;
use crate::gpu::family::Family;
use crate::gpu::shader::Shader;
use crate::gpu::tune_cache::TuneCache;
use crate::gpu::{Gpu, WFormat};
use crate::ops::matmul::gemm::{tiled_fma, TILE_LOAD};
use crate::ops::wgsl::common;
use crate::ops::Program;
use std::collections::BTreeMap;

/// TORUS_MOE_TILED=1 (or the tuner's choice for the adapter): the gpu profile's prefill-sized
/// steps run the tiled expert kernels; =0 keeps the grouped ones.
pub const MOE_TILED_ENV: &str = "TORUS_MOE_TILED";

/// Whether the gpu profile's prefill-sized steps run the tiled expert kernels for `format` on
/// `gpu`: MOE_TILED_ENV when set, else the tuner's choice for the adapter, else not.
pub fn tiled_wanted(gpu: &Gpu, format: WFormat, cache: Option<&TuneCache>) -> anyhow::Result<bool> {
    let on = match std::env::var(MOE_TILED_ENV).ok().as_deref() {
        Some("1") => true,
        Some("0") => false,
        Some(v) => anyhow::bail!("{MOE_TILED_ENV} must be 0 or 1, got {v:?}"),
        None => {
            cache.and_then(|c| c.moe(&gpu.info, crate::ops::matmul::gemm::tuned_kernels(), format.name()))
                == Some(MOE_TILED)
        }
    };
    if on {
        tracing::info!("{} experts: tiled (grouped GEMM) kernels for prefill-sized steps", format.name());
    }
    Ok(on)
}

/// The tiled expert kernels of `format`: [gate_up, down].
pub fn tiled_pipelines(gpu: &Gpu, family: &Family, format: WFormat) -> anyhow::Result<[wgpu::ComputePipeline; 2]> {
    let n = format.name();
    let make = |gu: bool| family.pipeline(gpu, &format!("moe_tiled_{n}_{gu}"), &moe_tiled_source(format, gu)?, "main");
    Ok([make(true)?, make(false)?])
}

/// The mixture-of-experts kernels of one weight format (moe.wgsl).
pub struct MoePipelines {
    /// A thread per pair (decode-sized steps).
    pub gate_up: wgpu::ComputePipeline,
    pub down: wgpu::ComputePipeline,
    /// A thread per MOE_TG pairs of one expert (prefill-sized steps).
    pub gate_up_grouped: wgpu::ComputePipeline,
    pub down_grouped: wgpu::ComputePipeline,
    /// gpu profile: tiles of MOE_MT pairs of one expert x 64 rows (moe_tiled.wgsl), [gate_up,
    /// down], built where prefill-sized steps run them instead of the grouped ones
    /// (moe::tiled_wanted; the kernel harness builds them when asked).
    pub tiled: Option<[wgpu::ComputePipeline; 2]>,
    pub use_tiled: bool,
}

/// The mixture-of-experts family's kernels: built empty for a dense model (no expert formats).
pub struct MoeKernels {
    /// `MoeBinds`.
    pub family: Family,
    /// The router, then the grouping's count, offsets and scatter (moe_route.wgsl), the
    /// combine and the shared expert's gate: built only with expert formats (a MoE model).
    pub route: Option<[wgpu::ComputePipeline; 4]>,
    pub combine: Option<wgpu::ComputePipeline>,
    pub shared_gate: Option<wgpu::ComputePipeline>,
    /// The expert kernels per format of the expert tensors.
    pub formats: BTreeMap<WFormat, MoePipelines>,
}

impl MoeKernels {
    /// The kernels of the expert tensors' `formats` (both profiles run the same expert kernels,
    /// a thread per few outputs, no workgroup memory; the gpu profile adds the tiled ones where
    /// `tiled_wanted`, from the tuner's `cache`).
    pub fn new(
        gpu: &Gpu,
        formats: &[WFormat],
        profile: KernelProfile,
        cache: Option<&TuneCache>,
    ) -> anyhow::Result<MoeKernels> {
        let family = Family::new(gpu, &crate::ops::layout_of(MoeBinds::SLOTS));
        let (route, combine, shared_gate) = if formats.is_empty() {
            (None, None, None)
        } else {
            let src = moe_route_source()?;
            let mut route = Vec::new();
            for entry in ["main", "count_main", "offsets_main", "scatter_main"] {
                route.push(family.pipeline(gpu, &format!("moe_route_{entry}"), &src, entry)?);
            }
            let route: [wgpu::ComputePipeline; 4] =
                route.try_into().map_err(|_| anyhow::anyhow!("moe_route: four pipelines expected"))?;
            let src = moe_source(WFormat::F32)?;
            let combine = family.pipeline(gpu, "moe_combine", &src, "combine_main")?;
            let shared_gate = family.pipeline(gpu, "moe_shared_gate", &src, "shared_gate_main")?;
            (Some(route), Some(combine), Some(shared_gate))
        };
        let mut by_format = BTreeMap::new();
        // Each format once.
        for f in formats.iter().copied().collect::<std::collections::BTreeSet<_>>() {
            let src = moe_source(f)?;
            let n = f.name();
            let gate_up = family.pipeline(gpu, &format!("moe_gate_up_{n}"), &src, "gate_up_main")?;
            let down = family.pipeline(gpu, &format!("moe_down_{n}"), &src, "down_main")?;
            let gate_up_grouped = family.pipeline(gpu, &format!("moe_gate_up_grouped_{n}"), &src, "gate_up_grouped")?;
            let down_grouped = family.pipeline(gpu, &format!("moe_down_grouped_{n}"), &src, "down_grouped")?;
            // The tiled expert kernels only where they will run (gpu profile, chosen).
            let use_tiled = profile == KernelProfile::Gpu && tiled_wanted(gpu, f, cache)?;
            let tiled = if use_tiled { Some(tiled_pipelines(gpu, &family, f)?) } else { None };
            by_format.insert(f, MoePipelines { gate_up, down, gate_up_grouped, down_grouped, tiled, use_tiled });
        }
        Ok(MoeKernels { family, route, combine, shared_gate, formats: by_format })
    }
}

/// Every program of the family: each format's expert kernels (and tiled ones), the router.
pub fn sources() -> crate::ops::Sources {
    let mut v: crate::ops::Sources = Vec::new();
    for f in WFormat::ALL {
        v.push(Program::new(format!("moe_{}", f.name()), moe_source(f), MoeBinds::BINDS));
        for gu in [false, true] {
            v.push(Program::new(format!("moe_tiled_{}_{gu}", f.name()), moe_tiled_source(f, gu), MoeBinds::BINDS));
        }
    }
    v.push(Program::new("moe_route", moe_route_source(), MoeBinds::BINDS));
    v
}

/// The tuner's names of the two prefill-sized expert kernels.
pub const MOE_TILED: &str = "tiled";
pub const MOE_GROUPED: &str = "grouped";

/// The WGSL declarations of the MoE shaders: MoeParams and its flags.
pub fn wgsl_moe() -> String {
    format!(
        "{}const MOE_NORM: u32 = {MOE_NORM}u;\nconst MOE_GELU: u32 = {MOE_GELU}u;\n\
         const MOE_CLAMPED: u32 = {MOE_CLAMPED}u;\nconst MOE_BIAS: u32 = {MOE_BIAS}u;\n\
         const MOE_SCALED: u32 = {MOE_SCALED}u;\n",
        MoeParams::WGSL
    )
}

const MOE_COMMON: &str = include_str!("../../../shaders/moe/moe_common.wgsl");

/// The tiled expert kernel's template (its hash is among the tuned kernels').
pub(crate) const MOE_TILED_WGSL: &str = include_str!("../../../shaders/moe/moe_tiled.wgsl");

/// The gpu profile's tiled expert kernel (moe_tiled.wgsl): gate/up (`gu`) or down.
pub fn moe_tiled_source(f: WFormat, gu: bool) -> anyhow::Result<String> {
    Shader::new(format!("moe_tiled_{}_{gu}", f.name()), MOE_TILED_WGSL)
        .after(common())
        .after(wgsl_moe())
        .after(f.snippet())
        .after(MOE_COMMON)
        .after(TILE_LOAD)
        .fill("GU", gu)
        .fill("FMA", tiled_fma(MOE_MT))
        .build()
}

/// The mixture-of-experts kernels of one weight format (moe.wgsl: gate_up_main, down_main).
pub fn moe_source(f: WFormat) -> anyhow::Result<String> {
    Shader::new(format!("moe_{}", f.name()), include_str!("../../../shaders/moe/moe.wgsl"))
        .after(common())
        .after(wgsl_moe())
        .after(f.snippet())
        .after(MOE_COMMON)
        .fill("TN", MOE_TN)
        .fill("TG", MOE_TG)
        .build()
}

/// The mixture-of-experts router (moe_route.wgsl).
pub fn moe_route_source() -> anyhow::Result<String> {
    Shader::new("moe_route", include_str!("../../../shaders/moe/moe_route.wgsl"))
        .after(common())
        .after(wgsl_moe())
        .fill("TG", MOE_TG)
        .fill("MT", MOE_MT)
        .build()
}
