//! SnapKV: prefill-time eviction by the votes of an observation window, and the voting that
//! RocketKV's first stage shares.

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::exact::{logits, softmax_rows};
use crate::select::top_k;
use crate::{AlgoError, Caps, Prompt, SparseAlgorithm, TopK};

/// SnapKV (Li et al., 2024): the queries of the prompt's last `window` positions vote for prefix
/// tokens with their attention probabilities (summed over the window and the KV group's query
/// heads), the votes are pooled over neighbouring positions, and each KV head keeps its
/// `capacity - window` best prefix tokens plus the window. Prompts of at most `capacity`
/// tokens are kept whole. Votes use the softmax scale `1 / sqrt(head_dim)`. Prefill only: its output is the keep list for
/// [`attn_op::compact_kv`]; decode then attends the compacted cache densely.
#[derive(Clone, Debug)]
pub struct SnapKv {
    config: SnapKvConfig,
}

/// How votes are smoothed over neighbouring positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pooling {
    /// Mean over the kernel, zero padded (SnapKV).
    Avg,
    /// Maximum over the kernel (RocketKV).
    Max,
}

/// Settings of [`SnapKv`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SnapKvConfig {
    /// Observation window: the last prompt positions that vote (32).
    pub window: usize,
    /// Pooling kernel, odd (5).
    pub kernel_size: usize,
    /// Pooling kind (average).
    pub pooling: Pooling,
    /// Tokens kept per KV head, the window included (2048).
    pub capacity: usize,
}

impl Default for SnapKvConfig {
    fn default() -> Self {
        SnapKvConfig {
            window: 32,
            kernel_size: 5,
            pooling: Pooling::Avg,
            capacity: 2048,
        }
    }
}

impl SnapKv {
    /// Validates the configuration.
    pub fn new(config: SnapKvConfig) -> Result<Self, AlgoError> {
        check_votes(config.window, config.kernel_size, config.capacity)?;
        Ok(SnapKv { config })
    }
}

/// Validates window, kernel and capacity of a voting stage.
pub(crate) fn check_votes(window: usize, kernel: usize, capacity: usize) -> Result<(), AlgoError> {
    if window == 0 || kernel == 0 || kernel.is_multiple_of(2) || capacity <= window {
        return Err(AlgoError::Config(format!(
            "observation window {window}, kernel {kernel}, capacity {capacity}: the window and \
             an odd kernel must be at least 1 and the capacity must exceed the window"
        )));
    }
    Ok(())
}

impl SparseAlgorithm for SnapKv {
    fn caps(&self) -> Caps {
        Caps {
            name: "snapkv",
            page_size: 1,
            decode: false,
            prefill_keep: true,
            reads_keys: true,
        }
    }

    fn predict_keep(&self, prompt: &Prompt<'_>) -> Result<TopK, AlgoError> {
        let c = self.config;
        keep_by_votes(prompt, c.window, c.kernel_size, c.pooling, c.capacity)
    }
}

/// The keep list of a voting stage (SnapKV, RocketKV stage 1).
pub(crate) fn keep_by_votes(
    prompt: &Prompt<'_>,
    window: usize,
    kernel: usize,
    pooling: Pooling,
    capacity: usize,
) -> Result<TopK, AlgoError> {
    let (g, rows) = prompt.validate()?;
    let keys = prompt.keys;
    let (kvh, d) = (keys.kv_heads(), keys.head_dim());
    let scale = 1.0 / (d as f32).sqrt();
    let row_len = prompt.q_heads * d;
    let mut out = Vec::with_capacity(rows.len() * kvh);
    for (s, q_rows) in rows.iter().enumerate() {
        let len = keys.seq_len(s);
        if len <= capacity {
            out.extend((0..kvh).map(|_| (0..len as i32).collect::<Vec<_>>()));
            continue;
        }
        if q_rows.len() < window {
            return Err(AlgoError::Invalid(format!(
                "prompt {s}: voting needs the queries of its last {window} positions, got {}",
                q_rows.len()
            )));
        }
        let prefix = len - window;
        // votes[h][t] for prefix positions t, summed over the window and the group.
        let first = q_rows.end - window;
        let per_query: Vec<Vec<f32>> = (0..window)
            .into_par_iter()
            .map(|i| {
                let q = &prompt.q[(first + i) * row_len..(first + i + 1) * row_len];
                let visible = prefix + i + 1;
                let mut p = logits(keys, s, visible, q, scale);
                softmax_rows(&mut p, visible);
                let mut v = vec![0.0f32; kvh * prefix];
                for j in 0..prompt.q_heads {
                    let h = j / g;
                    for (acc, &x) in v[h * prefix..(h + 1) * prefix]
                        .iter_mut()
                        .zip(&p[j * visible..j * visible + prefix])
                    {
                        *acc += x;
                    }
                }
                v
            })
            .collect();
        let mut votes = vec![0.0f32; kvh * prefix];
        for v in &per_query {
            votes.iter_mut().zip(v).for_each(|(a, &b)| *a += b);
        }
        for h in 0..kvh {
            let pooled = pool(&votes[h * prefix..(h + 1) * prefix], kernel, pooling);
            let mut keep = top_k(&pooled, 0, capacity - window);
            keep.sort_unstable();
            keep.extend(prefix as i32..len as i32);
            out.push(keep);
        }
    }
    Ok(TopK::from_rows(&out, kvh, 1))
}

/// Same-length 1-D pooling with `kernel / 2` padding on each side (zeros for the mean,
/// nothing for the maximum).
fn pool(x: &[f32], kernel: usize, pooling: Pooling) -> Vec<f32> {
    let r = kernel / 2;
    let n = x.len();
    match pooling {
        Pooling::Avg => {
            let mut prefix = vec![0.0f64; n + 1];
            for (i, &v) in x.iter().enumerate() {
                prefix[i + 1] = prefix[i] + f64::from(v);
            }
            (0..n)
                .map(|i| {
                    let (a, b) = (i.saturating_sub(r), (i + r + 1).min(n));
                    ((prefix[b] - prefix[a]) / kernel as f64) as f32
                })
                .collect()
        }
        Pooling::Max => (0..n)
            .map(|i| {
                x[i.saturating_sub(r)..(i + r + 1).min(n)]
                    .iter()
                    .copied()
                    .fold(f32::NEG_INFINITY, f32::max)
            })
            .collect(),
    }
}
