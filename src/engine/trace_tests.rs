//! The engine's step inputs and outputs for a scripted run, compared byte for byte with the
//! trace recorded before the engine was split into scheduler, runner and output
//! (src/engine/testdata/trace.txt): the split must not change one step. The run covers prefix
//! sharing, preemption, prompt logprobs, a stop string, penalties, a request arriving mid-run
//! and an abort. `TORUS_WRITE_TRACE=1` rewrites the file (only for an intended change).

use super::core::{Command, EngineCore};
use super::metrics::EngineMetrics;
use super::request::{Event, FinishReason, Request, RequestParams, StopConditions};
use super::scheduler::SchedulerConfig;
use super::scripted::{next_token, Scripted};
use crate::sampling::SamplingParams;
use crate::tokenizer::Tokenizer;
use std::fmt::Write;
use std::path::Path;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

fn tokenizer() -> Arc<Tokenizer> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-qwen2");
    Arc::new(Tokenizer::from_path(&p).expect("the tiny Qwen2 tokenizer"))
}

fn params(seed: u64, max_tokens: usize) -> RequestParams {
    RequestParams {
        sampling: SamplingParams { temperature: 0.7, seed: Some(seed), ..Default::default() },
        stop: StopConditions { max_tokens: Some(max_tokens), ..Default::default() },
        ..Default::default()
    }
}

fn prompt(start: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| 100 + (start + i * 13) % 380).collect()
}

/// The scheduler of the scripted runs: 16 tokens a step, blocks of 4.
fn sched_cfg(sliding_window: Option<usize>) -> SchedulerConfig {
    SchedulerConfig {
        max_num_batched_tokens: 16,
        max_decode_batch_size: 4,
        max_prefill_batch_size: 2,
        max_seq_len: 256,
        block_size: 4,
        sliding_window,
        spec: crate::config::SpecSettings::off(),
    }
}

type Out = (u64, UnboundedReceiver<Event>);

fn submit(id: u64, prompt: Vec<u32>, params: RequestParams) -> (Command, Out) {
    let (tx, rx) = unbounded_channel();
    (Command::Submit { id, req: Box::new(Request { prompt, params }), out: tx }, (id, rx))
}

/// Each request's id, finish reason, completion tokens and cached tokens.
type Ends = Vec<(u64, FinishReason, usize, usize)>;

/// Runs the script; returns the trace text, how each request ended, and the preemptions.
fn run(depth: usize) -> (String, Ends, u64) {
    let tok = tokenizer();
    let shared = prompt(0, 16);
    let mut outs = Vec::new();
    let mut first = Vec::new();

    // A: a shared 16-token prefix plus 4 tokens.
    let mut pa = shared.clone();
    pa.extend(prompt(500, 4));
    let (c, o) = submit(1, pa, params(1, 6));
    first.push(c);
    outs.push(o);
    // B: long, aborted mid-run.
    let (c, o) = submit(2, prompt(40, 30), params(2, 40));
    first.push(c);
    outs.push(o);
    // C: prompt logprobs and logprobs.
    let mut p = params(3, 3);
    p.prompt_logprobs = Some(2);
    p.logprobs = Some(1);
    let (c, o) = submit(3, prompt(77, 10), p);
    first.push(c);
    outs.push(o);
    // D: stops at the text of its third generated token.
    let pd = prompt(91, 12);
    let g0 = next_token(pd[11], 11);
    let g1 = next_token(g0, 12);
    let g2 = next_token(g1, 13);
    let mut p = params(4, 10);
    p.stop.stop = vec![tok.decode(&[g2], true)];
    let (c, o) = submit(4, pd, p);
    first.push(c);
    outs.push(o);
    // F: penalties and a logit bias (adjustment entries in its sample rows).
    let mut p = params(6, 8);
    p.repetition_penalty = 1.2;
    p.frequency_penalty = 0.5;
    p.logit_bias = vec![(7, 2.0), (9, -1.0)];
    let (c, o) = submit(6, prompt(123, 9), p);
    first.push(c);
    outs.push(o);

    let mut exec = Scripted::new(16, 4, 4, 21);
    exec.depth = depth;
    exec.vocab = 512;
    // E arrives at step 3 with A's prefix; B is aborted at step 16.
    let mut pe = shared;
    pe.extend(prompt(900, 6));
    let (c, o) = submit(5, pe, params(5, 5));
    outs.push(o);
    // The engine then drains: it ends once every request has.
    exec.script.insert(3, vec![c]);
    exec.script.insert(14, vec![Command::Shutdown { drain: true }]);
    exec.script.insert(16, vec![Command::Abort(2)]);
    let steps = exec.steps.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    exec.commands = Some(tx.clone());
    let cfg = sched_cfg(None);
    let metrics = Arc::new(EngineMetrics::default());
    let core = EngineCore::new(Box::new(exec), tok, cfg, true, metrics.clone(), None);
    for c in first {
        tx.send(c).unwrap();
    }
    core.run(rx);

    let mut trace = String::new();
    for (i, s) in steps.lock().unwrap().iter().enumerate() {
        writeln!(trace, "step {}: {s:?}", i + 1).unwrap();
    }
    let mut ends = Vec::new();
    for (id, mut rx) in outs {
        while let Ok(e) = rx.try_recv() {
            writeln!(trace, "request {id}: {e:?}").unwrap();
            if let Event::Done { reason, usage, .. } = e {
                ends.push((id, reason, usage.completion_tokens, usage.cached_tokens));
            }
        }
    }
    (trace, ends, metrics.preemptions.load(Relaxed))
}

#[test]
fn scripted_run_matches_the_recorded_trace() {
    let (trace, ends, preemptions) = run(1);
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/engine/testdata/trace.txt");
    if std::env::var_os("TORUS_WRITE_TRACE").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &trace).unwrap();
    }
    let reason = |id| ends.iter().find(|e| e.0 == id).map(|e| e.1.clone());
    assert_eq!(ends.len(), 6, "every request ends once: {ends:?}");
    assert_eq!(reason(1), Some(FinishReason::Length));
    assert_eq!(reason(2), Some(FinishReason::Abort));
    assert_eq!(reason(4), Some(FinishReason::Stop));
    let e = ends.iter().find(|e| e.0 == 5).unwrap();
    assert!(e.3 >= 8, "E reuses A's prefix blocks: {e:?}");
    assert!(preemptions > 0, "the cache is small enough to preempt");

    let want = std::fs::read_to_string(&path).expect("src/engine/testdata/trace.txt");
    if trace != want {
        let (i, (a, b)) = trace
            .lines()
            .zip(want.lines())
            .enumerate()
            .find(|(_, (a, b))| a != b)
            .unwrap_or((trace.lines().count().min(want.lines().count()), ("<end>", "<end>")));
        panic!("the trace differs from line {}:\n got: {a}\nwant: {b}", i + 1);
    }
}

/// With two steps in flight (a two-stage pipeline), the same requests end the same way.
#[test]
fn scripted_run_in_a_pipeline_ends_every_request() {
    let (_, ends, _) = run(2);
    assert_eq!(ends.len(), 6, "{ends:?}");
    for (id, reason, n, _) in &ends {
        match id {
            2 => assert_eq!(*reason, FinishReason::Abort),
            4 => assert_eq!((reason, *n), (&FinishReason::Stop, 3)),
            _ => assert_eq!(*reason, FinishReason::Length, "request {id}"),
        }
    }
}

/// With a sliding window of 8, a sequence of 8 + 40 tokens runs in a cache of 6 blocks (24
/// tokens): blocks that left the window are freed as it goes, so nothing is preempted.
#[test]
fn sliding_window_frees_the_blocks_that_left_it() {
    let exec = Scripted::new(16, 4, 4, 6);
    let cfg = sched_cfg(Some(8));
    let metrics = Arc::new(EngineMetrics::default());
    let core = EngineCore::new(Box::new(exec), tokenizer(), cfg, true, metrics.clone(), None);
    let (c, (_, mut rx)) = submit(1, prompt(5, 8), params(1, 40));
    let (tx, cmds) = std::sync::mpsc::channel();
    tx.send(c).unwrap();
    drop(tx);
    core.run(cmds);
    let mut end = None;
    while let Ok(e) = rx.try_recv() {
        if let Event::Done { reason, usage, .. } = e {
            end = Some((reason, usage.completion_tokens));
        }
    }
    assert_eq!(end, Some((FinishReason::Length, 40)));
    assert_eq!(metrics.preemptions.load(Relaxed), 0);
}
