//! Ollama's model routes: `GET /api/tags` and `/api/ps` (the one served model), `POST
//! /api/show`, `GET /api/version`; `/api/pull` of the served model succeeds at once, and what
//! cannot apply to a server of one model loaded at start (pulling another, create, copy,
//! delete, push, blobs) answers 400 saying so.

use super::model_name;
use crate::server::error::{ApiError, Dialect};
use crate::server::reasoning::ReasoningChoice;
use crate::server::AppState;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

/// The Ollama API version reported: the one whose routes and fields this server follows.
pub const OLLAMA_API_VERSION: &str = "0.12.0";

/// `t` as RFC 3339 in UTC with nanoseconds (`2026-12-04T20:31:05.123456789Z`).
pub(in crate::server) fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:09}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        d.subsec_nanos()
    )
}

/// What the model's file says of it, as Ollama's `details`: the format, and the parameter
/// count and quantization as its name gives them (`SmolLM2-135M-Instruct.Q4_1.gguf`).
fn details(st: &AppState) -> Value {
    let path = st.cfg.model_path.as_deref();
    let count = *st.parameter_count.get_or_init(|| path.and_then(parameter_count));
    details_of(path, count)
}

/// Ollama's `details` of the model at `path` with `count` parameters (when known).
pub(in crate::server) fn details_of(path: Option<&std::path::Path>, count: Option<u64>) -> Value {
    let name = path.and_then(|p| p.file_name()).map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let format = if name.to_ascii_lowercase().ends_with(".gguf") { "gguf" } else { "safetensors" };
    let size = count.map(human_count).or_else(|| size_in_name(&name));
    let lower = name.to_ascii_lowercase();
    let quant = [
        "q2_k", "q3_k", "q4_0", "q4_1", "q4_k", "q5_0", "q5_1", "q5_k", "q6_k", "q8_0", "iq", "mxfp4", "f16", "bf16",
        "f32",
    ]
    .iter()
    .find_map(|q| lower.find(q).map(|i| name[i..].split(['.', '-']).next().unwrap_or(q).to_ascii_uppercase()));
    json!({
        "parent_model": "",
        "format": format,
        "family": "",
        "families": null,
        "parameter_size": size.unwrap_or_default(),
        "quantization_level": quant.unwrap_or_default(),
    })
}

/// The parameters of a GGUF file (its tensors' elements), from its header; None for another
/// kind of model or an unreadable file.
pub(in crate::server) fn parameter_count(path: &std::path::Path) -> Option<u64> {
    let g = crate::formats::gguf::GgufFile::open(path).ok()?;
    Some(g.tensors.iter().map(|t| t.n_elements()).sum())
}

/// A parameter count as Ollama shows it: `494.03M`, `7.6B`.
fn human_count(n: u64) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.1}B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.2}M", n as f64 / 1e6),
        n => format!("{:.2}K", n as f64 / 1e3),
    }
}

/// The parameter count a model's name gives (`Qwen2.5-Coder-0.5B-Instruct` -> `0.5B`), where
/// the file cannot be counted.
fn size_in_name(name: &str) -> Option<String> {
    let stem = name.strip_suffix(".gguf").unwrap_or(name);
    stem.split(['-', '_']).find_map(|w| {
        let (num, unit) = w.split_at(w.len().saturating_sub(1));
        let ok = matches!(unit, "M" | "B" | "m" | "b") && !num.is_empty() && num.parse::<f64>().is_ok();
        ok.then(|| w.to_ascii_uppercase())
    })
}

/// The model file's size (0 for a directory or when unknown) and modification time.
fn file_facts(st: &AppState) -> (u64, SystemTime) {
    let m = st.cfg.model_path.as_deref().and_then(|p| std::fs::metadata(p).ok());
    let size = m.as_ref().filter(|m| m.is_file()).map_or(0, |m| m.len());
    (size, m.and_then(|m| m.modified().ok()).unwrap_or(UNIX_EPOCH))
}

/// A stable digest for the served model (of its name, size and time; the file is not read).
fn digest(st: &AppState, size: u64, modified: SystemTime) -> String {
    digest_of(&st.cfg.served_model_name, size, modified)
}

/// A stable digest for model `name` (of its name, size and time; the file is not read).
pub(in crate::server) fn digest_of(name: &str, size: u64, modified: SystemTime) -> String {
    use sha2::{Digest, Sha256};
    let secs = modified.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let h = Sha256::digest(format!("{name}\0{size}\0{secs}"));
    h.iter().map(|b| format!("{b:02x}")).collect()
}

/// The served model's name as Ollama lists it (`name:latest` unless it has a tag).
fn listed_name(st: &AppState) -> String {
    listed(&st.cfg.served_model_name)
}

/// A model name as Ollama lists it (`name:latest` unless it has a tag).
pub(in crate::server) fn listed(n: &str) -> String {
    if n.contains(':') {
        n.to_string()
    } else {
        format!("{n}:latest")
    }
}

fn entry(st: &AppState) -> Value {
    let (size, modified) = file_facts(st);
    json!({
        "name": listed_name(st),
        "model": listed_name(st),
        "modified_at": rfc3339(modified),
        "size": size,
        "digest": digest(st, size, modified),
        "details": details(st),
    })
}

pub(super) async fn tags(State(st): State<Arc<AppState>>) -> Response {
    if let Some(pool) = &st.models {
        return crate::server::models::ollama_tags(pool);
    }
    if let Err(e) = st.engine() {
        return e.response_in(Dialect::Ollama);
    }
    Json(json!({"models": [entry(&st)]})).into_response()
}

pub(super) async fn ps(State(st): State<Arc<AppState>>) -> Response {
    if let Some(pool) = &st.models {
        return crate::server::models::ollama_ps(pool);
    }
    if let Err(e) = st.engine() {
        return e.response_in(Dialect::Ollama);
    }
    let mut e = entry(&st);
    let size = e["size"].clone();
    let o = e.as_object_mut().expect("an object");
    o.remove("modified_at");
    o.insert("size_vram".into(), size);
    // Loaded until the server stops.
    o.insert("expires_at".into(), json!(rfc3339(UNIX_EPOCH + std::time::Duration::from_secs(253_402_300_799))));
    Json(json!({"models": [e]})).into_response()
}

pub(super) async fn version() -> Response {
    Json(json!({"version": OLLAMA_API_VERSION})).into_response()
}

/// The request body's `model` (or Ollama's older `name`) and the whole body. The body is parsed
/// like every other (bounded JSON, on the request workers).
pub(super) async fn read_named(
    st: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<(String, serde_json::Map<String, Value>), ApiError> {
    let data =
        crate::server::body::read(headers, body, st.cfg.max_request_body_bytes, st.cfg.body_read_timeout).await?;
    let v = st.work.run_sized(data.len(), move || crate::server::json::parse(&data, None)).await??.obj;
    let m = v.get("model").or_else(|| v.get("name")).filter(|m| !m.is_null());
    let Some(m) = m else { return Err(ApiError::invalid("model", "`model` is required")) };
    let Some(name) = model_name(m).as_str().map(str::to_string) else {
        return Err(ApiError::invalid("model", "`model` must be a string"));
    };
    Ok((name, v))
}

/// The request body's model, checked against the served model.
async fn named_model(st: &AppState, headers: &HeaderMap, body: Body) -> Result<(), ApiError> {
    let (name, _) = read_named(st, headers, body).await?;
    st.check_model(Some(&name))
}

pub(super) async fn show(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    let r = async {
        let engine = st.engine()?.clone();
        named_model(&st, &headers, body).await?;
        let (size, modified) = file_facts(&st);
        let facts = ShowFacts {
            template: engine.tokenizer.chat_template_source().unwrap_or_default(),
            file: st.cfg.model_file_name().unwrap_or_default(),
            size,
            modified,
            details: details(&st),
            context_length: engine.info.max_model_len(),
            vocab: engine.info.vocab,
        };
        Ok::<_, ApiError>(Json(show_body(&st.cfg, facts)).into_response())
    }
    .await;
    r.unwrap_or_else(|e| e.response_in(Dialect::Ollama))
}

/// What `/api/show` tells of a model.
pub(in crate::server) struct ShowFacts<'a> {
    pub template: &'a str,
    /// The model file's (or directory's) name.
    pub file: String,
    pub size: u64,
    pub modified: SystemTime,
    pub details: Value,
    pub context_length: usize,
    pub vocab: usize,
}

/// `/api/show`'s answer: the server's sampling defaults, the template and what it makes the
/// model capable of (tools where it renders them, thinking where the reasoning parser applies).
pub(in crate::server) fn show_body(cfg: &crate::server::ServerConfig, f: ShowFacts) -> Value {
    let mut caps = vec!["completion"];
    if f.template.contains("tools") {
        caps.push("tools");
    }
    if cfg.reasoning_parser != ReasoningChoice::None && cfg.reasoning_parser.resolve(Some(f.template)).is_some() {
        caps.push("thinking");
    }
    json!({
        "license": "",
        "modelfile": format!("# served by torus-wgpu\nFROM {}\n", f.file),
        "parameters": format!(
            "temperature {}\ntop_p {}\ntop_k {}",
            cfg.default_temperature, cfg.default_top_p, cfg.default_top_k
        ),
        "template": f.template,
        "details": f.details,
        "model_info": {
            "general.file_size": f.size,
            "general.context_length": f.context_length,
            "general.vocab_size": f.vocab,
        },
        "capabilities": caps,
        "modified_at": rfc3339(f.modified),
    })
}

pub(super) async fn unsupported() -> Response {
    ApiError::invalid(
        "model",
        "this server serves one model, loaded at start: models cannot be created, copied, deleted or pushed here",
    )
    .response_in(Dialect::Ollama)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_sizes_read_as_ollama_shows_them() {
        assert_eq!(human_count(494_032_768), "494.03M");
        assert_eq!(human_count(7_615_616_512), "7.6B");
        assert_eq!(size_in_name("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf").as_deref(), Some("0.5B"));
        assert_eq!(size_in_name("SmolLM2-135M-Instruct.Q4_1.gguf").as_deref(), Some("135M"));
        assert_eq!(size_in_name("model.gguf"), None);
    }
}
