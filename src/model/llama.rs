//! The recipe of the Llama family (Llama 3.x, Mistral, Qwen2/2.5, Qwen3): each layer is an
//! attention mixer (RMSNorm, q/k/v, Qwen3's q/k norm, RoPE + KV write, attention global or
//! within a sliding window, the output projection) and a dense SwiGLU FFN (RMSNorm, gate/up,
//! down), each adding into the residual; then the head. Built from the ops' constructors; a
//! family with other layer kinds adds a `LayerKind` and the ops it needs.

use crate::model::builder::{LayerParams, OpBuilder};
use crate::model::config::ModelConfig;
use crate::model::loader::{HostLayer, HostModel};
use crate::ops::attention::{self, AttnBinds};
use crate::ops::matmul::{MAT_ACCUMULATE, MAT_BIAS, MAT_SWIGLU_UP};
use crate::ops::norm::{self, HeadNormBinds, NormBinds};
use crate::ops::rope::{self, RopeBinds};
use crate::ops::sample::{self, AdjustBinds, SampleBinds, SamplerParams};
use crate::weights::tensor::QTensor;
use crate::weights::upload::GpuMatrix;
use anyhow::{bail, Result};

/// How a layer mixes tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mixer {
    /// Attention over every earlier position, or (`window`) over the last `window` only.
    Attention { window: Option<usize> },
}

/// A layer's feed-forward block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ffn {
    /// One SwiGLU MLP for every token.
    Dense,
}

/// What one layer is made of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerKind {
    pub mixer: Mixer,
    pub ffn: Ffn,
}

/// The kind of layer `l` of a Llama-family model: every layer attends the same way (the
/// model's sliding window, if any) and has a dense FFN.
pub fn layer_kind(cfg: &ModelConfig, _l: usize) -> LayerKind {
    LayerKind { mixer: Mixer::Attention { window: cfg.sliding_window }, ffn: Ffn::Dense }
}

impl OpBuilder<'_> {
    /// Layer `l`: its mixer, then its FFN, as `layer_kind` says.
    pub(crate) fn layer(
        &mut self,
        l: usize,
        hl: &HostLayer,
        lp: &LayerParams,
        k: &[wgpu::Buffer],
        v: &[wgpu::Buffer],
    ) -> Result<()> {
        let kind = layer_kind(self.cfg, l);
        match kind.mixer {
            // The window is in the layer parameters (one for the whole model).
            Mixer::Attention { window } => {
                debug_assert_eq!(window, self.cfg.sliding_window);
                self.attention_mixer(hl, lp, k, v)?
            }
        }
        match kind.ffn {
            Ffn::Dense => self.dense_ffn(hl, lp)?,
        }
        Ok(())
    }

    /// RMSNorm of the residual into `normed`.
    fn rms_norm(&mut self, lp: &LayerParams, weight: &[f32], label: &str) {
        let s = self.s;
        let w = self.storage(label, weight);
        let b = NormBinds { step: &s.step_buf, p: &lp.norm, x: &s.hidden, weight: &w, md: &s.meta_buf, y: &s.normed };
        self.push(norm::norm(self.kernels, self.g, &b, false, self.cfg.hidden));
    }

    /// RMSNorm, q/k/v (one matmul, or one per format), Qwen3's q/k norm, RoPE + KV write,
    /// attention, the output projection added into the residual.
    fn attention_mixer(
        &mut self,
        hl: &HostLayer,
        lp: &LayerParams,
        k: &[wgpu::Buffer],
        v: &[wgpu::Buffer],
    ) -> Result<()> {
        let (g, cfg, s, kern) = (self.g, self.cfg, self.s, self.kernels);
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
        let bias = hl.qkv_bias.as_ref().map(|b| self.storage("qkv_bias", b));

        self.rms_norm(lp, &hl.attn_norm, "attn_norm");
        let bias_flag = if bias.is_some() { MAT_BIAS } else { 0 };
        for (m, col0) in &qkv_ms {
            let io = (&s.normed, &s.qkv);
            self.matmul("qkv", m, io, (*col0, cfg.qkv_dim()), bias.as_ref(), bias_flag, false, false);
        }
        if let Some(w) = &hl.qk_norm {
            let wb = self.storage("qk_norm", w);
            let b = HeadNormBinds { step: &s.step_buf, p: &lp.head_norm, weight: &wb, qkv: &s.qkv };
            self.push(norm::head_norm(kern, g, &b, cfg.heads + cfg.kv_heads, cfg.head_dim));
        }
        let dims = (cfg.heads, cfg.kv_heads, cfg.head_dim);
        let b = RopeBinds { step: &s.step_buf, p: &lp.rope, md: &s.meta_buf, cos_sin: &s.cos_sin, qkv: &s.qkv };
        self.push(rope::rope_kv(kern, g, &b, (k, v), dims));
        let b = AttnBinds { step: &s.step_buf, p: &lp.attn, md: &s.meta_buf, qkv: &s.qkv, out: &s.attn, part: &s.part };
        self.push(attention::attention(kern, g, &b, (k, v), dims));
        self.matmul("o_proj", &o_m, (&s.attn, &s.hidden), (0, cfg.hidden), None, MAT_ACCUMULATE, false, false);
        self.matrices.extend(qkv_ms.into_iter().map(|(m, _)| m));
        self.matrices.push(o_m);
        Ok(())
    }

    /// RMSNorm, SwiGLU (gate and up fused when they share a format; else the gate is written
    /// to act and the up projection's epilogue applies silu(gate) * up), the down projection
    /// added into the residual.
    fn dense_ffn(&mut self, hl: &HostLayer, lp: &LayerParams) -> Result<()> {
        let (cfg, s) = (self.cfg, self.s);
        let (gu_m, up_m) = if hl.gate.format == hl.up.format {
            (self.upload("gate_up", &hl.gate, Some(&hl.up))?, None)
        } else {
            (self.upload("gate", &hl.gate, None)?, Some(self.upload("up", &hl.up, None)?))
        };
        let down_m = self.upload("down", &hl.down, None)?;
        self.rms_norm(lp, &hl.ffn_norm, "ffn_norm");
        let ffn = (0, cfg.intermediate);
        match &up_m {
            None => self.matmul("gate_up", &gu_m, (&s.normed, &s.act), ffn, None, 0, false, true),
            Some(up) => {
                self.matmul("gate_up", &gu_m, (&s.normed, &s.act), ffn, None, 0, false, false);
                self.matmul("gate_up", up, (&s.normed, &s.act), ffn, None, MAT_SWIGLU_UP, false, false);
            }
        }
        self.matmul("down", &down_m, (&s.act, &s.hidden), (0, cfg.hidden), None, MAT_ACCUMULATE, false, false);
        self.matrices.extend([gu_m, down_m]);
        self.matrices.extend(up_m);
        Ok(())
    }

    /// The last stage's head: the final norm of the sampled rows, the LM head (the embedding
    /// when tied), the logit adjustments and the sampler.
    pub(crate) fn head(
        &mut self,
        host: &HostModel,
        embed: Option<GpuMatrix>,
        lp: &LayerParams,
        off_params: usize,
    ) -> Result<()> {
        let (g, cfg, s, kern) = (self.g, self.cfg, self.s, self.kernels);
        let final_norm = self.storage("final_norm", &host.final_norm);
        let b = NormBinds {
            step: &s.step_buf,
            p: &lp.final_norm,
            x: &s.hidden,
            weight: &final_norm,
            md: &s.meta_buf,
            y: &s.final_normed,
        };
        self.push(norm::norm(kern, g, &b, true, cfg.hidden));
        let lm = match (&host.lm_head, embed) {
            (Some(t), _) if !host.tied => self.upload("lm_head", t, None)?,
            (_, Some(e)) if host.tied => e,
            _ => bail!("the output projection was not loaded from {}", host.source.display()),
        };
        self.matmul("lm_head", &lm, (&s.final_normed, &s.logits), (0, cfg.vocab), None, 0, true, false);
        let sp = SamplerParams { vocab: cfg.vocab as u32, off_params: off_params as u32, ..Default::default() };
        let sp = self.uniform(bytemuck::bytes_of(&sp));
        let b = AdjustBinds { step: &s.step_buf, p: &sp, md: &s.meta_buf, adj: &s.adjust_buf, logits: &s.logits };
        self.push(sample::logit_adjust(kern, g, &b, cfg.vocab));
        let b = SampleBinds { step: &s.step_buf, p: &sp, md: &s.meta_buf, logits: &s.logits, result: &s.result };
        self.push(sample::sample(kern, g, &b, cfg.vocab));
        self.matrices.push(lm);
        Ok(())
    }
}
