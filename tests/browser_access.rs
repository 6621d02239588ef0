//! What a web page can and cannot do with a server on localhost: DNS rebinding (the `Host`
//! check), CORS preflights of the official browser SDKs, and bodies without a Content-Type.
//! No model is needed: the server answers these before the engine (503 while it has none).

use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use torus_wgpu::config::EngineConfig;
use torus_wgpu::server::{start, ServerConfig, ServerHandle};

async fn serve(f: impl FnOnce(&mut ServerConfig)) -> ServerHandle {
    let mut scfg = ServerConfig::new("m", &EngineConfig::default());
    f(&mut scfg);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    start(listener, scfg, None).unwrap()
}

/// One HTTP/1.1 request with `headers` (lines without CRLF) and `body`: status, headers
/// (lowercase names), body.
async fn raw(h: &ServerHandle, method: &str, path: &str, headers: &[&str], body: &str) -> (u16, String, String) {
    let mut s = tokio::net::TcpStream::connect(h.addr).await.unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\n");
    for l in headers {
        req.push_str(l);
        req.push_str("\r\n");
    }
    req.push_str(&format!("Content-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()));
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), s.read_to_end(&mut out)).await.unwrap().unwrap();
    let text = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, head.to_ascii_lowercase(), body.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebound_name_is_refused_on_loopback() {
    let h = serve(|_| {}).await;
    let port = h.addr.port();
    let evil = format!("Host: attacker.example:{port}");
    // Every route, in its own error shape, before anything else happens.
    let (status, _, body) = raw(&h, "GET", "/v1/models", &[&evil], "").await;
    assert_eq!(status, 403, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["code"], "host_not_allowed", "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("--allowed-hosts"), "{v}");
    let (status, _, body) = raw(&h, "GET", "/api/tags", &[&evil], "").await;
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(status == 403 && v["error"].is_string(), "Ollama's shape: {status} {v}");
    let (status, _, body) =
        raw(&h, "POST", "/v1/messages", &[&evil, "Content-Type: application/json"], r#"{"model":"m"}"#).await;
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(status == 403 && v["type"] == "error" && v["error"]["message"].is_string(), "Anthropic's: {status} {v}");
    let (status, _, _) = raw(&h, "GET", "/health", &[&evil], "").await;
    assert_eq!(status, 403);
    // The loopback names, with or without a port: answered (503: no model yet).
    for host in ["localhost", "127.0.0.1", "[::1]"] {
        for with_port in [format!("Host: {host}:{port}"), format!("Host: {host}")] {
            let (status, _, body) = raw(&h, "GET", "/v1/models", &[&with_port], "").await;
            assert_ne!(status, 403, "{with_port}: {body}");
        }
    }
    h.shutdown().await;

    // --allowed-hosts adds names; `*` turns the check off.
    let h = serve(|c| c.allowed_hosts = vec!["my-box.lan".into()]).await;
    assert_ne!(raw(&h, "GET", "/health", &["Host: my-box.lan:8000"], "").await.0, 403);
    assert_ne!(raw(&h, "GET", "/health", &["Host: localhost"], "").await.0, 403);
    assert_eq!(raw(&h, "GET", "/health", &["Host: other.lan"], "").await.0, 403);
    h.shutdown().await;
    let h = serve(|c| c.allowed_hosts = vec!["*".into()]).await;
    assert_ne!(raw(&h, "GET", "/health", &["Host: attacker.example"], "").await.0, 403);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn browser_sdk_preflights_pass_for_allowed_origins() {
    let h = serve(|c| c.allowed_origins = vec!["http://app.example".into()]).await;
    // What the OpenAI and Anthropic JS SDKs ask for before a POST from a page.
    let asked = "authorization, content-type, x-stainless-os, x-stainless-lang, x-stainless-retry-count, \
                 anthropic-version, anthropic-dangerous-direct-browser-access, x-api-key";
    for path in ["/v1/chat/completions", "/v1/responses", "/v1/messages"] {
        let (status, head, _) = raw(
            &h,
            "OPTIONS",
            path,
            &[
                "Host: localhost",
                "Origin: http://app.example",
                "Access-Control-Request-Method: POST",
                &format!("Access-Control-Request-Headers: {asked}"),
            ],
            "",
        )
        .await;
        assert_eq!(status, 200, "{path}: {head}");
        assert!(head.contains("access-control-allow-origin: http://app.example"), "{path}: {head}");
        let allowed = head.lines().find(|l| l.starts_with("access-control-allow-headers:")).unwrap_or("");
        for name in asked.split(", ") {
            assert!(allowed.contains(name), "{path}: {name} not allowed: {allowed}");
        }
    }
    // Another origin gets no CORS grant.
    let (_, head, _) = raw(
        &h,
        "OPTIONS",
        "/v1/chat/completions",
        &["Host: localhost", "Origin: http://evil.example", "Access-Control-Request-Method: POST"],
        "",
    )
    .await;
    assert!(!head.contains("access-control-allow-origin"), "{head}");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_without_a_type_is_json_unless_a_browser_sent_it() {
    let h = serve(|_| {}).await;
    let body = r#"{"model": "m", "messages": [{"role": "user", "content": "hi"}]}"#;
    for path in ["/api/chat", "/v1/chat/completions"] {
        // litellm's ollama_chat provider: no Content-Type, no Origin. Read as JSON (503: no
        // model yet), not 415.
        let (status, _, text) = raw(&h, "POST", path, &["Host: localhost"], body).await;
        assert_eq!(status, 503, "{path}: {text}");
        // The same from a page (browsers always send Origin on a cross-site POST): 415.
        let (status, _, text) = raw(&h, "POST", path, &["Host: localhost", "Origin: http://evil.example"], body).await;
        assert_eq!(status, 415, "{path}: {text}");
        let (status, _, _) = raw(&h, "POST", path, &["Host: localhost", "Content-Type: text/plain"], body).await;
        assert_eq!(status, 415, "{path}");
    }
    h.shutdown().await;
}
