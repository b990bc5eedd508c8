//! One tier's pool of block ids: reference counts, the free list and the evictable set.

use std::collections::BTreeSet;

/// Marks a block that no tree node owns.
pub(crate) const NO_NODE: u32 = u32::MAX;

/// Tags the tail block of a released lazy run: `RUN_TAG | run` in [`Pool::node`]. Node and run
/// ids stay below it: a group has no more of either than blocks, and groups with `RUN_TAG`
/// blocks or more keep no runs.
pub(crate) const RUN_TAG: u32 = 1 << 31;

/// The ordering key of an evictable block: lowest priority first, then least recently used.
pub(crate) type EvictKey = (u8, u64);

/// Per-block state of one tier. A block is in exactly one of three states: free (on the free
/// list, no node), used (`refcount > 0`), or cached and idle (`refcount == 0`, owned by a tree
/// node, in the evictable set when the leaf rule allows).
#[derive(Debug)]
pub(crate) struct Pool {
    pub(crate) refcount: Vec<u32>,
    pub(crate) node: Vec<u32>,
    evict_key: Vec<Option<EvictKey>>,
    free: Vec<u32>,
    evictable: Evictable,
    used: u32,
}

/// The evictable blocks as (priority, last use, block), smallest first: an ordered set plus its
/// smallest member held outside it. Evicting a chain's leaf makes its parent the next leaf, and
/// the parent, used just after the leaf, usually precedes every other member: it then takes
/// the front without touching the tree, and evicting it reads the front back the same way.
#[derive(Debug, Default)]
struct Evictable {
    /// Smaller than every member of `rest` when set.
    front: Option<(u8, u64, u32)>,
    rest: BTreeSet<(u8, u64, u32)>,
}

impl Evictable {
    fn len(&self) -> usize {
        self.rest.len() + usize::from(self.front.is_some())
    }

    fn first(&self) -> Option<&(u8, u64, u32)> {
        self.front.as_ref().or_else(|| self.rest.first())
    }

    fn insert(&mut self, e: (u8, u64, u32)) {
        match self.front {
            Some(f) if e < f => {
                self.rest.insert(f);
                self.front = Some(e);
            }
            Some(_) => {
                self.rest.insert(e);
            }
            None if self.rest.first().is_none_or(|&m| e < m) => self.front = Some(e),
            None => {
                self.rest.insert(e);
            }
        }
    }

    fn remove(&mut self, e: &(u8, u64, u32)) {
        if self.front.as_ref() == Some(e) {
            self.front = None;
        } else {
            self.rest.remove(e);
        }
    }
}

impl Pool {
    /// A pool of `capacity` free blocks, or `None` where the allocator cannot give its
    /// bookkeeping (36 bytes a block) instead of the process's abort. Every vector is
    /// reserved before any is filled, so a refused pool has written nothing.
    pub(crate) fn new(capacity: u32) -> Option<Self> {
        let n = capacity as usize;
        let mut pool = Pool {
            refcount: Vec::new(),
            node: Vec::new(),
            evict_key: Vec::new(),
            free: Vec::new(),
            evictable: Evictable::default(),
            used: 0,
        };
        pool.refcount.try_reserve_exact(n).ok()?;
        pool.node.try_reserve_exact(n).ok()?;
        pool.evict_key.try_reserve_exact(n).ok()?;
        pool.free.try_reserve_exact(n).ok()?;
        pool.refcount.resize(n, 0);
        pool.node.resize(n, NO_NODE);
        pool.evict_key.resize(n, None);
        // Reversed so that the lowest ids are handed out first.
        pool.free.extend((0..capacity).rev());
        Some(pool)
    }

    pub(crate) fn capacity(&self) -> u32 {
        self.refcount.len() as u32
    }

    pub(crate) fn num_free(&self) -> u32 {
        self.free.len() as u32
    }

    pub(crate) fn num_used(&self) -> u32 {
        self.used
    }

    pub(crate) fn num_evictable(&self) -> u32 {
        self.evictable.len() as u32
    }

    pub(crate) fn free_list(&self) -> &[u32] {
        &self.free
    }

    pub(crate) fn evict_key(&self, block: u32) -> Option<EvictKey> {
        self.evict_key[block as usize]
    }

    /// Takes a block off the free list without referencing it.
    pub(crate) fn take_free(&mut self) -> Option<u32> {
        self.free.pop()
    }

    /// Returns an unreferenced block that no node owns to the free list.
    pub(crate) fn push_free(&mut self, block: u32) {
        debug_assert_eq!(self.refcount[block as usize], 0);
        debug_assert_eq!(self.node[block as usize], NO_NODE);
        debug_assert!(self.evict_key[block as usize].is_none());
        self.free.push(block);
    }

    /// Adds a reference; returns the new count.
    pub(crate) fn add_ref(&mut self, block: u32) -> u32 {
        let rc = &mut self.refcount[block as usize];
        if *rc == 0 {
            self.used += 1;
        }
        *rc += 1;
        *rc
    }

    /// Drops a reference; returns the new count.
    pub(crate) fn drop_ref(&mut self, block: u32) -> u32 {
        let rc = &mut self.refcount[block as usize];
        debug_assert!(*rc > 0, "dropping a reference of an unreferenced block");
        *rc = rc.saturating_sub(1);
        if *rc == 0 {
            self.used -= 1;
        }
        *rc
    }

    /// Puts the block into the evictable set under `key`, or takes it out with `None`.
    pub(crate) fn set_evictable(&mut self, block: u32, key: Option<EvictKey>) {
        let slot = &mut self.evict_key[block as usize];
        if *slot == key {
            return;
        }
        if let Some((p, t)) = slot.take() {
            self.evictable.remove(&(p, t, block));
        }
        if let Some((p, t)) = key {
            self.evictable.insert((p, t, block));
        }
        *slot = key;
    }

    /// The block to evict next, if any.
    pub(crate) fn first_evictable(&self) -> Option<u32> {
        self.evictable.first().map(|&(_, _, b)| b)
    }

    /// Gives a block that is neither free nor owned by a node its first reference.
    pub(crate) fn claim(&mut self, block: u32) {
        debug_assert_eq!(self.node[block as usize], NO_NODE);
        debug_assert!(self.evict_key[block as usize].is_none());
        debug_assert_eq!(self.refcount[block as usize], 0);
        self.refcount[block as usize] = 1;
        self.used += 1;
    }
}
