//! One window group: its two pools, its radix tree, and every block operation on them.
//!
//! The manager owns one `Group` per (attention window, KV heads) pair and applies each request
//! operation to all of them; a request's blocks in one group are its [`SeqBlocks`].

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

use crate::events::EventQueue;
use crate::lazy::{NoOwners, Own, Owners, Run, RunEnd, RunState, SharedTokens};
use crate::pool::{NO_NODE, Pool, RUN_TAG};
use crate::tree::{Insert, NO_RUN, Parent, RootKey, Tree};
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
    pub(crate) fn new(
        id: GroupId,
        window: Option<u32>,
        bs: u32,
        primary: u32,
        secondary: u32,
        eager_hashes: bool,
    ) -> Self {
        Group {
            id,
            window,
            bs,
            pools: [Pool::new(primary), Pool::new(secondary)],
            tree: Tree::new(bs, eager_hashes),
            lazy: window.is_none()
                && !eager_hashes
                && u64::from(primary) + u64::from(secondary) < u64::from(RUN_TAG),
            runs: Vec::new(),
            free_runs: Vec::new(),
            expiry: BinaryHeap::new(),
        }
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

    // ---- reuse (the lookups are in walk.rs) ---------------------------------------------------

    /// Builds the request's table: `reuse` tokens from the tree (shareable full blocks, onboarded
    /// when they sit in the other tier, then the rest copied or taken over from the best
    /// matching child), fresh blocks after that. Every source is referenced before anything is
    /// allocated, so no allocation can evict a block this call is about to use. On error the
    /// blocks already in `seq` must be released by the caller.
    pub(crate) fn attach(
        &mut self,
        seq: &mut SeqBlocks,
        info: &SeqInfo<'_>,
        reuse: u32,
        owners: &dyn Owners,
        sh: &mut Shared,
    ) -> Result<(), KvError> {
        if reuse > 0 {
            self.attach_reused(seq, info, reuse, owners, sh)?;
        }
        self.grow(seq, info.tier, info.tokens.len() as u32, sh)
    }

    fn attach_reused(
        &mut self,
        seq: &mut SeqBlocks,
        info: &SeqInfo<'_>,
        reuse: u32,
        owners: &dyn Owners,
        sh: &mut Shared,
    ) -> Result<(), KvError> {
        let bs = self.bs;
        let walk = |g: &Self| {
            g.walk(info, reuse, owners)
                .expect("invariant: a reuse length > 0 was matched from this root")
        };
        // Runs the request walks into, or that hang where it stops (its blocks will be stored
        // there), become nodes first.
        loop {
            let (at, _) = walk(self);
            let r = match at {
                At::Lazy(r, _) => r,
                At::Node(n) if self.tree.node(n).tail != NO_RUN => self.tree.node(n).tail,
                _ => break,
            };
            self.materialize(r, owners, sh);
        }
        let (at, path) = walk(self);
        let node = |at: At| at.node().expect("invariant: no run is left on the path");
        let path: Vec<u32> = path.into_iter().map(node).collect();
        let parent = at.parent().expect("invariant: no run is left on the path");
        let full = path.len() as u32 * bs;
        let rest = reuse - full;
        let partial = (rest > 0).then(|| {
            let want = &info.tokens[full as usize..reuse as usize];
            let (src, _) = self
                .best_partial(at, want, info.tier, &sh.opts, owners)
                .expect("invariant: the partial reuse was checked feasible");
            node(src)
        });
        // Hold every source.
        let mut held: Vec<BlockLoc> = path
            .iter()
            .chain(&partial)
            .map(|&n| self.tree.node(n).loc)
            .collect();
        for loc in &held {
            self.pools[loc.tier.index()].add_ref(loc.block.0);
            self.refresh(loc.tier, loc.block.0);
        }
        // Bring shared blocks of the other tier over.
        for (i, &c) in path.iter().enumerate() {
            if held[i].tier != info.tier {
                match self.onboard_held(c, sh) {
                    Ok(loc) => held[i] = loc,
                    Err(e) => {
                        for loc in held {
                            self.unref(loc.tier, loc.block.0, sh);
                        }
                        return Err(e);
                    }
                }
            }
        }
        for (i, &c) in path.iter().enumerate() {
            seq.table.push(Some(held[i].block));
            let (prio, dur) = info.retention.for_block(i as u32, bs, info.prompt_len);
            self.set_priority(c, prio, dur, sh);
        }
        seq.stored = path.len() as u32;
        seq.chain = match parent {
            Parent::Node(c) => Chain::Node(c, self.tree.node(c).generation),
            Parent::Root(_) => Chain::Root,
        };
        let Some(src) = partial else {
            return Ok(());
        };
        let sloc = held[path.len()];
        if !sh.opts.copy_on_partial_reuse && sloc.tier == info.tier && self.tree.childless(src) {
            // Take it over: our hold becomes the request's reference.
            self.drop_subtree(src, sh);
            seq.table.push(Some(sloc.block));
            return Ok(());
        }
        let dst = self.alloc(info.tier, sh);
        self.unref(sloc.tier, sloc.block.0, sh);
        let dst = dst?;
        sh.transfers.push(Transfer {
            group: self.id,
            src: sloc,
            dst: BlockLoc {
                tier: info.tier,
                block: BlockId(dst),
            },
            num_tokens: Some(rest),
            kind: TransferKind::Copy,
        });
        sh.stats.partial_copies += 1;
        seq.table.push(Some(BlockId(dst)));
        Ok(())
    }

    /// Allocates blocks until the table covers `len` tokens.
    pub(crate) fn grow(
        &mut self,
        seq: &mut SeqBlocks,
        tier: Tier,
        len: u32,
        sh: &mut Shared,
    ) -> Result<(), KvError> {
        let want = blocks_for(len, self.bs);
        seq.table.reserve(want.saturating_sub(seq.table.len()));
        let pool = &mut self.pools[tier.index()];
        while seq.table.len() < want
            && let Some(b) = pool.take_free()
        {
            pool.claim(b);
            seq.table.push(Some(BlockId(b)));
            sh.stats.allocated += 1;
        }
        // The free list ran dry: evict.
        while seq.table.len() < want {
            let front = self.pools[tier.index()].first_evictable();
            if let Some(r) = front.and_then(|b| self.droppable_run(tier, b, sh)) {
                // Evicting a run's tail block by block would free each block and take it back
                // at once: hand them over directly, as many as are needed.
                let k = (want - seq.table.len()) as u32;
                let got = self.evict_from_run(r, k, sh, |pool, b| {
                    pool.claim(b);
                    seq.table.push(Some(BlockId(b)));
                });
                sh.stats.allocated += u64::from(got);
                continue;
            }
            let b = self.alloc(tier, sh)?;
            seq.table.push(Some(BlockId(b)));
        }
        Ok(())
    }

    // ---- storing -------------------------------------------------------------------------------

    /// Offers to the tree every full block within the first `storable` tokens not offered yet.
    pub(crate) fn store(
        &mut self,
        seq: &mut SeqBlocks,
        info: &SeqInfo<'_>,
        storable: u32,
        owners: &dyn Owners,
        sh: &mut Shared,
    ) {
        if !sh.opts.enable_reuse {
            return;
        }
        let bs = self.bs;
        let end = (storable / bs).min(seq.table.len() as u32);
        let uniform = if self.lazy {
            info.retention.uniform()
        } else {
            None
        };
        while seq.stored < end {
            if let Chain::Run(r, generation) = seq.chain {
                match self.run_end(r, generation) {
                    RunEnd::Live => {
                        self.extend_run(r, end);
                        sh.stats.stored += u64::from(end - seq.stored);
                        seq.stored = end;
                        break;
                    }
                    RunEnd::Moved(n, generation) => seq.chain = Chain::Node(n, generation),
                    RunEnd::Gone => seq.chain = Chain::Broken,
                }
            }
            let i = seq.stored;
            seq.stored += 1;
            let parent = match seq.chain {
                Chain::Broken => continue,
                Chain::Run(..) => unreachable!("invariant: a run chain was resolved above"),
                Chain::Root => Parent::Root(self.tree.get_or_create_root(info.root_key)),
                Chain::Node(n, generation) => {
                    let node = self.tree.node(n);
                    if node.alive && node.generation == generation {
                        Parent::Node(n)
                    } else {
                        seq.chain = Chain::Broken;
                        continue;
                    }
                }
            };
            let Some(b) = seq.table[i as usize] else {
                seq.chain = Chain::Broken;
                continue;
            };
            let existing = self.pools[info.tier.index()].node[b.index()];
            if existing != NO_NODE {
                seq.chain = Chain::Node(existing, self.tree.node(existing).generation);
                continue;
            }
            if let Parent::Node(p) = parent {
                let tail = self.tree.node(p).tail;
                if tail != NO_RUN {
                    // Another request's run hangs here (this one's chain joined an equal block
                    // it does not hold): the run becomes nodes before anything is stored beside.
                    self.materialize(tail, owners, sh);
                }
                if let Some((r, generation)) =
                    self.try_start_run(seq, p, info.id, info.tier, uniform, (i, end))
                {
                    sh.stats.stored += u64::from(end - i);
                    seq.stored = end;
                    seq.chain = Chain::Run(r, generation);
                    break;
                }
            }
            let toks = &info.tokens[(i * bs) as usize..((i + 1) * bs) as usize];
            let loc = BlockLoc {
                tier: info.tier,
                block: b,
            };
            let (prio, dur) = info.retention.for_block(i, bs, info.prompt_len);
            let tick = sh.tick;
            match self.tree.insert(parent, toks, loc, prio, tick) {
                Insert::New(n) => {
                    self.pools[info.tier.index()].node[b.index()] = n;
                    let generation = self.tree.node(n).generation;
                    if let Some(d) = dur {
                        self.expiry
                            .push(Reverse((sh.now.saturating_add(d), n, generation, 0)));
                    }
                    sh.stats.stored += 1;
                    if sh.events.enabled() {
                        let parent_hash = self.tree.parent_hash(parent).map(BlockHash);
                        sh.events.push(KvEvent::Stored {
                            group: self.id,
                            hash: BlockHash(self.tree.hash(n)),
                            parent: parent_hash,
                            tier: info.tier,
                            priority: prio,
                        });
                    }
                    self.refresh_parent(parent);
                    seq.chain = Chain::Node(n, generation);
                }
                Insert::Existing(n) => {
                    seq.chain = Chain::Node(n, self.tree.node(n).generation);
                }
                Insert::Collision => seq.chain = Chain::Broken,
            }
        }
    }

    // ---- shrinking -----------------------------------------------------------------------------

    /// Releases blocks that left the attention window, given that the next token to compute is
    /// at position `computed`.
    pub(crate) fn release_window(
        &mut self,
        seq: &mut SeqBlocks,
        tier: Tier,
        computed: u32,
        sh: &mut Shared,
    ) {
        let Some(w) = self.window else {
            return;
        };
        let bs = u64::from(self.bs);
        while seq.first_live < seq.table.len()
            && (seq.first_live as u64 + 1) * bs + u64::from(w) <= u64::from(computed)
        {
            if let Some(b) = seq.table[seq.first_live].take() {
                self.unref(tier, b.0, sh);
            }
            seq.first_live += 1;
        }
    }

    /// Releases every block of the request, last block first (so a chain's tail is the least
    /// recently used and goes first).
    ///
    /// A request whose chain ends in its live lazy run hands the run its table and its tokens
    /// (from `tokens`, called only then).
    pub(crate) fn release(
        &mut self,
        seq: &mut SeqBlocks,
        tier: Tier,
        tokens: &mut dyn FnMut() -> SharedTokens,
        sh: &mut Shared,
    ) {
        if let Chain::Run(r, generation) = seq.chain {
            seq.chain = Chain::Broken;
            if let RunEnd::Live = self.run_end(r, generation) {
                self.release_run(seq, r, &tokens(), sh);
            }
        }
        while let Some(entry) = seq.table.pop() {
            if let Some(b) = entry {
                self.unref(tier, b.0, sh);
            }
        }
        seq.first_live = 0;
    }

    /// Before the request is cut to `len` tokens (of `tokens`): its live run becomes nodes when
    /// the cut reaches into it, so the cut meets only nodes.
    pub(crate) fn cut_run(&mut self, seq: &mut SeqBlocks, tokens: &[u32], len: u32, sh: &Shared) {
        let Chain::Run(r, generation) = seq.chain else {
            return;
        };
        let run = self.run(r);
        let live = run.generation == generation && matches!(run.state, RunState::Live(_));
        if !live || u64::from(len) >= u64::from(run.first + run.len) * u64::from(self.bs) {
            return;
        }
        let own = Own {
            tokens,
            table: &seq.table,
        };
        self.materialize(r, &own, sh);
        if let RunEnd::Moved(n, generation) = self.run_end(r, generation) {
            seq.chain = Chain::Node(n, generation);
        }
    }

    /// First half of shrinking the request to `len` tokens: a last block left partial that other
    /// requests can see (it is cached or shared) needs a private copy, since the request will
    /// overwrite its tail. Allocates that copy's block (the only step that can fail) and returns
    /// (old block, new block); nothing else changes.
    pub(crate) fn prepare_truncate(
        &mut self,
        seq: &SeqBlocks,
        tier: Tier,
        len: u32,
        sh: &mut Shared,
    ) -> Result<Option<(BlockId, BlockId)>, KvError> {
        let keep = blocks_for(len, self.bs);
        let t = tier.index();
        if !len.is_multiple_of(self.bs)
            && let Some(Some(b)) = seq.table.get(keep - 1).copied()
            && (self.pools[t].node[b.index()] != NO_NODE || self.pools[t].refcount[b.index()] > 1)
        {
            let dst = self.alloc(tier, sh)?;
            return Ok(Some((b, BlockId(dst))));
        }
        Ok(None)
    }

    /// Undoes [`prepare_truncate`](Self::prepare_truncate) when another group failed.
    pub(crate) fn cancel_truncate(
        &mut self,
        tier: Tier,
        prepared: Option<(BlockId, BlockId)>,
        sh: &mut Shared,
    ) {
        if let Some((_, dst)) = prepared {
            self.unref(tier, dst.0, sh);
        }
    }

    /// Second half of shrinking the request to `len` tokens: frees the blocks past them (last
    /// first) and swaps in the private copy prepared for a shared partial last block.
    pub(crate) fn finish_truncate(
        &mut self,
        seq: &mut SeqBlocks,
        tier: Tier,
        len: u32,
        prepared: Option<(BlockId, BlockId)>,
        sh: &mut Shared,
    ) {
        let bs = self.bs;
        let keep = blocks_for(len, bs);
        let t = tier.index();
        while seq.table.len() > keep {
            if let Some(Some(b)) = seq.table.pop() {
                self.unref(tier, b.0, sh);
            }
        }
        if let Some((old, new)) = prepared {
            sh.transfers.push(Transfer {
                group: self.id,
                src: BlockLoc { tier, block: old },
                dst: BlockLoc { tier, block: new },
                num_tokens: Some(len % bs),
                kind: TransferKind::Copy,
            });
            sh.stats.partial_copies += 1;
            seq.table[keep - 1] = Some(new);
            self.unref(tier, old.0, sh);
        }
        let full = len / bs;
        if seq.stored > full {
            seq.stored = full;
            seq.chain = if full == 0 {
                Chain::Root
            } else {
                match seq.table[full as usize - 1] {
                    Some(b) if self.pools[t].node[b.index()] != NO_NODE => {
                        let n = self.pools[t].node[b.index()];
                        Chain::Node(n, self.tree.node(n).generation)
                    }
                    _ => Chain::Broken,
                }
            };
        }
    }

    // ---- audit ---------------------------------------------------------------------------------

    /// Checks the group's internal invariants; the error says which one broke.
    pub(crate) fn audit(&self, owners: &dyn Owners) -> Result<(), String> {
        let g = self.id.0;
        let in_runs = self.audit_runs(owners)?;
        for tier in Tier::ALL {
            let in_run = &in_runs[tier.index()];
            let pool = self.pool(tier);
            let cap = pool.capacity() as usize;
            let mut on_free = vec![false; cap];
            for &b in pool.free_list() {
                let b = b as usize;
                if on_free[b] {
                    return Err(format!(
                        "group {g} {tier:?}: block {b} twice on the free list"
                    ));
                }
                on_free[b] = true;
                if pool.refcount[b] != 0
                    || pool.node[b] != NO_NODE
                    || pool.evict_key(b as u32).is_some()
                    || in_run[b]
                {
                    return Err(format!(
                        "group {g} {tier:?}: free block {b} is referenced, cached or evictable"
                    ));
                }
            }
            let (mut used, mut idle) = (0u32, 0u32);
            #[allow(clippy::needless_range_loop)] // b indexes four parallel arrays
            for b in 0..cap {
                let n = pool.node[b];
                if pool.refcount[b] > 0 {
                    used += 1;
                } else if n != NO_NODE || in_run[b] {
                    idle += 1;
                } else if !on_free[b] {
                    return Err(format!(
                        "group {g} {tier:?}: block {b} leaked (unreferenced, uncached, not free)"
                    ));
                }
                if n != NO_NODE && n & RUN_TAG != 0 {
                    let r = n & !RUN_TAG;
                    let run = self.runs.get(r as usize);
                    let tail = run
                        .filter(|run| matches!(run.state, RunState::Released { .. }) && run.len > 0)
                        .map(|run| self.released_block(r, run.len - 1));
                    if tail != Some(b as u32)
                        || pool.evict_key(b as u32) != Some(self.run_tail_key(r))
                    {
                        return Err(format!(
                            "group {g} {tier:?}: block {b} is tagged for run {r} but is not its evictable tail"
                        ));
                    }
                    continue;
                }
                if n != NO_NODE {
                    let node = self.tree.node(n);
                    if !node.alive
                        || node.loc
                            != (BlockLoc {
                                tier,
                                block: BlockId(b as u32),
                            })
                    {
                        return Err(format!(
                            "group {g} {tier:?}: block {b} points at node {n} which is elsewhere"
                        ));
                    }
                }
                let want = (pool.refcount[b] == 0 && n != NO_NODE)
                    .then(|| self.leaf_key(tier, n))
                    .flatten();
                if pool.evict_key(b as u32) != want {
                    return Err(format!(
                        "group {g} {tier:?}: block {b} evictable state is stale"
                    ));
                }
            }
            if used != pool.num_used() {
                return Err(format!(
                    "group {g} {tier:?}: used counter {} but {used} referenced",
                    pool.num_used()
                ));
            }
            if pool.num_free() + used + idle != pool.capacity() {
                return Err(format!(
                    "group {g} {tier:?}: free + used + cached != capacity"
                ));
            }
        }
        for n in self.tree.live_nodes() {
            let node = self.tree.node(n);
            if self.pool(node.loc.tier).node[node.loc.block.index()] != n {
                return Err(format!("group {g}: node {n} is not owned by its block"));
            }
            let mut counts = [0u32; 2];
            for &c in node.children.as_slice() {
                let child = self.tree.node(c);
                if !child.alive || child.parent != Parent::Node(n) {
                    return Err(format!("group {g}: node {n} lists a stale child {c}"));
                }
                counts[child.loc.tier.index()] += 1;
            }
            if counts != node.children_in {
                return Err(format!(
                    "group {g}: node {n} per-tier child counts are wrong"
                ));
            }
            if self.tree.lookup(node.parent, self.tree.tokens(n)) != Some(n) {
                return Err(format!("group {g}: node {n} is not found under its parent"));
            }
        }
        Ok(())
    }
}
