//! RocketKV: SnapKV-like eviction at prefill, then top-r-channel page selection at decode.

use attn_op::DType;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::algo::check_pool;
use crate::score::{Rows, Side, Weights, softmax_weights, sweep};
use crate::select::{budget_pages, plans, top_k};
use crate::snap::{Pooling, check_votes, keep_by_votes};
use crate::{
    AlgoError, AlwaysInclude, Caps, Decode, KeySource, Prompt, RepPool, RepShape, SparseAlgorithm,
    TopK, minmax,
};

/// RocketKV (Behnam et al., 2025), as TensorRT-LLM runs it.
///
/// Stage 1, at prefill ([`predict_keep`](SparseAlgorithm::predict_keep)): the last `window`
/// queries vote as in SnapKV, votes are max-pooled over `kernel_size` positions, and each KV head
/// keeps `prompt_budget - window` prefix tokens plus the window.
///
/// Stage 2, at decode: pages of `page_size` tokens keep their key min/max. For each KV group the
/// `topr` channels with the largest mean `|q|` over the group are used; per channel the sign of
/// the group's summed query picks the max (positive) or the min. Each query head scores pages
/// with those channels, the scores go through a softmax over tokens (a page counts once per token
/// it holds) with TensorRT-LLM's temperature `sqrt(d * sum_topr |q| / sum_all |q|)`, the
/// probabilities are averaged over the group, and the best pages within `topk` tokens are kept.
#[derive(Clone, Debug)]
pub struct RocketKv {
    config: RocketConfig,
    budget_pages: usize,
}

/// Settings of [`RocketKv`]; the defaults are TensorRT-LLM's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RocketConfig {
    /// Observation window of stage 1 (32).
    pub window_size: usize,
    /// Max-pooling kernel of stage 1, odd (63).
    pub kernel_size: usize,
    /// Tokens kept per KV head by stage 1, the window included (2048).
    pub prompt_budget: usize,
    /// Channels used for page scoring in stage 2 (128; capped at the head dimension).
    pub topr: usize,
    /// Tokens attended per decode step, in whole pages, forced pages included (64).
    pub topk: usize,
    /// Tokens per page of stage 2 (4).
    pub page_size: usize,
    /// Pages selected regardless of score.
    pub always: AlwaysInclude,
}

impl Default for RocketConfig {
    fn default() -> Self {
        RocketConfig {
            window_size: 32,
            kernel_size: 63,
            prompt_budget: 2048,
            topr: 128,
            topk: 64,
            page_size: 4,
            always: AlwaysInclude::default(),
        }
    }
}

impl RocketKv {
    /// Validates the configuration.
    pub fn new(config: RocketConfig) -> Result<Self, AlgoError> {
        check_votes(config.window_size, config.kernel_size, config.prompt_budget)?;
        if config.topr == 0 {
            return Err(AlgoError::Config("RocketKV topr 0".to_owned()));
        }
        Ok(RocketKv {
            budget_pages: budget_pages(config.topk, config.page_size)?,
            config,
        })
    }
}

impl SparseAlgorithm for RocketKv {
    fn caps(&self) -> Caps {
        Caps {
            name: "rocketkv",
            page_size: self.config.page_size,
            decode: true,
            prefill_keep: true,
            reads_keys: false,
        }
    }

    fn max_pages(&self, kv_heads: usize) -> Option<usize> {
        let c = self.config;
        Some(kv_heads.saturating_mul(c.always.max_row_pages(c.topk, c.page_size)))
    }

    fn rep_shape(&self, kv_heads: usize, head_dim: usize) -> RepShape {
        minmax::shape(self.config.page_size, kv_heads, head_dim)
    }

    fn rep_elem(&self, kv: DType) -> DType {
        // A key's min and max are values of its type.
        kv
    }

    fn update_representations(
        &self,
        layer: usize,
        keys: &dyn KeySource,
        slots: &[usize],
        pool: &mut RepPool,
    ) -> Result<(), AlgoError> {
        let shape = self.rep_shape(keys.kv_heads(), keys.head_dim());
        minmax::update(layer, keys, slots, pool, shape, crate::Summary::Exact)
    }

    fn predict_keep(&self, prompt: &Prompt<'_>) -> Result<TopK, AlgoError> {
        let c = self.config;
        keep_by_votes(
            prompt,
            c.window_size,
            c.kernel_size,
            Pooling::Max,
            c.prompt_budget,
        )
    }

    fn retrieve_topk(&self, step: &Decode<'_>, pool: &RepPool) -> Result<TopK, AlgoError> {
        let g = step.validate()?;
        let (kvh, d) = (step.kv_heads, step.head_dim);
        check_pool(pool, self.rep_shape(kvh, d))?;
        let ps = self.config.page_size;
        let plans = plans(step, pool, ps, self.budget_pages, self.config.always)?;
        let topr = self.config.topr.min(d);
        let mut rows = Vec::with_capacity(step.num_seqs() * kvh);
        for (s, plan) in plans.iter().enumerate() {
            if plan.pick == 0 {
                rows.extend((0..kvh).map(|_| plan.assemble(Vec::new())));
                continue;
            }
            let len = step.seq_lens[s];
            let heads: Vec<Channels> = (0..kvh)
                .map(|h| Channels::new(step.group_q(s, h), g, d, topr))
                .collect();
            let w: Vec<Weights<'_>> = heads
                .iter()
                .map(|c| Weights {
                    w: &c.w,
                    side: Side::Shared(&c.side),
                    g,
                    d,
                })
                .collect();
            // Every summarized page is scored: the softmax runs over all of them.
            let n = plan.mid.end;
            let reps = pool.reps(step.layer, step.slots[s])?;
            let scores = sweep(&w, reps, d, 0..n, Rows::All);
            let tokens: Vec<f32> = (0..n).map(|p| ((len - p * ps).min(ps)) as f32).collect();
            let per_head: Vec<Vec<i32>> = (0..kvh)
                .into_par_iter()
                .map(|h| {
                    let mut prob = vec![0.0f32; n];
                    let mut e = vec![0.0f32; n];
                    for j in 0..g {
                        let sc = &scores[(h * g + j) * n..(h * g + j + 1) * n];
                        let z = softmax_weights(sc, &tokens, heads[h].temp[j], &mut e);
                        let inv = (1.0 / z) as f32 / g as f32;
                        for (acc, &x) in prob.iter_mut().zip(&e) {
                            *acc += x * inv;
                        }
                    }
                    let mid = &prob[plan.mid.clone()];
                    plan.assemble(top_k(mid, plan.mid.start, plan.pick))
                })
                .collect();
            rows.extend(per_head);
        }
        Ok(TopK::from_rows(&rows, kvh, ps))
    }
}

/// One KV group's channel choice: weights that keep the top-r channels of the group's queries,
/// each channel read on the max or min side by the sign of its sum over the group (a side of
/// -1 reads `kmin`), and each query head's softmax temperature.
struct Channels {
    w: Vec<f32>,
    side: Vec<f32>,
    temp: Vec<f32>,
}

impl Channels {
    fn new(q: &[f32], g: usize, d: usize, topr: usize) -> Channels {
        // Channels by mean |q| over the group, ties to the lower channel.
        let mut mean_abs = vec![0.0f32; d];
        let mut sum = vec![0.0f32; d];
        for qj in q.chunks_exact(d) {
            for c in 0..d {
                mean_abs[c] += qj[c].abs();
                sum[c] += qj[c];
            }
        }
        let channels = top_k(&mean_abs, 0, topr);
        let mut w = vec![0.0f32; g * d];
        let mut side = vec![0.0f32; d];
        for &c in &channels {
            let c = c as usize;
            if sum[c] <= 0.0 || sum[c].is_nan() {
                side[c] = -1.0;
            }
            for j in 0..g {
                w[j * d + c] = q[j * d + c];
            }
        }
        let temp = q
            .chunks_exact(d)
            .map(|qj| {
                let all: f32 = qj.iter().map(|x| x.abs()).sum();
                let sel: f32 = channels.iter().map(|&c| qj[c as usize].abs()).sum();
                if all > 0.0 {
                    (d as f32 * sel / all).sqrt()
                } else {
                    1.0
                }
            })
            .collect();
        Channels { w, side, temp }
    }
}
