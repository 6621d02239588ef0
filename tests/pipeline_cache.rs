//! The driver's pipeline cache on disk: written after the pipelines are warmed up, read at the
//! next start, and a damaged file is ignored (an empty cache is started). Its own test binary,
//! since it sets TORUS_PIPELINE_CACHE_DIR for the process.

mod common;

use common::{fixtures, ids};
use std::sync::Arc;
use torus_wgpu::config::EngineConfig;
use torus_wgpu::engine::{generate, load_model};
use torus_wgpu::gpu::Gpu;
use torus_wgpu::sampling::SamplingParams;

#[test]
fn pipeline_cache_is_saved_reused_and_survives_damage() {
    let dir = std::env::temp_dir().join(format!("torus-pipeline-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // SAFETY: this test binary has one test; nothing else reads the environment concurrently.
    unsafe { std::env::set_var("TORUS_PIPELINE_CACHE_DIR", &dir) };
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("tiny-qwen2-reference.json")).unwrap()).unwrap();
    let prompt = &reference["prompts"][0];
    let (input, want) = (ids(&prompt["input_ids"]), ids(&prompt["greedy_ids"]));
    let cfg = EngineConfig { max_num_batched_tokens: 64, total_cache_size: 4 << 20, ..Default::default() };
    let run = || {
        let gpu = Gpu::new(None).expect("a wgpu adapter (lavapipe in CI)");
        if gpu.info.backend == wgpu::Backend::Vulkan {
            // Every Vulkan driver offers wgpu's PIPELINE_CACHE.
            assert!(gpu.pipeline_cache.is_some(), "no pipeline cache on a Vulkan adapter");
        }
        let has_cache = gpu.pipeline_cache.is_some();
        let (mut model, _) = load_model(&fixtures().join("tiny-qwen2"), &cfg, Arc::new(gpu), &|_, _| {}).unwrap();
        let got = generate(&mut model, &input, want.len(), &SamplingParams::default(), |_, _| true).unwrap().generated;
        let margins = common::floats(&prompt["argmax_margins"]);
        common::assert_greedy_matches(&got, &want, &margins, common::F16_MARGIN, "greedy tokens");
        has_cache
    };
    if !run() {
        eprintln!("this adapter has no pipeline cache: only the model run was checked");
        return;
    }
    let files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(files.len(), 1, "one cache file per adapter: {files:?}");
    let first = std::fs::read(&files[0]).unwrap();
    assert!(!first.is_empty());
    // A second start reads it (and writes it back).
    run();
    assert!(!std::fs::read(&files[0]).unwrap().is_empty());
    // A damaged file: the device starts an empty cache, the model still runs and the file is
    // rewritten whole.
    std::fs::write(&files[0], b"not a pipeline cache").unwrap();
    run();
    assert!(std::fs::read(&files[0]).unwrap().len() > 20);
    let _ = std::fs::remove_dir_all(&dir);
}
