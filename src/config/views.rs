//! Typed views of `EngineConfig`: each budget the engine and its executors size themselves by,
//! derived here once from the seed's keys.

use super::{EngineConfig, KernelProfile, KvDtype};

/// What one step may hold; every stage is built for it (the model may lower `max_seq_len` to
/// its positions, a device `max_seqs` to what its scratch holds).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepBudget {
    /// Tokens (rows) in one step: `max_num_batched_tokens`.
    pub max_tokens: usize,
    /// Sequences (and sampled rows) in one step: decodes plus prefills, at most one per token.
    pub max_seqs: usize,
    /// `max_sequence_length`.
    pub max_seq_len: usize,
    pub block_size: usize,
    /// KV-cache bytes across all layers (`total_cache_size`).
    pub cache_bytes: u64,
    pub kv_dtype: KvDtype,
    pub profile: KernelProfile,
}

/// The scheduler's caps on one step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchBudget {
    pub max_num_batched_tokens: usize,
    pub max_decode_batch_size: usize,
    pub max_prefill_batch_size: usize,
}

impl EngineConfig {
    pub fn step_budget(&self) -> StepBudget {
        StepBudget {
            max_tokens: self.max_num_batched_tokens,
            max_seqs: (self.max_decode_batch_size + self.max_prefill_batch_size)
                .min(self.max_num_batched_tokens)
                .max(1),
            max_seq_len: self.max_sequence_length,
            block_size: self.block_size,
            cache_bytes: self.total_cache_size,
            kv_dtype: self.kv_cache_dtype,
            profile: self.kernel_profile,
        }
    }

    /// The scheduler's caps, within a step of at most `max_tokens` tokens (the executor's).
    pub fn batch_budget(&self, max_tokens: usize) -> BatchBudget {
        BatchBudget {
            max_num_batched_tokens: self.max_num_batched_tokens.min(max_tokens),
            max_decode_batch_size: self.max_decode_batch_size,
            max_prefill_batch_size: self.max_prefill_batch_size,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_follow_the_keys() {
        let c = EngineConfig {
            max_num_batched_tokens: 6,
            max_decode_batch_size: 4,
            max_prefill_batch_size: 4,
            ..Default::default()
        };
        let s = c.step_budget();
        assert_eq!((s.max_tokens, s.max_seqs), (6, 6), "at most one sequence per token");
        assert_eq!(c.batch_budget(4).max_num_batched_tokens, 4);
        assert_eq!(c.batch_budget(100).max_num_batched_tokens, 6);
    }
}
