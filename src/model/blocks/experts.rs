//! Reading a layer's experts, from any checkpoint, with one loader: a format says how it names
//! and lays out its experts ([`ExpertNames`], a value beside its other tensor names), and
//! [`load`] reads them into the one host layout the MoE ops take ([`HostMoe`]): the router
//! [experts, hidden], every expert's gate rows then up rows [experts * 2 * ffn, hidden], the
//! down projections [experts * hidden, ffn], the biases and the shared expert where the names
//! give them.
//!
//! The layouts the formats use:
//! - GGUF: 3-D `*_exps` tensors, gate and up apart or (newer converters) fused, gate rows then
//!   up rows per expert;
//! - Hugging Face, one matrix per expert (`{e}` in the name: Qwen-MoE, Qwen3.5);
//! - Hugging Face, one 3-D tensor [experts, rows, cols] per projection (Gemma 4), or MXFP4
//!   `*_blocks`/`*_scales` (gpt-oss's published checkpoints): the weight source reads both;
//! - the gate's and up's rows alternating within an expert (gpt-oss's fused tensors), and float
//!   tensors stored [experts, cols, rows] (transformers' gpt-oss).

use super::moe::{HostMoe, SharedExpert};
use crate::model::config::ModelConfig;
use crate::model::layers::WeightSource;
use crate::weights::tensor::QTensor;
use anyhow::{anyhow, bail, Result};

/// How a format names (within a layer; "" where it has none) and lays out a layer's experts.
#[derive(Clone, Copy)]
pub(crate) struct ExpertNames {
    pub router: &'static str,
    /// Every expert's gate and up projections as one tensor: read in place of `gate` and `up`
    /// where the file has it (or where those are "").
    pub gate_up: &'static str,
    /// The gate's and up's projections apart (`{e}`: the expert's index, where stored per
    /// expert).
    pub gate: &'static str,
    pub up: &'static str,
    pub down: &'static str,
    /// The fused tensor's rows alternate gate, up within an expert (else gate rows, then up).
    pub alternating: bool,
    /// Float experts are stored [experts, cols, rows] (else [experts, rows, cols]).
    pub transposed: bool,
    /// Biases of the router and of each expert's projections (read where named: gpt-oss's):
    /// the router's [experts], the projections' [experts, rows].
    pub router_bias: &'static str,
    pub gate_up_bias: &'static str,
    pub gate_bias: &'static str,
    pub up_bias: &'static str,
    pub down_bias: &'static str,
    /// A shared expert's projections and its gate (read where the config gives it a size).
    pub gate_shexp: &'static str,
    pub up_shexp: &'static str,
    pub down_shexp: &'static str,
    pub gate_inp_shexp: &'static str,
}

/// Hugging Face (transformers) names: one matrix per expert.
pub(crate) const HF_EXPERTS: ExpertNames = ExpertNames {
    router: "mlp.gate.weight",
    gate_up: "",
    gate: "mlp.experts.{e}.gate_proj.weight",
    up: "mlp.experts.{e}.up_proj.weight",
    down: "mlp.experts.{e}.down_proj.weight",
    alternating: false,
    transposed: false,
    router_bias: "",
    gate_up_bias: "",
    gate_bias: "",
    up_bias: "",
    down_bias: "",
    gate_shexp: "mlp.shared_expert.gate_proj.weight",
    up_shexp: "mlp.shared_expert.up_proj.weight",
    down_shexp: "mlp.shared_expert.down_proj.weight",
    gate_inp_shexp: "mlp.shared_expert_gate.weight",
};

/// llama.cpp's GGUF names.
pub(crate) const GGUF_EXPERTS: ExpertNames = ExpertNames {
    router: "ffn_gate_inp.weight",
    gate_up: "ffn_gate_up_exps.weight",
    gate: "ffn_gate_exps.weight",
    up: "ffn_up_exps.weight",
    down: "ffn_down_exps.weight",
    alternating: false,
    transposed: false,
    router_bias: "",
    gate_up_bias: "",
    gate_bias: "",
    up_bias: "",
    down_bias: "",
    gate_shexp: "ffn_gate_shexp.weight",
    up_shexp: "ffn_up_shexp.weight",
    down_shexp: "ffn_down_shexp.weight",
    gate_inp_shexp: "ffn_gate_inp_shexp.weight",
};

/// Layer `t`'s experts (`t` names a tensor of the layer) as the names `n` say; Gemma 4's extra
/// router scales and norms are its block's (`parallel` stays None here).
pub(crate) fn load(
    w: &dyn WeightSource,
    n: &ExpertNames,
    t: &dyn Fn(&str) -> String,
    cfg: &ModelConfig,
) -> Result<HostMoe> {
    let m = cfg.moe.as_ref().ok_or_else(|| anyhow!("the model has no experts"))?;
    let (h, e, f) = (cfg.hidden, m.experts, m.ffn);
    let at_layer = |err: anyhow::Error| anyhow!("{}: layer {}: {err}", w.path().display(), t(""));
    let named = |name: &'static str| (!name.is_empty()).then_some(name);
    let biases = |name: &'static str, rows: usize| -> Result<Option<Vec<f32>>> {
        named(name).map(|b| Ok(w.array(&t(b), &[e, rows])?.0)).transpose()
    };
    let router = w.matrix(&t(n.router), e, h)?;
    let router_bias = named(n.router_bias).map(|b| w.vector(&t(b), e)).transpose()?;
    let fused = !n.gate_up.is_empty() && (n.gate.is_empty() || w.has(&t(n.gate_up)));
    let (gate_up, gate_up_bias) = if fused {
        let gate_up = stacked(w, n, &t(n.gate_up), (e, 2 * f, h)).map_err(at_layer)?;
        let bias = biases(n.gate_up_bias, 2 * f)?;
        if n.alternating {
            let order: Vec<usize> = (0..e).flat_map(|x| (0..2 * f).map(move |r| x * 2 * f + alternate(r, f))).collect();
            (gate_up.permute_rows(&order), bias.map(|b| order.iter().map(|&r| b[r]).collect()))
        } else {
            (gate_up, bias)
        }
    } else {
        let gate = w.experts(&t(n.gate), e, f, h)?;
        let up = w.experts(&t(n.up), e, f, h)?;
        let bias = match (biases(n.gate_bias, f)?, biases(n.up_bias, f)?) {
            (Some(g), Some(u)) => {
                Some((0..e).flat_map(|x| g[x * f..(x + 1) * f].iter().chain(&u[x * f..(x + 1) * f])).copied().collect())
            }
            _ => None,
        };
        (interleave_groups(&gate, &up, f).map_err(at_layer)?, bias)
    };
    let down = stacked(w, n, &t(n.down), (e, h, f)).map_err(at_layer)?;
    let biases = match (gate_up_bias, biases(n.down_bias, h)?) {
        (Some(a), Some(b)) => Some((a, b)),
        (None, None) => None,
        _ => bail!("{}: layer {}: the experts' gate/up and down biases are not both named", w.path().display(), t("")),
    };
    let shared = (m.shared_ffn > 0).then(|| load_shared(w, n, t, h, m.shared_ffn)).transpose()?;
    Ok(HostMoe { router, router_bias, gate_up, down, biases, shared, parallel: None })
}

/// Within one expert of fused alternating rows, the stored row of our row `r` (gate rows, then
/// up rows).
fn alternate(r: usize, f: usize) -> usize {
    if r < f {
        2 * r
    } else {
        2 * (r - f) + 1
    }
}

/// One projection of every expert, [experts * rows, cols]: a float tensor stored transposed
/// where the names say so, else as the weight source stores experts.
fn stacked(
    w: &dyn WeightSource,
    n: &ExpertNames,
    name: &str,
    (e, rows, cols): (usize, usize, usize),
) -> Result<QTensor> {
    if !(n.transposed && w.has(name)) {
        return w.experts(name, e, rows, cols);
    }
    let (v, f32) = w.array(name, &[e, cols, rows])?;
    let mut out = Vec::with_capacity(v.len());
    for ex in v.chunks_exact(rows * cols) {
        for r in 0..rows {
            out.extend((0..cols).map(|c| ex[c * rows + r]));
        }
    }
    if f32 {
        QTensor::from_f32(e * rows, cols, &out)
    } else {
        QTensor::from_f32_as_f16(e * rows, cols, &out)
    }
}

/// Rows of `a` and `b` ([groups * unit, cols] each) interleaved a group at a time: a's group g,
/// then b's group g.
pub fn interleave_groups(a: &QTensor, b: &QTensor, unit: usize) -> Result<QTensor> {
    if a.format != b.format || a.cols != b.cols || a.rows != b.rows || unit == 0 || !a.rows.is_multiple_of(unit) {
        bail!(
            "expert gate and up tensors differ ({:?} [{}, {}] and {:?} [{}, {}]) or are not whole experts of {unit} rows",
            a.format,
            a.rows,
            a.cols,
            b.format,
            b.rows,
            b.cols
        );
    }
    let (wq, ws) = (a.q.len() / a.rows.max(1), a.s.len() / a.rows.max(1));
    let mut out = QTensor { format: a.format, rows: 2 * a.rows, cols: a.cols, q: Vec::new(), s: Vec::new() };
    out.q.reserve(2 * a.q.len());
    out.s.reserve(2 * a.s.len());
    for g in 0..a.rows / unit {
        for t in [a, b] {
            out.q.extend_from_slice(&t.q[g * unit * wq..(g + 1) * unit * wq]);
            out.s.extend_from_slice(&t.s[g * unit * ws..(g + 1) * unit * ws]);
        }
    }
    Ok(out)
}

/// A layer's shared expert of intermediate size `sf`, and its gate: [1, hidden] in Hugging Face
/// files, a vector of `hidden` in GGUF ones; a model without the gate tensor has none.
fn load_shared(
    w: &dyn WeightSource,
    n: &ExpertNames,
    t: &dyn Fn(&str) -> String,
    h: usize,
    sf: usize,
) -> Result<SharedExpert> {
    let gi = t(n.gate_inp_shexp);
    let gate_inp = match w.has(&gi) {
        false => None,
        true => Some(w.matrix(&gi, 1, h).or_else(|_| QTensor::from_f32(1, h, &w.vector(&gi, h)?))?),
    };
    Ok(SharedExpert {
        gate: w.matrix(&t(n.gate_shexp), sf, h)?,
        up: w.matrix(&t(n.up_shexp), sf, h)?,
        down: w.matrix(&t(n.down_shexp), h, sf)?,
        gate_inp,
    })
}
