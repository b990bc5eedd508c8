//! The attention op of hierarchical sparse attention.
//!
//! This crate will hold the paged KV storage in the shared block-tensor layout
//! `[num_blocks, block_size, kv_heads, head_dim]`, batched attention driven by the flat metadata
//! arrays (`cu_seqlens_q`, `seq_lens_kv`, `block_table`), sparse page-list and token-level
//! decode attention, the log-sum-exp merge of partial results, `gather_page_offsets` and KV
//! compaction. The CPU implementation is the specification; a CUDA backend behind a feature must
//! match it. Nothing is implemented yet: see the attn-op issue.
#![deny(missing_docs)]
