//! `POST /tokenize` and `POST /detokenize`, with vLLM's request and response shapes.
//!
//! - `/tokenize` with `prompt` (a string; `add_special_tokens`, default true, adds BOS as a
//!   completion's prompt gets it) or `messages` (rendered through the chat template as for a
//!   chat completion, a final assistant message continued as there (`prefill`);
//!   `add_generation_prompt`, default true; `add_special_tokens`, default
//!   false: true adds the model's BOS/EOS on top of what the template writes; `tools` and
//!   `tool_choice` are rendered as for a chat completion). Answers
//!   `{"count", "max_model_len", "tokens"}`, plus `token_strs` (vocabulary strings) with
//!   `return_token_strs`.
//! - llama-server's shape: `/tokenize` with `content` (a string; `add_special`, default false;
//!   `parse_special`, default true; `with_pieces`: each token as `{"id", "piece"}`, the piece a
//!   string, or its bytes where they are not UTF-8 alone) answers `{"tokens": [...]}`.
//! - `/detokenize` with `tokens` (ids below the vocabulary size): `{"prompt": text, "content":
//!   text}` (vLLM's and llama-server's names).

use super::body;
use super::error::ApiError;
use super::json::{self, Parsed};
use super::openai::within;
use super::params::{parse_messages, Fields, Prompt};
use super::token_ids::IdField;
use super::tools::ToolRequest;
use super::AppState;
use crate::engine::EngineHandle;
use crate::tokenizer::TooLong;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use std::sync::Arc;

pub(crate) async fn tokenize(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    tokenize_body(st, headers, body).await.unwrap_or_else(IntoResponse::into_response)
}

pub(crate) async fn detokenize(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    detokenize_body(st, headers, body).await.unwrap_or_else(IntoResponse::into_response)
}

/// The body's JSON object (and its token-id field, with `ids`), parsed on a worker.
pub(crate) async fn read_body(
    st: &AppState,
    headers: &HeaderMap,
    body: Body,
    ids: Option<IdField>,
) -> Result<(EngineHandle, Parsed), ApiError> {
    let engine = st.engine()?.clone();
    let data = body::read(headers, body, st.cfg.max_request_body_bytes, st.cfg.body_read_timeout).await?;
    let parsed = st.work.run_sized(data.len(), move || json::parse(&data, ids)).await??;
    st.check_model(Fields(&parsed.obj).string("model")?)?;
    Ok((engine, parsed))
}

/// Most tokens `/tokenize` and `/detokenize` take at once (or the context length, if longer):
/// enough to count a text past the context, bounded all the same.
const MAX_TOKENS: usize = 1 << 16;

/// The 400 for a text of more than `limit` tokens.
fn too_many_tokens(e: anyhow::Error, limit: usize, param: &str) -> ApiError {
    match e.downcast_ref::<TooLong>() {
        Some(_) => {
            ApiError::invalid(param, format!("the text has more than {limit} tokens (the most /tokenize counts)"))
                .code("context_length_exceeded")
        }
        None => ApiError::invalid(param, format!("{e:#}")),
    }
}

async fn tokenize_body(st: Arc<AppState>, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let t0 = std::time::Instant::now();
    let (engine, parsed) = read_body(&st, &headers, body, None).await?;
    let parsed_bytes = parsed.bytes;
    let f = Fields(&parsed.obj);
    if f.get("content").is_some() && f.get("prompt").is_none() && f.get("messages").is_none() {
        return llama_tokenize(st, engine, parsed, t0).await;
    }
    let token_strs = f.bool("return_token_strs")?.unwrap_or(false);
    let add_special = f.bool("add_special_tokens")?;
    let tok = engine.tokenizer.clone();
    let ctx = engine.info.max_model_len();
    let limit = MAX_TOKENS.max(ctx);
    // Rendering and tokenizing run on a worker, within the server's time limit.
    type Job = Box<dyn FnOnce() -> Result<Vec<u32>, ApiError> + Send>;
    let job: Job = match (f.get("prompt"), f.get("messages")) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid("messages", "give either `prompt` or `messages`, not both"));
        }
        (None, None) => return Err(ApiError::invalid("prompt", "`prompt` (a string) or `messages` is required")),
        (Some(_), None) => {
            let text = f.string("prompt")?.unwrap_or_default().to_string();
            let add = add_special.unwrap_or(true);
            drop(parsed);
            Box::new(move || {
                let r = if add {
                    tok.encode_limited(&text, limit)
                } else {
                    tok.tokenize_limited(&text, false, true, limit)
                };
                r.map_err(|e| too_many_tokens(e, limit, "prompt"))
            })
        }
        (None, Some(_)) => {
            // Tool-call arguments held in strings count against what the body left.
            let (messages, _) = json::with_budget(parsed.values_left, || parse_messages(f.get("messages")));
            let messages = messages?;
            let end = super::prefill::turn_end(&f, &messages)?;
            let tools = ToolRequest::parse(&f)?;
            let kwargs = f.template_kwargs()?;
            let add = add_special.unwrap_or(false);
            drop(parsed);
            Box::new(move || {
                let text = super::prefill::render(&tok, &messages, tools.as_ref(), end, kwargs.as_ref())?;
                // As a chat completion's prompt (BOS only where the model wants it and the
                // template did not write it), or with every special token the model adds.
                let r =
                    if add { tok.tokenize_limited(&text, true, true, limit) } else { tok.encode_limited(&text, limit) };
                r.map_err(|e| too_many_tokens(e, limit, "messages"))
            })
        }
    };
    let job = st.work.run_sized(parsed_bytes, job);
    let ids = within(&st, t0, st.cfg.request_timeout, async { job.await? }).await?;
    let mut v = json!({"count": ids.len(), "max_model_len": ctx, "tokens": ids});
    if token_strs {
        let tok = &engine.tokenizer;
        let strs: Vec<String> = ids.iter().map(|&id| tok.id_to_token(id).unwrap_or_default()).collect();
        v["token_strs"] = json!(strs);
    }
    Ok(Json(v).into_response())
}

/// llama-server's `/tokenize` (see the module docs).
async fn llama_tokenize(
    st: Arc<AppState>,
    engine: EngineHandle,
    parsed: Parsed,
    t0: std::time::Instant,
) -> Result<Response, ApiError> {
    let f = Fields(&parsed.obj);
    let text = f.string("content")?.unwrap_or_default().to_string();
    let add = f.bool("add_special")?.unwrap_or(false);
    let parse_special = f.bool("parse_special")?.unwrap_or(true);
    let with_pieces = f.bool("with_pieces")?.unwrap_or(false);
    let limit = MAX_TOKENS.max(engine.info.max_model_len());
    let tok = engine.tokenizer.clone();
    let job = st.work.run_sized(parsed.bytes, move || {
        tok.tokenize_limited(&text, add, parse_special, limit).map_err(|e| too_many_tokens(e, limit, "content"))
    });
    let ids = within(&st, t0, st.cfg.request_timeout, async { job.await? }).await?;
    if !with_pieces {
        return Ok(Json(json!({ "tokens": ids })).into_response());
    }
    let tok = &engine.tokenizer;
    let tokens: Vec<_> = ids
        .iter()
        .map(|&id| {
            let (_, bytes) = super::openai::token_piece(tok, id);
            let piece = match String::from_utf8(bytes) {
                Ok(s) => json!(s),
                Err(e) => json!(e.into_bytes()),
            };
            json!({"id": id, "piece": piece})
        })
        .collect();
    Ok(Json(json!({ "tokens": tokens })).into_response())
}

async fn detokenize_body(st: Arc<AppState>, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let engine = st.engine()?;
    let max = MAX_TOKENS.max(engine.info.max_model_len());
    let field = IdField {
        key: "tokens",
        // The tokenizer's ids (added tokens included), as before.
        vocab: engine.tokenizer.vocab_size(),
        max_prompts: 1,
        max_ids: max,
        too_long: |n| ApiError::invalid("tokens", format!("`tokens` may hold at most {n} token ids")),
        empty_ok: true,
    };
    let (engine, parsed) = read_body(&st, &headers, body, Some(field)).await?;
    let not_ids = || ApiError::invalid("tokens", "`tokens` must be an array of token ids");
    let ids = match parsed.prompts {
        None => return Err(ApiError::invalid("tokens", "`tokens` (an array of token ids) is required")),
        Some(mut p) => match p.pop() {
            Some(Prompt::Ids(ids)) if p.is_empty() => ids,
            _ => return Err(not_ids()),
        },
    };
    let tok = engine.tokenizer.clone();
    let text = st.work.run(move || tok.decode(&ids, false)).await?;
    Ok(Json(json!({"prompt": text, "content": text})).into_response())
}
