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
