//! A sequence's state in the engine: its tokens, KV blocks and prefix keys, its sampling
//! parameters and logit adjustments, its streaming state (detokenizer, held-back text), and
//! the rows it adds to a step.

use crate::engine::penalties::Penalties;
use crate::engine::request::{Event, Request, RequestParams, Usage};
use crate::kv::root_key;
use crate::kv::{BlockId, BlockKey};
use crate::sampling::Rng;
use crate::sampling::SampleParams;
use crate::spec::AdaptiveK;
use crate::tokenizer::IncrementalDecoder;
use tokio::sync::mpsc::UnboundedSender;

pub(crate) struct Seq {
    pub(crate) id: u64,
    /// Prompt then generated tokens.
    pub(crate) tokens: Vec<u32>,
    pub(crate) prompt_len: usize,
    /// Tokens whose K/V are in the cache.
    pub(crate) computed: usize,
    /// Tokens submitted in steps (>= computed): later prompt chunks may be submitted while
    /// earlier ones are still in the pipeline, as each stage runs its steps in order.
    pub(crate) scheduled: usize,
    pub(crate) table: Vec<BlockId>,
    /// Its recurrent-state slot while running (hybrid models).
    pub(crate) state_slot: Option<u32>,
    /// While it verifies proposals (hybrid models): the slot holding its state from before them.
    pub(crate) backup_slot: Option<u32>,
    /// Leading table entries already released because they left the sliding window (their
    /// ids stay as placeholders; attention never reads them).
    pub(crate) released: usize,
    /// Prefix-cache keys of the table's full blocks, in order.
    pub(crate) keys: Vec<BlockKey>,
    /// The parent key of the first block: one per cache salt.
    pub(crate) root: BlockKey,
    pub(crate) params: RequestParams,
    pub(crate) max_tokens: usize,
    pub(crate) rng: Rng,
    pub(crate) out: UnboundedSender<Event>,
    pub(crate) detok: IncrementalDecoder,
    /// Released-by-the-detokenizer text held back because it may start a stop string.
    pub(crate) pending: String,
    /// Logit adjustments (penalties, logit_bias), kept up to date as tokens are generated.
    pub(crate) penalties: Penalties,
    pub(crate) cached_tokens: Option<usize>,
    /// Structured outputs: why the grammar could not give a mask (the sequence then fails).
    pub(crate) constraint_error: Option<String>,
    /// Structured outputs after a reasoning span (`RequestParams::constraint_after`): the last
    /// output text while the span's end is awaited (None once it is seen, or without one).
    pub(crate) thinking: Option<String>,
    /// Prompt log-probabilities delivered so far (of tokens 1..=lp_done).
    pub(crate) lp_done: usize,
    /// Steps in which a request behind it started while it waited (see `schedule`).
    pub(crate) passed_over: u32,
    /// Speculative decoding: how many tokens it proposes next.
    pub(crate) spec_k: AdaptiveK,
    /// Positions whose K/V the draft model's cache holds (engine/draft.rs).
    pub(crate) draft_computed: usize,
    /// The MTP head's input not yet read: the model's hidden states (final-normed) of positions
    /// `mtp_from..`, one row each (engine/mtp.rs).
    pub(crate) mtp_rows: Vec<f32>,
    pub(crate) mtp_from: usize,
    /// Which stop string ended it (an index into its `stop` list).
    pub(crate) stopped_by: Option<usize>,
    /// An embedding request's pooled hidden states so far (engine/embed.rs).
    pub(crate) embed: Option<crate::engine::embed::Pooled>,
}

impl Seq {
    /// A new request's sequence, waiting: nothing computed, no blocks.
    pub(crate) fn new(id: u64, req: Request, out: UnboundedSender<Event>, max_seq_len: usize) -> Seq {
        let prompt_len = req.prompt.len();
        let max_tokens = req.params.stop.max_tokens.unwrap_or(max_seq_len - prompt_len);
        let seed = req.params.sampling.seed;
        let skip_special = req.params.skip_special_tokens;
        let p = &req.params;
        let repetition = p.repetition_penalty != 1.0;
        let counting = repetition || p.frequency_penalty != 0.0 || p.presence_penalty != 0.0;
        let penalties = Penalties::new(&req.prompt, repetition, counting, &p.logit_bias);
        let req_constraint_waits = p.constraint.is_some() && p.constraint_after.is_some();
        let pooling = p.pooling;
        Seq {
            id,
            tokens: req.prompt,
            prompt_len,
            computed: 0,
            scheduled: 0,
            table: vec![],
            state_slot: None,
            backup_slot: None,
            released: 0,
            keys: vec![],
            root: root_key(req.params.cache_salt.as_deref()),
            params: req.params,
            max_tokens,
            rng: seed.map(Rng::new).unwrap_or_else(Rng::from_entropy),
            out,
            detok: IncrementalDecoder::new(skip_special),
            pending: String::new(),
            penalties,
            cached_tokens: None,
            constraint_error: None,
            thinking: (req_constraint_waits).then(String::new),
            lp_done: 0,
            passed_over: 0,
            spec_k: AdaptiveK::new(crate::config::MAX_SPECULATIVE_TOKENS),
            draft_computed: 0,
            mtp_rows: Vec::new(),
            mtp_from: 0,
            stopped_by: None,
            embed: pooling.map(crate::engine::embed::Pooled::new),
        }
    }

    /// Whether it may speculate: proposals are verified row by row with the sampler's own
    /// parameters and, under a grammar, the grammar's state after the proposals before each
    /// row (`draft_masks`); not while a grammar waits for the end of a reasoning span (where it
    /// starts depends on the text).
    pub(crate) fn may_speculate(&self) -> bool {
        self.params.constraint.is_none() || (self.thinking.is_none() && self.constraint_error.is_none())
    }

    /// Under a grammar: the masks of the rows that verify `draft` (row i: the grammar after
    /// draft[..i], on a copy of its state), with `draft` cut before the first proposal the
    /// grammar refuses (it could never be sampled) or after which it is complete. None without
    /// a grammar; an empty draft when the grammar fails (the next row reports it).
    pub(crate) fn draft_masks(&mut self, draft: &mut Vec<u32>, words: usize) -> Option<Vec<Vec<u32>>> {
        let live = self.params.constraint.as_mut()?;
        let first = match live.mask(words) {
            Ok(m) => m,
            Err(_) => {
                draft.clear();
                return None;
            }
        };
        let mut c = live.clone();
        let mut masks = vec![first];
        for i in 0..draft.len() {
            let t = draft[i] as usize;
            let allowed = masks[i].get(t / 32).is_some_and(|w| (w >> (t % 32)) & 1 == 1);
            let next = match allowed && c.accept(draft[i]).is_ok() && !c.is_stopped() {
                true => c.mask(words).ok(),
                false => None,
            };
            match next {
                Some(m) => masks.push(m),
                None => {
                    draft.truncate(i);
                    break;
                }
            }
        }
        masks.truncate(draft.len() + 1);
        Some(masks)
    }

    /// The sample rows of a decode step that verifies `draft`: row i samples the token after
    /// draft[..i], with the penalties counting draft[..i] and the i-th uniform after the
    /// sequence's (the same the token at that place would get without speculation). The
    /// sequence's generator is not advanced (see `output`).
    pub(crate) fn verify_params(&self, draft: &[u32], masks: Option<&[Vec<u32>]>) -> Vec<SampleParams> {
        let p = &self.params;
        let mut rng = self.rng.clone();
        let mut penalties = self.penalties.clone();
        (0..=draft.len())
            .map(|i| {
                if i > 0 {
                    penalties.push(draft[i - 1]);
                }
                SampleParams {
                    temperature: p.sampling.temperature,
                    top_p: p.sampling.top_p,
                    top_k: p.sampling.top_k,
                    min_p: p.sampling.min_p,
                    u: rng.uniform(),
                    repetition_penalty: p.repetition_penalty,
                    frequency_penalty: p.frequency_penalty,
                    presence_penalty: p.presence_penalty,
                    n_top: p.logprobs.unwrap_or(0),
                    adjust: penalties.list().to_vec(),
                    mask: masks.and_then(|m| m.get(i)).cloned(),
                    force: None,
                }
            })
            .collect()
    }

    pub(crate) fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Whether position `pos` (in a chunk being scheduled) gets a prompt-logprob row: its
    /// logits predict prompt token `pos + 1`, not yet delivered.
    pub(crate) fn wants_prompt_row(&self, pos: usize) -> bool {
        self.params.prompt_logprobs.is_some() && pos >= self.lp_done && pos + 1 < self.prompt_len
    }

    /// Prompt positions from which prompt-logprob rows are still needed (`prompt_len` if none).
    pub(crate) fn prompt_rows_from(&self) -> usize {
        match self.params.prompt_logprobs {
            Some(_) if self.lp_done + 1 < self.prompt_len => self.lp_done,
            _ => self.prompt_len,
        }
    }

    /// Sample rows the chunk `start..start + len` adds to a step (prompt-logprob rows and the
    /// row that samples the next token).
    pub(crate) fn rows_in(&self, start: usize, len: usize) -> usize {
        let from = self.prompt_rows_from().max(start);
        let forced = (start + len).min(self.prompt_len.saturating_sub(1)).saturating_sub(from);
        forced + usize::from(start + len == self.tokens.len())
    }

    /// The longest chunk from `start` (at most `len`) whose rows fit in `room`.
    pub(crate) fn chunk_within_rows(&self, start: usize, len: usize, room: usize) -> usize {
        if self.rows_in(start, len) <= room {
            return len;
        }
        // Rows grow by at most one per token: shrink until they fit (at least one token, whose
        // row count is at most 1 <= room).
        let mut l = len.min(room.max(1));
        while l > 1 && self.rows_in(start, l) > room {
            l -= 1;
        }
        l
    }

    pub(crate) fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt_len,
            completion_tokens: self.generated(),
            cached_tokens: self.cached_tokens.unwrap_or(0),
            stop_string: self.stopped_by,
        }
    }

    /// This row's sampling parameters; `mask_words`: the model vocabulary's mask length.
    pub(crate) fn sample_params(&mut self, mask_words: usize) -> SampleParams {
        // Structured outputs: the grammar's allowed tokens (computed here, while no step of
        // this sequence is in flight; see BENCHMARKS.md for its cost).
        let mask = match self.params.constraint.as_mut() {
            Some(c) if self.constraint_error.is_none() && self.thinking.is_none() => match c.mask(mask_words) {
                Ok(m) => Some(m),
                Err(e) => {
                    self.constraint_error = Some(e);
                    None
                }
            },
            _ => None,
        };
        let p = &self.params;
        SampleParams {
            temperature: p.sampling.temperature,
            top_p: p.sampling.top_p,
            top_k: p.sampling.top_k,
            min_p: p.sampling.min_p,
            u: self.rng.uniform(),
            repetition_penalty: p.repetition_penalty,
            frequency_penalty: p.frequency_penalty,
            presence_penalty: p.presence_penalty,
            n_top: p.logprobs.unwrap_or(0),
            adjust: self.penalties.list().to_vec(),
            mask,
            force: None,
        }
    }
}
