#!/usr/bin/env bash
# Runs N torus-wgpu replicas on this host behind the Shepherd Model Gateway (SMG, `pip install
# smg==1.13.0`; scripts/setup.sh installs it) with cache-aware routing, and stops them all on
# Ctrl-C / SIGTERM.
#
# Usage: scripts/replicas.sh [N] [-- extra `torus-wgpu serve` flags]
# Environment:
#   MODEL         model path (default: the SmolLM2 GGUF in models/)
#   PORT          the router's port (default 8000); replica i listens on PORT + i
#   HOST          the router's address (default 127.0.0.1; 0.0.0.0 to serve the network)
#   POLICY        SMG policy (default cache_aware; also round_robin, power_of_two, ...)
#   TORUS_BIN     the torus-wgpu binary (default: target/release/torus-wgpu, built if missing)
#   METRICS_PORT  the router's own Prometheus port (default PORT + 100; on 127.0.0.1)
#   SMG_FLAGS     extra flags for `smg launch`
#   LOG_DIR       where each process logs (default: a new temporary folder, printed)
#   PIDS_FILE     where to write "replica <i> <port> <pid>" lines and "router <port> <pid>"
# Prints "replicas: ready on http://HOST:PORT" once the router answers /v1/models with the model.
# Replicas on other hosts: run `torus-wgpu serve --host 0.0.0.0` on each, then
#   smg launch --worker-urls http://A:8000 http://B:8000 --policy cache_aware --backend vllm
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-2}
shift || true
[ "${1:-}" = "--" ] && shift
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
PORT=${PORT:-8000}
HOST=${HOST:-127.0.0.1}
POLICY=${POLICY:-cache_aware}
BIN=${TORUS_BIN:-target/release/torus-wgpu}
PIDS_FILE=${PIDS_FILE:-}
METRICS_PORT=${METRICS_PORT:-$((PORT + 100))}
LOG_DIR=${LOG_DIR:-$(mktemp -d -t torus-replicas.XXXXXX)}
mkdir -p "$LOG_DIR"
echo "replicas: logs in $LOG_DIR" >&2

if ! [ -x "$BIN" ]; then
  cargo build --release
  BIN=${CARGO_TARGET_DIR:-target}/release/torus-wgpu
fi
if ! command -v smg >/dev/null 2>&1; then
  echo "replicas: the smg command is missing: python3 -m pip install smg==1.13.0 (scripts/setup.sh does)" >&2
  exit 1
fi

pids=()
cleanup() {
  trap - INT TERM EXIT
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup INT TERM EXIT
[ -n "$PIDS_FILE" ] && : > "$PIDS_FILE"

urls=()
for i in $(seq 1 "$N"); do
  p=$((PORT + i))
  "$BIN" serve --model "$MODEL" --host 127.0.0.1 --port "$p" "$@" > "$LOG_DIR/replica-$i.log" 2>&1 &
  pids+=("$!")
  [ -n "$PIDS_FILE" ] && echo "replica $i $p $!" >> "$PIDS_FILE"
  urls+=("http://127.0.0.1:$p")
done

# Replicas answer /health 200 once their model is loaded.
for u in "${urls[@]}"; do
  for _ in $(seq 1 600); do
    curl -sf "$u/health" >/dev/null 2>&1 && break
    sleep 0.5
  done
  curl -sf "$u/health" >/dev/null || { echo "replicas: $u never became healthy (see $LOG_DIR)" >&2; exit 1; }
done

# shellcheck disable=SC2086
smg launch --host "$HOST" --port "$PORT" --worker-urls "${urls[@]}" --policy "$POLICY" --backend vllm \
  --prometheus-host 127.0.0.1 --prometheus-port "$METRICS_PORT" --log-level warn ${SMG_FLAGS:-} \
  > "$LOG_DIR/router.log" 2>&1 &
pids+=("$!")
[ -n "$PIDS_FILE" ] && echo "router $PORT $!" >> "$PIDS_FILE"
for _ in $(seq 1 240); do
  if curl -sf "http://127.0.0.1:$PORT/v1/models" 2>/dev/null | grep -q '"id"'; then
    echo "replicas: ready on http://$HOST:$PORT ($N replicas, policy $POLICY)"
    wait
    exit 0
  fi
  sleep 0.5
done
echo "replicas: the router on port $PORT never listed the model (see $LOG_DIR/router.log)" >&2
exit 1
