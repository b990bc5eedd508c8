//! The crate's error type.

use attn_op::AttnError;

/// Everything sparse-algo rejects. Every entry point validates its inputs before computing and
/// answers with one of these instead of panicking.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AlgoError {
    /// A configuration value that cannot work (budget 0, page size 0, a window larger than the
    /// capacity, …); the message says which.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A buffer's length does not match the shape the other arguments imply.
    #[error("{what}: expected {expected} elements, got {got}")]
    Shape {
        /// Which buffer.
        what: &'static str,
        /// Length implied by the shapes.
        expected: usize,
        /// Length given.
        got: usize,
    },
    /// An argument outside its range (a pool slot, a layer, a sequence longer than the pool
    /// holds, …); the message says which.
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// The algorithm does not take part in this phase (a prefill-only algorithm asked for a
    /// decode selection, or the reverse).
    #[error("{algorithm} does not support {phase}")]
    Unsupported {
        /// The algorithm's name.
        algorithm: &'static str,
        /// The phase asked for.
        phase: &'static str,
    },
    /// The attention op rejected something (metrics run attention through attn-op).
    #[error(transparent)]
    Attn(#[from] AttnError),
}

/// Checks that a buffer of `got` elements holds the product of `extents`, the common case of
/// [`AlgoError::Shape`]. The product saturates at `usize::MAX`: extents whose product overflows
/// match no buffer's length, so they are refused instead of panicking or wrapping.
pub(crate) fn check_len(
    what: &'static str,
    got: usize,
    extents: &[usize],
) -> Result<(), AlgoError> {
    let expected = extents.iter().fold(1usize, |a, &b| a.saturating_mul(b));
    if got == expected {
        Ok(())
    } else {
        Err(AlgoError::Shape {
            what,
            expected,
            got,
        })
    }
}
