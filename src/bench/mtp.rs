//! `bench-model --mtp`: what the MTP head's proposal rounds cost (Qwen3.5 / Qwen3.6 files that
//! keep their head; synthetic ones do), beside the model's decode step: B sequences read a
//! prompt through the head, then each timed round proposes one token per sequence (one layer,
//! the fc input stage and the model's LM head, which the head shares). Proposals of a synthetic
//! model mean nothing; only the time does.

use crate::bench::model::random_tokens;
use crate::config::EngineConfig;
use crate::gpu::Gpu;
use crate::model::blocks::mtp::{load_mtp, norm_rows};
use crate::model::{kv_block_bytes, Model, StepInput};
use crate::sampling::SampleParams;
use crate::weights::tensor::XorShift64;
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::sync::Arc;
use std::time::Instant;

/// The head's cost at one batch size.
#[derive(Clone, Debug, Serialize)]
pub struct MtpResult {
    pub batch: usize,
    /// Timed rounds (each proposes one token for every sequence).
    pub rounds: usize,
    pub seconds: f64,
    pub ms_per_round: f64,
}

/// The MTP head of the model `cfg` names, on `model`'s device, sharing its embedding and LM
/// head, with a KV cache of the model's block count.
pub fn load_head(cfg: &EngineConfig, gpu: Arc<Gpu>, model: &Model) -> Result<Model> {
    let path = cfg.model_path();
    let mut host = load_mtp(&path)?;
    host.model.embed = None;
    host.model.lm_head = None;
    let mut limits = model.limits;
    limits.cache_bytes = model.kv.num_blocks as u64 * kv_block_bytes(&host.model.cfg, &limits) * 2;
    let mut head = Model::new_mtp(gpu, &host, limits, model.io()).context("the MTP head")?;
    head.emit_hidden(true);
    head.warm_up()?;
    eprintln!("MTP head: {}", head.plan);
    Ok(head)
}

/// `batch` sequences read `prompt` positions through the head (untimed), then `rounds` timed
/// rounds of one proposal per sequence, each reading a normed hidden state.
pub fn measure_mtp(
    head: &mut Model,
    batch: usize,
    (prompt, rounds): (usize, usize),
    rng: &mut XorShift64,
) -> Result<MtpResult> {
    let lim = head.limits;
    let (h, bs) = (head.cfg.hidden, lim.block_size);
    let len = prompt.max(1) + rounds;
    let per_seq = len.div_ceil(bs);
    if batch == 0 || batch > lim.max_seqs || batch * per_seq > head.kv.num_blocks || len > lim.max_seq_len {
        bail!("batch {batch} of {len} positions does not fit the head's limits");
    }
    let tables: Vec<Vec<u32>> =
        (0..batch).map(|i| ((i * per_seq) as u32..((i + 1) * per_seq) as u32).collect()).collect();
    let slot = |t: &[u32], pos: usize| t[pos / bs] * bs as u32 + (pos % bs) as u32;
    if prompt.max(1) > lim.max_tokens {
        bail!("a prompt of {prompt} tokens exceeds max_num_batched_tokens {}", lim.max_tokens);
    }
    let rows = |n: usize, rng: &mut XorShift64| {
        let mut r: Vec<f32> = (0..n * h).map(|_| rng.unit() * 2.0 - 1.0).collect();
        norm_rows(&mut r, &vec![1.0; h], 1e-6);
        bytemuck::cast_slice::<f32, u8>(&r).to_vec()
    };
    let step = |tokens: Vec<u32>, pos: &[usize], seqs: &[usize], sample: bool| StepInput {
        slots: pos.iter().zip(seqs).map(|(&p, &s)| slot(&tables[s], p)).collect(),
        positions: pos.iter().map(|&p| p as u32).collect(),
        seq_of_token: seqs.iter().map(|&s| s as u32).collect(),
        block_tables: tables.clone(),
        sample_rows: if sample { (0..tokens.len() as u32).collect() } else { vec![] },
        sampling: if sample { vec![SampleParams::default(); tokens.len()] } else { vec![] },
        tokens,
        state_slots: Vec::new(),
    };
    // The prompt, a sequence per step.
    for table in &tables {
        let n = prompt.max(1);
        let one = StepInput {
            tokens: random_tokens(rng, n, head.cfg.vocab),
            positions: (0..n as u32).collect(),
            slots: (0..n).map(|p| slot(table, p)).collect(),
            seq_of_token: vec![0; n],
            block_tables: vec![table.clone()],
            ..Default::default()
        };
        head.run(&one, Some(&rows(n, rng)))?;
    }
    let seqs: Vec<usize> = (0..batch).collect();
    let t0 = Instant::now();
    for r in 0..rounds {
        let pos = vec![prompt.max(1) + r; batch];
        let input = step(random_tokens(rng, batch, head.cfg.vocab), &pos, &seqs, true);
        head.run(&input, Some(&rows(batch, rng)))?;
        head.take_hidden();
    }
    let seconds = t0.elapsed().as_secs_f64().max(1e-9);
    Ok(MtpResult { batch, rounds, seconds, ms_per_round: seconds * 1e3 / rounds.max(1) as f64 })
}
