//! The staging copies of buffers created with contents: wgpu writes the contents into a staging
//! buffer and copies them over at the next submit, keeping the staging buffer until that submit
//! completes. Loading a model creates its weight buffers without submitting anything, so without
//! a release every staging copy (as large as the weights) lives until the first step; and since
//! staging and weight buffers are carved from the same memory blocks, staging copies released
//! late leave holes that later buffers do not fit (on lavapipe a 7B model's 4.3 GiB of weights
//! reserved 7.6 GiB with releases every 256 MiB). Releasing each weight buffer's staging copy
//! before the next buffer is created lets the next one take its place. On a CPU adapter, whose
//! device memory is host memory, this is the difference between 1x and 2-3x the weights.

use super::Gpu;
use anyhow::{anyhow, Result};
use std::sync::atomic::Ordering;

impl Gpu {
    /// Counts `bytes` of contents given to a buffer created with them.
    pub(super) fn staged(&self, bytes: u64) {
        self.staged_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Submits the copies queued for buffers created with contents and waits for them, which
    /// frees their staging copies; nothing to do when none were created since the last release.
    pub fn release_staging(&self) -> Result<()> {
        if self.staged_bytes.swap(0, Ordering::Relaxed) == 0 {
            return Ok(());
        }
        self.queue.submit([]);
        self.device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| anyhow!("GPU poll failed: {e}"))?;
        Ok(())
    }
}
