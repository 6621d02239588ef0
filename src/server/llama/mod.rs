//! llama-server's own routes, for the tools written against it (SillyTavern's llama.cpp
//! backend, the llama.cpp web UI, editor plugins): `POST /completion` (see `completion`),
//! `GET /props` (the chat template, the default
//! generation settings, `total_slots`, the model file's name, build info) and
//! `POST /apply-template` (`{"messages": [...]}` -> `{"prompt": text}`, the chat template
//! applied as for a chat completion, a final assistant message continued), `GET /slots` (see
//! `slots`). All are behind the API key when one is set.

use super::error::ApiError;
use super::params::{parse_messages, Fields};
use super::prefill;
use super::tools::ToolRequest;
use super::AppState;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use std::sync::Arc;

mod completion;
mod infill;
mod slots;

pub(crate) use infill::Fim;

pub(super) fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/props", get(props))
        .route("/slots", get(slots::slots))
        .route("/apply-template", post(apply_template))
        .route("/completion", post(completion::completion))
        .route("/completions", post(completion::completion))
        .route("/infill", post(completion::infill))
}

/// llama-server's `/props`.
async fn props(State(st): State<Arc<AppState>>) -> Response {
    let r = async {
        let e = st.engine()?;
        let tok = &e.tokenizer;
        let text = |id: Option<u32>| id.map(|i| tok.decode(&[i], false)).unwrap_or_default();
        let model = st.cfg.model_file_name().unwrap_or_else(|| st.cfg.served_model_name.clone());
        let params = json!({
            "n_predict": -1,
            "temperature": st.cfg.default_temperature,
            "top_k": st.cfg.default_top_k,
            "top_p": st.cfg.default_top_p,
            "min_p": 0.0,
            "repeat_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "seed": -1,
            "stop": [],
            "ignore_eos": false,
            "stream": false,
        });
        Ok::<_, ApiError>(
            Json(json!({
                "default_generation_settings": {
                    "id": 0,
                    "id_task": -1,
                    "n_ctx": e.info.max_model_len(),
                    "speculative": st.cfg.speculative,
                    "is_processing": false,
                    "params": params,
                },
                "total_slots": st.cfg.total_slots,
                "model_path": model,
                "model_alias": st.cfg.served_model_name,
                "chat_template": tok.chat_template_source().unwrap_or_default(),
                "bos_token": text(tok.bos_token_id()),
                "eos_token": text(tok.eos_token_ids().first().copied()),
                "modalities": {"vision": false, "audio": false},
                "build_info": format!("torus-wgpu {}", env!("CARGO_PKG_VERSION")),
                "webui": st.cfg.webui,
            }))
            .into_response(),
        )
    }
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

/// llama-server's `/apply-template`: the prompt text a chat request's messages become.
async fn apply_template(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    let r = async {
        let (engine, parsed) = super::tokenize::read_body(&st, &headers, body, None).await?;
        let f = Fields(&parsed.obj);
        let messages = parse_messages(f.get("messages"))?;
        let tools = ToolRequest::parse(&f)?;
        let kwargs = f.template_kwargs()?;
        let end = prefill::turn_end(&f, &messages)?;
        drop(parsed);
        let tok = engine.tokenizer.clone();
        let prompt =
            st.work.run(move || prefill::render(&tok, &messages, tools.as_ref(), end, kwargs.as_ref())).await??;
        Ok::<_, ApiError>(Json(json!({ "prompt": Value::String(prompt) })).into_response())
    }
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}
