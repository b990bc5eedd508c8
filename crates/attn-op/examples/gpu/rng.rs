//! The deterministic generator of the GPU examples (attn-op's `gpu`, offload's `gpu_io`,
//! sparse-algo's `gpu_select` and coordinator's `gpu_step` include this file), so every run
//! draws the same inputs per seed.
#![allow(dead_code, reason = "each example uses a part")]

/// A small deterministic generator (xorshift64*), so every run draws the same inputs per seed.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `lo..hi`.
    pub(crate) fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo) as u64) as usize
    }

    /// Uniform in `[-1, 1)`.
    pub(crate) fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// A random permutation of `0..n`.
    pub(crate) fn permutation(&mut self, n: usize) -> Vec<usize> {
        let mut v: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            v.swap(i, self.range(0, i + 1));
        }
        v
    }

    /// `n` distinct values of `0..m`, ascending.
    pub(crate) fn subset(&mut self, n: usize, m: usize) -> Vec<i32> {
        let mut v: Vec<usize> = (0..m).collect();
        for i in 0..n.min(m) {
            let j = self.range(i, m);
            v.swap(i, j);
        }
        let mut s: Vec<i32> = v[..n.min(m)].iter().map(|&x| x as i32).collect();
        s.sort_unstable();
        s
    }
}
