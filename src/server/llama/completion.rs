//! llama-server's `POST /completion` (also `/completions`, its alias without `/v1`) and
//! `POST /infill` (the same with a fill-in-the-middle prompt, see `infill`), with their
//! request and response as its README documents them.
//!
//! Request: `prompt` (a string, token ids, or ids and strings mixed; a string first gets the
//! model's BOS), `n_predict` (-1, the default: until a stop or the context's end), `stop`,
//! `ignore_eos`, `seed` (-1: random), `temperature`, `top_k` (0: off), `top_p`, `min_p`,
//! `repeat_penalty`, `presence_penalty`, `frequency_penalty`, `repeat_last_n` (0 turns the
//! penalties off; other values count the whole sequence, as -1 does), `logit_bias` (`[[id, bias
//! or false]]` or `{"id": bias}`), `n_probs` (with `post_sampling_probs`: probabilities instead
//! of log-probabilities; both are the model's distribution before the samplers cut it),
//! `grammar` (GBNF), `json_schema`, `return_tokens`, `response_fields`, `stream`. `cache_prompt`, `n_keep`,
//! `samplers`, `id_slot` are taken and have nothing to change here (the prefix cache is always
//! on; a prompt never shifts out of the context). Samplers this engine does not have (`mirostat`,
//! `dry_multiplier`, `xtc_probability`, `dynatemp_range`, `typical_p` other than 1) are a 400
//! naming the field, never ignored.
//!
//! Response: `content`, `tokens`, `stop`, `stop_type` (`eos`, `word`, `limit`), `stopping_word`,
//! `truncated`, `tokens_predicted`, `tokens_evaluated`, `tokens_cached`, `generation_settings`,
//! `timings`, `completion_probabilities` with `n_probs`; streamed as `data: {...}` events, one
//! per token, the last with `stop: true` and the rest of the fields; with `timings_per_token`
//! every event carries `timings`, with `return_progress` `prompt_progress` events come while the
//! prompt is computed (`{total, cache, processed, time_ms}`).

use super::Fim;
use crate::engine::{Event, FinishReason, Usage};
use crate::server::access::AccessRecord;
use crate::server::error::ApiError;
use crate::server::generate::{submit, Choice};
use crate::server::openai::{deadline, error_of, token_piece, within};
use crate::server::params::type_name;
use crate::server::prepare::{self, Route, Translated};
use crate::server::timings::Clock;
use crate::server::AppState;
use crate::tokenizer::Tokenizer;
use axum::body::{Body, Bytes};
use axum::extract::{Extension, State};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::{stream, StreamExt};
use serde_json::{json, Map, Value};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

type Log = Option<Extension<AccessRecord>>;

/// `n_predict` -1: as many tokens as the context leaves (the translated route cuts it there).
const UNTIL_THE_END: u64 = 1 << 30;

/// The chat fields the translation renamed, as llama-server's clients name them.
const FIELDS: &[(&str, &str)] =
    &[("max_tokens", "n_predict"), ("repetition_penalty", "repeat_penalty"), ("logprobs", "n_probs")];

pub(crate) async fn completion(st: State<Arc<AppState>>, log: Log, headers: HeaderMap, body: Body) -> Response {
    run(st, log, headers, body, translate).await
}

/// llama-server's `POST /infill` (see `infill`): `/completion` with a fill-in-the-middle prompt.
pub(crate) async fn infill(st: State<Arc<AppState>>, log: Log, headers: HeaderMap, body: Body) -> Response {
    run(st, log, headers, body, translate_infill).await
}

async fn run(
    State(st): State<Arc<AppState>>,
    log: Log,
    headers: HeaderMap,
    body: Body,
    translate: prepare::Translate,
) -> Response {
    let t0 = Instant::now();
    let log = log.map(|l| l.0).unwrap_or_default();
    let r = within(&st, t0, st.cfg.request_timeout, async {
        let (engine, p, echo) = prepare::translated(&st, &headers, body, translate).await?;
        let prompt_tokens = p.plans.first().map_or(0, |pl| pl.prompt.len());
        let (stream, stops, limit) = (p.common.stream, p.common.stop.clone(), p.common.timeout);
        let mut choices = submit(&st, &engine, p.plans, t0, &log).await?;
        let choice = choices.pop().ok_or_else(|| ApiError::internal("no sequence was submitted"))?;
        let out = Out::new(&st, engine.tokenizer.clone(), echo, stops, prompt_tokens, t0);
        if stream {
            return Ok(streamed(out, choice, deadline(t0, limit)));
        }
        whole(out, choice).await
    })
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

fn invalid(param: &str, msg: impl Into<String>) -> ApiError {
    ApiError::invalid(param, msg)
}

/// A llama-server body as an OpenAI completions body (see the module docs).
fn translate(o: Map<String, Value>) -> Result<Translated, ApiError> {
    let get = |k: &str| o.get(k).filter(|v| !v.is_null());
    let number = |k: &str| -> Result<Option<f64>, ApiError> {
        match get(k) {
            None => Ok(None),
            Some(v) => {
                v.as_f64().map(Some).ok_or_else(|| invalid(k, format!("`{k}` must be a number, got {}", type_name(v))))
            }
        }
    };
    for (k, off) in [
        ("mirostat", 0.0),
        ("dry_multiplier", 0.0),
        ("xtc_probability", 0.0),
        ("dynatemp_range", 0.0),
        ("typical_p", 1.0),
    ] {
        if number(k)?.is_some_and(|x| x != off) {
            return Err(invalid(
                k,
                format!(
                    "`{k}` is not supported by this server (its samplers: temperature, top_k, top_p, min_p and the \
                     repetition, presence and frequency penalties); leave it out or at {off}"
                ),
            ));
        }
    }
    let mut body = Map::new();
    match get("prompt") {
        Some(p @ (Value::String(_) | Value::Array(_))) => body.insert("prompt".into(), p.clone()),
        _ => return Err(invalid("prompt", "`prompt` (a string, token ids, or both mixed) is required")),
    };
    let n_predict = match get("n_predict").or_else(|| get("max_tokens")) {
        None => UNTIL_THE_END,
        Some(v) => match v.as_i64() {
            Some(-1) => UNTIL_THE_END,
            Some(n) if n > 0 => n as u64,
            _ => return Err(invalid("n_predict", format!("`n_predict` must be -1 or a positive integer, got {v}"))),
        },
    };
    body.insert("max_tokens".into(), json!(n_predict));
    for (from, to) in [
        ("stop", "stop"),
        ("ignore_eos", "ignore_eos"),
        ("temperature", "temperature"),
        ("top_k", "top_k"),
        ("top_p", "top_p"),
        ("min_p", "min_p"),
        ("repeat_penalty", "repetition_penalty"),
        ("presence_penalty", "presence_penalty"),
        ("frequency_penalty", "frequency_penalty"),
        ("stream", "stream"),
        ("model", "model"),
        ("grammar", "grammar"),
        ("json_schema", "json_schema"),
        ("timings_per_token", "timings_per_token"),
        ("return_progress", "return_progress"),
    ] {
        if let Some(v) = get(from) {
            body.insert(to.into(), v.clone());
        }
    }
    // llama.cpp's default seed (-1, or 0xFFFFFFFF) draws a random one.
    if let Some(s) = get("seed").filter(|s| s.as_i64() != Some(-1) && s.as_u64() != Some(u32::MAX as u64)) {
        body.insert("seed".into(), s.clone());
    }
    if number("repeat_last_n")? == Some(0.0) {
        for k in ["repetition_penalty", "presence_penalty", "frequency_penalty"] {
            body.remove(k);
        }
    }
    if let Some(b) = get("logit_bias") {
        body.insert("logit_bias".into(), logit_bias(b)?);
    }
    let n_probs = match get("n_probs") {
        None => 0,
        Some(v) => v.as_u64().ok_or_else(|| invalid("n_probs", "`n_probs` must be a non-negative integer"))?,
    };
    if n_probs > 0 {
        body.insert("logprobs".into(), json!(n_probs));
    }
    let flag = |k: &str| get(k).and_then(Value::as_bool).unwrap_or(false);
    let mut settings = Map::new();
    for k in ["n_predict", "temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "seed"] {
        if let Some(v) = get(k) {
            settings.insert(k.into(), v.clone());
        }
    }
    settings.insert("n_probs".into(), json!(n_probs));
    settings.insert("stream".into(), json!(flag("stream")));
    let echo = json!({
        "n_probs": n_probs,
        "post_sampling_probs": flag("post_sampling_probs"),
        "return_tokens": flag("return_tokens"),
        "timings_per_token": flag("timings_per_token"),
        "return_progress": flag("return_progress"),
        "response_fields": get("response_fields").cloned().unwrap_or(Value::Null),
        "settings": settings,
    });
    Ok(Translated { body, route: Route::Completions, echo, fields: FIELDS, ollama_limits: false, fim: None })
}

/// An `/infill` body: its FIM fields, then the rest as `/completion`'s.
fn translate_infill(mut o: Map<String, Value>) -> Result<Translated, ApiError> {
    let mut text = |k: &str| match o.remove(k) {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s),
        Some(v) => Err(invalid(k, format!("`{k}` must be a string, got {}", type_name(&v)))),
    };
    let (prefix, suffix, middle) = (text("input_prefix")?, text("input_suffix")?, text("prompt")?);
    let mut extra = Vec::new();
    match o.remove("input_extra") {
        None | Some(Value::Null) => {}
        Some(Value::Array(list)) => {
            for (i, x) in list.iter().enumerate() {
                let field = |k: &str| x.get(k).and_then(Value::as_str).map(str::to_string);
                match (field("filename"), field("text")) {
                    (Some(name), Some(t)) => extra.push((name, t)),
                    _ => {
                        return Err(invalid(
                            &format!("input_extra[{i}]"),
                            "each of `input_extra` is {\"filename\", \"text\"}",
                        ))
                    }
                }
            }
        }
        Some(_) => return Err(invalid("input_extra", "`input_extra` must be an array of {\"filename\", \"text\"}")),
    }
    o.insert("prompt".into(), Value::String(String::new()));
    let mut t = translate(o)?;
    let answer = t.body.get("max_tokens").and_then(Value::as_u64).filter(|&n| n < UNTIL_THE_END).map(|n| n as usize);
    t.fim = Some(Fim { prefix, suffix, middle, extra, answer });
    Ok(t)
}

/// `logit_bias` in llama-server's forms: `[[id, bias], ...]` (`false` for never) or
/// `{"id": bias}`, as OpenAI's `{"id": bias}` (never: -100).
fn logit_bias(v: &Value) -> Result<Value, ApiError> {
    let bias = |b: &Value| match b {
        Value::Bool(false) => Ok(json!(-100.0)),
        Value::Number(_) => Ok(b.clone()),
        _ => Err(invalid("logit_bias", "a `logit_bias` value must be a number or false")),
    };
    let mut out = Map::new();
    match v {
        Value::Object(m) => {
            for (k, b) in m {
                out.insert(k.clone(), bias(b)?);
            }
        }
        Value::Array(a) => {
            for pair in a {
                match pair.as_array().map(Vec::as_slice) {
                    Some([Value::Number(id), b]) => {
                        out.insert(id.to_string(), bias(b)?);
                    }
                    _ => {
                        return Err(invalid(
                            "logit_bias",
                            "`logit_bias` must be [[token id, bias or false], ...] or {\"token id\": bias}",
                        ))
                    }
                }
            }
        }
        _ => return Err(invalid("logit_bias", "`logit_bias` must be an array of pairs or an object")),
    }
    Ok(Value::Object(out))
}

/// What the response needs of the request, and the generation so far.
struct Out {
    model: String,
    tok: Arc<Tokenizer>,
    echo: Value,
    stops: Vec<String>,
    prompt_tokens: usize,
    clock: Clock,
    content: String,
    ids: Vec<u32>,
    probs: Vec<Value>,
}

impl Out {
    fn new(st: &AppState, tok: Arc<Tokenizer>, echo: Value, stops: Vec<String>, prompt: usize, t0: Instant) -> Out {
        let model = st.cfg.served_model_name.clone();
        Out {
            model,
            tok,
            echo,
            stops,
            prompt_tokens: prompt,
            clock: Clock::new(t0, prompt),
            content: String::new(),
            ids: vec![],
            probs: vec![],
        }
    }

    /// One token: its text and, with `n_probs`, its probabilities entry.
    fn token(&mut self, id: u32, text: &str, logprob: f32, top: &[(u32, f32)]) -> (Option<Value>, String) {
        self.clock.token();
        self.content.push_str(text);
        self.ids.push(id);
        let n = self.echo["n_probs"].as_u64().unwrap_or(0) as usize;
        let prob = (n > 0).then(|| self.prob_entry(id, logprob, &top[..top.len().min(n)]));
        if let Some(p) = &prob {
            self.probs.push(p.clone());
        }
        (prob, text.to_string())
    }

    fn prob_entry(&self, id: u32, logprob: f32, top: &[(u32, f32)]) -> Value {
        let post = self.echo["post_sampling_probs"].as_bool().unwrap_or(false);
        let one = |id: u32, lp: f32| {
            let (text, bytes) = token_piece(&self.tok, id);
            let mut v = json!({"id": id, "token": text, "bytes": bytes});
            if post {
                v["prob"] = json!(lp.exp());
            } else {
                v["logprob"] = json!(lp);
            }
            v
        };
        let mut v = one(id, logprob);
        let list: Vec<Value> = top.iter().map(|&(i, lp)| one(i, lp)).collect();
        v[if post { "top_probs" } else { "top_logprobs" }] = json!(list);
        v
    }

    /// The fields of the last (or only) response object.
    fn finish(&mut self, text: &str, reason: &FinishReason, u: &Usage) -> Value {
        self.content.push_str(text);
        self.clock.done(u);
        let (stop_type, word) = match reason {
            FinishReason::Length => ("limit", ""),
            _ => match u.stop_string.and_then(|i| self.stops.get(i)) {
                Some(w) => ("word", w.as_str()),
                None => ("eos", ""),
            },
        };
        let mut settings = self.echo["settings"].clone();
        settings["model"] = json!(self.model);
        let mut v = json!({
            "index": 0,
            "content": self.content,
            "tokens": if self.echo["return_tokens"] == true { json!(self.ids) } else { json!([]) },
            "id_slot": 0,
            "stop": true,
            "model": self.model,
            "tokens_predicted": u.completion_tokens,
            "tokens_evaluated": self.prompt_tokens,
            "tokens_cached": u.cached_tokens,
            "generation_settings": settings,
            "has_new_line": self.content.contains('\n'),
            "truncated": false,
            "stop_type": stop_type,
            "stopping_word": word,
            "timings": self.clock.timings(),
        });
        if !self.probs.is_empty() {
            v["completion_probabilities"] = json!(std::mem::take(&mut self.probs));
        }
        v
    }
}

/// `v` with only the `response_fields` asked for (a path's parts joined by `/`), keyed by path.
fn only_fields(v: Value, fields: &Value) -> Value {
    let Some(list) = fields.as_array().filter(|l| !l.is_empty()) else { return v };
    let mut out = Map::new();
    for path in list.iter().filter_map(Value::as_str) {
        let found = path.split('/').try_fold(&v, |at, k| at.get(k));
        if let Some(x) = found {
            out.insert(path.to_string(), x.clone());
        }
    }
    Value::Object(out)
}

async fn whole(mut out: Out, mut choice: Choice) -> Result<Response, ApiError> {
    loop {
        match choice.next().await {
            Some(Event::Token { id, text, logprob, top }) => {
                out.token(id, &text, logprob, &top);
            }
            Some(Event::PromptLogprobs(_) | Event::Embedding(_) | Event::Progress { .. }) => {}
            Some(Event::Done { text, reason, usage }) => {
                if let Some(e) = error_of(&reason) {
                    return Err(e);
                }
                let v = out.finish(&text, &reason, &usage);
                let fields = out.echo["response_fields"].clone();
                return Ok(Json(only_fields(v, &fields)).into_response());
            }
            None => return Err(ApiError::internal("the engine stopped")),
        }
    }
}

fn event(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// The stream: a `data:` event per token, the last with `stop: true`; an error (engine, time
/// limit) as an `error` object.
fn streamed(out: Out, choice: Choice, limit: Option<(Duration, tokio::time::Instant)>) -> Response {
    let body = stream::unfold(Some((out, choice)), move |state| async move {
        let (mut out, mut choice) = state?;
        let far = tokio::time::Instant::now() + Duration::from_secs(86_400);
        loop {
            let e = tokio::select! {
                e = choice.next() => e,
                _ = tokio::time::sleep_until(limit.map_or(far, |(_, at)| at)) => {
                    let e = ApiError::timed_out(limit.map_or(Duration::ZERO, |(l, _)| l));
                    return Some((event(&json!({"error": e.body_in(crate::server::error::Dialect::OpenAi)["error"]})), None));
                }
            };
            match e {
                Some(Event::Token { id, text, logprob, top }) => {
                    let (prob, text) = out.token(id, &text, logprob, &top);
                    let mut v = json!({"index": 0, "content": text, "stop": false, "id_slot": 0});
                    v["tokens"] = if out.echo["return_tokens"] == true { json!([id]) } else { json!([]) };
                    if let Some(p) = prob {
                        v["completion_probabilities"] = json!([p]);
                    }
                    if out.echo["timings_per_token"] == true {
                        v["timings"] = out.clock.timings();
                    }
                    return Some((event(&v), Some((out, choice))));
                }
                Some(Event::Progress { processed, cached, total }) => {
                    let progress = out.clock.progress(processed, cached, total);
                    if out.echo["return_progress"] == true {
                        let v = json!({"index": 0, "content": "", "tokens": [], "stop": false, "id_slot": 0,
                                       "prompt_progress": progress});
                        return Some((event(&v), Some((out, choice))));
                    }
                }
                Some(Event::PromptLogprobs(_) | Event::Embedding(_)) => {}
                Some(Event::Done { text, reason, usage }) => {
                    if let Some(e) = error_of(&reason) {
                        let body = e.body_in(crate::server::error::Dialect::OpenAi);
                        return Some((event(&json!({"error": body["error"]})), None));
                    }
                    out.content.clear();
                    let mut v = out.finish(&text, &reason, &usage);
                    // The last event carries the text not sent yet, not the whole.
                    v["content"] = json!(text);
                    v.as_object_mut().map(|o| o.remove("completion_probabilities"));
                    return Some((event(&v), None));
                }
                None => return Some((event(&json!({"error": {"message": "the engine stopped"}})), None)),
            }
        }
    });
    let mut r = Body::from_stream(body.map(Ok::<Bytes, Infallible>)).into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}
