//! One model on this process's device: each step runs when submitted, its result is queued.

use super::{panic_message, Executor, StepOutput, StepResult};
use crate::model::{Model, StepInput, StepLimits};
use anyhow::anyhow;
use std::collections::VecDeque;
use std::sync::Arc;

pub struct Inline {
    model: Box<Model>,
    done: VecDeque<StepResult>,
}

impl Inline {
    pub fn new(model: Model) -> Inline {
        Inline { model: Box::new(model), done: VecDeque::new() }
    }

    /// Runs a step, `before` first (test faults), and queues its result. A panic in the step
    /// (a bug, a driver failure surfacing as one) fails this step's requests; the engine goes on
    /// with the next.
    pub(crate) fn run(&mut self, id: u64, input: StepInput, before: impl FnOnce(&mut Model)) {
        let model = &mut self.model;
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            before(model);
            model.step(&input)
        }))
        .unwrap_or_else(|p| Err(anyhow!("the step panicked: {}", panic_message(&*p))))
        .map(|sampled| StepOutput { sampled, logits: None, hidden: model.take_hidden() });
        self.done.push_back(StepResult { id, result });
    }
}

impl Executor for Inline {
    fn limits(&self) -> StepLimits {
        self.model.limits
    }

    fn num_blocks(&self) -> usize {
        self.model.kv.num_blocks
    }

    fn vocab(&self) -> usize {
        self.model.cfg.vocab
    }

    fn state_slots(&self) -> usize {
        self.model.state_slots
    }

    fn describe(&self) -> String {
        let m = &self.model;
        format!("{} (kernel profile {}; memory: {})", m.gpu.describe(), m.limits.profile.name(), m.plan)
    }

    fn gpu_faults(&self) -> Option<Arc<crate::gpu::GpuFaults>> {
        Some(self.model.gpu.faults.clone())
    }

    fn device(&self) -> Option<Arc<crate::gpu::Gpu>> {
        Some(self.model.gpu.clone())
    }

    fn emit_hidden(&mut self, on: bool) -> bool {
        self.model.emit_hidden(on)
    }

    fn final_norm(&self) -> Option<(Vec<f32>, f32)> {
        self.model.final_norm()
    }

    fn shared_io(&self) -> Option<crate::model::SharedIo> {
        self.model.io()
    }

    fn submit(&mut self, id: u64, input: StepInput) {
        self.run(id, input, |_| {})
    }

    fn recv(&mut self) -> Option<StepResult> {
        self.done.pop_front()
    }
}
