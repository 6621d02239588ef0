//! GPU timestamps for the per-kernel profile: what the device can time (between dispatches
//! inside a compute pass, at the start and end of each pass, or nothing), and a set of
//! timestamp queries resolved and read back as nanoseconds.

use super::Gpu;
use anyhow::{anyhow, bail, Result};

/// How this device can time kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimestampMode {
    /// `write_timestamp` between dispatches of one compute pass (TIMESTAMP_QUERY_INSIDE_PASSES).
    InsidePasses,
    /// Timestamps at the start and end of each compute pass only (TIMESTAMP_QUERY): one pass
    /// per op.
    PerPass,
    /// No timestamp queries: ops are timed by the host clock, one submit each.
    None,
}

impl TimestampMode {
    /// The features to request for timestamps the adapter offers.
    pub fn wanted(adapter: wgpu::Features) -> wgpu::Features {
        let all = wgpu::Features::TIMESTAMP_QUERY
            | wgpu::Features::TIMESTAMP_QUERY_INSIDE_ENCODERS
            | wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES;
        if adapter.contains(wgpu::Features::TIMESTAMP_QUERY) {
            adapter & all
        } else {
            wgpu::Features::empty()
        }
    }

    /// What a device opened with `features` can do.
    pub fn of(features: wgpu::Features) -> TimestampMode {
        use wgpu::Features as F;
        if features.contains(F::TIMESTAMP_QUERY | F::TIMESTAMP_QUERY_INSIDE_ENCODERS | F::TIMESTAMP_QUERY_INSIDE_PASSES)
        {
            TimestampMode::InsidePasses
        } else if features.contains(F::TIMESTAMP_QUERY) {
            TimestampMode::PerPass
        } else {
            TimestampMode::None
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            TimestampMode::InsidePasses => "timestamps between dispatches",
            TimestampMode::PerPass => "timestamps per compute pass",
            TimestampMode::None => "host clock, one submit per op",
        }
    }
}

/// Most timestamps one query set holds (wgpu's limit).
pub const MAX_TIMESTAMPS: u32 = 4096;

/// A set of `count` timestamp queries with the buffers to resolve and read them.
pub struct Timestamps {
    pub set: wgpu::QuerySet,
    pub count: u32,
    resolve: wgpu::Buffer,
    readback: wgpu::Buffer,
}

impl Timestamps {
    pub fn new(gpu: &Gpu, count: u32) -> Result<Timestamps> {
        if gpu.timestamps == TimestampMode::None {
            bail!("{} has no timestamp queries", gpu.describe());
        }
        if count == 0 || count > MAX_TIMESTAMPS {
            bail!("{count} timestamps: a query set holds 1..={MAX_TIMESTAMPS}");
        }
        let set = gpu.device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("kernel-profile"),
            ty: wgpu::QueryType::Timestamp,
            count,
        });
        let bytes = count as u64 * 8;
        let resolve = gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("timestamps"),
            size: bytes,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let readback = gpu.readback("timestamps-readback", bytes);
        Ok(Timestamps { set, count, resolve, readback })
    }

    /// Records the resolve of the first `n` queries and their copy to the host buffer.
    pub fn resolve(&self, enc: &mut wgpu::CommandEncoder, n: u32) {
        let n = n.min(self.count);
        if n > 0 {
            enc.resolve_query_set(&self.set, 0..n, &self.resolve, 0);
            enc.copy_buffer_to_buffer(&self.resolve, 0, &self.readback, 0, n as u64 * 8);
        }
    }

    /// The first `n` timestamps in nanoseconds (after the resolve was submitted).
    pub fn read_ns(&self, gpu: &Gpu, n: u32) -> Result<Vec<f64>> {
        let n = n.min(self.count);
        if n == 0 {
            return Ok(vec![]);
        }
        let bytes = gpu.read_mapped(&self.readback, n as u64 * 8)?;
        let ticks: Vec<u64> = bytemuck::pod_collect_to_vec(&bytes);
        let period = gpu.queue.get_timestamp_period() as f64;
        if period <= 0.0 {
            return Err(anyhow!("the device reports a timestamp period of {period} ns"));
        }
        Ok(ticks.into_iter().map(|t| t as f64 * period).collect())
    }
}
