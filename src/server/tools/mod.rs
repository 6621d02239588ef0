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
//!   (see [`render::generic_tools_prompt`]); an assistant message's calls become such blocks in its
//!   content, and a `tool` message becomes a `user` message holding
//!   `<tool_response>...</tool_response>`.
//! - **Parsing.** Output in the Hermes/Qwen form `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
//!   becomes OpenAI `tool_calls` ([`ToolCallParser`]). A block that is not a JSON object with a
//!   string `name`, or names a function the request did not define (with a named
//!   `tool_choice`: any other function), stays in the content as it was written. With
//!   `parallel_tool_calls: false` only the first call is kept (later blocks are dropped).
//!   Whitespace around parsed blocks is dropped; the content is null when nothing else is left.
//!   A block the output ends in (cut by `max_tokens`) is a call whose arguments are cut too, as
//!   OpenAI returns one (finish reason `length`), once its name is whole; before that, nothing.
//!   An output that is, as a whole, one call object without the tags (`{"name": ...,
//!   "arguments": {...}}`, as Qwen2.5-Coder-0.5B tends to answer) is a call too; to tell, a
//!   stream whose output starts with `{` is held back until the end.
//! - **`tool_choice: "none"`** follows vLLM's default: the tools are still rendered into the
//!   prompt, but the output is not parsed (any `<tool_call>` text stays content).
//! - **`required` / a named function** constrain decoding with a grammar
//!   ([`ToolRequest::constraint`], compiled by the structured-outputs library): the output is
//!   one call block (several with `required` and `parallel_tool_calls`) whose JSON names a
//!   permitted function and whose `arguments` follow that function's parameter schema. So even a
//!   small model returns a valid call (or, cut by `max_tokens`, a call with cut arguments:
//!   `length`).

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

    /// Whether the output must be calls (`required` or a named function).
    pub(crate) fn forced(&self) -> bool {
        matches!(self.choice, ToolChoice::Required | ToolChoice::Named(_))
    }

    /// Whether a call of `name` is accepted from the output.
    pub(crate) fn accepts(&self, name: &str) -> bool {
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

mod parse;
mod render;
#[cfg(test)]
mod tests;

pub use parse::{call_json, parse_output, ParsedCall, Piece, ToolCallParser};
pub use render::render_prompt;
