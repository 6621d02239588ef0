//! The access log: one `tracing` event per request (target `torus_wgpu::access`, level INFO),
//! and the request id in an `x-request-id` response header.
//!
//! The middleware puts an [`AccessRecord`] into the request's extensions; the generation routes
//! fill it in as their choices run (token counts, time to first token, finish reasons). The line
//! is written when the response body is dropped: after its last byte for a stream (or when the
//! client goes away), not when the headers are sent. A request whose client disconnects before
//! the response starts is logged with status 499.

use super::AppState;
use crate::engine::{FinishReason, Usage};
use axum::body::{Body, Bytes};
use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderName, HeaderValue, Method};
use axum::middleware::Next;
use axum::response::Response;
use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

/// The `tracing` target of the access log lines.
pub const ACCESS_TARGET: &str = "torus_wgpu::access";
/// The request id header (kept from the client when sane, generated otherwise).
pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
/// Longest client-given request id that is kept.
pub const MAX_REQUEST_ID_LEN: usize = 128;
/// Status logged for a request whose client went away before the response started (nginx's).
const CLIENT_CLOSED: u16 = 499;
/// Longest unmatched path written to the log, in bytes.
const MAX_LOGGED_PATH: usize = 256;

/// A client's request id, if it is 1..=128 visible ASCII characters (no spaces or controls).
pub fn sane_request_id(v: &HeaderValue) -> Option<&str> {
    let b = v.as_bytes();
    let ok = !b.is_empty() && b.len() <= MAX_REQUEST_ID_LEN && b.iter().all(|c| (0x21..=0x7e).contains(c));
    ok.then(|| v.to_str().ok()).flatten()
}

/// One choice as the access log sees it.
#[derive(Clone, Copy, Debug, Default)]
struct ChoiceLog {
    prompt_index: usize,
    /// Usage and finish reason once the choice is done.
    done: Option<(Usage, &'static str)>,
}

#[derive(Debug, Default)]
struct Generation {
    /// By choice index.
    choices: BTreeMap<usize, ChoiceLog>,
    /// The earliest first token of any choice, from the request's arrival.
    first_token: Option<Duration>,
}

/// What a generation request reports to its access log line; shared by the handler, the
/// response body and the log guard. A request that never submits a choice logs no token counts.
#[derive(Clone, Debug, Default)]
pub(crate) struct AccessRecord(Arc<Mutex<Generation>>);

impl AccessRecord {
    fn with<T>(&self, f: impl FnOnce(&mut Generation) -> T) -> T {
        f(&mut self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// A choice was submitted.
    pub fn choice(&self, index: usize, prompt_index: usize) {
        self.with(|g| g.choices.insert(index, ChoiceLog { prompt_index, done: None }));
    }

    /// A choice produced its first token `after` the request arrived.
    pub fn first_token(&self, after: Duration) {
        self.with(|g| g.first_token = Some(g.first_token.map_or(after, |t| t.min(after))));
    }

    /// A choice finished.
    pub fn done(&self, index: usize, usage: Usage, reason: &FinishReason) {
        self.with(|g| g.choices.entry(index).or_default().done = Some((usage, reason.as_openai())));
    }

    /// (prompt tokens, completion tokens, finish reasons), counted as the response's usage is
    /// (each prompt once, the choices' completions summed); a choice that never finished (client
    /// gone, time limit) has reason `abort`. None when no choice was submitted.
    fn summary(&self) -> Option<(usize, usize, String, Option<Duration>)> {
        self.with(|g| {
            if g.choices.is_empty() {
                return None;
            }
            let mut seen = std::collections::BTreeSet::new();
            let (mut prompt, mut completion, mut reasons) = (0, 0, Vec::new());
            for c in g.choices.values() {
                match c.done {
                    Some((u, r)) => {
                        if seen.insert(c.prompt_index) {
                            prompt += u.prompt_tokens;
                        }
                        completion += u.completion_tokens;
                        reasons.push(r);
                    }
                    None => reasons.push("abort"),
                }
            }
            Some((prompt, completion, reasons.join(","), g.first_token))
        })
    }
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// Writes the request's line when dropped.
struct LogGuard {
    id: String,
    method: Method,
    route: String,
    /// None until the response exists (dropped before: the client went away).
    status: Option<u16>,
    t0: Instant,
    record: AccessRecord,
}

impl Drop for LogGuard {
    fn drop(&mut self) {
        let status = self.status.unwrap_or(CLIENT_CLOSED);
        let duration_ms = ms(self.t0.elapsed());
        let (id, method, route) = (self.id.as_str(), self.method.as_str(), self.route.as_str());
        match self.record.summary() {
            Some((prompt_tokens, completion_tokens, finish_reasons, ttft)) => tracing::info!(
                target: ACCESS_TARGET,
                request_id = id,
                method,
                route,
                status,
                prompt_tokens,
                completion_tokens,
                ttft_ms = ttft.map(ms),
                duration_ms,
                finish_reasons = finish_reasons.as_str(),
                "request"
            ),
            None => tracing::info!(
                target: ACCESS_TARGET,
                request_id = id,
                method,
                route,
                status,
                duration_ms,
                "request"
            ),
        }
    }
}

/// A response body that holds the log guard until it is dropped.
struct Logged {
    inner: Body,
    _guard: LogGuard,
}

impl http_body::Body for Logged {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The middleware: request id in and out, one log line per request.
pub(crate) async fn access_log(State(st): State<Arc<AppState>>, mut req: Request, next: Next) -> Response {
    let t0 = Instant::now();
    let id = match req.headers().get(&REQUEST_ID).and_then(sane_request_id) {
        Some(id) => id.to_string(),
        None => st.new_request_id(),
    };
    let route = match req.extensions().get::<MatchedPath>() {
        Some(p) => p.as_str().to_string(),
        None => {
            let p = req.uri().path();
            let mut end = p.len().min(MAX_LOGGED_PATH);
            while !p.is_char_boundary(end) {
                end -= 1;
            }
            p[..end].to_string()
        }
    };
    let record = AccessRecord::default();
    req.extensions_mut().insert(record.clone());
    let mut guard = LogGuard { id, method: req.method().clone(), route, status: None, t0, record };
    let mut res = next.run(req).await;
    guard.status = Some(res.status().as_u16());
    if let Ok(v) = HeaderValue::from_str(&guard.id) {
        res.headers_mut().insert(REQUEST_ID, v);
    }
    res.map(|inner| Body::new(Logged { inner, _guard: guard }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_id_sanity() {
        let ok = |s: &str| sane_request_id(&HeaderValue::from_str(s).unwrap()).is_some();
        assert!(ok("abc-123_XYZ.~:/"));
        assert!(ok(&"a".repeat(128)));
        assert!(!ok(&"a".repeat(129)));
        assert!(!ok(""));
        assert!(!ok("has space"));
        assert!(!ok("tab\there"));
        assert!(sane_request_id(&HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap()).is_none());
    }

    #[test]
    fn summary_counts_each_prompt_once() {
        let r = AccessRecord::default();
        assert!(r.summary().is_none());
        for (i, p) in [(0, 0), (1, 0), (2, 1)] {
            r.choice(i, p);
        }
        let u = |p, c| Usage { prompt_tokens: p, completion_tokens: c, cached_tokens: 0, stop_string: None };
        r.first_token(Duration::from_millis(30));
        r.first_token(Duration::from_millis(20));
        r.done(1, u(5, 3), &FinishReason::Length);
        r.done(0, u(5, 2), &FinishReason::Stop);
        let (p, c, reasons, ttft) = r.summary().unwrap();
        assert_eq!((p, c, reasons.as_str(), ttft), (5, 5, "stop,length,abort", Some(Duration::from_millis(20))));
        r.done(2, u(7, 1), &FinishReason::Stop);
        assert_eq!(r.summary().unwrap().0, 12);
    }
}
