//! A model with Qwen2.5-7B's shapes (hidden 3584, 28 heads, 4 KV heads, intermediate 18944,
//! vocab 152064; 2 layers of random Q4_K weights, written by the test as a GGUF file) runs a
//! 2048-token prefill step on lavapipe: the 155 MB FFN activations (over the 128 MiB binding)
//! run as sub-steps, every grid is folded within the device's limits, and the step's last-token
//! logits are those of the prompt's last 256-token chunk run over the cached prefix. Then it
//! decodes.

use std::sync::Arc;
use torus_wgpu::config::{EngineConfig, KvDtype};
use torus_wgpu::gpu::wformat::WFormat;
use torus_wgpu::gpu::Gpu;
use torus_wgpu::model::loader::HostModel;
use torus_wgpu::model::synth::{synth_shape, write_synthetic_gguf};
use torus_wgpu::model::{Model, StepInput};
use torus_wgpu::sampling::Rng;
use torus_wgpu::sampling::SampleParams;

/// Runs `tokens` (positions from `start`) through the model in steps of at most `chunk` tokens,
/// the sequence's KV blocks at `table`; returns the last step's sampled token and the logits of
/// its last token.
fn prefill(model: &mut Model, tokens: &[u32], start: usize, chunk: usize, table: &[u32]) -> (u32, Vec<f32>) {
    let bs = model.limits.block_size;
    let mut out = None;
    for (i, c) in tokens.chunks(chunk).enumerate() {
        let pos: Vec<u32> = (start + i * chunk..start + i * chunk + c.len()).map(|p| p as u32).collect();
        let r = model
            .step(&StepInput {
                tokens: c.to_vec(),
                positions: pos.clone(),
                slots: pos.iter().map(|&p| table[p as usize / bs] * bs as u32 + p % bs as u32).collect(),
                seq_of_token: vec![0; c.len()],
                block_tables: vec![table.to_vec()],
                sample_rows: vec![c.len() as u32 - 1],
                sampling: vec![SampleParams::default()],
                state_slots: Vec::new(),
            })
            .unwrap();
        out = Some(r[0].id);
    }
    (out.unwrap(), model.last_logits(1).unwrap())
}

#[test]
fn qwen25_7b_shape_2048_token_step_matches_chunked_prefill() {
    let dir = std::env::temp_dir().join(format!("torus-big-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("qwen2.5-7b-shape-2-layers.q4_k.gguf");
    let shape = synth_shape("qwen2.5-7b").unwrap();
    write_synthetic_gguf(&path, &shape, WFormat::Q4_K, Some(2), 7).unwrap();
    let host = HostModel::load(&path, &|_, _| {}).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!((host.cfg.hidden, host.cfg.intermediate, host.cfg.vocab), (3584, 18944, 152064));

    let n = 2048;
    let cfg = EngineConfig {
        max_num_batched_tokens: n,
        max_decode_batch_size: 1,
        max_prefill_batch_size: 1,
        max_sequence_length: n + 64,
        // Two copies of the prompt's KV blocks (the whole step and the chunks) and the decode.
        total_cache_size: 2 * 2 * 2 * 280 * (16 * 512 * 2),
        kv_cache_dtype: KvDtype::F16,
        ..Default::default()
    };
    let limits = torus_wgpu::exec::step_limits(&cfg, &host.cfg);
    let gpu = Arc::new(Gpu::new(None).expect("a wgpu adapter (lavapipe in CI)"));
    let mut model = Model::new(gpu.clone(), &host, limits).unwrap();
    // 2048 rows of the 18944-wide FFN activations exceed one storage binding: sub-steps.
    let (sub_tokens, _) = model.sub_step_limits();
    assert!(sub_tokens < n && 18944 * 4 * sub_tokens as u64 <= gpu.max_binding, "{sub_tokens} tokens per sub-step");

    let mut rng = Rng::new(11);
    let prompt: Vec<u32> = (0..n).map(|_| (rng.uniform() * 150000.0) as u32).collect();
    let blocks = (n + 64).div_ceil(16) as u32;
    let table_a: Vec<u32> = (0..blocks).collect();
    let (tok_a, whole) = prefill(&mut model, &prompt, 0, n, &table_a);
    // The chunked run's first 7 chunks would write the K/V the whole step wrote (per-row
    // kernels): to keep the test quick it shares those blocks, as the prefix cache would, and
    // runs the last 256-token chunk on blocks of its own.
    let shared = (n - 256) / 16;
    let table_b: Vec<u32> = table_a[..shared].iter().copied().chain(blocks..2 * blocks - shared as u32).collect();
    let (tok_b, chunked) = prefill(&mut model, &prompt[n - 256..], n - 256, 256, &table_b);
    assert!(whole.iter().all(|v| v.is_finite()), "finite logits");
    let scale = whole.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = whole.iter().zip(&chunked).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    eprintln!("2048-token step vs its last 256-token chunk: max |logit diff| {diff} (largest |logit| {scale})");
    assert!(scale > 0.0 && diff < 1e-2, "last-token logits differ by {diff}");
    let top2 = {
        let mut v = whole.clone();
        v.sort_by(|a, b| b.total_cmp(a));
        v[0] - v[1]
    };
    if top2 > 1e-2 {
        assert_eq!(tok_a, tok_b, "greedy token after the prompt");
    }
    // Decode a few tokens after the whole-step prefill.
    let mut tok = tok_a;
    for i in 0..3 {
        let (next, logits) = prefill(&mut model, &[tok], n + i, 1, &table_a);
        assert!(logits.iter().all(|v| v.is_finite()), "decode step {i}: finite logits");
        assert!((next as usize) < 152064);
        tok = next;
    }
}
