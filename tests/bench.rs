//! The benchmark client: metric math on synthetic timelines with known answers, goodput/SLO
//! parsing, and connection handling against tiny raw-TCP servers that close connections (resends
//! on a fresh connection before any response byte, never after). (The end-to-end run against a
//! live torus-wgpu server is in tests/server_bench.rs.)

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use torus_wgpu::bench::metrics::{percentile, summarize, RequestRecord, Slo, Stats};
use torus_wgpu::bench::{format_table, run_bench, BenchArgs, Endpoint, SEND_ATTEMPTS};

fn rec(send: f64, chunks: &[f64], end: f64, out: usize) -> RequestRecord {
    RequestRecord {
        send,
        chunks: chunks.to_vec(),
        end,
        prompt_tokens: 10,
        output_tokens: out,
        success: true,
        error: None,
        retries: 0,
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[test]
fn per_request_ttft_tpot_itl_e2el() {
    // Sent at 1.0, first token at 1.5, then chunks at 1.7, 2.0, 2.6; 4 tokens; done at 2.6.
    let r = rec(1.0, &[1.5, 1.7, 2.0, 2.6], 2.6, 4);
    assert!(close(r.ttft().unwrap(), 0.5));
    assert!(close(r.e2el(), 1.6));
    // TPOT = (E2E - TTFT) / (tokens - 1) = 1.1 / 3.
    assert!(close(r.tpot().unwrap(), 1.1 / 3.0));
    let itl: Vec<f64> = r.itls().collect();
    assert_eq!(itl.len(), 3);
    for (a, b) in itl.iter().zip([0.2, 0.3, 0.6]) {
        assert!(close(*a, b), "{a} vs {b}");
    }
    // One output token: no TPOT.
    assert!(rec(0.0, &[0.4], 0.4, 1).tpot().is_none());
}

#[test]
fn percentiles_interpolate_like_numpy() {
    let v = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0];
    assert!(close(percentile(&v, 50.0), 5.5));
    assert!(close(percentile(&v, 90.0), 9.1));
    assert!(close(percentile(&v, 95.0), 9.55));
    assert!(close(percentile(&v, 99.0), 9.91));
    assert!(close(percentile(&v, 0.0), 1.0));
    assert!(close(percentile(&v, 100.0), 10.0));
    let s = Stats::of_seconds([0.001, 0.002, 0.003, 0.004]);
    assert!(close(s.mean, 2.5) && close(s.median, 2.5));
    assert!(close(s.std, (1.25f64).sqrt()));
}

#[test]
fn summary_counts_throughput_and_goodput() {
    let records = vec![
        // TTFT 100 ms, TPOT 50 ms, E2E 300 ms, 5 tokens.
        rec(0.0, &[0.1, 0.15, 0.2, 0.25, 0.3], 0.3, 5),
        // TTFT 600 ms, TPOT 100 ms, E2E 1000 ms, 5 tokens.
        rec(0.5, &[1.1, 1.2, 1.3, 1.4, 1.5], 1.5, 5),
        // TTFT 200 ms, TPOT 400 ms, E2E 1000 ms, 3 tokens.
        rec(1.0, &[1.2, 1.6, 2.0], 2.0, 3),
        RequestRecord { send: 1.0, end: 1.1, error: Some("HTTP 500".into()), ..Default::default() },
    ];
    let slo = Slo::parse(&["ttft:500".into(), "tpot:200".into()]).unwrap();
    let s = summarize(&records, 2.0, &slo);
    assert_eq!((s.completed, s.failed), (3, 1));
    assert_eq!(s.total_output_tokens, 13);
    assert_eq!(s.total_input_tokens, 30);
    assert!(close(s.request_throughput, 1.5));
    assert!(close(s.output_throughput, 6.5));
    assert!(close(s.total_token_throughput, 21.5));
    // Only the first request meets both SLOs: 1 request / 2 s.
    assert!(close(s.goodput.unwrap(), 0.5));
    assert!(close(s.ttft_ms.mean, 300.0));
    assert!(close(s.ttft_ms.median, 200.0));
    assert!(close(s.tpot_ms.mean, (50.0 + 100.0 + 400.0) / 3.0));
    assert!(close(s.e2el_ms.median, 1000.0));
    // ITL pools every gap: 4 + 4 + 2 = 10 gaps.
    assert!(close(s.itl_ms.mean, (4.0 * 50.0 + 4.0 * 100.0 + 2.0 * 400.0) / 10.0));
    // With an E2E objective of 500 ms the first still passes; with 200 ms none does.
    assert!(close(summarize(&records, 2.0, &Slo::parse(&["e2el:500".into()]).unwrap()).goodput.unwrap(), 0.5));
    assert!(close(summarize(&records, 2.0, &Slo::parse(&["e2el:200".into()]).unwrap()).goodput.unwrap(), 0.0));
    assert!(summarize(&records, 2.0, &Slo::default()).goodput.is_none());
}

#[test]
fn slo_parsing_rejects_bad_items() {
    assert!(Slo::parse(&["ttft:abc".into()]).is_err());
    assert!(Slo::parse(&["latency:5".into()]).is_err());
    assert!(Slo::parse(&["ttft".into()]).is_err());
    assert!(Slo::parse(&["ttft:-1".into()]).is_err());
    let s = Slo::parse(&["ttft:1 tpot:2".into(), "e2el:3".into()]).unwrap();
    assert_eq!((s.ttft_ms, s.tpot_ms, s.e2el_ms), (Some(1.0), Some(2.0), Some(3.0)));
}

/// What the test server does with each connection.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Conn {
    /// Answers one request, then closes the socket at once (no `connection: close` header).
    CloseAfterResponse,
    /// Answers one request and keeps the socket until the next request arrives on it, then
    /// closes it unanswered: the client's pooled connection is dead when it reuses it, always.
    CloseOnSecondRequest,
    /// Sends the response head and the first event, then closes mid-response.
    CloseMidResponse,
    /// Reads each request and closes without a byte of response.
    NeverAnswer,
}

/// One streamed chat completion: two text chunks, usage, [DONE].
fn sse_body() -> String {
    let events = [
        r#"{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#,
        r#"{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"Hello"}}]}"#,
        r#"{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" world"},"finish_reason":"length"}]}"#,
        r#"{"id":"c","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":4,"completion_tokens":2,"total_tokens":6}}"#,
        "[DONE]",
    ];
    events.iter().map(|e| format!("data: {e}\n\n")).collect()
}

/// Reads one HTTP/1.1 request (head and content-length body); its request line, or None at end
/// of stream.
async fn read_request(s: &mut TcpStream) -> Option<String> {
    let mut buf = Vec::new();
    let mut tmp = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let len: usize =
                head.lines().find_map(|l| l.strip_prefix("content-length:")).map_or(0, |v| v.trim().parse().unwrap());
            if buf.len() >= end + 4 + len {
                return Some(head.lines().next().unwrap_or("").to_string());
            }
        }
        match s.read(&mut tmp).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&tmp[..n]),
        }
    }
}

/// A server on 127.0.0.1 behaving as `mode` for completion requests; returns its address, the
/// count of completion requests it read and the count of `GET /metrics` (answered 404 on a
/// connection it closes, as a server without metrics would).
async fn test_server(mode: Conn) -> (String, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(AtomicUsize::new(0));
    let metrics = Arc::new(AtomicUsize::new(0));
    let (seen2, metrics2) = (seen.clone(), metrics.clone());
    tokio::spawn(async move {
        loop {
            let (mut s, _) = listener.accept().await.expect("the test server accepts a connection");
            let (seen, metrics) = (seen2.clone(), metrics2.clone());
            tokio::spawn(async move {
                // A connection closed before sending a request needs no answer.
                if let Some(line) = read_request(&mut s).await {
                    answer(&mut s, &line, mode, &seen, &metrics).await;
                }
                // Dropping the socket closes it.
            });
        }
    });
    (format!("http://{addr}"), seen, metrics)
}

/// The test server's answer to one request on `s` (see `Conn`).
async fn answer(s: &mut TcpStream, line: &str, mode: Conn, seen: &AtomicUsize, metrics: &AtomicUsize) {
    if line.starts_with("get /metrics") {
        metrics.fetch_add(1, SeqCst);
        let _ = s.write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n").await;
        let _ = s.flush().await;
        return;
    }
    assert!(line.starts_with("post /v1/chat/completions"), "{line}");
    seen.fetch_add(1, SeqCst);
    let body = sse_body();
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\nconnection: keep-alive\r\n\r\n",
        body.len()
    );
    match mode {
        Conn::NeverAnswer => return,
        Conn::CloseMidResponse => {
            let first = body.find("\n\n").unwrap() + 2;
            let _ = s.write_all(format!("{head}{}", &body[..first]).as_bytes()).await;
            let _ = s.flush().await;
            return;
        }
        Conn::CloseAfterResponse | Conn::CloseOnSecondRequest => {
            let _ = s.write_all(format!("{head}{body}").as_bytes()).await;
            let _ = s.flush().await;
        }
    }
    if mode == Conn::CloseOnSecondRequest && read_request(s).await.is_some() {
        seen.fetch_add(1, SeqCst);
    }
}

fn conn_args(base_url: String) -> BenchArgs {
    BenchArgs {
        base_url,
        model: Some("m".into()),
        endpoint: Endpoint::Chat,
        num_prompts: 32,
        concurrency: Some(1),
        request_rate: None,
        input_len: 4,
        output_len: 2,
        dataset: None,
        ignore_eos: true,
        seed: 1,
        temperature: 0.0,
        goodput: vec![],
        json_out: None,
        tokenizer: None,
        api_key: None,
        timeout: 30.0,
        quiet: true,
    }
}

/// A server that closes every connection after one response: no request fails; requests that
/// found their pooled connection dead are resent on a fresh one and counted as retries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_keep_alive_connections_are_retried_on_a_fresh_one() {
    for mode in [Conn::CloseOnSecondRequest, Conn::CloseAfterResponse] {
        let (base, seen, metrics) = test_server(mode).await;
        let report = run_bench(&conn_args(base)).await.unwrap();
        let s = &report.summary;
        // Speculative counters are read before and after the run; a 404 means none.
        assert_eq!(metrics.load(SeqCst), 2, "{mode:?}");
        assert!(report.spec_decode.is_none());
        assert_eq!((s.completed, s.failed), (32, 0), "{mode:?}: {:?}", report.records.iter().find(|r| !r.success));
        assert!(report.records.iter().all(|r| r.output_tokens == 2 && r.chunks.len() == 2), "{mode:?}");
        assert_eq!(s.retries, report.records.iter().map(|r| r.retries).sum::<usize>());
        if mode == Conn::CloseAfterResponse {
            // Attempts on a dead connection never reach the server: it answers each request once
            // (whether the client ever reuses a dead connection here is a race).
            assert_eq!(seen.load(SeqCst), 32, "{mode:?}");
        } else {
            // The server reads each failed attempt (then closes): requests plus counted resends.
            assert_eq!(seen.load(SeqCst), 32 + s.retries, "{mode:?}");
            // Every reuse of a pooled connection meets a dead one: about every other request.
            assert!(s.retries >= 8, "{mode:?}: {} retries", s.retries);
            assert!(report.records.iter().all(|r| r.retries <= 1), "one fresh connection is enough");
        }
        // The count is in the JSON document and in the text report.
        let v = serde_json::to_value(&report).unwrap();
        assert_eq!(v["summary"]["retries"], s.retries);
        assert_eq!(v["records"][0]["retries"], report.records[0].retries);
        let table = format_table(&report);
        assert!(
            table
                .lines()
                .any(|l| l.starts_with("Retries on a fresh connection:") && l.ends_with(&s.retries.to_string())),
            "{table}"
        );
    }
}

/// A connection that closes after the response began is a failure of the server, never resent;
/// one that never answers is resent a bounded number of times and then fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_after_a_response_began_are_not_retried() {
    let (base, seen, _) = test_server(Conn::CloseMidResponse).await;
    let report = run_bench(&conn_args(base)).await.unwrap();
    assert_eq!((report.summary.completed, report.summary.failed, report.summary.retries), (0, 32, 0));
    assert_eq!(seen.load(SeqCst), 32);
    assert!(
        report.records.iter().all(|r| r.error.as_deref().unwrap().contains("stream broke")),
        "{:?}",
        report.records[0]
    );

    let (base, seen, _) = test_server(Conn::NeverAnswer).await;
    let mut a = conn_args(base);
    a.num_prompts = 4;
    let report = run_bench(&a).await.unwrap();
    assert_eq!((report.summary.completed, report.summary.failed), (0, 4));
    assert!(report.records.iter().all(|r| r.retries == SEND_ATTEMPTS - 1), "{:?}", report.records);
    assert_eq!(report.summary.retries, 4 * (SEND_ATTEMPTS - 1));
    assert_eq!(seen.load(SeqCst), 4 * SEND_ATTEMPTS);
    let e = report.records[0].error.as_deref().unwrap();
    assert!(e.contains(&format!("{SEND_ATTEMPTS} attempts")), "{e}");
}
