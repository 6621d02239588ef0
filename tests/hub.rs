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
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use torus_wgpu::hub::{pull, Options, Spec};

const TOKEN: &str = "hf_good";

struct Repo {
    commit: String,
    files: Vec<(String, Vec<u8>)>,
    gated: bool,
    /// Files whose blob differs from the sha256 the listing gives.
    corrupt: Vec<String>,
}

#[derive(Default)]
struct Hub {
    repos: HashMap<String, Repo>,
    /// Every request: (path, Range header).
    log: Vec<(String, Option<String>)>,
    /// Cut the next blob response after this many bytes of the whole file (once).
    cut_at: Option<usize>,
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
        .map(|(n, b)| serde_json::json!({"rfilename": n, "size": b.len(), "lfs": {"sha256": sha(b), "size": b.len()}}))
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
    // A redirect to another host, as the Hub's to its storage: the client reads the commit and
    // the ETag here and the size from the blob.
    Response::builder()
        .status(StatusCode::FOUND)
        .header(header::LOCATION, format!("http://{host}/blobs/{owner}/{name}/{etag}"))
        .header("x-repo-commit", r.commit.as_str())
        .header("x-linked-etag", format!("\"{etag}\""))
        .header("x-linked-size", bytes.len())
        .body(Body::empty())
        .unwrap()
}

async fn blob(
    State(hub): State<Shared>,
    UrlPath((owner, name, etag)): UrlPath<(String, String, String)>,
    headers: HeaderMap,
) -> Response {
    let mut hub = hub.lock().unwrap();
    let range = headers.get(header::RANGE).and_then(|v| v.to_str().ok()).map(str::to_string);
    hub.log.push((format!("/blobs/{etag}"), range.clone()));
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
    let body = bytes[a..=b].to_vec();
    let mut resp = Response::builder()
        .status(StatusCode::PARTIAL_CONTENT)
        .header(header::CONTENT_RANGE, format!("bytes {a}-{b}/{total}"))
        .header(header::CONTENT_LENGTH, body.len());
    // The connection is cut in the middle of the response that passes `cut_at`.
    if let Some(at) = hub.cut_at.filter(|&at| at > a && at <= b) {
        hub.cut_at = None;
        let head = body[..at - a].to_vec();
        let stream = futures_util::stream::iter([
            Ok::<_, std::io::Error>(axum::body::Bytes::from(head)),
            Err(std::io::Error::other("connection cut")),
        ]);
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
        chunk_bytes: 256 << 10,
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
fn a_cut_download_resumes_from_its_committed_chunks() {
    let file = bytes(1_100_000, 3);
    let hub = hub_with(vec![("org/R-GGUF", repo(vec![("R-Q4_K_M.gguf", file.clone())]))]);
    hub.lock().unwrap().cut_at = Some(700_000);
    let url = start(hub.clone());
    let dir = tmp("resume");
    let o = opts(&url, &dir.0);
    let e = pull(&spec("org/R-GGUF"), &o).unwrap_err();
    assert!(format!("{e:#}").contains("R-Q4_K_M.gguf"), "{e:#}");
    let before = requests(&hub);
    let p = pull(&spec("org/R-GGUF"), &o).unwrap();
    assert_eq!(std::fs::read(&p).unwrap(), file, "the resumed file is whole");
    // The second try asked for the bytes from the first uncommitted chunk on (chunks of 256 KiB:
    // two were whole before the cut at 700 000), not from 0.
    let log = hub.lock().unwrap().log[before..].to_vec();
    let first_blob = log
        .iter()
        .filter(|(p, r)| p.contains("/resolve/") && r.as_deref() != Some("bytes=0-0"))
        .map(|(_, r)| r.clone().unwrap_or_default())
        .next()
        .unwrap();
    assert_eq!(first_blob, format!("bytes={}-{}", 2 * (256 << 10), 3 * (256 << 10) - 1), "{log:?}");
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
    // (hf-hub leaves its lock file beside the blobs.)
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
