//! Configuration of the manager and of requests, with validation.

use std::time::Duration;

use crate::{KvError, Priority, RequestId, Tier};

/// The manager's configuration. Build one with [`KvCacheConfig::new`] and adjust the public fields;
/// [`KvCacheManager::new`](crate::KvCacheManager::new) validates it.
#[derive(Clone, Debug, PartialEq)]
pub struct KvCacheConfig {
    /// Tokens per block; a power of two greater than 1.
    pub tokens_per_block: u32,
    /// One entry per (attention window, KV heads) group; each has its own pools.
    pub groups: Vec<GroupConfig>,
    /// Whether full blocks are stored in the radix tree for reuse across requests.
    pub enable_reuse: bool,
    /// Whether a block whose tokens only partly match may be reused.
    pub enable_partial_reuse: bool,
    /// Whether a partly matched block is copied into a new block (so other requests can keep
    /// using it) rather than taken over; taking over needs an unused leaf block.
    pub copy_on_partial_reuse: bool,
    /// Blocks evicted from the primary tier go to the secondary tier only at this priority or
    /// above; lower ones are dropped.
    pub secondary_offload_min_priority: Priority,
    /// Capacity of the event buffer; 0 turns events off.
    pub event_capacity: usize,
}

impl KvCacheConfig {
    /// A configuration with one full-attention group of the given pool sizes and the defaults of
    /// TensorRT-LLM: reuse and partial reuse on, copy on partial reuse, offload from priority 35,
    /// events off.
    pub fn new(tokens_per_block: u32, primary_blocks: u32, secondary_blocks: u32) -> Self {
        KvCacheConfig {
            tokens_per_block,
            groups: vec![GroupConfig {
                window: None,
                kv_heads: 1,
                primary_blocks,
                secondary_blocks,
            }],
            enable_reuse: true,
            enable_partial_reuse: true,
            copy_on_partial_reuse: true,
            secondary_offload_min_priority: Priority::DEFAULT,
            event_capacity: 0,
        }
    }

    /// Checks every field; the error names the first problem found.
    pub fn validate(&self) -> Result<(), KvError> {
        let bad = |msg: String| Err(KvError::InvalidConfig(msg));
        let bs = self.tokens_per_block;
        if bs < 2 || !bs.is_power_of_two() {
            return bad(format!(
                "tokens_per_block must be a power of two greater than 1, got {bs}"
            ));
        }
        if self.groups.is_empty() {
            return bad("at least one window group is needed".to_owned());
        }
        for (i, g) in self.groups.iter().enumerate() {
            if g.window == Some(0) {
                return bad(format!("group {i}: an attention window of 0 tokens"));
            }
            if g.kv_heads == 0 {
                return bad(format!("group {i}: kv_heads must be at least 1"));
            }
            if g.primary_blocks == 0 && g.secondary_blocks == 0 {
                return bad(format!("group {i}: both pools are empty"));
            }
            for (tier, n) in [
                (Tier::Primary, g.primary_blocks),
                (Tier::Secondary, g.secondary_blocks),
            ] {
                if n > MAX_BLOCKS_PER_POOL {
                    return bad(format!(
                        "group {i}: {n} {tier:?} blocks exceed the limit of {MAX_BLOCKS_PER_POOL} (ids are i32 in block tables)"
                    ));
                }
            }
            if self.groups[..i]
                .iter()
                .any(|h| h.window == g.window && h.kv_heads == g.kv_heads)
            {
                return bad(format!(
                    "group {i}: another group has the same window and kv_heads; merge them"
                ));
            }
        }
        Ok(())
    }
}

/// The largest pool: block ids are stored as `i32` in block tables.
pub const MAX_BLOCKS_PER_POOL: u32 = i32::MAX as u32;

/// One window group: the layers sharing an attention window size and a KV head count.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupConfig {
    /// The attention window in tokens; `None` for full attention. A token at position `p` attends
    /// keys at positions `> p - window`; blocks wholly outside every future token's window are
    /// released from the request.
    pub window: Option<u32>,
    /// KV heads of the group's layers (the pools' block size in bytes follows from it).
    pub kv_heads: u32,
    /// Blocks in the primary (device) pool.
    pub primary_blocks: u32,
    /// Blocks in the secondary (host) pool; 0 turns the host tier off.
    pub secondary_blocks: u32,
}

/// Priority for a range of prompt tokens, optionally for a limited time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenRangeRetention {
    /// First token of the range.
    pub start: u32,
    /// One past the last token; `None` for the end of the prompt.
    pub end: Option<u32>,
    /// Priority of blocks overlapping the range.
    pub priority: Priority,
    /// How long after a block becomes reusable the priority holds before it reverts to
    /// [`Priority::DEFAULT`]; `None` for ever.
    pub duration: Option<Duration>,
}

/// How long a request's blocks are kept once reusable, by token range, plus a rule for blocks of
/// generated tokens. A block takes the highest priority among the ranges it overlaps.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RetentionPolicy {
    /// Rules for prompt tokens.
    pub ranges: Vec<TokenRangeRetention>,
    /// Priority of blocks holding generated tokens.
    pub decode_priority: Priority,
    /// How long `decode_priority` holds; `None` for ever.
    pub decode_duration: Option<Duration>,
}

impl RetentionPolicy {
    /// Priority and duration of block `index` of a request whose prompt has `prompt_len` tokens.
    pub(crate) fn for_block(
        &self,
        index: u32,
        tokens_per_block: u32,
        prompt_len: u32,
    ) -> (Priority, Option<Duration>) {
        let start = u64::from(index) * u64::from(tokens_per_block);
        let end = start + u64::from(tokens_per_block);
        if end > u64::from(prompt_len) {
            return (self.decode_priority, self.decode_duration);
        }
        let mut best: Option<(Priority, Option<Duration>)> = None;
        for r in &self.ranges {
            let r_end = u64::from(r.end.unwrap_or(prompt_len));
            let overlaps = u64::from(r.start) < end && start < r_end;
            if overlaps && best.is_none_or(|(p, _)| r.priority > p) {
                best = Some((r.priority, r.duration));
            }
        }
        best.unwrap_or((Priority::DEFAULT, None))
    }

    /// The priority every block gets when it is the same for all of them and never reverts:
    /// no token ranges, a decode priority equal to the default, and no duration.
    pub(crate) fn uniform(&self) -> Option<Priority> {
        (self.ranges.is_empty()
            && self.decode_priority == Priority::DEFAULT
            && self.decode_duration.is_none())
        .then_some(Priority::DEFAULT)
    }
}

/// A request to add: its prompt and how its blocks are cached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestSpec {
    /// The request's id; must not be live.
    pub id: RequestId,
    /// The prompt's token ids; at least one.
    pub tokens: Vec<u32>,
    /// Only requests with equal salts share blocks.
    pub salt: Option<String>,
    /// Ids that are part of every block's key besides the tokens, such as a LoRA task id.
    pub extra_ids: Vec<u64>,
    /// Priorities for the request's blocks once reusable.
    pub retention: RetentionPolicy,
    /// The tier the request's blocks are allocated in: primary for dense requests, secondary for
    /// sparse-mode requests whose full KV lives in host memory.
    pub tier: Tier,
}

impl RequestSpec {
    /// A request in the primary tier with no salt, no extra ids and default retention.
    pub fn new(id: RequestId, tokens: Vec<u32>) -> Self {
        RequestSpec {
            id,
            tokens,
            salt: None,
            extra_ids: Vec::new(),
            retention: RetentionPolicy::default(),
            tier: Tier::Primary,
        }
    }

    /// Sets the cache salt.
    pub fn with_salt(mut self, salt: impl Into<String>) -> Self {
        self.salt = Some(salt.into());
        self
    }

    /// Sets the extra ids.
    pub fn with_extra_ids(mut self, ids: Vec<u64>) -> Self {
        self.extra_ids = ids;
        self
    }

    /// Sets the retention policy.
    pub fn with_retention(mut self, retention: RetentionPolicy) -> Self {
        self.retention = retention;
        self
    }

    /// Sets the tier.
    pub fn in_tier(mut self, tier: Tier) -> Self {
        self.tier = tier;
        self
    }
}
