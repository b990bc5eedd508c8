//! The CUDA backend of offload (feature `cuda`): the hot-buffer diff and the zero-copy IO on the
//! device, with the same contracts as [`HotBuffer::diff`](crate::HotBuffer::diff) and
//! [`execute_loads`](crate::execute_loads).
//!
//! [`IoKernels`] compiles `kernels/offload.cu` once for a [`Gpu`] and runs on its stream.
//! [`PinnedHostPool`] is the host KV pool in pinned memory (allocated without write-combining,
//! so the CPU reads it at full speed), which kernels read and write directly.
//! [`DeviceHotBuffers`] holds the hot buffers of many (request, layer) rows on the device, and
//! [`IoKernels::diff`] runs the swap-in for all of them in one launch. Its misses feed
//! [`IoKernels::load_misses`] without a round trip to the host.

use std::ffi::c_void;
use std::sync::Arc;

use attn_op::cuda::{CudaElement, DevicePagedKv, DeviceSelection, Gpu, compile_source};
use attn_op::{AttnError, KvCache};
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PinnedHostSlice,
    PushKernelArg,
};

use crate::{HostLayout, HostPool, HostShape, HostStore, HotBuffer, Load, OffloadError};

/// The CUDA C source of offload's kernels (`kernels/common.cuh`, then
/// `kernels/offload.cu`), embedded at build time.
pub const KERNEL_SOURCE: &str = concat!(
    include_str!("../../../kernels/common.cuh"),
    include_str!("../../../kernels/offload.cu")
);

/// Threads of a diff CTA (`DIFF_THREADS` in kernels/offload.cu).
const DIFF_THREADS: u32 = 1024;
/// The largest selection the diff's shared-memory hash takes (half its 4096 entries).
pub const MAX_DIFF_SELECTION: usize = 2048;
/// Warps of an IO CTA (`IO_WARPS`).
const IO_WARPS: usize = 8;
/// Threads of a `union_heads` or `page_table` CTA (`UNION_THREADS`).
const UNION_THREADS: u32 = 256;
/// Threads of the `tally_diff` CTA (`TALLY_THREADS`).
const TALLY_THREADS: u32 = 256;
/// The shared memory a `union_heads` CTA may use for its bitmap (the default limit).
const UNION_SMEM_MAX: usize = 48 << 10;

fn device_err(e: impl std::fmt::Debug) -> OffloadError {
    OffloadError::Attn(AttnError::Device(format!("CUDA driver: {e:?}")))
}

fn to_i32(x: usize) -> Result<i32, OffloadError> {
    i32::try_from(x).map_err(|_| OffloadError::Invalid(format!("{x} does not fit an i32")))
}

fn to_u32(x: usize) -> Result<u32, OffloadError> {
    u32::try_from(x).map_err(|_| OffloadError::Invalid(format!("{x} does not fit a u32")))
}

/// offload's kernels, loaded for one [`Gpu`], launched on its stream (or another stream of
/// its context, through [`IoKernels::on_stream`]).
#[derive(Clone, Debug)]
pub struct IoKernels {
    stream: Arc<CudaStream>,
    diff: CudaFunction,
    /// The most dynamic shared memory a diff CTA may use (set once at load).
    diff_smem_max: usize,
    load_misses: CudaFunction,
    copy_rows: CudaFunction,
    union_heads: CudaFunction,
    page_table: CudaFunction,
    tally_diff: CudaFunction,
}

/// The hot buffers of `rows` (request, layer) rows of `hot` slots each, on the device: the LRU
/// order and the page of each slot ([`HotBuffer`]'s state; the reserved slot is index `hot`).
pub struct DeviceHotBuffers {
    /// Rows.
    pub rows: usize,
    /// Slots per row, the reserved slot aside.
    pub hot: usize,
    lru: CudaSlice<u32>,
    slot_page: CudaSlice<i32>,
}

/// The outputs of a diff launch, per row `[rows, sel_max]` and -1 padded where not counts.
/// Allocated once ([`DeviceDiff::new`]) and rewritten whole by every [`IoKernels::diff`].
pub struct DeviceDiff {
    /// Columns per row.
    pub sel_max: usize,
    /// The slot of each selected page (`hot` for the current page).
    pub slots: CudaSlice<i32>,
    /// The device block of each selected page: the page table attention reads.
    pub table: CudaSlice<i32>,
    /// Missed pages, in selection order.
    pub miss_pages: CudaSlice<i32>,
    /// The slot each miss goes to.
    pub miss_slots: CudaSlice<i32>,
    /// Misses per row.
    pub miss_counts: CudaSlice<i32>,
    /// Hits per row (the current page included).
    pub hit_counts: CudaSlice<i32>,
    /// 1 where a row's selection did not fit its evictable slots (that row is unchanged).
    pub errors: CudaSlice<i32>,
}

impl DeviceDiff {
    /// Output buffers for diffs of `rows` rows of selections up to `sel_max` pages.
    pub fn new(gpu: &Gpu, rows: usize, sel_max: usize) -> Result<Self, OffloadError> {
        let alloc = |n: usize| gpu.zeros::<i32>(n);
        Ok(DeviceDiff {
            sel_max,
            slots: alloc(rows * sel_max)?,
            table: alloc(rows * sel_max)?,
            miss_pages: alloc(rows * sel_max)?,
            miss_slots: alloc(rows * sel_max)?,
            miss_counts: alloc(rows)?,
            hit_counts: alloc(rows)?,
            errors: alloc(rows)?,
        })
    }

    /// Rows the buffers hold.
    pub fn rows(&self) -> usize {
        self.errors.len()
    }
}

/// Which hot buffer each selection row of a [`IoKernels::diff_rows`] batch diffs against:
/// distinct rows of a [`DeviceHotBuffers`] of `bufs` rows, checked on the host and uploaded.
pub struct BufRows {
    rows: CudaSlice<i32>,
    bufs: usize,
}

impl BufRows {
    /// Uploads `rows` (distinct, each below `bufs`).
    pub fn upload(gpu: &Gpu, rows: &[usize], bufs: usize) -> Result<Self, OffloadError> {
        let mut seen = vec![false; bufs];
        let mut ids = Vec::with_capacity(rows.len());
        for &r in rows {
            if r >= bufs || std::mem::replace(&mut seen[r], true) {
                return Err(OffloadError::Invalid(format!(
                    "hot buffer row {r} repeated or outside {bufs} rows"
                )));
            }
            ids.push(to_i32(r)?);
        }
        Ok(BufRows {
            rows: gpu.upload(&ids)?,
            bufs,
        })
    }
}

/// The host KV pool in page-locked memory, in offload's [`HostLayout::LayerFirst`] layout (K
/// and V each `[layers, pages, page_size, kv_heads, head_dim]`): a pinned copy
/// ([`PinnedHostPool::from_host`]), or a [`HostPool`] registered in place
/// ([`PinnedHostPool::register`]) so that what the CPU appends to it is what kernels load.
/// Kernels read it by address, so it waits for its stream before it frees or unregisters the
/// memory.
pub struct PinnedHostPool<T: CudaElement> {
    shape: HostShape,
    mem: HostMem<T>,
    /// The device addresses of K and V, which kernels read through unified addressing.
    ptrs: (u64, u64),
    stream: Arc<CudaStream>,
}

/// Where a [`PinnedHostPool`]'s memory comes from.
enum HostMem<T: CudaElement> {
    /// Pinned allocations of its own.
    Owned {
        k: PinnedHostSlice<T>,
        v: PinnedHostSlice<T>,
    },
    /// A host pool's tensors, page-locked in place; the `Arc` keeps them alive (a `HostPool`
    /// never reallocates its tensors) until they are unregistered.
    Registered {
        pool: Arc<parking_lot::RwLock<HostPool<T>>>,
        host_ptrs: (u64, u64),
    },
}

impl<T: CudaElement> Drop for PinnedHostPool<T> {
    fn drop(&mut self) {
        // A kernel enqueued on the stream may still read the pool; an error here leaves
        // nothing better to do than to free it anyway.
        let _ = self.stream.synchronize();
        if let HostMem::Registered { host_ptrs, .. } = &self.mem {
            for p in [host_ptrs.0, host_ptrs.1] {
                // SAFETY: `p` was registered by `register` and nothing reads it any more (the
                // stream has drained); the pool's `Arc` still keeps the memory alive here.
                let _ = unsafe { cudarc::driver::sys::cuMemHostUnregister(p as *mut c_void) };
            }
        }
    }
}

impl<T: CudaElement> PinnedHostPool<T> {
    /// A pinned copy of a layer-first host pool.
    pub fn from_host(gpu: &Gpu, pool: &HostPool<T>) -> Result<Self, OffloadError> {
        if pool.layout() != HostLayout::LayerFirst {
            return Err(OffloadError::Invalid(format!(
                "a pinned pool is layer-first, not {:?}",
                pool.layout()
            )));
        }
        let (k, v) = pool.tensors();
        let ctx = gpu.context();
        // SAFETY: flags 0 asks for plain page-locked memory (not write-combined, so host reads
        // stay fast); the contents are written below before any use.
        let (mut pk, mut pv) = unsafe {
            (
                ctx.alloc_pinned_with_flags::<T>(k.len(), 0)
                    .map_err(device_err)?,
                ctx.alloc_pinned_with_flags::<T>(v.len(), 0)
                    .map_err(device_err)?,
            )
        };
        pk.as_mut_slice().map_err(device_err)?.copy_from_slice(k);
        pv.as_mut_slice().map_err(device_err)?.copy_from_slice(v);
        let ptrs = (
            pk.as_ptr().map_err(device_err)? as u64,
            pv.as_ptr().map_err(device_err)? as u64,
        );
        Ok(PinnedHostPool {
            shape: pool.shape(),
            mem: HostMem::Owned { k: pk, v: pv },
            ptrs,
            stream: gpu.stream().clone(),
        })
    }

    /// Page-locks a layer-first host pool in place (`cuMemHostRegister`, mapped for the
    /// device): no copy, so tokens the CPU writes into the pool later (an offload manager's
    /// appends) are what kernels load. The caller orders those writes with the kernels that
    /// read the same pages (the pool's stream). Unregistered on drop.
    pub fn register(
        gpu: &Gpu,
        pool: Arc<parking_lot::RwLock<HostPool<T>>>,
    ) -> Result<Self, OffloadError> {
        let (shape, host_ptrs, bytes) = {
            let p = pool.read();
            if p.layout() != HostLayout::LayerFirst {
                return Err(OffloadError::Invalid(format!(
                    "a pinned pool is layer-first, not {:?}",
                    p.layout()
                )));
            }
            let (k, v) = p.tensors();
            (
                p.shape(),
                (k.as_ptr() as u64, v.as_ptr() as u64),
                size_of_val(k),
            )
        };
        gpu.context().bind_to_thread().map_err(device_err)?;
        let mut ptrs = [0u64; 2];
        let mut registered = 0;
        let mut failure = None;
        for (i, p) in [host_ptrs.0, host_ptrs.1].into_iter().enumerate() {
            // SAFETY: `p` addresses `bytes` bytes of a live `Vec` that the pool's `Arc` keeps
            // alive and never reallocates; registering only page-locks and maps it.
            let r = unsafe {
                cudarc::driver::sys::cuMemHostRegister_v2(
                    p as *mut c_void,
                    bytes.max(1),
                    cudarc::driver::sys::CU_MEMHOSTREGISTER_DEVICEMAP,
                )
            };
            if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
                failure = Some(format!("cuMemHostRegister: {r:?}"));
                break;
            }
            registered += 1;
            let mut d: cudarc::driver::sys::CUdeviceptr = 0;
            // SAFETY: `p` was just registered with DEVICEMAP; the call writes one address.
            let r = unsafe {
                cudarc::driver::sys::cuMemHostGetDevicePointer_v2(&mut d, p as *mut c_void, 0)
            };
            if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
                failure = Some(format!("cuMemHostGetDevicePointer: {r:?}"));
                break;
            }
            ptrs[i] = d;
        }
        if let Some(f) = failure {
            for p in [host_ptrs.0, host_ptrs.1].into_iter().take(registered) {
                // SAFETY: `p` was registered above and no kernel has been given it.
                let _ = unsafe { cudarc::driver::sys::cuMemHostUnregister(p as *mut c_void) };
            }
            return Err(OffloadError::Attn(AttnError::Device(f)));
        }
        Ok(PinnedHostPool {
            shape,
            mem: HostMem::Registered { pool, host_ptrs },
            ptrs: (ptrs[0], ptrs[1]),
            stream: gpu.stream().clone(),
        })
    }

    /// The pool's shape.
    pub fn shape(&self) -> HostShape {
        self.shape
    }

    /// K and V of a pinned copy, read on the host (waits for work that uses them). A
    /// registered pool answers an error: read it through its [`HostPool`].
    pub fn tensors(&self) -> Result<(&[T], &[T]), OffloadError> {
        match &self.mem {
            HostMem::Owned { k, v } => Ok((
                k.as_slice().map_err(device_err)?,
                v.as_slice().map_err(device_err)?,
            )),
            HostMem::Registered { .. } => Err(OffloadError::Invalid(
                "a registered pool is read through its HostPool".to_owned(),
            )),
        }
    }

    /// The host pool a registered pool page-locks (`None` for a pinned copy).
    pub fn host_pool(&self) -> Option<&Arc<parking_lot::RwLock<HostPool<T>>>> {
        match &self.mem {
            HostMem::Owned { .. } => None,
            HostMem::Registered { pool, .. } => Some(pool),
        }
    }

    /// Elements of one page of one layer (K or V).
    fn page_elems(&self) -> usize {
        self.shape.page_size * self.shape.kv_heads * self.shape.head_dim
    }
}

impl DeviceHotBuffers {
    /// The device copy of host hot buffers, all of the same size.
    pub fn upload(gpu: &Gpu, buffers: &[HotBuffer]) -> Result<Self, OffloadError> {
        let hot = buffers.first().map_or(0, |b| b.lru().len());
        if hot == 0 || buffers.iter().any(|b| b.lru().len() != hot) {
            return Err(OffloadError::Invalid(
                "hot buffers must be non-empty and of one size".to_owned(),
            ));
        }
        let lru: Vec<u32> = buffers
            .iter()
            .flat_map(|b| b.lru().iter().copied())
            .collect();
        let pages: Vec<i32> = buffers
            .iter()
            .flat_map(|b| b.slot_pages().iter().copied())
            .collect();
        Ok(DeviceHotBuffers {
            rows: buffers.len(),
            hot,
            lru: gpu.upload(&lru)?,
            slot_page: gpu.upload(&pages)?,
        })
    }

    /// Empties row `row` (a new request in it): the LRU order `0..hot` and no pages.
    pub fn reset_row(&mut self, gpu: &Gpu, row: usize) -> Result<(), OffloadError> {
        if row >= self.rows {
            return Err(OffloadError::Invalid(format!(
                "hot buffer row {row} of {}",
                self.rows
            )));
        }
        let fresh = HotBuffer::new(self.hot);
        let range = row * self.hot..(row + 1) * self.hot;
        let stream = gpu.stream();
        stream
            .memcpy_htod(fresh.lru(), &mut self.lru.slice_mut(range.clone()))
            .map_err(device_err)?;
        stream
            .memcpy_htod(fresh.slot_pages(), &mut self.slot_page.slice_mut(range))
            .map_err(device_err)?;
        Ok(())
    }

    /// The LRU orders and slot pages, `[rows, hot]` each (waits for the stream).
    pub fn download(&self, gpu: &Gpu) -> Result<(Vec<u32>, Vec<i32>), OffloadError> {
        Ok((gpu.download(&self.lru)?, gpu.download(&self.slot_page)?))
    }
}

impl IoKernels {
    /// Compiles and loads `kernels/offload.cu` for `gpu`'s device.
    pub fn new(gpu: &Gpu) -> Result<Self, OffloadError> {
        let ptx = compile_source("kernels/offload.cu", KERNEL_SOURCE, gpu.arch())?;
        let module = gpu.context().load_module(ptx).map_err(device_err)?;
        let load = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| OffloadError::Attn(AttnError::Device(format!("kernel {name}: {e:?}"))))
        };
        // The diff's dynamic shared memory grows with HOT: allow it, once, all the device
        // offers a block beyond the kernel's static hash.
        let diff = load("hot_diff")?;
        let optin = gpu
            .context()
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(device_err)?;
        let fixed = diff
            .get_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
            .map_err(device_err)?;
        let diff_smem_max = usize::try_from(optin - fixed).unwrap_or(0);
        diff.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            to_i32(diff_smem_max)?,
        )
        .map_err(device_err)?;
        Ok(IoKernels {
            stream: gpu.stream().clone(),
            diff,
            diff_smem_max,
            load_misses: load("load_misses")?,
            copy_rows: load("copy_rows")?,
            union_heads: load("union_heads")?,
            page_table: load("page_table")?,
            tally_diff: load("tally_diff")?,
        })
    }

    /// The same kernels launched on `stream`, a stream of the same context: loads on a copy
    /// stream, say, overlapped with attention on the compute stream. Ordering work across the
    /// two streams (events) is the caller's.
    pub fn on_stream(&self, stream: Arc<CudaStream>) -> Self {
        IoKernels {
            stream,
            ..self.clone()
        }
    }

    /// The swap-in of every row at once: `pages` (rows of ascending, unique logical pages, at
    /// most [`MAX_DIFF_SELECTION`] per row), `current` (`[rows]`, the page in each reserved
    /// slot) and `blocks` (`[rows, hot + 1]`, each slot's device block). Updates `buffers` as
    /// [`HotBuffer::diff`] would, row by row, and rewrites `out` whole; a row whose selection
    /// does not fit is left unchanged and flagged in [`DeviceDiff::errors`].
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
