//! The gpu profile's decode-sized matmul (matmul_gpu.wgsl for one token, matmul_gpu_tokens.wgsl
//! for 2-16 tokens per workgroup) and the one-token kernel on int8 activations
//! (matmul_gpu_xi8.wgsl after quantize_x8.wgsl), with the choice of when int8 runs.

use super::{both, matmul_shader};
use crate::gpu::family::Family;
use crate::gpu::shader::Shader;
use crate::gpu::tune_cache::TuneCache;
use crate::gpu::wformat::{WFormat, XQuant};
use crate::gpu::Gpu;
use crate::ops::wgsl::SG_ARGS;
use anyhow::Result;

/// Tokens per workgroup of the gpu profile's decode matmul variants (matmul_gpu.wgsl): a step
/// of m <= 16 rows uses the first TM >= m, larger ones groups of 16, until the format's GEMM
/// plan (gemm.rs) sends the step to a GEMM.
pub const GPU_DECODE_TM: [u32; 5] = [1, 2, 4, 8, 16];
/// Most rows of a step the decode matmul serves (as groups of 16 tokens) in the default GEMM plan.
pub const GPU_DECODE_MAX_ROWS: u32 = 64;
/// Weight rows per workgroup of the decode kernel (gate+up rows for SwiGLU: half as many outputs).
pub const GPU_DECODE_NR: u32 = 4;

/// The one-token decode kernel (its X part says how it reads x).
pub(crate) const MATMUL_GPU_WGSL: &str = include_str!("../../../shaders/matmul/matmul_gpu.wgsl");

/// Reduction of matmul_gpu.wgsl's partial sums into `tot`: subgroupAdd, then one value per
/// subgroup through workgroup memory (at most 16 subgroups: subgroups have 4 lanes or more).
const RED_SUBGROUP: &str = "var<workgroup> red: array<f32, NV * 16u>;";
const REDUCE_SUBGROUP: &str = "    for (var k = 0u; k < NV; k++) {
        let v = subgroupAdd(acc[k]);
        if (sid == 0u) {
            red[k * 16u + sg] = v;
        }
    }
    workgroupBarrier();
    if (lid < NV) {
        var s = 0.0;
        for (var j = 0u; j < nsg; j++) {
            s += red[lid * 16u + j];
        }
        tot[lid] = s;
    }";

/// The same through workgroup memory only (adapters without subgroups): a tree over the WG
/// invocations for RB outputs at a time (RB * WG floats of workgroup memory).
const RED_WORKGROUP: &str = "const RB: u32 = min(NV, 32u);
var<workgroup> red: array<f32, RB * WG>;";
const REDUCE_WORKGROUP: &str = "    for (var k0 = 0u; k0 < NV; k0 += RB) {
        for (var k = 0u; k < RB; k++) {
            red[k * WG + lid] = acc[k0 + k];
        }
        workgroupBarrier();
        for (var s = WG / 2u; s > 0u; s = s / 2u) {
            if (lid < s) {
                for (var k = 0u; k < RB; k++) {
                    red[k * WG + lid] += red[k * WG + lid + s];
                }
            }
            workgroupBarrier();
        }
        if (lid < RB) {
            tot[k0 + lid] = red[lid * WG];
        }
        workgroupBarrier();
    }";

/// The gpu profile's decode-sized matmul for `tm` tokens per workgroup: matmul_gpu.wgsl for one
/// (`subgroups`: reduce with subgroupAdd), matmul_gpu_tokens.wgsl for more (one weight row per
/// 16 invocations, so that the tokens' x values are never all live at once).
pub fn matmul_gpu_source(f: WFormat, tm: u32, swiglu: bool, subgroups: bool) -> Result<String> {
    if tm > 1 {
        let template = include_str!("../../../shaders/matmul/matmul_gpu_tokens.wgsl");
        return matmul_shader(Shader::new(format!("matmul_gpu_{}_{tm}", f.name()), template), f)
            .fill("TM", tm)
            .fill("SWIGLU", swiglu)
            .build();
    }
    one_token_source(
        format!("matmul_gpu_{}_{tm}", f.name()),
        f,
        include_str!("../../../shaders/matmul/matmul_gpu_xf32.wgsl"),
        "",
        swiglu,
        subgroups,
    )
    .build()
}

/// The gpu profile's one-token decode matmul on int8 activations (matmul_gpu_xi8.wgsl; the
/// formats with `WFormat::has_int8`), after quantize_x8_source's kernel.
/// The table formats (IQ4_NL, IQ4_XS, MXFP4) add wfmt_table_codes8.wgsl: their codes through a
/// workgroup table that each workgroup fills first.
pub fn matmul_gpu_i8_source(f: WFormat, swiglu: bool, subgroups: bool) -> Result<String> {
    let xi8 = include_str!("../../../shaders/matmul/matmul_gpu_xi8.wgsl");
    let (x_part, prep) = if f.table().is_some() {
        let codes8 = include_str!("../../../shaders/wfmt/wfmt_table_codes8.wgsl");
        (format!("{xi8}\n{codes8}"), "    wprep(lid);\n    workgroupBarrier();")
    } else {
        (xi8.to_string(), "")
    };
    one_token_source(format!("matmul_gpu_i8_{}", f.name()), f, &x_part, prep, swiglu, subgroups).build()
}

/// matmul_gpu.wgsl for one token with its X part (how it reads x) and PREP (what every
/// invocation does before the loop over K); the X part's own placeholders are the caller's.
fn one_token_source(label: String, f: WFormat, x_part: &str, prep: &str, swiglu: bool, subgroups: bool) -> Shader {
    let (args, decl, reduce) =
        if subgroups { (SG_ARGS, RED_SUBGROUP, REDUCE_SUBGROUP) } else { ("", RED_WORKGROUP, REDUCE_WORKGROUP) };
    matmul_shader(Shader::new(label, MATMUL_GPU_WGSL), f)
        .fill("X", x_part)
        .fill("PREP", prep)
        .fill("TM", 1)
        .fill("SWIGLU", swiglu)
        .fill("SG_ARGS", args)
        .fill("RED_DECL", decl)
        .fill("REDUCE", reduce)
}

/// The quantization of a matmul's activations to int8 blocks (quantize_x8.wgsl), as `xq` says
/// (`WFormat::int8_x`).
pub fn quantize_x8_source(xq: XQuant) -> Result<String> {
    Shader::new(quantize_x8_label(xq), include_str!("../../../shaders/matmul/quantize_x8.wgsl"))
        .after(crate::gpu::shared::wgsl_common())
        .after(super::wgsl_matmul())
        .fill("GROUP", xq.group())
        .fill("WHOLE", xq == XQuant::Q8_1)
        .build()
}

/// quantize_x8's pipeline label for `xq` (quantize_x8_q8_0, _q8_1, _q8k).
pub(crate) fn quantize_x8_label(xq: XQuant) -> String {
    format!("quantize_x8_{}", format!("{xq:?}").to_lowercase())
}

/// TORUS_INT8=0 keeps the gpu profile's one-token matmuls on f32 activations, =1 quantizes them
/// to int8 per 32 values for every format that allows it (`WFormat::has_int8`); unset, the
/// tuner's choice for the adapter and format, else int8 on GPUs through Vulkan and DX12 (whose
/// drivers turn dot4I8Packed into the GPU's integer dot products) and f32 on Metal and GL (naga
/// writes it out as shifts and multiplies there) and on CPU adapters (llvmpipe runs the cpu
/// profile by default, and the suite checks the gpu profile's f32 kernels there; int8 is
/// faster on it too, BENCHMARKS.md).
pub const INT8_ENV: &str = "TORUS_INT8";

/// Whether the gpu profile builds and runs `format`'s int8 matmuls on `gpu`: never where the
/// format has none, else as `forced` says (`KernelSpec::int8`), else INT8_ENV, the tuner's
/// cache, the backend (a bad INT8_ENV value is an error naming it).
pub fn int8_wanted(gpu: &Gpu, format: WFormat, forced: Option<bool>, cache: Option<&TuneCache>) -> Result<bool> {
    if !format.has_int8() {
        return Ok(false);
    }
    if let Some(on) = forced {
        return Ok(on);
    }
    Ok(match std::env::var(INT8_ENV).ok().as_deref() {
        Some("1") => true,
        Some("0") => false,
        Some(v) => anyhow::bail!("{INT8_ENV} must be 0 or 1, got {v:?}"),
        None => cache.and_then(|c| c.int8(&gpu.info, super::gemm::tuned_kernels(), format.name())).unwrap_or(
            matches!(gpu.info.backend, wgpu::Backend::Vulkan | wgpu::Backend::Dx12)
                && gpu.info.device_type != wgpu::DeviceType::Cpu,
        ),
    })
}

/// The quantizations of x for the int8 matmuls (in the matmul family), in `XQuant::ALL`'s order
/// (`xq as usize` indexes them).
pub fn quantize_pipelines(gpu: &Gpu, family: &Family) -> Result<[wgpu::ComputePipeline; 3]> {
    let [a, b, c] =
        XQuant::ALL.map(|xq| family.pipeline(gpu, &quantize_x8_label(xq), &quantize_x8_source(xq)?, "main"));
    Ok([a?, b?, c?])
}

/// Most rows of x a step may quantize for the int8 matmuls (they serve one-token steps).
pub const INT8_MAX_ROWS: u32 = 1;

/// The one-token decode kernel of `f` on int8 activations: [plain, swiglu].
pub fn int8_pipelines(gpu: &Gpu, family: &Family, f: WFormat) -> Result<[wgpu::ComputePipeline; 2]> {
    let n = f.name();
    both(gpu, family, &|sw| (format!("matmul_gpu_i8_{n}_1_{sw}"), matmul_gpu_i8_source(f, sw, gpu.subgroups)))
}

/// The decode kernels of `f`, one per GPU_DECODE_TM entry: [plain, swiglu].
pub fn decode_pipelines(gpu: &Gpu, family: &Family, f: WFormat) -> Result<Vec<[wgpu::ComputePipeline; 2]>> {
    let n = f.name();
    GPU_DECODE_TM
        .iter()
        .map(|&tm| {
            both(gpu, family, &|sw| (format!("matmul_gpu_{n}_{tm}_{sw}"), matmul_gpu_source(f, tm, sw, gpu.subgroups)))
        })
        .collect()
}
