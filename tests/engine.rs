//! The serving engine: continuous batching, chunked prefill, prefix cache, preemption, abort,
//! seeded sampling and stop conditions, checked as properties (batched == alone, cache on ==
//! off) and against the fixtures.

mod common;
use common::completions::assert_all_blocks_free;
use common::{assert_greedy_matches, fixtures, floats, greedy_req, smollm2, tiny, F16_MARGIN};

use serde_json::Value;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use torus_wgpu::config::{EngineConfig, KvDtype};
use torus_wgpu::engine::{load_model, Completion, EngineHandle, FinishReason, Request, RequestParams, StopConditions};
use torus_wgpu::gpu::Gpu;
use torus_wgpu::sampling::SamplingParams;

fn engine(path: &Path, f: impl FnOnce(&mut EngineConfig)) -> EngineHandle {
    let gpu = Arc::new(Gpu::new(None).expect("a wgpu adapter"));
    let mut cfg = EngineConfig {
        max_num_batched_tokens: 256,
        max_sequence_length: 256,
        total_cache_size: 32 << 20,
        max_decode_batch_size: 16,
        max_prefill_batch_size: 4,
        ..Default::default()
    };
    f(&mut cfg);
    let (model, tok) = load_model(path, &cfg, gpu, &|_, _| {}).unwrap();
    EngineHandle::start(model, tok, &cfg)
}

fn run_alone(e: &EngineHandle, reqs: &[Request]) -> Vec<Vec<u32>> {
    reqs.iter().map(|r| e.submit(r.clone()).unwrap().collect_blocking().ids).collect()
}

fn run_together(e: &EngineHandle, reqs: &[Request]) -> Vec<Vec<u32>> {
    let streams: Vec<_> = reqs.iter().map(|r| e.submit(r.clone()).unwrap()).collect();
    streams.into_iter().map(|s| s.collect_blocking().ids).collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// Prompts of different lengths (1..60 tokens) from a fixed generator, for the tiny model.
fn tiny_prompts(n: usize) -> Vec<Vec<u32>> {
    let mut rng = torus_wgpu::sampling::Rng::new(11);
    (0..n).map(|i| (0..1 + (i * 13) % 60).map(|_| (rng.next_u64() % 500) as u32).collect()).collect()
}

#[test]
fn batching_invariance_tiny_qwen2_matches_fixtures() {
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("tiny-qwen2-reference.json")).unwrap()).unwrap();
    let fixture: Vec<(Vec<u32>, Vec<u32>, Vec<f32>)> = reference["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (ids(&p["input_ids"]), ids(&p["greedy_ids"]), floats(&p["argmax_margins"])))
        .collect();
    let mut reqs: Vec<Request> = fixture.iter().map(|(p, g, _)| greedy_req(p, g.len())).collect();
    reqs.extend(tiny_prompts(7).iter().map(|p| greedy_req(p, 20)));
    let e = engine(&tiny(), |_| {});
    let alone = run_alone(&e, &reqs);
    for ((_, want, margins), got) in fixture.iter().zip(&alone) {
        assert_greedy_matches(got, want, margins, F16_MARGIN, "alone vs fixture");
    }
    let together = run_together(&e, &reqs);
    assert_eq!(together, alone, "batched output differs from alone");
    assert_all_blocks_free(&e);
}

#[test]
fn batching_invariance_smollm2() {
    let path = smollm2();
    let e = engine(&path, |_| {});
    let tok = e.tokenizer.clone();
    let texts = [
        "The capital of France is",
        "Write a haiku about GPUs.",
        "List three prime numbers:",
        "def fibonacci(n):",
        "Once upon a time, in a land far away,",
        "The quick brown fox",
        "1, 2, 3, 4,",
        "Rust is a programming language that",
    ];
    let reqs: Vec<Request> = texts.iter().map(|t| greedy_req(&tok.encode(t).unwrap(), 12)).collect();
    let alone = run_alone(&e, &reqs);
    let together = run_together(&e, &reqs);
    assert_eq!(together, alone);
    // The plain prompt also matches the PyTorch reference's greedy tokens.
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("smollm2-reference.json")).unwrap()).unwrap();
    let want = ids(&reference["prompts"][0]["greedy"]["generated_ids"]);
    let margins = floats(&reference["prompts"][0]["greedy"]["argmax_margins"]);
    assert_greedy_matches(&alone[0], &want[..12], &margins[..12], F16_MARGIN, "smollm2 plain prompt");
    assert_all_blocks_free(&e);
}

#[test]
fn prefix_cache_on_equals_off_and_saves_prefill() {
    let system: Vec<u32> = (0..50).map(|i| (i * 7 % 500) as u32).collect();
    let reqs: Vec<Request> =
        tiny_prompts(6).iter().map(|p| greedy_req(&[system.clone(), p.clone()].concat(), 10)).collect();
    let on = engine(&tiny(), |c| c.enable_prefix_cache = true);
    let off = engine(&tiny(), |c| c.enable_prefix_cache = false);
    // Sequentially, so later requests can hit blocks the earlier ones cached.
    let a = run_alone(&on, &reqs);
    let b = run_alone(&off, &reqs);
    assert_eq!(a, b);
    let (m_on, m_off) = (on.metrics.snapshot(), off.metrics.snapshot());
    assert!(m_on.prefix_hits > 0, "{m_on:?}");
    assert_eq!(m_off.prefix_hits, 0);
    assert!(m_on.prefill_tokens < m_off.prefill_tokens, "{} vs {}", m_on.prefill_tokens, m_off.prefill_tokens);
    // Batched with the cache warm: still the same tokens.
    assert_eq!(run_together(&on, &reqs), a);
    // Usage reports the cached prompt tokens.
    let c = on.submit(reqs[0].clone()).unwrap().collect_blocking();
    assert!(c.usage.cached_tokens >= 48, "{:?}", c.usage);
    assert_all_blocks_free(&on);
    assert_all_blocks_free(&off);
}

/// `cache_salt`: requests share cached blocks only with requests of the same salt; the
/// prefix-cache counters count each admitted request's look-up exactly once.
#[test]
fn cache_salt_separates_tenants_and_counters_are_exact() {
    let e = engine(&tiny(), |c| c.enable_prefix_cache = true);
    let prompt: Vec<u32> = (0..50).map(|i| (i * 11 % 500) as u32).collect();
    let req = |salt: Option<&str>| {
        let mut r = greedy_req(&prompt, 4);
        r.params.cache_salt = salt.map(str::to_string);
        r
    };
    // 50 tokens, the last always computed: 3 full blocks of 16 are looked up per request.
    let mut want_tokens = None;
    for (i, (salt, hits)) in
        [(Some("a"), 0), (Some("b"), 0), (Some("a"), 3), (None, 0), (None, 3), (Some("b"), 3)].into_iter().enumerate()
    {
        let c = e.submit(req(salt)).unwrap().collect_blocking();
        assert_eq!(c.usage.cached_tokens, hits * 16, "request {i} ({salt:?})");
        // Same prompt, same greedy tokens, whatever the salt.
        assert_eq!(want_tokens.get_or_insert(c.ids.clone()), &c.ids);
        let t = Instant::now();
        let want_queries = 3 * (i as u64 + 1);
        while e.metrics.snapshot().prefix_queries < want_queries {
            assert!(t.elapsed() < Duration::from_secs(20), "{:?}", e.metrics.snapshot());
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let m = e.metrics.snapshot();
    assert_eq!((m.prefix_queries, m.prefix_hits), (18, 9), "{m:?}");
    assert_all_blocks_free(&e);
}

#[test]
fn preemption_when_the_pool_is_too_small() {
    // tiny-qwen2: one 16-token block of K+V over 2 layers = 2 * 2 * 16 * 32 * 2 bytes (f16) = 4 KiB.
    let e = engine(&tiny(), |c| {
        c.total_cache_size = 14 * 4096;
        c.enable_prefix_cache = false;
    });
    assert_eq!(e.info.num_blocks, 14);
    let reqs: Vec<Request> = tiny_prompts(8).iter().skip(2).map(|p| greedy_req(p, 40)).collect();
    let alone = run_alone(&e, &reqs);
    assert_eq!(e.metrics.snapshot().preemptions, 0);
    let together = run_together(&e, &reqs);
    assert!(e.metrics.snapshot().preemptions > 0, "expected preemption: {:?}", e.metrics.snapshot());
    assert_eq!(together, alone);
    assert_all_blocks_free(&e);
}

#[test]
fn chunked_prefill_equals_unchunked() {
    let prompt: Vec<u32> = (0..100).map(|i| (i * 31 % 509) as u32).collect();
    let whole = engine(&tiny(), |c| c.max_num_batched_tokens = 256);
    let chunked = engine(&tiny(), |c| c.max_num_batched_tokens = 16);
    let req = greedy_req(&prompt, 20);
    let a = run_alone(&whole, std::slice::from_ref(&req));
    let b = run_alone(&chunked, std::slice::from_ref(&req));
    assert_eq!(a, b);
    // Chunked prefill of a long prompt while other sequences decode.
    let mut reqs = vec![req];
    reqs.extend(tiny_prompts(4).iter().map(|p| greedy_req(p, 20)));
    let alone = run_alone(&chunked, &reqs);
    assert_eq!(run_together(&chunked, &reqs), alone);
    assert_all_blocks_free(&chunked);
}

#[test]
fn abort_and_dropped_streams_free_blocks() {
    // SmolLM2 (~10 tokens/s on lavapipe) is surely still generating when the streams end.
    let path = smollm2();
    let e = engine(&path, |c| c.max_sequence_length = 512);
    let prompt = vec![100u32, 200, 300, 400, 500];
    let mut s = e.submit(greedy_req(&prompt, 400)).unwrap();
    let mut n = 0;
    while n < 3 {
        if let Some(torus_wgpu::engine::Event::Token { .. }) = s.next_blocking() {
            n += 1;
        }
    }
    drop(s);
    assert_all_blocks_free(&e);
    assert_eq!(e.metrics.snapshot().requests_aborted + e.metrics.snapshot().requests_finished, 1);
    let mut s = e.submit(greedy_req(&prompt, 400)).unwrap();
    s.next_blocking();
    s.abort();
    // The published gauges may predate the second request; wait for it to be ended first.
    let t = Instant::now();
    while e.metrics.snapshot().requests_aborted + e.metrics.snapshot().requests_finished < 2 {
        assert!(t.elapsed() < Duration::from_secs(20), "{:?}", e.metrics.snapshot());
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_all_blocks_free(&e);
    let m = e.metrics.snapshot();
    assert_eq!(m.requests_aborted, 2, "{m:?}");
}

#[test]
fn seeded_sampling_is_reproducible_in_a_busy_batch() {
    let e = engine(&tiny(), |_| {});
    let prompt = tiny_prompts(5)[4].clone();
    let seeded = |seed| Request {
        prompt: prompt.clone(),
        params: RequestParams {
            sampling: SamplingParams { temperature: 0.9, top_p: 0.95, top_k: 50, min_p: 0.0, seed: Some(seed) },
            stop: StopConditions { max_tokens: Some(24), ignore_eos: true, ..Default::default() },
            ..Default::default()
        },
    };
    let alone = run_alone(&e, &[seeded(7)])[0].clone();
    let mut busy: Vec<Request> = tiny_prompts(6).iter().map(|p| greedy_req(p, 30)).collect();
    busy.insert(3, seeded(7));
    busy.push(seeded(8));
    let out = run_together(&e, &busy);
    assert_eq!(out[3], alone, "same seed, same tokens inside a busy batch");
    assert_ne!(out.last().unwrap(), &alone, "another seed gives other tokens");
}

#[test]
fn stop_strings_stop_tokens_and_max_tokens() {
    let path = smollm2();
    let e = engine(&path, |_| {});
    let prompt = e.tokenizer.encode("The capital of France is").unwrap();
    let plain = e.submit(greedy_req(&prompt, 24)).unwrap().collect_blocking();
    assert_eq!(plain.reason, FinishReason::Length);
    assert_eq!(plain.ids.len(), 24);
    assert!(plain.text.contains("answer is"), "{:?}", plain.text);
    // A stop string spanning tokens: the text before it is emitted, not the match.
    let mut r = greedy_req(&prompt, 24);
    r.params.stop.stop = vec!["swer i".into()];
    let c = e.submit(r).unwrap().collect_blocking();
    assert_eq!(c.reason, FinishReason::Stop);
    let cut = plain.text.find("swer i").unwrap();
    assert_eq!(c.text, plain.text[..cut]);
    // A stop token id: generation ends at its first occurrence, which is not emitted.
    let mut r = greedy_req(&prompt, 24);
    let stop_id = plain.ids[3];
    let first = plain.ids.iter().position(|&t| t == stop_id).unwrap();
    r.params.stop.stop_token_ids = vec![stop_id];
    let c = e.submit(r).unwrap().collect_blocking();
    assert_eq!(c.reason, FinishReason::Stop);
    assert_eq!(c.ids, plain.ids[..first]);
    assert_eq!(c.usage.completion_tokens, first + 1);
    // EOS ends the request unless ignored.
    let mut r = greedy_req(&prompt, 48);
    r.params.stop.ignore_eos = false;
    let c = e.submit(r).unwrap().collect_blocking();
    assert_eq!(c.reason, FinishReason::Stop);
    // The reference's first eos is at index 29: 29 tokens are streamed, 30 generated.
    assert_eq!(c.ids.len(), 29);
    assert_eq!(c.usage.completion_tokens, 30);
    assert_eq!(c.text.trim_end(), " Paris.\n\nThe answer is: 2018-01-22 12:12:53.");
    assert_all_blocks_free(&e);
}

#[test]
fn logit_bias_penalties_and_logprobs() {
    let e = engine(&tiny(), |_| {});
    let prompt = tiny_prompts(4)[3].clone();
    let mut r = greedy_req(&prompt, 8);
    r.params.logit_bias = vec![(77, 100.0)];
    let c = e.submit(r).unwrap().collect_blocking();
    assert_eq!(c.ids, vec![77; 8]);
    // A strong frequency penalty forbids repeating a token that the bias would otherwise pick.
    let mut r = greedy_req(&prompt, 8);
    r.params.logit_bias = vec![(77, 20.0)];
    r.params.frequency_penalty = 2.0 * 1000.0;
    let c = e.submit(r).unwrap().collect_blocking();
    assert_eq!(c.ids[0], 77);
    assert_eq!(c.ids.iter().filter(|&&t| t == 77).count(), 1, "{:?}", c.ids);
    // Top logprobs: n alternatives, sorted, the greedy choice first.
    let mut r = greedy_req(&prompt, 4);
    r.params.logprobs = Some(5);
    let mut s = e.submit(r).unwrap();
    while let Some(ev) = s.next_blocking() {
        if let torus_wgpu::engine::Event::Token { id, logprob, top, .. } = ev {
            assert_eq!(top.len(), 5);
            assert_eq!(top[0].0, id);
            assert!((top[0].1 - logprob).abs() < 1e-6);
            assert!(top.windows(2).all(|w| w[0].1 >= w[1].1));
        } else {
            break;
        }
    }
}

#[test]
fn too_long_requests_are_rejected_before_taking_blocks() {
    let e = engine(&tiny(), |c| c.max_sequence_length = 64);
    let long: Vec<u32> = vec![5; 64];
    assert!(e.submit(greedy_req(&long, 1)).unwrap_err().contains("max_sequence_length"));
    let err = e.submit(greedy_req(&long[..40], 30)).unwrap_err();
    assert!(err.contains("max_tokens"), "{err}");
    assert!(e.submit(greedy_req(&[], 3)).is_err());
    assert!(e.submit(greedy_req(&[600], 3)).unwrap_err().contains("vocabulary"));
    assert_eq!(e.metrics.snapshot().kv_blocks_used, 0);
    // The engine still serves a good request.
    assert_eq!(e.submit(greedy_req(&[1, 2, 3], 3)).unwrap().collect_blocking().ids.len(), 3);
}

/// Mistral's sliding window through the engine: blocks that left the window are freed as the
/// sequences advance, so a cache far too small for the whole sequences serves several at once
/// (chunked prefill, continuous batching), with the reference's greedy tokens.
#[test]
fn sliding_window_frees_blocks_and_matches_reference() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tiny-mistral-reference.json")).unwrap()).unwrap();
    assert_eq!(reference["config"]["sliding_window"].as_u64(), Some(8));
    let prompts: Vec<(Vec<u32>, Vec<u32>)> = reference["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (ids(&p["input_ids"]), ids(&p["greedy_ids"])))
        .collect();
    // Blocks of 4 tokens, 8-token steps: a sequence holds at most (8 + 8) / 4 + 1 = 5 blocks.
    // 12 blocks (2 KiB each in f32: 4 tokens x 32 values x 4 bytes x K,V x 2 layers) hold
    // 48 tokens; the longest prompt alone needs 110.
    let e = engine(&dir.join("tiny-mistral"), |c| {
        c.block_size = 4;
        c.max_num_batched_tokens = 8;
        c.kv_cache_dtype = torus_wgpu::config::KvDtype::F32;
        c.total_cache_size = 12 * 2048;
        c.enable_prefix_cache = false;
    });
    assert_eq!(e.info.num_blocks, 12);
    let longest = prompts.iter().map(|(p, g)| p.len() + g.len()).max().unwrap();
    assert!(longest.div_ceil(4) > 12, "the window must be what makes the requests fit");
    let reqs: Vec<Request> = prompts.iter().map(|(p, g)| greedy_req(p, g.len())).collect();
    let want: Vec<Vec<u32>> = prompts.iter().map(|(_, g)| g.clone()).collect();
    assert_eq!(run_alone(&e, &reqs), want, "alone");
    assert_eq!(run_together(&e, &reqs), want, "together");
    assert_all_blocks_free(&e);
}

fn log_softmax(row: &[f32]) -> Vec<f64> {
    let m = row.iter().fold(f32::MIN, |a, &b| a.max(b)) as f64;
    let lse = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
    row.iter().map(|&x| x as f64 - lse).collect()
}

/// Prompt logprobs (what `echo` with `logprobs` returns on /v1/completions): each fixture prompt
/// is extended by its first 4 reference greedy tokens, so the prompt logprobs at positions
/// n-1..n+2 are the reference's decode steps 0..3. They match the reference (the token's logprob
/// at n-1 against the log-softmax of the full reference logits; at each step the top-5 ids and
/// their logprob differences against the reference top-5 logits), every prompt token but the
/// first gets one, in order, and the numbers do not depend on how the prompt is scheduled:
/// alone, chunked into 5-token pieces with at most 3 sample rows per step, after the same
/// prompt filled the prefix cache, or in a batch with other requests (whose tokens stay those
/// they get alone). The generated tokens are those of a plain request.
#[test]
fn prompt_logprobs_match_reference_and_scheduling() {
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("tiny-qwen2-reference.json")).unwrap()).unwrap();
    // An f32 KV cache, as the reference computes; 4-token blocks, so that the short prompts
    // fill prefix-cache blocks.
    let big = engine(&tiny(), |c| {
        c.kv_cache_dtype = KvDtype::F32;
        c.block_size = 4;
    });
    let small = engine(&tiny(), |c| {
        c.kv_cache_dtype = KvDtype::F32;
        c.max_num_batched_tokens = 5;
        c.max_decode_batch_size = 2;
        c.max_prefill_batch_size = 1;
    });
    let others: Vec<Request> = tiny_prompts(5).iter().map(|p| greedy_req(p, 12)).collect();
    let others_alone = run_alone(&big, &others);
    for p in reference["prompts"].as_array().unwrap() {
        let name = p["name"].as_str().unwrap();
        let (input, greedy) = (ids(&p["input_ids"]), ids(&p["greedy_ids"]));
        let n = input.len();
        let prompt: Vec<u32> = input.iter().chain(&greedy[..4]).copied().collect();
        let mut req = greedy_req(&prompt, 3);
        req.params.prompt_logprobs = Some(5);
        let plain = big.submit(greedy_req(&prompt, 3)).unwrap().collect_blocking();

        let alone = big.submit(req.clone()).unwrap().collect_blocking();
        let lps = &alone.prompt_logprobs;
        assert_eq!(lps.iter().map(|l| l.id).collect::<Vec<_>>(), prompt[1..], "{name}");
        assert_eq!(alone.ids, plain.ids, "{name}: generated tokens");
        // Against the reference.
        let full: Vec<f32> =
            p["last_position_logits_full"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
        let want = log_softmax(&full)[greedy[0] as usize];
        // lps[k] is prompt token k + 1, predicted at position k.
        let got = lps[n - 1].logprob as f64;
        assert!((got - want).abs() < 1e-3, "{name}: logprob of the first greedy token {got} vs {want}");
        for (s, step) in p["first_decode_steps_top5"].as_array().unwrap().iter().enumerate() {
            let (rids, rlog) = (ids(&step["top5_ids"]), step["top5_logits"].as_array().unwrap());
            let top = &lps[n - 1 + s].top;
            assert_eq!(top.len(), 5);
            for j in 0..5 {
                let want = rlog[j].as_f64().unwrap() - rlog[0].as_f64().unwrap();
                let got = (top[j].1 - top[0].1) as f64;
                // (Each logit within ~1e-3 of the reference: a difference of two within 2e-3.)
                assert!((got - want).abs() < 2e-3, "{name} step {s} top {j}: {got} vs {want}");
                // Ids only where the reference order is clear.
                let gap = |a: usize, b: usize| (rlog[a].as_f64().unwrap() - rlog[b].as_f64().unwrap()).abs();
                let clear = (j == 0 || gap(j - 1, j) > 1e-3) && (j == 4 || gap(j, j + 1) > 1e-3);
                if clear {
                    assert_eq!(top[j].0, rids[j], "{name} step {s} top {j}");
                }
            }
        }

        let same = |what: &str, c: &Completion| {
            assert_eq!(c.ids, alone.ids, "{name} {what}: tokens");
            assert_eq!(c.prompt_logprobs.len(), lps.len(), "{name} {what}");
            for (a, b) in c.prompt_logprobs.iter().zip(lps) {
                assert_eq!(
                    (a.id, a.top.iter().map(|t| t.0).collect::<Vec<_>>()),
                    (b.id, b.top.iter().map(|t| t.0).collect()),
                    "{name} {what}"
                );
                assert!((a.logprob - b.logprob).abs() < 1e-4, "{name} {what}: {} vs {}", a.logprob, b.logprob);
            }
        };
        same("chunked", &small.submit(req.clone()).unwrap().collect_blocking());
        // The prompt's blocks are now cached (a plain request reuses them): still all.
        let again = big.submit(greedy_req(&prompt, 1)).unwrap().collect_blocking();
        assert!(again.usage.cached_tokens >= 8, "{name}: {:?}", again.usage);
        let cached = big.submit(req.clone()).unwrap().collect_blocking();
        same("after caching", &cached);
        let streams: Vec<_> =
            others.iter().chain(std::iter::once(&req)).map(|r| big.submit(r.clone()).unwrap()).collect();
        let mut outs: Vec<_> = streams.into_iter().map(|s| s.collect_blocking()).collect();
        same("batched", &outs.pop().unwrap());
        assert_eq!(outs.into_iter().map(|c| c.ids).collect::<Vec<_>>(), others_alone, "{name}: neighbours changed");
    }
    assert_all_blocks_free(&big);
    assert_all_blocks_free(&small);
}
