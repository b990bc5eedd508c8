//! Where the time of one Quest step goes: the tensor-core scoring, the selecting kernel and the
//! sparse attention, each launched in its traced form (per-CTA `%globaltimer` marks,
//! kernels/trace.cuh), on one time axis from the first scoring CTA's start.

use attn_op::cuda::{DeviceBatch, DevicePagedKv, Gpu, TRACE_MARKS, TRACE_WORDS};
use attn_op::{AttnError, AttnParams};
use cudarc::driver::CudaSlice;
use cudarc::driver::sys::CUevent_flags;
use half::bf16;
use sparse_algo::cuda::{DeviceRepPool, DeviceTopK, PICK_TRACE_FIRST, QuestScoring, SelectKernels};
use sparse_algo::{AlgoError, Quest};

use super::bench::{D, Q_HEADS};

/// A kernel's marks: the mark's index in a trace record and what it stands for.
type Marks = &'static [(usize, &'static str)];

/// One traced kernel of a step: its name, its CTAs' records and its marks.
type Traced<'a> = (&'a str, &'a [u64], Marks);

/// What each kernel's marks stand for (kernels/select.cu and kernels/attn.cu); mark 9 is
/// every kernel's end.
const SCORE_MARKS: &[(usize, &str)] = &[(0, "start"), (1, "wait over"), (9, "items scored")];
const PICK_MARKS: &[(usize, &str)] = &[
    (0, "start"),
    (1, "wait over"),
    (2, "keys read, floor"),
    (7, "ballots counted"),
    (8, "places found"),
    (5, "candidates"),
    (6, "threshold"),
    (3, "ids"),
    (4, "row written"),
    (9, "end"),
];
const ATTN_MARKS: &[(usize, &str)] = &[
    (0, "start"),
    (1, "wait over"),
    (2, "metadata"),
    (3, "first slots, q"),
    (4, "first K and V"),
    (5, "walk done"),
    (8, "split counted"),
    (9, "end (merged)"),
];

/// One Quest step's inputs at one shape, shared by the step's benches and its trace (`tag`
/// names the shape in their rows, after a space).
pub(crate) struct Step<'a> {
    pub quest: &'a Quest,
    pub q: &'a CudaSlice<bf16>,
    pub kv: &'a DevicePagedKv<bf16>,
    pub decode: &'a DeviceBatch,
    pub slots: &'a CudaSlice<i32>,
    pub pool: &'a DeviceRepPool<bf16>,
    /// The pool's layer the step scores.
    pub layer: usize,
    pub top: &'a mut DeviceTopK,
    pub out: &'a mut CudaSlice<f32>,
    pub tag: &'a str,
}

impl<'a> Step<'a> {
    /// Points the step at `layer` of the pool, with that layer's decode metadata.
    pub(crate) fn set_layer(&mut self, layer: usize, decode: &'a DeviceBatch) {
        self.layer = layer;
        self.decode = decode;
    }

    /// The same step at `layer` of the pool, with that layer's decode metadata, attending into
    /// `out` (the top-k borrowed from this one).
    pub(crate) fn for_layer<'b>(
        &'b mut self,
        layer: usize,
        decode: &'b DeviceBatch,
        out: &'b mut CudaSlice<f32>,
    ) -> Step<'b> {
        Step {
            decode,
            layer,
            top: &mut *self.top,
            out,
            ..*self
        }
    }

    /// Enqueues the step on `gpu`'s stream (where `sk` launches too): `sk`'s top-k, then
    /// attention over its selection, starting early over the published rows where the top-k
    /// published them ([`SelectKernels::set_publish`]).
    pub(crate) fn run(&mut self, gpu: &Gpu, sk: &SelectKernels) -> Result<(), AlgoError> {
        let params = AttnParams::new(Q_HEADS, D);
        let (q, kv, decode) = (self.q, self.kv, self.decode);
        sk.quest_topk(
            self.quest, q, Q_HEADS, decode, self.layer, self.slots, self.pool, self.top,
        )?;
        let sel = &self.top.sel;
        match self.top.published() {
            // SAFETY: the launch right before is the top-k whose scoring advanced the step's
            // value and which publishes the selection under it; q, kv and decode were
            // complete before that scoring began.
            Some(p) => unsafe {
                gpu.sparse_page_attention_published(q, kv, decode, sel, p, &params, self.out, None)
            }?,
            None => gpu.sparse_page_attention(q, kv, decode, sel, &params, self.out, None)?,
        }
        Ok(())
    }
}

/// Traces one step alone (an idle device) and one right behind an untraced step, and answers
/// a report of each.
pub(crate) fn trace_step(
    gpu: &mut Gpu,
    sk: &mut SelectKernels,
    s: &mut Step<'_>,
) -> Result<Vec<String>, AlgoError> {
    sk.set_quest_scoring(QuestScoring::TensorCores);
    let mut reports = Vec::new();
    for (publish, behind) in [(false, false), (false, true), (true, false), (true, true)] {
        sk.set_publish(publish);
        s.run(gpu, sk)?;
        gpu.synchronize()?;
        sk.take_trace()?;
        gpu.take_attn_trace()?;
        if behind {
            s.run(gpu, sk)?;
        }
        let name = format!(
            "{}{}{}",
            s.tag.trim(),
            if publish { " published" } else { "" },
            if behind {
                ", behind an untraced step"
            } else {
                ", alone"
            }
        );
        reports.push(trace_next(gpu, sk, s, &name)?);
    }
    sk.set_publish(false);
    sk.set_quest_scoring(QuestScoring::Exact);
    Ok(reports)
}

/// Traces `s`'s step, enqueued right behind whatever `gpu`'s stream holds (`sk` publishing or
/// not as set), and answers its report under `name`. The trace records hold nothing yet: none
/// was written since the last [`SelectKernels::take_trace`] and [`Gpu::take_attn_trace`].
pub(crate) fn trace_next(
    gpu: &mut Gpu,
    sk: &mut SelectKernels,
    s: &mut Step<'_>,
    name: &str,
) -> Result<String, AlgoError> {
    let event = || {
        gpu.context()
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| AlgoError::from(AttnError::from(e)))
    };
    let (a, b) = (event()?, event()?);
    sk.set_trace(true);
    let variant = gpu.variant();
    gpu.set_variant(Some("tct"))?;
    a.record(gpu.stream()).map_err(AttnError::from)?;
    let traced = s.run(gpu, sk);
    b.record(gpu.stream()).map_err(AttnError::from)?;
    sk.set_trace(false);
    gpu.set_variant(variant)?;
    traced?;
    b.synchronize().map_err(AttnError::from)?;
    let ms = f64::from(a.elapsed_ms(&b).map_err(AttnError::from)?);
    let sel = sk.take_trace()?;
    let attn = gpu.take_attn_trace()?;
    let words = PICK_TRACE_FIRST * TRACE_WORDS;
    let kernels = [
        ("scoring", &sel[..words], SCORE_MARKS),
        ("pick_rows", &sel[words..], PICK_MARKS),
        ("attention", &attn[..], ATTN_MARKS),
    ];
    Ok(report(name, ms, &kernels))
}

/// The marks of every kernel's CTAs, as min / median / max µs after the first CTA's start.
fn report(name: &str, event_ms: f64, kernels: &[Traced<'_>]) -> String {
    let starts = kernels.iter().flat_map(|(_, r, _)| {
        r.chunks_exact(TRACE_WORDS)
            .map(|c| c[0])
            .filter(|&t| t != 0)
    });
    let Some(t0) = starts.min() else {
        return format!("step trace {name}: nothing recorded\n");
    };
    let mut s = format!(
        "step trace {name}: {:.1} µs between events; µs after the first CTA's start, min / \
         median / max over CTAs\n",
        event_ms * 1e3
    );
    for &(kernel, records, marks) in kernels {
        let ctas: Vec<&[u64]> = records
            .chunks_exact(TRACE_WORDS)
            .filter(|c| c[0] != 0)
            .collect();
        s += &format!("  {kernel} ({} CTAs):", ctas.len());
        for &(i, what) in marks {
            debug_assert!(i < TRACE_MARKS, "a mark of the record");
            let mut at: Vec<f64> = ctas
                .iter()
                .filter(|c| c[i] != 0)
                .map(|c| c[i].saturating_sub(t0) as f64 / 1e3)
                .collect();
            if at.is_empty() {
                continue;
            }
            at.sort_by(f64::total_cmp);
            s += &format!(
                " {what} {:.1}/{:.1}/{:.1};",
                at[0],
                at[at.len() / 2],
                at[at.len() - 1]
            );
        }
        // The SM clock over each CTA's marks, and the rounds it counted (the selecting
        // kernel's histogram rounds, the attention's walk).
        let mut mhz: Vec<f64> = ctas
            .iter()
            .filter(|c| c[9] > c[0])
            .map(|c| c[TRACE_MARKS + 1] as f64 * 1e3 / (c[9] - c[0]) as f64)
            .collect();
        let mut rounds: Vec<u64> = ctas.iter().map(|c| c[TRACE_MARKS] >> 20).collect();
        if !mhz.is_empty() {
            mhz.sort_by(f64::total_cmp);
            rounds.sort_unstable();
            s += &format!(
                " clock {:.0} MHz, rounds {}/{};",
                mhz[mhz.len() / 2],
                rounds[rounds.len() / 2],
                rounds[rounds.len() - 1]
            );
        }
        s.push('\n');
    }
    s
}
