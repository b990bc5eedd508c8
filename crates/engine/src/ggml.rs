//! llama.cpp's rounding, reproduced: the attention of its CPU backend and the pieces of its
//! forward that round differently from ours ([`Model::like_llama_cpp`]).
//!
//! A 135M Q4_1 model turns one flipped rounding into logits that move by tenths, so two
//! correct forwards that round differently agree on the next token at only 0.95–0.97 (llama.cpp
//! against itself with flash attention on, or with an f32 KV cache). To compare the engine's
//! forward with llama.cpp beyond that noise, this module computes what llama.cpp's CPU backend
//! computes, operation for operation, in its order of f32 sums. The reference build is
//! llama-cpp-python 0.3.16 compiled by GCC for an AVX-512 x86-64 CPU with its defaults (an f16
//! KV cache, no flash attention). On that build the engine's logits equal llama.cpp's bit for
//! bit (BENCHMARKS.md). The orders below are that build's:
//!
//! - scores and the weighted sum of V in a batch of two or more tokens: llamafile's tinyBLAS
//!   (16 lanes, each a chain of fused multiply-adds over the chunks of 16, then GCC's
//!   `_mm512_reduce_add_ps` tree);
//! - in a batch of one token: `ggml_vec_dot_f16` (four accumulators of 16 lanes over steps of
//!   64, then the rest added in f64);
//! - the softmax: ggml's polynomial `expf`, sums of 16 lanes added in f64, then a multiply by
//!   the f32 reciprocal; the probabilities are rounded to f16 before they meet V.
//!
//! [`Model::like_llama_cpp`]: crate::Model::like_llama_cpp

use half::f16;
use rayon::prelude::*;

use crate::{Attention, EngineError, ModelConfig};

/// Dense causal attention computed as llama.cpp's CPU backend computes it, over its own f16 KV
/// cache: each call appends the batch's keys and values to layer `layer`'s cache, and the
/// batch's tokens follow the cached ones (token `i` of a batch sees every cached token and
/// the batch's tokens `0..=i`).
pub struct GgmlAttention {
    /// Per layer, the keys `[tokens, kv_heads, head_dim]`.
    k: Vec<Vec<f16>>,
    /// Per layer, the values, in the same layout.
    v: Vec<Vec<f16>>,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl GgmlAttention {
    /// An empty cache for a model of shape `c`.
    pub fn new(c: &ModelConfig) -> GgmlAttention {
        GgmlAttention {
            k: vec![Vec::new(); c.layers],
            v: vec![Vec::new(); c.layers],
            q_heads: c.q_heads,
            kv_heads: c.kv_heads,
            head_dim: c.head_dim,
        }
    }

    /// Tokens in layer `layer`'s cache (0 for a layer the model does not have).
    pub fn len(&self, layer: usize) -> usize {
        self.k
            .get(layer)
            .map_or(0, |k| k.len() / (self.kv_heads * self.head_dim).max(1))
    }

    /// Whether every layer's cache is empty.
    pub fn is_empty(&self) -> bool {
        self.k.iter().all(Vec::is_empty)
    }
}

impl Attention for GgmlAttention {
    fn attend(
        &mut self,
        layer: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        let (d, qh, kvh) = (self.head_dim, self.q_heads, self.kv_heads);
        let n = q.len() / (qh * d).max(1);
        if layer >= self.k.len()
            || kvh == 0
            || qh % kvh != 0
            || q.len() != n * qh * d
            || k.len() != n * kvh * d
            || v.len() != n * kvh * d
            || out.len() != q.len()
        {
            return Err(EngineError::Invalid(format!(
                "GgmlAttention: layer {layer} of {}, {} query, {} key, {} value and {} output \
                 values for {qh} query / {kvh} KV heads of {d}",
                self.k.len(),
                q.len(),
                k.len(),
                v.len(),
                out.len()
            )));
        }
        let start = self.len(layer);
        self.k[layer].extend(k.iter().map(|&x| f16::from_f32(x)));
        self.v[layer].extend(v.iter().map(|&x| f16::from_f32(x)));
        let (kc, vc) = (&self.k[layer], &self.v[layer]);
        // llamafile's tinyBLAS takes a batch of two or more tokens when the dot products'
        // length is a multiple of its 16 lanes; anything else runs ggml_vec_dot_f16.
        let batched = n >= 2 && d % 16 == 0;
        let scale = 1.0 / (d as f32).sqrt();
        out.par_chunks_mut(d).enumerate().for_each(|(row, o)| {
            let (i, h) = (row / qh, row % qh);
            let len = start + i + 1;
            let g = h / (qh / kvh);
            let key = |j: usize| &kc[(j * kvh + g) * d..][..d];
            let q16: Vec<f32> = q[row * d..][..d]
                .iter()
                .map(|&x| f16::from_f32(x).to_f32())
                .collect();
            let scores: Vec<f32> = (0..len)
                .map(|j| {
                    let k = key(j);
                    let dot = if batched {
                        lanes_dot(d, |c| k[c].to_f32() * q16[c])
                    } else {
                        vec_dot(d, |c| k[c].to_f32() * q16[c])
                    };
                    dot * scale
                })
                .collect();
            let p = probabilities(&scores);
            for (c, o) in o.iter_mut().enumerate() {
                let term = |j: usize| vc[(j * kvh + g) * d + c].to_f32() * p[j];
                *o = if batched {
                    lanes_dot(len, term)
                } else {
                    // The cache's rows run to a multiple of 32 tokens (llama.cpp's padding
                    // without flash attention); past `len` every probability is 0.
                    vec_dot_padded(len, len.div_ceil(32) * 32, term)
                };
            }
        });
        Ok(())
    }
}

/// llama.cpp's softmax of one row of scores, each probability rounded to f16: ggml's `expf`
/// of each score less the row's maximum, sums of 16 lanes added in f64, and a multiply by the
/// f32 reciprocal of the total.
fn probabilities(scores: &[f32]) -> Vec<f32> {
    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
    let e: Vec<f32> = scores.iter().map(|&s| expf(s - max)).collect();
    let mut sum = 0.0f64;
    for chunk in e.chunks(16) {
        let mut lanes = [0.0f32; 16];
        lanes[..chunk.len()].copy_from_slice(chunk);
        sum += f64::from(reduce16(&lanes));
    }
    let inv = (1.0 / sum) as f32;
    e.iter().map(|&x| f16::from_f32(x * inv).to_f32()).collect()
}

/// `Σ term(i)` over `0..n` in tinyBLAS's order: lane `i % 16` adds its terms in order, then
/// [`reduce16`]. Each term is a product of two f16 values, exact in f32, so an fma adding it
/// rounds as this addition does.
fn lanes_dot(n: usize, term: impl Fn(usize) -> f32) -> f32 {
    let mut lanes = [0.0f32; 16];
    for i in 0..n {
        lanes[i % 16] += term(i);
    }
    reduce16(&lanes)
}

/// `Σ term(i)` over `0..n` in `ggml_vec_dot_f16`'s order for a row of `n` elements.
fn vec_dot(n: usize, term: impl Fn(usize) -> f32) -> f32 {
    vec_dot_padded(n, n, term)
}

/// `ggml_vec_dot_f16`'s order over a row of `row` elements whose terms past `n` are zero:
/// four accumulators of 16 lanes over steps of 64, summed pairwise, [`reduce16`]; the last
/// `row % 64` terms are added in f64 after them.
fn vec_dot_padded(n: usize, row: usize, term: impl Fn(usize) -> f32) -> f32 {
    let steps = row / 64 * 64;
    let mut acc = [[0.0f32; 16]; 4];
    for i in 0..steps.min(n) {
        acc[(i % 64) / 16][i % 16] += term(i);
    }
    let mut z = [0.0f32; 16];
    for (l, z) in z.iter_mut().enumerate() {
        *z = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    }
    let mut sum = f64::from(reduce16(&z));
    for i in steps..n {
        sum += f64::from(term(i));
    }
    sum as f32
}

/// The sum of 16 lanes in the tree of GCC's `_mm512_reduce_add_ps`: halves, then quarters,
/// then pairs.
fn reduce16(v: &[f32; 16]) -> f32 {
    let mut t = [0.0f32; 8];
    for (i, t) in t.iter_mut().enumerate() {
        *t = v[8 + i] + v[i];
    }
    let u = [t[4] + t[0], t[5] + t[1], t[6] + t[2], t[7] + t[3]];
    (u[0] + u[2]) + (u[1] + u[3])
}

/// ggml's vectorized `expf` (`ggml_v_expf`, after Arm's optimized routines), lane by lane:
/// within 1.5 ulp of `exp`; 0 below about -104 and infinity above about 88.4.
pub(crate) fn expf(x: f32) -> f32 {
    let c = f32::from_bits;
    // 1.5 · 2^23: adding it rounds to an integer.
    let round = c(0x4b40_0000);
    let n = x.mul_add(c(0x3fb8_aa3b), round) - round;
    // x - n · ln 2, with ln 2 in two parts.
    let b = (-n).mul_add(c(0x35bf_be8e), (-n).mul_add(c(0x3f31_7200), x));
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    let u = b * b;
    let j = c(0x3c07_2010)
        .mul_add(b, c(0x3d2b_9f17))
        .mul_add(u, c(0x3e2a_af33).mul_add(b, c(0x3eff_fedb)))
        .mul_add(u, c(0x3f7f_fff6).mul_add(b, 1.0));
    // `_mm512_scalef_ps`: j · 2^n rounded once (|n| ≤ 192, so f64 holds it exactly).
    (f64::from(j) * 2f64.powi(n as i32)) as f32
}

/// `x / (1 + e^-x)` with ggml's [`expf`], as its SwiGLU computes it.
pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + expf(0.0 - x))
}

/// RoPE's `(sin, cos)` per rotated pair of a token at position `p`, as ggml builds its cache:
/// the angle starts at `p` and is multiplied by `base^(-2 / dims)` in f32 from one pair to the
/// next.
pub(crate) fn rope_angles(p: usize, pairs: usize, base: f32, dims: usize) -> Vec<(f32, f32)> {
    let step = base.powf(-2.0 / dims as f32);
    let mut theta = p as f32;
    (0..pairs)
        .map(|_| {
            let r = (theta.sin(), theta.cos());
            theta *= step;
            r
        })
        .collect()
}

/// One pair `(a, b)` rotated by `(sin, cos)` as GCC contracts ggml's
/// `a·cos - b·sin, a·sin + b·cos`: the first product of each fused with the sum.
pub(crate) fn rotate(a: f32, b: f32, sin: f32, cos: f32) -> (f32, f32) {
    (a.mul_add(cos, -(b * sin)), a.mul_add(sin, b * cos))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in units of the last place between two finite f32 of the same sign.
    fn ulps(a: f32, b: f32) -> u32 {
        a.to_bits().abs_diff(b.to_bits())
    }

    #[test]
    fn expf_is_within_two_ulp_of_exp_and_saturates() {
        let mut worst = 0;
        for i in 0..=190_000 {
            let x = -103.0 + i as f32 * 0.001;
            let want = (f64::from(x)).exp() as f32;
            if want.is_normal() {
                worst = worst.max(ulps(expf(x), want));
            }
        }
        assert!(worst <= 2, "ggml's expf is {worst} ulp from exp");
        assert_eq!(expf(-200.0), 0.0);
        assert_eq!(expf(f32::NEG_INFINITY), 0.0);
        assert_eq!(expf(200.0), f32::INFINITY);
        assert_eq!(expf(0.0), 1.0);
    }

    #[test]
    fn sums_follow_their_orders() {
        // One term of 2^24 among ones: 2^24 + 1 rounds back to 2^24 (a tie, to even), so
        // each order keeps a different share of the ones. A left-to-right f32 sum keeps none.
        const BIG: f32 = 16_777_216.0;
        let term = |i: usize| if i == 0 { BIG } else { 1.0 };
        let mut v = [1.0f32; 16];
        v[0] = BIG;
        // Halves: 2^24 + 1 -> 2^24, the other lanes 2; then 2^24 + 2 + 4 + 8 exactly.
        assert_eq!(reduce16(&v), BIG + 14.0);
        // Lane 0 adds its second term (lost); lanes 1..16 hold 2 each; the tree adds 30.
        assert_eq!(lanes_dot(32, term), BIG + 30.0);
        // Four accumulators over 64 terms (one lost where lane 0's pair meets), then 16
        // leftovers added in f64, all kept.
        assert_eq!(vec_dot(80, term), BIG + 78.0);
        // A row padded to 64 takes all 40 terms into the accumulators; unpadded, all 40 are
        // leftovers added in f64 (2^24 + 39, a tie, rounds to 2^24 + 40).
        assert_eq!(vec_dot_padded(40, 64, term), BIG + 38.0);
        assert_eq!(vec_dot(40, term), BIG + 40.0);
        assert_eq!((0..80).map(term).sum::<f32>(), BIG);
    }

    #[test]
    fn probabilities_sum_to_one_within_f16() {
        let scores: Vec<f32> = (0..37)
            .map(|i| ((i * 7919) % 23) as f32 * 0.37 - 3.0)
            .collect();
        let p = probabilities(&scores);
        let total: f32 = p.iter().sum();
        assert!((total - 1.0).abs() < 1e-2, "{total}");
        assert!(p.iter().all(|&x| f16::from_f32(x).to_f32() == x));
        let best = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let at = scores
            .iter()
            .position(|&s| s == best)
            .expect("a maximum exists");
        assert!(p.iter().all(|&x| x <= p[at]));
    }
}
