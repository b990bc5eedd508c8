//! Capacity math: bytes per token, blocks from a memory budget, blocks needed per step.

use kv_blocks::{
    KvShape, PoolSizing, blocks_for_tokens, blocks_needed_for_step, max_attention_window,
    max_blocks_in_window,
};

const LLAMA8B: KvShape = KvShape {
    layers: 32,
    kv_heads: 8,
    head_dim: 128,
    dtype_bytes: 2,
};

#[test]
fn bytes_per_token_is_two_times_layers_heads_dim_dtype() {
    // 2 (K and V) * 32 * 8 * 128 * 2 bytes = 128 KiB per token.
    assert_eq!(LLAMA8B.bytes_per_token(), 131_072);
    assert_eq!(LLAMA8B.bytes_per_block(32), 4_194_304);
}

#[test]
fn pool_sizing_takes_the_lesser_of_fraction_and_max_tokens() {
    let check = |free_bytes: u64, fraction: f64, max_tokens: Option<u64>, want: u32| {
        let sizing = PoolSizing {
            free_bytes,
            free_memory_fraction: fraction,
            max_tokens,
        };
        assert_eq!(
            sizing.blocks(&LLAMA8B, 32).expect("valid sizing"),
            want,
            "{free_bytes} bytes, fraction {fraction}, max_tokens {max_tokens:?}"
        );
    };
    let gib = 1u64 << 30;
    // 0.9 * 80 GiB / 4 MiB per block = 18432 blocks.
    check(80 * gib, 0.9, None, 18_432);
    check(80 * gib, 1.0, None, 20_480);
    // max_tokens is smaller: 1000 tokens need ceil(1000 / 32) = 32 blocks.
    check(80 * gib, 0.9, Some(1000), 32);
    // fraction is smaller than max_tokens.
    check(gib, 0.5, Some(1 << 20), 128);
    check(0, 0.9, None, 0);
}

#[test]
fn pool_sizing_rejects_bad_fractions_and_empty_shapes() {
    for fraction in [0.0, -0.1, 1.5, f64::NAN] {
        let sizing = PoolSizing {
            free_bytes: 1 << 30,
            free_memory_fraction: fraction,
            max_tokens: None,
        };
        assert!(sizing.blocks(&LLAMA8B, 32).is_err(), "fraction {fraction}");
    }
    let empty = KvShape {
        head_dim: 0,
        ..LLAMA8B
    };
    let sizing = PoolSizing {
        free_bytes: 1 << 30,
        free_memory_fraction: 0.9,
        max_tokens: None,
    };
    assert!(sizing.blocks(&empty, 32).is_err());
}

#[test]
fn blocks_needed_per_step_counts_only_block_boundaries_crossed() {
    let check = |len: u64, new: u64, window: Option<u32>, want: u64| {
        assert_eq!(
            blocks_needed_for_step(len, new, 16, window),
            want,
            "len {len} + {new}, window {window:?}"
        );
    };
    check(0, 1, None, 1);
    check(15, 1, None, 0);
    check(16, 1, None, 1);
    check(100, 1000, None, 62); // ceil(1100 / 16) - ceil(100 / 16)
    // A window caps what one sequence ever needs: ceil(64 / 16) + 1 blocks.
    check(0, 100_000, Some(64), 5);
    assert_eq!(blocks_for_tokens(33, 16), 3);
    assert_eq!(max_blocks_in_window(64, 16), 5);
}

#[test]
fn max_attention_window_from_memory_divides_blocks_among_sequences() {
    assert_eq!(max_attention_window(1000, 8, 32), 125 * 32);
    assert_eq!(max_attention_window(1000, 0, 32), 0);
}
