//! Layers read from the open weights one at a time, as they are uploaded (`HostModel::open`), so
//! that the host holds one layer's tensors at a time rather than the whole model; and what each
//! layer holds (its matmuls' formats and its bytes on the device), surveyed when the model is
//! opened, for the kernels and the memory plan.

use super::layers::{load_layer, HostLayer, HostModel, Recipe, WeightSource};
use super::loader::{check_range, open_source};
use crate::gpu::wformat::WFormat;
use crate::weights::tensor::QTensor;
use anyhow::{anyhow, Context, Result};
use std::path::Path;

/// What one layer holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LayerSummary {
    /// The formats of its dense matmuls (attention, dense FFN, router, shared expert, recurrent
    /// mixer's projections).
    pub formats: Vec<WFormat>,
    /// The formats of its expert tensors.
    pub moe_formats: Vec<WFormat>,
    /// Its bytes on the device.
    pub bytes: u64,
    /// The bytes of its expert tensors.
    pub expert_bytes: u64,
}

impl LayerSummary {
    pub fn of(l: &HostLayer) -> LayerSummary {
        let mut formats =
            vec![l.q.format, l.k.format, l.v.format, l.o.format, l.gate.format, l.up.format, l.down.format];
        formats.extend(l.moe.iter().map(|m| m.router.format));
        // A shared expert runs through the dense matmuls.
        if let Some(sh) = l.moe.as_ref().and_then(|m| m.shared.as_ref()) {
            formats.extend([sh.gate.format, sh.up.format, sh.down.format]);
            formats.extend(sh.gate_inp.iter().map(|t| t.format));
        }
        formats.extend(l.attn_gate.iter().map(|t| t.format));
        if let Some(lin) = &l.linear {
            formats.extend(lin.proj.iter().chain([&lin.out]).map(|t| t.format));
        }
        formats.extend(l.ple.iter().flat_map(|p| [p.gate.format, p.proj.format]));
        formats.sort();
        formats.dedup();
        let mut moe_formats: Vec<WFormat> = l.moe.iter().flat_map(|m| [m.gate_up.format, m.down.format]).collect();
        moe_formats.sort();
        moe_formats.dedup();
        let f = |n: usize| (n * 4) as u64;
        let matrices = [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down].iter().map(|t| t.bytes() as u64).sum::<u64>()
            + l.moe.as_ref().map_or(0, |m| m.bytes() as u64);
        let bytes = matrices
            + f(l.attn_norm.len() + l.ffn_norm.len())
            + l.qkv_bias.as_ref().map_or(0, |b| f(b.len()))
            + l.qk_norm.as_ref().map_or(0, |b| f(b.len()))
            + l.attn_gate.as_ref().map_or(0, |t| t.bytes() as u64)
            + l.linear.as_ref().map_or(0, |t| t.bytes())
            + l.ple.as_ref().map_or(0, |p| (p.gate.bytes() + p.proj.bytes()) as u64 + f(p.post_norm.len()))
            + l.post_norms.as_ref().map_or(0, |(a, b)| f(a.len() + b.len()))
            + f(l.layer_scalar.map_or(0, |_| 1));
        let expert_bytes = l.moe.as_ref().map_or(0, |m| (m.gate_up.bytes() + m.down.bytes()) as u64);
        LayerSummary { formats, moe_formats, bytes, expert_bytes }
    }
}

/// A tensor or layer in host memory: one the model holds, or one just read from the open
/// weights (dropped by the caller once uploaded).
pub enum Loaded<'a, T> {
    Held(&'a T),
    Read(Box<T>),
}

impl<T> std::ops::Deref for Loaded<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        match self {
            Loaded::Held(t) => t,
            Loaded::Read(t) => t,
        }
    }
}

/// A layer (`HostModel::layer`).
pub type LayerRef<'a> = Loaded<'a, HostLayer>;

/// The format and device bytes of a tensor outside the layers (the embedding, the LM head).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub format: WFormat,
    pub bytes: u64,
}

impl TensorInfo {
    pub fn of(t: &QTensor) -> TensorInfo {
        TensorInfo { format: t.format, bytes: t.bytes() as u64 }
    }
}

/// The embedding or LM head (`HostModel::read_embed`, `read_lm_head`).
pub type TensorRef<'a> = Loaded<'a, QTensor>;

/// The open weights of a model's layers, read one layer at a time (and its embedding and LM
/// head, read when uploaded).
pub(crate) struct LayerStream {
    source: Box<dyn WeightSource + Send + Sync>,
    recipe: Recipe,
    /// Each layer's summary, from `first_layer` on.
    summaries: Vec<LayerSummary>,
    /// The embedding and the untied LM head, where the range needs them.
    embed: Option<TensorInfo>,
    lm_head: Option<TensorInfo>,
}

impl HostModel {
    /// Opens `path` (a Hugging Face directory or a GGUF file) for layers `range` (all when None;
    /// a pipeline stage's otherwise): the parts outside the layers that the range needs are
    /// loaded (as `load_layers` does), the layers are read once to survey them (each dropped
    /// before the next is read) and are read again, one at a time, as they are uploaded
    /// (`layer`). `progress(done, total)` is called as layers are surveyed.
    pub fn open(
        path: &Path,
        range: Option<std::ops::Range<usize>>,
        progress: &dyn Fn(usize, usize),
    ) -> Result<HostModel> {
        let (w, cfg, recipe) = open_source(path)?;
        let range = check_range(path, range, cfg.layers)?;
        let mut m = super::layers::load_parts(&*w, recipe.names, cfg, range.clone())?;
        if recipe.add_one {
            super::layers::add_one_to_norms(&mut m);
        }
        // The embedding and LM head are read again when uploaded.
        let embed = m.embed.take().as_ref().map(TensorInfo::of);
        let lm_head = m.lm_head.take().as_ref().map(TensorInfo::of);
        w.release();
        let mut summaries = Vec::with_capacity(range.len());
        for l in range {
            progress(l, m.cfg.layers);
            summaries.push(LayerSummary::of(&read_layer(&*w, recipe, &m.cfg, l)?));
        }
        progress(m.cfg.layers, m.cfg.layers);
        m.stream = Some(LayerStream { source: w, recipe, summaries, embed, lm_head });
        Ok(m)
    }

    /// Layers held: in host memory, or readable from the open weights.
    pub fn layer_count(&self) -> usize {
        self.stream.as_ref().map_or(self.layers.len(), |s| s.summaries.len())
    }

    /// Whether layers `range` are held.
    pub fn holds(&self, range: &std::ops::Range<usize>) -> bool {
        range.start >= self.first_layer && range.end <= self.first_layer + self.layer_count()
    }

    /// Layer `l`: borrowed when in host memory, else read from the open weights (the caller
    /// drops it once uploaded).
    pub fn layer(&self, l: usize) -> Result<LayerRef<'_>> {
        let not_held = || anyhow!("layer {l} was not loaded from {}", self.source.display());
        let i = l.checked_sub(self.first_layer).filter(|&i| i < self.layer_count()).ok_or_else(not_held)?;
        match &self.stream {
            None => Ok(LayerRef::Held(&self.layers[i])),
            Some(s) => {
                let layer = read_layer(&*s.source, s.recipe, &self.cfg, l)
                    .with_context(|| format!("reading layer {l} of {}", self.source.display()))?;
                Ok(LayerRef::Read(Box::new(layer)))
            }
        }
    }

    /// What each held layer holds, from `first_layer` on.
    pub fn summaries(&self) -> Vec<LayerSummary> {
        match &self.stream {
            Some(s) => s.summaries.clone(),
            None => self.layers.iter().map(LayerSummary::of).collect(),
        }
    }

    /// Bytes on the device of layers `range` (which `holds` must accept).
    pub fn layer_bytes(&self, range: &std::ops::Range<usize>) -> u64 {
        let s = self.summaries();
        s[range.start - self.first_layer..range.end - self.first_layer].iter().map(|s| s.bytes).sum()
    }

    /// The bytes of the largest held layer (what reading one layer holds in host memory).
    pub fn largest_layer_bytes(&self) -> u64 {
        self.summaries().iter().map(|s| s.bytes).max().unwrap_or(0)
    }

    /// The most bytes one read of a streamed model holds: its largest layer, its embedding or
    /// its LM head.
    pub fn largest_read_bytes(&self) -> u64 {
        let parts = [self.embed_info(), self.lm_head_info()].into_iter().flatten().map(|t| t.bytes);
        parts.fold(self.largest_layer_bytes(), u64::max)
    }

    /// The bytes of the held layers' expert tensors.
    pub fn expert_bytes(&self) -> u64 {
        self.summaries().iter().map(|s| s.expert_bytes).sum()
    }

    /// The embedding's format and bytes, where the model holds it (or reads it when uploaded).
    pub fn embed_info(&self) -> Option<TensorInfo> {
        self.stream.as_ref().map_or(self.embed.as_ref().map(TensorInfo::of), |s| s.embed)
    }

    /// The untied LM head's format and bytes, where the model holds it.
    pub fn lm_head_info(&self) -> Option<TensorInfo> {
        self.stream.as_ref().map_or(self.lm_head.as_ref().map(TensorInfo::of), |s| s.lm_head)
    }

    /// The embedding: borrowed when in host memory, else read from the open weights; None
    /// where the model's range does not need it.
    pub fn read_embed(&self) -> Result<Option<TensorRef<'_>>> {
        match (&self.embed, &self.stream) {
            (Some(t), _) => Ok(Some(TensorRef::Held(t))),
            (None, Some(s)) if s.embed.is_some() => self.read_part(s, s.recipe.names.embed).map(Some),
            _ => Ok(None),
        }
    }

    /// The untied LM head, as `read_embed`.
    pub fn read_lm_head(&self) -> Result<Option<TensorRef<'_>>> {
        match (&self.lm_head, &self.stream) {
            (Some(t), _) => Ok(Some(TensorRef::Held(t))),
            (None, Some(s)) if s.lm_head.is_some() => self.read_part(s, s.recipe.names.lm_head).map(Some),
            _ => Ok(None),
        }
    }

    fn read_part(&self, s: &LayerStream, name: &str) -> Result<TensorRef<'_>> {
        let t = s.source.matrix(name, self.cfg.vocab, self.cfg.hidden);
        s.source.release();
        Ok(TensorRef::Read(Box::new(t.with_context(|| format!("reading {name} of {}", self.source.display()))?)))
    }

    /// Whether the layers are read from the open weights as they are uploaded.
    pub fn streams_layers(&self) -> bool {
        self.stream.is_some()
    }
}

/// Reads layer `l` as `recipe` says, then lets go of the mapped pages it read.
fn read_layer(w: &dyn WeightSource, recipe: Recipe, cfg: &super::config::ModelConfig, l: usize) -> Result<HostLayer> {
    let layer = load_layer(w, recipe.names, cfg, l, recipe.unpermute_qk);
    w.release();
    let mut layer = layer?;
    if recipe.add_one {
        super::layers::add_one_to_layer_norms(&mut layer);
    }
    Ok(layer)
}
