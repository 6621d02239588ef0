//! The CPU reference of the mixture-of-experts block: the router's choice and weights, and the
//! block's output (the kernel tests and the harness compare the GPU's with them).

use super::MoeSpec;
use crate::weights::tensor::{matmul_ref, QTensor};

/// The experts and weights the router gives one token's logits: the top_k largest (lowest
/// index first among equals), weighted by softmax over all logits, renormalised with `norm`.
pub fn route_ref(logits: &[f32], top_k: usize, norm: bool) -> Vec<(usize, f32)> {
    let mx = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let z: f64 = logits.iter().map(|&l| ((l - mx) as f64).exp()).sum();
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    let mut out: Vec<(usize, f32)> =
        idx[..top_k].iter().map(|&e| (e, (((logits[e] - mx) as f64).exp() / z) as f32)).collect();
    if norm {
        let s: f32 = out.iter().map(|x| x.1).sum();
        out.iter_mut().for_each(|x| x.1 /= s);
    }
    out
}

/// The MoE block's output for `t` rows of `x` (to be added into the residual), on the CPU:
/// router (with its bias), top-k, each chosen expert's gated FFN, the weighted sum. `gate_up`:
/// [experts * 2 * ffn, hidden] (each expert's gate rows then up rows); `down`: [experts *
/// hidden, ffn]; biases per expert in the same row order.
#[allow(clippy::too_many_arguments)]
pub fn moe_ref(
    spec: &MoeSpec,
    x: &[f32],
    t: usize,
    router: &QTensor,
    router_bias: Option<&[f32]>,
    gate_up: &QTensor,
    down: &QTensor,
    biases: Option<(&[f32], &[f32])>,
) -> Vec<f32> {
    let (h, f) = (router.cols, spec.ffn);
    let mut logits = matmul_ref(x, t, router);
    if let Some(b) = router_bias {
        logits.chunks_mut(spec.experts).for_each(|r| r.iter_mut().zip(b).for_each(|(l, b)| *l += b));
    }
    let mut y = vec![0f32; t * h];
    for i in 0..t {
        let xi = &x[i * h..(i + 1) * h];
        for (e, w) in route_ref(&logits[i * spec.experts..(i + 1) * spec.experts], spec.top_k, spec.norm) {
            let dot = |m: &QTensor, r: usize, v: &[f32]| -> f32 {
                m.dequant_row(r).iter().zip(v).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() as f32
            };
            let act: Vec<f32> = (0..f)
                .map(|n| {
                    let (mut g, mut u) = (dot(gate_up, e * 2 * f + n, xi), dot(gate_up, e * 2 * f + f + n, xi));
                    if let Some((bgu, _)) = biases {
                        g += bgu[e * 2 * f + n];
                        u += bgu[e * 2 * f + f + n];
                    }
                    match spec.clamped {
                        Some((alpha, limit)) => {
                            let (g, u) = (g.min(limit), u.clamp(-limit, limit));
                            g / (1.0 + (-alpha * g).exp()) * (u + 1.0)
                        }
                        None if spec.gelu => gelu_tanh(g) * u,
                        None => g / (1.0 + (-g).exp()) * u,
                    }
                })
                .collect();
            for n in 0..h {
                let mut d = dot(down, e * h + n, &act);
                if let Some((_, bd)) = biases {
                    d += bd[e * h + n];
                }
                y[i * h + n] += w * d;
            }
        }
    }
    y
}

fn gelu_tanh(x: f32) -> f32 {
    let c = (2.0f32 / std::f32::consts::PI).sqrt();
    0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
}
