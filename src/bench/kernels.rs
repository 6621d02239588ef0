//! `bench-model --profile-kernels`: where a step's GPU time goes. For each measured shape (decode
//! at each batch size, the prefill) a few steps run with the model's per-kernel profile on
//! (model/profile.rs: GPU timestamps around every op), and the time, dispatches, bytes and FLOPs
//! are reported per op label with the achieved GB/s and GFLOP/s (bytes and FLOPs from the ops'
//! cost model: each input read once, each output written once).

use crate::model::profile::StepProfile;
use serde::Serialize;

/// One op label's share of a profiled step.
#[derive(Clone, Debug, Serialize)]
pub struct OpRow {
    pub label: String,
    pub family: String,
    pub ops_per_step: u64,
    pub dispatches_per_step: f64,
    pub ms_per_step: f64,
    /// Of the step's summed op time.
    pub share: f64,
    pub bytes_per_step: f64,
    pub flops_per_step: f64,
    pub gb_s: f64,
    pub gflop_s: f64,
}

/// The profile of one shape.
#[derive(Clone, Debug, Serialize)]
pub struct KernelProfileRun {
    /// `decode` or `prefill`.
    pub kind: String,
    /// Sequences (decode) or prompt tokens (prefill).
    pub size: usize,
    pub steps: usize,
    /// How ops were timed.
    pub method: String,
    /// Wall time per profiled step (timestamps included).
    pub wall_ms_per_step: f64,
    /// The ops' summed time per step.
    pub gpu_ms_per_step: f64,
    pub dispatches_per_step: f64,
    pub bytes_per_step: f64,
    pub flops_per_step: f64,
    pub ops: Vec<OpRow>,
}

impl KernelProfileRun {
    pub fn new(kind: &str, size: usize, p: &StepProfile, wall_s: f64) -> KernelProfileRun {
        let steps = p.steps.max(1) as f64;
        let total = p.seconds().max(1e-12);
        let ops: Vec<OpRow> = p
            .totals
            .iter()
            .map(|t| {
                let s = t.seconds.max(1e-12);
                OpRow {
                    label: t.label.clone(),
                    family: t.family.clone(),
                    ops_per_step: t.ops,
                    dispatches_per_step: t.dispatches as f64 / steps,
                    ms_per_step: t.seconds * 1e3 / steps,
                    share: t.seconds / total,
                    bytes_per_step: t.bytes as f64 / steps,
                    flops_per_step: t.flops as f64 / steps,
                    gb_s: t.bytes as f64 / s / 1e9,
                    gflop_s: t.flops as f64 / s / 1e9,
                }
            })
            .collect();
        KernelProfileRun {
            kind: kind.to_string(),
            size,
            steps: p.steps,
            method: p.method.clone(),
            wall_ms_per_step: wall_s * 1e3 / steps,
            gpu_ms_per_step: total * 1e3 / steps,
            dispatches_per_step: ops.iter().map(|o| o.dispatches_per_step).sum(),
            bytes_per_step: ops.iter().map(|o| o.bytes_per_step).sum(),
            flops_per_step: ops.iter().map(|o| o.flops_per_step).sum(),
            ops,
        }
    }
}

/// The runs as readable tables.
pub fn format_runs(runs: &[KernelProfileRun]) -> String {
    let mut t = String::new();
    for r in runs {
        let what = match r.kind.as_str() {
            "decode" => format!("decode, batch {}", r.size),
            _ => format!("prefill, {} tokens", r.size),
        };
        t.push_str(&format!(
            "kernel profile: {what} ({} steps, {}): {:.3} ms/step in ops, {:.3} ms/step wall, {:.0} dispatches, \
             {:.1} MB, {:.2} GFLOP per step\n",
            r.steps,
            r.method,
            r.gpu_ms_per_step,
            r.wall_ms_per_step,
            r.dispatches_per_step,
            r.bytes_per_step / 1e6,
            r.flops_per_step / 1e9
        ));
        t.push_str(&format!(
            "  {:<13} {:<12} {:>5} {:>6} {:>10} {:>7} {:>10} {:>9} {:>10} {:>9}\n",
            "op", "family", "ops", "disp", "ms/step", "share", "MB/step", "GB/s", "MFLOP/st", "GFLOP/s"
        ));
        for o in &r.ops {
            t.push_str(&format!(
                "  {:<13} {:<12} {:>5} {:>6.0} {:>10.4} {:>6.1}% {:>10.3} {:>9.2} {:>10.2} {:>9.2}\n",
                o.label,
                o.family,
                o.ops_per_step,
                o.dispatches_per_step,
                o.ms_per_step,
                o.share * 100.0,
                o.bytes_per_step / 1e6,
                o.gb_s,
                o.flops_per_step / 1e6,
                o.gflop_s
            ));
        }
    }
    t
}
