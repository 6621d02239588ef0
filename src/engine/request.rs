//! What callers submit to the engine and what they get back.

use crate::sampling::SamplingParams;
use crate::structured::Constraint;

/// When a request stops.
#[derive(Clone, Debug, Default)]
pub struct StopConditions {
    /// Most tokens to generate (None: up to max_sequence_length).
    pub max_tokens: Option<usize>,
    /// Extra token ids that end the request (their text is not emitted).
    pub stop_token_ids: Vec<u32>,
    /// Strings that end the request, matched on the detokenized text even across token
    /// boundaries; the matched text is not emitted.
    pub stop: Vec<String>,
    /// Keep going past the model's end-of-sequence ids.
    pub ignore_eos: bool,
}

/// Everything about how one request samples and stops.
#[derive(Clone, Debug)]
pub struct RequestParams {
    pub sampling: SamplingParams,
    pub repetition_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    /// (token id, bias added to its logit).
    pub logit_bias: Vec<(u32, f32)>,
    /// Some(n): return the chosen token's logprob and the n most likely alternatives (n <= 20).
    pub logprobs: Option<u32>,
    /// Some(n): also return each prompt token's logprob (all but the first, which nothing
    /// predicts) and the n most likely alternatives at its position, as
    /// [`Event::PromptLogprobs`] before the first token (vLLM's `prompt_logprobs`). Such a
    /// request does not reuse cached prefix blocks for the positions it still needs.
    pub prompt_logprobs: Option<u32>,
    pub stop: StopConditions,
    /// Prefix-cache salt (vLLM's `cache_salt`): requests share cached blocks only with requests
    /// of the same salt (None: the shared cache).
    pub cache_salt: Option<String>,
    /// Leave special tokens out of the text (vLLM's `skip_special_tokens`; default true). Tool
    /// calling turns it off: some models' `<tool_call>` tags are special tokens.
    pub skip_special_tokens: bool,
    /// Structured outputs: every sampled token keeps the output inside this grammar, and the
    /// request stops when the grammar is complete (see [`crate::structured`]).
    pub constraint: Option<Constraint>,
    /// Structured outputs of a reasoning model: the grammar starts after the output holds this
    /// text (the end of its thinking, `</think>`), so it constrains the answer only.
    pub constraint_after: Option<String>,
    /// An embedding request: the prompt's last hidden states are pooled this way into one
    /// L2-normalised vector, sent as [`Event::Embedding`] once the prompt is computed; then the
    /// request ends without generating. Needs embeddings enabled
    /// ([`EngineHandle::enable_embeddings`](crate::engine::EngineHandle::enable_embeddings)).
    pub pooling: Option<Pooling>,
    /// Send [`Event::Progress`] after each step that computes part of the prompt (llama-server's
    /// `return_progress`; also how the server learns the cached prefix before the end).
    pub progress: bool,
}

/// How an embedding request's hidden states (after the model's final norm) become one vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pooling {
    /// The last token's (Qwen3-Embedding and other decoder embedding models).
    Last,
    /// The mean over every token.
    Mean,
    /// The first token's.
    Cls,
}

impl Pooling {
    pub fn parse(s: &str) -> Result<Pooling, String> {
        match s {
            "last" => Ok(Pooling::Last),
            "mean" => Ok(Pooling::Mean),
            "cls" | "first" => Ok(Pooling::Cls),
            o => Err(format!("unknown pooling '{o}' (last, mean or cls)")),
        }
    }

    /// The name that parses back to this pooling.
    pub fn name(self) -> &'static str {
        match self {
            Pooling::Last => "last",
            Pooling::Mean => "mean",
            Pooling::Cls => "cls",
        }
    }
}

impl Default for RequestParams {
    fn default() -> Self {
        RequestParams {
            sampling: SamplingParams::default(),
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            logit_bias: vec![],
            logprobs: None,
            prompt_logprobs: None,
            stop: StopConditions::default(),
            cache_salt: None,
            skip_special_tokens: true,
            constraint: None,
            constraint_after: None,
            pooling: None,
            progress: false,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub params: RequestParams,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence id, stop token or stop string.
    Stop,
    /// max_tokens or the context length was reached.
    Length,
    /// Aborted by the caller.
    Abort,
    /// The engine failed this request (the message says why).
    Error(String),
}

impl FinishReason {
    /// OpenAI's finish_reason string.
    pub fn as_openai(&self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Error(_) => "error",
        }
    }
}

#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache at admission.
    pub cached_tokens: usize,
    /// Which of the request's stop strings ended it (an index into `stop`), if one did.
    pub stop_string: Option<usize>,
}

/// Debug output names `stop_string` only when a stop string ended the request (recorded traces
/// of requests without one stay as they were).
impl std::fmt::Debug for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("Usage");
        d.field("prompt_tokens", &self.prompt_tokens)
            .field("completion_tokens", &self.completion_tokens)
            .field("cached_tokens", &self.cached_tokens);
        if let Some(i) = self.stop_string {
            d.field("stop_string", &i);
        }
        d.finish()
    }
}

/// One prompt token's log-probability given the tokens before it, and the most likely tokens
/// at its position.
#[derive(Clone, Debug, PartialEq)]
pub struct PromptLogprob {
    pub id: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// What a request's stream yields.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// A generated token and the text it released (possibly empty while text is held back for
    /// an incomplete UTF-8 character or a possible stop string).
    Token { id: u32, text: String, logprob: f32, top: Vec<(u32, f32)> },
    /// Log-probabilities of prompt tokens (`prompt_logprobs`), in prompt order starting with the
    /// second token; they may come in several events, all before the first `Token`.
    PromptLogprobs(Vec<PromptLogprob>),
    /// Prefill progress (`RequestParams::progress`): of the prompt's `total` tokens,
    /// `processed` have their K/V in the cache, `cached` of them found in the prefix cache.
    Progress { processed: usize, cached: usize, total: usize },
    /// An embedding request's vector (L2-normalised), just before its `Done`.
    Embedding(Vec<f32>),
    /// The end: any remaining text, why, and the token counts.
    Done { text: String, reason: FinishReason, usage: Usage },
}
