//! Lanes: one batch split over forks of the model ([`GpuModel::fork`]), each half decoded by
//! its own thread on its own stream, so the device can overlap one lane's host loads with the
//! other's GEMMs and attention. The weights are shared; each lane has its own buffers, KV
//! cache or coordinator, and host pool.

use std::sync::{Condvar, Mutex};

use engine::gpu::GpuModel;
use half::bf16;

use crate::Res;

/// Lanes a lane run splits its batch over.
pub(crate) const LANES: usize = 2;

/// Lane `lane`'s requests of a batch of `batch` split over [`LANES`] (the first lanes take
/// one more where it does not divide).
pub(crate) fn share(batch: usize, lane: usize) -> usize {
    batch / LANES + usize::from(lane < batch % LANES)
}

/// A barrier for the lanes' threads that a failing lane breaks: the others get an error
/// instead of waiting forever.
pub(crate) struct Meet {
    /// Meetings completed, lanes arrived at the current one, whether a lane failed.
    state: Mutex<(usize, usize, bool)>,
    cv: Condvar,
}

impl Meet {
    fn new() -> Meet {
        Meet {
            state: Mutex::new((0, 0, false)),
            cv: Condvar::new(),
        }
    }

    /// Waits until every lane has arrived; an error once a lane has failed.
    pub(crate) fn wait(&self) -> Res<()> {
        let broken = || "another lane failed".to_owned();
        let mut g = self.state.lock().map_err(|_| broken())?;
        let meeting = g.0;
        g.1 += 1;
        if g.1 == LANES {
            g.0 += 1;
            g.1 = 0;
            self.cv.notify_all();
        }
        while g.0 == meeting && !g.2 {
            g = self.cv.wait(g).map_err(|_| broken())?;
        }
        if g.2 { Err(broken()) } else { Ok(()) }
    }

    /// Marks a lane failed and wakes the others.
    fn fail(&self) {
        if let Ok(mut g) = self.state.lock() {
            g.2 = true;
        }
        self.cv.notify_all();
    }
}

/// Runs `work(lane, model, meet)` for every lane at once, each on its own thread with its own
/// fork of `gm`; returns the lanes' results in lane order, or the first error.
pub(crate) fn run<R: Send>(
    gm: &GpuModel<bf16>,
    work: impl Fn(usize, &GpuModel<bf16>, &Meet) -> Res<R> + Sync,
) -> Res<Vec<R>> {
    let ctx = gm.gpu().context();
    let tracking = ctx.is_event_tracking();
    // SAFETY: the lanes share only the weights, which `GpuModel::fork` waits for before a
    // lane's stream can read them; every other buffer a lane allocates and uses on its own
    // stream. With tracking on, cudarc would record and wait on events for every argument of
    // every launch of both threads (a driver call each). (`engine::gpu::open_gpu` has it off
    // already.)
    unsafe { ctx.disable_event_tracking() };
    let meet = Meet::new();
    let (work, meet_ref) = (&work, &meet);
    let out = std::thread::scope(|s| {
        let lanes: Vec<_> = (0..LANES)
            .map(|lane| {
                s.spawn(move || {
                    let r = gm
                        .gpu()
                        .fork()
                        .map_err(|e| e.to_string())
                        .and_then(|g| gm.fork(g).map_err(|e| e.to_string()))
                        .and_then(|model| work(lane, &model, meet_ref));
                    if r.is_err() {
                        meet_ref.fail();
                    }
                    r
                })
            })
            .collect();
        lanes
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a lane panicked".to_owned()))
            })
            .collect::<Res<Vec<R>>>()
    });
    if tracking {
        // SAFETY: the lanes' streams are gone with their threads; tracking is as it was.
        unsafe { ctx.enable_event_tracking() };
    }
    out
}
