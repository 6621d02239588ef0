//! A weight matrix on the GPU, split by rows into chunks that each fit one storage binding.

use crate::gpu::wformat::WFormat;
use crate::gpu::Gpu;
use crate::weights::grids;
use crate::weights::tensor::QTensor;
use anyhow::{bail, Result};

/// A weight matrix on the GPU, split by rows into chunks that each fit one storage binding.
#[derive(Clone)]
pub struct GpuMatrix {
    pub format: WFormat,
    pub rows: usize,
    pub cols: usize,
    pub chunks: Vec<GpuChunk>,
}

#[derive(Clone)]
pub struct GpuChunk {
    pub row0: usize,
    pub rows: usize,
    pub q: wgpu::Buffer,
    pub s: wgpu::Buffer,
}

impl GpuMatrix {
    /// Uploads `t`; with `pair` (same shape), each chunk holds `t`'s rows then `pair`'s same rows
    /// (gate then up, for the fused SwiGLU matmul).
    pub fn upload(gpu: &Gpu, label: &str, t: &QTensor, pair: Option<&QTensor>, max_binding: u64) -> Result<GpuMatrix> {
        Self::upload_in_units(gpu, label, t, pair, 1, max_binding)
    }

    /// Uploads `t` in chunks of whole groups of `unit` rows (a mixture-of-experts tensor: one
    /// expert's rows per group), so that no group spans two chunks.
    pub fn upload_grouped(gpu: &Gpu, label: &str, t: &QTensor, unit: usize, max_binding: u64) -> Result<GpuMatrix> {
        Self::upload_in_units(gpu, label, t, None, unit, max_binding)
    }

    fn upload_in_units(
        gpu: &Gpu,
        label: &str,
        t: &QTensor,
        pair: Option<&QTensor>,
        unit: usize,
        max_binding: u64,
    ) -> Result<GpuMatrix> {
        if let Some(p) = pair.filter(|p| (p.format, p.rows, p.cols) != (t.format, t.rows, t.cols)) {
            bail!(
                "{label}: cannot pair a {:?} [{}, {}] tensor with a {:?} [{}, {}] one",
                t.format,
                t.rows,
                t.cols,
                p.format,
                p.rows,
                p.cols
            );
        }
        if unit == 0 || !t.rows.is_multiple_of(unit) {
            bail!("{label}: {} rows are not whole groups of {unit}", t.rows);
        }
        let per_row_q = (t.blocks_per_row() * t.format.words_per_block() * 4) as u64;
        let per_row_s = (t.format.scale_words_per_row(t.cols) * 4) as u64;
        let mult = if pair.is_some() { 2 } else { 1 };
        let per_row = per_row_q.max(per_row_s) * mult;
        // The grid formats' grid goes in front of every chunk's scale records.
        let grid = if t.format.is_grid() { grids::gpu_grid_words(t.format) } else { vec![] };
        let rows_per_chunk = (max_binding.saturating_sub(grid.len() as u64 * 4) / per_row) as usize / unit * unit;
        if rows_per_chunk == 0 {
            bail!("{label}: {unit} row(s) of {per_row} bytes exceed the device's max storage binding");
        }
        let mut chunks = Vec::new();
        let mut r0 = 0;
        while r0 < t.rows {
            let r1 = (r0 + rows_per_chunk).min(t.rows);
            // A chunk of one tensor is uploaded from its rows in place; a pair's rows are
            // stacked first.
            let stacked = pair.map(|p| {
                let ((tq, ts), (pq, ps)) = (t.row_words(r0, r1), p.row_words(r0, r1));
                ([tq, pq].concat(), [ts, ps].concat())
            });
            let (q_words, s_words) = match &stacked {
                Some((q, s)) => (q.as_slice(), s.as_slice()),
                None => t.row_words(r0, r1),
            };
            // Each buffer's staging copy is let go before the next buffer is created (see
            // gpu/staging.rs).
            let q = gpu.storage_init(label, bytemuck::cast_slice(q_words));
            gpu.release_staging()?;
            let s = if grid.is_empty() {
                gpu.storage_init(label, bytemuck::cast_slice(s_words))
            } else {
                gpu.storage_init(label, bytemuck::cast_slice(&[grid.as_slice(), s_words].concat()))
            };
            gpu.release_staging()?;
            drop(stacked);
            chunks.push(GpuChunk { row0: r0, rows: r1 - r0, q, s });
            r0 = r1;
        }
        Ok(GpuMatrix { format: t.format, rows: t.rows, cols: t.cols, chunks })
    }
}
