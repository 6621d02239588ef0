use super::*;
use crate::server::tools::{Tool, ToolChoice};
use serde_json::json;

fn tools(choice: ToolChoice, parallel: bool) -> ToolRequest {
    let tool = |name: &str| Tool {
        name: name.into(),
        parameters: json!({"type": "object", "properties": {}}),
        spec: json!({"type": "function", "function": {"name": name}}),
    };
    ToolRequest { tools: vec![tool("get_weather"), tool("get_time")], choice, parallel }
}

fn call(index: usize, name: &str, arguments: &str) -> ParsedCall {
    ParsedCall { index, name: name.into(), arguments: arguments.into() }
}

fn s(x: &str) -> Option<String> {
    Some(x.to_string())
}

const THINK_ANSWER: &str =
    "<|channel|>analysis<|message|>The user asks for 2+2.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.<|return|>";
const CALL: &str = "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary \
                    to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>";

#[test]
fn channels_go_to_reasoning_and_content() {
    assert_eq!(parse_whole(None, THINK_ANSWER), (s("The user asks for 2+2."), s("It is 4."), vec![]));
    // Stopped at <|return|> (an end-of-generation token, so not in the text).
    let cut = THINK_ANSWER.trim_end_matches("<|return|>");
    assert_eq!(parse_whole(None, cut), (s("The user asks for 2+2."), s("It is 4."), vec![]));
    // Cut by max_tokens inside the thinking, and inside a header.
    assert_eq!(parse_whole(None, "<|channel|>analysis<|message|>Hmm, le"), (s("Hmm, le"), None, vec![]));
    assert_eq!(
        parse_whole(None, "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|chan"),
        (s("a"), None, vec![])
    );
    // A preamble on the commentary channel is shown to the user.
    let pre = "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final<|message|>Done.";
    assert_eq!(parse_whole(None, pre), (None, s("Checking.Done."), vec![]));
    // A model that answers in plain text.
    assert_eq!(parse_whole(None, "Just text <b>"), (None, s("Just text <b>"), vec![]));
    // A built-in tool's call (not run here) is not shown as content.
    let browse = "<|channel|>analysis to=browser.search<|message|>{\"query\": \"x\"}<|call|>";
    assert_eq!(parse_whole(None, browse), (s("{\"query\": \"x\"}"), None, vec![]));
}

#[test]
fn function_calls_become_tool_calls() {
    let t = tools(ToolChoice::Auto, true);
    assert_eq!(
        parse_whole(Some(&t), CALL),
        (s("Need weather."), None, vec![call(0, "get_weather", "{\"city\": \"Paris\"}")])
    );
    // The recipient before the channel, and a call cut at its end (<|call|> stops generation).
    let before = "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}";
    assert_eq!(parse_whole(Some(&t), before), (None, None, vec![call(0, "get_time", "{}")]));
    // Two calls; with parallel_tool_calls false only the first.
    let two = format!(
        "{CALL}<|start|>assistant to=functions.get_time<|channel|>commentary<|message|>{{\"tz\": \"UTC\"}}<|call|>"
    );
    assert_eq!(parse_whole(Some(&t), &two).2.len(), 2);
    assert_eq!(
        parse_whole(Some(&tools(ToolChoice::Auto, false)), &two).2,
        vec![call(0, "get_weather", "{\"city\": \"Paris\"}")]
    );
    // An unknown function, a call without tools in the request, arguments that are not a JSON
    // object, or another function than the named one: the body stays content.
    let unknown = CALL.replace("get_weather", "launch");
    assert_eq!(parse_whole(Some(&t), &unknown), (s("Need weather."), s("{\"city\": \"Paris\"}"), vec![]));
    assert_eq!(parse_whole(None, CALL).1, s("{\"city\": \"Paris\"}"));
    assert_eq!(parse_whole(Some(&t), &CALL.replace("{\"city\": \"Paris\"}", "[1]")).1, s("[1]"));
    let named = tools(ToolChoice::Named("get_time".into()), true);
    assert!(parse_whole(Some(&named), CALL).2.is_empty());
}

/// The output cut at every pair of points and fed in three pieces gives the whole's parts.
#[test]
fn streamed_parts_add_up_to_the_whole_at_any_boundary() {
    let t = tools(ToolChoice::Auto, true);
    for text in [THINK_ANSWER, CALL, "<|channel|>final<|message|>a < b <|e and <|end|>", "plain <|"] {
        let whole = parse_whole(Some(&t), text);
        let cuts: Vec<usize> = (0..=text.len()).filter(|&i| text.is_char_boundary(i)).collect();
        for &a in &cuts {
            for &b in cuts.iter().filter(|&&b| b >= a) {
                let mut p = HarmonyParser::new(Some(t.clone()));
                let mut parts = p.push(&text[..a]);
                parts.extend(p.push(&text[a..b]));
                parts.extend(p.push(&text[b..]));
                parts.extend(p.finish());
                assert_eq!(joined(parts), whole, "{text:?} cut at {a}, {b}");
            }
        }
    }
}
