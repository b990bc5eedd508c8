//! The pointers a chunk's head blocks read their K and V rows through, and those the chunk
//! before asks the cache for.

use super::{CHUNK, Run};
use crate::{Element, PagedKv, simd};

/// Pointers to a chunk's K and V rows for each KV head of a job, as the SIMD builds read them:
/// head-major (head block `hb`'s rows at `hb * CHUNK ..`, one a token; entries past the
/// chunk's tokens are stale and never read) for the math, and in address order (token by
/// token, each token's heads in order) for the prefetches of the chunk before. Where those
/// rows lie back to back (a chunk inside one run of a job with every KV head: a decode's
/// chunk of one page), the address order is the first row and a count, and no table is
/// written. Filled once a chunk, by additions only.
#[derive(Default)]
pub(super) struct ChunkRows {
    k: Vec<*const u8>,
    v: Vec<*const u8>,
    k_addr: Vec<*const u8>,
    v_addr: Vec<*const u8>,
    /// The first K and V rows and the row count where the rows lie back to back (the
    /// tables above are then empty).
    span: Option<(*const u8, *const u8, usize)>,
}

impl ChunkRows {
    /// The rows of `chunk`'s tokens, heads `h0..h0 + nh` of head dim `d`.
    pub(super) fn fill<T: Element>(
        &mut self,
        kv: &PagedKv<T>,
        chunk: &[Run],
        (h0, nh): (usize, usize),
        d: usize,
    ) {
        const C: usize = CHUNK as usize;
        let tokens = chunk.iter().map(|run| run.len as usize).sum::<usize>();
        // A run's rows come from one slice of its tokens' rows of every head, so that each
        // pointer stays within the memory it was derived from; head `h` of the run's token
        // `i` lies `i * token + h * row` bytes into it.
        let (row, token) = (
            d * size_of::<T>(),
            kv.layout_ref().token_stride() * size_of::<T>(),
        );
        let back_to_back = chunk.len() == 1 && nh * row == token;
        // Every entry read is written below: no clearing.
        let null = std::ptr::null();
        for rows in [&mut self.k, &mut self.v] {
            rows.resize(nh * C, null);
        }
        let table = if back_to_back { 0 } else { tokens * nh };
        for rows in [&mut self.k_addr, &mut self.v_addr] {
            rows.resize(table, null);
        }
        self.span = None;
        let mut t = 0;
        for run in chunk {
            let n = run.len as usize;
            let (k, v) = kv.run_all_heads(run.slot as usize, n);
            let (k, v) = (k.as_ptr().cast::<u8>(), v.as_ptr().cast::<u8>());
            if back_to_back {
                // Head `h0` is 0: the job has every head.
                self.span = Some((k, v, tokens * nh));
            }
            // Head-major: each head's rows one token apart.
            for hb in 0..nh {
                let at = hb * C + t..hb * C + t + n;
                let (ks, vs) = (&mut self.k[at.clone()], &mut self.v[at]);
                let o = (h0 + hb) * row;
                let (mut kp, mut vp) = (k.wrapping_add(o), v.wrapping_add(o));
                for (kr, vr) in ks.iter_mut().zip(vs) {
                    (*kr, *vr) = (kp, vp);
                    (kp, vp) = (kp.wrapping_add(token), vp.wrapping_add(token));
                }
            }
            t += n;
        }
        if !back_to_back {
            // The same rows in address order: token by token, each token's heads in order.
            for (i, (ka, va)) in self
                .k_addr
                .chunks_exact_mut(nh)
                .zip(self.v_addr.chunks_exact_mut(nh))
                .enumerate()
            {
                for hb in 0..nh {
                    (ka[hb], va[hb]) = (self.k[hb * C + i], self.v[hb * C + i]);
                }
            }
        }
    }

    /// No rows (no chunk).
    pub(super) fn clear(&mut self) {
        self.k.clear();
        self.v.clear();
        self.k_addr.clear();
        self.v_addr.clear();
        self.span = None;
    }

    /// Head block `hb`'s rows of the chunk's first `len` tokens: keys, values.
    pub(super) fn head(&self, hb: usize, len: usize) -> (&[*const u8], &[*const u8]) {
        let at = hb * CHUNK as usize..hb * CHUNK as usize + len;
        (
            self.k.get(at.clone()).unwrap_or(&[]),
            self.v.get(at).unwrap_or(&[]),
        )
    }

    /// What head block `hb` of the chunk before asks the cache for while it computes, for K
    /// and for V (rows of `bytes`): its share of these rows in address order (block `hb`
    /// takes rows `16 hb .. 16 (hb + 1)` of the chunk's tokens times heads).
    pub(super) fn share(&self, hb: usize, bytes: usize) -> (simd::Ahead<'_>, simd::Ahead<'_>) {
        let from = hb * CHUNK as usize;
        if let Some((k, v, rows)) = self.span {
            let len = rows.saturating_sub(from).min(CHUNK as usize);
            let skip = from.min(rows) * bytes;
            return (
                simd::Ahead::back_to_back(k.wrapping_add(skip), len, bytes),
                simd::Ahead::back_to_back(v.wrapping_add(skip), len, bytes),
            );
        }
        // Both address tables hold a row per (token, head).
        let rows = self.k_addr.len();
        let from = from.min(rows);
        let at = from..(from + CHUNK as usize).min(rows);
        (
            simd::Ahead::new(&self.k_addr[at.clone()], bytes),
            simd::Ahead::new(&self.v_addr[at], bytes),
        )
    }
}
