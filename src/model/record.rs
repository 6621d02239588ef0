//! Recording a step's ops into command buffers. The cpu profile records one compute pass in one
//! command buffer (on lavapipe every extra pass slows later submits). The gpu profile cuts the
//! step into a few command buffers and submits each as soon as it is recorded, so the GPU starts
//! while the rest is recorded, and no single submit nears the 2 s GPU watchdogs of Windows and
//! macOS: a new buffer starts when the work recorded since the last cut reaches a quarter of the
//! step, or SUBMIT_BUDGET_S on a slow GPU (the ops' cost model at SLOW_GPU_GB_S and
//! SLOW_GPU_GFLOP_S), whichever comes first. One op is never split (a larger step is already
//! cut into sub-steps by the binding limits).

use crate::gpu::Gpu;
use crate::ops::{Op, Recorder, StepShape};

/// A slow GPU for the watchdog budget: an integrated GPU of a few years ago.
pub const SLOW_GPU_GB_S: f64 = 30.0;
pub const SLOW_GPU_GFLOP_S: f64 = 400.0;
/// Most estimated seconds (on that GPU) one command buffer may hold, far below a 2 s watchdog.
pub const SUBMIT_BUDGET_S: f64 = 0.2;
/// Command buffers a step is cut into at least (when it has that many ops).
pub const SUBMITS_PER_STEP: usize = 4;

/// The op indices where a new command buffer starts, from the ops' estimated seconds: after the
/// op that brings the buffer's total to a quarter of the step or to SUBMIT_BUDGET_S.
pub fn submit_cuts(est_s: &[f64]) -> Vec<usize> {
    let total: f64 = est_s.iter().sum();
    let target = (total / SUBMITS_PER_STEP as f64).min(SUBMIT_BUDGET_S);
    let mut cuts = Vec::new();
    let mut acc = 0.0;
    for (i, &e) in est_s.iter().enumerate() {
        acc += e;
        if acc >= target && target > 0.0 && i + 1 < est_s.len() {
            cuts.push(i + 1);
            acc = 0.0;
        }
    }
    cuts
}

/// Records `ops` for a step of shape `s`; with `split` (the gpu profile), in several command
/// buffers, all but the last submitted here. Returns the last encoder, for the caller's copies
/// and submit.
pub(crate) fn record_step(g: &Gpu, rec: &Recorder, ops: &[Op], s: &StepShape, split: bool) -> wgpu::CommandEncoder {
    let cuts = if split {
        let kv_bytes = rec.kernels.kv.bytes() as u64;
        let est: Vec<f64> =
            ops.iter().map(|op| op.kind.cost(s, kv_bytes).seconds_at(SLOW_GPU_GB_S, SLOW_GPU_GFLOP_S)).collect();
        submit_cuts(&est)
    } else {
        vec![]
    };
    let mut start = 0;
    for end in cuts.into_iter().chain([ops.len()]) {
        let t = std::time::Instant::now();
        let mut enc = g.device.create_command_encoder(&Default::default());
        let mut n = 0;
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            for op in &ops[start..end] {
                op.dispatches(rec, s, |d| {
                    d.record(&mut pass);
                    n += 1;
                });
            }
        }
        g.counters.pass(n, t);
        if end == ops.len() {
            return enc;
        }
        g.submit(enc);
        start = end;
    }
    unreachable!("the last range ends at ops.len()")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_give_about_four_buffers_and_respect_the_budget() {
        // 40 equal small ops (exact binary fractions): a cut every 10.
        assert_eq!(submit_cuts(&[1.0 / 1024.0; 40]), vec![10, 20, 30]);
        // A large step on a slow GPU: a cut whenever 0.2 s is reached (after 4 ops of 0.06 s).
        let cuts = submit_cuts(&[0.06; 40]);
        assert_eq!(cuts, (1..10).map(|i| 4 * i).collect::<Vec<_>>());
        // One op above the budget ends its buffer; no empty buffer at the end.
        assert_eq!(submit_cuts(&[0.01, 3.0, 0.01]), vec![2]);
        assert_eq!(submit_cuts(&[0.0, 0.0]), Vec::<usize>::new());
        assert_eq!(submit_cuts(&[]), Vec::<usize>::new());
    }
}
