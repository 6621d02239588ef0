//! Request bodies: the `Content-Type`, and the size and the time they may take to arrive.
//! Parsing them is `json` (bounded memory) and `token_ids` (token-id prompts).

use super::error::ApiError;
use axum::body::Body;
use axum::http::{header, HeaderMap};
use futures_util::StreamExt;
use std::time::Duration;

/// After a body turned out too large, read at most this much more of it so the client sees the
/// 413 instead of a reset connection.
const DRAIN_CAP: usize = 64 << 20;

/// 415 unless the body is declared JSON (`application/json`, any parameters), or declared
/// nothing by a client that is not a browser. Browsers send a cross-site POST without a
/// preflight only as `text/plain`, form or multipart data, always with an `Origin` header, so
/// this keeps other web pages from reaching a server on localhost; clients that send no type at
/// all (litellm's Ollama provider; Ollama reads their bodies as JSON) send no `Origin` either.
pub fn check_json_content_type(headers: &HeaderMap) -> Result<(), ApiError> {
    let ct = headers.get(header::CONTENT_TYPE).map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    let mime = ct.as_deref().map(|c| c.split(';').next().unwrap_or("").trim().to_ascii_lowercase());
    match mime.as_deref() {
        Some("application/json") => Ok(()),
        None if !headers.contains_key(header::ORIGIN) => Ok(()),
        _ => Err(ApiError::unsupported_media_type(ct.as_deref())),
    }
}

/// The body's bytes: 413 over `limit` bytes, 408 if it has not all arrived within `timeout`
/// (None: no limit) of the request's head, 415 if it is not declared JSON. The body is read
/// even when it will be refused, so that the connection can carry the next request.
pub async fn read(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
    timeout: Option<Duration>,
) -> Result<Vec<u8>, ApiError> {
    let read = read_limited(headers, body, limit);
    let data = match timeout {
        None => read.await,
        Some(t) => tokio::time::timeout(t, read).await.unwrap_or_else(|_| Err(ApiError::body_timed_out(t))),
    }?;
    check_json_content_type(headers)?;
    Ok(data)
}

async fn read_limited(headers: &HeaderMap, body: Body, limit: usize) -> Result<Vec<u8>, ApiError> {
    let declared =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse::<u64>().ok());
    let mut chunks = body.into_data_stream();
    let mut data = Vec::new();
    let mut over = declared.is_some_and(|n| n > limit as u64);
    if !over {
        if let Some(n) = declared {
            data.reserve_exact(n as usize);
        }
        while let Some(chunk) = chunks.next().await {
            let chunk = chunk.map_err(|e| ApiError::bad_request(format!("could not read the request body: {e}")))?;
            if data.len() + chunk.len() > limit {
                over = true;
                break;
            }
            data.extend_from_slice(&chunk);
        }
    }
    if over {
        if declared.is_none_or(|n| n <= (limit + DRAIN_CAP) as u64) {
            let mut drained = 0;
            while let Some(Ok(c)) = chunks.next().await {
                drained += c.len();
                if drained > DRAIN_CAP {
                    break;
                }
            }
        }
        return Err(ApiError::too_large(limit));
    }
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_type_must_be_json() {
        let mut h = HeaderMap::new();
        // No type: JSON from a client that is not a browser; 415 with an Origin (a browser's).
        assert!(check_json_content_type(&h).is_ok());
        h.insert(header::ORIGIN, "http://evil.example".parse().unwrap());
        assert_eq!(check_json_content_type(&h).unwrap_err().status.as_u16(), 415);
        for (ct, ok) in [
            ("application/json", true),
            ("Application/JSON; charset=utf-8", true),
            ("text/plain", false),
            ("application/x-www-form-urlencoded", false),
            ("multipart/form-data; boundary=x", false),
            ("application/jsonx", false),
        ] {
            h.insert(header::CONTENT_TYPE, ct.parse().unwrap());
            assert_eq!(check_json_content_type(&h).is_ok(), ok, "{ct}");
        }
    }
}
