//! The recurrent mixer of hybrid models (Qwen3.5's Gated DeltaNet layers) and the output gate of
//! their attention layers. A linear-attention layer: RMSNorm, the input projections (q/k/v, z,
//! b, a) into one row per token, then ops/delta.rs's stages (the causal convolution, q/k
//! normalisation with each value head's decay and beta, the delta-rule recurrence from each
//! sequence's state slot, the gated RMSNorm), and the output projection added into the
//! residual. The states live in two buffers per layer (`LayerCache::State`), one slot per
//! running sequence; a step's sequences name their slots (`StepInput::state_slots`).

use crate::model::builder::{LayerParams, OpBuilder};
use crate::model::loader::HostLayer;
use crate::ops::delta::{self, DeltaBinds, DeltaStage};
use crate::weights::tensor::QTensor;
use crate::weights::upload::GpuMatrix;
use anyhow::{anyhow, Result};

/// What a layer keeps per sequence: KV-cache chunks (attention) or recurrent-state buffers.
pub(crate) enum LayerCache<'a> {
    Kv(&'a [wgpu::Buffer], &'a [wgpu::Buffer]),
    /// The convolution states and the delta rule's states of every slot.
    State(&'a wgpu::Buffer, &'a wgpu::Buffer),
}

impl OpBuilder<'_> {
    /// A Gated DeltaNet layer's mixer (model/qwen35.rs's weights) over the slots' `states`.
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
            let op = delta::delta(self.kernels, self.g, &b, stage, stage.per_unit(&d, 0))?;
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
        let op = delta::delta(self.kernels, self.g, &b, DeltaStage::Gate, cfg.q_dim() as u32)?;
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
