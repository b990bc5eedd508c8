//! The capacity accounting on a Llama-3-8B-class shape (bf16 KV, blocks of 16: 2 MiB a
//! block), against bytes computed by hand. The hot buffers hold twice the pages one step can
//! select (Quest, pages of 16: `budget / 16`), plus the reserved page; the
//! representations are max and min per (page, KV head, channel) as the device keeps them: in
//! bf16, 4 KiB a page and layer, or in FP8 E4M3 with a scale byte per KV head, 2056 bytes.

use coordinator::SparseConfig;
use engine::capacity::{BlockGeometry, footprint};
use engine::synthetic::LLAMA3_8B;
use sparse_algo::{AlgoConfig, Summary};

const MIB: u64 = 1 << 20;
const BUDGET: u64 = 64 << 30;

/// One request's expected reservation and how many fit in [`BUDGET`].
struct Case {
    name: &'static str,
    config: Option<SparseConfig>,
    /// Whether it runs in sparse mode.
    sparse: bool,
    prompt: usize,
    total: usize,
    reserve: u64,
    decode_reserve: u64,
    max: u64,
}

fn check(c: &Case) {
    let shape = LLAMA3_8B.shape();
    let lowered = c
        .config
        .as_ref()
        .map(|s| s.lower(shape, None).expect("a valid configuration"));
    let blocks = BlockGeometry {
        tokens: 16,
        bytes: 2 * MIB,
    };
    let f = footprint(lowered.as_ref(), shape, 2, blocks, c.prompt, c.total);
    assert_eq!(
        (
            f.sparse,
            f.reserve,
            f.decode_reserve,
            f.max_concurrent(BUDGET)
        ),
        (c.sparse, c.reserve, c.decode_reserve, c.max),
        "{}",
        c.name
    );
}

fn quest(budget: usize, dense: Vec<usize>, min_prompt: usize) -> SparseConfig {
    SparseConfig {
        dense_layers: dense,
        min_prompt_tokens: Some(min_prompt),
        ..SparseConfig::quest(budget)
    }
}

/// `config` with Quest's bounds stored in FP8 E4M3.
fn e4m3(mut config: SparseConfig) -> SparseConfig {
    if let AlgoConfig::Quest(q) = &mut config.algo {
        q.summary = Summary::E4m3;
    }
    config
}

#[test]
fn footprints_of_an_8b_shape_equal_hand_computed_bytes() {
    // Quest 2048: 256 hot pages + 1 = 4112 tokens of 4 KiB per layer; 2048 pages of
    // representations per layer at 32K.
    let quest_2048 = 32 * 4096 * 4112 + 32 * 4096 * 2048;
    // The same with E4M3 representations.
    let quest_2048_e4m3 = 32 * 4096 * 4112 + 32 * 2056 * 2048;
    // Quest 1024 on 30 layers: 128 + 1 pages = 2064 tokens.
    let quest_1024_30 = 30 * 4096 * 2064 + 30 * 4096 * 2048;
    for c in [
        Case {
            name: "dense 32K",
            config: None,
            sparse: false,
            prompt: 32512,
            total: 32768,
            reserve: 4096 * MIB,
            decode_reserve: 4096 * MIB,
            max: 16,
        },
        Case {
            name: "quest-2048, every layer sparse: the prompt's blocks only while it prefills",
            config: Some(quest(2048, Vec::new(), 1)),
            sparse: true,
            prompt: 32512,
            total: 32768,
            reserve: quest_2048 + 2032 * 2 * MIB,
            decode_reserve: quest_2048,
            max: 79,
        },
        Case {
            name: "quest-2048 with E4M3 representations: a byte a value, a scale byte a KV head",
            config: Some(e4m3(quest(2048, Vec::new(), 1))),
            sparse: true,
            prompt: 32512,
            total: 32768,
            reserve: quest_2048_e4m3 + 2032 * 2 * MIB,
            decode_reserve: quest_2048_e4m3,
            max: 95,
        },
        Case {
            name: "quest-1024 with layers 0 and 1 dense: the blocks of every layer stay",
            config: Some(quest(1024, vec![0, 1], 1)),
            sparse: true,
            prompt: 32512,
            total: 32768,
            reserve: quest_1024_30 + 4096 * MIB,
            decode_reserve: quest_1024_30 + 4096 * MIB,
            max: 14,
        },
        Case {
            name: "a prompt below min_prompt_tokens runs dense",
            config: Some(quest(2048, Vec::new(), 4096)),
            sparse: false,
            prompt: 100,
            total: 356,
            reserve: 23 * 2 * MIB,
            decode_reserve: 23 * 2 * MIB,
            max: BUDGET / (46 * MIB),
        },
        Case {
            name: "128K dense does not fit 64 GiB twice",
            config: None,
            sparse: false,
            prompt: 130_816,
            total: 131_072,
            reserve: 16384 * MIB,
            decode_reserve: 16384 * MIB,
            max: 4,
        },
    ] {
        check(&c);
    }
}

#[test]
fn a_request_larger_than_the_budget_fits_zero_times() {
    let f = footprint(
        None,
        LLAMA3_8B.shape(),
        2,
        BlockGeometry {
            tokens: 16,
            bytes: 2 * MIB,
        },
        1000,
        1 << 20,
    );
    assert_eq!((f.decode_reserve, f.max_concurrent(BUDGET)), (128 << 30, 0));
}
