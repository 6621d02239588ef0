//! What the last stage hands back besides sampled tokens: every token's residual after the
//! last layer, read back with each step while it is on (the MTP head reads it, embeddings pool
//! it), and the final norm that turns such a residual into the model's last hidden state.

use super::Model;

impl Model {
    /// Turns on (or off) reading back every token's residual after the last layer with each step
    /// of the last stage (an MTP head reads the model's hidden states); false where this model is
    /// not the last stage.
    pub fn emit_hidden(&mut self, on: bool) -> bool {
        if !self.is_last() {
            return false;
        }
        // Counted in the memory plan while held.
        let bytes = (self.sub_tokens * self.cfg.hidden * 4) as u64;
        match (on, self.emit.is_some()) {
            (true, false) => self.plan.scratch += bytes,
            (false, true) => self.plan.scratch -= bytes,
            _ => {}
        }
        self.emit = on.then(|| self.gpu.readback("hidden_emit", bytes));
        true
    }

    /// The final RMSNorm (its weights, as the head applies them, and epsilon) that turns an
    /// emitted residual into the model's last hidden state; None where this is not the last stage.
    pub fn final_norm(&self) -> Option<(Vec<f32>, f32)> {
        (!self.final_norm.is_empty()).then(|| (self.final_norm.clone(), self.cfg.rms_eps))
    }

    /// The residual of every token of the last step ([tokens, hidden] f32), while `emit_hidden`
    /// is on; empty otherwise.
    pub fn take_hidden(&mut self) -> Vec<f32> {
        bytemuck::pod_collect_to_vec(&std::mem::take(&mut self.emitted))
    }
}
