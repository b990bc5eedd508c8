#!/usr/bin/env python3
"""CPU attention peers for `cargo xtask bench --peers`: PyTorch's scaled_dot_product_attention
on the shapes of attn-op's decode bench (32 query / 8 KV heads, head dim 128, pages of 32 tokens).

- torch_sdpa/{dtype}/B{b}/L{ctx}: dense decode over contiguous K/V ([B, 8, L, 128], GQA).
- torch_gather_sdpa/{dtype}/B{b}/L{ctx}: the same step from a paged pool
  ([blocks, 32, 8, 128]) gathered through a block table first, as an engine without a paged
  kernel must do.

Each call takes the next of enough copies of its K/V (or pool) that together they pass 640 MiB,
as attn-op's decode bench does (benches/shared/pool.rs, ROTATION_BYTES): no call finds its K/V
left in a cache by the call before.

Prints one JSON object per line ({"id", "mean_ns", "bytes"}) and writes them to --out.
"""
import argparse
import itertools
import json
import statistics
import time

import torch
import torch.nn.functional as F

Q_HEADS, KV_HEADS, D, BS = 32, 8, 128, 32
ROTATION_BYTES = 640 << 20


def rotation(k, v, kv_bytes):
    """(k, v) and enough copies that together they pass ROTATION_BYTES, taken in turn."""
    n = max(1, -(-ROTATION_BYTES // kv_bytes))
    return itertools.cycle([(k, v)] + [(k.clone(), v.clone()) for _ in range(n - 1)])


def timed(fn, min_time=1.0, warmup=2):
    for _ in range(warmup):
        fn()
    times = []
    start = time.perf_counter()
    while time.perf_counter() - start < min_time or len(times) < 5:
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.mean(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--min-time", type=float, default=1.0)
    args = ap.parse_args()
    torch.manual_seed(0)
    results = []
    for name, dtype in [("f16", torch.float16), ("bf16", torch.bfloat16)]:
        for b in (1, 8):
            for ctx in (4096, 32768):
                kv_bytes = 2 * b * ctx * KV_HEADS * D * 2
                q = torch.randn(b, Q_HEADS, 1, D, dtype=dtype)
                k = torch.randn(b, KV_HEADS, ctx, D, dtype=dtype)
                v = torch.randn(b, KV_HEADS, ctx, D, dtype=dtype)
                kvs = rotation(k, v, kv_bytes)

                def dense():
                    kk, vv = next(kvs)
                    return F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)

                results.append({"id": f"torch_sdpa/{name}/B{b}/L{ctx}", "mean_ns": timed(dense, args.min_time), "bytes": kv_bytes})
                del k, v, kvs
                blocks = b * ctx // BS
                pool_k = torch.randn(blocks, BS, KV_HEADS, D, dtype=dtype)
                pool_v = torch.randn(blocks, BS, KV_HEADS, D, dtype=dtype)
                pools = rotation(pool_k, pool_v, kv_bytes)
                table = torch.arange(blocks).reshape(ctx // BS, b).T.contiguous()

                def gathered():
                    pk, pv = next(pools)
                    kk = pk[table].reshape(b, ctx, KV_HEADS, D).transpose(1, 2)
                    vv = pv[table].reshape(b, ctx, KV_HEADS, D).transpose(1, 2)
                    return F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)

                results.append({"id": f"torch_gather_sdpa/{name}/B{b}/L{ctx}", "mean_ns": timed(gathered, args.min_time), "bytes": kv_bytes})
                del pool_k, pool_v, pools
                print(json.dumps(results[-2]), flush=True)
                print(json.dumps(results[-1]), flush=True)
    with open(args.out, "w") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)


if __name__ == "__main__":
    main()
