//! `POST /tokenize` and `POST /detokenize`, with vLLM's request and response shapes.
//!
//! - `/tokenize` with `prompt` (a string; `add_special_tokens`, default true, adds BOS as a
//!   completion's prompt gets it) or `messages` (rendered through the chat template as for a
//!   chat completion; `add_generation_prompt`, default true; `add_special_tokens`, default
//!   false: true adds the model's BOS/EOS on top of what the template writes; `tools` and
//!   `tool_choice` are rendered as for a chat completion). Answers
//!   `{"count", "max_model_len", "tokens"}`, plus `token_strs` (vocabulary strings) with
//!   `return_token_strs`.
//! - `/detokenize` with `tokens` (ids below the vocabulary size): `{"prompt": text}`.

use super::error::ApiError;
use super::openai::{blocking, read_json};
use super::params::{parse_messages, Fields};
use super::tools::{render_prompt, ToolRequest};
use super::AppState;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use std::sync::Arc;

pub(crate) async fn tokenize(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    tokenize_body(st, headers, body).await.unwrap_or_else(IntoResponse::into_response)
}

pub(crate) async fn detokenize(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    detokenize_body(st, headers, body).await.unwrap_or_else(IntoResponse::into_response)
}

async fn tokenize_body(st: Arc<AppState>, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let engine = st.engine()?.clone();
    let obj = read_json(&headers, body, st.cfg.max_request_body_bytes).await?;
    let f = Fields(&obj);
    st.check_model(f.string("model")?)?;
    let token_strs = f.bool("return_token_strs")?.unwrap_or(false);
    let add_special = f.bool("add_special_tokens")?;
    let tok = engine.tokenizer.clone();
    let ids = match (f.get("prompt"), f.get("messages")) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid("messages", "give either `prompt` or `messages`, not both"));
        }
        (None, None) => return Err(ApiError::invalid("prompt", "`prompt` (a string) or `messages` is required")),
        (Some(_), None) => {
            let text = f.string("prompt")?.unwrap_or_default().to_string();
            let add = add_special.unwrap_or(true);
            blocking(move || if add { tok.encode(&text) } else { tok.encode_raw(&text) })
                .await?
                .map_err(|e| ApiError::invalid("prompt", format!("{e:#}")))?
        }
        (None, Some(_)) => {
            let messages = parse_messages(f.get("messages"))?;
            let generation_prompt = f.bool("add_generation_prompt")?.unwrap_or(true);
            if f.bool("continue_final_message")?.unwrap_or(false) {
                return Err(ApiError::invalid("continue_final_message", "`continue_final_message` is not supported"));
            }
            let tools = ToolRequest::parse(&f)?;
            let add = add_special.unwrap_or(false);
            blocking(move || -> anyhow::Result<Vec<u32>> {
                let text = render_prompt(&tok, &messages, tools.as_ref(), generation_prompt)?;
                // As a chat completion's prompt (BOS only where the model wants it and the
                // template did not write it), or with every special token the model adds.
                if add {
                    tok.tokenize(&text, true, true)
                } else {
                    tok.encode(&text)
                }
            })
            .await?
            .map_err(|e| ApiError::invalid("messages", format!("{e:#}")))?
        }
    };
    let mut v = json!({"count": ids.len(), "max_model_len": engine.info.max_seq_len, "tokens": ids});
    if token_strs {
        let tok = &engine.tokenizer;
        let strs: Vec<String> = ids.iter().map(|&id| tok.id_to_token(id).unwrap_or_default()).collect();
        v["token_strs"] = json!(strs);
    }
    Ok(Json(v).into_response())
}

async fn detokenize_body(st: Arc<AppState>, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let engine = st.engine()?.clone();
    let obj = read_json(&headers, body, st.cfg.max_request_body_bytes).await?;
    let f = Fields(&obj);
    st.check_model(f.string("model")?)?;
    let vocab = engine.tokenizer.vocab_size();
    let ids = match f.get("tokens") {
        None => return Err(ApiError::invalid("tokens", "`tokens` (an array of token ids) is required")),
        Some(Value::Array(list)) => list
            .iter()
            .enumerate()
            .map(|(i, x)| {
                let id = x.as_u64().filter(|&id| id < vocab as u64).ok_or_else(|| {
                    ApiError::invalid(
                        "tokens",
                        format!("`tokens[{i}]` must be a token id in [0, {vocab}), got {}", short(x)),
                    )
                })?;
                Ok(id as u32)
            })
            .collect::<Result<Vec<u32>, ApiError>>()?,
        Some(v) => {
            return Err(ApiError::invalid(
                "tokens",
                format!("`tokens` must be an array of token ids, got {}", short(v)),
            ))
        }
    };
    let tok = engine.tokenizer.clone();
    let text = blocking(move || tok.decode(&ids, false)).await?;
    Ok(Json(json!({"prompt": text})).into_response())
}

/// A JSON value for an error message, cut to 40 characters.
fn short(v: &Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(40) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s,
    }
}
