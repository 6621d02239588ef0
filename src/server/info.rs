//! The routes that report on the server: `/health`, `/metrics`, `/version`, `/server_info`,
//! `/v1/models` and `/v1/models/{id}`.

use super::{metrics, ApiError, AppState};
use axum::extract::{Path as UrlPath, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use std::sync::Arc;

pub(super) async fn version() -> Response {
    Json(json!({"version": env!("CARGO_PKG_VERSION")})).into_response()
}

/// What a router or operator may want to know about this replica (routers probe it, as they
/// do SGLang's): the model names, the context length and the KV cache. The engine's fields are
/// null while the model loads.
pub(super) async fn server_info(State(st): State<Arc<AppState>>) -> Response {
    if let Some(pool) = &st.models {
        return super::models::server_info(&st, pool);
    }
    let e = st.engine.get();
    let dtype = match st.cfg.kv_cache_dtype {
        crate::config::KvDtype::F16 => "f16",
        crate::config::KvDtype::F32 => "f32",
    };
    Json(json!({
        "server": "torus-wgpu",
        "version": env!("CARGO_PKG_VERSION"),
        "served_model_name": st.cfg.served_model_name,
        "model_aliases": st.cfg.model_aliases,
        "loaded": e.is_some(),
        "max_model_len": e.map(|e| e.info.max_model_len()),
        "block_size": e.map(|e| e.info.block_size),
        "num_gpu_blocks": e.map(|e| e.info.num_blocks),
        "max_total_num_tokens": e.map(|e| e.info.num_blocks * e.info.block_size),
        "kv_cache_dtype": dtype,
        "enable_prefix_caching": st.cfg.share_prompt_prefill,
        "adapter": e.map(|e| e.info.adapter.clone()),
        "request_workers": st.work.threads(),
    }))
    .into_response()
}

/// 200 when the model is loaded and every pipeline stage answers (remote workers are asked
/// now); otherwise 503 naming what is missing.
pub(super) async fn health(State(st): State<Arc<AppState>>) -> Response {
    if let Some(pool) = &st.models {
        return super::models::health(pool);
    }
    let engine = match st.engine() {
        Ok(e) => e,
        Err(e) => return e.into_response(),
    };
    let Some(stages) = engine.stages.clone() else {
        return (StatusCode::OK, Json(json!({"status": "ok"}))).into_response();
    };
    let mut list = Vec::new();
    let mut down = Vec::new();
    for h in stages.iter() {
        let r = match &h.address {
            Some(addr) => crate::exec::remote::probe(addr, &h.link, std::time::Duration::from_secs(2))
                .await
                .map(|_| ())
                .map_err(|e| format!("{e:#}")),
            None => h.get(),
        };
        if let Err(e) = &r {
            down.push(format!(
                "pipeline stage {} ({}, layers {}..{}): {e}",
                h.stage, h.name, h.layers.start, h.layers.end
            ));
        }
        list.push(json!({
            "stage": h.stage,
            "name": h.name,
            "address": h.address,
            "layers": [h.layers.start, h.layers.end],
            "ok": r.is_ok(),
            "error": r.err(),
        }));
    }
    if down.is_empty() {
        return (StatusCode::OK, Json(json!({"status": "ok", "stages": list}))).into_response();
    }
    let body = json!({
        "status": "unavailable",
        "stages": list,
        "error": {"message": down.join("; "), "type": "service_unavailable", "param": null, "code": "stage_unavailable"},
    });
    (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
}

pub(super) async fn prometheus(State(st): State<Arc<AppState>>) -> Response {
    if let Some(pool) = &st.models {
        return super::models::metrics(&st, pool).await;
    }
    let snap = st.engine.get().map(|e| e.metrics.snapshot());
    let labels = metrics::VllmLabels {
        model_name: st.cfg.served_model_name.clone(),
        block_size: st.engine.get().map_or(0, |e| e.info.block_size),
        cache_dtype: match st.cfg.kv_cache_dtype {
            crate::config::KvDtype::F16 => "auto".into(),
            crate::config::KvDtype::F32 => "fp32".into(),
        },
        prefix_caching: st.cfg.share_prompt_prefill,
    };
    let mut text = st.metrics.render(snap.as_ref(), &labels);
    if let Some(stages) = st.engine.get().and_then(|e| e.stages.clone()) {
        // As the engine last saw each stage (/health asks the workers afresh).
        text.push_str(
            "# HELP torus_pipeline_stage_up Whether the pipeline stage's last step succeeded.\n\
             # TYPE torus_pipeline_stage_up gauge\n",
        );
        for h in stages.iter() {
            text.push_str(&format!("torus_pipeline_stage_up{{stage=\"{}\"}} {}\n", h.stage, h.get().is_ok() as u8));
        }
    }
    let mut r = text.into_response();
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"));
    r
}

fn model_card(st: &AppState, name: &str) -> serde_json::Value {
    let mut card = json!({
        "id": name,
        "object": "model",
        "created": st.started,
        "owned_by": "torus-wgpu",
    });
    if let Some(e) = st.engine.get() {
        card["max_model_len"] = json!(e.info.max_model_len());
    }
    card
}

pub(super) async fn list_models(State(st): State<Arc<AppState>>) -> Response {
    if let Some(pool) = &st.models {
        return super::models::list_models(pool);
    }
    let data: Vec<serde_json::Value> = st.model_names().map(|n| model_card(&st, n)).collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

pub(super) async fn get_model(
    State(st): State<Arc<AppState>>,
    model: Result<UrlPath<String>, axum::extract::rejection::PathRejection>,
) -> Response {
    // A path that does not decode (invalid UTF-8 in percent escapes) names no model.
    let Ok(UrlPath(model)) = model else { return ApiError::not_found("no such model").into_response() };
    if let Some(pool) = &st.models {
        return super::models::get_model(pool, &model);
    }
    match st.check_model(Some(&model)) {
        Ok(()) => Json(model_card(&st, &model)).into_response(),
        Err(e) => e.into_response(),
    }
}
