//! The compute core shared by every entry point: online-softmax attention of a tile of query
//! rows over a list of KV runs, split into fixed chunks and merged with the log-sum-exp rule.
//!
//! Determinism: the arithmetic follows the list's tokens in order, never the physical layout.
//! A run list is cut into chunks of [`CHUNK`] consecutive tokens of the list (a chunk gathers
//! the tokens of every run inside it), each chunk is one online-softmax step, and a list splits
//! every [`SPLIT_CHUNKS`] chunks into partial results merged pairwise in a binary tree over the
//! split order, whose shape reads the split count alone. So the same tokens in the same order
//! give bit-identical results whatever the thread count, the block size, or how many runs the
//! blocks break them into: dense attention, sparse attention with every page selected at any
//! page size, and token-level attention over every token agree bit for bit, and so do a
//! selection attended in place and the same selection gathered into a compact buffer.

use std::sync::{Mutex, OnceLock};

use crate::aligned::Aligned;
use crate::meta::Seq;
use crate::phase::{Tree, guided, lock, share};
use crate::simd;
use crate::{AttnParams, DType, Element, PagedKv};

/// Consecutive tokens that are consecutive in one block: logical positions `pos..pos + len` at
/// physical slots `slot..slot + len`, inside chunk `chunk` of their list (set by
/// [`at_chunks`]; 0 until then).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Run {
    pub(crate) pos: u32,
    pub(crate) slot: u32,
    pub(crate) len: u32,
    pub(crate) chunk: u32,
}

/// What one unit of work walks, and what its last chunk asks the cache for, as any chunk
/// asks for the next.
#[derive(Clone, Copy, Debug)]
struct Walk<'a> {
    /// The unit's runs, cut and numbered by [`at_chunks`].
    runs: &'a [Run],
    /// The first chunk's runs of the unit the same thread walks next (none where there is
    /// none).
    after: &'a [Run],
    /// That unit's KV heads `h0..h1`.
    after_heads: (usize, usize),
}

/// Tokens per online-softmax step: chunk `c` of a list holds its tokens `c * CHUNK .. (c + 1) *
/// CHUNK`, counted in list order.
const CHUNK: u32 = 16;
/// Chunks per split of a job's run list (256 tokens): a list splits every this many chunks,
/// whatever its length, so the same tokens in the same order split alike everywhere. Units
/// this small let threads that read memory at unequal rates end together on long lists (a
/// 16-core Xeon's B1 L32K decode took 11 % less time than with units of 64 chunks), for
/// about 3 % more instructions in merges and unit set-up (BENCHMARKS.md, session 59).
const SPLIT_CHUNKS: usize = 16;
/// Queries per job in prefill.
pub(crate) const Q_TILE: usize = 16;

/// One unit of work: the queries `q_lo..q_hi` of sequence `seq`, the query heads of KV heads
/// `h0..h1`, over run list `list`. Rows are ordered (query, KV head, head in group).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Job {
    pub(crate) seq: usize,
    pub(crate) h0: usize,
    pub(crate) h1: usize,
    pub(crate) q_lo: usize,
    pub(crate) q_hi: usize,
    pub(crate) list: usize,
}

impl Job {
    fn rows(&self, group: usize) -> usize {
        (self.q_hi - self.q_lo) * (self.h1 - self.h0) * group
    }
}

/// Decode-sized jobs cover every KV head of a sequence, so that a page is read as one
/// contiguous block; larger query tiles keep one KV head per job to bound their state.
const MAX_ROWS_ALL_HEADS: usize = 64;

/// Unnormalized attention state of some rows: running max `m`, denominator `l`, and the
/// weighted sum of values `acc` (`rows x head_dim`, on a cache line like the KV rows).
#[derive(Clone, Debug)]
pub(crate) struct Partial {
    pub(crate) acc: Aligned<f32>,
    pub(crate) m: Vec<f32>,
    pub(crate) l: Vec<f32>,
}

impl Partial {
    pub(crate) fn empty(rows: usize, d: usize) -> Self {
        Partial {
            acc: Aligned::with(rows * d, |n| vec![0.0; n]),
            m: vec![f32::NEG_INFINITY; rows],
            l: vec![0.0; rows],
        }
    }

    /// One online-softmax step of rows `b..b + rows` over a chunk's scores (`len` a row,
    /// `stride` apart, masked ones -inf): each row's running max and the rescale of its sums
    /// where the max grew, then the rows' exponentials, side by side where the build can
    /// (`simd::exp_rows`), which replace the scores as the chunk's weights.
    #[inline(always)]
    fn absorb<const ISA: u8>(
        &mut self,
        b: usize,
        (scores, stride, len): (&mut [f32], usize, usize),
        d: usize,
    ) {
        let rows = scores.len() / stride;
        for g in 0..rows {
            let r = b + g;
            let mx = simd::row_max::<ISA>(&scores[g * stride..g * stride + len]);
            let m_new = self.m[r].max(mx);
            if self.m[r] != m_new {
                let alpha = (self.m[r] - m_new).exp();
                self.acc[r * d..(r + 1) * d]
                    .iter_mut()
                    .for_each(|a| *a *= alpha);
                self.l[r] *= alpha;
            }
            self.m[r] = m_new;
        }
        simd::exp_rows::<ISA>(
            scores,
            (stride, len),
            &self.m[b..b + rows],
            &mut self.l[b..b + rows],
        );
    }

    /// Folds `other` into `self` with the log-sum-exp rule, in the widest vectors this CPU has
    /// (`isa`, resolved); every build multiplies and adds alike, so the bits do not depend on it.
    pub(crate) fn merge(&mut self, other: &Partial, d: usize, isa: u8) {
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx512f,avx2")]
            fn wide(a: &mut Partial, b: &Partial, d: usize) {
                a.merge_body(b, d);
            }
            #[target_feature(enable = "avx2")]
            fn narrow(a: &mut Partial, b: &Partial, d: usize) {
                a.merge_body(b, d);
            }
            if isa >= simd::AVX512 {
                // SAFETY: `isa` was resolved by `simd::resolve`, which never exceeds what this
                // CPU runs, and AVX512 and above imply AVX-512F and AVX2.
                return unsafe { wide(self, other, d) };
            }
            if isa == simd::AVX2 {
                // SAFETY: as above; AVX2 was detected.
                return unsafe { narrow(self, other, d) };
            }
        }
        let _ = isa;
        self.merge_body(other, d);
    }

    #[inline(always)]
    fn merge_body(&mut self, other: &Partial, d: usize) {
        for r in 0..self.m.len() {
            let m = self.m[r].max(other.m[r]);
            if m == f32::NEG_INFINITY {
                continue;
            }
            // One of the two weights is exp(0) = 1 exactly; only the other needs its exp.
            let (a, b) = if self.m[r] == m {
                (1.0, (other.m[r] - m).exp())
            } else {
                ((self.m[r] - m).exp(), 1.0)
            };
            for (x, y) in self.acc[r * d..(r + 1) * d]
                .iter_mut()
                .zip(&other.acc[r * d..(r + 1) * d])
            {
                *x = a * *x + b * y;
            }
            self.l[r] = a * self.l[r] + b * other.l[r];
            self.m[r] = m;
        }
    }

    /// Turns a job's merged state into its output: each row of `acc` divided by its
    /// denominator (with the row's attention sink, if any, joining the softmax), and `m` the
    /// row's log-sum-exp (-inf, with a zero row, where nothing was visible).
    fn normalize(&mut self, job: &Job, group: usize, sinks: Option<&[f32]>, d: usize) {
        let per_q = (job.h1 - job.h0) * group;
        for r in 0..self.m.len() {
            let (mut m, mut l) = (self.m[r], self.l[r]);
            let mut scale_acc = 1.0;
            if let Some(sinks) = sinks {
                let sink = sinks[job.h0 * group + r % per_q];
                let m2 = m.max(sink);
                scale_acc = if m == f32::NEG_INFINITY {
                    0.0
                } else {
                    (m - m2).exp()
                };
                l = l * scale_acc + (sink - m2).exp();
                m = m2;
            }
            let row = &mut self.acc[r * d..(r + 1) * d];
            if l > 0.0 {
                let inv = scale_acc / l;
                for o in row.iter_mut() {
                    *o *= inv;
                }
                self.m[r] = m + l.ln();
            } else {
                row.fill(0.0);
                self.m[r] = f32::NEG_INFINITY;
            }
        }
    }
}

/// The build whose body [`attend`] runs for `isa` (resolved) on a cache of `T` with head dim
/// `d`: the bf16 dot products only on bf16 caches whose head dim is a multiple of 32 (the rows
/// that build reads), AVX-512 for the other caches of a CPU that has them.
fn body_isa<T: Element>(isa: u8, d: usize) -> u8 {
    match isa {
        simd::AVX512_BF16 if T::DTYPE == DType::BF16 && d.is_multiple_of(32) => isa,
        simd::AVX512_BF16 => simd::AVX512,
        _ => isa,
    }
}

/// The f32 lanes of the body [`attend`] runs for `isa` on a cache of `T` with head dim `d`,
/// where that body's Q·K widens bf16 keys two vectors at a time, even elements first, and so
/// takes its query rows in [`simd::pair_order`]: AVX2 (8) and AVX-512 (16) on bf16 caches.
/// The bf16 dot-product body reads its keys in element order.
fn pair_lanes<T: Element>(isa: u8, d: usize) -> Option<usize> {
    match body_isa::<T>(isa, d) {
        _ if T::DTYPE != DType::BF16 => None,
        simd::AVX512 => Some(16),
        simd::AVX2 => Some(8),
        _ => None,
    }
}

/// Attention of query rows over `runs`, with the widest instruction set this CPU has. The SIMD
/// builds round differently from the portable one (fused multiply-adds, a polynomial exp), so
/// results are deterministic per machine and agree across machines within f32 rounding.
#[allow(clippy::too_many_arguments)]
fn attend<T: Element>(
    isa: u8,
    kv: &PagedKv<T>,
    heads: (usize, usize),
    group: usize,
    q: &[f32],
    pos: &[i64],
    params: &AttnParams,
    walk: Walk<'_>,
) -> Partial {
    #[cfg(target_arch = "x86_64")]
    match body_isa::<T>(isa, kv.layout_ref().head_dim) {
        simd::AVX512_BF16 => {
            // SAFETY: `resolve` caps `isa` by the features the CPU has, which are the ones
            // each function is compiled for; this build reads the cache as bf16 in rows of
            // 32, which `body_isa` checks.
            return unsafe { attend_avx512bf16(kv, heads, group, q, pos, params, walk) };
        }
        simd::AVX512 => {
            // SAFETY: as above (a CPU with the bf16 build has AVX-512F).
            return unsafe { attend_avx512(kv, heads, group, q, pos, params, walk) };
        }
        // SAFETY: as above.
        simd::AVX2 => return unsafe { attend_avx2(kv, heads, group, q, pos, params, walk) },
        _ => {}
    }
    attend_body::<T, { simd::PORTABLE }>(kv, heads, group, q, pos, params, walk)
}

/// Defines `$name`: [`attend_body`] compiled for `$features` with build `$isa`.
macro_rules! attend_with {
    ($name:ident, $features:literal, $isa:expr) => {
        /// # Safety
        #[doc = concat!("The CPU must support ", $features, ".")]
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        unsafe fn $name<T: Element>(
            kv: &PagedKv<T>,
            heads: (usize, usize),
            group: usize,
            q: &[f32],
            pos: &[i64],
            params: &AttnParams,
            walk: Walk<'_>,
        ) -> Partial {
            attend_body::<T, { $isa }>(kv, heads, group, q, pos, params, walk)
        }
    };
}

attend_with!(attend_avx2, "avx2,fma,f16c", simd::AVX2);
attend_with!(attend_avx512, "avx512f,avx2,fma,f16c", simd::AVX512);
attend_with!(
    attend_avx512bf16,
    "avx512f,avx512bw,avx512bf16,avx2,fma,f16c",
    simd::AVX512_BF16
);

/// Attention of query rows (`q`: `rows x d`, already scaled; `pos`: each row's absolute
/// position; rows ordered (query, KV head, head in group)) over `runs` of KV heads `h0..h1`
/// (ascending, cut and numbered by [`at_chunks`]). Each chunk is widened once for all the job's
/// heads; each row then sees the same operations in the same order whatever the job's head
/// range, so results do not depend on it.
#[inline(always)]
fn attend_body<T: Element, const ISA: u8>(
    kv: &PagedKv<T>,
    (h0, h1): (usize, usize),
    group: usize,
    q: &[f32],
    pos: &[i64],
    params: &AttnParams,
    Walk {
        runs,
        after,
        after_heads: (a0, a1),
    }: Walk<'_>,
) -> Partial {
    const C: usize = CHUNK as usize;
    let layout = kv.layout_ref();
    let d = layout.head_dim;
    let nh = h1 - h0;
    let rows = pos.len();
    let mut part = Partial::empty(rows, d);
    let scratch = if ISA == simd::PORTABLE { C * nh * d } else { 0 };
    let mut kbuf = vec![0.0f32; scratch];
    let mut vbuf = vec![0.0f32; scratch];
    // Scores of the rows one step takes: a block of `group`, or, in a one-head job, every row
    // of the job where `multi` below takes them together.
    let step_rows = if nh == 1 { rows.max(group) } else { group };
    let mut scores = Aligned::with(step_rows * C, |n| vec![0.0f32; n]);
    let mut wbuf = vec![0.0f32; group];
    // The bf16 build: the rows rounded to bf16 once, and each chunk's keys and values as bf16
    // bits (`attend` enters it for bf16 caches only).
    #[cfg(target_arch = "x86_64")]
    let bf16_rows = Aligned::from_vec(if ISA == simd::AVX512_BF16 {
        // SAFETY: this build runs only on CPUs with its features (`attend`).
        unsafe { simd::avx512bf16::round(q) }
    } else {
        Vec::new()
    });
    // The AVX-512 and AVX2 builds take a chunk's dot products at once where the head dim
    // allows (a whole number of vectors).
    let chunk_dots = cfg!(target_arch = "x86_64")
        && ((ISA == simd::AVX512 && d.is_multiple_of(16))
            || (ISA == simd::AVX2 && d.is_multiple_of(8)));
    // The chunk's tokens: logical position and physical slot, in order.
    let mut toks: Vec<(i64, usize)> = Vec::with_capacity(C);
    let pmax = pos.iter().copied().max().unwrap_or(-1);
    let pmin = pos.iter().copied().min().unwrap_or(-1);
    let contiguous = nh == layout.kv_heads;
    let chunks: Vec<&[Run]> = runs.chunk_by(|a, b| a.chunk == b.chunk).collect();
    // The SIMD builds' pointers to this chunk's K and V rows and to the next chunk's, which
    // the head blocks ask the cache for while they compute (`simd::Ahead`): a chunk's tokens
    // are strided by every head's row, which the hardware's prefetchers do not follow across
    // pages. The next chunk's become this chunk's at the next step.
    let (mut this, mut next) = (ChunkRows::default(), ChunkRows::default());
    let mut next_of = None;
    let bytes = d * size_of::<T>();
    for (ci, &chunk) in chunks.iter().enumerate() {
        let start = i64::from(chunk[0].pos);
        if start > pmax {
            continue;
        }
        if ISA != simd::PORTABLE {
            if next_of == Some(ci) {
                std::mem::swap(&mut this, &mut next);
            } else {
                this.fill(kv, chunk, (h0, nh), d);
            }
            // The last chunk asks for the first chunk of the unit this thread walks next.
            match chunks.get(ci + 1).copied() {
                Some(runs) => next.fill(kv, runs, (h0, nh), d),
                None if !after.is_empty() => next.fill(kv, after, (a0, a1 - a0), d),
                None => next.clear(),
            }
            next_of = Some(ci + 1);
        }
        toks.clear();
        for run in chunk {
            toks.extend(
                (0..run.len as usize)
                    .map(|t| (i64::from(run.pos) + t as i64, run.slot as usize + t)),
            );
        }
        let len = toks.len();
        // Every token of the chunk is visible to every row: no per-token mask.
        let end = toks[len - 1].0;
        let all_visible = end <= pmin && params.window.is_none_or(|w| start > pmax - i64::from(w));
        // The portable build widens the chunk once into f32 scratch; the SIMD builds widen in
        // registers as they go (a head's K and V stay in L1 across its group's rows).
        if ISA == simd::PORTABLE {
            let mut o = 0;
            for run in chunk {
                let n = run.len as usize;
                if contiguous {
                    let (k, v) = kv.run_all_heads(run.slot as usize, n);
                    T::slice_to_f32(k, &mut kbuf[o * nh * d..(o + n) * nh * d]);
                    T::slice_to_f32(v, &mut vbuf[o * nh * d..(o + n) * nh * d]);
                } else {
                    for t in 0..n {
                        let slot = run.slot as usize + t;
                        for h in h0..h1 {
                            let at = ((o + t) * nh + h - h0) * d;
                            T::slice_to_f32(kv.k_at(slot, h), &mut kbuf[at..at + d]);
                            T::slice_to_f32(kv.v_at(slot, h), &mut vbuf[at..at + d]);
                        }
                    }
                }
                o += n;
            }
        }
        // Rows come in blocks of `group`: one query position and KV head, so one mask and one
        // K/V stream, widened once for the whole block. Where the job has one KV head and
        // every row sees every token of the chunk (a prefill's chunks below its query tile),
        // and the group does not fill the chunk kernels' blocks of 4 rows by itself (groups
        // of 1, 2, 3, 5, 6, 7), the chunk kernels take all the job's rows in one step
        // instead, so that each key and value is read once for a whole block of rows; each
        // row's arithmetic is the same either way. The bf16 build keeps its fused step for
        // the groups it fuses (1, 2, 4, 8 rows) and takes the others so too.
        let odd_group = !group.is_multiple_of(4);
        let multi = nh == 1
            && all_visible
            && odd_group
            && (chunk_dots || (ISA == simd::AVX512_BF16 && group > 2));
        // `hb` is the block's KV head, `(b / group) % nh` since rows are ordered (query, KV
        // head, head in group): counted rather than divided for.
        let (mut next_block, mut next_hb) = (0, 0);
        while next_block < rows {
            let (b, hb) = (next_block, next_hb);
            let span = if multi { rows - b } else { group };
            next_block += span;
            next_hb = if hb + 1 == nh { 0 } else { hb + 1 };
            let p = pos[b];
            let h = h0 + hb;
            let qb = &q[b * d..(b + span) * d];
            let mut any = false;
            // This head's rows of the chunk.
            let (keys, vals_at) = this.head(hb, len);
            // The first query's head blocks ask for the next chunk's rows, each a share of
            // them in address order.
            let (ahead_k, ahead_v) = if ISA != simd::PORTABLE && b < nh * group {
                next.share(hb, bytes)
            } else {
                (simd::Ahead::NONE, simd::Ahead::NONE)
            };
            // The bf16 build takes a full chunk that every row sees in one pass, its scores in
            // registers.
            #[cfg(target_arch = "x86_64")]
            if ISA == simd::AVX512_BF16 && all_visible && len == C {
                let keys: &[*const u8; C] = keys
                    .try_into()
                    .expect("invariant: a full chunk has a key row per token");
                let state = (
                    &mut part.m[b..b + span],
                    &mut part.l[b..b + span],
                    &mut part.acc[b * d..(b + span) * d],
                );
                // SAFETY: this build runs on bf16 caches whose head dim is a multiple of 32
                // (`attend`), on a CPU with its features; the rows hold `span` rows of `d`,
                // the state `span` rows, and each of the 16 keys and values `d` elements.
                let done = unsafe {
                    simd::avx512bf16::chunk_step(
                        (bf16_rows.as_ptr().add(b * d), d, span),
                        (keys, vals_at),
                        state,
                        (&ahead_k, &ahead_v),
                    )
                };
                if done {
                    continue;
                }
            }
            #[cfg(target_arch = "x86_64")]
            if chunk_dots {
                // Every token's dot products at once, as `dot_rows` makes them; masked ones
                // are overwritten below.
                let (rows, out) = ((qb.as_ptr(), d, span), scores.as_mut_ptr());
                // SAFETY: this build runs on a CPU with its features (`attend`); `d` is a
                // multiple of its vector width (`chunk_dots`); `qb` holds `span` rows of `d`,
                // each key `d` elements, and `scores` `span` rows of `C` (16).
                unsafe {
                    if ISA == simd::AVX512 {
                        simd::avx512::qk_chunk(rows, (keys, T::DTYPE), out, C, &ahead_k);
                    } else {
                        simd::avx2::qk_chunk::<T>(rows, keys, out, C, &ahead_k);
                    }
                }
            }
            #[cfg(target_arch = "x86_64")]
            if ISA == simd::AVX512_BF16 {
                // Every token's dot products at once; masked ones are overwritten below.
                // SAFETY: this build runs on bf16 caches whose head dim is a multiple of 32
                // (`attend`), on a CPU with its features; the rows hold `span` rows of `d`
                // and each key `d` elements; `scores` holds `span` rows of `C` (16).
                unsafe {
                    simd::avx512bf16::qk_chunk(
                        bf16_rows.as_ptr().add(b * d),
                        d,
                        span,
                        keys,
                        scores.as_mut_ptr(),
                        C,
                        &ahead_k,
                    );
                }
            }
            let computed = ISA == simd::AVX512_BF16 || chunk_dots;
            // The per-token and portable paths below take blocks of `group` rows: `multi`
            // (a span of more rows) needs the chunk kernels and every token visible.
            debug_assert!(span == group || (computed && all_visible));
            // Nothing to mask or compute token by token where the chunk kernels made every
            // score and every token is visible.
            let per_token = if all_visible && computed {
                &[][..]
            } else {
                &toks[..]
            };
            any |= per_token.is_empty();
            for (t, &(tp, slot)) in per_token.iter().enumerate() {
                let visible = all_visible || params.visible(tp, p);
                any |= visible;
                if !visible {
                    (0..span).for_each(|g| scores[g * C + t] = f32::NEG_INFINITY);
                } else if computed {
                    // Computed above.
                } else if ISA == simd::PORTABLE {
                    let o = (t * nh + h - h0) * d;
                    for g in 0..group {
                        scores[g * C + t] = simd::dot(&qb[g * d..(g + 1) * d], &kbuf[o..o + d]);
                    }
                } else {
                    ahead_k.part(t, 1, bytes);
                    simd::dot_rows::<T, ISA>(qb, d, kv.k_at(slot, h), &mut wbuf);
                    (0..group).for_each(|g| scores[g * C + t] = wbuf[g]);
                }
            }
            if !any {
                continue;
            }
            part.absorb::<ISA>(b, (&mut scores[..span * C], C, len), d);
            let accs = &mut part.acc[b * d..(b + span) * d];
            if ISA == simd::PORTABLE {
                for t in 0..len {
                    (0..group).for_each(|g| wbuf[g] = scores[g * C + t]);
                    if wbuf.iter().all(|&w| w == 0.0) {
                        continue;
                    }
                    let o = (t * nh + h - h0) * d;
                    for (g, acc) in accs.chunks_exact_mut(d).enumerate() {
                        simd::axpy(acc, wbuf[g], &vbuf[o..o + d]);
                    }
                }
            } else {
                // The chunk's tokens that weigh anything, summed in registers.
                let live = simd::live_tokens::<ISA>(&scores, C, span, len);
                #[cfg(target_arch = "x86_64")]
                if ISA == simd::AVX512_BF16 {
                    // SAFETY: as for `qk_chunk` above; `accs` holds `span` rows of `d`, the
                    // scores `span` rows of `C` (16), and every token of the chunk has a
                    // value of `d` elements.
                    unsafe {
                        simd::avx512bf16::pv_chunk(
                            accs.as_mut_ptr(),
                            d,
                            span,
                            (scores.as_ptr(), C),
                            vals_at,
                            (live, &ahead_v),
                        );
                    }
                    continue;
                }
                // SAFETY: `vals_at[t]` points at token `t`'s value row of head `h`: `d`
                // initialized elements of `T` within the cache, which outlives the call
                // (`ChunkRows::fill` took it from the cache's rows of its run).
                unsafe {
                    simd::axpy_rows::<T, ISA>(
                        accs,
                        d,
                        (&mut scores, C),
                        (live, vals_at),
                        span,
                        &ahead_v,
                    );
                }
            }
        }
    }
    part
}

/// Runs every job (in parallel over jobs and splits) and writes the normalized output
/// (`[total_q, q_heads, d]`) and log-sum-exp (`[total_q, q_heads]`) of each job's rows.
#[allow(clippy::too_many_arguments)]
pub(crate) fn execute<T: Element>(
    kv: &PagedKv<T>,
    q: &[T],
    params: &AttnParams,
    group: usize,
    seqs: &[Seq<'_>],
    jobs: &[Job],
    lists: &[Vec<Run>],
    out: &mut [f32],
    lse: Option<&mut [f32]>,
) {
    let d = kv.layout_ref().head_dim;
    let hq = params.q_heads;
    let isa = simd::resolve(params.simd);
    let (lists, splits): (Vec<Vec<Run>>, Vec<Vec<usize>>) =
        lists.iter().map(|l| at_chunks(l)).unzip();
    let units: Vec<(usize, usize, usize)> = jobs
        .iter()
        .enumerate()
        .flat_map(|(j, job)| {
            let cuts = &splits[job.list];
            cuts.windows(2).map(move |w| (j, w[0], w[1]))
        })
        .collect();
    // Consecutive units in tasks, each walked in order by one thread, so that a unit's last
    // chunk can ask for the next unit's first (a unit started cold waits on its first chunk's
    // misses). Threads that walk the same bytes from memory take unequal times, by up to 2x
    // on 16 cores of a Xeon, so tasks shrink toward the end of the phase (`guided`): the
    // threads that end early take the last small ones instead of waiting on one long one.
    // Which thread walks a unit changes no result.
    let threads = rayon::current_num_threads();
    let sizes: Vec<usize> = units
        .iter()
        .map(|&(j, lo, hi)| chunk_count(&lists[jobs[j].list][lo..hi]))
        .collect();
    let starts = guided(&sizes, threads);
    // Units are in job order, so job `j`'s units are `first[j]..first[j + 1]`.
    let first: Vec<usize> = std::iter::once(0)
        .chain(jobs.iter().scan(0, |n, job| {
            *n += splits[job.list].len() - 1;
            Some(*n)
        }))
        .collect();
    // One parallel phase does everything. The first unit of a job to start widens and scales
    // its query rows (shared by its other units). Each job merges its partials in a fixed
    // tree over the unit order (the tree fixes the bits) as they arrive, and whoever merges
    // at the root normalizes the job's rows. So the merges spread over the phase instead of
    // trailing it.
    let job_qs: Vec<OnceLock<(Vec<f32>, Vec<i64>)>> =
        jobs.iter().map(|_| OnceLock::new()).collect();
    let trees: Vec<Tree> = first.windows(2).map(|w| Tree::new(w[1] - w[0])).collect();
    // Whoever finishes a job writes its rows, on the core that holds them: the caller copying
    // every job's result after the phase read them from other cores' caches one by one (25-30
    // µs of B8 L4K's 1.4 ms on a 16-core Xeon).
    let sinks = row_sinks(jobs, seqs, (group, hq, d), out, lse);
    let tasks: Vec<&[(usize, usize, usize)]> =
        starts.windows(2).map(|w| &units[w[0]..w[1]]).collect();
    share(tasks.len(), |t| {
        let task = tasks[t];
        for (i, &(j, lo, hi)) in task.iter().enumerate() {
            let job = jobs[j];
            let (after, after_heads) = task.get(i + 1).map_or((&[][..], (0, 0)), |&(k, lo, hi)| {
                let next = jobs[k];
                (first_chunk(&lists[next.list][lo..hi]), (next.h0, next.h1))
            });
            let walk = Walk {
                runs: &lists[job.list][lo..hi],
                after,
                after_heads,
            };
            let (rows_q, pos) = job_qs[j].get_or_init(|| {
                let shape = (group, hq, d, pair_lanes::<T>(isa, d));
                job_rows(q, &seqs[job.seq], &job, shape, params.scale)
            });
            let part = attend(isa, kv, (job.h0, job.h1), group, rows_q, pos, params, walk);
            trees[j].arrive(starts[t] + i - first[j], part, d, isa, |mut whole| {
                whole.normalize(&job, group, params.sink_logits.as_deref(), d);
                for (p, (out, lse)) in lock(&sinks[j]).iter_mut().enumerate() {
                    let rows = p * group..(p + 1) * group;
                    out.copy_from_slice(&whole.acc[rows.start * d..rows.end * d]);
                    if let Some(lse) = lse {
                        lse.copy_from_slice(&whole.m[rows]);
                    }
                }
            });
        }
    });
    debug_assert!(
        trees.iter().all(Tree::finished),
        "every job's units have all been merged"
    );
}

/// A job's rows of the output and of the log-sum-exp: for each (query, KV head) it covers, in
/// the order of its rows, that pair's `group` rows.
type Sink<'a> = Vec<(&'a mut [f32], Option<&'a mut [f32]>)>;

/// Cuts `out` (`[total_q, q_heads, d]`) and `lse` (`[total_q, q_heads]`) into each job's
/// [`Sink`]. A (query, KV head) pair's `group` rows lie together in both, and the jobs
/// partition the pairs (`jobs_for`: every sequence's query tiles, each with all KV heads or
/// one job a head).
fn row_sinks<'a>(
    jobs: &[Job],
    seqs: &[Seq<'_>],
    (group, hq, d): (usize, usize, usize),
    out: &'a mut [f32],
    lse: Option<&'a mut [f32]>,
) -> Vec<Mutex<Sink<'a>>> {
    let kv_heads = hq / group;
    let mut outs: Vec<Option<&mut [f32]>> = out.chunks_mut(group * d).map(Some).collect();
    let mut lses: Vec<Option<&mut [f32]>> =
        lse.map_or_else(Vec::new, |lse| lse.chunks_mut(group).map(Some).collect());
    jobs.iter()
        .map(|job| {
            let first = seqs[job.seq].q_start + job.q_lo;
            let sink = (first..first + job.q_hi - job.q_lo)
                .flat_map(|token| (job.h0..job.h1).map(move |h| token * kv_heads + h))
                .map(|at| {
                    let out = outs[at]
                        .take()
                        .expect("invariant: jobs partition the (query, KV head) pairs");
                    (out, lses.get_mut(at).and_then(Option::take))
                })
                .collect();
            Mutex::new(sink)
        })
        .collect()
}

/// The scaled f32 query rows of a job and their positions, each row in [`simd::pair_order`] of
/// `pair` lanes where the build's Q·K takes it so ([`pair_lanes`]).
fn job_rows<T: Element>(
    q: &[T],
    seq: &Seq<'_>,
    job: &Job,
    (group, hq, d, pair): (usize, usize, usize, Option<usize>),
    scale: f32,
) -> (Vec<f32>, Vec<i64>) {
    let rows = job.rows(group);
    let per_q = (job.h1 - job.h0) * group;
    let mut qs = vec![0.0f32; rows * d];
    let mut pos = Vec::with_capacity(rows);
    for r in 0..rows {
        let qi = job.q_lo + r / per_q;
        let qh = job.h0 * group + r % per_q;
        let token = seq.q_start + qi;
        let src = &q[(token * hq + qh) * d..(token * hq + qh + 1) * d];
        let dst = &mut qs[r * d..(r + 1) * d];
        T::slice_to_f32(src, dst);
        dst.iter_mut().for_each(|x| *x *= scale);
        if let Some(lanes) = pair {
            simd::pair_order(dst, lanes);
        }
        pos.push(seq.position(qi));
    }
    (qs, pos)
}

/// Pointers to a chunk's K and V rows for each KV head of a job, as the SIMD builds read them:
/// head-major (head block `hb`'s rows at `hb * CHUNK ..`, one a token; entries past the
/// chunk's tokens are stale and never read) for the math, and in address order (token by
/// token, each token's heads in order) for the prefetches of the chunk before. Where those
/// rows lie back to back (a chunk inside one run of a job with every KV head: a decode's
/// chunk of one page), the address order is the first row and a count, and no table is
/// written. Filled once a chunk, by additions only.
#[derive(Default)]
struct ChunkRows {
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
    fn fill<T: Element>(
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
    fn clear(&mut self) {
        self.k.clear();
        self.v.clear();
        self.k_addr.clear();
        self.v_addr.clear();
        self.span = None;
    }

    /// Head block `hb`'s rows of the chunk's first `len` tokens: keys, values.
    fn head(&self, hb: usize, len: usize) -> (&[*const u8], &[*const u8]) {
        let at = hb * CHUNK as usize..hb * CHUNK as usize + len;
        (
            self.k.get(at.clone()).unwrap_or(&[]),
            self.v.get(at).unwrap_or(&[]),
        )
    }

    /// What head block `hb` of the chunk before asks the cache for while it computes, for K
    /// and for V (rows of `bytes`): its share of these rows in address order (block `hb`
    /// takes rows `16 hb .. 16 (hb + 1)` of the chunk's tokens times heads).
    fn share(&self, hb: usize, bytes: usize) -> (simd::Ahead<'_>, simd::Ahead<'_>) {
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

/// `runs` cut into chunks of [`CHUNK`] consecutive tokens of the list, each run numbered with
/// its chunk (a run that straddles two chunks is cut in two), and where the cut list splits
/// into units of [`SPLIT_CHUNKS`] chunks: ascending run indices from 0 to its length, at least
/// one unit even for an empty list. One pass into vectors sized once: a B8 L4K decode cuts
/// 2048 runs a call, on the caller's thread while the others wait.
fn at_chunks(runs: &[Run]) -> (Vec<Run>, Vec<usize>) {
    let tokens: usize = runs.iter().map(|r| r.len as usize).sum();
    let chunk = CHUNK as usize;
    // A run is cut once more at each chunk boundary inside it.
    let mut out = Vec::with_capacity(runs.len() + tokens / chunk + 1);
    let mut cuts = Vec::with_capacity(tokens / (chunk * SPLIT_CHUNKS) + 2);
    cuts.push(0);
    let mut seen = 0u32;
    for &r in runs {
        let (mut pos, mut slot, end) = (r.pos, r.slot, r.pos + r.len);
        while pos < end {
            let (c, off) = (seen / CHUNK, seen % CHUNK);
            // A unit starts with the first run of every SPLIT_CHUNKS-th chunk but the first.
            if off == 0 && c > 0 && (c as usize).is_multiple_of(SPLIT_CHUNKS) {
                cuts.push(out.len());
            }
            let len = (CHUNK - off).min(end - pos);
            out.push(Run {
                pos,
                slot,
                len,
                chunk: c,
            });
            seen += len;
            slot += len;
            pos += len;
        }
    }
    cuts.push(out.len());
    (out, cuts)
}

/// The runs of a chunked run list's first chunk (none for an empty list).
fn first_chunk(runs: &[Run]) -> &[Run] {
    let n = runs.first().map_or(0, |first| {
        runs.iter().take_while(|r| r.chunk == first.chunk).count()
    });
    &runs[..n]
}

/// The chunks that consecutive runs of a list cut and numbered by [`at_chunks`] touch: the
/// whole list's, or a unit's.
fn chunk_count(runs: &[Run]) -> usize {
    match (runs.first(), runs.last()) {
        (Some(first), Some(last)) => (last.chunk - first.chunk) as usize + 1,
        _ => 0,
    }
}

/// Runs covering logical positions `0..len` page by page.
pub(crate) fn dense_runs(seq: &Seq<'_>, len: usize, block_size: usize) -> Vec<Run> {
    (0..len.div_ceil(block_size))
        .map(|p| page_run(seq, p, len, block_size))
        .collect()
}

/// The run of logical page `page` of a sequence of `len` tokens.
pub(crate) fn page_run(seq: &Seq<'_>, page: usize, len: usize, block_size: usize) -> Run {
    let pos = page * block_size;
    Run {
        pos: pos as u32,
        slot: (seq.blocks[page] as usize * block_size) as u32,
        len: (len - pos).min(block_size) as u32,
        chunk: 0,
    }
}

/// Jobs for every (sequence, query tile) and KV heads; `list_of(seq, head)` names the run list,
/// and `shared(seq)` says whether all KV heads of the sequence attend the same list (then its
/// decode-sized jobs take every head at once, reading each token's heads as one contiguous
/// row). Which heads a job takes changes no bit of any row's result.
pub(crate) fn jobs_for(
    seqs: &[Seq<'_>],
    kv_heads: usize,
    group: usize,
    shared: impl Fn(usize) -> bool,
    list_of: impl Fn(usize, usize) -> usize,
) -> Vec<Job> {
    let mut jobs = Vec::new();
    for (s, seq) in seqs.iter().enumerate() {
        let mut lo = 0;
        while lo < seq.q_len {
            let hi = (lo + Q_TILE).min(seq.q_len);
            if shared(s) && (hi - lo) * kv_heads * group <= MAX_ROWS_ALL_HEADS {
                jobs.push(Job {
                    seq: s,
                    h0: 0,
                    h1: kv_heads,
                    q_lo: lo,
                    q_hi: hi,
                    list: list_of(s, 0),
                });
            } else {
                for h in 0..kv_heads {
                    jobs.push(Job {
                        seq: s,
                        h0: h,
                        h1: h + 1,
                        q_lo: lo,
                        q_hi: hi,
                        list: list_of(s, h),
                    });
                }
            }
            lo = hi;
        }
    }
    jobs
}
