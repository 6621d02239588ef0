//! Ollama's `POST /api/pull`: the served model is already here (success at once); a Hugging
//! Face name, as Ollama spells it (`hf.co/OWNER/REPO[:QUANT]`, also `huggingface.co/...`), is
//! downloaded into the Hugging Face cache (src/hub), streamed as Ollama streams a pull
//! (`pulling manifest`, `pulling FILE`, `verifying sha256 digest`, `success`, or `{"error"}`),
//! or answered once with `"stream": false`. One download runs at a time (another pull is a
//! 429 until it ends, even when its client left); a pull whose client left is cancelled (what
//! it fetched is kept for the next pull to resume). Errors name no path of the server's;
//! `serve --no-pull` refuses them (403); behind the API key when one is set. A name of
//! Ollama's own library (`qwen3:8b`) is a 400 saying what this server pulls. The server keeps
//! serving the model it started with: a pulled one is loadable by a later `serve --model
//! hf:...` (the cache finds it without a request).

use crate::hub::{pull_cancellable as hub_pull_cancellable, Options, Spec};
use crate::server::error::{ApiError, Dialect};
use crate::server::models::catalog::hub_name;
use crate::server::AppState;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Cancels a download when dropped before it ended: the pull's client left.
struct Abandon(Arc<AtomicBool>);

impl Drop for Abandon {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// A pull's error as a client sees it: the cache's place on this server's disk is not theirs
/// to know.
fn private(text: &str, opts: &Options) -> String {
    let mut out = text.to_string();
    let mut places = vec![opts.cache.clone()];
    places.extend(std::fs::canonicalize(&opts.cache).ok());
    for p in places {
        out = out.replace(&p.display().to_string(), "$HF_HUB_CACHE");
    }
    out
}

pub(super) async fn pull(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    let r = async {
        let (name, v) = super::info::read_named(&st, &headers, body).await?;
        let stream = match v.get("stream") {
            None | Some(Value::Null) => true,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(ApiError::invalid("stream", "`stream` must be a boolean")),
        };
        if st.check_model(Some(&name)).is_ok() {
            return Ok(Json(json!({"status": "success"})).into_response());
        }
        let Some(hub) = hub_name(&name) else {
            return Err(ApiError::invalid(
                "model",
                format!(
                    "{name:?} is not served here ({} is) and is not a Hugging Face name: this server pulls \
                     hf.co/OWNER/REPO[:QUANT] (GGUF or Transformers repositories), not Ollama's library",
                    st.cfg.served_model_name
                ),
            ));
        };
        if !st.cfg.allow_pull {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "permission_error",
                "this server does not pull models (started with --no-pull)",
            ));
        }
        let spec = Spec::parse(hub).map_err(|e| ApiError::invalid("model", format!("{e:#}")))?;
        // One download at a time: it holds a thread, the disk and the network.
        let Ok(permit) = st.pulls.clone().try_acquire_owned() else {
            return Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "another pull is running: try again when it ends",
            ));
        };
        let opts = st.cfg.hub.clone().unwrap_or_else(Options::from_env);
        // On a models server the pulled model is servable under the name it was pulled by.
        let (pool, pulled) = (st.models.clone(), name.clone());
        // The permit is the download's: it is given back when the download ends, whoever
        // waits for it; the download is cancelled when nobody does (`Abandon`).
        let cancel = Arc::new(AtomicBool::new(false));
        let abandon = Abandon(cancel.clone());
        let job = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            let r = hub_pull_cancellable(&spec, &Options { progress: false, ..opts.clone() }, cancel);
            if let (Ok(path), Some(pool)) = (&r, &pool) {
                pool.add_pulled(&pulled, path.clone());
            }
            r.map_err(|e| private(&format!("{e:#}"), &opts))
        });
        if !stream {
            let r = job.await.map_err(|_| ApiError::internal("the pull panicked"))?;
            drop(abandon);
            return match r {
                Ok(_) => Ok(Json(json!({"status": "success"})).into_response()),
                Err(e) => Err(ApiError::new(StatusCode::BAD_GATEWAY, "api_error", e)),
            };
        }
        let lines = futures_util::stream::unfold((0u8, Some(job), abandon), |(stage, job, abandon)| async move {
            let line = |v: Value| Ok::<_, std::convert::Infallible>(Bytes::from(format!("{v}\n")));
            match (stage, job) {
                (0, job) => Some((line(json!({"status": "pulling manifest"})), (1, job, abandon))),
                (1, Some(job)) => {
                    let next = match job.await {
                        Ok(Ok(path)) => {
                            let file = path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
                            json!({"status": format!("pulling {file}"), "completed": 1, "total": 1})
                        }
                        Ok(Err(e)) => return Some((line(json!({"error": e})), (9, None, abandon))),
                        Err(_) => return Some((line(json!({"error": "the pull panicked"})), (9, None, abandon))),
                    };
                    Some((line(next), (2, None, abandon)))
                }
                (2, _) => Some((line(json!({"status": "verifying sha256 digest"})), (3, None, abandon))),
                (3, _) => Some((line(json!({"status": "success"})), (9, None, abandon))),
                _ => None,
            }
        });
        let mut r = Body::from_stream(lines).into_response();
        r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/x-ndjson"));
        Ok(r)
    }
    .await;
    r.unwrap_or_else(|e| e.response_in(Dialect::Ollama))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_names() {
        assert_eq!(hub_name("hf.co/ggml-org/Qwen3-8B-GGUF:Q4_K_M"), Some("ggml-org/Qwen3-8B-GGUF:Q4_K_M"));
        assert_eq!(hub_name("huggingface.co/Qwen/Qwen3-8B:latest"), Some("Qwen/Qwen3-8B"));
        assert_eq!(hub_name("qwen3:8b"), None);
    }
}
