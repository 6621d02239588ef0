//! The access log: one JSON line per request (target `torus_wgpu::access`) with the request id,
//! route, status, token counts, time to first token, duration and finish reasons, written when
//! the response ends (for a stream: after its last event). The lines are captured through a
//! process-wide tracing subscriber (the handlers run on other threads), so this file holds one
//! test.

mod common;
use common::tiny;

use reqwest::StatusCode;
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use torus_wgpu::config::EngineConfig;
use torus_wgpu::server::{start, ServerConfig};

/// Everything the subscriber writes.
#[derive(Clone, Default)]
struct Buf(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Buf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Buf {
    /// The access lines so far, parsed.
    fn access_lines(&self) -> Vec<Value> {
        let text = String::from_utf8(self.0.lock().unwrap().clone()).unwrap();
        text.lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap_or_else(|e| panic!("not JSON: {l:?}: {e}")))
            .filter(|v| v["target"] == torus_wgpu::server::access::ACCESS_TARGET)
            .collect()
    }

    /// Waits (bounded) for the line of request `id`; there must be exactly one.
    async fn line_of(&self, id: &str) -> Value {
        let t = Instant::now();
        loop {
            let lines: Vec<Value> = self.access_lines().into_iter().filter(|v| v["request_id"] == id).collect();
            assert!(lines.len() <= 1, "several lines for {id}: {lines:?}");
            if let Some(l) = lines.into_iter().next() {
                return l;
            }
            assert!(t.elapsed() < Duration::from_secs(30), "no access line for {id}: {:?}", self.access_lines());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// The generation fields of a line agree with the response's usage and finish reasons.
fn assert_generation_line(l: &Value, id: &str, route: &str, usage: &Value, reasons: &str) {
    assert_eq!(l["request_id"], id, "{l}");
    assert_eq!(l["level"], "INFO", "{l}");
    assert_eq!(l["method"], "POST", "{l}");
    assert_eq!(l["route"], route, "{l}");
    assert_eq!(l["status"], 200, "{l}");
    assert_eq!(l["prompt_tokens"], usage["prompt_tokens"], "{l} {usage}");
    assert_eq!(l["completion_tokens"], usage["completion_tokens"], "{l} {usage}");
    assert_eq!(l["finish_reasons"], reasons, "{l}");
    let (ttft, total) = (l["ttft_ms"].as_f64().unwrap(), l["duration_ms"].as_f64().unwrap());
    assert!(ttft > 0.0 && ttft <= total, "{l}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_log_lines() {
    let buf = Buf::default();
    let w = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .json()
        .flatten_event(true)
        .with_max_level(tracing::Level::INFO)
        .with_writer(move || w.clone())
        .finish();
    tracing::subscriber::set_global_default(subscriber).unwrap();

    let cfg = EngineConfig {
        max_num_batched_tokens: 256,
        max_sequence_length: 512,
        total_cache_size: 8 << 20,
        max_decode_batch_size: 16,
        max_prefill_batch_size: 4,
        ..Default::default()
    };
    let engine = common::start_engine_async(&tiny(), &cfg).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let handle = start(listener, ServerConfig::new("tiny-qwen2", &cfg), Some(engine)).unwrap();
    let base = format!("http://{}", handle.addr);
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let post = |path: &str, id: &str, body: Value| {
        http.post(format!("{base}{path}")).header("x-request-id", id).json(&body).send()
    };

    // Non-streaming chat: counts as in the response's usage.
    let messages = json!([{"role": "user", "content": "Hello there"}]);
    let r =
        post("/v1/chat/completions", "log-chat", json!({"messages": messages, "max_tokens": 7, "ignore_eos": true}))
            .await
            .unwrap();
    assert_eq!(r.headers()["x-request-id"], "log-chat");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 7, "{v}");
    assert_generation_line(&buf.line_of("log-chat").await, "log-chat", "/v1/chat/completions", &v["usage"], "length");

    // A stream of two choices with a stop token budget each. Had the line been written when the
    // headers went out, no choice would have finished yet (no tokens, reasons `abort`).
    let body = json!({"messages": messages, "max_tokens": 40, "ignore_eos": true, "n": 2, "stream": true,
                      "stream_options": {"include_usage": true}});
    let r = post("/v1/chat/completions", "log-stream", body).await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let text = r.text().await.unwrap();
    let usage = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .find(|c| c["usage"].is_object())
        .expect("a usage chunk")["usage"]
        .clone();
    assert_eq!(usage["completion_tokens"], 80, "{usage}");
    let l = buf.line_of("log-stream").await;
    assert_generation_line(&l, "log-stream", "/v1/chat/completions", &usage, "length,length");

    // Legacy completions, two prompts: each prompt counted once.
    let r = post("/v1/completions", "log-cmpl", json!({"prompt": ["The sky is", "One two"], "max_tokens": 3}))
        .await
        .unwrap();
    let v: Value = r.json().await.unwrap();
    let reasons: Vec<&str> =
        v["choices"].as_array().unwrap().iter().map(|c| c["finish_reason"].as_str().unwrap()).collect();
    let l = buf.line_of("log-cmpl").await;
    assert_generation_line(&l, "log-cmpl", "/v1/completions", &v["usage"], &reasons.join(","));

    // Other routes and errors: id, method, route, status, duration; no token fields.
    let r = http.get(format!("{base}/v1/models")).header("x-request-id", "log-models").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let l = buf.line_of("log-models").await;
    assert_eq!(
        (l["method"].as_str(), l["route"].as_str(), l["status"].as_u64()),
        (Some("GET"), Some("/v1/models"), Some(200))
    );
    assert!(l["duration_ms"].as_f64().unwrap() >= 0.0, "{l}");
    assert!(l.get("prompt_tokens").is_none() && l.get("finish_reasons").is_none(), "{l}");
    let r = post("/v1/chat/completions", "log-bad", json!({"messages": "nope"})).await.unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let l = buf.line_of("log-bad").await;
    assert_eq!(l["status"], 400, "{l}");
    assert!(l.get("prompt_tokens").is_none(), "{l}");
    let r = http.get(format!("{base}/v1/models/x/y")).send().await.unwrap();
    let id = r.headers()["x-request-id"].to_str().unwrap().to_string();
    let l = buf.line_of(&id).await;
    assert_eq!((l["route"].as_str(), l["status"].as_u64()), (Some("/v1/models/{*model}"), Some(404)), "{l}");
    let r = http.get(format!("{base}/no/such/path")).send().await.unwrap();
    let id = r.headers()["x-request-id"].to_str().unwrap().to_string();
    assert_eq!(buf.line_of(&id).await["route"], "/no/such/path");

    handle.shutdown().await;
}
