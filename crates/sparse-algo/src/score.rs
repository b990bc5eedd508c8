//! The inner loops of page scoring, with an AVX2 + FMA build chosen at run time.
//!
//! Both builds add the same products in the same order (16 lanes, then the lanes in order), so
//! they give bit-identical scores: selections do not depend on the machine.

use attn_op::{Element, exp_nonpositive};
use half::{bf16, f16};

use crate::Reps;

#[cfg(target_arch = "x86_64")]
mod wide;

/// Scores pages against a group of weighted queries: for every page `p` of `pages` and every
/// query head `j < g`, `out[j * pages.len() + i] = sum_c w_jc * side_jc(kmax_c, kmin_c)`, where
/// the page's `[kmax ‖ kmin]` vector (`2 * d` floats) sits at `reps[p * page_len + head_off..]`
/// and `side` picks `kmin` or `kmax` per channel ([`Weights`]). With `w = q` and each channel's
/// side the sign of `q` this is Quest's per-dimension upper bound `sum_d max(q_d * kmin_d, q_d *
/// kmax_d)`.
pub(crate) fn page_scores(
    w: &Weights<'_>,
    reps: &[f32],
    page_len: usize,
    head_off: usize,
    pages: std::ops::Range<usize>,
    out: &mut [f32],
) {
    dispatch!(page_scores_generic(
        w: &Weights<'_>,
        reps: &[f32],
        page_len: usize,
        head_off: usize,
        pages: std::ops::Range<usize>,
        out: &mut [f32]
    ));
}

/// Calls a generic `#[inline(always)]` body through an AVX2 + FMA build when the CPU has both.
macro_rules! dispatch {
    ($f:ident($($arg:ident: $ty:ty),*)) => {{
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            #[target_feature(enable = "avx2,fma")]
            fn wide($($arg: $ty),*) {
                $f($($arg),*)
            }
            // SAFETY: the CPU has AVX2 and FMA, checked just above.
            unsafe { wide($($arg),*) };
            return;
        }
        $f($($arg),*);
    }};
}
use dispatch;

/// Query weights of a group: each query head's weight of each channel (`w`, `[g, d]`) and
/// which of a page's two summaries each channel reads ([`Side`]). Quest weighs every channel
/// by the query and reads `kmax` where it is not negative, `kmin` where it is; RocketKV weighs
/// only its top-r channels and reads one side of each for the whole group. A score of `w *
/// kmax` where the other weight was 0 has the bits of `w * kmax + 0 * kmin` (a zero sum never
/// starts with -0, so the zero's sign is lost), which is what both computed before session 79.
pub(crate) struct Weights<'a> {
    pub(crate) w: &'a [f32],
    pub(crate) side: Side<'a>,
    pub(crate) g: usize,
    pub(crate) d: usize,
}

/// Which summary a channel reads: `kmin` where a sign bit is set, `kmax` where it is clear.
#[derive(Clone, Copy)]
pub(crate) enum Side<'a> {
    /// The sign of the head's own weight of the channel (Quest).
    Own,
    /// The sign of `[c]`, one entry a channel for the whole group (RocketKV).
    Shared(&'a [f32]),
}

impl Weights<'_> {
    /// Head `j`'s weights, and its side of each channel.
    #[inline(always)]
    fn head(&self, j: usize) -> (&[f32], &[f32]) {
        let w = &self.w[j * self.d..(j + 1) * self.d];
        match self.side {
            Side::Own => (w, w),
            Side::Shared(side) => (w, &side[..self.d]),
        }
    }
}

/// `kmin` where `side`'s sign bit is set, else `kmax` (the AVX2 build's `blendv`).
#[inline(always)]
fn pick(side: f32, kmax: f32, kmin: f32) -> f32 {
    if side.is_sign_negative() { kmin } else { kmax }
}

#[inline(always)]
fn page_scores_generic(
    w: &Weights<'_>,
    reps: &[f32],
    page_len: usize,
    head_off: usize,
    pages: std::ops::Range<usize>,
    out: &mut [f32],
) {
    let (g, d) = (w.g, w.d);
    let n = pages.len();
    for (i, p) in pages.enumerate() {
        let base = p * page_len + head_off;
        let (kmax, kmin) = reps[base..base + 2 * d].split_at(d);
        for j in 0..g {
            out[j * n + i] = dot2::<1>(w, j, kmax, kmin)[0];
        }
    }
}

/// The 16 lanes of [`dot2`]: lane `l` sums `w[i] * pick(side[i], kmax[i], kmin[i])` over `i =
/// l, l + 16, ...` below the last whole 16, in order.
#[inline(always)]
fn lanes(w: &[f32], side: &[f32], kmax: &[f32], kmin: &[f32]) -> [f32; 16] {
    let mut acc = [0.0f32; 16];
    let chunks = w.len() / 16 * 16;
    for i in (0..chunks).step_by(16) {
        let (w, side) = (&w[i..i + 16], &side[i..i + 16]);
        let (kmax, kmin) = (&kmax[i..i + 16], &kmin[i..i + 16]);
        for l in 0..16 {
            acc[l] += w[l] * pick(side[l], kmax[l], kmin[l]);
        }
    }
    acc
}

/// An element type representations are stored in, widened exactly to f32 for scoring.
pub(crate) trait Widen: Element {
    /// `row` as f32: itself, or widened into `scratch` (once, for every query head that
    /// scores it).
    fn widen_row<'a>(row: &'a [Self], scratch: &'a mut Vec<f32>) -> &'a [f32];
}

impl Widen for f32 {
    #[inline(always)]
    fn widen_row<'a>(row: &'a [f32], _: &'a mut Vec<f32>) -> &'a [f32] {
        row
    }
}

impl Widen for bf16 {
    #[inline(always)]
    fn widen_row<'a>(row: &'a [bf16], scratch: &'a mut Vec<f32>) -> &'a [f32] {
        widened(row, scratch)
    }
}

impl Widen for f16 {
    #[inline(always)]
    fn widen_row<'a>(row: &'a [f16], scratch: &'a mut Vec<f32>) -> &'a [f32] {
        widened(row, scratch)
    }
}

/// `row` widened into `scratch` by its element type's own slice conversion.
#[inline(always)]
fn widened<'a, E: Element>(row: &[E], scratch: &'a mut Vec<f32>) -> &'a [f32] {
    scratch.resize(row.len(), 0.0);
    E::slice_to_f32(row, scratch);
    scratch
}

/// `a · b` with 16 independent lanes, same build choice and order rules as [`page_scores`].
pub(crate) fn dots(q: &[f32], keys: &[f32], d: usize, out: &mut [f32]) {
    dispatch!(dots_generic(q: &[f32], keys: &[f32], d: usize, out: &mut [f32]));
}

/// `out[i] = q · keys[i * d..(i + 1) * d]` for every row of `keys`.
#[inline(always)]
fn dots_generic(q: &[f32], keys: &[f32], d: usize, out: &mut [f32]) {
    for (o, k) in out.iter_mut().zip(keys.chunks_exact(d)) {
        let mut acc = [0.0f32; 16];
        let chunks = d / 16 * 16;
        for i in (0..chunks).step_by(16) {
            let (a, b) = (&q[i..i + 16], &k[i..i + 16]);
            for l in 0..16 {
                acc[l] += a[l] * b[l];
            }
        }
        let mut s = 0.0;
        for x in acc {
            s += x;
        }
        for i in chunks..d {
            s += q[i] * k[i];
        }
        *o = s;
    }
}

/// A head's softmax weights over its page scores, unnormalized, into `e`: page `p`'s is
/// `tokens[p]` times `exp((x[p] - m) / temp)`, `m` the scores' maximum. Returns their sum in
/// f64 (four running sums, of pages `p % 4`, added in order). The exponential is attn-op's
/// [`exp_nonpositive`], the same bits on every machine, and the loop vectorizes where the CPU
/// has AVX2 and FMA.
pub(crate) fn softmax_weights(x: &[f32], tokens: &[f32], temp: f32, e: &mut [f32]) -> f64 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let mut parts = x.chunks_exact(8);
    for part in parts.by_ref() {
        for (l, &v) in lanes.iter_mut().zip(part) {
            *l = l.max(v);
        }
    }
    let m = lanes
        .into_iter()
        .chain(parts.remainder().iter().copied())
        .fold(f32::NEG_INFINITY, f32::max);
    let mut z = [0.0f64; 4];
    weigh(x, tokens, [m, temp], e, &mut z);
    z.iter().sum()
}

/// The body of [`softmax_weights`] after its maximum (`at`: the maximum and the temperature):
/// the weights into `e`, their sum into `z`'s four lanes.
fn weigh(x: &[f32], tokens: &[f32], at: [f32; 2], e: &mut [f32], z: &mut [f64; 4]) {
    dispatch!(weigh_generic(
        x: &[f32],
        tokens: &[f32],
        at: [f32; 2],
        e: &mut [f32],
        z: &mut [f64; 4]
    ));
}

#[inline(always)]
fn weigh_generic(x: &[f32], tokens: &[f32], [m, temp]: [f32; 2], e: &mut [f32], z: &mut [f64; 4]) {
    // Two plain loops, each of which vectorizes: the weights, then their sums.
    for ((e, &x), &t) in e.iter_mut().zip(x).zip(tokens) {
        *e = t * exp_nonpositive((x - m) / temp);
    }
    let mut lanes = [0.0f64; 4];
    let mut parts = e.chunks_exact(4);
    for part in parts.by_ref() {
        for (l, &v) in lanes.iter_mut().zip(part) {
            *l += f64::from(v);
        }
    }
    for (l, &v) in lanes.iter_mut().zip(parts.remainder()) {
        *l += f64::from(v);
    }
    *z = lanes;
}

/// Pages scored per parallel task of [`sweep`].
const SWEEP_CHUNK: usize = 64;

/// Which rows [`sweep`] returns: every query head's scores, or their maximum over each KV
/// head's group, or over every query head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Rows {
    /// `[kv_heads, g, pages]`: every query head's scores.
    All,
    /// `[kv_heads, pages]`: the maximum over each KV head's group.
    GroupMax,
    /// `[1, pages]`: the maximum over every query head.
    Max,
}

/// Scores pages `pages` of one sequence for every KV head at once, walking the representations
/// in memory order (page by page, every head of a page together): `w[h]` holds KV head `h`'s
/// group weights and `reps` is `[pages, kv_heads, 2 * d]`. The result holds `rows`, each
/// `pages.len()` long. Every score has the bits [`page_scores`] gives it (over the values
/// widened to f32: a 16-bit pool scores as an f32 pool of the same values), and a maximum is
/// taken over the query heads in order, `best = best.max(next)`.
pub(crate) fn sweep(
    w: &[Weights<'_>],
    reps: Reps<'_>,
    d: usize,
    pages: std::ops::Range<usize>,
    rows: Rows,
) -> Vec<f32> {
    match reps {
        Reps::F32(reps) => sweep_in(w, reps, d, pages, rows),
        Reps::Bf16(reps) => sweep_in(w, reps, d, pages, rows),
        Reps::F16(reps) => sweep_in(w, reps, d, pages, rows),
    }
}

/// [`sweep`] over values of one element type.
fn sweep_in<E: SweepChunk>(
    w: &[Weights<'_>],
    reps: &[E],
    d: usize,
    pages: std::ops::Range<usize>,
    rows: Rows,
) -> Vec<f32> {
    use rayon::prelude::*;
    let kvh = w.len();
    let g = w.first().map_or(0, |w| w.g);
    let n = pages.len();
    // Output rows, and how many query heads' rows each takes the maximum of.
    let (out_rows, per) = match rows {
        Rows::All => (kvh * g, 1),
        Rows::GroupMax => (kvh, g),
        Rows::Max => (1, kvh * g),
    };
    let parts: Vec<Vec<f32>> = (0..n.div_ceil(SWEEP_CHUNK))
        .into_par_iter()
        .map(|c| {
            let a = pages.start + c * SWEEP_CHUNK;
            let b = (a + SWEEP_CHUNK).min(pages.end);
            let m = b - a;
            let mut local = vec![0.0f32; kvh * g * m];
            E::sweep_chunk(w, reps, d, a..b, &mut local);
            if per == 1 {
                return local;
            }
            let mut best = vec![0.0f32; out_rows * m];
            for (o, dst) in best.chunks_exact_mut(m).enumerate() {
                dst.copy_from_slice(&local[o * per * m..(o * per + 1) * m]);
                for r in o * per + 1..(o + 1) * per {
                    for (b, &x) in dst.iter_mut().zip(&local[r * m..(r + 1) * m]) {
                        *b = b.max(x);
                    }
                }
            }
            best
        })
        .collect();
    let mut out = vec![0.0f32; out_rows * n];
    for (c, local) in parts.iter().enumerate() {
        let a = c * SWEEP_CHUNK;
        let m = local.len() / out_rows.max(1);
        for r in 0..out_rows {
            out[r * n + a..r * n + a + m].copy_from_slice(&local[r * m..(r + 1) * m]);
        }
    }
    out
}

/// One task of [`sweep`] per element type (the build chosen at run time is not generic).
trait SweepChunk: Widen {
    /// Pages `pages` into `local` (`[kv_heads, g, pages.len()]`), through one build choice
    /// for the whole chunk.
    fn sweep_chunk(
        w: &[Weights<'_>],
        reps: &[Self],
        d: usize,
        pages: std::ops::Range<usize>,
        local: &mut [f32],
    );
}

/// Implements [`SweepChunk`] for element types.
macro_rules! sweep_chunk_for {
    ($($t:ty),*) => {$(
        impl SweepChunk for $t {
            fn sweep_chunk(
                w: &[Weights<'_>],
                reps: &[$t],
                d: usize,
                pages: std::ops::Range<usize>,
                local: &mut [f32],
            ) {
                // Groups of whole fours over whole 16s of channels take the AVX2 body, each
                // page row widened once for four heads; it adds as the generic body does.
                #[cfg(target_arch = "x86_64")]
                if w.iter().all(|h| h.g % 4 == 0 && h.d == d) && d % 16 == 0 && wide::usable() {
                    // SAFETY: `usable` checked AVX2, FMA and F16C; every group is a whole
                    // number of fours of `d` channels, `d` a whole number of 16s; the caller
                    // (`sweep_in`) passes a `local` of `[kv_heads, g, pages.len()]`.
                    unsafe { wide::sweep_chunk(w, reps, d, pages, local) };
                    return;
                }
                dispatch!(sweep_chunk_generic(
                    w: &[Weights<'_>],
                    reps: &[$t],
                    d: usize,
                    pages: std::ops::Range<usize>,
                    local: &mut [f32]
                ));
            }
        }
    )*};
}
sweep_chunk_for!(f32, bf16, f16);

/// The body of [`SweepChunk::sweep_chunk`]. A page's `[kmax ‖ kmin]` is scored for four query
/// heads of its group at a time, whose final sums of lanes then run side by side; each head's
/// sum takes exactly the steps of [`page_scores`]'s, so the bits match.
#[inline(always)]
fn sweep_chunk_generic<E: Widen>(
    w: &[Weights<'_>],
    reps: &[E],
    d: usize,
    pages: std::ops::Range<usize>,
    local: &mut [f32],
) {
    let m = pages.len();
    let mut scratch = Vec::with_capacity(2 * d);
    walk(w.len(), reps, d, pages, |h, i, row| {
        let wh = &w[h];
        let row = E::widen_row(row, &mut scratch);
        let (kmax, kmin) = row.split_at(d);
        let g = wh.g;
        let mut j = 0;
        while j < g {
            let row = |t: usize| (h * g + j + t) * m + i;
            if j + 4 <= g {
                for (t, x) in dot2::<4>(wh, j, kmax, kmin).into_iter().enumerate() {
                    local[row(t)] = x;
                }
                j += 4;
            } else {
                local[row(0)] = dot2::<1>(wh, j, kmax, kmin)[0];
                j += 1;
            }
        }
    });
}

/// The sweep's walk over pages `pages` of `reps` (`[pages, heads, 2 * d]`): blocks of
/// [`BLOCK`] pages, each KV head's rows of a block in turn, so that the head's query weights
/// (`4 g d` bytes) are read from level 1 once a block, and the same head's rows [`AHEAD`] pages
/// on asked of level 2 as each is scored (the hardware's prefetchers alone left the walk at a
/// fraction of the read bandwidth). Calls `score(h, i, row)` for KV head `h` of page
/// `pages.start + i`, whose `[kmax ‖ kmin]` is `row`.
#[inline(always)]
fn walk<E>(
    heads: usize,
    reps: &[E],
    d: usize,
    pages: std::ops::Range<usize>,
    mut score: impl FnMut(usize, usize, &[E]),
) {
    let page_len = heads * 2 * d;
    let first = pages.start;
    for block in (first..pages.end).step_by(BLOCK) {
        let block = block..(block + BLOCK).min(pages.end);
        for h in 0..heads {
            for p in block.clone() {
                let base = p * page_len + h * 2 * d;
                let ahead = base + AHEAD * page_len;
                if let Some(rows) = reps.get(ahead..ahead + 2 * d) {
                    fetch_lines(rows);
                }
                score(h, p - first, &reps[base..base + 2 * d]);
            }
        }
    }
}

/// Pages a KV head scores in a row before the next head's turn
/// ([`SweepChunk::sweep_chunk`]).
const BLOCK: usize = 4;

/// How many pages ahead of its scoring [`SweepChunk::sweep_chunk`] asks for a page's rows.
const AHEAD: usize = 8;

/// Asks the CPU to bring `rows` (each 64-byte line) into its level-2 cache.
#[inline(always)]
fn fetch_lines<E>(rows: &[E]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
        let p = rows.as_ptr().cast::<i8>();
        for o in (0..size_of_val(rows)).step_by(64) {
            // SAFETY: `o` lies within `rows`, and a prefetch reads nothing architecturally.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(p.add(o)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = rows;
}

/// `sum_c w_jc * pick(side_jc, kmax_c, kmin_c)` for the `N` query heads `j = j0..j0 + N` of
/// `w`, in one fixed order of adds: each head's 16 lanes ([`lanes`]), then its lanes summed in
/// order from 0.0, then the dims past the last whole 16 in order. The `N` heads' sums run side
/// by side.
#[inline(always)]
fn dot2<const N: usize>(w: &Weights<'_>, j0: usize, kmax: &[f32], kmin: &[f32]) -> [f32; N] {
    // A loop, not `std::array::from_fn`: a closure passed to a function that is not inlined
    // is compiled without the caller's target features.
    let mut acc = [[0.0f32; 16]; N];
    for (t, at) in acc.iter_mut().enumerate() {
        let (wt, side) = w.head(j0 + t);
        *at = lanes(wt, side, kmax, kmin);
    }
    // Lane by lane, every head's sum at once: N independent chains of 16 adds.
    let mut s = [0.0f32; N];
    for l in 0..16 {
        for (st, at) in s.iter_mut().zip(&acc) {
            *st += at[l];
        }
    }
    let chunks = w.d / 16 * 16;
    for (t, st) in s.iter_mut().enumerate() {
        let (wt, side) = w.head(j0 + t);
        for i in chunks..w.d {
            *st += wt[i] * pick(side[i], kmax[i], kmin[i]);
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `sweep` against one `page_scores` call per (page, KV head), bit for bit, over group
    /// sizes that take the AVX2 body (whole fours over whole 16s of channels) and the generic
    /// one, head dims with and without a tail past the 16 lanes, and both kinds of weights
    /// (Quest's own signs, RocketKV's shared sides with channels that weigh nothing); its
    /// maxima against the rows' maxima taken in order; and `page_scores` against the form
    /// both algorithms used before session 79, `wmax kmax + wmin kmin` with one weight 0.
    #[test]
    fn the_sweep_has_the_bits_of_one_page_at_a_time() {
        let mut random = crate::xorshift(0x9e37_79b9);
        let mut next = move || (random() >> 8) as f32 / (1 << 24) as f32 - 0.5;
        for (kvh, g, d, pages) in [
            (2, 4, 128, 150),
            (3, 5, 40, 70),
            (1, 1, 7, 3),
            (2, 8, 16, 65),
            (1, 12, 48, 9),
        ] {
            let q: Vec<f32> = (0..kvh * g * d).map(|_| 4.0 * next()).collect();
            let sides: Vec<f32> = (0..kvh * d)
                .map(|_| if next() < 0.0 { -1.0 } else { 0.0 })
                .collect();
            let sparse: Vec<f32> = q
                .iter()
                .enumerate()
                .map(|(i, &v)| if i % 3 == 0 { 0.0 } else { v })
                .collect();
            let reps: Vec<f32> = (0..pages * kvh * 2 * d).map(|_| 8.0 * next()).collect();
            for shared in [false, true] {
                let w: Vec<Weights<'_>> = (0..kvh)
                    .map(|h| Weights {
                        w: &(if shared { &sparse } else { &q })[h * g * d..(h + 1) * g * d],
                        side: if shared {
                            Side::Shared(&sides[h * d..(h + 1) * d])
                        } else {
                            Side::Own
                        },
                        g,
                        d,
                    })
                    .collect();
                check(
                    &w,
                    &reps,
                    pages,
                    &format!("kv heads {kvh}, group {g}, dim {d}, shared {shared}"),
                );
            }
        }
    }

    /// One case of [`the_sweep_has_the_bits_of_one_page_at_a_time`]: weights `w` over the f32
    /// pages `reps` (`pages` of them), and the same pages in bf16 and f16.
    fn check(w: &[Weights<'_>], reps: &[f32], pages: usize, case: &str) {
        let bits = |v: &[f32]| v.iter().map(|s| s.to_bits()).collect::<Vec<_>>();
        let (kvh, g, d) = (w.len(), w[0].g, w[0].d);
        let range = 1..pages;
        let n = range.len();
        let got = sweep(w, Reps::F32(reps), d, range.clone(), Rows::All);
        for (h, wh) in w.iter().enumerate() {
            let mut want = vec![0.0f32; g * n];
            for (i, p) in range.clone().enumerate() {
                let mut one = vec![0.0f32; g];
                page_scores(wh, reps, kvh * 2 * d, h * 2 * d, p..p + 1, &mut one);
                let row = &reps[p * kvh * 2 * d + h * 2 * d..][..2 * d];
                for (j, s) in one.into_iter().enumerate() {
                    assert_eq!(
                        s.to_bits(),
                        before(wh, j, row).to_bits(),
                        "{case}: head {h}"
                    );
                    want[j * n + i] = s;
                }
            }
            assert_eq!(
                bits(&got[h * g * n..(h + 1) * g * n]),
                bits(&want),
                "{case}: head {h}"
            );
        }
        // The maxima over each group and over every head, in the rows' order.
        let max_of = |rows: std::ops::Range<usize>| -> Vec<u32> {
            let mut best = got[rows.start * n..(rows.start + 1) * n].to_vec();
            for r in rows.start + 1..rows.end {
                for (b, &x) in best.iter_mut().zip(&got[r * n..(r + 1) * n]) {
                    *b = b.max(x);
                }
            }
            bits(&best)
        };
        let groups: Vec<u32> = (0..kvh).flat_map(|h| max_of(h * g..(h + 1) * g)).collect();
        let grouped = sweep(w, Reps::F32(reps), d, range.clone(), Rows::GroupMax);
        assert_eq!(bits(&grouped), groups, "{case}");
        let all = sweep(w, Reps::F32(reps), d, range.clone(), Rows::Max);
        assert_eq!(bits(&all), max_of(0..kvh * g), "{case}");
        // A 16-bit pool scores as an f32 pool of its values, in every row form.
        let brain: Vec<bf16> = reps.iter().map(|&x| bf16::from_f32(x)).collect();
        let half: Vec<f16> = reps.iter().map(|&x| f16::from_f32(x)).collect();
        for (name, narrow) in [("bf16", Reps::Bf16(&brain)), ("f16", Reps::F16(&half))] {
            let wide = narrow.to_f32();
            for rows in [Rows::All, Rows::GroupMax, Rows::Max] {
                assert_eq!(
                    bits(&sweep(w, narrow, d, range.clone(), rows)),
                    bits(&sweep(w, Reps::F32(&wide), d, range.clone(), rows)),
                    "{case}: {rows:?} over {name}"
                );
            }
        }
    }

    /// The softmax weights through both builds against the scalar body, bit for bit (the
    /// exponential's own accuracy is attn-op's test).
    #[test]
    fn the_softmax_weights_are_the_same_through_both_builds() {
        let mut random = crate::xorshift(0x51f1_5eed);
        let mut next = move || (random() >> 8) as f32 / (1 << 24) as f32;
        let x: Vec<f32> = (0..1003).map(|_| 30.0 * next() - 15.0).collect();
        let tokens: Vec<f32> = (0..x.len())
            .map(|p| if p == 1002 { 3.0 } else { 16.0 })
            .collect();
        let mut e = vec![0.0f32; x.len()];
        let z = softmax_weights(&x, &tokens, 1.7, &mut e);
        let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut want = vec![0.0f32; x.len()];
        let mut lanes = [0.0f64; 4];
        weigh_generic(&x, &tokens, [m, 1.7], &mut want, &mut lanes);
        let bits = |v: &[f32]| v.iter().map(|s| s.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&e), bits(&want));
        assert_eq!(z.to_bits(), lanes.iter().sum::<f64>().to_bits());
    }

    /// Head `j`'s score of one page row (`[kmax ‖ kmin]`) in the form of before session 79:
    /// the weight on the row's side in `wmax` or `wmin` and 0 on the other, each lane adding
    /// `wmax kmax + wmin kmin`, then the lanes in order, then the tail.
    fn before(w: &Weights<'_>, j: usize, row: &[f32]) -> f32 {
        let d = w.d;
        let (wt, side) = w.head(j);
        let (kmax, kmin) = row.split_at(d);
        let (mut wmax, mut wmin) = (vec![0.0f32; d], vec![0.0f32; d]);
        for c in 0..d {
            if side[c].is_sign_negative() {
                wmin[c] = wt[c];
            } else {
                wmax[c] = wt[c];
            }
        }
        let term = |c: usize| wmax[c] * kmax[c] + wmin[c] * kmin[c];
        let mut acc = [0.0f32; 16];
        for c in 0..d / 16 * 16 {
            acc[c % 16] += term(c);
        }
        let mut s = acc.iter().fold(0.0f32, |s, &a| s + a);
        for c in d / 16 * 16..d {
            s += term(c);
        }
        s
    }
}
