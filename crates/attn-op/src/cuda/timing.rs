//! Timing device work with CUDA events, the way every GPU benchmark of the workspace does.

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream};

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
        let elapsed =
            |a: &CudaEvent, b: &CudaEvent| a.elapsed_ms(b).map(f64::from).map_err(AttnError::from);
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

/// Device time of a sequence of stages on one stream, split by label with CUDA events: each
/// [`mark`](Self::mark) closes the stage that began at the previous mark and gives its time to
/// a label, so a forward marked at every stage boundary sums, per label, to the device time
/// between its first and last mark. Events are reused from one [`take`](Self::take) to the next.
pub struct StageClock {
    stream: Arc<CudaStream>,
    /// Events recorded so far (the first `used`) and spare ones.
    events: Vec<CudaEvent>,
    used: usize,
    /// Per recorded event after the first, the label of the stage it closes.
    labels: Vec<&'static str>,
}

impl StageClock {
    /// A clock on `gpu`'s stream.
    pub fn new(gpu: &Gpu) -> Self {
        StageClock {
            stream: gpu.stream().clone(),
            events: Vec::new(),
            used: 0,
            labels: Vec::new(),
        }
    }

    /// Ends the stage in progress and gives its device time to `label`; the first mark after
    /// [`new`](Self::new) or [`take`](Self::take) only starts the clock.
    pub fn mark(&mut self, label: &'static str) -> Result<(), AttnError> {
        if self.used == self.events.len() {
            let e = self
                .stream
                .context()
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            self.events.push(e);
        }
        self.events[self.used].record(&self.stream)?;
        if self.used > 0 {
            self.labels.push(label);
        }
        self.used += 1;
        Ok(())
    }

    /// Waits for the stream and answers the milliseconds of each label, in the order labels
    /// first closed a stage; the clock starts over.
    pub fn take(&mut self) -> Result<Vec<(&'static str, f64)>, AttnError> {
        let mut sums: Vec<(&'static str, f64)> = Vec::new();
        if self.used > 1 {
            self.events[self.used - 1].synchronize()?;
        }
        for (i, &label) in self.labels.iter().enumerate() {
            let ms = f64::from(self.events[i].elapsed_ms(&self.events[i + 1])?);
            match sums.iter_mut().find(|(l, _)| *l == label) {
                Some((_, t)) => *t += ms,
                None => sums.push((label, ms)),
            }
        }
        self.used = 0;
        self.labels.clear();
        Ok(sums)
    }
}

/// The median of a non-empty list (the upper one of an even count).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
