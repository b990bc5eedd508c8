//! The crate's error type.

use crate::{GroupId, RequestId, Tier};

/// Everything that can go wrong in kv-blocks. No input makes the crate panic; it answers with one
/// of these instead, and leaves its state as it was before the failed call unless a variant says
/// otherwise.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    /// A request with this id is already live.
    #[error("{0} is already live")]
    DuplicateRequest(RequestId),
    /// No live request has this id.
    #[error("{0} is not live")]
    UnknownRequest(RequestId),
    /// The tier's pool of the group has no free block and nothing evictable.
    #[error("out of blocks in the {tier:?} tier of window group {}", group.0)]
    OutOfBlocks {
        /// The window group.
        group: GroupId,
        /// The tier that ran out.
        tier: Tier,
    },
    /// No window group has this id.
    #[error("window group {} does not exist", .0.0)]
    UnknownGroup(GroupId),
    /// A block index outside the pool.
    #[error("block {block} is outside the {tier:?} pool of window group {}", group.0)]
    UnknownBlock {
        /// The window group.
        group: GroupId,
        /// The tier.
        tier: Tier,
        /// The offending index.
        block: u32,
    },
    /// A priority above 100.
    #[error("priority {0} is not in 0..=100")]
    InvalidPriority(u8),
    /// The configuration is inconsistent; the message says how.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// A request was added with no tokens.
    #[error("{0} has no tokens")]
    EmptyRequest(RequestId),
    /// A call asked for more tokens than the request has, or a length that does not fit.
    #[error("{request}: {what}")]
    InvalidLength {
        /// The request.
        request: RequestId,
        /// What was wrong.
        what: String,
    },
    /// An output buffer is too small or a request has more blocks than the table allows.
    #[error("block table: {0}")]
    TableTooSmall(String),
}
