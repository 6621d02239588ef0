#!/usr/bin/env bash
# Reproduces the seed engine's published scenario against `torus-wgpu serve` on the default
# model: 50 requests, 74 output tokens each (end-of-sequence ignored), concurrency 8, with the
# engine's max decode batch at 1, 4, 8 and 16. Prompts are 70 tokens (random words sized with the
# model's tokenizer), sent to /v1/completions. Prints a markdown table; the raw reports go to
# $OUT (default bench-results/).
#   scripts/bench-seed-table.sh            # all four batch sizes
#   BATCHES="1 8" scripts/bench-seed-table.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet
BIN="${CARGO_TARGET_DIR:-target}/release/torus-wgpu"
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
OUT="${OUT:-bench-results}"
PORT="${PORT:-8011}"
BATCHES="${BATCHES:-1 4 8 16}"
mkdir -p "$OUT"
[ -f "$MODEL" ] || scripts/fetch-model.sh

wait_healthy() {
  python3 - "$1" <<'PY'
import sys, time, urllib.request
url = sys.argv[1]
for _ in range(600):
    try:
        if urllib.request.urlopen(url, timeout=2).status == 200:
            sys.exit(0)
    except Exception:
        pass
    time.sleep(0.5)
sys.exit("server did not become healthy")
PY
}

echo "| max batch | requests/s | mean latency (s) | P95 latency (s) | output tok/s | mean TTFT (ms) | mean TPOT (ms) | failed |"
echo "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
for B in $BATCHES; do
  "$BIN" serve --model "$MODEL" --port "$PORT" --max-decode-batch-size "$B" >"$OUT/serve-b$B.log" 2>&1 &
  pid=$!
  trap 'kill $pid 2>/dev/null || true' EXIT
  wait_healthy "http://127.0.0.1:$PORT/health"
  "$BIN" bench --base-url "http://127.0.0.1:$PORT" --endpoint completions --num-prompts 50 \
    --input-len 70 --output-len 74 --concurrency 8 --ignore-eos --seed 0 --quiet \
    --tokenizer "$MODEL" --json-out "$OUT/seed-b$B.json" >"$OUT/bench-b$B.txt"
  kill -INT "$pid"
  wait "$pid" || true
  trap - EXIT
  python3 - "$OUT/seed-b$B.json" "$B" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
s = r["summary"]
print(f"| {sys.argv[2]} | {s['request_throughput']:.3f} | {s['e2el_ms']['mean']/1000:.2f} | "
      f"{s['e2el_ms']['p95']/1000:.2f} | {s['output_throughput']:.2f} | {s['ttft_ms']['mean']:.0f} | "
      f"{s['tpot_ms']['mean']:.0f} | {s['failed']} |")
PY
done
