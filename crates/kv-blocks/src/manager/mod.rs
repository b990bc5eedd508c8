//! The public manager: requests, their block tables, and the calls an engine makes.

use std::sync::Arc;

use rustc_hash::FxHashMap;

use crate::clock::{Clock, SystemClock};
use crate::events::EventQueue;
use crate::group::{Group, Opts, SeqBlocks, SeqInfo, Shared};
use crate::lazy::Owners;
use crate::tree::RootKey;
mod query;

use crate::{
    BlockHash, BlockId, BlockLoc, EventBatch, GroupId, KvCacheConfig, KvError, KvEvent, Priority,
    RequestId, RequestSpec, RetentionPolicy, Tier,
};

/// The KV block manager: block pools per window group and tier, per-request block tables, prefix
/// reuse through a radix tree, prioritized LRU eviction with host offload, and an event stream.
///
/// It manages block *ids* only. Block contents live with the caller (the offload layer), which
/// executes the [`Transfer`]s this manager returns, in order, before the next forward pass.
///
/// The protocol of a request: [`add_request`](Self::add_request) (its reused prefix is reported,
/// the rest must be prefilled), [`commit_computed`](Self::commit_computed) as prefill chunks
/// write KV, [`append_tokens`](Self::append_tokens) for each sampled token,
/// [`release`](Self::release) at the end.
pub struct KvCacheManager {
    config: KvCacheConfig,
    clock: Arc<dyn Clock>,
    groups: Vec<Group>,
    requests: FxHashMap<RequestId, Request>,
    shared: Shared,
}

/// A copy the caller must execute, in the order given, before the blocks are next read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transfer {
    /// The window group whose pools are involved.
    pub group: GroupId,
    /// Where the data is.
    pub src: BlockLoc,
    /// Where it must go.
    pub dst: BlockLoc,
    /// Copy only the first this many tokens of the block; `None` for the whole block.
    pub num_tokens: Option<u32>,
    /// Why the copy is needed.
    pub kind: TransferKind,
}

/// Why a [`Transfer`] is needed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TransferKind {
    /// A cached block leaves the primary tier for the secondary tier.
    Offload,
    /// A cached secondary block is reused by a primary request and moves back.
    Onboard,
    /// A partial reuse or a copy-on-write: the first `num_tokens` tokens are duplicated.
    Copy,
}

/// What [`KvCacheManager::add_request`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AddOutcome {
    /// Leading prompt tokens whose KV is already in the request's blocks (after the returned
    /// transfers run); prefill starts at this position.
    pub reused_tokens: u32,
}

/// Reuse statistics of one request, counted in blocks of its prompt.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RequestStats {
    /// Prompt blocks reused, fully or partly.
    pub reused_blocks: u32,
    /// Prompt blocks that had to be computed from scratch.
    pub missed_blocks: u32,
    /// Prompt tokens reused.
    pub reused_tokens: u32,
}

/// Counters over the manager's lifetime, summed over window groups.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Blocks handed to requests.
    pub allocated: u64,
    /// Prompt blocks reused (fully or partly), as in [`RequestStats`].
    pub reused_blocks: u64,
    /// Prompt blocks missed, as in [`RequestStats`].
    pub missed_blocks: u64,
    /// Blocks stored in the tree.
    pub stored: u64,
    /// Blocks dropped from the tree.
    pub evicted: u64,
    /// Blocks offloaded to the secondary tier.
    pub offloaded: u64,
    /// Blocks onboarded back to the primary tier.
    pub onboarded: u64,
    /// Partial copies (partial reuse and copy-on-write).
    pub partial_copies: u64,
}

/// A cached block as the tree knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CachedBlock {
    /// The block's chained hash.
    pub hash: BlockHash,
    /// The tokens it holds.
    pub tokens: Vec<u32>,
    /// Its position in the prefix: 0 for a prompt's first block.
    pub index: u32,
    /// The cache salt of its prefix.
    pub salt: Option<String>,
    /// The extra ids of its prefix.
    pub extra_ids: Vec<u64>,
    /// Its current priority.
    pub priority: Priority,
}

/// Block counts of one pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolUsage {
    /// Blocks in the pool.
    pub capacity: u32,
    /// Blocks on the free list.
    pub free: u32,
    /// Blocks referenced by at least one request.
    pub used: u32,
    /// Unreferenced blocks kept for reuse (`capacity - free - used`).
    pub cached: u32,
    /// Cached blocks that can be evicted right now (leaves).
    pub evictable: u32,
}

struct Request {
    id: RequestId,
    tier: Tier,
    tokens: Vec<u32>,
    prompt_len: u32,
    computed: u32,
    root_key: RootKey,
    retention: RetentionPolicy,
    seqs: Vec<SeqBlocks>,
    stats: RequestStats,
}

impl Request {
    fn info(&self) -> SeqInfo<'_> {
        SeqInfo {
            id: self.id,
            tier: self.tier,
            tokens: &self.tokens,
            prompt_len: self.prompt_len,
            root_key: &self.root_key,
            retention: &self.retention,
        }
    }
}

fn len_u32(request: RequestId, len: usize) -> Result<u32, KvError> {
    u32::try_from(len).map_err(|_| KvError::InvalidLength {
        request,
        what: format!("{len} tokens exceed the limit of {}", u32::MAX),
    })
}

impl KvCacheManager {
    /// A manager with wall-clock time.
    pub fn new(config: KvCacheConfig) -> Result<Self, KvError> {
        Self::with_clock(config, Arc::new(SystemClock::new()))
    }

    /// A manager reading time from `clock` (for retention durations).
    pub fn with_clock(config: KvCacheConfig, clock: Arc<dyn Clock>) -> Result<Self, KvError> {
        config.validate()?;
        let bs = config.tokens_per_block;
        let mut events = EventQueue::new(config.event_capacity);
        let groups = config
            .groups
            .iter()
            .enumerate()
            .map(|(i, g)| {
                let id = GroupId(i as u32);
                events.push(KvEvent::Created {
                    group: id,
                    primary_blocks: g.primary_blocks,
                    secondary_blocks: g.secondary_blocks,
                });
                Group::new(
                    id,
                    g.window,
                    bs,
                    g.primary_blocks,
                    g.secondary_blocks,
                    events.enabled(),
                )
                .ok_or_else(|| {
                    KvError::InvalidConfig(format!(
                        "group {i}: the bookkeeping of {} + {} blocks cannot be allocated",
                        g.primary_blocks, g.secondary_blocks
                    ))
                })
            })
            .collect::<Result<_, _>>()?;
        let shared = Shared {
            opts: Opts {
                bs,
                enable_reuse: config.enable_reuse,
                enable_partial_reuse: config.enable_reuse && config.enable_partial_reuse,
                copy_on_partial_reuse: config.copy_on_partial_reuse,
                offload_min: config.secondary_offload_min_priority,
            },
            events,
            transfers: Vec::new(),
            stats: CacheStats::default(),
            tick: 0,
            now: clock.now(),
        };
        Ok(KvCacheManager {
            config,
            clock,
            groups,
            requests: FxHashMap::default(),
            shared,
        })
    }

    /// The configuration the manager was built with.
    pub fn config(&self) -> &KvCacheConfig {
        &self.config
    }

    /// Reads the clock and reverts priorities whose retention ran out.
    fn tick_clock(&mut self) {
        self.shared.now = self.clock.now();
        for g in &mut self.groups {
            g.expire(&mut self.shared);
        }
    }

    fn group(&self, group: GroupId) -> Result<&Group, KvError> {
        self.groups
            .get(group.index())
            .ok_or(KvError::UnknownGroup(group))
    }

    fn request(&self, id: RequestId) -> Result<&Request, KvError> {
        self.requests.get(&id).ok_or(KvError::UnknownRequest(id))
    }

    /// Adds a request: finds the longest cached prefix of its prompt (never the last prompt token,
    /// whose logits must be computed), takes those blocks, and allocates the rest. With several
    /// window groups the reused length is the shortest any group can reuse.
    ///
    /// On error nothing of the request remains (blocks evicted to make room stay evicted).
    pub fn add_request(&mut self, spec: RequestSpec) -> Result<AddOutcome, KvError> {
        self.tick_clock();
        let id = spec.id;
        if self.requests.contains_key(&id) {
            return Err(KvError::DuplicateRequest(id));
        }
        if spec.tokens.is_empty() {
            return Err(KvError::EmptyRequest(id));
        }
        let len = len_u32(id, spec.tokens.len())?;
        let mut req = Request {
            id,
            tier: spec.tier,
            tokens: spec.tokens,
            prompt_len: len,
            computed: 0,
            root_key: RootKey {
                salt: spec.salt,
                extra: spec.extra_ids,
            },
            retention: spec.retention,
            seqs: Vec::with_capacity(self.groups.len()),
            stats: RequestStats::default(),
        };
        let sh = &mut self.shared;
        let info = req.info();
        let reuse = Self::reusable(&self.groups, &info, &sh.opts, &self.requests);
        let mut seqs = Vec::with_capacity(self.groups.len());
        let mut failure = None;
        for g in &mut self.groups {
            let mut seq = SeqBlocks::new();
            let r = g.attach(&mut seq, &info, reuse, &self.requests, sh);
            seqs.push(seq);
            if let Err(e) = r {
                failure = Some(e);
                break;
            }
        }
        if let Some(e) = failure {
            // Nothing was stored yet, so no run asks for the tokens.
            let mut tokens = || Arc::new(Vec::new());
            for (g, seq) in self.groups.iter_mut().zip(&mut seqs) {
                g.release(seq, info.tier, &mut tokens, sh);
            }
            return Err(e);
        }
        for (g, seq) in self.groups.iter_mut().zip(&mut seqs) {
            g.release_window(seq, info.tier, reuse, sh);
        }
        let bs = sh.opts.bs;
        let prompt_blocks = len.div_ceil(bs);
        let reused_blocks = reuse.div_ceil(bs);
        let stats = RequestStats {
            reused_blocks,
            missed_blocks: prompt_blocks - reused_blocks,
            reused_tokens: reuse,
        };
        sh.stats.reused_blocks += u64::from(stats.reused_blocks);
        sh.stats.missed_blocks += u64::from(stats.missed_blocks);
        req.computed = reuse;
        req.stats = stats;
        req.seqs = seqs;
        self.requests.insert(id, req);
        Ok(AddOutcome {
            reused_tokens: reuse,
        })
    }

    /// How many leading tokens of `spec`'s prompt [`add_request`](Self::add_request) would reuse
    /// right now, without changing anything: for cache-aware scheduling and routing.
    pub fn reusable_tokens(&self, spec: &RequestSpec) -> u32 {
        let Ok(len) = u32::try_from(spec.tokens.len()) else {
            return 0;
        };
        let root_key = RootKey {
            salt: spec.salt.clone(),
            extra: spec.extra_ids.clone(),
        };
        let info = SeqInfo {
            id: spec.id,
            tier: spec.tier,
            tokens: &spec.tokens,
            prompt_len: len,
            root_key: &root_key,
            retention: &spec.retention,
        };
        Self::reusable(&self.groups, &info, &self.shared.opts, &self.requests)
    }

    /// The reuse length every group can honour: the shortest match, cut to whole blocks when a
    /// group cannot reuse the trailing partial block exactly.
    fn reusable(groups: &[Group], info: &SeqInfo<'_>, opts: &Opts, owners: &dyn Owners) -> u32 {
        let len = info.tokens.len() as u32;
        let limit = if opts.enable_reuse {
            len.saturating_sub(1)
        } else {
            0
        };
        if limit == 0 {
            return 0;
        }
        let mut reuse = groups
            .iter()
            .map(|g| g.match_len(info, limit, opts, owners))
            .min()
            .unwrap_or(0);
        if !reuse.is_multiple_of(opts.bs)
            && !groups
                .iter()
                .all(|g| g.can_reuse_exactly(info, reuse, opts, owners))
        {
            reuse -= reuse % opts.bs;
        }
        reuse
    }

    /// Declares that the KV of the request's first `computed` tokens is written (after a prefill
    /// chunk). Full blocks among them become reusable, except that the last token is never
    /// stored; blocks that left an attention window are released.
    pub fn commit_computed(&mut self, id: RequestId, computed: u32) -> Result<(), KvError> {
        self.tick_clock();
        let req = self
            .requests
            .get_mut(&id)
            .ok_or(KvError::UnknownRequest(id))?;
        let len = req.tokens.len() as u32;
        if computed > len {
            return Err(KvError::InvalidLength {
                request: id,
                what: format!("{computed} computed tokens but only {len} tokens"),
            });
        }
        req.computed = req.computed.max(computed);
        self.settle_live(id);
        Ok(())
    }

    /// Stores newly computed full blocks and releases blocks outside attention windows.
    fn settle(groups: &mut [Group], req: &mut Request, owners: &dyn Owners, sh: &mut Shared) {
        let storable = req.computed.min(req.tokens.len() as u32 - 1);
        let mut seqs = std::mem::take(&mut req.seqs);
        let info = req.info();
        for (g, seq) in groups.iter_mut().zip(&mut seqs) {
            g.store(seq, &info, storable, owners, sh);
            g.release_window(seq, info.tier, req.computed, sh);
        }
        req.seqs = seqs;
    }

    /// [`settle`](Self::settle) for live request `id`, taken out of the map meanwhile so that the
    /// other live requests can be read as owners of lazy runs.
    fn settle_live(&mut self, id: RequestId) {
        let mut req = self
            .requests
            .remove(&id)
            .expect("invariant: only live requests are settled");
        Self::settle(&mut self.groups, &mut req, &self.requests, &mut self.shared);
        self.requests.insert(id, req);
    }

    /// Appends one sampled token (see [`append_tokens`](Self::append_tokens)).
    pub fn append_token(&mut self, id: RequestId, token: u32) -> Result<(), KvError> {
        self.append_tokens(id, &[token])
    }

    /// Appends tokens (a sampled token, or draft tokens): the KV of every token before them is now
    /// computed, blocks that filled become reusable, and new blocks are allocated as needed. On
    /// error (out of blocks) the request is left as it was.
    pub fn append_tokens(&mut self, id: RequestId, tokens: &[u32]) -> Result<(), KvError> {
        self.tick_clock();
        let req = self
            .requests
            .get_mut(&id)
            .ok_or(KvError::UnknownRequest(id))?;
        let old_len = req.tokens.len();
        let new_len = len_u32(id, old_len + tokens.len())?;
        let sh = &mut self.shared;
        let mut failure = None;
        for (g, seq) in self.groups.iter_mut().zip(&mut req.seqs) {
            if let Err(e) = g.grow(seq, req.tier, new_len, sh) {
                failure = Some(e);
                break;
            }
        }
        if let Some(e) = failure {
            for (g, seq) in self.groups.iter_mut().zip(&mut req.seqs) {
                // Only blocks this call allocated are dropped; the old last block is untouched,
                // so no copy is needed.
                g.finish_truncate(seq, req.tier, old_len as u32, None, sh);
            }
            return Err(e);
        }
        req.tokens.extend_from_slice(tokens);
        req.computed = req.computed.max(old_len as u32);
        self.settle_live(id);
        Ok(())
    }

    /// Shrinks the request to its first `len` tokens (rejected draft tokens, say), freeing the
    /// blocks past them. A cached or shared block left partial is replaced by a private copy
    /// first, so other requests never see the overwritten tail. `len` must be at least 1 and
    /// must not reach into blocks released by an attention window.
    pub fn truncate(&mut self, id: RequestId, len: u32) -> Result<(), KvError> {
        self.tick_clock();
        let req = self
            .requests
            .get_mut(&id)
            .ok_or(KvError::UnknownRequest(id))?;
        let cur = req.tokens.len() as u32;
        let bs = self.shared.opts.bs;
        let window_cut = req.seqs.iter().map(|s| s.first_live).max().unwrap_or(0) as u64;
        if len == 0 || len > cur || u64::from(len) <= window_cut * u64::from(bs) {
            return Err(KvError::InvalidLength {
                request: id,
                what: format!(
                    "cannot truncate {cur} tokens to {len} (minimum 1, and past any window-released blocks)"
                ),
            });
        }
        let sh = &mut self.shared;
        for (g, seq) in self.groups.iter_mut().zip(&mut req.seqs) {
            g.cut_run(seq, &req.tokens, len, sh);
        }
        let mut prepared = Vec::with_capacity(self.groups.len());
        for (g, seq) in self.groups.iter_mut().zip(&req.seqs) {
            match g.prepare_truncate(seq, req.tier, len, sh) {
                Ok(p) => prepared.push(p),
                Err(e) => {
                    for (g, p) in self.groups.iter_mut().zip(prepared) {
                        g.cancel_truncate(req.tier, p, sh);
                    }
                    return Err(e);
                }
            }
        }
        for ((g, seq), p) in self.groups.iter_mut().zip(&mut req.seqs).zip(prepared) {
            g.finish_truncate(seq, req.tier, len, p, sh);
        }
        req.tokens.truncate(len as usize);
        req.computed = req.computed.min(len);
        req.prompt_len = req.prompt_len.min(len);
        Ok(())
    }

    /// Ends a request: its computed full blocks become reusable and every block reference is
    /// dropped. Returns the request's reuse statistics.
    pub fn release(&mut self, id: RequestId) -> Result<RequestStats, KvError> {
        self.tick_clock();
        let mut req = self
            .requests
            .remove(&id)
            .ok_or(KvError::UnknownRequest(id))?;
        Self::settle(&mut self.groups, &mut req, &self.requests, &mut self.shared);
        // Lazy runs keep the tokens as their blocks' keys; one handle serves every group.
        let mut shared = None;
        let owned = &mut req.tokens;
        let mut tokens =
            || Arc::clone(shared.get_or_insert_with(|| Arc::new(std::mem::take(&mut *owned))));
        for (g, seq) in self.groups.iter_mut().zip(&mut req.seqs) {
            g.release(seq, req.tier, &mut tokens, &mut self.shared);
        }
        Ok(req.stats)
    }

    /// Evicts up to `count` cached, unreferenced leaf blocks from a tier, as allocation pressure
    /// would (primary blocks of high enough priority are offloaded). Returns how many were freed.
    pub fn evict(&mut self, group: GroupId, tier: Tier, count: u32) -> Result<u32, KvError> {
        self.tick_clock();
        let g = self
            .groups
            .get_mut(group.index())
            .ok_or(KvError::UnknownGroup(group))?;
        let mut done = 0;
        while done < count && g.evict_one(tier, &mut self.shared) {
            done += 1;
        }
        Ok(done)
    }

    /// The transfers produced since the last call, to execute in order.
    pub fn take_transfers(&mut self) -> Vec<Transfer> {
        std::mem::take(&mut self.shared.transfers)
    }

    /// The events buffered since the last call.
    pub fn drain_events(&mut self) -> EventBatch {
        self.shared.events.drain()
    }
}

impl Owners for FxHashMap<RequestId, Request> {
    fn tokens(&self, id: RequestId) -> &[u32] {
        &self
            .get(&id)
            .expect("invariant: a live run's owner is a live request")
            .tokens
    }

    fn table(&self, id: RequestId, group: GroupId) -> &[Option<BlockId>] {
        &self
            .get(&id)
            .expect("invariant: a live run's owner is a live request")
            .seqs[group.index()]
        .table
    }
}
