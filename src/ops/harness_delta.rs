//! The kernel harness's Gated DeltaNet mixer: the four stages of a linear-attention layer after
//! its projections, built with ops/delta.rs's constructor and recorded as the forward step
//! records them, over several sequences with state slots.

use super::delta::{self, DeltaBinds, DeltaDims, DeltaParams, DeltaStage, DeltaWeights, STATE_RECORD};
use super::harness::Harness;
use super::kernels::{KernelSpec, Kernels};
use super::StepShape;
use crate::config::{KernelProfile, KvDtype};
use crate::gpu::{Gpu, WFormat};
use anyhow::{bail, Result};
use std::sync::Arc;

/// One sequence of a harness step: its state slot, its token rows (consecutive, in order) and
/// whether it starts from a zero state.
#[derive(Clone, Copy, Debug)]
pub struct DeltaSeq {
    pub slot: u32,
    pub tokens: usize,
    pub reset: bool,
    /// A slot the state before the step is copied to.
    pub backup: Option<u32>,
    /// A slot the state after its token `.1` (from its first) is copied to.
    pub snapshot: Option<(u32, u32)>,
    /// A slot its state is read from instead of its own.
    pub src: Option<u32>,
}

/// The states of every slot: [slots, conv_state] and [slots, rec_state] floats.
#[derive(Clone, Debug, PartialEq)]
pub struct DeltaSlots {
    pub conv: Vec<f32>,
    pub rec: Vec<f32>,
}

impl Harness {
    /// The f32 matmuls and Gated DeltaNet's kernels for keys of `k_dim`.
    pub fn for_delta(gpu: Arc<Gpu>, k_dim: u32, profile: KernelProfile) -> Result<Harness> {
        let spec = KernelSpec {
            formats: vec![WFormat::F32],
            moe_formats: vec![],
            head_dim: 64,
            group: 1,
            kv: KvDtype::default(),
            kv_chunks: 1,
            profile,
            delta_k_dim: Some(k_dim),
            int8: None,
            more_attn: vec![],
        };
        Ok(Harness { kernels: Kernels::new(&gpu, &spec)?, gpu })
    }

    /// The mixer's outputs [tokens, value_dim] for the projections `x` ([tokens, proj_width],
    /// the sequences' rows one after another), from and into the slots' states `st`.
    pub fn delta(
        &self,
        d: &DeltaDims,
        w: &DeltaWeights,
        x: &[f32],
        seqs: &[DeltaSeq],
        st: &mut DeltaSlots,
        (eps, tiled): (f32, bool),
    ) -> Result<Vec<f32>> {
        self.delta_iters(d, w, x, seqs, st, (eps, tiled), 1).map(|r| r.0)
    }

    /// Wall time of `iters` repetitions of the mixer's four stages over the step (one submit;
    /// the states advance each time).
    #[allow(clippy::too_many_arguments)]
    pub fn time_delta(
        &self,
        d: &DeltaDims,
        w: &DeltaWeights,
        x: &[f32],
        seqs: &[DeltaSeq],
        st: &mut DeltaSlots,
        iters: u64,
    ) -> Result<std::time::Duration> {
        self.delta_iters(d, w, x, seqs, st, (1e-6, false), iters).map(|r| r.1)
    }

    #[allow(clippy::too_many_arguments)]
    fn delta_iters(
        &self,
        d: &DeltaDims,
        w: &DeltaWeights,
        x: &[f32],
        seqs: &[DeltaSeq],
        st: &mut DeltaSlots,
        (eps, tiled): (f32, bool),
        iters: u64,
    ) -> Result<(Vec<f32>, std::time::Duration)> {
        let g = &*self.gpu;
        let n: usize = seqs.iter().map(|s| s.tokens).sum();
        let slots = st.rec.len() / d.rec_state().max(1);
        if x.len() != n * d.proj_width()
            || st.conv.len() != slots * d.conv_state()
            || seqs.iter().any(|s| {
                s.slot as usize >= slots
                    || s.backup.is_some_and(|b| b as usize >= slots)
                    || s.snapshot.is_some_and(|(b, at)| b as usize >= slots || at as usize >= s.tokens)
                    || s.src.is_some_and(|b| b as usize >= slots)
            })
        {
            bail!("delta: x, the states or a slot do not match {n} tokens and {slots} slots");
        }
        let mut meta = Vec::new();
        let mut first = 0;
        for s in seqs {
            let (snap, at) = s.snapshot.unwrap_or((delta::NO_SLOT, 0));
            let none = delta::NO_SLOT;
            let src = s.src.unwrap_or(none);
            meta.extend([
                s.slot,
                first as u32,
                s.tokens as u32,
                s.reset as u32,
                s.backup.unwrap_or(none),
                snap,
                at,
                src,
            ]);
            first += s.tokens;
        }
        debug_assert_eq!(meta.len(), seqs.len() * STATE_RECORD);
        let mut header = Self::header(n, 0);
        header.n_seqs = seqs.len() as u32;
        let (step, md) = self.step_buffers(header, &meta);
        let mut wv = [w.conv, w.a, w.dt_bias, w.norm].concat();
        wv.push(0.0);
        let wb = g.storage_init("delta_w", bytemuck::cast_slice(&wv));
        let xb = g.storage_init("x", bytemuck::cast_slice(x));
        let conv = g.storage_init("conv_state", bytemuck::cast_slice(&st.conv));
        let rec = g.storage_init("rec_state", bytemuck::cast_slice(&st.rec));
        let out = g.storage("out", (n * d.value_dim() * 4).max(16) as u64);
        let chunks = g.storage("chunks", (n * d.chunk_width() * 4).max(16) as u64);
        let p = DeltaParams::new(d, eps, 0, 0, tiled);
        let pb = g.uniform_init("p", bytemuck::bytes_of(&p));
        let b = DeltaBinds {
            step: &step,
            p: &pb,
            md: &md,
            w: &wb,
            x: &xb,
            conv_state: &conv,
            rec_state: &rec,
            out: &out,
            chunks: &chunks,
        };
        let ops = DeltaStage::mixer()
            .iter()
            .map(|&stage| delta::delta(self.kernels.delta.as_ref(), g, &b, stage, stage.per_unit(d, 0)))
            .collect::<Result<Vec<_>>>()?;
        let shape = StepShape { n_tokens: n as u32, n_seqs: seqs.len() as u32, n_splits: 1, ..Default::default() };
        let t = self.run(&self.calls(&ops, shape, None), iters)?;
        st.conv = g.download_f32(&conv, st.conv.len())?;
        st.rec = g.download_f32(&rec, st.rec.len())?;
        Ok((g.download_f32(&out, n * d.value_dim())?, t))
    }

    /// out * sigmoid(gate), elementwise over `n` rows of `width` (the attention's output gate).
    pub fn attn_gate(&self, gate: &[f32], out: &[f32], width: usize) -> Result<Vec<f32>> {
        let g = &*self.gpu;
        let n = out.len() / width;
        let (step, md) = self.step_buffers(Self::header(n, 0), &[0]);
        let d = DeltaDims { k_heads: 1, v_heads: 1, k_dim: 4, v_dim: 4, kernel: 4 };
        let pb = g.uniform_init("p", bytemuck::bytes_of(&DeltaParams::new(&d, 1e-6, 0, width, false)));
        let xb = g.storage_init("gate", bytemuck::cast_slice(gate));
        let ob = g.storage_init("out", bytemuck::cast_slice(out));
        // Unused here; distinct, as no two writable bindings may alias.
        let dummy = [g.storage("dummy", 16), g.storage("dummy", 16), g.storage("dummy", 16), g.storage("dummy", 16)];
        let b = DeltaBinds {
            step: &step,
            p: &pb,
            md: &md,
            w: &dummy[0],
            x: &xb,
            conv_state: &dummy[1],
            rec_state: &dummy[2],
            out: &ob,
            chunks: &dummy[3],
        };
        let op = delta::delta(self.kernels.delta.as_ref(), g, &b, DeltaStage::Gate, width as u32)?;
        let shape = StepShape { n_tokens: n as u32, n_splits: 1, ..Default::default() };
        self.run(&self.calls(&[op], shape, None), 1)?;
        g.download_f32(&ob, out.len())
    }
}
