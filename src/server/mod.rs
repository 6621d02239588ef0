//! `torus-wgpu serve`: the OpenAI-compatible HTTP server (routes, OpenAI types, SSE, errors,
//! metrics) over the engine handle.
//!
//! The listener is bound before the model loads: while it loads, `GET /health` and every API
//! route answer 503 (with `Retry-After`), and `/metrics` reports `torus_model_loaded 0`.
//! `/health`, `/metrics` and `/version` never need the API key; every `/v1/...` route,
//! `/tokenize` and `/detokenize` do when one is set.
//!
//! Tests and embedders run the server in-process with [`start`] on a listener of their own
//! (port 0 for an ephemeral port) and stop it with [`ServerHandle::shutdown`].

pub mod access;
mod body;
mod conn;
mod error;
mod generate;
mod json;
pub mod metrics;
mod openai;
mod params;
mod prepare;
mod structured;
mod token_ids;
mod tokenize;
mod tools;
mod work;

pub use error::ApiError;
pub use metrics::ServerMetrics;
pub use tools::tool_call_grammar;

use crate::config::{EngineArgs, EngineConfig};
use crate::engine::EngineHandle;
use anyhow::{Context, Result};
use axum::extract::{DefaultBodyLimit, Path as UrlPath, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{from_fn_with_state, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// Most choices (`n`) per request, by default.
pub const DEFAULT_MAX_N: usize = 16;
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

#[derive(clap::Args, Clone, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the address is logged).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on /v1 routes, /tokenize and /detokenize (also from
    /// TORUS_API_KEY).
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
    /// Answer 503 (Retry-After) while this many sequences wait for their first token.
    #[arg(long, default_value_t = 256)]
    pub max_queued_requests: usize,
    /// Largest accepted request body in bytes (larger: 413).
    #[arg(long, default_value_t = 4 << 20)]
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
}

/// How the HTTP side behaves (the engine has its own config).
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The model id responses report (and /v1/models lists first).
    pub served_model_name: String,
    /// Further names a request may give for the model (listed by /v1/models after the first).
    pub model_aliases: Vec<String>,
    /// Origins allowed by CORS (`*`: any); empty: no CORS headers at all.
    pub allowed_origins: Vec<String>,
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
}

impl ServerConfig {
    /// Defaults for serving `cfg`'s model under `served_model_name`.
    pub fn new(served_model_name: impl Into<String>, cfg: &EngineConfig) -> ServerConfig {
        ServerConfig {
            served_model_name: served_model_name.into(),
            model_aliases: Vec::new(),
            allowed_origins: Vec::new(),
            api_key: None,
            max_queued_requests: 256,
            max_request_body_bytes: 4 << 20,
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
        }
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
    /// Where requests are parsed, rendered and tokenized before they are queued.
    pub work: work::WorkPool,
    /// Unix time the server started (the model's `created`).
    pub started: u64,
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
    }
}

/// Serves the OpenAI API on `listener` (inside the current tokio runtime). With `engine` None
/// the server answers 503 until [`ServerHandle::set_engine`].
pub fn start(
    listener: tokio::net::TcpListener,
    cfg: ServerConfig,
    engine: Option<EngineHandle>,
) -> std::io::Result<ServerHandle> {
    let addr = listener.local_addr()?;
    let cors =
        cors_layer(&cfg.allowed_origins).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let state = Arc::new(AppState {
        cfg,
        engine: OnceLock::new(),
        metrics: ServerMetrics::default(),
        work: work::WorkPool::per_core(),
        started: unix_now(),
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

/// The CORS layer for `origins` (None when empty): GET, POST and OPTIONS with the
/// `Authorization`, `Content-Type` and `x-request-id` headers; `x-request-id` readable by
/// scripts. Preflight requests (OPTIONS) are answered by the layer itself.
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
            .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE, access::REQUEST_ID])
            .expose_headers([access::REQUEST_ID]),
    ))
}

fn router(state: Arc<AppState>, cors: Option<tower_http::cors::CorsLayer>) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{*model}", get(get_model))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route_layer(from_fn_with_state(state.clone(), require_api_key));
    let mut app = Router::new()
        .merge(api)
        .route("/health", get(health))
        .route("/metrics", get(prometheus))
        .route("/version", get(version))
        .route("/server_info", get(server_info))
        .fallback(|| async { ApiError::not_found("no such route") })
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed() });
    // Innermost first: CORS (answers preflights), the status counter, the access log.
    if let Some(cors) = cors {
        app = app.layer(cors);
    }
    app.layer(from_fn_with_state(state.clone(), count_status))
        .layer(from_fn_with_state(state.clone(), access::access_log))
        .layer(DefaultBodyLimit::disable())
        .with_state(state)
}

async fn version() -> Response {
    Json(json!({"version": env!("CARGO_PKG_VERSION")})).into_response()
}

/// What a router or operator may want to know about this replica (routers probe it, as they
/// do SGLang's): the model names, the context length and the KV cache. The engine's fields are
/// null while the model loads.
async fn server_info(State(st): State<Arc<AppState>>) -> Response {
    let e = st.engine.get();
    let dtype = match st.cfg.kv_cache_dtype {
        crate::config::KvDtype::F16 => "f16",
        crate::config::KvDtype::F32 => "f32",
    };
    Json(json!({
        "server": "torus-wgpu",
        "version": env!("CARGO_PKG_VERSION"),
        "served_model_name": st.cfg.served_model_name,
        "model_aliases": st.cfg.model_aliases,
        "loaded": e.is_some(),
        "max_model_len": e.map(|e| e.info.max_model_len()),
        "block_size": e.map(|e| e.info.block_size),
        "num_gpu_blocks": e.map(|e| e.info.num_blocks),
        "max_total_num_tokens": e.map(|e| e.info.num_blocks * e.info.block_size),
        "kv_cache_dtype": dtype,
        "enable_prefix_caching": st.cfg.share_prompt_prefill,
        "adapter": e.map(|e| e.info.adapter.clone()),
        "request_workers": st.work.threads(),
    }))
    .into_response()
}

/// Whether two secrets are equal, in a time that depends on neither where they differ nor
/// their lengths: their SHA-256 digests are compared, every byte.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    use sha2::{Digest, Sha256};
    let (x, y) = (Sha256::digest(a), Sha256::digest(b));
    x.iter().zip(y.iter()).fold(0u8, |acc, (p, q)| acc | (p ^ q)) == 0
}

async fn require_api_key(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.cfg.api_key {
        let token = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
            .map(str::trim);
        match token {
            None => return ApiError::unauthorized("missing API key: send `Authorization: Bearer KEY`").into_response(),
            Some(t) if !same_secret(t.as_bytes(), key.as_bytes()) => {
                return ApiError::unauthorized("incorrect API key provided").into_response()
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

/// 200 when the model is loaded and every pipeline stage answers (remote workers are asked
/// now); otherwise 503 naming what is missing.
async fn health(State(st): State<Arc<AppState>>) -> Response {
    let engine = match st.engine() {
        Ok(e) => e,
        Err(e) => return e.into_response(),
    };
    let Some(stages) = engine.stages.clone() else {
        return (StatusCode::OK, Json(json!({"status": "ok"}))).into_response();
    };
    let mut list = Vec::new();
    let mut down = Vec::new();
    for h in stages.iter() {
        let r = match &h.address {
            Some(addr) => crate::pipeline::remote::probe(addr, &h.link, std::time::Duration::from_secs(2))
                .await
                .map(|_| ())
                .map_err(|e| format!("{e:#}")),
            None => h.get(),
        };
        if let Err(e) = &r {
            down.push(format!(
                "pipeline stage {} ({}, layers {}..{}): {e}",
                h.stage, h.name, h.layers.start, h.layers.end
            ));
        }
        list.push(json!({
            "stage": h.stage,
            "name": h.name,
            "address": h.address,
            "layers": [h.layers.start, h.layers.end],
            "ok": r.is_ok(),
            "error": r.err(),
        }));
    }
    if down.is_empty() {
        return (StatusCode::OK, Json(json!({"status": "ok", "stages": list}))).into_response();
    }
    let body = json!({
        "status": "unavailable",
        "stages": list,
        "error": {"message": down.join("; "), "type": "service_unavailable", "param": null, "code": "stage_unavailable"},
    });
    (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
}

async fn prometheus(State(st): State<Arc<AppState>>) -> Response {
    let snap = st.engine.get().map(|e| e.metrics.snapshot());
    let labels = metrics::VllmLabels {
        model_name: st.cfg.served_model_name.clone(),
        block_size: st.engine.get().map_or(0, |e| e.info.block_size),
        cache_dtype: match st.cfg.kv_cache_dtype {
            crate::config::KvDtype::F16 => "auto".into(),
            crate::config::KvDtype::F32 => "fp32".into(),
        },
        prefix_caching: st.cfg.share_prompt_prefill,
    };
    let mut text = st.metrics.render(snap.as_ref(), &labels);
    if let Some(stages) = st.engine.get().and_then(|e| e.stages.clone()) {
        // As the engine last saw each stage (/health asks the workers afresh).
        text.push_str(
            "# HELP torus_pipeline_stage_up Whether the pipeline stage's last step succeeded.\n\
             # TYPE torus_pipeline_stage_up gauge\n",
        );
        for h in stages.iter() {
            text.push_str(&format!("torus_pipeline_stage_up{{stage=\"{}\"}} {}\n", h.stage, h.get().is_ok() as u8));
        }
    }
    let mut r = text.into_response();
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"));
    r
}

fn model_card(st: &AppState, name: &str) -> serde_json::Value {
    let mut card = json!({
        "id": name,
        "object": "model",
        "created": st.started,
        "owned_by": "torus-wgpu",
    });
    if let Some(e) = st.engine.get() {
        card["max_model_len"] = json!(e.info.max_model_len());
    }
    card
}

async fn list_models(State(st): State<Arc<AppState>>) -> Response {
    let data: Vec<serde_json::Value> = st.model_names().map(|n| model_card(&st, n)).collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

async fn get_model(
    State(st): State<Arc<AppState>>,
    model: Result<UrlPath<String>, axum::extract::rejection::PathRejection>,
) -> Response {
    // A path that does not decode (invalid UTF-8 in percent escapes) names no model.
    let Ok(UrlPath(model)) = model else { return ApiError::not_found("no such model").into_response() };
    match st.check_model(Some(&model)) {
        Ok(()) => Json(model_card(&st, &model)).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `torus-wgpu serve`: binds, loads the model (503 until then), serves until SIGINT/SIGTERM,
/// then finishes in-flight requests and exits.
pub fn run(args: ServeArgs) -> Result<()> {
    let cfg = args.engine.resolve()?;
    let model_path = cfg.model_path();
    if !model_path.exists() {
        anyhow::bail!(
            "{}: model not found (run scripts/fetch-model.sh for the default model, or pass --model)",
            model_path.display()
        );
    }
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
    let mut scfg = ServerConfig::new(names.remove(0), &cfg);
    scfg.model_aliases = names;
    cors_layer(&args.allowed_origins).map_err(anyhow::Error::msg)?;
    scfg.allowed_origins = args.allowed_origins.clone();
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
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().thread_name("torus-http").build()?;
    let r = rt.block_on(serve(args, cfg, scfg, model_path));
    // Never wait on work that is still running (dropping the runtime would).
    rt.shutdown_timeout(Duration::from_secs(1));
    r
}

async fn serve(args: ServeArgs, cfg: EngineConfig, scfg: ServerConfig, model_path: std::path::PathBuf) -> Result<()> {
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
    let auth = if scfg.api_key.is_some() { "API key required on /v1, /tokenize and /detokenize" } else { "no API key" };
    let name = scfg.served_model_name.clone();
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
        let r = crate::engine::load_configured(&load_cfg).and_then(|(m, t)| EngineHandle::try_start(m, t, &load_cfg));
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
    if let Some(a) = i.kv_events_addr {
        eprintln!("torus-wgpu serve: publishing KV-cache events on tcp://{a} (ZeroMQ PUB, vLLM's format)");
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
