//! Prioritized LRU eviction: priorities, LRU among equals, timed reversion, leaves only.

use std::time::Duration;

use kv_blocks::{
    BlockId, KvCacheManager, KvEvent, Priority, RequestId, RequestSpec, RetentionPolicy, Tier,
    TokenRangeRetention,
};

use crate::util::{G0, audit, manager, primary, table, toks};

fn retention(priority: u8, duration: Option<Duration>) -> RetentionPolicy {
    RetentionPolicy {
        ranges: vec![TokenRangeRetention {
            start: 0,
            end: None,
            priority: Priority::new(priority).expect("in range"),
            duration,
        }],
        ..RetentionPolicy::default()
    }
}

/// Runs a 3-token prompt with block size 2 (one stored block) and returns that block.
fn cache_one(kv: &mut KvCacheManager, id: u64, retention: RetentionPolicy) -> BlockId {
    let spec = RequestSpec::new(RequestId(id), toks(10 * id as u32, 3)).with_retention(retention);
    kv.add_request(spec).expect("room");
    kv.commit_computed(RequestId(id), 3).expect("live");
    let block = table(kv, id)[0];
    kv.release(RequestId(id)).expect("live");
    block
}

fn is_cached(kv: &KvCacheManager, b: BlockId) -> bool {
    kv.cached_block(G0, primary(b)).expect("valid").is_some()
}

/// Allocates one fresh block (a 1-token request that is never released).
fn take_one(kv: &mut KvCacheManager, id: u64) {
    kv.add_request(RequestSpec::new(RequestId(id), vec![9_999]))
        .expect("room after eviction");
}

/// Takes every free block, so that the next allocation must evict.
fn use_up_free_blocks(kv: &mut KvCacheManager) {
    let mut id = 1_000;
    while kv.usage(G0, Tier::Primary).expect("g0").free > 0 {
        take_one(kv, id);
        id += 1;
    }
}

#[test]
fn lowest_priority_goes_first_and_lru_breaks_ties() {
    let (mut kv, _) = manager(2, 6, 0);
    let a = cache_one(&mut kv, 1, retention(80, None));
    let b = cache_one(&mut kv, 2, retention(10, None));
    let c = cache_one(&mut kv, 3, RetentionPolicy::default());
    let d = cache_one(&mut kv, 4, retention(10, None));
    assert_eq!(kv.usage(G0, Tier::Primary).expect("g0").cached, 4);
    use_up_free_blocks(&mut kv);
    let mut expect_gone = |id: u64, gone: BlockId, kept: &[BlockId]| {
        take_one(&mut kv, 100 + id);
        assert!(!is_cached(&kv, gone), "step {id}: {gone} should be evicted");
        for &k in kept {
            assert!(is_cached(&kv, k), "step {id}: {k} should stay");
        }
        audit(&kv);
    };
    expect_gone(1, b, &[a, c, d]); // priority 10, older
    expect_gone(2, d, &[a, c]); // priority 10
    expect_gone(3, c, &[a]); // priority 35
    expect_gone(4, a, &[]); // priority 80
}

#[test]
fn timed_priority_reverts_to_default_after_its_duration() {
    for (advance, first_evicted_is_a) in [
        (Duration::from_secs(5), false),
        (Duration::from_secs(11), true),
    ] {
        let (mut kv, clock) = manager(2, 4, 0);
        let a = cache_one(&mut kv, 1, retention(90, Some(Duration::from_secs(10))));
        let b = cache_one(&mut kv, 2, RetentionPolicy::default());
        use_up_free_blocks(&mut kv);
        kv.drain_events();
        clock.advance(advance);
        take_one(&mut kv, 3);
        assert_eq!(!is_cached(&kv, a), first_evicted_is_a, "after {advance:?}");
        assert_eq!(is_cached(&kv, b), first_evicted_is_a, "after {advance:?}");
        let reverted = kv.drain_events().events.iter().any(
            |e| matches!(e, KvEvent::Updated { priority, .. } if *priority == Priority::DEFAULT),
        );
        assert_eq!(
            reverted, first_evicted_is_a,
            "an Updated event marks the reversion"
        );
        audit(&kv);
    }
}

#[test]
fn decode_retention_applies_to_blocks_of_generated_tokens() {
    let (mut kv, _) = manager(2, 3, 0);
    let policy = RetentionPolicy {
        decode_priority: Priority::new(5).expect("in range"),
        ..RetentionPolicy::default()
    };
    kv.add_request(RequestSpec::new(RequestId(1), toks(0, 2)).with_retention(policy))
        .expect("room");
    kv.commit_computed(RequestId(1), 2).expect("live");
    for t in [1, 2, 3] {
        kv.append_token(RequestId(1), t).expect("room");
    }
    let t = table(&kv, 1);
    kv.release(RequestId(1)).expect("live");
    // Block 0 (prompt) has priority 35 and block 1 (generated) priority 5. Block 1 is the chain's
    // leaf anyway; check its priority and that it goes first.
    let gen_block = kv
        .cached_block(G0, primary(t[1]))
        .expect("valid")
        .expect("stored");
    assert_eq!(gen_block.priority.get(), 5);
    let prompt_block = kv
        .cached_block(G0, primary(t[0]))
        .expect("valid")
        .expect("stored");
    assert_eq!(prompt_block.priority, Priority::DEFAULT);
    use_up_free_blocks(&mut kv);
    take_one(&mut kv, 3); // evicts block 1
    assert!(!is_cached(&kv, t[1]));
    assert!(is_cached(&kv, t[0]));
}

#[test]
fn only_leaves_are_evicted_whatever_their_priority() {
    let (mut kv, _) = manager(2, 3, 0);
    let policy = RetentionPolicy {
        ranges: vec![
            TokenRangeRetention {
                start: 0,
                end: Some(2),
                priority: Priority::MIN,
                duration: None,
            },
            TokenRangeRetention {
                start: 2,
                end: Some(4),
                priority: Priority::MAX,
                duration: None,
            },
        ],
        ..RetentionPolicy::default()
    };
    kv.add_request(RequestSpec::new(RequestId(1), toks(0, 5)).with_retention(policy))
        .expect("room");
    kv.commit_computed(RequestId(1), 5).expect("live");
    let t = table(&kv, 1);
    kv.release(RequestId(1)).expect("live");
    assert_eq!(
        kv.usage(G0, Tier::Primary).expect("g0").evictable,
        1,
        "only the leaf"
    );
    use_up_free_blocks(&mut kv);
    take_one(&mut kv, 3); // must evict: the priority-100 leaf goes, not its priority-0 parent
    assert!(is_cached(&kv, t[0]));
    assert!(!is_cached(&kv, t[1]));
    take_one(&mut kv, 4); // now the parent is a leaf
    assert!(!is_cached(&kv, t[0]));
    audit(&kv);
}

#[test]
fn explicit_evict_frees_up_to_the_count_asked() {
    let (mut kv, _) = manager(2, 8, 0);
    for id in 1..=3 {
        cache_one(&mut kv, id, RetentionPolicy::default());
    }
    assert_eq!(kv.evict(G0, Tier::Primary, 2).expect("g0"), 2);
    assert_eq!(kv.evict(G0, Tier::Primary, 5).expect("g0"), 1);
    assert_eq!(kv.usage(G0, Tier::Primary).expect("g0").free, 8);
    audit(&kv);
}
