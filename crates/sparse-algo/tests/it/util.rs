//! Seeded random data and the paged KV cases the tests share.

use attn_op::{Element, KvLayout, PagedKv};
use proptest::prelude::RngExt;
use proptest::test_runner::{RngAlgorithm, TestRng};
use sparse_algo::{Decode, KeySource, PagedKeys};

/// A seeded generator (proptest's ChaCha), so cases are reproducible from their seed.
pub(crate) struct Rng(TestRng);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        let mut bytes = [0u8; 32];
        bytes[..8].copy_from_slice(&seed.to_le_bytes());
        Rng(TestRng::from_seed(RngAlgorithm::ChaCha, &bytes))
    }

    /// Uniform in `lo..hi` (`hi > lo`).
    pub(crate) fn range(&mut self, lo: usize, hi: usize) -> usize {
        self.0.random_range(lo..hi)
    }

    /// Uniform in [-1, 1).
    pub(crate) fn unit(&mut self) -> f32 {
        self.0.random_range(-1.0f32..1.0)
    }

    pub(crate) fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.unit() * scale).collect()
    }
}

/// A batch of sequences in a paged KV cache with shuffled blocks, plus decode queries.
pub(crate) struct Case<T: Element> {
    pub(crate) kv: PagedKv<T>,
    pub(crate) lens: Vec<i32>,
    pub(crate) ulens: Vec<usize>,
    pub(crate) table: Vec<i32>,
    pub(crate) max_blocks: usize,
    pub(crate) q: Vec<f32>,
    pub(crate) q_heads: usize,
    pub(crate) slots: Vec<usize>,
}

impl<T: Element> Case<T> {
    /// Sequences with keys `keys[s]` (`[len, kv_heads, head_dim]` f32, converted to `T`),
    /// random values, queries `q` (`[num_seqs, q_heads, head_dim]`), blocks of `bs` shuffled.
    pub(crate) fn new(
        keys: &[Vec<f32>],
        q: Vec<f32>,
        q_heads: usize,
        kv_heads: usize,
        head_dim: usize,
        bs: usize,
        rng: &mut Rng,
    ) -> Self {
        let stride = kv_heads * head_dim;
        let ulens: Vec<usize> = keys.iter().map(|k| k.len() / stride).collect();
        let max_blocks = ulens
            .iter()
            .map(|l| l.div_ceil(bs))
            .max()
            .unwrap_or(0)
            .max(1);
        let num_blocks = max_blocks * keys.len() + 1;
        let mut perm: Vec<usize> = (0..num_blocks).collect();
        for i in (1..num_blocks).rev() {
            perm.swap(i, rng.range(0, i + 1));
        }
        let layout = KvLayout {
            num_blocks,
            block_size: bs,
            kv_heads,
            head_dim,
        };
        let mut k = vec![T::from_f32(0.75); layout.len()];
        let v: Vec<T> = (0..layout.len()).map(|_| T::from_f32(rng.unit())).collect();
        let mut table = vec![-1i32; keys.len() * max_blocks];
        for (s, ks) in keys.iter().enumerate() {
            for t in 0..ulens[s] {
                let b = perm[s * max_blocks + t / bs];
                table[s * max_blocks + t / bs] = b as i32;
                let slot = b * bs + t % bs;
                for (dst, &x) in k[slot * stride..(slot + 1) * stride]
                    .iter_mut()
                    .zip(&ks[t * stride..(t + 1) * stride])
                {
                    *dst = T::from_f32(x);
                }
            }
        }
        Case {
            kv: PagedKv::from_tensors(layout, k, v).expect("shapes built to match the layout"),
            lens: ulens.iter().map(|&l| l as i32).collect(),
            slots: (0..keys.len()).collect(),
            ulens,
            table,
            max_blocks,
            q,
            q_heads,
        }
    }

    pub(crate) fn keys(&self) -> PagedKeys<'_, T> {
        PagedKeys::new(&self.kv, &self.lens, &self.table, self.max_blocks)
            .expect("the case's table covers its sequences")
    }

    /// The decode step of the case (queries at the last position), reading keys from `keys`.
    pub(crate) fn step<'a>(&'a self, keys: Option<&'a dyn KeySource>) -> Decode<'a> {
        let layout = attn_op::KvCache::layout(&self.kv);
        Decode {
            layer: 0,
            q: &self.q,
            q_heads: self.q_heads,
            kv_heads: layout.kv_heads,
            head_dim: layout.head_dim,
            seq_lens: &self.ulens,
            slots: &self.slots,
            keys,
        }
    }

    /// The f32 key of (seq, position, head) as stored (after conversion to `T`).
    pub(crate) fn key(&self, seq: usize, pos: usize, head: usize) -> Vec<f32> {
        let keys = self.keys();
        let (h, d) = (keys.kv_heads(), keys.head_dim());
        let mut buf = vec![0.0; h * d];
        keys.read(seq, pos, &mut buf);
        buf[head * d..(head + 1) * d].to_vec()
    }
}
