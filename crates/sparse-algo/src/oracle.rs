//! The oracle: exact top-k by true attention probability, for evaluation only.

use serde::{Deserialize, Serialize};

use crate::exact::{logits, softmax_rows};
use crate::select::{Plan, budget_pages, top_k};
use crate::{AlgoError, AlwaysInclude, Caps, Decode, RepPool, SparseAlgorithm, TopK};

/// Scores every page by the attention probability mass its tokens receive from the group's
/// query heads (softmax over every visible key, summed over the heads of the KV group) and
/// keeps the best: the selection with the highest mass recall a budget allows. It reads every
/// key, so it costs more than dense attention; it exists to measure the other algorithms.
#[derive(Clone, Debug)]
pub struct Oracle {
    config: OracleConfig,
    budget_pages: usize,
}

/// Settings of [`Oracle`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OracleConfig {
    /// Tokens per selected id (1: token-level).
    pub page_size: usize,
    /// Tokens attended per step, forced pages included.
    pub budget_tokens: usize,
    /// Pages selected regardless of score.
    pub always: AlwaysInclude,
    /// Softmax scale; `None` is `1 / sqrt(head_dim)`.
    pub scale: Option<f32>,
}

impl Default for OracleConfig {
    fn default() -> Self {
        OracleConfig {
            page_size: 16,
            budget_tokens: 2048,
            always: AlwaysInclude::default(),
            scale: None,
        }
    }
}

impl Oracle {
    /// Validates the configuration.
    pub fn new(config: OracleConfig) -> Result<Self, AlgoError> {
        if config.scale.is_some_and(|s| !s.is_finite()) {
            return Err(AlgoError::Config(
                "the oracle's scale is not finite".to_owned(),
            ));
        }
        Ok(Oracle {
            budget_pages: budget_pages(config.budget_tokens, config.page_size)?,
            config,
        })
    }
}

impl SparseAlgorithm for Oracle {
    fn caps(&self) -> Caps {
        Caps {
            name: "oracle",
            page_size: self.config.page_size,
            decode: true,
            prefill_keep: false,
            reads_keys: true,
        }
    }

    fn max_pages(&self, kv_heads: usize) -> Option<usize> {
        let c = self.config;
        Some(kv_heads.saturating_mul(c.always.max_row_pages(c.budget_tokens, c.page_size)))
    }

    fn retrieve_topk(&self, step: &Decode<'_>, _pool: &RepPool) -> Result<TopK, AlgoError> {
        let g = step.validate()?;
        let keys = step.need_keys("oracle")?;
        let (kvh, d, ps) = (step.kv_heads, step.head_dim, self.config.page_size);
        let scale = self.config.scale.unwrap_or(1.0 / (d as f32).sqrt());
        let mut rows = Vec::with_capacity(step.num_seqs() * kvh);
        for (s, &len) in step.seq_lens.iter().enumerate() {
            let plan = Plan::new(len, ps, self.budget_pages, self.config.always);
            if plan.pick == 0 {
                rows.extend((0..kvh).map(|_| plan.assemble(Vec::new())));
                continue;
            }
            let q = &step.q[s * step.q_heads * d..(s + 1) * step.q_heads * d];
            let mut p = logits(keys, s, len, q, scale);
            softmax_rows(&mut p, len);
            for h in 0..kvh {
                let mut mass = vec![0.0f32; plan.mid.len()];
                for j in h * g..(h + 1) * g {
                    let row = &p[j * len..(j + 1) * len];
                    for (i, m) in mass.iter_mut().enumerate() {
                        let page = plan.mid.start + i;
                        *m += row[page * ps..((page + 1) * ps).min(len)]
                            .iter()
                            .sum::<f32>();
                    }
                }
                rows.push(plan.assemble(top_k(&mass, plan.mid.start, plan.pick)));
            }
        }
        Ok(TopK::from_rows(&rows, kvh, ps))
    }
}
