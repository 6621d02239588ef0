//! Qwen3.5's multi-token-prediction head (MTP; llama.cpp's NextN block), loaded as a one-layer
//! model that proposes tokens for speculative decoding (engine/draft.rs runs it).
//!
//! At position p the head reads the model's final-normed hidden state h_p and the token at p + 1:
//! `x = fc [enorm(embed(t_{p+1})); hnorm(h_p)]`, one gated full-attention decoder layer of the
//! model's kind (its dense or mixture-of-experts FFN), its own final norm, the model's LM head; so
//! it predicts the token at p + 2. Its further proposals read its own final-normed output in
//! place of h_p. Its KV cache is its own (one layer), addressed by the model's block tables.
//!
//! Weights: Hugging Face `mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`,
//! `mtp.layers.0.*`, `mtp.norm` (zero-centred norms, +1 at load as the model's); GGUF the last
//! `nextn_predict_layers` blocks: `blk.L.nextn.{eh_proj, enorm, hnorm, shared_head_norm}` beside
//! the block's attention and FFN tensors (norms stored with the +1, as the model's). The
//! embedding and LM head are the model's: the engine hands the head the model's copies on the
//! device (`Model::io`); loaded alone (tests) it uploads its own.

use crate::gpu::wformat::WFormat;
use crate::model::builder::{LayerParams, OpBuilder};
use crate::model::config::ModelConfig;
use crate::model::layers::{load_layers, HostModel, TensorNames};
use crate::ops::matmul::MAT_ACCUMULATE;
use crate::ops::norm::{self, NormBinds};
use crate::weights::tensor::QTensor;
use anyhow::{bail, Context, Result};
use std::path::Path;

/// The head on the host: a one-layer model (the model's embedding and LM head, the head's final
/// norm) and the input stage.
pub struct HostMtp {
    pub model: HostModel,
    /// RMSNorm weights of the token's embedding and of the hidden state.
    pub enorm: Vec<f32>,
    pub hnorm: Vec<f32>,
    /// fc's halves: [hidden, hidden] over the normed embedding, and over the normed hidden state.
    pub fc_embed: QTensor,
    pub fc_hidden: QTensor,
    /// The model's final norm (its hidden states are normed by it before the head reads them).
    pub target_norm: Vec<f32>,
}

/// Whether the model at `path` has an MTP head (without loading weights).
pub fn has_mtp(cfg: &ModelConfig) -> bool {
    cfg.linear.as_ref().is_some_and(|l| l.mtp_layers > 0)
}

/// Loads the MTP head of the Qwen3.5 model at `path` (a Hugging Face directory or a GGUF file);
/// fails with the file and the reason when there is none.
pub fn load_mtp(path: &Path) -> Result<HostMtp> {
    let (w, cfg, recipe) = crate::model::loader::open_source(path)?;
    let gguf = !path.is_dir();
    let src = path.display();
    if !has_mtp(&cfg) {
        bail!(
            "{src}: no MTP (NextN) head in this model (only Qwen3.5 / Qwen3.6 checkpoints that keep theirs have one)"
        );
    }
    let h = cfg.hidden;
    let main_layers = cfg.layers;
    let mut one = cfg.clone();
    one.linear = None;
    // The head is the last block of a GGUF (blk.{layers}), mtp.layers.0 of a checkpoint.
    let (names, range, nextn) = if gguf {
        one.layers = main_layers + 1;
        (*recipe.names, main_layers..main_layers + 1, format!("blk.{main_layers}.nextn."))
    } else {
        one.layers = 1;
        // The head's layer and final norm, the model's other names.
        let names = TensorNames { layer: "mtp.layers.{l}", final_norm: "mtp.norm.weight", ..*recipe.names };
        (names, 0..1, "mtp.".to_string())
    };
    if let Some(m) = one.moe.as_mut() {
        m.sparse_layers = vec![true; one.layers];
    }
    let mut model = load_layers(&*w, &names, one, range, &|_, _| {}, false)?;
    if model.embed.is_none() {
        model.embed = Some(w.matrix(names.embed, cfg.vocab, h)?);
    }
    model.first_layer = 0;
    model.cfg.layers = 1;
    if let Some(m) = model.cfg.moe.as_mut() {
        m.sparse_layers = vec![true];
    }
    let (mut enorm, mut hnorm, fc, mut target_norm);
    if gguf {
        enorm = w.vector(&format!("{nextn}enorm.weight"), h)?;
        hnorm = w.vector(&format!("{nextn}hnorm.weight"), h)?;
        fc = w.matrix(&format!("{nextn}eh_proj.weight"), h, 2 * h)?;
        model.final_norm = w.vector(&format!("{nextn}shared_head_norm.weight"), h)?;
        target_norm = w.vector(recipe.names.final_norm, h)?;
    } else {
        enorm = w.vector("mtp.pre_fc_norm_embedding.weight", h)?;
        hnorm = w.vector("mtp.pre_fc_norm_hidden.weight", h)?;
        fc = w.matrix("mtp.fc.weight", h, 2 * h)?;
        target_norm = w.vector(recipe.names.final_norm, h)?;
        if recipe.add_one {
            crate::model::layers::add_one_to_norms(&mut model);
            for v in [&mut enorm, &mut hnorm, &mut target_norm] {
                v.iter_mut().for_each(|x| *x += 1.0);
            }
        }
    }
    let (fc_embed, fc_hidden) = split_columns(&fc).with_context(|| format!("{src}: the MTP head's fc"))?;
    Ok(HostMtp { model, enorm, hnorm, fc_embed, fc_hidden, target_norm })
}

/// A [rows, 2 n] matrix as its two [rows, n] halves: F32 stays F32, any other format becomes F16
/// (its values dequantized; a quantized block may straddle the middle).
fn split_columns(m: &QTensor) -> Result<(QTensor, QTensor)> {
    let n = m.cols / 2;
    let (mut a, mut b) = (Vec::with_capacity(m.rows * n), Vec::with_capacity(m.rows * n));
    for r in 0..m.rows {
        let row = m.dequant_row(r);
        a.extend_from_slice(&row[..n]);
        b.extend_from_slice(&row[n..]);
    }
    let make = |d: &[f32]| match m.format {
        WFormat::F32 => QTensor::from_f32(m.rows, n, d),
        _ => QTensor::from_f32_as_f16(m.rows, n, d),
    };
    Ok((make(&a)?, make(&b)?))
}

/// RMSNorm of each `dim`-wide row of `rows` with `weight`, in place (the hidden states the head
/// reads: the model's by its final norm, the head's own by its).
pub fn norm_rows(rows: &mut [f32], weight: &[f32], eps: f32) {
    for r in rows.chunks_exact_mut(weight.len()) {
        let ms = r.iter().map(|v| v * v).sum::<f32>() / r.len() as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        r.iter_mut().zip(weight).for_each(|(v, w)| *v *= inv * w);
    }
}

impl OpBuilder<'_> {
    /// The head's input after the embedding (in the residual): the residual becomes
    /// `fc_embed enorm(residual) + fc_hidden hnorm(rows)`, `rows` holding each token's hidden state
    /// (already normed by the model's final norm).
    pub(crate) fn mtp_input(&mut self, m: &HostMtp, lp: &LayerParams, rows: &wgpu::Buffer) -> Result<()> {
        let (s, h) = (self.s, self.cfg.hidden);
        let fc_e = self.upload("mtp_fc_embed", &m.fc_embed, None)?;
        let fc_h = self.upload("mtp_fc_hidden", &m.fc_hidden, None)?;
        self.rms_norm(lp, &m.enorm, "mtp_enorm");
        self.matmul("mtp_fc", &fc_e, (&s.normed, &s.hidden), (0, h), None, 0, false, false);
        let w = self.storage("mtp_hnorm", &m.hnorm);
        let b = NormBinds { step: &s.step_buf, p: &lp.norm, x: rows, weight: &w, md: &s.meta_buf, y: &s.normed };
        self.push(norm::norm(&self.kernels.norm, self.g, &b, false, h));
        self.matmul("mtp_fc", &fc_h, (&s.normed, &s.hidden), (0, h), None, MAT_ACCUMULATE, false, false);
        self.matrices.extend([fc_e, fc_h]);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_split_in_halves() {
        let d: Vec<f32> = (0..2 * 64).map(|i| i as f32).collect();
        let m = QTensor::from_f32(2, 64, &d).unwrap();
        let (a, b) = split_columns(&m).unwrap();
        assert_eq!((a.rows, a.cols, b.cols), (2, 32, 32));
        assert_eq!(a.dequant_row(1)[0], 64.0);
        assert_eq!(b.dequant_row(0)[0], 32.0);
        assert_eq!(b.dequant_row(1)[31], 127.0);
    }

    #[test]
    fn rows_are_normed_each() {
        let mut r = vec![3.0, 4.0, 0.0, 2.0];
        norm_rows(&mut r, &[1.0, 2.0], 0.0);
        let inv = 1.0 / 12.5f32.sqrt();
        assert!((r[0] - 3.0 * inv).abs() < 1e-6 && (r[1] - 8.0 * inv).abs() < 1e-6);
        assert!((r[2]).abs() < 1e-6 && (r[3] - 2.0 * 2.0 / 2f32.sqrt()).abs() < 1e-5);
    }
}
