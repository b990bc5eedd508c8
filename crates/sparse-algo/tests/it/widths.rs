//! The selection width every planning algorithm publishes (`max_pages`) against the rows it
//! returns: no row is longer, and some sequence length reaches it, so the width sizing device
//! rows and hot buffers is exact.

use proptest::prelude::*;
use sparse_algo::{
    AlgoConfig, AlwaysInclude, DsaConfig, OracleConfig, QuestConfig, RepPool, RocketConfig,
    StreamingConfig,
};

use crate::util::{Case, Rng};

const KV_HEADS: usize = 2;
const D: usize = 4;

/// One sequence of every length `1..=longest`, random keys and queries.
fn sweep(longest: usize, seed: u64) -> Case<f32> {
    let mut rng = Rng::new(seed);
    let keys: Vec<Vec<f32>> = (1..=longest)
        .map(|len| rng.vec(len * KV_HEADS * D, 2.0))
        .collect();
    let q = rng.vec(longest * KV_HEADS * D, 1.0);
    Case::new(&keys, q, KV_HEADS, KV_HEADS, D, 4, &mut rng)
}

/// Runs `config` over `case` and checks its rows against its published widths: each row at
/// most `max_pages(1)`, each sequence's union at most `max_pages(KV_HEADS)`, and the longest
/// row exactly `max_pages(1)`.
fn check(name: &str, config: &AlgoConfig, case: &Case<f32>) -> Result<(), TestCaseError> {
    let algo = config.build(None).expect("a valid config");
    let keys = case.keys();
    let longest = case.ulens.iter().copied().max().unwrap_or(0);
    let mut pool = RepPool::new(algo.rep_shape(KV_HEADS, D), 1, case.ulens.len(), longest)
        .expect("a small pool");
    algo.construct_representations(0, &keys, &case.slots, &mut pool)
        .expect("construction");
    let top = algo
        .retrieve_topk(&case.step(Some(&keys)), &pool)
        .expect("selection");
    let row = algo.max_pages(1).expect("a decode algorithm");
    let union = algo.max_pages(KV_HEADS).expect("a decode algorithm");
    let mut widest = 0;
    for (s, &len) in case.ulens.iter().enumerate() {
        let mut pages: Vec<i32> = Vec::new();
        for h in 0..KV_HEADS {
            let r = top.row(s, h);
            prop_assert!(
                r.len() <= row,
                "{name}: length {len} head {h} holds {} > {row}",
                r.len()
            );
            widest = widest.max(r.len());
            pages.extend_from_slice(r);
        }
        pages.sort_unstable();
        pages.dedup();
        prop_assert!(
            pages.len() <= union,
            "{name}: length {len} needs {} > {union}",
            pages.len()
        );
    }
    prop_assert_eq!(widest, row, "{}: no length reaches the width", name);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn rows_fit_the_published_width_and_some_length_fills_it(
        ps in 1..6usize, budget in 1..8usize, extra in 0..6usize, sink in 0..12u32,
        recent in 0..14u32, seed in any::<u64>(),
    ) {
        let always = AlwaysInclude { sink_tokens: sink, recent_tokens: recent };
        let forced = always.max_forced_pages(ps);
        // Long enough that the sinks and the recent tokens part, at every alignment of the
        // recent tokens within a page.
        let longest = (budget + forced + 3) * ps;
        let case = sweep(longest, seed);
        let budget_tokens = budget * ps + extra % ps;
        for shared_heads in [false, true] {
            let quest = QuestConfig { page_size: ps, budget_tokens, always, shared_heads, ..Default::default() };
            check("quest", &AlgoConfig::Quest(quest), &case)?;
        }
        let oracle = OracleConfig { page_size: ps, budget_tokens, always, ..Default::default() };
        check("oracle", &AlgoConfig::Oracle(oracle), &case)?;
        let rocket = RocketConfig { page_size: ps, topk: budget_tokens, always, ..Default::default() };
        check("rocketkv", &AlgoConfig::RocketKv(rocket), &case)?;
        let dsa = DsaConfig { topk: budget_tokens, always };
        check("dsa", &AlgoConfig::Dsa(dsa), &case)?;
        let streaming = StreamingConfig { page_size: ps, sink_tokens: sink, window_tokens: recent.max(1) };
        check("streaming_llm", &AlgoConfig::StreamingLlm(streaming), &case)?;
    }
}
