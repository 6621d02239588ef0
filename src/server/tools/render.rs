//! Tools and tool-call history into the prompt: through the model's chat template when it
//! renders `tools`, else generically (Hermes style; see the module docs of `tools`).

use super::{ToolRequest, CALL_CLOSE, CALL_OPEN};
use crate::tokenizer::{ChatMessage, Tokenizer};
use serde_json::{json, Value};

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
                let mut out = ChatMessage::new(m.role.clone(), content);
                out.reasoning_content = m.reasoning_content.clone();
                out
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
    kwargs: Option<&serde_json::Map<String, serde_json::Value>>,
) -> anyhow::Result<String> {
    let mut specs = tools.map(ToolRequest::specs);
    // gpt-oss's template joins `"// " + tool.description`, which fails on a tool without one
    // (OpenAI's API makes it optional): give such tools an empty description there.
    if tok.chat_template_source().is_some_and(|t| t.contains("<|channel|>")) {
        for s in specs.iter_mut().flatten() {
            if let Some(f) = s["function"].as_object_mut() {
                f.entry("description").or_insert(serde_json::Value::String(String::new()));
            }
        }
    }
    let folded;
    let messages = match fold_reasoning(tok, messages) {
        Some(f) => {
            folded = f;
            &folded[..]
        }
        None => messages,
    };
    let has_history = messages.iter().any(|m| m.tool_calls.is_some() || m.role == "tool");
    if tok.chat_template_supports_tools() {
        tok.apply_chat_template_kwargs(messages, specs.as_deref(), add_generation_prompt, kwargs)
    } else if specs.is_some() || has_history {
        let generic = generic_messages(messages, specs.as_deref());
        tok.apply_chat_template_kwargs(&generic, None, add_generation_prompt, kwargs)
    } else {
        tok.apply_chat_template_kwargs(messages, None, add_generation_prompt, kwargs)
    }
}

/// For a template that does not read `reasoning_content` but writes `<think>` spans (it finds
/// the thinking in the content, as Qwen3's and DeepSeek-R1's do): the messages with their
/// thinking put back into the content, in the span. None when nothing needs folding.
fn fold_reasoning(tok: &Tokenizer, messages: &[ChatMessage]) -> Option<Vec<ChatMessage>> {
    let source = tok.chat_template_source()?;
    if !messages.iter().any(|m| m.reasoning_content.is_some()) || source.contains("reasoning_content") {
        return None;
    }
    let think = source.contains(crate::server::reasoning::OPEN);
    let fold = |m: &ChatMessage| {
        let mut m = m.clone();
        if let Some(r) = m.reasoning_content.take().filter(|_| think) {
            m.content = format!(
                "{}\n{}\n{}\n\n{}",
                crate::server::reasoning::OPEN,
                r,
                crate::server::reasoning::CLOSE,
                m.content
            );
        }
        m
    };
    Some(messages.iter().map(fold).collect())
}
