//! The scheduler's properties, with no executor and no device: sequences and a block manager
//! in, plans out (plus one scripted engine run for the sliding window, whose release is applied
//! with a step's results).

use super::metrics::EngineMetrics;
use super::request::{Request, RequestParams, StopConditions};
use super::scheduler::{Planned, Scheduler, SchedulerConfig, MAX_PASSED_OVER};
use super::sequence::Seq;
use crate::kv::BlockManager;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

const BS: usize = 4;

fn sched(num_blocks: usize, budget: usize, decode: usize, prefill: usize) -> Scheduler {
    let cfg = SchedulerConfig {
        max_num_batched_tokens: budget,
        max_decode_batch_size: decode,
        max_prefill_batch_size: prefill,
        max_seq_len: 512,
        block_size: BS,
        sliding_window: None,
        spec: crate::config::SpecSettings::off(),
    };
    Scheduler::new(cfg, BlockManager::new(num_blocks, BS, true), Arc::new(EngineMetrics::default()))
}

fn seq(id: u64, prompt: Vec<u32>, params: RequestParams) -> Seq {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    std::mem::forget(rx); // the stream stays open
    Seq::new(id, Request { prompt, params }, tx, 512)
}

fn plain(id: u64, len: usize) -> Seq {
    let prompt = (0..len as u32).map(|i| 1000 * id as u32 + i).collect();
    let params =
        RequestParams { stop: StopConditions { max_tokens: Some(64), ..Default::default() }, ..Default::default() };
    seq(id, prompt, params)
}

fn spans(plan: &[Planned]) -> Vec<(u64, usize, usize)> {
    plan.iter().map(|p| (p.id, p.start, p.len)).collect()
}

/// Submits the plan and applies its result at once: the tokens are computed, and every
/// sequence whose last token ran gets one more.
fn run(s: &mut Scheduler, plan: &[Planned]) {
    let _ = s.step_input(plan, 1);
    for p in plan {
        s.busy.remove(&p.id);
        let q = s.running.iter_mut().find(|q| q.id == p.id).unwrap();
        q.computed += p.len;
        if q.computed == q.tokens.len() {
            q.tokens.push(7);
        }
    }
}

#[test]
fn running_first_then_waiting_in_order_within_the_budget() {
    let mut s = sched(64, 16, 8, 8);
    for id in 1..=3 {
        s.waiting.push_back(plain(id, 10));
    }
    let p = s.schedule(8, 1);
    assert_eq!(spans(&p), vec![(1, 0, 10), (2, 0, 6)], "arrival order, chunked at the budget");
    run(&mut s, &p);
    let p = s.schedule(8, 1);
    // 1 decodes, 2 continues its prefill, 3 starts with what is left.
    assert_eq!(spans(&p), vec![(1, 10, 1), (2, 6, 4), (3, 0, 10)]);
}

#[test]
fn preemption_takes_the_newest_sequence_not_in_flight() {
    // 6 blocks = 24 tokens: three sequences of 8 fill them; the oldest then needs a block.
    let mut s = sched(6, 64, 8, 8);
    for id in 1..=3 {
        s.waiting.push_back(plain(id, 8));
    }
    let p = s.schedule(8, 1);
    assert_eq!(p.len(), 3);
    run(&mut s, &p);
    // All three now decode position 8, each needing a third block: none is free. The newest (3)
    // is preempted for the first, then 2 for the second... but 3's blocks suffice for 1 and 2.
    let p = s.schedule(8, 1);
    assert_eq!(spans(&p), vec![(1, 8, 1), (2, 8, 1)]);
    assert_eq!(s.waiting.front().map(|q| q.id), Some(3), "the preempted sequence is first in line");
    assert_eq!(s.metrics.preemptions.load(Relaxed), 1);
    assert_eq!(s.waiting[0].computed, 0, "it is recomputed from its tokens");

    // A sequence in flight is never preempted: with 1 and 2 busy, a new arrival waits.
    let _ = s.step_input(&p, 1);
    s.waiting.push_back(plain(4, 4));
    assert!(s.schedule(8, 1).is_empty(), "nothing fits while the running ones are in flight");
    assert_eq!(s.running.len(), 2);
}

#[test]
fn chunked_prefill_keeps_within_the_row_limit() {
    // Prompt logprobs add a row per prompt position: 4 rows per step at most.
    let mut s = sched(64, 64, 8, 8);
    let params = RequestParams {
        prompt_logprobs: Some(1),
        stop: StopConditions { max_tokens: Some(4), ..Default::default() },
        ..Default::default()
    };
    s.waiting.push_back(seq(1, (10..20).collect(), params));
    let mut covered = 0;
    for _ in 0..10 {
        let p = s.schedule(4, 1);
        if p.is_empty() || s.running[0].scheduled >= 10 {
            break;
        }
        let (input, rows) = s.step_input(&p, 1);
        assert!(input.sample_rows.len() <= 4 && rows.len() == input.sample_rows.len(), "{rows:?}");
        assert_eq!(p[0].start, covered, "chunks follow each other");
        covered += p[0].len;
        let q = &mut s.running[0];
        q.computed = q.scheduled;
        q.lp_done = q.computed.min(q.prompt_len - 1);
        s.busy.clear();
    }
    assert_eq!(covered, 10, "the whole prompt ran in chunks of at most 4 rows");
}

#[test]
fn a_prefix_hit_is_counted_once_per_admission() {
    let mut s = sched(8, 64, 8, 8);
    // A runs 12 tokens and its three full blocks stay cached.
    s.waiting.push_back(plain(1, 12));
    let p = s.schedule(8, 1);
    run(&mut s, &p);
    for (i, key) in [0usize, 1, 2].iter().enumerate() {
        let q = &mut s.running[0];
        let parent = if i == 0 { q.root } else { q.keys[i - 1] };
        let k = s.bm.register(q.table[*key], &parent, i == 0, &q.tokens[i * BS..(i + 1) * BS], false);
        s.running[0].keys.push(k);
    }
    let q0 = s.bm.stats().prefix_queries;
    assert_eq!(q0, 2, "A's admission queried its first two full blocks (its last token always runs)");
    // B shares A's 12 tokens and needs 5 more blocks, more than are free: it waits, looked up each step.
    let mut b = plain(1, 12);
    b.id = 2;
    b.tokens.extend(2000..2020);
    b.prompt_len = b.tokens.len();
    s.waiting.push_back(b);
    for _ in 0..3 {
        let p = s.schedule(8, 1);
        assert!(p.iter().all(|q| q.id != 2));
        run(&mut s, &p);
    }
    assert_eq!(s.bm.stats().prefix_queries, q0, "B's lookups while it waits are not counted");
    // A ends; B is admitted with A's three blocks.
    let a = s.running.remove(0);
    s.bm.release(&a.table);
    let p = s.schedule(8, 1);
    assert_eq!(spans(&p), vec![(2, 12, 20)]);
    let st = s.bm.stats();
    assert_eq!((st.prefix_queries, st.prefix_hits), (q0 + 7, 3), "B's admission counts once: {st:?}");
    assert_eq!(s.metrics.prefix_hit_tokens.load(Relaxed), 12);
}

#[test]
fn decodes_are_spread_over_the_steps_in_flight() {
    let mut s = sched(64, 64, 8, 8);
    for id in 1..=4 {
        s.waiting.push_back(plain(id, 3));
    }
    let p = s.schedule(8, 1);
    run(&mut s, &p);
    // Two steps may still be submitted (a two-stage pipeline): half the decodes in each.
    let first = s.schedule(8, 2);
    assert_eq!(spans(&first), vec![(1, 3, 1), (2, 3, 1)]);
    let _ = s.step_input(&first, 1);
    let second = s.schedule(8, 1);
    assert_eq!(spans(&second), vec![(3, 3, 1), (4, 3, 1)], "the others, not those in flight");
}

#[test]
fn a_large_request_is_passed_over_a_bounded_number_of_times() {
    // 8 blocks. A sequence in flight holds 4; a waiting request needing 6 blocks cannot start,
    // small ones behind it can, until it has been passed over MAX_PASSED_OVER times.
    let mut s = sched(8, 64, 8, 8);
    s.waiting.push_back(plain(1, 16));
    let p = s.schedule(8, 1);
    let _ = s.step_input(&p, 1);
    s.waiting.push_back(plain(2, 24));
    let mut started = 0;
    for i in 0..(MAX_PASSED_OVER as u64 + 5) {
        s.waiting.push_back(plain(100 + i, 2));
        let p = s.schedule(8, 1);
        started += p.iter().filter(|q| q.id >= 100).count();
        run(&mut s, &p);
        // Small requests end at once, freeing their block.
        let small: Vec<usize> = (0..s.running.len()).filter(|&j| s.running[j].id >= 100).collect();
        for j in small.into_iter().rev() {
            let q = s.running.remove(j);
            s.bm.release(&q.table);
        }
    }
    assert_eq!(started, MAX_PASSED_OVER as usize, "small requests start until the large one's turn");
    assert_eq!(s.waiting[0].id, 2);
    assert_eq!(s.waiting[0].passed_over, MAX_PASSED_OVER);
    assert_eq!(s.waiting.len(), 1 + 5, "the rest wait behind it");
    // The running sequence ends: the large request starts first.
    let a = s.running.remove(0);
    s.busy.clear();
    s.bm.release(&a.table);
    let p = s.schedule(8, 1);
    assert_eq!(p[0].id, 2, "{:?}", spans(&p));
}
