#!/usr/bin/env python3
"""torus-wgpu against llama.cpp on tiny F32 variants of the synthetic shapes (issue 47).

Run through scripts/llama-compare.sh, which builds llama-cpp-python (llama.cpp's CPU backend)
from its sdist into a virtual environment and runs this with it.

    scripts/llama-compare.sh [--format f32] [--tokens 16] [--prompts 3] [--kernel-profile cpu] [SHAPE ...]
    scripts/llama-compare.sh --format q8_0 --kernel-profile gpu --decode --int8 both [SHAPE ...]
                                                   (torus-wgpu decoding token by token, on f32 and on
                                                    int8 activations: a row each)
    scripts/llama-compare.sh --model FILE.gguf     (any GGUF file both engines load; JSON out)
    scripts/llama-compare.sh --fixtures            (llama.cpp against tests/fixtures' transformers
                                                    references; torus-wgpu's own test suite checks
                                                    torus-wgpu against them)

For each shape (default: all that `synth-model` knows): `torus-wgpu synth-model --tiny --format F` writes the file;
llama.cpp loads it (its loader is the judge of the file format), evaluates a fixed prompt of
random ids and continues it greedily; torus-wgpu (`serve`, /v1/completions with the same ids,
`echo` and `logprobs`) scores the same sequence. Over the continuation's positions the table
gives how often torus-wgpu's top token is llama.cpp's greedy one, the median and largest
|difference| of the two engines' log-probabilities of that token, and llama.cpp's smallest
margin (top-1 minus top-2) where the top tokens differ; "llama.cpp batch vs token" is how far
llama.cpp's log-probabilities of the same sequence move between one batch and token by token
(its own noise). Both engines keep the KV cache in f32.

LLAMA_CPP_LIB_PATH (llama-cpp-python's own variable) points it at another build of llama.cpp's
libraries: BENCHMARKS.md's issue-47 section uses one built without GGML_GELU_FP16.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np
from llama_cpp import Llama

BIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "target", "release", "torus-wgpu")


def known_shapes():
    """The synthetic shapes, as the binary lists them (`synth-model` names them on a bad one)."""
    r = subprocess.run([BIN, "synth-model", "--shape", "?", "--out", os.devnull], capture_output=True, text=True)
    known = r.stderr.split("known: ", 1)[-1].split(")", 1)[0]
    return [x.strip() for x in known.split(",") if x.strip()]


def log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def llama_run(path, prompt, n_new):
    """llama.cpp: the greedy continuation of `prompt`, and per continuation position its
    log-probabilities (of the whole vocabulary)."""
    llm = Llama(
        model_path=path,
        n_ctx=256,
        n_batch=256,
        n_ubatch=256,
        logits_all=True,
        n_threads=os.cpu_count() or 2,
        type_k=0,  # GGML_TYPE_F32
        type_v=0,
        flash_attn=False,
        verbose=False,
    )
    llm.eval(prompt)
    ids = list(prompt)
    rows = []
    for _ in range(n_new):
        lp = log_softmax(llm.scores[llm.n_tokens - 1])
        rows.append(lp)
        tok = int(lp.argmax())
        ids.append(tok)
        llm.eval([tok])
    # Score the whole sequence in one batch too: the positions' log-probabilities as a batch
    # (what torus-wgpu's echo computes) rather than token by token.
    llm.reset()
    llm.eval(ids)
    batch = [log_softmax(llm.scores[len(prompt) - 1 + i]) for i in range(n_new)]
    del llm
    return ids, rows, batch


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Torus:
    def __init__(self, path, profile, int8=None):
        self.port = free_port()
        self.log = tempfile.TemporaryFile()
        env = dict(os.environ)
        if int8 is not None:
            env["TORUS_INT8"] = int8
        self.proc = subprocess.Popen(
            [BIN, "serve", "--model", path, "--port", str(self.port), "--kv-cache-dtype", "f32",
             "--kernel-profile", profile, "--enable-prefix-cache", "false", "--max-sequence-length", "256",
             "--no-webui"],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.time() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2).read()
                return
            except Exception:
                if self.proc.poll() is not None or time.time() > deadline:
                    self.log.seek(0)
                    sys.exit(f"torus-wgpu serve did not start:\n{self.log.read().decode(errors='replace')[-3000:]}")
                time.sleep(0.5)

    def score(self, ids):
        """Per position from the second: (log-probability of the token there, the top one's)."""
        body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}
        r = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        v = json.loads(urllib.request.urlopen(r, timeout=600).read())
        lp = v["choices"][0]["logprobs"]
        n = len(ids)
        own = lp["token_logprobs"][1:n]
        top = [max(d.values()) for d in lp["top_logprobs"][1:n]]
        return own, top

    def decode(self, prompt, n_new, n_probs=20):
        """Greedy decoding of `prompt` one token per step (llama-server's /completion, whose
        entries carry token ids): per generated token (its id, {id: log-probability} of the top
        `n_probs`)."""
        body = {"prompt": prompt, "n_predict": n_new, "temperature": 0, "n_probs": n_probs,
                "ignore_eos": True, "cache_prompt": False}
        r = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        v = json.loads(urllib.request.urlopen(r, timeout=600).read())
        return [(e["id"], {t["id"]: t["logprob"] for t in e["top_logprobs"]}) for e in v["completion_probabilities"]]

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


def compare(shape, fmt, prompts, n_prompt, n_new, profile, work, path=None, decode=False, int8=None):
    if path is None:
        path = os.path.join(work, f"{shape}-{fmt}.gguf")
        if not os.path.exists(path):
            subprocess.run([BIN, "synth-model", "--tiny", "--shape", shape, "--format", fmt, "--seed", "1",
                            "--out", path], check=True, capture_output=True)
    vocab = Llama(model_path=path, vocab_only=True, verbose=False).n_vocab()
    diffs, agree, total, margins, batch_diffs, torus_batch = [], 0, 0, [], [], []
    torus = Torus(path, profile, int8)
    try:
        for p in range(prompts):
            rng = np.random.default_rng(1000 + p)
            # Not the last ids: the synthetic and fixture tokenizers keep their special tokens there.
            prompt = [int(x) for x in rng.integers(0, vocab - 3, n_prompt)]
            ids, rows, batch = llama_run(path, prompt, n_new)
            if decode:
                # Both engines token by token: the positions up to and including the first where
                # torus-wgpu's greedy token differs (after it the two sequences differ). Positions
                # where llama.cpp's token is not in torus-wgpu's top 20 count as disagreement only.
                for i, (tok, top) in enumerate(torus.decode(prompt, n_new)):
                    want = ids[n_prompt + i]
                    total += 1
                    if want in top:
                        diffs.append(abs(top[want] - rows[i][want]))
                        batch_diffs.append(abs(batch[i][want] - rows[i][want]))
                        torus_batch.append(abs(top[want] - batch[i][want]))
                    if tok == want:
                        agree += 1
                        continue
                    srt = np.sort(rows[i])
                    margins.append(srt[-1] - srt[-2])
                    break
                continue
            own, top = torus.score(ids)
            for i in range(n_new):
                at = n_prompt + i  # the token at `at`, predicted from position at - 1
                tok = ids[at]
                t_lp, t_top = own[at - 1], top[at - 1]
                l_lp = rows[i][tok]
                diffs.append(abs(t_lp - l_lp))
                batch_diffs.append(abs(batch[i][tok] - l_lp))
                torus_batch.append(abs(t_lp - batch[i][tok]))
                total += 1
                if t_top - t_lp < 1e-6:
                    agree += 1
                else:
                    srt = np.sort(rows[i])
                    margins.append(srt[-1] - srt[-2])
    finally:
        torus.close()
    return {
        "shape": shape,
        "agree": agree,
        "total": total,
        "median": float(np.median(diffs)),
        "max": float(np.max(diffs)),
        "llama_batch_max": float(np.max(batch_diffs)),
        "torus_vs_batch_max": float(np.max(torus_batch)),
        "margin": float(min(margins)) if margins else None,
    }


def fixtures(root):
    """llama.cpp against transformers on the suite's tiny fixtures: every tests/fixtures/*-reference.json
    with a GGUF conversion. Per fixture: the largest |logit difference| at each prompt's last
    position (transformers' float32 logits are in the reference), and how many of transformers'
    greedy tokens llama.cpp's greedy continuation repeats."""
    print("| fixture (transformers float32 reference) | prompts | max abs dlogit, last position | greedy tokens equal |")
    print("|---|---|---|---|")
    pairs = []  # (GGUF file, its transformers reference)
    for name in sorted(os.listdir(root)):
        if name.endswith("-reference.json"):
            ref = json.load(open(os.path.join(root, name)))
            g = ref.get("gguf") if isinstance(ref.get("gguf"), dict) else {}
            # One file, or several (the first is the model's own conversion, the others controls).
            g = g.get("file") or next(iter(g.get("files", {})), None)
            if g:
                pairs.append((g, ref))
        elif name.endswith("-gguf.json"):  # a conversion described beside its reference
            d = json.load(open(os.path.join(root, name)))
            pairs.append((d["file"], json.load(open(os.path.join(root, os.path.basename(d["reference"]))))))
    for g, ref in pairs:
        if not os.path.exists(os.path.join(root, g)):
            continue
        try:
            llm = Llama(model_path=os.path.join(root, g), n_ctx=512, n_batch=512, n_ubatch=512, logits_all=True,
                        type_k=0, type_v=0, flash_attn=False, verbose=False, n_threads=os.cpu_count() or 2)
        except Exception as e:  # the loader is the judge of the format: say so, go on
            print(f"| {g} | - | llama.cpp refuses: {e} | - |")
            continue
        worst, same, total, n = 0.0, 0, 0, 0
        for p in ref["prompts"]:
            if "last_position_logits_full" not in p or not p.get("input_ids"):
                continue  # (the MTP fixtures' references are of the draft head)
            n += 1
            llm.reset()
            llm.eval(p["input_ids"])
            got = np.asarray(llm.scores[len(p["input_ids"]) - 1], dtype=np.float64)
            worst = max(worst, float(np.abs(got - np.asarray(p["last_position_logits_full"])).max()))
            want = p.get("greedy_ids", [])
            for t in want:
                nxt = int(np.asarray(llm.scores[llm.n_tokens - 1]).argmax())
                if nxt != t:
                    break
                same += 1
                llm.eval([t])
            total += len(want)
        del llm
        if n == 0:
            continue
        print(f"| {g} | {n} | {worst:.2e} | {same}/{total} |", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="*")
    ap.add_argument("--format", default="f32")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--kernel-profile", default="cpu")
    ap.add_argument("--model", help="compare this GGUF file instead of the shapes")
    ap.add_argument("--fixtures", action="store_true",
                    help="compare llama.cpp with the transformers references of tests/fixtures instead")
    ap.add_argument("--decode", action="store_true",
                    help="torus-wgpu decodes token by token (one-token matmuls) instead of scoring the "
                         "sequence as one prefill")
    ap.add_argument("--int8", choices=["0", "1", "both"],
                    help="TORUS_INT8 for torus-wgpu (the gpu profile's int8 activations); both: a row each")
    ap.add_argument("--setup-only", action="store_true")
    a = ap.parse_args()
    if a.setup_only:
        print("llama-cpp-python is installed")
        return
    if a.fixtures:
        fixtures(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures"))
        return
    if a.model:
        r = compare(os.path.basename(a.model), None, a.prompts, a.prompt_tokens, a.tokens, a.kernel_profile, None, a.model)
        print(json.dumps(r))
        return
    shapes = known_shapes()
    if len(shapes) < 2:
        sys.exit(f"{BIN} did not list its synthetic shapes")
    a.shapes = a.shapes or shapes
    bad = [s for s in a.shapes if s not in shapes]
    if bad:
        sys.exit(f"unknown shape(s) {bad} (known: {', '.join(shapes)})")
    how = "decodes token by token" if a.decode else "scores the sequence as one prefill"
    print(f"tiny variants, {a.format}, {a.prompts} prompts of {a.prompt_tokens} random ids + {a.tokens} "
          f"greedy tokens of llama.cpp; torus-wgpu kernel profile {a.kernel_profile}, {how}")
    print("| shape | TORUS_INT8 | top-1 agree | median abs dlogprob | max abs dlogprob | "
          "llama.cpp batch vs token max | llama.cpp margin where top-1 differs |")
    print("|---|---|---|---|---|---|---|")
    settings = ["0", "1"] if a.int8 == "both" else [a.int8]
    with tempfile.TemporaryDirectory() as work:
        for s in a.shapes:
            for x in settings:
                r = compare(s, a.format, a.prompts, a.prompt_tokens, a.tokens, a.kernel_profile, work,
                            decode=a.decode, int8=x)
                m = "-" if r["margin"] is None else f"{r['margin']:.4f}"
                print(f"| {s} | {x or 'default'} | {r['agree']}/{r['total']} | {r['median']:.2e} | "
                      f"{r['max']:.2e} | {r['llama_batch_max']:.2e} | {m} |", flush=True)


if __name__ == "__main__":
    main()
