//! OpenAI's Responses API, stateless: `POST /v1/responses`.
//!
//! `input` (text, or items: messages, `function_call`, `function_call_output`) and
//! `instructions` become a chat request; function `tools`, `tool_choice`,
//! `parallel_tool_calls`, `max_output_tokens`, `temperature`, `top_p` and `text.format`
//! (`json_schema` and `json_object`, through structured outputs) carry over. The output is
//! items: `reasoning` (the reasoning parser's span), a `message` with `output_text`, and
//! `function_call`s. With `stream` the typed events come (`response.created`,
//! `response.output_item.added`, `response.output_text.delta`,
//! `response.function_call_arguments.delta`, ..., `response.completed`). Nothing is stored:
//! `previous_response_id` and `background` get a 400 saying so (send the whole conversation).

use super::access::AccessRecord;
use super::error::ApiError;
use super::openai::within;
use super::params::type_name;
use super::prepare::{Route, Translated};
use super::turn::{chat_tools, Part, Turn, Whole};
use super::{unix_now, AppState};
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
    Router::new().route("/v1/responses", post(responses))
}

type Log = Option<Extension<AccessRecord>>;

async fn responses(State(st): State<Arc<AppState>>, log: Log, headers: HeaderMap, body: Body) -> Response {
    let t0 = Instant::now();
    let log = log.map(|l| l.0).unwrap_or_default();
    let limit = st.cfg.request_timeout;
    let r = within(&st, t0, limit, async {
        let turn = Turn::start(&st, &headers, body, t0, &log, translate).await?;
        let head = Head::new(&st, turn.echo.clone(), turn.prompt_tokens);
        if turn.stream {
            return Ok(stream::respond(turn, head));
        }
        let whole = turn.whole().await?;
        let items = output_items(&st, &whole.parts);
        Ok(Json(head.response(&whole, items)).into_response())
    })
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

/// A fresh item id: `prefix_` and hex digits.
fn item_id(st: &AppState, prefix: &str) -> String {
    let id = st.new_id(prefix);
    format!("{prefix}_{}", id.strip_prefix(&format!("{prefix}-")).unwrap_or(&id))
}

/// What every response object of one request carries.
pub(super) struct Head {
    id: String,
    created: u64,
    model: String,
    echo: Value,
    prompt_tokens: usize,
}

impl Head {
    fn new(st: &AppState, echo: Value, prompt_tokens: usize) -> Head {
        Head {
            id: item_id(st, "resp"),
            created: unix_now(),
            model: st.cfg.served_model_name.clone(),
            echo,
            prompt_tokens,
        }
    }

    /// The response object with `status`, `output` and `usage`.
    fn object(&self, status: &str, output: Vec<Value>, usage: Option<&Usage>, incomplete: bool) -> Value {
        let e = |k: &str, default: Value| self.echo.get(k).filter(|v| !v.is_null()).cloned().unwrap_or(default);
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": null,
            "incomplete_details": if incomplete { json!({"reason": "max_output_tokens"}) } else { Value::Null },
            "instructions": e("instructions", Value::Null),
            "max_output_tokens": e("max_output_tokens", Value::Null),
            "metadata": e("metadata", json!({})),
            "model": self.model,
            "output": output,
            "parallel_tool_calls": e("parallel_tool_calls", json!(true)),
            "previous_response_id": null,
            "reasoning": e("reasoning", Value::Null),
            "store": false,
            "temperature": e("temperature", Value::Null),
            "text": e("text", json!({"format": {"type": "text"}})),
            "tool_choice": e("tool_choice", json!("auto")),
            "tools": e("tools", json!([])),
            "top_p": e("top_p", Value::Null),
            "truncation": "disabled",
            "usage": usage.map(|u| usage_json(self.prompt_tokens, u)),
        })
    }

    /// The finished response.
    fn response(&self, w: &Whole, output: Vec<Value>) -> Value {
        let incomplete = matches!(w.reason, FinishReason::Length);
        self.object(if incomplete { "incomplete" } else { "completed" }, output, Some(&w.usage), incomplete)
    }
}

fn usage_json(prompt_tokens: usize, u: &Usage) -> Value {
    json!({
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + u.completion_tokens,
    })
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    let content = if status == "in_progress" { json!([]) } else { json!([text_part(text)]) };
    json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": content})
}

fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

fn reasoning_item(id: &str, text: &str, status: &str) -> Value {
    let content = if status == "in_progress" { json!([]) } else { json!([reasoning_part(text)]) };
    json!({"type": "reasoning", "id": id, "summary": [], "content": content, "status": status})
}

fn reasoning_part(text: &str) -> Value {
    json!({"type": "reasoning_text", "text": text})
}

fn call_item(id: &str, call_id: &str, name: &str, arguments: &str, status: &str) -> Value {
    json!({"type": "function_call", "id": id, "call_id": call_id, "name": name, "arguments": arguments, "status": status})
}

/// A whole turn's output items.
fn output_items(st: &AppState, parts: &[Part]) -> Vec<Value> {
    parts
        .iter()
        .map(|p| match p {
            Part::Reasoning(t) => reasoning_item(&item_id(st, "rs"), t, "completed"),
            Part::Text(t) => message_item(&item_id(st, "msg"), t, "completed"),
            Part::Call(c) => call_item(&item_id(st, "fc"), &item_id(st, "call"), &c.name, &c.arguments, "completed"),
        })
        .collect()
}

fn invalid(param: &str, msg: impl Into<String>) -> ApiError {
    ApiError::invalid(param, msg)
}

/// A message item's text (a string, or text parts).
fn item_text(v: Option<&Value>, p: &str) -> Result<String, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut out = String::new();
            for (i, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str).unwrap_or_default();
                match (kind, part.get("text").and_then(Value::as_str)) {
                    ("input_text" | "output_text" | "text" | "summary_text", Some(t)) => out.push_str(t),
                    ("refusal", _) => {}
                    _ => {
                        return Err(invalid(
                            &format!("{p}[{i}]"),
                            format!("content parts of type {kind:?} are not supported: this server reads text only"),
                        ))
                    }
                }
            }
            Ok(out)
        }
        Some(v) => Err(invalid(p, format!("`{p}` must be a string or an array of parts, got {}", type_name(v)))),
    }
}

fn input_messages(input: &Value, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let items = match input {
        Value::String(s) => {
            out.push(json!({"role": "user", "content": s}));
            return Ok(());
        }
        Value::Array(items) if !items.is_empty() => items,
        _ => return Err(invalid("input", "`input` must be a string or a non-empty array of items")),
    };
    for (i, item) in items.iter().enumerate() {
        let p = format!("input[{i}]");
        let Value::Object(o) = item else { return Err(invalid(&p, format!("`{p}` must be an object"))) };
        let s = |k: &str| o.get(k).and_then(Value::as_str);
        match s("type").unwrap_or("message") {
            "message" => {
                let role = match s("role") {
                    Some(r @ ("user" | "system" | "developer" | "assistant")) => r,
                    _ => {
                        return Err(invalid(
                            &format!("{p}.role"),
                            "`role` must be \"user\", \"system\", \"developer\" or \"assistant\"",
                        ))
                    }
                };
                out.push(json!({"role": role, "content": item_text(o.get("content"), &format!("{p}.content"))?}));
            }
            "function_call" => {
                let (Some(call_id), Some(name)) = (s("call_id"), s("name")) else {
                    return Err(invalid(&p, "a `function_call` item needs `call_id` and `name`"));
                };
                let call = json!({"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": s("arguments").unwrap_or("{}")}});
                match out.last_mut() {
                    Some(m) if m["role"] == "assistant" => {
                        let calls = m.as_object_mut().expect("an object").entry("tool_calls").or_insert(json!([]));
                        calls.as_array_mut().expect("an array").push(call);
                    }
                    _ => out.push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
                }
            }
            "function_call_output" => {
                let Some(call_id) = s("call_id") else {
                    return Err(invalid(&p, "a `function_call_output` item needs `call_id`"));
                };
                let content = item_text(o.get("output"), &format!("{p}.output"))?;
                out.push(json!({"role": "tool", "tool_call_id": call_id, "content": content}));
            }
            // Earlier reasoning is not shown to the model again.
            "reasoning" => {}
            "item_reference" => {
                return Err(invalid(&p, "item references need stored responses, and this server stores none"))
            }
            other => {
                return Err(invalid(&format!("{p}.type"), format!("input items of type {other:?} are not supported")))
            }
        }
    }
    Ok(())
}

fn translate_tools(v: &Value) -> Result<Vec<Value>, ApiError> {
    let check = |t: Option<&str>| match t {
        Some("function") => None,
        other => Some(format!("only function tools are available here, got {other:?}")),
    };
    let fields = [("name", "name"), ("description", "description"), ("parameters", "parameters"), ("strict", "strict")];
    chat_tools(v, check, &fields)
}

fn translate_format(text: &Value) -> Result<Option<Value>, ApiError> {
    let Some(f) = text.get("format").filter(|f| !f.is_null()) else { return Ok(None) };
    Ok(match f.get("type").and_then(Value::as_str) {
        Some("text") => None,
        Some("json_object") => Some(json!({"type": "json_object"})),
        Some("json_schema") => {
            let mut js = Map::new();
            for k in ["name", "schema", "strict", "description"] {
                if let Some(v) = f.get(k).filter(|v| !v.is_null()) {
                    js.insert(k.into(), v.clone());
                }
            }
            Some(json!({"type": "json_schema", "json_schema": js}))
        }
        _ => {
            return Err(invalid(
                "text.format.type",
                "`text.format.type` must be \"text\", \"json_object\" or \"json_schema\"",
            ))
        }
    })
}

/// The chat fields the translation renamed, as the Responses API names them.
const RESPONSES_FIELDS: &[(&str, &str)] =
    &[("max_tokens", "max_output_tokens"), ("messages", "input"), ("response_format", "text.format")];

/// OpenAI's limits on `metadata`: an object of at most 16 string values, keys of at most 64
/// characters, values of at most 512 (it is echoed in every response object a stream sends).
fn check_metadata(m: Option<&Value>) -> Result<(), ApiError> {
    let m = match m {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::Object(m)) => m,
        Some(_) => return Err(invalid("metadata", "`metadata` must be an object of strings")),
    };
    if m.len() > 16 {
        return Err(invalid("metadata", format!("`metadata` has {} keys; at most 16", m.len())));
    }
    for (k, v) in m {
        let Some(v) = v.as_str() else {
            return Err(invalid(
                "metadata",
                format!("`metadata.{}` must be a string", k.chars().take(64).collect::<String>()),
            ));
        };
        if k.chars().count() > 64 || v.chars().count() > 512 {
            return Err(invalid("metadata", "`metadata` keys are at most 64 characters and values at most 512"));
        }
    }
    Ok(())
}

/// A Responses body as a chat body; `echo` keeps what the response object repeats.
fn translate(mut o: Map<String, Value>) -> Result<Translated, ApiError> {
    for (k, why) in [
        ("previous_response_id", "this server stores no responses: send the whole conversation as `input`"),
        ("conversation", "this server stores no conversations: send the whole conversation as `input`"),
    ] {
        if o.get(k).is_some_and(|v| !v.is_null()) {
            return Err(invalid(k, why));
        }
    }
    if o.get("background") == Some(&Value::Bool(true)) {
        return Err(invalid("background", "background responses are not supported (nothing is stored)"));
    }
    let mut messages = Vec::new();
    match o.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => messages.push(json!({"role": "system", "content": s})),
        Some(_) => return Err(invalid("instructions", "`instructions` must be a string")),
    }
    input_messages(o.get("input").unwrap_or(&Value::Null), &mut messages)?;
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(messages));
    if let Some(t) = o.get("tools").filter(|t| !t.is_null()) {
        chat.insert("tools".into(), Value::Array(translate_tools(t)?));
    }
    match o.get("tool_choice") {
        None | Some(Value::Null) => {}
        Some(v @ Value::String(_)) => {
            chat.insert("tool_choice".into(), v.clone());
        }
        Some(v) if v.get("type").and_then(Value::as_str) == Some("function") => {
            let name = v.get("name").cloned().unwrap_or(Value::Null);
            chat.insert("tool_choice".into(), json!({"type": "function", "function": {"name": name}}));
        }
        Some(_) => {
            return Err(invalid(
                "tool_choice",
                "`tool_choice` must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"name\": ...}",
            ))
        }
    }
    if let Some(text) = o.get("text").filter(|t| !t.is_null()) {
        if let Some(rf) = translate_format(text)? {
            chat.insert("response_format".into(), rf);
        }
    }
    check_metadata(o.get("metadata"))?;
    let mut echo = Map::new();
    for k in ["instructions", "max_output_tokens", "metadata", "parallel_tool_calls", "reasoning", "temperature"] {
        if let Some(v) = o.get(k) {
            echo.insert(k.into(), v.clone());
        }
    }
    for k in ["text", "tool_choice", "tools", "top_p"] {
        if let Some(v) = o.get(k) {
            echo.insert(k.into(), v.clone());
        }
    }
    for (from, to) in [
        ("model", "model"),
        ("max_output_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("parallel_tool_calls", "parallel_tool_calls"),
        ("stream", "stream"),
    ] {
        if let Some(v) = o.remove(from) {
            chat.insert(to.into(), v);
        }
    }
    Ok(Translated {
        body: chat,
        route: Route::Chat,
        echo: Value::Object(echo),
        fields: RESPONSES_FIELDS,
        ollama_limits: false,
        fim: None,
    })
}

#[cfg(test)]
mod tests;
