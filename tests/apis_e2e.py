#!/usr/bin/env python3
"""Drives a running `torus-wgpu serve` through the APIs beyond OpenAI's chat completions, with
the official clients: Anthropic's Messages API with the `anthropic` package, the Responses API
and embeddings with the `openai` package, Ollama's API with plain HTTP (and the `ollama`
package). The server runs with `--task embed --pooling mean`.

Usage: python3 tests/apis_e2e.py BASE_URL MODEL API_KEY   (BASE_URL like http://127.0.0.1:8000;
the server runs an instruct model that answers "What is the capital of France?" with Paris,
greedy by default, e.g. SmolLM2-135M-Instruct, and requires API_KEY). Prints
`apis_e2e: all checks passed` and exits 0 when every check passes; otherwise exits 1.
"""

import json
import os
import re
import sys
import urllib.error
import urllib.request

import anthropic
import jsonschema
import openai
from pydantic import BaseModel

BASE, MODEL, KEY = sys.argv[1].rstrip("/"), sys.argv[2], sys.argv[3]
QUESTION = "What is the capital of France?"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "The city name"}},
    "required": ["city"],
}


def check(cond, what):
    if not cond:
        raise AssertionError(what)


# ---------------------------------------------------------------- Anthropic Messages
def anthropic_checks():
    client = anthropic.Anthropic(base_url=BASE, api_key=KEY, max_retries=0, timeout=120.0)
    msgs = [{"role": "user", "content": QUESTION}]

    m = client.messages.create(model=MODEL, max_tokens=16, messages=msgs)
    check(m.type == "message" and m.role == "assistant", f"message shape: {m}")
    check(m.content and m.content[0].type == "text", f"a text block: {m.content}")
    text = "".join(b.text for b in m.content if b.type == "text")
    check("Paris" in text, f"the answer names Paris: {text!r}")
    check(m.stop_reason in ("end_turn", "max_tokens"), f"stop_reason {m.stop_reason}")
    check(m.usage.output_tokens > 0 and m.usage.input_tokens > 0, f"usage {m.usage}")

    # A stop sequence ends the answer before it, and is named.
    st = client.messages.create(model=MODEL, max_tokens=16, messages=msgs, stop_sequences=["Nowhere", "Paris"])
    cut = "".join(b.text for b in st.content if b.type == "text")
    check(st.stop_reason == "stop_sequence" and st.stop_sequence == "Paris", f"stop sequence: {st}")
    check("Paris" not in cut and text.startswith(cut), f"the text stops before it: {cut!r} / {text!r}")
    with client.messages.stream(model=MODEL, max_tokens=16, messages=msgs, stop_sequences=["Paris"]) as s:
        for _ in s:
            pass
        fm = s.get_final_message()
    check(fm.stop_reason == "stop_sequence" and fm.stop_sequence == "Paris", f"streamed stop sequence: {fm}")

    n = client.messages.count_tokens(model=MODEL, messages=msgs)
    check(n.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0),
          f"count_tokens {n.input_tokens} vs usage {m.usage}")
    n1 = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=msgs)
    n2 = client.messages.count_tokens(model=MODEL, system="Be brief. Answer in one word, and nothing else.",
                                      messages=msgs)
    check(n2.input_tokens > n1.input_tokens, f"the system prompt counts: {n2.input_tokens} vs {n1.input_tokens}")

    # Streamed: Anthropic's event order, and the same text as the whole message.
    kinds, deltas = [], []
    with client.messages.stream(model=MODEL, max_tokens=16, messages=msgs) as s:
        for ev in s:
            kinds.append(ev.type)
            if ev.type == "content_block_delta" and ev.delta.type == "text_delta":
                deltas.append(ev.delta.text)
        final = s.get_final_message()
    check(kinds[0] == "message_start", f"starts with message_start: {kinds}")
    check(kinds[-1] == "message_stop" and kinds[-2] == "message_delta", f"ends with message_delta, message_stop: {kinds}")
    core = [k for k in kinds if k in ("content_block_start", "content_block_delta", "content_block_stop")]
    check(core[0] == "content_block_start" and core[-1] == "content_block_stop", f"block events in order: {kinds}")
    check(kinds.index("content_block_start") < kinds.index("content_block_delta"), f"block start before deltas: {kinds}")
    check(len(deltas) > 1, f"several text deltas: {deltas}")
    check("".join(deltas) == text, f"streamed {''.join(deltas)!r} == whole {text!r}")
    check(final.stop_reason == m.stop_reason, f"stop_reason {final.stop_reason} vs {m.stop_reason}")

    # Tool use round trip: `any` and a named tool force a call; its input follows the schema.
    tools = [{"name": "get_weather", "description": "Get the current weather in a given city",
              "input_schema": WEATHER_SCHEMA}]
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    # (One call: a small model would go on writing calls while the grammar allows several.)
    for choice in ({"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "get_weather"}):
        r = client.messages.create(model=MODEL, max_tokens=60, messages=ask, tools=tools, tool_choice=choice)
        uses = [b for b in r.content if b.type == "tool_use"]
        check(r.stop_reason == "tool_use" and len(uses) >= 1, f"{choice}: a tool_use: {r}")
        check(uses[0].name == "get_weather" and uses[0].id.startswith("toolu_"), f"{choice}: {uses[0]}")
        jsonschema.validate(uses[0].input, WEATHER_SCHEMA)
    follow = ask + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny, 21 C"}]},
    ]
    r2 = client.messages.create(model=MODEL, max_tokens=24, messages=follow, tools=tools)
    check(r2.content and r2.stop_reason in ("end_turn", "max_tokens", "tool_use"), f"after the tool result: {r2}")
    # Streamed tool use: the input arrives as input_json_delta and parses.
    with client.messages.stream(model=MODEL, max_tokens=60, messages=ask, tools=tools,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}) as s:
        kinds = [ev.type for ev in s]
        final = s.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    check(final.stop_reason == "tool_use" and uses, f"streamed tool use: {final}")
    jsonschema.validate(uses[0].input, WEATHER_SCHEMA)

    # Errors as the SDK's typed exceptions.
    for bad, exc in (
        (dict(model=MODEL, max_tokens=0, messages=msgs), anthropic.BadRequestError),
        (dict(model=MODEL, max_tokens=8, messages=[]), anthropic.BadRequestError),
        (dict(model="no-such-model", max_tokens=8, messages=msgs), anthropic.NotFoundError),
    ):
        try:
            client.messages.create(**bad)
            raise AssertionError(f"{bad} should fail")
        except exc as e:
            check(e.body["type"] == "error" and e.body["error"]["message"], f"error body {e.body}")
    wrong = anthropic.Anthropic(base_url=BASE, api_key="wrong", max_retries=0)
    try:
        wrong.messages.create(model=MODEL, max_tokens=8, messages=msgs)
        raise AssertionError("a wrong key should fail")
    except anthropic.AuthenticationError:
        pass
    print("anthropic: ok")


# ---------------------------------------------------------------- OpenAI Responses
class City(BaseModel):
    name: str
    country: str


def responses_checks():
    client = openai.OpenAI(base_url=BASE + "/v1", api_key=KEY, max_retries=0, timeout=120.0)
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=16)
    check(r.object == "response" and r.status in ("completed", "incomplete"), f"response {r}")
    check("Paris" in r.output_text, f"the answer names Paris: {r.output_text!r}")
    check(r.usage.output_tokens > 0 and r.usage.input_tokens > 0, f"usage {r.usage}")

    meta = {"k": "v" * 512}
    events = list(client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=16, stream=True,
                                          metadata=meta))
    kinds = [e.type for e in events]
    echoed = [e.type for e in events if getattr(getattr(e, "response", None), "metadata", None)]
    check(echoed == kinds[-1:] and events[-1].response.metadata == meta, f"metadata echoed once, at the end: {echoed}")
    check(kinds[:2] == ["response.created", "response.in_progress"], f"opening events: {kinds}")
    check(kinds[-1] in ("response.completed", "response.incomplete"), f"closing event: {kinds}")
    check([e.sequence_number for e in events] == list(range(len(events))), "sequence numbers")
    for k in ("response.output_item.added", "response.content_part.added", "response.output_text.delta",
              "response.output_text.done", "response.output_item.done"):
        check(k in kinds, f"{k} in {kinds}")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    check(deltas == r.output_text, f"streamed {deltas!r} == whole {r.output_text!r}")
    check(events[-1].response.output_text == r.output_text, "the final response holds the text")

    tools = [{"type": "function", "name": "get_weather", "description": "Get the current weather in a given city",
              "parameters": WEATHER_SCHEMA}]
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    r = client.responses.create(model=MODEL, input=ask, tools=tools, tool_choice="required", max_output_tokens=60,
                                parallel_tool_calls=False)
    calls = [o for o in r.output if o.type == "function_call"]
    check(calls and calls[0].name == "get_weather" and calls[0].call_id, f"a function call: {r.output}")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_SCHEMA)
    follow = ask + [calls[0].model_dump(exclude_none=True),
                    {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"}]
    r2 = client.responses.create(model=MODEL, input=follow, tools=tools, max_output_tokens=24)
    check(r2.output, f"after the call's output: {r2}")
    events = list(client.responses.create(model=MODEL, input=ask, tools=tools, tool_choice="required",
                                          max_output_tokens=60, parallel_tool_calls=False, stream=True))
    kinds = [e.type for e in events]
    check("response.function_call_arguments.delta" in kinds, f"argument deltas: {kinds}")
    done = [e for e in events if e.type == "response.function_call_arguments.done"][0]
    jsonschema.validate(json.loads(done.arguments), WEATHER_SCHEMA)

    parsed = client.responses.parse(model=MODEL, input="Name a city in Italy and its country.",
                                    text_format=City, max_output_tokens=60)
    check(isinstance(parsed.output_parsed, City), f"text.format json_schema parsed: {parsed.output_text!r}")

    try:
        client.responses.create(model=MODEL, input=QUESTION, previous_response_id="resp_1")
        raise AssertionError("previous_response_id should fail")
    except openai.BadRequestError as e:
        check("stores no responses" in str(e), f"says why: {e}")
    print("responses: ok")


# ---------------------------------------------------------------- OpenAI embeddings
def embeddings_checks():
    import base64
    import math
    import struct
    client = openai.OpenAI(base_url=BASE + "/v1", api_key=KEY, max_retries=0, timeout=120.0)
    texts = ["The cat sits on the mat.", "A cat is sitting on a rug.",
             "Stock markets fell sharply today.", "The quarterly earnings report disappointed investors."]
    r = client.embeddings.create(model=MODEL, input=texts)
    check(len(r.data) == 4 and [d.index for d in r.data] == [0, 1, 2, 3], f"one vector per input: {r.data}")
    vs = [d.embedding for d in r.data]
    dim = len(vs[0])
    check(dim > 0 and all(len(v) == dim for v in vs), "one size")
    check(all(abs(sum(x * x for x in v) - 1) < 1e-4 for v in vs), "normalised")
    cos = lambda a, b: sum(x * y for x, y in zip(a, b))  # noqa: E731
    para, other = cos(vs[0], vs[1]), max(cos(vs[0], vs[2]), cos(vs[0], vs[3]), cos(vs[1], vs[2]), cos(vs[1], vs[3]))
    check(para > other, f"paraphrases closer ({para:.4f}) than unrelated texts ({other:.4f})")
    check(r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens, f"usage {r.usage}")
    raw = client.embeddings.with_raw_response.create(model=MODEL, input=texts[0], encoding_format="base64")
    b64 = json.loads(raw.text)["data"][0]["embedding"]
    decoded = struct.unpack(f"<{dim}f", base64.b64decode(b64))
    check(max(abs(a - b) for a, b in zip(decoded, vs[0])) < 1e-5, "base64 decodes to the float vector")
    short = client.embeddings.create(model=MODEL, input=texts[0], dimensions=32).data[0].embedding
    n = math.sqrt(sum(x * x for x in vs[0][:32]))
    check(len(short) == 32 and max(abs(a - b / n) for a, b in zip(short, vs[0][:32])) < 1e-4, "dimensions 32")
    try:
        client.embeddings.create(model=MODEL, input=texts[0], dimensions=dim + 1)
        raise AssertionError("dimensions above the model's should fail")
    except openai.BadRequestError:
        pass
    print(f"embeddings: ok ({dim} dimensions; paraphrases {para:.3f}, unrelated at most {other:.3f})")


# ---------------------------------------------------------------- Ollama
def http(path, body=None, method=None):
    req = urllib.request.Request(BASE + path, method=method or ("POST" if body is not None else "GET"))
    req.add_header("Authorization", f"Bearer {KEY}")
    data = None
    if body is not None:
        req.add_header("Content-Type", "application/json")
        data = json.dumps(body).encode()
    try:
        with urllib.request.urlopen(req, data, timeout=120) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode()


def ollama_checks():
    opts = {"num_predict": 16, "temperature": 0}
    msgs = [{"role": "user", "content": QUESTION}]
    status, ctype, text = http("/api/chat", {"model": MODEL + ":latest", "messages": msgs, "options": opts})
    check(status == 200 and ctype.startswith("application/x-ndjson"), f"chat streams NDJSON: {status} {ctype}")
    lines = [json.loads(l) for l in text.splitlines()]
    check(len(lines) > 2 and all(not l["done"] for l in lines[:-1]) and lines[-1]["done"], f"NDJSON done flags: {lines}")
    streamed = "".join(l["message"]["content"] for l in lines)
    check("Paris" in streamed, f"the answer names Paris: {streamed!r}")
    last = lines[-1]
    check(last["done_reason"] in ("stop", "length") and last["eval_count"] > 0 and last["prompt_eval_count"] > 0,
          f"final counts: {last}")
    status, _, text = http("/api/chat", {"model": MODEL, "messages": msgs, "options": opts, "stream": False})
    whole = json.loads(text)
    check(status == 200 and whole["done"] and whole["message"]["content"] == streamed, f"stream false: {whole}")
    # Real timings: 16 tokens of decoding take time after the first one (it was 0 before).
    check(whole["eval_duration"] > 0 and whole["prompt_eval_duration"] > 0
          and whole["eval_duration"] + whole["prompt_eval_duration"] <= whole["total_duration"],
          f"durations: {whole}")

    status, _, text = http("/api/generate", {"model": MODEL, "prompt": QUESTION, "options": opts})
    lines = [json.loads(l) for l in text.splitlines()]
    gen = "".join(l["response"] for l in lines)
    check(status == 200 and lines[-1]["done"] and gen == streamed, f"generate = chat: {gen!r} vs {streamed!r}")
    status, _, text = http("/api/generate", {"model": MODEL, "prompt": "", "stream": False})
    check(status == 200 and json.loads(text)["done_reason"] == "load", f"an empty prompt loads: {text}")

    status, _, text = http("/api/tags")
    models = json.loads(text)["models"]
    check(status == 200 and models[0]["name"] == MODEL + ":latest" and models[0]["size"] > 0, f"tags: {text}")
    status, _, text = http("/api/show", {"model": MODEL})
    show = json.loads(text)
    # SmolLM2-135M: its tensors' count (134.52M), not a word of the file name.
    size = show["details"]["parameter_size"]
    check(re.fullmatch(r"13[45]\.\d\dM", size) is not None, f"parameter_size: {size!r}")
    check(status == 200 and show["template"] and "completion" in show["capabilities"], f"show: {text[:300]}")
    # The model file by its name, not where it lives on the server.
    check(re.search(r"^FROM [^/\\]+\.gguf$", show["modelfile"], re.M) is not None, f"modelfile: {show['modelfile']!r}")
    status, _, text = http("/api/version")
    check(status == 200 and json.loads(text)["version"], f"version: {text}")
    status, _, text = http("/api/ps")
    check(status == 200 and json.loads(text)["models"][0]["model"] == MODEL + ":latest", f"ps: {text}")

    for path, body, want in (
        ("/api/chat", {"model": "other", "messages": msgs}, 404),
        ("/api/pull", {"model": "llama3"}, 400),
        ("/api/create", {"model": "x"}, 400),
        ("/api/chat", {"model": MODEL, "messages": msgs, "options": {"num_predict": 0}}, 400),
    ):
        status, _, text = http(path, body)
        check(status == want and isinstance(json.loads(text)["error"], str), f"{path} {body}: {status} {text}")
    status, _, text = http("/api/embed", {"model": MODEL, "input": ["a cat", "a dog"]})
    embs = json.loads(text)["embeddings"]
    check(status == 200 and len(embs) == 2 and len(embs[0]) > 0, f"/api/embed: {text[:200]}")
    status, _, text = http("/api/pull", {"model": MODEL, "stream": False})
    check(status == 200 and json.loads(text)["status"] == "success", f"pull of the served model: {text}")

    try:
        import ollama
    except ImportError:
        ollama = None
    if ollama is not None:
        c = ollama.Client(host=BASE, headers={"Authorization": f"Bearer {KEY}"})
        r = c.chat(model=MODEL, messages=msgs, options=opts)
        check(r.message.content == streamed, f"the ollama package: {r.message.content!r}")
        names = [m.model for m in c.list().models]
        check(MODEL + ":latest" in names, f"ollama list: {names}")
        parts = [p.message.content for p in c.chat(model=MODEL, messages=msgs, options=opts, stream=True)]
        check("".join(parts) == streamed, f"ollama stream: {parts}")
    # litellm's `ollama_chat/` provider (it posts without a Content-Type), greedy as above.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    r = litellm.completion(model=f"ollama_chat/{MODEL}", api_base=BASE, messages=msgs, temperature=0, max_tokens=16,
                           extra_headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    check(r.choices[0].message.content == streamed, f"litellm ollama_chat/: {r.choices[0].message.content!r}")
    print("ollama: ok" + (" (with the ollama package and litellm)" if ollama else " (with litellm)"))


def main():
    failed = []
    for f in (anthropic_checks, responses_checks, embeddings_checks, ollama_checks):
        try:
            f()
        except Exception as e:  # noqa: BLE001 (report every section)
            import traceback
            traceback.print_exc()
            failed.append(f"{f.__name__}: {e!r}")
    if failed:
        print("apis_e2e: FAILED:\n" + "\n".join(failed))
        sys.exit(1)
    print("apis_e2e: all checks passed")


if __name__ == "__main__":
    main()
