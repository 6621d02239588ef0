//! A streamed Messages response: Anthropic's event sequence over a turn's parts.

use super::{block, message_id, stop_reason, usage_json};
use crate::server::error::Dialect;
use crate::server::turn::{sse_event, stream_response, Part, Turn, TurnEvent};
use crate::server::AppState;
use axum::body::Bytes;
use axum::response::Response;
use serde_json::{json, Value};
use std::sync::Arc;

/// The open content block.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Open {
    None,
    Thinking,
    Text,
}

struct Events {
    st: Arc<AppState>,
    /// Index of the next block.
    next: usize,
    open: Open,
    prompt_tokens: usize,
    pinged: bool,
    stops: Vec<String>,
}

impl Events {
    fn close(&mut self, out: &mut Vec<Bytes>) {
        if self.open != Open::None {
            out.push(sse_event("content_block_stop", &json!({"type": "content_block_stop", "index": self.next - 1})));
            self.open = Open::None;
        }
    }

    fn start(&mut self, out: &mut Vec<Bytes>, block: Value, open: Open) {
        self.close(out);
        out.push(sse_event(
            "content_block_start",
            &json!({"type": "content_block_start", "index": self.next, "content_block": block}),
        ));
        self.next += 1;
        self.open = open;
        if !self.pinged {
            self.pinged = true;
            out.push(ping());
        }
    }

    fn delta(&self, out: &mut Vec<Bytes>, delta: Value) {
        out.push(sse_event(
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": self.next - 1, "delta": delta}),
        ));
    }

    fn parts(&mut self, parts: Vec<Part>, out: &mut Vec<Bytes>) {
        for p in parts {
            match p {
                Part::Reasoning(t) => {
                    if self.open != Open::Thinking {
                        self.start(out, json!({"type": "thinking", "thinking": "", "signature": ""}), Open::Thinking);
                    }
                    self.delta(out, json!({"type": "thinking_delta", "thinking": t}));
                }
                Part::Text(t) => {
                    if self.open != Open::Text {
                        self.start(out, json!({"type": "text", "text": ""}), Open::Text);
                    }
                    self.delta(out, json!({"type": "text_delta", "text": t}));
                }
                Part::Call(c) => {
                    let mut b = block(&self.st, &Part::Call(c.clone()));
                    b["input"] = json!({});
                    self.start(out, b, Open::None);
                    let args = super::arguments_value(&c).to_string();
                    self.delta(out, json!({"type": "input_json_delta", "partial_json": args}));
                    out.push(sse_event(
                        "content_block_stop",
                        &json!({"type": "content_block_stop", "index": self.next - 1}),
                    ));
                }
            }
        }
    }

    fn render(&mut self, e: TurnEvent) -> Vec<Bytes> {
        let mut out = Vec::new();
        match e {
            TurnEvent::Parts(parts) => self.parts(parts, &mut out),
            TurnEvent::KeepAlive => out.push(ping()),
            TurnEvent::Done { parts, reason, usage, calls } => {
                self.parts(parts, &mut out);
                self.close(&mut out);
                let mut u = usage_json(self.prompt_tokens, &usage);
                u["output_tokens"] = json!(usage.completion_tokens);
                let (stop_reason, stop_sequence) = stop_reason(&reason, calls, &usage, &self.stops);
                out.push(sse_event(
                    "message_delta",
                    &json!({
                        "type": "message_delta",
                        "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                        "usage": u,
                    }),
                ));
                out.push(sse_event("message_stop", &json!({"type": "message_stop"})));
            }
            TurnEvent::Failed(e) => out.push(sse_event("error", &e.body_in(Dialect::Anthropic))),
        }
        out
    }
}

fn ping() -> Bytes {
    sse_event("ping", &json!({"type": "ping"}))
}

/// The streamed response to a turn.
pub(super) fn respond(turn: Turn) -> Response {
    let st = turn.st.clone();
    let start = json!({
        "type": "message_start",
        "message": {
            "id": message_id(&st),
            "type": "message",
            "role": "assistant",
            "model": st.cfg.served_model_name,
            "content": [],
            "stop_reason": null,
            "stop_sequence": null,
            "usage": {"input_tokens": turn.prompt_tokens, "output_tokens": 0},
        },
    });
    let stops = turn.stops.clone();
    let mut ev = Events { st, next: 0, open: Open::None, prompt_tokens: turn.prompt_tokens, pinged: false, stops };
    let head = vec![sse_event("message_start", &start)];
    stream_response(head, turn.events(), move |e| ev.render(e), "text/event-stream")
}
