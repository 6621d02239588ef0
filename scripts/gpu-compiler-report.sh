#!/usr/bin/env bash
# The GPU compiler report: what a real GPU compiler makes of every gpu-profile kernel, with no
# GPU. Mesa's RADV compiles for any AMD GPU family on its "null" device (RADV_FORCE_FAMILY);
# scripts/radv-shim/shim.c stands in front of it so that the real binary builds its pipelines
# there, and RADV_DEBUG=shaderstats,asm prints each pipeline's statistics and machine code
# (ACO's, as for the real card). The binary names each pipeline before it builds it
# (TORUS_PRINT_PIPELINES=1); scripts/gpu-compiler-report.py makes the table.
#
#   scripts/gpu-compiler-report.sh [--targets navi31,navi21,vega10,gfx1201] [--quick] [--out DIR]
#
# --quick: the Q4_K and Q8_0 dense models only. What runs, per target: `bench-model
# --kernel-profile gpu` on one-layer synthetic models (Qwen2.5-7B's shape in every weight format
# synth-model writes; Qwen3-30B-A3B, Qwen3.5-9B, gpt-oss-20b and Gemma 4 E4B in Q4_K), which
# builds the decode kernels at every row count, the GEMMs, attention, norms, RoPE, MoE, DeltaNet,
# PLE and sampling; and `tune` on a synthetic Q4_K and Q8_0 layer (every GEMM variant). Timings
# mean nothing there (nothing runs): only the compiler's figures count.
#
# Needs: Mesa 25.0.x's RADV, fetched once with apt-get from Debian's bookworm-backports under a
# private apt state and extracted with dpkg-deb into ~/.cache/torus-wgpu/mesa-25.0.7 (the
# system's Mesa, lavapipe, is not touched; Debian 12's own RADV compiles worse code); Vulkan's
# headers (libvulkan-dev, installed with apt-get where missing) and a C compiler for the shim.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGETS=navi31,navi21,vega10,gfx1201
QUICK=0
OUT=compiler-report
while [ $# -gt 0 ]; do
  case "$1" in
    --targets) TARGETS=$2; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --out) OUT=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
BIN=${BIN:-target/release/torus-wgpu}
[ -x "$BIN" ] || cargo build --release
MESA_VERSION=25.0.7-2~bpo12+1
CACHE=${TORUS_MESA_CACHE:-$HOME/.cache/torus-wgpu/mesa-25.0.7}
LIB=$CACHE/root/usr/lib/x86_64-linux-gnu
mkdir -p "$OUT/models" "$OUT/logs"

# Mesa's RADV from bookworm-backports, with the libdrm it needs.
if [ ! -f "$LIB/libvulkan_radeon.so" ]; then
  APT="$CACHE/apt"
  mkdir -p "$APT/lists/partial" "$APT/archives/partial" "$CACHE/debs"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm-backports main" \
    > "$APT/sources.list"
  OPTS=(-o "Dir::State::Lists=$APT/lists" -o "Dir::Cache=$APT" -o "Dir::Etc::SourceList=$APT/sources.list"
        -o "Dir::Etc::SourceParts=/nonexistent" -o "Debug::NoLocking=1")
  apt-get "${OPTS[@]}" update 2>&1 | grep -v "^W: Download is performed unsandboxed" >&2
  # (Only backports is listed: its libdrm is the candidate.)
  (cd "$CACHE/debs" && apt-get "${OPTS[@]}" download "mesa-vulkan-drivers=$MESA_VERSION" libdrm2 libdrm-amdgpu1 \
    2>&1 | grep -v "^W: Download is performed unsandboxed" >&2)
  for d in "$CACHE"/debs/*.deb; do dpkg-deb -x "$d" "$CACHE/root"; done
fi

# The shim.
if [ ! -f /usr/include/vulkan/vulkan.h ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get install -y libvulkan-dev >/dev/null
fi
SHIM=$CACHE/libtorus_radv_shim.so
cc -shared -fPIC -O2 -Wall -o "$SHIM" scripts/radv-shim/shim.c -ldl
printf '{"file_format_version": "1.0.0", "ICD": {"library_path": "%s", "api_version": "1.3.0"}}\n' "$SHIM" \
  > "$CACHE/shim_icd.json"

# The synthetic models (written once per --out folder).
MODELS=()
synth() { # NAME SHAPE FORMAT LAYERS
  local f="$OUT/models/$1.gguf"
  [ -f "$f" ] || "$BIN" synth-model --shape "$2" --format "$3" --layers "$4" --out "$f" >/dev/null
  MODELS+=("$f")
}
synth qwen2.5-7b-q4_k qwen2.5-7b q4_k 1
synth qwen2.5-7b-q8_0 qwen2.5-7b q8_0 1
if [ "$QUICK" = 0 ]; then
  for f in f32 f16 q4_0 q4_1 q5_0 q5_1 q2_k q3_k q5_k q6_k iq4_nl iq4_xs; do synth "qwen2.5-7b-$f" qwen2.5-7b "$f" 1; done
  synth qwen3-30b-a3b-q4_k qwen3-30b-a3b q4_k 1
  synth qwen3.5-9b-q4_k qwen3.5-9b q4_k 4
  synth gpt-oss-20b gpt-oss-20b q4_k 1
  synth gemma-4-e4b-q4_k gemma-4-e4b q4_k 2
fi

export VK_ICD_FILENAMES=$CACHE/shim_icd.json TORUS_RADV_LIBRARY=$LIB/libvulkan_radeon.so
export LD_LIBRARY_PATH=$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export RADV_DEBUG=shaderstats,asm MESA_SHADER_CACHE_DISABLE=true TORUS_PIPELINE_CACHE_DIR=off
export TORUS_PRINT_PIPELINES=1 TORUS_TUNE_CACHE=$OUT/tune-cache.json
LOGS=()
for t in ${TARGETS//,/ }; do
  for m in "${MODELS[@]}"; do
    log="$OUT/logs/$t-$(basename "$m" .gguf).log"
    echo "$t: $(basename "$m")" >&2
    RADV_FORCE_FAMILY=$t "$BIN" bench-model --model "$m" --kernel-profile gpu --max-sequence-length 1024 \
      --total-cache-size 67108864 >/dev/null 2>"$log" || { echo "failed: see $log" >&2; exit 1; }
    LOGS+=("$log")
  done
  for f in q4_k q8_0; do
    log="$OUT/logs/$t-tune-$f.log"
    echo "$t: tune $f" >&2
    RADV_FORCE_FAMILY=$t "$BIN" tune --format "$f" --budget-s 5 --experts 8 --top-k 2 >/dev/null 2>"$log" ||
      { echo "failed: see $log" >&2; exit 1; }
    LOGS+=("$log")
  done
done
python3 scripts/gpu-compiler-report.py "${LOGS[@]}" > "$OUT/report.md"
echo "$OUT/report.md" >&2
