//! The bounded stream of cache events.

use std::collections::VecDeque;

use crate::{BlockHash, GroupId, Priority, Tier};

/// Something that happened to the reusable (cached) blocks of the manager.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// A window group's pools were created.
    Created {
        /// The group.
        group: GroupId,
        /// Blocks in its primary pool.
        primary_blocks: u32,
        /// Blocks in its secondary pool.
        secondary_blocks: u32,
    },
    /// A full block became reusable.
    Stored {
        /// The group.
        group: GroupId,
        /// The block's chained content hash.
        hash: BlockHash,
        /// The parent's hash; `None` for the first block of a prefix.
        parent: Option<BlockHash>,
        /// Where it is stored.
        tier: Tier,
        /// Its priority.
        priority: Priority,
    },
    /// A block stopped being reusable (evicted, or taken over by a partial reuse).
    Removed {
        /// The group.
        group: GroupId,
        /// The block's chained content hash.
        hash: BlockHash,
        /// The tier it was in.
        tier: Tier,
    },
    /// A cached block's priority changed (a reuse with another retention, or a timed reversion).
    Updated {
        /// The group.
        group: GroupId,
        /// The block's chained content hash.
        hash: BlockHash,
        /// The new priority.
        priority: Priority,
    },
    /// A cached block moved between tiers (offload or onboard); it stays reusable.
    TierChanged {
        /// The group.
        group: GroupId,
        /// The block's chained content hash.
        hash: BlockHash,
        /// The tier it left.
        from: Tier,
        /// The tier it is in now.
        to: Tier,
    },
}

/// Events taken from the manager, oldest first, and how many were dropped because the buffer was
/// full since the previous drain.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EventBatch {
    /// The buffered events, oldest first.
    pub events: Vec<KvEvent>,
    /// Events that did not fit in the buffer and were dropped (the newest ones are dropped, so
    /// `events` is an unbroken prefix of what happened).
    pub dropped: u64,
}

/// A bounded FIFO of events with an overflow counter; capacity 0 turns events off.
#[derive(Debug)]
pub(crate) struct EventQueue {
    capacity: usize,
    events: VecDeque<KvEvent>,
    dropped: u64,
}

impl EventQueue {
    pub(crate) fn new(capacity: usize) -> Self {
        EventQueue {
            capacity,
            events: VecDeque::new(),
            dropped: 0,
        }
    }

    /// Whether anyone listens; callers skip building events when not.
    pub(crate) fn enabled(&self) -> bool {
        self.capacity > 0
    }

    pub(crate) fn push(&mut self, event: KvEvent) {
        if !self.enabled() {
            return;
        }
        if self.events.len() < self.capacity {
            self.events.push_back(event);
        } else {
            self.dropped += 1;
        }
    }

    pub(crate) fn drain(&mut self) -> EventBatch {
        EventBatch {
            events: self.events.drain(..).collect(),
            dropped: std::mem::take(&mut self.dropped),
        }
    }
}
