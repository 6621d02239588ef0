#!/usr/bin/env python3
"""Times prompt scoring (`echo` with `logprobs`) against a plain prefill on a running server.

Usage: python3 scripts/bench-echo-scoring.py [BASE_URL]   (default http://127.0.0.1:8000)
Sends 6 different ~380-word prompts (a distinct first word each, so the prefix cache never
hits), max_tokens 1, each twice in turn: plain, then with echo and logprobs 1; prints the
prompt length and the median and all times of each mode (BENCHMARKS.md).
"""
import json
import random
import sys
import time
import urllib.request

BASE = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex every jovial bard".split()


def post(body):
    r = urllib.request.Request(
        BASE + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    t = time.time()
    v = json.loads(urllib.request.urlopen(r, timeout=600).read())
    return time.time() - t, v


def main():
    res = {"plain": [], "echo": []}
    n = 0
    for i in range(6):
        random.seed(i)
        text = " ".join(random.choice(WORDS) for _ in range(380))
        for mode in ("plain", "echo"):
            body = {"prompt": f"{mode} {i}: " + text, "max_tokens": 1, "temperature": 0}
            if mode == "echo":
                body.update(echo=True, logprobs=1)
            dt, v = post(body)
            res[mode].append(dt)
            n = v["usage"]["prompt_tokens"]
    print("prompt tokens", n)
    for m, ts in res.items():
        ts = sorted(ts)
        print(m, "median %.2f s" % ts[len(ts) // 2], ["%.2f" % t for t in ts])


if __name__ == "__main__":
    main()
