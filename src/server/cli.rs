//! `torus-wgpu serve`: its flags, and the process around the server: bind, load the model
//! (503 until then), serve until a signal, then drain within a grace period and exit.

use super::{cors_layer, model_id_for_path, start, ServerConfig};
use super::{
    default_max_connections_per_peer, DEFAULT_REQUEST_TIMEOUT_S, DEFAULT_SHUTDOWN_GRACE_S, DEFAULT_SSE_KEEPALIVE_S,
};
use super::{DEFAULT_BODY_READ_TIMEOUT_S, DEFAULT_HEADER_READ_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS};
use super::{DEFAULT_MAX_QUEUED_REQUESTS, DEFAULT_MAX_REQUEST_BODY_BYTES};
use crate::config::{EngineArgs, EngineConfig};
use crate::engine::EngineHandle;
use anyhow::{Context, Result};
use std::time::Duration;

#[derive(clap::Args, Clone, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the address is logged).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` (or `x-api-key: KEY`) on /v1 and /api routes,
    /// /tokenize and /detokenize (also from TORUS_API_KEY).
    #[arg(long, env = "TORUS_API_KEY")]
    pub api_key: Option<String>,
    /// The model id clients send and /v1/models lists (default: the model file's stem or the
    /// model directory's name). Several names (repeat the flag, or separate them with commas or
    /// spaces) are aliases: a request may name any of them; responses report the first.
    #[arg(long, num_args = 1.., value_delimiter = ',')]
    pub served_model_name: Vec<String>,
    /// Origins allowed to call the API from a browser (CORS): repeat the flag or separate them
    /// with commas; `*` allows any origin. None (the default): no CORS headers.
    #[arg(long, value_delimiter = ',')]
    pub allowed_origins: Vec<String>,
    /// Host names the server answers besides localhost, 127.0.0.1 and [::1] when it listens on
    /// a loopback address (DNS rebinding protection; other hosts get 403): repeat the flag or
    /// separate them with commas; `*` answers any. On other addresses: none given, any host;
    /// else only these.
    #[arg(long, value_delimiter = ',')]
    pub allowed_hosts: Vec<String>,
    /// Answer 503 (Retry-After) while this many sequences wait for their first token.
    #[arg(long, default_value_t = DEFAULT_MAX_QUEUED_REQUESTS)]
    pub max_queued_requests: usize,
    /// Largest accepted request body in bytes (larger: 413).
    #[arg(long, default_value_t = DEFAULT_MAX_REQUEST_BODY_BYTES)]
    pub max_request_body_bytes: usize,
    /// Time limit of each completion request in seconds, from its arrival to its last byte
    /// (0: none). Past it the request is aborted: 408, or a streamed `abort` finish and error.
    #[arg(long, default_value_t = DEFAULT_REQUEST_TIMEOUT_S)]
    pub request_timeout_s: u64,
    /// Seconds between SSE comments (`: keep-alive`) a streamed request sends while it waits
    /// for its first token, so proxies keep it open through queueing and long prefills (0: none).
    #[arg(long, default_value_t = DEFAULT_SSE_KEEPALIVE_S)]
    pub sse_keepalive_s: f64,
    /// Seconds a connection may take to send a request's headers; also how long an idle
    /// keep-alive connection stays open (0: no limit).
    #[arg(long, default_value_t = DEFAULT_HEADER_READ_TIMEOUT_S)]
    pub header_read_timeout_s: u64,
    /// Most open HTTP connections. With all taken, a probe lane of 16 more answers only
    /// /health, /metrics and /version (others: 503); beyond that, connections wait in the
    /// listen backlog.
    #[arg(long, default_value_t = DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// Most open connections from one IP address (default: half of --max-connections); more
    /// are answered 429 and closed.
    #[arg(long)]
    pub max_connections_per_peer: Option<usize>,
    /// Seconds a request's body may take to arrive after its head (0: no limit); later: 408.
    #[arg(long, default_value_t = DEFAULT_BODY_READ_TIMEOUT_S)]
    pub body_read_timeout_s: u64,
    /// On SIGTERM or SIGINT, seconds to let in-flight requests finish before they are aborted
    /// and the process exits (a second signal exits at once).
    #[arg(long, default_value_t = DEFAULT_SHUTDOWN_GRACE_S)]
    pub shutdown_grace_s: u64,
    /// Where a chat answer's thinking goes: `auto` (from the chat template: one that uses
    /// `<think>` is split, `qwen3` style when it has an `enable_thinking` switch, else
    /// `deepseek_r1`; Gemma 4's `<|channel>` and gpt-oss's harmony channels by their own parsers),
    /// `none` (all in `content`), `deepseek_r1`, `qwen3`, `gemma4` or `openai_gptoss`. The
    /// thinking span goes to `reasoning_content`, the rest to `content`.
    #[arg(long, default_value = "auto", value_parser = super::reasoning::ReasoningChoice::parse)]
    pub reasoning_parser: super::reasoning::ReasoningChoice,
    /// Do not serve the chat page at `GET /`.
    #[arg(long)]
    pub no_webui: bool,
    /// Refuse Ollama's `/api/pull` of Hugging Face models (a client may otherwise make the
    /// server download any Hub repository into its cache).
    #[arg(long)]
    pub no_pull: bool,
    /// `embed` also serves embeddings (`/v1/embeddings`, Ollama's `/api/embed`) from any
    /// supported model: every step then hands back its tokens' hidden states. `generate` (the
    /// default): text only, unless the model file is an embedding model (a GGUF declaring
    /// `pooling_type`), which turns embeddings on by itself.
    #[arg(long, default_value = "generate", value_parser = ["generate", "embed"])]
    pub task: String,
    /// How embeddings pool a prompt's last hidden states: `last` (the last token's, as decoder
    /// embedding models such as Qwen3-Embedding are trained), `mean` or `cls` (the first
    /// token's). Default: what an embedding GGUF declares, else `last`.
    #[arg(long, value_parser = crate::engine::Pooling::parse)]
    pub pooling: Option<crate::engine::Pooling>,
    /// Serve every model under DIR (GGUF files, Transformers directories; three levels deep)
    /// from one endpoint: a request's `model` picks one, loaded when first asked for (in a
    /// process of its own, with these engine settings); instead of `--model`.
    #[arg(long, env = "TORUS_MODELS_DIR")]
    pub models_dir: Option<std::path::PathBuf>,
    /// With --models-dir: most models loaded at once; the least recently used idle one is
    /// unloaded to load another.
    #[arg(long, default_value_t = 4)]
    pub max_loaded_models: usize,
    /// With --models-dir: GiB the loaded models may take, each counted as its memory plan's total
    /// (one about to load: its weights' size on disk plus total_cache_size); the least recently
    /// used idle ones are unloaded to make room.
    /// (A load that the device cannot hold also unloads idle models and tries again.)
    #[arg(long)]
    pub models_memory_gb: Option<f64>,
    /// With --models-dir: how long an idle model stays loaded when its last request did not
    /// say (Ollama's `keep_alive`): seconds or a duration such as 5m or 1h; negative (the
    /// default): until it is unloaded to make room.
    #[arg(long, env = "TORUS_KEEP_ALIVE", default_value = "-1", allow_hyphen_values = true)]
    pub keep_alive: String,
    /// With --models-dir: seconds a model may take to load.
    #[arg(long, default_value_t = 600)]
    pub model_load_timeout_s: u64,
    /// Exit when standard input closes (a models server's model processes: they end with it).
    #[arg(long, hide = true)]
    pub exit_with_stdin: bool,
}

/// `torus-wgpu serve`: binds, loads the model (503 until then), serves until SIGINT/SIGTERM,
/// then finishes in-flight requests and exits.
pub fn run(args: ServeArgs) -> Result<()> {
    if args.exit_with_stdin {
        exit_with_stdin();
    }
    if args.models_dir.is_some() {
        return super::models::serve::run(args);
    }
    let cfg = args.engine.resolve()?;
    let model_path = cfg.model_path();
    if !model_path.exists() {
        anyhow::bail!(
            "{}: model not found (run scripts/fetch-model.sh for the default model, or pass --model)",
            model_path.display()
        );
    }
    let mut names: Vec<String> = Vec::new();
    for n in args.served_model_name.iter().map(|n| n.trim()) {
        if n.is_empty() {
            anyhow::bail!("--served-model-name: empty model name");
        }
        if !names.iter().any(|m| m == n) {
            names.push(n.to_string());
        }
    }
    if names.is_empty() {
        names.push(model_id_for_path(&model_path));
    }
    let mut scfg = http_config(&args, &cfg, names.remove(0))?;
    scfg.model_aliases = names;
    let declared = crate::engine::embed::declared_pooling(&model_path);
    scfg.pooling = args.pooling.or(declared).unwrap_or(crate::engine::Pooling::Last);
    scfg.model_path = Some(model_path.clone());
    // Why embeddings are on, if they are.
    let embed = match (args.task == "embed", declared) {
        (true, _) => Some("--task embed"),
        (false, Some(_)) => Some("the model file is an embedding model"),
        (false, None) => None,
    };
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().thread_name("torus-http").build()?;
    let r = rt.block_on(serve(args, cfg, scfg, model_path, embed));
    // Never wait on work that is still running (dropping the runtime would).
    rt.shutdown_timeout(Duration::from_secs(1));
    r
}

/// The server settings every `serve` takes from its flags (one model or several), checked.
pub(super) fn http_config(args: &ServeArgs, cfg: &EngineConfig, name: String) -> Result<ServerConfig> {
    if args.max_request_body_bytes == 0 {
        anyhow::bail!("--max-request-body-bytes must be positive");
    }
    if args.max_queued_requests == 0 {
        anyhow::bail!("--max-queued-requests must be positive");
    }
    if args.max_connections == 0 {
        anyhow::bail!("--max-connections must be positive");
    }
    if args.header_read_timeout_s > 86_400 {
        anyhow::bail!("--header-read-timeout-s must be at most 86400 (a day), or 0 for no limit");
    }
    let mut scfg = ServerConfig::new(name, cfg);
    cors_layer(&args.allowed_origins).map_err(anyhow::Error::msg)?;
    scfg.allowed_origins = args.allowed_origins.clone();
    super::hosts::HostCheck::new(true, &args.allowed_hosts).map_err(anyhow::Error::msg)?;
    scfg.allowed_hosts = args.allowed_hosts.clone();
    if args.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
        // An empty key would silently mean "no authentication".
        anyhow::bail!("--api-key (or TORUS_API_KEY) is empty; give a key, or leave it unset for no authentication");
    }
    scfg.api_key = args.api_key.clone();
    scfg.max_queued_requests = args.max_queued_requests;
    scfg.max_request_body_bytes = args.max_request_body_bytes;
    let secs = |s: u64| (s > 0).then(|| Duration::from_secs(s));
    scfg.request_timeout = secs(args.request_timeout_s);
    let ka = args.sse_keepalive_s;
    if ka != 0.0 && !(0.01..=86_400.0).contains(&ka) {
        anyhow::bail!("--sse-keepalive-s must be 0 (off) or between 0.01 and 86400 seconds");
    }
    scfg.sse_keepalive = (ka > 0.0).then(|| Duration::from_secs_f64(ka));
    scfg.header_read_timeout = secs(args.header_read_timeout_s);
    scfg.max_connections = args.max_connections;
    scfg.max_connections_per_peer = match args.max_connections_per_peer {
        Some(0) => anyhow::bail!("--max-connections-per-peer must be positive"),
        Some(n) => n,
        None => default_max_connections_per_peer(args.max_connections),
    };
    if args.body_read_timeout_s > 86_400 {
        anyhow::bail!("--body-read-timeout-s must be at most 86400 (a day), or 0 for no limit");
    }
    scfg.body_read_timeout = secs(args.body_read_timeout_s);
    scfg.reasoning_parser = args.reasoning_parser;
    scfg.webui = !args.no_webui;
    scfg.allow_pull = !args.no_pull;
    Ok(scfg)
}

/// Ends the process when standard input closes (its parent, a models server, is gone).
fn exit_with_stdin() {
    std::thread::spawn(|| {
        use std::io::Write;
        let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
        // Not eprintln!: the parent read our stderr, and a write to a closed pipe must not panic.
        let _ =
            writeln!(std::io::stderr(), "torus-wgpu serve: standard input closed (the models server is gone); exiting");
        std::process::exit(0);
    });
}

async fn serve(
    args: ServeArgs,
    cfg: EngineConfig,
    scfg: ServerConfig,
    model_path: std::path::PathBuf,
    embed: Option<&'static str>,
) -> Result<()> {
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
    let auth =
        if scfg.api_key.is_some() { "API key required on /v1, /api, /tokenize and /detokenize" } else { "no API key" };
    let (name, pooling) = (scfg.served_model_name.clone(), scfg.pooling);
    let server = start(listener, scfg, None)?;
    eprintln!(
        "torus-wgpu serve: listening on http://{} ({auth}); loading {} as model {name:?} (/health answers 503 until it is loaded)",
        server.addr,
        model_path.display()
    );
    let (tx, rx) = tokio::sync::oneshot::channel();
    let load_cfg = cfg.clone();
    // A plain thread, so that a signal during loading can end the process without waiting.
    std::thread::Builder::new().name("torus-load".into()).spawn(move || {
        let r = crate::engine::load_configured(&load_cfg).and_then(|(m, t)| {
            let draft = crate::engine::load_draft(&load_cfg, &*m, &t)?;
            EngineHandle::try_start_with_draft(m, draft, t, &load_cfg)
        });
        let _ = tx.send(r);
    })?;
    let mut signal = std::pin::pin!(crate::shutdown::signal());
    let engine = tokio::select! {
        r = rx => match r {
            Ok(Ok(engine)) => engine,
            Ok(Err(e)) => {
                server.shutdown().await;
                return Err(e);
            }
            Err(_) => {
                server.shutdown().await;
                anyhow::bail!("the model loader stopped unexpectedly");
            }
        },
        _ = &mut signal => {
            eprintln!("torus-wgpu serve: signal received while loading; exiting");
            server.shutdown().await;
            return Ok(());
        }
    };
    let i = engine.info.clone();
    if let Some(name) = engine.tokenizer.builtin_template() {
        eprintln!("torus-wgpu serve: the model file has no chat template; using the built-in '{name}' turn format");
    }
    match args.reasoning_parser.resolve(engine.tokenizer.chat_template_source()) {
        Some(k) => eprintln!(
            "torus-wgpu serve: reasoning parser {k:?} ({:?}): thinking goes to reasoning_content",
            args.reasoning_parser
        ),
        None if engine.tokenizer.chat_template_source().is_some_and(|t| t.contains(super::reasoning::OPEN)) => {
            eprintln!("torus-wgpu serve: the chat template uses <think>, but --reasoning-parser is none")
        }
        None => {}
    }
    if let Some(a) = i.kv_events_addr {
        eprintln!("torus-wgpu serve: publishing KV-cache events on tcp://{a} (ZeroMQ PUB, vLLM's format)");
    }
    if let Some(sp) = cfg.spec_settings().ok().filter(|s| s.enabled()) {
        let how = match cfg.draft_model_path() {
            Some(d) if sp.method == crate::config::SpecMethod::Draft => format!("draft model {}", d.display()),
            _ if sp.method == crate::config::SpecMethod::Mtp => "the model's MTP head".to_string(),
            _ => format!("n-grams of {} to {}", sp.ngram_min, sp.ngram_max),
        };
        eprintln!(
            "torus-wgpu serve: speculative decoding {:?}: up to {} tokens per step, {how}, in steps of at most {} decoding sequences",
            sp.method, sp.max_tokens, sp.max_batch
        );
    }
    if let Some(why) = embed {
        let dim = engine.enable_embeddings().map_err(anyhow::Error::msg).context(why)?;
        eprintln!("torus-wgpu serve: embeddings on ({why}; /v1/embeddings): {dim} dimensions, {pooling:?} pooling");
    }
    server.set_engine(engine);
    eprintln!(
        "torus-wgpu serve: ready on http://{} | model {name:?} ({}) | adapter {} | KV cache ({}) {} blocks x {} tokens = {} tokens | max_sequence_length {} | max batch {} decode + {} prefill, {} tokens/step",
        server.addr,
        model_path.display(),
        i.adapter,
        cfg.kv_cache_dtype.name(),
        i.num_blocks,
        i.block_size,
        i.num_blocks * i.block_size,
        i.max_seq_len,
        cfg.max_decode_batch_size,
        cfg.max_prefill_batch_size,
        cfg.max_num_batched_tokens
    );
    signal.await;
    let grace = Duration::from_secs(args.shutdown_grace_s);
    eprintln!("torus-wgpu serve: shutting down (finishing in-flight requests for up to {} s)", grace.as_secs());
    exit_after(grace + Duration::from_secs(5));
    // A second signal: exit now.
    tokio::spawn(async {
        crate::shutdown::signal().await;
        eprintln!("torus-wgpu serve: second signal; exiting now");
        std::process::exit(130);
    });
    let engine = server.engine().cloned();
    let mut stop = std::pin::pin!(server.shutdown());
    if tokio::time::timeout(grace, &mut stop).await.is_err() {
        eprintln!("torus-wgpu serve: grace period over; aborting the requests still running");
        if let Some(e) = engine {
            // Aborted requests end their streams; the engine thread stops.
            std::thread::spawn(move || e.shutdown(false));
        }
        let _ = tokio::time::timeout(Duration::from_secs(3), &mut stop).await;
    }
    eprintln!("torus-wgpu serve: stopped");
    Ok(())
}

/// Ends the process after `t` whatever is still running (a step stuck on the GPU, say).
fn exit_after(t: Duration) {
    std::thread::spawn(move || {
        std::thread::sleep(t);
        eprintln!("torus-wgpu serve: still not stopped after {} s; exiting", t.as_secs());
        std::process::exit(1);
    });
}
