//! The engine of hierarchical sparse attention.
//!
//! This crate will compose every layer into something a user runs: a Llama-family model loaded
//! from GGUF or safetensors, a continuous-batching scheduler with chunked prefill, kv-blocks for
//! allocation and prefix reuse, the coordinator for sparse decode, and a command-line interface
//! with `generate`, `run` and `eval`. Nothing is implemented yet: see the engine issue.
#![deny(missing_docs)]
