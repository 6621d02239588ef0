//! `torus-wgpu serve`: the OpenAI-compatible HTTP server (routes, OpenAI types, SSE, errors,
//! metrics) over the engine handle; beside it Anthropic's Messages API (`anthropic`), OpenAI's
//! Responses API (`responses`) and Ollama's API (`ollama`), each translated into a chat request
//! and read back through `turn`, embeddings (`embeddings`, with `--task embed`), and the chat
//! page at `/` (`webui`).
//!
//! The listener is bound before the model loads: while it loads, `GET /health` and every API
//! route answer 503 (with `Retry-After`), and `/metrics` reports `torus_model_loaded 0`.
//! `/health`, `/metrics`, `/version` and the chat page never need the API key; every `/v1/...`
//! route, `/api/...`, `/tokenize` and `/detokenize` do when one is set (as `Authorization:
//! Bearer KEY` or `x-api-key: KEY`); a refusal is in the route's API's error shape.
//!
//! Tests and embedders run the server in-process with [`start`] on a listener of their own
//! (port 0 for an ephemeral port) and stop it with [`ServerHandle::shutdown`].
//!
//! Owns: the HTTP APIs (OpenAI, Anthropic, Responses and Ollama routes, SSE, errors, metrics, access log), the chat page, tools and structured-output parsing of requests.
//! May use: engine, exec, tokenizer, structured, config, sampling, shutdown, formats, hub.
//! Never uses: gpu, model, ops.

pub mod access;
mod anthropic;
mod body;
mod cli;
mod conn;
mod embeddings;
mod error;
mod fields;
mod generate;
pub mod harmony;
mod hosts;
mod info;
mod json;
mod llama;
pub mod metrics;
pub mod models;
mod ollama;
mod openai;
mod params;
mod prefill;
mod prepare;
mod queue;
pub mod reasoning;
mod responses;
mod structured;
mod timings;
mod token_ids;
mod tokenize;
mod tools;
mod turn;
mod webui;
mod work;

pub use cli::{run, ServeArgs};
pub use error::{ApiError, Dialect};
pub use metrics::ServerMetrics;
pub use tools::tool_call_grammar;

use crate::config::EngineConfig;
use crate::engine::EngineHandle;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue};
use axum::middleware::{from_fn_with_state, Next};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// Most choices (`n`) per request, by default.
pub const DEFAULT_MAX_N: usize = 16;
/// Sequences waiting for their first token before new requests get 503.
pub const DEFAULT_MAX_QUEUED_REQUESTS: usize = 256;
/// Largest accepted request body (larger: 413).
pub const DEFAULT_MAX_REQUEST_BODY_BYTES: usize = 4 << 20;
/// Default `--request-timeout-s`.
pub const DEFAULT_REQUEST_TIMEOUT_S: u64 = 600;
/// Default seconds between SSE keep-alive comments before a stream's first token.
pub const DEFAULT_SSE_KEEPALIVE_S: f64 = 15.0;
/// Default `--header-read-timeout-s`.
pub const DEFAULT_HEADER_READ_TIMEOUT_S: u64 = 30;
/// Default `--max-connections` (below the usual 1024 open-file limit).
pub const DEFAULT_MAX_CONNECTIONS: usize = 512;
/// Default `--max-connections-per-peer`: half of `max_connections` (at least 1).
pub fn default_max_connections_per_peer(max_connections: usize) -> usize {
    (max_connections / 2).max(1)
}
/// Default `--body-read-timeout-s`.
pub const DEFAULT_BODY_READ_TIMEOUT_S: u64 = 30;
/// Default `--shutdown-grace-s`.
pub const DEFAULT_SHUTDOWN_GRACE_S: u64 = 5;

/// How the HTTP side behaves (the engine has its own config).
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The model id responses report (and /v1/models lists first).
    pub served_model_name: String,
    /// Further names a request may give for the model (listed by /v1/models after the first).
    pub model_aliases: Vec<String>,
    /// Origins allowed by CORS (`*`: any); empty: no CORS headers at all.
    pub allowed_origins: Vec<String>,
    /// Host names answered beside the loopback ones (`*`: any; see `hosts`).
    pub allowed_hosts: Vec<String>,
    pub api_key: Option<String>,
    pub max_queued_requests: usize,
    pub max_request_body_bytes: usize,
    /// Most choices (`n`) per request.
    pub max_n: usize,
    /// Sampling defaults for requests that give none (from the engine config).
    pub default_temperature: f32,
    pub default_top_p: f32,
    pub default_top_k: u32,
    /// With n > 1 (and a prompt longer than a block), prefill the prompt once, then start the
    /// other choices on its cached blocks. Set from `enable_prefix_cache`.
    pub share_prompt_prefill: bool,
    /// Time limit of each completion request (None: none); a request may ask for less.
    pub request_timeout: Option<Duration>,
    /// Interval of SSE keep-alive comments before a stream's first token (None: none).
    pub sse_keepalive: Option<Duration>,
    /// How long a connection may take to send a request's headers, and how long an idle
    /// keep-alive connection stays open (None: no limit).
    pub header_read_timeout: Option<Duration>,
    /// Most open connections (at least 1), not counting the probe lane (see `conn`).
    pub max_connections: usize,
    /// Most open connections from one IP address.
    pub max_connections_per_peer: usize,
    /// How long a request's body may take to arrive (None: no limit).
    pub body_read_timeout: Option<Duration>,
    /// The engine's KV-cache dtype (reported by `vllm:cache_config_info`).
    pub kv_cache_dtype: crate::config::KvDtype,
    /// How chat outputs are split into `reasoning_content` and `content` (see `reasoning`).
    pub reasoning_parser: reasoning::ReasoningChoice,
    /// Serve the chat page at `GET /` (`--no-webui` turns it off).
    pub webui: bool,
    /// How `/v1/embeddings` pools a prompt's hidden states (`--pooling`).
    pub pooling: crate::engine::Pooling,
    /// The model file or directory (Ollama's `/api/tags` and `/api/show` describe it).
    pub model_path: Option<std::path::PathBuf>,
    /// Sequences decoded at once (llama-server's `total_slots` in `/props`).
    pub total_slots: usize,
    /// Speculative decoding is on (`/props` and `/slots` say so).
    pub speculative: bool,
    /// Where Ollama's `/api/pull` downloads from and to (None: the environment's, as
    /// `hub::Options::from_env`).
    pub hub: Option<crate::hub::Options>,
    /// Ollama's `/api/pull` may download Hub models (`serve --no-pull` turns it off).
    pub allow_pull: bool,
}

impl ServerConfig {
    /// Defaults for serving `cfg`'s model under `served_model_name`.
    pub fn new(served_model_name: impl Into<String>, cfg: &EngineConfig) -> ServerConfig {
        ServerConfig {
            served_model_name: served_model_name.into(),
            model_aliases: Vec::new(),
            allowed_origins: Vec::new(),
            allowed_hosts: Vec::new(),
            api_key: None,
            max_queued_requests: DEFAULT_MAX_QUEUED_REQUESTS,
            max_request_body_bytes: DEFAULT_MAX_REQUEST_BODY_BYTES,
            max_n: DEFAULT_MAX_N,
            default_temperature: cfg.temperature,
            default_top_p: cfg.top_p,
            default_top_k: cfg.top_k,
            share_prompt_prefill: cfg.enable_prefix_cache,
            request_timeout: Some(Duration::from_secs(DEFAULT_REQUEST_TIMEOUT_S)),
            sse_keepalive: Some(Duration::from_secs_f64(DEFAULT_SSE_KEEPALIVE_S)),
            header_read_timeout: Some(Duration::from_secs(DEFAULT_HEADER_READ_TIMEOUT_S)),
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_connections_per_peer: default_max_connections_per_peer(DEFAULT_MAX_CONNECTIONS),
            body_read_timeout: Some(Duration::from_secs(DEFAULT_BODY_READ_TIMEOUT_S)),
            kv_cache_dtype: cfg.kv_cache_dtype,
            reasoning_parser: reasoning::ReasoningChoice::Auto,
            webui: true,
            pooling: crate::engine::Pooling::Last,
            model_path: None,
            total_slots: cfg.max_decode_batch_size,
            speculative: cfg.speculative != crate::config::SpecMethod::Off,
            hub: None,
            allow_pull: true,
        }
    }
}

impl ServerConfig {
    /// The model file's (or directory's) name, never its path: where it lives on the server is
    /// not the client's business.
    pub fn model_file_name(&self) -> Option<String> {
        self.model_path.as_deref().and_then(|p| p.file_name()).map(|n| n.to_string_lossy().into_owned())
    }
}

/// The model id for a model path: a file's stem (`SmolLM2-135M-Instruct.Q4_1`) or a
/// directory's name (`tiny-qwen2`).
pub fn model_id_for_path(path: &Path) -> String {
    let name = if path.is_dir() { path.file_name() } else { path.file_stem() };
    name.map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| path.display().to_string())
}

/// State shared by every handler.
pub(crate) struct AppState {
    pub cfg: ServerConfig,
    pub engine: OnceLock<EngineHandle>,
    pub metrics: ServerMetrics,
    /// Which `Host` headers are answered (DNS rebinding).
    pub host_check: hosts::HostCheck,
    /// The model file's parameter count (Ollama's `parameter_size`), read once when asked.
    pub parameter_count: OnceLock<Option<u64>>,
    /// Where requests are parsed, rendered and tokenized before they are queued.
    pub work: work::WorkPool,
    /// Unix time the server started (the model's `created`).
    pub started: u64,
    /// A models server's models (`serve --models-dir`); None for a server of one model.
    pub models: Option<Arc<models::Pool>>,
    /// Ollama's `/api/pull`: one download at a time (its permit is the download's).
    pub pulls: Arc<tokio::sync::Semaphore>,
    id_salt: u64,
    next_id: AtomicU64,
}

pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

impl AppState {
    /// The engine, or 503 while the model loads or once the engine cannot serve.
    pub fn engine(&self) -> Result<&EngineHandle, ApiError> {
        let e =
            self.engine.get().ok_or_else(|| ApiError::unavailable("the model is still loading", "model_loading"))?;
        e.health()
            .map_err(|why| ApiError::unavailable(format!("the engine cannot serve: {why}"), "engine_unavailable"))?;
        Ok(e)
    }

    /// A fresh response id such as `chatcmpl-3f2a...`.
    pub fn new_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Relaxed);
        let a = crate::sampling::Rng::new(self.id_salt ^ n).next_u64();
        let b = crate::sampling::Rng::new(a ^ n.rotate_left(17)).next_u64();
        format!("{prefix}-{a:016x}{:08x}", b as u32)
    }

    /// A fresh request id (32 hex digits) for the `x-request-id` header and the access log.
    pub fn new_request_id(&self) -> String {
        let n = self.next_id.fetch_add(1, Relaxed);
        let a = crate::sampling::Rng::new(self.id_salt ^ n.rotate_left(29)).next_u64();
        let b = crate::sampling::Rng::new(a ^ n).next_u64();
        format!("{a:016x}{b:016x}")
    }

    /// Every name of the served model: the primary one, then the aliases.
    pub fn model_names(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.cfg.served_model_name.as_str()).chain(self.cfg.model_aliases.iter().map(String::as_str))
    }

    /// 404 for a request naming another model (no model named: the served one).
    pub fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        if let (Some(pool), Some(m)) = (&self.models, model) {
            return pool.find(m).map(|_| ()).ok_or_else(|| models::unknown(pool, m));
        }
        match model {
            Some(m) if !self.model_names().any(|n| n == m) => Err(ApiError::model_not_found(m)),
            _ => Ok(()),
        }
    }
}

/// A running server.
pub struct ServerHandle {
    /// The address it listens on.
    pub addr: SocketAddr,
    state: Arc<AppState>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

impl ServerHandle {
    /// Installs the engine once the model has loaded; from then on /health answers 200.
    /// Returns false (and drops `engine`) if one was installed already.
    pub fn set_engine(&self, engine: EngineHandle) -> bool {
        self.state.engine.set(engine).is_ok()
    }

    pub fn engine(&self) -> Option<&EngineHandle> {
        self.state.engine.get()
    }

    /// The server's own counters (responses by status, latency histograms).
    pub fn metrics(&self) -> &ServerMetrics {
        &self.state.metrics
    }

    /// Graceful stop: no new connections (those waiting in the backlog are dropped), idle
    /// keep-alive connections close, in-flight requests (streams included) run to their end,
    /// then the engine drains and its thread exits.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            match task.await {
                Ok(Err(e)) => tracing::warn!("server error: {e}"),
                Err(e) => tracing::warn!("server task: {e}"),
                Ok(Ok(())) => {}
            }
        }
        if let Some(engine) = self.state.engine.get().cloned() {
            let _ = tokio::task::spawn_blocking(move || engine.shutdown(true)).await;
        }
        if let Some(pool) = &self.state.models {
            pool.stop_all();
        }
    }
}

/// Serves the OpenAI API on `listener` (inside the current tokio runtime). With `engine` None
/// the server answers 503 until [`ServerHandle::set_engine`].
pub fn start(
    listener: tokio::net::TcpListener,
    cfg: ServerConfig,
    engine: Option<EngineHandle>,
) -> std::io::Result<ServerHandle> {
    start_with(listener, cfg, engine, None)
}

/// [`start`], for a models server when `models` is given (`serve --models-dir`).
pub fn start_with(
    listener: tokio::net::TcpListener,
    cfg: ServerConfig,
    engine: Option<EngineHandle>,
    models: Option<Arc<models::Pool>>,
) -> std::io::Result<ServerHandle> {
    let addr = listener.local_addr()?;
    let invalid = |e: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, e);
    let cors = cors_layer(&cfg.allowed_origins).map_err(invalid)?;
    let host_check = hosts::HostCheck::new(addr.ip().is_loopback(), &cfg.allowed_hosts).map_err(invalid)?;
    let state = Arc::new(AppState {
        cfg,
        host_check,
        parameter_count: OnceLock::new(),
        engine: OnceLock::new(),
        metrics: ServerMetrics::default(),
        work: work::WorkPool::per_core(),
        started: unix_now(),
        models,
        pulls: Arc::new(tokio::sync::Semaphore::new(1)),
        id_salt: crate::sampling::Rng::from_entropy().next_u64(),
        next_id: AtomicU64::new(1),
    });
    if let Some(e) = engine {
        let _ = state.engine.set(e);
    }
    let app = router(state.clone(), cors);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(conn::accept_loop(listener, app, state.clone(), stopped));
    Ok(ServerHandle { addr, state, stop: Some(stop), task: Some(task) })
}

/// The CORS layer for `origins` (None when empty): GET, POST and OPTIONS with whatever headers
/// the preflight names; `x-request-id` readable by scripts. Preflight requests (OPTIONS) are answered by the layer itself.
pub fn cors_layer(origins: &[String]) -> Result<Option<tower_http::cors::CorsLayer>, String> {
    use axum::http::Method;
    use tower_http::cors::{AllowOrigin, CorsLayer};
    let origins: Vec<&str> = origins.iter().map(|o| o.trim()).filter(|o| !o.is_empty()).collect();
    if origins.is_empty() {
        return Ok(None);
    }
    let allow = if origins.contains(&"*") {
        AllowOrigin::any()
    } else {
        let mut list = Vec::new();
        for o in origins {
            let host = o.strip_prefix("http://").or_else(|| o.strip_prefix("https://"));
            let ok = o == "null"
                || host.is_some_and(|h| {
                    !h.is_empty() && h.bytes().all(|b| b.is_ascii_graphic() && !b"/?#@\\".contains(&b))
                });
            let v = HeaderValue::from_str(o).ok().filter(|_| ok).ok_or_else(|| {
                format!("--allowed-origins: {o:?} is not an origin (scheme://host[:port], no path; or `*`)")
            })?;
            list.push(v);
        }
        AllowOrigin::list(list)
    };
    Ok(Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods([Method::GET, Method::POST, Method::OPTIONS])
            // The headers the preflight asks for: the official browser SDKs send their own
            // (`x-stainless-*`, `anthropic-dangerous-direct-browser-access`, ...); the origin
            // list is the restriction.
            .allow_headers(tower_http::cors::AllowHeaders::mirror_request())
            .expose_headers([access::REQUEST_ID]),
    ))
}

fn router(state: Arc<AppState>, cors: Option<tower_http::cors::CorsLayer>) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/embeddings", post(embeddings::embeddings))
        .route("/v1/models", get(info::list_models))
        .route("/v1/models/{*model}", get(info::get_model))
        // llama-server answers OpenAI's routes without the prefix too.
        .route("/chat/completions", post(openai::chat_completions))
        .route("/embeddings", post(embeddings::embeddings))
        .route("/models", get(info::list_models))
        // The server's models and settings: for key holders only, as the API is.
        .route("/server_info", get(info::server_info))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .merge(anthropic::routes())
        .merge(responses::routes())
        .merge(ollama::routes())
        .merge(llama::routes())
        // A models server passes requests on to their models (inside the key check).
        .route_layer(from_fn_with_state(state.clone(), models::dispatch))
        .route_layer(from_fn_with_state(state.clone(), require_api_key));
    let mut app = Router::new()
        .merge(api)
        .route("/health", get(info::health))
        .route("/metrics", get(info::prometheus))
        .route("/version", get(info::version))
        .fallback(|uri: axum::http::Uri| async move {
            ApiError::not_found("no such route").response_in(Dialect::of_path(uri.path()))
        })
        .method_not_allowed_fallback(|uri: axum::http::Uri| async move {
            ApiError::method_not_allowed().response_in(Dialect::of_path(uri.path()))
        });
    if state.cfg.webui {
        app = app.merge(webui::routes());
    }
    // Innermost first: CORS (answers preflights), the Host check, the status counter, the
    // access log.
    if let Some(cors) = cors {
        app = app.layer(cors);
    }
    app.layer(from_fn_with_state(state.clone(), hosts::check_host))
        .layer(from_fn_with_state(state.clone(), count_status))
        .layer(from_fn_with_state(state.clone(), access::access_log))
        .layer(DefaultBodyLimit::disable())
        .with_state(state)
}

/// Whether two secrets are equal, in a time that depends on neither where they differ nor
/// their lengths: their SHA-256 digests are compared, every byte.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    use sha2::{Digest, Sha256};
    let (x, y) = (Sha256::digest(a), Sha256::digest(b));
    x.iter().zip(y.iter()).fold(0u8, |acc, (p, q)| acc | (p ^ q)) == 0
}

/// The key a request sends: `Authorization: Bearer KEY` (OpenAI, Ollama) or `x-api-key: KEY`
/// (Anthropic); None when it sends neither.
fn sent_key(headers: &axum::http::HeaderMap) -> Option<&str> {
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")));
    bearer.or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok())).map(str::trim)
}

async fn require_api_key(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.cfg.api_key {
        let dialect = Dialect::of_path(req.uri().path());
        match sent_key(req.headers()) {
            None => {
                return ApiError::unauthorized("missing API key: send `Authorization: Bearer KEY` or `x-api-key: KEY`")
                    .response_in(dialect)
            }
            Some(t) if !same_secret(t.as_bytes(), key.as_bytes()) => {
                return ApiError::unauthorized("incorrect API key provided").response_in(dialect)
            }
            Some(_) => {}
        }
    }
    next.run(req).await
}

async fn count_status(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let r = next.run(req).await;
    st.metrics.count_status(r.status().as_u16());
    r
}
