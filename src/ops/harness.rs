//! Runs single kernels on host data: what the kernel tests and benches drive. It builds its ops
//! with the same family constructors as the forward step (model/), and records them the same way.

use crate::config::{KernelProfile, KvDtype};
use crate::gpu::shared::StepHeader;
use crate::gpu::wformat::WFormat;
use crate::gpu::Gpu;
use crate::ops::attention::{self, AttnBinds, AttnParams};
use crate::ops::kernels::{KernelSpec, Kernels};
use crate::ops::matmul::decode::{int8_pipelines, quantize_pipelines};
use crate::ops::matmul::gemm::{add_gemm, GemmPlan};
use crate::ops::matmul::tiles::{window_entries, window_stride};
use crate::ops::matmul::{self, MatmulIo, MAT_ACCUMULATE, MAT_BIAS, MAT_SWIGLU_UP};
use crate::ops::norm::{self, HeadNormBinds, HeadNormParams, NormBinds, NormParams};
use crate::ops::rope::{self, rope_table, RopeBinds, RopeParams};
use crate::ops::sample::{self, AdjustBinds, SampleBinds, SamplerParams};
use crate::ops::{attention_splits, attention_tiled, Op, RecordParams, Recorder, StepShape};
use crate::sampling::row::SAMPLE_RESULT_STRIDE;
use crate::sampling::{SampleParams, Sampled};
use crate::weights::tensor::QTensor;
use crate::weights::upload::GpuMatrix;
use anyhow::Result;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub struct Harness {
    pub gpu: Arc<Gpu>,
    pub kernels: Kernels,
}

/// Metadata of one attention step (see `Harness::rope_attention`).
#[derive(Clone, Debug, Default)]
pub struct AttnStep {
    pub positions: Vec<u32>,
    pub slots: Vec<u32>,
    pub seq_of_token: Vec<u32>,
    pub block_tables: Vec<Vec<u32>>,
}

/// One recorded dispatch: pipeline, bind group (with its dynamic offsets) and grid.
#[derive(Clone, Debug)]
pub struct Call {
    pub pipe: wgpu::ComputePipeline,
    pub bind: wgpu::BindGroup,
    pub offsets: Vec<u32>,
    pub grid: (u32, u32),
}

/// Head counts and sizes of an attention test.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
}

/// KV cache and RoPE table for attention tests, kept across steps.
pub struct AttnRig {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    /// Sliding attention window (0: none).
    pub window: usize,
    /// gpu profile: key ranges per (token, KV head) to force (None: as the forward step picks).
    pub splits: Option<u32>,
    /// gpu profile: run the query-tiled attention (Some(true)), the split one (Some(false)), or
    /// (None) as the forward step picks.
    pub tiled: Option<bool>,
    /// A sink logit per query head (gpt-oss), or None.
    pub sinks: Option<Vec<f32>>,
    /// The cache's chunks (as many as the kernels were built for), `blocks_per_chunk` blocks each.
    pub k: Vec<wgpu::Buffer>,
    pub v: Vec<wgpu::Buffer>,
    pub blocks_per_chunk: usize,
    cos_sin: wgpu::Buffer,
    max_pos: usize,
}

impl Harness {
    /// Every weight format, attention for `head_dim`, the default (f16) KV cache; cpu profile.
    pub fn new(gpu: Arc<Gpu>, head_dim: u32) -> Result<Harness> {
        Self::with_kv(gpu, head_dim, KvDtype::default())
    }

    pub fn with_kv(gpu: Arc<Gpu>, head_dim: u32, kv: KvDtype) -> Result<Harness> {
        Self::build(gpu, WFormat::ALL.to_vec(), head_dim, 1, kv, 1, KernelProfile::Cpu)
    }

    /// Every weight format in the given profile; the split attention (gpu) for `group` query
    /// heads per KV head.
    pub fn with_profile(gpu: Arc<Gpu>, head_dim: u32, group: u32, profile: KernelProfile) -> Result<Harness> {
        Self::build(gpu, WFormat::ALL.to_vec(), head_dim, group, KvDtype::default(), 1, profile)
    }

    /// The matmuls and the mixture-of-experts kernels of the given formats, in `profile`.
    pub fn for_moe(gpu: Arc<Gpu>, formats: &[WFormat], profile: KernelProfile) -> Result<Harness> {
        let spec = KernelSpec {
            formats: formats.to_vec(),
            moe_formats: formats.to_vec(),
            head_dim: 64,
            group: 1,
            kv: KvDtype::default(),
            kv_chunks: 1,
            profile,
            delta_k_dim: None,
            int8: None,
            more_attn: vec![],
        };
        Ok(Harness { kernels: Kernels::new(&gpu, &spec)?, gpu })
    }

    /// The given weight formats only (quicker to build), in `profile`.
    pub fn with_formats(
        gpu: Arc<Gpu>,
        formats: &[WFormat],
        (head_dim, group): (u32, u32),
        profile: KernelProfile,
    ) -> Result<Harness> {
        Self::build(gpu, formats.to_vec(), head_dim, group, KvDtype::default(), 1, profile)
    }

    /// For attention tests and benches: the matmuls of one weight format only (quicker to build),
    /// the KV cache of each layer split over `kv_chunks` buffers, `group` query heads per KV head.
    pub fn attention_only(
        gpu: Arc<Gpu>,
        (head_dim, group): (u32, u32),
        kv: KvDtype,
        kv_chunks: usize,
        profile: KernelProfile,
    ) -> Result<Harness> {
        Self::build(gpu, vec![WFormat::F32], head_dim, group, kv, kv_chunks, profile)
    }

    fn build(
        gpu: Arc<Gpu>,
        formats: Vec<WFormat>,
        head_dim: u32,
        group: u32,
        kv: KvDtype,
        kv_chunks: usize,
        profile: KernelProfile,
    ) -> Result<Harness> {
        let spec = KernelSpec {
            formats,
            moe_formats: vec![],
            head_dim,
            group,
            kv,
            kv_chunks,
            profile,
            delta_k_dim: None,
            int8: None,
            more_attn: vec![],
        };
        let kernels = Kernels::new(&gpu, &spec)?;
        Ok(Harness { gpu, kernels })
    }

    /// Tests: whether the gpu profile's one-token matmuls run on int8 activations (where the
    /// format has int8 kernels; on by default unless TORUS_INT8=0).
    pub fn set_int8(&mut self, on: bool) {
        if let Some(g) = self.kernels.matmul.gpu.as_mut() {
            g.int8 = on;
        }
    }

    /// The tuner: builds `format`'s int8 kernels (and the quantization of x) where this run's
    /// choice (TORUS_INT8, an earlier tune) left them out, so that they can be timed again.
    pub fn add_int8(&mut self, format: WFormat) -> Result<()> {
        let k = &mut self.kernels.matmul;
        if let Some(g) = k.gpu.as_mut().filter(|_| format.has_int8()) {
            if let Some(p) = g.formats.get_mut(&format).filter(|p| p.int8.is_none()) {
                p.int8 = Some(int8_pipelines(&self.gpu, &k.family, format)?);
            }
            if g.quantize_x8.is_none() {
                g.quantize_x8 = Some(quantize_pipelines(&self.gpu, &k.family)?);
            }
        }
        Ok(())
    }

    /// Whether a matmul of `format` over `m` rows runs on int8 activations.
    pub fn uses_int8(&self, format: WFormat, m: usize) -> bool {
        self.kernels.matmul.gpu.as_ref().is_some_and(|g| g.int8_for(format, m as u32))
    }

    /// Tests and the tuner: every weight format's gpu-profile matmuls follow `plan` (its GEMM
    /// variants are built where missing).
    pub fn set_gemm(&mut self, plan: GemmPlan) -> Result<()> {
        let k = &mut self.kernels.matmul;
        if let Some(g) = k.gpu.as_mut() {
            for (&f, p) in g.formats.iter_mut() {
                for v in plan.kernels() {
                    add_gemm(&self.gpu, &k.family, f, p, v)?;
                }
                p.plan = plan;
            }
        }
        Ok(())
    }

    /// The ops' dispatches for a step of `shape`, as the forward step records them; `tile`:
    /// the cpu profile's storage-x matmul tile to force.
    pub(crate) fn calls(&self, ops: &[Op], shape: StepShape, tile: Option<usize>) -> Vec<Call> {
        let RecordParams { align, win_stride } = RecordParams::new(&self.gpu);
        let rec = Recorder { kernels: &self.kernels, gpu: &self.gpu, align, win_stride, tile_override: tile };
        let mut calls = Vec::new();
        for op in ops {
            op.dispatches(&rec, &shape, |d| {
                calls.push(Call {
                    pipe: d.pipe.clone(),
                    bind: d.bind.clone(),
                    offsets: d.offsets.map_or(vec![], |o| o.to_vec()),
                    grid: d.grid,
                })
            });
        }
        calls
    }

    /// Runs one op over a step of `n` tokens and `ns` sampled rows.
    fn run_op(&self, op: Op, n: usize, ns: usize) -> Result<()> {
        let shape =
            StepShape { n_tokens: n as u32, n_sample: ns as u32, n_splits: 1, any_adjust: true, ..Default::default() };
        self.run(&self.calls(&[op], shape, None), 1).map(|_| ())
    }

    pub(crate) fn step_buffers(&self, header: StepHeader, meta: &[u32]) -> (wgpu::Buffer, wgpu::Buffer) {
        (
            self.gpu.uniform_init("step", bytemuck::bytes_of(&header)),
            self.gpu.storage_init("meta", bytemuck::cast_slice(meta)),
        )
    }

    pub(crate) fn header(n_tokens: usize, n_sample: usize) -> StepHeader {
        StepHeader {
            n_tokens: n_tokens as u32,
            n_sample: n_sample as u32,
            n_seqs: 1,
            max_blocks: 0,
            off_pos: 0,
            off_slot: 0,
            off_seq: 0,
            off_table: 0,
            n_splits: 1,
            ..Default::default()
        }
    }

    /// y = x W^T (+ bias) (+ y_init), for m rows of x, dispatched as the forward step does
    /// (cpu profile: with `tile`, the storage-x variant of MATMUL_TILES[tile]; with `uniform_x`
    /// the uniform windows the forward step plans), W split into chunks no larger than
    /// `max_binding` bytes. With `up`, runs the fused SwiGLU: silu(x G^T) * (x U^T).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        w: &QTensor,
        up: Option<&QTensor>,
        x: &[f32],
        m: usize,
        bias: Option<&[f32]>,
        y_init: Option<&[f32]>,
        tile: Option<usize>,
        uniform_x: bool,
        max_binding: u64,
    ) -> Result<Vec<f32>> {
        let g = &*self.gpu;
        let xb = self.x_buffer(x);
        let zeros = vec![0f32; m * w.rows];
        let yb = g.storage_init("y", bytemuck::cast_slice(y_init.unwrap_or(&zeros)));
        let bb = g.storage_init("bias", bytemuck::cast_slice(bias.unwrap_or(&[0.0])));
        let flags = if bias.is_some() { MAT_BIAS } else { 0 } | if y_init.is_some() { MAT_ACCUMULATE } else { 0 };
        let calls = self.matmul_calls(w, up, &xb, m, &bb, flags, &yb, tile, uniform_x, max_binding)?;
        self.run(&calls, 1)?;
        g.download_f32(&yb, m * w.rows)
    }

    /// silu(x G^T) * (x U^T) the way the forward step runs it when gate and up differ in format:
    /// the gate matmul writes y, then the up matmul's epilogue (MAT_SWIGLU_UP) combines.
    #[allow(clippy::too_many_arguments)]
    pub fn swiglu_unfused(
        &self,
        gate: &QTensor,
        up: &QTensor,
        x: &[f32],
        m: usize,
        tile: Option<usize>,
        uniform_x: bool,
        max_binding: u64,
    ) -> Result<Vec<f32>> {
        let (xb, yb, bb) = self.matmul_buffers(x, m * gate.rows);
        let mut calls = self.matmul_calls(gate, None, &xb, m, &bb, 0, &yb, tile, uniform_x, max_binding)?;
        calls.extend(self.matmul_calls(up, None, &xb, m, &bb, MAT_SWIGLU_UP, &yb, tile, uniform_x, max_binding)?);
        self.run(&calls, 1)?;
        self.gpu.download_f32(&yb, m * gate.rows)
    }

    /// Wall time of `iters` repetitions of a matmul (weights uploaded once; one submit).
    pub fn time_matmul(
        &self,
        w: &QTensor,
        up: Option<&QTensor>,
        m: usize,
        uniform_x: bool,
        iters: u64,
    ) -> Result<Duration> {
        let (xb, yb, bb) = self.matmul_buffers(&vec![0.5f32; m * w.cols], m * w.rows);
        let calls = self.matmul_calls(w, up, &xb, m, &bb, 0, &yb, None, uniform_x, self.gpu.max_binding)?;
        self.run(&calls, iters)
    }

    pub(crate) fn x_buffer(&self, x: &[f32]) -> wgpu::Buffer {
        let xb = self.gpu.activation("x", (x.len() * 4) as u64);
        self.gpu.queue.write_buffer(&xb, 0, bytemuck::cast_slice(x));
        xb
    }

    /// x, a zeroed y of `y_len` floats and a placeholder bias, for a matmul without bias.
    fn matmul_buffers(&self, x: &[f32], y_len: usize) -> (wgpu::Buffer, wgpu::Buffer, wgpu::Buffer) {
        let g = &*self.gpu;
        (self.x_buffer(x), g.storage("y", (y_len * 4) as u64), g.storage_init("bias", bytemuck::cast_slice(&[0f32])))
    }

    /// The dispatches of y (flags: MAT_*) = x W^T, m rows, as the forward step records them.
    #[allow(clippy::too_many_arguments)]
    fn matmul_calls(
        &self,
        w: &QTensor,
        up: Option<&QTensor>,
        xb: &wgpu::Buffer,
        m: usize,
        bb: &wgpu::Buffer,
        flags: u32,
        yb: &wgpu::Buffer,
        tile: Option<usize>,
        uniform_x: bool,
        max_binding: u64,
    ) -> Result<Vec<Call>> {
        let g = &*self.gpu;
        let mat = GpuMatrix::upload(g, "w", w, up, max_binding)?;
        let (step, _meta) = self.step_buffers(Self::header(m, 0), &[0]);
        let windows = g.uniform_init("windows", bytemuck::cast_slice(&window_entries(m + 1, window_stride(g))));
        let xq = g.storage("xq", matmul::xq_bytes(w.cols) * m as u64);
        let io = MatmulIo {
            step: &step,
            x: xb,
            y: yb,
            bias: bb,
            windows: uniform_x.then_some(&windows),
            cap: 0.0,
            xq: Some(&xq),
        };
        let (ops, _params) =
            matmul::matmul(&self.kernels.matmul, g, &mat, &io, (0, w.rows), flags, false, up.is_some());
        let shape = StepShape { n_tokens: m as u32, n_sample: 0, n_splits: 1, any_adjust: false, ..Default::default() };
        // The weights stay alive through the bind groups.
        Ok(self.calls(&ops, shape, tile))
    }

    /// Records `calls` `iters` times in one compute pass, submits, waits; returns the wall time.
    pub fn run(&self, calls: &[Call], iters: u64) -> Result<Duration> {
        let g = &*self.gpu;
        let mut enc = g.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            for _ in 0..iters {
                for c in calls {
                    pass.set_pipeline(&c.pipe);
                    pass.set_bind_group(0, &c.bind, &c.offsets);
                    pass.dispatch_workgroups(c.grid.0, c.grid.1, 1);
                }
            }
        }
        let t = Instant::now();
        g.queue.submit([enc.finish()]);
        g.device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| anyhow::anyhow!("GPU poll failed: {e}"))?;
        Ok(t.elapsed())
    }

    /// Embedding rows for `tokens`, the table split into chunks of at most `max_binding` bytes.
    pub fn embed(&self, table: &QTensor, tokens: &[u32], max_binding: u64) -> Result<Vec<f32>> {
        let g = &*self.gpu;
        let mat = GpuMatrix::upload(g, "embed", table, None, max_binding)?;
        let (step, meta) = self.step_buffers(Self::header(tokens.len(), 0), tokens);
        let out = g.storage("hidden", (tokens.len() * table.cols * 4) as u64);
        let dummy = g.storage("dummy", 16);
        let (ops, _params) = matmul::embed(&self.kernels.matmul, g, &mat, (1.0, false), &step, &meta, &dummy, &out);
        for op in ops {
            self.run_op(op, tokens.len(), 0)?;
        }
        g.download_f32(&out, tokens.len() * table.cols)
    }

    /// RMSNorm of m rows; with `gather`, output row r normalises input row gather[r].
    pub fn rmsnorm(&self, x: &[f32], dim: usize, weight: &[f32], eps: f32, gather: Option<&[u32]>) -> Result<Vec<f32>> {
        let g = &*self.gpu;
        let m = x.len() / dim;
        let rows = gather.map(|r| r.len()).unwrap_or(m);
        let (step, meta) =
            self.step_buffers(Self::header(m, gather.map(|r| r.len()).unwrap_or(0)), gather.unwrap_or(&[0]));
        let pb = g.uniform_init("p", bytemuck::bytes_of(&NormParams::new(dim, eps, gather.is_some(), 0)));
        let xb = g.storage_init("x", bytemuck::cast_slice(x));
        let wb = g.storage_init("w", bytemuck::cast_slice(weight));
        let yb = g.storage("y", (rows * dim * 4) as u64);
        let b = NormBinds { step: &step, p: &pb, x: &xb, weight: &wb, md: &meta, y: &yb };
        self.run_op(norm::norm(&self.kernels.norm, g, &b, gather.is_some(), dim), m, rows)?;
        g.download_f32(&yb, rows * dim)
    }

    fn sample_iters(
        &self,
        logits: &[f32],
        vocab: usize,
        params: &[SampleParams],
        iters: u64,
        with_adjust: bool,
    ) -> Result<(Vec<Sampled>, Vec<f32>, Duration)> {
        let g = &*self.gpu;
        let rows = params.len();
        let mut meta = Vec::new();
        let mut adjust = Vec::new();
        for p in params {
            meta.extend(p.words((adjust.len() / 4) as u32));
            p.push_adjust(&mut adjust);
        }
        adjust.extend([0u32; 4]);
        let (step, meta) = self.step_buffers(Self::header(rows, rows), &meta);
        let pb = g.uniform_init("p", bytemuck::bytes_of(&SamplerParams { vocab: vocab as u32, ..Default::default() }));
        let lb = g.storage_init("logits", bytemuck::cast_slice(logits));
        let ab = g.storage_init("adjust", bytemuck::cast_slice(&adjust));
        let bytes = (rows * SAMPLE_RESULT_STRIDE * 4) as u64;
        let rb = g.storage("result", bytes);
        let shape = StepShape {
            n_tokens: rows as u32,
            n_sample: rows as u32,
            n_splits: 1,
            any_adjust: true,
            ..Default::default()
        };
        let k = &self.kernels;
        let ops = [
            sample::logit_adjust(
                &k.sample,
                g,
                &AdjustBinds { step: &step, p: &pb, md: &meta, adj: &ab, logits: &lb },
                vocab,
            ),
            sample::sample(
                &k.sample,
                g,
                &SampleBinds { step: &step, p: &pb, md: &meta, logits: &lb, result: &rb },
                vocab,
            ),
        ];
        let calls = self.calls(&ops, shape, None);
        if iters > 1 {
            // Timing: the sampler alone (penalties would compound over repetitions), or with
            // the adjustment kernel (token masks only: repeating them changes nothing).
            let from = if with_adjust { 0 } else { 1 };
            return Ok((vec![], vec![], self.run(&calls[from..], iters)?));
        }
        self.run(&calls, 1)?;
        let words: Vec<u32> = bytemuck::pod_collect_to_vec(&g.download(&rb, bytes)?);
        let out = params.iter().enumerate().map(|(i, p)| Sampled::parse(&words[i * SAMPLE_RESULT_STRIDE..], p.n_top));
        Ok((out.collect(), g.download_f32(&lb, rows * vocab)?, Duration::ZERO))
    }

    /// Applies penalties/bias (logit_adjust) and samples one token per logits row (vocab wide).
    /// Also returns the adjusted logits.
    pub fn sample(&self, logits: &[f32], vocab: usize, params: &[SampleParams]) -> Result<(Vec<Sampled>, Vec<f32>)> {
        let (s, l, _) = self.sample_iters(logits, vocab, params, 1, false)?;
        Ok((s, l))
    }

    /// Wall time of `iters` sampler runs over these rows (one submit).
    pub fn time_sample(&self, logits: &[f32], vocab: usize, params: &[SampleParams], iters: u64) -> Result<Duration> {
        Ok(self.sample_iters(logits, vocab, params, iters.max(2), false)?.2)
    }

    /// Wall time of `iters` runs of the adjustment kernel and the sampler (one submit): for rows
    /// whose only adjustment is a token mask (penalties would compound over repetitions).
    pub fn time_masked_sample(
        &self,
        logits: &[f32],
        vocab: usize,
        params: &[SampleParams],
        iters: u64,
    ) -> Result<Duration> {
        if params.iter().any(|p| !p.adjust.is_empty()) {
            anyhow::bail!("time_masked_sample takes rows without penalties or bias");
        }
        Ok(self.sample_iters(logits, vocab, params, iters.max(2), true)?.2)
    }

    /// Per-head RMSNorm (Qwen3's q_norm/k_norm) of the q and k heads of qkv rows, in place;
    /// `weight` = q weights then k weights (2 * head_dim). Returns the qkv rows.
    #[allow(clippy::too_many_arguments)]
    pub fn head_norm(
        &self,
        qkv: &[f32],
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        weight: &[f32],
        eps: f32,
    ) -> Result<Vec<f32>> {
        let g = &*self.gpu;
        let n = qkv.len() / ((heads + 2 * kv_heads) * head_dim);
        let (step, _meta) = self.step_buffers(Self::header(n, 0), &[0]);
        let pb = g.uniform_init("p", bytemuck::bytes_of(&HeadNormParams::new(heads, kv_heads, head_dim, eps)));
        let wb = g.storage_init("w", bytemuck::cast_slice(weight));
        let qb = g.storage_init("qkv", bytemuck::cast_slice(qkv));
        let b = HeadNormBinds { step: &step, p: &pb, weight: &wb, qkv: &qb };
        self.run_op(norm::head_norm(&self.kernels.norm, g, &b, heads + kv_heads, head_dim), n, 0)?;
        g.download_f32(&qb, qkv.len())
    }

    /// A KV cache of `num_blocks` blocks and a RoPE table for positions below `max_pos`.
    pub fn attn_rig(&self, shape: AttnShape, num_blocks: usize, max_pos: usize, theta: f64) -> AttnRig {
        let AttnShape { heads, kv_heads, head_dim, block_size } = shape;
        let g = &*self.gpu;
        // Unscaled RoPE: inv_freq[i] = theta^(-2i / head_dim).
        let inv: Vec<f64> = (0..head_dim / 2).map(|i| 1.0 / theta.powf((2 * i) as f64 / head_dim as f64)).collect();
        let cs = rope_table(&inv, 1.0, max_pos);
        let per_block = (block_size * kv_heads * head_dim * self.kernels.kv.bytes()) as u64;
        let chunks = self.kernels.kv_chunks;
        let blocks_per_chunk = num_blocks.div_ceil(chunks);
        let bytes = blocks_per_chunk as u64 * per_block;
        AttnRig {
            blocks_per_chunk,
            heads,
            kv_heads,
            head_dim,
            block_size,
            window: 0,
            splits: None,
            tiled: None,
            sinks: None,
            k: (0..chunks).map(|_| g.storage("k", bytes)).collect(),
            v: (0..chunks).map(|_| g.storage("v", bytes)).collect(),
            cos_sin: g.storage_init("cos_sin", bytemuck::cast_slice(&cs)),
            max_pos,
        }
    }

    /// RoPE + KV write for this step's qkv rows, then paged attention. Returns (rotated q|k|v
    /// rows, attention output rows [n, heads * head_dim]).
    pub fn rope_attention(&self, rig: &AttnRig, qkv: &[f32], s: &AttnStep) -> Result<(Vec<f32>, Vec<f32>)> {
        let (r, _) = self.rope_attention_iters(rig, qkv, s, 0)?;
        Ok(r)
    }

    /// Runs rope_attention once, then times `iters` repetitions of the attention dispatch alone.
    pub fn time_attention(&self, rig: &AttnRig, qkv: &[f32], s: &AttnStep, iters: u64) -> Result<Duration> {
        Ok(self.rope_attention_iters(rig, qkv, s, iters.max(1))?.1)
    }

    #[allow(clippy::type_complexity)]
    fn rope_attention_iters(
        &self,
        rig: &AttnRig,
        qkv: &[f32],
        s: &AttnStep,
        iters: u64,
    ) -> Result<((Vec<f32>, Vec<f32>), Duration)> {
        let g = &*self.gpu;
        let n = s.positions.len();
        assert!(s.positions.iter().all(|&p| (p as usize) < rig.max_pos));
        let qkv_dim = (rig.heads + 2 * rig.kv_heads) * rig.head_dim;
        let max_blocks = s.block_tables.iter().map(|t| t.len()).max().unwrap_or(1).max(1);
        let mut meta = Vec::new();
        meta.extend(&s.positions);
        meta.extend(&s.slots);
        meta.extend(&s.seq_of_token);
        for t in &s.block_tables {
            let mut row = t.clone();
            row.resize(max_blocks, 0);
            meta.extend(row);
        }
        let header = StepHeader {
            n_tokens: n as u32,
            n_sample: 0,
            n_seqs: s.block_tables.len() as u32,
            max_blocks: max_blocks as u32,
            off_pos: 0,
            off_slot: n as u32,
            off_seq: 2 * n as u32,
            off_table: 3 * n as u32,
            n_splits: 1,
            ..Default::default()
        };
        let dims = (rig.heads, rig.kv_heads, rig.head_dim / 4);
        let max_keys = s.positions.iter().max().map_or(1, |&p| p as usize + 1);
        let splits = rig.splits.unwrap_or_else(|| attention_splits(n, max_keys, dims, 1 << 24));
        let header = StepHeader { n_splits: splits, ..header };
        let part = g.storage("part", (n * rig.heads * splits as usize * (dims.2 + 1) * 16) as u64);
        let (step, meta) = self.step_buffers(header, &meta);
        let qkv_b = g.storage_init("qkv", bytemuck::cast_slice(qkv));
        let out = g.storage("out", (n * rig.heads * rig.head_dim * 4) as u64);
        let chunk = rig.blocks_per_chunk * rig.block_size * rig.kv_heads * rig.head_dim;
        let dims = (rig.heads, rig.kv_heads, rig.head_dim);
        let rp =
            g.uniform_init("rope", bytemuck::bytes_of(&RopeParams::new(rig.heads, rig.kv_heads, rig.head_dim, chunk)));
        let ap = AttnParams::new(dims, rig.block_size, rig.window, chunk).with_sinks(rig.sinks.is_some());
        let ap = g.uniform_init("attn", bytemuck::bytes_of(&ap));
        let sinks = g.storage_init("sinks", bytemuck::cast_slice(rig.sinks.as_deref().unwrap_or(&[0.0; 4])));
        let k = &self.kernels;
        let kv = (&rig.k[..], &rig.v[..]);
        let b = RopeBinds { step: &step, p: &rp, md: &meta, cos_sin: &rig.cos_sin, qkv: &qkv_b };
        let rope = rope::rope_kv(&k.rope, g, &b, kv, dims);
        let b = AttnBinds { step: &step, p: &ap, md: &meta, qkv: &qkv_b, out: &out, part: &part, sinks: &sinks };
        let attention = attention::attention(&k.attention, g, &b, kv, dims);
        let attn_tile = match rig.tiled {
            None => attention_tiled(&self.kernels.attention, n, s.block_tables.len()),
            Some(true) => attention::tiled_tokens(&self.kernels.attention),
            Some(false) => 0,
        };
        let shape = StepShape { n_tokens: n as u32, n_splits: splits, attn_tile, n_seqs: 1, ..Default::default() };
        self.run(&self.calls(&[rope], shape, None), 1)?;
        let attention = self.calls(&[attention], shape, None);
        self.run(&attention, 1)?;
        let elapsed = if iters > 0 { self.run(&attention, iters)? } else { Duration::ZERO };
        Ok(((g.download_f32(&qkv_b, n * qkv_dim)?, g.download_f32(&out, n * rig.heads * rig.head_dim)?), elapsed))
    }
}
