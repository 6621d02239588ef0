//! Builds a stage's ops from the recipe: uploads weights, creates parameter buffers and bind
//! groups.

use crate::gpu::Gpu;
use crate::model::blocks::delta_net::LayerCache;
use crate::model::config::{AttnGeom, ModelConfig};
use crate::model::plan::KvPlan;
use crate::model::scratch::Scratch;
use crate::model::step::StepLimits;
use crate::ops::attention::AttnParams;
use crate::ops::delta::{DeltaDims, DeltaParams};
use crate::ops::kernels::Kernels;
use crate::ops::matmul::{self, MatmulIo, MatmulOp};
use crate::ops::norm::{HeadNormParams, NormParams};
use crate::ops::rope::RopeParams;
use crate::ops::{Op, OpKind};
use crate::weights::tensor::QTensor;
use crate::weights::upload::GpuMatrix;
use anyhow::Result;

/// What an attention layer's parameters depend on: its geometry, window (None: global), rotated
/// elements per head, and whether it reads another layer's cache (queries only).
type AttnKey = (AttnGeom, Option<usize>, usize, bool);

/// The uniform parameters of one kind of attention layer.
pub(crate) struct AttnKindParams {
    pub(crate) rope: wgpu::Buffer,
    pub(crate) attn: wgpu::Buffer,
    pub(crate) head_norm: wgpu::Buffer,
}

/// Per-layer uniform parameters, shared by every layer's ops.
pub(crate) struct LayerParams {
    pub(crate) norm: wgpu::Buffer,
    /// The norms after attention and the FFN (added into the residual).
    pub(crate) post_norm: wgpu::Buffer,
    /// Per kind of attention layer the model has.
    kinds: Vec<(AttnKey, AttnKindParams)>,
    /// The final norm's (gathers the sampled rows).
    pub(crate) final_norm: wgpu::Buffer,
    /// The Gated DeltaNet stages' and the attention output gate's (ops/delta.rs), where the
    /// model has either.
    pub(crate) delta: Option<wgpu::Buffer>,
}

impl LayerParams {
    /// `off_state`: where the step metadata's state records start.
    pub(crate) fn new(
        b: &mut OpBuilder,
        limits: &StepLimits,
        kv: &KvPlan,
        (off_sample, off_state): (usize, usize),
    ) -> LayerParams {
        let cfg = b.cfg;
        let norm = |gather: bool| NormParams::new(cfg.hidden, cfg.rms_eps, gather, off_sample);
        let mut keys: Vec<AttnKey> = (0..cfg.layers).map(|l| attn_key(cfg, l)).collect();
        keys.sort();
        keys.dedup();
        let st = &cfg.style;
        let kinds = keys
            .into_iter()
            .map(|key| {
                let (geom, w, rot, shared) = key;
                let chunk = kv.chunk_elems(geom.kv_dim(), limits.block_size);
                let (heads, kv_heads, head_dim) = geom.dims();
                let p = AttnParams::new(geom.dims(), limits.block_size, w.unwrap_or(0), chunk)
                    .with_scores(st.attn_scale, st.attn_softcap)
                    .with_sinks(st.attn_sinks);
                let rope = RopeParams::new(heads, kv_heads, head_dim, chunk).with_rotary(rot).q_only(shared);
                let hn =
                    HeadNormParams::new(heads, kv_heads, head_dim, cfg.rms_eps).with_v_norm(st.v_norm).q_only(shared);
                let params = AttnKindParams {
                    rope: b.uniform(bytemuck::bytes_of(&rope)),
                    attn: b.uniform(bytemuck::bytes_of(&p)),
                    head_norm: b.uniform(bytemuck::bytes_of(&hn)),
                };
                (key, params)
            })
            .collect();
        LayerParams {
            norm: b.uniform(bytemuck::bytes_of(&norm(false))),
            post_norm: b.uniform(bytemuck::bytes_of(&NormParams::accumulating(cfg.hidden, cfg.rms_eps))),
            kinds,
            final_norm: b.uniform(bytemuck::bytes_of(&norm(true))),
            delta: delta_dims(cfg).map(|(d, tiled)| {
                let p = DeltaParams::new(&d, cfg.rms_eps, off_state, cfg.q_dim(), tiled);
                b.uniform(bytemuck::bytes_of(&p))
            }),
        }
    }
}

/// The Gated DeltaNet sizes the delta kernels are built for (and their value-head order): the
/// model's, or placeholders where only the attention output gate uses them; None where neither.
pub(crate) fn delta_dims(cfg: &ModelConfig) -> Option<(DeltaDims, bool)> {
    match &cfg.linear {
        Some(l) => Some((l.dims, l.tiled)),
        None if cfg.style.attn_gate => {
            Some((DeltaDims { k_heads: 1, v_heads: 1, k_dim: 4, v_dim: 4, kernel: 4 }, false))
        }
        None => None,
    }
}

/// The parameters' key of attention layer `l`.
fn attn_key(cfg: &ModelConfig, l: usize) -> AttnKey {
    (cfg.geom(l), cfg.layer_window(l), cfg.layer_rope_dim(l), cfg.kv_source(l).is_some())
}

impl LayerParams {
    /// The attention parameters of layer `l` of `cfg`.
    pub(crate) fn attn_kind(&self, cfg: &ModelConfig, l: usize) -> Result<&AttnKindParams> {
        let key = attn_key(cfg, l);
        let found = self.kinds.iter().find(|(k, _)| *k == key).map(|(_, p)| p);
        found.ok_or_else(|| anyhow::anyhow!("no attention parameters for layer {l} ({key:?})"))
    }
}

/// Builds a stage's ops: uploads weights, creates parameter buffers and bind groups.
pub(crate) struct OpBuilder<'a> {
    pub(crate) g: &'a Gpu,
    pub(crate) cfg: &'a ModelConfig,
    pub(crate) kernels: &'a Kernels,
    pub(crate) s: &'a Scratch,
    /// Max storage binding (weights are split into row chunks within it).
    pub(crate) mb: u64,
    pub(crate) uniform_x: bool,
    pub(crate) ops: Vec<Op>,
    /// Parameter and weight buffers the bind groups use.
    pub(crate) keep: Vec<wgpu::Buffer>,
    pub(crate) matrices: Vec<GpuMatrix>,
    /// gpu profile: the int8 matmuls' quantized x (ops/matmul/), grown to the widest matrix
    /// so far (the ops run one after another: one buffer serves them all).
    pub(crate) xq: Option<wgpu::Buffer>,
}

impl OpBuilder<'_> {
    pub(crate) fn uniform(&mut self, bytes: &[u8]) -> wgpu::Buffer {
        let b = self.g.uniform_init("params", bytes);
        self.keep.push(b.clone());
        b
    }

    pub(crate) fn storage(&mut self, label: &str, v: &[f32]) -> wgpu::Buffer {
        let b = self.g.storage_init(label, bytemuck::cast_slice(v));
        self.keep.push(b.clone());
        b
    }

    pub(crate) fn push(&mut self, op: Op) {
        self.ops.push(op);
    }

    /// Ops with the parameter buffers their bind groups use.
    pub(crate) fn extend(&mut self, (ops, params): (Vec<Op>, Vec<wgpu::Buffer>)) {
        self.ops.extend(ops);
        self.keep.extend(params);
    }

    pub(crate) fn upload(&self, label: &str, t: &QTensor, pair: Option<&QTensor>) -> Result<GpuMatrix> {
        GpuMatrix::upload(self.g, label, t, pair, self.mb)
    }

    /// The embedding lookup, one op per row-chunk of the table.
    pub(crate) fn embed(&mut self, e: &GpuMatrix) {
        let s = self.s;
        let scale = self.cfg.style.embed_scale.unwrap_or(1.0);
        let ops = matmul::embed(
            &self.kernels.matmul,
            self.g,
            e,
            (scale, false),
            &s.step_buf,
            &s.meta_buf,
            &s.dummy,
            &s.hidden,
        );
        self.extend(ops);
    }

    /// Matmul ops for every chunk of `m`, reading x into columns col0.. of y (rows of y_stride
    /// floats); `flags`: MAT_* (MAT_BIAS needs `bias`); `label`: the role the per-kernel
    /// profile reports them under.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn matmul(
        &mut self,
        label: &'static str,
        m: &GpuMatrix,
        (x, y): (&wgpu::Buffer, &wgpu::Buffer),
        cols: (usize, usize),
        bias: Option<&wgpu::Buffer>,
        flags: u32,
        sampled: bool,
        swiglu: bool,
    ) {
        let s = self.s;
        let windows = self.uniform_x.then_some(&s.windows);
        // The one soft-capped matmul is the LM head (Gemma 2's final_logit_softcapping).
        let cap = self.cfg.style.final_softcap.unwrap_or(0.0);
        let int8 = self.kernels.matmul.gpu.as_ref().is_some_and(|gk| gk.quantize_x8.is_some());
        if int8 && self.xq.as_ref().is_none_or(|b| b.size() < matmul::xq_bytes(m.cols)) {
            let b = self.g.storage("xq", matmul::xq_bytes(m.cols));
            self.keep.push(b.clone());
            self.xq = Some(b);
        }
        let xq = self.xq.as_ref().filter(|_| int8);
        let io = MatmulIo { step: &s.step_buf, x, y, bias: bias.unwrap_or(&s.dummy), windows, cap, xq };
        let (mut ops, params) = matmul::matmul(&self.kernels.matmul, self.g, m, &io, cols, flags, sampled, swiglu);
        // (The int8 path's quantization of x keeps its own label.)
        ops.iter_mut()
            .filter(|op| matches!(op.kind, OpKind::Matmul(MatmulOp::Matmul { .. })))
            .for_each(|op| op.label = label);
        self.extend((ops, params));
    }
}

/// Whether layers `layers` of `cfg` can be one stage: a model with per-layer embeddings only
/// whole, and no layer reading the KV cache of a layer of an earlier stage.
pub(crate) fn check_stage(cfg: &ModelConfig, layers: &std::ops::Range<usize>) -> Result<()> {
    if cfg.style.ple.is_some() && (layers.start > 0 || layers.end < cfg.layers) {
        anyhow::bail!("a model with per-layer embeddings (Gemma 4 E2B/E4B) runs in one stage only");
    }
    if let Some(l) = layers.clone().find(|&l| cfg.kv_source(l).is_some_and(|p| p < layers.start)) {
        anyhow::bail!(
            "layer {l} reads the KV cache of layer {} of an earlier stage; split the layers elsewhere",
            cfg.kv_source(l).unwrap_or(0)
        );
    }
    Ok(())
}

impl OpBuilder<'_> {
    /// The stage's layers, each with its cache: its recurrent state, its own KV cache, or (a
    /// KV-sharing layer) the cache of the layer it reads.
    pub(crate) fn layers(
        &mut self,
        host: &crate::model::loader::HostModel,
        layers: &std::ops::Range<usize>,
        lp: &LayerParams,
        (kv, states): (&crate::model::plan::KvCache, &[(wgpu::Buffer, wgpu::Buffer)]),
    ) -> Result<()> {
        let cfg = self.cfg;
        let (mut ai, mut ri) = (0, 0);
        // Each cache-owning layer's index among the stage's caches.
        let mut cache_of = std::collections::HashMap::new();
        for layer in layers.clone() {
            // Read now when the layers are streamed, dropped once uploaded.
            let hl = host.layer(layer)?;
            let cache = if cfg.is_linear(layer) {
                ri += 1;
                LayerCache::State(&states[ri - 1].0, &states[ri - 1].1)
            } else if let Some(src) = cfg.kv_source(layer) {
                let i: usize = *cache_of
                    .get(&src)
                    .ok_or_else(|| anyhow::anyhow!("layer {layer}: layer {src}'s cache is not here"))?;
                LayerCache::Kv(kv.k[i].as_slice(), kv.v[i].as_slice())
            } else {
                cache_of.insert(layer, ai);
                ai += 1;
                LayerCache::Kv(&kv.k[ai - 1], &kv.v[ai - 1])
            };
            self.layer(layer, &hl, lp, cache)?;
            drop(hl);
            // Let go of the upload's staging copies before the next layer is read.
            self.g.release_staging()?;
        }
        Ok(())
    }
}
