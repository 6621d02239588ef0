//! What a model (or stage) allocates on its device: the KV cache's blocks and chunks, the
//! step metadata layout and sub-step sizes, the scratch buffers' sizes, and the memory plan
//! that sums them.

use crate::config::KernelProfile;
use crate::gpu::shared::StepHeader;
use crate::gpu::Gpu;
use crate::model::config::ModelConfig;
use crate::model::loader::HostModel;
use crate::model::step::*;
use crate::sampling::row::*;
use crate::sampling::row::{SAMPLE_PARAMS_STRIDE, SAMPLE_RESULT_STRIDE};
use anyhow::{bail, Result};

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
    /// Recurrent-state slots (models with recurrent layers).
    pub state: u64,
    /// Activations, logits, RoPE table, step metadata and logit adjustments.
    pub scratch: u64,
}

impl MemoryPlan {
    pub fn total(&self) -> u64 {
        self.weights + self.kv_cache + self.state + self.scratch
    }
}

impl std::fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        write!(f, "weights {:.1} MiB + KV cache {:.1} MiB", mib(self.weights), mib(self.kv_cache))?;
        if self.state > 0 {
            write!(f, " + recurrent states {:.1} MiB", mib(self.state))?;
        }
        write!(f, " + scratch {:.1} MiB = {:.1} MiB", mib(self.scratch), mib(self.total()))
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

/// Bytes of one KV block of one layer (K or V).
pub fn kv_block_bytes(cfg: &ModelConfig, limits: &StepLimits) -> u64 {
    (limits.block_size * cfg.kv_dim() * limits.kv_dtype.bytes()) as u64
}

/// K and V floats per token of each attention layer among `range` (layers differ in Gemma 4).
/// (Layers that read another layer's cache, Gemma 4's KV sharing, own none.)
pub fn kv_dims(cfg: &ModelConfig, range: std::ops::Range<usize>) -> Vec<usize> {
    range.filter(|&l| !cfg.is_linear(l) && cfg.kv_source(l).is_none()).map(|l| cfg.geom(l).kv_dim()).collect()
}

/// KV blocks of one layer's cache: `cache_bytes` spread over every attention layer of the model,
/// each block holding its layer's K and V (all stages of a pipeline agree; recurrent layers keep
/// no KV cache).
pub fn kv_blocks(cfg: &ModelConfig, limits: &StepLimits) -> usize {
    let floats: usize = kv_dims(cfg, 0..cfg.layers).iter().sum();
    // A model whose layers are all recurrent (a few layers of a hybrid) may still attend in its
    // MTP head: its blocks are sized as for one attention layer, not left unbounded.
    let floats = if floats == 0 { cfg.kv_dim() } else { floats };
    let per_block = (2 * limits.block_size * floats.max(1) * limits.kv_dtype.bytes()) as u64;
    (limits.cache_bytes / per_block) as usize
}

/// Adjustment entries one sampled row may take: one per token of its sequence (penalties), its
/// logit-bias entries, and its token mask (four words per entry).
pub(crate) fn adjust_per_row(vocab: usize, limits: &StepLimits) -> usize {
    limits.max_seq_len + MAX_LOGIT_BIAS + vocab.div_ceil(32).div_ceil(4)
}

/// The step metadata layout and the rows of one sub-step: at most `t_max` tokens and `s_max`
/// sampled rows, so every activation, logits and adjustment buffer fits one storage binding.
pub(crate) struct StepLayout {
    pub(crate) t_max: usize,
    pub(crate) s_max: usize,
    pub(crate) header: StepHeader,
    pub(crate) off_sample: usize,
    pub(crate) off_params: usize,
    /// Where each sequence's recurrent-state record starts (ops/delta.rs's STATE_RECORD words).
    pub(crate) off_state: usize,
    pub(crate) meta_len: usize,
    /// Logit adjustments: up to one entry per token of every sampled sequence, plus its
    /// logit-bias entries.
    pub(crate) adjust_cap: usize,
}

impl StepLayout {
    /// `loop_tokens`: the most tokens a sub-step's kernels keep within the device's loop limit
    /// (`Model::loop_tokens`; usize::MAX where none).
    pub(crate) fn new(cfg: &ModelConfig, limits: &StepLimits, last: bool, loop_tokens: usize) -> Result<StepLayout> {
        let mb = limits.max_binding;
        let (t_all, s_all) = (limits.max_tokens, limits.max_seqs);
        let max_blocks = limits.max_seq_len.div_ceil(limits.block_size);
        // A step runs in sub-steps of at most `t_max` tokens and `s_max` sampled rows (a
        // 2048-token step of a 7B model's 18944-wide FFN does not fit one binding). Sub-steps
        // run in token order, so a token still sees every earlier token's K/V: the result is
        // the whole step's.
        let f = |n: usize| (n * 4) as u64;
        // MoE: the router's logits, the route words (per token about 4 per choice), the pairs'
        // down projections.
        let moe = cfg.moe.as_ref().map_or(0, |m| m.experts.max(4 * m.top_k + m.experts).max(m.top_k * cfg.hidden));
        let lin = crate::model::scratch::lin_width(cfg)
            .max(crate::model::scratch::lin_out_width(cfg))
            .max(crate::model::scratch::lin_chunk_width(cfg));
        let widest = cfg.hidden.max(cfg.qkv_dim()).max(cfg.q_dim()).max(cfg.act_width()).max(moe).max(lin);
        let widest = widest.max(cfg.layers * cfg.ple_dim());
        let t_max = t_all.min((mb / f(widest)) as usize).min(loop_tokens);
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
            // Every sequence of the step has its block table (and state record) in every sub-step.
            off_state: 4 * t_max + (1 + ps) * s_max + s_all * max_blocks,
            meta_len: 4 * t_max + (1 + ps) * s_max + s_all * (max_blocks + crate::ops::delta::STATE_RECORD),
            adjust_cap: s_max * adjust_per_row(cfg.vocab, limits),
        })
    }
}

/// The KV cache's size: blocks per layer ([block_size, kv_heads, head_dim] each, K and V, f16 or
/// f32), spread over `chunks` buffers of `blocks_per_chunk` whole blocks within the binding limit.
pub(crate) struct KvPlan {
    /// Bytes of one cached element.
    pub(crate) elem_bytes: usize,
    pub(crate) num_blocks: usize,
    pub(crate) blocks_per_chunk: usize,
    pub(crate) chunks: usize,
}

impl KvPlan {
    pub(crate) fn new(cfg: &ModelConfig, limits: &StepLimits, max_chunks: usize, max_blocks: usize) -> Result<KvPlan> {
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
        Ok(KvPlan { elem_bytes: limits.kv_dtype.bytes(), num_blocks, blocks_per_chunk, chunks })
    }

    /// Bytes of the K and V caches of layers with `kv_dims` floats per token each.
    pub(crate) fn bytes(&self, kv_dims: &[usize], block_size: usize) -> u64 {
        kv_dims.iter().map(|&d| (self.num_blocks * block_size * d * self.elem_bytes * 2) as u64).sum()
    }

    /// Elements of one chunk buffer of a layer with `kv_dim` K (or V) floats per token.
    pub(crate) fn chunk_elems(&self, kv_dim: usize, block_size: usize) -> usize {
        self.blocks_per_chunk * block_size * kv_dim
    }

    /// The caches of layers with `kv_dims` K (or V) floats per token each.
    pub(crate) fn allocate(&self, g: &Gpu, kv_dims: &[usize], block_size: usize) -> KvCache {
        let chunk_buffers = |name: &str, kv_dim: usize| -> Vec<wgpu::Buffer> {
            let per_block = (block_size * kv_dim * self.elem_bytes) as u64;
            (0..self.chunks)
                .map(|c| {
                    let blocks = self.blocks_per_chunk.min(self.num_blocks - c * self.blocks_per_chunk);
                    g.storage(name, blocks as u64 * per_block)
                })
                .collect()
        };
        KvCache {
            k: kv_dims.iter().map(|&d| chunk_buffers("k_cache", d)).collect(),
            v: kv_dims.iter().map(|&d| chunk_buffers("v_cache", d)).collect(),
            num_blocks: self.num_blocks,
            block_size,
            blocks_per_chunk: self.blocks_per_chunk,
        }
    }
}

/// Bytes of a stage's weights on the device: its layers, and the embedding / final norm / LM
/// head where the stage holds them.
pub(crate) fn stage_weight_bytes(host: &HostModel, layers: &std::ops::Range<usize>) -> u64 {
    let f = |n: usize| (n * 4) as u64;
    let (first, last) = (layers.start == 0, layers.end == host.cfg.layers);
    host.layer_bytes(layers)
        // Gemma 4's per-layer embeddings (the first stage holds them).
        + host.ple.as_ref().filter(|_| first).map_or(0, |p| (p.embed.bytes() + p.model_proj.bytes()) as u64 + f(p.proj_norm.len()))
        + host.embed_info().filter(|_| first || (last && host.tied)).map_or(0, |e| e.bytes)
        + host.lm_head_info().filter(|_| last && !host.tied).map_or(0, |e| e.bytes)
        + f(host.final_norm.len())
}

/// Sizes of the scratch buffers (bytes, except where named).
pub(crate) struct ScratchPlan {
    /// Sampled rows with logits: the sub-step's on the last stage, none elsewhere (1 as a
    /// placeholder).
    pub(crate) s_last: usize,
    /// vec4s of the split attention's partial results (gpu profile; 0 on the cpu profile).
    pub(crate) part_vec4: usize,
    pub(crate) bytes: u64,
}

impl ScratchPlan {
    pub(crate) fn new(cfg: &ModelConfig, limits: &StepLimits, layout: &StepLayout, last: bool) -> ScratchPlan {
        let f = |n: usize| (n * 4) as u64;
        let (t_max, s_max) = (layout.t_max, layout.s_max);
        let s_last = if last { s_max } else { 1 };
        // Up to MAX_SPLITS key ranges of every head of every sampled row (decode-sized steps
        // split most); attention_splits aims at 1024 workgroups of (token, KV head, range), so a
        // step of n tokens writes at most n * heads * (1024 / (n * kv_heads) + 1), below 2048
        // records per query head of a KV head.
        let part_vec4 = if limits.profile == KernelProfile::Gpu {
            let splits = crate::ops::attention::MAX_SPLITS;
            let per_geom = |g: &crate::model::config::AttnGeom| {
                let records = (s_max * g.heads * splits).min(2048 * g.group() + g.heads);
                records * (g.head_dim / 4 + 1)
            };
            cfg.geoms().iter().map(per_geom).max().unwrap_or(0).min((limits.max_binding / 16) as usize)
        } else {
            0
        };
        // The MoE router's logits and route words.
        let moe = cfg.moe.as_ref().map_or(0, |m| m.experts + 4 * m.top_k + 2 * m.experts + m.top_k * cfg.hidden);
        let lin = crate::model::scratch::lin_width(cfg) + crate::model::scratch::lin_chunk_width(cfg);
        let attn = crate::model::scratch::attn_width(cfg);
        let ple = cfg.layers * cfg.ple_dim();
        let bytes = f(t_max * (2 * cfg.hidden + cfg.qkv_dim() + attn + cfg.act_width() + moe + lin + ple))
            + f(s_last * (cfg.vocab + cfg.hidden + SAMPLE_RESULT_STRIDE))
            + f(limits.max_seq_len * (cfg.rope_dim() + cfg.style.local_rope_theta.map_or(0, |_| cfg.head_dim)))
            + f(layout.meta_len)
            + part_vec4 as u64 * 16
            + if last { (layout.adjust_cap * 16) as u64 } else { 0 };
        ScratchPlan { s_last, part_vec4, bytes }
    }

    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// The most tokens a sub-step may hold so that every kernel stays within the device's loop limit
/// (`Gpu::loop_limit`: llvmpipe stops an invocation's loops silently past it): a hybrid model's
/// chunked delta rule bounds it (ops/delta.rs `max_loop_tokens`); usize::MAX on other devices.
/// The cpu profile's attention runs one loop iteration per key, so there a longest sequence whose
/// keys would pass the limit is refused.
pub(crate) fn loop_tokens(gpu: &Gpu, cfg: &ModelConfig, limits: &StepLimits) -> Result<usize> {
    let Some(limit) = gpu.loop_limit() else { return Ok(usize::MAX) };
    let hd4 = cfg.geoms().iter().map(|g| g.head_dim / 4).max().unwrap_or(0);
    let keys = limit - limit / 10 - 2 * hd4;
    if limits.profile == KernelProfile::Cpu && limits.max_seq_len > keys {
        bail!(
            "max_sequence_length {} is more than {} on {}: its attention kernel runs a loop iteration per key and \
             llvmpipe stops a kernel's loops after {limit} iterations; lower max_sequence_length",
            limits.max_seq_len,
            keys,
            gpu.info.name
        );
    }
    let chunked = limits.profile == KernelProfile::Gpu;
    Ok(cfg.linear.as_ref().map_or(usize::MAX, |l| crate::ops::delta::max_loop_tokens(l.dims.k_dim, chunked, limit)))
}
