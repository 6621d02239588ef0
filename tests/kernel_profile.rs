//! The per-kernel profile (`Model::set_profiling`, `bench-model --profile-kernels`): a profiled
//! step gives the same tokens as an unprofiled one, and reports every op of the recipe under its
//! label with as many ops per step as the model has layers, a positive time, and the bytes and
//! FLOPs the cost model gives for the step's shape.

mod common;

use std::sync::Arc;
use torus_wgpu::config::{EngineConfig, KernelProfile, KvDtype};
use torus_wgpu::gpu::Gpu;
use torus_wgpu::model::loader::HostModel;
use torus_wgpu::model::{Model, StepInput};
use torus_wgpu::sampling::SampleParams;

fn step(prompt: &[u32]) -> StepInput {
    let n = prompt.len();
    let pos: Vec<u32> = (0..n as u32).collect();
    StepInput {
        tokens: prompt.to_vec(),
        positions: pos.clone(),
        slots: pos,
        seq_of_token: vec![0; n],
        block_tables: vec![(0..n.div_ceil(16) as u32).collect()],
        sample_rows: vec![n as u32 - 1],
        sampling: vec![SampleParams { n_top: 3, ..Default::default() }],
        state_slots: Vec::new(),
    }
}

#[test]
fn profiled_steps_time_every_op_and_change_no_output() {
    let host = HostModel::load(&common::tiny(), &|_, _| {}).unwrap();
    let c = host.cfg.clone();
    let gpu = Arc::new(Gpu::new(None).expect("a wgpu adapter (lavapipe in CI)"));
    let prompt: Vec<u32> = (0..21).map(|i| (i * 31 + 5) % c.vocab as u32).collect();
    for profile in [KernelProfile::Cpu, KernelProfile::Gpu] {
        let cfg = EngineConfig {
            max_num_batched_tokens: 32,
            max_sequence_length: 64,
            total_cache_size: 8 << 20,
            kv_cache_dtype: KvDtype::F32,
            kernel_profile: profile,
            ..Default::default()
        };
        let mut model = Model::new(gpu.clone(), &host, torus_wgpu::exec::step_limits(&cfg, &c)).unwrap();
        assert!(model.profile().is_none(), "profiling is off until asked");
        let want = model.step(&step(&prompt)).unwrap();
        model.set_profiling(true);
        let got = model.step(&step(&prompt)).unwrap();
        let got2 = model.step(&step(&prompt)).unwrap();
        assert_eq!(got[0].id, want[0].id, "{profile:?}: the profiled step samples the same token");
        assert_eq!(got[0].top, want[0].top, "{profile:?}: and the same top log-probabilities");
        assert_eq!(got2[0].id, want[0].id);
        let p = model.profile().expect("profiling is on");
        model.set_profiling(false);
        assert!(model.profile().is_none());
        assert_eq!(p.steps, 2, "{profile:?}");
        eprintln!("{profile:?}: {} {:?}", p.method, p.totals.iter().map(|t| (&t.label, t.seconds)).collect::<Vec<_>>());
        let labels: Vec<&str> = p.totals.iter().map(|t| t.label.as_str()).collect();
        // tiny-qwen2: tied embedding, no q/k norm, no logit adjustments.
        assert_eq!(
            labels,
            ["embed", "rmsnorm", "qkv", "rope_kv", "attention", "o_proj", "gate_up", "down", "lm_head", "sample"],
            "{profile:?}"
        );
        let layers = c.layers as u64;
        for t in &p.totals {
            let want_ops = match t.label.as_str() {
                "embed" | "lm_head" | "sample" => 1,
                // Two per layer and the final norm.
                "rmsnorm" => 2 * layers + 1,
                _ => layers,
            };
            assert_eq!(t.ops, want_ops, "{profile:?} {}: ops per step", t.label);
            assert!(t.dispatches >= 2 * want_ops, "{profile:?} {}: dispatches over 2 steps", t.label);
            assert!(t.seconds > 0.0 && t.seconds < 60.0, "{profile:?} {}: {} s", t.label, t.seconds);
            assert!(t.bytes > 0 && t.flops > 0, "{profile:?} {}", t.label);
        }
        // The LM head over the one sampled row reads the whole (tied) embedding once per step.
        let lm = p.totals.iter().find(|t| t.label == "lm_head").unwrap();
        let table = host.embed.as_ref().unwrap();
        let row_bytes = table.format.row_bytes(c.hidden) as u64;
        let per_step = c.vocab as u64 * row_bytes + 4 * c.hidden as u64 + 4 * c.vocab as u64;
        assert_eq!(lm.bytes, 2 * per_step);
        assert_eq!(lm.flops, 2 * 2 * c.vocab as u64 * c.hidden as u64);
        // Attention: 21 tokens attend causally to 1..=21 keys.
        let att = p.totals.iter().find(|t| t.label == "attention").unwrap();
        let keys = 21 * 22 / 2;
        assert_eq!(att.flops, 2 * layers * 4 * keys * (c.heads * c.head_dim) as u64);
    }
}
