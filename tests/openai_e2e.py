#!/usr/bin/env python3
"""Drives a running `torus-wgpu serve` with the official `openai` Python package.

Usage: python3 tests/openai_e2e.py [BASE_URL]   (default: $TORUS_BASE_URL, else
http://127.0.0.1:8000/v1). Set TORUS_API_KEY when the server requires a key.

Checks chat (non-streaming and streaming with usage), completions (non-streaming and
streaming), n > 1, logprobs, the model list, and that errors come back as the client's typed
exceptions. Responses are parsed with the client's strict validation where it offers it.
Exits 0 when every check passes; otherwise prints what failed and exits 1.
"""

import os
import sys

import openai
from openai import OpenAI


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


def main() -> int:
    base_url = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("TORUS_BASE_URL", "http://127.0.0.1:8000/v1")
    client = make_client(base_url)

    models = client.models.list()
    ids = [m.id for m in models.data]
    check(len(ids) == 1, f"one served model, got {ids}")
    model = ids[0]
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
