use super::*;

fn tr(v: Value) -> Result<Map<String, Value>, ApiError> {
    translate(v.as_object().unwrap().clone()).map(|t| t.body)
}

#[test]
fn a_conversation_with_tools_becomes_chat_messages() {
    let body = tr(json!({
        "model": "m",
        "max_tokens": 64,
        "system": [{"type": "text", "text": "Be brief."}],
        "stop_sequences": ["END"],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "x"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C"}]},
                {"type": "text", "text": "And tomorrow?"}
            ]}
        ],
        "tools": [{"name": "get_weather", "description": "d", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }))
    .unwrap();
    assert_eq!(
        body["messages"],
        json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"},
            {"role": "user", "content": "And tomorrow?"}
        ])
    );
    assert_eq!(
        body["tools"],
        json!([{"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": {"type": "object"}}}])
    );
    assert_eq!(body["tool_choice"], json!("required"));
    assert_eq!(body["parallel_tool_calls"], json!(false));
    assert_eq!(body["stop"], json!(["END"]));
    assert_eq!(body["max_tokens"], json!(64));
    assert_eq!(body["chat_template_kwargs"], json!({"enable_thinking": true}));
}

#[test]
fn bad_requests_name_the_field() {
    for (body, param) in [
        (json!({"messages": []}), "messages"),
        (json!({"messages": [{"role": "system", "content": "x"}]}), "messages[0].role"),
        (json!({"messages": [{"role": "user", "content": 5}]}), "messages[0].content"),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
            "messages[0].content[0]",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f"}]}]}),
            "messages[0].content[0]",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305", "name": "w"}]}),
            "tools[0].type",
        ),
        (json!({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "tool"}}), "tool_choice.name"),
        (json!({"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}), "tool_choice"),
        (json!({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "on"}}), "thinking.type"),
        (json!({"messages": [{"role": "user", "content": "x"}], "system": 3}), "system"),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "output_config": {"format": {"type": "xml"}}}),
            "output_config.format.type",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "output_config": {"format": {"type": "json_schema"}}}),
            "output_config.format.schema",
        ),
        (json!({"messages": [{"role": "user", "content": "x"}], "output_config": 1}), "output_config"),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "output_format": {"type": "text"}}),
            "output_format.type",
        ),
    ] {
        let e = tr(body.clone()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some(param), "{body}: {e}");
        assert_eq!(e.status, 400);
    }
}

#[test]
fn stop_reasons() {
    let stops = vec!["END".to_string(), "STOP".to_string()];
    let plain = Usage::default();
    let by_stop = Usage { stop_string: Some(1), ..Usage::default() };
    assert_eq!(stop_reason(&FinishReason::Stop, 0, &plain, &stops), ("end_turn", Value::Null));
    assert_eq!(stop_reason(&FinishReason::Stop, 0, &by_stop, &stops), ("stop_sequence", json!("STOP")));
    assert_eq!(stop_reason(&FinishReason::Stop, 2, &plain, &stops), ("tool_use", Value::Null));
    assert_eq!(stop_reason(&FinishReason::Length, 1, &plain, &stops), ("max_tokens", Value::Null));
}

#[test]
fn errors_in_anthropic_shape() {
    let e = ApiError::invalid("max_tokens", "bad");
    assert_eq!(
        e.body_in(Dialect::Anthropic),
        json!({"type": "error", "error": {"type": "invalid_request_error", "message": "bad"}})
    );
    let e = ApiError::unavailable("busy", "overloaded");
    assert_eq!(e.body_in(Dialect::Anthropic)["error"]["type"], "overloaded_error");
    assert_eq!(ApiError::unauthorized("k").body_in(Dialect::Anthropic)["error"]["type"], "authentication_error");
}

#[test]
fn structured_outputs_become_the_chat_response_format() {
    let schema = json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]});
    let want = json!({"type": "json_schema", "json_schema": {"name": "output", "schema": schema, "strict": true}});
    for key in ["output_config", "output_format"] {
        let f = json!({"type": "json_schema", "schema": schema});
        let v = if key == "output_config" { json!({"format": f, "effort": "low"}) } else { f };
        let body = tr(json!({"messages": [{"role": "user", "content": "x"}], key: v})).unwrap();
        assert_eq!(body["response_format"], want, "{key}");
    }
    let body = tr(json!({"messages": [{"role": "user", "content": "x"}], "output_config": {"effort": "low"}})).unwrap();
    assert!(body.get("response_format").is_none());
}

#[test]
fn thinking_is_kept_only_in_the_current_tool_use_cycle() {
    let think = |t: &str| json!({"type": "thinking", "thinking": t, "signature": "s"});
    let call = |id: &str| json!({"type": "tool_use", "id": id, "name": "f", "input": {}});
    let result =
        |id: &str| json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": id, "content": "ok"}]});
    let body = tr(json!({"messages": [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": [think("old"), {"type": "text", "text": "a1"}]},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": [think("t1"), call("c1")]},
        result("c1"),
        {"role": "assistant", "content": [think("t2"), {"type": "redacted_thinking", "data": "x"}, call("c2")]},
        result("c2"),
    ]}))
    .unwrap();
    let m = body["messages"].as_array().unwrap();
    let reasoning: Vec<&Value> = m.iter().map(|m| &m["reasoning_content"]).collect();
    assert_eq!(
        reasoning,
        [&Value::Null, &Value::Null, &Value::Null, &json!("t1"), &Value::Null, &json!("t2"), &Value::Null]
    );
    assert_eq!(m[1]["content"], "a1");
}
