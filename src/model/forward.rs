//! The model on the GPU: weights, KV cache, activation scratch and the recorded forward step.
//! One `step` = upload the step's metadata, one compute pass with every layer's dispatches and
//! the sampler, one submit, one small readback of (token id, logprob) per sampled row.

use super::config::{ModelConfig, RopeScaling};
use super::loader::{HostLayer, HostModel};
use super::ops::{attention_splits, Op, OpKind, RecordParams, Recorder, StepShape};
use super::tensor::QTensor;
use crate::gpu::kernels::{
    window_entries, window_stride, KernelProfile, KernelSpec, Kernels, KvDtype, WFormat, KV_K_CHUNK_BINDING,
    KV_V_CHUNK_BINDING, MATMUL_TILES, MAX_TOP_LOGPROBS, NO_FORCE, NO_MASK, SAMPLE_PARAMS_STRIDE, SAMPLE_RESULT_STRIDE,
};
pub(crate) use crate::gpu::shared::{MatParams, StepHeader, MAT_ACCUMULATE, MAT_BIAS, MAT_SWIGLU_UP};
use crate::gpu::Gpu;
use anyhow::{bail, Result};
use std::sync::Arc;

/// A weight matrix on the GPU, split by rows into chunks that each fit one storage binding.
pub struct GpuMatrix {
    pub format: WFormat,
    pub rows: usize,
    pub cols: usize,
    pub chunks: Vec<GpuChunk>,
}

pub struct GpuChunk {
    pub row0: usize,
    pub rows: usize,
    pub q: wgpu::Buffer,
    pub s: wgpu::Buffer,
}

impl GpuMatrix {
    /// Uploads `t`; with `pair` (same shape), each chunk holds `t`'s rows then `pair`'s same rows
    /// (gate then up, for the fused SwiGLU matmul).
    pub fn upload(gpu: &Gpu, label: &str, t: &QTensor, pair: Option<&QTensor>, max_binding: u64) -> Result<GpuMatrix> {
        let per_row_q = (t.blocks_per_row() * t.format.words_per_block() * 4) as u64;
        let per_row_s = (t.format.scale_words_per_row(t.cols) * 4) as u64;
        let mult = if pair.is_some() { 2 } else { 1 };
        let per_row = per_row_q.max(per_row_s) * mult;
        let rows_per_chunk = (max_binding / per_row) as usize;
        if rows_per_chunk == 0 {
            bail!("{label}: one row ({per_row} bytes) exceeds the device's max storage binding");
        }
        let mut chunks = Vec::new();
        let mut r0 = 0;
        while r0 < t.rows {
            let r1 = (r0 + rows_per_chunk).min(t.rows);
            let mut part = t.slice_rows(r0, r1);
            if let Some(p) = pair {
                part = QTensor::concat_rows(&[&part, &p.slice_rows(r0, r1)])?;
            }
            chunks.push(GpuChunk {
                row0: r0,
                rows: r1 - r0,
                q: gpu.storage_init(label, bytemuck::cast_slice(&part.q)),
                s: gpu.storage_init(label, bytemuck::cast_slice(&part.s)),
            });
            r0 = r1;
        }
        Ok(GpuMatrix { format: t.format, rows: t.rows, cols: t.cols, chunks })
    }
}

/// Most logit-bias entries one request may carry.
pub const MAX_LOGIT_BIAS: usize = 300;

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
    /// `pipeline::step_limits`): blocks that left it can be freed.
    pub sliding_window: Option<usize>,
}

/// Per-row sampling parameters; `u` is a uniform draw in [0, 1) from the request's generator.
#[derive(Clone, Debug, PartialEq)]
pub struct SampleParams {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: u32,
    /// 0 = off; otherwise tokens whose probability (after temperature) is below min_p times the
    /// largest are dropped before top-p.
    pub min_p: f32,
    pub u: f32,
    /// 1.0 = off. Divides positive (multiplies negative) logits of tokens seen in prompt or output.
    pub repetition_penalty: f32,
    /// Subtracted once per occurrence in the output.
    pub frequency_penalty: f32,
    /// Subtracted once if the token occurs in the output.
    pub presence_penalty: f32,
    /// Top log-probabilities to return (at most MAX_TOP_LOGPROBS).
    pub n_top: u32,
    /// Tokens whose logits the penalties or a bias change; each id at most once.
    pub adjust: Vec<Adjust>,
    /// Structured outputs: the tokens this row may pick, one bit per vocabulary id (bit `i % 32`
    /// of word `i / 32`; `vocab.div_ceil(32)` words). Every other token's logit becomes
    /// [`MASKED_LOGIT`] before sampling (greedy too), so it is never picked. None: no mask.
    pub mask: Option<Vec<u32>>,
    /// Prompt log-probabilities: this row reports `force` as its token (with its log-probability
    /// and the top ones) instead of sampling one. None: sample.
    pub force: Option<u32>,
}

impl Default for SampleParams {
    fn default() -> Self {
        SampleParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            u: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            n_top: 0,
            adjust: vec![],
            mask: None,
            force: None,
        }
    }
}

impl SampleParams {
    /// Entries (16 bytes each) this row takes in the adjustment buffer: its logit adjustments,
    /// then its token mask padded to whole entries.
    pub(crate) fn adjust_entries(&self) -> usize {
        self.adjust.len() + self.mask.as_ref().map_or(0, |m| m.len().div_ceil(4))
    }

    /// Appends this row's entries to the adjustment buffer's words; `words()` takes the start.
    pub(crate) fn push_adjust(&self, adjust: &mut Vec<u32>) {
        adjust.extend(self.adjust.iter().flat_map(|a| a.words()));
        if let Some(m) = &self.mask {
            adjust.extend_from_slice(m);
            adjust.resize(adjust.len().div_ceil(4) * 4, 0);
        }
    }

    /// The per-row words of the step metadata (layout in sample.wgsl / logit_adjust.wgsl).
    /// `adj_start`: the entry where this row's adjustments start in the adjustment buffer (its
    /// mask, if any, follows them).
    pub(crate) fn words(&self, adj_start: u32) -> [u32; SAMPLE_PARAMS_STRIDE] {
        [
            self.temperature.to_bits(),
            self.top_p.to_bits(),
            self.top_k,
            self.u.to_bits(),
            self.repetition_penalty.to_bits(),
            self.frequency_penalty.to_bits(),
            self.presence_penalty.to_bits(),
            self.n_top.min(MAX_TOP_LOGPROBS as u32),
            adj_start,
            self.adjust.len() as u32,
            self.min_p.to_bits(),
            match self.mask {
                Some(_) => adj_start + self.adjust.len() as u32,
                None => NO_MASK,
            },
            self.force.unwrap_or(NO_FORCE),
            0,
            0,
            0,
        ]
    }
}

/// One logit change: token id, times generated so far, whether it is in the prompt, bias.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Adjust {
    pub id: u32,
    pub count: u32,
    pub in_prompt: bool,
    pub bias: f32,
}

impl Adjust {
    pub(crate) fn words(&self) -> [u32; 4] {
        [self.id, self.count, self.in_prompt as u32, self.bias.to_bits()]
    }
}

/// A sampled token: id, log-probability, and the most likely alternatives when asked.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub id: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

impl Sampled {
    pub(crate) fn parse(words: &[u32], n_top: u32) -> Sampled {
        let top = (0..n_top.min(MAX_TOP_LOGPROBS as u32) as usize)
            .map(|j| (words[2 + 2 * j], f32::from_bits(words[3 + 2 * j])))
            .collect();
        Sampled { id: words[0], logprob: f32::from_bits(words[1]), top }
    }
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
}

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

/// The KV cache of a stage's layers: per layer, K and V each in one or more buffers (chunks)
/// of `blocks_per_chunk` whole blocks, so no binding exceeds the device's limit.
pub struct KvCache {
    pub k: Vec<Vec<wgpu::Buffer>>,
    pub v: Vec<Vec<wgpu::Buffer>>,
    pub num_blocks: usize,
    pub block_size: usize,
    pub blocks_per_chunk: usize,
}

/// What a model (or stage) allocates on its device, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryPlan {
    pub weights: u64,
    pub kv_cache: u64,
    /// Activations, logits, RoPE table, step metadata and logit adjustments.
    pub scratch: u64,
}

impl MemoryPlan {
    pub fn total(&self) -> u64 {
        self.weights + self.kv_cache + self.scratch
    }
}

impl std::fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        write!(
            f,
            "weights {:.1} MiB + KV cache {:.1} MiB + scratch {:.1} MiB = {:.1} MiB",
            mib(self.weights),
            mib(self.kv_cache),
            mib(self.scratch),
            mib(self.total())
        )
    }
}

/// Splits a layer's `num_blocks` KV blocks into at most `max_chunks` buffers of whole blocks no
/// larger than `max_binding`: (blocks per chunk, chunks).
pub fn kv_chunking(num_blocks: usize, per_block: u64, max_binding: u64, max_chunks: usize) -> Option<(usize, usize)> {
    let fit = (max_binding / per_block) as usize;
    if fit == 0 {
        return None;
    }
    let chunks = num_blocks.div_ceil(fit).max(1);
    // Balance the chunks.
    let per_chunk = num_blocks.div_ceil(chunks);
    (chunks <= max_chunks).then_some((per_chunk, chunks))
}

/// What one step of a stage returns: hidden states for the next stage ([tokens, hidden] f32,
/// little-endian bytes), or, on the last stage, the sampled tokens.
#[derive(Clone, Debug, PartialEq)]
pub enum StageOutput {
    Hidden(Vec<u8>),
    Sampled(Vec<Sampled>),
}

/// The model, or one pipeline stage of it: layers `layers` of `cfg.layers`. The first stage
/// also embeds tokens; the last also applies the final norm, the LM head and the sampler.
pub struct Model {
    /// Test-only (`pipeline::Fault::StepGpuError`): the next step raises a wgpu validation error.
    #[doc(hidden)]
    pub provoke_gpu_error: bool,
    pub cfg: ModelConfig,
    pub gpu: Arc<Gpu>,
    pub limits: StepLimits,
    pub layers: std::ops::Range<usize>,
    /// KV cache of this stage's layers only.
    pub kv: KvCache,
    /// What this model (or stage) allocated on its device.
    pub plan: MemoryPlan,
    kernels: Kernels,
    ops: Vec<Op>,
    step_buf: wgpu::Buffer,
    meta_buf: wgpu::Buffer,
    /// Host copies of the step metadata and logit adjustments, reused every step.
    meta_scratch: Vec<u32>,
    adjust_scratch: Vec<u32>,
    adjust_buf: wgpu::Buffer,
    adjust_cap: usize,
    /// vec4s of the split attention's partial results (gpu profile; 0 on the cpu profile).
    part_vec4: usize,
    /// The device's uniform-offset alignment and window stride (read once, not every step).
    record: RecordParams,
    header: StepHeader,
    /// Most tokens and sampled rows of one sub-step (a step larger than that runs in several).
    sub_tokens: usize,
    sub_seqs: usize,
    off_sample: usize,
    off_params: usize,
    pub logits: wgpu::Buffer,
    result: wgpu::Buffer,
    readback: wgpu::Buffer,
    /// The hidden states of every token (input of a later stage, output of an earlier one).
    hidden: wgpu::Buffer,
    hidden_readback: Option<wgpu::Buffer>,
    // Weights and scratch stay alive as long as the bind groups that use them.
    _keep: Vec<wgpu::Buffer>,
    _matrices: Vec<GpuMatrix>,
}

impl MatParams {
    /// Parameters of one row-chunk's matmul (see matmul.wgsl), writing output columns from
    /// `col0` + the chunk's first row.
    pub(crate) fn new(cols: usize, chunk: &GpuChunk, col0: usize, y_stride: usize, sampled: bool, flags: u32) -> Self {
        MatParams {
            k_blocks: (cols / 32) as u32,
            n_rows: chunk.rows as u32,
            row0: (col0 + chunk.row0) as u32,
            y_stride: y_stride as u32,
            x_stride4: (cols / 4) as u32,
            m_src: sampled as u32,
            flags,
            ..Default::default()
        }
    }
}

/// cos/sin of pos * inv_freq[i] for every position below `max_pos` and i < d/2, with f32
/// inverse frequencies (scaled as the model's rope scaling says) and f32 angles as Hugging Face
/// computes them, times the scaling's attention factor (YaRN): [pos][i] = (cos, sin).
pub(crate) fn rope_table(theta: f64, head_dim: usize, max_pos: usize, scaling: &RopeScaling) -> Vec<f32> {
    let half = head_dim / 2;
    let (inv, attn) = scaling.inv_freq(theta, head_dim);
    let inv: Vec<f32> = inv.iter().map(|&f| f as f32).collect();
    let attn = attn as f32;
    let mut cs = Vec::with_capacity(max_pos * half * 2);
    for pos in 0..max_pos {
        for f in &inv {
            let a = pos as f32 * f;
            cs.extend([a.cos() * attn, a.sin() * attn]);
        }
    }
    cs
}

/// Uniform words of rope_kv.wgsl's RopeParams; `kv_chunk`: elements per KV-cache buffer.
pub(crate) fn rope_params(heads: usize, kv_heads: usize, head_dim: usize, kv_chunk: usize) -> [u32; 8] {
    [
        heads as u32,
        kv_heads as u32,
        head_dim as u32,
        ((heads + 2 * kv_heads) * head_dim) as u32,
        kv_chunk as u32,
        0,
        0,
        0,
    ]
}

/// Uniform words of the attention kernels' AttnParams (gpu::shared); `window`: attend to the last `window`
/// positions only (0: all); `kv_chunk`: elements per KV-cache buffer.
pub(crate) fn attn_params(
    (heads, kv_heads, head_dim): (usize, usize, usize),
    block_size: usize,
    window: usize,
    kv_chunk: usize,
) -> [u32; 8] {
    bytemuck::cast(crate::gpu::shared::AttnParams {
        n_heads: heads as u32,
        n_kv_heads: kv_heads as u32,
        block_size: block_size as u32,
        qkv_stride4: ((heads + 2 * kv_heads) * head_dim / 4) as u32,
        scale: 1.0 / (head_dim as f32).sqrt(),
        window: window as u32,
        kv_chunk4: (kv_chunk / 4) as u32,
        _p2: 0,
    })
}

/// Uniform words of head_norm.wgsl's HeadNormParams.
pub(crate) fn head_norm_params(heads: usize, kv_heads: usize, head_dim: usize, eps: f32) -> [u32; 8] {
    let qkv_stride = ((heads + 2 * kv_heads) * head_dim) as u32;
    [heads as u32, kv_heads as u32, head_dim as u32, qkv_stride, eps.to_bits(), 0, 0, 0]
}

/// Bytes of one KV block of one layer (K or V).
pub fn kv_block_bytes(cfg: &ModelConfig, limits: &StepLimits) -> u64 {
    (limits.block_size * cfg.kv_dim() * limits.kv_dtype.bytes()) as u64
}

/// KV blocks of one layer's cache: `cache_bytes` spread over every layer of the model (all
/// stages of a pipeline agree).
pub fn kv_blocks(cfg: &ModelConfig, limits: &StepLimits) -> usize {
    (limits.cache_bytes / (kv_block_bytes(cfg, limits) * 2 * cfg.layers as u64)) as usize
}

/// Threads of one rope_kv dispatch: one per (token, head, pair of rotated elements).
pub(crate) fn rope_threads(n_tokens: usize, heads: usize, kv_heads: usize, head_dim: usize) -> u32 {
    (n_tokens * (heads + 2 * kv_heads) * head_dim / 4) as u32
}

/// Bind entries plus a layer's KV-cache chunks: chunk 0 at `first` (K, V), chunk c >= 1 at
/// KV_K_CHUNK_BINDING + c and KV_V_CHUNK_BINDING + c.
pub(crate) fn kv_entries<'a>(
    mut entries: Vec<(u32, &'a wgpu::Buffer)>,
    first: (u32, u32),
    k: &'a [wgpu::Buffer],
    v: &'a [wgpu::Buffer],
) -> Vec<(u32, &'a wgpu::Buffer)> {
    for (c, (kb, vb)) in k.iter().zip(v).enumerate() {
        let c = c as u32;
        let (ki, vi) = if c == 0 { first } else { (KV_K_CHUNK_BINDING + c, KV_V_CHUNK_BINDING + c) };
        entries.extend([(ki, kb), (vi, vb)]);
    }
    entries
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

/// Adjustment entries one sampled row may take: one per token of its sequence (penalties), its
/// logit-bias entries, and its token mask (four words per entry).
fn adjust_per_row(vocab: usize, limits: &StepLimits) -> usize {
    limits.max_seq_len + MAX_LOGIT_BIAS + vocab.div_ceil(32).div_ceil(4)
}

/// The step metadata layout and the rows of one sub-step: at most `t_max` tokens and `s_max`
/// sampled rows, so every activation, logits and adjustment buffer fits one storage binding.
struct StepLayout {
    t_max: usize,
    s_max: usize,
    header: StepHeader,
    off_sample: usize,
    off_params: usize,
    meta_len: usize,
    /// Logit adjustments: up to one entry per token of every sampled sequence, plus its
    /// logit-bias entries.
    adjust_cap: usize,
}

impl StepLayout {
    fn new(cfg: &ModelConfig, limits: &StepLimits, last: bool) -> Result<StepLayout> {
        let mb = limits.max_binding;
        let (t_all, s_all) = (limits.max_tokens, limits.max_seqs);
        let max_blocks = limits.max_seq_len.div_ceil(limits.block_size);
        // A step runs in sub-steps of at most `t_max` tokens and `s_max` sampled rows (a
        // 2048-token step of a 7B model's 18944-wide FFN does not fit one binding). Sub-steps
        // run in token order, so a token still sees every earlier token's K/V: the result is
        // the whole step's.
        let f = |n: usize| (n * 4) as u64;
        let widest = cfg.hidden.max(cfg.qkv_dim()).max(cfg.q_dim()).max(cfg.intermediate);
        let t_max = t_all.min((mb / f(widest)) as usize);
        let per_sampled = f(cfg.vocab).max((adjust_per_row(cfg.vocab, limits) * 16) as u64);
        let s_max = s_all.min(t_max).min(if last { (mb / per_sampled) as usize } else { s_all });
        if t_max == 0 || s_max == 0 {
            bail!(
                "one token's activations ({} bytes) or logits ({} bytes) exceed the device's max storage binding \
                 ({mb} bytes)",
                f(widest),
                per_sampled
            );
        }
        // Metadata layout (u32 words): tokens, positions, slots, seq ids, sample rows,
        // sample params (SAMPLE_PARAMS_STRIDE per row), block tables.
        let ps = SAMPLE_PARAMS_STRIDE;
        let header = StepHeader {
            n_tokens: 0,
            n_sample: 0,
            n_seqs: 0,
            max_blocks: max_blocks as u32,
            off_pos: t_max as u32,
            off_slot: 2 * t_max as u32,
            off_seq: 3 * t_max as u32,
            off_table: (4 * t_max + (1 + ps) * s_max) as u32,
            n_splits: 1,
            ..Default::default()
        };
        Ok(StepLayout {
            t_max,
            s_max,
            header,
            off_sample: 4 * t_max,
            off_params: 4 * t_max + s_max,
            // Every sequence of the step has its block table in every sub-step.
            meta_len: 4 * t_max + (1 + ps) * s_max + s_all * max_blocks,
            adjust_cap: s_max * adjust_per_row(cfg.vocab, limits),
        })
    }
}

/// The KV cache's size: blocks per layer ([block_size, kv_heads, head_dim] each, K and V, f16 or
/// f32), spread over `chunks` buffers of `blocks_per_chunk` whole blocks within the binding limit.
struct KvPlan {
    per_block: u64,
    num_blocks: usize,
    blocks_per_chunk: usize,
    chunks: usize,
}

impl KvPlan {
    fn new(cfg: &ModelConfig, limits: &StepLimits, max_chunks: usize, max_blocks: usize) -> Result<KvPlan> {
        let mb = limits.max_binding;
        let per_block = kv_block_bytes(cfg, limits);
        // Sized by the whole model's layer count, so every stage of a pipeline holds as many blocks.
        let num_blocks = kv_blocks(cfg, limits);
        if num_blocks < max_blocks.min(2) || num_blocks == 0 {
            bail!(
                "total_cache_size {} bytes holds only {num_blocks} KV blocks of {} tokens ({} KV cache); raise it",
                limits.cache_bytes,
                limits.block_size,
                limits.kv_dtype.name()
            );
        }
        // A layer's cache larger than one storage binding spans several buffers (chunks).
        let Some((blocks_per_chunk, chunks)) = kv_chunking(num_blocks, per_block, mb, max_chunks) else {
            // Never shrink the cache behind the user's back.
            bail!(
                "total_cache_size {} bytes gives each layer a {} KV cache of {} bytes for K (and as much for V), \
                 more than {max_chunks} storage bindings of {mb} bytes; lower total_cache_size to at most {} bytes",
                limits.cache_bytes,
                limits.kv_dtype.name(),
                num_blocks as u64 * per_block,
                (mb / per_block) * max_chunks as u64 * per_block * 2 * cfg.layers as u64
            );
        };
        Ok(KvPlan { per_block, num_blocks, blocks_per_chunk, chunks })
    }

    fn bytes_per_layer(&self) -> u64 {
        self.num_blocks as u64 * self.per_block * 2
    }

    /// Elements of one chunk buffer.
    fn chunk_elems(&self, cfg: &ModelConfig, block_size: usize) -> usize {
        self.blocks_per_chunk * block_size * cfg.kv_dim()
    }

    fn allocate(&self, g: &Gpu, layers: usize, block_size: usize) -> KvCache {
        let chunk_buffers = |name: &str| -> Vec<wgpu::Buffer> {
            (0..self.chunks)
                .map(|c| {
                    let blocks = self.blocks_per_chunk.min(self.num_blocks - c * self.blocks_per_chunk);
                    g.storage(name, blocks as u64 * self.per_block)
                })
                .collect()
        };
        KvCache {
            k: (0..layers).map(|_| chunk_buffers("k_cache")).collect(),
            v: (0..layers).map(|_| chunk_buffers("v_cache")).collect(),
            num_blocks: self.num_blocks,
            block_size,
            blocks_per_chunk: self.blocks_per_chunk,
        }
    }
}

/// Bytes of a stage's weights on the device: its layers, and the embedding / final norm / LM
/// head where the stage holds them.
fn stage_weight_bytes(host: &HostModel, layers: &std::ops::Range<usize>) -> u64 {
    let f = |n: usize| (n * 4) as u64;
    let (first, last) = (layers.start == 0, layers.end == host.cfg.layers);
    host.layer_slice(layers)
        .iter()
        .map(|l| {
            let m = [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down].iter().map(|t| t.bytes() as u64).sum::<u64>();
            m + f(l.attn_norm.len() + l.ffn_norm.len())
                + l.qkv_bias.as_ref().map_or(0, |b| f(b.len()))
                + l.qk_norm.as_ref().map_or(0, |b| f(b.len()))
        })
        .sum::<u64>()
        + host.embed.as_ref().filter(|_| first || (last && host.tied)).map_or(0, |e| e.bytes() as u64)
        + host.lm_head.as_ref().filter(|_| last && !host.tied).map_or(0, |e| e.bytes() as u64)
        + f(host.final_norm.len())
}

/// Sizes of the scratch buffers (bytes, except where named).
struct ScratchPlan {
    /// Sampled rows with logits: the sub-step's on the last stage, none elsewhere (1 as a
    /// placeholder).
    s_last: usize,
    /// vec4s of the split attention's partial results (gpu profile; 0 on the cpu profile).
    part_vec4: usize,
    bytes: u64,
}

impl ScratchPlan {
    fn new(cfg: &ModelConfig, limits: &StepLimits, layout: &StepLayout, last: bool) -> ScratchPlan {
        let f = |n: usize| (n * 4) as u64;
        let (t_max, s_max) = (layout.t_max, layout.s_max);
        let s_last = if last { s_max } else { 1 };
        // Up to 32 key ranges of every head of every sampled row (decode-sized steps split most).
        let part_vec4 = if limits.profile == KernelProfile::Gpu {
            (s_max * cfg.heads * 32 * (cfg.head_dim / 4 + 1)).min((limits.max_binding / 16) as usize)
        } else {
            0
        };
        let bytes = f(t_max * (2 * cfg.hidden + cfg.qkv_dim() + cfg.q_dim() + cfg.intermediate))
            + f(s_last * (cfg.vocab + cfg.hidden + SAMPLE_RESULT_STRIDE))
            + f(limits.max_seq_len * cfg.head_dim)
            + f(layout.meta_len)
            + part_vec4 as u64 * 16
            + if last { (layout.adjust_cap * 16) as u64 } else { 0 };
        ScratchPlan { s_last, part_vec4, bytes }
    }

    fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// The step's buffers: metadata, activations, logits and sampler results, hidden states for
/// the next stage, the RoPE table and the split attention's partials.
struct Scratch {
    step_buf: wgpu::Buffer,
    meta_buf: wgpu::Buffer,
    adjust_buf: wgpu::Buffer,
    hidden: wgpu::Buffer,
    normed: wgpu::Buffer,
    qkv: wgpu::Buffer,
    attn: wgpu::Buffer,
    act: wgpu::Buffer,
    final_normed: wgpu::Buffer,
    logits: wgpu::Buffer,
    result: wgpu::Buffer,
    readback: wgpu::Buffer,
    hidden_readback: Option<wgpu::Buffer>,
    part: wgpu::Buffer,
    cos_sin: wgpu::Buffer,
    /// Bound where a kernel's binding is unused (no bias).
    dummy: wgpu::Buffer,
    /// Window entries of the uniform-x matmuls.
    windows: wgpu::Buffer,
    /// Buffers only the bind groups use.
    keep: Vec<wgpu::Buffer>,
}

impl Scratch {
    fn new(
        g: &Gpu,
        cfg: &ModelConfig,
        limits: &StepLimits,
        layout: &StepLayout,
        plan: &ScratchPlan,
        last: bool,
    ) -> Scratch {
        let f = |n: usize| (n * 4) as u64;
        let t_max = layout.t_max;
        // Only the last stage samples: the others get placeholders for its buffers.
        let result_bytes = (plan.s_last * SAMPLE_RESULT_STRIDE * 4) as u64;
        let cs = rope_table(cfg.rope_theta, cfg.head_dim, limits.max_seq_len, &cfg.rope_scaling);
        let s = Scratch {
            step_buf: g.uniform_init("step", bytemuck::bytes_of(&layout.header)),
            meta_buf: g.storage("meta", (layout.meta_len * 4) as u64),
            adjust_buf: g.storage("adjust", if last { (layout.adjust_cap * 16) as u64 } else { 16 }),
            hidden: g.storage("hidden", f(t_max * cfg.hidden)),
            normed: g.activation("normed", f(t_max * cfg.hidden)),
            qkv: g.storage("qkv", f(t_max * cfg.qkv_dim())),
            attn: g.activation("attn", f(t_max * cfg.q_dim())),
            act: g.activation("act", f(t_max * cfg.intermediate)),
            // Logits and sampler results only on the last stage; hidden states leave the others.
            final_normed: g.activation("final_normed", f(plan.s_last * cfg.hidden)),
            logits: g.storage("logits", f(plan.s_last * cfg.vocab)),
            result: g.storage("result", result_bytes),
            readback: g.readback("result_readback", result_bytes),
            hidden_readback: (!last).then(|| g.readback("hidden_readback", f(t_max * cfg.hidden))),
            part: g.storage("attn_partials", plan.part_vec4 as u64 * 16),
            cos_sin: g.storage_init("cos_sin", bytemuck::cast_slice(&cs)),
            dummy: g.storage("dummy", 16),
            windows: g.uniform_init("windows", bytemuck::cast_slice(&window_entries(t_max + 1, window_stride(g)))),
            keep: Vec::new(),
        };
        let keep = vec![
            s.normed.clone(),
            s.qkv.clone(),
            s.attn.clone(),
            s.act.clone(),
            s.final_normed.clone(),
            s.part.clone(),
            s.cos_sin.clone(),
            s.dummy.clone(),
            s.windows.clone(),
        ];
        Scratch { keep, ..s }
    }
}

/// Per-layer uniform parameters, shared by every layer's ops.
struct LayerParams {
    norm: wgpu::Buffer,
    rope: wgpu::Buffer,
    attn: wgpu::Buffer,
    head_norm: wgpu::Buffer,
    /// The final norm's (gathers the sampled rows).
    final_norm: wgpu::Buffer,
}

impl LayerParams {
    fn new(b: &mut OpBuilder, limits: &StepLimits, kv: &KvPlan, off_sample: usize) -> LayerParams {
        let cfg = b.cfg;
        let chunk = kv.chunk_elems(cfg, limits.block_size);
        let norm = |gather: bool| [(cfg.hidden / 4) as u32, cfg.rms_eps.to_bits(), gather as u32, off_sample as u32];
        LayerParams {
            norm: b.uniform(&norm(false)),
            rope: b.uniform(&rope_params(cfg.heads, cfg.kv_heads, cfg.head_dim, chunk)),
            attn: b.uniform(&attn_params(
                (cfg.heads, cfg.kv_heads, cfg.head_dim),
                limits.block_size,
                cfg.sliding_window.unwrap_or(0),
                chunk,
            )),
            head_norm: b.uniform(&head_norm_params(cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.rms_eps)),
            final_norm: b.uniform(&norm(true)),
        }
    }
}

/// Builds a stage's ops: uploads weights, creates parameter buffers and bind groups.
struct OpBuilder<'a> {
    g: &'a Gpu,
    cfg: &'a ModelConfig,
    kernels: &'a Kernels,
    s: &'a Scratch,
    /// Max storage binding (weights are split into row chunks within it).
    mb: u64,
    uniform_x: bool,
    ops: Vec<Op>,
    /// Parameter and weight buffers the bind groups use.
    keep: Vec<wgpu::Buffer>,
    matrices: Vec<GpuMatrix>,
}

impl OpBuilder<'_> {
    fn uniform(&mut self, words: &[u32]) -> wgpu::Buffer {
        let b = self.g.uniform_init("params", bytemuck::cast_slice(words));
        self.keep.push(b.clone());
        b
    }

    fn storage(&mut self, label: &str, v: &[f32]) -> wgpu::Buffer {
        let b = self.g.storage_init(label, bytemuck::cast_slice(v));
        self.keep.push(b.clone());
        b
    }

    fn push(&mut self, kind: OpKind, bind: wgpu::BindGroup) {
        self.ops.push(Op { kind, bind, bind_u: None });
    }

    fn upload(&self, label: &str, t: &QTensor, pair: Option<&QTensor>) -> Result<GpuMatrix> {
        GpuMatrix::upload(self.g, label, t, pair, self.mb)
    }

    /// The embedding lookup, one op per row-chunk of the table.
    fn embed(&mut self, e: &GpuMatrix) {
        let kb = (self.cfg.hidden / 32) as u32;
        for c in &e.chunks {
            let p = self.uniform(&[kb, c.rows as u32, c.row0 as u32, 0]);
            let s = self.s;
            let bind = self.kernels.matmul_family.bind(
                self.g,
                &[(0, &s.step_buf), (1, &p), (2, &s.meta_buf), (3, &c.q), (4, &c.s), (5, &s.dummy), (6, &s.hidden)],
            );
            self.push(OpKind::Embed { format: e.format, k_blocks: kb }, bind);
        }
    }

    /// Matmul ops for every chunk of `m`, reading x into columns col0.. of y (rows of y_stride
    /// floats); `flags`: MAT_* (MAT_BIAS needs `bias`).
    #[allow(clippy::too_many_arguments)]
    fn matmul(
        &mut self,
        m: &GpuMatrix,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        (col0, y_stride): (usize, usize),
        bias: Option<&wgpu::Buffer>,
        flags: u32,
        sampled: bool,
        swiglu: bool,
    ) {
        let (g, s) = (self.g, self.s);
        for c in &m.chunks {
            let p = MatParams::new(m.cols, c, col0, y_stride, sampled, flags);
            let pb = g.uniform_init("matmul_params", bytemuck::bytes_of(&p));
            // A chunked bias is bound whole; the chunk's row0 offsets into it.
            let entries =
                [(0, &s.step_buf), (1, &pb), (2, x), (3, &c.q), (4, &c.s), (5, bias.unwrap_or(&s.dummy)), (6, y)];
            let bind = self.kernels.matmul_family.bind(g, &entries);
            let bind_u = self.uniform_x.then(|| self.kernels.matmul_u_family.bind_uniform_x(g, &entries, &s.windows));
            let (rows, x_vec4) = (c.rows as u32, (m.cols / 4) as u32);
            self.ops.push(Op {
                kind: OpKind::Matmul { format: m.format, rows, x_vec4, sampled, swiglu },
                bind,
                bind_u,
            });
            self.keep.push(pb);
        }
    }

    /// One transformer layer: RMSNorm, q/k/v (one matmul, or one per format), Qwen3's q/k norm,
    /// RoPE + KV write, attention, output projection with the residual add, RMSNorm, SwiGLU
    /// (fused, or gate then up), down projection with the residual add.
    fn layer(&mut self, hl: &HostLayer, lp: &LayerParams, k: &[wgpu::Buffer], v: &[wgpu::Buffer]) -> Result<()> {
        let (g, cfg, s, kern) = (self.g, self.cfg, self.s, self.kernels);
        let attn_norm = self.storage("attn_norm", &hl.attn_norm);
        let ffn_norm = self.storage("ffn_norm", &hl.ffn_norm);
        // q, k and v in one matmul when they share a format (K-quant files often store v in
        // another), else three writing their columns of the qkv rows.
        let qkv_ms: Vec<(GpuMatrix, usize)> = if hl.q.format == hl.k.format && hl.k.format == hl.v.format {
            vec![(self.upload("qkv", &QTensor::concat_rows(&[&hl.q, &hl.k, &hl.v])?, None)?, 0)]
        } else {
            vec![
                (self.upload("q_proj", &hl.q, None)?, 0),
                (self.upload("k_proj", &hl.k, None)?, cfg.q_dim()),
                (self.upload("v_proj", &hl.v, None)?, cfg.q_dim() + cfg.kv_dim()),
            ]
        };
        let o_m = self.upload("o_proj", &hl.o, None)?;
        // Gate and up fused into one SwiGLU matmul when they share a format; else the gate is
        // written to act and the up projection's epilogue applies silu(gate) * up.
        let (gu_m, up_m) = if hl.gate.format == hl.up.format {
            (self.upload("gate_up", &hl.gate, Some(&hl.up))?, None)
        } else {
            (self.upload("gate", &hl.gate, None)?, Some(self.upload("up", &hl.up, None)?))
        };
        let down_m = self.upload("down", &hl.down, None)?;
        let bias = hl.qkv_bias.as_ref().map(|b| self.storage("qkv_bias", b));

        let bind_norm = |w: &wgpu::Buffer, out: &wgpu::Buffer| {
            kern.norm_family
                .bind(g, &[(0, &s.step_buf), (1, &lp.norm), (2, &s.hidden), (3, w), (4, &s.meta_buf), (5, out)])
        };
        self.push(OpKind::Norm { sampled: false }, bind_norm(&attn_norm, &s.normed));
        let bias_flag = if bias.is_some() { MAT_BIAS } else { 0 };
        for (m, col0) in &qkv_ms {
            self.matmul(m, &s.normed, &s.qkv, (*col0, cfg.qkv_dim()), bias.as_ref(), bias_flag, false, false);
        }
        if let Some(w) = &hl.qk_norm {
            let wb = self.storage("qk_norm", w);
            let bind = kern.head_norm_family.bind(g, &[(0, &s.step_buf), (1, &lp.head_norm), (2, &wb), (3, &s.qkv)]);
            self.push(OpKind::HeadNorm { heads: (cfg.heads + cfg.kv_heads) as u32 }, bind);
        }
        let rope_bind = kern.rope_family.bind(
            g,
            &kv_entries(
                vec![(0, &s.step_buf), (1, &lp.rope), (2, &s.meta_buf), (3, &s.cos_sin), (4, &s.qkv)],
                (5, 6),
                k,
                v,
            ),
        );
        self.push(OpKind::RopeKv { threads: rope_threads(1, cfg.heads, cfg.kv_heads, cfg.head_dim) }, rope_bind);
        let attn_bind = kern.attn_family.bind(
            g,
            &kv_entries(
                vec![(0, &s.step_buf), (1, &lp.attn), (2, &s.meta_buf), (3, &s.qkv), (6, &s.attn), (7, &s.part)],
                (4, 5),
                k,
                v,
            ),
        );
        let (heads, kv_heads, hd4) = (cfg.heads as u32, cfg.kv_heads as u32, (cfg.head_dim / 4) as u32);
        self.push(OpKind::Attention { heads, kv_heads, hd4 }, attn_bind);
        self.matmul(&o_m, &s.attn, &s.hidden, (0, cfg.hidden), None, MAT_ACCUMULATE, false, false);
        self.push(OpKind::Norm { sampled: false }, bind_norm(&ffn_norm, &s.normed));
        let ffn = (0, cfg.intermediate);
        match &up_m {
            None => self.matmul(&gu_m, &s.normed, &s.act, ffn, None, 0, false, true),
            Some(up) => {
                self.matmul(&gu_m, &s.normed, &s.act, ffn, None, 0, false, false);
                self.matmul(up, &s.normed, &s.act, ffn, None, MAT_SWIGLU_UP, false, false);
            }
        }
        self.matmul(&down_m, &s.act, &s.hidden, (0, cfg.hidden), None, MAT_ACCUMULATE, false, false);
        self.matrices.extend(qkv_ms.into_iter().map(|(m, _)| m));
        self.matrices.extend([o_m, gu_m, down_m]);
        self.matrices.extend(up_m);
        Ok(())
    }

    /// The last stage's head: the final norm of the sampled rows, the LM head (the embedding
    /// when tied), the logit adjustments and the sampler.
    fn head(&mut self, host: &HostModel, embed: Option<GpuMatrix>, lp: &LayerParams, off_params: usize) -> Result<()> {
        let (g, cfg, s, kern) = (self.g, self.cfg, self.s, self.kernels);
        let final_norm = self.storage("final_norm", &host.final_norm);
        let bind = kern.norm_family.bind(
            g,
            &[
                (0, &s.step_buf),
                (1, &lp.final_norm),
                (2, &s.hidden),
                (3, &final_norm),
                (4, &s.meta_buf),
                (5, &s.final_normed),
            ],
        );
        self.push(OpKind::Norm { sampled: true }, bind);
        let lm = match (&host.lm_head, embed) {
            (Some(t), _) if !host.tied => self.upload("lm_head", t, None)?,
            (_, Some(e)) if host.tied => e,
            _ => bail!("the output projection was not loaded from {}", host.source.display()),
        };
        self.matmul(&lm, &s.final_normed, &s.logits, (0, cfg.vocab), None, 0, true, false);
        let sp = self.uniform(&[cfg.vocab as u32, off_params as u32, 0, 0]);
        let adjust = kern
            .sample_family
            .bind(g, &[(0, &s.step_buf), (1, &sp), (2, &s.meta_buf), (3, &s.adjust_buf), (4, &s.logits)]);
        self.push(OpKind::LogitAdjust, adjust);
        let sample =
            kern.sample_family.bind(g, &[(0, &s.step_buf), (1, &sp), (2, &s.meta_buf), (3, &s.logits), (4, &s.result)]);
        self.push(OpKind::Sample, sample);
        self.matrices.push(lm);
        Ok(())
    }
}

impl Model {
    /// The whole model on one device.
    pub fn new(gpu: Arc<Gpu>, host: &HostModel, limits: StepLimits) -> Result<Model> {
        Model::new_stage(gpu, host, limits, 0..host.cfg.layers)
    }

    /// Layers `layers` of `host` on one device (a pipeline stage): the step layout and its
    /// binding limits, the KV cache, the memory plan (checked before anything is allocated), the
    /// scratch buffers, then the ops of the embedding, every layer and the head.
    pub fn new_stage(
        gpu: Arc<Gpu>,
        host: &HostModel,
        mut limits: StepLimits,
        layers: std::ops::Range<usize>,
    ) -> Result<Model> {
        let cfg = host.cfg.clone();
        if layers.start >= layers.end || layers.end > cfg.layers {
            bail!("stage layers {}..{} are outside the model's {} layers", layers.start, layers.end, cfg.layers);
        }
        if !host.holds(&layers) {
            bail!("layers {}..{} were not loaded from {}", layers.start, layers.end, host.source.display());
        }
        let (first, last) = (layers.start == 0, layers.end == cfg.layers);
        if limits.max_binding == 0 || limits.max_binding > gpu.max_binding {
            limits.max_binding = gpu.max_binding;
        }
        limits.max_seqs = limits.max_seqs.min(limits.max_tokens).max(1);
        limits.sliding_window = cfg.sliding_window;
        limits.profile = limits.profile.resolve(gpu.info.device_type);
        let g = &*gpu;

        let layout = StepLayout::new(&cfg, &limits, last)?;
        let kv_plan = KvPlan::new(&cfg, &limits, g.kv_chunk_limit(), layout.header.max_blocks as usize)?;
        let scratch_plan = ScratchPlan::new(&cfg, &limits, &layout, last);
        let plan = MemoryPlan {
            weights: stage_weight_bytes(host, &layers),
            kv_cache: kv_plan.bytes_per_layer() * layers.len() as u64,
            scratch: scratch_plan.bytes(),
        };
        if let Some(mem) = g.memory_limit.filter(|&m| plan.total() > m) {
            let mib = |b: u64| b >> 20;
            bail!(
                "the model does not fit on {}: it needs {plan}, the device has {} MiB; lower total_cache_size \
                 (the KV cache, now {} MiB) or max_num_batched_tokens / max_decode_batch_size (the scratch), use a \
                 smaller quantization, or split the layers over pipeline stages",
                g.describe(),
                mib(mem),
                mib(plan.kv_cache)
            );
        }
        let kv = kv_plan.allocate(g, layers.len(), limits.block_size);
        let kernels = Kernels::new(
            g,
            &KernelSpec {
                formats: host.formats(),
                head_dim: cfg.head_dim as u32,
                group: (cfg.heads / cfg.kv_heads.max(1)) as u32,
                kv: limits.kv_dtype,
                kv_chunks: kv_plan.chunks,
                profile: limits.profile,
            },
        )?;
        let scratch = Scratch::new(g, &cfg, &limits, &layout, &scratch_plan, last);

        let mut b = OpBuilder {
            g,
            cfg: &cfg,
            kernels: &kernels,
            s: &scratch,
            mb: limits.max_binding,
            // TORUS_NO_UNIFORM_X=1 turns the uniform-x matmul variant off (for comparisons).
            uniform_x: g.uniform_x_ok() && std::env::var_os("TORUS_NO_UNIFORM_X").is_none(),
            ops: Vec::new(),
            keep: Vec::new(),
            matrices: Vec::new(),
        };
        let embed = match (&host.embed, first || (last && host.tied)) {
            (Some(t), true) => Some(GpuMatrix::upload(g, "embed", t, None, limits.max_binding)?),
            (None, true) => bail!("the embedding was not loaded from {}", host.source.display()),
            (_, false) => None,
        };
        if let Some(e) = embed.as_ref().filter(|_| first) {
            b.embed(e);
        }
        let lp = LayerParams::new(&mut b, &limits, &kv_plan, layout.off_sample);
        for (l, hl) in host.layer_slice(&layers).iter().enumerate() {
            b.layer(hl, &lp, &kv.k[l], &kv.v[l])?;
        }
        if last {
            b.head(host, embed, &lp, layout.off_params)?;
        } else {
            b.matrices.extend(embed);
        }
        let OpBuilder { ops, keep, matrices, .. } = b;

        Ok(Model {
            cfg,
            gpu: gpu.clone(),
            limits,
            layers,
            kv,
            plan,
            kernels,
            ops,
            meta_scratch: vec![0; layout.meta_len],
            adjust_scratch: Vec::new(),
            adjust_cap: layout.adjust_cap,
            part_vec4: scratch_plan.part_vec4,
            record: RecordParams::new(g),
            header: layout.header,
            sub_tokens: layout.t_max,
            sub_seqs: layout.s_max,
            off_sample: layout.off_sample,
            off_params: layout.off_params,
            step_buf: scratch.step_buf,
            meta_buf: scratch.meta_buf,
            adjust_buf: scratch.adjust_buf,
            logits: scratch.logits,
            result: scratch.result,
            readback: scratch.readback,
            hidden: scratch.hidden,
            hidden_readback: scratch.hidden_readback,
            _keep: [keep, scratch.keep].concat(),
            _matrices: matrices,
            provoke_gpu_error: false,
        })
    }

    /// What a step given to this model may hold.
    pub fn bounds(&self) -> StepBounds {
        StepBounds {
            max_tokens: self.limits.max_tokens,
            max_seqs: self.limits.max_seqs,
            max_seq_len: self.limits.max_seq_len,
            block_size: self.limits.block_size,
            num_blocks: self.kv.num_blocks,
            max_blocks: self.header.max_blocks as usize,
            adjust_cap: self.adjust_cap,
            vocab: self.cfg.vocab,
            hidden: self.cfg.hidden,
            first: self.is_first(),
        }
    }

    /// Most tokens and sampled rows one sub-step holds: a larger step runs as several.
    pub fn sub_step_limits(&self) -> (usize, usize) {
        (self.sub_tokens, self.sub_seqs)
    }

    pub fn is_first(&self) -> bool {
        self.layers.start == 0
    }

    pub fn is_last(&self) -> bool {
        self.layers.end == self.cfg.layers
    }

    /// Runs one forward step of the whole model and samples one token per sample row.
    pub fn step(&mut self, s: &StepInput) -> Result<Vec<Sampled>> {
        match self.run(s, None)? {
            StageOutput::Sampled(r) => Ok(r),
            StageOutput::Hidden(_) => bail!("step() needs the whole model; this stage holds layers {:?}", self.layers),
        }
    }

    /// Runs this stage's part of one step. `hidden` is the previous stage's output ([tokens,
    /// hidden] f32 bytes), required unless this is the first stage.
    ///
    /// Checked before anything is written; the GPU work runs inside error scopes, so a wgpu
    /// error or a lost device fails this call (`GpuFault`) instead of passing unnoticed.
    pub fn run(&mut self, s: &StepInput, hidden: Option<&[u8]>) -> Result<StageOutput> {
        // Nothing reaches the device before the whole step is known to stay inside this
        // model's cache and buffers.
        self.bounds().check(s, hidden.map(<[u8]>::len))?;
        let gpu = self.gpu.clone();
        gpu.scoped(|| {
            if std::mem::take(&mut self.provoke_gpu_error) {
                gpu.provoke_validation_error();
            }
            self.run_checked(s, hidden)
        })
    }

    fn run_checked(&mut self, s: &StepInput, hidden: Option<&[u8]>) -> Result<StageOutput> {
        let ranges = sub_steps(&s.sample_rows, s.tokens.len(), self.sub_tokens, self.sub_seqs);
        if ranges.len() == 1 {
            return self.run_one(s, hidden);
        }
        // Sub-steps in token order; each samples the rows that fall in it.
        let row = self.cfg.hidden * 4;
        let mut hidden_out = Vec::new();
        let mut sampled: Vec<(usize, Sampled)> = Vec::new();
        for (a, b) in ranges {
            let pick: Vec<usize> =
                (0..s.sample_rows.len()).filter(|&i| (a..b).contains(&(s.sample_rows[i] as usize))).collect();
            let sub = StepInput {
                tokens: s.tokens[a..b].to_vec(),
                positions: s.positions[a..b].to_vec(),
                slots: s.slots[a..b].to_vec(),
                seq_of_token: s.seq_of_token[a..b].to_vec(),
                block_tables: s.block_tables.clone(),
                sample_rows: pick.iter().map(|&i| s.sample_rows[i] - a as u32).collect(),
                sampling: pick.iter().map(|&i| s.sampling[i].clone()).collect(),
            };
            match self.run_one(&sub, hidden.map(|h| &h[a * row..b * row]))? {
                StageOutput::Hidden(h) => hidden_out.extend(h),
                StageOutput::Sampled(r) => sampled.extend(pick.into_iter().zip(r)),
            }
        }
        if !self.is_last() {
            return Ok(StageOutput::Hidden(hidden_out));
        }
        sampled.sort_by_key(|(i, _)| *i);
        Ok(StageOutput::Sampled(sampled.into_iter().map(|(_, r)| r).collect()))
    }

    /// One sub-step: at most `sub_tokens` tokens and `sub_seqs` sampled rows.
    fn run_one(&mut self, s: &StepInput, hidden: Option<&[u8]>) -> Result<StageOutput> {
        let want = s.tokens.len() * self.cfg.hidden * 4;
        match (self.is_first(), hidden) {
            (true, None) => {}
            (false, Some(h)) if h.len() == want => self.gpu.queue.write_buffer(&self.hidden, 0, h),
            (false, Some(h)) => {
                bail!("hidden states of {} bytes, expected {want} ({} tokens)", h.len(), s.tokens.len())
            }
            (false, None) => bail!("stage {:?} needs the previous stage's hidden states", self.layers),
            (true, Some(_)) => bail!("the first stage embeds tokens itself; it takes no hidden states"),
        }
        let n = s.tokens.len() as u32;
        let ns = s.sample_rows.len() as u32;
        self.header.n_tokens = n;
        self.header.n_sample = ns;
        self.header.n_seqs = s.block_tables.len() as u32;
        let cfg = &self.cfg;
        // Keys the longest-reaching token attends to (its window, with a sliding window).
        let max_keys = s.positions.iter().max().map_or(1, |&p| p as usize + 1);
        let max_keys = cfg.sliding_window.map_or(max_keys, |w| max_keys.min(w.max(1)));
        self.header.n_splits =
            attention_splits(n as usize, max_keys, (cfg.heads, cfg.kv_heads, cfg.head_dim / 4), self.part_vec4);
        let h = self.header;
        // Reused every step: no per-step allocation of the metadata or adjustment words.
        let meta = &mut self.meta_scratch;
        let t = self.sub_tokens;
        meta[..n as usize].copy_from_slice(&s.tokens);
        meta[t..t + n as usize].copy_from_slice(&s.positions);
        meta[2 * t..2 * t + n as usize].copy_from_slice(&s.slots);
        meta[3 * t..3 * t + n as usize].copy_from_slice(&s.seq_of_token);
        let adjust = &mut self.adjust_scratch;
        adjust.clear();
        // Sample rows, their parameters and logit adjustments matter to the last stage only.
        if self.layers.end == self.cfg.layers {
            meta[self.off_sample..self.off_sample + ns as usize].copy_from_slice(&s.sample_rows);
            for (i, p) in s.sampling.iter().enumerate() {
                let b = self.off_params + SAMPLE_PARAMS_STRIDE * i;
                meta[b..b + SAMPLE_PARAMS_STRIDE].copy_from_slice(&p.words((adjust.len() / 4) as u32));
                p.push_adjust(adjust);
            }
        }
        let mb = h.max_blocks as usize;
        for (i, tbl) in s.block_tables.iter().enumerate() {
            let b = h.off_table as usize + i * mb;
            meta[b..b + tbl.len()].copy_from_slice(tbl);
            meta[b + tbl.len()..b + mb].fill(0);
        }
        let g = &self.gpu;
        // Only the used part of the tables is uploaded.
        let used = h.off_table as usize + s.block_tables.len() * mb;
        g.queue.write_buffer(&self.meta_buf, 0, bytemuck::cast_slice(&meta[..used]));
        g.queue.write_buffer(&self.step_buf, 0, bytemuck::bytes_of(&h));
        if !adjust.is_empty() {
            g.queue.write_buffer(&self.adjust_buf, 0, bytemuck::cast_slice(adjust));
        }
        let any_adjust = !adjust.is_empty();

        let mut enc = g.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            let RecordParams { align, win_stride } = self.record;
            let rec = Recorder { kernels: &self.kernels, gpu: g, align, win_stride, tile_override: None };
            let shape = StepShape { n_tokens: n, n_sample: ns, n_splits: h.n_splits, any_adjust };
            for op in &self.ops {
                op.dispatches(&rec, &shape, |d| d.record(&mut pass));
            }
        }
        if let Some(rb) = &self.hidden_readback {
            enc.copy_buffer_to_buffer(&self.hidden, 0, rb, 0, want as u64);
            g.queue.submit([enc.finish()]);
            return Ok(StageOutput::Hidden(g.read_mapped(rb, want as u64)?));
        }
        if ns == 0 {
            g.queue.submit([enc.finish()]);
            return Ok(StageOutput::Sampled(vec![]));
        }
        // Read back only as many words per row as the rows asked for.
        let max_top = s.sampling.iter().map(|p| p.n_top.min(MAX_TOP_LOGPROBS as u32)).max().unwrap_or(0) as usize;
        let len = (((ns as usize - 1) * SAMPLE_RESULT_STRIDE + 2 + 2 * max_top) * 4) as u64;
        enc.copy_buffer_to_buffer(&self.result, 0, &self.readback, 0, len);
        g.queue.submit([enc.finish()]);
        let bytes = g.read_mapped(&self.readback, len)?;
        // A Vec<u8> need not be 4-byte aligned: copy into words rather than cast in place.
        let words: Vec<u32> = bytemuck::pod_collect_to_vec(&bytes);
        Ok(StageOutput::Sampled(
            s.sampling
                .iter()
                .enumerate()
                .map(|(i, p)| Sampled::parse(&words[i * SAMPLE_RESULT_STRIDE..], p.n_top))
                .collect(),
        ))
    }

    /// Runs a step of each matmul tile's size on scratch block 0 so every pipeline is
    /// compiled by the driver before the first request (Mesa compiles at first dispatch).
    pub fn warm_up(&mut self) -> Result<()> {
        for (tm, _) in MATMUL_TILES {
            let len = (tm as usize).min(self.limits.max_tokens).min(self.limits.block_size);
            let pos: Vec<u32> = (0..len as u32).collect();
            let hidden = (!self.is_first()).then(|| vec![0u8; len * self.cfg.hidden * 4]);
            let step = StepInput {
                tokens: vec![0; len],
                positions: pos.clone(),
                slots: pos,
                seq_of_token: vec![0; len],
                block_tables: vec![vec![0]],
                sample_rows: vec![len as u32 - 1],
                sampling: vec![SampleParams {
                    temperature: 1.0,
                    top_p: 0.9,
                    top_k: 5,
                    min_p: 0.05,
                    u: 0.5,
                    n_top: 2,
                    adjust: vec![Adjust { id: 1, count: 1, in_prompt: true, bias: 0.5 }],
                    repetition_penalty: 1.1,
                    ..Default::default()
                }],
            };
            self.run(&step, hidden.as_deref())?;
        }
        // Every pipeline is compiled now: keep the driver's cache for the next start.
        self.gpu.save_pipeline_cache();
        Ok(())
    }

    /// The logits of the last step's sampled rows, [n_sample, vocab] (tests and tools); of a step
    /// run in sub-steps, those of the last sub-step's rows.
    pub fn last_logits(&self, n_sample: usize) -> Result<Vec<f32>> {
        self.gpu.download_f32(&self.logits, n_sample * self.cfg.vocab)
    }
}
