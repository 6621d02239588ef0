//! From validated requests to engine streams: admission control (the queue limit), submitting
//! n choices per prompt (sharing the prompt's prefill through the prefix cache), and each
//! choice's events with the server's latency measurements.
//!
//! Everything here is owned by the handler future or by the response body, so a client that
//! goes away drops its `RequestStream`s, which aborts the requests and frees their KV blocks.

use super::access::AccessRecord;
use super::error::ApiError;
use super::queue::{reserve, share, Gate, QueueSlot};
use super::AppState;
use crate::engine::handle::EngineInfo;
use crate::engine::{EngineHandle, Event, FinishReason, PromptLogprob, Request, RequestParams, RequestStream, Usage};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

/// The most tokens a request may ask for, or a 400 naming `param` when the prompt does not
/// leave room. `max_tokens` None: whatever room is left.
pub(crate) fn check_context(
    info: &EngineInfo,
    prompt_len: usize,
    max_tokens: Option<usize>,
    param: &str,
) -> Result<usize, ApiError> {
    let ctx = info.max_model_len();
    if prompt_len == 0 {
        return Err(ApiError::invalid(param, "the prompt is empty"));
    }
    if prompt_len >= ctx {
        return Err(ApiError::invalid(
            param,
            format!(
                "This model's maximum context length is {ctx} tokens. However, your prompt has {prompt_len} tokens, \
                 which leaves no room for the completion. Please reduce the length of the prompt."
            ),
        )
        .code("context_length_exceeded")
        .with_context(prompt_len, ctx));
    }
    match max_tokens {
        None => Ok(ctx - prompt_len),
        Some(m) if m > ctx - prompt_len => Err(ApiError::invalid(
            param,
            format!(
                "This model's maximum context length is {ctx} tokens. However, you requested {} tokens \
                 ({prompt_len} in the prompt, {m} for the completion). Please reduce the length of the prompt \
                 or the completion.",
                prompt_len.saturating_add(m)
            ),
        )
        .code("context_length_exceeded")
        .with_context(prompt_len, ctx)),
        Some(m) => Ok(m),
    }
}

/// One prompt and the engine parameters of each of its choices.
pub(crate) struct Planned {
    pub prompt: Vec<u32>,
    pub choices: Vec<RequestParams>,
}

/// One sequence of a response: choice `index`, generated for prompt `prompt_index`.
pub(crate) struct Choice {
    pub index: usize,
    pub prompt_index: usize,
    /// None until submitted (see `pending`).
    stream: Option<RequestStream>,
    /// A sequence of a request larger than its queue share: submitted when its first event is
    /// awaited and the request's [`Gate`] has a place for it.
    pending: Option<(Request, EngineHandle)>,
    gate: Option<Arc<Gate>>,
    slot: Option<QueueSlot>,
    buffered: Option<Event>,
    st: Arc<AppState>,
    t0: Instant,
    last: Option<Instant>,
    done: bool,
    log: AccessRecord,
}

impl Choice {
    /// Receives the next event and records the latencies; a stream that ends without `Done`
    /// (the engine stopped) ends with an error.
    async fn recv(&mut self) -> Option<Event> {
        if self.done {
            return None;
        }
        if let Some((request, engine)) = self.pending.take() {
            match self.start(request, &engine).await {
                Ok(stream) => self.stream = Some(stream),
                Err(e) => {
                    self.done = true;
                    let reason = FinishReason::Error(e.message);
                    self.log.done(self.index, Usage::default(), &reason);
                    self.st.metrics.observe_finished(0, 0, "error");
                    return Some(Event::Done { text: String::new(), reason, usage: Usage::default() });
                }
            }
        }
        let e = match &mut self.stream {
            Some(s) => s.next().await,
            None => None,
        };
        if let Some(slot) = self.slot.take() {
            if let Some(g) = &self.gate {
                g.give_back(slot);
            }
        }
        let now = Instant::now();
        let m = &self.st.metrics;
        match e {
            Some(Event::Token { .. }) => {
                match self.last {
                    None => {
                        m.observe_ttft(now - self.t0);
                        self.log.first_token(now - self.t0);
                    }
                    Some(prev) => m.observe_itl(now - prev),
                }
                self.last = Some(now);
                e
            }
            Some(Event::PromptLogprobs(_) | Event::Embedding(_) | Event::Progress { .. }) => e,
            Some(Event::Done { usage, ref reason, .. }) => {
                self.done = true;
                // A sequence whose only token ended it (eos) still had a first token.
                if self.last.is_none() && usage.completion_tokens > 0 {
                    m.observe_ttft(now - self.t0);
                    self.log.first_token(now - self.t0);
                }
                self.log.done(self.index, usage, reason);
                m.prompt_tokens.fetch_add(usage.prompt_tokens as u64, Relaxed);
                m.generation_tokens.fetch_add(usage.completion_tokens as u64, Relaxed);
                m.observe_e2e(now - self.t0);
                m.observe_finished(usage.prompt_tokens, usage.completion_tokens, reason.as_openai());
                e
            }
            None => {
                self.done = true;
                self.log.done(self.index, Usage::default(), &FinishReason::Error(String::new()));
                self.st.metrics.observe_finished(0, 0, "error");
                Some(Event::Done {
                    text: String::new(),
                    reason: FinishReason::Error("the engine stopped".into()),
                    usage: Usage::default(),
                })
            }
        }
    }

    /// Submits a deferred sequence once its request's gate has a place for it.
    async fn start(&mut self, request: Request, engine: &EngineHandle) -> Result<RequestStream, ApiError> {
        let gate = self.gate.clone().ok_or_else(|| ApiError::internal("a deferred sequence without its gate"))?;
        self.slot = Some(gate.take().await?);
        engine.submit(request).map_err(refused)
    }

    /// Waits for the first event and keeps it for [`next`](Self::next).
    async fn wait_first(&mut self) {
        if self.buffered.is_none() {
            self.buffered = self.recv().await;
        }
    }

    pub async fn next(&mut self) -> Option<Event> {
        match self.buffered.take() {
            Some(e) => Some(e),
            None => self.recv().await,
        }
    }
}

impl Drop for Choice {
    /// A choice dropped before its end (the client went away, or the time limit came) counts as
    /// aborted; the engine aborts the sequence when its stream closes.
    fn drop(&mut self) {
        if !self.done {
            self.st.metrics.observe_aborted();
        }
    }
}

/// What submitting needs besides the request.
struct Submitter<'a> {
    st: &'a Arc<AppState>,
    engine: &'a EngineHandle,
    t0: Instant,
    log: &'a AccessRecord,
}

impl Submitter<'_> {
    fn submit(
        &self,
        prompt: &[u32],
        params: RequestParams,
        (index, prompt_index): (usize, usize),
        slot: QueueSlot,
    ) -> Result<Choice, ApiError> {
        let stream = self.engine.submit(Request { prompt: prompt.to_vec(), params }).map_err(refused)?;
        self.log.choice(index, prompt_index);
        Ok(self.choice((index, prompt_index), Some(stream), Some(slot)))
    }

    /// A sequence submitted later, when `gate` has a place for it.
    fn defer(&self, prompt: &[u32], params: RequestParams, at: (usize, usize), gate: &Arc<Gate>) -> Choice {
        self.log.choice(at.0, at.1);
        let mut c = self.choice(at, None, None);
        c.pending = Some((Request { prompt: prompt.to_vec(), params }, self.engine.clone()));
        c.gate = Some(gate.clone());
        c
    }

    fn choice(
        &self,
        (index, prompt_index): (usize, usize),
        stream: Option<RequestStream>,
        slot: Option<QueueSlot>,
    ) -> Choice {
        Choice {
            index,
            prompt_index,
            stream,
            pending: None,
            gate: None,
            slot,
            buffered: None,
            st: self.st.clone(),
            t0: self.t0,
            last: None,
            done: false,
            log: self.log.clone(),
        }
    }
}

fn refused(e: impl std::fmt::Display) -> ApiError {
    ApiError::unavailable(format!("the engine refused the request: {e}"), "engine_unavailable")
}

/// Validates every request, takes queue places, and submits them. Choice indices run
/// prompt-major (`prompt_index * n + j`). With several choices per prompt and prefill sharing
/// on, the first choice prefills the prompt alone and the others start once its blocks are in
/// the prefix cache.
pub(crate) async fn submit(
    st: &Arc<AppState>,
    engine: &EngineHandle,
    plans: Vec<Planned>,
    t0: Instant,
    log: &AccessRecord,
) -> Result<Vec<Choice>, ApiError> {
    for p in &plans {
        for params in &p.choices {
            engine.validate_parts(&p.prompt, params).map_err(ApiError::bad_request)?;
        }
    }
    let total: usize = plans.iter().map(|p| p.choices.len()).sum();
    let sub = &Submitter { st, engine, t0, log };
    if total > share(st) {
        // More sequences than one request's share of the queue: each is submitted in turn, as
        // the request's earlier ones leave the queue.
        let gate = Arc::new(Gate::new(reserve(st, share(st))?, total));
        let mut out = Vec::with_capacity(total);
        for (pi, plan) in plans.into_iter().enumerate() {
            for params in plan.choices {
                out.push(sub.defer(&plan.prompt, params, (out.len(), pi), &gate));
            }
        }
        return Ok(out);
    }
    let mut slots = reserve(st, total)?;
    let block_size = engine.info.block_size;
    let mut base = 0;
    let mut jobs = Vec::with_capacity(plans.len());
    for (pi, plan) in plans.into_iter().enumerate() {
        let n = plan.choices.len();
        let my_slots: Vec<QueueSlot> = slots.drain(..n).collect();
        let share = n > 1 && st.cfg.share_prompt_prefill && plan.prompt.len() > block_size;
        let first_index = base;
        base += n;
        jobs.push(async move {
            let mut out = Vec::with_capacity(n);
            let mut params = plan.choices.into_iter();
            let mut slots = my_slots.into_iter();
            let (Some(p0), Some(s0)) = (params.next(), slots.next()) else { return Ok(out) };
            out.push(sub.submit(&plan.prompt, p0, (first_index, pi), s0)?);
            if share {
                out[0].wait_first().await;
            }
            for (j, (p, s)) in params.zip(slots).enumerate() {
                out.push(sub.submit(&plan.prompt, p, (first_index + j + 1, pi), s)?);
            }
            Ok::<_, ApiError>(out)
        });
    }
    let groups = futures_util::future::try_join_all(jobs).await?;
    Ok(groups.into_iter().flatten().collect())
}

/// One token of a choice, kept for logprobs.
#[derive(Clone, Debug)]
pub(crate) struct TokenOut {
    pub id: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// A choice's whole output.
pub(crate) struct Collected {
    pub index: usize,
    pub prompt_index: usize,
    pub text: String,
    pub tokens: Vec<TokenOut>,
    /// `echo` with `logprobs`: the prompt's logprobs (from its second token).
    pub prompt_logprobs: Vec<PromptLogprob>,
    pub reason: FinishReason,
    pub usage: Usage,
    /// An embedding request's vector.
    pub embedding: Option<Vec<f32>>,
    /// When its first token came (llama-server's `timings`).
    pub first: Option<Instant>,
}

impl Choice {
    pub async fn collect(mut self) -> Collected {
        let mut c = Collected {
            index: self.index,
            prompt_index: self.prompt_index,
            text: String::new(),
            tokens: vec![],
            prompt_logprobs: vec![],
            reason: FinishReason::Error("the engine stopped".into()),
            usage: Usage::default(),
            embedding: None,
            first: None,
        };
        while let Some(e) = self.next().await {
            match e {
                Event::Token { id, text, logprob, top } => {
                    c.first.get_or_insert_with(Instant::now);
                    c.text.push_str(&text);
                    c.tokens.push(TokenOut { id, logprob, top });
                }
                Event::PromptLogprobs(lps) => c.prompt_logprobs.extend(lps),
                Event::Embedding(v) => c.embedding = Some(v),
                Event::Progress { .. } => {}
                Event::Done { text, reason, usage } => {
                    c.text.push_str(&text);
                    c.reason = reason;
                    c.usage = usage;
                    break;
                }
            }
        }
        c
    }
}

/// Usage over all choices: each prompt counted once (its first choice's count and cache
/// hits), completions summed. `per_choice` is (prompt index, usage) in choice order.
pub(crate) fn total_usage(per_choice: &[(usize, Usage)]) -> serde_json::Value {
    let mut seen = std::collections::BTreeSet::new();
    let (mut prompt, mut cached, mut completion) = (0, 0, 0);
    for (p, u) in per_choice {
        if seen.insert(*p) {
            prompt += u.prompt_tokens;
            cached += u.cached_tokens;
        }
        completion += u.completion_tokens;
    }
    serde_json::json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}
