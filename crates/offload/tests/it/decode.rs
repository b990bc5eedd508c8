//! A multi-layer CPU decode loop: the hierarchical path (host pool + hot buffer + diff) against
//! in-memory sparse attention with the same selections, and against dense attention.

use attn_op::{
    AttnOut, AttnParams, BatchMeta, KvCache, KvLayout, PagedKv, paged_attention,
    sparse_page_attention,
};
use kv_blocks::RequestId;
use offload::{HostAlloc, HostLayout, OffloadConfig, SparseKvCacheManager, StepStats};
use sparse_algo::{Decode, PagedKeys, Quest, QuestConfig, RepPool, SparseAlgorithm, TopK};

use crate::util::token;

const LAYERS: usize = 3;
const KVH: usize = 2;
const GROUP: usize = 2;
const D: usize = 16;
const PS: usize = 4;
const PROMPT: usize = 101;
const STEPS: usize = 24;
const MAX: usize = PROMPT + STEPS;
const STRIDE: usize = KVH * D;

/// The reference: every layer's full KV in memory (block `i` holds page `i`).
struct Reference {
    kv: Vec<PagedKv<f32>>,
    table: Vec<i32>,
}

impl Reference {
    fn new() -> Self {
        let layout = KvLayout {
            num_blocks: MAX.div_ceil(PS),
            block_size: PS,
            kv_heads: KVH,
            head_dim: D,
        };
        Reference {
            kv: (0..LAYERS)
                .map(|_| PagedKv::new(layout).expect("valid"))
                .collect(),
            table: (0..MAX.div_ceil(PS) as i32).collect(),
        }
    }
}

/// A scaled token so attention weights differ (the shared helper's values are large).
fn scaled(layer: usize, pos: usize, which: usize) -> Vec<f32> {
    token(9, layer, pos, which, STRIDE)
        .iter()
        .map(|x| (x % 17.0 - 8.0) / 8.0)
        .collect()
}

/// The query of step `s`, `[q_heads, D]`.
fn query(layer: usize, s: usize) -> Vec<f32> {
    (0..KVH * GROUP * D)
        .map(|i| (((i * 7 + s * 13 + layer * 5) % 23) as f32 - 11.0) / 11.0)
        .collect()
}

/// Runs the loop with a Quest budget; returns the totals and checks every step's outputs.
/// With `write_through`, each step runs as an engine does: the step is planned before the new
/// token's append, the token is written into its device slot, then appended for the backup.
fn run(
    budget_tokens: usize,
    hot_pages: usize,
    layout: HostLayout,
    write_through: bool,
) -> (StepStats, Vec<Vec<u32>>) {
    let cfg = OffloadConfig {
        page_size: PS,
        hot_pages,
        layers: LAYERS,
        kv_heads: KVH,
        head_dim: D,
        host_pages: MAX.div_ceil(PS),
        max_requests: 1,
        layout,
        host_alloc: HostAlloc::Own,
    };
    let mut m = SparseKvCacheManager::<f32>::new(cfg).expect("valid config");
    let id = RequestId(1);
    m.begin_request(id).expect("free buffer");
    let mut reference = Reference::new();
    let quest = Quest::new(QuestConfig {
        page_size: PS,
        budget_tokens,
        ..Default::default()
    })
    .expect("valid");
    let params = AttnParams::new(KVH * GROUP, D);
    // Prefill: the prompt's KV goes to the reference and to the host pool.
    for l in 0..LAYERS {
        let (k, v): (Vec<f32>, Vec<f32>) = (
            (0..PROMPT).flat_map(|p| scaled(l, p, 0)).collect(),
            (0..PROMPT).flat_map(|p| scaled(l, p, 1)).collect(),
        );
        let slots: Vec<i32> = (0..PROMPT as i32).collect();
        reference.kv[l].set_kv(&slots, &k, &v).expect("in range");
        m.append(id, l, &k, &v).expect("host room");
    }
    let mut totals = StepStats::default();
    let mut model_lru: Vec<Vec<u32>> = vec![Vec::new(); LAYERS];
    #[allow(
        clippy::needless_range_loop,
        reason = "l indexes several per-layer arrays"
    )]
    for s in 0..STEPS {
        let len = PROMPT + s + 1;
        for l in 0..LAYERS {
            let pos = len - 1;
            let (k, v) = (scaled(l, pos, 0), scaled(l, pos, 1));
            reference.kv[l]
                .set_kv(&[pos as i32], &k, &v)
                .expect("in range");
            if !write_through {
                m.append(id, l, &k, &v).expect("host room");
            }
            // Select with Quest over the reference keys.
            let lens = [len as i32];
            let keys = PagedKeys::new(
                &reference.kv[l],
                &lens,
                &reference.table,
                reference.table.len(),
            )
            .expect("valid");
            let mut pool = RepPool::new(quest.rep_shape(KVH, D), 1, 1, MAX).expect("pool");
            quest
                .construct_representations(0, &keys, &[0], &mut pool)
                .expect("construct");
            let q = query(l, s);
            let step = Decode {
                layer: 0,
                q: &q,
                q_heads: KVH * GROUP,
                kv_heads: KVH,
                head_dim: D,
                seq_lens: &[len],
                slots: &[0],
                keys: None,
            };
            let top = quest.retrieve_topk(&step, &pool).expect("select");
            let mut union: Vec<i32> = (0..KVH).flat_map(|h| top.row(0, h).to_vec()).collect();
            union.sort_unstable();
            union.dedup();
            let plan = if write_through {
                let plan = m.step_with_new(id, l, &union, 1).expect("a valid step");
                m.device(l)
                    .write()
                    .set_kv(&plan.new_slots, &k, &v)
                    .expect("slots in the pool");
                m.append(id, l, &k, &v).expect("host room");
                plan
            } else {
                m.step(id, l, &union).expect("a valid step")
            };
            // Independent count: an LRU of pages kept by the test, oldest first.
            let lru = &mut model_lru[l];
            let current = ((len - 1) / PS) as u32;
            let mut hits = 0u64;
            let mut misses = 0u64;
            for &p in &union {
                let p = p as u32;
                if p == current || lru.contains(&p) {
                    hits += 1;
                } else {
                    misses += 1;
                }
            }
            let mut order: Vec<u32> = lru
                .iter()
                .copied()
                .filter(|p| !union.contains(&(*p as i32)))
                .collect();
            let evict = (order.len() + union.iter().filter(|&&p| p as u32 != current).count())
                .saturating_sub(hot_pages);
            order.drain(..evict);
            let new: Vec<u32> = union
                .iter()
                .map(|&p| p as u32)
                .filter(|&p| p != current && !lru.contains(&p))
                .collect();
            let kept: Vec<u32> = lru
                .iter()
                .copied()
                .filter(|p| union.contains(&(*p as i32)) && *p != current)
                .collect();
            order.extend(new);
            order.extend(kept);
            *lru = order;
            assert_eq!(
                (plan.stats.hits, plan.stats.misses),
                (hits, misses),
                "layer {l} step {s}"
            );
            totals.add(&plan.stats);
            // Attention: hierarchical (device pool, compact table, per-head ids) vs in memory.
            let ids: Vec<Vec<i32>> = (0..KVH)
                .map(|h| {
                    top.row(0, h)
                        .iter()
                        .map(|p| union.binary_search(p).expect("in the union") as i32)
                        .collect()
                })
                .collect();
            let width = union.len();
            let compact = TopK::from_rows(&ids, KVH, PS);
            let device = m.device(l);
            let device = device.read();
            let compact_len = [plan.seq_len as i32];
            let meta = BatchMeta {
                cu_seqlens_q: &[0, 1],
                seq_lens_kv: &compact_len,
                block_table: &plan.block_table,
                max_blocks: width,
            };
            let mut ours = vec![0.0f32; q.len()];
            let mut ours_lse = vec![0.0f32; KVH * GROUP];
            sparse_page_attention(
                &q,
                &device,
                &meta,
                &compact.as_selection(),
                &params,
                AttnOut {
                    out: &mut ours,
                    lse: Some(&mut ours_lse),
                },
            )
            .expect("valid");
            let full_meta = BatchMeta {
                cu_seqlens_q: &[0, 1],
                seq_lens_kv: &lens,
                block_table: &reference.table,
                max_blocks: reference.table.len(),
            };
            let mut theirs = vec![0.0f32; q.len()];
            let mut theirs_lse = vec![0.0f32; KVH * GROUP];
            sparse_page_attention(
                &q,
                &reference.kv[l],
                &full_meta,
                &top.as_selection(),
                &params,
                AttnOut {
                    out: &mut theirs,
                    lse: Some(&mut theirs_lse),
                },
            )
            .expect("valid");
            assert_eq!(
                ours, theirs,
                "layer {l} step {s}: hierarchical differs from in-memory sparse"
            );
            assert_eq!(ours_lse, theirs_lse);
            if budget_tokens >= MAX {
                let mut dense = vec![0.0f32; q.len()];
                paged_attention(
                    &q,
                    &reference.kv[l],
                    &full_meta,
                    &params,
                    AttnOut {
                        out: &mut dense,
                        lse: None,
                    },
                )
                .expect("valid");
                assert_eq!(
                    ours, dense,
                    "layer {l} step {s}: a full budget differs from dense"
                );
            }
        }
    }
    let loaded_tokens: u64 = totals.bytes / (2 * STRIDE * 4) as u64;
    assert_eq!(
        loaded_tokens,
        totals.loaded_pages * PS as u64 + reserved_tokens(&totals, write_through),
        "bytes match the loads"
    );
    m.end_request(id).expect("live");
    assert_eq!(m.free_host_pages(), MAX.div_ceil(PS));
    (totals, model_lru)
}

/// Tokens moved by reserved-slot refreshes: once per layer at the first step, the prompt's
/// partial last page, and the first decode token if it was appended before the reserved slot
/// existed. Later tokens are written straight into the reserved slot.
fn reserved_tokens(t: &StepStats, write_through: bool) -> u64 {
    assert_eq!(
        t.reserved_loads, LAYERS as u64,
        "one refresh per layer, after the prompt"
    );
    (LAYERS * (PROMPT % PS + usize::from(!write_through))) as u64
}

#[test]
fn hierarchical_sparse_equals_in_memory_sparse() {
    let (t, _) = run(32, 16, HostLayout::LayerFirst, false);
    assert!(t.misses > 0 && t.hits > t.misses, "a realistic mix: {t:?}");
}

#[test]
fn planning_before_the_append_writes_new_tokens_through() {
    let (a, lru_a) = run(32, 16, HostLayout::LayerFirst, false);
    let (b, lru_b) = run(32, 16, HostLayout::LayerFirst, true);
    assert_eq!(
        (a.hits, a.misses, a.loaded_pages),
        (b.hits, b.misses, b.loaded_pages)
    );
    assert_eq!(lru_a, lru_b);
    assert_eq!(
        a.bytes - b.bytes,
        (LAYERS * 2 * STRIDE * 4) as u64,
        "only the first decode token's reserved-slot load is saved"
    );
}

#[test]
fn a_full_budget_equals_dense() {
    let (t, _) = run(MAX + PS, MAX.div_ceil(PS), HostLayout::PageFirst, true);
    // Every page is loaded once, then always hits.
    assert_eq!(
        t.loaded_pages as usize,
        LAYERS * (PROMPT.div_ceil(PS) - 1 + (PROMPT + STEPS - 1) / PS - PROMPT / PS)
    );
}

#[test]
fn the_three_host_layouts_give_identical_loads() {
    let a = run(32, 12, HostLayout::LayerFirst, false);
    let b = run(32, 12, HostLayout::PageFirst, false);
    let c = run(32, 12, HostLayout::PageHead, false);
    assert_eq!(a, b);
    assert_eq!(a, c);
}
