//! Mixture-of-experts FFNs (Qwen3-MoE, Qwen2-MoE; the layer kind gpt-oss also uses): what the
//! configs say (`MoeConfig`), the host layout of a layer's experts (`HostMoe`: one matrix per
//! projection with an expert dimension, read by model/blocks/experts.rs), and the layer's ops:
//! RMSNorm, the router matmul, the GPU's top-k routing, the chosen experts' gate/up and down
//! projections summed into the residual (ops/moe/), and a shared expert where the model has
//! one (a dense FFN every token runs, scaled by the sigmoid of its own gate: Qwen2-MoE's). No
//! host round trip inside a step.

use crate::formats::gguf::GgufFile;
use crate::model::builder::{LayerParams, OpBuilder};
use crate::model::layers::HostLayer;
use crate::ops::matmul::{MAT_ACCUMULATE, MAT_BIAS, MAT_GELU, MAT_SWIGLU_UP};
use crate::ops::moe::{self, MoeIo, MoeSpec, MAX_EXPERTS, MAX_ROUTE_WORK, MAX_TOP_K};
use crate::weights::tensor::QTensor;
use anyhow::{anyhow, bail, Result};
use serde_json::Value;

/// A model's mixture-of-experts layers.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Each expert's intermediate size.
    pub ffn: usize,
    /// The chosen experts' weights are renormalised to sum to 1 (Qwen3-MoE's norm_topk_prob).
    pub norm_topk: bool,
    /// Per layer: its FFN is the mixture (else the dense FFN of `intermediate_size`).
    pub sparse_layers: Vec<bool>,
    /// gpt-oss's clamped SwiGLU (alpha, limit) instead of the model's activation.
    pub clamped: Option<(f32, f32)>,
    /// The shared expert's intermediate size (Qwen2-MoE's shared_expert_intermediate_size;
    /// 0: none).
    pub shared_ffn: usize,
}

impl MoeConfig {
    /// What the ops need, with the model's activation.
    pub fn spec(&self, gelu: bool) -> MoeSpec {
        MoeSpec {
            experts: self.experts,
            top_k: self.top_k,
            ffn: self.ffn,
            norm: self.norm_topk,
            gelu,
            clamped: self.clamped,
        }
    }

    pub fn is_sparse(&self, l: usize) -> bool {
        self.sparse_layers.get(l).copied().unwrap_or(false)
    }

    pub fn validate(&self, layers: usize, src: &str) -> Result<()> {
        if self.experts == 0 || self.experts > MAX_EXPERTS {
            bail!("{src}: {} experts (supported: 1 to {MAX_EXPERTS})", self.experts);
        }
        if self.top_k == 0 || self.top_k > self.experts.min(MAX_TOP_K) || self.top_k * self.experts > MAX_ROUTE_WORK {
            bail!(
                "{src}: {} experts per token of {} (supported: 1 to {MAX_TOP_K}, with experts per token times experts at \
                 most {MAX_ROUTE_WORK})",
                self.top_k,
                self.experts
            );
        }
        if self.ffn == 0 || !self.ffn.is_multiple_of(32) {
            bail!("{src}: the experts' intermediate size {} must be a positive multiple of 32", self.ffn);
        }
        if self.clamped.is_some_and(|(a, l)| !(a > 0.0 && a.is_finite() && l > 0.0 && l.is_finite())) {
            bail!("{src}: the clamped SwiGLU's alpha and limit must be positive and finite");
        }
        if self.shared_ffn > 0 && !self.shared_ffn.is_multiple_of(32) {
            bail!("{src}: the shared expert's intermediate size {} must be a multiple of 32", self.shared_ffn);
        }
        if self.sparse_layers.len() != layers {
            bail!("{src}: {} per-layer FFN kinds for {layers} layers", self.sparse_layers.len());
        }
        Ok(())
    }
}

/// Qwen3-MoE's and Qwen2-MoE's config.json: num_experts (or num_local_experts),
/// num_experts_per_tok, moe_intermediate_size, norm_topk_prob, shared_expert_intermediate_size
/// (Qwen2-MoE), and the sparse layers: every decoder_sparse_step-th (layer l is sparse when
/// (l + 1) % step == 0) except those in mlp_only_layers.
pub(crate) fn hf_config(v: &Value, layers: usize, src: &str) -> Result<MoeConfig> {
    let int = |k: &str| v[k].as_u64().map(|x| x as usize);
    let experts = int("num_experts")
        .or_else(|| int("num_local_experts"))
        .ok_or_else(|| anyhow!("{src}: field 'num_experts' is missing"))?;
    let step = int("decoder_sparse_step").unwrap_or(1).max(1);
    let dense: Vec<usize> = v["mlp_only_layers"]
        .as_array()
        .map(|a| a.iter().filter_map(|x| x.as_u64().map(|x| x as usize)).collect())
        .unwrap_or_default();
    let c = MoeConfig {
        experts,
        top_k: int("num_experts_per_tok").ok_or_else(|| anyhow!("{src}: field 'num_experts_per_tok' is missing"))?,
        ffn: int("moe_intermediate_size").ok_or_else(|| anyhow!("{src}: field 'moe_intermediate_size' is missing"))?,
        norm_topk: v["norm_topk_prob"].as_bool().unwrap_or(false),
        sparse_layers: (0..layers).map(|l| !dense.contains(&l) && (l + 1) % step == 0).collect(),
        clamped: None,
        shared_ffn: int("shared_expert_intermediate_size").unwrap_or(0),
    };
    c.validate(layers, src)?;
    Ok(c)
}

/// A GGUF file's MoE metadata (`<arch>.expert_count`, `.expert_used_count`,
/// `.expert_feed_forward_length`, `.expert_shared_feed_forward_length`, `.expert_weights_norm`,
/// where absent `norm_default`: true for Qwen3-MoE, false for Qwen2-MoE, as llama.cpp has them);
/// a layer is sparse when it has a router tensor (`ffn_gate_inp`).
pub(crate) fn gguf_config(g: &GgufFile, arch: &str, layers: usize, norm_default: bool) -> Result<MoeConfig> {
    let src = g.path.display().to_string();
    let key = |k: &str| format!("{arch}.{k}");
    let c = MoeConfig {
        experts: g.require_u64(&key("expert_count"))? as usize,
        top_k: g.require_u64(&key("expert_used_count"))? as usize,
        ffn: g.require_u64(&key("expert_feed_forward_length"))? as usize,
        norm_topk: g.get_bool(&key("expert_weights_norm")).unwrap_or(norm_default),
        sparse_layers: (0..layers).map(|l| g.tensor(&format!("blk.{l}.ffn_gate_inp.weight")).is_some()).collect(),
        clamped: None,
        shared_ffn: g.get_u64(&key("expert_shared_feed_forward_length")).unwrap_or(0) as usize,
    };
    c.validate(layers, &src)?;
    Ok(c)
}

/// One MoE layer's weights on the host: the router [experts, hidden], each expert's gate rows
/// then up rows [experts * 2 * ffn, hidden], the down projections [experts * hidden, ffn].
pub struct HostMoe {
    pub router: QTensor,
    pub router_bias: Option<Vec<f32>>,
    pub gate_up: QTensor,
    pub down: QTensor,
    /// Per-expert biases of gate/up and of down, in the same row order (gpt-oss).
    pub biases: Option<(Vec<f32>, Vec<f32>)>,
    /// The shared expert (Qwen2-MoE).
    pub shared: Option<SharedExpert>,
    /// Gemma 4's router scales and extra norms (model/blocks/parallel_moe.rs).
    pub parallel: Option<crate::model::blocks::parallel_moe::ParallelMoe>,
}

/// A dense FFN every token of a MoE layer runs beside its chosen experts, its output scaled by
/// sigmoid(gate . x) where the model has that gate.
pub struct SharedExpert {
    pub gate: QTensor,
    pub up: QTensor,
    pub down: QTensor,
    /// The gate's row [1, hidden], or None.
    pub gate_inp: Option<QTensor>,
}

impl HostMoe {
    pub fn bytes(&self) -> usize {
        let b =
            self.biases.as_ref().map_or(0, |(a, b)| a.len() + b.len()) + self.router_bias.as_ref().map_or(0, Vec::len);
        let shared = self.shared.as_ref().map_or(0, |s| {
            s.gate.bytes() + s.up.bytes() + s.down.bytes() + s.gate_inp.as_ref().map_or(0, QTensor::bytes)
        });
        let parallel = self.parallel.as_ref().map_or(0, |g| 4 * g.floats());
        self.router.bytes() + self.gate_up.bytes() + self.down.bytes() + 4 * b + shared + parallel
    }
}

impl OpBuilder<'_> {
    /// RMSNorm, the router (its logits, then each token's experts and weights on the GPU), the
    /// chosen experts' gate/up with the gated activation, their down projections weighted and
    /// added into the residual.
    pub(crate) fn moe_ffn(&mut self, hl: &HostLayer, lp: &LayerParams, gelu: bool) -> Result<()> {
        let (cfg, s) = (self.cfg, self.s);
        let hm = hl.moe.as_ref().ok_or_else(|| anyhow!("a mixture-of-experts layer without its experts"))?;
        let mc = cfg.moe.as_ref().ok_or_else(|| anyhow!("the model has no experts"))?;
        let (Some(logits), Some(route), Some(pair_out), Some(layout)) =
            (&s.moe_logits, &s.moe_route, &s.moe_pair_out, s.moe_layout)
        else {
            bail!("the step has no MoE scratch");
        };
        let spec = mc.spec(gelu);
        let router = self.upload("router", &hm.router, None)?;
        let gate_up = crate::weights::upload::GpuMatrix::upload_grouped(
            self.g,
            "experts_gate_up",
            &hm.gate_up,
            2 * mc.ffn,
            self.mb,
        )?;
        let down =
            crate::weights::upload::GpuMatrix::upload_grouped(self.g, "experts_down", &hm.down, cfg.hidden, self.mb)?;
        let rbias = hm.router_bias.as_ref().map(|b| self.storage("router_bias", b));
        let biases =
            hm.biases.as_ref().map(|(a, b)| (self.storage("experts_bias", a), self.storage("experts_bias", b)));
        self.rms_norm(lp, &hl.ffn_norm, "ffn_norm");
        let flags = if rbias.is_some() { MAT_BIAS } else { 0 };
        self.matmul("router", &router, (&s.normed, logits), (0, mc.experts), rbias.as_ref(), flags, false, false);
        let io = MoeIo {
            step: &s.step_buf,
            logits,
            route,
            x: &s.normed,
            act: &s.act,
            pair_out,
            layout,
            hidden: &s.hidden,
            dummy: &s.dummy,
        };
        let ops = moe::route(&self.kernels.moe, self.g, &spec, &io, None);
        self.extend(ops);
        let ops = moe::experts(&self.kernels.moe, self.g, &spec, &gate_up, &io, false, biases.as_ref().map(|b| &b.0));
        self.extend(ops);
        let ops = moe::experts(&self.kernels.moe, self.g, &spec, &down, &io, true, biases.as_ref().map(|b| &b.1));
        self.extend(ops);
        let (op, p) = moe::combine(&self.kernels.moe, self.g, &spec, &io, cfg.hidden, false);
        self.extend((vec![op], vec![p]));
        self.matrices.extend([router, gate_up, down]);
        if let Some(sh) = &hm.shared {
            self.shared_expert(sh, &spec, &io, gelu)?;
        }
        Ok(())
    }

    /// The shared expert on the normed rows: gate/up with the activation into act, scaled by
    /// the sigmoid of its gate's logit (written to column 0 of the router's logits, which the
    /// routing has consumed), the down projection added into the residual.
    fn shared_expert(&mut self, sh: &SharedExpert, spec: &MoeSpec, io: &MoeIo, gelu: bool) -> Result<()> {
        let (s, sf) = (self.s, sh.gate.rows);
        let act = if gelu { MAT_GELU } else { 0 };
        if sh.gate.format == sh.up.format {
            let gu = self.upload("shexp_gate_up", &sh.gate, Some(&sh.up))?;
            self.matmul("shexp_gate_up", &gu, (&s.normed, &s.act), (0, sf), None, act, false, true);
            self.matrices.push(gu);
        } else {
            let (g, u) = (self.upload("shexp_gate", &sh.gate, None)?, self.upload("shexp_up", &sh.up, None)?);
            self.matmul("shexp_gate_up", &g, (&s.normed, &s.act), (0, sf), None, 0, false, false);
            self.matmul("shexp_gate_up", &u, (&s.normed, &s.act), (0, sf), None, MAT_SWIGLU_UP | act, false, false);
            self.matrices.extend([g, u]);
        }
        if let Some(gi) = &sh.gate_inp {
            let gm = self.upload("shexp_gate_inp", gi, None)?;
            self.matmul("shexp_gate_inp", &gm, (&s.normed, io.logits), (0, spec.experts), None, 0, false, false);
            let (op, p) = moe::shared_gate(&self.kernels.moe, self.g, spec, io, sf);
            self.extend((vec![op], vec![p]));
            self.matrices.push(gm);
        }
        let down = self.upload("shexp_down", &sh.down, None)?;
        self.matmul("shexp_down", &down, (&s.act, &s.hidden), (0, self.cfg.hidden), None, MAT_ACCUMULATE, false, false);
        self.matrices.push(down);
        Ok(())
    }
}
