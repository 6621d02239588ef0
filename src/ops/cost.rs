//! What each op moves and computes in a step: bytes (every input read once, every output written
//! once: the least memory traffic the op can have) and floating-point operations, each family's
//! from its own file (its op kind's `FamilyOp::cost`). The per-kernel
//! profile divides them by the measured time (achieved GB/s and GFLOP/s), and the forward step
//! sizes its command buffers with them.

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::WFormat;
    use crate::ops::attention::AttentionOp;
    use crate::ops::matmul::MatmulOp;
    use crate::ops::{OpKind, StepShape};

    #[test]
    fn matmul_cost_counts_weights_once_and_two_flops_per_weight_and_row() {
        let s = StepShape { n_tokens: 3, n_sample: 1, ..Default::default() };
        // Q4_K as re-packed: 4 quant words per 32 elements and 6 scale words per 256: 152 bytes
        // per 256.
        let kind = OpKind::from(MatmulOp::Matmul {
            format: WFormat::Q4_K,
            rows: 10,
            x_vec4: 64,
            sampled: false,
            swiglu: false,
        });
        let c = kind.cost(&s, 2);
        assert_eq!(c.bytes, 10 * 152 + 4 * 3 * 256 + 4 * 3 * 10);
        assert_eq!(c.flops, 2 * 3 * 10 * 256);
        // SwiGLU: gate and up rows read, half as many outputs; over the sampled rows.
        let kind =
            OpKind::from(MatmulOp::Matmul { format: WFormat::F16, rows: 10, x_vec4: 8, sampled: true, swiglu: true });
        let c = kind.cost(&s, 2);
        assert_eq!(c.bytes, 20 * 64 + 4 * 32 + 4 * 10);
        assert_eq!(c.flops, 2 * 20 * 32);
        let att = OpKind::from(AttentionOp { heads: 4, kv_heads: 2, hd4: 16 });
        let s = StepShape { n_tokens: 2, attn_keys: 30, ..Default::default() };
        assert_eq!(att.cost(&s, 2).bytes, 2 * 30 * 2 * 64 * 2 + 8 * 2 * 4 * 64);
        // Query tiles of 2 tokens read their keys once.
        let s = StepShape { attn_tile: 2, ..s };
        assert_eq!(att.cost(&s, 2).bytes, 30 * 2 * 64 * 2 + 8 * 2 * 4 * 64);
        assert_eq!(Cost { bytes: 2_000_000_000, flops: 1 }.seconds_at(1000.0, 1.0), 2e-3);
    }
}
