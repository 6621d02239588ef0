//! The chat page at `GET /`: one HTML file (its CSS and script inline) embedded in the binary,
//! so nothing is fetched from anywhere else. It calls the OpenAI routes relative to its own
//! address, so it works behind a path prefix; with `--api-key` it asks for the key and keeps
//! it in the browser. `--no-webui` leaves it out (then `/` is a 404).

use super::AppState;
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use std::sync::Arc;

/// The page.
pub const INDEX_HTML: &str = include_str!("webui/index.html");

/// What the page may load and call: only itself and this server.
const CSP: &str = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                   img-src data:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

pub(super) fn routes() -> Router<Arc<AppState>> {
    Router::new().route("/", get(index)).route("/index.html", get(index))
}

async fn index() -> Response {
    let mut r = INDEX_HTML.into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/html; charset=utf-8"));
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}
