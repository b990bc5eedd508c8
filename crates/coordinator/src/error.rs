//! The crate's error type.

use attn_op::AttnError;
use kv_blocks::RequestId;
use offload::OffloadError;
use sparse_algo::AlgoError;

/// Everything the coordinator rejects. Hooks validate before they change anything, so an error
/// leaves every request as it was.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CoordError {
    /// A configuration that cannot work; the message says why.
    #[error("invalid sparse configuration: {0}")]
    Config(String),
    /// The request is not live.
    #[error("request {0:?} is not live")]
    UnknownRequest(RequestId),
    /// The request is live already.
    #[error("request {0:?} is already live")]
    DuplicateRequest(RequestId),
    /// Every representation slot (sparse-mode request) is taken.
    #[error("all {0} sparse-mode request slots are in use")]
    Full(usize),
    /// A hook called out of order, or inputs that do not fit the batch; the message says which.
    #[error("invalid call: {0}")]
    Invalid(String),
    /// The algorithm layer rejected its inputs.
    #[error(transparent)]
    Algo(#[from] AlgoError),
    /// The offload layer rejected a step.
    #[error(transparent)]
    Offload(#[from] OffloadError),
    /// The attention op rejected its inputs.
    #[error(transparent)]
    Attn(#[from] AttnError),
}
