//! The step's buffers: metadata, activations, logits and sampler results, hidden states for
//! the next stage, the RoPE table and the split attention's partials.

use crate::gpu::Gpu;
use crate::model::config::{ModelConfig, RopeScaling};
use crate::model::plan::*;
use crate::model::step::*;
use crate::ops::matmul::tiles::{window_entries, window_stride};
use crate::ops::rope::*;
use crate::sampling::row::SAMPLE_RESULT_STRIDE;

/// Floats per token of the `lin` buffer: the Gated DeltaNet projections, or the attention
/// output gate's (0: the model has neither).
pub(crate) fn lin_width(cfg: &ModelConfig) -> usize {
    let gate = if cfg.style.attn_gate { cfg.q_dim() } else { 0 };
    cfg.linear.as_ref().map_or(0, |l| l.dims.proj_width()).max(gate)
}

/// Floats per token of the `attn` buffer: attention's or the Gated DeltaNet's output, and Gemma
/// 4's MoE block's sum of its two paths.
pub(crate) fn attn_width(cfg: &ModelConfig) -> usize {
    let parallel_moe = if cfg.moe.is_some() && cfg.family().dense_beside_experts { cfg.hidden } else { 0 };
    cfg.q_dim().max(lin_out_width(cfg)).max(parallel_moe)
}

/// Floats per token of the chunked delta rule's matrices (0: no linear-attention layers).
pub(crate) fn lin_chunk_width(cfg: &ModelConfig) -> usize {
    cfg.linear.as_ref().map_or(0, |l| l.dims.chunk_width())
}

/// Floats per token of the Gated DeltaNet's output (written where attention's goes).
pub(crate) fn lin_out_width(cfg: &ModelConfig) -> usize {
    cfg.linear.as_ref().map_or(0, |l| l.dims.value_dim())
}

/// The step's buffers: metadata, activations, logits and sampler results, hidden states for
/// the next stage, the RoPE table and the split attention's partials.
pub(crate) struct Scratch {
    pub(crate) step_buf: wgpu::Buffer,
    pub(crate) meta_buf: wgpu::Buffer,
    pub(crate) adjust_buf: wgpu::Buffer,
    pub(crate) hidden: wgpu::Buffer,
    pub(crate) normed: wgpu::Buffer,
    pub(crate) qkv: wgpu::Buffer,
    pub(crate) attn: wgpu::Buffer,
    pub(crate) act: wgpu::Buffer,
    /// Each token's Gated DeltaNet projections, or the attention output gate's (None where the
    /// model has neither).
    pub(crate) lin: Option<wgpu::Buffer>,
    /// The chunked delta rule's per-chunk matrices (None without linear-attention layers).
    pub(crate) lin_chunks: Option<wgpu::Buffer>,
    /// The MoE router's logits [tokens, experts] and route words [tokens, 2 * top_k] (None for
    /// a dense model).
    pub(crate) moe_logits: Option<wgpu::Buffer>,
    pub(crate) moe_route: Option<wgpu::Buffer>,
    /// The down projection of every (token, choice) pair [tokens * top_k, hidden], and the route
    /// buffer's layout.
    pub(crate) moe_pair_out: Option<wgpu::Buffer>,
    pub(crate) moe_layout: Option<crate::ops::moe::RouteLayout>,
    pub(crate) final_normed: wgpu::Buffer,
    pub(crate) logits: wgpu::Buffer,
    pub(crate) result: wgpu::Buffer,
    pub(crate) readback: wgpu::Buffer,
    pub(crate) hidden_readback: Option<wgpu::Buffer>,
    pub(crate) part: wgpu::Buffer,
    pub(crate) cos_sin: wgpu::Buffer,
    /// Every layer's per-layer embedding of each token (Gemma 4 E2B/E4B), else None.
    pub(crate) ple: Option<wgpu::Buffer>,
    /// The RoPE table of the windowed layers when their base differs (Gemma 3), else None.
    pub(crate) cos_sin_local: Option<wgpu::Buffer>,
    /// Bound where a kernel's binding is unused (no bias).
    pub(crate) dummy: wgpu::Buffer,
    /// Window entries of the uniform-x matmuls.
    pub(crate) windows: wgpu::Buffer,
    /// Buffers only the bind groups use.
    pub(crate) keep: Vec<wgpu::Buffer>,
}

impl Scratch {
    pub(crate) fn new(
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
        let (inv_freq, attn) = cfg.rope_scaling.inv_freq(cfg.rope_theta, cfg.rope_dim());
        let cs = rope_table(&inv_freq, attn, limits.max_seq_len);
        let local = cfg.style.local_rope_theta.map(|theta| {
            let (inv_freq, attn) = RopeScaling::None.inv_freq(theta, cfg.head_dim);
            g.storage_init("cos_sin_local", bytemuck::cast_slice(&rope_table(&inv_freq, attn, limits.max_seq_len)))
        });
        let s = Scratch {
            step_buf: g.uniform_init("step", bytemuck::bytes_of(&layout.header)),
            meta_buf: g.storage("meta", (layout.meta_len * 4) as u64),
            adjust_buf: g.storage("adjust", if last { (layout.adjust_cap * 16) as u64 } else { 16 }),
            hidden: g.storage("hidden", f(t_max * cfg.hidden)),
            normed: g.activation("normed", f(t_max * cfg.hidden)),
            qkv: g.storage("qkv", f(t_max * cfg.qkv_dim())),
            attn: g.activation("attn", f(t_max * attn_width(cfg))),
            act: g.activation("act", f(t_max * cfg.act_width())),
            lin: (lin_width(cfg) > 0).then(|| g.activation("lin", f(t_max * lin_width(cfg)))),
            lin_chunks: (lin_chunk_width(cfg) > 0).then(|| g.activation("lin_chunks", f(t_max * lin_chunk_width(cfg)))),
            // Whole vec4s: the shared expert's gate reads its logits through a vec4 binding.
            moe_logits: cfg.moe.as_ref().map(|m| g.storage("moe_logits", f((t_max * m.experts).next_multiple_of(4)))),
            moe_route: cfg
                .moe
                .as_ref()
                .map(|m| g.storage("moe_route", f(crate::ops::moe::RouteLayout::new(t_max, m.experts, m.top_k).words))),
            moe_pair_out: cfg.moe.as_ref().map(|m| g.activation("moe_pair_out", f(t_max * m.top_k * cfg.hidden))),
            moe_layout: cfg.moe.as_ref().map(|m| crate::ops::moe::RouteLayout::new(t_max, m.experts, m.top_k)),
            // Logits and sampler results only on the last stage; hidden states leave the others.
            final_normed: g.activation("final_normed", f(plan.s_last * cfg.hidden)),
            logits: g.storage("logits", f(plan.s_last * cfg.vocab)),
            result: g.storage("result", result_bytes),
            readback: g.readback("result_readback", result_bytes),
            hidden_readback: (!last).then(|| g.readback("hidden_readback", f(t_max * cfg.hidden))),
            part: g.storage("attn_partials", plan.part_vec4 as u64 * 16),
            cos_sin: g.storage_init("cos_sin", bytemuck::cast_slice(&cs)),
            cos_sin_local: local,
            ple: (cfg.ple_dim() > 0).then(|| g.storage("ple", f(t_max * cfg.layers * cfg.ple_dim()))),
            dummy: g.storage("dummy", 16),
            windows: g.uniform_init("windows", bytemuck::cast_slice(&window_entries(t_max + 1, window_stride(g)))),
            keep: Vec::new(),
        };
        let mut keep = vec![
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
        keep.extend(s.cos_sin_local.clone());
        keep.extend(s.ple.clone());
        keep.extend(s.lin.clone());
        keep.extend(s.lin_chunks.clone());
        keep.extend(s.moe_logits.clone());
        keep.extend(s.moe_route.clone());
        keep.extend(s.moe_pair_out.clone());
        Scratch { keep, ..s }
    }
}
