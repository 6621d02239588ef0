//! Embeddings (`--task embed`): `/v1/embeddings` on a tiny random Qwen3 against transformers'
//! pooled `last_hidden_state` (tests/fixtures/tiny-qwen3-embeddings.json, made by
//! scripts/fixtures/gen_embedding_reference.py) for last-token, mean and first-token pooling;
//! batched == one by one, prefix cache hits change nothing, `base64` and `dimensions`, the text
//! path, Ollama's `/api/embed` and `/api/embeddings`, generation beside embeddings, and the
//! errors (a server without `--task embed` says how to get embeddings).

mod common;

use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use torus_wgpu::config::EngineConfig;
use torus_wgpu::engine::{EngineHandle, Pooling};
use torus_wgpu::server::{start, ServerConfig, ServerHandle};

fn model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-qwen3")
}

fn reference() -> Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-qwen3-embeddings.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn cfg() -> EngineConfig {
    EngineConfig {
        max_num_batched_tokens: 8,
        max_sequence_length: 256,
        total_cache_size: 8 << 20,
        max_decode_batch_size: 8,
        max_prefill_batch_size: 4,
        ..Default::default()
    }
}

async fn serve(engine: &EngineHandle, pooling: Pooling) -> ServerHandle {
    let mut s = ServerConfig::new("tiny-qwen3", &cfg());
    s.pooling = pooling;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    start(listener, s, Some(engine.clone())).unwrap()
}

async fn post(srv: &ServerHandle, path: &str, body: Value) -> (u16, Value) {
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let r = http.post(format!("http://{}{path}", srv.addr)).json(&body).send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let worst = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(worst < 2e-4, "{what}: max difference {worst} from the reference\n got {got:?}\nwant {want:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_match_transformers_for_every_pooling() {
    let reference = reference();
    let cases = reference["cases"].as_array().unwrap();
    // Small steps (8 tokens): the longer inputs are computed in several chunks.
    let engine = common::start_engine_async(&model(), &cfg()).await;

    // Without --task embed: a clear 400.
    let plain = serve(&engine, Pooling::Last).await;
    let (status, v) = post(&plain, "/v1/embeddings", json!({"input": "hi"})).await;
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("--task embed"), "{v}");
    // ... after reading the body: a 3 MB one gets the same answer, not a connection reset.
    let big: Vec<String> = (0..200).map(|i| format!("{i} {}", "word ".repeat(3000))).collect();
    let (status, v) = post(&plain, "/v1/embeddings", json!({"input": big})).await;
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("--task embed"), "{v}");
    // (Servers sharing the engine stay up until the end: shutting one down stops the engine.)
    let mut servers = vec![plain];

    assert_eq!(engine.enable_embeddings(), Ok(64));
    for (pooling, key) in [(Pooling::Last, "last"), (Pooling::Mean, "mean"), (Pooling::Cls, "cls")] {
        let srv = serve(&engine, pooling).await;
        let inputs: Vec<Value> = cases.iter().map(|c| c["ids"].clone()).collect();
        // Twice over in one request: the second copies meet the first ones' cached blocks.
        let twice: Vec<Value> = inputs.iter().chain(inputs.iter()).cloned().collect();
        let (status, v) = post(&srv, "/v1/embeddings", json!({"input": twice, "model": "tiny-qwen3"})).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["object"], "list");
        let data = v["data"].as_array().unwrap();
        assert_eq!(data.len(), 2 * cases.len());
        for (i, d) in data.iter().enumerate() {
            assert_eq!((d["index"].as_u64(), &d["object"]), (Some(i as u64), &json!("embedding")));
            let c = &cases[i % cases.len()];
            assert_close(&floats(&d["embedding"]), &floats(&c[key]), &format!("{key} pooling, input {i}"));
        }
        let tokens: usize = cases.iter().map(|c| c["ids"].as_array().unwrap().len()).sum();
        assert_eq!(v["usage"]["prompt_tokens"], 2 * tokens, "{v}");
        // One at a time == batched; and a later request, after the cache holds its blocks.
        for c in cases {
            let (_, one) = post(&srv, "/v1/embeddings", json!({"input": c["ids"].clone()})).await;
            assert_close(&floats(&one["data"][0]["embedding"]), &floats(&c[key]), &format!("{key} alone"));
        }
        servers.push(srv);
    }

    let srv = serve(&engine, Pooling::Last).await;
    // The text path tokenizes as the fixture's tokenizer does.
    let text_case = cases.iter().find(|c| c["ids"] == reference["text_ids"]).unwrap();
    let (_, v) = post(&srv, "/v1/embeddings", json!({"input": reference["text"].clone()})).await;
    assert_eq!(v["usage"]["prompt_tokens"], reference["text_ids"].as_array().unwrap().len(), "{v}");
    assert_close(&floats(&v["data"][0]["embedding"]), &floats(&text_case["last"]), "text input");
    // base64: little-endian f32; dimensions: the first N, normalised again.
    let ids = cases[0]["ids"].clone();
    let (_, b) = post(&srv, "/v1/embeddings", json!({"input": [ids.clone()], "encoding_format": "base64"})).await;
    let bytes = base64_decode(b["data"][0]["embedding"].as_str().unwrap());
    let decoded: Vec<f32> = bytes.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert_close(&decoded, &floats(&cases[0]["last"]), "base64");
    let (_, d) = post(&srv, "/v1/embeddings", json!({"input": [ids.clone()], "dimensions": 16})).await;
    let full = floats(&cases[0]["last"]);
    let n = full[..16].iter().map(|x| x * x).sum::<f32>().sqrt();
    let want: Vec<f32> = full[..16].iter().map(|x| x / n).collect();
    assert_close(&floats(&d["data"][0]["embedding"]), &want, "dimensions 16");
    // Ollama's routes.
    let (s, o) =
        post(&srv, "/api/embed", json!({"model": "tiny-qwen3:latest", "input": [reference["text"].clone()]})).await;
    assert_eq!(s, 200, "{o}");
    assert_close(&floats(&o["embeddings"][0]), &floats(&text_case["last"]), "/api/embed");
    let (s, o) =
        post(&srv, "/api/embeddings", json!({"model": "tiny-qwen3", "prompt": reference["text"].clone()})).await;
    assert_eq!(s, 200, "{o}");
    assert_close(&floats(&o["embedding"]), &floats(&text_case["last"]), "/api/embeddings");
    // A text longer than the context: Ollama's /api/embed cuts it to the context (`truncate`
    // defaults to true), as the embedding of its first 255 tokens; refused with `truncate:
    // false` and on OpenAI's route.
    let long = "the quick brown fox jumps over the lazy dog ".repeat(60);
    let (s, o) = post(&srv, "/api/embed", json!({"input": long})).await;
    assert_eq!((s, o["prompt_eval_count"].as_u64()), (200, Some(255)), "{o}");
    let (_, t) = post(&srv, "/tokenize", json!({"prompt": long})).await;
    let ids: Vec<Value> = t["tokens"].as_array().unwrap_or_else(|| panic!("{t}"))[..255].to_vec();
    let (_, v) = post(&srv, "/v1/embeddings", json!({"input": [ids]})).await;
    assert_close(&floats(&o["embeddings"][0]), &floats(&v["data"][0]["embedding"]), "truncated");
    for (path, body) in
        [("/api/embed", json!({"input": long, "truncate": false})), ("/v1/embeddings", json!({"input": long}))]
    {
        let (s, e) = post(&srv, path, body).await;
        assert_eq!(s, 400, "{path}: {e}");
    }
    // Generation goes on beside embeddings.
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": true});
    let (s, c) = post(&srv, "/v1/chat/completions", chat).await;
    assert_eq!((s, c["usage"]["completion_tokens"].as_u64()), (200, Some(4)), "{c}");
    // Bad requests name their field.
    for (body, param) in [
        (json!({"input": "x", "dimensions": 0}), "dimensions"),
        (json!({"input": "x", "dimensions": 65}), "dimensions"),
        (json!({"input": "x", "encoding_format": "hex"}), "encoding_format"),
        (json!({"input": []}), "input"),
        (json!({"input": ""}), "input"),
        (json!({"input": [[600]]}), "input"),
        (json!({}), "input"),
    ] {
        let (s, e) = post(&srv, "/v1/embeddings", body.clone()).await;
        assert_eq!(s, 400, "{body}: {e}");
        assert_eq!(e["error"]["param"], param, "{body}: {e}");
    }
    let (s, _) = post(&srv, "/v1/embeddings", json!({"input": "x", "model": "other"})).await;
    assert_eq!(s, 404);
    drop(servers);
    srv.shutdown().await;
}

fn base64_decode(s: &str) -> Vec<u8> {
    let val = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => panic!("not base64: {c}"),
    } as u32;
    let mut out = Vec::new();
    for chunk in s.as_bytes().chunks(4) {
        let pad = chunk.iter().filter(|&&c| c == b'=').count();
        let n = chunk.iter().filter(|&&c| c != b'=').fold(0u32, |n, &c| n << 6 | val(c)) << (6 * pad);
        out.extend_from_slice(&n.to_be_bytes()[1..4 - pad]);
    }
    out
}
