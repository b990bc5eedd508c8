//! Helpers that stay between calls: after its last task a helper watches a board for the next
//! call's tasks for a while (the linger, [`set_linger`]) before it gives its rayon worker
//! back, so back-to-back calls (a decode's layers, a bench's iterations) start on threads
//! that are already awake instead of waking them one by one through the pool's sleep.

use std::any::Any;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::time::{Duration, Instant};

use crate::phase::{lock, wait_until};

/// Sets how long a helper thread of the CPU attention waits, spinning, for the next call's
/// work after its last task before it gives its rayon worker back (250 µs unless set).
///
/// Waking a sleeping rayon worker costs the caller a system call, and the worker starts tens
/// of microseconds later; a call that needs 16 threads pays that 15 times before every core
/// reads. Helpers that linger join the next call at once, as OpenMP's spinning threads do.
/// While they linger they keep a core busy, but they run any other job that reaches their
/// rayon pool meanwhile, so the pool's other work does not wait for them. `Duration::ZERO`
/// turns lingering off, and every call then spawns its helpers into the pool anew. The
/// setting is global and takes effect from the next call.
pub fn set_linger(linger: Duration) {
    let ns = u64::try_from(linger.as_nanos()).unwrap_or(u64::MAX);
    LINGER_NS.store(ns, SeqCst);
}

/// The linger of [`set_linger`], in nanoseconds.
static LINGER_NS: AtomicU64 = AtomicU64::new(250_000);

/// Whether helpers linger at all.
pub(crate) fn lingering() -> bool {
    LINGER_NS.load(SeqCst) > 0
}

/// The most tasks one call can publish on the board (the state's task field).
pub(crate) const MAX_TASKS: usize = u16::MAX as usize;

/// Runs `work(t)` for every `t < tasks` on the calling thread and on up to `helpers` lingering
/// helpers, spawning into the current rayon pool those that are missing. Returns `false`
/// without running anything where another call holds the board (a concurrent or nested
/// call) or `tasks` exceeds [`MAX_TASKS`]: the caller then shares the tasks another way.
pub(crate) fn run(tasks: usize, helpers: usize, work: &(dyn Fn(usize) + Sync)) -> bool {
    if tasks > MAX_TASKS
        || BOARD
            .busy
            .compare_exchange(false, true, SeqCst, SeqCst)
            .is_err()
    {
        return false;
    }
    let epoch = ((BOARD.state.load(SeqCst) >> 32) + 1) & 0xffff_ffff;
    BOARD.done.store(0, SeqCst);
    // The helpers read the work through this pointer to a reference on this frame; see
    // `linger` for why it outlives every read.
    let work_ref: &(dyn Fn(usize) + Sync) = work;
    BOARD
        .work
        .store(std::ptr::from_ref(&work_ref).cast_mut().cast(), SeqCst);
    BOARD
        .state
        .store(epoch << 32 | (tasks as u64) << 16, SeqCst);
    let crew = BOARD.crew.load(SeqCst);
    for _ in crew..helpers {
        BOARD.crew.fetch_add(1, SeqCst);
        rayon::spawn(linger);
    }
    // The caller claims tasks until none is left (only the board's holder opens an epoch).
    loop {
        let s = BOARD.state.load(SeqCst);
        if open(s).is_none() {
            break;
        }
        if let Some(t) = claim(s) {
            run_task(work, t);
        }
    }
    // Every task is claimed; no helper reads the work once the count is full.
    wait_until(&BOARD.done, tasks);
    let panic = lock(&BOARD.panic).take();
    BOARD.busy.store(false, SeqCst);
    if let Some(payload) = panic {
        std::panic::resume_unwind(payload);
    }
    true
}

/// The board lingering helpers watch: one published call at a time.
struct Board {
    /// The published call's claims: its epoch in the high 32 bits, its task count in the
    /// next 16 and the next unclaimed task in the low 16.
    state: AtomicU64,
    /// The published call's work: a thin pointer to a `&(dyn Fn(usize) + Sync)` on its
    /// caller's frame.
    work: AtomicPtr<()>,
    /// Tasks of the published call finished (or unwound).
    done: AtomicUsize,
    /// Whether a call holds the board.
    busy: AtomicBool,
    /// Helpers spawned and not yet gone.
    crew: AtomicUsize,
    /// The first panic of the published call's tasks, for its caller to pass on.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

static BOARD: Board = Board {
    state: AtomicU64::new(0),
    work: AtomicPtr::new(std::ptr::null_mut()),
    done: AtomicUsize::new(0),
    busy: AtomicBool::new(false),
    crew: AtomicUsize::new(0),
    panic: Mutex::new(None),
};

/// The next task of state `s`, where the call it describes has one left to claim.
fn open(s: u64) -> Option<usize> {
    let (tasks, next) = ((s >> 16) & 0xffff, s & 0xffff);
    (next < tasks).then_some(next as usize)
}

/// Claims the next task of state `s` for this thread, where the board still holds `s`.
fn claim(s: u64) -> Option<usize> {
    let t = open(s)?;
    BOARD
        .state
        .compare_exchange(s, s + 1, SeqCst, SeqCst)
        .is_ok()
        .then_some(t)
}

/// Runs claimed task `t` and counts it done, keeping the first panic of the call for its
/// caller.
fn run_task(work: &(dyn Fn(usize) + Sync), t: usize) {
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(t)));
    if let Err(payload) = result {
        lock(&BOARD.panic).get_or_insert(payload);
    }
    BOARD.done.fetch_add(1, SeqCst);
}

/// A helper: claims the published call's tasks while there are any, and returns once it has
/// found none for the linger.
fn linger() {
    /// Clears [`WATCHING`] when the helper leaves.
    struct Leave;
    impl Drop for Leave {
        fn drop(&mut self) {
            WATCHING.set(false);
        }
    }
    if WATCHING.replace(true) {
        BOARD.crew.fetch_sub(1, SeqCst);
        return;
    }
    let _leave = Leave;
    let mut idle_since = Instant::now();
    let mut spins = 0u32;
    loop {
        let s = BOARD.state.load(SeqCst);
        if open(s).is_some() {
            let work = BOARD.work.load(SeqCst);
            if let Some(t) = claim(s) {
                // SAFETY: the claim succeeded on the state that `work` was read under, so
                // `work` is its call's: the caller stores the work before the state that
                // opens the epoch, and a later call's work is stored only after this call's
                // caller has seen every task done, which cannot happen before this task
                // counts itself. The epoch is 32 bits wide, so a stale state would have to
                // survive 2^32 calls to be taken for this one. The caller's frame, which
                // holds the reference `work` points to and what it borrows, outlives its
                // wait, so the reference is valid until `run_task` counts the task, and
                // nothing reads it after.
                let work = unsafe { *work.cast::<&(dyn Fn(usize) + Sync)>() };
                run_task(work, t);
                idle_since = Instant::now();
                spins = 0;
            }
            continue;
        }
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(YIELD_SPINS) {
            // Other jobs of the pool run here meanwhile, so they wait for no lingering
            // helper (a helper spawned for a call and run here returns at once: this thread
            // already watches the board).
            if rayon::yield_now() == Some(rayon::Yield::Executed) {
                idle_since = Instant::now();
            } else if idle_since.elapsed() >= Duration::from_nanos(LINGER_NS.load(SeqCst)) {
                BOARD.crew.fetch_sub(1, SeqCst);
                // A call published after its caller counted this helper in the crew would
                // miss it: look once more after leaving the count, and stay if there is work.
                if open(BOARD.state.load(SeqCst)).is_none() {
                    return;
                }
                BOARD.crew.fetch_add(1, SeqCst);
            }
        }
        std::hint::spin_loop();
    }
}

thread_local! {
    /// Whether a helper on this thread watches the board: a helper run by another's
    /// `rayon::yield_now` would otherwise nest one more watcher a call on the same thread.
    static WATCHING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Spins of an idle helper between two looks at the pool's other work and the clock.
const YIELD_SPINS: u32 = 64;
