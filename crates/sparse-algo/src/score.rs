//! The inner loops of page scoring, with an AVX2 + FMA build chosen at run time.
//!
//! Both builds add the same products in the same order (16 lanes, then the lanes in order), so
//! they give bit-identical scores: selections do not depend on the machine.

/// Scores pages against a group of weighted queries: for every page `p` of `pages` and every
/// query head `j < g`, `out[j * pages.len() + i] = wmax_j · kmax + wmin_j · kmin`, where the
/// page's `[kmax ‖ kmin]` vector (`2 * d` floats) sits at `reps[p * page_len + head_off..]`.
/// With `wmax = max(q, 0)` and `wmin = min(q, 0)` this is Quest's per-dimension upper bound
/// `sum_d max(q_d * kmin_d, q_d * kmax_d)`.
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

/// Query weights of a group: `wmax` and `wmin`, each `[g, d]`.
pub(crate) struct Weights<'a> {
    pub(crate) wmax: &'a [f32],
    pub(crate) wmin: &'a [f32],
    pub(crate) g: usize,
    pub(crate) d: usize,
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
            let s = dot2(
                &w.wmax[j * d..(j + 1) * d],
                kmax,
                &w.wmin[j * d..(j + 1) * d],
                kmin,
            );
            out[j * n + i] = s;
        }
    }
}

/// `a · b + c · e` with 16 independent lanes.
#[inline(always)]
fn dot2(a: &[f32], b: &[f32], c: &[f32], e: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let chunks = a.len() / 16 * 16;
    for i in (0..chunks).step_by(16) {
        let (a, b, c, e) = (&a[i..i + 16], &b[i..i + 16], &c[i..i + 16], &e[i..i + 16]);
        for l in 0..16 {
            acc[l] += a[l] * b[l] + c[l] * e[l];
        }
    }
    let mut s = 0.0;
    for x in acc {
        s += x;
    }
    for i in chunks..a.len() {
        s += a[i] * b[i] + c[i] * e[i];
    }
    s
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

/// Pages scored per parallel task of [`sweep`].
const SWEEP_CHUNK: usize = 64;

/// Scores pages `pages` of one sequence for every KV head at once, walking the representations
/// in memory order (page by page, every head of a page together): `w[h]` holds KV head `h`'s
/// group weights, `reps` is `[pages, kv_heads, 2 * d]`, and the result is
/// `[kv_heads, g, pages.len()]`.
pub(crate) fn sweep(
    w: &[Weights<'_>],
    reps: &[f32],
    d: usize,
    pages: std::ops::Range<usize>,
) -> Vec<f32> {
    use rayon::prelude::*;
    let kvh = w.len();
    let g = w.first().map_or(0, |w| w.g);
    let n = pages.len();
    let page_len = kvh * 2 * d;
    let parts: Vec<Vec<f32>> = (0..n.div_ceil(SWEEP_CHUNK))
        .into_par_iter()
        .map(|c| {
            let a = pages.start + c * SWEEP_CHUNK;
            let b = (a + SWEEP_CHUNK).min(pages.end);
            let m = b - a;
            let mut local = vec![0.0f32; kvh * g * m];
            let mut tmp = vec![0.0f32; g];
            for p in a..b {
                for (h, wh) in w.iter().enumerate() {
                    page_scores(wh, reps, page_len, h * 2 * d, p..p + 1, &mut tmp);
                    for (j, &x) in tmp.iter().enumerate() {
                        local[(h * g + j) * m + p - a] = x;
                    }
                }
            }
            local
        })
        .collect();
    let mut out = vec![0.0f32; kvh * g * n];
    for (c, local) in parts.iter().enumerate() {
        let a = c * SWEEP_CHUNK;
        let m = local.len() / (kvh * g).max(1);
        for r in 0..kvh * g {
            out[r * n + a..r * n + a + m].copy_from_slice(&local[r * m..(r + 1) * m]);
        }
    }
    out
}
