//! The GPU compiler report as a test: every gpu-profile pipeline (`torus-wgpu build-kernels`:
//! every weight format's decode kernels and GEMM variants, attention at the families' geometries,
//! MoE, DeltaNet, PLE, norms, RoPE, sampling) compiled by a real GPU compiler, Mesa's RADV (ACO)
//! for AMD's RDNA3 (navi31) and RDNA2 (navi21), on its null device behind scripts/radv-shim
//! (scripts/fetch-radv.sh fetches and builds both; scripts/setup.sh runs it). No pipeline may
//! spill vector registers or use scratch memory, and the decode matmuls keep enough waves per
//! SIMD to hide memory latency: at least 8 at one token, at least 4 at 2 to 16 tokens.

#![cfg(target_arch = "x86_64")]

use std::collections::BTreeMap;
use std::path::PathBuf;

/// One pipeline's figures from RADV_DEBUG=shaderstats.
#[derive(Debug, Default, Clone)]
struct Stats {
    vgprs: u32,
    spilled_vgprs: u32,
    scratch: u32,
    waves: u32,
}

/// label -> figures, from the stderr of a run with TORUS_PRINT_PIPELINES=1.
fn parse(log: &str) -> (BTreeMap<String, Stats>, usize) {
    let (mut out, mut blocks) = (BTreeMap::new(), 0);
    let (mut label, mut cur): (Option<String>, Option<Stats>) = (None, None);
    for line in log.lines() {
        if let Some(l) = line.strip_prefix("torus-wgpu pipeline: ") {
            label = Some(l.to_string());
        } else if line.starts_with("*** SHADER STATS ***") {
            cur = Some(Stats::default());
        } else if line.starts_with("****") {
            if let (Some(l), Some(s)) = (label.take(), cur.take()) {
                out.insert(l, s);
                blocks += 1;
            }
        } else if let Some(s) = cur.as_mut() {
            let (k, v) = line.split_once(": ").unwrap_or_default();
            let v: u32 = v.trim().parse().unwrap_or(0);
            match k {
                "VGPRs" => s.vgprs = v,
                "Spilled VGPRs" => s.spilled_vgprs = v,
                "Scratch size" => s.scratch = v,
                "Subgroups per SIMD" => s.waves = v,
                _ => {}
            }
        }
    }
    (out, blocks)
}

/// RADV and the shim, as scripts/fetch-radv.sh leaves them.
fn radv() -> PathBuf {
    let dir = std::env::var_os("TORUS_RADV_DIR").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/torus-wgpu/mesa-25.0.7")
    });
    for f in ["shim_icd.json", "libtorus_radv_shim.so", "root/usr/lib/x86_64-linux-gnu/libvulkan_radeon.so"] {
        assert!(
            dir.join(f).exists(),
            "{} is missing: run scripts/fetch-radv.sh (scripts/setup.sh does)",
            dir.join(f).display()
        );
    }
    dir
}

#[test]
fn gpu_kernels_fit_in_registers_on_amd_targets() {
    let dir = radv();
    let lib = dir.join("root/usr/lib/x86_64-linux-gnu");
    let mut failures = Vec::new();
    for target in ["navi31", "navi21"] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_torus-wgpu"))
            .arg("build-kernels")
            .env("VK_ICD_FILENAMES", dir.join("shim_icd.json"))
            .env("TORUS_RADV_LIBRARY", lib.join("libvulkan_radeon.so"))
            .env("LD_LIBRARY_PATH", &lib)
            .env("RADV_FORCE_FAMILY", target)
            .env("RADV_DEBUG", "shaderstats")
            .env("MESA_SHADER_CACHE_DISABLE", "true")
            .env("TORUS_PIPELINE_CACHE_DIR", "off")
            .env("TORUS_PRINT_PIPELINES", "1")
            .env_remove("VK_DRIVER_FILES")
            .env_remove("VK_ADD_DRIVER_FILES")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{target}: {stdout}\n{}", stderr.chars().rev().take(3000).collect::<String>());
        assert!(stdout.contains(&format!("RADV {}", target.to_uppercase())), "{target}: not RADV's device: {stdout}");
        let (stats, blocks) = parse(&stderr);
        let labels = stderr.lines().filter(|l| l.starts_with("torus-wgpu pipeline: ")).count();
        // Every pipeline named has its statistics (none came from a cache), and there are many.
        assert_eq!(blocks, labels, "{target}: statistics for every pipeline");
        assert!(stats.len() > 500, "{target}: only {} pipelines", stats.len());
        for (label, s) in &stats {
            if s.spilled_vgprs > 0 || s.scratch > 0 {
                failures.push(format!("{target} {label}: {} VGPRs spilled, {} B scratch", s.spilled_vgprs, s.scratch));
            }
            // Decode matmuls: matmul_gpu_FORMAT_TOKENS_SWIGLU.
            let Some(rest) = label.strip_prefix("matmul_gpu_") else { continue };
            let tokens: u32 = rest.rsplit('_').nth(1).and_then(|t| t.parse().ok()).expect(label);
            let floor = if tokens == 1 { 8 } else { 4 };
            if s.waves < floor {
                failures
                    .push(format!("{target} {label}: {} waves per SIMD ({} VGPRs), under {floor}", s.waves, s.vgprs));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
