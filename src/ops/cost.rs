//! What each op moves and computes in a step: bytes (every input read once, every output written
//! once: the least memory traffic the op can have) and floating-point operations. The per-kernel
//! profile divides them by the measured time (achieved GB/s and GFLOP/s), and the forward step
//! sizes its command buffers with them.

use super::{OpKind, StepShape};

/// Bytes moved and floating-point operations of one op in one step.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Cost {
    pub bytes: u64,
    pub flops: u64,
}

impl std::ops::AddAssign for Cost {
    fn add_assign(&mut self, o: Cost) {
        self.bytes += o.bytes;
        self.flops += o.flops;
    }
}

impl Cost {
    /// Seconds this would take at `gb_s` GB/s and `gflop_s` GFLOP/s, whichever bounds it.
    pub fn seconds_at(&self, gb_s: f64, gflop_s: f64) -> f64 {
        (self.bytes as f64 / (gb_s * 1e9)).max(self.flops as f64 / (gflop_s * 1e9))
    }
}

impl OpKind {
    /// The kernel family: what the per-kernel profile groups by when a recipe gave no role.
    pub fn family(&self) -> &'static str {
        match self {
            OpKind::Embed { .. } => "embed",
            OpKind::Matmul { .. } => "matmul",
            OpKind::QuantizeX8 { .. } => "quantize_x8",
            OpKind::Norm { .. } => "rmsnorm",
            OpKind::HeadNorm { .. } => "head_norm",
            OpKind::PleGate { .. } => "ple_gate",
            OpKind::RopeKv { .. } => "rope_kv",
            OpKind::Attention { .. } => "attention",
            OpKind::MoeRoute { .. } => "moe_route",
            OpKind::MoeGroup { .. } => "moe_group",
            OpKind::MoeCombine { .. } => "moe_combine",
            OpKind::MoeSharedGate { .. } => "moe_shared_gate",
            OpKind::MoeExperts { down: false, .. } => "moe_gate_up",
            OpKind::MoeExperts { down: true, .. } => "moe_down",
            OpKind::Delta { stage, .. } => stage.label(),
            OpKind::LogitAdjust { .. } => "logit_adjust",
            OpKind::Sample { .. } => "sample",
        }
    }

    /// This op's bytes and FLOPs in a step of shape `s` (`kv_bytes`: bytes per KV-cache
    /// element). Activations are f32.
    pub fn cost(&self, s: &StepShape, kv_bytes: u64) -> Cost {
        let (n, ns) = (s.n_tokens as u64, s.n_sample as u64);
        match *self {
            OpKind::Embed { format, k_blocks } => {
                let k = k_blocks as u64 * 32;
                Cost { bytes: n * (format.row_bytes(k as usize) as u64 + 4 * k), flops: n * k }
            }
            OpKind::Matmul { format, rows, x_vec4, sampled, swiglu } => {
                let m = if sampled { ns } else { n };
                if m == 0 {
                    return Cost::default();
                }
                let k = x_vec4 as u64 * 4;
                // SwiGLU chunks hold gate and up rows and write one output per pair.
                let (w_rows, outs) = if swiglu { (2 * rows as u64, rows as u64) } else { (rows as u64, rows as u64) };
                let weights = w_rows * format.row_bytes(k as usize) as u64;
                Cost { bytes: weights + 4 * m * k + 4 * m * outs, flops: 2 * m * w_rows * k }
            }
            OpKind::QuantizeX8 { k_blocks, sampled, .. } => {
                // Runs in one-token steps only (INT8_MAX_ROWS): reads f32 x, writes 48 bytes per block.
                let m = if sampled { ns } else { n };
                if m != 1 {
                    return Cost::default();
                }
                Cost { bytes: k_blocks as u64 * (128 + 48), flops: k_blocks as u64 * 32 * 3 }
            }
            OpKind::Norm { sampled, dim } => {
                let m = if sampled { ns } else { n };
                Cost { bytes: 8 * m * dim as u64 + 4 * dim as u64, flops: 4 * m * dim as u64 }
            }
            OpKind::HeadNorm { heads, head_dim } => {
                let e = n * heads as u64 * head_dim as u64;
                Cost { bytes: 8 * e + 8 * head_dim as u64, flops: 4 * e }
            }
            OpKind::RopeKv { threads } => {
                // Each thread reads 4 floats (two rotated pairs) and writes 4 values; the K and V
                // thirds go to the cache.
                let e = 4 * n * threads as u64;
                Cost { bytes: 4 * e + (4 + kv_bytes) * e / 2, flops: 3 * e }
            }
            OpKind::Attention { heads, kv_heads, hd4 } => {
                let hd = 4 * hd4 as u64;
                // The tiled kernel reads a tile's keys once for its tokens.
                let kv = 2 * s.attn_keys * kv_heads as u64 * hd * kv_bytes / s.attn_tile.max(1) as u64;
                Cost { bytes: kv + 2 * 4 * n * heads as u64 * hd, flops: 4 * s.attn_keys * heads as u64 * hd }
            }
            // The router reads each token's logits and writes 2 words per choice.
            OpKind::MoeRoute { experts } => Cost { bytes: 4 * n * experts as u64, flops: 4 * n * experts as u64 },
            OpKind::MoeGroup { top_k, .. } => Cost { bytes: 16 * n * top_k as u64, flops: 0 },
            OpKind::MoeCombine { hidden } => Cost { bytes: 4 * n * hidden as u64 * 3, flops: 2 * n * hidden as u64 },
            OpKind::MoeSharedGate { width } => Cost { bytes: 8 * n * width as u64, flops: 4 * n * width as u64 },
            OpKind::PleGate { width } => Cost { bytes: 12 * n * width as u64, flops: 12 * n * width as u64 },
            OpKind::MoeExperts { format, n_out, top_k, down, cols, chunk_experts, experts } => {
                // The (token, choice) pairs routed to this chunk if routing is even, and the
                // experts they touch at most (all distinct); each touched expert's rows are
                // read once.
                let (k, ce) = (cols as u64, chunk_experts as u64);
                let pairs = (n * top_k as u64 * ce).div_ceil(experts.max(1) as u64);
                let rows = if down { n_out as u64 } else { 2 * n_out as u64 };
                let weights = pairs.min(ce) * rows * format.row_bytes(k as usize) as u64;
                let outs = pairs * n_out as u64;
                Cost { bytes: weights + 4 * pairs * k + 4 * outs, flops: 2 * pairs * rows * k }
            }
            OpKind::Delta { stage, per } => {
                use super::delta::DeltaStage;
                let per = per as u64;
                match stage {
                    // Each channel's taps and state read and written once, its inputs in place.
                    DeltaStage::Conv => Cost { bytes: 8 * n * per + 16 * per, flops: 8 * n * per },
                    // The recurrence: a workgroup's 64 columns of state read and written once
                    // per step; q, k read per column per token (the FLOPs: 4 per state element
                    // and token, 64 k_dim-long columns per workgroup, k_dim unknown here: the
                    // state traffic is the bound that matters).
                    DeltaStage::Recur => Cost { bytes: 2 * 4 * 64 * 128 * s.n_seqs as u64 * per, flops: 0 },
                    // Per token and value head: its rows of the two chunk matrices written, v
                    // read and written; the q.k and k.k products of its chunk (k_dim unknown
                    // here: 128).
                    DeltaStage::Chunk => {
                        let c = super::delta::CHUNK as u64;
                        Cost { bytes: n * per * (8 * c + 8 * 128), flops: n * per * c * 4 * 128 }
                    }
                    // Per token and workgroup (CHUNK_COLS columns): q and k read, its chunk rows
                    // read; the state block read and written once per sequence; 6 FLOPs per
                    // state element and token, the chunk matrices' products (k_dim: 128).
                    DeltaStage::ChunkState => {
                        let (c, cols) = (super::delta::CHUNK as u64, super::delta::CHUNK_COLS as u64);
                        Cost {
                            bytes: n * per * (8 * 128 + 8 * c) + 8 * 128 * cols * s.n_seqs as u64 * per,
                            flops: n * per * cols * (6 * 128 + 2 * c),
                        }
                    }
                    _ => Cost { bytes: 8 * n * per, flops: 4 * n * per },
                }
            }
            OpKind::LogitAdjust { vocab } if s.any_adjust => {
                Cost { bytes: 8 * ns * vocab as u64, flops: ns * vocab as u64 }
            }
            OpKind::LogitAdjust { .. } => Cost::default(),
            OpKind::Sample { vocab } => Cost { bytes: 4 * ns * vocab as u64, flops: 4 * ns * vocab as u64 },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::WFormat;

    #[test]
    fn matmul_cost_counts_weights_once_and_two_flops_per_weight_and_row() {
        let s = StepShape { n_tokens: 3, n_sample: 1, ..Default::default() };
        // Q4_K as re-packed: 4 quant words per 32 elements and 6 scale words per 256: 152 bytes
        // per 256.
        let kind = OpKind::Matmul { format: WFormat::Q4_K, rows: 10, x_vec4: 64, sampled: false, swiglu: false };
        let c = kind.cost(&s, 2);
        assert_eq!(c.bytes, 10 * 152 + 4 * 3 * 256 + 4 * 3 * 10);
        assert_eq!(c.flops, 2 * 3 * 10 * 256);
        // SwiGLU: gate and up rows read, half as many outputs; over the sampled rows.
        let kind = OpKind::Matmul { format: WFormat::F16, rows: 10, x_vec4: 8, sampled: true, swiglu: true };
        let c = kind.cost(&s, 2);
        assert_eq!(c.bytes, 20 * 64 + 4 * 32 + 4 * 10);
        assert_eq!(c.flops, 2 * 20 * 32);
        let att = OpKind::Attention { heads: 4, kv_heads: 2, hd4: 16 };
        let s = StepShape { n_tokens: 2, attn_keys: 30, ..Default::default() };
        assert_eq!(att.cost(&s, 2).bytes, 2 * 30 * 2 * 64 * 2 + 8 * 2 * 4 * 64);
        // Query tiles of 2 tokens read their keys once.
        let s = StepShape { attn_tile: 2, ..s };
        assert_eq!(att.cost(&s, 2).bytes, 30 * 2 * 64 * 2 + 8 * 2 * 4 * 64);
        assert_eq!(Cost { bytes: 2_000_000_000, flops: 1 }.seconds_at(1000.0, 1.0), 2e-3);
    }
}
