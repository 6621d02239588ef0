#!/usr/bin/env python3
"""What hostile requests cost a running `torus-wgpu serve` (BENCHMARKS.md, "Hardening II").

Usage: bench-hostile.py http://127.0.0.1:PORT PID [--only TEXT | --slow N | --hol | --share]

For each 4 MiB body that would amplify in memory (one-id prompts, a flat id list, short words
to /tokenize and as a prompt, many empty messages, one long message, many tiny values, ids to
/detokenize): the status, the time, and the server's peak RSS growth (its peak is reset first
through /proc/PID/clear_refs); then six of some of them at once; then RSS before and after
(--only TEXT: the bodies whose name holds TEXT).
With --slow N: N connections that drip a request head, then N that drip a body, and how long
GET /health takes meanwhile (start the server with --max-connections N to fill every place).
With --hol (head of line; start the server with --total-cache-size 8388608, 22 blocks of 16
tokens for SmolLM2): A (200 prompt tokens, 100 generated) runs, B (150 prompt tokens) cannot
fit beside it, C (1 token) could: how long C, B and A take.
With --share (start the server with `--task embed`): a 256-input embeddings request and a short
chat request sent during it: the chat's status and time (one request must not own the queue).
Standard library only.
"""

import json
import socket
import sys
import threading
import time
import urllib.error
import urllib.request

LIM = 4 << 20


def status_kib(pid, key):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(key):
            return int(line.split()[1])
    raise KeyError(key)


def post(base, path, body):
    req = urllib.request.Request(base + path, data=body, headers={"Content-Type": "application/json"})
    t = time.time()
    try:
        r = urllib.request.urlopen(req, timeout=300)
        code, text = r.status, r.read()
    except urllib.error.HTTPError as e:
        code, text = e.code, e.read()
    except Exception as e:  # the server died, or cut the connection
        code, text = 0, str(e).encode()
    return code, time.time() - t, text


def peak(pid, f):
    before = status_kib(pid, "VmRSS:")
    with open(f"/proc/{pid}/clear_refs", "w") as c:
        c.write("5")
    r = f()
    return r, (status_kib(pid, "VmHWM:") - before) / 1024


def bodies():
    compact = dict(separators=(",", ":"))
    return {
        "one-id prompts": ("/v1/completions", b'{"max_tokens":1,"prompt":[' + b",".join([b"[1]"] * ((LIM - 40) // 4)) + b"]}"),
        "flat id list": ("/v1/completions", b'{"max_tokens":1,"prompt":[' + b",".join([b"1"] * ((LIM - 40) // 2)) + b"]}"),
        "words to /tokenize": ("/tokenize", json.dumps({"prompt": "a " * ((LIM - 40) // 2)}, **compact).encode()),
        "one word to /tokenize": ("/tokenize", json.dumps({"prompt": "a" * (LIM - 40)}, **compact).encode()),
        "CJK to /tokenize": ("/tokenize", json.dumps({"prompt": "中文的句子，" * ((LIM - 40) // 18)}, ensure_ascii=False, **compact).encode()),
        "CJK without stops": ("/tokenize", json.dumps({"prompt": "中" * ((LIM - 40) // 3)}, ensure_ascii=False, **compact).encode()),
        "one word as a prompt": ("/v1/completions", json.dumps({"max_tokens": 1, "prompt": "ab" * ((LIM - 40) // 2)}, **compact).encode()),
        "words as a prompt": ("/v1/completions", json.dumps({"max_tokens": 1, "prompt": "ab " * ((LIM - 40) // 3)}, **compact).encode()),
        "empty messages": (
            "/v1/chat/completions",
            json.dumps({"max_tokens": 1, "messages": [{"role": "user", "content": ""}] * ((LIM - 60) // 33)}, **compact).encode(),
        ),
        "one long message": (
            "/v1/chat/completions",
            json.dumps({"max_tokens": 1, "messages": [{"role": "user", "content": "ab " * ((LIM - 80) // 3)}]}, **compact).encode(),
        ),
        "tiny values": (
            "/v1/chat/completions",
            b'{"max_tokens":1,"messages":[{"role":"user","content":"x"}],"x":[' + b",".join([b"1"] * ((LIM - 80) // 2)) + b"]}",
        ),
        "ids to /detokenize": ("/detokenize", b'{"tokens":[' + b",".join([b"1"] * ((LIM - 20) // 2)) + b"]}"),
        "values inside a string": (
            "/v1/chat/completions",
            b'{"max_tokens":1,"messages":[{"role":"user","content":"x"}],"structured_outputs":{"json":"['
            + b",".join([b"1"] * ((LIM - 120) // 2))
            + b']"}}',
        ),
    }


def health_time(base):
    t = time.time()
    try:
        urllib.request.urlopen(base + "/health", timeout=120).read()
        return time.time() - t, "200"
    except urllib.error.HTTPError as e:
        return time.time() - t, str(e.code)
    except Exception as e:
        return time.time() - t, type(e).__name__


def slow(base, n):
    host, port = base.split("//")[1].split(":")
    for what, head, drip in [
        ("headers", b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nX-Slow: ", b"x"),
        ("a body", b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{", b" "),
    ]:
        socks = []
        for _ in range(n):
            s = socket.create_connection((host, int(port)))
            s.sendall(head)
            socks.append(s)
        stop = threading.Event()

        def dripping():
            while not stop.is_set():
                for s in socks:
                    try:
                        s.send(drip)
                    except OSError:
                        pass
                time.sleep(0.5)

        threading.Thread(target=dripping, daemon=True).start()
        time.sleep(1)
        took, code = health_time(base)
        print(f"{n} peers dripping {what}: GET /health {code} in {took:.2f} s")
        stop.set()
        for s in socks:
            s.close()
        time.sleep(1)


def hol(base):
    t0 = time.time()
    done = {}

    def body(name, n, max_tokens, stream=False):
        # Each its own token ids: no prefix-cache sharing.
        token = {"A": 1, "B": 2, "C": 3}[name]
        return json.dumps({"prompt": [token] * n, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}).encode()

    def run(name, n, max_tokens):
        code, _, _ = post(base, "/v1/completions", body(name, n, max_tokens))
        done[name] = (code, time.time() - t0)

    # A streams: B and C are sent once it decodes.
    req = urllib.request.Request(base + "/v1/completions", data=body("A", 200, 100, True), headers={"Content-Type": "application/json"})
    ra = urllib.request.urlopen(req, timeout=600)
    while not ra.readline().startswith(b"data: {"):
        pass
    first = time.time() - t0

    def rest():
        ra.read()
        done["A"] = (ra.status, time.time() - t0)

    a = threading.Thread(target=rest)
    a.start()
    b = threading.Thread(target=run, args=("B", 150, 4))
    b.start()
    time.sleep(0.2)
    c0 = time.time() - t0
    run("C", 1, 1)
    a.join()
    b.join()
    print(f"A's first token at {first:.2f} s")
    for name in "ABC":
        code, t = done[name]
        print(f"{name}: {code}, done at {t:.2f} s" + (f" (sent at {c0:.2f} s: {t - c0:.2f} s)" if name == "C" else ""))


def share(base):
    """One request of 256 inputs (embeddings on a `--task embed` server) and a short request
    sent 0.5 s into it: the short one's status and time (its TTFT: it asks for one token or
    embeds one word), and when the big one ended."""
    t0 = time.time()
    done = {}
    words = "the quick brown fox jumps over the lazy dog " * 2

    def big():
        body = json.dumps({"input": [f"{i} {words}" for i in range(256)]}).encode()
        code, _, _ = post(base, "/v1/embeddings", body)
        done["big"] = (code, time.time() - t0)

    b = threading.Thread(target=big)
    b.start()
    time.sleep(0.5)
    sent = time.time() - t0
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    code, t, _ = post(base, "/v1/chat/completions", chat)
    small = json.dumps({"input": "hello"}).encode()
    code2, t2, _ = post(base, "/v1/embeddings", small)
    b.join()
    print(f"chat sent at {sent:.2f} s: {code} in {t:.2f} s; then a one-word embedding: {code2} in {t2:.2f} s")
    print(f"the 256-input request: {done['big'][0]}, done at {done['big'][1]:.2f} s")


def main():
    base, pid = sys.argv[1].rstrip("/"), int(sys.argv[2])
    if "--hol" in sys.argv:
        hol(base)
        return
    if "--share" in sys.argv:
        share(base)
        return
    if "--slow" in sys.argv:
        slow(base, int(sys.argv[sys.argv.index("--slow") + 1]))
        return
    b = bodies()
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
    if only:
        b = {k: v for k, v in b.items() if only in k}
    rss0 = status_kib(pid, "VmRSS:") / 1024
    print(f"RSS before: {rss0:.0f} MiB")
    for name, (path, body) in b.items():
        (code, dt, text), grew = peak(pid, lambda: post(base, path, body))
        print(f"{name}: {len(body) >> 10} KiB -> {code} in {dt:.2f} s, peak +{grew:.0f} MiB ({text[:70]!r})")
    for name in [k for k in ["one-id prompts", "words to /tokenize", "empty messages", "one long message"] if k in b]:
        path, body = b[name]

        def six():
            ts = [threading.Thread(target=post, args=(base, path, body)) for _ in range(6)]
            t = time.time()
            [x.start() for x in ts]
            [x.join() for x in ts]
            return time.time() - t

        dt, grew = peak(pid, six)
        print(f"6 x {name} at once: {dt:.2f} s, peak +{grew:.0f} MiB")
    time.sleep(2)
    print(f"RSS after: {status_kib(pid, 'VmRSS:') / 1024:.0f} MiB (before: {rss0:.0f} MiB)")


if __name__ == "__main__":
    main()
