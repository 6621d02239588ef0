//! Speculative decoding's settings: the method, tokens proposed per step, the n-gram sizes, the
//! draft model and the batch size from which speculation steps back; vLLM's
//! `speculative_config` object mapped onto them; the typed view the scheduler takes
//! (`SpecSettings`).

use super::EngineConfig;
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

/// Most tokens proposed per sequence and step.
pub const MAX_SPECULATIVE_TOKENS: usize = 16;
/// The longest n-gram looked up.
pub const MAX_NGRAM: usize = 16;

/// `speculative` / `--speculative`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SpecMethod {
    #[default]
    Off,
    /// Prompt lookup: the tokens that followed the longest recent match of the sequence's last
    /// n tokens in its own prompt and output.
    Ngram,
    /// A smaller model with the same vocabulary (`draft_model`) proposes greedily.
    Draft,
    /// The model's own multi-token-prediction head (Qwen3.5's MTP / NextN block) proposes
    /// greedily from the model's hidden states (model/blocks/mtp.rs).
    Mtp,
}

impl SpecMethod {
    /// Proposals come from a model the engine runs (a draft model or the MTP head), not from
    /// a lookup.
    pub fn uses_model(self) -> bool {
        matches!(self, SpecMethod::Draft | SpecMethod::Mtp)
    }
}

impl std::str::FromStr for SpecMethod {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "off" | "none" => Ok(SpecMethod::Off),
            "ngram" | "prompt_lookup" => Ok(SpecMethod::Ngram),
            "draft" | "draft_model" => Ok(SpecMethod::Draft),
            "mtp" | "nextn" => Ok(SpecMethod::Mtp),
            _ => Err(format!("unknown speculative method '{s}' (expected ngram, draft, mtp or off)")),
        }
    }
}

/// vLLM's `speculative_config` (the keys that map here; any other is an error naming it).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VllmSpeculativeConfig {
    /// `ngram` (vLLM also says so with `model: "[ngram]"`) or `draft_model`.
    pub method: Option<String>,
    /// The draft model's path (a draft model when no method is given).
    pub model: Option<String>,
    pub num_speculative_tokens: Option<usize>,
    pub prompt_lookup_max: Option<usize>,
    pub prompt_lookup_min: Option<usize>,
}

/// What the scheduler needs: how many tokens to propose at most, the n-gram sizes, and the
/// batch size above which no sequence speculates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpecSettings {
    pub method: SpecMethod,
    pub max_tokens: usize,
    pub ngram_min: usize,
    pub ngram_max: usize,
    pub max_batch: usize,
    /// Stop speculating for a while where it is measured to cost more per token than plain
    /// decoding (`spec::CostGate`).
    pub cost_gate: bool,
}

impl SpecSettings {
    pub fn off() -> SpecSettings {
        SpecSettings {
            method: SpecMethod::Off,
            max_tokens: 0,
            ngram_min: 1,
            ngram_max: 1,
            max_batch: 0,
            cost_gate: false,
        }
    }

    pub fn enabled(&self) -> bool {
        self.method != SpecMethod::Off && self.max_tokens > 0
    }
}

impl EngineConfig {
    /// The speculative settings, `speculative_config` applied over the plain keys.
    pub fn spec_settings(&self) -> Result<SpecSettings> {
        let mut s = SpecSettings {
            method: self.speculative,
            max_tokens: self.num_speculative_tokens,
            ngram_min: self.prompt_lookup_min,
            ngram_max: self.prompt_lookup_max,
            max_batch: self.speculative_max_batch,
            cost_gate: self.speculative_cost_gate,
        };
        if self.draft_model.is_some() {
            match s.method {
                SpecMethod::Off | SpecMethod::Draft => s.method = SpecMethod::Draft,
                m => bail!("draft_model is given but speculative is {m:?}; give one of them"),
            }
        }
        if let Some(v) = &self.speculative_config {
            let model = v.model.as_deref();
            let method = v.method.as_deref().or(model.map(|m| if m == "[ngram]" { "ngram" } else { "draft_model" }));
            s.method = match method {
                Some("ngram") | Some("[ngram]") => SpecMethod::Ngram,
                Some("draft_model") | Some("draft") => {
                    if model.is_none() && self.draft_model.is_none() {
                        bail!("speculative_config: method draft_model needs \"model\" (the draft model's path)");
                    }
                    SpecMethod::Draft
                }
                // vLLM's names of the Qwen3.5 / Qwen3-Next head.
                Some("mtp") | Some("qwen3_next_mtp") | Some("qwen3_5_mtp") => SpecMethod::Mtp,
                Some(other) => {
                    bail!("speculative_config: method {other:?} is not supported (supported: ngram, draft_model, mtp)")
                }
                None => bail!("speculative_config: give method \"ngram\", or a draft \"model\""),
            };
            s.max_tokens = v.num_speculative_tokens.unwrap_or(s.max_tokens);
            s.ngram_max = v.prompt_lookup_max.unwrap_or(s.ngram_max);
            s.ngram_min = v.prompt_lookup_min.unwrap_or(s.ngram_min.min(s.ngram_max));
        }
        if s.method == SpecMethod::Draft && self.draft_model_path().is_none() {
            bail!("speculative draft needs draft_model (--draft-model FILE_OR_DIR)");
        }
        if s.max_tokens > MAX_SPECULATIVE_TOKENS {
            bail!("num_speculative_tokens {} is above the limit of {MAX_SPECULATIVE_TOKENS}", s.max_tokens);
        }
        if s.method != SpecMethod::Off && s.max_tokens == 0 {
            bail!("num_speculative_tokens must be positive when speculative decoding is on");
        }
        if s.ngram_min == 0 || s.ngram_min > s.ngram_max || s.ngram_max > MAX_NGRAM {
            bail!(
                "prompt_lookup_min {} and prompt_lookup_max {} must satisfy 1 <= min <= max <= {MAX_NGRAM}",
                s.ngram_min,
                s.ngram_max
            );
        }
        Ok(s)
    }
}

impl EngineConfig {
    /// The draft model's path: `draft_model`, else `speculative_config`'s `model` (not
    /// `[ngram]`).
    pub fn draft_model_path(&self) -> Option<std::path::PathBuf> {
        let from_vllm = self.speculative_config.as_ref().and_then(|v| v.model.clone()).filter(|m| m != "[ngram]");
        self.draft_model.clone().or(from_vllm).map(std::path::PathBuf::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_and_vllm_config() {
        let c = EngineConfig::default();
        assert!(!c.spec_settings().unwrap().enabled());
        let c = EngineConfig { speculative: SpecMethod::Ngram, ..Default::default() };
        let s = c.spec_settings().unwrap();
        assert!(s.enabled());
        assert_eq!((s.max_tokens, s.ngram_min, s.ngram_max), (4, 2, 4));
        let v: VllmSpeculativeConfig =
            serde_json::from_str(r#"{"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 5}"#)
                .unwrap();
        let c = EngineConfig { speculative_config: Some(v), ..Default::default() };
        let s = c.spec_settings().unwrap();
        assert_eq!((s.method, s.max_tokens, s.ngram_min, s.ngram_max), (SpecMethod::Ngram, 6, 2, 5));
        assert!(serde_json::from_str::<VllmSpeculativeConfig>(r#"{"method": "ngram", "draft_tp": 1}"#).is_err());
        let bad = |v: &str| {
            let v: VllmSpeculativeConfig = serde_json::from_str(v).unwrap();
            EngineConfig { speculative_config: Some(v), ..Default::default() }.spec_settings().unwrap_err().to_string()
        };
        assert!(bad(r#"{"method": "eagle3"}"#).contains("eagle3"));
        assert!(bad(r#"{"method": "draft_model"}"#).contains("model"));
        // A draft model: by path in vLLM's object, or by the plain keys.
        let v: VllmSpeculativeConfig =
            serde_json::from_str(r#"{"model": "d.gguf", "num_speculative_tokens": 3}"#).unwrap();
        let c = EngineConfig { speculative_config: Some(v), ..Default::default() };
        assert_eq!(
            (c.spec_settings().unwrap().method, c.draft_model_path()),
            (SpecMethod::Draft, Some("d.gguf".into()))
        );
        let c = EngineConfig { draft_model: Some("d".into()), ..Default::default() };
        assert_eq!(c.spec_settings().unwrap().method, SpecMethod::Draft);
        let c = EngineConfig { speculative: SpecMethod::Draft, ..Default::default() };
        assert!(c.spec_settings().unwrap_err().to_string().contains("draft_model"));
        let c = EngineConfig { speculative: SpecMethod::Ngram, draft_model: Some("d".into()), ..Default::default() };
        assert!(c.spec_settings().is_err());
        let v: VllmSpeculativeConfig =
            serde_json::from_str(r#"{"method": "qwen3_next_mtp", "num_speculative_tokens": 2}"#).unwrap();
        let c = EngineConfig { speculative_config: Some(v), ..Default::default() };
        assert_eq!((c.spec_settings().unwrap().method, c.spec_settings().unwrap().max_tokens), (SpecMethod::Mtp, 2));
        assert_eq!("mtp".parse::<SpecMethod>(), Ok(SpecMethod::Mtp));
        assert!(bad(r#"{"method": "ngram", "num_speculative_tokens": 99}"#).contains("num_speculative_tokens"));
        assert!(bad(r#"{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}"#).contains("prompt_lookup"));
    }
}
