//! Streaming responses (SSE): one `data: {chunk}` event per token or piece, keep-alive
//! comments until the first engine event, the time limit as an `abort` finish and an error
//! event, the usage chunk, and `data: [DONE]`.

use super::*;

impl Output {
    pub(super) fn stream(self, mut choices: Vec<Choice>) -> Response {
        choices.sort_by_key(|c| c.index);
        let mut s = SseState {
            tail: VecDeque::new(),
            merged: stream::select_all(Vec::<BoxStream<'static, (usize, usize, Event)>>::new()),
            usage: vec![],
            offsets: HashMap::new(),
            parsers: HashMap::new(),
            splitters: HashMap::new(),
            harmony: HashMap::new(),
            open: choices.iter().map(|c| c.index).collect(),
            echo_pending: BTreeSet::new(),
            prompt_lps: HashMap::new(),
            clocks: HashMap::new(),
            finished: false,
            started: false,
            out: self,
        };
        for c in &choices {
            if s.out.chat {
                let delta = json!({"role": "assistant", "content": "", "refusal": null});
                s.push_choice(json!({"index": c.index, "delta": delta, "logprobs": null, "finish_reason": null}));
            } else if s.out.echo_prompt(c.prompt_index).is_some() {
                // Sent with the prompt's logprobs, once they are in (before the first token).
                s.echo_pending.insert(c.index);
            } else if !s.out.echo_of(c.prompt_index).is_empty() {
                let text = s.out.echo_of(c.prompt_index).to_string();
                s.push_choice(json!({"index": c.index, "text": text, "logprobs": null, "finish_reason": null}));
            }
        }
        s.merged = stream::select_all(choices.into_iter().map(|c| {
            stream::unfold(c, |mut c| async move {
                let e = c.next().await?;
                Some(((c.index, c.prompt_index, e), c))
            })
            .boxed()
        }));
        let body = stream::unfold(s, |mut s| async move {
            loop {
                if let Some(b) = s.tail.pop_front() {
                    return Some((Ok::<Bytes, Infallible>(b), s));
                }
                if s.finished {
                    return None;
                }
                // Until the first engine event, a comment every `sse_keepalive` keeps proxies
                // from closing a stream that waits in the queue or on a long prefill.
                let keepalive = if s.started { None } else { s.out.st.cfg.sse_keepalive };
                let far = tokio::time::Instant::now() + Duration::from_secs(86_400);
                let deadline_at = s.out.deadline.map_or(far, |(_, at)| at);
                let keepalive_at = keepalive.map_or(far, |d| tokio::time::Instant::now() + d);
                let wake = tokio::select! {
                    biased;
                    next = s.merged.next() => Wake::Next(next),
                    _ = tokio::time::sleep_until(deadline_at), if s.out.deadline.is_some() => Wake::Deadline,
                    _ = tokio::time::sleep_until(keepalive_at), if keepalive.is_some() => Wake::KeepAlive,
                };
                match wake {
                    Wake::Next(Some((index, prompt_index, e))) => {
                        s.started = true;
                        s.on_event(index, prompt_index, e)
                    }
                    Wake::Next(None) => s.finish(),
                    Wake::Deadline => {
                        if let Some((limit, _)) = s.out.deadline {
                            s.time_out(limit);
                        }
                    }
                    Wake::KeepAlive => s.tail.push_back(Bytes::from_static(SSE_KEEPALIVE)),
                }
            }
        });
        let mut r = Body::from_stream(body).into_response();
        let h = r.headers_mut();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        r
    }
}

/// An SSE comment: clients (the openai package, EventSource) ignore it.
pub const SSE_KEEPALIVE: &[u8] = b": keep-alive\n\n";

/// What ended a wait of a streaming response.
enum Wake {
    Next(Option<(usize, usize, Event)>),
    Deadline,
    KeepAlive,
}

/// A streaming response in progress; dropping it (client gone) drops every choice's stream.
struct SseState {
    out: Output,
    merged: SelectAll<BoxStream<'static, (usize, usize, Event)>>,
    /// SSE messages ready to send.
    tail: VecDeque<Bytes>,
    /// (choice index, prompt index, usage) of finished choices.
    usage: Vec<(usize, usize, Usage)>,
    /// Legacy logprobs: each choice's text offset so far.
    offsets: HashMap<usize, usize>,
    /// Chat with tools: each choice's tool-call parser.
    parsers: HashMap<usize, ToolCallParser>,
    /// Chat with a reasoning parser: each choice's splitter.
    splitters: HashMap<usize, Splitter>,
    /// Chat in the harmony format: each choice's parser (reasoning and tool calls).
    harmony: HashMap<usize, HarmonyParser>,
    /// Choices not finished yet.
    open: BTreeSet<usize>,
    /// Completions with `echo` and `logprobs`: choices whose echo chunk waits for the prompt's
    /// logprobs, and those received so far.
    echo_pending: BTreeSet<usize>,
    prompt_lps: HashMap<usize, Vec<PromptLogprob>>,
    /// Each choice's clock (`timings_per_token`, `return_progress`).
    clocks: HashMap<usize, Clock>,
    finished: bool,
    /// Whether an engine event arrived (no more keep-alive comments after it).
    started: bool,
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

impl SseState {
    fn parser(&mut self, index: usize) -> &mut ToolCallParser {
        let tools = &self.out.tools;
        self.parsers.entry(index).or_insert_with(|| ToolCallParser::new(tools.clone().expect("a tools request")))
    }

    /// Chunks for parsed output: content deltas, and each call as one `delta.tool_calls` chunk
    /// (id, type, name and the whole arguments). `lp` (a token's logprobs) goes on the first
    /// chunk, or on an empty content delta when the token's text is held back.
    fn push_pieces(&mut self, index: usize, pieces: Vec<Piece>, mut lp: Value) {
        if pieces.is_empty() && !lp.is_null() {
            self.push_choice(json!({"index": index, "delta": {"content": ""}, "logprobs": lp, "finish_reason": null}));
            return;
        }
        for piece in pieces {
            let delta = match piece {
                Piece::Content(text) => json!({"content": text}),
                Piece::Call(c) => {
                    let mut call = tools::call_json(&self.out.call_id(), &c);
                    call["index"] = json!(c.index);
                    json!({"tool_calls": [call]})
                }
            };
            let lp = std::mem::take(&mut lp);
            self.push_choice(json!({"index": index, "delta": delta, "logprobs": lp, "finish_reason": null}));
        }
    }

    /// Chunks for a harmony choice's `text` (`last`: the output ends here); returns how many
    /// calls the choice has made.
    fn push_harmony(&mut self, index: usize, text: &str, last: bool, mut lp: Value) -> usize {
        let tools = &self.out.tools;
        let p = self.harmony.entry(index).or_insert_with(|| HarmonyParser::new(tools.clone()));
        let mut parts = p.push(text);
        if last {
            parts.extend(p.finish());
        }
        let calls = p.calls();
        for part in parts {
            let l = std::mem::take(&mut lp);
            match part {
                HarmonyPart::Reasoning(t) => self.push_choice(
                    json!({"index": index, "delta": {"reasoning_content": t}, "logprobs": l, "finish_reason": null}),
                ),
                HarmonyPart::Content(t) => self.push_pieces(index, vec![Piece::Content(t)], l),
                HarmonyPart::Call(c) => self.push_pieces(index, vec![Piece::Call(c)], l),
            }
        }
        if !lp.is_null() {
            self.push_choice(json!({"index": index, "delta": {"content": ""}, "logprobs": lp, "finish_reason": null}));
        }
        calls
    }

    /// Chat output text as parts: through the choice's reasoning splitter when the request has
    /// one (`last`: the output ends here), else all content.
    fn split(&mut self, index: usize, text: &str, last: bool) -> Vec<reasoning::Part> {
        let Some(r) = self.out.reasoning else { return vec![reasoning::Part::Content(text.to_string())] };
        let s = self.splitters.entry(index).or_insert_with(|| Splitter::new(r));
        let mut parts = s.push(text);
        if last {
            parts.extend(s.finish());
        }
        parts
    }

    /// Chunks for chat parts: `delta.reasoning_content`, and content (through the tool-call
    /// parser when the request has tools). `lp` goes on the first chunk, or on an empty content
    /// delta when nothing is sent.
    fn push_parts(&mut self, index: usize, parts: Vec<reasoning::Part>, mut lp: Value) {
        for part in parts {
            let l = std::mem::take(&mut lp);
            match part {
                reasoning::Part::Reasoning(t) => self.push_choice(
                    json!({"index": index, "delta": {"reasoning_content": t}, "logprobs": l, "finish_reason": null}),
                ),
                reasoning::Part::Content(t) if self.out.tools.is_some() => {
                    let pieces = self.parser(index).push(&t);
                    self.push_pieces(index, pieces, l);
                }
                reasoning::Part::Content(t) => self.push_choice(
                    json!({"index": index, "delta": {"content": t}, "logprobs": l, "finish_reason": null}),
                ),
            }
        }
        if !lp.is_null() {
            self.push_choice(json!({"index": index, "delta": {"content": ""}, "logprobs": lp, "finish_reason": null}));
        }
    }

    fn clock(&mut self, index: usize) -> &mut Clock {
        let t0 = self.out.t0;
        self.clocks.entry(index).or_insert_with(|| Clock::new(t0, 0))
    }

    fn push_choice(&mut self, choice: Value) {
        // From the choice's first engine event on (the role chunk goes out before it).
        let timings = match choice["index"].as_u64() {
            Some(i) if self.out.timings => self.clocks.get(&(i as usize)).map(Clock::timings),
            _ => None,
        };
        let mut v = self.out.envelope(true, vec![choice]);
        if self.out.include_usage {
            v["usage"] = Value::Null;
        }
        if let Some(t) = timings {
            v["timings"] = t;
        }
        self.tail.push_back(sse(&v));
    }

    /// `echo` with `logprobs`: the echo chunk, with the prompt's logprobs, once they are all in.
    fn flush_echo(&mut self, index: usize, prompt_index: usize) {
        if !self.echo_pending.remove(&index) {
            return;
        }
        let lps = self.prompt_lps.remove(&index).unwrap_or_default();
        let ids = self.out.echo_prompt(prompt_index).unwrap_or(&[]);
        let off = self.offsets.entry(index).or_insert(0);
        let lp = self.out.legacy_logprobs(Some((ids, &lps)), &[], off);
        let text = self.out.echo_of(prompt_index).to_string();
        self.push_choice(json!({"index": index, "text": text, "logprobs": lp, "finish_reason": null}));
    }

    fn on_event(&mut self, index: usize, prompt_index: usize, e: Event) {
        if !matches!(
            e,
            Event::PromptLogprobs(_) | Event::Done { reason: FinishReason::Error(_) | FinishReason::Abort, .. }
        ) {
            self.flush_echo(index, prompt_index);
        }
        match e {
            Event::PromptLogprobs(lps) => self.prompt_lps.entry(index).or_default().extend(lps),
            Event::Embedding(_) => {}
            Event::Progress { processed, cached, total } => {
                let progress = self.clock(index).progress(processed, cached, total);
                if self.out.progress {
                    let mut v = self.out.envelope(true, vec![]);
                    v["prompt_progress"] = progress;
                    self.tail.push_back(sse(&v));
                }
            }
            Event::Token { id, text, logprob, top } => {
                self.clock(index).token();
                if text.is_empty() && !self.out.logprobs {
                    return;
                }
                let toks = [TokenOut { id, logprob, top }];
                if self.out.chat {
                    let lp = if self.out.logprobs { self.out.chat_logprobs(&toks) } else { Value::Null };
                    if self.out.reasoning.is_some_and(|r| r.is_harmony()) {
                        self.push_harmony(index, &text, false, lp);
                        return;
                    }
                    let parts = self.split(index, &text, false);
                    self.push_parts(index, parts, lp);
                } else {
                    let lp = if self.out.logprobs {
                        let off = self.offsets.entry(index).or_insert(0);
                        self.out.legacy_logprobs(None, &toks, off)
                    } else {
                        Value::Null
                    };
                    self.push_choice(json!({"index": index, "text": text, "logprobs": lp, "finish_reason": null}));
                }
            }
            Event::Done { text, reason: finish, usage } => {
                self.open.remove(&index);
                if let Some(err) = error_of(&finish) {
                    self.tail.push_back(sse(&err.body()));
                    self.tail.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
                    self.finished = true;
                    return;
                }
                self.usage.push((index, prompt_index, usage));
                self.clock(index).done(&usage);
                let mut reason = json!(finish.as_openai());
                if self.out.chat && self.out.reasoning.is_some_and(|r| r.is_harmony()) {
                    if self.push_harmony(index, &text, true, Value::Null) > 0 {
                        reason = tool_calls_reason(&finish, reason);
                    }
                    self.push_choice(json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": reason}));
                } else if self.out.chat {
                    let mut parts = self.split(index, &text, true);
                    parts.retain(
                        |p| !matches!(p, reasoning::Part::Reasoning(t) | reasoning::Part::Content(t) if t.is_empty()),
                    );
                    self.push_parts(index, parts, Value::Null);
                    if self.out.tools.is_some() {
                        let parser = self.parser(index);
                        let pieces = parser.finish();
                        if parser.calls() > 0 {
                            reason = tool_calls_reason(&finish, reason);
                        }
                        self.push_pieces(index, pieces, Value::Null);
                    }
                    self.push_choice(json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": reason}));
                } else {
                    self.push_choice(json!({"index": index, "text": text, "logprobs": null, "finish_reason": reason}));
                }
            }
        }
    }

    /// The time limit passed: every unfinished choice ends with finish reason `abort` (its
    /// engine request aborted), then an error event (408's body) and `[DONE]`.
    fn time_out(&mut self, limit: Duration) {
        self.merged = stream::select_all(Vec::new());
        for index in std::mem::take(&mut self.open) {
            if self.out.chat {
                self.push_choice(json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": "abort"}));
            } else {
                self.push_choice(json!({"index": index, "text": "", "logprobs": null, "finish_reason": "abort"}));
            }
        }
        self.out.st.metrics.timed_out.fetch_add(1, Relaxed);
        self.tail.push_back(sse(&ApiError::timed_out(limit).body()));
        self.tail.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
        self.finished = true;
    }

    /// Every choice is done: the usage chunk (with include_usage), then `[DONE]`.
    fn finish(&mut self) {
        if self.out.include_usage {
            self.usage.sort_by_key(|u| u.0);
            let per: Vec<(usize, Usage)> = self.usage.iter().map(|&(_, p, u)| (p, u)).collect();
            let mut v = self.out.envelope(true, vec![]);
            v["usage"] = total_usage(&per);
            self.tail.push_back(sse(&v));
        }
        self.tail.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
        self.finished = true;
    }
}
