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

mod diff;
mod io;

use std::ffi::c_void;
use std::sync::Arc;

use attn_op::AttnError;
use attn_op::cuda::{CudaElement, Gpu, compile_source};
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, PinnedHostSlice};

use crate::{HostLayout, HostPool, HostShape, HostStore, HotBuffer, OffloadError};

/// The CUDA C source of offload's kernels (`kernels/common.cuh`, then
/// `kernels/offload.cu`), embedded at build time.
pub const KERNEL_SOURCE: &str = concat!(
    include_str!("../../../../kernels/common.cuh"),
    include_str!("../../../../kernels/offload.cu")
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
}
