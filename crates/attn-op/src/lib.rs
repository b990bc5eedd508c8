//! The attention op of hierarchical sparse attention, on the CPU.
//!
//! Everything here works on one layer's KV cache in the shared block-tensor layout
//! `[num_blocks, block_size, kv_heads, head_dim]` ([`PagedKv`]) and on the flat `i32` metadata
//! arrays of the data contract ([`BatchMeta`], [`Selection`]). Inputs may be f32, f16 or bf16
//! ([`Element`]); arithmetic is f32 and outputs are f32, with the log-sum-exp of every row so
//! that results over disjoint key sets [merge](merge_attention) exactly.
//!
//! - [`paged_attention`]: causal attention for mixed prefill + decode batches, MHA/GQA/MQA,
//!   sliding window, sink tokens and sink logits.
//! - [`gather_page_offsets`] and [`sparse_page_attention`]: attention over selected pages only.
//! - [`token_sparse_attention`]: attention over selected tokens.
//! - [`compact_kv`]: in-place KV compaction after prefill.
//!
//! With the `cuda` feature, the `cuda` module runs the same operations on a CUDA device.
//!
//! This CPU implementation is the specification: a CUDA kernel is correct when it matches it.
//! Work is spread by (sequence, KV head, query tile, KV split) over the calling thread and
//! rayon's pool; results do not depend on the number of threads. The pool's helpers linger
//! between calls, ready for the next one, for a time [`set_linger`] sets.
//!
//! ```
//! use attn_op::{AttnOut, AttnParams, BatchMeta, KvCache, KvLayout, PagedKv, paged_attention};
//!
//! let layout = KvLayout { num_blocks: 4, block_size: 4, kv_heads: 1, head_dim: 2 };
//! let mut kv = PagedKv::<f32>::new(layout)?;
//! // Three tokens into block 2 (slots 8, 9, 10).
//! kv.set_kv(&[8, 9, 10], &[1., 0., 0., 1., 1., 1.], &[1., 2., 3., 4., 5., 6.])?;
//! let meta = BatchMeta { cu_seqlens_q: &[0, 1], seq_lens_kv: &[3], block_table: &[2, -1], max_blocks: 2 };
//! let mut out = [0.0f32; 2];
//! let mut lse = [0.0f32; 1];
//! paged_attention(&[0.0f32, 0.0], &kv, &meta, &AttnParams::new(1, 2),
//!     AttnOut { out: &mut out, lse: Some(&mut lse) })?;
//! assert_eq!(out, [3.0, 4.0]); // a zero query weighs the three values equally
//! assert!((lse[0] - 3f32.ln()).abs() < 1e-6);
//! # Ok::<(), attn_op::AttnError>(())
//! ```
#![deny(missing_docs)]

mod aligned;
mod crew;
#[cfg(feature = "cuda")]
pub mod cuda;
mod dtype;
mod error;
mod kernel;
mod kv;
mod meta;
mod ops;
mod phase;
mod simd;

pub use aligned::advise_huge_pages;
pub use crew::set_linger;
pub use dtype::{DType, Element};
pub use error::AttnError;
pub use kv::{Host, KvCache, KvLayout, Memory, PagedKv};
pub use meta::{AttnParams, BatchMeta, Selection, Simd};
pub use ops::{
    AttnOut, AttnPart, GatheredPages, compact_kv, gather_page_offsets, merge_attention,
    paged_attention, sparse_page_attention, token_sparse_attention,
};
pub use simd::exp_nonpositive;
