//! Gemma 3 end to end: the 270M base model, Q4_K_M (tensor types Q8_0 embedding, Q5_0, Q4_K,
//! Q6_K, F32 norms), against an independent float32 reference (numpy over the gguf package's
//! dequantized weights, tokenized by transformers' GemmaTokenizer from the same file):
//! tests/fixtures/gemma3-270m-reference.json, made by scripts/fixtures/gemma3_reference.py.
//! Its prompts include one of 869 tokens, so the 512-token window of the local layers (and the
//! global layers' reach past it) decides the logits. The model is fetched by scripts/setup.sh.

use crate::common::{floats, ids, logits_steps};
use serde_json::{json, Value};
use std::sync::Arc;
use torus_wgpu::config::{EngineConfig, KernelProfile, KvDtype};
use torus_wgpu::engine::load_model;
use torus_wgpu::gpu::Gpu;
use torus_wgpu::model::config::Arch;
use torus_wgpu::model::Model;
use torus_wgpu::tokenizer::{ChatMessage, Tokenizer};

fn reference() -> Value {
    let p = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/gemma3-270m-reference.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn config(kv: KvDtype, profile: KernelProfile) -> EngineConfig {
    EngineConfig {
        max_num_batched_tokens: 1024,
        max_sequence_length: 1024,
        total_cache_size: 64 << 20,
        kv_cache_dtype: kv,
        kernel_profile: profile,
        ..Default::default()
    }
}

fn load(kv: KvDtype, profile: KernelProfile) -> (Model, Tokenizer) {
    let gpu = Arc::new(Gpu::new(None).expect("a wgpu adapter (lavapipe in CI)"));
    load_model(&crate::common::gemma3_270m(), &config(kv, profile), gpu, &|_, _| {}).unwrap()
}

/// The prompts a profile is checked on: all, or for the gpu profile those under 100 tokens (it
/// is slower on lavapipe, and its attention kernels still loop over the head inside their key
/// loops, which llvmpipe's 65535-iteration loop limit cuts short past ~500 keys at head_dim
/// 256; real GPUs have no such limit).
fn prompts(reference: &Value, profile: KernelProfile) -> Vec<&Value> {
    let all = reference["prompts"].as_array().unwrap().iter();
    all.filter(|p| profile != KernelProfile::Gpu || p["input_ids"].as_array().unwrap().len() < 100).collect()
}

/// Per prompt: per-step logits under teacher forcing (the gpu profile: prefill and 5 steps).
fn run_prompts(kv: KvDtype, profile: KernelProfile) -> (Value, Vec<Vec<Vec<f32>>>) {
    let reference = reference();
    let (mut model, tok) = load(kv, profile);
    let c = &model.cfg;
    assert_eq!((c.arch, c.sliding_window, c.uniform_window()), (Arch::Gemma3, Some(512), None));
    let mut all = Vec::new();
    for p in prompts(&reference, profile) {
        let name = p["name"].as_str().unwrap();
        let input = ids(&p["input_ids"]);
        // Our SentencePiece tokenizer from the GGUF against transformers' conversion of it.
        assert_eq!(tok.encode(p["text"].as_str().unwrap()).unwrap(), input, "{name}: tokenization");
        let greedy = ids(&p["greedy_ids"]);
        let steps = if profile == KernelProfile::Gpu { 5 } else { greedy.len() - 1 };
        all.push(logits_steps(&mut model, &input, &greedy[..steps]));
    }
    (reference, all)
}

fn top5_logits_match(profile: KernelProfile, tol: f32) {
    let (reference, logits) = run_prompts(KvDtype::F32, profile);
    let mut worst = 0f32;
    let checked = prompts(&reference, profile);
    assert!(
        checked.len() >= 3 && (profile == KernelProfile::Gpu || checked.len() == 5),
        "{profile:?}: {} prompts checked",
        checked.len()
    );
    for (p, steps) in checked.into_iter().zip(&logits) {
        let name = p["name"].as_str().unwrap();
        let top5 = p["top5"].as_array().unwrap();
        assert!(steps.len() >= 6 && steps.len() <= top5.len(), "{name}: {} steps", steps.len());
        for (s, (row, want)) in steps.iter().zip(top5).enumerate() {
            for (id, w) in ids(&want["ids"]).iter().zip(floats(&want["logits"])) {
                let got = row[*id as usize];
                worst = worst.max((got - w).abs());
                assert!((got - w).abs() < tol, "{name} step {s} token {id}: logit {got}, reference {w}");
            }
        }
    }
    eprintln!("{profile:?}: max |logit - reference| over every step's top-5: {worst}");
}

/// With an f32 KV cache, every step's top-5 logits of all five prompts (16 steps each) agree
/// with the reference.
#[test]
fn top5_logits_match_reference_with_f32_kv_cache() {
    top5_logits_match(KernelProfile::Auto, 2e-3);
}

/// The gpu kernel profile (forced on lavapipe) against the same reference.
#[test]
fn gpu_profile_top5_logits_match_reference() {
    top5_logits_match(KernelProfile::Gpu, 2e-3);
}

/// With the default f16 KV cache, the greedy token of every step whose reference top-1/top-2
/// margin exceeds 0.1 is the reference's.
#[test]
fn greedy_tokens_match_reference_with_f16_kv_cache() {
    let (reference, logits) = run_prompts(KvDtype::F16, KernelProfile::Auto);
    let (mut compared, mut worst) = (0, 0f32);
    for (p, steps) in prompts(&reference, KernelProfile::Auto).into_iter().zip(&logits) {
        let name = p["name"].as_str().unwrap();
        let want = ids(&p["greedy_ids"]);
        let margins = floats(&p["argmax_margins"]);
        let top5 = p["top5"].as_array().unwrap();
        for (s, row) in steps.iter().enumerate() {
            for (id, w) in ids(&top5[s]["ids"]).iter().zip(floats(&top5[s]["logits"])) {
                worst = worst.max((row[*id as usize] - w).abs());
            }
            if margins[s] <= 0.1 {
                continue;
            }
            let argmax = (0..row.len()).fold(0, |b, i| if row[i] > row[b] { i } else { b });
            assert_eq!(argmax as u32, want[s], "{name} step {s}: greedy token (reference margin {})", margins[s]);
            compared += 1;
        }
    }
    eprintln!("{compared} greedy tokens compared; max |logit - reference| (f16 KV cache): {worst}");
    assert!(compared >= 50, "only {compared} steps had a margin above 0.1");
}

/// The file has no chat template: the built-in Gemma turn format renders the reference's chat
/// prompt (llama.cpp's `gemma` template), folds a system message into the first user turn, and
/// `<end_of_turn>` ends generation.
#[test]
fn builtin_turn_template_and_end_of_turn() {
    let reference = reference();
    let tok = Tokenizer::from_path(&crate::common::gemma3_270m()).unwrap();
    assert_eq!(tok.builtin_template(), Some("gemma"));
    let chat = reference["prompts"].as_array().unwrap().iter().find(|p| p["name"] == "chat").unwrap();
    let text = tok.apply_chat_template(&[ChatMessage::new("user", "What is the capital of France?")], true).unwrap();
    assert_eq!(text, chat["text"].as_str().unwrap());
    let msgs = [
        ChatMessage::new("system", " Be brief. "),
        ChatMessage::new("user", "Hi"),
        ChatMessage::new("assistant", "Hello!"),
        ChatMessage::new("user", "Bye"),
    ];
    assert_eq!(
        tok.apply_chat_template(&msgs, true).unwrap(),
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n\
         <start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    );
    let eot = tok.encode_raw("<end_of_turn>").unwrap();
    assert_eq!(eot, [106]);
    assert!(tok.eos_token_ids().contains(&106) && tok.eos_token_ids().contains(&1), "{:?}", tok.eos_token_ids());
}

/// `torus-wgpu serve` answers a chat request with the reference's greedy tokens (the chat
/// prompt's 16 steps all have a margin above 0.4), and says at start-up that it uses the
/// built-in template.
#[test]
fn serves_chat_with_the_reference_greedy_tokens() {
    let reference = reference();
    let chat = reference["prompts"].as_array().unwrap().iter().find(|p| p["name"] == "chat").unwrap();
    assert!(floats(&chat["argmax_margins"]).iter().all(|&m| m > 0.4));
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let model = crate::common::gemma3_270m();
    let (mut child, log, _rx) = crate::common::spawn_until_ready(
        std::process::Command::new(env!("CARGO_BIN_EXE_torus-wgpu")).args([
            "serve",
            "--model",
            model.to_str().unwrap(),
            "--port",
            &port.to_string(),
            "--max-sequence-length",
            "1024",
            "--served-model-name",
            "gemma3",
        ]),
        "serve",
        "ready on",
        std::time::Duration::from_secs(300),
    );
    assert!(log.iter().any(|l| l.contains("built-in 'gemma' turn format")), "{log:?}");
    let body = json!({
        "model": "gemma3",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 16,
        "temperature": 0,
    });
    let resp = ureq_post(&format!("http://127.0.0.1:{port}/v1/chat/completions"), &body);
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(resp["usage"]["prompt_tokens"], chat["n_input"], "{resp}");
    assert_eq!(resp["usage"]["completion_tokens"], 16, "{resp}");
    assert_eq!(resp["choices"][0]["message"]["content"], chat["greedy_text"], "{resp}");
}

/// A blocking JSON POST over a plain TCP connection (HTTP/1.1, Connection: close).
fn ureq_post(url: &str, body: &Value) -> Value {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://").unwrap();
    let (host, path) = rest.split_at(rest.find('/').unwrap());
    let mut s = std::net::TcpStream::connect(host).unwrap();
    let b = body.to_string();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{b}",
        b.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}\n{body}");
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"))
}
