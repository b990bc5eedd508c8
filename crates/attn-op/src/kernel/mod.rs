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

mod block;
mod partial;
mod rows;
mod runs;

use std::sync::{Mutex, OnceLock};

pub(crate) use partial::Partial;
use rows::ChunkRows;
use runs::{at_chunks, chunk_count, first_chunk};
pub(crate) use runs::{dense_runs, jobs_for, page_run};

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

/// Everything one unit of work reads: the cache, its job's KV heads `h0..h1` and query heads
/// per KV head, the job's query rows (`q`: `rows x d`, already scaled; `pos`: each row's
/// absolute position; rows ordered (query, KV head, head in group)), the parameters, and the
/// walk.
struct Unit<'a, T: Element> {
    kv: &'a PagedKv<T>,
    heads: (usize, usize),
    group: usize,
    q: &'a [f32],
    pos: &'a [i64],
    params: &'a AttnParams,
    walk: Walk<'a>,
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

/// Attention of a unit's query rows over its runs, with the widest instruction set this CPU
/// has. The SIMD builds round differently from the portable one (fused multiply-adds, a
/// polynomial exp), so results are deterministic per machine and agree across machines within
/// f32 rounding.
fn attend<T: Element>(isa: u8, unit: Unit<'_, T>) -> Partial {
    #[cfg(target_arch = "x86_64")]
    match body_isa::<T>(isa, unit.kv.layout_ref().head_dim) {
        simd::AVX512_BF16 => {
            // SAFETY: `resolve` caps `isa` by the features the CPU has, which are the ones
            // each function is compiled for; this build reads the cache as bf16 in rows of
            // 32, which `body_isa` checks.
            return unsafe { attend_avx512bf16(unit) };
        }
        // SAFETY: as above (a CPU with the bf16 build has AVX-512F).
        simd::AVX512 => return unsafe { attend_avx512(unit) },
        // SAFETY: as above.
        simd::AVX2 => return unsafe { attend_avx2(unit) },
        _ => {}
    }
    attend_body::<T, { simd::PORTABLE }>(unit)
}

/// Defines `$name`: [`attend_body`] compiled for `$features` with build `$isa`.
macro_rules! attend_with {
    ($name:ident, $features:literal, $isa:expr) => {
        /// # Safety
        #[doc = concat!("The CPU must support ", $features, ".")]
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        unsafe fn $name<T: Element>(unit: Unit<'_, T>) -> Partial {
            attend_body::<T, { $isa }>(unit)
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

/// Attention of a unit's query rows over its runs (cut and numbered by [`at_chunks`]). Each
/// chunk is widened once for all the job's heads; each row then sees the same operations in
/// the same order whatever the job's head range, so results do not depend on it.
#[inline(always)]
fn attend_body<T: Element, const ISA: u8>(
    Unit {
        kv,
        heads: (h0, h1),
        group,
        q,
        pos,
        params,
        walk:
            Walk {
                runs,
                after,
                after_heads: (a0, a1),
            },
    }: Unit<'_, T>,
) -> Partial {
    let d = kv.layout_ref().head_dim;
    let nh = h1 - h0;
    let rows = pos.len();
    // The AVX-512 and AVX2 builds take a chunk's dot products at once where the head dim
    // allows (a whole number of vectors).
    let chunk_dots = cfg!(target_arch = "x86_64")
        && ((ISA == simd::AVX512 && d.is_multiple_of(16))
            || (ISA == simd::AVX2 && d.is_multiple_of(8)));
    let walker = block::Walker {
        kv,
        params,
        group,
        h0,
        nh,
        d,
        chunk_dots,
    };
    let mut part = Partial::empty(rows, d);
    // A step takes a block of `group` rows, or, in a one-head job, every row of the job where
    // `multi` below takes them together.
    let step_rows = if nh == 1 { rows.max(group) } else { group };
    let mut scratch = block::Scratch::new::<T, ISA>(&walker, q, step_rows);
    let mut bufs = scratch.bufs();
    // The chunk's tokens: logical position and physical slot, in order.
    let mut toks: Vec<(i64, usize)> = Vec::with_capacity(CHUNK as usize);
    let pmax = pos.iter().copied().max().unwrap_or(-1);
    let pmin = pos.iter().copied().min().unwrap_or(-1);
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
        let view = block::ChunkView {
            toks: &toks,
            all_visible,
        };
        // The portable build widens the chunk once into f32 scratch; the SIMD builds widen in
        // registers as they go (a head's K and V stay in L1 across its group's rows).
        if ISA == simd::PORTABLE {
            walker.widen(chunk, &mut bufs);
        }
        // Rows come in blocks of `group`: one query position and KV head, so one mask and one
        // K/V stream, widened once for the whole block. Where the job has one KV head and
        // every row sees every token of the chunk (a prefill's chunks below its query tile),
        // and the group does not fill the chunk kernels' blocks of 4 rows by itself (groups
        // of 1, 2, 3, 5, 6, 7), the chunk kernels take all the job's rows in one step
        // instead, so that each key and value is read once for a whole block of rows; each
        // row's arithmetic is the same either way. The bf16 build keeps its fused step for
        // the groups it fuses (1, 2, 4, 8 rows) and takes the others so too.
        let multi = nh == 1
            && all_visible
            && !group.is_multiple_of(4)
            && (chunk_dots || (ISA == simd::AVX512_BF16 && group > 2));
        // `hb` is the block's KV head, `(b / group) % nh` since rows are ordered (query, KV
        // head, head in group): counted rather than divided for.
        let (mut b, mut hb) = (0, 0);
        while b < rows {
            let span = if multi { rows - b } else { group };
            let (keys, vals) = this.head(hb, len);
            // The first query's head blocks ask for the next chunk's rows, each a share of
            // them in address order.
            let ahead = if ISA != simd::PORTABLE && b < nh * group {
                next.share(hb, bytes)
            } else {
                (simd::Ahead::NONE, simd::Ahead::NONE)
            };
            let blk = block::Block {
                b,
                span,
                hb,
                keys,
                vals,
                ahead,
            };
            walker.step::<ISA>((&mut part, &mut bufs), &view, &blk, (q, pos[b]));
            b += span;
            hb = if hb + 1 == nh { 0 } else { hb + 1 };
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
            let unit = Unit {
                kv,
                heads: (job.h0, job.h1),
                group,
                q: rows_q,
                pos,
                params,
                walk,
            };
            let part = attend(isa, unit);
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
