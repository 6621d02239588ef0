//! Paged attention over the KV cache (global, or within a sliding window): parameters,
//! bindings and constructor. The cpu profile runs attention.wgsl; the gpu profile the split-key
//! attention_split.wgsl, whose partial results (`part`) a second pass merges, and for
//! prefill-sized steps the query-tiled attention_tiled.wgsl.

use super::cost::Cost;
use super::kv_cache::{chunk_slots, kv_entries, kv_snippet};
use super::wgsl::{common, unrolled, SG_ARGS};
use super::{bindings, div_up, Dispatch, FamilyOp, Op, OpKind, Program, Recorder, StepShape};
use crate::config::{KernelProfile, KvDtype};
use crate::gpu::family::{Family, Slot};
use crate::gpu::shader::Shader;
use crate::gpu::shared::gpu_struct;
use crate::gpu::Gpu;
use crate::gpu::MAX_KV_CHUNKS;
use anyhow::Result;

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

/// Keys per tile of the split and the tiled attention (one per invocation of their workgroups).
const ATTN_KT: u32 = 64;

/// The tile softmax's state, for G rows (query heads, or a tile's tokens times heads): the
/// tile's exponentials and each row's running max, sum and correction.
const SOFTMAX_STATE_DECL: &str = "var<workgroup> sc: array<f32, G * KT>;
var<workgroup> mstat: array<f32, G>;
var<workgroup> lstat: array<f32, G>;
var<workgroup> corr: array<f32, G>;";

/// The attention tile softmax (split and tiled kernels) with subgroup reductions: the tile's
/// max per row (subgroupMax, then one value per subgroup), every invocation's exponential,
/// their sum per row (subgroupAdd), then G invocations update the running statistics.
const SOFTMAX_SUBGROUP_DECL: &str = "var<workgroup> red_max: array<f32, G * 16u>;
var<workgroup> red_sum: array<f32, G * 16u>;";
const SOFTMAX_SUBGROUP: &str = "        for (var h = 0u; h < G; h++) {
            let v = subgroupMax(sh[h]);
            if (sid == 0u) {
                red_max[h * 16u + sg] = v;
            }
        }
        workgroupBarrier();
        for (var h = 0u; h < G; h++) {
            var mx = mstat[h];
            for (var q = 0u; q < nsg; q++) {
                mx = max(mx, red_max[h * 16u + q]);
            }
            let e = select(0.0, exp(sh[h] - mx), j < ke && sh[h] > -1.0e38);
            sc[h * KT + lid] = e;
            let v = subgroupAdd(e);
            if (sid == 0u) {
                red_sum[h * 16u + sg] = v;
            }
        }
        workgroupBarrier();
        if (lid < G) {
            var mx = mstat[lid];
            var sum = 0.0;
            for (var q = 0u; q < nsg; q++) {
                mx = max(mx, red_max[lid * 16u + q]);
                sum += red_sum[lid * 16u + q];
            }
            let c = exp(mstat[lid] - mx);
            corr[lid] = c;
            lstat[lid] = lstat[lid] * c + sum;
            mstat[lid] = mx;
        }
        workgroupBarrier();";

/// The same without subgroups: G invocations each walk their head's KT scores.
const SOFTMAX_WORKGROUP: &str = "        for (var h = 0u; h < G; h++) {
            sc[h * KT + lid] = sh[h];
        }
        workgroupBarrier();
        if (lid < G) {
            var mx = mstat[lid];
            for (var i = 0u; i < KT; i++) {
                mx = max(mx, sc[lid * KT + i]);
            }
            let c = exp(mstat[lid] - mx);
            var sum = 0.0;
            for (var i = 0u; i < KT; i++) {
                let x = sc[lid * KT + i];
                let e = select(0.0, exp(x - mx), tile + i < ke && x > -1.0e38);
                sc[lid * KT + i] = e;
                sum += e;
            }
            corr[lid] = c;
            lstat[lid] = lstat[lid] * c + sum;
            mstat[lid] = mx;
        }
        workgroupBarrier();";

/// An attention kernel with the tile softmax (the split and the tiled one), its shared parts
/// filled: HD4, the KV cache's loads, and the softmax with subgroup reductions (`subgroups`) or
/// through workgroup memory.
fn tile_softmax_attention(
    label: &str,
    body: &str,
    head_dim: u32,
    kv: KvDtype,
    kv_chunks: usize,
    subgroups: bool,
) -> Shader {
    let (args, decl, softmax) =
        if subgroups { (SG_ARGS, SOFTMAX_SUBGROUP_DECL, SOFTMAX_SUBGROUP) } else { ("", "", SOFTMAX_WORKGROUP) };
    Shader::new(label, body)
        .after(common())
        .after(AttnParams::WGSL)
        .after(WGSL_SCORE)
        .fill("HD4", head_dim / 4)
        .fill("KT", ATTN_KT)
        .fill("KV", kv_snippet(kv, false, kv_chunks))
        .fill("SG_ARGS", args)
        .fill("SOFTMAX_DECL", format!("{SOFTMAX_STATE_DECL}\n{decl}"))
        .fill("SOFTMAX", softmax)
}

/// The gpu profile's split-key attention for `group` query heads per KV head; `subgroups`: the
/// tile softmax reduces with subgroup operations.
pub fn attention_split_source(
    head_dim: u32,
    group: u32,
    kv: KvDtype,
    kv_chunks: usize,
    subgroups: bool,
) -> Result<String> {
    let body = include_str!("../../shaders/attention/attention_split.wgsl");
    tile_softmax_attention("attention_split", body, head_dim, kv, kv_chunks, subgroups).fill("G", group).build()
}

/// Workgroup memory the tiled attention may use (WebGPU's guaranteed minimum).
const TILED_ATTN_WG_BYTES: u32 = 16384;
/// Most tokens per tile of the tiled attention.
pub const TILED_ATTN_MAX_QT: u32 = 16;

/// Tokens per query tile of the gpu profile's tiled (prefill) attention for `group` query heads
/// per KV head: as many as fit the workgroup memory (queries, scores, statistics, the subgroup
/// reductions' arrays) up to TILED_ATTN_MAX_QT rows; 0 when not even one token's rows fit or a
/// tile would have one token only (the split kernel is then as good).
pub fn tiled_attention_tokens(head_dim: u32, group: u32, subgroups: bool) -> u32 {
    let kt = ATTN_KT;
    let per_row = head_dim * 4 + kt * 4 + 3 * 4 + if subgroups { 2 * 16 * 4 } else { 0 };
    let per_token = 2 * 4 + group.max(1) * per_row;
    let fit = (TILED_ATTN_WG_BYTES - kt * 4) / per_token;
    let qt = fit.min(TILED_ATTN_MAX_QT / group.max(1));
    if qt >= 2 {
        qt
    } else {
        0
    }
}

/// The gpu profile's query-tiled attention (`qt` tokens per tile, from `tiled_attention_tokens`).
pub fn attention_tiled_source(
    head_dim: u32,
    group: u32,
    qt: u32,
    kv: KvDtype,
    kv_chunks: usize,
    subgroups: bool,
) -> Result<String> {
    let body = include_str!("../../shaders/attention/attention_tiled.wgsl");
    tile_softmax_attention("attention_tiled", body, head_dim, kv, kv_chunks, subgroups)
        .fill("GQ", group.max(1))
        .fill("QT", qt)
        .build()
}

/// The cpu profile's attention (attention.wgsl), a thread per (token, head).
pub fn attention_source(head_dim: u32, kv: KvDtype, kv_chunks: usize) -> Result<String> {
    // One statement per vec4 of the head (see the shader: llvmpipe's loop-iteration limit).
    Shader::new("attention", include_str!("../../shaders/attention/attention.wgsl"))
        .after(common())
        .after(AttnParams::WGSL)
        .after(WGSL_SCORE)
        .fill("SCORE", unrolled(head_dim / 4, 2, "s4 += q[{i}] * load_k(kb + {i});"))
        .fill("ACCUM", unrolled(head_dim / 4, 2, "acc[{i}] = acc[{i}] * corr + e * load_v(kb + {i});"))
        .fill("HD4", head_dim / 4)
        .fill("KV", kv_snippet(kv, false, kv_chunks))
        .build()
}

/// Every program of the family at each of `head_dims`: the split and tiled kernels (several
/// group sizes, one and the most KV chunks, with and without subgroups) and the cpu profile's.
pub fn sources(head_dims: &[u32]) -> super::Sources {
    let b = AttnBinds::BINDS;
    let mut v: super::Sources = Vec::new();
    for &d in head_dims {
        for group in [1, 3, 7, 8] {
            for chunks in [1, MAX_KV_CHUNKS] {
                for sg in [false, true] {
                    let label = format!("attention_split_hd{d}_g{group}_x{chunks}_{sg}");
                    v.push(
                        Program::new(label, attention_split_source(d, group, KvDtype::F16, chunks, sg), b)
                            .with_kv(ATTN_KV),
                    );
                    let qt = tiled_attention_tokens(d, group, sg);
                    if qt > 0 {
                        let label = format!("attention_tiled_hd{d}_g{group}_x{chunks}_{sg}");
                        let src = attention_tiled_source(d, group, qt, KvDtype::F16, chunks, sg);
                        v.push(Program::new(label, src, b).with_kv(ATTN_KV));
                    }
                }
            }
        }
    }
    for kv in [KvDtype::F16, KvDtype::F32] {
        for chunks in 1..=MAX_KV_CHUNKS {
            for &d in head_dims {
                let label = format!("attention_hd{d}_{}_x{chunks}", kv.name());
                v.push(Program::new(label, attention_source(d, kv, chunks), b).with_kv(ATTN_KV));
            }
        }
    }
    v
}

/// The attention kernels of one further geometry (KernelSpec::more_attn).
pub struct MoreAttn {
    /// (head_dim, group).
    pub geom: (u32, u32),
    /// The cpu profile's attention (None on the gpu profile, which never runs it).
    pub cpu: Option<wgpu::ComputePipeline>,
    /// gpu profile: the split attention and its merge, and the query-tiled one (at the tokens
    /// per tile of AttnKernels::tiled).
    pub split: Option<[wgpu::ComputePipeline; 2]>,
    pub tiled: Option<wgpu::ComputePipeline>,
}

/// The attention family's kernels for a model.
pub struct AttnKernels {
    /// `AttnBinds` and the KV cache's chunks.
    pub family: Family,
    /// (head_dim, group) of the model's own kernels.
    pub geom: (u32, u32),
    /// The cpu profile's attention, a thread per (token, head) (None on the gpu profile, which
    /// runs the split and tiled kernels: a thread holding a head's query and accumulator
    /// spills on real GPUs).
    pub cpu: Option<wgpu::ComputePipeline>,
    /// gpu profile: the split-key attention and the merge of its splits.
    pub split: Option<[wgpu::ComputePipeline; 2]>,
    /// gpu profile: the query-tiled attention for prefill-sized steps and its tokens per tile
    /// (None where no tile of two tokens fits the workgroup memory).
    pub tiled: Option<(wgpu::ComputePipeline, u32)>,
    /// The kernels of the further geometries.
    pub more: Vec<MoreAttn>,
}

impl AttnKernels {
    /// The kernels of `geom` (head_dim, group) and the further geometries `more`, for a KV
    /// cache of `kv` elements in `kv_chunks` buffers per layer.
    pub fn new(
        gpu: &Gpu,
        geom: (u32, u32),
        more: &[(u32, u32)],
        (kv, kv_chunks): (KvDtype, usize),
        profile: KernelProfile,
    ) -> Result<AttnKernels> {
        let (head_dim, group) = geom;
        let mut slots = super::layout_of(AttnBinds::SLOTS);
        slots.extend([(ATTN_KV.0, Slot::Read), (ATTN_KV.1, Slot::Read)]);
        slots.extend(chunk_slots(kv_chunks, Slot::Read));
        let family = Family::new(gpu, &slots);
        let on_gpu = profile == KernelProfile::Gpu;
        let more: Vec<(u32, u32)> = more.iter().copied().filter(|&g| g != geom).collect();
        let cpu = |d: u32, label: &str| -> Result<Option<wgpu::ComputePipeline>> {
            if on_gpu {
                return Ok(None);
            }
            Ok(Some(family.pipeline(gpu, label, &attention_source(d, kv, kv_chunks)?, "main")?))
        };
        let split = |d: u32, g: u32, name: &dyn Fn(&str) -> String| -> Result<Option<[wgpu::ComputePipeline; 2]>> {
            if !on_gpu {
                return Ok(None);
            }
            let src = attention_split_source(d, g.max(1), kv, kv_chunks, gpu.subgroups)?;
            Ok(Some([
                family.pipeline(gpu, &name("attention_split"), &src, "main")?,
                family.pipeline(gpu, &name("attention_combine"), &src, "combine")?,
            ]))
        };
        // One tile size for every geometry (a step picks the tiled kernel for all layers).
        let qt = if on_gpu {
            more.iter()
                .map(|&(d, g)| tiled_attention_tokens(d, g, gpu.subgroups))
                .fold(tiled_attention_tokens(head_dim, group, gpu.subgroups), u32::min)
        } else {
            0
        };
        let tiled = |d: u32, g: u32, label: &str| -> Result<Option<wgpu::ComputePipeline>> {
            if qt == 0 {
                return Ok(None);
            }
            let src = attention_tiled_source(d, g, qt, kv, kv_chunks, gpu.subgroups)?;
            Ok(Some(family.pipeline(gpu, label, &src, "main")?))
        };
        let more = more
            .iter()
            .map(|&(d, g)| -> Result<MoreAttn> {
                let name = |n: &str| format!("{n}_{d}_{g}");
                Ok(MoreAttn {
                    geom: (d, g),
                    cpu: cpu(d, &name("attention"))?,
                    split: split(d, g, &name)?,
                    tiled: tiled(d, g, &name("attention_tiled"))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(AttnKernels {
            geom,
            cpu: cpu(head_dim, "attention")?,
            split: split(head_dim, group, &|n: &str| n.to_string())?,
            tiled: tiled(head_dim, group, "attention_tiled")?.map(|p| (p, qt)),
            more,
            family,
        })
    }
}

/// The attention op over a layer's KV cache chunks `k`, `v`.
pub fn attention(
    kern: &AttnKernels,
    g: &Gpu,
    b: &AttnBinds,
    (k, v): (&[wgpu::Buffer], &[wgpu::Buffer]),
    (heads, kv_heads, head_dim): (usize, usize, usize),
) -> Op {
    let bind = kern.family.bind(g, &kv_entries(b.entries(), ATTN_KV, k, v));
    let kind = OpKind::from(AttentionOp { heads: heads as u32, kv_heads: kv_heads as u32, hd4: (head_dim / 4) as u32 });
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
pub fn attention_tiled(kern: &AttnKernels, n_tokens: usize, n_seqs: usize) -> u32 {
    let qt = tiled_tokens(kern);
    if qt > 0 && n_tokens >= qt as usize * n_seqs.max(1) {
        qt
    } else {
        0
    }
}

/// Tokens per tile of the query-tiled attention these kernels have (0: none built).
pub fn tiled_tokens(kern: &AttnKernels) -> u32 {
    kern.tiled.as_ref().map_or(0, |t| t.1)
}

/// Paged attention of `heads` query heads over `kv_heads` KV heads, `hd4` vec4s per head.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionOp {
    pub heads: u32,
    pub kv_heads: u32,
    pub hd4: u32,
}

impl FamilyOp for AttentionOp {
    fn family(&self) -> &'static str {
        "attention"
    }

    /// `kv_bytes` per cache element: the tiled kernel reads a tile's keys once for its tokens.
    fn cost(&self, s: &StepShape, kv_bytes: u64) -> Cost {
        let AttentionOp { heads, kv_heads, hd4 } = *self;
        let (n, hd) = (s.n_tokens as u64, 4 * hd4 as u64);
        let kv = 2 * s.attn_keys * kv_heads as u64 * hd * kv_bytes / s.attn_tile.max(1) as u64;
        Cost { bytes: kv + 2 * 4 * n * heads as u64 * hd, flops: 4 * s.attn_keys * heads as u64 * hd }
    }

    fn dispatches<'a>(&self, op: &'a Op, r: &Recorder<'a>, s: &StepShape, out: impl FnMut(Dispatch<'a>)) {
        dispatches(op, r, s, *self, out)
    }
}

/// Attention's grid: on the gpu profile a workgroup per (query tile, KV head) for a tiled step,
/// else a workgroup per (token, KV head, key range), then the merge of the ranges; on the cpu
/// profile a thread per (token, head).
fn dispatches<'a>(
    op: &'a Op,
    r: &Recorder<'a>,
    s: &StepShape,
    AttentionOp { heads, kv_heads, hd4 }: AttentionOp,
    mut out: impl FnMut(Dispatch<'a>),
) {
    let n = s.n_tokens;
    let k = &r.kernels.attention;
    let geom = (hd4 * 4, heads / kv_heads.max(1));
    // A further geometry's kernels (Gemma 4's full-attention layers), else the model's own.
    let more = k.more.iter().find(|m| m.geom == geom && geom != k.geom);
    match (&k.split, &k.tiled) {
        (Some(_), Some((pipe, qt))) if s.attn_tile > 0 => {
            debug_assert_eq!(s.attn_tile, *qt);
            let pipe = more.and_then(|m| m.tiled.as_ref()).unwrap_or(pipe);
            out(r.folded(pipe, &op.bind, div_up(n, *qt) * kv_heads));
        }
        (Some([a, c]), _) => {
            let [split, combine] = more.and_then(|m| m.split.as_ref()).map_or([a, c], |[a, c]| [a, c]);
            out(r.folded(split, &op.bind, n * kv_heads * s.n_splits));
            if s.n_splits > 1 {
                out(r.folded(combine, &op.bind, div_up(n * heads * hd4, 64)));
            }
        }
        // (Without the gpu profile's kernels, the cpu profile's attention was built.)
        (None, _) => {
            if let Some(pipe) = more.map_or(k.cpu.as_ref(), |m| m.cpu.as_ref()) {
                out(r.folded(pipe, &op.bind, div_up(n * heads, 32)));
            }
        }
    }
}
