//! gpt-oss's harmony format: its real chat template (tests/fixtures/templates/gpt-oss.jinja)
//! rendered by our template engine against transformers' rendering of the same conversations,
//! and the tiny gpt-oss served with it (the harmony parser picked from the template). The tiny
//! model's text is random, so the HTTP checks are of shape and consistency; how harmony output
//! is split into reasoning, content and tool calls at every boundary is tested in
//! `server::harmony`.

mod common;

use common::served::{self, TempDir};
use common::tiny::local;
use serde_json::{json, Value};
use std::path::Path;
use torus_wgpu::config::EngineConfig;
use torus_wgpu::server::reasoning::ReasoningChoice;
use torus_wgpu::server::ServerHandle;
use torus_wgpu::tokenizer::{ChatMessage, Tokenizer};

fn template() -> String {
    std::fs::read_to_string(local("templates/gpt-oss.jinja")).unwrap()
}

/// A copy of tiny-gptoss with gpt-oss's chat template, and room for the template's system
/// message in byte-level tokens (the weights are random).
fn tiny_gptoss_with_template(tag: &str) -> TempDir {
    served::with_template(&local("tiny-gptoss"), &format!("harmony-{tag}"), &template(), |c| {
        c["max_position_embeddings"] = json!(1024)
    })
}

/// The text with its "Current date: ..." line (the day it was rendered) taken out.
fn without_date(s: &str) -> String {
    s.lines().filter(|l| !l.starts_with("Current date: ")).collect::<Vec<_>>().join("\n")
}

#[test]
fn gptoss_template_renders_as_transformers_does() {
    let model = tiny_gptoss_with_template("render");
    let tok = Tokenizer::from_path(&model.0).unwrap();
    let r: Value =
        serde_json::from_str(&std::fs::read_to_string(local("templates/gpt-oss-reference.json")).unwrap()).unwrap();
    let cases = r["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 5);
    for c in cases {
        let name = c["name"].as_str().unwrap();
        let messages: Vec<ChatMessage> = serde_json::from_value(c["messages"].clone()).unwrap();
        let tools = c.get("tools").and_then(Value::as_array).cloned();
        let kwargs = c.get("kwargs").and_then(Value::as_object).cloned();
        let got = tok
            .apply_chat_template_kwargs(&messages, tools.as_deref(), true, kwargs.as_ref())
            .unwrap_or_else(|e| panic!("{name}: {e:#}"));
        let want = c["rendered"].as_str().unwrap();
        assert!(got.contains("Current date: "), "{name}: {got}");
        assert_eq!(without_date(&got), without_date(want), "{name}");
    }
}

async fn serve(path: &Path, parser: ReasoningChoice) -> (ServerHandle, String) {
    let cfg = EngineConfig {
        max_num_batched_tokens: 512,
        max_sequence_length: 1024,
        total_cache_size: 16 << 20,
        ..Default::default()
    };
    served::serve(path, &cfg, parser).await
}

fn body(extra: Value) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "max_tokens": 16,
        "temperature": 0,
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

async fn post(base: &str, extra: Value) -> reqwest::Response {
    reqwest::Client::new().post(format!("{base}/chat/completions")).json(&body(extra)).send().await.unwrap()
}

/// A stream's (reasoning, content) deltas joined, and its finish reason.
async fn streamed(base: &str, extra: Value) -> (String, String, String) {
    let mut extra = extra;
    extra["stream"] = json!(true);
    let r = post(base, extra).await;
    assert_eq!(r.status(), 200);
    served::joined_stream(&r.text().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiny_gptoss_served_with_the_harmony_template() {
    let model = tiny_gptoss_with_template("serve");
    let tools = json!({"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]});

    // The raw text, without a parser: it keeps no special tokens, and this tokenizer has none
    // of harmony's, so both servers see the same text.
    let (h, base) = serve(&model.0, ReasoningChoice::None).await;
    let raw: Value = post(&base, json!({})).await.json().await.unwrap();
    let raw_text = raw["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    h.shutdown().await;
    assert!(!raw_text.is_empty(), "{raw}");

    let (h, base) = serve(&model.0, ReasoningChoice::Auto).await;
    let v: Value = post(&base, json!({})).await.json().await.unwrap();
    let m = &v["choices"][0]["message"];
    // The random model writes no harmony header: its text is content as it stands.
    assert_eq!(m["content"], json!(raw_text), "{v}");
    assert_eq!(m["reasoning_content"], Value::Null, "{v}");
    let (sr, sc, finish) = streamed(&base, json!({})).await;
    assert_eq!((sr.as_str(), sc.as_str(), finish.as_str()), ("", raw_text.as_str(), "length"));

    // Tools go into the developer message the template writes: a longer prompt.
    let with_tools: Value = post(&base, tools.clone()).await.json().await.unwrap();
    assert!(
        with_tools["usage"]["prompt_tokens"].as_u64() > v["usage"]["prompt_tokens"].as_u64(),
        "{with_tools} vs {v}"
    );
    assert!(with_tools["choices"][0]["message"].get("tool_calls").is_none(), "{with_tools}");
    let (_, sc, _) = streamed(&base, tools.clone()).await;
    assert_eq!(Some(sc.as_str()), with_tools["choices"][0]["message"]["content"].as_str());

    // A required function cannot be enforced in this format: a clear 400 naming the field.
    let mut req = tools.clone();
    req["tool_choice"] = json!("required");
    let r = post(&base, req).await;
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["param"], "tool_choice", "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("harmony"), "{e}");
    h.shutdown().await;
}
