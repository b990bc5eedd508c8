//! Properties: dense, sparse and token-level attention against the f64 oracle for every dtype,
//! GQA ratio, window and sink; exact equalities (sparse with every page = dense, results
//! independent of the thread count); merge and compaction identities.

use attn_op::{
    AttnOut, AttnPart, Element, GatheredPages, Selection, Simd, compact_kv, gather_page_offsets,
    merge_attention, paged_attention, sparse_page_attention, token_sparse_attention,
};
use half::{bf16, f16};
use proptest::prelude::*;

use crate::oracle::{Case, Rng, Shape, assert_close};

/// f32 arithmetic on inputs that are exact in every dtype: the error bound does not depend on
/// the storage type.
const TOL: f64 = 2e-5;

/// The bf16 dot-product build (`Simd::Avx512Bf16`, bf16 caches, head dims a multiple of 32).
/// Queries times a power-of-two scale are exact in bf16 here, so only the softmax weights are
/// rounded for the values' products: by at most 2^-9 relatively, which moves an output by at
/// most 2^-9 of the largest value (values lie in [-1, 1]); the log-sum-exp uses the unrounded
/// weights. This bound is 2^-8.
const TOL_BF16_DOT: f64 = 1.0 / 256.0;

/// Whether `a` and `b` agree bit for bit, element by element.
fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn shape() -> impl Strategy<Value = Shape> {
    (
        1..4usize,
        prop::sample::select(vec![2usize, 4, 16]),
        1..3usize,
        prop::sample::select(vec![1usize, 3, 4, 8]),
        prop::sample::select(vec![4usize, 12, 24, 64, 128]),
        1..70usize,
        0..3u8,
    )
        .prop_map(
            |(seqs, block_size, kv_heads, group, head_dim, max_kv, mode)| Shape {
                seqs,
                block_size,
                kv_heads,
                group,
                head_dim,
                max_kv,
                mode,
            },
        )
}

/// Window, sink tokens, and sink logits drawn from the seed.
fn decorate<T: Element>(case: &mut Case<T>, rng: &mut Rng, masks: bool) {
    if masks && rng.range(0, 2) == 0 {
        case.params.window = Some(rng.range(1, 30) as u32);
        case.params.sink_tokens = rng.range(0, 4) as u32;
    }
    if masks && rng.range(0, 3) == 0 {
        case.params.sink_logits = Some((0..case.params.q_heads).map(|_| rng.unit()).collect());
    }
}

fn dense<T: Element>(case: &Case<T>) -> (Vec<f32>, Vec<f32>) {
    let hq = case.params.q_heads;
    let d = case.layout().head_dim;
    let mut out = vec![0.0; case.total_q() * hq * d];
    let mut lse = vec![0.0; case.total_q() * hq];
    paged_attention(
        &case.q,
        &case.kv,
        &case.meta(),
        &case.params,
        AttnOut {
            out: &mut out,
            lse: Some(&mut lse),
        },
    )
    .expect("valid case");
    (out, lse)
}

fn dense_matches_oracle<T: Element>(shape: Shape, seed: u64) {
    let mut rng = Rng::new(seed);
    let mut case = Case::<T>::random(shape, &mut rng);
    decorate(&mut case, &mut rng, true);
    let (want_out, want_lse) = case.oracle(&|_, _, _| true);
    // Every build of the inner loops (those this CPU lacks fall back to narrower ones).
    for simd in [Simd::Portable, Simd::Avx2, Simd::Avx512, Simd::Avx512Bf16] {
        case.params.simd = simd;
        let (out, lse) = dense(&case);
        let tol = if simd == Simd::Avx512Bf16 {
            TOL_BF16_DOT
        } else {
            TOL
        };
        assert_close(&format!("{simd:?} out"), &out, &want_out, tol);
        assert_close(&format!("{simd:?} lse"), &lse, &want_lse, tol);
    }
}

/// Random page selections (unordered, with duplicates) at a granularity finer or coarser than
/// the KV page.
fn random_selection(
    case_lens: &[i32],
    kv_heads: usize,
    sel_bs: usize,
    rng: &mut Rng,
    all: bool,
) -> (Vec<i32>, Vec<i32>, usize) {
    let max_len = case_lens
        .iter()
        .map(|&l| (l as usize).div_ceil(sel_bs))
        .max()
        .unwrap_or(0)
        * 2
        + 1;
    let mut ids = vec![-1; case_lens.len() * kv_heads * max_len];
    let mut lens = vec![0; case_lens.len() * kv_heads];
    for (s, &l) in case_lens.iter().enumerate() {
        let blocks = (l as usize).div_ceil(sel_bs);
        for h in 0..kv_heads {
            let r = s * kv_heads + h;
            let mut row: Vec<i32> = if all {
                (0..blocks as i32).collect()
            } else {
                (0..rng.range(0, blocks + 1))
                    .map(|_| rng.range(0, blocks) as i32)
                    .collect()
            };
            if all {
                // Shuffle and duplicate some: gather must sort and dedup.
                for i in (1..row.len()).rev() {
                    row.swap(i, rng.range(0, i + 1));
                }
                if !row.is_empty() {
                    row.push(row[0]);
                }
            }
            ids[r * max_len..r * max_len + row.len()].copy_from_slice(&row);
            lens[r] = row.len() as i32;
        }
    }
    (ids, lens, max_len)
}

fn sparse_run<T: Element>(case: &Case<T>, pages: &GatheredPages) -> (Vec<f32>, Vec<f32>) {
    let hq = case.params.q_heads;
    let d = case.layout().head_dim;
    let mut out = vec![0.0; case.total_q() * hq * d];
    let mut lse = vec![0.0; case.total_q() * hq];
    sparse_page_attention(
        &case.q,
        &case.kv,
        &case.meta(),
        &pages.as_selection(),
        &case.params,
        AttnOut {
            out: &mut out,
            lse: Some(&mut lse),
        },
    )
    .expect("valid selection");
    (out, lse)
}

fn sparse_properties<T: Element>(shape: Shape, seed: u64) {
    let mut rng = Rng::new(seed);
    let mut case = Case::<T>::random(shape, &mut rng);
    decorate(&mut case, &mut rng, true);
    let l = case.layout();
    let bs = l.block_size;
    let sel_bs = [bs / 2, bs, bs * 4][rng.range(0, 3)].max(1);
    // Every page selected (shuffled, duplicated): bit-for-bit the dense result.
    let (ids, lens, max_len) = random_selection(&case.lens, l.kv_heads, sel_bs, &mut rng, true);
    let sel = Selection {
        ids: &ids,
        lens: &lens,
        max_len,
    };
    let all = gather_page_offsets(&sel, sel_bs, &case.lens, bs, l.kv_heads).expect("valid");
    for (r, &n) in all.kv_lens.iter().enumerate() {
        assert_eq!(
            n,
            case.lens[r / l.kv_heads],
            "effective length of a full selection"
        );
    }
    // In the default build and in the bf16 dot-product one.
    for simd in [Simd::Avx512Bf16, Simd::Auto] {
        case.params.simd = simd;
        let (dense_out, dense_lse) = dense(&case);
        let (sparse_out, sparse_lse) = sparse_run(&case, &all);
        assert!(
            same_bits(&dense_out, &sparse_out),
            "{simd:?} out differs from dense"
        );
        assert!(
            same_bits(&dense_lse, &sparse_lse),
            "{simd:?} lse differs from dense"
        );
    }
    // A random subset: the oracle restricted to the gathered pages.
    let (ids, lens, max_len) = random_selection(&case.lens, l.kv_heads, sel_bs, &mut rng, false);
    let sel = Selection {
        ids: &ids,
        lens: &lens,
        max_len,
    };
    let some = gather_page_offsets(&sel, sel_bs, &case.lens, bs, l.kv_heads).expect("valid");
    let chosen = |s: usize, h: usize, pos: usize| {
        let r = s * l.kv_heads + h;
        let row = &some.pages[r * some.max_pages..r * some.max_pages + some.counts[r] as usize];
        row.contains(&((pos / bs) as i32))
    };
    for (r, &n) in some.kv_lens.iter().enumerate() {
        let s = r / l.kv_heads;
        let covered = (0..case.lens[s] as usize)
            .filter(|&p| chosen(s, r % l.kv_heads, p))
            .count();
        assert_eq!(
            n as usize, covered,
            "effective length counts the last partial page exactly"
        );
        // Every selected token lies on a gathered page.
        let row = &ids[r * max_len..r * max_len + lens[r] as usize];
        for &id in row {
            let tok = id as usize * sel_bs;
            assert!(chosen(
                s,
                r % l.kv_heads,
                tok.min(case.lens[s] as usize - 1)
            ));
        }
    }
    let (out, lse) = sparse_run(&case, &some);
    let (want_out, want_lse) = case.oracle(&chosen);
    assert_close("sparse out", &out, &want_out, TOL);
    assert_close("sparse lse", &lse, &want_lse, TOL);
    shared_rows_equal_per_head_rows(&case, (&ids, &lens, max_len), sel_bs);
}

/// A selection that every KV head of a sequence shares is attended with all heads in one job;
/// each head's rows must be, bit for bit, what the same pages give that head where the other
/// heads select other pages (one job a head). `(ids, lens, max_len)` is a selection whose
/// heads differ.
fn shared_rows_equal_per_head_rows<T: Element>(
    case: &Case<T>,
    (ids, lens, max_len): (&[i32], &[i32], usize),
    sel_bs: usize,
) {
    let l = case.layout();
    let (kvh, hq, d) = (l.kv_heads, case.params.q_heads, l.head_dim);
    let group = hq / kvh;
    // Head h of sequence s takes head 0's row where `pick(h)`, its own row elsewhere.
    let mixed = |pick: &dyn Fn(usize) -> bool| {
        let (mut m_ids, mut m_lens) = (ids.to_vec(), lens.to_vec());
        for (r, len) in m_lens.iter_mut().enumerate() {
            if pick(r % kvh) {
                let first = r - r % kvh;
                m_ids.copy_within(first * max_len..(first + 1) * max_len, r * max_len);
                *len = lens[first];
            }
        }
        let sel = Selection {
            ids: &m_ids,
            lens: &m_lens,
            max_len,
        };
        let pages = gather_page_offsets(&sel, sel_bs, &case.lens, l.block_size, kvh);
        sparse_run(case, &pages.expect("valid"))
    };
    let (shared_out, shared_lse) = mixed(&|_| true);
    for parity in [0, 1] {
        let (out, lse) = mixed(&|h| h % 2 == parity);
        for token in 0..case.total_q() {
            for h in (parity..kvh).step_by(2) {
                let rows = token * hq + h * group..token * hq + (h + 1) * group;
                let what = format!("token {token}, KV head {h} of {kvh}");
                assert!(
                    same_bits(&shared_lse[rows.clone()], &lse[rows.clone()]),
                    "{what}: lse of a shared selection differs from per-head"
                );
                let rows = rows.start * d..rows.end * d;
                assert!(
                    same_bits(&shared_out[rows.clone()], &out[rows]),
                    "{what}: out of a shared selection differs from per-head"
                );
            }
        }
    }
}

/// Token selections: a random subset of each row's positions, in random order.
fn random_tokens(
    lens: &[i32],
    kv_heads: usize,
    rng: &mut Rng,
    same_count: bool,
) -> (Vec<i32>, Vec<i32>, usize) {
    let max_len = lens.iter().copied().max().unwrap_or(0) as usize;
    let mut ids = vec![-1; lens.len() * kv_heads * max_len];
    let mut counts = vec![0; lens.len() * kv_heads];
    for (s, &l) in lens.iter().enumerate() {
        let l = l as usize;
        let keep = rng.range(1, l + 1);
        for h in 0..kv_heads {
            let mut all: Vec<i32> = (0..l as i32).collect();
            for i in (1..l).rev() {
                all.swap(i, rng.range(0, i + 1));
            }
            let n = if same_count {
                keep
            } else {
                rng.range(0, l + 1)
            };
            let mut row = all[..n].to_vec();
            if same_count {
                row.sort_unstable();
            }
            let r = s * kv_heads + h;
            ids[r * max_len..r * max_len + n].copy_from_slice(&row);
            counts[r] = n as i32;
        }
    }
    (ids, counts, max_len)
}

fn token_and_compaction<T: Element>(shape: Shape, seed: u64) {
    let mut rng = Rng::new(seed);
    let mut case = Case::<T>::random(Shape { mode: 0, ..shape }, &mut rng);
    decorate(&mut case, &mut rng, true);
    let l = case.layout();
    let hq = case.params.q_heads;
    let d = l.head_dim;
    let (ids, counts, max_len) = random_tokens(&case.lens, l.kv_heads, &mut rng, false);
    let sel = Selection {
        ids: &ids,
        lens: &counts,
        max_len,
    };
    let mut out = vec![0.0; case.total_q() * hq * d];
    let mut lse = vec![0.0; case.total_q() * hq];
    token_sparse_attention(
        &case.q,
        &case.kv,
        &case.meta(),
        &sel,
        &case.params,
        AttnOut {
            out: &mut out,
            lse: Some(&mut lse),
        },
    )
    .expect("valid tokens");
    let chosen = |s: usize, h: usize, pos: usize| {
        let r = s * l.kv_heads + h;
        ids[r * max_len..r * max_len + counts[r] as usize].contains(&(pos as i32))
    };
    let (want_out, want_lse) = case.oracle(&chosen);
    assert_close("token out", &out, &want_out, TOL);
    assert_close("token lse", &lse, &want_lse, TOL);

    // Compaction then dense equals token-level attention over the kept tokens (no window: the
    // compacted positions are new).
    case.params.window = None;
    let (keep, keep_lens, keep_max) = random_tokens(&case.lens, l.kv_heads, &mut rng, true);
    let keep_sel = Selection {
        ids: &keep,
        lens: &keep_lens,
        max_len: keep_max,
    };
    let mut tok_out = vec![0.0; case.total_q() * hq * d];
    token_sparse_attention(
        &case.q,
        &case.kv,
        &case.meta(),
        &keep_sel,
        &case.params,
        AttnOut {
            out: &mut tok_out,
            lse: None,
        },
    )
    .expect("valid keep list");
    let new_lens = compact_kv(
        &mut case.kv,
        &case.lens,
        &case.table,
        case.max_blocks,
        &keep_sel,
    )
    .expect("sorted keep list");
    case.lens = new_lens;
    let (compact_out, _) = dense(&case);
    for (a, b) in compact_out.iter().zip(&tok_out) {
        assert!(
            (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
            "compacted dense {a} vs token-level {b}"
        );
    }
}

fn merge_of_chunks<T: Element>(shape: Shape, seed: u64) {
    let mut rng = Rng::new(seed);
    let case = Case::<T>::random(shape, &mut rng);
    let l = case.layout();
    let hq = case.params.q_heads;
    let d = l.head_dim;
    let rows = case.total_q() * hq;
    // Split every sequence's positions into three disjoint chunks by a random cut.
    let mut parts = Vec::new();
    let cut_a = rng.range(0, 70);
    let cut_b = cut_a + rng.range(0, 70);
    for (lo, hi) in [(0, cut_a), (cut_a, cut_b), (cut_b, usize::MAX)] {
        let max_len = case.lens.iter().copied().max().unwrap_or(0) as usize;
        let mut ids = vec![-1; case.lens.len() * l.kv_heads * max_len];
        let mut counts = vec![0; case.lens.len() * l.kv_heads];
        for (s, &len) in case.lens.iter().enumerate() {
            let row: Vec<i32> = (0..len)
                .filter(|&p| (p as usize) >= lo && (p as usize) < hi)
                .collect();
            for h in 0..l.kv_heads {
                let r = s * l.kv_heads + h;
                ids[r * max_len..r * max_len + row.len()].copy_from_slice(&row);
                counts[r] = row.len() as i32;
            }
        }
        let mut out = vec![0.0; rows * d];
        let mut lse = vec![0.0; rows];
        let sel = Selection {
            ids: &ids,
            lens: &counts,
            max_len,
        };
        token_sparse_attention(
            &case.q,
            &case.kv,
            &case.meta(),
            &sel,
            &case.params,
            AttnOut {
                out: &mut out,
                lse: Some(&mut lse),
            },
        )
        .expect("valid chunk");
        parts.push((out, lse));
    }
    let views: Vec<AttnPart<'_>> = parts
        .iter()
        .map(|(o, l)| AttnPart { out: o, lse: l })
        .collect();
    let mut out = vec![0.0; rows * d];
    let mut lse = vec![0.0; rows];
    merge_attention(&views, d, &mut out, &mut lse).expect("same shapes");
    let (want_out, want_lse) = case.oracle(&|_, _, _| true);
    assert_close("merged out", &out, &want_out, TOL);
    assert_close("merged lse", &lse, &want_lse, TOL);
}

/// Results depend on the logical KV only: neither the thread count, nor the block size of the
/// pool, nor whether every token is attended densely or as a token-level selection changes a bit.
fn layout_and_thread_count_do_not_change_results<T: Element>(shape: Shape, seed: u64) {
    let mut rng = Rng::new(seed);
    let mut case = Case::<T>::random(shape, &mut rng);
    decorate(&mut case, &mut rng, true);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("a pool");
    let want = dense(&case);
    let check = |what: &str, got: &(Vec<f32>, Vec<f32>)| {
        assert!(
            same_bits(&got.0, &want.0) && same_bits(&got.1, &want.1),
            "{what} changes the result"
        );
    };
    check("one thread", &pool.install(|| dense(&case)));
    let bs = [1, 3, 5, 16, 32][rng.range(0, 5)];
    let other = case.reblock(bs, &mut rng);
    check(&format!("blocks of {bs}"), &dense(&other));
    let l = other.layout();
    let all = |sel_bs: usize, rng: &mut Rng| {
        let (ids, lens, max_len) = random_selection(&other.lens, l.kv_heads, sel_bs, rng, true);
        let sel = Selection {
            ids: &ids,
            lens: &lens,
            max_len,
        };
        gather_page_offsets(&sel, sel_bs, &other.lens, sel_bs, l.kv_heads).expect("valid")
    };
    let pages = all(bs, &mut rng);
    check(
        &format!("every page selected over blocks of {bs}"),
        &sparse_run(&other, &pages),
    );
    let tokens = all(1, &mut rng);
    let hq = other.params.q_heads;
    let mut out = vec![0.0; other.total_q() * hq * l.head_dim];
    let mut lse = vec![0.0; other.total_q() * hq];
    token_sparse_attention(
        &other.q,
        &other.kv,
        &other.meta(),
        &tokens.as_selection(),
        &other.params,
        AttnOut {
            out: &mut out,
            lse: Some(&mut lse),
        },
    )
    .expect("valid selection");
    check(
        &format!("every token selected over blocks of {bs}"),
        &(out, lse),
    );
}

/// Runs a property for the three element types.
macro_rules! all_dtypes {
    ($f:ident, $shape:expr, $seed:expr) => {{
        $f::<f32>($shape, $seed);
        $f::<f16>($shape, $seed);
        $f::<bf16>($shape, $seed);
    }};
}

/// 48 cases by default; `PROPTEST_CASES` raises it for soak runs.
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(48)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn dense_attention_matches_the_f64_oracle(shape in shape(), seed in any::<u64>()) {
        all_dtypes!(dense_matches_oracle, shape, seed);
    }

    #[test]
    fn sparse_pages_match_the_oracle_and_all_pages_equal_dense_bitwise(shape in shape(), seed in any::<u64>()) {
        all_dtypes!(sparse_properties, shape, seed);
    }

    #[test]
    fn token_sparse_matches_the_oracle_and_equals_compaction(shape in shape(), seed in any::<u64>()) {
        all_dtypes!(token_and_compaction, shape, seed);
    }

    #[test]
    fn merged_chunks_equal_one_shot_attention(shape in shape(), seed in any::<u64>()) {
        all_dtypes!(merge_of_chunks, shape, seed);
    }

    #[test]
    fn results_depend_on_neither_the_layout_nor_the_thread_count(shape in shape(), seed in any::<u64>()) {
        all_dtypes!(layout_and_thread_count_do_not_change_results, shape, seed);
    }
}

/// Two sequences of up to 3000 tokens, blocks of 4: lists long enough to split.
fn long_lists() -> Shape {
    Shape {
        seqs: 2,
        block_size: 4,
        kv_heads: 2,
        group: 4,
        head_dim: 16,
        max_kv: 3000,
        mode: 0,
    }
}

#[test]
fn long_context_splits_merge_to_the_oracle() {
    // Up to 3000 tokens: up to 188 chunks of 16 positions, cut into splits of 16 chunks (a
    // short list aims at about 16 splits), so up to 12 KV splits merge.
    let shape = long_lists();
    for seed in 0..3 {
        dense_matches_oracle::<bf16>(shape, seed);
    }
}

#[test]
fn long_lists_split_alike_whatever_the_threads_or_the_layout() {
    // Lists of up to 3000 tokens split into up to 12 units, which the threads walk in tasks
    // cut by their count and merge pairwise as the units end: neither may change a bit.
    let shape = long_lists();
    for seed in 0..2 {
        all_dtypes!(layout_and_thread_count_do_not_change_results, shape, seed);
    }
}

#[test]
fn bf16_dot_products_match_the_oracle_at_head_dim_128() {
    // The shape of record's head dim, GQA 4 and 8 (row blocks of 4 and 8), chunks with an odd
    // number of weighted tokens and masked ones (windows); a power-of-two scale keeps the
    // queries exact in bf16, as TOL_BF16_DOT assumes.
    for (seed, group) in [(0, 4), (1, 8), (2, 4), (3, 8)] {
        let shape = Shape {
            seqs: 2,
            block_size: 16,
            kv_heads: 2,
            group,
            head_dim: 128,
            max_kv: 700,
            mode: 0,
        };
        let mut rng = Rng::new(seed);
        let mut case = Case::<bf16>::random(shape, &mut rng);
        decorate(&mut case, &mut rng, true);
        case.params.scale = 1.0 / 16.0;
        let (want_out, want_lse) = case.oracle(&|_, _, _| true);
        case.params.simd = Simd::Avx512Bf16;
        let (out, lse) = dense(&case);
        assert_close("bf16 dot out", &out, &want_out, TOL_BF16_DOT);
        assert_close("bf16 dot lse", &lse, &want_lse, TOL_BF16_DOT);
    }
}

/// A prefill of groups of 3 query heads, whose one-head jobs take every row of a chunk below
/// the query tile in one step (the chunk kernels' blocks span query positions), against the
/// same heads among groups of 4, whose jobs take a position's rows at a time (the bf16
/// build's in its fused step): each head's output and log-sum-exp must be the same bits, in
/// every build and cache type.
fn rows_across_positions_equal_rows_by_position<T: Element>(seed: u64) {
    let mut rng = Rng::new(seed);
    let shape = Shape {
        seqs: 2,
        block_size: 16,
        kv_heads: 2,
        group: 4,
        head_dim: 64,
        max_kv: 200,
        mode: 1,
    };
    let mut four = Case::<T>::random(shape, &mut rng);
    let (kvh, d, total_q) = (shape.kv_heads, shape.head_dim, four.total_q());
    // Heads 0..3 of each group of four, as groups of three.
    let q: Vec<T> = (0..total_q * kvh * 3)
        .flat_map(|r| {
            let (t, h, g) = (r / (kvh * 3), r / 3 % kvh, r % 3);
            let at = ((t * kvh + h) * 4 + g) * d;
            four.q[at..at + d].to_vec()
        })
        .collect();
    let mut three = Case {
        kv: four.kv.clone(),
        q,
        cu: four.cu.clone(),
        lens: four.lens.clone(),
        table: four.table.clone(),
        max_blocks: four.max_blocks,
        params: attn_op::AttnParams::new(kvh * 3, d),
    };
    for simd in [Simd::Avx2, Simd::Auto, Simd::Avx512Bf16] {
        (three.params.simd, four.params.simd) = (simd, simd);
        let (out3, lse3) = dense(&three);
        let (out4, lse4) = dense(&four);
        for t in 0..total_q {
            for h in 0..kvh {
                for g in 0..3 {
                    let (r3, r4) = ((t * kvh + h) * 3 + g, (t * kvh + h) * 4 + g);
                    let what = format!("{simd:?}, query {t}, KV head {h}, head {g}");
                    assert_eq!(lse3[r3].to_bits(), lse4[r4].to_bits(), "{what}: lse");
                    assert!(
                        same_bits(&out3[r3 * d..(r3 + 1) * d], &out4[r4 * d..(r4 + 1) * d]),
                        "{what}: out"
                    );
                }
            }
        }
    }
}

#[test]
fn prefill_rows_across_positions_equal_rows_by_position() {
    for seed in 0..4 {
        rows_across_positions_equal_rows_by_position::<f32>(seed);
        rows_across_positions_equal_rows_by_position::<f16>(seed);
        rows_across_positions_equal_rows_by_position::<bf16>(seed);
    }
}
