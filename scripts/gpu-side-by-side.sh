#!/usr/bin/env bash
# torus-wgpu beside llama.cpp's Vulkan backend on the same GPU and the same files (issue 48).
#
#   scripts/gpu-side-by-side.sh pack [--pack DIR (side-by-side-pack)]
#       Here (Debian, with apt-get and pip): installs cmake, glslc, libvulkan-dev and
#       spirv-headers where missing, builds llama.cpp's Vulkan backend and llama-bench from the
#       tree vendored in the llama-cpp-python==0.3.36 sdist (GGML_NATIVE off, only the x86
#       features /proc/cpuinfo lists, AVX-512 and VNNI left off: not every machine has them),
#       and writes DIR/pack.tar.xz: llama-bench, llama-batched-bench, their libraries and the torus-wgpu binary
#       (target/release), stripped. Carry DIR to the GPU machine (the device tool's `carry`).
#
#   scripts/gpu-side-by-side.sh run [--pack DIR] [--out DIR (side-by-side-out)] [--shapes LIST]
#       [--serve-shapes LIST] [--tune-shapes LIST] [--quick] [--tmp DIR] [--peak-gb-s N (the GPU's memory bandwidth: 3350 H100 SXM, 4800 H200)]
#       On the GPU machine (no compiler, no network): unpacks, writes each synthetic model once
#       with `torus-wgpu synth-model` (qwen2.5-7b and llama-3-8b in Q4_K, qwen3-30b-a3b at 12
#       layers, qwen3.5-9b), runs llama-bench (tg128 and pp512, flash attention off and on) and
#       `torus-wgpu bench-model` (decode at batch 1, 8, 32; a 512-token prefill) on it, and
#       prints torus-wgpu / llama.cpp ratios (those runs with the default GEMM plan: no tuner
#       cache). On the --serve-shapes (qwen2.5-7b) also (issue 49): `torus-wgpu tune` on the
#       model (every GEMM variant timed against the decode kernel; DIR/tune-SHAPE.json), then
#       bench-model with the tuned plan and with cooperative matrices in every GEMM
#       (TORUS_COOPERATIVE_MATRIX=1), llama-batched-bench (pp128 tg128 at 8 and 32 sequences),
#       and `torus-wgpu serve` (with the tuned plan) measured by `torus-wgpu bench` (completions,
#       128-token prompts, 128 tokens out with ignore_eos) at concurrency 1, 8 and 32. On the
#       --tune-shapes (qwen2.5-7b; add qwen3-30b-a3b for the MoE experts' tiled kernels) tune and
#       bench-model with the tuned choice.
#       DIR gets side-by-side.json (every report whole and the ratios), reports.jsonl, summary.txt
#       and log.txt. --quick (lavapipe): the tiny variants, tg16/pp64, batches 1 and 8, concurrency
#       1 and 8 with 16 tokens out. About 10 minutes for the four shapes on an H100/H200 (the
#       device allows 10 minutes a call: give each call two shapes with --shapes).
#
# Vulkan on the GPU machine: see scripts/gpu-check.sh's header (libvulkan1, VK_DRIVER_FILES).
set -uo pipefail
cd "$(dirname "$0")/.."

cmd="${1:-}"
shift || true
pack="side-by-side-pack"
out="side-by-side-out"
shapes="qwen2.5-7b,llama-3-8b,qwen3-30b-a3b,qwen3.5-9b"
serve_shapes="qwen2.5-7b"
tune_shapes="qwen2.5-7b"
quick=0
tmp="${TMPDIR:-/tmp}"
peak=""
while [ $# -gt 0 ]; do
    case "$1" in
        --pack) pack="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --shapes) shapes="$2"; shift 2 ;;
        --serve-shapes) serve_shapes="$2"; shift 2 ;;
        --tune-shapes) tune_shapes="$2"; shift 2 ;;
        --tmp) tmp="$2"; shift 2 ;;
        --quick) quick=1; shift ;;
        --peak-gb-s) peak="$2"; shift 2 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
done

do_pack() {
    set -e
    local need=()
    command -v cmake >/dev/null || need+=(cmake)
    command -v glslc >/dev/null || need+=(glslc)
    [ -f /usr/include/vulkan/vulkan.h ] || need+=(libvulkan-dev)
    [ -d /usr/include/spirv ] || need+=(spirv-headers)
    command -v xz >/dev/null || need+=(xz-utils)
    if [ ${#need[@]} -gt 0 ]; then
        apt-get update -q && apt-get install -y -q "${need[@]}"
    fi
    local bin=target/release/torus-wgpu
    [ -x "$bin" ] || { echo "error: build torus-wgpu first (cargo build --release)" >&2; exit 1; }
    local src="${LLAMA_SRC:-$HOME/.cache/torus-wgpu/llama.cpp-0.3.36}"
    if [ ! -f "$src/CMakeLists.txt" ]; then
        local dl
        dl=$(mktemp -d)
        # The sdist only (its metadata step needs cmake and scikit-build-core).
        python3 -m pip install -q "scikit-build-core>=0.9.2"
        python3 -m pip download -q --no-deps --no-build-isolation --no-binary llama-cpp-python \
            -d "$dl" "llama-cpp-python==0.3.36"
        tar -xzf "$dl"/llama_cpp_python-0.3.36.tar.gz -C "$dl"
        mkdir -p "$(dirname "$src")"
        rm -rf "$src"
        mv "$dl"/llama_cpp_python-0.3.36/vendor/llama.cpp "$src"
        rm -rf "$dl"
    fi
    # This llama.cpp needs Vulkan headers of 1.3.261 or later (VK_EXT_layer_settings); Debian 12
    # has 1.3.239. Then Debian 13's libvulkan-dev is downloaded (not installed) and its headers
    # used: apt-get with a private source list and state, unpacked with dpkg -x.
    local vk_inc=""
    local have
    have=$(sed -n 's/^#define VK_HEADER_VERSION \([0-9]*\).*/\1/p' /usr/include/vulkan/vulkan_core.h 2>/dev/null)
    if [ -z "$have" ] || [ "$have" -lt 261 ]; then
        local ax="$HOME/.cache/torus-wgpu/vulkan-headers"
        if [ ! -f "$ax/usr/include/vulkan/vulkan.hpp" ]; then
            local apt_dir
            apt_dir=$(mktemp -d)
            mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial"
            echo "deb http://deb.debian.org/debian trixie main" >"$apt_dir/sources.list"
            local a=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
                -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache")
            apt-get "${a[@]}" update -q
            (cd "$apt_dir" && apt-get "${a[@]}" download libvulkan-dev)
            mkdir -p "$ax"
            dpkg -x "$apt_dir"/libvulkan-dev_*.deb "$ax"
            rm -rf "$apt_dir"
        fi
        vk_inc="$ax/usr/include"
    fi
    local flags=(-DGGML_NATIVE=OFF ${vk_inc:+-DVulkan_INCLUDE_DIR="$vk_inc"} -DGGML_VULKAN=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DLLAMA_CURL=OFF
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=ON
        -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF -DGGML_BMI2=OFF -DCMAKE_BUILD_TYPE=Release
        -DCMAKE_BUILD_RPATH='$ORIGIN' -DCMAKE_INSTALL_RPATH='$ORIGIN')
    for f in avx avx2 fma f16c; do
        if grep -qw "$f" /proc/cpuinfo; then
            flags+=("-DGGML_$(echo "$f" | tr a-z A-Z)=ON")
        else
            flags+=("-DGGML_$(echo "$f" | tr a-z A-Z)=OFF")
        fi
    done
    echo "building llama-bench (Vulkan) in $src/build-vulkan: ${flags[*]}"
    cmake -S "$src" -B "$src/build-vulkan" "${flags[@]}" >/dev/null
    cmake --build "$src/build-vulkan" --target llama-bench llama-batched-bench -j "$(nproc)"
    local stage
    stage=$(mktemp -d)
    mkdir -p "$stage/pack"
    cp "$src/build-vulkan/bin/llama-bench" "$src/build-vulkan/bin/llama-batched-bench" "$stage/pack/"
    find "$src/build-vulkan/bin" -maxdepth 1 -name '*.so*' -exec cp -a {} "$stage/pack/" \;
    cp "$bin" "$stage/pack/torus-wgpu"
    strip "$stage/pack/llama-bench" "$stage/pack/llama-batched-bench" "$stage/pack/torus-wgpu"
    find "$stage/pack" -type f -name '*.so*' -exec strip --strip-unneeded {} \;
    mkdir -p "$pack"
    tar -C "$stage" -cJf "$pack/pack.tar.xz" pack
    rm -rf "$stage"
    ls -la "$pack/pack.tar.xz"
}

# Issue 49's measurements on one shape: the matmul variants A/B, llama.cpp's batched decode, and
# serving throughput through HTTP.
# `torus-wgpu tune` on one shape's file (its GEMM plan, and for a MoE shape tiled against grouped
# experts), kept in $work/tune-SHAPE.json, which the tuned runs name.
tune_shape() {
    local shape="$1" model="$2" tuned="$work/tune-$shape.json"
    local budget=30
    [ "$quick" = 1 ] && budget=20
    echo "+ torus-wgpu tune --model $model" >>"$log"
    if "$p/torus-wgpu" tune --model "$model" --budget-s "$budget" --cache "$tuned" --json "$out/tune-$shape.json" \
        >"$work/tune.out" 2>&1; then
        cat "$work/tune.out" >>"$log"
        grep -E '^[a-z0-9_]+: decode below|experts \(' "$work/tune.out" | sed 's/^/tuned: /' | tee -a "$summary"
        printf '{"shape":"%s","engine":"torus-wgpu-tune","report":%s}\n' "$shape" "$(tr -d '\n' <"$out/tune-$shape.json")" >>"$reports"
    else
        cat "$work/tune.out" >>"$log"
        say "FAIL: $shape: tune ($(tail -n 1 "$work/tune.out"))"
    fi
}

# bench-model on one shape's file with the variants named (tuned: the plan tune_shape kept;
# coop: cooperative matrices in every GEMM), each A/B against the default run.
variants() {
    local shape="$1" model="$2" v env
    shift 2
    for v in "$@"; do
        case "$v" in tuned) env="TORUS_TUNE_CACHE=$work/tune-$shape.json" ;; coop) env="TORUS_COOPERATIVE_MATRIX=1" ;; esac
        echo "+ $env torus-wgpu bench-model $model" >>"$log"
        if env "$env" "$p/torus-wgpu" bench-model --model "$model" --kernel-profile gpu --batches "${batches#1,}" \
            --decode-steps "$steps" --warmup-steps 2 --prefill-tokens "$pp" ${peak:+--peak-gb-s "$peak"} \
            --json "$work/torus-$v.json" >"$work/bench.out" 2>&1; then
            cat "$work/bench.out" >>"$log"
            grep -E '^(batch [0-9]+:|prefill:)' "$work/bench.out" | sed "s/^/[$v] /" | tee -a "$summary"
            printf '{"shape":"%s","engine":"torus-wgpu","variant":"%s","report":%s}\n' "$shape" "$v" \
                "$(tr -d '\n' <"$work/torus-$v.json")" >>"$reports"
        else
            cat "$work/bench.out" >>"$log"
            say "FAIL: $shape: bench-model with $env ($(tail -n 1 "$work/bench.out"))"
        fi
    done
}

tuned_bench() {
    variants "$1" "$2" tuned
}

serving() {
    local shape="$1" model="$2"
    local tuned="$work/tune-$shape.json"
    variants "$shape" "$model" tuned coop
    # llama.cpp's batched decode: 8 and 32 sequences of a 128-token prompt and 128 new tokens.
    local npl=8,32 ctx=16384
    [ "$quick" = 1 ] && { npl=8; ctx=2048; }
    for fa in off on; do
        if run "$p/llama-batched-bench" -m "$model" -ngl 99 -fa "$fa" -c "$ctx" -b 2048 -ub 512 -npp 128 \
            -ntg "$tg" -npl "$npl" --output-format jsonl >"$work/batched.out"; then
            grep '^{' "$work/batched.out" | while read -r row; do
                printf '{"shape":"%s","engine":"llama.cpp-batched","report":%s}\n' "$shape" "$row" >>"$reports"
                echo "llama-batched-bench fa $fa: $row" | tee -a "$summary"
            done
        else
            say "FAIL: $shape: llama-batched-bench -fa $fa ($(tail -n 1 "$log"))"
        fi
    done
    # torus-wgpu serve, measured through its OpenAI API.
    local port=18431
    TORUS_TUNE_CACHE="$tuned" "$p/torus-wgpu" serve --model "$model" --kernel-profile gpu --port "$port" --max-decode-batch-size 32 \
        --max-sequence-length 4096 --total-cache-size "$cache" >>"$log" 2>&1 &
    local spid=$! i
    # No curl on the GPU machine: bash's /dev/tcp asks /health.
    healthy() { (exec 3<>"/dev/tcp/127.0.0.1/$port" && printf 'GET /health HTTP/1.0\r\n\r\n' >&3 && head -n 1 <&3 | grep -q ' 200') 2>/dev/null; }
    for i in $(seq 1200); do
        healthy && break
        kill -0 "$spid" 2>/dev/null || break
        sleep 0.5
    done
    if ! healthy; then
        say "FAIL: $shape: serve did not come up ($(tail -n 1 "$log"))"
        kill "$spid" 2>/dev/null
        return
    fi
    local c
    for c in ${conc//,/ }; do
        local n=$((c * 2))
        [ "$n" -lt 4 ] && n=4
        if run "$p/torus-wgpu" bench --base-url "http://127.0.0.1:$port" --endpoint completions --num-prompts "$n" \
            --concurrency "$c" --input-len 128 --output-len "$out_len" --ignore-eos --tokenizer "$model" --quiet \
            --json-out "$work/serve.json" >"$work/serve.out"; then
            say "serve, concurrency $c: $(grep -E 'Output token throughput' "$work/serve.out" | tr -s ' ')"
            cp "$work/serve.json" "$out/serve-$shape-c$c.json"
            printf '{"shape":"%s","engine":"torus-wgpu-serve","concurrency":%s,"report":%s}\n' "$shape" "$c" \
                "$(python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print(json.dumps(r["summary"]))' "$work/serve.json" 2>/dev/null || echo null)" >>"$reports"
        else
            say "FAIL: $shape: bench at concurrency $c ($(tail -n 1 "$log"))"
        fi
    done
    kill "$spid" 2>/dev/null
    wait "$spid" 2>/dev/null
}

do_run() {
    [ -f "$pack/pack.tar.xz" ] || { echo "error: $pack/pack.tar.xz is missing (run 'pack' first)" >&2; exit 1; }
    mkdir -p "$out"
    work=$(mktemp -d "$tmp/side-by-side.XXXXXX")
    trap 'rm -rf "$work"' EXIT
    tar -C "$work" -xJf "$pack/pack.tar.xz"
    local p="$work/pack" log="$out/log.txt" summary="$out/summary.txt" reports="$work/reports.jsonl"
    : >"$log"
    : >"$summary"
    : >"$reports"
    export LD_LIBRARY_PATH="$p${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    # The default GEMM plan unless a run names the tuner's cache.
    export TORUS_TUNE_CACHE=off
    say() { echo "$*" | tee -a "$summary"; }
    run() { echo "+ $*" >>"$log"; "$@" 2>>"$log"; }
    local tg=128 pp=512 batches=1,8,32 steps=32 tiny="" conc=1,8,32 out_len=128 cache=4294967296
    if [ "$quick" = 1 ]; then
        tg=16; pp=64; batches=1,8; steps=4; tiny="--tiny"; conc=1,8; out_len=16; cache=268435456
        # ggml-vulkan skips CPU devices (llvmpipe) unless they are named.
        export GGML_VK_VISIBLE_DEVICES="${GGML_VK_VISIBLE_DEVICES:-0}"
    fi
    say "side-by-side: $(date -u +%Y-%m-%dT%H:%M:%SZ), shapes $shapes${tiny:+ (tiny variants)}"
    run "$p/torus-wgpu" adapters | tee -a "$summary"
    for shape in ${shapes//,/ }; do
        local layers=""
        case "$shape" in qwen3-30b-a3b|gpt-oss-20b|qwen3.6-35b-a3b) [ "$quick" = 1 ] || layers=12 ;; esac
        local model="$work/$shape.gguf"
        say ""
        say "== $shape (q4_k${layers:+, $layers layers})"
        if ! run "$p/torus-wgpu" synth-model --shape "$shape" --format q4_k $tiny ${layers:+--layers "$layers"} --out "$model"; then
            say "FAIL: $shape: synth-model"
            continue
        fi
        # llama-bench: one JSON array per run; -r 3 repetitions, its mean and deviation.
        for fa in 0 1; do
            if run "$p/llama-bench" -m "$model" -p "$pp" -n "$tg" -fa "$fa" -ngl 99 -r 3 -o json >"$work/llama.json"; then
                # Without a Vulkan device llama.cpp runs on the CPU: not the comparison asked for.
                grep -q '"gpu_info": "[^"]' "$work/llama.json" ||
                    say "FAIL: $shape: llama.cpp found no Vulkan device and ran on the CPU ($(grep -m1 ggml_vulkan "$log"))"
                printf '{"shape":"%s","engine":"llama.cpp","fa":%s,"report":%s}\n' "$shape" "$fa" \
                    "$(tr -d '\n' <"$work/llama.json")" >>"$reports"
            else
                say "FAIL: $shape: llama-bench -fa $fa ($(tail -n 1 "$log"))"
            fi
        done
        echo "+ torus-wgpu bench-model $model" >>"$log"
        if "$p/torus-wgpu" bench-model --model "$model" --kernel-profile gpu --batches "$batches" \
            --decode-steps "$steps" --warmup-steps 2 --prefill-tokens "$pp" ${peak:+--peak-gb-s "$peak"} \
            --json "$work/torus.json" >"$work/bench.out" 2>&1; then
            cat "$work/bench.out" >>"$log"
            grep -E '^(batch [0-9]+:|prefill:)' "$work/bench.out" | tee -a "$summary"
            printf '{"shape":"%s","engine":"torus-wgpu","report":%s}\n' "$shape" "$(tr -d '\n' <"$work/torus.json")" >>"$reports"
        else
            cat "$work/bench.out" >>"$log"
            say "FAIL: $shape: bench-model ($(tail -n 1 "$work/bench.out"))"
        fi
        case ",$tune_shapes,$serve_shapes," in *",$shape,"*) tune_shape "$shape" "$model" ;; esac
        case ",$serve_shapes," in
            *",$shape,"*) serving "$shape" "$model" ;;
            *) case ",$tune_shapes," in *",$shape,"*) tuned_bench "$shape" "$model" ;; esac ;;
        esac
        rm -f "$model"
    done
    cp "$reports" "$out/reports.jsonl"
    if command -v python3 >/dev/null; then
        python3 scripts/side-by-side-table.py "$reports" "$out/side-by-side.json" | tee -a "$summary"
    else
        say "no python3 here: the reports are in $out/reports.jsonl (scripts/side-by-side-table.py makes the table)"
    fi
}

case "$cmd" in
    pack) do_pack ;;
    run) do_run ;;
    *) sed -n 2,32p "$0"; exit 2 ;;
esac
