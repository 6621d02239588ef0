//! The download: the cache first (no request at all when it holds the files), then the Hub's
//! file listing (`/api/models/OWNER/REPO/revision/main?blobs=true`: names, sizes, LFS sha256),
//! the selection, and each file not cached through `hf-hub` (`resolve/main/FILE`, in chunks of
//! `TORUS_HUB_CHUNK_BYTES` (10 MB) whose progress is kept beside the blob, so a cut download
//! resumes), then its sha256 checked against the listing (a mismatch removes the file).

use super::select::{quant_of, select, DEFAULT_QUANT};
use super::Spec;
use anyhow::{anyhow, bail, Context, Result};
use hf_hub::api::tokio::ApiBuilder;
use hf_hub::{Cache, Repo};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::io::{IsTerminal, Read};
use std::path::{Path, PathBuf};

/// Where and how to download (from the environment, as the Hugging Face tools read it).
#[derive(Clone, Debug)]
pub struct Options {
    /// The hub cache: `HF_HUB_CACHE`, else `$HF_HOME/hub`, else ~/.cache/huggingface/hub.
    pub cache: PathBuf,
    /// `HF_ENDPOINT`, else the Hub.
    pub endpoint: String,
    /// `HF_TOKEN`, else the cache's token file.
    pub token: Option<String>,
    /// `HF_HUB_OFFLINE=1`: the cache only.
    pub offline: bool,
    /// A progress bar (on a terminal).
    pub progress: bool,
    /// Bytes per request: how much a cut download loses at most.
    pub chunk_bytes: usize,
}

const DEFAULT_ENDPOINT: &str = "https://huggingface.co";
const DEFAULT_CHUNK_BYTES: usize = 10_000_000;

fn env(k: &str) -> Option<String> {
    std::env::var(k).ok().filter(|v| !v.trim().is_empty())
}

impl Options {
    pub fn from_env() -> Options {
        let cache = match (env("HF_HUB_CACHE"), env("HF_HOME")) {
            (Some(c), _) => PathBuf::from(c),
            (None, Some(h)) => Path::new(&h).join("hub"),
            (None, None) => Cache::default().path().clone(),
        };
        let token = env("HF_TOKEN").or_else(|| Cache::from_env().token());
        let offline = env("HF_HUB_OFFLINE")
            .is_some_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"));
        let chunk_bytes =
            env("TORUS_HUB_CHUNK_BYTES").and_then(|v| v.parse().ok()).filter(|&n| n > 0).unwrap_or(DEFAULT_CHUNK_BYTES);
        Options {
            cache,
            endpoint: env("HF_ENDPOINT")
                .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string())
                .trim_end_matches('/')
                .to_string(),
            token,
            offline,
            progress: std::io::stderr().is_terminal(),
            chunk_bytes,
        }
    }
}

/// The local path of `spec`'s model: its GGUF file (the first part of a split one) or its
/// snapshot directory, downloaded where the cache does not hold it.
pub fn pull(spec: &Spec, opts: &Options) -> Result<PathBuf> {
    let dir = opts.cache.join(Repo::model(spec.repo.clone()).folder_name());
    match from_cache(&dir, spec, opts.offline) {
        Ok(Some(p)) => return Ok(p),
        Ok(None) if opts.offline => bail!(
            "{} is not in the Hugging Face cache ({}) and HF_HUB_OFFLINE is set: pull it with a network first",
            spec.repo,
            opts.cache.display()
        ),
        Err(e) if opts.offline => bail!("HF_HUB_OFFLINE is set and the cache cannot serve it: {e}"),
        _ => {}
    }
    // hf-hub is async; a thread of its own runs it, whatever runtime the caller is in.
    let (spec, opts, d) = (spec.clone(), opts.clone(), dir.clone());
    std::thread::spawn(move || -> Result<PathBuf> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        rt.block_on(online(&spec, &opts, &d))
    })
    .join()
    .map_err(|_| anyhow!("the download thread panicked"))?
}

/// The files of the snapshot `refs/main` points at, relative to it.
fn cached_files(snapshot: &Path) -> Vec<String> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(root, &p, out);
            } else if p.is_file() {
                if let Ok(rel) = p.strip_prefix(root) {
                    out.push(rel.to_string_lossy().replace('\\', "/"));
                }
            }
        }
    }
    let mut out = Vec::new();
    walk(snapshot, snapshot, &mut out);
    out.sort();
    out
}

/// The model from the cache alone, when it holds every file (None: it does not, or, with no
/// quantization named and no Q4_K_M cached, the Hub must say which file is the default).
fn from_cache(dir: &Path, spec: &Spec, offline: bool) -> Result<Option<PathBuf>, String> {
    let Ok(commit) = std::fs::read_to_string(dir.join("refs/main")) else { return Ok(None) };
    let snapshot = dir.join("snapshots").join(commit.trim());
    let names = cached_files(&snapshot);
    if names.is_empty() {
        return Ok(None);
    }
    let sel = select(&spec.repo, &names, spec.quant.as_deref())?;
    let is_default = sel.entry.as_deref().and_then(quant_of).is_none_or(|q| q == DEFAULT_QUANT);
    if spec.quant.is_none() && !is_default && !offline {
        return Ok(None);
    }
    if sel.entry.is_none() && !shards_complete(&snapshot) {
        return Ok(None);
    }
    Ok(Some(match sel.entry {
        Some(e) => snapshot.join(e),
        None => snapshot,
    }))
}

/// A Transformers snapshot holds every shard its index names.
fn shards_complete(snapshot: &Path) -> bool {
    let Ok(text) = std::fs::read_to_string(snapshot.join("model.safetensors.index.json")) else { return true };
    let Ok(v) = serde_json::from_str::<Value>(&text) else { return false };
    v["weight_map"]
        .as_object()
        .is_some_and(|m| m.values().filter_map(Value::as_str).all(|f| !f.contains("..") && snapshot.join(f).is_file()))
}

async fn online(spec: &Spec, opts: &Options, dir: &Path) -> Result<PathBuf> {
    let api = ApiBuilder::new()
        .with_cache_dir(opts.cache.clone())
        .with_endpoint(opts.endpoint.clone())
        .with_token(opts.token.clone())
        .with_progress(opts.progress)
        .with_chunk_size(Some(opts.chunk_bytes))
        .build()
        .context("the Hub client")?;
    let repo = api.model(spec.repo.clone());
    let where_ = format!("{}/{}", opts.endpoint, spec.repo);
    let r = repo
        .info_request()
        .query(&[("blobs", "true")])
        .send()
        .await
        .with_context(|| format!("cannot reach {}", opts.endpoint))?;
    match r.status().as_u16() {
        200 => {}
        401 | 403 if opts.token.is_none() => {
            bail!("{where_} is gated or private: accept its terms on the Hub, then set HF_TOKEN to a token of yours")
        }
        401 | 403 => {
            bail!("{where_}: the Hub refused HF_TOKEN (HTTP {}): is the repository's access granted to it?", r.status())
        }
        404 => bail!("{where_}: no such repository (or it is private: set HF_TOKEN)"),
        s => bail!("{where_}: the Hub answered HTTP {s}"),
    }
    let info: Value = r.json().await.with_context(|| format!("{where_}: the file listing is not JSON"))?;
    let commit = info["sha"].as_str().filter(|c| c.len() >= 7 && c.bytes().all(|b| b.is_ascii_hexdigit()));
    let commit = commit.ok_or_else(|| anyhow!("{where_}: the listing has no commit"))?.to_string();
    let siblings = info["siblings"].as_array().cloned().unwrap_or_default();
    let names: Vec<String> = siblings.iter().filter_map(|s| s["rfilename"].as_str().map(str::to_string)).collect();
    let sel = select(&spec.repo, &names, spec.quant.as_deref()).map_err(|e| anyhow!(e))?;
    let snapshot = dir.join("snapshots").join(&commit);
    for file in &sel.files {
        if file.split('/').any(|p| p == ".." || p.is_empty()) {
            bail!("{where_}: the listing names an unsafe path {file:?}");
        }
        if snapshot.join(file).is_file() {
            continue;
        }
        let sha = siblings
            .iter()
            .find(|s| s["rfilename"] == file.as_str())
            .and_then(|s| s["lfs"]["sha256"].as_str())
            .map(str::to_string);
        let path = repo.download(file).await.with_context(|| format!("downloading {file} from {where_}"))?;
        if let Some(want) = sha {
            let p = path.clone();
            let got = tokio::task::spawn_blocking(move || sha256_file(&p)).await??;
            if !got.eq_ignore_ascii_case(&want) {
                if let Ok(blob) = std::fs::canonicalize(&path) {
                    let _ = std::fs::remove_file(blob);
                }
                let _ = std::fs::remove_file(&path);
                bail!("{file} from {where_}: sha256 {got} is not the {want} the Hub lists; the file was removed (run again)");
            }
        }
    }
    let out = match &sel.entry {
        Some(e) => snapshot.join(e),
        None => snapshot.clone(),
    };
    if !out.exists() {
        bail!(
            "{where_}: downloaded, but {} is not in the cache (the Hub's commit moved while downloading?)",
            out.display()
        );
    }
    Ok(out)
}

fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).with_context(|| format!("{}", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}
