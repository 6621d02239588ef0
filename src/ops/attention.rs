//! Paged attention over the KV cache (global, or within a sliding window): parameters,
//! bindings and constructor. The cpu profile runs attention.wgsl; the gpu profile the split-key
//! attention_split.wgsl, whose partial results (`part`) a second pass merges, and for
//! prefill-sized steps the query-tiled attention_tiled.wgsl.

use super::kernels::{GpuPipelines, Kernels};
use super::rope::kv_entries;
use super::{bindings, div_up, Dispatch, Op, OpKind, Recorder, StepShape};
use crate::gpu::shared::gpu_struct;
use crate::gpu::Gpu;

gpu_struct! {
    /// Parameters of the attention kernels (attention.wgsl, attention_split.wgsl; WGSL
    /// `AttnParams`).
    wgsl AttnParams;
    pub struct AttnParams {
        pub n_heads: u32,
        pub n_kv_heads: u32,
        pub block_size: u32,
        /// vec4s per qkv row.
        pub qkv_stride4: u32,
        pub scale: f32,
        /// Attend to the last `window` positions only (0: all).
        pub window: u32,
        /// vec4s per KV-cache buffer of a layer (when the cache spans several).
        pub kv_chunk4: u32,
        /// Scores become softcap * tanh(score / softcap) (Gemma 2), when positive.
        pub softcap: f32,
        /// 1: each head's learned sink logit (`sinks`, gpt-oss) joins its softmax's
        /// denominator; 0: no sinks.
        pub sinks: u32,
        pub _p0: u32,
        pub _p1: u32,
        pub _p2: u32,
    }
}

bindings! {
    /// attention.wgsl and attention_split.wgsl (`part` only in the split one), with the KV
    /// cache's chunks from binding 4 (K) and 5 (V) on (see `kv_entries`).
    AttnBinds {
        step: Uniform @ 0,
        p: Uniform @ 1,
        md: Read @ 2,
        qkv: Read @ 3,
        out: ReadWrite @ 6,
        part: ReadWrite @ 7,
        sinks: Read @ 8,
    }
}

/// The first K and V cache bindings of the attention kernels.
pub const ATTN_KV: (u32, u32) = (4, 5);

impl AttnParams {
    /// `window`: attend to the last `window` positions only (0: all); `kv_chunk`: elements per
    /// KV-cache buffer.
    pub fn new(
        (heads, kv_heads, head_dim): (usize, usize, usize),
        block_size: usize,
        window: usize,
        kv_chunk: usize,
    ) -> AttnParams {
        AttnParams {
            n_heads: heads as u32,
            n_kv_heads: kv_heads as u32,
            block_size: block_size as u32,
            qkv_stride4: ((heads + 2 * kv_heads) * head_dim / 4) as u32,
            scale: 1.0 / (head_dim as f32).sqrt(),
            window: window as u32,
            kv_chunk4: (kv_chunk / 4) as u32,
            softcap: 0.0,
            ..Default::default()
        }
    }

    /// With a sink logit per head (the `sinks` binding) in every softmax's denominator.
    pub fn with_sinks(self, sinks: bool) -> AttnParams {
        AttnParams { sinks: sinks as u32, ..self }
    }

    /// With the model's own score scale (Gemma's query_pre_attn_scalar^-1/2) and soft cap.
    pub fn with_scores(self, scale: Option<f32>, softcap: Option<f32>) -> AttnParams {
        AttnParams { scale: scale.unwrap_or(self.scale), softcap: softcap.unwrap_or(0.0), ..self }
    }
}

/// The attention kernels' score function after AttnParams: the soft cap, when set; and the
/// softmax's end: with sinks, head h's sink logit joins the denominator as one more score with
/// no value (gpt-oss), so the weights sum to less than 1.
pub const WGSL_SCORE: &str = "
@group(0) @binding(8) var<storage, read> sinks: array<f32>;

fn capped(s: f32) -> f32 {
    if (p.softcap > 0.0) {
        return p.softcap * tanh_c(s / p.softcap);
    }
    return s;
}

// The factor the unnormalised sum of values (relative to the running max mx, with sum of
// exponentials l) is multiplied by: 1 / l, or with head h's sink s
// exp(mx - m) / (l exp(mx - m) + exp(s - m)), m = max(mx, s).
fn normaliser(h: u32, mx: f32, l: f32) -> f32 {
    if (p.sinks == 0u) {
        return 1.0 / l;
    }
    let s = sinks[h];
    let m = max(mx, s);
    let c = exp(mx - m);
    return c / (l * c + exp(s - m));
}
";

/// The attention op over a layer's KV cache chunks `k`, `v`.
pub fn attention(
    kern: &Kernels,
    g: &Gpu,
    b: &AttnBinds,
    (k, v): (&[wgpu::Buffer], &[wgpu::Buffer]),
    (heads, kv_heads, head_dim): (usize, usize, usize),
) -> Op {
    let bind = kern.attn_family.bind(g, &kv_entries(b.entries(), ATTN_KV, k, v));
    let kind = OpKind::Attention { heads: heads as u32, kv_heads: kv_heads as u32, hd4: (head_dim / 4) as u32 };
    Op { kind, label: kind.family(), bind, bind_x: None }
}

/// Most key ranges per (token, KV head) of the split attention.
pub const MAX_SPLITS: usize = 64;
/// Fewest keys per range (a range's tile of 64 keys is then a quarter full).
pub const MIN_SPLIT_KEYS: usize = 16;

/// Key ranges per (token, KV head) of the split attention: enough workgroups to fill a large GPU
/// (about 1024: 132 multiprocessors of an H200 with several workgroups each, at batch 1 too),
/// at least MIN_SPLIT_KEYS keys per range, at most MAX_SPLITS ranges, and partial results that
/// fit `part_vec4` vec4s (one range writes the output directly).
pub fn attention_splits(
    n_tokens: usize,
    max_keys: usize,
    (heads, kv_heads, hd4): (usize, usize, usize),
    part_vec4: usize,
) -> u32 {
    let want = 1024usize.div_ceil((n_tokens * kv_heads).max(1));
    let by_keys = max_keys.div_ceil(MIN_SPLIT_KEYS);
    let by_buffer = part_vec4 / (n_tokens * heads * (hd4 + 1)).max(1);
    want.min(by_keys).min(by_buffer).clamp(1, MAX_SPLITS) as u32
}

/// StepShape::attn_tile for a step of `n_tokens` tokens over `n_seqs` sequences: the query-tiled
/// kernel's tokens per tile when it is built (gpu profile) and the sequences have a tile of
/// tokens each on average (a prefill-sized step: tiles mostly full, each K/V row read once per
/// tile); else 0, the split kernel, whose key ranges fill the GPU at decode.
pub fn attention_tiled(kern: &Kernels, n_tokens: usize, n_seqs: usize) -> u32 {
    let qt = tiled_tokens(kern);
    if qt > 0 && n_tokens >= qt as usize * n_seqs.max(1) {
        qt
    } else {
        0
    }
}

/// Tokens per tile of the query-tiled attention these kernels have (0: none built).
pub fn tiled_tokens(kern: &Kernels) -> u32 {
    kern.gpu.as_ref().and_then(|g| g.attention_tiled.as_ref()).map_or(0, |t| t.1)
}

/// Attention's grid: on the gpu profile a workgroup per (query tile, KV head) for a tiled step,
/// else a workgroup per (token, KV head, key range), then the merge of the ranges; on the cpu
/// profile a thread per (token, head).
pub(super) fn dispatches<'a>(
    op: &'a Op,
    r: &Recorder<'a>,
    s: &StepShape,
    (heads, kv_heads, hd4): (u32, u32, u32),
    mut out: impl FnMut(Dispatch<'a>),
) {
    let n = s.n_tokens;
    let k = r.kernels;
    let geom = (hd4 * 4, heads / kv_heads.max(1));
    // A further geometry's kernels (Gemma 4's full-attention layers), else the model's own.
    let more = k.more_attn.iter().find(|m| m.geom == geom && geom != k.attn_geom);
    match (&k.gpu, more) {
        (Some(GpuPipelines { attention_tiled: Some((pipe, qt)), .. }), _) if s.attn_tile > 0 => {
            debug_assert_eq!(s.attn_tile, *qt);
            let pipe = more.and_then(|m| m.tiled.as_ref()).unwrap_or(pipe);
            out(r.folded(pipe, &op.bind, div_up(n, *qt) * kv_heads));
        }
        (Some(gk), _) => {
            let [split, combine] =
                more.and_then(|m| m.split.as_ref()).map_or([&gk.attention, &gk.combine], |[a, c]| [a, c]);
            out(r.folded(split, &op.bind, n * kv_heads * s.n_splits));
            if s.n_splits > 1 {
                out(r.folded(combine, &op.bind, div_up(n * heads * hd4, 64)));
            }
        }
        // (Without the gpu profile's kernels, the cpu profile's attention was built.)
        (None, _) => {
            if let Some(pipe) = more.map_or(k.attention.as_ref(), |m| m.cpu.as_ref()) {
                out(r.folded(pipe, &op.bind, div_up(n * heads, 32)));
            }
        }
    }
}
