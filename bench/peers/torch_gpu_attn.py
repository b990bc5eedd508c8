#!/usr/bin/env python3
"""GPU peers of attn-op's device benchmarks, run by the device bundle on the GPU machine.

Same shapes and data sizes as `attn-op`'s `gpu bench`: bf16, 32 query / 8 KV heads, head dim
128, pages of 16 tokens, a pool of 32K random blocks (1 GiB of K and V).

- copy d2d 1 GiB: `dst.copy_(src)`, bytes read + written.
- torch SDPA dense decode: contiguous K/V `[B, 8, L, 128]`, `enable_gqa=True`.
- torch gather + SDPA: K/V gathered from the pool through a random page table, then SDPA.
- torch sparse gather + SDPA: 128 selected pages per (sequence, KV head) gathered, then SDPA.
- torch Quest estimate + top-k: per-page key min/max `[B, 8, pages, 128]`, the bound
  `sum_d max(q_d kmin_d, q_d kmax_d)` per query head, max over the GQA group, top-127 pages
  (the last page is always kept); the Quest pipeline adds the gather of the selected pages and
  SDPA over them (what sparse-algo's `gpu_select bench` times as "quest+sparse attn").

Timing: after warm-up, medians of 50 runs, each alone between CUDA events (synced) and enqueued
back to back with events between (queued). Writes JSON with --json.
"""
import argparse
import json

import torch
import torch.nn.functional as F

QH, KVH, D, BS = 32, 8, 128, 16
POOL_BLOCKS = 32 * 1024
BUDGET_PAGES = 128
RUNS = 50


def timed(fn):
    """(synced, queued) medians in ms: each run alone between events and waited for; then runs
    enqueued back to back with an event between each two, so host work overlaps the GPU's."""
    for _ in range(5):
        fn()
    synced = []
    for _ in range(RUNS):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        synced.append(a.elapsed_time(b))
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(RUNS + 1)]
    marks[0].record()
    for m in marks[1:]:
        fn()
        m.record()
    torch.cuda.synchronize()
    queued = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
    synced.sort()
    queued.sort()
    return synced[RUNS // 2], queued[RUNS // 2]


def row(name, times, nbytes):
    return {"name": name, "ms": times[0], "queued_ms": times[1], "bytes": nbytes}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []

    n = 1 << 28
    src = torch.rand(n, device=dev, generator=g)
    dst = torch.empty_like(src)
    rows.append(row("torch copy d2d 1 GiB", timed(lambda: dst.copy_(src)), n * 4 * 2))
    del src, dst

    # The report's context sweep at batch 1: SDPA dense only.
    for ctx in [4096, 8192, 16384, 32768, 65536]:
        q = torch.rand(1, QH, 1, D, device=dev, generator=g, dtype=torch.bfloat16)
        k = torch.rand(1, KVH, ctx, D, device=dev, generator=g, dtype=torch.bfloat16)
        v = torch.rand(1, KVH, ctx, D, device=dev, generator=g, dtype=torch.bfloat16)
        t = timed(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        rows.append(row(f"torch SDPA dense B1 L{ctx // 1024}K", t, ctx * KVH * D * 2 * 2))
        del q, k, v

    pool_k = torch.rand(POOL_BLOCKS, BS, KVH, D, device=dev, generator=g, dtype=torch.bfloat16)
    pool_v = torch.rand(POOL_BLOCKS, BS, KVH, D, device=dev, generator=g, dtype=torch.bfloat16)
    for b, ctx in [(8, 32 * 1024), (1, 128 * 1024)]:
        blocks = ctx // BS
        tag = f"B{b} L{ctx // 1024}K"
        q = torch.rand(b, QH, 1, D, device=dev, generator=g, dtype=torch.bfloat16)
        kv_bytes = b * ctx * KVH * D * 2 * 2

        k = torch.rand(b, KVH, ctx, D, device=dev, generator=g, dtype=torch.bfloat16)
        v = torch.rand(b, KVH, ctx, D, device=dev, generator=g, dtype=torch.bfloat16)
        t = timed(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        rows.append(row(f"torch SDPA dense {tag}", t, kv_bytes))
        del k, v

        table = torch.randperm(POOL_BLOCKS, device=dev, generator=g)[: b * blocks].view(b, blocks)

        def gathered():
            kk = pool_k[table].view(b, ctx, KVH, D).transpose(1, 2)
            vv = pool_v[table].view(b, ctx, KVH, D).transpose(1, 2)
            return F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)

        rows.append(row(f"torch gather+SDPA {tag}", timed(gathered), kv_bytes))

        # Sparse: per (sequence, KV head) BUDGET_PAGES logical pages, gathered per head.
        sel = torch.stack([
            torch.randperm(blocks - 1, device=dev, generator=g)[: BUDGET_PAGES - 1]
            for _ in range(b * KVH)
        ]).view(b, KVH, BUDGET_PAGES - 1)
        last = torch.full((b, KVH, 1), blocks - 1, device=dev)
        sel = torch.cat([sel, last], dim=2).sort(dim=2).values
        phys = torch.gather(table.unsqueeze(1).expand(b, KVH, blocks), 2, sel)
        heads = torch.arange(KVH, device=dev).view(1, KVH, 1)
        sel_bytes = b * KVH * BUDGET_PAGES * BS * D * 2 * 2

        def sparse():
            # pool[phys, :, h, :] -> [b, KVH, pages, BS, D]
            kk = pool_k.permute(0, 2, 1, 3)[phys, heads].reshape(b, KVH, BUDGET_PAGES * BS, D)
            vv = pool_v.permute(0, 2, 1, 3)[phys, heads].reshape(b, KVH, BUDGET_PAGES * BS, D)
            return F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)

        rows.append(row(f"torch sparse gather+SDPA 2K {tag}", timed(sparse), sel_bytes))

        # Quest: min/max pages (random, as the bench's own), per-head bound, group max, top-k.
        kmax = torch.rand(b, KVH, blocks, D, device=dev, generator=g, dtype=torch.bfloat16)
        kmin = -torch.rand(b, KVH, blocks, D, device=dev, generator=g, dtype=torch.bfloat16)
        qg = q.view(b, KVH, QH // KVH, 1, D)
        last_page = torch.full((b, KVH, 1), blocks - 1, device=dev)
        rep_bytes = b * KVH * blocks * D * 2 * 2

        def quest_topk():
            bound = torch.maximum(qg * kmax.unsqueeze(2), qg * kmin.unsqueeze(2)).sum(-1)
            return bound.amax(2)[..., :-1].topk(BUDGET_PAGES - 1, dim=-1).indices

        def quest_pipeline():
            pages = torch.cat([quest_topk(), last_page], dim=2)
            phys = torch.gather(table.unsqueeze(1).expand(b, KVH, blocks), 2, pages)
            kk = pool_k.permute(0, 2, 1, 3)[phys, heads].reshape(b, KVH, BUDGET_PAGES * BS, D)
            vv = pool_v.permute(0, 2, 1, 3)[phys, heads].reshape(b, KVH, BUDGET_PAGES * BS, D)
            return F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)

        rows.append(row(f"torch Quest estimate+top-k {tag}", timed(quest_topk), rep_bytes))
        rows.append(row(f"torch Quest pipeline 2K {tag}", timed(quest_pipeline),
                        rep_bytes + sel_bytes))
        del kmax, kmin

    for r in rows:
        print(f"{r['name']:<44} {r['ms']:>10.4f} ms (queued {r['queued_ms']:.4f}) "
              f"{r['bytes'] / r['ms'] / 1e6:>10.1f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f)


if __name__ == "__main__":
    main()
