//! Kernel benches at the default model's shapes (SmolLM2-135M: hidden 576, ffn 1536, 9/3 heads
//! of 64, vocab 49152): each matmul weight format at decode (1 row) and prefill (128 rows)
//! sizes, paged attention at several context lengths, and sampling. Throughput is reported as
//! multiply-adds (elements = MACs, so GFLOP/s = 2 x Gelem/s) or tokens; weight bytes per call
//! are printed once for GB/s.
//! Run: cargo bench --bench kernels

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::sync::Arc;
use std::time::Duration;
use torus_wgpu::config::KernelProfile;
use torus_wgpu::gpu::wformat::WFormat;
use torus_wgpu::gpu::Gpu;
use torus_wgpu::ops::delta::{DeltaDims, DeltaWeights};
use torus_wgpu::ops::harness::{AttnShape, AttnStep, Harness};
use torus_wgpu::ops::harness_delta::{DeltaSeq, DeltaSlots};
use torus_wgpu::sampling::Rng;
use torus_wgpu::sampling::SampleParams;
use torus_wgpu::weights::tensor::QTensor;

fn rand(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.uniform() - 0.5).collect()
}

/// One decode token's paged attention over `ctx` cached keys of `shape` (the cache filled first).
fn attention_decode(
    g: &mut criterion::BenchmarkGroup<criterion::measurement::WallTime>,
    h: &Harness,
    shape: AttnShape,
    ctx: usize,
    rng: &mut Rng,
    name: String,
) {
    let rig = h.attn_rig(shape, ctx.div_ceil(16) + 1, ctx + 1, 100000.0);
    let table: Vec<u32> = (0..(ctx.div_ceil(16) + 1) as u32).collect();
    let qkv_dim = (shape.heads + 2 * shape.kv_heads) * shape.head_dim;
    let fill = AttnStep {
        positions: (0..ctx as u32).collect(),
        slots: (0..ctx as u32).collect(),
        seq_of_token: vec![0; ctx],
        block_tables: vec![table.clone()],
    };
    h.rope_attention(&rig, &rand(rng, ctx * qkv_dim), &fill).unwrap();
    let step = AttnStep {
        positions: vec![ctx as u32],
        slots: vec![ctx as u32],
        seq_of_token: vec![0],
        block_tables: vec![table],
    };
    let q = rand(rng, qkv_dim);
    g.bench_function(name, |b| b.iter_custom(|iters| h.time_attention(&rig, &q, &step, iters).unwrap()));
}

fn bench(c: &mut Criterion) {
    let gpu = Arc::new(Gpu::new(None).expect("a wgpu adapter"));
    let h = Harness::new(gpu, 64).unwrap();
    let mut rng = Rng::new(3);
    let mut g = c.benchmark_group("kernels");
    g.sample_size(10).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    // (name, rows N, cols K): fused QKV, gate (as a plain matmul), down, lm_head.
    let shapes = [("qkv", 960usize, 576usize), ("ffn_up", 1536, 576), ("down", 576, 1536), ("lm_head", 49152, 576)];
    for format in [WFormat::Q4_1, WFormat::Q8_0, WFormat::Q4_0, WFormat::F16, WFormat::F32] {
        for &(name, n, k) in &shapes {
            if name == "lm_head" && !matches!(format, WFormat::Q8_0 | WFormat::F16) {
                continue;
            }
            let w = QTensor::quantize(format, n, k, &rand(&mut rng, n * k)).unwrap();
            let rows: &[usize] = if name == "lm_head" { &[1] } else { &[1, 128] };
            for &m in rows {
                eprintln!("{:?} {name} m={m}: {} weight bytes per call", format, w.bytes());
                g.throughput(Throughput::Elements((m * n * k) as u64));
                g.bench_function(format!("matmul_{}_{name}_{n}x{k}_m{m}", format.name()), |b| {
                    b.iter_custom(|iters| h.time_matmul(&w, None, m, true, iters).unwrap())
                });
            }
        }
    }
    // Every GGUF format at shapes whose rows are whole K-quant super-blocks (Qwen2.5-0.5B's
    // ffn_down 896x4864, and a 2048x1024 projection), random blocks: the K-quants, Q5, the IQ
    // types and MXFP4 beside the legacy formats on equal terms.
    let k_shapes = [("down05b", 896usize, 4864usize), ("proj", 2048, 1024)];
    for format in [
        WFormat::Q4_0,
        WFormat::Q4_1,
        WFormat::Q5_0,
        WFormat::Q8_0,
        WFormat::Q2_K,
        WFormat::Q3_K,
        WFormat::Q4_K,
        WFormat::Q5_K,
        WFormat::Q6_K,
        WFormat::IQ4_NL,
        WFormat::IQ4_XS,
        WFormat::MXFP4,
        WFormat::IQ2_XXS,
        WFormat::IQ2_XS,
        WFormat::IQ2_S,
        WFormat::IQ3_XXS,
        WFormat::IQ3_S,
        WFormat::IQ1_S,
        WFormat::IQ1_M,
        WFormat::F16,
    ] {
        for &(name, n, k) in &k_shapes {
            let w = QTensor::random_gguf(format, n, k, 7).unwrap();
            for m in [1usize, 128] {
                eprintln!("{:?} {name} m={m}: {} weight bytes per call", format, w.bytes());
                g.throughput(Throughput::Elements((m * n * k) as u64));
                g.bench_function(format!("matmul_{}_{name}_{n}x{k}_m{m}", format.name()), |b| {
                    b.iter_custom(|iters| h.time_matmul(&w, None, m, true, iters).unwrap())
                });
            }
        }
    }
    // Paged attention, decode (1 query token) at several context lengths.
    let shape = AttnShape { heads: 9, kv_heads: 3, head_dim: 64, block_size: 16 };
    for ctx in [128usize, 512, 2048] {
        g.throughput(Throughput::Elements(ctx as u64));
        attention_decode(&mut g, &h, shape, ctx, &mut rng, format!("attention_decode_ctx{ctx}"));
    }
    // A hybrid model's token mixers per decode token and layer: Qwen3.5-9B's Gated DeltaNet
    // (conv, q/k norm + decay, the delta rule over 32 value heads of 128 x 128, the gated norm;
    // its cost does not grow with the context) beside paged attention at 4096 keys of Qwen2.5-7B
    // (28 / 4 heads of 128) and of Qwen3.5-9B's attention layers (16 / 4 heads of 256).
    // Run: cargo bench --bench kernels -- mixer_decode
    let d = DeltaDims { k_heads: 16, v_heads: 32, k_dim: 128, v_dim: 128, kernel: 4 };
    let dh = Harness::for_delta(h.gpu.clone(), 128, KernelProfile::Cpu).unwrap();
    let (conv, a, dt, norm) = (rand(&mut rng, d.conv_dim() * 4), vec![-0.5; 32], vec![0.1; 32], vec![1.0; 128]);
    let w = DeltaWeights { conv: &conv, a: &a, dt_bias: &dt, norm: &norm };
    let x = rand(&mut rng, d.proj_width());
    let mut st = DeltaSlots { conv: vec![0.0; d.conv_state()], rec: vec![0.0; d.rec_state()] };
    let seqs = [DeltaSeq { slot: 0, tokens: 1, reset: false, backup: None, snapshot: None, src: None }];
    g.throughput(Throughput::Elements(1));
    g.bench_function("mixer_decode_gated_deltanet_qwen35_9b", |b| {
        b.iter_custom(|iters| dh.time_delta(&d, &w, &x, &seqs, &mut st, iters).unwrap())
    });
    // The same mixer over a 512-token prompt (prefill): the gpu profile's chunked form, and the
    // cpu profile's per-token recurrence.
    // Run: cargo bench --bench kernels -- mixer_prefill
    let n = 512;
    let xp = rand(&mut rng, n * d.proj_width());
    let seqs = [DeltaSeq { slot: 0, tokens: n, reset: true, backup: None, snapshot: None, src: None }];
    g.throughput(Throughput::Elements(n as u64));
    for (name, profile) in [("chunked", KernelProfile::Gpu), ("per_token", KernelProfile::Cpu)] {
        let ph = Harness::for_delta(h.gpu.clone(), 128, profile).unwrap();
        g.bench_function(format!("mixer_prefill512_gated_deltanet_qwen35_9b_{name}"), |b| {
            b.iter_custom(|iters| ph.time_delta(&d, &w, &xp, &seqs, &mut st, iters).unwrap())
        });
    }
    for (name, heads, kv_heads, head_dim) in [("qwen25_7b", 28usize, 4usize, 128usize), ("qwen35_9b", 16, 4, 256)] {
        let group = (head_dim as u32, (heads / kv_heads) as u32);
        let ah = Harness::attention_only(h.gpu.clone(), group, Default::default(), 1, KernelProfile::Cpu).unwrap();
        let shape = AttnShape { heads, kv_heads, head_dim, block_size: 16 };
        attention_decode(&mut g, &ah, shape, 4096, &mut rng, format!("mixer_decode_attention_ctx4096_{name}"));
    }
    // Sampling over the vocabulary: greedy, temperature + top-k + top-p, and top-p alone (one
    // sampler in both profiles: histogram thresholds), at SmolLM2's and Qwen2.5's vocabularies.
    for vocab in [49152usize, 151936] {
        let logits: Vec<f32> = (0..8 * vocab).map(|_| 4.0 * (rng.uniform() - 0.5)).collect();
        for (name, p) in [
            ("greedy", SampleParams::default()),
            ("top_k_top_p", SampleParams { temperature: 0.8, top_k: 40, top_p: 0.9, u: 0.3, ..Default::default() }),
            ("top_p", SampleParams { temperature: 0.8, top_p: 0.9, u: 0.3, ..Default::default() }),
        ] {
            let params = vec![p; 8];
            g.throughput(Throughput::Elements(8));
            g.bench_function(format!("sample_{name}_8rows_vocab{vocab}"), |b| {
                b.iter_custom(|iters| h.time_sample(&logits, vocab, &params, iters).unwrap())
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
