//! Speculative decoding with n-gram (prompt lookup) proposals: the output with speculation on
//! equals the output with it off, token for token, for greedy and seeded sampled requests,
//! with penalties, logprobs, stop strings and max_tokens ending inside an accepted run, alone
//! and in busy batches, under grammars, across preemption and over pipeline stages, on the tiny
//! model, SmolLM2 and Qwen2.5-Coder-0.5B; sampled continuations have the same distribution over
//! independent seeds (chi-square); proposals are really accepted (the counters say so); KV
//! blocks are all free afterwards and the prefix cache hits the same blocks either way. How
//! proposals are looked up and how k adapts is tested in `spec`; draft models in
//! `speculative_draft.rs`.

mod common;
use common::completions::{
    assert_all_blocks_free, assert_same, greedy, request, run_alone, run_together, shared_prefix_requests,
    stops_mid_text,
};
use common::{smollm2, tiny};

use std::path::Path;
use std::sync::Arc;
use torus_wgpu::config::{EngineConfig, SpecMethod, StageConfig};
use torus_wgpu::engine::{load_model, EngineHandle, Request, RequestParams};
use torus_wgpu::gpu::Gpu;
use torus_wgpu::sampling::SamplingParams;

fn engine(path: &Path, spec: bool, f: impl FnOnce(&mut EngineConfig)) -> EngineHandle {
    let gpu = Arc::new(Gpu::new(None).expect("a wgpu adapter (lavapipe in CI)"));
    let mut cfg = EngineConfig {
        max_num_batched_tokens: 256,
        max_sequence_length: 320,
        total_cache_size: 32 << 20,
        max_decode_batch_size: 16,
        max_prefill_batch_size: 4,
        speculative: if spec { SpecMethod::Ngram } else { SpecMethod::Off },
        num_speculative_tokens: 5,
        prompt_lookup_min: 1,
        prompt_lookup_max: 4,
        speculative_max_batch: 16,
        // The tests count proposals: no timing-dependent backing off.
        speculative_cost_gate: false,
        ..Default::default()
    };
    f(&mut cfg);
    let (model, tok) = load_model(path, &cfg, gpu, &|_, _| {}).unwrap();
    EngineHandle::start(model, tok, &cfg)
}

/// Prompts that repeat themselves (as code edits and quotes do), so lookups find matches.
fn prompts(n: usize) -> Vec<Vec<u32>> {
    (0..n)
        .map(|i| {
            let unit: Vec<u32> = (0..5 + i % 4).map(|j| (37 + 53 * i as u32 + 11 * j as u32) % 500).collect();
            let mut p: Vec<u32> = unit.iter().cycle().take(unit.len() * 3).copied().collect();
            p.extend((0..i % 3).map(|j| 400 + j as u32));
            p
        })
        .collect()
}

/// Greedy, seeded sampling (with penalties and logprobs), stop strings and max_tokens:
/// speculation on gives exactly what it gives off, alone and in one busy batch; proposals are
/// accepted; every block is free afterwards.
#[test]
fn tiny_model_speculation_on_equals_off() {
    let p = prompts(6);
    let mut reqs: Vec<Request> = p.iter().map(|p| request(p, greedy(40))).collect();
    for (i, p) in p.iter().enumerate().take(4) {
        let params = RequestParams {
            sampling: SamplingParams {
                temperature: 0.8,
                top_p: 0.95,
                seed: Some(100 + i as u64),
                ..Default::default()
            },
            repetition_penalty: if i % 2 == 0 { 1.1 } else { 1.0 },
            presence_penalty: if i == 1 { 0.3 } else { 0.0 },
            logprobs: Some(2),
            ..greedy(40)
        };
        reqs.push(request(p, params));
    }
    // max_tokens small enough to end inside an accepted run.
    reqs.push(request(&p[0], greedy(3)));
    reqs.push(request(&p[1], greedy(7)));

    let off = engine(&tiny(), false, |_| {});
    let want = run_alone(&off, &reqs);
    assert_all_blocks_free(&off);
    // Stop strings: a piece of each greedy answer's text from its middle.
    let stops = stops_mid_text(&want[..3], &reqs);
    let want_stops = run_alone(&off, &stops);

    let on = engine(&tiny(), true, |_| {});
    assert_same(&run_alone(&on, &reqs), &want, "alone");
    assert_same(&run_together(&on, &reqs), &want, "together");
    assert_same(&run_alone(&on, &stops), &want_stops, "stop strings");
    let m = on.metrics.snapshot();
    eprintln!(
        "drafts {} draft tokens {} accepted {} per position {:?}",
        m.spec_drafts,
        m.spec_draft_tokens,
        m.spec_accepted_tokens,
        &m.spec_accepted_per_pos[..5]
    );
    assert!(m.spec_drafts > 0 && m.spec_accepted_tokens > 0, "{m:?}");
    assert!(m.spec_accepted_tokens <= m.spec_draft_tokens);
    assert_eq!(m.spec_accepted_per_pos.iter().sum::<u64>(), m.spec_accepted_tokens);
    assert!(m.spec_accepted_per_pos[0] >= m.spec_accepted_per_pos[1]);
    // Fewer steps than tokens: proposals were verified several at a time.
    assert!(m.decode_tokens > m.steps, "{m:?}");
    assert_all_blocks_free(&on);
    assert_eq!(off.metrics.snapshot().spec_drafts, 0);
}

/// The prefix cache sees only accepted tokens: the same requests hit the same cached blocks
/// with speculation on and off; preemption (a cache of a few blocks) keeps the outputs.
#[test]
fn tiny_model_speculation_with_prefix_cache_and_preemption() {
    let reqs = shared_prefix_requests(&prompts(1)[0]);
    let run = |spec: bool| {
        let e = engine(&tiny(), spec, |c| c.enable_prefix_cache = true);
        let out = run_alone(&e, &reqs);
        let again = run_alone(&e, &reqs);
        assert_same(&again, &out, "a second time, from the prefix cache");
        let m = e.metrics.snapshot();
        assert_all_blocks_free(&e);
        (out, m.prefix_hits, m.prefix_hit_tokens)
    };
    let (off, hits_off, tokens_off) = run(false);
    let (on, hits_on, tokens_on) = run(true);
    assert_same(&on, &off, "prefix cache");
    assert!(hits_off > 0);
    assert_eq!((hits_on, tokens_on), (hits_off, tokens_off), "prefix-cache hits with speculation on and off");

    // 16-token blocks of the tiny model: 4 KiB each; 10 of them, where the 4 requests need 5 each.
    let small = |spec: bool| {
        engine(&tiny(), spec, |c| {
            c.total_cache_size = 10 * 4096;
            c.enable_prefix_cache = false;
        })
    };
    let (e_off, e_on) = (small(false), small(true));
    assert_eq!(e_on.info.num_blocks, 10);
    let want = run_alone(&e_off, &reqs);
    let got = run_together(&e_on, &reqs);
    assert!(e_on.metrics.snapshot().preemptions > 0, "expected preemption: {:?}", e_on.metrics.snapshot());
    assert_same(&got, &want, "preemption");
    assert_all_blocks_free(&e_on);
}

/// Two pipeline stages verify proposals like one model does.
#[test]
fn tiny_model_speculation_over_two_stages() {
    let reqs: Vec<Request> = prompts(3).iter().map(|p| request(p, greedy(24))).collect();
    let want = run_alone(&engine(&tiny(), false, |_| {}), &reqs);
    let path = tiny();
    let staged = |spec: bool| -> EngineHandle {
        let c = EngineConfig {
            model: Some(path.display().to_string()),
            enable_pipeline_parallel: true,
            world_size: 2,
            stages: vec![StageConfig::default(), StageConfig::default()],
            max_num_batched_tokens: 256,
            max_sequence_length: 320,
            total_cache_size: 32 << 20,
            speculative: if spec { SpecMethod::Ngram } else { SpecMethod::Off },
            num_speculative_tokens: 5,
            prompt_lookup_min: 1,
            speculative_max_batch: 16,
            ..Default::default()
        };
        let exec = torus_wgpu::exec::build(&c, &path, &|_, _| {}, &|_| {}).unwrap();
        let tok = torus_wgpu::tokenizer::Tokenizer::from_path(&path).unwrap();
        EngineHandle::start(exec, tok, &c)
    };
    let e = staged(true);
    assert_same(&run_together(&e, &reqs), &want, "two stages");
    assert!(e.metrics.snapshot().spec_accepted_tokens > 0);
    assert_all_blocks_free(&e);
}

/// The default model on a code edit (repeat a function with one change): greedy output with
/// speculation equals the output without, and most proposals hold.
#[test]
fn smollm2_code_edit_speculation_on_equals_off() {
    let path = smollm2();
    let tok = torus_wgpu::tokenizer::Tokenizer::from_path(&path).unwrap();
    let code =
        "def area(width, height):\n    if width < 0 or height < 0:\n        raise ValueError(\"negative\")\n    \
                return width * height\n\n";
    let text = format!(
        "<|im_start|>user\nRename `area` to `surface` in this function and repeat it:\n{code}<|im_end|>\n\
         <|im_start|>assistant\n"
    );
    let prompt = tok.encode(&text).unwrap();
    let reqs = [request(&prompt, greedy(48))];
    let want = run_alone(&engine(&path, false, |_| {}), &reqs);
    let e = engine(&path, true, |_| {});
    let got = run_alone(&e, &reqs);
    assert_same(&got, &want, "SmolLM2 code edit");
    let m = e.metrics.snapshot();
    eprintln!(
        "{:?}\nSmolLM2 code edit: {} of {} proposed tokens accepted",
        got[0].text, m.spec_accepted_tokens, m.spec_draft_tokens
    );
    assert!(m.spec_accepted_tokens > 0, "{m:?}");
    assert_all_blocks_free(&e);
}

/// Under a grammar (a JSON schema and a regex), proposals are verified with the grammar's
/// state after the proposals before them: greedy and seeded sampled outputs equal those
/// without speculation, follow the grammar, and proposals are accepted.
#[test]
fn smollm2_speculation_under_a_grammar() {
    use torus_wgpu::structured::ConstraintSpec;
    let path = smollm2();
    let tok = torus_wgpu::tokenizer::Tokenizer::from_path(&path).unwrap();
    let text = "<|im_start|>user\nCopy this JSON exactly: {\"name\": \"Ann Lee\", \"city\": \"Paris\", \
                \"tags\": [\"red\", \"blue\", \"green\"]}<|im_end|>\n<|im_start|>assistant\n";
    let prompt = tok.encode(text).unwrap();
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "city": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}}
        },
        "required": ["name", "city", "tags"],
        "additionalProperties": false
    });
    let specs = [
        ConstraintSpec::JsonSchema { schema, strict: true },
        ConstraintSpec::Regex("\\{\"name\": \"[A-Za-z ]+\", \"city\": \"[A-Za-z]+\".*".into()),
    ];
    let run = |spec: bool| {
        let e = engine(&path, spec, |_| {});
        let g = e.grammars().unwrap();
        let mut reqs = Vec::new();
        for s in &specs {
            for seed in [None, Some(5)] {
                let mut params = greedy(48);
                params.stop.ignore_eos = false;
                params.constraint = Some(g.compile(s).unwrap());
                if let Some(seed) = seed {
                    params.sampling = SamplingParams { temperature: 0.6, seed: Some(seed), ..Default::default() };
                }
                reqs.push(request(&prompt, params));
            }
        }
        let out = run_alone(&e, &reqs);
        let m = e.metrics.snapshot();
        assert_all_blocks_free(&e);
        (out, m)
    };
    let (want, _) = run(false);
    let (got, m) = run(true);
    assert_same(&got, &want, "under a grammar");
    eprintln!("{:?}\n{} of {} proposals accepted", got[0].text, m.spec_accepted_tokens, m.spec_draft_tokens);
    let v: serde_json::Value = serde_json::from_str(&got[0].text).expect("the schema's JSON");
    assert!(v["tags"].is_array(), "{v}");
    assert!(got[2].text.starts_with("{\"name\": \""), "{:?}", got[2].text);
    assert!(m.spec_accepted_tokens > 0, "{m:?}");
}

/// Qwen2.5-Coder-0.5B on a code edit: greedy output with speculation equals the output without.
#[test]
fn qwen25_coder_code_edit_speculation_on_equals_off() {
    let path = common::qwen25_coder();
    let tok = torus_wgpu::tokenizer::Tokenizer::from_path(&path).unwrap();
    let text = "<|im_start|>user\nRename `total` to `acc` and repeat the code:\n\
                def add_all(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total\n\
                <|im_end|>\n<|im_start|>assistant\n";
    let reqs = [request(&tok.encode(text).unwrap(), greedy(40))];
    let want = run_alone(&engine(&path, false, |_| {}), &reqs);
    let e = engine(&path, true, |_| {});
    assert_same(&run_alone(&e, &reqs), &want, "Qwen2.5-Coder code edit");
    let m = e.metrics.snapshot();
    eprintln!("{:?}\n{} of {} proposals accepted", want[0].text, m.spec_accepted_tokens, m.spec_draft_tokens);
    assert!(m.spec_accepted_tokens > 0, "{m:?}");
    assert_all_blocks_free(&e);
}

/// The distribution of sampled continuations is the same with speculation as without, over
/// independent seeds (the equality above is per seed): a chi-square test of the first four
/// tokens over 1200 requests each way. A logit bias keeps the choice to three tokens that
/// cycle in the prompt, so n-gram lookups propose at every position, and the model's own
/// logits weigh the three. A rule that kept proposals more often than the model samples them
/// shifts the counts far past the threshold.
#[test]
fn sampled_distribution_with_speculation_matches_without() {
    let unit = [41u32, 97, 12];
    let prompt: Vec<u32> = unit.iter().cycle().take(30).copied().collect();
    let n = 1200;
    let sample = |spec: bool, seed0: u64| -> std::collections::HashMap<Vec<u32>, usize> {
        let e = engine(&tiny(), spec, |_| {});
        let reqs: Vec<Request> = (0..n as u64)
            .map(|i| {
                let params = RequestParams {
                    sampling: SamplingParams {
                        temperature: 4.0,
                        top_k: 3,
                        seed: Some(seed0 + i),
                        ..Default::default()
                    },
                    logit_bias: unit.iter().map(|&t| (t, 30.0)).collect(),
                    ..greedy(4)
                };
                request(&prompt, params)
            })
            .collect();
        let mut counts = std::collections::HashMap::new();
        for chunk in reqs.chunks(16) {
            for c in run_together(&e, chunk) {
                assert!(c.ids.iter().all(|t| unit.contains(t)), "{:?}", c.ids);
                *counts.entry(c.ids).or_insert(0) += 1;
            }
        }
        if spec {
            let m = e.metrics.snapshot();
            eprintln!("{} of {} proposals accepted", m.spec_accepted_tokens, m.spec_draft_tokens);
            assert!(m.spec_draft_tokens >= n as u64 && m.spec_accepted_tokens > 0, "{m:?}");
        }
        counts
    };
    let off = sample(false, 0);
    let on = sample(true, 1_000_000);
    // Two-sample chi-square over outcomes seen at least 10 times in all (the rest pooled).
    let mut keys: Vec<&Vec<u32>> = off.keys().chain(on.keys()).collect();
    keys.sort();
    keys.dedup();
    let (mut stat, mut bins, mut pool) = (0.0, 0usize, (0usize, 0usize));
    let mut add = |a: usize, b: usize| {
        let (a, b) = (a as f64, b as f64);
        stat += (a - b) * (a - b) / (a + b);
        bins += 1;
    };
    for k in keys {
        let (a, b) = (off.get(k).copied().unwrap_or(0), on.get(k).copied().unwrap_or(0));
        if a + b >= 10 {
            add(a, b);
        } else {
            pool = (pool.0 + a, pool.1 + b);
        }
    }
    if pool.0 + pool.1 > 0 {
        add(pool.0, pool.1);
    }
    let df = (bins - 1) as f64;
    // The 0.999 quantile of chi-square is below df + 3.3 sqrt(2 df) + 8 for these df.
    let limit = df + 3.3 * (2.0 * df).sqrt() + 8.0;
    eprintln!("chi-square {stat:.1} over {bins} bins (limit {limit:.1})");
    assert!(bins >= 5, "too few outcomes to compare: {off:?}");
    assert!(stat < limit, "chi-square {stat:.1} >= {limit:.1}: the distributions differ");
}
