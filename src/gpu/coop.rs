//! Cooperative matrices (NVIDIA tensor cores, AMD WMMA, Apple simdgroup matrices) for the gpu
//! profile's prefill GEMM (shaders/matmul/matmul_coop.wgsl), through wgpu's experimental feature.
//!
//! The device is opened with the feature where the adapter has it, one fixed subgroup size (16,
//! 32 or 64), a fragment shape the kernel has (16x16x16 with f16 inputs and f32 accumulators, or
//! 8x8x8 in f32) and the workgroup memory it needs, and something wants it: the tuner (`torus-wgpu
//! tune` measures the kernel against the tiled ones), the tuner's cached choice for this adapter
//! (it measured the kernel faster), or `TORUS_COOPERATIVE_MATRIX=1` (then every GEMM runs it);
//! `TORUS_COOPERATIVE_MATRIX=0` keeps it off. Otherwise the tiled kernels run, with one log line
//! saying why. It cannot run on lavapipe (no VK_KHR_cooperative_matrix): the tests validate its
//! WGSL with naga and translate it to SPIR-V.

use anyhow::{anyhow, Result};
use wgpu::{CooperativeMatrixProperties as Props, CooperativeScalarType as Ty};

/// The environment variable that opts in.
pub const COOP_ENV: &str = "TORUS_COOPERATIVE_MATRIX";

/// The cooperative-matrix shape the GEMM is built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CoopShape {
    /// Fragment side: 8 (8x8x8, f32 inputs) or 16 (16x16x16, f16 inputs); f32 accumulators.
    pub side: u32,
    /// Whether A and B are f16 (needs `shader-f16`).
    pub f16: bool,
    /// The adapter's subgroup size (the kernel's subgroups per workgroup follow from it).
    pub subgroup: u32,
}

impl CoopShape {
    /// Workgroup memory of matmul_coop.wgsl: the x and weight tiles (2048 elements each) and
    /// the 64 x 64 f32 output tile.
    pub fn workgroup_bytes(&self) -> u32 {
        2 * 2048 * if self.f16 { 2 } else { 4 } + 4096 * 4
    }
}

/// The shape to build for, or why none: `subgroups` (min, max) of the adapter, whether it has
/// `shader-f16`, its workgroup memory and its cooperative-matrix configurations.
pub fn choose(props: &[Props], subgroups: (u32, u32), f16: bool, wg_bytes: u32) -> Result<CoopShape, String> {
    let (lo, hi) = subgroups;
    if lo != hi || ![16, 32, 64].contains(&lo) {
        return Err(format!("subgroup size {lo}..{hi} is not one fixed size of 16, 32 or 64"));
    }
    let has = |side: u32, ab: Ty| {
        props
            .iter()
            .any(|p| (p.m_size, p.n_size, p.k_size) == (side, side, side) && p.ab_type == ab && p.cr_type == Ty::F32)
    };
    let shape = if f16 && has(16, Ty::F16) {
        CoopShape { side: 16, f16: true, subgroup: lo }
    } else if has(8, Ty::F32) {
        CoopShape { side: 8, f16: false, subgroup: lo }
    } else {
        return Err("no 16x16x16 f16->f32 (with shader-f16) or 8x8x8 f32 configuration".into());
    };
    if 64 / shape.side < 64 / shape.subgroup {
        return Err(format!("subgroups of {lo} leave no {0}x{0} fragments to each", shape.side));
    }
    if shape.workgroup_bytes() > wg_bytes {
        return Err(format!("needs {} bytes of workgroup memory, the adapter has {wg_bytes}", shape.workgroup_bytes()));
    }
    Ok(shape)
}

/// Whether the user asked for cooperative matrices in every GEMM (COOP_ENV=1).
pub fn opted_in() -> bool {
    std::env::var(COOP_ENV).ok().as_deref() == Some("1")
}

/// Whether the user turned them off (COOP_ENV=0).
pub fn opted_out() -> bool {
    std::env::var(COOP_ENV).ok().as_deref() == Some("0")
}

/// The shape for this adapter when something wants cooperative matrices (`wanted`: why, for the
/// log), logging why not where the adapter has none.
pub fn for_adapter(adapter: &wgpu::Adapter, wanted: Option<&str>) -> Option<CoopShape> {
    let wanted = wanted?;
    let why = if !adapter.features().contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX) {
        Err("the adapter has no cooperative-matrix feature".to_string())
    } else if !adapter.features().contains(wgpu::Features::SUBGROUP) {
        Err("the adapter has no subgroups".to_string())
    } else {
        let info = adapter.get_info();
        choose(
            &adapter.cooperative_matrix_properties(),
            (info.subgroup_min_size, info.subgroup_max_size),
            adapter.features().contains(wgpu::Features::SHADER_F16),
            adapter.limits().max_compute_workgroup_storage_size,
        )
    };
    match why {
        Ok(s) => {
            tracing::info!("cooperative matrices on ({wanted}): {0}x{0} fragments, f16 inputs: {1}", s.side, s.f16);
            Some(s)
        }
        Err(e) => {
            tracing::info!("{wanted}, but cooperative matrices stay off: {e}");
            None
        }
    }
}

/// The features a device for `shape` is opened with.
pub fn features(shape: Option<CoopShape>) -> wgpu::Features {
    match shape {
        Some(s) if s.f16 => wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX | wgpu::Features::SHADER_F16,
        Some(_) => wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX,
        None => wgpu::Features::empty(),
    }
}

/// Validates a cooperative-matrix shader with naga and translates it to SPIR-V, as the Vulkan
/// backend would (the check lavapipe allows: it cannot run the kernel).
pub fn validate_and_translate(label: &str, source: &str) -> Result<Vec<u32>> {
    let (module, info) = super::validate_module(label, source, super::capabilities(source))?;
    let opts = naga::back::spv::Options { lang_version: (1, 3), ..Default::default() };
    naga::back::spv::write_vec(&module, &info, &opts, None).map_err(|e| anyhow!("shader {label}: SPIR-V: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(side: u32, ab: Ty) -> Props {
        Props {
            m_size: side,
            n_size: side,
            k_size: side,
            ab_type: ab,
            cr_type: Ty::F32,
            saturating_accumulation: false,
        }
    }

    #[test]
    fn picks_the_shape_the_adapter_has() {
        let nv = [p(16, Ty::F16), p(16, Ty::F32)];
        assert_eq!(choose(&nv, (32, 32), true, 49152), Ok(CoopShape { side: 16, f16: true, subgroup: 32 }));
        // Without shader-f16 an f16-only adapter has nothing the kernel takes.
        assert!(choose(&[p(16, Ty::F16)], (32, 32), false, 49152).is_err());
        let apple = [p(8, Ty::F32), p(8, Ty::F16)];
        assert_eq!(choose(&apple, (32, 32), true, 32768), Ok(CoopShape { side: 8, f16: false, subgroup: 32 }));
        // Variable subgroup sizes (AMD wave32/64) and too little workgroup memory are refused.
        assert!(choose(&nv, (32, 64), true, 65536).unwrap_err().contains("subgroup size"));
        assert!(choose(&apple, (32, 32), false, 16384).unwrap_err().contains("workgroup memory"));
        // 16x16 fragments need subgroups of 16 or more lanes for 4 token fragments per tile.
        assert!(choose(&nv, (8, 8), true, 65536).is_err());
        assert_eq!(choose(&nv, (64, 64), true, 65536).unwrap().subgroup, 64);
    }
}
