//! Decode attention benches, with this machine's read bandwidth measured in the same run.
//!
//! - `stream_read`: a parallel integer sum over 1 GiB (on huge pages where Linux grants them, as
//!   the pools are), the STREAM-like ceiling for reading KV, measured before the decode benches
//!   (`sum_1GiB`) and after them (`sum_1GiB_after`).
//! - `decode/{dtype}/B{b}/L{ctx}`: dense paged decode, 32 query / 8 KV heads, head dim 128,
//!   pages of 32 tokens. Throughput is the KV bytes the step must read. Each call takes the
//!   next of enough copies of the KV pool that together they pass 640 MiB
//!   (`pool::ROTATION_BYTES`), so that it reads its KV from memory, as the stream read does,
//!   and not from a cache that the call before filled.
//! - `sparse_decode/{dtype}/B{b}/L32768`: the same step reading a 2048-token budget (64 random
//!   pages per KV head, through `gather_page_offsets`), over the same copies in turn.
//!   Throughput is the dense step's KV bytes, so its bytes/s over dense's is the sparse/dense
//!   speedup.
//! - `sparse_decode_shared/{dtype}/B{b}/L32768`: the same budget with one selection per
//!   sequence that all its KV heads share (Quest's `shared_heads`, the engine's default).
//! - bf16 at batch 1 sweeps the context from 4K to 128K, dense and sparse at each, for the
//!   report's speedup-against-context plot.
//! - `decode_cached/bf16/B{b}/L256`: dense bf16 decode over one pool of 1 MiB a sequence (two
//!   sequences a thread, at least 8), called back to back without copies, so that each call
//!   finds the KV the call before left in the caches. Where its rate over the read bandwidth
//!   is well below the 0.8 goal, the decode is bound by its arithmetic on this CPU, not by
//!   memory alone. (Its short sequences pay a unit's costs over 256 tokens, so a long decode
//!   from memory may exceed it.)
//! - `pool_read/bf16/B{b}/L{ctx}`: a parallel sum of exactly the bf16 decode's KV bytes
//!   (`pool::pool_sum`), over the same copies in turn, call by call as the decode runs: the
//!   read a decode of that size meets. Where it is itself under the goal (a short shape on
//!   many cores, whose threads' start and end weigh on a small read), a decode of that shape
//!   misses the goal unless it reads better than a plain parallel read does; where it is near
//!   1, what the decode misses is its own.
//! - `decode/bf16-dot` and `sparse_decode/bf16-dot`: bf16 with `Simd::Avx512Bf16` (bf16 dot
//!   products where the CPU has them; the same as bf16 elsewhere).
//!
//! `cargo xtask bench` prints the fractions and ratios from criterion's estimates.
#![allow(missing_docs)]

use std::any::Any;
use std::hint::black_box;

use attn_op::{
    AttnError, AttnOut, AttnParams, Element, PagedKv, Selection, Simd, gather_page_offsets,
    paged_attention, sparse_page_attention,
};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use half::{bf16, f16};

#[path = "shared/pool.rs"]
mod pool;
use pool::{BS, D, KV_HEADS, Q_HEADS, kv_bytes, pool_sum, setup, stream_data, stream_sum};

const BUDGET: usize = 2048;

fn stream_read(c: &mut Criterion) {
    stream_read_as(c, "sum_1GiB");
}

/// The same read again after the decode benches: the dev box's bandwidth drifts with its
/// neighbours, and the report divides by the better of the two.
fn stream_read_after(c: &mut Criterion) {
    stream_read_as(c, "sum_1GiB_after");
}

fn stream_read_as(c: &mut Criterion, id: &str) {
    let data = stream_data();
    let mut g = c.benchmark_group("stream_read");
    g.throughput(Throughput::Bytes((data.len() * 8) as u64));
    g.sample_size(10);
    g.bench_function(id, |b| {
        b.iter(|| black_box(stream_sum(&data)));
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
            let mut dec = setup::<T>(batch, ctx);
            dec.rotate();
            dense(c, &format!("decode/{name}"), &dec, &params, 10);
            // The read of the same bf16 pools, beside their decode (`T` is bf16 where the
            // name is; the downcast finds it).
            let bf16_pools = (&dec as &dyn Any).downcast_ref::<pool::Decode<bf16>>();
            if let Some(dec) =
                bf16_pools.filter(|_| name == "bf16" && (ctx == 4096 || ctx == 32768))
            {
                pool_read(c, dec);
            }
            if ctx == 32768 || sweep {
                sparse::<T>(c, (name, batch, ctx), &dec, &params, false);
            }
            if ctx == 32768 {
                sparse::<T>(c, (name, batch, ctx), &dec, &params, true);
            }
        }
    }
}

/// Dense decode of `dec`'s batch in `group` ([`rotated`]).
fn dense<T: Element>(
    c: &mut Criterion,
    group: &str,
    dec: &pool::Decode<T>,
    params: &AttnParams,
    samples: usize,
) {
    let meta = dec.meta();
    rotated(c, group, dec, samples, |kv, out| {
        paged_attention(&dec.q, kv, &meta, params, out)
    });
}

/// The read of exactly `dec`'s KV, call by call over its copies ([`pool_sum`]), beside the
/// decode of the same bf16 batch.
fn pool_read(c: &mut Criterion, dec: &pool::Decode<bf16>) {
    rotated(c, "pool_read/bf16", dec, 10, |kv, _| {
        black_box(pool_sum(kv));
        Ok(())
    });
}

/// Times `step` on `dec`'s batch in `group` as `B{batch}/L{ctx}` (`samples` samples, throughput
/// the dense step's KV bytes), each call over the next of the pool's copies
/// ([`pool::Decode::rotate`]; the pool itself every call where it has none) into the batch's
/// output and LSE buffers.
fn rotated<T: Element>(
    c: &mut Criterion,
    group: &str,
    dec: &pool::Decode<T>,
    samples: usize,
    mut step: impl FnMut(&PagedKv<T>, AttnOut<'_>) -> Result<(), AttnError>,
) {
    let (batch, ctx) = (dec.lens.len(), dec.lens.first().map_or(0, |&l| l as usize));
    let (mut out, mut lse) = dec.outputs();
    let mut g = c.benchmark_group(group);
    g.throughput(Throughput::Bytes(kv_bytes::<T>(batch, ctx)));
    g.sample_size(samples);
    let id = BenchmarkId::new(format!("B{batch}"), format!("L{ctx}"));
    let mut call = 0;
    g.bench_function(id, |b| {
        b.iter(|| {
            call += 1;
            step(
                dec.kv_for(call),
                AttnOut {
                    out: &mut out,
                    lse: Some(&mut lse),
                },
            )
            .expect("valid bench batch");
        });
    });
    g.finish();
}

/// The step over a 2048-token budget: 64 random pages per (sequence, KV head), or with
/// `shared` one draw per sequence that every KV head takes (Quest's `shared_heads`), gathered
/// into sorted page lists.
fn sparse<T: Element>(
    c: &mut Criterion,
    (name, batch, ctx): (&str, usize, usize),
    dec: &pool::Decode<T>,
    params: &AttnParams,
    shared: bool,
) {
    let pages = BUDGET / BS;
    let mut y = 0x9e37u32;
    let mut draw = || {
        y = y.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        ((y >> 8) as usize % (ctx / BS)) as i32
    };
    let ids: Vec<i32> = if shared {
        (0..batch)
            .flat_map(|_| {
                let row: Vec<i32> = (0..pages).map(|_| draw()).collect();
                std::iter::repeat_n(row, KV_HEADS).flatten()
            })
            .collect()
    } else {
        (0..batch * KV_HEADS * pages).map(|_| draw()).collect()
    };
    let counts = vec![pages as i32; batch * KV_HEADS];
    let sel = Selection {
        ids: &ids,
        lens: &counts,
        max_len: pages,
    };
    let gathered = gather_page_offsets(&sel, BS, &dec.lens, BS, KV_HEADS).expect("valid selection");
    let meta = dec.meta();
    let group = if shared {
        "sparse_decode_shared"
    } else {
        "sparse_decode"
    };
    rotated(c, &format!("{group}/{name}"), dec, 10, |kv, out| {
        sparse_page_attention(&dec.q, kv, &meta, &gathered.as_selection(), params, out)
    });
}

/// The decode's compute rate: the bench's shape at a context small enough for the last-level
/// caches (1 MiB of bf16 KV a sequence), the same pool every call. Two sequences a thread, and
/// at least 8 (8 MiB): a sequence of 256 tokens is one unit of work, so fewer would leave
/// threads idle and understate the rate.
fn decode_cached(c: &mut Criterion) {
    let dec = setup::<bf16>((2 * rayon::current_num_threads()).max(8), 256);
    dense(
        c,
        "decode_cached/bf16",
        &dec,
        &AttnParams::new(Q_HEADS, D),
        20,
    );
}

fn decode(c: &mut Criterion) {
    decode_dtype::<f16>(c, "f16", Simd::Auto);
    decode_dtype::<bf16>(c, "bf16", Simd::Auto);
    // Where the CPU has AVX-512 BF16 (elsewhere the same as bf16): bf16 dot products, with
    // queries and weights rounded to bf16.
    decode_dtype::<bf16>(c, "bf16-dot", Simd::Avx512Bf16);
}

criterion_group!(
    benches,
    stream_read,
    decode_cached,
    decode,
    stream_read_after
);
criterion_main!(benches);
