//! [`IoKernels`]' transfers between the pinned host pool and the device pool: the misses
//! loaded zero-copy, and new tokens backed up to the host or scattered into it.

use attn_op::KvCache;
use attn_op::cuda::{CudaElement, DevicePagedKv, Gpu};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{DeviceDiff, IO_WARPS, IoKernels, PinnedHostPool, device_err, to_i32, to_u32};
use crate::{Load, OffloadError};

impl IoKernels {
    /// Loads the misses of `diff` for `layer` from the pinned host pool into the device pool,
    /// zero-copy: row `r`'s missed page `p` comes from host page `host_table[r, p]` (`[rows,
    /// max_pages]`) and goes to device block `blocks[r, slot]` (`[rows, hot + 1]`). Ids out of
    /// range are skipped.
    #[allow(
        clippy::too_many_arguments,
        reason = "a diff's outputs plus where pages live on each side"
    )]
    pub fn load_misses<T: CudaElement>(
        &self,
        host: &PinnedHostPool<T>,
        layer: usize,
        host_table: &CudaSlice<i32>,
        max_pages: usize,
        blocks: &CudaSlice<i32>,
        hot: usize,
        diff: &DeviceDiff,
        device: &mut DevicePagedKv<T>,
    ) -> Result<(), OffloadError> {
        let shape = host.shape;
        let layout = device.layout();
        let rows = diff.miss_counts.len();
        if layout.block_size != shape.page_size
            || layout.kv_heads != shape.kv_heads
            || layout.head_dim != shape.head_dim
            || layer >= shape.layers
        {
            return Err(OffloadError::Invalid(format!(
                "device pool {layout:?} does not match host pages {shape:?} (layer {layer})"
            )));
        }
        let page_bytes = host.page_elems() * size_of::<T>();
        if !page_bytes.is_multiple_of(16)
            || host_table.len() != rows * max_pages
            || blocks.len() != rows * (hot + 1)
        {
            return Err(OffloadError::Invalid(format!(
                "loads of {rows} rows: pages of {page_bytes} bytes (16-byte multiples), host \
                 table {} (want {}), blocks {} (want {})",
                host_table.len(),
                rows * max_pages,
                blocks.len(),
                rows * (hot + 1)
            )));
        }
        if rows == 0 || diff.sel_max == 0 {
            return Ok(());
        }
        let ints = [
            to_i32(layer)?,
            to_i32(shape.pages)?,
            to_i32(page_bytes / 16)?,
            to_i32(max_pages)?,
            to_i32(hot)?,
            to_i32(diff.sel_max)?,
            to_i32(layout.num_blocks)?,
        ];
        let [
            layer_i,
            pages_i,
            vecs_i,
            max_pages_i,
            hot_i,
            sel_i,
            blocks_i,
        ] = ints;
        let (hk, hv) = host.ptrs;
        let cfg = LaunchConfig {
            grid_dim: (
                to_u32((2 * diff.sel_max).div_ceil(IO_WARPS))?,
                to_u32(rows)?,
                1,
            ),
            block_dim: (to_u32(IO_WARPS * 32)?, 1, 1),
            shared_mem_bytes: 0,
        };
        let (k, v) = device.tensors_mut();
        let mut b = self.stream.launch_builder(&self.load_misses);
        b.arg(&hk)
            .arg(&hv)
            .arg(&layer_i)
            .arg(&pages_i)
            .arg(&vecs_i)
            .arg(host_table)
            .arg(&max_pages_i)
            .arg(blocks)
            .arg(&hot_i)
            .arg(&diff.miss_pages)
            .arg(&diff.miss_slots)
            .arg(&diff.miss_counts)
            .arg(&sel_i)
            .arg(k)
            .arg(v)
            .arg(&blocks_i);
        // SAFETY: the arguments follow `load_misses` in kernels/offload.cu. The host pointers
        // are pinned allocations of `layers * pages * page` elements (UVA makes them valid in
        // kernels), freed only after the pool's stream (this one) has drained; the kernel
        // range-checks every page, slot, host page and block id before it addresses memory.
        unsafe { b.launch(cfg) }.map_err(device_err)?;
        Ok(())
    }

    /// Executes `loads` as [`execute_loads`](crate::execute_loads) does on the CPU: each
    /// load's tokens of one host page go from the pinned pool into the same offsets of a
    /// device block (a reserved slot's refresh, say), all in one launch for K and one for V.
    pub fn execute_loads<T: CudaElement>(
        &self,
        gpu: &Gpu,
        host: &PinnedHostPool<T>,
        loads: &[Load],
        device: &mut DevicePagedKv<T>,
    ) -> Result<(), OffloadError> {
        let shape = host.shape;
        let layout = device.layout();
        crate::exec::check_loads(shape, layout, loads)?;
        let ps = shape.page_size;
        let (mut src, mut dst) = (Vec::new(), Vec::new());
        for l in loads {
            let (page, block) = (l.host_page as usize, l.device_block as usize);
            let first = l.first as usize;
            for t in first..first + l.tokens as usize {
                src.push(to_i32((l.layer * shape.pages + page) * ps + t)?);
                dst.push(to_i32(block * ps + t)?);
            }
        }
        if src.is_empty() {
            return Ok(());
        }
        let row_bytes = shape.kv_heads * shape.head_dim * size_of::<T>();
        let src_rows = shape.layers * shape.pages * ps;
        let dst_rows = layout.num_blocks * ps;
        let (src_idx, dst_idx) = (gpu.upload(&src)?, gpu.upload(&dst)?);
        let (hk, hv) = host.ptrs;
        let stream = self.stream.clone();
        let (dk, dv) = device.tensors_mut();
        for (from, to) in [(hk, dk), (hv, dv)] {
            let (to, _guard) = to.device_ptr_mut(&stream);
            // SAFETY: `from` is the pinned pool's K or V (`src_rows` rows of `row_bytes`,
            // 16-byte aligned allocations; the pool outlives the launch, as it drains its
            // stream before freeing), `to` the device tensor of `dst_rows` rows, kept borrowed
            // (and its use recorded by the guard) until the launch is enqueued; every index was
            // range-checked above.
            unsafe {
                self.copy_rows(from, src_rows, to, dst_rows, &src_idx, &dst_idx, row_bytes)?;
            }
        }
        Ok(())
    }

    /// The device-to-host backup of new tokens: token row `src_idx[i]` of `k` and `v` (`[tokens,
    /// kv_heads, head_dim]` on the device) goes to row `dst_idx[i]` (`host_page * page_size +
    /// offset`) of `layer` in the pinned pool, K and V in one launch each. Indices out of
    /// range are skipped; the rows are written when the stream reaches the copy.
    #[allow(
        clippy::too_many_arguments,
        reason = "both tensors, both index lists and where they go"
    )]
    pub fn backup_tokens<T: CudaElement>(
        &self,
        k: &CudaSlice<T>,
        v: &CudaSlice<T>,
        src_idx: &CudaSlice<i32>,
        host: &PinnedHostPool<T>,
        layer: usize,
        dst_idx: &CudaSlice<i32>,
    ) -> Result<(), OffloadError> {
        let shape = host.shape;
        let row = shape.kv_heads * shape.head_dim;
        if layer >= shape.layers || k.len() != v.len() || !k.len().is_multiple_of(row) {
            return Err(OffloadError::Invalid(format!(
                "a backup of K and V of {} and {} elements into layer {layer} of {shape:?}",
                k.len(),
                v.len()
            )));
        }
        let layer_rows = shape.pages * shape.page_size;
        let row_bytes = row * size_of::<T>();
        let offset = (layer * layer_rows * row_bytes) as u64;
        let (hk, hv) = host.ptrs;
        for (from, to) in [(k, hk), (v, hv)] {
            let (from, _guard) = from.device_ptr(&self.stream);
            // SAFETY: `from` is a device tensor of `k.len() / row` rows, kept borrowed (its use
            // recorded by the guard) until the launch is enqueued; `to + offset` is layer
            // `layer` of the pinned pool (`layer_rows` rows, inside the allocation as `layer <
            // layers`), which outlives the launch as it drains its stream before it is freed.
            unsafe {
                self.copy_rows(
                    from,
                    k.len() / row,
                    to + offset,
                    layer_rows,
                    src_idx,
                    dst_idx,
                    row_bytes,
                )?;
            }
        }
        Ok(())
    }

    /// Writes token rows of `k` and `v` (`[tokens, kv_heads, head_dim]` on the device) into
    /// slots of a device pool: row `src_idx[i]` goes to flat slot `dst_slots[i]` (`block *
    /// block_size + offset`), K and V in one launch each, without the host. Indices out of
    /// range are skipped.
    pub fn scatter_tokens<T: CudaElement>(
        &self,
        k: &CudaSlice<T>,
        v: &CudaSlice<T>,
        src_idx: &CudaSlice<i32>,
        device: &mut DevicePagedKv<T>,
        dst_slots: &CudaSlice<i32>,
    ) -> Result<(), OffloadError> {
        let layout = device.layout();
        let row = layout.kv_heads * layout.head_dim;
        if k.len() != v.len() || !k.len().is_multiple_of(row) {
            return Err(OffloadError::Invalid(format!(
                "K and V of {} and {} elements for a pool of {layout:?}",
                k.len(),
                v.len()
            )));
        }
        let slots = layout.num_blocks * layout.block_size;
        let (dk, dv) = device.tensors_mut();
        for (from, to) in [(k, dk), (v, dv)] {
            let (from, _g1) = from.device_ptr(&self.stream);
            let (to, _g2) = to.device_ptr_mut(&self.stream);
            // SAFETY: both are device tensors (`k.len() / row` and `slots` rows of `row`
            // elements), kept borrowed with their use recorded by the guards until the launch
            // is enqueued; they are distinct allocations (one borrowed shared, one mutably).
            unsafe {
                self.copy_rows(
                    from,
                    k.len() / row,
                    to,
                    slots,
                    src_idx,
                    dst_slots,
                    row * size_of::<T>(),
                )?;
            }
        }
        Ok(())
    }

    /// Copies rows of `row_bytes` (a multiple of 16) by index: row `i` goes from
    /// `src[src_idx[i]]` to `dst[dst_idx[i]]`. Either side may be pinned host memory (loads of
    /// token rows, backups of new tokens) or device memory, as raw addresses with their row
    /// counts; indices out of range are skipped.
    ///
    /// # Safety
    ///
    /// `src` and `dst` must address at least `src_rows` and `dst_rows` rows of `row_bytes`,
    /// 16-byte aligned, readable (src) and writable (dst) by the device until the stream has
    /// run the copy.
    #[allow(clippy::too_many_arguments, reason = "two sides, each with its rows")]
    pub unsafe fn copy_rows(
        &self,
        src: u64,
        src_rows: usize,
        dst: u64,
        dst_rows: usize,
        src_idx: &CudaSlice<i32>,
        dst_idx: &CudaSlice<i32>,
        row_bytes: usize,
    ) -> Result<(), OffloadError> {
        let n = src_idx.len();
        if dst_idx.len() != n || row_bytes == 0 || !row_bytes.is_multiple_of(16) {
            return Err(OffloadError::Invalid(format!(
                "copy of {n} rows into {} destinations, rows of {row_bytes} bytes (16-byte \
                 multiples)",
                dst_idx.len()
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let ints = [
            to_i32(n)?,
            to_i32(row_bytes / 16)?,
            to_i32(src_rows)?,
            to_i32(dst_rows)?,
        ];
        let [n_i, vecs_i, src_i, dst_i] = ints;
        let cfg = LaunchConfig {
            grid_dim: (to_u32(n.div_ceil(IO_WARPS))?, 1, 1),
            block_dim: (to_u32(IO_WARPS * 32)?, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(&self.copy_rows);
        b.arg(&src)
            .arg(&dst)
            .arg(src_idx)
            .arg(dst_idx)
            .arg(&n_i)
            .arg(&vecs_i)
            .arg(&src_i)
            .arg(&dst_i);
        // SAFETY: the arguments follow `copy_rows` in kernels/offload.cu; the caller guarantees
        // the two sides (this function's contract) and the kernel skips indices out of range.
        unsafe { b.launch(cfg) }.map_err(device_err)?;
        Ok(())
    }
}
