//! What a models server says of its models: `/v1/models` (every model, with `status` loaded /
//! loading / unloaded, as llama.cpp's router says it), `/v1/models/{id}`, Ollama's `/api/tags`
//! (every model) and `/api/ps` (the loaded ones), `/health`, `/server_info`, and `/metrics`:
//! the server's own counters by model, then each loaded model's series with `model="NAME"`.

use super::catalog::Entry;
use super::Pool;
use crate::server::error::ApiError;
use crate::server::ollama::info::{details_of, digest_of, listed, rfc3339, show_body, ShowFacts};
use crate::server::AppState;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

fn status(pool: &Pool) -> HashMap<String, &'static str> {
    pool.loaded().into_iter().map(|(n, c)| (n, if c.is_some() { "loaded" } else { "loading" })).collect()
}

fn card(e: &Entry, status: &HashMap<String, &'static str>) -> Value {
    json!({
        "id": e.name,
        "object": "model",
        "created": e.modified.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        "owned_by": "torus-wgpu",
        "status": {"value": status.get(&e.name).copied().unwrap_or("unloaded")},
    })
}

pub(crate) fn list_models(pool: &Pool) -> Response {
    let st = status(pool);
    let data: Vec<Value> = pool.entries().iter().map(|e| card(e, &st)).collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

/// `/v1/models/{id}`: the model's card, or 404.
pub(crate) fn get_model(pool: &Pool, name: &str) -> Response {
    match pool.find(name) {
        Some(e) => Json(card(&e, &status(pool))).into_response(),
        None => super::unknown(pool, name).into_response(),
    }
}

fn tag(e: &Entry) -> Value {
    let count = e.parameter_count();
    json!({
        "name": listed(&e.name),
        "model": listed(&e.name),
        "modified_at": rfc3339(e.modified),
        "size": e.size,
        "digest": digest_of(&e.name, e.size, e.modified),
        "details": details_of(Some(&e.path), count),
    })
}

pub(crate) fn ollama_tags(pool: &Pool) -> Response {
    let models: Vec<Value> = pool.entries().iter().map(|e| tag(e)).collect();
    Json(json!({"models": models})).into_response()
}

/// The loaded models, as Ollama's `/api/ps`.
pub(crate) fn ollama_ps(pool: &Pool) -> Response {
    let entries = pool.entries();
    let mut models = Vec::new();
    for (name, child) in pool.loaded() {
        let (Some(c), Some(e)) = (child, entries.iter().find(|e| e.name == name)) else { continue };
        let mut t = tag(e);
        let o = t.as_object_mut().expect("an object");
        o.remove("modified_at");
        o.insert("size_vram".into(), json!(c.bytes));
        // Until unloaded to make room, unless a keep-alive ends it sooner.
        let at = match c.expires() {
            Some(t) => SystemTime::now() + t.saturating_duration_since(std::time::Instant::now()),
            None => UNIX_EPOCH + Duration::from_secs(253_402_300_799),
        };
        o.insert("expires_at".into(), json!(rfc3339(at)));
        o.insert("loaded_at".into(), json!(rfc3339(c.loaded_at)));
        models.push(t);
    }
    Json(json!({"models": models})).into_response()
}

/// Ollama's `/api/show` of a model that is not loaded, from its files alone (its tokenizer and
/// chat template are read; nothing is loaded on a device): clients ask it of every model they
/// list, and that must not load each in turn. The context length is the configured
/// `max_sequence_length` (a loaded model answers with what its KV cache holds, which may be less).
pub(crate) async fn show_unloaded(st: &AppState, pool: &Pool, e: &Entry) -> Result<Response, ApiError> {
    let path = e.path.clone();
    let tok = st.work.run_sized(0, move || crate::tokenizer::Tokenizer::from_path(&path)).await?;
    let tok = tok.map_err(|err| {
        let why = super::catalog::hide_path(&format!("{err:#}"), &e.path);
        ApiError::internal(format!("model {:?}: cannot read its tokenizer: {why}", e.name)).code("model_load_failed")
    })?;
    let count = e.parameter_count();
    let facts = ShowFacts {
        template: tok.chat_template_source().unwrap_or_default(),
        file: super::catalog::file_name(&e.path),
        size: e.size,
        modified: e.modified,
        details: details_of(Some(&e.path), count),
        context_length: pool.cfg.max_sequence_length,
        vocab: tok.vocab_size(),
    };
    Ok(Json(show_body(&st.cfg, facts)).into_response())
}

pub(crate) fn health(pool: &Pool) -> Response {
    let loaded = pool.loaded();
    let ready = loaded.iter().filter(|(_, c)| c.is_some()).count();
    let body = json!({
        "status": "ok",
        "models": pool.entries().len(),
        "loaded": ready,
        "loading": loaded.len() - ready,
    });
    (StatusCode::OK, Json(body)).into_response()
}

pub(crate) fn server_info(st: &AppState, pool: &Pool) -> Response {
    let status = status(pool);
    let models: Vec<Value> = pool
        .entries()
        .iter()
        .map(|e| json!({"name": e.name, "status": status.get(&e.name).copied().unwrap_or("unloaded")}))
        .collect();
    Json(json!({
        "server": "torus-wgpu",
        "version": env!("CARGO_PKG_VERSION"),
        "models": models,
        "max_loaded_models": pool.cfg.max_loaded,
        "models_memory_bytes": pool.cfg.memory_budget,
        "request_workers": st.work.threads(),
    }))
    .into_response()
}

/// Escapes a label value for Prometheus' text format.
fn label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// A sample line of a model's exposition with `model="NAME"` added as its first label.
fn with_model(line: &str, model: &str) -> String {
    let m = format!("model=\"{}\"", label(model));
    let name_end = line.find(['{', ' ']).unwrap_or(line.len());
    let (name, rest) = line.split_at(name_end);
    match rest.strip_prefix('{') {
        Some(r) if r.starts_with('}') => format!("{name}{{{m}{r}"),
        Some(r) => format!("{name}{{{m},{r}"),
        None => format!("{name}{{{m}}}{rest}"),
    }
}

/// Merges the models' expositions: each family's `# HELP` / `# TYPE` once, then every model's
/// samples of it, each labelled with its model.
fn merge(parts: &[(String, String)]) -> String {
    let mut order: Vec<String> = Vec::new();
    let mut head: HashMap<String, Vec<String>> = HashMap::new();
    let mut samples: HashMap<String, Vec<String>> = HashMap::new();
    for (model, text) in parts {
        let mut family = String::new();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            if let Some(rest) = line.strip_prefix("# HELP ").or_else(|| line.strip_prefix("# TYPE ")) {
                family = rest.split_whitespace().next().unwrap_or("").to_string();
                if !head.contains_key(&family) {
                    order.push(family.clone());
                }
                let h = head.entry(family.clone()).or_default();
                if !h.iter().any(|x| x == line) && h.len() < 2 {
                    h.push(line.to_string());
                }
            } else if !line.starts_with('#') {
                let name = line.split(['{', ' ']).next().unwrap_or("");
                let fam = if name.starts_with(family.as_str()) && !family.is_empty() {
                    family.clone()
                } else {
                    name.to_string()
                };
                if !head.contains_key(&fam) && !samples.contains_key(&fam) {
                    order.push(fam.clone());
                }
                samples.entry(fam).or_default().push(with_model(line, model));
            }
        }
    }
    let mut out = String::new();
    for f in order {
        for l in head.get(&f).into_iter().flatten().chain(samples.get(&f).into_iter().flatten()) {
            out.push_str(l);
            out.push('\n');
        }
    }
    out
}

/// `/metrics`: loads, unloads and requests by model, the models loaded, then each loaded
/// model's own metrics labelled by model (fetched now; one that does not answer in 2 s is
/// left out).
pub(crate) async fn metrics(st: &AppState, pool: &Pool) -> Response {
    let loaded = pool.loaded();
    let mut text = String::new();
    let gauge = |text: &mut String, name: &str, help: &str, kind: &str| {
        text.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
    };
    gauge(&mut text, "torus_models_available", "Models this server can load.", "gauge");
    text.push_str(&format!("torus_models_available {}\n", pool.entries().len()));
    gauge(&mut text, "torus_models_loaded", "Models loaded (state=loaded) or loading.", "gauge");
    let ready = loaded.iter().filter(|(_, c)| c.is_some()).count();
    text.push_str(&format!("torus_models_loaded{{state=\"loaded\"}} {ready}\n"));
    text.push_str(&format!("torus_models_loaded{{state=\"loading\"}} {}\n", loaded.len() - ready));
    let counts = pool.counts();
    let mut counter = |name: &str, help: &str, extra: &str, get: &dyn Fn(&super::Counts) -> u64| {
        gauge(&mut text, name, help, "counter");
        for (m, c) in &counts {
            text.push_str(&format!("{name}{{model=\"{}\"{extra}}} {}\n", label(m), get(c)));
        }
    };
    counter("torus_model_loads_total", "Model loads that succeeded.", "", &|c| c.loads);
    counter("torus_model_load_failures_total", "Model loads that failed.", "", &|c| c.load_failures);
    gauge(&mut text, "torus_model_unloads_total", "Models unloaded to make room, by why.", "counter");
    for (m, c) in &counts {
        for why in super::Why::ALL {
            let (m, r, n) = (label(m), why.label(), c.unloads[why as usize]);
            text.push_str(&format!("torus_model_unloads_total{{model=\"{m}\",reason=\"{r}\"}} {n}\n"));
        }
    }
    let mut counter = |name: &str, help: &str, get: &dyn Fn(&super::Counts) -> u64| {
        gauge(&mut text, name, help, "counter");
        for (m, c) in &counts {
            text.push_str(&format!("{name}{{model=\"{}\"}} {}\n", label(m), get(c)));
        }
    };
    counter("torus_model_requests_total", "Requests passed to each model.", &|c| c.requests);
    text.push_str(&st.metrics.render_front());
    let fetches = loaded.into_iter().filter_map(|(n, c)| c.map(|c| (n, c))).map(|(n, c)| async move {
        let url = format!("http://127.0.0.1:{}/metrics", c.port);
        let r = pool.http.get(url).timeout(Duration::from_secs(2)).send().await;
        let body = match r {
            Ok(r) if r.status().is_success() => r.text().await.ok(),
            _ => None,
        };
        body.map(|b| (n, b))
    });
    let parts: Vec<(String, String)> = futures_util::future::join_all(fetches).await.into_iter().flatten().collect();
    text.push_str(&merge(&parts));
    let mut r = text.into_response();
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_every_sample_with_its_model() {
        assert_eq!(with_model("a 1", "m"), "a{model=\"m\"} 1");
        assert_eq!(with_model("a{} 1", "m"), "a{model=\"m\"} 1");
        assert_eq!(with_model("a{x=\"y\"} 1", "m\"q"), "a{model=\"m\\\"q\",x=\"y\"} 1");
        let one = "# HELP a An a.\n# TYPE a counter\na 1\n# HELP h A histogram.\n# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_sum 3\nh_count 2\n";
        let two = one.replace(" 1\n", " 5\n");
        let m = merge(&[("x".into(), one.into()), ("y".into(), two)]);
        assert_eq!(m.matches("# TYPE a counter").count(), 1);
        assert_eq!(m.matches("# HELP h").count(), 1);
        let lines: Vec<&str> = m.lines().collect();
        let at = |s: &str| lines.iter().position(|l| *l == s).unwrap_or_else(|| panic!("{s} in {m}"));
        assert!(at("a{model=\"x\"} 1") < at("a{model=\"y\"} 5"));
        assert!(at("a{model=\"y\"} 5") < at("# HELP h A histogram."));
        assert!(at("h_count{model=\"y\"} 2") > at("h_sum{model=\"x\"} 3"));
    }
}
