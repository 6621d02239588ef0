//! The GPU ops of a forward step, one file (or folder) per kernel family — `matmul` (the
//! embedding, the cpu profile's register tiles, the gpu profile's decode kernels and GEMMs with
//! the plan of which runs when), `norm` (RMSNorm, the per-head q/k norm), `ple`, `rope` (RoPE +
//! KV write), `attention`, `moe`, `delta` (Gated DeltaNet), `sample` (logit adjustments, the
//! sampler). Each family owns its parameter struct (one Rust definition that generates the WGSL
//! declaration), its bindings by name (checked against the shader), its WGSL assembly from
//! shaders/<family>/, its pipelines (`<Family>Kernels`), the constructors of its ops and their
//! kind (`FamilyOp`: label, cost, grid). `OpKind` composes the families' op kinds (one line
//! each in `op_kinds!`), `kernels` the families' kernels for a model; `wgsl` and
//! `kv_cache` hold what several families' programs share; `tune` measures the GEMM plan;
//! `harness` runs single ops on host data for tests and benches.
//!
//! Owns: kernels, op families, the kernel harness.
//! May use: gpu, weights, config, sampling.
//! Never uses: model, exec, engine, server.
//!
//! Each op is a typed value (what it computes, its sizes, its bind groups) that turns a step's
//! sizes into its dispatches: pipeline, bind group, dynamic offsets and a grid folded within
//! the device's per-dimension limit. The forward step (model/) and the kernel harness both
//! build ops with the family constructors and record them through `Op::dispatches`, so the
//! kernel tests run the code that runs in production.

pub mod attention;
#[cfg(test)]
mod binding_tests;
pub mod cost;
pub mod delta;
pub mod harness;
pub mod harness_delta;
pub mod harness_moe;
pub mod kernels;
pub mod kv_cache;
pub mod matmul;
pub mod moe;
pub mod norm;
pub mod ple;
pub mod rope;
pub mod sample;
pub mod tune;
pub mod wgsl;

pub use attention::{attention_splits, attention_tiled};

/// Declares a kernel family's bindings by name: a struct of buffers whose fields are the
/// shader's variable names, each with its access and binding number. `SLOTS` gives the bind-group
/// layout, `entries` the bind group; binding_tests checks both against the assembled shaders.
macro_rules! bindings {
    ($(#[$m:meta])* $name:ident { $($field:ident: $slot:ident @ $b:expr),* $(,)? }) => {
        $(#[$m])*
        pub struct $name<'a> {
            $(pub $field: &'a wgpu::Buffer),*
        }

        impl<'a> $name<'a> {
            /// (binding, shader variable, access) of each field.
            pub const SLOTS: &'static [(u32, &'static str, crate::gpu::family::Slot)] =
                &[$(($b, stringify!($field), crate::gpu::family::Slot::$slot)),*];
            /// The struct's name and slots, what a program of it must declare.
            pub const BINDS: crate::ops::Binds = (stringify!($name), Self::SLOTS);

            pub fn entries(&self) -> Vec<(u32, &'a wgpu::Buffer)> {
                vec![$(($b, self.$field)),*]
            }
        }
    };
}
pub(crate) use bindings;

/// A bindings struct's name and its (binding, shader variable, access) slots.
pub type Binds = (&'static str, &'static [(u32, &'static str, crate::gpu::family::Slot)]);

/// One program a family can build: its label (what the naga test names), its assembled source,
/// the bindings struct its shader must declare and, for a kernel that binds the KV cache, the
/// first K and V cache bindings (binding_tests checks both against the source).
pub struct Program {
    pub label: String,
    pub src: anyhow::Result<String>,
    pub binds: Binds,
    pub kv: Option<(u32, u32)>,
}

impl Program {
    pub fn new(label: impl Into<String>, src: anyhow::Result<String>, binds: Binds) -> Program {
        Program { label: label.into(), src, binds, kv: None }
    }

    /// The same binding the KV cache with its first chunk at `first` (K, V).
    pub fn with_kv(self, first: (u32, u32)) -> Program {
        Program { kv: Some(first), ..self }
    }
}

/// Every program of a family (its `sources`; kernels::programs gathers them).
pub(crate) type Sources = Vec<Program>;

/// The bind-group layout of a family's slots.
pub(crate) fn layout_of(slots: &[(u32, &str, crate::gpu::family::Slot)]) -> Vec<(u32, crate::gpu::family::Slot)> {
    slots.iter().map(|&(b, _, s)| (b, s)).collect()
}

use crate::config::KernelProfile;
use crate::gpu::Gpu;
use crate::ops::kernels::Kernels;

/// What every family's op kind (its enum or struct inside [`OpKind`], in its own file)
/// answers: the family's whole say about an op once it is built.
pub(crate) trait FamilyOp {
    /// The kernel's name in the per-kernel profile, where a recipe gave the op no role.
    fn family(&self) -> &'static str;
    /// Bytes moved and FLOPs in a step of shape `s` (`kv_bytes`: bytes per KV-cache element;
    /// activations are f32).
    fn cost(&self, s: &StepShape, kv_bytes: u64) -> cost::Cost;
    /// `op`'s dispatches for a step of shape `s` (none where it has no rows).
    fn dispatches<'a>(&self, op: &'a Op, r: &Recorder<'a>, s: &StepShape, out: impl FnMut(Dispatch<'a>));
}

/// Composes the families' op kinds: one line per family gives [`OpKind`]'s variant, and its
/// `family`, `cost` and `Op::dispatches` pass to the family's [`FamilyOp`].
macro_rules! op_kinds {
    ($($(#[$m:meta])* $variant:ident($kind:ty),)*) => {
        /// What an op computes, with the sizes its grid depends on: its family's kind.
        #[derive(Clone, Copy, Debug, PartialEq)]
        pub enum OpKind {
            $($(#[$m])* $variant($kind),)*
        }

        impl OpKind {
            /// The kernel family: what the per-kernel profile groups by when a recipe gave no role.
            pub fn family(&self) -> &'static str {
                match self {
                    $(OpKind::$variant(k) => k.family(),)*
                }
            }

            /// This op's bytes and FLOPs in a step of shape `s` (`kv_bytes`: bytes per KV-cache
            /// element).
            pub fn cost(&self, s: &StepShape, kv_bytes: u64) -> cost::Cost {
                match self {
                    $(OpKind::$variant(k) => k.cost(s, kv_bytes),)*
                }
            }
        }

        impl Op {
            /// Hands this op's dispatches for a step of shape `s` to `out` (none where it has no
            /// rows): the forward step records them straight into its compute pass, with no
            /// per-step allocation. Each family computes its own grid.
            pub fn dispatches<'a>(&'a self, r: &Recorder<'a>, s: &StepShape, out: impl FnMut(Dispatch<'a>)) {
                match &self.kind {
                    $(OpKind::$variant(k) => k.dispatches(self, r, s, out),)*
                }
            }
        }

        $(impl From<$kind> for OpKind {
            fn from(k: $kind) -> OpKind {
                OpKind::$variant(k)
            }
        })*
    };
}

op_kinds! {
    /// The embedding, matmuls and the int8 quantization of their x.
    Matmul(matmul::MatmulOp),
    /// RMSNorm and the per-head q/k norm.
    Norm(norm::NormOp),
    /// The per-layer input gate.
    Ple(ple::PleOp),
    /// RoPE and the KV-cache write.
    Rope(rope::RopeOp),
    /// Paged attention.
    Attention(attention::AttentionOp),
    /// The mixture of experts' routing, experts and combination.
    Moe(moe::MoeOp),
    /// The Gated DeltaNet's stages.
    Delta(delta::DeltaOp),
    /// Logit adjustments and the sampler.
    Sample(sample::SampleOp),
}

/// An op with its bind groups.
pub struct Op {
    pub kind: OpKind,
    /// What the per-kernel profile calls it: the family (`OpKind::family`), or the role a
    /// recipe gave it (`qkv`, `down`, ...).
    pub label: &'static str,
    pub bind: wgpu::BindGroup,
    /// Matmuls: the bind group of their other reading of x, when there is one: the cpu
    /// profile's uniform-x variant (where the device allows it), or the gpu profile's int8
    /// activations (x bound to the quantized blocks; formats with int8 kernels).
    pub bind_x: Option<wgpu::BindGroup>,
}

/// The sizes of one step that grids depend on.
#[derive(Clone, Copy, Debug, Default)]
pub struct StepShape {
    pub n_tokens: u32,
    pub n_sample: u32,
    /// Key ranges per (token, KV head) of the split attention (see `attention_splits`).
    pub n_splits: u32,
    /// gpu profile: tokens per query tile when attention runs the query-tiled kernel (a
    /// prefill-sized step; see `attention_tiled`), 0 when it runs the split one.
    pub attn_tile: u32,
    /// Whether any sampled row has logit adjustments.
    pub any_adjust: bool,
    /// Keys attended over all tokens of the step (causal, within the window): what attention
    /// reads (the cost model's; no grid depends on it).
    pub attn_keys: u64,
    /// Sequences in the step (the recurrent mixer's grids).
    pub n_seqs: u32,
}

/// One dispatch.
pub struct Dispatch<'a> {
    pub pipe: &'a wgpu::ComputePipeline,
    pub bind: &'a wgpu::BindGroup,
    /// Dynamic offsets (uniform-x matmuls: x's window and its window entry).
    pub offsets: Option<[u32; 2]>,
    pub grid: (u32, u32),
}

impl Dispatch<'_> {
    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>) {
        pass.set_pipeline(self.pipe);
        pass.set_bind_group(0, self.bind, self.offsets.as_ref().map_or(&[][..], |o| &o[..]));
        pass.dispatch_workgroups(self.grid.0, self.grid.1, 1);
    }
}

/// The device's uniform-window parameters of the cpu profile's uniform-x matmuls.
#[derive(Clone, Copy, Debug)]
pub struct RecordParams {
    /// Dynamic uniform offset alignment and window-entry stride.
    pub align: u32,
    pub win_stride: u32,
}

impl RecordParams {
    pub fn new(gpu: &Gpu) -> RecordParams {
        RecordParams {
            align: gpu.device.limits().min_uniform_buffer_offset_alignment,
            win_stride: crate::ops::matmul::tiles::window_stride(gpu),
        }
    }
}

/// What ops need to choose their pipelines and grids: the kernels, the device and the
/// uniform-window parameters.
pub struct Recorder<'a> {
    pub kernels: &'a Kernels,
    pub gpu: &'a Gpu,
    pub align: u32,
    pub win_stride: u32,
    /// Tests: the cpu profile's storage-x matmuls use this MATMUL_TILES entry whatever the step's
    /// rows (so every tile can be checked on small inputs).
    pub tile_override: Option<usize>,
}

impl<'a> Recorder<'a> {
    /// The profile the kernels were built for.
    pub fn profile(&self) -> KernelProfile {
        if self.kernels.matmul.gpu.is_some() {
            KernelProfile::Gpu
        } else {
            KernelProfile::Cpu
        }
    }

    pub(crate) fn folded<'b>(
        &self,
        pipe: &'b wgpu::ComputePipeline,
        bind: &'b wgpu::BindGroup,
        groups: u32,
    ) -> Dispatch<'b> {
        Dispatch { pipe, bind, offsets: None, grid: self.gpu.fold(groups) }
    }
}

pub(crate) fn div_up(a: u32, b: u32) -> u32 {
    a.div_ceil(b)
}
