//! The AVX2 body of the page sweep: a page row's `kmax` and `kmin` widened once, in registers,
//! for four query heads, each channel's summary picked by a blend on its side's sign bit.
//! It adds exactly what the generic body adds, in the same order, so the bits agree.

use std::arch::x86_64::*;

use half::{bf16, f16};

use super::{Side, Weights, walk};

/// Whether this CPU runs [`sweep_chunk`] (AVX2, FMA and F16C).
pub(super) fn usable() -> bool {
    std::is_x86_feature_detected!("avx2")
        && std::is_x86_feature_detected!("fma")
        && std::is_x86_feature_detected!("f16c")
}

/// An element type whose eight values widen to one f32 vector.
pub(super) trait Lanes: Copy {
    /// The eight values from `p`, exactly as f32.
    ///
    /// # Safety
    /// The CPU must have AVX2 and F16C, and `p` must point at eight readable values.
    unsafe fn load8(p: *const Self) -> __m256;
}

impl Lanes for f32 {
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> __m256 {
        // SAFETY: the caller's contract; an unaligned load.
        unsafe { _mm256_loadu_ps(p) }
    }
}

impl Lanes for bf16 {
    #[inline(always)]
    unsafe fn load8(p: *const bf16) -> __m256 {
        // SAFETY: the caller's contract; a bf16 is the high half of the f32 of its value.
        unsafe {
            let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast::<__m128i>()));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h))
        }
    }
}

impl Lanes for f16 {
    #[inline(always)]
    unsafe fn load8(p: *const f16) -> __m256 {
        // SAFETY: the caller's contract; F16C widens exactly.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast::<__m128i>())) }
    }
}

/// The generic body's sweep (`super::sweep_chunk_generic`) for groups of whole fours over `d`
/// a whole number of 16s, over the same walk (`super::walk`).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; every group's `g` must be a multiple of 4 and its
/// `d` equal `d`, a multiple of 16; `local` must hold `[w.len(), g, pages.len()]` scores.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn sweep_chunk<E: Lanes>(
    w: &[Weights<'_>],
    reps: &[E],
    d: usize,
    pages: std::ops::Range<usize>,
    local: &mut [f32],
) {
    let m = pages.len();
    walk(w.len(), reps, d, pages, |h, i, row| {
        let wh = &w[h];
        for j in (0..wh.g).step_by(4) {
            // SAFETY: the row holds `2 * d` values (the walk's slice) and heads `j..j + 4` lie
            // in the group (`g` a multiple of 4); the caller's CPU has this function's
            // features.
            let s = unsafe { four(wh, j, row.as_ptr(), d) };
            for (t, x) in s.into_iter().enumerate() {
                local[(h * wh.g + j + t) * m + i] = x;
            }
        }
    });
}

/// Heads `j..j + 4` of `wh` scored against one page row (`kmax` then `kmin`, `d` values each):
/// each head's 16 lanes (lanes 0-7 from the first 8 of each 16 channels, 8-15 from the last
/// 8), a product rounded and then added, then its lanes summed in order from 0.0.
///
/// # Safety
/// As [`sweep_chunk`]; `row` must point at `2 * d` values and `j + 4 <= wh.g`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn four<E: Lanes>(wh: &Weights<'_>, j: usize, row: *const E, d: usize) -> [f32; 4] {
    debug_assert!(j + 4 <= wh.g && wh.w.len() >= wh.g * d);
    let w = wh.w[j * d..(j + 4) * d].as_ptr();
    // Each half's (lanes 0-7, 8-15) sums of the four heads.
    let mut acc = [[_mm256_setzero_ps(); 4]; 2];
    let mut i = 0;
    while i < d {
        for (half, o) in [(0, i), (1, i + 8)] {
            // SAFETY: `o + 8 <= d`: within both halves of the row and every head's weights
            // (and the shared sides, `d` of them).
            unsafe {
                let (kx, kn) = (
                    opaque(E::load8(row.add(o))),
                    opaque(E::load8(row.add(d + o))),
                );
                let shared = match wh.side {
                    Side::Own => None,
                    Side::Shared(side) => Some(_mm256_blendv_ps(
                        kx,
                        kn,
                        _mm256_loadu_ps(side[..d].as_ptr().add(o)),
                    )),
                };
                for (t, a) in acc[half].iter_mut().enumerate() {
                    let wv = _mm256_loadu_ps(w.add(t * d + o));
                    let k = shared.unwrap_or_else(|| _mm256_blendv_ps(kx, kn, wv));
                    *a = _mm256_add_ps(*a, _mm256_mul_ps(wv, k));
                }
            }
        }
        i += 16;
    }
    // Lane `l` of the four heads side by side: the four heads' sums then take one chain of
    // 16 adds in lane order from 0.0, as each head's alone would.
    let mut s = _mm_setzero_ps();
    for [r0, r1, r2, r3] in acc {
        let (t0, t1) = (_mm256_unpacklo_ps(r0, r1), _mm256_unpackhi_ps(r0, r1));
        let (t2, t3) = (_mm256_unpacklo_ps(r2, r3), _mm256_unpackhi_ps(r2, r3));
        // Lane `l` of the half in the low 128 bits, lane `l + 4` in the high.
        let by_lane = [
            _mm256_shuffle_ps::<0x44>(t0, t2),
            _mm256_shuffle_ps::<0xee>(t0, t2),
            _mm256_shuffle_ps::<0x44>(t1, t3),
            _mm256_shuffle_ps::<0xee>(t1, t3),
        ];
        for v in by_lane {
            s = _mm_add_ps(s, _mm256_castps256_ps128(v));
        }
        for v in by_lane {
            s = _mm_add_ps(s, _mm256_extractf128_ps::<1>(v));
        }
    }
    let mut out = [0.0f32; 4];
    // SAFETY: `out` holds 4 floats.
    unsafe { _mm_storeu_ps(out.as_mut_ptr(), s) };
    out
}

/// `v` itself, through an empty `asm!` that the compiler cannot see into: without it LLVM
/// turned the blend of two widened bf16 vectors into a byte blend of the narrow values (a
/// compare, a pack and a blend a vector, its registers spilled), twice as slow a page.
#[inline]
#[target_feature(enable = "avx")]
fn opaque(mut v: __m256) -> __m256 {
    // SAFETY: the template is empty: it reads and writes only the register it is given.
    unsafe { std::arch::asm!("/* {0} */", inout(ymm_reg) v, options(pure, nomem, nostack)) };
    v
}
