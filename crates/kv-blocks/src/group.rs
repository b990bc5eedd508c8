//! One window group: its two pools, its radix tree, and every block operation on them.
//!
//! The manager owns one `Group` per (attention window, KV heads) pair and applies each request
//! operation to all of them; a request's blocks in one group are its [`SeqBlocks`].

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

use crate::events::EventQueue;
use crate::pool::{NO_NODE, Pool};
use crate::tree::{Insert, Parent, RootKey, Tree};
use crate::{
    BlockHash, BlockId, BlockLoc, CacheStats, GroupId, KvError, KvEvent, Priority, RetentionPolicy,
    Tier, Transfer, TransferKind,
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

fn common_prefix(a: &[u32], b: &[u32]) -> u32 {
    a.iter().zip(b).take_while(|(x, y)| x == y).count() as u32
}

fn blocks_for(len: u32, bs: u32) -> usize {
    len.div_ceil(bs) as usize
}

/// One window group's pools and tree.
pub(crate) struct Group {
    pub(crate) id: GroupId,
    pub(crate) window: Option<u32>,
    bs: u32,
    pub(crate) pools: [Pool; 2],
    pub(crate) tree: Tree,
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
            expiry: BinaryHeap::new(),
        }
    }

    pub(crate) fn pool(&self, tier: Tier) -> &Pool {
        &self.pools[tier.index()]
    }

    // ---- evictable-set upkeep ----------------------------------------------------------------

    /// Puts a block into, or out of, the evictable set according to the rules: unreferenced,
    /// cached, and a leaf (no child in the primary tier for a primary block; no child at all for
    /// a secondary block, since dropping it would orphan them).
    fn refresh(&mut self, tier: Tier, b: u32) {
        let pool = &self.pools[tier.index()];
        let n = pool.node[b as usize];
        let key = if pool.refcount[b as usize] == 0 && n != NO_NODE {
            let node = self.tree.node(n);
            let leaf = match tier {
                Tier::Primary => node.children_in[0] == 0,
                Tier::Secondary => node.children.is_empty(),
            };
            leaf.then_some((node.priority.get(), node.last_used))
        } else {
            None
        };
        self.pools[tier.index()].set_evictable(b, key);
    }

    fn refresh_node(&mut self, n: u32) {
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
        let n = self.pools[tier.index()].node[b as usize];
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
    /// free, referenced ones stay with their requests as private blocks.
    fn drop_subtree(&mut self, n: u32, sh: &mut Shared) {
        let top_parent = self.tree.node(n).parent;
        // Breadth-first, so that removing in reverse takes children before parents. A leaf, the
        // usual victim, needs no list at all.
        let mut order = Vec::new();
        if !self.tree.node(n).children.is_empty() {
            order.push(n);
            let mut i = 0;
            while i < order.len() {
                order.extend_from_slice(self.tree.node(order[i]).children.as_slice());
                i += 1;
            }
        }
        let single = [n];
        let order: &[u32] = if order.is_empty() { &single } else { &order };
        for &d in order.iter().rev() {
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
            sh.stats.evicted += 1;
            if let Some(hash) = hash {
                sh.events.push(KvEvent::Removed {
                    group: self.id,
                    hash: BlockHash(hash),
                    tier: loc.tier,
                });
            }
        }
        self.refresh_parent(top_parent);
    }

    /// Drops one reference to a block; an unreferenced block becomes evictable when cached and
    /// free otherwise.
    fn unref(&mut self, tier: Tier, b: u32, sh: &mut Shared) {
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

    // ---- reuse ---------------------------------------------------------------------------------

    /// Whether a request in `tier` can share node `n` as is (same tier), or after onboarding it
    /// (a primary request and an unreferenced secondary node).
    fn can_share(&self, n: u32, tier: Tier) -> bool {
        let loc = self.tree.node(n).loc;
        loc.tier == tier
            || (tier == Tier::Primary && self.pools[1].refcount[loc.block.index()] == 0)
    }

    /// Whether a request in `tier` may take node `n` over for a partial reuse without copying.
    fn can_take(&self, n: u32, tier: Tier) -> bool {
        let node = self.tree.node(n);
        node.loc.tier == tier
            && node.children.is_empty()
            && self.pools[tier.index()].refcount[node.loc.block.index()] == 0
    }

    /// The child of `parent` sharing the longest prefix with `want` that this request can use.
    fn best_partial(
        &self,
        parent: Parent,
        want: &[u32],
        tier: Tier,
        opts: &Opts,
    ) -> Option<(u32, u32)> {
        self.tree
            .children(parent)
            .iter()
            .filter(|&&c| opts.copy_on_partial_reuse || self.can_take(c, tier))
            .map(|&c| (c, common_prefix(self.tree.tokens(c), want)))
            .filter(|&(_, k)| k > 0)
            .max_by_key(|&(_, k)| k)
    }

    /// Walks the full blocks of the request that are cached and shareable, up to `limit` tokens:
    /// the last parent reached and the nodes on the way.
    fn walk(&self, info: &SeqInfo<'_>, limit: u32) -> Option<(Parent, Vec<u32>)> {
        let bs = self.bs;
        let root = self.tree.find_root(info.root_key)?;
        let mut parent = Parent::Root(root);
        let mut path = Vec::new();
        let mut m = 0u32;
        while u64::from(m + 1) * u64::from(bs) <= u64::from(limit) {
            let toks = &info.tokens[(m * bs) as usize..((m + 1) * bs) as usize];
            match self.tree.lookup(parent, toks) {
                Some(c) if self.can_share(c, info.tier) => {
                    parent = Parent::Node(c);
                    path.push(c);
                    m += 1;
                }
                _ => break,
            }
        }
        Some((parent, path))
    }

    /// Tokens of the request's first `limit` tokens this group could reuse: shareable full
    /// blocks, then up to one block's worth of tokens copied (or taken over) from the child that
    /// matches best.
    pub(crate) fn match_len(&self, info: &SeqInfo<'_>, limit: u32, opts: &Opts) -> u32 {
        let Some((parent, path)) = self.walk(info, limit) else {
            return 0;
        };
        let full = path.len() as u32 * self.bs;
        if !opts.enable_partial_reuse || full >= limit {
            return full;
        }
        let end = limit.min(full + self.bs) as usize;
        let want = &info.tokens[full as usize..end];
        full + self
            .best_partial(parent, want, info.tier, opts)
            .map_or(0, |(_, k)| k)
    }

    /// Whether exactly `len` tokens can be reused: the shareable full blocks, plus a source for
    /// the rest (at most one block's worth).
    pub(crate) fn can_reuse_exactly(&self, info: &SeqInfo<'_>, len: u32, opts: &Opts) -> bool {
        let Some((parent, path)) = self.walk(info, len) else {
            return len == 0;
        };
        let full = path.len() as u32 * self.bs;
        let rest = len - full;
        rest == 0
            || (opts.enable_partial_reuse
                && rest <= self.bs
                && self
                    .best_partial(
                        parent,
                        &info.tokens[full as usize..len as usize],
                        info.tier,
                        opts,
                    )
                    .is_some_and(|(_, got)| got >= rest))
    }

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
        sh: &mut Shared,
    ) -> Result<(), KvError> {
        if reuse > 0 {
            self.attach_reused(seq, info, reuse, sh)?;
        }
        self.grow(seq, info.tier, info.tokens.len() as u32, sh)
    }

    fn attach_reused(
        &mut self,
        seq: &mut SeqBlocks,
        info: &SeqInfo<'_>,
        reuse: u32,
        sh: &mut Shared,
    ) -> Result<(), KvError> {
        let bs = self.bs;
        let (parent, path) = self
            .walk(info, reuse)
            .expect("invariant: a reuse length > 0 was matched from this root");
        let full = path.len() as u32 * bs;
        let rest = reuse - full;
        let partial = (rest > 0).then(|| {
            let want = &info.tokens[full as usize..reuse as usize];
            let (src, _) = self
                .best_partial(parent, want, info.tier, &sh.opts)
                .expect("invariant: the partial reuse was checked feasible");
            src
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
        if !sh.opts.copy_on_partial_reuse
            && sloc.tier == info.tier
            && self.tree.node(src).children.is_empty()
        {
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
        while seq.table.len() < want {
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
        sh: &mut Shared,
    ) {
        if !sh.opts.enable_reuse {
            return;
        }
        let bs = self.bs;
        let end = (storable / bs).min(seq.table.len() as u32);
        while seq.stored < end {
            let i = seq.stored;
            seq.stored += 1;
            let parent = match seq.chain {
                Chain::Broken => continue,
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
    pub(crate) fn release(&mut self, seq: &mut SeqBlocks, tier: Tier, sh: &mut Shared) {
        while let Some(entry) = seq.table.pop() {
            if let Some(b) = entry {
                self.unref(tier, b.0, sh);
            }
        }
        seq.first_live = 0;
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
    pub(crate) fn audit(&self) -> Result<(), String> {
        let g = self.id.0;
        for tier in Tier::ALL {
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
                } else if n != NO_NODE {
                    idle += 1;
                } else if !on_free[b] {
                    return Err(format!(
                        "group {g} {tier:?}: block {b} leaked (unreferenced, uncached, not free)"
                    ));
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
                let want = if pool.refcount[b] == 0 && n != NO_NODE {
                    let node = self.tree.node(n);
                    let leaf = match tier {
                        Tier::Primary => node.children_in[0] == 0,
                        Tier::Secondary => node.children.is_empty(),
                    };
                    leaf.then_some((node.priority.get(), node.last_used))
                } else {
                    None
                };
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
