//! The compute pipelines of every kernel, built once at start-up (bind-group layouts by family,
//! pipelines per weight format and tile), and how a matmul reads its activations (storage, or
//! uniform windows on the cpu profile).

use super::attention::{AttnBinds, ATTN_KV};
use super::gemm::{gpu_matmul_pipelines, GemmKernel, GemmPlan};
use super::layout_of;
use super::matmul::MatmulBinds;
use super::moe::MoeBinds;
use super::norm::{HeadNormBinds, NormBinds};
use super::rope::{RopeBinds, ROPE_KV};
use super::sample::SampleBinds;
use super::sources::*;
use crate::config::{KernelProfile, KvDtype};
use crate::gpu::family::{Family, Slot};
use crate::gpu::tune_cache::TuneCache;
use crate::gpu::wformat::{WFormat, XQuant};
use crate::gpu::Gpu;
use anyhow::Result;
use std::collections::BTreeMap;

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

/// Tokens per workgroup of the gpu profile's decode matmul variants (matmul_gpu.wgsl): a step
/// of m <= 16 rows uses the first TM >= m, larger ones groups of 16, until the format's GEMM
/// plan (ops/gemm.rs) sends the step to a GEMM.
pub const GPU_DECODE_TM: [u32; 5] = [1, 2, 4, 8, 16];
/// Most rows of a step the decode matmul serves (as groups of 16 tokens) in the default GEMM plan.
pub const GPU_DECODE_MAX_ROWS: u32 = 64;
/// Weight rows per workgroup of the decode kernel (gate+up rows for SwiGLU: half as many outputs).
pub const GPU_DECODE_NR: u32 = 4;

pub struct MatmulPipelines {
    /// One per MATMUL_TILES entry (the cpu profile's; none on the gpu profile, whose matmuls
    /// are GpuMatmulPipelines).
    pub plain: Vec<wgpu::ComputePipeline>,
    /// Fused gate/up SwiGLU, one per MATMUL_TILES entry.
    pub swiglu: Vec<wgpu::ComputePipeline>,
    /// The same with x read through a uniform binding (matmul_u_family).
    pub plain_u: Vec<wgpu::ComputePipeline>,
    pub swiglu_u: Vec<wgpu::ComputePipeline>,
    pub embed: wgpu::ComputePipeline,
}

impl MatmulPipelines {
    pub fn get(&self, tile: usize, swiglu: bool, uniform_x: bool) -> &wgpu::ComputePipeline {
        match (swiglu, uniform_x) {
            (false, false) => &self.plain[tile],
            (true, false) => &self.swiglu[tile],
            (false, true) => &self.plain_u[tile],
            (true, true) => &self.swiglu_u[tile],
        }
    }
}

/// The gpu profile's matmuls of one weight format (ops/gemm.rs builds them).
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
        None => cache.and_then(|c| c.int8(&gpu.info, format.name())).unwrap_or(
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

impl GpuMatmulPipelines {
    /// The pipelines of GEMM variant `k` (built with the plan).
    pub fn gemm(&self, k: GemmKernel) -> &[wgpu::ComputePipeline; 2] {
        &self.gemm.iter().find(|(g, _)| *g == k).expect("a GEMM variant of the plan is built with it").1
    }
}

/// The gpu profile's kernels (built only for models that run it).
pub struct GpuPipelines {
    pub matmul: BTreeMap<WFormat, GpuMatmulPipelines>,
    /// Split-key attention and the merge of its splits (attn_family).
    pub attention: wgpu::ComputePipeline,
    pub combine: wgpu::ComputePipeline,
    /// Query-tiled attention for prefill-sized steps and its tokens per tile (None where no
    /// tile of two tokens fits the workgroup memory).
    pub attention_tiled: Option<(wgpu::ComputePipeline, u32)>,
    /// The activations' quantizations for the int8 matmuls (built where a format has them),
    /// in `XQuant` order.
    pub quantize_x8: Option<[wgpu::ComputePipeline; 3]>,
    /// Whether one-token steps run the int8 matmuls that were built (the tuner and tests turn
    /// it off to time and check the f32 ones).
    pub int8: bool,
}

impl GpuPipelines {
    /// Whether a step of `m` rows runs `format`'s int8 matmul (and quantizes x for it).
    pub fn int8_for(&self, format: WFormat, m: u32) -> bool {
        self.int8
            && m <= INT8_MAX_ROWS
            && self.matmul.get(&format).is_some_and(|p| p.int8.is_some() && p.plan.kernel_for(m) == GemmKernel::Decode)
    }
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

/// What a set of kernels is built for.
#[derive(Clone, Debug)]
pub struct KernelSpec {
    pub formats: Vec<WFormat>,
    /// The formats of expert tensors (none for a dense model).
    pub moe_formats: Vec<WFormat>,
    pub head_dim: u32,
    /// Query heads per KV head (the split attention is built for it).
    pub group: u32,
    pub kv: KvDtype,
    pub kv_chunks: usize,
    /// `cpu` or `gpu` (`auto` counts as `cpu`).
    pub profile: KernelProfile,
    /// The key head size of a model with Gated DeltaNet layers (its kernels are built for it).
    pub delta_k_dim: Option<u32>,
    /// gpu profile: the one-token matmuls on int8 activations (Some(true)) or not; None: as
    /// `int8_wanted` decides.
    pub int8: Option<bool>,
    /// Further (head_dim, group) attention geometries some layers have (Gemma 4's
    /// full-attention layers): their attention kernels are built too.
    pub more_attn: Vec<(u32, u32)>,
}

/// The attention kernels of one further geometry (KernelSpec::more_attn).
pub struct MoreAttn {
    /// (head_dim, group).
    pub geom: (u32, u32),
    /// The cpu profile's attention (None on the gpu profile, which never runs it).
    pub cpu: Option<wgpu::ComputePipeline>,
    /// gpu profile: the split attention and its merge, and the query-tiled one (at the tokens
    /// per tile of GpuPipelines::attention_tiled).
    pub split: Option<[wgpu::ComputePipeline; 2]>,
    pub tiled: Option<wgpu::ComputePipeline>,
}

/// All pipelines of one model: the weight-format-specific ones for the formats it uses.
pub struct Kernels {
    /// `MatmulBinds` (and `EmbedBinds`).
    pub matmul_family: Family,
    /// The same with binding 2 uniform (a UNIFORM_X_BYTES window of x).
    pub matmul_u_family: Family,
    pub matmul: BTreeMap<WFormat, MatmulPipelines>,
    /// `NormBinds`.
    pub norm_family: Family,
    pub rmsnorm: wgpu::ComputePipeline,
    /// `HeadNormBinds`.
    pub head_norm_family: Family,
    pub head_norm: wgpu::ComputePipeline,
    /// `PleBinds`: Gemma 4's per-layer input gate.
    pub ple_family: Family,
    pub ple_gate: wgpu::ComputePipeline,
    /// `RopeBinds` and the KV cache's chunks.
    pub rope_family: Family,
    pub rope_kv: wgpu::ComputePipeline,
    /// `AttnBinds` and the KV cache's chunks.
    pub attn_family: Family,
    /// The cpu profile's attention, a thread per (token, head) (None on the gpu profile, which
    /// runs `gpu`'s split and tiled kernels: a thread holding a head's query and accumulator
    /// spills on real GPUs).
    pub attention: Option<wgpu::ComputePipeline>,
    /// `SampleBinds` (and `AdjustBinds`, with the same accesses).
    pub sample_family: Family,
    pub sample: wgpu::ComputePipeline,
    /// In the sampler's family.
    pub logit_adjust: wgpu::ComputePipeline,
    /// The KV-cache element type rope_kv and attention were built for.
    pub kv: KvDtype,
    /// Buffers per layer's K (and V) cache they bind.
    pub kv_chunks: usize,
    /// `MoeBinds`: the router and the expert kernels per format of the expert tensors.
    pub moe_family: Family,
    /// The router, then the grouping's count, offsets and scatter (moe_route.wgsl), the
    /// combine and the shared expert's gate: built only with expert formats (a MoE model).
    pub moe_route: Option<[wgpu::ComputePipeline; 4]>,
    pub moe_combine: Option<wgpu::ComputePipeline>,
    pub moe_shared_gate: Option<wgpu::ComputePipeline>,
    pub moe: BTreeMap<WFormat, MoePipelines>,
    /// The gpu profile's kernels, when built for it.
    pub gpu: Option<GpuPipelines>,
    /// Gated DeltaNet's kernels (a model with linear-attention layers).
    pub delta: Option<super::delta::DeltaPipelines>,
    /// (head_dim, group) of `attention` and the gpu profile's attention kernels.
    pub attn_geom: (u32, u32),
    /// The attention kernels of the further geometries.
    pub more_attn: Vec<MoreAttn>,
}

impl Kernels {
    pub fn new(gpu: &Gpu, spec: &KernelSpec) -> Result<Kernels> {
        let KernelSpec { ref formats, ref moe_formats, head_dim, group, kv, kv_chunks, profile, delta_k_dim, .. } =
            *spec;
        let more: Vec<(u32, u32)> = spec.more_attn.iter().copied().filter(|&g| g != (head_dim, group)).collect();
        let kv_chunks = kv_chunks.clamp(1, MAX_KV_CHUNKS);
        use Slot::*;
        let matmul_family = Family::new(gpu, &layout_of(MatmulBinds::SLOTS));
        // x (2) as a uniform window, and the window entry (7), both at dynamic offsets.
        let mut u_slots = layout_of(MatmulBinds::SLOTS);
        u_slots.iter_mut().filter(|s| s.0 == 2).for_each(|s| s.1 = UniformDyn);
        u_slots.push((7, UniformDyn));
        let matmul_u_family = Family::new(gpu, &u_slots);
        let mut matmul = BTreeMap::new();
        for &f in formats.iter() {
            if matmul.contains_key(&f) {
                continue;
            }
            let n = f.name();
            let (mut plain, mut swiglu, mut plain_u, mut swiglu_u) = (vec![], vec![], vec![], vec![]);
            // The register tiles are the cpu profile's; the gpu profile runs `gpu`'s matmuls.
            let tiles = if profile == KernelProfile::Gpu { &[][..] } else { &MATMUL_TILES[..] };
            for &(tm, tn) in tiles {
                let src = matmul_source(f, tm, tn, false)?;
                plain.push(matmul_family.pipeline(gpu, &format!("matmul_{n}_{tm}x{tn}"), &src, "main")?);
                swiglu.push(matmul_family.pipeline(gpu, &format!("swiglu_{n}_{tm}x{tn}"), &src, "main_swiglu")?);
                let src = matmul_source(f, tm, tn, true)?;
                plain_u.push(matmul_u_family.pipeline(gpu, &format!("matmul_{n}_{tm}x{tn}_ux"), &src, "main")?);
                swiglu_u.push(matmul_u_family.pipeline(
                    gpu,
                    &format!("swiglu_{n}_{tm}x{tn}_ux"),
                    &src,
                    "main_swiglu",
                )?);
            }
            let p = MatmulPipelines {
                plain,
                swiglu,
                plain_u,
                swiglu_u,
                embed: matmul_family.pipeline(gpu, &format!("embed_{n}"), &embed_source(f)?, "main")?,
            };
            matmul.insert(f, p);
        }
        let norm_family = Family::new(gpu, &layout_of(NormBinds::SLOTS));
        let rmsnorm = norm_family.pipeline(gpu, "rmsnorm", &rmsnorm_source()?, "main")?;
        let head_norm_family = Family::new(gpu, &layout_of(HeadNormBinds::SLOTS));
        let head_norm = head_norm_family.pipeline(gpu, "head_norm", &head_norm_source()?, "main")?;
        let ple_family = Family::new(gpu, &layout_of(super::ple::PleBinds::SLOTS));
        let ple_gate = ple_family.pipeline(gpu, "ple_gate", &ple_source()?, "main")?;
        // The KV cache's chunks beyond the first.
        let chunk_slots = |s: Slot| {
            (1..kv_chunks as u32).flat_map(move |c| [(KV_K_CHUNK_BINDING + c, s), (KV_V_CHUNK_BINDING + c, s)])
        };
        let mut rope_slots = layout_of(RopeBinds::SLOTS);
        rope_slots.extend([(ROPE_KV.0, ReadWrite), (ROPE_KV.1, ReadWrite)]);
        rope_slots.extend(chunk_slots(ReadWrite));
        let rope_family = Family::new(gpu, &rope_slots);
        let rope_kv = rope_family.pipeline(gpu, "rope_kv", &rope_kv_source(kv, kv_chunks)?, "main")?;
        let mut attn_slots = layout_of(AttnBinds::SLOTS);
        attn_slots.extend([(ATTN_KV.0, Read), (ATTN_KV.1, Read)]);
        attn_slots.extend(chunk_slots(Read));
        let attn_family = Family::new(gpu, &attn_slots);
        let attention = match profile {
            KernelProfile::Gpu => None,
            _ => Some(attn_family.pipeline(gpu, "attention", &attention_source(head_dim, kv, kv_chunks)?, "main")?),
        };
        // The adjustment kernel binds the same way: AdjustBinds::SLOTS has these accesses.
        let sample_family = Family::new(gpu, &layout_of(SampleBinds::SLOTS));
        let sample = sample_family.pipeline(gpu, "sample", &sample_source()?, "main")?;
        let logit_adjust = sample_family.pipeline(gpu, "logit_adjust", &logit_adjust_source()?, "main")?;
        // Both profiles run the same expert kernels (a thread per few outputs, no workgroup memory).
        let moe_family = Family::new(gpu, &layout_of(MoeBinds::SLOTS));
        let (moe_route, moe_combine, moe_shared_gate) = if moe_formats.is_empty() {
            (None, None, None)
        } else {
            let src = moe_route_source()?;
            let mut route = Vec::new();
            for entry in ["main", "count_main", "offsets_main", "scatter_main"] {
                route.push(moe_family.pipeline(gpu, &format!("moe_route_{entry}"), &src, entry)?);
            }
            let route: [wgpu::ComputePipeline; 4] =
                route.try_into().map_err(|_| anyhow::anyhow!("moe_route: four pipelines expected"))?;
            let src = moe_source(WFormat::F32)?;
            let combine = moe_family.pipeline(gpu, "moe_combine", &src, "combine_main")?;
            let shared_gate = moe_family.pipeline(gpu, "moe_shared_gate", &src, "shared_gate_main")?;
            (Some(route), Some(combine), Some(shared_gate))
        };
        // The tuner's choices for this adapter (gpu profile).
        let cache = if profile == KernelProfile::Gpu { TuneCache::for_run() } else { None };
        let mut moe = BTreeMap::new();
        for &f in moe_formats.iter() {
            if let std::collections::btree_map::Entry::Vacant(slot) = moe.entry(f) {
                let src = moe_source(f)?;
                let n = f.name();
                let gate_up = moe_family.pipeline(gpu, &format!("moe_gate_up_{n}"), &src, "gate_up_main")?;
                let down = moe_family.pipeline(gpu, &format!("moe_down_{n}"), &src, "down_main")?;
                let gate_up_grouped =
                    moe_family.pipeline(gpu, &format!("moe_gate_up_grouped_{n}"), &src, "gate_up_grouped")?;
                let down_grouped = moe_family.pipeline(gpu, &format!("moe_down_grouped_{n}"), &src, "down_grouped")?;
                // The tiled expert kernels only where they will run (gpu profile, chosen).
                let use_tiled = profile == KernelProfile::Gpu && super::moe::tiled_wanted(gpu, f, cache.as_ref())?;
                let tiled = if use_tiled { Some(super::moe::tiled_pipelines(gpu, &moe_family, f)?) } else { None };
                slot.insert(MoePipelines { gate_up, down, gate_up_grouped, down_grouped, tiled, use_tiled });
            }
        }
        let gpu_kernels = if profile == KernelProfile::Gpu {
            let mut matmul = BTreeMap::new();
            for &f in formats.iter() {
                if matmul.contains_key(&f) {
                    continue;
                }
                let plan = GemmPlan::for_device(gpu, f, cache.as_ref())?;
                let int8 = int8_wanted(gpu, f, spec.int8, cache.as_ref())?;
                matmul.insert(f, gpu_matmul_pipelines(gpu, &matmul_family, f, plan, int8)?);
            }
            let quantize_x8 = if matmul.values().any(|p| p.int8.is_some()) {
                Some(quantize_pipelines(gpu, &matmul_family)?)
            } else {
                None
            };
            let src = attention_split_source(head_dim, group.max(1), kv, kv_chunks, gpu.subgroups)?;
            // One tile size for every geometry (a step picks the tiled kernel for all layers).
            let qt = more
                .iter()
                .map(|&(d, g)| tiled_attention_tokens(d, g, gpu.subgroups))
                .fold(tiled_attention_tokens(head_dim, group, gpu.subgroups), u32::min);
            let attention_tiled = if qt > 0 {
                let src = attention_tiled_source(head_dim, group, qt, kv, kv_chunks, gpu.subgroups)?;
                Some((attn_family.pipeline(gpu, "attention_tiled", &src, "main")?, qt))
            } else {
                None
            };
            Some(GpuPipelines {
                matmul,
                attention: attn_family.pipeline(gpu, "attention_split", &src, "main")?,
                combine: attn_family.pipeline(gpu, "attention_combine", &src, "combine")?,
                attention_tiled,
                quantize_x8,
                int8: true,
            })
        } else {
            None
        };
        let qt = gpu_kernels.as_ref().and_then(|k| k.attention_tiled.as_ref()).map_or(0, |t| t.1);
        let more_attn = more
            .iter()
            .map(|&(d, g)| -> Result<MoreAttn> {
                let name = |n: &str| format!("{n}_{d}_{g}");
                let cpu = match profile {
                    KernelProfile::Gpu => None,
                    _ => Some(attn_family.pipeline(
                        gpu,
                        &name("attention"),
                        &attention_source(d, kv, kv_chunks)?,
                        "main",
                    )?),
                };
                let (split, tiled) = if profile == KernelProfile::Gpu {
                    let src = attention_split_source(d, g.max(1), kv, kv_chunks, gpu.subgroups)?;
                    let split = [
                        attn_family.pipeline(gpu, &name("attention_split"), &src, "main")?,
                        attn_family.pipeline(gpu, &name("attention_combine"), &src, "combine")?,
                    ];
                    let tiled = if qt > 0 {
                        let src = attention_tiled_source(d, g, qt, kv, kv_chunks, gpu.subgroups)?;
                        Some(attn_family.pipeline(gpu, &name("attention_tiled"), &src, "main")?)
                    } else {
                        None
                    };
                    (Some(split), tiled)
                } else {
                    (None, None)
                };
                Ok(MoreAttn { geom: (d, g), cpu, split, tiled })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Kernels {
            attn_geom: (head_dim, group),
            more_attn,
            matmul_family,
            matmul_u_family,
            matmul,
            norm_family,
            rmsnorm,
            head_norm_family,
            head_norm,
            ple_family,
            ple_gate,
            rope_family,
            rope_kv,
            attn_family,
            attention,
            sample_family,
            sample,
            logit_adjust,
            kv,
            kv_chunks,
            moe_family,
            moe_route,
            moe_combine,
            moe_shared_gate,
            moe,
            gpu: gpu_kernels,
            delta: delta_k_dim
                .map(|k| super::delta::DeltaPipelines::new(gpu, k, profile == KernelProfile::Gpu))
                .transpose()?,
        })
    }
}
