//! `torus-wgpu tune` on lavapipe: it measures every GEMM variant the device has (the decode
//! kernel beside them), its plan agrees with its own timings, the tiled and grouped expert
//! kernels of a MoE block are timed and the faster kept, the choices are kept in the cache, the
//! next run on the adapter builds them, and a model runs right on a tuned plan. One test: it
//! sets the cache's environment variable for this process.

mod common;

use common::served::TempDir;
use common::{fixtures, tiny, F16_MARGIN};
use serde_json::Value;
use std::path::Path;
use std::sync::Arc;
use torus_wgpu::config::{EngineConfig, KernelProfile, KvDtype};
use torus_wgpu::gpu::tune_cache::{GemmRecord, TuneCache, TUNE_CACHE_ENV};
use torus_wgpu::gpu::wformat::WFormat;
use torus_wgpu::gpu::Gpu;
use torus_wgpu::ops::harness::Harness;
use torus_wgpu::ops::matmul::gemm::GemmPlan;

/// The measured time of `kernel` at `rows` in the tuner's JSON.
fn time(ms: &[Value], kernel: &str, rows: u64) -> Option<f64> {
    ms.iter().find(|m| m["kernel"] == kernel && m["rows"] == rows).and_then(|m| m["ms"].as_f64())
}

/// Runs `torus-wgpu tune ARGS --cache CACHE --json REPORT`; its stdout and the report.
fn tune(args: &[&str], cache: &Path, report: &Path) -> (String, Value) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_torus-wgpu"))
        .arg("tune")
        .args(args)
        .arg("--cache")
        .arg(cache)
        .arg("--json")
        .arg(report)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "tune failed: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    (stdout, serde_json::from_slice(&std::fs::read(report).unwrap()).unwrap())
}

#[test]
fn tune_keeps_a_plan_the_next_run_uses() {
    let dir = TempDir(std::env::temp_dir().join(format!("torus-tune-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0).unwrap();
    let cache = dir.0.join("cache/tune.json");
    let report = dir.0.join("report.json");
    let (stdout, r) = tune(
        &["--format", "q4_0", "--hidden", "256", "--ffn", "512", "--kv", "128", "--budget-s", "300"],
        &cache,
        &report,
    );
    let f = &r["formats"][0];
    assert_eq!(f["format"], "q4_0");
    assert_eq!(f["complete"], true, "{stdout}");
    let ms = f["measurements"].as_array().unwrap();
    // Every variant lavapipe has (f16 tiles and 128 x 128 tiles included) at every size, the
    // decode kernel up to 64 rows; none failed its check against the decode kernel. (The plan
    // chooses among all six: the fastest is taken among all six too.)
    let gemms = ["tile64", "tile32", "tile128", "tile64h", "tile32h", "tile128h"];
    for rows in [512, 32, 16, 8, 64] {
        for k in gemms {
            assert!(time(ms, k, rows).is_some(), "{k} at {rows} rows: {stdout}");
        }
        assert_eq!(time(ms, "decode", rows).is_some(), rows <= 64, "decode at {rows} rows");
    }
    // The plan is what its timings say: the fastest GEMM at 512 rows and at 32, and from
    // min_rows on the plan's GEMM beats the decode kernel at every size measured.
    let plan: GemmRecord = serde_json::from_value(f["plan"].clone()).unwrap();
    let fastest = |rows| {
        gemms
            .iter()
            .min_by(|a, b| time(ms, a, rows).unwrap().total_cmp(&time(ms, b, rows).unwrap()))
            .unwrap()
            .to_string()
    };
    assert_eq!(plan.large, fastest(512), "{stdout}");
    assert_eq!(plan.small, fastest(32), "{stdout}");
    let gemm_wins = |rows: u64| {
        let k = if rows < 64 { &plan.small } else { &plan.large };
        time(ms, k, rows).unwrap() < time(ms, "decode", rows).unwrap()
    };
    for rows in [8u64, 16, 32, 64] {
        if rows >= plan.min_rows as u64 {
            assert!(gemm_wins(rows), "the plan sends {rows} rows to a slower GEMM: {stdout}");
        }
    }
    if plan.min_rows > 64 {
        assert!([8u64, 16, 32, 64].iter().any(|&m| !gemm_wins(m)), "{stdout}");
    } else {
        assert!([8, 16, 32, 64].contains(&plan.min_rows), "{stdout}");
    }
    // One-token steps on int8 or f32 activations: both timed (the int8 output checked against
    // the f32 one first), the faster kept.
    let one = &f["one_token"];
    let (f32_ms, int8_ms) = (one["f32_ms"].as_f64().unwrap(), one["int8_ms"].as_f64());
    let int8_ms = int8_ms.unwrap_or_else(|| panic!("the int8 kernels were not timed: {stdout}"));
    assert_eq!(one["int8"], int8_ms < f32_ms, "{stdout}");
    let int8_kept = one["int8"].as_bool().unwrap();

    // A synthetic mixture-of-experts block (no time for the dense matmuls: budget 0): the tiled
    // and the grouped expert kernels timed at a 64-token step, the faster kept.
    let report2 = dir.0.join("report-moe.json");
    let (stdout, r) = tune(
        &[
            "--format",
            "q8_0",
            "--hidden",
            "256",
            "--ffn",
            "256",
            "--kv",
            "64",
            "--budget-s",
            "0",
            "--experts",
            "8",
            "--top-k",
            "2",
            "--expert-ffn",
            "256",
            "--moe-tokens",
            "64",
        ],
        &cache,
        &report2,
    );
    let moe = &r["moe"];
    assert_eq!(moe["format"], "q8_0", "{stdout}");
    let (grouped, tiled) = (moe["grouped_ms"].as_f64().unwrap(), moe["tiled_ms"].as_f64());
    let tiled = tiled.unwrap_or_else(|| panic!("the tiled kernels were not timed: {stdout}"));
    assert_eq!(moe["kernel"], if tiled < grouped { "tiled" } else { "grouped" }, "{stdout}");
    let moe_kernel = moe["kernel"].as_str().unwrap().to_string();

    // The next run on this adapter builds the kept plans (and nothing reads the default's).
    unsafe { std::env::set_var(TUNE_CACHE_ENV, &cache) };
    let gpu = Arc::new(Gpu::new(None).unwrap());
    let h = Harness::with_formats(gpu.clone(), &[WFormat::Q4_0, WFormat::Q8_0], (64, 1), KernelProfile::Gpu).unwrap();
    let g = h.kernels.matmul.gpu.as_ref().unwrap();
    assert_eq!(g.formats[&WFormat::Q4_0].plan.record(), plan);
    assert_eq!(h.uses_int8(WFormat::Q4_0, 1), int8_kept, "the kept int8 choice");
    assert_eq!(g.formats[&WFormat::Q8_0].plan, GemmPlan::default(), "q8_0's GEMMs were not measured");
    let h = Harness::for_moe(gpu.clone(), &[WFormat::Q8_0, WFormat::F32], KernelProfile::Gpu).unwrap();
    assert_eq!(h.kernels.moe.formats[&WFormat::Q8_0].use_tiled, moe_kernel == "tiled");

    // A model on a tuned plan: f16 tiles of 32 tokens from one row on (every matmul of every
    // step), against the PyTorch reference.
    let mut c = TuneCache::read(&cache).unwrap();
    for f in WFormat::ALL {
        let rec = GemmRecord { min_rows: 1, small: "tile32h".into(), large: "tile32h".into() };
        c.set_gemm(&gpu.info, torus_wgpu::ops::matmul::gemm::tuned_kernels(), f.name(), rec);
    }
    c.write(&cache).unwrap();
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("tiny-qwen2-reference.json")).unwrap()).unwrap();
    let cfg = EngineConfig {
        max_num_batched_tokens: 128,
        max_sequence_length: 256,
        total_cache_size: 16 << 20,
        kv_cache_dtype: KvDtype::F32,
        kernel_profile: KernelProfile::Gpu,
        ..Default::default()
    };
    let (mut model, _) = torus_wgpu::engine::load_model(&common::tiny(), &cfg, gpu, &|_, _| {}).unwrap();
    let plans: Vec<GemmPlan> = model.kernels().matmul.gpu.as_ref().unwrap().formats.values().map(|p| p.plan).collect();
    assert!(!plans.is_empty() && plans.iter().all(|p| p.kernel_for(1).name() == "tile32h"), "{plans:?}");
    tiny::assert_model_matches(&mut model, &reference, "tiny-qwen2 on tile32h", 2e-2, F16_MARGIN);
}
