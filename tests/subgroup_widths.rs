//! The gpu profile at every subgroup width a real GPU uses. llvmpipe's subgroup width follows
//! LP_NATIVE_VECTOR_WIDTH (128 bits: 4 lanes, 256: 8, the default; 1024: 32 as NVIDIA, Apple
//! and AMD's wave32; 2048: 64 as AMD's wave64). `every_subgroup_width` runs this file's two
//! checks again in child processes at 4, 32 and 64 lanes (each child asserts it got that width);
//! at the default width they run as ordinary tests. The checks: the gpu profile's decode
//! matmuls (whose reduction uses subgroups) and tiled matmuls against the CPU reference, and
//! tiny-qwen2 under the gpu profile against the PyTorch reference.

mod common;

use common::reference::{assert_close, matmul_tol, randn, weights};
use common::{fixtures, tiny, F32_MARGIN};
use std::process::Command;
use std::sync::Arc;
use torus_wgpu::config::{EngineConfig, KernelProfile, KvDtype};
use torus_wgpu::gpu::wformat::WFormat;
use torus_wgpu::gpu::Gpu;
use torus_wgpu::ops::harness::Harness;
use torus_wgpu::ops::matmul::gemm::{GemmKernel, GemmPlan};
use torus_wgpu::sampling::Rng;
use torus_wgpu::weights::tensor::matmul_ref;

/// The adapter, and in a child process the check that it runs at the width asked for.
fn gpu() -> Arc<Gpu> {
    let gpu = Gpu::new(None).expect("a wgpu adapter (lavapipe in CI)");
    if let Ok(want) = std::env::var("TORUS_EXPECT_SUBGROUP") {
        let want: u32 = want.parse().unwrap();
        assert!(gpu.subgroups, "the adapter has no subgroups");
        assert_eq!(
            (gpu.info.subgroup_min_size, gpu.info.subgroup_max_size),
            (want, want),
            "LP_NATIVE_VECTOR_WIDTH={:?} gave other subgroups",
            std::env::var("LP_NATIVE_VECTOR_WIDTH")
        );
    }
    Arc::new(gpu)
}

#[test]
fn gpu_profile_matmuls_at_this_width() {
    let formats = [WFormat::Q4_K, WFormat::Q6_K, WFormat::Q8_0];
    let mut h = Harness::with_formats(gpu(), &formats, (64, 1), KernelProfile::Gpu).unwrap();
    // TORUS_INT8=1 (every_subgroup_width's second runs): one-token steps on int8 activations.
    let int8 = std::env::var("TORUS_INT8").is_ok_and(|v| v == "1");
    assert!(formats.iter().all(|&f| h.uses_int8(f, 1) == int8), "int8 one-token matmuls: {int8}");
    let mut rng = Rng::new(11);
    // Decode variants (1, 3 and 16 rows; rows of 16, 80 and 24 blocks: groups of 16, 64 and 32
    // invocations per row),
    // and the tiled kernel (70 rows: two token tiles).
    for format in formats {
        for (m, n, k) in [(1, 37, 512), (1, 9, 2560), (3, 20, 2560), (16, 13, 768), (70, 67, 256)] {
            let w = weights(format, n, k, &mut rng, 1.0);
            let x = randn(&mut rng, m * k, 1.0);
            let want = matmul_ref(&x, m, &w);
            let tol = matmul_tol(&h, &x, m, &w, false);
            let got = h.matmul(&w, None, &x, m, None, None, None, false, 1 << 27).unwrap();
            assert_close(&got, &want, |i| tol[i], &format!("{format:?} m={m} n={n} k={k}"));
        }
        // The fused SwiGLU of the decode and the tiled kernels.
        for (m, n) in [(2, 41), (70, 9)] {
            let (gate, up) = (weights(format, n, 256, &mut rng, 0.5), weights(format, n, 256, &mut rng, 0.5));
            let x = randn(&mut rng, m * 256, 0.02);
            let (g, u) = (matmul_ref(&x, m, &gate), matmul_ref(&x, m, &up));
            let want: Vec<f32> = g.iter().zip(&u).map(|(a, b)| a / (1.0 + (-a).exp()) * b).collect();
            let (tg, tu) = (matmul_tol(&h, &x, m, &gate, false), matmul_tol(&h, &x, m, &up, false));
            let got = h.matmul(&gate, Some(&up), &x, m, None, None, None, false, 1 << 27).unwrap();
            let tol = |i: usize| 2.0 * (tg[i] * u[i].abs() + tu[i] * g[i].abs()) + 1e-5 * (1.0 + want[i].abs());
            assert_close(&got, &want, tol, &format!("swiglu {format:?} m={m} n={n}"));
        }
    }
    // GEMM variants for batched-decode-sized steps (a plan from 8 rows): ragged token tiles. They
    // use no subgroup operations; these two cover what the variants differ in (32 and 128 tokens,
    // f16 and f32 tiles, 64 and 256 invocations with joint and split loads).
    for v in [GemmKernel::Tile { bm: 32, f16: true }, GemmKernel::Tile { bm: 128, f16: false }] {
        let GemmKernel::Tile { f16, .. } = v else { unreachable!() };
        h.set_gemm(GemmPlan::only(v, 8)).unwrap();
        for format in formats {
            for (m, n, k) in [(8, 37, 512), (17, 20, 768)] {
                let w = weights(format, n, k, &mut rng, 1.0);
                let x = randn(&mut rng, m * k, 1.0);
                let want = matmul_ref(&x, m, &w);
                let tol = matmul_tol(&h, &x, m, &w, f16);
                let got = h.matmul(&w, None, &x, m, None, None, None, false, 1 << 27).unwrap();
                assert_close(&got, &want, |i| tol[i], &format!("{} {format:?} m={m} n={n} k={k}", v.name()));
            }
        }
    }
}

#[test]
fn tiny_qwen2_gpu_profile_at_this_width() {
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("tiny-qwen2-reference.json")).unwrap()).unwrap();
    let cfg = EngineConfig {
        max_num_batched_tokens: 128,
        max_sequence_length: 256,
        total_cache_size: 16 << 20,
        kv_cache_dtype: KvDtype::F32,
        kernel_profile: KernelProfile::Gpu,
        ..Default::default()
    };
    let (mut model, _) = torus_wgpu::engine::load_model(&common::tiny(), &cfg, gpu(), &|_, _| {}).unwrap();
    assert_eq!(model.limits.profile, KernelProfile::Gpu);
    // Float weights have no int8 kernels: TORUS_INT8=1 leaves this model on f32 activations.
    assert!(!model.runs_int8(), "tiny-qwen2's float32 matmuls have no int8 path");
    tiny::assert_model_matches(&mut model, &reference, "tiny-qwen2 gpu profile", 1e-3, F32_MARGIN);
}

/// Both checks again at 4, 32 and 64 lanes, each in a child process of this test binary.
#[test]
fn every_subgroup_width() {
    let probe = Gpu::new(None).expect("a wgpu adapter (lavapipe in CI)");
    if !probe.info.name.contains("llvmpipe") {
        // Only llvmpipe's width can be chosen; a real GPU runs the checks at its own width.
        assert!(std::env::var_os("CI").is_none(), "CI runs on lavapipe, this adapter is {}", probe.describe());
        eprintln!("{}: not llvmpipe, the subgroup width is the GPU's own", probe.describe());
        return;
    }
    let exe = std::env::current_exe().unwrap();
    // Each width with the defaults (f32 activations on llvmpipe; this process ran 8 lanes) and
    // with the one-token matmuls on int8 activations (TORUS_INT8=1), as GPUs run them.
    let runs = [
        (128, 4, false),
        (1024, 32, false),
        (2048, 64, false),
        (256, 8, true),
        (128, 4, true),
        (1024, 32, true),
        (2048, 64, true),
    ];
    for (bits, lanes, int8) in runs {
        let mut cmd = Command::new(&exe);
        cmd.args(["--exact", "gpu_profile_matmuls_at_this_width", "tiny_qwen2_gpu_profile_at_this_width"])
            .args(["--test-threads", "1", "--nocapture"])
            .env("LP_NATIVE_VECTOR_WIDTH", bits.to_string())
            .env("TORUS_EXPECT_SUBGROUP", lanes.to_string())
            .env_remove("TORUS_INT8");
        if int8 {
            cmd.env("TORUS_INT8", "1");
        }
        let out = cmd.output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        let what = format!("at {lanes} lanes (LP_NATIVE_VECTOR_WIDTH={bits}) int8 {int8}");
        assert!(out.status.success(), "{what}:\n{text}");
        assert!(text.contains("test result: ok. 2 passed"), "{what}: both checks ran:\n{text}");
        eprintln!("subgroups of {lanes}, int8 {int8}: both checks passed");
    }
}
