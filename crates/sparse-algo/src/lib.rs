//! The Algorithm layer of hierarchical sparse attention: which pages or tokens of the KV cache
//! matter for a query, and what a selection loses.
//!
//! Every algorithm implements [`SparseAlgorithm`]: it builds per-page representations after
//! prefill and extends them as decode appends tokens (kept in a [`RepPool`] indexed by layer,
//! request slot and page), answers each decode step with a [`TopK`] of logical page or token ids
//! per (sequence, KV head) in the shared -1-padded format, and, for compression algorithms,
//! predicts at prefill which tokens to keep. It never sees physical addresses. The
//! always-include rules ([`AlwaysInclude`]: sinks, recent tokens, the current page) are shared.
//!
//! | algorithm | granularity | decode | prefill keep |
//! |---|---|---|---|
//! | [`Full`] | page | all pages | |
//! | [`StreamingLlm`] | token (or page) | sinks + window | |
//! | [`Quest`] | page | per-dimension upper bound | |
//! | [`SnapKv`] | token | | observation-window votes |
//! | [`RocketKv`] | page | top-r channels, min/max pages | max-pooled votes |
//! | [`Dsa`] | token | indexer `sum_j w_j relu(q_j · k)` | |
//! | [`Oracle`] | page or token | exact attention mass | |
//!
//! A pool stores f32, or, for min/max bounds, the KV's own 16-bit type at half the bytes with
//! the same selections: build it with [`RepPool::with_elem`] and the algorithm's
//! [`SparseAlgorithm::rep_elem`] for the cache's dtype, as the coordinator does.
//!
//! [`metrics`] measures mass recall, top-k recall and output error against dense attention
//! computed by attn-op. Selection is deterministic: ties between equal scores go to the lower
//! id, NaN scores rank last, and no result depends on the thread count.
//!
//! ```
//! use attn_op::{KvCache, KvLayout, PagedKv};
//! use sparse_algo::{Decode, PagedKeys, Quest, QuestConfig, RepPool, SparseAlgorithm};
//!
//! // One sequence of 64 tokens, one KV head of dim 4, in 4 blocks of 16.
//! let layout = KvLayout { num_blocks: 4, block_size: 16, kv_heads: 1, head_dim: 4 };
//! let k: Vec<f32> = (0..64 * 4).map(|i| ((i * 37 % 11) as f32 - 5.0) / 8.0).collect();
//! let kv = PagedKv::from_tensors(layout, k.clone(), k)?;
//! let (lens, table) = ([64], [0, 1, 2, 3]);
//! let keys = PagedKeys::new(&kv, &lens, &table, 4)?;
//!
//! let quest = Quest::new(QuestConfig { page_size: 16, budget_tokens: 32, ..Default::default() })?;
//! let mut pool = RepPool::new(quest.rep_shape(1, 4), 1, 1, 64)?;
//! quest.construct_representations(0, &keys, &[0], &mut pool)?;
//! let step = Decode {
//!     layer: 0, q: &[1.0, -1.0, 0.5, 0.0], q_heads: 1, kv_heads: 1, head_dim: 4,
//!     seq_lens: &[64], slots: &[0], keys: None,
//! };
//! let top = quest.retrieve_topk(&step, &pool)?;
//! assert_eq!(top.row(0, 0).len(), 2); // the budget: one estimated page plus the current one
//! assert_eq!(top.row(0, 0)[1], 3);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![deny(missing_docs)]

mod algo;
mod basic;
mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
mod dsa;
mod error;
mod exact;
mod keys;
mod minmax;
mod oracle;
mod pool;
mod quest;
mod rocket;
mod score;
mod select;
mod snap;
pub mod summary;

pub mod metrics;

pub use algo::{Caps, Decode, Prompt, SparseAlgorithm};
pub use basic::{Full, FullConfig, StreamingConfig, StreamingLlm};
pub use config::AlgoConfig;
pub use dsa::{Dsa, DsaConfig, Indexer};
pub use error::AlgoError;
pub use keys::{KeySource, PagedKeys};
pub use oracle::{Oracle, OracleConfig};
pub use pool::{RepPool, RepShape, Reps};
pub use quest::{Quest, QuestConfig, quest_bound};
pub use rocket::{RocketConfig, RocketKv};
pub use select::{AlwaysInclude, TopK};
pub use snap::{Pooling, SnapKv, SnapKvConfig};
pub use summary::Summary;

/// A xorshift32 generator from `seed`, for the unit tests' fixed random inputs.
#[cfg(test)]
pub(crate) fn xorshift(seed: u32) -> impl FnMut() -> u32 {
    let mut x = seed;
    move || {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        x
    }
}
