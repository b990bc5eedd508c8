//! The engine: a Llama-family model from GGUF, run through the hierarchical sparse attention
//! layers.
//!
//! So far it reads GGUF model files ([`gguf`]); the forward pass, the scheduler and the CLI
//! follow (see the engine issue).
#![deny(missing_docs)]

mod error;
pub mod eval;
mod generate;
pub mod gguf;
mod kv;
mod linear;
mod model;
mod sample;
mod sparse;
pub mod synthetic;
mod tokenizer;

pub use error::EngineError;
pub use generate::{GenerateStats, PREFILL_CHUNK, generate};
pub use kv::{Batch, DenseAttention, KvStore};
pub use linear::Linear;
pub use model::{Attention, Model, ModelConfig};
pub use sample::{Sampler, Sampling};
pub use sparse::SparseAttention;
pub use tokenizer::Tokenizer;
