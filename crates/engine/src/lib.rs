//! The engine: a Llama-family model from GGUF, run through the hierarchical sparse attention
//! layers.
//!
//! - [`gguf`], [`hf`], [`Tokenizer`], [`Model`]: the model file (GGUF, or a Hugging Face
//!   checkpoint in safetensors), its tokenizer, and the Llama forward on the CPU with
//!   attention behind the [`Attention`] trait.
//! - [`generate`]: one request end to end; [`Scheduler`]: many at once (continuous
//!   batching, chunked prefill, kv-blocks prefix reuse, admission by a device budget).
//! - [`eval`]: fidelity of sparse variants against dense (perplexity, top-1 agreement,
//!   recall, passkey retrieval).
//! - `gpu` (feature `cuda`): the same forward on the GPU, weights in f16 or bf16, GEMMs in
//!   cuBLAS; a synthetic model's random weights made on the device.
//! - `gpu_sparse` (feature `cuda`): a GPU forward's attention through the coordinator's device
//!   hooks (sparse-mode decode batches).
//! - `gpu_request` (feature `cuda`): one request on the GPU end to end, dense or sparse, and
//!   `generate_gpu`.
//! - the `hsa` binary: the command line over all of it.
#![deny(missing_docs)]

pub mod capacity;
mod error;
pub mod eval;
mod generate;
pub mod ggml;
pub mod gguf;
#[cfg(feature = "cuda")]
pub mod gpu;
#[cfg(feature = "cuda")]
pub mod gpu_request;
#[cfg(feature = "cuda")]
pub mod gpu_sparse;
pub mod hf;
mod kv;
mod linear;
mod model;
mod qdot;
mod sample;
mod sched;
mod sparse;
mod step;
pub mod synthetic;
mod tokenizer;

pub use error::{EngineError, RequestError};
pub use generate::{GenerateStats, PREFILL_CHUNK, generate};
pub use kv::{Batch, DenseAttention, KvStore};
pub use linear::Linear;
pub use model::{Attention, Model, ModelConfig};
pub use sample::{Sampler, Sampling};
pub use sched::{Event, FinishReason, Report, Request, Scheduler, SchedulerConfig, Usage};
pub use sparse::{SparseAttention, single_request};
pub use tokenizer::Tokenizer;
