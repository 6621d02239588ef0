//! Models by name from the Hub (src/hub), against a local HTTP server that answers the Hub's
//! endpoints the client uses: the file listing with LFS sha256 (`/api/models/OWNER/REPO/revision/
//! main?blobs=true`), `resolve/main/FILE` as a redirect to the blob (with the commit and ETag
//! headers), and the blob with Range. No test reaches the real Hub. Checked: the quantization
//! picked and the Hugging Face cache layout, no request at all for a cached file, a download cut
//! in the middle resumed from its committed chunks, a wrong checksum refused and removed, offline
//! mode, a gated repository without a token, split GGUFs, unknown repositories and
//! quantizations, and `generate --model hf:...` / `-hf` end to end on the tiny Qwen2.

mod common;

use axum::body::Body;
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use common::served::TempDir;
use futures_util::StreamExt;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use torus_wgpu::hub::{pull, Options, Spec};

const TOKEN: &str = "hf_good";

struct Repo {
    commit: String,
    files: Vec<(String, Vec<u8>)>,
    gated: bool,
    /// Files whose blob differs from the sha256 the listing gives.
    corrupt: Vec<String>,
    /// The listing gives no sha256 (only a git blob id), as for files outside LFS.
    no_sha: bool,
    /// The listing claims this size for every file.
    claim: Option<u64>,
    /// Blobs end after this many bytes, however long the file.
    short: Option<usize>,
    /// How a blob's body comes: (bytes per piece, pause between pieces), instead of at once.
    pace: Option<(usize, Duration)>,
    /// Hostile metadata headers on `resolve` (traversal in the etag and commit).
    hostile_headers: bool,
}

#[derive(Default)]
struct Hub {
    repos: HashMap<String, Repo>,
    /// Every request: (path, Range header).
    log: Vec<(String, Option<String>)>,
    /// Cut the next blob response after this many bytes of the whole file (once).
    cut_at: Option<usize>,
    /// Requests that reached another origin than the Hub's (`localhost`) with an
    /// `Authorization` header.
    leaked_token: usize,
    /// Blob bodies being sent now.
    sending: usize,
    /// The listing of every repository, in place of the real one: (body, bytes per piece,
    /// pause between pieces).
    listing_body: Option<(Vec<u8>, usize, Duration)>,
    /// The listing redirects to the same path on another origin.
    listing_elsewhere: bool,
}

type Shared = Arc<Mutex<Hub>>;

fn sha(b: &[u8]) -> String {
    Sha256::digest(b).iter().map(|x| format!("{x:02x}")).collect()
}

fn authorized(h: &HeaderMap) -> bool {
    h.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) == Some(&format!("Bearer {TOKEN}"))
}

async fn listing(
    State(hub): State<Shared>,
    UrlPath((owner, name, _rev)): UrlPath<(String, String, String)>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    let mut hub = hub.lock().unwrap();
    hub.log.push((format!("/api/models/{owner}/{name}"), None));
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
    if host.starts_with("localhost") && headers.contains_key(header::AUTHORIZATION) {
        hub.leaked_token += 1;
    }
    if hub.listing_elsewhere && host.starts_with("127.0.0.1") {
        let to = format!(
            "http://{}/api/models/{owner}/{name}/revision/main?blobs=true",
            host.replace("127.0.0.1", "localhost")
        );
        return Response::builder().status(StatusCode::FOUND).header(header::LOCATION, to).body(Body::empty()).unwrap();
    }
    if let Some((body, piece, pause)) = hub.listing_body.clone() {
        return paced(body, piece, pause, None);
    }
    let Some(r) = hub.repos.get(&format!("{owner}/{name}")) else {
        return (StatusCode::NOT_FOUND, "Repository not found").into_response();
    };
    if r.gated && !authorized(&headers) {
        return (StatusCode::UNAUTHORIZED, "Access to this model is restricted").into_response();
    }
    assert_eq!(q.get("blobs").map(String::as_str), Some("true"), "the client asks for the LFS metadata");
    let siblings: Vec<serde_json::Value> = r
        .files
        .iter()
        .map(|(n, b)| {
            let size = r.claim.unwrap_or(b.len() as u64);
            match r.no_sha {
                true => serde_json::json!({"rfilename": n, "size": size, "blobId": &sha(b)[..40]}),
                false => serde_json::json!({"rfilename": n, "size": size, "lfs": {"sha256": sha(b), "size": size}}),
            }
        })
        .collect();
    axum::Json(serde_json::json!({"id": format!("{owner}/{name}"), "sha": r.commit, "siblings": siblings}))
        .into_response()
}

async fn resolve(
    State(hub): State<Shared>,
    UrlPath((owner, name, _rev, file)): UrlPath<(String, String, String, String)>,
    headers: HeaderMap,
) -> Response {
    let mut hub = hub.lock().unwrap();
    let range = headers.get(header::RANGE).and_then(|v| v.to_str().ok()).map(str::to_string);
    hub.log.push((format!("/{owner}/{name}/resolve/{file}"), range));
    // The storage is another host, as the Hub's is: `localhost` for `127.0.0.1`.
    let host =
        headers.get(header::HOST).and_then(|v| v.to_str().ok()).unwrap_or_default().replace("127.0.0.1", "localhost");
    let Some(r) = hub.repos.get(&format!("{owner}/{name}")) else { return StatusCode::NOT_FOUND.into_response() };
    if r.gated && !authorized(&headers) {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    let Some((_, bytes)) = r.files.iter().find(|(n, _)| *n == file) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let etag = sha(bytes);
    // A redirect to another host, as the Hub's to its storage, with the Hub's metadata headers.
    let (etag_header, commit_header) = match r.hostile_headers {
        true => ("\"../../../../escaped\"".to_string(), "../../escaped-commit".to_string()),
        false => (format!("\"{etag}\""), r.commit.clone()),
    };
    Response::builder()
        .status(StatusCode::FOUND)
        .header(header::LOCATION, format!("http://{host}/blobs/{owner}/{name}/{etag}"))
        .header("x-repo-commit", commit_header)
        .header("x-linked-etag", etag_header)
        .header("x-linked-size", bytes.len())
        .body(Body::empty())
        .unwrap()
}

/// Counts a blob body being sent (until it is dropped: sent, or the client left).
struct Sending(Shared);

impl Drop for Sending {
    fn drop(&mut self) {
        self.0.lock().unwrap().sending -= 1;
    }
}

/// `body` in pieces of `piece` bytes with `pause` between them (`sending`: counted meanwhile).
fn paced(body: Vec<u8>, piece: usize, pause: Duration, sending: Option<Sending>) -> Response {
    let pieces: Vec<Vec<u8>> = body.chunks(piece.max(1)).map(<[u8]>::to_vec).collect();
    let stream =
        futures_util::stream::unfold((pieces.into_iter(), sending, true), move |(mut it, s, first)| async move {
            if !first {
                tokio::time::sleep(pause).await;
            }
            let p = it.next()?;
            Some((Ok::<_, std::io::Error>(axum::body::Bytes::from(p)), (it, s, false)))
        });
    Response::builder().status(StatusCode::OK).body(Body::from_stream(stream)).unwrap()
}

async fn blob(
    State(hub): State<Shared>,
    UrlPath((owner, name, etag)): UrlPath<(String, String, String)>,
    headers: HeaderMap,
) -> Response {
    let shared = hub.clone();
    let mut hub = hub.lock().unwrap();
    let range = headers.get(header::RANGE).and_then(|v| v.to_str().ok()).map(str::to_string);
    hub.log.push((format!("/blobs/{etag}"), range.clone()));
    if headers.contains_key(header::AUTHORIZATION) {
        hub.leaked_token += 1;
    }
    let Some(r) = hub.repos.get(&format!("{owner}/{name}")) else { return StatusCode::NOT_FOUND.into_response() };
    let Some((file, bytes)) = r.files.iter().find(|(_, b)| sha(b) == etag) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let mut bytes = bytes.clone();
    if r.corrupt.contains(file) {
        bytes[0] ^= 0xff;
    }
    let total = bytes.len();
    let (a, b) = match range.as_deref().and_then(|r| r.strip_prefix("bytes=")).and_then(|r| r.split_once('-')) {
        Some((a, b)) => {
            let a: usize = a.parse().unwrap();
            let b: usize = b.parse::<usize>().map_or(total - 1, |b| b.min(total - 1));
            (a, b)
        }
        None => (0, total - 1),
    };
    let mut body = bytes[a..=b].to_vec();
    if let Some(n) = r.short {
        body.truncate(n);
    }
    if let Some((piece, pause)) = r.pace {
        hub.sending += 1;
        let mut resp = paced(body, piece, pause, Some(Sending(shared.clone())));
        *resp.status_mut() = StatusCode::PARTIAL_CONTENT;
        let h = resp.headers_mut();
        h.insert(header::CONTENT_RANGE, format!("bytes {a}-{b}/{total}").parse().unwrap());
        return resp;
    }
    let mut resp = Response::builder()
        .status(StatusCode::PARTIAL_CONTENT)
        .header(header::CONTENT_RANGE, format!("bytes {a}-{b}/{total}"))
        .header(header::CONTENT_LENGTH, body.len().min(b + 1 - a));
    // The response that passes `cut_at` stops there (the bytes before it sent, then nothing
    // until the client gives up; the connection is cut after 30 s).
    if let Some(at) = hub.cut_at.filter(|&at| at > a && at <= b) {
        hub.cut_at = None;
        let head = body[..at - a].to_vec();
        let hang = async {
            tokio::time::sleep(Duration::from_secs(30)).await;
            Err::<axum::body::Bytes, _>(std::io::Error::other("connection cut"))
        };
        let stream = futures_util::stream::iter([Ok::<_, std::io::Error>(axum::body::Bytes::from(head))])
            .chain(futures_util::stream::once(hang));
        resp = resp.header("x-cut", "1");
        return resp.body(Body::from_stream(stream)).unwrap();
    }
    resp.body(Body::from(body)).unwrap()
}

/// The local Hub, serving on a thread of its own (the client blocks its caller).
fn start(hub: Shared) -> String {
    let app = Router::new()
        .route("/api/models/{owner}/{name}/revision/{rev}", get(listing))
        .route("/{owner}/{name}/resolve/{rev}/{*file}", get(resolve))
        .route("/blobs/{owner}/{name}/{etag}", get(blob))
        .with_state(hub);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(l.local_addr().unwrap()).unwrap();
            axum::serve(l, app).await.unwrap();
        });
    });
    format!("http://{}", rx.recv().unwrap())
}

/// Deterministic bytes standing in for a model file.
fn bytes(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u32).wrapping_mul(2654435761).rotate_left(seed as u32 % 31) as u8 ^ seed).collect()
}

fn tmp(tag: &str) -> TempDir {
    let d = std::env::temp_dir().join(format!("torus-hub-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    TempDir(d)
}

fn opts(endpoint: &str, cache: &Path) -> Options {
    Options {
        cache: cache.to_path_buf(),
        endpoint: endpoint.to_string(),
        token: None,
        offline: false,
        progress: false,
        timeout: Duration::from_secs(1),
        retries: 0,
    }
}

fn hub_with(repos: Vec<(&str, Repo)>) -> Shared {
    let mut h = Hub::default();
    for (n, r) in repos {
        h.repos.insert(n.to_string(), r);
    }
    Arc::new(Mutex::new(h))
}

fn repo(files: Vec<(&str, Vec<u8>)>) -> Repo {
    Repo {
        commit: "0123456789abcdef0123456789abcdef01234567".into(),
        files: files.into_iter().map(|(n, b)| (n.to_string(), b)).collect(),
        gated: false,
        corrupt: vec![],
        no_sha: false,
        claim: None,
        short: None,
        pace: None,
        hostile_headers: false,
    }
}

fn requests(hub: &Shared) -> usize {
    hub.lock().unwrap().log.len()
}

fn spec(s: &str) -> Spec {
    Spec::parse(s).unwrap()
}

#[test]
fn pull_picks_the_quantization_into_the_hf_cache_and_reuses_it() {
    let q4 = bytes(700_000, 1);
    let hub = hub_with(vec![(
        "org/M-GGUF",
        repo(vec![("README.md", b"# M".to_vec()), ("M-Q8_0.gguf", bytes(300_000, 2)), ("M-Q4_K_M.gguf", q4.clone())]),
    )]);
    let url = start(hub.clone());
    let dir = tmp("pick");
    let o = opts(&url, &dir.0);
    let p = pull(&spec("org/M-GGUF"), &o).unwrap();
    assert!(p.ends_with("M-Q4_K_M.gguf"), "{}", p.display());
    assert_eq!(std::fs::read(&p).unwrap(), q4);
    // The Hugging Face layout: refs/main, snapshots/COMMIT/FILE -> ../../blobs/SHA256.
    let root = dir.0.join("models--org--M-GGUF");
    let commit = std::fs::read_to_string(root.join("refs/main")).unwrap();
    assert_eq!(commit.trim(), "0123456789abcdef0123456789abcdef01234567");
    assert_eq!(p, root.join("snapshots").join(commit.trim()).join("M-Q4_K_M.gguf"));
    assert!(std::fs::symlink_metadata(&p).unwrap().file_type().is_symlink());
    assert_eq!(std::fs::canonicalize(&p).unwrap(), std::fs::canonicalize(root.join("blobs").join(sha(&q4))).unwrap());
    // Cached: no request at all.
    let n = requests(&hub);
    assert_eq!(pull(&spec("org/M-GGUF"), &o).unwrap(), p);
    assert_eq!(pull(&spec("org/M-GGUF:q4_k_m"), &o).unwrap(), p);
    assert_eq!(requests(&hub), n, "a cached model makes no request");
    // Another quantization is downloaded beside it; an unknown one lists those there are.
    let q8 = pull(&spec("org/M-GGUF:Q8_0"), &o).unwrap();
    assert!(q8.ends_with("M-Q8_0.gguf"));
    let e = pull(&spec("org/M-GGUF:Q5_K_S"), &o).unwrap_err().to_string();
    assert!(e.contains("Q5_K_S") && e.contains("Q4_K_M, Q8_0"), "{e}");
    let e = pull(&spec("org/nothing-here"), &o).unwrap_err().to_string();
    assert!(e.contains("no such repository"), "{e}");
}

#[test]
fn a_cut_download_resumes_from_its_last_byte() {
    let file = bytes(1_100_000, 3);
    let hub = hub_with(vec![("org/R-GGUF", repo(vec![("R-Q4_K_M.gguf", file.clone())]))]);
    hub.lock().unwrap().cut_at = Some(700_000);
    let url = start(hub.clone());
    let dir = tmp("resume");
    let mut o = opts(&url, &dir.0);
    // No second try within the pull: it fails, and the next pull resumes.
    let e = pull(&spec("org/R-GGUF"), &o).unwrap_err();
    assert!(format!("{e:#}").contains("R-Q4_K_M.gguf"), "{e:#}");
    let before = requests(&hub);
    let p = pull(&spec("org/R-GGUF"), &o).unwrap();
    assert_eq!(std::fs::read(&p).unwrap(), file, "the resumed file is whole");
    let ranges = |from: usize| -> Vec<String> {
        let log = hub.lock().unwrap().log[from..].to_vec();
        log.into_iter().filter(|(p, _)| p.contains("/resolve/")).map(|(_, r)| r.unwrap_or_default()).collect()
    };
    assert_eq!(ranges(before), ["bytes=700000-"], "the second try asked for the bytes from the cut on");
    // With tries to spare, one pull gets over a cut by itself.
    let dir = tmp("resume2");
    o = opts(&url, &dir.0);
    o.retries = 2;
    hub.lock().unwrap().cut_at = Some(300_000);
    let before = requests(&hub);
    let p = pull(&spec("org/R-GGUF"), &o).unwrap();
    assert_eq!(std::fs::read(&p).unwrap(), file);
    assert_eq!(ranges(before), ["bytes=0-", "bytes=300000-"]);
}

#[test]
fn a_wrong_checksum_is_refused_and_removed() {
    let file = bytes(200_000, 4);
    let mut r = repo(vec![("C-Q4_K_M.gguf", file.clone())]);
    r.corrupt = vec!["C-Q4_K_M.gguf".into()];
    let hub = hub_with(vec![("org/C-GGUF", r)]);
    let url = start(hub);
    let dir = tmp("sum");
    let e = pull(&spec("org/C-GGUF"), &opts(&url, &dir.0)).unwrap_err().to_string();
    assert!(e.contains("sha256") && e.contains(&sha(&file)), "{e}");
    let root = dir.0.join("models--org--C-GGUF");
    // (The download's lock file stays, as the Python client's does.)
    let left: Vec<_> = std::fs::read_dir(root.join("blobs"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_none_or(|x| x != "lock"))
        .collect();
    assert!(left.is_empty(), "the bad blob is removed: {left:?}");
    assert!(!root.join("snapshots/0123456789abcdef0123456789abcdef01234567/C-Q4_K_M.gguf").exists());
}

#[test]
fn offline_mode_uses_the_cache_only() {
    let hub = hub_with(vec![("org/O-GGUF", repo(vec![("O-Q4_K_M.gguf", bytes(50_000, 5))]))]);
    let url = start(hub.clone());
    let dir = tmp("offline");
    let mut o = opts(&url, &dir.0);
    o.offline = true;
    let e = pull(&spec("org/O-GGUF"), &o).unwrap_err().to_string();
    assert!(e.contains("HF_HUB_OFFLINE") && e.contains("not in the Hugging Face cache"), "{e}");
    assert_eq!(requests(&hub), 0, "offline: no request");
    o.offline = false;
    let p = pull(&spec("org/O-GGUF"), &o).unwrap();
    let n = requests(&hub);
    o.offline = true;
    assert_eq!(pull(&spec("org/O-GGUF"), &o).unwrap(), p);
    assert_eq!(requests(&hub), n);
}

#[test]
fn a_gated_repository_needs_a_token() {
    let mut r = repo(vec![("G-Q4_K_M.gguf", bytes(40_000, 6))]);
    r.gated = true;
    let hub = hub_with(vec![("org/G-GGUF", r)]);
    let url = start(hub);
    let dir = tmp("gated");
    let mut o = opts(&url, &dir.0);
    let e = pull(&spec("org/G-GGUF"), &o).unwrap_err().to_string();
    assert!(e.contains("gated") && e.contains("HF_TOKEN"), "{e}");
    o.token = Some("hf_wrong".into());
    let e = pull(&spec("org/G-GGUF"), &o).unwrap_err().to_string();
    assert!(e.contains("refused HF_TOKEN"), "{e}");
    o.token = Some(TOKEN.into());
    assert!(pull(&spec("org/G-GGUF"), &o).unwrap().ends_with("G-Q4_K_M.gguf"));
}

/// Two pulls of one file at once (two processes would do the same): one downloads, the other
/// waits on the blob's lock and finds it whole; the Hub sends the file once.
#[test]
fn two_pulls_of_one_file_download_it_once() {
    let file = bytes(1_000_000, 20);
    let mut r = repo(vec![("W-Q4_K_M.gguf", file.clone())]);
    r.pace = Some((64 << 10, Duration::from_millis(50)));
    let hub = hub_with(vec![("org/W-GGUF", r)]);
    let url = start(hub.clone());
    let dir = tmp("twice");
    let pulls: Vec<_> = (0..2)
        .map(|_| {
            let o = opts(&url, &dir.0);
            std::thread::spawn(move || pull(&spec("org/W-GGUF"), &o))
        })
        .collect();
    for p in pulls {
        assert_eq!(std::fs::read(p.join().unwrap().unwrap()).unwrap(), file);
    }
    let fetched = hub.lock().unwrap().log.iter().filter(|(p, _)| p.starts_with("/blobs/")).count();
    assert_eq!(fetched, 1, "{:?}", hub.lock().unwrap().log);
}

#[test]
fn split_gguf_parts_come_together() {
    let (a, b) = (bytes(90_000, 7), bytes(60_000, 8));
    let hub = hub_with(vec![(
        "org/S-GGUF",
        repo(vec![("S-Q8_0-00002-of-00002.gguf", b.clone()), ("S-Q8_0-00001-of-00002.gguf", a.clone())]),
    )]);
    let url = start(hub);
    let dir = tmp("split");
    let p = pull(&spec("org/S-GGUF:Q8_0"), &opts(&url, &dir.0)).unwrap();
    assert!(p.ends_with("S-Q8_0-00001-of-00002.gguf"), "the first part is the entry: {}", p.display());
    assert_eq!(std::fs::read(&p).unwrap(), a);
    assert_eq!(std::fs::read(p.with_file_name("S-Q8_0-00002-of-00002.gguf")).unwrap(), b);
}

/// The binary: `generate --model hf:org/tiny-qwen2` downloads the Transformers repository and
/// runs it; `-hf` then finds it in the cache with HF_HUB_OFFLINE=1.
#[test]
fn generate_with_a_model_from_the_hub() {
    let src = common::tiny();
    let mut files = Vec::new();
    for f in ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"] {
        files.push((f, std::fs::read(src.join(f)).unwrap()));
    }
    files.push(("README.md", b"tiny".to_vec()));
    let hub = hub_with(vec![("org/tiny-qwen2", repo(files))]);
    let url = start(hub.clone());
    let home = tmp("generate");
    let run = |args: &[&str], offline: bool| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_torus-wgpu"));
        c.args(args).env("HF_HOME", &home.0).env("HF_ENDPOINT", &url).env_remove("HF_TOKEN").env_remove("HF_HUB_CACHE");
        if offline {
            c.env("HF_HUB_OFFLINE", "1");
        } else {
            c.env_remove("HF_HUB_OFFLINE");
        }
        let out = c.output().unwrap();
        let (so, se) =
            (String::from_utf8_lossy(&out.stdout).to_string(), String::from_utf8_lossy(&out.stderr).to_string());
        assert!(out.status.success(), "{args:?}: {se}");
        (so, se)
    };
    let gen = ["generate", "--prompt", "Hello", "--max-tokens", "4", "--temperature", "0"];
    let (a, _) = run(&[&gen[..], &["--model", "hf:org/tiny-qwen2"]].concat(), false);
    let n = requests(&hub);
    assert!(n > 0);
    let (b, _) = run(&[&gen[..], &["-hf", "org/tiny-qwen2"]].concat(), true);
    assert_eq!(requests(&hub), n, "the second run is served by the cache");
    let (c, _) = run(&[&gen[..], &["--model", src.to_str().unwrap()]].concat(), true);
    let text = |s: &str| s.lines().next().unwrap_or_default().to_string();
    assert!(text(&c).len() > "Hello".len(), "generate printed the prompt and its tokens: {c:?}");
    assert_eq!(text(&a), text(&c), "the model from the Hub generates what the local copy does");
    assert_eq!(text(&b), text(&c));
    let (path, _) = run(&["pull", "org/tiny-qwen2"], true);
    assert!(Path::new(path.trim()).join("model.safetensors").is_file(), "{path}");
}

/// A split GGUF (llama.cpp's gguf-split layout, cut here by `write_split`) loads as the whole
/// file: the same tensors and bytes, and through the Hub the same generated text; a later part
/// or a missing part is a clear error.
#[test]
fn a_split_gguf_from_the_hub_runs_as_the_whole_file() {
    use torus_wgpu::formats::gguf::GgufFile;
    use torus_wgpu::formats::gguf_split::write_split;
    let whole_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-gemma4.gguf");
    let whole = GgufFile::open(&whole_path).unwrap();
    let cut = tmp("cut");
    let parts = write_split(&whole, &cut.0.join("tg4-Q8_0"), 3).unwrap();
    assert_eq!(parts.len(), 3);
    let joined = GgufFile::open(&parts[0]).unwrap();
    assert_eq!(joined.tensors.len(), whole.tensors.len());
    for t in &whole.tensors {
        let j = joined.tensor(&t.name).unwrap_or_else(|| panic!("{} is missing", t.name));
        assert_eq!((&j.dims, j.ggml_type), (&t.dims, t.ggml_type));
        assert_eq!(joined.tensor_data(j), whole.tensor_data(t), "{}", t.name);
    }
    assert!(joined.tensors.iter().any(|t| t.part == 2), "the last part's tensors are there");
    let e = GgufFile::open(&parts[1]).unwrap_err().to_string();
    assert!(e.contains("part 2 of a split GGUF file of 3") && e.contains("first part"), "{e}");

    let files: Vec<(&str, Vec<u8>)> =
        ["tg4-Q8_0-00001-of-00003.gguf", "tg4-Q8_0-00002-of-00003.gguf", "tg4-Q8_0-00003-of-00003.gguf"]
            .into_iter()
            .zip(&parts)
            .map(|(n, p)| (n, std::fs::read(p).unwrap()))
            .collect();
    let hub = hub_with(vec![("org/tg4-GGUF", repo(files))]);
    let url = start(hub);
    let home = tmp("split-run");
    let generate = |model: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_torus-wgpu"))
            .args(["generate", "--prompt", "Hello", "--max-tokens", "4", "--temperature", "0", "--model", model])
            .env("HF_HOME", &home.0)
            .env("HF_ENDPOINT", &url)
            .env_remove("HF_HUB_OFFLINE")
            .env_remove("HF_HUB_CACHE")
            .output()
            .unwrap();
        assert!(out.status.success(), "{model}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).lines().next().unwrap_or_default().to_string()
    };
    let text = generate(whole_path.to_str().unwrap());
    assert!(text.len() > "Hello".len(), "generate printed the prompt and its tokens: {text:?}");
    assert_eq!(generate("hf:org/tg4-GGUF:Q8_0"), text);
    std::fs::remove_file(&parts[2]).unwrap();
    let e = GgufFile::open(&parts[0]).unwrap_err().to_string();
    assert!(e.contains("tg4-Q8_0-00003-of-00003.gguf"), "the missing part is named: {e}");
}

/// Ollama's `/api/pull` of a Hugging Face name (`hf.co/OWNER/REPO:QUANT`) downloads into the
/// cache, streamed as Ollama streams it or answered once; the served model is "already here";
/// a name of Ollama's library, or a failed download, is an error in Ollama's shape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ollama_pull_downloads_a_hub_model() {
    use torus_wgpu::config::EngineConfig;
    use torus_wgpu::server::{model_id_for_path, start, ServerConfig};
    let q8 = bytes(120_000, 9);
    let mut gated = repo(vec![("G-Q4_K_M.gguf", bytes(1000, 10))]);
    gated.gated = true;
    let hub = hub_with(vec![
        ("org/P-GGUF", repo(vec![("P-Q4_K_M.gguf", bytes(80_000, 11)), ("P-Q8_0.gguf", q8.clone())])),
        ("org/G-GGUF", gated),
    ]);
    let url = start_hub_async(hub).await;
    let cache = tmp("ollama-pull");
    let cfg = EngineConfig { max_sequence_length: 256, total_cache_size: 4 << 20, ..Default::default() };
    let engine = common::start_engine_async(&common::tiny(), &cfg).await;
    let mut scfg = ServerConfig::new(model_id_for_path(&common::tiny()), &cfg);
    scfg.hub = Some(opts(&url, &cache.0));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let srv = start(listener, scfg, Some(engine)).unwrap();
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let post = |body: serde_json::Value| http.post(format!("http://{}/api/pull", srv.addr)).json(&body).send();

    let r = post(serde_json::json!({"model": "hf.co/org/P-GGUF:Q8_0"})).await.unwrap();
    assert_eq!(r.status(), 200);
    let lines: Vec<serde_json::Value> =
        r.text().await.unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.first().unwrap()["status"], "pulling manifest", "{lines:?}");
    assert_eq!(lines.last().unwrap()["status"], "success", "{lines:?}");
    let file = cache.0.join("models--org--P-GGUF/snapshots/0123456789abcdef0123456789abcdef01234567/P-Q8_0.gguf");
    assert_eq!(std::fs::read(&file).unwrap(), q8);

    let r = post(serde_json::json!({"model": "hf.co/org/P-GGUF", "stream": false})).await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<serde_json::Value>().await.unwrap(), serde_json::json!({"status": "success"}));
    assert!(file.with_file_name("P-Q4_K_M.gguf").is_file());

    let r = post(serde_json::json!({"model": "tiny-qwen2"})).await.unwrap();
    assert_eq!(r.json::<serde_json::Value>().await.unwrap()["status"], "success", "the served model is here");
    let r = post(serde_json::json!({"model": "qwen3:8b"})).await.unwrap();
    assert_eq!(r.status(), 400);
    let e: serde_json::Value = r.json().await.unwrap();
    assert!(e["error"].as_str().unwrap().contains("hf.co/OWNER/REPO"), "{e}");
    let r = post(serde_json::json!({"model": "hf.co/org/G-GGUF", "stream": false})).await.unwrap();
    assert_eq!(r.status(), 502);
    let e: serde_json::Value = r.json().await.unwrap();
    assert!(e["error"].as_str().unwrap().contains("HF_TOKEN"), "{e}");
    let r = post(serde_json::json!({"model": "hf.co/org/G-GGUF"})).await.unwrap();
    let text = r.text().await.unwrap();
    let last: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    assert!(last["error"].as_str().unwrap().contains("gated"), "{text}");
    srv.shutdown().await;

    // `serve --no-pull`: a 403, nothing downloaded.
    let engine = common::start_engine_async(&common::tiny(), &cfg).await;
    let mut scfg = ServerConfig::new(model_id_for_path(&common::tiny()), &cfg);
    scfg.hub = Some(opts(&url, &cache.0));
    scfg.allow_pull = false;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let srv = start(listener, scfg, Some(engine)).unwrap();
    let r = http.post(format!("http://{}/api/pull", srv.addr)).json(&serde_json::json!({"model": "hf.co/org/Q-GGUF"}));
    let r = r.send().await.unwrap();
    assert_eq!(r.status(), 403);
    assert!(!cache.0.join("models--org--Q-GGUF").exists());
    srv.shutdown().await;
}

/// `start` from inside a runtime (it blocks on a channel only until the port is bound).
async fn start_hub_async(hub: Shared) -> String {
    tokio::task::spawn_blocking(move || start(hub)).await.unwrap()
}

/// On a `serve --models-dir` server, a model pulled through Ollama's `/api/pull` is served by
/// the name it was pulled by at once (listed by `/api/tags`, loaded when a chat names it), and
/// its answer is the local copy's; a Hub name the cache does not hold is a 404 that downloads
/// nothing (only `/api/pull` reaches the network).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_models_server_serves_what_it_pulled() {
    let src = common::tiny();
    let mut files = Vec::new();
    for f in ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"] {
        files.push((f, std::fs::read(src.join(f)).unwrap()));
    }
    let hub = hub_with(vec![("org/tiny-qwen2", repo(files.clone())), ("org/other", repo(files))]);
    let url = start_hub_async(hub.clone()).await;
    let home = tmp("models-pull");
    let dir = home.0.join("models");
    std::fs::create_dir_all(&dir).unwrap();
    std::os::unix::fs::symlink(&src, dir.join("local-tiny")).unwrap();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_torus-wgpu"));
    cmd.args(["serve", "--port", "0", "--max-loaded-models", "1", "--models-dir"])
        .arg(&dir)
        .env("HF_HOME", home.0.join("hf"))
        .env("HF_ENDPOINT", &url)
        .env_remove("HF_TOKEN")
        .env_remove("HF_HUB_CACHE")
        .env_remove("HF_HUB_OFFLINE");
    let (mut child, lines, _log) =
        common::spawn_until_ready(&mut cmd, "models", "ready on http://", std::time::Duration::from_secs(60));
    let addr = lines.last().unwrap().split("ready on http://").nth(1).unwrap().split_whitespace().next().unwrap();
    let base = format!("http://{addr}");
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let chat = |model: &str| {
        let body = serde_json::json!({"model": model, "messages": [{"role": "user", "content": "Hello"}],
                                      "max_tokens": 6, "temperature": 0});
        http.post(format!("{base}/v1/chat/completions")).json(&body).send()
    };

    let r = chat("hf.co/org/other").await.unwrap();
    assert_eq!(r.status(), 404, "not pulled, not in the cache");
    let before = requests(&hub);
    assert_eq!(before, 0, "a name alone never downloads");

    let r = http
        .post(format!("{base}/api/pull"))
        .json(&serde_json::json!({"model": "hf.co/org/tiny-qwen2", "stream": false}));
    let r = r.send().await.unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let tags: serde_json::Value = http.get(format!("{base}/api/tags")).send().await.unwrap().json().await.unwrap();
    let names: Vec<&str> = tags["models"].as_array().unwrap().iter().map(|m| m["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["local-tiny:latest", "hf.co/org/tiny-qwen2:latest"]);
    let pulled: serde_json::Value = chat("hf.co/org/tiny-qwen2:latest").await.unwrap().json().await.unwrap();
    assert_eq!(pulled["model"], "hf.co/org/tiny-qwen2", "{pulled}");
    let local: serde_json::Value = chat("local-tiny").await.unwrap().json().await.unwrap();
    let content = |v: &serde_json::Value| v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    assert!(!content(&local).is_empty());
    assert_eq!(content(&pulled), content(&local), "the pulled model answers as the local copy");
    let _ = child.kill();
    let _ = child.wait();
}

// ---- A hostile Hub and a poisoned cache ----

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// Every file and link under `dir` (links not followed).
fn files_under(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let ty = e.file_type().unwrap();
            if ty.is_dir() {
                stack.push(e.path());
            } else {
                out.push(e.path());
            }
        }
    }
    out
}

/// `f` on a thread of its own, which must end within `secs` (a hang fails the test).
fn within<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(secs)).unwrap_or_else(|_| panic!("still running after {secs} s"))
}

/// A Hub that answers every listing with `body` (in pieces of `piece` bytes, `pause` apart).
fn hub_listing(body: Vec<u8>, piece: usize, pause: Duration) -> String {
    let h = hub_with(vec![]);
    h.lock().unwrap().listing_body = Some((body, piece, pause));
    start(h)
}

/// What the Hub says is data, never a path: traversal in the metadata headers (etag and
/// commit), in the listing's commit, blob id, sha256 and file names. Nothing is written
/// outside the cache, and the bad values are errors that say which.
#[test]
fn hub_values_never_become_paths() {
    let file = bytes(30_000, 12);
    let mut headers = repo(vec![("H-Q4_K_M.gguf", file.clone())]);
    headers.hostile_headers = true;
    let mut commit = repo(vec![("B-Q4_K_M.gguf", bytes(1000, 13))]);
    commit.commit = "../../escaped-commit".into();
    let base = tmp("paths");
    let cache = base.0.join("a/b/c/hub");
    let url = start(hub_with(vec![("org/H-GGUF", headers), ("org/B-GGUF", commit)]));
    let o = opts(&url, &cache);
    let p = pull(&spec("org/H-GGUF"), &o).unwrap();
    assert_eq!(std::fs::read(&p).unwrap(), file);
    let e = pull(&spec("org/B-GGUF"), &o).unwrap_err().to_string();
    assert!(e.contains("no commit"), "{e}");
    let one = |sibling: serde_json::Value| serde_json::json!({"sha": COMMIT, "siblings": [sibling]});
    for (listing, why) in [
        (
            one(serde_json::json!({"rfilename": "E-Q4_K_M.gguf", "size": 10, "blobId": "../../../../escaped-blob"})),
            "no blob id",
        ),
        (
            one(
                serde_json::json!({"rfilename": "E-Q4_K_M.gguf", "size": 1, "lfs": {"sha256": "/tmp/escaped-abs", "size": 1}}),
            ),
            "no blob id",
        ),
        (
            one(
                serde_json::json!({"rfilename": "../../../escaped-Q4_K_M.gguf", "size": 1, "lfs": {"sha256": sha(b"x"), "size": 1}}),
            ),
            "unsafe file",
        ),
        (
            one(
                serde_json::json!({"rfilename": "/tmp/escaped-Q4_K_M.gguf", "size": 1, "lfs": {"sha256": sha(b"x"), "size": 1}}),
            ),
            "unsafe file",
        ),
    ] {
        let url = hub_listing(serde_json::to_vec(&listing).unwrap(), 1 << 20, Duration::ZERO);
        let e = pull(&spec("org/E-GGUF"), &opts(&url, &cache)).unwrap_err().to_string();
        assert!(e.contains(why), "{listing}: {e}");
    }
    let all = files_under(&base.0);
    let outside: Vec<_> = all.iter().filter(|p| !p.starts_with(&cache)).collect();
    assert!(outside.is_empty(), "written outside the cache: {outside:?}");
    let escaped: Vec<_> = all.iter().filter(|p| p.to_string_lossy().contains("escaped")).collect();
    assert!(escaped.is_empty(), "{escaped:?}");
}

/// The cache is checked when read: a `refs/main` that leads out of the cache, a snapshot file
/// linked to a file outside it, and a snapshot holding a branching symlink loop are not served,
/// and looking at them ends at once.
#[test]
fn a_poisoned_cache_is_not_followed() {
    let base = tmp("poison");
    let cache = base.0.join("hub");
    std::fs::create_dir_all(&cache).unwrap();
    std::fs::write(base.0.join("secret-Q4_K_M.gguf"), b"secret").unwrap();
    let root = cache.join("models--org--P-GGUF");
    std::fs::create_dir_all(root.join("refs")).unwrap();
    std::fs::create_dir_all(root.join("snapshots")).unwrap();
    let mut o = opts("http://127.0.0.1:9", &cache);
    o.offline = true;
    // refs/main naming a folder three levels up: the snapshot would be `base`.
    std::fs::write(root.join("refs/main"), "../../..").unwrap();
    let e = pull(&spec("org/P-GGUF"), &o).unwrap_err().to_string();
    assert!(e.contains("refs/main names no commit"), "{e}");
    // A commit whose snapshot links to a file outside the cache.
    std::fs::write(root.join("refs/main"), COMMIT).unwrap();
    let snap = root.join("snapshots").join(COMMIT);
    std::fs::create_dir_all(&snap).unwrap();
    std::os::unix::fs::symlink(base.0.join("secret-Q4_K_M.gguf"), snap.join("P-Q4_K_M.gguf")).unwrap();
    let e = pull(&spec("org/P-GGUF"), &o).unwrap_err().to_string();
    assert!(e.contains("not in the Hugging Face cache"), "{e}");
    // A loop that branches three ways at every level.
    std::fs::create_dir_all(snap.join("d")).unwrap();
    for l in ["u1", "u2", "u3"] {
        std::os::unix::fs::symlink("..", snap.join("d").join(l)).unwrap();
    }
    std::fs::write(snap.join("d/x-Q8_0.gguf"), b"x").unwrap();
    let o2 = o.clone();
    let e = within(30, move || pull(&spec("org/P-GGUF"), &o2).unwrap_err().to_string());
    assert!(e.contains("not in the Hugging Face cache"), "{e}");
}

/// `Authorization` goes to the Hub's origin only: not to the storage its downloads redirect
/// to, nor to another origin its listing redirects to.
#[test]
fn the_token_goes_only_to_the_hub() {
    let file = bytes(20_000, 16);
    let hub = hub_with(vec![("org/T-GGUF", repo(vec![("T-Q4_K_M.gguf", file.clone())]))]);
    hub.lock().unwrap().listing_elsewhere = true;
    let url = start(hub.clone());
    let dir = tmp("token");
    let mut o = opts(&url, &dir.0);
    o.token = Some(TOKEN.into());
    assert_eq!(std::fs::read(pull(&spec("org/T-GGUF"), &o).unwrap()).unwrap(), file);
    let h = hub.lock().unwrap();
    assert!(h.log.iter().filter(|(p, _)| p.starts_with("/blobs/")).count() >= 1, "{:?}", h.log);
    assert_eq!(h.leaked_token, 0, "the token reached another origin: {:?}", h.log);
}

/// A listing or a body that drips (a byte every 300 ms, under the 1 s time limit per read) is
/// cut within a few time limits, not held for as long as it drips.
#[test]
fn a_drip_is_cut() {
    let mut r = repo(vec![("D-Q4_K_M.gguf", bytes(200_000, 17))]);
    r.pace = Some((1, Duration::from_millis(300)));
    let url = start(hub_with(vec![("org/D-GGUF", r)]));
    let dir = tmp("drip");
    let mut o = opts(&url, &dir.0);
    o.retries = 1;
    let t0 = Instant::now();
    let e = within(60, move || pull(&spec("org/D-GGUF"), &o).unwrap_err().to_string());
    assert!(e.contains("stalled"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    let listing = serde_json::to_vec(&serde_json::json!({"sha": COMMIT, "siblings": []})).unwrap();
    let url = hub_listing(listing, 1, Duration::from_millis(300));
    let o = opts(&url, &dir.0);
    let t0 = Instant::now();
    let e = within(60, move || pull(&spec("org/D-GGUF"), &o).unwrap_err().to_string());
    assert!(e.contains("file listing took longer"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
}

/// Sizes are enforced: a body shorter than the listed size (no sha256 listed to catch it), a
/// size claim of 10 TB for a 1 KiB file, and a body longer than the listed size all fail,
/// nothing is linked into the snapshot, and no file grows past what was sent.
#[test]
fn sizes_are_enforced() {
    let file = bytes(1024, 18);
    let mut short = repo(vec![("S-Q4_K_M.gguf", file.clone())]);
    (short.no_sha, short.short) = (true, Some(100));
    let mut huge = repo(vec![("H-Q4_K_M.gguf", file.clone())]);
    huge.claim = Some(10 << 40);
    let mut small = repo(vec![("L-Q4_K_M.gguf", file.clone())]);
    (small.no_sha, small.claim) = (true, Some(500));
    let url = start(hub_with(vec![("org/S-GGUF", short), ("org/H-GGUF", huge), ("org/L-GGUF", small)]));
    let dir = tmp("sizes");
    for name in ["org/S-GGUF", "org/H-GGUF", "org/L-GGUF"] {
        let e = pull(&spec(name), &opts(&url, &dir.0)).unwrap_err().to_string();
        assert!(e.contains("bytes"), "{name}: {e}");
    }
    let all = files_under(&dir.0);
    assert!(!all.iter().any(|p| p.to_string_lossy().contains("snapshots")), "{all:?}");
    for p in &all {
        assert!(std::fs::metadata(p).unwrap().len() <= 1024, "{} grew past what was sent", p.display());
    }
}

/// A 20 MB listing (the limit is 16 MiB) is refused, and a listing of 900,000 tiny files is
/// refused past 100,000 files, each costing the `pull` process under 100 MB (its peak resident
/// memory, as a Python parent reads it: a child the test process starts would count the test's
/// own memory, which it shares until it runs the program).
#[test]
fn huge_listings_cost_little_memory() {
    let mut nested = br#"{"sha": "0123456789abcdef0123456789abcdef01234567", "siblings": [], "x": ["#.to_vec();
    while nested.len() < 20_000_000 {
        nested.extend_from_slice(b"[[]],");
    }
    nested.extend_from_slice(b"[]]}");
    let mut many = br#"{"sha": "0123456789abcdef0123456789abcdef01234567", "siblings": ["#.to_vec();
    for i in 0..900_000 {
        many.extend_from_slice(if i == 0 { b"{\"rfilename\":\"a\"}" } else { b",{\"rfilename\":\"a\"}" });
    }
    many.extend_from_slice(b"]}");
    assert!(many.len() < 16 << 20);
    const MEASURE: &str = "import os, resource, subprocess, sys\n\
        r = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n\
        print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n\
        sys.stdout.write(r.stderr)\n";
    for (body, why) in [(nested, "larger than 16 MiB"), (many, "more than 100000 files")] {
        let url = hub_listing(body, 1 << 20, Duration::ZERO);
        let home = tmp("listing");
        let out = std::process::Command::new("python3")
            .args(["-c", MEASURE, env!("CARGO_BIN_EXE_torus-wgpu"), "pull", "org/L-GGUF"])
            .env("HF_HOME", &home.0)
            .env("HF_ENDPOINT", &url)
            .env_remove("HF_HUB_OFFLINE")
            .env_remove("HF_HUB_CACHE")
            .output()
            .expect("python3 (scripts/setup.sh installs it)");
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let mut head = text.lines().next().unwrap_or_default().split_whitespace();
        let status: i32 = head.next().and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("{text}"));
        let rss_kb: u64 = head.next().and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("{text}"));
        assert_ne!(status, 0, "{text}");
        assert!(text.contains(why), "{text}");
        assert!(rss_kb < 100_000, "the pull took {rss_kb} KB for a listing it refused");
    }
}

/// Ollama's `/api/pull` holds its one-at-a-time permit for as long as its download runs, and a
/// pull whose client left is cancelled (the Hub sees its download end), keeping what it fetched
/// for the next pull to resume; a failed pull's error names no path of the server's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_whose_client_left_is_cancelled() {
    use torus_wgpu::config::EngineConfig;
    use torus_wgpu::server::{model_id_for_path, start, ServerConfig};
    let file = bytes(2_000_000, 19);
    let mut r = repo(vec![("C-Q4_K_M.gguf", file.clone())]);
    // 160 KB/s: 12 s for the whole file.
    r.pace = Some((16 << 10, Duration::from_millis(100)));
    let hub = hub_with(vec![("org/C-GGUF", r)]);
    let url = start_hub_async(hub.clone()).await;
    let cache = tmp("cancel");
    let cfg = EngineConfig { max_sequence_length: 256, total_cache_size: 4 << 20, ..Default::default() };
    let serve = |hub_cache: &Path| {
        let mut scfg = ServerConfig::new(model_id_for_path(&common::tiny()), &cfg);
        scfg.hub = Some(opts(&url, hub_cache));
        scfg
    };
    let engine = common::start_engine_async(&common::tiny(), &cfg).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let srv = start(listener, serve(&cache.0), Some(engine)).unwrap();
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let pull_url = format!("http://{}/api/pull", srv.addr);
    let body = serde_json::json!({"model": "hf.co/org/C-GGUF"});
    let until = |what: &'static str, f: Box<dyn Fn() -> bool + Send>| async move {
        let t0 = Instant::now();
        while !f() {
            assert!(t0.elapsed() < Duration::from_secs(8), "{what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };

    // A client that leaves once the download runs.
    let r = http.post(&pull_url).json(&body).send().await.unwrap();
    let mut lines = r.bytes_stream();
    let first = lines.next().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).contains("pulling manifest"));
    let h = hub.clone();
    until("the download starts", Box::new(move || h.lock().unwrap().sending == 1)).await;
    drop(lines);
    let h = hub.clone();
    until("the abandoned download is cancelled", Box::new(move || h.lock().unwrap().sending == 0)).await;
    let blobs = cache.0.join("models--org--C-GGUF/blobs");
    let partial = std::fs::read_dir(&blobs)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "incomplete"))
        .unwrap();
    let kept = std::fs::metadata(&partial).unwrap().len();
    assert!(kept > 0 && kept < file.len() as u64, "{kept}");

    // The next pull resumes it; while it runs, another is refused.
    let before = requests(&hub);
    let next = tokio::spawn(
        http.post(&pull_url).json(&serde_json::json!({"model": "hf.co/org/C-GGUF", "stream": false})).send(),
    );
    let h = hub.clone();
    until("the second download starts", Box::new(move || h.lock().unwrap().sending == 1)).await;
    let r = http.post(&pull_url).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 429, "one pull at a time");
    let r = next.await.unwrap().unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let h = hub.clone();
    until("the download ends", Box::new(move || h.lock().unwrap().sending == 0)).await;
    let log = hub.lock().unwrap().log[before..].to_vec();
    let range = log.iter().find(|(p, _)| p.contains("/resolve/")).and_then(|(_, r)| r.clone()).unwrap();
    let from: u64 = range.trim_start_matches("bytes=").trim_end_matches('-').parse().unwrap();
    assert!(from >= kept, "resumed from {from}, {kept} were kept");
    let snap = cache.0.join("models--org--C-GGUF/snapshots").join(COMMIT).join("C-Q4_K_M.gguf");
    assert_eq!(std::fs::read(snap).unwrap(), file);
    srv.shutdown().await;

    // A cache that cannot be written: the error says why without the server's paths.
    let not_a_dir = cache.0.join("a-file");
    std::fs::write(&not_a_dir, b"x").unwrap();
    let engine = common::start_engine_async(&common::tiny(), &cfg).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let srv = start(listener, serve(&not_a_dir.join("hub")), Some(engine)).unwrap();
    let r = http
        .post(format!("http://{}/api/pull", srv.addr))
        .json(&serde_json::json!({"model": "hf.co/org/C-GGUF", "stream": false}));
    let r = r.send().await.unwrap();
    assert_eq!(r.status(), 502);
    let text = r.text().await.unwrap();
    assert!(!text.contains(&*cache.0.to_string_lossy()) && !text.contains("/tmp"), "{text}");
    assert!(text.contains("cannot create"), "{text}");
    srv.shutdown().await;
}
