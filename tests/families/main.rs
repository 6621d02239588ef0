//! The model families' tests, one file per family of model/families/ (`<family>.rs`), in one
//! test binary over one harness (tests/common/tiny.rs): each family's tiny random checkpoint
//! (tests/fixtures, made by scripts/fixtures/gen_tiny_*.py) against transformers' float32
//! logits and greedy tokens, its llama.cpp-layout GGUF against the same (or llama.cpp's own)
//! reference, in both kernel profiles, and the engine's properties on it; the few real models
//! with references of their own (gemma3_270m.rs). Here: what the family table refuses.

#[path = "../common/mod.rs"]
mod common;

mod gemma;
mod gemma3_270m;
mod gemma4;
mod gptoss;
mod llama;
mod phi3;
mod qwen;
mod qwen35;
mod qwen35_mtp;

use common::tiny::local;
use serde_json::Value;
use torus_wgpu::model::loader::read_config;

/// Config errors name the file and the problem: an architecture no family answers to (listing
/// those the table has), a RoPE scaling no family reads.
#[test]
fn unsupported_architecture_and_rope_scaling_are_refused() {
    let tmp = std::env::temp_dir().join(format!("torus-arch-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let base: Value =
        serde_json::from_str(&std::fs::read_to_string(local("tiny-llama3/config.json")).unwrap()).unwrap();
    let write = |v: &Value| {
        std::fs::write(tmp.join("config.json"), serde_json::to_string(v).unwrap()).unwrap();
        read_config(&tmp).expect_err("must be refused").to_string()
    };
    let mut v = base.clone();
    v["architectures"] = serde_json::json!(["GPTNeoXForCausalLM"]);
    let err = write(&v);
    assert!(
        err.contains("config.json") && err.contains("GPTNeoXForCausalLM") && err.contains("Qwen3ForCausalLM"),
        "{err}"
    );
    let mut v = base.clone();
    v["rope_scaling"] = serde_json::json!({"rope_type": "longrope", "factor": 4.0});
    v.as_object_mut().unwrap().remove("rope_parameters");
    let err = write(&v);
    assert!(err.contains("longrope") && err.contains("llama3"), "{err}");
    std::fs::remove_dir_all(&tmp).ok();
}
