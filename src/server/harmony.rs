//! gpt-oss's harmony output format (vLLM's `openai_gptoss` reasoning parser and `openai` tool
//! parser): the output is a sequence of messages, each a header and a body,
//!
//! ```text
//! <|channel|>analysis<|message|>thinking...<|end|>
//! <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
//! <|start|>assistant<|channel|>final<|message|>the answer<|return|>
//! ```
//!
//! (the prompt ends with `<|start|>assistant`, so the first header starts at `<|channel|>`; the
//! recipient `to=...` may also come before `<|channel|>`). Bodies go by channel and recipient:
//! `analysis` to `reasoning_content`; `final` and recipient-less `commentary` (preambles) to
//! `content`; a body addressed to `functions.NAME` becomes a tool call of NAME with the body as
//! its arguments (when the request has tools that accept NAME and the body is a JSON object;
//! otherwise it stays content); a body addressed to anything else (the built-in `browser` and
//! `python` tools, not run here) to `reasoning_content`. The output must keep its special
//! tokens as text (skip_special_tokens off). Text that may be the start of a marker is held
//! back, so the parts streamed in any pieces add up to the parts of the whole.

use super::tools::{ParsedCall, ToolRequest};
use serde_json::Value;

/// A piece of parsed output, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HarmonyPart {
    Reasoning(String),
    Content(String),
    Call(ParsedCall),
}

const MESSAGE: &str = "<|message|>";
/// Markers that end a body: the message ends, a call or the whole answer ends, or (a model that
/// left out `<|end|>`) a new message or channel starts.
const BODY_ENDS: [&str; 5] = ["<|end|>", "<|call|>", "<|return|>", "<|start|>", "<|channel|>"];
/// Every marker (for holding back a possible start of one).
const MARKERS: [&str; 7] =
    ["<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|start|>", "<|channel|>", "<|constrain|>"];
/// A header longer than this without `<|message|>` is not a header: the text is content.
const MAX_HEADER: usize = 512;

/// Where a body goes.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Route {
    Reasoning,
    Content,
    /// A call of this function; the body is collected as its arguments.
    Call(String),
}

#[derive(Clone, Debug)]
enum State {
    /// Collecting a header until `<|message|>`.
    Header,
    Body(Route),
    /// No harmony header where one must be: the rest of the output is content.
    Plain,
}

/// Splits one choice's output into reasoning, content and tool calls as it arrives.
#[derive(Clone, Debug)]
pub struct HarmonyParser {
    tools: Option<ToolRequest>,
    state: State,
    buf: String,
    /// The arguments of the call being read.
    args: String,
    calls: usize,
}

impl HarmonyParser {
    /// `tools`: the request's tools when their calls are parsed (None: calls stay content).
    pub fn new(tools: Option<ToolRequest>) -> HarmonyParser {
        HarmonyParser { tools, state: State::Header, buf: String::new(), args: String::new(), calls: 0 }
    }

    /// How many calls were found so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    pub fn push(&mut self, text: &str) -> Vec<HarmonyPart> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        while self.step(&mut out, false) {}
        merge(out)
    }

    /// The output ended: a call being read is complete, text held back is given out.
    pub fn finish(&mut self) -> Vec<HarmonyPart> {
        let mut out = Vec::new();
        while self.step(&mut out, true) {}
        merge(out)
    }

    /// One step; false when nothing more can be done with what is buffered.
    fn step(&mut self, out: &mut Vec<HarmonyPart>, end: bool) -> bool {
        match self.state.clone() {
            State::Plain => {
                if !self.buf.is_empty() {
                    out.push(HarmonyPart::Content(std::mem::take(&mut self.buf)));
                }
                false
            }
            State::Header => {
                if let Some(i) = self.buf.find(MESSAGE) {
                    let header: String = self.buf.drain(..i + MESSAGE.len()).collect();
                    self.state = State::Body(route(&header[..i]));
                    return true;
                }
                let t = self.buf.trim_start();
                let may_be_header = t.starts_with("<|") || "<|".starts_with(t);
                if !self.buf.is_empty() && (self.buf.len() > MAX_HEADER || !may_be_header || (end && t.is_empty())) {
                    // Not harmony (a model that answers in plain text): content as it stands.
                    self.state = State::Plain;
                    return true;
                }
                if end {
                    // An unfinished header (max_tokens) carries nothing to show.
                    self.buf.clear();
                }
                false
            }
            State::Body(r) => {
                let found = BODY_ENDS.iter().filter_map(|m| self.buf.find(m).map(|i| (i, *m))).min();
                match found {
                    Some((i, marker)) => {
                        let body: String = self.buf.drain(..i).collect();
                        // The marker itself goes too, unless it starts the next header.
                        if !matches!(marker, "<|start|>" | "<|channel|>") {
                            self.buf.drain(..marker.len());
                        }
                        self.emit(&r, body, out);
                        self.end_message(&r, out);
                        self.state = State::Header;
                        true
                    }
                    None => {
                        let keep = if end { 0 } else { held_tail(&self.buf) };
                        let body: String = self.buf.drain(..self.buf.len() - keep).collect();
                        self.emit(&r, body, out);
                        if end {
                            self.end_message(&r, out);
                            self.state = State::Header;
                        }
                        false
                    }
                }
            }
        }
    }

    fn emit(&mut self, r: &Route, text: String, out: &mut Vec<HarmonyPart>) {
        match r {
            Route::Reasoning => out.push(HarmonyPart::Reasoning(text)),
            Route::Content => out.push(HarmonyPart::Content(text)),
            Route::Call(_) => self.args.push_str(&text),
        }
    }

    /// A message ended: a call is given out (or, not accepted, its body as content).
    fn end_message(&mut self, r: &Route, out: &mut Vec<HarmonyPart>) {
        let Route::Call(name) = r else { return };
        let args = std::mem::take(&mut self.args);
        let json_object = serde_json::from_str::<Value>(args.trim()).is_ok_and(|v| v.is_object());
        let accepted = self.tools.as_ref().is_some_and(|t| t.accepts(name) && (t.parallel || self.calls == 0));
        if accepted && json_object {
            out.push(HarmonyPart::Call(ParsedCall {
                index: self.calls,
                name: name.clone(),
                arguments: args.trim().into(),
            }));
            self.calls += 1;
        } else {
            out.push(HarmonyPart::Content(args));
        }
    }
}

/// Where the body after `header` goes: its recipient (`to=...`, before or after the channel)
/// and its channel decide.
fn route(header: &str) -> Route {
    let header = header.replace("<|constrain|>", " ");
    let recipient = header
        .split("to=")
        .nth(1)
        .map(|r| r.split(|c: char| c.is_whitespace() || c == '<').next().unwrap_or("").to_string());
    let channel = header
        .split("<|channel|>")
        .nth(1)
        .and_then(|c| c.split(|ch: char| ch.is_whitespace() || ch == '<').next())
        .unwrap_or("");
    match recipient.as_deref() {
        Some(r) if r.starts_with("functions.") => Route::Call(r["functions.".len()..].to_string()),
        Some(r) if !r.is_empty() => Route::Reasoning,
        _ if channel == "analysis" => Route::Reasoning,
        _ => Route::Content,
    }
}

/// Bytes at the end of `s` that may be the start of a marker.
fn held_tail(s: &str) -> usize {
    let Some(i) = s.rfind('<') else { return 0 };
    let t = &s[i..];
    if MARKERS.iter().any(|m| m.len() > t.len() && m.starts_with(t)) {
        t.len()
    } else {
        0
    }
}

/// Adjacent text parts of one kind joined, empty ones dropped.
fn merge(parts: Vec<HarmonyPart>) -> Vec<HarmonyPart> {
    let mut out: Vec<HarmonyPart> = Vec::new();
    for p in parts {
        match (out.last_mut(), p) {
            (_, HarmonyPart::Reasoning(s) | HarmonyPart::Content(s)) if s.is_empty() => {}
            (Some(HarmonyPart::Reasoning(a)), HarmonyPart::Reasoning(b)) => a.push_str(&b),
            (Some(HarmonyPart::Content(a)), HarmonyPart::Content(b)) => a.push_str(&b),
            (_, p) => out.push(p),
        }
    }
    out
}

/// A whole output: (reasoning, content, calls); the texts None when empty.
pub fn parse_whole(tools: Option<&ToolRequest>, text: &str) -> (Option<String>, Option<String>, Vec<ParsedCall>) {
    let mut p = HarmonyParser::new(tools.cloned());
    let mut parts = p.push(text);
    parts.extend(p.finish());
    joined(parts)
}

fn joined(parts: Vec<HarmonyPart>) -> (Option<String>, Option<String>, Vec<ParsedCall>) {
    let (mut reasoning, mut content, mut calls) = (String::new(), String::new(), Vec::new());
    for p in parts {
        match p {
            HarmonyPart::Reasoning(t) => reasoning.push_str(&t),
            HarmonyPart::Content(t) => content.push_str(&t),
            HarmonyPart::Call(c) => calls.push(c),
        }
    }
    let some = |s: String| (!s.is_empty()).then_some(s);
    (some(reasoning), some(content), calls)
}

#[cfg(test)]
#[path = "harmony_tests.rs"]
mod tests;
