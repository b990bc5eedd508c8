//! The decode bench's pool and stream read, shared by `benches/decode.rs` and
//! `examples/paired.rs` (each includes this file by `#[path]`).

use attn_op::{BatchMeta, Element, KvLayout, PagedKv};
use half::bf16;
use rayon::prelude::*;

/// Query heads of the bench's shapes.
pub(crate) const Q_HEADS: usize = 32;
/// KV heads of the bench's shapes.
pub(crate) const KV_HEADS: usize = 8;
/// Head dim of the bench's shapes.
pub(crate) const D: usize = 128;
/// Tokens a KV block.
pub(crate) const BS: usize = 32;

/// Bytes that a bench's copies of a KV pool pass together: more than twice the largest
/// last-level cache of the machines we measure on (the GPU machines' 16-core Xeon host has 300
/// MiB of L3). A bench that takes the copies in turn finds no call's KV left in a cache by the
/// call before, so that its time is a read from memory, as a decode that walks many layers
/// meets it. With one pool, that host served a B1 L4K decode (16 MiB) partly from its L3: 20 to
/// 23 % faster than from memory (BENCHMARKS.md, session 56).
pub(crate) const ROTATION_BYTES: u64 = 640 << 20;

/// A decode batch of the bench: its KV pool, block table, queries and metadata.
pub(crate) struct Decode<T: Element> {
    /// The pool: `batch` sequences of `ctx` tokens.
    pub(crate) kv: PagedKv<T>,
    /// Copies of the pool, taken in turn with it by [`Decode::kv_for`] (none until
    /// [`Decode::rotate`]).
    copies: Vec<PagedKv<T>>,
    /// `[batch, ctx / BS]` block table.
    pub(crate) table: Vec<i32>,
    /// `[batch, Q_HEADS, D]` queries, one a sequence.
    pub(crate) q: Vec<T>,
    /// `cu_seqlens_q`: one query a sequence.
    pub(crate) cu: Vec<i32>,
    /// Every sequence's KV length, `ctx`.
    pub(crate) lens: Vec<i32>,
}

impl<T: Element> Decode<T> {
    /// The batch's metadata.
    pub(crate) fn meta(&self) -> BatchMeta<'_> {
        BatchMeta {
            cu_seqlens_q: &self.cu,
            seq_lens_kv: &self.lens,
            block_table: &self.table,
            max_blocks: self.table.len() / self.lens.len().max(1),
        }
    }

    /// Adds copies of the pool until the pool and its copies pass [`ROTATION_BYTES`]
    /// together (none where the pool alone does).
    pub(crate) fn rotate(&mut self) {
        let bytes = (2 * self.kv.k().len() * T::DTYPE.size()) as u64;
        let pools = ROTATION_BYTES.div_ceil(bytes.max(1)).max(1) as usize;
        self.copies = (1..pools).map(|_| self.kv.clone()).collect();
    }

    /// The pool for a bench's `call`-th call: the pool and its copies in turn. Each holds the
    /// same values under the same block table.
    pub(crate) fn kv_for(&self, call: usize) -> &PagedKv<T> {
        match call % (self.copies.len() + 1) {
            0 => &self.kv,
            k => &self.copies[k - 1],
        }
    }

    /// How many pools [`Decode::kv_for`] takes in turn: the pool and its copies.
    #[allow(dead_code, reason = "examples/paired.rs's, not the bench's")]
    pub(crate) fn pools(&self) -> usize {
        self.copies.len() + 1
    }

    /// Output and LSE buffers for the batch's attention.
    pub(crate) fn outputs(&self) -> (Vec<f32>, Vec<f32>) {
        let rows = self.lens.len() * Q_HEADS;
        (vec![0.0; rows * D], vec![0.0; rows])
    }
}

/// A decode batch of `batch` sequences of `ctx` tokens, its pool filled by tiling a random
/// pattern (the values do not matter for speed, only that they are not zeros).
pub(crate) fn setup<T: Element>(batch: usize, ctx: usize) -> Decode<T> {
    setup_shaped(batch, ctx, (KV_HEADS, D))
}

/// [`setup`] with `kv_heads` KV heads of head dim `d` (queries for `Q_HEADS` query heads of
/// `d`; a caller with other query heads draws its own).
pub(crate) fn setup_shaped<T: Element>(
    batch: usize,
    ctx: usize,
    (kv_heads, d): (usize, usize),
) -> Decode<T> {
    // A partial last block where the context is not a whole number of blocks.
    let blocks_per_seq = ctx.div_ceil(BS);
    let layout = KvLayout {
        num_blocks: batch * blocks_per_seq,
        block_size: BS,
        kv_heads,
        head_dim: d,
    };
    let pattern: Vec<T> = values(1 << 20, 0x2545_f491);
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
    Decode {
        kv,
        copies: Vec::new(),
        table,
        q: tile(batch * Q_HEADS * d, 3),
        cu: (0..=batch as i32).collect(),
        lens: vec![ctx as i32; batch],
    }
}

/// `n` values in [-0.5, 0.5) from a xorshift stream seeded by `seed` (not zero), never zeros.
pub(crate) fn values<T: Element>(n: usize, seed: u32) -> Vec<T> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            T::from_f32((x >> 8) as f32 / (1 << 24) as f32 - 0.5)
        })
        .collect()
}

/// The KV bytes a dense decode of `batch` sequences of `ctx` tokens reads.
pub(crate) fn kv_bytes<T: Element>(batch: usize, ctx: usize) -> u64 {
    kv_bytes_shaped::<T>(batch, ctx, (KV_HEADS, D))
}

/// [`kv_bytes`] with `kv_heads` KV heads of head dim `d`.
pub(crate) fn kv_bytes_shaped<T: Element>(
    batch: usize,
    ctx: usize,
    (kv_heads, d): (usize, usize),
) -> u64 {
    (2 * batch * ctx * kv_heads * d * T::DTYPE.size()) as u64
}

/// The stream read's 1 GiB of data, backed by transparent huge pages where Linux grants them
/// ([`attn_op::advise_huge_pages`]), as the decode's pools are: the read is this machine's
/// best, not one slowed by a TLB miss every 4 KiB. Measured in session 63 (the same sum,
/// alternated): with the advice the read was about 5 % faster on the dev box and 6-7 % on the
/// 16-core Xeon (BENCHMARKS.md), so fractions measured before then are that much too high.
pub(crate) fn stream_data() -> Vec<u64> {
    const LEN: usize = 1 << 27;
    let mut data: Vec<u64> = Vec::with_capacity(LEN);
    attn_op::advise_huge_pages(&data);
    data.extend((0..LEN as u64).map(|i| i.wrapping_mul(0x9e37_79b9)));
    data
}

/// The stream read: a parallel wrapping sum of `data`. An integer sum is associative, so it
/// vectorizes and is bound by memory, not by an add-latency chain (a plain f32 sum would
/// understate the bandwidth).
pub(crate) fn stream_sum(data: &[u64]) -> u64 {
    data.par_chunks(1 << 15)
        .map(|c| c.iter().fold(0u64, |a, &x| a.wrapping_add(x)))
        .reduce(|| 0, u64::wrapping_add)
}

/// A read of exactly a bf16 decode's bytes: a parallel wrapping sum of the bits of every K and V
/// element of `kv`, the way [`stream_sum`] reads its 1 GiB. Timed call by call over a pool's
/// copies, as the decode is, it is the read a decode of that size meets: on a machine whose
/// threads start and end a short read unevenly, a small pool reads below the 1 GiB figure
/// (B1 L4K on the 16-core Xeon: 0.79-0.85 of it, BENCHMARKS.md, session 78).
pub(crate) fn pool_sum(kv: &PagedKv<bf16>) -> u16 {
    // K's chunks, then V's, in one parallel phase, as the decode reads both in one.
    const CHUNK: usize = 1 << 16;
    kv.k()
        .par_chunks(CHUNK)
        .chain(kv.v().par_chunks(CHUNK))
        .map(|c| c.iter().fold(0u16, |a, x| a.wrapping_add(x.to_bits())))
        .reduce(|| 0, u16::wrapping_add)
}
