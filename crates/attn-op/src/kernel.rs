//! The compute core shared by every entry point: online-softmax attention of a tile of query
//! rows over a list of KV runs, split into fixed chunks and merged with the log-sum-exp rule.
//!
//! Determinism: the split of a run list depends only on its length, and partial results are
//! merged in order, so a given list gives bit-identical results whatever the thread count. Dense
//! attention and sparse attention with every page selected build the same list, and so agree
//! bit for bit.

use rayon::prelude::*;

use crate::meta::Seq;
use crate::{AttnParams, Element, PagedKv};

/// Consecutive tokens that are consecutive in one block: logical positions `pos..pos + len` at
/// physical slots `slot..slot + len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Run {
    pub(crate) pos: u32,
    pub(crate) slot: u32,
    pub(crate) len: u32,
}

/// Runs per split of a job's run list.
const SPLIT_RUNS: usize = 64;
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
/// weighted sum of values `acc` (`rows x head_dim`).
#[derive(Clone, Debug)]
pub(crate) struct Partial {
    pub(crate) acc: Vec<f32>,
    pub(crate) m: Vec<f32>,
    pub(crate) l: Vec<f32>,
}

impl Partial {
    fn empty(rows: usize, d: usize) -> Self {
        Partial {
            acc: vec![0.0; rows * d],
            m: vec![f32::NEG_INFINITY; rows],
            l: vec![0.0; rows],
        }
    }

    /// Folds `other` into `self` with the log-sum-exp rule.
    fn merge(&mut self, other: &Partial, d: usize) {
        for r in 0..self.m.len() {
            let m = self.m[r].max(other.m[r]);
            if m == f32::NEG_INFINITY {
                continue;
            }
            let a = (self.m[r] - m).exp();
            let b = (other.m[r] - m).exp();
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
}

/// `a · b`; the `FMA` build (only instantiated by `attend_avx2_fma`) uses AVX2 FMA intrinsics.
#[inline(always)]
fn dot<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if FMA {
        // SAFETY: `FMA` is true only in `attend_avx2_fma`, which runs after AVX2 and FMA were
        // detected.
        return unsafe { simd::dot(a, b) };
    }
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

/// `acc += w * v`; the `FMA` build uses AVX2 FMA intrinsics.
#[inline(always)]
fn axpy<const FMA: bool>(acc: &mut [f32], w: f32, v: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if FMA {
        // SAFETY: as in `dot`.
        return unsafe { simd::axpy(acc, w, v) };
    }
    for (a, x) in acc.iter_mut().zip(v) {
        *a += w * x;
    }
}

/// Replaces each score `s` by `exp(s - m)` (a masked score, -inf, by exactly 0) and returns
/// their sum; the `FMA` build evaluates 8 exponentials at a time.
#[inline(always)]
fn exp_weights<const FMA: bool>(scores: &mut [f32], m: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if FMA {
        // SAFETY: as in `dot`.
        return unsafe { simd::exp_weights(scores, m) };
    }
    let mut sum = 0.0;
    for s in scores.iter_mut() {
        *s = if *s == f32::NEG_INFINITY {
            0.0
        } else {
            (*s - m).exp()
        };
        sum += *s;
    }
    sum
}

/// AVX2 + FMA versions of the inner loops.
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::{
        __m256, _CMP_GT_OQ, _MM_FROUND_NO_EXC, _MM_FROUND_TO_NEAREST_INT, _mm_add_ps, _mm_add_ss,
        _mm_cvtss_f32, _mm_movehl_ps, _mm_shuffle_ps, _mm256_add_epi32, _mm256_add_ps,
        _mm256_and_ps, _mm256_castps_si256, _mm256_castps256_ps128, _mm256_castsi256_ps,
        _mm256_cmp_ps, _mm256_cvtps_epi32, _mm256_extractf128_ps, _mm256_fmadd_ps, _mm256_loadu_ps,
        _mm256_max_ps, _mm256_mul_ps, _mm256_round_ps, _mm256_set1_ps, _mm256_setzero_ps,
        _mm256_slli_epi32, _mm256_storeu_ps, _mm256_sub_ps,
    };

    /// Sum of the 8 lanes.
    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
        _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps::<1>(x, x)))
    }

    /// `exp(x)` for `x <= 0`, 8 lanes: Cody-Waite range reduction by ln 2 and the Cephes
    /// degree-5 polynomial (about 1 ulp), lanes below -87.3 clamped there (about 1e-38).
    #[target_feature(enable = "avx2,fma")]
    fn exp8(x: __m256) -> __m256 {
        let x = _mm256_max_ps(x, _mm256_set1_ps(-87.3));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693_359_4), x);
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.121_944_4e-4), r);
        let mut p = _mm256_set1_ps(1.987_569_1e-4);
        for c in [
            1.398_199_9e-3,
            8.333_452e-3,
            4.166_579_6e-2,
            0.166_666_65,
            0.5,
        ] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let y = _mm256_fmadd_ps(
            _mm256_mul_ps(p, r),
            r,
            _mm256_add_ps(r, _mm256_set1_ps(1.0)),
        );
        let e = _mm256_slli_epi32::<23>(_mm256_cvtps_epi32(n));
        _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(y), e))
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_weights(scores: &mut [f32], m: f32) -> f32 {
        let n = scores.len();
        let p = scores.as_mut_ptr();
        let (mv, ninf) = (_mm256_set1_ps(m), _mm256_set1_ps(f32::NEG_INFINITY));
        let mut sum = _mm256_setzero_ps();
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: `i + 8 <= n`: 8 floats read-writable at `p + i`.
            unsafe {
                let s = _mm256_loadu_ps(p.add(i));
                let keep = _mm256_cmp_ps::<_CMP_GT_OQ>(s, ninf);
                let w = _mm256_and_ps(exp8(_mm256_sub_ps(s, mv)), keep);
                _mm256_storeu_ps(p.add(i), w);
                sum = _mm256_add_ps(sum, w);
            }
            i += 8;
        }
        let mut total = hsum(sum);
        for s in &mut scores[i..] {
            *s = if *s == f32::NEG_INFINITY {
                0.0
            } else {
                (*s - m).exp()
            };
            total += *s;
        }
        total
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc: [__m256; 4] = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (j, c) in acc.iter_mut().enumerate() {
                // SAFETY: `i + 32 <= n`, so the 8 floats at `i + 8 j` are in both slices.
                unsafe {
                    let o = i + 8 * j;
                    *c =
                        _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(o)), _mm256_loadu_ps(pb.add(o)), *c);
                }
            }
            i += 32;
        }
        while i + 8 <= n {
            // SAFETY: `i + 8 <= n`.
            unsafe {
                acc[0] = _mm256_fmadd_ps(
                    _mm256_loadu_ps(pa.add(i)),
                    _mm256_loadu_ps(pb.add(i)),
                    acc[0],
                );
            }
            i += 8;
        }
        let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut s = hsum(v);
        for j in i..n {
            s += a[j] * b[j];
        }
        s
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn axpy(acc: &mut [f32], w: f32, v: &[f32]) {
        let n = acc.len().min(v.len());
        let (pa, pv) = (acc.as_mut_ptr(), v.as_ptr());
        let wv = _mm256_set1_ps(w);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: `i + 8 <= n`: 8 floats readable in `v` and read-writable in `acc`.
            unsafe {
                let r = _mm256_fmadd_ps(wv, _mm256_loadu_ps(pv.add(i)), _mm256_loadu_ps(pa.add(i)));
                _mm256_storeu_ps(pa.add(i), r);
            }
            i += 8;
        }
        for j in i..n {
            acc[j] += w * v[j];
        }
    }
}

/// Widens a head vector; the `FAST` build (only instantiated by `attend_avx2_fma`) uses F16C.
#[inline(always)]
fn widen<T: Element, const FAST: bool>(src: &[T], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if FAST {
        // SAFETY: `FAST` is true only in `attend_avx2_fma`, which runs after AVX2, FMA and F16C
        // were detected.
        return unsafe { crate::dtype::widen_f16c(src, dst) };
    }
    T::slice_to_f32(src, dst);
}

/// Attention of `rows` query rows over `runs`, with the fastest code this CPU runs. The AVX2 +
/// FMA build rounds differently from the portable one (fused multiply-adds), so results are
/// deterministic per machine, and equal across machines within f32 rounding.
fn attend<T: Element>(
    kv: &PagedKv<T>,
    heads: (usize, usize),
    group: usize,
    q: &[f32],
    pos: &[i64],
    params: &AttnParams,
    runs: &[Run],
) -> Partial {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
    {
        // SAFETY: the CPU was just checked to support AVX2, FMA and F16C, the features the
        // function is compiled for.
        return unsafe { attend_avx2_fma(kv, heads, group, q, pos, params, runs) };
    }
    attend_body::<T, false>(kv, heads, group, q, pos, params, runs)
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_avx2_fma<T: Element>(
    kv: &PagedKv<T>,
    heads: (usize, usize),
    group: usize,
    q: &[f32],
    pos: &[i64],
    params: &AttnParams,
    runs: &[Run],
) -> Partial {
    attend_body::<T, true>(kv, heads, group, q, pos, params, runs)
}

/// Attention of query rows (`q`: `rows x d`, already scaled; `pos`: each row's absolute
/// position; rows ordered (query, KV head, head in group)) over `runs` of KV heads `h0..h1`.
/// Each run is widened once for all the job's heads; each row then sees the same operations in
/// the same order whatever the job's head range, so results do not depend on it.
#[inline(always)]
fn attend_body<T: Element, const FMA: bool>(
    kv: &PagedKv<T>,
    (h0, h1): (usize, usize),
    group: usize,
    q: &[f32],
    pos: &[i64],
    params: &AttnParams,
    runs: &[Run],
) -> Partial {
    let layout = kv.layout_ref();
    let d = layout.head_dim;
    let nh = h1 - h0;
    let rows = pos.len();
    let mut part = Partial::empty(rows, d);
    let longest = runs.iter().map(|r| r.len as usize).max().unwrap_or(0);
    let mut kbuf = vec![0.0f32; longest * nh * d];
    let mut vbuf = vec![0.0f32; longest * nh * d];
    let mut scores = vec![0.0f32; longest];
    let pmax = pos.iter().copied().max().unwrap_or(-1);
    let pmin = pos.iter().copied().min().unwrap_or(-1);
    let contiguous = nh == layout.kv_heads;
    for run in runs {
        let (start, len) = (i64::from(run.pos), run.len as usize);
        if start > pmax {
            continue;
        }
        // Every token of the run is visible to every row: no per-token mask.
        let end = start + len as i64 - 1;
        let all_visible = end <= pmin && params.window.is_none_or(|w| start > pmax - i64::from(w));
        if contiguous {
            let (k, v) = kv.run_all_heads(run.slot as usize, len);
            widen::<T, FMA>(k, &mut kbuf[..len * nh * d]);
            widen::<T, FMA>(v, &mut vbuf[..len * nh * d]);
        } else {
            for t in 0..len {
                let slot = run.slot as usize + t;
                for h in h0..h1 {
                    let o = (t * nh + h - h0) * d;
                    widen::<T, FMA>(kv.k_at(slot, h), &mut kbuf[o..o + d]);
                    widen::<T, FMA>(kv.v_at(slot, h), &mut vbuf[o..o + d]);
                }
            }
        }
        for r in 0..rows {
            let p = pos[r];
            let hh = (r / group) % nh;
            let qr = &q[r * d..(r + 1) * d];
            let mut mx = f32::NEG_INFINITY;
            for (t, s) in scores[..len].iter_mut().enumerate() {
                *s = if all_visible || params.visible(start + t as i64, p) {
                    let o = (t * nh + hh) * d;
                    let v = dot::<FMA>(qr, &kbuf[o..o + d]);
                    mx = mx.max(v);
                    v
                } else {
                    f32::NEG_INFINITY
                };
            }
            if mx == f32::NEG_INFINITY {
                continue;
            }
            let m_old = part.m[r];
            let m_new = m_old.max(mx);
            let acc = &mut part.acc[r * d..(r + 1) * d];
            if m_old != m_new {
                let alpha = (m_old - m_new).exp();
                acc.iter_mut().for_each(|a| *a *= alpha);
                part.l[r] *= alpha;
            }
            let lsum = exp_weights::<FMA>(&mut scores[..len], m_new);
            for (t, &w) in scores[..len].iter().enumerate() {
                if w != 0.0 {
                    let o = (t * nh + hh) * d;
                    axpy::<FMA>(acc, w, &vbuf[o..o + d]);
                }
            }
            part.l[r] += lsum;
            part.m[r] = m_new;
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
    mut lse: Option<&mut [f32]>,
) {
    let d = kv.layout_ref().head_dim;
    let hq = params.q_heads;
    let units: Vec<(usize, usize, usize)> = jobs
        .iter()
        .enumerate()
        .flat_map(|(j, job)| {
            let n = lists[job.list].len();
            let splits = n.div_ceil(SPLIT_RUNS).max(1);
            (0..splits).map(move |s| (j, s * SPLIT_RUNS, ((s + 1) * SPLIT_RUNS).min(n)))
        })
        .collect();
    let partials: Vec<Partial> = units
        .par_iter()
        .map(|&(j, lo, hi)| {
            let job = jobs[j];
            let seq = &seqs[job.seq];
            let (rows_q, pos) = job_rows(q, seq, &job, group, hq, d, params.scale);
            attend(
                kv,
                (job.h0, job.h1),
                group,
                &rows_q,
                &pos,
                params,
                &lists[job.list][lo..hi],
            )
        })
        .collect();
    let mut next = 0;
    for (j, job) in jobs.iter().enumerate() {
        let mut merged = partials[next].clone();
        next += 1;
        while next < units.len() && units[next].0 == j {
            merged.merge(&partials[next], d);
            next += 1;
        }
        let seq = &seqs[job.seq];
        let nh = job.h1 - job.h0;
        for r in 0..job.rows(group) {
            let qi = job.q_lo + r / (nh * group);
            let qh = job.h0 * group + r % (nh * group);
            {
                let (mut m, mut l) = (merged.m[r], merged.l[r]);
                let mut scale_acc = 1.0;
                if let Some(sinks) = &params.sink_logits {
                    let sink = sinks[qh];
                    let m2 = m.max(sink);
                    scale_acc = if m == f32::NEG_INFINITY {
                        0.0
                    } else {
                        (m - m2).exp()
                    };
                    l = l * scale_acc + (sink - m2).exp();
                    m = m2;
                }
                let token = seq.q_start + qi;
                let dst = &mut out[(token * hq + qh) * d..(token * hq + qh + 1) * d];
                let src = &merged.acc[r * d..(r + 1) * d];
                if l > 0.0 {
                    let inv = scale_acc / l;
                    for (o, a) in dst.iter_mut().zip(src) {
                        *o = a * inv;
                    }
                } else {
                    dst.fill(0.0);
                }
                if let Some(lse) = lse.as_deref_mut() {
                    lse[token * hq + qh] = if l > 0.0 {
                        m + l.ln()
                    } else {
                        f32::NEG_INFINITY
                    };
                }
            }
        }
    }
}

/// The scaled f32 query rows of a job and their positions.
fn job_rows<T: Element>(
    q: &[T],
    seq: &Seq<'_>,
    job: &Job,
    group: usize,
    hq: usize,
    d: usize,
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
        pos.push(seq.position(qi));
    }
    (qs, pos)
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
    }
}

/// Jobs for every (sequence, query tile) and KV heads; `list_of(seq, head)` names the run list,
/// and `shared` says whether all KV heads of a sequence share one list (then decode-sized jobs
/// take every head at once).
pub(crate) fn jobs_for(
    seqs: &[Seq<'_>],
    kv_heads: usize,
    group: usize,
    shared: bool,
    list_of: impl Fn(usize, usize) -> usize,
) -> Vec<Job> {
    let mut jobs = Vec::new();
    for (s, seq) in seqs.iter().enumerate() {
        let mut lo = 0;
        while lo < seq.q_len {
            let hi = (lo + Q_TILE).min(seq.q_len);
            if shared && (hi - lo) * kv_heads * group <= MAX_ROWS_ALL_HEADS {
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
