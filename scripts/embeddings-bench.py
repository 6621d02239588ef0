#!/usr/bin/env python3
"""Embeddings against plain prefill on a running server (`torus-wgpu serve --task embed`).

Usage: python3 scripts/embeddings-bench.py [BASE_URL]   (default http://127.0.0.1:8000)
Sends 64 sentences once to /v1/embeddings, then the same prompts to /v1/completions with
max_tokens 1 (the second time they are in the prefix cache unless the server has it off), and
prints the times. Mean and first-token pooling never hit the prefix cache; last-token pooling may.
"""
import json
import sys
import time
import urllib.request

base = (sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000").rstrip("/")
texts = [f"Sentence number {i}: the quick brown fox jumps over the lazy dog near the river bank." for i in range(64)]


def post(path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=600).read())


post("/v1/embeddings", {"input": texts[:2]})
t = time.time()
n = post("/v1/embeddings", {"input": texts})["usage"]["prompt_tokens"]
te = time.time() - t
print(f"64 inputs, {n} tokens: embeddings {te:.2f} s ({n / te:.0f} tok/s)")
for label in ("first", "second"):
    t = time.time()
    post("/v1/completions", {"prompt": texts, "max_tokens": 1, "temperature": 0})
    tc = time.time() - t
    print(f"completions max_tokens 1, {label} time: {tc:.2f} s ({n / tc:.0f} tok/s)")
