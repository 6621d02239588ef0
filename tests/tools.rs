//! Tool calling on /v1/chat/completions (`tools`, `tool_choice`, `parallel_tool_calls`, tool
//! history): request validation, prompt rendering (Qwen2.5's template, which renders tools
//! itself, and the generic Hermes-style rendering for templates that do not), and a real tool
//! call by Qwen2.5-Coder-0.5B-Instruct parsed into OpenAI `tool_calls`, streamed and not, with
//! a follow-up turn carrying the tool's result.

mod common;
use common::tiny;

use reqwest::StatusCode;
use serde_json::{json, Value};
use std::path::Path;
use torus_wgpu::config::EngineConfig;
use torus_wgpu::engine::{FinishReason, Request, RequestParams, StopConditions};
use torus_wgpu::sampling::SamplingParams;
use torus_wgpu::server::{model_id_for_path, start, tool_call_grammar, ServerConfig, ServerHandle};
use torus_wgpu::structured::ConstraintSpec;
use torus_wgpu::tokenizer::{ChatMessage, Tokenizer};

fn weather_tool() -> Value {
    json!({"type": "function", "function": {
        "name": "get_weather",
        "description": "Get the current weather in a given city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city name"}},
            "required": ["city"],
        },
    }})
}

struct Srv {
    _handle: ServerHandle,
    base: String,
    http: reqwest::Client,
}

async fn serve(path: &Path, cfg: EngineConfig) -> Srv {
    let engine = common::start_engine_async(path, &cfg).await;
    let scfg = ServerConfig::new(model_id_for_path(path), &cfg);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let handle = start(listener, scfg, Some(engine)).unwrap();
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    Srv { base: format!("http://{}", handle.addr), _handle: handle, http }
}

impl Srv {
    async fn post(&self, path: &str, body: &Value) -> (StatusCode, Value) {
        let r = self.http.post(format!("{}{path}", self.base)).json(body).send().await.unwrap();
        let status = r.status();
        let text = r.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: non-JSON {text:?}: {e}")))
    }

    async fn ok(&self, path: &str, body: &Value) -> Value {
        let (s, v) = self.post(path, body).await;
        assert_eq!(s, StatusCode::OK, "{path} {body}: {v}");
        v
    }

    /// The SSE events' JSON, up to `[DONE]`.
    async fn stream(&self, body: &Value) -> Vec<Value> {
        let r = self.http.post(format!("{}/v1/chat/completions", self.base)).json(body).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        let text = r.text().await.unwrap();
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        text.split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap())
            .collect()
    }

    /// The prompt a chat request would get: /tokenize, then /detokenize.
    async fn rendered(&self, body: &Value) -> String {
        let t = self.ok("/tokenize", body).await;
        let d = self.ok("/detokenize", &json!({"tokens": t["tokens"]})).await;
        d["prompt"].as_str().unwrap().to_string()
    }
}

/// Streamed chunks folded into (content, tool_calls, finish reason) as a client does: content
/// deltas concatenated, tool-call deltas merged by index (arguments concatenated).
fn reassemble(chunks: &[Value]) -> (Option<String>, Vec<Value>, String) {
    let (mut content, mut calls, mut reason) = (None::<String>, Vec::<Value>::new(), String::new());
    for c in chunks {
        let Some(ch) = c["choices"].get(0) else { continue };
        let d = &ch["delta"];
        if let Some(s) = d["content"].as_str().filter(|s| !s.is_empty()) {
            content.get_or_insert_with(String::new).push_str(s);
        }
        for tc in d["tool_calls"].as_array().into_iter().flatten() {
            let i = tc["index"].as_u64().unwrap() as usize;
            if i == calls.len() {
                assert!(tc["id"].as_str().unwrap().starts_with("call_"), "{tc}");
                calls.push(json!({"id": tc["id"], "type": tc["type"], "function": {"name": tc["function"]["name"], "arguments": ""}}));
            }
            let args = calls[i]["function"]["arguments"].as_str().unwrap().to_string();
            calls[i]["function"]["arguments"] = json!(args + tc["function"]["arguments"].as_str().unwrap_or(""));
        }
        if let Some(r) = ch["finish_reason"].as_str() {
            reason = r.to_string();
        }
    }
    (content, calls, reason)
}

/// Qwen2.5's template (from the GGUF) renders the tools itself: the `<tools>` block holds each
/// tool as JSON (Python's json.dumps separators), and history tool calls and tool results take
/// Qwen's forms. SmolLM2's template does not mention tools.
#[test]
fn qwen_template_renders_tools_and_history() {
    let tok = Tokenizer::from_path(&common::qwen25_coder()).unwrap();
    assert!(tok.chat_template_supports_tools());
    let mut call = ChatMessage::new("assistant", "");
    call.tool_calls = Some(vec![json!({"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}})]);
    let mut result = ChatMessage::new("tool", "{\"temperature_c\": 18}");
    result.tool_call_id = Some("call_1".into());
    let msgs = [ChatMessage::new("user", "Weather in Paris?"), call, result];
    let text = tok.apply_chat_template_with_tools(&msgs, Some(&[weather_tool()]), true).unwrap();
    // Keys in the request's order, as Python's json.dumps writes a dict (transformers, vLLM).
    let tool_json = "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Get the \
                     current weather in a given city\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": \
                     {\"type\": \"string\", \"description\": \"The city name\"}}, \"required\": [\"city\"]}}}";
    let want_system = format!(
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n\
         You may call one or more functions to assist with the user query.\n\nYou are provided with function \
         signatures within <tools></tools> XML tags:\n<tools>\n{tool_json}\n</tools>\n\n"
    );
    assert!(text.starts_with(&want_system), "{text}");
    let want_tail = "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n\
                     {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n\
                     <|im_start|>user\n<tool_response>\n{\"temperature_c\": 18}\n</tool_response><|im_end|>\n\
                     <|im_start|>assistant\n";
    assert!(text.ends_with(want_tail), "{text}");
    // Without tools the template renders as before.
    let plain = tok.apply_chat_template(&msgs[..1], true).unwrap();
    assert!(!plain.contains("<tools>"), "{plain}");

    let smol = Tokenizer::from_path(&common::smollm2()).unwrap();
    assert!(!smol.chat_template_supports_tools());
}

/// On tiny-qwen2 (a template without tools): tool requests are validated (400s naming the
/// field), rendered with the generic Hermes-style system prompt, and answered 200 (random
/// weights: no call is expected; the content is the text as generated).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validation_and_generic_rendering() {
    let cfg = EngineConfig {
        max_num_batched_tokens: 256,
        max_sequence_length: 1024,
        total_cache_size: 8 << 20,
        ..Default::default()
    };
    let srv = serve(&tiny(), cfg).await;
    let chat = "/v1/chat/completions";
    let user = json!([{"role": "user", "content": "Weather in Paris?"}]);
    let w = weather_tool();
    let call = |args: Value| {
        json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]})
    };
    let history =
        |args: Value| json!([user[0], call(args), {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]);
    for (body, param) in [
        (json!({"messages": user, "tools": {"a": 1}}), "tools"),
        (json!({"messages": user, "tools": [{"type": "function"}]}), "tools[0].function"),
        (json!({"messages": user, "tools": [{"type": "code_interpreter"}]}), "tools[0].type"),
        (
            json!({"messages": user, "tools": [{"type": "function", "function": {"name": "get weather"}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"messages": user, "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}),
            "tools[0].function.parameters",
        ),
        (json!({"messages": user, "tools": [w, w]}), "tools[1].function.name"),
        (json!({"messages": user, "tools": [w], "tool_choice": "sometimes"}), "tool_choice"),
        (
            json!({"messages": user, "tools": [w], "tool_choice": {"type": "function", "function": {"name": "f"}}}),
            "tool_choice",
        ),
        (json!({"messages": user, "tool_choice": "required"}), "tool_choice"),
        (json!({"messages": user, "tools": [w], "parallel_tool_calls": 1}), "parallel_tool_calls"),
        (
            json!({"messages": history(json!("{not json")), "tools": [w]}),
            "messages[1].tool_calls[0].function.arguments",
        ),
        (json!({"messages": [user[0], {"role": "tool", "content": "18 C"}]}), "messages[1].tool_call_id"),
        (json!({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}), "messages[0].tool_calls"),
    ] {
        for route in [chat, "/tokenize"] {
            let (s, v) = srv.post(route, &body).await;
            assert_eq!(s, StatusCode::BAD_REQUEST, "{route} {body}: {v}");
            assert_eq!(v["error"]["param"], param, "{route} {body}: {v}");
            assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        }
    }
    let (s, v) = srv.post("/v1/completions", &json!({"prompt": "x", "tools": [w]})).await;
    assert_eq!((s, v["error"]["param"].as_str()), (StatusCode::BAD_REQUEST, Some("tools")), "{v}");

    // The generic rendering: the tools in a system message, history calls as <tool_call>
    // blocks, the tool result as a user turn.
    let body = json!({"messages": history(json!("{\"city\": \"Paris\"}")), "tools": [w]});
    let text = srv.rendered(&body).await;
    assert!(text.starts_with("<|im_start|>system\n# Tools\n\nYou may call one or more functions"), "{text}");
    assert!(text.contains("<tools>\n{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"description\":\"Get the current weather"), "{text}");
    assert!(text.contains("<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"));
    assert!(
        text.contains(
            "<|im_start|>assistant\n<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}\n\
             </tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>"
        ),
        "{text}"
    );
    // History alone (no tools in this request) is rendered the same way, without the tool list.
    let text = srv.rendered(&json!({"messages": history(json!({"city": "Paris"}))})).await;
    assert!(!text.contains("<tools>") && text.contains("<tool_response>\n18 C\n</tool_response>"), "{text}");
    // A plain request renders exactly as before.
    let plain = srv.rendered(&json!({"messages": user})).await;
    let tok = Tokenizer::from_path(&tiny()).unwrap();
    let want = tok.apply_chat_template(&[ChatMessage::new("user", "Weather in Paris?")], true).unwrap();
    assert_eq!(plain, want);

    // (tiny-qwen2's context is 512 tokens: a short tool.)
    let f = json!({"type": "function", "function": {"name": "f"}});
    for choice in
        [json!("auto"), json!("none"), json!("required"), json!({"type": "function", "function": {"name": "f"}})]
    {
        let body = json!({"messages": user, "tools": [f], "tool_choice": choice, "max_tokens": 4, "temperature": 0});
        let v = srv.ok(chat, &body).await;
        let ch = &v["choices"][0];
        assert!(ch["message"]["content"].is_string(), "{v}");
        assert!(ch["message"].get("tool_calls").is_none(), "noise made a call? {v}");
        let mut sbody = body.clone();
        sbody["stream"] = json!(true);
        let (content, calls, reason) = reassemble(&srv.stream(&sbody).await);
        assert_eq!((content.unwrap_or_default(), calls.len()), (ch["message"]["content"].as_str().unwrap().into(), 0));
        assert_eq!(reason, ch["finish_reason"].as_str().unwrap());
    }
    let follow = json!([user[0], call(json!("{}")), {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]);
    srv.ok(chat, &json!({"messages": follow, "tools": [f], "max_tokens": 2})).await;
}

/// `tool_choice` "required" or a named function holds even a random-weights model (tiny-qwen2)
/// to a valid call: sampled at temperature 1 with several seeds in one batch, every output is
/// one `<tool_call>` block whose JSON names a permitted function and whose arguments follow its
/// schema (an enum and a bounded integer, no other keys), and the sequence stops there. (The
/// engine is driven directly: the generic tool prompt alone nearly fills tiny-qwen2's 512-token
/// context. Over HTTP, the SmolLM2 checks of tests/openai_e2e.py --structured cover the same.)
#[test]
fn required_and_named_choices_always_call() {
    let c = EngineConfig { max_num_batched_tokens: 256, total_cache_size: 8 << 20, ..Default::default() };
    let e = common::start_engine(&tiny(), &c);
    let tok = e.tokenizer.clone();
    let g = e.grammars().unwrap();
    let params = |key: &str| {
        json!({"type": "object", "additionalProperties": false, "required": ["u", key],
               "properties": {"u": {"enum": ["c", "f"]}, key: {"type": "integer", "minimum": 1, "maximum": 7}}})
    };
    let tool =
        |name: &str, key: &str| json!({"type": "function", "function": {"name": name, "parameters": params(key)}});
    let tools = json!([tool("forecast", "days"), tool("history", "years")]);
    let prompt = tok.encode(&tok.apply_chat_template(&[ChatMessage::new("user", "Weather?")], true).unwrap()).unwrap();
    let named = json!({"type": "function", "function": {"name": "history"}});
    let mut runs = Vec::new();
    for (choice, only) in [(json!("required"), None), (named, Some("history"))] {
        let body = json!({"tools": tools, "tool_choice": choice, "parallel_tool_calls": false});
        let lark = tool_call_grammar(&body, &tok).unwrap().expect("a grammar");
        let spec = ConstraintSpec::Lark(lark);
        // Auto and none impose nothing.
        for free in ["auto", "none"] {
            assert_eq!(tool_call_grammar(&json!({"tools": tools, "tool_choice": free}), &tok).unwrap(), None);
        }
        for seed in 0..6u64 {
            let req = Request {
                prompt: prompt.clone(),
                params: RequestParams {
                    sampling: SamplingParams { temperature: 1.0, seed: Some(seed), ..Default::default() },
                    // (tiny-qwen2's small vocabulary spells most of the call byte by byte.)
                    stop: StopConditions { max_tokens: Some(256), ..Default::default() },
                    constraint: Some(g.compile(&spec).unwrap()),
                    skip_special_tokens: false,
                    ..Default::default()
                },
            };
            runs.push((only, seed, e.submit(req).unwrap()));
        }
    }
    let mut names = std::collections::BTreeSet::new();
    for (only, seed, stream) in runs {
        let out = stream.collect_blocking();
        assert_eq!(out.reason, FinishReason::Stop, "seed {seed}: {:?}", out.text);
        let body = out
            .text
            .strip_prefix("<tool_call>\n")
            .and_then(|t| t.strip_suffix("\n</tool_call>"))
            .unwrap_or_else(|| panic!("seed {seed}: not one call block: {:?}", out.text));
        let call: Value = serde_json::from_str(body).unwrap_or_else(|err| panic!("{body:?}: {err}"));
        let name = call["name"].as_str().unwrap_or_else(|| panic!("{call}"));
        let key = match name {
            "forecast" => "days",
            "history" => "years",
            other => panic!("a call of {other:?}: {call}"),
        };
        if let Some(n) = only {
            assert_eq!(name, n, "{call}");
        }
        names.insert(name.to_string());
        assert_eq!(call.as_object().unwrap().len(), 2, "{call}");
        let args = call["arguments"].as_object().unwrap_or_else(|| panic!("{call}"));
        assert_eq!(args.len(), 2, "{call}");
        assert!(matches!(args["u"].as_str(), Some("c" | "f")), "{call}");
        assert!(args[key].as_i64().is_some_and(|d| (1..=7).contains(&d)), "{call}");
    }
    eprintln!("functions called: {names:?}");
}

fn qwen_cfg() -> EngineConfig {
    EngineConfig {
        max_num_batched_tokens: 256,
        max_sequence_length: 1024,
        total_cache_size: 64 << 20,
        max_decode_batch_size: 2,
        max_prefill_batch_size: 1,
        ..Default::default()
    }
}

/// Qwen2.5-Coder-0.5B-Instruct, asked for the weather with `tool_choice: auto`, answers (greedy)
/// with the call as a bare JSON object, without the `<tool_call>` tags its template asks for
/// (`{"name": "get_weather", "arguments": {"city": "Paris"}}`, 17 tokens): it comes back as
/// OpenAI `tool_calls` with `finish_reason: "tool_calls"` and null content, streamed deltas
/// reassemble to the same call, `tool_choice: none` leaves the text as content, and the
/// follow-up turn with the tool's result is accepted and rendered into the prompt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qwen_tool_call_round_trip() {
    let srv = serve(&common::qwen25_coder(), qwen_cfg()).await;
    let messages = json!([{"role": "user", "content": "What is the weather in Paris? Use the get_weather tool."}]);
    let body = json!({"messages": messages, "tools": [weather_tool()], "tool_choice": "auto",
                      "max_tokens": 48, "temperature": 0});
    let t = std::time::Instant::now();
    let v = srv.ok("/v1/chat/completions", &body).await;
    eprintln!("non-streamed in {:?}: {v}", t.elapsed());
    let ch = &v["choices"][0];
    assert_eq!(ch["finish_reason"], "tool_calls", "{v}");
    let msg = &ch["message"];
    assert!(msg["content"].is_null(), "{v}");
    let calls = msg["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{v}");
    let c = &calls[0];
    let id = c["id"].as_str().unwrap();
    assert!(id.starts_with("call_") && id.len() == 29, "{id}");
    assert_eq!((c["type"].as_str(), c["function"]["name"].as_str()), (Some("function"), Some("get_weather")));
    let args: Value = serde_json::from_str(c["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris"}));

    // Streamed: no markup leaks as content; the deltas reassemble to the same call.
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let chunks = srv.stream(&sbody).await;
    let (content, scalls, reason) = reassemble(&chunks);
    assert_eq!(content, None, "{chunks:?}");
    assert_eq!(reason, "tool_calls");
    assert_eq!(scalls.len(), 1);
    assert_eq!(scalls[0]["function"], c["function"], "{chunks:?}");
    assert_ne!(scalls[0]["id"], c["id"], "ids are fresh per response");

    // A forced call cut by max_tokens: a call whose arguments are cut (finish reason length),
    // streamed or not; never `<tool_call>` markup as content.
    let mut cut = body.clone();
    cut["tool_choice"] = json!("required");
    cut["max_tokens"] = json!(12);
    let v = srv.ok("/v1/chat/completions", &cut).await;
    let ch = &v["choices"][0];
    assert_eq!(ch["finish_reason"], "length", "{v}");
    assert!(ch["message"]["content"].as_str().is_none_or(|c| !c.contains("tool_call")), "{v}");
    let calls = ch["message"]["tool_calls"].as_array().expect("a cut call");
    assert_eq!(calls[0]["function"]["name"], "get_weather", "{v}");
    let args = calls[0]["function"]["arguments"].as_str().unwrap();
    assert!(args.is_empty() || args.starts_with('{') && serde_json::from_str::<Value>(args).is_err(), "{v}");
    cut["stream"] = json!(true);
    let chunks = srv.stream(&cut).await;
    let (content, scalls, reason) = reassemble(&chunks);
    assert_eq!((content, reason.as_str()), (None, "length"), "{chunks:?}");
    assert_eq!(scalls.len(), 1, "{chunks:?}");
    assert_eq!(scalls[0]["function"], calls[0]["function"], "{chunks:?}");

    // With tool_choice none the tools are rendered but the output is not parsed.
    let mut nbody = body.clone();
    nbody["tool_choice"] = json!("none");
    let v = srv.ok("/v1/chat/completions", &nbody).await;
    assert!(v["choices"][0]["message"].get("tool_calls").is_none(), "{v}");
    assert!(v["choices"][0]["message"]["content"].as_str().unwrap().contains("get_weather"), "{v}");

    // The follow-up turn: the assistant's call and the tool's result.
    let follow = json!([messages[0], msg, {"role": "tool", "tool_call_id": id, "content": "{\"temperature_c\": 18, \"sky\": \"sunny\"}"}]);
    let fbody = json!({"messages": follow, "tools": [weather_tool()], "max_tokens": 24, "temperature": 0});
    let text = srv.rendered(&json!({"messages": follow, "tools": [weather_tool()]})).await;
    assert!(
        text.ends_with(
            "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n\
             </tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{\"temperature_c\": 18, \"sky\": \"sunny\"}\n\
             </tool_response><|im_end|>\n<|im_start|>assistant\n"
        ),
        "{text}"
    );
    let v = srv.ok("/v1/chat/completions", &fbody).await;
    eprintln!("follow-up: {v}");
    assert!(v["choices"][0]["message"]["content"].is_string(), "{v}");

    // The official openai client: tool_choice "required", streamed and not, arguments valid
    // against the schema, and the follow-up turn (tests/openai_e2e.py --tool-model).
    let base = format!("{}/v1", srv.base);
    tokio::task::spawn_blocking(move || common::openai_e2e(&base, &["--tool-model"])).await.unwrap();
}
