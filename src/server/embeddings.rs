//! `POST /v1/embeddings` (OpenAI's shape) while the server runs with `--task embed`: `input` as
//! a string, strings, token ids or lists of them (at most 256), `encoding_format` `float` or
//! `base64` (little-endian f32), `dimensions` (the first N of the vector, normalised again, as
//! Matryoshka-trained models such as Qwen3-Embedding allow). Each input is one engine request
//! that computes its prompt and pools its last hidden states (`--pooling`: last token by
//! default, mean or first); they are batched by the engine like any others.
//! Ollama's `/api/embed` and `/api/embeddings` reuse the same path (`ollama`).

use super::access::AccessRecord;
use super::error::ApiError;
use super::generate::{check_context, submit, Planned};
use super::json;
use super::openai::within;
use super::params::{type_name, Fields, Prompt};
use super::prepare::{admit, tokenize_prompt, tokenize_prompt_cut, too_long, MAX_CHOICES};
use super::token_ids::IdField;
use super::AppState;
use crate::engine::{EngineHandle, Pooling, RequestParams, StopConditions};
use axum::body::Body;
use axum::extract::{Extension, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Instant;

type Log = Option<Extension<AccessRecord>>;

pub(crate) async fn embeddings(State(st): State<Arc<AppState>>, log: Log, headers: HeaderMap, body: Body) -> Response {
    let t0 = Instant::now();
    let log = log.map(|l| l.0).unwrap_or_default();
    within(&st, t0, st.cfg.request_timeout, async {
        let (req, vectors) = embed(&st, &headers, body, t0, &log, EmbedApi::OpenAi).await?;
        let data: Vec<Value> = vectors
            .iter()
            .enumerate()
            .map(|(i, (v, _))| {
                let e = if req.base64 { json!(base64_f32(v)) } else { json!(v) };
                json!({"object": "embedding", "index": i, "embedding": e})
            })
            .collect();
        let tokens: usize = vectors.iter().map(|(_, n)| n).sum();
        Ok(Json(json!({
            "object": "list",
            "data": data,
            "model": st.cfg.served_model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }))
        .into_response())
    })
    .await
    .unwrap_or_else(IntoResponse::into_response)
}

/// What an embeddings request asked for besides its inputs.
pub(crate) struct EmbedRequest {
    pub base64: bool,
}

/// Which API an embeddings body is in: OpenAI's (`input`), Ollama's `/api/embed` (`input`,
/// and `truncate`, true by default: a text longer than the context is cut to it) or its older
/// `/api/embeddings` (`prompt`, cut the same way).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EmbedApi {
    OpenAi,
    OllamaEmbed,
    OllamaLegacy,
}

impl EmbedApi {
    fn key(self) -> &'static str {
        if self == EmbedApi::OllamaLegacy {
            "prompt"
        } else {
            "input"
        }
    }
}

/// Reads an embeddings body and computes each input's vector; returns them in input order with
/// each prompt's length in tokens.
pub(crate) async fn embed(
    st: &Arc<AppState>,
    headers: &HeaderMap,
    body: Body,
    t0: Instant,
    log: &AccessRecord,
    api: EmbedApi,
) -> Result<(EmbedRequest, Vec<(Vec<f32>, usize)>), ApiError> {
    let pooling = st.cfg.pooling;
    let salt = st.new_id("embed");
    // Whether the server embeds at all is answered after the body is read (admit reads it
    // first), so the client sees the 400 rather than a connection closed under its upload.
    let (engine, (plans, base64, dims)) = admit(st, headers, body, move |data, e, _| {
        let Some(dim) = e.embedding_dim() else {
            return Err(ApiError::invalid(
                "model",
                "this server does not serve embeddings: start it with `--task embed` (any supported model)",
            ));
        };
        parse(e, data, api, dim, pooling, &salt)
    })
    .await?;
    let lens: Vec<usize> = plans.iter().map(|p| p.prompt.len()).collect();
    let choices = submit(st, &engine, plans, t0, log).await?;
    let done = futures_util::future::join_all(choices.into_iter().map(|c| c.collect())).await;
    let mut out = Vec::with_capacity(done.len());
    for (c, n) in done.into_iter().zip(lens) {
        if let Some(e) = super::openai::error_of(&c.reason) {
            return Err(e);
        }
        let mut v = c.embedding.ok_or_else(|| ApiError::internal("the engine gave no embedding"))?;
        if let Some(d) = dims.filter(|&d| d < v.len()) {
            v.truncate(d);
            let norm = v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt().max(1e-12);
            v.iter_mut().for_each(|x| *x = (*x as f64 / norm) as f32);
        }
        out.push((v, n));
    }
    Ok((EmbedRequest { base64 }, out))
}

/// The body's inputs as engine requests (blocking: on a worker), whether it asked for base64,
/// and `dimensions`; and the model it named.
#[allow(clippy::type_complexity)]
fn parse(
    engine: &EngineHandle,
    data: Vec<u8>,
    api: EmbedApi,
    dim: usize,
    pooling: Pooling,
    salt: &str,
) -> Result<((Vec<Planned>, bool, Option<usize>), Option<String>), ApiError> {
    let key = api.key();
    let ids = IdField {
        key,
        vocab: engine.info.vocab,
        max_prompts: MAX_CHOICES,
        max_ids: engine.info.max_model_len().saturating_sub(1),
        too_long: |n| too_long(n + 1, "input"),
        empty_ok: false,
    };
    let parsed = json::parse(&data, Some(ids))?;
    drop(data);
    let f = Fields(&parsed.obj);
    let model = f.string("model")?.map(|m| m.strip_suffix(":latest").unwrap_or(m).to_string());
    let base64 = match f.string("encoding_format")? {
        None | Some("float") => false,
        Some("base64") => true,
        Some(o) => {
            return Err(ApiError::invalid(
                "encoding_format",
                format!("`encoding_format` must be float or base64, got {o:?}"),
            ))
        }
    };
    let dims = f.int_in("dimensions", 1, dim as i64)?.map(|d| d as usize);
    let truncate = match api {
        EmbedApi::OpenAi => false,
        EmbedApi::OllamaEmbed => f.bool("truncate")?.unwrap_or(true),
        EmbedApi::OllamaLegacy => true,
    };
    let inputs = match parsed.prompts {
        Some(p) if !p.is_empty() => p,
        _ => return Err(ApiError::invalid(key, format!("`{key}` must be a non-empty string, strings or token ids"))),
    };
    let mut plans = Vec::with_capacity(inputs.len());
    for (i, p) in inputs.into_iter().enumerate() {
        let prompt = match p {
            Prompt::Text(s) if s.is_empty() => return Err(ApiError::invalid(key, format!("input {i} is empty"))),
            Prompt::Text(s) if truncate => tokenize_prompt_cut(&engine.tokenizer, &engine.info, &s, key)?,
            Prompt::Text(s) => tokenize_prompt(&engine.tokenizer, &engine.info, &s, key)?,
            Prompt::Ids(ids) => ids,
        };
        check_context(&engine.info, prompt.len(), Some(1), key)?;
        // Mean and first-token pooling need every position computed: no prefix-cache hits.
        let cache_salt = (pooling != Pooling::Last).then(|| format!("{salt}-{i}"));
        let params = RequestParams {
            pooling: Some(pooling),
            stop: StopConditions { max_tokens: Some(1), ..Default::default() },
            cache_salt,
            ..Default::default()
        };
        plans.push(Planned { prompt, choices: vec![params] });
    }
    if let Some(v) = parsed.obj.get("user").filter(|v| !v.is_null() && !v.is_string()) {
        return Err(ApiError::invalid("user", format!("`user` must be a string, got {}", type_name(v))));
    }
    Ok(((plans, base64, dims), model))
}

/// `v` as little-endian f32 bytes in standard base64 (what the OpenAI clients decode).
pub(crate) fn base64_f32(v: &[f32]) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for c in bytes.chunks(3) {
        let n = (c[0] as u32) << 16 | (*c.get(1).unwrap_or(&0) as u32) << 8 | *c.get(2).unwrap_or(&0) as u32;
        for k in 0..4 {
            if k <= c.len() {
                out.push(ABC[(n >> (18 - 6 * k) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_of_floats() {
        // 1.0f32 = 00 00 80 3f; 2.0f32 = 00 00 00 40 (python: base64.b64encode(struct.pack('<2f', 1, 2))).
        assert_eq!(base64_f32(&[1.0, 2.0]), "AACAPwAAAEA=");
        assert_eq!(base64_f32(&[1.0]), "AACAPw==");
        assert_eq!(base64_f32(&[]), "");
    }
}
