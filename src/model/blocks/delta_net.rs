//! The recurrent mixer of hybrid models (Qwen3.5's Gated DeltaNet layers): its config
//! (`LinearConfig`), its weights (`HostLinear`, read through `LinearNames`) and its ops; and the
//! output gate of the hybrids' attention layers. A linear-attention layer: RMSNorm, the input projections (q/k/v, z,
//! b, a) into one row per token, then ops/delta.rs's stages (the causal convolution, q/k
//! normalisation with each value head's decay and beta, the delta-rule recurrence from each
//! sequence's state slot, the gated RMSNorm), and the output projection added into the
//! residual. The states live in two buffers per layer (`LayerCache::State`), one slot per
//! running sequence; a step's sequences name their slots (`StepInput::state_slots`).

use crate::model::builder::{LayerParams, OpBuilder};
use crate::model::config::ModelConfig;
use crate::model::layers::WeightSource;
use crate::model::loader::HostLayer;
use crate::ops::delta::{self, DeltaBinds, DeltaDims, DeltaStage};
use crate::weights::tensor::QTensor;
use crate::weights::upload::GpuMatrix;
use anyhow::{anyhow, bail, Result};

/// Most taps of the convolution the kernels keep (delta.wgsl's MAX_KERNEL).
pub const MAX_CONV_KERNEL: usize = crate::ops::delta::MAX_CONV_TAPS as usize + 1;
/// Most rows of the state one kernel thread keeps in registers (k_dim).
pub const MAX_K_DIM: usize = 256;

/// A hybrid model's recurrent layers.
#[derive(Clone, Debug, PartialEq)]
pub struct LinearConfig {
    pub dims: DeltaDims,
    /// Per layer: a Gated DeltaNet layer (else attention).
    pub layers: Vec<bool>,
    /// llama.cpp's value-head order (value head h uses key head h % k_heads).
    pub tiled: bool,
    /// Multi-token-prediction (NextN) layers the checkpoint keeps (model/blocks/mtp.rs); 0: none.
    pub mtp_layers: usize,
}

impl LinearConfig {
    pub fn validate(&self, layers: usize, src: &str) -> Result<()> {
        let d = &self.dims;
        if self.layers.len() != layers {
            bail!("{src}: {} layer kinds for {layers} layers", self.layers.len());
        }
        if d.k_heads == 0 || d.v_heads == 0 || !d.v_heads.is_multiple_of(d.k_heads) {
            bail!("{src}: {} linear value heads must be a positive multiple of {} key heads", d.v_heads, d.k_heads);
        }
        if d.k_dim == 0 || d.k_dim > MAX_K_DIM || d.v_dim == 0 || !d.v_dim.is_multiple_of(4) {
            bail!(
                "{src}: linear key head size {} (1..={MAX_K_DIM}) or value head size {} (a multiple of 4)",
                d.k_dim,
                d.v_dim
            );
        }
        if d.kernel == 0 || d.kernel > MAX_CONV_KERNEL {
            bail!("{src}: linear_conv_kernel_dim {} must be 1..={MAX_CONV_KERNEL}", d.kernel);
        }
        if !d.proj_width().is_multiple_of(4) {
            bail!("{src}: the linear layers' projections ({} per token) must be a multiple of 4", d.proj_width());
        }
        Ok(())
    }

    /// Per slot, the bytes of every recurrent layer's states among `layers`.
    pub fn slot_bytes(&self, layers: std::ops::Range<usize>) -> u64 {
        let n = layers.filter(|&l| self.layers.get(l).copied().unwrap_or(false)).count();
        (n * (self.dims.conv_state() + self.dims.rec_state()) * 4) as u64
    }
}

/// A Gated DeltaNet layer's weights on the host.
pub struct HostLinear {
    /// The input projections: [q; k; v] (conv_dim rows), z (value_dim), b and a (v_heads each).
    pub proj: [QTensor; 4],
    /// The convolution [conv_dim, kernel], A (-exp(A_log)) and dt_bias [v_heads], the gated
    /// norm [v_dim], concatenated in that order (what delta.wgsl reads).
    pub small: Vec<f32>,
    pub out: QTensor,
}

impl HostLinear {
    pub fn bytes(&self) -> u64 {
        (self.proj.iter().map(|t| t.bytes()).sum::<usize>() + self.out.bytes() + 4 * self.small.len()) as u64
    }
}

/// Tensor names of a Gated DeltaNet layer (after the layer's prefix).
pub(crate) struct LinearNames {
    pub qkv: &'static str,
    pub z: &'static str,
    pub b: &'static str,
    pub a: &'static str,
    pub conv: &'static str,
    pub dt_bias: &'static str,
    /// A_log (Hugging Face) or A itself (GGUF, `a_is_log` false).
    pub a_param: &'static str,
    pub a_is_log: bool,
    pub norm: &'static str,
    pub out: &'static str,
}

pub(crate) const HF_LINEAR: LinearNames = LinearNames {
    qkv: "linear_attn.in_proj_qkv.weight",
    z: "linear_attn.in_proj_z.weight",
    b: "linear_attn.in_proj_b.weight",
    a: "linear_attn.in_proj_a.weight",
    conv: "linear_attn.conv1d.weight",
    dt_bias: "linear_attn.dt_bias",
    a_param: "linear_attn.A_log",
    a_is_log: true,
    norm: "linear_attn.norm.weight",
    out: "linear_attn.out_proj.weight",
};

pub(crate) const GGUF_LINEAR: LinearNames = LinearNames {
    qkv: "attn_qkv.weight",
    z: "attn_gate.weight",
    b: "ssm_beta.weight",
    a: "ssm_alpha.weight",
    conv: "ssm_conv1d.weight",
    dt_bias: "ssm_dt.bias",
    a_param: "ssm_a",
    a_is_log: false,
    norm: "ssm_norm.weight",
    out: "ssm_out.weight",
};

/// Loads a Gated DeltaNet layer's mixer (`t` names a tensor of the layer).
pub(crate) fn load_linear(
    w: &dyn WeightSource,
    n: &LinearNames,
    t: &dyn Fn(&str) -> String,
    cfg: &ModelConfig,
    lc: &LinearConfig,
) -> Result<HostLinear> {
    let (d, h) = (&lc.dims, cfg.hidden);
    let proj = [
        w.matrix(&t(n.qkv), d.conv_dim(), h)?,
        w.matrix(&t(n.z), d.value_dim(), h)?,
        w.matrix(&t(n.b), d.v_heads, h)?,
        w.matrix(&t(n.a), d.v_heads, h)?,
    ];
    // Hugging Face keeps Conv1d's [channels, 1, kernel]; llama.cpp squeezes it.
    let conv = if n.a_is_log {
        w.array(&t(n.conv), &[d.conv_dim(), 1, d.kernel])?.0
    } else {
        w.array(&t(n.conv), &[d.conv_dim(), d.kernel])?.0
    };
    let a = w.vector(&t(n.a_param), d.v_heads)?;
    let a: Vec<f32> = if n.a_is_log { a.iter().map(|x| -x.exp()).collect() } else { a };
    if a.iter().any(|x| !x.is_finite()) {
        bail!("{}: {}: A is not finite", w.path().display(), t(n.a_param));
    }
    let mut small = conv;
    small.extend(a);
    small.extend(w.vector(&t(n.dt_bias), d.v_heads)?);
    small.extend(w.vector(&t(n.norm), d.v_dim)?);
    Ok(HostLinear { proj, small, out: w.matrix(&t(n.out), h, d.value_dim())? })
}

/// What a layer keeps per sequence: KV-cache chunks (attention) or recurrent-state buffers.
pub(crate) enum LayerCache<'a> {
    Kv(&'a [wgpu::Buffer], &'a [wgpu::Buffer]),
    /// The convolution states and the delta rule's states of every slot.
    State(&'a wgpu::Buffer, &'a wgpu::Buffer),
}

impl OpBuilder<'_> {
    /// A Gated DeltaNet layer's mixer (model/blocks/delta_net.rs's weights) over the slots' `states`.
    pub(crate) fn linear_mixer(
        &mut self,
        hl: &HostLayer,
        lp: &LayerParams,
        (conv, rec): (&wgpu::Buffer, &wgpu::Buffer),
    ) -> Result<()> {
        let (cfg, s) = (self.cfg, self.s);
        let lin = hl.linear.as_ref().ok_or_else(|| anyhow!("a linear-attention layer without its weights"))?;
        let d = cfg.linear.as_ref().ok_or_else(|| anyhow!("a linear-attention layer in a model without them"))?.dims;
        let (x, params) = match (&s.lin, &lp.delta) {
            (Some(x), Some(p)) => (x, p),
            _ => return Err(anyhow!("the step has no buffer for the linear layers' projections")),
        };
        let pw = d.proj_width();
        // The projections in one matmul when they share a format, else each into its columns.
        let [qkv, z, b, a] = &lin.proj;
        let parts: Vec<(GpuMatrix, usize)> = if [z, b, a].iter().all(|t| t.format == qkv.format) {
            vec![(self.upload("delta_in", &QTensor::concat_rows(&[qkv, z, b, a])?, None)?, 0)]
        } else {
            let cols = [0, d.conv_dim(), d.conv_dim() + d.value_dim(), d.conv_dim() + d.value_dim() + d.v_heads];
            lin.proj.iter().zip(cols).map(|(t, c)| Ok((self.upload("delta_in", t, None)?, c))).collect::<Result<_>>()?
        };
        let out_m = self.upload("delta_out", &lin.out, None)?;
        let w = self.storage("delta_w", &lin.small);
        self.rms_norm(lp, &hl.attn_norm, "attn_norm");
        for (m, col0) in &parts {
            self.matmul("delta_in", m, (&s.normed, x), (*col0, pw), None, 0, false, false);
        }
        let chunks =
            s.lin_chunks.as_ref().ok_or_else(|| anyhow!("the step has no buffer for the chunked delta rule"))?;
        let b = DeltaBinds {
            step: &s.step_buf,
            p: params,
            md: &s.meta_buf,
            w: &w,
            x,
            conv_state: conv,
            rec_state: rec,
            out: &s.attn,
            chunks,
        };
        for &stage in DeltaStage::mixer() {
            let op = delta::delta(self.kernels.delta.as_ref(), self.g, &b, stage, stage.per_unit(&d, 0))?;
            self.push(op);
        }
        self.project_out("delta_out", (&out_m, None), &s.attn, lp, None);
        self.matrices.extend(parts.into_iter().map(|(m, _)| m));
        self.matrices.push(out_m);
        Ok(())
    }

    /// Attention's output gate (Qwen3.5): the gate projection of the normed input, then the
    /// attention output times its sigmoid, in place.
    pub(crate) fn attn_output_gate(&mut self, gate: &QTensor, lp: &LayerParams) -> Result<()> {
        let (cfg, s) = (self.cfg, self.s);
        let (x, params) = match (&s.lin, &lp.delta) {
            (Some(x), Some(p)) => (x, p),
            _ => return Err(anyhow!("the step has no buffer for the attention's output gate")),
        };
        let m = self.upload("attn_gate", gate, None)?;
        self.matmul("attn_gate", &m, (&s.normed, x), (0, cfg.q_dim()), None, 0, false, false);
        // Unused by the gate; distinct, as no two writable bindings may alias.
        let w = self.storage("dummy", &[0.0; 4]);
        let (c, r) = (self.storage("dummy", &[0.0; 4]), self.storage("dummy", &[0.0; 4]));
        let chunks = self.storage("dummy", &[0.0; 4]);
        let b = DeltaBinds {
            step: &s.step_buf,
            p: params,
            md: &s.meta_buf,
            w: &w,
            x,
            conv_state: &c,
            rec_state: &r,
            out: &s.attn,
            chunks: &chunks,
        };
        let op = delta::delta(self.kernels.delta.as_ref(), self.g, &b, DeltaStage::Gate, cfg.q_dim() as u32)?;
        self.push(op);
        self.matrices.push(m);
        Ok(())
    }
}

/// Each recurrent layer's state buffers among `layers`: the convolution states and the delta
/// rule's states of `slots` slots, each within one storage binding of `max_binding` bytes.
pub(crate) fn state_buffers(
    g: &crate::gpu::Gpu,
    cfg: &crate::model::config::ModelConfig,
    layers: std::ops::Range<usize>,
    slots: usize,
    max_binding: u64,
) -> Result<Vec<(wgpu::Buffer, wgpu::Buffer)>> {
    let Some(lc) = cfg.linear.as_ref().filter(|_| slots > 0) else { return Ok(Vec::new()) };
    let d = &lc.dims;
    let (conv, rec) = ((slots * d.conv_state() * 4) as u64, (slots * d.rec_state() * 4) as u64);
    if conv.max(rec) > max_binding {
        anyhow::bail!(
            "the recurrent states of {slots} sequences take {} bytes per layer, more than one storage binding \
             ({max_binding} bytes); lower max_decode_batch_size / max_prefill_batch_size to at most {}",
            conv.max(rec),
            (max_binding / (conv.max(rec) / slots as u64)).max(1)
        );
    }
    Ok(layers
        .filter(|&l| cfg.is_linear(l))
        .map(|_| (g.storage("conv_state", conv.max(16)), g.storage("rec_state", rec.max(16))))
        .collect())
}

/// The step's state records (ops/delta.rs's STATE_RECORD words per sequence) into `meta`: each
/// sequence's slot (its index where the step names none), first token row, token count, whether
/// it starts from a zero state (its first token is at position 0), the slot its state is first
/// copied to, the snapshot slot and token after which its state is copied there, and the slot
/// its state is read from instead of its own (`delta::NO_SLOT`: none).
pub(crate) fn state_records(meta: &mut [u32], s: &crate::model::StepInput) {
    for (j, st) in crate::model::step::SeqState::all(s).enumerate() {
        let none = delta::NO_SLOT;
        let (snap, at) = st.snapshot.unwrap_or((none, 0));
        let r = [st.slot, 0, 0, 0, st.backup.unwrap_or(none), snap, at, st.src.unwrap_or(none)];
        meta[j * delta::STATE_RECORD..(j + 1) * delta::STATE_RECORD].copy_from_slice(&r);
    }
    for (i, &seq) in s.seq_of_token.iter().enumerate() {
        let r = &mut meta[seq as usize * delta::STATE_RECORD..][..delta::STATE_RECORD];
        if r[2] == 0 {
            r[1] = i as u32;
            r[3] = (s.positions[i] == 0) as u32;
        }
        r[2] += 1;
    }
}
