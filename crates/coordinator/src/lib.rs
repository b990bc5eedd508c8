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
//! After an error inside a forward, [`SparseCoordinator::abort_forward`] abandons it: the
//! requests it had not changed can be batched again, and those it had are ended and named.
//!
//! The user's [`SparseConfig`] (serde/TOML) is lowered once into per-layer [`LayerParams`]
//! (`None`: a dense layer); nothing after [`SparseConfig::lower`] reads the user config.
//!
//! A one-layer model and one request: a prefill of 24 tokens, which the engine attends
//! itself, then a decode step that the coordinator routes through the hot buffer:
//!
//! ```
//! use attn_op::{AttnOut, AttnParams};
//! use coordinator::{Capacity, Mode, ModelShape, Route, SparseConfig, SparseCoordinator};
//! use kv_blocks::RequestId;
//! use offload::HostAlloc;
//!
//! let model = ModelShape { layers: 1, q_heads: 2, kv_heads: 1, head_dim: 4 };
//! let config: SparseConfig = toml::from_str(r#"
//!     hot_tokens = 32
//!     min_prompt_tokens = 16
//!     [algo]
//!     algorithm = "quest"
//!     page_size = 4
//!     budget_tokens = 12
//! "#)?;
//! let capacity =
//!     Capacity { max_requests: 1, max_tokens: 64, host_pages: 16, host_alloc: HostAlloc::Own };
//! let mut coord = SparseCoordinator::<f32>::from_config(model, &config, capacity)?;
//! // Deterministic rows in [-1, 1] of `width` values for tokens `start..start + n`.
//! let rows = |seed: usize, start: usize, n: usize, width: usize| -> Vec<f32> {
//!     let value = |i: usize| ((i * 37 + seed * 11) % 19) as f32 / 9.0 - 1.0;
//!     (start * width..(start + n) * width).map(value).collect()
//! };
//!
//! let id = RequestId(1);
//! // A prompt of at least `min_prompt_tokens` runs in sparse mode.
//! assert_eq!(coord.on_request_begin(id, 24)?, Mode::Sparse);
//! coord.forward_begin(&[(id, 24)])?;
//! let (q, k, v) = (rows(0, 0, 24, 8), rows(1, 0, 24, 4), rows(2, 0, 24, 4));
//! let plan = coord.attention_begin(0, &q, &k, &v)?;
//! assert_eq!(plan.routes, [Route::Dense]); // prefill attends over the engine's own KV
//! coord.attention_end(0, &k, &v)?; // the prompt goes to the host pool; Quest's bounds are built
//! coord.forward_end()?;
//!
//! // Decode: the new token's q, k and v.
//! coord.forward_begin(&[(id, 1)])?;
//! let (q, k, v) = (rows(0, 24, 1, 8), rows(1, 24, 1, 4), rows(2, 24, 1, 4));
//! let plan = coord.attention_begin(0, &q, &k, &v)?;
//! assert_eq!(plan.routes, [Route::Sparse(0)]);
//! let meta = plan.meta.as_ref().expect("a sparse row has metadata");
//! assert_eq!(meta.seq_lens_kv, [9]); // 12 tokens of budget: two full pages and the new token's
//! let pages = plan.selection.as_ref().expect("and a selection").row(0, 0);
//! assert_eq!(pages.iter().filter(|&&p| p >= 0).last(), Some(&6)); // the current page, last
//! let mut out = [0.0f32; 8];
//! let device = coord.device(0).expect("layer 0 is sparse");
//! meta.attend(&q, &device.read(), &AttnParams::new(2, 4), AttnOut { out: &mut out, lse: None })?;
//! assert!(out.iter().all(|x| x.abs() <= 1.0)); // a weighted mean of values in [-1, 1]
//! coord.attention_end(0, &k, &v)?; // the new token's backup to the host
//! coord.forward_end()?;
//! assert_eq!(coord.on_request_end(id)?.len, 25);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
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
