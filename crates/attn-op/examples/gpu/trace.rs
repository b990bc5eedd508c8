//! Where the time of one attention launch goes, from the traced kernel's per-CTA timestamps
//! (variant `tct`, kernels/trace.cuh): when the CTAs start, how long each phase takes, and how
//! much of the event-timed launch lies outside every CTA.

use attn_op::cuda::{TRACE_MARKS, TRACE_WORDS};

/// What each phase ends with; phase i runs from mark i to mark i + 1.
const PHASES: [&str; TRACE_MARKS - 1] = [
    "dependent-launch wait",
    "metadata, split length, first list entries",
    "first slots (block table), queries",
    "first K and V",
    "the rest of the walk",
    "warps' states into shared memory",
    "rows combined, partial written",
    "split counted (fence, counter)",
    "merge (the unit's last split only)",
];

/// One CTA's record: its marks in ns (0: not reached), SM, merge flag and rounds.
struct Cta {
    marks: [u64; TRACE_MARKS],
    sm: u32,
    merged: bool,
    rounds: u32,
    cycles: u64,
}

/// A report of one traced launch: `records` from `Gpu::take_attn_trace`, `event_ms` the
/// launch's time between CUDA events around it.
pub(crate) fn report(name: &str, records: &[u64], event_ms: f64) -> String {
    let ctas: Vec<Cta> = records
        .chunks_exact(TRACE_WORDS)
        .filter(|r| r[0] != 0)
        .map(|r| {
            let mut marks = [0; TRACE_MARKS];
            marks.copy_from_slice(&r[..TRACE_MARKS]);
            let info = r[TRACE_MARKS];
            Cta {
                marks,
                sm: (info & 0xffff) as u32,
                merged: (info >> 16) & 1 == 1,
                rounds: (info >> 20) as u32,
                cycles: r[TRACE_MARKS + 1],
            }
        })
        .collect();
    let Some(t0) = ctas.iter().map(|c| c.marks[0]).min() else {
        return format!("trace {name}: no CTA recorded\n");
    };
    let end = ctas
        .iter()
        .map(|c| c.marks[TRACE_MARKS - 1])
        .max()
        .unwrap_or(t0);
    let us = |ns: u64| ns as f64 / 1e3;
    let mut sms: Vec<u32> = ctas.iter().map(|c| c.sm).collect();
    sms.sort_unstable();
    let per_sm = sms
        .chunk_by(|a, b| a == b)
        .map(<[u32]>::len)
        .max()
        .unwrap_or(0);
    sms.dedup();
    let done: Vec<&Cta> = ctas
        .iter()
        .filter(|c| c.marks[TRACE_MARKS - 1] != 0)
        .collect();
    let mut rounds: Vec<f64> = done.iter().map(|c| f64::from(c.rounds)).collect();
    let mut clock: Vec<f64> = done
        .iter()
        .map(|c| c.cycles as f64 / (c.marks[TRACE_MARKS - 1] - c.marks[0]).max(1) as f64)
        .collect();
    let mut s = format!(
        "trace {name}: {} CTAs on {} SMs (at most {per_sm} on one), {} merged; launch {:.1} µs \
         between events, {:.1} µs from the first CTA's start to the last CTA's end; rounds a \
         warp walks: median {:.0}; SM clock {:.2} GHz\n",
        ctas.len(),
        sms.len(),
        done.iter().filter(|c| c.merged).count(),
        event_ms * 1e3,
        us(end - t0),
        quantile(&mut rounds, 0.5),
        quantile(&mut clock, 0.5),
    );
    let mut starts: Vec<f64> = ctas.iter().map(|c| us(c.marks[0] - t0)).collect();
    s += &format!(
        "  CTA start after the first: median {:.2}, p90 {:.2}, max {:.2} µs\n",
        quantile(&mut starts, 0.5),
        quantile(&mut starts, 0.9),
        quantile(&mut starts, 1.0)
    );
    for (i, phase) in PHASES.iter().enumerate() {
        let mut d: Vec<f64> = ctas
            .iter()
            .filter(|c| c.marks[i] != 0 && c.marks[i + 1] != 0)
            .map(|c| us(c.marks[i + 1].saturating_sub(c.marks[i])))
            .collect();
        if d.is_empty() {
            continue;
        }
        let mut at: Vec<f64> = ctas
            .iter()
            .filter(|c| c.marks[i + 1] != 0)
            .map(|c| us(c.marks[i + 1] - t0))
            .collect();
        s += &format!(
            "  {phase:<42} {:>4} CTAs: median {:>6.2}, p90 {:>6.2}, max {:>6.2} µs; ends \
             {:>6.2} .. {:>6.2} µs after the first start\n",
            d.len(),
            quantile(&mut d, 0.5),
            quantile(&mut d, 0.9),
            quantile(&mut d, 1.0),
            quantile(&mut at, 0.0),
            quantile(&mut at, 1.0),
        );
    }
    s
}

/// The `q` quantile (0 = min, 1 = max) of `v`, nearest rank; NaN for an empty slice.
fn quantile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let i = ((v.len() - 1) as f64 * q).round() as usize;
    v[i.min(v.len() - 1)]
}
