//! GGUF's grid quant types (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M): a block
//! stores indices into a fixed lookup grid of 4 or 8 values (iq_grids.rs), signs and small
//! scales. Their bytes are re-packed at load into the GPU layout without changing any value
//! (quant words per 32-element block, one scale record per 256-element super-block), and the
//! grid itself goes in front of every chunk's scale buffer (`gpu_grid_words`), where the
//! kernels look entries up (shaders/wfmt/wfmt_iq*.wgsl).
//!
//! Each element's value is `db * v`: `db` the scale of its 16-element half, `v` a small signed
//! integer: +-grid value (IQ2, IQ3), or 8 * grid value +- 1 for IQ1 (whose +-1/8 delta is then
//! folded into db / 8, exact in f32, so the product is the same single rounding as ggml's
//! `dl * (grid + delta)`).

use super::blocks::{bytes_word, f16_at, gguf_scale_fields, u32_at as word};
use super::iq_grids::*;
use super::tensor::XorShift64;
use crate::gpu::wformat::WFormat;
use half::f16;

/// The grid of a format: (entries as packed u16 map indices, value map, elements per entry).
fn grid(format: WFormat) -> (&'static [u16], &'static [i8], usize) {
    match format {
        WFormat::IQ2_XXS => (&IQ2XXS_GRID, &IQ2XXS_MAP, 8),
        WFormat::IQ2_XS => (&IQ2XS_GRID, &IQ2XS_MAP, 8),
        WFormat::IQ2_S => (&IQ2S_GRID, &IQ2S_MAP, 8),
        WFormat::IQ3_XXS => (&IQ3XXS_GRID, &IQ3XXS_MAP, 4),
        WFormat::IQ3_S => (&IQ3S_GRID, &IQ3S_MAP, 4),
        WFormat::IQ1_S | WFormat::IQ1_M => (&IQ1S_GRID, &IQ1S_MAP, 8),
        f => unreachable!("{f:?} has no grid"),
    }
}

/// Element `i`'s map index in grid entry `e`.
fn grid_index(format: WFormat, e: usize, i: usize) -> usize {
    let (g, m, _) = grid(format);
    let bits = if m.len() <= 4 { 2 } else { 3 };
    ((g[e] >> (bits * i)) & ((1 << bits) - 1)) as usize
}

/// The grid as the kernels read it, in front of the scale records: one byte per element, four
/// per word (an entry of 8 elements takes two words). IQ2 and IQ3 bytes are the grid values;
/// IQ1's are the map index (0, 1, 2 for -1, 0, 1).
pub fn gpu_grid_words(format: WFormat) -> Vec<u32> {
    let (g, m, per) = grid(format);
    let byte = |e: usize, i: usize| {
        let k = grid_index(format, e, i);
        if matches!(format, WFormat::IQ1_S | WFormat::IQ1_M) {
            k as u32
        } else {
            m[k] as u8 as u32
        }
    };
    let mut out = Vec::with_capacity(g.len() * per / 4);
    for e in 0..g.len() {
        for w in 0..per / 4 {
            out.push((0..4).map(|i| byte(e, 4 * w + i) << (8 * i)).sum());
        }
    }
    out
}

/// ggml's ksigns: seven stored sign bits and an eighth that makes the count of minus signs even.
fn ksigns(s7: u32) -> u32 {
    let s7 = s7 & 127;
    s7 | (s7.count_ones() & 1) << 7
}

/// IQ1_M's d: an f16 whose four nibbles are the top nibbles of its four scale u16s.
fn iq1m_d(b: &[u8]) -> f32 {
    let sc = |k: usize| u16::from_le_bytes([b[48 + 2 * k], b[49 + 2 * k]]);
    let bits = (sc(0) >> 12) | ((sc(1) >> 8) & 0xf0) | ((sc(2) >> 4) & 0xf00) | (sc(3) & 0xf000);
    f16::from_bits(bits).to_f32()
}

/// Re-packs one GGUF super-block (256 elements) into 8 blocks of quant words (`q`) and one scale
/// record (`s`), d first (f16 widened to f32 bits):
/// - IQ2_XXS: q [grid bytes, signs/scale word]; s [d].
/// - IQ2_XS: q [four u16 of 9-bit index | 7 signs << 9]; s [d, 8 scale bytes].
/// - IQ2_S: q [index low bytes, sign bytes]; s [d, 8 scale bytes, 8 qh bytes].
/// - IQ3_XXS: q [8 index bytes (2 words), signs/scale word]; s [d].
/// - IQ3_S: q [8 index low bytes (2 words), sign bits]; s [d, 4 scale bytes, 8 qh bytes].
/// - IQ1_S: q [4 index low bytes]; s [d, 8 qh u16].
/// - IQ1_M: q [4 index low bytes]; s [d, 4 scale u16, 16 qh bytes].
pub(crate) fn repack_block(format: WFormat, b: &[u8], q: &mut Vec<u32>, s: &mut Vec<u32>) {
    let d = |at: usize| f16_at(b, at).to_bits();
    let words = |s: &mut Vec<u32>, bytes: &[u8]| s.extend(bytes.chunks_exact(4).map(bytes_word));
    match format {
        WFormat::IQ2_XXS | WFormat::IQ2_XS => {
            (0..16).for_each(|i| q.push(word(b, 2 + 4 * i)));
            s.push(d(0));
            if format == WFormat::IQ2_XS {
                words(s, &b[66..74]);
            }
        }
        WFormat::IQ2_S => {
            for j in 0..8 {
                q.extend([word(b, 2 + 4 * j), word(b, 34 + 4 * j)]);
            }
            s.push(d(0));
            words(s, &b[74..82]);
            words(s, &b[66..74]);
        }
        WFormat::IQ3_XXS => {
            for j in 0..8 {
                q.extend([word(b, 2 + 8 * j), word(b, 6 + 8 * j), word(b, 66 + 4 * j)]);
            }
            s.push(d(0));
        }
        WFormat::IQ3_S => {
            for j in 0..8 {
                q.extend([word(b, 2 + 8 * j), word(b, 6 + 8 * j), word(b, 74 + 4 * j)]);
            }
            s.push(d(0));
            words(s, &b[106..110]);
            words(s, &b[66..74]);
        }
        WFormat::IQ1_S => {
            (0..8).for_each(|j| q.push(word(b, 2 + 4 * j)));
            s.push(d(0));
            words(s, &b[34..50]);
        }
        WFormat::IQ1_M => {
            (0..8).for_each(|j| q.push(word(b, 4 * j)));
            s.push(iq1m_d(b).to_bits());
            words(s, &b[48..56]);
            words(s, &b[32..48]);
        }
        f => unreachable!("{f:?} is not a grid format"),
    }
}

/// Byte `i` of a little-endian word array.
fn byte_of(w: &[u32], i: usize) -> u32 {
    (w[i / 4] >> (8 * (i % 4))) & 255
}

/// The 32 values of block `j` (0..8 in its super-block) from its quant words `w` and its
/// super-block's scale record `r`, as the kernels compute them and bit for bit as ggml's
/// reference dequantization.
pub(crate) fn dequant_block(format: WFormat, w: &[u32], r: &[u32], j: usize) -> [f32; 32] {
    let d = f32::from_bits(r[0]);
    let (_, map, _) = grid(format);
    let val = |e: usize, i: usize| map[grid_index(format, e, i)] as f32;
    let sign = |bits: u32, i: usize| if (bits >> i) & 1 == 1 { -1.0 } else { 1.0 };
    // The IQ2 types' half scales: d * (0.5 + 4-bit scale) / 4.
    let iq2 = |ls: u32| d * (0.5 + ls as f32) * 0.25;
    let mut out = [0f32; 32];
    for (e, o) in out.iter_mut().enumerate() {
        let (g, i) = (e / 8, e % 8);
        let half = e / 16;
        *o = match format {
            WFormat::IQ2_XXS => {
                let idx = byte_of(&w[..1], g) as usize;
                iq2(w[1] >> 28) * (sign(ksigns(w[1] >> (7 * g)), i) * val(idx, i))
            }
            WFormat::IQ2_XS => {
                let u = (w[g / 2] >> (16 * (g % 2))) & 0xffff;
                let ls = (byte_of(&r[1..3], j) >> (4 * half)) & 15;
                iq2(ls) * (sign(ksigns(u >> 9), i) * val((u & 511) as usize, i))
            }
            WFormat::IQ2_S => {
                let qh = byte_of(&r[3..5], j);
                let idx = byte_of(&w[..1], g) | ((qh >> (2 * g)) & 3) << 8;
                let ls = (byte_of(&r[1..3], j) >> (4 * half)) & 15;
                iq2(ls) * (sign(byte_of(&w[1..2], g), i) * val(idx as usize, i))
            }
            WFormat::IQ3_XXS => {
                let idx = byte_of(&w[..2], e / 4) as usize;
                let db = d * (0.5 + (w[2] >> 28) as f32) * 0.5;
                db * (sign(ksigns(w[2] >> (7 * g)), i) * val(idx, e % 4))
            }
            WFormat::IQ3_S => {
                let qh = byte_of(&r[2..4], j);
                let idx = byte_of(&w[..2], e / 4) | ((qh >> (e / 4)) & 1) << 8;
                let ls = (byte_of(&r[1..2], j / 2) >> (4 * (j % 2))) & 15;
                let db = d * (1 + 2 * ls) as f32;
                db * (sign(w[2], e) * val(idx as usize, e % 4))
            }
            WFormat::IQ1_S => {
                let qh = (r[1 + j / 2] >> (16 * (j % 2))) & 0xffff;
                let idx = byte_of(&w[..1], g) | ((qh >> (3 * g)) & 7) << 8;
                let dl = d * (2 * ((qh >> 12) & 7) + 1) as f32 * 0.125;
                dl * (8.0 * val(idx as usize, i) + sign(qh >> 15, 0))
            }
            WFormat::IQ1_M => {
                let nib = (byte_of(&r[3..7], 2 * j + g / 2) >> (4 * (g % 2))) & 15;
                let idx = byte_of(&w[..1], g) | (nib & 7) << 8;
                let k = 2 * j + half;
                let sc = ((r[1 + k / 8] >> (16 * (k / 4 % 2))) >> (3 * (k % 4))) & 7;
                let dl = d * (2 * sc + 1) as f32 * 0.125;
                dl * (8.0 * val(idx as usize, i) + sign(nib >> 3, 0))
            }
            f => unreachable!("{f:?} is not a grid format"),
        };
    }
    out
}

/// Sets a random block's scale so that its values have standard deviation about `std` (random
/// indices and signs keep the mean about 0): the d field, with the block's 4-bit (IQ2, IQ3) or
/// 3-bit (IQ1) sub-block scales left random.
pub(crate) fn fill_centered(format: WFormat, b: &mut [u8], rng: &mut XorShift64, std: f32) {
    let (g, map, per) = grid(format);
    let iq1 = matches!(format, WFormat::IQ1_S | WFormat::IQ1_M);
    // The RMS of v over the grid's entries (IQ1: grid + the 1/8 delta) and of the sub-block
    // scale factor over its random 4-bit or 3-bit field.
    let mut sq = 0f64;
    for e in 0..g.len() {
        for i in 0..per {
            let v = map[grid_index(format, e, i)] as f64;
            sq += if iq1 { v * v + 1.0 / 64.0 } else { v * v };
        }
    }
    let v_rms = (sq / (g.len() * per) as f64).sqrt();
    let factor = |ls: u32| -> f64 {
        match format {
            WFormat::IQ3_XXS => (0.5 + ls as f64) * 0.5,
            WFormat::IQ3_S => (1 + 2 * ls) as f64,
            _ if iq1 => (2 * ls + 1) as f64,
            _ => (0.5 + ls as f64) * 0.25,
        }
    };
    let levels = if iq1 { 8 } else { 16 };
    let s_rms = ((0..levels).map(|l| factor(l).powi(2)).sum::<f64>() / levels as f64).sqrt();
    let d = std / (v_rms * s_rms) as f32 * (0.75 + 0.5 * rng.unit());
    // The f16 d's offset (gguf_scale_fields); IQ1_M spreads it over its scales.
    match gguf_scale_fields(format).first() {
        Some(&o) => b[o..o + 2].copy_from_slice(&f16::from_f32(d).to_le_bytes()),
        None => set_iq1m_d(b, d),
    }
}

/// Writes IQ1_M's d into the top nibbles of its scale u16s (the 3-bit scales stay).
pub(crate) fn set_iq1m_d(b: &mut [u8], d: f32) {
    let bits = f16::from_f32(d).to_bits();
    for k in 0..4 {
        let at = 48 + 2 * k;
        let sc = u16::from_le_bytes([b[at], b[at + 1]]) & 0x0fff;
        let top = ((bits >> (4 * k)) & 15) << 12;
        b[at..at + 2].copy_from_slice(&(sc | top).to_le_bytes());
    }
}
