//! Small typed identifiers and values shared by the whole crate.

use std::fmt;

use crate::KvError;

/// The index of a block inside one tier's pool of one window group.
///
/// A `BlockId` only means something together with its [`Tier`] and [`GroupId`]: the offload layer
/// maps it to `block * block_size + offset` slots of that pool's block tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlockId(pub(crate) u32);

impl BlockId {
    /// A block id from its index; the manager checks it against the pool it is used with.
    pub fn new(index: u32) -> Self {
        BlockId(index)
    }

    /// The index as a `usize`, for indexing a block tensor.
    pub fn index(self) -> usize {
        self.0 as usize
    }

    /// The index as the `i32` used by the flat `block_table` metadata arrays.
    pub fn as_i32(self) -> i32 {
        // Pool capacities are validated to be at most `i32::MAX` blocks, so every id fits.
        self.0 as i32
    }
}

impl fmt::Display for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// A memory tier holding KV blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    /// Device (GPU) memory: where attention reads KV in dense mode.
    Primary,
    /// Host memory: the offload target, and where sparse-mode requests keep their full KV.
    Secondary,
}

impl Tier {
    /// Both tiers, primary first.
    pub const ALL: [Tier; 2] = [Tier::Primary, Tier::Secondary];

    pub(crate) fn index(self) -> usize {
        match self {
            Tier::Primary => 0,
            Tier::Secondary => 1,
        }
    }
}

/// Where a block lives: a tier and a block index in that tier's pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockLoc {
    /// The tier of the pool.
    pub tier: Tier,
    /// The block inside the pool.
    pub block: BlockId,
}

/// A caller-chosen request identifier, unique among live requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "request {}", self.0)
    }
}

/// The index of a window group (one pool per attention window size and KV head count), in the
/// order of [`KvCacheConfig::groups`](crate::KvCacheConfig::groups).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GroupId(pub u32);

impl GroupId {
    pub(crate) fn index(self) -> usize {
        self.0 as usize
    }
}

/// An eviction priority between 0 and 100; higher is kept longer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Priority(u8);

impl Priority {
    /// The lowest priority: evicted first.
    pub const MIN: Priority = Priority(0);
    /// The highest priority: evicted last.
    pub const MAX: Priority = Priority(100);
    /// The priority of blocks without a retention rule, and the one timed rules revert to.
    pub const DEFAULT: Priority = Priority(35);

    /// A priority from a value in `0..=100`.
    pub fn new(value: u8) -> Result<Self, KvError> {
        if value <= 100 {
            Ok(Priority(value))
        } else {
            Err(KvError::InvalidPriority(value))
        }
    }

    /// The value in `0..=100`.
    pub fn get(self) -> u8 {
        self.0
    }
}

impl Default for Priority {
    fn default() -> Self {
        Priority::DEFAULT
    }
}

/// A content hash of a cached block, chained from its parent (and so covering the whole prefix,
/// the cache salt and the extra ids). Stable for as long as the block stays cached; events use it
/// to name blocks, so an external router can mirror the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockHash(pub u64);
