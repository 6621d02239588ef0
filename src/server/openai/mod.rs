//! `POST /v1/chat/completions` and `POST /v1/completions`: request bodies to engine requests,
//! engine events to OpenAI's response objects or SSE chunks (`data: {...}`, `data: [DONE]`).

use super::access::AccessRecord;
use super::error::ApiError;
use super::generate::{submit, total_usage, Choice, Collected, TokenOut};
use super::harmony::{self, HarmonyParser, HarmonyPart};
use super::prepare::{self, Prepared, Route};
use super::reasoning::{self, Reasoning, Splitter};
use super::timings::Clock;
use super::tools::{self, Piece, ToolCallParser, ToolRequest};
use super::{unix_now, AppState};
use crate::engine::{EngineHandle, Event, FinishReason, PromptLogprob, Usage};
use crate::tokenizer::Tokenizer;
use axum::body::{Body, Bytes};
use axum::extract::{Extension, State};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, BoxStream, SelectAll};
use futures_util::StreamExt;
use serde_json::{json, Map, Value};
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(crate) mod sse;

/// The access log's record of this request (a detached one outside the middleware).
type Log = Option<Extension<AccessRecord>>;

pub(crate) async fn chat_completions(st: State<Arc<AppState>>, log: Log, headers: HeaderMap, body: Body) -> Response {
    handle(st, log, headers, body, Route::Chat).await
}

pub(crate) async fn completions(st: State<Arc<AppState>>, log: Log, headers: HeaderMap, body: Body) -> Response {
    handle(st, log, headers, body, Route::Completions).await
}

/// Either generation route, within the server's time limit.
async fn handle(State(st): State<Arc<AppState>>, log: Log, headers: HeaderMap, body: Body, route: Route) -> Response {
    let t0 = Instant::now();
    let limit = st.cfg.request_timeout;
    let log = log.map(|l| l.0).unwrap_or_default();
    within(&st, t0, limit, generate(st.clone(), headers, body, t0, log, route))
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// A time limit counted from `t0`, and its deadline (None: no limit, or one too far to count).
pub(crate) fn deadline(t0: Instant, limit: Option<Duration>) -> Option<(Duration, tokio::time::Instant)> {
    let limit = limit?;
    Some((limit, t0.checked_add(limit)?.into()))
}

/// `fut`, or a 408 once `limit` has passed since `t0`. Cutting `fut` off drops what it holds,
/// so its engine requests are aborted and their KV blocks freed.
pub(crate) async fn within<T>(
    st: &AppState,
    t0: Instant,
    limit: Option<Duration>,
    fut: impl Future<Output = Result<T, ApiError>>,
) -> Result<T, ApiError> {
    let Some((limit, at)) = deadline(t0, limit) else { return fut.await };
    match tokio::time::timeout_at(at, fut).await {
        Ok(r) => r,
        Err(_) => {
            st.metrics.timed_out.fetch_add(1, Relaxed);
            Err(ApiError::timed_out(limit))
        }
    }
}

/// Reads and prepares the request (on a worker, within its own time limit), then answers.
async fn generate(
    st: Arc<AppState>,
    headers: HeaderMap,
    body: Body,
    t0: Instant,
    log: AccessRecord,
    route: Route,
) -> Result<Response, ApiError> {
    let (engine, parsed, c) = prepare::begin(&st, &headers, body, route).await?;
    let timeout = c.timeout;
    let e = engine.clone();
    let job = st.work.run_sized(parsed.bytes, move || match route {
        Route::Chat => prepare::chat(&e, parsed, c),
        Route::Completions => prepare::completion(&e, parsed, c),
    });
    let mut p = within(&st, t0, timeout, async { job.await? }).await?;
    within(&st, t0, timeout, prepare::compile_constraint(&engine, &mut p)).await?;
    respond(st, engine, p, route == Route::Chat, t0, log).await
}

/// Submits a prepared request and answers with its choices (streamed or whole).
async fn respond(
    st: Arc<AppState>,
    engine: EngineHandle,
    p: Prepared,
    chat: bool,
    t0: Instant,
    log: AccessRecord,
) -> Result<Response, ApiError> {
    let c = p.common;
    let choices = within(&st, t0, c.timeout, submit(&st, &engine, p.plans, t0, &log)).await?;
    let out = Output {
        id: st.new_id(if chat { "chatcmpl" } else { "cmpl" }),
        created: unix_now(),
        model: st.cfg.served_model_name.clone(),
        tok: engine.tokenizer.clone(),
        chat,
        logprobs: p.logprobs.is_some(),
        include_usage: c.include_usage,
        echo: p.echo,
        echo_ids: p.echo_ids,
        deadline: deadline(t0, c.timeout),
        tools: p.tools,
        reasoning: p.reasoning,
        st: st.clone(),
        t0,
        timings: c.timings,
        progress: c.progress && c.stream,
    };
    Ok(if c.stream { out.stream(choices) } else { within(&st, t0, c.timeout, out.whole(choices)).await? })
}

/// The error a finish reason stands for (None for stop and length).
pub(crate) fn error_of(reason: &FinishReason) -> Option<ApiError> {
    match reason {
        FinishReason::Stop | FinishReason::Length => None,
        FinishReason::Abort => {
            Some(ApiError::unavailable("the request was aborted: the server is shutting down", "aborted"))
        }
        FinishReason::Error(m) if m.contains("shutting down") => {
            Some(ApiError::unavailable(m.clone(), "shutting_down"))
        }
        // A pipeline stage is down or restarted (engine::core): retrying later can succeed.
        FinishReason::Error(m) if m.starts_with("pipeline stage") => {
            Some(ApiError::unavailable(m.clone(), "stage_unavailable"))
        }
        // The device is gone (engine::core): /health says 503 too, until a restart.
        FinishReason::Error(m)
            if m.starts_with("the engine cannot serve") || m.starts_with("the GPU device was lost") =>
        {
            Some(ApiError::unavailable(m.clone(), "engine_unavailable"))
        }
        // The request's grammar went past the library's limits while generating: the
        // client's grammar, not the server, is at fault.
        FinishReason::Error(m) if m.starts_with("structured output:") => Some(ApiError::bad_request(format!(
            "{m} (the request's grammar needs more than the grammar library's limits allow; simplify it)"
        ))),
        FinishReason::Error(m) => Some(ApiError::internal(m.clone())),
    }
}

/// A logprob as JSON, with f32's shortest digits (-0.1, not -0.10000000149011612); -9999 for
/// -inf, as OpenAI writes it.
fn lp_json(x: f32) -> Value {
    if !x.is_finite() {
        return json!(-9999.0);
    }
    json!(x.to_string().parse::<f64>().unwrap_or(x as f64))
}

/// The byte a GPT-2 byte-level BPE character stands for.
fn byte_level_byte(c: char) -> Option<u8> {
    let direct = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let c = c as u32;
    if c < 256 {
        return direct(c).then_some(c as u8);
    }
    // The bytes that are not printable map, in order, to 256, 257, ...
    (0u32..256).filter(|&b| !direct(b)).nth((c - 256) as usize).map(|b| b as u8)
}

/// A token's text and raw bytes. A token holding part of a UTF-8 character decodes to U+FFFD
/// on its own; then the bytes come from its vocabulary form (byte-level BPE or `<0xAB>`).
pub(crate) fn token_piece(tok: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let s = tok.token_text(id);
    if s.contains('\u{FFFD}') || s.is_empty() {
        if let Some(raw) = tok.id_to_token(id) {
            let hex = raw.strip_prefix("<0x").and_then(|r| r.strip_suffix('>'));
            let bytes = match hex {
                Some(h) if h.len() == 2 => u8::from_str_radix(h, 16).ok().map(|b| vec![b]),
                _ => raw.chars().map(byte_level_byte).collect::<Option<Vec<u8>>>(),
            };
            if let Some(b) = bytes.filter(|b| !b.is_empty()) {
                return (String::from_utf8_lossy(&b).into_owned(), b);
            }
        }
    }
    let b = s.as_bytes().to_vec();
    (s, b)
}

/// What a response carries besides the choices.
struct Output {
    id: String,
    created: u64,
    model: String,
    tok: Arc<Tokenizer>,
    chat: bool,
    logprobs: bool,
    include_usage: bool,
    /// Completions with `echo`: each prompt's text (empty otherwise).
    echo: Vec<String>,
    /// Completions with `echo` and `logprobs`: each prompt's token ids (empty otherwise).
    echo_ids: Vec<Vec<u32>>,
    /// The request's time limit and when it passes (streams end there).
    deadline: Option<(Duration, tokio::time::Instant)>,
    /// Chat with tools (tool_choice other than `none`): the output is parsed for tool calls.
    tools: Option<ToolRequest>,
    /// Chat with a reasoning parser: the thinking goes to `reasoning_content` (before tools).
    reasoning: Option<Reasoning>,
    st: Arc<AppState>,
    t0: Instant,
    /// llama-server's `timings_per_token`: `timings` on the response, and on every chunk.
    timings: bool,
    /// llama-server's `return_progress`: `prompt_progress` chunks while the prompt is computed.
    progress: bool,
}

/// Legacy completions logprobs under construction.
#[derive(Default)]
struct LegacyLogprobs {
    tokens: Vec<String>,
    lps: Vec<Value>,
    tops: Vec<Value>,
    offsets: Vec<usize>,
}

impl LegacyLogprobs {
    /// One token: its text at `offset` (advanced past it), its logprob and top entries (null
    /// for a prompt's first token).
    fn push(&mut self, tok: &Tokenizer, id: u32, lp: Option<f32>, top: Option<&[(u32, f32)]>, offset: &mut usize) {
        let (s, _) = token_piece(tok, id);
        self.offsets.push(*offset);
        *offset += s.chars().count();
        self.tokens.push(s);
        self.lps.push(lp.map_or(Value::Null, lp_json));
        self.tops.push(top.map_or(Value::Null, |t| {
            Value::Object(
                t.iter().map(|&(id, lp)| (token_piece(tok, id).0, lp_json(lp))).collect::<Map<String, Value>>(),
            )
        }));
    }
}

/// `tool_calls` as the finish reason of a choice that stopped after calling tools.
fn tool_calls_reason(reason: &FinishReason, openai: Value) -> Value {
    if matches!(reason, FinishReason::Stop) {
        json!("tool_calls")
    } else {
        openai
    }
}

impl Output {
    /// A fresh tool-call id, `call_` and 24 hex digits.
    fn call_id(&self) -> String {
        let id = self.st.new_id("call");
        format!("call_{}", id.strip_prefix("call-").unwrap_or(&id))
    }

    fn envelope(&self, chunk: bool, choices: Vec<Value>) -> Value {
        let object = match (self.chat, chunk) {
            (true, false) => "chat.completion",
            (true, true) => "chat.completion.chunk",
            (false, _) => "text_completion",
        };
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": null,
            "choices": choices,
        })
    }

    fn echo_of(&self, prompt_index: usize) -> &str {
        self.echo.get(prompt_index).map_or("", String::as_str)
    }

    /// Chat logprobs: `{"content": [{token, logprob, bytes, top_logprobs}]}`.
    fn chat_logprobs(&self, toks: &[TokenOut]) -> Value {
        let entry = |id: u32, lp: f32| {
            let (t, b) = token_piece(&self.tok, id);
            json!({"token": t, "logprob": lp_json(lp), "bytes": b})
        };
        let content: Vec<Value> = toks
            .iter()
            .map(|t| {
                let mut e = entry(t.id, t.logprob);
                e["top_logprobs"] = Value::Array(t.top.iter().map(|&(id, lp)| entry(id, lp)).collect());
                e
            })
            .collect();
        json!({"content": content, "refusal": null})
    }

    /// Legacy completions logprobs: the prompt's (with `echo`: its first token has none, as
    /// nothing predicts it) and then the generated tokens'; `offset` is the text offset of the
    /// first token, advanced.
    fn legacy_logprobs(
        &self,
        prompt: Option<(&[u32], &[PromptLogprob])>,
        toks: &[TokenOut],
        offset: &mut usize,
    ) -> Value {
        let mut out = LegacyLogprobs::default();
        if let Some((ids, lps)) = prompt {
            if let Some(&first) = ids.first() {
                out.push(&self.tok, first, None, None, offset);
            }
            for p in lps {
                // As vLLM does: the prompt token is among its position's top entries.
                let mut top = p.top.clone();
                if !top.iter().any(|&(id, _)| id == p.id) {
                    top.push((p.id, p.logprob));
                }
                out.push(&self.tok, p.id, Some(p.logprob), Some(&top), offset);
            }
        }
        for t in toks {
            out.push(&self.tok, t.id, Some(t.logprob), Some(&t.top), offset);
        }
        json!({"tokens": out.tokens, "token_logprobs": out.lps, "top_logprobs": out.tops, "text_offset": out.offsets})
    }

    /// `echo` with `logprobs`: the prompt's token ids (None otherwise).
    fn echo_prompt(&self, prompt_index: usize) -> Option<&[u32]> {
        self.echo_ids.get(prompt_index).map(Vec::as_slice)
    }

    async fn whole(self, choices: Vec<Choice>) -> Result<Response, ApiError> {
        let mut done: Vec<Collected> = futures_util::future::join_all(choices.into_iter().map(Choice::collect)).await;
        done.sort_by_key(|c| c.index);
        if let Some(e) = done.iter().find_map(|c| error_of(&c.reason)) {
            return Err(e);
        }
        let usage = total_usage(&done.iter().map(|c| (c.prompt_index, c.usage)).collect::<Vec<_>>());
        let choices = done
            .iter()
            .map(|c| {
                let reason = c.reason.as_openai();
                if self.chat {
                    let lp = if self.logprobs { self.chat_logprobs(&c.tokens) } else { Value::Null };
                    let mut message = json!({"role": "assistant", "content": c.text, "refusal": null});
                    let harmony = self.reasoning.is_some_and(|r| r.is_harmony());
                    let (thinking, mut content, mut calls) = match self.reasoning {
                        Some(_) if harmony => harmony::parse_whole(self.tools.as_ref(), &c.text),
                        Some(r) => {
                            let (thinking, content) = reasoning::split_whole(r, &c.text);
                            (thinking, content, vec![])
                        }
                        None => (None, Some(c.text.clone()), vec![]),
                    };
                    if self.reasoning.is_some() {
                        message["reasoning_content"] = json!(thinking);
                    }
                    if let Some(t) = self.tools.as_ref().filter(|_| !harmony) {
                        (content, calls) = tools::parse_output(t, content.as_deref().unwrap_or_default());
                    }
                    message["content"] = json!(content);
                    let mut reason = json!(reason);
                    if !calls.is_empty() {
                        let calls: Vec<Value> = calls.iter().map(|k| tools::call_json(&self.call_id(), k)).collect();
                        message["tool_calls"] = Value::Array(calls);
                        reason = tool_calls_reason(&c.reason, reason);
                    }
                    json!({
                        "index": c.index,
                        "message": message,
                        "logprobs": lp,
                        "finish_reason": reason,
                    })
                } else {
                    let prompt = self.echo_prompt(c.prompt_index).map(|ids| (ids, &c.prompt_logprobs[..]));
                    let lp = if self.logprobs { self.legacy_logprobs(prompt, &c.tokens, &mut 0) } else { Value::Null };
                    json!({
                        "index": c.index,
                        "text": format!("{}{}", self.echo_of(c.prompt_index), c.text),
                        "logprobs": lp,
                        "finish_reason": reason,
                    })
                }
            })
            .collect();
        let mut v = self.envelope(false, choices);
        v["usage"] = usage;
        if let Some(c) = done.first().filter(|_| self.timings) {
            v["timings"] = Clock::finished(self.t0, c.first, &c.usage).timings();
        }
        Ok(Json(v).into_response())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_inverse() {
        assert_eq!(byte_level_byte('a'), Some(b'a'));
        assert_eq!(byte_level_byte('Ġ'), Some(b' '));
        assert_eq!(byte_level_byte('Ċ'), Some(b'\n'));
        assert_eq!(byte_level_byte('\u{100}'), Some(0));
        assert_eq!(byte_level_byte('▁'), None);
    }

    /// A grammar that goes past the library's limits while generating is the client's 400,
    /// not the server's 500 (the parser's own words kept).
    #[test]
    fn grammar_failures_while_generating_are_the_clients() {
        let m = "structured output: Parser Error: Current row has 2501 items; max is 2000";
        let e = error_of(&FinishReason::Error(m.into())).unwrap();
        assert_eq!(e.status.as_u16(), 400);
        assert!(e.body()["error"]["message"].as_str().unwrap().contains("2501 items"), "{:?}", e.body());
        assert_eq!(error_of(&FinishReason::Error("boom".into())).unwrap().status.as_u16(), 500);
    }

    #[test]
    fn logprob_digits() {
        assert_eq!(lp_json(-0.1).to_string(), "-0.1");
        assert_eq!(lp_json(f32::NEG_INFINITY).to_string(), "-9999.0");
    }
}
