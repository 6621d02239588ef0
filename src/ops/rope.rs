//! RoPE and the KV-cache write: the cos/sin table, parameters, bindings and constructor, and
//! the KV cache's chunk bindings (shared with attention).

use super::kernels::Kernels;
use super::sources::{KV_K_CHUNK_BINDING, KV_V_CHUNK_BINDING};
use super::{bindings, div_up, Dispatch, Op, OpKind, Recorder, StepShape};
use crate::gpu::shared::gpu_struct;
use crate::gpu::Gpu;

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

/// The RoPE + KV-write op over a layer's KV cache chunks `k`, `v`.
pub fn rope_kv(
    kern: &Kernels,
    g: &Gpu,
    b: &RopeBinds,
    (k, v): (&[wgpu::Buffer], &[wgpu::Buffer]),
    (heads, kv_heads, head_dim): (usize, usize, usize),
) -> Op {
    let bind = kern.rope_family.bind(g, &kv_entries(b.entries(), ROPE_KV, k, v));
    let kind = OpKind::RopeKv { threads: rope_threads(heads, kv_heads, head_dim) };
    Op { kind, label: kind.family(), bind, bind_x: None }
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

/// RoPE + KV write's grid: `threads` per token.
pub(super) fn dispatches<'a>(
    op: &'a Op,
    r: &Recorder<'a>,
    s: &StepShape,
    threads: u32,
    mut out: impl FnMut(Dispatch<'a>),
) {
    out(r.folded(&r.kernels.rope_kv, &op.bind, div_up(s.n_tokens * threads, 64)));
}
