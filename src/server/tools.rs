//! Tool calling on `/v1/chat/completions`: OpenAI's `tools`, `tool_choice` and
//! `parallel_tool_calls`, tool-call history in the messages, prompt rendering, and the parsing
//! of the model's output into `tool_calls`.
//!
//! - **Rendering.** When the model's chat template mentions `tools` (Qwen2.5's, Hermes',
//!   Llama 3.1's do) the tool list is passed to it as the `tools` variable (each tool as OpenAI's
//!   `{"type": "function", "function": {"name", "description", "parameters"}}`), and history
//!   messages keep their `tool_calls` (arguments as JSON objects) and `role: "tool"`. Otherwise
//!   (SmolLM2's template) the server renders them generically, Hermes style: a system message
//!   (the first system message, extended, or a new one) lists the tools as JSON inside
//!   `<tools></tools>` and asks for calls as `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
//!   (see [`generic_tools_prompt`]); an assistant message's calls become such blocks in its
//!   content, and a `tool` message becomes a `user` message holding
//!   `<tool_response>...</tool_response>`.
//! - **Parsing.** Output in the Hermes/Qwen form `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
//!   becomes OpenAI `tool_calls` ([`ToolCallParser`]). A block that is not a JSON object with a
//!   string `name`, or names a function the request did not define (with a named
//!   `tool_choice`: any other function), stays in the content as it was written. With
//!   `parallel_tool_calls: false` only the first call is kept (later blocks are dropped).
//!   Whitespace around parsed blocks is dropped; the content is null when nothing else is left.
//!   An output that is, as a whole, one call object without the tags (`{"name": ...,
//!   "arguments": {...}}`, as Qwen2.5-Coder-0.5B tends to answer) is a call too; to tell, a
//!   stream whose output starts with `{` is held back until the end.
//! - **`tool_choice: "none"`** follows vLLM's default: the tools are still rendered into the
//!   prompt, but the output is not parsed (any `<tool_call>` text stays content).
//! - **`required` / a named function** constrain decoding with a grammar
//!   ([`ToolRequest::constraint`], compiled by the structured-outputs library): the output is
//!   one call block (several with `required` and `parallel_tool_calls`) whose JSON names a
//!   permitted function and whose `arguments` follow that function's parameter schema. So even a
//!   small model returns a valid call (or, cut by `max_tokens`, a prefix of one: `length`).

use super::error::ApiError;
use super::params::Fields;
use crate::tokenizer::{ChatMessage, Tokenizer};
use serde_json::{json, Map, Value};

/// Most tools per request.
pub const MAX_TOOLS: usize = 128;
/// The opening and closing tags of a call in the model's output.
pub const CALL_OPEN: &str = "<tool_call>";
pub const CALL_CLOSE: &str = "</tool_call>";

/// One function the model may call.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    pub name: String,
    /// The JSON schema of its arguments (`{"type": "object", "properties": {}}` when not given).
    pub parameters: Value,
    /// OpenAI's tool object as the chat template sees it.
    pub spec: Value,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

use super::params::type_name;

/// A request's tools and how they may be used.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolRequest {
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    pub parallel: bool,
}

fn valid_name(n: &str) -> bool {
    (1..=64).contains(&n.len()) && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl ToolRequest {
    /// `tools`, `tool_choice` and `parallel_tool_calls` of a chat request; None without tools
    /// (an empty list counts as none). Errors name the field at fault.
    pub fn parse(f: &Fields) -> Result<Option<ToolRequest>, ApiError> {
        let parallel = f.bool("parallel_tool_calls")?.unwrap_or(true);
        let tools = match f.get("tools") {
            None => vec![],
            Some(Value::Array(a)) if a.len() > MAX_TOOLS => {
                return Err(ApiError::invalid(
                    "tools",
                    format!("`tools` may hold at most {MAX_TOOLS} tools, got {}", a.len()),
                ))
            }
            Some(Value::Array(a)) => a.iter().enumerate().map(|(i, t)| parse_tool(i, t)).collect::<Result<_, _>>()?,
            Some(v) => {
                return Err(ApiError::invalid("tools", format!("`tools` must be an array, got {}", type_name(v))))
            }
        };
        for (i, t) in tools.iter().enumerate() {
            if tools[..i].iter().any(|u: &Tool| u.name == t.name) {
                return Err(ApiError::invalid(
                    &format!("tools[{i}].function.name"),
                    format!("the function name {:?} is defined twice", t.name),
                ));
            }
        }
        let choice = match f.get("tool_choice") {
            None => ToolChoice::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "none" => ToolChoice::None,
                "auto" => ToolChoice::Auto,
                "required" => ToolChoice::Required,
                other => {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        format!(
                            "`tool_choice` must be \"none\", \"auto\", \"required\" or \
                             {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {other:?}"
                        ),
                    ))
                }
            },
            Some(Value::Object(o)) => {
                let name = match (o.get("type"), o.get("function")) {
                    (Some(Value::String(t)), Some(Value::Object(func))) if t == "function" => {
                        func.get("name").and_then(Value::as_str)
                    }
                    _ => None,
                };
                let Some(name) = name else {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        "a named `tool_choice` must be {\"type\": \"function\", \"function\": {\"name\": \"...\"}}",
                    ));
                };
                if !tools.iter().any(|t| t.name == name) {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        format!("`tool_choice` names the function {name:?}, which is not among `tools`"),
                    ));
                }
                ToolChoice::Named(name.to_string())
            }
            Some(v) => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("`tool_choice` must be a string or an object, got {}", type_name(v)),
                ))
            }
        };
        if tools.is_empty() {
            return match choice {
                ToolChoice::None | ToolChoice::Auto => Ok(None),
                _ => Err(ApiError::invalid("tool_choice", "`tool_choice` requires `tools`")),
            };
        }
        Ok(Some(ToolRequest { tools, choice, parallel }))
    }

    /// Whether the output is parsed for tool calls (every choice but `none`).
    pub fn parses_output(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// The tool objects given to the chat template.
    pub fn specs(&self) -> Vec<Value> {
        self.tools.iter().map(|t| t.spec.clone()).collect()
    }

    /// Whether a call of `name` is accepted from the output.
    fn accepts(&self, name: &str) -> bool {
        match &self.choice {
            ToolChoice::Named(n) => n == name,
            _ => self.tools.iter().any(|t| t.name == name),
        }
    }

    /// What the output must be under `tool_choice: "required"` or a named function (None for
    /// `auto` and `none`): see [`ToolConstraint`]. `special(tag)`: whether the tokenizer has the
    /// tag as one special token (Qwen2.5's `<tool_call>`); the grammar then asks for that token,
    /// as the model was trained to write it, rather than for its spelling.
    pub fn constraint(&self, special: &dyn Fn(&str) -> bool) -> Option<ToolConstraint> {
        let candidates: Vec<&Tool> = match &self.choice {
            ToolChoice::None | ToolChoice::Auto => return None,
            ToolChoice::Required => self.tools.iter().collect(),
            ToolChoice::Named(n) => self.tools.iter().filter(|t| &t.name == n).collect(),
        };
        let one = |t: &Tool| {
            json!({
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                "required": ["name", "arguments"],
                "additionalProperties": false,
            })
        };
        let call_schema = match candidates.as_slice() {
            [t] => one(t),
            many => json!({"anyOf": many.iter().map(|t| one(t)).collect::<Vec<_>>()}),
        };
        let many = self.parallel && self.choice == ToolChoice::Required;
        let tag = |t: &str| if special(t) { t.to_string() } else { lark_literal(t) };
        // The JSON as OpenAI writes it (fixed separators, no free whitespace).
        let json = crate::structured::openai_json(call_schema.clone(), false);
        let lark = format!(
            "start: call{}\ncall: {} \"\\n\" %json {} \"\\n\" {}\n",
            if many { " (\"\\n\" call)*" } else { "" },
            tag(CALL_OPEN),
            json,
            tag(CALL_CLOSE),
        );
        Some(ToolConstraint { call_schema, lark, many })
    }
}

impl ToolRequest {
    /// [`constraint`](Self::constraint) for a model's tokenizer.
    pub fn constraint_for(&self, tok: &Tokenizer) -> Option<ToolConstraint> {
        self.constraint(&|tag| tok.token_to_id(tag).is_some_and(|id| tok.is_special(id)))
    }
}

/// The Lark grammar (llguidance's dialect) that a chat request body's `tools`, `tool_choice`
/// and `parallel_tool_calls` impose on the output for a model's tokenizer: None unless
/// `tool_choice` is `required` or names a function. Errors say which field is wrong.
pub fn tool_call_grammar(body: &Value, tok: &Tokenizer) -> Result<Option<String>, String> {
    let Value::Object(o) = body else { return Err("the body must be a JSON object".into()) };
    let req = ToolRequest::parse(&Fields(o)).map_err(|e| e.to_string())?;
    Ok(req.and_then(|r| r.constraint_for(tok)).map(|c| c.lark))
}

/// A Lark string literal.
fn lark_literal(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// The output `tool_choice: "required"` or a named function obliges: one call block (one or
/// more, newline-separated, with `required` and `parallel_tool_calls`), each
/// `<tool_call>\n{json}\n</tool_call>` whose JSON follows `call_schema`
/// (`{"name": <a defined function>, "arguments": <its parameters schema>}`). `lark` says the
/// same as a Lark grammar with an embedded JSON schema (llguidance's `%json {...}`).
#[derive(Clone, Debug, PartialEq)]
pub struct ToolConstraint {
    pub call_schema: Value,
    pub lark: String,
    /// Whether several calls may follow each other.
    pub many: bool,
}

fn parse_tool(i: usize, t: &Value) -> Result<Tool, ApiError> {
    let p = format!("tools[{i}]");
    let Value::Object(o) = t else {
        return Err(ApiError::invalid(&p, format!("`{p}` must be an object, got {}", type_name(t))));
    };
    match o.get("type") {
        Some(Value::String(s)) if s == "function" => {}
        _ => return Err(ApiError::invalid(&format!("{p}.type"), format!("`{p}.type` must be \"function\""))),
    }
    let pf = format!("{p}.function");
    let Some(Value::Object(func)) = o.get("function") else {
        return Err(ApiError::invalid(&pf, format!("`{pf}` must be an object with a `name`")));
    };
    let name = match func.get("name") {
        Some(Value::String(n)) if valid_name(n) => n.clone(),
        _ => {
            return Err(ApiError::invalid(
                &format!("{pf}.name"),
                format!("`{pf}.name` must be a string of 1 to 64 letters, digits, underscores or dashes"),
            ))
        }
    };
    let mut spec_fn = Map::new();
    spec_fn.insert("name".into(), Value::String(name.clone()));
    match func.get("description") {
        None | Some(Value::Null) => {}
        Some(Value::String(d)) => {
            spec_fn.insert("description".into(), Value::String(d.clone()));
        }
        Some(_) => {
            return Err(ApiError::invalid(&format!("{pf}.description"), format!("`{pf}.description` must be a string")))
        }
    }
    let parameters = match func.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(v @ Value::Object(_)) => v.clone(),
        Some(_) => {
            return Err(ApiError::invalid(
                &format!("{pf}.parameters"),
                format!("`{pf}.parameters` must be a JSON schema object"),
            ))
        }
    };
    spec_fn.insert("parameters".into(), parameters.clone());
    if let Some(s) = func.get("strict").filter(|s| !s.is_null()) {
        if !s.is_boolean() {
            return Err(ApiError::invalid(&format!("{pf}.strict"), format!("`{pf}.strict` must be a boolean")));
        }
    }
    Ok(Tool { name, parameters, spec: json!({"type": "function", "function": Value::Object(spec_fn)}) })
}

/// The tool-calling fields of history message `p` (`messages[i]`): an assistant's
/// `tool_calls` (content may then be null), a tool message's `tool_call_id` (required) and
/// `name`. Called by `params::parse_messages`.
pub fn parse_history_fields(f: &Fields, p: &str, msg: &mut ChatMessage) -> Result<(), ApiError> {
    let calls = f.get("tool_calls");
    if let Some(v) = calls {
        let pc = format!("{p}.tool_calls");
        if msg.role != "assistant" {
            return Err(ApiError::invalid(&pc, "only assistant messages may have `tool_calls`"));
        }
        let Value::Array(list) = v else {
            return Err(ApiError::invalid(&pc, format!("`{pc}` must be an array, got {}", type_name(v))));
        };
        let mut out = Vec::with_capacity(list.len());
        for (j, c) in list.iter().enumerate() {
            let pj = format!("{pc}[{j}]");
            let Value::Object(o) = c else {
                return Err(ApiError::invalid(&pj, format!("`{pj}` must be an object")));
            };
            let id = match o.get("id") {
                Some(Value::String(s)) => s.clone(),
                _ => return Err(ApiError::invalid(&format!("{pj}.id"), format!("`{pj}.id` must be a string"))),
            };
            if !matches!(o.get("type"), None | Some(Value::Null)) && o.get("type") != Some(&json!("function")) {
                return Err(ApiError::invalid(&format!("{pj}.type"), format!("`{pj}.type` must be \"function\"")));
            }
            let pf = format!("{pj}.function");
            let Some(Value::Object(func)) = o.get("function") else {
                return Err(ApiError::invalid(&pf, format!("`{pf}` must be an object with `name` and `arguments`")));
            };
            let Some(Value::String(name)) = func.get("name") else {
                return Err(ApiError::invalid(&format!("{pf}.name"), format!("`{pf}.name` must be a string")));
            };
            let pa = format!("{pf}.arguments");
            // A JSON string, as OpenAI sends it; the template sees the parsed object (as vLLM
            // passes it). An object is taken as it is.
            let arguments = match func.get("arguments") {
                None | Some(Value::Null) => json!({}),
                Some(Value::String(s)) if s.trim().is_empty() => json!({}),
                Some(Value::String(s)) => super::json::parse_embedded(s)
                    .map_err(|e| ApiError::invalid(&pa, format!("`{pa}` cannot be read: {e}")))?,
                Some(v @ Value::Object(_)) => v.clone(),
                Some(v) => {
                    return Err(ApiError::invalid(
                        &pa,
                        format!("`{pa}` must be a string holding JSON, got {}", type_name(v)),
                    ))
                }
            };
            out.push(json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}));
        }
        msg.tool_calls = Some(out);
    }
    if msg.role == "tool" {
        let pt = format!("{p}.tool_call_id");
        match f.get("tool_call_id") {
            Some(Value::String(s)) => msg.tool_call_id = Some(s.clone()),
            Some(v) => return Err(ApiError::invalid(&pt, format!("`{pt}` must be a string, got {}", type_name(v)))),
            None => return Err(ApiError::invalid(&pt, format!("`{pt}` is required in a tool message"))),
        }
    }
    if matches!(msg.role.as_str(), "tool" | "assistant" | "user" | "system") {
        match f.get("name") {
            None => {}
            Some(Value::String(s)) => msg.name = Some(s.clone()),
            Some(v) => {
                let pn = format!("{p}.name");
                return Err(ApiError::invalid(&pn, format!("`{pn}` must be a string, got {}", type_name(v))));
            }
        }
    }
    Ok(())
}

/// The system-prompt text that offers `tools` to a model whose chat template does not render
/// them (Hermes' function-calling prompt).
pub fn generic_tools_prompt(tools: &[Value]) -> String {
    let mut s = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for t in tools {
        s.push('\n');
        s.push_str(&t.to_string());
    }
    s.push_str(
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments within \
         <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": \
         <args-json-object>}\n</tool_call>",
    );
    s
}

/// `messages` rewritten for a template that knows nothing of tools (see the module docs).
pub fn generic_messages(messages: &[ChatMessage], tools: Option<&[Value]>) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = messages
        .iter()
        .map(|m| {
            let mut content = m.content.clone();
            if let Some(calls) = &m.tool_calls {
                for c in calls {
                    let call = json!({"name": c["function"]["name"], "arguments": c["function"]["arguments"]});
                    if !content.is_empty() {
                        content.push('\n');
                    }
                    content.push_str(&format!("{CALL_OPEN}\n{call}\n{CALL_CLOSE}"));
                }
            }
            if m.role == "tool" {
                ChatMessage::new("user", format!("<tool_response>\n{content}\n</tool_response>"))
            } else {
                ChatMessage::new(m.role.clone(), content)
            }
        })
        .collect();
    if let Some(tools) = tools.filter(|t| !t.is_empty()) {
        let prompt = generic_tools_prompt(tools);
        match out.first_mut() {
            Some(first) if first.role == "system" => first.content = format!("{}\n\n{prompt}", first.content),
            _ => out.insert(0, ChatMessage::new("system", prompt)),
        }
    }
    out
}

/// The chat prompt of `messages` with the request's tools (if any), through the template when
/// it supports tools, else through [`generic_messages`].
pub fn render_prompt(
    tok: &Tokenizer,
    messages: &[ChatMessage],
    tools: Option<&ToolRequest>,
    add_generation_prompt: bool,
) -> anyhow::Result<String> {
    let specs = tools.map(ToolRequest::specs);
    let has_history = messages.iter().any(|m| m.tool_calls.is_some() || m.role == "tool");
    if tok.chat_template_supports_tools() {
        tok.apply_chat_template_with_tools(messages, specs.as_deref(), add_generation_prompt)
    } else if specs.is_some() || has_history {
        tok.apply_chat_template(&generic_messages(messages, specs.as_deref()), add_generation_prompt)
    } else {
        tok.apply_chat_template(messages, add_generation_prompt)
    }
}

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

    /// The end of the output: whatever is still held back.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = vec![];
        if self.start != Start::Tagged {
            let held = std::mem::take(&mut self.start_buf);
            let bare = (self.start == Start::Bare).then(|| parse_bare_call(&held)).flatten();
            self.start = Start::Tagged;
            match bare.filter(|(name, _)| self.tools.accepts(name)) {
                Some((name, arguments)) => {
                    self.calls += 1;
                    return vec![Piece::Call(ParsedCall { index: 0, name, arguments })];
                }
                None => out = self.push_tagged(&held),
            }
        }
        let rest = std::mem::take(&mut self.buf);
        let rest = if std::mem::take(&mut self.in_call) { format!("{CALL_OPEN}{rest}") } else { rest };
        self.content(&rest, &mut out);
        let ws = std::mem::take(&mut self.held_ws);
        if self.calls == 0 && !ws.is_empty() {
            out.push(Piece::Content(ws));
        }
        out
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

#[cfg(test)]
mod tests {
    use super::*;

    fn req(body: Value) -> Result<Option<ToolRequest>, ApiError> {
        ToolRequest::parse(&Fields(body.as_object().unwrap()))
    }

    fn weather() -> Value {
        json!({"type": "function", "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        }})
    }

    fn tools(choice: Value, parallel: bool) -> ToolRequest {
        let time = json!({"type": "function", "function": {"name": "time"}});
        req(json!({"tools": [weather(), time], "tool_choice": choice, "parallel_tool_calls": parallel}))
            .unwrap()
            .unwrap()
    }

    #[test]
    fn requests_parse_and_bad_ones_name_the_field() {
        assert_eq!(req(json!({})).unwrap(), None);
        assert_eq!(req(json!({"tools": [], "tool_choice": "none"})).unwrap(), None);
        let t = tools(json!(null), true);
        assert_eq!((t.choice.clone(), t.parallel, t.tools.len()), (ToolChoice::Auto, true, 2));
        assert_eq!(t.tools[1].parameters, json!({"type": "object", "properties": {}}));
        assert_eq!(t.tools[1].spec["function"]["name"], "time");
        assert_eq!(
            tools(json!({"type": "function", "function": {"name": "time"}}), false).choice,
            ToolChoice::Named("time".into())
        );
        assert_eq!(tools(json!("required"), true).choice, ToolChoice::Required);
        assert!(!tools(json!("none"), true).parses_output());
        let w = weather();
        for (body, param) in [
            (json!({"tools": {}}), "tools"),
            (json!({"tools": [5]}), "tools[0]"),
            (json!({"tools": [{"type": "retrieval"}]}), "tools[0].type"),
            (json!({"tools": [{"type": "function"}]}), "tools[0].function"),
            (json!({"tools": [{"type": "function", "function": {}}]}), "tools[0].function.name"),
            (json!({"tools": [w, {"type": "function", "function": {"name": "a b"}}]}), "tools[1].function.name"),
            (json!({"tools": [{"type": "function", "function": {"name": "x".repeat(65)}}]}), "tools[0].function.name"),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}),
                "tools[0].function.parameters",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f", "description": 1}}]}),
                "tools[0].function.description",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}),
                "tools[0].function.strict",
            ),
            (json!({"tools": [w, w]}), "tools[1].function.name"),
            (json!({"tools": vec![w.clone(); MAX_TOOLS + 1]}), "tools"),
            (json!({"tools": [w], "tool_choice": "always"}), "tool_choice"),
            (json!({"tools": [w], "tool_choice": 1}), "tool_choice"),
            (json!({"tools": [w], "tool_choice": {"type": "function", "function": {"name": "nope"}}}), "tool_choice"),
            (json!({"tools": [w], "tool_choice": {"type": "function"}}), "tool_choice"),
            (json!({"tool_choice": "required"}), "tool_choice"),
            (json!({"tools": [w], "parallel_tool_calls": "no"}), "parallel_tool_calls"),
        ] {
            let e = req(body.clone()).unwrap_err();
            assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some(param)), "{body}: {e:?}");
        }
    }

    #[test]
    fn history_fields() {
        let parse = |m: Value| {
            let mut msg = ChatMessage::new(m["role"].as_str().unwrap(), "");
            parse_history_fields(&Fields(m.as_object().unwrap()), "messages[1]", &mut msg).map(|_| msg)
        };
        let m = parse(json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}))
        .unwrap();
        assert_eq!(
            m.tool_calls.unwrap(),
            vec![json!({"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}})]
        );
        let m = parse(json!({"role": "tool", "tool_call_id": "call_1", "content": "20 C"})).unwrap();
        assert_eq!(m.tool_call_id.as_deref(), Some("call_1"));
        let call =
            |f: Value| json!({"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": f}]});
        for (m, param) in [
            (json!({"role": "user", "tool_calls": []}), "messages[1].tool_calls"),
            (json!({"role": "assistant", "tool_calls": {}}), "messages[1].tool_calls"),
            (json!({"role": "assistant", "tool_calls": [1]}), "messages[1].tool_calls[0]"),
            (json!({"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}), "messages[1].tool_calls[0].id"),
            (
                json!({"role": "assistant", "tool_calls": [{"id": "c", "type": "x", "function": {}}]}),
                "messages[1].tool_calls[0].type",
            ),
            (json!({"role": "assistant", "tool_calls": [{"id": "c"}]}), "messages[1].tool_calls[0].function"),
            (call(json!({"arguments": "{}"})), "messages[1].tool_calls[0].function.name"),
            (call(json!({"name": "f", "arguments": "{oops"})), "messages[1].tool_calls[0].function.arguments"),
            (call(json!({"name": "f", "arguments": 5})), "messages[1].tool_calls[0].function.arguments"),
            (json!({"role": "tool", "content": "x"}), "messages[1].tool_call_id"),
            (json!({"role": "tool", "content": "x", "tool_call_id": 3}), "messages[1].tool_call_id"),
            (json!({"role": "tool", "tool_call_id": "c", "name": 3}), "messages[1].name"),
        ] {
            let e = parse(m.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{m}: {e:?}");
        }
    }

    #[test]
    fn generic_rendering_lists_tools_and_rewrites_history() {
        let t = tools(json!("auto"), true);
        let mut asst = ChatMessage::new("assistant", "");
        asst.tool_calls =
            Some(vec![json!({"id": "c", "type": "function", "function": {"name": "time", "arguments": {}}})]);
        let mut result = ChatMessage::new("tool", "12:00");
        result.tool_call_id = Some("c".into());
        let msgs = [ChatMessage::new("user", "time?"), asst, result];
        let out = generic_messages(&msgs, Some(&t.specs()));
        assert_eq!(out.len(), 4);
        assert_eq!(out[0].role, "system");
        assert!(
            out[0].content.contains("<tools>\n{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"description\":\"Weather of a city\""),
            "{}",
            out[0].content
        );
        assert!(out[0].content.contains("<tool_call>\n{\"name\": <function-name>"), "{}", out[0].content);
        assert_eq!(out[2].content, "<tool_call>\n{\"name\":\"time\",\"arguments\":{}}\n</tool_call>");
        assert_eq!(out[3], ChatMessage::new("user", "<tool_response>\n12:00\n</tool_response>"));
        // An existing system message is extended.
        let out = generic_messages(&[ChatMessage::new("system", "Be brief.")], Some(&t.specs()));
        assert_eq!(out.len(), 1);
        assert!(out[0].content.starts_with("Be brief.\n\n# Tools\n"), "{}", out[0].content);
    }

    #[test]
    fn constraint_for_required_and_named() {
        let plain = |_: &str| false;
        assert_eq!(tools(json!("auto"), true).constraint(&plain), None);
        assert_eq!(tools(json!("none"), true).constraint(&plain), None);
        let named = tools(json!({"type": "function", "function": {"name": "get_weather"}}), true);
        let named = named.constraint(&plain).unwrap();
        assert_eq!(named.call_schema["properties"]["name"], json!({"const": "get_weather"}));
        assert_eq!(named.call_schema["properties"]["arguments"]["required"], json!(["city"]));
        assert!(!named.many);
        let json = crate::structured::openai_json(named.call_schema.clone(), false);
        assert_eq!(
            named.lark,
            format!("start: call\ncall: \"<tool_call>\" \"\\n\" %json {json} \"\\n\" \"</tool_call>\"\n")
        );
        // Tags that are special tokens are asked for as tokens.
        let special = |t: &str| t == CALL_OPEN || t == CALL_CLOSE;
        let named = tools(json!({"type": "function", "function": {"name": "get_weather"}}), true);
        let lark = named.constraint(&special).unwrap().lark;
        assert!(lark.starts_with("start: call\ncall: <tool_call> \"\\n\" %json {"), "{lark}");
        assert!(lark.ends_with("} \"\\n\" </tool_call>\n"), "{lark}");
        let req = tools(json!("required"), true).constraint(&plain).unwrap();
        assert_eq!(req.call_schema["anyOf"].as_array().unwrap().len(), 2);
        assert!(req.many && req.lark.starts_with("start: call (\"\\n\" call)*\n"), "{}", req.lark);
        assert!(!tools(json!("required"), false).constraint(&plain).unwrap().many);
        // What the parser accepts from a call that follows the schema.
        let call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let (_, calls) = parse_output(&tools(json!("required"), true), call);
        assert_eq!(calls[0].arguments, "{\"city\":\"Paris\"}");
    }

    const SAMPLE: &str = "Let me check. <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n\
        <tool_call>{\"name\": \"time\"}</tool_call>\n<tool_call>{not json}</tool_call> tail <tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call>\
        <tool_call>{\"name\": \"time\", \"arguments\": \"{\\\"tz\\\": \\\"UTC\\\"}\"}</tool_call>\n <tool_c";

    #[test]
    fn output_parsing() {
        let t = tools(json!("auto"), true);
        let (content, calls) = parse_output(&t, SAMPLE);
        assert_eq!(
            content.as_deref(),
            Some(
                "Let me check.<tool_call>{not json}</tool_call> tail <tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call><tool_c"
            )
        );
        let got: Vec<(usize, &str, &str)> =
            calls.iter().map(|c| (c.index, c.name.as_str(), c.arguments.as_str())).collect();
        assert_eq!(
            got,
            vec![(0, "get_weather", "{\"city\":\"Paris\"}"), (1, "time", "{}"), (2, "time", "{\"tz\": \"UTC\"}")]
        );
        // parallel_tool_calls false: the first call only.
        let (content, calls) = parse_output(&tools(json!("auto"), false), SAMPLE);
        assert_eq!(calls.len(), 1);
        assert!(content.unwrap().starts_with("Let me check.<tool_call>{not json}"));
        // A named choice accepts that function only.
        let named = tools(json!({"type": "function", "function": {"name": "time"}}), true);
        assert_eq!(parse_output(&named, SAMPLE).1.len(), 2);
        // Calls alone: null content. No calls: the text as it was.
        let only = "\n<tool_call>\n{\"name\": \"time\", \"arguments\": {}}\n</tool_call>\n";
        assert_eq!(
            parse_output(&t, only),
            (None, vec![ParsedCall { index: 0, name: "time".into(), arguments: "{}".into() }])
        );
        // A whole output that is one call without the tags (with `arguments`) is a call too.
        let bare = " {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n";
        let want = ParsedCall { index: 0, name: "get_weather".into(), arguments: "{\"city\":\"Paris\"}".into() };
        assert_eq!(parse_output(&t, bare), (None, vec![want]));
        for plain in [
            "",
            "  hello \n",
            "a < b <tool",
            "<tool_call>{\"name\": \"time\"}",
            " x <tool_call>\n",
            "{\"name\": \"time\"}",
            "{\"name\": \"nope\", \"arguments\": {}}",
            "{\"name\": \"time\", \"arguments\": {}} and more",
            " {\"a\": 1}",
        ] {
            assert_eq!(parse_output(&t, plain), (Some(plain.to_string()), vec![]), "{plain:?}");
        }
    }

    /// Fed in two pieces split at every byte (and one byte at a time), the parser gives the
    /// same calls and content as fed whole; content never shows a tag's start before it is
    /// known to be text.
    #[test]
    fn streaming_split_anywhere_equals_whole() {
        let t = tools(json!("auto"), true);
        for text in [
            format!("{SAMPLE} é ✓\n\n"),
            "\n {\"name\": \"time\", \"arguments\": {\"tz\": \"é\"}} \n".to_string(),
            format!(" {{\"name\": \"time\"}}{SAMPLE}"),
        ] {
            split_anywhere(&t, &text);
        }
        // A call is released as soon as its closing tag is complete.
        let mut p = ToolCallParser::new(t.clone());
        assert_eq!(p.push("Hi <tool_call>{\"name\": \"time\"}</tool_cal"), vec![Piece::Content("Hi".into())]);
        assert!(matches!(p.push("l>").as_slice(), [Piece::Call(_)]));
        assert_eq!(p.calls(), 1);
    }

    fn split_anywhere(t: &ToolRequest, text: &str) {
        let whole = parse_output(t, text);
        let collect = |pieces: &[&str]| {
            let mut p = ToolCallParser::new(t.clone());
            let (mut content, mut calls) = (String::new(), vec![]);
            let mut all = vec![];
            for s in pieces {
                all.extend(p.push(s));
            }
            all.extend(p.finish());
            for piece in all {
                match piece {
                    Piece::Content(s) => {
                        assert!(!s.is_empty());
                        assert!(!s.contains("<tool_call>\n{\"name\": \"get_weather\""), "{s:?}");
                        content.push_str(&s)
                    }
                    Piece::Call(c) => calls.push(c),
                }
            }
            let content = if content.is_empty() && !calls.is_empty() { None } else { Some(content) };
            (content, calls)
        };
        for i in 0..=text.len() {
            if text.is_char_boundary(i) {
                assert_eq!(collect(&[&text[..i], &text[i..]]), whole, "split at {i}");
            }
        }
        let chars: Vec<String> = text.chars().map(String::from).collect();
        assert_eq!(collect(&chars.iter().map(String::as_str).collect::<Vec<_>>()), whole);
    }
}
