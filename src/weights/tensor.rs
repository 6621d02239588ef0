//! Host-side weight matrices in the GPU layout, with the CPU reference math the tests use.

use crate::gpu::wformat::WFormat;
use anyhow::{bail, Result};
use half::{bf16, f16};

/// A [rows, cols] weight matrix (row-major, cols = K contiguous) in GPU layout: `q` holds the
/// quant words of each 32-element block (rows * cols/32 * words_per_block), `s` the scale
/// records (rows * scale_words_per_row words; f32 values stored as their bits). See
/// [`QTensor::from_gguf_blocks`] for how each GGUF format is re-packed.
#[derive(Clone, Debug)]
pub struct QTensor {
    pub format: WFormat,
    pub rows: usize,
    pub cols: usize,
    pub q: Vec<u32>,
    pub s: Vec<u32>,
}

fn check_cols(cols: usize, group: usize, what: &str) -> Result<()> {
    if cols == 0 || !cols.is_multiple_of(group) {
        bail!("{what}: row length {cols} is not a positive multiple of {group}");
    }
    Ok(())
}

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
    })
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

fn bytes_word(b: &[u8]) -> u32 {
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
fn gguf_scale_fields(format: WFormat) -> &'static [usize] {
    match format {
        WFormat::Q8_0 | WFormat::Q4_0 | WFormat::Q5_0 => &[0],
        WFormat::Q4_1 | WFormat::Q5_1 | WFormat::Q4_K | WFormat::Q5_K => &[0, 2],
        WFormat::Q2_K => &[80, 82],
        WFormat::Q3_K => &[108],
        WFormat::Q6_K => &[208],
        WFormat::F32 | WFormat::F16 => &[],
    }
}

/// xorshift64: the fast, seeded generator of random weights (tests, benches, synthetic
/// models). The same sequence on every platform for a given seed.
#[derive(Clone, Debug)]
pub struct XorShift64(u64);

impl XorShift64 {
    pub fn new(seed: u64) -> XorShift64 {
        XorShift64(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// Uniform in [0, 1), with 24 bits so it is exact in f32.
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in [lo, hi] (inclusive).
    pub fn range(&mut self, lo: u32, hi: u32) -> u32 {
        lo + (self.next_u64() >> 32) as u32 % (hi - lo + 1)
    }

    /// Random bytes, eight per step of the generator.
    pub fn fill_bytes(&mut self, out: &mut [u8]) {
        let mut chunks = out.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        let last = self.next_u64().to_le_bytes();
        let n = rest.len();
        rest.copy_from_slice(&last[..n]);
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
        WFormat::F32 | WFormat::F16 => unreachable!("not a block format"),
    }
}

/// Q4_K/Q5_K's twelve bytes of 6-bit scales and mins -> (scales, mins), eight each.
fn k4_scales(sc: &[u8]) -> ([u8; 8], [u8; 8]) {
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
fn decode_block(format: WFormat, b: &[u8], codes: &mut [u8], s: &mut Vec<u32>) {
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
        WFormat::F32 | WFormat::F16 => unreachable!("not a block format"),
    }
}

/// Packs the 32 codes of one block into the format's words (see `from_gguf_blocks`).
fn pack_block(format: WFormat, c: &[u8], q: &mut Vec<u32>) {
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
        WFormat::F32 | WFormat::F16 => unreachable!("not a block format"),
    }
}

/// Unpacks the 32 codes of block words `w` (the inverse of `pack_block`).
fn unpack_block(format: WFormat, w: &[u32]) -> [u32; 32] {
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
            WFormat::Q5_0 | WFormat::Q5_1 | WFormat::Q5_K => nib(e) | bit(w[4], e) << 4,
            WFormat::Q6_K => nib(e) | pair(w[4], w[5], e) << 4,
            WFormat::Q3_K => pair(w[0], w[1], e) | bit(w[2], e) << 2,
            WFormat::Q2_K => pair(w[0], w[1], e),
            WFormat::F32 | WFormat::F16 => unreachable!("not a block format"),
        };
    }
    c
}

/// How block codes become values: `Offset(o)`: (code - o) * d, with o = 128 meaning the code is
/// a signed byte; `Min`: code * d + m. Mirrors GGUF's reference dequantization operation for
/// operation, so results are bit-identical.
enum Affine {
    Offset(i32),
    Min,
}

fn affine(format: WFormat) -> Affine {
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
fn half_scale(format: WFormat, r: &[u32], j: usize, half: usize) -> (f32, f32) {
    let fl = |i: usize| f32::from_bits(r[i]);
    let byte = |w: &[u32], i: usize| (w[i / 4] >> (8 * (i % 4))) & 255;
    match format {
        WFormat::Q8_0 | WFormat::Q4_0 | WFormat::Q5_0 => (fl(0), 0.0),
        WFormat::Q4_1 | WFormat::Q5_1 => (fl(0), fl(1)),
        WFormat::Q4_K | WFormat::Q5_K => (fl(0) * byte(&r[2..4], j) as f32, -(fl(1) * byte(&r[4..6], j) as f32)),
        WFormat::Q3_K | WFormat::Q6_K => (fl(0) * byte(&r[1..5], 2 * j + half) as u8 as i8 as f32, 0.0),
        WFormat::Q2_K => {
            let sc = byte(&r[2..6], 2 * j + half);
            (fl(0) * (sc & 15) as f32, -(fl(1) * (sc >> 4) as f32))
        }
        WFormat::F32 | WFormat::F16 => unreachable!("not a block format"),
    }
}

impl QTensor {
    pub fn blocks_per_row(&self) -> usize {
        self.cols / 32
    }

    fn q_words_per_row(&self) -> usize {
        self.blocks_per_row() * self.format.words_per_block()
    }

    fn s_words_per_row(&self) -> usize {
        self.format.scale_words_per_row(self.cols)
    }

    pub fn from_f32(rows: usize, cols: usize, data: &[f32]) -> Result<QTensor> {
        check_cols(cols, 32, "f32 tensor")?;
        if data.len() != rows * cols {
            bail!("f32 tensor: {} values for shape [{rows}, {cols}]", data.len());
        }
        Ok(QTensor { format: WFormat::F32, rows, cols, q: data.iter().map(|v| v.to_bits()).collect(), s: vec![] })
    }

    pub fn from_f16_bits(rows: usize, cols: usize, data: &[u16]) -> Result<QTensor> {
        check_cols(cols, 32, "f16 tensor")?;
        if data.len() != rows * cols {
            bail!("f16 tensor: {} values for shape [{rows}, {cols}]", data.len());
        }
        let q = data.chunks_exact(2).map(|p| p[0] as u32 | (p[1] as u32) << 16).collect();
        Ok(QTensor { format: WFormat::F16, rows, cols, q, s: vec![] })
    }

    pub fn from_f32_as_f16(rows: usize, cols: usize, data: &[f32]) -> Result<QTensor> {
        let bits: Vec<u16> = data.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
        Self::from_f16_bits(rows, cols, &bits)
    }

    pub fn from_bf16_bits_as_f16(rows: usize, cols: usize, data: &[u16]) -> Result<QTensor> {
        let bits: Vec<u16> = data.iter().map(|&b| f16::from_f32(bf16::from_bits(b).to_f32()).to_bits()).collect();
        Self::from_f16_bits(rows, cols, &bits)
    }

    /// Re-packs GGUF block data without changing any quantized value or scale, so that every
    /// kernel load is an aligned u32 (GGUF's Q6_K and Q3_K blocks are 210 and 110 bytes, Q5
    /// blocks keep their fifth bits in a separate field).
    ///
    /// Per 32-element block, `q` gets the codes as words; "part p" is elements 4p..4p+4 and
    /// 16+4p..16+4p+4, the order the matmul consumes:
    /// - nibble words (Q4_*, Q5_*, Q6_K: the low four bits): 4 words, word p byte i = element
    ///   4p+i | element 16+4p+i << 4 (GGUF's own Q4_0 order);
    /// - a bit word (Q5_*: fifth bit; Q3_K: third bit): byte p = part p's 8 bits;
    /// - two pair words (Q6_K: bits 4..6; Q3_K, Q2_K: bits 0..2): 16 bits per part.
    ///
    /// Words per block: Q8_0 8 (the signed bytes), Q4_0/Q4_1/Q4_K 4, Q5_0/Q5_1/Q5_K 5 (nibbles,
    /// bits), Q6_K 6 (nibbles, pairs), Q3_K 3 (pairs, bits), Q2_K 2 (pairs).
    ///
    /// `s` gets one scale record per GGUF block, f16 values widened to f32 bits: Q8_0, Q4_0,
    /// Q5_0: [d]; Q4_1, Q5_1: [d, m]; Q4_K, Q5_K: [d, dmin, 8 scales as bytes (2 words), 8 mins
    /// (2 words)], the 6-bit values unpacked from GGUF's 12-byte packing; Q6_K: [d, 16 signed
    /// scales as bytes]; Q3_K: the same, the 6-bit scales unpacked and stored minus 32; Q2_K:
    /// [d, dmin, GGUF's 16 scale/min bytes].
    pub fn from_gguf_blocks(format: WFormat, rows: usize, cols: usize, bytes: &[u8]) -> Result<QTensor> {
        let Some((block_elems, block_bytes)) = gguf_block(format) else {
            bail!("from_gguf_blocks: {format:?} is not a block format");
        };
        check_cols(cols, block_elems, &format!("{format:?} tensor"))?;
        let nblocks = rows * cols / block_elems;
        if bytes.len() != nblocks * block_bytes {
            bail!(
                "{} bytes of data for {nblocks} {format:?} blocks of shape [{rows}, {cols}] (expected {})",
                bytes.len(),
                nblocks * block_bytes
            );
        }
        let mut q = Vec::with_capacity(rows * cols / 32 * format.words_per_block());
        let mut s = Vec::with_capacity(rows * format.scale_words_per_row(cols));
        let mut codes = vec![0u8; block_elems];
        for b in bytes.chunks_exact(block_bytes) {
            decode_block(format, b, &mut codes, &mut s);
            for c in codes.chunks_exact(32) {
                pack_block(format, c, &mut q);
            }
        }
        Ok(QTensor { format, rows, cols, q, s })
    }

    /// Random GGUF blocks of `format` (random codes; finite f16 scales of random sign and
    /// magnitude 1e-3..0.1), for tests and benches of formats this crate cannot quantize to.
    pub fn random_gguf(format: WFormat, rows: usize, cols: usize, seed: u64) -> Result<QTensor> {
        let mut rng = XorShift64::new(seed);
        let mut unit = || rng.unit();
        match format {
            WFormat::F32 => {
                return Self::from_f32(rows, cols, &(0..rows * cols).map(|_| unit() * 2.0 - 1.0).collect::<Vec<_>>())
            }
            WFormat::F16 => {
                return Self::from_f32_as_f16(
                    rows,
                    cols,
                    &(0..rows * cols).map(|_| unit() * 2.0 - 1.0).collect::<Vec<_>>(),
                )
            }
            _ => {}
        }
        let (block_elems, block_bytes) = gguf_block(format).expect("a block format");
        check_cols(cols, block_elems, "random_gguf")?;
        let n = rows * cols / block_elems;
        let mut bytes: Vec<u8> = (0..n * block_bytes).map(|_| (unit() * 256.0) as u8).collect();
        for b in bytes.chunks_exact_mut(block_bytes) {
            for &o in gguf_scale_fields(format) {
                let mag = 1e-3 + unit() * 0.099;
                let v = if unit() < 0.5 { -mag } else { mag };
                b[o..o + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
            }
        }
        Self::from_gguf_blocks(format, rows, cols, &bytes)
    }

    /// Quantizes f32 data the way llama.cpp's reference quantizers do (tests and benches), for
    /// F32, F16, Q8_0, Q4_0 and Q4_1.
    pub fn quantize(format: WFormat, rows: usize, cols: usize, data: &[f32]) -> Result<QTensor> {
        match format {
            WFormat::F32 => return Self::from_f32(rows, cols, data),
            WFormat::F16 => return Self::from_f32_as_f16(rows, cols, data),
            WFormat::Q8_0 | WFormat::Q4_0 | WFormat::Q4_1 => {}
            f => bail!("quantize: {f:?} is not supported (use random_gguf)"),
        }
        check_cols(cols, 32, "quantize")?;
        let mut bytes = Vec::new();
        for blk in data.chunks_exact(32) {
            match format {
                WFormat::Q8_0 => {
                    let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let d = amax / 127.0;
                    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                    bytes.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                    bytes.extend(blk.iter().map(|v| (v * id).round() as i8 as u8));
                }
                WFormat::Q4_0 => {
                    let mut maxv = 0f32;
                    for &v in blk {
                        if v.abs() > maxv.abs() {
                            maxv = v;
                        }
                    }
                    let d = maxv / -8.0;
                    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                    bytes.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                    let qv = |v: f32| ((v * id + 8.5) as i32).clamp(0, 15) as u8;
                    bytes.extend((0..16).map(|j| qv(blk[j]) | qv(blk[j + 16]) << 4));
                }
                WFormat::Q4_1 => {
                    let mn = blk.iter().cloned().fold(f32::INFINITY, f32::min);
                    let mx = blk.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                    let d = (mx - mn) / 15.0;
                    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                    bytes.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                    bytes.extend_from_slice(&f16::from_f32(mn).to_le_bytes());
                    let qv = |v: f32| (((v - mn) * id + 0.5) as i32).clamp(0, 15) as u8;
                    bytes.extend((0..16).map(|j| qv(blk[j]) | qv(blk[j + 16]) << 4));
                }
                _ => unreachable!(),
            }
        }
        Self::from_gguf_blocks(format, rows, cols, &bytes)
    }

    /// CPU reference: row `r` dequantized, exactly as the GPU's wpart computes it (and as GGUF's
    /// reference dequantization does, bit for bit).
    pub fn dequant_row(&self, r: usize) -> Vec<f32> {
        let kb = self.blocks_per_row();
        let wpb = self.format.words_per_block();
        let mut out = Vec::with_capacity(self.cols);
        let (group, sw) = (self.format.scale_group(), self.format.scale_words());
        for b in 0..kb {
            let blk = r * kb + b;
            let words = &self.q[blk * wpb..(blk + 1) * wpb];
            match self.format {
                WFormat::F32 => out.extend(words.iter().map(|w| f32::from_bits(*w))),
                WFormat::F16 => {
                    for w in words {
                        out.push(f16::from_bits(*w as u16).to_f32());
                        out.push(f16::from_bits((*w >> 16) as u16).to_f32());
                    }
                }
                f => {
                    let rec = (blk * 32) / group;
                    let record = &self.s[rec * sw..(rec + 1) * sw];
                    let j = blk % (group / 32);
                    let codes = unpack_block(f, words);
                    for (e, &c) in codes.iter().enumerate() {
                        let (d, m) = half_scale(f, record, j, e / 16);
                        out.push(match affine(f) {
                            Affine::Offset(128) => c as u8 as i8 as f32 * d,
                            Affine::Offset(o) => (c as i32 - o) as f32 * d,
                            Affine::Min => c as f32 * d + m,
                        });
                    }
                }
            }
        }
        out
    }

    /// Rows [r0, r1) as their own tensor.
    pub fn slice_rows(&self, r0: usize, r1: usize) -> QTensor {
        let (wpr, spr) = (self.q_words_per_row(), self.s_words_per_row());
        QTensor {
            format: self.format,
            rows: r1 - r0,
            cols: self.cols,
            q: self.q[r0 * wpr..r1 * wpr].to_vec(),
            s: self.s[r0 * spr..r1 * spr].to_vec(),
        }
    }

    /// Stacks matrices of one format and width along rows.
    pub fn concat_rows(parts: &[&QTensor]) -> Result<QTensor> {
        let first = parts[0];
        let mut out = QTensor { format: first.format, rows: 0, cols: first.cols, q: vec![], s: vec![] };
        for p in parts {
            if p.format != first.format || p.cols != first.cols {
                bail!(
                    "cannot fuse tensors of format/width {:?}/{} and {:?}/{}",
                    first.format,
                    first.cols,
                    p.format,
                    p.cols
                );
            }
            out.rows += p.rows;
            out.q.extend_from_slice(&p.q);
            out.s.extend_from_slice(&p.s);
        }
        Ok(out)
    }

    /// Reorders rows: row i of the result is row `src[i]` of self.
    pub fn permute_rows(&self, src: &[usize]) -> QTensor {
        let (wpr, spr) = (self.q_words_per_row(), self.s_words_per_row());
        let mut q = Vec::with_capacity(src.len() * wpr);
        let mut s = Vec::with_capacity(src.len() * spr);
        for &r in src {
            q.extend_from_slice(&self.q[r * wpr..(r + 1) * wpr]);
            s.extend_from_slice(&self.s[r * spr..(r + 1) * spr]);
        }
        QTensor { format: self.format, rows: src.len(), cols: self.cols, q, s }
    }

    pub fn bytes(&self) -> usize {
        (self.q.len() + self.s.len()) * 4
    }
}

/// llama.cpp's converter permutes the q/k rows of llama-arch models for interleaved RoPE; this
/// gives, for each Hugging Face (rotate-half) row, the GGUF row that holds it.
pub fn unpermute_qk_rows(n_heads: usize, head_dim: usize) -> Vec<usize> {
    let half = head_dim / 2;
    let mut src = Vec::with_capacity(n_heads * head_dim);
    for h in 0..n_heads {
        for j in 0..2 {
            for i in 0..half {
                src.push(h * head_dim + 2 * i + j);
            }
        }
    }
    src
}

/// CPU reference matmul: y[t, n] = sum_k x[t, k] * w[n, k], in f64 accumulation.
pub fn matmul_ref(x: &[f32], m: usize, w: &QTensor) -> Vec<f32> {
    let k = w.cols;
    let mut y = vec![0f32; m * w.rows];
    for n in 0..w.rows {
        let row = w.dequant_row(n);
        for t in 0..m {
            let xs = &x[t * k..(t + 1) * k];
            y[t * w.rows + n] = xs.iter().zip(&row).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() as f32;
        }
    }
    y
}
