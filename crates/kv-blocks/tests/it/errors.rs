//! Every error is typed, and a failed call leaves the manager as it was.

use kv_blocks::{
    BlockId, BlockLoc, GroupConfig, GroupId, KvCacheConfig, KvCacheManager, KvError, Priority,
    RequestId, RequestSpec, Tier,
};

use crate::util::{G0, add_computed, audit, manager, toks};

#[test]
fn invalid_configs_are_rejected_with_a_reason() {
    let check = |edit: &dyn Fn(&mut KvCacheConfig), needle: &str| {
        let mut cfg = KvCacheConfig::new(16, 8, 8);
        edit(&mut cfg);
        match KvCacheManager::new(cfg) {
            Err(KvError::InvalidConfig(msg)) => {
                assert!(msg.contains(needle), "`{msg}` should mention `{needle}`");
            }
            Err(other) => panic!("expected InvalidConfig about {needle}, got {other}"),
            Ok(_) => panic!("expected InvalidConfig about {needle}, got a manager"),
        }
    };
    check(&|c| c.tokens_per_block = 0, "power of two");
    check(&|c| c.tokens_per_block = 1, "power of two");
    check(&|c| c.tokens_per_block = 24, "power of two");
    check(&|c| c.groups.clear(), "at least one");
    check(&|c| c.groups[0].window = Some(0), "window of 0");
    check(&|c| c.groups[0].kv_heads = 0, "kv_heads");
    check(
        &|c| {
            c.groups[0].primary_blocks = 0;
            c.groups[0].secondary_blocks = 0;
        },
        "both pools are empty",
    );
    check(
        &|c| c.groups[0].primary_blocks = u32::MAX,
        "exceed the limit",
    );
    check(
        &|c| {
            let g = c.groups[0].clone();
            c.groups.push(g);
        },
        "same window",
    );
    // A different window is a valid second group.
    let mut cfg = KvCacheConfig::new(16, 8, 8);
    cfg.groups.push(GroupConfig {
        window: Some(64),
        ..cfg.groups[0].clone()
    });
    assert!(KvCacheManager::new(cfg).is_ok());
}

#[test]
fn request_errors_name_the_request_and_change_nothing() {
    let (mut kv, _) = manager(4, 8, 0);
    add_computed(&mut kv, 1, toks(0, 6));
    let before = kv.usage(G0, Tier::Primary).expect("group 0");
    let check = |got: Result<(), KvError>, want: KvError| assert_eq!(got, Err(want));
    check(
        kv.add_request(RequestSpec::new(RequestId(1), toks(0, 3)))
            .map(drop),
        KvError::DuplicateRequest(RequestId(1)),
    );
    check(
        kv.add_request(RequestSpec::new(RequestId(2), Vec::new()))
            .map(drop),
        KvError::EmptyRequest(RequestId(2)),
    );
    check(
        kv.append_token(RequestId(9), 5),
        KvError::UnknownRequest(RequestId(9)),
    );
    check(
        kv.release(RequestId(9)).map(drop),
        KvError::UnknownRequest(RequestId(9)),
    );
    check(
        kv.commit_computed(RequestId(9), 1),
        KvError::UnknownRequest(RequestId(9)),
    );
    assert!(matches!(
        kv.commit_computed(RequestId(1), 7),
        Err(KvError::InvalidLength { .. })
    ));
    assert!(matches!(
        kv.truncate(RequestId(1), 0),
        Err(KvError::InvalidLength { .. })
    ));
    assert!(matches!(
        kv.truncate(RequestId(1), 7),
        Err(KvError::InvalidLength { .. })
    ));
    check(
        kv.block_table(RequestId(1), GroupId(3)).map(drop),
        KvError::UnknownGroup(GroupId(3)),
    );
    check(
        kv.refcount(
            G0,
            BlockLoc {
                tier: Tier::Primary,
                block: BlockId::new(99),
            },
        )
        .map(drop),
        KvError::UnknownBlock {
            group: G0,
            tier: Tier::Primary,
            block: 99,
        },
    );
    check(Priority::new(101).map(drop), KvError::InvalidPriority(101));
    assert_eq!(kv.usage(G0, Tier::Primary).expect("group 0"), before);
    audit(&kv);
}

#[test]
fn out_of_blocks_on_add_leaves_no_trace() {
    let (mut kv, _) = manager(4, 4, 0);
    add_computed(&mut kv, 1, toks(0, 12)); // 3 of 4 blocks
    let before = kv.usage(G0, Tier::Primary).expect("group 0");
    let err = kv.add_request(RequestSpec::new(RequestId(2), toks(100, 9)));
    assert_eq!(
        err,
        Err(KvError::OutOfBlocks {
            group: G0,
            tier: Tier::Primary
        })
    );
    assert!(!kv.contains(RequestId(2)));
    assert_eq!(kv.usage(G0, Tier::Primary).expect("group 0"), before);
    audit(&kv);
}

#[test]
fn out_of_blocks_on_append_leaves_the_request_as_it_was() {
    let (mut kv, _) = manager(4, 2, 0);
    add_computed(&mut kv, 1, toks(0, 8)); // both blocks, full
    let tokens_before = kv.tokens(RequestId(1)).expect("live").to_vec();
    assert!(matches!(
        kv.append_token(RequestId(1), 42),
        Err(KvError::OutOfBlocks { .. })
    ));
    assert_eq!(kv.tokens(RequestId(1)).expect("live"), &tokens_before[..]);
    assert_eq!(kv.block_table(RequestId(1), G0).expect("live").len(), 2);
    audit(&kv);
}

#[test]
fn block_table_export_checks_its_buffer() {
    let (mut kv, _) = manager(4, 8, 0);
    add_computed(&mut kv, 1, toks(0, 9)); // 3 blocks
    let mut small = vec![0; 2];
    assert!(matches!(
        kv.fill_block_table(G0, &[RequestId(1)], 4, &mut small),
        Err(KvError::TableTooSmall(_))
    ));
    let mut out = vec![0; 2];
    assert!(matches!(
        kv.fill_block_table(G0, &[RequestId(1)], 2, &mut out),
        Err(KvError::TableTooSmall(_))
    ));
    assert_eq!(out, vec![0, 0], "nothing written on error");
}
