//! Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`, as
//! coding agents and Anthropic's SDKs speak it to a local server (llama.cpp's, vLLM's).
//!
//! A request is translated into a chat request (`system` first; text, `tool_use` and
//! `tool_result` blocks into messages, tool calls and tool messages; `tools` with their
//! `input_schema`; `tool_choice` auto / any / tool / none; `stop_sequences`; `thinking` into the
//! chat template's `enable_thinking`) and runs as one; its output comes back as content blocks:
//! `thinking` (the reasoning parser's span), `text` and `tool_use`. Streams follow Anthropic's
//! event sequence (`message_start`, `content_block_start` / `_delta` / `_stop`, `ping`,
//! `message_delta` with `stop_reason`, `message_stop`); errors are in Anthropic's shape. The API
//! key may come as `x-api-key`; `anthropic-version` and `anthropic-beta` are accepted and not
//! needed.

use super::access::AccessRecord;
use super::error::{ApiError, Dialect};
use super::openai::within;
use super::params::type_name;
use super::prepare::{Route, Translated};
use super::turn::{arguments_value, chat_tools, Part, Turn, Whole};
use super::AppState;
use crate::engine::{FinishReason, Usage};
use axum::body::Body;
use axum::extract::{Extension, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Map, Value};
use std::sync::Arc;
use std::time::Instant;

mod stream;

pub(super) fn routes() -> Router<Arc<AppState>> {
    Router::new().route("/v1/messages", post(messages)).route("/v1/messages/count_tokens", post(count_tokens))
}

type Log = Option<Extension<AccessRecord>>;

async fn messages(State(st): State<Arc<AppState>>, log: Log, headers: HeaderMap, body: Body) -> Response {
    let t0 = Instant::now();
    let log = log.map(|l| l.0).unwrap_or_default();
    let limit = st.cfg.request_timeout;
    let r = within(&st, t0, limit, async {
        let turn = Turn::start(&st, &headers, body, t0, &log, translate).await?;
        if turn.stream {
            return Ok(stream::respond(turn));
        }
        let id = message_id(&st);
        let (prompt_tokens, stops) = (turn.prompt_tokens, turn.stops.clone());
        let whole = turn.whole().await?;
        Ok(Json(message_json(&st, &id, prompt_tokens, &whole, &stops)).into_response())
    })
    .await;
    r.unwrap_or_else(|e| e.response_in(Dialect::Anthropic))
}

/// `{"input_tokens": N}`: the prompt the request would be, counted (nothing is generated).
async fn count_tokens(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    let r = async {
        let (_, p, _) = super::prepare::translated(&st, &headers, body, translate_count).await?;
        let n = p.plans.first().map_or(0, |pl| pl.prompt.len());
        Ok::<_, ApiError>(Json(json!({"input_tokens": n})).into_response())
    }
    .await;
    r.unwrap_or_else(|e| e.response_in(Dialect::Anthropic))
}

fn message_id(st: &AppState) -> String {
    let id = st.new_id("msg");
    format!("msg_{}", id.strip_prefix("msg-").unwrap_or(&id))
}

fn tool_use_id(st: &AppState) -> String {
    let id = st.new_id("toolu");
    format!("toolu_{}", id.strip_prefix("toolu-").unwrap_or(&id))
}

/// Anthropic's `stop_reason` for a finish, and the stop sequence that ended it.
fn stop_reason(reason: &FinishReason, calls: usize, u: &Usage, stops: &[String]) -> (&'static str, Value) {
    let seq = u.stop_string.and_then(|i| stops.get(i)).filter(|_| matches!(reason, FinishReason::Stop));
    match (reason, seq) {
        (FinishReason::Length, _) => ("max_tokens", Value::Null),
        _ if calls > 0 => ("tool_use", Value::Null),
        (_, Some(s)) => ("stop_sequence", json!(s)),
        _ => ("end_turn", Value::Null),
    }
}

fn usage_json(prompt_tokens: usize, u: &Usage) -> Value {
    json!({
        "input_tokens": prompt_tokens.saturating_sub(u.cached_tokens),
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": 0,
    })
}

/// A content block for a part (a call gets a fresh `toolu_` id).
fn block(st: &AppState, p: &Part) -> Value {
    match p {
        Part::Reasoning(t) => json!({"type": "thinking", "thinking": t, "signature": ""}),
        Part::Text(t) => json!({"type": "text", "text": t}),
        Part::Call(c) => {
            json!({"type": "tool_use", "id": tool_use_id(st), "name": c.name, "input": arguments_value(c)})
        }
    }
}

fn message_json(st: &AppState, id: &str, prompt_tokens: usize, w: &Whole, stops: &[String]) -> Value {
    let (reason, seq) = stop_reason(&w.reason, w.calls, &w.usage, stops);
    json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": st.cfg.served_model_name,
        "content": w.parts.iter().map(|p| block(st, p)).collect::<Vec<_>>(),
        "stop_reason": reason,
        "stop_sequence": seq,
        "usage": usage_json(prompt_tokens, &w.usage),
    })
}

fn invalid(param: &str, msg: impl Into<String>) -> ApiError {
    ApiError::invalid(param, msg)
}

/// A block list's text (`content` as a string, or text blocks); `what` names the field.
fn text_of(v: &Value, what: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut out = String::new();
            for (i, b) in blocks.iter().enumerate() {
                match (b.get("type").and_then(Value::as_str), b.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => out.push_str(t),
                    _ => {
                        return Err(invalid(&format!("{what}[{i}]"), format!("`{what}[{i}]` must be a text block")));
                    }
                }
            }
            Ok(out)
        }
        v => Err(invalid(what, format!("`{what}` must be a string or an array of text blocks, got {}", type_name(v)))),
    }
}

/// One Anthropic message as chat messages: tool results become `tool` messages (before the
/// rest of the user's turn), an assistant's `tool_use` blocks its `tool_calls`.
fn push_message(out: &mut Vec<Value>, i: usize, m: &Value) -> Result<(), ApiError> {
    let p = format!("messages[{i}]");
    let Value::Object(o) = m else { return Err(invalid(&p, format!("`{p}` must be an object"))) };
    let role = match o.get("role").and_then(Value::as_str) {
        Some(r @ ("user" | "assistant")) => r,
        _ => return Err(invalid(&format!("{p}.role"), format!("`{p}.role` must be \"user\" or \"assistant\""))),
    };
    let pc = format!("{p}.content");
    let blocks = match o.get("content") {
        Some(Value::String(s)) => {
            out.push(json!({"role": role, "content": s}));
            return Ok(());
        }
        Some(Value::Array(b)) => b,
        _ => return Err(invalid(&pc, format!("`{pc}` must be a string or an array of content blocks"))),
    };
    let (mut text, mut thinking) = (String::new(), String::new());
    let mut calls = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let pb = format!("{pc}[{j}]");
        let kind = b.get("type").and_then(Value::as_str).unwrap_or_default();
        match (kind, role) {
            ("text", _) => text.push_str(
                b.get("text").and_then(Value::as_str).ok_or_else(|| invalid(&pb, "a text block needs `text`"))?,
            ),
            // Thinking goes to the template as `reasoning_content`; `translate` drops it from
            // turns before the current tool-use cycle (as Anthropic's own API does). Redacted
            // thinking is encrypted elsewhere: nothing a model here can read.
            ("thinking", "assistant") => thinking.push_str(
                b.get("thinking")
                    .and_then(Value::as_str)
                    .ok_or_else(|| invalid(&pb, "a thinking block needs `thinking`"))?,
            ),
            ("redacted_thinking", "assistant") => {}
            ("tool_use", "assistant") => {
                let id = b.get("id").and_then(Value::as_str).ok_or_else(|| invalid(&pb, "`tool_use` needs an `id`"))?;
                let name =
                    b.get("name").and_then(Value::as_str).ok_or_else(|| invalid(&pb, "`tool_use` needs a `name`"))?;
                let input = b.get("input").cloned().unwrap_or_else(|| json!({}));
                if !input.is_object() {
                    return Err(invalid(&format!("{pb}.input"), "`input` must be an object"));
                }
                calls.push(json!({"id": id, "type": "function", "function": {"name": name, "arguments": input}}));
            }
            ("tool_result", "user") => {
                let id = b
                    .get("tool_use_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| invalid(&pb, "`tool_result` needs a `tool_use_id`"))?;
                let mut content = match b.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(v) => text_of(v, &format!("{pb}.content"))?,
                };
                if b.get("is_error") == Some(&Value::Bool(true)) {
                    content = format!("Error: {content}");
                }
                out.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
            }
            ("image" | "document", _) => {
                return Err(invalid(&pb, format!("`{kind}` blocks are not supported: this server reads text only")))
            }
            _ => return Err(invalid(&pb, format!("a {role} message cannot hold a block of type {kind:?}"))),
        }
    }
    if !calls.is_empty() {
        let content = if text.is_empty() { Value::Null } else { Value::String(text) };
        out.push(json!({"role": "assistant", "content": content, "tool_calls": calls}));
    } else if !text.is_empty() || role == "assistant" || !blocks.iter().any(|b| b["type"] == "tool_result") {
        out.push(json!({"role": role, "content": text}));
    }
    if !thinking.is_empty() {
        if let Some(last) = out.last_mut() {
            last["reasoning_content"] = Value::String(thinking);
        }
    }
    Ok(())
}

/// Drop the thinking of assistant turns that ended before the last user message: only the
/// current tool-use cycle (the assistant messages and tool results after it) keeps its thinking,
/// which a reasoning model must see to go on where it left off between calls.
fn keep_current_thinking(messages: &mut [Value]) {
    let Some(last_user) = messages.iter().rposition(|m| m["role"] == "user") else { return };
    for m in &mut messages[..last_user] {
        if let Some(o) = m.as_object_mut() {
            o.remove("reasoning_content");
        }
    }
}

fn translate_tools(v: &Value) -> Result<Vec<Value>, ApiError> {
    let check = |t: Option<&str>| match t {
        None | Some("custom") => None,
        Some(k) => {
            Some(format!("server tools ({k:?}) are not available here; define client tools with `input_schema`"))
        }
    };
    chat_tools(v, check, &[("name", "name"), ("description", "description"), ("input_schema", "parameters")])
}

/// `tool_choice` as the chat request's, and whether parallel calls are off.
fn translate_tool_choice(v: &Value) -> Result<(Value, bool), ApiError> {
    let off = v.get("disable_parallel_tool_use").and_then(Value::as_bool).unwrap_or(false);
    let choice = match v.get("type").and_then(Value::as_str) {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => match v.get("name").and_then(Value::as_str) {
            Some(n) => json!({"type": "function", "function": {"name": n}}),
            None => return Err(invalid("tool_choice.name", "`tool_choice` of type \"tool\" needs a `name`")),
        },
        _ => return Err(invalid(
            "tool_choice",
            "`tool_choice` must be {\"type\": \"auto\" | \"any\" | \"none\"} or {\"type\": \"tool\", \"name\": ...}",
        )),
    };
    Ok((choice, off))
}

/// An Anthropic Messages body as a chat body.
fn translate(mut o: Map<String, Value>) -> Result<Translated, ApiError> {
    let mut chat = Map::new();
    let mut messages = Vec::new();
    match o.get("system") {
        None | Some(Value::Null) => {}
        Some(v) => messages.push(json!({"role": "system", "content": text_of(v, "system")?})),
    }
    match o.get("messages") {
        Some(Value::Array(list)) if !list.is_empty() => {
            for (i, m) in list.iter().enumerate() {
                push_message(&mut messages, i, m)?;
            }
            keep_current_thinking(&mut messages);
        }
        _ => return Err(invalid("messages", "`messages` must be a non-empty array")),
    }
    chat.insert("messages".into(), Value::Array(messages));
    if let Some(t) = o.get("tools").filter(|t| !t.is_null()) {
        chat.insert("tools".into(), Value::Array(translate_tools(t)?));
    }
    if let Some(tc) = o.get("tool_choice").filter(|t| !t.is_null()) {
        let (choice, no_parallel) = translate_tool_choice(tc)?;
        chat.insert("tool_choice".into(), choice);
        if no_parallel {
            chat.insert("parallel_tool_calls".into(), json!(false));
        }
    }
    match o.get("thinking").filter(|t| !t.is_null()) {
        None => {}
        Some(t) => {
            let on = match t.get("type").and_then(Value::as_str) {
                Some("enabled" | "adaptive") => true,
                Some("disabled") => false,
                _ => return Err(invalid("thinking.type", "`thinking.type` must be \"enabled\" or \"disabled\"")),
            };
            chat.insert("chat_template_kwargs".into(), json!({"enable_thinking": on}));
        }
    }
    if let Some(rf) = output_format(&o)? {
        chat.insert("response_format".into(), rf);
    }
    for (from, to) in [
        ("model", "model"),
        ("max_tokens", "max_tokens"),
        ("stop_sequences", "stop"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("stream", "stream"),
    ] {
        if let Some(v) = o.remove(from) {
            chat.insert(to.into(), v);
        }
    }
    Ok(Translated {
        body: chat,
        route: Route::Chat,
        echo: Value::Null,
        fields: ANTHROPIC_FIELDS,
        ollama_limits: false,
        fim: None,
    })
}

/// The chat fields the translation renamed, as Anthropic's clients name them.
const ANTHROPIC_FIELDS: &[(&str, &str)] =
    &[("stop", "stop_sequences"), ("response_format", "output_config.format"), ("chat_template_kwargs", "thinking")];

/// Structured outputs: `output_config.format` (or the older `output_format`) of type
/// `json_schema` as the chat's `response_format` (the grammar constrains the answer); anything
/// else there is a 400, never ignored.
fn output_format(o: &Map<String, Value>) -> Result<Option<Value>, ApiError> {
    let (f, at) = match (o.get("output_config").filter(|c| !c.is_null()), o.get("output_format")) {
        (Some(Value::Object(c)), _) => match c.get("format").filter(|f| !f.is_null()) {
            Some(f) => (f, "output_config.format"),
            None => return Ok(None),
        },
        (Some(_), _) => return Err(invalid("output_config", "`output_config` must be an object")),
        (None, Some(f)) if !f.is_null() => (f, "output_format"),
        (None, _) => return Ok(None),
    };
    match f.get("type").and_then(Value::as_str) {
        Some("json_schema") => {}
        _ => return Err(invalid(&format!("{at}.type"), format!("`{at}.type` must be \"json_schema\""))),
    }
    let Some(schema) = f.get("schema").filter(|s| s.is_object()) else {
        return Err(invalid(&format!("{at}.schema"), format!("`{at}.schema` must be a JSON schema object")));
    };
    Ok(Some(json!({"type": "json_schema", "json_schema": {"name": "output", "schema": schema, "strict": true}})))
}

/// As [`translate`], without streaming or a length limit on the answer (counting only).
fn translate_count(o: Map<String, Value>) -> Result<Translated, ApiError> {
    let mut t = translate(o)?;
    t.body.remove("stream");
    t.body.remove("max_tokens");
    Ok(t)
}

#[cfg(test)]
mod tests;
