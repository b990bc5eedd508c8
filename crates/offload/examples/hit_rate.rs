//! Hit rate of the hot buffer versus its size, on Quest selections over a synthetic drifting
//! decode trace.
//!
//! `cargo run --release -p offload --example hit_rate` prints a Markdown table.
//!
//! The trace (fixed seed): one sequence of a 32K-token prompt and 256 decode steps, 32 query /
//! 8 KV heads, head dim 128, f32 keys. The context is cut into segments of 64–512 tokens, each
//! about one of 64 topics per KV head (a key is its topic plus noise). Each decode query mixes
//! three topics; every 32 steps one of them is swapped for another over 8 steps (the focus of
//! a generation drifts), and each generated token's key is about the query's topics. Quest
//! (pages of 16, budget 2048 tokens, so 128 pages per KV head) selects every step; its
//! representations grow with the decode. Each KV head's selection is diffed against its own
//! hot buffer of HOT tokens (HiSparse: HOT >= top-k); Quest with `shared_heads` gives one
//! selection, diffed against one buffer of whole pages per layer, as the offload manager does.
#![allow(clippy::print_stdout, reason = "an example that prints its table")]

use attn_op::{KvCache, KvLayout, PagedKv};
use offload::{HotBuffer, StepStats};
use proptest::prelude::RngExt;
use proptest::test_runner::{RngAlgorithm, TestRng};
use sparse_algo::{AlgoError, Decode, PagedKeys, Quest, QuestConfig, RepPool, SparseAlgorithm};

const PROMPT: usize = 32 * 1024;
const STEPS: usize = 256;
const KVH: usize = 8;
const GROUP: usize = 4;
const QH: usize = KVH * GROUP;
const D: usize = 128;
const PS: usize = 16;
const TOPICS: usize = 64;
const BUDGET: usize = 2048;
const HOTS: [usize; 3] = [2048, 4096, 8192];

fn main() -> Result<(), AlgoError> {
    let mut rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[0x5e; 32]);
    let mut noise = |n: usize, scale: f32| -> Vec<f32> {
        (0..n)
            .map(|_| scale * (rng.random_range(-1.0f32..1.0) + rng.random_range(-1.0f32..1.0)))
            .collect()
    };
    let topics: Vec<Vec<f32>> = (0..KVH * TOPICS).map(|_| noise(D, 1.0)).collect();
    let mut pick = TestRng::from_seed(RngAlgorithm::ChaCha, &[0x7a; 32]);
    let total = PROMPT + STEPS;
    let layout = KvLayout {
        num_blocks: total.div_ceil(PS),
        block_size: PS,
        kv_heads: KVH,
        head_dim: D,
    };
    let mut kv = PagedKv::<f32>::new(layout).map_err(|e| AlgoError::Invalid(e.to_string()))?;
    let table: Vec<i32> = (0..layout.num_blocks as i32).collect();
    // A key about `topic` (per head) plus noise.
    let key = |topic: &dyn Fn(usize) -> Vec<f32>, noise: &mut dyn FnMut(usize, f32) -> Vec<f32>| {
        (0..KVH)
            .flat_map(|h| {
                let t = topic(h);
                let n = noise(D, 0.5);
                t.iter().zip(n).map(|(a, b)| a + b).collect::<Vec<_>>()
            })
            .collect::<Vec<f32>>()
    };
    let mut pos = 0;
    while pos < PROMPT {
        let n = pick.random_range(64..=512).min(PROMPT - pos);
        let topic = pick.random_range(0..TOPICS);
        for p in pos..pos + n {
            let k = key(&|h| topics[h * TOPICS + topic].clone(), &mut noise);
            write(&mut kv, p, &k)?;
        }
        pos += n;
    }
    let quest = Quest::new(QuestConfig {
        page_size: PS,
        budget_tokens: BUDGET,
        ..Default::default()
    })?;
    let shared = Quest::new(QuestConfig {
        page_size: PS,
        budget_tokens: BUDGET,
        shared_heads: true,
        ..Default::default()
    })?;
    let mut pool = RepPool::new(quest.rep_shape(KVH, D), 1, 1, total)?;
    let mut active: [usize; 3] = [0, 1, 2].map(|_| pick.random_range(0..TOPICS));
    let mut incoming = pick.random_range(0..TOPICS);
    // Per mode (per-head selections, one buffer per KV head; one shared selection, one buffer
    // per layer) and HOT size: the buffers and their counts.
    let mut buffers: Vec<Vec<HotBuffer>> = [KVH, 1]
        .iter()
        .flat_map(|&n| {
            HOTS.iter()
                .map(move |&hot| vec![HotBuffer::new(hot / PS); n])
        })
        .collect();
    let mut stats = vec![StepStats::default(); 2 * HOTS.len()];
    let mut after_first = stats.clone();
    let mut union_pages = 0usize;
    for s in 0..STEPS {
        // The focus drifts: every 32 steps the first topic fades out over 8 steps.
        let phase = s % 32;
        let fade = if phase >= 24 {
            (phase - 23) as f32 / 8.0
        } else {
            0.0
        };
        if phase == 0 && s > 0 {
            active[0] = incoming;
            active.rotate_left(1);
            incoming = pick.random_range(0..TOPICS);
        }
        let mix = |h: usize| -> Vec<f32> {
            let t = |i: usize| &topics[h * TOPICS + i];
            (0..D)
                .map(|d| {
                    (1.0 - fade) * t(active[0])[d]
                        + t(active[1])[d]
                        + t(active[2])[d]
                        + fade * t(incoming)[d]
                })
                .collect()
        };
        let len = PROMPT + s + 1;
        let k = key(&|h| mix(h).iter().map(|x| x / 2.0).collect(), &mut noise);
        write(&mut kv, len - 1, &k)?;
        let lens = [len as i32];
        let keys = PagedKeys::new(&kv, &lens, &table, table.len())?;
        if s == 0 {
            quest.construct_representations(0, &keys, &[0], &mut pool)?;
        } else {
            quest.update_representations(0, &keys, &[0], &mut pool)?;
        }
        let q: Vec<f32> = (0..QH)
            .flat_map(|j| {
                let m = mix(j / GROUP);
                let n = noise(D, 0.3);
                m.iter().zip(n).map(|(a, b)| a + b).collect::<Vec<_>>()
            })
            .collect();
        let step = Decode {
            layer: 0,
            q: &q,
            q_heads: QH,
            kv_heads: KVH,
            head_dim: D,
            seq_lens: &[len],
            slots: &[0],
            keys: None,
        };
        let top = quest.retrieve_topk(&step, &pool)?;
        let one = shared.retrieve_topk(&step, &pool)?;
        let current = ((len - 1) / PS) as i32;
        let mut union: Vec<i32> = (0..KVH).flat_map(|h| top.row(0, h).to_vec()).collect();
        union.sort_unstable();
        union.dedup();
        union_pages += union.len();
        if s == 1 {
            after_first.clone_from(&stats);
        }
        for (bufs, st) in buffers.iter_mut().zip(&mut stats) {
            // A page of one head, or of every head, K and V in bf16.
            let (sel, page_bytes) = if bufs.len() == KVH {
                (&top, PS * 2 * D * 2)
            } else {
                (&one, PS * 2 * KVH * D * 2)
            };
            for (h, buf) in bufs.iter_mut().enumerate() {
                let diff = buf.diff(sel.row(0, h), current);
                st.add(&StepStats {
                    steps: 1,
                    hits: u64::from(diff.hits),
                    misses: diff.misses.len() as u64,
                    loaded_pages: diff.misses.len() as u64,
                    bytes: (diff.misses.len() * page_bytes) as u64,
                    ..Default::default()
                });
            }
        }
    }
    println!(
        "Quest (pages of {PS}, budget {BUDGET} tokens) over a drifting synthetic trace: \
         {PROMPT}-token prompt, {STEPS} decode steps, {QH} q / {KVH} kv heads, D {D}. \
         Per-head selections go to one hot buffer per KV head (their union averages {:.0} \
         pages per step); a selection shared by the heads goes to one buffer per layer of \
         whole pages (what the offload manager moves).\n",
        union_pages as f64 / STEPS as f64
    );
    println!(
        "| selection | HOT (tokens) | HOT / top-k | hit rate | hit rate after step 1 | \
         pages loaded per buffer-step | KiB per layer-step (bf16 K+V) |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    for (i, (st, first)) in stats.iter().zip(&after_first).enumerate() {
        let hot = HOTS[i % HOTS.len()];
        let mode = if i < HOTS.len() {
            "per KV head"
        } else {
            "shared by the heads"
        };
        // The first step loads every selected page; the rest is the steady state.
        let (hits, misses) = (st.hits - first.hits, st.misses - first.misses);
        let steady = hits as f64 / (hits + misses) as f64;
        println!(
            "| {mode} | {hot} | {:.0}x | {:.3} | {:.3} | {:.1} | {:.0} |",
            hot as f64 / BUDGET as f64,
            st.hit_rate(),
            steady,
            st.loaded_pages as f64 / st.steps as f64,
            st.bytes as f64 / STEPS as f64 / 1024.0
        );
    }
    Ok(())
}
/// Writes the key of position `pos` (V stays zero: hit rates read keys only).
fn write(kv: &mut PagedKv<f32>, pos: usize, k: &[f32]) -> Result<(), AlgoError> {
    let v = vec![0.0; k.len()];
    kv.set_kv(&[pos as i32], k, &v)
        .map_err(|e| AlgoError::Invalid(e.to_string()))
}
