//! The inner loops of attention in three builds: portable Rust, AVX2 + FMA + F16C, and
//! AVX-512F. `ISA` selects one at compile time; the kernel instantiates the SIMD builds only
//! inside functions compiled for those features and entered after `detect` found them, which
//! is the invariant every `unsafe` call below relies on.

use crate::{DType, Element};

/// Plain Rust (the compiler's baseline vectorization).
pub(crate) const PORTABLE: u8 = 0;
/// AVX2, FMA and F16C.
pub(crate) const AVX2: u8 = 1;
/// AVX-512F on top of AVX2, FMA and F16C.
pub(crate) const AVX512: u8 = 2;

/// The build to run for a requested level: the request, capped by what this CPU runs.
pub(crate) fn resolve(requested: crate::Simd) -> u8 {
    let want = match requested {
        crate::Simd::Portable => PORTABLE,
        crate::Simd::Avx2 => AVX2,
        crate::Simd::Avx512 | crate::Simd::Auto => AVX512,
    };
    want.min(detect())
}

/// The widest build this CPU runs.
fn detect() -> u8 {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx2") && has!("fma") && has!("f16c") {
            return if has!("avx512f") { AVX512 } else { AVX2 };
        }
    }
    PORTABLE
}

/// `a · b`.
#[inline(always)]
pub(crate) fn dot<const ISA: u8>(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    match ISA {
        // SAFETY: see the module doc: ISA > PORTABLE only runs on CPUs with those features.
        AVX512 => return unsafe { avx512::dot(a, b) },
        // SAFETY: as above.
        AVX2 => return unsafe { avx2::dot(a, b) },
        _ => {}
    }
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// `acc += w * v`.
#[inline(always)]
pub(crate) fn axpy<const ISA: u8>(acc: &mut [f32], w: f32, v: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    match ISA {
        // SAFETY: see the module doc.
        AVX512 => return unsafe { avx512::axpy(acc, w, v) },
        // SAFETY: see the module doc.
        AVX2 => return unsafe { avx2::axpy(acc, w, v) },
        _ => {}
    }
    for (a, x) in acc.iter_mut().zip(v) {
        *a += w * x;
    }
}

/// Replaces each score `s` by `exp(s - m)` (a masked score, -inf, by exactly 0) and returns
/// their sum.
#[inline(always)]
pub(crate) fn exp_weights<const ISA: u8>(scores: &mut [f32], m: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    match ISA {
        // SAFETY: see the module doc.
        AVX512 => return unsafe { avx512::exp_weights(scores, m) },
        // SAFETY: see the module doc.
        AVX2 => return unsafe { avx2::exp_weights(scores, m) },
        _ => {}
    }
    let mut sum = 0.0;
    for s in scores.iter_mut() {
        *s = if *s == f32::NEG_INFINITY {
            0.0
        } else {
            (*s - m).exp()
        };
        sum += *s;
    }
    sum
}

/// Widens `src` into `dst` (same length).
#[inline(always)]
pub(crate) fn widen<T: Element, const ISA: u8>(src: &[T], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if ISA != PORTABLE && T::DTYPE != DType::F32 {
        // `Element` is sealed: a DTYPE of F16 or BF16 means `half::f16` or `half::bf16`, both
        // `repr(transparent)` over `u16`.
        let bits = src.as_ptr().cast::<u16>();
        let n = src.len().min(dst.len());
        // SAFETY: `bits` points at `n` readable u16 (see above); the module doc covers ISA.
        unsafe {
            match (ISA, T::DTYPE) {
                (AVX512, DType::F16) => avx512::widen_f16(bits, dst.as_mut_ptr(), n),
                (AVX512, _) => avx512::widen_bf16(bits, dst.as_mut_ptr(), n),
                (_, DType::F16) => avx2::widen_f16(bits, dst.as_mut_ptr(), n),
                _ => avx2::widen_bf16(bits, dst.as_mut_ptr(), n),
            }
        }
        return;
    }
    T::slice_to_f32(src, dst);
}

/// `q · k` with `k` in its storage type, widened in registers (SIMD builds only).
#[inline(always)]
pub(crate) fn dot_mixed<T: Element, const ISA: u8>(q: &[f32], k: &[T]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        let n = q.len().min(k.len());
        let kp = k.as_ptr().cast::<u8>();
        match ISA {
            // SAFETY: `q` and `k` hold at least `n` elements, `k` of `T::DTYPE`; the module doc
            // covers ISA.
            AVX512 => return unsafe { avx512::dot_mixed(q.as_ptr(), kp, T::DTYPE, n) },
            // SAFETY: as above.
            AVX2 => return unsafe { avx2::dot_mixed(q.as_ptr(), kp, T::DTYPE, n) },
            _ => {}
        }
    }
    q.iter().zip(k).map(|(a, b)| a * b.to_f32()).sum()
}

/// `acc += w * v` with `v` in its storage type, widened in registers (SIMD builds only).
#[inline(always)]
pub(crate) fn axpy_mixed<T: Element, const ISA: u8>(acc: &mut [f32], w: f32, v: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        let n = acc.len().min(v.len());
        let vp = v.as_ptr().cast::<u8>();
        match ISA {
            // SAFETY: `acc` and `v` hold at least `n` elements, `v` of `T::DTYPE`; the module doc
            // covers ISA.
            AVX512 => return unsafe { avx512::axpy_mixed(acc.as_mut_ptr(), w, vp, T::DTYPE, n) },
            // SAFETY: as above.
            AVX2 => return unsafe { avx2::axpy_mixed(acc.as_mut_ptr(), w, vp, T::DTYPE, n) },
            _ => {}
        }
    }
    for (a, x) in acc.iter_mut().zip(v) {
        *a += w * x.to_f32();
    }
}

/// Widens element `i` of a buffer of `dtype` (the scalar tail of the mixed loops).
///
/// # Safety
/// `p` must point at more than `i` elements of `dtype`.
#[inline(always)]
unsafe fn load_one(p: *const u8, dtype: DType, i: usize) -> f32 {
    // SAFETY: the caller's contract; the reads are unaligned-safe.
    unsafe {
        match dtype {
            DType::F32 => p.cast::<f32>().add(i).read_unaligned(),
            DType::F16 => half::f16::from_bits(p.cast::<u16>().add(i).read_unaligned()).to_f32(),
            DType::BF16 => f32::from_bits(u32::from(p.cast::<u16>().add(i).read_unaligned()) << 16),
        }
    }
}

/// `exp` of a lane for the tails of the SIMD loops, with the same masking rule.
#[inline(always)]
fn exp_tail(scores: &mut [f32], m: f32) -> f32 {
    let mut total = 0.0;
    for s in scores {
        *s = if *s == f32::NEG_INFINITY {
            0.0
        } else {
            (*s - m).exp()
        };
        total += *s;
    }
    total
}

/// Widening of the last `< lanes` halves, shared by both SIMD builds.
///
/// # Safety
/// `src` must point at `n` readable u16 and `dst` at `n` writable f32.
#[inline(always)]
unsafe fn widen_tail(src: *const u16, dst: *mut f32, from: usize, n: usize, f16: bool) {
    for j in from..n {
        // SAFETY: `j < n`, within both buffers by the contract.
        unsafe {
            let h = *src.add(j);
            *dst.add(j) = if f16 {
                half::f16::from_bits(h).to_f32()
            } else {
                f32::from_bits(u32::from(h) << 16)
            };
        }
    }
}

/// Cody-Waite reduction by ln 2 and the Cephes degree-5 polynomial for `exp(x)`, `x <= 0`:
/// about 1 ulp; lanes below -87.3 are clamped there (about 1e-38).
const EXP_CLAMP: f32 = -87.3;
const LN2_HI: f32 = -0.693_359_4;
const LN2_LO: f32 = 2.121_944_4e-4;
const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use crate::DType;

    use super::{EXP_CLAMP, EXP_POLY, LN2_HI, LN2_LO, exp_tail, widen_tail};

    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
        _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps::<1>(x, x)))
    }

    #[target_feature(enable = "avx2,fma")]
    fn exp8(x: __m256) -> __m256 {
        let x = _mm256_max_ps(x, _mm256_set1_ps(EXP_CLAMP));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        );
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

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (j, c) in acc.iter_mut().enumerate() {
                // SAFETY: `i + 32 <= n`, so the 8 floats at `i + 8 j` are in both slices.
                unsafe {
                    let o = i + 8 * j;
                    *c =
                        _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(o)), _mm256_loadu_ps(pb.add(o)), *c);
                }
            }
            i += 32;
        }
        while i + 8 <= n {
            // SAFETY: `i + 8 <= n`.
            unsafe {
                acc[0] = _mm256_fmadd_ps(
                    _mm256_loadu_ps(pa.add(i)),
                    _mm256_loadu_ps(pb.add(i)),
                    acc[0],
                );
            }
            i += 8;
        }
        let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut s = hsum(v);
        for j in i..n {
            s += a[j] * b[j];
        }
        s
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn axpy(acc: &mut [f32], w: f32, v: &[f32]) {
        let n = acc.len().min(v.len());
        let (pa, pv) = (acc.as_mut_ptr(), v.as_ptr());
        let wv = _mm256_set1_ps(w);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: `i + 8 <= n`: 8 floats readable in `v` and read-writable in `acc`.
            unsafe {
                let r = _mm256_fmadd_ps(wv, _mm256_loadu_ps(pv.add(i)), _mm256_loadu_ps(pa.add(i)));
                _mm256_storeu_ps(pa.add(i), r);
            }
            i += 8;
        }
        for j in i..n {
            acc[j] += w * v[j];
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

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `q` must point at `n` f32 and `k` at `n`
    /// elements of `dtype`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_mixed(q: *const f32, k: *const u8, dtype: DType, n: usize) -> f32 {
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (j, c) in acc.iter_mut().enumerate() {
                let o = i + 8 * j;
                // SAFETY: `o + 8 <= n`: within both buffers.
                unsafe { *c = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(o)), load8(k, dtype, o), *c) };
            }
            i += 32;
        }
        while i + 8 <= n {
            // SAFETY: `i + 8 <= n`.
            unsafe {
                acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(i)), load8(k, dtype, i), acc[0]);
            };
            i += 8;
        }
        let mut s = hsum(_mm256_add_ps(
            _mm256_add_ps(acc[0], acc[1]),
            _mm256_add_ps(acc[2], acc[3]),
        ));
        for j in i..n {
            // SAFETY: `j < n`.
            s += unsafe { *q.add(j) * super::load_one(k, dtype, j) };
        }
        s
    }

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `acc` must point at `n` f32 and `v` at `n`
    /// elements of `dtype`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn axpy_mixed(acc: *mut f32, w: f32, v: *const u8, dtype: DType, n: usize) {
        let wv = _mm256_set1_ps(w);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: `i + 8 <= n`: within both buffers.
            unsafe {
                let r = _mm256_fmadd_ps(wv, load8(v, dtype, i), _mm256_loadu_ps(acc.add(i)));
                _mm256_storeu_ps(acc.add(i), r);
            }
            i += 8;
        }
        for j in i..n {
            // SAFETY: `j < n`.
            unsafe { *acc.add(j) += w * super::load_one(v, dtype, j) };
        }
    }

    /// # Safety
    /// The CPU must support AVX2 and F16C; `src` must point at `n` readable u16 and `dst` at `n`
    /// writable f32.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn widen_f16(src: *const u16, dst: *mut f32, n: usize) {
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: `i + 8 <= n`: within both buffers; unaligned loads and stores.
            unsafe {
                let h = _mm_loadu_si128(src.add(i).cast::<__m128i>());
                _mm256_storeu_ps(dst.add(i), _mm256_cvtph_ps(h));
            }
            i += 8;
        }
        // SAFETY: the caller's contract.
        unsafe { widen_tail(src, dst, i, n, true) };
    }

    /// # Safety
    /// As [`widen_f16`], with AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn widen_bf16(src: *const u16, dst: *mut f32, n: usize) {
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: `i + 8 <= n`: within both buffers; unaligned loads and stores.
            unsafe {
                let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(src.add(i).cast::<__m128i>()));
                _mm256_storeu_ps(dst.add(i), _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h)));
            }
            i += 8;
        }
        // SAFETY: the caller's contract.
        unsafe { widen_tail(src, dst, i, n, false) };
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use crate::DType;

    use super::{EXP_CLAMP, EXP_POLY, LN2_HI, LN2_LO, exp_tail, widen_tail};

    #[target_feature(enable = "avx512f")]
    fn exp16(x: __m512) -> __m512 {
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
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn exp_weights(scores: &mut [f32], m: f32) -> f32 {
        let n = scores.len();
        let p = scores.as_mut_ptr();
        let (mv, ninf) = (_mm512_set1_ps(m), _mm512_set1_ps(f32::NEG_INFINITY));
        let mut sum = _mm512_setzero_ps();
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: `i + 16 <= n`: 16 floats read-writable at `p + i`.
            unsafe {
                let s = _mm512_loadu_ps(p.add(i));
                let keep = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(s, ninf);
                let w = _mm512_maskz_mov_ps(keep, exp16(_mm512_sub_ps(s, mv)));
                _mm512_storeu_ps(p.add(i), w);
                sum = _mm512_add_ps(sum, w);
            }
            i += 16;
        }
        _mm512_reduce_add_ps(sum) + exp_tail(&mut scores[i..], m)
    }

    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        while i + 64 <= n {
            for (j, c) in acc.iter_mut().enumerate() {
                // SAFETY: `i + 64 <= n`, so the 16 floats at `i + 16 j` are in both slices.
                unsafe {
                    let o = i + 16 * j;
                    *c =
                        _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(o)), _mm512_loadu_ps(pb.add(o)), *c);
                }
            }
            i += 64;
        }
        while i + 16 <= n {
            // SAFETY: `i + 16 <= n`.
            unsafe {
                acc[0] = _mm512_fmadd_ps(
                    _mm512_loadu_ps(pa.add(i)),
                    _mm512_loadu_ps(pb.add(i)),
                    acc[0],
                );
            }
            i += 16;
        }
        let v = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
        let mut s = _mm512_reduce_add_ps(v);
        for j in i..n {
            s += a[j] * b[j];
        }
        s
    }

    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn axpy(acc: &mut [f32], w: f32, v: &[f32]) {
        let n = acc.len().min(v.len());
        let (pa, pv) = (acc.as_mut_ptr(), v.as_ptr());
        let wv = _mm512_set1_ps(w);
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: `i + 16 <= n`: 16 floats readable in `v` and read-writable in `acc`.
            unsafe {
                let r = _mm512_fmadd_ps(wv, _mm512_loadu_ps(pv.add(i)), _mm512_loadu_ps(pa.add(i)));
                _mm512_storeu_ps(pa.add(i), r);
            }
            i += 16;
        }
        for j in i..n {
            acc[j] += w * v[j];
        }
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

    /// # Safety
    /// The CPU must support AVX-512F; `q` must point at `n` f32 and `k` at `n` elements of
    /// `dtype`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn dot_mixed(q: *const f32, k: *const u8, dtype: DType, n: usize) -> f32 {
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        while i + 64 <= n {
            for (j, c) in acc.iter_mut().enumerate() {
                let o = i + 16 * j;
                // SAFETY: `o + 16 <= n`: within both buffers.
                unsafe { *c = _mm512_fmadd_ps(_mm512_loadu_ps(q.add(o)), load16(k, dtype, o), *c) };
            }
            i += 64;
        }
        while i + 16 <= n {
            // SAFETY: `i + 16 <= n`.
            unsafe {
                acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(q.add(i)), load16(k, dtype, i), acc[0]);
            };
            i += 16;
        }
        let mut s = _mm512_reduce_add_ps(_mm512_add_ps(
            _mm512_add_ps(acc[0], acc[1]),
            _mm512_add_ps(acc[2], acc[3]),
        ));
        for j in i..n {
            // SAFETY: `j < n`.
            s += unsafe { *q.add(j) * super::load_one(k, dtype, j) };
        }
        s
    }

    /// # Safety
    /// The CPU must support AVX-512F; `acc` must point at `n` f32 and `v` at `n` elements of
    /// `dtype`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn axpy_mixed(acc: *mut f32, w: f32, v: *const u8, dtype: DType, n: usize) {
        let wv = _mm512_set1_ps(w);
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: `i + 16 <= n`: within both buffers.
            unsafe {
                let r = _mm512_fmadd_ps(wv, load16(v, dtype, i), _mm512_loadu_ps(acc.add(i)));
                _mm512_storeu_ps(acc.add(i), r);
            }
            i += 16;
        }
        for j in i..n {
            // SAFETY: `j < n`.
            unsafe { *acc.add(j) += w * super::load_one(v, dtype, j) };
        }
    }

    /// # Safety
    /// The CPU must support AVX-512F; `src` must point at `n` readable u16 and `dst` at `n`
    /// writable f32.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn widen_f16(src: *const u16, dst: *mut f32, n: usize) {
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: `i + 16 <= n`: within both buffers; unaligned loads and stores.
            unsafe {
                let h = _mm256_loadu_si256(src.add(i).cast::<__m256i>());
                _mm512_storeu_ps(dst.add(i), _mm512_cvtph_ps(h));
            }
            i += 16;
        }
        // SAFETY: the caller's contract.
        unsafe { widen_tail(src, dst, i, n, true) };
    }

    /// # Safety
    /// As [`widen_f16`].
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn widen_bf16(src: *const u16, dst: *mut f32, n: usize) {
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: `i + 16 <= n`: within both buffers; unaligned loads and stores.
            unsafe {
                let h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(src.add(i).cast::<__m256i>()));
                _mm512_storeu_ps(dst.add(i), _mm512_castsi512_ps(_mm512_slli_epi32::<16>(h)));
            }
            i += 16;
        }
        // SAFETY: the caller's contract.
        unsafe { widen_tail(src, dst, i, n, false) };
    }
}
