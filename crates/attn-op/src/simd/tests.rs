//! The chunk kernels against the per-key (and per-row) ones they stand for, bit for bit.

use half::{bf16, f16};

use super::{AVX2, AVX512, avx2, avx512, detect, dot_rows, exp_rows, exp_weights};
use crate::Element;

/// A fixed-seed stream of values in `[-1, 1)`, never all zero.
struct Values(u64);

impl Values {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Runs `qk_chunk` of the build `isa` over `keys` keys of head dim `d` and `rows` query rows,
/// and checks each score against that build's `dot_rows` for the same key, bit for bit, and
/// the lanes past the chunk's keys for zero.
fn check<T: Element, const ISA: u8>(rows: usize, keys: usize, d: usize, seed: u64) {
    let mut v = Values(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let q: Vec<f32> = (0..rows * d).map(|_| v.next()).collect();
    let k: Vec<Vec<T>> = (0..keys)
        .map(|_| (0..d).map(|_| T::from_f32(4.0 * v.next())).collect())
        .collect();
    let ptrs: Vec<*const u8> = k.iter().map(|k| k.as_ptr().cast::<u8>()).collect();
    const STRIDE: usize = 20;
    let mut scores = vec![f32::NAN; rows * STRIDE];
    // SAFETY: the caller checked that this CPU runs `ISA`; `q` holds `rows` rows of `d`, each
    // key `d` elements, and `scores` `rows` rows of `STRIDE >= 16`.
    unsafe {
        if ISA == AVX512 {
            avx512::qk_chunk(
                (q.as_ptr(), d, rows),
                (&ptrs, T::DTYPE),
                scores.as_mut_ptr(),
                STRIDE,
                &super::Ahead::NONE,
            );
        } else {
            avx2::qk_chunk::<T>(
                (q.as_ptr(), d, rows),
                &ptrs,
                scores.as_mut_ptr(),
                STRIDE,
                &super::Ahead::NONE,
            );
        }
    }
    let mut want = vec![0.0f32; rows];
    for (t, key) in k.iter().enumerate() {
        dot_rows::<T, ISA>(&q, d, key, &mut want);
        for (r, w) in want.iter().enumerate() {
            let got = scores[r * STRIDE + t];
            assert_eq!(
                got.to_bits(),
                w.to_bits(),
                "{:?} build {ISA}, {rows} rows, key {t} of {keys}, d {d}: {got} against {w}",
                T::DTYPE
            );
        }
    }
    for r in 0..rows {
        for t in keys..16 {
            assert_eq!(scores[r * STRIDE + t], 0.0, "lane {t} past {keys} keys");
        }
    }
}

/// Every row count the row blocks take (1 to 8, and 9 to 13 for blocks after blocks), every
/// key count of a chunk, and head dims of one vector, a few and the models' 128.
fn check_all<const ISA: u8>(width: usize) {
    let mut seed = 1;
    for d in [width, 3 * width, 128] {
        for rows in 1..=13 {
            for keys in 1..=16 {
                seed += 1;
                check::<f32, ISA>(rows, keys, d, seed);
                check::<f16, ISA>(rows, keys, d, seed);
                check::<bf16, ISA>(rows, keys, d, seed);
            }
        }
    }
}

/// Each chunk kernel this CPU runs (AVX2, and AVX-512F where present).
#[test]
fn chunk_dots_equal_per_key_dots() {
    let isa = detect();
    if isa >= AVX2 {
        check_all::<AVX2>(8);
    }
    if isa >= AVX512 {
        check_all::<AVX512>(16);
    }
}

/// `exp_rows` of `rows` rows of `len` scores (some masked, -inf) against each row's
/// `exp_weights`, weights and sums bit for bit.
fn check_exp_rows<const ISA: u8>(rows: usize, len: usize, seed: u64) {
    const STRIDE: usize = 16;
    let mut v = Values(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let scores: Vec<f32> = (0..rows * STRIDE)
        .map(|_| match v.next() {
            x if x < -0.8 => f32::NEG_INFINITY,
            x => 30.0 * x,
        })
        .collect();
    let m: Vec<f32> = (0..rows).map(|_| 30.0 + v.next()).collect();
    let l0: Vec<f32> = (0..rows).map(|_| 2.0 + v.next()).collect();
    let (mut got, mut got_l) = (scores.clone(), l0.clone());
    exp_rows::<ISA>(&mut got, (STRIDE, len), &m, &mut got_l);
    let (mut want, mut want_l) = (scores, l0);
    for r in 0..rows {
        want_l[r] += exp_weights::<ISA>(&mut want[r * STRIDE..r * STRIDE + len], m[r]);
    }
    let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let at = format!("build {ISA}, {rows} rows of {len}");
    assert_eq!(bits(&got), bits(&want), "weights, {at}");
    assert_eq!(bits(&got_l), bits(&want_l), "sums, {at}");
}

/// Row counts below, at and past the blocks of 4, full rows and short ones.
#[test]
fn exp_rows_equal_per_row_weights() {
    let isa = detect();
    let mut seed = 1;
    for rows in 1..=9 {
        for len in [1, 7, 15, 16] {
            seed += 1;
            if isa >= AVX2 {
                check_exp_rows::<AVX2>(rows, len, seed);
            }
            if isa >= AVX512 {
                check_exp_rows::<AVX512>(rows, len, seed);
            }
            check_exp_rows::<{ super::PORTABLE }>(rows, len, seed);
        }
    }
}
