//! One step of a chunk for one head block: the block's scores over the chunk's tokens, their
//! online softmax into the job's state, and the values they weigh.

use super::{CHUNK, Partial, Run};
use crate::aligned::Aligned;
use crate::{AttnParams, Element, PagedKv, simd};

/// What every step of one unit's walk shares: the cache, the job's heads and the build's
/// choices, fixed for the walk.
pub(super) struct Walker<'a, T: Element> {
    pub(super) kv: &'a PagedKv<T>,
    pub(super) params: &'a AttnParams,
    /// Query heads of each KV head.
    pub(super) group: usize,
    /// The job's first KV head and its KV head count: heads `h0..h0 + nh`.
    pub(super) h0: usize,
    pub(super) nh: usize,
    pub(super) d: usize,
    /// Whether the AVX-512 or AVX2 build takes a chunk's dot products at once (its head dim a
    /// whole number of vectors).
    pub(super) chunk_dots: bool,
}

/// One step's rows and what they read: rows `b..b + span` of the job (one query position's
/// `group` heads of KV head block `hb`, or in a one-head job every row at once), the chunk's
/// key and value rows of that head, and the next chunk's rows the step asks the cache for.
pub(super) struct Block<'c> {
    pub(super) b: usize,
    pub(super) span: usize,
    pub(super) hb: usize,
    pub(super) keys: &'c [*const u8],
    pub(super) vals: &'c [*const u8],
    pub(super) ahead: (simd::Ahead<'c>, simd::Ahead<'c>),
}

/// A chunk as each of its steps sees it: its tokens (logical position, physical slot) in
/// order, and whether every row of the job sees every one of them.
pub(super) struct ChunkView<'t> {
    pub(super) toks: &'t [(i64, usize)],
    pub(super) all_visible: bool,
}

/// The buffers a walk reuses from chunk to chunk, owned; [`Scratch::bufs`] lends them.
pub(super) struct Scratch {
    /// A step's scores, then its weights: `CHUNK` a row.
    scores: Aligned<f32>,
    /// One token's scores of a block's rows (the per-token paths).
    wbuf: Vec<f32>,
    /// The portable build's chunk widened to f32, token-major, every head of the job.
    kbuf: Vec<f32>,
    vbuf: Vec<f32>,
    /// The bf16 build's query rows rounded to bf16 once.
    bf16_rows: Aligned<u16>,
}

impl Scratch {
    /// Buffers for a walk of `w`'s job over rows `q` (`rows x d`), whose steps take at most
    /// `step_rows` rows.
    pub(super) fn new<T: Element, const ISA: u8>(
        w: &Walker<'_, T>,
        q: &[f32],
        step_rows: usize,
    ) -> Self {
        const C: usize = CHUNK as usize;
        let widened = if ISA == simd::PORTABLE {
            C * w.nh * w.d
        } else {
            0
        };
        #[cfg(target_arch = "x86_64")]
        let bf16_rows = if ISA == simd::AVX512_BF16 {
            // SAFETY: this build runs only on CPUs with its features (`attend`).
            unsafe { simd::avx512bf16::round(q) }
        } else {
            Vec::new()
        };
        #[cfg(not(target_arch = "x86_64"))]
        let bf16_rows = {
            let _ = q;
            Vec::new()
        };
        Scratch {
            scores: Aligned::with(step_rows * C, |n| vec![0.0f32; n]),
            wbuf: vec![0.0f32; w.group],
            kbuf: vec![0.0f32; widened],
            vbuf: vec![0.0f32; widened],
            bf16_rows: Aligned::from_vec(bf16_rows),
        }
    }

    /// The buffers as plain slices, taken once for a walk: the steps then index them without
    /// finding each aligned window again.
    pub(super) fn bufs(&mut self) -> Bufs<'_> {
        Bufs {
            scores: &mut self.scores,
            wbuf: &mut self.wbuf,
            kbuf: &mut self.kbuf,
            vbuf: &mut self.vbuf,
            bf16_rows: &self.bf16_rows,
        }
    }
}

/// [`Scratch`]'s buffers, lent to a walk's steps.
pub(super) struct Bufs<'s> {
    scores: &'s mut [f32],
    wbuf: &'s mut [f32],
    kbuf: &'s mut [f32],
    vbuf: &'s mut [f32],
    bf16_rows: &'s [u16],
}

impl<T: Element> Walker<'_, T> {
    /// The portable build's chunk widened once into f32 scratch, token-major, each token's
    /// heads of the job in order.
    pub(super) fn widen(&self, chunk: &[Run], s: &mut Bufs<'_>) {
        let (h0, nh, d) = (self.h0, self.nh, self.d);
        let mut o = 0;
        for run in chunk {
            let n = run.len as usize;
            if nh == self.kv.layout_ref().kv_heads {
                let (k, v) = self.kv.run_all_heads(run.slot as usize, n);
                T::slice_to_f32(k, &mut s.kbuf[o * nh * d..(o + n) * nh * d]);
                T::slice_to_f32(v, &mut s.vbuf[o * nh * d..(o + n) * nh * d]);
            } else {
                for t in 0..n {
                    let slot = run.slot as usize + t;
                    for h in h0..h0 + nh {
                        let at = ((o + t) * nh + h - h0) * d;
                        T::slice_to_f32(self.kv.k_at(slot, h), &mut s.kbuf[at..at + d]);
                        T::slice_to_f32(self.kv.v_at(slot, h), &mut s.vbuf[at..at + d]);
                    }
                }
            }
            o += n;
        }
    }

    /// Block `blk`'s step over `chunk`: its rows' scores (`q`: the job's rows; `p`: the
    /// block's query position), the online softmax into `part`, and the weighted values.
    #[inline(always)]
    pub(super) fn step<const ISA: u8>(
        &self,
        (part, s): (&mut Partial, &mut Bufs<'_>),
        chunk: &ChunkView<'_>,
        blk: &Block<'_>,
        (q, p): (&[f32], i64),
    ) {
        const C: usize = CHUNK as usize;
        let (d, b, span) = (self.d, blk.b, blk.span);
        let len = chunk.toks.len();
        // The bf16 build takes a full chunk that every row sees in one pass, its scores in
        // registers.
        #[cfg(target_arch = "x86_64")]
        if ISA == simd::AVX512_BF16 && chunk.all_visible && len == C {
            let keys: &[*const u8; C] = blk
                .keys
                .try_into()
                .expect("invariant: a full chunk has a key row per token");
            let state = (
                &mut part.m[b..b + span],
                &mut part.l[b..b + span],
                &mut part.acc[b * d..(b + span) * d],
            );
            // SAFETY: this build runs on bf16 caches whose head dim is a multiple of 32
            // (`attend`), on a CPU with its features; the rows hold `span` rows of `d`, the
            // state `span` rows, and each of the 16 keys and values `d` elements.
            let done = unsafe {
                simd::avx512bf16::chunk_step(
                    (s.bf16_rows.as_ptr().add(b * d), d, span),
                    (keys, blk.vals),
                    state,
                    (&blk.ahead.0, &blk.ahead.1),
                )
            };
            if done {
                return;
            }
        }
        let qb = &q[b * d..(b + span) * d];
        let computed = self.scores_at_once::<ISA>(s, blk, qb);
        // Steps of more rows than a group (`multi` in `attend_body`) need the chunk kernels
        // and every token visible: the per-token and portable paths take blocks of `group`.
        debug_assert!(span == self.group || (computed && chunk.all_visible));
        if !self.token_scores::<ISA>(s, chunk, blk, (qb, p), computed) {
            return;
        }
        part.absorb::<ISA>(b, (&mut s.scores[..span * C], C, len), d);
        self.add_values::<ISA>(&mut part.acc[b * d..(b + span) * d], s, blk, len);
    }

    /// Every token's dot products with the block's rows at once, where the build has chunk
    /// kernels (masked ones are overwritten after): whether it made them.
    #[inline(always)]
    fn scores_at_once<const ISA: u8>(&self, s: &mut Bufs<'_>, blk: &Block<'_>, qb: &[f32]) -> bool {
        const C: usize = CHUNK as usize;
        #[cfg(target_arch = "x86_64")]
        if self.chunk_dots {
            let (rows, out) = ((qb.as_ptr(), self.d, blk.span), s.scores.as_mut_ptr());
            // SAFETY: this build runs on a CPU with its features (`attend`); `d` is a multiple
            // of its vector width (`chunk_dots`); `qb` holds `span` rows of `d`, each key `d`
            // elements, and `scores` `span` rows of `C` (16).
            unsafe {
                if ISA == simd::AVX512 {
                    simd::avx512::qk_chunk(rows, (blk.keys, T::DTYPE), out, C, &blk.ahead.0);
                } else {
                    simd::avx2::qk_chunk::<T>(rows, blk.keys, out, C, &blk.ahead.0);
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        if ISA == simd::AVX512_BF16 {
            // SAFETY: this build runs on bf16 caches whose head dim is a multiple of 32
            // (`attend`), on a CPU with its features; the rows hold `span` rows of `d` and
            // each key `d` elements; `scores` holds `span` rows of `C` (16).
            unsafe {
                simd::avx512bf16::qk_chunk(
                    s.bf16_rows.as_ptr().add(blk.b * self.d),
                    self.d,
                    blk.span,
                    blk.keys,
                    s.scores.as_mut_ptr(),
                    C,
                    &blk.ahead.0,
                );
            }
        }
        ISA == simd::AVX512_BF16 || self.chunk_dots
    }

    /// The scores no chunk kernel made, token by token, and -inf where a row does not see a
    /// token (`p`: the block's query position): whether the block sees any token.
    #[inline(always)]
    fn token_scores<const ISA: u8>(
        &self,
        s: &mut Bufs<'_>,
        chunk: &ChunkView<'_>,
        blk: &Block<'_>,
        (qb, p): (&[f32], i64),
        computed: bool,
    ) -> bool {
        const C: usize = CHUNK as usize;
        // Nothing to mask or compute token by token where the chunk kernels made every score
        // and every token is visible.
        if chunk.all_visible && computed {
            return true;
        }
        let (h0, nh, d, group) = (self.h0, self.nh, self.d, self.group);
        let h = h0 + blk.hb;
        let bytes = d * size_of::<T>();
        let mut any = false;
        for (t, &(tp, slot)) in chunk.toks.iter().enumerate() {
            let visible = chunk.all_visible || self.params.visible(tp, p);
            any |= visible;
            if !visible {
                (0..blk.span).for_each(|g| s.scores[g * C + t] = f32::NEG_INFINITY);
            } else if computed {
                // Computed above.
            } else if ISA == simd::PORTABLE {
                let o = (t * nh + blk.hb) * d;
                for g in 0..group {
                    s.scores[g * C + t] = simd::dot(&qb[g * d..(g + 1) * d], &s.kbuf[o..o + d]);
                }
            } else {
                blk.ahead.0.part(t, 1, bytes);
                simd::dot_rows::<T, ISA>(qb, d, self.kv.k_at(slot, h), s.wbuf);
                (0..group).for_each(|g| s.scores[g * C + t] = s.wbuf[g]);
            }
        }
        any
    }

    /// The chunk's values weighed by the block's weights (`s.scores`), added to its rows'
    /// sums `accs` (`span` rows of `d`).
    #[inline(always)]
    fn add_values<const ISA: u8>(
        &self,
        accs: &mut [f32],
        s: &mut Bufs<'_>,
        blk: &Block<'_>,
        len: usize,
    ) {
        const C: usize = CHUNK as usize;
        let (d, span) = (self.d, blk.span);
        if ISA == simd::PORTABLE {
            let nh = self.nh;
            for t in 0..len {
                (0..self.group).for_each(|g| s.wbuf[g] = s.scores[g * C + t]);
                if s.wbuf.iter().all(|&w| w == 0.0) {
                    continue;
                }
                let o = (t * nh + blk.hb) * d;
                for (g, acc) in accs.chunks_exact_mut(d).enumerate() {
                    simd::axpy(acc, s.wbuf[g], &s.vbuf[o..o + d]);
                }
            }
            return;
        }
        // The chunk's tokens that weigh anything, summed in registers.
        let live = simd::live_tokens::<ISA>(s.scores, C, span, len);
        #[cfg(target_arch = "x86_64")]
        if ISA == simd::AVX512_BF16 {
            // SAFETY: as for `qk_chunk` in `scores_at_once`; `accs` holds `span` rows of `d`,
            // the scores `span` rows of `C` (16), and every token of the chunk has a value of
            // `d` elements.
            unsafe {
                simd::avx512bf16::pv_chunk(
                    accs.as_mut_ptr(),
                    d,
                    span,
                    (s.scores.as_ptr(), C),
                    blk.vals,
                    (live, &blk.ahead.1),
                );
            }
            return;
        }
        // SAFETY: `blk.vals[t]` points at token `t`'s value row of the block's head: `d`
        // initialized elements of `T` within the cache, which outlives the call
        // (`ChunkRows::fill` took it from the cache's rows of its run).
        unsafe {
            simd::axpy_rows::<T, ISA>(accs, d, (s.scores, C), (live, blk.vals), span, &blk.ahead.1);
        }
    }
}
