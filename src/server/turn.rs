//! One assistant turn for the APIs beyond OpenAI's chat completions (Anthropic Messages, the
//! Responses API, Ollama): a request translated into a chat (or completions) request and
//! prepared as one (`prepare::translated`), submitted as one sequence, and its output read
//! back as semantic parts (reasoning, text, tool calls) by the same parsers the chat route
//! uses, whole or as a stream of events that each API renders in its own shape.

use super::access::AccessRecord;
use super::error::ApiError;
use super::generate::{submit, Choice};
use super::harmony::{HarmonyParser, HarmonyPart};
use super::openai::{deadline, error_of};
use super::prepare::{self, Translate};
use super::reasoning::{self, Reasoning, Splitter};
use super::tools::{ParsedCall, Piece, ToolCallParser, ToolRequest};
use super::AppState;
use crate::engine::{Event, FinishReason, Usage};
use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, BoxStream};
use futures_util::StreamExt;
use serde_json::Value;
use std::convert::Infallible;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A piece of an assistant turn, in output order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Part {
    Reasoning(String),
    Text(String),
    Call(ParsedCall),
}

/// Splits one sequence's output, fed in any pieces, into [`Part`]s: the reasoning parser's
/// span (or gpt-oss's harmony channels), then tool calls in the answer.
pub(crate) struct TurnParser {
    splitter: Option<Splitter>,
    calls: Option<ToolCallParser>,
    harmony: Option<HarmonyParser>,
}

impl TurnParser {
    pub fn new(reasoning: Option<Reasoning>, tools: Option<ToolRequest>) -> TurnParser {
        if reasoning.is_some_and(|r| r.is_harmony()) {
            return TurnParser { splitter: None, calls: None, harmony: Some(HarmonyParser::new(tools)) };
        }
        TurnParser { splitter: reasoning.map(Splitter::new), calls: tools.map(ToolCallParser::new), harmony: None }
    }

    /// How many calls the output has made so far.
    pub fn calls(&self) -> usize {
        match (&self.harmony, &self.calls) {
            (Some(h), _) => h.calls(),
            (None, Some(c)) => c.calls(),
            (None, None) => 0,
        }
    }

    fn answer(&mut self, parts: Vec<reasoning::Part>, last: bool) -> Vec<Part> {
        let mut out = Vec::new();
        for p in parts {
            match (p, &mut self.calls) {
                (reasoning::Part::Reasoning(t), _) => out.push(Part::Reasoning(t)),
                (reasoning::Part::Content(t), Some(c)) => out.extend(c.push(&t).into_iter().map(piece)),
                (reasoning::Part::Content(t), None) => out.push(Part::Text(t)),
            }
        }
        if last {
            if let Some(c) = &mut self.calls {
                out.extend(c.finish().into_iter().map(piece));
            }
        }
        merge(out)
    }

    /// The parts `text` completes (text that may start a tag is held back).
    pub fn push(&mut self, text: &str) -> Vec<Part> {
        if let Some(h) = &mut self.harmony {
            return merge(h.push(text).into_iter().map(harmony_part).collect());
        }
        let parts = match &mut self.splitter {
            Some(s) => s.push(text),
            None => vec![reasoning::Part::Content(text.to_string())],
        };
        self.answer(parts, false)
    }

    /// The output's last text and everything held back.
    pub fn finish(&mut self, text: &str) -> Vec<Part> {
        if let Some(h) = &mut self.harmony {
            let mut parts = h.push(text);
            parts.extend(h.finish());
            return merge(parts.into_iter().map(harmony_part).collect());
        }
        let parts = match &mut self.splitter {
            Some(s) => {
                let mut p = s.push(text);
                p.extend(s.finish());
                p
            }
            None => vec![reasoning::Part::Content(text.to_string())],
        };
        self.answer(parts, true)
    }
}

fn piece(p: Piece) -> Part {
    match p {
        Piece::Content(t) => Part::Text(t),
        Piece::Call(c) => Part::Call(c),
    }
}

fn harmony_part(p: HarmonyPart) -> Part {
    match p {
        HarmonyPart::Reasoning(t) => Part::Reasoning(t),
        HarmonyPart::Content(t) => Part::Text(t),
        HarmonyPart::Call(c) => Part::Call(c),
    }
}

/// Parts without empty texts, neighbours of one kind joined.
pub(crate) fn merge(parts: Vec<Part>) -> Vec<Part> {
    let mut out: Vec<Part> = Vec::with_capacity(parts.len());
    for p in parts {
        match (out.last_mut(), p) {
            (_, Part::Reasoning(t) | Part::Text(t)) if t.is_empty() => {}
            (Some(Part::Reasoning(a)), Part::Reasoning(b)) | (Some(Part::Text(a)), Part::Text(b)) => a.push_str(&b),
            (_, p) => out.push(p),
        }
    }
    out
}

/// A turn's whole output.
pub(crate) struct Whole {
    pub parts: Vec<Part>,
    pub reason: FinishReason,
    pub usage: Usage,
    /// How many tool calls it made.
    pub calls: usize,
    /// When its first token came (None: it made none).
    pub first: Option<std::time::Instant>,
}

/// What a streamed turn reports.
pub(crate) enum TurnEvent {
    Parts(Vec<Part>),
    /// Nothing yet (queued, or a long prefill): time for the API's keep-alive.
    KeepAlive,
    /// The last parts and the end.
    Done {
        parts: Vec<Part>,
        reason: FinishReason,
        usage: Usage,
        calls: usize,
    },
    /// The turn failed (engine error, shutdown, time limit); nothing follows.
    Failed(ApiError),
}

/// One submitted sequence and what reading it needs.
pub(crate) struct Turn {
    pub st: Arc<AppState>,
    pub choice: Choice,
    pub parser: TurnParser,
    /// The prompt's length in tokens.
    pub prompt_tokens: usize,
    pub stream: bool,
    /// What the translation kept of the request for the response.
    pub echo: Value,
    /// The request's stop strings (`Usage::stop_string` indexes them).
    pub stops: Vec<String>,
    deadline: Option<(Duration, tokio::time::Instant)>,
}

impl Turn {
    /// Reads, translates, prepares and submits a request (within the caller's time limit).
    pub async fn start(
        st: &Arc<AppState>,
        headers: &HeaderMap,
        body: Body,
        t0: Instant,
        log: &AccessRecord,
        translate: Translate,
    ) -> Result<Turn, ApiError> {
        let (engine, p, echo) = prepare::translated(st, headers, body, translate).await?;
        let prompt_tokens = p.plans.first().map_or(0, |pl| pl.prompt.len());
        let c = p.common;
        let stops = c.stop.clone();
        let mut choices = submit(st, &engine, p.plans, t0, log).await?;
        let choice = choices.pop().ok_or_else(|| ApiError::internal("no sequence was submitted"))?;
        Ok(Turn {
            st: st.clone(),
            choice,
            parser: TurnParser::new(p.reasoning, p.tools),
            prompt_tokens,
            stream: c.stream,
            echo,
            stops,
            deadline: deadline(t0, c.timeout),
        })
    }

    /// Waits for the whole output.
    pub async fn whole(mut self) -> Result<Whole, ApiError> {
        let (mut text, mut first) = (String::new(), None);
        loop {
            match self.choice.next().await {
                Some(Event::Token { text: t, .. }) => {
                    first.get_or_insert_with(std::time::Instant::now);
                    text.push_str(&t)
                }
                Some(Event::PromptLogprobs(_) | Event::Embedding(_) | Event::Progress { .. }) => {}
                Some(Event::Done { text: t, reason, usage }) => {
                    if let Some(e) = error_of(&reason) {
                        return Err(e);
                    }
                    text.push_str(&t);
                    let mut parts = self.parser.push(&text);
                    parts.extend(self.parser.finish(""));
                    let calls = self.parser.calls();
                    return Ok(Whole { parts: merge(parts), reason, usage, calls, first });
                }
                None => return Err(ApiError::internal("the engine stopped")),
            }
        }
    }

    /// The output as events, ending with `Done` or `Failed`. Before the first token a
    /// `KeepAlive` comes every `sse_keepalive`; at the time limit the turn fails with a 408
    /// (dropping the stream aborts the engine request).
    pub fn events(self) -> BoxStream<'static, TurnEvent> {
        stream::unfold(Some((self, false)), |state| async move {
            let (mut t, mut started) = state?;
            let keepalive = if started { None } else { t.st.cfg.sse_keepalive };
            let far = tokio::time::Instant::now() + Duration::from_secs(86_400);
            let deadline_at = t.deadline.map_or(far, |(_, at)| at);
            let keepalive_at = keepalive.map_or(far, |d| tokio::time::Instant::now() + d);
            loop {
                tokio::select! {
                    biased;
                    e = t.choice.next() => {
                        started = true;
                        match e {
                            Some(Event::Token { text, .. }) => {
                                let parts = t.parser.push(&text);
                                if !parts.is_empty() {
                                    return Some((TurnEvent::Parts(parts), Some((t, started))));
                                }
                            }
                            Some(Event::PromptLogprobs(_) | Event::Embedding(_) | Event::Progress { .. }) => {}
                            Some(Event::Done { text, reason, usage }) => {
                                if let Some(e) = error_of(&reason) {
                                    return Some((TurnEvent::Failed(e), None));
                                }
                                let parts = t.parser.finish(&text);
                                let calls = t.parser.calls();
                                return Some((TurnEvent::Done { parts, reason, usage, calls }, None));
                            }
                            None => return Some((TurnEvent::Failed(ApiError::internal("the engine stopped")), None)),
                        }
                    }
                    _ = tokio::time::sleep_until(deadline_at), if t.deadline.is_some() => {
                        t.st.metrics.timed_out.fetch_add(1, Relaxed);
                        let limit = t.deadline.map_or(Duration::ZERO, |(l, _)| l);
                        return Some((TurnEvent::Failed(ApiError::timed_out(limit)), None));
                    }
                    _ = tokio::time::sleep_until(keepalive_at), if keepalive.is_some() && !started => {
                        return Some((TurnEvent::KeepAlive, Some((t, started))));
                    }
                }
            }
        })
        .boxed()
    }
}

/// A streamed response: `head`, then each event rendered by `render`.
pub(crate) fn stream_response(
    head: Vec<Bytes>,
    events: BoxStream<'static, TurnEvent>,
    mut render: impl FnMut(TurnEvent) -> Vec<Bytes> + Send + 'static,
    content_type: &'static str,
) -> Response {
    let rest = events.flat_map(move |e| stream::iter(render(e)));
    let body = stream::iter(head).chain(rest).map(Ok::<Bytes, Infallible>);
    let mut r = Body::from_stream(body).into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

/// An SSE message with an event name.
pub(crate) fn sse_event(name: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {data}\n\n"))
}

/// Another API's tool list as chat `tools`: each tool's type checked by `check_type` (an error
/// message for a type not taken), then its fields `renamed` (from, to) into the function object.
pub(crate) fn chat_tools(
    v: &Value,
    check_type: fn(Option<&str>) -> Option<String>,
    renamed: &[(&str, &str)],
) -> Result<Vec<Value>, ApiError> {
    let Value::Array(list) = v else { return Err(ApiError::invalid("tools", "`tools` must be an array")) };
    list.iter()
        .enumerate()
        .map(|(i, t)| {
            if let Some(why) = check_type(t.get("type").and_then(Value::as_str)) {
                return Err(ApiError::invalid(&format!("tools[{i}].type"), why));
            }
            let mut f = serde_json::Map::new();
            for (from, to) in renamed {
                if let Some(v) = t.get(*from).filter(|v| !v.is_null()) {
                    f.insert(to.to_string(), v.clone());
                }
            }
            Ok(serde_json::json!({"type": "function", "function": f}))
        })
        .collect()
}

/// A tool call's arguments as a JSON value (an object; `{}` when the text is not one).
pub(crate) fn arguments_value(c: &ParsedCall) -> Value {
    match serde_json::from_str::<Value>(&c.arguments) {
        Ok(v @ Value::Object(_)) => v,
        _ => Value::Object(Default::default()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_joins_neighbours_and_drops_empty_text() {
        let call = ParsedCall { index: 0, name: "f".into(), arguments: "{}".into() };
        let got = merge(vec![
            Part::Reasoning("a".into()),
            Part::Reasoning("b".into()),
            Part::Text(String::new()),
            Part::Text("c".into()),
            Part::Call(call.clone()),
            Part::Text("d".into()),
            Part::Text("e".into()),
        ]);
        assert_eq!(
            got,
            vec![Part::Reasoning("ab".into()), Part::Text("c".into()), Part::Call(call), Part::Text("de".into())]
        );
    }
}
