#!/usr/bin/env bash
# Prefill and decode speed of the test models back to back on one machine: the same English
# prompt (the "long" prompt of tests/fixtures/gemma3-270m-reference.json: 418 Gemma tokens,
# about 330-420 for the others), 64 decoded tokens with end-of-sequence ignored, each model run
# RUNS times in turn. `generate` prints its own prefill and decode rates on stderr.
#   scripts/bench-models.sh                  # SmolLM2, Qwen2.5-Coder-0.5B, Gemma 3 270M
#   RUNS=1 MODELS="models/x.gguf" scripts/bench-models.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet
BIN="${CARGO_TARGET_DIR:-target}/release/torus-wgpu"
RUNS="${RUNS:-2}"
MODELS="${MODELS:-models/SmolLM2-135M-Instruct.Q4_1.gguf models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf models/gemma-3-270m-q4_k_m.gguf}"
PROMPT="$(python3 -c 'import json; d = json.load(open("tests/fixtures/gemma3-270m-reference.json")); print(next(p["text"] for p in d["prompts"] if p["name"] == "long"))')"
for run in $(seq "$RUNS"); do
  for m in $MODELS; do
    echo "== run $run: $m" >&2
    "$BIN" generate --model "$m" --prompt "$PROMPT" --max-tokens 64 --ignore-eos --temperature 0 >/dev/null
  done
done
