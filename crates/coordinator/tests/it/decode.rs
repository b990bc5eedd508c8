//! Mixed batches through the hooks: dense and sparse requests, chunked prefill, a dense layer,
//! page-level and token-level selections; every sparse row checked against in-memory attention.

use coordinator::{Mode, Phase, SparseConfig};
use kv_blocks::RequestId;
use offload::HostAlloc;
use sparse_algo::{AlgoConfig, OracleConfig, QuestConfig};

use crate::util::Engine;

/// Three requests: `a` (prompt 90, sparse, prefilled in two chunks), `b` (prompt 20, dense)
/// and `c` (prompt 70, sparse, joins later), decoding together; layer 1 is dense.
fn run(algo: AlgoConfig, hot_tokens: usize, expect_dense: bool) -> Engine {
    let config = SparseConfig {
        algo,
        hot_tokens: Some(hot_tokens),
        min_prompt_tokens: Some(60),
        dense_layers: vec![1],
        ..Default::default()
    };
    let mut e = Engine::new(&config, HostAlloc::Own, 600);
    e.expect_dense = expect_dense;
    let (a, b, c) = (RequestId(1), RequestId(2), RequestId(3));
    for (id, prompt) in [(a, 90), (b, 20)] {
        e.add(id);
        let mode = e.coord.on_request_begin(id, prompt).expect("room");
        assert_eq!(
            mode,
            if prompt >= 60 {
                Mode::Sparse
            } else {
                Mode::Dense
            }
        );
    }
    e.forward(&[(a, 50), (b, 20)]);
    assert_eq!(e.coord.tracker(a).map(|t| t.phase), Some(Phase::Prefill));
    e.forward(&[(a, 40), (b, 1)]);
    assert_eq!(e.coord.tracker(a).map(|t| t.phase), Some(Phase::Decode));
    e.add(c);
    e.coord.on_request_begin(c, 70).expect("room");
    e.forward(&[(a, 1), (c, 70), (b, 1)]);
    for _ in 0..30 {
        e.forward(&[(a, 1), (b, 1), (c, 1)]);
    }
    // a: 31 steps, c: 30, over the 2 sparse layers.
    assert_eq!(e.checked, 2 * (31 + 30));
    assert_eq!(e.stats.steps, 2 * (31 + 30));
    for id in [a, b, c] {
        e.coord.on_request_end(id).expect("live");
    }
    let m = e.coord.manager().expect("sparse layers");
    assert_eq!(m.free_host_pages(), 600, "every host page is back");
    e
}

#[test]
fn page_level_hierarchical_attention_equals_in_memory_sparse() {
    let quest = QuestConfig {
        page_size: 4,
        budget_tokens: 16,
        ..Default::default()
    };
    let e = run(AlgoConfig::Quest(quest), 64, false);
    let s = e.stats;
    assert!(
        s.misses > 0 && s.hits > 2 * s.misses,
        "a realistic mix: {s:?}"
    );
}

#[test]
fn shared_head_selection_moves_at_most_the_budget() {
    let quest = QuestConfig {
        page_size: 4,
        budget_tokens: 16,
        shared_heads: true,
        ..Default::default()
    };
    let e = run(AlgoConfig::Quest(quest), 24, false);
    assert_eq!(e.coord.lowered().hot_pages, 6);
}

#[test]
fn token_level_hierarchical_attention_equals_in_memory_sparse() {
    let oracle = OracleConfig {
        page_size: 1,
        budget_tokens: 24,
        ..Default::default()
    };
    let e = run(AlgoConfig::Oracle(oracle), 64, false);
    assert!(e.stats.misses > 0);
}

#[test]
fn a_budget_covering_the_context_equals_dense() {
    let quest = QuestConfig {
        page_size: 4,
        budget_tokens: 160,
        ..Default::default()
    };
    run(AlgoConfig::Quest(quest), 2 * 4 * 42, true);
}
