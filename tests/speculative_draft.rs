//! Speculative decoding with a draft model: outputs equal those without speculation (greedy
//! and seeded sampling, alone and batched, with max_tokens, stop strings, the prefix cache and
//! preemption); the model drafting for itself has every proposal accepted, a random model of
//! the same shape almost none, with the same text either way; a draft with another
//! vocabulary, a missing file and a pipeline are refused at load with the reason.

mod common;
use common::completions::{
    assert_all_blocks_free, assert_same, greedy, request, run_alone, run_together, shared_prefix_requests,
    stops_mid_text,
};
use common::{smollm2, tiny};

use std::path::{Path, PathBuf};
use std::sync::Arc;
use torus_wgpu::config::{EngineConfig, SpecMethod, StageConfig};
use torus_wgpu::engine::{load_draft, load_model, EngineHandle, Request, RequestParams};
use torus_wgpu::exec::Executor;
use torus_wgpu::gpu::Gpu;
use torus_wgpu::sampling::SamplingParams;

fn config(draft: Option<&Path>, f: impl FnOnce(&mut EngineConfig)) -> EngineConfig {
    let mut cfg = EngineConfig {
        max_num_batched_tokens: 256,
        max_sequence_length: 320,
        total_cache_size: 32 << 20,
        max_decode_batch_size: 16,
        max_prefill_batch_size: 4,
        draft_model: draft.map(|d| d.display().to_string()),
        num_speculative_tokens: 5,
        speculative_max_batch: 16,
        // The tests count proposals: no timing-dependent backing off.
        speculative_cost_gate: false,
        ..Default::default()
    };
    f(&mut cfg);
    cfg
}

fn try_engine(path: &Path, cfg: &EngineConfig) -> anyhow::Result<EngineHandle> {
    let gpu = Arc::new(Gpu::new(None).expect("a wgpu adapter (lavapipe in CI)"));
    let (model, tok) = load_model(path, cfg, gpu, &|_, _| {})?;
    let exec: Box<dyn Executor> = model.into();
    let draft = load_draft(cfg, &*exec, &tok)?;
    EngineHandle::try_start_with_draft(exec, draft, tok, cfg)
}

fn engine(path: &Path, draft: Option<&Path>, f: impl FnOnce(&mut EngineConfig)) -> EngineHandle {
    try_engine(path, &config(draft, f)).unwrap()
}

fn prompts(n: usize) -> Vec<Vec<u32>> {
    (0..n).map(|i| (0..12 + 5 * i as u32).map(|j| (29 + 71 * i as u32 + 13 * j) % 500).collect()).collect()
}

/// A copy of the tiny model with every weight replaced by a deterministic pseudo-random value
/// (same shapes, same tokenizer): a draft whose guesses are unrelated to the model's.
fn random_tiny(tag: &str) -> PathBuf {
    let src = tiny();
    let dir = std::env::temp_dir().join(format!("torus-draft-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut out = bytes.clone();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for (name, t) in header.as_object().unwrap() {
        if name == "__metadata__" {
            continue;
        }
        assert_eq!(t["dtype"], "F32", "{name}");
        let (a, b) = (t["data_offsets"][0].as_u64().unwrap() as usize, t["data_offsets"][1].as_u64().unwrap() as usize);
        let norm = name.contains("norm");
        for at in (8 + n + a..8 + n + b).step_by(4) {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let u = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            let v = if norm { 1.0 + 0.2 * u } else { 0.4 * u };
            out[at..at + 4].copy_from_slice(&v.to_le_bytes());
        }
    }
    assert_ne!(out, bytes);
    std::fs::write(dir.join("model.safetensors"), out).unwrap();
    dir
}

/// The tiny model drafting for itself, and a random draft: greedy and seeded sampled requests
/// (penalties, logprobs), max_tokens and stop strings inside proposals, alone and batched,
/// give exactly the output without speculation. The self-draft's greedy proposals are all
/// accepted; the random draft's rarely.
#[test]
fn tiny_model_with_a_draft_model_equals_without() {
    let p = prompts(5);
    let mut reqs: Vec<Request> = p.iter().map(|p| request(p, greedy(40))).collect();
    reqs.push(request(&p[0], greedy(3)));
    reqs.push(request(&p[1], greedy(8)));
    let sampled: Vec<Request> = p
        .iter()
        .take(3)
        .enumerate()
        .map(|(i, p)| {
            let params = RequestParams {
                sampling: SamplingParams {
                    temperature: 0.7,
                    top_p: 0.9,
                    seed: Some(7 + i as u64),
                    ..Default::default()
                },
                repetition_penalty: if i == 0 { 1.2 } else { 1.0 },
                logprobs: Some(2),
                ..greedy(30)
            };
            request(p, params)
        })
        .collect();
    let off = engine(&tiny(), None, |_| {});
    let want = run_alone(&off, &reqs);
    let want_sampled = run_alone(&off, &sampled);
    let stops = stops_mid_text(&want[..3], &reqs);
    let want_stops = run_alone(&off, &stops);

    // The model drafting for itself: greedy proposals are the model's own greedy tokens.
    let own = engine(&tiny(), Some(&tiny()), |_| {});
    assert_same(&run_alone(&own, &reqs), &want, "self-draft, alone");
    let m = own.metrics.snapshot();
    assert!(m.spec_draft_tokens > 0, "{m:?}");
    assert_eq!(m.spec_accepted_tokens, m.spec_draft_tokens, "the self-draft's greedy proposals all hold: {m:?}");
    assert_same(&run_together(&own, &reqs), &want, "self-draft, together");
    assert_same(&run_alone(&own, &sampled), &want_sampled, "self-draft, seeded sampling");
    assert_same(&run_together(&own, &stops), &want_stops, "self-draft, stop strings");
    assert!(own.metrics.snapshot().decode_tokens > own.metrics.snapshot().steps);
    assert_all_blocks_free(&own);

    // A random draft: the same text, few proposals accepted.
    let random = random_tiny("random");
    let rnd = engine(&tiny(), Some(&random), |_| {});
    assert_same(&run_together(&rnd, &reqs), &want, "random draft");
    assert_same(&run_alone(&rnd, &sampled), &want_sampled, "random draft, seeded sampling");
    let m = rnd.metrics.snapshot();
    eprintln!("random draft: {} of {} proposals accepted", m.spec_accepted_tokens, m.spec_draft_tokens);
    assert!(m.spec_draft_tokens > 0);
    assert!(m.spec_accepted_tokens * 5 < m.spec_draft_tokens, "a random draft is rarely right: {m:?}");
    assert_all_blocks_free(&rnd);
    let _ = std::fs::remove_dir_all(random);
}

/// The draft's cache follows the model's blocks: with the prefix cache (the same hits as
/// without speculation) and under preemption (a cache of a few blocks) outputs are unchanged.
#[test]
fn draft_model_with_prefix_cache_and_preemption() {
    let reqs = shared_prefix_requests(&prompts(1)[0]);
    let run = |draft: Option<&Path>| {
        let e = engine(&tiny(), draft, |c| c.enable_prefix_cache = true);
        let out = run_alone(&e, &reqs);
        assert_same(&run_together(&e, &reqs), &out, "again, together, from the prefix cache");
        let m = e.metrics.snapshot();
        assert_all_blocks_free(&e);
        (out, m.prefix_hits)
    };
    let (off, hits_off) = run(None);
    let (on, hits_on) = run(Some(&tiny()));
    assert_same(&on, &off, "prefix cache");
    assert!(hits_off > 0);
    assert_eq!(hits_on, hits_off);

    let small = |draft: Option<&Path>| {
        engine(&tiny(), draft, |c| {
            c.total_cache_size = 10 * 4096;
            c.enable_prefix_cache = false;
        })
    };
    let want = run_alone(&small(None), &reqs);
    let e = small(Some(&tiny()));
    let got = run_together(&e, &reqs);
    let m = e.metrics.snapshot();
    assert!(m.preemptions > 0 && m.spec_accepted_tokens > 0, "{m:?}");
    assert_same(&got, &want, "preemption");
    assert_all_blocks_free(&e);
}

/// Refused at load, with the draft's path and the reason.
#[test]
fn bad_draft_models_are_refused_at_load() {
    let err = |cfg: &EngineConfig| try_engine(&tiny(), cfg).err().map(|e| format!("{e:#}")).expect("refused");
    // Another tokenizer (SmolLM2's 49152 tokens for the tiny model's 512).
    let e = err(&config(Some(&smollm2()), |_| {}));
    assert!(e.contains("draft model") && e.contains("vocabulary") && e.contains("SmolLM2"), "{e}");
    let e = err(&config(Some(Path::new("/nonexistent/draft.gguf")), |_| {}));
    assert!(e.contains("/nonexistent/draft.gguf") && e.contains("not found"), "{e}");
    // A pipeline of stages has no single device for the draft.
    let path = tiny();
    let c = config(Some(&path), |c| {
        c.model = Some(path.display().to_string());
        c.enable_pipeline_parallel = true;
        c.world_size = 2;
        c.stages = vec![StageConfig::default(), StageConfig::default()];
    });
    let exec = torus_wgpu::exec::build(&c, &path, &|_, _| {}, &|_| {}).unwrap();
    let tok = torus_wgpu::tokenizer::Tokenizer::from_path(&path).unwrap();
    let e = load_draft(&c, &exec, &tok).err().map(|e| format!("{e:#}")).expect("refused");
    assert!(e.contains("pipeline"), "{e}");
    // The method without a model, and an engine started without loading it.
    let c = config(None, |c| c.speculative = SpecMethod::Draft);
    assert!(c.validate().unwrap_err().to_string().contains("draft_model"));
    let c = config(Some(&path), |_| {});
    let gpu = Arc::new(Gpu::new(None).unwrap());
    let (model, tok) = load_model(&path, &c, gpu, &|_, _| {}).unwrap();
    let e = EngineHandle::try_start_with_draft(model, None, tok, &c).err().expect("refused");
    assert!(e.to_string().contains("draft model is not loaded"), "{e}");
}

/// The default model drafting for itself on a code edit: the same greedy text, every proposal
/// accepted.
#[test]
fn smollm2_self_draft_code_edit() {
    let path = smollm2();
    let tok = torus_wgpu::tokenizer::Tokenizer::from_path(&path).unwrap();
    let text = "<|im_start|>user\nRepeat this function with `area` renamed to `surface`:\n\
                def area(width, height):\n    return width * height\n<|im_end|>\n<|im_start|>assistant\n";
    let reqs = [request(&tok.encode(text).unwrap(), greedy(32))];
    let want = run_alone(&engine(&path, None, |_| {}), &reqs);
    let e = engine(&path, Some(&path), |_| {});
    assert_same(&run_alone(&e, &reqs), &want, "SmolLM2 self-draft");
    let m = e.metrics.snapshot();
    assert!(m.spec_draft_tokens > 0 && m.spec_accepted_tokens == m.spec_draft_tokens, "{m:?}");
    assert!(m.steps < 20, "32 tokens in fewer steps: {m:?}");
    assert_all_blocks_free(&e);
}
