//! Host-side weight matrices in the GPU layout, with the CPU reference math the tests use.

use crate::gpu::kernels::WFormat;
use anyhow::{bail, Result};
use half::{bf16, f16};

/// A [rows, cols] weight matrix (row-major, cols = K contiguous) in GPU layout: `q` holds the
/// quant words of each 32-element block (rows * cols/32 * words_per_block), `s` the block
/// scales as f32 (converted exactly from GGUF's f16).
#[derive(Clone, Debug)]
pub struct QTensor {
    pub format: WFormat,
    pub rows: usize,
    pub cols: usize,
    pub q: Vec<u32>,
    pub s: Vec<f32>,
}

fn check_cols(cols: usize, what: &str) -> Result<()> {
    if cols == 0 || !cols.is_multiple_of(32) {
        bail!("{what}: row length {cols} is not a positive multiple of 32");
    }
    Ok(())
}

impl QTensor {
    pub fn blocks_per_row(&self) -> usize {
        self.cols / 32
    }

    pub fn from_f32(rows: usize, cols: usize, data: &[f32]) -> Result<QTensor> {
        check_cols(cols, "f32 tensor")?;
        if data.len() != rows * cols {
            bail!("f32 tensor: {} values for shape [{rows}, {cols}]", data.len());
        }
        Ok(QTensor { format: WFormat::F32, rows, cols, q: data.iter().map(|v| v.to_bits()).collect(), s: vec![] })
    }

    pub fn from_f16_bits(rows: usize, cols: usize, data: &[u16]) -> Result<QTensor> {
        check_cols(cols, "f16 tensor")?;
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

    /// Repacks GGUF block data (Q8_0: f16 d + 32 i8; Q4_0: f16 d + 16 bytes; Q4_1: f16 d, f16 m
    /// + 16 bytes) without changing any quantized value.
    pub fn from_gguf_blocks(format: WFormat, rows: usize, cols: usize, bytes: &[u8]) -> Result<QTensor> {
        check_cols(cols, "quantized tensor")?;
        let (block_bytes, head) = match format {
            WFormat::Q8_0 => (34, 2),
            WFormat::Q4_0 => (18, 2),
            WFormat::Q4_1 => (20, 4),
            _ => bail!("from_gguf_blocks: {format:?} is not a block format"),
        };
        let nblocks = rows * cols / 32;
        if bytes.len() != nblocks * block_bytes {
            bail!("{} bytes for {nblocks} blocks of {format:?}", bytes.len());
        }
        let mut q = Vec::with_capacity(nblocks * format.words_per_block());
        let mut s = Vec::with_capacity(nblocks * format.scales_per_block());
        for b in bytes.chunks_exact(block_bytes) {
            let h = |i: usize| f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32();
            s.push(h(0));
            if format == WFormat::Q4_1 {
                s.push(h(2));
            }
            for w in b[head..].chunks_exact(4) {
                q.push(u32::from_le_bytes([w[0], w[1], w[2], w[3]]));
            }
        }
        Ok(QTensor { format, rows, cols, q, s })
    }

    /// Quantizes f32 data the way llama.cpp's reference quantizers do (tests and benches).
    pub fn quantize(format: WFormat, rows: usize, cols: usize, data: &[f32]) -> Result<QTensor> {
        match format {
            WFormat::F32 => return Self::from_f32(rows, cols, data),
            WFormat::F16 => return Self::from_f32_as_f16(rows, cols, data),
            _ => {}
        }
        check_cols(cols, "quantize")?;
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

    /// CPU reference: row `r` dequantized, exactly as the GPU's wdeq computes it (up to f32 fma).
    pub fn dequant_row(&self, r: usize) -> Vec<f32> {
        let kb = self.blocks_per_row();
        let wpb = self.format.words_per_block();
        let spb = self.format.scales_per_block();
        let mut out = Vec::with_capacity(self.cols);
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
                WFormat::Q8_0 => {
                    let d = self.s[blk];
                    for w in words {
                        out.extend(w.to_le_bytes().iter().map(|&b| b as i8 as f32 * d));
                    }
                }
                WFormat::Q4_0 | WFormat::Q4_1 => {
                    let (d, m) = if self.format == WFormat::Q4_1 {
                        (self.s[blk * spb], self.s[blk * spb + 1])
                    } else {
                        (self.s[blk], -8.0 * self.s[blk])
                    };
                    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
                    out.extend(bytes.iter().map(|&b| (b & 15) as f32 * d + m));
                    out.extend(bytes.iter().map(|&b| (b >> 4) as f32 * d + m));
                }
            }
        }
        out
    }

    /// Rows [r0, r1) as their own tensor.
    pub fn slice_rows(&self, r0: usize, r1: usize) -> QTensor {
        let wpr = self.blocks_per_row() * self.format.words_per_block();
        let spr = self.blocks_per_row() * self.format.scales_per_block();
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
        let wpr = self.blocks_per_row() * self.format.words_per_block();
        let spr = self.blocks_per_row() * self.format.scales_per_block();
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
