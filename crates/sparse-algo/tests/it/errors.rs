//! Bad input gives typed errors, never panics.

use attn_op::{KvLayout, PagedKv};
use sparse_algo::{
    AlgoConfig, AlgoError, Decode, DsaConfig, FullConfig, OracleConfig, PagedKeys, Prompt,
    QuestConfig, RepPool, RepShape, RocketConfig, SnapKvConfig, StreamingConfig,
};

/// Checks that a result is an error of the expected kind.
fn check<T: std::fmt::Debug>(what: &str, r: Result<T, AlgoError>, kind: fn(&AlgoError) -> bool) {
    match r {
        Err(e) if kind(&e) => {}
        other => panic!("{what}: expected a typed error, got {other:?}"),
    }
}

fn config(e: &AlgoError) -> bool {
    matches!(e, AlgoError::Config(_))
}

fn invalid(e: &AlgoError) -> bool {
    matches!(e, AlgoError::Invalid(_) | AlgoError::Shape { .. })
}

#[test]
fn bad_configs_are_rejected() {
    let bad = [
        (
            "quest budget 0",
            AlgoConfig::Quest(QuestConfig {
                budget_tokens: 0,
                ..Default::default()
            }),
        ),
        (
            "quest page 0",
            AlgoConfig::Quest(QuestConfig {
                page_size: 0,
                ..Default::default()
            }),
        ),
        (
            "quest budget below a page",
            AlgoConfig::Quest(QuestConfig {
                budget_tokens: 8,
                ..Default::default()
            }),
        ),
        ("full page 0", AlgoConfig::Full(FullConfig { page_size: 0 })),
        (
            "streaming window 0",
            AlgoConfig::StreamingLlm(StreamingConfig {
                window_tokens: 0,
                ..Default::default()
            }),
        ),
        (
            "snapkv even kernel",
            AlgoConfig::SnapKv(SnapKvConfig {
                kernel_size: 4,
                ..Default::default()
            }),
        ),
        (
            "snapkv capacity below window",
            AlgoConfig::SnapKv(SnapKvConfig {
                capacity: 16,
                ..Default::default()
            }),
        ),
        (
            "rocket topr 0",
            AlgoConfig::RocketKv(RocketConfig {
                topr: 0,
                ..Default::default()
            }),
        ),
        (
            "rocket page 0",
            AlgoConfig::RocketKv(RocketConfig {
                page_size: 0,
                ..Default::default()
            }),
        ),
        (
            "dsa topk 0",
            AlgoConfig::Dsa(DsaConfig {
                topk: 0,
                ..Default::default()
            }),
        ),
        (
            "oracle budget 0",
            AlgoConfig::Oracle(OracleConfig {
                budget_tokens: 0,
                ..Default::default()
            }),
        ),
        (
            "oracle scale nan",
            AlgoConfig::Oracle(OracleConfig {
                scale: Some(f32::NAN),
                ..Default::default()
            }),
        ),
    ];
    for (what, c) in bad {
        check(what, c.build(None).map(|_| ()), config);
    }
    check(
        "pool page 0",
        RepPool::new(
            RepShape {
                page_size: 0,
                heads: 1,
                width: 2,
            },
            1,
            1,
            8,
        ),
        config,
    );
    check(
        "pool past any machine's memory",
        RepPool::new(
            RepShape {
                page_size: 1,
                heads: 8,
                width: 256,
            },
            1,
            1,
            1 << 40,
        ),
        config,
    );
    check(
        "pool overflow",
        RepPool::new(
            RepShape {
                page_size: 1,
                heads: usize::MAX,
                width: 2,
            },
            2,
            2,
            8,
        ),
        config,
    );
}

#[test]
fn configs_round_trip_through_toml_and_reject_unknown_fields() {
    for c in [
        AlgoConfig::Full(FullConfig::default()),
        AlgoConfig::StreamingLlm(StreamingConfig::default()),
        AlgoConfig::Quest(QuestConfig::default()),
        AlgoConfig::SnapKv(SnapKvConfig::default()),
        AlgoConfig::RocketKv(RocketConfig::default()),
        AlgoConfig::Dsa(DsaConfig::default()),
        AlgoConfig::Oracle(OracleConfig::default()),
    ] {
        let text = toml::to_string(&c).expect("serializable");
        assert_eq!(
            toml::from_str::<AlgoConfig>(&text).expect("parses back"),
            c,
            "{text}"
        );
        assert!(c.build(None).is_ok(), "defaults are valid: {text}");
    }
    assert!(toml::from_str::<AlgoConfig>("algorithm = \"quest\"\nbudget = 3").is_err());
    assert!(toml::from_str::<AlgoConfig>("algorithm = \"h2o\"").is_err());
}

#[test]
fn bad_shapes_are_rejected() {
    let layout = KvLayout {
        num_blocks: 2,
        block_size: 4,
        kv_heads: 2,
        head_dim: 4,
    };
    let k: Vec<f32> = (0..layout.len()).map(|i| (i % 7) as f32 - 3.0).collect();
    let kv = PagedKv::from_tensors(layout, k.clone(), k).expect("valid");
    check(
        "block out of pool",
        PagedKeys::new(&kv, &[8], &[0, 5], 2),
        invalid,
    );
    check(
        "table too short",
        PagedKeys::new(&kv, &[8], &[0], 1),
        invalid,
    );
    check(
        "negative length",
        PagedKeys::new(&kv, &[-1], &[0, 1], 2),
        invalid,
    );
    let keys = PagedKeys::new(&kv, &[8], &[1, 0], 2).expect("valid");
    let quest = AlgoConfig::Quest(QuestConfig {
        page_size: 2,
        budget_tokens: 4,
        ..Default::default()
    })
    .build(None)
    .expect("valid");
    let mut pool = RepPool::new(quest.rep_shape(2, 4), 1, 1, 8).expect("pool");
    check(
        "slot out of pool",
        quest.construct_representations(0, &keys, &[3], &mut pool),
        invalid,
    );
    check(
        "layer out of pool",
        quest.construct_representations(1, &keys, &[0], &mut pool),
        invalid,
    );
    check(
        "slots of another batch",
        quest.construct_representations(0, &keys, &[0, 0], &mut pool),
        invalid,
    );
    let mut small = RepPool::new(quest.rep_shape(2, 4), 1, 1, 4).expect("pool");
    check(
        "sequence longer than the pool",
        quest.construct_representations(0, &keys, &[0], &mut small),
        invalid,
    );
    let mut wrong = RepPool::new(
        RepShape {
            page_size: 2,
            heads: 2,
            width: 3,
        },
        1,
        1,
        8,
    )
    .expect("pool");
    check(
        "pool of another shape",
        quest.construct_representations(0, &keys, &[0], &mut wrong),
        invalid,
    );
    let q = [0.5f32; 16];
    let step = |q: &'static [f32], q_heads, seq_lens: &'static [usize]| Decode {
        layer: 0,
        q,
        q_heads,
        kv_heads: 2,
        head_dim: 4,
        seq_lens,
        slots: &[0],
        keys: None,
    };
    let q: &'static [f32] = Box::leak(Box::new(q));
    check(
        "stale representations",
        quest.retrieve_topk(&step(q, 4, &[8]), &pool),
        invalid,
    );
    quest
        .construct_representations(0, &keys, &[0], &mut pool)
        .expect("valid");
    assert!(quest.retrieve_topk(&step(q, 4, &[8]), &pool).is_ok());
    check(
        "q of the wrong length",
        quest.retrieve_topk(&step(&q[..8], 4, &[8]), &pool),
        invalid,
    );
    check(
        "heads that do not group",
        quest.retrieve_topk(&step(&q[..12], 3, &[8]), &pool),
        invalid,
    );
    check(
        "empty sequence",
        quest.retrieve_topk(&step(q, 4, &[0]), &pool),
        invalid,
    );
    let oracle = AlgoConfig::Oracle(OracleConfig {
        page_size: 4,
        budget_tokens: 4,
        ..Default::default()
    })
    .build(None)
    .expect("valid");
    check(
        "oracle without keys",
        oracle.retrieve_topk(&step(q, 4, &[8]), &pool),
        invalid,
    );
    check(
        "decode on a prefill-only algorithm",
        AlgoConfig::SnapKv(SnapKvConfig::default())
            .build(None)
            .expect("valid")
            .retrieve_topk(&step(q, 4, &[8]), &pool),
        |e| matches!(e, AlgoError::Unsupported { .. }),
    );
    check(
        "keep on a decode-only algorithm",
        quest.predict_keep(&Prompt {
            layer: 0,
            q,
            cu_q: &[0, 4],
            q_heads: 4,
            keys: &keys,
        }),
        |e| matches!(e, AlgoError::Unsupported { .. }),
    );
    let snap = AlgoConfig::SnapKv(SnapKvConfig {
        window: 2,
        kernel_size: 1,
        capacity: 4,
        ..Default::default()
    })
    .build(None)
    .expect("valid");
    check(
        "keep with too few window queries",
        snap.predict_keep(&Prompt {
            layer: 0,
            q: &q[..16],
            cu_q: &[0, 1],
            q_heads: 4,
            keys: &keys,
        }),
        invalid,
    );
    check(
        "keep with a bad cu_q",
        snap.predict_keep(&Prompt {
            layer: 0,
            q,
            cu_q: &[0, 9],
            q_heads: 4,
            keys: &keys,
        }),
        invalid,
    );
}
