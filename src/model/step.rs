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
    /// gpu profile: one-token matmuls on int8 activations (Some(true)) or f32 (Some(false));
    /// None: as `ops::kernels::int8_wanted` decides (TORUS_INT8, the tuner, the adapter).
    pub int8: Option<bool>,
}

/// One step's work: tokens (with position, KV slot and sequence index), the sequences' block
/// tables, and which token rows get logits and a sampled token.
#[derive(Clone, Default)]
pub struct StepInput {
    pub tokens: Vec<u32>,
    pub positions: Vec<u32>,
    pub slots: Vec<u32>,
    pub seq_of_token: Vec<u32>,
    pub block_tables: Vec<Vec<u32>>,
    pub sample_rows: Vec<u32>,
    pub sampling: Vec<SampleParams>,
    /// Each sequence's recurrent-state slots (models with recurrent layers), STATE_WORDS words
    /// each (`SeqState`); empty: sequence i uses slot i and nothing else.
    pub state_slots: Vec<u32>,
}

/// Debug output names `state_slots` only where a step has them (recorded traces of models
/// without recurrent layers stay as they were).
impl std::fmt::Debug for StepInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("StepInput");
        d.field("tokens", &self.tokens)
            .field("positions", &self.positions)
            .field("slots", &self.slots)
            .field("seq_of_token", &self.seq_of_token)
            .field("block_tables", &self.block_tables)
            .field("sample_rows", &self.sample_rows)
            .field("sampling", &self.sampling);
        if !self.state_slots.is_empty() {
            d.field("state_slots", &self.state_slots);
        }
        d.finish()
    }
}

/// Words of one sequence's entry in `StepInput::state_slots`.
pub const STATE_WORDS: usize = 3;

/// One sequence's recurrent-state slots in a step: its own; a slot its state is read from
/// instead (a prefix-cache snapshot, at its first step); a backup the step first copies its
/// state to (speculative decoding: the state to go back to when proposals are rejected); a
/// snapshot slot the state after its token `at` (counted from its first token in the step) is
/// copied to (the prefix cache). Slots are below 65535.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SeqState {
    pub slot: u32,
    pub src: Option<u32>,
    pub backup: Option<u32>,
    pub snapshot: Option<(u32, u32)>,
}

impl SeqState {
    pub fn encode(&self) -> [u32; STATE_WORDS] {
        let (snap, at) = self.snapshot.map_or((0, 0), |(s, at)| (s + 1, at));
        let hi = |x: Option<u32>| x.map_or(0, |b| (b + 1) << 16);
        [self.slot | hi(self.backup), snap | hi(self.src), at]
    }

    pub fn decode(w: &[u32]) -> SeqState {
        let word = |i: usize| w.get(i).copied().unwrap_or(0);
        SeqState {
            slot: word(0) & 0xffff,
            src: (word(1) >> 16).checked_sub(1),
            backup: (word(0) >> 16).checked_sub(1),
            snapshot: (word(1) & 0xffff).checked_sub(1).map(|s| (s, word(2))),
        }
    }

    /// Each sequence's entry of `state_slots` (sequence j: slot j where the step names none),
    /// decoded as it is read (no per-step allocation).
    pub fn all(s: &StepInput) -> impl Iterator<Item = SeqState> + '_ {
        (0..s.block_tables.len()).map(move |j| match s.state_slots.is_empty() {
            true => SeqState { slot: j as u32, ..Default::default() },
            false => SeqState::decode(s.state_slots.get(j * STATE_WORDS..).unwrap_or(&[])),
        })
    }
}

/// The state slots of the sub-step of `s` holding its tokens `a..b` (sub-steps run in token
/// order): a sequence whose earlier tokens ran in an earlier sub-step goes on from its own slot
/// (its source was read and its backup taken there), and a snapshot is taken in the sub-step that
/// holds its token, counted from the sequence's first token in that sub-step.
pub fn sub_step_states(s: &StepInput, (a, b): (usize, usize)) -> Vec<u32> {
    if s.state_slots.is_empty() {
        return Vec::new();
    }
    let n = s.block_tables.len();
    let (mut before, mut within) = (vec![0u32; n], vec![0u32; n]);
    for (i, &seq) in s.seq_of_token.iter().enumerate().take(b) {
        let c = if i < a { &mut before } else { &mut within };
        if let Some(c) = c.get_mut(seq as usize) {
            *c += 1;
        }
    }
    SeqState::all(s)
        .zip(before.iter().zip(&within))
        .flat_map(|(mut st, (&done, &count))| {
            if done > 0 {
                st.src = None;
                st.backup = None;
            }
            st.snapshot =
                st.snapshot.and_then(|(slot, at)| (at >= done && at < done + count).then(|| (slot, at - done)));
            st.encode()
        })
        .collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sub_step_reads_the_source_once_and_takes_the_snapshot_where_its_token_is() {
        // Sequence 0: tokens 0..5 (source slot 7, backup 8, snapshot into 9 after its token 3);
        // sequence 1: tokens 5..7 (snapshot into 6 after its token 0). Sub-steps of 3 tokens.
        let st = [
            SeqState { slot: 1, src: Some(7), backup: Some(8), snapshot: Some((9, 3)) },
            SeqState { slot: 2, src: None, backup: None, snapshot: Some((6, 0)) },
        ];
        let s = StepInput {
            tokens: vec![0; 7],
            seq_of_token: vec![0, 0, 0, 0, 0, 1, 1],
            block_tables: vec![vec![0], vec![1]],
            state_slots: st.iter().flat_map(|s| s.encode()).collect(),
            ..Default::default()
        };
        let decode = |w: Vec<u32>| -> Vec<SeqState> { w.chunks(STATE_WORDS).map(SeqState::decode).collect() };
        assert_eq!(sub_steps(&[], 7, 3, 1), [(0, 3), (3, 6), (6, 7)]);
        // First: sequence 0's first three tokens, from its source, backed up; no snapshot yet.
        let first = decode(sub_step_states(&s, (0, 3)));
        assert_eq!(first[0], SeqState { snapshot: None, ..st[0] });
        assert_eq!(first[1], SeqState { snapshot: None, ..st[1] });
        // Second: sequence 0 goes on from its own slot, snapshot after its first token here;
        // sequence 1 starts, its snapshot after its first.
        let second = decode(sub_step_states(&s, (3, 6)));
        assert_eq!(second[0], SeqState { slot: 1, src: None, backup: None, snapshot: Some((9, 0)) });
        assert_eq!(second[1], st[1]);
        // Third: sequence 0 has no tokens; sequence 1 goes on, its snapshot behind it.
        let third = decode(sub_step_states(&s, (6, 7)));
        assert_eq!(third[1], SeqState { slot: 2, src: None, backup: None, snapshot: None });
        assert!(sub_step_states(&StepInput { state_slots: vec![], ..s }, (0, 3)).is_empty());
    }
}
