//! The APIs beyond OpenAI's chat completions (Anthropic Messages, the Responses API, embeddings,
//! Ollama's API) driven by their official clients (tests/apis_e2e.py: the `anthropic` and
//! `openai` packages, Ollama's over plain HTTP and the `ollama` package), the chat page at `/` in a real
//! browser (tests/webui_selenium.py: headless Chromium through selenium), and the raw framing
//! the clients hide (Anthropic's pings, the API key on `x-api-key`, errors in each API's shape).

mod common;
use common::{smollm2, tiny};

use serde_json::{json, Value};
use std::path::Path;
use std::process::Command;
use torus_wgpu::config::EngineConfig;
use torus_wgpu::server::{model_id_for_path, start, ServerConfig, ServerHandle};

const KEY: &str = "sk-apis-test";

async fn serve(path: &Path, f: impl FnOnce(&mut ServerConfig)) -> ServerHandle {
    let cfg = EngineConfig {
        max_num_batched_tokens: 256,
        max_sequence_length: 1024,
        total_cache_size: 32 << 20,
        max_decode_batch_size: 8,
        max_prefill_batch_size: 4,
        ..Default::default()
    };
    let engine = common::start_engine_async(path, &cfg).await;
    let mut scfg = ServerConfig::new(model_id_for_path(path), &cfg);
    scfg.model_path = Some(path.to_path_buf());
    f(&mut scfg);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    start(listener, scfg, Some(engine)).unwrap()
}

/// Runs a Python test script; its packages missing fail the test in CI (outside CI,
/// `TORUS_SKIP_PYTHON=1` skips it).
fn python(script: &str, imports: &str, args: &[&str], passed: &str) {
    let ok =
        Command::new("python3").args(["-c", &format!("import {imports}")]).output().is_ok_and(|o| o.status.success());
    if !ok {
        if std::env::var("TORUS_SKIP_PYTHON").as_deref() == Ok("1") && std::env::var_os("CI").is_none() {
            eprintln!("SKIPPED: python3 cannot `import {imports}` (TORUS_SKIP_PYTHON=1)");
            return;
        }
        panic!("python3 cannot `import {imports}`: run scripts/setup.sh");
    }
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests").join(script);
    let out = Command::new("python3")
        .arg(path)
        .args(args)
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("no_proxy", "127.0.0.1,localhost")
        .output()
        .expect("run python3");
    let (so, se) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{script} failed ({:?})\nstdout:\n{so}\nstderr:\n{se}", out.status);
    assert!(so.contains(passed), "{so}\n{se}");
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_clients_on_anthropic_responses_and_ollama() {
    let path = smollm2();
    let srv = serve(&path, |s| {
        s.api_key = Some(KEY.into());
        s.pooling = torus_wgpu::engine::Pooling::Mean;
    })
    .await;
    assert_eq!(srv.engine().unwrap().enable_embeddings(), Ok(576), "--task embed");
    let base = format!("http://{}", srv.addr);
    let model = model_id_for_path(&path);
    tokio::task::spawn_blocking(move || {
        python(
            "apis_e2e.py",
            "anthropic, openai, pydantic, jsonschema",
            &[&base, &model, KEY],
            "apis_e2e: all checks passed",
        )
    })
    .await
    .unwrap();
    srv.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_page_in_a_browser() {
    let srv = serve(&smollm2(), |s| s.api_key = Some(KEY.into())).await;
    let base = format!("http://{}/", srv.addr);
    // Cargo's scratch folder for integration tests (it exists; `target/` need not be there).
    let shot = Path::new(env!("CARGO_TARGET_TMPDIR")).join("webui-screenshot.png");
    let _ = std::fs::remove_file(&shot);
    let s = shot.display().to_string();
    tokio::task::spawn_blocking(move || {
        python("webui_selenium.py", "selenium", &[&base, &s, "--api-key", KEY], "webui: all checks passed")
    })
    .await
    .unwrap();
    assert!(std::fs::metadata(&shot).is_ok_and(|m| m.len() > 1000), "no screenshot at {}", shot.display());
    srv.shutdown().await;
}

/// The raw framing: Anthropic's stream (ping after the first block start, the block indices),
/// the key on `x-api-key`, each API's 401 and 404 shape, the page's headers and `--no-webui`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn framing_keys_and_error_shapes() {
    let srv = serve(&tiny(), |s| s.api_key = Some(KEY.into())).await;
    let base = format!("http://{}", srv.addr);
    let http = client();
    let body = json!({"model": "tiny-qwen2", "max_tokens": 5, "stream": true,
        "messages": [{"role": "user", "content": "hi"}]});
    let r = http.post(format!("{base}/v1/messages")).header("x-api-key", KEY).header("anthropic-version", "2023-06-01");
    let text = r.json(&body).send().await.unwrap().text().await.unwrap();
    let events: Vec<(String, Value)> = text
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let name = e.lines().next().unwrap().strip_prefix("event: ").unwrap().to_string();
            let data: Value = serde_json::from_str(e.lines().nth(1).unwrap().strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(data["type"], name.as_str(), "{e}");
            (name, data)
        })
        .collect();
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names[..3], ["message_start", "content_block_start", "ping"], "{names:?}");
    assert_eq!(names[names.len() - 3..], ["content_block_stop", "message_delta", "message_stop"], "{names:?}");
    assert!(events.iter().filter(|(n, _)| n == "content_block_delta").all(|(_, d)| d["index"] == 0), "{text}");
    let delta = &events[events.len() - 2].1;
    let n = delta["usage"]["output_tokens"].as_u64().unwrap();
    let reason = delta["delta"]["stop_reason"].as_str().unwrap();
    assert!((n == 5 && reason == "max_tokens") || (n < 5 && reason == "end_turn"), "{delta}");

    // 401 in each API's shape; the key works on either header.
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    for (path, shape) in [
        (
            "/v1/messages",
            json!({"type": "error", "error": {"type": "authentication_error", "message": "incorrect API key provided"}}),
        ),
        ("/api/chat", json!({"error": "incorrect API key provided"})),
        (
            "/v1/chat/completions",
            json!({"error": {"message": "incorrect API key provided", "type": "invalid_request_error", "param": null, "code": "invalid_api_key"}}),
        ),
    ] {
        let r = http.post(format!("{base}{path}")).header("x-api-key", "wrong").json(&chat).send().await.unwrap();
        assert_eq!(r.status(), 401, "{path}");
        assert_eq!(r.json::<Value>().await.unwrap(), shape, "{path}");
        let r = http.post(format!("{base}{path}")).header("x-api-key", KEY).json(&chat).send().await.unwrap();
        assert_eq!(r.status(), 200, "{path} with x-api-key");
    }
    // More max tokens than the context has room for (agents send 8k-32k): the translated APIs
    // answer up to the room (1024 here) and end with their "max tokens" reason; OpenAI's chat
    // keeps vLLM's 400.
    let msgs = json!([{"role": "user", "content": "hi"}]);
    for (path, body) in [
        ("/v1/messages", json!({"model": "tiny-qwen2", "max_tokens": 32000, "messages": msgs})),
        ("/v1/responses", json!({"model": "tiny-qwen2", "max_output_tokens": 32000, "input": "hi"})),
        (
            "/api/chat",
            json!({"model": "tiny-qwen2", "messages": msgs, "stream": false, "options": {"num_predict": 32000}}),
        ),
    ] {
        let r = http.post(format!("{base}{path}")).bearer_auth(KEY).json(&body).send().await.unwrap();
        let status = r.status();
        let v: Value = r.json().await.unwrap();
        assert_eq!(status, 200, "{path}: {v}");
    }
    // llama-server's /props and /apply-template, behind the key.
    let r = http.get(format!("{base}/props")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let props: Value = http.get(format!("{base}/props")).bearer_auth(KEY).send().await.unwrap().json().await.unwrap();
    assert!(props["chat_template"].as_str().unwrap().contains("im_start"), "{props}");
    assert_eq!(props["model_path"], "tiny-qwen2", "a name, not a path: {props}");
    assert!(props["total_slots"].as_u64().unwrap() > 0, "{props}");
    assert!(props["default_generation_settings"]["n_ctx"].as_u64().unwrap() > 0, "{props}");
    let r = http.post(format!("{base}/apply-template")).bearer_auth(KEY).json(&json!({"messages": msgs}));
    let p: Value = r.send().await.unwrap().json().await.unwrap();
    assert!(p["prompt"].as_str().unwrap().ends_with("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"), "{p}");
    // Anthropic's prefill: a final assistant message is continued, counted as chat counts it.
    let pre = json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there"}]);
    let r = http.post(format!("{base}/v1/messages/count_tokens")).bearer_auth(KEY).json(&json!({"messages": pre}));
    let counted: Value = r.send().await.unwrap().json().await.unwrap();
    let r = http.post(format!("{base}/tokenize")).bearer_auth(KEY).json(&json!({"messages": pre}));
    let chat: Value = r.send().await.unwrap().json().await.unwrap();
    let r = http.post(format!("{base}/detokenize")).bearer_auth(KEY).json(&json!({"tokens": chat["tokens"]}));
    let text: Value = r.send().await.unwrap().json().await.unwrap();
    assert!(text["content"].as_str().unwrap().ends_with("assistant\nHello there"), "{text}");
    assert_eq!(counted["input_tokens"], chat["count"], "{counted} {chat}");
    // Ollama takes more than 16 stop strings and temperatures above 2; OpenAI's route does not.
    let stops: Vec<String> = (0..17).map(|i| format!("s{i}")).collect();
    let opts = json!({"num_predict": 3, "temperature": 3.5, "stop": stops});
    let body = json!({"model": "tiny-qwen2", "messages": msgs, "stream": false, "options": opts});
    let r = http.post(format!("{base}/api/chat")).bearer_auth(KEY).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    for bad in [json!({"temperature": 3.5}), json!({"stop": stops})] {
        let mut body = json!({"messages": msgs, "max_tokens": 3});
        body.as_object_mut().unwrap().extend(bad.as_object().unwrap().clone());
        let r = http.post(format!("{base}/v1/chat/completions")).bearer_auth(KEY).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 400, "{bad}");
    }
    // Errors name the client's own fields, not the chat fields they became.
    for (path, body, param, chat_name) in [
        ("/v1/responses", json!({"max_output_tokens": 0, "input": "hi"}), "max_output_tokens", "max_tokens"),
        ("/v1/messages", json!({"max_tokens": 5, "stop_sequences": stops, "messages": msgs}), "stop_sequences", "stop"),
        ("/api/chat", json!({"messages": msgs, "options": {"top_p": 2}}), "options.top_p", "top_p"),
    ] {
        let r = http.post(format!("{base}{path}")).bearer_auth(KEY).json(&body).send().await.unwrap();
        let status = r.status();
        let text = r.text().await.unwrap();
        assert_eq!(status, 400, "{path}: {text}");
        assert!(text.contains(param) && !text.contains(&format!("`{chat_name}`")), "{path}: {text}");
    }
    let r = http
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth(KEY)
        .json(&json!({"messages": msgs, "max_tokens": 32000}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    for (path, check) in [("/api/nothing", "error"), ("/v1/messages/nothing", "type"), ("/v1/nothing", "error")] {
        let r = http.get(format!("{base}{path}")).bearer_auth(KEY).send().await.unwrap();
        assert_eq!(r.status(), 404, "{path}");
        let v: Value = r.json().await.unwrap();
        assert!(v.get(check).is_some(), "{path}: {v}");
    }

    // The page needs no key (it asks for one), and says where it may connect.
    let r = http.get(format!("{base}/")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let csp = r.headers()["content-security-policy"].to_str().unwrap().to_string();
    assert!(csp.contains("connect-src 'self'") && csp.contains("default-src 'none'"), "{csp}");
    assert!(r.text().await.unwrap().contains("renderMarkdown"));
    srv.shutdown().await;

    let bare = serve(&tiny(), |s| s.webui = false).await;
    let r = http.get(format!("http://{}/", bare.addr)).send().await.unwrap();
    assert_eq!(r.status(), 404, "--no-webui");
    bare.shutdown().await;
}

/// A thinking model's span (here the tiny model under `deepseek_r1`, whose output without
/// `</think>` is all thinking) comes back as Anthropic's `thinking` block and the Responses
/// API's `reasoning` item, whole and streamed, with the same text as chat's `reasoning_content`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasoning_as_thinking_blocks_and_reasoning_items() {
    use torus_wgpu::server::reasoning::{ReasoningChoice, ReasoningKind};
    let srv = serve(&tiny(), |s| s.reasoning_parser = ReasoningChoice::Parser(ReasoningKind::DeepSeekR1)).await;
    let base = format!("http://{}", srv.addr);
    let http = client();
    let user = json!([{"role": "user", "content": "hi"}]);
    let chat = json!({"messages": user, "max_tokens": 6, "temperature": 0});
    let c: Value =
        http.post(format!("{base}/v1/chat/completions")).json(&chat).send().await.unwrap().json().await.unwrap();
    let thinking = c["choices"][0]["message"]["reasoning_content"].as_str().unwrap().to_string();
    assert!(!thinking.is_empty(), "{c}");

    let m = json!({"messages": user, "max_tokens": 6, "temperature": 0});
    let a: Value = http.post(format!("{base}/v1/messages")).json(&m).send().await.unwrap().json().await.unwrap();
    assert_eq!(a["content"][0]["type"], "thinking", "{a}");
    assert_eq!(a["content"][0]["thinking"], thinking.as_str(), "{a}");
    let mut ms = m.clone();
    ms["stream"] = json!(true);
    let text = http.post(format!("{base}/v1/messages")).json(&ms).send().await.unwrap().text().await.unwrap();
    let deltas: String = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .filter(|v| v["delta"]["type"] == "thinking_delta")
        .map(|v| v["delta"]["thinking"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(deltas, thinking, "{text}");
    assert!(text.contains(r#""content_block":{"type":"thinking""#), "{text}");

    let r = json!({"input": "hi", "max_output_tokens": 6, "temperature": 0});
    let o: Value = http.post(format!("{base}/v1/responses")).json(&r).send().await.unwrap().json().await.unwrap();
    assert_eq!(o["output"][0]["type"], "reasoning", "{o}");
    assert_eq!(o["output"][0]["content"][0]["text"], thinking.as_str(), "{o}");
    let mut rs = r.clone();
    rs["stream"] = json!(true);
    let text = http.post(format!("{base}/v1/responses")).json(&rs).send().await.unwrap().text().await.unwrap();
    let deltas: String = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .filter(|v| v["type"] == "response.reasoning_text.delta")
        .map(|v| v["delta"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(deltas, thinking, "{text}");
    srv.shutdown().await;
}
