//! The Hub's two requests, bounded: the file listing (`/api/models/OWNER/REPO/revision/main?
//! blobs=true`: the commit, each file's size, sha256 and blob id), read up to
//! [`MAX_LISTING_BYTES`] and parsed into only the fields used; and a file's bytes
//! (`OWNER/REPO/resolve/COMMIT/FILE`, following the redirect to the storage), streamed to its
//! `.incomplete` blob from where an earlier try stopped, never past the size the listing gives,
//! with the sha256 computed on the way. Every read has a time limit: a connection that sends
//! nothing, or less than [`MIN_BYTES_PER_WINDOW`] per window of `timeout`, is cut, and the
//! download resumes (a few times) from the last byte written. `Authorization` goes only to the
//! Hub's own origin (it is dropped on a redirect to another host, port or scheme); at most
//! [`MAX_REDIRECTS`] redirects are followed.

use super::fetch::Options;
use anyhow::{anyhow, bail, Context, Result};
use reqwest_hub as reqwest;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Largest file listing read (a repository of ~80,000 files).
pub const MAX_LISTING_BYTES: usize = 16 << 20;
/// Most redirects followed for one request.
pub const MAX_REDIRECTS: usize = 5;
/// A download that brings less than this in a whole window of `timeout` has stalled.
pub const MIN_BYTES_PER_WINDOW: u64 = 1024;
/// How often a download waiting for bytes looks whether it was cancelled.
const CANCEL_POLL: Duration = Duration::from_millis(100);
/// Most files a listing may name (the Hub's own recommendation for a repository).
pub const MAX_LISTED_FILES: usize = 100_000;

/// The HTTP client of one pull: TLS with the web's root certificates (the Hub's CAs), the
/// connect and read time limits, the redirect limit. The token is added per request.
pub fn client(opts: &Options) -> Result<reqwest::Client> {
    let policy = reqwest::redirect::Policy::custom(|attempt| {
        if attempt.previous().len() > MAX_REDIRECTS {
            attempt.error(format!("more than {MAX_REDIRECTS} redirects"))
        } else {
            attempt.follow()
        }
    });
    reqwest::Client::builder()
        .use_rustls_tls()
        .connect_timeout(opts.timeout)
        .read_timeout(opts.timeout)
        .redirect(policy)
        .user_agent(concat!("torus-wgpu/", env!("CARGO_PKG_VERSION")))
        .build()
        .context("the HTTP client")
}

fn with_token(r: reqwest::RequestBuilder, opts: &Options) -> reqwest::RequestBuilder {
    match &opts.token {
        Some(t) => r.bearer_auth(t),
        None => r,
    }
}

/// What the listing says of one file.
#[derive(Debug, Deserialize)]
pub struct Listed {
    pub rfilename: String,
    #[serde(default)]
    size: Option<u64>,
    #[serde(default, rename = "blobId")]
    blob_id: Option<String>,
    #[serde(default)]
    lfs: Option<Lfs>,
}

#[derive(Debug, Deserialize)]
struct Lfs {
    #[serde(default)]
    sha256: Option<String>,
    #[serde(default)]
    size: Option<u64>,
}

impl Listed {
    /// Its sha256 (LFS files), checked as a sha256.
    pub fn sha256(&self) -> Option<String> {
        let s = self.lfs.as_ref()?.sha256.as_deref()?;
        super::cache::etag(s).filter(|s| s.len() == 64)
    }

    /// The name of its blob in the cache: its sha256 (LFS), else its git blob id.
    pub fn etag(&self) -> Option<String> {
        self.sha256().or_else(|| super::cache::etag(self.blob_id.as_deref()?))
    }

    /// Its size in bytes.
    pub fn size(&self) -> Option<u64> {
        self.lfs.as_ref().and_then(|l| l.size).or(self.size)
    }
}

/// A repository's listing: its commit and files.
#[derive(Debug, Deserialize)]
pub struct Listing {
    #[serde(default)]
    pub sha: Option<String>,
    #[serde(default, deserialize_with = "at_most_files")]
    pub siblings: Vec<Listed>,
}

/// The listing's files, refused past [`MAX_LISTED_FILES`] (each is memory).
fn at_most_files<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<Listed>, D::Error> {
    struct Files;
    impl<'de> serde::de::Visitor<'de> for Files {
        type Value = Vec<Listed>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            write!(f, "a list of at most {MAX_LISTED_FILES} files")
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<Listed>, A::Error> {
            let mut out = Vec::new();
            while let Some(f) = seq.next_element::<Listed>()? {
                if out.len() == MAX_LISTED_FILES {
                    return Err(serde::de::Error::custom(format!("more than {MAX_LISTED_FILES} files")));
                }
                out.push(f);
            }
            Ok(out)
        }
    }
    d.deserialize_seq(Files)
}

/// The listing of `repo` at main (`where_`: how errors name the repository).
pub async fn listing(http: &reqwest::Client, opts: &Options, repo: &str, where_: &str) -> Result<Listing> {
    let url = format!("{}/api/models/{repo}/revision/main?blobs=true", opts.endpoint);
    let send = with_token(http.get(&url), opts).send();
    let r = tokio::time::timeout(opts.timeout, send)
        .await
        .map_err(|_| anyhow!("{} did not answer within {} s", opts.endpoint, opts.timeout.as_secs_f64()))?
        .map_err(|e| anyhow!("cannot reach {}: {}", opts.endpoint, plain(&e)))?;
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
    if r.content_length().is_some_and(|n| n > MAX_LISTING_BYTES as u64) {
        bail!("{where_}: the file listing is larger than {} MiB", MAX_LISTING_BYTES >> 20);
    }
    // The whole listing within a few windows, whatever pace the bytes come at.
    let body = read_capped(r, MAX_LISTING_BYTES, opts.timeout * 6, where_);
    let body = body.await?;
    let listing: Listing =
        serde_json::from_slice(&body).map_err(|e| anyhow!("{where_}: the file listing is not the Hub's: {e}"))?;
    Ok(listing)
}

/// A response's body, refused past `cap` bytes or `limit` in all.
async fn read_capped(mut r: reqwest::Response, cap: usize, limit: Duration, where_: &str) -> Result<Vec<u8>> {
    let deadline = tokio::time::Instant::now() + limit;
    let mut body = Vec::new();
    loop {
        let chunk = tokio::time::timeout_at(deadline, r.chunk())
            .await
            .map_err(|_| anyhow!("{where_}: the file listing took longer than {} s", limit.as_secs()))?
            .map_err(|e| anyhow!("{where_}: reading the file listing: {}", plain(&e)))?;
        let Some(chunk) = chunk else { return Ok(body) };
        if body.len() + chunk.len() > cap {
            bail!("{where_}: the file listing is larger than {} MiB", cap >> 20);
        }
        body.extend_from_slice(&chunk);
    }
}

/// A reqwest error with its causes (a timeout says so).
fn plain(e: &reqwest::Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(c) = src {
        s.push_str(&format!(": {c}"));
        src = c.source();
    }
    s
}

/// One file to download: where from, where to, what it must be.
pub struct Want<'a> {
    pub url: String,
    /// The `.incomplete` blob.
    pub partial: &'a Path,
    pub size: u64,
    pub sha256: Option<String>,
    /// How errors name the file.
    pub what: String,
}

/// Why a try failed: worth another (the connection) or not (what the Hub sent is wrong).
enum Failed {
    Retry(anyhow::Error),
    Fatal(anyhow::Error),
}

/// Downloads `want` into its `.incomplete` file, resuming what is there, retrying a cut or a
/// stall up to `opts.retries` times; the file is whole (size, and sha256 where listed) when
/// this returns Ok.
pub async fn download(
    http: &reqwest::Client,
    opts: &Options,
    want: &Want<'_>,
    cancel: &AtomicBool,
    bar: Option<&indicatif::ProgressBar>,
) -> Result<()> {
    let mut hash = Hashed::default();
    let mut tries = 0;
    loop {
        match attempt(http, opts, want, &mut hash, cancel, bar).await {
            Ok(()) => break,
            Err(Failed::Retry(e)) if tries < opts.retries && !cancel.load(Ordering::Relaxed) => {
                tries += 1;
                tracing::warn!("{}: {e:#}; trying again ({tries} of {})", want.what, opts.retries);
                tokio::time::sleep(Duration::from_millis(250 * tries as u64)).await;
            }
            Err(Failed::Retry(e) | Failed::Fatal(e)) => return Err(e),
        }
    }
    if let Some(sha) = &want.sha256 {
        let got = hash.finish(want.partial)?;
        if !got.eq_ignore_ascii_case(sha) {
            let _ = std::fs::remove_file(want.partial);
            bail!("{}: sha256 {got} is not the {sha} the Hub lists; the file was removed (run again)", want.what);
        }
    }
    Ok(())
}

/// The sha256 of the bytes written so far (`at` of them), kept across tries.
#[derive(Default)]
struct Hashed {
    h: Sha256,
    at: u64,
}

impl Hashed {
    /// Brings the hash to the first `len` bytes of `path` (from scratch where it is ahead).
    fn catch_up(&mut self, path: &Path, len: u64) -> std::io::Result<()> {
        if self.at > len {
            *self = Hashed::default();
        }
        if self.at == len {
            return Ok(());
        }
        let mut f = std::fs::File::open(path)?;
        std::io::Seek::seek(&mut f, std::io::SeekFrom::Start(self.at))?;
        let mut f = f.take(len - self.at);
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = f.read(&mut buf)?;
            if n == 0 {
                break;
            }
            self.h.update(&buf[..n]);
            self.at += n as u64;
        }
        Ok(())
    }

    fn finish(&mut self, path: &Path) -> Result<String> {
        let len = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
        self.catch_up(path, len)?;
        Ok(std::mem::take(&mut self.h).finalize().iter().map(|b| format!("{b:02x}")).collect())
    }
}

/// Bytes already in the `.incomplete` file (a link there is removed: it is nothing of ours).
fn have(path: &Path, size: u64) -> std::io::Result<u64> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_file() && m.len() <= size => Ok(m.len()),
        Ok(m) if m.is_dir() => Err(std::io::Error::other(format!("{} is a folder", path.display()))),
        Ok(_) => std::fs::remove_file(path).map(|_| 0),
        Err(_) => Ok(0),
    }
}

/// `bytes START-END/TOTAL` of a Content-Range header.
fn content_range(v: &str) -> Option<(u64, u64, u64)> {
    let (range, total) = v.strip_prefix("bytes ")?.split_once('/')?;
    let (a, b) = range.split_once('-')?;
    Some((a.trim().parse().ok()?, b.trim().parse().ok()?, total.trim().parse().ok()?))
}

async fn attempt(
    http: &reqwest::Client,
    opts: &Options,
    want: &Want<'_>,
    hash: &mut Hashed,
    cancel: &AtomicBool,
    bar: Option<&indicatif::ProgressBar>,
) -> Result<(), Failed> {
    let what = &want.what;
    let io = |e: std::io::Error| Failed::Fatal(anyhow!("{what}: {e}"));
    let mut at = have(want.partial, want.size).map_err(io)?;
    if at == want.size {
        // (An empty file has nothing to fetch, but its blob exists.)
        std::fs::OpenOptions::new().create(true).append(true).open(want.partial).map_err(io)?;
        return Ok(());
    }
    let req = with_token(http.get(&want.url), opts).header(reqwest::header::RANGE, format!("bytes={at}-"));
    let r = match tokio::time::timeout(opts.timeout, req.send()).await {
        Err(_) => return Err(Failed::Retry(anyhow!("{what}: no answer within {} s", opts.timeout.as_secs_f64()))),
        Ok(Err(e)) => return Err(Failed::Retry(anyhow!("{what}: {}", plain(&e)))),
        Ok(Ok(r)) => r,
    };
    let status = r.status().as_u16();
    let expect = |n: u64| r.content_length().is_none_or(|l| l == n);
    match status {
        206 => {
            let range = r.headers().get(reqwest::header::CONTENT_RANGE).and_then(|v| v.to_str().ok());
            match range.and_then(content_range) {
                Some((a, b, total))
                    if a == at && b + 1 == want.size && total == want.size && expect(want.size - at) => {}
                _ => {
                    return Err(Failed::Fatal(anyhow!(
                    "{what}: the Hub sent bytes {range:?} for a request from byte {at} of a file it lists at {} bytes",
                    want.size
                )))
                }
            }
        }
        200 => {
            // The whole file (the range was not honoured): start again from 0.
            if !expect(want.size) {
                return Err(Failed::Fatal(anyhow!(
                    "{what}: the Hub sends {} bytes for a file it lists at {} bytes",
                    r.content_length().unwrap_or(0),
                    want.size
                )));
            }
            at = 0;
        }
        416 => return Err(Failed::Fatal(anyhow!("{what}: the Hub has no bytes from {at} on (HTTP 416)"))),
        401 | 403 => return Err(Failed::Fatal(anyhow!("{what}: the Hub refused the download (HTTP {status})"))),
        404 => return Err(Failed::Fatal(anyhow!("{what}: the Hub has no such file (HTTP 404)"))),
        s if s == 429 || s >= 500 => return Err(Failed::Retry(anyhow!("{what}: the Hub answered HTTP {s}"))),
        s => return Err(Failed::Fatal(anyhow!("{what}: the Hub answered HTTP {s}"))),
    }
    hash.catch_up(want.partial, at).map_err(io)?;
    let file = std::fs::OpenOptions::new().create(true).write(true).truncate(false).open(want.partial).map_err(io)?;
    file.set_len(at).map_err(io)?;
    let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
    std::io::Seek::seek(&mut out, std::io::SeekFrom::Start(at)).map_err(io)?;
    let mut r = r;
    let mut window = (Instant::now(), 0u64);
    let result = loop {
        if cancel.load(Ordering::Relaxed) {
            break Err(Failed::Fatal(anyhow!("{what}: the pull was cancelled")));
        }
        // Each window of `timeout` must bring enough (a drip is a stall); a cancel is seen
        // within a tenth of a second.
        let ends = (window.0 + opts.timeout).min(Instant::now() + CANCEL_POLL);
        let next = tokio::time::timeout_at(ends.into(), r.chunk()).await;
        if window.0.elapsed() >= opts.timeout {
            if window.1 < MIN_BYTES_PER_WINDOW && !matches!(next, Ok(Ok(None))) {
                break Err(Failed::Retry(anyhow!(
                    "{what}: the download stalled ({} bytes in {} s)",
                    window.1,
                    opts.timeout.as_secs_f64()
                )));
            }
            window = (Instant::now(), 0);
        }
        let chunk = match next {
            Err(_) => continue,
            Ok(Err(e)) => break Err(Failed::Retry(anyhow!("{what}: {}", plain(&e)))),
            Ok(Ok(None)) => break Ok(()),
            Ok(Ok(Some(c))) => c,
        };
        if at + chunk.len() as u64 > want.size {
            break Err(Failed::Fatal(anyhow!("{what}: the Hub sent more than the {} bytes it lists", want.size)));
        }
        if let Err(e) = out.write_all(&chunk) {
            break Err(io(e));
        }
        hash.h.update(&chunk);
        hash.at += chunk.len() as u64;
        at += chunk.len() as u64;
        window.1 += chunk.len() as u64;
        if let Some(b) = bar {
            b.set_position(at);
        }
    };
    out.flush().map_err(io)?;
    result?;
    if at < want.size {
        return Err(Failed::Retry(anyhow!("{what}: the body ended at byte {at} of {}", want.size)));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_content_ranges() {
        assert_eq!(content_range("bytes 0-99/100"), Some((0, 99, 100)));
        assert_eq!(content_range("bytes 5-9/*"), None);
        assert_eq!(content_range("items 0-1/2"), None);
    }

    #[test]
    fn listings_give_sizes_and_blob_names() {
        let sha = "ab".repeat(32);
        let v = serde_json::json!({"sha": "c".repeat(40), "extra": [[[]]], "siblings": [
            {"rfilename": "a.gguf", "size": 5, "blobId": "d".repeat(40), "lfs": {"sha256": sha, "size": 7}},
            {"rfilename": "b.json", "size": 3, "blobId": "e".repeat(40)},
            {"rfilename": "c", "blobId": "../../x", "lfs": {"sha256": "\"/etc/passwd\""}}]});
        let l: Listing = serde_json::from_value(v).unwrap();
        assert_eq!((l.siblings[0].etag().unwrap(), l.siblings[0].size()), (sha.clone(), Some(7)));
        assert_eq!(l.siblings[0].sha256(), Some(sha));
        assert_eq!((l.siblings[1].etag().unwrap(), l.siblings[1].size()), ("e".repeat(40), Some(3)));
        assert_eq!(l.siblings[1].sha256(), None);
        assert_eq!((l.siblings[2].etag(), l.siblings[2].size()), (None, None));
    }
}
