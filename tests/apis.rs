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

/// llama-server's `/completion` (and `/completions`) on tiny-qwen2, greedy: its fields against
/// the other routes (`/tokenize` counts the prompt, `/detokenize` spells the tokens), `n_probs`
/// against the tokens chosen, a stop word, the stream against the whole answer, a JSON schema
/// held, and a 400 naming each sampler this server does not have.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llama_server_completion() {
    let srv = serve(&tiny(), |_| {}).await;
    let base = format!("http://{}", srv.addr);
    let http = client();
    let post = |path: &str, body: Value| {
        let r = http.post(format!("{base}{path}")).json(&body).send();
        async move {
            let r = r.await.unwrap();
            let status = r.status().as_u16();
            (status, r.text().await.unwrap())
        }
    };
    let ok = |(s, t): (u16, String)| -> Value {
        assert_eq!(s, 200, "{t}");
        serde_json::from_str(&t).unwrap()
    };
    let ask = json!({"prompt": "Hello there", "n_predict": 8, "ignore_eos": true, "temperature": 0,
                     "return_tokens": true, "n_probs": 3});
    let v = ok(post("/completion", ask.clone()).await);
    let count = ok(post("/tokenize", json!({"content": "Hello there", "add_special": true})).await);
    assert_eq!(v["tokens_evaluated"].as_u64().unwrap() as usize, count["tokens"].as_array().unwrap().len(), "{v}");
    assert_eq!(
        (v["tokens_predicted"].as_u64(), v["stop_type"].as_str(), v["stop"].as_bool()),
        (Some(8), Some("limit"), Some(true))
    );
    let ids = v["tokens"].clone();
    assert_eq!(ids.as_array().unwrap().len(), 8, "{v}");
    let spelled = ok(post("/detokenize", json!({"tokens": ids})).await);
    assert_eq!(spelled["content"], v["content"], "{v}");
    let probs = v["completion_probabilities"].as_array().unwrap();
    assert_eq!(probs.len(), 8);
    for (p, id) in probs.iter().zip(ids.as_array().unwrap()) {
        assert_eq!(&p["id"], id, "{p}");
        let top = p["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3, "{p}");
        assert_eq!(&top[0]["id"], id, "greedy picks the most likely: {p}");
        assert!(p["logprob"].as_f64().unwrap() <= 0.0 && p["bytes"].is_array(), "{p}");
    }
    for k in ["prompt_ms", "predicted_ms", "predicted_per_second"] {
        assert!(v["timings"][k].as_f64().is_some(), "{k}: {v}");
    }
    // The alias, post-sampling probabilities and response_fields.
    let mut alias = ask.clone();
    alias["post_sampling_probs"] = json!(true);
    let a = ok(post("/completions", alias.clone()).await);
    assert_eq!(a["content"], v["content"]);
    let p = a["completion_probabilities"][0]["prob"].as_f64().unwrap();
    assert!(p > 0.0 && p <= 1.0 && a["completion_probabilities"][0]["top_probs"].is_array(), "{a}");
    alias["response_fields"] = json!(["content", "timings/predicted_n"]);
    let f = ok(post("/completion", alias).await);
    assert_eq!(f, json!({"content": v["content"], "timings/predicted_n": 8}));
    // A prompt of ids and text mixed: the ids as they are, the text tokenized after them.
    let hello: Vec<Value> = count["tokens"].as_array().unwrap().clone();
    let mut mixed = hello.clone();
    mixed.push(json!(" again"));
    let again = ok(post("/tokenize", json!({"content": " again"})).await);
    let m = ok(post("/completion", json!({"prompt": mixed, "n_predict": 2})).await);
    assert_eq!(
        m["tokens_evaluated"].as_u64().unwrap() as usize,
        hello.len() + again["tokens"].as_array().unwrap().len()
    );
    // A stop word: the text up to it.
    let third = ok(post("/detokenize", json!({"tokens": [ids[2].clone()]})).await);
    let word = third["content"].as_str().unwrap().to_string();
    let before = ok(post("/detokenize", json!({"tokens": [ids[0].clone(), ids[1].clone()]})).await);
    if !word.trim().is_empty() && !before["content"].as_str().unwrap().contains(&word) {
        let mut s = ask.clone();
        s["stop"] = json!([word]);
        let w = ok(post("/completion", s).await);
        assert_eq!((w["stop_type"].as_str(), w["stopping_word"].as_str()), (Some("word"), Some(word.as_str())), "{w}");
        assert_eq!(w["content"], before["content"], "{w}");
    }
    // Streamed: the same text, one event per token, the last with the totals.
    let mut s = ask.clone();
    s["stream"] = json!(true);
    let (status, text) = post("/completion", s).await;
    assert_eq!(status, 200, "{text}");
    let events: Vec<Value> = text
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| serde_json::from_str(e.strip_prefix("data: ").unwrap()).unwrap())
        .collect();
    let joined: String = events.iter().map(|e| e["content"].as_str().unwrap()).collect();
    assert_eq!(joined, v["content"].as_str().unwrap());
    let last = events.last().unwrap();
    assert_eq!(
        (last["stop"].as_bool(), last["stop_type"].as_str(), last["tokens_predicted"].as_u64()),
        (Some(true), Some("limit"), Some(8))
    );
    assert!(events[..events.len() - 1].iter().all(|e| e["stop"] == false && e["completion_probabilities"].is_array()));
    // A JSON schema holds even a random model to it.
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": false});
    let j =
        ok(post("/completion", json!({"prompt": "JSON:", "n_predict": 60, "json_schema": schema, "temperature": 0}))
            .await);
    if j["stop_type"] == "eos" {
        let got: Value = serde_json::from_str(j["content"].as_str().unwrap()).unwrap_or_else(|e| panic!("{e}: {j}"));
        assert!(got["a"].is_i64(), "{j}");
    } else {
        assert!(j["content"].as_str().unwrap().starts_with('{'), "{j}");
    }
    // A GBNF grammar holds it too, on /completion and on chat; a bad one says where.
    let gbnf = "root ::= answer \".\"\nanswer ::= (\"yes\" | \"no\") [!?]{0,2}";
    let g = ok(post("/completion", json!({"prompt": "Well?", "n_predict": 12, "grammar": gbnf})).await);
    let text = g["content"].as_str().unwrap();
    let word = text.trim_end_matches('.').trim_end_matches(['!', '?']);
    assert!(matches!(word, "yes" | "no") && text.ends_with('.') && g["stop_type"] == "eos", "{g}");
    let c = ok(post(
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "Well?"}], "max_tokens": 12, "grammar": gbnf}),
    )
    .await);
    let text = c["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(text.starts_with("yes") || text.starts_with("no"), "{c}");
    let (s, t) = post("/completion", json!({"prompt": "x", "grammar": "root ::= \"a\"\nb ::= [z-a]"})).await;
    assert!(s == 400 && t.contains("line 2 column 7"), "{t}");
    // Past the parser's 2,000 items at one position: a 400 naming the limit, at once (it would
    // fail only while generating); at the limit, the grammar holds.
    let words = |n: usize| -> String {
        let alts: Vec<String> = (0..n).map(|i| format!("\"w{i}\"")).collect();
        format!("root ::= {}", alts.join(" | "))
    };
    let (s, t) = post("/completion", json!({"prompt": "x", "n_predict": 4, "grammar": words(2500)})).await;
    assert!(s == 400 && t.contains("2500 alternatives") && t.contains("at most 1999"), "{t}");
    let g = ok(post("/completion", json!({"prompt": "x", "n_predict": 8, "grammar": words(1999)})).await);
    let w = g["content"].as_str().unwrap();
    assert!(w.starts_with('w') && w[1..].parse::<u32>().is_ok_and(|n| n < 1999), "{g}");
    // `false` in logit_bias bans a token: the greedy first token changes.
    let first = ids[0].as_u64().unwrap();
    let mut ban = ask.clone();
    ban["logit_bias"] = json!([[first, false]]);
    let b = ok(post("/completion", ban).await);
    assert_ne!(b["tokens"][0].as_u64(), Some(first), "{b}");
    // What this server does not have is a 400 naming the field.
    for (body, param) in [
        (json!({"prompt": "x", "mirostat": 2}), "mirostat"),
        (json!({"prompt": "x", "dry_multiplier": 0.8}), "dry_multiplier"),
        (json!({"prompt": "x", "xtc_probability": 0.5}), "xtc_probability"),
        (json!({"prompt": "x", "typical_p": 0.9}), "typical_p"),
        (json!({"prompt": "x", "grammar": "root ::= \"a\" | b"}), "grammar"),
        (json!({"prompt": "x", "grammar": "root ::= [a-"}), "grammar"),
        (json!({"prompt": "x", "n_predict": 0}), "n_predict"),
        (json!({"prompt": "x", "logit_bias": [["a", 1]]}), "logit_bias"),
        (json!({"prompt": [1, {}]}), "prompt[1]"),
        (json!({"n_predict": 2}), "prompt"),
    ] {
        let (s, t) = post("/completion", body.clone()).await;
        let e: Value = serde_json::from_str(&t).unwrap();
        assert_eq!((s, e["error"]["param"].as_str()), (400, Some(param)), "{body}: {t}");
    }
    // tiny-qwen2's reduced vocabulary has no FIM tokens: /infill and `suffix` say so.
    let (s, t) = post("/infill", json!({"input_prefix": "a", "input_suffix": "b"})).await;
    assert!(s == 400 && t.contains("fill-in-the-middle"), "{t}");
    let (s, t) = post("/v1/completions", json!({"prompt": "a", "suffix": "b"})).await;
    assert!(s == 400 && t.contains("\"param\":\"suffix\""), "{t}");
    // Neutral settings of those samplers are fine.
    ok(post("/completion", json!({"prompt": "x", "n_predict": 1, "mirostat": 0, "typical_p": 1.0, "grammar": ""}))
        .await);
    srv.shutdown().await;
}

/// Fill-in-the-middle on Qwen2.5-Coder-0.5B (a FIM model): `/infill` and OpenAI's `suffix`
/// complete the function between its head and its use, greedily, with the same text; other
/// files in `input_extra` are taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn infill_on_qwen_coder() {
    let srv = serve(&common::qwen25_coder(), |_| {}).await;
    let base = format!("http://{}", srv.addr);
    let http = client();
    let (prefix, suffix) = ("def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n");
    let body = json!({"input_prefix": prefix, "input_suffix": suffix, "n_predict": 6, "temperature": 0});
    let r = http.post(format!("{base}/infill")).json(&body).send().await.unwrap();
    let v: Value = r.json().await.unwrap();
    let text = v["content"].as_str().unwrap_or_else(|| panic!("{v}"));
    assert!(text.starts_with("a + b"), "{v}");
    let openai = json!({"prompt": prefix, "suffix": suffix, "max_tokens": 6, "temperature": 0});
    let r = http.post(format!("{base}/v1/completions")).json(&openai).send().await.unwrap();
    let c: Value = r.json().await.unwrap();
    assert_eq!(c["choices"][0]["text"], v["content"], "{c}");
    assert_eq!(c["usage"]["prompt_tokens"], v["tokens_evaluated"], "{c} {v}");
    let mut extra = body.clone();
    extra["input_extra"] = json!([{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}]);
    let r = http.post(format!("{base}/infill")).json(&extra).send().await.unwrap();
    let e: Value = r.json().await.unwrap();
    assert!(e["tokens_evaluated"].as_u64() > v["tokens_evaluated"].as_u64(), "{e}");
    assert!(e["content"].as_str().unwrap().starts_with("a + b"), "{e}");
    srv.shutdown().await;
}

/// llama-server's `GET /slots` (and `/server_info`): behind the key; a running request shows as
/// a busy slot with its prompt and decode counts (never its text, seed or sampling settings);
/// `fail_on_no_slot` is a 503 while every slot is busy; the slot is idle again once the client
/// leaves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_under_an_api_key() {
    let srv = serve(&tiny(), |s| {
        s.api_key = Some(KEY.into());
        s.total_slots = 1;
    })
    .await;
    let base = format!("http://{}", srv.addr);
    let http = client();
    let slots = |q: &'static str| {
        let r = http.get(format!("{base}/slots{q}")).bearer_auth(KEY).send();
        async move {
            let r = r.await.unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }
    };
    assert_eq!(http.get(format!("{base}/slots")).send().await.unwrap().status(), 401);
    // /server_info names the model and settings: for key holders too.
    assert_eq!(http.get(format!("{base}/server_info")).send().await.unwrap().status(), 401);
    assert_eq!(http.get(format!("{base}/server_info")).bearer_auth(KEY).send().await.unwrap().status(), 200);
    let (s, idle) = slots("").await;
    assert_eq!(s, 200, "{idle}");
    let idle: Value = serde_json::from_str(&idle).unwrap();
    assert_eq!(idle.as_array().unwrap().len(), 1, "{idle}");
    assert_eq!(idle[0]["is_processing"], false, "{idle}");
    assert_eq!(slots("?fail_on_no_slot=1").await.0, 200);

    let prompt = "A secret prompt about zebras";
    let n = 400;
    let body = json!({"prompt": prompt, "n_predict": n, "ignore_eos": true, "stream": true, "seed": 987654321,
                      "temperature": 0.75});
    let mut r = http.post(format!("{base}/completion")).bearer_auth(KEY).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.chunk().await.unwrap().is_some(), "the stream's first event");
    let (s, text) = slots("").await;
    assert_eq!(s, 200, "{text}");
    assert!(!text.contains("zebras"), "no request's text in /slots: {text}");
    assert!(!text.contains("987654321") && !text.contains("0.75"), "no request's sampling settings in /slots: {text}");
    let busy: Value = serde_json::from_str(&text).unwrap();
    let slot = &busy[0];
    assert_eq!(slot["is_processing"], true, "{busy}");
    let r2 =
        http.post(format!("{base}/tokenize")).bearer_auth(KEY).json(&json!({"content": prompt, "add_special": true}));
    let count: Value = r2.send().await.unwrap().json().await.unwrap();
    assert_eq!(slot["n_prompt_tokens"], json!(count["tokens"].as_array().unwrap().len()), "{busy}");
    assert_eq!(slot["n_prompt_tokens_processed"], slot["n_prompt_tokens"], "{busy}");
    let decoded = slot["next_token"]["n_decoded"].as_u64().unwrap();
    assert!(decoded >= 1, "{busy}");
    assert_eq!(slot["next_token"]["n_remain"].as_u64().unwrap(), n - decoded, "{busy}");
    assert_eq!(slot["params"]["n_predict"], json!(n), "{busy}");
    let (s, e) = slots("?fail_on_no_slot=1").await;
    assert_eq!(s, 503, "{e}");
    let e: Value = serde_json::from_str(&e).unwrap();
    assert_eq!(e["error"]["code"], "no_slot_available", "{e}");

    // The client leaves: its sequence is aborted and the slot is idle again.
    drop(r);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let (_, t) = slots("").await;
        let v: Value = serde_json::from_str(&t).unwrap();
        if v[0]["is_processing"] == false {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the slot stayed busy: {v}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    srv.shutdown().await;
}

/// llama-server's `return_progress` and `timings_per_token`, on `/completion` and on chat: a
/// prompt longer than a step's token budget (256) sends its progress chunk by chunk before the
/// first token; every event then carries `timings` whose counts match the usage; without them the
/// responses keep their shape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_and_timings() {
    let srv = serve(&tiny(), |_| {}).await;
    let base = format!("http://{}", srv.addr);
    let http = client();
    let long = "the quick brown fox jumps over the lazy dog ".repeat(20);
    let events = |text: &str| -> Vec<Value> {
        text.split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap())
            .collect()
    };
    let body = json!({"prompt": long, "n_predict": 4, "ignore_eos": true, "stream": true,
                      "return_progress": true, "timings_per_token": true});
    let r = http.post(format!("{base}/completion")).json(&body).send().await.unwrap();
    let status = r.status();
    let text = r.text().await.unwrap();
    assert_eq!(status, 200, "{text}");
    let ev = events(&text);
    let last = ev.last().unwrap();
    let total = last["tokens_evaluated"].as_u64().unwrap();
    assert!(total > 256, "{last}");
    let progress: Vec<&Value> = ev.iter().filter_map(|e| e.get("prompt_progress")).collect();
    assert!(progress.len() >= 2, "a prompt of {total} tokens in steps of 256: {progress:?}");
    let processed: Vec<u64> = progress.iter().map(|p| p["processed"].as_u64().unwrap()).collect();
    assert!(processed.windows(2).all(|w| w[0] < w[1]) && processed.last() == Some(&total), "{processed:?}");
    assert!(progress.iter().all(|p| p["total"] == json!(total)), "{progress:?}");
    let first_token = ev.iter().position(|e| e["content"].as_str().is_some_and(|c| !c.is_empty())).unwrap();
    let last_progress = ev.iter().rposition(|e| e.get("prompt_progress").is_some()).unwrap();
    assert!(last_progress < first_token, "progress comes before the tokens");
    let tokens: Vec<&Value> = ev.iter().filter(|e| e.get("prompt_progress").is_none()).collect();
    assert!(tokens.iter().all(|e| e["timings"]["predicted_n"].is_u64()), "timings on every token: {tokens:?}");
    assert_eq!(last["timings"]["predicted_n"], 4, "{last}");
    assert_eq!(last["timings"]["prompt_n"], json!(total - last["tokens_cached"].as_u64().unwrap()), "{last}");

    // Chat, whole: `timings` only when asked.
    let chat = |extra: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": long}], "max_tokens": 3, "temperature": 0});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        http.post(format!("{base}/v1/chat/completions")).json(&b).send()
    };
    let plain: Value = chat(json!({})).await.unwrap().json().await.unwrap();
    assert!(plain.get("timings").is_none() && plain.get("prompt_progress").is_none(), "{plain}");
    let timed: Value = chat(json!({"timings_per_token": true})).await.unwrap().json().await.unwrap();
    let (u, t) = (&timed["usage"], &timed["timings"]);
    assert_eq!(t["predicted_n"], u["completion_tokens"], "{timed}");
    let cached = u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    assert_eq!(t["prompt_n"].as_u64().unwrap(), u["prompt_tokens"].as_u64().unwrap() - cached, "{timed}");
    assert!(t["prompt_ms"].as_f64().unwrap() > 0.0, "{timed}");

    // Chat, streamed, with a prompt the cache has not seen: progress chunks with no choices, then
    // chunks with timings.
    let fresh = format!("a different text {long}");
    let b = json!({"messages": [{"role": "user", "content": fresh}], "max_tokens": 3, "stream": true,
                   "return_progress": true, "timings_per_token": true});
    let r = http.post(format!("{base}/v1/chat/completions")).json(&b).send().await.unwrap();
    let ev = events(&r.text().await.unwrap());
    let progress: Vec<&Value> = ev.iter().filter(|e| e.get("prompt_progress").is_some()).collect();
    assert!(progress.len() >= 2, "{ev:?}");
    assert!(progress.iter().all(|e| e["choices"] == json!([])), "{progress:?}");
    let chunks: Vec<&Value> = ev.iter().filter(|e| e.get("prompt_progress").is_none()).collect();
    // The role chunk goes out at once; every chunk after it carries the timings.
    assert!(chunks[0]["choices"][0]["delta"]["role"] == "assistant" && chunks.len() > 1, "{chunks:?}");
    assert!(chunks[1..].iter().all(|e| e["timings"]["prompt_n"].as_u64() > Some(256)), "{chunks:?}");
    assert_eq!(chunks.last().unwrap()["timings"]["predicted_n"], 3, "{chunks:?}");
    srv.shutdown().await;
}
