//! MXFP4 as Hugging Face checkpoints store it (gpt-oss's `*_blocks` / `*_scales`), turned into
//! GGUF's MXFP4 blocks.
//!
//! Hugging Face: per row, `cols / 32` blocks of 16 bytes, byte i holding element 2i in its low
//! nibble and element 2i + 1 in its high one; the scales a separate byte per block (e8m0, bias
//! 127). GGUF: per block the scale byte, then 16 bytes with element j in the low nibble of byte j
//! and element j + 16 in its high nibble.

use anyhow::{bail, Result};

/// `rows` rows of `cols` elements: `blocks` (rows * cols / 2 bytes) and `scales` (rows * cols /
/// 32 bytes) in Hugging Face's order, as GGUF MXFP4 bytes (rows * cols / 32 * 17), rows taken in
/// the order `order` gives (None: as stored).
pub fn gguf_bytes(blocks: &[u8], scales: &[u8], rows: usize, cols: usize, order: Option<&[usize]>) -> Result<Vec<u8>> {
    if cols == 0 || !cols.is_multiple_of(32) {
        bail!("MXFP4 rows of {cols} elements (a multiple of 32 is needed)");
    }
    let per_row = cols / 32;
    if blocks.len() != rows * per_row * 16 || scales.len() != rows * per_row {
        bail!(
            "MXFP4 data of {} block bytes and {} scales for [{rows}, {cols}] (expected {} and {})",
            blocks.len(),
            scales.len(),
            rows * per_row * 16,
            rows * per_row
        );
    }
    let mut out = Vec::with_capacity(rows * per_row * 17);
    for i in 0..rows {
        let r = order.map_or(i, |o| o[i]);
        if r >= rows {
            bail!("MXFP4 row order names row {r} of {rows}");
        }
        for g in r * per_row..(r + 1) * per_row {
            let b = &blocks[g * 16..(g + 1) * 16];
            let code = |k: usize| if k.is_multiple_of(2) { b[k / 2] & 0x0f } else { b[k / 2] >> 4 };
            out.push(scales[g]);
            out.extend((0..16).map(|j| code(j) | (code(j + 16) << 4)));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn element_order_and_rows() {
        // One row of 32 elements: element k holds code k % 16.
        let blocks: Vec<u8> = (0..16u8).map(|i| ((2 * i) % 16) | (((2 * i + 1) % 16) << 4)).collect();
        let out = gguf_bytes(&blocks, &[130], 1, 32, None).unwrap();
        assert_eq!(out[0], 130);
        // GGUF byte j: element j (code j) low, element j + 16 (code j) high.
        for j in 0..16u8 {
            assert_eq!(out[1 + j as usize], j | (j << 4), "byte {j}");
        }
        // Two rows swapped by the order.
        let two = [blocks.clone(), vec![0x21; 16]].concat();
        let out = gguf_bytes(&two, &[1, 2], 2, 32, Some(&[1, 0])).unwrap();
        assert_eq!(out[0], 2);
        assert_eq!(out[1], 0x11);
        assert_eq!(out[17], 1);
        assert!(gguf_bytes(&two, &[1], 2, 32, None).is_err());
        assert!(gguf_bytes(&two, &[1, 2], 2, 32, Some(&[2, 0])).is_err());
        assert!(gguf_bytes(&[], &[], 1, 16, None).is_err());
    }
}
