//! Decode attention benches, with this machine's read bandwidth measured in the same run.
//!
//! - `stream_read`: a parallel integer sum over 1 GiB, the STREAM-like ceiling for reading KV,
//!   measured before the decode benches (`sum_1GiB`) and after them (`sum_1GiB_after`).
//! - `decode/{dtype}/B{b}/L{ctx}`: dense paged decode, 32 query / 8 KV heads, head dim 128,
//!   pages of 32 tokens. Throughput is the KV bytes the step must read.
//! - `sparse_decode/{dtype}/B{b}/L32768`: the same step reading a 2048-token budget (64 random
//!   pages per KV head, through `gather_page_offsets`). Throughput is the dense step's KV bytes,
//!   so its bytes/s over dense's is the sparse/dense speedup.
//! - bf16 at batch 1 sweeps the context from 4K to 128K, dense and sparse at each, for the
//!   report's speedup-against-context plot.
//! - `decode/bf16-dot` and `sparse_decode/bf16-dot`: bf16 with `Simd::Avx512Bf16` (bf16 dot
//!   products where the CPU has them; the same as bf16 elsewhere).
//!
//! `cargo xtask bench` prints the fractions and ratios from criterion's estimates.
#![allow(missing_docs)]

use std::hint::black_box;

use attn_op::{
    AttnOut, AttnParams, BatchMeta, Element, KvLayout, PagedKv, Selection, Simd,
    gather_page_offsets, paged_attention, sparse_page_attention,
};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use half::{bf16, f16};
use rayon::prelude::*;

const Q_HEADS: usize = 32;
const KV_HEADS: usize = 8;
const D: usize = 128;
const BS: usize = 32;
const BUDGET: usize = 2048;

/// A KV pool for `batch` sequences of `ctx` tokens, filled by tiling a random pattern (the
/// values do not matter for speed, only that they are not zeros).
fn setup<T: Element>(batch: usize, ctx: usize) -> (PagedKv<T>, Vec<i32>, Vec<T>) {
    let blocks_per_seq = ctx / BS;
    let layout = KvLayout {
        num_blocks: batch * blocks_per_seq,
        block_size: BS,
        kv_heads: KV_HEADS,
        head_dim: D,
    };
    let mut x = 0x2545_f491u32;
    let pattern: Vec<T> = (0..1 << 20)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            T::from_f32((x >> 8) as f32 / (1 << 24) as f32 - 0.5)
        })
        .collect();
    let tile = |n: usize, shift: usize| -> Vec<T> {
        (0..n)
            .map(|i| pattern[(i + shift) % pattern.len()])
            .collect()
    };
    // A pool made as an engine makes one (zeroed, then written), so it gets the same pages.
    let mut kv = PagedKv::new(layout).expect("consistent bench layout");
    let (k, v) = kv.tensors_mut();
    k.copy_from_slice(&tile(layout.len(), 0));
    v.copy_from_slice(&tile(layout.len(), 7));
    // Sequence s owns a strided set of blocks, as a real allocator would interleave them.
    let table: Vec<i32> = (0..batch)
        .flat_map(|s| (0..blocks_per_seq).map(move |b| (b * batch + s) as i32))
        .collect();
    let q = tile(batch * Q_HEADS * D, 3);
    (kv, table, q)
}

fn kv_bytes<T: Element>(batch: usize, ctx: usize) -> u64 {
    (2 * batch * ctx * KV_HEADS * D * T::DTYPE.size()) as u64
}

fn stream_read(c: &mut Criterion) {
    stream_read_as(c, "sum_1GiB");
}

/// The same read again after the decode benches: the dev box's bandwidth drifts with its
/// neighbours, and the report divides by the better of the two.
fn stream_read_after(c: &mut Criterion) {
    stream_read_as(c, "sum_1GiB_after");
}

fn stream_read_as(c: &mut Criterion, id: &str) {
    // A wrapping integer sum is associative, so it vectorizes and is bound by memory, not by an
    // add-latency chain (a plain f32 sum would understate the bandwidth).
    let data: Vec<u64> = (0..(1u64 << 27))
        .map(|i| i.wrapping_mul(0x9e37_79b9))
        .collect();
    let mut g = c.benchmark_group("stream_read");
    g.throughput(Throughput::Bytes((data.len() * 8) as u64));
    g.sample_size(10);
    g.bench_function(id, |b| {
        b.iter(|| {
            let s = data
                .par_chunks(1 << 15)
                .map(|c| c.iter().fold(0u64, |a, &x| a.wrapping_add(x)))
                .reduce(|| 0, u64::wrapping_add);
            black_box(s)
        });
    });
    g.finish();
}

fn decode_dtype<T: Element>(c: &mut Criterion, name: &str, simd: Simd) {
    let mut params = AttnParams::new(Q_HEADS, D);
    params.simd = simd;
    for batch in [1usize, 8] {
        let sweep = name == "bf16" && batch == 1;
        let contexts: &[usize] = if sweep {
            &[4096, 8192, 16384, 32768, 65536, 131_072]
        } else {
            &[4096, 32768]
        };
        for &ctx in contexts {
            let (kv, table, q) = setup::<T>(batch, ctx);
            let cu: Vec<i32> = (0..=batch as i32).collect();
            let lens = vec![ctx as i32; batch];
            let meta = BatchMeta {
                cu_seqlens_q: &cu,
                seq_lens_kv: &lens,
                block_table: &table,
                max_blocks: ctx / BS,
            };
            let mut out = vec![0.0f32; batch * Q_HEADS * D];
            let mut lse = vec![0.0f32; batch * Q_HEADS];
            let mut g = c.benchmark_group(format!("decode/{name}"));
            g.throughput(Throughput::Bytes(kv_bytes::<T>(batch, ctx)));
            g.sample_size(10);
            let id = BenchmarkId::new(format!("B{batch}"), format!("L{ctx}"));
            g.bench_function(id, |b| {
                b.iter(|| {
                    paged_attention(
                        &q,
                        &kv,
                        &meta,
                        &params,
                        AttnOut {
                            out: &mut out,
                            lse: Some(&mut lse),
                        },
                    )
                    .expect("valid bench batch");
                });
            });
            g.finish();
            if ctx == 32768 || sweep {
                // 64 random pages per (sequence, KV head), gathered into sorted page lists.
                let pages = BUDGET / BS;
                let mut y = 0x9e37u32;
                let ids: Vec<i32> = (0..batch * KV_HEADS * pages)
                    .map(|_| {
                        y = y.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                        ((y >> 8) as usize % (ctx / BS)) as i32
                    })
                    .collect();
                let counts = vec![pages as i32; batch * KV_HEADS];
                let sel = Selection {
                    ids: &ids,
                    lens: &counts,
                    max_len: pages,
                };
                let gathered =
                    gather_page_offsets(&sel, BS, &lens, BS, KV_HEADS).expect("valid selection");
                let mut g = c.benchmark_group(format!("sparse_decode/{name}"));
                g.throughput(Throughput::Bytes(kv_bytes::<T>(batch, ctx)));
                g.sample_size(10);
                let id = BenchmarkId::new(format!("B{batch}"), format!("L{ctx}"));
                g.bench_function(id, |b| {
                    b.iter(|| {
                        sparse_page_attention(
                            &q,
                            &kv,
                            &meta,
                            &gathered.as_selection(),
                            &params,
                            AttnOut {
                                out: &mut out,
                                lse: Some(&mut lse),
                            },
                        )
                        .expect("valid bench selection");
                    });
                });
                g.finish();
            }
        }
    }
}

fn decode(c: &mut Criterion) {
    decode_dtype::<f16>(c, "f16", Simd::Auto);
    decode_dtype::<bf16>(c, "bf16", Simd::Auto);
    // Where the CPU has AVX-512 BF16 (elsewhere the same as bf16): bf16 dot products, with
    // queries and weights rounded to bf16.
    decode_dtype::<bf16>(c, "bf16-dot", Simd::Avx512Bf16);
}

criterion_group!(benches, stream_read, decode, stream_read_after);
criterion_main!(benches);
