//! Where a decode step's time goes on the host, and how much GPU work it records (issue 48's
//! overhead budget): `bench-model` reads the device's step counters (gpu/counters.rs) around
//! its timed decode steps.

use crate::gpu::counters::Counts;
use serde::Serialize;

/// Per decode step, averaged over the timed steps.
#[derive(Clone, Debug, Default, Serialize)]
pub struct StepOverhead {
    pub wall_ms: f64,
    /// Recording the step's compute passes (pipelines, bind groups, dispatches).
    pub record_ms: f64,
    /// In `Queue::submit`.
    pub submit_ms: f64,
    /// Waiting for the sampled tokens' readback: the GPU work not yet done when the host got
    /// there, and the copy.
    pub wait_ms: f64,
    /// The rest of the wall time: the step's metadata and uploads, the scheduler's work, reading
    /// the result.
    pub other_host_ms: f64,
    pub submits: f64,
    pub passes: f64,
    pub dispatches: f64,
    pub readbacks: f64,
    /// The weight bytes one step reads at the peak bandwidth given (`--peak-gb-s`): the step's
    /// floor on this GPU.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub floor_ms: Option<f64>,
}

impl StepOverhead {
    /// From the counters' change `c` over `steps` steps that took `seconds`.
    pub fn of(c: &Counts, steps: usize, seconds: f64) -> StepOverhead {
        let n = steps.max(1) as f64;
        let ms = |ns: u64| ns as f64 / 1e6 / n;
        let wall_ms = seconds * 1e3 / n;
        let (record_ms, submit_ms, wait_ms) = (ms(c.record_ns), ms(c.submit_ns), ms(c.wait_ns));
        StepOverhead {
            wall_ms,
            record_ms,
            submit_ms,
            wait_ms,
            other_host_ms: (wall_ms - record_ms - submit_ms - wait_ms).max(0.0),
            submits: c.submits as f64 / n,
            passes: c.passes as f64 / n,
            dispatches: c.dispatches as f64 / n,
            readbacks: c.readbacks as f64 / n,
            floor_ms: None,
        }
    }

    /// One line for the console.
    pub fn line(&self) -> String {
        let floor = self.floor_ms.map_or(String::new(), |f| format!(" (floor {f:.3} ms)"));
        format!(
            "per step {:.3} ms{floor} = record {:.3} + submit {:.3} + wait {:.3} + other host {:.3}; \
             {:.0} dispatches in {:.1} passes, {:.1} submits, {:.1} readbacks",
            self.wall_ms,
            self.record_ms,
            self.submit_ms,
            self.wait_ms,
            self.other_host_ms,
            self.dispatches,
            self.passes,
            self.submits,
            self.readbacks
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parts_add_up_to_the_wall_time() {
        let c = Counts {
            submits: 4,
            passes: 8,
            dispatches: 400,
            readbacks: 4,
            record_ns: 2_000_000,
            submit_ns: 400_000,
            wait_ns: 10_000_000,
        };
        let o = StepOverhead::of(&c, 4, 0.016);
        assert_eq!((o.wall_ms, o.record_ms, o.submit_ms, o.wait_ms), (4.0, 0.5, 0.1, 2.5));
        assert!((o.other_host_ms - 0.9).abs() < 1e-9);
        assert_eq!((o.dispatches, o.passes, o.submits, o.readbacks), (100.0, 2.0, 1.0, 1.0));
        assert!(o.line().contains("100 dispatches in 2.0 passes"));
    }
}
