//! Qwen3.5, the Gated DeltaNet hybrid: the tiny model of scripts/fixtures/gen_tiny_qwen35.py (three
//! DeltaNet layers, then a gated attention layer with partial RoPE) from its Hugging Face directory
//! and its llama.cpp-layout GGUF (tiled value heads, A = -exp(A_log), +1 norms), against
//! transformers' float32 logits and greedy tokens, in both kernel profiles and over 2 pipeline
//! stages; the DeltaNet kernels against a CPU reference (chunks == one step == token by token,
//! several sequences and slots); and the engine's properties on a hybrid model: batching and
//! chunked-prefill invariance, prefix cache asked for == off (it is turned off), preemption, and
//! every state slot back afterwards.

use crate::common::tiny::{self, local, reference};
use std::sync::Arc;
use torus_wgpu::config::KernelProfile;
use torus_wgpu::gpu::Gpu;
use torus_wgpu::model::config::Arch;
use torus_wgpu::model::loader::read_config;
use torus_wgpu::ops::delta::{delta_ref, DeltaDims, DeltaState, DeltaWeights, CHUNK, CHUNK_MIN};
use torus_wgpu::ops::harness::Harness;
use torus_wgpu::ops::harness_delta::{DeltaSeq, DeltaSlots};
use torus_wgpu::weights::tensor::XorShift64;

#[test]
fn qwen35_config_from_hf_and_gguf() {
    for (f, tiled) in [("tiny-qwen35", false), ("tiny-qwen35.gguf", true)] {
        let c = read_config(&local(f)).unwrap_or_else(|e| panic!("{f}: {e:#}"));
        assert_eq!(c.arch, Arch::Qwen35, "{f}");
        let l = c.linear.as_ref().unwrap();
        assert_eq!(l.layers, [true, true, true, false], "{f}");
        let d = l.dims;
        assert_eq!((d.k_heads, d.v_heads, d.k_dim, d.v_dim, d.kernel), (2, 4, 16, 16, 4), "{f}");
        assert_eq!(l.tiled, tiled, "{f}");
        assert_eq!((c.rope_dim(), c.head_dim, c.heads, c.kv_heads), (8, 32, 4, 2), "{f}");
        assert!(c.qk_norm && c.style.attn_gate, "{f}");
        assert_eq!(c.attn_layers_in(0..4), 1);
    }
    let r = reference("tiny-qwen35-reference.json");
    let len = std::fs::metadata(local("tiny-qwen35.gguf")).unwrap().len();
    assert_eq!(len, r["gguf"]["size"].as_u64().unwrap());
}

/// Every prompt's last-position logits within 1e-3 of transformers and its 20 greedy tokens
/// (each decoded token continuing the recurrent state), from the HF directory and the GGUF, in
/// both kernel profiles.
#[test]
fn qwen35_matches_transformers() {
    let r = reference("tiny-qwen35-reference.json");
    for f in ["tiny-qwen35", "tiny-qwen35.gguf"] {
        for profile in [KernelProfile::Cpu, KernelProfile::Gpu] {
            tiny::assert_matches_reference(f, &r, profile);
        }
    }
}

/// Qwen3.5-MoE: the same hybrid layers with every FFN a mixture of 8 experts (2 per token,
/// renormalised) beside a gated shared expert; per-expert HF tensors and llama.cpp's stacked ones.
#[test]
fn qwen35_moe_config_and_matches_transformers() {
    for f in ["tiny-qwen35moe", "tiny-qwen35moe.gguf"] {
        let c = read_config(&local(f)).unwrap_or_else(|e| panic!("{f}: {e:#}"));
        assert_eq!(c.arch, Arch::Qwen35, "{f}");
        assert_eq!(c.linear.as_ref().unwrap().layers, [true, true, true, false], "{f}");
        let m = c.moe.as_ref().unwrap();
        assert_eq!((m.experts, m.top_k, m.ffn, m.norm_topk, m.shared_ffn), (8, 2, 32, true, 64), "{f}");
        assert_eq!(m.sparse_layers, [true; 4], "{f}");
    }
    let r = reference("tiny-qwen35moe-reference.json");
    for f in ["tiny-qwen35moe", "tiny-qwen35moe.gguf"] {
        for profile in [KernelProfile::Cpu, KernelProfile::Gpu] {
            tiny::assert_matches_reference(f, &r, profile);
        }
    }
}

/// Two in-process stages: DeltaNet layers only (no KV cache at all), then a DeltaNet and the
/// attention layer.
#[test]
fn qwen35_in_two_pipeline_stages() {
    tiny::assert_stages_match_reference(
        "tiny-qwen35.gguf",
        &reference("tiny-qwen35-reference.json"),
        &[(0, 2), (2, 4)],
    );
}

fn rand_vec(rng: &mut XorShift64, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| (rng.unit() * 2.0 - 1.0) * scale).collect()
}

/// The DeltaNet kernels against the CPU reference: three sequences in slots 2, 0 and 1 (one
/// continuing from a state, two from zero), as one step; the same tokens in steps of 3, of 20
/// and token by token end in the same outputs and states; grouped and tiled value heads; both
/// kernel profiles. Short sequences take the per-token recurrence; long ones (CHUNK_MIN tokens or
/// more in a step) in the gpu profile the chunked form, over several chunks, a short first one
/// where a snapshot is asked for.
#[test]
fn delta_kernels_match_the_reference_in_chunks_and_token_by_token() {
    let gpu = Arc::new(Gpu::new(None).expect("a wgpu adapter"));
    let shapes = [
        (false, DeltaDims { k_heads: 2, v_heads: 4, k_dim: 16, v_dim: 12, kernel: 4 }),
        (true, DeltaDims { k_heads: 1, v_heads: 3, k_dim: 32, v_dim: 80, kernel: 3 }),
    ];
    let short = [7usize, 5, 9];
    // 70: three chunks (32, 32, 6); 45: a snapshot after token 2, so chunks of 3, 32 and 10.
    let long = [70usize, 45, 20];
    assert!(short.iter().all(|&n| n < CHUNK_MIN) && long.iter().all(|&n| n >= CHUNK_MIN) && long[0] > 2 * CHUNK);
    // The gpu profile takes the chunked form for long sequences, the cpu profile never.
    let cases = shapes.iter().flat_map(|&s| [(s, short), (s, long)]);
    for (((tiled, d), lens), profile) in cases.flat_map(|c| [(c, KernelProfile::Cpu), (c, KernelProfile::Gpu)]) {
        let h = Harness::for_delta(gpu.clone(), d.k_dim as u32, profile).unwrap();
        assert_eq!(h.kernels.delta.as_ref().unwrap().chunked, profile == KernelProfile::Gpu);
        let mut rng = XorShift64::new(11);
        let conv = rand_vec(&mut rng, d.conv_dim() * d.kernel, 0.5);
        let a: Vec<f32> = (0..d.v_heads).map(|i| -0.2 - 0.3 * i as f32).collect();
        let dt = rand_vec(&mut rng, d.v_heads, 0.5);
        let norm: Vec<f32> = (0..d.v_dim).map(|_| 1.0 + 0.2 * (rng.unit() - 0.5)).collect();
        let w = DeltaWeights { conv: &conv, a: &a, dt_bias: &dt, norm: &norm };
        let x: Vec<Vec<f32>> = lens.iter().map(|&n| rand_vec(&mut rng, n * d.proj_width(), 1.0)).collect();
        // Slot 2 continues from a random state; the others start from zero (reset).
        // Slot 3: the first sequence's backup (its state before the step is copied there); slot
        // 4: the second's snapshot after its third token.
        let slots = 5;
        let mut start = DeltaSlots { conv: vec![0.0; slots * d.conv_state()], rec: vec![0.0; slots * d.rec_state()] };
        let prior =
            DeltaState { conv: rand_vec(&mut rng, d.conv_state(), 1.0), rec: rand_vec(&mut rng, d.rec_state(), 0.3) };
        start.conv[2 * d.conv_state()..3 * d.conv_state()].copy_from_slice(&prior.conv);
        start.rec[2 * d.rec_state()..3 * d.rec_state()].copy_from_slice(&prior.rec);
        // Garbage in the reset slots: a reset must not read it.
        start.conv[..d.conv_state()].fill(9.0);
        start.rec[d.rec_state()..2 * d.rec_state()].fill(-7.0);
        let order = [(2u32, false), (0, true), (1, true)];
        let eps = 1e-6;
        let mut want = Vec::new();
        let mut want_states = Vec::new();
        for (i, &(slot, reset)) in order.iter().enumerate() {
            let mut st = if reset { DeltaState::zero(&d) } else { prior.clone() };
            want.push(delta_ref(&d, &w, &x[i], &mut st, eps, tiled));
            want_states.push((slot, st));
        }
        let check = |got: &[Vec<f32>], st: &DeltaSlots, what: &str| {
            for (i, (slot, s)) in want_states.iter().enumerate() {
                let dmax = tiny::max_diff(&got[i], &want[i]);
                assert!(
                    dmax < 2e-4,
                    "{what} tiled={tiled} {lens:?} {profile:?}: sequence {i} outputs differ by {dmax}"
                );
                let s0 = *slot as usize;
                let dr = tiny::max_diff(&st.rec[s0 * d.rec_state()..(s0 + 1) * d.rec_state()], &s.rec);
                let dc = tiny::max_diff(&st.conv[s0 * d.conv_state()..(s0 + 1) * d.conv_state()], &s.conv);
                assert!(
                    dr < 2e-4 && dc == 0.0,
                    "{what} tiled={tiled} {lens:?} {profile:?}: sequence {i} state differs by {dr} / {dc}"
                );
            }
        };
        // One step with all three sequences.
        let mut st = start.clone();
        let seqs: Vec<DeltaSeq> = order
            .iter()
            .zip(&lens)
            .enumerate()
            .map(|(i, (&(slot, reset), &tokens))| DeltaSeq {
                slot,
                tokens,
                reset,
                backup: (i == 0).then_some(3),
                snapshot: (i == 1).then_some((4, 2)),
                src: None,
            })
            .collect();
        let out = h.delta(&d, &w, &x.concat(), &seqs, &mut st, (eps, tiled)).unwrap();
        let slot = |v: &[f32], i: usize, n: usize| v[i * n..(i + 1) * n].to_vec();
        assert_eq!(slot(&st.rec, 3, d.rec_state()), prior.rec, "the backup holds the state before the step");
        assert_eq!(slot(&st.conv, 3, d.conv_state()), prior.conv);
        let mut after3 = DeltaState::zero(&d);
        delta_ref(&d, &w, &x[1][..3 * d.proj_width()], &mut after3, eps, tiled);
        let dr = tiny::max_diff(&slot(&st.rec, 4, d.rec_state()), &after3.rec);
        assert!(dr < 2e-4, "the snapshot holds the state after the third token ({dr})");
        assert_eq!(slot(&st.conv, 4, d.conv_state()), after3.conv);
        // The second sequence again from its fourth token, its state read from the snapshot
        // (slot 4) into slot 0 (garbage before): its outputs and final state as in one go.
        let mut st2 = st.clone();
        st2.rec[..d.rec_state()].fill(5.0);
        st2.conv[..d.conv_state()].fill(5.0);
        let rest = DeltaSeq { slot: 0, tokens: lens[1] - 3, reset: false, backup: None, snapshot: None, src: Some(4) };
        let out2 = h.delta(&d, &w, &x[1][3 * d.proj_width()..], &[rest], &mut st2, (eps, tiled)).unwrap();
        let dmax = tiny::max_diff(&out2, &want[1][3 * d.value_dim()..]);
        assert!(dmax < 2e-4, "read from a snapshot: outputs differ by {dmax}");
        let dr = tiny::max_diff(&slot(&st2.rec, 0, d.rec_state()), &want_states[1].1.rec);
        assert!(dr < 2e-4, "read from a snapshot: state differs by {dr}");
        assert_eq!(slot(&st2.rec, 4, d.rec_state()), slot(&st.rec, 4, d.rec_state()), "the snapshot is only read");
        let mut got = Vec::new();
        let mut at = 0;
        for &n in &lens {
            got.push(out[at * d.value_dim()..(at + n) * d.value_dim()].to_vec());
            at += n;
        }
        check(&got, &st, "one step");
        // Chunks of `c` tokens of every sequence per step (c = 1: token by token; 20: the
        // chunked form from a state).
        for c in [3usize, 1, 20] {
            let mut st = start.clone();
            let mut got = vec![Vec::new(); 3];
            for step in 0.. {
                let mut seqs = Vec::new();
                let mut xs = Vec::new();
                let mut which = Vec::new();
                for (i, &(slot, reset)) in order.iter().enumerate() {
                    let (a, b) = (step * c, ((step + 1) * c).min(lens[i]));
                    if a < b {
                        let reset = reset && a == 0;
                        seqs.push(DeltaSeq { slot, tokens: b - a, reset, backup: None, snapshot: None, src: None });
                        xs.extend_from_slice(&x[i][a * d.proj_width()..b * d.proj_width()]);
                        which.push((i, b - a));
                    }
                }
                if seqs.is_empty() {
                    break;
                }
                let out = h.delta(&d, &w, &xs, &seqs, &mut st, (eps, tiled)).unwrap();
                let mut at = 0;
                for (i, n) in which {
                    got[i].extend_from_slice(&out[at * d.value_dim()..(at + n) * d.value_dim()]);
                    at += n;
                }
            }
            check(&got, &st, &format!("chunks of {c}"));
        }
    }
}

/// Long sequences at Qwen3.5's keys of 128 (and 256), one step each from a zero state: llvmpipe
/// stops an invocation's loops after 65535 iterations in all (`Gpu::loop_limit`), which cut the
/// per-token recurrence after ~250 tokens (its two loops over the state's 128 rows per token, now
/// written out) and the chunked form after ~2300. The per-token recurrence (cpu profile) reaches
/// every token of 3000; the chunked form (gpu profile) every token of the most a step gives one
/// sequence on this device (`max_loop_tokens`, the model's sub-step bound); every output and the
/// final states against the CPU reference.
#[test]
fn delta_kernels_reach_every_token_of_a_long_sequence() {
    use torus_wgpu::ops::delta::max_loop_tokens;
    let gpu = Arc::new(Gpu::new(None).expect("a wgpu adapter"));
    for k_dim in [128usize, 256] {
        let d = DeltaDims { k_heads: 1, v_heads: 2, k_dim, v_dim: 32, kernel: 4 };
        let mut rng = XorShift64::new(5);
        let conv = rand_vec(&mut rng, d.conv_dim() * d.kernel, 0.5);
        let (a, dt) = (vec![-0.2, -0.5], rand_vec(&mut rng, d.v_heads, 0.5));
        let norm = vec![1.0; d.v_dim];
        let w = DeltaWeights { conv: &conv, a: &a, dt_bias: &dt, norm: &norm };
        for profile in [KernelProfile::Cpu, KernelProfile::Gpu] {
            let chunked = profile == KernelProfile::Gpu;
            let n = gpu.loop_limit().map_or(3000, |l| max_loop_tokens(k_dim, chunked, l).min(3000));
            assert!(n > if chunked { 1000 } else { 2999 }, "k_dim {k_dim}: {n} tokens per step");
            let h = Harness::for_delta(gpu.clone(), k_dim as u32, profile).unwrap();
            let x = rand_vec(&mut rng, n * d.proj_width(), 1.0);
            let mut want_state = DeltaState::zero(&d);
            let want = delta_ref(&d, &w, &x, &mut want_state, 1e-6, true);
            let mut st = DeltaSlots { conv: vec![3.0; d.conv_state()], rec: vec![3.0; d.rec_state()] };
            let seq = DeltaSeq { slot: 0, tokens: n, reset: true, backup: None, snapshot: None, src: None };
            let got = h.delta(&d, &w, &x, &[seq], &mut st, (1e-6, true)).unwrap();
            let vd = d.value_dim();
            let bad = (0..n).find(|&t| tiny::max_diff(&got[t * vd..(t + 1) * vd], &want[t * vd..(t + 1) * vd]) > 1e-3);
            assert_eq!(bad, None, "k_dim {k_dim} {profile:?}: {n} tokens, outputs wrong from this token");
            let dr = tiny::max_diff(&st.rec, &want_state.rec);
            assert!(dr < 1e-3 && st.conv == want_state.conv, "k_dim {k_dim} {profile:?}: final state off by {dr}");
        }
    }
}

/// The attention's output gate: out * sigmoid(gate).
#[test]
fn attention_output_gate_matches_the_reference() {
    let gpu = Arc::new(Gpu::new(None).expect("a wgpu adapter"));
    let h = Harness::for_delta(gpu, 16, KernelProfile::Cpu).unwrap();
    let mut rng = XorShift64::new(3);
    let (gate, out) = (rand_vec(&mut rng, 5 * 96, 4.0), rand_vec(&mut rng, 5 * 96, 1.0));
    let got = h.attn_gate(&gate, &out, 96).unwrap();
    let want: Vec<f32> = gate.iter().zip(&out).map(|(g, o)| o / (1.0 + (-g).exp())).collect();
    assert!(tiny::max_diff(&got, &want) < 1e-6);
}

/// Batching and chunked-prefill invariance; prefix cache on == off, where a hybrid model reuses
/// a cached prefix from a state snapshot after its last block (hits counted), also run a
/// second time and batched; every state slot back after.
#[test]
fn qwen35_engine_batched_chunked_and_prefix_cache_requests_equal_alone() {
    let reqs = tiny::shared_prefix_requests(6, 12);
    let off = tiny::engine("tiny-qwen35", |c| c.enable_prefix_cache = false);
    let alone = tiny::run_alone(&off, &reqs);
    assert_eq!(tiny::run_together(&off, &reqs), alone, "batched != alone");
    // Prompts of 41..60 tokens in steps of 16: every prompt prefilled over several chunks.
    let chunked = tiny::engine("tiny-qwen35", |c| {
        c.enable_prefix_cache = false;
        c.max_num_batched_tokens = 16;
    });
    assert_eq!(tiny::run_together(&chunked, &reqs), alone, "chunked prefill != one step");
    for file in ["tiny-qwen35", "tiny-qwen35moe"] {
        let want = if file == "tiny-qwen35" {
            alone.clone()
        } else {
            tiny::run_alone(&tiny::engine(file, |c| c.enable_prefix_cache = false), &reqs)
        };
        let on = tiny::engine(file, |c| c.enable_prefix_cache = true);
        assert_eq!(tiny::run_alone(&on, &reqs), want, "{file}: prefix cache on != off");
        let hits = on.metrics.snapshot().prefix_hits;
        assert!(hits > 0, "{file}: the shared prefix is reused from a snapshot");
        assert_eq!(tiny::run_alone(&on, &reqs), want, "{file}: prefix cache on != off, a second time");
        assert!(on.metrics.snapshot().prefix_hits > hits, "{file}: the same prompts hit again");
        assert_eq!(tiny::run_together(&on, &reqs), want, "{file}: prefix cache on, batched != alone");
        // Three copies of one prompt at once (as `n` choices are): each reads the snapshot.
        let hits = on.metrics.snapshot().prefix_hits;
        let three = vec![reqs[0].clone(); 3];
        assert_eq!(tiny::run_together(&on, &three), vec![want[0].clone(); 3], "{file}: three copies");
        assert!(on.metrics.snapshot().prefix_hits >= hits + 3, "{file}: every copy starts after the prefix");
        // Chunks of 16: every chunk ends on a block, each leaves a snapshot.
        let on_chunked = tiny::engine(file, |c| {
            c.enable_prefix_cache = true;
            c.max_num_batched_tokens = 16;
        });
        assert_eq!(tiny::run_together(&on_chunked, &reqs), want, "{file}: chunked with the prefix cache");
        assert_eq!(tiny::run_together(&on_chunked, &reqs), want, "{file}: chunked with the prefix cache, again");
        assert!(on_chunked.metrics.snapshot().prefix_hits > 0);
        for e in [&on, &on_chunked] {
            crate::common::completions::assert_all_blocks_free(e);
        }
    }
    for e in [&off, &chunked] {
        crate::common::completions::assert_all_blocks_free(e);
        let m = e.metrics.snapshot();
        assert!(m.state_slots_total > 0, "{m:?}");
    }
}

/// The gpu profile's chunked delta rule in the engine: batched, chunked prefill (steps of 16
/// tokens: each sequence's part a chunk of its own, continuing from its state) and prefix cache
/// on (states read from snapshots, written at block ends inside the chunks) all give what the
/// gpu profile gives alone with the cache off; every block back after.
#[test]
fn qwen35_chunked_delta_rule_in_the_engine() {
    let reqs = tiny::shared_prefix_requests(6, 12);
    let gpu = |cache: bool, step: usize| {
        tiny::engine("tiny-qwen35", move |c| {
            c.kernel_profile = KernelProfile::Gpu;
            c.enable_prefix_cache = cache;
            if step > 0 {
                c.max_num_batched_tokens = step;
            }
        })
    };
    let off = gpu(false, 0);
    let alone = tiny::run_alone(&off, &reqs);
    assert_eq!(tiny::run_together(&off, &reqs), alone, "batched != alone");
    let chunked = gpu(false, 16);
    assert_eq!(tiny::run_together(&chunked, &reqs), alone, "chunked prefill != one step");
    let on = gpu(true, 0);
    assert_eq!(tiny::run_alone(&on, &reqs), alone, "prefix cache on != off");
    assert!(on.metrics.snapshot().prefix_hits > 0, "the shared prefix is reused from a snapshot");
    assert_eq!(tiny::run_together(&on, &reqs), alone, "prefix cache on, batched != alone");
    for e in [&off, &chunked, &on] {
        crate::common::completions::assert_all_blocks_free(e);
    }
}

/// Speculative decoding (n-gram) on a hybrid: a verification step keeps each sequence's state
/// from before it in a backup slot; where a proposal is rejected the sequence goes on from that
/// state and computes its accepted tokens again. Greedy and seeded sampling give exactly what
/// they give with speculation off, alone and batched, dense and MoE; proposals are both accepted
/// and rejected; every slot and block is back afterwards.
#[test]
fn qwen35_speculation_on_equals_off() {
    use crate::common::completions::{assert_all_blocks_free, assert_same, greedy, request, run_alone, run_together};
    use torus_wgpu::config::SpecMethod;
    use torus_wgpu::engine::RequestParams;
    use torus_wgpu::sampling::SamplingParams;
    // Prompts that repeat themselves, so lookups find matches.
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|i| {
            let unit: Vec<u32> = (0..5 + i % 3).map(|j| (37 + 53 * i as u32 + 11 * j as u32) % 500).collect();
            unit.iter().cycle().take(unit.len() * 3).copied().collect()
        })
        .collect();
    let mut reqs: Vec<_> = prompts.iter().map(|p| request(p, greedy(24))).collect();
    for (i, p) in prompts.iter().enumerate().take(2) {
        let sampling = SamplingParams { temperature: 0.8, top_p: 0.95, seed: Some(7 + i as u64), ..Default::default() };
        reqs.push(request(p, RequestParams { sampling, logprobs: Some(1), ..greedy(24) }));
    }
    // A logit bias keeps the choice to three tokens that cycle in the prompt: lookups propose
    // at every position and the model's own logits pick among the three (some proposals kept,
    // some rejected).
    let unit = [41u32, 97, 12];
    let cycle: Vec<u32> = unit.iter().cycle().take(30).copied().collect();
    for i in 0..4u64 {
        let sampling = SamplingParams { temperature: 4.0, top_k: 3, seed: Some(100 + i), ..Default::default() };
        let logit_bias = unit.iter().map(|&t| (t, 30.0)).collect();
        reqs.push(request(&cycle, RequestParams { sampling, logit_bias, ..greedy(24) }));
    }
    for file in ["tiny-qwen35", "tiny-qwen35moe"] {
        let engine = |spec: bool| {
            tiny::engine(file, |c| {
                c.enable_prefix_cache = false;
                c.speculative = if spec { SpecMethod::Ngram } else { SpecMethod::Off };
                c.num_speculative_tokens = 4;
                c.prompt_lookup_min = 1;
                c.speculative_max_batch = 16;
                c.speculative_cost_gate = false;
            })
        };
        let off = engine(false);
        let want = run_alone(&off, &reqs);
        let on = engine(true);
        assert_same(&run_alone(&on, &reqs), &want, &format!("{file}: alone"));
        assert_same(&run_together(&on, &reqs), &want, &format!("{file}: together"));
        let m = on.metrics.snapshot();
        eprintln!(
            "{file}: {} of {} proposals accepted in {} drafts",
            m.spec_accepted_tokens, m.spec_draft_tokens, m.spec_drafts
        );
        assert!(m.spec_accepted_tokens > 0, "{file}: {m:?}");
        assert!(m.spec_accepted_tokens < m.spec_draft_tokens, "{file}: some proposals rejected: {m:?}");
        assert_all_blocks_free(&on);
    }
}

/// Preemption frees a sequence's slot; recomputed from its tokens it gives what it gives alone.
#[test]
fn qwen35_preemption() {
    // One 16-token block of K+V of the one attention layer: 2 * 16 * 2 * 32 * 2 bytes (f16).
    tiny::assert_preemption_keeps_outputs("tiny-qwen35", 12, 4096);
}

/// A shared system prompt (ending in the end-of-turn token) before different questions, each
/// prompt short enough for one prefill chunk: the first request's chunk ends at the block before
/// the turn's end, so its state there is snapshotted and the later requests start after it
/// (without the cut the only snapshot lies past the shared part and nothing is reused); outputs
/// equal to the cache off.
#[test]
fn qwen35_prefix_cache_reuses_a_shared_system_prompt() {
    use crate::common::completions::{greedy, request, run_alone};
    let mut rng = XorShift64::new(5);
    let mut system: Vec<u32> = (0..37).map(|_| rng.range(0, 500)).collect();
    system.extend([511, 198]);
    let reqs: Vec<_> = (0..4)
        .map(|_| {
            let mut p = system.clone();
            p.extend((0..20).map(|_| rng.range(0, 500)));
            request(&p, greedy(8))
        })
        .collect();
    let want = run_alone(&tiny::engine("tiny-qwen35", |c| c.enable_prefix_cache = false), &reqs);
    let on = tiny::engine("tiny-qwen35", |c| c.enable_prefix_cache = true);
    let got = run_alone(&on, &reqs);
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        assert_eq!(a.ids, b.ids, "request {i}: prefix cache on != off");
    }
    let m = on.metrics.snapshot();
    assert!(m.prefix_hit_tokens >= 3 * 32, "the system prompt's two blocks are reused: {m:?}");
    crate::common::completions::assert_all_blocks_free(&on);
}
