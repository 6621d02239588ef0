//! Gemma 4's mixture-of-experts block (26B-A4B): beside a dense GeGLU MLP, every token's top-k
//! experts of its own router, each path with norms of its own:
//! `h + post(post_1(mlp(pre(h))) + post_2(experts(pre_2(h))))`, the router reading
//! `rmsnorm(h) * scale * hidden^-1/2` (an RMSNorm with those weights), softmax over all experts,
//! top-k renormalised, then each chosen weight times its expert's `per_expert_scale`. The
//! experts run on the MoE kernels (ops/moe/).

use crate::model::builder::{LayerParams, OpBuilder};
use crate::model::config::ModelConfig;
use crate::model::layers::{HostLayer, WeightSource};
use crate::ops::matmul::MAT_GELU;
use crate::ops::moe::{self, MoeIo};
use crate::ops::norm::{self, NormBinds, NormParams};
use crate::weights::upload::GpuMatrix;
use anyhow::{anyhow, bail, Result};

/// What Gemma 4's block has beyond the experts.
pub struct ParallelMoe {
    /// The router's input scale [hidden] and each expert's weight scale [experts].
    pub router_scale: Vec<f32>,
    pub expert_scale: Vec<f32>,
    /// The norms before the experts, after the MLP and after the experts.
    pub pre_2: Vec<f32>,
    pub post_1: Vec<f32>,
    pub post_2: Vec<f32>,
}

impl ParallelMoe {
    pub fn floats(&self) -> usize {
        self.router_scale.len() + self.expert_scale.len() + self.pre_2.len() + self.post_1.len() + self.post_2.len()
    }
}

/// A format's names of the block's tensors beyond its experts (within a layer; the experts'
/// are the format's `ExpertNames`, model/blocks/experts.rs).
pub(crate) struct ParallelMoeNames {
    router_scale: &'static str,
    expert_scale: &'static str,
    pre_2: &'static str,
    post_1: &'static str,
    post_2: &'static str,
}

pub(crate) const HF_PARALLEL_MOE: ParallelMoeNames = ParallelMoeNames {
    router_scale: "router.scale",
    expert_scale: "router.per_expert_scale",
    pre_2: "pre_feedforward_layernorm_2.weight",
    post_1: "post_feedforward_layernorm_1.weight",
    post_2: "post_feedforward_layernorm_2.weight",
};

/// llama.cpp's names (conversion/gemma.py's Gemma4Model).
pub(crate) const GGUF_PARALLEL_MOE: ParallelMoeNames = ParallelMoeNames {
    router_scale: "ffn_gate_inp.scale",
    expert_scale: "ffn_down_exps.scale",
    pre_2: "pre_ffw_norm_2.weight",
    post_1: "post_ffw_norm_1.weight",
    post_2: "post_ffw_norm_2.weight",
};

/// A layer's router scales and norms (`t`: a name within the layer).
pub(crate) fn load(
    w: &dyn WeightSource,
    n: &ParallelMoeNames,
    t: &dyn Fn(&str) -> String,
    cfg: &ModelConfig,
) -> Result<ParallelMoe> {
    let (h, e) = (cfg.hidden, cfg.moe.as_ref().ok_or_else(|| anyhow!("the model has no experts"))?.experts);
    Ok(ParallelMoe {
        router_scale: w.vector(&t(n.router_scale), h)?,
        expert_scale: w.vector(&t(n.expert_scale), e)?,
        pre_2: w.vector(&t(n.pre_2), h)?,
        post_1: w.vector(&t(n.post_1), h)?,
        post_2: w.vector(&t(n.post_2), h)?,
    })
}

impl OpBuilder<'_> {
    /// RMSNorm of the rows of `x` with `weight` into `y` (written, or added with `p` the
    /// accumulating parameters).
    fn norm_rows(&mut self, p: &wgpu::Buffer, (x, y): (&wgpu::Buffer, &wgpu::Buffer), weight: &[f32], label: &str) {
        let s = self.s;
        let w = self.storage(label, weight);
        let b = NormBinds { step: &s.step_buf, p, x, weight: &w, md: &s.meta_buf, y };
        self.push(norm::norm(&self.kernels.norm, self.g, &b, false, self.cfg.hidden));
    }

    /// The block of layer `l` (see the module's doc), its sum added into the residual through
    /// the FFN's post-norm `post`, the residual then multiplied by `scalar` where given.
    pub(crate) fn parallel_moe_ffn(
        &mut self,
        l: usize,
        hl: &HostLayer,
        lp: &LayerParams,
        post: &[f32],
        scalar: Option<f32>,
    ) -> Result<()> {
        let (cfg, s, h) = (self.cfg, self.s, self.cfg.hidden);
        let hm = hl.moe.as_ref().ok_or_else(|| anyhow!("layer {l}: no experts"))?;
        let gm = hm.parallel.as_ref().ok_or_else(|| anyhow!("layer {l}: no router scales"))?;
        let mc = cfg.moe.as_ref().ok_or_else(|| anyhow!("the model has no experts"))?;
        let (Some(logits), Some(route), Some(pair_out), Some(layout)) =
            (&s.moe_logits, &s.moe_route, &s.moe_pair_out, s.moe_layout)
        else {
            bail!("the step has no MoE scratch");
        };
        // The sum of both paths' normed outputs (attention's output buffer is free here).
        let sum = &s.attn;
        // The dense MLP, its output normed into `sum`.
        if hl.gate.format != hl.up.format {
            bail!("layer {l}: the MLP's gate and up projections differ in format");
        }
        let gu = self.upload("gate_up", &hl.gate, Some(&hl.up))?;
        let down = self.upload("down", &hl.down, None)?;
        self.rms_norm(lp, &hl.ffn_norm, "ffn_norm");
        self.matmul("gate_up", &gu, (&s.normed, &s.act), (0, cfg.layer_ffn(l)), None, MAT_GELU, false, true);
        self.matmul("down", &down, (&s.act, &s.normed), (0, h), None, 0, false, false);
        self.norm_rows(&lp.norm, (&s.normed, sum), &gm.post_1, "post_ffw_norm_1");
        // The router: rmsnorm(h) * scale * hidden^-1/2, its logits.
        let inv = 1.0 / (h as f32).sqrt();
        let rw: Vec<f32> = gm.router_scale.iter().map(|x| x * inv).collect();
        self.rms_norm(lp, &rw, "router_norm");
        let router = self.upload("router", &hm.router, None)?;
        self.matmul("router", &router, (&s.normed, logits), (0, mc.experts), None, 0, false, false);
        // The experts on pre_2(h), their weighted sum written to `normed`, normed into `sum`.
        self.rms_norm(lp, &gm.pre_2, "pre_ffw_norm_2");
        let spec = mc.spec(true);
        let gate_up = GpuMatrix::upload_grouped(self.g, "experts_gate_up", &hm.gate_up, 2 * mc.ffn, self.mb)?;
        let experts_down = GpuMatrix::upload_grouped(self.g, "experts_down", &hm.down, h, self.mb)?;
        let scale = self.storage("per_expert_scale", &gm.expert_scale);
        let io = MoeIo {
            step: &s.step_buf,
            logits,
            route,
            x: &s.normed,
            act: &s.act,
            pair_out,
            layout,
            hidden: &s.normed,
            dummy: &s.dummy,
        };
        let ops = moe::route(&self.kernels.moe, self.g, &spec, &io, Some(&scale));
        self.extend(ops);
        let ops = moe::experts(&self.kernels.moe, self.g, &spec, &gate_up, &io, false, None);
        self.extend(ops);
        let ops = moe::experts(&self.kernels.moe, self.g, &spec, &experts_down, &io, true, None);
        self.extend(ops);
        let (op, p) = moe::combine(&self.kernels.moe, self.g, &spec, &io, h, true);
        self.extend((vec![op], vec![p]));
        self.norm_rows(&lp.post_norm, (&s.normed, sum), &gm.post_2, "post_ffw_norm_2");
        // Into the residual through the FFN's post-norm, then the layer's scalar.
        let p =
            self.uniform(bytemuck::bytes_of(&NormParams::accumulating_scaled(h, cfg.rms_eps, scalar.unwrap_or(1.0))));
        self.norm_rows(&p, (sum, &s.hidden), post, "post_ffw_norm");
        self.matrices.extend([gu, down, router, gate_up, experts_down]);
        Ok(())
    }
}
