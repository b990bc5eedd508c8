#!/usr/bin/env python3
"""CPU decode speed at long context: the engine dense and sparse, and llama.cpp dense, in one run.

For each context C (default 4096 and 8000) it runs `hsa eval` on a real text (GPL-3 + GFDL-1.3 +
LGPL-2.1 as shipped by Debian, about 14K tokens, cut to C + 64): one dense prefill of C tokens,
then 64 teacher-forced decode steps for dense and each sparse variant (Quest 1024 with every
layer sparse; Quest 1024 with layers 0 and 1 dense), each variant timed on its own. Then the
llama.cpp peer (bench/peers/llamacpp_peer.py, llama-cpp-python on the same GGUF, all cores)
decodes 64 tokens after a C-token prompt. It prints one table with tokens/s and the ratios to
llama.cpp, and writes it as JSON to target/bench-report/cpu_decode.json.

Usage: python3 bench/cpu_decode.py [--contexts 4096 8000] [--python PYTHON]
(PYTHON runs the peer; default: target/peer-venv/bin/python if present, else python3.)
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
TEXTS = [f"/usr/share/common-licenses/{n}" for n in ("GPL-3", "GFDL-1.3", "LGPL-2.1")]
DECODE = 64
CONFIG = """
[variants.quest-1024]
algo = { algorithm = "quest", budget_tokens = 1024, shared_heads = true }
min_prompt_tokens = 1

[variants.quest-1024-2dense]
algo = { algorithm = "quest", budget_tokens = 1024, shared_heads = true }
min_prompt_tokens = 1
dense_layers = [0, 1]
"""


def engine(hsa, ctx, out):
    cfg = os.path.join(out, "cpu_decode.toml")
    with open(cfg, "w") as f:
        f.write(CONFIG)
    js = os.path.join(out, f"cpu_decode_{ctx}.json")
    cmd = [hsa, "--config", cfg, "--model", MODEL, "eval", "--no-recall", "--tokens",
           str(ctx + DECODE + 1), "--prefill", str(ctx), "--json", js]
    for t in TEXTS:
        cmd += ["--text", t]
    subprocess.run(cmd, check=True)
    with open(js) as f:
        return {v["name"]: v["tokens_per_s"] for v in json.load(f)["variants"]}


def peer(python, contexts):
    script = os.path.join(ROOT, "bench", "peers", "llamacpp_peer.py")
    cmd = [python, script, "--model", MODEL, "decode", "--context"] + [str(c) for c in contexts]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        return {}, str(e)
    found = {}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            found[r["context"]] = r["tokens_per_s"]
    return found, (p.stderr.strip().splitlines() or ["no output"])[-1] if p.returncode else ""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 8000])
    venv = os.path.join(ROOT, "target", "peer-venv", "bin", "python")
    ap.add_argument("--python", default=venv if os.path.exists(venv) else "python3")
    args = ap.parse_args()
    if not os.path.exists(MODEL):
        sys.exit(f"no model at {MODEL}: run `cargo xtask fetch-model`")
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "engine", "--bin", "hsa"],
                   check=True, cwd=ROOT)
    hsa = os.path.join(ROOT, "target", "release", "hsa")
    out = os.path.join(ROOT, "target", "bench-report")
    os.makedirs(out, exist_ok=True)
    rows = {c: engine(hsa, c, out) for c in args.contexts}
    theirs, why = peer(args.python, args.contexts)
    names = list(next(iter(rows.values())).keys())
    head = f"{'context':>8} {'llama.cpp':>10} " + " ".join(f"{n:>22}" for n in names)
    print("\nCPU decode tokens/s (ratio to llama.cpp dense), 64 steps after the context; "
          f"{os.cpu_count()} cores")
    print(head)
    for c, r in rows.items():
        base = theirs.get(c)
        cells = []
        for n in names:
            ratio = f" ({r[n] / base:.2f}x)" if base else ""
            cells.append(f"{r[n]:>10.1f}{ratio:<9}".rjust(22))
        print(f"{c:>8} {base if base is None else round(base, 1)!s:>10} " + " ".join(cells))
    if why:
        print(f"llama.cpp peer did not run: {why}")
    with open(os.path.join(out, "cpu_decode.json"), "w") as f:
        json.dump({"cores": os.cpu_count(), "decode_steps": DECODE, "engine": rows,
                   "llama_cpp": theirs}, f, indent=1)


if __name__ == "__main__":
    main()
