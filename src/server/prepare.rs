//! From a request body to what the engine is given, for both generation routes: the body read
//! and parsed, the common fields, then (on a worker thread, within the request's own time
//! limit) the messages or prompts, the chat template and tokenization, then the grammar (on a
//! thread of its own, see `structured::compile`).
//!
//! The order is the admission order: the queue limit is checked before the body is parsed;
//! counts (prompts, token ids per prompt) while it is parsed; the context length while each
//! prompt is tokenized. See `body` and `work` for the bounds.

use super::body;
use super::error::ApiError;
use super::generate::{check_context, Planned};
use super::json::{self, Parsed};
use super::params::{parse_messages, Common, Fields, Limits, Prompt, MAX_TOP_LOGPROBS};
use super::prefill;
use super::queue::check_queue;
use super::reasoning::{self, Reasoning};
use super::structured;
use super::token_ids::IdField;
use super::tools::ToolRequest;
use super::AppState;
use crate::engine::handle::EngineInfo;
use crate::engine::{EngineHandle, RequestParams};
use crate::structured::ConstraintSpec;
use crate::tokenizer::{Tokenizer, TooLong};
use axum::body::Body;
use axum::http::HeaderMap;
use serde_json::{Map, Value};

/// Most sequences (prompts x n) one completions request may ask for.
pub const MAX_CHOICES: usize = 256;
/// Legacy completions' default `max_tokens`, as OpenAI's.
const COMPLETIONS_DEFAULT_MAX_TOKENS: usize = 16;

/// Which route a body is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    Chat,
    Completions,
}

/// Compiles the prepared request's constraint (off the request workers: see
/// `structured::compile`) and gives each of its choices a copy of its own.
pub(crate) async fn compile_constraint(engine: &EngineHandle, p: &mut Prepared) -> Result<(), ApiError> {
    let Some(c) = structured::compile(engine, p.common.constraint.take()).await? else { return Ok(()) };
    for plan in &mut p.plans {
        for choice in &mut plan.choices {
            choice.constraint = Some(c.clone());
        }
    }
    p.common.compiled = Some(c);
    Ok(())
}

/// A request ready to submit (its constraint still to compile: [`compile_constraint`]), with
/// what its response needs.
pub(crate) struct Prepared {
    pub common: Common,
    pub plans: Vec<Planned>,
    /// Top logprobs per token (None: no logprobs).
    pub logprobs: Option<u32>,
    /// Chat with tools whose output is parsed for calls.
    pub tools: Option<ToolRequest>,
    /// Completions with `echo`: each prompt's text.
    pub echo: Vec<String>,
    /// Completions with `echo` and `logprobs`: each prompt's token ids.
    pub echo_ids: Vec<Vec<u32>>,
    /// Chat with a reasoning parser: how its output is split.
    pub reasoning: Option<Reasoning>,
}

fn limits(st: &AppState, e: &EngineHandle) -> Limits {
    Limits {
        vocab: e.info.vocab,
        max_n: st.cfg.max_n,
        default_temperature: st.cfg.default_temperature,
        default_top_p: st.cfg.default_top_p,
        default_top_k: st.cfg.default_top_k,
        request_timeout: st.cfg.request_timeout,
        max_temperature: 2.0,
        max_stop: super::params::MAX_STOP,
    }
}

/// The request's `max_tokens`, cut to the room a prompt of `prompt_len` tokens leaves where the
/// route clamps (`Common::clamp_max_tokens`).
fn room(info: &EngineInfo, prompt_len: usize, c: &Common, want: Option<usize>) -> Option<usize> {
    let left = info.max_model_len().saturating_sub(prompt_len).max(1);
    want.map(|m| if c.clamp_max_tokens { m.min(left) } else { m })
}

/// The 400 for a prompt longer than the context (as `check_context`'s).
pub(crate) fn too_long(ctx: usize, param: &'static str) -> ApiError {
    ApiError::invalid(
        param,
        format!(
            "This model's maximum context length is {ctx} tokens. However, your prompt has more than {} tokens, \
             which leaves no room for the completion. Please reduce the length of the prompt.",
            ctx - 1
        ),
    )
    .code("context_length_exceeded")
}

/// The admission every body goes through: the engine (503 while the model loads), the body
/// (its size and time limits), the queue (503 when full, before anything is parsed), then
/// `parse` on a worker (its memory bounded by `body`), and the model it names checked.
/// `parse` gets the body (to drop as soon as it is parsed), the engine and the request limits,
/// and returns what it read and the model name the request gave.
pub(crate) async fn admit<T: Send + 'static>(
    st: &AppState,
    headers: &HeaderMap,
    body: Body,
    parse: impl FnOnce(Vec<u8>, &EngineHandle, Limits) -> Result<(T, Option<String>), ApiError> + Send + 'static,
) -> Result<(EngineHandle, T), ApiError> {
    // The body first: its errors (size, type) come before "still loading", and the connection
    // can carry the next request whatever the answer.
    let data = body::read(headers, body, st.cfg.max_request_body_bytes, st.cfg.body_read_timeout).await?;
    let engine = st.engine()?.clone();
    check_queue(st)?;
    let lim = limits(st, &engine);
    let e = engine.clone();
    let (v, model) = st.work.run_sized(data.len(), move || parse(data, &e, lim)).await??;
    st.check_model(model.as_deref())?;
    Ok((engine, v))
}

/// The engine, the parsed body and its common fields (with the server's reasoning parser), as
/// [`admit`] reads them.
pub(crate) async fn begin(
    st: &AppState,
    headers: &HeaderMap,
    body: Body,
    route: Route,
) -> Result<(EngineHandle, Parsed, Common), ApiError> {
    let (engine, (parsed, mut c)) = admit(st, headers, body, move |data, e, lim| {
        let ids = (route == Route::Completions).then_some(IdField {
            key: "prompt",
            vocab: e.info.vocab,
            max_prompts: MAX_CHOICES,
            max_ids: e.info.max_model_len().saturating_sub(1),
            too_long: |n| too_long(n + 1, "prompt"),
            empty_ok: false,
        });
        let keys: &[&str] = match route {
            Route::Chat => &["max_completion_tokens", "max_tokens"],
            Route::Completions => &["max_tokens"],
        };
        let mut parsed = json::parse(&data, ids)?;
        drop(data);
        let c = common_fields(&mut parsed, &lim, keys)?;
        let model = c.model.clone();
        Ok(((parsed, c), model))
    })
    .await?;
    c.reasoning = st.cfg.reasoning_parser;
    Ok((engine, parsed, c))
}

fn common_fields(parsed: &mut Parsed, lim: &Limits, keys: &[&str]) -> Result<Common, ApiError> {
    let (c, left) = json::with_budget(parsed.values_left, || Common::parse(&Fields(&parsed.obj), lim, keys));
    parsed.values_left = left;
    c
}

/// A body in another API's shape (Anthropic's, the Responses API's, Ollama's) as an OpenAI
/// chat body, or a completions body whose `prompt` is a string.
#[derive(Debug)]
pub(crate) struct Translated {
    pub body: Map<String, Value>,
    pub route: Route,
    /// What the response needs of the original request (the API's own business).
    pub echo: Value,
    /// (chat field, the client's field) for the fields the translation renamed: errors found
    /// in the chat body name the client's own fields.
    pub fields: &'static [(&'static str, &'static str)],
    /// The sampling fields are read with Ollama's limits ([`Limits::ollama`]).
    pub ollama_limits: bool,
    /// A fill-in-the-middle prompt (llama-server's `/infill`), built for the model's tokenizer
    /// in place of `prompt`.
    pub fim: Option<super::llama::Fim>,
}

/// `e` with its `param` and the backquoted field names in its message as the client knows them
/// (`fields`: see [`Translated::fields`]).
pub(crate) fn in_client_terms(mut e: ApiError, fields: &[(&str, &str)]) -> ApiError {
    let Some(p) = e.param.clone() else { return e };
    let rest_of = |chat: &str| p.strip_prefix(chat).filter(|r| r.is_empty() || r.starts_with(['.', '[']));
    if let Some((chat, client, rest)) = fields.iter().find_map(|(c, k)| rest_of(c).map(|r| (*c, *k, r))) {
        e.param = Some(format!("{client}{rest}"));
        e.message = e.message.replace(&format!("`{chat}"), &format!("`{client}"));
    }
    e
}

/// Translates a body (errors name the original API's fields).
pub(crate) type Translate = fn(Map<String, Value>) -> Result<Translated, ApiError>;

/// A request in another API's shape, ready to submit: read, translated, then prepared as the
/// OpenAI route it became (the same checks, limits and admission order as [`begin`]).
pub(crate) async fn translated(
    st: &AppState,
    headers: &HeaderMap,
    body: Body,
    translate: Translate,
) -> Result<(EngineHandle, Prepared, Value), ApiError> {
    let (engine, (parsed, mut c, route, echo, fields)) = admit(st, headers, body, move |data, e, lim| {
        let mut parsed = json::parse(&data, None)?;
        drop(data);
        let t = translate(std::mem::take(&mut parsed.obj))?;
        let (route, echo, fields, fim) = (t.route, t.echo, t.fields, t.fim);
        let lim = if t.ollama_limits { lim.ollama() } else { lim };
        parsed.obj = t.body;
        if let Some(f) = fim {
            parsed.obj.remove("prompt");
            parsed.prompts = Some(vec![Prompt::Ids(f.tokens(e, "input_prefix")?)]);
        } else if route == Route::Completions {
            let prompt = match parsed.obj.remove("prompt") {
                Some(Value::String(s)) => Prompt::Text(s),
                // llama-server's: token ids and strings, mixed.
                Some(Value::Array(a)) if !a.is_empty() => Prompt::Ids(mixed_prompt(e, &a)?),
                _ => return Err(ApiError::invalid("prompt", "`prompt` must be a string")),
            };
            parsed.prompts = Some(vec![prompt]);
        }
        let mut c = common_fields(&mut parsed, &lim, &["max_tokens"]).map_err(|e| in_client_terms(e, fields))?;
        c.clamp_max_tokens = true;
        let model = c.model.clone();
        Ok(((parsed, c, route, echo, fields), model))
    })
    .await?;
    c.reasoning = st.cfg.reasoning_parser;
    let e = engine.clone();
    let mut p = st
        .work
        .run_sized(parsed.bytes, move || match route {
            Route::Chat => chat(&e, parsed, c),
            Route::Completions => completion(&e, parsed, c),
        })
        .await?
        .map_err(|e| in_client_terms(e, fields))?;
    compile_constraint(&engine, &mut p).await.map_err(|e| in_client_terms(e, fields))?;
    Ok((engine, p, echo))
}

/// `text`'s tokens as a prompt (BOS where the model wants it), or the context-length 400.
pub(crate) fn tokenize_prompt(
    tok: &Tokenizer,
    info: &EngineInfo,
    text: &str,
    param: &'static str,
) -> Result<Vec<u32>, ApiError> {
    let ctx = info.max_model_len();
    tok.encode_limited(text, ctx.saturating_sub(1)).map_err(|e| match e.downcast_ref::<TooLong>() {
        Some(_) => too_long(ctx, param),
        None => ApiError::invalid(param, format!("{e:#}")),
    })
}

/// A prompt of token ids and strings (llama-server's mixed prompt): ids below the vocabulary
/// size as they are, strings tokenized (the first element with the model's BOS), within the
/// context.
fn mixed_prompt(e: &EngineHandle, items: &[Value]) -> Result<Vec<u32>, ApiError> {
    let max = e.info.max_model_len().saturating_sub(1);
    let mut ids: Vec<u32> = Vec::new();
    for (i, v) in items.iter().enumerate() {
        let left = max.saturating_sub(ids.len());
        match v {
            Value::String(s) => {
                let got = e.tokenizer.tokenize_limited(s, i == 0, true, left).map_err(|err| {
                    match err.downcast_ref::<TooLong>() {
                        Some(_) => too_long(max + 1, "prompt"),
                        None => ApiError::invalid("prompt", format!("{err:#}")),
                    }
                })?;
                ids.extend(got);
            }
            Value::Number(n) => match n.as_u64().filter(|&id| id < e.info.vocab as u64) {
                Some(id) if left > 0 => ids.push(id as u32),
                Some(_) => return Err(too_long(max + 1, "prompt")),
                None => {
                    return Err(ApiError::invalid(
                        &format!("prompt[{i}]"),
                        format!("token id {n} is outside the vocabulary (size {})", e.info.vocab),
                    ))
                }
            },
            _ => return Err(ApiError::invalid(&format!("prompt[{i}]"), "`prompt` items must be token ids or strings")),
        }
    }
    Ok(ids)
}

/// `text`'s first tokens, as many as a prompt may have (Ollama's `truncate`).
pub(crate) fn tokenize_prompt_cut(
    tok: &Tokenizer,
    info: &EngineInfo,
    text: &str,
    param: &'static str,
) -> Result<Vec<u32>, ApiError> {
    tok.encode_prefix(text, info.max_model_len().saturating_sub(1))
        .map_err(|e| ApiError::invalid(param, format!("{e:#}")))
}

/// A chat request, ready to submit (blocking: run it on a worker).
pub(crate) fn chat(engine: &EngineHandle, parsed: Parsed, c: Common) -> Result<Prepared, ApiError> {
    json::with_budget(parsed.values_left, || chat_within(engine, parsed, c)).0
}

fn chat_within(engine: &EngineHandle, parsed: Parsed, mut c: Common) -> Result<Prepared, ApiError> {
    let f = Fields(&parsed.obj);
    let messages = parse_messages(f.get("messages"))?;
    let logprobs = f.bool("logprobs")?.unwrap_or(false);
    let top = f.int_in("top_logprobs", 0, MAX_TOP_LOGPROBS as i64)?;
    if top.is_some() && !logprobs {
        return Err(ApiError::invalid("top_logprobs", "`top_logprobs` requires `logprobs` to be true"));
    }
    let lp = logprobs.then(|| top.unwrap_or(0) as u32);
    let tool_req = ToolRequest::parse(&f)?;
    let kwargs = f.template_kwargs()?;
    let end = prefill::turn_end(&f, &messages)?;
    drop(parsed);
    let tok = &engine.tokenizer;
    let kind = c.reasoning.resolve(tok.chat_template_source());
    let harmony = kind == Some(reasoning::ReasoningKind::Harmony);
    // `required` and named functions: the output is held to a valid call by a grammar.
    if let Some(tc) = tool_req.as_ref().and_then(|t| t.constraint_for(&engine.tokenizer)) {
        if harmony {
            return Err(ApiError::invalid(
                "tool_choice",
                "this model answers in the harmony format: `tool_choice` may be `auto` or `none` (a required or \
                 named function cannot be enforced)",
            ));
        }
        if c.constraint.is_some() {
            return Err(ApiError::invalid(
                "tool_choice",
                "a required or named `tool_choice` cannot be combined with an output constraint (response_format, structured_outputs)",
            ));
        }
        // Each function's parameters as the document its own `$ref`s point into.
        for t in tool_req.iter().flat_map(|r| &r.tools) {
            let spec = ConstraintSpec::JsonSchema { schema: t.parameters.clone(), strict: false };
            structured::check_bounds(Some(&structured::Requested { spec, param: "tools" }))?;
        }
        c.constraint = Some(structured::Requested { spec: ConstraintSpec::Lark(tc.lark), param: "tools" });
    }
    structured::check_bounds(c.constraint.as_ref())?;
    let text = prefill::render(tok, &messages, tool_req.as_ref(), end, kwargs.as_ref())?;
    drop(messages);
    let reasoning = kind.map(|k| Reasoning::new(k, &text));
    let prompt = tokenize_prompt(tok, &engine.info, &text, "messages")?;
    drop(text);
    let want = room(&engine.info, prompt.len(), &c, c.max_tokens);
    let max_tokens = check_context(&engine.info, prompt.len(), want, "messages")?;
    let mut params: Vec<_> = (0..c.n).map(|j| c.request_params(j, max_tokens, lp)).collect();
    // A grammar constrains the answer, not the thinking before it.
    if let Some(r) = reasoning.filter(|r| r.starts_thinking() && c.constraint.is_some()) {
        params.iter_mut().for_each(|p| p.constraint_after = Some(r.answer_starts_after().to_string()));
    }
    // Gemma 4's channel tags may be special tokens too (its Hugging Face tokenizer's).
    let gemma4 = kind == Some(reasoning::ReasoningKind::Gemma4);
    if harmony || gemma4 || tool_req.as_ref().is_some_and(ToolRequest::parses_output) {
        // Harmony's channel markers are special tokens; as vLLM's Hermes parser, Hermes' tags may
        // be too (Qwen2.5's GGUF marks them so).
        params.iter_mut().for_each(|p| p.skip_special_tokens = false);
    }
    Ok(Prepared {
        common: c,
        plans: vec![Planned { prompt, choices: params }],
        logprobs: lp,
        tools: tool_req.filter(ToolRequest::parses_output),
        echo: vec![],
        echo_ids: vec![],
        reasoning,
    })
}

/// A completions request, ready to submit (blocking: run it on a worker).
pub(crate) fn completion(engine: &EngineHandle, parsed: Parsed, c: Common) -> Result<Prepared, ApiError> {
    let f = Fields(&parsed.obj);
    if f.get("tools").is_some_and(|t| t.as_array().is_none_or(|a| !a.is_empty())) {
        return Err(ApiError::invalid("tools", "`tools` is only supported on /v1/chat/completions"));
    }
    let echo = f.bool("echo")?.unwrap_or(false);
    let lp = f.int_in("logprobs", 0, MAX_TOP_LOGPROBS as i64)?.map(|n| n as u32);
    // `echo` with `logprobs`: the prompt's tokens come back with their logprobs too.
    let prompt_lp = if echo { lp } else { None };
    // OpenAI's `suffix`: the prompt is the text before the cursor, filled in the middle.
    let suffix = f.string("suffix")?.filter(|s| !s.is_empty()).map(str::to_string);
    if f.int("best_of")?.is_some_and(|b| b != c.n as i64) {
        return Err(ApiError::invalid("best_of", "`best_of` other than `n` is not supported"));
    }
    let prompts = parsed.prompts.ok_or_else(|| ApiError::invalid("prompt", "`prompt` is required"))?;
    if prompts.len() * c.n > MAX_CHOICES {
        return Err(ApiError::invalid(
            "prompt",
            format!("at most {MAX_CHOICES} sequences (prompts x n) per request, got {}", prompts.len() * c.n),
        ));
    }
    structured::check_bounds(c.constraint.as_ref())?;
    let tok = &engine.tokenizer;
    let max_tokens = Some(c.max_tokens.unwrap_or(COMPLETIONS_DEFAULT_MAX_TOKENS));
    let mut plans = Vec::with_capacity(prompts.len());
    let mut echoes = Vec::with_capacity(prompts.len());
    let mut echo_ids = Vec::new();
    for p in prompts {
        let (prompt, text) = match (p, &suffix) {
            (Prompt::Text(s), Some(suffix)) => {
                let fim = super::llama::Fim {
                    prefix: s.clone(),
                    suffix: suffix.clone(),
                    answer: max_tokens,
                    ..Default::default()
                };
                (fim.tokens(engine, "suffix")?, s)
            }
            (Prompt::Ids(_), Some(_)) => {
                return Err(ApiError::invalid("suffix", "`suffix` needs a text `prompt`"));
            }
            (Prompt::Text(s), None) => (tokenize_prompt(tok, &engine.info, &s, "prompt")?, s),
            (Prompt::Ids(ids), None) => {
                let text = if echo { tok.decode(&ids, false) } else { String::new() };
                (ids, text)
            }
        };
        let m = check_context(&engine.info, prompt.len(), room(&engine.info, prompt.len(), &c, max_tokens), "prompt")?;
        let choices: Vec<RequestParams> =
            (0..c.n).map(|j| RequestParams { prompt_logprobs: prompt_lp, ..c.request_params(j, m, lp) }).collect();
        if prompt_lp.is_some() {
            echo_ids.push(prompt.clone());
        }
        plans.push(Planned { prompt, choices });
        echoes.push(if echo { text } else { String::new() });
    }
    Ok(Prepared { common: c, plans, logprobs: lp, tools: None, echo: echoes, echo_ids, reasoning: None })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_clients_fields() {
        let fields = &[("max_tokens", "options.num_predict"), ("stop", "stop_sequences")];
        let e = in_client_terms(ApiError::invalid("max_tokens", "`max_tokens` must be at least 1"), fields);
        assert_eq!(
            (e.param.as_deref(), e.message.as_str()),
            (Some("options.num_predict"), "`options.num_predict` must be at least 1")
        );
        let e = in_client_terms(ApiError::invalid("stop[3]", "`stop[3]` is too long"), fields);
        assert_eq!(
            (e.param.as_deref(), e.message.as_str()),
            (Some("stop_sequences[3]"), "`stop_sequences[3]` is too long")
        );
        // A field that only starts like one, and a field not renamed, stay.
        let e = in_client_terms(ApiError::invalid("stop_token_ids", "`stop_token_ids` ..."), fields);
        assert_eq!(e.param.as_deref(), Some("stop_token_ids"));
        let e = in_client_terms(ApiError::invalid("temperature", "`temperature` ..."), fields);
        assert_eq!(e.param.as_deref(), Some("temperature"));
    }
}
