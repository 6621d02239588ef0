use super::*;

fn tr(v: Value) -> Result<Translated, ApiError> {
    translate(v.as_object().unwrap().clone())
}

#[test]
fn items_become_chat_messages() {
    let t = tr(json!({
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
            {"type": "message", "role": "user", "content": "Thanks"}
        ],
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": true}],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 50,
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": true}},
        "metadata": {"k": "v"},
    }))
    .unwrap();
    let b = &t.body;
    assert_eq!(
        b["messages"],
        json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
            {"role": "user", "content": "Thanks"}
        ])
    );
    assert_eq!(
        b["tools"],
        json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}, "strict": true}}])
    );
    assert_eq!(b["tool_choice"], json!({"type": "function", "function": {"name": "get_weather"}}));
    assert_eq!(b["max_tokens"], json!(50));
    assert_eq!(
        b["response_format"],
        json!({"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}, "strict": true}})
    );
    assert_eq!(t.echo["metadata"], json!({"k": "v"}));
    assert_eq!(t.echo["max_output_tokens"], json!(50));
    let t = tr(json!({"input": "Hi"})).unwrap();
    assert_eq!(t.body["messages"], json!([{"role": "user", "content": "Hi"}]));
}

#[test]
fn bad_requests_name_the_field() {
    for (body, param) in [
        (json!({"input": "x", "previous_response_id": "resp_1"}), "previous_response_id"),
        (json!({"input": "x", "background": true}), "background"),
        (json!({}), "input"),
        (json!({"input": []}), "input"),
        (json!({"input": [{"role": "tool", "content": "x"}]}), "input[0].role"),
        (json!({"input": [{"type": "function_call", "name": "f"}]}), "input[0]"),
        (json!({"input": [{"type": "item_reference", "id": "x"}]}), "input[0]"),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
            "input[0].content[0]",
        ),
        (json!({"input": "x", "tools": [{"type": "web_search"}]}), "tools[0].type"),
        (json!({"input": "x", "text": {"format": {"type": "xml"}}}), "text.format.type"),
        (json!({"input": "x", "instructions": 3}), "instructions"),
        (json!({"input": "x", "metadata": "m"}), "metadata"),
        (json!({"input": "x", "metadata": {"k": 1}}), "metadata"),
        (json!({"input": "x", "metadata": {"k": "v".repeat(513)}}), "metadata"),
        (json!({"input": "x", "metadata": {"k".repeat(65): "v"}}), "metadata"),
        (
            json!({"input": "x", "metadata": (0..17).map(|i| (i.to_string(), json!("v"))).collect::<serde_json::Map<_, _>>()}),
            "metadata",
        ),
    ] {
        let e = tr(body.clone()).err().unwrap_or_else(|| panic!("{body} should fail"));
        assert_eq!(e.param.as_deref(), Some(param), "{body}: {e}");
    }
}
