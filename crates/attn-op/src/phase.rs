//! The parallel phase of a call: [`share`] runs its tasks on the calling thread and the rayon
//! pool, and a job's [`Tree`] merges its units' partial results as they arrive, in a fixed
//! order that no thread's timing changes.

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::crew;
use crate::kernel::Partial;

/// A job's merge tree: its `n` partials merged pairwise in a fixed binary tree over the unit
/// order (a heap of `2 * m` nodes, `m = n.next_power_of_two()`, leaf `k` at node `m + k`; a
/// node whose right half holds no unit passes its left up unmerged). The shape reads `n`
/// alone, so the bits never depend on which thread finishes first, and the merges of a long
/// list run side by side: the last unit to end waits on `log2 m` merges instead of up to
/// `n - 1` in a row.
pub(crate) struct Tree {
    /// Leaves: the tree's `m`.
    leaves: usize,
    /// Units: the tree's `n`.
    units: usize,
    /// Partials waiting at a node for their sibling, by heap index.
    slots: Vec<Mutex<Option<Partial>>>,
    /// Children arrived at each inner node, by heap index.
    arrived: Vec<AtomicU8>,
    /// Whether the whole has reached the root and been finished.
    finished: AtomicBool,
}

impl Tree {
    pub(crate) fn new(units: usize) -> Self {
        let leaves = units.max(1).next_power_of_two();
        Tree {
            leaves,
            units,
            slots: (0..2 * leaves).map(|_| Mutex::new(None)).collect(),
            arrived: (0..leaves).map(|_| AtomicU8::new(0)).collect(),
            finished: AtomicBool::new(false),
        }
    }

    /// The first unit under node `h`.
    fn first_unit(&self, h: usize) -> usize {
        let shift = self.leaves.trailing_zeros() - h.ilog2();
        (h << shift) - self.leaves
    }

    /// Takes unit `k`'s partial up the tree: at each node with a sibling, the first of the two
    /// to arrive leaves its partial there, and the second merges the pair (the right into the
    /// left) and climbs on with it, so every call adds the same pairs whoever arrives first.
    /// Whoever reaches the root hands the whole to `finish`, on its own thread.
    pub(crate) fn arrive(
        &self,
        k: usize,
        part: Partial,
        d: usize,
        isa: u8,
        finish: impl FnOnce(Partial),
    ) {
        let mut h = self.leaves + k;
        let mut acc = part;
        while h > 1 {
            let sibling = h ^ 1;
            if sibling > h && self.first_unit(sibling) >= self.units {
                h /= 2;
                continue;
            }
            // The partial is stored before the arrival is counted, so the second arrival
            // finds the first's.
            *lock(&self.slots[h]) = Some(acc);
            if self.arrived[h / 2].fetch_add(1, Ordering::AcqRel) == 0 {
                return;
            }
            let mine = lock(&self.slots[h]).take();
            let theirs = lock(&self.slots[sibling]).take();
            let (Some(mine), Some(theirs)) = (mine, theirs) else {
                unreachable!("invariant: both children stored their partials before arriving")
            };
            let (mut left, right) = if h.is_multiple_of(2) {
                (mine, theirs)
            } else {
                (theirs, mine)
            };
            left.merge(&right, d, isa);
            acc = left;
            h /= 2;
        }
        finish(acc);
        self.finished.store(true, Ordering::Release);
    }

    /// Whether every unit has arrived and the whole has been finished.
    pub(crate) fn finished(&self) -> bool {
        self.finished.load(Ordering::Acquire)
    }
}

/// How finely [`guided`] cuts the units still left into tasks: each task takes about `1 /
/// (TASK_SHARE * threads)` of the work left.
const TASK_SHARE: usize = 2;

/// Where consecutive units of work `sizes` (chunks each) are cut into tasks for `threads`
/// threads (guided self-scheduling): ascending unit indices from 0 to `sizes.len()`. Each
/// task takes one unit, and more while it holds no more than `1 / (TASK_SHARE * threads)` of
/// the work not yet cut, so the first tasks are long (few cold starts) and the last ones
/// short (an even end).
pub(crate) fn guided(sizes: &[usize], threads: usize) -> Vec<usize> {
    let mut left: usize = sizes.iter().sum();
    let mut starts = vec![0];
    let mut i = 0;
    while i < sizes.len() {
        let target = left / (TASK_SHARE * threads.max(1));
        let mut taken = sizes[i];
        i += 1;
        while i < sizes.len() && taken + sizes[i] <= target {
            taken += sizes[i];
            i += 1;
        }
        left -= taken;
        starts.push(i);
    }
    starts
}

/// Runs `work(t)` once for every task `t < tasks`: on the calling thread and on up to one
/// fewer rayon workers than the pool has, each claiming the next task until none is left.
///
/// The caller takes part and waits by spinning instead of sleeping: a caller from outside
/// the pool that blocks (as rayon's parallel iterators make it) sleeps while the workers take
/// every core, and wakes tens of microseconds after the last task, and a binary tree of joins
/// passes the end up through a wake at each level. Measured on 16 cores of an Intel Xeon
/// (criterion, bf16 decode B1 4K tokens, two runs each): 255 and 270 µs through a parallel
/// iterator, 222 and 233 µs here with folds that no thread waited on (session 54). Which
/// thread runs a task changes no result.
///
/// Where helpers linger ([`crate::set_linger`]), the call goes through their board
/// (`crew::run`), which wakes no worker that is still watching it; a call that finds the
/// board taken (a concurrent or nested one) spawns its helpers into a scope as below.
pub(crate) fn share(tasks: usize, work: impl Fn(usize) + Sync) {
    /// Counts a claimed task as done even when its work unwinds, so the wait below ends and
    /// the scope passes the panic on.
    struct Done<'a>(&'a AtomicUsize);
    impl Drop for Done<'_> {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::Release);
        }
    }
    let helpers = rayon::current_num_threads().min(tasks).saturating_sub(1);
    if helpers == 0 {
        (0..tasks).for_each(work);
        return;
    }
    if crew::lingering() && crew::run(tasks, helpers, &work) {
        return;
    }
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let run = || {
        loop {
            let t = next.fetch_add(1, Ordering::Relaxed);
            if t >= tasks {
                return;
            }
            let _done = Done(&done);
            work(t);
        }
    };
    rayon::in_place_scope(|s| {
        for _ in 0..helpers {
            s.spawn(|_| run());
        }
        run();
        wait_until(&done, tasks);
    });
}

/// Waits until `count` reaches `n`, spinning first, then giving the core away: the wait of a
/// caller whose tasks are all claimed for those still running elsewhere (one at most a thread).
pub(crate) fn wait_until(count: &AtomicUsize, n: usize) {
    let mut spins = 0u32;
    while count.load(Ordering::Acquire) < n {
        if spins < WAIT_SPINS {
            spins += 1;
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

/// Spins before [`wait_until`] yields its core.
const WAIT_SPINS: u32 = 1 << 10;

/// Locks a tree node's slot, a job's output rows or the lingering helpers' panic slot. Nothing
/// panics while one is held (the locks only guard moves in and out, and copies between rows of
/// one length; merges run outside them), so a poisoned lock cannot hide a half-written value.
pub(crate) fn lock<T>(slot: &Mutex<T>) -> MutexGuard<'_, T> {
    slot.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::{TASK_SHARE, Tree, guided, lock, share};
    use crate::kernel::Partial;
    use crate::simd;

    /// Head dim of the test partials.
    const D: usize = 16;

    /// A partial of `rows` rows with values from `seed` (never zeros; some rows with a
    /// maximum of minus infinity, as a unit whose tokens are all masked has).
    fn partial(rows: usize, seed: u64) -> Partial {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        let mut p = Partial::empty(rows, D);
        for r in 0..rows {
            if next() < -0.4 {
                continue;
            }
            p.m[r] = 4.0 * next();
            p.l[r] = 1.0 + next();
            for v in &mut p.acc[r * D..(r + 1) * D] {
                *v = next();
            }
        }
        p
    }

    /// The tree's expression for leaves `lo..hi` (a power-of-two span) over `parts`: the left
    /// half merged with the right one where the right holds a unit.
    fn expected(parts: &[Partial], lo: usize, hi: usize, isa: u8) -> Option<Partial> {
        if lo >= parts.len() {
            return None;
        }
        if hi - lo == 1 {
            return Some(parts[lo].clone());
        }
        let mid = lo + (hi - lo) / 2;
        let mut left = expected(parts, lo, mid, isa)?;
        if let Some(right) = expected(parts, mid, hi, isa) {
            left.merge(&right, D, isa);
        }
        Some(left)
    }

    fn same(a: &Partial, b: &Partial) -> bool {
        let bits = |p: &Partial| {
            p.acc
                .iter()
                .chain(&p.m)
                .chain(&p.l)
                .map(|x| x.to_bits())
                .collect::<Vec<_>>()
        };
        bits(a) == bits(b)
    }

    #[test]
    fn the_tree_merges_alike_in_any_arrival_order() {
        let isa = simd::resolve(crate::Simd::Auto);
        for n in 1usize..=13 {
            let parts: Vec<Partial> = (0..n).map(|k| partial(3, (n * 100 + k) as u64)).collect();
            let want = expected(&parts, 0, n.next_power_of_two(), isa)
                .expect("invariant: n >= 1 units give a result");
            // Arrival orders: in order, reversed, and interleaved from both ends.
            let interleaved: Vec<usize> = (0..n)
                .map(|i| if i % 2 == 0 { i / 2 } else { n - 1 - i / 2 })
                .collect();
            for order in [(0..n).collect(), (0..n).rev().collect(), interleaved] {
                let tree = Tree::new(n);
                let root = Mutex::new(None);
                for &k in &order {
                    assert!(
                        !tree.finished(),
                        "n = {n}: finished before unit {k} arrived"
                    );
                    tree.arrive(k, parts[k].clone(), D, isa, |whole| {
                        *lock(&root) = Some(whole);
                    });
                }
                assert!(tree.finished(), "n = {n}: every unit arrived");
                let got = lock(&root)
                    .take()
                    .expect("every unit arrived, so the root was finished");
                assert!(same(&got, &want), "n = {n}, arrival order {order:?}");
            }
        }
    }

    #[test]
    fn guided_tasks_cover_every_unit_once_and_shrink_to_one_unit() {
        let check = |sizes: &[usize], threads: usize| {
            let starts = guided(sizes, threads);
            let case = format!("sizes {sizes:?}, {threads} threads: {starts:?}");
            assert_eq!(starts.first(), Some(&0), "{case}");
            assert_eq!(starts.last(), Some(&sizes.len()), "{case}");
            let mut left: usize = sizes.iter().sum();
            for w in starts.windows(2) {
                assert!(w[0] < w[1], "every task holds a unit: {case}");
                let work: usize = sizes[w[0]..w[1]].iter().sum();
                let share = left / (TASK_SHARE * threads.max(1));
                assert!(w[1] - w[0] == 1 || work <= share, "{case}");
                left -= work;
            }
            if sizes.len() > 1 {
                let last = &starts[starts.len() - 2..];
                assert_eq!(last[1] - last[0], 1, "the last task is one unit: {case}");
            }
            starts
        };
        // 40 units of 1 on one thread: half of what is left each time.
        let want = [0, 20, 30, 35, 37, 38, 39, 40];
        assert_eq!(check(&[1; 40], 1), want);
        // The decode bench's B8 4K tokens on 16 threads, 128 units of 16 chunks: tasks of four
        // units, then of three, two and one.
        let b8 = check(&[16; 128], 16);
        assert_eq!(&b8[..3], &[0, 4, 7], "{b8:?}");
        assert_eq!(b8[b8.len() - 2..], [127, 128], "{b8:?}");
        for (sizes, threads) in [
            (vec![], 4),
            (vec![0], 1),
            (vec![0, 0, 5], 2),
            (vec![64, 1, 1, 64, 3], 3),
            (vec![7; 33], 0),
        ] {
            check(&sizes, threads);
        }
    }

    #[test]
    fn share_runs_each_task_once_inside_and_outside_a_pool() {
        for threads in [1, 2, 3, 8] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("a pool");
            for tasks in [0, 1, 2, 7, 64] {
                let runs: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
                let count = |t: usize| {
                    runs[t].fetch_add(1, Ordering::Relaxed);
                };
                pool.install(|| share(tasks, count));
                share(tasks, count);
                for (t, r) in runs.iter().enumerate() {
                    assert_eq!(
                        r.load(Ordering::Relaxed),
                        2,
                        "task {t} of {tasks}, {threads} threads"
                    );
                }
            }
        }
    }

    #[test]
    fn concurrent_and_nested_calls_run_each_task_once() {
        // Four callers at once: one holds the lingering helpers' board, the others share
        // through scopes. Each task of theirs starts a call of its own, nested in the first.
        let outer = 12;
        let inner = 5;
        let runs: Vec<AtomicUsize> = (0..4 * outer * inner)
            .map(|_| AtomicUsize::new(0))
            .collect();
        std::thread::scope(|s| {
            for caller in 0..4 {
                let runs = &runs;
                s.spawn(move || {
                    share(outer, |t| {
                        share(inner, |u| {
                            runs[(caller * outer + t) * inner + u].fetch_add(1, Ordering::Relaxed);
                        });
                    });
                });
            }
        });
        for (i, r) in runs.iter().enumerate() {
            assert_eq!(r.load(Ordering::Relaxed), 1, "task {i}");
        }
    }

    #[test]
    fn a_panicking_task_reaches_the_caller_instead_of_hanging() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(4)
            .build()
            .expect("a pool");
        for inside in [false, true] {
            let runs: Vec<AtomicUsize> = (0..32).map(|_| AtomicUsize::new(0)).collect();
            let failing = |t: usize| {
                runs[t].fetch_add(1, Ordering::Relaxed);
                assert!(t != 5, "task 5 fails on purpose");
            };
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                if inside {
                    pool.install(|| share(32, failing));
                } else {
                    share(32, failing);
                }
            }));
            assert!(result.is_err(), "the task's panic reaches the caller");
            assert_eq!(runs[5].load(Ordering::Relaxed), 1, "task 5 ran");
            assert!(
                runs.iter().all(|r| r.load(Ordering::Relaxed) <= 1),
                "no task ran twice"
            );
        }
    }
}
