//! A proptest state machine: random sequences of add / append / commit / truncate / release /
//! evict / clock advance over two tiers and two window groups, with the invariants checked after
//! every step.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kv_blocks::{
    GroupConfig, GroupId, KvCacheConfig, KvCacheManager, KvError, ManualClock, Priority, RequestId,
    RequestSpec, RetentionPolicy, Tier, TokenRangeRetention,
};
use proptest::prelude::*;

const BS: u32 = 4;
const SALTS: [Option<&str>; 3] = [None, Some("a"), Some("b")];

#[derive(Clone, Debug)]
enum Op {
    /// A prompt: `len` tokens of base sequence `base` (shared prefixes), then `tail` tokens of
    /// its own; `salt` picks from [`SALTS`].
    Add {
        id: u8,
        base: u8,
        len: u8,
        tail: u8,
        salt: u8,
        host: bool,
        priority: u8,
        timed: bool,
        /// The default retention instead: one priority for every block, for ever.
        plain: bool,
    },
    Append {
        id: u8,
        token: u8,
        count: u8,
    },
    Commit {
        id: u8,
        fraction: u8,
    },
    Truncate {
        id: u8,
        keep: u8,
    },
    Release {
        id: u8,
    },
    Evict {
        group: u8,
        host: bool,
        count: u8,
    },
    Advance {
        ms: u16,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..8u8, 0..3u8, 1..40u8, 0..6u8, 0..3u8, prop::bool::weighted(0.2), 0..=100u8, any::<bool>(), any::<bool>())
            .prop_map(|(id, base, len, tail, salt, host, priority, timed, plain)| Op::Add {
                id, base, len, tail, salt, host, priority, timed, plain
            }),
        3 => (0..8u8, 1..200u8, 1..4u8).prop_map(|(id, token, count)| Op::Append { id, token, count }),
        2 => (0..8u8, 0..=4u8).prop_map(|(id, fraction)| Op::Commit { id, fraction }),
        1 => (0..8u8, 1..40u8).prop_map(|(id, keep)| Op::Truncate { id, keep }),
        3 => (0..8u8).prop_map(|id| Op::Release { id }),
        1 => (0..2u8, any::<bool>(), 1..4u8).prop_map(|(group, host, count)| Op::Evict { group, host, count }),
        1 => (0..3000u16).prop_map(|ms| Op::Advance { ms }),
    ]
}

/// What the test knows of a live request, independently of the manager.
struct Model {
    tokens: Vec<u32>,
    salt: Option<String>,
    tier: Tier,
}

fn config(copy_on_partial_reuse: bool, offload_min: Priority) -> KvCacheConfig {
    let mut cfg = KvCacheConfig::new(BS, 24, 12);
    cfg.copy_on_partial_reuse = copy_on_partial_reuse;
    cfg.secondary_offload_min_priority = offload_min;
    cfg.event_capacity = 64;
    cfg.groups.push(GroupConfig {
        window: Some(10),
        kv_heads: 2,
        primary_blocks: 20,
        secondary_blocks: 8,
    });
    cfg
}

fn prompt(base: u8, len: u8, tail: u8, id: u8) -> Vec<u32> {
    let base = u32::from(base);
    let mut t: Vec<u32> = (0..u32::from(len))
        .map(|i| 1 + base * 1000 + i % 7 * (base + 1) + i)
        .collect();
    t.extend((0..u32::from(tail)).map(|i| 50_000 + u32::from(id) * 100 + i));
    t
}

fn run(ops: &[Op], copy_on_partial_reuse: bool, offload_min: u8) -> Result<(), TestCaseError> {
    let clock = ManualClock::new();
    let offload_min = Priority::new(offload_min).expect("0..=100");
    let cfg = config(copy_on_partial_reuse, offload_min);
    let mut kv = KvCacheManager::with_clock(cfg, Arc::new(clock.clone())).expect("valid config");
    // The same operations without events: the tree then computes block hashes on demand
    // instead of keeping them, and keeps the stored blocks of requests with a plain retention
    // as lazy runs in the group without a window; everything observable must stay the same.
    let mut quiet_cfg = config(copy_on_partial_reuse, offload_min);
    quiet_cfg.event_capacity = 0;
    let mut quiet =
        KvCacheManager::with_clock(quiet_cfg, Arc::new(clock.clone())).expect("valid config");
    let mut live: BTreeMap<u8, Model> = BTreeMap::new();
    for (step, op) in ops.iter().enumerate() {
        let quiet_result = apply(&mut quiet, op, &live);
        let result: Result<(), KvError> = match *op {
            Op::Add { id, .. } => {
                let spec = add_spec(op).expect("invariant: matched as an Add");
                let (tokens, salt, tier) = (spec.tokens.clone(), spec.salt.clone(), spec.tier);
                let r = kv.add_request(spec);
                match (&r, live.contains_key(&id)) {
                    (Ok(out), false) => {
                        prop_assert!(
                            out.reused_tokens < tokens.len() as u32,
                            "the last token is never reused"
                        );
                        live.insert(id, Model { tokens, salt, tier });
                    }
                    (Err(KvError::DuplicateRequest(_)), true) => {}
                    (Err(KvError::OutOfBlocks { .. }), false) => {
                        prop_assert!(
                            !kv.contains(RequestId(id.into())),
                            "a failed add leaves nothing"
                        );
                    }
                    (other, was_live) => prop_assert!(false, "add of live={was_live}: {other:?}"),
                }
                r.map(drop)
            }
            Op::Append { id, token, count } => {
                let new = appended(token, count);
                let r = kv.append_tokens(RequestId(id.into()), &new);
                if r.is_ok() {
                    live.get_mut(&id)
                        .expect("append succeeded on a live request")
                        .tokens
                        .extend(&new);
                }
                r
            }
            Op::Commit { id, fraction } => match live.get(&id) {
                Some(m) => {
                    let n = m.tokens.len() as u32 * u32::from(fraction) / 4;
                    kv.commit_computed(RequestId(id.into()), n)
                }
                None => kv.commit_computed(RequestId(id.into()), 1),
            },
            Op::Truncate { id, keep } => {
                let r = kv.truncate(RequestId(id.into()), u32::from(keep));
                if r.is_ok() {
                    live.get_mut(&id)
                        .expect("truncate succeeded on a live request")
                        .tokens
                        .truncate(keep as usize);
                }
                r
            }
            Op::Release { id } => {
                let r = kv.release(RequestId(id.into())).map(drop);
                prop_assert_eq!(r.is_ok(), live.remove(&id).is_some());
                r
            }
            Op::Evict { group, host, count } => {
                let tier = if host { Tier::Secondary } else { Tier::Primary };
                kv.evict(GroupId(group.into()), tier, count.into())
                    .map(drop)
            }
            Op::Advance { ms } => {
                clock.advance(Duration::from_millis(ms.into()));
                Ok(())
            }
        };
        if let Err(e) = &result {
            let expected = matches!(
                e,
                KvError::OutOfBlocks { .. }
                    | KvError::UnknownRequest(_)
                    | KvError::DuplicateRequest(_)
                    | KvError::InvalidLength { .. }
            );
            prop_assert!(expected, "step {step} {op:?}: unexpected error {e}");
        }
        prop_assert_eq!(
            result.as_ref().err(),
            quiet_result.as_ref().err(),
            "step {} {:?}: with and without events",
            step,
            op
        );
        let transfers = check(&mut kv, &live)
            .map_err(|e| TestCaseError::fail(format!("step {step} {op:?}: {e}")))?;
        same(&kv, &mut quiet, &live, &transfers)
            .map_err(|e| TestCaseError::fail(format!("step {step} {op:?}: {e}")))?;
    }
    // Releasing everything returns every block to free or cached.
    for id in live.keys() {
        kv.release(RequestId((*id).into()))
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        quiet
            .release(RequestId((*id).into()))
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
    let transfers = check(&mut kv, &BTreeMap::new()).map_err(TestCaseError::fail)?;
    same(&kv, &mut quiet, &BTreeMap::new(), &transfers).map_err(TestCaseError::fail)?;
    for g in 0..kv.num_groups() {
        for tier in Tier::ALL {
            let u = kv.usage(GroupId(g), tier).expect("valid group");
            prop_assert_eq!(u.used, 0);
            prop_assert_eq!(u.free + u.cached, u.capacity);
        }
    }
    Ok(())
}

/// The invariants, checked from outside through the public API and inside through `audit`.
/// The tokens an [`Op::Append`] appends.
fn appended(token: u8, count: u8) -> Vec<u32> {
    (0..u32::from(count))
        .map(|i| u32::from(token) * 7 + i + 1)
        .collect()
}

/// The request an [`Op::Add`] adds (`None` for other operations): its prompt, salt, tier, and a
/// retention giving the first half of the base prompt its priority, for a while when `timed`.
fn add_spec(op: &Op) -> Option<RequestSpec> {
    let Op::Add {
        id,
        base,
        len,
        tail,
        salt,
        host,
        priority,
        timed,
        plain,
    } = *op
    else {
        return None;
    };
    let retention = if plain {
        RetentionPolicy::default()
    } else {
        RetentionPolicy {
            ranges: vec![TokenRangeRetention {
                start: 0,
                end: Some(u32::from(len) / 2),
                priority: Priority::new(priority).expect("0..=100"),
                duration: timed.then_some(Duration::from_millis(1500)),
            }],
            ..RetentionPolicy::default()
        }
    };
    let tier = if host { Tier::Secondary } else { Tier::Primary };
    let mut spec = RequestSpec::new(RequestId(id.into()), prompt(base, len, tail, id))
        .with_retention(retention)
        .in_tier(tier);
    spec.salt = SALTS[salt as usize].map(str::to_owned);
    Some(spec)
}

/// Applies `op` to `kv` as `run` does, without its checks (for the manager without events).
fn apply(kv: &mut KvCacheManager, op: &Op, live: &BTreeMap<u8, Model>) -> Result<(), KvError> {
    match *op {
        Op::Add { .. } => {
            let spec = add_spec(op).expect("invariant: matched as an Add");
            kv.add_request(spec).map(drop)
        }
        Op::Append { id, token, count } => {
            let new = appended(token, count);
            kv.append_tokens(RequestId(id.into()), &new)
        }
        Op::Commit { id, fraction } => {
            let n = live
                .get(&id)
                .map_or(1, |m| m.tokens.len() as u32 * u32::from(fraction) / 4);
            kv.commit_computed(RequestId(id.into()), n)
        }
        Op::Truncate { id, keep } => kv.truncate(RequestId(id.into()), u32::from(keep)),
        Op::Release { id } => kv.release(RequestId(id.into())).map(drop),
        Op::Evict { group, host, count } => {
            let tier = if host { Tier::Secondary } else { Tier::Primary };
            kv.evict(GroupId(group.into()), tier, count.into())
                .map(drop)
        }
        Op::Advance { .. } => Ok(()),
    }
}

/// The manager without events (`quiet`) agrees with `kv` on everything observable: statistics,
/// pool usage, block tables, the transfers (`kv`'s, as `check` took them) and every cached
/// block of a live table, its hash included.
fn same(
    kv: &KvCacheManager,
    quiet: &mut KvCacheManager,
    live: &BTreeMap<u8, Model>,
    transfers: &[kv_blocks::Transfer],
) -> Result<(), String> {
    quiet.audit()?;
    if kv.stats() != quiet.stats() {
        return Err(format!(
            "stats {:?} against {:?}",
            kv.stats(),
            quiet.stats()
        ));
    }
    if transfers != quiet.take_transfers() {
        return Err("transfers differ with and without events".to_owned());
    }
    for g in 0..kv.num_groups() {
        let group = GroupId(g);
        for tier in Tier::ALL {
            if kv.usage(group, tier).ok() != quiet.usage(group, tier).ok() {
                return Err(format!("group {g} {tier:?}: usage differs"));
            }
        }
        for &id in live.keys() {
            let rid = RequestId(id.into());
            let table = kv.block_table(rid, group).map_err(|e| e.to_string())?;
            if quiet.block_table(rid, group).ok() != Some(table) {
                return Err(format!("request {id} group {g}: block tables differ"));
            }
            let tier = kv.request_tier(rid).map_err(|e| e.to_string())?;
            for block in table.iter().flatten() {
                let loc = kv_blocks::BlockLoc {
                    tier,
                    block: *block,
                };
                if kv.cached_block(group, loc).ok() != quiet.cached_block(group, loc).ok() {
                    return Err(format!(
                        "request {id} group {g} block {block}: cached blocks differ"
                    ));
                }
            }
        }
    }
    Ok(())
}

fn check(
    kv: &mut KvCacheManager,
    live: &BTreeMap<u8, Model>,
) -> Result<Vec<kv_blocks::Transfer>, String> {
    // Pool accounting, tree links, evictable sets, refcount == tables holding the block.
    kv.audit()?;
    for g in 0..kv.num_groups() {
        let group = GroupId(g);
        for tier in Tier::ALL {
            let u = kv.usage(group, tier).map_err(|e| e.to_string())?;
            if u.free + u.used + u.cached != u.capacity {
                return Err(format!(
                    "group {g} {tier:?}: free + used + cached != capacity"
                ));
            }
        }
        for (&id, m) in live {
            let rid = RequestId(id.into());
            if kv.tokens(rid).map_err(|e| e.to_string())? != &m.tokens[..] {
                return Err(format!("request {id}: tokens differ from the model"));
            }
            let table = kv.block_table(rid, group).map_err(|e| e.to_string())?;
            if table.len() != m.tokens.len().div_ceil(BS as usize) {
                return Err(format!(
                    "request {id} group {g}: {} blocks for {} tokens",
                    table.len(),
                    m.tokens.len()
                ));
            }
            for (i, b) in table.iter().enumerate() {
                let Some(block) = b else { continue };
                let loc = kv_blocks::BlockLoc {
                    tier: m.tier,
                    block: *block,
                };
                // A cached block in a request's table holds exactly that request's tokens, under
                // the request's salt: reuse never crosses salts or mixes contents.
                if let Some(c) = kv.cached_block(group, loc).map_err(|e| e.to_string())? {
                    let want = &m.tokens[i * BS as usize..(i + 1) * BS as usize];
                    if c.tokens != want || c.index as usize != i || c.salt != m.salt {
                        return Err(format!(
                            "request {id} group {g} block {i}: cached key {c:?} is not the request's"
                        ));
                    }
                }
            }
        }
    }
    let transfers = kv.take_transfers();
    for t in &transfers {
        for loc in [t.src, t.dst] {
            kv.refcount(t.group, loc)
                .map_err(|e| format!("transfer {t:?}: {e}"))?;
        }
        if t.src == t.dst {
            return Err(format!("transfer onto itself: {t:?}"));
        }
    }
    let batch = kv.drain_events();
    if batch.events.len() > 64 {
        return Err("event buffer exceeded its capacity".to_owned());
    }
    Ok(transfers)
}

/// 192 cases by default (a few seconds in debug builds); `PROPTEST_CASES` raises it for soak runs.
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(192)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn invariants_hold_under_random_operations_copying(ops in prop::collection::vec(op(), 1..120)) {
        run(&ops, true, 35)?;
    }

    #[test]
    fn invariants_hold_under_random_operations_taking_over(ops in prop::collection::vec(op(), 1..120)) {
        run(&ops, false, 35)?;
    }

    /// Default-priority blocks are dropped rather than offloaded, so lazy runs lose their tails
    /// to eviction in both tiers.
    #[test]
    fn invariants_hold_when_evictions_drop(ops in prop::collection::vec(op(), 1..120)) {
        run(&ops, false, 60)?;
    }
}
