#!/usr/bin/env python3
"""Drives a running `torus-wgpu serve` with the official `openai` Python package.

Usage: python3 tests/openai_e2e.py [BASE_URL] [--tool-model | --structured | --reasoning]   (default:
$TORUS_BASE_URL, else http://127.0.0.1:8000/v1). Set TORUS_API_KEY when the server requires a key.

Checks chat (non-streaming and streaming with usage), completions (non-streaming and
streaming), n > 1, logprobs, the model list, tool-calling requests (shapes, a follow-up turn
with a `tool` message), and that errors come back as the client's typed exceptions. Responses
are parsed with the client's strict validation where it offers it. With --tool-model (a model
that answers the weather question below with a call, e.g. Qwen2.5-Coder-0.5B-Instruct), only
the tool checks run, and the call itself is checked: streamed and not, with arguments valid
against the tool's JSON schema. With --structured (a small instruct model such as SmolLM2),
only the structured-output checks run: `chat.completions.parse` with a Pydantic model 20 times
with varied prompts (every result parses and validates), `json_object` output parses, and
`tool_choice="required"` returns calls whose arguments validate against the tool's schema,
streamed and not, followed by a `role: tool` turn. With --reasoning (a model whose chat template
thinks), only the reasoning checks run: `reasoning_content` beside `content`, streamed equal to
non-streamed, with and without `chat_template_kwargs`. Exits 0 when every check passes; otherwise
prints what failed and exits 1.
"""

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
from openai import OpenAI
from pydantic import BaseModel, Field


def make_client(base_url: str, strict: bool = True) -> OpenAI:
    key = os.environ.get("TORUS_API_KEY") or "not-needed"
    kwargs = dict(base_url=base_url, api_key=key, max_retries=0, timeout=120.0)
    if strict:
        try:
            # Validate every response against the client's own types.
            return OpenAI(_strict_response_validation=True, **kwargs)
        except TypeError:
            pass
    return OpenAI(**kwargs)


def check(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a given city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city name"}},
            "required": ["city"],
        },
    },
}


def validate_arguments(arguments: str, schema: dict) -> None:
    args = json.loads(arguments)
    check(isinstance(args, dict), f"arguments are an object: {arguments!r}")
    jsonschema.validate(args, schema)


def check_tools(client: OpenAI, model: str, tool_model: bool) -> None:
    """Tool-calling requests. With a model that calls tools (tool_model), the call itself."""
    schema = WEATHER_TOOL["function"]["parameters"]
    # A random-weights test model has a short context (tiny-qwen2: 512 tokens): short texts there.
    tool = WEATHER_TOOL if tool_model else {"type": "function", "function": {"name": "get_weather"}}
    ask = "What is the weather in Paris? Use the get_weather tool." if tool_model else "Paris?"
    question = [{"role": "user", "content": ask}]
    kwargs = dict(model=model, messages=question, tools=[tool], temperature=0, max_tokens=48 if tool_model else 4)
    # tool_choice "required" (enforced by a grammar: the output is a call, or a prefix of one
    # when max_tokens cuts it).
    chat = client.chat.completions.create(tool_choice="required", **kwargs)
    msg = chat.choices[0].message
    if tool_model:
        check(chat.choices[0].finish_reason == "tool_calls", f"finish_reason: {chat.choices[0].finish_reason}")
        check(msg.content is None, f"content: {msg.content!r}")
        check(msg.tool_calls is not None and len(msg.tool_calls) == 1, f"tool_calls: {msg.tool_calls}")
        call = msg.tool_calls[0]
        check(call.type == "function" and call.id.startswith("call_"), f"call: {call}")
        check(call.function.name == "get_weather", f"name: {call.function.name}")
        validate_arguments(call.function.arguments, schema)
    else:
        check(chat.choices[0].finish_reason in ("stop", "length", "tool_calls"), "finish_reason")

    # Streamed: the deltas merge (by tool-call index) into the same call.
    stream = client.chat.completions.create(tool_choice="required", stream=True, **kwargs)
    calls, content, reasons = {}, "", []
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                if tc.function is not None:
                    entry["name"] += tc.function.name or ""
                    entry["arguments"] += tc.function.arguments or ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    check(reasons == [chat.choices[0].finish_reason], f"streamed finish reasons: {reasons}")
    if tool_model:
        check(content == "", f"streamed content: {content!r}")
        check(list(calls) == [0], f"streamed calls: {calls}")
        check(calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_"), f"{calls}")
        check(calls[0]["arguments"] == msg.tool_calls[0].function.arguments, f"{calls} vs {msg.tool_calls}")
        validate_arguments(calls[0]["arguments"], schema)
    else:
        check(content == (msg.content or ""), f"streamed {content!r} != {msg.content!r}")

    # The follow-up turn: the assistant's call (content null) and the tool's result.
    call_id = msg.tool_calls[0].id if msg.tool_calls else "call_0"
    follow = question + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": '{"temperature_c": 18}'},
    ]
    after = client.chat.completions.create(model=model, messages=follow, tools=[tool], temperature=0, max_tokens=4)
    check(after.choices[0].message.role == "assistant", "follow-up answered")

    # A tool_choice naming an undefined function is refused, naming the field.
    try:
        client.chat.completions.create(
            model=model, messages=question, tools=[tool], tool_choice={"type": "function", "function": {"name": "nope"}}
        )
        raise AssertionError("a tool_choice naming an undefined function was accepted")
    except openai.BadRequestError as e:
        check(e.status_code == 400 and e.param == "tool_choice", f"status {e.status_code}, param {e.param}")


class Weather(BaseModel):
    city: str = Field(max_length=24)
    sky: Literal["sunny", "cloudy", "rainy", "snowy"]
    temperature_c: int = Field(ge=-50, le=50)
    windy: bool


CITIES = ["Paris", "Tokyo", "Cairo", "Lima", "Oslo", "Rome", "Delhi", "Sydney", "Toronto", "Nairobi"]


def check_structured(client: OpenAI, model: str) -> None:
    """Structured outputs through the client's own helpers, on a small instruct model."""
    # `parse` moved out of `beta` in later client versions; take whichever this one has.
    beta = getattr(getattr(client, "beta", None), "chat", None)
    parse = getattr(getattr(beta, "completions", None), "parse", None) or client.chat.completions.parse
    prompts = [f"Describe today's weather in {c} as JSON." for c in CITIES]
    prompts += [f"It is {t} degrees and {s} in {c}. Report it." for t, s, c in zip(
        [3, 21, 35, -4, 12, 28, 15, 7, 30, -10],
        ["snowy", "sunny", "sunny", "snowy", "rainy", "cloudy", "rainy", "cloudy", "sunny", "snowy"],
        CITIES,
    )]

    def one(prompt: str):
        r = parse(model=model, messages=[{"role": "user", "content": prompt}], response_format=Weather,
                  max_tokens=100, temperature=0)
        return prompt, r

    # All 20 at once: they decode as one batch.
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(one, prompts))
    check(len(results) == 20, "20 results")
    for prompt, r in results:
        c = r.choices[0]
        check(c.finish_reason == "stop", f"{prompt!r}: finish_reason {c.finish_reason}")
        check(isinstance(c.message.parsed, Weather), f"{prompt!r}: parsed {c.message.parsed!r}")
        # The text itself validates against the schema the client sent.
        again = Weather.model_validate_json(c.message.content)
        check(again == c.message.parsed, f"{prompt!r}: {c.message.content!r}")
        jsonschema.validate(json.loads(c.message.content), Weather.model_json_schema())

    # json_object: any JSON object.
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Give a JSON object with the keys name and age for Bob, who is 30."}],
        response_format={"type": "json_object"}, max_tokens=60, temperature=0,
    )
    check(r.choices[0].finish_reason == "stop", f"json_object finish_reason {r.choices[0].finish_reason}")
    obj = json.loads(r.choices[0].message.content)
    check(isinstance(obj, dict), f"json_object output: {r.choices[0].message.content!r}")

    # tool_choice="required": SmolLM2's template has no tools, so the server renders them; the
    # grammar makes the output calls whose arguments follow the schema.
    schema = WEATHER_TOOL["function"]["parameters"]
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = dict(model=model, messages=question, tools=[WEATHER_TOOL], tool_choice="required", temperature=0,
                  max_tokens=120)
    chat = client.chat.completions.create(**kwargs)
    c = chat.choices[0]
    check(c.finish_reason == "tool_calls", f"required: finish_reason {c.finish_reason}, content {c.message.content!r}")
    check(c.message.tool_calls, f"required: no calls: {c.message}")
    for call in c.message.tool_calls:
        check(call.function.name == "get_weather" and call.id.startswith("call_"), f"call: {call}")
        validate_arguments(call.function.arguments, schema)
    calls, reasons = {}, []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                if tc.function is not None:
                    entry["name"] += tc.function.name or ""
                    entry["arguments"] += tc.function.arguments or ""
            if ch.finish_reason:
                reasons.append(ch.finish_reason)
    check(reasons == ["tool_calls"], f"streamed finish reasons: {reasons}")
    got = [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)]
    want = [(x.function.name, json.loads(x.function.arguments)) for x in c.message.tool_calls]
    check(got == want, f"streamed calls {got} != {want}")
    for _, args in got:
        jsonschema.validate(args, schema)
    # The follow-up turn with the tool's result (the assistant message as the client returned it).
    follow = question + [
        c.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": c.message.tool_calls[0].id, "content": '{"temperature_c": 18}'},
    ]
    after = client.chat.completions.create(model=model, messages=follow, tools=[WEATHER_TOOL], temperature=0,
                                           max_tokens=24)
    check(after.choices[0].message.role == "assistant", "follow-up answered")
    check(after.choices[0].finish_reason in ("stop", "length", "tool_calls"), "follow-up finish_reason")


def field(obj, name: str):
    """A field the client's types do not declare (kept as an extra), or None."""
    extra = getattr(obj, "model_extra", None) or {}
    return extra.get(name, getattr(obj, name, None))


def check_reasoning(client: OpenAI, model: str) -> None:
    """A model whose chat template thinks: `reasoning_content` beside `content`, streamed equal
    to non-streamed, with and without `chat_template_kwargs` (enable_thinking off)."""
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    for extra in ({}, {"chat_template_kwargs": {"enable_thinking": False}}):
        whole = client.chat.completions.create(model=model, messages=messages, max_tokens=20, temperature=0,
                                               extra_body=extra)
        msg = whole.choices[0].message
        reasoning, content = field(msg, "reasoning_content"), msg.content
        check("reasoning_content" in (msg.model_extra or {}), f"reasoning_content in the message: {msg}")
        check(reasoning is None or isinstance(reasoning, str), f"reasoning_content: {reasoning!r}")
        check(bool(reasoning) or bool(content), f"an answer: {msg}")
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=20, temperature=0,
                                                stream=True, extra_body=extra)
        sr, sc, reasons = "", "", []
        for chunk in stream:
            for c in chunk.choices:
                sr += field(c.delta, "reasoning_content") or ""
                sc += c.delta.content or ""
                if c.finish_reason:
                    reasons.append(c.finish_reason)
        check(sr == (reasoning or ""), f"streamed reasoning {sr!r} != {reasoning!r}")
        check(sc == (content or ""), f"streamed content {sc!r} != {content!r}")
        check(reasons == [whole.choices[0].finish_reason], f"finish reasons: {reasons}")


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    tool_model = "--tool-model" in sys.argv[1:]
    structured = "--structured" in sys.argv[1:]
    base_url = args[0] if args else os.environ.get("TORUS_BASE_URL", "http://127.0.0.1:8000/v1")
    client = make_client(base_url)

    models = client.models.list()
    ids = [m.id for m in models.data]
    check(len(ids) == 1, f"one served model, got {ids}")
    model = ids[0]
    if tool_model:
        check_tools(client, model, tool_model=True)
        print("openai_e2e: all checks passed")
        return 0
    if structured:
        check_structured(client, model)
        print("openai_e2e: all checks passed")
        return 0
    if "--reasoning" in sys.argv[1:]:
        check_reasoning(client, model)
        print("openai_e2e: all checks passed")
        return 0
    check_tools(client, model, tool_model=False)
    check(client.models.retrieve(model).id == model, "models.retrieve returns the served model")

    messages = [{"role": "user", "content": "Say hello."}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    check(chat.object == "chat.completion", f"object: {chat.object}")
    check(len(chat.choices) == 1, "one choice")
    choice = chat.choices[0]
    check(choice.message.role == "assistant", f"role: {choice.message.role}")
    check(isinstance(choice.message.content, str), "content is a string")
    check(choice.finish_reason in ("stop", "length"), f"finish_reason: {choice.finish_reason}")
    u = chat.usage
    check(u is not None and u.total_tokens == u.prompt_tokens + u.completion_tokens, f"usage: {u}")
    check(u.completion_tokens <= 12, f"completion_tokens: {u.completion_tokens}")

    # Streaming, greedy: the deltas add up to the non-streaming text; usage comes last.
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, reasons, usage, roles = "", [], None, []
    for chunk in stream:
        check(chunk.object == "chat.completion.chunk", f"chunk object: {chunk.object}")
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            text += c.delta.content or ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    check(roles == ["assistant"], f"roles in deltas: {roles}")
    check(text == choice.message.content, f"streamed {text!r} != {choice.message.content!r}")
    check(reasons == [choice.finish_reason], f"finish reasons: {reasons}")
    check(usage is not None and usage.completion_tokens == u.completion_tokens, f"stream usage: {usage}")

    # n > 1 and logprobs.
    multi = client.chat.completions.create(
        model=model, messages=messages, max_tokens=6, temperature=0, n=3, logprobs=True, top_logprobs=2
    )
    check([c.index for c in multi.choices] == [0, 1, 2], "three choices in order")
    check(len({c.message.content for c in multi.choices}) == 1, "greedy choices agree")
    lp = multi.choices[0].logprobs
    check(lp is not None and lp.content, "logprobs present")
    for e in lp.content:
        check(len(e.top_logprobs) == 2, f"top_logprobs: {e.top_logprobs}")
        check(e.logprob <= 0.0, f"logprob {e.logprob}")

    # Legacy completions.
    comp = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0)
    check(comp.object == "text_completion", f"object: {comp.object}")
    check(isinstance(comp.choices[0].text, str), "completion text")
    check(comp.usage is not None and comp.usage.completion_tokens <= 8, f"usage: {comp.usage}")
    # Legacy streaming chunks carry `"finish_reason": null` until the last one, as OpenAI's do;
    # the client's Completion type (reused for chunks) only validates leniently there.
    lenient = make_client(base_url, strict=False)
    streamed = "".join(
        c.choices[0].text
        for c in lenient.completions.create(
            model=model, prompt="Once upon a time", max_tokens=8, temperature=0, stream=True
        )
        if c.choices
    )
    check(streamed == comp.choices[0].text, f"streamed completion {streamed!r} != {comp.choices[0].text!r}")
    batch = client.completions.create(model=model, prompt=["a", "b"], max_tokens=2, temperature=0, logprobs=1)
    check(len(batch.choices) == 2 and batch.choices[0].logprobs is not None, "two prompts, legacy logprobs")

    # Errors surface as the client's typed exceptions.
    try:
        client.chat.completions.create(model=model, messages=messages, temperature=5)
        raise AssertionError("temperature 5 was accepted")
    except openai.BadRequestError as e:
        check(e.status_code == 400, f"status {e.status_code}")
    try:
        client.chat.completions.create(model="no-such-model", messages=messages)
        raise AssertionError("an unknown model was accepted")
    except openai.NotFoundError as e:
        check(e.status_code == 404, f"status {e.status_code}")

    print("openai_e2e: all checks passed")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:  # noqa: BLE001 - report any failure as exit 1
        print(f"openai_e2e: FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
