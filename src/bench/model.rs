//! `torus-wgpu bench-model`: the speed of `Model` itself, with no server and no scheduler.
//! Decode tokens/s at several batch sizes (B sequences, each decoding one token per step after a
//! short prompt) and the weight bytes read per second that implies, and the prefill tokens/s of
//! one long prompt. Made for synthetic models (`torus-wgpu synth-model`) on machines with a GPU
//! but no model files; any model file works.

use crate::bench::kernels::{format_runs, KernelProfileRun};
use crate::config::{EngineArgs, EngineConfig};
use crate::gpu::Gpu;
use crate::model::config::ModelConfig;
use crate::model::loader::{read_config, HostModel};
use crate::model::Model;
use crate::weights::tensor::XorShift64;
use anyhow::{anyhow, bail, Context, Result};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

pub use super::measure::{measure_decode, measure_prefill, random_tokens, DecodeResult, PrefillResult};

#[derive(clap::Args, Clone, Debug)]
pub struct BenchModelArgs {
    /// Engine settings (--model, --adapter, --kernel-profile, ...). max_decode_batch_size,
    /// max_num_batched_tokens, max_sequence_length and total_cache_size are sized for the
    /// requested runs unless given as flags.
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Decode batch sizes to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    pub batches: Vec<usize>,
    /// Timed decode steps per batch size.
    #[arg(long, default_value_t = 32)]
    pub decode_steps: usize,
    /// Untimed decode steps before the timed ones.
    #[arg(long, default_value_t = 2)]
    pub warmup_steps: usize,
    /// Prompt tokens of each decoding sequence.
    #[arg(long, default_value_t = 16)]
    pub prompt_tokens: usize,
    /// Tokens of the prefill measurement's prompt (0: no prefill measurement), in steps of at
    /// most max_num_batched_tokens.
    #[arg(long, default_value_t = 512)]
    pub prefill_tokens: usize,
    /// Write the report as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Seed of the random prompt tokens.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Then profile each shape (decode at each batch size, the prefill): the GPU time, bytes and
    /// FLOPs of every op label per step, from timestamp queries where the adapter has them.
    #[arg(long)]
    pub profile_kernels: bool,
    /// Decode steps profiled per batch size (the prefill is profiled whole).
    #[arg(long, default_value_t = 4)]
    pub profile_steps: usize,
    /// Benchmark only, for mixture-of-experts models: route every token to this many experts
    /// instead of the model's own number (the expert count: every expert active), to measure what
    /// the sparse path saves. The outputs are no longer the model's.
    #[arg(long)]
    pub moe_top_k: Option<usize>,
    /// The GPU's peak memory bandwidth in GB/s (e.g. 3350 for an H100 SXM, 4800 for an H200):
    /// each decode step's floor (the weight bytes it reads at that rate) is reported beside it.
    #[arg(long)]
    pub peak_gb_s: Option<f64>,
    /// Also time the MTP head's proposal rounds at each batch size (Qwen3.5 files with a head,
    /// synthetic ones included).
    #[arg(long)]
    pub mtp: bool,
}

/// The adapter a measurement ran on.
#[derive(Clone, Debug, Serialize)]
pub struct AdapterSummary {
    pub name: String,
    pub backend: String,
    pub device_type: String,
    pub driver: String,
    pub driver_info: String,
}

impl AdapterSummary {
    pub fn of(gpu: &Gpu) -> AdapterSummary {
        let i = &gpu.info;
        AdapterSummary {
            name: i.name.clone(),
            backend: format!("{:?}", i.backend),
            device_type: format!("{:?}", i.device_type),
            driver: i.driver.clone(),
            driver_info: i.driver_info.clone(),
        }
    }
}

/// The model a measurement ran.
#[derive(Clone, Debug, Serialize)]
pub struct ModelSummary {
    pub file: String,
    /// `general.name` of a GGUF file (e.g. "synthetic qwen2.5-7b q4_k"), when it has one.
    pub name: Option<String>,
    pub arch: String,
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub vocab: usize,
    /// Weight formats of the matrices.
    pub formats: Vec<String>,
    /// Bytes of weights on the device (`Model::plan.weights`).
    pub weight_bytes: u64,
    /// Mixture of experts: experts per layer and per token (as run), and the bytes of all expert
    /// tensors (part of weight_bytes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub experts: Option<(usize, usize)>,
    pub expert_bytes: u64,
    /// Bytes of an untied token embedding (part of weight_bytes): a step reads only its tokens'
    /// rows of it. 0 when tied (the LM head reads it whole).
    pub lookup_bytes: u64,
}

impl ModelSummary {
    /// Weight bytes one decode step of `batch` sequences reads: every weight but an untied
    /// embedding (a row per token, not counted) and the experts, and of each MoE layer the
    /// experts its tokens chose (batch * top_k of them, at most all: the upper bound, every
    /// choice distinct).
    pub fn step_weight_bytes(&self, batch: usize) -> u64 {
        let dense = self.dense_step_bytes();
        match self.experts {
            None => dense,
            Some((e, k)) => {
                let active = (batch * k).min(e) as u64;
                dense - self.expert_bytes + self.expert_bytes * active / e.max(1) as u64
            }
        }
    }

    /// What a step of a dense model of this size reads: every weight but an untied embedding.
    pub fn dense_step_bytes(&self) -> u64 {
        self.weight_bytes - self.lookup_bytes
    }
}

impl ModelSummary {
    fn of(path: &Path, host: &HostModel, weight_bytes: u64) -> ModelSummary {
        let c = &host.cfg;
        let name = match path.is_dir() {
            true => None,
            false => crate::formats::gguf::GgufFile::open(path)
                .ok()
                .and_then(|g| g.get_str("general.name").map(str::to_string)),
        };
        ModelSummary {
            file: path.display().to_string(),
            name,
            arch: format!("{:?}", c.arch).to_lowercase(),
            layers: c.layers,
            hidden: c.hidden,
            heads: c.heads,
            kv_heads: c.kv_heads,
            head_dim: c.head_dim,
            intermediate: c.intermediate,
            vocab: c.vocab,
            formats: {
                let mut f = [host.formats(), host.moe_formats()].concat();
                f.sort();
                f.dedup();
                f.iter().map(|f| f.name().to_string()).collect()
            },
            weight_bytes,
            experts: c.moe.as_ref().map(|m| (m.experts, m.top_k)),
            expert_bytes: host.expert_bytes(),
            lookup_bytes: match (host.embed_info(), host.tied) {
                (Some(e), false) => e.bytes,
                _ => 0,
            },
        }
    }
}

/// What `bench-model` measured (also its JSON document).
#[derive(Clone, Debug, Serialize)]
pub struct BenchModelReport {
    pub adapter: AdapterSummary,
    /// The kernel profile the model ran with (auto resolved for the adapter).
    pub kernel_profile: String,
    /// wgpu's shader runtime checks (TORUS_SHADER_CHECKS: full, loops or off).
    pub shader_checks: String,
    pub model: ModelSummary,
    pub kv_cache_dtype: String,
    pub max_num_batched_tokens: usize,
    pub decode: Vec<DecodeResult>,
    pub prefill: Option<PrefillResult>,
    /// With --profile-kernels: where each shape's step time goes.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub kernel_timing: Vec<KernelProfileRun>,
    /// With --mtp: the MTP head's cost per proposal round at each batch size.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub mtp: Vec<crate::bench::mtp::MtpResult>,
}

/// Sizes the engine settings `args` leaves unset for a run: max_decode_batch_size (the
/// largest batch), max_num_batched_tokens (the largest step), max_sequence_length (the longest
/// sequence) and total_cache_size (exactly `cache_blocks(block_size)` KV blocks). Flags the
/// user gave are kept (a run that does not fit them fails, naming the limit).
pub fn sized_config(
    args: &EngineArgs,
    model: &ModelConfig,
    max_batch: usize,
    max_len: usize,
    step_tokens: usize,
    cache_blocks: &dyn Fn(usize) -> usize,
) -> Result<EngineConfig> {
    let mut cfg = args.resolve()?;
    if args.max_decode_batch_size.is_none() {
        cfg.max_decode_batch_size = max_batch.max(1);
    }
    if args.max_num_batched_tokens.is_none() {
        cfg.max_num_batched_tokens = step_tokens.max(max_batch).max(1);
    }
    if args.max_sequence_length.is_none() {
        cfg.max_sequence_length = max_len.next_multiple_of(cfg.block_size).max(cfg.block_size);
    }
    if args.total_cache_size.is_none() {
        // One spare block: a model needs at least two.
        let blocks = (cache_blocks(cfg.block_size) + 1) as u64;
        let per_block = (cfg.block_size * model.kv_dim() * cfg.kv_cache_dtype.bytes()) as u64;
        cfg.total_cache_size = blocks * per_block * 2 * model.layers as u64;
    }
    cfg.validate()?;
    Ok(cfg)
}

/// Loads the model `cfg` names onto `gpu` (weights only: no tokenizer), compiles every pipeline.
/// Prints how long reading the file and building the model on the device took.
pub fn load_model(cfg: &EngineConfig, gpu: Arc<Gpu>, moe_top_k: Option<usize>) -> Result<(Model, HostModel)> {
    let path = cfg.model_path();
    let t = Instant::now();
    let mut host = HostModel::open(&path, None, &|_, _| {}).with_context(|| format!("loading {}", path.display()))?;
    if let Some(k) = moe_top_k {
        let layers = host.cfg.layers;
        let Some(m) = host.cfg.moe.as_mut() else { bail!("--moe-top-k: {} has no experts", path.display()) };
        m.top_k = k;
        m.validate(layers, "--moe-top-k")?;
        eprintln!("benchmark override: {k} experts per token of {} (outputs are not the model's)", m.experts);
    }
    let read_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let limits = crate::exec::step_limits(cfg, &host.cfg);
    let mut model = Model::new(gpu, &host, limits).with_context(|| format!("loading {}", path.display()))?;
    model.warm_up()?;
    eprintln!(
        "loaded {}: read {read_s:.1} s, on the device {:.1} s: {}",
        path.display(),
        t.elapsed().as_secs_f64(),
        model.plan
    );
    Ok((model, host))
}

/// Loads the model and measures everything `args` asks for.
pub fn bench_model(args: &BenchModelArgs) -> Result<BenchModelReport> {
    if args.batches.is_empty() || args.batches.contains(&0) {
        bail!("--batches must list positive batch sizes");
    }
    if args.decode_steps == 0 {
        bail!("--decode-steps must be positive");
    }
    let path = args.engine.resolve()?.model_path();
    let mcfg = read_config(&path)?;
    let max_batch = args.batches.iter().copied().max().unwrap_or(1);
    let decode_len = args.prompt_tokens.max(1) + args.warmup_steps + args.decode_steps;
    let step_tokens = (max_batch * args.prompt_tokens.max(1)).max(args.prefill_tokens).min(512);
    // The largest batch's sequences, or the prefill's one.
    let blocks = |bs: usize| (max_batch * decode_len.div_ceil(bs)).max(args.prefill_tokens.div_ceil(bs));
    let cfg = sized_config(&args.engine, &mcfg, max_batch, decode_len.max(args.prefill_tokens), step_tokens, &blocks)?;
    let gpu = Arc::new(Gpu::new(cfg.adapter.as_deref())?);
    eprintln!("adapter: {}", gpu.describe());
    if crate::gpu::family::shader_checks() != crate::gpu::family::ShaderChecks::Loops {
        eprintln!("shader runtime checks: {:?} (TORUS_SHADER_CHECKS)", crate::gpu::family::shader_checks());
    }
    let (mut model, host) = load_model(&cfg, gpu.clone(), args.moe_top_k)?;
    let model_summary = ModelSummary::of(&path, &host, model.plan.weights);
    drop(host);
    let mut rng = XorShift64::new(args.seed);
    let mut decode = Vec::new();
    let sizes = (args.prompt_tokens, args.warmup_steps, args.decode_steps);
    for &b in &args.batches {
        let (mut r, _) =
            measure_decode(&mut model, b, sizes, &mut rng, false).with_context(|| format!("decode at batch {b}"))?;
        r.read_gb_s = model_summary.step_weight_bytes(b) as f64 * r.steps as f64 / r.seconds / 1e9;
        r.per_step.floor_ms = args.peak_gb_s.map(|p| model_summary.step_weight_bytes(b) as f64 / (p * 1e6));
        eprintln!("batch {b}: {:.2} tok/s; {}", r.tok_s, r.per_step.line());
        decode.push(r);
    }
    let mut mtp = Vec::new();
    if args.mtp {
        let mut head = crate::bench::mtp::load_head(&cfg, gpu.clone(), &model)?;
        for &b in &args.batches {
            let sizes = (args.prompt_tokens, args.decode_steps);
            let r = crate::bench::mtp::measure_mtp(&mut head, b, sizes, &mut rng)
                .with_context(|| format!("MTP head at batch {b}"))?;
            eprintln!("MTP head, batch {b}: {:.2} ms per round", r.ms_per_round);
            mtp.push(r);
        }
    }
    let prefill = match args.prefill_tokens {
        0 => None,
        n => Some(measure_prefill(&mut model, n, &mut rng, false).context("prefill")?.0),
    };
    // The profiled runs come after the timed ones, which the timestamps do not disturb.
    let mut kernel_timing = Vec::new();
    if args.profile_kernels {
        let sizes = (args.prompt_tokens, 1, args.profile_steps.max(1));
        for &b in &args.batches {
            let (_, run) = measure_decode(&mut model, b, sizes, &mut rng, true)
                .with_context(|| format!("profiling decode at batch {b}"))?;
            kernel_timing.extend(run);
        }
        if args.prefill_tokens > 0 {
            let (_, run) =
                measure_prefill(&mut model, args.prefill_tokens, &mut rng, true).context("profiling prefill")?;
            kernel_timing.extend(run);
        }
    }
    Ok(BenchModelReport {
        adapter: AdapterSummary::of(&gpu),
        kernel_profile: model.limits.profile.name().to_string(),
        shader_checks: format!("{:?}", crate::gpu::family::shader_checks()).to_lowercase(),
        model: model_summary,
        kv_cache_dtype: cfg.kv_cache_dtype.name().to_string(),
        max_num_batched_tokens: model.limits.max_tokens,
        decode,
        prefill,
        kernel_timing,
        mtp,
    })
}

/// The report as a readable table.
pub fn format_report(r: &BenchModelReport) -> String {
    let m = &r.model;
    let a = &r.adapter;
    let mut t = String::new();
    t.push_str(&format!(
        "adapter: {} ({}, {}; driver {} {})\n",
        a.name, a.backend, a.device_type, a.driver, a.driver_info
    ));
    t.push_str(&format!("kernel profile: {}   KV cache: {}\n", r.kernel_profile, r.kv_cache_dtype));
    t.push_str(&format!(
        "model: {}{}\n       {} layers {}, hidden {}, heads {}/{} x {}, ffn {}, vocab {}, weights {:.1} MiB ({})\n",
        m.file,
        m.name.as_ref().map_or(String::new(), |n| format!(" ({n})")),
        m.arch,
        m.layers,
        m.hidden,
        m.heads,
        m.kv_heads,
        m.head_dim,
        m.intermediate,
        m.vocab,
        m.weight_bytes as f64 / (1u64 << 20) as f64,
        m.formats.join(", ")
    ));
    if let Some((e, k)) = m.experts {
        t.push_str(&format!(
            "experts: {k} of {e} per token; {:.1} MiB of experts; a batch-1 step reads {:.1} MiB of weights \
             (a dense model of this size: {:.1} MiB)\n",
            m.expert_bytes as f64 / (1u64 << 20) as f64,
            m.step_weight_bytes(1) as f64 / (1u64 << 20) as f64,
            m.dense_step_bytes() as f64 / (1u64 << 20) as f64
        ));
    }
    t.push_str(&format!(
        "{:>8} {:>8} {:>10} {:>12} {:>14} {:>12}\n",
        "batch", "steps", "seconds", "tok/s", "weight GB/s", "read GB/s"
    ));
    for d in &r.decode {
        t.push_str(&format!(
            "{:>8} {:>8} {:>10.3} {:>12.2} {:>14.2} {:>12.2}\n",
            d.batch, d.steps, d.seconds, d.tok_s, d.weight_gb_s, d.read_gb_s
        ));
    }
    if let Some(p) = &r.prefill {
        t.push_str(&format!(
            "prefill: {} tokens in {} steps (max {} tokens each): {:.3} s, {:.2} tok/s\n",
            p.tokens, p.steps, r.max_num_batched_tokens, p.seconds, p.tok_s
        ));
    }
    for m in &r.mtp {
        let step = r.decode.iter().find(|d| d.batch == m.batch).map_or(0.0, |d| d.seconds * 1e3 / d.steps as f64);
        t.push_str(&format!(
            "MTP head, batch {}: {:.2} ms per proposal round ({} rounds); the model's decode step {:.2} ms\n",
            m.batch, m.ms_per_round, m.rounds, step
        ));
    }
    t.push_str(&format_runs(&r.kernel_timing));
    t
}

/// `torus-wgpu bench-model`.
pub fn run(args: &BenchModelArgs) -> Result<()> {
    let report = bench_model(args)?;
    print!("{}", format_report(&report));
    if let Some(p) = &args.json {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(p, text + "\n").map_err(|e| anyhow!("{}: {e}", p.display()))?;
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}
