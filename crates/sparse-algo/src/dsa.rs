//! A DSA-style indexer (DeepSeek V3.2's lightning indexer): token-level top-k.

use std::sync::Arc;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::algo::{check_batch, check_pool};
use crate::exact::logits;
use crate::pool::f32_only;
use crate::score::dots;
use crate::select::{Plan, top_k};
use crate::{
    AlgoError, AlwaysInclude, Caps, Decode, KeySource, RepPool, RepShape, Reps, SparseAlgorithm,
    TopK,
};

/// A model's trained indexer: small per-token keys and per-step queries with head weights.
/// The token score is `I(t, s) = sum_j w_j * relu(q_j · k_idx(s))` (DeepSeek V3.2: 64 heads of
/// dimension 128). The model computes these from its hidden states, which this crate never
/// sees, so the model implements this trait and stashes whatever it needs before each call.
pub trait Indexer: Send + Sync {
    /// Indexer heads.
    fn heads(&self) -> usize;
    /// Elements of an indexer key or query.
    fn dim(&self) -> usize;
    /// Writes the indexer keys of positions `start..start + n` of sequence `seq` of `layer`
    /// into `dst` (`[n, dim]`, `n = dst.len() / dim`).
    fn keys(&self, layer: usize, seq: usize, start: usize, dst: &mut [f32]);
    /// Writes the indexer queries `[heads, dim]` and head weights `[heads]` of the current
    /// decode step of sequence `seq` of `layer`.
    fn queries(&self, layer: usize, seq: usize, q: &mut [f32], weights: &mut [f32]);
}

/// DSA-style token selection: the `topk` tokens with the highest indexer score, shared by every
/// KV head (one row per KV head, all equal).
///
/// With a model [`Indexer`], indexer keys live in the representation pool (one vector of
/// `dim` per token) and a step reads only them. Without one (a model that has no trained
/// indexer), the generic fallback applies the same formula to the attention itself: every query
/// head is an indexer head of weight `1 / q_heads` and its "indexer key" is the token's key of
/// its KV group, so `I(s) = mean_j relu(scale * q_j · k_{g(j)}(s))`. The fallback reads every
/// key (a dense pass) and so saves no bandwidth; it is a heuristic baseline, not DeepSeek's
/// trained indexer.
#[derive(Clone)]
pub struct Dsa {
    config: DsaConfig,
    indexer: Option<Arc<dyn Indexer>>,
}

/// Settings of [`Dsa`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DsaConfig {
    /// Tokens attended per step, forced tokens included (DeepSeek's 2048).
    pub topk: usize,
    /// Tokens selected regardless of score.
    pub always: AlwaysInclude,
}

impl Default for DsaConfig {
    fn default() -> Self {
        DsaConfig {
            topk: 2048,
            always: AlwaysInclude::default(),
        }
    }
}

impl std::fmt::Debug for Dsa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dsa")
            .field("config", &self.config)
            .field("trained_indexer", &self.indexer.is_some())
            .finish()
    }
}

impl Dsa {
    /// Validates the configuration; `indexer` `None` selects the generic fallback.
    pub fn new(config: DsaConfig, indexer: Option<Arc<dyn Indexer>>) -> Result<Self, AlgoError> {
        if config.topk == 0 {
            return Err(AlgoError::Config("DSA top-k 0".to_owned()));
        }
        if let Some(ix) = &indexer
            && (ix.heads() == 0 || ix.dim() == 0)
        {
            return Err(AlgoError::Config(format!(
                "an indexer of {} heads of dim {}",
                ix.heads(),
                ix.dim()
            )));
        }
        Ok(Dsa { config, indexer })
    }

    /// The settings.
    pub fn config(&self) -> DsaConfig {
        self.config
    }

    /// The longest row a decode selection can have: the top-k, or the forced tokens where they
    /// exceed it (the width of a device selection).
    pub fn row_width(&self) -> usize {
        self.config.always.max_row_pages(self.config.topk, 1)
    }

    /// The model's trained indexer, or `None` for the generic fallback.
    pub fn indexer(&self) -> Option<&Arc<dyn Indexer>> {
        self.indexer.as_ref()
    }

    /// Scores of positions `mid` of sequence `s` with the trained indexer.
    fn indexer_scores(
        &self,
        ix: &dyn Indexer,
        step: &Decode<'_>,
        pool: &RepPool,
        s: usize,
        mid: std::ops::Range<usize>,
    ) -> Result<Vec<f32>, AlgoError> {
        let (heads, dim) = (ix.heads(), ix.dim());
        let mut q = vec![0.0f32; heads * dim];
        let mut w = vec![0.0f32; heads];
        ix.queries(step.layer, s, &mut q, &mut w);
        let Reps::F32(keys) = pool.reps(step.layer, step.slots[s])? else {
            return Err(f32_only("DSA's indexer keys"));
        };
        let keys = &keys[mid.start * dim..mid.end * dim];
        let scores = keys
            .par_chunks(256 * dim)
            .flat_map_iter(|chunk| {
                let n = chunk.len() / dim;
                let mut acc = vec![0.0f32; n];
                let mut tmp = vec![0.0f32; n];
                for j in 0..heads {
                    dots(&q[j * dim..(j + 1) * dim], chunk, dim, &mut tmp);
                    for (a, &t) in acc.iter_mut().zip(&tmp) {
                        *a += w[j] * t.max(0.0);
                    }
                }
                acc
            })
            .collect();
        Ok(scores)
    }
}

impl SparseAlgorithm for Dsa {
    fn caps(&self) -> Caps {
        Caps {
            name: "dsa",
            page_size: 1,
            decode: true,
            prefill_keep: false,
            reads_keys: self.indexer.is_none(),
        }
    }

    fn max_pages(&self, _kv_heads: usize) -> Option<usize> {
        // Every KV head gets the same row.
        Some(self.row_width())
    }

    fn rep_shape(&self, _kv_heads: usize, _head_dim: usize) -> RepShape {
        match &self.indexer {
            Some(ix) => RepShape {
                page_size: 1,
                heads: 1,
                width: ix.dim(),
            },
            None => RepShape::NONE,
        }
    }

    fn update_representations(
        &self,
        layer: usize,
        keys: &dyn KeySource,
        slots: &[usize],
        pool: &mut RepPool,
    ) -> Result<(), AlgoError> {
        check_batch(
            keys,
            slots,
            pool,
            self.rep_shape(keys.kv_heads(), keys.head_dim()),
        )?;
        let Some(ix) = &self.indexer else {
            return Ok(());
        };
        let dim = ix.dim();
        for (s, &slot) in slots.iter().enumerate() {
            let len = keys.seq_len(s);
            let (row, built) = pool.row_mut_f32(layer, slot, len, "DSA's indexer keys")?;
            let from = (*built).min(len);
            ix.keys(layer, s, from, &mut row[from * dim..len * dim]);
            *built = len;
        }
        Ok(())
    }

    fn retrieve_topk(&self, step: &Decode<'_>, pool: &RepPool) -> Result<TopK, AlgoError> {
        step.validate()?;
        check_pool(pool, self.rep_shape(step.kv_heads, step.head_dim))?;
        let kvh = step.kv_heads;
        let mut rows = Vec::with_capacity(step.num_seqs() * kvh);
        for (s, &len) in step.seq_lens.iter().enumerate() {
            let plan = Plan::new(len, 1, self.config.topk, self.config.always);
            let row = if plan.pick == 0 {
                plan.assemble(Vec::new())
            } else {
                let scores = match &self.indexer {
                    Some(ix) => {
                        let built = pool.tokens(step.layer, step.slots[s])?;
                        if built < plan.mid.end {
                            return Err(AlgoError::Invalid(format!(
                                "slot {}: indexer keys cover {built} tokens, scoring needs {}",
                                step.slots[s], plan.mid.end
                            )));
                        }
                        self.indexer_scores(ix.as_ref(), step, pool, s, plan.mid.clone())?
                    }
                    None => fallback_scores(step, s, len, plan.mid.clone())?,
                };
                plan.assemble(top_k(&scores, plan.mid.start, plan.pick))
            };
            rows.extend((1..kvh).map(|_| row.clone()));
            rows.push(row);
        }
        Ok(TopK::from_rows(&rows, kvh, 1))
    }
}

/// The fallback's scores of positions `mid` of sequence `s`.
fn fallback_scores(
    step: &Decode<'_>,
    s: usize,
    len: usize,
    mid: std::ops::Range<usize>,
) -> Result<Vec<f32>, AlgoError> {
    let keys = step.need_keys("the DSA fallback indexer")?;
    let d = step.head_dim;
    let q = &step.q[s * step.q_heads * d..(s + 1) * step.q_heads * d];
    let l = logits(keys, s, len, q, 1.0 / (d as f32).sqrt());
    let w = 1.0 / step.q_heads as f32;
    let mut scores = vec![0.0f32; mid.len()];
    for j in 0..step.q_heads {
        for (acc, &x) in scores
            .iter_mut()
            .zip(&l[j * len + mid.start..j * len + mid.end])
        {
            *acc += w * x.max(0.0);
        }
    }
    Ok(scores)
}
