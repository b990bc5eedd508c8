//! Planted needles: random keys plus a few keys aligned with the query; every algorithm that
//! scores must find them within a small budget.

use std::sync::Arc;

use attn_op::DType;
use half::bf16;
use sparse_algo::metrics::{mass_recall, mean, output_error, topk_recall};
use sparse_algo::{
    AlgoConfig, AlgoError, Dsa, DsaConfig, Indexer, OracleConfig, Prompt, QuestConfig, RepPool,
    RocketConfig, SnapKvConfig, SparseAlgorithm, StreamingConfig, TopK,
};

use crate::util::{Case, Rng};

const KV_HEADS: usize = 2;
const GROUP: usize = 2;
const D: usize = 64;
const LEN: usize = 3000;

/// Two sequences of `LEN` tokens: small random keys, and at each needle position every KV head's
/// key is twice its group's query direction. Queries are their direction plus noise.
struct Needles {
    case: Case<bf16>,
    needles: Vec<Vec<usize>>,
    /// `[num_seqs, window, q_heads, D]`: prompt queries of the last 32 positions, also aligned.
    window_q: Vec<f32>,
}

fn needles(seed: u64) -> Needles {
    let mut rng = Rng::new(seed);
    let q_heads = KV_HEADS * GROUP;
    let stride = KV_HEADS * D;
    let mut keys = Vec::new();
    let mut q = Vec::new();
    let mut window_q = Vec::new();
    let mut planted = Vec::new();
    for _ in 0..2 {
        let dirs: Vec<Vec<f32>> = (0..KV_HEADS).map(|_| rng.vec(D, 1.0)).collect();
        let mut k = rng.vec(LEN * stride, 0.5);
        let mut pos: Vec<usize> = (0..3).map(|_| rng.range(40, LEN - 200)).collect();
        pos.sort_unstable();
        pos.dedup();
        for &p in &pos {
            for (h, dir) in dirs.iter().enumerate() {
                for (x, &u) in k[p * stride + h * D..p * stride + (h + 1) * D]
                    .iter_mut()
                    .zip(dir)
                {
                    *x = 2.0 * u;
                }
            }
        }
        let mut aligned = |n: usize| -> Vec<f32> {
            (0..n)
                .flat_map(|_| {
                    (0..q_heads)
                        .flat_map(|j| dirs[j / GROUP].clone())
                        .collect::<Vec<_>>()
                })
                .map(|x| x + 0.1 * rng.unit())
                .collect()
        };
        q.extend(aligned(1));
        window_q.extend(aligned(32));
        keys.push(k);
        planted.push(pos);
    }
    let case = Case::new(&keys, q, q_heads, KV_HEADS, D, 32, &mut rng);
    Needles {
        case,
        needles: planted,
        window_q,
    }
}

/// Runs a decode algorithm end to end: pool, construction, selection.
fn select(algo: &dyn SparseAlgorithm, n: &Needles) -> TopK {
    let keys = n.case.keys();
    let mut pool = RepPool::new(algo.rep_shape(KV_HEADS, D), 1, 2, LEN).expect("pool");
    algo.construct_representations(0, &keys, &n.case.slots, &mut pool)
        .expect("construction");
    let top = algo
        .retrieve_topk(&n.case.step(Some(&keys)), &pool)
        .expect("selection");
    // Determinism: the same inputs give the same selection.
    assert_eq!(
        top,
        algo.retrieve_topk(&n.case.step(Some(&keys)), &pool)
            .expect("again")
    );
    top
}

/// Asserts that every needle's token is covered by every KV head's row.
fn check_found(name: &str, top: &TopK, n: &Needles) {
    let tokens = top.to_tokens(&n.case.ulens);
    for (s, pos) in n.needles.iter().enumerate() {
        for h in 0..KV_HEADS {
            for &p in pos {
                assert!(
                    tokens.row(s, h).binary_search(&(p as i32)).is_ok(),
                    "{name}: sequence {s} head {h} misses the needle at {p}: {:?}",
                    top.row(s, h)
                );
            }
        }
    }
}

#[test]
fn every_scoring_algorithm_finds_the_needles() {
    let n = needles(7);
    let check = |name: &str, config: AlgoConfig, budget_tokens: usize| {
        let algo = config.build(None).expect("valid config");
        let top = select(algo.as_ref(), &n);
        for r in 0..top.lens.len() {
            let tokens = top.row(r / KV_HEADS, r % KV_HEADS).len() * top.page_size;
            assert!(
                tokens <= budget_tokens,
                "{name}: row {r} takes {tokens} tokens"
            );
        }
        check_found(name, &top, &n);
    };
    check(
        "quest",
        AlgoConfig::Quest(QuestConfig {
            budget_tokens: 128,
            ..Default::default()
        }),
        128,
    );
    check(
        "rocketkv",
        AlgoConfig::RocketKv(RocketConfig::default()),
        64,
    );
    check(
        "dsa fallback",
        AlgoConfig::Dsa(DsaConfig {
            topk: 32,
            ..Default::default()
        }),
        32,
    );
    check(
        "oracle",
        AlgoConfig::Oracle(OracleConfig {
            budget_tokens: 128,
            ..Default::default()
        }),
        128,
    );
    check(
        "oracle, tokens",
        AlgoConfig::Oracle(OracleConfig {
            page_size: 1,
            budget_tokens: 16,
            ..Default::default()
        }),
        16,
    );
}

/// A trained indexer stand-in: the indexer keys are KV head 0's keys, the indexer queries are
/// the query heads of group 0, all of weight 1.
struct HeadZero {
    keys: Vec<Vec<f32>>,
    q: Vec<Vec<f32>>,
}

impl Indexer for HeadZero {
    fn heads(&self) -> usize {
        GROUP
    }

    fn dim(&self) -> usize {
        D
    }

    fn keys(&self, _layer: usize, seq: usize, start: usize, dst: &mut [f32]) {
        dst.copy_from_slice(&self.keys[seq][start * D..start * D + dst.len()]);
    }

    fn queries(&self, _layer: usize, seq: usize, q: &mut [f32], weights: &mut [f32]) {
        q.copy_from_slice(&self.q[seq]);
        weights.fill(1.0);
    }
}

#[test]
fn a_trained_indexer_finds_the_needles() {
    let n = needles(11);
    let keys = n.case.keys();
    let ix = HeadZero {
        keys: (0..2)
            .map(|s| (0..LEN).flat_map(|t| n.case.key(s, t, 0)).collect())
            .collect(),
        q: (0..2)
            .map(|s| {
                n.case.q[s * KV_HEADS * GROUP * D..(s * KV_HEADS * GROUP + GROUP) * D].to_vec()
            })
            .collect(),
    };
    let dsa = Dsa::new(
        DsaConfig {
            topk: 16,
            ..Default::default()
        },
        Some(Arc::new(ix)),
    )
    .expect("valid");
    assert!(!dsa.caps().reads_keys);
    let mut pool = RepPool::new(dsa.rep_shape(KV_HEADS, D), 1, 2, LEN).expect("pool");
    dsa.construct_representations(0, &keys, &n.case.slots, &mut pool)
        .expect("construct");
    // Indexer keys are not bounds: a bf16 pool is refused with a typed error.
    let mut narrow =
        RepPool::with_elem(dsa.rep_shape(KV_HEADS, D), DType::BF16, 1, 2, LEN).expect("pool");
    let refused = dsa.construct_representations(0, &keys, &n.case.slots, &mut narrow);
    assert!(
        matches!(refused, Err(AlgoError::Invalid(_))),
        "a bf16 pool for indexer keys: {refused:?}"
    );
    let top = dsa
        .retrieve_topk(&n.case.step(None), &pool)
        .expect("select");
    assert!(top.row(0, 0).len() <= 16);
    assert_eq!(
        top.row(0, 0),
        top.row(0, 1),
        "DSA rows are shared by every KV head"
    );
    check_found("dsa indexer", &top, &n);
}

#[test]
fn streaming_llm_selects_exactly_sinks_and_window() {
    let n = needles(3);
    let algo = AlgoConfig::StreamingLlm(StreamingConfig {
        sink_tokens: 4,
        window_tokens: 60,
        page_size: 1,
    })
    .build(None)
    .expect("valid");
    let top = select(algo.as_ref(), &n);
    let expected: Vec<i32> = (0..4).chain(LEN as i32 - 60..LEN as i32).collect();
    for r in 0..top.lens.len() {
        assert_eq!(top.row(r / KV_HEADS, r % KV_HEADS), &expected[..]);
    }
}

#[test]
fn snapkv_and_rocketkv_keep_the_voted_tokens() {
    let n = needles(5);
    let keys = n.case.keys();
    let cu = [0, 32, 64];
    let prompt = Prompt {
        layer: 0,
        q: &n.window_q,
        cu_q: &cu,
        q_heads: KV_HEADS * GROUP,
        keys: &keys,
    };
    for (name, config, capacity) in [
        (
            "snapkv",
            AlgoConfig::SnapKv(SnapKvConfig {
                capacity: 64,
                ..Default::default()
            }),
            64,
        ),
        (
            "rocketkv",
            AlgoConfig::RocketKv(RocketConfig {
                prompt_budget: 256,
                ..Default::default()
            }),
            256,
        ),
    ] {
        let keep = config
            .build(None)
            .expect("valid")
            .predict_keep(&prompt)
            .expect("keep");
        assert_eq!(keep.page_size, 1);
        for s in 0..2 {
            for h in 0..KV_HEADS {
                let row = keep.row(s, h);
                assert_eq!(row.len(), capacity, "{name}: every head keeps the capacity");
                assert!(row.windows(2).all(|w| w[0] < w[1]), "{name}: ascending");
                assert!(row.ends_with(&(LEN as i32 - 32..LEN as i32).collect::<Vec<_>>()));
                for &p in &n.needles[s] {
                    assert!(
                        row.contains(&(p as i32)),
                        "{name}: seq {s} head {h} drops needle {p}"
                    );
                }
            }
        }
        // The keep list feeds attn-op's compaction directly.
        let mut kv = n.case.kv.clone();
        let lens = attn_op::compact_kv(
            &mut kv,
            &n.case.lens,
            &n.case.table,
            n.case.max_blocks,
            &keep.as_selection(),
        )
        .expect("compaction accepts the keep list");
        assert_eq!(lens, vec![capacity as i32; 2]);
    }
}

#[test]
fn the_oracle_has_the_best_recall_and_full_budget_loses_nothing() {
    let n = needles(13);
    let keys = n.case.keys();
    let step = n.case.step(Some(&keys));
    let scale = 1.0 / (D as f32).sqrt();
    let oracle = AlgoConfig::Oracle(OracleConfig {
        budget_tokens: 256,
        ..Default::default()
    })
    .build(None)
    .expect("valid");
    let quest = AlgoConfig::Quest(QuestConfig {
        budget_tokens: 256,
        ..Default::default()
    })
    .build(None)
    .expect("valid");
    let (o, qs) = (select(oracle.as_ref(), &n), select(quest.as_ref(), &n));
    let (mo, mq) = (
        mass_recall(&step, &o, scale).expect("o"),
        mass_recall(&step, &qs, scale).expect("q"),
    );
    for (a, b) in mo.iter().zip(&mq) {
        assert!(
            a + 1e-6 >= *b,
            "the oracle's mass recall {a} is below Quest's {b}"
        );
    }
    assert_eq!(
        mean(&topk_recall(&o, &o, &n.case.ulens).expect("self")),
        1.0
    );
    let everything = AlgoConfig::Oracle(OracleConfig {
        budget_tokens: LEN + 16,
        ..Default::default()
    })
    .build(None)
    .expect("valid");
    let all = select(everything.as_ref(), &n);
    for m in mass_recall(&step, &all, scale).expect("all") {
        assert!((m - 1.0).abs() < 1e-5, "mass recall of everything is {m}");
    }
    let q: Vec<bf16> = n.case.q.iter().map(|&x| bf16::from_f32(x)).collect();
    let meta = attn_op::BatchMeta {
        cu_seqlens_q: &[0, 1, 2],
        seq_lens_kv: &n.case.lens,
        block_table: &n.case.table,
        max_blocks: n.case.max_blocks,
    };
    let params = attn_op::AttnParams::new(KV_HEADS * GROUP, D);
    for e in output_error(&q, &n.case.kv, &meta, &all, &params).expect("error") {
        assert!(e < 1e-6, "selecting everything changes the output by {e}");
    }
    let err_o = mean(&output_error(&q, &n.case.kv, &meta, &o, &params).expect("error"));
    assert!(
        err_o.is_finite() && err_o > 1e-4,
        "a partial selection changes the output: {err_o}"
    );
}

#[test]
fn ties_go_to_the_lower_page() {
    // Every key equal (and not zero): every page scores the same, so the lowest pages win.
    let mut rng = Rng::new(17);
    let keys = vec![vec![0.25f32; 200 * KV_HEADS * D]];
    let q = rng.vec(KV_HEADS * GROUP * D, 1.0);
    let case = Case::<f32>::new(&keys, q, KV_HEADS * GROUP, KV_HEADS, D, 16, &mut rng);
    let view = case.keys();
    for config in [
        AlgoConfig::Quest(QuestConfig {
            budget_tokens: 64,
            ..Default::default()
        }),
        AlgoConfig::Oracle(OracleConfig {
            budget_tokens: 64,
            ..Default::default()
        }),
        AlgoConfig::RocketKv(RocketConfig {
            topk: 64,
            page_size: 16,
            ..Default::default()
        }),
    ] {
        let algo = config.build(None).expect("valid");
        let mut pool = RepPool::new(algo.rep_shape(KV_HEADS, D), 1, 1, 200).expect("pool");
        algo.construct_representations(0, &view, &[0], &mut pool)
            .expect("construct");
        let top = algo
            .retrieve_topk(&case.step(Some(&view)), &pool)
            .expect("select");
        for h in 0..KV_HEADS {
            assert_eq!(top.row(0, h), &[0, 1, 2, 12], "{config:?}");
        }
    }
}
