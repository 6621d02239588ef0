use super::*;

#[test]
fn chat_bodies_translate() {
    let o = json!({
        "model": "smol:latest",
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "w", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "18C", "tool_name": "w"}
        ],
        "options": {"temperature": 0, "num_predict": 12, "repeat_penalty": 1.1, "stop": ["x"], "num_ctx": 4096},
        "format": "json",
        "think": false,
    });
    let t = translate_chat(o.as_object().unwrap().clone()).unwrap();
    let b = &t.body;
    assert_eq!(b["model"], "smol");
    assert_eq!(b["stream"], true, "Ollama streams by default");
    assert_eq!((b["temperature"].clone(), b["max_tokens"].clone()), (json!(0), json!(12)));
    assert_eq!(b["repetition_penalty"], json!(1.1));
    assert_eq!(b["stop"], json!(["x"]));
    assert!(b.get("num_ctx").is_none());
    assert_eq!(b["response_format"], json!({"type": "json_object"}));
    assert_eq!(b["chat_template_kwargs"], json!({"enable_thinking": false}));
    assert_eq!(b["messages"][1]["tool_calls"][0]["id"], "call_1_0");
    assert_eq!(b["messages"][2]["tool_call_id"], "call_1_0");
}

#[test]
fn generate_bodies_translate() {
    let o = json!({"prompt": "Hi", "system": "Be brief.", "stream": false, "options": {"num_predict": -1}});
    let t = translate_generate(o.as_object().unwrap().clone()).unwrap();
    assert_eq!(t.route, Route::Chat);
    assert_eq!(
        t.body["messages"],
        json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    );
    assert!(t.body.get("max_tokens").is_none());
    let o = json!({"prompt": "Once upon", "raw": true});
    let t = translate_generate(o.as_object().unwrap().clone()).unwrap();
    assert_eq!((t.route, t.body["prompt"].clone()), (Route::Completions, json!("Once upon")));
    let e = translate_generate(json!({"model": "m"}).as_object().unwrap().clone()).unwrap_err();
    assert_eq!(e.code, Some(LOAD_ONLY));
    for (body, param) in [
        (json!({"prompt": "x", "images": ["aGk="]}), "images"),
        (json!({"prompt": "x", "images": "aGk="}), "images"),
        (json!({"prompt": "x", "suffix": "y"}), "suffix"),
        (json!({"prompt": "x", "format": 3}), "format"),
        (json!({"prompt": "x", "options": {"num_predict": 0}}), "options.num_predict"),
        (json!({"prompt": "x", "options": 1}), "options"),
        (json!({"prompt": "x", "think": "max"}), "think"),
        (json!({"prompt": 5}), "prompt"),
    ] {
        let e = translate_generate(body.as_object().unwrap().clone()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some(param), "{body}: {e}");
    }
}

#[test]
fn timestamps_are_rfc3339() {
    use std::time::{Duration, UNIX_EPOCH};
    assert_eq!(info::rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000000000Z");
    let t = UNIX_EPOCH + Duration::new(1_796_416_265, 5);
    assert_eq!(info::rfc3339(t), "2026-12-04T20:31:05.000000005Z");
    assert_eq!(info::rfc3339(UNIX_EPOCH + Duration::from_secs(951_782_400)), "2000-02-29T00:00:00.000000000Z");
}
