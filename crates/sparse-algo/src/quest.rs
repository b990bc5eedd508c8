//! Quest: per-page key min/max and the per-dimension upper bound of `q · k`.

use attn_op::DType;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::algo::check_pool;
use crate::score::{Rows, Side, Weights, page_scores, sweep};
use crate::select::{budget_pages, plans, top_k};
use crate::{
    AlgoError, AlwaysInclude, Caps, Decode, KeySource, RepPool, RepShape, SparseAlgorithm, Summary,
    TopK, minmax,
};

/// Quest (Tang et al., 2024): each page is summarized by the elementwise maximum and minimum of
/// its keys; a page's score for query `q` is `sum_d max(q_d * kmin_d, q_d * kmax_d)`, an upper
/// bound of `q · k` for every key `k` of the page (the max of the two whole dot products, as
/// nano-vllm computes it, is not). Under GQA a page scores the maximum of the bounds of the
/// group's query heads, so it still bounds every head's true logits (with
/// [`QuestConfig::shared_heads`], of all query heads, and every KV head gets one selection). The budget is in tokens;
/// the always-include pages (by default the current, possibly partial page) are attended and
/// not estimated; a sequence with no more pages than the budget is selected whole without
/// estimation.
#[derive(Clone, Debug)]
pub struct Quest {
    config: QuestConfig,
    budget_pages: usize,
}

/// Settings of [`Quest`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QuestConfig {
    /// Tokens per page (Quest's default 16).
    pub page_size: usize,
    /// Tokens attended per step, forced pages included.
    pub budget_tokens: usize,
    /// Pages selected regardless of score.
    pub always: AlwaysInclude,
    /// One selection for every KV head of a sequence, by the maximum of the bounds over all
    /// query heads (still an upper bound for each head): a hierarchical cache then moves at
    /// most the budget per step instead of up to the budget times the KV heads.
    pub shared_heads: bool,
    /// How each page's bounds are stored: exactly, or in FP8 E4M3 rounded outward (half the
    /// metadata bytes; still upper bounds, looser ones).
    pub summary: Summary,
}

impl Default for QuestConfig {
    fn default() -> Self {
        QuestConfig {
            page_size: 16,
            budget_tokens: 2048,
            always: AlwaysInclude::default(),
            shared_heads: false,
            summary: Summary::Exact,
        }
    }
}

impl Quest {
    /// Validates the configuration.
    pub fn new(config: QuestConfig) -> Result<Self, AlgoError> {
        Ok(Quest {
            budget_pages: budget_pages(config.budget_tokens, config.page_size)?,
            config,
        })
    }

    /// The configuration.
    pub fn config(&self) -> QuestConfig {
        self.config
    }

    /// The budget in pages, forced pages included.
    pub fn budget_pages(&self) -> usize {
        self.budget_pages
    }

    /// The width of a device selection row: the most pages a decode row can hold, the larger
    /// of the budget's pages and the most forced pages a row can have (its scored pages fill
    /// only what the forced ones leave of the budget). The entries past a row's pages stay -1.
    pub fn row_width(&self) -> usize {
        let c = self.config;
        c.always.max_row_pages(c.budget_tokens, c.page_size)
    }
}

/// Quest's page score for one query head: `sum_d max(q_d * kmin_d, q_d * kmax_d)`, computed
/// exactly as [`Quest`] computes it (bit for bit), so callers can check its selections.
pub fn quest_bound(q: &[f32], kmax: &[f32], kmin: &[f32]) -> f32 {
    let d = q.len().min(kmax.len()).min(kmin.len());
    let w = weights(&q[..d]);
    let mut rep = kmax[..d].to_vec();
    rep.extend_from_slice(&kmin[..d]);
    let w = Weights {
        w: &w,
        side: Side::Own,
        g: 1,
        d,
    };
    let mut out = [0.0f32];
    page_scores(&w, &rep, 2 * d, 0, 0..1, &mut out);
    out[0]
}

/// A query's channel weights for the bound: the query itself, a NaN read as 0 (it bounds
/// nothing), each channel reading `kmin` where the weight's sign bit is set ([`Side::Own`]).
fn weights(q: &[f32]) -> Vec<f32> {
    q.iter()
        .map(|&x| if x.is_nan() { 0.0 } else { x })
        .collect()
}

impl SparseAlgorithm for Quest {
    fn caps(&self) -> Caps {
        Caps {
            name: "quest",
            page_size: self.config.page_size,
            decode: true,
            prefill_keep: false,
            reads_keys: false,
        }
    }

    fn max_pages(&self, kv_heads: usize) -> Option<usize> {
        let row = self.row_width();
        Some(if self.config.shared_heads {
            row
        } else {
            kv_heads.saturating_mul(row)
        })
    }

    fn rep_shape(&self, kv_heads: usize, head_dim: usize) -> RepShape {
        minmax::shape(self.config.page_size, kv_heads, head_dim)
    }

    fn rep_elem(&self, kv: DType) -> DType {
        // Every scaled E4M3 value is a bf16 value, and a key's min and max are values of its
        // type.
        match self.config.summary {
            Summary::E4m3 => DType::BF16,
            Summary::Exact => kv,
        }
    }

    fn update_representations(
        &self,
        layer: usize,
        keys: &dyn KeySource,
        slots: &[usize],
        pool: &mut RepPool,
    ) -> Result<(), AlgoError> {
        let shape = self.rep_shape(keys.kv_heads(), keys.head_dim());
        minmax::update(layer, keys, slots, pool, shape, self.config.summary)
    }

    fn retrieve_topk(&self, step: &Decode<'_>, pool: &RepPool) -> Result<TopK, AlgoError> {
        let g = step.validate()?;
        let (kvh, d) = (step.kv_heads, step.head_dim);
        check_pool(pool, self.rep_shape(kvh, d))?;
        let ps = self.config.page_size;
        let plans = plans(step, pool, ps, self.budget_pages, self.config.always)?;
        let mut rows = Vec::with_capacity(step.num_seqs() * kvh);
        for (s, plan) in plans.iter().enumerate() {
            if plan.pick == 0 {
                rows.extend((0..kvh).map(|_| plan.assemble(Vec::new())));
                continue;
            }
            let qs: Vec<Vec<f32>> = (0..kvh).map(|h| weights(step.group_q(s, h))).collect();
            let w: Vec<Weights<'_>> = qs
                .iter()
                .map(|w| Weights {
                    w,
                    side: Side::Own,
                    g,
                    d,
                })
                .collect();
            let reps = pool.reps(step.layer, step.slots[s])?;
            // The best bound of each KV head's group, or of every query head.
            let which = if self.config.shared_heads {
                Rows::Max
            } else {
                Rows::GroupMax
            };
            let best = sweep(&w, reps, d, plan.mid.clone(), which);
            let n = plan.mid.len();
            let pick = |r: usize| {
                plan.assemble(top_k(&best[r * n..(r + 1) * n], plan.mid.start, plan.pick))
            };
            let per_head: Vec<Vec<i32>> = if self.config.shared_heads {
                vec![pick(0); kvh]
            } else {
                (0..kvh).into_par_iter().map(pick).collect()
            };
            rows.extend(per_head);
        }
        Ok(TopK::from_rows(&rows, kvh, ps))
    }
}
