//! Pages loaded ahead of a layer's step: the step's attention is unchanged (every sparse row
//! is still checked against in-memory attention), and what a prefetch with the step's own
//! queries loads are exactly the step's misses without it.

use coordinator::{CoordError, SparseConfig};
use kv_blocks::RequestId;
use offload::HostAlloc;
use sparse_algo::{AlgoConfig, OracleConfig, QuestConfig};

use crate::util::{Engine, Estimate, MODEL};

/// Two sparse requests (prompts 90 and 70) decoding 30 steps together, Quest over pages of 4
/// per KV head, layer 1 dense; prefetching before every layer's step with `estimate`.
fn run(algo: AlgoConfig, estimate: Option<Estimate>) -> Engine {
    let config = SparseConfig {
        algo,
        hot_tokens: Some(64),
        min_prompt_tokens: Some(60),
        dense_layers: vec![1],
        ..Default::default()
    };
    let mut e = Engine::new(&config, HostAlloc::Own, 600);
    e.prefetch = estimate;
    let (a, c) = (RequestId(1), RequestId(3));
    for (id, prompt) in [(a, 90), (c, 70)] {
        e.add(id);
        e.coord.on_request_begin(id, prompt).expect("room");
        e.forward(&[(id, prompt)]);
    }
    for _ in 0..30 {
        e.forward(&[(a, 1), (c, 1)]);
    }
    assert_eq!(e.checked, 2 * 2 * 30, "every sparse row was checked");
    e
}

fn quest() -> AlgoConfig {
    AlgoConfig::Quest(QuestConfig {
        page_size: 4,
        budget_tokens: 16,
        ..Default::default()
    })
}

#[test]
fn a_prefetch_with_the_steps_own_queries_takes_every_miss_off_the_step() {
    let plain = run(quest(), None);
    let exact = run(quest(), Some(Estimate::Exact));
    assert!(
        plain.stats.misses > 0,
        "the plain run misses: {:?}",
        plain.stats
    );
    assert_eq!(exact.stats.misses, 0, "{:?}", exact.stats);
    assert_eq!(exact.prefetched.misses, plain.stats.misses);
    assert_eq!(
        exact.prefetched.bytes,
        plain.stats.bytes - exact.stats.bytes
    );
    assert_eq!(exact.prefetched.steps, 0);
}

#[test]
fn a_prefetch_with_other_queries_leaves_attention_unchanged() {
    // `run` checks every sparse row against in-memory attention over the step's selection.
    let other = run(quest(), Some(Estimate::Other));
    assert!(other.prefetched.misses > 0, "{:?}", other.prefetched);
}

#[test]
fn a_prefetch_out_of_place_is_a_typed_error() {
    let mut e = run(quest(), None);
    let (a, c) = (RequestId(1), RequestId(3));
    let qs = MODEL.q_heads * MODEL.head_dim;
    let q = vec![0.5f32; 2 * qs];
    assert!(
        matches!(e.coord.prefetch(0, &q), Err(CoordError::Invalid(_))),
        "no forward"
    );
    e.coord
        .forward_begin(&[(a, 1), (c, 1)])
        .expect("a valid batch");
    assert!(
        matches!(e.coord.prefetch(0, &q[1..]), Err(CoordError::Invalid(_))),
        "q's length"
    );
    assert!(
        matches!(e.coord.prefetch(9, &q), Err(CoordError::Invalid(_))),
        "no layer 9"
    );
    let kvs = MODEL.kv_heads * MODEL.head_dim;
    let kv = vec![0.25f32; 2 * kvs];
    e.coord
        .attention_begin(0, &q, &kv, &kv)
        .expect("a valid layer");
    assert!(
        matches!(e.coord.prefetch(0, &q), Err(CoordError::Invalid(_))),
        "after the layer's step began"
    );
    let loaded = e
        .coord
        .prefetch(1, &q)
        .expect("a dense layer loads nothing");
    assert_eq!(loaded.loaded_pages, 0);
    // An algorithm that reads the new keys cannot select ahead of them.
    let mut o = Engine::new(
        &SparseConfig {
            algo: AlgoConfig::Oracle(OracleConfig {
                page_size: 1,
                budget_tokens: 24,
                ..Default::default()
            }),
            min_prompt_tokens: Some(60),
            ..Default::default()
        },
        HostAlloc::Own,
        600,
    );
    o.add(a);
    o.coord.on_request_begin(a, 70).expect("room");
    o.forward(&[(a, 70)]);
    o.coord.forward_begin(&[(a, 1)]).expect("a valid batch");
    assert!(matches!(
        o.coord.prefetch(0, &q[..qs]),
        Err(CoordError::Config(_))
    ));
}
