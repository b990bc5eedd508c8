//! The decode matmul's inner kernel for quantized weights, as ggml runs it: the few input rows
//! are quantized once per matmul to 8 bits in blocks of 32 (`d · q`, [`Q8Rows`]), and each
//! weight block meets each input block in an integer dot product (`maddubs`, 32 products in
//! one instruction on AVX2), scaled by both blocks' `d`. Q4_1's minimum adds `m · d · Σq`.
//! A portable scalar body computes the same sums where AVX2 is missing.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use crate::gguf::DType;

/// Input rows the kernel takes at once (the fused path runs fewer than 8).
pub(crate) const MAX_ROWS: usize = 7;

/// Whether [`tile_dot`] handles `dtype`.
pub(crate) fn supports(dtype: DType) -> bool {
    matches!(dtype, DType::Q8_0 | DType::Q4_0 | DType::Q4_1)
}

/// Input rows quantized to 8 bits in blocks of 32: element `j` of row `i` is about
/// `d[i, j / 32] · q[i, j]`, with `|q| ≤ 127`.
pub(crate) struct Q8Rows {
    q: Vec<i8>,
    /// Per block, its scale `d`.
    d: Vec<f32>,
    /// Per block, `d · Σq` (Q4_1's minimum multiplies it).
    s: Vec<f32>,
    cols: usize,
}

impl Q8Rows {
    /// Quantizes the `n` rows of `x`, each `cols` long (a multiple of 32): `d` is the block's
    /// largest magnitude over 127, and `q` rounds `x / d` to nearest. `like_ggml` rounds as
    /// ggml's x86 `quantize_row_q8_1` does: `q` to nearest even, then `d` and `d · Σq` to f16.
    pub(crate) fn new(x: &[f32], n: usize, cols: usize, like_ggml: bool) -> Q8Rows {
        let blocks = n * cols / 32;
        let mut r = Q8Rows {
            q: vec![0; n * cols],
            d: Vec::with_capacity(blocks),
            s: Vec::with_capacity(blocks),
            cols,
        };
        for (xb, qb) in x[..n * cols].chunks_exact(32).zip(r.q.chunks_exact_mut(32)) {
            let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            let mut sum = 0i32;
            for (q, &v) in qb.iter_mut().zip(xb) {
                let v = v * id;
                let v = if like_ggml {
                    v.round_ties_even()
                } else {
                    v.round()
                };
                // |v| ≤ 127 up to rounding; the clamp makes the cast exact.
                *q = v.clamp(-127.0, 127.0) as i8;
                sum += i32::from(*q);
            }
            let d = amax / 127.0;
            let s = d * sum as f32;
            let half = |v: f32| half::f16::from_f32(v).to_f32();
            r.d.push(if like_ggml { half(d) } else { d });
            r.s.push(if like_ggml { half(s) } else { s });
        }
        r
    }
}

/// `dst[i * stride + r] = x_i · w_r` for the weight rows `w` (each `row_bytes` long, `x.cols`
/// weights of `dtype`) and the first `n ≤ MAX_ROWS` rows of `x`.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `dtype` must be one [`supports`] accepts; `x` must
/// hold at least `n` rows and `dst` `(n - 1) × stride + rows` of `w`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn tile_dot(
    dtype: DType,
    w: &[u8],
    row_bytes: usize,
    x: &Q8Rows,
    n: usize,
    dst: &mut [f32],
    stride: usize,
) {
    let n = n.min(MAX_ROWS);
    let (_, bytes) = dtype.block();
    let blocks = x.cols / 32;
    assert!(
        x.q.len() >= n * x.cols
            && x.d.len() >= n * blocks
            && x.s.len() >= n * blocks
            && blocks * bytes <= row_bytes
            && bytes >= 4,
        "qdot::tile_dot: the caller sizes x and rows from the layer's shape"
    );
    let rows = w.len() / row_bytes;
    assert!(
        n == 0 || dst.len() >= (n - 1) * stride + rows,
        "qdot::tile_dot: the caller sizes dst from the tile"
    );
    let mut t = Tile {
        dtype,
        w,
        row_bytes,
        x,
        dst,
        stride,
    };
    // SAFETY: the CPU has AVX2, FMA and F16C (this function's contract), and the asserts above
    // are what `rows_dot` reads and writes within.
    unsafe {
        match n {
            1 => rows_dot::<1>(&mut t),
            2 => rows_dot::<2>(&mut t),
            3 => rows_dot::<3>(&mut t),
            4 => rows_dot::<4>(&mut t),
            5 => rows_dot::<5>(&mut t),
            6 => rows_dot::<6>(&mut t),
            7 => rows_dot::<7>(&mut t),
            _ => {}
        }
    }
}

/// What [`tile_dot`] hands its body.
#[cfg(target_arch = "x86_64")]
struct Tile<'a> {
    dtype: DType,
    w: &'a [u8],
    row_bytes: usize,
    x: &'a Q8Rows,
    dst: &'a mut [f32],
    stride: usize,
}

/// [`tile_dot`] for `N` input rows, whose accumulators then stay in registers. Each row adds
/// its blocks in order into one accumulator, as ggml's AVX2 kernel does, so the sums keep
/// their bits whatever `N` is.
///
/// # Safety
/// AVX2, FMA and F16C; `t.x` holds `N` rows (their `q`, `d` and `s`), each weight row holds
/// `x.cols / 32` whole blocks of at least 4 bytes, and `t.dst` holds `(N - 1) × stride + rows`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_dot<const N: usize>(t: &mut Tile<'_>) {
    let (_, bytes) = t.dtype.block();
    let x = t.x;
    let blocks = x.cols / 32;
    let ones = _mm256_set1_epi16(1);
    // Q4_1's nibbles are unsigned: maddubs takes them as they are. Signed weights multiply as
    // |w| · (x with w's sign). Only Q4_1 has a minimum.
    let unsigned = t.dtype == DType::Q4_1;
    for (r, row) in t.w.chunks_exact(t.row_bytes).enumerate() {
        let mut acc = [_mm256_setzero_ps(); N];
        let mut mins = [0.0f32; N];
        for b in 0..blocks {
            let blk = &row[b * bytes..(b + 1) * bytes];
            // The block's f16 scale and (Q4_1) minimum, widened together: exact, as a
            // scalar conversion is. A block has at least 4 bytes (asserted by the caller).
            // SAFETY: `blk` holds `bytes >= 4` bytes; the read is unaligned.
            let head = unsafe { std::ptr::read_unaligned(blk.as_ptr().cast::<i32>()) };
            let head = _mm_cvtph_ps(_mm_cvtsi32_si128(head));
            let dw = _mm_cvtss_f32(head);
            let mw = if unsigned {
                _mm_cvtss_f32(_mm_movehdup_ps(head))
            } else {
                0.0
            };
            // SAFETY: `blk` is one whole block of `dtype`, which is all `weights` reads.
            let wq = unsafe { weights(t.dtype, blk) };
            let wabs = if unsigned {
                wq
            } else {
                _mm256_sign_epi8(wq, wq)
            };
            for i in 0..N {
                let k = i * blocks + b;
                // SAFETY: row `i < N` of `x` holds `blocks` blocks (the contract), so `k` is
                // within `d` and `s`, and `32 k + 32` within `q`.
                let (xq, xd, xsum) = unsafe {
                    (
                        _mm256_loadu_si256(x.q.as_ptr().add(32 * k).cast()),
                        *x.d.get_unchecked(k),
                        *x.s.get_unchecked(k),
                    )
                };
                let xsigned = if unsigned {
                    xq
                } else {
                    _mm256_sign_epi8(xq, wq)
                };
                let sum = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, xsigned), ones);
                let scale = _mm256_set1_ps(dw * xd);
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc[i]);
                mins[i] += mw * xsum;
            }
        }
        for i in 0..N {
            // SAFETY: `i < N` and `r < rows`, within the contract's `dst`.
            unsafe { *t.dst.get_unchecked_mut(i * t.stride + r) = hsum(acc[i]) + mins[i] };
        }
    }
}

/// The scalar body of [`tile_dot`], for CPUs without AVX2: the same integer sums per block.
pub(crate) fn tile_dot_portable(
    dtype: DType,
    w: &[u8],
    row_bytes: usize,
    x: &Q8Rows,
    n: usize,
    dst: &mut [f32],
    stride: usize,
) {
    let (_, bytes) = dtype.block();
    let blocks = x.cols / 32;
    for (r, row) in w.chunks_exact(row_bytes).enumerate() {
        for i in 0..n.min(MAX_ROWS) {
            let mut acc = 0.0f32;
            for b in 0..blocks {
                let blk = &row[b * bytes..(b + 1) * bytes];
                let h = |i: usize| half::f16::from_le_bytes([blk[i], blk[i + 1]]).to_f32();
                let xq = &x.q[i * x.cols + b * 32..][..32];
                let k = i * blocks + b;
                let sum: i32 = match dtype {
                    DType::Q8_0 => (0..32)
                        .map(|j| i32::from(blk[2 + j] as i8) * i32::from(xq[j]))
                        .sum(),
                    _ => {
                        let at = if dtype == DType::Q4_1 { 4 } else { 2 };
                        let off = if dtype == DType::Q4_1 { 0 } else { 8 };
                        (0..32)
                            .map(|j| {
                                let byte = blk[at + j % 16];
                                let nib = if j < 16 { byte & 15 } else { byte >> 4 };
                                (i32::from(nib) - off) * i32::from(xq[j])
                            })
                            .sum()
                    }
                };
                acc += h(0) * x.d[k] * sum as f32;
                if dtype == DType::Q4_1 {
                    acc += h(2) * x.s[k];
                }
            }
            dst[i * stride + r] = acc;
        }
    }
}

/// One block's 32 weights as 32 bytes in element order: Q8_0's signed values, Q4_0's
/// nibbles minus 8, Q4_1's nibbles (elements 0–15 are the low nibbles, 16–31 the high).
///
/// # Safety
/// AVX2; `blk` is one whole block of `dtype`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn weights(dtype: DType, blk: &[u8]) -> __m256i {
    match dtype {
        // SAFETY: a Q8_0 block is 2 + 32 bytes; the load reads bytes 2..34.
        DType::Q8_0 => unsafe { _mm256_loadu_si256(blk.as_ptr().add(2).cast()) },
        // SAFETY: a Q4_0 block is 2 + 16 bytes, a Q4_1 block 4 + 16; the load reads the 16
        // after the header.
        _ => unsafe {
            let at = if dtype == DType::Q4_1 { 4 } else { 2 };
            let q = _mm_loadu_si128(blk.as_ptr().add(at).cast());
            let mask = _mm_set1_epi8(0x0f);
            let lo = _mm_and_si128(q, mask);
            let hi = _mm_and_si128(_mm_srli_epi16::<4>(q), mask);
            let v = _mm256_set_m128i(hi, lo);
            if dtype == DType::Q4_1 {
                v
            } else {
                _mm256_sub_epi8(v, _mm256_set1_epi8(8))
            }
        },
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::dequantize;

    /// Weight rows of `dtype` with random codes and scales, from a fixed seed.
    fn rows(dtype: DType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        let mut next = move || {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (s >> 33) as u32
        };
        let (_, bytes) = dtype.block();
        let mut out = Vec::new();
        for _ in 0..rows * cols / 32 {
            let mut blk: Vec<u8> = (0..bytes).map(|_| next() as u8).collect();
            let scale =
                |v: u32| half::f16::from_f32(0.005 + (v % 1000) as f32 * 1e-4).to_le_bytes();
            blk[..2].copy_from_slice(&scale(next()));
            if dtype == DType::Q4_1 {
                let m = half::f16::from_f32(-0.05 + (next() % 100) as f32 * 1e-3);
                blk[2..4].copy_from_slice(&m.to_le_bytes());
            }
            out.extend(blk);
        }
        out
    }

    #[test]
    fn both_bodies_compute_the_integer_dot_products() {
        let (n_rows, cols) = (5, 128);
        let x: Vec<f32> = (0..MAX_ROWS * cols)
            .map(|i| ((i * 7919 % 211) as f32 - 105.0) / 37.0)
            .collect();
        let q = Q8Rows::new(&x, MAX_ROWS, cols, false);
        // Every row count the AVX2 body has a build for, and every weight type.
        let cases =
            (1..=MAX_ROWS).flat_map(|n| [(n, DType::Q8_0), (n, DType::Q4_0), (n, DType::Q4_1)]);
        for (n, dtype) in cases {
            let (_, bytes) = dtype.block();
            let row_bytes = cols / 32 * bytes;
            let w = rows(dtype, n_rows, cols, 7);
            let mut portable = vec![f32::NAN; n * n_rows];
            tile_dot_portable(dtype, &w, row_bytes, &q, n, &mut portable, n_rows);
            for r in 0..n_rows {
                let mut wr = vec![0.0f32; cols];
                dequantize(dtype, &w[r * row_bytes..(r + 1) * row_bytes], &mut wr);
                for i in 0..n {
                    let want: f64 = (0..cols)
                        .map(|k| {
                            let xv =
                                f64::from(q.d[(i * cols + k) / 32]) * f64::from(q.q[i * cols + k]);
                            xv * f64::from(wr[k])
                        })
                        .sum();
                    let got = f64::from(portable[i * n_rows + r]);
                    assert!(
                        (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "{dtype:?} portable {got} vs {want}"
                    );
                }
            }
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                let mut simd = vec![f32::NAN; n * n_rows];
                // SAFETY: AVX2, FMA and F16C were detected; the dtype is supported; `q` holds n
                // rows of `cols`; `simd` holds n rows of `n_rows`.
                unsafe { tile_dot(dtype, &w, row_bytes, &q, n, &mut simd, n_rows) };
                for (a, b) in simd.iter().zip(&portable) {
                    assert!(
                        (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                        "{dtype:?} AVX2 {a} vs portable {b}"
                    );
                }
            }
        }
    }
}
