//! [`IoKernels`]' side of the hot buffer: the swap-in diff of many rows in one launch, the
//! union of a row's KV heads' selections, the tally of their misses, and the device page table.

use attn_op::cuda::DeviceSelection;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{
    BufRows, DIFF_THREADS, DeviceDiff, DeviceHotBuffers, IoKernels, MAX_DIFF_SELECTION,
    TALLY_THREADS, UNION_SMEM_MAX, UNION_THREADS, device_err, to_i32, to_u32,
};
use crate::OffloadError;

impl IoKernels {
    /// The swap-in of every row at once: `pages` (rows of ascending, unique logical pages, at
    /// most [`MAX_DIFF_SELECTION`] per row), `current` (`[rows]`, the page in each reserved
    /// slot) and `blocks` (`[rows, hot + 1]`, each slot's device block). Updates `buffers` as
    /// [`HotBuffer::diff`](crate::HotBuffer::diff) would, row by row, and rewrites `out` whole;
    /// a row whose selection does not fit is left unchanged and flagged in
    /// [`DeviceDiff::errors`].
    pub fn diff(
        &self,
        buffers: &mut DeviceHotBuffers,
        pages: &DeviceSelection,
        current: &CudaSlice<i32>,
        blocks: &CudaSlice<i32>,
        out: &mut DeviceDiff,
    ) -> Result<(), OffloadError> {
        if pages.rows != buffers.rows {
            return Err(OffloadError::Invalid(format!(
                "a selection of {} rows for {} hot buffers",
                pages.rows, buffers.rows
            )));
        }
        self.launch_diff(buffers, None, pages, current, blocks, out)
    }

    /// [`diff`](Self::diff) of a batch that holds some of `buffers`' rows: selection row `i`
    /// diffs against hot buffer `rows.get(i)`, and `current`, `blocks` and `out` are per
    /// selection row. The hot buffers of other rows are untouched.
    pub fn diff_rows(
        &self,
        buffers: &mut DeviceHotBuffers,
        rows: &BufRows,
        pages: &DeviceSelection,
        current: &CudaSlice<i32>,
        blocks: &CudaSlice<i32>,
        out: &mut DeviceDiff,
    ) -> Result<(), OffloadError> {
        if rows.bufs != buffers.rows || rows.rows.len() != pages.rows {
            return Err(OffloadError::Invalid(format!(
                "a row map of {} rows over {} buffers, for a selection of {} rows over {}",
                rows.rows.len(),
                rows.bufs,
                pages.rows,
                buffers.rows
            )));
        }
        self.launch_diff(buffers, Some(&rows.rows), pages, current, blocks, out)
    }

    fn launch_diff(
        &self,
        buffers: &mut DeviceHotBuffers,
        map: Option<&CudaSlice<i32>>,
        pages: &DeviceSelection,
        current: &CudaSlice<i32>,
        blocks: &CudaSlice<i32>,
        out: &mut DeviceDiff,
    ) -> Result<(), OffloadError> {
        let (rows, hot, sel_max) = (pages.rows, buffers.hot, pages.max_len);
        if current.len() != rows
            || blocks.len() != rows * (hot + 1)
            || out.rows() != rows
            || out.sel_max != sel_max
        {
            return Err(OffloadError::Invalid(format!(
                "diff of {rows} rows of {sel_max}: current {}, blocks {} (want {}), outputs {} \
                 rows of {}",
                current.len(),
                blocks.len(),
                rows * (hot + 1),
                out.rows(),
                out.sel_max
            )));
        }
        if sel_max > MAX_DIFF_SELECTION {
            return Err(OffloadError::Invalid(format!(
                "selections of {sel_max} pages; the device diff takes {MAX_DIFF_SELECTION}"
            )));
        }
        if rows == 0 {
            return Ok(());
        }
        // kernels/offload.cu's dynamic arrays: six of hot slots (one more for the blocks) and
        // two of the selection.
        let smem = (6 * hot + 1 + 2 * sel_max) * 4;
        if smem > self.diff_smem_max {
            return Err(OffloadError::Invalid(format!(
                "a hot buffer of {hot} slots needs {smem} bytes of shared memory per diff CTA; \
                 the device offers {}",
                self.diff_smem_max
            )));
        }
        let (hot_i, sel_i, bufs_i) = (to_i32(hot)?, to_i32(sel_max)?, to_i32(buffers.rows)?);
        let cfg = LaunchConfig {
            grid_dim: (to_u32(rows)?, 1, 1),
            block_dim: (DIFF_THREADS, 1, 1),
            shared_mem_bytes: to_u32(smem)?,
        };
        let null: u64 = 0;
        let mut b = self.stream.launch_builder(&self.diff);
        b.arg(&mut buffers.lru)
            .arg(&mut buffers.slot_page)
            .arg(&hot_i)
            .arg(&pages.ids)
            .arg(&pages.lens)
            .arg(&sel_i)
            .arg(current)
            .arg(blocks)
            .arg(&mut out.slots)
            .arg(&mut out.table)
            .arg(&mut out.miss_pages)
            .arg(&mut out.miss_slots)
            .arg(&mut out.miss_counts)
            .arg(&mut out.hit_counts)
            .arg(&mut out.errors);
        match map {
            Some(m) => b.arg(m),
            None => b.arg(&null),
        };
        b.arg(&bufs_i);
        // SAFETY: the arguments follow `hot_diff` in kernels/offload.cu; the hot buffers hold
        // `[buffers.rows, hot]` and the kernel range-checks each row map entry against that
        // count (a null map is the identity, with as many selection rows as buffers, checked
        // by `diff`); the map's rows are distinct (`BufRows`), so no two CTAs share a buffer;
        // every per-row buffer has the `[rows, sel_max]`, `[rows]` or `[rows, hot + 1]` length
        // checked above, the dynamic shared memory is within the limit set at load, and the
        // selection fits the kernel's hash (sel_max <= MAX_DIFF_SELECTION).
        unsafe { b.launch(cfg) }.map_err(device_err)?;
        Ok(())
    }

    /// The union of per-head selections, the rows a request's one hot buffer diffs (as the
    /// CPU coordinator does): row `r` of `out` gets the ascending, unique pages of rows `r *
    /// heads .. (r + 1) * heads` of `sel`, -1 padded, ids outside `0..max_pages` left out.
    /// `out` must have `sel.rows / heads` rows of at least `heads * sel.max_len` ids.
    pub fn union_heads(
        &self,
        sel: &DeviceSelection,
        heads: usize,
        max_pages: usize,
        out: &mut DeviceSelection,
    ) -> Result<(), OffloadError> {
        let smem = max_pages.div_ceil(32) * 4;
        if heads == 0
            || sel.rows != out.rows * heads
            || out.max_len < heads * sel.max_len
            || smem > UNION_SMEM_MAX
        {
            return Err(OffloadError::Invalid(format!(
                "a union of {} rows of {} ids, {heads} heads a row, into {} rows of {}, over \
                 {max_pages} pages ({smem} bytes of bitmap, at most {UNION_SMEM_MAX})",
                sel.rows, sel.max_len, out.rows, out.max_len
            )));
        }
        if out.rows == 0 {
            return Ok(());
        }
        let ints = [
            to_i32(heads)?,
            to_i32(sel.max_len)?,
            to_i32(max_pages)?,
            to_i32(out.max_len)?,
        ];
        let [heads_i, sel_i, pages_i, out_i] = ints;
        let cfg = LaunchConfig {
            grid_dim: (to_u32(out.rows)?, 1, 1),
            block_dim: (UNION_THREADS, 1, 1),
            shared_mem_bytes: to_u32(smem)?,
        };
        let mut b = self.stream.launch_builder(&self.union_heads);
        b.arg(&sel.ids)
            .arg(&sel.lens)
            .arg(&heads_i)
            .arg(&sel_i)
            .arg(&pages_i)
            .arg(&mut out.ids)
            .arg(&mut out.lens)
            .arg(&out_i);
        // SAFETY: the arguments follow `union_heads` in kernels/offload.cu; `sel` holds
        // `out.rows * heads` rows of `sel.max_len` ids (a `DeviceSelection` checks its sizes),
        // `out` `out.rows` rows of `out.max_len`; the bitmap of `max_pages` bits is the dynamic
        // shared memory given, within the default limit; the kernel skips ids outside it.
        unsafe { b.launch(cfg) }.map_err(device_err)?;
        Ok(())
    }

    /// Adds `diff`'s counts over its rows into entry `at` of `totals` (`[entries, 3]`: hits,
    /// misses, and rows whose selection did not fit), on the device: running totals read
    /// once, instead of the counts after every diff.
    pub fn tally(
        &self,
        diff: &DeviceDiff,
        totals: &mut CudaSlice<u64>,
        at: usize,
    ) -> Result<(), OffloadError> {
        if totals.len() < 3 * (at + 1) {
            return Err(OffloadError::Invalid(format!(
                "entry {at} of diff totals of {} counters",
                totals.len()
            )));
        }
        let rows = diff.rows();
        if rows == 0 {
            return Ok(());
        }
        let (rows_i, at_i) = (to_i32(rows)?, to_i32(at)?);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (TALLY_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(&self.tally_diff);
        b.arg(&diff.hit_counts)
            .arg(&diff.miss_counts)
            .arg(&diff.errors)
            .arg(&rows_i)
            .arg(totals)
            .arg(&at_i);
        // SAFETY: the arguments follow `tally_diff` in kernels/offload.cu; the diff's three
        // count arrays hold `rows` entries each (its allocation), and `totals` at least
        // 3 (at + 1) (checked).
        unsafe { b.launch(cfg) }.map_err(device_err)?;
        Ok(())
    }

    /// The block table of diffed selections: row `r` of `table` (`[rows, max_pages]`) maps
    /// each page of row `r` of `pages` to its device block in `diff` (the diff of `pages`),
    /// every other page to -1.
    pub fn page_table(
        &self,
        pages: &DeviceSelection,
        diff: &DeviceDiff,
        max_pages: usize,
        table: &mut CudaSlice<i32>,
    ) -> Result<(), OffloadError> {
        let rows = pages.rows;
        if diff.rows() != rows || diff.sel_max != pages.max_len || table.len() != rows * max_pages {
            return Err(OffloadError::Invalid(format!(
                "a block table of {} entries for {rows} rows of {max_pages} pages, from a diff of \
                 {} rows of {} (selections of {})",
                table.len(),
                diff.rows(),
                diff.sel_max,
                pages.max_len
            )));
        }
        if rows == 0 || max_pages == 0 {
            return Ok(());
        }
        let (sel_i, pages_i) = (to_i32(pages.max_len)?, to_i32(max_pages)?);
        let cfg = LaunchConfig {
            grid_dim: (to_u32(rows)?, 1, 1),
            block_dim: (UNION_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(&self.page_table);
        b.arg(&pages.ids)
            .arg(&pages.lens)
            .arg(&sel_i)
            .arg(&diff.table)
            .arg(&pages_i)
            .arg(table);
        // SAFETY: the arguments follow `page_table` in kernels/offload.cu; `pages` and the
        // diff's table hold `rows` rows of `sel_max` ids, `table` `rows * max_pages` entries
        // (checked above), and the kernel writes only pages inside `0..max_pages`.
        unsafe { b.launch(cfg) }.map_err(device_err)?;
        Ok(())
    }
}
