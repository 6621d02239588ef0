//! GGUF's ternary types TQ1_0 and TQ2_0 (BitNet-style models): 256-element blocks of codes q in
//! 0..3 (TQ1_0: 0..2, five base-3 digits per byte) and one f16 d, value d * (q - 1). They are
//! re-written at load as Q2_K blocks of the same codes with every sub-block scale and min 1 and
//! dmin = d, so that Q2_K's `d * q - d` is the same value (exact in f32: q <= 3), and the Q2_K
//! kernels serve them (2.6 bits per weight on the GPU; TQ2_0 files have 2.06, TQ1_0 1.69).

use super::blocks::f16_at;
use anyhow::{bail, Result};

/// The ternary types.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ternary {
    TQ1_0,
    TQ2_0,
}

impl Ternary {
    /// Bytes of one 256-element block in the file.
    pub fn block_bytes(self) -> usize {
        match self {
            Ternary::TQ1_0 => 54,
            Ternary::TQ2_0 => 66,
        }
    }
}

/// TQ1_0's base-3 digit k (0..5) of byte b: ggml's ((b * 3^k mod 256) * 3) >> 8.
fn trit(b: u8, k: u32) -> u8 {
    ((b.wrapping_mul(3u8.pow(k)) as u16 * 3) >> 8) as u8
}

/// The 256 codes of one block, in element order.
fn codes(t: Ternary, b: &[u8]) -> [u8; 256] {
    let mut c = [0u8; 256];
    match t {
        Ternary::TQ2_0 => {
            // Element 128 n + 32 l + m: bits 2l..2l+2 of qs[32 n + m].
            for (e, v) in c.iter_mut().enumerate() {
                let (n, l, m) = (e / 128, e % 128 / 32, e % 32);
                *v = (b[32 * n + m] >> (2 * l)) & 3;
            }
        }
        Ternary::TQ1_0 => {
            // qs[0..32]: elements 32 k + m (digit k of byte m); qs[32..48]: 160 + 16 k + m;
            // qh[0..4] (bytes 48..52): 240 + 4 k + m, four digits each.
            for k in 0..5 {
                for m in 0..32 {
                    c[32 * k + m] = trit(b[m], k as u32);
                }
                for m in 0..16 {
                    c[160 + 16 * k + m] = trit(b[32 + m], k as u32);
                }
            }
            for k in 0..4 {
                for m in 0..4 {
                    c[240 + 4 * k + m] = trit(b[48 + m], k as u32);
                }
            }
        }
    }
    c
}

/// A ternary tensor's blocks as Q2_K blocks (84 bytes: scales[16], qs[64], d, dmin).
pub fn to_q2_k(t: Ternary, bytes: &[u8]) -> Result<Vec<u8>> {
    let bb = t.block_bytes();
    if !bytes.len().is_multiple_of(bb) {
        bail!("{} bytes of data is not a whole number of {t:?} blocks ({bb} bytes each)", bytes.len());
    }
    let mut out = Vec::with_capacity(bytes.len() / bb * 84);
    for b in bytes.chunks_exact(bb) {
        let c = codes(t, b);
        let d = f16_at(b, bb - 2);
        out.extend([0x11u8; 16]);
        // Q2_K's layout: element 128 n + 32 j + l in bits 2j..2j+2 of qs[32 n + l].
        for n in 0..2 {
            for l in 0..32 {
                out.push((0..4).map(|j| c[128 * n + 32 * j + l] << (2 * j)).sum());
            }
        }
        let dh = half::f16::from_f32(d).to_le_bytes();
        out.extend(dh);
        out.extend(dh);
    }
    Ok(out)
}
