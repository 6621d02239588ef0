//! Hugging Face checkpoints as a weight source: config.json and every *.safetensors file of the
//! directory, memory-mapped, each tensor checked against the shape it must have; and the
//! loading of a whole directory (the families whose names or norms differ).

use super::config::ModelConfig;
use super::layers::{Recipe, WeightSource};
use super::loader::{check_shape, to_f32, u16s};
use crate::gpu::wformat::WFormat;
use crate::weights::mxfp4_hf;
use crate::weights::tensor::QTensor;
use anyhow::{anyhow, bail, Context, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

struct HfTensor {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    file: usize,
    start: usize,
    end: usize,
}

pub(super) struct HfWeights {
    dir: PathBuf,
    files: Vec<(PathBuf, memmap2::Mmap)>,
    tensors: HashMap<String, HfTensor>,
}

impl HfWeights {
    pub(super) fn open(dir: &Path) -> Result<HfWeights> {
        let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
            .with_context(|| format!("{}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        paths.sort();
        if paths.is_empty() {
            bail!("{}: no *.safetensors files", dir.display());
        }
        let mut files = Vec::new();
        let mut tensors = HashMap::new();
        for (fi, p) in paths.into_iter().enumerate() {
            let f = std::fs::File::open(&p).with_context(|| format!("{}", p.display()))?;
            // SAFETY: the file is opened read-only and not modified while mapped.
            let map = unsafe { memmap2::Mmap::map(&f) }.with_context(|| format!("{}", p.display()))?;
            let (header_len, meta) = safetensors::SafeTensors::read_metadata(&map)
                .map_err(|e| anyhow!("{}: invalid safetensors file: {e}", p.display()))?;
            let data_start = 8 + header_len;
            for (name, info) in meta.tensors() {
                let (s, e) = info.data_offsets;
                if data_start + e > map.len() {
                    bail!("{}: tensor {name} extends past end of file (truncated?)", p.display());
                }
                tensors.insert(
                    name.to_string(),
                    HfTensor {
                        dtype: info.dtype,
                        shape: info.shape.clone(),
                        file: fi,
                        start: data_start + s,
                        end: data_start + e,
                    },
                );
            }
            files.push((p, map));
        }
        Ok(HfWeights { dir: dir.to_path_buf(), files, tensors })
    }

    fn get(&self, name: &str) -> Result<(&HfTensor, &[u8], String)> {
        let t = self.tensors.get(name).ok_or_else(|| anyhow!("weights: tensor {name} is missing"))?;
        let (p, map) = &self.files[t.file];
        Ok((t, &map[t.start..t.end], p.display().to_string()))
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let (t, bytes, src) = self.get(name)?;
        if t.shape != [len] {
            bail!("{src}: tensor {name} has shape {:?}, expected [{len}]", t.shape);
        }
        to_f32(t.dtype, bytes).map_err(|e| anyhow!("{src}: tensor {name}: {e}"))
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<QTensor> {
        let (t, bytes, src) = self.get(name)?;
        if t.shape.len() != 2 {
            bail!("{src}: tensor {name} has shape {:?}, expected [{rows}, {cols}]", t.shape);
        }
        check_shape(&src, name, (t.shape[0], t.shape[1]), (rows, cols))?;
        Self::rows(t, bytes, rows, cols).map_err(|e| anyhow!("{src}: tensor {name}: {e}"))
    }

    /// A float tensor's data as `rows` rows of `cols` (F32 kept, F16 and BF16 as F16).
    fn rows(t: &HfTensor, bytes: &[u8], rows: usize, cols: usize) -> Result<QTensor> {
        match t.dtype {
            safetensors::Dtype::F32 => QTensor::from_f32(rows, cols, &to_f32(t.dtype, bytes)?),
            safetensors::Dtype::F16 => QTensor::from_f16_bits(rows, cols, &u16s(bytes)),
            safetensors::Dtype::BF16 => QTensor::from_bf16_bits_as_f16(rows, cols, &u16s(bytes)),
            d => bail!("unsupported dtype {d:?} (supported: F32, F16, BF16)"),
        }
    }

    /// The bytes of a U8 tensor of `shape` (MXFP4 blocks and scales).
    fn bytes(&self, name: &str, shape: &[usize]) -> Result<&[u8]> {
        let (t, bytes, src) = self.get(name)?;
        if t.shape != shape || t.dtype != safetensors::Dtype::U8 {
            bail!("{src}: tensor {name} is {:?} {:?}, expected U8 {shape:?}", t.dtype, t.shape);
        }
        Ok(bytes)
    }

    /// The experts of one projection stored as one 3-D float tensor [experts, rows, cols], or
    /// in MXFP4 as `{name}_blocks` [experts, rows, cols / 32, 16] and `{name}_scales` [experts,
    /// rows, cols / 32] (gpt-oss's published checkpoints), as [experts * rows, cols].
    fn stacked(&self, name: &str, experts: usize, rows: usize, cols: usize) -> Result<QTensor> {
        let (blocks, scales) = (format!("{name}_blocks"), format!("{name}_scales"));
        if !self.tensors.contains_key(name) && self.tensors.contains_key(&blocks) {
            if !cols.is_multiple_of(32) {
                bail!("{}: MXFP4 {name} has rows of {cols} (a multiple of 32 is needed)", self.dir.display());
            }
            let b = self.bytes(&blocks, &[experts, rows, cols / 32, 16])?;
            let s = self.bytes(&scales, &[experts, rows, cols / 32])?;
            let bytes = mxfp4_hf::gguf_bytes(b, s, experts * rows, cols, None)
                .map_err(|e| anyhow!("{}: {name}: {e}", self.dir.display()))?;
            return QTensor::from_gguf_blocks(WFormat::MXFP4, experts * rows, cols, &bytes);
        }
        let (t, bytes, src) = self.get(name)?;
        if t.shape != [experts, rows, cols] {
            bail!("{src}: tensor {name} has shape {:?}, expected {:?}", t.shape, [experts, rows, cols]);
        }
        Self::rows(t, bytes, experts * rows, cols).map_err(|e| anyhow!("{src}: tensor {name}: {e}"))
    }
}

/// Opens a Hugging Face directory: its weights, config and how its tensors become layers (the
/// families whose names or norms differ).
pub(super) fn open_hf(dir: &Path) -> Result<(HfWeights, ModelConfig, Recipe)> {
    let cfg = ModelConfig::from_hf_json(&dir.join("config.json"))?;
    let w = HfWeights::open(dir)?;
    let family = cfg.family();
    let recipe = Recipe { names: (family.hf_names)(&w), unpermute_qk: false, add_one: family.hf_add_one };
    Ok((w, cfg, recipe))
}

impl WeightSource for HfWeights {
    fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<QTensor> {
        HfWeights::matrix(self, name, rows, cols)
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        HfWeights::vector(self, name, len)
    }

    fn experts(&self, name: &str, experts: usize, rows: usize, cols: usize) -> Result<QTensor> {
        if !name.contains("{e}") {
            return self.stacked(name, experts, rows, cols);
        }
        let parts = (0..experts)
            .map(|e| HfWeights::matrix(self, &name.replace("{e}", &e.to_string()), rows, cols))
            .collect::<Result<Vec<_>>>()?;
        QTensor::concat_rows(&parts.iter().collect::<Vec<_>>())
            .map_err(|err| anyhow!("{}: {name}: {err}", self.dir.display()))
    }

    fn array(&self, name: &str, shape: &[usize]) -> Result<(Vec<f32>, bool)> {
        let (t, bytes, src) = self.get(name)?;
        if t.shape != shape {
            bail!("{src}: tensor {name} has shape {:?}, expected {shape:?}", t.shape);
        }
        let v = to_f32(t.dtype, bytes).map_err(|e| anyhow!("{src}: tensor {name}: {e}"))?;
        Ok((v, t.dtype == safetensors::Dtype::F32))
    }

    fn path(&self) -> &Path {
        &self.dir
    }

    fn release(&self) {
        for (_, map) in &self.files {
            crate::formats::release_pages(map);
        }
    }
}
