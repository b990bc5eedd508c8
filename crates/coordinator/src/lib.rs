//! The coordinator of hierarchical sparse attention.
//!
//! This crate will hold the SparseCoordinator: the lifecycle hooks an engine calls
//! (`on_request_begin`, `forward_begin`, `attention_begin`, `attention_end`, `forward_end`,
//! `on_request_end`), the per-request trackers, the backend adaptor that rewrites attention
//! metadata to the selected pages, and the lowering of a user sparse config into per-layer
//! parameters. Nothing is implemented yet: see the offload + coordinator issue.
#![deny(missing_docs)]
