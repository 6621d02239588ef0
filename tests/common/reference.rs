//! CPU-side helpers of the kernel tests: random data, tolerances and weight matrices.

use torus_wgpu::gpu::wformat::WFormat;
use torus_wgpu::sampling::Rng;
use torus_wgpu::weights::tensor::QTensor;

pub fn randn(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| (rng.uniform() * 2.0 - 1.0) * scale).collect()
}

pub fn assert_close(got: &[f32], want: &[f32], tol: impl Fn(usize) -> f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol(i), "{what}: element {i}: got {g}, want {w} (tol {})", tol(i));
    }
}

/// Tolerance for a dot product: f32 rounding grows with the sum of |terms|.
pub fn dot_tol(x: &[f32], m: usize, w: &QTensor) -> Vec<f32> {
    let k = w.cols as f32;
    dot_abs(x, m, w).into_iter().map(|s| 2e-6 * s * k.sqrt() + 1e-6).collect()
}

/// The same for a kernel that rounds x and the weights to f16 before multiplying (in f32):
/// each term off by at most 2^-10 of its size, on top of dot_tol.
pub fn dot_tol_f16(x: &[f32], m: usize, w: &QTensor) -> Vec<f32> {
    let k = w.cols as f32;
    dot_abs(x, m, w).into_iter().map(|s| (2e-6 * k.sqrt() + 1.0 / 1024.0) * s + 1e-6).collect()
}

/// The same for the int8 matmuls (quantize_x8.wgsl), which see x rounded to d * q per group of
/// values (the format's `int8_x`: 32 or 256; d = max|x| / 127, each value off by at most d / 2,
/// d in f16 for groups of 32): on top of dot_tol, the sum of |w[n, i]| * d / 2 over the row,
/// twice (room for the f16 scale and the sums' rounding).
pub fn dot_tol_q8(x: &[f32], m: usize, w: &QTensor) -> Vec<f32> {
    let (k, group) = (w.cols, w.format.int8_x().group() as usize);
    let half_d: Vec<f32> = x.chunks(group).map(|b| b.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0 / 2.0).collect();
    let mut out = dot_tol(x, m, w);
    for n in 0..w.rows {
        let row = w.dequant_row(n);
        for t in 0..m {
            let e: f32 = row.iter().enumerate().map(|(i, v)| v.abs() * half_d[(t * k + i) / group]).sum();
            out[t * w.rows + n] += 2.0 * e;
        }
    }
    out
}

/// The tolerance of a matmul of `w` over `m` rows of x on harness `h`: int8 (dot_tol_q8) where it
/// runs its int8 kernel, f16 operands (dot_tol_f16) with `f16`, else dot_tol.
pub fn matmul_tol(h: &torus_wgpu::ops::harness::Harness, x: &[f32], m: usize, w: &QTensor, f16: bool) -> Vec<f32> {
    if h.uses_int8(w.format, m) {
        dot_tol_q8(x, m, w)
    } else if f16 {
        dot_tol_f16(x, m, w)
    } else {
        dot_tol(x, m, w)
    }
}

/// Sum of |x[t, i] w[n, i]| for every output (t, n).
fn dot_abs(x: &[f32], m: usize, w: &QTensor) -> Vec<f32> {
    let k = w.cols;
    let mut out = vec![0f32; m * w.rows];
    for n in 0..w.rows {
        let row = w.dequant_row(n);
        for t in 0..m {
            out[t * w.rows + n] = x[t * k..(t + 1) * k].iter().zip(&row).map(|(a, b)| (a * b).abs()).sum();
        }
    }
    out
}

/// A random [n, k] weight matrix of `format`: quantized from random values where this crate has
/// a quantizer, else random GGUF blocks (random codes, random finite scales).
pub fn weights(format: WFormat, n: usize, k: usize, rng: &mut Rng, scale: f32) -> QTensor {
    match format {
        WFormat::F32 | WFormat::F16 | WFormat::Q8_0 | WFormat::Q4_0 | WFormat::Q4_1 => {
            QTensor::quantize(format, n, k, &randn(rng, n * k, scale)).unwrap()
        }
        _ => QTensor::random_gguf(format, n, k, rng.next_u64()).unwrap(),
    }
}
