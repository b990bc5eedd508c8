//! The AVX-512F build: sixteen f32 lanes, every cache type widened to f32 before its
//! multiply-adds.

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

use crate::{DType, Element};

use super::{
    EXP_CLAMP, EXP_POLY, FIXED_HEAD_DIM, LN2_HI, LN2_LO, SMALL_HEAD_DIM, chunk_axpy, exp_tail,
    qk_block,
};

#[inline]
#[target_feature(enable = "avx512f")]
pub(super) fn exp16(x: __m512) -> __m512 {
    let x = _mm512_max_ps(x, _mm512_set1_ps(EXP_CLAMP));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
    );
    let r = _mm512_fmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    let r = _mm512_fmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    let mut p = _mm512_set1_ps(EXP_POLY[0]);
    for c in &EXP_POLY[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
    }
    let y = _mm512_fmadd_ps(
        _mm512_mul_ps(p, r),
        r,
        _mm512_add_ps(r, _mm512_set1_ps(1.0)),
    );
    let e = _mm512_slli_epi32::<23>(_mm512_cvtps_epi32(n));
    _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(y), e))
}

/// # Safety
/// The CPU must support AVX-512F.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn exp_weights(scores: &mut [f32], m: f32) -> f32 {
    let n = scores.len();
    let p = scores.as_mut_ptr();
    let mv = _mm512_set1_ps(m);
    let mut sum = _mm512_setzero_ps();
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: `i + 16 <= n`: 16 floats read-writable at `p + i`.
        unsafe {
            let w = weigh16(_mm512_loadu_ps(p.add(i)), mv);
            _mm512_storeu_ps(p.add(i), w);
            sum = _mm512_add_ps(sum, w);
        }
        i += 16;
    }
    _mm512_reduce_add_ps(sum) + exp_tail(&mut scores[i..], m)
}

/// `exp(s - m)` of 16 scores, exactly 0 where a score is -inf (masked).
#[inline]
#[target_feature(enable = "avx512f")]
fn weigh16(s: __m512, m: __m512) -> __m512 {
    let keep = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(s, _mm512_set1_ps(f32::NEG_INFINITY));
    _mm512_maskz_mov_ps(keep, exp16(_mm512_sub_ps(s, m)))
}

/// [`exp_weights`] of 4 rows of 16 scores (`stride` apart from `scores`; row `r` against
/// `m[r]`, its sum added to `l[r]`), the rows' exponentials side by side: the same operations,
/// so the same bits (the AVX2 build's `exp_rows4`).
///
/// # Safety
/// The CPU must support AVX-512F; `scores` must hold `3 * stride + 16` floats.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn exp_rows4(scores: *mut f32, stride: usize, m: &[f32], l: &mut [f32]) {
    debug_assert!(m.len() == 4 && l.len() == 4);
    let mut w = [_mm512_setzero_ps(); 4];
    for (r, w) in w.iter_mut().enumerate() {
        // SAFETY: row `r < 4` holds 16 floats (the caller's contract).
        *w = weigh16(
            unsafe { _mm512_loadu_ps(scores.add(r * stride)) },
            _mm512_set1_ps(m[r]),
        );
    }
    for (r, w) in w.iter().enumerate() {
        // SAFETY: as above.
        unsafe { _mm512_storeu_ps(scores.add(r * stride), *w) };
    }
    for (l, w) in l.iter_mut().zip(w) {
        // `exp_weights`' sum of a row of 16: its one vector across the lanes.
        *l += _mm512_reduce_add_ps(w);
    }
}

/// # Safety
/// The CPU must support AVX-512F.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn row_max(row: &[f32]) -> f32 {
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut acc = ninf;
    for part in row.chunks(16) {
        let live: __mmask16 = super::first_lanes(part.len());
        // SAFETY: the mask reads only `part`'s elements.
        let x = unsafe { _mm512_mask_loadu_ps(ninf, live, part.as_ptr()) };
        // `max(x, acc)` keeps `acc` where `x` is NaN, as `f32::max` ignores NaN.
        acc = _mm512_max_ps(x, acc);
    }
    _mm512_reduce_max_ps(acc)
}

/// The tokens `t < len` whose weight is not 0 in any of the `rows` rows of `w` (`stride`
/// apart), as a lane mask.
///
/// # Safety
/// The CPU must support AVX-512F; `w` must hold rows `rows` of `stride >= 16` weights.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn live_tokens(w: *const f32, stride: usize, rows: usize, len: usize) -> u16 {
    debug_assert!(stride >= 16 && len <= 16);
    let mut live: __mmask16 = 0;
    for r in 0..rows {
        // SAFETY: row `r` holds 16 weights.
        let x = unsafe { _mm512_loadu_ps(w.add(r * stride)) };
        live |= _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(x, _mm512_setzero_ps());
    }
    let in_chunk: u16 = super::first_lanes(len);
    live & in_chunk
}

/// 16 lanes of a buffer of `dtype` from element `i`, widened to f32.
///
/// # Safety
/// `p` must point at `i + 16` or more elements of `dtype`.
#[inline(always)]
unsafe fn load16(p: *const u8, dtype: DType, i: usize) -> __m512 {
    // SAFETY: the caller's contract; unaligned loads.
    unsafe {
        match dtype {
            DType::F32 => _mm512_loadu_ps(p.cast::<f32>().add(i)),
            DType::F16 => {
                _mm512_cvtph_ps(_mm256_loadu_si256(p.cast::<u16>().add(i).cast::<__m256i>()))
            }
            DType::BF16 => {
                let h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                    p.cast::<u16>().add(i).cast::<__m256i>(),
                ));
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(h))
            }
        }
    }
}

/// Two vectors in the lane order `load_pair` gives for `dtype`, back in element order.
#[inline]
#[target_feature(enable = "avx512f")]
fn in_order(dtype: DType, a: __m512, b: __m512) -> (__m512, __m512) {
    if dtype == DType::BF16 {
        let lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
        let hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
        (
            _mm512_permutex2var_ps(a, lo, b),
            _mm512_permutex2var_ps(a, hi, b),
        )
    } else {
        (a, b)
    }
}

/// # Safety
/// The CPU must support AVX-512F; `q` must hold `R * n` f32, `k` `n` elements of
/// `dtype`, `out` `R` f32.
#[target_feature(enable = "avx512f")]
unsafe fn dot_rows_r<const R: usize>(
    q: *const f32,
    n: usize,
    k: *const u8,
    dtype: DType,
    out: *mut f32,
) {
    let mut acc = [[_mm512_setzero_ps(); 1]; R];
    // SAFETY: the caller's contract.
    let i = unsafe { block_dots::<R, 1, 0>((q, n), (&[k], dtype), &mut acc) };
    for (r, [a]) in acc.iter().enumerate() {
        let mut s = _mm512_reduce_add_ps(*a);
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
#[target_feature(enable = "avx512f")]
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
/// [`super::pair_order`] of 16 lanes for bf16 keys; `n` a multiple of 16) and the chunk's
/// keys (`n` elements of `dtype` each, at most 16; lanes past `keys.len()` get 0): bit for
/// bit the sums [`dot_rows`] makes, for a chunk at once. Rows go in blocks of up to 8 and
/// keys `16 / rows` at a time, so that each widened key slice serves the block's rows. Each
/// row's 16 sums are then reduced in one tree ([`super::fold`] by [`sum_level`]) that adds
/// lanes in the order `_mm512_reduce_add_ps` does.
///
/// # Safety
/// The CPU must support AVX-512F; `q` must hold `rows * n` floats, each key `n` elements of
/// `dtype`, and `scores` `(rows - 1) * stride + 16` floats.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn qk_chunk(
    (q, n, rows): (*const f32, usize, usize),
    (keys, dtype): (&[*const u8], DType),
    scores: *mut f32,
    stride: usize,
    ahead: &super::Ahead<'_>,
) {
    debug_assert!(!keys.is_empty() && keys.len() <= 16 && n.is_multiple_of(16));
    let (all, live) = super::pad16(keys);
    super::row_blocks(rows, |r0, block| {
        let ahead = ahead.for_rows_from(r0);
        // SAFETY: rows `r0..r0 + block` are within the caller's `rows`, of `q` and of
        // `scores` alike.
        unsafe {
            let (q, out) = (q.add(r0 * n), (scores.add(r0 * stride), stride));
            // The constant shapes are those of this build's `chunk_axpy!` list (P·V).
            match (block, n) {
                (4, FIXED_HEAD_DIM) => {
                    qk_rows::<4, 4, FIXED_HEAD_DIM>(q, n, (&all, dtype), out, (live, ahead));
                }
                (4, SMALL_HEAD_DIM) => {
                    qk_rows::<4, 4, SMALL_HEAD_DIM>(q, n, (&all, dtype), out, (live, ahead));
                }
                (8, _) => qk_rows::<8, 2, 0>(q, n, (&all, dtype), out, (live, ahead)),
                (4, _) => qk_rows::<4, 4, 0>(q, n, (&all, dtype), out, (live, ahead)),
                (2, _) => qk_rows::<2, 8, 0>(q, n, (&all, dtype), out, (live, ahead)),
                _ => qk_rows::<1, 16, 0>(q, n, (&all, dtype), out, (live, ahead)),
            }
        }
    });
}

/// [`qk_chunk`] for `R` rows, the keys taken `B` at a time (`R * B = 16` accumulators); `N`
/// is the head dim where it is a constant ([`super::FIXED_HEAD_DIM`],
/// [`super::SMALL_HEAD_DIM`]), else 0 (`n` then).
/// A block of `B` aligned keys is a subtree of the first levels of [`super::fold`]; the
/// blocks' results go through the rest.
///
/// # Safety
/// As [`qk_chunk`], for `R` rows of `q` and of the scores.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn qk_rows<const R: usize, const B: usize, const N: usize>(
    q: *const f32,
    n: usize,
    (keys, dtype): (&[*const u8; 16], DType),
    (scores, stride): (*mut f32, usize),
    (live, ahead): (__mmask16, &super::Ahead<'_>),
) {
    let split = B.trailing_zeros() as usize;
    let level = |k, u, w| sum_level(k, u, w);
    // `B = 16 / R`, so each row has `R` blocks.
    debug_assert_eq!(R * B, 16);
    // Each block's sums are written once below before any is read, so the array starts
    // uninitialized (an array of zero vectors costs a `memset` a call).
    let mut blocks = [[MaybeUninit::<__m512>::uninit(); R]; R];
    for (b, block) in keys.chunks_exact(B).enumerate() {
        ahead.part(b, B, n * dtype.size());
        let mut acc = [[_mm512_setzero_ps(); B]; R];
        // SAFETY: the caller's contract (`n` a multiple of 16, so whole vectors cover it).
        unsafe { block_dots::<R, B, N>((q, n), (block, dtype), &mut acc) };
        for r in 0..R {
            blocks[r][b].write(super::fold(&mut acc[r], 0..split, level));
        }
    }
    // SAFETY: the loop wrote every block of every row (`keys` holds `16 = R * B` keys, so
    // `b` took every value below `R`), and `MaybeUninit<__m512>` has the layout of `__m512`.
    let blocks = unsafe { &mut *(&raw mut blocks).cast::<[[__m512; R]; R]>() };
    // The tree leaves token `t` in lane `4 (t % 4) + t / 4`.
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    for (r, row) in blocks.iter_mut().enumerate() {
        let sums = _mm512_permutexvar_ps(order, super::fold(row, split..4, level));
        // SAFETY: row `r`'s 16 scores are within the caller's bound.
        unsafe { _mm512_storeu_ps(scores.add(r * stride), _mm512_maskz_mov_ps(live, sums)) };
    }
}

/// Level `level` of the lane-sum tree of [`qk_chunk`]: neighbours `u` and `w` combined.
/// Over 16 vectors, levels 0 to 4 leave vector `t`'s lane sum in lane `4 (t % 4) + t /
/// 4`, added as `_mm512_reduce_add_ps` adds: lanes `i` and `i + 8`, then `i` and `i + 4`,
/// `i` and `i + 2`, `i` and `i + 1`.
#[inline]
#[target_feature(enable = "avx512f")]
fn sum_level(level: usize, u: __m512, w: __m512) -> __m512 {
    match level {
        0 => _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(u, w),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(u, w),
        ),
        1 => _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(u, w),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(u, w),
        ),
        2 => {
            let (u, w) = (_mm512_castps_pd(u), _mm512_castps_pd(w));
            _mm512_add_ps(
                _mm512_castpd_ps(_mm512_unpacklo_pd(u, w)),
                _mm512_castpd_ps(_mm512_unpackhi_pd(u, w)),
            )
        }
        _ => _mm512_add_ps(
            _mm512_shuffle_ps::<0b10_00_10_00>(u, w),
            _mm512_shuffle_ps::<0b11_01_11_01>(u, w),
        ),
    }
}

qk_block!(
    16,
    __m512,
    _mm512_setzero_ps,
    _mm512_fmadd_ps,
    _mm512_loadu_ps,
    load16,
    4
);

chunk_axpy!(
    "avx512f",
    "AVX-512F",
    row_blocks,
    [8, 4, 2],
    [(4, FIXED_HEAD_DIM), (4, SMALL_HEAD_DIM)],
    16,
    __m512,
    _mm512_setzero_ps,
    _mm512_set1_ps,
    _mm512_fmadd_ps,
    _mm512_loadu_ps,
    _mm512_storeu_ps,
    _mm512_add_ps,
    load16,
    (
        __m512i,
        _mm512_loadu_si512,
        _mm512_and_si512,
        _mm512_set1_epi32,
        _mm512_slli_epi32,
        _mm512_castsi512_ps
    )
);
