//! The engine flags of every command that loads a model: one flag per `EngineConfig` field that
//! may be overridden, generated (with how it applies) from one list, so a new setting is one
//! line here and one field in `EngineConfig`.

use super::{EngineConfig, KernelProfile, KvDtype, Secret, SpecMethod, VllmSpeculativeConfig};
use anyhow::Result;
use std::path::PathBuf;

/// A flag's value applied to its config field: a plain field takes it, an optional one takes
/// `Some` of it.
trait Apply<T> {
    fn apply(&mut self, v: &T);
}

macro_rules! apply_plain {
    ($($t:ty),*) => {
        $(impl Apply<$t> for $t {
            fn apply(&mut self, v: &$t) {
                *self = v.clone();
            }
        })*
    };
}
apply_plain!(usize, u64, u32, f32, f64, bool, String, KvDtype, KernelProfile, SpecMethod);

/// `--speculative-config JSON` (vLLM's flag): parsed when applied; a bad object is reported by
/// `resolve`.
impl Apply<String> for Option<VllmSpeculativeConfig> {
    fn apply(&mut self, _v: &String) {}
}

impl<T: Clone> Apply<T> for Option<T> {
    fn apply(&mut self, v: &T) {
        *self = Some(v.clone());
    }
}

impl Apply<String> for Option<Secret> {
    fn apply(&mut self, v: &String) {
        *self = Some(Secret(v.clone()));
    }
}

/// `EngineArgs` with an `Option` flag per listed field (`field: type`, or
/// `field: type as "flag-name"`, or with `env = ".."`), and `apply_fields`, which sets each
/// given one on the config.
macro_rules! engine_args {
    ($($(#[$m:meta])* $field:ident: $ty:ty $(as $flag:literal)? $(, env = $env:literal)?;)*) => {
        /// Engine settings shared by the commands that load a model; each overrides the config file.
        #[derive(clap::Args, Clone, Debug, Default)]
        pub struct EngineArgs {
            /// JSON engine config (see configs/).
            #[arg(long)]
            pub config: Option<PathBuf>,
            $(
                $(#[$m])*
                #[arg(long $(= $flag)? $(, env = $env, hide_env_values = true)?)]
                pub $field: Option<$ty>,
            )*
            /// Shorthand (vLLM's name): enable_pipeline_parallel with this world_size.
            #[arg(long)]
            pub pipeline_parallel_size: Option<usize>,
            /// Connect the KV-events PUB socket to the endpoint (a subscriber that binds, as
            /// llm-d's endpoint picker) instead of binding it.
            #[arg(long)]
            pub kv_events_connect: bool,
        }

        impl EngineArgs {
            fn apply_fields(&self, c: &mut EngineConfig) {
                $(
                    if let Some(v) = &self.$field {
                        c.$field.apply(v);
                    }
                )*
            }

            /// The config fields these flags override (for tests and docs).
            pub const FIELDS: &'static [&'static str] = &[$(stringify!($field)),*];
        }
    };
}

engine_args! {
    /// Hugging Face model directory or .gguf file (default: the SmolLM2 model in models/).
    model: String;
    /// Adapter index or name substring, as `torus-wgpu adapters` prints.
    adapter: String;
    max_sequence_length: usize;
    max_num_batched_tokens: usize;
    max_decode_batch_size: usize;
    max_prefill_batch_size: usize;
    /// KV-cache bytes across all layers.
    total_cache_size: u64;
    block_size: usize;
    /// KV-cache element type: f16 (default) or f32.
    kv_cache_dtype: KvDtype;
    /// Kernel shapes: auto (cpu on software adapters, gpu elsewhere), cpu or gpu.
    kernel_profile: KernelProfile;
    enable_prefix_cache: bool;
    /// Default temperature for requests that give none.
    temperature: f32 as "default-temperature";
    top_p: f32 as "default-top-p";
    top_k: u32 as "default-top-k";
    /// Split the layers into `world_size` pipeline stages.
    enable_pipeline_parallel: bool;
    world_size: usize;
    /// This worker's stage (`torus-wgpu worker`).
    pipeline_rank: usize;
    stage_start_layer: usize;
    stage_end_layer: usize;
    /// Seconds a remote stage may take for one step.
    stage_timeout_s: f64;
    /// Shared secret between the scheduler and its workers (overrides worker_token).
    worker_token: String, env = "TORUS_WORKER_TOKEN";
    /// PEM certificate chain: a worker's TLS identity, or a scheduler's client certificate.
    tls_cert: String;
    /// PEM private key of --tls-cert.
    tls_key: String;
    /// PEM CA: a worker requires client certificates signed by it; a scheduler uses TLS to its
    /// workers and verifies them against it.
    tls_ca: String;
    /// Name a scheduler expects in its workers' certificates (default: each address's host).
    tls_domain: String;
    /// Idle seconds after which another scheduler may take a worker over.
    worker_lease_s: f64;
    /// Publish KV-cache events (vLLM's format, for KV-aware routers) on a ZeroMQ PUB socket
    /// bound at tcp://HOST:PORT (default: off).
    kv_events_endpoint: String;
    /// The KV-cache events' ZeroMQ topic (default: empty, as vLLM's).
    kv_events_topic: String;
    /// Speculative decoding: ngram (prompt lookup), draft (a draft model), mtp (the model's MTP head) or off (default).
    speculative: SpecMethod;
    /// Draft model (Hugging Face directory or .gguf file, same vocabulary) for speculative
    /// decoding; implies --speculative draft.
    draft_model: String;
    /// Tokens proposed per sequence and step at most (default 4).
    num_speculative_tokens: usize;
    /// Shortest n-gram the lookup matches (default 2).
    prompt_lookup_min: usize;
    /// Longest n-gram the lookup matches (default 4).
    prompt_lookup_max: usize;
    /// No speculation in steps with more decoding sequences than this (default 4).
    speculative_max_batch: usize;
    /// Stop speculating for a while where it is measured slower than plain decoding (default true).
    speculative_cost_gate: bool;
    /// vLLM's speculative_config as JSON, e.g. '{"method": "ngram", "num_speculative_tokens": 4}'.
    speculative_config: String;
}

impl EngineArgs {
    /// The config file (or defaults) with every given flag applied, validated.
    pub fn resolve(&self) -> Result<EngineConfig> {
        let mut c = match &self.config {
            Some(p) => EngineConfig::from_file(p)?,
            None => EngineConfig::default(),
        };
        self.apply_fields(&mut c);
        if let Some(n) = self.pipeline_parallel_size {
            c.enable_pipeline_parallel = n > 1;
            c.world_size = n;
        }
        c.kv_events_connect |= self.kv_events_connect;
        if let Some(json) = &self.speculative_config {
            c.speculative_config =
                Some(serde_json::from_str(json).map_err(|e| anyhow::anyhow!("--speculative-config: {e}"))?);
        }
        c.validate()?;
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        engine: EngineArgs,
    }

    #[test]
    fn every_flag_sets_its_field() {
        let cli = Cli::try_parse_from([
            "t",
            "--max-num-batched-tokens",
            "77",
            "--default-temperature",
            "0.25",
            "--stage-start-layer",
            "3",
            "--kv-cache-dtype",
            "f32",
            "--worker-token",
            "s3cret",
            "--pipeline-parallel-size",
            "2",
            "--kv-events-connect",
            "--kv-events-endpoint",
            "tcp://127.0.0.1:5557",
        ])
        .unwrap();
        let c = cli.engine.resolve().unwrap();
        assert_eq!(c.max_num_batched_tokens, 77);
        assert_eq!(c.temperature, 0.25);
        assert_eq!(c.stage_start_layer, Some(3));
        assert_eq!(c.kv_cache_dtype, KvDtype::F32);
        assert_eq!(c.worker_token.as_ref().map(|s| s.expose()), Some("s3cret"));
        assert!(c.enable_pipeline_parallel && c.world_size == 2);
        assert!(c.kv_events_connect);
        // Unset flags keep the defaults.
        let d = EngineConfig::default();
        assert_eq!((c.block_size, c.top_p), (d.block_size, d.top_p));
        // Every listed field is a config key (the JSON config's and the flag's names agree).
        let keys = serde_json::to_value(&d).unwrap();
        for f in EngineArgs::FIELDS {
            assert!(keys.get(f).is_some(), "{f} is not an EngineConfig key");
        }
    }
}
