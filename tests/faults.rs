//! Engine faults (issue 12): a step that panics, raises a wgpu error (caught by the step's
//! error scope) or returns under the wrong step id fails only its own requests, with a clear
//! error (500 in OpenAI's shape over HTTP), and the next request is served correctly; a dead
//! engine thread or a lost device turns /health to 503 and `torus_engine_healthy` to 0.
//! Faults are injected with the test-only `EngineHandle::inject_fault` into the real paths
//! (a real panic in the executor, a real wgpu validation error, a really destroyed device).

mod common;
use common::{greedy_req, tiny};

use reqwest::StatusCode;
use serde_json::{json, Value};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use torus_wgpu::config::EngineConfig;
use torus_wgpu::engine::{load_model, EngineHandle, FinishReason};
use torus_wgpu::exec::{Fault, FaultInjector};
use torus_wgpu::gpu::Gpu;
use torus_wgpu::server::{model_id_for_path, start, ServerConfig, ServerHandle};

fn cfg() -> EngineConfig {
    EngineConfig {
        max_num_batched_tokens: 128,
        max_sequence_length: 256,
        total_cache_size: 8 << 20,
        max_decode_batch_size: 8,
        max_prefill_batch_size: 4,
        enable_prefix_cache: true,
        ..Default::default()
    }
}

fn engine(path: &Path, cfg: &EngineConfig) -> EngineHandle {
    let gpu = Arc::new(Gpu::new(None).expect("a wgpu adapter"));
    let (model, tok) = load_model(path, cfg, gpu, &|_, _| {}).expect("model loads");
    EngineHandle::start(FaultInjector::new(model), tok, cfg)
}

/// Waits (up to 10 s) for `f` to hold.
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(10), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn step_faults_fail_their_requests_and_the_engine_goes_on() {
    let e = engine(&tiny(), &cfg());
    // 40 tokens: longer than two 16-token blocks, so the prefix cache holds blocks of it.
    let prompt: Vec<u32> = (0..40).map(|i| 5 + (i * 37) % 200).collect();
    let reference = e.submit(greedy_req(&prompt, 12)).unwrap().collect_blocking();
    assert_eq!(reference.reason, FinishReason::Length);
    assert_eq!(reference.ids.len(), 12);
    let cases = [
        (Fault::StepPanic, "panicked"),
        (Fault::StepGpuError, "GPU error"),
        (Fault::StepIdMismatch, "returned the result of step"),
    ];
    for (i, (fault, expect)) in cases.into_iter().enumerate() {
        e.inject_fault(fault);
        let failed = e.submit(greedy_req(&prompt, 12)).unwrap().collect_blocking();
        match &failed.reason {
            FinishReason::Error(m) => assert!(m.contains(expect), "{fault:?}: error {m:?} should say {expect:?}"),
            r => panic!("{fault:?}: the faulty step's request must fail, it ended with {r:?}"),
        }
        assert!(failed.ids.is_empty(), "{fault:?}: no token of a failed step is delivered: {:?}", failed.ids);
        assert_eq!(e.metrics.snapshot().step_failures, i as u64 + 1, "{fault:?} is counted");
        assert!(e.health().is_ok(), "{fault:?}: a failed step leaves the engine serving: {:?}", e.health());
        // Every block of the failed request is freed.
        eventually("the failed request's blocks to be freed", || e.metrics.snapshot().kv_blocks_used == 0);
        // The next request (on the prefix cache's blocks, where they survived) is served right.
        let next = e.submit(greedy_req(&prompt, 12)).unwrap().collect_blocking();
        assert_eq!(next.ids, reference.ids, "{fault:?}: the request after the fault");
        assert_eq!(next.reason, FinishReason::Length);
    }
    e.shutdown(true);
}

#[test]
fn a_fault_fails_only_the_step_it_hits() {
    // Two requests run together; a step fault fails the sequences of that step (both, as they
    // share every step here), while a request submitted after it matches the reference.
    let e = engine(&tiny(), &cfg());
    let a: Vec<u32> = (0..20).map(|i| 7 + (i * 11) % 150).collect();
    let b: Vec<u32> = (0..9).map(|i| 300 + i * 3).collect();
    let ref_a = e.submit(greedy_req(&a, 30)).unwrap().collect_blocking();
    let ref_b = e.submit(greedy_req(&b, 30)).unwrap().collect_blocking();
    let mut sa = e.submit(greedy_req(&a, 30)).unwrap();
    let mut sb = e.submit(greedy_req(&b, 30)).unwrap();
    // Both have streamed a token: they are decoding together.
    let first = |s: &mut torus_wgpu::engine::RequestStream| match s.next_blocking() {
        Some(torus_wgpu::engine::Event::Token { id, .. }) => id,
        e => panic!("expected a token, got {e:?}"),
    };
    let (fa, fb) = (first(&mut sa), first(&mut sb));
    e.inject_fault(Fault::StepPanic);
    let (ra, rb) = (sa.collect_blocking(), sb.collect_blocking());
    for (f, r, full) in [(fa, &ra, &ref_a), (fb, &rb, &ref_b)] {
        assert!(matches!(&r.reason, FinishReason::Error(m) if m.contains("panicked")), "{:?}", r.reason);
        // What was delivered before the fault is a prefix of the right answer.
        let got: Vec<u32> = std::iter::once(f).chain(r.ids.iter().copied()).collect();
        assert!(got.len() < 30 && full.ids.starts_with(&got), "{got:?} vs {:?}", full.ids);
    }
    let again = e.submit(greedy_req(&b, 30)).unwrap().collect_blocking();
    assert_eq!(again.ids, ref_b.ids);
    e.shutdown(true);
}

struct Srv {
    handle: Option<ServerHandle>,
    base: String,
    http: reqwest::Client,
}

impl Srv {
    async fn new() -> Srv {
        let path = tiny();
        let c = cfg();
        let scfg = ServerConfig::new(model_id_for_path(&path), &c);
        let engine = tokio::task::spawn_blocking(move || engine(&path, &c)).await.unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let handle = start(listener, scfg, Some(engine)).unwrap();
        let http = reqwest::Client::builder().no_proxy().build().unwrap();
        Srv { base: format!("http://{}", handle.addr), handle: Some(handle), http }
    }

    fn engine(&self) -> &EngineHandle {
        self.handle.as_ref().unwrap().engine().unwrap()
    }

    async fn complete(&self) -> (StatusCode, Value) {
        let body = json!({"prompt": "one two three", "max_tokens": 6, "temperature": 0, "ignore_eos": true});
        let r = self.http.post(format!("{}/v1/completions", self.base)).json(&body).send().await.unwrap();
        let status = r.status();
        (status, r.json().await.unwrap())
    }

    async fn get(&self, path: &str) -> (StatusCode, String) {
        let r = self.http.get(format!("{}{path}", self.base)).send().await.unwrap();
        let status = r.status();
        (status, r.text().await.unwrap())
    }

    async fn healthy_gauge(&self) -> String {
        let (s, text) = self.get("/metrics").await;
        assert_eq!(s, StatusCode::OK);
        text.lines().find(|l| l.starts_with("torus_engine_healthy ")).expect("torus_engine_healthy").to_string()
    }

    async fn wait_health(&self, want: StatusCode) -> String {
        let t = Instant::now();
        loop {
            let (s, body) = self.get("/health").await;
            if s == want {
                return body;
            }
            assert!(t.elapsed() < Duration::from_secs(10), "/health stays {s} ({body}), expected {want}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn stop(mut self) {
        self.handle.take().unwrap().shutdown().await;
    }
}

/// OpenAI's error shape, with the message containing `part`.
fn assert_error(body: &Value, part: &str) {
    let e = &body["error"];
    assert!(e["message"].as_str().is_some_and(|m| m.contains(part)), "{body}");
    assert!(e["type"].is_string(), "{body}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_step_fault_is_a_500_and_the_next_request_succeeds() {
    let srv = Srv::new().await;
    let (s, good) = srv.complete().await;
    assert_eq!(s, StatusCode::OK, "{good}");
    srv.engine().inject_fault(Fault::StepGpuError);
    let (s, body) = srv.complete().await;
    assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR, "{body}");
    assert_error(&body, "GPU error");
    assert_eq!(body["error"]["type"], "server_error");
    let (s, again) = srv.complete().await;
    assert_eq!(s, StatusCode::OK, "{again}");
    assert_eq!(again["choices"][0]["text"], good["choices"][0]["text"]);
    srv.wait_health(StatusCode::OK).await;
    assert_eq!(srv.healthy_gauge().await, "torus_engine_healthy 1");
    let (_, metrics) = srv.get("/metrics").await;
    assert!(metrics.contains("torus_engine_step_failures_total 1"), "{metrics}");
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_engine_thread_turns_health_to_503() {
    let srv = Srv::new().await;
    srv.wait_health(StatusCode::OK).await;
    assert_eq!(srv.healthy_gauge().await, "torus_engine_healthy 1");
    srv.engine().inject_fault(Fault::EnginePanic);
    let body = srv.wait_health(StatusCode::SERVICE_UNAVAILABLE).await;
    let body: Value = serde_json::from_str(&body).unwrap();
    assert_error(&body, "panicked");
    assert_eq!(body["error"]["code"], "engine_unavailable");
    assert_eq!(srv.healthy_gauge().await, "torus_engine_healthy 0");
    let (s, body) = srv.complete().await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_error(&body, "engine");
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_device_turns_health_to_503() {
    let srv = Srv::new().await;
    srv.wait_health(StatusCode::OK).await;
    srv.engine().inject_fault(Fault::DeviceLost);
    // The request whose step finds the device gone fails with 503 (retry elsewhere).
    let (s, body) = srv.complete().await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_error(&body, "device was lost");
    let body: Value = serde_json::from_str(&srv.wait_health(StatusCode::SERVICE_UNAVAILABLE).await).unwrap();
    assert_error(&body, "device was lost");
    assert_eq!(srv.healthy_gauge().await, "torus_engine_healthy 0");
    let (s, body) = srv.complete().await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    srv.stop().await;
}
