#!/usr/bin/env bash
# Speculative decoding's figures: the same server with --speculative off and ngram (or, with
# --draft PATH, off and that draft model), back to back, on three workloads at concurrency 1
# (benches/spec/code-edit.jsonl: repeat a 53-line function with one rename; summary.jsonl:
# summarize a paragraph; chat.jsonl: a short story; code-edit-short.jsonl: a 16-line function,
# for slow models), then the three mixed at concurrency 1, 4 and 8 (--rounds R: R*c prompts at
# concurrency c, at least 3). Prints each run's output tok/s, TPOT and the speculation counters
# (drafts, acceptance rate, mean accepted length); writes the reports to --out. Needs a release
# binary and the model (default: Qwen2.5-Coder-0.5B, scripts/fetch-model.sh).
#
#   scripts/bench-spec.sh [--model PATH] [--draft PATH] [--k 5] [--out bench-results/spec] [--port 8123] [--runs 1]
#       [--workloads code-edit,summary,chat] [--concurrency 1,4,8] [--rounds 3]
#       [extra serve flags after --]
set -euo pipefail
cd "$(dirname "$0")/.."
model="models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
draft=""
k=5
out="bench-results/spec"
port=8123
runs=1
rounds=3
workloads="code-edit,summary,chat"
concurrency="1,4,8"
extra=()
while [ $# -gt 0 ]; do
    case "$1" in
        --model) model="$2"; shift 2 ;;
        --draft) draft="$2"; shift 2 ;;
        --k) k="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --port) port="$2"; shift 2 ;;
        --runs) runs="$2"; shift 2 ;;
        --rounds) rounds="$2"; shift 2 ;;
        --workloads) workloads="$2"; shift 2 ;;
        --concurrency) concurrency="$2"; shift 2 ;;
        --) shift; extra=("$@"); break ;;
        *) sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2 ;;
    esac
done
bin="${TORUS_BIN:-target/release/torus-wgpu}"
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"

pid=""
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null' EXIT

serve() {
    local how=(--speculative "$1")
    [ "$1" = draft ] && how+=(--draft-model "$draft")
    "$bin" serve --model "$model" --port "$port" --max-decode-batch-size 8 --max-sequence-length 2048 \
        "${how[@]}" --num-speculative-tokens "$k" "${extra[@]}" 2>"$out/serve-$1.log" &
    pid=$!
    for _ in $(seq 600); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && return 0
        kill -0 "$pid" 2>/dev/null || { cat "$out/serve-$1.log"; exit 1; }
        sleep 0.5
    done
    echo "server did not become ready" >&2
    exit 1
}

bench() { # label dataset concurrency prompts
    "$bin" bench --base-url "http://127.0.0.1:$port" --endpoint chat --dataset "$2" --concurrency "$3" \
        --num-prompts "$4" --timeout 3600 --quiet --json-out "$out/$1.json" >"$out/$1.txt"
    local tput tpot acc len
    field() { grep -m1 "$1" "$2" | awk '{print $NF}' || true; }
    tput=$(field 'Output token throughput' "$out/$1.txt")
    tpot=$(field 'Mean TPOT' "$out/$1.txt")
    acc=$(field 'Acceptance rate' "$out/$1.txt")
    len=$(field 'Mean accepted length' "$out/$1.txt")
    printf '%-28s output %8s tok/s  TPOT %8s ms  acceptance %6s %%  mean accepted length %s\n' \
        "$1" "$tput" "$tpot" "${acc:--}" "${len:--}" | tee -a "$summary"
}

for run in $(seq "$runs"); do
    methods="off ngram"
    [ -n "$draft" ] && methods="off draft"
    for spec in $methods; do
        serve "$spec"
        for w in ${workloads//,/ }; do
            bench "$w-$spec-run$run" "benches/spec/$w.jsonl" 1 1
        done
        for c in ${concurrency//,/ }; do
            bench "mixed-c$c-$spec-run$run" benches/spec/mixed.jsonl "$c" "$((c * rounds < 3 ? 3 : c * rounds))"
        done
        kill "$pid"
        wait "$pid" 2>/dev/null || true
        pid=""
    done
done
echo "reports in $out"
