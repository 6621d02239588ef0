//! Qwen3.5's MTP (NextN) head: the tiny model of scripts/fixtures/gen_tiny_qwen35.py with a random
//! head (`tiny-qwen35-mtp`, a Hugging Face directory and a llama.cpp-layout GGUF with the head as
//! its last block). The head against its reference (transformers' decoder layer fed the model's
//! final-normed hidden states and the next tokens): full logits where the prompt ends, every
//! teacher-forced proposal after it; and `--speculative mtp` in the engine: output equal to plain
//! decoding (greedy, seeded sampling, alone and batched), and exactly the proposals the reference
//! says are kept.

use crate::common::tiny::{self, local, max_diff, reference};
use crate::common::{floats, ids};
use serde_json::Value;
use std::sync::Arc;
use torus_wgpu::config::{KernelProfile, SpecMethod};
use torus_wgpu::engine::{load_draft, load_model, EngineHandle, Request, RequestParams};
use torus_wgpu::gpu::Gpu;
use torus_wgpu::model::blocks::mtp::{load_mtp, norm_rows};
use torus_wgpu::model::{Model, StepInput};
use torus_wgpu::sampling::{SampleParams, SamplingParams};

fn step(tokens: &[u32], start: usize, table: &[u32], sample_all: bool) -> StepInput {
    let n = tokens.len();
    let pos: Vec<u32> = (start as u32..(start + n) as u32).collect();
    let rows: Vec<u32> = if sample_all { (0..n as u32).collect() } else { vec![n as u32 - 1] };
    StepInput {
        tokens: tokens.to_vec(),
        positions: pos.clone(),
        slots: pos,
        seq_of_token: vec![0; n],
        block_tables: vec![table.to_vec()],
        sampling: vec![SampleParams::default(); rows.len()],
        sample_rows: rows,
        state_slots: Vec::new(),
    }
}

fn bytes(rows: &[f32]) -> Vec<u8> {
    bytemuck::cast_slice(rows).to_vec()
}

/// The model's hidden states over a prompt and its continuation, normed by its final norm, then
/// the head over them: the full logits where the prompt ends within 1e-3 of the reference, and
/// every later teacher-forced proposal (where the reference's margin allows), from the HF
/// directory and the GGUF in both kernel profiles.
#[test]
fn qwen35_mtp_head_matches_the_reference() {
    for f in ["tiny-qwen35", "tiny-qwen35.gguf", "tiny-qwen3.gguf"] {
        let e = load_mtp(&local(f)).err().map(|e| format!("{e:#}")).unwrap_or_default();
        assert!(e.contains("no MTP (NextN) head") && e.contains(f), "{f}: {e}");
    }
    for f in ["tiny-qwen35-mtp", "tiny-qwen35-mtp.gguf", "tiny-qwen35moe-mtp", "tiny-qwen35moe-mtp.gguf"] {
        let r = reference(&format!("{}-reference.json", f.trim_end_matches(".gguf")));
        let head = load_mtp(&local(f)).unwrap_or_else(|e| panic!("{f}: {e:#}"));
        for profile in [KernelProfile::Cpu, KernelProfile::Gpu] {
            let gpu = Arc::new(Gpu::new(None).expect("a wgpu adapter"));
            let c = tiny::cfg(profile);
            let (mut model, _) = load_model(&local(f), &c, gpu.clone(), &|_, _| {}).unwrap();
            assert!(model.emit_hidden(true));
            let limits = torus_wgpu::exec::step_limits(&c, &head.model.cfg);
            let mut mtp = Model::new_mtp(gpu, &head, limits, None).unwrap();
            let eps = head.model.cfg.rms_eps;
            let mut checked = 0;
            for p in r["prompts"].as_array().unwrap().iter().chain([&r["biased"]]) {
                let what = format!("{f} {profile:?} {}", p["name"].as_str().unwrap());
                let seq = ids(&p["sequence"]);
                let (n, m) = (seq.len(), ids(&p["input_ids"]).len());
                let table: Vec<u32> = (0..n.div_ceil(model.limits.block_size) as u32).collect();
                let out = model.step(&step(&seq, 0, &table, false)).unwrap();
                assert_eq!(out.len(), 1);
                let mut rows = model.take_hidden();
                assert_eq!(rows.len(), n * 64, "{what}: a hidden state per token");
                norm_rows(&mut rows, &head.target_norm, eps);
                // Positions 0..m: the prompt's and the first generated token's.
                let h = 64;
                let a = mtp.run(&step(&seq[1..=m], 0, &table, false), Some(&bytes(&rows[..m * h]))).unwrap();
                let got = mtp.last_logits(1).unwrap();
                let d = max_diff(&got, &floats(&p["mtp_logits_at_prompt_end"]));
                assert!(d < 1e-3, "{what}: the head's logits where the prompt ends differ by {d}");
                let argmax = ids(&p["mtp_argmax"]);
                let margin = floats(&p["mtp_margin"]);
                let ids_of = |o: torus_wgpu::model::StageOutput| match o {
                    torus_wgpu::model::StageOutput::Sampled(s) => s.into_iter().map(|x| x.id).collect::<Vec<_>>(),
                    _ => panic!("the head samples"),
                };
                assert_eq!(ids_of(a), [argmax[m - 1]], "{what}");
                // The rest in steps of 8, every position sampled.
                for a in (m..n - 1).step_by(8) {
                    let b = (a + 8).min(n - 1);
                    let out = mtp.run(&step(&seq[a + 1..=b], a, &table, true), Some(&bytes(&rows[a * h..b * h])));
                    for (i, id) in ids_of(out.unwrap()).into_iter().enumerate() {
                        if margin[a + i] > 1e-2 {
                            assert_eq!(id, argmax[a + i], "{what}: the proposal at position {}", a + i);
                            checked += 1;
                        }
                    }
                }
            }
            assert!(checked > 60, "{f} {profile:?}: {checked} proposals checked");
        }
    }
}

/// An engine with `--speculative mtp` (or plain decoding) on the tiny model with its head.
fn engine(file: &str, spec: bool, k: usize) -> EngineHandle {
    engine_with(file, spec, k, false)
}

fn engine_with(file: &str, spec: bool, k: usize, prefix_cache: bool) -> EngineHandle {
    let gpu = Arc::new(Gpu::new(None).expect("a wgpu adapter"));
    let mut c = tiny::cfg(KernelProfile::Cpu);
    c.kv_cache_dtype = torus_wgpu::config::KvDtype::F32;
    c.max_decode_batch_size = 16;
    c.enable_prefix_cache = prefix_cache;
    c.model = Some(local(file).display().to_string());
    c.speculative = if spec { SpecMethod::Mtp } else { SpecMethod::Off };
    c.num_speculative_tokens = k;
    c.speculative_max_batch = 16;
    c.speculative_cost_gate = false;
    let (model, tok) = load_model(&local(file), &c, gpu, &|_, _| {}).unwrap();
    let exec: Box<dyn torus_wgpu::exec::Executor> = model.into();
    let draft = load_draft(&c, &*exec, &tok).unwrap_or_else(|e| panic!("{file}: {e:#}"));
    assert_eq!(draft.is_some(), spec);
    EngineHandle::try_start_with_draft(exec, draft, tok, &c).unwrap()
}

fn biased(r: &Value) -> Request {
    let b = &r["biased"];
    let bias = b["bias"].as_object().unwrap().iter().map(|(t, v)| (t.parse().unwrap(), v.as_f64().unwrap() as f32));
    crate::common::completions::request(
        &ids(&b["input_ids"]),
        RequestParams { logit_bias: bias.collect(), ..crate::common::completions::greedy(ids(&b["greedy_ids"]).len()) },
    )
}

/// One proposal per step as the reference's teacher-forced proposals say (proposals, kept): from
/// the prompt's end, a step whose last token is at position q proposes the head's argmax at
/// q - 1 (unless it would pass max_tokens); kept, it is the token at q + 1 and the step samples
/// q + 2; rejected, the step samples q + 1 (and the next step, which computes q again from the
/// hybrid's state before this one, proposes after q + 1).
fn expected_proposals(p: &Value) -> (u64, u64) {
    let (seq, argmax) = (ids(&p["sequence"]), ids(&p["mtp_argmax"]));
    let m = ids(&p["input_ids"]).len();
    let end = seq.len() - 1;
    let (mut q, mut proposed, mut kept) = (m, 0, 0);
    while q < end {
        if q + 1 < end {
            proposed += 1;
            let hit = argmax[q - 1] == seq[q + 1];
            kept += hit as u64;
            q += if hit { 2 } else { 1 };
        } else {
            q += 1;
        }
    }
    (proposed, kept)
}

/// The engine's debug lines `mtp proposals` (each speculating sequence's first proposal and the
/// position of its last token), captured as JSON.
#[derive(Clone, Default)]
struct Lines(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Lines {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Lines {
    fn capture() -> Lines {
        let buf = Lines::default();
        let w = buf.clone();
        let sub = tracing_subscriber::fmt()
            .json()
            .flatten_event(true)
            .with_env_filter(tracing_subscriber::EnvFilter::new("torus_wgpu::engine::mtp=debug"))
            .with_writer(move || w.clone())
            .finish();
        tracing::subscriber::set_global_default(sub).unwrap();
        buf
    }

    /// (sequence, position of its last token, first proposal) of every line since the last take.
    fn take(&self) -> Vec<(u64, usize, u32)> {
        let text = String::from_utf8(std::mem::take(&mut *self.0.lock().unwrap())).unwrap();
        text.lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter(|v| v["message"] == "mtp proposals")
            .map(|v| {
                (v["seq"].as_u64().unwrap(), v["last"].as_u64().unwrap() as usize, v["first"].as_u64().unwrap() as u32)
            })
            .collect()
    }
}

/// `--speculative mtp`: greedy and seeded output equal to plain decoding, alone and batched,
/// HF and GGUF; with one proposal per step, every proposal is the reference's teacher-forced one
/// at the position before the sequence's last token (the head read the right hidden states after
/// prefill, after kept and after rejected proposals) and exactly the proposals the reference
/// keeps are kept; every block back afterwards.
#[test]
fn qwen35_mtp_speculation_on_equals_off() {
    let lines = Lines::capture();
    for (file, reference_file) in [
        ("tiny-qwen35-mtp", "tiny-qwen35-mtp-reference.json"),
        ("tiny-qwen35-mtp.gguf", "tiny-qwen35-mtp-reference.json"),
        ("tiny-qwen35moe-mtp.gguf", "tiny-qwen35moe-mtp-reference.json"),
    ] {
        speculation_on_equals_off(&lines, file, &reference(reference_file));
    }
}

fn speculation_on_equals_off(lines: &Lines, file: &str, r: &Value) {
    use crate::common::completions::{assert_all_blocks_free, assert_same, greedy, request, run_alone, run_together};
    let mut reqs: Vec<Request> = r["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| request(&ids(&p["input_ids"]), greedy(ids(&p["greedy_ids"]).len())))
        .collect();
    reqs.push(biased(r));
    for (i, p) in r["prompts"].as_array().unwrap().iter().enumerate().take(2) {
        let sampling = SamplingParams { temperature: 0.8, seed: Some(3 + i as u64), ..Default::default() };
        reqs.push(request(&ids(&p["input_ids"]), RequestParams { sampling, ..greedy(20) }));
    }
    {
        let want = run_alone(&engine(file, false, 2), &reqs);
        // The references' greedy continuations, the biased one included.
        for (i, p) in r["prompts"].as_array().unwrap().iter().chain([&r["biased"]]).enumerate() {
            assert_eq!(want[i].ids, ids(&p["greedy_ids"]), "{file}: greedy {i}");
        }
        // One proposal per step: each prompt alone, every proposal checked, the kept ones counted.
        lines.take();
        let one = engine(file, true, 1);
        let got = run_alone(&one, &reqs[..4]);
        assert_same(&got, &want[..4], &format!("{file}: k = 1"));
        let mut logged = lines.take();
        eprintln!("LOGGED {:?}", logged.iter().map(|l| (l.0, l.1)).collect::<Vec<_>>());
        logged.sort_by_key(|l| l.0);
        let refs: Vec<&Value> = r["prompts"].as_array().unwrap().iter().chain([&r["biased"]]).collect();
        let seqs: Vec<u64> =
            logged.iter().map(|l| l.0).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
        assert_eq!(seqs.len(), refs.len(), "{file}: every request proposed");
        let mut checked = 0;
        for (&(seq, last, first), _) in logged.iter().zip(0..) {
            let p = refs[seqs.iter().position(|&s| s == seq).unwrap()];
            let (argmax, margin) = (ids(&p["mtp_argmax"]), floats(&p["mtp_margin"]));
            if margin[last - 1] > 1e-2 {
                assert_eq!(first, argmax[last - 1], "{file} {}: the proposal after position {last}", p["name"]);
                checked += 1;
            }
        }
        assert!(checked > 30, "{file}: {checked} proposals checked");
        let m = one.metrics.snapshot();
        let (proposed, kept) = r["prompts"]
            .as_array()
            .unwrap()
            .iter()
            .chain([&r["biased"]])
            .map(expected_proposals)
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
        eprintln!(
            "{file}: {} of {} proposals kept (reference: {kept} of {proposed})",
            m.spec_accepted_tokens, m.spec_draft_tokens
        );
        assert!(kept >= 1, "the biased run keeps proposals");
        assert_eq!((m.spec_draft_tokens, m.spec_accepted_tokens), (proposed, kept), "{file}: {m:?}");
        let on = engine(file, true, 3);
        assert_same(&run_alone(&on, &reqs), &want, &format!("{file}: k = 3, alone"));
        assert_same(&run_together(&on, &reqs), &want, &format!("{file}: k = 3, together"));
        let m = on.metrics.snapshot();
        assert!(m.spec_accepted_tokens > 0 && m.spec_accepted_tokens < m.spec_draft_tokens, "{file}: {m:?}");
        for e in [&one, &on] {
            assert_all_blocks_free(e);
        }
        if file == "tiny-qwen35-mtp" {
            // With the prefix cache: the second run starts after cached prefixes whose positions
            // the head read in the first (its rows begin after the hit).
            let cached = engine_with(file, true, 2, true);
            assert_same(&run_alone(&cached, &reqs), &want, &format!("{file}: prefix cache, first run"));
            assert_same(&run_together(&cached, &reqs), &want, &format!("{file}: prefix cache, second run"));
            assert!(cached.metrics.snapshot().prefix_hits > 0, "{file}: the second run hits");
            assert_all_blocks_free(&cached);
        }
    }
}
