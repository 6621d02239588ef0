//! Ollama's API, as desktop apps and editor plugins speak it: `POST /api/chat` and
//! `/api/generate` (streamed as NDJSON by default, `"stream": false` for one object), with
//! `options` mapped to the sampling fields (`num_predict`, `temperature`, `top_p`, `top_k`,
//! `min_p`, `seed`, `stop`, `repeat_penalty`, `presence_penalty`, `frequency_penalty`; the
//! others, such as `num_ctx`, do not apply and are ignored), `format` (`"json"` or a JSON
//! schema) through structured outputs, `think`, and tools; and the model routes (`info`).
//! Model names may carry Ollama's `:latest` tag. Errors are `{"error": "..."}`.

use super::access::AccessRecord;
use super::embeddings::EmbedApi;
use super::error::{ApiError, Dialect};
use super::openai::within;
use super::params::type_name;
use super::prepare::{Route, Translated};
use super::turn::{arguments_value, stream_response, Part, Turn, TurnEvent, Whole};
use super::AppState;
use crate::engine::{FinishReason, Usage};
use axum::body::{Body, Bytes};
use axum::extract::{Extension, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::{any, delete, get, post};
use axum::{Json, Router};
use serde_json::{json, Map, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(super) mod info;
mod pull;

pub(super) fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/api/chat", post(chat))
        .route("/api/generate", post(generate))
        .route("/api/embed", post(embed))
        .route("/api/embeddings", post(embeddings_legacy))
        .route("/api/tags", get(info::tags))
        .route("/api/show", post(info::show))
        .route("/api/version", get(info::version))
        .route("/api/ps", get(info::ps))
        .route("/api/pull", post(pull::pull))
        .route("/api/delete", delete(info::unsupported))
        .route("/api/push", post(info::unsupported))
        .route("/api/create", post(info::unsupported))
        .route("/api/copy", post(info::unsupported))
        .route("/api/blobs/{digest}", any(info::unsupported))
}

type Log = Option<Extension<AccessRecord>>;

/// The code of the error that stands for an empty `/api/generate` (Ollama's "load the model").
const LOAD_ONLY: &str = "ollama_load_only";

async fn chat(st: State<Arc<AppState>>, log: Log, headers: HeaderMap, body: Body) -> Response {
    run(st, log, headers, body, true).await
}

async fn generate(st: State<Arc<AppState>>, log: Log, headers: HeaderMap, body: Body) -> Response {
    run(st, log, headers, body, false).await
}

async fn run(State(st): State<Arc<AppState>>, log: Log, headers: HeaderMap, body: Body, chat: bool) -> Response {
    let t0 = Instant::now();
    let log = log.map(|l| l.0).unwrap_or_default();
    let translate = if chat { translate_chat } else { translate_generate };
    let r = within(&st, t0, st.cfg.request_timeout, async {
        let turn = Turn::start(&st, &headers, body, t0, &log, translate).await?;
        let mut out =
            Out { model: st.cfg.served_model_name.clone(), chat, t0, first: None, prompt: turn.prompt_tokens };
        if turn.stream {
            return Ok(stream_response(vec![], turn.events(), move |e| out.render(e), "application/x-ndjson"));
        }
        let w: Whole = turn.whole().await?;
        // The prompt's evaluation ended with the first token, not when the whole answer came.
        out.first = w.first;
        let mut v = out.chunk(&w.parts);
        out.finish(&mut v, &w.reason, &w.usage);
        Ok(Json(v).into_response())
    })
    .await;
    match r {
        Err(e) if e.code == Some(LOAD_ONLY) => {
            let m = st.cfg.served_model_name.clone();
            let mut v = json!({"model": m, "created_at": info::rfc3339(std::time::SystemTime::now()), "done": true, "done_reason": "load"});
            v[if chat { "message" } else { "response" }] =
                if chat { json!({"role": "assistant", "content": ""}) } else { json!("") };
            Json(v).into_response()
        }
        r => r.unwrap_or_else(|e| e.response_in(Dialect::Ollama)),
    }
}

/// `/api/embed`: `input` (a string or strings) -> `embeddings`.
async fn embed(State(st): State<Arc<AppState>>, log: Log, headers: HeaderMap, body: Body) -> Response {
    let t0 = Instant::now();
    let log = log.map(|l| l.0).unwrap_or_default();
    let r = within(
        &st,
        t0,
        st.cfg.request_timeout,
        super::embeddings::embed(&st, &headers, body, t0, &log, EmbedApi::OllamaEmbed),
    )
    .await;
    match r {
        Ok((_, vs)) => Json(json!({
            "model": st.cfg.served_model_name,
            "embeddings": vs.iter().map(|(v, _)| v).collect::<Vec<_>>(),
            "total_duration": t0.elapsed().as_nanos() as u64,
            "load_duration": 0,
            "prompt_eval_count": vs.iter().map(|(_, n)| n).sum::<usize>(),
        }))
        .into_response(),
        Err(e) => e.response_in(Dialect::Ollama),
    }
}

/// The older `/api/embeddings`: one `prompt` -> `embedding`.
async fn embeddings_legacy(State(st): State<Arc<AppState>>, log: Log, headers: HeaderMap, body: Body) -> Response {
    let t0 = Instant::now();
    let log = log.map(|l| l.0).unwrap_or_default();
    let r = within(
        &st,
        t0,
        st.cfg.request_timeout,
        super::embeddings::embed(&st, &headers, body, t0, &log, EmbedApi::OllamaLegacy),
    )
    .await;
    match r {
        Ok((_, vs)) => {
            Json(json!({"embedding": vs.first().map(|(v, _)| v.clone()).unwrap_or_default()})).into_response()
        }
        Err(e) => e.response_in(Dialect::Ollama),
    }
}

/// Renders a turn as Ollama objects.
struct Out {
    model: String,
    chat: bool,
    t0: Instant,
    /// When the first output came (the prompt's evaluation ends there).
    first: Option<Instant>,
    prompt: usize,
}

impl Out {
    /// One object holding `parts` (`done: false`).
    fn chunk(&mut self, parts: &[Part]) -> Value {
        self.first.get_or_insert_with(Instant::now);
        let (mut text, mut thinking, mut calls) = (String::new(), String::new(), Vec::new());
        for p in parts {
            match p {
                Part::Reasoning(t) => thinking.push_str(t),
                Part::Text(t) => text.push_str(t),
                Part::Call(c) => calls.push(json!({"function": {"name": c.name, "arguments": arguments_value(c)}})),
            }
        }
        let mut v = json!({"model": self.model, "created_at": info::rfc3339(std::time::SystemTime::now())});
        if self.chat {
            let mut m = json!({"role": "assistant", "content": text});
            if !thinking.is_empty() {
                m["thinking"] = json!(thinking);
            }
            if !calls.is_empty() {
                m["tool_calls"] = json!(calls);
            }
            v["message"] = m;
        } else {
            v["response"] = json!(text);
            if !thinking.is_empty() {
                v["thinking"] = json!(thinking);
            }
        }
        v["done"] = json!(false);
        v
    }

    /// Marks `v` as the last object, with the counts and durations (nanoseconds).
    fn finish(&self, v: &mut Value, reason: &FinishReason, u: &Usage) {
        let now = Instant::now();
        let first = self.first.unwrap_or(now);
        let ns = |d: Duration| d.as_nanos() as u64;
        v["done"] = json!(true);
        v["done_reason"] = json!(if matches!(reason, FinishReason::Length) { "length" } else { "stop" });
        v["total_duration"] = json!(ns(now - self.t0));
        v["load_duration"] = json!(0);
        v["prompt_eval_count"] = json!(self.prompt.max(u.prompt_tokens));
        v["prompt_eval_duration"] = json!(ns(first.saturating_duration_since(self.t0)));
        v["eval_count"] = json!(u.completion_tokens);
        v["eval_duration"] = json!(ns(now.saturating_duration_since(first)));
    }

    fn line(v: &Value) -> Bytes {
        Bytes::from(format!("{v}\n"))
    }

    fn render(&mut self, e: TurnEvent) -> Vec<Bytes> {
        match e {
            TurnEvent::Parts(p) => vec![Self::line(&self.chunk(&p))],
            TurnEvent::KeepAlive => vec![],
            TurnEvent::Done { parts, reason, usage, .. } => {
                let mut out = Vec::new();
                if !parts.is_empty() {
                    out.push(Self::line(&self.chunk(&parts)));
                }
                let mut v = self.chunk(&[]);
                self.finish(&mut v, &reason, &usage);
                out.push(Self::line(&v));
                out
            }
            TurnEvent::Failed(e) => vec![Self::line(&e.body_in(Dialect::Ollama))],
        }
    }
}

fn invalid(param: &str, msg: impl Into<String>) -> ApiError {
    ApiError::invalid(param, msg)
}

/// Ollama's model name without its `:latest` tag.
pub(super) fn model_name(v: &Value) -> Value {
    match v.as_str() {
        Some(s) => json!(s.strip_suffix(":latest").unwrap_or(s)),
        None => v.clone(),
    }
}

/// The chat fields `common` fills from `options` and `format`, as Ollama's clients name them.
macro_rules! ollama_options {
    ($($extra:expr),*) => {
        &[
            ("max_tokens", "options.num_predict"),
            ("temperature", "options.temperature"),
            ("top_p", "options.top_p"),
            ("top_k", "options.top_k"),
            ("min_p", "options.min_p"),
            ("seed", "options.seed"),
            ("stop", "options.stop"),
            ("repetition_penalty", "options.repeat_penalty"),
            ("presence_penalty", "options.presence_penalty"),
            ("frequency_penalty", "options.frequency_penalty"),
            ("response_format", "format"),
            $($extra),*
        ]
    };
}
const OLLAMA_CHAT_FIELDS: &[(&str, &str)] = ollama_options!();
const OLLAMA_GENERATE_FIELDS: &[(&str, &str)] = ollama_options!(("messages", "prompt"));

/// The fields both routes share: model, options, format, think, stream (default true).
fn common(o: &Map<String, Value>, chat: &mut Map<String, Value>) -> Result<(), ApiError> {
    if let Some(m) = o.get("model") {
        chat.insert("model".into(), model_name(m));
    }
    chat.insert("stream".into(), o.get("stream").filter(|v| !v.is_null()).cloned().unwrap_or(json!(true)));
    match o.get("options") {
        None | Some(Value::Null) => {}
        Some(Value::Object(opts)) => {
            for (from, to) in [
                ("temperature", "temperature"),
                ("top_p", "top_p"),
                ("top_k", "top_k"),
                ("min_p", "min_p"),
                ("seed", "seed"),
                ("stop", "stop"),
                ("repeat_penalty", "repetition_penalty"),
                ("presence_penalty", "presence_penalty"),
                ("frequency_penalty", "frequency_penalty"),
            ] {
                if let Some(v) = opts.get(from).filter(|v| !v.is_null()) {
                    chat.insert(to.into(), v.clone());
                }
            }
            // -1 (no limit) and -2 (fill the context): whatever room is left.
            match opts.get("num_predict") {
                Some(n) if n.as_i64().is_some_and(|n| n > 0) => {
                    chat.insert("max_tokens".into(), n.clone());
                }
                None | Some(Value::Null) => {}
                Some(n) if n.as_i64().is_some_and(|n| n == -1 || n == -2) => {}
                Some(n) => {
                    return Err(invalid(
                        "options.num_predict",
                        format!("`num_predict` must be positive, -1 or -2, got {n}"),
                    ))
                }
            }
        }
        Some(v) => return Err(invalid("options", format!("`options` must be an object, got {}", type_name(v)))),
    }
    match o.get("format") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s.is_empty() => {}
        Some(Value::String(s)) if s == "json" => {
            chat.insert("response_format".into(), json!({"type": "json_object"}));
        }
        Some(schema @ Value::Object(_)) => {
            chat.insert(
                "response_format".into(),
                json!({"type": "json_schema", "json_schema": {"name": "format", "schema": schema}}),
            );
        }
        Some(_) => return Err(invalid("format", "`format` must be \"json\" or a JSON schema object")),
    }
    match o.get("think") {
        None | Some(Value::Null) => {}
        Some(Value::Bool(b)) => {
            chat.insert("chat_template_kwargs".into(), json!({"enable_thinking": b}));
        }
        Some(Value::String(s)) if matches!(s.as_str(), "low" | "medium" | "high") => {
            chat.insert("chat_template_kwargs".into(), json!({"enable_thinking": true}));
        }
        Some(_) => return Err(invalid("think", "`think` must be true, false, \"low\", \"medium\" or \"high\"")),
    }
    Ok(())
}

fn no_images(m: &Map<String, Value>, p: &str) -> Result<(), ApiError> {
    match m.get("images") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::Array(a)) if a.is_empty() => Ok(()),
        Some(Value::Array(_)) => {
            Err(invalid(&format!("{p}images"), "images are not supported: this server reads text only"))
        }
        Some(_) => Err(invalid(&format!("{p}images"), "`images` must be a list of base64-encoded images")),
    }
}

/// An `/api/chat` body as a chat body. Ollama's tool calls have no ids: each call gets one,
/// and each `tool` message answers the oldest call not yet answered.
fn translate_chat(o: Map<String, Value>) -> Result<Translated, ApiError> {
    let Some(Value::Array(list)) = o.get("messages") else {
        return Err(invalid("messages", "`messages` must be an array"));
    };
    let mut messages = Vec::with_capacity(list.len());
    let mut pending = std::collections::VecDeque::new();
    for (i, m) in list.iter().enumerate() {
        let p = format!("messages[{i}]");
        let Value::Object(m) = m else { return Err(invalid(&p, format!("`{p}` must be an object"))) };
        no_images(m, &format!("{p}."))?;
        let role = m.get("role").cloned().unwrap_or(Value::Null);
        let content = m.get("content").filter(|c| !c.is_null()).cloned().unwrap_or(json!(""));
        let mut out = json!({"role": role, "content": content});
        // An earlier answer's thinking, given back: the template decides whether it shows it.
        if let Some(t) = m.get("thinking").filter(|t| t.is_string() && role == "assistant") {
            out["reasoning_content"] = t.clone();
        }
        if let Some(Value::Array(calls)) = m.get("tool_calls") {
            let mut with_ids = Vec::new();
            for (j, c) in calls.iter().enumerate() {
                let f = c.get("function").cloned().unwrap_or(Value::Null);
                let id = format!("call_{i}_{j}");
                pending.push_back(id.clone());
                with_ids.push(json!({"id": id, "type": "function", "function": {
                    "name": f.get("name").cloned().unwrap_or(Value::Null),
                    "arguments": f.get("arguments").cloned().unwrap_or(json!({})),
                }}));
            }
            out["tool_calls"] = Value::Array(with_ids);
        }
        if role == "tool" {
            out["tool_call_id"] = json!(pending.pop_front().unwrap_or_else(|| format!("call_{i}")));
            if let Some(n) = m.get("tool_name").filter(|n| n.is_string()) {
                out["name"] = n.clone();
            }
        }
        messages.push(out);
    }
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(messages));
    if let Some(t) = o.get("tools").filter(|t| !t.is_null()) {
        chat.insert("tools".into(), t.clone());
    }
    common(&o, &mut chat)?;
    Ok(Translated {
        body: chat,
        route: Route::Chat,
        echo: Value::Null,
        fields: OLLAMA_CHAT_FIELDS,
        ollama_limits: true,
        fim: None,
    })
}

/// An `/api/generate` body: with `raw`, the prompt as it is (a completion); otherwise a chat
/// turn of `system` and `prompt` through the model's chat template. An empty prompt only
/// "loads the model" (Ollama's answer: `done_reason: "load"`).
fn translate_generate(o: Map<String, Value>) -> Result<Translated, ApiError> {
    let prompt = match o.get("prompt") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(v) => return Err(invalid("prompt", format!("`prompt` must be a string, got {}", type_name(v)))),
    };
    if prompt.is_empty() {
        return Err(invalid("prompt", "an empty prompt only loads the model").code(LOAD_ONLY));
    }
    no_images(&o, "")?;
    for k in ["suffix", "template"] {
        if o.get(k).and_then(Value::as_str).is_some_and(|s| !s.is_empty()) {
            return Err(invalid(k, format!("`{k}` is not supported")));
        }
    }
    let mut body = Map::new();
    let raw = o.get("raw").and_then(Value::as_bool).unwrap_or(false);
    let route = if raw {
        body.insert("prompt".into(), json!(prompt));
        Route::Completions
    } else {
        let mut messages = Vec::new();
        match o.get("system") {
            Some(Value::String(s)) if !s.is_empty() => messages.push(json!({"role": "system", "content": s})),
            None | Some(Value::Null) | Some(Value::String(_)) => {}
            Some(_) => return Err(invalid("system", "`system` must be a string")),
        }
        messages.push(json!({"role": "user", "content": prompt}));
        body.insert("messages".into(), Value::Array(messages));
        Route::Chat
    };
    common(&o, &mut body)?;
    if raw {
        body.remove("chat_template_kwargs");
    }
    Ok(Translated { body, route, echo: Value::Null, fields: OLLAMA_GENERATE_FIELDS, ollama_limits: true, fim: None })
}

#[cfg(test)]
mod tests;
