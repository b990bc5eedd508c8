//! The engine: a Llama-family model from GGUF, run through the hierarchical sparse attention
//! layers.
//!
//! - [`gguf`], [`hf`], [`Tokenizer`], [`Model`]: the model file (GGUF, or a Hugging Face
//!   checkpoint in safetensors), its tokenizer, and the Llama forward on the CPU with
//!   attention behind the [`Attention`] trait.
//! - [`generate`](fn@generate): one request end to end; [`Scheduler`]: many at once (continuous
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
//!
//! A tiny synthetic model (random weights, byte tokens) generating greedily, once densely
//! and once through Quest with a budget that covers the whole context, which must then give
//! the same tokens:
//!
//! ```
//! use coordinator::SparseConfig;
//! use engine::gguf::{DType, Gguf};
//! use engine::{Model, ModelConfig, Sampling, Tokenizer, generate};
//!
//! let shape = ModelConfig {
//!     layers: 2, embed: 64, ffn: 128, q_heads: 4, kv_heads: 2, head_dim: 16,
//!     vocab: 256, context: 512, rope_base: 10_000.0, rms_eps: 1e-5,
//! };
//! let gguf = Gguf::from_bytes(engine::synthetic::synthetic_gguf(&shape, DType::F16, 3))?;
//! let (model, tokenizer) = (Model::load(&gguf)?, Tokenizer::from_gguf(&gguf)?);
//! let prompt = tokenizer.encode(&"a prompt long enough for sparse mode. ".repeat(4))?;
//! let sampling = Sampling { max_tokens: 8, stop_at_eos: false, ..Sampling::default() };
//! let (dense, _) =
//!     generate::<f32>(&model, &tokenizer, &prompt, &sampling, None, |_| {}, |_, _| {})?;
//! let quest = SparseConfig { min_prompt_tokens: Some(64), ..SparseConfig::quest(512) };
//! let (sparse, stats) =
//!     generate::<f32>(&model, &tokenizer, &prompt, &sampling, Some(&quest), |_| {}, |_, _| {})?;
//! assert!(stats.sparse && stats.generated == 8);
//! assert_eq!(sparse, dense);
//! # Ok::<(), engine::EngineError>(())
//! ```
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
