//! RoPE and the KV-cache write (rope_kv.wgsl): the cos/sin table, parameters, bindings,
//! constructor, grid and kernel.

use super::cost::Cost;
use super::kv_cache::{chunk_slots, kv_entries, kv_snippet};
use super::{bindings, div_up, Dispatch, FamilyOp, Op, OpKind, Program, Recorder, StepShape};
use crate::config::KvDtype;
use crate::gpu::family::{Family, Slot};
use crate::gpu::shader::Shader;
use crate::gpu::shared::gpu_struct;
use crate::gpu::Gpu;
use anyhow::Result;

gpu_struct! {
    /// rope_kv.wgsl's parameters (WGSL `RopeParams`).
    wgsl RopeParams;
    pub struct RopeParams {
        pub n_heads: u32,
        pub n_kv_heads: u32,
        pub head_dim: u32,
        /// Floats per qkv row.
        pub qkv_stride: u32,
        /// Elements per KV-cache buffer of a layer (when the cache spans several).
        pub kv_chunk: u32,
        /// Leading elements of each q/k head that RoPE rotates (partial rotary; head_dim when
        /// all): pairs (i, i + rot_dim / 2), the rest copied as they are.
        pub rot_dim: u32,
        /// 1: RoPE on the q heads only, no K/V written (Gemma 4's KV-sharing layers).
        pub q_only: u32,
        pub _p2: u32,
    }
}

bindings! {
    /// rope_kv.wgsl, with the KV cache's chunks from binding 5 (K) and 6 (V) on.
    RopeBinds {
        step: Uniform @ 0,
        p: Uniform @ 1,
        md: Read @ 2,
        cos_sin: Read @ 3,
        qkv: ReadWrite @ 4,
    }
}

/// The first K and V cache bindings of rope_kv.
pub const ROPE_KV: (u32, u32) = (5, 6);

impl RopeParams {
    /// `kv_chunk`: elements per KV-cache buffer.
    pub fn new(heads: usize, kv_heads: usize, head_dim: usize, kv_chunk: usize) -> RopeParams {
        RopeParams {
            n_heads: heads as u32,
            n_kv_heads: kv_heads as u32,
            head_dim: head_dim as u32,
            qkv_stride: ((heads + 2 * kv_heads) * head_dim) as u32,
            kv_chunk: kv_chunk as u32,
            rot_dim: head_dim as u32,
            ..Default::default()
        }
    }

    /// RoPE on the first `rot_dim` elements of each head only (a multiple of 4).
    pub fn with_rotary(self, rot_dim: usize) -> RopeParams {
        RopeParams { rot_dim: rot_dim as u32, ..self }
    }

    /// RoPE on the q heads only, writing no K/V (a layer that reads another layer's cache).
    pub fn q_only(self, on: bool) -> RopeParams {
        RopeParams { q_only: on as u32, ..self }
    }
}

/// cos/sin of pos * inv_freq[i] for every position below `max_pos` and i < d/2, with f32
/// inverse frequencies (as the model's rope scaling gives them) and f32 angles as Hugging Face
/// computes them, times the scaling's attention factor `attn` (YaRN): [pos][i] = (cos, sin), i
/// below the rotated dimensions / 2.
pub fn rope_table(inv_freq: &[f64], attn: f64, max_pos: usize) -> Vec<f32> {
    let inv: Vec<f32> = inv_freq.iter().map(|&f| f as f32).collect();
    let attn = attn as f32;
    let mut cs = Vec::with_capacity(max_pos * inv.len() * 2);
    for pos in 0..max_pos {
        for f in &inv {
            let a = pos as f32 * f;
            cs.extend([a.cos() * attn, a.sin() * attn]);
        }
    }
    cs
}

/// Threads of one rope_kv dispatch per token: one per (head, pair of rotated elements).
pub fn rope_threads(heads: usize, kv_heads: usize, head_dim: usize) -> u32 {
    ((heads + 2 * kv_heads) * head_dim / 4) as u32
}

/// RoPE and the KV write for a cache of `kv` elements in `kv_chunks` buffers per layer.
pub fn rope_kv_source(kv: KvDtype, kv_chunks: usize) -> Result<String> {
    Shader::new("rope_kv", include_str!("../../shaders/rope/rope_kv.wgsl"))
        .after(super::wgsl::common())
        .after(RopeParams::WGSL)
        .fill("KV", kv_snippet(kv, true, kv_chunks))
        .build()
}

/// Every program of the family: each KV element type and number of chunks.
pub fn sources() -> super::Sources {
    let mut v: super::Sources = Vec::new();
    for kv in [KvDtype::F16, KvDtype::F32] {
        for chunks in 1..=crate::gpu::MAX_KV_CHUNKS {
            let label = format!("rope_kv_{}_x{chunks}", kv.name());
            v.push(Program::new(label, rope_kv_source(kv, chunks), RopeBinds::BINDS).with_kv(ROPE_KV));
        }
    }
    v
}

/// The RoPE family's kernel for a model's KV cache.
pub struct RopeKernels {
    /// `RopeBinds` and the KV cache's chunks.
    pub family: Family,
    pub rope_kv: wgpu::ComputePipeline,
}

impl RopeKernels {
    pub fn new(gpu: &Gpu, kv: KvDtype, kv_chunks: usize) -> Result<RopeKernels> {
        let mut slots = super::layout_of(RopeBinds::SLOTS);
        slots.extend([(ROPE_KV.0, Slot::ReadWrite), (ROPE_KV.1, Slot::ReadWrite)]);
        slots.extend(chunk_slots(kv_chunks, Slot::ReadWrite));
        let family = Family::new(gpu, &slots);
        let rope_kv = family.pipeline(gpu, "rope_kv", &rope_kv_source(kv, kv_chunks)?, "main")?;
        Ok(RopeKernels { family, rope_kv })
    }
}

/// The RoPE + KV-write op over a layer's KV cache chunks `k`, `v`.
pub fn rope_kv(
    kern: &RopeKernels,
    g: &Gpu,
    b: &RopeBinds,
    (k, v): (&[wgpu::Buffer], &[wgpu::Buffer]),
    (heads, kv_heads, head_dim): (usize, usize, usize),
) -> Op {
    let bind = kern.family.bind(g, &kv_entries(b.entries(), ROPE_KV, k, v));
    let kind = OpKind::from(RopeOp { threads: rope_threads(heads, kv_heads, head_dim) });
    Op { kind, label: kind.family(), bind, bind_x: None }
}

/// RoPE and the KV write: `threads` invocations per token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeOp {
    pub threads: u32,
}

impl FamilyOp for RopeOp {
    fn family(&self) -> &'static str {
        "rope_kv"
    }

    /// Each thread reads 4 floats (two rotated pairs) and writes 4 values; the K and V thirds go
    /// to the cache (`kv_bytes` per element).
    fn cost(&self, s: &StepShape, kv_bytes: u64) -> Cost {
        let e = 4 * s.n_tokens as u64 * self.threads as u64;
        Cost { bytes: 4 * e + (4 + kv_bytes) * e / 2, flops: 3 * e }
    }

    fn dispatches<'a>(&self, op: &'a Op, r: &Recorder<'a>, s: &StepShape, mut out: impl FnMut(Dispatch<'a>)) {
        out(r.folded(&r.kernels.rope.rope_kv, &op.bind, div_up(s.n_tokens * self.threads, 64)));
    }
}
