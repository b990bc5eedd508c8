//! A naive f64 attention written for the tests, and random batches to feed it.

use attn_op::{AttnParams, BatchMeta, Element, KvLayout, PagedKv};

/// SplitMix64: a small seeded generator, so cases are reproducible from their seed.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..hi` (`hi > lo`).
    pub(crate) fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo) as u64) as usize
    }

    /// Uniform in [-1, 1), never exactly zero in practice.
    pub(crate) fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// A random batch: a KV pool with shuffled blocks (unused blocks hold garbage), metadata for a
/// mix of decodes, chunked prefills and full prefills, and queries.
pub(crate) struct Case<T: Element> {
    pub(crate) kv: PagedKv<T>,
    pub(crate) q: Vec<T>,
    pub(crate) cu: Vec<i32>,
    pub(crate) lens: Vec<i32>,
    pub(crate) table: Vec<i32>,
    pub(crate) max_blocks: usize,
    pub(crate) params: AttnParams,
}

/// Shape knobs of a random case.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shape {
    pub(crate) seqs: usize,
    pub(crate) block_size: usize,
    pub(crate) kv_heads: usize,
    pub(crate) group: usize,
    pub(crate) head_dim: usize,
    pub(crate) max_kv: usize,
    /// 0: decode only, 1: prefill only, 2: mixed.
    pub(crate) mode: u8,
}

impl<T: Element> Case<T> {
    pub(crate) fn random(shape: Shape, rng: &mut Rng) -> Self {
        let Shape {
            seqs,
            block_size: bs,
            kv_heads,
            group,
            head_dim: d,
            max_kv,
            mode,
        } = shape;
        let mut lens = Vec::new();
        let mut cu = vec![0i32];
        for s in 0..seqs {
            let kv = rng.range(1, max_kv + 1);
            let q = match (mode, s % 2) {
                (0, _) | (2, 0) => 1,
                _ => rng.range(1, kv + 1),
            };
            lens.push(kv as i32);
            cu.push(cu[s] + q as i32);
        }
        let max_blocks = lens
            .iter()
            .map(|&l| (l as usize).div_ceil(bs))
            .max()
            .unwrap_or(0)
            + 1;
        let used: usize = lens.iter().map(|&l| (l as usize).div_ceil(bs)).sum();
        let num_blocks = used + 3;
        let mut perm: Vec<i32> = (0..num_blocks as i32).collect();
        for i in (1..perm.len()).rev() {
            perm.swap(i, rng.range(0, i + 1));
        }
        let mut table = vec![-1; seqs * max_blocks];
        let mut next = 0;
        for (s, &l) in lens.iter().enumerate() {
            for b in 0..(l as usize).div_ceil(bs) {
                table[s * max_blocks + b] = perm[next];
                next += 1;
            }
        }
        let layout = KvLayout {
            num_blocks,
            block_size: bs,
            kv_heads,
            head_dim: d,
        };
        let mut fill = |n: usize, amp: f32| {
            (0..n)
                .map(|_| T::from_f32(amp * rng.unit()))
                .collect::<Vec<T>>()
        };
        let k = fill(layout.len(), 1.0);
        let v = fill(layout.len(), 1.0);
        let total_q = *cu.last().expect("non-empty") as usize;
        let q = fill(total_q * kv_heads * group * d, 2.0);
        let kv = PagedKv::from_tensors(layout, k, v).expect("consistent");
        let params = AttnParams::new(kv_heads * group, d);
        Case {
            kv,
            q,
            cu,
            lens,
            table,
            max_blocks,
            params,
        }
    }

    /// The same batch over a pool of `block_size` blocks, shuffled (unused ones hold garbage).
    pub(crate) fn reblock(&self, block_size: usize, rng: &mut Rng) -> Self {
        let old = self.layout();
        let stride = old.kv_heads * old.head_dim;
        let max_blocks = self
            .lens
            .iter()
            .map(|&l| (l as usize).div_ceil(block_size))
            .max()
            .unwrap_or(0)
            + 1;
        let used: usize = self
            .lens
            .iter()
            .map(|&l| (l as usize).div_ceil(block_size))
            .sum();
        let layout = KvLayout {
            num_blocks: used + 2,
            block_size,
            ..old
        };
        let mut perm: Vec<i32> = (0..layout.num_blocks as i32).collect();
        for i in (1..perm.len()).rev() {
            perm.swap(i, rng.range(0, i + 1));
        }
        let garbage = |rng: &mut Rng| {
            (0..layout.len())
                .map(|_| T::from_f32(rng.unit()))
                .collect::<Vec<T>>()
        };
        let (mut k, mut v) = (garbage(rng), garbage(rng));
        let mut table = vec![-1; self.lens.len() * max_blocks];
        let mut next = 0;
        for (s, &l) in self.lens.iter().enumerate() {
            for b in 0..(l as usize).div_ceil(block_size) {
                table[s * max_blocks + b] = perm[next];
                next += 1;
            }
            for p in 0..l as usize {
                let from = self.table[s * self.max_blocks + p / old.block_size] as usize
                    * old.block_size
                    + p % old.block_size;
                let to =
                    table[s * max_blocks + p / block_size] as usize * block_size + p % block_size;
                k[to * stride..(to + 1) * stride]
                    .copy_from_slice(&self.kv.k()[from * stride..(from + 1) * stride]);
                v[to * stride..(to + 1) * stride]
                    .copy_from_slice(&self.kv.v()[from * stride..(from + 1) * stride]);
            }
        }
        Case {
            kv: PagedKv::from_tensors(layout, k, v).expect("consistent"),
            q: self.q.clone(),
            cu: self.cu.clone(),
            lens: self.lens.clone(),
            table,
            max_blocks,
            params: self.params.clone(),
        }
    }

    pub(crate) fn meta(&self) -> BatchMeta<'_> {
        BatchMeta {
            cu_seqlens_q: &self.cu,
            seq_lens_kv: &self.lens,
            block_table: &self.table,
            max_blocks: self.max_blocks,
        }
    }

    pub(crate) fn layout(&self) -> KvLayout {
        attn_op::KvCache::<attn_op::Host>::layout(&self.kv)
    }

    pub(crate) fn total_q(&self) -> usize {
        *self.cu.last().expect("non-empty") as usize
    }

    /// The f64 oracle: for each query row, softmax over the visible keys among those `allowed`
    /// (sequence, KV head, position) admits. Returns (out, lse).
    pub(crate) fn oracle(
        &self,
        allowed: &dyn Fn(usize, usize, usize) -> bool,
    ) -> (Vec<f64>, Vec<f64>) {
        let l = self.layout();
        let (bs, d, hkv) = (l.block_size, l.head_dim, l.kv_heads);
        let hq = self.params.q_heads;
        let group = hq / hkv;
        let total = self.total_q();
        let mut out = vec![0.0; total * hq * d];
        let mut lse = vec![f64::NEG_INFINITY; total * hq];
        let kf = |slot: usize, h: usize, i: usize| -> f64 {
            self.kv.k()[(slot * hkv + h) * d + i].to_f32().into()
        };
        let vf = |slot: usize, h: usize, i: usize| -> f64 {
            self.kv.v()[(slot * hkv + h) * d + i].to_f32().into()
        };
        for s in 0..self.lens.len() {
            let kv_len = self.lens[s] as usize;
            let (q0, q1) = (self.cu[s] as usize, self.cu[s + 1] as usize);
            for (i, tok) in (q0..q1).enumerate() {
                let p = (kv_len - (q1 - q0) + i) as i64;
                for qh in 0..hq {
                    let h = qh / group;
                    let qv: Vec<f64> = (0..d)
                        .map(|x| f64::from(self.q[(tok * hq + qh) * d + x].to_f32()))
                        .collect();
                    let mut scores = Vec::new();
                    for pos in 0..kv_len {
                        let visible = pos as i64 <= p
                            && match self.params.window {
                                None => true,
                                Some(w) => {
                                    pos as i64 > p - i64::from(w)
                                        || (pos as u32) < self.params.sink_tokens
                                }
                            };
                        if !visible || !allowed(s, h, pos) {
                            continue;
                        }
                        let slot =
                            self.table[s * self.max_blocks + pos / bs] as usize * bs + pos % bs;
                        let dotp: f64 = (0..d).map(|x| qv[x] * kf(slot, h, x)).sum();
                        scores.push((dotp * f64::from(self.params.scale), slot));
                    }
                    let sink = self.params.sink_logits.as_ref().map(|s| f64::from(s[qh]));
                    let m = scores
                        .iter()
                        .map(|x| x.0)
                        .chain(sink)
                        .fold(f64::NEG_INFINITY, f64::max);
                    if m == f64::NEG_INFINITY {
                        continue;
                    }
                    let denom: f64 = scores.iter().map(|x| (x.0 - m).exp()).sum::<f64>()
                        + sink.map_or(0.0, |s| (s - m).exp());
                    for x in 0..d {
                        let num: f64 = scores
                            .iter()
                            .map(|&(sc, slot)| (sc - m).exp() * vf(slot, h, x))
                            .sum();
                        out[(tok * hq + qh) * d + x] = num / denom;
                    }
                    lse[tok * hq + qh] = m + denom.ln();
                }
            }
        }
        (out, lse)
    }
}

/// Asserts `got` matches the oracle within `tol` (absolute, on values of order 1).
pub(crate) fn assert_close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = if w == f64::NEG_INFINITY {
            g == f32::NEG_INFINITY
        } else {
            (f64::from(g) - w).abs() <= tol * (1.0 + w.abs())
        };
        assert!(ok, "{what}[{i}]: got {g}, oracle {w}");
    }
}
