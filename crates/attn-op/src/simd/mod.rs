//! The inner loops of attention in four builds: portable Rust, AVX2 + FMA + F16C, AVX-512F,
//! and AVX-512 BF16 dot products for bf16 caches. `ISA` selects one at compile time; the
//! kernel instantiates the SIMD builds only inside functions compiled for those features and
//! entered after `detect` found them, which is the invariant every `unsafe` call in this module
//! and its three builds relies on.

mod ahead;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512bf16;
mod macros;

pub(crate) use ahead::Ahead;
#[cfg(target_arch = "x86_64")]
use macros::{chunk_axpy, qk_block};

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

/// [`exp_weights`] of each of the `m.len()` rows of `scores` (`len` scores, `stride` apart)
/// against `m[r]`, its sum added to `l[r]`. The AVX2 and AVX-512 builds take full rows (16
/// scores) four at a time, with the same bits.
#[inline(always)]
pub(crate) fn exp_rows<const ISA: u8>(
    scores: &mut [f32],
    (stride, len): (usize, usize),
    m: &[f32],
    l: &mut [f32],
) {
    debug_assert!(len <= stride && m.len() == l.len());
    let mut r = 0;
    #[cfg(target_arch = "x86_64")]
    if ISA >= AVX2 && len == 16 {
        while r + 4 <= m.len() {
            assert!(
                scores.len() >= (r + 3) * stride + 16,
                "a row of 16 past the scores"
            );
            let (rows, m, l) = (
                scores.as_mut_ptr().wrapping_add(r * stride),
                &m[r..r + 4],
                &mut l[r..r + 4],
            );
            // SAFETY: see the module doc; rows `r..r + 4` hold 16 scores each (asserted).
            unsafe {
                if ISA == AVX2 {
                    avx2::exp_rows4(rows, stride, m, l);
                } else {
                    avx512::exp_rows4(rows, stride, m, l);
                }
            }
            r += 4;
        }
    }
    for r in r..m.len() {
        l[r] += exp_weights::<ISA>(&mut scores[r * stride..r * stride + len], m[r]);
    }
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
    #[cfg(target_arch = "x86_64")]
    if ISA == AVX2 {
        // SAFETY: see the module doc.
        return unsafe { avx2::row_max(row) };
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
    #[cfg(target_arch = "x86_64")]
    if ISA == AVX2 {
        // SAFETY: see the module doc; `w` holds `rows` rows of 16 weights (asserted above).
        return unsafe { avx2::live_tokens(w.as_ptr(), stride, rows, len) };
    }
    (0..len)
        .filter(|&t| (0..rows).any(|r| w[r * stride + t] != 0.0))
        .fold(0, |m, t| m | 1 << t)
}

/// `out[g] = q_g · k` for the `out.len()` rows of `q` (row-major, `n` per row), widening each
/// chunk of `k` once for all rows (SIMD builds only). For a bf16 `k`, the AVX2 and AVX-512
/// builds take `q`'s rows in [`pair_order`] (of their lanes), as `kernel::pair_lanes` says.
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

/// `acc_g += sum over live t of w[g * stride + t] * v_t` for the `rows` rows of `acc`
/// (row-major, `n` per row), where `live` has bit `t` set for each chunk token `t` that weighs
/// anything and `vals[t]` points at its value: one chunk's weighted values, summed in token
/// order in registers and added to each accumulator once (SIMD builds), or token by token
/// (portable build). Where the live tokens are not the chunk's first ones, the rows of `w`
/// are left with their live weights moved to the front.
///
/// # Safety
/// For every bit `t` of `live`, `vals[t]` must point at `n` initialized elements of `T`.
#[inline(always)]
pub(crate) unsafe fn axpy_rows<T: Element, const ISA: u8>(
    acc: &mut [f32],
    n: usize,
    (w, stride): (&mut [f32], usize),
    (live, vals): (u16, &[*const u8]),
    rows: usize,
    ahead: &Ahead<'_>,
) {
    if live == 0 {
        // Nothing weighs anything.
        return;
    }
    // Token indices grow with the bits, so the highest bounds them all.
    let last = 15 - live.leading_zeros() as usize;
    assert!(
        acc.len() >= rows * n
            && last < vals.len()
            && last < stride
            && (rows == 0 || w.len() > (rows - 1) * stride + last),
        "invariant: callers pass whole rows"
    );
    let count = live.count_ones() as usize;
    // The kernels take the live tokens' values in order, the `j`-th weighted by `w[r * stride
    // + j]`. Where the live tokens are the chunk's first `count` (every token of a chunk that
    // every row sees: nearly every chunk of a decode) that is the caller's layout; otherwise
    // each row's live weights move to its front (in place: a token's index is never below its
    // place) and the values with them.
    let mut packed = [std::ptr::null::<u8>(); 16];
    let vals = if live == first_lanes(count) {
        &vals[..count]
    } else {
        for r in 0..rows {
            let row = &mut w[r * stride..r * stride + last + 1];
            let mut bits = live;
            for j in 0..count {
                let t = bits.trailing_zeros() as usize;
                row[j] = row[t];
                bits &= bits - 1;
            }
        }
        let mut bits = live;
        for p in &mut packed[..count] {
            *p = vals[bits.trailing_zeros() as usize];
            bits &= bits - 1;
        }
        &packed[..count]
    };
    #[cfg(target_arch = "x86_64")]
    if ISA != PORTABLE {
        let (ap, wp) = (acc.as_mut_ptr(), w.as_ptr());
        // SAFETY: the assert above bounds every access to `acc` and `w` (the `j`-th value's
        // weight sits at `j <= last`), the caller's contract every value; the module doc
        // covers ISA.
        unsafe {
            if ISA >= AVX512 {
                avx512::axpy_rows::<T>(ap, n, (wp, stride), vals, rows, ahead);
            } else {
                avx2::axpy_rows::<T>(ap, n, (wp, stride), vals, rows, ahead);
            }
        }
        return;
    }
    for (j, &v) in vals.iter().enumerate() {
        // SAFETY: the caller's contract: `v` points at `n` elements of `T`.
        let v = unsafe { std::slice::from_raw_parts(v.cast::<T>(), n) };
        for (g, a) in acc.chunks_exact_mut(n).take(rows).enumerate() {
            for (x, y) in a.iter_mut().zip(v) {
                *x += w[g * stride + j] * y.to_f32();
            }
        }
    }
}

/// Puts each whole block of `2 * lanes` elements of a query row in the order in which a build
/// of `lanes` f32 lanes (8: AVX2, 16: AVX-512) widens bf16 keys for Q·K (one load whose 32-bit
/// lanes each hold two elements, split by a shift and a mask): the block's even elements,
/// then its odd ones. Elements past the last whole block keep their places.
pub(crate) fn pair_order(row: &mut [f32], lanes: usize) {
    assert!(
        lanes <= 16,
        "invariant: the builds have at most 16 f32 lanes"
    );
    let mut b = [0.0f32; 32];
    for block in row.chunks_exact_mut(2 * lanes) {
        b[..2 * lanes].copy_from_slice(block);
        for j in 0..lanes {
            (block[j], block[lanes + j]) = (b[2 * j], b[2 * j + 1]);
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

/// The head dim that the chunk kernels' blocks of 4 rows take as a constant (the shape of
/// record: GQA 4 and 8 at head dim 128), so that their loops unroll and address rows at
/// fixed offsets; other head dims run the same code with the head dim at run time (`N = 0`).
/// The sums are the same bits either way.
#[cfg(target_arch = "x86_64")]
const FIXED_HEAD_DIM: usize = 128;

/// The small Llama-family models' head dim (SmolLM2 with groups of 3, Llama-3.2-1B and
/// TinyLlama with groups of 4 and 8), which the chunk kernels take as a constant too, for
/// blocks of 4 rows and, in the AVX2 build, of 3. At this head dim a key's fixed costs weigh
/// on half as many multiply-adds, so the loop counters cost twice as much a multiply-add.
#[cfg(target_arch = "x86_64")]
const SMALL_HEAD_DIM: usize = 64;

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

/// Splits `rows` into blocks of 4 and one last block of 3, 2 or 1, for the AVX2 kernels,
/// whose 16 registers hold the accumulators of at most 4 rows (and which have a 3-row form,
/// so that groups of 3 take one block).
#[inline(always)]
fn row_blocks4(rows: usize, mut f: impl FnMut(usize, usize)) {
    let mut r = 0;
    while r < rows {
        let block = (rows - r).min(4);
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

/// `exp(x)` for `x <= 0` with the same bits on every machine: the SIMD builds' Cody-Waite
/// reduction by ln 2 and Cephes' degree-5 polynomial written as `mul_add`s, each a single
/// rounding whether the CPU fuses it or the library does, so that a loop of it vectorizes
/// where FMA is on and gives the same bits where it is not. Within 2 ulp of `exp` on
/// `[-87.3, 0]`. Unlike the SIMD builds' lanes, which clamp there (about 1e-38), it returns 0
/// below -87.3 (and at -inf), and NaN for NaN. Positive `x` is taken as 0.
#[inline(always)]
pub fn exp_nonpositive(x: f32) -> f32 {
    let clamped = x.clamp(EXP_CLAMP, 0.0);
    let n = (clamped * std::f32::consts::LOG2_E).round_ties_even();
    let r = n.mul_add(LN2_LO, n.mul_add(LN2_HI, clamped));
    let p = EXP_POLY[1..]
        .iter()
        .fold(EXP_POLY[0], |p, &c| p.mul_add(r, c));
    let y = (p * r).mul_add(r, r + 1.0);
    // `n` is a whole number in -126..=0, exact in the low bits of `n + 1.5 * 2^23` (an integer
    // conversion with `as` saturates lane by lane instead of vectorizing).
    let n_bits = (n + 12_582_912.0).to_bits().wrapping_sub(0x4b40_0000);
    let scaled = f32::from_bits(y.to_bits().wrapping_add(n_bits << 23));
    if x >= EXP_CLAMP {
        scaled
    } else if x.is_nan() {
        x
    } else {
        0.0
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

#[cfg(all(test, target_arch = "x86_64"))]
mod tests;
