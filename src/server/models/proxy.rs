//! Passing a request to its model's process: the model named by the body's `model` (Ollama's
//! `name`) or the query's `model=`, the body read once within the server's limits, the
//! client's headers but its key (the process has its own), the answer streamed back as it
//! comes (a client that leaves closes the stream to the process, which stops the request
//! there).

use super::catalog::Entry;
use super::keep_alive::KeepAlive;
use super::{unknown, Pool};
use crate::server::error::ApiError;
use crate::server::AppState;
use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderName, Method};
use axum::response::Response;
use futures_util::StreamExt;
use std::sync::Arc;

/// Headers that belong to one connection, not to the request (or that the process gets its own
/// of).
fn hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "transfer-encoding"
            | "te"
            | "trailer"
            | "upgrade"
            | "host"
            | "content-length"
            | "authorization"
            | "x-api-key"
    )
}

/// What the models server reads of a body.
#[derive(Debug, Default, PartialEq)]
struct Said {
    /// `model`, else Ollama's `name`.
    model: Option<String>,
    /// Ollama's `keep_alive`, when given (Err: not a duration).
    keep_alive: Option<Result<KeepAlive, String>>,
    /// Ollama's "unload": `keep_alive` 0 with no prompt or messages, as `ollama stop` sends.
    unload: bool,
}

/// What a body says; Err(why) for a body that is not JSON.
fn named(data: &[u8]) -> Result<Said, String> {
    #[derive(serde::Deserialize)]
    struct Named {
        model: Option<serde_json::Value>,
        name: Option<serde_json::Value>,
        keep_alive: Option<serde_json::Value>,
        prompt: Option<serde::de::IgnoredAny>,
        messages: Option<Vec<serde::de::IgnoredAny>>,
    }
    let n: Named = serde_json::from_slice(data).map_err(|e| e.to_string())?;
    let keep_alive = n.keep_alive.as_ref().filter(|v| !v.is_null()).map(KeepAlive::from_json);
    let zero = matches!(keep_alive, Some(Ok(KeepAlive::For(d))) if d.is_zero());
    let unload = zero && n.prompt.is_none() && n.messages.is_none_or(|m| m.is_empty());
    Ok(Said { model: n.model.or(n.name).and_then(|v| v.as_str().map(str::to_string)), keep_alive, unload })
}

/// The `model=` of a query string (percent-decoded).
fn query_model(query: Option<&str>) -> Option<String> {
    let q = query?;
    q.split('&').find_map(|kv| {
        let v = kv.strip_prefix("model=")?;
        let bytes = v.replace('+', " ").into_bytes();
        let mut out = Vec::with_capacity(bytes.len());
        let mut i = 0;
        while i < bytes.len() {
            let hex = |b: u8| (b as char).to_digit(16);
            match (bytes[i], bytes.get(i + 1).and_then(|&b| hex(b)), bytes.get(i + 2).and_then(|&b| hex(b))) {
                (b'%', Some(h), Some(l)) => {
                    out.push((h * 16 + l) as u8);
                    i += 3;
                }
                (b, _, _) => {
                    out.push(b);
                    i += 1;
                }
            }
        }
        String::from_utf8(out).ok()
    })
}

/// Ollama's answer to an unload (`ollama stop`): the model is unloaded now if idle, else once
/// its requests end.
fn unloaded(pool: &Pool, e: &Entry, chat: bool) -> Response {
    pool.stop(&e.name);
    let now = crate::server::ollama::info::rfc3339(std::time::SystemTime::now());
    let mut v = serde_json::json!({"model": e.name, "created_at": now, "done": true, "done_reason": "unload"});
    if chat {
        v["message"] = serde_json::json!({"role": "assistant", "content": ""});
    } else {
        v["response"] = serde_json::json!("");
    }
    axum::response::IntoResponse::into_response(axum::Json(v))
}

/// The model a request is for: the one it names, or the only one there is.
fn choose(pool: &Pool, name: Option<String>, unparsed: Option<String>) -> Result<Arc<Entry>, ApiError> {
    match name {
        Some(n) => pool.find(&n).ok_or_else(|| unknown(pool, &n)),
        None => {
            let all = pool.entries();
            if all.len() == 1 {
                return Ok(all[0].clone());
            }
            if let Some(why) = unparsed {
                return Err(ApiError::bad_request(format!("the request body is not valid JSON: {why}")));
            }
            let names: Vec<&str> = all.iter().take(20).map(|e| e.name.as_str()).collect();
            Err(ApiError::invalid(
                "model",
                format!("`model` is required: this server serves several models ({})", names.join(", ")),
            ))
        }
    }
}

/// Reads `req`, finds (and if need be loads) its model, and passes it on.
pub(super) async fn pass(st: &Arc<AppState>, pool: &Arc<Pool>, req: Request) -> Result<Response, ApiError> {
    let (parts, body) = req.into_parts();
    let mut keep_alive = None;
    let (data, name, unparsed) = if parts.method == Method::GET || parts.method == Method::HEAD {
        (Vec::new(), query_model(parts.uri.query()), None)
    } else {
        let data =
            crate::server::body::read(&parts.headers, body, st.cfg.max_request_body_bytes, st.cfg.body_read_timeout)
                .await?;
        let (data, r) = st
            .work
            .run_sized(data.len(), move || {
                let r = named(&data);
                (data, r)
            })
            .await?;
        match r {
            Ok(said) => {
                // `keep_alive` is Ollama's (its routes are /api/...).
                let ollama = parts.uri.path().starts_with("/api/");
                if ollama {
                    match said.keep_alive {
                        Some(Err(why)) => return Err(ApiError::invalid("keep_alive", why)),
                        Some(Ok(k)) => keep_alive = Some(k),
                        None => {}
                    }
                }
                let generate = matches!(parts.uri.path(), "/api/generate" | "/api/chat");
                if said.unload && generate && said.model.is_some() {
                    let entry = choose(pool, said.model, None)?;
                    return Ok(unloaded(pool, &entry, parts.uri.path() == "/api/chat"));
                }
                (data, said.model.or_else(|| query_model(parts.uri.query())), None)
            }
            Err(why) => (data, None, Some(why)),
        }
    };
    let entry = choose(pool, name, unparsed)?;
    if parts.uri.path() == "/api/show" && !pool.is_loaded(&entry.name) {
        return super::show_unloaded(st, pool, &entry).await;
    }
    let limit = st.cfg.request_timeout.unwrap_or(pool.cfg.load_timeout).max(pool.cfg.load_timeout);
    let lease = pool.acquire(entry, limit).await?;
    lease.child.set_keep_alive(keep_alive.unwrap_or(pool.cfg.keep_alive));
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let url = format!("http://127.0.0.1:{}{path}", lease.child.port);
    let mut rb = pool.http.request(parts.method.clone(), url).bearer_auth(&lease.child.key);
    for (k, v) in parts.headers.iter().filter(|(k, _)| !hop(k)) {
        rb = rb.header(k, v);
    }
    let resp = rb.body(data).send().await.map_err(|e| {
        ApiError::new(
            axum::http::StatusCode::BAD_GATEWAY,
            "api_error",
            format!("model {:?} did not answer: {e}", lease.child.name),
        )
    })?;
    let mut out = Response::builder().status(resp.status());
    for (k, v) in resp.headers().iter().filter(|(k, _)| !hop(k) || *k == header::CONTENT_LENGTH) {
        out = out.header(k, v);
    }
    // The lease goes with the body: the model stays loaded until its answer has been sent.
    let stream = resp.bytes_stream().map(move |chunk| {
        let _held = &lease;
        chunk
    });
    out.body(Body::from_stream(stream)).map_err(|e| ApiError::internal(format!("bad answer from the model: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_from_bodies_and_queries() {
        let said = |m: Option<&str>, k: Option<KeepAlive>, unload| Said {
            model: m.map(str::to_string),
            keep_alive: k.map(Ok),
            unload,
        };
        let zero = Some(KeepAlive::For(std::time::Duration::ZERO));
        assert_eq!(
            named(br#"{"model": "a", "messages": [{"x": [1, {"y": 2}]}]}"#).unwrap(),
            said(Some("a"), None, false)
        );
        assert_eq!(named(br#"{"name": "b:latest"}"#).unwrap(), said(Some("b:latest"), None, false));
        assert_eq!(named(br#"{"prompt": "p"}"#).unwrap(), said(None, None, false));
        assert_eq!(named(br#"{"model": "a", "keep_alive": 0}"#).unwrap(), said(Some("a"), zero, true));
        assert_eq!(
            named(br#"{"model": "a", "keep_alive": "0s", "messages": []}"#).unwrap(),
            said(Some("a"), zero, true)
        );
        assert_eq!(named(br#"{"model": "a", "keep_alive": 0, "prompt": "hi"}"#).unwrap(), said(Some("a"), zero, false));
        let five = Some(KeepAlive::For(std::time::Duration::from_secs(300)));
        assert_eq!(named(br#"{"model": "a", "keep_alive": "5m"}"#).unwrap(), said(Some("a"), five, false));
        assert!(matches!(named(br#"{"model": "a", "keep_alive": "soon"}"#).unwrap().keep_alive, Some(Err(_))));
        assert!(named(b"{nope").is_err());
        assert_eq!(query_model(Some("x=1&model=hf.co%2Fa%2Fb%3AQ4_K_M")).as_deref(), Some("hf.co/a/b:Q4_K_M"));
        assert_eq!(query_model(Some("fail_on_no_slot=1")), None);
    }
}
