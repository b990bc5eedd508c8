//! The unnormalized attention state of a job's rows: one online-softmax step, the
//! log-sum-exp merge of two states, and the normalization into outputs.

use super::Job;
use crate::aligned::Aligned;
use crate::simd;

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
    pub(super) fn absorb<const ISA: u8>(
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
    pub(super) fn normalize(&mut self, job: &Job, group: usize, sinks: Option<&[f32]>, d: usize) {
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
