//! Reasoning output over HTTP: the tiny random Qwen3 (tests/fixtures/tiny-qwen3) served with
//! two thinking chat templates written for these tests: a Qwen3-style one (an
//! `enable_thinking` switch: off closes an empty `<think></think>` in the prompt) and a
//! DeepSeek-R1-style one (the generation prompt opens `<think>`). The model's text is random, so
//! the checks are of shape and consistency: against the same server with `--reasoning-parser
//! none` (the raw text), streamed against whole, through the official `openai` client, and that
//! a grammar waits for the end of the thinking. How a text is split at every boundary is
//! tested in `server::reasoning`.

mod common;

use common::served::{self, TempDir};
use serde_json::{json, Value};
use std::path::Path;
use torus_wgpu::config::EngineConfig;
use torus_wgpu::server::reasoning::ReasoningChoice;
use torus_wgpu::server::ServerHandle;

/// Qwen3-style: ChatML; with `enable_thinking` false the prompt holds an empty thinking span.
const QWEN3_STYLE: &str = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}";
/// DeepSeek-R1-style: the generation prompt opens the thinking span.
const R1_STYLE: &str = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}";

/// A copy of tiny-qwen3 with `template` as its chat template.
fn model_with_template(name: &str, template: &str) -> TempDir {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-qwen3");
    served::with_template(&src, &format!("reasoning-{name}"), template, |_| {})
}

async fn serve(path: &Path, parser: ReasoningChoice) -> (ServerHandle, String) {
    let cfg = EngineConfig {
        max_num_batched_tokens: 256,
        max_sequence_length: 512,
        total_cache_size: 8 << 20,
        ..Default::default()
    };
    served::serve(path, &cfg, parser).await
}

async fn chat(base: &str, extra: Value) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content": "What is 2 + 2?"}],
        "max_tokens": 24,
        "temperature": 0,
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let r = reqwest::Client::new().post(format!("{base}/chat/completions")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

/// A stream's (reasoning, content) deltas joined, and its finish reason.
async fn chat_streamed(base: &str, extra: Value) -> (String, String, String) {
    let mut body = json!({
        "messages": [{"role": "user", "content": "What is 2 + 2?"}],
        "max_tokens": 24,
        "temperature": 0,
        "stream": true,
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let r = reqwest::Client::new().post(format!("{base}/chat/completions")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    served::joined_stream(&r.text().await.unwrap())
}

fn message(v: &Value) -> &Value {
    &v["choices"][0]["message"]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thinking_goes_to_reasoning_content() {
    let r1 = model_with_template("r1", R1_STYLE);
    let qwen = model_with_template("qwen3", QWEN3_STYLE);

    // The DeepSeek-R1-style template opens the span in the prompt, and the random model never
    // closes it: everything is reasoning, the raw text (the same model without a parser) with
    // its leading whitespace dropped.
    let (h_raw, raw_base) = serve(&r1.0, ReasoningChoice::None).await;
    let raw = chat(&raw_base, json!({})).await;
    let raw_text = message(&raw)["content"].as_str().unwrap().to_string();
    assert!(message(&raw).get("reasoning_content").is_none(), "{raw}");
    let raw_json = chat(&raw_base, json!({"response_format": {"type": "json_object"}})).await;
    h_raw.shutdown().await;

    let (h, base) = serve(&r1.0, ReasoningChoice::Auto).await;
    let v = chat(&base, json!({})).await;
    eprintln!("r1-style: {}", message(&v));
    assert!(!raw_text.trim().is_empty());
    assert_eq!(message(&v)["reasoning_content"], json!(raw_text.trim_start()), "{v}");
    assert_eq!(message(&v)["content"], Value::Null, "{v}");
    let (sr, sc, finish) = chat_streamed(&base, json!({})).await;
    assert_eq!((sr.as_str(), sc.as_str(), finish.as_str()), (raw_text.trim_start(), "", "length"));
    // A grammar constrains the answer, not the thinking: the thinking is the unconstrained text,
    // where the parser-less server's json_object output is held to JSON from its first token.
    let j = chat(&base, json!({"response_format": {"type": "json_object"}})).await;
    assert_eq!(message(&j)["reasoning_content"], json!(raw_text.trim_start()), "{j}");
    let raw_json_text = message(&raw_json)["content"].as_str().unwrap();
    assert!(raw_json_text.trim_start().starts_with('{'), "{raw_json}");
    assert_ne!(raw_json_text, raw_text);
    h.shutdown().await;

    // The Qwen3-style template: without `<think>` at the start the output is all content.
    // `chat_template_kwargs` reach the template: thinking off puts the empty span in the prompt.
    let (h, base) = serve(&qwen.0, ReasoningChoice::Auto).await;
    let on = chat(&base, json!({})).await;
    let off = chat(&base, json!({"chat_template_kwargs": {"enable_thinking": false}})).await;
    for v in [&on, &off] {
        assert_eq!(message(v)["reasoning_content"], Value::Null, "{v}");
        assert!(message(v)["content"].as_str().is_some_and(|c| !c.is_empty()), "{v}");
    }
    let (p_on, p_off) =
        (on["usage"]["prompt_tokens"].as_u64().unwrap(), off["usage"]["prompt_tokens"].as_u64().unwrap());
    assert!(p_off > p_on, "enable_thinking false must add the empty span to the prompt: {p_on} vs {p_off}");
    let (sr, sc, _) = chat_streamed(&base, json!({})).await;
    assert_eq!((sr.as_str(), Some(sc.as_str())), ("", message(&on)["content"].as_str()));
    let bad = reqwest::Client::new()
        .post(format!("{base}/chat/completions"))
        .json(&json!({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": [1]}))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    let e: Value = bad.json().await.unwrap();
    assert_eq!(e["error"]["param"], "chat_template_kwargs", "{e}");

    // The official client exposes the field, streamed and not (tests/openai_e2e.py --reasoning).
    let b = base.clone();
    tokio::task::spawn_blocking(move || common::openai_e2e(&b, &["--reasoning"])).await.unwrap();
    h.shutdown().await;
    let (h, base) = serve(&r1.0, ReasoningChoice::Auto).await;
    tokio::task::spawn_blocking(move || common::openai_e2e(&base, &["--reasoning"])).await.unwrap();
    h.shutdown().await;
}

/// Renders an assistant message's `reasoning_content` in a `<think>` span (as Qwen3's own
/// template does for the current tool-use cycle).
const READS_REASONING: &str = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m.reasoning_content is defined %}{{ '<think>' + m.reasoning_content + '</think>' }}{% endif %}{{ m['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Anthropic's `thinking` blocks reach the template within the current tool-use cycle and are
/// dropped from earlier turns (`count_tokens` counts exactly what the prompt holds); OpenAI's
/// `reasoning_content` reaches a template that reads it, and is put back into the content's
/// `<think>` span for one that does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thinking_given_back_reaches_the_template() {
    let reads = model_with_template("reads", READS_REASONING);
    let (_h, base) = serve(&reads.0, ReasoningChoice::None).await;
    let http = reqwest::Client::new();
    let count = |messages: Value| {
        let (http, base) = (http.clone(), base.clone());
        async move {
            let r = http.post(format!("{base}/messages/count_tokens")).json(&json!({"messages": messages})).send();
            let r = r.await.unwrap();
            assert_eq!(r.status(), 200);
            let v: Value = r.json().await.unwrap();
            v["input_tokens"].as_u64().unwrap()
        }
    };
    let thinking = json!({"type": "thinking", "thinking": "alpha beta gamma delta", "signature": "s"});
    let call = json!({"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": 1}});
    let text = json!({"type": "text", "text": "Looking."});
    let result = json!({"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"});
    let cycle = |with: bool| {
        let mut blocks = if with { vec![thinking.clone()] } else { vec![] };
        blocks.extend([text.clone(), call.clone()]);
        json!([
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": blocks},
            {"role": "user", "content": [result.clone()]},
        ])
    };
    let (with, without) = (count(cycle(true)).await, count(cycle(false)).await);
    assert!(with > without + 4, "the current cycle's thinking must be in the prompt: {with} vs {without}");
    // The same assistant message before a new user question: its thinking is dropped.
    let earlier = |with: bool| {
        let mut m = cycle(with);
        m.as_array_mut().unwrap()[2] = json!({"role": "user", "content": "next question"});
        m.as_array_mut().unwrap()[1]["content"] =
            if with { json!([thinking.clone(), text.clone()]) } else { json!([text.clone()]) };
        m
    };
    assert_eq!(count(earlier(true)).await, count(earlier(false)).await, "an earlier turn's thinking is dropped");

    // OpenAI's `reasoning_content`, through llama-server's /apply-template (the prompt text).
    let root = base.trim_end_matches("/v1");
    let apply = |root: String, http: reqwest::Client| async move {
        let messages = json!([
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "A", "reasoning_content": "R"},
            {"role": "user", "content": "q2"},
        ]);
        let r = http.post(format!("{root}/apply-template")).json(&json!({"messages": messages})).send().await.unwrap();
        assert_eq!(r.status(), 200);
        r.json::<Value>().await.unwrap()["prompt"].as_str().unwrap().to_string()
    };
    let p = apply(root.to_string(), http.clone()).await;
    assert!(p.contains("<|im_start|>assistant\n<think>R</think>A<|im_end|>"), "{p}");
    let bad = json!({"messages": [{"role": "user", "content": "q", "reasoning_content": "R"}]});
    let r = http.post(format!("{root}/apply-template")).json(&bad).send().await.unwrap();
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["param"], "messages[0].reasoning_content", "{e}");

    // A template that does not read `reasoning_content` but writes `<think>`: folded into the
    // content's span.
    let folds = model_with_template("folds", QWEN3_STYLE);
    let (_h2, base2) = serve(&folds.0, ReasoningChoice::None).await;
    let p = apply(base2.trim_end_matches("/v1").to_string(), http.clone()).await;
    assert!(p.contains("<|im_start|>assistant\n<think>\nR\n</think>\n\nA<|im_end|>"), "{p}");
}
