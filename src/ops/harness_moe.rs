//! The kernel harness's mixture-of-experts block: the router matmul, the routing and the
//! expert ops built with ops/moe/'s constructors, recorded as the forward step records them.

use super::harness::{Call, Harness};
use super::matmul::{self, MatmulIo, MAT_BIAS};
use super::moe::{self, MoeIo, MoeSpec, RouteLayout};
use super::StepShape;
use crate::weights::tensor::QTensor;
use crate::weights::upload::GpuMatrix;
use anyhow::{bail, Result};
use std::time::Duration;

/// One MoE block's weights on the host (see `moe::moe_ref` for their layout).
pub struct MoeWeights<'a> {
    pub router: &'a QTensor,
    pub router_bias: Option<&'a [f32]>,
    pub gate_up: &'a QTensor,
    pub down: &'a QTensor,
    /// Per-expert biases of gate/up and of down.
    pub biases: Option<(&'a [f32], &'a [f32])>,
}

impl Harness {
    /// Tests and the tuner: whether the gpu profile's prefill-sized MoE steps run the tiled
    /// expert kernels (built here where missing; the cpu profile has none).
    pub fn set_moe_tiled(&mut self, on: bool) -> Result<()> {
        let gpu_profile = self.kernels.matmul.gpu.is_some();
        let k = &mut self.kernels.moe;
        for (&f, p) in k.formats.iter_mut() {
            if on && gpu_profile && p.tiled.is_none() {
                p.tiled = Some(moe::tiled_pipelines(&self.gpu, &k.family, f)?);
            }
            p.use_tiled = on && p.tiled.is_some();
        }
        Ok(())
    }

    /// y_init + the MoE block's output for `t` rows of `x`, the expert tensors split into chunks
    /// of whole experts within `max_binding` bytes.
    pub fn moe(
        &self,
        spec: &MoeSpec,
        w: &MoeWeights,
        x: &[f32],
        t: usize,
        y_init: &[f32],
        max_binding: u64,
    ) -> Result<Vec<f32>> {
        let (calls, hidden, _keep) = self.moe_calls(spec, w, x, t, y_init, max_binding)?;
        self.run(&calls, 1)?;
        self.gpu.download_f32(&hidden, t * w.router.cols)
    }

    /// Wall time of `iters` repetitions of the MoE block over `t` rows (one submit).
    pub fn time_moe(&self, spec: &MoeSpec, w: &MoeWeights, t: usize, iters: u64) -> Result<Duration> {
        let h = w.router.cols;
        let x: Vec<f32> = (0..t * h).map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0).collect();
        let (calls, _hidden, _keep) = self.moe_calls(spec, w, &x, t, &vec![0.0; t * h], self.gpu.max_binding)?;
        self.run(&calls, iters)
    }

    #[allow(clippy::type_complexity)]
    fn moe_calls(
        &self,
        spec: &MoeSpec,
        w: &MoeWeights,
        x: &[f32],
        t: usize,
        y_init: &[f32],
        max_binding: u64,
    ) -> Result<(Vec<Call>, wgpu::Buffer, Vec<GpuMatrix>)> {
        let g = &*self.gpu;
        let h = w.router.cols;
        if x.len() != t * h || y_init.len() != t * h || w.router.rows != spec.experts {
            bail!("moe: x, y_init or the router do not match {t} rows of {h} and {} experts", spec.experts);
        }
        let xb = self.x_buffer(x);
        let hidden = g.storage_init("hidden", bytemuck::cast_slice(y_init));
        let logits = g.storage("moe_logits", (t * spec.experts * 4) as u64);
        let layout = RouteLayout::new(t, spec.experts, spec.top_k);
        let route = g.storage("moe_route", (layout.words * 4) as u64);
        let act = g.storage("moe_act", (t * spec.top_k * spec.ffn * 4) as u64);
        let pair_out = g.storage("moe_pair_out", (t * spec.top_k * h * 4) as u64);
        let dummy = g.storage("dummy", 16);
        let rbias = g.storage_init("router_bias", bytemuck::cast_slice(w.router_bias.unwrap_or(&[0.0])));
        let (bgu, bd) = match w.biases {
            Some((a, b)) => (
                Some(g.storage_init("bias_gu", bytemuck::cast_slice(a))),
                Some(g.storage_init("bias_d", bytemuck::cast_slice(b))),
            ),
            None => (None, None),
        };
        let (step, _meta) = self.step_buffers(Self::header(t, 0), &[0]);
        let router = GpuMatrix::upload(g, "router", w.router, None, max_binding)?;
        let gate_up = GpuMatrix::upload_grouped(g, "gate_up", w.gate_up, 2 * spec.ffn, max_binding)?;
        let down = GpuMatrix::upload_grouped(g, "down", w.down, h, max_binding)?;
        let io = MatmulIo { step: &step, x: &xb, y: &logits, bias: &rbias, windows: None, cap: 0.0, xq: None };
        let flags = if w.router_bias.is_some() { MAT_BIAS } else { 0 };
        let (mut ops, _p) =
            matmul::matmul(&self.kernels.matmul, g, &router, &io, (0, spec.experts), flags, false, false);
        let mio = MoeIo {
            step: &step,
            logits: &logits,
            route: &route,
            x: &xb,
            act: &act,
            pair_out: &pair_out,
            layout,
            hidden: &hidden,
            dummy: &dummy,
        };
        ops.extend(moe::route(&self.kernels.moe, g, spec, &mio, None).0);
        ops.extend(moe::experts(&self.kernels.moe, g, spec, &gate_up, &mio, false, bgu.as_ref()).0);
        ops.extend(moe::experts(&self.kernels.moe, g, spec, &down, &mio, true, bd.as_ref()).0);
        ops.push(moe::combine(&self.kernels.moe, g, spec, &mio, h, false).0);
        let shape = StepShape { n_tokens: t as u32, n_splits: 1, ..Default::default() };
        Ok((self.calls(&ops, shape, None), hidden, vec![router, gate_up, down]))
    }
}
