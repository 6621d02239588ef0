//! Embeddings: a request with `pooling` runs its prompt only; every step hands back its tokens'
//! residuals after the last layer (`Executor::emit_hidden`), the model's final RMSNorm turns them
//! into the last hidden states here (as transformers' `last_hidden_state`), and they are pooled
//! (last token, mean, first token) into one L2-normalised vector once the prompt is computed.
//!
//! Rows are taken by position, once each: a prompt recomputed after preemption adds nothing
//! twice. Mean and first-token pooling need every position computed, so the server gives such
//! requests a cache salt of their own (no prefix-cache hits); last-token pooling needs only the
//! last position, which a step always computes.

use super::request::Pooling;
use super::scheduler::{rows_by_seq, Planned};
use super::sequence::Seq;
use crate::exec::Executor;

/// The final norm the engine applies to emitted rows (`EmbedHead::enable` turns it on).
pub(crate) struct EmbedHead {
    pub(crate) norm: Vec<f32>,
    pub(crate) eps: f32,
}

impl EmbedHead {
    /// `x` after the final RMSNorm (the MTP head's host norm).
    fn normed(&self, x: &[f32]) -> Vec<f32> {
        let mut r = x.to_vec();
        crate::model::blocks::mtp::norm_rows(&mut r, &self.norm, self.eps);
        r
    }
}

/// One request's pooling so far.
pub(crate) struct Pooled {
    pooling: Pooling,
    /// Positions taken so far (rows `0..next`).
    next: usize,
    sum: Vec<f64>,
    /// The row that pooling keeps (last or first token).
    kept: Vec<f32>,
}

impl Pooled {
    pub(crate) fn new(pooling: Pooling) -> Pooled {
        Pooled { pooling, next: 0, sum: Vec::new(), kept: Vec::new() }
    }

    /// Takes the normed row of position `pos` (positions already taken are skipped).
    fn take(&mut self, pos: usize, row: Vec<f32>) {
        if pos < self.next {
            return;
        }
        self.next = pos + 1;
        match self.pooling {
            Pooling::Last => self.kept = row,
            Pooling::Cls if pos == 0 => self.kept = row,
            Pooling::Cls => {}
            Pooling::Mean => {
                if self.sum.is_empty() {
                    self.sum = vec![0.0; row.len()];
                }
                self.sum.iter_mut().zip(&row).for_each(|(s, &v)| *s += v as f64);
            }
        }
    }

    /// The pooled vector, L2-normalised; None when the rows it needs never came.
    pub(crate) fn finish(self) -> Option<Vec<f32>> {
        let v: Vec<f64> = match self.pooling {
            Pooling::Mean => self.sum.iter().map(|s| s / self.next.max(1) as f64).collect(),
            _ => self.kept.iter().map(|&x| x as f64).collect(),
        };
        if v.is_empty() {
            return None;
        }
        let n = v.iter().map(|x| x * x).sum::<f64>().sqrt().max(1e-12);
        Some(v.iter().map(|x| (x / n) as f32).collect())
    }
}

/// The pooling an embedding model file declares (an embedding GGUF's `pooling_type`); None
/// for a generative model or an unknown type.
pub fn declared_pooling(path: &std::path::Path) -> Option<Pooling> {
    match crate::model::loader::gguf_pooling_type(path)? {
        1 => Some(Pooling::Mean),
        2 => Some(Pooling::Cls),
        3 => Some(Pooling::Last),
        _ => None,
    }
}

impl EmbedHead {
    /// Turns embeddings on: every step of `exec` from now on hands back its hidden states.
    /// Returns the head, or why this executor cannot (a pipeline).
    pub(crate) fn enable(exec: &mut dyn Executor) -> Result<EmbedHead, String> {
        const WHOLE: &str = "embeddings need the whole model on one device (not pipeline stages)";
        let (norm, eps) = exec.final_norm().ok_or(WHOLE)?;
        if !exec.emit_hidden(true) {
            return Err(WHOLE.into());
        }
        Ok(EmbedHead { norm, eps })
    }

    /// The embedding size.
    pub(crate) fn dim(&self) -> usize {
        self.norm.len()
    }

    /// Pools a step's hidden states (`hidden`: [tokens, hidden] in the plan's order) into the
    /// embedding requests among `running`.
    pub(crate) fn pool(&self, plan: &[Planned], hidden: &[f32], running: &mut [Seq]) {
        let h = self.norm.len();
        let Some(split) = rows_by_seq(plan, hidden, h) else { return };
        for (p, rows) in split {
            let Some(s) = running.iter_mut().find(|s| s.id == p.id) else { continue };
            let Some(acc) = s.embed.as_mut() else { continue };
            for (i, pos) in (p.start..p.start + p.len).enumerate().filter(|&(_, pos)| pos < s.prompt_len) {
                // Only what pooling keeps is normed.
                let wanted = match acc.pooling {
                    Pooling::Mean => true,
                    Pooling::Last => pos + 1 == s.prompt_len,
                    Pooling::Cls => pos == 0,
                };
                if wanted {
                    acc.take(pos, self.normed(&rows[i * h..(i + 1) * h]));
                } else {
                    acc.next = acc.next.max(pos + 1);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_embedding_gguf_declares_its_pooling() {
        use crate::formats::gguf::{encode_header, GgufValue};
        let dir = std::env::temp_dir().join(format!("torus-pooling-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (kv, want) in [
            (Some(3), Some(Pooling::Last)),
            (Some(1), Some(Pooling::Mean)),
            (Some(2), Some(Pooling::Cls)),
            (Some(0), None),
            (None, None),
        ] {
            let mut meta = vec![("general.architecture".to_string(), GgufValue::Str("qwen3".into()))];
            if let Some(t) = kv {
                meta.push(("qwen3.pooling_type".to_string(), GgufValue::U32(t)));
            }
            let path = dir.join(format!("m{kv:?}.gguf"));
            std::fs::write(&path, encode_header(&meta, &[]).unwrap().bytes).unwrap();
            assert_eq!(declared_pooling(&path), want, "pooling_type {kv:?}");
        }
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(declared_pooling(&dir), None, "a directory");
    }

    #[test]
    fn pooling_takes_each_position_once_and_normalises() {
        let mut m = Pooled::new(Pooling::Mean);
        m.take(0, vec![1.0, 0.0]);
        m.take(1, vec![0.0, 3.0]);
        m.take(1, vec![100.0, 100.0]); // a recomputed position: skipped
        let v = m.finish().unwrap();
        let want = [0.5 / (0.5f64.powi(2) + 1.5f64.powi(2)).sqrt(), 1.5 / (0.5f64.powi(2) + 1.5f64.powi(2)).sqrt()];
        assert!((v[0] as f64 - want[0]).abs() < 1e-6 && (v[1] as f64 - want[1]).abs() < 1e-6, "{v:?}");
        let mut l = Pooled::new(Pooling::Last);
        l.take(0, vec![1.0, 1.0]);
        l.take(1, vec![3.0, 4.0]);
        assert_eq!(l.finish().unwrap(), vec![0.6, 0.8]);
        assert_eq!(Pooled::new(Pooling::Cls).finish(), None);
        let head = EmbedHead { norm: vec![1.0, 2.0], eps: 0.0 };
        let n = head.normed(&[3.0, 4.0]);
        let r = 1.0 / 12.5f32.sqrt();
        assert!((n[0] - 3.0 * r).abs() < 1e-6 && (n[1] - 8.0 * r).abs() < 1e-6, "{n:?}");
    }
}
