//! `torus-wgpu serve --models-dir DIR`: the process of a models server. Its engine settings
//! (the config file and the engine flags, as one JSON file only this user can read) and its
//! per-request server settings are handed to each model's process; the HTTP side (key, CORS,
//! hosts, connection and body limits) is its own.

use super::{Pool, PoolConfig, Spawn};
use crate::server::cli::{http_config, ServeArgs};
use anyhow::{bail, Context, Result};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The engine settings file handed to the models' processes; removed when the server stops.
struct SettingsFile(PathBuf);

impl Drop for SettingsFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn write_settings(json: &str) -> Result<SettingsFile> {
    let path = std::env::temp_dir().join(format!(
        "torus-wgpu-models-{}-{:08x}.json",
        std::process::id(),
        crate::sampling::Rng::from_entropy().next_u64() as u32
    ));
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        o.mode(0o600);
    }
    let mut f = o.open(&path).with_context(|| format!("cannot write {}", path.display()))?;
    f.write_all(json.as_bytes())?;
    Ok(SettingsFile(path))
}

/// The server flags each model's process gets (the per-request ones).
fn passed_flags(args: &ServeArgs, settings: &Path) -> Vec<String> {
    let mut v: Vec<String> = vec!["--config".into(), settings.to_string_lossy().into_owned()];
    let mut flag = |k: &str, val: String| {
        v.push(format!("--{k}"));
        v.push(val);
    };
    flag("max-queued-requests", args.max_queued_requests.to_string());
    flag("max-request-body-bytes", args.max_request_body_bytes.to_string());
    flag("request-timeout-s", args.request_timeout_s.to_string());
    flag("sse-keepalive-s", args.sse_keepalive_s.to_string());
    flag("shutdown-grace-s", args.shutdown_grace_s.to_string());
    flag("max-connections", args.max_connections.to_string());
    flag("max-connections-per-peer", args.max_connections.to_string());
    flag("reasoning-parser", args.reasoning_parser.flag().to_string());
    flag("task", args.task.clone());
    if let Some(p) = args.pooling {
        flag("pooling", p.name().to_string());
    }
    v
}

pub fn run(args: ServeArgs) -> Result<()> {
    let dir = args.models_dir.clone().expect("--models-dir");
    if args.engine.model.is_some() {
        bail!("--models-dir serves the models under a directory and --model serves one: give one or the other");
    }
    if !args.served_model_name.is_empty() {
        bail!("--served-model-name names the one model of a server; with --models-dir each model is named by its file");
    }
    if !dir.is_dir() {
        bail!("--models-dir {}: not a directory", dir.display());
    }
    if args.max_loaded_models == 0 {
        bail!("--max-loaded-models must be positive");
    }
    let budget = match args.models_memory_gb {
        Some(g) if !(g.is_finite() && g > 0.0) => bail!("--models-memory-gb must be a positive number of GiB"),
        Some(g) => Some((g * (1u64 << 30) as f64) as u64),
        None => None,
    };
    let keep_alive =
        super::keep_alive::KeepAlive::parse(&args.keep_alive).map_err(|e| anyhow::anyhow!("--keep-alive: {e}"))?;
    let cfg = args.engine.resolve()?;
    let scfg = http_config(&args, &cfg, String::new())?;
    let settings = write_settings(&serde_json::to_string_pretty(&cfg)?)?;
    let exe = std::env::current_exe().context("the path of this program")?;
    let pool = Pool::new(PoolConfig {
        dir: dir.clone(),
        max_loaded: args.max_loaded_models,
        memory_budget: budget,
        per_model_extra: cfg.total_cache_size,
        spawn: Spawn { exe, before: Vec::new(), args: passed_flags(&args, &settings.0) },
        load_timeout: Duration::from_secs(args.model_load_timeout_s.max(1)),
        keep_alive,
        max_sequence_length: cfg.max_sequence_length,
    })?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().thread_name("torus-http").build()?;
    let r = rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
        let auth = if scfg.api_key.is_some() { "API key required" } else { "no API key" };
        let server = crate::server::start_with(listener, scfg, None, Some(pool.clone()))?;
        pool.start_expiry();
        let names: Vec<String> = pool.entries().iter().map(|e| e.name.clone()).collect();
        eprintln!("torus-wgpu serve: listening on http://{} ({auth})", server.addr);
        eprintln!(
            "torus-wgpu serve: ready on http://{} | {} models in {} ({}) | each loads when a request names it; at most {} loaded{}",
            server.addr,
            names.len(),
            dir.display(),
            names.join(", "),
            args.max_loaded_models,
            budget.map_or(String::new(), |b| format!(", within {:.1} GiB", b as f64 / (1u64 << 30) as f64)),
        );
        crate::shutdown::signal().await;
        eprintln!("torus-wgpu serve: shutting down (the models' processes end with it)");
        let grace = Duration::from_secs(args.shutdown_grace_s);
        let _ = tokio::time::timeout(grace, server.shutdown()).await;
        pool.stop_all();
        eprintln!("torus-wgpu serve: stopped");
        Ok::<_, anyhow::Error>(())
    });
    rt.shutdown_timeout(Duration::from_secs(1));
    drop(settings);
    r
}
