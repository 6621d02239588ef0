//! The benchmark client: metric math on synthetic timelines with known answers, and goodput/SLO
//! parsing. (The end-to-end run against a live server is in tests/server_bench.rs.)

use torus_wgpu::bench::metrics::{percentile, summarize, RequestRecord, Slo, Stats};

fn rec(send: f64, chunks: &[f64], end: f64, out: usize) -> RequestRecord {
    RequestRecord {
        send,
        chunks: chunks.to_vec(),
        end,
        prompt_tokens: 10,
        output_tokens: out,
        success: true,
        error: None,
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
