//! The per-kernel profile: while it is on (`Model::set_profiling`), every step records a
//! timestamp before each op and after the last (inside one compute pass where the device allows
//! it, else one pass per op with timestamps at its start and end, else one submit per op timed by
//! the host clock), and the time, dispatches, bytes and FLOPs of each op are summed under its
//! label (`qkv`, `down`, `attention`, ...). `bench-model --profile-kernels` reports them per step.
//! A profiled step is recorded in one command buffer (the gpu profile's cuts are off).

use crate::gpu::timing::{TimestampMode, Timestamps, MAX_TIMESTAMPS};
use crate::gpu::Gpu;
use crate::ops::cost::Cost;
use crate::ops::{Op, Recorder, StepShape};
use anyhow::{bail, Result};
use serde::Serialize;
use std::time::Instant;

/// One label's totals over the profiled steps.
#[derive(Clone, Debug, Default, Serialize)]
pub struct OpTotals {
    pub label: String,
    pub family: String,
    /// Ops with this label per step (e.g. one matmul op per layer and weight chunk).
    pub ops: u64,
    pub dispatches: u64,
    pub seconds: f64,
    pub bytes: u64,
    pub flops: u64,
}

/// What the profiled steps spent, by op label, in the order the ops first ran.
#[derive(Clone, Debug, Serialize)]
pub struct StepProfile {
    /// How the ops were timed (`TimestampMode::name`).
    pub method: String,
    pub steps: usize,
    pub totals: Vec<OpTotals>,
}

impl StepProfile {
    /// Seconds of all ops, summed over the steps.
    pub fn seconds(&self) -> f64 {
        self.totals.iter().map(|t| t.seconds).sum()
    }
}

/// The profiler of a model: its timestamp queries and running totals.
pub(crate) struct Profiler {
    mode: TimestampMode,
    ts: Option<Timestamps>,
    /// This step's ops: (index into `totals`, dispatches, cost, timestamp slot of its start).
    pending: Vec<(usize, u64, Cost, u32)>,
    /// Timestamps written this step.
    written: u32,
    steps: usize,
    totals: Vec<OpTotals>,
}

impl Profiler {
    pub(crate) fn new(gpu: &Gpu) -> Profiler {
        Profiler { mode: gpu.timestamps, ts: None, pending: vec![], written: 0, steps: 0, totals: vec![] }
    }

    fn slot(&mut self, op: &Op) -> usize {
        match self.totals.iter().position(|t| t.label == op.label) {
            Some(i) => i,
            None => {
                let family = op.kind.family().to_string();
                self.totals.push(OpTotals { label: op.label.to_string(), family, ..Default::default() });
                self.totals.len() - 1
            }
        }
    }

    /// Records the step's ops with timestamps around each (or, without timestamp queries, runs
    /// each op as its own submit and times it); returns the encoder for the caller's copies and
    /// submit, then `collect` reads the times.
    pub(crate) fn record(
        &mut self,
        g: &Gpu,
        rec: &Recorder,
        ops: &[Op],
        s: &StepShape,
    ) -> Result<wgpu::CommandEncoder> {
        let kv_bytes = rec.kernels.kv.bytes() as u64;
        // Ops with no dispatches this step (no sampled rows, no adjustments) are left out.
        let mut runs: Vec<(usize, Vec<crate::ops::Dispatch>)> = Vec::new();
        for (i, op) in ops.iter().enumerate() {
            let mut ds = Vec::new();
            op.dispatches(rec, s, |d| ds.push(d));
            if !ds.is_empty() {
                runs.push((i, ds));
            }
        }
        let need = match self.mode {
            TimestampMode::InsidePasses => runs.len() as u32 + 1,
            TimestampMode::PerPass => 2 * runs.len() as u32,
            TimestampMode::None => 0,
        };
        if need > MAX_TIMESTAMPS {
            bail!("{} ops are too many to profile in one step (at most {})", runs.len(), MAX_TIMESTAMPS / 2 - 1);
        }
        if need > 0 && self.ts.as_ref().is_none_or(|t| t.count < need) {
            self.ts = Some(Timestamps::new(g, need.next_power_of_two().min(MAX_TIMESTAMPS))?);
        }
        self.pending.clear();
        let mut enc = g.device.create_command_encoder(&Default::default());
        for (n, (i, ds)) in runs.iter().enumerate() {
            let slot = self.slot(&ops[*i]);
            let cost = ops[*i].kind.cost(s, kv_bytes);
            let start = match self.mode {
                TimestampMode::PerPass => 2 * n as u32,
                _ => n as u32,
            };
            self.pending.push((slot, ds.len() as u64, cost, start));
        }
        match (self.mode, &self.ts) {
            (TimestampMode::InsidePasses, Some(ts)) => {
                let mut pass = enc.begin_compute_pass(&Default::default());
                for (n, (_, ds)) in runs.iter().enumerate() {
                    pass.write_timestamp(&ts.set, n as u32);
                    ds.iter().for_each(|d| d.record(&mut pass));
                }
                pass.write_timestamp(&ts.set, runs.len() as u32);
            }
            (TimestampMode::PerPass, Some(ts)) => {
                for (n, (_, ds)) in runs.iter().enumerate() {
                    let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                        label: None,
                        timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                            query_set: &ts.set,
                            beginning_of_pass_write_index: Some(2 * n as u32),
                            end_of_pass_write_index: Some(2 * n as u32 + 1),
                        }),
                    });
                    ds.iter().for_each(|d| d.record(&mut pass));
                }
            }
            _ => {
                // The host clock: each op alone, submitted and waited for.
                for (n, (_, ds)) in runs.iter().enumerate() {
                    let mut e = g.device.create_command_encoder(&Default::default());
                    {
                        let mut pass = e.begin_compute_pass(&Default::default());
                        ds.iter().for_each(|d| d.record(&mut pass));
                    }
                    let t = Instant::now();
                    g.queue.submit([e.finish()]);
                    g.device
                        .poll(wgpu::PollType::wait_indefinitely())
                        .map_err(|e| anyhow::anyhow!("GPU poll failed: {e}"))?;
                    let (slot, d, cost, _) = self.pending[n];
                    self.add(slot, d, cost, t.elapsed().as_secs_f64());
                }
                self.pending.clear();
            }
        }
        self.written = need;
        if let Some(ts) = self.ts.as_ref().filter(|_| need > 0) {
            ts.resolve(&mut enc, need);
        }
        Ok(enc)
    }

    fn add(&mut self, slot: usize, dispatches: u64, cost: Cost, seconds: f64) {
        let t = &mut self.totals[slot];
        t.ops += 1;
        t.dispatches += dispatches;
        t.seconds += seconds;
        t.bytes += cost.bytes;
        t.flops += cost.flops;
    }

    /// After the step's submit: reads its timestamps into the totals.
    pub(crate) fn collect(&mut self, g: &Gpu) -> Result<()> {
        self.steps += 1;
        let pending = std::mem::take(&mut self.pending);
        let Some(ts) = self.ts.as_ref().filter(|_| self.written > 0) else { return Ok(()) };
        let ns = ts.read_ns(g, self.written)?;
        for (slot, d, cost, start) in pending {
            // The op's start and end: slots n, n + 1 between dispatches; 2n, 2n + 1 per pass.
            let (a, b) = (ns[start as usize], ns[start as usize + 1]);
            // Timestamps of some drivers are not monotonic across passes: no negative times.
            self.add(slot, d, cost, (b - a).max(0.0) * 1e-9);
        }
        Ok(())
    }

    /// The totals so far.
    pub(crate) fn report(&self) -> StepProfile {
        let mut totals = self.totals.clone();
        // `ops` counted every step: per step.
        for t in &mut totals {
            t.ops /= self.steps.max(1) as u64;
        }
        StepProfile { method: self.mode.name().to_string(), steps: self.steps, totals }
    }
}
