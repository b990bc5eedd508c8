//! The host tier: offload with a minimum priority, onboarding on reuse, and sparse-mode requests
//! that live in the host tier.

use kv_blocks::{
    BlockLoc, KvEvent, Priority, RequestId, RequestSpec, RetentionPolicy, Tier,
    TokenRangeRetention, TransferKind,
};

use crate::util::{G0, add_computed, audit, manager, primary, run_once, table, toks};

fn low_priority() -> RetentionPolicy {
    RetentionPolicy {
        ranges: vec![TokenRangeRetention {
            start: 0,
            end: None,
            priority: Priority::new(20).expect("in range"),
            duration: None,
        }],
        ..RetentionPolicy::default()
    }
}

#[test]
fn evicted_blocks_are_offloaded_only_from_the_min_priority() {
    let (mut kv, _) = manager(2, 4, 4);
    // A low-priority prompt and a default one; each leaves one cached block.
    kv.add_request(RequestSpec::new(RequestId(1), toks(0, 3)).with_retention(low_priority()))
        .expect("room");
    kv.commit_computed(RequestId(1), 3).expect("live");
    kv.release(RequestId(1)).expect("live");
    run_once(&mut kv, 2, toks(50, 3));
    kv.drain_events();
    // Four fresh blocks: two free ones, and both cached blocks must leave the primary tier.
    kv.add_request(RequestSpec::new(RequestId(3), toks(100, 8)))
        .expect("room");
    let transfers = kv.take_transfers();
    assert_eq!(
        transfers.len(),
        1,
        "only the default-priority block is offloaded"
    );
    assert_eq!(transfers[0].kind, TransferKind::Offload);
    assert_eq!(transfers[0].dst.tier, Tier::Secondary);
    let events = kv.drain_events().events;
    assert!(events.iter().any(|e| matches!(
        e,
        KvEvent::Removed {
            tier: Tier::Primary,
            ..
        }
    )));
    assert!(events.iter().any(|e| matches!(
        e,
        KvEvent::TierChanged {
            from: Tier::Primary,
            to: Tier::Secondary,
            ..
        }
    )));
    assert_eq!(kv.usage(G0, Tier::Secondary).expect("g0").cached, 1);
    audit(&kv);
}

#[test]
fn a_reused_secondary_block_is_onboarded_and_stays_reusable() {
    let (mut kv, _) = manager(2, 2, 4);
    run_once(&mut kv, 1, toks(0, 3));
    // Fill the primary tier so the cached block moves to the host.
    add_computed(&mut kv, 2, toks(100, 4));
    kv.take_transfers();
    assert_eq!(kv.usage(G0, Tier::Secondary).expect("g0").cached, 1);
    kv.release(RequestId(2)).expect("live");
    assert_eq!(
        add_computed(&mut kv, 3, toks(0, 3)),
        2,
        "found in the host tier"
    );
    let transfers = kv.take_transfers();
    let onboard: Vec<_> = transfers
        .iter()
        .filter(|t| t.kind == TransferKind::Onboard)
        .collect();
    assert_eq!(onboard.len(), 1);
    assert_eq!(onboard[0].src.tier, Tier::Secondary);
    assert_eq!(onboard[0].dst, primary(table(&kv, 3)[0]));
    kv.release(RequestId(3)).expect("live");
    assert_eq!(
        add_computed(&mut kv, 4, toks(0, 3)),
        2,
        "still reusable in primary"
    );
    audit(&kv);
}

#[test]
fn sparse_mode_requests_live_in_the_host_tier_and_share_among_themselves() {
    let (mut kv, _) = manager(4, 4, 16);
    let host =
        |id: u64, n: u32| RequestSpec::new(RequestId(id), toks(0, n)).in_tier(Tier::Secondary);
    kv.add_request(host(1, 17)).expect("room");
    kv.commit_computed(RequestId(1), 17).expect("live");
    assert_eq!(kv.usage(G0, Tier::Primary).expect("g0").used, 0);
    assert_eq!(kv.usage(G0, Tier::Secondary).expect("g0").used, 5);
    assert_eq!(
        kv.request_tier(RequestId(1)).expect("live"),
        Tier::Secondary
    );
    let out = kv.add_request(host(2, 17)).expect("room");
    assert_eq!(out.reused_tokens, 16);
    // A primary request cannot share blocks a host request still holds; it copies the best
    // matching one instead (one block's worth).
    kv.take_transfers();
    assert_eq!(add_computed(&mut kv, 3, toks(0, 9)), 4);
    let copies = kv.take_transfers();
    assert_eq!(copies.len(), 1);
    assert_eq!(
        (copies[0].kind, copies[0].src.tier, copies[0].dst.tier),
        (TransferKind::Copy, Tier::Secondary, Tier::Primary)
    );
    assert_eq!(
        kv.refcount(G0, copies[0].src).expect("valid"),
        2,
        "still held by both host requests"
    );
    audit(&kv);
}

#[test]
fn a_secondary_parent_keeps_its_primary_child_and_both_are_reused() {
    let (mut kv, _) = manager(2, 4, 4);
    // A host-tier request stores block X in the secondary tier and keeps holding it.
    kv.add_request(RequestSpec::new(RequestId(1), toks(0, 3)).in_tier(Tier::Secondary))
        .expect("room");
    kv.commit_computed(RequestId(1), 3).expect("live");
    // A primary request with prompt X + Z cannot share X (held in the host tier), copies it into
    // a private block, and stores Z under the cached X: a secondary parent with a primary child.
    let mut prompt = toks(0, 2);
    prompt.extend(toks(500, 3));
    assert_eq!(add_computed(&mut kv, 2, prompt.clone()), 2);
    let z = table(&kv, 2)[1];
    let z_cached = kv
        .cached_block(G0, primary(z))
        .expect("valid")
        .expect("stored");
    assert_eq!(z_cached.index, 1);
    kv.release(RequestId(1)).expect("live");
    kv.release(RequestId(2)).expect("live");
    // X has a child, so it is not evictable from the host tier.
    let x_loc = BlockLoc {
        tier: Tier::Secondary,
        block: kv_blocks::BlockId::new(0),
    };
    assert!(kv.cached_block(G0, x_loc).expect("valid").is_some());
    assert_eq!(kv.evict(G0, Tier::Secondary, 4).expect("g0"), 0);
    // Reuse walks X (onboarded) then Z (already primary).
    assert_eq!(add_computed(&mut kv, 3, prompt), 4);
    let onboards = kv
        .take_transfers()
        .into_iter()
        .filter(|t| t.kind == TransferKind::Onboard)
        .count();
    assert_eq!(onboards, 1);
    audit(&kv);
}
