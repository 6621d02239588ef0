//! Paths shared by the integration tests.
#![allow(dead_code)]

pub mod api_shapes;
pub mod completions;
pub mod isolation;
pub mod reference;
pub mod served;
pub mod tiny;

use serde_json::Value;
use std::path::{Path, PathBuf};
use torus_wgpu::engine::{Request, RequestParams, StopConditions};
use torus_wgpu::model::{Model, StepInput};
use torus_wgpu::sampling::SampleParams;

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// The tiny Qwen2 model of the fixtures (Hugging Face layout).
pub fn tiny() -> PathBuf {
    fixtures().join("tiny-qwen2")
}

/// The default model (scripts/setup.sh fetches it; a missing file fails the test).
pub fn smollm2() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(p.exists(), "{} is missing: run scripts/setup.sh (or scripts/fetch-model.sh)", p.display());
    p
}
/// Qwen2.5-Coder-0.5B-Instruct Q4_K_M (scripts/setup.sh fetches it; a missing file fails the test).
pub fn qwen25_coder() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-model.sh qwen2.5-coder-0.5b (scripts/setup.sh does)",
        p.display()
    );
    p
}

/// Gemma 3 270M (the base model) Q4_K_M (scripts/setup.sh fetches it; a missing file fails the test).
pub fn gemma3_270m() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/gemma-3-270m-q4_k_m.gguf");
    assert!(p.exists(), "{} is missing: run scripts/fetch-model.sh gemma3-270m (scripts/setup.sh does)", p.display());
    p
}

/// Loads `path` with `cfg` on the default adapter (lavapipe here) and starts an engine.
pub fn start_engine(path: &Path, cfg: &torus_wgpu::config::EngineConfig) -> torus_wgpu::engine::EngineHandle {
    let gpu = std::sync::Arc::new(torus_wgpu::gpu::Gpu::new(None).expect("a wgpu adapter (lavapipe in CI)"));
    let (model, tok) = torus_wgpu::engine::load_model(path, cfg, gpu, &|_, _| {})
        .unwrap_or_else(|e| panic!("{} loads: {e:#}", path.display()));
    torus_wgpu::engine::EngineHandle::start(model, tok, cfg)
}

/// [`start_engine`] off the async threads.
pub async fn start_engine_async(
    path: &Path,
    cfg: &torus_wgpu::config::EngineConfig,
) -> torus_wgpu::engine::EngineHandle {
    let (path, cfg) = (path.to_path_buf(), cfg.clone());
    tokio::task::spawn_blocking(move || start_engine(&path, &cfg)).await.unwrap()
}

/// Starts `cmd` with stderr piped and waits (up to `limit`) for a stderr line containing
/// `ready`. Every line is echoed (prefixed with `tag`) and also sent on the returned receiver;
/// the lines up to the ready one are returned.
pub fn spawn_until_ready(
    cmd: &mut std::process::Command,
    tag: &'static str,
    ready: &str,
    limit: std::time::Duration,
) -> (std::process::Child, Vec<String>, std::sync::mpsc::Receiver<String>) {
    use std::io::{BufRead, BufReader};
    let mut child = cmd
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start the program");
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let err = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            eprintln!("[{tag}] {line}");
            let _ = tx.send(line);
        }
    });
    let mut log = vec![];
    loop {
        let Ok(line) = rx.recv_timeout(limit) else {
            let _ = child.kill();
            let _ = child.wait();
            panic!("no line with {ready:?}: {log:?}");
        };
        let done = line.contains(ready);
        log.push(line);
        if done {
            return (child, log, rx);
        }
    }
}

/// A greedy request for `n` tokens that ignores end-of-sequence.
pub fn greedy_req(prompt: &[u32], n: usize) -> Request {
    Request {
        prompt: prompt.to_vec(),
        params: RequestParams {
            stop: StopConditions { max_tokens: Some(n), ignore_eos: true, ..Default::default() },
            ..Default::default()
        },
    }
}

/// A JSON array of token ids.
pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// A JSON array of numbers.
pub fn floats(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

/// Logits at the last prompt position and after each forced token (teacher forcing): one
/// prefill step of the prompt, then one decode step per forced token.
pub fn logits_steps(model: &mut Model, prompt: &[u32], forced: &[u32]) -> Vec<Vec<f32>> {
    let bs = model.limits.block_size;
    let total = prompt.len() + forced.len();
    let table: Vec<u32> = (0..total.div_ceil(bs) as u32).collect();
    let mut out = Vec::new();
    let mut start = 0;
    let all: Vec<u32> = prompt.iter().chain(forced).cloned().collect();
    for end in std::iter::once(prompt.len()).chain(prompt.len() + 1..=total) {
        let n = end - start;
        let pos: Vec<u32> = (start as u32..end as u32).collect();
        model
            .step(&StepInput {
                tokens: all[start..end].to_vec(),
                positions: pos.clone(),
                slots: pos,
                seq_of_token: vec![0; n],
                block_tables: vec![table.clone()],
                sample_rows: vec![n as u32 - 1],
                sampling: vec![SampleParams::default()],
                state_slots: Vec::new(),
            })
            .unwrap();
        out.push(model.last_logits(1).unwrap());
        start = end;
    }
    out
}

/// Runs tests/openai_e2e.py (the official `openai` Python client) against `base` (`.../v1`)
/// with `flags`, and asserts that every check passed. Blocking: call it from
/// `spawn_blocking` in async tests. Without the Python packages (scripts/setup.sh installs
/// them) it fails, unless TORUS_SKIP_PYTHON=1 outside CI.
pub fn openai_e2e(base: &str, flags: &[&str]) {
    let import = "import openai, pydantic, jsonschema";
    let ok = std::process::Command::new("python3").args(["-c", import]).output().is_ok_and(|o| o.status.success());
    if !ok {
        let skip = std::env::var("TORUS_SKIP_PYTHON").as_deref() == Ok("1") && std::env::var_os("CI").is_none();
        if skip {
            eprintln!("SKIPPED: python3 cannot `{import}` (TORUS_SKIP_PYTHON=1)");
            return;
        }
        panic!("python3 cannot `{import}`: run scripts/setup.sh (or set TORUS_SKIP_PYTHON=1 outside CI to skip)");
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/openai_e2e.py");
    let out = std::process::Command::new("python3")
        .arg(script)
        .arg(base)
        .args(flags)
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("no_proxy", "127.0.0.1,localhost")
        .output()
        .expect("run python3");
    let (so, se) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "openai_e2e.py {flags:?} failed ({:?})\nstdout:\n{so}\nstderr:\n{se}", out.status);
    assert!(so.contains("openai_e2e: all checks passed"), "{so}");
}

/// Greedy tokens against a reference's, margin-aware: compared up to the first step whose
/// reference top-1/top-2 margin is below `min_margin` (twice the logit tolerance: there another
/// summation order, a real GPU's, may legitimately pick the other token, and the rest follows
/// from it). Returns how many tokens were compared.
pub fn assert_greedy_matches(got: &[u32], want: &[u32], margins: &[f32], min_margin: f32, what: &str) -> usize {
    assert_eq!(margins.len(), want.len(), "{what}: a margin per reference step");
    let n = margins.iter().position(|&m| m < min_margin).unwrap_or(want.len());
    assert!(got.len() >= n, "{what}: {} greedy tokens, the reference has {n} to compare", got.len());
    assert_eq!(
        got[..n],
        want[..n],
        "{what}: greedy tokens (the first {n}, whose reference margins are >= {min_margin})"
    );
    n
}

/// Reference margins below which greedy tokens are not compared: twice the logit tolerance of an
/// f32 KV cache (1e-3) and of an f16 one (2e-2).
pub const F32_MARGIN: f32 = 2e-3;
pub const F16_MARGIN: f32 = 4e-2;
