//! The model on the GPU: weights, KV cache, activation scratch and the recorded forward step.
//! One `step` = upload the step's metadata, one compute pass with every layer's dispatches and
//! the sampler, one submit, one small readback of (token id, logprob) per sampled row.

use crate::config::KernelProfile;
use crate::gpu::shared::StepHeader;
use crate::gpu::Gpu;
use crate::model::blocks::delta_net::{state_buffers, state_records};
use crate::model::builder::*;
use crate::model::config::ModelConfig;
use crate::model::loader::HostModel;
use crate::model::plan::*;
use crate::model::record::record_step;
use crate::model::scratch::*;
use crate::model::step::*;
use crate::model::validate::*;
use crate::ops::kernels::{KernelSpec, Kernels};
use crate::ops::matmul::tiles::MATMUL_TILES;
use crate::ops::*;
use crate::sampling::row::*;
use crate::sampling::row::{MAX_TOP_LOGPROBS, SAMPLE_PARAMS_STRIDE, SAMPLE_RESULT_STRIDE};
use crate::weights::upload::*;
use anyhow::{bail, Result};
use std::sync::Arc;

/// The embedding and the LM head on a device, as an MTP head shares them with its model.
pub type SharedIo = (GpuMatrix, GpuMatrix);

/// The model, or one pipeline stage of it: layers `layers` of `cfg.layers`. The first stage
/// also embeds tokens; the last also applies the final norm, the LM head and the sampler.
pub struct Model {
    /// Test-only (`exec::Fault::StepGpuError`): the next step raises a wgpu validation error.
    #[doc(hidden)]
    pub provoke_gpu_error: bool,
    pub cfg: ModelConfig,
    pub gpu: Arc<Gpu>,
    pub limits: StepLimits,
    pub layers: std::ops::Range<usize>,
    /// KV cache of this stage's attention layers only.
    pub kv: KvCache,
    /// Recurrent-state slots of this stage's recurrent layers (0: it has none), one per
    /// sequence of a step at most.
    pub state_slots: usize,
    off_state: usize,
    /// What this model (or stage) allocated on its device.
    pub plan: MemoryPlan,
    kernels: Kernels,
    ops: Vec<Op>,
    step_buf: wgpu::Buffer,
    meta_buf: wgpu::Buffer,
    /// Host copies of the step metadata and logit adjustments, reused every step.
    meta_scratch: Vec<u32>,
    adjust_scratch: Vec<u32>,
    adjust_buf: wgpu::Buffer,
    adjust_cap: usize,
    /// vec4s of the split attention's partial results (gpu profile; 0 on the cpu profile).
    part_vec4: usize,
    /// The model's attention geometries (the split count of a step fits every one).
    geoms: Vec<crate::model::config::AttnGeom>,
    /// The device's uniform-offset alignment and window stride (read once, not every step).
    record: RecordParams,
    header: StepHeader,
    /// Most tokens and sampled rows of one sub-step (a step larger than that runs in several).
    pub(crate) sub_tokens: usize,
    sub_seqs: usize,
    off_sample: usize,
    off_params: usize,
    pub logits: wgpu::Buffer,
    result: wgpu::Buffer,
    readback: wgpu::Buffer,
    /// The hidden states of every token (input of a later stage, output of an earlier one).
    hidden: wgpu::Buffer,
    hidden_readback: Option<wgpu::Buffer>,
    /// An MTP head's input: each token's hidden state (model/blocks/mtp.rs); None for any other model.
    mtp_rows: Option<wgpu::Buffer>,
    /// The embedding and LM head (whole model only), for an MTP head to share.
    io: Option<SharedIo>,
    /// The last stage also reads back every token's residual after the last layer (an MTP head
    /// reads it; embeddings pool it): its readback buffer while on, and what the last step gave
    /// (model/emit.rs).
    pub(crate) emit: Option<wgpu::Buffer>,
    pub(crate) emitted: Vec<u8>,
    /// The final norm's weights as the head applies them (last stage only; empty otherwise), for
    /// pooling the emitted residuals into embeddings on the host.
    pub(crate) final_norm: Vec<f32>,
    /// The per-kernel profile, while it is on.
    profiler: Option<crate::model::profile::Profiler>,
    // Weights and scratch stay alive as long as the bind groups that use them.
    _keep: Vec<wgpu::Buffer>,
    _matrices: Vec<GpuMatrix>,
}

impl Model {
    /// Whether this model's one-token matmuls run on int8 activations (the gpu profile, where
    /// `ops::kernels::int8_wanted` built them for one of its formats).
    pub fn runs_int8(&self) -> bool {
        self.kernels.matmul.gpu.as_ref().is_some_and(|g| g.int8 && g.quantize_x8.is_some())
    }

    /// The whole model on one device.
    pub fn new(gpu: Arc<Gpu>, host: &HostModel, limits: StepLimits) -> Result<Model> {
        Model::new_stage(gpu, host, limits, 0..host.cfg.layers)
    }

    /// Layers `layers` of `host` on one device (a pipeline stage): the step layout and its
    /// binding limits, the KV cache, the memory plan (checked before anything is allocated), the
    /// scratch buffers, then the ops of the embedding, every layer and the head.
    pub fn new_stage(
        gpu: Arc<Gpu>,
        host: &HostModel,
        limits: StepLimits,
        layers: std::ops::Range<usize>,
    ) -> Result<Model> {
        Model::build(gpu, host, limits, layers, None, None)
    }

    /// A Qwen3.5 MTP head (model/blocks/mtp.rs) as a one-layer model: `run` takes each token's hidden
    /// state (normed by the model's final norm) beside its token. `io`: the model's embedding and
    /// LM head on this device (`Model::io`), used instead of the head's own copies.
    pub fn new_mtp(
        gpu: Arc<Gpu>,
        head: &crate::model::blocks::mtp::HostMtp,
        limits: StepLimits,
        io: Option<SharedIo>,
    ) -> Result<Model> {
        Model::build(gpu, &head.model, limits, 0..1, Some(head), io)
    }

    /// The embedding and LM head on the device (the whole model only), for an MTP head to share.
    /// The pipelines the model runs (tests and tools read which GEMM plan was built).
    pub fn kernels(&self) -> &Kernels {
        &self.kernels
    }

    pub fn io(&self) -> Option<SharedIo> {
        self.io.clone()
    }

    fn build(
        gpu: Arc<Gpu>,
        host: &HostModel,
        mut limits: StepLimits,
        layers: std::ops::Range<usize>,
        mtp: Option<&crate::model::blocks::mtp::HostMtp>,
        io: Option<SharedIo>,
    ) -> Result<Model> {
        let cfg = host.cfg.clone();
        let last_stage = layers.end == cfg.layers;
        if layers.start >= layers.end || layers.end > cfg.layers {
            bail!("stage layers {}..{} are outside the model's {} layers", layers.start, layers.end, cfg.layers);
        }
        if !host.holds(&layers) {
            bail!("layers {}..{} were not loaded from {}", layers.start, layers.end, host.source.display());
        }
        let (first, last) = (layers.start == 0, layers.end == cfg.layers);
        check_stage(&cfg, &layers)?;
        if limits.max_binding == 0 || limits.max_binding > gpu.max_binding {
            limits.max_binding = gpu.max_binding;
        }
        limits.max_seqs = limits.max_seqs.min(limits.max_tokens).max(1);
        // Blocks that left the window are freed only when every layer has it.
        limits.sliding_window = cfg.uniform_window();
        limits.profile = limits.profile.resolve(gpu.info.device_type == wgpu::DeviceType::Cpu);
        let g = &*gpu;

        let layout = StepLayout::new(&cfg, &limits, last, loop_tokens(&gpu, &cfg, &limits)?)?;
        let kv_plan = KvPlan::new(&cfg, &limits, g.kv_chunk_limit(), layout.header.max_blocks as usize)?;
        let mut scratch_plan = ScratchPlan::new(&cfg, &limits, &layout, last);
        // An MTP head's input rows.
        if mtp.is_some() {
            scratch_plan.bytes += (layout.t_max * cfg.hidden * 4) as u64;
        }
        let attn_layers = cfg.attn_layers_in(layers.clone());
        // A slot per sequence a step can hold.
        let state_slots = if attn_layers < layers.len() { limits.max_seqs } else { 0 };
        let plan = MemoryPlan {
            weights: stage_weight_bytes(host, &layers)
                + mtp.map_or(0, |m| (m.fc_embed.bytes() + m.fc_hidden.bytes() + 8 * m.hnorm.len()) as u64),
            kv_cache: kv_plan.bytes(&kv_dims(&cfg, layers.clone()), limits.block_size),
            state: cfg.linear.as_ref().map_or(0, |l| l.slot_bytes(layers.clone()) * state_slots as u64),
            scratch: scratch_plan.bytes(),
        };
        // Streamed weights are in host memory one layer (or the embedding, or the LM head) at a
        // time; loaded ones are there already.
        let host_read = if host.streams_layers() { host.largest_read_bytes() } else { 0 };
        crate::model::fit::check(&host.source, g, &plan, host_read)?;
        let kv = kv_plan.allocate(g, &kv_dims(&cfg, layers.clone()), limits.block_size);
        let states = state_buffers(g, &cfg, layers.clone(), state_slots, limits.max_binding)?;
        let kernels = Kernels::new(
            g,
            &KernelSpec {
                formats: stage_formats(host, mtp, io.as_ref()),
                moe_formats: host.moe_formats(),
                head_dim: cfg.head_dim as u32,
                group: cfg.base_geom().group() as u32,
                more_attn: cfg.geoms().iter().map(|g| (g.head_dim as u32, g.group() as u32)).collect(),
                kv: limits.kv_dtype,
                kv_chunks: kv_plan.chunks,
                profile: limits.profile,
                delta_k_dim: delta_dims(&cfg).map(|(d, _)| d.k_dim as u32),
                int8: limits.int8,
            },
        )?;
        let scratch = Scratch::new(g, &cfg, &limits, &layout, &scratch_plan, last);

        let mut b = OpBuilder {
            g,
            cfg: &cfg,
            kernels: &kernels,
            s: &scratch,
            mb: limits.max_binding,
            // TORUS_NO_UNIFORM_X=1 turns the uniform-x matmul variant off (for comparisons).
            uniform_x: g.uniform_x_ok() && std::env::var_os("TORUS_NO_UNIFORM_X").is_none(),
            ops: Vec::new(),
            keep: Vec::new(),
            matrices: Vec::new(),
            xq: None,
        };
        let (shared_embed, shared_lm) = io.unzip();
        let embed = match (shared_embed, first || (last && host.tied)) {
            (Some(e), true) => Some(e),
            (None, true) => match host.read_embed()? {
                Some(t) => Some(GpuMatrix::upload(g, "embed", &t, None, limits.max_binding)?),
                None => bail!("the embedding was not loaded from {}", host.source.display()),
            },
            (_, false) => None,
        };
        let lp = LayerParams::new(&mut b, &limits, &kv_plan, (layout.off_sample, layout.off_state));
        if let Some(e) = embed.as_ref().filter(|_| first) {
            b.embed(e);
            if let Some(p) = &host.ple {
                b.ple_inputs(p)?;
            }
        }
        let mtp_rows = mtp.map(|_| g.storage("mtp_rows", (layout.t_max * cfg.hidden * 4) as u64));
        if let (Some(head), Some(rows)) = (mtp, &mtp_rows) {
            b.mtp_input(head, &lp, rows)?;
        }
        b.layers(host, &layers, &lp, (&kv, &states))?;
        let embed_io = embed.clone().filter(|_| first);
        let mut io = None;
        if last {
            b.head(host, embed, &lp, layout.off_params, shared_lm)?;
            // The head's LM head is the last matrix it uploaded (or shared).
            io = embed_io.zip(b.matrices.last().cloned());
        } else {
            b.matrices.extend(embed);
        }
        let OpBuilder { ops, keep, matrices, .. } = b;
        g.release_staging()?;
        let geoms = cfg.geoms();

        Ok(Model {
            cfg,
            gpu: gpu.clone(),
            limits,
            layers,
            kv,
            state_slots,
            off_state: layout.off_state,
            plan,
            kernels,
            ops,
            meta_scratch: vec![0; layout.meta_len],
            adjust_scratch: Vec::new(),
            adjust_cap: layout.adjust_cap,
            part_vec4: scratch_plan.part_vec4,
            geoms,
            record: RecordParams::new(g),
            header: layout.header,
            sub_tokens: layout.t_max,
            sub_seqs: layout.s_max,
            off_sample: layout.off_sample,
            off_params: layout.off_params,
            step_buf: scratch.step_buf,
            meta_buf: scratch.meta_buf,
            adjust_buf: scratch.adjust_buf,
            logits: scratch.logits,
            result: scratch.result,
            readback: scratch.readback,
            hidden: scratch.hidden,
            hidden_readback: scratch.hidden_readback,
            mtp_rows,
            io,
            emit: None,
            emitted: Vec::new(),
            final_norm: if last_stage { host.final_norm.clone() } else { Vec::new() },
            _keep: [keep, scratch.keep, states.into_iter().flat_map(|(c, r)| [c, r]).collect()].concat(),
            _matrices: matrices,
            provoke_gpu_error: false,
            profiler: None,
        })
    }

    /// Turns the per-kernel profile on (from zero) or off: while on, every step times each op
    /// (see model/profile.rs).
    pub fn set_profiling(&mut self, on: bool) {
        self.profiler = on.then(|| crate::model::profile::Profiler::new(&self.gpu));
    }

    /// What the profiled steps spent per op label since profiling was turned on.
    pub fn profile(&self) -> Option<crate::model::profile::StepProfile> {
        self.profiler.as_ref().map(|p| p.report())
    }

    /// What a step given to this model may hold.
    pub fn bounds(&self) -> StepBounds {
        StepBounds {
            max_tokens: self.limits.max_tokens,
            max_seqs: self.limits.max_seqs,
            max_seq_len: self.limits.max_seq_len,
            block_size: self.limits.block_size,
            num_blocks: self.kv.num_blocks,
            max_blocks: self.header.max_blocks as usize,
            adjust_cap: self.adjust_cap,
            vocab: self.cfg.vocab,
            hidden: self.cfg.hidden,
            first: self.is_first(),
            state_slots: self.state_slots,
        }
    }

    /// Most tokens and sampled rows one sub-step holds: a larger step runs as several.
    pub fn sub_step_limits(&self) -> (usize, usize) {
        (self.sub_tokens, self.sub_seqs)
    }

    pub fn is_first(&self) -> bool {
        self.layers.start == 0
    }

    pub fn is_last(&self) -> bool {
        self.layers.end == self.cfg.layers
    }

    /// Runs one forward step of the whole model and samples one token per sample row.
    pub fn step(&mut self, s: &StepInput) -> Result<Vec<Sampled>> {
        match self.run(s, None)? {
            StageOutput::Sampled(r) => Ok(r),
            StageOutput::Hidden(_) => bail!("step() needs the whole model; this stage holds layers {:?}", self.layers),
        }
    }

    /// Runs this stage's part of one step. `hidden` is the previous stage's output ([tokens,
    /// hidden] f32 bytes), required unless this is the first stage.
    ///
    /// Checked before anything is written; the GPU work runs inside error scopes, so a wgpu
    /// error or a lost device fails this call (`GpuFault`) instead of passing unnoticed.
    pub fn run(&mut self, s: &StepInput, hidden: Option<&[u8]>) -> Result<StageOutput> {
        // Nothing reaches the device before the whole step is known to stay inside this
        // model's cache and buffers.
        let mut bounds = self.bounds();
        // An MTP head takes hidden states beside its tokens.
        bounds.first &= self.mtp_rows.is_none();
        bounds.check(s, hidden.map(<[u8]>::len))?;
        let gpu = self.gpu.clone();
        gpu.scoped(|| {
            if std::mem::take(&mut self.provoke_gpu_error) {
                gpu.provoke_validation_error();
            }
            self.run_checked(s, hidden)
        })
    }

    pub(crate) fn run_checked(&mut self, s: &StepInput, hidden: Option<&[u8]>) -> Result<StageOutput> {
        self.emitted.clear();
        let ranges = sub_steps(&s.sample_rows, s.tokens.len(), self.sub_tokens, self.sub_seqs);
        if ranges.len() == 1 {
            return self.run_one(s, hidden);
        }
        // Sub-steps in token order; each samples the rows that fall in it.
        let row = self.cfg.hidden * 4;
        let mut hidden_out = Vec::new();
        let mut sampled: Vec<(usize, Sampled)> = Vec::new();
        for (a, b) in ranges {
            let pick: Vec<usize> =
                (0..s.sample_rows.len()).filter(|&i| (a..b).contains(&(s.sample_rows[i] as usize))).collect();
            let sub = StepInput {
                tokens: s.tokens[a..b].to_vec(),
                positions: s.positions[a..b].to_vec(),
                slots: s.slots[a..b].to_vec(),
                seq_of_token: s.seq_of_token[a..b].to_vec(),
                block_tables: s.block_tables.clone(),
                sample_rows: pick.iter().map(|&i| s.sample_rows[i] - a as u32).collect(),
                sampling: pick.iter().map(|&i| s.sampling[i].clone()).collect(),
                state_slots: sub_step_states(s, (a, b)),
            };
            match self.run_one(&sub, hidden.map(|h| &h[a * row..b * row]))? {
                StageOutput::Hidden(h) => hidden_out.extend(h),
                StageOutput::Sampled(r) => sampled.extend(pick.into_iter().zip(r)),
            }
        }
        if !self.is_last() {
            return Ok(StageOutput::Hidden(hidden_out));
        }
        sampled.sort_by_key(|(i, _)| *i);
        Ok(StageOutput::Sampled(sampled.into_iter().map(|(_, r)| r).collect()))
    }

    /// One sub-step: at most `sub_tokens` tokens and `sub_seqs` sampled rows.
    pub(crate) fn run_one(&mut self, s: &StepInput, hidden: Option<&[u8]>) -> Result<StageOutput> {
        let want = s.tokens.len() * self.cfg.hidden * 4;
        match (self.is_first(), hidden) {
            (true, None) if self.mtp_rows.is_none() => {}
            (true, Some(h)) if h.len() == want && self.mtp_rows.is_some() => {
                self.gpu.queue.write_buffer(self.mtp_rows.as_ref().expect("checked"), 0, h)
            }
            (false, Some(h)) if h.len() == want => self.gpu.queue.write_buffer(&self.hidden, 0, h),
            (false, Some(h)) => {
                bail!("hidden states of {} bytes, expected {want} ({} tokens)", h.len(), s.tokens.len())
            }
            (false, None) => bail!("stage {:?} needs the previous stage's hidden states", self.layers),
            (true, _) => bail!("the first stage takes hidden states only as an MTP head, one per token"),
        }
        let n = s.tokens.len() as u32;
        let ns = s.sample_rows.len() as u32;
        self.header.n_tokens = n;
        self.header.n_sample = ns;
        self.header.n_seqs = s.block_tables.len() as u32;
        // Keys the longest-reaching token attends to (its window, with a sliding window).
        let max_keys = s.positions.iter().max().map_or(1, |&p| p as usize + 1);
        let max_keys = self.limits.sliding_window.map_or(max_keys, |w| max_keys.min(w.max(1)));
        // One count for every layer: the fewest any geometry allows (each fits the partials).
        self.header.n_splits = self
            .geoms
            .iter()
            .map(|g| attention_splits(n as usize, max_keys, (g.heads, g.kv_heads, g.head_dim / 4), self.part_vec4))
            .min()
            .unwrap_or(1);
        // Keys attended by all tokens (the ops' cost model).
        let window = self.limits.sliding_window.unwrap_or(usize::MAX).max(1) as u64;
        let attn_keys = s.positions.iter().map(|&p| (p as u64 + 1).min(window)).sum();
        let h = self.header;
        // Reused every step: no per-step allocation of the metadata or adjustment words.
        let meta = &mut self.meta_scratch;
        let t = self.sub_tokens;
        meta[..n as usize].copy_from_slice(&s.tokens);
        meta[t..t + n as usize].copy_from_slice(&s.positions);
        meta[2 * t..2 * t + n as usize].copy_from_slice(&s.slots);
        meta[3 * t..3 * t + n as usize].copy_from_slice(&s.seq_of_token);
        let adjust = &mut self.adjust_scratch;
        adjust.clear();
        // Sample rows, their parameters and logit adjustments matter to the last stage only.
        if self.layers.end == self.cfg.layers {
            meta[self.off_sample..self.off_sample + ns as usize].copy_from_slice(&s.sample_rows);
            for (i, p) in s.sampling.iter().enumerate() {
                let b = self.off_params + SAMPLE_PARAMS_STRIDE * i;
                meta[b..b + SAMPLE_PARAMS_STRIDE].copy_from_slice(&p.words((adjust.len() / 4) as u32));
                p.push_adjust(adjust);
            }
        }
        if self.state_slots > 0 {
            state_records(&mut meta[self.off_state..], s);
        }
        let mb = h.max_blocks as usize;
        for (i, tbl) in s.block_tables.iter().enumerate() {
            let b = h.off_table as usize + i * mb;
            meta[b..b + tbl.len()].copy_from_slice(tbl);
            meta[b + tbl.len()..b + mb].fill(0);
        }
        let g = &self.gpu;
        // Only the used part of the tables (and the state records) is uploaded.
        let used = match self.state_slots {
            0 => h.off_table as usize + s.block_tables.len() * mb,
            _ => self.off_state + s.block_tables.len() * crate::ops::delta::STATE_RECORD,
        };
        g.queue.write_buffer(&self.meta_buf, 0, bytemuck::cast_slice(&meta[..used]));
        g.queue.write_buffer(&self.step_buf, 0, bytemuck::bytes_of(&h));
        if !adjust.is_empty() {
            g.queue.write_buffer(&self.adjust_buf, 0, bytemuck::cast_slice(adjust));
        }
        let any_adjust = !adjust.is_empty();

        let RecordParams { align, win_stride } = self.record;
        let rec = Recorder { kernels: &self.kernels, gpu: g, align, win_stride, tile_override: None };
        let attn_tile = attention_tiled(&self.kernels.attention, n as usize, s.block_tables.len());
        let n_seqs = h.n_seqs;
        let shape =
            StepShape { n_tokens: n, n_sample: ns, n_splits: h.n_splits, attn_tile, any_adjust, attn_keys, n_seqs };
        let mut enc = match &mut self.profiler {
            Some(p) => p.record(g, &rec, &self.ops, &shape)?,
            None => record_step(g, &rec, &self.ops, &shape, self.limits.profile == KernelProfile::Gpu),
        };
        if let Some(rb) = &self.hidden_readback {
            enc.copy_buffer_to_buffer(&self.hidden, 0, rb, 0, want as u64);
            g.submit(enc);
            let out = g.read_mapped(rb, want as u64)?;
            if let Some(p) = &mut self.profiler {
                p.collect(g)?;
            }
            return Ok(StageOutput::Hidden(out));
        }
        if let Some(rb) = &self.emit {
            enc.copy_buffer_to_buffer(&self.hidden, 0, rb, 0, want as u64);
        }
        if ns == 0 {
            g.submit(enc);
            if let Some(rb) = &self.emit {
                self.emitted.extend(g.read_mapped(rb, want as u64)?);
            }
            if let Some(p) = &mut self.profiler {
                p.collect(g)?;
            }
            return Ok(StageOutput::Sampled(vec![]));
        }
        // Read back only as many words per row as the rows asked for.
        let max_top = s.sampling.iter().map(|p| p.n_top.min(MAX_TOP_LOGPROBS as u32)).max().unwrap_or(0) as usize;
        let len = (((ns as usize - 1) * SAMPLE_RESULT_STRIDE + 2 + 2 * max_top) * 4) as u64;
        enc.copy_buffer_to_buffer(&self.result, 0, &self.readback, 0, len);
        g.submit(enc);
        let bytes = g.read_mapped(&self.readback, len)?;
        if let Some(rb) = &self.emit {
            self.emitted.extend(g.read_mapped(rb, want as u64)?);
        }
        if let Some(p) = &mut self.profiler {
            p.collect(g)?;
        }
        // A Vec<u8> need not be 4-byte aligned: copy into words rather than cast in place.
        let words: Vec<u32> = bytemuck::pod_collect_to_vec(&bytes);
        Ok(StageOutput::Sampled(
            s.sampling
                .iter()
                .enumerate()
                .map(|(i, p)| Sampled::parse(&words[i * SAMPLE_RESULT_STRIDE..], p.n_top))
                .collect(),
        ))
    }

    /// Runs a step of each matmul tile's size on scratch block 0 so every pipeline is
    /// compiled by the driver before the first request (Mesa compiles at first dispatch).
    pub fn warm_up(&mut self) -> Result<()> {
        for (tm, _) in MATMUL_TILES {
            let len = (tm as usize).min(self.limits.max_tokens).min(self.limits.block_size);
            let pos: Vec<u32> = (0..len as u32).collect();
            let hidden = (!self.is_first() || self.mtp_rows.is_some()).then(|| vec![0u8; len * self.cfg.hidden * 4]);
            let step = StepInput {
                tokens: vec![0; len],
                positions: pos.clone(),
                slots: pos,
                seq_of_token: vec![0; len],
                block_tables: vec![vec![0]],
                sample_rows: vec![len as u32 - 1],
                sampling: vec![SampleParams {
                    temperature: 1.0,
                    top_p: 0.9,
                    top_k: 5,
                    min_p: 0.05,
                    u: 0.5,
                    n_top: 2,
                    adjust: vec![Adjust { id: 1, count: 1, in_prompt: true, bias: 0.5 }],
                    repetition_penalty: 1.1,
                    ..Default::default()
                }],
                state_slots: Vec::new(),
            };
            self.run(&step, hidden.as_deref())?;
        }
        // Every pipeline is compiled now: keep the driver's cache for the next start.
        self.gpu.save_pipeline_cache();
        Ok(())
    }

    /// The logits of the last step's sampled rows, [n_sample, vocab] (tests and tools); of a step
    /// run in sub-steps, those of the last sub-step's rows.
    pub fn last_logits(&self, n_sample: usize) -> Result<Vec<f32>> {
        self.gpu.download_f32(&self.logits, n_sample * self.cfg.vocab)
    }
}

/// The weight formats a stage's matmuls read: its host model's, an MTP head's input stage's,
/// and those of the embedding and LM head it shares.
fn stage_formats(
    host: &HostModel,
    mtp: Option<&crate::model::blocks::mtp::HostMtp>,
    io: Option<&SharedIo>,
) -> Vec<crate::gpu::wformat::WFormat> {
    let mut f = host.formats();
    f.extend(mtp.iter().flat_map(|m| [m.fc_embed.format, m.fc_hidden.format]));
    f.extend(io.iter().flat_map(|(e, l)| [e.format, l.format]));
    f.sort();
    f.dedup();
    f
}
