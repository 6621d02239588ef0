//! Soak (issue 12): the real binary (`torus-wgpu serve`) takes 500 requests of random parameters
//! at concurrency 32: chat and completions, streaming or not, n 1-4, stop strings, logprobs,
//! penalties, seeds, and 10% of them disconnected mid-stream. Every request must complete (or
//! end with a clean error in OpenAI's shape), the KV blocks in use must return to 0, and the
//! server's resident memory after the 500th request must be within 10% of that after the 100th.
//!
//! The model is the tiny Qwen2 fixture (fast; its text is noise, which stop strings and
//! logprobs do not mind); `TORUS_SOAK_MODEL=path` runs another (e.g. SmolLM2) and
//! `TORUS_SOAK_REQUESTS=n` another count, `TORUS_SOAK_BIN=path` another build of the binary.
//! The figures are printed (run with --nocapture).

mod common;
use common::{spawn_until_ready, tiny};

use futures_util::StreamExt;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const CONCURRENCY: usize = 32;

/// xorshift64*: the soak's parameters are random but reproducible from the seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
    fn range(&mut self, a: f64, b: f64) -> f64 {
        a + (b - a) * ((self.next() >> 11) as f64 / (1u64 << 53) as f64)
    }
}

const WORDS: &[&str] = &[
    "the",
    "cache",
    "river",
    "GPU",
    "kernel",
    "why",
    "seven",
    "blue",
    "tell",
    "me",
    "about",
    "a",
    "story",
    "of",
    "paged",
    "attention",
    "and",
    "bread",
    "42",
    "é",
    "日本",
    "🙂",
];
const STOPS: &[&str] = &["e", "the", " a", "\n", ".", "an", "ing", "🙂", "xyz"];

struct Job {
    path: &'static str,
    body: Value,
    n: usize,
    stream: bool,
    disconnect: bool,
}

fn job(r: &mut Rng) -> Job {
    let chat = r.chance(0.7);
    let disconnect = r.chance(0.1);
    let stream = disconnect || r.chance(0.5);
    let n = 1 + r.below(4) as usize;
    let words = 1 + r.below(40) as usize;
    let text: Vec<&str> = (0..words).map(|_| WORDS[r.below(WORDS.len() as u64) as usize]).collect();
    let text = text.join(" ");
    let mut b = if chat { json!({"messages": [{"role": "user", "content": text}]}) } else { json!({"prompt": text}) };
    b["n"] = json!(n);
    b["max_tokens"] = json!(1 + r.below(if disconnect { 64 } else { 24 }));
    b["stream"] = json!(stream);
    if stream && r.chance(0.5) {
        b["stream_options"] = json!({"include_usage": true});
    }
    if r.chance(0.5) {
        b["temperature"] = json!(0.0);
    } else {
        b["temperature"] = json!(r.range(0.2, 1.5));
        b["top_p"] = json!(r.range(0.5, 1.0));
        if r.chance(0.3) {
            b["top_k"] = json!(1 + r.below(50));
        }
    }
    if r.chance(0.5) {
        b["seed"] = json!(r.below(1 << 31));
    }
    if r.chance(0.3) {
        let k = 1 + r.below(3) as usize;
        let stops: Vec<&str> = (0..k).map(|_| STOPS[r.below(STOPS.len() as u64) as usize]).collect();
        b["stop"] = json!(stops);
    }
    if r.chance(0.3) {
        let top = r.below(6);
        if chat {
            b["logprobs"] = json!(true);
            b["top_logprobs"] = json!(top);
        } else {
            b["logprobs"] = json!(top);
        }
    }
    if r.chance(0.3) {
        b["presence_penalty"] = json!(r.range(-1.0, 1.0));
        b["frequency_penalty"] = json!(r.range(-1.0, 1.0));
        b["repetition_penalty"] = json!(r.range(1.0, 1.3));
    }
    if r.chance(0.5) {
        b["ignore_eos"] = json!(true);
    }
    let path = if chat { "/v1/chat/completions" } else { "/v1/completions" };
    Job { path, body: b, n, stream, disconnect }
}

#[derive(Debug, PartialEq)]
enum Outcome {
    Complete,
    /// An error in OpenAI's shape (status, message).
    CleanError(u16, String),
    Disconnected,
}

/// Sends one job; Err for anything that is neither a complete answer nor a clean error.
async fn run(http: &reqwest::Client, base: &str, j: Job) -> Result<Outcome, String> {
    let resp = http.post(format!("{base}{}", j.path)).json(&j.body).send().await.map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    if status != 200 {
        let v: Value = resp.json().await.map_err(|e| format!("{status}: body is not JSON: {e}"))?;
        let m = v["error"]["message"].as_str().ok_or_else(|| format!("{status}: not OpenAI's error shape: {v}"))?;
        if status >= 500 && status != 503 {
            return Err(format!("{status}: {m}"));
        }
        return Ok(Outcome::CleanError(status, m.to_string()));
    }
    if !j.stream {
        let v: Value = resp.json().await.map_err(|e| e.to_string())?;
        let choices = v["choices"].as_array().ok_or_else(|| format!("no choices: {v}"))?;
        if choices.len() != j.n {
            return Err(format!("{} choices, asked for {}: {v}", choices.len(), j.n));
        }
        for c in choices {
            let reason = c["finish_reason"].as_str().unwrap_or("");
            if reason != "stop" && reason != "length" {
                return Err(format!("finish_reason {reason:?}: {v}"));
            }
        }
        if v["usage"]["completion_tokens"].as_u64().is_none() {
            return Err(format!("no usage: {v}"));
        }
        return Ok(Outcome::Complete);
    }
    let mut body = resp.bytes_stream();
    let mut text = String::new();
    while let Some(chunk) = body.next().await {
        text.push_str(&String::from_utf8_lossy(&chunk.map_err(|e| e.to_string())?));
        if j.disconnect && text.contains("\n\n") {
            // Gone after the first event: the server must abort the request and free its blocks.
            return Ok(Outcome::Disconnected);
        }
    }
    if !text.ends_with("data: [DONE]\n\n") {
        return Err(format!("stream does not end with [DONE]: {text:?}"));
    }
    let mut finished = vec![false; j.n];
    for ev in text.split("\n\n").filter(|e| !e.is_empty() && *e != "data: [DONE]" && !e.starts_with(':')) {
        let data = ev.strip_prefix("data: ").ok_or_else(|| format!("not a data event: {ev:?}"))?;
        let v: Value = serde_json::from_str(data).map_err(|e| format!("bad event {data:?}: {e}"))?;
        if let Some(m) = v["error"]["message"].as_str() {
            return Ok(Outcome::CleanError(200, m.to_string()));
        }
        for c in v["choices"].as_array().into_iter().flatten() {
            if let (Some(i), Some(reason)) = (c["index"].as_u64(), c["finish_reason"].as_str()) {
                if reason != "stop" && reason != "length" {
                    return Err(format!("finish_reason {reason:?}: {data}"));
                }
                *finished.get_mut(i as usize).ok_or_else(|| format!("choice index {i} of {}", j.n))? = true;
            }
        }
    }
    if finished.iter().any(|f| !f) {
        return Err(format!("not every choice finished: {finished:?}: {text}"));
    }
    Ok(Outcome::Complete)
}

fn rss_kib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("the server's /proc status");
    let line = s.lines().find(|l| l.starts_with("VmRSS:")).expect("VmRSS");
    line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).expect("VmRSS in kB")
}

fn gauge(metrics: &str, name: &str) -> u64 {
    let line = metrics.lines().find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '));
    line.and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<f64>().ok())
        .map(|v| v as u64)
        .unwrap_or_else(|| panic!("{name} missing from /metrics"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn soak_random_requests_at_concurrency_32() {
    let total: usize = std::env::var("TORUS_SOAK_REQUESTS").ok().and_then(|v| v.parse().ok()).unwrap_or(500);
    assert!(total >= 100, "the soak compares memory after the 100th request");
    let model = std::env::var("TORUS_SOAK_MODEL").map(std::path::PathBuf::from).unwrap_or_else(|_| tiny());
    assert!(model.exists(), "{} is missing (scripts/setup.sh fetches the models)", model.display());
    let bin = std::env::var("TORUS_SOAK_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_torus-wgpu").to_string());
    let mut cmd = std::process::Command::new(bin);
    cmd.args(["serve", "--port", "0", "--max-decode-batch-size", "32", "--max-sequence-length", "512"])
        .args(["--total-cache-size", &(64u64 << 20).to_string(), "--model"])
        .arg(&model);
    let (mut child, log, lines) =
        spawn_until_ready(&mut cmd, "soak-server", "listening on http://", Duration::from_secs(60));
    // Keep draining the server's log so it never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    let line = log.last().unwrap();
    let addr = line.split("http://").nth(1).and_then(|r| r.split_whitespace().next()).expect("the address");
    let base = format!("http://{addr}");
    let pid = child.id();
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let t = Instant::now();
    loop {
        let ok = http.get(format!("{base}/health")).send().await.is_ok_and(|r| r.status() == 200);
        if ok {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(300), "the server did not load its model");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let jobs: Vec<Job> = (0..total).map(|_| job(&mut rng)).collect();
    let queue = Arc::new(Mutex::new(jobs.into_iter().collect::<std::collections::VecDeque<_>>()));
    let done = Arc::new(AtomicUsize::new(0));
    let rss_100 = Arc::new(Mutex::new(None::<u64>));
    let outcomes = Arc::new(Mutex::new(Vec::new()));
    let t0 = Instant::now();
    let workers: Vec<_> = (0..CONCURRENCY)
        .map(|_| {
            let (queue, done, rss_100, outcomes) = (queue.clone(), done.clone(), rss_100.clone(), outcomes.clone());
            let (http, base) = (http.clone(), base.clone());
            tokio::spawn(async move {
                loop {
                    let Some(j) = queue.lock().unwrap().pop_front() else { break };
                    let body = j.body.to_string();
                    let r = tokio::time::timeout(Duration::from_secs(300), run(&http, &base, j))
                        .await
                        .unwrap_or_else(|_| Err("no answer within 300 s".into()));
                    outcomes.lock().unwrap().push((r, body));
                    if done.fetch_add(1, SeqCst) + 1 == 100 {
                        *rss_100.lock().unwrap() = Some(rss_kib(pid));
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.await.unwrap();
    }
    let secs = t0.elapsed().as_secs_f64();
    let rss_end = rss_kib(pid);
    let rss_100 = rss_100.lock().unwrap().expect("RSS after the 100th request");

    // Disconnected requests are aborted by the server: every block comes back.
    let t = Instant::now();
    let metrics = loop {
        let m = http.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
        let idle = gauge(&m, "torus_kv_cache_blocks_used") == 0
            && gauge(&m, "torus_num_requests_running") == 0
            && gauge(&m, "torus_num_requests_waiting") == 0;
        if idle || t.elapsed() > Duration::from_secs(30) {
            break m;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let _ = child.kill();
    let _ = child.wait();

    let outcomes = outcomes.lock().unwrap();
    let count = |f: &dyn Fn(&Outcome) -> bool| outcomes.iter().filter(|(r, _)| r.as_ref().is_ok_and(f)).count();
    let complete = count(&|o| *o == Outcome::Complete);
    let disconnected = count(&|o| *o == Outcome::Disconnected);
    let clean_errors: Vec<String> = outcomes
        .iter()
        .filter_map(|(r, b)| match r {
            Ok(Outcome::CleanError(s, m)) => Some(format!("{s} {m} <- {b}")),
            _ => None,
        })
        .collect();
    let broken: Vec<String> =
        outcomes.iter().filter_map(|(r, b)| r.as_ref().err().map(|e| format!("{e} <- {b}"))).collect();
    eprintln!(
        "soak: {total} requests in {secs:.1} s at concurrency {CONCURRENCY}: {complete} complete, {disconnected} \
         disconnected mid-stream, {} clean errors, {} broken; RSS {rss_100} KiB after the 100th, {rss_end} KiB after \
         the {total}th ({:+.1}%); prefix-cache hits {} of {} queries; preemptions {}",
        clean_errors.len(),
        broken.len(),
        (rss_end as f64 / rss_100 as f64 - 1.0) * 100.0,
        gauge(&metrics, "torus_prefix_cache_hits_total"),
        gauge(&metrics, "torus_prefix_cache_queries_total"),
        gauge(&metrics, "torus_preemptions_total"),
    );
    assert_eq!(outcomes.len(), total);
    assert!(broken.is_empty(), "requests that neither completed nor failed cleanly:\n{}", broken.join("\n"));
    // Valid random parameters: nothing is refused either.
    assert!(clean_errors.is_empty(), "requests refused:\n{}", clean_errors.join("\n"));
    assert!(disconnected > 0 && complete + disconnected == total);
    assert_eq!(gauge(&metrics, "torus_kv_cache_blocks_used"), 0, "KV blocks still in use after the soak");
    assert_eq!(gauge(&metrics, "torus_num_requests_running"), 0);
    assert!(
        rss_end as f64 <= rss_100 as f64 * 1.10,
        "resident memory grew from {rss_100} KiB (100th request) to {rss_end} KiB ({total}th)"
    );
}
