//! `torus-wgpu build-kernels`: builds every pipeline a kernel profile can build on one adapter,
//! without a model: every weight format's matmuls (on the gpu profile the decode kernels at
//! every token count and every GEMM variant the tuner may choose), embeddings and expert
//! kernels, attention at the head sizes and group sizes of the families served, norms, RoPE,
//! Gated DeltaNet, PLE and sampling; and prints how many and how long they took. With
//! `TORUS_PRINT_PIPELINES=1` each pipeline is named on stderr before the driver builds it, so a
//! driver that prints its compiler's statistics (RADV's RADV_DEBUG=shaderstats) gives them per
//! kernel: the GPU compiler report (scripts/gpu-compiler-report.sh, tests/compiler_report.rs).

use crate::config::{KernelProfile, KvDtype};
use crate::gpu::{Gpu, WFormat};
use crate::ops::kernels::{KernelSpec, Kernels};
use crate::ops::matmul::gemm::{add_gemm, GemmKernel};
use anyhow::Result;
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct BuildKernelsArgs {
    /// Adapter index or name substring, as `torus-wgpu adapters` prints.
    #[arg(long)]
    pub adapter: Option<String>,
    /// The kernel profile whose pipelines are built: gpu (default) or cpu.
    #[arg(long, default_value = "gpu")]
    pub kernel_profile: KernelProfile,
    /// Only these weight formats' kernels (comma-separated names: q4_k,q8_0); all by default.
    #[arg(long, value_delimiter = ',')]
    pub formats: Vec<String>,
}

/// Attention geometries (head size, query heads per KV head) of the families served: Qwen2.5-7B,
/// Llama 3 8B and Qwen3's 128 with groups of 7, 4 and 8; gpt-oss's 64 in groups of 8; Qwen3.5's
/// and Gemma's 256, Gemma 4's 512.
const ATTENTION: [(u32, u32); 6] = [(128, 7), (128, 4), (128, 8), (64, 8), (256, 4), (512, 2)];

pub fn run(args: &BuildKernelsArgs) -> Result<()> {
    let formats = if args.formats.is_empty() {
        WFormat::ALL.to_vec()
    } else {
        args.formats
            .iter()
            .map(|n| {
                let found = WFormat::ALL.iter().copied().find(|f| f.name() == n.as_str());
                found.ok_or_else(|| anyhow::anyhow!("build-kernels: no weight format {n:?}"))
            })
            .collect::<Result<Vec<_>>>()?
    };
    let gpu = Gpu::new(args.adapter.as_deref())?;
    let t0 = Instant::now();
    let spec = KernelSpec {
        formats: formats.clone(),
        moe_formats: formats.clone(),
        head_dim: ATTENTION[0].0,
        group: ATTENTION[0].1,
        kv: KvDtype::F16,
        kv_chunks: 1,
        profile: args.kernel_profile,
        delta_k_dim: Some(128),
        // Every int8 kernel, whatever this adapter would choose.
        int8: Some(true),
        more_attn: ATTENTION[1..].to_vec(),
    };
    let mut kernels = Kernels::new(&gpu, &spec)?;
    // Every GEMM variant the tuner may choose (the plan built only its own).
    let mk = &mut kernels.matmul;
    if let Some(g) = mk.gpu.as_mut() {
        let variants: Vec<GemmKernel> =
            GemmKernel::TILES.into_iter().chain(gpu.coop.map(|_| GemmKernel::Coop)).collect();
        for (&f, p) in g.formats.iter_mut() {
            for &k in &variants {
                if matches!(k, GemmKernel::Tile { f16: true, .. }) && !gpu.f16 {
                    continue;
                }
                add_gemm(&gpu, &mk.family, f, p, k)?;
            }
        }
    }
    println!(
        "built the {} profile's pipelines for {} weight formats and {} attention geometries on {} in {:.1} s",
        args.kernel_profile.name(),
        formats.len(),
        ATTENTION.len(),
        gpu.info.name,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
