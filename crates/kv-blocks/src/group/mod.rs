//! One window group: its two pools, its radix tree, and every block operation on them.
//!
//! The manager owns one `Group` per (attention window, KV heads) pair and applies each request
//! operation to all of them; a request's blocks in one group are its [`SeqBlocks`].

mod audit;
mod seq;

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

use crate::events::EventQueue;
use crate::lazy::{NoOwners, Run};
use crate::pool::{NO_NODE, Pool, RUN_TAG};
use crate::tree::{NO_RUN, Parent, RootKey, Tree};
use crate::walk::At;
use crate::{
    BlockHash, BlockId, BlockLoc, CacheStats, GroupId, KvError, KvEvent, Priority, RequestId,
    RetentionPolicy, Tier, Transfer, TransferKind,
};

/// Settings every group reads.
#[derive(Debug)]
pub(crate) struct Opts {
    pub(crate) bs: u32,
    pub(crate) enable_reuse: bool,
    pub(crate) enable_partial_reuse: bool,
    pub(crate) copy_on_partial_reuse: bool,
    pub(crate) offload_min: Priority,
}

/// State shared by all groups: outputs of operations and counters.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) opts: Opts,
    pub(crate) events: EventQueue,
    pub(crate) transfers: Vec<Transfer>,
    pub(crate) stats: CacheStats,
    pub(crate) tick: u64,
    pub(crate) now: Duration,
}

impl Shared {
    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }
}

/// What a group needs to know about a request.
pub(crate) struct SeqInfo<'a> {
    pub(crate) id: RequestId,
    pub(crate) tier: Tier,
    pub(crate) tokens: &'a [u32],
    pub(crate) prompt_len: u32,
    pub(crate) root_key: &'a RootKey,
    pub(crate) retention: &'a RetentionPolicy,
}

/// Where the next block of a request is stored in the tree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Chain {
    /// Under the request's root.
    Root,
    /// Under a node, valid while the node keeps this generation.
    Node(u32, u32),
    /// At the end of the request's lazy run (run, run generation).
    Run(u32, u32),
    /// Nowhere: the chain was cut (a parent was evicted, or a hash collided).
    Broken,
}

/// A request's blocks in one group.
#[derive(Debug)]
pub(crate) struct SeqBlocks {
    /// Block of each logical block index; `None` once it left the attention window.
    pub(crate) table: Vec<Option<BlockId>>,
    /// Blocks before this index have left the window.
    pub(crate) first_live: usize,
    /// Blocks before this index have been offered to the tree.
    stored: u32,
    chain: Chain,
}

impl SeqBlocks {
    pub(crate) fn new() -> Self {
        SeqBlocks {
            table: Vec::new(),
            first_live: 0,
            stored: 0,
            chain: Chain::Root,
        }
    }
}

fn blocks_for(len: u32, bs: u32) -> usize {
    len.div_ceil(bs) as usize
}

/// One window group's pools and tree.
pub(crate) struct Group {
    pub(crate) id: GroupId,
    pub(crate) window: Option<u32>,
    pub(crate) bs: u32,
    pub(crate) pools: [Pool; 2],
    pub(crate) tree: Tree,
    /// Whether requests' stored blocks may be kept as lazy runs (see lazy.rs): no events, no
    /// window, and ids that fit under [`RUN_TAG`].
    pub(crate) lazy: bool,
    pub(crate) runs: Vec<Run>,
    pub(crate) free_runs: Vec<u32>,
    /// Pending priority reversions: (when, node, node generation, priority generation).
    expiry: BinaryHeap<Reverse<(Duration, u32, u32, u32)>>,
}

impl Group {
    /// A group with empty pools of `primary` and `secondary` blocks; `None` where their
    /// bookkeeping cannot be allocated.
    pub(crate) fn new(
        id: GroupId,
        window: Option<u32>,
        bs: u32,
        primary: u32,
        secondary: u32,
        eager_hashes: bool,
    ) -> Option<Self> {
        Some(Group {
            id,
            window,
            bs,
            pools: [Pool::new(primary)?, Pool::new(secondary)?],
            tree: Tree::new(bs, eager_hashes),
            lazy: window.is_none()
                && !eager_hashes
                && u64::from(primary) + u64::from(secondary) < u64::from(RUN_TAG),
            runs: Vec::new(),
            free_runs: Vec::new(),
            expiry: BinaryHeap::new(),
        })
    }

    pub(crate) fn pool(&self, tier: Tier) -> &Pool {
        &self.pools[tier.index()]
    }

    // ---- evictable-set upkeep ----------------------------------------------------------------

    /// Puts a block into, or out of, the evictable set according to the rules: unreferenced,
    /// cached, and a leaf ([`leaf_key`](Self::leaf_key)).
    fn refresh(&mut self, tier: Tier, b: u32) {
        let pool = &self.pools[tier.index()];
        let n = pool.node[b as usize];
        debug_assert!(
            n == NO_NODE || n & RUN_TAG == 0,
            "a run's tail is kept by lazy.rs"
        );
        let key = (pool.refcount[b as usize] == 0 && n != NO_NODE)
            .then(|| self.leaf_key(tier, n))
            .flatten();
        self.pools[tier.index()].set_evictable(b, key);
    }

    /// The eviction key of cached node `n` in `tier` when it is a leaf: no child in the primary
    /// tier for a primary block; nothing at all under a secondary block, since dropping it
    /// would orphan it. A lazy run counts as a child in its tier.
    fn leaf_key(&self, tier: Tier, n: u32) -> Option<(u8, u64)> {
        let node = self.tree.node(n);
        let leaf = match tier {
            Tier::Primary => {
                node.children_in[0] == 0
                    && (node.tail == NO_RUN || self.run(node.tail).tier != Tier::Primary)
            }
            Tier::Secondary => self.tree.childless(n),
        };
        leaf.then_some((node.priority.get(), node.last_used))
    }

    pub(crate) fn refresh_node(&mut self, n: u32) {
        let loc = self.tree.node(n).loc;
        self.refresh(loc.tier, loc.block.0);
    }

    fn refresh_parent(&mut self, parent: Parent) {
        if let Parent::Node(p) = parent {
            self.refresh_node(p);
        }
    }

    // ---- allocation and eviction ---------------------------------------------------------------

    /// A block with one reference, taken from the free list or made free by eviction.
    fn alloc(&mut self, tier: Tier, sh: &mut Shared) -> Result<u32, KvError> {
        let b = self.take_block(tier, sh).ok_or(KvError::OutOfBlocks {
            group: self.id,
            tier,
        })?;
        self.pools[tier.index()].claim(b);
        sh.stats.allocated += 1;
        Ok(b)
    }

    /// An unreferenced block that nothing owns, evicting if needed.
    fn take_block(&mut self, tier: Tier, sh: &mut Shared) -> Option<u32> {
        loop {
            if let Some(b) = self.pools[tier.index()].take_free() {
                return Some(b);
            }
            if !self.evict_one(tier, sh) {
                return None;
            }
        }
    }

    /// Evicts the first evictable block of the tier: a primary block of high enough priority is
    /// offloaded to the secondary tier (and stays reusable), anything else is dropped from the
    /// tree with its descendants. Returns whether a block was freed.
    pub(crate) fn evict_one(&mut self, tier: Tier, sh: &mut Shared) -> bool {
        let Some(b) = self.pools[tier.index()].first_evictable() else {
            return false;
        };
        if let Some(r) = self.droppable_run(tier, b, sh) {
            self.evict_from_run(r, 1, sh, |pool, b| pool.push_free(b));
            return true;
        }
        let mut n = self.pools[tier.index()].node[b as usize];
        if n & RUN_TAG != 0 {
            // An offload moves one block to the other tier: the run becomes nodes first.
            self.materialize(n & !RUN_TAG, &NoOwners, sh);
            n = self.pools[tier.index()].node[b as usize];
        }
        self.pools[tier.index()].set_evictable(b, None);
        let offload = tier == Tier::Primary
            && self.tree.node(n).priority >= sh.opts.offload_min
            && self.pools[1].capacity() > 0;
        if offload && let Some(s) = self.take_block(Tier::Secondary, sh) {
            let dst = BlockLoc {
                tier: Tier::Secondary,
                block: BlockId(s),
            };
            self.move_node(n, dst, TransferKind::Offload, sh);
            // Making room in the secondary tier may have dropped a child of `n`, which put `b`
            // back into the evictable set; it is leaving for good.
            self.pools[0].set_evictable(b, None);
            self.pools[0].push_free(b);
        } else {
            self.drop_subtree(n, sh);
        }
        true
    }

    /// Removes a node and all its descendants from the tree; their unreferenced blocks become
    /// free, referenced ones stay with their requests as private blocks. Lazy runs in the
    /// subtree go block by block in the order their nodes would have.
    fn drop_subtree(&mut self, n: u32, sh: &mut Shared) {
        let top_parent = self.tree.node(n).parent;
        // Breadth-first, so that removing in reverse takes children before parents. A leaf, the
        // usual victim, needs no list at all.
        let mut order = Vec::new();
        if !self.tree.childless(n) {
            order.push(At::Node(n));
            let mut i = 0;
            while i < order.len() {
                let at = order[i];
                order.extend(self.kids(at));
                i += 1;
            }
        }
        let single = [At::Node(n)];
        let order: &[At] = if order.is_empty() { &single } else { &order };
        for &at in order.iter().rev() {
            sh.stats.evicted += 1;
            match at {
                At::Node(d) => self.drop_node(d, sh),
                At::Lazy(r, i) => self.drop_run_block(r, i),
                At::Root(_) => unreachable!("invariant: a subtree holds no root"),
            }
        }
        self.refresh_parent(top_parent);
    }

    /// Removes childless node `d` from the tree (see [`drop_subtree`](Self::drop_subtree)).
    fn drop_node(&mut self, d: u32, sh: &mut Shared) {
        let loc = self.tree.node(d).loc;
        let hash = sh.events.enabled().then(|| self.tree.hash(d));
        self.tree.remove(d);
        let pool = &mut self.pools[loc.tier.index()];
        let b = loc.block.0;
        pool.node[b as usize] = NO_NODE;
        pool.set_evictable(b, None);
        if pool.refcount[b as usize] == 0 {
            pool.push_free(b);
        }
        if let Some(hash) = hash {
            sh.events.push(KvEvent::Removed {
                group: self.id,
                hash: BlockHash(hash),
                tier: loc.tier,
            });
        }
    }

    /// Drops one reference to a block; an unreferenced block becomes evictable when cached and
    /// free otherwise.
    #[inline]
    pub(crate) fn unref(&mut self, tier: Tier, b: u32, sh: &mut Shared) {
        if self.pools[tier.index()].drop_ref(b) == 0 {
            let n = self.pools[tier.index()].node[b as usize];
            if n == NO_NODE {
                self.pools[tier.index()].push_free(b);
            } else {
                let tick = sh.next_tick();
                self.tree.node_mut(n).last_used = tick;
                self.refresh(tier, b);
            }
        }
    }

    /// Moves cached node `n` to `dst` in the other tier, recording the transfer, the counter and
    /// the event. The block it leaves has no node afterwards; the caller frees it.
    fn move_node(&mut self, n: u32, dst: BlockLoc, kind: TransferKind, sh: &mut Shared) {
        let src = self.tree.node(n).loc;
        self.tree.relocate(n, dst);
        self.pools[src.tier.index()].node[src.block.index()] = NO_NODE;
        self.pools[dst.tier.index()].node[dst.block.index()] = n;
        sh.transfers.push(Transfer {
            group: self.id,
            src,
            dst,
            num_tokens: None,
            kind,
        });
        if dst.tier == Tier::Primary {
            sh.stats.onboarded += 1;
        } else {
            sh.stats.offloaded += 1;
        }
        if sh.events.enabled() {
            sh.events.push(KvEvent::TierChanged {
                group: self.id,
                hash: BlockHash(self.tree.hash(n)),
                from: src.tier,
                to: dst.tier,
            });
        }
        self.refresh(dst.tier, dst.block.0);
        let parent = self.tree.node(n).parent;
        self.refresh_parent(parent);
    }

    /// Moves a secondary node that only the caller references into the primary tier; the
    /// caller's reference moves with it. Returns the new location.
    fn onboard_held(&mut self, n: u32, sh: &mut Shared) -> Result<BlockLoc, KvError> {
        let src = self.tree.node(n).loc;
        let s = src.block.0;
        let p = self.alloc(Tier::Primary, sh)?;
        let dst = BlockLoc {
            tier: Tier::Primary,
            block: BlockId(p),
        };
        self.move_node(n, dst, TransferKind::Onboard, sh);
        self.pools[1].drop_ref(s);
        self.pools[1].set_evictable(s, None);
        self.pools[1].push_free(s);
        Ok(dst)
    }

    // ---- priorities ----------------------------------------------------------------------------

    fn set_priority(
        &mut self,
        n: u32,
        priority: Priority,
        duration: Option<Duration>,
        sh: &mut Shared,
    ) {
        let node = self.tree.node_mut(n);
        let changed = node.priority != priority;
        node.priority = priority;
        node.prio_gen = node.prio_gen.wrapping_add(1);
        if let Some(d) = duration {
            let entry = (sh.now.saturating_add(d), n, node.generation, node.prio_gen);
            self.expiry.push(Reverse(entry));
        }
        if changed {
            if sh.events.enabled() {
                sh.events.push(KvEvent::Updated {
                    group: self.id,
                    hash: BlockHash(self.tree.hash(n)),
                    priority,
                });
            }
            self.refresh_node(n);
        }
    }

    /// Reverts the priority of blocks whose retention has run out.
    pub(crate) fn expire(&mut self, sh: &mut Shared) {
        while let Some(&Reverse((when, n, generation, prio_gen))) = self.expiry.peek() {
            if when > sh.now {
                break;
            }
            self.expiry.pop();
            let node = self.tree.node(n);
            if node.alive && node.generation == generation && node.prio_gen == prio_gen {
                self.set_priority(n, Priority::DEFAULT, None, sh);
            }
        }
    }
}
