//! The OpenAI-compatible HTTP server against a real client (reqwest, raw TCP, the official
//! `openai` Python package), in-process on 127.0.0.1 with an ephemeral port. Most tests use
//! tiny-qwen2 (random weights: the text is noise, so they check properties: streaming ==
//! non-streaming, seeds reproduce, n greedy choices agree); SmolLM2 runs where a slow, real
//! model matters (a real answer, disconnects mid-generation, a full queue).

mod common;
use common::{smollm2, spawn_until_ready, tiny};

use futures_util::StreamExt;
use reqwest::StatusCode;
use serde_json::{json, Value};
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use torus_wgpu::config::EngineConfig;
use torus_wgpu::engine::metrics::MetricsSnapshot;
use torus_wgpu::engine::EngineHandle;
use torus_wgpu::server::{model_id_for_path, start, ServerConfig, ServerHandle};
use torus_wgpu::tokenizer::{ChatMessage, Tokenizer};

fn tiny_cfg() -> EngineConfig {
    EngineConfig {
        max_num_batched_tokens: 256,
        max_sequence_length: 512,
        total_cache_size: 8 << 20,
        max_decode_batch_size: 16,
        max_prefill_batch_size: 4,
        ..Default::default()
    }
}

async fn load_engine(path: &Path, cfg: &EngineConfig) -> EngineHandle {
    common::start_engine_async(path, cfg).await
}

struct Srv {
    handle: Option<ServerHandle>,
    base: String,
    http: reqwest::Client,
}

async fn serve_with(path: &Path, cfg: EngineConfig, f: impl FnOnce(&mut ServerConfig)) -> Srv {
    let engine = load_engine(path, &cfg).await;
    let mut scfg = ServerConfig::new(model_id_for_path(path), &cfg);
    f(&mut scfg);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let handle = start(listener, scfg, Some(engine)).unwrap();
    Srv { base: format!("http://{}", handle.addr), handle: Some(handle), http: client() }
}

async fn serve_tiny() -> Srv {
    serve_with(&tiny(), tiny_cfg(), |_| {}).await
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

/// A parsed SSE body: the JSON of every `data:` event before `[DONE]` (comments, such as the
/// keep-alive ones before the first token, are skipped).
fn parse_sse(text: &str) -> Vec<Value> {
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.trim().is_empty() && !e.starts_with(':')).collect();
    assert_eq!(events.last().copied(), Some("data: [DONE]"), "stream must end with [DONE]: {text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text:?}");
    events[..events.len() - 1]
        .iter()
        .map(|e| {
            let data = e.strip_prefix("data: ").unwrap_or_else(|| panic!("not a data event: {e:?}"));
            serde_json::from_str(data).unwrap_or_else(|err| panic!("bad JSON in {data:?}: {err}"))
        })
        .collect()
}

impl Srv {
    fn handle(&self) -> &ServerHandle {
        self.handle.as_ref().unwrap()
    }

    fn engine(&self) -> &EngineHandle {
        self.handle().engine().unwrap()
    }

    fn snapshot(&self) -> MetricsSnapshot {
        self.engine().metrics.snapshot()
    }

    async fn post(&self, path: &str, body: &Value) -> (StatusCode, Value) {
        let r = self.http.post(format!("{}{path}", self.base)).json(body).send().await.unwrap();
        let status = r.status();
        let text = r.text().await.unwrap();
        let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: non-JSON response {text:?}: {e}"));
        (status, v)
    }

    async fn ok(&self, path: &str, body: &Value) -> Value {
        let (s, v) = self.post(path, body).await;
        assert_eq!(s, StatusCode::OK, "{path} {body}: {v}");
        v
    }

    async fn get(&self, path: &str) -> (StatusCode, String) {
        let r = self.http.get(format!("{}{path}", self.base)).send().await.unwrap();
        (r.status(), r.text().await.unwrap())
    }

    async fn stream(&self, path: &str, body: &Value) -> Vec<Value> {
        let r = self.http.post(format!("{}{path}", self.base)).json(body).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        let ct = r.headers().get("content-type").unwrap().to_str().unwrap().to_string();
        assert!(ct.starts_with("text/event-stream"), "{ct}");
        parse_sse(&r.text().await.unwrap())
    }

    /// Waits (bounded) until the engine's counters satisfy `f`.
    async fn wait_until(&self, what: &str, f: impl Fn(&MetricsSnapshot) -> bool) -> MetricsSnapshot {
        let t = Instant::now();
        loop {
            let m = self.snapshot();
            if f(&m) {
                return m;
            }
            assert!(t.elapsed() < Duration::from_secs(60), "{what} never happened: {m:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits (bounded) until the engine is idle with every KV block free. (Only meaningful
    /// once the engine has seen the requests: its gauges are published after each step.)
    async fn wait_idle(&self) -> MetricsSnapshot {
        self.wait_until("idle", |m| m.running == 0 && m.waiting == 0 && m.kv_blocks_used == 0).await
    }

    async fn metric(&self, line_prefix: &str) -> f64 {
        let (s, text) = self.get("/metrics").await;
        assert_eq!(s, StatusCode::OK);
        text.lines()
            .find_map(|l| l.strip_prefix(line_prefix).and_then(|r| r.strip_prefix(' ')))
            .unwrap_or_else(|| panic!("{line_prefix} missing from /metrics:\n{text}"))
            .parse()
            .unwrap()
    }
}

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

fn content(v: &Value, i: usize) -> String {
    v["choices"][i]["message"]["content"].as_str().unwrap().to_string()
}

/// Concatenated chat deltas per choice index, and each index's finish reason.
fn stream_texts(chunks: &[Value], n: usize) -> (Vec<String>, Vec<String>) {
    let (mut texts, mut reasons) = (vec![String::new(); n], vec![String::new(); n]);
    for c in chunks {
        for ch in c["choices"].as_array().unwrap() {
            let i = ch["index"].as_u64().unwrap() as usize;
            if let Some(t) = ch["delta"]["content"].as_str().or(ch["text"].as_str()) {
                texts[i].push_str(t);
            }
            if let Some(r) = ch["finish_reason"].as_str() {
                assert!(reasons[i].is_empty(), "two finish reasons for choice {i}");
                reasons[i] = r.to_string();
            }
        }
    }
    (texts, reasons)
}

fn assert_usage_sums(u: &Value) {
    let p = u["prompt_tokens"].as_u64().unwrap();
    let c = u["completion_tokens"].as_u64().unwrap();
    assert_eq!(u["total_tokens"].as_u64().unwrap(), p + c, "{u}");
    assert!(u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() <= p, "{u}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_response_shape_and_usage() {
    let srv = serve_tiny().await;
    let tok = Tokenizer::from_hf_dir(&tiny()).unwrap();
    let prompt_len =
        tok.encode(&tok.apply_chat_template(&[ChatMessage::new("user", "Hello there")], true).unwrap()).unwrap().len()
            as u64;
    let v = srv
        .ok(
            "/v1/chat/completions",
            &json!({"model": "tiny-qwen2", "messages": user("Hello there"), "max_tokens": 8, "ignore_eos": true, "user": "x"}),
        )
        .await;
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"), "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "tiny-qwen2");
    assert!(v["created"].as_u64().unwrap() > 1_600_000_000);
    let ch = &v["choices"][0];
    assert_eq!(v["choices"].as_array().unwrap().len(), 1);
    assert_eq!(ch["index"], 0);
    assert_eq!(ch["message"]["role"], "assistant");
    assert!(ch["message"]["content"].is_string());
    assert_eq!(ch["finish_reason"], "length");
    assert!(ch["logprobs"].is_null());
    let u = &v["usage"];
    assert_eq!(u["prompt_tokens"].as_u64().unwrap(), prompt_len, "{u}");
    assert_eq!(u["completion_tokens"], 8);
    assert_usage_sums(u);

    // max_completion_tokens wins over max_tokens; a content array of text parts is accepted.
    let v = srv
        .ok(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}],
                    "max_tokens": 9, "max_completion_tokens": 3, "ignore_eos": true}),
        )
        .await;
    assert_eq!(v["usage"]["completion_tokens"], 3);
    assert_eq!(v["usage"]["prompt_tokens"].as_u64().unwrap(), prompt_len);
    // The same prompt again is served from the prefix cache (its full blocks).
    assert!(v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() >= 16, "{v}");

    // logit_bias +100 on one token makes greedy decoding pick it every time.
    let (id, piece) = (300..500u32)
        .map(|id| (id, tok.decode(&[id], false)))
        .find(|(_, s)| s.len() > 1 && s.chars().all(|c| c.is_ascii_alphabetic()))
        .unwrap();
    let v = srv
        .ok(
            "/v1/completions",
            &json!({"prompt": [1, 2, 3], "max_tokens": 5, "logit_bias": {id.to_string(): 100}, "logprobs": 0, "ignore_eos": true}),
        )
        .await;
    let toks = v["choices"][0]["logprobs"]["tokens"].as_array().unwrap();
    assert_eq!(toks.len(), 5);
    assert!(toks.iter().all(|t| t.as_str() == Some(piece.as_str())), "{v}");
    assert_eq!(v["choices"][0]["text"].as_str().unwrap(), piece.repeat(5));
    srv.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_equals_non_streaming() {
    let srv = serve_tiny().await;
    let body = json!({"messages": user("Tell me a story"), "max_tokens": 24, "temperature": 0});
    let whole = srv.ok("/v1/chat/completions", &body).await;
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let chunks = srv.stream("/v1/chat/completions", &sbody).await;
    let id = chunks[0]["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-"));
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk", "{c}");
        assert_eq!(c["id"], id);
        assert_eq!(c["model"], "tiny-qwen2");
        assert!(c.get("usage").is_some(), "with include_usage every chunk has a usage field: {c}");
    }
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant", "first delta has the role");
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"].as_array().unwrap().len(), 0, "usage chunk has no choices: {last}");
    for c in &chunks[..chunks.len() - 1] {
        assert!(c["usage"].is_null(), "{c}");
        assert_eq!(c["choices"].as_array().unwrap().len(), 1);
    }
    let (texts, reasons) = stream_texts(&chunks, 1);
    assert_eq!(texts[0], content(&whole, 0), "greedy streaming text differs from non-streaming");
    assert_eq!(reasons[0], whole["choices"][0]["finish_reason"].as_str().unwrap());
    let (su, wu) = (&last["usage"], &whole["usage"]);
    assert_usage_sums(su);
    assert_eq!(su["prompt_tokens"], wu["prompt_tokens"]);
    assert_eq!(su["completion_tokens"], wu["completion_tokens"]);

    // Without include_usage: no usage field, no usage chunk.
    let chunks = srv
        .stream("/v1/chat/completions", &json!({"messages": user("Tell me a story"), "max_tokens": 24, "stream": true}))
        .await;
    assert!(chunks.iter().all(|c| c.get("usage").is_none() && !c["choices"].as_array().unwrap().is_empty()));
    assert_eq!(stream_texts(&chunks, 1).0[0], content(&whole, 0));
    srv.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_prompts_echo_and_streaming() {
    let srv = serve_tiny().await;
    // Token-id prompt; OpenAI's default max_tokens is 16.
    let v = srv.ok("/v1/completions", &json!({"prompt": [5, 6, 7, 8, 9], "ignore_eos": true})).await;
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["prompt_tokens"], 5);
    assert_eq!(v["usage"]["completion_tokens"], 16);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert!(v["choices"][0]["text"].is_string());
    assert_usage_sums(&v["usage"]);

    // Two text prompts x n=2: four choices, prompt-major, each prompt counted once.
    let v = srv
        .ok(
            "/v1/completions",
            &json!({"prompt": ["The sky is", "Once upon a time, in a land far away"], "n": 2, "max_tokens": 6, "ignore_eos": true}),
        )
        .await;
    let ch = v["choices"].as_array().unwrap();
    assert_eq!(ch.len(), 4);
    for (i, c) in ch.iter().enumerate() {
        assert_eq!(c["index"], i);
    }
    assert_eq!(ch[0]["text"], ch[1]["text"], "greedy choices of one prompt agree");
    assert_eq!(ch[2]["text"], ch[3]["text"]);
    let one = srv.ok("/v1/completions", &json!({"prompt": "The sky is", "max_tokens": 6, "ignore_eos": true})).await;
    let two = srv
        .ok(
            "/v1/completions",
            &json!({"prompt": "Once upon a time, in a land far away", "max_tokens": 6, "ignore_eos": true}),
        )
        .await;
    assert_eq!(ch[0]["text"], one["choices"][0]["text"]);
    assert_eq!(ch[2]["text"], two["choices"][0]["text"]);
    let p = one["usage"]["prompt_tokens"].as_u64().unwrap() + two["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(v["usage"]["prompt_tokens"].as_u64().unwrap(), p);
    assert_eq!(v["usage"]["completion_tokens"], 24);

    // echo prepends the prompt; token-id prompts echo their decoded text.
    let v = srv
        .ok("/v1/completions", &json!({"prompt": "The sky is", "max_tokens": 6, "echo": true, "ignore_eos": true}))
        .await;
    assert_eq!(
        v["choices"][0]["text"].as_str().unwrap(),
        format!("The sky is{}", one["choices"][0]["text"].as_str().unwrap())
    );

    // Streaming completions: same text, chunks of object text_completion, usage at the end.
    let chunks = srv
        .stream(
            "/v1/completions",
            &json!({"prompt": "The sky is", "max_tokens": 6, "ignore_eos": true, "stream": true, "echo": true,
                    "stream_options": {"include_usage": true}}),
        )
        .await;
    assert!(chunks.iter().all(|c| c["object"] == "text_completion"));
    let (texts, reasons) = stream_texts(&chunks, 1);
    assert_eq!(texts[0], v["choices"][0]["text"].as_str().unwrap());
    assert_eq!(reasons[0], "length");
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 6);
    srv.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_and_unknown_model() {
    let srv = serve_with(&tiny(), tiny_cfg(), |s| s.served_model_name = "org/tiny-qwen2".into()).await;
    let (s, body) = srv.get("/v1/models").await;
    assert_eq!(s, StatusCode::OK);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"].as_array().unwrap().len(), 1);
    assert_eq!(v["data"][0]["id"], "org/tiny-qwen2");
    assert_eq!(v["data"][0]["object"], "model");
    let (s, body) = srv.get("/v1/models/org/tiny-qwen2").await;
    assert_eq!(s, StatusCode::OK, "{body}");
    let (s, _) = srv.get("/v1/models/tiny-qwen2").await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let v = srv
        .ok("/v1/chat/completions", &json!({"model": "org/tiny-qwen2", "messages": user("hi"), "max_tokens": 2}))
        .await;
    assert_eq!(v["model"], "org/tiny-qwen2");
    let (s, v) = srv.post("/v1/chat/completions", &json!({"model": "gpt-4", "messages": user("hi")})).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_eq!(v["error"]["code"], "model_not_found");
    assert_eq!(v["error"]["param"], "model");
    let (s, body) = srv.get("/health").await;
    assert_eq!((s, body.contains("ok")), (StatusCode::OK, true));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_share_the_prompt_prefill() {
    let srv = serve_tiny().await;
    let msgs = user("A prompt long enough to fill a few KV blocks of sixteen tokens each, so that sharing shows.");
    let one = srv.ok("/v1/chat/completions", &json!({"messages": msgs, "max_tokens": 10, "ignore_eos": true})).await;
    let prompt_len = one["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_len > 32, "{prompt_len}");
    // A different system prompt, so nothing of this prompt is cached yet.
    let msgs = json!([{"role": "system", "content": "Be brief."}, msgs[0]]);
    let before = srv.wait_idle().await;
    let v =
        srv.ok("/v1/chat/completions", &json!({"messages": msgs, "max_tokens": 10, "n": 4, "ignore_eos": true})).await;
    let after = srv.wait_idle().await;
    let ch = v["choices"].as_array().unwrap();
    assert_eq!(ch.len(), 4);
    let p = v["usage"]["prompt_tokens"].as_u64().unwrap();
    for (i, c) in ch.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["finish_reason"], "length");
        assert_eq!(c["message"]["content"], ch[0]["message"]["content"], "greedy choices differ");
    }
    assert_eq!(v["usage"]["completion_tokens"], 40, "completions summed");
    assert_eq!(v["usage"]["total_tokens"].as_u64().unwrap(), p + 40, "prompt counted once");
    // The prompt was prefilled once; the other three choices reused its full blocks.
    let computed = after.prefill_tokens - before.prefill_tokens;
    assert!(computed <= p + 3 * 16, "prefilled {computed} tokens for a {p}-token prompt with n=4");
    assert!(after.prefix_hits > before.prefix_hits);

    // Streaming n=3: every index gets its deltas and one finish reason.
    let chunks = srv
        .stream(
            "/v1/chat/completions",
            &json!({"messages": msgs, "max_tokens": 10, "n": 3, "ignore_eos": true, "stream": true}),
        )
        .await;
    let (texts, reasons) = stream_texts(&chunks, 3);
    for i in 0..3 {
        assert_eq!(texts[i], content(&v, 0));
        assert_eq!(reasons[i], "length");
    }
    srv.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_end_the_text() {
    let srv = serve_tiny().await;
    let body = json!({"prompt": "Stop words are tested here", "max_tokens": 40, "ignore_eos": true});
    let full = srv.ok("/v1/completions", &body).await["choices"][0]["text"].as_str().unwrap().to_string();
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() > 12, "{full:?}");
    // A stop string taken from the middle of the greedy text: the output is what came before
    // its first occurrence.
    for (k, len) in [(chars.len() / 2, 2), (5, 1)] {
        let stop: String = chars[k..k + len].iter().collect();
        let want = &full[..full.find(&stop).unwrap()];
        for stop_field in [json!(stop), json!(["\u{1F600}never", stop])] {
            let mut b = body.clone();
            b["stop"] = stop_field;
            let v = srv.ok("/v1/completions", &b).await;
            assert_eq!(v["choices"][0]["text"].as_str().unwrap(), want, "stop {stop:?}");
            assert_eq!(v["choices"][0]["finish_reason"], "stop");
            b["stream"] = json!(true);
            let (texts, reasons) = stream_texts(&srv.stream("/v1/completions", &b).await, 1);
            assert_eq!((texts[0].as_str(), reasons[0].as_str()), (want, "stop"));
        }
    }
    srv.wait_idle().await;
}

/// min_p = 1 keeps only the most likely token: sampling at temperature 1 is greedy (chat and
/// completions), while min_p = 0 at temperature 1 is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_p_one_samples_greedily() {
    let srv = serve_tiny().await;
    let chat = ("/v1/chat/completions", "messages", user("Tell me a story"));
    let comp = ("/v1/completions", "prompt", json!("Once upon a time"));
    for (path, key, prompt) in [chat, comp] {
        let text = |v: &Value| match key {
            "messages" => content(v, 0),
            _ => v["choices"][0]["text"].as_str().unwrap().to_string(),
        };
        let mut greedy = json!({"max_tokens": 16, "temperature": 0, "ignore_eos": true});
        greedy[key] = prompt;
        let want = text(&srv.ok(path, &greedy).await);
        let mut sampled = greedy.clone();
        sampled["temperature"] = json!(1.0);
        let mut differs = false;
        for seed in [1, 2, 3] {
            sampled["seed"] = json!(seed);
            sampled["min_p"] = json!(1.0);
            assert_eq!(text(&srv.ok(path, &sampled).await), want, "{path} seed {seed}: min_p 1 is not greedy");
            sampled["min_p"] = json!(0.0);
            differs |= text(&srv.ok(path, &sampled).await) != want;
        }
        assert!(differs, "{path}: temperature 1 without min_p was greedy for three seeds");
    }
    srv.wait_idle().await;
}

/// While a streamed request waits for its first token, the server sends SSE keep-alive
/// comments, and none after; the stream is otherwise what it would be. The wait here: a prompt
/// of about 450 tokens prefilled 8 tokens a step (some 60 steps, each a GPU submission and
/// read-back: tens of milliseconds on lavapipe), against a 2 ms interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_keepalive_comments_precede_the_first_token() {
    let cfg = EngineConfig { max_num_batched_tokens: 8, max_decode_batch_size: 4, ..tiny_cfg() };
    let srv = serve_with(&tiny(), cfg, |s| s.sse_keepalive = Some(Duration::from_millis(2))).await;
    let prompt: Vec<u32> = (0..480).map(|i| (i * 7) % 500).collect();
    let chat = ("/v1/chat/completions", json!({"messages": user(&"lorem ipsum dolor ".repeat(30))}));
    let comp = ("/v1/completions", json!({"prompt": prompt}));
    for (path, mut body) in [comp, chat] {
        body["max_tokens"] = json!(8);
        body["temperature"] = json!(0);
        body["ignore_eos"] = json!(true);
        // Streamed first: the prompt is not in the prefix cache yet.
        let mut sbody = body.clone();
        sbody["stream"] = json!(true);
        let t = Instant::now();
        let r = srv.http.post(format!("{}{path}", srv.base)).json(&sbody).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        let text = r.text().await.unwrap();
        eprintln!("{path}: {:?} for the stream", t.elapsed());
        let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
        let comments: Vec<usize> = (0..events.len()).filter(|&i| events[i].starts_with(':')).collect();
        assert!(!comments.is_empty(), "{path}: no keep-alive comment: {text}");
        assert!(comments.iter().all(|&i| events[i] == ": keep-alive"), "{path}: {text}");
        // The first event that carries generated text comes after every comment.
        let first_token = events
            .iter()
            .position(|e| {
                let Some(v) = e.strip_prefix("data: ").and_then(|d| serde_json::from_str::<Value>(d).ok()) else {
                    return false;
                };
                let c = &v["choices"][0];
                c["text"].as_str().or(c["delta"]["content"].as_str()).is_some_and(|t| !t.is_empty())
            })
            .unwrap_or_else(|| panic!("{path}: no text: {text}"));
        assert!(comments.iter().all(|&i| i < first_token), "{path}: a comment after the first token: {text}");
        let (texts, _) = stream_texts(&parse_sse(&text), 1);
        let whole = srv.ok(path, &body).await;
        let want = match path {
            "/v1/completions" => whole["choices"][0]["text"].as_str().unwrap().to_string(),
            _ => content(&whole, 0),
        };
        assert_eq!(texts[0], want, "{path}: the stream's text");
    }
    srv.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeds_reproduce_sampling() {
    let srv = serve_tiny().await;
    let body = |seed: u64| json!({"messages": user("Sample something"), "max_tokens": 24, "temperature": 1.0, "seed": seed, "ignore_eos": true});
    let a = content(&srv.ok("/v1/chat/completions", &body(42)).await, 0);
    let b = content(&srv.ok("/v1/chat/completions", &body(42)).await, 0);
    assert_eq!(a, b, "same seed, different text");
    let mut differs = false;
    for seed in [43, 44, 45] {
        differs |= content(&srv.ok("/v1/chat/completions", &body(seed)).await, 0) != a;
    }
    assert!(differs, "three other seeds all reproduced seed 42's text: sampling ignores the seed");
    // Streaming with the seed gives the same text; n seeded choices are reproducible too.
    let mut s = body(42);
    s["stream"] = json!(true);
    assert_eq!(stream_texts(&srv.stream("/v1/chat/completions", &s).await, 1).0[0], a);
    let mut n = body(7);
    n["n"] = json!(3);
    let x = srv.ok("/v1/chat/completions", &n).await;
    let y = srv.ok("/v1/chat/completions", &n).await;
    for i in 0..3 {
        assert_eq!(content(&x, i), content(&y, i));
    }
    assert!(content(&x, 0) != content(&x, 1) || content(&x, 1) != content(&x, 2), "seeded choices are all equal");
    assert_eq!(content(&x, 0), content(&srv.ok("/v1/chat/completions", &body(7)).await, 0), "choice 0 keeps the seed");
    srv.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_shapes() {
    let srv = serve_tiny().await;
    let v = srv
        .ok(
            "/v1/chat/completions",
            &json!({"messages": user("logprobs"), "max_tokens": 6, "ignore_eos": true, "logprobs": true, "top_logprobs": 3}),
        )
        .await;
    let content_lp = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content_lp.len(), 6, "one entry per generated token");
    for e in content_lp {
        let token = e["token"].as_str().unwrap();
        let lp = e["logprob"].as_f64().unwrap();
        assert!(lp <= 0.0);
        let bytes: Vec<u8> = e["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8).collect();
        if let Ok(s) = std::str::from_utf8(&bytes) {
            assert_eq!(s, token);
        }
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3, "{e}");
        for w in top.windows(2) {
            assert!(w[0]["logprob"].as_f64().unwrap() >= w[1]["logprob"].as_f64().unwrap(), "top not sorted: {e}");
        }
        for t in top {
            assert!(t["token"].is_string() && t["bytes"].is_array() && t["logprob"].as_f64().unwrap() <= 0.0);
        }
        // Greedy: the chosen token is the most likely one.
        assert_eq!(top[0]["token"], e["token"], "{e}");
        assert!((top[0]["logprob"].as_f64().unwrap() - lp).abs() < 1e-4, "{e}");
    }
    // logprobs without top_logprobs: empty top lists.
    let v = srv.ok("/v1/chat/completions", &json!({"messages": user("x"), "max_tokens": 2, "logprobs": true})).await;
    for e in v["choices"][0]["logprobs"]["content"].as_array().unwrap() {
        assert_eq!(e["top_logprobs"], json!([]));
    }
    // Streaming: each token's entry rides in its chunk, the same values as non-streaming.
    let chunks = srv
        .stream(
            "/v1/chat/completions",
            &json!({"messages": user("logprobs"), "max_tokens": 6, "ignore_eos": true, "logprobs": true, "top_logprobs": 3, "stream": true}),
        )
        .await;
    let streamed: Vec<Value> =
        chunks.iter().filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array()).flatten().cloned().collect();
    assert_eq!(streamed.len(), 6);
    for (a, b) in streamed.iter().zip(content_lp) {
        assert_eq!(a["token"], b["token"]);
    }
    // Legacy completions logprobs.
    let v =
        srv.ok("/v1/completions", &json!({"prompt": "abc", "max_tokens": 5, "ignore_eos": true, "logprobs": 2})).await;
    let lp = &v["choices"][0]["logprobs"];
    let tokens = lp["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), 5);
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 5);
    let offsets: Vec<u64> = lp["text_offset"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
    assert_eq!(offsets.len(), 5);
    assert_eq!(offsets[0], 0);
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]));
    for t in lp["top_logprobs"].as_array().unwrap() {
        let m = t.as_object().unwrap();
        assert!(!m.is_empty() && m.len() <= 2, "{t}");
    }
    srv.wait_idle().await;
}

/// `echo` with `logprobs` on /v1/completions (what lm-evaluation-harness's loglikelihood
/// requests send): the logprobs cover the prompt's tokens, the first with null entries, then the
/// generated ones; each prompt entry's top entries include the token itself; the offsets run over
/// the echoed text. Checked against independent requests: a prompt extended by its greedy next
/// token reports, for that token, the logprob a plain request got when generating it; the
/// generated part equals a request without echo; streaming carries the same entries (the echo
/// chunk holds the prompt's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_with_logprobs_scores_the_prompt() {
    let srv = serve_tiny().await;
    let comp = "/v1/completions";
    let tok = srv.ok("/tokenize", &json!({"prompt": "The sky is"})).await;
    let mut prompt = common::ids(&tok["tokens"]);
    let n = prompt.len();
    // The greedy next token and its logprob, straight from the engine.
    let (e, p) = (srv.engine().clone(), prompt.clone());
    let first = tokio::task::spawn_blocking(move || e.submit(common::greedy_req(&p, 1)).unwrap().collect_blocking())
        .await
        .unwrap();
    let g_lp = first.logprobs[0] as f64;
    prompt.push(first.ids[0]);
    let body = json!({"prompt": prompt, "max_tokens": 4, "ignore_eos": true, "logprobs": 2, "echo": true});
    let v = srv.ok(comp, &body).await;
    let c = &v["choices"][0];
    let lp = &c["logprobs"];
    let tokens = lp["tokens"].as_array().unwrap();
    let lps = lp["token_logprobs"].as_array().unwrap();
    let tops = lp["top_logprobs"].as_array().unwrap();
    let offsets: Vec<u64> = lp["text_offset"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
    assert_eq!((tokens.len(), lps.len(), tops.len(), offsets.len()), (n + 5, n + 5, n + 5, n + 5), "{lp}");
    assert!(lps[0].is_null() && tops[0].is_null(), "{lp}");
    assert_eq!(offsets[0], 0);
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");
    let text = c["text"].as_str().unwrap();
    let joined: String = tokens.iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(joined, text, "the tokens spell the echoed text and the completion");
    for k in 1..n + 1 {
        let l = lps[k].as_f64().unwrap();
        assert!(l <= 0.0, "{lp}");
        let top = tops[k].as_object().unwrap();
        assert!(top.len() >= 2 && top.len() <= 3, "{}", tops[k]);
        assert_eq!(top[tokens[k].as_str().unwrap()].as_f64().unwrap(), l, "the prompt token is among its top entries");
    }
    // The appended greedy token: the logprob a plain request reported for it.
    assert!((lps[n].as_f64().unwrap() - g_lp).abs() < 1e-4, "{} vs {g_lp}", lps[n]);
    // The generated part: as without echo.
    let mut no_echo = body.clone();
    no_echo["echo"] = json!(false);
    let w = srv.ok(comp, &no_echo).await;
    let wl = &w["choices"][0]["logprobs"];
    assert_eq!(tokens[n + 1..].to_vec(), *wl["tokens"].as_array().unwrap());
    for (a, b) in lps[n + 1..].iter().zip(wl["token_logprobs"].as_array().unwrap()) {
        assert!((a.as_f64().unwrap() - b.as_f64().unwrap()).abs() < 1e-4, "{a} vs {b}");
    }
    // Streamed: the echo chunk carries the prompt's entries, then one chunk per token.
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let chunks = srv.stream(comp, &sbody).await;
    let (mut st, mut sl, mut so) = (vec![], vec![], vec![]);
    let mut stext = String::new();
    for ch in &chunks {
        let c = &ch["choices"][0];
        stext.push_str(c["text"].as_str().unwrap_or(""));
        if let Some(l) = c["logprobs"].as_object() {
            st.extend(l["tokens"].as_array().unwrap().iter().cloned());
            sl.extend(l["token_logprobs"].as_array().unwrap().iter().cloned());
            so.extend(l["text_offset"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()));
        }
    }
    assert_eq!(stext, text);
    assert_eq!(st, *tokens);
    assert_eq!(so, offsets);
    assert!(sl[0].is_null());
    for (a, b) in sl[1..].iter().zip(&lps[1..]) {
        assert!((a.as_f64().unwrap() - b.as_f64().unwrap()).abs() < 1e-4, "{a} vs {b}");
    }
    srv.wait_idle().await;
}

/// Every sample of a Prometheus text exposition: `name{labels}` (as written) -> value; also
/// checks that each sample's family has a TYPE line.
fn prometheus_samples(text: &str) -> std::collections::BTreeMap<String, f64> {
    let typed: std::collections::BTreeSet<&str> =
        text.lines().filter_map(|l| l.strip_prefix("# TYPE ")).filter_map(|l| l.split(' ').next()).collect();
    let mut out = std::collections::BTreeMap::new();
    for l in text.lines().filter(|l| !l.starts_with('#') && !l.is_empty()) {
        let (key, value) = l.rsplit_once(' ').unwrap_or_else(|| panic!("bad sample line {l:?}"));
        let name = key.split('{').next().unwrap();
        let family =
            ["_bucket", "_sum", "_count"].iter().find_map(|s| name.strip_suffix(s)).filter(|f| typed.contains(f));
        assert!(typed.contains(name) || family.is_some(), "no TYPE line for {name}");
        out.insert(key.to_string(), value.parse::<f64>().unwrap_or_else(|e| panic!("{l:?}: {e}")));
    }
    out
}

/// vLLM's metric names beside ours (what routers, autoscalers and vLLM's dashboards read):
/// while requests queue and run, each vLLM-named gauge equals its `torus_*` twin in the same
/// scrape (waiting, running, KV-cache usage, blocks in `vllm:cache_config_info`), and some
/// scrape sees requests waiting; at the end they agree with the engine's state (idle, all
/// blocks free) and the counters and histograms count what was served (prompt and generated
/// tokens, finish reasons, token-based prefix-cache hits of the shared prompt). `/server_info`
/// reports the same KV cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_metric_names_agree_with_ours_and_the_engine() {
    // 16 KV blocks of 4 KiB (16 tokens x 2 layers x K,V x 32 values x f16): two or three of
    // the 100-token requests fit at once, the others wait.
    let cfg = EngineConfig { total_cache_size: 16 * 4096, ..tiny_cfg() };
    let srv = Arc::new(serve_with(&tiny(), cfg, |s| s.served_model_name = "tiny \"q\"".into()).await);
    let labels = "engine=\"0\",model_name=\"tiny \\\"q\\\"\"";
    // Six requests with one 40-token prompt (prefix-cache hits after the first).
    let prompt: Vec<u32> = (0..40).map(|i| (i * 7 % 500) as u32).collect();
    let mut tasks = Vec::new();
    for _ in 0..6 {
        let srv = srv.clone();
        let body = json!({"prompt": prompt, "max_tokens": 60, "ignore_eos": true});
        tasks.push(tokio::spawn(async move { srv.ok("/v1/completions", &body).await }));
    }
    let pairs = [
        ("vllm:num_requests_waiting", "torus_num_requests_waiting"),
        ("vllm:num_requests_running", "torus_num_requests_running"),
        ("vllm:kv_cache_usage_perc", "torus_kv_cache_usage_ratio"),
        ("vllm:gpu_cache_usage_perc", "torus_kv_cache_usage_ratio"),
    ];
    let mut saw_waiting = false;
    let t = Instant::now();
    while !tasks.iter().all(|t| t.is_finished()) {
        let (status, text) = srv.get("/metrics").await;
        assert_eq!(status, StatusCode::OK);
        let m = prometheus_samples(&text);
        for (v, ours) in pairs {
            assert_eq!(m[&format!("{v}{{{labels}}}")], m[ours], "{v} vs {ours}\n{text}");
        }
        let info = format!(
            "vllm:cache_config_info{{block_size=\"16\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"0\",num_gpu_blocks=\"{}\"}}",
            m["torus_kv_cache_blocks_total"]
        );
        assert_eq!(m.get(&info), Some(&1.0), "{info} missing:\n{text}");
        saw_waiting |= m["torus_num_requests_waiting"] > 0.0;
        assert!(t.elapsed() < Duration::from_secs(120));
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert!(saw_waiting, "no scrape saw a waiting request");
    let e = srv.wait_idle().await;
    let (_, text) = srv.get("/metrics").await;
    let m = prometheus_samples(&text);
    let v = |name: &str| m[&format!("{name}{{{labels}}}")];
    assert_eq!((v("vllm:num_requests_waiting"), v("vllm:num_requests_running")), (0.0, 0.0));
    assert_eq!((e.waiting, e.running, e.kv_blocks_used), (0, 0, 0));
    assert_eq!(v("vllm:kv_cache_usage_perc"), 0.0);
    assert_eq!(v("vllm:prompt_tokens_total"), 240.0);
    assert_eq!(v("vllm:prompt_tokens_total"), m["torus_prompt_tokens_total"]);
    assert_eq!(v("vllm:generation_tokens_total"), 360.0);
    assert_eq!(m[&format!("vllm:request_success_total{{{labels},finished_reason=\"length\"}}")], 6.0);
    assert_eq!(m[&format!("vllm:request_success_total{{{labels},finished_reason=\"stop\"}}")], 0.0);
    // Token-based prefix cache: every prompt queried whole; later ones hit its two full blocks.
    assert_eq!(v("vllm:prefix_cache_queries_total"), 240.0);
    // (Each later request found the two full blocks of the prompt, unless they were evicted.)
    let hits = v("vllm:prefix_cache_hits_total");
    assert!((32.0..=5.0 * 32.0).contains(&hits) && hits % 16.0 == 0.0, "{text}");
    for (name, count) in [
        ("vllm:e2e_request_latency_seconds", "torus_e2e_request_latency_seconds_count"),
        ("vllm:time_to_first_token_seconds", "torus_time_to_first_token_seconds_count"),
        ("vllm:inter_token_latency_seconds", "torus_inter_token_latency_seconds_count"),
    ] {
        assert_eq!(v(&format!("{name}_count")), m[count], "{name}");
    }
    assert_eq!(v("vllm:request_prompt_tokens_count"), 6.0);
    assert_eq!(v("vllm:request_prompt_tokens_sum"), 240.0);
    assert_eq!(v("vllm:request_generation_tokens_sum"), 360.0);
    assert_eq!(m[&format!("vllm:request_generation_tokens_bucket{{le=\"50\",{labels}}}")], 0.0);
    assert_eq!(m[&format!("vllm:request_generation_tokens_bucket{{le=\"100\",{labels}}}")], 6.0);
    // /server_info: the same KV cache.
    let (s, info) = srv.get("/server_info").await;
    assert_eq!(s, StatusCode::OK);
    let info: Value = serde_json::from_str(&info).unwrap();
    assert_eq!(info["num_gpu_blocks"].as_f64(), Some(m["torus_kv_cache_blocks_total"]), "{info}");
    assert_eq!((info["block_size"].as_u64(), info["served_model_name"].as_str()), (Some(16), Some("tiny \"q\"")));
    assert_eq!(info["max_model_len"].as_u64(), Some(srv.engine().info.max_model_len() as u64));
}

/// A bad request's status and OpenAI error shape.
fn assert_error(status: StatusCode, v: &Value, want: StatusCode, what: &str) {
    assert_eq!(status, want, "{what}: {v}");
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{what}: {v}");
    assert!(e["type"].is_string(), "{what}: {v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{what}: {v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors() {
    let srv = serve_with(&tiny(), tiny_cfg(), |s| s.max_request_body_bytes = 256 << 10).await;
    let chat = "/v1/chat/completions";
    let comp = "/v1/completions";
    let m = || user("hi");
    let long_prompt: Vec<u32> = (0..600).map(|i| i % 500).collect();
    let cases: Vec<(&str, Value, Option<&str>)> = vec![
        (chat, json!({}), Some("messages")),
        (chat, json!({"messages": []}), Some("messages")),
        (chat, json!({"messages": "hi"}), Some("messages")),
        (chat, json!({"messages": [{"role": "user", "content": 5}]}), Some("messages[0].content")),
        (chat, json!({"messages": [{"role": "wizard", "content": "x"}]}), Some("messages[0].role")),
        (chat, json!({"messages": [{"content": "x"}]}), Some("messages[0].role")),
        (chat, json!({"messages": m(), "temperature": -0.5}), Some("temperature")),
        (chat, json!({"messages": m(), "temperature": 2.5}), Some("temperature")),
        (chat, json!({"messages": m(), "temperature": "hot"}), Some("temperature")),
        (chat, json!({"messages": m(), "top_p": 0}), Some("top_p")),
        (chat, json!({"messages": m(), "top_p": 1.5}), Some("top_p")),
        (chat, json!({"messages": m(), "min_p": -0.1}), Some("min_p")),
        (chat, json!({"messages": m(), "min_p": 1.01}), Some("min_p")),
        (comp, json!({"prompt": "x", "min_p": "0.1"}), Some("min_p")),
        (chat, json!({"messages": m(), "n": 0}), Some("n")),
        (chat, json!({"messages": m(), "n": 17}), Some("n")),
        (chat, json!({"messages": m(), "n": 1.5}), Some("n")),
        (chat, json!({"messages": m(), "max_tokens": 0}), Some("max_tokens")),
        (chat, json!({"messages": m(), "max_completion_tokens": -1}), Some("max_completion_tokens")),
        (chat, json!({"messages": m(), "max_tokens": 10000}), Some("messages")),
        (chat, json!({"messages": m(), "logprobs": true, "top_logprobs": 21}), Some("top_logprobs")),
        (chat, json!({"messages": m(), "top_logprobs": 2}), Some("top_logprobs")),
        (chat, json!({"messages": m(), "logprobs": "yes"}), Some("logprobs")),
        (chat, json!({"messages": m(), "logit_bias": {"abc": 1}}), Some("logit_bias")),
        (chat, json!({"messages": m(), "logit_bias": {"5": 150}}), Some("logit_bias")),
        (chat, json!({"messages": m(), "logit_bias": {"99999": 1}}), Some("logit_bias")),
        (chat, json!({"messages": m(), "logit_bias": [1]}), Some("logit_bias")),
        (chat, json!({"messages": m(), "stop": 5}), Some("stop")),
        (chat, json!({"messages": m(), "stop": [""]}), Some("stop")),
        (chat, json!({"messages": m(), "stop": vec!["x"; 17]}), Some("stop")),
        (chat, json!({"messages": m(), "stop": "y".repeat(1025)}), Some("stop")),
        (chat, json!({"messages": m(), "stop_token_ids": vec![1; 65]}), Some("stop_token_ids")),
        (chat, json!({"messages": m(), "stop_token_ids": [-1]}), Some("stop_token_ids")),
        (chat, json!({"messages": m(), "seed": 1e30}), Some("seed")),
        (chat, json!({"messages": m(), "max_tokens": 1e300}), Some("max_tokens")),
        (chat, json!({"messages": m(), "request_timeout_s": 601}), Some("request_timeout_s")),
        (chat, json!({"messages": m(), "request_timeout_s": 0}), Some("request_timeout_s")),
        (chat, json!({"messages": m(), "presence_penalty": 3}), Some("presence_penalty")),
        (chat, json!({"messages": m(), "frequency_penalty": -2.5}), Some("frequency_penalty")),
        (chat, json!({"messages": m(), "seed": "x"}), Some("seed")),
        (chat, json!({"messages": m(), "stream": "yes"}), Some("stream")),
        (chat, json!({"messages": m(), "stream_options": {"include_usage": true}}), Some("stream_options")),
        (chat, json!({"messages": m(), "top_k": -2}), Some("top_k")),
        (
            chat,
            json!({"messages": m(), "tools": [{"type": "function", "function": {"name": "a f"}}]}),
            Some("tools[0].function.name"),
        ),
        (chat, json!({"messages": m(), "tool_choice": "required"}), Some("tool_choice")),
        (comp, json!({}), Some("prompt")),
        (comp, json!({"prompt": []}), Some("prompt")),
        (comp, json!({"prompt": [[]]}), Some("prompt")),
        (comp, json!({"prompt": [1, "a"]}), Some("prompt")),
        (comp, json!({"prompt": [1, 600]}), Some("prompt")),
        (comp, json!({"prompt": [-1]}), Some("prompt")),
        (comp, json!({"prompt": ""}), Some("prompt")),
        (comp, json!({"prompt": long_prompt}), Some("prompt")),
        (comp, json!({"prompt": [1, 2], "max_tokens": 511}), Some("prompt")),
        (comp, json!({"prompt": "x", "logprobs": 21}), Some("logprobs")),
        (comp, json!({"prompt": "x", "best_of": 3}), Some("best_of")),
        (comp, json!({"prompt": "x", "suffix": "y"}), Some("suffix")),
        (comp, json!({"prompt": "x", "stop": ["a", "b".repeat(2000)]}), Some("stop")),
        (comp, json!({"prompt": "x", "stop_token_ids": vec![0; 100]}), Some("stop_token_ids")),
        (comp, json!({"prompt": vec!["a"; 20], "n": 16}), Some("prompt")),
    ];
    let normal = json!({"messages": user("still fine?"), "max_tokens": 3, "ignore_eos": true});
    for (path, body, param) in &cases {
        let (s, v) = srv.post(path, body).await;
        assert_error(s, &v, StatusCode::BAD_REQUEST, &format!("{path} {body}"));
        assert_eq!(v["error"]["param"].as_str(), *param, "{path} {body}: {v}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        // A bad request never disturbs the next good one.
        let ok = srv.ok(chat, &normal).await;
        assert_eq!(ok["usage"]["completion_tokens"], 3);
    }
    let too_long = srv.post(comp, &json!({"prompt": long_prompt})).await;
    assert_eq!(too_long.1["error"]["code"], "context_length_exceeded");
    // With the prompt's length and the context beside OpenAI's fields, as llama-server's.
    let (s, v) = srv.post(comp, &json!({"prompt": long_prompt[..500], "max_tokens": 100})).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!((v["error"]["n_prompt_tokens"].as_u64(), v["error"]["n_ctx"].as_u64()), (Some(500), Some(512)), "{v}");

    // Raw bodies: malformed JSON, not an object, invalid UTF-8, empty, nesting past serde_json's
    // depth limit, lone surrogates and bad escapes, numbers past f64, too large (declared and
    // chunked).
    let deep = |n: usize| format!("{{\"messages\": {}{}}}", "[".repeat(n), "]".repeat(n)).into_bytes();
    let raw: Vec<(Vec<u8>, StatusCode)> = vec![
        (deep(200), StatusCode::BAD_REQUEST),
        (deep(100_000), StatusCode::BAD_REQUEST),
        (format!("{}{}", "{\"a\":".repeat(5000), "}".repeat(5000)).into_bytes(), StatusCode::BAD_REQUEST),
        (br#"{"messages": [{"role": "user", "content": "\ud800"}]}"#.to_vec(), StatusCode::BAD_REQUEST),
        (br#"{"messages": [{"role": "user", "content": "\udc00\ud800"}]}"#.to_vec(), StatusCode::BAD_REQUEST),
        (br#"{"messages": [{"role": "user", "content": "\uZZZZ"}]}"#.to_vec(), StatusCode::BAD_REQUEST),
        (
            br#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e400}"#.to_vec(),
            StatusCode::BAD_REQUEST,
        ),
        (br#"{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}"#.to_vec(), StatusCode::BAD_REQUEST),
        (
            br#"{"max_tokens": 2, "max_tokens": "x", "messages": [{"role": "user", "content": "hi"}]}"#.to_vec(),
            StatusCode::BAD_REQUEST,
        ),
        (b"{\"messages\": [".to_vec(), StatusCode::BAD_REQUEST),
        (b"[1, 2]".to_vec(), StatusCode::BAD_REQUEST),
        (b"{\"messages\": [{\"role\": \"user\", \"content\": \"\xff\xfe\"}]}".to_vec(), StatusCode::BAD_REQUEST),
        (b"".to_vec(), StatusCode::BAD_REQUEST),
        (vec![b' '; 300 << 10], StatusCode::PAYLOAD_TOO_LARGE),
    ];
    for (body, want) in raw {
        let r = srv
            .http
            .post(format!("{}{chat}", srv.base))
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await
            .unwrap();
        let s = r.status();
        let v: Value = r.json().await.unwrap();
        assert_error(s, &v, want, &format!("raw body of {} bytes", body.len()));
        srv.ok(chat, &normal).await;
    }
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> = (0..40).map(|_| Ok(vec![b' '; 16 << 10])).collect();
    let r = srv
        .http
        .post(format!("{}{chat}", srv.base))
        .header("content-type", "application/json")
        .body(reqwest::Body::wrap_stream(futures_util::stream::iter(chunks)))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_error(StatusCode::PAYLOAD_TOO_LARGE, &r.json().await.unwrap(), StatusCode::PAYLOAD_TOO_LARGE, "chunked");

    // Unknown routes and methods.
    let (s, body) = srv.get("/v1/nothing").await;
    assert_error(s, &serde_json::from_str(&body).unwrap(), StatusCode::NOT_FOUND, "unknown route");
    let (s, body) = srv.get(chat).await;
    assert_error(s, &serde_json::from_str(&body).unwrap(), StatusCode::METHOD_NOT_ALLOWED, "GET on a POST route");
    let (s, body) = srv.get("/v1/models/%ff%fe").await;
    assert_error(s, &serde_json::from_str(&body).unwrap(), StatusCode::NOT_FOUND, "model path that is not UTF-8");
    srv.ok(chat, &normal).await;
    assert!(srv.metric("torus_requests_total{status=\"400\"}").await >= cases.len() as f64);
    // Duplicate keys: the last one counts (as in Python's json).
    let dup =
        br#"{"max_tokens": "x", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": true, "max_tokens": 2}"#;
    let r = srv
        .http
        .post(format!("{}{chat}", srv.base))
        .header("content-type", "application/json")
        .body(dup.to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.json::<Value>().await.unwrap()["usage"]["completion_tokens"], 2);
    srv.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_is_required_on_v1() {
    let srv = serve_with(&tiny(), tiny_cfg(), |s| s.api_key = Some("sekrit".into())).await;
    let url = format!("{}/v1/chat/completions", srv.base);
    let body = json!({"messages": user("hi"), "max_tokens": 2});
    for auth in [None, Some("Bearer wrong"), Some("sekrit"), Some("Bearer sekri")] {
        let mut req = srv.http.post(&url).json(&body);
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        let r = req.send().await.unwrap();
        let s = r.status();
        let v: Value = r.json().await.unwrap();
        assert_error(s, &v, StatusCode::UNAUTHORIZED, &format!("{auth:?}"));
        assert_eq!(v["error"]["code"], "invalid_api_key");
    }
    let r = srv.http.post(&url).bearer_auth("sekrit").json(&body).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let r = srv.http.get(format!("{}/v1/models", srv.base)).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    // /tokenize and /detokenize are outside /v1 but need the key too (as vLLM's).
    for (path, body) in [("/tokenize", json!({"prompt": "hi"})), ("/detokenize", json!({"tokens": [1, 2]}))] {
        let url = format!("{}{path}", srv.base);
        let r = srv.http.post(&url).json(&body).send().await.unwrap();
        let s = r.status();
        assert_error(s, &r.json().await.unwrap(), StatusCode::UNAUTHORIZED, path);
        let r = srv.http.post(&url).bearer_auth("sekrit").json(&body).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK, "{path}");
    }
    // Health, metrics and version stay open (for probes and scrapers).
    assert_eq!(srv.get("/health").await.0, StatusCode::OK);
    assert_eq!(srv.get("/metrics").await.0, StatusCode::OK);
    assert_eq!(srv.get("/version").await.0, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_is_503_until_the_engine_is_set() {
    let cfg = tiny_cfg();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let handle = start(listener, ServerConfig::new("tiny-qwen2", &cfg), None).unwrap();
    let base = format!("http://{}", handle.addr);
    let http = client();
    let r = http.get(format!("{base}/health")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(r.headers().get("retry-after").is_some());
    let r =
        http.post(format!("{base}/v1/chat/completions")).json(&json!({"messages": user("hi")})).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(r.headers().get("retry-after").is_some());
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "model_loading");
    let m = http.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(m.contains("torus_model_loaded 0"), "{m}");

    assert!(handle.set_engine(load_engine(&tiny(), &cfg).await));
    let r = http.get(format!("{base}/health")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let r = http
        .post(format!("{base}/v1/chat/completions"))
        .json(&json!({"messages": user("hi"), "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    handle.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_clients_all_complete() {
    let srv = serve_tiny().await;
    let prompt = |i: usize| format!("Concurrent request number {} of a small load test.", i % 8);
    // Alone first: the reference greedy text of each distinct prompt.
    let mut reference = vec![];
    for i in 0..8 {
        reference.push(content(
            &srv.ok(
                "/v1/chat/completions",
                &json!({"messages": user(&prompt(i)), "max_tokens": 12, "ignore_eos": true}),
            )
            .await,
            0,
        ));
    }
    let ok_before = srv.handle().metrics().status_count(200);
    let results: Vec<(usize, Value)> = futures_util::stream::iter(0..64)
        .map(|i| {
            let (http, base) = (srv.http.clone(), srv.base.clone());
            let stream = i % 3 == 0;
            let body = json!({"messages": user(&prompt(i)), "max_tokens": 12, "ignore_eos": true, "stream": stream});
            async move {
                let r = http.post(format!("{base}/v1/chat/completions")).json(&body).send().await.unwrap();
                assert_eq!(r.status(), StatusCode::OK, "request {i}");
                let text = r.text().await.unwrap();
                let v = if stream {
                    let chunks = parse_sse(&text);
                    let (t, reasons) = stream_texts(&chunks, 1);
                    json!({"choices": [{"message": {"content": t[0]}, "finish_reason": reasons[0]}]})
                } else {
                    serde_json::from_str(&text).unwrap()
                };
                (i, v)
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    assert_eq!(results.len(), 64);
    let mut seen = [false; 64];
    for (i, v) in &results {
        seen[*i] = true;
        assert_eq!(content(v, 0), reference[i % 8], "request {i}: batched output differs from alone");
        assert!(v["choices"][0]["finish_reason"].is_string());
    }
    assert!(seen.iter().all(|&s| s));
    assert_eq!(srv.handle().metrics().status_count(200) - ok_before, 64);
    let m = srv.wait_idle().await;
    assert_eq!(m.requests_aborted + m.requests_failed, 0, "{m:?}");
    // Metrics exported.
    assert!(srv.metric("torus_requests_total{status=\"200\"}").await >= 72.0);
    assert_eq!(srv.metric("torus_time_to_first_token_seconds_count").await, 72.0);
    assert_eq!(srv.metric("torus_inter_token_latency_seconds_count").await, 72.0 * 11.0);
    assert_eq!(srv.metric("torus_e2e_request_latency_seconds_count").await, 72.0);
    assert_eq!(srv.metric("torus_kv_cache_blocks_used").await, 0.0);
    assert!(srv.metric("torus_kv_cache_blocks_total").await > 0.0);
    assert_eq!(srv.metric("torus_generation_tokens_total").await, 72.0 * 12.0);
    for name in [
        "torus_num_requests_waiting",
        "torus_num_requests_running",
        "torus_kv_cache_usage_ratio",
        "torus_prefix_cache_hit_rate",
        "torus_preemptions_total",
        "torus_prompt_tokens_total",
    ] {
        srv.metric(name).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_finishes_in_flight_streams() {
    let mut srv = serve_tiny().await;
    let r = srv
        .http
        .post(format!("{}/v1/completions", srv.base))
        .json(&json!({"prompt": "a long one", "max_tokens": 300, "ignore_eos": true, "stream": true,
                      "stream_options": {"include_usage": true}}))
        .send()
        .await
        .unwrap();
    let mut body = r.bytes_stream();
    let mut text = String::from_utf8(body.next().await.unwrap().unwrap().to_vec()).unwrap();
    let addr = srv.handle().addr;
    let shutdown = tokio::spawn(srv.handle.take().unwrap().shutdown());
    while let Some(b) = body.next().await {
        text.push_str(std::str::from_utf8(&b.unwrap()).unwrap());
    }
    let chunks = parse_sse(&text);
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 300, "the stream was cut short");
    tokio::time::timeout(Duration::from_secs(60), shutdown).await.expect("shutdown hangs").unwrap();
    assert!(tokio::net::TcpStream::connect(addr).await.is_err(), "still accepting after shutdown");
}

/// Sends a POST on a plain socket (dropping it closes the connection at once).
fn raw_send(addr: std::net::SocketAddr, path: &str, body: &str) -> std::net::TcpStream {
    let mut sock = std::net::TcpStream::connect(addr).unwrap();
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    sock.write_all(req.as_bytes()).unwrap();
    sock
}

/// [`raw_send`], then reads the response head (blocking).
fn raw_request(addr: std::net::SocketAddr, path: &str, body: &str) -> (std::net::TcpStream, String) {
    let mut sock = raw_send(addr, path, body);
    sock.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        assert_eq!(std::io::Read::read(&mut sock, &mut byte).unwrap(), 1, "connection closed in the head");
        head.push(byte[0]);
    }
    (sock, String::from_utf8_lossy(&head).into_owned())
}

/// SmolLM2 (slow on lavapipe, ~10 tokens/s): a real answer, disconnects mid-generation, and a
/// full queue, on one server with prefill in small chunks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smollm2_answers_disconnects_abort_and_queue_limit() {
    let path = smollm2();
    let cfg = EngineConfig {
        max_num_batched_tokens: 16,
        max_sequence_length: 1024,
        total_cache_size: 64 << 20,
        max_decode_batch_size: 4,
        max_prefill_batch_size: 2,
        ..Default::default()
    };
    let srv = serve_with(&path, cfg, |s| s.max_queued_requests = 1).await;
    let chat = format!("{}/v1/chat/completions", srv.base);

    // A real answer.
    let v = srv
        .ok("/v1/chat/completions", &json!({"messages": user("What is the capital of France?"), "max_tokens": 12}))
        .await;
    assert!(content(&v, 0).contains("Paris"), "{v}");

    // Non-streaming client disconnects while its request is decoding.
    let before = srv.wait_idle().await;
    let body =
        json!({"messages": user("Count from one to a thousand."), "max_tokens": 900, "ignore_eos": true}).to_string();
    let sock = raw_send(srv.handle().addr, "/v1/chat/completions", &body);
    let t = Instant::now();
    while srv.snapshot().decode_tokens < before.decode_tokens + 3 {
        assert!(t.elapsed() < Duration::from_secs(60), "request never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(srv.snapshot().running, 1);
    drop(sock);
    srv.wait_until("abort", |m| m.requests_aborted > before.requests_aborted).await;
    let m = srv.wait_idle().await;
    assert_eq!(m.requests_aborted, before.requests_aborted + 1, "{m:?}");
    assert_eq!(m.requests_finished, before.requests_finished, "{m:?}");
    assert_eq!(m.kv_blocks_used, 0);

    // Streaming client disconnects after the first tokens.
    let before = m;
    let r = srv
        .http
        .post(&chat)
        .json(&json!({"messages": user("Write a long essay."), "max_tokens": 900, "ignore_eos": true, "stream": true}))
        .send()
        .await
        .unwrap();
    let mut body = r.bytes_stream();
    let mut seen = String::new();
    while !seen.contains("\"content\":\"") || seen.matches("data: ").count() < 3 {
        seen.push_str(std::str::from_utf8(&body.next().await.unwrap().unwrap()).unwrap());
    }
    drop(body);
    srv.wait_until("abort", |m| m.requests_aborted > before.requests_aborted).await;
    let m = srv.wait_idle().await;
    assert_eq!(m.requests_aborted, before.requests_aborted + 1, "{m:?}");
    assert_eq!(m.requests_finished, before.requests_finished, "{m:?}");
    assert_eq!(m.kv_blocks_used, 0);

    // Queue limit 1: while a long prompt is still prefilling (16 tokens per step), a second
    // request is turned away with 503 and Retry-After; after the first leaves (its client
    // closes the connection), requests run again.
    let before = m;
    let long: Vec<u32> = (0..900).map(|i| 1000 + (i * 7) % 20000).collect();
    let body = json!({"prompt": long, "max_tokens": 100, "ignore_eos": true, "stream": true}).to_string();
    let addr = srv.handle().addr;
    let (first, head) = tokio::task::spawn_blocking(move || raw_request(addr, "/v1/completions", &body)).await.unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let r = srv.http.post(&chat).json(&json!({"messages": user("hi"), "max_tokens": 2})).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.headers().get("retry-after").unwrap(), "1");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "overloaded");
    drop(first);
    srv.wait_until("abort", |m| m.requests_aborted > before.requests_aborted).await;
    let m = srv.wait_idle().await;
    assert_eq!(m.requests_aborted, before.requests_aborted + 1, "{m:?}");
    assert_eq!(m.requests_finished, before.requests_finished, "{m:?}");
    let v = srv.ok("/v1/chat/completions", &json!({"messages": user("hi"), "max_tokens": 2})).await;
    assert_eq!(v["usage"]["completion_tokens"], 2);
    assert_eq!(srv.metric("torus_requests_rejected_overloaded_total").await, 1.0);
    // vLLM's counter counts the three disconnects as aborted.
    let (_, text) = srv.get("/metrics").await;
    let aborted: Vec<&str> = text.lines().filter(|l| l.contains("finished_reason=\"abort\"")).collect();
    assert!(aborted.len() == 1 && aborted[0].ends_with(" 3"), "{aborted:?}");
}

/// One request of many sequences holds at most a quarter of the queue: with room for 4, a
/// completions request of 12 prompts runs them in turn, and a chat request sent meanwhile is
/// admitted and answered before it ends (it used to take 12 places and leave others a 503).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_does_not_own_the_queue() {
    let cfg = EngineConfig { max_decode_batch_size: 2, max_prefill_batch_size: 1, ..tiny_cfg() };
    let srv = serve_with(&tiny(), cfg, |s| s.max_queued_requests = 4).await;
    let prompts: Vec<String> = (0..12).map(|i| format!("Prompt number {i}")).collect();
    // Long enough (12 x 400 tokens, two at a time: ~2400 steps) that the chat request, whose
    // preparation waits for a CPU on a loaded machine, arrives while it runs.
    let big = json!({"prompt": prompts, "max_tokens": 400, "ignore_eos": true, "temperature": 0});
    let (http, url) = (srv.http.clone(), format!("{}/v1/completions", srv.base));
    let big =
        tokio::spawn(async move { http.post(url).json(&big).send().await.unwrap().json::<Value>().await.unwrap() });
    srv.wait_until("the big request runs", |m| m.running > 0).await;
    let mut most_queued = 0.0f64;
    let v = srv.ok("/v1/chat/completions", &json!({"messages": user("hi"), "max_tokens": 2})).await;
    assert_eq!(v["usage"]["completion_tokens"], 2, "{v}");
    assert!(!big.is_finished(), "the chat request was not answered while the big one ran");
    while !big.is_finished() {
        most_queued = most_queued.max(srv.metric("torus_queued_requests").await);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(most_queued <= 1.0, "one request held {most_queued} queue places");
    let v = big.await.unwrap();
    let choices = v["choices"].as_array().unwrap_or_else(|| panic!("{v}"));
    assert_eq!(choices.len(), 12, "{v}");
    for (i, c) in choices.iter().enumerate() {
        assert_eq!((c["index"].as_u64(), c["finish_reason"].as_str()), (Some(i as u64), Some("length")), "{v}");
    }
    assert_eq!(v["usage"]["completion_tokens"], 12 * 400, "{v}");
    let m = srv.wait_idle().await;
    assert_eq!((m.requests_aborted, m.requests_failed, m.kv_blocks_used), (0, 0, 0), "{m:?}");
    assert_eq!(srv.metric("torus_queued_requests").await, 0.0);
}

/// `torus-wgpu serve` as a process: starts on port 0, logs where it listens, and on SIGTERM
/// finishes the in-flight stream and exits 0. With `--log-format json` the stream's access line
/// is JSON, written when the stream ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_serves_and_drains_on_sigterm() {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_torus-wgpu"));
    cmd.env_remove("RUST_LOG").args(["--log-format", "json", "serve", "--model"]).arg(tiny()).args([
        "--port",
        "0",
        "--total-cache-size",
        "8388608",
        "--max-sequence-length",
        "512",
        "--shutdown-grace-s",
        "120",
    ]);
    let (mut child, mut log, rx) = spawn_until_ready(&mut cmd, "serve", "ready on http://", Duration::from_secs(120));
    let addr =
        log.last().unwrap().split("ready on http://").nth(1).unwrap().split_whitespace().next().unwrap().to_string();
    assert!(log.iter().any(|l| l.contains("KV cache") && l.contains("blocks")), "{log:?}");
    let http = client();
    let r = http
        .post(format!("http://{addr}/v1/chat/completions"))
        .header("x-request-id", "sigterm-stream")
        .json(&json!({"messages": user("hi"), "max_tokens": 400, "ignore_eos": true, "stream": true,
                      "stream_options": {"include_usage": true}}))
        .send()
        .await
        .unwrap();
    let mut body = r.bytes_stream();
    let mut text = String::from_utf8(body.next().await.unwrap().unwrap().to_vec()).unwrap();
    let kill = std::process::Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(kill.success());
    while let Some(b) = body.next().await {
        text.push_str(std::str::from_utf8(&b.unwrap()).unwrap());
    }
    let chunks = parse_sse(&text);
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 400, "in-flight stream cut short");
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "server did not exit after SIGTERM");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // Until stderr closes.
    while let Ok(l) = rx.recv_timeout(Duration::from_secs(10)) {
        log.push(l);
    }
    assert_eq!(status.code(), Some(0), "{log:?}");
    assert!(!log.iter().any(|l| l.contains("panicked")), "{log:?}");
    let access: Vec<Value> = log
        .iter()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["target"] == "torus_wgpu::access" && v["request_id"] == "sigterm-stream")
        .collect();
    assert_eq!(access.len(), 1, "{log:?}");
    let a = &access[0];
    assert_eq!((a["status"].as_u64(), a["completion_tokens"].as_u64()), (Some(200), Some(400)), "{a}");
    assert_eq!(a["finish_reasons"], "length", "{a}");
}

/// Drives the server with the official `openai` Python package (tests/openai_e2e.py).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_client() {
    let srv = serve_tiny().await;
    let base = format!("{}/v1", srv.base);
    tokio::task::spawn_blocking(move || common::openai_e2e(&base, &[])).await.unwrap();
    srv.wait_idle().await;
}

/// SmolLM2 (~10 tokens/s on lavapipe) under a 2 s `request_timeout_s`: a long non-streaming
/// request is answered 408, a long stream ends with finish reason `abort`, an error event and
/// `[DONE]`; both engine requests are aborted and their KV blocks freed, and a short request
/// still succeeds. A request's own `request_timeout_s` may shorten the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smollm2_request_timeout_aborts_and_frees_blocks() {
    let path = smollm2();
    let cfg = EngineConfig {
        max_num_batched_tokens: 64,
        max_sequence_length: 1024,
        total_cache_size: 64 << 20,
        max_decode_batch_size: 4,
        max_prefill_batch_size: 2,
        ..Default::default()
    };
    let srv = serve_with(&path, cfg, |s| s.request_timeout = Some(Duration::from_secs(2))).await;
    let long = json!({"messages": user("Count from one to a thousand."), "max_tokens": 900, "ignore_eos": true});

    // Non-streaming: 408 in OpenAI's error shape.
    let before = srv.snapshot();
    let (s, v) = srv.post("/v1/chat/completions", &long).await;
    assert_error(s, &v, StatusCode::REQUEST_TIMEOUT, "non-streaming past the limit");
    assert_eq!(v["error"]["code"], "request_timeout", "{v}");
    assert_eq!(v["error"]["type"], "timeout_error", "{v}");
    srv.wait_until("abort", |m| m.requests_aborted > before.requests_aborted).await;
    let m = srv.wait_idle().await;
    assert_eq!(m.requests_aborted, before.requests_aborted + 1, "{m:?}");
    assert_eq!(m.requests_finished, before.requests_finished, "{m:?}");
    assert_eq!(m.kv_blocks_used, 0);

    // Streaming (legacy completions, n = 2): some text, then each choice finishes with
    // `abort`, then the error event, then [DONE].
    let before = m;
    let mut body = json!({"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": true, "n": 2});
    body["stream"] = json!(true);
    let r = srv.http.post(format!("{}/v1/completions", srv.base)).json(&body).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let text = r.text().await.unwrap();
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.trim().is_empty() && !e.starts_with(':')).collect();
    assert_eq!(events.last().copied(), Some("data: [DONE]"), "{text}");
    let err: Value = serde_json::from_str(events[events.len() - 2].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(err["error"]["code"], "request_timeout", "{text}");
    let chunks: Vec<Value> =
        events[..events.len() - 2].iter().map(|e| serde_json::from_str(&e["data: ".len()..]).unwrap()).collect();
    let (texts, reasons) = stream_texts(&chunks, 2);
    assert_eq!(reasons, vec!["abort", "abort"], "{text}");
    assert!(texts.iter().any(|t| !t.is_empty()), "no text before the limit: {text}");
    srv.wait_until("abort", |m| m.requests_aborted >= before.requests_aborted + 2).await;
    let m = srv.wait_idle().await;
    assert_eq!(m.requests_aborted, before.requests_aborted + 2, "{m:?}");
    assert_eq!(m.kv_blocks_used, 0);

    // A request's own, shorter limit.
    let mut short = long.clone();
    short["request_timeout_s"] = json!(0.5);
    let (s, v) = srv.post("/v1/chat/completions", &short).await;
    assert_error(s, &v, StatusCode::REQUEST_TIMEOUT, "per-request limit");
    assert!(v["error"]["message"].as_str().unwrap().contains("0.5 s"), "{v}");
    srv.wait_idle().await;

    // The next request runs normally.
    let v = srv.ok("/v1/completions", &json!({"prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": true})).await;
    assert_eq!(v["usage"]["completion_tokens"], 2);
    assert_eq!(srv.metric("torus_requests_timed_out_total").await, 3.0);
    // The engine publishes its gauges after each step: wait for the one after the last.
    srv.wait_idle().await;
    assert_eq!(srv.metric("torus_kv_cache_blocks_used").await, 0.0);
}

/// A server without a model (no engine needed for connection handling).
async fn serve_bare(f: impl FnOnce(&mut ServerConfig)) -> ServerHandle {
    let mut scfg = ServerConfig::new("none", &tiny_cfg());
    f(&mut scfg);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    start(listener, scfg, None).unwrap()
}

/// Reads until the peer closes (Ok) or `limit` passes without a byte (Err); returns what came.
fn read_to_close(sock: &mut std::net::TcpStream, limit: Duration) -> Result<Vec<u8>, std::io::Error> {
    sock.set_read_timeout(Some(limit)).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match std::io::Read::read(sock, &mut buf) {
            Ok(0) => return Ok(got),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Ok(got),
            Err(e) => return Err(e),
        }
    }
}

/// A client that sends half a request head, or nothing, is disconnected after the header-read
/// timeout; complete requests are unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_read_timeout_closes_stalled_connections() {
    let handle = serve_bare(|s| s.header_read_timeout = Some(Duration::from_secs(1))).await;
    let addr = handle.addr;
    let http = client();
    let metrics = format!("http://{addr}/metrics");
    assert_eq!(http.get(&metrics).send().await.unwrap().status(), StatusCode::OK);
    tokio::task::spawn_blocking(move || {
        let mut half = std::net::TcpStream::connect(addr).unwrap();
        half.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nUser-Agent: slow").unwrap();
        let mut silent = std::net::TcpStream::connect(addr).unwrap();
        let t = Instant::now();
        for (what, sock) in [("half a head", &mut half), ("nothing", &mut silent)] {
            let got = read_to_close(sock, Duration::from_secs(30))
                .unwrap_or_else(|e| panic!("a client that sent {what} was not disconnected: {e}"));
            let head = String::from_utf8_lossy(&got);
            assert!(got.is_empty() || head.starts_with("HTTP/1.1 408"), "{what}: {head}");
        }
        assert!(t.elapsed() >= Duration::from_millis(900), "closed before the timeout: {:?}", t.elapsed());
    })
    .await
    .unwrap();
    let r = http.get(&metrics).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert!(r.text().await.unwrap().contains("torus_http_connections"));
    handle.shutdown().await;
}

/// With `max_connections` 2 and two connections open, a third is served by the probe lane:
/// `/health` is answered, anything else 503 `too_many_connections`; one address holds at
/// most 4 probe places (then 429), each for at most a second without a request head; once a
/// main place is free, requests are served as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_cap_and_the_probe_lane() {
    let handle = serve_bare(|s| s.max_connections = 2).await;
    let addr = handle.addr;
    let open = || handle.metrics().connections.load(std::sync::atomic::Ordering::Relaxed);
    let held: Vec<std::net::TcpStream> = (0..2).map(|_| std::net::TcpStream::connect(addr).unwrap()).collect();
    let t = Instant::now();
    while open() < 2 {
        assert!(t.elapsed() < Duration::from_secs(30), "the first two connections were not accepted");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let ask = move |req: &'static [u8]| {
        tokio::task::spawn_blocking(move || {
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            s.write_all(req).unwrap();
            String::from_utf8_lossy(&read_to_close(&mut s, Duration::from_secs(10)).unwrap()).into_owned()
        })
    };
    // No model loaded: /health answers 503 model_loading, which is the point (it was served).
    let got = ask(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n").await.unwrap();
    assert!(got.starts_with("HTTP/1.1 503") && got.contains("model_loading"), "{got}");
    let got = ask(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n").await.unwrap();
    assert!(got.starts_with("HTTP/1.1 503") && got.contains("too_many_connections"), "{got}");
    assert!(got.to_ascii_lowercase().contains("retry-after: 1"), "{got}");
    // Four silent probe-lane connections from this address; a fifth is refused at once.
    let silent: Vec<std::net::TcpStream> = (0..4).map(|_| std::net::TcpStream::connect(addr).unwrap()).collect();
    let t = Instant::now();
    while open() < 6 {
        assert!(t.elapsed() < Duration::from_secs(10), "probe-lane connections not accepted: {}", open());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let got = ask(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n").await.unwrap();
    assert!(got.starts_with("HTTP/1.1 429"), "{got}");
    let silent = tokio::task::spawn_blocking(move || {
        let t = Instant::now();
        for mut s in silent {
            read_to_close(&mut s, Duration::from_secs(10)).expect("a silent probe-lane connection was kept");
        }
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    });
    silent.await.unwrap();
    // A main place comes free: a third connection is served normally.
    let mut held = held;
    drop(held.pop());
    let t = Instant::now();
    while open() > 1 {
        assert!(t.elapsed() < Duration::from_secs(30), "connections left open: {}", open());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let got = ask(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").await.unwrap();
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    drop(held);
    let t = Instant::now();
    while open() > 0 {
        assert!(t.elapsed() < Duration::from_secs(30), "connections left open: {}", open());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let r = client().get(format!("http://{addr}/metrics")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    handle.shutdown().await;
}

/// Shutdown does not wait for connections that have not sent a whole request (none sent
/// here: no header-read timeout would ever close them); they are closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_closes_connections_without_a_request() {
    let handle = serve_bare(|s| s.header_read_timeout = None).await;
    let addr = handle.addr;
    let mut silent = std::net::TcpStream::connect(addr).unwrap();
    let mut half = std::net::TcpStream::connect(addr).unwrap();
    half.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n").unwrap();
    let t = Instant::now();
    while handle.metrics().connections.load(std::sync::atomic::Ordering::Relaxed) < 2 {
        assert!(t.elapsed() < Duration::from_secs(30), "connections not accepted");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::timeout(Duration::from_secs(30), handle.shutdown()).await.expect("shutdown waits for idle clients");
    tokio::task::spawn_blocking(move || {
        for sock in [&mut silent, &mut half] {
            read_to_close(sock, Duration::from_secs(30)).expect("connection left open after shutdown");
        }
    })
    .await
    .unwrap();
    assert!(tokio::net::TcpStream::connect(addr).await.is_err(), "still accepting after shutdown");
}

/// An OPTIONS preflight for /v1/chat/completions from `origin`.
async fn preflight(http: &reqwest::Client, base: &str, origin: &str) -> reqwest::Response {
    http.request(reqwest::Method::OPTIONS, format!("{base}/v1/chat/completions"))
        .header("origin", origin)
        .header("access-control-request-method", "POST")
        .header("access-control-request-headers", "authorization,content-type")
        .send()
        .await
        .unwrap()
}

fn header<'a>(r: &'a reqwest::Response, name: &str) -> Option<&'a str> {
    r.headers().get(name).map(|v| v.to_str().unwrap())
}

fn cors_headers(r: &reqwest::Response) -> Vec<String> {
    r.headers().keys().map(|k| k.as_str().to_string()).filter(|k| k.starts_with("access-control-")).collect()
}

/// CORS (--allowed-origins): a preflight from an allowed origin is answered with the
/// Access-Control-Allow-* headers, one from another origin gets no Allow-Origin; `*` allows
/// any; by default no CORS header at all, and a preflight is a 4xx in OpenAI's shape, not a 5xx.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cors_preflight_and_allowed_origins() {
    let http = client();
    let handle =
        serve_bare(|s| s.allowed_origins = vec!["http://app.test:3000".into(), "https://other.test".into()]).await;
    let base = format!("http://{}", handle.addr);
    for origin in ["http://app.test:3000", "https://other.test"] {
        let r = preflight(&http, &base, origin).await;
        assert!(r.status().is_success(), "{}", r.status());
        assert_eq!(header(&r, "access-control-allow-origin"), Some(origin));
        let methods = header(&r, "access-control-allow-methods").unwrap().to_ascii_uppercase();
        assert!(["GET", "POST", "OPTIONS"].iter().all(|m| methods.contains(m)), "{methods}");
        let headers = header(&r, "access-control-allow-headers").unwrap().to_ascii_lowercase();
        assert!(headers.contains("authorization") && headers.contains("content-type"), "{headers}");
    }
    let r = preflight(&http, &base, "http://evil.test").await;
    assert_eq!(header(&r, "access-control-allow-origin"), None, "{:?}", r.headers());
    // Actual requests (here a 503: no model) carry the headers for allowed origins only, and
    // expose the request id to scripts.
    let r = http.get(format!("{base}/health")).header("origin", "http://app.test:3000").send().await.unwrap();
    assert_eq!(header(&r, "access-control-allow-origin"), Some("http://app.test:3000"));
    assert!(header(&r, "access-control-expose-headers").unwrap().contains("x-request-id"));
    let r = http.get(format!("{base}/health")).header("origin", "http://evil.test").send().await.unwrap();
    assert_eq!(header(&r, "access-control-allow-origin"), None);
    handle.shutdown().await;

    let handle = serve_bare(|s| s.allowed_origins = vec!["*".into()]).await;
    let r = preflight(&http, &format!("http://{}", handle.addr), "http://anything.test").await;
    assert!(r.status().is_success());
    assert_eq!(header(&r, "access-control-allow-origin"), Some("*"));
    handle.shutdown().await;

    // Default: no CORS.
    let handle = serve_bare(|_| {}).await;
    let base = format!("http://{}", handle.addr);
    let r = preflight(&http, &base, "http://app.test:3000").await;
    let status = r.status();
    assert!(cors_headers(&r).is_empty(), "{:?}", r.headers());
    assert_error(status, &r.json().await.unwrap(), StatusCode::METHOD_NOT_ALLOWED, "preflight without CORS");
    let r = http.get(format!("{base}/health")).header("origin", "http://app.test:3000").send().await.unwrap();
    assert!(cors_headers(&r).is_empty(), "{:?}", r.headers());
    handle.shutdown().await;

    // Origins that are not origins are refused at start.
    for bad in ["app.test", "http://app.test/", "ftp://app.test", "http://a b"] {
        let mut scfg = ServerConfig::new("none", &tiny_cfg());
        scfg.allowed_origins = vec![bad.into()];
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        assert!(start(listener, scfg, None).is_err(), "{bad}");
    }
}

/// `x-request-id`: a client's own id (visible ASCII, at most 128 characters) comes back;
/// otherwise the server makes one (32 hex digits), on every route and status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_ids_echoed_or_generated() {
    let handle = serve_bare(|_| {}).await;
    let base = format!("http://{}", handle.addr);
    let http = client();
    let get = |path: &'static str, id: Option<String>| {
        let mut req = http.get(format!("{base}{path}"));
        if let Some(id) = id {
            req = req.header("x-request-id", id);
        }
        async move { header(&req.send().await.unwrap(), "x-request-id").unwrap().to_string() }
    };
    let long = "r".repeat(128);
    for id in ["client-id-42", "a:b/c.d~e_f", long.as_str()] {
        assert_eq!(get("/health", Some(id.to_string())).await, id);
        assert_eq!(get("/no/such/route", Some(id.to_string())).await, id);
    }
    let is_generated = |s: &str| s.len() == 32 && s.bytes().all(|b| b.is_ascii_hexdigit());
    let mut seen = std::collections::HashSet::new();
    for id in [None, Some("has space".to_string()), Some("r".repeat(129)), Some(String::new())] {
        let got = get("/health", id.clone()).await;
        assert!(is_generated(&got), "{id:?} -> {got}");
        assert!(seen.insert(got), "ids repeat");
    }
    let r = http.post(format!("{base}/v1/chat/completions")).body("{").send().await.unwrap();
    assert!(is_generated(header(&r, "x-request-id").unwrap()));
    handle.shutdown().await;
}

/// Several served model names: any is accepted in `model`, /v1/models lists all, responses
/// report the first (as vLLM's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn served_model_name_aliases() {
    let srv = serve_with(&tiny(), tiny_cfg(), |s| {
        s.served_model_name = "first".into();
        s.model_aliases = vec!["second".into(), "org/third".into()];
    })
    .await;
    let (s, body) = srv.get("/v1/models").await;
    assert_eq!(s, StatusCode::OK);
    let v: Value = serde_json::from_str(&body).unwrap();
    let ids: Vec<&str> = v["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["first", "second", "org/third"]);
    for name in ["first", "second", "org/third"] {
        let (s, body) = srv.get(&format!("/v1/models/{name}")).await;
        assert_eq!(s, StatusCode::OK, "{body}");
        assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["id"], name);
        let v = srv.ok("/v1/chat/completions", &json!({"model": name, "messages": user("hi"), "max_tokens": 2})).await;
        assert_eq!(v["model"], "first", "{v}");
        let v = srv.ok("/v1/completions", &json!({"model": name, "prompt": "hi", "max_tokens": 2})).await;
        assert_eq!(v["model"], "first", "{v}");
        srv.ok("/tokenize", &json!({"model": name, "prompt": "hi"})).await;
    }
    let chunks = srv
        .stream(
            "/v1/chat/completions",
            &json!({"model": "second", "messages": user("hi"), "max_tokens": 2, "stream": true}),
        )
        .await;
    assert!(chunks.iter().all(|c| c["model"] == "first"));
    let (s, v) = srv.post("/v1/chat/completions", &json!({"model": "fourth", "messages": user("hi")})).await;
    assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::NOT_FOUND, Some("model_not_found")));
    assert_eq!(srv.get("/v1/models/fourth").await.0, StatusCode::NOT_FOUND);
}

/// /tokenize and /detokenize (vLLM's shapes) on SmolLM2: a round trip restores the text; a
/// prompt tokenizes as /v1/completions counts it and messages as /v1/chat/completions counts
/// them; bad input is a 400 in OpenAI's shape naming the field. Also GET /version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smollm2_tokenize_detokenize() {
    let path = smollm2();
    let cfg = EngineConfig {
        max_num_batched_tokens: 64,
        max_sequence_length: 1024,
        total_cache_size: 32 << 20,
        max_decode_batch_size: 2,
        max_prefill_batch_size: 1,
        ..Default::default()
    };
    let srv = serve_with(&path, cfg, |_| {}).await;
    let tok = Tokenizer::from_path(&path).unwrap();
    let text = "The quick brown fox jumps over the lazy dog.\nÜnïcödé ✓ 12345 <|im_start|>  tabs\tand  spaces";

    let v = srv.ok("/tokenize", &json!({"prompt": text, "add_special_tokens": false, "return_token_strs": true})).await;
    let tokens = common::ids(&v["tokens"]);
    assert_eq!(tokens, tok.encode_raw(text).unwrap());
    assert!(tokens.len() > 20, "{v}");
    assert_eq!(v["count"], tokens.len());
    assert_eq!(v["max_model_len"], 1024);
    let strs: Vec<String> = v["token_strs"].as_array().unwrap().iter().map(|s| s.as_str().unwrap().into()).collect();
    assert_eq!(strs.len(), tokens.len());
    assert_eq!(strs[0], tok.id_to_token(tokens[0]).unwrap());
    assert!(strs.contains(&"<|im_start|>".to_string()), "{strs:?}");
    let d = srv.ok("/detokenize", &json!({"tokens": tokens})).await;
    assert_eq!(d["prompt"], text);
    assert_eq!(srv.ok("/detokenize", &json!({"tokens": []})).await["prompt"], "");

    // A prompt, as /v1/completions counts it (add_special_tokens defaults to true).
    let t = srv.ok("/tokenize", &json!({"prompt": text})).await;
    assert!(t.get("token_strs").is_none(), "{t}");
    let c = srv.ok("/v1/completions", &json!({"prompt": text, "max_tokens": 1})).await;
    assert_eq!(t["count"], c["usage"]["prompt_tokens"], "{t} {c}");
    assert_eq!(common::ids(&t["tokens"]), tok.encode(text).unwrap());

    // Messages, as /v1/chat/completions counts them.
    let messages =
        json!([{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2+2?"}]);
    let t = srv.ok("/tokenize", &json!({"model": model_id_for_path(&path), "messages": messages})).await;
    let c = srv.ok("/v1/chat/completions", &json!({"messages": messages, "max_tokens": 1})).await;
    assert_eq!(t["count"], c["usage"]["prompt_tokens"], "{t} {c}");
    let msgs = [ChatMessage::new("system", "Answer briefly."), ChatMessage::new("user", "What is 2+2?")];
    assert_eq!(common::ids(&t["tokens"]), tok.encode(&tok.apply_chat_template(&msgs, true).unwrap()).unwrap());
    let no_gen = srv.ok("/tokenize", &json!({"messages": messages, "add_generation_prompt": false})).await;
    let (with, without) = (common::ids(&t["tokens"]), common::ids(&no_gen["tokens"]));
    assert!(without.len() < with.len() && with.starts_with(&without), "{with:?} {without:?}");
    let d = srv.ok("/detokenize", &json!({"tokens": with})).await;
    assert!(d["prompt"].as_str().unwrap().ends_with("<|im_start|>assistant\n"), "{d}");

    // Prefill: a final assistant message is continued (no end of turn, no new turn), as
    // llama-server does; `add_generation_prompt: true` answers it in a new turn instead.
    let prefill =
        json!([{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "The answer is"}]);
    let t = srv.ok("/tokenize", &json!({"messages": prefill})).await;
    let d = srv.ok("/detokenize", &json!({"tokens": t["tokens"]})).await;
    assert!(d["content"].as_str().unwrap().ends_with("<|im_start|>assistant\nThe answer is"), "{d}");
    let c = srv.ok("/v1/chat/completions", &json!({"messages": prefill, "max_tokens": 1})).await;
    assert_eq!(t["count"], c["usage"]["prompt_tokens"], "{t} {c}");
    let t = srv.ok("/tokenize", &json!({"messages": prefill, "add_generation_prompt": true})).await;
    let d = srv.ok("/detokenize", &json!({"tokens": t["tokens"]})).await;
    assert!(d["content"].as_str().unwrap().ends_with("The answer is<|im_end|>\n<|im_start|>assistant\n"), "{d}");
    let both = json!({"messages": prefill, "continue_final_message": true, "add_generation_prompt": true});
    let (s, v) = srv.post("/v1/chat/completions", &both).await;
    assert_eq!((s, v["error"]["param"].as_str()), (StatusCode::BAD_REQUEST, Some("continue_final_message")), "{v}");

    // llama-server's shapes: `content`, `add_special` (default false), `with_pieces`.
    let v = srv.ok("/tokenize", &json!({"content": text})).await;
    assert_eq!(common::ids(&v["tokens"]), tok.encode_raw(text).unwrap(), "{v}");
    let v = srv.ok("/tokenize", &json!({"content": text, "with_pieces": true})).await;
    let mut bytes = vec![];
    for t in v["tokens"].as_array().unwrap() {
        assert!(t["id"].is_u64(), "{t}");
        match &t["piece"] {
            Value::String(s) => bytes.extend(s.as_bytes()),
            Value::Array(a) => bytes.extend(a.iter().map(|b| b.as_u64().unwrap() as u8)),
            p => panic!("piece {p}"),
        }
    }
    assert_eq!(String::from_utf8(bytes).unwrap(), text);

    let vocab = tok.vocab_size();
    let bad: Vec<(&str, Value, &str)> = vec![
        ("/tokenize", json!({}), "prompt"),
        ("/tokenize", json!({"prompt": 5}), "prompt"),
        ("/tokenize", json!({"prompt": ["a"]}), "prompt"),
        ("/tokenize", json!({"prompt": "a", "messages": messages}), "messages"),
        ("/tokenize", json!({"messages": []}), "messages"),
        ("/tokenize", json!({"messages": [{"role": "nobody", "content": "x"}]}), "messages[0].role"),
        ("/tokenize", json!({"messages": messages, "continue_final_message": true}), "continue_final_message"),
        ("/tokenize", json!({"messages": messages, "tools": [{"type": "function"}]}), "tools[0].function"),
        ("/tokenize", json!({"prompt": "a", "add_special_tokens": "yes"}), "add_special_tokens"),
        ("/tokenize", json!({"prompt": "a", "return_token_strs": 1}), "return_token_strs"),
        ("/detokenize", json!({}), "tokens"),
        ("/detokenize", json!({"tokens": "1, 2"}), "tokens"),
        ("/detokenize", json!({"tokens": [1, -1]}), "tokens"),
        ("/detokenize", json!({"tokens": [1.5]}), "tokens"),
        ("/detokenize", json!({"tokens": [vocab]}), "tokens"),
        ("/detokenize", json!({"tokens": [1, "2"]}), "tokens"),
        ("/detokenize", json!({"tokens": [u64::MAX]}), "tokens"),
    ];
    for (route, body, param) in bad {
        let (s, v) = srv.post(route, &body).await;
        assert_error(s, &v, StatusCode::BAD_REQUEST, &format!("{route} {body}"));
        assert_eq!(v["error"]["param"], param, "{route} {body}: {v}");
    }
    for route in ["/tokenize", "/detokenize"] {
        let r = srv
            .http
            .post(format!("{}{route}", srv.base))
            .header("content-type", "application/json")
            .body("{\"prompt\": ")
            .send()
            .await
            .unwrap();
        let s = r.status();
        assert_error(s, &r.json().await.unwrap(), StatusCode::BAD_REQUEST, route);
        let (s, v) = srv.post(route, &json!({"model": "nope", "prompt": "a", "tokens": [1]})).await;
        assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::NOT_FOUND, Some("model_not_found")));
        assert_eq!(srv.get(route).await.0, StatusCode::METHOD_NOT_ALLOWED);
    }
    let (s, body) = srv.get("/version").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap(), json!({"version": env!("CARGO_PKG_VERSION")}));
}
