#!/usr/bin/env python3
"""The GPU compiler report's table, from the logs scripts/gpu-compiler-report.sh writes: each
log is one run of the binary on RADV's null device (file name TARGET-WORKLOAD.log) with
TORUS_PRINT_PIPELINES=1 and RADV_DEBUG=shaderstats,asm, so each pipeline's label is followed by
its machine code and its statistics.

  scripts/gpu-compiler-report.py LOG... [--json FILE]

Prints a Markdown table per target: every kernel (a label built with different sources in
different workloads, e.g. attention at head size 128 and 256, appears once per distinct result,
with the workload after '@'), its VGPRs (and before scheduling), spilled VGPRs and SGPRs,
scratch bytes, LDS bytes, waves per SIMD, code bytes, VALU and VMEM instructions, and for the
decode matmuls (matmul_gpu_*) the vector instructions per weight read in the loop over K: the
VALU instructions of the loop that holds the most memory loads, over the weights one invocation
reads per iteration (one token, rows of 48 blocks or more: 4 rows x one 32-weight block; 2-16
tokens: one row's block, used for every token). The standard library only.
"""
import json
import os
import re
import sys

STATS = {
    "VGPRs": "vgprs",
    "Pre-Sched VGPRs": "presched_vgprs",
    "Spilled VGPRs": "spill_v",
    "Spilled SGPRs": "spill_s",
    "Scratch size": "scratch",
    "LDS size": "lds",
    "Subgroups per SIMD": "waves",
    "Code size": "code",
    "VALU": "valu",
    "VMEM": "vmem",
}
BRANCH = re.compile(r"^\s*s_c?branch\w*\s+(BB\d+)")
LABEL = re.compile(r"^(BB\d+):")


def inner_loop(asm):
    """(VALU, VMEM) of the loop with the most memory loads in `asm` (lines), None without a loop."""
    blocks, order = [], {}
    for line in asm:
        m = LABEL.match(line)
        if m:
            order[m.group(1)] = len(blocks)
            blocks.append([])
        elif blocks:
            blocks[-1].append(line.strip())
    best = None
    for i, body in enumerate(blocks):
        for ins in body:
            m = BRANCH.match(ins)
            if not m or order.get(m.group(1), i + 1) > i:
                continue
            loop = [x for b in blocks[order[m.group(1)]:i + 1] for x in b]
            valu = sum(1 for x in loop if x.startswith("v_"))
            vmem = sum(1 for x in loop if re.match(r"(buffer|global)_load", x))
            key = (vmem, -len(loop))
            if best is None or key > best[0]:
                best = (key, valu, vmem)
    return None if best is None else (best[1], best[2])


def parse(path):
    """Every pipeline of one log: (label, stats dict)."""
    out, label, asm, stats = [], None, [], None
    with open(path, errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            if line.startswith("torus-wgpu pipeline: "):
                label, asm, stats = line.split(": ", 1)[1], [], None
            elif line.startswith("*** SHADER STATS ***"):
                stats = {}
            elif stats is not None and line.startswith("****"):
                if label is not None:
                    loop = inner_loop(asm)
                    if loop:
                        stats["loop_valu"], stats["loop_vmem"] = loop
                    out.append((label, stats))
                label, asm, stats = None, [], None
            elif stats is not None:
                k, _, v = line.partition(": ")
                if k in STATS:
                    stats[STATS[k]] = int(v)
            elif label is not None:
                asm.append(line)
    return out


def main():
    args = sys.argv[1:]
    json_out = None
    if "--json" in args:
        i = args.index("--json")
        json_out = args[i + 1]
        del args[i:i + 2]
    # target -> label -> [(figures, first workload)], one entry per distinct result
    variants = {}
    for path in args:
        name = os.path.basename(path)[:-4]
        target, _, workload = name.partition("-")
        labels = variants.setdefault(target, {})
        for label, figures in parse(path):
            seen = labels.setdefault(label, [])
            if not any(f == figures for f, _ in seen):
                seen.append((figures, workload))
    by_target = {}
    for target, labels in variants.items():
        rows = by_target.setdefault(target, {})
        for label, seen in labels.items():
            for figures, workload in seen:
                key = label if len(seen) == 1 else f"{label}@{workload}"
                rows[key] = {"figures": figures}
    if json_out:
        with open(json_out, "w") as f:
            json.dump({t: {k: r["figures"] for k, r in rows.items()} for t, rows in by_target.items()}, f, indent=1)
    for target, rows in by_target.items():
        spilling = sum(1 for r in rows.values() if r["figures"].get("spill_v", 0) or r["figures"].get("scratch", 0))
        print(f"### {target}: {len(rows)} pipelines, {spilling} spilling or using scratch\n")
        print("| kernel | VGPRs (pre-sched) | spilled V/S | scratch | LDS | waves/SIMD | code B | VALU | VMEM | VALU per weight read (K loop) |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for key in sorted(rows):
            s = rows[key]["figures"]
            per_weight = ""
            m = re.match(r"matmul_gpu_\w+?_(\d+)_(true|false)", key)
            if m and "loop_valu" in s:
                weights = 128 if m.group(1) == "1" else 32
                per_weight = f"{s['loop_valu'] / weights:.2f}"
            print(
                f"| {key} | {s.get('vgprs', '')} ({s.get('presched_vgprs', '')}) | {s.get('spill_v', '')}/{s.get('spill_s', '')} "
                f"| {s.get('scratch', '')} | {s.get('lds', '')} | {s.get('waves', '')} | {s.get('code', '')} "
                f"| {s.get('valu', '')} | {s.get('vmem', '')} | {per_weight} |"
            )
        print()


if __name__ == "__main__":
    main()
