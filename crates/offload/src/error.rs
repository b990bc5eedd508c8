//! The crate's error type.

use attn_op::AttnError;
use kv_blocks::RequestId;

/// Everything offload rejects. Every operation validates before it changes anything, so an
/// error leaves the manager as it was.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OffloadError {
    /// A configuration value that cannot work; the message says which.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The request id is not live (or, for `begin_request`, already live).
    #[error("request {0:?} is not live")]
    UnknownRequest(RequestId),
    /// The request id is live already.
    #[error("request {0:?} is already live")]
    DuplicateRequest(RequestId),
    /// Every device hot buffer is taken.
    #[error("all {0} device hot buffers are in use")]
    NoDeviceBuffer(usize),
    /// The host pool has fewer free pages than the write needs.
    #[error("host pool exhausted: {needed} pages needed, {free} free")]
    HostExhausted {
        /// Pages the operation needs.
        needed: usize,
        /// Pages free.
        free: usize,
    },
    /// The request's host page table (given by the caller, [`HostAlloc::External`]) is too
    /// short for the tokens.
    ///
    /// [`HostAlloc::External`]: crate::HostAlloc::External
    #[error("{needed} more host pages are needed; give them with extend_host_pages")]
    MissingHostPages {
        /// Pages missing.
        needed: usize,
    },
    /// A selection larger than the hot buffer (HiSparse requires HOT >= top-k).
    #[error("{selected} selected pages do not fit a hot buffer of {hot}")]
    HotTooSmall {
        /// Pages selected besides the current one.
        selected: usize,
        /// Hot slots per (request, layer).
        hot: usize,
    },
    /// A buffer, id or position that does not fit; the message says which.
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// attn-op rejected a tensor.
    #[error(transparent)]
    Attn(#[from] AttnError),
}
