//! Structured outputs (constrained decoding): the token trie built from the model's own
//! vocabulary, grammar-masked sampling in a batch mixed with free requests (constrained outputs
//! follow their grammar token by token; free ones are unchanged by their neighbours), the
//! finish reasons, and the OpenAI fields (`response_format`, vLLM's `structured_outputs`) over
//! HTTP, including the 400 for a grammar the library cannot compile.

mod common;
use common::{smollm2, tiny};

use serde_json::{json, Value};
use std::path::Path;
use torus_wgpu::config::EngineConfig;
use torus_wgpu::engine::{EngineHandle, FinishReason, Request, RequestParams, StopConditions};
use torus_wgpu::sampling::SamplingParams;
use torus_wgpu::server::{model_id_for_path, start, ServerConfig};
use torus_wgpu::structured::{ConstraintSpec, Grammars};
use torus_wgpu::tokenizer::{ChatMessage, Tokenizer, SPECIAL_TOKEN_MARKER};

fn cfg() -> EngineConfig {
    EngineConfig {
        max_num_batched_tokens: 256,
        max_sequence_length: 512,
        total_cache_size: 32 << 20,
        max_decode_batch_size: 16,
        max_prefill_batch_size: 4,
        ..Default::default()
    }
}

fn engine(path: &Path) -> EngineHandle {
    common::start_engine(path, &cfg())
}

/// The bytes of every token concatenate back to the text it was encoded from; special tokens
/// carry the marker.
#[test]
fn token_bytes_round_trip() {
    for path in [smollm2(), tiny()] {
        let tok = Tokenizer::from_path(&path).unwrap();
        let bytes = tok.token_bytes().unwrap();
        assert_eq!(bytes.len(), tok.vocab_size());
        for text in
            ["Hello, world!", " 123-abc {\"k\": [1, 2.5e-3]}\n\ttabs", "héllo ünïcode → 日本語 🎉", "  two  spaces"]
        {
            let ids = tok.encode_raw(text).unwrap();
            let joined: Vec<u8> = ids.iter().flat_map(|&i| bytes[i as usize].clone()).collect();
            assert_eq!(String::from_utf8_lossy(&joined), text, "{}: {ids:?}", path.display());
        }
        for &e in tok.eos_token_ids() {
            if tok.is_special(e) {
                assert_eq!(bytes[e as usize][0], SPECIAL_TOKEN_MARKER, "eos {e}");
            }
        }
        Grammars::new(&tok).unwrap();
    }
}

fn chat_prompt(tok: &Tokenizer, text: &str) -> Vec<u32> {
    let t = tok.apply_chat_template(&[ChatMessage::new("user", text)], true).unwrap();
    tok.encode(&t).unwrap()
}

/// `[0-9]{3}-[a-z]+`, checked by hand.
fn matches_code(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() > 4 && b[..3].iter().all(u8::is_ascii_digit) && b[3] == b'-' && b[4..].iter().all(u8::is_ascii_lowercase)
}

fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150}
        },
        "required": ["name", "age"],
        "additionalProperties": false
    })
}

fn check_person(s: &str) {
    let v: Value = serde_json::from_str(s).unwrap_or_else(|e| panic!("not JSON: {s:?}: {e}"));
    let o = v.as_object().unwrap_or_else(|| panic!("not an object: {s}"));
    assert!(o["name"].is_string() && o["name"].as_str().unwrap().chars().count() <= 20, "{s}");
    assert!(o["age"].is_u64() && o["age"].as_u64().unwrap() <= 150, "{s}");
    assert_eq!(o.len(), 2, "{s}");
}

/// A batch of constrained (regex, JSON schema, JSON object, choice; greedy and sampled) and free greedy
/// requests on SmolLM2: every constrained token was allowed by its grammar's mask at that point
/// (replayed through a fresh matcher), the outputs follow their grammars and stop when
/// complete, and the free requests' tokens equal their tokens when run alone.
#[test]
fn mixed_batch_follows_grammars_and_leaves_free_requests_alone() {
    let e = engine(&smollm2());
    let tok = e.tokenizer.clone();
    let g = e.grammars().unwrap();
    let specs = [
        (ConstraintSpec::Regex("[0-9]{3}-[a-z]+".into()), "Write a product code.", 0.0),
        (ConstraintSpec::JsonSchema { schema: person_schema(), strict: true }, "Describe a person as JSON.", 0.0),
        (ConstraintSpec::Choice(vec!["yes".into(), "no".into(), "maybe".into()]), "Is the sky blue?", 0.0),
        // Sampled grammars are bounded, so that they complete within max_tokens whatever the
        // draw. An open JSON object is not: a sampled number or string can run past any
        // max_tokens (a seeded draw once did), so it is greedy here.
        (ConstraintSpec::Regex("[0-9]{3}-[a-z]{1,8}".into()), "Write a product code.", 1.0),
        (ConstraintSpec::JsonObject, "Give me a JSON object.", 0.0),
        (ConstraintSpec::JsonSchema { schema: person_schema(), strict: true }, "Describe a person as JSON.", 0.8),
    ];
    let constrained: Vec<Request> = specs
        .iter()
        .enumerate()
        .map(|(i, (spec, text, t))| Request {
            prompt: chat_prompt(&tok, text),
            params: RequestParams {
                sampling: SamplingParams { temperature: *t, seed: Some(i as u64), ..Default::default() },
                stop: StopConditions { max_tokens: Some(80), ..Default::default() },
                constraint: Some(g.compile(spec).unwrap()),
                ..Default::default()
            },
        })
        .collect();
    let free: Vec<Request> = ["Tell me about cats.", "What is 2+2?", "Name three colours."]
        .iter()
        .map(|t| Request {
            prompt: chat_prompt(&tok, t),
            params: RequestParams {
                stop: StopConditions { max_tokens: Some(24), ignore_eos: true, ..Default::default() },
                ..Default::default()
            },
        })
        .collect();
    let alone: Vec<Vec<u32>> = free.iter().map(|r| e.submit(r.clone()).unwrap().collect_blocking().ids).collect();
    // Interleaved: constrained and free requests decode in the same steps.
    let mut streams = Vec::new();
    for i in 0..constrained.len().max(free.len()) {
        if let Some(r) = constrained.get(i) {
            streams.push((Some(i), e.submit(r.clone()).unwrap()));
        }
        if let Some(r) = free.get(i) {
            streams.push((None, e.submit(r.clone()).unwrap()));
        }
    }
    let words = e.info.vocab.div_ceil(32);
    let mut free_out = Vec::new();
    for (which, s) in streams {
        let c = s.collect_blocking();
        let Some(i) = which else {
            free_out.push(c.ids);
            continue;
        };
        let (spec, _, _) = &specs[i];
        // Replay: each token was allowed when it was sampled.
        let mut m = g.compile(spec).unwrap();
        for (k, &id) in c.ids.iter().enumerate() {
            let mask = m.mask(words).unwrap();
            assert!(mask[id as usize / 32] >> (id % 32) & 1 == 1, "request {i}: token {k} ({id}) was not allowed");
            if !tok.is_eos(id) {
                m.accept(id).unwrap();
            }
        }
        eprintln!("request {i}: {:?} {:?}", c.reason, c.text);
        assert_eq!(c.reason, FinishReason::Stop, "request {i} ({spec:?}): {:?}", c.text);
        assert!(m.is_stopped() || m.is_accepting(), "request {i}: the grammar is not complete: {:?}", c.text);
        match spec {
            ConstraintSpec::Regex(_) => assert!(matches_code(&c.text), "{:?}", c.text),
            ConstraintSpec::JsonSchema { .. } => check_person(&c.text),
            ConstraintSpec::Choice(list) => assert!(list.contains(&c.text), "{:?}", c.text),
            ConstraintSpec::JsonObject => {
                let v: Value = serde_json::from_str(&c.text).unwrap_or_else(|e| panic!("{:?}: {e}", c.text));
                assert!(v.is_object(), "{}", c.text);
            }
            ConstraintSpec::Lark(_) => unreachable!(),
        }
    }
    assert_eq!(free_out, alone, "free requests changed by constrained neighbours");
}

/// A grammar still open at max_tokens ends with `length`; the text is a prefix of the grammar.
#[test]
fn max_tokens_before_the_grammar_completes_is_length() {
    let e = engine(&tiny());
    let g = e.grammars().unwrap();
    let spec = ConstraintSpec::JsonSchema { schema: person_schema(), strict: true };
    let r = Request {
        prompt: vec![1, 2, 3],
        params: RequestParams {
            stop: StopConditions { max_tokens: Some(3), ..Default::default() },
            constraint: Some(g.compile(&spec).unwrap()),
            ..Default::default()
        },
    };
    let c = e.submit(r).unwrap().collect_blocking();
    assert_eq!(c.reason, FinishReason::Length);
    assert_eq!(c.ids.len(), 3);
    assert!(c.text.starts_with('{'), "{:?}", c.text);
}

/// Grammars the library rejects are errors with a reason, never a panic.
#[test]
fn bad_grammars_are_rejected_with_a_reason() {
    let tok = Tokenizer::from_path(&tiny()).unwrap();
    let g = Grammars::new(&tok).unwrap();
    for spec in [
        ConstraintSpec::JsonSchema { schema: json!({"type": "nonsense"}), strict: true },
        ConstraintSpec::JsonSchema { schema: json!({"type": "string", "minLength": 5, "maxLength": 2}), strict: true },
        ConstraintSpec::JsonSchema { schema: json!("a string"), strict: true },
        ConstraintSpec::Regex("(unclosed".into()),
        ConstraintSpec::Lark("start: undefined_rule".into()),
        ConstraintSpec::Lark("   ".into()),
        ConstraintSpec::Choice(vec![]),
    ] {
        let err = g.compile(&spec).expect_err(&format!("{spec:?} compiled"));
        assert!(!err.is_empty(), "{spec:?}");
    }
}

async fn post(base: &str, path: &str, body: &Value) -> (u16, Value) {
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let r = http.post(format!("{base}{path}")).json(body).send().await.unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: non-JSON {text:?}: {e}")))
}

/// Over HTTP on SmolLM2: json_schema (chat) returns JSON with the required keys; json_object
/// output parses; vLLM's `structured_outputs` choice and regex (completions); a schema the library
/// cannot compile is a 400 naming `response_format`; a tiny max_tokens gives `length`; then the
/// official openai client's checks (Pydantic `parse` 20 times, json_object, required tools).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_fields_over_http() {
    let path = smollm2();
    let e = tokio::task::spawn_blocking({
        let p = path.clone();
        move || engine(&p)
    })
    .await
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let handle = start(listener, ServerConfig::new(model_id_for_path(&path), &cfg()), Some(e)).unwrap();
    let base = format!("http://{}", handle.addr);
    let msgs = json!([{"role": "user", "content": "Describe a person named Ann as JSON."}]);

    let (s, v) = post(
        &base,
        "/v1/chat/completions",
        &json!({"messages": msgs, "max_tokens": 80, "temperature": 0,
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "person", "schema": person_schema(), "strict": true}}}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    check_person(v["choices"][0]["message"]["content"].as_str().unwrap());
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    let (s, v) = post(
        &base,
        "/v1/chat/completions",
        &json!({"messages": msgs, "max_tokens": 120, "temperature": 0, "n": 2,
                "response_format": {"type": "json_object"}}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    for c in v["choices"].as_array().unwrap() {
        if c["finish_reason"] == "stop" {
            let text = c["message"]["content"].as_str().unwrap();
            let o: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            assert!(o.is_object());
        }
    }

    let (s, v) = post(
        &base,
        "/v1/completions",
        &json!({"prompt": "Is water wet? Answer:", "max_tokens": 10, "temperature": 0,
                "structured_outputs": {"choice": ["yes", "no"]}}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let t = v["choices"][0]["text"].as_str().unwrap();
    assert!(t == "yes" || t == "no", "{t:?}");

    let (s, v) = post(
        &base,
        "/v1/completions",
        &json!({"prompt": "Code:", "max_tokens": 20, "temperature": 0.7, "seed": 3, "guided_regex": "[0-9]{3}-[a-z]+"}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let t = v["choices"][0]["text"].as_str().unwrap();
    if v["choices"][0]["finish_reason"] == "stop" {
        assert!(matches_code(t), "{t:?}");
    }

    // Cannot compile: 400 with the reason, naming the field.
    for rf in [
        json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}, "strict": true}}),
        json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "minLength": 5, "maxLength": 2}}}),
        json!({"type": "yaml"}),
    ] {
        let (s, v) = post(&base, "/v1/chat/completions", &json!({"messages": msgs, "response_format": rf})).await;
        assert_eq!(s, 400, "{rf}: {v}");
        assert_eq!(v["error"]["param"], "response_format", "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        assert!(v["error"]["message"].as_str().unwrap().len() > 10, "{v}");
    }
    let (s, v) = post(&base, "/v1/completions", &json!({"prompt": "x", "structured_outputs": {"regex": "(a"}})).await;
    assert_eq!(s, 400, "{v}");
    assert_eq!(v["error"]["param"], "structured_outputs", "{v}");

    // max_tokens before the grammar completes.
    let (s, v) = post(
        &base,
        "/v1/chat/completions",
        &json!({"messages": msgs, "max_tokens": 2, "response_format": {"type": "json_object"}}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");

    // The official openai client: `chat.completions.parse` with a Pydantic model 20 times,
    // json_object, and tool_choice "required" (tests/openai_e2e.py --structured).
    let v1 = format!("{base}/v1");
    tokio::task::spawn_blocking(move || common::openai_e2e(&v1, &["--structured"])).await.unwrap();
    handle.shutdown().await;
}

/// A Lark grammar with an inline JSON schema (the shape a tool call takes): the tokens of a
/// matching text are all allowed in turn and complete the grammar; a stray token is refused.
#[test]
fn lark_grammar_with_inline_json() {
    let tok = Tokenizer::from_path(&smollm2()).unwrap();
    let g = Grammars::new(&tok).unwrap();
    let lark = r#"start: "<tool_call>\n" call "\n</tool_call>"
call: %json {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}, "required": ["name", "arguments"], "additionalProperties": false}"#;
    let spec = ConstraintSpec::Lark(lark.into());
    let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    let words = tok.vocab_size().div_ceil(32);
    let mut c = g.compile(&spec).unwrap();
    for id in tok.encode_raw(text).unwrap() {
        let mask = c.mask(words).unwrap();
        assert!(mask[id as usize / 32] >> (id % 32) & 1 == 1, "token {id} ({:?}) refused", tok.decode(&[id], false));
        c.accept(id).unwrap();
    }
    assert!(c.is_accepting() || c.is_stopped());
    let mut c = g.compile(&spec).unwrap();
    let bad = tok.encode_raw("{").unwrap()[0];
    let mask = c.mask(words).unwrap();
    assert!(mask[bad as usize / 32] >> (bad % 32) & 1 == 0, "`{{` allowed before <tool_call>");
}
