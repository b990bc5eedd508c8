//! The engine: a Llama-family model from GGUF, run through the hierarchical sparse attention
//! layers.
//!
//! So far it reads GGUF model files ([`gguf`]); the forward pass, the scheduler and the CLI
//! follow (see the engine issue).
#![deny(missing_docs)]

mod error;
pub mod gguf;

pub use error::EngineError;
