//! Pipeline-parallel overhead on this machine's adapter:
//! - `hop/N`: the host hop between two devices for N tokens of SmolLM2 hidden state (copy to a
//!   mapped buffer on device A, read it, write it to device B and wait), reported per byte;
//! - `step/S stages/T tokens`: one forward step of SmolLM2 split into S in-process stages (each
//!   its own device) against the single-device step, and `step/2 workers/T` with the two stages
//!   in `torus-wgpu worker` processes on 127.0.0.1 (gRPC).
//!
//! Run: cargo bench --bench pipeline

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::path::{Path, PathBuf};

use torus_wgpu::config::{EngineConfig, StageConfig};
use torus_wgpu::gpu::Gpu;
use torus_wgpu::model::StepInput;
use torus_wgpu::sampling::SampleParams;

const HIDDEN: usize = 576;

fn hop(c: &mut Criterion) {
    let (a, b) = (Gpu::new(None).unwrap(), Gpu::new(None).unwrap());
    let max = 4096 * HIDDEN * 4;
    let src = a.storage("src", max as u64);
    let rb = a.readback("hop", max as u64);
    let dst = b.storage("dst", max as u64);
    let mut g = c.benchmark_group("hop");
    for tokens in [1usize, 16, 128, 512, 4096] {
        let bytes = tokens * HIDDEN * 4;
        g.throughput(Throughput::Bytes(bytes as u64));
        g.bench_with_input(BenchmarkId::from_parameter(tokens), &bytes, |bench, &bytes| {
            bench.iter(|| {
                let mut enc = a.device.create_command_encoder(&Default::default());
                enc.copy_buffer_to_buffer(&src, 0, &rb, 0, bytes as u64);
                a.queue.submit([enc.finish()]);
                let host = a.read_mapped(&rb, bytes as u64).unwrap();
                b.queue.write_buffer(&dst, 0, &host);
                b.queue.submit([]);
                b.device.poll(wgpu::PollType::wait_indefinitely()).unwrap();
            })
        });
    }
    g.finish();
}

fn step_input(n: usize) -> StepInput {
    let pos: Vec<u32> = (0..n as u32).collect();
    StepInput {
        tokens: (0..n as u32).map(|i| 100 + i * 7).collect(),
        positions: pos.clone(),
        slots: pos,
        seq_of_token: vec![0; n],
        block_tables: vec![(0..32).collect()],
        sample_rows: vec![n as u32 - 1],
        sampling: vec![SampleParams::default()],
        state_slots: Vec::new(),
    }
}

fn steps(c: &mut Criterion) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.exists() {
        eprintln!("skipped: {} missing (scripts/fetch-model.sh)", path.display());
        return;
    }
    let cfg = EngineConfig {
        model: Some(path.display().to_string()),
        max_num_batched_tokens: 256,
        max_sequence_length: 512,
        total_cache_size: 64 << 20,
        ..Default::default()
    };
    let mut g = c.benchmark_group("step");
    g.sample_size(10);
    for stages in [1usize, 2, 3] {
        let p = PathBuf::from(&path);
        let pcfg = EngineConfig {
            enable_pipeline_parallel: true,
            world_size: stages,
            stages: vec![StageConfig::default(); stages],
            ..cfg.clone()
        };
        let pipe = torus_wgpu::exec::build(&pcfg, &p, &|_, _| {}, &|_| {}).unwrap();
        bench_steps(&mut g, &format!("{stages} stages"), pipe);
    }
    // The same two stages as worker processes on 127.0.0.1 (gRPC instead of an in-process hop).
    let workers = [(0, 15), (15, 30)].map(|(a, b)| Worker::start(&cfg, a, b));
    let stages = workers
        .iter()
        .map(|w| StageConfig {
            address: Some(w.addr.clone()),
            stage_start_layer: Some(w.layers.0),
            stage_end_layer: Some(w.layers.1),
            ..Default::default()
        })
        .collect();
    let pcfg = EngineConfig { enable_pipeline_parallel: true, world_size: 2, stages, ..cfg.clone() };
    let pipe = torus_wgpu::exec::build(&pcfg, &path, &|_, _| {}, &|_| {}).unwrap();
    bench_steps(&mut g, "2 workers", pipe);
    g.finish();
}

fn bench_steps(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    mut pipe: torus_wgpu::exec::Pipeline,
) {
    for tokens in [1usize, 256] {
        let input = step_input(tokens);
        g.throughput(Throughput::Elements(tokens as u64));
        g.bench_function(BenchmarkId::new(name, tokens), |b| b.iter(|| pipe.step(input.clone(), false).unwrap()));
    }
}

/// A `torus-wgpu worker` process for layers a..b, killed when dropped.
struct Worker {
    child: std::process::Child,
    addr: String,
    layers: (usize, usize),
}

impl Worker {
    fn start(cfg: &EngineConfig, a: usize, b: usize) -> Worker {
        use std::io::BufRead;
        let addr = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
        let file = std::env::temp_dir().join(format!("torus-bench-worker-{}-{a}.json", std::process::id()));
        let w = EngineConfig { stage_start_layer: Some(a), stage_end_layer: Some(b), ..cfg.clone() };
        std::fs::write(&file, serde_json::to_string(&w).unwrap()).unwrap();
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_torus-wgpu"))
            .args(["worker", "--config", file.to_str().unwrap(), "--listen", &addr])
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // Keep reading its stderr after "ready" so the worker never writes to a closed pipe.
        let err = std::io::BufReader::new(child.stderr.take().unwrap());
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in err.lines().map_while(Result::ok) {
                if line.contains("ready on") {
                    let _ = tx.send(());
                }
            }
        });
        rx.recv().expect("the worker exited before it was ready");
        Worker { child, addr, layers: (a, b) }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

criterion_group!(benches, hop, steps);
criterion_main!(benches);
