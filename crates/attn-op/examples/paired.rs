//! Decode attention as a fraction of this machine's read bandwidth, measured in pairs: each
//! decode is timed right after a stream read of 1 GiB, so that both see the same neighbours.
//! On a shared box the read bandwidth drifts by a quarter between runs, and a fraction taken
//! from a read minutes away (criterion's `stream_read` and `decode` groups) drifts with it.
//!
//! `cargo run --release -p attn-op --example paired` times the bench's B8 L32K bf16 decode (32
//! query / 8 KV heads, head dim 128, pages of 32 tokens, 1 GiB of KV) with bf16 dot products
//! where the CPU has them (`Simd::Avx512Bf16`), and prints each pair and the median fraction.
//! `PAIRS`, `B` and `L` in the environment change the pair count, the batch and the context;
//! `SIMD=auto` takes the default build, `SIMD=avx2` the AVX2 one. A hash of the outputs and
//! LSEs shows that two builds computed the same bits.
//!
//! Each pair also times a read of exactly the decode's bytes (`pool_sum`: the pool's K and V
//! summed in parallel), call by call over other copies of the pool than the decode's, and
//! prints it as a fraction of the same 1 GiB read: the read a decode of that size meets.
//!
//! `CALLS` (1 by default) times that many decodes back to back after each read, each over the
//! next copy of the pool, and takes their mean, as criterion's calls run. Short shapes need it:
//! on the dev box one B1 L4K call (16 MiB, about 1.5 ms) right after a read measured 0.44-0.55
//! of the read, and 32 back to back 0.59-0.65 (BENCHMARKS.md, session 72).
#![allow(
    clippy::print_stdout,
    reason = "an example that prints what it measured"
)]

use std::hint::black_box;
use std::time::Instant;

use attn_op::{AttnOut, AttnParams, Simd, paged_attention};
use half::bf16;

#[path = "../benches/shared/pool.rs"]
mod pool;
use pool::{D, Q_HEADS, kv_bytes, pool_sum, setup, stream_data, stream_sum};

fn main() -> Result<(), attn_op::AttnError> {
    let var = |name: &str, default: usize| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let (pairs, batch, ctx) = (var("PAIRS", 8).max(1), var("B", 8), var("L", 32768));
    let calls = var("CALLS", 1).max(1);
    // The decode bench's batch (benches/shared/pool.rs).
    let mut dec = setup::<bf16>(batch, ctx);
    // Copies of the pool taken in turn, so that no decode finds its KV cached (none at the
    // default 1 GiB).
    dec.rotate();
    let meta = dec.meta();
    let mut params = AttnParams::new(Q_HEADS, D);
    params.simd = match std::env::var("SIMD").as_deref() {
        Ok("auto") => Simd::Auto,
        Ok("avx2") => Simd::Avx2,
        _ => Simd::Avx512Bf16,
    };
    let (mut out, mut lse) = dec.outputs();
    // The stream read of benches/decode.rs.
    let data = stream_data();
    let read_bytes = (data.len() * size_of::<u64>()) as f64;
    let kv_bytes = kv_bytes::<bf16>(batch, ctx) as f64;
    println!(
        "pair | stream read (ms) | its bytes read (µs) | their fraction | decode (µs) | fraction of the read"
    );
    let mut fractions = Vec::with_capacity(pairs);
    let mut floors = Vec::with_capacity(pairs);
    // The pool read takes the copies half a rotation away from the decode's, so that neither
    // finds the other's bytes in a cache.
    let away = dec.pools() / 2;
    for pair in 0..pairs {
        let t = Instant::now();
        black_box(stream_sum(&data));
        let read = t.elapsed().as_secs_f64();
        let t = Instant::now();
        for call in 0..calls {
            black_box(pool_sum(dec.kv_for(pair * calls + call + away)));
        }
        let floor = t.elapsed().as_secs_f64() / calls as f64;
        let t = Instant::now();
        for call in 0..calls {
            paged_attention(
                &dec.q,
                dec.kv_for(pair * calls + call),
                &meta,
                &params,
                AttnOut {
                    out: &mut out,
                    lse: Some(&mut lse),
                },
            )?;
        }
        let decode = t.elapsed().as_secs_f64() / calls as f64;
        let fraction = (kv_bytes / decode) / (read_bytes / read);
        let floor_fraction = (kv_bytes / floor) / (read_bytes / read);
        println!(
            "{pair} | {:.1} | {:.1} | {floor_fraction:.3} | {:.1} | {fraction:.3}",
            read * 1e3,
            floor * 1e6,
            decode * 1e6
        );
        fractions.push(fraction);
        floors.push(floor_fraction);
    }
    let hash = out.iter().chain(&lse).fold(0u64, |h, x| {
        h.wrapping_mul(31).wrapping_add(u64::from(x.to_bits()))
    });
    println!(
        "median fraction {}; its bytes read alone {}; outputs hash {hash:016x}",
        spread(&mut fractions),
        spread(&mut floors)
    );
    Ok(())
}

/// The median of `xs` and their range, as the summary line prints them (`xs` not empty: one
/// figure a pair, and at least one pair).
fn spread(xs: &mut [f64]) -> String {
    xs.sort_by(f64::total_cmp);
    format!(
        "{:.3} (range {:.3} to {:.3})",
        xs[xs.len() / 2],
        xs[0],
        xs[xs.len() - 1]
    )
}
