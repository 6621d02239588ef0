#!/usr/bin/env python3
"""The table of scripts/gpu-side-by-side.sh: torus-wgpu against llama.cpp on the same files.

Usage: side-by-side-table.py REPORTS.jsonl OUT.json
REPORTS.jsonl: one line per run, {"shape", "engine": "llama.cpp", "fa", "report": llama-bench's
JSON array} or {"shape", "engine": "torus-wgpu", "report": bench-model's JSON} (with "variant":
"tuned" (the tuner's plan) or "coop"), {"shape", "engine": "torus-wgpu-tune", "report": the
tuner's JSON} (not tabled), {"shape", "engine": "llama.cpp-batched", "report": one
llama-batched-bench jsonl row}, {"shape", "engine": "torus-wgpu-serve", "concurrency",
"report": `torus-wgpu bench`'s summary}. Prints a markdown table per shape (tok/s and ratios),
then the batched and serving table, and writes OUT.json with every report and the ratios.
Ratios are torus-wgpu / llama.cpp: decode at batch 1 against tg (llama-bench's best of flash
attention off and on), prefill against pp, batched decode against llama-batched-bench's S_TG
(best of flash attention off and on) at the same number of sequences.
"""
import json
import sys


def llama_rates(runs):
    """(best tg tok/s, best pp tok/s, per-fa detail) of a shape's llama-bench runs."""
    tg, pp, detail = None, None, []
    for r in runs:
        for row in r["report"]:
            ts = row.get("avg_ts")
            if ts is None:
                continue
            kind = "tg" if row.get("n_gen", 0) > 0 else "pp"
            n = row.get("n_gen") if kind == "tg" else row.get("n_prompt")
            detail.append({"test": f"{kind}{n}", "fa": r["fa"], "tok_s": ts, "stddev": row.get("stddev_ts")})
            if kind == "tg":
                tg = max(tg or 0.0, ts)
            else:
                pp = max(pp or 0.0, ts)
    return tg, pp, detail


def ratio(a, b):
    return round(a / b, 3) if a and b else None


def batched_table(lines, shapes, out):
    """Issue 49's table: batched decode per matmul variant beside llama-batched-bench, prefill per
    variant, and serving throughput per concurrency."""
    rows = []
    for s in shapes:
        runs = [x for x in lines if x["shape"] == s]
        if not any(x["engine"] in ("llama.cpp-batched", "torus-wgpu-serve") or x.get("variant") for x in runs):
            continue
        llama = {}
        for x in runs:
            if x["engine"] == "llama.cpp-batched":
                r = x["report"]
                llama[r["pl"]] = max(llama.get(r["pl"], 0.0), r["speed_tg"])
        variants = {}
        for x in runs:
            if x["engine"] == "torus-wgpu":
                rep = x["report"]
                variants[x.get("variant") or "default"] = (
                    {d["batch"]: d["tok_s"] for d in rep.get("decode", [])},
                    (rep.get("prefill") or {}).get("tok_s"),
                )
        serve = {x["concurrency"]: (x["report"] or {}).get("output_throughput") for x in runs
                 if x["engine"] == "torus-wgpu-serve"}
        base = variants.get("default", ({}, None))[0]
        row = {"shape": s, "llama_batched_tg": llama, "variants": variants, "serve_output_tok_s": serve,
               "b32_over_b1": ratio(base.get(32), base.get(1)),
               "b32_over_llama": ratio(max((v[0].get(32) or 0 for v in variants.values()), default=None), llama.get(32))}
        rows.append(row)
    if not rows:
        return
    out["batched"] = rows
    f = lambda v: "-" if v is None else f"{v:.1f}"
    print()
    print("| shape | variant | b8 | b32 | llama.cpp batched 8 | llama.cpp batched 32 | prefill |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        for name, (dec, pre) in r["variants"].items():
            print(f"| {r['shape']} | {name} | {f(dec.get(8))} | {f(dec.get(32))} | {f(r['llama_batched_tg'].get(8))} | "
                  f"{f(r['llama_batched_tg'].get(32))} | {f(pre)} |")
    print()
    print("| shape | serve c=1 | c=8 | c=32 (output tok/s) | b32 / b1 | best b32 / llama.cpp 32 |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        sv = r["serve_output_tok_s"]
        print(f"| {r['shape']} | {f(sv.get(1))} | {f(sv.get(8))} | {f(sv.get(32))} | {r['b32_over_b1']} | {r['b32_over_llama']} |")


def main():
    lines = [json.loads(x) for x in open(sys.argv[1]) if x.strip()]
    shapes = []
    for x in lines:
        if x["shape"] not in shapes:
            shapes.append(x["shape"])
    out = {"runs": lines, "shapes": []}
    print()
    print("| shape | llama.cpp tg (best fa) | torus b1 | ratio | torus b8 | torus b32 | llama.cpp pp | torus prefill | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for s in shapes:
        runs = [x for x in lines if x["shape"] == s]
        tg, pp, detail = llama_rates([x for x in runs if x["engine"] == "llama.cpp"])
        torus = next((x["report"] for x in runs if x["engine"] == "torus-wgpu" and not x.get("variant")), None)
        dec = {d["batch"]: d["tok_s"] for d in (torus or {}).get("decode", [])}
        pre = ((torus or {}).get("prefill") or {}).get("tok_s")
        row = {
            "shape": s,
            "llama_tg": tg,
            "llama_pp": pp,
            "llama_runs": detail,
            "torus_decode": dec,
            "torus_prefill": pre,
            "decode_b1_ratio": ratio(dec.get(1), tg),
            "prefill_ratio": ratio(pre, pp),
            "adapter": (torus or {}).get("adapter", {}).get("name"),
            "llama_device": next((row.get("gpu_info") for x in runs if x["engine"] == "llama.cpp" for row in x["report"]), None),
        }
        out["shapes"].append(row)
        f = lambda v: "-" if v is None else f"{v:.1f}"
        r = lambda v: "-" if v is None else f"{v:.2f}x"
        print(f"| {s} | {f(tg)} | {f(dec.get(1))} | {r(row['decode_b1_ratio'])} | {f(dec.get(8))} | "
              f"{f(dec.get(32))} | {f(pp)} | {f(pre)} | {r(row['prefill_ratio'])} |")
    batched_table(lines, shapes, out)
    devices = {(r["adapter"], r["llama_device"]) for r in out["shapes"]}
    for a, l in devices:
        print(f"\ntorus-wgpu on {a!r}; llama.cpp on {l!r}")
    json.dump(out, open(sys.argv[2], "w"), indent=1)
    print(f"\nwrote {sys.argv[2]}")


if __name__ == "__main__":
    main()
