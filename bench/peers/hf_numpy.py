#!/usr/bin/env python3
"""Hugging Face Llama forward in numpy: an independent peer for the engine's safetensors loader.

It reads a Hugging Face checkpoint directory (config.json, model.safetensors; parsed here with
numpy alone) and runs the forward of transformers' LlamaForCausalLM in float32, with RoPE on
the two halves of each head (`rotate_half`), the convention the engine converts from when it
loads such a checkpoint. Over the token ids in T.json it prints the perplexity and, given the
engine's arg-max file (`hsa --model DIR eval --argmax-out A.json`), the share of positions
where both predict the same next token. A wrong RoPE pairing shows at once: perplexity in the
hundreds and little agreement.

    python3 bench/peers/hf_numpy.py --model DIR --tokens T.json [--ours A.json] [--n 128]

The result is one JSON line on stdout, prefixed "RESULT ".
"""
import argparse
import json
import os
import struct

import numpy as np


def load_safetensors(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        s, e = info["data_offsets"]
        raw = data[s:e]
        if info["dtype"] == "F32":
            a = np.frombuffer(raw, dtype="<f4")
        elif info["dtype"] == "F16":
            a = np.frombuffer(raw, dtype="<f2").astype(np.float32)
        elif info["dtype"] == "BF16":
            a = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            raise SystemExit(f"{name}: dtype {info['dtype']} not handled")
        out[name] = a.reshape(info["shape"])
    return out


def rms_norm(x, w, eps):
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w


def rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def forward(cfg, w, tokens):
    n = len(tokens)
    d_model = cfg["hidden_size"]
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads", nh)
    hd = cfg.get("head_dim", d_model // nh)
    eps = cfg.get("rms_norm_eps", 1e-6)
    theta = cfg.get("rope_theta", 10000.0)
    inv = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = np.outer(np.arange(n, dtype=np.float64), inv)
    emb = np.concatenate([ang, ang], axis=-1)
    cos, sin = np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)
    x = w["model.embed_tokens.weight"][tokens]
    mask = np.triu(np.full((n, n), -np.inf, dtype=np.float32), 1)
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(n, nh, hd).transpose(1, 0, 2)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(n, nkv, hd).transpose(1, 0, 2)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(n, nkv, hd).transpose(1, 0, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = np.repeat(k, nh // nkv, axis=0)
        v = np.repeat(v, nh // nkv, axis=0)
        s = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + mask
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        s /= s.sum(axis=-1, keepdims=True)
        o = (s @ v).transpose(1, 0, 2).reshape(n, nh * hd)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        g = h @ w[p + "mlp.gate_proj.weight"].T
        u = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (g / (1.0 + np.exp(-g)) * u) @ w[p + "mlp.down_proj.weight"].T
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ head.T


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face checkpoint directory")
    p.add_argument("--tokens", required=True, help="a JSON list of token ids")
    p.add_argument("--ours", help="the engine's arg-max file")
    p.add_argument("--n", type=int, default=128, help="positions to evaluate")
    a = p.parse_args()
    cfg = json.load(open(os.path.join(a.model, "config.json")))
    w = load_safetensors(os.path.join(a.model, "model.safetensors"))
    tokens = json.load(open(a.tokens))[: a.n]
    logits = forward(cfg, w, np.asarray(tokens)).astype(np.float64)
    m = logits.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(logits - m).sum(axis=1))
    nll = lse[:-1] - logits[np.arange(len(tokens) - 1), tokens[1:]]
    result = {"tokens": len(tokens), "ppl": float(np.exp(nll.mean()))}
    if a.ours:
        ours = json.load(open(a.ours))
        start, pred = ours["start"], np.asarray(ours["argmax"])
        theirs = logits.argmax(axis=1)[start:]
        k = min(len(theirs), len(pred))
        same = int((theirs[:k] == pred[:k]).sum())
        result.update({"positions": k, "agree": same, "top1_agreement": same / max(k, 1)})
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
