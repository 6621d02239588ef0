//! The attention mixer and its variants, as a layer's config and weights say: q/k/v in one
//! matmul or one per format (with biases), the per-head q/k (and v) norm, RoPE over the whole
//! head or part of it (a windowed layer's own RoPE base), the KV-cache write, attention global
//! or within a sliding window, with sinks, over a cache of its own or (KV sharing) an earlier
//! layer's with queries only, the output gate of gated attention, and the output projection
//! added into the residual, directly or through a post-norm.

use crate::model::builder::{LayerParams, OpBuilder};
use crate::model::layers::HostLayer;
use crate::ops::attention::{self, AttnBinds};
use crate::ops::matmul::MAT_BIAS;
use crate::ops::norm::{self, HeadNormBinds};
use crate::ops::rope::{self, RopeBinds};
use crate::weights::tensor::QTensor;
use crate::weights::upload::GpuMatrix;
use anyhow::{bail, Result};

impl OpBuilder<'_> {
    /// RMSNorm, q/k/v (one matmul, or one per format), the q/k norm, RoPE + KV write,
    /// attention (within `window`), the output projection added into the residual (through
    /// the `post` norm).
    pub(crate) fn attention_mixer(
        &mut self,
        l: usize,
        hl: &HostLayer,
        lp: &LayerParams,
        (k, v): (&[wgpu::Buffer], &[wgpu::Buffer]),
        window: Option<usize>,
        post: Option<&[f32]>,
    ) -> Result<()> {
        let (g, cfg, s, kern) = (self.g, self.cfg, self.s, self.kernels);
        let geom = cfg.geom(l);
        let kp = lp.attn_kind(cfg, l)?;
        // A KV-sharing layer (Gemma 4) computes queries only and reads another layer's cache.
        let shared = cfg.kv_source(l).is_some();
        // q, k and v in one matmul when they share a format (K-quant files often store v in
        // another), else three writing their columns of the qkv rows.
        let qkv_ms: Vec<(GpuMatrix, usize)> = if shared {
            vec![(self.upload("q_proj", &hl.q, None)?, 0)]
        } else if hl.q.format == hl.k.format && hl.k.format == hl.v.format {
            vec![(self.upload("qkv", &QTensor::concat_rows(&[&hl.q, &hl.k, &hl.v])?, None)?, 0)]
        } else {
            vec![
                (self.upload("q_proj", &hl.q, None)?, 0),
                (self.upload("k_proj", &hl.k, None)?, geom.q_dim()),
                (self.upload("v_proj", &hl.v, None)?, geom.q_dim() + geom.kv_dim()),
            ]
        };
        let o_m = self.upload("o_proj", &hl.o, None)?;
        let bias = hl.qkv_bias.as_ref().map(|b| self.storage("qkv_bias", b));
        let o_bias = hl.o_bias.as_ref().map(|b| self.storage("o_bias", b));
        let sinks = hl.sinks.as_ref().map(|b| self.storage("sinks", b));
        if sinks.is_some() != cfg.style.attn_sinks {
            bail!("a layer's attention sinks do not match the model's style");
        }

        self.rms_norm(lp, &hl.attn_norm, "attn_norm");
        let bias_flag = if bias.is_some() { MAT_BIAS } else { 0 };
        for (m, col0) in &qkv_ms {
            let io = (&s.normed, &s.qkv);
            self.matmul("qkv", m, io, (*col0, geom.qkv_dim()), bias.as_ref(), bias_flag, false, false);
        }
        if let Some(w) = &hl.qk_norm {
            let wb = self.storage("qk_norm", w);
            let b = HeadNormBinds { step: &s.step_buf, p: &kp.head_norm, weight: &wb, qkv: &s.qkv };
            let heads = match (shared, cfg.style.v_norm) {
                (true, _) => geom.heads,
                (false, true) => geom.heads + 2 * geom.kv_heads,
                (false, false) => geom.heads + geom.kv_heads,
            };
            self.push(norm::head_norm(&kern.norm, g, &b, heads, geom.head_dim));
        }
        let dims = geom.dims();
        // Windowed layers with a RoPE base of their own (Gemma 3) use its table.
        let cos_sin = match (&s.cos_sin_local, window) {
            (Some(local), Some(_)) => local,
            _ => &s.cos_sin,
        };
        let b = RopeBinds { step: &s.step_buf, p: &kp.rope, md: &s.meta_buf, cos_sin, qkv: &s.qkv };
        let rope_dims = if shared { (geom.heads, 0, geom.head_dim) } else { dims };
        self.push(rope::rope_kv(&kern.rope, g, &b, (k, v), rope_dims));
        let b = AttnBinds {
            step: &s.step_buf,
            p: &kp.attn,
            md: &s.meta_buf,
            qkv: &s.qkv,
            out: &s.attn,
            part: &s.part,
            sinks: sinks.as_ref().unwrap_or(&s.dummy),
        };
        self.push(attention::attention(&kern.attention, g, &b, (k, v), dims));
        match (&hl.attn_gate, cfg.style.attn_gate) {
            (Some(gate), true) => self.attn_output_gate(gate, lp)?,
            (None, false) => {}
            _ => bail!("a layer's output gate does not match the model's style"),
        }
        self.project_out("o_proj", (&o_m, o_bias.as_ref()), &s.attn, lp, post.map(|p| (p, None)));
        self.matrices.extend(qkv_ms.into_iter().map(|(m, _)| m));
        self.matrices.push(o_m);
        Ok(())
    }
}
