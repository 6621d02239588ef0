//! Host-side counters of the step path (issue 48's overhead budget): command buffers submitted,
//! compute passes and dispatches recorded, readbacks waited for, and the host time spent
//! recording, submitting and waiting. Always on (a few atomic adds per step); `bench-model`
//! reads them per decode step.

use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

/// The running totals of one device.
#[derive(Debug, Default)]
pub struct StepCounters {
    submits: AtomicU64,
    passes: AtomicU64,
    dispatches: AtomicU64,
    readbacks: AtomicU64,
    record_ns: AtomicU64,
    submit_ns: AtomicU64,
    wait_ns: AtomicU64,
}

/// The counters at one moment (or, from [`Counts::since`], over an interval).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Counts {
    pub submits: u64,
    pub passes: u64,
    pub dispatches: u64,
    pub readbacks: u64,
    /// Host time recording passes (set_pipeline / set_bind_group / dispatch calls).
    pub record_ns: u64,
    /// Host time in `Queue::submit`.
    pub submit_ns: u64,
    /// Host time waiting for readbacks (the GPU's remaining work, then the copy).
    pub wait_ns: u64,
}

fn ns(t: Instant) -> u64 {
    t.elapsed().as_nanos().min(u64::MAX as u128) as u64
}

impl StepCounters {
    pub fn snapshot(&self) -> Counts {
        Counts {
            submits: self.submits.load(Relaxed),
            passes: self.passes.load(Relaxed),
            dispatches: self.dispatches.load(Relaxed),
            readbacks: self.readbacks.load(Relaxed),
            record_ns: self.record_ns.load(Relaxed),
            submit_ns: self.submit_ns.load(Relaxed),
            wait_ns: self.wait_ns.load(Relaxed),
        }
    }

    /// A pass of `dispatches` dispatches, recorded from `start` on.
    pub fn pass(&self, dispatches: u64, start: Instant) {
        self.passes.fetch_add(1, Relaxed);
        self.dispatches.fetch_add(dispatches, Relaxed);
        self.record_ns.fetch_add(ns(start), Relaxed);
    }

    pub fn submitted(&self, start: Instant) {
        self.submits.fetch_add(1, Relaxed);
        self.submit_ns.fetch_add(ns(start), Relaxed);
    }

    pub fn waited(&self, start: Instant) {
        self.readbacks.fetch_add(1, Relaxed);
        self.wait_ns.fetch_add(ns(start), Relaxed);
    }
}

impl Counts {
    /// What happened between `earlier` and this snapshot.
    pub fn since(&self, earlier: &Counts) -> Counts {
        Counts {
            submits: self.submits - earlier.submits,
            passes: self.passes - earlier.passes,
            dispatches: self.dispatches - earlier.dispatches,
            readbacks: self.readbacks - earlier.readbacks,
            record_ns: self.record_ns - earlier.record_ns,
            submit_ns: self.submit_ns - earlier.submit_ns,
            wait_ns: self.wait_ns - earlier.wait_ns,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_add_up_and_subtract() {
        let c = StepCounters::default();
        let a = c.snapshot();
        let t = Instant::now();
        c.pass(7, t);
        c.pass(3, t);
        c.submitted(t);
        c.waited(t);
        let d = c.snapshot().since(&a);
        assert_eq!((d.passes, d.dispatches, d.submits, d.readbacks), (2, 10, 1, 1));
        assert!(d.record_ns > 0 && d.submit_ns > 0 && d.wait_ns > 0);
        assert_eq!(c.snapshot().since(&c.snapshot()), Counts::default());
    }
}
