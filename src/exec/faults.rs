//! Test-only faults (tests/faults.rs, tests/kv_events.rs): `FaultInjector` wraps a
//! single-device executor and, when armed through `EngineHandle::inject_fault`, makes its next
//! step fail the way real failures do. A server never wraps its executor.

use super::{Executor, Inline, StepResult};
use crate::model::{Model, StepInput, StepLimits};
use std::sync::Arc;

/// Test-only faults, injected through `EngineHandle::inject_fault` to exercise the paths that
/// real failures take. The step faults need a `FaultInjector`; `EnginePanic` is the engine's.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The next step panics inside the executor.
    StepPanic,
    /// The next step's GPU work raises a wgpu validation error (caught by its error scope).
    StepGpuError,
    /// The device is destroyed before the next step (the device-lost handler runs).
    DeviceLost,
    /// The next step's result comes back under the wrong step id.
    StepIdMismatch,
    /// The engine thread panics.
    EnginePanic,
}

/// A single-device executor with test faults.
pub struct FaultInjector {
    inner: Inline,
    armed: Option<Fault>,
}

impl FaultInjector {
    pub fn new(model: Model) -> FaultInjector {
        FaultInjector { inner: Inline::new(model), armed: None }
    }
}

impl Executor for FaultInjector {
    fn limits(&self) -> StepLimits {
        self.inner.limits()
    }

    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }

    fn vocab(&self) -> usize {
        self.inner.vocab()
    }

    fn state_slots(&self) -> usize {
        self.inner.state_slots()
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn gpu_faults(&self) -> Option<Arc<crate::gpu::GpuFaults>> {
        self.inner.gpu_faults()
    }

    fn device(&self) -> Option<Arc<crate::gpu::Gpu>> {
        self.inner.device()
    }

    fn emit_hidden(&mut self, on: bool) -> bool {
        self.inner.emit_hidden(on)
    }

    fn final_norm(&self) -> Option<(Vec<f32>, f32)> {
        self.inner.final_norm()
    }

    fn shared_io(&self) -> Option<crate::model::SharedIo> {
        self.inner.shared_io()
    }

    fn submit(&mut self, id: u64, input: StepInput) {
        let fault = self.armed.take_if(|f| *f != Fault::StepIdMismatch);
        self.inner.run(id, input, |model| match fault {
            Some(Fault::StepPanic) => panic!("injected fault: a panic in the step"),
            Some(Fault::StepGpuError) => model.provoke_gpu_error = true,
            Some(Fault::DeviceLost) => model.gpu.device.destroy(),
            _ => {}
        })
    }

    fn recv(&mut self) -> Option<StepResult> {
        let mut r = self.inner.recv()?;
        if self.armed.take_if(|f| *f == Fault::StepIdMismatch).is_some() {
            // The result comes back under another step's id.
            r.id = r.id.wrapping_add(1);
        }
        Some(r)
    }

    fn inject(&mut self, f: Fault) {
        self.armed = Some(f);
    }
}
