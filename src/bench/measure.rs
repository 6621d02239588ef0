//! The measurements `bench-model` is made of: decode speed at one batch size (B sequences after
//! a short prompt, one token each per step, the step's host budget from the device's counters)
//! and the prefill speed of one prompt, straight on `Model`.

use crate::bench::kernels::KernelProfileRun;
use crate::model::{Model, StepInput};
use crate::sampling::SampleParams;
use crate::weights::tensor::XorShift64;
use anyhow::{bail, Result};
use serde::Serialize;
use std::time::Instant;

/// Decode speed at one batch size.
#[derive(Clone, Debug, Serialize)]
pub struct DecodeResult {
    pub batch: usize,
    /// Timed steps (each decodes one token of every sequence).
    pub steps: usize,
    pub seconds: f64,
    /// batch * steps / seconds.
    pub tok_s: f64,
    /// Weight bytes read per second if every step reads every weight once: weight_bytes *
    /// steps / seconds, in 1e9 bytes.
    pub weight_gb_s: f64,
    /// The same for the weights a step reads (`ModelSummary::step_weight_bytes`; a MoE model's
    /// chosen experts only).
    pub read_gb_s: f64,
    /// Where a step's time goes on the host, and its dispatches, passes, submits, readbacks.
    pub per_step: crate::bench::overhead::StepOverhead,
}

/// Prefill speed of one prompt.
#[derive(Clone, Debug, Serialize)]
pub struct PrefillResult {
    pub tokens: usize,
    /// Steps the prompt took (at most max_num_batched_tokens tokens each).
    pub steps: usize,
    pub seconds: f64,
    pub tok_s: f64,
}

/// `n` random token ids below `vocab`.
pub fn random_tokens(rng: &mut XorShift64, n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|_| (rng.next_u64() % vocab as u64) as u32).collect()
}

/// The KV slot of position `pos` of a sequence with block table `table`.
fn slot(table: &[u32], pos: usize, block_size: usize) -> u32 {
    table[pos / block_size] * block_size as u32 + (pos % block_size) as u32
}

/// Runs `seqs` (their tokens from `start` on, each through its block table) as prefill steps of
/// whole sequences packed up to the model's token and sequence limits; returns the greedy token
/// sampled after each sequence's last token.
fn prefill_packed(model: &mut Model, seqs: &[(Vec<u32>, Vec<u32>)]) -> Result<Vec<u32>> {
    let lim = model.limits;
    let mut out = Vec::with_capacity(seqs.len());
    let mut i = 0;
    while i < seqs.len() {
        let mut step = StepInput::default();
        while i < seqs.len()
            && step.block_tables.len() < lim.max_seqs
            && step.tokens.len() + seqs[i].0.len() <= lim.max_tokens
        {
            let (tokens, table) = &seqs[i];
            let s = step.block_tables.len() as u32;
            for (pos, &t) in tokens.iter().enumerate() {
                step.tokens.push(t);
                step.positions.push(pos as u32);
                step.slots.push(slot(table, pos, lim.block_size));
                step.seq_of_token.push(s);
            }
            step.sample_rows.push(step.tokens.len() as u32 - 1);
            step.sampling.push(SampleParams::default());
            step.block_tables.push(table.clone());
            i += 1;
        }
        if step.block_tables.is_empty() {
            bail!("a prompt of {} tokens does not fit max_num_batched_tokens {}", seqs[i].0.len(), lim.max_tokens);
        }
        out.extend(model.step(&step)?.iter().map(|r| r.id));
    }
    Ok(out)
}

/// Decode speed with `batch` sequences: each gets a prompt of `prompt_tokens` random tokens,
/// then `warmup` untimed and `steps` timed greedy decode steps of one token per sequence. With
/// `profile`, the timed steps run with the per-kernel profile on.
pub fn measure_decode(
    model: &mut Model,
    batch: usize,
    (prompt_tokens, warmup, steps): (usize, usize, usize),
    rng: &mut XorShift64,
    profile: bool,
) -> Result<(DecodeResult, Option<KernelProfileRun>)> {
    let lim = model.limits;
    if batch == 0 || batch > lim.max_seqs {
        bail!("batch {batch} is outside 1..={} (max_decode_batch_size)", lim.max_seqs);
    }
    let len = prompt_tokens.max(1) + warmup + steps;
    if len > lim.max_seq_len {
        bail!("{len} tokens per sequence exceed max_sequence_length {}", lim.max_seq_len);
    }
    let per_seq = len.div_ceil(lim.block_size);
    if batch * per_seq > model.kv.num_blocks {
        bail!(
            "batch {batch} needs {} KV blocks, the cache holds {} (raise total_cache_size)",
            batch * per_seq,
            model.kv.num_blocks
        );
    }
    let vocab = model.cfg.vocab;
    let seqs: Vec<(Vec<u32>, Vec<u32>)> = (0..batch)
        .map(|i| {
            let table = ((i * per_seq) as u32..((i + 1) * per_seq) as u32).collect();
            (random_tokens(rng, prompt_tokens.max(1), vocab), table)
        })
        .collect();
    let mut last = prefill_packed(model, &seqs)?;
    let tables: Vec<Vec<u32>> = seqs.iter().map(|s| s.1.clone()).collect();
    let mut t0 = Instant::now();
    let mut counted = model.gpu.counters.snapshot();
    for s in 0..warmup + steps {
        if s == warmup {
            counted = model.gpu.counters.snapshot();
            model.set_profiling(profile);
            t0 = Instant::now();
        }
        let pos = prompt_tokens.max(1) + s;
        let step = StepInput {
            tokens: last.clone(),
            positions: vec![pos as u32; batch],
            slots: tables.iter().map(|t| slot(t, pos, lim.block_size)).collect(),
            seq_of_token: (0..batch as u32).collect(),
            block_tables: tables.clone(),
            sample_rows: (0..batch as u32).collect(),
            sampling: vec![SampleParams::default(); batch],
            state_slots: Vec::new(),
        };
        last = model.step(&step)?.iter().map(|r| r.id).collect();
    }
    let seconds = t0.elapsed().as_secs_f64().max(1e-9);
    let run = model.profile().map(|p| KernelProfileRun::new("decode", batch, &p, seconds));
    model.set_profiling(false);
    let r = DecodeResult {
        batch,
        steps,
        seconds,
        tok_s: (batch * steps) as f64 / seconds,
        weight_gb_s: model.plan.weights as f64 * steps as f64 / seconds / 1e9,
        read_gb_s: model.plan.weights as f64 * steps as f64 / seconds / 1e9,
        per_step: crate::bench::overhead::StepOverhead::of(
            &model.gpu.counters.snapshot().since(&counted),
            steps,
            seconds,
        ),
    };
    Ok((r, run))
}

/// Prefill speed of one prompt of `tokens` random tokens, in steps of at most
/// max_num_batched_tokens tokens (the last samples one token); with `profile`, with the
/// per-kernel profile on.
pub fn measure_prefill(
    model: &mut Model,
    tokens: usize,
    rng: &mut XorShift64,
    profile: bool,
) -> Result<(PrefillResult, Option<KernelProfileRun>)> {
    let lim = model.limits;
    if tokens == 0 || tokens > lim.max_seq_len {
        bail!("a prefill of {tokens} tokens is outside 1..={} (max_sequence_length)", lim.max_seq_len);
    }
    let blocks = tokens.div_ceil(lim.block_size);
    if blocks > model.kv.num_blocks {
        bail!("a prefill of {tokens} tokens needs {blocks} KV blocks, the cache holds {}", model.kv.num_blocks);
    }
    let table: Vec<u32> = (0..blocks as u32).collect();
    let prompt = random_tokens(rng, tokens, model.cfg.vocab);
    model.set_profiling(profile);
    let t0 = Instant::now();
    let mut steps = 0;
    for c0 in (0..tokens).step_by(lim.max_tokens) {
        let c1 = (c0 + lim.max_tokens).min(tokens);
        let pos: Vec<u32> = (c0 as u32..c1 as u32).collect();
        let is_last = c1 == tokens;
        model.step(&StepInput {
            tokens: prompt[c0..c1].to_vec(),
            slots: pos.clone(),
            positions: pos,
            seq_of_token: vec![0; c1 - c0],
            block_tables: vec![table.clone()],
            sample_rows: if is_last { vec![(c1 - c0) as u32 - 1] } else { vec![] },
            sampling: if is_last { vec![SampleParams::default()] } else { vec![] },
            state_slots: Vec::new(),
        })?;
        steps += 1;
    }
    let seconds = t0.elapsed().as_secs_f64().max(1e-9);
    let run = model.profile().map(|p| KernelProfileRun::new("prefill", tokens, &p, seconds));
    model.set_profiling(false);
    Ok((PrefillResult { tokens, steps, seconds, tok_s: tokens as f64 / seconds }, run))
}
