//! The recipe of the dense transformers (Llama 3.x, Mistral, Qwen2/2.5, Qwen3, Gemma 2/3): each
//! layer is an attention mixer (model/blocks/attention.rs: RMSNorm, q/k/v, the q/k norm of Qwen3
//! and Gemma 3, RoPE + KV write, attention global or within a sliding window, the output
//! projection) and a gated FFN
//! (RMSNorm, gate/up with SiLU or tanh-GELU, down), each adding into the residual, through a
//! norm of its own where the family has one (Gemma); then the head. A family's differences are
//! data (`LayerStyle`, read from each family's config by model/families/), turned into each layer's `LayerKind`
//! here; a family with other layer kinds (MoE, recurrent mixers) adds a variant and its ops.

use crate::model::blocks::delta_net::LayerCache;
use crate::model::builder::{LayerParams, OpBuilder};
use crate::model::config::ModelConfig;
use crate::model::loader::{HostLayer, HostModel};
use crate::ops::matmul::{MAT_ACCUMULATE, MAT_BIAS, MAT_GELU, MAT_SOFTCAP, MAT_SWIGLU_UP};
use crate::ops::norm::{self, NormBinds, NormParams};
use crate::ops::sample::{self, AdjustBinds, SampleBinds, SamplerParams};
use crate::weights::upload::GpuMatrix;
use anyhow::{bail, Result};

/// How a layer mixes tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mixer {
    /// Attention over every earlier position, or (`window`) over the last `window` only.
    Attention { window: Option<usize> },
    /// A recurrent mixer with a fixed-size state per sequence (Gated DeltaNet, model/blocks/delta_net.rs).
    Linear,
}

/// A layer's feed-forward block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ffn {
    /// One gated MLP for every token: SwiGLU, or GeGLU (tanh-GELU) with `gelu`.
    Dense { gelu: bool },
    /// A mixture of experts (model/blocks/moe.rs): each token's top-k gated MLPs, weighted.
    Moe { gelu: bool },
    /// Gemma 4's block (model/blocks/parallel_moe.rs): a dense GeGLU MLP beside the experts.
    DenseAndMoe,
}

/// What one layer is made of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerKind {
    pub mixer: Mixer,
    pub ffn: Ffn,
    /// The mixer's and the FFN's outputs are RMS-normed before they are added into the
    /// residual (Gemma).
    pub post_norms: bool,
}

/// The kind of layer `l`: attention within the layer's window (the model's sliding window on
/// every layer, or on the layers its style names), a dense gated FFN.
pub fn layer_kind(cfg: &ModelConfig, l: usize) -> LayerKind {
    LayerKind {
        mixer: if cfg.is_linear(l) { Mixer::Linear } else { Mixer::Attention { window: cfg.layer_window(l) } },
        ffn: match &cfg.moe {
            Some(m) if m.is_sparse(l) && cfg.family().dense_beside_experts => Ffn::DenseAndMoe,
            Some(m) if m.is_sparse(l) => Ffn::Moe { gelu: cfg.style.gelu },
            _ => Ffn::Dense { gelu: cfg.style.gelu },
        },
        post_norms: cfg.style.post_norms,
    }
}

impl OpBuilder<'_> {
    /// Layer `l`: its mixer, then its FFN, as `layer_kind` says.
    pub(crate) fn layer(&mut self, l: usize, hl: &HostLayer, lp: &LayerParams, cache: LayerCache) -> Result<()> {
        let kind = layer_kind(self.cfg, l);
        let post = match (&hl.post_norms, kind.post_norms) {
            (Some((a, f)), true) => Some((a.as_slice(), f.as_slice())),
            (None, false) => None,
            _ => bail!("layer {l}: its post-norm weights do not match its kind"),
        };
        match (kind.mixer, cache) {
            (Mixer::Attention { window }, LayerCache::Kv(k, v)) => {
                self.attention_mixer(l, hl, lp, (k, v), window, post.map(|p| p.0))?
            }
            (Mixer::Linear, LayerCache::State(conv, rec)) => self.linear_mixer(hl, lp, (conv, rec))?,
            _ => bail!("layer {l}: its cache does not match its mixer"),
        }
        // Gemma 4 scales the residual after the layer: with the FFN's post-norm's sum.
        let scalar = match (hl.layer_scalar, self.cfg.style.layer_scalar) {
            (Some(x), true) if post.is_some() && matches!(kind.ffn, Ffn::Dense { .. } | Ffn::DenseAndMoe) => Some(x),
            (None, false) => None,
            _ => bail!("layer {l}: its layer scalar does not match its kind"),
        };
        // With per-layer embeddings the scalar comes after their block.
        let ffn_scalar = if hl.ple.is_some() { None } else { scalar };
        match kind.ffn {
            Ffn::Dense { gelu } => self.dense_ffn(l, hl, lp, gelu, post.map(|p| (p.1, ffn_scalar)))?,
            Ffn::Moe { .. } if post.is_some() => bail!("layer {l}: a mixture of experts with a post-FFN norm"),
            Ffn::Moe { gelu } => self.moe_ffn(hl, lp, gelu)?,
            Ffn::DenseAndMoe => {
                let post = post.ok_or_else(|| anyhow::anyhow!("layer {l}: Gemma 4's block without its post-norm"))?;
                self.parallel_moe_ffn(l, hl, lp, post.1, ffn_scalar)?
            }
        }
        match (&hl.ple, self.cfg.style.ple) {
            (Some(p), Some(_)) => self.ple_layer(l, p, lp, scalar)?,
            (None, None) => {}
            _ => bail!("layer {l}: its per-layer embedding block does not match the model"),
        }
        Ok(())
    }

    /// RMSNorm of the residual into `normed`.
    pub(crate) fn rms_norm(&mut self, lp: &LayerParams, weight: &[f32], label: &str) {
        let s = self.s;
        let w = self.storage(label, weight);
        let b = NormBinds { step: &s.step_buf, p: &lp.norm, x: &s.hidden, weight: &w, md: &s.meta_buf, y: &s.normed };
        self.push(norm::norm(&self.kernels.norm, self.g, &b, false, self.cfg.hidden));
    }

    /// A block's output projection `m` of `x` (plus `bias`), added into the residual: directly,
    /// or (`post`) through an RMSNorm with those weights (the projection goes to `normed` first),
    /// the residual then multiplied by the scalar where one is given (Gemma 4).
    pub(crate) fn project_out(
        &mut self,
        label: &'static str,
        (m, bias): (&GpuMatrix, Option<&wgpu::Buffer>),
        x: &wgpu::Buffer,
        lp: &LayerParams,
        post: Option<(&[f32], Option<f32>)>,
    ) {
        let (s, h) = (self.s, self.cfg.hidden);
        let b = if bias.is_some() { MAT_BIAS } else { 0 };
        match post {
            None => self.matmul(label, m, (x, &s.hidden), (0, h), bias, MAT_ACCUMULATE | b, false, false),
            Some((weight, scale)) => {
                self.matmul(label, m, (x, &s.normed), (0, h), bias, b, false, false);
                let w = self.storage("post_norm", weight);
                let scaled = scale.map(|x| {
                    self.uniform(bytemuck::bytes_of(&NormParams::accumulating_scaled(h, self.cfg.rms_eps, x)))
                });
                let b = NormBinds {
                    step: &s.step_buf,
                    p: scaled.as_ref().unwrap_or(&lp.post_norm),
                    x: &s.normed,
                    weight: &w,
                    md: &s.meta_buf,
                    y: &s.hidden,
                };
                self.push(norm::norm(&self.kernels.norm, self.g, &b, false, h));
            }
        }
    }

    /// RMSNorm, SwiGLU or GeGLU (`gelu`; gate and up fused when they share a format; else the
    /// gate is written to act and the up projection's epilogue applies act(gate) * up), the down
    /// projection added into the residual (through the `post` norm).
    fn dense_ffn(
        &mut self,
        l: usize,
        hl: &HostLayer,
        lp: &LayerParams,
        gelu: bool,
        post: Option<(&[f32], Option<f32>)>,
    ) -> Result<()> {
        let (cfg, s) = (self.cfg, self.s);
        let (gu_m, up_m) = if hl.gate.format == hl.up.format {
            (self.upload("gate_up", &hl.gate, Some(&hl.up))?, None)
        } else {
            (self.upload("gate", &hl.gate, None)?, Some(self.upload("up", &hl.up, None)?))
        };
        let down_m = self.upload("down", &hl.down, None)?;
        self.rms_norm(lp, &hl.ffn_norm, "ffn_norm");
        let ffn = (0, cfg.layer_ffn(l));
        let act = if gelu { MAT_GELU } else { 0 };
        match &up_m {
            None => self.matmul("gate_up", &gu_m, (&s.normed, &s.act), ffn, None, act, false, true),
            Some(up) => {
                self.matmul("gate_up", &gu_m, (&s.normed, &s.act), ffn, None, 0, false, false);
                self.matmul("gate_up", up, (&s.normed, &s.act), ffn, None, MAT_SWIGLU_UP | act, false, false);
            }
        }
        self.project_out("down", (&down_m, None), &s.act, lp, post);
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
        shared_lm: Option<GpuMatrix>,
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
        self.push(norm::norm(&kern.norm, g, &b, true, cfg.hidden));
        let lm = match (shared_lm, host.tied, embed) {
            (Some(m), _, _) => m,
            (None, true, Some(e)) => e,
            (None, false, _) => match host.read_lm_head()? {
                Some(t) => self.upload("lm_head", &t, None)?,
                None => bail!("the output projection was not loaded from {}", host.source.display()),
            },
            _ => bail!("the output projection was not loaded from {}", host.source.display()),
        };
        // Gemma 2's final soft cap is the LM head's epilogue.
        let flags = if cfg.style.final_softcap.is_some() { MAT_SOFTCAP } else { 0 };
        self.matmul("lm_head", &lm, (&s.final_normed, &s.logits), (0, cfg.vocab), None, flags, true, false);
        let sp = SamplerParams { vocab: cfg.vocab as u32, off_params: off_params as u32, ..Default::default() };
        let sp = self.uniform(bytemuck::bytes_of(&sp));
        let b = AdjustBinds { step: &s.step_buf, p: &sp, md: &s.meta_buf, adj: &s.adjust_buf, logits: &s.logits };
        self.push(sample::logit_adjust(&kern.sample, g, &b, cfg.vocab));
        let b = SampleBinds { step: &s.step_buf, p: &sp, md: &s.meta_buf, logits: &s.logits, result: &s.result };
        self.push(sample::sample(&kern.sample, g, &b, cfg.vocab));
        self.matrices.push(lm);
        Ok(())
    }
}
