//! Gemma 4's per-layer embeddings (E2B / E4B): each token gets, for every layer, a small vector
//! made of its own row of a token table (times sqrt(P)) and a projection of its embedding
//! (times hidden^-1/2, RMS-normed per layer), summed and times 2^-1/2; after each layer's FFN the
//! residual's gate projection through tanh-GELU times that vector is projected back, normed and
//! added into the residual. The model's prologue writes every layer's vectors into the `ple`
//! buffer (`ple_inputs`); each layer reads its slice (`ple_layer`).

use crate::model::builder::{LayerParams, OpBuilder};
use crate::model::config::ModelConfig;
use crate::model::layers::WeightSource;
use crate::ops::matmul;
use crate::ops::norm::{self, HeadNormBinds, HeadNormParams};
use crate::ops::ple::{self, PleBinds, PleParams};
use crate::weights::tensor::QTensor;
use crate::weights::upload::GpuMatrix;
use anyhow::{anyhow, Result};

/// The per-layer embeddings' tensor names of a format.
pub(crate) struct PleNames {
    /// [tokens, layers x P], the token table.
    pub embed: &'static str,
    /// [layers x P, hidden], the context projection of the token's embedding.
    pub model_proj: &'static str,
    /// [P], the projection's norm.
    pub proj_norm: &'static str,
    /// Per layer: [P, hidden] the residual's gate, [hidden, P] the way back, [hidden] its norm.
    pub gate: &'static str,
    pub proj: &'static str,
    pub post_norm: &'static str,
}

pub(crate) const HF_PLE: PleNames = PleNames {
    embed: "model.embed_tokens_per_layer.weight",
    model_proj: "model.per_layer_model_projection.weight",
    proj_norm: "model.per_layer_projection_norm.weight",
    gate: "per_layer_input_gate.weight",
    proj: "per_layer_projection.weight",
    post_norm: "post_per_layer_input_norm.weight",
};

/// The same inside `Gemma4ForConditionalGeneration` (the multimodal checkpoints).
pub(crate) const VL_HF_PLE: PleNames = PleNames {
    embed: "model.language_model.embed_tokens_per_layer.weight",
    model_proj: "model.language_model.per_layer_model_projection.weight",
    proj_norm: "model.language_model.per_layer_projection_norm.weight",
    ..HF_PLE
};

/// llama.cpp's names (conversion/gemma.py's Gemma4Model).
pub(crate) const GGUF_PLE: PleNames = PleNames {
    embed: "per_layer_token_embd.weight",
    model_proj: "per_layer_model_proj.weight",
    proj_norm: "per_layer_proj_norm.weight",
    gate: "inp_gate.weight",
    proj: "proj.weight",
    post_norm: "post_norm.weight",
};

/// The model-level tensors (on the first stage).
pub struct HostPle {
    pub embed: QTensor,
    pub model_proj: QTensor,
    pub proj_norm: Vec<f32>,
}

/// One layer's block.
pub struct HostPleLayer {
    pub gate: QTensor,
    pub proj: QTensor,
    pub post_norm: Vec<f32>,
}

/// The model-level tensors, where the model has per-layer embeddings.
pub(crate) fn load(w: &dyn WeightSource, n: &PleNames, cfg: &ModelConfig) -> Result<Option<HostPle>> {
    let Some((p, vocab)) = cfg.style.ple else { return Ok(None) };
    let wide = cfg.layers * p;
    Ok(Some(HostPle {
        embed: w.matrix(n.embed, vocab, wide)?,
        model_proj: w.matrix(n.model_proj, wide, cfg.hidden)?,
        proj_norm: w.vector(n.proj_norm, p)?,
    }))
}

/// Layer tensors (`t`: a name within the layer), where the model has per-layer embeddings.
pub(crate) fn load_layer(
    w: &dyn WeightSource,
    n: &PleNames,
    t: &dyn Fn(&str) -> String,
    cfg: &ModelConfig,
) -> Result<Option<HostPleLayer>> {
    let Some((p, _)) = cfg.style.ple else { return Ok(None) };
    let h = cfg.hidden;
    Ok(Some(HostPleLayer {
        gate: w.matrix(&t(n.gate), p, h)?,
        proj: w.matrix(&t(n.proj), h, p)?,
        post_norm: w.vector(&t(n.post_norm), h)?,
    }))
}

impl OpBuilder<'_> {
    /// The prologue after the embedding: every layer's per-layer input of every token into
    /// `ple`: (norm(proj(e) * hidden^-1/2) + table[token] * sqrt(P)) * 2^-1/2, e the scaled
    /// embedding. The projection's scale moves into the norm's epsilon (norm(c x) is x over
    /// sqrt(mean(x^2) + eps / c^2)), 2^-1/2 into its weights and the table's scale.
    pub(crate) fn ple_inputs(&mut self, host: &HostPle) -> Result<()> {
        let (cfg, s) = (self.cfg, self.s);
        let (p, _) = cfg.style.ple.ok_or_else(|| anyhow!("per-layer embeddings without their size"))?;
        let ple = s.ple.as_ref().ok_or_else(|| anyhow!("no per-layer embedding buffer"))?;
        let (layers, wide) = (cfg.layers, cfg.layers * p);
        let half = std::f32::consts::FRAC_1_SQRT_2;
        let proj = self.upload("ple_model_proj", &host.model_proj, None)?;
        self.matmul_from_residual("ple_proj", &proj, ple, wide);
        let weight: Vec<f32> = host.proj_norm.iter().map(|w| w * half).collect();
        let wb = self.storage("ple_proj_norm", &weight);
        // Rows of P floats: `layers` "heads" per token.
        let params = HeadNormParams::new(layers, 0, p, cfg.rms_eps * cfg.hidden as f32);
        let pb = self.uniform(bytemuck::bytes_of(&params));
        let b = HeadNormBinds { step: &s.step_buf, p: &pb, weight: &wb, qkv: ple };
        self.push(norm::head_norm(&self.kernels.norm, self.g, &b, layers, p));
        let table = self.upload("ple_embed", &host.embed, None)?;
        let scale = (p as f32).sqrt() * half;
        let ops =
            matmul::embed(&self.kernels.matmul, self.g, &table, (scale, true), &s.step_buf, &s.meta_buf, &s.dummy, ple);
        self.extend(ops);
        self.matrices.extend([proj, table]);
        Ok(())
    }

    /// y (rows of `width` floats) = the residual times `m`: x read from storage (the residual
    /// buffer has no uniform usage for the cpu profile's uniform-x windows).
    fn matmul_from_residual(&mut self, label: &'static str, m: &GpuMatrix, y: &wgpu::Buffer, width: usize) {
        let uniform_x = std::mem::replace(&mut self.uniform_x, false);
        let x = &self.s.hidden;
        self.matmul(label, m, (x, y), (0, width), None, 0, false, false);
        self.uniform_x = uniform_x;
    }

    /// Layer `l`'s block after its FFN: gelu(gate(h)) * its per-layer input, projected back,
    /// normed and added into the residual, which is then multiplied by the layer's `scalar`.
    pub(crate) fn ple_layer(
        &mut self,
        l: usize,
        hl: &HostPleLayer,
        lp: &LayerParams,
        scalar: Option<f32>,
    ) -> Result<()> {
        let (cfg, s) = (self.cfg, self.s);
        let p = cfg.ple_dim();
        let ple = s.ple.as_ref().ok_or_else(|| anyhow!("no per-layer embedding buffer"))?;
        let gate = self.upload("ple_gate", &hl.gate, None)?;
        let back = self.upload("ple_proj", &hl.proj, None)?;
        self.matmul_from_residual("ple_in", &gate, &s.act, p);
        let pb = self.uniform(bytemuck::bytes_of(&PleParams::new(p, cfg.layers, l)));
        let b = PleBinds { step: &s.step_buf, p: &pb, ple, y: &s.act };
        self.push(ple::ple_gate(&self.kernels.ple, self.g, &b, p));
        self.project_out("ple_proj", (&back, None), &s.act, lp, Some((&hl.post_norm, scalar)));
        self.matrices.extend([gate, back]);
        Ok(())
    }
}
