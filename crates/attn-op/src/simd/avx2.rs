//! The AVX2 build (AVX2, FMA and F16C): eight f32 lanes, f16 widened by F16C and bf16 by a shift.

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

use crate::{DType, Element};

use super::{
    EXP_CLAMP, EXP_POLY, FIXED_HEAD_DIM, LN2_HI, LN2_LO, SMALL_HEAD_DIM, chunk_axpy, exp_tail,
    qk_block,
};

#[inline]
#[target_feature(enable = "avx2,fma")]
fn hsum(v: __m256) -> f32 {
    let x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps::<1>(x, x)))
}

#[inline]
#[target_feature(enable = "avx2,fma")]
fn exp8(x: __m256) -> __m256 {
    let x = _mm256_max_ps(x, _mm256_set1_ps(EXP_CLAMP));
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm256_fmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    let r = _mm256_fmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    let mut p = _mm256_set1_ps(EXP_POLY[0]);
    for c in &EXP_POLY[1..] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
    }
    let y = _mm256_fmadd_ps(
        _mm256_mul_ps(p, r),
        r,
        _mm256_add_ps(r, _mm256_set1_ps(1.0)),
    );
    let e = _mm256_slli_epi32::<23>(_mm256_cvtps_epi32(n));
    _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(y), e))
}

/// # Safety
/// The CPU must support AVX2 and FMA.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn exp_weights(scores: &mut [f32], m: f32) -> f32 {
    let n = scores.len();
    let p = scores.as_mut_ptr();
    let mv = _mm256_set1_ps(m);
    let mut sum = _mm256_setzero_ps();
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: `i + 8 <= n`: 8 floats read-writable at `p + i`.
        unsafe {
            let w = weigh8(_mm256_loadu_ps(p.add(i)), mv);
            _mm256_storeu_ps(p.add(i), w);
            sum = _mm256_add_ps(sum, w);
        }
        i += 8;
    }
    hsum(sum) + exp_tail(&mut scores[i..], m)
}

/// `exp(s - m)` of 8 scores, exactly 0 where a score is -inf (masked).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn weigh8(s: __m256, m: __m256) -> __m256 {
    let keep = _mm256_cmp_ps::<_CMP_GT_OQ>(s, _mm256_set1_ps(f32::NEG_INFINITY));
    _mm256_and_ps(exp8(_mm256_sub_ps(s, m)), keep)
}

/// [`exp_weights`] of 4 rows of 16 scores (`stride` apart from `scores`; row `r` against
/// `m[r]`, its sum added to `l[r]`), with the rows' exponentials side by side rather than one
/// row after another: the same operations, so the same bits, in about 5 % less time a decode
/// (BENCHMARKS.md, session 70).
///
/// # Safety
/// The CPU must support AVX2 and FMA; `scores` must hold `3 * stride + 16` floats.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn exp_rows4(scores: *mut f32, stride: usize, m: &[f32], l: &mut [f32]) {
    debug_assert!(m.len() == 4 && l.len() == 4);
    let mut w = [_mm256_setzero_ps(); 8];
    for (i, w) in w.iter_mut().enumerate() {
        // SAFETY: row `i / 2 < 4` holds 16 floats (the caller's contract).
        let s = unsafe { _mm256_loadu_ps(scores.add(i / 2 * stride + i % 2 * 8)) };
        *w = weigh8(s, _mm256_set1_ps(m[i / 2]));
    }
    for (i, w) in w.iter().enumerate() {
        // SAFETY: as above.
        unsafe { _mm256_storeu_ps(scores.add(i / 2 * stride + i % 2 * 8), *w) };
    }
    for (r, l) in l.iter_mut().enumerate() {
        // `exp_weights`' sum of a row of 16: its two vectors added, then across the lanes.
        *l += hsum(_mm256_add_ps(w[2 * r], w[2 * r + 1]));
    }
}

/// 8 lanes of a buffer of `dtype` from element `i`, widened to f32.
///
/// # Safety
/// `p` must point at `i + 8` or more elements of `dtype`.
#[inline(always)]
unsafe fn load8(p: *const u8, dtype: DType, i: usize) -> __m256 {
    // SAFETY: the caller's contract; unaligned loads.
    unsafe {
        match dtype {
            DType::F32 => _mm256_loadu_ps(p.cast::<f32>().add(i)),
            DType::F16 => {
                _mm256_cvtph_ps(_mm_loadu_si128(p.cast::<u16>().add(i).cast::<__m128i>()))
            }
            DType::BF16 => {
                let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(
                    p.cast::<u16>().add(i).cast::<__m128i>(),
                ));
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h))
            }
        }
    }
}

/// Two vectors in the lane order `load_pair` gives for `dtype`, back in element order.
#[inline]
#[target_feature(enable = "avx2")]
fn in_order(dtype: DType, a: __m256, b: __m256) -> (__m256, __m256) {
    if dtype == DType::BF16 {
        // Elements 0-3 and 8-11 interleaved, then 4-7 and 12-15.
        let (lo, hi) = (_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
        (
            _mm256_permute2f128_ps::<0x20>(lo, hi),
            _mm256_permute2f128_ps::<0x31>(lo, hi),
        )
    } else {
        (a, b)
    }
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C; `q` must hold `R * n` f32, `k` `n` elements of
/// `dtype`, `out` `R` f32.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_rows_r<const R: usize>(
    q: *const f32,
    n: usize,
    k: *const u8,
    dtype: DType,
    out: *mut f32,
) {
    let mut acc = [[_mm256_setzero_ps(); 1]; R];
    // SAFETY: the caller's contract.
    let i = unsafe { block_dots::<R, 1, 0>((q, n), (&[k], dtype), &mut acc) };
    for (r, [a]) in acc.iter().enumerate() {
        let mut s = hsum(*a);
        for j in i..n {
            // SAFETY: `j < n`: within `k` and row `r` of `q`.
            s += unsafe { *q.add(r * n + j) * super::load_one(k, dtype, j) };
        }
        // SAFETY: `r < R`.
        unsafe { *out.add(r) = s };
    }
}

/// # Safety
/// As `dot_rows_r`, for `rows` rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_rows(
    q: *const f32,
    n: usize,
    k: *const u8,
    dtype: DType,
    out: *mut f32,
    rows: usize,
) {
    super::row_blocks(rows, |r, block| {
        // SAFETY: rows `r..r + block` are within the `rows` rows of the caller's contract.
        unsafe {
            let (q, out) = (q.add(r * n), out.add(r));
            match block {
                8 => dot_rows_r::<8>(q, n, k, dtype, out),
                4 => dot_rows_r::<4>(q, n, k, dtype, out),
                2 => dot_rows_r::<2>(q, n, k, dtype, out),
                _ => dot_rows_r::<1>(q, n, k, dtype, out),
            }
        }
    });
}

/// `scores[r * stride + t] = q_r · k_t` for the `rows` rows of `q` (f32, `n` per row, in
/// [`super::pair_order`] of 8 lanes for bf16 keys; `n` a multiple of 8) and the chunk's keys
/// (`n` elements of `dtype` each, at most 16; lanes past `keys.len()` get 0): bit for bit the
/// sums [`dot_rows`] makes, for a chunk at once. Rows go in blocks of up to 4 and keys 2, 2,
/// 4 or 8 at a time (at most eight accumulators), so that each widened key slice serves the
/// block's rows (8 rows of one key each would load 8 query slices for each key slice). Each
/// row's sums are then reduced eight keys at a time in one tree ([`super::fold`] by
/// [`sum_level`]) that adds lanes in the order [`hsum`] does.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `q` must hold `rows * n` floats, each key `n` elements
/// of `dtype`, and `scores` `(rows - 1) * stride + 16` floats.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn qk_chunk<T: Element>(
    (q, n, rows): (*const f32, usize, usize),
    keys: &[*const u8],
    scores: *mut f32,
    stride: usize,
    ahead: &super::Ahead<'_>,
) {
    debug_assert!(!keys.is_empty() && keys.len() <= 16 && n.is_multiple_of(8));
    let (all, live) = super::pad16(keys);
    super::row_blocks4(rows, |r0, block| {
        let ahead = ahead.for_rows_from(r0);
        // SAFETY: rows `r0..r0 + block` are within the caller's `rows`, of `q` and of
        // `scores` alike.
        unsafe {
            let (q, out) = (q.add(r0 * n), (scores.add(r0 * stride), stride));
            // The constant shapes are those of this build's `chunk_axpy!` list (P·V).
            match (block, n) {
                (4, FIXED_HEAD_DIM) => {
                    qk_rows::<T, 4, 2, 8, FIXED_HEAD_DIM>(q, n, &all, out, (live, ahead));
                }
                (4, SMALL_HEAD_DIM) => {
                    qk_rows::<T, 4, 2, 8, SMALL_HEAD_DIM>(q, n, &all, out, (live, ahead));
                }
                (3, SMALL_HEAD_DIM) => {
                    qk_rows::<T, 3, 2, 8, SMALL_HEAD_DIM>(q, n, &all, out, (live, ahead));
                }
                (4, _) => qk_rows::<T, 4, 2, 8, 0>(q, n, &all, out, (live, ahead)),
                (3, _) => qk_rows::<T, 3, 2, 8, 0>(q, n, &all, out, (live, ahead)),
                (2, _) => qk_rows::<T, 2, 4, 4, 0>(q, n, &all, out, (live, ahead)),
                _ => qk_rows::<T, 1, 8, 2, 0>(q, n, &all, out, (live, ahead)),
            }
        }
    });
}

/// [`qk_chunk`] for `R` rows, the keys taken `B` at a time (`R * B <= 8` accumulators), in
/// `H = 16 / B` blocks; `N` is the head dim where it is a constant
/// ([`super::FIXED_HEAD_DIM`], [`super::SMALL_HEAD_DIM`]), else 0 (`n` then). A block of `B`
/// aligned keys is a subtree of the first levels of [`super::fold`]; each half chunk's `8 / B`
/// blocks (eight keys) go through the rest.
///
/// # Safety
/// As [`qk_chunk`], for `R` rows of `q` and of the scores.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn qk_rows<T: Element, const R: usize, const B: usize, const H: usize, const N: usize>(
    q: *const f32,
    n: usize,
    keys: &[*const u8; 16],
    (scores, stride): (*mut f32, usize),
    (live, ahead): (u16, &super::Ahead<'_>),
) {
    let split = B.trailing_zeros() as usize;
    let level = |k, u, w| sum_level(k, u, w);
    // Each row has `H` blocks, `H / 2` a half chunk.
    let half_blocks = H / 2;
    debug_assert_eq!(H * B, 16);
    // Each block's sums are written once below before any is read, so the array starts
    // uninitialized: an array of zero vectors cost a `memset` a call.
    let mut blocks = [[MaybeUninit::<__m256>::uninit(); H]; R];
    for (b, block) in keys.chunks_exact(B).enumerate() {
        ahead.part(b, B, n * size_of::<T>());
        let mut acc = [[_mm256_setzero_ps(); B]; R];
        // SAFETY: the caller's contract (`n` a multiple of 8, so whole vectors cover it).
        unsafe { block_dots::<R, B, N>((q, n), (block, T::DTYPE), &mut acc) };
        for r in 0..R {
            blocks[r][b].write(super::fold(&mut acc[r], 0..split, level));
        }
    }
    // SAFETY: the loop wrote every block of every row (`keys` holds `16 = H * B` keys, so
    // `b` took every value below `H`), and `MaybeUninit<__m256>` has the layout of `__m256`.
    let blocks = unsafe { &mut *(&raw mut blocks).cast::<[[__m256; H]; R]>() };
    // The tree leaves token `t` of a half in lane `t / 2` (even `t`) or `4 + t / 2` (odd).
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    for (r, row) in blocks.iter_mut().enumerate() {
        for half in 0..2 {
            let sums = super::fold(
                &mut row[half * half_blocks..(half + 1) * half_blocks],
                split..3,
                level,
            );
            let sums = _mm256_permutevar8x32_ps(sums, order);
            let lanes = _mm256_set1_epi32(i32::from(live >> (8 * half)));
            let keep = _mm256_cmpeq_epi32(_mm256_and_si256(lanes, bit), bit);
            // SAFETY: row `r`'s 16 scores are within the caller's bound.
            unsafe {
                _mm256_storeu_ps(
                    scores.add(r * stride + 8 * half),
                    _mm256_and_ps(sums, _mm256_castsi256_ps(keep)),
                );
            }
        }
    }
}

/// Level `level` of the lane-sum tree of [`qk_chunk`]: neighbours `u` and `w` combined.
/// Over 8 vectors, levels 0 to 2 leave vector `t`'s lane sum in lane `t / 2` (even `t`) or
/// `4 + t / 2` (odd), added as [`hsum`] adds: lanes `i` and `i + 4`, then `i` and `i + 2`,
/// then `i` and `i + 1`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn sum_level(level: usize, u: __m256, w: __m256) -> __m256 {
    match level {
        0 => _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(u, w),
            _mm256_permute2f128_ps::<0x31>(u, w),
        ),
        1 => {
            let (u, w) = (_mm256_castps_pd(u), _mm256_castps_pd(w));
            _mm256_add_ps(
                _mm256_castpd_ps(_mm256_unpacklo_pd(u, w)),
                _mm256_castpd_ps(_mm256_unpackhi_pd(u, w)),
            )
        }
        _ => _mm256_add_ps(
            _mm256_shuffle_ps::<0b10_00_10_00>(u, w),
            _mm256_shuffle_ps::<0b11_01_11_01>(u, w),
        ),
    }
}

/// # Safety
/// The CPU must support AVX2.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn row_max(row: &[f32]) -> f32 {
    let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut acc = ninf;
    let mut parts = row.chunks_exact(8);
    for part in parts.by_ref() {
        // SAFETY: `part` holds 8 floats.
        let x = unsafe { _mm256_loadu_ps(part.as_ptr()) };
        // `max(x, acc)` keeps `acc` where `x` is NaN, as `f32::max` ignores NaN.
        acc = _mm256_max_ps(x, acc);
    }
    // The lanes hold no NaN (above), so a vector maximum across them is theirs.
    let x = _mm_max_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
    let x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    let x = _mm_max_ss(x, _mm_shuffle_ps::<1>(x, x));
    parts
        .remainder()
        .iter()
        .copied()
        .fold(_mm_cvtss_f32(x), f32::max)
}

/// The tokens `t < len` whose weight is not 0 in any of the `rows` rows of `w` (`stride`
/// apart), as a lane mask.
///
/// # Safety
/// The CPU must support AVX2; `w` must hold rows `rows` of `stride >= 16` weights.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn live_tokens(w: *const f32, stride: usize, rows: usize, len: usize) -> u16 {
    debug_assert!(stride >= 16 && len <= 16);
    let zero = _mm256_setzero_ps();
    let (mut lo, mut hi) = (0, 0);
    for r in 0..rows {
        // SAFETY: row `r` holds 16 weights.
        unsafe {
            let p = w.add(r * stride);
            lo |= _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_NEQ_UQ>(_mm256_loadu_ps(p), zero));
            hi |= _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_NEQ_UQ>(
                _mm256_loadu_ps(p.add(8)),
                zero,
            ));
        }
    }
    ((lo | hi << 8) as u16) & super::first_lanes(len)
}

qk_block!(
    8,
    __m256,
    _mm256_setzero_ps,
    _mm256_fmadd_ps,
    _mm256_loadu_ps,
    load8,
    2
);

chunk_axpy!(
    "avx2,fma,f16c",
    "AVX2, FMA and F16C",
    row_blocks4,
    [4, 3, 2],
    [
        (4, FIXED_HEAD_DIM),
        (4, SMALL_HEAD_DIM),
        (3, SMALL_HEAD_DIM)
    ],
    8,
    __m256,
    _mm256_setzero_ps,
    _mm256_set1_ps,
    _mm256_fmadd_ps,
    _mm256_loadu_ps,
    _mm256_storeu_ps,
    _mm256_add_ps,
    load8,
    (
        __m256i,
        _mm256_loadu_si256,
        _mm256_and_si256,
        _mm256_set1_epi32,
        _mm256_slli_epi32,
        _mm256_castsi256_ps
    )
);
