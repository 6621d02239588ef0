#!/usr/bin/env bash
# The GPU compiler report: what a real GPU compiler makes of every gpu-profile kernel, with no
# GPU. Mesa's RADV compiles for any AMD GPU family on its "null" device (RADV_FORCE_FAMILY);
# scripts/radv-shim/shim.c stands in front of it so that the real binary builds its pipelines
# there, and RADV_DEBUG=shaderstats,asm prints each pipeline's statistics and machine code
# (ACO's, as for the real card). The binary names each pipeline before it builds it
# (TORUS_PRINT_PIPELINES=1); scripts/gpu-compiler-report.py makes the table.
#
#   scripts/gpu-compiler-report.sh [--targets navi31,navi21,vega10,gfx1201] [--models] [--out DIR]
#
# Per target: `torus-wgpu build-kernels` (every pipeline of the gpu profile: every weight format's
# decode kernels and GEMM variants, attention at the families' head and group sizes, MoE,
# DeltaNet, PLE, norms, RoPE, sampling). --models adds `bench-model --kernel-profile gpu` on
# one-layer synthetic models (Qwen2.5-7B's shape in Q4_K and Q8_0, Qwen3-30B-A3B, Qwen3.5-9B,
# gpt-oss-20b, Gemma 4 E4B): the kernels as real shapes build them. Timings mean nothing there
# (nothing runs): only the compiler's figures count. RADV comes from scripts/fetch-radv.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGETS=navi31,navi21,vega10,gfx1201
MODELS=0
OUT=compiler-report
while [ $# -gt 0 ]; do
  case "$1" in
    --targets) TARGETS=$2; shift 2 ;;
    --models) MODELS=1; shift ;;
    --out) OUT=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
BIN=${BIN:-target/release/torus-wgpu}
[ -x "$BIN" ] || cargo build --release
RADV=$(scripts/fetch-radv.sh)
mkdir -p "$OUT/models" "$OUT/logs"

SYNTH=()
synth() { # NAME SHAPE FORMAT LAYERS
  local f="$OUT/models/$1.gguf"
  [ -f "$f" ] || "$BIN" synth-model --shape "$2" --format "$3" --layers "$4" --out "$f" >/dev/null 2>&1
  SYNTH+=("$f")
}
if [ "$MODELS" = 1 ]; then
  synth qwen2.5-7b-q4_k qwen2.5-7b q4_k 1
  synth qwen2.5-7b-q8_0 qwen2.5-7b q8_0 1
  synth qwen3-30b-a3b-q4_k qwen3-30b-a3b q4_k 1
  synth qwen3.5-9b-q4_k qwen3.5-9b q4_k 4
  synth gpt-oss-20b gpt-oss-20b q4_k 1
  synth gemma-4-e4b-q4_k gemma-4-e4b q4_k 2
fi

export VK_ICD_FILENAMES=$RADV/shim_icd.json TORUS_RADV_LIBRARY=$RADV/root/usr/lib/x86_64-linux-gnu/libvulkan_radeon.so
export LD_LIBRARY_PATH=$RADV/root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export RADV_DEBUG=shaderstats,asm MESA_SHADER_CACHE_DISABLE=true TORUS_PIPELINE_CACHE_DIR=off TORUS_PRINT_PIPELINES=1
LOGS=()
for t in ${TARGETS//,/ }; do
  log="$OUT/logs/$t-build-kernels.log"
  echo "$t: build-kernels" >&2
  RADV_FORCE_FAMILY=$t "$BIN" build-kernels >/dev/null 2>"$log" || { echo "failed: see $log" >&2; exit 1; }
  LOGS+=("$log")
  for m in "${SYNTH[@]}"; do
    log="$OUT/logs/$t-$(basename "$m" .gguf).log"
    echo "$t: $(basename "$m")" >&2
    RADV_FORCE_FAMILY=$t "$BIN" bench-model --model "$m" --kernel-profile gpu --max-sequence-length 1024 \
      --total-cache-size 67108864 >/dev/null 2>"$log" || { echo "failed: see $log" >&2; exit 1; }
    LOGS+=("$log")
  done
done
python3 scripts/gpu-compiler-report.py "${LOGS[@]}" --json "$OUT/report.json" > "$OUT/report.md"
echo "$OUT/report.md" >&2
