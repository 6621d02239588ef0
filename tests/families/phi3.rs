//! Phi-3 end to end: the tiny model of scripts/fixtures/gen_tiny_phi3.py (fused q/k/v and gate/up
//! tensors, RoPE over half of each head, a sliding window of 8) from the Hugging Face directory
//! against transformers' semantics (the window on every layer), and its llama.cpp conversion
//! against llama.cpp's (phi3's window ignored; the generator checked llama.cpp's own logits
//! against the same reference), in both kernel profiles; refusals; the engine's properties.

use crate::common::tiny::{self, local, reference};
use torus_wgpu::config::KernelProfile;
use torus_wgpu::model::config::Arch;
use torus_wgpu::model::loader::read_config;

#[test]
fn phi3_config_from_hf_and_gguf() {
    for (f, window) in [("tiny-phi3", Some(8)), ("tiny-phi3.gguf", None)] {
        let c = read_config(&local(f)).unwrap_or_else(|e| panic!("{f}: {e:#}"));
        assert_eq!(c.arch, Arch::Phi3, "{f}");
        assert_eq!((c.hidden, c.heads, c.kv_heads, c.head_dim, c.intermediate), (64, 4, 2, 16, 128), "{f}");
        assert_eq!(c.style.rotary_dim, Some(8), "{f}: partial_rotary_factor 0.5");
        assert_eq!(c.sliding_window, window, "{f}");
    }
}

#[test]
fn phi3_matches_transformers_and_llama_cpp() {
    let hf = reference("tiny-phi3-reference.json");
    let gguf = reference("tiny-phi3-gguf-reference.json");
    assert!(gguf["llama_cpp_max_abs_diff_last_position"].as_f64().unwrap() < 1e-3);
    for profile in [KernelProfile::Cpu, KernelProfile::Gpu] {
        tiny::assert_matches_reference("tiny-phi3", &hf, profile);
        tiny::assert_matches_reference("tiny-phi3.gguf", &gguf, profile);
    }
}

/// Long-context Phi-3 (longrope: per-dimension short and long factors) is refused at load with
/// the file named, from either source.
#[test]
fn phi3_longrope_is_refused() {
    let dir = std::env::temp_dir().join(format!("torus-phi3-longrope-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(local("tiny-phi3/config.json")).unwrap()).unwrap();
    cfg["rope_scaling"] = serde_json::json!({"type": "longrope", "short_factor": [1.0, 1.0, 1.0, 1.0], "long_factor": [2.0, 2.0, 2.0, 2.0]});
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let e = format!("{:#}", read_config(&dir).unwrap_err());
    assert!(e.contains("longrope") && e.contains("config.json"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn phi3_batched_equals_alone_and_prefix_cache_on_equals_off() {
    tiny::assert_batched_equals_alone_and_prefix_cache_on_equals_off("tiny-phi3");
}
