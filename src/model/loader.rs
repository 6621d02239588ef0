//! Loads a model's weights on the host, in GPU layout, from a Hugging Face directory
//! (config.json + safetensors) or a GGUF file.

use super::config::{ModelConfig, RopeScaling};
use super::layers::{load_layers, Recipe, WeightSource};
pub use super::layers::{HostLayer, HostModel};
use crate::formats::gguf::{GgmlType, GgufFile};
use crate::gpu::wformat::WFormat;
use crate::weights::tensor::QTensor;
use crate::weights::ternary::{to_q2_k, Ternary};
use anyhow::{anyhow, bail, Result};
use std::path::Path;

impl HostModel {
    /// The output projection, when in host memory (a model loaded with `load`).
    pub fn lm_head(&self) -> Option<&QTensor> {
        if self.tied {
            self.embed.as_ref()
        } else {
            self.lm_head.as_ref()
        }
    }

    /// The formats of the loaded layers' dense matmuls and of the embedding and LM head.
    pub fn formats(&self) -> Vec<WFormat> {
        let mut f: Vec<WFormat> = self.embed_info().iter().chain(&self.lm_head_info()).map(|t| t.format).collect();
        f.extend(self.summaries().into_iter().flat_map(|s| s.formats));
        // Gemma 4's per-layer embeddings: their token table (an embedding lookup) and context
        // projection.
        f.extend(self.ple.iter().flat_map(|p| [p.embed.format, p.model_proj.format]));
        f.sort();
        f.dedup();
        f
    }

    /// The formats of the expert tensors (none for a dense model).
    pub fn moe_formats(&self) -> Vec<WFormat> {
        let mut f: Vec<WFormat> = self.summaries().into_iter().flat_map(|s| s.moe_formats).collect();
        f.sort();
        f.dedup();
        f
    }

    /// Loads `path`: a directory with config.json, or a .gguf file, every layer in host memory
    /// (tests and tools that read the layers; `HostModel::open` reads them as they are uploaded).
    pub fn load(path: &Path, progress: &dyn Fn(usize, usize)) -> Result<HostModel> {
        Self::load_layers(path, None, progress)
    }

    /// Loads only the layers in `range` (all when None), for a pipeline stage, with the
    /// embedding when the range starts at layer 0 (or ends at the last with a tied head) and the
    /// untied output projection when it ends at the last layer.
    pub fn load_layers(
        path: &Path,
        range: Option<std::ops::Range<usize>>,
        progress: &dyn Fn(usize, usize),
    ) -> Result<HostModel> {
        let (w, cfg, recipe) = open_source(path)?;
        let range = check_range(path, range, cfg.layers)?;
        let mut m = load_layers(&*w, recipe.names, cfg, range, progress, recipe.unpermute_qk)?;
        if recipe.add_one {
            super::layers::add_one_to_norms(&mut m);
        }
        Ok(m)
    }
}

/// Layers `range` (all when None) of a model of `total` layers, checked.
pub(super) fn check_range(
    path: &Path,
    range: Option<std::ops::Range<usize>>,
    total: usize,
) -> Result<std::ops::Range<usize>> {
    let range = range.unwrap_or(0..total);
    if range.start >= range.end || range.end > total {
        bail!("{}: layers {}..{} are outside the model's {total} layers", path.display(), range.start, range.end);
    }
    Ok(range)
}

/// The weights at `path` (a Hugging Face directory or a GGUF file, its metadata parsed once),
/// opened, with the model's config and how its tensors become layers.
pub(super) fn open_source(path: &Path) -> Result<(Box<dyn WeightSource + Send + Sync>, ModelConfig, Recipe)> {
    if !path.exists() {
        bail!("{}: no such file or directory", path.display());
    }
    if path.is_dir() {
        let (w, cfg, recipe) = super::hf_weights::open_hf(path)?;
        return Ok((Box::new(w), cfg, recipe));
    }
    let g = GgufFile::open(path)?;
    let cfg = gguf_config(&g)?;
    let family = cfg.family();
    let recipe = Recipe { names: family.gguf_names, unpermute_qk: family.gguf_unpermute_qk, add_one: false };
    Ok((Box::new(GgufSource(g)), cfg, recipe))
}

/// The pooling an embedding GGUF declares (llama.cpp's `<arch>.pooling_type`: 1 mean, 2 cls,
/// 3 last; 0 or absent: none, a generative model); None for anything else.
pub fn gguf_pooling_type(path: &Path) -> Option<u32> {
    if path.is_dir() {
        return None;
    }
    let g = GgufFile::open(path).ok()?;
    let arch = g.get_str("general.architecture")?;
    g.get_u32(&format!("{arch}.pooling_type")).filter(|&t| t != 0)
}

/// The hyper-parameters of the model at `path`, without loading weights.
pub fn read_config(path: &Path) -> Result<ModelConfig> {
    if path.is_dir() {
        ModelConfig::from_hf_json(&path.join("config.json"))
    } else {
        gguf_config(&GgufFile::open(path)?)
    }
}

pub(super) fn check_shape(src: &str, name: &str, got: (usize, usize), want: (usize, usize)) -> Result<()> {
    if got != want {
        bail!("{src}: tensor {name} has shape [{}, {}], expected [{}, {}]", got.0, got.1, want.0, want.1);
    }
    Ok(())
}

// ---------------------------------------------------------------- raw tensor data

pub(super) fn u16s(b: &[u8]) -> Vec<u16> {
    b.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect()
}

pub(super) fn to_f32(dtype: safetensors::Dtype, b: &[u8]) -> Result<Vec<f32>> {
    Ok(match dtype {
        safetensors::Dtype::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        safetensors::Dtype::F16 => u16s(b).into_iter().map(|h| half::f16::from_bits(h).to_f32()).collect(),
        safetensors::Dtype::BF16 => u16s(b).into_iter().map(|h| half::bf16::from_bits(h).to_f32()).collect(),
        d => bail!("unsupported dtype {d:?} (supported: F32, F16, BF16)"),
    })
}

// ---------------------------------------------------------------- GGUF

fn gguf_config(g: &GgufFile) -> Result<ModelConfig> {
    let src = g.path.display().to_string();
    let arch_name =
        g.get_str("general.architecture").ok_or_else(|| anyhow!("{src}: general.architecture is missing"))?;
    let family = super::families::by_gguf(arch_name).ok_or_else(|| {
        anyhow!(
            "{src}: unsupported architecture '{arch_name}' (supported: {}; Mistral's files are llama)",
            super::families::gguf_names_supported()
        )
    })?;
    let arch = family.arch;
    let key = |k: &str| format!("{arch_name}.{k}");
    let req = |k: &str| -> Result<usize> { Ok(g.require_u64(&key(k))? as usize) };
    let hidden = req("embedding_length")?;
    let heads = req("attention.head_count")?;
    let kv_heads = g.get_u64(&key("attention.head_count_kv")).map(|v| v as usize).unwrap_or(heads);
    let head_dim = g
        .get_u64(&key("attention.key_length"))
        .or_else(|| g.get_u64(&key("rope.dimension_count")))
        .map(|v| v as usize)
        .unwrap_or(hidden / heads.max(1));
    let embd = g.tensor("token_embd.weight").ok_or_else(|| anyhow!("{src}: tensor token_embd.weight is missing"))?;
    let vocab = g
        .get_u64(&key("vocab_size"))
        .map(|v| v as usize)
        .or_else(|| embd.dims.get(1).map(|&d| d as usize))
        .unwrap_or(0);
    let cfg = ModelConfig {
        arch,
        hidden,
        layers: req("block_count")?,
        heads,
        kv_heads,
        head_dim,
        // A MoE file whose every layer is sparse may have no dense FFN size.
        intermediate: match req("feed_forward_length") {
            Ok(v) => v,
            Err(_) if family.ffn_optional => 0,
            Err(e) => return Err(e),
        },
        vocab,
        rope_theta: g.get_f32(&key("rope.freq_base")).unwrap_or(10000.0) as f64,
        rms_eps: g.get_f32(&key("attention.layer_norm_rms_epsilon")).unwrap_or(1e-5),
        max_positions: g.get_u64(&key("context_length")).unwrap_or(4096) as usize,
        qkv_bias: family.qkv_bias,
        rope_scaling: gguf_rope_scaling(g, arch_name)?,
        sliding_window: g.get_u64(&key("attention.sliding_window")).filter(|&w| w > 0).map(|w| w as usize),
        qk_norm: family.qk_norm,
        style: Default::default(),
        moe: None,
        linear: None,
        full_attn: None,
    };
    let cfg = (family.gguf_config)(cfg, g, arch_name)?;
    cfg.validate(&src)?;
    Ok(cfg)
}

/// RoPE scaling from GGUF metadata the way llama.cpp writes it: `rope_freqs.weight` (per-frequency
/// divisors: Llama 3.x), `<arch>.rope.scaling.type` linear or yarn with `.factor` and
/// `.original_context_length` (or the older `<arch>.rope.scale_linear`).
fn gguf_rope_scaling(g: &GgufFile, arch: &str) -> Result<RopeScaling> {
    let src = g.path.display();
    let key = |k: &str| format!("{arch}.rope.{k}");
    let kind = g.get_str(&key("scaling.type")).unwrap_or("none");
    let factor = g.get_f32(&key("scaling.factor")).or_else(|| g.get_f32(&key("scale_linear"))).map(|f| f as f64);
    let positive = |f: Option<f64>| {
        f.filter(|f| *f > 0.0 && f.is_finite()).ok_or_else(|| {
            anyhow!("{src}: {} must be a positive number for rope scaling '{kind}'", key("scaling.factor"))
        })
    };
    if let Some(t) = g.tensor("rope_freqs.weight") {
        if kind != "none" && kind != "linear" || factor.is_some_and(|f| f != 1.0) && kind == "linear" {
            bail!("{src}: both rope_freqs.weight and rope scaling type '{kind}' are given");
        }
        if t.ggml_type != GgmlType::F32 || t.dims.len() != 1 {
            bail!("{src}: tensor rope_freqs.weight must be a 1-d F32 tensor, found {} {:?}", t.ggml_type, t.dims);
        }
        return Ok(RopeScaling::Freqs(to_f32(safetensors::Dtype::F32, g.tensor_data(t))?));
    }
    Ok(match kind {
        "none" => match factor {
            Some(f) if f != 1.0 && g.get_f32(&key("scale_linear")).is_some() => RopeScaling::Linear { factor: positive(Some(f))? },
            _ => RopeScaling::None,
        },
        "linear" => RopeScaling::Linear { factor: positive(factor)? },
        "yarn" => {
            let factor = positive(factor)?;
            let ctx = g.get_f32(&key("scaling.original_context_length")).map(|v| v as f64);
            RopeScaling::Yarn {
                factor,
                original_max: ctx.ok_or_else(|| anyhow!("{src}: {} is missing", key("scaling.original_context_length")))?,
                beta_fast: g.get_f32(&key("scaling.yarn_beta_fast")).unwrap_or(32.0) as f64,
                beta_slow: g.get_f32(&key("scaling.yarn_beta_slow")).unwrap_or(1.0) as f64,
                // llama.cpp multiplies its attn_factor (default 1) into YaRN's own mscale.
                attention_factor: g.get_f32(&key("scaling.attn_factor")).map_or(1.0, |v| v as f64)
                    * super::config::yarn_mscale(factor, 1.0),
                truncate: true,
            }
        }
        other => bail!("{src}: rope scaling type '{other}' ({}) is not supported (supported: none, linear, yarn, rope_freqs.weight)", key("scaling.type")),
    })
}

/// The GGUF tensor types a weight matrix may have.
pub const SUPPORTED_GGUF_TYPES: &str =
    "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4, \
     IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, TQ1_0, TQ2_0";

/// The GPU format of a quantized GGUF type (kept quantized, re-packed).
pub fn block_format(t: GgmlType) -> Option<WFormat> {
    Some(match t {
        GgmlType::Q8_0 => WFormat::Q8_0,
        GgmlType::Q4_0 => WFormat::Q4_0,
        GgmlType::Q4_1 => WFormat::Q4_1,
        GgmlType::Q5_0 => WFormat::Q5_0,
        GgmlType::Q5_1 => WFormat::Q5_1,
        GgmlType::Q2_K => WFormat::Q2_K,
        GgmlType::Q3_K => WFormat::Q3_K,
        GgmlType::Q4_K => WFormat::Q4_K,
        GgmlType::Q5_K => WFormat::Q5_K,
        GgmlType::Q6_K => WFormat::Q6_K,
        GgmlType::IQ4_NL => WFormat::IQ4_NL,
        GgmlType::IQ4_XS => WFormat::IQ4_XS,
        GgmlType::MXFP4 => WFormat::MXFP4,
        GgmlType::IQ2_XXS => WFormat::IQ2_XXS,
        GgmlType::IQ2_XS => WFormat::IQ2_XS,
        GgmlType::IQ2_S => WFormat::IQ2_S,
        GgmlType::IQ3_XXS => WFormat::IQ3_XXS,
        GgmlType::IQ3_S => WFormat::IQ3_S,
        GgmlType::IQ1_S => WFormat::IQ1_S,
        GgmlType::IQ1_M => WFormat::IQ1_M,
        _ => return None,
    })
}

/// The GGUF tensor type that stores a weight format (the inverse of `block_format`, plus the
/// float formats).
pub fn gguf_type(f: WFormat) -> GgmlType {
    match f {
        WFormat::F32 => GgmlType::F32,
        WFormat::F16 => GgmlType::F16,
        WFormat::Q8_0 => GgmlType::Q8_0,
        WFormat::Q4_0 => GgmlType::Q4_0,
        WFormat::Q4_1 => GgmlType::Q4_1,
        WFormat::Q5_0 => GgmlType::Q5_0,
        WFormat::Q5_1 => GgmlType::Q5_1,
        WFormat::Q2_K => GgmlType::Q2_K,
        WFormat::Q3_K => GgmlType::Q3_K,
        WFormat::Q4_K => GgmlType::Q4_K,
        WFormat::Q5_K => GgmlType::Q5_K,
        WFormat::Q6_K => GgmlType::Q6_K,
        WFormat::IQ4_NL => GgmlType::IQ4_NL,
        WFormat::IQ4_XS => GgmlType::IQ4_XS,
        WFormat::MXFP4 => GgmlType::MXFP4,
        WFormat::IQ2_XXS => GgmlType::IQ2_XXS,
        WFormat::IQ2_XS => GgmlType::IQ2_XS,
        WFormat::IQ2_S => GgmlType::IQ2_S,
        WFormat::IQ3_XXS => GgmlType::IQ3_XXS,
        WFormat::IQ3_S => GgmlType::IQ3_S,
        WFormat::IQ1_S => GgmlType::IQ1_S,
        WFormat::IQ1_M => GgmlType::IQ1_M,
    }
}

/// A TQ1_0 / TQ2_0 matrix, re-written as Q2_K blocks of the same values (weights::ternary).
pub fn ternary_matrix(t: GgmlType, rows: usize, cols: usize, bytes: &[u8]) -> Result<QTensor> {
    let tern = if t == GgmlType::TQ1_0 { Ternary::TQ1_0 } else { Ternary::TQ2_0 };
    if !cols.is_multiple_of(256) {
        bail!("{t} tensor: row length {cols} is not a positive multiple of 256");
    }
    if bytes.len() != rows * cols / 256 * tern.block_bytes() {
        bail!(
            "{} bytes of data for {t} tensor of shape [{rows}, {cols}] (expected {})",
            bytes.len(),
            rows * cols / 256 * tern.block_bytes()
        );
    }
    QTensor::from_gguf_blocks(WFormat::Q2_K, rows, cols, &to_q2_k(tern, bytes)?)
}

fn gguf_matrix(g: &GgufFile, name: &str, rows: usize, cols: usize) -> Result<QTensor> {
    gguf_rows(g, name, &[cols as u64, rows as u64])
}

/// A tensor of dims `want` (GGUF order: the row length first) as a matrix of its rows: a 2-D
/// matrix, or an expert tensor [cols, rows, experts] as [experts * rows, cols].
fn gguf_rows(g: &GgufFile, name: &str, want: &[u64]) -> Result<QTensor> {
    let src = g.path.display().to_string();
    let t = g.tensor(name).ok_or_else(|| anyhow!("{src}: tensor {name} is missing"))?;
    if t.dims.len() != want.len() {
        bail!("{src}: tensor {name} has {} dimensions, expected {}", t.dims.len(), want.len());
    }
    if want.len() == 2 {
        check_shape(&src, name, (t.dims[1] as usize, t.dims[0] as usize), (want[1] as usize, want[0] as usize))?;
    } else if t.dims != want {
        bail!("{src}: tensor {name} has dims {:?} (GGUF order), expected {:?}", t.dims, want);
    }
    let (cols, rows) = (want[0] as usize, want[1..].iter().product::<u64>() as usize);
    let b = g.tensor_data(t);
    let r = match t.ggml_type {
        GgmlType::F32 => QTensor::from_f32(rows, cols, &to_f32(safetensors::Dtype::F32, b)?),
        GgmlType::F16 => QTensor::from_f16_bits(rows, cols, &u16s(b)),
        GgmlType::BF16 => QTensor::from_bf16_bits_as_f16(rows, cols, &u16s(b)),
        GgmlType::TQ1_0 | GgmlType::TQ2_0 => ternary_matrix(t.ggml_type, rows, cols, b),
        other => match block_format(other) {
            Some(f) => QTensor::from_gguf_blocks(f, rows, cols, b),
            None => bail!(
                "{src}: tensor {name} has type {} which is not supported (supported: {})",
                other.name(),
                SUPPORTED_GGUF_TYPES
            ),
        },
    };
    // The tensor is a copy now: its pages of the file need not stay resident.
    g.release_tensor_pages(t);
    r.map_err(|e| anyhow!("{src}: tensor {name}: {e}"))
}

fn gguf_vector(g: &GgufFile, name: &str, len: usize) -> Result<Vec<f32>> {
    let src = g.path.display().to_string();
    let t = g.tensor(name).ok_or_else(|| anyhow!("{src}: tensor {name} is missing"))?;
    if t.dims != [len as u64] {
        bail!("{src}: tensor {name} has shape {:?}, expected [{len}]", t.dims);
    }
    let b = g.tensor_data(t);
    match t.ggml_type {
        GgmlType::F32 => to_f32(safetensors::Dtype::F32, b),
        GgmlType::F16 => to_f32(safetensors::Dtype::F16, b),
        GgmlType::BF16 => to_f32(safetensors::Dtype::BF16, b),
        other => bail!("{src}: tensor {name} has type {}, expected F32/F16/BF16", other.name()),
    }
}

/// A GGUF file as a weight source.
struct GgufSource(GgufFile);

impl WeightSource for GgufSource {
    fn has(&self, name: &str) -> bool {
        self.0.tensor(name).is_some()
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<QTensor> {
        gguf_matrix(&self.0, name, rows, cols)
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        gguf_vector(&self.0, name, len)
    }

    fn experts(&self, name: &str, experts: usize, rows: usize, cols: usize) -> Result<QTensor> {
        gguf_rows(&self.0, name, &[cols as u64, rows as u64, experts as u64])
    }

    fn array(&self, name: &str, shape: &[usize]) -> Result<(Vec<f32>, bool)> {
        let g = &self.0;
        let src = g.path.display();
        let t = g.tensor(name).ok_or_else(|| anyhow!("{src}: tensor {name} is missing"))?;
        let want: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
        if t.dims != want {
            bail!("{src}: tensor {name} has dims {:?} (GGUF order), expected {want:?}", t.dims);
        }
        let dtype = match t.ggml_type {
            GgmlType::F32 => safetensors::Dtype::F32,
            GgmlType::F16 => safetensors::Dtype::F16,
            GgmlType::BF16 => safetensors::Dtype::BF16,
            other => bail!("{src}: tensor {name} has type {}, expected F32/F16/BF16", other.name()),
        };
        Ok((to_f32(dtype, g.tensor_data(t))?, t.ggml_type == GgmlType::F32))
    }

    fn path(&self) -> &Path {
        &self.0.path
    }

    fn release(&self) {
        self.0.release_pages();
    }
}
