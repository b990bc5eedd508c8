//! What the chunk kernels ask the level-2 cache for while they compute.

/// The rows a chunk kernel asks the level-2 cache for while it computes, spread over its work:
/// with the work on token `t` of a chunk, `rows[t]` (a row of a later chunk); null or missing
/// entries ask for nothing. A prefetch is a hint that never faults, so any address is sound.
///
/// Measured on the dev box's EPYC (dense bf16 decode B8 L32K): the next chunk asked for head
/// block by head block, in bursts, against nothing: 66 against 103 ms. One row per token of
/// work instead overlaps the loads with the math better (BENCHMARKS.md, session 32). Asking
/// level 1 for the next head's rows as well cost more than it saved (session 33).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ahead<'a> {
    /// Rows of a later chunk, by token of the current chunk (none where `run` alone
    /// describes them).
    rows: &'a [*const u8],
    /// How many rows.
    len: usize,
    /// Bytes of each row.
    bytes: usize,
    /// The first row where the rows lie back to back (one range of lines), else null.
    run: *const u8,
}

impl<'a> Ahead<'a> {
    /// The tokens a step asks for when a kernel walks its work in `steps` steps.
    #[inline(always)]
    pub(crate) fn per_step(steps: usize) -> usize {
        16usize.div_ceil(steps.max(1))
    }

    /// Asks for nothing.
    pub(crate) const NONE: Ahead<'static> = Ahead {
        rows: &[],
        len: 0,
        bytes: 0,
        run: std::ptr::null(),
    };

    /// Asks for `len` rows of `bytes` that lie back to back from `first`, one with the work
    /// on each token.
    pub(crate) fn back_to_back(first: *const u8, len: usize, bytes: usize) -> Self {
        Ahead {
            rows: &[],
            len,
            bytes,
            run: if len == 0 { std::ptr::null() } else { first },
        }
    }

    /// Asks for `rows[t]` (`bytes` from each) with the work on token `t`. Rows whose first
    /// and last lie as far apart as back-to-back rows would (a decode's every head of
    /// consecutive tokens of a page) are taken as one range, so that a step's share is one
    /// loop over its lines; a prefetch is a hint, so a wrong guess costs time, never a result.
    pub(crate) fn new(rows: &'a [*const u8], bytes: usize) -> Self {
        let run = match rows {
            [first, .., last] if first.wrapping_add((rows.len() - 1) * bytes) == *last => *first,
            [only] => *only,
            _ => std::ptr::null(),
        };
        Ahead {
            rows,
            len: rows.len(),
            bytes,
            run,
        }
    }

    /// What the block of rows from `first_row` asks for: the first block of a chunk kernel's
    /// rows asks for everything, the others for nothing (once a chunk is enough).
    #[inline(always)]
    pub(crate) fn for_rows_from(&self, first_row: usize) -> &Ahead<'a> {
        if first_row == 0 { self } else { &Ahead::NONE }
    }

    /// Asks for the rows of tokens `k * per .. (k + 1) * per` of the chunk's 16: a kernel
    /// that walks its work in `steps` steps calls this once a step, with `per` from
    /// [`Ahead::per_step`] (taken once: a division in every step cost more than the rest).
    /// `row_bytes` is the rows' size as the kernel knows it (the `bytes` of [`Ahead::new`]),
    /// a constant where the kernel's head dim and element are: then a whole step's share of
    /// back-to-back rows is a fixed run of prefetches, with no loop to count.
    #[inline(always)]
    pub(crate) fn part(&self, k: usize, per: usize, row_bytes: usize) {
        debug_assert!(self.len == 0 || row_bytes == self.bytes);
        let (lo, hi) = (k * per, ((k + 1) * per).min(self.len));
        if lo >= hi {
            return;
        }
        if !self.run.is_null() {
            let from = self.run.wrapping_add(lo * row_bytes);
            // The same call either way; the first has a length the compiler knows where
            // `per` and `row_bytes` are constants (every step but a short chunk's last).
            if hi - lo == per {
                fetch_lines(from, per * row_bytes);
            } else {
                fetch_lines(from, (hi - lo) * row_bytes);
            }
        } else {
            self.rows[lo..hi]
                .iter()
                .for_each(|&p| fetch_lines(p, row_bytes));
        }
    }
}

/// Asks the CPU to bring the `bytes` bytes from `p` (each 64-byte line) into its level-2
/// cache; nothing for a null `p`.
#[inline(always)]
fn fetch_lines(p: *const u8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    if !p.is_null() {
        use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
        // Plain loops, eight lines a turn, then four: `step_by`'s setup (a rounded-up
        // division) cost more than the prefetches of a row of 4 lines (a bf16 head of 128).
        let line = |o: usize| {
            // SAFETY: a prefetch reads nothing architecturally and never faults, whatever the
            // address (`wrapping_add` keeps the pointer arithmetic defined).
            unsafe { _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(o).cast::<i8>()) };
        };
        let mut o = 0;
        while o + 256 <= bytes {
            (0..4).for_each(|k| line(o + 64 * k));
            o += 256;
        }
        while o < bytes {
            line(o);
            o += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, bytes);
}
