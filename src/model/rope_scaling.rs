//! RoPE scaling for long contexts: the kinds a model's config may name and the inverse
//! frequencies each gives, computed as Hugging Face transformers does.

use anyhow::{anyhow, bail, Result};
use serde_json::Value;

/// How RoPE frequencies are scaled for long contexts.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Position interpolation: every frequency divided by `factor`.
    Linear {
        factor: f64,
    },
    /// Llama 3.x: low frequencies divided by `factor`, high ones kept, a smooth ramp between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max: f64,
    },
    /// YaRN: interpolated and extrapolated frequencies blended over a ramp of dimensions, and
    /// cos/sin scaled by `attention_factor`.
    Yarn {
        factor: f64,
        original_max: f64,
        beta_fast: f64,
        beta_slow: f64,
        attention_factor: f64,
        truncate: bool,
    },
    /// Per-frequency divisors (GGUF's rope_freqs.weight, how llama.cpp stores Llama 3 scaling).
    Freqs(Vec<f32>),
    /// Gemma 4's `proportional` RoPE: the pairs (i, i + head_dim / 2) of the whole head, the first
    /// `pairs` with the default frequencies (exponents over head_dim), the rest not rotated.
    Proportional {
        pairs: usize,
    },
}

/// YaRN's attention scaling for a context extension `scale` (HF's get_mscale).
pub fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

impl RopeScaling {
    /// The inverse frequencies (head_dim / 2 of them) and the factor cos/sin are multiplied by,
    /// computed as Hugging Face transformers does.
    pub fn inv_freq(&self, theta: f64, head_dim: usize) -> (Vec<f64>, f64) {
        let half = head_dim / 2;
        let base: Vec<f64> = (0..half).map(|i| 1.0 / theta.powf((2 * i) as f64 / head_dim as f64)).collect();
        match self {
            RopeScaling::None => (base, 1.0),
            RopeScaling::Linear { factor } => (base.iter().map(|f| f / factor).collect(), 1.0),
            RopeScaling::Freqs(div) => (base.iter().zip(div).map(|(f, d)| f / *d as f64).collect(), 1.0),
            RopeScaling::Proportional { pairs } => {
                (base.iter().enumerate().map(|(i, &f)| if i < *pairs { f } else { 0.0 }).collect(), 1.0)
            }
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max } => {
                let low_wavelen = original_max / low_freq_factor;
                let high_wavelen = original_max / high_freq_factor;
                let f = base
                    .iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen > low_wavelen {
                            f / factor
                        } else if wavelen < high_wavelen {
                            f
                        } else {
                            let smooth =
                                (original_max / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect();
                (f, 1.0)
            }
            RopeScaling::Yarn { factor, original_max, beta_fast, beta_slow, attention_factor, truncate } => {
                let d = head_dim as f64;
                let corr = |rot: f64| d * (original_max / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln());
                let (mut low, mut high) = (corr(*beta_fast), corr(*beta_slow));
                if *truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
                if low == high {
                    high += 0.001;
                }
                let f = base
                    .iter()
                    .enumerate()
                    .map(|(i, &extra)| {
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolate = 1.0 - ramp;
                        extra / factor * (1.0 - extrapolate) + extra * extrapolate
                    })
                    .collect();
                (f, *attention_factor)
            }
        }
    }

    /// From a Hugging Face `rope_scaling` (or `rope_parameters`) object; `max_positions` is the
    /// model's max_position_embeddings.
    pub fn from_hf(v: Option<&serde_json::Map<String, Value>>, max_positions: f64, src: &str) -> Result<RopeScaling> {
        let Some(v) = v else { return Ok(RopeScaling::None) };
        let kind = v.get("rope_type").or_else(|| v.get("type")).and_then(|x| x.as_str()).unwrap_or("default");
        let num = |k: &str| v.get(k).and_then(|x| x.as_f64());
        let factor = || {
            num("factor")
                .filter(|f| *f > 0.0 && f.is_finite())
                .ok_or_else(|| anyhow!("{src}: rope_scaling type '{kind}' needs a positive 'factor'"))
        };
        Ok(match kind {
            "default" | "" => RopeScaling::None,
            "linear" => RopeScaling::Linear { factor: factor()? },
            "llama3" => {
                let r = RopeScaling::Llama3 {
                    factor: factor()?,
                    low_freq_factor: num("low_freq_factor").unwrap_or(1.0),
                    high_freq_factor: num("high_freq_factor").unwrap_or(4.0),
                    original_max: num("original_max_position_embeddings").unwrap_or(8192.0),
                };
                if let RopeScaling::Llama3 { low_freq_factor, high_freq_factor, .. } = r {
                    if !(high_freq_factor > low_freq_factor && low_freq_factor > 0.0) {
                        bail!("{src}: rope_scaling llama3 needs 0 < low_freq_factor < high_freq_factor");
                    }
                }
                r
            }
            "yarn" => {
                let factor = factor()?;
                let attention_factor = match (num("attention_factor"), num("mscale"), num("mscale_all_dim")) {
                    (Some(a), _, _) => a,
                    (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                        yarn_mscale(factor, m) / yarn_mscale(factor, all)
                    }
                    _ => yarn_mscale(factor, 1.0),
                };
                RopeScaling::Yarn {
                    factor,
                    original_max: num("original_max_position_embeddings").unwrap_or(max_positions),
                    beta_fast: num("beta_fast").unwrap_or(32.0),
                    beta_slow: num("beta_slow").unwrap_or(1.0),
                    attention_factor,
                    truncate: v.get("truncate").and_then(|x| x.as_bool()).unwrap_or(true),
                }
            }
            other => {
                bail!("{src}: rope_scaling type '{other}' is not supported (supported: default, linear, llama3, yarn)")
            }
        })
    }
}
