//! Decode-step selection cost against dense attention on the same shapes.
//!
//! - `topk/{algo}/L{ctx}`: one `retrieve_topk` for one sequence of `ctx` tokens, 32 query /
//!   8 KV heads, head dim 128, pages of 16, budget 2048 tokens (RocketKV with every channel),
//!   representations built beforehand in an f32 pool; `topk/{algo}-bf16/L{ctx}`: the same
//!   from a bf16 pool (half the bytes, the same selections for this bf16 cache).
//! - `topk_dense/bf16/L{ctx}`: attn-op's dense paged decode of the same sequence (bf16 KV,
//!   pages of 16), the time a selection step must be small against.
//!
//! `cargo xtask bench` prints each selection's time as a fraction of dense (goal < 0.15).
#![allow(missing_docs)]

use std::hint::black_box;

use attn_op::{AttnOut, AttnParams, BatchMeta, DType, KvLayout, PagedKv, paged_attention};
use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use half::bf16;
use sparse_algo::{
    Decode, PagedKeys, Quest, QuestConfig, RepPool, RocketConfig, RocketKv, SparseAlgorithm,
};

const Q_HEADS: usize = 32;
const KV_HEADS: usize = 8;
const D: usize = 128;
const PAGE: usize = 16;
const BUDGET: usize = 2048;

/// A random bf16 KV cache of one sequence of `ctx` tokens with interleaved blocks.
fn setup(ctx: usize) -> (PagedKv<bf16>, Vec<i32>, Vec<f32>) {
    let blocks = ctx / PAGE;
    let layout = KvLayout {
        num_blocks: blocks,
        block_size: PAGE,
        kv_heads: KV_HEADS,
        head_dim: D,
    };
    let mut x = 0x9e37_79b9u32;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        (x >> 8) as f32 / (1 << 24) as f32 - 0.5
    };
    let pattern: Vec<bf16> = (0..1 << 20).map(|_| bf16::from_f32(next())).collect();
    let tile = |shift: usize| -> Vec<bf16> {
        (0..layout.len())
            .map(|i| pattern[(i * 7 + shift) % pattern.len()])
            .collect()
    };
    let kv = PagedKv::from_tensors(layout, tile(0), tile(3)).expect("consistent layout");
    let table: Vec<i32> = (0..blocks).map(|b| ((b * 7919) % blocks) as i32).collect();
    let q: Vec<f32> = (0..Q_HEADS * D).map(|_| next()).collect();
    (kv, table, q)
}

fn bench(c: &mut Criterion) {
    let mut dense = c.benchmark_group("topk_dense");
    dense.sample_size(10);
    let mut cases = Vec::new();
    for ctx in [32 * 1024, 128 * 1024] {
        let (kv, table, q) = setup(ctx);
        let qb: Vec<bf16> = q.iter().map(|&x| bf16::from_f32(x)).collect();
        let lens = [ctx as i32];
        let meta = BatchMeta {
            cu_seqlens_q: &[0, 1],
            seq_lens_kv: &lens,
            block_table: &table,
            max_blocks: table.len(),
        };
        let params = AttnParams::new(Q_HEADS, D);
        let mut out = vec![0.0f32; Q_HEADS * D];
        dense.bench_function(BenchmarkId::new("bf16", format!("L{ctx}")), |b| {
            b.iter(|| {
                paged_attention(
                    &qb,
                    &kv,
                    &meta,
                    &params,
                    AttnOut {
                        out: &mut out,
                        lse: None,
                    },
                )
                .expect("valid bench batch");
                black_box(&out);
            });
        });
        cases.push((ctx, kv, table, q));
    }
    dense.finish();

    let mut group = c.benchmark_group("topk");
    group.sample_size(20);
    let algos: Vec<(&str, Box<dyn SparseAlgorithm>)> = vec![
        (
            "quest",
            Box::new(
                Quest::new(QuestConfig {
                    page_size: PAGE,
                    budget_tokens: BUDGET,
                    ..Default::default()
                })
                .expect("valid config"),
            ),
        ),
        (
            "rocketkv",
            Box::new(
                RocketKv::new(RocketConfig {
                    topk: BUDGET,
                    page_size: PAGE,
                    ..Default::default()
                })
                .expect("valid config"),
            ),
        ),
    ];
    for (ctx, kv, table, q) in &cases {
        let lens = [*ctx as i32];
        let keys = PagedKeys::new(kv, &lens, table, table.len()).expect("valid table");
        for ((name, algo), (suffix, elem)) in algos
            .iter()
            .flat_map(|a| [("", DType::F32), ("-bf16", DType::BF16)].map(|e| (a, e)))
        {
            let mut pool = RepPool::with_elem(algo.rep_shape(KV_HEADS, D), elem, 1, 1, *ctx)
                .expect("pool fits");
            algo.construct_representations(0, &keys, &[0], &mut pool)
                .expect("valid construction");
            let step = Decode {
                layer: 0,
                q,
                q_heads: Q_HEADS,
                kv_heads: KV_HEADS,
                head_dim: D,
                seq_lens: &[*ctx],
                slots: &[0],
                keys: None,
            };
            let id = BenchmarkId::new(format!("{name}{suffix}"), format!("L{ctx}"));
            group.bench_function(id, |b| {
                b.iter(|| black_box(algo.retrieve_topk(&step, &pool).expect("valid step")));
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
