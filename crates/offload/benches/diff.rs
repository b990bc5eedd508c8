//! The sparse diff of one layer: `B` hot buffers of 4096 slots, each diffing a selection of
//! 2048 ids out of 32768 that drifts by a quarter between steps (`diff/B{b}`).
#![allow(missing_docs)]

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use offload::HotBuffer;

const HOT: usize = 4096;
const TOPK: usize = 2048;
const IDS: i32 = 32768;

/// Two alternating selections per buffer that share three quarters of their ids.
fn selections(seed: u32) -> [Vec<i32>; 2] {
    let mut x = seed | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        (x % IDS as u32) as i32
    };
    let mut base: Vec<i32> = Vec::new();
    while base.len() < TOPK {
        base.push(next());
        base.sort_unstable();
        base.dedup();
    }
    let mut other = base.clone();
    for i in (0..TOPK).step_by(4) {
        other[i] = next();
    }
    other.sort_unstable();
    other.dedup();
    [base, other]
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("diff");
    for b in [1usize, 64] {
        let sels: Vec<[Vec<i32>; 2]> = (0..b as u32).map(|s| selections(s * 7919 + 1)).collect();
        let mut bufs: Vec<HotBuffer> = (0..b).map(|_| HotBuffer::new(HOT)).collect();
        for (buf, s) in bufs.iter_mut().zip(&sels) {
            buf.diff(&s[0], -1);
        }
        let mut flip = 1;
        group.bench_function(BenchmarkId::from_parameter(format!("B{b}")), |bench| {
            bench.iter(|| {
                for (buf, s) in bufs.iter_mut().zip(&sels) {
                    black_box(buf.diff(&s[flip], -1));
                }
                flip ^= 1;
            });
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
