//! `torus-wgpu bench` end to end against a real torus-wgpu server on 127.0.0.1 (tiny-qwen2):
//! every request accounted for, counts right, and the JSON report has the documented fields.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use torus_wgpu::bench::{run_bench, write_json, BenchArgs, Endpoint};
use torus_wgpu::config::EngineConfig;
use torus_wgpu::engine::{load_model, EngineHandle};
use torus_wgpu::gpu::Gpu;
use torus_wgpu::server::{model_id_for_path, start, ServerConfig};

fn tiny() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-qwen2")
}

fn args(base_url: String, endpoint: Endpoint, json_out: PathBuf) -> BenchArgs {
    BenchArgs {
        base_url,
        model: None,
        endpoint,
        num_prompts: 12,
        concurrency: Some(4),
        request_rate: None,
        input_len: 20,
        output_len: 8,
        dataset: None,
        ignore_eos: true,
        seed: 1,
        temperature: 0.0,
        goodput: vec!["ttft:60000".into(), "e2el:120000".into()],
        json_out: Some(json_out),
        tokenizer: Some(tiny()),
        api_key: None,
        timeout: 120.0,
        quiet: true,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_against_a_live_server() {
    let cfg = EngineConfig {
        max_num_batched_tokens: 256,
        max_sequence_length: 256,
        total_cache_size: 16 << 20,
        ..Default::default()
    };
    let c2 = cfg.clone();
    let engine = tokio::task::spawn_blocking(move || {
        let gpu = Arc::new(Gpu::new(None).expect("a wgpu adapter"));
        let (model, tok) = load_model(&tiny(), &c2, gpu, &|_, _| {}).unwrap();
        EngineHandle::start(model, tok, &c2)
    })
    .await
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server = start(listener, ServerConfig::new(model_id_for_path(&tiny()), &cfg), Some(engine)).unwrap();
    let base = format!("http://{}", server.addr);
    let dir = std::env::temp_dir().join(format!("torus-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();

    for endpoint in [Endpoint::Completions, Endpoint::Chat] {
        let json_out = dir.join(format!("{endpoint:?}.json"));
        let a = args(base.clone(), endpoint, json_out.clone());
        let report = run_bench(&a).await.unwrap();
        let s = &report.summary;
        assert_eq!(report.model, "tiny-qwen2");
        assert_eq!(report.records.len(), 12, "every request is accounted for");
        assert_eq!((s.completed, s.failed), (12, 0), "{:?}", report.records.iter().find(|r| !r.success));
        // ignore_eos: exactly output_len tokens each, counted by the server's usage.
        assert!(report.records.iter().all(|r| r.output_tokens == 8), "{:?}", report.records);
        assert_eq!(s.total_output_tokens, 96);
        if endpoint == Endpoint::Completions {
            // Prompts sized with the server's tokenizer: exactly input_len tokens.
            assert!(report.records.iter().all(|r| r.prompt_tokens == 20), "{:?}", report.records[0]);
        }
        for r in &report.records {
            assert!(r.ttft().unwrap() > 0.0 && r.e2el() >= r.ttft().unwrap());
            assert!(!r.chunks.is_empty() && r.chunks.len() <= 8);
        }
        assert!(s.ttft_ms.mean > 0.0 && s.e2el_ms.p99 >= s.e2el_ms.median);
        assert!(s.goodput.unwrap() > 0.0);
        // The JSON report parses and carries settings, summary and records.
        write_json(&report, &json_out).unwrap();
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json_out).unwrap()).unwrap();
        for key in [
            "completed",
            "failed",
            "duration_s",
            "request_throughput",
            "output_throughput",
            "total_token_throughput",
            "goodput",
            "ttft_ms",
            "tpot_ms",
            "itl_ms",
            "e2el_ms",
        ] {
            assert!(v["summary"].get(key).is_some(), "summary.{key} missing");
        }
        for key in ["mean", "median", "p90", "p95", "p99"] {
            assert!(v["summary"]["ttft_ms"][key].is_number(), "ttft_ms.{key}");
        }
        assert_eq!(v["settings"]["num_prompts"], 12);
        assert_eq!(v["records"].as_array().unwrap().len(), 12);
        assert!(v["settings"].get("api_key").is_none(), "the API key is never written out");
    }

    // A server that refuses every request: failures are counted, the run does not crash.
    let mut a = args(base.clone(), Endpoint::Chat, dir.join("bad.json"));
    a.model = Some("no-such-model".into());
    let report = run_bench(&a).await.unwrap();
    assert_eq!((report.summary.completed, report.summary.failed), (0, 12));
    assert!(report.records.iter().all(|r| r.error.as_deref().unwrap_or("").contains("404")));
    server.shutdown().await;
}
