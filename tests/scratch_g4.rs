use std::sync::Arc;
use torus_wgpu::config::{KernelProfile, KvDtype};
use torus_wgpu::gpu::Gpu;
use torus_wgpu::model::loader::HostModel;
use torus_wgpu::model::{Model, StepInput, StepLimits};
use torus_wgpu::sampling::SampleParams;

#[test]
fn scratch() {
    let path = std::env::var("G4").unwrap();
    let gpu = Arc::new(Gpu::new(None).unwrap());
    let host = HostModel::load(std::path::Path::new(&path), &|_, _| {}).unwrap();
    let limits = StepLimits {
        max_tokens: 64,
        max_seqs: 1,
        max_seq_len: 64,
        block_size: 16,
        cache_bytes: 64 << 20,
        max_binding: 0,
        kv_dtype: KvDtype::F32,
        profile: KernelProfile::Cpu,
        sliding_window: host.cfg.sliding_window,
    };
    let mut models = Vec::new();
    for (profile, kv) in [
        (KernelProfile::Cpu, KvDtype::F32),
        (KernelProfile::Cpu, KvDtype::F16),
        (KernelProfile::Gpu, KvDtype::F32),
        (KernelProfile::Gpu, KvDtype::F16),
    ] {
        models.push(Model::new(gpu.clone(), &host, StepLimits { profile, kv_dtype: kv, ..limits }).unwrap());
    }
    let table: Vec<u32> = (0..4).collect();
    let chunk = |tokens: &[u32], start: usize| {
        let pos: Vec<u32> = (start as u32..(start + tokens.len()) as u32).collect();
        StepInput {
            tokens: tokens.to_vec(),
            slots: pos.clone(),
            positions: pos,
            seq_of_token: vec![0; tokens.len()],
            block_tables: vec![table.clone()],
            sample_rows: vec![tokens.len() as u32 - 1],
            sampling: vec![SampleParams::default()],
            state_slots: Vec::new(),
        }
    };
    let prompt: Vec<u32> = (0..16).map(|i| (i * 7919 + 13) % 1000).collect();
    let mut steps = vec![chunk(&prompt, 0)];
    for s in 0..3 {
        steps.push(chunk(&[(s * 31 + 5) as u32], 16 + s));
    }
    for (i, st) in steps.iter().enumerate() {
        let mut logits = Vec::new();
        for m in models.iter_mut() {
            m.step(st).unwrap();
            logits.push(m.last_logits(1).unwrap());
        }
        let d = |a: usize, b: usize| logits[a].iter().zip(&logits[b]).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        println!(
            "step {i}: cpu16-cpu32 {:e} gpu32-cpu32 {:e} gpu16-cpu32 {:e} gpu16-cpu16 {:e}",
            d(1, 0),
            d(2, 0),
            d(3, 0),
            d(3, 1)
        );
    }
}
