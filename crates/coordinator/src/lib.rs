//! The coordinator of hierarchical sparse attention (SGLang's SparseCoordinator).
//!
//! An engine calls six hooks; the coordinator drives, per sparse layer, the Algorithm
//! (`sparse-algo`: representations, top-k) → the [`BackendAdaptor`] (selection → attention
//! metadata) → the SparseKVCacheManager (`offload`: host pool, hot buffer, diff, loads):
//!
//! - [`SparseCoordinator::on_request_begin`]: sparse mode when the prompt is at least
//!   [`Lowered::min_prompt_tokens`], dense otherwise;
//!   [`SparseCoordinator::on_request_begin_with_prefix`] starts in sparse mode from a prefix
//!   that kv-blocks' host tier already holds, without recomputing or copying it.
//! - [`SparseCoordinator::forward_begin`]: the batch (requests and their new tokens).
//! - [`SparseCoordinator::attention_begin`]: per layer, with the new tokens' q, k, v; for
//!   sparse-mode decode requests, writes the new token into its device slot, selects, diffs,
//!   loads, and returns the [`LayerPlan`]: which requests attend densely (the engine's own
//!   KV) and the [`AttentionMeta`] of the others over [`SparseCoordinator::device`].
//! - [`SparseCoordinator::attention_end`]: backs the new tokens up to the host, updates the
//!   representations, and after the last prompt chunk builds them.
//! - [`SparseCoordinator::forward_end`], [`SparseCoordinator::on_request_end`].
//!
//! The user's [`SparseConfig`] (serde/TOML) is lowered once into per-layer [`LayerParams`]
//! (`None`: a dense layer); nothing after [`SparseConfig::lower`] reads the user config.
#![deny(missing_docs)]

mod adaptor;
mod config;
mod coord;
#[cfg(feature = "cuda")]
pub mod cuda;
mod error;
mod keys;
mod prefetch;
mod tracker;

pub use adaptor::{
    AttentionMeta, AttnKind, BackendAdaptor, MetaRow, PageTableAdaptor, TokenAdaptor,
};
pub use config::{LayerOverride, LayerParams, Lowered, SparseConfig};
pub use coord::{Capacity, LayerPlan, Route, SparseCoordinator};
pub use error::CoordError;
pub use tracker::{Mode, Phase, RequestTracker};

/// The attention shape of a model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelShape {
    /// Layers.
    pub layers: usize,
    /// Query heads.
    pub q_heads: usize,
    /// KV heads (a divisor of the query heads).
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
}

impl ModelShape {
    fn validate(&self) -> Result<(), CoordError> {
        if self.layers == 0
            || self.kv_heads == 0
            || self.head_dim == 0
            || self.q_heads == 0
            || !self.q_heads.is_multiple_of(self.kv_heads)
        {
            return Err(CoordError::Config(format!(
                "an unusable model shape {self:?}"
            )));
        }
        Ok(())
    }
}
