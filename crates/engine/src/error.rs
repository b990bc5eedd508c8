//! The crate's error type.

use std::path::PathBuf;

/// Everything the engine rejects.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A file could not be opened or mapped.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// A model file that does not follow its format; the message says where.
    #[error("malformed model file: {0}")]
    Malformed(String),
    /// A valid file with something this engine does not support (a tensor type, a version).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// Text that could not be encoded or ids that could not be decoded.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A request the engine rejects; nothing of it was kept.
    #[error("bad request: {0}")]
    Request(#[from] RequestError),
    /// A call the engine rejects; the message says why.
    #[error("invalid: {0}")]
    Invalid(String),
    /// The attention op rejected a batch.
    #[error(transparent)]
    Attn(#[from] attn_op::AttnError),
    /// The KV block manager refused a call.
    #[error("kv-blocks: {0}")]
    Kv(#[from] kv_blocks::KvError),
    /// The sparse coordinator rejected a step.
    #[error(transparent)]
    Coord(#[from] coordinator::CoordError),
}

/// Why a request was rejected.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum RequestError {
    /// The prompt has no tokens.
    #[error("an empty prompt")]
    EmptyPrompt,
    /// The prompt and the tokens to generate do not fit the context.
    #[error("{prompt} prompt tokens + {max_tokens} to generate exceed the limit of {limit}")]
    TooLong {
        /// Prompt tokens.
        prompt: usize,
        /// Tokens to generate at most.
        max_tokens: usize,
        /// The longest sequence allowed.
        limit: usize,
    },
    /// A prompt token outside the vocabulary.
    #[error("prompt token {token} is outside the vocabulary of {vocab}")]
    OutOfVocab {
        /// The token.
        token: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A sampling value that cannot sample; the message names it.
    #[error("sampling: {0}")]
    Sampling(String),
    /// Stop strings were given to an engine without a tokenizer.
    #[error("stop strings need a tokenizer")]
    NoTokenizer,
    /// The sparse configuration does not lower for the model.
    #[error("sparse config: {0}")]
    Sparse(String),
    /// The request could never be admitted: it needs more memory than the whole budget.
    #[error("needs {need} bytes of {what} but the whole budget is {budget}")]
    TooBig {
        /// Which memory.
        what: &'static str,
        /// Bytes needed.
        need: u64,
        /// Bytes in the budget.
        budget: u64,
    },
    /// No request with this id is waiting or running.
    #[error("request {0} is not live")]
    Unknown(u64),
}
