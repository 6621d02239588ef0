//! The model's weights on the host, and the one loop that loads them: from any weight source
//! (safetensors, GGUF) through a table of its tensor names, per layer in GPU layout.

use super::config::ModelConfig;
use crate::weights::tensor::{unpermute_qk_rows, QTensor};
use anyhow::Result;
use std::path::{Path, PathBuf};

pub struct HostLayer {
    pub attn_norm: Vec<f32>,
    pub q: QTensor,
    pub k: QTensor,
    pub v: QTensor,
    /// q, k and v biases concatenated (Qwen2), or None.
    pub qkv_bias: Option<Vec<f32>>,
    /// Per-head RMSNorm weights of q then k ([2 * head_dim], Qwen3), or None.
    pub qk_norm: Option<Vec<f32>>,
    pub o: QTensor,
    /// The output projection's bias (gpt-oss), or None.
    pub o_bias: Option<Vec<f32>>,
    /// Each head's sink logit (gpt-oss), or None.
    pub sinks: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    /// The dense FFN (0 rows in a mixture-of-experts layer).
    pub gate: QTensor,
    pub up: QTensor,
    pub down: QTensor,
    /// The mixture-of-experts FFN, in a sparse layer.
    pub moe: Option<super::blocks::moe::HostMoe>,
    /// RMSNorm weights of the attention output and of the FFN output before each is added
    /// into the residual (Gemma), or None.
    pub post_norms: Option<(Vec<f32>, Vec<f32>)>,
    /// The attention output's gate projection (Qwen3.5), or None.
    pub attn_gate: Option<QTensor>,
    /// A recurrent layer's mixer (q/k/v/o then have no rows), or None.
    pub linear: Option<super::blocks::delta_net::HostLinear>,
    /// The factor the layer's output is multiplied by (Gemma 4), or None.
    pub layer_scalar: Option<f32>,
    /// The per-layer-embedding block (Gemma 4 E2B/E4B), or None.
    pub ple: Option<super::blocks::ple::HostPleLayer>,
}

pub struct HostModel {
    pub cfg: ModelConfig,
    /// The token embedding; None on a pipeline stage that neither embeds nor has a tied head.
    pub embed: Option<QTensor>,
    /// Layers `first_layer..first_layer + layers.len()` of `cfg.layers` (all unless loaded for
    /// a pipeline stage).
    pub layers: Vec<HostLayer>,
    pub first_layer: usize,
    pub final_norm: Vec<f32>,
    /// The untied output projection; None when tied, or on a stage other than the last.
    pub lm_head: Option<QTensor>,
    /// The output projection is the embedding.
    pub tied: bool,
    /// The per-layer embeddings' token table and context projection (Gemma 4 E2B/E4B), on the
    /// first stage; None elsewhere and for other models.
    pub ple: Option<super::blocks::ple::HostPle>,
    /// Where the weights came from (for messages).
    pub source: PathBuf,
    /// The open weights the layers are read from one at a time (`HostModel::open`: then
    /// `layers` is empty); None when every layer is in `layers`.
    pub(crate) stream: Option<super::stream::LayerStream>,
}

/// Where weights are read from: each tensor by name, checked against the shape it must have.
pub(crate) trait WeightSource {
    fn has(&self, name: &str) -> bool;
    /// A [rows, cols] matrix in its stored format (quantized formats stay quantized).
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<QTensor>;
    /// A vector of `len` values.
    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>>;
    /// `experts` [rows, cols] matrices as one [experts * rows, cols] matrix: a 3-D tensor
    /// (GGUF's `*_exps`; Hugging Face's fused experts, in a float type or MXFP4 blocks), or one
    /// matrix per expert where `name` holds `{e}` (Hugging Face).
    fn experts(&self, name: &str, experts: usize, rows: usize, cols: usize) -> Result<QTensor>;
    /// The values of a float tensor of `shape` (outermost first, as Hugging Face writes it; a
    /// GGUF file stores the dims reversed), and whether it is stored as F32.
    fn array(&self, name: &str, shape: &[usize]) -> Result<(Vec<f32>, bool)>;
    /// The file or directory (for messages).
    fn path(&self) -> &Path;
    /// Lets go of the mapped pages read so far (they are read again from the file when needed):
    /// the loaded tensors are copies.
    fn release(&self) {}
}

/// A format's tensor names: the model-level ones, and each layer's after its prefix (`{l}`
/// stands for the layer index).
#[derive(Clone, Copy)]
pub(crate) struct TensorNames {
    pub embed: &'static str,
    pub final_norm: &'static str,
    pub lm_head: &'static str,
    pub layer: &'static str,
    pub attn_norm: &'static str,
    pub q: &'static str,
    pub k: &'static str,
    pub v: &'static str,
    /// q, k and v as one tensor (their rows in that order), in place of `q`, `k`, `v` where
    /// not "" (Phi-3).
    pub qkv: &'static str,
    pub q_bias: &'static str,
    pub k_bias: &'static str,
    pub v_bias: &'static str,
    pub q_norm: &'static str,
    pub k_norm: &'static str,
    pub o: &'static str,
    /// The output projection's bias and the heads' sinks (gpt-oss; read only when the style
    /// says so).
    pub o_bias: &'static str,
    pub sinks: &'static str,
    pub ffn_norm: &'static str,
    pub gate: &'static str,
    pub up: &'static str,
    /// The gate's rows then the up's as one tensor, in place of `gate` and `up` where not ""
    /// (Phi-3).
    pub gate_up: &'static str,
    pub down: &'static str,
    /// The norms after attention and after the FFN (Gemma; "" where a format has none).
    pub post_attn_norm: &'static str,
    pub post_ffn_norm: &'static str,
    /// A mixture-of-experts layer's router, experts and shared expert, and how they are laid out.
    pub experts: &'static super::blocks::experts::ExpertNames,
    /// A Gated DeltaNet layer's tensors (Qwen3.5).
    pub linear: &'static super::blocks::delta_net::LinearNames,
    /// The layer's output scale (Gemma 4; read only when the style says so).
    pub layer_scalar: &'static str,
    /// The per-layer embeddings' tensors (Gemma 4 E2B/E4B; read only when the style says so).
    pub ple: &'static super::blocks::ple::PleNames,
    /// The tensors of the block with a dense FFN beside the experts, beyond its experts (Gemma 4;
    /// read only for such a model).
    pub parallel_moe: &'static super::blocks::parallel_moe::ParallelMoeNames,
}

/// Hugging Face (transformers) names.
pub(crate) const HF_NAMES: TensorNames = TensorNames {
    embed: "model.embed_tokens.weight",
    final_norm: "model.norm.weight",
    lm_head: "lm_head.weight",
    layer: "model.layers.{l}",
    attn_norm: "input_layernorm.weight",
    q: "self_attn.q_proj.weight",
    k: "self_attn.k_proj.weight",
    v: "self_attn.v_proj.weight",
    qkv: "",
    q_bias: "self_attn.q_proj.bias",
    k_bias: "self_attn.k_proj.bias",
    v_bias: "self_attn.v_proj.bias",
    q_norm: "self_attn.q_norm.weight",
    k_norm: "self_attn.k_norm.weight",
    o: "self_attn.o_proj.weight",
    o_bias: "self_attn.o_proj.bias",
    sinks: "self_attn.sinks",
    ffn_norm: "post_attention_layernorm.weight",
    gate: "mlp.gate_proj.weight",
    up: "mlp.up_proj.weight",
    gate_up: "",
    down: "mlp.down_proj.weight",
    post_attn_norm: "",
    post_ffn_norm: "",
    experts: &super::blocks::experts::HF_EXPERTS,
    linear: &super::blocks::delta_net::HF_LINEAR,
    layer_scalar: "layer_scalar",
    ple: &super::blocks::ple::HF_PLE,
    parallel_moe: &super::blocks::parallel_moe::HF_PARALLEL_MOE,
};

/// llama.cpp's GGUF names.
pub(crate) const GGUF_NAMES: TensorNames = TensorNames {
    embed: "token_embd.weight",
    final_norm: "output_norm.weight",
    lm_head: "output.weight",
    layer: "blk.{l}",
    attn_norm: "attn_norm.weight",
    q: "attn_q.weight",
    k: "attn_k.weight",
    v: "attn_v.weight",
    qkv: "",
    q_bias: "attn_q.bias",
    k_bias: "attn_k.bias",
    v_bias: "attn_v.bias",
    q_norm: "attn_q_norm.weight",
    k_norm: "attn_k_norm.weight",
    o: "attn_output.weight",
    o_bias: "attn_output.bias",
    sinks: "attn_sinks.weight",
    ffn_norm: "ffn_norm.weight",
    gate: "ffn_gate.weight",
    up: "ffn_up.weight",
    gate_up: "",
    down: "ffn_down.weight",
    post_attn_norm: "post_attention_norm.weight",
    post_ffn_norm: "post_ffw_norm.weight",
    experts: &super::blocks::experts::GGUF_EXPERTS,
    linear: &super::blocks::delta_net::GGUF_LINEAR,
    layer_scalar: "layer_output_scale.weight",
    ple: &super::blocks::ple::GGUF_PLE,
    parallel_moe: &super::blocks::parallel_moe::GGUF_PARALLEL_MOE,
};

/// How a format's tensors become host layers: its names, whether q/k rows are stored permuted
/// for interleaved RoPE (llama.cpp's Llama files: put back in HF order), and whether its norm
/// weights are stored less one (Hugging Face Gemma 2/3 and Qwen3.5: the 1 is added at load).
#[derive(Clone, Copy)]
pub(crate) struct Recipe {
    pub names: &'static TensorNames,
    pub unpermute_qk: bool,
    pub add_one: bool,
}

/// Loads layers `range` of a model with hyper-parameters `cfg` (and the embedding, final norm
/// and output projection its position needs) from `w`, every layer in host memory.
/// `unpermute_qk`: q/k rows are stored permuted for interleaved RoPE (llama.cpp's Llama files)
/// and are put back in HF order.
pub(crate) fn load_layers(
    w: &dyn WeightSource,
    n: &TensorNames,
    cfg: ModelConfig,
    range: std::ops::Range<usize>,
    progress: &dyn Fn(usize, usize),
    unpermute_qk: bool,
) -> Result<HostModel> {
    let mut m = load_parts(w, n, cfg, range.clone())?;
    for l in range {
        progress(l, m.cfg.layers);
        m.layers.push(load_layer(w, n, &m.cfg, l, unpermute_qk)?);
    }
    progress(m.cfg.layers, m.cfg.layers);
    Ok(m)
}

/// The parts of a model outside its layers that a stage of layers `range` needs: the embedding
/// where it starts at layer 0 (or ends at the last with a tied head), the untied output
/// projection where it ends at the last, the final norm, and the per-layer embeddings' table on
/// the first stage. No layers are loaded (`layers` is empty, `first_layer` is `range.start`).
pub(crate) fn load_parts(
    w: &dyn WeightSource,
    n: &TensorNames,
    cfg: ModelConfig,
    range: std::ops::Range<usize>,
) -> Result<HostModel> {
    let h = cfg.hidden;
    let (first, last) = (range.start == 0, range.end == cfg.layers);
    let tied = !w.has(n.lm_head);
    let embed = if first || (last && tied) { Some(w.matrix(n.embed, cfg.vocab, h)?) } else { None };
    let lm_head = if last && !tied { Some(w.matrix(n.lm_head, cfg.vocab, h)?) } else { None };
    let ple = if first { super::blocks::ple::load(w, n.ple, &cfg)? } else { None };
    Ok(HostModel {
        ple,
        final_norm: w.vector(n.final_norm, h)?,
        cfg,
        embed,
        layers: Vec::new(),
        first_layer: range.start,
        lm_head,
        tied,
        source: w.path().to_path_buf(),
        stream: None,
    })
}

/// Loads layer `l` of a model with hyper-parameters `cfg` from `w` (see `load_layers`).
pub(crate) fn load_layer(
    w: &dyn WeightSource,
    n: &TensorNames,
    cfg: &ModelConfig,
    l: usize,
    unpermute_qk: bool,
) -> Result<HostLayer> {
    let h = cfg.hidden;
    // The layer's own attention geometry (Gemma 4's full-attention layers differ).
    let geom = cfg.geom(l);
    let (q, kv, head_dim) = (geom.q_dim(), geom.kv_dim(), geom.head_dim);
    let perms =
        unpermute_qk.then(|| (unpermute_qk_rows(geom.heads, head_dim), unpermute_qk_rows(geom.kv_heads, head_dim)));
    // A KV-sharing layer (Gemma 4) has queries only.
    let shared = cfg.kv_source(l).is_some();
    let p = n.layer.replace("{l}", &l.to_string());
    let t = |name: &str| format!("{p}.{name}");
    let mut attn_gate = None;
    let linear = match &cfg.linear {
        Some(lc) if cfg.is_linear(l) => Some(super::blocks::delta_net::load_linear(w, n.linear, &t, cfg, lc)?),
        _ => None,
    };
    let none = |cols: usize| QTensor::from_f32(0, cols, &[]);
    let (mut wq, mut wk, wv, wo) = match linear {
        Some(_) => (none(h)?, none(h)?, none(h)?, none(32)?),
        None if cfg.style.attn_gate => {
            let both = w.matrix(&t(n.q), 2 * q, h)?;
            let (query, gate) = split_query_gate(&both, geom.heads, head_dim);
            attn_gate = Some(gate);
            (query, w.matrix(&t(n.k), kv, h)?, w.matrix(&t(n.v), kv, h)?, w.matrix(&t(n.o), h, q)?)
        }
        None if shared => (w.matrix(&t(n.q), q, h)?, none(h)?, none(h)?, w.matrix(&t(n.o), h, q)?),
        // Keys that are the values too: the key projection twice (v is normed, not roped).
        None if cfg.k_eq_v(l) => {
            let k = w.matrix(&t(n.k), kv, h)?;
            (w.matrix(&t(n.q), q, h)?, k.clone(), k, w.matrix(&t(n.o), h, q)?)
        }
        None if !n.qkv.is_empty() => {
            let qkv = w.matrix(&t(n.qkv), q + 2 * kv, h)?;
            let (wq, wk, wv) = (qkv.slice_rows(0, q), qkv.slice_rows(q, q + kv), qkv.slice_rows(q + kv, q + 2 * kv));
            (wq, wk, wv, w.matrix(&t(n.o), h, q)?)
        }
        None => {
            (w.matrix(&t(n.q), q, h)?, w.matrix(&t(n.k), kv, h)?, w.matrix(&t(n.v), kv, h)?, w.matrix(&t(n.o), h, q)?)
        }
    };
    if let Some((q_perm, k_perm)) = perms.as_ref().filter(|_| linear.is_none() && !shared) {
        wq = wq.permute_rows(q_perm);
        wk = wk.permute_rows(k_perm);
    }
    let attn = linear.is_none();
    let qkv_bias = if cfg.qkv_bias && attn {
        let mut b = w.vector(&t(n.q_bias), q)?;
        b.extend(w.vector(&t(n.k_bias), kv)?);
        b.extend(w.vector(&t(n.v_bias), kv)?);
        Some(b)
    } else {
        None
    };
    let qk_norm = if cfg.qk_norm && attn {
        let mut v = w.vector(&t(n.q_norm), head_dim)?;
        if !shared {
            v.extend(w.vector(&t(n.k_norm), head_dim)?);
        }
        // The values' norm has no weight (Gemma 4).
        if cfg.style.v_norm && !shared {
            v.extend(std::iter::repeat_n(1.0, head_dim));
        }
        Some(v)
    } else {
        None
    };
    let sparse = cfg.moe.as_ref().is_some_and(|m| m.is_sparse(l));
    let family = cfg.family();
    let t: &dyn Fn(&str) -> String = &t;
    let (gate, up, down, moe) = if sparse && family.dense_beside_experts {
        // The dense MLP beside the experts, with the block's own router scales and norms.
        let i = cfg.layer_ffn(l);
        let mut moe = super::blocks::experts::load(w, n.experts, t, cfg)?;
        moe.parallel = Some(super::blocks::parallel_moe::load(w, n.parallel_moe, t, cfg)?);
        (w.matrix(&t(n.gate), i, h)?, w.matrix(&t(n.up), i, h)?, w.matrix(&t(n.down), h, i)?, Some(moe))
    } else if sparse {
        let none = || QTensor::from_f32(0, h, &[]);
        let moe = super::blocks::experts::load(w, n.experts, t, cfg)?;
        (none()?, none()?, QTensor::from_f32(0, 32, &[])?, Some(moe))
    } else if !n.gate_up.is_empty() {
        let i = cfg.layer_ffn(l);
        let gate_up = w.matrix(&t(n.gate_up), 2 * i, h)?;
        (gate_up.slice_rows(0, i), gate_up.slice_rows(i, 2 * i), w.matrix(&t(n.down), h, i)?, None)
    } else {
        let i = cfg.layer_ffn(l);
        (w.matrix(&t(n.gate), i, h)?, w.matrix(&t(n.up), i, h)?, w.matrix(&t(n.down), h, i)?, None)
    };
    Ok(HostLayer {
        qk_norm,
        attn_norm: w.vector(&t(n.attn_norm), h)?,
        q: wq,
        k: wk,
        v: wv,
        qkv_bias,
        o: wo,
        o_bias: if cfg.style.out_bias && attn { Some(w.vector(&t(n.o_bias), h)?) } else { None },
        sinks: if cfg.style.attn_sinks && attn { Some(w.vector(&t(n.sinks), cfg.heads)?) } else { None },
        ffn_norm: w.vector(&t(n.ffn_norm), h)?,
        gate,
        up,
        down,
        moe,
        post_norms: if cfg.style.post_norms {
            Some((w.vector(&t(n.post_attn_norm), h)?, w.vector(&t(n.post_ffn_norm), h)?))
        } else {
            None
        },
        attn_gate,
        linear,
        layer_scalar: if cfg.style.layer_scalar { Some(w.vector(&t(n.layer_scalar), 1)?[0]) } else { None },
        ple: super::blocks::ple::load_layer(w, n.ple, &t, cfg)?,
    })
}

/// Checkpoints whose RMSNorm weights are stored as w for a norm that multiplies by 1 + w
/// (Hugging Face Gemma 2/3 and Qwen3.5, `Recipe::add_one`): llama.cpp's converter adds the 1 when
/// it writes a GGUF; this does the same at load.
pub(crate) fn add_one_to_norms(m: &mut HostModel) {
    m.layers.iter_mut().for_each(add_one_to_layer_norms);
    add_one(&mut m.final_norm);
}

/// `add_one_to_norms` of one layer (a layer read as it is uploaded).
pub(crate) fn add_one_to_layer_norms(l: &mut HostLayer) {
    add_one(&mut l.attn_norm);
    add_one(&mut l.ffn_norm);
    if let Some(q) = &mut l.qk_norm {
        add_one(q);
    }
    if let Some((a, f)) = &mut l.post_norms {
        add_one(a);
        add_one(f);
    }
}

fn add_one(v: &mut [f32]) {
    v.iter_mut().for_each(|x| *x += 1.0);
}

/// Splits Qwen3.5's query projection ([heads * 2 * head_dim] rows: each head's query rows then
/// its gate rows) into the query rows and the gate rows.
pub(crate) fn split_query_gate(q: &QTensor, heads: usize, head_dim: usize) -> (QTensor, QTensor) {
    let rows = heads * head_dim;
    let order: Vec<usize> = (0..2 * rows)
        .map(|i| {
            let (part, j) = (i / rows, i % rows);
            (j / head_dim) * 2 * head_dim + part * head_dim + j % head_dim
        })
        .collect();
    let p = q.permute_rows(&order);
    (p.slice_rows(0, rows), p.slice_rows(rows, 2 * rows))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_query_projection_splits_per_head() {
        // 2 heads of 2: rows q0 q0 g0 g0 q1 q1 g1 g1 (values = row index).
        let data: Vec<f32> = (0..8).flat_map(|r| [r as f32; 32]).collect();
        let q = QTensor::from_f32(8, 32, &data).unwrap();
        let (query, gate) = split_query_gate(&q, 2, 2);
        let first = |t: &QTensor| (0..t.rows).map(|r| t.dequant_row(r)[0]).collect::<Vec<_>>();
        assert_eq!(first(&query), [0.0, 1.0, 4.0, 5.0]);
        assert_eq!(first(&gate), [2.0, 3.0, 6.0, 7.0]);
    }
}
