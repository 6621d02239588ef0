//! The step validator: what one step may hold on a model (or stage), checked before anything
//! is written (a worker checks every step it receives).

use crate::model::step::*;
use anyhow::{bail, Result};

/// What one step may hold on a model (or stage): its step budget and its own KV cache. A step
/// that passes `check` writes K/V only into the blocks its own sequences' tables name, and
/// reads and writes no buffer out of bounds; the engine's steps always pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepBounds {
    pub max_tokens: usize,
    pub max_seqs: usize,
    pub max_seq_len: usize,
    pub block_size: usize,
    /// Blocks of the KV cache.
    pub num_blocks: usize,
    /// Longest block table.
    pub max_blocks: usize,
    /// Most logit adjustments in one step.
    pub adjust_cap: usize,
    pub vocab: usize,
    pub hidden: usize,
    /// The first stage takes token ids; every other stage hidden states.
    pub first: bool,
    /// Recurrent-state slots (0: the model has no recurrent layers).
    pub state_slots: usize,
}

impl StepBounds {
    /// Checks every count, index and length of a step (and the byte length of the hidden
    /// states entering it, when given) against these bounds.
    pub fn check(&self, s: &StepInput, hidden_bytes: Option<usize>) -> Result<()> {
        let n = s.tokens.len();
        if n == 0 || n > self.max_tokens {
            bail!("step has {n} tokens (1..={} allowed)", self.max_tokens);
        }
        if s.positions.len() != n || s.slots.len() != n || s.seq_of_token.len() != n {
            bail!(
                "step metadata lengths disagree with its {n} tokens ({} positions, {} slots, {} sequence indices)",
                s.positions.len(),
                s.slots.len(),
                s.seq_of_token.len()
            );
        }
        if s.sample_rows.len() != s.sampling.len() || s.sample_rows.len() > self.max_seqs {
            bail!(
                "step samples {} rows with {} parameter sets ({} allowed)",
                s.sample_rows.len(),
                s.sampling.len(),
                self.max_seqs
            );
        }
        if s.block_tables.is_empty() || s.block_tables.len() > self.max_seqs {
            bail!("step has {} sequences (1..={} allowed)", s.block_tables.len(), self.max_seqs);
        }
        for (j, t) in s.block_tables.iter().enumerate() {
            if t.len() > self.max_blocks {
                bail!("sequence {j}: block table of {} blocks (at most {})", t.len(), self.max_blocks);
            }
            if let Some(b) = t.iter().find(|&&b| b as usize >= self.num_blocks) {
                bail!("sequence {j}: block {b} is outside the KV cache ({} blocks)", self.num_blocks);
            }
        }
        if self.state_slots > 0 {
            let seqs = s.block_tables.len();
            if !s.state_slots.is_empty() && s.state_slots.len() != seqs * STATE_WORDS {
                bail!("step has {} state-slot words for {seqs} sequences ({STATE_WORDS} each)", s.state_slots.len());
            }
            if s.state_slots.is_empty() && seqs > self.state_slots {
                bail!("step has {seqs} sequences and names no state slots ({} exist)", self.state_slots);
            }
            let mut seen = vec![false; self.state_slots];
            let mut tokens = vec![0usize; seqs];
            for &q in &s.seq_of_token {
                if let Some(t) = tokens.get_mut(q as usize) {
                    *t += 1;
                }
            }
            for (j, st) in SeqState::all(s).enumerate() {
                if st.snapshot.is_some_and(|(_, at)| at as usize >= tokens[j]) {
                    bail!("sequence {j}: a state snapshot after token {:?} of its {}", st.snapshot, tokens[j]);
                }
                // A snapshot read from may serve several sequences; it is none of their own.
                if st.src.is_some_and(|x| x as usize >= self.state_slots) {
                    bail!("sequence {j}: state read from slot {:?}, outside the {} slots", st.src, self.state_slots);
                }
                for slot in [Some(st.slot), st.backup, st.snapshot.map(|x| x.0)].into_iter().flatten() {
                    match seen.get_mut(slot as usize) {
                        None => bail!("state slot {slot} is outside the {} slots", self.state_slots),
                        Some(true) => bail!("state slot {slot} is used twice in one step"),
                        Some(x) => *x = true,
                    }
                }
            }
        }
        let bs = self.block_size;
        let mut prev_seq = 0;
        for i in 0..n {
            let seq = s.seq_of_token[i] as usize;
            let pos = s.positions[i] as usize;
            if seq >= s.block_tables.len() {
                bail!("token {i}: sequence {seq} of a step with {} sequences", s.block_tables.len());
            }
            // The engine lists each sequence's tokens together, in sequence order.
            if seq < prev_seq {
                bail!("token {i}: sequence {seq} after sequence {prev_seq} (sequence indices must not decrease)");
            }
            prev_seq = seq;
            if pos >= self.max_seq_len {
                bail!("token {i}: position {pos} is beyond max_sequence_length {}", self.max_seq_len);
            }
            let table = &s.block_tables[seq];
            let Some(&block) = table.get(pos / bs) else {
                bail!(
                    "token {i}: position {pos} of sequence {seq} is outside its block table ({} blocks)",
                    table.len()
                );
            };
            // A token's K/V go where its own sequence's table puts its position, nowhere else.
            let want = block as u64 * bs as u64 + (pos % bs) as u64;
            if s.slots[i] as u64 != want {
                bail!(
                    "token {i}: slot {} is not position {pos}'s slot {want} in sequence {seq}'s block table",
                    s.slots[i]
                );
            }
            if self.first && s.tokens[i] as usize >= self.vocab {
                bail!("token id {} is outside the vocabulary ({})", s.tokens[i], self.vocab);
            }
        }
        if let Some(r) = s.sample_rows.iter().find(|&&r| r as usize >= n) {
            bail!("sample row {r} of a step with {n} tokens");
        }
        let adj: usize = s.sampling.iter().map(|p| p.adjust_entries()).sum();
        if adj > self.adjust_cap {
            bail!("{adj} logit adjustment entries (at most {})", self.adjust_cap);
        }
        for p in &s.sampling {
            if let Some(m) = &p.mask {
                let words = self.vocab.div_ceil(32);
                if m.len() != words {
                    bail!("a token mask of {} words (the vocabulary of {} takes {words})", m.len(), self.vocab);
                }
                // The sampler must have a token to pick: bits past the vocabulary do not count.
                let tail = if self.vocab.is_multiple_of(32) { u32::MAX } else { (1u32 << (self.vocab % 32)) - 1 };
                if m[..words - 1].iter().all(|&w| w == 0) && m[words - 1] & tail == 0 {
                    bail!("a token mask that allows no token");
                }
            }
            if let Some(a) = p.adjust.iter().find(|a| a.id as usize >= self.vocab || a.bias.is_nan()) {
                bail!("logit adjustment of token {} (bias {}) is out of range", a.id, a.bias);
            }
            let floats =
                [p.temperature, p.top_p, p.min_p, p.u, p.repetition_penalty, p.frequency_penalty, p.presence_penalty];
            if floats.iter().any(|f| !f.is_finite()) {
                bail!("sampling parameters must be finite numbers");
            }
        }
        let want = n * self.hidden * 4;
        match (self.first, hidden_bytes) {
            (true, None) => {}
            (false, Some(h)) if h == want => {}
            (false, Some(h)) => bail!("hidden states of {h} bytes, expected {want} ({n} tokens)"),
            (false, None) => bail!("this stage needs the previous stage's hidden states"),
            (true, Some(_)) => bail!("the first stage embeds tokens itself; it takes no hidden states"),
        }
        Ok(())
    }
}
