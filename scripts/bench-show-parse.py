#!/usr/bin/env python3
"""32 concurrent 4 MiB /api/show bodies of tiny values against a running `serve`: peak RSS growth
and the slowest GET /health meanwhile (BENCHMARKS.md, Hardening III). Usage: bench-show-parse.py URL PID"""
import json, sys, threading, time, urllib.request, urllib.error
base, pid = sys.argv[1], int(sys.argv[2])
def kib(key):
    for l in open(f"/proc/{pid}/status"):
        if l.startswith(key): return int(l.split()[1])
body = b'{"model":"x","x":[' + b",".join([b"1"] * ((4 << 20) // 2 - 20)) + b"]}"
open(f"/proc/{pid}/clear_refs", "w").write("5")
rss0 = kib("VmRSS:")
codes = []
def one():
    req = urllib.request.Request(base + "/api/show", data=body, headers={"Content-Type": "application/json"})
    try: codes.append(urllib.request.urlopen(req, timeout=300).status)
    except urllib.error.HTTPError as e: codes.append(e.code)
    except Exception as e: codes.append(str(e)[:30])
ts = [threading.Thread(target=one) for _ in range(32)]
t = time.time(); [x.start() for x in ts]
worst = 0.0
while any(x.is_alive() for x in ts):
    h = time.time(); urllib.request.urlopen(base + "/health", timeout=60).read(); worst = max(worst, time.time() - h)
    time.sleep(0.05)
[x.join() for x in ts]
print(f"32 x 4 MiB /api/show: {time.time()-t:.2f} s, statuses {sorted(set(map(str,codes)))}, peak RSS +{(kib('VmHWM:') - rss0)/1024:.0f} MiB, slowest /health {worst*1000:.0f} ms")
