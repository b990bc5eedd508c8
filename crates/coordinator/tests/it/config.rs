//! The user config in TOML, lowered once into per-layer parameters.

use coordinator::{Lowered, ModelShape, SparseConfig};

const MODEL: ModelShape = ModelShape {
    layers: 4,
    q_heads: 8,
    kv_heads: 2,
    head_dim: 32,
};

/// Parses and lowers `toml`; `Ok` with a summary per layer (`-` dense, else the algorithm's
/// name and its most pages per step), the hot pages and the sparse-mode threshold, or `Err`
/// with the error text.
fn lower(toml: &str) -> Result<(Vec<String>, usize, usize), String> {
    let c: SparseConfig = toml::from_str(toml).map_err(|e| e.to_string())?;
    let l: Lowered = c.lower(MODEL, None).map_err(|e| e.to_string())?;
    let layers = l
        .layers
        .iter()
        .map(|p| {
            p.as_ref().map_or("-".to_owned(), |p| {
                format!("{}:{}", p.caps.name, p.max_pages)
            })
        })
        .collect();
    Ok((layers, l.hot_pages, l.min_prompt_tokens))
}

fn check(toml: &str, want: Result<(&[&str], usize, usize), &str>) {
    let got = lower(toml);
    match (&got, want) {
        (Ok((layers, hot, min)), Ok((w, wh, wm))) => {
            assert_eq!(
                (layers.as_slice(), *hot, *min),
                (
                    w.iter()
                        .map(|s| s.to_string())
                        .collect::<Vec<_>>()
                        .as_slice(),
                    wh,
                    wm
                ),
                "{toml}"
            );
        }
        (Err(e), Err(w)) => assert!(e.contains(w), "{toml}: {e:?} lacks {w:?}"),
        _ => panic!("{toml}: got {got:?}, want {want:?}"),
    }
}

#[test]
fn configs_lower_to_per_layer_parameters() {
    // Defaults: Quest, pages of 16, 2048 tokens shared by the heads: 128 pages, the current
    // one among them; the hot buffer holds twice that, and shorter prompts stay dense.
    let q = "quest:128";
    check("", Ok((&[q, q, q, q], 256, 256 * 16)));
    check(
        "dense_layers = [0, 3]\nhot_tokens = 4160\nmin_prompt_tokens = 100",
        Ok((&["-", q, q, "-"], 260, 100)),
    );
    // Per-layer overrides: a budget, a dense layer, another algorithm of the same page size.
    check(
        r#"
        [algo]
        algorithm = "quest"
        budget_tokens = 512
        [[layer]]
        layers = [1]
        budget_tokens = 1024
        [[layer]]
        layers = [2]
        dense = true
        [[layer]]
        layers = [3]
        algo = { algorithm = "streaming_llm", page_size = 16 }
        "#,
        // Per-head Quest: 2 heads x 32 pages; layer 1: 2 x 64; StreamingLLM: 1 sink page and
        // the 129 pages its 2044 window tokens can touch. The widest layer sizes the hot buffer.
        Ok((
            &["quest:64", "quest:128", "-", "streaming_llm:130"],
            260,
            260 * 16,
        )),
    );
    // Token-level selection: pages of one token, the same 64 (the newest among them) for
    // every KV head.
    check(
        "[algo]\nalgorithm = \"dsa\"\ntopk = 64",
        Ok((&["dsa:64"; 4], 128, 128)),
    );
    // Everything dense: no sparse layer, nothing to hold.
    check("dense_layers = [0, 1, 2, 3]", Ok((&["-"; 4], 2, 2)));
}

#[test]
fn bad_configs_are_rejected_with_the_reason() {
    check("hot_tokens = 1024", Err("one step can select 128"));
    check("dense_layers = [4]", Err("layer 4 of a model of 4 layers"));
    check(
        "[algo]\nalgorithm = \"full\"",
        Err("no bounded decode selection"),
    );
    check(
        "[algo]\nalgorithm = \"snapkv\"",
        Err("no bounded decode selection"),
    );
    check(
        "[[layer]]\nlayers = [2]\nalgo = { algorithm = \"quest\", page_size = 8 }",
        Err("other sparse layers use 16"),
    );
    check("hot_token = 4096", Err("unknown field"));
    check(
        "[algo]\nalgorithm = \"quest\"\nbudget_tokens = 0",
        Err("budget"),
    );
}

#[test]
fn sparse_mode_starts_at_the_threshold_only_where_a_layer_is_sparse() {
    let from = |toml: &str| {
        let c: SparseConfig = toml::from_str(toml).expect("a valid test config");
        c.lower(MODEL, None).expect("it lowers").sparse_from()
    };
    assert_eq!(from(""), Some(256 * 16));
    assert_eq!(
        from("dense_layers = [0, 3]\nmin_prompt_tokens = 100"),
        Some(100)
    );
    assert_eq!(from("dense_layers = [0, 1, 2, 3]"), None);
}

proptest::proptest! {
    /// Any budget, hot buffer, threshold or model shape a config can name lowers or fails with
    /// an error, never a panic: products of widths with head counts and page sizes saturate or
    /// are refused.
    #[test]
    fn extreme_configs_lower_or_fail_without_panicking(
        algo in 0..7usize,
        budget in width(),
        page in proptest::sample::select(vec![1usize, 16]),
        hot in proptest::option::of(width()),
        min_prompt in proptest::option::of(width()),
        kv_heads in width(),
        group in 1..3usize,
        layer in width(),
    ) {
        use sparse_algo::AlgoConfig;
        let algo = match algo {
            0 => AlgoConfig::Full(Default::default()),
            1 => AlgoConfig::StreamingLlm(Default::default()),
            2 => AlgoConfig::Quest(sparse_algo::QuestConfig { page_size: page, ..Default::default() }),
            3 => AlgoConfig::SnapKv(Default::default()),
            4 => AlgoConfig::RocketKv(sparse_algo::RocketConfig { page_size: page, ..Default::default() }),
            5 => AlgoConfig::Dsa(Default::default()),
            _ => AlgoConfig::Oracle(sparse_algo::OracleConfig { page_size: page, ..Default::default() }),
        };
        let mut c = SparseConfig::quest(16);
        c.algo = algo.with_budget(budget);
        c.hot_tokens = hot;
        c.min_prompt_tokens = min_prompt;
        c.layer.push(coordinator::LayerOverride {
            layers: vec![layer % 4],
            algo: None,
            budget_tokens: Some(budget / 2),
            dense: false,
        });
        let model = ModelShape {
            kv_heads,
            q_heads: kv_heads.saturating_mul(group),
            ..MODEL
        };
        if let Ok(l) = c.lower(model, None) {
            proptest::prop_assert!(l.layers.iter().flatten().all(|p| p.max_pages <= l.hot_pages));
        }
    }
}

/// A width a config can name: small, TOML's largest integer, or `usize::MAX`.
fn width() -> impl proptest::strategy::Strategy<Value = usize> {
    use proptest::prelude::*;
    prop_oneof![
        6 => 1..300usize,
        1 => Just(0usize),
        1 => Just(1usize << 40),
        1 => Just(i64::MAX as usize),
        1 => Just(usize::MAX),
    ]
}
