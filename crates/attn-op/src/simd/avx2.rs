//! The AVX2 build (AVX2, FMA and F16C): eight f32 lanes, f16 widened by F16C and bf16 by a shift.

use std::arch::x86_64::*;

use crate::{DType, Element};

use super::{EXP_CLAMP, EXP_POLY, LN2_HI, LN2_LO, chunk_axpy, exp_tail};

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
    let (mv, ninf) = (_mm256_set1_ps(m), _mm256_set1_ps(f32::NEG_INFINITY));
    let mut sum = _mm256_setzero_ps();
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: `i + 8 <= n`: 8 floats read-writable at `p + i`.
        unsafe {
            let s = _mm256_loadu_ps(p.add(i));
            let keep = _mm256_cmp_ps::<_CMP_GT_OQ>(s, ninf);
            let w = _mm256_and_ps(exp8(_mm256_sub_ps(s, mv)), keep);
            _mm256_storeu_ps(p.add(i), w);
            sum = _mm256_add_ps(sum, w);
        }
        i += 8;
    }
    hsum(sum) + exp_tail(&mut scores[i..], m)
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
    let mut acc = [_mm256_setzero_ps(); R];
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: `i + 8 <= n`: within `k` and within each of the `R` rows of `q`.
        unsafe {
            let kv = load8(k, dtype, i);
            for (r, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(r * n + i)), kv, *a);
            }
        }
        i += 8;
    }
    for (r, a) in acc.iter().enumerate() {
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

chunk_axpy!(
    "avx2,fma,f16c",
    "AVX2, FMA and F16C",
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
