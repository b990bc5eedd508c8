//! Quest's bound, its representations and its selection, as properties over random data.

use attn_op::{DType, Element};
use half::{bf16, f16};
use proptest::prelude::*;
use sparse_algo::summary::{self, Summary};
use sparse_algo::{
    AlwaysInclude, KeySource, Quest, QuestConfig, RepPool, SparseAlgorithm, quest_bound,
};

use crate::util::{Case, Rng};

/// Shape knobs of a random Quest case.
#[derive(Clone, Copy, Debug)]
struct Shape {
    seqs: usize,
    kv_heads: usize,
    group: usize,
    head_dim: usize,
    page_size: usize,
    block_size: usize,
    max_len: usize,
}

fn shape() -> impl Strategy<Value = Shape> {
    (
        1..3usize,
        1..3usize,
        1..4usize,
        1..40usize,
        1..9usize,
        1..5usize,
        1..160usize,
    )
        .prop_map(
            |(seqs, kv_heads, group, head_dim, page_size, bs_pow, max_len)| Shape {
                seqs,
                kv_heads,
                group,
                head_dim,
                page_size,
                block_size: 1 << (bs_pow - 1),
                max_len,
            },
        )
}

fn case<T: Element>(sh: Shape, seed: u64) -> Case<T> {
    let mut rng = Rng::new(seed);
    let stride = sh.kv_heads * sh.head_dim;
    let keys: Vec<Vec<f32>> = (0..sh.seqs)
        .map(|_| {
            let len = rng.range(1, sh.max_len + 1);
            rng.vec(len * stride, 3.0)
        })
        .collect();
    let q = rng.vec(sh.seqs * sh.kv_heads * sh.group * sh.head_dim, 2.0);
    Case::new(
        &keys,
        q,
        sh.kv_heads * sh.group,
        sh.kv_heads,
        sh.head_dim,
        sh.block_size,
        &mut rng,
    )
}

/// Quest over pages of `ps` with a budget of `budget_pages` pages, no forced pages, and the
/// given head sharing and summary.
fn quest(ps: usize, budget_pages: usize, shared_heads: bool, summary: Summary) -> Quest {
    Quest::new(QuestConfig {
        page_size: ps,
        budget_tokens: budget_pages * ps,
        always: AlwaysInclude::default(),
        shared_heads,
        summary,
    })
    .expect("valid config")
}

/// Builds Quest's f32 pool for a case.
fn built<T: Element>(quest: &Quest, c: &Case<T>, sh: Shape) -> RepPool {
    built_in(quest, c, sh, DType::F32)
}

/// Builds Quest's pool of `elem` values for a case.
fn built_in<T: Element>(quest: &Quest, c: &Case<T>, sh: Shape, elem: DType) -> RepPool {
    let keys = c.keys();
    let mut pool = RepPool::with_elem(
        quest.rep_shape(sh.kv_heads, sh.head_dim),
        elem,
        1,
        sh.seqs,
        sh.max_len,
    )
    .expect("a small pool");
    quest
        .construct_representations(0, &keys, &c.slots, &mut pool)
        .expect("valid construction");
    pool
}

/// The stored bound of an E4M3 summary: the least (`up`) or greatest E4M3 value times `2^e`
/// at or beyond `x`, found by walking every finite E4M3 value.
fn outward(x: f32, e: i32, up: bool) -> f32 {
    let s = 2f32.powi(e);
    let mut best: Option<f32> = None;
    for c in 0..=255u8 {
        if c & 0x7f == 0x7f {
            continue;
        }
        let v = summary::e4m3_value(c) * s;
        let ok = if up { v >= x } else { v <= x };
        let better = best.is_none_or(|b| if up { v < b } else { v > b });
        if ok && better {
            best = Some(v);
        }
    }
    best.expect("|x| within 448 * 2^e") + 0.0
}

/// The upper-bound property for one dtype: every page's stored `[kmax ‖ kmin]` is the
/// elementwise max/min of its keys (with E4M3 summaries, the nearest scaled E4M3 values
/// outward of them), and for every query head the bound is at least every `q · k` of the page
/// (computed in f64), up to f32 rounding of the bound's own sum.
fn check_bound<T: Element>(sh: Shape, seed: u64, summary: Summary) -> Result<(), TestCaseError> {
    let c = case::<T>(sh, seed);
    let ps = sh.page_size;
    let quest = quest(ps, 1, false, summary);
    let pool = built(&quest, &c, sh);
    let d = sh.head_dim;
    let q_heads = sh.kv_heads * sh.group;
    for (s, &len) in c.ulens.iter().enumerate() {
        let reps = pool.pages(0, s).expect("slot in range");
        prop_assert_eq!(reps.len(), len.div_ceil(ps) * sh.kv_heads * 2 * d);
        for p in 0..len.div_ceil(ps) {
            for h in 0..sh.kv_heads {
                let base = (p * sh.kv_heads + h) * 2 * d;
                let (kmax, kmin) = reps[base..base + 2 * d].split_at(d);
                let keys: Vec<Vec<f32>> = (p * ps..((p + 1) * ps).min(len))
                    .map(|t| c.key(s, t, h))
                    .collect();
                let exact: Vec<f32> = (0..2 * d)
                    .map(|i| {
                        let col = keys.iter().map(|k| k[i % d]);
                        if i < d {
                            col.fold(f32::NEG_INFINITY, f32::max)
                        } else {
                            col.fold(f32::INFINITY, f32::min)
                        }
                    })
                    .collect();
                let e = summary::scale_exp(&exact);
                for i in 0..d {
                    let (hi, lo) = (exact[i], exact[d + i]);
                    let want = match summary {
                        Summary::Exact => (hi, lo),
                        Summary::E4m3 => (outward(hi, e, true), outward(lo, e, false)),
                    };
                    prop_assert_eq!((kmax[i], kmin[i]), want, "page {} head {} dim {}", p, h, i);
                }
                for j in h * sh.group..(h + 1) * sh.group {
                    let q = &c.q[(s * q_heads + j) * d..(s * q_heads + j + 1) * d];
                    let bound = f64::from(quest_bound(q, kmax, kmin));
                    let slack: f64 = q
                        .iter()
                        .zip(kmax.iter().zip(kmin))
                        .map(|(&a, (&b, &e))| f64::from(a.abs() * b.abs().max(e.abs())))
                        .sum::<f64>()
                        * 1e-5;
                    for k in &keys {
                        let dot: f64 = q
                            .iter()
                            .zip(k)
                            .map(|(&a, &b)| f64::from(a) * f64::from(b))
                            .sum();
                        prop_assert!(
                            bound >= dot - slack,
                            "page {p} head {h} q head {j}: bound {bound} < q.k {dot}"
                        );
                    }
                }
            }
        }
    }
    Ok(())
}

/// Quest's selection equals a brute-force one: forced pages, then the best pages by the
/// maximum over the group of [`quest_bound`], ties to the lower page; and with a budget that
/// covers the context, every page. With `shared_heads` the maximum runs over every query head
/// and every KV head gets the same pages.
fn check_selection(
    sh: Shape,
    seed: u64,
    budget_pages: usize,
    shared_heads: bool,
    summary: Summary,
) -> Result<(), TestCaseError> {
    let c = case::<f32>(sh, seed);
    let ps = sh.page_size;
    let quest = quest(ps, budget_pages, shared_heads, summary);
    let pool = built(&quest, &c, sh);
    let top = quest
        .retrieve_topk(&c.step(None), &pool)
        .expect("valid step");
    let d = sh.head_dim;
    let q_heads = sh.kv_heads * sh.group;
    for (s, &len) in c.ulens.iter().enumerate() {
        let pages = len.div_ceil(ps);
        let reps = pool.pages(0, s).expect("slot in range");
        for h in 0..sh.kv_heads {
            let expected: Vec<i32> = if pages <= budget_pages {
                (0..pages as i32).collect()
            } else {
                let current = (len - 1) / ps;
                let mut scored: Vec<(f32, usize)> = (0..current)
                    .map(|p| {
                        let bound = |h: usize| {
                            let base = (p * sh.kv_heads + h) * 2 * d;
                            let (kmax, kmin) = reps[base..base + 2 * d].split_at(d);
                            (h * sh.group..(h + 1) * sh.group)
                                .map(|j| {
                                    let q = &c.q[(s * q_heads + j) * d..(s * q_heads + j + 1) * d];
                                    quest_bound(q, kmax, kmin)
                                })
                                .fold(f32::NEG_INFINITY, f32::max)
                        };
                        let best = if shared_heads {
                            (0..sh.kv_heads)
                                .map(bound)
                                .fold(f32::NEG_INFINITY, f32::max)
                        } else {
                            bound(h)
                        };
                        (best, p)
                    })
                    .collect();
                scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
                let mut ids: Vec<i32> = scored
                    .iter()
                    .take(budget_pages - (pages - current))
                    .map(|&(_, p)| p as i32)
                    .collect();
                ids.extend(current as i32..pages as i32);
                ids.sort_unstable();
                ids
            };
            prop_assert_eq!(top.row(s, h), &expected[..], "seq {} head {}", s, h);
        }
    }
    Ok(())
}

/// A 16-bit pool against the f32 pool of the same keys: each `kmax` is the least value of the
/// pool's type at or above the f32 pool's, each `kmin` the greatest at or below (a brute-force
/// walk over the neighbours of the nearest value), in half the bytes. Where the bounds are
/// values of that type already (keys of that type, or E4M3 summaries in bf16), the values and
/// the selections are the f32 pool's; elsewhere the outward rounding keeps them bounds.
fn check_half_pool<T: Element>(
    sh: Shape,
    seed: u64,
    budget_pages: usize,
    summary: Summary,
    elem: DType,
) -> Result<(), TestCaseError> {
    let c = case::<T>(sh, seed);
    let ps = sh.page_size;
    let quest = quest(ps, budget_pages, false, summary);
    let (wide, narrow) = (built(&quest, &c, sh), built_in(&quest, &c, sh, elem));
    prop_assert_eq!(narrow.elem(), elem);
    prop_assert_eq!(2 * narrow.bytes(), wide.bytes());
    // The type's value of bits `b`, and the bits of its nearest value to `x`.
    let value = |b: u16| match elem {
        DType::BF16 => bf16::from_bits(b).to_f32(),
        _ => f16::from_bits(b).to_f32(),
    };
    let nearest = |x: f32| match elem {
        DType::BF16 => bf16::from_f32(x).to_bits(),
        _ => f16::from_f32(x).to_bits(),
    };
    // The least (`up`) or greatest value at or beyond `x`, among the neighbours of its nearest.
    let outward = |x: f32, up: bool| -> f32 {
        let n = nearest(x);
        let near = [
            n.wrapping_sub(1),
            n,
            n.wrapping_add(1),
            0x0001,
            0x8001,
            0,
            0x8000,
        ];
        near.into_iter()
            .map(value)
            .filter(|v| !v.is_nan() && if up { *v >= x } else { *v <= x })
            .reduce(|a, b| if up == (b < a) { b } else { a })
            .expect("a neighbour lies on each side")
    };
    let d = sh.head_dim;
    let exact = T::DTYPE == elem || (summary == Summary::E4m3 && elem == DType::BF16);
    for s in 0..sh.seqs {
        let (w, n) = (
            wide.pages(0, s).expect("slot"),
            narrow.pages(0, s).expect("slot"),
        );
        prop_assert_eq!(w.len(), n.len());
        for (i, (&x, &y)) in w.iter().zip(n.iter()).enumerate() {
            let up = i % (2 * d) < d;
            prop_assert_eq!(y, outward(x, up), "seq {} value {}: {} from {}", s, i, y, x);
            prop_assert!(!exact || x == y, "seq {} value {}: {} from {}", s, i, y, x);
        }
    }
    let (top_w, top_n) = (
        quest
            .retrieve_topk(&c.step(None), &wide)
            .expect("valid step"),
        quest
            .retrieve_topk(&c.step(None), &narrow)
            .expect("valid step"),
    );
    if exact {
        prop_assert_eq!(top_w, top_n);
    }
    Ok(())
}

/// 64 cases by default; `PROPTEST_CASES` raises it for soak runs.
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn quest_page_score_bounds_every_key_of_the_page(sh in shape(), seed in any::<u64>()) {
        for summary in [Summary::Exact, Summary::E4m3] {
            check_bound::<f32>(sh, seed, summary)?;
            check_bound::<f16>(sh, seed, summary)?;
            check_bound::<bf16>(sh, seed, summary)?;
        }
    }

    #[test]
    fn quest_selects_by_the_bound_and_everything_within_budget(
        sh in shape(), seed in any::<u64>(), budget in 1..12usize, shared in any::<bool>(),
        e4m3 in any::<bool>(),
    ) {
        let summary = if e4m3 { Summary::E4m3 } else { Summary::Exact };
        check_selection(sh, seed, budget, shared, summary)?;
        check_selection(sh, seed, sh.max_len.div_ceil(sh.page_size), shared, summary)?;
    }

    #[test]
    fn a_16_bit_pool_rounds_outward_and_selects_alike_where_exact(
        sh in shape(), seed in any::<u64>(), budget in 1..12usize,
    ) {
        for summary in [Summary::Exact, Summary::E4m3] {
            for elem in [DType::BF16, DType::F16] {
                check_half_pool::<f32>(sh, seed, budget, summary, elem)?;
                check_half_pool::<f16>(sh, seed, budget, summary, elem)?;
                check_half_pool::<bf16>(sh, seed, budget, summary, elem)?;
            }
        }
    }

    #[test]
    fn update_after_decode_equals_construction(
        sh in shape(), seed in any::<u64>(), cut in 0..100usize, e4m3 in any::<bool>(),
    ) {
        let c = case::<bf16>(sh, seed);
        let summary = if e4m3 { Summary::E4m3 } else { Summary::Exact };
        let quest = quest(sh.page_size, 1, false, summary);
        let whole = built(&quest, &c, sh);
        // The same sequences, first cut short (as after prefill), then extended (as decode does).
        let short: Vec<i32> = c.lens.iter().map(|&l| l - (cut as i32 % l)).collect();
        let keys = sparse_algo::PagedKeys::new(&c.kv, &short, &c.table, c.max_blocks).expect("valid");
        let mut pool = RepPool::new(quest.rep_shape(sh.kv_heads, sh.head_dim), 1, sh.seqs, sh.max_len).expect("pool");
        quest.construct_representations(0, &keys, &c.slots, &mut pool).expect("construct");
        quest.update_representations(0, &c.keys(), &c.slots, &mut pool).expect("update");
        for s in 0..sh.seqs {
            prop_assert_eq!(pool.tokens(0, s).expect("slot"), c.keys().seq_len(s));
            prop_assert_eq!(pool.pages(0, s).expect("slot"), whole.pages(0, s).expect("slot"));
        }
    }
}

/// nano-vllm scores a page with `max(q · kmin, q · kmax)`; that is not an upper bound, and the
/// bound Quest defines is. A fixed counterexample with two keys of two dimensions.
#[test]
fn the_max_of_two_dot_products_is_not_a_bound() {
    let keys = [[1.0f32, -1.0], [-1.0, 1.0]];
    let kmax = [1.0f32, 1.0];
    let kmin = [-1.0f32, -1.0];
    let q = [1.0f32, -1.0];
    let true_max = keys
        .iter()
        .map(|k| q[0] * k[0] + q[1] * k[1])
        .fold(f32::MIN, f32::max);
    let dot = |k: &[f32; 2]| q[0] * k[0] + q[1] * k[1];
    let nano = dot(&kmin).max(dot(&kmax));
    assert_eq!(true_max, 2.0);
    assert_eq!(
        nano, 0.0,
        "the two-dot-product score misses the key [1, -1]"
    );
    assert_eq!(quest_bound(&q, &kmax, &kmin), 2.0);
}

/// The device kernel (kernels/select.cu) adds `max(q kmax, q kmin)` per element, with NaN
/// queries read as 0, in the CPU's lane order; the CPU adds `q` times `kmax` or `kmin` as the
/// query's sign bit picks (`score.rs`; `wmax kmax + wmin kmin` before session 79). The two
/// must agree bit for bit, zeros of either sign and NaN queries included, or device selections
/// would differ from the CPU's.
#[test]
fn the_device_form_of_the_bound_is_bit_identical() {
    let mut rng = Rng::new(31);
    for d in [16, 48, 64, 128] {
        for round in 0..200 {
            let pick = |rng: &mut Rng| match rng.range(0, 8) {
                0 => 0.0,
                1 => -0.0,
                _ => rng.unit() * 2.0,
            };
            let (mut kmax, mut kmin) = (Vec::new(), Vec::new());
            for _ in 0..d {
                let (a, b) = (pick(&mut rng), pick(&mut rng));
                kmax.push(a.max(b));
                kmin.push(a.min(b));
            }
            let mut q: Vec<f32> = (0..d).map(|_| pick(&mut rng)).collect();
            if round % 7 == 0 {
                q[round % d] = f32::NAN;
            }
            let mut acc = [0.0f32; 16];
            for (i, ((&x, &hi), &lo)) in q.iter().zip(&kmax).zip(&kmin).enumerate() {
                let x = if x.is_nan() { 0.0 } else { x };
                acc[i % 16] += (x * hi).max(x * lo);
            }
            let device = acc.iter().fold(0.0f32, |s, &a| s + a);
            let cpu = quest_bound(&q, &kmax, &kmin);
            assert_eq!(device.to_bits(), cpu.to_bits(), "d {d}, round {round}");
        }
    }
}
