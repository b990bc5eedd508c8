//! One decode's compute rate where its KV is cached: the bench's decode shape (32 query / 8 KV
//! heads, head dim 128, pages of 32 tokens, batch 1) over one pool small enough for the
//! last-level cache, called back to back, so that the time is the kernel's work rather than
//! memory's. With one thread (`RAYON_NUM_THREADS=1`) it is one core's rate, which the decode
//! must keep above that core's share of the read bandwidth to stay memory-bound.
//!
//! `cargo run --release -p attn-op --example compute` prints, for bf16, f16 and f32 caches,
//! the median, fastest and ninetieth-percentile call and the KV bytes a second at the median,
//! with a hash of the outputs (two builds that print the same hash computed the same bits).
//! In the environment, `SIMD` picks the build (`portable`, `avx2`, `avx512`, `bf16-dot`; the
//! default is `auto`), `L` the context (4096; f32 takes half, for the same bytes) and `ITERS`
//! the calls (200). `TYPES` picks the caches (a comma list; all three by default).
//! `Q` queries (1: a decode) attend as the last `Q` positions of the context, as a prefill's
//! query tile does, `GROUP` sets the query heads of each KV head (4), `KV` the KV heads (8)
//! and `D` the head dim (128): `KV=3 D=64 GROUP=3` is SmolLM2's attention. `SAME=1` makes every
//! entry of the block table name the first block, so that the call reads one block's KV over and
//! over (with `KV=1`, 16 KiB of bf16 that level 1 holds): the kernel's rate with no cache misses.
#![allow(
    clippy::print_stdout,
    reason = "an example that prints what it measured"
)]

use std::hint::black_box;
use std::time::Instant;

use attn_op::{AttnError, AttnOut, AttnParams, BatchMeta, Element, Simd, paged_attention};
use half::{bf16, f16};

#[path = "../benches/shared/pool.rs"]
#[allow(
    dead_code,
    reason = "the bench's pool module; this example uses part of it"
)]
mod pool;
use pool::{D, KV_HEADS, Q_HEADS, kv_bytes_shaped, setup_shaped, values};

fn main() -> Result<(), AttnError> {
    let var = |name: &str, default: usize| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let (iters, ctx) = (var("ITERS", 200).max(1), var("L", 4096).max(64));
    let shape = Shape {
        queries: var("Q", 1).clamp(1, ctx / 2),
        group: var("GROUP", Q_HEADS / KV_HEADS).max(1),
        kv_heads: var("KV", KV_HEADS).max(1),
        d: var("D", D).max(1),
        same: var("SAME", 0) != 0,
    };
    let simd = match std::env::var("SIMD").as_deref() {
        Ok("portable") => Simd::Portable,
        Ok("avx2") => Simd::Avx2,
        Ok("avx512") => Simd::Avx512,
        Ok("bf16-dot") => Simd::Avx512Bf16,
        _ => Simd::Auto,
    };
    println!(
        "cache | context | queries x heads | build | median (µs) | fastest (µs) | 90th percentile (µs) | GB/s at the median | hash"
    );
    let types = std::env::var("TYPES").unwrap_or_else(|_| "bf16,f16,f32".into());
    let wanted = |name: &str| types.split(',').any(|t| t.trim() == name);
    if wanted("bf16") {
        run::<bf16>("bf16", ctx, shape, iters, simd)?;
    }
    if wanted("f16") {
        run::<f16>("f16", ctx, shape, iters, simd)?;
    }
    if wanted("f32") {
        run::<f32>("f32", ctx / 2, shape, iters, simd)?;
    }
    Ok(())
}

/// The queries of a call: how many positions, and the query heads of each KV head.
#[derive(Clone, Copy)]
struct Shape {
    queries: usize,
    group: usize,
    kv_heads: usize,
    d: usize,
    /// Whether every page of the block table names the first block.
    same: bool,
}

/// Times `iters` calls of one sequence at context `ctx` over one pool of `T`, its last
/// `shape.queries` positions querying.
fn run<T: Element>(
    name: &str,
    ctx: usize,
    shape: Shape,
    iters: usize,
    simd: Simd,
) -> Result<(), AttnError> {
    let (kv_heads, d) = (shape.kv_heads, shape.d);
    let mut dec = setup_shaped::<T>(1, ctx, (kv_heads, d));
    if shape.same {
        dec.table.fill(0);
    }
    let heads = kv_heads * shape.group;
    let rows = shape.queries * heads;
    let cu = [0, shape.queries as i32];
    let meta = BatchMeta {
        cu_seqlens_q: &cu,
        ..dec.meta()
    };
    let q: Vec<T> = values(rows * d, 0x9e37_79b9);
    let mut params = AttnParams::new(heads, d);
    params.simd = simd;
    let (mut out, mut lse) = (vec![0.0; rows * d], vec![0.0; rows]);
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        paged_attention(
            &q,
            &dec.kv,
            &meta,
            &params,
            AttnOut {
                out: &mut out,
                lse: Some(&mut lse),
            },
        )?;
        times.push(t.elapsed().as_secs_f64());
        black_box(&out);
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let p90 = times[times.len() * 9 / 10];
    let hash = out.iter().chain(&lse).fold(0u64, |h, x| {
        h.wrapping_mul(31).wrapping_add(u64::from(x.to_bits()))
    });
    println!(
        "{name} | {ctx}{} | {} x {heads} | {simd:?} | {:.1} | {:.1} | {:.1} | {:.2} | {hash:016x}",
        if shape.same { " (one block)" } else { "" },
        shape.queries,
        median * 1e6,
        times[0] * 1e6,
        p90 * 1e6,
        kv_bytes_shaped::<T>(1, ctx, (kv_heads, d)) as f64 / median / 1e9
    );
    Ok(())
}
