//! The GEMM tuner: for one weight format, times every kernel the device can build (the decode
//! kernel, the tiled variants, cooperative matrices) at the step sizes a plan tells apart, on the
//! model's own matmul shapes, and chooses the format's GemmPlan: the fastest GEMM for prefill-sized
//! steps, the fastest for batched-decode-sized ones, and the fewest rows from which GEMMs beat the
//! decode kernel. A kernel is timed only after its output matched the decode kernel's on the same
//! input (a variant a driver miscompiles is never chosen), within a time budget (what was not
//! measured in time is not chosen; the default stands where nothing was). `torus-wgpu tune`
//! (bench/tune.rs) runs it and keeps the plans in gpu::tune_cache.

use super::harness::Harness;
use super::harness_moe::MoeWeights;
use super::matmul::gemm::{GemmKernel, GemmPlan, LARGE_ROWS};
use super::moe::{MoeSpec, MOE_GROUPED, MOE_TILED};
use crate::weights::tensor::QTensor;
use anyhow::{anyhow, Result};
use std::time::{Duration, Instant};

/// Step sizes measured, most telling first (the budget may end the list): a prefill, then
/// batched decode from 32 sequences down, then a 64-row step.
pub const TUNE_ROWS: [u32; 5] = [512, 32, 16, 8, 64];
/// The step sizes below LARGE_ROWS and at it that decide `min_rows`, ascending.
const SMALL_ROWS: [u32; 4] = [8, 16, 32, 64];

/// One timing: a kernel at a step size, per call (all shapes of the format), or why it failed.
#[derive(Clone, Debug)]
pub struct Measurement {
    pub kernel: GemmKernel,
    pub rows: u32,
    pub time: Result<Duration, String>,
}

/// A tuned plan and what it was chosen from.
#[derive(Clone, Debug)]
pub struct Tuned {
    pub plan: GemmPlan,
    pub measurements: Vec<Measurement>,
    /// Whether every kernel was measured at every size within the budget.
    pub complete: bool,
}

/// Measures `kernels` (GEMM variants; the decode kernel is measured beside them) through
/// `measure` while `elapsed()` is under `budget`, and chooses the plan.
pub fn choose(
    kernels: &[GemmKernel],
    budget: Duration,
    elapsed: &mut dyn FnMut() -> Duration,
    measure: &mut dyn FnMut(GemmKernel, u32) -> Result<Duration>,
) -> Tuned {
    let gemms: Vec<GemmKernel> = kernels.iter().copied().filter(|&k| k != GemmKernel::Decode).collect();
    let mut measurements = Vec::new();
    let mut complete = true;
    'sizes: for m in TUNE_ROWS {
        let decode = (m <= LARGE_ROWS).then_some(GemmKernel::Decode);
        for k in decode.into_iter().chain(gemms.iter().copied()) {
            if elapsed() >= budget {
                complete = false;
                break 'sizes;
            }
            let time = measure(k, m).map_err(|e| format!("{e:#}"));
            measurements.push(Measurement { kernel: k, rows: m, time });
        }
    }
    Tuned { plan: plan_from(&gemms, &measurements), measurements, complete }
}

/// The plan the measurements support (see the module's comment).
pub fn plan_from(gemms: &[GemmKernel], ms: &[Measurement]) -> GemmPlan {
    let t = |k: GemmKernel, m: u32| {
        ms.iter().find(|x| x.kernel == k && x.rows == m).and_then(|x| x.time.as_ref().ok().copied())
    };
    let fastest = |m: u32| gemms.iter().filter_map(|&k| t(k, m).map(|d| (d, k))).min().map(|(_, k)| k);
    let default = GemmPlan::default();
    let large = fastest(512).unwrap_or(default.large);
    let small = fastest(32).unwrap_or(large);
    let gemm_wins = |m: u32| {
        let g = if m < LARGE_ROWS { small } else { large };
        matches!((t(g, m), t(GemmKernel::Decode, m)), (Some(a), Some(b)) if a < b)
    };
    let min_rows = SMALL_ROWS
        .iter()
        .copied()
        .find(|&m0| SMALL_ROWS.iter().filter(|&&m| m >= m0).all(|&m| gemm_wins(m)))
        .unwrap_or(default.min_rows);
    GemmPlan { min_rows, small, large }
}

/// A matmul the tuner times: the weights (and the up projection of a fused SwiGLU).
pub struct TuneShape {
    pub w: QTensor,
    pub up: Option<QTensor>,
}

/// Time of one call of kernel `k` at `m` rows over `shapes` on the harness's device, after its
/// output matched the decode kernel's on the same input (`reference`: the decode kernel's
/// outputs per (shape, m), filled as needed). Each shape runs enough repetitions in one submit
/// to take about `per_shape` (wall time, the submit's overhead spread over them).
pub fn measure_on(
    h: &mut Harness,
    shapes: &[TuneShape],
    k: GemmKernel,
    m: u32,
    per_shape: Duration,
    reference: &mut Vec<((usize, u32), Vec<f32>)>,
) -> Result<Duration> {
    let m_us = m as usize;
    let run = |h: &Harness, s: &TuneShape, x: &[f32]| run_shape(h, s, x, m_us);
    let mut total = Duration::ZERO;
    for (i, s) in shapes.iter().enumerate() {
        let x = probe_x(m_us * s.w.cols);
        if !reference.iter().any(|(key, _)| *key == (i, m)) {
            h.set_gemm(GemmPlan::only(GemmKernel::TILE64, u32::MAX))?;
            let y = run(h, s, &x)?;
            reference.push(((i, m), y));
        }
        let want = &reference.iter().find(|(key, _)| *key == (i, m)).expect("filled above").1;
        let plan =
            if k == GemmKernel::Decode { GemmPlan::only(GemmKernel::TILE64, u32::MAX) } else { GemmPlan::only(k, 1) };
        h.set_gemm(plan)?;
        let got = run(h, s, &x)?;
        agree(&got, want).map_err(|e| anyhow!("{} at {m} rows disagrees with the decode kernel: {e}", k.name()))?;
        total += per_call(per_shape, |iters| h.time_matmul(&s.w, s.up.as_ref(), m_us, false, iters))?;
    }
    Ok(total)
}

/// The prefill-sized expert kernels of one MoE block, timed against each other.
#[derive(Clone, Debug)]
pub struct MoeChoice {
    /// moe::MOE_TILED or moe::MOE_GROUPED.
    pub kernel: &'static str,
    /// Per run of the block (router, routing, experts, combine) at the step size tuned.
    pub grouped: Duration,
    /// The same with the tiled kernels, or why they were not timed (their output disagreed with
    /// the grouped kernels').
    pub tiled: Result<Duration, String>,
}

/// Times a `t`-token step of the MoE block `w` with the grouped and with the tiled expert
/// kernels (the tiled ones only after their output matched the grouped ones'), each for about
/// `per_run` of repetitions, and chooses the faster. Leaves the harness on the grouped kernels.
pub fn choose_moe(h: &mut Harness, spec: &MoeSpec, w: &MoeWeights, t: usize, per_run: Duration) -> Result<MoeChoice> {
    let n = t * w.router.cols;
    let x = probe_x(n);
    let zeros = vec![0f32; n];
    let time = |h: &Harness| per_call(per_run, |iters| h.time_moe(spec, w, t, iters));
    h.set_moe_tiled(false)?;
    let want = h.moe(spec, w, &x, t, &zeros, h.gpu.max_binding)?;
    let grouped = time(h)?;
    h.set_moe_tiled(true)?;
    let tiled = h
        .moe(spec, w, &x, t, &zeros, h.gpu.max_binding)
        .map_err(|e| format!("{e:#}"))
        .and_then(|got| {
            agree(&got, &want).map_err(|e| format!("the tiled kernels disagree with the grouped ones: {e}"))
        })
        .and_then(|()| time(h).map_err(|e| format!("{e:#}")));
    h.set_moe_tiled(false)?;
    let kernel = match &tiled {
        Ok(d) if *d < grouped => MOE_TILED,
        _ => MOE_GROUPED,
    };
    Ok(MoeChoice { kernel, grouped, tiled })
}

/// The one-token matmuls of one weight format on f32 and on int8 activations, timed against
/// each other.
#[derive(Clone, Debug)]
pub struct Int8Choice {
    pub int8: bool,
    /// Per step over the shapes (every matmul of a layer of that format).
    pub f32_x: Duration,
    /// The same on int8 activations (the quantization included), or why it was not timed (its
    /// output disagreed with the f32 kernel's).
    pub int8_x: Result<Duration, String>,
}

/// Times one-token steps of `shapes` with the f32 and the int8 kernels (the int8 ones only after
/// their output matched the f32 ones' within the quantization's error), each shape for about
/// `per_shape` of repetitions, and chooses the faster. The harness must have the int8 kernels
/// built (`Harness::add_int8`); it is left running them.
pub fn choose_int8(h: &mut Harness, shapes: &[TuneShape], per_shape: Duration) -> Result<Int8Choice> {
    let run = |h: &Harness, s: &TuneShape, x: &[f32]| run_shape(h, s, x, 1);
    let time = |h: &Harness| -> Result<Duration> {
        let mut total = Duration::ZERO;
        for s in shapes {
            total += per_call(per_shape, |iters| h.time_matmul(&s.w, s.up.as_ref(), 1, false, iters))?;
        }
        Ok(total)
    };
    // One-token steps on the decode kernel (the GEMM plans timed before may have left a GEMM
    // for every size).
    h.set_gemm(GemmPlan::only(GemmKernel::TILE64, u32::MAX))?;
    h.set_int8(false);
    let f32_x = time(h)?;
    let mut want = Vec::new();
    for s in shapes {
        let x = probe_x(s.w.cols);
        want.push((x.clone(), run(h, s, &x)?));
    }
    h.set_int8(true);
    let checked = shapes.iter().zip(&want).try_for_each(|(s, (x, y))| {
        let got = run(h, s, x).map_err(|e| format!("{e:#}"))?;
        agree(&got, y).map_err(|e| format!("the int8 kernel disagrees with the f32 one: {e}"))
    });
    let int8_x = checked.and_then(|()| time(h).map_err(|e| format!("{e:#}")));
    let int8 = matches!(&int8_x, Ok(d) if *d < f32_x);
    Ok(Int8Choice { int8, f32_x, int8_x })
}

/// The tuner's input: `n` values spread over [-0.5, 0.5) without a pattern the kernels could
/// exploit.
fn probe_x(n: usize) -> Vec<f32> {
    (0..n).map(|j| ((j * 7919 + 13) % 2003) as f32 / 2003.0 - 0.5).collect()
}

/// One matmul of shape `s` over `m` rows of `x`, as the harness's current kernels run it.
fn run_shape(h: &Harness, s: &TuneShape, x: &[f32], m: usize) -> Result<Vec<f32>> {
    h.matmul(&s.w, s.up.as_ref(), x, m, None, None, None, false, h.gpu.max_binding)
}

/// Time of one call of `run` (which times `iters` calls in one submit): timed once, then with as
/// many calls (1 to 200) as take about `target`.
fn per_call(target: Duration, run: impl Fn(u64) -> Result<Duration>) -> Result<Duration> {
    let once = run(1)?;
    let iters = (target.as_secs_f64() / once.as_secs_f64().max(1e-6)).clamp(1.0, 200.0) as u64;
    Ok(run(iters)? / iters as u32)
}

/// Whether `got` matches `want` within what f16 operands allow (relative to the output's scale).
fn agree(got: &[f32], want: &[f32]) -> Result<(), String> {
    let scale = want.iter().fold(0f32, |a, v| a.max(v.abs())).max(1e-6);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if !g.is_finite() || (g - w).abs() > 0.02 * scale {
            return Err(format!("output {i} is {g}, the decode kernel's {w}"));
        }
    }
    Ok(())
}

/// The wall clock since `start`, for `choose`.
pub fn since(start: Instant) -> impl FnMut() -> Duration {
    move || start.elapsed()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    const T32: GemmKernel = GemmKernel::Tile { bm: 32, f16: false };
    const T64H: GemmKernel = GemmKernel::Tile { bm: 64, f16: true };

    /// Runs the tuner on a fake device: `time(k, m)` in microseconds (None: it fails
    /// validation), each measurement advancing a fake clock by `cost`.
    fn tune(
        kernels: &[GemmKernel],
        budget_us: u64,
        cost_us: u64,
        time: impl Fn(GemmKernel, u32) -> Option<u64>,
    ) -> (Tuned, Vec<(GemmKernel, u32)>) {
        let clock = Cell::new(0u64);
        let mut asked = Vec::new();
        let tuned = choose(
            kernels,
            Duration::from_micros(budget_us),
            &mut || Duration::from_micros(clock.get()),
            &mut |k, m| {
                asked.push((k, m));
                clock.set(clock.get() + cost_us);
                time(k, m).map(Duration::from_micros).ok_or_else(|| anyhow!("disagrees"))
            },
        );
        (tuned, asked)
    }

    #[test]
    fn picks_the_fastest_kernel_for_each_step_size() {
        // Decode costs 10 us per row; tile64 40 + 1 per row; tile32 20 + 1 per row; tile64h wins
        // prefill-sized steps only (and beats decode at 64 rows).
        let time = |k: GemmKernel, m: u32| {
            let m = m as u64;
            Some(match k {
                GemmKernel::Decode => 10 * m,
                GemmKernel::TILE64 => 40 + m,
                T32 => 20 + m,
                T64H => {
                    if m >= 512 {
                        300
                    } else {
                        500
                    }
                }
                _ => unreachable!(),
            })
        };
        let (t, asked) = tune(&[GemmKernel::TILE64, T32, T64H], 1_000_000, 1, time);
        assert!(t.complete);
        // Decode at every size up to 64, each GEMM at all five.
        assert_eq!(asked.len(), 4 + 3 * 5);
        assert_eq!(t.plan.large, T64H);
        assert_eq!(t.plan.small, T32);
        // tile32 at 8 rows: 28 us vs decode's 80: GEMMs from 8 rows (tile64h at 64 rows: 500 us
        // vs 640).
        assert_eq!(t.plan.min_rows, 8);
        // Where the decode kernel is faster at 8 and 16 rows, GEMMs start at 32.
        let slow_small =
            |k: GemmKernel, m: u32| if k != GemmKernel::Decode && m <= 16 { Some(10_000) } else { time(k, m) };
        assert_eq!(tune(&[GemmKernel::TILE64, T32, T64H], 1_000_000, 1, slow_small).0.plan.min_rows, 32);
        // Where the large GEMM loses at 64 rows, the plan cannot send 64 rows to the decode
        // kernel and smaller ones to a GEMM: the default threshold stands.
        let slow_64 = |k: GemmKernel, m: u32| if k == T64H && m == 64 { Some(10_000) } else { time(k, m) };
        assert_eq!(
            tune(&[GemmKernel::TILE64, T32, T64H], 1_000_000, 1, slow_64).0.plan.min_rows,
            GemmPlan::default().min_rows
        );
        // Where it is faster everywhere, the default threshold stands.
        let decode_wins = |k: GemmKernel, m: u32| if k == GemmKernel::Decode { Some(1) } else { time(k, m) };
        assert_eq!(
            tune(&[GemmKernel::TILE64, T32], 1_000_000, 1, decode_wins).0.plan.min_rows,
            GemmPlan::default().min_rows
        );
    }

    #[test]
    fn never_picks_a_kernel_that_failed_validation() {
        // Coop would be fastest everywhere, but its output disagreed: never chosen.
        let time = |k: GemmKernel, m: u32| match k {
            GemmKernel::Coop => None,
            GemmKernel::Decode => Some(10 * m as u64),
            _ => Some(100 + m as u64),
        };
        let (t, _) = tune(&[GemmKernel::TILE64, GemmKernel::Coop], 1_000_000, 1, time);
        assert!(t.measurements.iter().any(|x| x.kernel == GemmKernel::Coop && x.time.is_err()));
        assert_eq!((t.plan.small, t.plan.large), (GemmKernel::TILE64, GemmKernel::TILE64));
        // All GEMMs failing: the default plan.
        let none = |k: GemmKernel, m: u32| (k == GemmKernel::Decode).then_some(10 * m as u64);
        assert_eq!(tune(&[GemmKernel::TILE64, T32], 1_000_000, 1, none).0.plan, GemmPlan::default());
    }

    #[test]
    fn honours_the_budget() {
        let time = |k: GemmKernel, m: u32| Some(if k == GemmKernel::Decode { 10 * m as u64 } else { 100 });
        // Each measurement costs 10 us of a 35 us budget: 4 are taken (the clock is read before
        // each), all at 512 rows, then it stops.
        let (t, asked) = tune(&[GemmKernel::TILE64, T32, T64H, GemmKernel::Coop], 35, 10, time);
        assert!(!t.complete);
        assert_eq!(asked.len(), 4);
        assert!(asked.iter().all(|&(_, m)| m == 512));
        // Nothing measured below 64 rows: no evidence for GEMMs there, the default threshold.
        assert_eq!(t.plan.min_rows, GemmPlan::default().min_rows);
        // A zero budget measures nothing and keeps the default plan.
        let (t, asked) = tune(&[GemmKernel::TILE64, T32], 0, 10, time);
        assert!(asked.is_empty() && !t.complete);
        assert_eq!(t.plan, GemmPlan::default());
    }
}
