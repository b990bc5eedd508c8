//! The bf16 dot-product build (AVX-512F, AVX-512BW and AVX-512 BF16) for bf16 caches whose head
//! dim is a multiple of 32. `vdpbf16ps` multiplies pairs of bf16 and adds both products to an
//! f32 lane, so a 64-byte load of keys feeds 32 multiply-adds with no widening. Queries and
//! softmax weights are rounded to bf16 (to nearest even) for it, as tensor cores round them.

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
        ahead.part(b, B, 2 * n);
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
    let second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    let per = super::Ahead::per_step(n / 32);
    let mut i = 0;
    while i < n {
        ahead.part(i / 32, per, 2 * n);
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
                    let wv: __m512bh = std::mem::transmute(_mm512_set1_epi32(packed[r][p] as i32));
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
