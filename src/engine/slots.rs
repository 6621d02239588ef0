//! What each sequence the engine holds is doing, for llama-server's `GET /slots`: counts and
//! sampling settings only, never a request's text or tokens (one client must not read what
//! another asked or was answered).

use super::sequence::Seq;

/// One sequence's state at the moment the engine was asked.
#[derive(Clone, Debug, PartialEq)]
pub struct SlotState {
    /// The sequence's engine id.
    pub id: u64,
    /// Admitted and being computed (false: waiting for room).
    pub running: bool,
    pub prompt_tokens: usize,
    /// Prompt tokens whose K/V are in the cache (prefill progress).
    pub prompt_processed: usize,
    /// Prompt tokens found in the prefix cache.
    pub cached_tokens: usize,
    /// Tokens generated so far.
    pub decoded: usize,
    pub max_tokens: usize,
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    pub seed: Option<u64>,
}

impl SlotState {
    pub(crate) fn of(s: &Seq, running: bool) -> SlotState {
        let p = &s.params.sampling;
        SlotState {
            id: s.id,
            running,
            prompt_tokens: s.prompt_len,
            prompt_processed: s.computed.min(s.prompt_len),
            cached_tokens: s.cached_tokens.unwrap_or(0),
            decoded: s.tokens.len().saturating_sub(s.prompt_len),
            max_tokens: s.max_tokens,
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            min_p: p.min_p,
            seed: p.seed,
        }
    }
}
