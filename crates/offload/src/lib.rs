//! The offload layer of hierarchical sparse attention.
//!
//! This crate will hold the SparseKVCacheManager: a host KV pool holding every token of every
//! request, a per-(request, layer) device hot buffer with an LRU order, the sparse diff that turns
//! a selection into a device page table plus a list of pages to load, a transfer executor with
//! per-layer completion events, and hit/miss statistics. Nothing is implemented yet: see the
//! offload + coordinator issue.
#![deny(missing_docs)]
