//! The kernels of a model, composed from the families' own (each ops family assembles its
//! WGSL, builds its pipelines and says what they cost): what the model is built with
//! (`KernelSpec`), the families' kernels together (`Kernels`) and every program the engine
//! can build (`all_sources`, for the validation tests and tools).

use super::attention::{self, AttnKernels};
use super::delta::{self, DeltaKernels};
use super::matmul::{self, MatmulKernels};
use super::moe::{self, MoeKernels};
use super::norm::{self, NormKernels};
use super::ple::{self, PleKernels};
use super::rope::{self, RopeKernels};
use super::sample::{self, SampleKernels};
use crate::config::{KernelProfile, KvDtype};
use crate::gpu::tune_cache::TuneCache;
use crate::gpu::wformat::WFormat;
use crate::gpu::{Gpu, MAX_KV_CHUNKS};
use anyhow::Result;

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

/// All pipelines of one model, by family: the weight-format-specific ones for the formats it
/// uses.
pub struct Kernels {
    pub matmul: MatmulKernels,
    pub norm: NormKernels,
    /// Gemma 4's per-layer input gate.
    pub ple: PleKernels,
    pub rope: RopeKernels,
    pub attention: AttnKernels,
    pub sample: SampleKernels,
    /// The router and the expert kernels (none built for a dense model).
    pub moe: MoeKernels,
    /// Gated DeltaNet's kernels (a model with linear-attention layers).
    pub delta: Option<DeltaKernels>,
    /// The KV-cache element type rope_kv and attention were built for.
    pub kv: KvDtype,
    /// Buffers per layer's K (and V) cache they bind.
    pub kv_chunks: usize,
}

impl Kernels {
    pub fn new(gpu: &Gpu, spec: &KernelSpec) -> Result<Kernels> {
        let KernelSpec { ref formats, ref moe_formats, head_dim, group, kv, kv_chunks, profile, delta_k_dim, .. } =
            *spec;
        let kv_chunks = kv_chunks.clamp(1, MAX_KV_CHUNKS);
        // The tuner's choices for this adapter (gpu profile).
        let cache = if profile == KernelProfile::Gpu { TuneCache::for_run() } else { None };
        Ok(Kernels {
            matmul: MatmulKernels::new(gpu, formats, profile, spec.int8, cache.as_ref())?,
            norm: NormKernels::new(gpu)?,
            ple: PleKernels::new(gpu)?,
            rope: RopeKernels::new(gpu, kv, kv_chunks)?,
            attention: AttnKernels::new(gpu, (head_dim, group), &spec.more_attn, (kv, kv_chunks), profile)?,
            sample: SampleKernels::new(gpu)?,
            moe: MoeKernels::new(gpu, moe_formats, profile, cache.as_ref())?,
            delta: delta_k_dim.map(|k| DeltaKernels::new(gpu, k, profile == KernelProfile::Gpu)).transpose()?,
            kv,
            kv_chunks,
        })
    }
}

/// Every program the engine can build, family by family (attention at each of `head_dims`).
pub fn programs(head_dims: &[u32]) -> Vec<super::Program> {
    [
        matmul::sources(),
        moe::sources(),
        attention::sources(head_dims),
        rope::sources(),
        norm::sources(),
        ple::sources(),
        delta::sources(),
        sample::sources(),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// Every WGSL program the engine can build, with a label (attention at each of `head_dims`):
/// what the naga test validates. Panics on a template that does not assemble (for tests and
/// tools).
pub fn all_sources(head_dims: &[u32]) -> Vec<(String, String)> {
    // Tests and tools: an assembly error is a bug in a template, named here.
    programs(head_dims)
        .into_iter()
        .map(|p| {
            let src = p.src.unwrap_or_else(|e| panic!("{}: {e:#}", p.label));
            (p.label, src)
        })
        .collect()
}
