//! Accepting connections: the connection cap, the per-peer cap, and a probe lane.
//!
//! - At most `max_connections` connections are served at once (the main lane); each must send
//!   a request head within `header_read_timeout` (its body has `body_read_timeout`, see `body`).
//! - One peer (IP address) holds at most `max_connections_per_peer` of those places; a further
//!   connection from it is answered 429 and closed at once.
//! - When every main place is taken, up to [`PROBE_LANE`] more connections are accepted into a
//!   probe lane: each must send its request head within [`PROBE_HEAD_TIMEOUT`], gets one
//!   answer and is closed, and only `GET /health`, `/metrics` and `/version` are served there
//!   (anything else: 503 with Retry-After). So an orchestrator's probes are answered within
//!   about a second even while slow peers hold every main place. A peer holds at most
//!   [`PROBE_PER_PEER`] probe places; with every place of both lanes taken, further connections
//!   wait in the kernel's listen backlog.

use super::AppState;
use axum::body::Body;
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use futures_util::future::Either;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Connections the probe lane takes beyond `max_connections`.
pub const PROBE_LANE: usize = 16;
/// Probe-lane places one peer may hold.
pub const PROBE_PER_PEER: usize = 4;
/// How long a probe-lane connection may take to send its request head.
pub const PROBE_HEAD_TIMEOUT: Duration = Duration::from_secs(1);

/// Errors of one connection (it went away before it was accepted), not of the listener.
fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(e.kind(), ConnectionRefused | ConnectionAborted | ConnectionReset)
}

/// Whether a request is one the probe lane serves.
fn is_probe(method: &Method, path: &str) -> bool {
    method == Method::GET && matches!(path, "/health" | "/metrics" | "/version")
}

/// Connections per peer, in one lane; a place is given back when its [`PeerPlace`] drops.
#[derive(Default)]
struct PeerCounts(Mutex<HashMap<IpAddr, usize>>);

struct PeerPlace(Arc<PeerCounts>, IpAddr);

impl PeerCounts {
    /// A place for `ip`, unless it holds `cap` already.
    fn take(self: &Arc<Self>, ip: IpAddr, cap: usize) -> Option<PeerPlace> {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let n = m.entry(ip).or_insert(0);
        if *n >= cap {
            return None;
        }
        *n += 1;
        Some(PeerPlace(self.clone(), ip))
    }
}

impl Drop for PeerPlace {
    fn drop(&mut self) {
        let mut m = self.0 .0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = m.get_mut(&self.1) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.1);
            }
        }
    }
}

/// A short answer written straight to a socket that is then closed (best effort).
fn refuse(sock: &tokio::net::TcpStream, status: u16, reason: &str, message: &str) {
    let body = serde_json::json!({"error": {"message": message, "type": "server_error", "param": null, "code": "too_many_connections"}})
        .to_string();
    let head = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let _ = sock.try_write(format!("{head}{body}").as_bytes());
}

/// The answer of the probe lane to anything but a probe.
fn lane_full() -> Response {
    let body = serde_json::json!({"error": {
        "message": "every connection place is taken (max_connections); only /health, /metrics and /version are answered now; retry later",
        "type": "server_error", "param": null, "code": "too_many_connections"}});
    let mut r = (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response();
    r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(1));
    r
}

/// Accepts and serves connections (HTTP/1.1) as the module docs say. On `stopped`: stops
/// accepting, closes connections that are idle or have not sent a whole request yet, and
/// returns once every in-flight response has been sent.
pub(super) async fn accept_loop(
    listener: tokio::net::TcpListener,
    app: Router,
    st: Arc<AppState>,
    stopped: tokio::sync::oneshot::Receiver<()>,
) -> std::io::Result<()> {
    use hyper::service::Service;
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::service::TowerToHyperService;
    use std::sync::atomic::AtomicBool;

    let max = st.cfg.max_connections.clamp(1, Semaphore::MAX_PERMITS.min(u32::MAX as usize));
    let per_peer = st.cfg.max_connections_per_peer.max(1);
    let main = Arc::new(Semaphore::new(max));
    let probe = Arc::new(Semaphore::new(PROBE_LANE));
    let (main_peers, probe_peers) = (Arc::new(PeerCounts::default()), Arc::new(PeerCounts::default()));
    let (stopping, _) = tokio::sync::watch::channel(false);
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(st.cfg.header_read_timeout);
    let mut probe_http = hyper::server::conn::http1::Builder::new();
    probe_http.timer(TokioTimer::new()).header_read_timeout(PROBE_HEAD_TIMEOUT).keep_alive(false);
    let mut stopped = std::pin::pin!(stopped);
    loop {
        // A place in either lane (main first), else wait: further connections stay in the
        // listen backlog.
        let lane: (OwnedSemaphorePermit, bool) = tokio::select! {
            biased;
            _ = &mut stopped => break,
            p = main.clone().acquire_owned() => (p.expect("never closed"), true),
            p = probe.clone().acquire_owned() => (p.expect("never closed"), false),
        };
        let (sock, peer) = tokio::select! {
            biased;
            _ = &mut stopped => break,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) if is_connection_error(&e) => continue,
                Err(e) => {
                    // Out of file descriptors, say: wait rather than spin.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            },
        };
        // A main place may have come free since.
        let (permit, is_main) = match lane {
            (p, false) => match main.clone().try_acquire_owned() {
                Ok(m) => {
                    drop(p);
                    (m, true)
                }
                Err(_) => (p, false),
            },
            l => l,
        };
        let place =
            if is_main { main_peers.take(peer.ip(), per_peer) } else { probe_peers.take(peer.ip(), PROBE_PER_PEER) };
        let Some(place) = place else {
            st.metrics.connections_refused.fetch_add(1, Relaxed);
            let msg = if is_main {
                format!("too many connections from your address (max_connections_per_peer {per_peer})")
            } else {
                "too many connections from your address while every place is taken".to_string()
            };
            refuse(&sock, 429, "Too Many Requests", &msg);
            continue;
        };
        let _ = sock.set_nodelay(true);
        // Whether a whole request head has arrived on this connection.
        let started = Arc::new(AtomicBool::new(false));
        let router = TowerToHyperService::new(app.clone());
        let flag = started.clone();
        let svc = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
            flag.store(true, Relaxed);
            if is_main || is_probe(req.method(), req.uri().path()) {
                Either::Left(router.call(req))
            } else {
                Either::Right(std::future::ready(Ok::<Response<Body>, std::convert::Infallible>(lane_full())))
            }
        });
        let builder = if is_main { &http } else { &probe_http };
        let conn = builder.serve_connection(TokioIo::new(sock), svc);
        let mut stop = stopping.subscribe();
        let st = st.clone();
        st.metrics.connections.fetch_add(1, Relaxed);
        tokio::spawn(async move {
            let mut conn = std::pin::pin!(conn);
            let r = tokio::select! {
                r = conn.as_mut() => r,
                _ = async { stop.wait_for(|s| *s).await.map(|_| ()) } => {
                    if started.load(Relaxed) {
                        // Finish the response in flight (if any), then close.
                        conn.as_mut().graceful_shutdown();
                        conn.await
                    } else {
                        Ok(())
                    }
                }
            };
            if let Err(e) = r {
                tracing::debug!("connection: {e}");
            }
            st.metrics.connections.fetch_sub(1, Relaxed);
            drop(place);
            drop(permit);
        });
    }
    drop(listener);
    let _ = stopping.send(true);
    // Every connection has ended once all the places are free again.
    let _ = main.acquire_many(max as u32).await;
    let _ = probe.acquire_many(PROBE_LANE as u32).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_places_come_back() {
        let c = Arc::new(PeerCounts::default());
        let a: IpAddr = "127.0.0.1".parse().unwrap();
        let b: IpAddr = "127.0.0.2".parse().unwrap();
        let p1 = c.take(a, 2).unwrap();
        let _p2 = c.take(a, 2).unwrap();
        assert!(c.take(a, 2).is_none());
        assert!(c.take(b, 2).is_some());
        drop(p1);
        assert!(c.take(a, 2).is_some());
        assert!(is_probe(&Method::GET, "/health") && !is_probe(&Method::POST, "/health"));
        assert!(!is_probe(&Method::GET, "/v1/models"));
    }
}
