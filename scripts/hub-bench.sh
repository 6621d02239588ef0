#!/usr/bin/env bash
# `torus-wgpu pull` against a local stand-in for the Hub (scripts/hub-standin.py), for the
# figures in BENCHMARKS.md: the default model's file pulled three times (seconds, peak RSS), a
# 20 MB listing, and a body that drips a byte every 2 s (each cut after 60 s at most).
#   scripts/hub-bench.sh [BINARY]   (default: target/release/torus-wgpu)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${1:-target/release/torus-wgpu}"
FILE=models/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$FILE" ] || { echo "$FILE is missing: run scripts/fetch-model.sh" >&2; exit 1; }
WORK=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$WORK"' EXIT

# standin ARGS...: starts a stand-in, sets URL.
standin() {
  python3 scripts/hub-standin.py --file "$FILE" "$@" > "$WORK/standin.out" &
  for _ in $(seq 100); do grep -q ready "$WORK/standin.out" 2>/dev/null && break; sleep 0.1; done
  URL=$(awk '/ready/ {print $2}' "$WORK/standin.out")
}

# measure LABEL: one `pull` with a fresh cache: seconds, peak RSS, exit status.
measure() {
  rm -rf "$WORK/hf"
  HF_HOME="$WORK/hf" HF_ENDPOINT="$URL" HF_HUB_DOWNLOAD_TIMEOUT=10 python3 - "$1" "$BIN" <<'PY'
import resource, subprocess, sys, time
t0 = time.time()
try:
    r = subprocess.run([sys.argv[2], "pull", "org/M-GGUF"], capture_output=True, text=True, timeout=60)
    status, err = r.returncode, r.stderr.strip().splitlines()[-1:] 
except subprocess.TimeoutExpired:
    status, err = "killed after 60 s", []
rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
print(f"{sys.argv[1]:<22} {time.time() - t0:7.2f} s  peak RSS {rss:7.1f} MB  exit {status}  {err[0][:110] if err else ''}")
PY
}

standin
for i in 1 2 3; do measure "default model, run $i"; done
kill %1; wait %1 2>/dev/null || true
standin --listing-mb 20
measure "20 MB listing"
kill %1; wait %1 2>/dev/null || true
standin --drip 2
measure "body dripping 1 B/2 s"
