//! Every WGSL kernel against a plain-Rust CPU reference on random data: odd sizes, shapes that
//! cross 32-element blocks, KV blocks and weight chunks, several GQA ratios, each weight format.

mod common;

use common::reference::{assert_close, dot_tol, dot_tol_q8, matmul_tol, randn, weights};
use std::sync::{Arc, OnceLock};
use torus_wgpu::config::{KernelProfile, KvDtype};
use torus_wgpu::gpu::wformat::{WFormat, XQuant};
use torus_wgpu::gpu::{validate_wgsl, Gpu};
use torus_wgpu::ops::harness::{AttnShape, AttnStep, Harness};
use torus_wgpu::ops::kernels::all_sources;
use torus_wgpu::ops::matmul::gemm::coop_sources;
use torus_wgpu::ops::matmul::gemm::{GemmKernel, GemmPlan};
use torus_wgpu::ops::matmul::tiles::{plan_x, XPlan, MATMUL_TILES, UNIFORM_X_VEC4};
use torus_wgpu::sampling::Rng;
use torus_wgpu::sampling::{Adjust, SampleParams};
use torus_wgpu::weights::tensor::matmul_ref;
use torus_wgpu::weights::tensor::QTensor;

fn gpu() -> Arc<Gpu> {
    static GPU: OnceLock<Arc<Gpu>> = OnceLock::new();
    GPU.get_or_init(|| Arc::new(Gpu::new(None).expect("a wgpu adapter (lavapipe in CI)"))).clone()
}

/// Every kernel (all weight formats; attention for head_dim 64), built once for all tests.
fn harness() -> &'static Harness {
    static H: OnceLock<Harness> = OnceLock::new();
    H.get_or_init(|| Harness::new(gpu(), 64).unwrap())
}

#[test]
fn every_shader_validates_with_naga() {
    for (label, src) in all_sources(&[16, 64, 128]) {
        validate_wgsl(&label, &src).unwrap();
    }
}

/// The cooperative-matrix GEMM cannot run on lavapipe: every variant must validate with naga
/// and translate to SPIR-V (with the cooperative-matrix capability), and it stays off here.
#[test]
fn cooperative_matrix_gemm_validates_and_translates() {
    let all = coop_sources();
    assert_eq!(all.len(), WFormat::ALL.len() * 10);
    for (label, src) in all {
        let spv = torus_wgpu::gpu::coop::validate_and_translate(&label, &src).unwrap();
        // The SPIR-V magic number, and the CooperativeMatrixKHR capability (6022) declared.
        assert_eq!(spv[0], 0x0723_0203, "{label}");
        assert!(spv.windows(2).any(|w| w == [(2 << 16) | 17, 6022]), "{label}: no CooperativeMatrixKHR capability");
    }
    assert!(gpu().coop.is_none(), "lavapipe has no cooperative matrices");
}

/// cpu profile: every tile with storage x, and the uniform-x plan (one window, or several when
/// m rows of x exceed UNIFORM_X_VEC4 vec4s).
fn variants() -> Vec<(Option<usize>, bool)> {
    (0..MATMUL_TILES.len()).map(|t| (Some(t), false)).chain([(None, true)]).collect()
}

/// The gpu profile: with subgroup reductions (lavapipe has subgroups) and through workgroup
/// memory only.
fn gpu_harnesses() -> &'static [Harness; 2] {
    static H: OnceLock<[Harness; 2]> = OnceLock::new();
    H.get_or_init(|| {
        let mut plain = Gpu::new(None).unwrap();
        assert!(plain.subgroups, "lavapipe offers subgroups: the subgroup reduction must be tested");
        plain.subgroups = false;
        let hs = [gpu(), Arc::new(plain)].map(|g| Harness::with_profile(g, 64, 1, KernelProfile::Gpu).unwrap());
        assert!(hs.iter().all(|h| h.kernels.matmul.gpu.is_some()), "the gpu profile's kernels are built");
        hs
    })
}

/// The sampler as each profile's kernels build it (one sampler: 256 invocations per row,
/// histogram thresholds).
fn samplers() -> [&'static Harness; 2] {
    [harness(), &gpu_harnesses()[0]]
}

/// The gpu profile picks its kernel by rows: 1, 2, 8 and 16-token decode variants, 3 and 4 groups
/// of 16 tokens, tiles beyond.
const GPU_ROWS: [usize; 7] = [1, 2, 6, 9, 40, 64, 70];

#[test]
fn uniform_x_plans_cover_every_row_once() {
    for (m, x_vec4) in [(1u32, 144u32), (28, 144), (29, 144), (331, 144), (331, 384), (9, 512), (40, 4096)] {
        match plan_x(m, x_vec4, true, 256, 256) {
            XPlan::Uniform { tile, windows } => {
                let tm = MATMUL_TILES[tile].0;
                let mut next = 0;
                for (i, &(x_off, win_off, rows)) in windows.iter().enumerate() {
                    assert!(rows * x_vec4 <= UNIFORM_X_VEC4 && rows > 0);
                    assert_eq!(x_off % 256, 0);
                    if windows.len() > 1 {
                        assert_eq!(x_off, next * x_vec4 * 16);
                        assert_eq!(win_off, (i as u32 + 1) * 256);
                        assert!(rows <= windows[0].2 && windows[0].2 % tm == 0);
                    }
                    next += rows;
                }
                assert_eq!(next, m, "m={m} x_vec4={x_vec4}");
            }
            XPlan::Storage { .. } => {
                assert!(m * x_vec4 > UNIFORM_X_VEC4 && UNIFORM_X_VEC4 / x_vec4 == 0 || x_vec4 > UNIFORM_X_VEC4)
            }
        }
    }
}

/// Shapes (m, n, k) for a format: rows of K-quants and IQ4_XS are whole 256-element super-blocks.
fn shapes(
    format: WFormat,
    legacy: &[(usize, usize, usize)],
    k_quant: &[(usize, usize, usize)],
) -> Vec<(usize, usize, usize)> {
    if format.scale_group() == 256 { k_quant } else { legacy }.to_vec()
}

fn row_bytes(format: WFormat, k: usize) -> u64 {
    ((k / 32 * format.words_per_block()).max(format.scale_words_per_row(k)) * 4) as u64
}

/// A max storage binding that holds `rows` rows of a matrix (and a grid format's grid, which
/// every chunk's scale buffer starts with).
fn rows_binding(format: WFormat, k: usize, rows: u64) -> u64 {
    rows * row_bytes(format, k) + format.grid_words() as u64 * 4
}

#[test]
fn matmul_every_format_and_variant() {
    let legacy = [(1, 37, 64), (3, 130, 96), (5, 67, 160), (33, 45, 64), (20, 9, 288), (9, 20, 2048), (70, 13, 576)];
    let k_quant = [(1, 37, 256), (3, 130, 512), (33, 45, 256), (9, 20, 2048), (70, 13, 768)];
    check_matmuls(harness(), &variants(), &legacy, &k_quant, false);
}

#[test]
fn gpu_profile_matmul_every_format() {
    // Odd row counts (ragged workgroups and tiles), K across several blocks and super-blocks.
    let ks = [(64, 256), (160, 512), (96, 256), (2048, 2048), (288, 768), (96, 256), (576, 768)];
    let ns = [37, 130, 67, 20, 9, 45, 13];
    let legacy: Vec<_> = GPU_ROWS.iter().zip(ns).zip(ks).map(|((&m, n), (k, _))| (m, n, k)).collect();
    let k_quant: Vec<_> = GPU_ROWS.iter().zip(ns).zip(ks).map(|((&m, n), (_, k))| (m, n, k)).collect();
    for h in gpu_harnesses() {
        check_matmuls(h, &[(None, false)], &legacy, &k_quant, false);
    }
}

/// The one-token matmuls on int8 activations (every format that has them), against the
/// reference within the activations' quantization error, against the reference on x rounded
/// on the host to float error, and against the same kernels on f32
/// activations (TORUS_INT8=0's), which must differ: the int8 kernel is what ran. Chunked
/// weights; SwiGLU. (tests/subgroup_widths.rs runs them at every subgroup width.)
#[test]
fn gpu_profile_int8_matmul_every_format() {
    let mut rng = Rng::new(8);
    let formats: Vec<WFormat> = WFormat::ALL.iter().copied().filter(|f| f.has_int8()).collect();
    let mut h = Harness::with_formats(gpu(), &formats, (64, 1), KernelProfile::Gpu).unwrap();
    // llvmpipe (a CPU adapter) runs f32 activations by default; the harness builds the int8
    // kernels where asked.
    if std::env::var_os("TORUS_INT8").is_none() {
        assert!(formats.iter().all(|&f| !h.uses_int8(f, 1)), "f32 activations by default on a CPU adapter");
    }
    for &f in &formats {
        h.add_int8(f).unwrap();
        assert!(h.uses_int8(f, 1) && !h.uses_int8(f, 2), "{f:?}: int8 serves one-token steps");
    }
    for &format in &formats {
        let k = if format.scale_group() == 256 { 768 } else { 320 };
        let (w, up) = (weights(format, 45, k, &mut rng, 1.0), weights(format, 45, k, &mut rng, 1.0));
        let x = randn(&mut rng, k, 1.0);
        let want = matmul_ref(&x, 1, &w);
        let (tol, tol32) = (dot_tol_q8(&x, 1, &w), dot_tol(&x, 1, &w));
        for max_binding in [1 << 27, rows_binding(format, k, 16)] {
            let what = format!("int8 {format:?} k={k} binding={max_binding}");
            h.set_int8(true);
            let got = h.matmul(&w, None, &x, 1, None, None, None, false, max_binding).unwrap();
            assert_close(&got, &want, |i| tol[i], &what);
            h.set_int8(false);
            let f32_path = h.matmul(&w, None, &x, 1, None, None, None, false, max_binding).unwrap();
            assert_close(&f32_path, &want, |i| tol32[i], &format!("{what} (f32 path)"));
            assert!(got.iter().zip(&f32_path).any(|(a, b)| a != b), "{what}: the int8 kernel ran");
        }
        // Offsets and mins go through the sums of the quantized x: every format's int8 output is
        // exactly the f32 product of its dequantized weights with x rounded as quantize_x8.wgsl
        // and llama.cpp round it, to float error. Groups of 32 (llama.cpp's Q8_0): d = max|x| /
        // 127 per block in f16, q = round(x * 127 / max|x|); Q4_1 and Q5_1 take their per-block
        // m times the block's d * sum(q) rounded to f16 (llama.cpp's Q8_1). Groups of 256 (its
        // Q8_K, for the K-quants and IQ4_XS): v the value of largest |x| (the first of equals),
        // q = min(127, round(x * -127 / v)), d = 1 / (-127 / v). Ties to even. (With outliers:
        // one block's values spread over 100x; 60 is the largest of its group of 256, -35
        // of its block.)
        let mut xo = x.clone();
        xo[5] = 60.0;
        xo[70] = -35.0;
        let group = format.int8_x().group() as usize;
        // Per 32-value block: its f32 d (before any f16 rounding) and its q.
        let blocks: Vec<(f32, Vec<f32>)> = xo
            .chunks(group)
            .flat_map(|g| {
                let top = g.iter().fold(0f32, |t, &v| if v.abs() > t.abs() { v } else { t });
                let am = top.abs();
                let (d, scale) = if group == 256 {
                    let iscale = if am > 0.0 { -127.0 / top } else { 0.0 };
                    (if am > 0.0 { 1.0 / iscale } else { 0.0 }, iscale)
                } else {
                    (am / 127.0, if am > 0.0 { 127.0 / am } else { 0.0 })
                };
                g.chunks(32).map(move |b| (d, b.iter().map(|v| (v * scale).round_ties_even().min(127.0)).collect()))
            })
            .collect();
        let applied = |d: f32| if group == 256 { d } else { half::f16::from_f32(d).to_f32() };
        let xq: Vec<f32> = blocks.iter().flat_map(|(d, q)| q.iter().map(|v| v * applied(*d))).collect();
        let mut want = matmul_ref(&xq, 1, &w);
        if format.int8_x() == XQuant::Q8_1 {
            // Q4_1 / Q5_1 scale records: [d, m] per block.
            for (r, y) in want.iter_mut().enumerate() {
                for (b, (d, q)) in blocks.iter().enumerate() {
                    let m = f32::from_bits(w.s[2 * (r * blocks.len() + b) + 1]);
                    let (sum_q, dh) = (q.iter().sum::<f32>(), half::f16::from_f32(*d).to_f32());
                    *y += m * (half::f16::from_f32(d * sum_q).to_f32() - dh * sum_q);
                }
            }
        }
        h.set_int8(true);
        let got = h.matmul(&w, None, &xo, 1, None, None, None, false, 1 << 27).unwrap();
        let tol = dot_tol(&xq, 1, &w);
        assert_close(&got, &want, |i| 4.0 * tol[i], &format!("int8 {format:?} against x rounded on the host"));
        if format.int8_x() == XQuant::Q8_1 {
            // All codes 0 (weights = m = 1): the output is the sum over blocks of the f16
            // d * sum(q), visibly off d_f16 * sum(q) for this x.
            let (n, k) = (4, 64);
            let cw = QTensor {
                format,
                rows: n,
                cols: k,
                q: vec![0; n * k / 32 * format.words_per_block()],
                s: (0..n * k / 32).flat_map(|_| [1f32.to_bits(), 1f32.to_bits()]).collect(),
            };
            let sums = |xc: &[f32]| {
                let (mut whole, mut plain) = (0f32, 0f32);
                for b in xc.chunks(32) {
                    let am = b.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let sum_q: f32 = b.iter().map(|v| (v * 127.0 / am).round_ties_even()).sum();
                    whole += half::f16::from_f32(am / 127.0 * sum_q).to_f32();
                    plain += half::f16::from_f32(am / 127.0).to_f32() * sum_q;
                }
                (whole, plain)
            };
            // Of 64 positive x, the one whose two sums differ most.
            let xc = (0..64)
                .map(|j| (0..k).map(|i| 0.3 + (i as f32 * 0.37 + j as f32 * 0.1).sin().abs()).collect::<Vec<f32>>())
                .max_by(|a, b| {
                    let (d_a, d_b) = (sums(a), sums(b));
                    (d_a.0 - d_a.1).abs().total_cmp(&(d_b.0 - d_b.1).abs())
                })
                .unwrap();
            let (whole, plain) = sums(&xc);
            let got = h.matmul(&cw, None, &xc, 1, None, None, None, false, 1 << 27).unwrap();
            let tol = dot_tol(&xc, 1, &cw)[0];
            assert!((whole - plain).abs() > 3.0 * tol, "{format:?}: the check cannot tell ({whole} vs {plain})");
            for (r, g) in got.iter().enumerate() {
                assert!((g - whole).abs() <= tol, "{format:?} row {r}: {g}, want the f16 block sums' {whole}");
            }
        }
        // The fused SwiGLU, small x (a moderate gate).
        let xs: Vec<f32> = x.iter().map(|v| v * 0.02).collect();
        let (g, u) = (matmul_ref(&xs, 1, &w), matmul_ref(&xs, 1, &up));
        let want: Vec<f32> = g.iter().zip(&u).map(|(a, b)| a / (1.0 + (-a).exp()) * b).collect();
        let (tg, tu) = (dot_tol_q8(&xs, 1, &w), dot_tol_q8(&xs, 1, &up));
        h.set_int8(true);
        let got = h.matmul(&w, Some(&up), &xs, 1, None, None, None, false, 1 << 27).unwrap();
        let tol = |i: usize| 2.0 * (tg[i] * u[i].abs() + tu[i] * g[i].abs()) + 1e-5 * (1.0 + want[i].abs());
        assert_close(&got, &want, tol, &format!("int8 swiglu {format:?}"));
    }
}

/// Every GEMM variant the tuner chooses from (64 x 64, 32 x 64 and 128 x 128 tiles, in f32 and,
/// where the device has shader-f16, f16), for steps of fewer rows than a tile (as a plan sends batched
/// decode to them) and of several tiles: ragged token tiles of 1, 8, 17, 33 and 70 rows, K of 2
/// to 72 blocks, every format (the tiles use no subgroup operations; tests/subgroup_widths.rs
/// runs them at every width).
#[test]
fn gpu_gemm_variants_every_format() {
    let ks = [(64, 256), (160, 512), (96, 768), (288, 2048), (2304, 256)];
    let ns = [37, 130, 67, 9, 70];
    let rows = [1, 8, 17, 33, 70];
    let legacy: Vec<_> = rows.iter().zip(ns).zip(ks).map(|((&m, n), (k, _))| (m, n, k)).collect();
    let k_quant: Vec<_> = rows.iter().zip(ns).zip(ks).map(|((&m, n), (_, k))| (m, n, k)).collect();
    let mut every = Harness::with_profile(gpu(), 64, 1, KernelProfile::Gpu).unwrap();
    // The format's part (the tile loads, matmul_tile_load.wgsl) is the same code in every
    // variant and the variant's part does not depend on the format: every format with the
    // default tiles, three formats (a legacy block, a K-quant with mins, an e8m0-scaled one)
    // with the others (each compiled anew: lavapipe compiles a tiled kernel slowly).
    let few = [WFormat::Q4_0, WFormat::Q4_K, WFormat::MXFP4];
    let mut some = Harness::with_formats(gpu(), &few, (64, 1), KernelProfile::Gpu).unwrap();
    let variants = GemmKernel::available(&every.gpu);
    assert_eq!(variants.len(), GemmKernel::TILES.len(), "lavapipe builds every tiled variant");
    for k in variants {
        let GemmKernel::Tile { f16, .. } = k else { continue };
        let h = if k == GemmKernel::TILE64 { &mut every } else { &mut some };
        h.set_gemm(GemmPlan::only(k, 1)).unwrap();
        check_matmuls(h, &[(None, false)], &legacy, &k_quant, f16);
        // The fused SwiGLU (32 outputs per tile).
        check_swiglu(h, &[(None, false)], &[(8, 41, 64), (70, 35, 96)], &[(17, 41, 256), (70, 9, 512)], f16);
    }
}

/// `f16`: the kernel rounds its operands to f16 (dot_tol_f16).
fn check_matmuls(
    h: &Harness,
    variants: &[(Option<usize>, bool)],
    legacy: &[(usize, usize, usize)],
    k_quant: &[(usize, usize, usize)],
    f16: bool,
) {
    let mut rng = Rng::new(1);
    for format in h.kernels.matmul.embed.keys().copied().collect::<Vec<_>>() {
        for (m, n, k) in shapes(format, legacy, k_quant) {
            let w = weights(format, n, k, &mut rng, 1.0);
            let x = randn(&mut rng, m * k, 1.0);
            let bias = randn(&mut rng, n, 1.0);
            let y0 = randn(&mut rng, m * n, 1.0);
            let base = matmul_ref(&x, m, &w);
            let tol = matmul_tol(h, &x, m, &w, f16);
            // Chunks of about 16 rows, so several chunks (and a ragged last one) are used.
            for &(variant, ux) in variants {
                for max_binding in [1 << 27, rows_binding(format, k, 16)] {
                    let what = format!(
                        "{format:?} tile {:?} uniform-x {ux} m={m} n={n} k={k} binding={max_binding}",
                        variant.map(|v| MATMUL_TILES[v])
                    );
                    let got = h.matmul(&w, None, &x, m, None, None, variant, ux, max_binding).unwrap();
                    assert_close(&got, &base, |i| tol[i], &what);
                    let got = h.matmul(&w, None, &x, m, Some(&bias), Some(&y0), variant, ux, max_binding).unwrap();
                    let want: Vec<f32> = (0..m * n).map(|i| base[i] + bias[i % n] + y0[i]).collect();
                    assert_close(
                        &got,
                        &want,
                        |i| tol[i] * 1.01 + 1e-5 * (1.0 + want[i].abs()),
                        &format!("{what} bias+accumulate"),
                    );
                }
            }
        }
    }
}

#[test]
fn swiglu_matmul_every_format() {
    let legacy = [(1, 41, 64), (7, 130, 96), (19, 33, 128)];
    let k_quant = [(1, 41, 256), (7, 130, 512), (19, 33, 256)];
    check_swiglu(harness(), &variants(), &legacy, &k_quant, false);
}

#[test]
fn gpu_profile_swiglu_every_format() {
    // Up to 64 rows: the decode kernel (40: three groups of 16); beyond: 64 x 64 tiles (70: a
    // second, ragged token tile).
    let legacy = [(1, 41, 64), (2, 3, 96), (5, 130, 96), (8, 33, 128), (13, 20, 64), (40, 67, 96), (70, 35, 64)];
    let k_quant = [(1, 41, 256), (3, 130, 512), (8, 33, 256), (16, 9, 256), (40, 67, 256), (70, 35, 256)];
    for h in gpu_harnesses() {
        check_swiglu(h, &[(None, false)], &legacy, &k_quant, false);
    }
}

fn check_swiglu(
    h: &Harness,
    variants: &[(Option<usize>, bool)],
    legacy: &[(usize, usize, usize)],
    k_quant: &[(usize, usize, usize)],
    f16: bool,
) {
    let mut rng = Rng::new(2);
    for format in h.kernels.matmul.embed.keys().copied().collect::<Vec<_>>() {
        for (m, n, k) in shapes(format, legacy, k_quant) {
            let gate = weights(format, n, k, &mut rng, 0.5);
            let up = weights(format, n, k, &mut rng, 0.5);
            // K-quant test weights are larger: keep the gate's inputs to silu moderate.
            let xs = if format.scale_group() == 256 { 0.02 } else { 1.0 };
            let x = randn(&mut rng, m * k, xs);
            let (g, u) = (matmul_ref(&x, m, &gate), matmul_ref(&x, m, &up));
            let want: Vec<f32> = g.iter().zip(&u).map(|(a, b)| a / (1.0 + (-a).exp()) * b).collect();
            let (tg, tu) = (matmul_tol(h, &x, m, &gate, f16), matmul_tol(h, &x, m, &up, f16));
            let tol = |i: usize| 2.0 * (tg[i] * u[i].abs() + tu[i] * g[i].abs()) + 1e-5 * (1.0 + want[i].abs());
            for &(variant, ux) in variants {
                for max_binding in [1 << 27, rows_binding(format, k, 2 * 10)] {
                    let got = h.matmul(&gate, Some(&up), &x, m, None, None, variant, ux, max_binding).unwrap();
                    let what = format!(
                        "swiglu {format:?} tile {:?} uniform-x {ux} m={m} n={n} k={k} binding={max_binding}",
                        variant.map(|v| MATMUL_TILES[v])
                    );
                    assert_close(&got, &want, tol, &what);
                }
            }
        }
    }
}

/// Gate and up in different formats (as K-quant files may store them): the gate matmul, then
/// the up matmul's SwiGLU epilogue.
#[test]
fn swiglu_unfused_mixed_formats() {
    check_swiglu_unfused(harness(), &variants());
    for h in gpu_harnesses() {
        check_swiglu_unfused(h, &[(None, false)]);
    }
}

fn check_swiglu_unfused(h: &Harness, variants: &[(Option<usize>, bool)]) {
    let mut rng = Rng::new(21);
    for (fg, fu) in [(WFormat::Q4_K, WFormat::Q6_K), (WFormat::Q5_0, WFormat::Q8_0), (WFormat::Q2_K, WFormat::F16)] {
        for (m, n, k) in [(1, 41, 256), (9, 70, 512), (4, 67, 256)] {
            let gate = weights(fg, n, k, &mut rng, 0.5);
            let up = weights(fu, n, k, &mut rng, 0.5);
            let x = randn(&mut rng, m * k, 0.02);
            let (g, u) = (matmul_ref(&x, m, &gate), matmul_ref(&x, m, &up));
            let want: Vec<f32> = g.iter().zip(&u).map(|(a, b)| a / (1.0 + (-a).exp()) * b).collect();
            let (tg, tu) = (matmul_tol(h, &x, m, &gate, false), matmul_tol(h, &x, m, &up, false));
            for &(variant, ux) in variants {
                let got = h.swiglu_unfused(&gate, &up, &x, m, variant, ux, 1 << 27).unwrap();
                let what = format!("unfused swiglu {fg:?}/{fu:?} tile {variant:?} uniform-x {ux} m={m}");
                assert_close(
                    &got,
                    &want,
                    |i| 2.0 * (tg[i] * u[i].abs() + tu[i] * g[i].abs()) + 1e-5 * (1.0 + want[i].abs()),
                    &what,
                );
            }
        }
    }
}

#[test]
fn embedding_lookup_every_format_across_chunks() {
    let h = harness();
    let mut rng = Rng::new(3);
    let vocab = 101;
    let tokens = [0u32, 100, 57, 13, 13, 64, 99, 1];
    for format in WFormat::ALL {
        let dim = if format.scale_group() == 256 { 512 } else { 96 };
        let table = weights(format, vocab, dim, &mut rng, 1.0);
        let want: Vec<f32> = tokens.iter().flat_map(|&t| table.dequant_row(t as usize)).collect();
        for max_binding in [1 << 27, rows_binding(format, dim, 7)] {
            let got = h.embed(&table, &tokens, max_binding).unwrap();
            // The lookup is the dequantization itself: the CPU reference's values within one f32
            // ulp (a driver may fuse q * d + m into one multiply-add, whose rounding differs by
            // an ulp of the larger of q * d and m, both below twice the block's largest value).
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let b = i / 32 * 32;
                let amax = want[b..b + 32].iter().fold(0f32, |m, v| m.max(v.abs()));
                let ulp = 2.0 * amax * f32::EPSILON;
                assert!((g - w).abs() <= ulp, "embed {format:?} element {i}: got {g}, want {w} (1 ulp: {ulp})");
            }
        }
    }
}

#[test]
fn rmsnorm_rows_and_gather() {
    let h = harness();
    let mut rng = Rng::new(4);
    for &(m, dim) in &[(1, 64), (5, 576), (3, 1000)] {
        let x = randn(&mut rng, m * dim, 3.0);
        let w = randn(&mut rng, dim, 1.5);
        let eps = 1e-5;
        let norm = |r: usize| -> Vec<f32> {
            let row = &x[r * dim..(r + 1) * dim];
            let ms = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / dim as f64;
            let s = 1.0 / (ms + eps as f64).sqrt();
            row.iter().zip(&w).map(|(v, g)| (*v as f64 * s) as f32 * g).collect()
        };
        let want: Vec<f32> = (0..m).flat_map(norm).collect();
        let got = h.rmsnorm(&x, dim, &w, eps, None).unwrap();
        assert_close(&got, &want, |i| 1e-5 * (1.0 + want[i].abs()), "rmsnorm");
        let rows: Vec<u32> = (0..m as u32).rev().collect();
        let want: Vec<f32> = rows.iter().flat_map(|&r| norm(r as usize)).collect();
        let got = h.rmsnorm(&x, dim, &w, eps, Some(&rows)).unwrap();
        assert_close(&got, &want, |i| 1e-5 * (1.0 + want[i].abs()), "rmsnorm gather");
    }
}

/// (position, rotated k, v) of one cached token.
type CachedKv = (usize, Vec<f32>, Vec<f32>);

fn rope_ref(v: &mut [f32], pos: usize, theta: f64) {
    let d = v.len();
    let half = d / 2;
    for i in 0..half {
        let inv = (1.0 / theta.powf((2 * i) as f64 / d as f64)) as f32;
        let (s, c) = (pos as f32 * inv).sin_cos();
        let (a, b) = (v[i], v[i + half]);
        v[i] = a * c - b * s;
        v[i + half] = b * c + a * s;
    }
}

/// Two sequences with scattered block tables: a prefix step fills the cache, then a step with a
/// prefill chunk of one sequence and a decode token of the other attends over cache + chunk.
#[test]
fn rope_and_paged_attention_with_gqa() {
    let theta = 10000.0;
    let shapes = [(4, 4, 16), (4, 2, 16), (8, 2, 64), (9, 3, 64), (6, 1, 32)];
    // (KV-cache dtype, sliding window (0: none), KV buffers per layer, shape, a sink logit per
    // head (gpt-oss)).
    let cases = [KvDtype::F32, KvDtype::F16]
        .into_iter()
        .flat_map(|kv| shapes.iter().map(move |s| (kv, 0, 1, s, false)))
        .chain([
            (KvDtype::F32, 6, 1, &shapes[2], false),
            (KvDtype::F16, 3, 1, &shapes[3], false),
            (KvDtype::F32, 1, 1, &shapes[1], false),
            // The cache of each layer split over several buffers (the block tables cross them).
            (KvDtype::F32, 0, 3, &shapes[2], false),
            (KvDtype::F16, 0, 4, &shapes[3], false),
            (KvDtype::F16, 5, 2, &shapes[1], false),
            // Sinks, globally and (as gpt-oss's alternate layers) within a window.
            (KvDtype::F32, 0, 1, &shapes[2], true),
            (KvDtype::F32, 4, 1, &shapes[3], true),
            (KvDtype::F16, 0, 2, &shapes[1], true),
        ]);
    // A case again with its grids folded into 2-D at 1 workgroup in x.
    let cases = cases.map(|c| (c, false)).chain([((KvDtype::F16, 5, 2, &shapes[3], false), true)]);
    // The cpu profile's attention, and the gpu profile's split attention with as many key
    // ranges as the forward step picks, 3 ranges, and 5 (more than some tokens have keys); its
    // tile softmax with subgroup reductions, and (false) without; the gpu profile's query-tiled
    // attention with and without subgroups (its tiles hold tokens of both sequences: 15 and 6
    // tokens of two sequences per step).
    let profiles = [
        (KernelProfile::Cpu, None, true, None),
        (KernelProfile::Gpu, None, true, Some(false)),
        (KernelProfile::Gpu, Some(3), true, Some(false)),
        (KernelProfile::Gpu, Some(5), true, Some(false)),
        (KernelProfile::Gpu, Some(3), false, Some(false)),
        (KernelProfile::Gpu, None, true, Some(true)),
        (KernelProfile::Gpu, None, false, Some(true)),
    ];
    for (
        ((kv, window, chunks, &(heads, kv_heads, head_dim), with_sinks), folded),
        (profile, splits, subgroups, tiled),
    ) in cases.flat_map(|c| profiles.map(|p| (c, p))).filter(|&(((.., sinks), _), (_, splits, subgroups, _))| {
        // Sinks change only how each kernel normalises its sums: the cpu kernel, the split
        // kernel with one range and with a combine, the tiled one.
        !sinks || (subgroups && splits != Some(5))
    }) {
        let gpu = if folded || !subgroups {
            let mut g = Gpu::new(None).unwrap();
            if folded {
                g.max_grid = 1;
            }
            g.subgroups = subgroups;
            Arc::new(g)
        } else {
            gpu()
        };
        let group = (heads / kv_heads) as u32;
        let h = Harness::attention_only(gpu, (head_dim as u32, group), kv, chunks, profile).unwrap();
        assert_eq!(h.kernels.kv_chunks, chunks);
        // The cache stores K and V in its element type: the reference rounds them the same way.
        let stored = |v: Vec<f32>| -> Vec<f32> {
            match kv {
                KvDtype::F32 => v,
                KvDtype::F16 => v.into_iter().map(|x| half::f16::from_f32(x).to_f32()).collect(),
            }
        };
        let bs = 4;
        let mut rig = h.attn_rig(AttnShape { heads, kv_heads, head_dim, block_size: bs }, 12, 64, theta);
        rig.window = window;
        rig.splits = splits;
        rig.tiled = tiled;
        // Sinks from well below to well above the scores (a sink above every score takes most of
        // the weight).
        let sinks: Option<Vec<f32>> = with_sinks.then(|| (0..heads).map(|h| h as f32 * 1.5 - 3.0).collect());
        rig.sinks = sinks.clone();
        if tiled == Some(true) {
            assert!(h.kernels.attention.tiled.is_some(), "no tiled attention for {heads}/{kv_heads} x {head_dim}");
        }
        let mut rng = Rng::new(5 + heads as u64);
        let tables = vec![vec![3u32, 0, 5, 7], vec![1u32, 6, 2]];
        let qkv_dim = (heads + 2 * kv_heads) * head_dim;
        // (sequence, position) of every token, in step order.
        let step1: Vec<(usize, usize)> = (0..10).map(|p| (0, p)).chain((0..5).map(|p| (1, p))).collect();
        let step2: Vec<(usize, usize)> = (10..15).map(|p| (0, p)).chain([(1, 5)]).collect();
        let mut all_k: Vec<Vec<CachedKv>> = vec![vec![], vec![]];
        for (si, step) in [step1, step2].iter().enumerate() {
            let qkv = randn(&mut rng, step.len() * qkv_dim, 1.0);
            let s = AttnStep {
                positions: step.iter().map(|&(_, p)| p as u32).collect(),
                slots: step.iter().map(|&(q, p)| tables[q][p / bs] * bs as u32 + (p % bs) as u32).collect(),
                seq_of_token: step.iter().map(|&(q, _)| q as u32).collect(),
                block_tables: tables.clone(),
            };
            let (rot, out) = h.rope_attention(&rig, &qkv, &s).unwrap();
            // CPU reference: rotate q and k, record k/v per sequence.
            let mut qs = Vec::new();
            for (t, &(seq, pos)) in step.iter().enumerate() {
                let row = &qkv[t * qkv_dim..(t + 1) * qkv_dim];
                let mut q = row[..heads * head_dim].to_vec();
                let mut k = row[heads * head_dim..(heads + kv_heads) * head_dim].to_vec();
                let v = row[(heads + kv_heads) * head_dim..].to_vec();
                for hh in 0..heads {
                    rope_ref(&mut q[hh * head_dim..(hh + 1) * head_dim], pos, theta);
                }
                for hh in 0..kv_heads {
                    rope_ref(&mut k[hh * head_dim..(hh + 1) * head_dim], pos, theta);
                }
                let got_q = &rot[t * qkv_dim..t * qkv_dim + heads * head_dim];
                assert_close(got_q, &q, |_| 1e-5, "rotated q");
                all_k[seq].push((pos, stored(k), stored(v)));
                qs.push(q);
            }
            if si == 0 {
                continue;
            }
            let scale = 1.0 / (head_dim as f64).sqrt();
            let mut want = Vec::new();
            for (t, &(seq, pos)) in step.iter().enumerate() {
                for hh in 0..heads {
                    let kvh = hh / (heads / kv_heads);
                    let q = &qs[t][hh * head_dim..(hh + 1) * head_dim];
                    // Causal, and within the sliding window when there is one.
                    let first = if window > 0 { (pos + 1).saturating_sub(window) } else { 0 };
                    let keys: Vec<&CachedKv> = all_k[seq].iter().filter(|e| e.0 <= pos && e.0 >= first).collect();
                    assert_eq!(keys.len(), pos + 1 - first);
                    let scores: Vec<f64> = keys
                        .iter()
                        .map(|(_, k, _)| {
                            let kk = &k[kvh * head_dim..(kvh + 1) * head_dim];
                            q.iter().zip(kk).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * scale
                        })
                        .collect();
                    let sink = sinks.as_ref().map(|s| s[hh] as f64);
                    let mx = scores.iter().cloned().chain(sink).fold(f64::MIN, f64::max);
                    let e: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
                    // A sink is one more logit in the denominator, with no value.
                    let z: f64 = e.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - mx).exp());
                    for d in 0..head_dim {
                        let o: f64 = keys.iter().zip(&e).map(|((_, _, v), w)| w * v[kvh * head_dim + d] as f64).sum();
                        want.push((o / z) as f32);
                    }
                }
            }
            // f16: a key element rounded on the other side of a half-way point shifts a score.
            let tol = if kv == KvDtype::F16 { 2e-4 } else { 2e-5 };
            let what = format!(
                "attention {profile:?} splits {splits:?} tiled {tiled:?} subgroups {subgroups} {kv:?} window {window} chunks {chunks} sinks {with_sinks} \
                 heads={heads} kv={kv_heads} d={head_dim}"
            );
            assert_close(&out, &want, |_| tol, &what);
        }
    }
}

/// An f16 KV cache clamps values beyond f16's range to the largest finite half instead of
/// storing infinities: a token attending only to itself gets its (clamped) value row back, in
/// both profiles.
#[test]
fn f16_kv_cache_clamps_out_of_range_values() {
    let (heads, kv_heads, head_dim) = (2, 1, 16);
    for profile in [KernelProfile::Cpu, KernelProfile::Gpu] {
        let h = Harness::attention_only(gpu(), (head_dim as u32, 2), KvDtype::F16, 1, profile).unwrap();
        let rig = h.attn_rig(AttnShape { heads, kv_heads, head_dim, block_size: 4 }, 4, 8, 10000.0);
        let qkv_dim = (heads + 2 * kv_heads) * head_dim;
        let mut qkv = vec![0.5f32; qkv_dim];
        // v: one element far above f16's range, one far below, one in range.
        let v0 = (heads + kv_heads) * head_dim;
        qkv[v0] = 1.0e6;
        qkv[v0 + 1] = -3.0e5;
        qkv[v0 + 2] = 1234.0;
        // k: huge too (scores stay finite only if it is clamped).
        qkv[heads * head_dim] = 1.0e9;
        let s = AttnStep { positions: vec![0], slots: vec![0], seq_of_token: vec![0], block_tables: vec![vec![0]] };
        let (_, out) = h.rope_attention(&rig, &qkv, &s).unwrap();
        assert!(out.iter().all(|x| x.is_finite()), "{profile:?}: non-finite attention output {out:?}");
        for hh in 0..heads {
            let o = &out[hh * head_dim..(hh + 1) * head_dim];
            assert_eq!(o[0], 65504.0, "{profile:?} head {hh}");
            assert_eq!(o[1], -65504.0, "{profile:?} head {hh}");
            assert_eq!(o[2], 1234.0, "{profile:?} head {hh}");
        }
    }
}

/// Qwen3's per-head q/k RMSNorm: q heads and k heads normalised with their own weights, v
/// untouched.
#[test]
fn head_norm_of_q_and_k_heads() {
    let h = harness();
    let mut rng = Rng::new(7);
    for &(n, heads, kv_heads, head_dim) in &[(1, 4, 2, 16), (5, 14, 2, 64), (3, 8, 8, 128)] {
        let qkv_dim = (heads + 2 * kv_heads) * head_dim;
        let qkv = randn(&mut rng, n * qkv_dim, 3.0);
        let w = randn(&mut rng, 2 * head_dim, 1.5);
        let eps = 1e-6;
        let got = h.head_norm(&qkv, heads, kv_heads, head_dim, &w, eps).unwrap();
        let mut want = qkv.clone();
        for t in 0..n {
            for hh in 0..heads + kv_heads {
                let b = t * qkv_dim + hh * head_dim;
                let x = &qkv[b..b + head_dim];
                let ms = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / head_dim as f64;
                let r = 1.0 / (ms + eps as f64).sqrt();
                let wo = if hh < heads { 0 } else { head_dim };
                for d in 0..head_dim {
                    want[b + d] = w[wo + d] * (x[d] as f64 * r) as f32;
                }
            }
        }
        assert_close(
            &got,
            &want,
            |i| 1e-5 * (1.0 + want[i].abs()),
            &format!("head norm n={n} heads={heads}/{kv_heads} d={head_dim}"),
        );
    }
}

fn log_softmax(row: &[f32]) -> Vec<f64> {
    let mx = row.iter().cloned().fold(f32::MIN, f32::max) as f64;
    let lse = mx + row.iter().map(|v| (*v as f64 - mx).exp()).sum::<f64>().ln();
    row.iter().map(|v| *v as f64 - lse).collect()
}

#[test]
fn greedy_sampling_picks_lowest_argmax_with_logprob() {
    for h in samplers() {
        greedy_sampling_picks_lowest_argmax_with_logprob_with(h);
    }
}

fn greedy_sampling_picks_lowest_argmax_with_logprob_with(h: &Harness) {
    let mut rng = Rng::new(6);
    for vocab in [7usize, 512, 49152, 1000] {
        let mut logits = randn(&mut rng, 2 * vocab, 8.0);
        // Row 1 has a tie for the maximum; the lower id must win.
        let (a, b) = (vocab / 3, 2 * vocab / 3);
        logits[vocab + a] = 20.0;
        logits[vocab + b] = 20.0;
        let got = h.sample(&logits, vocab, &[SampleParams::default(), SampleParams::default()]).unwrap().0;
        for (r, s) in got.iter().enumerate() {
            let (id, lp) = (s.id, s.logprob);
            let row = &logits[r * vocab..(r + 1) * vocab];
            let best = (0..vocab).fold(0, |bi, i| if row[i] > row[bi] { i } else { bi });
            assert_eq!(id as usize, best, "vocab {vocab} row {r}");
            let want = log_softmax(row)[best];
            assert!((lp as f64 - want).abs() < 1e-4, "logprob {lp} vs {want}");
        }
        assert_eq!(got[1].id as usize, a);
    }
}

/// Inverse-CDF sampling: sweeping u over a fine grid must reproduce the filtered distribution.
#[test]
fn temperature_top_k_min_p_top_p_follow_the_distribution() {
    for h in samplers() {
        temperature_top_k_min_p_top_p_follow_the_distribution_with(h, 300, 2000);
    }
    // A row of a real vocabulary's size, where the histogram thresholds refine over several
    // sweeps.
    temperature_top_k_min_p_top_p_follow_the_distribution_with(harness(), 49_157, 320);
}

/// Rows of the largest vocabularies (Qwen's 151936, Qwen3.5's 248320, Gemma's 262144) with
/// top-k, top-p, min-p and 20 top log-probabilities at once: every draw within the top-k, the
/// top log-probabilities exactly the row's largest. llvmpipe stops an invocation's loops after
/// 65535 iterations in all: the cpu profile's earlier sampler (64 invocations a row, 32
/// bisection sweeps per threshold) drew only the argmax there, and its top log-probabilities
/// went wrong past a few at 49152 tokens.
#[test]
fn sampling_reaches_every_logit_of_the_largest_vocabularies() {
    for vocab in [151_936usize, 248_320, 262_144] {
        let mut rng = Rng::new(vocab as u64);
        let logits = randn(&mut rng, vocab, 3.0);
        let lsm = log_softmax(&logits);
        let mut order: Vec<usize> = (0..vocab).collect();
        order.sort_by(|&a, &b| logits[b].partial_cmp(&logits[a]).unwrap().then(a.cmp(&b)));
        let grid = 24;
        let params: Vec<SampleParams> = (0..grid)
            .map(|i| SampleParams {
                temperature: 1.0,
                top_k: 40,
                top_p: 0.95,
                min_p: 0.001,
                n_top: 20,
                u: (i as f32 + 0.5) / grid as f32,
                ..Default::default()
            })
            .collect();
        let rows: Vec<f32> = (0..grid).flat_map(|_| logits.iter().copied()).collect();
        for h in samplers() {
            let got = h.sample(&rows, vocab, &params).unwrap().0;
            let ranks: Vec<usize> =
                got.iter().map(|s| order.iter().position(|&o| o == s.id as usize).unwrap()).collect();
            assert!(ranks.iter().all(|&r| r < 40), "vocab {vocab}: drawn outside the top 40: ranks {ranks:?}");
            assert!(ranks.iter().any(|&r| r >= 2), "vocab {vocab}: the draws span the candidates: ranks {ranks:?}");
            for s in &got {
                assert_eq!(s.top.len(), 20);
                for (j, &(id, lp)) in s.top.iter().enumerate() {
                    assert_eq!(id as usize, order[j], "vocab {vocab}: top {j}");
                    assert!((lp as f64 - lsm[order[j]]).abs() < 1e-4, "vocab {vocab}: top {j}'s log-probability");
                }
            }
        }
    }
}

fn temperature_top_k_min_p_top_p_follow_the_distribution_with(h: &Harness, vocab: usize, grid: usize) {
    let mut rng = Rng::new(7);
    let logits = randn(&mut rng, vocab, 4.0);
    let mut order: Vec<usize> = (0..vocab).collect();
    order.sort_by(|&a, &b| logits[b].partial_cmp(&logits[a]).unwrap());
    for &(temp, top_k, top_p, min_p) in &[
        (1.0f32, 0u32, 1.0f32, 0.0f32),
        (0.7, 10, 1.0, 0.0),
        (1.3, 0, 0.8, 0.0),
        (1.0, 20, 0.5, 0.0),
        (1.0, 0, 1.0, 0.05),
        (0.6, 0, 1.0, 0.2),
        (1.5, 0, 0.9, 0.1),
        (0.3, 5, 1.0, 0.8),
        (2.0, 30, 0.7, 0.8),
    ] {
        // Expected distribution (vLLM's order): softmax(l / T) over the top_k, without tokens
        // whose probability is below min_p times the largest, then the smallest top set whose
        // mass reaches top_p, renormalised.
        let mut keep: Vec<usize> = order.clone();
        if top_k > 0 {
            keep.truncate(top_k as usize);
        }
        let w_of = |i: usize| ((logits[i] - logits[order[0]]) as f64 / temp as f64).exp();
        if min_p > 0.0 {
            let before = keep.len();
            keep.retain(|&i| w_of(i) >= min_p as f64);
            // (The cases are chosen on the small row; a large one's top 5 may all pass.)
            assert!(keep.len() < before || vocab > 300, "min_p {min_p} at T={temp} cuts nothing: a useless case");
        }
        let w: Vec<f64> = keep.iter().map(|&i| w_of(i)).collect();
        let z: f64 = w.iter().sum();
        let mut n_keep = keep.len();
        if top_p < 1.0 {
            let mut c = 0.0;
            for (j, x) in w.iter().enumerate() {
                c += x / z;
                if c >= top_p as f64 {
                    n_keep = j + 1;
                    break;
                }
            }
        }
        let zk: f64 = w[..n_keep].iter().sum();
        let params: Vec<SampleParams> = (0..grid)
            .map(|i| SampleParams {
                temperature: temp,
                top_p,
                top_k,
                min_p,
                u: (i as f32 + 0.5) / grid as f32,
                ..Default::default()
            })
            .collect();
        let rows: Vec<f32> = (0..grid).flat_map(|_| logits.iter().cloned()).collect();
        let got = h.sample(&rows, vocab, &params).unwrap().0;
        let mut counts = vec![0usize; vocab];
        for s in &got {
            let (id, lp) = (s.id, s.logprob);
            counts[id as usize] += 1;
            assert!((lp as f64 - log_softmax(&logits)[id as usize]).abs() < 1e-4);
        }
        let what = format!("vocab {vocab} T={temp} k={top_k} p={top_p} min_p={min_p}");
        for (j, &i) in keep.iter().enumerate() {
            let p = if j < n_keep { w[j] / zk } else { 0.0 };
            let f = counts[i] as f64 / grid as f64;
            assert!((f - p).abs() <= 1.5 / grid as f64 + 1e-3, "{what}: id {i} freq {f} want {p}");
        }
        let candidates = &keep[..n_keep];
        let outside: usize = (0..vocab).filter(|i| !candidates.contains(i)).map(|i| counts[i]).sum();
        assert_eq!(outside, 0, "{what}: sampled outside the candidate set");
    }
}

/// Properties of min_p on random rows (random vocabularies, temperatures, cuts and draws): the
/// sampled token's probability is at least min_p times the largest; min_p near 1 at
/// temperature 1 is greedy whenever the runner-up is less likely than min_p times the best;
/// min_p = 1 is greedy outright.
#[test]
fn min_p_keeps_only_tokens_near_the_most_likely() {
    for h in samplers() {
        min_p_keeps_only_tokens_near_the_most_likely_with(h);
    }
}

fn min_p_keeps_only_tokens_near_the_most_likely_with(h: &Harness) {
    let mut rng = Rng::new(11);
    for vocab in [7usize, 1000, 49152] {
        let rows = 96;
        let mut logits = randn(&mut rng, rows * vocab, 6.0);
        let mut params = Vec::with_capacity(rows);
        for r in 0..rows {
            let row = &mut logits[r * vocab..(r + 1) * vocab];
            let u = rng.uniform();
            let p = match r % 3 {
                // Anything goes.
                0 => SampleParams {
                    temperature: 0.2 + 1.8 * rng.uniform(),
                    top_k: [0, 1, 5, 50][(r / 3) % 4],
                    top_p: [1.0, 0.9, 0.5][(r / 3) % 3],
                    min_p: rng.uniform(),
                    u,
                    ..Default::default()
                },
                // min_p near 1, temperature 1.
                1 => SampleParams { temperature: 1.0, min_p: 0.999, u, ..Default::default() },
                // min_p = 1 at a high temperature.
                _ => SampleParams { temperature: 2.0, min_p: 1.0, u, ..Default::default() },
            };
            if r % 3 == 1 {
                // Keep the runner-up below min_p times the best (exp(-0.01) < 0.999).
                let best = (0..vocab).fold(0, |bi, i| if row[i] > row[bi] { i } else { bi });
                row[best] += 0.01;
            }
            params.push(p);
        }
        let got = h.sample(&logits, vocab, &params).unwrap().0;
        for (r, (s, p)) in got.iter().zip(&params).enumerate() {
            let row = &logits[r * vocab..(r + 1) * vocab];
            let best = (0..vocab).fold(0, |bi, i| if row[i] > row[bi] { i } else { bi });
            let ratio = ((row[s.id as usize] - row[best]) as f64 / p.temperature as f64).exp();
            assert!(ratio >= p.min_p as f64 * (1.0 - 1e-5), "vocab {vocab} row {r} {p:?}: ratio {ratio}");
            if r % 3 != 0 {
                assert_eq!(s.id as usize, best, "vocab {vocab} row {r} {p:?}: not greedy");
            }
        }
    }
}

#[test]
fn penalties_bias_and_top_logprobs() {
    for h in samplers() {
        penalties_bias_and_top_logprobs_with(h);
    }
}

fn penalties_bias_and_top_logprobs_with(h: &Harness) {
    let vocab = 1000;
    let mut rng = Rng::new(8);
    let logits = randn(&mut rng, vocab, 5.0);
    let adjust = vec![
        Adjust { id: 3, count: 2, in_prompt: false, bias: 0.0 },
        Adjust { id: 10, count: 0, in_prompt: true, bias: 0.0 },
        Adjust { id: 999, count: 1, in_prompt: true, bias: -1.5 },
        Adjust { id: 500, count: 0, in_prompt: false, bias: 100.0 },
    ];
    let p = SampleParams {
        repetition_penalty: 1.3,
        frequency_penalty: 0.25,
        presence_penalty: 0.5,
        n_top: 20,
        adjust: adjust.clone(),
        ..Default::default()
    };
    let two_rows = [logits.clone(), logits.clone()].concat();
    let (got, adjusted) = h
        .sample(&two_rows, vocab, &[p, SampleParams { n_top: 5, ..Default::default() }])
        .unwrap_or_else(|e| panic!("{e}"));
    // CPU reference of the adjustment.
    let mut want = logits.clone();
    for a in &adjust {
        let l = &mut want[a.id as usize];
        if a.count > 0 || a.in_prompt {
            *l = if *l > 0.0 { *l / 1.3 } else { *l * 1.3 };
        }
        *l -= 0.25 * a.count as f32 + if a.count > 0 { 0.5 } else { 0.0 };
        *l += a.bias;
    }
    assert_close(&adjusted[..vocab], &want, |_| 1e-5, "adjusted logits");
    // The bias of 100 makes token 500 the greedy pick.
    assert_eq!(got[0].id, 500);
    for (row, logits_row, n) in [(&got[0], &want, 20), (&got[1], &adjusted[vocab..].to_vec(), 5)] {
        let lsm = log_softmax(logits_row);
        let mut order: Vec<usize> = (0..vocab).collect();
        order.sort_by(|&a, &b| logits_row[b].partial_cmp(&logits_row[a]).unwrap().then(a.cmp(&b)));
        assert_eq!(row.top.len(), n);
        for (j, &(id, lp)) in row.top.iter().enumerate() {
            assert_eq!(id as usize, order[j], "top {j}");
            assert!((lp as f64 - lsm[order[j]]).abs() < 1e-4);
        }
    }
    // The second row had no adjustments: its logits are untouched.
    assert_close(&adjusted[vocab..], &logits, |_| 0.0, "unadjusted row");
}

/// Prompt log-probabilities: a row with a forced token reports that token (not the argmax nor a
/// draw) with its log-softmax value, and the top log-probabilities as usual; other rows of the
/// same step still sample.
#[test]
fn forced_rows_report_the_given_token() {
    for h in samplers() {
        forced_rows_report_the_given_token_with(h);
    }
}

fn forced_rows_report_the_given_token_with(h: &Harness) {
    let vocab = 777;
    let mut rng = Rng::new(21);
    let rows: Vec<Vec<f32>> = (0..3).map(|_| randn(&mut rng, vocab, 4.0)).collect();
    let lsm: Vec<Vec<f64>> = rows.iter().map(|r| log_softmax(r)).collect();
    let worst = |r: &[f32]| (0..vocab).min_by(|&a, &b| r[a].partial_cmp(&r[b]).unwrap()).unwrap() as u32;
    let params = [
        SampleParams { force: Some(worst(&rows[0])), n_top: 3, ..Default::default() },
        SampleParams { force: Some(5), temperature: 1.0, u: 0.5, ..Default::default() },
        SampleParams::default(),
    ];
    let (got, _) = h.sample(&rows.concat(), vocab, &params).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(got[0].id, worst(&rows[0]));
    assert!(
        (got[0].logprob as f64 - lsm[0][got[0].id as usize]).abs() < 1e-4,
        "{} vs {}",
        got[0].logprob,
        lsm[0][got[0].id as usize]
    );
    let best = |r: &[f32]| (0..vocab).max_by(|&a, &b| r[a].partial_cmp(&r[b]).unwrap().then(b.cmp(&a))).unwrap() as u32;
    assert_eq!(got[0].top.len(), 3);
    assert_eq!(got[0].top[0].0, best(&rows[0]));
    assert_eq!(got[1].id, 5);
    assert!((got[1].logprob as f64 - lsm[1][5]).abs() < 1e-4);
    assert_eq!(got[2].id, best(&rows[2]), "an unforced greedy row");
}

fn mask_allows(mask: &[u32], id: usize) -> bool {
    mask[id / 32] >> (id % 32) & 1 == 1
}

/// Structured outputs: a row's token mask. Whatever the sampling mode (greedy, temperature with
/// top-k / top-p / min-p, a bias of +100 on a forbidden token, one allowed token, the argmax
/// forbidden), the sampler picks an allowed token; greedy picks the best allowed one (the CPU
/// reference); forbidden logits become MASKED_LOGIT and allowed ones stay; rows without a mask
/// sample exactly as they do with no masked row beside them.
#[test]
fn token_mask_is_never_crossed() {
    for h in samplers() {
        token_mask_is_never_crossed_with(h);
    }
}

fn token_mask_is_never_crossed_with(h: &Harness) {
    use torus_wgpu::sampling::row::MASKED_LOGIT;

    let mut rng = Rng::new(13);
    for vocab in [7usize, 1000, 49152 + 13] {
        let words = vocab.div_ceil(32);
        let rows = 48;
        let logits = randn(&mut rng, rows * vocab, 6.0);
        let mut params = Vec::with_capacity(rows);
        for r in 0..rows {
            let row = &logits[r * vocab..(r + 1) * vocab];
            let best = (0..vocab).fold(0, |bi, i| if row[i] > row[bi] { i } else { bi });
            let mut p = match r % 4 {
                0 => SampleParams::default(),
                1 => SampleParams { temperature: 0.3 + 1.5 * rng.uniform(), u: rng.uniform(), ..Default::default() },
                2 => SampleParams {
                    temperature: 1.0,
                    top_k: [1, 5, 50][(r / 4) % 3],
                    top_p: [1.0, 0.9, 0.5][(r / 4) % 3],
                    min_p: [0.0, 0.1][(r / 4) % 2],
                    u: rng.uniform(),
                    n_top: 3,
                    ..Default::default()
                },
                // No mask: a free row among constrained ones.
                _ => SampleParams { temperature: 0.8, u: rng.uniform(), ..Default::default() },
            };
            if r % 4 != 3 {
                let mut mask = vec![0u32; words];
                let density = [0.0, 0.01, 0.3, 0.9][(r / 4) % 4];
                for i in 0..vocab {
                    if rng.uniform() < density {
                        mask[i / 32] |= 1 << (i % 32);
                    }
                }
                // Never the argmax; always at least one token.
                mask[best / 32] &= !(1 << (best % 32));
                let one = (best + 1 + r) % vocab;
                if one != best {
                    mask[one / 32] |= 1 << (one % 32);
                } else if vocab > 1 {
                    let other = (best + 1) % vocab;
                    mask[other / 32] |= 1 << (other % 32);
                }
                // Bits past the vocabulary are ignored.
                if !vocab.is_multiple_of(32) {
                    mask[words - 1] |= !0u32 << (vocab % 32);
                }
                // A huge bias on a forbidden token does not lift it.
                let forbidden = (0..vocab).find(|&i| !mask_allows(&mask, i)).unwrap();
                p.adjust = vec![Adjust { id: forbidden as u32, count: 0, in_prompt: false, bias: 100.0 }];
                p.mask = Some(mask);
            }
            params.push(p);
        }
        let (got, adjusted) = h.sample(&logits, vocab, &params).unwrap_or_else(|e| panic!("{e}"));
        for (r, (s, p)) in got.iter().zip(&params).enumerate() {
            let row = &logits[r * vocab..(r + 1) * vocab];
            let adj = &adjusted[r * vocab..(r + 1) * vocab];
            let Some(mask) = &p.mask else { continue };
            let id = s.id as usize;
            assert!(id < vocab && mask_allows(mask, id), "vocab {vocab} row {r}: picked forbidden token {id}");
            for i in 0..vocab {
                let want = if !mask_allows(mask, i) {
                    MASKED_LOGIT
                } else if p.adjust.iter().any(|a| a.id as usize == i) {
                    row[i] + 100.0
                } else {
                    row[i]
                };
                assert_eq!(adj[i], want, "vocab {vocab} row {r}: logit {i}");
            }
            if p.temperature == 0.0 {
                let best = (0..vocab).filter(|&i| mask_allows(mask, i)).fold(None, |b: Option<usize>, i| match b {
                    Some(b) if row[b] >= row[i] => Some(b),
                    _ => Some(i),
                });
                assert_eq!(Some(id), best, "vocab {vocab} row {r}: greedy must pick the best allowed token");
            }
        }
        // The free rows, sampled with no masked neighbour, pick the same tokens.
        let free: Vec<usize> = (0..rows).filter(|r| params[*r].mask.is_none()).collect();
        let alone_logits: Vec<f32> = free.iter().flat_map(|&r| logits[r * vocab..(r + 1) * vocab].to_vec()).collect();
        let alone_params: Vec<SampleParams> = free.iter().map(|&r| params[r].clone()).collect();
        let alone = h.sample(&alone_logits, vocab, &alone_params).unwrap().0;
        for (k, &r) in free.iter().enumerate() {
            assert_eq!(got[r], alone[k], "vocab {vocab} free row {r} changed by its masked neighbours");
        }
    }
}

/// The cpu profile's attention at head_dim 256 (Gemma's) over 600 keys: llvmpipe ends every loop
/// of an invocation after 65535 iterations in all, so a kernel looping over the head inside its
/// key loop silently dropped the keys past ~500 (Gemma 3 270M went wrong from position 498).
/// Every token's output against the f64 reference.
#[test]
fn cpu_attention_reaches_every_key_at_head_dim_256() {
    let (heads, kv_heads, head_dim, n, theta) = (4usize, 1usize, 256usize, 600usize, 10000.0);
    let h = Harness::attention_only(gpu(), (head_dim as u32, 4), KvDtype::F32, 1, KernelProfile::Cpu).unwrap();
    let bs = 16;
    let rig = h.attn_rig(AttnShape { heads, kv_heads, head_dim, block_size: bs }, n.div_ceil(bs), n, theta);
    let mut rng = Rng::new(11);
    let qkv_dim = (heads + 2 * kv_heads) * head_dim;
    let qkv = randn(&mut rng, n * qkv_dim, 1.0);
    let s = AttnStep {
        positions: (0..n as u32).collect(),
        slots: (0..n as u32).collect(),
        seq_of_token: vec![0; n],
        block_tables: vec![(0..n.div_ceil(bs) as u32).collect()],
    };
    let (_, out) = h.rope_attention(&rig, &qkv, &s).unwrap();
    let row = |t: usize, part: usize| &qkv[t * qkv_dim + part * head_dim..t * qkv_dim + (part + 1) * head_dim];
    let keys: Vec<Vec<f32>> = (0..n)
        .map(|t| {
            let mut k = row(t, heads).to_vec();
            rope_ref(&mut k, t, theta);
            k
        })
        .collect();
    let scale = 1.0 / (head_dim as f64).sqrt();
    let mut want = Vec::with_capacity(out.len());
    for t in 0..n {
        for hh in 0..heads {
            let mut q = row(t, hh).to_vec();
            rope_ref(&mut q, t, theta);
            let sc: Vec<f64> = keys[..=t]
                .iter()
                .map(|k| q.iter().zip(k).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * scale)
                .collect();
            let mx = sc.iter().cloned().fold(f64::MIN, f64::max);
            let e: Vec<f64> = sc.iter().map(|x| (x - mx).exp()).collect();
            let z: f64 = e.iter().sum();
            for d in 0..head_dim {
                want.push(((0..=t).map(|j| e[j] * row(j, heads + 1)[d] as f64).sum::<f64>() / z) as f32);
            }
        }
    }
    assert_close(&out, &want, |_| 1e-4, "attention over 600 keys at head_dim 256");
}
