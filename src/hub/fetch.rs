//! The pull: the cache first (no request at all when it holds the files), then the Hub's file
//! listing, the selection, and each file not cached downloaded into its blob (see `http`),
//! linked into the snapshot, and `refs/main` pointed at the listing's commit last (see `cache`).
//! A file is used only once it is whole: its size is the listing's, and its sha256 too where
//! the listing gives one.

use super::cache::{self, RepoCache};
use super::http;
use super::select::{quant_of, select, DEFAULT_QUANT};
use super::Spec;
use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;
use std::io::{IsTerminal, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Where and how to download (from the environment, as the Hugging Face tools read it).
#[derive(Clone, Debug)]
pub struct Options {
    /// The hub cache: `HF_HUB_CACHE`, else `$HF_HOME/hub`, else ~/.cache/huggingface/hub.
    pub cache: PathBuf,
    /// `HF_ENDPOINT`, else the Hub.
    pub endpoint: String,
    /// `HF_TOKEN`, else the token file (`HF_TOKEN_PATH`, else `$HF_HOME/token`).
    pub token: Option<String>,
    /// `HF_HUB_OFFLINE=1`: the cache only.
    pub offline: bool,
    /// A progress bar (on a terminal).
    pub progress: bool,
    /// Connecting, waiting for an answer, and each window in which a download must bring
    /// bytes (`HF_HUB_DOWNLOAD_TIMEOUT`, seconds; 10 by default, as the Python client's).
    pub timeout: Duration,
    /// Further tries of a download that was cut or stalled, each from its last byte.
    pub retries: u32,
}

const DEFAULT_ENDPOINT: &str = "https://huggingface.co";
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
const DEFAULT_RETRIES: u32 = 3;

fn env(k: &str) -> Option<String> {
    std::env::var(k).ok().filter(|v| !v.trim().is_empty())
}

/// `HF_HOME`, else `$XDG_CACHE_HOME/huggingface`, else ~/.cache/huggingface.
fn hf_home() -> PathBuf {
    if let Some(h) = env("HF_HOME") {
        return PathBuf::from(h);
    }
    let cache = env("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| env("HOME").or_else(|| env("USERPROFILE")).map(|h| Path::new(&h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"));
    cache.join("huggingface")
}

/// The token `huggingface-cli login` saved (its first line, at most 4 KiB read).
fn token_file() -> Option<String> {
    let path = env("HF_TOKEN_PATH").map(PathBuf::from).unwrap_or_else(|| hf_home().join("token"));
    let mut text = String::new();
    std::fs::File::open(path).ok()?.take(4096).read_to_string(&mut text).ok()?;
    let t = text.lines().next()?.trim();
    (!t.is_empty()).then(|| t.to_string())
}

impl Options {
    pub fn from_env() -> Options {
        let cache = env("HF_HUB_CACHE").map(PathBuf::from).unwrap_or_else(|| hf_home().join("hub"));
        let offline = env("HF_HUB_OFFLINE")
            .is_some_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"));
        let timeout = env("HF_HUB_DOWNLOAD_TIMEOUT")
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s > 0.0)
            .map_or(DEFAULT_TIMEOUT, |s| Duration::from_secs_f64(s.min(3600.0)));
        Options {
            cache,
            endpoint: env("HF_ENDPOINT")
                .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string())
                .trim_end_matches('/')
                .to_string(),
            token: env("HF_TOKEN").or_else(token_file),
            offline,
            progress: std::io::stderr().is_terminal(),
            timeout,
            retries: DEFAULT_RETRIES,
        }
    }
}

/// The local path of `spec`'s model: its GGUF file (the first part of a split one) or its
/// snapshot directory, downloaded where the cache does not hold it.
pub fn pull(spec: &Spec, opts: &Options) -> Result<PathBuf> {
    pull_cancellable(spec, opts, Arc::new(AtomicBool::new(false)))
}

/// [`pull`], stopped (what was downloaded kept, to resume) once `cancel` is set.
pub fn pull_cancellable(spec: &Spec, opts: &Options, cancel: Arc<AtomicBool>) -> Result<PathBuf> {
    let repo = RepoCache::new(&opts.cache, &spec.repo);
    match from_cache(&repo, spec, opts.offline) {
        Ok(Some(p)) => return Ok(p),
        Ok(None) if opts.offline => bail!(
            "{} is not in the Hugging Face cache ({}) and HF_HUB_OFFLINE is set: pull it with a network first",
            spec.repo,
            opts.cache.display()
        ),
        Err(e) if opts.offline => bail!("HF_HUB_OFFLINE is set and the cache cannot serve {}: {e}", spec.repo),
        _ => {}
    }
    // A runtime of its own on a thread of its own, whatever runtime the caller is in.
    let (spec, opts) = (spec.clone(), opts.clone());
    std::thread::Builder::new()
        .name("torus-hub-pull".into())
        .spawn(move || -> Result<PathBuf> {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            rt.block_on(online(&spec, &opts, &repo, &cancel))
        })
        .context("cannot start the download thread")?
        .join()
        .map_err(|_| anyhow!("the download thread panicked"))?
}

/// The model from the cache alone, when it holds every file (None: it does not, or, with no
/// quantization named and no Q4_K_M cached, the Hub must say which file is the default).
fn from_cache(repo: &RepoCache, spec: &Spec, offline: bool) -> Result<Option<PathBuf>, String> {
    let Some(commit) = repo.main_ref()? else { return Ok(None) };
    let names = repo.list(&commit);
    if names.is_empty() {
        return Ok(None);
    }
    let sel = select(&spec.repo, &names, spec.quant.as_deref())?;
    let is_default = sel.entry.as_deref().and_then(quant_of).is_none_or(|q| q == DEFAULT_QUANT);
    if spec.quant.is_none() && !is_default && !offline {
        return Ok(None);
    }
    if !sel.files.iter().all(|f| repo.resolve(&commit, f).is_some()) {
        return Ok(None);
    }
    let snapshot = repo.snapshot(&commit);
    Ok(Some(match sel.entry {
        Some(e) => snapshot.join(e),
        None if shards_complete(repo, &commit) && repo.snapshot_contained(&commit) => snapshot,
        None => return Ok(None),
    }))
}

/// A Transformers snapshot holds every shard its index names.
fn shards_complete(repo: &RepoCache, commit: &str) -> bool {
    let Some(index) = repo.resolve(commit, "model.safetensors.index.json") else { return true };
    let mut text = String::new();
    let read = std::fs::File::open(index).and_then(|f| f.take(64 << 20).read_to_string(&mut text));
    let Ok(v) = read.map_err(|_| ()).and_then(|_| serde_json::from_str::<Value>(&text).map_err(|_| ())) else {
        return false;
    };
    v["weight_map"]
        .as_object()
        .is_some_and(|m| m.values().filter_map(Value::as_str).all(|f| repo.resolve(commit, f).is_some()))
}

/// A file's name in a URL path (each part percent-encoded, `/` kept).
fn url_path(file: &str) -> String {
    let keep = |b: u8| b.is_ascii_alphanumeric() || b"-._~".contains(&b);
    file.split('/')
        .map(|part| part.bytes().map(|b| if keep(b) { (b as char).to_string() } else { format!("%{b:02X}") }).collect())
        .collect::<Vec<String>>()
        .join("/")
}

async fn online(spec: &Spec, opts: &Options, repo: &RepoCache, cancel: &AtomicBool) -> Result<PathBuf> {
    let client = http::client(opts)?;
    let where_ = format!("{}/{}", opts.endpoint, spec.repo);
    let listing = http::listing(&client, opts, &spec.repo, &where_).await?;
    let commit = listing.sha.as_deref().filter(|c| cache::is_commit(c));
    let commit = commit.ok_or_else(|| anyhow!("{where_}: the listing names no commit"))?.to_ascii_lowercase();
    let names: Vec<String> = listing.siblings.iter().map(|s| s.rfilename.clone()).collect();
    let sel = select(&spec.repo, &names, spec.quant.as_deref()).map_err(|e| anyhow!(e))?;
    for file in &sel.files {
        cache::file_name(file).map_err(|e| anyhow!("{where_}: {e}"))?;
    }
    for file in &sel.files {
        if repo.resolve(&commit, file).is_some() {
            continue;
        }
        let Some(listed) = listing.siblings.iter().find(|s| &s.rfilename == file) else { continue };
        let etag = listed.etag().ok_or_else(|| anyhow!("{where_}: the listing gives {file} no blob id or sha256"))?;
        let size = listed.size().ok_or_else(|| anyhow!("{where_}: the listing gives {file} no size"))?;
        repo.blobs_dir()?;
        let blob = repo.blob(&etag);
        let whole = || std::fs::symlink_metadata(&blob).is_ok_and(|m| m.is_file() && m.len() == size);
        // Another process pulling the same file waits for this one (and finds it whole).
        let _lock = if whole() { None } else { Some(lock_blob(&repo.lock(&etag), cancel).await?) };
        if !whole() {
            let partial = repo.partial(&etag);
            let want = http::Want {
                url: format!("{}/{}/resolve/{commit}/{}", opts.endpoint, spec.repo, url_path(file)),
                partial: &partial,
                size,
                sha256: listed.sha256(),
                what: format!("{file} from {where_}"),
            };
            let bar = opts.progress.then(|| progress_bar(file, size));
            http::download(&client, opts, &want, cancel, bar.as_ref()).await?;
            if let Some(b) = bar {
                b.finish_and_clear();
            }
            if cancel.load(Ordering::Relaxed) {
                bail!("{file} from {where_}: the pull was cancelled");
            }
            std::fs::rename(&partial, &blob)
                .with_context(|| format!("cannot move {} into place", partial.display()))?;
        }
        repo.link(&commit, file, &etag)?;
    }
    repo.set_main_ref(&commit)?;
    let snapshot = repo.snapshot(&commit);
    Ok(match &sel.entry {
        Some(e) => snapshot.join(e),
        None => snapshot,
    })
}

/// Holds `blobs/ETAG.lock` (the Python client's lock file) while this process downloads the
/// blob, so that two processes pulling one file never write into the same `.incomplete` file:
/// the second waits (until cancelled).
async fn lock_blob(path: &Path, cancel: &AtomicBool) -> Result<std::fs::File> {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(false)
        .open(path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    let mut said = false;
    loop {
        match f.try_lock() {
            Ok(()) => return Ok(f),
            Err(std::fs::TryLockError::WouldBlock) => {}
            Err(std::fs::TryLockError::Error(e)) => bail!("cannot lock {}: {e}", path.display()),
        }
        if cancel.load(Ordering::Relaxed) {
            bail!("the pull was cancelled while another process downloaded the same file");
        }
        if !said {
            tracing::info!("another process is downloading {}; waiting for it", path.display());
            said = true;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn progress_bar(file: &str, size: u64) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(size);
    let style =
        indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    bar.set_style(style.progress_chars("=> "));
    bar.set_message(file.rsplit('/').next().unwrap_or(file).to_string());
    bar
}

#[cfg(test)]
mod tests {
    #[test]
    fn file_names_in_urls() {
        assert_eq!(super::url_path("sub dir/m#1.gguf"), "sub%20dir/m%231.gguf");
        assert_eq!(super::url_path("Q4_K_M/m-Q4_K_M.gguf"), "Q4_K_M/m-Q4_K_M.gguf");
    }
}
