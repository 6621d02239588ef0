//! Loading within memory (issue 50 item 8): a model whose plan does not fit the host's memory
//! is refused with one clear error (the model, what it needs, what there is) and a non-zero
//! exit instead of being killed; and layers read as they are uploaded (`HostModel::open`) give
//! the same model as layers loaded up front (`HostModel::load`), for every synthetic family,
//! a Hugging Face directory and a pipeline stage's range.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use torus_wgpu::config::{KernelProfile, KvDtype};
use torus_wgpu::gpu::{Gpu, WFormat};
use torus_wgpu::model::loader::HostModel;
use torus_wgpu::model::synth::{synth_shape_names, write_synthetic_gguf};
use torus_wgpu::model::synth_tiny::tiny_shape;
use torus_wgpu::model::{Model, StepInput, StepLimits};
use torus_wgpu::sampling::SampleParams;

fn smollm2() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(p.exists(), "{} is missing: run scripts/setup.sh (or scripts/fetch-model.sh)", p.display());
    p
}

/// Runs `generate` on `model` with `TORUS_HOST_MEMORY` set to `mem`: (exit code, stderr).
fn generate_with_host_memory(model: &Path, mem: &str) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_torus-wgpu"))
        .args(["generate", "--model", model.to_str().unwrap(), "--prompt", "hi", "--max-tokens", "2"])
        .env("TORUS_HOST_MEMORY", mem)
        .output()
        .unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).to_string())
}

#[test]
fn too_little_host_memory_is_refused_with_a_clear_error() {
    let model = smollm2();
    let (code, err) = generate_with_host_memory(&model, "64M");
    // An exit code (not a signal: nothing was killed), and one error line.
    assert_eq!(code, Some(1), "stderr: {err}");
    assert!(!err.contains("panicked"), "{err}");
    let line = err.lines().find(|l| l.starts_with("error: ")).unwrap_or_else(|| panic!("no error line: {err}"));
    for want in [
        model.to_str().unwrap(),
        "not enough host memory to load the model",
        "it needs ",
        "weights ",
        "the host has 64 MiB available (as TORUS_HOST_MEMORY says)",
    ] {
        assert!(line.contains(want), "{want:?} missing from: {line}");
    }
}

#[test]
fn a_bad_host_memory_figure_is_an_error() {
    let (code, err) = generate_with_host_memory(&smollm2(), "plenty");
    assert_eq!(code, Some(1), "stderr: {err}");
    assert!(err.contains("TORUS_HOST_MEMORY=plenty: expected bytes"), "{err}");
}

#[test]
fn enough_host_memory_loads() {
    let (code, err) = generate_with_host_memory(&smollm2(), "64G");
    assert_eq!(code, Some(0), "stderr: {err}");
}

fn limits() -> StepLimits {
    StepLimits {
        max_tokens: 16,
        max_seqs: 1,
        max_seq_len: 32,
        block_size: 16,
        cache_bytes: 1 << 20,
        max_binding: 0,
        kv_dtype: KvDtype::F32,
        profile: KernelProfile::Auto,
        sliding_window: None,
        int8: None,
    }
}

/// The logits of one prompt step through a model built from `host`.
fn logits(gpu: &Arc<Gpu>, host: &HostModel) -> Vec<f32> {
    let mut model = Model::new(gpu.clone(), host, limits()).unwrap();
    let prompt: Vec<u32> = vec![17, 400, 123, 9];
    let n = prompt.len();
    let pos: Vec<u32> = (0..n as u32).collect();
    model
        .step(&StepInput {
            tokens: prompt,
            positions: pos.clone(),
            slots: pos,
            seq_of_token: vec![0; n],
            block_tables: vec![vec![0]],
            sample_rows: vec![n as u32 - 1],
            sampling: vec![SampleParams::default()],
            state_slots: Vec::new(),
        })
        .unwrap();
    model.last_logits(1).unwrap()
}

/// What `open` surveys equals what `load` holds.
fn same_survey(path: &Path, what: &str) -> (HostModel, HostModel) {
    let loaded = HostModel::load(path, &|_, _| {}).unwrap();
    let opened = HostModel::open(path, None, &|_, _| {}).unwrap();
    assert!(opened.streams_layers() && opened.layers.is_empty() && !loaded.streams_layers(), "{what}");
    assert_eq!(opened.layer_count(), loaded.layers.len(), "{what}");
    assert_eq!(opened.summaries(), loaded.summaries(), "{what}");
    assert_eq!((opened.formats(), opened.moe_formats()), (loaded.formats(), loaded.moe_formats()), "{what}");
    assert_eq!(opened.final_norm, loaded.final_norm, "{what}");
    // The embedding and LM head are read again when uploaded, like the layers.
    assert!(opened.embed.is_none() && opened.lm_head.is_none() && loaded.embed.is_some(), "{what}");
    assert_eq!((opened.embed_info(), opened.lm_head_info()), (loaded.embed_info(), loaded.lm_head_info()), "{what}");
    assert_eq!(opened.read_embed().unwrap().unwrap().q, loaded.embed.as_ref().unwrap().q, "{what}");
    (loaded, opened)
}

#[test]
fn streamed_layers_survey_like_loaded_ones_in_every_family() {
    let dir = std::env::temp_dir().join(format!("torus-load-memory-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for name in &synth_shape_names() {
        let (shape, layers) = tiny_shape(name).unwrap();
        let path = dir.join(format!("{name}.gguf"));
        write_synthetic_gguf(&path, &shape, WFormat::Q8_0, Some(layers), 3).unwrap();
        let (loaded, opened) = same_survey(&path, name);
        // Each layer read again is the one surveyed.
        for l in 0..layers {
            let read = torus_wgpu::model::stream::LayerSummary::of(&opened.layer(l).unwrap());
            assert_eq!(read, torus_wgpu::model::stream::LayerSummary::of(&loaded.layers[l]), "{name} layer {l}");
        }
        let _ = std::fs::remove_file(&path);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn streamed_models_compute_what_loaded_ones_do() {
    let gpu = Arc::new(Gpu::new(None).expect("a wgpu adapter (lavapipe in CI)"));
    // A Hugging Face directory, and a hybrid MoE GGUF (recurrent and attention layers, experts).
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-qwen2");
    let dir = std::env::temp_dir().join(format!("torus-load-memory-run-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let hybrid = dir.join("hybrid.gguf");
    let (shape, layers) = tiny_shape("qwen3.6-35b-a3b").unwrap();
    write_synthetic_gguf(&hybrid, &shape, WFormat::Q4_K, Some(layers), 5).unwrap();
    for path in [tiny.as_path(), hybrid.as_path()] {
        let what = path.display().to_string();
        let (loaded, opened) = same_survey(path, &what);
        assert_eq!(logits(&gpu, &opened), logits(&gpu, &loaded), "{what}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_stage_opens_only_its_layers() {
    let (shape, _) = tiny_shape("qwen2.5-0.5b").unwrap();
    let dir = std::env::temp_dir().join(format!("torus-load-memory-stage-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("m.gguf");
    write_synthetic_gguf(&path, &shape, WFormat::Q8_0, Some(3), 1).unwrap();
    let host = HostModel::open(&path, Some(1..2), &|_, _| {}).unwrap();
    assert_eq!((host.first_layer, host.layer_count()), (1, 1));
    assert!(host.holds(&(1..2)) && !host.holds(&(0..2)) && !host.holds(&(1..3)));
    assert!(host.embed_info().is_none() && host.lm_head_info().is_none() && host.read_embed().unwrap().is_none());
    let e = host.layer(0).err().unwrap().to_string();
    assert!(e.contains("layer 0 was not loaded from") && e.contains("m.gguf"), "{e}");
    assert!(host.layer(1).is_ok());
    let e = HostModel::open(&path, Some(2..5), &|_, _| {}).err().unwrap().to_string();
    assert!(e.contains("layers 2..5 are outside the model's 3 layers"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}
