//! Timing device work with CUDA events, the way every GPU benchmark of the workspace does.

use cudarc::driver::sys::CUevent_flags;

use super::Gpu;
use crate::AttnError;

/// Medians of one operation, in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timing {
    /// Each run alone: events around it, then a wait for it. This includes the host's launch
    /// work, which the device waits for.
    pub synced: f64,
    /// Runs enqueued back to back with an event between each two, as an engine enqueues one
    /// layer after another: the host's launch work overlaps the device's.
    pub queued: f64,
}

impl Gpu {
    /// Times `f` (which enqueues work on this GPU's stream): 5 warm-up runs, then `runs` runs
    /// synced and `runs` runs queued (see [`Timing`]); medians. `runs` 0 counts as 1.
    pub fn time<E: From<AttnError>>(
        &self,
        runs: usize,
        mut f: impl FnMut() -> Result<(), E>,
    ) -> Result<Timing, E> {
        let runs = runs.max(1);
        for _ in 0..5 {
            f()?;
        }
        let ctx = self.context();
        let stream = self.stream();
        let event = || {
            ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(AttnError::from)
        };
        let elapsed = |a: &cudarc::driver::CudaEvent, b: &cudarc::driver::CudaEvent| {
            a.elapsed_ms(b).map(f64::from).map_err(AttnError::from)
        };
        let mut synced = Vec::with_capacity(runs);
        for _ in 0..runs {
            let (a, b) = (event()?, event()?);
            a.record(stream).map_err(AttnError::from)?;
            f()?;
            b.record(stream).map_err(AttnError::from)?;
            b.synchronize().map_err(AttnError::from)?;
            synced.push(elapsed(&a, &b)?);
        }
        let marks = (0..=runs).map(|_| event()).collect::<Result<Vec<_>, _>>()?;
        marks[0].record(stream).map_err(AttnError::from)?;
        for m in &marks[1..] {
            f()?;
            m.record(stream).map_err(AttnError::from)?;
        }
        self.synchronize()?;
        let mut queued = marks
            .windows(2)
            .map(|w| elapsed(&w[0], &w[1]))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Timing {
            synced: median(&mut synced),
            queued: median(&mut queued),
        })
    }
}

/// The median of a non-empty list (the upper one of an even count).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
