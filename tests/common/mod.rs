//! Paths shared by the integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures")
}

/// The tiny Qwen2 model of the fixtures (Hugging Face layout).
pub fn tiny() -> PathBuf {
    fixtures().join("tiny-qwen2")
}

/// The default model, when scripts/fetch-model.sh has fetched it (None, with a note, otherwise).
pub fn smollm2() -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if p.exists() {
        Some(p)
    } else {
        eprintln!("SKIPPED: {} missing (scripts/fetch-model.sh)", p.display());
        None
    }
}
