//! The Algorithm layer of hierarchical sparse attention.
//!
//! This crate will hold the pluggable top-k algorithms that answer "which pages or tokens of the
//! KV cache matter for this query": a trait with `construct_representations`,
//! `update_representations`, `retrieve_topk` and a prefill-time keep list, and the algorithms
//! Full, StreamingLLM, Quest (with the per-dimension upper bound), SnapKV, RocketKV, a DSA-style
//! indexer and an exact oracle, together with fidelity metrics. Selections are logical page or
//! token ids as -1-padded `i32` arrays plus lengths; algorithms never see physical addresses.
//! Nothing is implemented yet: see the sparse-algo issue.
#![deny(missing_docs)]
