//! What a well-formed answer of each API looks like: an error body in OpenAI's, Anthropic's or
//! Ollama's shape, and a whole SSE stream in its API's framing (used by the HTTP fuzz test).

use serde_json::Value;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    OpenAi,
    Anthropic,
    Ollama,
    /// llama-server's own routes: errors in OpenAI's shape, streams of `data:` objects.
    Llama,
}

pub fn dialect(path: &str) -> Dialect {
    if matches!(path, "/completion" | "/completions" | "/infill") {
        Dialect::Llama
    } else if path.starts_with("/v1/messages") {
        Dialect::Anthropic
    } else if path.starts_with("/api/") || path == "/api" {
        Dialect::Ollama
    } else {
        Dialect::OpenAi
    }
}

/// Whether `v` is an error body in `d`'s shape.
pub fn is_error(d: Dialect, v: &Value) -> bool {
    match d {
        Dialect::OpenAi | Dialect::Llama => {
            let e = &v["error"];
            e["message"].as_str().is_some_and(|m| !m.is_empty())
                && e["type"].is_string()
                && e.get("param").is_some()
                && e.get("code").is_some()
        }
        Dialect::Anthropic => {
            v["type"] == "error"
                && v["error"]["type"].as_str().is_some_and(|t| t.ends_with("_error") || t == "request_too_large")
                && v["error"]["message"].as_str().is_some_and(|m| !m.is_empty())
        }
        Dialect::Ollama => v["error"].as_str().is_some_and(|m| !m.is_empty()),
    }
}

/// A whole SSE stream in its API's framing: OpenAI's ends with `[DONE]` (error events carry a
/// code), Anthropic's with `message_stop` or an error event, the Responses API's with
/// `response.completed`, `.incomplete` or `.failed`; llama-server's with a `stop: true` object
/// (or an error).
pub fn check_sse(d: Dialect, text: &str) -> Result<(), String> {
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty() && !e.starts_with(':')).collect();
    let data = |ev: &str| -> Result<Value, String> {
        let line = ev.lines().find_map(|l| l.strip_prefix("data: ")).ok_or_else(|| format!("no data in {ev:?}"))?;
        serde_json::from_str(line).map_err(|e| format!("bad event {ev:?}: {e}"))
    };
    match d {
        Dialect::OpenAi if text.starts_with("event: ") => {
            let last = data(events.last().ok_or("an empty stream")?)?;
            let t = last["type"].as_str().unwrap_or_default();
            if !matches!(t, "response.completed" | "response.incomplete" | "response.failed") {
                return Err(format!("the stream ends with {t:?}"));
            }
            for (i, ev) in events.iter().enumerate() {
                if data(ev)?["sequence_number"] != i {
                    return Err(format!("event {i} is out of sequence"));
                }
            }
            Ok(())
        }
        Dialect::OpenAi => {
            if !text.ends_with("data: [DONE]\n\n") {
                return Err("a stream without [DONE]".into());
            }
            for ev in events.iter().filter(|e| **e != "data: [DONE]") {
                // An error event is a 408 (time limit) or 503 (shutdown, a stage down) in the
                // stream; an internal error (500) has no code.
                let v = data(ev)?;
                if v.get("error").is_some_and(|e| !e["code"].is_string()) {
                    return Err(format!("error event {v}"));
                }
            }
            Ok(())
        }
        Dialect::Llama => {
            let all: Vec<Value> = events.iter().map(|e| data(e)).collect::<Result<_, _>>()?;
            let last = all.last().ok_or("an empty stream")?;
            if last["stop"] != true && last.get("error").is_none() {
                return Err(format!("the stream ends with {last}"));
            }
            if all[..all.len() - 1].iter().any(|e| e["stop"] != false) {
                return Err("a chunk before the last says stop".into());
            }
            Ok(())
        }
        Dialect::Anthropic | Dialect::Ollama => {
            let last = data(events.last().ok_or("an empty stream")?)?;
            if last["type"] != "message_stop" && !is_error(Dialect::Anthropic, &last) {
                return Err(format!("the stream ends with {last}"));
            }
            if data(events[0])?["type"] != "message_start" {
                return Err("the stream does not open with message_start".into());
            }
            Ok(())
        }
    }
}
