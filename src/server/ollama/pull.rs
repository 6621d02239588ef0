//! Ollama's `POST /api/pull`: the served model is already here (success at once); a Hugging
//! Face name, as Ollama spells it (`hf.co/OWNER/REPO[:QUANT]`, also `huggingface.co/...`), is
//! downloaded into the Hugging Face cache (src/hub), streamed as Ollama streams a pull
//! (`pulling manifest`, `pulling FILE`, `verifying sha256 digest`, `success`, or `{"error"}`),
//! or answered once with `"stream": false`. One pull runs at a time (another is a 429);
//! `serve --no-pull` refuses them (403); behind the API key when one is set. A name of
//! Ollama's own library (`qwen3:8b`) is a 400 saying what this server pulls. The server keeps
//! serving the model it started with: a pulled one is loadable by a later `serve --model
//! hf:...` (the cache finds it without a request).

use crate::hub::{pull as hub_pull, Options, Spec};
use crate::server::error::{ApiError, Dialect};
use crate::server::models::catalog::hub_name;
use crate::server::AppState;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use std::sync::{Arc, OnceLock};
use tokio::sync::Semaphore;

/// One pull at a time: a download holds a thread and the disk.
fn one_at_a_time() -> &'static Semaphore {
    static S: OnceLock<Semaphore> = OnceLock::new();
    S.get_or_init(|| Semaphore::new(1))
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
        let Ok(permit) = one_at_a_time().try_acquire() else {
            return Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "another pull is running: try again when it ends",
            ));
        };
        let opts = st.cfg.hub.clone().unwrap_or_else(Options::from_env);
        // On a models server the pulled model is servable under the name it was pulled by.
        let (pool, pulled) = (st.models.clone(), name.clone());
        let job = tokio::task::spawn_blocking(move || {
            let r = hub_pull(&spec, &Options { progress: false, ..opts });
            if let (Ok(path), Some(pool)) = (&r, &pool) {
                pool.add_pulled(&pulled, path.clone());
            }
            r
        });
        if !stream {
            let r = job.await.map_err(|_| ApiError::internal("the pull panicked"))?;
            drop(permit);
            return match r {
                Ok(_) => Ok(Json(json!({"status": "success"})).into_response()),
                Err(e) => Err(ApiError::new(StatusCode::BAD_GATEWAY, "api_error", format!("{e:#}"))),
            };
        }
        // The permit goes with the stream (a client that leaves does not stop the download,
        // which finishes into the cache).
        let permit = Arc::new(permit);
        let lines = futures_util::stream::unfold((0u8, Some(job), permit), |(stage, job, permit)| async move {
            let line = |v: Value| Ok::<_, std::convert::Infallible>(Bytes::from(format!("{v}\n")));
            match (stage, job) {
                (0, job) => Some((line(json!({"status": "pulling manifest"})), (1, job, permit))),
                (1, Some(job)) => {
                    let next = match job.await {
                        Ok(Ok(path)) => {
                            let file = path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
                            json!({"status": format!("pulling {file}"), "completed": 1, "total": 1})
                        }
                        Ok(Err(e)) => return Some((line(json!({"error": format!("{e:#}")})), (9, None, permit))),
                        Err(_) => return Some((line(json!({"error": "the pull panicked"})), (9, None, permit))),
                    };
                    Some((line(next), (2, None, permit)))
                }
                (2, _) => Some((line(json!({"status": "verifying sha256 digest"})), (3, None, permit))),
                (3, _) => Some((line(json!({"status": "success"})), (9, None, permit))),
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
