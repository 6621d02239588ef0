//! The mixture-of-experts kernels (router top-k, expert gate/up, weighted down) against the
//! plain-Rust reference `ops::moe::moe_ref`: every format the experts of real files use, sizes
//! that are not powers of two, expert tensors split over several chunks, uneven routing (one
//! expert chosen by every token, most chosen by none), a router bias, expert biases and
//! gpt-oss's clamped SwiGLU, with and without renormalised weights, in both kernel profiles and
//! with the gpu profile's tiled expert kernels.

mod common;

use common::reference::{randn, weights};
use std::sync::{Arc, OnceLock};
use torus_wgpu::config::KernelProfile;
use torus_wgpu::gpu::wformat::WFormat;
use torus_wgpu::gpu::Gpu;
use torus_wgpu::model::blocks::experts::interleave_groups;
use torus_wgpu::ops::harness::Harness;
use torus_wgpu::ops::harness_moe::MoeWeights;
use torus_wgpu::ops::moe::{moe_ref, route_ref, MoeSpec};
use torus_wgpu::sampling::Rng;
use torus_wgpu::weights::tensor::QTensor;

const FORMATS: [WFormat; 6] =
    [WFormat::Q4_K, WFormat::Q5_K, WFormat::Q6_K, WFormat::Q8_0, WFormat::MXFP4, WFormat::F16];

fn gpu() -> Arc<Gpu> {
    static GPU: OnceLock<Arc<Gpu>> = OnceLock::new();
    GPU.get_or_init(|| Arc::new(Gpu::new(None).expect("a wgpu adapter (lavapipe in CI)"))).clone()
}

fn harness(profile: KernelProfile) -> &'static Harness {
    static H: OnceLock<[Harness; 2]> = OnceLock::new();
    let h = H.get_or_init(|| {
        let mut formats = FORMATS.to_vec();
        formats.push(WFormat::F32);
        [KernelProfile::Cpu, KernelProfile::Gpu].map(|p| Harness::for_moe(gpu(), &formats, p).unwrap())
    });
    &h[(profile == KernelProfile::Gpu) as usize]
}

/// The gpu profile with the tiled (grouped-GEMM) expert kernels for prefill-sized steps.
fn tiled_harness() -> &'static Harness {
    static H: OnceLock<Harness> = OnceLock::new();
    H.get_or_init(|| {
        // F32: the router's format.
        let mut h = Harness::for_moe(gpu(), &[&FORMATS[..], &[WFormat::F32]].concat(), KernelProfile::Gpu).unwrap();
        h.set_moe_tiled(true).unwrap();
        assert!(h.kernels.moe.formats.values().all(|p| p.use_tiled), "the gpu profile builds the tiled kernels");
        h
    })
}

/// How the tokens are routed: the router is the identity on the first `experts` columns of x,
/// so x's first columns are the logits and the test chooses them.
#[derive(Clone, Copy, Debug)]
enum Routing {
    /// A random order of all experts per token (0.25 apart).
    Spread,
    /// Expert 3 first for every token, then experts 0 and 1 in turn; every other expert last.
    Skewed,
}

fn inputs(rng: &mut Rng, spec: &MoeSpec, h: usize, t: usize, routing: Routing) -> (Vec<f32>, QTensor) {
    let e = spec.experts;
    let mut x = randn(rng, t * h, 1.0);
    for i in 0..t {
        let logits: Vec<f32> = match routing {
            Routing::Spread => {
                let mut order: Vec<usize> = (0..e).collect();
                for j in (1..e).rev() {
                    order.swap(j, (rng.next_u64() % (j as u64 + 1)) as usize);
                }
                let mut l = vec![0.0; e];
                order.iter().enumerate().for_each(|(rank, &ex)| l[ex] = 1.0 - 0.25 * rank as f32);
                l
            }
            Routing::Skewed => (0..e)
                .map(|ex| match ex {
                    3 => 2.0,
                    0 | 1 if (ex + i) % 2 == 0 => 1.0,
                    0 | 1 => 0.5,
                    _ => -1.0 - 0.25 * ex as f32,
                })
                .collect(),
        };
        x[i * h..i * h + e].copy_from_slice(&logits);
    }
    let mut router = vec![0f32; e * h];
    (0..e).for_each(|ex| router[ex * h + ex] = 1.0);
    (x, QTensor::from_f32(e, h, &router).unwrap())
}

/// Runs one case on `harness`'s kernels and on the CPU; returns the routing the reference took
/// (to check the case routes as meant).
#[allow(clippy::too_many_arguments)]
fn check(
    harness: &Harness,
    format: WFormat,
    spec: MoeSpec,
    h: usize,
    t: usize,
    routing: Routing,
    biased: bool,
    chunk_experts: usize,
) -> Vec<Vec<usize>> {
    let label = match (&harness.kernels.matmul.gpu, harness.kernels.moe.formats.values().any(|p| p.use_tiled)) {
        (None, _) => "Cpu",
        (Some(_), false) => "Gpu",
        (Some(_), true) => "GpuTiled",
    };
    let mut rng = Rng::new(11 + t as u64 * 7 + h as u64);
    let (e, f) = (spec.experts, spec.ffn);
    let (x, router) = inputs(&mut rng, &spec, h, t, routing);
    let gate = weights(format, e * f, h, &mut rng, 0.2);
    let up = weights(format, e * f, h, &mut rng, 0.2);
    let gate_up = interleave_groups(&gate, &up, f).unwrap();
    let down = weights(format, e * h, f, &mut rng, 0.2);
    let router_bias = biased.then(|| (0..e).map(|i| 0.01 * i as f32).collect::<Vec<_>>());
    let (bgu, bd) = (randn(&mut rng, e * 2 * f, 0.3), randn(&mut rng, e * h, 0.3));
    let w = MoeWeights {
        router: &router,
        router_bias: router_bias.as_deref(),
        gate_up: &gate_up,
        down: &down,
        biases: biased.then_some((bgu.as_slice(), bd.as_slice())),
    };
    let y0 = randn(&mut rng, t * h, 0.5);
    // Chunks of `chunk_experts` experts of the larger tensor (per_row is what one row takes in
    // its largest buffer).
    let per_expert = |m: &QTensor, rows: usize| (m.q.len().max(m.s.len()) * 4 / m.rows * rows) as u64;
    let mb = (chunk_experts as u64 * per_expert(&gate_up, 2 * f).max(per_expert(&down, h))).max(256);
    let got = harness.moe(&spec, &w, &x, t, &y0, mb).unwrap();
    let mut want = moe_ref(&spec, &x, t, &router, w.router_bias, &gate_up, &down, w.biases);
    want.iter_mut().zip(&y0).for_each(|(a, b)| *a += b);
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let what = format!("{label} {} h{h} f{f} e{e} k{} t{t} {routing:?} bias {biased}", format.name(), spec.top_k);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= 1e-4 * scale + 1e-5, "{what}: element {i}: got {g}, want {w} (scale {scale})");
    }
    (0..t)
        .map(|i| {
            let mut l = x[i * h..i * h + e].to_vec();
            if let Some(b) = &router_bias {
                l.iter_mut().zip(b).for_each(|(a, b)| *a += b);
            }
            route_ref(&l, spec.top_k, spec.norm).into_iter().map(|r| r.0).collect()
        })
        .collect()
}

fn spec(experts: usize, top_k: usize, ffn: usize, norm: bool) -> MoeSpec {
    MoeSpec { experts, top_k, ffn, norm, gelu: false, clamped: None }
}

/// The sizes a format's blocks allow: (hidden, ffn).
fn sizes(f: WFormat) -> (usize, usize) {
    if f.scale_group() == 256 {
        (256, 256)
    } else {
        (96, 64)
    }
}

#[test]
fn experts_match_the_reference_in_every_format_and_profile() {
    for profile in [KernelProfile::Cpu, KernelProfile::Gpu] {
        for f in FORMATS {
            let (h, ffn) = sizes(f);
            for (t, routing) in [(1, Routing::Spread), (5, Routing::Skewed), (37, Routing::Spread)] {
                check(harness(profile), f, spec(8, 2, ffn, true), h, t, routing, false, 3);
            }
        }
    }
}

/// The tiled expert kernels (a grouped GEMM: tiles of 32 pairs of one expert): every format,
/// experts with several tiles (the skewed expert takes every token: 70 pairs, three tiles) and
/// with none, chunks of experts, biases and gpt-oss's clamped SwiGLU, and a decode-sized step
/// on the same harness (the per-pair kernels).
#[test]
fn tiled_experts_match_the_reference() {
    let h = tiled_harness();
    for f in FORMATS {
        let (hd, ffn) = sizes(f);
        for (t, routing) in [(70, Routing::Skewed), (37, Routing::Spread), (2, Routing::Spread)] {
            check(h, f, spec(8, 2, ffn, true), hd, t, routing, false, 3);
        }
    }
    let clamped = MoeSpec { clamped: Some((1.702, 7.0)), ..spec(8, 4, 64, true) };
    check(h, WFormat::MXFP4, clamped, 96, 33, Routing::Spread, true, 2);
    check(h, WFormat::Q8_0, spec(8, 2, 64, false), 96, 40, Routing::Skewed, true, 8);
}

#[test]
fn skewed_routing_leaves_experts_idle_and_one_busy() {
    // The case routes as it says: expert 3 is every token's first choice, experts 2 and 4..7
    // are nobody's.
    let routes =
        check(harness(KernelProfile::Cpu), WFormat::Q8_0, spec(8, 2, 64, false), 96, 9, Routing::Skewed, false, 1);
    assert!(routes.iter().all(|r| r[0] == 3 && (r[1] == 0 || r[1] == 1)), "{routes:?}");
    // More experts per token than the skew names, with one expert per chunk.
    check(harness(KernelProfile::Gpu), WFormat::Q4_K, spec(6, 4, 256, true), 256, 4, Routing::Skewed, false, 1);
}

#[test]
fn router_bias_expert_biases_and_clamped_swiglu() {
    let clamped = MoeSpec { clamped: Some((1.702, 7.0)), ..spec(8, 4, 64, true) };
    for profile in [KernelProfile::Cpu, KernelProfile::Gpu] {
        check(harness(profile), WFormat::MXFP4, clamped, 96, 6, Routing::Spread, true, 2);
        check(harness(profile), WFormat::Q8_0, spec(8, 2, 64, false), 96, 3, Routing::Spread, true, 8);
    }
    let gelu = MoeSpec { gelu: true, ..spec(4, 1, 64, false) };
    check(harness(KernelProfile::Cpu), WFormat::F16, gelu, 96, 7, Routing::Spread, false, 4);
}
