//! The offload layer of hierarchical sparse attention: SGLang's SparseKVCacheManager and
//! HiSparse, in Rust, on the CPU.
//!
//! A sparse-mode request keeps every token of every layer in a host pool
//! ([`HostPool`], three layouts behind [`HostStore`]). The device tier keeps, per (request,
//! layer), a [`HotBuffer`] of pages in LRU order plus a reserved slot for the current page.
//! Each decode step hands [`SparseKvCacheManager::step`] the selected logical pages; the diff
//! keeps hits where they are, gives each miss the least recently used evictable slot, loads the
//! misses from the host, and returns the device page table attention reads ([`StepPlan`]).
//! [`execute_loads`] and [`Pipeline`] execute loads (synchronously, or on a worker thread with
//! per-layer completion tickets) and [`execute_block_transfers`] runs kv-blocks' tier moves.
//!
//! A request of ten tokens (pages of 4: two full pages and the current one, of 2 tokens),
//! two decode steps that select its first and its current page, and attention over the
//! device blocks the plan names:
//!
//! ```
//! use attn_op::{AttnOut, AttnParams, BatchMeta, paged_attention};
//! use kv_blocks::RequestId;
//! use offload::{HostAlloc, HostLayout, OffloadConfig, SparseKvCacheManager};
//!
//! let config = OffloadConfig {
//!     page_size: 4,
//!     hot_pages: 2,
//!     layers: 1,
//!     kv_heads: 1,
//!     head_dim: 2,
//!     host_pages: 8,
//!     max_requests: 1,
//!     layout: HostLayout::LayerFirst,
//!     host_alloc: HostAlloc::Own,
//! };
//! let mut kv = SparseKvCacheManager::<f32>::new(config)?;
//! let id = RequestId(7);
//! kv.begin_request(id)?;
//! // The prompt's K and V after prefill, `[tokens, kv_heads, head_dim]`: token t has key
//! // (t, 1) and value (t, -t).
//! let k: Vec<f32> = (0..10).flat_map(|t| [t as f32, 1.0]).collect();
//! let v: Vec<f32> = (0..10).flat_map(|t| [t as f32, -(t as f32)]).collect();
//! kv.append(id, 0, &k, &v)?;
//!
//! // The algorithm picked pages 0 and 2 (ascending; the current page last).
//! let plan = kv.step(id, 0, &[0, 2])?;
//! assert_eq!(plan.seq_len, 6); // page 0's 4 tokens and the current page's 2
//! assert_eq!(plan.stats.misses, 1); // page 0 came from the host
//! // The next step selects the same pages: both are resident, nothing moves.
//! let again = kv.step(id, 0, &[0, 2])?;
//! assert_eq!((again.stats.hits, again.stats.misses, again.stats.bytes), (2, 0, 0));
//!
//! // Attention over exactly the selected tokens, through the plan's device block table.
//! let meta = BatchMeta {
//!     cu_seqlens_q: &[0, 1],
//!     seq_lens_kv: &[plan.seq_len as i32],
//!     block_table: &plan.block_table,
//!     max_blocks: plan.block_table.len(),
//! };
//! let mut out = [0.0f32; 2];
//! paged_attention(&[0.0f32, 0.0], &*kv.device(0).read(), &meta, &AttnParams::new(1, 2),
//!     AttnOut { out: &mut out, lse: None })?;
//! // A zero query weighs tokens 0-3, 8 and 9 equally: their mean value is (23 / 6, -23 / 6).
//! assert!((out[0] - 23.0 / 6.0).abs() < 1e-5 && (out[1] + 23.0 / 6.0).abs() < 1e-5);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![deny(missing_docs)]

#[cfg(feature = "cuda")]
pub mod cuda;
mod error;
mod exec;
mod host;
mod hot;
mod manager;

pub use error::OffloadError;
pub use exec::{
    CpuExecutor, Job, Load, Pipeline, Ticket, TransferExecutor, execute_block_transfers,
    execute_loads,
};
pub use host::{HostLayout, HostPool, HostShape, HostStore};
pub use hot::{Diff, HotBuffer};
pub use manager::{HostAlloc, OffloadConfig, SparseKvCacheManager, StepPlan};

/// Counts of one step, or totals over many.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepStats {
    /// Steps counted.
    pub steps: u64,
    /// Selected pages already resident (the current page included).
    pub hits: u64,
    /// Selected pages loaded.
    pub misses: u64,
    /// Pages loaded for misses.
    pub loaded_pages: u64,
    /// Bytes moved host → device (misses and reserved-slot refreshes, K and V).
    pub bytes: u64,
    /// Loads that refreshed the reserved slot (the current page after prefill).
    pub reserved_loads: u64,
    /// Layer steps that reused another layer's diff ([`SparseKvCacheManager::step_layers`]).
    pub reused_plans: u64,
}

impl StepStats {
    /// Adds another count.
    pub fn add(&mut self, o: &StepStats) {
        self.steps += o.steps;
        self.hits += o.hits;
        self.misses += o.misses;
        self.loaded_pages += o.loaded_pages;
        self.bytes += o.bytes;
        self.reserved_loads += o.reserved_loads;
        self.reused_plans += o.reused_plans;
    }

    /// Hits over selected pages (1 when nothing was selected).
    pub fn hit_rate(&self) -> f64 {
        let n = self.hits + self.misses;
        if n == 0 {
            1.0
        } else {
            self.hits as f64 / n as f64
        }
    }
}
