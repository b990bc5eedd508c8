//! Prefix reuse: full blocks, partial blocks, the last-token rule, salts, extra ids and stats.

use kv_blocks::{KvCacheConfig, RequestId, RequestSpec, RequestStats, Tier, TransferKind};

use crate::util::{G0, add_computed, audit, manager, manager_with, primary, run_once, table, toks};

#[test]
fn allocation_fills_a_table_of_distinct_blocks_and_grows_on_append() {
    let (mut kv, _) = manager(4, 16, 0);
    add_computed(&mut kv, 1, toks(0, 10));
    let t = table(&kv, 1);
    assert_eq!(t.len(), 3);
    assert!(t[0] != t[1] && t[1] != t[2] && t[0] != t[2]);
    kv.append_tokens(RequestId(1), &[1, 2]).expect("room");
    assert_eq!(table(&kv, 1).len(), 3, "12 tokens still fit 3 blocks");
    kv.append_token(RequestId(1), 3).expect("room");
    assert_eq!(table(&kv, 1).len(), 4, "the 13th token opens a block");
    let mut flat = vec![0; 2 * 5];
    add_computed(&mut kv, 2, toks(50, 3));
    kv.fill_block_table(G0, &[RequestId(1), RequestId(2)], 5, &mut flat)
        .expect("fits");
    let t1: Vec<i32> = table(&kv, 1).iter().map(|b| b.as_i32()).collect();
    let t2 = table(&kv, 2)[0].as_i32();
    assert_eq!(flat, [t1[0], t1[1], t1[2], t1[3], -1, t2, -1, -1, -1, -1]);
    audit(&kv);
}

#[test]
fn full_blocks_of_a_released_prompt_are_reused_and_shared() {
    let (mut kv, _) = manager(4, 16, 0);
    let prompt = toks(0, 13);
    assert_eq!(run_once(&mut kv, 1, prompt.clone()), 0);
    // 12 tokens = 3 full blocks stored (the 13th token is the last one and is not).
    assert_eq!(add_computed(&mut kv, 2, prompt.clone()), 12);
    assert_eq!(add_computed(&mut kv, 3, prompt), 12);
    let (t2, t3) = (table(&kv, 2), table(&kv, 3));
    assert_eq!(t2[..3], t3[..3], "the reused blocks are shared");
    assert_ne!(t2[3], t3[3], "the last block is private");
    assert_eq!(kv.refcount(G0, primary(t2[0])).expect("valid"), 2);
    assert_eq!(
        kv.request_stats(RequestId(3)).expect("live"),
        RequestStats {
            reused_blocks: 3,
            missed_blocks: 1,
            reused_tokens: 12
        }
    );
    audit(&kv);
}

#[test]
fn last_token_of_the_last_block_is_never_stored_or_reused() {
    let (mut kv, _) = manager(4, 16, 0);
    // A prompt of exactly two blocks: only the first is stored, since the last token's KV is
    // recomputed for its logits.
    run_once(&mut kv, 1, toks(0, 8));
    assert_eq!(kv.stats().stored, 1);
    assert_eq!(add_computed(&mut kv, 2, toks(0, 8)), 4);
    // A longer prompt with the same 8 tokens reuses 4 only: block 1 was never stored.
    assert_eq!(add_computed(&mut kv, 3, toks(0, 12)), 4);
    audit(&kv);
}

#[test]
fn one_token_prompt_gets_no_reuse() {
    let (mut kv, _) = manager(2, 16, 0);
    run_once(&mut kv, 1, toks(0, 5));
    assert_eq!(run_once(&mut kv, 2, toks(0, 1)), 0);
    assert_eq!(kv.stats().partial_copies, 0);
}

#[test]
fn decode_blocks_are_stored_as_they_fill() {
    let (mut kv, _) = manager(4, 16, 0);
    add_computed(&mut kv, 1, toks(0, 3));
    let generated = toks(3, 6);
    for &t in &generated {
        kv.append_token(RequestId(1), t).expect("room");
    }
    // 9 tokens, 8 computed: two full blocks stored while the request is still live.
    assert_eq!(kv.stats().stored, 2);
    assert_eq!(add_computed(&mut kv, 2, toks(0, 10)), 8);
    audit(&kv);
}

#[test]
fn partial_reuse_copies_the_matching_tokens_when_copy_is_on() {
    let (mut kv, _) = manager(4, 16, 0);
    add_computed(&mut kv, 1, toks(0, 9)); // blocks 0 and 1 stored, request 1 holds them
    kv.take_transfers();
    // 6 shared tokens: block 0 fully, 2 tokens of block 1.
    let mut prompt = toks(0, 6);
    prompt.extend([7, 7, 7]);
    assert_eq!(add_computed(&mut kv, 2, prompt), 6);
    let (t1, t2) = (table(&kv, 1), table(&kv, 2));
    assert_eq!(t1[0], t2[0]);
    assert_ne!(t1[1], t2[1]);
    let copies: Vec<_> = kv.take_transfers();
    assert_eq!(copies.len(), 1);
    assert_eq!(copies[0].kind, TransferKind::Copy);
    assert_eq!(copies[0].src, primary(t1[1]));
    assert_eq!(copies[0].dst, primary(t2[1]));
    assert_eq!(copies[0].num_tokens, Some(2));
    // The source block stays cached for others.
    assert!(
        kv.cached_block(G0, primary(t1[1]))
            .expect("valid")
            .is_some()
    );
    audit(&kv);
}

#[test]
fn partial_reuse_takes_over_an_unused_leaf_when_copy_is_off() {
    let mut cfg = KvCacheConfig::new(4, 16, 0);
    cfg.copy_on_partial_reuse = false;
    let (mut kv, _) = manager_with(cfg);
    add_computed(&mut kv, 1, toks(0, 9));
    let t1 = table(&kv, 1);
    kv.release(RequestId(1)).expect("live");
    let mut prompt = toks(0, 6);
    prompt.extend([7, 7, 7]);
    let spec = RequestSpec::new(RequestId(2), prompt);
    assert_eq!(kv.add_request(spec).expect("room").reused_tokens, 6);
    let t2 = table(&kv, 2);
    assert_eq!(t2[1], t1[1], "the partly matching block is taken over");
    assert!(kv.take_transfers().is_empty(), "no copy");
    assert_eq!(
        kv.cached_block(G0, primary(t2[1])).expect("valid"),
        None,
        "a taken-over block leaves the tree"
    );
    // Once computed, it is stored again under its new content.
    kv.commit_computed(RequestId(2), 9).expect("live");
    let cached = kv
        .cached_block(G0, primary(t2[1]))
        .expect("valid")
        .expect("stored");
    assert_eq!(cached.tokens, vec![1004, 1005, 7, 7]);
    audit(&kv);
}

#[test]
fn partial_reuse_without_copy_skips_a_block_in_use() {
    let mut cfg = KvCacheConfig::new(4, 16, 0);
    cfg.copy_on_partial_reuse = false;
    let (mut kv, _) = manager_with(cfg);
    add_computed(&mut kv, 1, toks(0, 9)); // still holds block 1
    let mut prompt = toks(0, 6);
    prompt.extend([7, 7, 7]);
    assert_eq!(add_computed(&mut kv, 2, prompt), 4, "only the full block");
    audit(&kv);
}

#[test]
fn partial_reuse_can_be_turned_off() {
    let mut cfg = KvCacheConfig::new(4, 16, 0);
    cfg.enable_partial_reuse = false;
    let (mut kv, _) = manager_with(cfg);
    run_once(&mut kv, 1, toks(0, 9));
    assert_eq!(add_computed(&mut kv, 2, toks(0, 7)), 4);
}

#[test]
fn reuse_can_be_turned_off() {
    let mut cfg = KvCacheConfig::new(4, 16, 0);
    cfg.enable_reuse = false;
    let (mut kv, _) = manager_with(cfg);
    run_once(&mut kv, 1, toks(0, 9));
    assert_eq!(run_once(&mut kv, 2, toks(0, 9)), 0);
    assert_eq!(kv.stats().stored, 0);
    assert_eq!(kv.usage(G0, Tier::Primary).expect("g0").free, 16);
}

#[test]
fn different_salts_never_share_blocks() {
    let (mut kv, _) = manager(4, 32, 0);
    let prompt = toks(0, 9);
    let add = |kv: &mut kv_blocks::KvCacheManager, id: u64, salt: Option<&str>| {
        let mut spec = RequestSpec::new(RequestId(id), prompt.clone());
        spec.salt = salt.map(str::to_owned);
        let reused = kv.add_request(spec).expect("room").reused_tokens;
        kv.commit_computed(RequestId(id), 9).expect("live");
        kv.release(RequestId(id)).expect("live");
        reused
    };
    assert_eq!(add(&mut kv, 1, Some("alice")), 0);
    assert_eq!(add(&mut kv, 2, Some("bob")), 0, "another salt");
    assert_eq!(add(&mut kv, 3, None), 0, "no salt is its own salt");
    assert_eq!(add(&mut kv, 4, Some("alice")), 8, "same salt");
    assert_eq!(add(&mut kv, 5, None), 8);
}

#[test]
fn extra_ids_are_part_of_every_block_key() {
    let (mut kv, _) = manager(4, 32, 0);
    let run = |kv: &mut kv_blocks::KvCacheManager, id: u64, extra: Vec<u64>| {
        let spec = RequestSpec::new(RequestId(id), toks(0, 9)).with_extra_ids(extra);
        let reused = kv.add_request(spec).expect("room").reused_tokens;
        kv.commit_computed(RequestId(id), 9).expect("live");
        kv.release(RequestId(id)).expect("live");
        reused
    };
    assert_eq!(run(&mut kv, 1, vec![7]), 0);
    assert_eq!(run(&mut kv, 2, vec![8]), 0, "another LoRA task id");
    assert_eq!(run(&mut kv, 3, vec![7]), 8);
    let t = {
        let spec = RequestSpec::new(RequestId(4), toks(0, 9)).with_extra_ids(vec![7]);
        kv.add_request(spec).expect("room");
        table(&kv, 4)
    };
    let cached = kv
        .cached_block(G0, primary(t[1]))
        .expect("valid")
        .expect("cached");
    assert_eq!(cached.extra_ids, vec![7]);
    assert_eq!(cached.index, 1);
    assert_eq!(cached.tokens, toks(4, 4));
}

#[test]
fn request_and_global_stats_count_reused_and_missed_blocks() {
    let (mut kv, _) = manager(4, 32, 0);
    assert_eq!(run_once(&mut kv, 1, toks(0, 10)), 0);
    let s = {
        add_computed(&mut kv, 2, toks(0, 10));
        kv.release(RequestId(2)).expect("live")
    };
    // The first run stored the 2 full blocks within its first 9 tokens; the third block was
    // never full, so it is missed.
    assert_eq!(
        s,
        RequestStats {
            reused_blocks: 2,
            missed_blocks: 1,
            reused_tokens: 8
        }
    );
    let g = kv.stats();
    assert_eq!((g.reused_blocks, g.missed_blocks), (2, 4));
}

#[test]
fn truncating_frees_the_tail_and_copies_a_shared_partial_block() {
    let (mut kv, _) = manager(4, 16, 0);
    add_computed(&mut kv, 1, toks(0, 13)); // 4 blocks, 3 stored
    let t = table(&kv, 1);
    kv.take_transfers();
    kv.truncate(RequestId(1), 6).expect("valid length");
    let after = table(&kv, 1);
    assert_eq!(after.len(), 2);
    assert_eq!(after[0], t[0]);
    assert_ne!(
        after[1], t[1],
        "block 1 is cached, so the request gets a private copy"
    );
    let copies = kv.take_transfers();
    assert_eq!(copies.len(), 1);
    assert_eq!(copies[0].num_tokens, Some(2));
    assert_eq!(kv.tokens(RequestId(1)).expect("live"), &toks(0, 6)[..]);
    // The tail blocks are back: 2 held, and the cached ones are unreferenced.
    let u = kv.usage(G0, Tier::Primary).expect("g0");
    assert_eq!(u.used, 2);
    audit(&kv);
}

#[test]
fn reusable_tokens_predicts_add_request_without_changing_anything() {
    let (mut kv, _) = manager(4, 16, 0);
    run_once(&mut kv, 1, toks(0, 13));
    let spec = RequestSpec::new(RequestId(2), toks(0, 11));
    let before = kv.usage(G0, Tier::Primary).expect("g0");
    assert_eq!(kv.reusable_tokens(&spec), 10);
    assert_eq!(kv.usage(G0, Tier::Primary).expect("g0"), before);
    assert_eq!(kv.add_request(spec).expect("room").reused_tokens, 10);
    assert_eq!(
        kv.reusable_tokens(&RequestSpec::new(RequestId(3), vec![5])),
        0
    );
}

#[test]
fn blocks_kept_as_a_lazy_run_behave_as_nodes() {
    // Without events, a prompt's stored blocks after its first are kept as one lazy run; the
    // manager with events keeps a node per block. Both must agree on everything.
    let mut cfg = KvCacheConfig::new(4, 12, 0);
    cfg.event_capacity = 0;
    let (mut lazy, _) = manager_with(cfg);
    let (mut nodes, _) = manager(4, 12, 0);
    for kv in [&mut lazy, &mut nodes] {
        add_computed(kv, 1, toks(0, 21));
        let c = kv
            .cached_block(G0, primary(table(kv, 1)[3]))
            .expect("valid block")
            .expect("stored");
        assert_eq!((c.index, c.tokens), (3, toks(12, 4)), "block 3 of the run");
        kv.release(RequestId(1)).expect("live");
        // Diverges inside block 2: blocks 0 and 1 are reused, block 2 partly.
        let mut p = toks(0, 10);
        p.extend(toks(900, 8));
        assert_eq!(add_computed(kv, 2, p), 10);
        // A new 7-block prompt evicts the rest of the first prompt's blocks.
        add_computed(kv, 3, toks(300, 27));
        audit(kv);
    }
    for id in [2, 3] {
        assert_eq!(table(&lazy, id), table(&nodes, id), "request {id}'s table");
    }
    assert_eq!(lazy.stats(), nodes.stats());
    assert!(lazy.stats().evicted > 0, "the last prompt had to evict");
}
