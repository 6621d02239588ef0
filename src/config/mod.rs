//! Engine configuration: the JSON keys of configs/*.json, validated, with command-line overrides.
//!
//! Owns: EngineConfig (the seed's JSON keys), its validation and the per-device choices (KV dtype, kernel profile).
//! May use: nothing.
//! Never uses: every other room (anyone may use config).

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

mod args;
mod choices;
mod spec;
mod views;
pub use args::EngineArgs;
pub use choices::{KernelProfile, KvDtype};
pub use spec::{SpecMethod, SpecSettings, VllmSpeculativeConfig, MAX_NGRAM, MAX_SPECULATIVE_TOKENS};
pub use views::{BatchBudget, StepBudget};

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EngineConfig {
    /// Model path: a Hugging Face directory or a .gguf file (None = the default model).
    pub model: Option<String>,
    /// Adapter index or name substring (None = best available).
    pub adapter: Option<String>,
    pub max_decode_batch_size: usize,
    pub max_prefill_batch_size: usize,
    pub max_num_batched_tokens: usize,
    pub max_sequence_length: usize,
    /// KV-cache bytes across all layers.
    pub total_cache_size: u64,
    pub block_size: usize,
    /// Element type of the KV cache: f16 (default, half the memory) or f32.
    pub kv_cache_dtype: KvDtype,
    /// Kernel shapes: auto (by device type), cpu (software Vulkan) or gpu.
    pub kernel_profile: KernelProfile,
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: u32,
    pub enable_prefix_cache: bool,
    pub enable_pipeline_parallel: bool,
    pub world_size: usize,
    pub pipeline_rank: usize,
    pub stage_start_layer: Option<usize>,
    pub stage_end_layer: Option<usize>,
    /// Pipeline stages, in layer order (with enable_pipeline_parallel). Empty: `world_size`
    /// stages on `adapter`, layers split evenly.
    pub stages: Vec<StageConfig>,
    /// Longest a remote stage may take to answer one step before it counts as failed.
    pub stage_timeout_s: f64,
    /// Shared secret between a scheduler and its workers: a worker refuses every call that
    /// does not carry it, the scheduler sends it on every call. `TORUS_WORKER_TOKEN` in the
    /// environment (or `--worker-token`) overrides the file, so the secret need not be stored
    /// in a config.
    pub worker_token: Option<Secret>,
    /// PEM certificate chain and private key. A worker serves TLS with them; a scheduler
    /// presents them to workers that require client certificates.
    pub tls_cert: Option<String>,
    pub tls_key: Option<String>,
    /// PEM CA certificate(s). A worker requires (and verifies) client certificates signed by
    /// it; a scheduler connects to its workers over TLS and verifies them against it.
    pub tls_ca: Option<String>,
    /// The name a scheduler expects in its workers' certificates (default: the host part of
    /// each stage's address).
    pub tls_domain: Option<String>,
    /// A worker keeps serving the scheduler that claimed it (its first step) and refuses
    /// steps of any other; after this many idle seconds another scheduler may take it over
    /// (the worker then starts a new cache instance, which the old scheduler detects).
    pub worker_lease_s: f64,
    /// Publish KV-cache events (blocks stored in and evicted from the prefix cache) in vLLM's
    /// format on a ZeroMQ PUB socket bound at this `tcp://HOST:PORT` (None: off).
    pub kv_events_endpoint: Option<String>,
    /// The events' ZeroMQ topic (vLLM's `topic`; default empty). llm-d names the publishing pod
    /// in it (`kv@<pod ip>@<model>`).
    pub kv_events_topic: String,
    /// Connect the PUB socket to `kv_events_endpoint` (a subscriber that binds there, as llm-d's
    /// endpoint picker does) instead of binding it; reconnects when the connection drops.
    pub kv_events_connect: bool,
    /// Speculative decoding: `off` (default), `ngram` (prompt lookup) or `draft` (a draft
    /// model proposes; implied by `draft_model`).
    pub speculative: SpecMethod,
    /// The draft model (Hugging Face directory or .gguf file): same vocabulary as the model,
    /// run on the same device with its own KV cache (as many blocks as the model's).
    pub draft_model: Option<String>,
    /// Tokens proposed per sequence and step at most (each sequence adapts its own number to
    /// how many of its proposals were accepted).
    pub num_speculative_tokens: usize,
    /// The n-gram sizes looked up, longest first.
    pub prompt_lookup_min: usize,
    pub prompt_lookup_max: usize,
    /// No sequence speculates in a step with more decoding sequences than this: decode is then
    /// no longer bound by reading the weights, and verifying proposals costs real work.
    pub speculative_max_batch: usize,
    /// Time decode steps with and without verification and stop speculating for a while where
    /// it costs more per token than it saves (default on; tests that count proposals turn it off).
    pub speculative_cost_gate: bool,
    /// vLLM's `speculative_config` object (its keys that map here), applied over the keys above.
    pub speculative_config: Option<VllmSpeculativeConfig>,
}

/// A secret string (the worker token): serialized as a plain string, never printed by Debug.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl Secret {
    pub fn expose(&self) -> &str {
        &self.0
    }
}

/// One pipeline stage: in this process on an adapter, or a worker at `address`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct StageConfig {
    /// Adapter index or name substring (local stages; None = the engine's adapter).
    pub adapter: Option<String>,
    /// host:port of a `torus-wgpu worker` running this stage.
    pub address: Option<String>,
    pub stage_start_layer: Option<usize>,
    /// Exclusive.
    pub stage_end_layer: Option<usize>,
    /// The stage's memory in bytes: without layer ranges, layers are split in proportion to
    /// it. Local stages default to their adapter's device-local memory where the backend
    /// reports it (Vulkan); the split is even when any stage's memory is unknown.
    pub memory_bytes: Option<u64>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            model: None,
            adapter: None,
            max_decode_batch_size: 16,
            max_prefill_batch_size: 4,
            max_num_batched_tokens: 512,
            max_sequence_length: 2048,
            total_cache_size: 256 << 20,
            block_size: 16,
            kv_cache_dtype: KvDtype::F16,
            kernel_profile: KernelProfile::Auto,
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            enable_prefix_cache: true,
            enable_pipeline_parallel: false,
            world_size: 1,
            pipeline_rank: 0,
            stage_start_layer: None,
            stage_end_layer: None,
            stages: vec![],
            stage_timeout_s: 600.0,
            worker_token: None,
            tls_cert: None,
            tls_key: None,
            tls_ca: None,
            tls_domain: None,
            worker_lease_s: 60.0,
            kv_events_endpoint: None,
            kv_events_topic: String::new(),
            kv_events_connect: false,
            speculative: SpecMethod::Off,
            draft_model: None,
            num_speculative_tokens: 4,
            prompt_lookup_min: 2,
            prompt_lookup_max: 4,
            speculative_max_batch: 4,
            speculative_cost_gate: true,
            speculative_config: None,
        }
    }
}

impl EngineConfig {
    pub fn from_file(path: &Path) -> Result<EngineConfig> {
        let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
        let cfg: EngineConfig = serde_json::from_str(&text).map_err(|e| anyhow!("{}: {e}", path.display()))?;
        cfg.validate().map_err(|e| anyhow!("{}: {e}", path.display()))?;
        Ok(cfg)
    }

    /// Checks every value; the error names the key.
    pub fn validate(&self) -> Result<()> {
        let pos = |k: &str, v: usize| if v == 0 { Err(anyhow!("{k} must be positive")) } else { Ok(()) };
        pos("max_decode_batch_size", self.max_decode_batch_size)?;
        pos("max_prefill_batch_size", self.max_prefill_batch_size)?;
        pos("max_num_batched_tokens", self.max_num_batched_tokens)?;
        pos("max_sequence_length", self.max_sequence_length)?;
        pos("block_size", self.block_size)?;
        pos("world_size", self.world_size)?;
        if self.total_cache_size == 0 {
            bail!("total_cache_size must be positive");
        }
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            bail!("temperature must be >= 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("top_p must be in (0, 1]");
        }
        if self.pipeline_rank >= self.world_size {
            bail!("pipeline_rank {} must be below world_size {}", self.pipeline_rank, self.world_size);
        }
        if let (Some(s), Some(e)) = (self.stage_start_layer, self.stage_end_layer) {
            if s >= e {
                bail!("stage_start_layer {s} must be below stage_end_layer {e}");
            }
        }
        if !(self.stage_timeout_s > 0.0 && self.stage_timeout_s.is_finite()) {
            bail!("stage_timeout_s must be a positive number of seconds");
        }
        if let Some(t) = &self.worker_token {
            // It travels as an HTTP/2 header value.
            if t.0.is_empty() || !t.0.bytes().all(|b| b.is_ascii_graphic()) {
                bail!("worker_token must be non-empty printable ASCII without spaces");
            }
        }
        if self.tls_cert.is_some() != self.tls_key.is_some() {
            bail!("give both tls_cert and tls_key, or neither");
        }
        if !(self.worker_lease_s > 0.0 && self.worker_lease_s.is_finite()) {
            bail!("worker_lease_s must be a positive number of seconds");
        }
        if let Some(ep) = &self.kv_events_endpoint {
            parse_endpoint(ep)?;
        } else if self.kv_events_connect || !self.kv_events_topic.is_empty() {
            bail!("kv_events_topic and kv_events_connect need kv_events_endpoint");
        }
        self.spec_settings()?;
        if !self.stages.is_empty() {
            if !self.enable_pipeline_parallel {
                bail!("stages are given but enable_pipeline_parallel is false");
            }
            if self.stages.len() != self.world_size {
                bail!("world_size is {} but {} stages are given", self.world_size, self.stages.len());
            }
            for (i, st) in self.stages.iter().enumerate() {
                if st.address.is_some() && st.adapter.is_some() {
                    bail!("stage {i}: give either address (a worker) or adapter (in this process), not both");
                }
                if st.stage_start_layer.is_some() != st.stage_end_layer.is_some() {
                    bail!("stage {i}: give both stage_start_layer and stage_end_layer, or neither");
                }
            }
        }
        Ok(())
    }
}

impl EngineConfig {
    /// The model this config names, or the default model.
    pub fn model_path(&self) -> PathBuf {
        self.model.clone().map(PathBuf::from).unwrap_or_else(default_model_path)
    }
}

/// Where the default model lives: `TORUS_MODEL`, else models/ under the current directory or
/// beside the executable's repository.
pub fn default_model_path() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("TORUS_MODEL") {
        return p.into();
    }
    let name = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    let local = std::path::PathBuf::from(name);
    if local.exists() {
        return local;
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join(name);
    if repo.exists() {
        return repo;
    }
    local
}

/// The `host:port` of a `tcp://HOST:PORT` endpoint (`*` for the host: every interface).
pub fn parse_endpoint(endpoint: &str) -> Result<String> {
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| anyhow!("kv_events_endpoint {endpoint:?} must look like tcp://HOST:PORT"))?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| anyhow!("kv_events_endpoint {endpoint:?} must look like tcp://HOST:PORT"))?;
    let port: u16 = port.parse().map_err(|_| anyhow!("kv_events_endpoint {endpoint:?}: bad port {port:?}"))?;
    if host.is_empty() {
        bail!("kv_events_endpoint {endpoint:?}: the host is missing");
    }
    let host = if host == "*" { "0.0.0.0" } else { host };
    Ok(format!("{host}:{port}"))
}
