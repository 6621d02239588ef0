//! Running requests on an engine and comparing completions: alone or together, every field
//! equal, and every KV block free afterwards.

use std::time::{Duration, Instant};
use torus_wgpu::engine::{Completion, EngineHandle, Request, RequestParams, StopConditions};

/// `reqs` again with a stop string each: three characters from the middle of the text its
/// completion in `want` gave (requests whose middle is blank are left out; at least one stays).
pub fn stops_mid_text(want: &[Completion], reqs: &[Request]) -> Vec<Request> {
    let stops: Vec<Request> = want
        .iter()
        .zip(reqs)
        .filter_map(|(c, r)| {
            let mid: String = c.text.chars().skip(c.text.chars().count() / 2).take(3).collect();
            (!mid.trim().is_empty()).then(|| {
                let mut r = r.clone();
                r.params.stop.stop = vec![mid];
                r
            })
        })
        .collect();
    assert!(!stops.is_empty(), "every completion's middle is blank");
    stops
}

pub fn run_alone(e: &EngineHandle, reqs: &[Request]) -> Vec<Completion> {
    reqs.iter().map(|r| e.submit(r.clone()).unwrap().collect_blocking()).collect()
}

pub fn run_together(e: &EngineHandle, reqs: &[Request]) -> Vec<Completion> {
    let streams: Vec<_> = reqs.iter().map(|r| e.submit(r.clone()).unwrap()).collect();
    streams.into_iter().map(|s| s.collect_blocking()).collect()
}

/// Waits (bounded) until the engine is idle with every KV block (and state slot) free.
pub fn assert_all_blocks_free(e: &EngineHandle) {
    let t = Instant::now();
    loop {
        let m = e.metrics.snapshot();
        if m.running == 0 && m.waiting == 0 && m.kv_blocks_used == 0 {
            assert_eq!(m.kv_blocks_free, m.kv_blocks_total);
            // Recurrent-state slots (hybrid models) come back with the blocks.
            assert_eq!(m.state_slots_used, 0, "{m:?}");
            return;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "blocks still in use: {m:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Ids, text, logprobs (within 1e-3) and finish reasons of `a` and `b` are the same.
pub fn assert_same(a: &[Completion], b: &[Completion], what: &str) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.ids, y.ids, "{what}: request {i}: tokens");
        assert_eq!(x.text, y.text, "{what}: request {i}: text");
        assert_eq!(x.reason, y.reason, "{what}: request {i}: finish reason");
        assert_eq!(x.logprobs.len(), y.logprobs.len(), "{what}: request {i}: logprobs");
        for (p, q) in x.logprobs.iter().zip(&y.logprobs) {
            assert!((p - q).abs() < 1e-3, "{what}: request {i}: logprob {p} vs {q}");
        }
    }
}

/// Greedy, `max_tokens` new tokens, end-of-sequence ignored.
pub fn greedy(max_tokens: usize) -> RequestParams {
    RequestParams {
        stop: StopConditions { max_tokens: Some(max_tokens), ignore_eos: true, ..Default::default() },
        ..Default::default()
    }
}

pub fn request(prompt: &[u32], params: RequestParams) -> Request {
    Request { prompt: prompt.to_vec(), params }
}

/// Four greedy requests (30 tokens) on a 40-token prefix cycled from `unit`, each with two
/// tokens of its own: the prefix cache's full blocks are shared.
pub fn shared_prefix_requests(unit: &[u32]) -> Vec<Request> {
    let shared: Vec<u32> = unit.iter().cycle().take(40).copied().collect();
    (0..4)
        .map(|i| {
            let mut p = shared.clone();
            p.extend([7 + i, 9 + 2 * i]);
            request(&p, greedy(30))
        })
        .collect()
}
