//! Exact attention logits and probabilities of a decode query, for the oracle, SnapKV's votes,
//! the DSA fallback and the metrics.

use rayon::prelude::*;

use crate::KeySource;
use crate::score::dots;

/// Tokens per parallel chunk when reading keys.
const CHUNK: usize = 1024;

/// `scale * q_j · k_t` for every query head `j` (`q` is `[q_heads, head_dim]`; head `j` reads KV
/// head `j / (q_heads / kv_heads)`) and every position `t < len` of `seq`: `[q_heads, len]`.
pub(crate) fn logits(
    keys: &dyn KeySource,
    seq: usize,
    len: usize,
    q: &[f32],
    scale: f32,
) -> Vec<f32> {
    let (kvh, d) = (keys.kv_heads(), keys.head_dim());
    let qh = q.len() / d;
    let g = qh / kvh;
    let chunks: Vec<Vec<f32>> = (0..len.div_ceil(CHUNK))
        .into_par_iter()
        .map(|c| {
            let start = c * CHUNK;
            let n = (len - start).min(CHUNK);
            let mut buf = vec![0.0f32; n * kvh * d];
            keys.read(seq, start, &mut buf);
            let mut head = vec![0.0f32; n * d];
            let mut out = vec![0.0f32; qh * n];
            for h in 0..kvh {
                for t in 0..n {
                    head[t * d..(t + 1) * d]
                        .copy_from_slice(&buf[(t * kvh + h) * d..(t * kvh + h + 1) * d]);
                }
                for j in h * g..(h + 1) * g {
                    let o = &mut out[j * n..(j + 1) * n];
                    dots(&q[j * d..(j + 1) * d], &head, d, o);
                    o.iter_mut().for_each(|x| *x *= scale);
                }
            }
            out
        })
        .collect();
    let mut all = vec![0.0f32; qh * len];
    for (c, chunk) in chunks.iter().enumerate() {
        let start = c * CHUNK;
        let n = chunk.len() / qh;
        for j in 0..qh {
            all[j * len + start..j * len + start + n].copy_from_slice(&chunk[j * n..(j + 1) * n]);
        }
    }
    all
}

/// Softmax of each row of `x` (rows of `len`) in place, in f64 for the sums.
pub(crate) fn softmax_rows(x: &mut [f32], len: usize) {
    for row in x.chunks_exact_mut(len) {
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f64;
        for v in row.iter_mut() {
            *v = (*v - m).exp();
            sum += f64::from(*v);
        }
        let inv = (1.0 / sum) as f32;
        row.iter_mut().for_each(|v| *v *= inv);
    }
}
