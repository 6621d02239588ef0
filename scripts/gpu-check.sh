#!/usr/bin/env bash
# The GPU check: correctness and speed of the kernel profiles at real model sizes, on a machine
# where only this working tree and a release binary were copied (no Rust toolchain, no network,
# no model files). For each shape it writes a synthetic model (random weights, the real shape
# and a tokenizer; `torus-wgpu synth-model`) into a temp dir, runs `check-profiles` (cpu vs gpu
# kernel profiles, step by step), then `bench-model --profile-kernels` once per profile (speed,
# then where each shape's step time goes: GPU time, bytes and FLOPs per op from timestamp
# queries), and deletes the model.
# The out dir gets four files: summary.txt, log.txt, checks.json and bench.json. It goes on
# after a failed shape and exits 1 at the end if any check failed.
#
#   scripts/gpu-check.sh [--shapes smollm2-135m,qwen2.5-0.5b,qwen2.5-7b,llama-3-8b,qwen3-30b-a3b,gpt-oss-20b,qwen3.5-9b,qwen3.6-35b-a3b,gemma-4-e4b]
#       [--format q4_k]
#       [--layers N] [--out DIR (./gpu-check-out)] [--tmp DIR ($TMPDIR or /tmp)]
#       [--batches 1,8,32] [--decode-steps 32] [--prefill-tokens 512] [--profiles cpu,gpu] [--quick]
#
# The hybrids (qwen3.5-*, qwen3.6-*) get one more gpu-profile prefill with the chunked delta
# rule off, to compare with the per-token recurrence.
# --profiles: the kernel profiles bench-model runs (both by default; `gpu` alone when device
# time is short: check-profiles still compares the two).
# --quick (for lavapipe): 2 layers, batches 1,8, 4 decode steps, a 64-token prefill, a shorter
# profile check. The 7B/8B shapes at full depth need about 5 GB of disk and GPU memory each.
# The mixture-of-experts shapes run 12 of their layers unless --layers is given (qwen3-30b-a3b:
# 12 of 48, about 4.6 GB in Q4_K; gpt-oss-20b: 12 of 24, its experts MXFP4 whatever --format
# says, about 6 GB; qwen3.6-35b-a3b: 12 of 40, 9 Gated DeltaNet + 3 attention layers), and once
# more at batch 1 with every expert active (bench-model --moe-top-k 128 or 32; qwen3.6: 128 of
# its 256, the router's most): what the sparse path saves. gemma-4-e4b: 42 layers (five sliding-window
# layers to one global, the last 18 reading earlier layers' caches, per-layer embeddings), about
# 5 GB in Q4_K with its per-layer token table.
#
# The binary: $TORUS_BIN, else target/release/torus-wgpu, else $CARGO_TARGET_DIR/release/torus-wgpu.
#
# Vulkan: the binary opens libvulkan.so.1 at run time. Where `ldconfig -p | grep libvulkan`
# prints nothing, bring Debian's libvulkan1 package along (`apt-get download libvulkan1` on a
# machine with apt) and unpack it there: `dpkg -x libvulkan1_*.deb / && ldconfig`, or
# `dpkg -x libvulkan1_*.deb DIR` and LD_LIBRARY_PATH=DIR/usr/lib/x86_64-linux-gnu. Where the
# loader then finds no driver (`torus-wgpu adapters` lists only llvmpipe or nothing), point it
# at the vendor's ICD file, e.g. VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
# (NVIDIA containers; elsewhere /usr/share/vulkan/icd.d/nvidia_icd.json). Headless, an ICD file
# that names libGLX_nvidia.so.0 can fail ("Could not get 'vkCreateInstance'"); write one naming
# the EGL library instead, e.g. {"file_format_version":"1.0.1","ICD":{"library_path":
# "/usr/local/nvidia/lib64/libEGL_nvidia.so.0","api_version":"1.3.0"}}, and point VK_DRIVER_FILES at it.
set -uo pipefail
cd "$(dirname "$0")/.."

shapes="smollm2-135m,qwen2.5-0.5b,qwen2.5-7b,llama-3-8b,qwen3-30b-a3b,gpt-oss-20b,qwen3.5-9b,qwen3.6-35b-a3b,gemma-4-e4b"
format="q4_k"
layers=""
out="gpu-check-out"
tmp="${TMPDIR:-/tmp}"
batches="1,8,32"
decode_steps=32
warmup_steps=2
prefill_tokens=512
check_prompt=64
check_steps=16
profile_steps=4
profiles="cpu,gpu"
quick=0

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
    case "$1" in
        --shapes) shapes="$2"; shift 2 ;;
        --format) format="$2"; shift 2 ;;
        --layers) layers="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --tmp) tmp="$2"; shift 2 ;;
        --batches) batches="$2"; shift 2 ;;
        --decode-steps) decode_steps="$2"; shift 2 ;;
        --prefill-tokens) prefill_tokens="$2"; shift 2 ;;
        --profiles) profiles="$2"; shift 2 ;;
        --quick) quick=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu-check: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
if [ "$quick" = 1 ]; then
    # Only values still at their defaults change.
    [ -z "$layers" ] && layers=2
    [ "$batches" = "1,8,32" ] && batches="1,8"
    [ "$decode_steps" = 32 ] && decode_steps=4
    [ "$prefill_tokens" = 512 ] && prefill_tokens=64
    warmup_steps=1
    check_prompt=16
    check_steps=4
    profile_steps=2
fi

bin="${TORUS_BIN:-}"
if [ -z "$bin" ]; then
    for b in target/release/torus-wgpu "${CARGO_TARGET_DIR:-target}/release/torus-wgpu"; do
        [ -x "$b" ] && bin="$b" && break
    done
fi
if [ -z "$bin" ] || [ ! -x "$bin" ]; then
    echo "gpu-check: no torus-wgpu binary (set TORUS_BIN, or build with cargo build --release)" >&2
    exit 2
fi
mkdir -p "$out" || exit 2
out="$(cd "$out" && pwd)"
work="$(mktemp -d "$tmp/torus-gpu-check.XXXXXX")" || exit 2
trap 'rm -rf "$work"' EXIT
# Four files come out: summary.txt (verdicts and speed tables), log.txt (every command's
# output), checks.json and bench.json (arrays of check-profiles' and bench-model's reports).
summary="$out/summary.txt"
log="$out/log.txt"
: >"$summary"
: >"$log"
failed=0
say() { echo "$*" | tee -a "$summary"; }
# Runs a command, its output to the terminal and log.txt; its exit status is the command's.
run() {
    echo "\$ $*" >>"$log"
    "$@" 2>&1 | tee -a "$log"
}
# Joins JSON documents (files) into one array.
json_array() {
    local first=1
    echo "["
    for f in "$@"; do
        [ -f "$f" ] || continue
        [ "$first" = 1 ] || echo ","
        cat "$f"
        first=0
    done
    echo "]"
}

say "gpu-check: $(date -u +%Y-%m-%dT%H:%M:%SZ) binary $bin, format $format, shapes $shapes${layers:+, $layers layers}"
run "$bin" adapters | tee -a "$summary" || { say "FAIL: torus-wgpu adapters"; failed=1; }

n=0
for shape in ${shapes//,/ }; do
    n=$((n + 1))
    model="$work/$shape-$format.gguf"
    shape_layers="$layers"
    moe=0
    # The hybrids' files carry an MTP head: its proposal rounds are timed too.
    mtp_flag=""
    case "$shape" in qwen3.5-*|qwen3.6-*) mtp_flag="--mtp" ;; esac
    case "$shape" in
        qwen3-30b-a3b) moe=128; [ -z "$shape_layers" ] && shape_layers=12 ;;
        gpt-oss-20b) moe=32; [ -z "$shape_layers" ] && shape_layers=12 ;;
        # All 256 would exceed the router's limit (128 per token): half of them active.
        qwen3.6-35b-a3b) moe=128; [ -z "$shape_layers" ] && shape_layers=12 ;;
    esac
    # Gemma 4 at full depth: its unscaled attention over q/k-normed heads makes the random model
    # chaotic. The f16 KV cache's rounding (the same in both profiles) moves one layer's logits
    # by 3e-3 to 9e-3 from an f32 cache, and the profiles' last-bit differences in the keys
    # round to different halves; over 42 layers that grew to 1.5 on an H200 (f32 cache: 5e-2,
    # every step agreeing). Its profiles are compared with an f32 cache; the benchmarks use f16.
    check_kv=""
    case "$shape" in gemma-4-*) check_kv="--kv-cache-dtype f32" ;; esac
    say ""
    say "== $shape ($format${shape_layers:+, $shape_layers layers})"
    if ! run "$bin" synth-model --shape "$shape" --format "$format" ${shape_layers:+--layers "$shape_layers"} --out "$model"; then
        say "FAIL: $shape: synth-model"
        failed=1
        continue
    fi
    tail -n 1 "$log" >>"$summary"
    if run "$bin" check-profiles --model "$model" --prompt-tokens "$check_prompt" --steps "$check_steps" $check_kv \
        --json "$work/check-$n.json"; then
        say "PASS: $shape: check-profiles ($(tail -n 1 "$log"))"
    else
        say "FAIL: $shape: check-profiles ($(tail -n 1 "$log"))"
        failed=1
    fi
    for profile in ${profiles//,/ }; do
        if run "$bin" bench-model --model "$model" --kernel-profile "$profile" --batches "$batches" \
            --decode-steps "$decode_steps" --warmup-steps "$warmup_steps" --prefill-tokens "$prefill_tokens" \
            --profile-kernels --profile-steps "$profile_steps" $mtp_flag \
            --json "$work/bench-$n-$profile.json" >"$work/bench.out"; then
            cat "$work/bench.out"
            say "bench-model, kernel profile $profile:"
            grep -v -e '^adapter:' -e '^loaded ' -e '^batch [0-9]*:' -e '^MTP head, batch [0-9]*: [0-9.]* ms per round$' -e '^wrote ' "$work/bench.out" >>"$summary"
        else
            say "FAIL: $shape: bench-model --kernel-profile $profile ($(tail -n 1 "$log"))"
            failed=1
        fi
    done
    # The hybrids' prefill once more with the chunked delta rule off (the per-token recurrence
    # in every step): what the gpu profile's chunked form gains or loses on this GPU.
    if [ -n "$mtp_flag" ]; then
        if TORUS_DELTA_CHUNK_MIN=1000000000 run "$bin" bench-model --model "$model" --kernel-profile gpu --batches 1 \
            --decode-steps 1 --warmup-steps 1 --prefill-tokens "$prefill_tokens" --profile-kernels --profile-steps 1 \
            --json "$work/bench-$n-per-token-delta.json" >"$work/bench.out"; then
            cat "$work/bench.out"
            say "bench-model, kernel profile gpu, the delta rule per token (TORUS_DELTA_CHUNK_MIN=1000000000):"
            grep -e '^prefill' -e 'kernel profile: prefill' -e '  delta_' "$work/bench.out" >>"$summary"
        else
            say "FAIL: $shape: bench-model with the per-token delta rule ($(tail -n 1 "$log"))"
            failed=1
        fi
    fi
    if [ "$moe" != 0 ]; then
        if run "$bin" bench-model --model "$model" --batches 1 --decode-steps "$decode_steps" \
            --warmup-steps "$warmup_steps" --prefill-tokens 0 --moe-top-k "$moe" \
            --json "$work/bench-$n-all-experts.json" >"$work/bench.out"; then
            cat "$work/bench.out"
            say "bench-model, every expert active (--moe-top-k $moe; the outputs are not the model's):"
            grep -v -e '^adapter:' -e '^loaded ' -e '^batch [0-9]*:' -e '^MTP head, batch [0-9]*: [0-9.]* ms per round$' -e '^wrote ' "$work/bench.out" >>"$summary"
        else
            say "FAIL: $shape: bench-model --moe-top-k $moe ($(tail -n 1 "$log"))"
            failed=1
        fi
    fi
    rm -f "$model"
done

json_array "$work"/check-*.json >"$out/checks.json"
json_array "$work"/bench-*.json >"$out/bench.json"
say ""
if [ "$failed" = 0 ]; then
    say "gpu-check: all checks passed; reports in $out"
else
    say "gpu-check: some checks FAILED; reports in $out"
fi
exit "$failed"
