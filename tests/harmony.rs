//! gpt-oss's harmony format: its real chat template (tests/fixtures/templates/gpt-oss.jinja)
//! rendered by our template engine against transformers' rendering of the same conversations,
//! and the tiny gpt-oss served with it (the harmony parser picked from the template). The tiny
//! model's text is random, so the HTTP checks are of shape and consistency; how harmony output
//! is split into reasoning, content and tool calls at every boundary is tested in
//! `server::harmony`.

mod common;

use common::tiny::local;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use torus_wgpu::config::EngineConfig;
use torus_wgpu::server::reasoning::ReasoningChoice;
use torus_wgpu::server::{model_id_for_path, start, ServerConfig, ServerHandle};
use torus_wgpu::tokenizer::{ChatMessage, Tokenizer};

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn template() -> String {
    std::fs::read_to_string(local("templates/gpt-oss.jinja")).unwrap()
}

/// A copy of tiny-gptoss with gpt-oss's chat template.
fn tiny_gptoss_with_template(tag: &str) -> TempDir {
    let dir = std::env::temp_dir().join(format!("torus-harmony-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = local("tiny-gptoss");
    for f in ["generation_config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    // Room for the template's system message in byte-level tokens (the weights are random).
    let mut config: Value = serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    config["max_position_embeddings"] = json!(1024);
    std::fs::write(dir.join("config.json"), serde_json::to_vec(&config).unwrap()).unwrap();
    let mut cfg: Value = serde_json::from_slice(&std::fs::read(src.join("tokenizer_config.json")).unwrap()).unwrap();
    cfg["chat_template"] = json!(template());
    std::fs::write(dir.join("tokenizer_config.json"), serde_json::to_vec(&cfg).unwrap()).unwrap();
    TempDir(dir)
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
    let engine = common::start_engine_async(path, &cfg).await;
    let mut scfg = ServerConfig::new(model_id_for_path(path), &cfg);
    scfg.reasoning_parser = parser;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let h = start(listener, scfg, Some(engine)).unwrap();
    let base = format!("http://{}/v1", h.addr);
    (h, base)
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
    let text = r.text().await.unwrap();
    let (mut reasoning, mut content, mut finish) = (String::new(), String::new(), String::new());
    for ev in text.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).filter(|d| *d != "[DONE]") {
        let v: Value = serde_json::from_str(ev).unwrap();
        let c = &v["choices"][0];
        reasoning.push_str(c["delta"]["reasoning_content"].as_str().unwrap_or(""));
        content.push_str(c["delta"]["content"].as_str().unwrap_or(""));
        if let Some(f) = c["finish_reason"].as_str() {
            finish = f.to_string();
        }
    }
    (reasoning, content, finish)
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
