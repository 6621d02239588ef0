//! Bad input fails with one clear error line naming the file or field, a non-zero exit, and no
//! panic. Each case runs the real binary.

use std::path::{Path, PathBuf};
use std::process::Command;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("torus-errors-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A writable copy of tiny-qwen2 to damage.
fn tiny_copy(name: &str) -> PathBuf {
    let d = scratch(name);
    for e in std::fs::read_dir(fixtures().join("tiny-qwen2")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), d.join(e.file_name())).unwrap();
    }
    d
}

/// Runs `generate` and returns stderr, asserting failure without a panic.
fn fails(args: &[&str], env: &[(&str, &str)]) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_torus-wgpu"));
    cmd.arg("generate").args(args).arg("--max-tokens").arg("4");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "expected failure for {args:?}, got success; stderr: {err}");
    assert_eq!(out.status.code(), Some(1), "exit code for {args:?}; stderr: {err}");
    assert!(!err.contains("panicked"), "panic for {args:?}: {err}");
    let line = err.lines().find(|l| l.starts_with("error: ")).unwrap_or_else(|| panic!("no error line: {err}"));
    line.to_string()
}

fn edit_json(path: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

#[test]
fn missing_model_path() {
    let e = fails(&["--model", "/nonexistent/model.gguf", "--prompt", "hi"], &[]);
    assert!(e.contains("/nonexistent/model.gguf"), "{e}");
}

#[test]
fn truncated_and_corrupt_gguf() {
    let d = scratch("gguf");
    let bad = d.join("bad.gguf");
    std::fs::write(&bad, b"NOTGGUF0000000000000000000").unwrap();
    let e = fails(&["--model", bad.to_str().unwrap(), "--prompt", "hi"], &[]);
    assert!(e.contains("bad.gguf") && e.to_lowercase().contains("magic"), "{e}");

    let real = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if real.exists() {
        let cut = d.join("cut.gguf");
        let bytes = std::fs::read(&real).unwrap();
        std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
        let e = fails(&["--model", cut.to_str().unwrap(), "--prompt", "hi"], &[]);
        assert!(e.contains("cut.gguf") && e.contains("past end of file"), "{e}");
    }
}

#[test]
fn truncated_safetensors() {
    let d = tiny_copy("trunc");
    let st = d.join("model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    std::fs::write(&st, &bytes[..bytes.len() - 1000]).unwrap();
    let e = fails(&["--model", d.to_str().unwrap(), "--prompt", "hi"], &[]);
    assert!(e.contains("model.safetensors"), "{e}");
}

#[test]
fn garbage_safetensors_header() {
    let d = tiny_copy("garbage");
    std::fs::write(d.join("model.safetensors"), b"\xff\xff\xff\xff\xff\xff\xff\x7fnot a header").unwrap();
    let e = fails(&["--model", d.to_str().unwrap(), "--prompt", "hi"], &[]);
    assert!(e.contains("model.safetensors") && e.contains("invalid safetensors"), "{e}");
}

#[test]
fn shape_mismatch_names_the_tensor() {
    let d = tiny_copy("shape");
    edit_json(&d.join("config.json"), |v| v["intermediate_size"] = 96.into());
    let e = fails(&["--model", d.to_str().unwrap(), "--prompt", "hi"], &[]);
    assert!(e.contains("mlp.gate_proj.weight") && e.contains("shape"), "{e}");
}

#[test]
fn unsupported_architecture() {
    // A recurrent model, DeepSeek's MLA and Llama 4's interleaved MoE: each named at load.
    for arch in ["MambaForCausalLM", "DeepseekV3ForCausalLM", "Llama4ForCausalLM"] {
        let d = tiny_copy(&format!("arch-{arch}"));
        edit_json(&d.join("config.json"), |v| v["architectures"] = serde_json::json!([arch]));
        let e = fails(&["--model", d.to_str().unwrap(), "--prompt", "hi"], &[]);
        assert!(e.contains("config.json") && e.contains(arch) && e.contains("supported"), "{e}");
    }
    // A GGUF file of llama.cpp's `deepseek` architecture (the tiny Qwen3-MoE file with its
    // architecture name, and the keys under it, renamed: same length, so still a valid file).
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-qwen3moe.gguf");
    let mut bytes = std::fs::read(src).unwrap();
    let (from, to) = (b"qwen3moe", b"deepseek");
    let mut i = 0;
    while i + from.len() <= bytes.len() {
        if &bytes[i..i + from.len()] == from {
            bytes[i..i + from.len()].copy_from_slice(to);
        }
        i += 1;
    }
    let f = scratch("arch-gguf").join("deepseek.gguf");
    std::fs::write(&f, bytes).unwrap();
    let e = fails(&["--model", f.to_str().unwrap(), "--prompt", "hi"], &[]);
    assert!(e.contains("deepseek.gguf") && e.contains("unsupported architecture 'deepseek'"), "{e}");
}

#[test]
fn unsupported_dtype_names_the_tensor() {
    // Rewrite the safetensors header so one tensor claims dtype I32 (same byte size as F32).
    let d = tiny_copy("dtype");
    let st = d.join("model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8(bytes[8..8 + n].to_vec()).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&header).unwrap();
    v["model.layers.0.mlp.up_proj.weight"]["dtype"] = "I32".into();
    let mut h = serde_json::to_string(&v).unwrap();
    while h.len() < n {
        h.push(' ');
    }
    assert_eq!(h.len(), n, "rewritten header must keep its length");
    let mut out = bytes[..8].to_vec();
    out.extend(h.as_bytes());
    out.extend(&bytes[8 + n..]);
    std::fs::write(&st, out).unwrap();
    let e = fails(&["--model", d.to_str().unwrap(), "--prompt", "hi"], &[]);
    assert!(e.contains("model.layers.0.mlp.up_proj.weight") && e.contains("I32"), "{e}");
}

#[test]
fn prompt_longer_than_max_sequence_length() {
    let d = fixtures().join("tiny-qwen2");
    let long = "hello world ".repeat(100);
    let e = fails(&["--model", d.to_str().unwrap(), "--prompt", &long, "--max-sequence-length", "64"], &[]);
    assert!(e.contains("max_sequence_length"), "{e}");
}

#[test]
fn invalid_config_value_names_the_key() {
    let d = scratch("config");
    let cfg = d.join("bad.json");
    std::fs::write(&cfg, r#"{"block_size": 0}"#).unwrap();
    let e = fails(&["--config", cfg.to_str().unwrap(), "--prompt", "hi"], &[]);
    assert!(e.contains("block_size"), "{e}");
    std::fs::write(&cfg, r#"{"max_decode_batch": 4}"#).unwrap();
    let e = fails(&["--config", cfg.to_str().unwrap(), "--prompt", "hi"], &[]);
    assert!(e.contains("max_decode_batch"), "{e}");
}

#[test]
fn no_gpu_adapter_says_what_to_install() {
    let d = fixtures().join("tiny-qwen2");
    let e = fails(
        &["--model", d.to_str().unwrap(), "--prompt", "hi"],
        &[("VK_ICD_FILENAMES", "/nonexistent/icd.json"), ("VK_DRIVER_FILES", "/nonexistent/icd.json")],
    );
    assert!(e.contains("mesa-vulkan-drivers"), "{e}");
}

#[test]
fn shipped_configs_parse_and_validate() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
    let mut n = 0;
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "json") {
            torus_wgpu::config::EngineConfig::from_file(&p).unwrap_or_else(|e| panic!("{e}"));
            n += 1;
        }
    }
    assert!(n >= 3);
}
