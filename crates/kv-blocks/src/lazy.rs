//! Lazy runs: a request's chain of stored blocks kept without a tree node per block.
//!
//! Storing a 128K-token prompt as one node per block costs far more than allocating its blocks.
//! Where nothing can observe the difference (no events, no attention window, a retention that
//! gives every block the same priority for ever), a request's stored blocks after its first
//! node, the run's *head*, are kept as a run: the owner's table and tokens while it is live, its
//! table and a shared handle on its tokens once released. Nothing is hashed or copied per block.
//!
//! A run is the head's only descendant, a chain of blocks with the head's tier and one
//! priority. Its blocks leave from the tail end: a released run's tail is its one evictable
//! block, and block `i` of it was last used at tick `tick0 - i`, exactly as if every block had
//! been a node released tail first. Anything else that reaches a run (a request attached
//! through it or stopping at its head, an offload, the owner truncating into it, another
//! request storing under its head) first turns it into nodes ([`Group::materialize`]), so the
//! rest of the crate only ever meets ordinary nodes. Queries read runs in place (walk.rs), and
//! dropping a subtree that holds a run drops its blocks as the nodes would have been dropped.

use std::sync::Arc;

use crate::group::{Group, SeqBlocks, Shared};
use crate::pool::{NO_NODE, RUN_TAG};
use crate::tree::{Insert, NO_RUN, Parent, RootKey, Tree};
use crate::{BlockId, BlockLoc, GroupId, Priority, RequestId, Tier};

/// A released request's tokens, shared by the runs of every group. The request's own vector is
/// moved in: an `Arc<[u32]>` would copy it, which costs more than releasing the request.
#[allow(clippy::rc_buffer)]
pub(crate) type SharedTokens = Arc<Vec<u32>>;

/// Read access to live requests, for runs whose blocks and tokens still belong to their owner.
pub(crate) trait Owners {
    /// The tokens of live request `id`.
    fn tokens(&self, id: RequestId) -> &[u32];
    /// The block table of live request `id` in `group`.
    fn table(&self, id: RequestId, group: GroupId) -> &[Option<BlockId>];
}

/// For callers that can only meet released runs: any lookup is a broken invariant.
pub(crate) struct NoOwners;

impl Owners for NoOwners {
    fn tokens(&self, _: RequestId) -> &[u32] {
        unreachable!("invariant: only a released run is materialized without its owner")
    }

    fn table(&self, _: RequestId, _: GroupId) -> &[Option<BlockId>] {
        unreachable!("invariant: only a released run is materialized without its owner")
    }
}

/// One request's own tokens and table, for materializing its run while it is borrowed.
pub(crate) struct Own<'a> {
    pub(crate) tokens: &'a [u32],
    pub(crate) table: &'a [Option<BlockId>],
}

impl Owners for Own<'_> {
    fn tokens(&self, _: RequestId) -> &[u32] {
        self.tokens
    }

    fn table(&self, _: RequestId, _: GroupId) -> &[Option<BlockId>] {
        self.table
    }
}

/// One lazy run, or a free slot.
#[derive(Debug)]
pub(crate) struct Run {
    /// The node the run hangs under.
    pub(crate) head: u32,
    pub(crate) tier: Tier,
    pub(crate) priority: Priority,
    /// Index in the owner's table of the run's first block.
    pub(crate) first: u32,
    /// Blocks in the run; at least one while the run is live or released.
    pub(crate) len: u32,
    /// Bumped whenever the slot is freed, so stale chains can be recognised.
    pub(crate) generation: u32,
    pub(crate) state: RunState,
}

/// Where a run's blocks and tokens are, or what became of it.
#[derive(Debug)]
pub(crate) enum RunState {
    /// An unused slot.
    Free,
    /// The owner is live: the run is blocks `first..first + len` of its table and tokens.
    Live(RequestId),
    /// The owner was released: its table and tokens moved here; block `i` of the run was last
    /// used at tick `tick0 - i`.
    Released {
        tokens: SharedTokens,
        table: Vec<Option<BlockId>>,
        tick0: u64,
    },
    /// Turned into nodes while the owner was live; its chain continues at node `last`.
    Moved { last: u32, generation: u32 },
    /// Dropped with a subtree while the owner was live; its blocks became private.
    Dropped,
}

/// What the chain of a request that ended in a run finds there.
pub(crate) enum RunEnd {
    /// The run is still live and the request's own.
    Live,
    /// The run became nodes; the chain goes on at this node and generation.
    Moved(u32, u32),
    /// The run is gone.
    Gone,
}

impl Group {
    // ---- the run slab ----------------------------------------------------------------------

    pub(crate) fn run(&self, r: u32) -> &Run {
        &self.runs[r as usize]
    }

    fn new_run(&mut self, run: Run) -> u32 {
        match self.free_runs.pop() {
            Some(r) => {
                let generation = self.runs[r as usize].generation;
                self.runs[r as usize] = Run { generation, ..run };
                r
            }
            None => {
                self.runs.push(run);
                (self.runs.len() - 1) as u32
            }
        }
    }

    fn free_run(&mut self, r: u32) {
        let run = &mut self.runs[r as usize];
        run.state = RunState::Free;
        run.len = 0;
        run.generation = run.generation.wrapping_add(1);
        self.free_runs.push(r);
    }

    /// Ends run `r` once its blocks are gone, detaching it from its head (returned): a
    /// released run's slot is free again; a live one leaves word for its owner's chain.
    fn end_run(&mut self, r: u32) -> u32 {
        let head = self.run(r).head;
        self.tree.node_mut(head).tail = NO_RUN;
        if matches!(self.run(r).state, RunState::Live(_)) {
            self.runs[r as usize].state = RunState::Dropped;
        } else {
            self.free_run(r);
        }
        head
    }

    /// Resolves a request's chain that ended in run `r` of generation `generation`, freeing
    /// the slot when the run is no longer live (the chain was its last reference).
    pub(crate) fn run_end(&mut self, r: u32, generation: u32) -> RunEnd {
        let run = self.run(r);
        if run.generation != generation {
            return RunEnd::Gone;
        }
        let end = match run.state {
            RunState::Live(_) => return RunEnd::Live,
            RunState::Moved { last, generation } => RunEnd::Moved(last, generation),
            _ => RunEnd::Gone,
        };
        self.free_run(r);
        end
    }

    /// The tokens and table a run's blocks index into.
    pub(crate) fn run_data<'a>(
        &'a self,
        r: u32,
        owners: &'a dyn Owners,
    ) -> (&'a [u32], &'a [Option<BlockId>]) {
        match &self.run(r).state {
            RunState::Live(id) => (owners.tokens(*id), owners.table(*id, self.id)),
            RunState::Released { tokens, table, .. } => (tokens, table),
            _ => (&[], &[]),
        }
    }

    /// The tokens of block `i` of run `r`.
    pub(crate) fn run_tokens<'a>(&'a self, r: u32, i: u32, owners: &'a dyn Owners) -> &'a [u32] {
        let start = ((self.run(r).first + i) * self.bs) as usize;
        &self.run_data(r, owners).0[start..start + self.bs as usize]
    }

    /// Block `i` of a released run.
    pub(crate) fn released_block(&self, r: u32, i: u32) -> u32 {
        let run = self.run(r);
        match &run.state {
            RunState::Released { table, .. } => {
                table[(run.first + i) as usize]
                    .expect("invariant: runs exist only without windows, so no block left")
                    .0
            }
            _ => unreachable!("invariant: only a released run's blocks are read from the run"),
        }
    }

    /// The eviction key of a released run's tail.
    pub(crate) fn run_tail_key(&self, r: u32) -> (u8, u64) {
        let run = self.run(r);
        match run.state {
            RunState::Released { tick0, .. } => {
                (run.priority.get(), tick0 - u64::from(run.len - 1))
            }
            _ => unreachable!("invariant: only a released run has an evictable tail"),
        }
    }

    // ---- storing -----------------------------------------------------------------------------

    /// Starts a run of blocks `first..end` of the request under node `head` when nothing could
    /// tell it from nodes: this group keeps runs, the request's blocks all get priority
    /// `uniform`, and `head` is the request's previous block, held by it alone, with nothing
    /// under it. Returns the run and its generation.
    pub(crate) fn try_start_run(
        &mut self,
        seq: &SeqBlocks,
        head: u32,
        owner: RequestId,
        tier: Tier,
        uniform: Option<Priority>,
        (first, end): (u32, u32),
    ) -> Option<(u32, u32)> {
        let priority = uniform.filter(|_| self.lazy)?;
        let node = self.tree.node(head);
        let held = first > 0
            && seq.table[first as usize - 1] == Some(node.loc.block)
            && node.loc.tier == tier
            && self.pool(tier).refcount[node.loc.block.index()] == 1;
        if !held || !self.tree.childless(head) {
            return None;
        }
        let r = self.new_run(Run {
            head,
            tier,
            priority,
            first,
            len: end - first,
            generation: 0,
            state: RunState::Live(owner),
        });
        self.tree.node_mut(head).tail = r;
        Some((r, self.run(r).generation))
    }

    /// Grows live run `r` to end at table index `end`.
    pub(crate) fn extend_run(&mut self, r: u32, end: u32) {
        let run = &mut self.runs[r as usize];
        run.len = end - run.first;
    }

    // ---- release -----------------------------------------------------------------------------

    /// Releases the blocks of a request whose chain ends in live run `r`: blocks after the run
    /// and before it as usual (last first), the run's own without touching the tree. The run
    /// takes the table and a handle on the tokens, and its tail becomes evictable.
    pub(crate) fn release_run(
        &mut self,
        seq: &mut SeqBlocks,
        r: u32,
        tokens: &SharedTokens,
        sh: &mut Shared,
    ) {
        let (first, len, tier) = {
            let run = self.run(r);
            (run.first, run.len, run.tier)
        };
        let end = (first + len) as usize;
        while seq.table.len() > end {
            if let Some(Some(b)) = seq.table.pop() {
                self.unref(tier, b.0, sh);
            }
        }
        let pool = &mut self.pools[tier.index()];
        for b in seq.table[first as usize..].iter().flatten() {
            let left = pool.drop_ref(b.0);
            debug_assert_eq!(left, 0, "a live run's blocks are held by their owner alone");
        }
        let tick0 = sh.tick + u64::from(len);
        sh.tick = tick0;
        for i in (0..first as usize).rev() {
            if let Some(b) = seq.table[i] {
                self.unref(tier, b.0, sh);
            }
        }
        self.runs[r as usize].state = RunState::Released {
            tokens: Arc::clone(tokens),
            table: std::mem::take(&mut seq.table),
            tick0,
        };
        self.hook_tail(r);
    }

    /// Makes a released run's tail the evictable block it stands for.
    fn hook_tail(&mut self, r: u32) {
        let b = self.released_block(r, self.run(r).len - 1);
        let key = self.run_tail_key(r);
        let pool = &mut self.pools[self.run(r).tier.index()];
        pool.node[b as usize] = RUN_TAG | r;
        pool.set_evictable(b, Some(key));
    }

    /// Undoes [`hook_tail`](Self::hook_tail) before the tail changes.
    fn unhook_tail(&mut self, r: u32) {
        let b = self.released_block(r, self.run(r).len - 1);
        let pool = &mut self.pools[self.run(r).tier.index()];
        pool.node[b as usize] = NO_NODE;
        pool.set_evictable(b, None);
    }

    // ---- eviction ----------------------------------------------------------------------------

    /// The released run whose tail is evictable block `b` of `tier`, when evicting it drops it
    /// (no offload).
    pub(crate) fn droppable_run(&self, tier: Tier, b: u32, sh: &Shared) -> Option<u32> {
        let n = self.pool(tier).node[b as usize];
        if n == NO_NODE || n & RUN_TAG == 0 {
            return None;
        }
        let r = n & !RUN_TAG;
        let offload = tier == Tier::Primary
            && self.run(r).priority >= sh.opts.offload_min
            && self.pools[1].capacity() > 0;
        (!offload).then_some(r)
    }

    /// Evicts up to `k` blocks from the tail of released run `r`, handing each to `take` in
    /// eviction order; the head becomes a leaf again when the run empties. Returns how many.
    pub(crate) fn evict_from_run(
        &mut self,
        r: u32,
        k: u32,
        sh: &mut Shared,
        mut take: impl FnMut(&mut crate::pool::Pool, u32),
    ) -> u32 {
        self.unhook_tail(r);
        let run = &self.runs[r as usize];
        let (first, len) = (run.first, run.len);
        let k = k.min(len);
        let RunState::Released { table, .. } = &run.state else {
            unreachable!("invariant: only a released run has an evictable tail")
        };
        let pool = &mut self.pools[run.tier.index()];
        for b in table[(first + len - k) as usize..(first + len) as usize]
            .iter()
            .rev()
        {
            take(
                pool,
                b.expect("invariant: runs exist only without windows").0,
            );
        }
        sh.stats.evicted += u64::from(k);
        self.runs[r as usize].len -= k;
        if self.run(r).len > 0 {
            self.hook_tail(r);
        } else {
            let head = self.end_run(r);
            self.refresh_node(head);
        }
        k
    }

    /// Drops block `i` of run `r` with a subtree, the run's blocks after it having gone
    /// already: a released run's block becomes free, a live one stays its owner's, private.
    /// The run ends with its first block.
    pub(crate) fn drop_run_block(&mut self, r: u32, i: u32) {
        debug_assert_eq!(
            i + 1,
            self.run(r).len,
            "a run's blocks are dropped from the tail"
        );
        if matches!(self.run(r).state, RunState::Released { .. }) {
            let b = self.released_block(r, i);
            self.unhook_tail(r);
            self.pools[self.run(r).tier.index()].push_free(b);
        }
        self.runs[r as usize].len = i;
        if i == 0 {
            self.end_run(r);
        }
    }

    // ---- materializing -----------------------------------------------------------------------

    /// Turns run `r` into one node per block under its head. A released run's tail keeps its
    /// place in the evictable set as the last node; a live run leaves a forward to the last
    /// node for its owner's chain. Returns the last node.
    pub(crate) fn materialize(&mut self, r: u32, owners: &dyn Owners, sh: &Shared) -> u32 {
        let Group {
            id,
            bs,
            runs,
            tree,
            pools,
            ..
        } = self;
        let run = &runs[r as usize];
        let (tokens, table, tick0): (&[u32], &[Option<BlockId>], Option<u64>) = match &run.state {
            RunState::Live(owner) => (owners.tokens(*owner), owners.table(*owner, *id), None),
            RunState::Released {
                tokens,
                table,
                tick0,
            } => (tokens, table, Some(*tick0)),
            _ => unreachable!("invariant: only a live or released run is materialized"),
        };
        tree.node_mut(run.head).tail = NO_RUN;
        let bs = *bs as usize;
        let mut parent = run.head;
        for i in 0..run.len {
            let idx = (run.first + i) as usize;
            let b = table[idx].expect("invariant: runs exist only without windows");
            let loc = BlockLoc {
                tier: run.tier,
                block: b,
            };
            let last_used = tick0.map_or(sh.tick, |t| t - u64::from(i));
            let toks = &tokens[idx * bs..(idx + 1) * bs];
            match tree.insert(Parent::Node(parent), toks, loc, run.priority, last_used) {
                Insert::New(n) => {
                    pools[run.tier.index()].node[b.index()] = n;
                    parent = n;
                }
                Insert::Existing(_) | Insert::Collision => {
                    unreachable!("invariant: a run's blocks chain under childless nodes")
                }
            }
        }
        if tick0.is_some() {
            self.free_run(r);
        } else {
            let generation = self.tree.node(parent).generation;
            self.runs[r as usize].state = RunState::Moved {
                last: parent,
                generation,
            };
        }
        parent
    }

    // ---- audit -------------------------------------------------------------------------------

    /// Checks the runs' invariants; returns, per tier, which blocks released runs hold.
    pub(crate) fn audit_runs(&self, owners: &dyn Owners) -> Result<[Vec<bool>; 2], String> {
        let g = self.id.0;
        let mut held = [
            vec![false; self.pools[0].capacity() as usize],
            vec![false; self.pools[1].capacity() as usize],
        ];
        for n in self.tree.live_nodes() {
            let r = self.tree.node(n).tail;
            if r != NO_RUN
                && self
                    .runs
                    .get(r as usize)
                    .is_none_or(|run| run.head != n || run.len == 0)
            {
                return Err(format!(
                    "group {g}: node {n} has a tail {r} that is not its run"
                ));
            }
        }
        for r in 0..self.runs.len() as u32 {
            let run = self.run(r);
            let hangs = matches!(run.state, RunState::Live(_) | RunState::Released { .. });
            if !hangs {
                continue;
            }
            let head = self.tree.node(run.head);
            if !head.alive
                || head.tail != r
                || !head.children.is_empty()
                || head.loc.tier != run.tier
                || run.len == 0
            {
                return Err(format!(
                    "group {g}: run {r} does not hang alone under a live head"
                ));
            }
            let released = matches!(run.state, RunState::Released { .. });
            let (_, table) = self.run_data(r, owners);
            let pool = self.pool(run.tier);
            let range = run.first as usize..(run.first + run.len) as usize;
            for (i, b) in table.get(range).unwrap_or_default().iter().enumerate() {
                let Some(b) = b else {
                    return Err(format!("group {g}: run {r} has a hole at {i}"));
                };
                let tail = released && i as u32 + 1 == run.len;
                let rc = pool.refcount[b.index()];
                let node_ok = if tail {
                    pool.node[b.index()] == RUN_TAG | r
                } else {
                    pool.node[b.index()] == NO_NODE
                };
                if rc != u32::from(!released)
                    || !node_ok
                    || (!tail && pool.evict_key(b.0).is_some())
                {
                    return Err(format!(
                        "group {g}: block {} of run {r} is in the wrong state",
                        b.0
                    ));
                }
                if released {
                    held[run.tier.index()][b.index()] = true;
                }
            }
            if table.len() < (run.first + run.len) as usize {
                return Err(format!("group {g}: run {r} runs past its table"));
            }
        }
        Ok(held)
    }

    // ---- queries -----------------------------------------------------------------------------

    /// The run and index holding `block` of `tier`, if a run holds it (a scan of the runs).
    pub(crate) fn find_in_runs(
        &self,
        tier: Tier,
        block: BlockId,
        owners: &dyn Owners,
    ) -> Option<(u32, u32)> {
        (0..self.runs.len() as u32).find_map(|r| {
            let run = self.run(r);
            if run.tier != tier || run.len == 0 {
                return None;
            }
            let (_, table) = self.run_data(r, owners);
            let range = run.first as usize..(run.first + run.len) as usize;
            let i = table.get(range)?.iter().position(|&b| b == Some(block))?;
            Some((r, i as u32))
        })
    }

    /// What a cached block holds: the node's, or for a block of a run (found by a scan of the
    /// runs) what its node would hold.
    pub(crate) fn cached<'a>(
        &'a self,
        loc: BlockLoc,
        owners: &'a dyn Owners,
    ) -> Option<Cached<'a>> {
        let n = self.pool(loc.tier).node[loc.block.index()];
        if n != NO_NODE && n & RUN_TAG == 0 {
            let (key, index) = self.tree.root_key_of(n);
            return Some(Cached {
                hash: self.tree.hash(n),
                tokens: self.tree.tokens(n),
                index,
                key,
                priority: self.tree.node(n).priority,
            });
        }
        let (r, i) = self.find_in_runs(loc.tier, loc.block, owners)?;
        let run = self.run(r);
        let (key, head_index) = self.tree.root_key_of(run.head);
        let hash = (0..=i).fold(self.tree.hash(run.head), |h, j| {
            Tree::chain_hash(h, self.run_tokens(r, j, owners))
        });
        Some(Cached {
            hash,
            tokens: self.run_tokens(r, i, owners),
            index: head_index + 1 + i,
            key,
            priority: run.priority,
        })
    }
}

/// What [`Group::cached`] finds.
pub(crate) struct Cached<'a> {
    pub(crate) hash: u64,
    pub(crate) tokens: &'a [u32],
    pub(crate) index: u32,
    pub(crate) key: &'a RootKey,
    pub(crate) priority: Priority,
}
