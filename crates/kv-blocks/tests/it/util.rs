//! Helpers shared by the scenario tests.

use std::sync::Arc;

use kv_blocks::{
    BlockId, BlockLoc, GroupId, KvCacheConfig, KvCacheManager, ManualClock, RequestId, RequestSpec,
    Tier,
};

pub(crate) const G0: GroupId = GroupId(0);

/// A manager with one full-attention group, events on, and a manual clock.
pub(crate) fn manager(bs: u32, primary: u32, secondary: u32) -> (KvCacheManager, ManualClock) {
    let mut cfg = KvCacheConfig::new(bs, primary, secondary);
    cfg.event_capacity = 1024;
    manager_with(cfg)
}

pub(crate) fn manager_with(cfg: KvCacheConfig) -> (KvCacheManager, ManualClock) {
    let clock = ManualClock::new();
    let kv = KvCacheManager::with_clock(cfg, Arc::new(clock.clone())).expect("valid test config");
    (kv, clock)
}

/// Tokens `start, start+1, …` (never zeros: `start` is offset by 1000).
pub(crate) fn toks(start: u32, len: u32) -> Vec<u32> {
    (start + 1000..start + 1000 + len).collect()
}

/// Adds a request, commits its whole prompt as computed, and returns the reused token count.
pub(crate) fn add_computed(kv: &mut KvCacheManager, id: u64, tokens: Vec<u32>) -> u32 {
    let len = tokens.len() as u32;
    let out = kv
        .add_request(RequestSpec::new(RequestId(id), tokens))
        .expect("add");
    kv.commit_computed(RequestId(id), len).expect("commit");
    out.reused_tokens
}

/// Adds, computes and releases a request in one go; returns the reused token count.
pub(crate) fn run_once(kv: &mut KvCacheManager, id: u64, tokens: Vec<u32>) -> u32 {
    let reused = add_computed(kv, id, tokens);
    kv.release(RequestId(id)).expect("release");
    reused
}

/// The request's blocks in group 0, all present.
pub(crate) fn table(kv: &KvCacheManager, id: u64) -> Vec<BlockId> {
    kv.block_table(RequestId(id), G0)
        .expect("live request")
        .iter()
        .map(|b| b.expect("no window in this test"))
        .collect()
}

pub(crate) fn primary(block: BlockId) -> BlockLoc {
    BlockLoc {
        tier: Tier::Primary,
        block,
    }
}

/// Asserts the manager's internal invariants.
pub(crate) fn audit(kv: &KvCacheManager) {
    if let Err(e) = kv.audit() {
        panic!("invariant broken: {e}");
    }
}
