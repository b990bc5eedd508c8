//! The group's invariants, checked on demand (tests and `KvCacheManager::audit`).

use super::Group;
use crate::lazy::{Owners, RunState};
use crate::pool::{NO_NODE, RUN_TAG};
use crate::tree::Parent;
use crate::{BlockId, BlockLoc, Tier};

impl Group {
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
