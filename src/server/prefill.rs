//! How a chat prompt ends: a new assistant turn opened (the generation prompt), nothing after
//! the last message, or the final assistant message continued (answer prefill: "start the reply
//! with ..."), as llama-server does by default, Anthropic's Messages API documents, and vLLM
//! does with `continue_final_message: true` + `add_generation_prompt: false`.
//!
//! - `add_generation_prompt` (default true) and `continue_final_message` (default false) may not
//!   both be true;
//! - a final assistant message (text, no tool calls) is continued unless the request says
//!   `add_generation_prompt: true` or `continue_final_message: false`; `continue_final_message:
//!   true` without one is a 400.
//!
//! Continuing renders the conversation without a generation prompt and cuts the text right
//! after the final message's content, so the model's next token follows it on the same turn.

use super::error::ApiError;
use super::params::Fields;
use super::tools::{render_prompt, ToolRequest};
use crate::tokenizer::{ChatMessage, Tokenizer};
use serde_json::{Map, Value};

/// How the rendered prompt ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TurnEnd {
    /// With the generation prompt: a new assistant turn.
    Open,
    /// After the last message as the template closes it.
    Closed,
    /// Inside the final assistant message, right after its content.
    Continue,
}

/// The request's `add_generation_prompt` and `continue_final_message` for `messages`.
pub(crate) fn turn_end(f: &Fields, messages: &[ChatMessage]) -> Result<TurnEnd, ApiError> {
    let generation = f.bool("add_generation_prompt")?;
    let cont = f.bool("continue_final_message")?;
    if generation == Some(true) && cont == Some(true) {
        return Err(ApiError::invalid(
            "continue_final_message",
            "`continue_final_message` and `add_generation_prompt` may not both be true",
        ));
    }
    let last = messages.last().filter(|m| m.role == "assistant" && m.tool_calls.is_none());
    let prefill = last.is_some_and(|m| !m.content.is_empty());
    match (cont, generation) {
        (Some(true), _) if !prefill => Err(ApiError::invalid(
            "continue_final_message",
            "`continue_final_message` needs a final assistant message with text to continue",
        )),
        (Some(true), _) => Ok(TurnEnd::Continue),
        (None, None) if prefill => Ok(TurnEnd::Continue),
        (_, Some(false)) => Ok(TurnEnd::Closed),
        _ => Ok(TurnEnd::Open),
    }
}

/// The prompt text of `messages` ending as `end` says (`render_prompt` for the rest).
pub(crate) fn render(
    tok: &Tokenizer,
    messages: &[ChatMessage],
    tools: Option<&ToolRequest>,
    end: TurnEnd,
    kwargs: Option<&Map<String, Value>>,
) -> Result<String, ApiError> {
    let failed = |e: anyhow::Error| ApiError::invalid("messages", format!("{e:#}"));
    let text = render_prompt(tok, messages, tools, end == TurnEnd::Open, kwargs).map_err(failed)?;
    if end != TurnEnd::Continue {
        return Ok(text);
    }
    let content = messages.last().map(|m| m.content.as_str()).unwrap_or_default();
    // Templates may trim the content they write.
    let found = [content, content.trim_end(), content.trim()]
        .into_iter()
        .filter(|c| !c.is_empty())
        .find_map(|c| text.rfind(c).map(|at| at + c.len()));
    match found {
        Some(end) => Ok(text[..end].to_string()),
        None => Err(ApiError::invalid(
            "messages",
            "the chat template does not write the final assistant message as it was given, so it cannot be \
             continued; send `continue_final_message: false` to answer it in a new turn",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn end(body: Value, roles: &[(&str, &str)]) -> Result<TurnEnd, ApiError> {
        let messages: Vec<ChatMessage> = roles.iter().map(|(r, c)| ChatMessage::new(*r, *c)).collect();
        turn_end(&Fields(body.as_object().unwrap()), &messages)
    }

    #[test]
    fn how_the_turn_ends() {
        let asked = [("user", "hi")];
        let prefilled = [("user", "hi"), ("assistant", "Sure,")];
        assert_eq!(end(json!({}), &asked).unwrap(), TurnEnd::Open);
        assert_eq!(end(json!({}), &prefilled).unwrap(), TurnEnd::Continue);
        assert_eq!(end(json!({"add_generation_prompt": true}), &prefilled).unwrap(), TurnEnd::Open);
        assert_eq!(end(json!({"continue_final_message": false}), &prefilled).unwrap(), TurnEnd::Open);
        assert_eq!(end(json!({"add_generation_prompt": false}), &asked).unwrap(), TurnEnd::Closed);
        let vllm = json!({"continue_final_message": true, "add_generation_prompt": false});
        assert_eq!(end(vllm, &prefilled).unwrap(), TurnEnd::Continue);
        assert_eq!(end(json!({}), &[("user", "hi"), ("assistant", "")]).unwrap(), TurnEnd::Open);
        for (body, roles) in [
            (json!({"continue_final_message": true, "add_generation_prompt": true}), &prefilled[..]),
            (json!({"continue_final_message": true}), &asked[..]),
        ] {
            let e = end(body.clone(), roles).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("continue_final_message"), "{body}");
        }
    }
}
