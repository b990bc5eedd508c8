//! The inner loops of attention in four builds: portable Rust, AVX2 + FMA + F16C, AVX-512F,
//! and AVX-512 BF16 dot products for bf16 caches. `ISA` selects one at compile time; the
//! kernel instantiates the SIMD builds only inside functions compiled for those features and
//! entered after `detect` found them, which is the invariant every `unsafe` call in this module
//! and its three builds relies on.

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512bf16;

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
    /// Rows of a later chunk, by token of the current chunk (none where `run` alone
    /// describes them).
    rows: &'a [*const u8],
    /// How many rows.
    len: usize,
    /// Bytes of each row.
    bytes: usize,
    /// The first row where the rows lie back to back (one range of lines), else null.
    run: *const u8,
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
        len: 0,
        bytes: 0,
        run: std::ptr::null(),
    };

    /// Asks for `len` rows of `bytes` that lie back to back from `first`, one with the work
    /// on each token.
    pub(crate) fn back_to_back(first: *const u8, len: usize, bytes: usize) -> Self {
        Ahead {
            rows: &[],
            len,
            bytes,
            run: if len == 0 { std::ptr::null() } else { first },
        }
    }

    /// Asks for `rows[t]` (`bytes` from each) with the work on token `t`. Rows whose first
    /// and last lie as far apart as back-to-back rows would (a decode's every head of
    /// consecutive tokens of a page) are taken as one range, so that a step's share is one
    /// loop over its lines; a prefetch is a hint, so a wrong guess costs time, never a result.
    pub(crate) fn new(rows: &'a [*const u8], bytes: usize) -> Self {
        let run = match rows {
            [first, .., last] if first.wrapping_add((rows.len() - 1) * bytes) == *last => *first,
            [only] => *only,
            _ => std::ptr::null(),
        };
        Ahead {
            rows,
            len: rows.len(),
            bytes,
            run,
        }
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
    /// `row_bytes` is the rows' size as the kernel knows it (the `bytes` of [`Ahead::new`]),
    /// a constant where the kernel's head dim and element are: then a whole step's share of
    /// back-to-back rows is a fixed run of prefetches, with no loop to count.
    #[inline(always)]
    pub(crate) fn part(&self, k: usize, per: usize, row_bytes: usize) {
        debug_assert!(self.len == 0 || row_bytes == self.bytes);
        let (lo, hi) = (k * per, ((k + 1) * per).min(self.len));
        if lo >= hi {
            return;
        }
        if !self.run.is_null() {
            let from = self.run.wrapping_add(lo * row_bytes);
            // The same call either way; the first has a length the compiler knows where
            // `per` and `row_bytes` are constants (every step but a short chunk's last).
            if hi - lo == per {
                fetch_lines(from, per * row_bytes);
            } else {
                fetch_lines(from, (hi - lo) * row_bytes);
            }
        } else {
            self.rows[lo..hi]
                .iter()
                .for_each(|&p| fetch_lines(p, row_bytes));
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
        // Plain loops, eight lines a turn, then four: `step_by`'s setup (a rounded-up
        // division) cost more than the prefetches of a row of 4 lines (a bf16 head of 128).
        let line = |o: usize| {
            // SAFETY: a prefetch reads nothing architecturally and never faults, whatever the
            // address (`wrapping_add` keeps the pointer arithmetic defined).
            unsafe { _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(o).cast::<i8>()) };
        };
        let mut o = 0;
        while o + 256 <= bytes {
            (0..4).for_each(|k| line(o + 64 * k));
            o += 256;
        }
        while o < bytes {
            line(o);
            o += 64;
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

/// The Q·K of one SIMD build over a block of keys, inside its module (`$w` f32 lanes of vector
/// type `$v`; the build's intrinsics and widening load `$load`; the module's `load_pair` from
/// [`chunk_axpy`]; `$few`, the most keys whose widened pairs stay in registers with the
/// block's accumulators). `block_dots` adds `q_r · key_t` to accumulator `[r][t]`: `2 * $w`
/// elements a step in `load_pair`'s order (so the rows in [`pair_order`] for bf16 keys), each
/// accumulator its key's first vector, then its second; then one vector where one is left.
/// Per-key dot products (`dot_rows`) and the chunk kernels (`qk_chunk`) both go through it, so
/// their sums are the same bits.
macro_rules! qk_block {
    ($w:literal, $v:ty, $zero:ident, $fma:ident, $ldu:ident, $load:ident, $few:literal) => {
        #[doc = concat!("Adds each key's dot products with the `R` rows of `q` (`n` f32 each) to ")]
        #[doc = concat!("`acc`, over the elements whole vectors of ", $w, " cover; returns where ")]
        #[doc = "they end."]
        ///
        /// # Safety
        /// The CPU must support the build; `q` must hold `R` rows of `n` floats and each of the
        /// `B` keys `n` elements of `dtype`.
        #[inline(always)]
        unsafe fn block_dots<const R: usize, const B: usize, const N: usize>(
            (q, n): (*const f32, usize),
            (keys, dtype): (&[*const u8], DType),
            acc: &mut [[$v; B]; R],
        ) -> usize {
            debug_assert!(keys.len() == B && (N == 0 || N == n));
            let n = if N == 0 { n } else { N };
            let mut i = 0;
            while i + 2 * $w <= n {
                // SAFETY: `i + 2 * $w <= n`: within every key and each of the `R` rows of `q`.
                unsafe {
                    if B <= $few {
                        // Every key's pair in registers, each query vector loaded once.
                        let mut ks = [($zero(), $zero()); B];
                        for (k, &key) in ks.iter_mut().zip(keys) {
                            *k = load_pair(key, dtype, i);
                        }
                        for (r, row) in acc.iter_mut().enumerate() {
                            let q0 = $ldu(q.add(r * n + i));
                            for (a, k) in row.iter_mut().zip(&ks) {
                                *a = $fma(q0, k.0, *a);
                            }
                            let q1 = $ldu(q.add(r * n + i + $w));
                            for (a, k) in row.iter_mut().zip(&ks) {
                                *a = $fma(q1, k.1, *a);
                            }
                        }
                    } else {
                        // Many keys (few rows): a key's pair at a time.
                        for (t, &key) in keys.iter().enumerate() {
                            let (k0, k1) = load_pair(key, dtype, i);
                            for (r, row) in acc.iter_mut().enumerate() {
                                row[t] = $fma($ldu(q.add(r * n + i)), k0, row[t]);
                                row[t] = $fma($ldu(q.add(r * n + i + $w)), k1, row[t]);
                            }
                        }
                    }
                }
                i += 2 * $w;
            }
            if i + $w <= n {
                for (t, &key) in keys.iter().enumerate() {
                    // SAFETY: `i + $w <= n`: within every key and each of the `R` rows of `q`.
                    unsafe {
                        let kv = $load(key, dtype, i);
                        for (r, row) in acc.iter_mut().enumerate() {
                            row[t] = $fma($ldu(q.add(r * n + i)), kv, row[t]);
                        }
                    }
                }
                i += $w;
            }
            i
        }
    };
}

/// The builds expand it by path (`super::qk_block`), as [`chunk_axpy`].
#[cfg(target_arch = "x86_64")]
use qk_block;

/// The chunked PV step of one SIMD build, inside its module (`$feat`: its target features,
/// `$isa`: their names for the docs; `$w` f32 lanes of vector type `$v`; the build's
/// intrinsics, its widening load `$load` and the module's `in_order`; `$blocks` the function
/// that cuts rows into blocks whose accumulators its registers hold, and `[$r, ...]` the
/// block sizes above 1 that it yields): `load_pair` widens two
/// vectors' worth of a value, `axpy_rows_r` keeps two vectors of each of `R` rows in
/// registers over a chunk's tokens, and `axpy_rows` runs it over row blocks.
macro_rules! chunk_axpy {
    ($feat:literal, $isa:literal, $blocks:ident, [$($r:literal),+],
     [$(($fr:literal, $fd:path)),+],
     $w:literal, $v:ty, $zero:ident, $set1:ident, $fma:ident,
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

        /// Adds each value of `vs`, the `j`-th weighted by `w[r * stride + j]`, to the sums
        /// `(a0, a1)` of row `r` (the two vectors from element `i`, in `load_pair`'s order),
        /// token by token in order; tokens go `G` a loop step.
        ///
        /// # Safety
        /// Every value of `vs` must hold the two vectors from element `i` of `T`, and `w`
        /// rows `R` of `stride >= vs.len()` weights.
        #[inline(always)]
        unsafe fn weigh<T: Element, const R: usize, const G: usize>(
            vs: &[*const u8],
            (w, stride): (*const f32, usize),
            i: usize,
            (a0, a1): (&mut [$v; R], &mut [$v; R]),
        ) {
            // Tokens `G` at a time (one loop step for all), then the rest, each row's sums
            // token by token in order.
            let mut groups = vs.chunks_exact(G);
            let mut j = 0;
            for group in groups.by_ref() {
                for (t, &v) in group.iter().enumerate() {
                    // SAFETY: the caller's contract, for value `j + t`.
                    unsafe { weigh_one::<T, R>(v, (w.add(j + t), stride), i, (a0, a1)) };
                }
                j += G;
            }
            for (t, &v) in groups.remainder().iter().enumerate() {
                // SAFETY: as above.
                unsafe { weigh_one::<T, R>(v, (w.add(j + t), stride), i, (a0, a1)) };
            }
        }

        /// Adds value `v`, weighted by `w[r * stride]` in row `r`, to the sums `(a0, a1)` of
        /// the `R` rows (the two vectors from element `i`, in `load_pair`'s order).
        ///
        /// # Safety
        /// `v` must hold the two vectors from element `i` of `T`, and `w` rows `R` of
        /// `stride` weights.
        #[inline(always)]
        unsafe fn weigh_one<T: Element, const R: usize>(
            v: *const u8,
            (w, stride): (*const f32, usize),
            i: usize,
            (a0, a1): (&mut [$v; R], &mut [$v; R]),
        ) {
            // SAFETY: the caller's contract.
            unsafe {
                let (v0, v1) = load_pair(v, T::DTYPE, i);
                for r in 0..R {
                    let wr = $set1(*w.add(r * stride));
                    a0[r] = $fma(wr, v0, a0[r]);
                    a1[r] = $fma(wr, v1, a1[r]);
                }
            }
        }

        /// Adds each chunk value's weighted rows to `acc` (`R` rows of `n`), two vectors of
        /// each row at a time; `N` and `S` are `n` and `stride` where they are constants, else
        /// 0 (the arguments then).
        ///
        #[doc = concat!("# Safety\nThe CPU must support ", $isa, "; `acc` must hold `R * n` f32, ")]
        #[doc = "`w` rows `R` of `stride >= vs.len()` weights (the `j`-th value's in column `j`),"]
        #[doc = "and each value of `vs` `n` elements of `T`."]
        #[target_feature(enable = $feat)]
        unsafe fn axpy_rows_r<T: Element, const R: usize, const N: usize, const S: usize>(
            acc: *mut f32,
            n: usize,
            (w, stride): (*const f32, usize),
            vs: &[*const u8],
            ahead: &super::Ahead<'_>,
        ) {
            debug_assert!((N == 0 || N == n) && (S == 0 || S == stride));
            let (n, stride) = (if N == 0 { n } else { N }, if S == 0 { stride } else { S });
            let dtype = T::DTYPE;
            let per = super::Ahead::per_step(n / (2 * $w));
            // Two vectors of each row at a time, summed over the tokens in registers.
            let mut i = 0;
            while i + 2 * $w <= n {
                let mut a0 = [$zero(); R];
                let mut a1 = [$zero(); R];
                ahead.part(i / (2 * $w), per, n * size_of::<T>());
                // A full chunk's 16 tokens go eight a loop step, a slice of constant length
                // (two steps, no count to keep); 16 a step spilled registers. Fewer go two a
                // step. The sums are the same.
                // SAFETY: the caller's contract.
                unsafe {
                    if let Some(all) = vs.first_chunk::<16>() {
                        weigh::<T, R, 8>(all, (w, stride), i, (&mut a0, &mut a1));
                    } else {
                        weigh::<T, R, 2>(vs, (w, stride), i, (&mut a0, &mut a1));
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
                    for (t, &v) in vs.iter().enumerate() {
                        // SAFETY: `j < n`, `r < R`, `t < stride`.
                        x += unsafe {
                            *w.add(r * stride + t) * super::load_one(v, dtype, j)
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
            vs: &[*const u8],
            rows: usize,
            ahead: &super::Ahead<'_>,
        ) {
            super::$blocks(rows, |r, block| {
                let ahead = ahead.for_rows_from(r);
                // SAFETY: rows `r..r + block` are within the `rows` rows of the caller's
                // contract.
                unsafe {
                    let (acc, w) = (acc.add(r * n), (w.add(r * stride), stride));
                    // The weights' stride is a constant too where it is the kernel's (16).
                    match (block, n, stride) {
                        $(($fr, $fd, 16) => {
                            axpy_rows_r::<T, $fr, { $fd }, 16>(acc, n, w, vs, ahead);
                        })+
                        $(($r, _, _) => axpy_rows_r::<T, $r, 0, 0>(acc, n, w, vs, ahead),)+
                        _ => axpy_rows_r::<T, 1, 0, 0>(acc, n, w, vs, ahead),
                    }
                }
            });
        }
    };
}

/// The builds expand it by path (`super::chunk_axpy`), so their modules may be declared first.
#[cfg(target_arch = "x86_64")]
use chunk_axpy;

#[cfg(all(test, target_arch = "x86_64"))]
mod tests;
