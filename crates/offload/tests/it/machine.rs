//! A proptest state machine over the manager: random requests, appends and steps, with the
//! HiSparse invariants checked after every step against an independent model.

use attn_op::KvCache;
use kv_blocks::RequestId;
use offload::{HostLayout, OffloadConfig, OffloadError, SparseKvCacheManager};
use proptest::prelude::*;

use crate::util::{config, token, tokens};

/// One operation on request `req % 3`.
#[derive(Clone, Debug)]
enum Op {
    Begin(u64),
    Append(u64, usize),
    Step(u64, usize, Vec<u16>),
    End(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..3u64).prop_map(Op::Begin),
        (0..3u64, 1..12usize).prop_map(|(r, n)| Op::Append(r, n)),
        (
            0..3u64,
            0..2usize,
            proptest::collection::vec(any::<u16>(), 0..8)
        )
            .prop_map(|(r, l, s)| Op::Step(r, l, s)),
        (0..3u64).prop_map(Op::End),
    ]
}

/// 64 cases by default; `PROPTEST_CASES` raises it for soak runs.
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

/// The model's view of a request: tokens per layer.
#[derive(Clone, Debug, Default)]
struct Model {
    lens: [usize; 2],
}

/// Runs `ops` on pages of `ps` tokens (1: token granularity) and a host pool of 160 tokens.
fn run(ops: &[Op], hot: usize, layout: HostLayout, ps: usize) -> Result<(), TestCaseError> {
    let host_pages = 160 / ps;
    let cfg = OffloadConfig {
        page_size: ps,
        ..config(hot, host_pages, layout)
    };
    let stride = cfg.kv_heads * cfg.head_dim;
    let mut m = SparseKvCacheManager::<f32>::new(cfg).expect("valid config");
    let mut live: std::collections::BTreeMap<u64, Model> = Default::default();
    for op in ops {
        match op {
            Op::Begin(r) => {
                let res = m.begin_request(RequestId(*r));
                prop_assert_eq!(res.is_ok(), !live.contains_key(r));
                if res.is_ok() {
                    live.insert(*r, Model::default());
                }
            }
            Op::End(r) => {
                prop_assert_eq!(
                    m.end_request(RequestId(*r)).is_ok(),
                    live.remove(r).is_some()
                );
            }
            Op::Append(r, n) => {
                let Some(model) = live.get_mut(r) else {
                    prop_assert!(matches!(
                        m.append(RequestId(*r), 0, &[], &[]),
                        Err(OffloadError::UnknownRequest(_))
                    ));
                    continue;
                };
                for layer in 0..2 {
                    let start = model.lens[layer];
                    let free = m.free_host_pages();
                    let res = m.append(
                        RequestId(*r),
                        layer,
                        &tokens(*r, layer, start, *n, 0, stride),
                        &tokens(*r, layer, start, *n, 1, stride),
                    );
                    match res {
                        Ok(()) => model.lens[layer] += n,
                        Err(OffloadError::HostExhausted { .. }) => {
                            // Nothing lost: the request and the pool are as they were.
                            prop_assert_eq!(m.free_host_pages(), free);
                            prop_assert_eq!(m.len(RequestId(*r), layer).expect("live"), start);
                        }
                        Err(e) => return Err(TestCaseError::fail(format!("append: {e}"))),
                    }
                }
            }
            Op::Step(r, layer, raw) => {
                let Some(model) = live.get(r) else { continue };
                let len = model.lens[*layer];
                if len == 0 {
                    continue;
                }
                let pages = len.div_ceil(ps);
                let mut sel: Vec<i32> = raw.iter().map(|&x| i32::from(x) % pages as i32).collect();
                sel.push(pages as i32 - 1);
                sel.sort_unstable();
                sel.dedup();
                let id = RequestId(*r);
                let before = m.hot_buffer(id, *layer).expect("live").clone();
                let current = pages as i32 - 1;
                let others = sel.iter().filter(|&&p| p != current).count();
                let plan = match m.step(id, *layer, &sel) {
                    Err(OffloadError::HotTooSmall { .. }) => {
                        prop_assert!(others > hot);
                        prop_assert_eq!(m.hot_buffer(id, *layer).expect("live"), &before);
                        continue;
                    }
                    other => other.expect("a valid step"),
                };
                let after = m.hot_buffer(id, *layer).expect("live");
                // The LRU order stays a permutation of the slots.
                let mut lru = after.lru().to_vec();
                lru.sort_unstable();
                prop_assert_eq!(lru, (0..hot as u32).collect::<Vec<_>>());
                // Hits are never reloaded; loads equal misses.
                let resident: Vec<i32> = before
                    .slot_pages()
                    .iter()
                    .copied()
                    .filter(|&p| p >= 0)
                    .collect();
                let expected_misses: Vec<i32> = sel
                    .iter()
                    .copied()
                    .filter(|p| *p != current && !resident.contains(p))
                    .collect();
                prop_assert_eq!(plan.stats.misses as usize, expected_misses.len());
                prop_assert_eq!(plan.stats.hits as usize, sel.len() - expected_misses.len());
                let page_loads = plan
                    .loads
                    .iter()
                    .filter(|l| l.device_block as usize % (hot + 1) != hot)
                    .count();
                prop_assert_eq!(page_loads, expected_misses.len());
                // Every selected page is resident, nothing selected was evicted, and the device
                // bytes equal the host bytes (the expected token values).
                let device = m.device(*layer);
                let device = device.read();
                let layout = device.layout();
                for (i, &p) in sel.iter().enumerate() {
                    let block = plan.block_table[i] as usize;
                    if p == current {
                        prop_assert_eq!(block % (hot + 1), hot);
                    } else {
                        prop_assert_eq!(after.slot_pages()[block % (hot + 1)], p);
                    }
                    let valid = (len - p as usize * ps).min(ps);
                    for t in 0..valid {
                        let o = (block * ps + t) * layout.token_stride();
                        let pos = p as usize * ps + t;
                        prop_assert_eq!(
                            &device.k()[o..o + stride],
                            &token(*r, *layer, pos, 0, stride)[..]
                        );
                        prop_assert_eq!(
                            &device.v()[o..o + stride],
                            &token(*r, *layer, pos, 1, stride)[..]
                        );
                    }
                }
                prop_assert_eq!(
                    plan.seq_len,
                    (sel.len() - 1) * ps + (len - (pages - 1) * ps)
                );
            }
        }
    }
    for r in live.keys() {
        m.end_request(RequestId(*r)).expect("live");
    }
    prop_assert_eq!(
        m.free_host_pages(),
        host_pages,
        "the host pool frees everything at request end"
    );
    prop_assert_eq!(m.num_requests(), 0);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn hot_buffers_keep_the_hisparse_invariants(
        ops in proptest::collection::vec(op(), 1..60),
        hot in 2..7usize,
        layout in prop_oneof![Just(HostLayout::LayerFirst), Just(HostLayout::PageFirst), Just(HostLayout::PageHead)],
        ps in prop_oneof![Just(1usize), Just(4)],
    ) {
        run(&ops, hot, layout, ps)?;
    }
}
