//! Attention windows and the event stream.

use kv_blocks::{GroupConfig, GroupId, KvCacheConfig, KvEvent, RequestId, RequestSpec, Tier};

use crate::util::{audit, manager, manager_with, run_once, toks};

const FULL: GroupId = GroupId(0);
const WINDOWED: GroupId = GroupId(1);

fn two_groups() -> KvCacheConfig {
    let mut cfg = KvCacheConfig::new(4, 32, 0);
    cfg.groups.push(GroupConfig {
        window: Some(8),
        kv_heads: 2,
        primary_blocks: 16,
        secondary_blocks: 0,
    });
    cfg
}

#[test]
fn blocks_that_leave_the_window_are_released_from_the_request() {
    let (mut kv, _) = manager_with(two_groups());
    kv.add_request(RequestSpec::new(RequestId(1), toks(0, 20)))
        .expect("room");
    assert_eq!(
        kv.usage(WINDOWED, Tier::Primary).expect("g1").used,
        5,
        "prefill needs all"
    );
    kv.commit_computed(RequestId(1), 20).expect("live");
    // Next token is at 20 and sees keys > 12: blocks 0..=2 (tokens 0..12) are out.
    let t = kv.block_table(RequestId(1), WINDOWED).expect("live");
    assert_eq!(
        t.iter().map(Option::is_some).collect::<Vec<_>>(),
        [false, false, false, true, true]
    );
    assert_eq!(kv.block_table(RequestId(1), FULL).expect("live").len(), 5);
    let mut flat = vec![0; 6];
    kv.fill_block_table(WINDOWED, &[RequestId(1)], 6, &mut flat)
        .expect("fits");
    assert_eq!(flat[..3], [-1, -1, -1]);
    assert!(flat[3] >= 0 && flat[4] >= 0 && flat[5] == -1);
    assert_eq!(kv.usage(WINDOWED, Tier::Primary).expect("g1").used, 2);
    // Decoding keeps at most window / block + 1 blocks live.
    for t in 0..40 {
        kv.append_token(RequestId(1), 7 + t).expect("room");
        let live = kv
            .block_table(RequestId(1), WINDOWED)
            .expect("live")
            .iter()
            .flatten()
            .count();
        assert!(live <= 3, "{live} live blocks");
    }
    audit(&kv);
}

#[test]
fn blocks_released_by_the_window_stay_reusable() {
    let (mut kv, _) = manager_with(two_groups());
    assert_eq!(run_once(&mut kv, 1, toks(0, 20)), 0);
    let out = kv
        .add_request(RequestSpec::new(RequestId(2), toks(0, 20)))
        .expect("room");
    assert_eq!(
        out.reused_tokens, 16,
        "both groups reuse the 4 stored blocks"
    );
    let t = kv.block_table(RequestId(2), WINDOWED).expect("live");
    // Position 16 attends keys 9..=16: blocks 0 (0..4) and 1 (4..8) are behind the window.
    assert!(t[0].is_none() && t[1].is_none());
    assert!(t[2].is_some());
    audit(&kv);
}

#[test]
fn the_event_stream_reports_created_stored_updated_tier_changes_and_removals() {
    let (mut kv, _) = manager(2, 3, 1);
    let created = kv.drain_events().events;
    assert_eq!(
        created,
        vec![KvEvent::Created {
            group: FULL,
            primary_blocks: 3,
            secondary_blocks: 1
        }]
    );
    run_once(&mut kv, 1, toks(0, 5)); // stores two chained blocks
    let stored: Vec<_> = kv
        .drain_events()
        .events
        .into_iter()
        .filter_map(|e| match e {
            KvEvent::Stored { hash, parent, .. } => Some((hash, parent)),
            _ => None,
        })
        .collect();
    assert_eq!(stored.len(), 2);
    assert_eq!(stored[0].1, None);
    assert_eq!(stored[1].1, Some(stored[0].0), "chained from the parent");
    // Three fresh blocks: the free one, then the leaf is offloaded into the single host block,
    // then the parent is offloaded too, which drops the leaf from the host tier to make room.
    kv.add_request(RequestSpec::new(RequestId(2), toks(100, 6)))
        .expect("room");
    let events = kv.drain_events().events;
    let moved = |h| {
        events.iter().any(
            |e| matches!(e, KvEvent::TierChanged { hash, to: Tier::Secondary, .. } if *hash == h),
        )
    };
    assert!(moved(stored[1].0) && moved(stored[0].0));
    assert!(
        events
            .iter()
            .any(|e| matches!(e, KvEvent::Removed { hash, .. } if *hash == stored[1].0))
    );
    // The parent is still reusable from the host tier, with an Updated event when reused with
    // another priority.
    let spec =
        RequestSpec::new(RequestId(3), toks(0, 3)).with_retention(kv_blocks::RetentionPolicy {
            ranges: vec![kv_blocks::TokenRangeRetention {
                start: 0,
                end: None,
                priority: kv_blocks::Priority::new(60).expect("in range"),
                duration: None,
            }],
            ..Default::default()
        });
    kv.release(RequestId(2)).expect("live");
    assert_eq!(kv.add_request(spec).expect("room").reused_tokens, 2);
    let events = kv.drain_events().events;
    assert!(
        events
            .iter()
            .any(|e| matches!(e, KvEvent::Updated { hash, .. } if *hash == stored[0].0))
    );
}

#[test]
fn a_full_event_buffer_counts_what_it_drops() {
    let mut cfg = KvCacheConfig::new(2, 64, 0);
    cfg.event_capacity = 3;
    let (mut kv, _) = manager_with(cfg);
    run_once(&mut kv, 1, toks(0, 11)); // Created + 5 Stored
    let batch = kv.drain_events();
    assert_eq!(batch.events.len(), 3);
    assert!(matches!(batch.events[0], KvEvent::Created { .. }));
    assert_eq!(batch.dropped, 3);
    let again = kv.drain_events();
    assert_eq!(
        (again.events.len(), again.dropped),
        (0, 0),
        "draining resets the count"
    );
}

#[test]
fn events_are_off_at_capacity_zero() {
    let (mut kv, _) = manager_with(KvCacheConfig::new(2, 8, 0));
    run_once(&mut kv, 1, toks(0, 5));
    assert_eq!(kv.drain_events(), kv_blocks::EventBatch::default());
}
