//! The decode matmul's inner kernel for quantized weights on x86-64 with AVX2 and FMA: each
//! block of 32 weights is unpacked into four 8-lane vectors (`d · q + m`) and multiplied
//! straight into the accumulators of every input row, without a dequantized copy.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use crate::gguf::DType;

/// Input rows the kernel takes at once (the fused path runs fewer than 8).
pub(crate) const MAX_ROWS: usize = 7;

/// Whether [`tile_dot`] handles `dtype`.
pub(crate) fn supports(dtype: DType) -> bool {
    matches!(dtype, DType::Q8_0 | DType::Q4_0 | DType::Q4_1)
}

/// `dst[i * stride + r] = x_i · w_r` for the weight rows `w` (each `row_bytes` long, `cols`
/// weights of `dtype`) and the `n ≤ MAX_ROWS` input rows of `x`.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `dtype` must be one [`supports`] accepts; `x` must
/// hold `n × cols` values and `dst` `(n - 1) × stride + rows` of `w`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(
    clippy::too_many_arguments,
    reason = "the tile, its row encoding and the inputs, each distinct"
)]
pub(crate) unsafe fn tile_dot(
    dtype: DType,
    w: &[u8],
    row_bytes: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    dst: &mut [f32],
    stride: usize,
) {
    let n = n.min(MAX_ROWS);
    let (_, bytes) = dtype.block();
    let blocks = cols / 32;
    assert!(
        x.len() >= n * cols && blocks * bytes <= row_bytes,
        "qdot::tile_dot: the caller sizes x and rows from the layer's shape"
    );
    for (r, row) in w.chunks_exact(row_bytes).enumerate() {
        let mut acc = [_mm256_setzero_ps(); MAX_ROWS];
        for b in 0..blocks {
            let blk = &row[b * bytes..(b + 1) * bytes];
            // SAFETY: `blk` holds one whole block of `dtype` (checked above), which is all
            // `unpack` reads; AVX2/FMA/F16C are enabled on this function.
            let wv = unsafe { unpack(dtype, blk) };
            for (i, a) in acc.iter_mut().enumerate().take(n) {
                let xb = &x[i * cols + b * 32..i * cols + b * 32 + 32];
                for (k, &wk) in wv.iter().enumerate() {
                    // SAFETY: `xb` holds 32 floats, so each 8-float load at 8k is in bounds.
                    let xv = unsafe { _mm256_loadu_ps(xb.as_ptr().add(8 * k)) };
                    *a = _mm256_fmadd_ps(wk, xv, *a);
                }
            }
        }
        for (i, a) in acc.iter().enumerate().take(n) {
            dst[i * stride + r] = hsum(*a);
        }
    }
}

/// One block's 32 weights as four vectors of 8, in order.
///
/// # Safety
/// AVX2, FMA and F16C; `blk` is one whole block of `dtype`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn unpack(dtype: DType, blk: &[u8]) -> [__m256; 4] {
    let h = |i: usize| half::f16::from_le_bytes([blk[i], blk[i + 1]]).to_f32();
    let d = _mm256_set1_ps(h(0));
    match dtype {
        // SAFETY: a Q8_0 block is 2 + 32 bytes; the load reads bytes 2..34.
        DType::Q8_0 => unsafe {
            let q = _mm256_loadu_si256(blk.as_ptr().add(2).cast());
            let lo = _mm256_castsi256_si128(q);
            let hi = _mm256_extracti128_si256::<1>(q);
            let f = |v: __m128i| _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)));
            [
                f(lo),
                f(_mm_srli_si128::<8>(lo)),
                f(hi),
                f(_mm_srli_si128::<8>(hi)),
            ]
        },
        // SAFETY: a Q4_0 block is 2 + 16 bytes, a Q4_1 block 4 + 16; the load reads the 16
        // after the header.
        DType::Q4_0 | DType::Q4_1 => unsafe {
            let (m, at) = if dtype == DType::Q4_1 {
                (_mm256_set1_ps(h(2)), 4)
            } else {
                (_mm256_set1_ps(-8.0 * h(0)), 2)
            };
            let q = _mm_loadu_si128(blk.as_ptr().add(at).cast());
            let mask = _mm_set1_epi8(0x0f);
            let lo = _mm_and_si128(q, mask);
            let hi = _mm_and_si128(_mm_srli_epi16::<4>(q), mask);
            let f = |v: __m128i| _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), m);
            [
                f(lo),
                f(_mm_srli_si128::<8>(lo)),
                f(hi),
                f(_mm_srli_si128::<8>(hi)),
            ]
        },
        _ => [_mm256_setzero_ps(); 4],
    }
}

/// The sum of a vector's 8 lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
    _mm_cvtss_f32(s)
}
