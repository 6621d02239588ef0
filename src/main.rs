//! The `torus-wgpu` command line: generate, adapters.

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use torus_wgpu::config::{default_model_path, EngineConfig};
use torus_wgpu::engine::{generate, load_model};
use torus_wgpu::gpu::{list_adapters, Gpu};
use torus_wgpu::sampling::SamplingParams;
use torus_wgpu::tokenizer::{ChatMessage, IncrementalDecoder};

#[derive(Parser)]
#[command(name = "torus-wgpu", version, about = "LLM inference on any GPU through wgpu and WGSL")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

/// Engine settings shared by the commands that load a model; each overrides the config file.
#[derive(clap::Args, Clone, Default)]
struct EngineArgs {
    /// JSON engine config (see configs/).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Hugging Face model directory or .gguf file (default: the SmolLM2 model in models/).
    #[arg(long)]
    model: Option<String>,
    /// Adapter index or name substring, as `torus-wgpu adapters` prints.
    #[arg(long)]
    adapter: Option<String>,
    #[arg(long)]
    max_sequence_length: Option<usize>,
    #[arg(long)]
    max_num_batched_tokens: Option<usize>,
    #[arg(long)]
    total_cache_size: Option<u64>,
    #[arg(long)]
    block_size: Option<usize>,
}

impl EngineArgs {
    fn resolve(&self) -> Result<EngineConfig> {
        let mut c = match &self.config {
            Some(p) => EngineConfig::from_file(p)?,
            None => EngineConfig::default(),
        };
        if self.model.is_some() {
            c.model = self.model.clone();
        }
        if self.adapter.is_some() {
            c.adapter = self.adapter.clone();
        }
        c.max_sequence_length = self.max_sequence_length.unwrap_or(c.max_sequence_length);
        c.max_num_batched_tokens = self.max_num_batched_tokens.unwrap_or(c.max_num_batched_tokens);
        c.total_cache_size = self.total_cache_size.unwrap_or(c.total_cache_size);
        c.block_size = self.block_size.unwrap_or(c.block_size);
        c.validate()?;
        Ok(c)
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
        #[arg(long)]
        seed: Option<u64>,
        /// Keep going past end-of-sequence tokens (benchmarks).
        #[arg(long)]
        ignore_eos: bool,
    },
    /// List every wgpu adapter with its features and limits.
    Adapters,
}

fn progress_bar(label: &str) -> indicatif::ProgressBar {
    let pb = indicatif::ProgressBar::new(1);
    pb.set_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} layers")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb.set_message(label.to_string());
    pb
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
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
                    "    shader-f16: {}  subgroups: {} (size {}..{})  timestamps: {}",
                    has(wgpu::Features::SHADER_F16),
                    has(wgpu::Features::SUBGROUP),
                    i.subgroup_min_size,
                    i.subgroup_max_size,
                    has(wgpu::Features::TIMESTAMP_QUERY)
                );
                println!(
                    "    max storage binding: {} MiB  max buffer: {} MiB  max workgroup invocations: {}",
                    a.limits.max_storage_buffer_binding_size >> 20,
                    a.limits.max_buffer_size >> 20,
                    a.limits.max_compute_invocations_per_workgroup
                );
            }
        }
        Cmd::Generate { engine, prompt, chat, max_tokens, temperature, top_p, top_k, seed, ignore_eos } => {
            let cfg = engine.resolve()?;
            let path = cfg.model.clone().map(PathBuf::from).unwrap_or_else(default_model_path);
            if !path.exists() {
                anyhow::bail!(
                    "{}: model not found (run scripts/fetch-model.sh for the default model, or pass --model)",
                    path.display()
                );
            }
            let gpu = Arc::new(Gpu::new(cfg.adapter.as_deref())?);
            eprintln!("adapter: {}", gpu.describe());
            let pb = progress_bar("loading");
            let (mut model, tok) = load_model(&path, &cfg, gpu, &|done, total| {
                pb.set_length(total as u64);
                pb.set_position(done as u64);
            })
            .with_context(|| format!("loading {}", path.display()))?;
            pb.finish_and_clear();
            let text = if chat { tok.apply_chat_template(&[ChatMessage::new("user", prompt)], true)? } else { prompt };
            let ids = tok.encode(&text)?;
            let params = SamplingParams {
                temperature: temperature.unwrap_or(cfg.temperature),
                top_p: top_p.unwrap_or(cfg.top_p),
                top_k: top_k.unwrap_or(cfg.top_k),
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
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = run() {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
