//! `torus-wgpu bench`: a load generator for any OpenAI-compatible endpoint (torus-wgpu,
//! llama.cpp's llama-server, vLLM, ...). Streams every request, records each chunk's arrival,
//! and reports throughput and TTFT / TPOT / ITL / E2E latency with vLLM's definitions.
//! A request whose send fails before any response arrived (a keep-alive connection the server
//! had closed) is resent on a fresh connection and counted in `retries`; its timeline still
//! starts at the first attempt.
//!
//! Owns: the load generator for OpenAI endpoints, `bench-model`, the kernel-profile sweep and
//! `build-kernels` (every pipeline a profile has, for the GPU compiler report).
//! May use: config, exec, model, ops, weights, gpu, formats, tokenizer, sampling.
//! Never uses: server, engine internals.

pub mod build_kernels;
pub mod kernels;
pub mod measure;
pub mod metrics;
pub mod model;
pub mod mtp;
pub mod overhead;
pub mod profiles;
pub mod spec_counters;
pub mod tune;

use anyhow::{anyhow, bail, Context, Result};
use futures_util::StreamExt;
use metrics::{summarize, RequestRecord, Slo, Stats, Summary};
use serde::Serialize;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Endpoint {
    Chat,
    Completions,
}

#[derive(clap::Args, Clone, Debug, Serialize)]
pub struct BenchArgs {
    /// Server root, e.g. http://127.0.0.1:8000 (the /v1 paths are appended).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub base_url: String,
    /// Model name to send (default: the first one /v1/models lists).
    #[arg(long)]
    pub model: Option<String>,
    #[arg(long, value_enum, default_value = "chat")]
    pub endpoint: Endpoint,
    #[arg(long, default_value_t = 100)]
    pub num_prompts: usize,
    /// Most requests in flight at once.
    #[arg(long, conflicts_with = "request_rate")]
    pub concurrency: Option<usize>,
    /// Requests per second, with Poisson arrivals (default: all at once).
    #[arg(long)]
    pub request_rate: Option<f64>,
    /// Prompt length in tokens for random prompts (approximate unless --tokenizer is given).
    #[arg(long, default_value_t = 128)]
    pub input_len: usize,
    /// Output tokens per request (max_tokens), unless the dataset gives one.
    #[arg(long, default_value_t = 128)]
    pub output_len: usize,
    /// JSONL with "prompt" (or "messages") and optional "output_len" per line.
    #[arg(long)]
    pub dataset: Option<PathBuf>,
    /// Ask the server to ignore end-of-sequence tokens (the `ignore_eos` extension).
    #[arg(long)]
    pub ignore_eos: bool,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Service-level objectives for goodput, e.g. `--goodput ttft:500 tpot:100 e2el:5000` (ms).
    #[arg(long, num_args = 1..)]
    pub goodput: Vec<String>,
    /// Write settings, summary and per-request records here.
    #[arg(long)]
    pub json_out: Option<PathBuf>,
    /// A model directory or .gguf whose tokenizer sizes random prompts exactly.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    #[serde(skip)]
    pub api_key: Option<String>,
    /// Per-request timeout in seconds.
    #[arg(long, default_value_t = 600.0)]
    pub timeout: f64,
    /// No progress bar (for scripts and tests).
    #[arg(long)]
    pub quiet: bool,
}

/// One request to send.
#[derive(Clone, Debug, Serialize)]
pub struct BenchPrompt {
    pub prompt: Option<String>,
    pub messages: Option<Value>,
    pub prompt_tokens: usize,
    pub output_len: usize,
}

/// Everything a run produced (also the --json-out document).
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    pub settings: BenchArgs,
    pub model: String,
    pub summary: Summary,
    pub records: Vec<RequestRecord>,
    /// What the server's speculative-decoding counters did during the run (None where it
    /// exports none).
    pub spec_decode: Option<spec_counters::SpecCounters>,
}

/// Common short English words: each is usually one token (with its leading space) in BPE
/// vocabularies, so N words make about N tokens.
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not", "he",
    "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "had", "they", "you", "were", "their",
    "one", "all", "we", "can", "her", "has", "there", "been", "if", "more", "when", "will", "would", "who", "so", "no",
    "she", "other", "its", "may", "these", "what", "them", "than", "some", "him", "time", "into", "only", "do",
    "could", "new", "about", "two", "first", "then", "also", "after", "any", "like", "should", "made", "most", "over",
    "such", "where", "even", "many", "must", "before", "through", "years", "back", "much", "good", "well", "down",
    "very", "way", "out", "our", "just", "work", "life", "water", "world", "day", "house", "light", "music", "city",
    "river", "book", "story", "game", "plant", "paper", "green", "small", "large", "great", "long", "high", "open",
];

fn random_prompts(a: &BenchArgs) -> Result<Vec<BenchPrompt>> {
    let tok = a.tokenizer.as_deref().map(crate::tokenizer::Tokenizer::from_path).transpose()?;
    let mut rng = crate::sampling::Rng::new(a.seed);
    let mut out = Vec::with_capacity(a.num_prompts);
    for _ in 0..a.num_prompts {
        let mut words: Vec<&str> =
            (0..a.input_len.max(1)).map(|_| WORDS[(rng.next_u64() % WORDS.len() as u64) as usize]).collect();
        let mut n = words.len();
        if let Some(t) = &tok {
            let count = |w: &[&str]| t.encode(&w.join(" ")).map(|ids| ids.len());
            let mut next = || WORDS[(rng.next_u64() % WORDS.len() as u64) as usize];
            n = fit_words(&mut words, a.input_len, count, &mut next)?;
        }
        out.push(BenchPrompt {
            prompt: Some(words.join(" ")),
            messages: None,
            prompt_tokens: n,
            output_len: a.output_len,
        });
    }
    Ok(out)
}

/// Trims or grows `words` until `count` gives exactly `want` tokens, or, where words of several
/// tokens keep stepping over it, the most below it (a word that steps over is taken back and
/// another tried, at most `TRIES` times, so the search ends); returns the count.
fn fit_words<'w>(
    words: &mut Vec<&'w str>,
    want: usize,
    count: impl Fn(&[&'w str]) -> Result<usize>,
    next: &mut impl FnMut() -> &'w str,
) -> Result<usize> {
    const TRIES: usize = 64;
    let (mut grew, mut over) = (false, 0);
    loop {
        let n = count(words)?;
        if n > want && words.len() > 1 {
            words.pop();
            over += usize::from(grew);
            if over >= TRIES {
                return count(words);
            }
        } else if n < want {
            words.push(next());
            grew = true;
        } else {
            return Ok(n);
        }
    }
}

fn dataset_prompts(a: &BenchArgs, path: &std::path::Path) -> Result<Vec<BenchPrompt>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line).map_err(|e| anyhow!("{}:{}: {e}", path.display(), i + 1))?;
        let output_len = v["output_len"].as_u64().or_else(|| v["max_tokens"].as_u64()).map(|x| x as usize);
        let (prompt, messages) = match (&v["prompt"], &v["messages"]) {
            (Value::String(p), _) => (Some(p.clone()), None),
            (_, Value::Array(m)) => (None, Some(Value::Array(m.clone()))),
            _ => bail!("{}:{}: needs a \"prompt\" string or a \"messages\" list", path.display(), i + 1),
        };
        let words = prompt.as_deref().map(|p| p.split_whitespace().count()).unwrap_or(0);
        rows.push(BenchPrompt {
            prompt,
            messages,
            prompt_tokens: words,
            output_len: output_len.unwrap_or(a.output_len),
        });
    }
    if rows.is_empty() {
        bail!("{}: no prompts", path.display());
    }
    Ok((0..a.num_prompts).map(|i| rows[i % rows.len()].clone()).collect())
}

fn request_body(a: &BenchArgs, model: &str, p: &BenchPrompt) -> Value {
    let mut body = json!({
        "model": model,
        "max_tokens": p.output_len,
        "temperature": a.temperature,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    match a.endpoint {
        Endpoint::Chat => {
            body["messages"] = p
                .messages
                .clone()
                .unwrap_or_else(|| json!([{"role": "user", "content": p.prompt.clone().unwrap_or_default()}]));
        }
        Endpoint::Completions => {
            body["prompt"] = json!(p.prompt.clone().unwrap_or_default());
        }
    }
    if a.ignore_eos {
        body["ignore_eos"] = json!(true);
    }
    body
}

/// Text a streamed chunk carries, if any.
fn chunk_text(endpoint: Endpoint, v: &Value) -> Option<String> {
    let c = v["choices"].as_array()?.first()?;
    let t = match endpoint {
        Endpoint::Chat => c["delta"]["content"].as_str(),
        Endpoint::Completions => c["text"].as_str(),
    }?;
    (!t.is_empty()).then(|| t.to_string())
}

/// Attempts at sending one request: the first on the shared connection pool, each further one
/// on a fresh connection, and only after an attempt that failed before any response arrived.
pub const SEND_ATTEMPTS: usize = 3;

/// Whether a failed send never got a response: the connection could not be made, or it closed
/// before the response's head arrived, typically a pooled keep-alive connection the server had
/// already closed (llama.cpp's llama-server closes idle ones). Such a request is sent again on a
/// fresh connection. A timeout is not retried (the server may be working on the request); an
/// error once the response has begun never reaches this test (it fails the request).
pub fn failed_before_response(e: &reqwest::Error) -> bool {
    if e.is_timeout() {
        return false;
    }
    if e.is_connect() {
        return true;
    }
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(h) = s.downcast_ref::<hyper::Error>() {
            // "connection closed before message completed", or canceled before it was sent.
            if h.is_incomplete_message() || h.is_canceled() {
                return true;
            }
        }
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind::*;
            if matches!(io.kind(), ConnectionReset | ConnectionAborted | BrokenPipe | UnexpectedEof) {
                return true;
            }
        }
        source = s.source();
    }
    false
}

/// Sends one request: on `client`, then on `fresh` (a client that keeps no idle connections)
/// while attempts fail before any response arrived; counts those resends in `retries`.
async fn send_with_retries(
    client: &reqwest::Client,
    fresh: &reqwest::Client,
    a: &BenchArgs,
    url: &str,
    body: &Value,
    retries: &mut usize,
) -> Result<reqwest::Response> {
    let mut attempt = 1;
    loop {
        let mut req = if attempt == 1 { client } else { fresh }.post(url).json(body);
        if let Some(k) = &a.api_key {
            req = req.bearer_auth(k);
        }
        match req.send().await {
            Ok(resp) => return Ok(resp),
            Err(e) if attempt < SEND_ATTEMPTS && failed_before_response(&e) => {
                attempt += 1;
                *retries += 1;
            }
            Err(e) => {
                let what = match attempt {
                    1 => "request failed".to_string(),
                    n => format!("request failed ({n} attempts)"),
                };
                return Err(anyhow::Error::new(e).context(what));
            }
        }
    }
}

async fn one_request(
    client: &reqwest::Client,
    fresh: &reqwest::Client,
    a: &BenchArgs,
    url: &str,
    body: Value,
    p: &BenchPrompt,
    t0: Instant,
) -> RequestRecord {
    let mut rec =
        RequestRecord { send: t0.elapsed().as_secs_f64(), prompt_tokens: p.prompt_tokens, ..Default::default() };
    let result: Result<()> = async {
        let resp = send_with_retries(client, fresh, a, url, &body, &mut rec.retries).await?;
        let status = resp.status();
        if !status.is_success() {
            let text = resp.text().await.unwrap_or_default();
            bail!("HTTP {}: {}", status.as_u16(), text.chars().take(300).collect::<String>());
        }
        let mut stream = resp.bytes_stream();
        let mut buf: Vec<u8> = Vec::new();
        let mut done = false;
        let mut usage_tokens = None;
        let mut text_chunks = 0;
        while let Some(bytes) = stream.next().await {
            let bytes = bytes.map_err(|e| anyhow!("stream broke: {e}"))?;
            let now = t0.elapsed().as_secs_f64();
            buf.extend_from_slice(&bytes);
            while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = buf.drain(..=nl).collect();
                let line = String::from_utf8_lossy(&line);
                let Some(data) = line.trim().strip_prefix("data:") else { continue };
                let data = data.trim();
                if data == "[DONE]" {
                    done = true;
                    continue;
                }
                let v: Value = serde_json::from_str(data).map_err(|e| anyhow!("bad chunk {data:?}: {e}"))?;
                if v.get("error").is_some() {
                    bail!("error in stream: {}", v["error"]);
                }
                if chunk_text(a.endpoint, &v).is_some() {
                    rec.chunks.push(now);
                    text_chunks += 1;
                }
                if let Some(u) = v["usage"].as_object() {
                    usage_tokens = u.get("completion_tokens").and_then(|x| x.as_u64());
                    if let Some(pt) = u.get("prompt_tokens").and_then(|x| x.as_u64()) {
                        rec.prompt_tokens = pt as usize;
                    }
                }
            }
        }
        if !done {
            bail!("stream ended without [DONE]");
        }
        rec.output_tokens = usage_tokens.map(|x| x as usize).unwrap_or(text_chunks);
        Ok(())
    }
    .await;
    rec.end = t0.elapsed().as_secs_f64();
    match result {
        Ok(()) => rec.success = true,
        Err(e) => rec.error = Some(format!("{e:#}")),
    }
    rec
}

async fn served_model(client: &reqwest::Client, a: &BenchArgs) -> Result<String> {
    if let Some(m) = &a.model {
        return Ok(m.clone());
    }
    let url = format!("{}/v1/models", a.base_url.trim_end_matches('/'));
    let mut req = client.get(&url);
    if let Some(k) = &a.api_key {
        req = req.bearer_auth(k);
    }
    let v: Value = req.send().await.with_context(|| url.clone())?.json().await.with_context(|| url.clone())?;
    v["data"][0]["id"].as_str().map(str::to_string).ok_or_else(|| anyhow!("{url} lists no model; pass --model"))
}

/// Runs the benchmark and returns its report (no printing).
pub async fn run_bench(a: &BenchArgs) -> Result<BenchReport> {
    let slo = Slo::parse(&a.goodput).map_err(anyhow::Error::msg)?;
    if a.num_prompts == 0 {
        bail!("--num-prompts must be positive");
    }
    if a.concurrency == Some(0) || a.request_rate.is_some_and(|r| r.is_nan() || r <= 0.0) {
        bail!("--concurrency and --request-rate must be positive");
    }
    let prompts = match &a.dataset {
        Some(p) => dataset_prompts(a, p)?,
        None => random_prompts(a)?,
    };
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs_f64(a.timeout))
        .build()
        .map_err(|e| anyhow!("HTTP client: {e}"))?;
    // For resends: no idle connections kept, so every request opens its own.
    let fresh = reqwest::Client::builder()
        .timeout(Duration::from_secs_f64(a.timeout))
        .pool_max_idle_per_host(0)
        .build()
        .map_err(|e| anyhow!("HTTP client: {e}"))?;
    let model = served_model(&client, a).await?;
    let path = match a.endpoint {
        Endpoint::Chat => "/v1/chat/completions",
        Endpoint::Completions => "/v1/completions",
    };
    let url = format!("{}{path}", a.base_url.trim_end_matches('/'));
    let limit = Arc::new(tokio::sync::Semaphore::new(a.concurrency.unwrap_or(tokio::sync::Semaphore::MAX_PERMITS)));
    let bar =
        if a.quiet { indicatif::ProgressBar::hidden() } else { indicatif::ProgressBar::new(prompts.len() as u64) };
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} requests [{elapsed_precise}]")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut rng = crate::sampling::Rng::new(a.seed ^ 0x5eed);
    let spec_before = spec_counters::scrape(&client, &a.base_url, a.api_key.as_deref()).await;
    let t0 = Instant::now();
    let mut next_send = 0.0f64;
    let mut tasks = Vec::with_capacity(prompts.len());
    for p in prompts {
        if let Some(rate) = a.request_rate {
            // Poisson process: exponential gaps with mean 1/rate.
            let wait = next_send - t0.elapsed().as_secs_f64();
            if wait > 0.0 {
                tokio::time::sleep(Duration::from_secs_f64(wait)).await;
            }
            next_send += -(1.0 - rng.uniform() as f64).ln() / rate;
        }
        let permit = limit.clone().acquire_owned().await.map_err(|e| anyhow!("{e}"))?;
        let (client, fresh, a2, url, bar) = (client.clone(), fresh.clone(), a.clone(), url.clone(), bar.clone());
        let body = request_body(a, &model, &p);
        tasks.push(tokio::spawn(async move {
            let r = one_request(&client, &fresh, &a2, &url, body, &p, t0).await;
            drop(permit);
            bar.inc(1);
            r
        }));
    }
    let mut records = Vec::with_capacity(tasks.len());
    for t in tasks {
        records.push(t.await.map_err(|e| anyhow!("request task: {e}"))?);
    }
    let duration = t0.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let summary = summarize(&records, duration, &slo);
    let spec_after = spec_counters::scrape(&client, &a.base_url, a.api_key.as_deref()).await;
    let spec_decode = match (spec_after, spec_before) {
        (Some(after), Some(before)) => Some(after.since(&before)),
        _ => None,
    };
    Ok(BenchReport { settings: a.clone(), model, summary, records, spec_decode })
}

/// The result table, in the layout of vLLM's serving benchmark.
pub fn format_table(r: &BenchReport) -> String {
    let s = &r.summary;
    let mut t = String::new();
    let line = |t: &mut String, k: &str, v: String| t.push_str(&format!("{k:<40}{v:>12}\n"));
    t.push_str(&format!("{:=^52}\n", " Serving Benchmark Result "));
    line(&mut t, "Successful requests:", s.completed.to_string());
    line(&mut t, "Failed requests:", s.failed.to_string());
    line(&mut t, "Retries on a fresh connection:", s.retries.to_string());
    line(&mut t, "Benchmark duration (s):", format!("{:.2}", s.duration_s));
    line(&mut t, "Total input tokens:", s.total_input_tokens.to_string());
    line(&mut t, "Total generated tokens:", s.total_output_tokens.to_string());
    line(&mut t, "Request throughput (req/s):", format!("{:.3}", s.request_throughput));
    if let Some(g) = s.goodput {
        line(&mut t, "Request goodput (req/s):", format!("{g:.3}"));
    }
    line(&mut t, "Output token throughput (tok/s):", format!("{:.2}", s.output_throughput));
    line(&mut t, "Total token throughput (tok/s):", format!("{:.2}", s.total_token_throughput));
    let block = |t: &mut String, title: &str, name: &str, st: &Stats| {
        t.push_str(&format!("{:-^52}\n", format!(" {title} ")));
        for (k, v) in [("Mean", st.mean), ("Median", st.median), ("P90", st.p90), ("P95", st.p95), ("P99", st.p99)] {
            t.push_str(&format!("{:<40}{:>12.2}\n", format!("{k} {name} (ms):"), v));
        }
    };
    block(&mut t, "Time to First Token", "TTFT", &s.ttft_ms);
    block(&mut t, "Time per Output Token (excl. 1st token)", "TPOT", &s.tpot_ms);
    block(&mut t, "Inter-token Latency", "ITL", &s.itl_ms);
    block(&mut t, "End-to-end Latency", "E2EL", &s.e2el_ms);
    if let Some(c) = r.spec_decode.as_ref().filter(|c| c.drafts > 0.0) {
        t.push_str(&format!("{:-^52}\n", " Speculative Decoding "));
        line(&mut t, "Drafts:", format!("{}", c.drafts));
        line(&mut t, "Draft tokens:", format!("{}", c.draft_tokens));
        line(&mut t, "Accepted tokens:", format!("{}", c.accepted_tokens));
        line(&mut t, "Acceptance rate (%):", format!("{:.2}", 100.0 * c.acceptance_rate()));
        line(&mut t, "Mean accepted length:", format!("{:.2}", c.mean_accepted_length()));
        let per: Vec<String> = c.accepted_per_position.iter().take(8).map(|v| format!("{v}")).collect();
        line(&mut t, "Accepted per position:", per.join(","));
    }
    t.push_str(&"=".repeat(52));
    t.push('\n');
    let failures: Vec<&str> = r.records.iter().filter_map(|x| x.error.as_deref()).take(5).collect();
    if !failures.is_empty() {
        t.push_str("first failures:\n");
        for f in failures {
            t.push_str(&format!("  {f}\n"));
        }
    }
    t
}

/// Writes the report as JSON (settings, summary, per-request records).
pub fn write_json(report: &BenchReport, path: &std::path::Path) -> Result<()> {
    std::fs::write(path, serde_json::to_string_pretty(report)?).with_context(|| format!("{}", path.display()))
}

pub fn run(args: BenchArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let report = rt.block_on(run_bench(&args))?;
    print!("{}", format_table(&report));
    if let Some(p) = &args.json_out {
        write_json(&report, p)?;
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}

#[cfg(test)]
mod fit_tests {
    use super::fit_words;

    #[test]
    fn prompts_of_multi_token_words_end_as_near_as_words_allow() {
        // Every word 3 tokens: 128 cannot be hit; it used to loop for ever around it.
        let count = |w: &[&str]| Ok(3 * w.len());
        let mut next = || "word";
        for start in [1, 10, 43, 60, 200] {
            let mut words = vec!["word"; start];
            let n = fit_words(&mut words, 128, count, &mut next).unwrap();
            assert_eq!((n, words.len()), (126, 42), "from {start} words");
        }
        let mut words = vec!["a"; 5];
        assert_eq!(fit_words(&mut words, 7, |w: &[&str]| Ok(w.len()), &mut || "b").unwrap(), 7);
        // Words of 1 and 2 tokens: another word is tried after one steps over, so 8 is hit.
        let mut words = vec!["aa"; 3];
        let count = |w: &[&str]| Ok(w.iter().map(|x| x.len()).sum());
        let mut k = 0;
        let mut next = || {
            k += 1;
            if k % 2 == 1 {
                "aa"
            } else {
                "a"
            }
        };
        assert_eq!(fit_words(&mut words, 7, count, &mut next).unwrap(), 7);
    }
}
