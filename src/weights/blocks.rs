//! GGUF's quantized blocks, one format at a time: their geometry, how a block's codes and
//! scale record are decoded from the file's bytes and packed into the GPU layout's words (and
//! back), how codes become values (bit for bit as GGUF's reference dequantization), and random
//! blocks for synthetic models.

use super::tensor::XorShift64;
use crate::gpu::wformat::{WFormat, KVALUES_IQ4NL, KVALUES_MXFP4};
use half::f16;

/// GGUF's block geometry of a quantized format: (elements, bytes) per block.
pub fn gguf_block(format: WFormat) -> Option<(usize, usize)> {
    Some(match format {
        WFormat::F32 | WFormat::F16 => return None,
        WFormat::Q8_0 => (32, 34),
        WFormat::Q4_0 => (32, 18),
        WFormat::Q4_1 => (32, 20),
        WFormat::Q5_0 => (32, 22),
        WFormat::Q5_1 => (32, 24),
        WFormat::Q2_K => (256, 84),
        WFormat::Q3_K => (256, 110),
        WFormat::Q4_K => (256, 144),
        WFormat::Q5_K => (256, 176),
        WFormat::Q6_K => (256, 210),
        WFormat::IQ4_NL => (32, 18),
        WFormat::IQ4_XS => (256, 136),
        WFormat::MXFP4 => (32, 17),
        WFormat::IQ2_XXS => (256, 66),
        WFormat::IQ2_XS => (256, 74),
        WFormat::IQ2_S => (256, 82),
        WFormat::IQ3_XXS => (256, 98),
        WFormat::IQ3_S => (256, 110),
        WFormat::IQ1_S => (256, 50),
        WFormat::IQ1_M => (256, 56),
    })
}

pub(crate) fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

pub(crate) fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

pub(crate) fn bytes_word(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// The inverse of `k4_scales`: eight 6-bit scales and eight 6-bit mins -> GGUF's twelve bytes.
fn k4_pack_scales(d: &[u8; 8], m: &[u8; 8]) -> [u8; 12] {
    let mut sc = [0u8; 12];
    for j in 0..4 {
        sc[j] = (d[j] & 63) | (d[j + 4] >> 4) << 6;
        sc[j + 4] = (m[j] & 63) | (m[j + 4] >> 4) << 6;
        sc[j + 8] = (d[j + 4] & 15) | (m[j + 4] & 15) << 4;
    }
    sc
}

/// The inverse of Q3_K's scale unpacking in `decode_block`: sixteen signed scales in -32..32
/// -> GGUF's twelve bytes (low nibbles in bytes 0..8, the two high bits in bytes 8..12).
fn q3_pack_scales(scales: &[i8; 16]) -> [u8; 12] {
    let mut sc = [0u8; 12];
    for (i, &v) in scales.iter().enumerate() {
        let v = (v as i32 + 32).clamp(0, 63) as u8;
        sc[i % 8] |= (v & 15) << (4 * (i / 8));
        sc[8 + i % 4] |= (v >> 4) << (2 * (i / 4));
    }
    sc
}

/// Byte offsets of a GGUF block's f16 scale fields (d, and the min or dmin where the format
/// has one).
pub(crate) fn gguf_scale_fields(format: WFormat) -> &'static [usize] {
    match format {
        WFormat::Q8_0 | WFormat::Q4_0 | WFormat::Q5_0 | WFormat::IQ4_NL | WFormat::IQ4_XS => &[0],
        WFormat::IQ2_XXS | WFormat::IQ2_XS | WFormat::IQ2_S | WFormat::IQ3_XXS | WFormat::IQ3_S => &[0],
        WFormat::IQ1_S => &[0],
        // MXFP4's scale is an e8m0 byte, not an f16; IQ1_M's d is spread over its scales.
        WFormat::MXFP4 | WFormat::IQ1_M => &[],
        WFormat::Q4_1 | WFormat::Q5_1 | WFormat::Q4_K | WFormat::Q5_K => &[0, 2],
        WFormat::Q2_K => &[80, 82],
        WFormat::Q3_K => &[108],
        WFormat::Q6_K => &[208],
        WFormat::F32 | WFormat::F16 => &[],
    }
}

/// Standard deviation of a code drawn uniformly from `n` consecutive integers.
fn uniform_code_std(n: u32) -> f32 {
    (((n * n - 1) as f32) / 12.0).sqrt()
}

/// Fills one GGUF block of `format` with random codes and scales chosen so that its values
/// have mean about 0 and standard deviation about `std` (synthetic models: with `std` about
/// 1/sqrt(row length), activations stay O(1) through any number of layers). Symmetric formats
/// get scales of random sign; formats with a min get min = -(mean code) * scale.
pub fn fill_centered_block(format: WFormat, b: &mut [u8], rng: &mut XorShift64, std: f32) {
    rng.fill_bytes(b);
    let put = |b: &mut [u8], at: usize, v: f32| b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
    // A scale of magnitude std / code_std, jittered by +-25%, with a random sign when `signed`.
    let scale = |rng: &mut XorShift64, code_std: f32, signed: bool| {
        let d = std / code_std * (0.75 + 0.5 * rng.unit());
        if signed && rng.next_u64() & 1 == 1 {
            -d
        } else {
            d
        }
    };
    match format {
        WFormat::Q8_0 => put(b, 0, scale(rng, uniform_code_std(256), true)),
        WFormat::Q4_0 => put(b, 0, scale(rng, uniform_code_std(16), true)),
        WFormat::Q5_0 => put(b, 0, scale(rng, uniform_code_std(32), true)),
        WFormat::Q4_1 | WFormat::Q5_1 => {
            let levels = if format == WFormat::Q4_1 { 16 } else { 32 };
            let d = f16::from_f32(scale(rng, uniform_code_std(levels), true)).to_f32();
            put(b, 0, d);
            put(b, 2, -d * (levels - 1) as f32 / 2.0);
        }
        WFormat::Q4_K | WFormat::Q5_K => {
            // value = d * sc * code - dmin * m, sc in 32..=63; dmin = d * levels / 2 so that
            // m = round(mean code * sc * d / dmin) fits six bits.
            let levels = if format == WFormat::Q4_K { 16 } else { 32 };
            let d = scale(rng, uniform_code_std(levels) * 47.5, false);
            let dmin = d * (levels / 2) as f32;
            let (mut sc, mut mn) = ([0u8; 8], [0u8; 8]);
            for j in 0..8 {
                sc[j] = rng.range(32, 63) as u8;
                mn[j] = ((levels - 1) as f32 / 2.0 * sc[j] as f32 / (levels / 2) as f32).round() as u8;
            }
            put(b, 0, d);
            put(b, 2, dmin);
            b[4..16].copy_from_slice(&k4_pack_scales(&sc, &mn));
        }
        WFormat::Q6_K => {
            // value = d * sc * (code - 32), sc signed in +-(32..=127).
            put(b, 208, scale(rng, uniform_code_std(64) * 79.5, false));
            for s in &mut b[192..208] {
                let v = rng.range(32, 127) as i8;
                *s = if rng.next_u64() & 1 == 1 { -v } else { v } as u8;
            }
        }
        WFormat::Q3_K => {
            // value = d * sc * (code - 4), sc signed in +-(8..=31).
            put(b, 108, scale(rng, uniform_code_std(8) * 19.5, false));
            let mut sc = [0i8; 16];
            for s in &mut sc {
                let v = rng.range(8, 31) as i8;
                *s = if rng.next_u64() & 1 == 1 { -v } else { v };
            }
            b[96..108].copy_from_slice(&q3_pack_scales(&sc));
        }
        WFormat::Q2_K => {
            // value = d * sc * code - dmin * m, sc in 8..=15, dmin = 2 d, m = round(0.75 sc).
            let d = scale(rng, uniform_code_std(4) * 11.5, false);
            put(b, 80, d);
            put(b, 82, 2.0 * d);
            for s in &mut b[..16] {
                let sc = rng.range(8, 15) as u8;
                *s = sc | ((0.75 * sc as f32).round() as u8) << 4;
            }
        }
        WFormat::IQ4_NL => put(b, 0, scale(rng, table_std(&KVALUES_IQ4NL), true)),
        WFormat::IQ4_XS => {
            // value = d * (ls - 32) * table[code], ls - 32 signed in +-(8..=31).
            put(b, 0, scale(rng, table_std(&KVALUES_IQ4NL) * 19.5, false));
            let mut ls = [0u8; 8];
            for v in &mut ls {
                let m = rng.range(8, 31) as i32;
                *v = (32 + if rng.next_u64() & 1 == 1 { -m } else { m }) as u8;
            }
            b[2..8].copy_from_slice(&iq4xs_pack_scales(&ls));
        }
        WFormat::MXFP4 => {
            // value = 2^(e - 128) * table[code]. The scale is a power of two: 2^floor(x) or
            // 2^ceil(x), x = log2(std / the table's std), chosen so that the mean variance over
            // blocks is std^2.
            let x = (std / table_std(&KVALUES_MXFP4)).log2();
            let f = x.floor();
            let up = rng.unit() < (4f32.powf(x - f) - 1.0) / 3.0;
            b[0] = (128.0 + f + up as u8 as f32).clamp(2.0, 254.0) as u8;
        }
        f if f.is_grid() => super::grids::fill_centered(f, b, rng, std),
        f => unreachable!("{f:?}: not a block format with codes"),
    }
}

/// Standard deviation of a table's values, codes drawn uniformly.
fn table_std(t: &[i8; 16]) -> f32 {
    let mean = t.iter().map(|&v| v as f32).sum::<f32>() / 16.0;
    (t.iter().map(|&v| (v as f32 - mean).powi(2)).sum::<f32>() / 16.0).sqrt()
}

/// IQ4_XS's eight 6-bit sub-block scales -> its scales_h (u16, two bits each) and scales_l
/// (four bytes, a nibble each), as the block stores them from byte 2.
fn iq4xs_pack_scales(ls: &[u8; 8]) -> [u8; 6] {
    let mut h = 0u16;
    let mut out = [0u8; 6];
    for (ib, &v) in ls.iter().enumerate() {
        out[2 + ib / 2] |= (v & 15) << (4 * (ib % 2));
        h |= ((v >> 4) as u16 & 3) << (2 * ib);
    }
    out[..2].copy_from_slice(&h.to_le_bytes());
    out
}

/// ggml's e8m0_to_fp32_half: 2^(e - 128), subnormal for e < 2 (exact in f32).
pub(crate) fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 { 0x0020_0000u32 << e } else { ((e - 1) as u32) << 23 };
    f32::from_bits(bits)
}

/// Q4_K/Q5_K's twelve bytes of 6-bit scales and mins -> (scales, mins), eight each.
pub(crate) fn k4_scales(sc: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut d, mut m) = ([0u8; 8], [0u8; 8]);
    for j in 0..4 {
        d[j] = sc[j] & 63;
        m[j] = sc[j + 4] & 63;
        d[j + 4] = (sc[j + 8] & 15) | ((sc[j] >> 6) << 4);
        m[j + 4] = (sc[j + 8] >> 4) | ((sc[j + 4] >> 6) << 4);
    }
    (d, m)
}

/// Decodes one GGUF block into its quant codes (one unsigned integer per element, the value the
/// format stores, before any scale) and pushes its scale record onto `s`. No value changes: the
/// codes and scales are exactly those of the file (f16 scales widened to f32, exactly).
pub(crate) fn decode_block(format: WFormat, b: &[u8], codes: &mut [u8], s: &mut Vec<u32>) {
    let f = |x: f32| x.to_bits();
    match format {
        WFormat::Q8_0 => {
            s.push(f(f16_at(b, 0)));
            codes.copy_from_slice(&b[2..34]);
        }
        WFormat::Q4_0 | WFormat::Q4_1 => {
            let head = if format == WFormat::Q4_1 { 4 } else { 2 };
            s.push(f(f16_at(b, 0)));
            if format == WFormat::Q4_1 {
                s.push(f(f16_at(b, 2)));
            }
            for j in 0..16 {
                codes[j] = b[head + j] & 15;
                codes[j + 16] = b[head + j] >> 4;
            }
        }
        WFormat::Q5_0 | WFormat::Q5_1 => {
            let one = format == WFormat::Q5_1;
            s.push(f(f16_at(b, 0)));
            if one {
                s.push(f(f16_at(b, 2)));
            }
            let h = if one { 4 } else { 2 };
            let qh = u32_at(b, h);
            let qs = &b[h + 4..h + 20];
            for j in 0..16 {
                codes[j] = (qs[j] & 15) | (((qh >> j) & 1) << 4) as u8;
                codes[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4) as u8;
            }
        }
        WFormat::Q4_K | WFormat::Q5_K => {
            let (d, m) = k4_scales(&b[4..16]);
            s.extend([f(f16_at(b, 0)), f(f16_at(b, 2)), bytes_word(&d[..4]), bytes_word(&d[4..])]);
            s.extend([bytes_word(&m[..4]), bytes_word(&m[4..])]);
            let (qh, qs) = if format == WFormat::Q5_K { (Some(&b[16..48]), &b[48..176]) } else { (None, &b[16..144]) };
            // Sub-block j (32 elements) takes the low (j even) or high nibbles of qs[32 (j/2)..];
            // Q5_K's fifth bit of element l of sub-block j is bit j of qh[l].
            for j in 0..8 {
                for l in 0..32 {
                    let byte = qs[32 * (j / 2) + l];
                    let low = if j % 2 == 0 { byte & 15 } else { byte >> 4 };
                    let high = qh.map_or(0, |qh| (qh[l] >> j) & 1);
                    codes[32 * j + l] = low | high << 4;
                }
            }
        }
        WFormat::Q6_K => {
            let (ql, qh, sc) = (&b[..128], &b[128..192], &b[192..208]);
            s.push(f(f16_at(b, 208)));
            s.extend(sc.chunks_exact(4).map(bytes_word));
            // Halves of 128: element 32g + l of half n takes ql[64n + l + 32 (g % 2)]'s low
            // (g < 2) or high nibble, and bits 2g..2g+1 of qh[32n + l].
            for n in 0..2 {
                for g in 0..4 {
                    for l in 0..32 {
                        let byte = ql[64 * n + l + 32 * (g % 2)];
                        let low = if g < 2 { byte & 15 } else { byte >> 4 };
                        let high = (qh[32 * n + l] >> (2 * g)) & 3;
                        codes[128 * n + 32 * g + l] = low | high << 4;
                    }
                }
            }
        }
        WFormat::Q3_K => {
            let (hmask, qs, sc) = (&b[..32], &b[32..96], &b[96..108]);
            // Sixteen 6-bit scales: low nibbles from bytes 0..8 (low then high halves), the two
            // high bits from bytes 8..12. Stored as signed bytes (scale - 32).
            let mut scales = [0u8; 16];
            for (i, v) in scales.iter_mut().enumerate() {
                let low = if i < 8 { sc[i] & 15 } else { sc[i - 8] >> 4 };
                let high = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
                *v = ((low | high << 4) as i8 - 32) as u8;
            }
            s.push(f(f16_at(b, 108)));
            s.extend(scales.chunks_exact(4).map(bytes_word));
            // Element 32j + l of half n: bits 2j..2j+1 of qs[32n + l], and bit 4n + j of
            // hmask[l] (set: no -4 offset). Code = low | hbit << 2, value (code - 4) * scale.
            for n in 0..2 {
                for j in 0..4 {
                    for l in 0..32 {
                        let low = (qs[32 * n + l] >> (2 * j)) & 3;
                        let high = (hmask[l] >> (4 * n + j)) & 1;
                        codes[128 * n + 32 * j + l] = low | high << 2;
                    }
                }
            }
        }
        WFormat::IQ4_NL | WFormat::MXFP4 => {
            let (d, qs) =
                if format == WFormat::MXFP4 { (e8m0_half(b[0]), &b[1..17]) } else { (f16_at(b, 0), &b[2..18]) };
            s.push(f(d));
            for j in 0..16 {
                codes[j] = qs[j] & 15;
                codes[j + 16] = qs[j] >> 4;
            }
        }
        WFormat::IQ4_XS => {
            // Sub-block ib's 6-bit scale: nibble ib % 2 of scales_l[ib / 2], and bits 2 ib..2 ib + 2
            // of scales_h; stored as signed bytes (scale - 32). Its 16 bytes of qs: element j
            // in the low nibble of byte j, element 16 + j in the high one.
            let sh = u16::from_le_bytes([b[2], b[3]]);
            let mut sc = [0u8; 8];
            for (ib, v) in sc.iter_mut().enumerate() {
                let ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 15) | (((sh >> (2 * ib)) & 3) as u8) << 4;
                *v = (ls as i8 - 32) as u8;
            }
            s.extend([f(f16_at(b, 0)), bytes_word(&sc[..4]), bytes_word(&sc[4..])]);
            for ib in 0..8 {
                for j in 0..16 {
                    let q = b[8 + 16 * ib + j];
                    codes[32 * ib + j] = q & 15;
                    codes[32 * ib + 16 + j] = q >> 4;
                }
            }
        }
        WFormat::Q2_K => {
            let (sc, qs) = (&b[..16], &b[16..80]);
            s.extend([f(f16_at(b, 80)), f(f16_at(b, 82))]);
            s.extend(sc.chunks_exact(4).map(bytes_word));
            for n in 0..2 {
                for j in 0..4 {
                    for l in 0..32 {
                        codes[128 * n + 32 * j + l] = (qs[32 * n + l] >> (2 * j)) & 3;
                    }
                }
            }
        }
        f => unreachable!("{f:?}: not a block format with codes"),
    }
}

/// Packs the 32 codes of one block into the format's words (see `from_gguf_blocks`).
pub(crate) fn pack_block(format: WFormat, c: &[u8], q: &mut Vec<u32>) {
    // Part p of a block is elements 4p..4p+4 ("lo") and 16+4p..16+4p+4 ("hi"), the order
    // matmul.wgsl consumes them in.
    let nibbles = |q: &mut Vec<u32>| {
        for p in 0..4 {
            q.push(
                (0..4).map(|i| ((c[4 * p + i] & 15) as u32 | ((c[16 + 4 * p + i] & 15) as u32) << 4) << (8 * i)).sum(),
            );
        }
    };
    // One bit per element (bit `bit` of the code): byte p = part p, bits 0..4 lo, 4..8 hi.
    let bits = |q: &mut Vec<u32>, bit: u32| {
        let b = |e: usize| ((c[e] as u32) >> bit) & 1;
        q.push(
            (0..4)
                .map(|p| (0..4).map(|i| (b(4 * p + i) << i | b(16 + 4 * p + i) << (4 + i)) << (8 * p)).sum::<u32>())
                .sum(),
        );
    };
    // Two bits per element (bits `bit`, `bit`+1): 16 bits per part, two parts per word.
    let pairs = |q: &mut Vec<u32>, bit: u32| {
        let b = |e: usize| ((c[e] as u32) >> bit) & 3;
        for w in 0..2 {
            q.push(
                (0..2)
                    .map(|h| {
                        let p = 2 * w + h;
                        (0..4)
                            .map(|i| (b(4 * p + i) << (2 * i) | b(16 + 4 * p + i) << (8 + 2 * i)) << (16 * h))
                            .sum::<u32>()
                    })
                    .sum(),
            );
        }
    };
    match format {
        WFormat::Q8_0 => q.extend(c.chunks_exact(4).map(bytes_word)),
        WFormat::Q4_0 | WFormat::Q4_1 | WFormat::Q4_K => nibbles(q),
        WFormat::IQ4_NL | WFormat::IQ4_XS | WFormat::MXFP4 => nibbles(q),
        WFormat::Q5_0 | WFormat::Q5_1 | WFormat::Q5_K => {
            nibbles(q);
            bits(q, 4);
        }
        WFormat::Q6_K => {
            nibbles(q);
            pairs(q, 4);
        }
        WFormat::Q3_K => {
            pairs(q, 0);
            bits(q, 2);
        }
        WFormat::Q2_K => pairs(q, 0),
        f => unreachable!("{f:?}: not a block format with codes"),
    }
}

/// Unpacks the 32 codes of block words `w` (the inverse of `pack_block`).
pub(crate) fn unpack_block(format: WFormat, w: &[u32]) -> [u32; 32] {
    let mut c = [0u32; 32];
    let part = |e: usize| (e % 16 / 4, e % 4, e >= 16);
    let nib = |e: usize| {
        let (p, i, hi) = part(e);
        (w[p] >> (8 * i + 4 * hi as usize)) & 15
    };
    let bit = |word: u32, e: usize| {
        let (p, i, hi) = part(e);
        (word >> (8 * p + i + 4 * hi as usize)) & 1
    };
    let pair = |w0: u32, w1: u32, e: usize| {
        let (p, i, hi) = part(e);
        let word = if p < 2 { w0 } else { w1 };
        (word >> (16 * (p % 2) + 2 * i + 8 * hi as usize)) & 3
    };
    for (e, v) in c.iter_mut().enumerate() {
        *v = match format {
            WFormat::Q8_0 => (w[e / 4] >> (8 * (e % 4))) & 255,
            WFormat::Q4_0 | WFormat::Q4_1 | WFormat::Q4_K => nib(e),
            WFormat::IQ4_NL | WFormat::IQ4_XS | WFormat::MXFP4 => nib(e),
            WFormat::Q5_0 | WFormat::Q5_1 | WFormat::Q5_K => nib(e) | bit(w[4], e) << 4,
            WFormat::Q6_K => nib(e) | pair(w[4], w[5], e) << 4,
            WFormat::Q3_K => pair(w[0], w[1], e) | bit(w[2], e) << 2,
            WFormat::Q2_K => pair(w[0], w[1], e),
            f => unreachable!("{f:?}: not a block format with codes"),
        };
    }
    c
}

/// How block codes become values: `Offset(o)`: (code - o) * d, with o = 128 meaning the code is
/// a signed byte; `Min`: code * d + m; `Table(t)`: d * t[code]. Mirrors GGUF's reference dequantization operation for
/// operation, so results are bit-identical.
pub(crate) enum Affine {
    Offset(i32),
    Min,
    Table(&'static [i8; 16]),
}

pub(crate) fn affine(format: WFormat) -> Affine {
    if let Some(t) = format.table() {
        return Affine::Table(t);
    }
    match format {
        WFormat::Q8_0 => Affine::Offset(128),
        WFormat::Q4_0 => Affine::Offset(8),
        WFormat::Q5_0 => Affine::Offset(16),
        WFormat::Q3_K => Affine::Offset(4),
        WFormat::Q6_K => Affine::Offset(32),
        _ => Affine::Min,
    }
}

/// (d, m) of the 16 elements `half` (0: elements 0..16, 1: 16..32) of 32-element block `j`
/// (0..8 within a K-quant super-block; 0 otherwise) of the scale record `r`.
pub(crate) fn half_scale(format: WFormat, r: &[u32], j: usize, half: usize) -> (f32, f32) {
    let fl = |i: usize| f32::from_bits(r[i]);
    let byte = |w: &[u32], i: usize| (w[i / 4] >> (8 * (i % 4))) & 255;
    match format {
        WFormat::Q8_0 | WFormat::Q4_0 | WFormat::Q5_0 | WFormat::IQ4_NL | WFormat::MXFP4 => (fl(0), 0.0),
        WFormat::IQ4_XS => (fl(0) * byte(&r[1..3], j) as u8 as i8 as f32, 0.0),
        WFormat::Q4_1 | WFormat::Q5_1 => (fl(0), fl(1)),
        WFormat::Q4_K | WFormat::Q5_K => (fl(0) * byte(&r[2..4], j) as f32, -(fl(1) * byte(&r[4..6], j) as f32)),
        WFormat::Q3_K | WFormat::Q6_K => (fl(0) * byte(&r[1..5], 2 * j + half) as u8 as i8 as f32, 0.0),
        WFormat::Q2_K => {
            let sc = byte(&r[2..6], 2 * j + half);
            (fl(0) * (sc & 15) as f32, -(fl(1) * (sc >> 4) as f32))
        }
        f => unreachable!("{f:?}: not a block format with codes"),
    }
}
