//! The model's output into `tool_calls`: Hermes/Qwen `<tool_call>` blocks (streamed or whole)
//! and a whole output that is one bare call object (see the module docs of `tools`).

use super::{ToolRequest, CALL_CLOSE, CALL_OPEN};
use serde_json::{json, Value};

/// A tool call found in the output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParsedCall {
    /// Its position among the calls of this choice (0, 1, ...).
    pub index: usize,
    pub name: String,
    /// The arguments as a JSON text.
    pub arguments: String,
}

/// A piece of parsed output, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    Content(String),
    Call(ParsedCall),
}

/// Splits a choice's output, fed in arbitrary pieces, into content and tool calls. Text that
/// may be the start of a `<tool_call>` tag is held back until it is known not to be; a block is
/// held until its `</tool_call>`; whitespace is held until it is known not to border a parsed
/// call. Feeding the whole text at once or in any pieces gives the same result.
#[derive(Clone, Debug)]
pub struct ToolCallParser {
    tools: ToolRequest,
    buf: String,
    in_call: bool,
    held_ws: String,
    /// Right after a parsed call: leading whitespace is dropped.
    after_call: bool,
    calls: usize,
    /// The start of the output, until its first non-whitespace character says which way to go.
    start: Start,
    start_buf: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Start {
    /// Nothing but whitespace yet.
    Open,
    /// The output begins with `{`: held whole, it may be a bare call.
    Bare,
    /// Parsed for tagged calls.
    Tagged,
}

impl ToolCallParser {
    pub fn new(tools: ToolRequest) -> Self {
        ToolCallParser {
            tools,
            buf: String::new(),
            in_call: false,
            held_ws: String::new(),
            after_call: false,
            calls: 0,
            start: Start::Open,
            start_buf: String::new(),
        }
    }

    /// How many calls were found so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        match self.start {
            Start::Tagged => self.push_tagged(text),
            Start::Bare => {
                self.start_buf.push_str(text);
                vec![]
            }
            Start::Open => {
                self.start_buf.push_str(text);
                match self.start_buf.trim_start().chars().next() {
                    None => vec![],
                    Some('{') => {
                        self.start = Start::Bare;
                        vec![]
                    }
                    Some(_) => {
                        self.start = Start::Tagged;
                        let held = std::mem::take(&mut self.start_buf);
                        self.push_tagged(&held)
                    }
                }
            }
        }
    }

    fn push_tagged(&mut self, text: &str) -> Vec<Piece> {
        let mut out = vec![];
        self.buf.push_str(text);
        loop {
            if !self.in_call {
                if let Some(i) = self.buf.find(CALL_OPEN) {
                    let before = self.buf[..i].to_string();
                    self.content(&before, &mut out);
                    self.buf.drain(..i + CALL_OPEN.len());
                    self.in_call = true;
                } else {
                    let keep = partial_tag_len(&self.buf, CALL_OPEN);
                    let cut = self.buf.len() - keep;
                    let before: String = self.buf.drain(..cut).collect();
                    self.content(&before, &mut out);
                    break;
                }
            } else if let Some(i) = self.buf.find(CALL_CLOSE) {
                let body: String = self.buf.drain(..i + CALL_CLOSE.len()).collect();
                let body = &body[..i];
                self.in_call = false;
                match parse_call_body(body).filter(|(name, _)| self.tools.accepts(name)) {
                    Some(_) if !self.tools.parallel && self.calls > 0 => {
                        self.held_ws.clear();
                        self.after_call = true;
                    }
                    Some((name, arguments)) => {
                        self.held_ws.clear();
                        self.after_call = true;
                        out.push(Piece::Call(ParsedCall { index: self.calls, name, arguments }));
                        self.calls += 1;
                    }
                    None => self.content(&format!("{CALL_OPEN}{body}{CALL_CLOSE}"), &mut out),
                }
            } else {
                break;
            }
        }
        out
    }

    /// The end of the output: whatever is still held back. A call block the output ended in
    /// (cut by `max_tokens` or a stop string) becomes a call with the arguments as far as they
    /// got, as OpenAI returns a cut call, when its function's name was complete; otherwise it is
    /// dropped: never raw markup in the content. Under a forced `tool_choice` an output cut
    /// before its tags (a bare object's start) is read the same way.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = vec![];
        if self.start != Start::Tagged {
            let held = std::mem::take(&mut self.start_buf);
            let bare = self.start == Start::Bare;
            self.start = Start::Tagged;
            if bare {
                if let Some((name, arguments)) = parse_bare_call(&held).filter(|(name, _)| self.tools.accepts(name)) {
                    self.calls += 1;
                    return vec![Piece::Call(ParsedCall { index: 0, name, arguments })];
                }
                if self.tools.forced() {
                    return self.cut_call(&held).into_iter().collect();
                }
            }
            out = self.push_tagged(&held);
        }
        let rest = std::mem::take(&mut self.buf);
        if std::mem::take(&mut self.in_call) {
            out.extend(self.cut_call(&rest));
        } else {
            self.content(&rest, &mut out);
        }
        let ws = std::mem::take(&mut self.held_ws);
        if self.calls == 0 && !ws.is_empty() {
            out.push(Piece::Content(ws));
        }
        out
    }

    /// A call block's text cut before its end, as a call (see [`finish`](Self::finish)).
    fn cut_call(&mut self, body: &str) -> Option<Piece> {
        let (name, arguments) = parse_call_body(body).or_else(|| parse_cut_call(body))?;
        if !self.tools.accepts(&name) || (!self.tools.parallel && self.calls > 0) {
            return None;
        }
        self.calls += 1;
        Some(Piece::Call(ParsedCall { index: self.calls - 1, name, arguments }))
    }

    /// Content text: trailing whitespace is held back (it may precede a call), leading
    /// whitespace after a call dropped.
    fn content(&mut self, s: &str, out: &mut Vec<Piece>) {
        let s = if self.after_call { s.trim_start() } else { s };
        if s.is_empty() {
            return;
        }
        self.after_call = false;
        let body = s.trim_end();
        if body.is_empty() {
            self.held_ws.push_str(s);
            return;
        }
        let mut text = std::mem::take(&mut self.held_ws);
        text.push_str(body);
        self.held_ws.push_str(&s[body.len()..]);
        out.push(Piece::Content(text));
    }
}

/// The length of the longest end of `s` that is a proper start of `tag`.
fn partial_tag_len(s: &str, tag: &str) -> usize {
    (1..tag.len().min(s.len() + 1)).rev().find(|&k| s.ends_with(&tag[..k])).unwrap_or(0)
}

/// A whole output that is one call object without the tags, as small models often write it
/// (Qwen2.5-Coder-0.5B does): it must have `arguments` (or `parameters`).
fn parse_bare_call(text: &str) -> Option<(String, String)> {
    let Ok(Value::Object(o)) = serde_json::from_str::<Value>(text.trim()) else { return None };
    if !o.contains_key("arguments") && !o.contains_key("parameters") {
        return None;
    }
    parse_call_body(text)
}

/// `{"name": ..., "arguments": {...}}` (or `"parameters"`) as (name, arguments JSON text).
fn parse_call_body(body: &str) -> Option<(String, String)> {
    let Ok(Value::Object(o)) = serde_json::from_str::<Value>(body.trim()) else { return None };
    let name = o.get("name")?.as_str()?.to_string();
    let arguments = match o.get("arguments").or_else(|| o.get("parameters")) {
        None | Some(Value::Null) => "{}".to_string(),
        // Some models write the arguments as a JSON string, as OpenAI returns them.
        Some(Value::String(s)) if serde_json::from_str::<Value>(s).is_ok_and(|v| v.is_object()) => s.clone(),
        Some(v @ Value::Object(_)) => v.to_string(),
        Some(_) => return None,
    };
    Some((name, arguments))
}

/// The start of a call object cut before its end: `{"name": "<whole name>"` and, where the
/// text got to them, the arguments as far as they go (not valid JSON; empty before them).
fn parse_cut_call(body: &str) -> Option<(String, String)> {
    let rest = body.trim_start().strip_prefix('{')?.trim_start().strip_prefix("\"name\"")?;
    let rest = rest.trim_start().strip_prefix(':')?.trim_start();
    let mut values = serde_json::Deserializer::from_str(rest).into_iter::<String>();
    let name = values.next()?.ok()?;
    let after = rest[values.byte_offset()..].trim_start();
    let arguments = after
        .strip_prefix(',')
        .and_then(|a| a.trim_start().strip_prefix("\"arguments\""))
        .and_then(|a| a.trim_start().strip_prefix(':'))
        .map_or(String::new(), |a| a.trim().to_string());
    Some((name, arguments))
}

/// The whole output at once: (content, calls). Content is None when calls were found and
/// nothing but whitespace is left around them.
pub fn parse_output(tools: &ToolRequest, text: &str) -> (Option<String>, Vec<ParsedCall>) {
    let mut p = ToolCallParser::new(tools.clone());
    let mut pieces = p.push(text);
    pieces.extend(p.finish());
    let (mut content, mut calls) = (String::new(), vec![]);
    for piece in pieces {
        match piece {
            Piece::Content(s) => content.push_str(&s),
            Piece::Call(c) => calls.push(c),
        }
    }
    let content = if content.is_empty() && !calls.is_empty() { None } else { Some(content) };
    (content, calls)
}

/// A call as OpenAI's message (and, with its index, stream delta) shape.
pub fn call_json(id: &str, c: &ParsedCall) -> Value {
    json!({"id": id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}})
}
