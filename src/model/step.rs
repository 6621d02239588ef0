//! One step's work as the executor receives it (`StepInput`), the budget every step keeps
//! within (`StepLimits`), what a stage returns (`StageOutput`), and the split of a step into
//! sub-steps that fit the scratch.

use crate::config::{KernelProfile, KvDtype};
use crate::sampling::row::*;

/// Sizes of the per-step scratch, fixed at start-up.
#[derive(Clone, Copy, Debug)]
pub struct StepLimits {
    /// Most tokens (rows) in one step.
    pub max_tokens: usize,
    /// Most sequences (and sampled rows) in one step.
    pub max_seqs: usize,
    /// Longest sequence, in tokens (sizes block tables and the RoPE table).
    pub max_seq_len: usize,
    pub block_size: usize,
    /// KV-cache bytes across all layers.
    pub cache_bytes: u64,
    /// Cap on one storage binding (tests lower it to exercise chunking); 0 = the device's.
    pub max_binding: u64,
    /// Element type of the KV cache.
    pub kv_dtype: KvDtype,
    /// Kernel shapes; `Model::new_stage` resolves `auto` for its adapter.
    pub profile: KernelProfile,
    /// The model's sliding attention window (set from the model by `Model::new_stage` and
    /// `exec::step_limits`): blocks that left it can be freed.
    pub sliding_window: Option<usize>,
}

/// One step's work: tokens (with position, KV slot and sequence index), the sequences' block
/// tables, and which token rows get logits and a sampled token.
#[derive(Clone, Debug, Default)]
pub struct StepInput {
    pub tokens: Vec<u32>,
    pub positions: Vec<u32>,
    pub slots: Vec<u32>,
    pub seq_of_token: Vec<u32>,
    pub block_tables: Vec<Vec<u32>>,
    pub sample_rows: Vec<u32>,
    pub sampling: Vec<SampleParams>,
    /// Each sequence's recurrent-state slot (models with recurrent layers; empty: sequence i
    /// uses slot i), with a backup slot where it verifies proposals (`pack_state_slot`).
    pub state_slots: Vec<u32>,
}

/// A sequence's state slot word: the slot in the low 16 bits; with `backup`, that slot (+ 1) in
/// the high 16 bits: the step first copies the sequence's state there (the state before its
/// tokens, kept for when proposals it verifies are rejected).
pub fn pack_state_slot(slot: u32, backup: Option<u32>) -> u32 {
    slot | backup.map_or(0, |b| (b + 1) << 16)
}

/// A state slot word's (slot, backup).
pub fn unpack_state_slot(w: u32) -> (u32, Option<u32>) {
    (w & 0xffff, (w >> 16).checked_sub(1))
}

/// What one step of a stage returns: hidden states for the next stage ([tokens, hidden] f32,
/// little-endian bytes), or, on the last stage, the sampled tokens.
#[derive(Clone, Debug, PartialEq)]
pub enum StageOutput {
    Hidden(Vec<u8>),
    Sampled(Vec<Sampled>),
}

/// Splits a step of `n` tokens into consecutive token ranges of at most `max_tokens` tokens
/// and `max_sampled` of the `sample_rows`.
pub fn sub_steps(sample_rows: &[u32], n: usize, max_tokens: usize, max_sampled: usize) -> Vec<(usize, usize)> {
    let mut per_token = vec![0usize; n];
    for &r in sample_rows {
        if let Some(c) = per_token.get_mut(r as usize) {
            *c += 1;
        }
    }
    let mut out = Vec::new();
    let (mut a, mut sampled) = (0, 0);
    for (i, &c) in per_token.iter().enumerate() {
        if i > a && (i - a == max_tokens || sampled + c > max_sampled) {
            out.push((a, i));
            (a, sampled) = (i, 0);
        }
        sampled += c;
    }
    out.push((a, n));
    out
}
