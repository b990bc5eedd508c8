//! The algorithm trait and the inputs of its phases.

use crate::error::check_len;
use attn_op::DType;

use crate::{AlgoError, KeySource, RepPool, RepShape, TopK};

/// One pluggable sparse-attention algorithm (SGLang's BaseSparseAlgorithm, TensorRT-LLM's
/// predict hooks, nano-vllm's SparsePolicy). The lifecycle for one layer of a request:
/// [`construct_representations`](Self::construct_representations) after prefill (or
/// [`predict_keep`](Self::predict_keep) first, for compression algorithms, then construct over the
/// compacted keys); every decode step [`retrieve_topk`](Self::retrieve_topk) with the step's
/// queries, attention over the selection, then
/// [`update_representations`](Self::update_representations) with the new token.
///
/// Algorithms answer in logical page or token ids only; mapping them to memory is the
/// caller's job. Every method validates its inputs and returns [`AlgoError`] instead of
/// panicking, and equal inputs always give equal outputs.
pub trait SparseAlgorithm: Send + Sync {
    /// Name, granularity and supported phases.
    fn caps(&self) -> Caps;

    /// An upper bound on the distinct ids one decode step selects for a sequence over all
    /// `kv_heads` heads (what a hot buffer must hold), saturating at `usize::MAX`; `None` when
    /// the selection is not bounded (Full) or there is no decode selection (SnapKV).
    fn max_pages(&self, kv_heads: usize) -> Option<usize> {
        let _ = kv_heads;
        None
    }

    /// What the algorithm keeps per page for a layer of `kv_heads` heads of `head_dim`.
    fn rep_shape(&self, kv_heads: usize, head_dim: usize) -> RepShape {
        let _ = (kv_heads, head_dim);
        RepShape::NONE
    }

    /// The narrowest element type that holds the representations exactly for a KV cache of
    /// `kv` ([`RepPool::with_elem`]; for Quest and RocketKV the KV's own type, whose min/max
    /// bounds are its values, so that the pool selects as an f32 pool does); f32 by default.
    fn rep_elem(&self, kv: DType) -> DType {
        let _ = kv;
        DType::F32
    }

    /// Builds the representations of every token of each sequence of `keys` into its pool slot
    /// (`slots[s]`), replacing what the slot held.
    fn construct_representations(
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
        for &slot in slots {
            pool.reset(layer, slot)?;
        }
        self.update_representations(layer, keys, slots, pool)
    }

    /// Extends each slot's representations to the sequence's current length (after decode
    /// appended tokens); the partial last page is recomputed.
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
        let _ = layer;
        Ok(())
    }

    /// The decode selection of a batch: per (sequence, KV head), ascending logical ids of
    /// `caps().page_size` tokens.
    fn retrieve_topk(&self, step: &Decode<'_>, pool: &RepPool) -> Result<TopK, AlgoError> {
        let _ = (step, pool);
        Err(AlgoError::Unsupported {
            algorithm: self.caps().name,
            phase: "decode selection",
        })
    }

    /// The prefill-time keep list (TensorRT-LLM's `sparse_kv_predict`): per (sequence, KV head),
    /// ascending token positions to keep, the same count for every head of a sequence, ready for
    /// [`attn_op::compact_kv`].
    fn predict_keep(&self, prompt: &Prompt<'_>) -> Result<TopK, AlgoError> {
        let _ = prompt;
        Err(AlgoError::Unsupported {
            algorithm: self.caps().name,
            phase: "prefill keep prediction",
        })
    }
}

/// What an algorithm is and does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caps {
    /// Short name, as in configs.
    pub name: &'static str,
    /// Tokens per selected id (1: token-level).
    pub page_size: usize,
    /// Whether [`SparseAlgorithm::retrieve_topk`] works.
    pub decode: bool,
    /// Whether [`SparseAlgorithm::predict_keep`] works.
    pub prefill_keep: bool,
    /// Whether decode selection reads raw keys ([`Decode::keys`] must be given).
    pub reads_keys: bool,
}

/// The inputs of one decode step of one layer, for a batch of sequences with one query each.
#[derive(Clone, Copy)]
pub struct Decode<'a> {
    /// The layer (a row of the representation pool).
    pub layer: usize,
    /// Queries `[num_seqs, q_heads, head_dim]` (f32, as scoring runs in f32).
    pub q: &'a [f32],
    /// Query heads; a multiple of the KV heads.
    pub q_heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Tokens of each sequence, the query's own included (`[num_seqs]`).
    pub seq_lens: &'a [usize],
    /// Representation pool slot of each sequence (`[num_seqs]`).
    pub slots: &'a [usize],
    /// The layer's keys, for algorithms that read them ([`Caps::reads_keys`]).
    pub keys: Option<&'a dyn KeySource>,
}

impl Decode<'_> {
    /// Sequences in the step.
    pub fn num_seqs(&self) -> usize {
        self.seq_lens.len()
    }

    /// Checks every shape and returns the group size (query heads per KV head).
    pub(crate) fn validate(&self) -> Result<usize, AlgoError> {
        let n = self.num_seqs();
        check_len("slots", self.slots.len(), &[n])?;
        if self.kv_heads == 0 || self.head_dim == 0 || !self.q_heads.is_multiple_of(self.kv_heads) {
            return Err(AlgoError::Invalid(format!(
                "{} query heads over {} KV heads of dim {}",
                self.q_heads, self.kv_heads, self.head_dim
            )));
        }
        check_len("q", self.q.len(), &[n, self.q_heads, self.head_dim])?;
        if let Some(s) = self.seq_lens.iter().position(|&l| l == 0) {
            return Err(AlgoError::Invalid(format!("sequence {s} is empty")));
        }
        if let Some(k) = self.keys {
            check_keys(k, self.seq_lens, self.kv_heads, self.head_dim)?;
        }
        Ok(self.q_heads / self.kv_heads)
    }

    /// The keys, or an error naming the algorithm that needs them.
    pub(crate) fn need_keys(&self, algorithm: &'static str) -> Result<&dyn KeySource, AlgoError> {
        self.keys.ok_or_else(|| {
            AlgoError::Invalid(format!("{algorithm} reads keys; the decode step has none"))
        })
    }

    /// The query heads of (sequence, KV head), `[group, head_dim]`.
    pub(crate) fn group_q(&self, seq: usize, head: usize) -> &[f32] {
        let g = self.q_heads / self.kv_heads;
        let d = self.head_dim;
        let start = (seq * self.q_heads + head * g) * d;
        &self.q[start..start + g * d]
    }
}

/// The inputs of prefill-time keep prediction for a batch of prompts of one layer: the keys of
/// every prompt token and the queries of the prompts' last positions.
#[derive(Clone, Copy)]
pub struct Prompt<'a> {
    /// The layer.
    pub layer: usize,
    /// Queries of the last positions of each prompt, `[total, q_heads, head_dim]`: rows
    /// `cu_q[s]..cu_q[s + 1]` are the queries of the last `cu_q[s + 1] - cu_q[s]` positions of
    /// prompt `s` (at least the observation window, or the whole prompt if it is shorter).
    pub q: &'a [f32],
    /// `[num_seqs + 1]` prefix sums of query rows per prompt, from 0.
    pub cu_q: &'a [i32],
    /// Query heads; a multiple of the KV heads.
    pub q_heads: usize,
    /// The prompts' keys.
    pub keys: &'a dyn KeySource,
}

impl Prompt<'_> {
    /// Checks shapes; returns the group size and, per prompt, its query rows.
    pub(crate) fn validate(&self) -> Result<(usize, Vec<std::ops::Range<usize>>), AlgoError> {
        let n = self.keys.num_seqs();
        let (kvh, d) = (self.keys.kv_heads(), self.keys.head_dim());
        check_len("cu_q", self.cu_q.len(), &[n + 1])?;
        if kvh == 0 || d == 0 || self.q_heads == 0 || !self.q_heads.is_multiple_of(kvh) {
            return Err(AlgoError::Invalid(format!(
                "{} query heads over {kvh} KV heads of dim {d}",
                self.q_heads
            )));
        }
        let mut rows = Vec::with_capacity(n);
        for s in 0..n {
            let (a, b) = (self.cu_q[s], self.cu_q[s + 1]);
            if a < 0 || b < a || (b - a) as usize > self.keys.seq_len(s) {
                return Err(AlgoError::Invalid(format!(
                    "prompt {s}: query rows {a}..{b} do not fit its {} tokens",
                    self.keys.seq_len(s)
                )));
            }
            rows.push(a as usize..b as usize);
        }
        if self.cu_q[0] != 0 {
            return Err(AlgoError::Invalid("cu_q must start at 0".to_owned()));
        }
        let total = rows.last().map_or(0, |r| r.end);
        check_len("q", self.q.len(), &[total, self.q_heads, d])?;
        Ok((self.q_heads / kvh, rows))
    }
}

/// Checks a construction batch against the pool: one slot per sequence, no slot twice, and
/// a pool made for `shape`.
pub(crate) fn check_batch(
    keys: &dyn KeySource,
    slots: &[usize],
    pool: &RepPool,
    shape: RepShape,
) -> Result<(), AlgoError> {
    check_len("slots", slots.len(), &[keys.num_seqs()])?;
    check_pool(pool, shape)?;
    let mut seen = slots.to_vec();
    seen.sort_unstable();
    if seen.windows(2).any(|w| w[0] == w[1]) {
        return Err(AlgoError::Invalid(
            "a slot appears twice in one batch".to_owned(),
        ));
    }
    Ok(())
}

/// Checks that a key source matches the step's shapes and lengths.
fn check_keys(
    keys: &dyn KeySource,
    seq_lens: &[usize],
    kv_heads: usize,
    head_dim: usize,
) -> Result<(), AlgoError> {
    check_len("key source sequences", keys.num_seqs(), &[seq_lens.len()])?;
    if keys.kv_heads() != kv_heads || keys.head_dim() != head_dim {
        return Err(AlgoError::Invalid(format!(
            "keys have {} heads of {}, the step {kv_heads} of {head_dim}",
            keys.kv_heads(),
            keys.head_dim()
        )));
    }
    for (s, &len) in seq_lens.iter().enumerate() {
        if keys.seq_len(s) < len {
            return Err(AlgoError::Invalid(format!(
                "sequence {s}: {len} tokens, the keys hold {}",
                keys.seq_len(s)
            )));
        }
    }
    Ok(())
}

/// Checks that the pool was made for this algorithm's shape.
pub(crate) fn check_pool(pool: &RepPool, shape: RepShape) -> Result<(), AlgoError> {
    if pool.shape() == shape {
        Ok(())
    } else {
        Err(AlgoError::Invalid(format!(
            "the pool holds {:?}, the algorithm needs {shape:?}",
            pool.shape()
        )))
    }
}
