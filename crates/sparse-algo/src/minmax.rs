//! Per-page elementwise key minimum and maximum, the representation Quest and RocketKV share.

use rayon::prelude::*;

use crate::algo::check_batch;
use crate::{AlgoError, KeySource, RepPool, RepShape, Summary, summary};

/// The shape of min/max representations: per page and KV head, `[kmax ‖ kmin]`.
pub(crate) fn shape(page_size: usize, kv_heads: usize, head_dim: usize) -> RepShape {
    RepShape {
        page_size,
        heads: kv_heads,
        width: 2 * head_dim,
    }
}

/// Extends every slot's min/max pages to its sequence's length, recomputing the last page it
/// had (which may have been partial) from the keys, and storing the bounds as `summary` says.
/// Checks the batch against the pool first.
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
    let d = width / 2;
    let page_len = heads * width;
    for (s, &slot) in slots.iter().enumerate() {
        let len = keys.seq_len(s);
        let (row, built) = pool.row_mut(layer, slot, len)?;
        let first = (*built).min(len) / ps;
        let last = len.div_ceil(ps);
        row[first * page_len..last * page_len]
            .par_chunks_mut(page_len)
            .enumerate()
            .for_each_init(Vec::new, |buf, (i, dst)| {
                let p = first + i;
                let start = p * ps;
                let n = (len - start).min(ps);
                buf.resize(n * heads * d, 0.0);
                keys.read(s, start, buf);
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
            });
        *built = len;
    }
    Ok(())
}
