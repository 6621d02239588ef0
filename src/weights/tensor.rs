//! Host-side weight matrices in the GPU layout, with the CPU reference math the tests use.

use super::blocks::{affine, decode_block, gguf_scale_fields, half_scale, pack_block, unpack_block, Affine};
pub use super::blocks::{fill_centered_block, gguf_block};
use super::grids;
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
        if format.is_grid() {
            for b in bytes.chunks_exact(block_bytes) {
                grids::repack_block(format, b, &mut q, &mut s);
            }
            return Ok(QTensor { format, rows, cols, q, s });
        }
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
            if format == WFormat::MXFP4 {
                // An e8m0 scale of 2^-10..2^-4 (values up to 12 times half of it).
                b[0] = 118 + (unit() * 7.0) as u8;
            }
            for &o in gguf_scale_fields(format) {
                let mag = 1e-3 + unit() * 0.099;
                let v = if unit() < 0.5 { -mag } else { mag };
                b[o..o + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
            }
            if format == WFormat::IQ1_M {
                grids::set_iq1m_d(b, 1e-3 + unit() * 0.099);
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
                f if f.is_grid() => {
                    let rec = (blk * 32) / group;
                    out.extend(grids::dequant_block(f, words, &self.s[rec * sw..(rec + 1) * sw], blk % 8));
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
                            Affine::Table(t) => d * t[c as usize] as f32,
                        });
                    }
                }
            }
        }
        out
    }

    /// The words of rows [r0, r1): (quantized data, scale records), borrowed.
    pub fn row_words(&self, r0: usize, r1: usize) -> (&[u32], &[u32]) {
        let (wpr, spr) = (self.q_words_per_row(), self.s_words_per_row());
        (&self.q[r0 * wpr..r1 * wpr], &self.s[r0 * spr..r1 * spr])
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
