//! Property-based fuzzing of the HTTP server (proptest): batches of random requests to every
//! route (generation in every API's shape: OpenAI chat and completions, Anthropic Messages and
//! count_tokens, the Responses API, Ollama's chat and generate; embeddings, OpenAI's and
//! Ollama's; /tokenize, /detokenize, Ollama's
//! show and pull, and the GET routes, the chat page among them: valid-ish request skeletons
//! with random fields of wrong types, huge, negative and fractional numbers, long strings, big
//! arrays and maps; raw bodies with deep nesting, invalid escapes and lone surrogates, duplicate
//! keys, invalid UTF-8, truncation, garbage; wrong methods, content types and paths). Every
//! answer must be a 2xx or 4xx, or a 503, with a 4xx and 503 in its API's error shape (OpenAI's,
//! Anthropic's, Ollama's), streams well formed to their end in their API's framing, and carry
//! an `x-request-id`; after each batch a known-good request still succeeds; at the end the
//! engine is idle with every KV block free.
//!
//! One server (tiny-qwen2, short context) serves every case. The run is deterministic (fixed
//! seed, no failure file); `TORUS_FUZZ_SEED=N` picks another seed, `PROPTEST_CASES=N` sets the
//! number of batches.

mod common;
use common::api_shapes::{check_sse, dialect, is_error, Dialect};
use common::tiny;

use futures_util::StreamExt;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestError, TestRng, TestRunner};
use reqwest::{Method, StatusCode};
use serde_json::{json, Map, Value};
use std::time::{Duration, Instant};
use torus_wgpu::config::EngineConfig;
use torus_wgpu::server::{start, ServerConfig, ServerHandle};

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";
const TOKENIZE: &str = "/tokenize";
const DETOKENIZE: &str = "/detokenize";
const MESSAGES: &str = "/v1/messages";
const COUNT_TOKENS: &str = "/v1/messages/count_tokens";
const RESPONSES: &str = "/v1/responses";
const OLLAMA_CHAT: &str = "/api/chat";
const OLLAMA_GENERATE: &str = "/api/generate";
const OLLAMA_SHOW: &str = "/api/show";
const EMBEDDINGS: &str = "/v1/embeddings";
const OLLAMA_EMBED: &str = "/api/embed";
const LLAMA_COMPLETION: &str = "/completion";
const LLAMA_INFILL: &str = "/infill";
const APPLY_TEMPLATE: &str = "/apply-template";
/// The POST routes whose bodies must be declared JSON.
const POSTS: &[&str] = &[
    CHAT,
    COMPLETIONS,
    TOKENIZE,
    DETOKENIZE,
    MESSAGES,
    COUNT_TOKENS,
    RESPONSES,
    OLLAMA_CHAT,
    OLLAMA_GENERATE,
    OLLAMA_SHOW,
    EMBEDDINGS,
    OLLAMA_EMBED,
    LLAMA_COMPLETION,
    LLAMA_INFILL,
    APPLY_TEMPLATE,
];
/// The other routes the statistics name (the others count as "other").
const GETS: &[&str] = &[
    "/v1/models",
    "/health",
    "/metrics",
    "/version",
    "/server_info",
    "/api/tags",
    "/api/ps",
    "/api/version",
    "/",
    "/props",
];

/// Request fields the server reads (and some it does not).
const FIELDS: &[&str] = &[
    "model",
    "messages",
    "n_predict",
    "n_probs",
    "grammar",
    "json_schema",
    "input_prefix",
    "input_suffix",
    "input_extra",
    "mirostat",
    "response_fields",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "logit_bias",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "cache_salt",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "logprobs",
    "top_logprobs",
    "echo",
    "suffix",
    "best_of",
    "user",
    "request_timeout_s",
    "tokens",
    "add_special_tokens",
    "add_generation_prompt",
    "continue_final_message",
    "return_token_strs",
    "system",
    "stop_sequences",
    "thinking",
    "input",
    "instructions",
    "max_output_tokens",
    "text",
    "previous_response_id",
    "options",
    "format",
    "think",
    "raw",
    "images",
    "encoding_format",
    "dimensions",
];

/// Escapes that are not valid JSON string content, or decode to lone surrogates (and a few
/// valid ones).
const ESCAPES: &[&str] = &[
    r"\ud800",
    r"\udc00",
    r"\ud800\u0041",
    r"\udbff\udbff",
    r"\uZZZZ",
    r"\u12",
    r"\x41",
    r"\'",
    r"\ud83d\ude00",
    r"\u0000",
    "\\",
];

#[derive(Clone, Debug)]
enum Tweak {
    /// `"key": raw,` right after the opening brace (a duplicate key when the field is set).
    Splice(String, String),
    /// The first `"hi"` becomes a string holding this escape.
    Escape(&'static str),
    /// Cut the body to this fraction of its length.
    Truncate(f64),
    /// Bytes appended (garbage after the JSON).
    Append(Vec<u8>),
    /// Invalid UTF-8 in the middle.
    BadUtf8(f64),
}

#[derive(Clone)]
struct Case {
    method: Method,
    path: String,
    content_type: Option<&'static str>,
    body: Vec<u8>,
}

impl std::fmt::Debug for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let body = String::from_utf8_lossy(&self.body);
        let cut: String = body.chars().take(2000).collect();
        let more = if cut.len() < body.len() { format!("... ({} bytes)", self.body.len()) } else { String::new() };
        write!(f, "{} {} (content-type {:?}) {cut:?}{more}", self.method, self.path, self.content_type)
    }
}

fn leaf() -> BoxedStrategy<Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        (0i64..8).prop_map(|n| json!(n)),
        (-3i64..3).prop_map(|n| json!(n)),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        prop::sample::select(vec![
            0.0,
            -0.0,
            0.5,
            1.0,
            1.5,
            2.5,
            -1.0,
            1e-300,
            1e15,
            9.007_199_254_740_993e15,
            1e19,
            1e300,
            -1e300,
            f64::MAX,
            f64::MIN_POSITIVE
        ])
        .prop_map(|x| json!(x)),
        any::<f64>().prop_filter("finite", |x| x.is_finite()).prop_map(|x| json!(x)),
        "[a-z ]{0,12}".prop_map(Value::String),
        any::<String>().prop_map(Value::String),
        prop::sample::select(vec!["NaN", "Infinity", "-inf", "1e400", "", "\u{0}", "é", "<|im_end|>", "user", "text"])
            .prop_map(|s| json!(s)),
        (1usize..100_000, "[a-zé ]{1,3}").prop_map(|(n, s)| Value::String(s.repeat(n / s.len().max(1) + 1))),
    ]
    .boxed()
}

/// Nested JSON values (a few levels), big arrays and big maps.
fn value() -> BoxedStrategy<Value> {
    let key = prop_oneof![prop::sample::select(FIELDS).prop_map(str::to_string), "[a-z0-9]{0,6}", any::<String>()];
    let nested = leaf().prop_recursive(4, 48, 8, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            prop::collection::vec((key.clone(), inner), 0..8)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<String, Value>>())),
            // Chat messages of random shapes.
            (prop::sample::select(vec!["user", "system", "assistant", "developer", "tool", "x"]), leaf())
                .prop_map(|(r, c)| json!([{"role": r, "content": c}])),
        ]
    });
    prop_oneof![
        4 => nested,
        1 => (leaf(), 0usize..300).prop_map(|(v, n)| Value::Array(vec![v; n])),
        1 => (0usize..400, leaf()).prop_map(|(n, v)| {
            Value::Object((0..n).map(|i| ((i * 37 % 1000).to_string(), v.clone())).collect())
        }),
    ]
    .boxed()
}

/// Arrays or objects nested `depth` deep, as text.
fn deep() -> impl Strategy<Value = String> {
    (1usize..1000, any::<bool>()).prop_map(|(depth, arrays)| {
        if arrays {
            format!("{}1{}", "[".repeat(depth), "]".repeat(depth))
        } else {
            format!("{}1{}", "{\"a\":".repeat(depth), "}".repeat(depth))
        }
    })
}

fn tweak() -> impl Strategy<Value = Tweak> {
    prop_oneof![
        3 => (prop::sample::select(FIELDS), value()).prop_map(|(k, v)| Tweak::Splice(k.to_string(), v.to_string())),
        2 => (prop::sample::select(FIELDS), deep()).prop_map(|(k, d)| Tweak::Splice(k.to_string(), d)),
        2 => prop::sample::select(ESCAPES).prop_map(Tweak::Escape),
        1 => (0.0f64..1.0).prop_map(Tweak::Truncate),
        1 => prop::collection::vec(any::<u8>(), 1..40).prop_map(Tweak::Append),
        1 => (0.0f64..1.0).prop_map(Tweak::BadUtf8),
    ]
}

/// A JSON body for one of the generation routes (any API): a good request, some fields set
/// to random values or removed, then raw-text tweaks.
fn generation_body() -> impl Strategy<Value = (&'static str, Vec<u8>)> {
    let edit = (prop::sample::select(FIELDS), prop::option::weighted(0.85, value()));
    (
        0u8..13,
        1u32..6,
        prop::bool::weighted(0.25),
        prop::collection::vec(edit, 0..4),
        prop::collection::vec(tweak(), 0..3),
        prop::bool::weighted(0.5),
    )
        .prop_map(|(kind, max_tokens, stream, edits, tweaks, tweak_it)| {
            let user = json!([{"role": "user", "content": "hi"}]);
            let (path, mut v) = match kind {
                0 | 1 => (CHAT, json!({"messages": user, "max_tokens": max_tokens})),
                2 => (COMPLETIONS, json!({"prompt": "hi", "max_tokens": max_tokens})),
                3 => (MESSAGES, json!({"messages": user, "max_tokens": max_tokens, "system": "s"})),
                4 => (COUNT_TOKENS, json!({"messages": user})),
                5 => (RESPONSES, json!({"input": "hi", "max_output_tokens": max_tokens})),
                6 => (OLLAMA_CHAT, json!({"messages": user, "options": {"num_predict": max_tokens}})),
                7 => (OLLAMA_GENERATE, json!({"prompt": "hi", "options": {"num_predict": max_tokens}})),
                8 => (EMBEDDINGS, json!({"input": ["hi", "there"], "dimensions": max_tokens})),
                9 => (OLLAMA_EMBED, json!({"input": "hi"})),
                10 => (LLAMA_COMPLETION, json!({"prompt": "hi", "n_predict": max_tokens, "n_probs": 2})),
                11 => (LLAMA_INFILL, json!({"input_prefix": "def f(", "input_suffix": ")", "n_predict": max_tokens})),
                _ => (APPLY_TEMPLATE, json!({"messages": user})),
            };
            // Ollama streams unless told not to.
            if path.starts_with("/api/") {
                v["stream"] = json!(stream);
            } else if stream {
                v["stream"] = json!(true);
            }
            let o = v.as_object_mut().unwrap();
            for (k, val) in edits {
                match val {
                    Some(val) => o.insert(k.to_string(), val),
                    None => o.remove(k),
                };
            }
            let mut body = serde_json::to_vec(&v).unwrap();
            if tweak_it {
                for t in &tweaks {
                    body = apply(body, t);
                }
            }
            (path, body)
        })
}

/// A JSON body for /tokenize (a prompt or messages) or /detokenize (token ids): a good request,
/// some fields set to random values or removed, then raw-text tweaks.
fn tokenizer_body() -> impl Strategy<Value = (&'static str, Vec<u8>)> {
    let edit = (prop::sample::select(FIELDS), prop::option::weighted(0.85, value()));
    (
        0u8..3,
        prop::collection::vec(0u32..520, 0..40),
        prop::collection::vec(edit, 0..4),
        prop::collection::vec(tweak(), 0..3),
        prop::bool::weighted(0.5),
    )
        .prop_map(|(kind, ids, edits, tweaks, tweak_it)| {
            let (path, mut v) = match kind {
                0 => (TOKENIZE, json!({"prompt": "hi", "return_token_strs": true})),
                1 => {
                    (TOKENIZE, json!({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": true}))
                }
                _ => (DETOKENIZE, json!({"tokens": ids, "prompt": "hi"})),
            };
            let o = v.as_object_mut().unwrap();
            for (k, val) in edits {
                match val {
                    Some(val) => o.insert(k.to_string(), val),
                    None => o.remove(k),
                };
            }
            let mut body = serde_json::to_vec(&v).unwrap();
            if tweak_it {
                for t in &tweaks {
                    body = apply(body, t);
                }
            }
            (path, body)
        })
}

fn apply(mut body: Vec<u8>, t: &Tweak) -> Vec<u8> {
    match t {
        Tweak::Splice(k, raw) => {
            if body.first() == Some(&b'{') {
                let mut out = format!("{{{}: {raw},", Value::String(k.clone())).into_bytes();
                out.extend_from_slice(&body[1..]);
                if body.len() == 2 {
                    out.pop(); // `{}`: no trailing comma before `}`.
                    out.push(b'}');
                }
                return out;
            }
            body
        }
        Tweak::Escape(e) => {
            let text = String::from_utf8_lossy(&body).into_owned();
            text.replacen("\"hi\"", &format!("\"h{e}i\""), 1).into_bytes()
        }
        Tweak::Truncate(f) => {
            body.truncate((body.len() as f64 * f) as usize);
            body
        }
        Tweak::Append(g) => {
            body.extend_from_slice(g);
            body
        }
        Tweak::BadUtf8(f) => {
            let at = (body.len() as f64 * f) as usize;
            body.splice(at..at, [0xff, 0xfe, 0xc3]);
            body
        }
    }
}

fn case() -> impl Strategy<Value = Case> {
    // Mostly JSON, so that the fields are fuzzed; the other types must be 415.
    let content_type = prop::sample::select(vec![
        Some("application/json"),
        Some("application/json"),
        Some("application/json"),
        Some("application/json; charset=utf-8"),
        Some("text/plain"),
        Some("multipart/form-data; boundary=x"),
        None,
    ]);
    let generation = (generation_body(), content_type.clone()).prop_map(|((path, body), ct)| Case {
        method: Method::POST,
        path: path.into(),
        content_type: ct,
        body,
    });
    let tokenizer = (tokenizer_body(), content_type.clone()).prop_map(|((path, body), ct)| Case {
        method: Method::POST,
        path: path.into(),
        content_type: ct,
        body,
    });
    let raw_post = (
        prop::sample::select(POSTS.to_vec()),
        prop_oneof![
            prop::collection::vec(any::<u8>(), 0..300),
            deep().prop_map(String::into_bytes),
            Just(Vec::new()),
            Just(b"null".to_vec()),
            Just(b"[]".to_vec()),
            Just(b"\"hi\"".to_vec()),
            Just(br#"{"messages": [{"role": "user", "content": "\ud800"}]}"#.to_vec()),
            Just(br#"{"prompt": "\uDFFF", "max_tokens": 2}"#.to_vec()),
            Just(br#"{"prompt": "a", "max_tokens": 2, "max_tokens": -5}"#.to_vec()),
        ],
        content_type,
    )
        .prop_map(|(path, body, ct)| Case { method: Method::POST, path: path.into(), content_type: ct, body });
    let gets = prop_oneof![
        prop::sample::select(vec![
            "/v1/models",
            "/health",
            "/metrics",
            "/version",
            "/server_info",
            "/v1/models/tiny-qwen2",
            "/",
            "/v1",
            "/api/tags",
            "/api/ps",
            "/api/version",
            "/api/nothing",
        ])
        .prop_map(str::to_string),
        "[a-zA-Z0-9%._~-]{0,24}".prop_map(|s| format!("/v1/models/{s}")),
        "[a-zA-Z0-9%._~/-]{0,24}".prop_map(|s| format!("/{s}")),
    ];
    let other = (
        prop::sample::select(vec![
            Method::GET,
            Method::POST,
            Method::PUT,
            Method::DELETE,
            Method::PATCH,
            Method::HEAD,
            Method::OPTIONS,
        ]),
        prop::sample::select(vec![
            CHAT,
            COMPLETIONS,
            TOKENIZE,
            DETOKENIZE,
            "/v1/models",
            "/health",
            "/metrics",
            "/version",
            "/server_info",
            "/v1/models/x",
        ]),
        prop::collection::vec(any::<u8>(), 0..64),
    )
        .prop_map(|(method, path, body)| Case { method, path: path.into(), content_type: None, body });
    prop_oneof![
        6 => generation,
        2 => tokenizer,
        2 => raw_post,
        1 => gets.prop_map(|path| Case { method: Method::GET, path, content_type: None, body: vec![] }),
        1 => other,
    ]
}

struct Server {
    handle: ServerHandle,
    base: String,
    http: reqwest::Client,
}

async fn serve() -> Server {
    let cfg = EngineConfig {
        max_num_batched_tokens: 256,
        // Short generations: whatever a fuzzed request asks for, it ends soon.
        max_sequence_length: 128,
        total_cache_size: 8 << 20,
        max_decode_batch_size: 16,
        max_prefill_batch_size: 4,
        ..Default::default()
    };
    let path = tiny();
    let engine = common::start_engine_async(&path, &cfg).await;
    engine.enable_embeddings().expect("embeddings on");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let scfg = ServerConfig::new("tiny-qwen2", &cfg);
    let handle = start(listener, scfg, Some(engine)).unwrap();
    let base = format!("http://{}", handle.addr);
    let http = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(120)).build().unwrap();
    Server { handle, base, http }
}

fn check(cond: bool, what: impl FnOnce() -> String) -> Result<(), TestCaseError> {
    if cond {
        Ok(())
    } else {
        Err(TestCaseError::fail(what()))
    }
}

/// Sends one case and checks the answer; returns the status.
async fn send(srv: &Server, c: &Case) -> Result<u16, TestCaseError> {
    let mut req = srv.http.request(c.method.clone(), format!("{}{}", srv.base, c.path)).body(c.body.clone());
    if let Some(ct) = c.content_type {
        req = req.header("content-type", ct);
    }
    let what = || format!("{} {} {:?}", c.method, c.path, String::from_utf8_lossy(&c.body[..c.body.len().min(300)]));
    let r = req.send().await.map_err(|e| TestCaseError::fail(format!("{}: no response: {e}", what())))?;
    let status = r.status();
    check(r.headers().contains_key("x-request-id"), || format!("{}: no x-request-id", what()))?;
    let ct = r.headers().get("content-type").map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    let ct = ct.unwrap_or_default();
    let text = r.text().await.map_err(|e| TestCaseError::fail(format!("{}: body cut: {e}", what())))?;
    check(!status.is_server_error() || status == StatusCode::SERVICE_UNAVAILABLE, || {
        format!("{}: {status} {text}", what())
    })?;
    if c.method == Method::HEAD {
        return Ok(status.as_u16());
    }
    // A POST body declared other than JSON is refused (415), unless it is too large (413) first
    // (one declared nothing, without an Origin header, is read as JSON).
    let json = c.content_type.is_none_or(|ct| ct.starts_with("application/json"));
    if c.method == Method::POST && POSTS.contains(&c.path.as_str()) && !json {
        check(status == StatusCode::UNSUPPORTED_MEDIA_TYPE || status == StatusCode::PAYLOAD_TOO_LARGE, || {
            format!("{}: {status} for content-type {:?}", what(), c.content_type)
        })?;
    }
    let dialect = dialect(&c.path);
    if status.is_client_error() || status.is_server_error() {
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| TestCaseError::fail(format!("{}: {status} with a non-JSON body {text:?}: {e}", what())))?;
        check(is_error(dialect, &v), || format!("{}: {status}, not a {dialect:?} error: {v}", what()))?;
    } else if ct.starts_with("text/event-stream") {
        check_sse(dialect, &text).map_err(|why| TestCaseError::fail(format!("{}: {why}: {text}", what())))?;
    } else if ct.starts_with("application/x-ndjson") {
        let lines: Vec<&str> = text.lines().collect();
        for (i, l) in lines.iter().enumerate() {
            let v: Value = serde_json::from_str(l)
                .map_err(|e| TestCaseError::fail(format!("{}: bad NDJSON line {l:?}: {e}", what())))?;
            let last = i + 1 == lines.len();
            let ok = if last { v["done"] == true || is_error(Dialect::Ollama, &v) } else { v["done"] == false };
            check(ok, || format!("{}: NDJSON line {i} of {}: {v}", what(), lines.len()))?;
        }
        check(!lines.is_empty(), || format!("{}: an empty NDJSON stream", what()))?;
    } else if c.path != "/metrics" && !ct.starts_with("text/html") {
        serde_json::from_str::<Value>(&text)
            .map_err(|e| TestCaseError::fail(format!("{}: {status} with a non-JSON body {text:?}: {e}", what())))?;
    }
    Ok(status.as_u16())
}

/// A request that must succeed, and /health.
async fn good(srv: &Server) -> Result<(), TestCaseError> {
    let body = json!({"messages": [{"role": "user", "content": "still fine?"}], "max_tokens": 3, "ignore_eos": true});
    let r = srv.http.post(format!("{}{CHAT}", srv.base)).json(&body).send().await;
    let r = r.map_err(|e| TestCaseError::fail(format!("good request: {e}")))?;
    let status = r.status();
    let v: Value = r.json().await.map_err(|e| TestCaseError::fail(format!("good request: {e}")))?;
    check(status == StatusCode::OK && v["usage"]["completion_tokens"] == 3, || format!("good request: {status} {v}"))?;
    let h = srv.http.get(format!("{}/health", srv.base)).send().await;
    let h = h.map_err(|e| TestCaseError::fail(format!("/health: {e}")))?;
    check(h.status() == StatusCode::OK, || format!("/health: {}", h.status()))
}

#[test]
fn random_requests_never_break_the_server() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let srv = rt.block_on(serve());
    let batches = std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(300);
    let seed: u64 = std::env::var("TORUS_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(12);
    let mut seed_bytes = [0u8; 32];
    seed_bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let config = Config { cases: batches, failure_persistence: None, max_shrink_iters: 256, ..Config::default() };
    let mut runner = TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &seed_bytes));
    let t = Instant::now();
    let statuses = std::sync::Mutex::new(std::collections::BTreeMap::<(String, u16), usize>::new());
    let result = runner.run(&prop::collection::vec(case(), 1..10), |batch| {
        rt.block_on(async {
            // A few at a time, so that requests also meet in the engine's batches.
            let results: Vec<(String, Result<u16, TestCaseError>)> = futures_util::stream::iter(&batch)
                .map(|c| async { (c.path.clone(), send(&srv, c).await) })
                .buffer_unordered(4)
                .collect()
                .await;
            for (path, r) in results {
                let known = POSTS.contains(&path.as_str()) || GETS.contains(&path.as_str());
                let route = if known { path } else { "other".into() };
                *statuses.lock().unwrap().entry((route, r?)).or_insert(0) += 1;
            }
            good(&srv).await
        })
    });
    match result {
        Ok(()) => {}
        Err(TestError::Fail(why, batch)) => panic!("seed {seed}: {why}\nminimal failing batch: {batch:#?}"),
        Err(e) => panic!("seed {seed}: {e}"),
    }
    let statuses = statuses.into_inner().unwrap();
    let count = |path: &str, status: u16| statuses.get(&(path.to_string(), status)).copied().unwrap_or(0);
    eprintln!(
        "fuzz_http: {batches} batches, {} requests in {:.1} s (seed {seed}); by route and status: {statuses:?}",
        statuses.values().sum::<usize>(),
        t.elapsed().as_secs_f64()
    );
    // The mutations leave enough requests valid that generation runs, not only validation.
    if batches >= 100 {
        assert!(count(CHAT, 200) >= 5 && count(COMPLETIONS, 200) >= 5, "too few requests generated: {statuses:?}");
        for route in [MESSAGES, RESPONSES, OLLAMA_CHAT, OLLAMA_GENERATE, EMBEDDINGS, OLLAMA_EMBED] {
            assert!(count(route, 200) >= 3, "too few {route} requests generated: {statuses:?}");
        }
        assert!(count(TOKENIZE, 200) >= 5 && count(DETOKENIZE, 200) >= 5, "too few (de)tokenized: {statuses:?}");
    }
    // Nothing leaked: the engine goes idle with every KV block free.
    let engine = srv.handle.engine().unwrap().clone();
    let t = Instant::now();
    loop {
        let m = engine.metrics.snapshot();
        if m.running == 0 && m.waiting == 0 && m.kv_blocks_used == 0 {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "the engine never went idle: {m:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    rt.block_on(srv.handle.shutdown());
}
