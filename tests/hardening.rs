//! Hostile clients and model files against the real binary (issue: no single request, peer or
//! model file can crash, starve or exhaust the server): deep grammars, bodies that would
//! amplify in memory, cross-site content types, slow peers, a looping chat template, SIGTERM,
//! and head-of-line admission. After each attack the server still answers and its engine is
//! idle with every KV block free.

mod common;
use common::{greedy_req, smollm2, spawn_until_ready, tiny};

use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

/// A `torus-wgpu serve` process on port 0.
struct Server {
    child: Child,
    addr: String,
    lines: Receiver<String>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(model: &std::path::Path, extra: &[&str]) -> Server {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_torus-wgpu"));
    cmd.env_remove("RUST_LOG").args(["serve", "--port", "0", "--model"]).arg(model).args(extra);
    let (child, log, lines) = spawn_until_ready(&mut cmd, "serve", "ready on http://", Duration::from_secs(180));
    let addr =
        log.last().unwrap().split("ready on http://").nth(1).unwrap().split_whitespace().next().unwrap().to_string();
    Server { child, addr, lines }
}

/// One HTTP/1.1 exchange on a fresh connection: (status, body).
fn http(addr: &str, method: &str, path: &str, content_type: Option<&str>, body: &[u8]) -> (u16, String) {
    let ct = content_type.map(|c| format!("Content-Type: {c}\r\n")).unwrap_or_default();
    exchange(addr, &format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\n{ct}"), body)
}

/// A POST with one extra header line and no Content-Type.
fn http_with(addr: &str, path: &str, header_line: &str, body: &[u8]) -> (u16, String) {
    exchange(addr, &format!("POST {path} HTTP/1.1\r\nHost: localhost\r\n{header_line}\r\n"), body)
}

/// Sends `head` (request line and headers so far), the length, `body`; the status and body.
fn exchange(addr: &str, head: &str, body: &[u8]) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let head = format!("{head}Content-Length: {}\r\nConnection: close\r\n\r\n", body.len());
    s.write_all(head.as_bytes()).unwrap();
    // The server may answer (and close) before the whole body is sent.
    let _ = s.write_all(body);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    // Chunked bodies (not used by these JSON answers, but be safe): keep the raw text.
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    (status, body)
}

fn post_json(addr: &str, path: &str, body: &[u8]) -> (u16, Value) {
    let (status, text) = http(addr, "POST", path, Some("application/json"), body);
    let v =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {status} with a non-JSON body {text:?}: {e}"));
    (status, v)
}

fn health_ok(s: &mut Server) {
    assert!(s.child.try_wait().unwrap().is_none(), "the server exited");
    let (status, body) = http(&s.addr, "GET", "/health", None, b"");
    assert_eq!(status, 200, "/health: {body}");
}

/// Waits until /metrics says the engine is idle with every block free.
fn wait_idle(addr: &str) {
    let t = Instant::now();
    loop {
        let (_, m) = http(addr, "GET", "/metrics", None, b"");
        let get = |name: &str| {
            m.lines()
                .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
                .and_then(|l| l.rsplit(' ').next())
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(-1.0)
        };
        if get("torus_num_requests_running") == 0.0
            && get("torus_num_requests_waiting") == 0.0
            && get("torus_kv_cache_blocks_used") == 0.0
        {
            return;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "the engine never went idle:\n{m}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn status_kib(pid: u32, key: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = s.lines().find(|l| l.starts_with(key)).unwrap_or_else(|| panic!("no {key} in /proc/{pid}/status"));
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Peak RSS growth (bytes) of `pid` while `f` runs: the peak is reset first (clear_refs 5).
fn peak_growth(pid: u32, f: impl FnOnce()) -> u64 {
    let before = status_kib(pid, "VmRSS:");
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").expect("reset the peak RSS (Linux clear_refs)");
    f();
    (status_kib(pid, "VmHWM:").saturating_sub(before)) << 10
}

fn ref_chain(n: usize) -> Value {
    let mut defs = serde_json::Map::new();
    for i in 0..n {
        defs.insert(format!("a{i}"), json!({"$ref": format!("#/$defs/a{}", i + 1)}));
    }
    defs.insert(format!("a{n}"), json!({"type": "integer"}));
    json!({"$ref": "#/$defs/a0", "$defs": defs})
}

fn lark_chain(n: usize) -> String {
    let rules: Vec<String> = (0..n).map(|i| format!("r{i}: r{}", i + 1)).collect();
    format!("start: r0\n{}\nr{n}: \"x\"\n", rules.join("\n"))
}

/// Every way a request names a grammar, with a chain `n` deep: (field the 400 names, body).
fn deep_bodies(n: usize) -> Vec<(&'static str, Value)> {
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let tool = json!([{"type": "function", "function": {"name": "f", "parameters": ref_chain(n)}}]);
    vec![
        (
            "response_format",
            json!({"messages": msgs, "max_tokens": 3,
                   "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ref_chain(n)}}}),
        ),
        (
            "structured_outputs",
            json!({"messages": msgs, "max_tokens": 3, "structured_outputs": {"json": ref_chain(n)}}),
        ),
        (
            "structured_outputs",
            json!({"messages": msgs, "max_tokens": 3, "structured_outputs": {"grammar": lark_chain(n)}}),
        ),
        ("guided_json", json!({"messages": msgs, "max_tokens": 3, "guided_json": ref_chain(n)})),
        ("guided_grammar", json!({"prompt": "hi", "max_tokens": 3, "guided_grammar": lark_chain(n)})),
        ("tools", json!({"messages": msgs, "max_tokens": 3, "tools": tool, "tool_choice": "required"})),
    ]
}

/// Deep grammars, amplifying bodies, content types and the context limit, against the default
/// model (SmolLM2) served by the binary.
#[test]
fn hostile_requests_against_the_binary() {
    // An 8 MiB KV cache: 22 blocks of 16 tokens, fewer than max_sequence_length (2048).
    let mut srv = serve(&smollm2(), &["--total-cache-size", "8388608"]);
    let addr = srv.addr.clone();
    let pid = srv.child.id();
    let mut errors: Vec<String> = Vec::new();

    // 1. Grammars 1k and 10k deep on every path: a 400 naming the field and the bound; 300
    // deep still compiles and runs.
    for n in [1_000, 10_000] {
        for (param, body) in deep_bodies(n) {
            let path = if body.get("prompt").is_some() { "/v1/completions" } else { "/v1/chat/completions" };
            let (status, v) = post_json(&addr, path, body.to_string().as_bytes());
            assert_eq!(status, 400, "{n} deep via {param}: {v}");
            assert_eq!(v["error"]["param"], param, "{v}");
            assert!(v["error"]["message"].as_str().unwrap().contains("512"), "the bound is named: {v}");
            errors.push(v.to_string());
        }
        health_ok(&mut srv);
    }
    // Just under the bound: compiled on the compiler's thread, masks computed on the engine's.
    for (param, body) in deep_bodies(500).into_iter().filter(|(p, _)| *p != "tools") {
        let path = if body.get("prompt").is_some() { "/v1/completions" } else { "/v1/chat/completions" };
        let (status, v) = post_json(&addr, path, body.to_string().as_bytes());
        assert_eq!(status, 200, "500 deep via {param}: {v}");
    }

    // 2. Cross-site content types: 415 on every POST route, in OpenAI's error shape; no type at
    // all only from a browser (an Origin header).
    for path in ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"] {
        for ct in [
            Some("text/plain"),
            Some("application/x-www-form-urlencoded"),
            Some("multipart/form-data; boundary=x"),
            Some("Origin: http://evil.example"),
        ] {
            let body = br#"{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}"#;
            let (status, text) = match ct {
                Some(origin) if origin.starts_with("Origin:") => http_with(&addr, path, origin, body),
                _ => http(&addr, "POST", path, ct, body),
            };
            assert_eq!(status, 415, "{path} {ct:?}: {text}");
            let v: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(v["error"]["code"], "unsupported_media_type", "{v}");
            assert!(v["error"]["type"].is_string() && v["error"].get("param").is_some(), "{v}");
        }
    }

    // 3. 4 MiB bodies that would amplify: each costs at most 10x its size at its peak; six at
    // once at most 300 MB; the memory comes back.
    let lim = 4 << 20;
    let join = |parts: Vec<&str>| parts.join(",");
    let hostile: Vec<(&str, &str, Vec<u8>)> = vec![
        (
            "one-id prompts",
            "/v1/completions",
            format!("{{\"max_tokens\":1,\"prompt\":[{}]}}", join(vec!["[1]"; (lim - 40) / 4])).into_bytes(),
        ),
        (
            "a flat id list",
            "/v1/completions",
            format!("{{\"max_tokens\":1,\"prompt\":[{}]}}", join(vec!["1"; (lim - 40) / 2])).into_bytes(),
        ),
        (
            "short words to /tokenize",
            "/tokenize",
            json!({"prompt": "a ".repeat((lim - 40) / 2)}).to_string().into_bytes(),
        ),
        (
            "short words as a prompt",
            "/v1/completions",
            json!({"prompt": "ab ".repeat((lim - 40) / 3), "max_tokens": 1}).to_string().into_bytes(),
        ),
        (
            "many empty messages",
            "/v1/chat/completions",
            format!(
                "{{\"max_tokens\":1,\"messages\":[{}]}}",
                join(vec!["{\"role\":\"user\",\"content\":\"\"}"; (lim - 60) / 32])
            )
            .into_bytes(),
        ),
        (
            "one long message",
            "/v1/chat/completions",
            json!({"max_tokens": 1, "messages": [{"role": "user", "content": "ab ".repeat((lim - 80) / 3)}]})
                .to_string()
                .into_bytes(),
        ),
        (
            "many tiny values",
            "/v1/chat/completions",
            format!(
                "{{\"max_tokens\":1,\"messages\":[{{\"role\":\"user\",\"content\":\"x\"}}],\"x\":[{}]}}",
                join(vec!["1"; (lim - 80) / 2])
            )
            .into_bytes(),
        ),
        (
            "ids to /detokenize",
            "/detokenize",
            format!("{{\"tokens\":[{}]}}", join(vec!["1"; (lim - 20) / 2])).into_bytes(),
        ),
        (
            "values inside a string",
            "/v1/chat/completions",
            format!(
                "{{\"max_tokens\":1,\"messages\":[{{\"role\":\"user\",\"content\":\"x\"}}],\"structured_outputs\":{{\"json\":\"[{}]\"}}}}",
                join(vec!["1"; (lim - 120) / 2])
            )
            .into_bytes(),
        ),
    ];
    let rss0 = status_kib(pid, "VmRSS:") << 10;
    for (what, path, body) in &hostile {
        assert!(body.len() <= lim, "{what}: {} bytes", body.len());
        let mut answer = (0, Value::Null);
        let grew = peak_growth(pid, || answer = post_json(&addr, path, body));
        let (status, v) = answer;
        assert_eq!(status, 400, "{what}: {v}");
        errors.push(v.to_string());
        eprintln!(
            "{what}: {} KiB body, peak +{:.1} MiB, {}",
            body.len() >> 10,
            grew as f64 / 1048576.0,
            v["error"]["message"]
        );
        assert!(grew <= 10 * body.len() as u64, "{what}: the peak grew by {grew} bytes for a {}-byte body", body.len());
    }
    for (what, path, body) in hostile.iter().filter(|h| {
        ["one-id prompts", "short words to /tokenize", "many empty messages", "one long message"].contains(&h.0)
    }) {
        let grew = peak_growth(pid, || {
            std::thread::scope(|s| {
                let hs: Vec<_> = (0..6).map(|_| s.spawn(|| post_json(&addr, path, body).0)).collect();
                for h in hs {
                    assert_eq!(h.join().unwrap(), 400, "{what}");
                }
            })
        });
        eprintln!("6 x {what} at once: peak +{:.1} MiB", grew as f64 / 1048576.0);
        assert!(grew <= 300 << 20, "6 x {what}: the peak grew by {grew} bytes");
    }
    let rss1 = status_kib(pid, "VmRSS:") << 10;
    eprintln!("RSS {:.1} MiB before the bodies, {:.1} MiB after", rss0 as f64 / 1048576.0, rss1 as f64 / 1048576.0);
    assert!(rss1 <= rss0 + (64 << 20), "memory did not come back: {rss0} -> {rss1} bytes");
    health_ok(&mut srv);

    // 4. max_model_len is what requests are held to: the KV cache's 352 tokens here.
    let (_, models) = http(&addr, "GET", "/v1/models", None, b"");
    let models: Value = serde_json::from_str(&models).unwrap();
    let ctx = models["data"][0]["max_model_len"].as_u64().unwrap() as usize;
    assert_eq!(ctx, 352, "{models}");
    let ids = |n: usize| json!(vec![1; n]);
    let (status, v) =
        post_json(&addr, "/v1/completions", json!({"prompt": ids(ctx - 1), "max_tokens": 1}).to_string().as_bytes());
    assert_eq!(status, 200, "a prompt of max_model_len - 1 tokens: {v}");
    for body in [json!({"prompt": ids(ctx), "max_tokens": 1}), json!({"prompt": ids(ctx - 1), "max_tokens": 2})] {
        let (status, v) = post_json(&addr, "/v1/completions", body.to_string().as_bytes());
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
        errors.push(v.to_string());
    }

    // No error names a file of this machine.
    let model = smollm2();
    for e in &errors {
        assert!(!e.contains(".gguf") && !e.contains(model.parent().unwrap().to_str().unwrap()), "{e}");
    }
    wait_idle(&addr);
    health_ok(&mut srv);
}

/// Peers that drip their headers or bodies hold every connection place; probes are still
/// answered within 2 s, bodies that do not arrive end with 408, and one address cannot take
/// more than its share.
#[test]
fn slow_peers_do_not_block_probes() {
    let mut srv = serve(
        &tiny(),
        &[
            "--total-cache-size",
            "8388608",
            "--max-connections",
            "16",
            "--max-connections-per-peer",
            "8",
            "--header-read-timeout-s",
            "30",
            "--body-read-timeout-s",
            "3",
        ],
    );
    let addr: std::net::SocketAddr = srv.addr.parse().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    // From 127.0.0.2 and 127.0.0.3 (loopback too): 8 each.
    let from = |ip: &str| {
        let ip: std::net::IpAddr = ip.parse().unwrap();
        rt.block_on(async move {
            let s = tokio::net::TcpSocket::new_v4().unwrap();
            s.bind((ip, 0).into()).unwrap();
            s.connect(addr).await.unwrap().into_std().unwrap()
        })
    };
    let timed_probe = |path: &str| {
        let t = Instant::now();
        let (status, body) = http(&srv.addr, "GET", path, None, b"");
        (status, body, t.elapsed())
    };
    for (what, head) in [
        ("headers", &b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nX-Slow: "[..]),
        (
            "a body",
            &b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{"[..],
        ),
    ] {
        let mut slow: Vec<TcpStream> = (0..8).map(|_| from("127.0.0.2")).collect();
        // A ninth connection from a full address: 429 at once.
        let mut ninth = from("127.0.0.2");
        ninth.set_nonblocking(false).unwrap();
        ninth.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut got = String::new();
        let _ = ninth.read_to_string(&mut got);
        assert!(got.starts_with("HTTP/1.1 429"), "{got}");
        slow.extend((0..8).map(|_| from("127.0.0.3")));
        for s in &mut slow {
            s.set_nonblocking(false).unwrap();
            s.write_all(head).unwrap();
        }
        // Keep dripping while the probes are sent.
        let t = Instant::now();
        while srv_connections(&srv.addr) < 16 {
            assert!(t.elapsed() < Duration::from_secs(10), "the slow peers were not all accepted");
        }
        for path in ["/health", "/metrics", "/version"] {
            for s in &mut slow {
                let _ = s.write_all(b"x");
            }
            let (status, body, took) = timed_probe(path);
            assert_eq!(status, 200, "{path} while slow peers send {what}: {body}");
            assert!(took < Duration::from_secs(2), "{path} took {took:?} while slow peers send {what}");
        }
        // Anything else waits for a place: 503 from the probe lane, at once.
        let (status, body, took) = timed_probe("/v1/models");
        assert_eq!(status, 503, "{body}");
        assert!(body.contains("too_many_connections") && took < Duration::from_secs(2), "{body}");
        if what == "a body" {
            // The body read timeout (3 s) answers 408 and closes them.
            for s in &mut slow {
                s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
                let mut got = Vec::new();
                let _ = s.read_to_end(&mut got);
                let got = String::from_utf8_lossy(&got);
                assert!(got.starts_with("HTTP/1.1 408"), "{got}");
            }
        }
        drop(slow);
        let t = Instant::now();
        while srv_connections(&srv.addr) > 1 {
            assert!(t.elapsed() < Duration::from_secs(30), "slow connections left open");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let (status, v) = post_json(
        &srv.addr,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).to_string().as_bytes(),
    );
    assert_eq!(status, 200, "{v}");
    let (_, m) = http(&srv.addr, "GET", "/metrics", None, b"");
    assert!(m.lines().any(|l| l.starts_with("torus_http_connections_refused_total ") && !l.ends_with(" 0")), "{m}");
    wait_idle(&srv.addr);
    health_ok(&mut srv);
}

/// Open connections as /metrics reports them (this probe's own included).
fn srv_connections(addr: &str) -> u64 {
    let (_, m) = http(addr, "GET", "/metrics", None, b"");
    m.lines()
        .find(|l| l.starts_with("torus_http_connections "))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// A model file whose chat template loops: the request ends on its own time limit (or the
/// template's fuel), the error names no file, the server stays up, and SIGTERM with renders
/// still running exits within 10 s.
#[test]
fn looping_template_ends_on_time_and_sigterm_exits() {
    let dir = std::env::temp_dir().join(format!("torus-loop-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let template = dir.join("loop.jinja");
    std::fs::write(&template, "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
        .unwrap();
    let model = dir.join("loop.gguf");
    let st = Command::new(env!("CARGO_BIN_EXE_torus-wgpu"))
        .args(["synth-model", "--shape", "smollm2-135m", "--layers", "1", "--format", "q8_0", "--chat-template"])
        .arg(&template)
        .arg("--out")
        .arg(&model)
        .status()
        .unwrap();
    assert!(st.success());
    let mut srv = serve(&model, &["--total-cache-size", "8388608", "--request-timeout-s", "60"]);
    let chat = |timeout: f64| {
        let body =
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "request_timeout_s": timeout});
        let t = Instant::now();
        let (status, v) = post_json(&srv.addr, "/v1/chat/completions", body.to_string().as_bytes());
        (status, v, t.elapsed())
    };
    // The request's own limit (0.5 s) ends it, long before the server's (60 s).
    let (status, v, took) = chat(0.5);
    assert_eq!(status, 408, "{v}");
    assert!(took < Duration::from_secs(3), "{took:?}");
    // Left to run, the template's fuel stops it.
    let (status, v, took) = chat(30.0);
    assert_eq!(status, 400, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("instructions"), "{msg}");
    assert!(!msg.contains(".gguf") && !msg.contains(dir.to_str().unwrap()), "no file path in errors: {msg}");
    assert!(took < Duration::from_secs(20), "{took:?}");
    health_ok(&mut srv);
    // Renders in flight, then SIGTERM: the process exits within 10 s.
    let addr = srv.addr.clone();
    let clients: Vec<_> = (0..4)
        .map(|_| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
                http(&addr, "POST", "/v1/chat/completions", Some("application/json"), body.to_string().as_bytes())
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let kill = Command::new("kill").args(["-TERM", &srv.child.id().to_string()]).status().unwrap();
    assert!(kill.success());
    let t = Instant::now();
    loop {
        if srv.child.try_wait().unwrap().is_some() {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "still running 10 s after SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!("exited {:?} after SIGTERM", t.elapsed());
    while srv.lines.recv_timeout(Duration::from_millis(200)).is_ok() {}
    for c in clients {
        let _ = c.join();
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A long text tokenized within a limit (in pieces, stopping past the limit) gives the same
/// tokens as the whole text tokenized at once, for every tokenizer the tests load; past the
/// limit it is refused.
#[test]
fn limited_tokenization_equals_whole() {
    use torus_wgpu::tokenizer::{Tokenizer, TooLong};
    let mut rng = torus_wgpu::sampling::Rng::new(5);
    let words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "über",
        "naïve",
        "日本語",
        "x",
        "don't",
        "I'm",
        "12",
        "345",
        "3.14",
        "=>",
        "fn",
        "(a, b)",
        "<|im_start|>",
        "<|im_end|>",
        "    ",
        "\t",
        "中文，",
        "句子。",
        "e.g.",
        "(x)",
        "1,234",
        "a1b2",
        "Ωμέγα",
        "Привет!",
        "don’t",
        "x\r\n",
        "—",
        "「引用」",
    ];
    let mut text = String::new();
    while text.len() < 200_000 {
        let w = words[(rng.next_u64() % words.len() as u64) as usize];
        text.push_str(w);
        text.push_str(match rng.next_u64() % 10 {
            0 => "\n",
            1 => "\n\n",
            2 => ". ",
            3 => "  ",
            4 => ",",
            _ => " ",
        });
    }
    // Gemma 3's SentencePiece tokenizer cuts long texts itself (before spaces and CJK stops).
    let gemma = Tokenizer::from_path(&common::gemma3_270m()).unwrap();
    assert_eq!(
        gemma.tokenize_limited(&text, true, true, usize::MAX).unwrap(),
        gemma.tokenize(&text, true, true).unwrap()
    );
    for (path, pieces) in [(smollm2(), true), (common::qwen25_coder(), true), (tiny(), false)] {
        let tok = Tokenizer::from_path(&path).unwrap();
        // GGUF byte-level tokenizers are cut in pieces; tiny-qwen2's has a normalizer (NFC).
        assert_eq!(tok.tokenizes_in_pieces(), pieces, "{}", path.display());
        let whole = tok.tokenize(&text, true, true).unwrap();
        let limited = tok.tokenize_limited(&text, true, true, whole.len()).unwrap();
        assert!(limited == whole, "{}: {} tokens in pieces, {} whole", path.display(), limited.len(), whole.len());
        let raw = tok.tokenize(&text, false, false).unwrap();
        assert_eq!(tok.tokenize_limited(&text, false, false, raw.len()).unwrap(), raw, "{}", path.display());
        assert_eq!(tok.encode_limited(&text, whole.len() + 1).unwrap(), tok.encode(&text).unwrap());
        let e = tok.tokenize_limited(&text, true, true, whole.len() - 1).unwrap_err();
        assert!(e.downcast_ref::<TooLong>().is_some(), "{e:#}");
    }
}

/// A model pushed to emit continuation bytes for ever: the streaming detokenizer's window
/// stays bounded (linear time), and the broken text comes out as U+FFFD.
#[test]
fn detokenizer_window_stays_bounded() {
    use torus_wgpu::tokenizer::{IncrementalDecoder, Tokenizer};
    let tok = Tokenizer::from_path(&smollm2()).unwrap();
    // GPT-2 byte-level: the continuation byte 0xA0 is the character U+0142.
    let cont = tok.token_to_id("\u{142}").expect("the byte token of 0xA0");
    let mut d = IncrementalDecoder::new(true);
    let mut out = String::new();
    for _ in 0..5_000 {
        out.push_str(&d.push(&tok, cont));
        assert!(d.window_len() <= 2 * torus_wgpu::tokenizer::MAX_HELD + 1, "window {}", d.window_len());
    }
    out.push_str(&d.finish(&tok));
    assert!(out.chars().count() >= 5_000 && out.chars().all(|c| c == '\u{FFFD}'), "{}", out.chars().count());
    // Whole characters still come out whole.
    let mut d = IncrementalDecoder::new(true);
    let ids = tok.encode_raw("héllo wörld 日本").unwrap();
    let text: String = ids.iter().map(|&id| d.push(&tok, id)).collect::<String>() + &d.finish(&tok);
    assert_eq!(text, "héllo wörld 日本");
}

/// Start-up refuses an empty API key (it would silently mean no authentication).
#[test]
fn empty_api_key_is_refused_at_start() {
    for (flag, env) in [(Some(""), None), (None, Some("")), (Some("  "), None)] {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_torus-wgpu"));
        cmd.args(["serve", "--port", "0", "--model"]).arg(tiny());
        if let Some(k) = flag {
            cmd.args(["--api-key", k]);
        }
        match env {
            Some(k) => cmd.env("TORUS_API_KEY", k),
            None => cmd.env_remove("TORUS_API_KEY"),
        };
        let out = cmd.output().unwrap();
        assert!(!out.status.success(), "{flag:?} {env:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("empty"), "{err}");
    }
}

/// A request that fits in the free KV blocks starts at once, although an earlier one that
/// does not fit yet waits; the earlier one still completes.
#[test]
fn small_request_is_not_held_behind_a_big_one() {
    use torus_wgpu::engine::{Event, FinishReason};
    // tiny-qwen2: 1 KiB per 4-token block: 24 blocks, 96 tokens in all.
    let cfg = torus_wgpu::config::EngineConfig {
        max_num_batched_tokens: 64,
        max_sequence_length: 96,
        total_cache_size: 24 * 1024,
        block_size: 4,
        max_decode_batch_size: 8,
        max_prefill_batch_size: 4,
        enable_prefix_cache: false,
        ..Default::default()
    };
    let e = common::start_engine(&tiny(), &cfg);
    assert_eq!(e.info.num_blocks, 24);
    let ids = |n: usize, base: u32| -> Vec<u32> { (0..n as u32).map(|i| base + i % 50).collect() };
    // A: 40-token prompt + 40 decoded: up to 20 blocks.
    let mut a = e.submit(greedy_req(&ids(40, 1), 40)).unwrap();
    // Wait until A decodes (it holds 10+ blocks).
    match a.next_blocking() {
        Some(Event::Token { .. }) => {}
        other => panic!("{other:?}"),
    }
    // Each stream read as it comes: the order in which they end is the engine's.
    let (tx, rx) = std::sync::mpsc::channel();
    let read = |name: &'static str, s: torus_wgpu::engine::RequestStream| {
        let tx = tx.clone();
        std::thread::spawn(move || tx.send((name, s.collect_blocking())).unwrap())
    };
    let mut waits = vec![read("A", a)];
    // B needs 60 tokens of prompt (15 blocks): it cannot start while A runs. C needs one block.
    waits.push(read("B", e.submit(greedy_req(&ids(60, 100), 4)).unwrap()));
    waits.push(read("C", e.submit(greedy_req(&ids(2, 200), 1)).unwrap()));
    let order: Vec<_> = (0..3).map(|_| rx.recv_timeout(Duration::from_secs(60)).expect("all three finish")).collect();
    for w in waits {
        w.join().unwrap();
    }
    let names: Vec<&str> = order.iter().map(|(n, _)| *n).collect();
    // C finished first, while A still ran: it was not held behind B, and B still completed.
    assert_eq!(names, ["C", "A", "B"], "the order the requests finished in: {:?}", e.metrics.snapshot());
    for (name, done) in &order {
        assert_eq!(done.reason, FinishReason::Length, "{name}: {done:?}");
    }
    assert_eq!(order[2].1.usage.completion_tokens, 4);
    let t = Instant::now();
    loop {
        let m = e.metrics.snapshot();
        if m.running == 0 && m.waiting == 0 && m.kv_blocks_used == 0 {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(30), "{m:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
    e.shutdown(true);
}
