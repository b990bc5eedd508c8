//! The inner loops of attention in four builds: portable Rust, AVX2 + FMA + F16C, AVX-512F,
//! and AVX-512 BF16 dot products for bf16 caches. `ISA` selects one at compile time; the
//! kernel instantiates the SIMD builds only inside functions compiled for those features and
//! entered after `detect` found them, which is the invariant every `unsafe` call below relies
//! on.

use crate::{DType, Element};

/// Plain Rust (the compiler's baseline vectorization).
pub(crate) const PORTABLE: u8 = 0;
/// AVX2, FMA and F16C.
pub(crate) const AVX2: u8 = 1;
/// AVX-512F on top of AVX2, FMA and F16C.
pub(crate) const AVX512: u8 = 2;
/// AVX-512 with the BF16 dot product (`vdpbf16ps`) for bf16 caches, queries and weights
/// rounded to bf16; other caches run [`AVX512`].
pub(crate) const AVX512_BF16: u8 = 3;

/// The build to run for a requested level: the request, capped by what this CPU runs.
pub(crate) fn resolve(requested: crate::Simd) -> u8 {
    let want = match requested {
        crate::Simd::Portable => PORTABLE,
        crate::Simd::Avx2 => AVX2,
        crate::Simd::Avx512 | crate::Simd::Auto => AVX512,
        crate::Simd::Avx512Bf16 => AVX512_BF16,
    };
    want.min(detect())
}

/// The widest build this CPU runs.
fn detect() -> u8 {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx2") && has!("fma") && has!("f16c") {
            if !has!("avx512f") {
                return AVX2;
            }
            return if has!("avx512bw") && has!("avx512bf16") {
                AVX512_BF16
            } else {
                AVX512
            };
        }
    }
    PORTABLE
}

/// The rows a chunk kernel asks the level-2 cache for while it computes, spread over its work:
/// with the work on token `t` of a chunk, `rows[t]` (a row of a later chunk); null or missing
/// entries ask for nothing. A prefetch is a hint that never faults, so any address is sound.
///
/// Measured on the dev box's EPYC (dense bf16 decode B8 L32K): the next chunk asked for head
/// block by head block, in bursts, against nothing: 66 against 103 ms. One row per token of
/// work instead overlaps the loads with the math better (BENCHMARKS.md, session 32). Asking
/// level 1 for the next head's rows as well cost more than it saved (session 33).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ahead<'a> {
    /// Rows of a later chunk, by token of the current chunk.
    rows: &'a [*const u8],
    /// Bytes of each row.
    bytes: usize,
}

impl<'a> Ahead<'a> {
    /// The tokens a step asks for when a kernel walks its work in `steps` steps.
    #[inline(always)]
    pub(crate) fn per_step(steps: usize) -> usize {
        16usize.div_ceil(steps.max(1))
    }

    /// Asks for nothing.
    pub(crate) const NONE: Ahead<'static> = Ahead {
        rows: &[],
        bytes: 0,
    };

    /// Asks for `rows[t]` (`bytes` from each) with the work on token `t`.
    pub(crate) fn new(rows: &'a [*const u8], bytes: usize) -> Self {
        Ahead { rows, bytes }
    }

    /// What the block of rows from `first_row` asks for: the first block of a chunk kernel's
    /// rows asks for everything, the others for nothing (once a chunk is enough).
    #[inline(always)]
    pub(crate) fn for_rows_from(&self, first_row: usize) -> &Ahead<'a> {
        if first_row == 0 { self } else { &Ahead::NONE }
    }

    /// Asks for the rows of tokens `k * per .. (k + 1) * per` of the chunk's 16: a kernel
    /// that walks its work in `steps` steps calls this once a step, with `per` from
    /// [`Ahead::per_step`] (taken once: a division in every step cost more than the rest).
    #[inline(always)]
    pub(crate) fn part(&self, k: usize, per: usize) {
        for t in k * per..((k + 1) * per).min(16) {
            if let Some(&p) = self.rows.get(t) {
                fetch_lines(p, self.bytes);
            }
        }
    }
}

/// Asks the CPU to bring the `bytes` bytes from `p` (each 64-byte line) into its level-2
/// cache; nothing for a null `p`.
#[inline(always)]
fn fetch_lines(p: *const u8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    if !p.is_null() {
        use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
        for o in (0..bytes).step_by(64) {
            // SAFETY: a prefetch reads nothing architecturally and never faults, whatever the
            // address (`wrapping_add` keeps the pointer arithmetic defined).
            unsafe { _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(o).cast::<i8>()) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, bytes);
}

/// `a · b` (portable build).
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
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

/// `acc += w * v` (portable build).
#[inline(always)]
pub(crate) fn axpy(acc: &mut [f32], w: f32, v: &[f32]) {
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
        AVX512 | AVX512_BF16 => return unsafe { avx512::exp_weights(scores, m) },
        // SAFETY: see the module doc.
        AVX2 => return unsafe { avx2::exp_weights(scores, m) },
        _ => {}
    }
    exp_tail(scores, m)
}

/// The mask of the first `len` of 16 lanes (`len <= 16`).
#[inline(always)]
pub(crate) fn first_lanes(len: usize) -> u16 {
    debug_assert!(len <= 16);
    if len >= 16 {
        u16::MAX
    } else {
        (1u16 << len) - 1
    }
}

/// The largest of `row`, NaN ignored (as `f32::max` folds), -inf when empty.
#[inline(always)]
pub(crate) fn row_max<const ISA: u8>(row: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if ISA >= AVX512 {
        // SAFETY: see the module doc.
        return unsafe { avx512::row_max(row) };
    }
    row.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

/// The tokens `t < len` of a chunk whose weight is not 0 (NaN counts) in any of the `rows`
/// rows of `w` (`stride >= 16` apart), as a lane mask: the tokens whose values a weighted sum
/// must read.
#[inline(always)]
pub(crate) fn live_tokens<const ISA: u8>(w: &[f32], stride: usize, rows: usize, len: usize) -> u16 {
    debug_assert!(stride >= 16 && len <= 16 && w.len() >= (rows - 1) * stride + 16);
    #[cfg(target_arch = "x86_64")]
    if ISA >= AVX512 {
        // SAFETY: see the module doc; `w` holds `rows` rows of 16 weights (asserted above).
        return unsafe { avx512::live_tokens(w.as_ptr(), stride, rows, len) };
    }
    (0..len)
        .filter(|&t| (0..rows).any(|r| w[r * stride + t] != 0.0))
        .fold(0, |m, t| m | 1 << t)
}

/// `out[g] = q_g · k` for the `out.len()` rows of `q` (row-major, `n` per row), widening each
/// chunk of `k` once for all rows (SIMD builds only).
#[inline(always)]
pub(crate) fn dot_rows<T: Element, const ISA: u8>(q: &[f32], n: usize, k: &[T], out: &mut [f32]) {
    let rows = out.len();
    assert!(
        q.len() >= rows * n && k.len() >= n,
        "invariant: callers pass whole rows"
    );
    let kp = k.as_ptr().cast::<u8>();
    #[cfg(target_arch = "x86_64")]
    if ISA != PORTABLE {
        let (qp, op) = (q.as_ptr(), out.as_mut_ptr());
        // SAFETY: the assert above bounds every access; the module doc covers ISA.
        unsafe {
            if ISA >= AVX512 {
                avx512::dot_rows(qp, n, kp, T::DTYPE, op, rows);
            } else {
                avx2::dot_rows(qp, n, kp, T::DTYPE, op, rows);
            }
        }
        return;
    }
    for (g, o) in out.iter_mut().enumerate() {
        *o = q[g * n..(g + 1) * n]
            .iter()
            .zip(k)
            .map(|(a, b)| a * b.to_f32())
            .sum();
    }
}

/// `acc_g += sum over (t, v) in vs of w[g * stride + t] * v` for the `rows` rows of `acc`
/// (row-major, `n` per row): one chunk's weighted values, summed in token order in registers
/// and added to each accumulator once (SIMD builds), or token by token (portable build).
#[inline(always)]
pub(crate) fn axpy_rows<T: Element, const ISA: u8>(
    acc: &mut [f32],
    n: usize,
    (w, stride): (&[f32], usize),
    vs: &[(usize, &[T])],
    rows: usize,
    ahead: &Ahead<'_>,
) {
    assert!(
        acc.len() >= rows * n
            && vs.iter().all(|&(t, v)| v.len() >= n
                && t < stride
                && (rows == 0 || w.len() > (rows - 1) * stride + t)),
        "invariant: callers pass whole rows"
    );
    #[cfg(target_arch = "x86_64")]
    if ISA != PORTABLE {
        let (ap, wp) = (acc.as_mut_ptr(), w.as_ptr());
        // SAFETY: the assert above bounds every access; the module doc covers ISA.
        unsafe {
            if ISA >= AVX512 {
                avx512::axpy_rows(ap, n, (wp, stride), vs, rows, ahead);
            } else {
                avx2::axpy_rows(ap, n, (wp, stride), vs, rows, ahead);
            }
        }
        return;
    }
    for &(t, v) in vs {
        for (g, a) in acc.chunks_exact_mut(n).take(rows).enumerate() {
            for (x, y) in a.iter_mut().zip(v) {
                *x += w[g * stride + t] * y.to_f32();
            }
        }
    }
}

/// Levels `levels` of a lane-sum tree over `v` (`2^levels.len()` vectors), in place: level
/// `k` replaces each pair of neighbours by `level(k, u, w)`; returns the one vector left. A
/// run of `2^k` aligned vectors is a subtree of the first `k` levels, so a chunk's keys can be
/// folded in aligned blocks and the blocks' results after, in the same order as all at once.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn fold<V: Copy>(
    v: &mut [V],
    levels: std::ops::Range<usize>,
    level: impl Fn(usize, V, V) -> V,
) -> V {
    let mut len = v.len();
    for k in levels {
        for j in 0..len / 2 {
            v[j] = level(k, v[2 * j], v[2 * j + 1]);
        }
        len /= 2;
    }
    v[0]
}

/// A chunk's (at most 16) keys padded to 16 by repeating the first, so that the chunk kernels
/// keep 16 accumulators in registers, and the mask of the real ones (the lanes to keep).
#[cfg(target_arch = "x86_64")]
fn pad16<P: Copy>(keys: &[P]) -> ([P; 16], u16) {
    let mut all = [keys[0]; 16];
    all[..keys.len()].copy_from_slice(keys);
    (all, first_lanes(keys.len()))
}

/// Splits `rows` into blocks of 8, 4, 2 and 1 and calls `f(first_row, block)` for each, so the
/// fused kernels run with a constant row count (accumulators in registers).
#[inline(always)]
fn row_blocks(rows: usize, mut f: impl FnMut(usize, usize)) {
    let mut r = 0;
    while r < rows {
        let block = match rows - r {
            8.. => 8,
            4..=7 => 4,
            2..=3 => 2,
            _ => 1,
        };
        f(r, block);
        r += block;
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

/// The scalar weights: the portable build, and the tails of the SIMD loops.
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

/// The chunked PV step of one SIMD build, inside its module (`$feat`: its target features,
/// `$isa`: their names for the docs; `$w` f32 lanes of vector type `$v`; the build's
/// intrinsics, its widening load `$load` and the module's `in_order`): `load_pair` widens two
/// vectors' worth of a value, `axpy_rows_r` keeps two vectors of each of `R` rows in registers
/// over a chunk's tokens, and `axpy_rows` runs it over row blocks.
macro_rules! chunk_axpy {
    ($feat:literal, $isa:literal, $w:literal, $v:ty, $zero:ident, $set1:ident, $fma:ident,
     $ldu:ident, $stu:ident, $add:ident, $load:ident,
     ($vi:ty, $ldi:ident, $andi:ident, $set1i:ident, $slli:ident, $cast:ident)) => {
        #[doc = concat!("Elements `i .. i + 2 * ", $w, "` of a buffer of `dtype`, widened to f32")]
        /// as two vectors: in order, except for bf16, whose even elements come first and odd
        /// ones second (one load whose 32-bit lanes each hold a pair, split by a shift and a
        /// mask); `in_order` puts sums of them back in order.
        ///
        /// # Safety
        #[doc = concat!("The CPU must support ", $isa, "; `p` must point at `i + 2 * ", $w, "`")]
        /// or more elements of `dtype`.
        #[inline(always)]
        unsafe fn load_pair(p: *const u8, dtype: DType, i: usize) -> ($v, $v) {
            // SAFETY: the caller's contract; unaligned loads.
            unsafe {
                if dtype == DType::BF16 {
                    let x = $ldi(p.cast::<u16>().add(i).cast::<$vi>());
                    let odd = $andi(x, $set1i(0xffff_0000_u32 as i32));
                    ($cast($slli::<16>(x)), $cast(odd))
                } else {
                    ($load(p, dtype, i), $load(p, dtype, i + $w))
                }
            }
        }

        #[doc = concat!("# Safety\nThe CPU must support ", $isa, "; `acc` must hold `R * n` f32, ")]
        #[doc = "`w` rows `R` of `stride` weights with every token index of `vs` below `stride`,"]
        #[doc = "and each value `n` elements."]
        #[target_feature(enable = $feat)]
        unsafe fn axpy_rows_r<T: Element, const R: usize>(
            acc: *mut f32,
            n: usize,
            (w, stride): (*const f32, usize),
            vs: &[(usize, &[T])],
            ahead: &super::Ahead<'_>,
        ) {
            let dtype = T::DTYPE;
            let per = super::Ahead::per_step(n / (2 * $w));
            // Two vectors of each row at a time, summed over the tokens in registers.
            let mut i = 0;
            while i + 2 * $w <= n {
                let mut a0 = [$zero(); R];
                let mut a1 = [$zero(); R];
                ahead.part(i / (2 * $w), per);
                for &(t, v) in vs {
                    let vp = v.as_ptr().cast::<u8>();
                    // SAFETY: `i + 2 * $w <= n` elements of `v`; weight `r * stride + t` is
                    // within the caller's `R` rows of `stride`.
                    unsafe {
                        let (v0, v1) = load_pair(vp, dtype, i);
                        for r in 0..R {
                            let wr = $set1(*w.add(r * stride + t));
                            a0[r] = $fma(wr, v0, a0[r]);
                            a1[r] = $fma(wr, v1, a1[r]);
                        }
                    }
                }
                for r in 0..R {
                    let (x0, x1) = in_order(dtype, a0[r], a1[r]);
                    // SAFETY: `i + 2 * $w <= n`: within row `r` of `acc`.
                    unsafe {
                        let p = acc.add(r * n + i);
                        $stu(p, $add($ldu(p), x0));
                        $stu(p.add($w), $add($ldu(p.add($w)), x1));
                    }
                }
                i += 2 * $w;
            }
            for j in i..n {
                for r in 0..R {
                    let mut x = 0.0f32;
                    for &(t, v) in vs {
                        // SAFETY: `j < n`, `r < R`, `t < stride`.
                        x += unsafe {
                            *w.add(r * stride + t) * super::load_one(v.as_ptr().cast(), dtype, j)
                        };
                    }
                    // SAFETY: `j < n`, `r < R`.
                    unsafe { *acc.add(r * n + j) += x };
                }
            }
        }

        /// # Safety
        /// As `axpy_rows_r`, for `rows` rows.
        #[target_feature(enable = $feat)]
        pub(super) unsafe fn axpy_rows<T: Element>(
            acc: *mut f32,
            n: usize,
            (w, stride): (*const f32, usize),
            vs: &[(usize, &[T])],
            rows: usize,
            ahead: &super::Ahead<'_>,
        ) {
            super::row_blocks(rows, |r, block| {
                let ahead = ahead.for_rows_from(r);
                // SAFETY: rows `r..r + block` are within the `rows` rows of the caller's
                // contract.
                unsafe {
                    let (acc, w) = (acc.add(r * n), (w.add(r * stride), stride));
                    match block {
                        8 => axpy_rows_r::<T, 8>(acc, n, w, vs, ahead),
                        4 => axpy_rows_r::<T, 4>(acc, n, w, vs, ahead),
                        2 => axpy_rows_r::<T, 2>(acc, n, w, vs, ahead),
                        _ => axpy_rows_r::<T, 1>(acc, n, w, vs, ahead),
                    }
                }
            });
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use crate::{DType, Element};

    use super::{EXP_CLAMP, EXP_POLY, LN2_HI, LN2_LO, exp_tail};

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
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use std::arch::x86_64::*;

    use crate::{DType, Element};

    use super::{EXP_CLAMP, EXP_POLY, LN2_HI, LN2_LO, exp_tail};

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
            let hi =
                _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
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
        let mut acc = [_mm512_setzero_ps(); R];
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: `i + 16 <= n`: within `k` and within each of the `R` rows of `q`.
            unsafe {
                let kv = load16(k, dtype, i);
                for (r, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(_mm512_loadu_ps(q.add(r * n + i)), kv, *a);
                }
            }
            i += 16;
        }
        for (r, a) in acc.iter().enumerate() {
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

    /// `scores[r * stride + t] = q_r · k_t` for the `rows` rows of `q` (f32, `n` per row, `n` a
    /// multiple of 16) and the chunk's keys (`n` elements of `dtype` each, at most 16; lanes
    /// past `keys.len()` get 0): bit for bit the sums [`dot_rows`] makes, for a chunk at once.
    /// Rows go in blocks of up to 8 and keys `16 / rows` at a time, so that each widened key
    /// slice serves the block's rows. Each row's 16 sums are then reduced in one tree
    /// ([`super::fold`] by [`sum_level`]) that adds lanes in the order `_mm512_reduce_add_ps`
    /// does.
    ///
    /// # Safety
    /// The CPU must support AVX-512F; `q` must hold `rows * n` floats, each key `n` elements of
    /// `dtype`, and `scores` `(rows - 1) * stride + 16` floats.
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn qk_chunk(
        q: *const f32,
        n: usize,
        rows: usize,
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
                match block {
                    8 => qk_rows::<8, 2>(q, n, (&all, dtype), out, (live, ahead)),
                    4 => qk_rows::<4, 4>(q, n, (&all, dtype), out, (live, ahead)),
                    2 => qk_rows::<2, 8>(q, n, (&all, dtype), out, (live, ahead)),
                    _ => qk_rows::<1, 16>(q, n, (&all, dtype), out, (live, ahead)),
                }
            }
        });
    }

    /// [`qk_chunk`] for `R` rows, the keys taken `B` at a time (`R * B = 16` accumulators).
    /// A block of `B` aligned keys is a subtree of the first levels of [`super::fold`]; the
    /// blocks' results go through the rest.
    ///
    /// # Safety
    /// As [`qk_chunk`], for `R` rows of `q` and of the scores.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn qk_rows<const R: usize, const B: usize>(
        q: *const f32,
        n: usize,
        (keys, dtype): (&[*const u8; 16], DType),
        (scores, stride): (*mut f32, usize),
        (live, ahead): (__mmask16, &super::Ahead<'_>),
    ) {
        let split = B.trailing_zeros() as usize;
        let level = |k, u, w| sum_level(k, u, w);
        // `B = 16 / R`, so each row has `R` blocks.
        let mut blocks = [[_mm512_setzero_ps(); R]; R];
        for (b, block) in keys.chunks_exact(B).enumerate() {
            ahead.part(b, B);
            let mut acc = [[_mm512_setzero_ps(); B]; R];
            let mut i = 0;
            while i < n {
                for (t, &key) in block.iter().enumerate() {
                    // SAFETY: `i + 16 <= n`: within every key and each of the `R` rows of `q`.
                    unsafe {
                        let kv = load16(key, dtype, i);
                        for (r, row) in acc.iter_mut().enumerate() {
                            row[t] = _mm512_fmadd_ps(_mm512_loadu_ps(q.add(r * n + i)), kv, row[t]);
                        }
                    }
                }
                i += 16;
            }
            for r in 0..R {
                blocks[r][b] = super::fold(&mut acc[r], 0..split, level);
            }
        }
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

    chunk_axpy!(
        "avx512f",
        "AVX-512F",
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
}

/// The bf16 dot-product build (AVX-512F, AVX-512BW and AVX-512 BF16) for bf16 caches whose head
/// dim is a multiple of 32. `vdpbf16ps` multiplies pairs of bf16 and adds both products to an
/// f32 lane, so a 64-byte load of keys feeds 32 multiply-adds with no widening. Queries and
/// softmax weights are rounded to bf16 (to nearest even) for it, as tensor cores round them.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512bf16 {
    use std::arch::x86_64::*;

    /// Tokens of a chunk (the kernel's `CHUNK`): one f32 lane each.
    const TOKENS: usize = 16;

    /// `scores[r * stride + t] = q_r · k_t` for the `rows` rows of `q` (bf16 bits, `n` per
    /// row) and the chunk's keys `keys[t]` (`n` bf16 bits each, at most 16 of them); lanes
    /// past `keys.len()` get 0. Each row's 16 dot products are summed across lanes together,
    /// in one tree of unpacks and shuffles, the same tree for every token.
    ///
    /// # Safety
    /// The CPU must support AVX-512F, AVX-512BW and AVX-512 BF16; `n` must be a multiple of
    /// 32; `q` must hold `rows * n` elements and each key `n`; `scores` must hold
    /// `(rows - 1) * stride + 16` floats.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(crate) unsafe fn qk_chunk(
        q: *const u16,
        n: usize,
        rows: usize,
        keys: &[*const u8],
        scores: *mut f32,
        stride: usize,
        ahead: &super::Ahead<'_>,
    ) {
        debug_assert!(!keys.is_empty() && keys.len() <= TOKENS && n.is_multiple_of(32));
        let (all, live) = super::pad16(keys);
        super::row_blocks(rows, |r0, block| {
            let ahead = ahead.for_rows_from(r0);
            // SAFETY: rows `r0..r0 + block` are within the caller's `rows`, of `q` and of
            // `scores` alike.
            unsafe {
                let (q, out) = (q.add(r0 * n), scores.add(r0 * stride));
                match block {
                    8 => qk_rows::<8, 2>(q, n, &all, (out, stride), (live, ahead)),
                    4 => qk_rows::<4, 4>(q, n, &all, (out, stride), (live, ahead)),
                    2 => qk_rows::<2, 8>(q, n, &all, (out, stride), (live, ahead)),
                    _ => qk_rows::<1, 16>(q, n, &all, (out, stride), (live, ahead)),
                }
            }
        });
    }

    /// [`qk_chunk`] for `R` rows: [`qk_sums`], the lanes past the chunk's keys zeroed.
    ///
    /// # Safety
    /// As [`qk_chunk`], for `R` rows of `q` and of the scores.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn qk_rows<const R: usize, const B: usize>(
        q: *const u16,
        n: usize,
        keys: &[*const u8; TOKENS],
        (scores, stride): (*mut f32, usize),
        (live, ahead): (__mmask16, &super::Ahead<'_>),
    ) {
        // SAFETY: the caller's contract is `qk_sums`'.
        let sums = unsafe { qk_sums::<R, B>(q, n, keys, ahead) };
        for (r, row) in sums.iter().enumerate() {
            // SAFETY: row `r`'s 16 scores are within the caller's bound.
            unsafe { _mm512_storeu_ps(scores.add(r * stride), _mm512_maskz_mov_ps(live, *row)) };
        }
    }

    /// The dot products of `R` rows of `q` with 16 keys, one vector a row (lane `t` for key
    /// `t`), the keys taken `B` at a time (`R * B = 16` accumulators, in [`qk_block`]). A
    /// block's `B` lane-sum vectors go through the first levels of the [`super::fold`] tree
    /// at once (the tree pairs neighbours, so a block of `B` aligned tokens is a subtree), and
    /// the blocks' results through the rest: the same operations in the same order as one fold
    /// of the 16 vectors.
    ///
    /// # Safety
    /// As [`qk_chunk`], for `R` rows of `q` and 16 keys.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn qk_sums<const R: usize, const B: usize>(
        q: *const u16,
        n: usize,
        keys: &[*const u8; TOKENS],
        ahead: &super::Ahead<'_>,
    ) -> [__m512; R] {
        let split = B.trailing_zeros() as usize;
        // `B = 16 / R`, so each row has `R` blocks.
        let mut blocks = [[_mm512_setzero_ps(); R]; R];
        for (b, block) in keys.chunks_exact(B).enumerate() {
            ahead.part(b, B);
            // SAFETY: the caller's contract, for `B` of the keys.
            let sums = unsafe { qk_block::<R, B>(q, n, block) };
            for r in 0..R {
                blocks[r][b] = sums[r];
            }
        }
        let level = |k, u, w| sum_level(k, u, w);
        let mut sums = [_mm512_setzero_ps(); R];
        for (sum, row) in sums.iter_mut().zip(&mut blocks) {
            *sum = super::fold(row, split..4, level);
        }
        sums
    }

    /// The dot products of `R` rows of `q` with the `B` keys of `block`, their lane sums
    /// folded by the first `log2 B` levels of the tree: one vector a row. Kept out of line:
    /// inlined, the compiler unrolled every block of a chunk into one body and spilled the
    /// accumulators (from level 1, 24 cycles a token and KV head against 21.6 out of line).
    ///
    /// # Safety
    /// As [`qk_chunk`], for `R` rows of `q` and `B` keys.
    #[inline(never)]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn qk_block<const R: usize, const B: usize>(
        q: *const u16,
        n: usize,
        block: &[*const u8],
    ) -> [__m512; R] {
        let split = B.trailing_zeros() as usize;
        let mut acc = [[_mm512_setzero_ps(); B]; R];
        let mut i = 0;
        while i < n {
            // SAFETY: `i + 32 <= n`: within each of the `R` rows of `q` and every key.
            unsafe {
                let qv: [__m512bh; R] = std::array::from_fn(|r| {
                    std::mem::transmute(_mm512_loadu_si512(q.add(r * n + i).cast::<__m512i>()))
                });
                for (t, &key) in block.iter().enumerate() {
                    let kv: __m512bh = std::mem::transmute(_mm512_loadu_si512(
                        key.cast::<u16>().add(i).cast::<__m512i>(),
                    ));
                    for r in 0..R {
                        acc[r][t] = _mm512_dpbf16_ps(acc[r][t], qv[r], kv);
                    }
                }
            }
            i += 32;
        }
        let level = |k, u, w| sum_level(k, u, w);
        let mut sums = [_mm512_setzero_ps(); R];
        for (sum, row) in sums.iter_mut().zip(&mut acc) {
            *sum = super::fold(row, 0..split, level);
        }
        sums
    }

    /// A block of `rows` rows (1, 2, 4 or 8: `false` for others, with nothing done) over one
    /// full chunk of 16 keys and values that every row sees, in one pass that keeps the scores
    /// in registers: the dot products as [`qk_chunk`] makes them; the online-softmax update as
    /// the kernel makes it from them (each row's maximum `m`, the rescale of its sums `l` and
    /// `acc` where the maximum grew, the weights and their sum); then the weighted values as
    /// [`pv_chunk`] adds them. Bit for bit those steps in turn.
    ///
    /// # Safety
    /// As [`qk_chunk`] and [`pv_chunk`]: the CPU's features and `n` a multiple of 32; `q`
    /// holds `rows * n` bf16 bits, `m` and `l` `rows` floats, `acc` `rows * n`, and `keys`
    /// and `vals` 16 rows of `n` bf16 each.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(crate) unsafe fn chunk_step(
        (q, n, rows): (*const u16, usize, usize),
        (keys, vals): (&[*const u8; TOKENS], &[*const u8]),
        (m, l, acc): (&mut [f32], &mut [f32], &mut [f32]),
        (ahead_k, ahead_v): (&super::Ahead<'_>, &super::Ahead<'_>),
    ) -> bool {
        debug_assert!(vals.len() == TOKENS && n.is_multiple_of(32));
        debug_assert!(m.len() == rows && l.len() == rows && acc.len() == rows * n);
        let state = (m, l, acc);
        // SAFETY: the caller's contract, for each block size.
        unsafe {
            match rows {
                8 => step_rows::<8, 2>(q, n, (keys, vals), state, (ahead_k, ahead_v)),
                4 => step_rows::<4, 4>(q, n, (keys, vals), state, (ahead_k, ahead_v)),
                2 => step_rows::<2, 8>(q, n, (keys, vals), state, (ahead_k, ahead_v)),
                1 => step_rows::<1, 16>(q, n, (keys, vals), state, (ahead_k, ahead_v)),
                _ => return false,
            }
        }
        true
    }

    /// [`chunk_step`] for `R` rows, the keys taken `B` at a time.
    ///
    /// # Safety
    /// As [`chunk_step`], for `R` rows.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn step_rows<const R: usize, const B: usize>(
        q: *const u16,
        n: usize,
        (keys, vals): (&[*const u8; TOKENS], &[*const u8]),
        (m, l, acc): (&mut [f32], &mut [f32], &mut [f32]),
        (ahead_k, ahead_v): (&super::Ahead<'_>, &super::Ahead<'_>),
    ) {
        // SAFETY: the caller's contract is `qk_sums`'.
        let sums = unsafe { qk_sums::<R, B>(q, n, keys, ahead_k) };
        let (ninf, zero) = (_mm512_set1_ps(f32::NEG_INFINITY), _mm512_setzero_ps());
        let mut live: __mmask16 = 0;
        let mut packed = [[0u32; TOKENS / 2]; 8];
        let mut weights = [zero; R];
        for r in 0..R {
            // As `row_max`, `exp_weights` and the kernel's update between them.
            let mx = _mm512_reduce_max_ps(_mm512_max_ps(sums[r], ninf));
            let m_new = m[r].max(mx);
            if m[r] != m_new {
                let alpha = (m[r] - m_new).exp();
                acc[r * n..(r + 1) * n].iter_mut().for_each(|a| *a *= alpha);
                l[r] *= alpha;
            }
            let keep = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(sums[r], ninf);
            let e = super::avx512::exp16(_mm512_sub_ps(sums[r], _mm512_set1_ps(m_new)));
            weights[r] = _mm512_maskz_mov_ps(keep, e);
            l[r] += _mm512_reduce_add_ps(weights[r]);
            m[r] = m_new;
            live |= _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(weights[r], zero);
        }
        for (row, w) in packed.iter_mut().zip(weights) {
            pack_weights(live, w, row);
        }
        let mut order = [std::ptr::null::<u8>(); TOKENS];
        let vals = live_values(live, vals, &mut order);
        // SAFETY: the caller's contract: `acc` holds `R` rows of `n`, each live value `n`.
        unsafe { pv_rows::<R>(acc.as_mut_ptr(), n, &packed, (vals, ahead_v)) };
    }

    /// `acc_r[0..n) += sum over live tokens t of w[r * stride + t] * vals[t]` for the `rows`
    /// rows of `acc` (f32, `n` per row), the values bf16 bits (`n` each) and the weights
    /// rounded to bf16. The live tokens (the set bits of `live`) go in pairs, in order, one
    /// `vdpbf16ps` per pair (an odd last token pairs with itself at weight 0); 32 elements of
    /// each row at a time are summed over the chunk in registers, then added to `acc` once.
    ///
    /// # Safety
    /// As [`qk_chunk`]: the CPU's features and `n` a multiple of 32; `acc` must hold `rows *
    /// n` floats, `w` rows `rows` of `stride >= 16` weights, and every value of a live token
    /// (each bit of `live` below `vals.len()`) `n` elements.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(crate) unsafe fn pv_chunk(
        acc: *mut f32,
        n: usize,
        rows: usize,
        (w, stride): (*const f32, usize),
        vals: &[*const u8],
        (live, ahead): (u16, &super::Ahead<'_>),
    ) {
        debug_assert!(vals.len() <= TOKENS && n.is_multiple_of(32));
        debug_assert!(stride >= TOKENS && (16 - live.leading_zeros()) as usize <= vals.len());
        let mut order = [std::ptr::null::<u8>(); TOKENS];
        let vals = live_values(live, vals, &mut order);
        super::row_blocks(rows, |r0, block| {
            let ahead = ahead.for_rows_from(r0);
            // Each row's live weights as bf16 pairs (`pack_weights`).
            let mut packed = [[0u32; TOKENS / 2]; 8];
            for (r, row) in packed.iter_mut().enumerate().take(block) {
                // SAFETY: row `r0 + r` holds `stride >= 16` weights.
                pack_weights(
                    live,
                    unsafe { _mm512_loadu_ps(w.add((r0 + r) * stride)) },
                    row,
                );
            }
            // SAFETY: rows `r0..r0 + block` are within the caller's `rows`.
            unsafe {
                let acc = acc.add(r0 * n);
                match block {
                    8 => pv_rows::<8>(acc, n, &packed, (vals, ahead)),
                    4 => pv_rows::<4>(acc, n, &packed, (vals, ahead)),
                    2 => pv_rows::<2>(acc, n, &packed, (vals, ahead)),
                    _ => pv_rows::<1>(acc, n, &packed, (vals, ahead)),
                }
            }
        });
    }

    /// The live tokens' weights of a row (`w`, a lane a token), in order, rounded to bf16 and
    /// stored as pairs into `row`: the pair's first token in the low half of a 32-bit lane, and
    /// 0 after the last live token.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    fn pack_weights(live: __mmask16, w: __m512, row: &mut [u32; TOKENS / 2]) {
        let w = if live == u16::MAX {
            w
        } else {
            _mm512_maskz_compress_ps(live, w)
        };
        let bits = _mm512_cvtneps_pbh(w);
        // SAFETY: `row` holds 16 bf16 (32 bytes, as `bits`); both are plain bits.
        unsafe {
            let bits: __m256i = std::mem::transmute(bits);
            _mm256_storeu_si256(row.as_mut_ptr().cast::<__m256i>(), bits);
        }
    }

    /// The values of the live tokens (the set bits of `live`), in order: `vals` itself when
    /// every token of a full chunk is live, else gathered into `order`.
    #[inline]
    fn live_values<'a>(
        live: u16,
        vals: &'a [*const u8],
        order: &'a mut [*const u8; TOKENS],
    ) -> &'a [*const u8] {
        if live == u16::MAX && vals.len() == TOKENS {
            return vals;
        }
        let mut count = 0;
        let mut bits = live;
        while bits != 0 {
            order[count] = vals[bits.trailing_zeros() as usize];
            count += 1;
            bits &= bits - 1;
        }
        &order[..count]
    }

    /// [`pv_chunk`] for `R` rows with their packed weight pairs.
    ///
    /// # Safety
    /// As [`pv_chunk`], for `R` rows of `acc`.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn pv_rows<const R: usize>(
        acc: *mut f32,
        n: usize,
        packed: &[[u32; TOKENS / 2]; 8],
        (vals, ahead): (&[*const u8], &super::Ahead<'_>),
    ) {
        // Interleaving two tokens' 16-bit values within 128-bit lanes leaves the dot
        // products' lanes in the order (0-3, 8-11, 16-19, 24-27) for the low halves and
        // (4-7, 12-15, 20-23, 28-31) for the high ones; these put them back.
        let first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
        let second =
            _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
        let per = super::Ahead::per_step(n / 32);
        let mut i = 0;
        while i < n {
            ahead.part(i / 32, per);
            let mut lo = [_mm512_setzero_ps(); R];
            let mut hi = [_mm512_setzero_ps(); R];
            for (p, pair) in vals.chunks(2).enumerate() {
                let (a, b) = (
                    pair[0].cast::<u16>(),
                    pair.get(1).unwrap_or(&pair[0]).cast::<u16>(),
                );
                // SAFETY: `i + 32 <= n` elements of each value.
                unsafe {
                    let va = _mm512_loadu_si512(a.add(i).cast::<__m512i>());
                    let vb = _mm512_loadu_si512(b.add(i).cast::<__m512i>());
                    let l: __m512bh = std::mem::transmute(_mm512_unpacklo_epi16(va, vb));
                    let h: __m512bh = std::mem::transmute(_mm512_unpackhi_epi16(va, vb));
                    for r in 0..R {
                        let wv: __m512bh =
                            std::mem::transmute(_mm512_set1_epi32(packed[r][p] as i32));
                        lo[r] = _mm512_dpbf16_ps(lo[r], l, wv);
                        hi[r] = _mm512_dpbf16_ps(hi[r], h, wv);
                    }
                }
            }
            for r in 0..R {
                // SAFETY: `i + 32 <= n`: within row `r` of `acc`.
                unsafe {
                    let at = acc.add(r * n + i);
                    let x0 = _mm512_permutex2var_ps(lo[r], first, hi[r]);
                    let x1 = _mm512_permutex2var_ps(lo[r], second, hi[r]);
                    _mm512_storeu_ps(at, _mm512_add_ps(_mm512_loadu_ps(at), x0));
                    _mm512_storeu_ps(at.add(16), _mm512_add_ps(_mm512_loadu_ps(at.add(16)), x1));
                }
            }
            i += 32;
        }
    }

    /// `x` rounded to bf16 (to nearest even), as bits.
    ///
    /// # Safety
    /// The CPU must support AVX-512F, AVX-512BW and AVX-512 BF16.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(crate) unsafe fn round(x: &[f32]) -> Vec<u16> {
        let mut out = vec![0u16; x.len()];
        let mut i = 0;
        while i + 16 <= x.len() {
            // SAFETY: `i + 16 <= len` for both buffers.
            unsafe {
                let bits: __m256i =
                    std::mem::transmute(_mm512_cvtneps_pbh(_mm512_loadu_ps(x.as_ptr().add(i))));
                _mm256_storeu_si256(out.as_mut_ptr().add(i).cast::<__m256i>(), bits);
            }
            i += 16;
        }
        for (o, &v) in out[i..].iter_mut().zip(&x[i..]) {
            *o = half::bf16::from_f32(v).to_bits();
        }
        out
    }

    /// Level `level` of the lane-sum tree of [`qk_chunk`]: neighbours `u` and `w` combined.
    /// Over 16 vectors, levels 0 to 4 give the 16 vectors' lane sums, in order: each level
    /// adds interleaved neighbours (lanes within 128 bits, then 64-bit halves, then 128-bit
    /// quarters twice), so every token's lanes meet in the same pattern.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn sum_level(level: usize, u: __m512, w: __m512) -> __m512 {
        match level {
            0 => _mm512_add_ps(_mm512_unpacklo_ps(u, w), _mm512_unpackhi_ps(u, w)),
            1 => {
                let (u, w) = (_mm512_castps_pd(u), _mm512_castps_pd(w));
                _mm512_add_ps(
                    _mm512_castpd_ps(_mm512_unpacklo_pd(u, w)),
                    _mm512_castpd_ps(_mm512_unpackhi_pd(u, w)),
                )
            }
            _ => _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(u, w),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(u, w),
            ),
        }
    }
}
