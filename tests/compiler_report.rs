//! The GPU compiler report as a test: every gpu-profile pipeline (`torus-wgpu build-kernels`:
//! every weight format's decode kernels and GEMM variants, attention at the families' geometries,
//! MoE, DeltaNet, PLE, norms, RoPE, sampling) compiled by a real GPU compiler, Mesa's RADV (ACO)
//! for AMD's RDNA3 (navi31) and RDNA2 (navi21), on its null device behind scripts/radv-shim
//! (scripts/fetch-radv.sh fetches and builds both; scripts/setup.sh runs it). No pipeline may
//! spill vector registers or use scratch memory, and the decode matmuls keep enough waves per
//! SIMD to hide memory latency: at least 8 at one token, at least 4 at 2 to 16 tokens; attention
//! and the GEMM tiles at least 4 on RDNA3. The one-token int8 matmuls use RDNA3's dot4.

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

/// `torus-wgpu build-kernels ARGS` on RADV's null device for `target` with RADV_DEBUG=`debug`:
/// its stderr (each pipeline's label, then what RADV prints for it).
fn build_kernels(target: &str, debug: &str, args: &[&str]) -> String {
    let dir = radv();
    let lib = dir.join("root/usr/lib/x86_64-linux-gnu");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_torus-wgpu"))
        .arg("build-kernels")
        .args(args)
        .env("VK_ICD_FILENAMES", dir.join("shim_icd.json"))
        .env("TORUS_RADV_LIBRARY", lib.join("libvulkan_radeon.so"))
        .env("LD_LIBRARY_PATH", &lib)
        .env("RADV_FORCE_FAMILY", target)
        .env("RADV_DEBUG", debug)
        .env("MESA_SHADER_CACHE_DISABLE", "true")
        .env("TORUS_PIPELINE_CACHE_DIR", "off")
        .env("TORUS_PRINT_PIPELINES", "1")
        .env_remove("VK_DRIVER_FILES")
        .env_remove("VK_ADD_DRIVER_FILES")
        .env_remove("TORUS_INT8")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{target}: {stdout}\n{}", stderr.chars().rev().take(3000).collect::<String>());
    assert!(stdout.contains(&format!("RADV {}", target.to_uppercase())), "{target}: not RADV's device: {stdout}");
    stderr
}

/// The machine code RADV_DEBUG=asm printed for pipeline `label` (its lines up to the statistics).
fn asm_of<'a>(log: &'a str, label: &str) -> Vec<&'a str> {
    let start = format!("torus-wgpu pipeline: {label}");
    let mut lines = log.lines().skip_while(|l| *l != start).skip(1);
    lines.by_ref().take_while(|l| !l.starts_with("*** SHADER STATS ***")).collect()
}

/// (VALU, memory loads) of the loop with the most memory loads in `asm`: ACO's blocks
/// (`BB12:`) and the backward branches (`s_cbranch_scc0 BB12` after it) that close loops.
fn inner_loop(asm: &[&str]) -> Option<(usize, usize)> {
    let mut blocks: Vec<Vec<&str>> = Vec::new();
    let mut order = BTreeMap::new();
    for line in asm {
        let label = line
            .split_once(':')
            .map(|(n, _)| n)
            .filter(|n| n.strip_prefix("BB").is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit())));
        if let Some(name) = label {
            order.insert(name.to_string(), blocks.len());
            blocks.push(Vec::new());
        } else if let Some(b) = blocks.last_mut() {
            b.push(line.trim());
        }
    }
    let mut best: Option<((usize, i64), usize, usize)> = None;
    for (i, body) in blocks.iter().enumerate() {
        for ins in body {
            let mut words = ins.split_whitespace();
            let (Some(op), Some(target)) = (words.next(), words.next()) else { continue };
            if !(op.starts_with("s_branch") || op.starts_with("s_cbranch")) {
                continue;
            }
            let Some(&head) = order.get(target.trim_end_matches(',')) else { continue };
            if head > i {
                continue;
            }
            let body: Vec<&str> = blocks[head..=i].iter().flatten().copied().collect();
            let valu = body.iter().filter(|x| x.starts_with("v_")).count();
            let vmem = body.iter().filter(|x| x.starts_with("buffer_load") || x.starts_with("global_load")).count();
            let key = (vmem, -(body.len() as i64));
            if best.as_ref().is_none_or(|b| key > b.0) {
                best = Some((key, valu, vmem));
            }
        }
    }
    best.map(|(_, valu, vmem)| (valu, vmem))
}

/// The one-token int8 matmuls on RDNA3 (navi31): v_dot4 (RDNA3's v_dot4_i32_iu8, RDNA2's
/// v_dot4_i32_i8) in their loop over K and at most
/// 1.5 vector instructions per weight there (4 rows x one 32-weight block per iteration), for
/// Q4_K and Q8_0, plain and SwiGLU; still 8 waves per SIMD. The table formats' codes go through
/// a workgroup table (an address, its clamp and a read per two codes): at most 3.5 for IQ4_NL
/// and IQ4_XS (2.85 and 3.20 measured with Mesa 25.0.7, against 4.34 and 4.71 for their f32
/// kernels, whose table reads were memory loads).
#[test]
fn int8_matmuls_use_dot4_on_rdna3() {
    let log = build_kernels("navi31", "shaderstats,asm", &["--formats", "q4_k,q8_0,iq4_nl,iq4_xs"]);
    let (stats, _) = parse(&log);
    let mut failures = Vec::new();
    for (f, most) in [("q4_k", 1.5), ("q8_0", 1.5), ("iq4_nl", 3.5), ("iq4_xs", 3.5)] {
        for sw in [false, true] {
            let label = format!("matmul_gpu_i8_{f}_1_{sw}");
            let asm = asm_of(&log, &label);
            assert!(asm.len() > 50, "{label}: no machine code in the log");
            let (valu, vmem) = inner_loop(&asm).unwrap_or_else(|| panic!("{label}: no loop"));
            let dot4 = asm.iter().filter(|l| l.trim_start().starts_with("v_dot4_i32_i")).count();
            let per_weight = valu as f64 / 128.0;
            eprintln!(
                "{label}: {valu} VALU and {vmem} loads per iteration ({per_weight:.2} per weight), {dot4} v_dot4"
            );
            if dot4 < 16 || per_weight > most {
                failures.push(format!("{label}: {per_weight:.2} VALU per weight, {dot4} v_dot4"));
            }
            let waves = stats.get(&label).map_or(0, |s| s.waves);
            if waves < 8 {
                failures.push(format!("{label}: {waves} waves per SIMD"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn gpu_kernels_fit_in_registers_on_amd_targets() {
    let mut failures = Vec::new();
    for target in ["navi31", "navi21"] {
        let stderr = build_kernels(target, "shaderstats", &[]);
        let (stats, blocks) = parse(&stderr);
        let labels = stderr.lines().filter(|l| l.starts_with("torus-wgpu pipeline: ")).count();
        // Every pipeline named has its statistics (none came from a cache), and there are many.
        assert_eq!(blocks, labels, "{target}: statistics for every pipeline");
        assert!(stats.len() > 500, "{target}: only {} pipelines", stats.len());
        for (label, s) in &stats {
            if s.spilled_vgprs > 0 || s.scratch > 0 {
                failures.push(format!("{target} {label}: {} VGPRs spilled, {} B scratch", s.spilled_vgprs, s.scratch));
            }
            // Attention and the GEMM tiles on RDNA3: at least 4 waves. (ACO's scheduler picks a
            // wave target, then uses the registers that target leaves: their final VGPRs are far
            // above their demand before scheduling, so the floor is held, not a count.)
            let tiled = ["attention_split", "attention_tiled", "matmul_tile"].iter().any(|p| label.starts_with(p));
            if target == "navi31" && tiled && s.waves < 4 {
                failures.push(format!("{target} {label}: {} waves per SIMD ({} VGPRs), under 4", s.waves, s.vgprs));
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
