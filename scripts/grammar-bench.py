#!/usr/bin/env python3
"""What slow grammars cost other requests, for BENCHMARKS.md: against a running server
(`torus-wgpu serve --model ../path/to/tiny-qwen2 --port 8920`), two requests whose JSON schemas
take long to compile (4,000 object properties each, ~0.6 MB) are sent at once, then, 0.2 s
later, a plain completion; the plain one's latency is printed beside the grammar requests'. Then
one GBNF grammar of 60,000 alternatives (its status and time).

  scripts/grammar-bench.py [URL]   (default http://127.0.0.1:8920)
The standard library only.
"""
import json
import sys
import threading
import time
import urllib.request

URL = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8920"


def post(path, body):
    t0 = time.time()
    req = urllib.request.Request(URL + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status = r.status
            r.read()
    except urllib.error.HTTPError as e:
        status = e.code
        e.read()
    return status, time.time() - t0


props = {f"p{i}": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "pattern": "[a-z]{3,9}"}},
                   "required": ["a", "b"]} for i in range(4000)}
slow = {"prompt": "x", "max_tokens": 2, "response_format": {"type": "json_schema", "json_schema": {
    "name": "big", "schema": {"type": "object", "properties": props, "required": list(props)}}}}
plain = {"prompt": "Hello", "max_tokens": 2}
post("/v1/completions", plain)
results = {}


def run(name, body, delay=0.0):
    time.sleep(delay)
    results[name] = post("/v1/completions", body)


threads = [threading.Thread(target=run, args=(f"schema {i}", slow)) for i in (1, 2)]
threads.append(threading.Thread(target=run, args=("plain, 0.2 s later", plain, 0.2)))
for t in threads:
    t.start()
for t in threads:
    t.join()
for name, (status, secs) in sorted(results.items()):
    print(f"{name:<22} HTTP {status}  {secs:6.2f} s")
gbnf = "root ::= " + " | ".join(f'"w{i}"' for i in range(60000))
status, secs = post("/completion", {"prompt": "x", "n_predict": 4, "grammar": gbnf})
print(f"{'GBNF, 60,000 alts':<22} HTTP {status}  {secs:6.2f} s")
