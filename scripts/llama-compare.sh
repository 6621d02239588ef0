#!/usr/bin/env bash
# Compares torus-wgpu's log-probabilities with llama.cpp's on tiny F32 variants of every
# synthetic shape (issue 47; outside CI). Usage: scripts/llama-compare.sh [SHAPE ...]
#
# 1. Builds llama.cpp's CPU backend from the tree vendored in the llama-cpp-python==0.3.36 sdist
#    (pip downloads the sdist; pip builds it with cmake into a virtual environment under
#    $HOME/.cache/torus-wgpu/llama-venv). GGML_NATIVE is off and only x86 features this machine
#    lists are turned on: a native build may use AVX-VNNI, which these machines lack.
# 2. Runs scripts/llama-compare.py: writes each shape's tiny F32 file with `torus-wgpu
#    synth-model --tiny`, lets llama.cpp continue a fixed prompt greedily, scores the same ids
#    with both engines and prints one table row per shape.
# Needs: cmake, a C++ compiler, python3 with pip, and target/release/torus-wgpu
# (cargo build --release).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${LLAMA_VENV:-$HOME/.cache/torus-wgpu/llama-venv}"
if ! "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null; then
  command -v cmake >/dev/null || { echo "error: cmake is missing (apt-get install cmake)" >&2; exit 1; }
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "scikit-build-core[pyproject]>=0.9.2" numpy typing-extensions diskcache jinja2
  flags="-DGGML_NATIVE=OFF -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DGGML_OPENMP=ON"
  for f in avx avx2 fma f16c; do
    if grep -qw "$f" /proc/cpuinfo; then flags="$flags -DGGML_$(echo "$f" | tr a-z A-Z)=ON"; fi
  done
  # Left off even where listed: AVX-512 and VNNI variants (not on every machine of this kind).
  flags="$flags -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF -DGGML_BMI2=OFF"
  echo "building llama-cpp-python 0.3.36 from its sdist with: $flags"
  CMAKE_ARGS="$flags" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$VENV/bin/pip" install -v --no-binary llama-cpp-python --no-build-isolation \
    --no-cache-dir "llama-cpp-python==0.3.36" >"$VENV.build.log" 2>&1 \
    || { tail -40 "$VENV.build.log" >&2; echo "error: the build failed (log: $VENV.build.log)" >&2; exit 1; }
fi
[ -x target/release/torus-wgpu ] || { echo "error: build torus-wgpu first (cargo build --release)" >&2; exit 1; }
exec "$VENV/bin/python" scripts/llama-compare.py "$@"
