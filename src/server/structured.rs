//! Structured outputs in the OpenAI API: `response_format` (`text`, `json_object`,
//! `json_schema`) on chat and completions, and vLLM's `structured_outputs` extension (`json`,
//! `regex`, `choice`, `grammar`, `json_object`) with its older spellings `guided_json`,
//! `guided_regex`, `guided_choice` and `guided_grammar`, and llama-server's GBNF `grammar` (see
//! `structured::gbnf`) and top-level `json_schema`. The grammar is compiled before the
//! request is submitted (on a thread of its own, within a time limit), so one the library
//! cannot compile is a 400 naming the field; so is one that fails while generating (the
//! library's limits, see `openai::error_of`).

use super::error::ApiError;
use super::params::Fields;
use crate::engine::EngineHandle;
use crate::structured::bounds::{self, COMPILE_TIME_LIMIT};
use crate::structured::{Constraint, ConstraintSpec};
use serde_json::Value;
use std::sync::{Arc, OnceLock};
use tokio::sync::Semaphore;

/// A request's constraint and the field it came from (for error messages).
#[derive(Clone, Debug, PartialEq)]
pub struct Requested {
    pub spec: ConstraintSpec,
    pub param: &'static str,
}

fn invalid(param: &str, msg: impl Into<String>) -> ApiError {
    ApiError::invalid(param, msg)
}

/// A JSON schema given as an object, a boolean, or a string holding one.
fn schema_value(v: &Value, param: &str) -> Result<Value, ApiError> {
    match v {
        Value::Object(_) | Value::Bool(_) => Ok(v.clone()),
        Value::String(s) => match super::json::parse_embedded(s) {
            Ok(x @ (Value::Object(_) | Value::Bool(_))) => Ok(x),
            Ok(_) => Err(invalid(param, format!("`{param}` must be a JSON schema (an object)"))),
            Err(e) => Err(invalid(param, format!("`{param}` cannot be read: {e}"))),
        },
        _ => Err(invalid(param, format!("`{param}` must be a JSON schema (an object)"))),
    }
}

fn choices(v: &Value, param: &str) -> Result<Vec<String>, ApiError> {
    let list = v
        .as_array()
        .filter(|a| !a.is_empty())
        .ok_or_else(|| invalid(param, format!("`{param}` must be a non-empty array of strings")))?;
    list.iter()
        .map(|c| {
            c.as_str().map(str::to_string).ok_or_else(|| invalid(param, format!("`{param}` must hold strings only")))
        })
        .collect()
}

fn string(v: &Value, param: &str) -> Result<String, ApiError> {
    match v.as_str() {
        Some(s) if !s.is_empty() => Ok(s.to_string()),
        _ => Err(invalid(param, format!("`{param}` must be a non-empty string"))),
    }
}

/// `response_format`, or None for `text` (and when absent).
fn response_format(v: &Value) -> Result<Option<ConstraintSpec>, ApiError> {
    const P: &str = "response_format";
    let Value::Object(o) = v else { return Err(invalid(P, "`response_format` must be an object")) };
    let o = Fields(o);
    match o.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(ConstraintSpec::JsonObject)),
        Some("json_schema") => {
            let Some(Value::Object(js)) = o.get("json_schema") else {
                return Err(invalid(P, "`response_format.json_schema` must be an object with a `schema`"));
            };
            let js = Fields(js);
            if let Some(name) = js.get("name") {
                if !name.is_string() {
                    return Err(invalid(P, "`response_format.json_schema.name` must be a string"));
                }
            }
            let strict = match js.get("strict") {
                None => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => return Err(invalid(P, "`response_format.json_schema.strict` must be a boolean")),
            };
            let schema = match js.get("schema") {
                Some(s) => schema_value(s, "response_format.json_schema.schema").map_err(|e| e.param(P))?,
                None => return Err(invalid(P, "`response_format.json_schema.schema` is required")),
            };
            Ok(Some(ConstraintSpec::JsonSchema { schema, strict }))
        }
        Some(other) => Err(invalid(
            P,
            format!(
                "`response_format.type` {other:?} is not supported; supported: \"text\", \"json_object\", \"json_schema\""
            ),
        )),
        None => Err(invalid(P, "`response_format.type` must be a string")),
    }
}

/// vLLM's `structured_outputs` object: exactly one of its constraint fields.
fn structured_outputs(v: &Value) -> Result<Option<ConstraintSpec>, ApiError> {
    const P: &str = "structured_outputs";
    let Value::Object(o) = v else { return Err(invalid(P, "`structured_outputs` must be an object")) };
    let o = Fields(o);
    let mut found = Vec::new();
    if let Some(j) = o.get("json") {
        found.push(ConstraintSpec::JsonSchema { schema: schema_value(j, "structured_outputs.json")?, strict: false });
    }
    if let Some(r) = o.get("regex") {
        found.push(ConstraintSpec::Regex(string(r, "structured_outputs.regex")?));
    }
    if let Some(c) = o.get("choice") {
        found.push(ConstraintSpec::Choice(choices(c, "structured_outputs.choice")?));
    }
    if let Some(g) = o.get("grammar") {
        found.push(ConstraintSpec::Lark(string(g, "structured_outputs.grammar")?));
    }
    match o.get("json_object") {
        None | Some(Value::Bool(false)) => {}
        Some(Value::Bool(true)) => found.push(ConstraintSpec::JsonObject),
        Some(_) => return Err(invalid(P, "`structured_outputs.json_object` must be a boolean")),
    }
    if o.get("structural_tag").is_some() {
        return Err(invalid(P, "`structured_outputs.structural_tag` is not supported"));
    }
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.pop()),
        _ => Err(invalid(P, "`structured_outputs` may set only one of json, regex, choice, grammar, json_object")),
    }
}

/// The request's constraint, from whichever field names one (at most one may).
pub fn parse(f: &Fields) -> Result<Option<Requested>, ApiError> {
    let mut found: Vec<Requested> = Vec::new();
    if let Some(v) = f.get("response_format") {
        if let Some(spec) = response_format(v)? {
            found.push(Requested { spec, param: "response_format" });
        }
    }
    if let Some(v) = f.get("structured_outputs") {
        if let Some(spec) = structured_outputs(v)? {
            found.push(Requested { spec, param: "structured_outputs" });
        }
    }
    if let Some(v) = f.get("guided_json") {
        found.push(Requested {
            spec: ConstraintSpec::JsonSchema { schema: schema_value(v, "guided_json")?, strict: false },
            param: "guided_json",
        });
    }
    if let Some(v) = f.get("guided_regex") {
        found.push(Requested { spec: ConstraintSpec::Regex(string(v, "guided_regex")?), param: "guided_regex" });
    }
    if let Some(v) = f.get("guided_choice") {
        found.push(Requested { spec: ConstraintSpec::Choice(choices(v, "guided_choice")?), param: "guided_choice" });
    }
    if let Some(v) = f.get("guided_grammar") {
        found.push(Requested { spec: ConstraintSpec::Lark(string(v, "guided_grammar")?), param: "guided_grammar" });
    }
    // llama-server's: a GBNF `grammar` and a top-level `json_schema`.
    if let Some(v) = f.get("grammar").filter(|v| v.as_str() != Some("")) {
        let g = string(v, "grammar")?;
        let lark = crate::structured::gbnf::gbnf_to_lark(&g).map_err(|e| invalid("grammar", e.to_string()))?;
        found.push(Requested { spec: ConstraintSpec::Lark(lark), param: "grammar" });
    }
    if let Some(v) = f.get("json_schema") {
        found.push(Requested {
            spec: ConstraintSpec::JsonSchema { schema: schema_value(v, "json_schema")?, strict: false },
            param: "json_schema",
        });
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|r| r.param).collect();
        return Err(invalid(
            found[1].param,
            format!("only one output constraint per request, got {}", names.join(", ")),
        ));
    }
    Ok(found.pop())
}

/// Checks the request's constraint against the bounds (`structured::bounds`: size, depth,
/// alternatives) without compiling it: cheap, so a request past them is refused before its
/// prompt is rendered (it is compiled later, see [`compile`]).
pub fn check_bounds(req: Option<&Requested>) -> Result<(), ApiError> {
    let Some(req) = req else { return Ok(()) };
    let param = req.param;
    bounds::check(&req.spec).map_err(|e| invalid(param, format!("`{param}` cannot be compiled: {e}")))
}

/// At most this many constraints compile at once, each on a thread of its own: a flood of slow
/// grammars waits here (within each request's own time limit) and holds no request worker.
const COMPILE_SLOTS: usize = 2;

fn compile_slots() -> &'static Arc<Semaphore> {
    static S: OnceLock<Arc<Semaphore>> = OnceLock::new();
    S.get_or_init(|| Arc::new(Semaphore::new(COMPILE_SLOTS)))
}

/// Compiles the request's constraint for this engine's tokenizer, off the request workers and
/// the async threads, within [`COMPILE_TIME_LIMIT`]: one too large, too deep or with too many
/// alternatives (`structured::bounds`), one the library rejects, and one that takes too long
/// are each a 400 with the reason, naming the field. A compile that ran out of time goes on to
/// its end on its own thread (the library's own limits bound it), holding its slot.
pub async fn compile(engine: &EngineHandle, req: Option<Requested>) -> Result<Option<Constraint>, ApiError> {
    let Some(req) = req else { return Ok(None) };
    let param = req.param;
    let cannot = move |e: String| invalid(param, format!("`{param}` cannot be compiled: {e}"));
    bounds::check(&req.spec).map_err(cannot)?;
    let e = engine.clone();
    let g = tokio::task::spawn_blocking(move || e.grammars())
        .await
        .map_err(|_| ApiError::internal("the grammar library failed to start"))?
        .map_err(|e| invalid(param, format!("structured outputs are not available: {e}")))?;
    let permit =
        compile_slots().clone().acquire_owned().await.map_err(|_| ApiError::internal("no grammar compiler"))?;
    let (tx, rx) = tokio::sync::oneshot::channel();
    g.compile_detached(req.spec, move |r| {
        drop(permit);
        let _ = tx.send(r);
    })
    .map_err(cannot)?;
    match tokio::time::timeout(COMPILE_TIME_LIMIT, rx).await {
        Ok(Ok(r)) => r.map(Some).map_err(cannot),
        Ok(Err(_)) => Err(cannot("the grammar library failed on this grammar".into())),
        Err(_) => Err(cannot(format!("it takes longer than {} s, the limit", COMPILE_TIME_LIMIT.as_secs()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn p(v: Value) -> Result<Option<Requested>, ApiError> {
        parse(&Fields(v.as_object().unwrap()))
    }

    #[test]
    fn every_spelling() {
        assert_eq!(p(json!({})).unwrap(), None);
        assert_eq!(p(json!({"response_format": {"type": "text"}})).unwrap(), None);
        assert_eq!(
            p(json!({"response_format": {"type": "json_object"}})).unwrap().unwrap().spec,
            ConstraintSpec::JsonObject
        );
        let s = json!({"type": "object"});
        let r = p(
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s, "strict": true}}}),
        );
        assert_eq!(r.unwrap().unwrap().spec, ConstraintSpec::JsonSchema { schema: s.clone(), strict: true });
        let r = p(json!({"structured_outputs": {"json": "{\"type\": \"object\"}"}})).unwrap().unwrap();
        assert_eq!((r.spec, r.param), (ConstraintSpec::JsonSchema { schema: s, strict: false }, "structured_outputs"));
        assert_eq!(
            p(json!({"structured_outputs": {"regex": "a+"}})).unwrap().unwrap().spec,
            ConstraintSpec::Regex("a+".into())
        );
        assert_eq!(
            p(json!({"guided_choice": ["a", "b"]})).unwrap().unwrap().spec,
            ConstraintSpec::Choice(vec!["a".into(), "b".into()])
        );
        assert_eq!(
            p(json!({"guided_grammar": "start: \"x\""})).unwrap().unwrap().spec,
            ConstraintSpec::Lark("start: \"x\"".into())
        );
    }

    #[test]
    fn bad_fields_are_named() {
        for (v, param) in [
            (json!({"response_format": {"type": "xml"}}), "response_format"),
            (json!({"response_format": {"type": "json_schema"}}), "response_format"),
            (json!({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}), "response_format"),
            (json!({"response_format": "json"}), "response_format"),
            (json!({"structured_outputs": {"choice": []}}), "structured_outputs.choice"),
            (json!({"structured_outputs": {"regex": "a", "choice": ["b"]}}), "structured_outputs"),
            (json!({"response_format": {"type": "json_object"}, "guided_regex": "a"}), "guided_regex"),
        ] {
            let e = p(v.clone()).unwrap_err();
            assert_eq!(e.status.as_u16(), 400, "{v}");
            assert_eq!(e.body()["error"]["param"], param, "{v}");
        }
    }
}
