//! Paged KV block manager with TensorRT-LLM's semantics, in safe Rust and without a GPU.
//!
//! `kv-blocks` decides which block of which pool holds which tokens of which request; it never
//! touches KV data. It offers:
//!
//! - block pools per window group and tier ([`Tier::Primary`] device, [`Tier::Secondary`] host),
//!   typed [`BlockId`]s, reference counts, O(1) allocation and free, per-request block tables;
//! - prefix reuse: full blocks are stored in a radix tree keyed by (salt, extra ids, tokens)
//!   chained from the parent, found again when a request with the same prefix arrives, with
//!   partial reuse of a last block (copied, or taken over when unused);
//! - prioritized LRU eviction of leaf blocks with timed retention, offload of evicted blocks to
//!   the host tier and onboarding when they are reused, all returned as [`Transfer`] commands;
//! - attention windows, cache salting, a bounded [`KvEvent`] stream, and sizing helpers.
//!
//! ```
//! use kv_blocks::{KvCacheConfig, KvCacheManager, RequestId, RequestSpec};
//!
//! let mut kv = KvCacheManager::new(KvCacheConfig::new(4, 64, 0))?;
//! let prompt: Vec<u32> = (100..110).collect();
//! let a = kv.add_request(RequestSpec::new(RequestId(1), prompt.clone()))?;
//! assert_eq!(a.reused_tokens, 0);
//! kv.commit_computed(RequestId(1), 10)?; // prefill wrote the KV of all 10 tokens
//! kv.release(RequestId(1))?;
//! // Same prompt again: the two full blocks (8 tokens) are reused.
//! let b = kv.add_request(RequestSpec::new(RequestId(2), prompt))?;
//! assert_eq!(b.reused_tokens, 8);
//! # Ok::<(), kv_blocks::KvError>(())
//! ```
#![deny(missing_docs)]

mod clock;
mod config;
mod error;
mod events;
mod group;
mod lazy;
mod manager;
mod pool;
mod sizing;
mod tree;
mod types;
mod walk;

pub use clock::{Clock, ManualClock, SystemClock};
pub use config::{
    GroupConfig, KvCacheConfig, MAX_BLOCKS_PER_POOL, RequestSpec, RetentionPolicy,
    TokenRangeRetention,
};
pub use error::KvError;
pub use events::{EventBatch, KvEvent};
pub use manager::{
    AddOutcome, CacheStats, CachedBlock, KvCacheManager, PoolUsage, RequestStats, Transfer,
    TransferKind,
};
pub use sizing::{
    KvShape, PoolSizing, blocks_for_tokens, blocks_needed_for_step, max_attention_window,
    max_blocks_in_window,
};
pub use types::{BlockHash, BlockId, BlockLoc, GroupId, Priority, RequestId, Tier};
