//! The crate's error type.

/// Everything attn-op rejects. Every entry point validates its inputs before computing and
/// answers with one of these instead of panicking; outputs are left untouched on error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AttnError {
    /// Query heads are not a multiple of KV heads, or a count is zero.
    #[error("{q_heads} query heads cannot be grouped over {kv_heads} KV heads")]
    Heads {
        /// Query heads.
        q_heads: usize,
        /// KV heads.
        kv_heads: usize,
    },
    /// A buffer's length does not match the shape the other arguments imply.
    #[error("{what}: expected {expected} elements, got {got}")]
    Length {
        /// Which buffer.
        what: &'static str,
        /// Length implied by the shapes.
        expected: usize,
        /// Length given.
        got: usize,
    },
    /// Metadata arrays are inconsistent (non-monotonic `cu_seqlens_q`, a query longer than its
    /// KV, a negative length, …); the message says which.
    #[error("invalid metadata: {0}")]
    Metadata(String),
    /// A block id outside the KV pool.
    #[error("sequence {seq}: block id {block} is outside the pool of {num_blocks} blocks")]
    BlockOutOfRange {
        /// The sequence.
        seq: usize,
        /// The offending id.
        block: i32,
        /// Blocks in the pool.
        num_blocks: usize,
    },
    /// A selected page, token or slot outside its sequence or pool.
    #[error("{what} {index} is out of range (limit {limit})")]
    IndexOutOfRange {
        /// What kind of index.
        what: &'static str,
        /// The offending value.
        index: i64,
        /// The exclusive upper bound.
        limit: i64,
    },
    /// A layout or parameter that cannot work (block size 0, selection granularity that neither
    /// divides nor is a multiple of the page size, unsorted keep list, …).
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// The allocator could not give a buffer this large (a KV pool sized past the machine's
    /// memory, say).
    #[error("cannot allocate {bytes} bytes")]
    OutOfMemory {
        /// Bytes asked for.
        bytes: usize,
    },
    /// No usable CUDA driver, device or compiler, or a CUDA call failed (the `cuda` feature).
    #[error("CUDA device: {0}")]
    Device(String),
}

/// Checks that a buffer of `got` elements holds the product of `extents`, else
/// [`AttnError::Length`]. The product saturates at `usize::MAX`: extents whose product
/// overflows match no buffer's length, so they are refused instead of panicking or wrapping.
pub(crate) fn check_len(
    what: &'static str,
    got: usize,
    extents: &[usize],
) -> Result<(), AttnError> {
    let expected = extents.iter().fold(1usize, |a, &b| a.saturating_mul(b));
    if got == expected {
        Ok(())
    } else {
        Err(AttnError::Length {
            what,
            expected,
            got,
        })
    }
}
