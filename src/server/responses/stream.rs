//! A streamed Responses API answer: the typed events, each with its `sequence_number`.

use super::{call_item, item_id, message_item, reasoning_item, reasoning_part, text_part, Head};
use crate::engine::FinishReason;
use crate::server::openai::sse::SSE_KEEPALIVE;
use crate::server::turn::{sse_event, stream_response, Part, Turn, TurnEvent};
use crate::server::AppState;
use axum::body::Bytes;
use axum::response::Response;
use serde_json::{json, Value};
use std::sync::Arc;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Reasoning,
    Text,
}

/// The item being written.
struct OpenItem {
    kind: Kind,
    id: String,
    text: String,
}

struct Events {
    st: Arc<AppState>,
    head: Head,
    seq: u64,
    open: Option<OpenItem>,
    /// Finished items (the final response's `output`).
    items: Vec<Value>,
}

impl Events {
    fn emit(&mut self, out: &mut Vec<Bytes>, kind: &str, mut data: Value) {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        out.push(sse_event(kind, &data));
    }

    fn close(&mut self, out: &mut Vec<Bytes>) {
        let Some(o) = self.open.take() else { return };
        let index = self.items.len();
        let (done, part, item) = match o.kind {
            Kind::Text => (
                ("response.output_text.done", json!({"text": o.text, "logprobs": []})),
                text_part(&o.text),
                message_item(&o.id, &o.text, "completed"),
            ),
            Kind::Reasoning => (
                ("response.reasoning_text.done", json!({"text": o.text})),
                reasoning_part(&o.text),
                reasoning_item(&o.id, &o.text, "completed"),
            ),
        };
        let mut d = done.1;
        d["item_id"] = json!(o.id);
        d["output_index"] = json!(index);
        d["content_index"] = json!(0);
        self.emit(out, done.0, d);
        let at = json!({"item_id": o.id, "output_index": index, "content_index": 0, "part": part});
        self.emit(out, "response.content_part.done", at);
        self.emit(out, "response.output_item.done", json!({"output_index": index, "item": item}));
        self.items.push(item);
    }

    fn write(&mut self, out: &mut Vec<Bytes>, kind: Kind, t: String) {
        if self.open.as_ref().is_none_or(|o| o.kind != kind) {
            self.close(out);
            let (prefix, item, part) = match kind {
                Kind::Text => ("msg", message_item as fn(&str, &str, &str) -> Value, text_part("")),
                Kind::Reasoning => ("rs", reasoning_item as fn(&str, &str, &str) -> Value, reasoning_part("")),
            };
            let id = item_id(&self.st, prefix);
            let index = self.items.len();
            self.emit(
                out,
                "response.output_item.added",
                json!({"output_index": index, "item": item(&id, "", "in_progress")}),
            );
            let at = json!({"item_id": id, "output_index": index, "content_index": 0, "part": part});
            self.emit(out, "response.content_part.added", at);
            self.open = Some(OpenItem { kind, id, text: String::new() });
        }
        let index = self.items.len();
        let o = self.open.as_mut().expect("opened above");
        o.text.push_str(&t);
        let mut d = json!({"item_id": o.id, "output_index": index, "content_index": 0, "delta": t});
        let name = match kind {
            Kind::Text => {
                d["logprobs"] = json!([]);
                "response.output_text.delta"
            }
            Kind::Reasoning => "response.reasoning_text.delta",
        };
        self.emit(out, name, d);
    }

    fn parts(&mut self, parts: Vec<Part>, out: &mut Vec<Bytes>) {
        for p in parts {
            match p {
                Part::Reasoning(t) => self.write(out, Kind::Reasoning, t),
                Part::Text(t) => self.write(out, Kind::Text, t),
                Part::Call(c) => {
                    self.close(out);
                    let (id, call_id) = (item_id(&self.st, "fc"), item_id(&self.st, "call"));
                    let index = self.items.len();
                    let added = call_item(&id, &call_id, &c.name, "", "in_progress");
                    self.emit(out, "response.output_item.added", json!({"output_index": index, "item": added}));
                    let d = json!({"item_id": id, "output_index": index, "delta": c.arguments});
                    self.emit(out, "response.function_call_arguments.delta", d);
                    let d = json!({"item_id": id, "output_index": index, "arguments": c.arguments, "name": c.name});
                    self.emit(out, "response.function_call_arguments.done", d);
                    let item = call_item(&id, &call_id, &c.name, &c.arguments, "completed");
                    self.emit(out, "response.output_item.done", json!({"output_index": index, "item": item}));
                    self.items.push(item);
                }
            }
        }
    }

    fn render(&mut self, e: TurnEvent) -> Vec<Bytes> {
        let mut out = Vec::new();
        match e {
            TurnEvent::Parts(p) => self.parts(p, &mut out),
            TurnEvent::KeepAlive => out.push(Bytes::from_static(SSE_KEEPALIVE)),
            TurnEvent::Done { parts, reason, usage, .. } => {
                self.parts(parts, &mut out);
                self.close(&mut out);
                let incomplete = matches!(reason, FinishReason::Length);
                let status = if incomplete { "incomplete" } else { "completed" };
                let r = self.head.object(status, std::mem::take(&mut self.items), Some(&usage), incomplete);
                let kind = if incomplete { "response.incomplete" } else { "response.completed" };
                self.emit(&mut out, kind, json!({"response": r}));
            }
            TurnEvent::Failed(e) => {
                self.close(&mut out);
                let err = json!({"code": e.code, "message": e.message, "param": e.param});
                self.emit(&mut out, "error", err);
                let mut r = self.head.object("failed", std::mem::take(&mut self.items), None, false);
                r["error"] = json!({"code": e.code.unwrap_or("server_error"), "message": e.message});
                self.emit(&mut out, "response.failed", json!({"response": r}));
            }
        }
        out
    }
}

/// The streamed response to a turn.
pub(super) fn respond(turn: Turn, head: Head) -> Response {
    let st = turn.st.clone();
    let mut ev = Events { st, head, seq: 0, open: None, items: vec![] };
    let mut first = Vec::new();
    let mut r = ev.head.object("in_progress", vec![], None, false);
    // `metadata` is echoed once, in the final response object (the one clients keep).
    r["metadata"] = Value::Null;
    ev.emit(&mut first, "response.created", json!({"response": r.clone()}));
    ev.emit(&mut first, "response.in_progress", json!({"response": r}));
    stream_response(first, turn.events(), move |e| ev.render(e), "text/event-stream")
}
