//! Criterion benches of the block manager.
//!
//! - `alloc_free`: add and release a one-block request (reuse off): the pool's O(1) path.
//! - `add_release_128k`: add, commit and release a 128K-token request at 0 % prefix hit, with
//!   reuse on and off; their ratio is the cost of reuse bookkeeping.
//! - `prefix_lookup_128k`: find the reusable prefix of a fully cached 128K-token prompt.
//! - `evict_under_pressure`: add a 128K-token request into a pool full of cached blocks, which
//!   must evict 4096 blocks, dropping them or offloading them to the host tier.
//!
//! Throughput is in blocks (of 32 tokens) per second.
#![allow(missing_docs)]

use std::hint::black_box;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use kv_blocks::{KvCacheConfig, KvCacheManager, RequestId, RequestSpec};

const BS: u32 = 32;
const LONG: u32 = 128 * 1024;
const LONG_BLOCKS: u32 = LONG / BS;

/// Distinct prompts: prompt `i` shares no first block with prompt `j != i`.
fn prompt(i: u32, len: u32) -> Vec<u32> {
    let mut x = 0x9e37_79b9u32.wrapping_mul(i + 1);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x % 49_152 + 1
        })
        .collect()
}

/// Hands out requests cycling through `prompts`, each with a fresh id.
struct Cycle {
    prompts: Vec<Vec<u32>>,
    next: usize,
    id: u64,
}

impl Cycle {
    fn new(prompts: Vec<Vec<u32>>) -> Self {
        Cycle {
            prompts,
            next: 0,
            id: 0,
        }
    }

    fn spec(&mut self) -> RequestSpec {
        self.next = (self.next + 1) % self.prompts.len();
        self.id += 1;
        RequestSpec::new(RequestId(self.id), self.prompts[self.next].clone())
    }
}

/// Adds, fully computes and releases a request; returns the transfers it caused.
fn add_compute_release(kv: &mut KvCacheManager, spec: RequestSpec) -> usize {
    let id = spec.id;
    let len = spec.tokens.len() as u32;
    kv.add_request(spec).expect("room");
    kv.commit_computed(id, len).expect("live");
    kv.release(id).expect("live");
    kv.take_transfers().len()
}

fn manager(primary: u32, secondary: u32, reuse: bool) -> KvCacheManager {
    let mut cfg = KvCacheConfig::new(BS, primary, secondary);
    cfg.enable_reuse = reuse;
    KvCacheManager::new(cfg).expect("valid bench config")
}

fn alloc_free(c: &mut Criterion) {
    let mut g = c.benchmark_group("alloc_free");
    g.throughput(Throughput::Elements(1));
    let mut kv = manager(1024, 0, false);
    let tokens = prompt(0, BS);
    g.bench_function("one_block_request", |b| {
        b.iter_batched(
            || RequestSpec::new(RequestId(1), tokens.clone()),
            |spec| {
                kv.add_request(spec).expect("room");
                kv.release(RequestId(1)).expect("live");
            },
            BatchSize::SmallInput,
        );
    });
    g.finish();
}

fn add_release_128k(c: &mut Criterion) {
    let mut g = c.benchmark_group("add_release_128k");
    g.throughput(Throughput::Elements(u64::from(LONG_BLOCKS)));
    g.sample_size(30);
    // 16 distinct prompts through a pool that holds two: by the time a prompt comes back its
    // blocks were evicted, so every add misses (checked below).
    let mut cycle = Cycle::new((0..16).map(|i| prompt(i, LONG)).collect());
    for reuse in [false, true] {
        let name = if reuse {
            "reuse_on_0pct_hit"
        } else {
            "reuse_off"
        };
        let mut kv = manager(2 * LONG_BLOCKS + 8, 0, reuse);
        g.bench_function(name, |b| {
            b.iter_batched(
                || cycle.spec(),
                |spec| add_compute_release(&mut kv, spec),
                BatchSize::LargeInput,
            );
        });
        assert_eq!(
            kv.stats().reused_blocks,
            0,
            "{name}: the bench must run at 0 % hit"
        );
    }
    g.finish();
}

fn prefix_lookup_128k(c: &mut Criterion) {
    let mut g = c.benchmark_group("prefix_lookup_128k");
    g.throughput(Throughput::Elements(u64::from(LONG_BLOCKS)));
    let mut kv = manager(LONG_BLOCKS + 8, 0, true);
    let tokens = prompt(7, LONG);
    kv.add_request(RequestSpec::new(RequestId(1), tokens.clone()))
        .expect("room");
    kv.commit_computed(RequestId(1), LONG).expect("live");
    kv.release(RequestId(1)).expect("live");
    let spec = RequestSpec::new(RequestId(2), tokens);
    assert_eq!(
        kv.reusable_tokens(&spec),
        LONG - BS,
        "all but the last block"
    );
    g.bench_function("reusable_tokens", |b| {
        b.iter(|| black_box(kv.reusable_tokens(black_box(&spec))));
    });
    g.finish();
}

fn evict_under_pressure(c: &mut Criterion) {
    let mut g = c.benchmark_group("evict_under_pressure");
    g.throughput(Throughput::Elements(u64::from(LONG_BLOCKS)));
    g.sample_size(30);
    let mut cycle = Cycle::new((0..16).map(|i| prompt(100 + i, LONG)).collect());
    for (name, secondary) in [("drop", 0), ("offload_to_host", 4 * LONG_BLOCKS)] {
        // The primary pool holds exactly one request: each add evicts the previous one's blocks.
        let mut kv = manager(LONG_BLOCKS, secondary, true);
        add_compute_release(&mut kv, RequestSpec::new(RequestId(0), prompt(99, LONG)));
        // One warm-up request proves the premise before anything is timed.
        add_compute_release(&mut kv, cycle.spec());
        let s = kv.stats();
        assert!(s.evicted + s.offloaded > 0, "{name}: the bench must evict");
        g.bench_function(name, |b| {
            b.iter_batched(
                || cycle.spec(),
                |spec| add_compute_release(&mut kv, spec),
                BatchSize::LargeInput,
            );
        });
    }
    g.finish();
}

criterion_group!(
    benches,
    alloc_free,
    add_release_128k,
    prefix_lookup_128k,
    evict_under_pressure
);
criterion_main!(benches);
