//! `torus-wgpu tune`: chooses the gpu profile's GEMM plan of each weight format on this adapter
//! by measuring (ops/tune.rs) on a model's own matmul shapes (its first layer: q, k, v, o, the
//! fused gate/up and down), or on a synthetic one (Qwen2.5-7B's by default), and, for a
//! mixture-of-experts layer (the model's first, or a synthetic one with --experts), whether
//! prefill-sized steps run the tiled or the grouped expert kernels; it keeps the choices in the
//! tuner's cache (gpu::tune_cache), which every later run on this adapter, driver and binary
//! reads. It prints every timing and the choices, and writes them as JSON with `--json`.

use crate::config::KernelProfile;
use crate::gpu::tune_cache::TuneCache;
use crate::gpu::wformat::WFormat;
use crate::gpu::Gpu;
use crate::model::loader::HostModel;
use crate::ops::harness::Harness;
use crate::ops::harness_moe::MoeWeights;
use crate::ops::matmul::gemm::GemmKernel;
use crate::ops::moe::MoeSpec;
use crate::ops::tune::{choose, choose_int8, choose_moe, measure_on, since, TuneShape, Tuned};
use crate::weights::tensor::QTensor;
use anyhow::{anyhow, bail, Result};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct TuneArgs {
    /// A model (GGUF file or Hugging Face directory): its first layer's matmuls are measured,
    /// for each weight format they have. Without it, a synthetic layer of `--format`.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Weight format of the synthetic layer (without --model).
    #[arg(long, default_value = "q4_k")]
    pub format: String,
    /// Hidden size of the synthetic layer (Qwen2.5-7B's by default).
    #[arg(long, default_value_t = 3584)]
    pub hidden: usize,
    /// FFN size of the synthetic layer.
    #[arg(long, default_value_t = 18944)]
    pub ffn: usize,
    /// Key/value width of the synthetic layer (KV heads x head size).
    #[arg(long, default_value_t = 512)]
    pub kv: usize,
    /// Experts of a synthetic mixture-of-experts block to tune too (0: none).
    #[arg(long, default_value_t = 0)]
    pub experts: usize,
    /// Experts per token of the synthetic block.
    #[arg(long, default_value_t = 8)]
    pub top_k: usize,
    /// Each synthetic expert's intermediate size.
    #[arg(long, default_value_t = 768)]
    pub expert_ffn: usize,
    /// Tokens of the prefill step the expert kernels are timed at.
    #[arg(long, default_value_t = 512)]
    pub moe_tokens: usize,
    /// Seconds of measuring per format; what is not measured by then is not chosen.
    #[arg(long, default_value_t = 60.0)]
    pub budget_s: f64,
    /// Adapter index or name substring, as `torus-wgpu adapters` prints.
    #[arg(long)]
    pub adapter: Option<String>,
    /// The cache file to update (default: TORUS_TUNE_CACHE, else under XDG_CACHE_HOME or ~/.cache).
    #[arg(long)]
    pub cache: Option<PathBuf>,
    /// Also write the timings and plans here as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// A mixture-of-experts block to tune: its spec and weights (see moe::moe_ref for the layout).
struct MoeBlock {
    spec: MoeSpec,
    router: QTensor,
    gate_up: QTensor,
    down: QTensor,
}

/// The matmuls of one layer by weight format.
type DenseShapes = BTreeMap<WFormat, Vec<TuneShape>>;

/// The matmuls of one layer by weight format, and its mixture-of-experts block (a model's first
/// layer's when it is sparse, or the synthetic one of --experts).
fn shapes(args: &TuneArgs) -> Result<(DenseShapes, Option<MoeBlock>)> {
    let mut by_format: BTreeMap<WFormat, Vec<TuneShape>> = BTreeMap::new();
    let mut add = |w: &QTensor, up: Option<&QTensor>| {
        if w.rows > 0 && up.is_none_or(|u| u.format == w.format && u.rows == w.rows) {
            by_format.entry(w.format).or_default().push(TuneShape { w: w.clone(), up: up.cloned() });
        }
    };
    let mut moe = None;
    match &args.model {
        Some(path) => {
            let m = HostModel::load_layers(path, Some(0..1), &|_, _| {})?;
            let l = m.layers.first().ok_or_else(|| anyhow!("{}: no layers", path.display()))?;
            if let (Some(hm), Some(c)) = (&l.moe, &m.cfg.moe) {
                moe = Some(MoeBlock {
                    spec: c.spec(false),
                    router: hm.router.clone(),
                    gate_up: hm.gate_up.clone(),
                    down: hm.down.clone(),
                });
            }
            for w in [&l.q, &l.k, &l.v, &l.o, &l.down] {
                add(w, None);
            }
            if l.gate.format == l.up.format {
                add(&l.gate, Some(&l.up));
            } else {
                add(&l.gate, None);
                add(&l.up, None);
            }
        }
        None => {
            let f = WFormat::ALL
                .into_iter()
                .find(|f| f.name() == args.format.to_lowercase())
                .ok_or_else(|| anyhow!("unknown weight format {:?}", args.format))?;
            let (h, ffn, kv) = (args.hidden, args.ffn, args.kv);
            let r = |rows, cols, seed| QTensor::random_gguf(f, rows, cols, seed);
            let (q, k, v, o) = (r(h, h, 1)?, r(kv, h, 2)?, r(kv, h, 3)?, r(h, h, 4)?);
            let (gate, up, down) = (r(ffn, h, 5)?, r(ffn, h, 6)?, r(h, ffn, 7)?);
            for w in [&q, &k, &v, &o, &down] {
                add(w, None);
            }
            add(&gate, Some(&up));
            if args.experts > 0 {
                let (e, ef) = (args.experts, args.expert_ffn);
                let spec = MoeSpec { experts: e, top_k: args.top_k, ffn: ef, norm: true, gelu: false, clamped: None };
                moe = Some(MoeBlock {
                    spec,
                    router: QTensor::random_gguf(WFormat::F32, e, h, 8)?,
                    gate_up: r(e * 2 * ef, h, 9)?,
                    down: r(e * h, ef, 10)?,
                });
            }
        }
    }
    if by_format.is_empty() {
        bail!("no dense matmul to tune");
    }
    Ok((by_format, moe))
}

fn ms(d: &Result<Duration, String>) -> String {
    match d {
        Ok(d) => format!("{:.3}", d.as_secs_f64() * 1e3),
        Err(_) => "failed".into(),
    }
}

fn report(format: WFormat, t: &Tuned) {
    println!("{}: {}{}", format.name(), t.plan.describe(), if t.complete { "" } else { " (budget ran out)" });
    println!("  {:<10} {:>6} {:>12}", "kernel", "rows", "ms per call");
    for x in &t.measurements {
        println!("  {:<10} {:>6} {:>12}", x.kernel.name(), x.rows, ms(&x.time));
        if let Err(e) = &x.time {
            println!("    {e}");
        }
    }
}

pub fn run(args: &TuneArgs) -> Result<()> {
    let gpu = Arc::new(Gpu::for_tuning(args.adapter.as_deref())?);
    let path =
        args.cache.clone().or_else(TuneCache::path).ok_or_else(|| anyhow!("the tuner's cache is off; pass --cache"))?;
    let mut cache = TuneCache::read(&path).unwrap_or_else(|e| {
        tracing::warn!("starting a new tuner cache: {e:#}");
        TuneCache::default()
    });
    // The kernels the choices are for (the cache's key).
    let hash = crate::ops::matmul::gemm::tuned_kernels();
    let kernels = GemmKernel::available(&gpu);
    println!(
        "tuning on {} ({}): {}",
        gpu.info.name,
        gpu.info.driver,
        kernels.iter().map(|k| k.name()).collect::<Vec<_>>().join(", ")
    );
    let budget = Duration::from_secs_f64(args.budget_s.max(0.0));
    let mut out = Vec::new();
    let (dense, moe) = shapes(args)?;
    for (format, shapes) in dense {
        let mut h = Harness::with_formats(gpu.clone(), &[format], (64, 1), KernelProfile::Gpu)?;
        let mut reference = Vec::new();
        let per_shape = Duration::from_millis(20);
        let mut elapsed = since(Instant::now());
        let tuned = choose(&kernels, budget, &mut elapsed, &mut |k, m| {
            measure_on(&mut h, &shapes, k, m, per_shape, &mut reference)
        });
        report(format, &tuned);
        cache.set_gemm(&gpu.info, hash, format.name(), tuned.plan.record());
        // One-token steps on int8 activations or f32 (where the format has int8 kernels).
        // Both are timed whatever this run's default (off on llvmpipe): the kernels are built here.
        let int8 = if format.has_int8() {
            h.add_int8(format)?;
            let c = choose_int8(&mut h, &shapes, per_shape)?;
            println!(
                "  one token: {} activations (f32 {} ms, int8 {} ms per layer's matmuls)",
                if c.int8 { "int8" } else { "f32" },
                ms(&Ok(c.f32_x)),
                ms(&c.int8_x)
            );
            if let Err(e) = &c.int8_x {
                println!("    {e}");
            }
            cache.set_int8(&gpu.info, hash, format.name(), c.int8);
            Some(json!({
                "int8": c.int8,
                "f32_ms": c.f32_x.as_secs_f64() * 1e3,
                "int8_ms": c.int8_x.as_ref().ok().map(|d| d.as_secs_f64() * 1e3),
                "error": c.int8_x.as_ref().err(),
            }))
        } else {
            None
        };
        out.push(json!({
            "format": format.name(),
            "plan": tuned.plan.record(),
            "one_token": int8,
            "complete": tuned.complete,
            "measurements": tuned.measurements.iter().map(|x| json!({
                "kernel": x.kernel.name(),
                "rows": x.rows,
                "ms": x.time.as_ref().ok().map(|d| d.as_secs_f64() * 1e3),
                "error": x.time.as_ref().err(),
            })).collect::<Vec<_>>(),
        }));
    }
    let mut moe_out = None;
    if let Some(b) = moe {
        let format = b.gate_up.format;
        let mut h = Harness::for_moe(gpu.clone(), &[format, b.router.format, b.down.format], KernelProfile::Gpu)?;
        let w = MoeWeights { router: &b.router, router_bias: None, gate_up: &b.gate_up, down: &b.down, biases: None };
        let t = args.moe_tokens.max(1);
        let c = choose_moe(&mut h, &b.spec, &w, t, Duration::from_millis(100))?;
        println!(
            "{} experts ({} of {}, {t} tokens): {} (grouped {} ms, tiled {} ms per block)",
            format.name(),
            b.spec.top_k,
            b.spec.experts,
            c.kernel,
            ms(&Ok(c.grouped)),
            ms(&c.tiled)
        );
        if let Err(e) = &c.tiled {
            println!("  {e}");
        }
        cache.set_moe(&gpu.info, hash, format.name(), c.kernel);
        moe_out = Some(json!({
            "format": format.name(),
            "tokens": t,
            "kernel": c.kernel,
            "grouped_ms": c.grouped.as_secs_f64() * 1e3,
            "tiled_ms": c.tiled.as_ref().ok().map(|d| d.as_secs_f64() * 1e3),
            "error": c.tiled.as_ref().err(),
        }));
    }
    cache.write(&path)?;
    println!("plans kept in {}", path.display());
    if let Some(j) = &args.json {
        let doc = json!({ "adapter": gpu.info.name, "driver": gpu.info.driver, "formats": out, "moe": moe_out });
        std::fs::write(j, serde_json::to_string_pretty(&doc)?)?;
    }
    Ok(())
}
