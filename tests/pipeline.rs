//! Pipeline parallelism: the model split into 2 and 3 stages (separate devices in this process,
//! and `torus-wgpu worker` processes on 127.0.0.1) must give the single-device greedy tokens and
//! last-position logits within 1e-4; the engine over a pipeline (several steps in flight, prefix
//! cache on) must give the single-device outputs; bad configs and dead or restarted workers give
//! clear errors and nothing hangs.

mod common;
use common::{greedy_req, smollm2, spawn_until_ready, tiny};

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};
use torus_wgpu::config::{EngineConfig, StageConfig};
use torus_wgpu::engine::{load_model, load_tokenizer, EngineHandle, FinishReason, Request};
use torus_wgpu::exec::{self as pipeline, Pipeline};
use torus_wgpu::gpu::Gpu;
use torus_wgpu::model::StepInput;
use torus_wgpu::sampling::SampleParams;

fn base_cfg(path: &Path) -> EngineConfig {
    EngineConfig {
        model: Some(path.display().to_string()),
        max_num_batched_tokens: 128,
        max_sequence_length: 256,
        total_cache_size: 16 << 20,
        max_decode_batch_size: 8,
        max_prefill_batch_size: 4,
        ..Default::default()
    }
}

/// `cfg` as a pipeline of stages: (layer range, worker address or None for this process).
fn pipeline_cfg(cfg: &EngineConfig, stages: &[(usize, usize, Option<&str>)]) -> EngineConfig {
    EngineConfig {
        enable_pipeline_parallel: true,
        world_size: stages.len(),
        stages: stages
            .iter()
            .map(|&(a, b, addr)| StageConfig {
                address: addr.map(str::to_string),
                stage_start_layer: Some(a),
                stage_end_layer: Some(b),
                ..Default::default()
            })
            .collect(),
        ..cfg.clone()
    }
}

fn build(cfg: &EngineConfig) -> anyhow::Result<Pipeline> {
    let path = PathBuf::from(cfg.model.clone().unwrap());
    pipeline::build(cfg, &path, &|_, _| {}, &|_| {})
}

fn prompts(path: &Path) -> Vec<Vec<u32>> {
    let tok = load_tokenizer(path).unwrap();
    ["The capital of France is", "Once upon a time, in a small village by the sea, there lived", "1, 2, 3, 4,"]
        .iter()
        .map(|t| tok.encode(t).unwrap())
        .collect()
}

/// Greedy generation of `n` tokens through `step` (one sequence, blocks 0.. in order), with the
/// logits of every sampled position.
fn greedy(step: &mut dyn FnMut(&StepInput) -> (u32, Vec<f32>), prompt: &[u32], n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let table: Vec<u32> = (0..16).collect();
    let (mut toks, mut logits) = (vec![], vec![]);
    let mut input = prompt.to_vec();
    let mut pos = 0u32;
    for _ in 0..n {
        let len = input.len() as u32;
        let positions: Vec<u32> = (pos..pos + len).collect();
        let s = StepInput {
            tokens: input.clone(),
            positions: positions.clone(),
            slots: positions,
            seq_of_token: vec![0; len as usize],
            block_tables: vec![table.clone()],
            sample_rows: vec![len - 1],
            sampling: vec![SampleParams::default()],
            state_slots: Vec::new(),
        };
        let (t, l) = step(&s);
        toks.push(t);
        logits.push(l);
        pos += len;
        input = vec![t];
    }
    (toks, logits)
}

fn single_reference(path: &Path, cfg: &EngineConfig, n: usize) -> Vec<(Vec<u32>, Vec<Vec<f32>>)> {
    let gpu = Arc::new(Gpu::new(None).unwrap());
    let (mut m, _) = load_model(path, cfg, gpu, &|_, _| {}).unwrap();
    prompts(path)
        .iter()
        .map(|p| {
            greedy(
                &mut |s| {
                    let r = m.step(s).unwrap();
                    (r[0].id, m.last_logits(1).unwrap())
                },
                p,
                n,
            )
        })
        .collect()
}

fn check_pipeline(path: &Path, p: &mut Pipeline, want: &[(Vec<u32>, Vec<Vec<f32>>)], n: usize) {
    for (prompt, (want_toks, want_logits)) in prompts(path).iter().zip(want) {
        let (toks, logits) = greedy(
            &mut |s| {
                let out = p.step(s.clone(), true).unwrap();
                (out.sampled[0].id, out.logits.unwrap())
            },
            prompt,
            n,
        );
        assert_eq!(&toks, want_toks, "greedy tokens differ from the single-device run ({})", p.describe());
        for (step, (a, b)) in logits.iter().zip(want_logits).enumerate() {
            assert_eq!(a.len(), b.len());
            let d = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
            assert!(d <= 1e-4, "step {step}: logits differ by {d} ({})", p.describe());
        }
    }
}

#[test]
fn in_process_stages_match_single_device() {
    let cases = vec![
        (tiny(), vec![vec![(0, 1), (1, 2)]]),
        (smollm2(), vec![vec![(0, 13), (13, 30)], vec![(0, 10), (10, 20), (20, 30)]]),
    ];
    for (path, splits) in cases {
        let cfg = base_cfg(&path);
        let want = single_reference(&path, &cfg, 6);
        for split in splits {
            let stages: Vec<_> = split.iter().map(|&(a, b)| (a, b, None)).collect();
            let mut p = build(&pipeline_cfg(&cfg, &stages)).unwrap();
            assert_eq!(p.depth(), split.len());
            check_pipeline(&path, &mut p, &want, 6);
        }
    }
}

#[test]
fn split_without_ranges_is_even_and_covers_every_layer() {
    let cfg = EngineConfig { enable_pipeline_parallel: true, world_size: 2, ..base_cfg(&tiny()) };
    let p = build(&cfg).unwrap();
    let layers: Vec<_> = p.health.iter().map(|h| h.layers.clone()).collect();
    // Both stages on the same adapter: equal memory, even split.
    assert_eq!(layers, vec![0..1, 1..2]);
    let g = Gpu::new(None).unwrap();
    if g.info.backend == wgpu::Backend::Vulkan {
        assert!(g.memory.is_some_and(|m| m > 0), "Vulkan reported no device-local memory");
    }
    assert_eq!(pipeline::split_layers(30, &[None, None, None]).unwrap(), vec![0..10, 10..20, 20..30]);
    assert_eq!(pipeline::split_layers(30, &[Some(1 << 30), Some(2 << 30)]).unwrap(), vec![0..10, 10..30]);
    // Unknown memory anywhere: even.
    assert_eq!(pipeline::split_layers(7, &[Some(5), None]).unwrap(), vec![0..4, 4..7]);
    // Every stage keeps at least one layer however skewed the memory.
    assert_eq!(pipeline::split_layers(3, &[Some(1000), Some(1), Some(1)]).unwrap(), vec![0..1, 1..2, 2..3]);
    assert!(pipeline::split_layers(2, &[None, None, None]).is_err());
    // A stage reads only its layers; building a stage from layers not read fails clearly.
    use torus_wgpu::model::loader::HostModel;
    let host = HostModel::load_layers(&tiny(), Some(1..2), &|_, _| {}).unwrap();
    assert_eq!((host.first_layer, host.layers.len()), (1, 1));
    let gpu = Arc::new(Gpu::new(None).unwrap());
    let limits = pipeline::step_limits(&cfg, &host.cfg);
    assert!(torus_wgpu::model::Model::new_stage(gpu.clone(), &host, limits, 1..2).is_ok());
    let e = torus_wgpu::model::Model::new_stage(gpu, &host, limits, 0..1).err().unwrap().to_string();
    assert!(e.contains("layers 0..1 were not loaded"), "{e}");
    let e = HostModel::load_layers(&tiny(), Some(1..3), &|_, _| {}).err().unwrap().to_string();
    assert!(e.contains("outside the model's 2 layers"), "{e}");
    // A middle stage reads neither the embedding nor the output projection.
    let s = smollm2();
    let mid = HostModel::load_layers(&s, Some(10..20), &|_, _| {}).unwrap();
    assert!(mid.embed.is_none() && mid.lm_head().is_none() && mid.layers.len() == 10);
    let last = HostModel::load_layers(&s, Some(20..30), &|_, _| {}).unwrap();
    assert!(last.tied && last.lm_head().is_some());
}

fn build_err(cfg: &EngineConfig) -> String {
    match build(cfg) {
        Ok(_) => panic!("config {:?} was accepted", cfg.stages),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn bad_pipeline_configs_fail_naming_the_problem() {
    let cfg = base_cfg(&tiny());
    let ranges = |r: &[(usize, usize)]| pipeline_cfg(&cfg, &r.iter().map(|&(a, b)| (a, b, None)).collect::<Vec<_>>());
    let cases: Vec<(EngineConfig, &str)> = vec![
        (ranges(&[(0, 1), (2, 2)]), "stage_start_layer 2 must be below stage_end_layer 2"),
        (ranges(&[(1, 2)]), "gap: layers 0..1 belong to no stage"),
        (ranges(&[(0, 2), (1, 2)]), "overlap: layers 1..2 are in both stage 0 and stage 1"),
        (ranges(&[(0, 1), (1, 3)]), "stage 1: stage_end_layer 3 is beyond the model's 2 layers"),
        (ranges(&[(0, 1)]), "layers 1..2 belong to no stage"),
        (
            EngineConfig {
                stages: vec![
                    StageConfig { adapter: Some("no-such-adapter".into()), ..Default::default() },
                    StageConfig::default(),
                ],
                ..ranges(&[(0, 1), (1, 2)])
            },
            "stage 0: no adapter matches 'no-such-adapter'",
        ),
        (EngineConfig { world_size: 3, ..base_cfg(&tiny()) }.with_pipeline(), "cannot split 2 layers into 3 stages"),
    ];
    for (c, want) in cases {
        let e = build_err(&c);
        assert!(e.contains(want), "error {e:?} does not say {want:?}");
    }
    // Config-level checks (what `serve --config` reports before loading anything).
    let mut c = ranges(&[(0, 1), (1, 2)]);
    c.world_size = 3;
    assert!(c.validate().unwrap_err().to_string().contains("world_size is 3 but 2 stages are given"));
    let mut c = ranges(&[(0, 1), (1, 2)]);
    c.stages[1].stage_end_layer = None;
    assert!(c.validate().unwrap_err().to_string().contains("stage 1: give both"));
    let mut c = ranges(&[(0, 1), (1, 2)]);
    c.stages[1].address = Some("127.0.0.1:1".into());
    c.stages[1].adapter = Some("0".into());
    assert!(c.validate().unwrap_err().to_string().contains("either address"));
    let mut c = ranges(&[(0, 1), (1, 2)]);
    c.enable_pipeline_parallel = false;
    assert!(c.validate().is_err());
    // A config file with an unknown stage key is refused by name.
    let dir = std::env::temp_dir().join(format!("torus-pp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("bad.json");
    std::fs::write(&f, r#"{"enable_pipeline_parallel": true, "world_size": 1, "stages": [{"adaptor": "0"}]}"#).unwrap();
    let e = EngineConfig::from_file(&f).unwrap_err().to_string();
    assert!(e.contains("adaptor"), "{e}");
}

trait WithPipeline {
    fn with_pipeline(self) -> Self;
}

impl WithPipeline for EngineConfig {
    fn with_pipeline(mut self) -> Self {
        self.enable_pipeline_parallel = true;
        self
    }
}

/// Prompts with a shared 40-token prefix (prefix-cache hits) and distinct tails.
fn engine_prompts(path: &Path) -> Vec<Vec<u32>> {
    let base = prompts(path);
    let shared: Vec<u32> = base.iter().flatten().cycle().take(40).copied().collect();
    let mut v: Vec<Vec<u32>> = base.clone();
    for (i, p) in base.iter().enumerate() {
        let mut q = shared.clone();
        q.extend(p);
        q.push(p[i % p.len()]);
        v.push(q);
    }
    v
}

/// The engine's counters once it has published the end of the last request (its gauges are
/// updated just after the requests' final events are sent).
fn settled(e: &EngineHandle) -> torus_wgpu::engine::metrics::MetricsSnapshot {
    let t0 = Instant::now();
    loop {
        let m = e.metrics.snapshot();
        if (m.running == 0 && m.waiting == 0) || t0.elapsed() > Duration::from_secs(10) {
            return m;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn run_concurrently(e: &EngineHandle, reqs: &[Request]) -> Vec<Vec<u32>> {
    let streams: Vec<_> = reqs.iter().map(|r| e.submit(r.clone()).unwrap()).collect();
    streams
        .into_iter()
        .map(|s| {
            let c = s.collect_blocking();
            assert!(matches!(c.reason, FinishReason::Length), "{:?}", c.reason);
            c.ids
        })
        .collect()
}

fn single_engine_outputs(path: &Path, cfg: &EngineConfig, reqs: &[Request]) -> Vec<Vec<u32>> {
    let gpu = Arc::new(Gpu::new(None).unwrap());
    let (m, tok) = load_model(path, cfg, gpu, &|_, _| {}).unwrap();
    let e = EngineHandle::start(m, tok, cfg);
    let out = reqs.iter().map(|r| e.submit(r.clone()).unwrap().collect_blocking().ids).collect();
    e.shutdown(false);
    out
}

/// Prompt logprobs (`echo` with `logprobs`) through pipeline stages, with 16-token chunks that
/// overlap in the stages and a 14-block pool that forces preemption (a preempted request
/// recomputes its prompt but reports each prompt logprob once): the tokens, the prompt
/// logprobs' ids and top ids equal the single device's, and their values agree within 1e-4.
#[test]
fn pipelined_prompt_logprobs_match_single_device() {
    let path = tiny();
    let cfg = base_cfg(&path);
    let reqs: Vec<Request> = engine_prompts(&path)
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut r = greedy_req(p, 24);
            r.params.prompt_logprobs = (i % 2 == 0).then_some(2);
            r
        })
        .collect();
    let gpu = Arc::new(Gpu::new(None).unwrap());
    let (m, tok) = load_model(&path, &cfg, gpu, &|_, _| {}).unwrap();
    let single = EngineHandle::start(m, tok, &cfg);
    let want: Vec<_> = reqs.iter().map(|r| single.submit(r.clone()).unwrap().collect_blocking()).collect();
    single.shutdown(false);
    let mut pcfg = pipeline_cfg(&cfg, &[(0, 1, None), (1, 2, None)]);
    pcfg.max_num_batched_tokens = 16;
    pcfg.total_cache_size = 14 * 4096;
    let e = EngineHandle::start(build(&pcfg).unwrap(), load_tokenizer(&path).unwrap(), &pcfg);
    let streams: Vec<_> = reqs.iter().map(|r| e.submit(r.clone()).unwrap()).collect();
    for (i, (s, w)) in streams.into_iter().zip(&want).enumerate() {
        let got = s.collect_blocking();
        assert_eq!(got.ids, w.ids, "request {i}: tokens");
        let n = if reqs[i].params.prompt_logprobs.is_some() { reqs[i].prompt.len() - 1 } else { 0 };
        assert_eq!(got.prompt_logprobs.len(), n, "request {i}");
        assert_eq!(w.prompt_logprobs.len(), n, "request {i} (single device)");
        for (a, b) in got.prompt_logprobs.iter().zip(&w.prompt_logprobs) {
            let top = |x: &torus_wgpu::engine::PromptLogprob| x.top.iter().map(|t| t.0).collect::<Vec<_>>();
            assert_eq!((a.id, top(a)), (b.id, top(b)), "request {i}");
            assert!((a.logprob - b.logprob).abs() < 1e-4, "request {i}: {} vs {}", a.logprob, b.logprob);
        }
    }
    let m = settled(&e);
    assert!(m.preemptions > 0 && m.steps_overlapped > 0, "{m:?}");
    assert_eq!(m.kv_blocks_used, 0, "blocks leaked: {m:?}");
    e.shutdown(false);
}

#[test]
fn engine_over_in_process_pipeline_matches_single_device() {
    let cases = vec![
        (tiny(), vec![(0, 1, None), (1, 2, None)], 24),
        (smollm2(), vec![(0, 10, None), (10, 20, None), (20, 30, None)], 12),
    ];
    for (path, stages, n) in cases {
        let cfg = base_cfg(&path);
        let reqs: Vec<Request> = engine_prompts(&path).iter().map(|p| greedy_req(p, n)).collect();
        let want = single_engine_outputs(&path, &cfg, &reqs);
        let pcfg = pipeline_cfg(&cfg, &stages);
        let e = EngineHandle::start(build(&pcfg).unwrap(), load_tokenizer(&path).unwrap(), &pcfg);
        // Twice: the second round hits the prefix cache the first one filled.
        for round in 0..2 {
            assert_eq!(run_concurrently(&e, &reqs), want, "round {round} over {} stages", stages.len());
        }
        let m = settled(&e);
        assert!(m.prefix_hits > 0, "prefix cache unused: {m:?}");
        assert_eq!(m.kv_blocks_used, 0, "blocks leaked: {m:?}");
        e.shutdown(false);
    }
}

#[test]
fn pipelined_chunked_prefill_and_preemption_match_single_device() {
    // A 16-token budget splits every prompt into chunks that follow each other through the
    // stages; a 14-block pool forces preemption while other steps are in flight.
    let path = tiny();
    let cfg = base_cfg(&path);
    let reqs: Vec<Request> = engine_prompts(&path).iter().map(|p| greedy_req(p, 24)).collect();
    let want = single_engine_outputs(&path, &cfg, &reqs);
    for (budget, blocks) in [(16, 0), (128, 14), (16, 14)] {
        let mut pcfg = pipeline_cfg(&cfg, &[(0, 1, None), (1, 2, None)]);
        pcfg.max_num_batched_tokens = budget;
        if blocks > 0 {
            // 14 blocks x 16 tokens x 32 kv values x 2 bytes (f16) x (K, V) x 2 layers.
            pcfg.total_cache_size = 14 * 4096;
        }
        let e = EngineHandle::start(build(&pcfg).unwrap(), load_tokenizer(&path).unwrap(), &pcfg);
        if blocks > 0 {
            assert_eq!(e.info.num_blocks, blocks);
        }
        assert_eq!(run_concurrently(&e, &reqs), want, "budget {budget}, {blocks} blocks");
        let m = settled(&e);
        assert!(m.steps_overlapped > 0, "no two steps were ever in flight together: {m:?}");
        if blocks > 0 {
            assert!(m.preemptions > 0, "no preemption happened: {m:?}");
        }
        assert_eq!(m.kv_blocks_used, 0, "blocks leaked: {m:?}");
        e.shutdown(false);
    }
    // One long prompt alone: its chunks follow each other through the stages.
    let mut pcfg = pipeline_cfg(&cfg, &[(0, 1, None), (1, 2, None)]);
    pcfg.max_num_batched_tokens = 16;
    let e = EngineHandle::start(build(&pcfg).unwrap(), load_tokenizer(&path).unwrap(), &pcfg);
    let long = reqs.iter().max_by_key(|r| r.prompt.len()).unwrap().clone();
    let i = reqs.iter().position(|r| r.prompt == long.prompt).unwrap();
    assert_eq!(run_concurrently(&e, std::slice::from_ref(&long)), vec![want[i].clone()]);
    let m = settled(&e);
    assert!(m.steps_overlapped >= (long.prompt.len() / 16 - 1) as u64, "prefill chunks did not overlap: {m:?}");
    e.shutdown(false);
}

#[test]
fn requests_dropped_while_their_steps_are_in_flight() {
    // Streams dropped mid-generation while their steps are in the pipeline: their blocks come
    // back, the other requests' outputs do not change.
    let path = tiny();
    let cfg = base_cfg(&path);
    let reqs: Vec<Request> = engine_prompts(&path).iter().map(|p| greedy_req(p, 40)).collect();
    let want = single_engine_outputs(&path, &cfg, &reqs);
    let pcfg = pipeline_cfg(&cfg, &[(0, 1, None), (1, 2, None)]);
    let e = EngineHandle::start(build(&pcfg).unwrap(), load_tokenizer(&path).unwrap(), &pcfg);
    let mut streams: Vec<_> = reqs.iter().map(|r| Some(e.submit(r.clone()).unwrap())).collect();
    for (i, s) in streams.iter_mut().enumerate() {
        if i % 2 == 1 {
            let mut st = s.take().unwrap();
            assert!(matches!(st.next_blocking(), Some(torus_wgpu::engine::Event::Token { .. })));
            drop(st);
        }
    }
    for (i, s) in streams.into_iter().enumerate() {
        if let Some(s) = s {
            assert_eq!(s.collect_blocking().ids, want[i], "request {i}");
        }
    }
    let m = settled(&e);
    assert_eq!((m.kv_blocks_used, m.requests_aborted), (0, 3), "{m:?}");
    e.shutdown(false);
}

/// A `torus-wgpu worker` process, killed when dropped.
struct WorkerProc {
    child: Child,
    addr: String,
    cfg_file: PathBuf,
}

fn free_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

impl WorkerProc {
    fn start(cfg: &EngineConfig, layers: (usize, usize), addr: &str) -> WorkerProc {
        let dir = std::env::temp_dir().join(format!("torus-pp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg_file = dir.join(format!("worker-{}.json", addr.replace([':', '.'], "_")));
        let w = EngineConfig {
            enable_pipeline_parallel: true,
            world_size: 2,
            pipeline_rank: usize::from(layers.0 > 0),
            stage_start_layer: Some(layers.0),
            stage_end_layer: Some(layers.1),
            ..cfg.clone()
        };
        std::fs::write(&cfg_file, serde_json::to_string_pretty(&w).unwrap()).unwrap();
        WorkerProc::spawn(cfg_file, addr)
    }

    fn spawn(cfg_file: PathBuf, addr: &str) -> WorkerProc {
        // Ready once the model has loaded and warmed up.
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_torus-wgpu"));
        cmd.args(["worker", "--config", cfg_file.to_str().unwrap(), "--listen", addr]);
        let (child, _, _) = spawn_until_ready(&mut cmd, "worker", "ready on", Duration::from_secs(300));
        WorkerProc { child, addr: addr.to_string(), cfg_file }
    }

    fn restart(mut self) -> WorkerProc {
        self.kill();
        let (f, a) = (self.cfg_file.clone(), self.addr.clone());
        WorkerProc::spawn(f, &a)
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for WorkerProc {
    fn drop(&mut self) {
        self.kill();
    }
}

#[test]
fn worker_processes_match_single_device() {
    // tiny-qwen2 as two workers; SmolLM2 as two workers, and as three stages (two here, one
    // worker).
    let path = tiny();
    let cfg = base_cfg(&path);
    let want = single_reference(&path, &cfg, 6);
    let (a0, a1) = (free_addr(), free_addr());
    let w0 = WorkerProc::start(&cfg, (0, 1), &a0);
    let w1 = WorkerProc::start(&cfg, (1, 2), &a1);
    let mut p = build(&pipeline_cfg(&cfg, &[(0, 1, Some(&a0)), (1, 2, Some(&a1))])).unwrap();
    check_pipeline(&path, &mut p, &want, 6);
    drop((p, w0, w1));

    let path = smollm2();
    let cfg = base_cfg(&path);
    let want = single_reference(&path, &cfg, 6);
    let (a, b) = (free_addr(), free_addr());
    let _wa = WorkerProc::start(&cfg, (0, 15), &a);
    let _wb = WorkerProc::start(&cfg, (15, 30), &b);
    // Two workers; and three stages, two here and the second worker.
    let two = pipeline_cfg(&cfg, &[(0, 15, Some(&a)), (15, 30, Some(&b))]);
    let three = pipeline_cfg(&cfg, &[(0, 7, None), (7, 15, None), (15, 30, Some(&b))]);
    for pcfg in [&two, &three] {
        let mut p = build(pcfg).unwrap();
        check_pipeline(&path, &mut p, &want, 6);
    }
    // The engine with several requests in flight over the two workers, prefix cache on.
    let reqs: Vec<Request> = engine_prompts(&path).iter().map(|p| greedy_req(p, 8)).collect();
    let want = single_engine_outputs(&path, &cfg, &reqs);
    let e = EngineHandle::start(build(&two).unwrap(), load_tokenizer(&path).unwrap(), &two);
    for round in 0..2 {
        assert_eq!(run_concurrently(&e, &reqs), want, "round {round}");
    }
    assert!(e.metrics.snapshot().prefix_hits > 0);
    e.shutdown(false);
}

/// Collects a request's output on a thread, failing the test if it takes longer than `limit`.
fn collect_within(e: &EngineHandle, req: Request, limit: Duration) -> torus_wgpu::engine::Completion {
    let s = e.submit(req).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(s.collect_blocking());
    });
    rx.recv_timeout(limit).expect("the request hung")
}

#[test]
fn killed_and_restarted_workers() {
    let path = tiny();
    let cfg = base_cfg(&path);
    let (a0, a1) = (free_addr(), free_addr());
    let _w0 = WorkerProc::start(&cfg, (0, 1), &a0);
    let mut w1 = WorkerProc::start(&cfg, (1, 2), &a1);
    let pcfg = pipeline_cfg(&cfg, &[(0, 1, Some(&a0)), (1, 2, Some(&a1))]);
    let e = EngineHandle::start(build(&pcfg).unwrap(), load_tokenizer(&path).unwrap(), &pcfg);
    let prompt = prompts(&path)[1].clone();
    let want = single_engine_outputs(&path, &cfg, &[greedy_req(&prompt, 40)]).remove(0);
    let limit = Duration::from_secs(120);
    assert_eq!(collect_within(&e, greedy_req(&prompt, 40), limit).ids, want);

    // Killed mid-request: the request fails naming the stage, the stage is reported down.
    let mut s = e.submit(greedy_req(&prompt, 256 - prompt.len() - 1)).unwrap();
    for _ in 0..3 {
        assert!(matches!(s.next_blocking(), Some(torus_wgpu::engine::Event::Token { .. })));
    }
    w1.kill();
    let t0 = Instant::now();
    let reason = loop {
        match s.next_blocking() {
            Some(torus_wgpu::engine::Event::Done { reason, .. }) => break reason,
            Some(_) => assert!(t0.elapsed() < limit, "still streaming after the worker died"),
            None => panic!("stream ended without Done"),
        }
    };
    match &reason {
        FinishReason::Error(m) => assert!(m.contains("stage 1") && m.contains(&a1), "unclear error: {m}"),
        r => panic!("expected an error, got {r:?}"),
    }
    let stages = e.stages.clone().unwrap();
    assert!(stages[1].get().is_err() && stages[0].get().is_ok());
    // While it is down, requests fail at once with the same kind of error.
    let c = collect_within(&e, greedy_req(&prompt, 4), limit);
    assert!(matches!(&c.reason, FinishReason::Error(m) if m.contains("stage 1")), "{:?}", c.reason);
    assert_eq!(settled(&e).kv_blocks_used, 0);

    // Restarted: picked up again, correct output.
    w1 = w1.restart();
    assert_eq!(collect_within(&e, greedy_req(&prompt, 40), limit).ids, want);
    assert!(stages[1].get().is_ok());

    // Restarted while idle (the scheduler's view of its cache is stale): the worker refuses
    // the step, the engine recomputes, the request still succeeds.
    let _w1 = w1.restart();
    let failures = e.metrics.snapshot().stage_failures;
    let c = collect_within(&e, greedy_req(&prompt, 40), limit);
    assert_eq!(c.ids, want, "{:?}", c.reason);
    let m = settled(&e);
    assert_eq!(m.stage_failures, failures + 1, "the restart went unnoticed: {m:?}");
    assert!(m.preemptions >= 1, "the request was not recomputed: {m:?}");
    // A worker serves one scheduler at a time: the first engine releases its workers when it
    // shuts down. A worker serving other layers than the config says is refused by name.
    e.shutdown(false);
    let a2 = free_addr();
    let _wrong = WorkerProc::start(&cfg, (0, 1), &a2);
    let bad = pipeline_cfg(&cfg, &[(0, 1, Some(&a0)), (1, 2, Some(&a2))]);
    let e2 = EngineHandle::start(build(&bad).unwrap(), load_tokenizer(&path).unwrap(), &bad);
    let c = collect_within(&e2, greedy_req(&prompt, 4), limit);
    assert!(matches!(&c.reason, FinishReason::Error(m) if m.contains("serves layers 0..1")), "{:?}", c.reason);
    e2.shutdown(false);
}

/// tiny-qwen2 as a worker for layer 0 and an address with nothing behind it for layer 1.
fn tiny_with_stage_1_down() -> (PathBuf, EngineConfig, EngineConfig, WorkerProc, String) {
    let path = tiny();
    let cfg = base_cfg(&path);
    let (a0, a1) = (free_addr(), free_addr());
    let w0 = WorkerProc::start(&cfg, (0, 1), &a0);
    let pcfg = pipeline_cfg(&cfg, &[(0, 1, Some(&a0)), (1, 2, Some(&a1))]);
    (path, cfg, pcfg, w0, a1)
}

#[test]
fn a_hung_worker_times_out() {
    // A stopped (not dead) worker: the step fails after stage_timeout_s, and once the worker
    // runs again the next request succeeds.
    let path = tiny();
    let cfg = base_cfg(&path);
    let (a0, a1) = (free_addr(), free_addr());
    let _w0 = WorkerProc::start(&cfg, (0, 1), &a0);
    let w1 = WorkerProc::start(&cfg, (1, 2), &a1);
    let mut pcfg = pipeline_cfg(&cfg, &[(0, 1, Some(&a0)), (1, 2, Some(&a1))]);
    pcfg.stage_timeout_s = 2.0;
    let e = EngineHandle::start(build(&pcfg).unwrap(), load_tokenizer(&path).unwrap(), &pcfg);
    let prompt = prompts(&path)[2].clone();
    let want = single_engine_outputs(&path, &cfg, &[greedy_req(&prompt, 16)]).remove(0);
    assert_eq!(collect_within(&e, greedy_req(&prompt, 16), Duration::from_secs(60)).ids, want);
    let signal = |sig: &str| {
        let ok = Command::new("kill").args([sig, &w1.child.id().to_string()]).status().unwrap().success();
        assert!(ok, "kill {sig}");
    };
    signal("-STOP");
    let t0 = Instant::now();
    let c = collect_within(&e, greedy_req(&prompt, 16), Duration::from_secs(60));
    let waited = t0.elapsed();
    signal("-CONT");
    match &c.reason {
        FinishReason::Error(m) => assert!(m.contains("stage 1") && m.contains("timed out"), "{m}"),
        r => panic!("expected a timeout, got {r:?}"),
    }
    assert!(waited < Duration::from_secs(30), "took {waited:?}");
    assert_eq!(collect_within(&e, greedy_req(&prompt, 16), Duration::from_secs(60)).ids, want);
    e.shutdown(false);
}

#[test]
fn a_worker_down_at_start_does_not_stop_the_scheduler() {
    let (path, cfg, pcfg, _w0, a1) = tiny_with_stage_1_down();
    // Builds without reaching stage 1.
    let e = EngineHandle::start(build(&pcfg).unwrap(), load_tokenizer(&path).unwrap(), &pcfg);
    let prompt = prompts(&path)[0].clone();
    let c = collect_within(&e, greedy_req(&prompt, 4), Duration::from_secs(60));
    assert!(matches!(&c.reason, FinishReason::Error(m) if m.contains("stage 1")), "{:?}", c.reason);
    let _w1 = WorkerProc::start(&cfg, (1, 2), &a1);
    let want = single_engine_outputs(&path, &cfg, &[greedy_req(&prompt, 12)]).remove(0);
    assert_eq!(collect_within(&e, greedy_req(&prompt, 12), Duration::from_secs(60)).ids, want);
    e.shutdown(false);
}

#[test]
fn health_names_a_missing_stage() {
    let (path, cfg, pcfg, _w0, a1) = tiny_with_stage_1_down();
    let e = EngineHandle::start(build(&pcfg).unwrap(), load_tokenizer(&path).unwrap(), &pcfg);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (srv, base) = rt.block_on(async {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let srv = torus_wgpu::server::start(l, torus_wgpu::server::ServerConfig::new("tiny", &pcfg), Some(e)).unwrap();
        let base = format!("http://{}", srv.addr);
        (srv, base)
    });
    let health = |rt: &tokio::runtime::Runtime| {
        rt.block_on(async {
            let r = reqwest::get(format!("{base}/health")).await.unwrap();
            (r.status().as_u16(), r.json::<serde_json::Value>().await.unwrap())
        })
    };
    let (status, body) = health(&rt);
    assert_eq!(status, 503, "{body}");
    let msg = body["error"]["message"].as_str().unwrap();
    assert!(msg.contains("pipeline stage 1") && msg.contains(&a1), "{msg}");
    assert_eq!(body["stages"][0]["ok"], true);
    assert_eq!(body["stages"][1]["ok"], false);
    // A request while the stage is down: 503 in OpenAI's error shape, naming the stage.
    let (status, body) = rt.block_on(async {
        let r = reqwest::Client::new()
            .post(format!("{base}/v1/completions"))
            .json(&serde_json::json!({"prompt": "Hello", "max_tokens": 4}))
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json::<serde_json::Value>().await.unwrap())
    });
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["code"], "stage_unavailable");
    let metrics = rt.block_on(async { reqwest::get(format!("{base}/metrics")).await.unwrap().text().await.unwrap() });
    assert!(metrics.contains("torus_pipeline_stage_up{stage=\"1\"} 0"), "{metrics}");
    assert!(metrics.contains("torus_pipeline_stage_failures_total 1"), "{metrics}");
    assert!(body["error"]["message"].as_str().unwrap().contains(&a1), "{body}");
    let _w1 = WorkerProc::start(&cfg, (1, 2), &a1);
    let (status, body) = health(&rt);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["stages"].as_array().unwrap().len(), 2);
    rt.block_on(srv.shutdown());
}

#[test]
fn shipped_configs_parse_and_pipeline_ones_cover_the_default_model() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
    let mut pipelines = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let cfg = EngineConfig::from_file(&path).unwrap_or_else(|e| panic!("{e:#}"));
        if !cfg.stages.is_empty() {
            pipelines += 1;
            // SmolLM2-135M has 30 layers.
            let ranges =
                pipeline::stage_ranges(&cfg.stages, 30).unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
            assert_eq!(ranges.len(), cfg.world_size);
        } else if cfg.enable_pipeline_parallel {
            // A worker: its range lies inside the model.
            let r = torus_wgpu::exec::remote::worker_layers(&cfg, 30).unwrap();
            assert!(r.end <= 30 && r.start < r.end, "{}", path.display());
        }
    }
    assert!(pipelines >= 2, "the in-process and scheduler examples are missing");
    // Command-line overrides.
    use torus_wgpu::config::EngineArgs;
    let c = EngineArgs { pipeline_parallel_size: Some(3), ..Default::default() }.resolve().unwrap();
    assert!(c.enable_pipeline_parallel && c.world_size == 3);
    let c = EngineArgs {
        config: Some(dir.join("pipeline-worker1.json")),
        stage_start_layer: Some(12),
        ..Default::default()
    }
    .resolve()
    .unwrap();
    assert_eq!((c.pipeline_rank, c.stage_start_layer, c.stage_end_layer), (1, Some(12), Some(30)));
    let e = EngineArgs { stage_timeout_s: Some(0.0), ..Default::default() }.resolve().unwrap_err();
    assert!(e.to_string().contains("stage_timeout_s"), "{e}");
    let e = EngineArgs { pipeline_rank: Some(2), world_size: Some(2), ..Default::default() }.resolve().unwrap_err();
    assert!(e.to_string().contains("pipeline_rank 2 must be below world_size 2"), "{e}");
}

/// A stand-in stage: the first passes its token ids on as "hidden states", the last samples
/// the id it got plus one; token 13 makes the last stage panic.
struct FakeStage {
    last: bool,
}

impl pipeline::StageExec for FakeStage {
    fn run(
        &mut self,
        s: &StepInput,
        hidden: Option<Vec<u8>>,
        _want_logits: bool,
    ) -> anyhow::Result<(torus_wgpu::model::StageOutput, Option<Vec<f32>>)> {
        use torus_wgpu::model::StageOutput;
        use torus_wgpu::sampling::Sampled;
        if !self.last {
            return Ok((StageOutput::Hidden(bytemuck::cast_slice(&s.tokens).to_vec()), None));
        }
        let ids: Vec<u32> = bytemuck::pod_collect_to_vec(&hidden.unwrap());
        assert!(ids[0] != 13, "unlucky token");
        Ok((StageOutput::Sampled(vec![Sampled { id: ids[0] + 1, logprob: 0.0, top: vec![] }]), None))
    }
}

#[test]
fn a_panicking_stage_fails_its_step_and_the_pipeline_goes_on() {
    use torus_wgpu::exec::StageHealth;
    let stages: Vec<pipeline::Stage> = (0..2)
        .map(|i| {
            let stage: Box<dyn pipeline::StageExec> = Box::new(FakeStage { last: i == 1 });
            (stage, Arc::new(StageHealth::new(i, format!("fake {i}"), None, i..i + 1)))
        })
        .collect();
    let limits = pipeline::step_limits(&base_cfg(&tiny()), &torus_wgpu::model::loader::read_config(&tiny()).unwrap());
    let mut p = Pipeline::new(stages, limits, 16, 100).unwrap();
    let step = |t: u32| StepInput { tokens: vec![t], sample_rows: vec![0], ..Default::default() };
    assert_eq!(p.step(step(5), false).unwrap().sampled[0].id, 6);
    let e = format!("{:#}", p.step(step(13), false).err().unwrap());
    assert!(e.contains("stage 1") && e.contains("panicked") && e.contains("unlucky token"), "{e}");
    assert!(p.health[1].get().is_err());
    // Several in flight at once come back in order.
    for (id, t) in [(1, 1), (2, 13), (3, 3)] {
        p.submit(id, step(t), false);
    }
    let got: Vec<(u64, Option<u32>)> =
        (0..3).map(|_| p.recv().unwrap()).map(|r| (r.id, r.result.ok().map(|o| o.sampled[0].id))).collect();
    assert_eq!(got, vec![(1, Some(2)), (2, None), (3, Some(4))]);
    assert!(p.health[1].get().is_ok());
}

#[test]
fn serve_binary_drives_two_workers() {
    // `torus-wgpu serve --config` with a scheduler config whose stages are two workers.
    let path = tiny();
    let cfg = base_cfg(&path);
    let (a0, a1) = (free_addr(), free_addr());
    let _w0 = WorkerProc::start(&cfg, (0, 1), &a0);
    let _w1 = WorkerProc::start(&cfg, (1, 2), &a1);
    let sched = pipeline_cfg(&cfg, &[(0, 1, Some(&a0)), (1, 2, Some(&a1))]);
    let file = std::env::temp_dir().join(format!("torus-pp-sched-{}.json", std::process::id()));
    std::fs::write(&file, serde_json::to_string_pretty(&sched).unwrap()).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_torus-wgpu"));
    cmd.args(["serve", "--config", file.to_str().unwrap(), "--port", "0"]);
    let (mut child, log, _) = spawn_until_ready(&mut cmd, "serve", "ready on http://", Duration::from_secs(120));
    let addr = log.last().unwrap().split("ready on http://").nth(1).unwrap().split_whitespace().next().unwrap();
    assert!(log.iter().any(|l| l.contains(&a0) && l.contains(&a1)), "{log:?}");
    // The single-device engine's text for the same greedy request.
    let prompt = prompts(&path)[1].clone();
    let gpu = Arc::new(Gpu::new(None).unwrap());
    let (m, tok) = load_model(&path, &cfg, gpu, &|_, _| {}).unwrap();
    let single = EngineHandle::start(m, tok, &cfg);
    let want = single.submit(greedy_req(&prompt, 12)).unwrap().collect_blocking().text;
    single.shutdown(false);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let body = rt.block_on(async {
        let r = reqwest::Client::new()
            .post(format!("http://{addr}/v1/completions"))
            .json(&serde_json::json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": true}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        r.json::<serde_json::Value>().await.unwrap()
    });
    assert_eq!(body["choices"][0]["text"].as_str().unwrap(), want, "{body}");
    let _ = child.kill();
    let _ = child.wait();
}
