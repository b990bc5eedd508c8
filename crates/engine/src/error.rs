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
    /// A request or call the engine rejects; the message says why.
    #[error("invalid: {0}")]
    Invalid(String),
    /// The attention op rejected a batch.
    #[error(transparent)]
    Attn(#[from] attn_op::AttnError),
    /// The sparse coordinator rejected a step.
    #[error(transparent)]
    Coord(#[from] coordinator::CoordError),
}
