//! What the manager answers without changing anything: counters, pool usage, block tables,
//! a request's tokens and tier, a block's reference count and cached contents, and the audit
//! of every invariant.

use super::{CacheStats, CachedBlock, KvCacheManager, PoolUsage, RequestStats};
use crate::{BlockHash, BlockId, BlockLoc, GroupId, KvError, RequestId, Tier};

impl KvCacheManager {
    /// Lifetime counters.
    pub fn stats(&self) -> CacheStats {
        self.shared.stats
    }

    /// The number of window groups.
    pub fn num_groups(&self) -> u32 {
        self.groups.len() as u32
    }

    /// The number of live requests.
    pub fn num_requests(&self) -> usize {
        self.requests.len()
    }

    /// Whether a request is live.
    pub fn contains(&self, id: RequestId) -> bool {
        self.requests.contains_key(&id)
    }

    /// Block counts of a pool.
    pub fn usage(&self, group: GroupId, tier: Tier) -> Result<PoolUsage, KvError> {
        let pool = self.group(group)?.pool(tier);
        Ok(PoolUsage {
            capacity: pool.capacity(),
            free: pool.num_free(),
            used: pool.num_used(),
            cached: pool.capacity() - pool.num_free() - pool.num_used(),
            evictable: pool.num_evictable(),
        })
    }

    /// The request's block table in a group: one entry per logical block, `None` for blocks
    /// released by the group's attention window. Blocks are in the request's tier.
    pub fn block_table(
        &self,
        id: RequestId,
        group: GroupId,
    ) -> Result<&[Option<BlockId>], KvError> {
        self.group(group)?;
        Ok(&self.request(id)?.seqs[group.index()].table)
    }

    /// Writes the block tables of `ids` in one group as the flat `block_table[num_seqs *
    /// max_blocks]` array of the data contract: block ids as `i32`, -1 for padding and for
    /// blocks released by a window. Fails without writing if `out` is too short or a request has
    /// more than `max_blocks` blocks.
    pub fn fill_block_table(
        &self,
        group: GroupId,
        ids: &[RequestId],
        max_blocks: usize,
        out: &mut [i32],
    ) -> Result<(), KvError> {
        self.group(group)?;
        let need = ids.len().checked_mul(max_blocks).ok_or_else(|| {
            KvError::TableTooSmall(format!("{} rows of {max_blocks} overflow", ids.len()))
        })?;
        if out.len() < need {
            return Err(KvError::TableTooSmall(format!(
                "{need} entries needed, {} given",
                out.len()
            )));
        }
        let mut tables = Vec::with_capacity(ids.len());
        for &id in ids {
            let table = &self.request(id)?.seqs[group.index()].table;
            if table.len() > max_blocks {
                return Err(KvError::TableTooSmall(format!(
                    "{id} has {} blocks, more than max_blocks {max_blocks}",
                    table.len()
                )));
            }
            tables.push(table);
        }
        for (row, table) in out[..need].chunks_mut(max_blocks.max(1)).zip(tables) {
            row.fill(-1);
            for (slot, b) in row.iter_mut().zip(table) {
                *slot = b.map_or(-1, BlockId::as_i32);
            }
        }
        Ok(())
    }

    /// The request's tokens (prompt and appended).
    pub fn tokens(&self, id: RequestId) -> Result<&[u32], KvError> {
        Ok(&self.request(id)?.tokens)
    }

    /// Tokens whose KV the request declared computed.
    pub fn num_computed(&self, id: RequestId) -> Result<u32, KvError> {
        Ok(self.request(id)?.computed)
    }

    /// The tier the request's blocks live in.
    pub fn request_tier(&self, id: RequestId) -> Result<Tier, KvError> {
        Ok(self.request(id)?.tier)
    }

    /// The request's reuse statistics.
    pub fn request_stats(&self, id: RequestId) -> Result<RequestStats, KvError> {
        Ok(self.request(id)?.stats)
    }

    /// References held on a block.
    pub fn refcount(&self, group: GroupId, loc: BlockLoc) -> Result<u32, KvError> {
        let pool = self.group(group)?.pool(loc.tier);
        pool.refcount
            .get(loc.block.index())
            .copied()
            .ok_or(KvError::UnknownBlock {
                group,
                tier: loc.tier,
                block: loc.block.0,
            })
    }

    /// The cached content of a block, or `None` if the block is not in the tree. A block kept
    /// in a lazy run (see ARCHITECTURE.md) is found by a scan of the group's runs.
    pub fn cached_block(
        &self,
        group: GroupId,
        loc: BlockLoc,
    ) -> Result<Option<CachedBlock>, KvError> {
        let g = self.group(group)?;
        if loc.block.index() >= g.pool(loc.tier).capacity() as usize {
            return Err(KvError::UnknownBlock {
                group,
                tier: loc.tier,
                block: loc.block.0,
            });
        }
        Ok(g.cached(loc, &self.requests).map(|c| CachedBlock {
            hash: BlockHash(c.hash),
            tokens: c.tokens.to_vec(),
            index: c.index,
            salt: c.key.salt.clone(),
            extra_ids: c.key.extra.clone(),
            priority: c.priority,
        }))
    }

    /// Checks every internal invariant (pool accounting, tree links, evictable sets, and that each
    /// block's reference count equals the number of request tables holding it). Costs a full scan:
    /// for tests and debugging. The error names the first broken invariant.
    pub fn audit(&self) -> Result<(), String> {
        for (gi, g) in self.groups.iter().enumerate() {
            g.audit(&self.requests)?;
            for tier in Tier::ALL {
                let pool = g.pool(tier);
                let mut holders = vec![0u32; pool.capacity() as usize];
                for req in self.requests.values().filter(|r| r.tier == tier) {
                    for b in req.seqs[gi].table.iter().flatten() {
                        holders[b.index()] += 1;
                    }
                }
                for (b, &h) in holders.iter().enumerate() {
                    if pool.refcount[b] != h {
                        return Err(format!(
                            "group {gi} {tier:?}: block {b} has refcount {} but {h} tables hold it",
                            pool.refcount[b]
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}
