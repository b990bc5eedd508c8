//! Per-page elementwise key minimum and maximum, the representation Quest and RocketKV share.

use attn_op::Element;
use half::{bf16, f16};
use rayon::prelude::*;

use crate::algo::check_batch;
use crate::pool::RowMut;
use crate::{AlgoError, KeySource, RepPool, RepShape, Summary, summary};

/// The shape of min/max representations: per page and KV head, `[kmax ‖ kmin]`.
pub(crate) fn shape(page_size: usize, kv_heads: usize, head_dim: usize) -> RepShape {
    RepShape {
        page_size,
        heads: kv_heads,
        // Saturating: a width past `usize` is refused where a pool of it is made.
        width: head_dim.saturating_mul(2),
    }
}

/// Extends every slot's min/max pages to its sequence's length, recomputing the last page it
/// had (which may have been partial) from the keys, and storing the bounds as `summary` says,
/// in the pool's element type (a 16-bit pool's rounded outward, [`round_out`]). Checks the batch
/// against the pool first.
pub(crate) fn update(
    layer: usize,
    keys: &dyn KeySource,
    slots: &[usize],
    pool: &mut RepPool,
    shape: RepShape,
    summary: Summary,
) -> Result<(), AlgoError> {
    check_batch(keys, slots, pool, shape)?;
    let RepShape {
        page_size: ps,
        heads,
        width,
    } = pool.shape();
    let page_len = heads * width;
    for (s, &slot) in slots.iter().enumerate() {
        let len = keys.seq_len(s);
        let (row, built) = pool.row_mut(layer, slot, len)?;
        let first = (*built).min(len) / ps;
        let pages = first * page_len..len.div_ceil(ps) * page_len;
        let page = |p: usize, buf: &mut Vec<f32>, dst: &mut [f32]| {
            let start = p * ps;
            bounds(
                keys,
                s,
                start..len.min(start + ps),
                (heads, width),
                buf,
                dst,
                summary,
            );
        };
        match row {
            RowMut::F32(row) => row[pages]
                .par_chunks_mut(page_len)
                .enumerate()
                .for_each_init(Vec::new, |buf, (i, dst)| page(first + i, buf, dst)),
            RowMut::Bf16(row) => narrow(&mut row[pages], page_len, width, first, &page),
            RowMut::F16(row) => narrow(&mut row[pages], page_len, width, first, &page),
        }
        *built = len;
    }
    Ok(())
}

/// Pages of a 16-bit pool's row from page `first` on: each computed in f32 by `page`, then
/// rounded outward.
fn narrow<H: Half16, F: Fn(usize, &mut Vec<f32>, &mut [f32]) + Sync>(
    row: &mut [H],
    page_len: usize,
    width: usize,
    first: usize,
    page: &F,
) {
    row.par_chunks_mut(page_len).enumerate().for_each_init(
        || (Vec::new(), vec![0.0f32; page_len]),
        |(buf, wide), (i, dst)| {
            page(first + i, buf, wide);
            round_out(wide, width, dst);
        },
    );
}

/// The `[kmax ‖ kmin]` rows (`width` each, `heads` of them) of the page of sequence `s` that
/// holds tokens `tokens`, into `dst`, as `summary` stores them; `buf` is scratch for the
/// page's keys.
fn bounds(
    keys: &dyn KeySource,
    s: usize,
    tokens: std::ops::Range<usize>,
    (heads, width): (usize, usize),
    buf: &mut Vec<f32>,
    dst: &mut [f32],
    summary: Summary,
) {
    let d = width / 2;
    let n = tokens.len();
    buf.resize(n * heads * d, 0.0);
    keys.read(s, tokens.start, buf);
    for h in 0..heads {
        let (kmax, kmin) = dst[h * width..(h + 1) * width].split_at_mut(d);
        kmax.fill(f32::NEG_INFINITY);
        kmin.fill(f32::INFINITY);
        for t in 0..n {
            let k = &buf[(t * heads + h) * d..(t * heads + h + 1) * d];
            for ((hi, lo), &x) in kmax.iter_mut().zip(kmin.iter_mut()).zip(k) {
                *hi = hi.max(x);
                *lo = lo.min(x);
            }
        }
        if summary == Summary::E4m3 {
            summary::round_row(&mut dst[h * width..(h + 1) * width]);
        }
    }
}

/// `[kmax ‖ kmin]` rows of `width` in `wide`, rounded outward into `dst`: each `kmax` to the
/// least 16-bit value at or above it, each `kmin` to the greatest at or below it, so that the
/// rows still bound every key (exact where the bound is such a value already).
fn round_out<H: Half16>(wide: &[f32], width: usize, dst: &mut [H]) {
    let d = width / 2;
    for (w, o) in wide.chunks_exact(width).zip(dst.chunks_exact_mut(width)) {
        for (i, (&x, y)) in w.iter().zip(o.iter_mut()).enumerate() {
            *y = toward(x, i < d);
        }
    }
}

/// A 16-bit float type (sign bit on top, then exponent and mantissa) a pool stores bounds in:
/// its bits, beside [`Element`]'s conversions.
trait Half16: Element {
    /// The bit pattern.
    fn bits(self) -> u16;
    /// The value of a bit pattern.
    fn of_bits(bits: u16) -> Self;
}

/// Implements [`Half16`] through `half`'s inherent methods, which both types share.
macro_rules! half16 {
    ($($t:ty),*) => {$(
        impl Half16 for $t {
            fn bits(self) -> u16 {
                self.to_bits()
            }
            fn of_bits(bits: u16) -> Self {
                <$t>::from_bits(bits)
            }
        }
    )*};
}
half16!(bf16, f16);

/// The 16-bit value next to `x` upward (`up`) or downward: `x` itself where it is one, else
/// the nearest in that direction (past the largest finite, an infinity); NaN stays NaN.
fn toward<H: Half16>(x: f32, up: bool) -> H {
    // `from_f32` rounds to the nearest value, NaN to NaN.
    let n = H::from_f32(x);
    let v = n.to_f32();
    if v.is_nan() || v == x || (v > x) == up {
        return n;
    }
    // One step from `n` toward `x` and past it. Bits of the same sign count magnitudes, so the
    // step grows the magnitude where it moves away from zero (up from a positive value or a
    // +0, down from a negative one or a -0) and shrinks it otherwise. A nearest value on the
    // wrong side is never a zero moving toward zero, nor an infinity moving away from it.
    let b = n.bits();
    let negative = b & 0x8000 != 0;
    H::of_bits(if up != negative { b + 1 } else { b - 1 })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Directed rounding to bf16 at the edges: exact values, both signs, the largest finite
    /// f32, subnormals, zeros and NaN.
    #[test]
    fn bf16_rounding_goes_the_way_it_is_asked() {
        let bf16_toward = toward::<bf16>;
        let b = |bits: u16| bf16::from_bits(bits).to_f32();
        let step = 1.0 + 2f32.powi(-7);
        for (x, up, want) in [
            (1.0f32, true, 1.0f32),
            (1.0, false, 1.0),
            (1.0 + 2f32.powi(-10), true, step),
            (1.0 + 2f32.powi(-10), false, 1.0),
            (-1.0 - 2f32.powi(-10), true, -1.0),
            (-1.0 - 2f32.powi(-10), false, -step),
            (f32::MAX, true, f32::INFINITY),
            (f32::MAX, false, bf16::MAX.to_f32()),
            (-f32::MAX, false, f32::NEG_INFINITY),
            (f32::INFINITY, false, f32::INFINITY),
            (f32::from_bits(1), true, b(0x0001)),
            (f32::from_bits(1), false, 0.0),
            (-f32::from_bits(1), true, -0.0),
            (-f32::from_bits(1), false, b(0x8001)),
        ] {
            let got = bf16_toward(x, up).to_f32();
            assert_eq!(got.to_bits(), want.to_bits(), "{x:e} up {up}: {got:e}");
        }
        assert_eq!(bf16_toward(-0.0, true).to_bits(), 0x8000);
        assert!(bf16_toward(f32::NAN, true).is_nan());
        assert!(bf16_toward(f32::from_bits(0x7f80_0001), false).is_nan());
    }

    /// Directed rounding to f16 where its range ends: past the largest finite (65504), below
    /// the smallest subnormal (2^-24), across zero, and at exact values.
    #[test]
    fn f16_rounding_goes_the_way_it_is_asked() {
        let tiny = 2f32.powi(-24);
        for (x, up, want) in [
            (1.0f32, true, 1.0f32),
            (1.0 + 2f32.powi(-12), true, 1.0 + 2f32.powi(-10)),
            (1.0 + 2f32.powi(-12), false, 1.0),
            (-1.0 - 2f32.powi(-12), true, -1.0),
            (-1.0 - 2f32.powi(-12), false, -1.0 - 2f32.powi(-10)),
            (65504.0, true, 65504.0),
            (65505.0, true, f32::INFINITY),
            (65505.0, false, 65504.0),
            (1e6, false, 65504.0),
            (-1e6, true, -65504.0),
            (-1e6, false, f32::NEG_INFINITY),
            (1e-9, true, tiny),
            (1e-9, false, 0.0),
            (-1e-9, true, -0.0),
            (-1e-9, false, -tiny),
            (0.75 * tiny, true, tiny),
            (1.5 * tiny, false, tiny),
        ] {
            let got = toward::<f16>(x, up).to_f32();
            assert_eq!(got.to_bits(), want.to_bits(), "{x:e} up {up}: {got:e}");
        }
        assert!(toward::<f16>(f32::NAN, false).is_nan());
    }
}
