//! A request's blocks in one group: attached (with reuse from the tree), grown, stored into
//! the tree, released, and truncated.

use std::cmp::Reverse;

use super::{Chain, Group, SeqBlocks, SeqInfo, Shared, blocks_for};
use crate::lazy::{Own, Owners, RunEnd, RunState, SharedTokens};
use crate::pool::NO_NODE;
use crate::tree::{Insert, NO_RUN, Parent};
use crate::walk::At;
use crate::{BlockHash, BlockId, BlockLoc, KvError, KvEvent, Tier, Transfer, TransferKind};

impl Group {
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
}
