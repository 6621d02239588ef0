use super::parse::ParsedCall;
use super::render::generic_messages;
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
    req(json!({"tools": [weather(), time], "tool_choice": choice, "parallel_tool_calls": parallel})).unwrap().unwrap()
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
    let call = |f: Value| json!({"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": f}]});
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
    asst.tool_calls = Some(vec![json!({"id": "c", "type": "function", "function": {"name": "time", "arguments": {}}})]);
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
        "{\"name\": \"time\"}",
        "{\"name\": \"nope\", \"arguments\": {}}",
        "{\"name\": \"time\", \"arguments\": {}} and more",
        " {\"a\": 1}",
    ] {
        assert_eq!(parse_output(&t, plain), (Some(plain.to_string()), vec![]), "{plain:?}");
    }
}

/// An output that ends inside a call block (cut by `max_tokens`) gives a call with the
/// arguments as far as they got once the name is whole, else nothing: never the raw block.
#[test]
fn a_cut_call_is_a_call_with_cut_arguments() {
    let call = |name: &str, args: &str| ParsedCall { index: 0, name: name.into(), arguments: args.into() };
    for choice in [json!("auto"), json!("required"), json!({"type": "function", "function": {"name": "get_weather"}})] {
        let t = tools(choice.clone(), false);
        for (text, want) in [
            ("<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Pa", Some("{\"city\":\"Pa")),
            ("<tool_call>\n{\"name\":\"get_weather\",\"argu", Some("")),
            ("<tool_call>\n{\"name\": \"get_weather\"", Some("")),
            (
                "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}\n",
                Some("{\"city\":\"Paris\"}"),
            ),
            ("<tool_call>\n{\"name\":\"get_wea", None),
            ("<tool_call>\n{\"na", None),
            ("<tool_call>", None),
        ] {
            let (content, calls) = parse_output(&t, text);
            let want_calls: Vec<ParsedCall> = want.map(|a| call("get_weather", a)).into_iter().collect();
            assert_eq!(calls, want_calls, "{choice} {text:?}");
            assert!(content.as_deref().is_none_or(|c| !c.contains("tool_call")), "{choice} {text:?}: {content:?}");
            split_anywhere(&t, text);
        }
        // Text before the cut block stays; a cut call of an unknown function is dropped.
        let (content, calls) = parse_output(&t, "Checking. <tool_call>\n{\"name\":\"nope\",\"arguments\":{");
        assert_eq!((content.as_deref(), calls.len()), (Some("Checking. "), 0), "{choice}");
    }
    // Forced: an output cut before its tags (a bare call's start) is read as a cut call too;
    // under `auto` such text is an answer (a JSON object cut short), left as it is.
    let bare = "{\"name\":\"get_weather\",\"arguments\":{\"ci";
    assert_eq!(parse_output(&tools(json!("required"), true), bare), (None, vec![call("get_weather", "{\"ci")]));
    assert_eq!(parse_output(&tools(json!("auto"), true), bare), (Some(bare.to_string()), vec![]));
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
