//! The `torus-wgpu` command line: serve, worker, bench, throughput, generate, adapters, tokenize,
//! and the GPU check's tools: synth-model, bench-model, check-profiles.

use anyhow::Result;
use clap::{Parser, Subcommand};
use std::io::Write;
use torus_wgpu::config::{EngineArgs, EngineConfig};
use torus_wgpu::engine::{generate, load_configured};
use torus_wgpu::gpu::list_adapters;
use torus_wgpu::sampling::SamplingParams;
use torus_wgpu::tokenizer::{ChatMessage, IncrementalDecoder};

#[derive(Parser)]
#[command(name = "torus-wgpu", version, about = "LLM inference on any GPU through wgpu and WGSL")]
struct Cli {
    /// Log line format on stderr: `text`, or `json` (one JSON object per line, fields at the
    /// top level). Filter with RUST_LOG; without it, errors and the server's access log
    /// (target torus_wgpu::access) are written.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum LogFormat {
    Text,
    Json,
}

/// The process's tracing subscriber, writing to stderr.
fn init_logging(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    let filter = match std::env::var(EnvFilter::DEFAULT_ENV) {
        Ok(s) if !s.trim().is_empty() => EnvFilter::new(s),
        _ => EnvFilter::new(format!("error,{}=info", torus_wgpu::server::access::ACCESS_TARGET)),
    };
    use std::io::IsTerminal;
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        LogFormat::Text => fmt.init(),
        LogFormat::Json => fmt.json().flatten_event(true).init(),
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate a completion for one prompt, streamed to stdout.
    Generate {
        #[command(flatten)]
        engine: Box<EngineArgs>,
        #[arg(long)]
        prompt: String,
        /// Render the prompt as a user message through the model's chat template.
        #[arg(long)]
        chat: bool,
        #[arg(long, default_value_t = 128)]
        max_tokens: usize,
        #[arg(long)]
        temperature: Option<f32>,
        #[arg(long)]
        top_p: Option<f32>,
        #[arg(long)]
        top_k: Option<u32>,
        /// Drop tokens less likely than min_p times the most likely one (0 = off).
        #[arg(long, default_value_t = 0.0)]
        min_p: f32,
        #[arg(long)]
        seed: Option<u64>,
        /// Keep going past end-of-sequence tokens (benchmarks).
        #[arg(long)]
        ignore_eos: bool,
    },
    /// List every wgpu adapter with its features and limits.
    Adapters,
    /// Choose the gpu profile's GEMM kernels for this adapter by measuring them (on a model's
    /// matmul shapes, or a synthetic 7B layer) and keep the choice for later runs.
    Tune(Box<torus_wgpu::bench::tune::TuneArgs>),
    /// Build every pipeline a kernel profile has (every weight format, GEMM variant and attention
    /// geometry) on an adapter, without a model; with TORUS_PRINT_PIPELINES=1 each is named on
    /// stderr first (the GPU compiler report: scripts/gpu-compiler-report.sh).
    BuildKernels(torus_wgpu::bench::build_kernels::BuildKernelsArgs),
    /// Download a model from the Hugging Face Hub into its cache (`$HF_HOME/hub`) and print its
    /// local path: OWNER/REPO[:QUANT] (a GGUF repository's file of that quantization, Q4_K_M by
    /// default; a Transformers repository's weights, config and tokenizer). `--model
    /// hf:OWNER/REPO[:QUANT]` (or `-hf OWNER/REPO[:QUANT]`) does the same for any command.
    Pull {
        /// OWNER/REPO or OWNER/REPO:QUANT, e.g. ggml-org/Qwen3-8B-GGUF:Q4_K_M
        name: String,
    },
    /// Print a text's token ids as a JSON array (or, with --decode, the text of ids); no GPU or
    /// weights needed.
    Tokenize(torus_wgpu::tokenizer::cli::TokenizeArgs),
    /// Serve the OpenAI-compatible API (default: the SmolLM2 model on 127.0.0.1:8000).
    Serve(Box<torus_wgpu::server::ServeArgs>),
    /// Benchmark any OpenAI-compatible endpoint (TTFT, TPOT, ITL, E2E latency, throughput).
    Bench(Box<torus_wgpu::bench::BenchArgs>),
    /// Serve one pipeline stage (its layers, from --config's stage keys) to a scheduler over gRPC.
    Worker {
        #[command(flatten)]
        engine: Box<EngineArgs>,
        /// Address to listen on, e.g. 127.0.0.1:50051.
        #[arg(long)]
        listen: String,
        /// Serve on a non-loopback address without a worker_token (no authentication at all).
        #[arg(long)]
        insecure: bool,
    },
    /// Offline throughput: many requests submitted at once to the engine (no HTTP).
    Throughput {
        #[command(flatten)]
        engine: Box<EngineArgs>,
        #[arg(long, default_value_t = 32)]
        num_prompts: usize,
        #[arg(long, default_value_t = 70)]
        input_len: usize,
        #[arg(long, default_value_t = 64)]
        output_len: usize,
        /// Tokens of a system prompt shared by every request (shows the prefix cache's savings).
        #[arg(long, default_value_t = 0)]
        shared_prefix: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Write a synthetic GGUF model (random weights, real shape and tokenizer) for speed and
    /// correctness checks on machines without model files.
    SynthModel {
        /// Model shape: smollm2-135m, qwen2.5-0.5b, qwen2.5-7b, llama-3-8b, qwen3-30b-a3b,
        /// gpt-oss-20b, qwen3.5-9b, qwen3.6-35b-a3b, gemma-4-e4b or phi-3-mini.
        #[arg(long)]
        shape: String,
        /// Weight format of the matrices: f32, f16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k,
        /// q4_k, q5_k, q6_k, iq4_nl, iq4_xs, mxfp4 (K-quants and iq4_xs fall back as llama.cpp's
        /// where a row is not a multiple of 256; gpt-oss's experts are mxfp4 but in f32 files).
        #[arg(long, default_value = "q4_k")]
        format: String,
        /// Layers (default: the shape's own count).
        #[arg(long)]
        layers: Option<usize>,
        /// The shape's tiny variant: the same layer kinds at hidden 256, a 2048-token vocabulary
        /// and a few layers (F32 weights are cheap; for comparisons with other engines).
        #[arg(long)]
        tiny: bool,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// A file whose text becomes the model's chat template (default: ChatML).
        #[arg(long)]
        chat_template: Option<std::path::PathBuf>,
        /// The .gguf file to write.
        #[arg(long)]
        out: std::path::PathBuf,
    },
    /// Measure decode (at several batch sizes) and prefill speed of a model, straight on `Model`
    /// (no server, no scheduler).
    BenchModel(Box<torus_wgpu::bench::model::BenchModelArgs>),
    /// Run a prompt and greedy decoding through the cpu and gpu kernel profiles and compare them
    /// step by step; exits non-zero when they disagree.
    CheckProfiles(Box<torus_wgpu::bench::profiles::CheckProfilesArgs>),
}

fn throughput(
    cfg: &EngineConfig,
    n: usize,
    input_len: usize,
    output_len: usize,
    shared: usize,
    seed: u64,
) -> Result<()> {
    use torus_wgpu::engine::{EngineHandle, Request, RequestParams, StopConditions};
    let (exec, tok) = load_configured(cfg)?;
    let vocab = exec.vocab() as u64;
    let draft = torus_wgpu::engine::load_draft(cfg, &*exec, &tok)?;
    let engine = EngineHandle::try_start_with_draft(exec, draft, tok, cfg)?;
    // Random ordinary tokens (ids above the specials at the start of the vocabulary).
    let mut rng = torus_wgpu::sampling::Rng::new(seed);
    let mut draw = |k: usize| -> Vec<u32> { (0..k).map(|_| (1000 + rng.next_u64() % (vocab - 1000)) as u32).collect() };
    let prefix = draw(shared.min(input_len));
    let reqs: Vec<Request> = (0..n)
        .map(|_| Request {
            prompt: [prefix.clone(), draw(input_len - prefix.len())].concat(),
            params: RequestParams {
                stop: StopConditions { max_tokens: Some(output_len), ignore_eos: true, ..Default::default() },
                ..Default::default()
            },
        })
        .collect();
    let t0 = std::time::Instant::now();
    let streams: Vec<_> =
        reqs.into_iter().map(|r| engine.submit(r)).collect::<Result<_, _>>().map_err(anyhow::Error::msg)?;
    let mut out_tokens = 0;
    for s in streams {
        out_tokens += s.collect_blocking().usage.completion_tokens;
    }
    let dt = t0.elapsed().as_secs_f64();
    let m = engine.metrics.snapshot();
    println!(
        "requests: {n} x ({input_len} prompt + {output_len} output tokens), max_decode_batch_size {}",
        cfg.max_decode_batch_size
    );
    println!("elapsed: {dt:.2} s  requests/s: {:.3}", n as f64 / dt);
    println!(
        "output tokens/s: {:.2}  total tokens/s: {:.2}",
        out_tokens as f64 / dt,
        (out_tokens + n * input_len) as f64 / dt
    );
    println!(
        "prompt tokens: {}  prefilled: {}  saved by the prefix cache: {}  (block hits {} of {} lookups)  preemptions: {}",
        n * input_len,
        m.prefill_tokens,
        (n * input_len) as i64 - m.prefill_tokens as i64,
        m.prefix_hits,
        m.prefix_queries,
        m.preemptions
    );
    engine.shutdown(false);
    Ok(())
}

/// The engine flags of a command that loads a model.
fn engine_args(cmd: &mut Cmd) -> Option<&mut EngineArgs> {
    match cmd {
        Cmd::Serve(a) => Some(&mut a.engine),
        Cmd::BenchModel(a) => Some(&mut a.engine),
        Cmd::CheckProfiles(a) => Some(&mut a.engine),
        Cmd::Generate { engine, .. } | Cmd::Throughput { engine, .. } | Cmd::Worker { engine, .. } => Some(engine),
        _ => None,
    }
}

/// `-hf X` (llama.cpp's spelling) as `--model hf:X`.
fn hf_flag(args: impl Iterator<Item = String>) -> Vec<String> {
    let mut out = Vec::new();
    let mut args = args.peekable();
    while let Some(a) = args.next() {
        match a.as_str() {
            "-hf" | "--hf-repo" => {
                out.push("--model".to_string());
                out.push(format!("{}{}", torus_wgpu::hub::MODEL_PREFIX, args.next().unwrap_or_default()));
            }
            _ => out.push(a),
        }
    }
    out
}

fn run(mut cli: Cli) -> Result<()> {
    // Models named on the Hub (`--model hf:OWNER/REPO[:QUANT]`) are pulled before anything loads.
    if let Some(e) = engine_args(&mut cli.cmd) {
        for m in [&mut e.model, &mut e.draft_model].into_iter().flatten() {
            *m = torus_wgpu::hub::resolve_model_arg(m)?;
        }
    }
    match cli.cmd {
        Cmd::Pull { name } => {
            let spec = torus_wgpu::hub::Spec::parse(&name)?;
            let path = torus_wgpu::hub::pull(&spec, &torus_wgpu::hub::Options::from_env())?;
            println!("{}", path.display());
        }
        Cmd::Serve(args) => torus_wgpu::server::run(*args)?,
        Cmd::Bench(args) => torus_wgpu::bench::run(*args)?,
        Cmd::Tokenize(args) => torus_wgpu::tokenizer::cli::run(&args)?,
        Cmd::SynthModel { shape, format, layers, tiny, seed, chat_template, out } => {
            use torus_wgpu::model::synth;
            let s = match tiny {
                false => synth::synth_shape(&shape),
                true => torus_wgpu::model::synth_tiny::tiny_shape(&shape).map(|(s, _)| s),
            };
            let s = s.ok_or_else(|| {
                anyhow::anyhow!("unknown shape '{shape}' (known: {})", synth::synth_shape_names().join(", "))
            })?;
            let f = synth::parse_format(&format)?;
            let t = std::time::Instant::now();
            let template = match &chat_template {
                Some(p) => {
                    Some(std::fs::read_to_string(p).map_err(|e| anyhow::anyhow!("{}: cannot read: {e}", p.display()))?)
                }
                None => None,
            };
            let bytes = synth::write_synthetic_gguf_with_template(&out, &s, f, layers, seed, template.as_deref())?;
            eprintln!(
                "wrote {}: {} {} with {} layers, {:.1} MiB in {:.1} s",
                out.display(),
                s.name,
                f.name(),
                layers.unwrap_or(s.layers),
                bytes as f64 / (1u64 << 20) as f64,
                t.elapsed().as_secs_f64()
            );
        }
        Cmd::BenchModel(args) => torus_wgpu::bench::model::run(&args)?,
        Cmd::Tune(args) => torus_wgpu::bench::tune::run(&args)?,
        Cmd::BuildKernels(args) => torus_wgpu::bench::build_kernels::run(&args)?,
        Cmd::CheckProfiles(args) => torus_wgpu::bench::profiles::run(&args)?,
        Cmd::Throughput { engine, num_prompts, input_len, output_len, shared_prefix, seed } => {
            let cfg = engine.resolve()?;
            throughput(&cfg, num_prompts, input_len, output_len, shared_prefix, seed)?;
        }
        Cmd::Adapters => {
            let list = list_adapters();
            if list.is_empty() {
                anyhow::bail!(
                    "no GPU adapter found; on Linux without a GPU, install mesa-vulkan-drivers for software Vulkan"
                );
            }
            for a in list {
                let i = &a.info;
                println!("[{}] {} ({:?}, {:?})", a.index, i.name, i.backend, i.device_type);
                println!("    driver: {} {}", i.driver, i.driver_info);
                let f = a.features;
                let has = |x: wgpu::Features| if f.contains(x) { "yes" } else { "no" };
                println!(
                    "    shader-f16: {}  subgroups: {} (size {}..{})  timestamps: {} ({})",
                    has(wgpu::Features::SHADER_F16),
                    has(wgpu::Features::SUBGROUP),
                    i.subgroup_min_size,
                    i.subgroup_max_size,
                    has(wgpu::Features::TIMESTAMP_QUERY),
                    torus_wgpu::gpu::timing::TimestampMode::of(f).name()
                );
                println!(
                    "    cooperative matrices (wgpu experimental): {}",
                    has(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
                );
                println!(
                    "    max storage binding: {} MiB  max buffer: {} MiB  max workgroup invocations: {}  \
                     workgroup memory: {} KiB",
                    a.limits.max_storage_buffer_binding_size >> 20,
                    a.limits.max_buffer_size >> 20,
                    a.limits.max_compute_invocations_per_workgroup,
                    a.limits.max_compute_workgroup_storage_size >> 10
                );
                match a.memory {
                    Some(m) => println!("    device-local memory: {} MiB", m >> 20),
                    None => println!("    device-local memory: not reported by this backend"),
                }
            }
        }
        Cmd::Worker { engine, listen, insecure } => {
            let cfg = engine.resolve()?;
            torus_wgpu::exec::remote::run_worker(&cfg, &listen, insecure)?;
        }
        Cmd::Generate { engine, prompt, chat, max_tokens, temperature, top_p, top_k, min_p, seed, ignore_eos } => {
            let cfg = engine.resolve()?;
            if cfg.enable_pipeline_parallel {
                anyhow::bail!("generate runs on one device; serve or throughput run pipelines");
            }
            let (mut model, tok) = torus_wgpu::engine::load_configured_model(&cfg)?;
            let text = if chat { tok.apply_chat_template(&[ChatMessage::new("user", prompt)], true)? } else { prompt };
            let ids = tok.encode(&text)?;
            let params = SamplingParams {
                temperature: temperature.unwrap_or(cfg.temperature),
                top_p: top_p.unwrap_or(cfg.top_p),
                top_k: top_k.unwrap_or(cfg.top_k),
                min_p,
                seed,
            };
            let mut dec = IncrementalDecoder::new(true);
            let mut out = std::io::stdout();
            let stats = generate(&mut model, &ids, max_tokens, &params, |id, _| {
                if !ignore_eos && tok.is_eos(id) {
                    return false;
                }
                let piece = dec.push(&tok, id);
                let _ = out.write_all(piece.as_bytes());
                let _ = out.flush();
                true
            })?;
            let _ = out.write_all(dec.finish(&tok).as_bytes());
            println!();
            eprintln!(
                "prompt: {} tokens, {:.1} tok/s prefill | decode: {} tokens, {:.2} tok/s",
                stats.prompt_tokens,
                stats.prefill_tps(),
                stats.generated.len(),
                stats.decode_tps()
            );
        }
    }
    Ok(())
}

fn main() {
    let cli = Cli::parse_from(hf_flag(std::env::args()));
    init_logging(cli.log_format);
    if let Err(e) = run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
