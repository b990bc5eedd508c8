//! Vectors seen from their first cache-line boundary.
//!
//! The attention kernels load K and V rows 64 bytes at a time. A heap block from the system
//! allocator starts 16 bytes into a cache line, so every such load of a plain `Vec` would span
//! two lines. [`Aligned`] keeps a vector with a line's worth of spare elements and shows the
//! window that starts on a line; all of it is safe code.

use std::ops::{Deref, DerefMut};

/// Bytes in a cache line: where the window starts.
const LINE: usize = 64;

/// `len` elements of a vector, starting at the first element that sits on a 64-byte boundary.
pub(crate) struct Aligned<T> {
    buf: Vec<T>,
    at: usize,
    len: usize,
}

impl<T: Copy + Default> Aligned<T> {
    /// A window of `len` elements over `make(len + pad)`, where `pad` is a line's worth of
    /// elements (so that the window fits wherever the line boundary falls). `make` must return
    /// a vector of the length it is asked for; zeros through `calloc` stay untouched pages,
    /// and those the window covers in whole 2 MiB pages are backed by huge pages once touched
    /// ([`advise_huge`]).
    pub(crate) fn with(len: usize, make: impl FnOnce(usize) -> Vec<T>) -> Self {
        Self::window(make(len + pad::<T>()), len)
    }

    /// [`Aligned::with`] for an allocation that may fail: `None` where `make` gives none (or
    /// the padded length overflows).
    pub(crate) fn try_with(len: usize, make: impl FnOnce(usize) -> Option<Vec<T>>) -> Option<Self> {
        Some(Self::window(make(len.checked_add(pad::<T>())?)?, len))
    }

    /// The aligned window of `len` elements over a fresh, padded `buf`.
    fn window(buf: Vec<T>, len: usize) -> Self {
        advise_huge(buf.as_ptr(), size_of_val(&*buf));
        let at = skip(&buf);
        debug_assert!(buf.len() >= at + len, "make returns the length asked for");
        Aligned { buf, at, len }
    }

    /// `buf`'s elements, kept in place where it is already aligned (or empty); otherwise moved
    /// up within the same allocation (grown by a line's worth), so a large tensor is never held
    /// twice.
    pub(crate) fn from_vec(mut buf: Vec<T>) -> Self {
        let len = buf.len();
        if len > 0 && skip(&buf) != 0 {
            buf.reserve_exact(pad::<T>());
            let at = skip(&buf);
            buf.resize(len + at, T::default());
            buf.copy_within(0..len, at);
        }
        Aligned {
            at: if len > 0 { skip(&buf) } else { 0 },
            buf,
            len,
        }
    }
}

/// Asks Linux to back `buf`'s allocation (its whole capacity) with transparent huge pages, as
/// [`PagedKv`](crate::PagedKv) does for its tensors: a buffer read from end to end, or in
/// scattered rows, then takes a TLB miss every 2 MiB instead of every 4 KiB. Call it on an
/// empty vector with capacity, before filling it: pages touched before the advice stay small
/// until the kernel's background merger gets to them. A hint only: where huge pages are off,
/// or off Linux, nothing changes.
pub fn advise_huge_pages<T>(buf: &Vec<T>) {
    advise_huge(buf.as_ptr(), buf.capacity() * size_of::<T>());
}

/// Asks Linux to back the whole 2 MiB pages among the `bytes` bytes from `start`, within one
/// allocation (a vector's capacity, initialized or not), with transparent huge pages
/// (`MADV_HUGEPAGE`; by default the kernel does so only where asked). A decode step reads a
/// pool's K/V rows scattered over blocks, and with 4 KiB pages every two token rows cost a TLB
/// miss. Measured on the dev box (interleaved runs of one binary, pools with and without the
/// advice): dense bf16-dot decode B8 L32K 46.1 -> 39.2 ms, best of six. A hint only: pages
/// touched before the call stay small until the kernel's background merger gets to them, and
/// where huge pages are off the call fails and changes nothing.
/// Touching one byte of a huge page makes all 2 MiB of it resident.
fn advise_huge<T>(start: *const T, bytes: usize) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = start as usize;
        let (from, to) = (start.next_multiple_of(HUGE), (start + bytes) / HUGE * HUGE);
        if to > from {
            // SAFETY: `from..to` lies inside the caller's allocation, which outlives the call,
            // and MADV_HUGEPAGE changes only how the kernel backs those pages, never their
            // contents. The result is ignored: the advice is a hint.
            unsafe { libc::madvise(from as *mut libc::c_void, to - from, libc::MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (start, bytes);
}

/// Elements in a cache line: the most a window may start past its vector's first element.
fn pad<T>() -> usize {
    LINE / size_of::<T>().max(1)
}

/// Elements from `buf`'s start to its first 64-byte boundary (0 where it starts on one). A
/// boundary that falls inside an element (not possible for the 2- and 4-byte element types,
/// whose vectors are aligned to their size) rounds down: a slower window, never a wrong one.
fn skip<T>(buf: &[T]) -> usize {
    let over = buf.as_ptr() as usize % LINE;
    if over == 0 {
        0
    } else {
        (LINE - over) / size_of::<T>().max(1)
    }
}

impl<T> Deref for Aligned<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        &self.buf[self.at..self.at + self.len]
    }
}

impl<T> DerefMut for Aligned<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.buf[self.at..self.at + self.len]
    }
}

impl<T: Copy + Default> Clone for Aligned<T> {
    fn clone(&self) -> Self {
        let mut buf = Vec::with_capacity(self.len + pad::<T>());
        // Advised before its pages are touched, as a new tensor's are: a copy of a pool reads
        // as fast as the pool.
        advise_huge_pages(&buf);
        // An empty vector with capacity already has its allocation: its window start is known.
        let at = skip(&buf);
        buf.resize(at, T::default());
        buf.extend_from_slice(self);
        Aligned {
            buf,
            at,
            len: self.len,
        }
    }
}

impl<T: PartialEq> PartialEq for Aligned<T> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for Aligned<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (**self).fmt(f)
    }
}
