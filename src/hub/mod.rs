//! Models by name from the Hugging Face Hub: `torus-wgpu pull OWNER/REPO[:QUANT]` and
//! `--model hf:OWNER/REPO[:QUANT]` (`-hf OWNER/REPO[:QUANT]`, llama.cpp's spelling). A GGUF
//! repository gives the file of the quantization asked for (Q4_K_M when none is named, else the
//! first; every part of a split file), a Transformers repository its safetensors, config and
//! tokenizer files (see `select`). Files go into the Hugging Face cache (`$HF_HOME/hub`, blobs +
//! snapshots + refs, see `cache`), so what other tools downloaded is reused and theirs reuse
//! ours; a file already there is used without any request. `HF_TOKEN` (or the
//! cache's token file) for gated repositories, `HF_ENDPOINT` for a mirror, `HF_HUB_OFFLINE=1`
//! for the cache only. Downloads are streamed to disk, resume from their last byte, and are
//! checked against the size and sha256 the Hub lists for them (see `fetch` and `http`). What
//! the Hub or the cache says is data, never a path until checked (see `cache`).
//!
//! Owns: the repository name syntax, file selection, the download into the Hugging Face cache.
//! May use: nothing.
//! Never uses: every other room (a leaf: the binary resolves `--model hf:...` through it before
//! any room loads the model).

mod cache;
mod fetch;
mod http;
pub mod select;

use anyhow::{bail, Result};
use std::path::PathBuf;

pub use fetch::{pull, pull_cancellable, Options};

/// `OWNER/REPO[:QUANT]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Spec {
    pub repo: String,
    pub quant: Option<String>,
}

/// The prefix of a `--model` value that names a Hub repository.
pub const MODEL_PREFIX: &str = "hf:";

impl Spec {
    pub fn parse(s: &str) -> Result<Spec> {
        let (repo, quant) = match s.split_once(':') {
            Some((r, q)) => (r, Some(q)),
            None => (s, None),
        };
        let ok_part = |p: &str| {
            !p.is_empty()
                && p.len() <= 96
                && p != "."
                && p != ".."
                && p.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        };
        let parts: Vec<&str> = repo.split('/').collect();
        if parts.len() != 2 || !parts.iter().all(|p| ok_part(p)) {
            bail!("{s:?} is not a Hub repository: give OWNER/REPO or OWNER/REPO:QUANT (e.g. ggml-org/Qwen3-8B-GGUF:Q4_K_M)");
        }
        let quant = match quant {
            None => None,
            Some(q) if ok_part(q) && q.len() <= 32 => Some(q.to_string()),
            Some(q) => bail!("{q:?} is not a quantization name (e.g. Q4_K_M, Q8_0)"),
        };
        Ok(Spec { repo: repo.to_string(), quant })
    }
}

/// A `--model` value: `hf:OWNER/REPO[:QUANT]` is pulled (or found in the cache) and becomes the
/// local path; anything else is returned as it is.
pub fn resolve_model_arg(value: &str) -> Result<String> {
    let Some(name) = value.strip_prefix(MODEL_PREFIX) else { return Ok(value.to_string()) };
    let spec = Spec::parse(name)?;
    let path: PathBuf = pull(&spec, &Options::from_env())?;
    Ok(path.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        let s = Spec::parse("ggml-org/Qwen3-8B-GGUF:Q4_K_M").unwrap();
        assert_eq!((s.repo.as_str(), s.quant.as_deref()), ("ggml-org/Qwen3-8B-GGUF", Some("Q4_K_M")));
        assert_eq!(Spec::parse("Qwen/Qwen3-8B").unwrap().quant, None);
        for bad in ["qwen3", "a/b/c", "../x", "a/..", "a/b:", "a/b:c/d", "a /b", "/b", "a/"] {
            assert!(Spec::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(resolve_model_arg("models/x.gguf").unwrap(), "models/x.gguf");
        assert!(resolve_model_arg("hf:nope").is_err());
    }
}
