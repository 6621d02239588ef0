//! End-to-end engine speed on the default model (SmolLM2-135M Q4_1): batch-1 decode step and a
//! ~330-token prefill, each one GPU submission with one small readback.
//! Run: cargo bench --bench engine

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::path::Path;
use std::sync::Arc;
use torus_wgpu::config::EngineConfig;
use torus_wgpu::engine::load_model;
use torus_wgpu::gpu::Gpu;
use torus_wgpu::model::StepInput;
use torus_wgpu::sampling::SampleParams;

fn step_input(tokens: &[u32], start: usize, table: &[u32]) -> StepInput {
    let n = tokens.len();
    let pos: Vec<u32> = (start as u32..(start + n) as u32).collect();
    StepInput {
        tokens: tokens.to_vec(),
        positions: pos.clone(),
        slots: pos,
        seq_of_token: vec![0; n],
        block_tables: vec![table.to_vec()],
        sample_rows: vec![n as u32 - 1],
        sampling: vec![SampleParams::default()],
        state_slots: Vec::new(),
    }
}

fn bench(c: &mut Criterion) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.exists() {
        eprintln!("skipped: {} missing (scripts/fetch-model.sh)", path.display());
        return;
    }
    let gpu = Arc::new(Gpu::new(None).unwrap());
    let cfg = EngineConfig {
        max_num_batched_tokens: 512,
        max_sequence_length: 1024,
        max_decode_batch_size: 16,
        ..Default::default()
    };
    let (mut model, tok) = load_model(&path, &cfg, gpu, &|_, _| {}).unwrap();
    let text = "The quick brown fox jumps over the lazy dog. ".repeat(33);
    let prompt = tok.encode(&text).unwrap();
    let table: Vec<u32> = (0..40).collect();

    let mut g = c.benchmark_group("smollm2_q4_1");
    g.sample_size(10);
    g.throughput(Throughput::Elements(prompt.len() as u64));
    g.bench_function(format!("prefill_{}_tokens", prompt.len()), |b| {
        b.iter(|| model.step(&step_input(&prompt, 0, &table)).unwrap())
    });
    // Decode at a context of ~prompt length: one token per step.
    model.step(&step_input(&prompt, 0, &table)).unwrap();
    let pos = prompt.len();
    g.throughput(Throughput::Elements(1));
    g.bench_function("decode_batch1_ctx330", |b| b.iter(|| model.step(&step_input(&[42], pos, &table)).unwrap()));
    // Batched decode: 8 sequences sharing the cached prompt's blocks, one token each.
    for batch in [4usize, 8, 16] {
        let step = StepInput {
            tokens: vec![42; batch],
            positions: vec![pos as u32; batch],
            // Each sequence's position `pos` lies in its own block 40 + i, after the shared ones.
            slots: (0..batch as u32).map(|i| (40 + i) * 16 + pos as u32 % 16).collect(),
            seq_of_token: (0..batch as u32).collect(),
            block_tables: (0..batch)
                .map(|i| {
                    let mut t = table[..pos / 16].to_vec();
                    t.push(40 + i as u32);
                    t
                })
                .collect(),
            sample_rows: (0..batch as u32).collect(),
            sampling: vec![SampleParams::default(); batch],
            state_slots: Vec::new(),
        };
        g.throughput(Throughput::Elements(batch as u64));
        g.bench_function(format!("decode_batch{batch}_ctx330"), |b| b.iter(|| model.step(&step).unwrap()));
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
