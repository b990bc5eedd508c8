#!/usr/bin/env python3
"""llama.cpp peer of the engine (llama-cpp-python from PyPI, on the same GGUF file).

Two jobs:

- `top1 --tokens T.json [--ours A.json]`: evaluates the token ids in T.json (a JSON list, the
  engine's own tokenization) in one pass with every position's logits, and prints llama.cpp's
  perplexity over them. With the engine's arg-max file (`hsa eval --argmax-out A.json`: a JSON
  object {"start": s, "argmax": [...]}, the engine's prediction after each position s, s+1, ...)
  it prints the share of positions where both predict the same next token. Where the file also
  holds "like_llama_cpp" (the engine's model rounding as llama.cpp's CPU backend does), it
  prints that trace's agreement and how many of its largest logits equal llama.cpp's bit for
  bit. With `--configs`,
  it also evaluates the tokens under other llama.cpp settings that should not change the model
  (flash attention on, an f32 KV cache, one token per forward) and prints how often each pair of
  llama.cpp settings, and the engine against each, agree: llama.cpp's own floor of agreement.
- `decode --context N [N ...]`: dense decode speed: a prompt of N tokens, then 64 generated
  tokens (greedy), timed; prints tokens/s of the generation.

Every result is also one JSON line on stdout, prefixed "RESULT ".
"""
import argparse
import json
import os
import time

import numpy as np
from llama_cpp import Llama


def load(path, n_ctx, logits_all=False, **settings):
    kw = {"n_batch": 512, **settings}
    return Llama(
        model_path=path,
        n_ctx=n_ctx,
        n_threads=os.cpu_count(),
        logits_all=logits_all,
        verbose=False,
        **kw,
    )


# llama.cpp settings that leave the model unchanged; `default` is what `top1` compares to.
CONFIGS = {
    "default": {},
    "flash_attn": {"flash_attn": True},
    "f32_kv": {"type_k": 0, "type_v": 0},
    "one_by_one": {"n_batch": 1},
}


def last_argmax(llm):
    """Arg-max of the last evaluated token's logits. Without logits_all, llama-cpp-python 0.3
    keeps no scores, so they are read from the context."""
    logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
    return int(np.argmax(logits))


def top1(args):
    tokens = json.load(open(args.tokens))
    names = list(CONFIGS) if args.configs else ["default"]
    argmax = {}
    for name in names:
        llm = load(args.model, len(tokens) + 16, logits_all=True, **CONFIGS[name])
        llm.eval(tokens)
        logits = np.asarray(llm.scores[: len(tokens)], dtype=np.float64)
        argmax[name] = logits.argmax(axis=1)
        if name == "default":
            top_logit = np.asarray(llm.scores[: len(tokens)], dtype=np.float32).max(axis=1)
            m = logits.max(axis=1, keepdims=True)
            lse = m[:, 0] + np.log(np.exp(logits - m).sum(axis=1))
            nll = lse[:-1] - logits[np.arange(len(tokens) - 1), tokens[1:]]
            ppl = float(np.exp(nll.mean()))
        del llm
    result = {"job": "top1", "tokens": len(tokens), "llama_cpp_ppl": ppl}
    if args.ours:
        ours = json.load(open(args.ours))
        start, pred = ours["start"], np.asarray(ours["argmax"])
        argmax = {k: v[start : start + len(pred)] for k, v in argmax.items()}
        argmax["ours"] = pred
        same = int((argmax["default"] == pred).sum())
        result.update({"positions": len(pred), "agree": same, "top1_agreement": same / len(pred)})
        like = ours.get("like_llama_cpp")
        if like:
            # The engine's forward rounding as llama.cpp does: every largest logit should be
            # llama.cpp's own, bit for bit.
            lp = np.asarray(like["argmax"])
            argmax["ours_ggml"] = lp
            top = top_logit[start : start + len(lp)]
            exact = int((np.asarray(like["top_logit"], dtype=np.float32) == top).sum())
            result.update({
                "agree_like_llama_cpp": int((argmax["default"] == lp).sum()),
                "top1_agreement_like_llama_cpp": float((argmax["default"] == lp).mean()),
                "identical_top_logits_like_llama_cpp": exact,
            })
    if args.configs:
        keys = list(argmax)
        result["pairwise"] = {a: {b: float((argmax[a] == argmax[b]).mean()) for b in keys} for a in keys}
        print("top-1 agreement between llama.cpp settings" + (" and the engine" if args.ours else ""))
        print("%-11s" % "" + "".join("%11s" % k for k in keys))
        for a in keys:
            print("%-11s" % a + "".join("%11.4f" % result["pairwise"][a][b] for b in keys))
    print("RESULT " + json.dumps(result), flush=True)


def decode(args):
    gen = 64
    for n in args.context:
        llm = load(args.model, n + gen + 16)
        rng = np.random.default_rng(7)
        prompt = [int(t) for t in rng.integers(100, llm.n_vocab(), size=n)]
        llm.eval(prompt)
        t0 = time.perf_counter()
        tok = last_argmax(llm)
        for _ in range(gen):
            llm.eval([tok])
            tok = last_argmax(llm)
        dt = time.perf_counter() - t0
        print("RESULT " + json.dumps({"job": "decode", "context": n, "tokens_per_s": gen / dt}), flush=True)
        del llm


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    sub = p.add_subparsers(dest="job", required=True)
    t = sub.add_parser("top1")
    t.add_argument("--tokens", required=True)
    t.add_argument("--ours")
    t.add_argument("--configs", action="store_true", help="also run llama.cpp under other settings")
    d = sub.add_parser("decode")
    d.add_argument("--context", type=int, nargs="+", required=True)
    args = p.parse_args()
    {"top1": top1, "decode": decode}[args.job](args)


if __name__ == "__main__":
    main()
