//! The CUDA backend of sparse-algo (feature `cuda`): Quest on the device, with the same
//! contracts as the CPU implementation.
//!
//! [`SelectKernels`] compiles `kernels/select.cu` once for a [`Gpu`] and runs on its stream.
//! [`DeviceRepPool`] is [`RepPool`](crate::RepPool)'s layout on the device, in the keys' element
//! type (a page's minimum and maximum are keys, so nothing is rounded).
//! [`SelectKernels::update_minmax`] maintains it from the paged keys and the batch metadata:
//! after a prefill it builds every page, after a decode step it recomputes the current page.
//! [`SelectKernels::quest_topk`] scores pages and selects the top-k in one launch into a
//! [`DeviceTopK`], whose rows feed [`Gpu::sparse_page_attention`] (or, one row per sequence, the
//! hot-buffer diff) without a round trip to the host. Scores equal the CPU's bit for bit, so
//! the selections are the CPU's, ties included.

use std::sync::Arc;

use attn_op::cuda::{
    CudaElement, DeviceBatch, DevicePagedKv, DeviceSelection, Gpu, compile_source,
};
use attn_op::{AttnError, DType, KvCache};
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

use crate::pool::pool_extent;
use crate::{AlgoError, Quest, RepShape, minmax};

/// The CUDA C source of sparse-algo's kernels (`kernels/common.cuh`, then
/// `kernels/select.cu`), embedded at build time.
pub const KERNEL_SOURCE: &str = concat!(
    include_str!("../../../kernels/common.cuh"),
    include_str!("../../../kernels/select.cu")
);

/// Threads of a selection CTA (`SEL_THREADS` in kernels/select.cu): also the mid pages one
/// scoring CTA takes.
const SEL_THREADS: usize = 256;
/// The largest row of score keys the selecting CTA copies into shared memory (96 KiB: rows of
/// 24K pages, 384K tokens of 16); longer rows are selected from global memory.
const KEYS_SMEM_MAX: usize = 96 << 10;
/// Bytes of min/max rows a scoring CTA stages in shared memory (`TILE_BYTES`).
const TILE_BYTES: usize = 64 << 10;

fn device_err(e: impl std::fmt::Debug) -> AlgoError {
    AlgoError::Attn(AttnError::Device(format!("CUDA driver: {e:?}")))
}

fn to_i32(x: usize) -> Result<i32, AlgoError> {
    i32::try_from(x).map_err(|_| AlgoError::Invalid(format!("{x} does not fit an i32")))
}

fn to_u32(x: usize) -> Result<u32, AlgoError> {
    u32::try_from(x).map_err(|_| AlgoError::Invalid(format!("{x} does not fit a u32")))
}

/// sparse-algo's kernels, loaded for one [`Gpu`], launched on its stream.
#[derive(Debug)]
pub struct SelectKernels {
    stream: Arc<CudaStream>,
    /// `(quest_minmax, quest_select)` for f32, f16 and bf16, in [`type_index`] order.
    quest: [(CudaFunction, CudaFunction); 3],
    /// The most dynamic shared memory a selection CTA may use (set once at load).
    select_smem_max: usize,
}

/// [`RepPool`](crate::RepPool)'s flat array `[layers, slots, max_pages, heads, width]` on the
/// device, in element type `T`. Token counts are not kept: the batch metadata says which pages
/// a step touched.
pub struct DeviceRepPool<T: CudaElement> {
    shape: RepShape,
    layers: usize,
    slots: usize,
    max_pages: usize,
    data: CudaSlice<T>,
}

impl<T: CudaElement> DeviceRepPool<T> {
    /// A zeroed pool for `layers` layers and `slots` requests of up to `max_tokens` tokens.
    pub fn new(
        gpu: &Gpu,
        shape: RepShape,
        layers: usize,
        slots: usize,
        max_tokens: usize,
    ) -> Result<Self, AlgoError> {
        let (max_pages, len) = pool_extent(shape, layers, slots, max_tokens)?;
        Ok(DeviceRepPool {
            shape,
            layers,
            slots,
            max_pages,
            data: gpu.zeros(len.max(1))?,
        })
    }

    /// The per-page shape.
    pub fn shape(&self) -> RepShape {
        self.shape
    }

    /// The longest sequence a slot can summarize.
    pub fn max_tokens(&self) -> usize {
        self.max_pages * self.shape.page_size
    }

    /// Bytes the pool holds on the device.
    pub fn bytes(&self) -> usize {
        self.data.len() * size_of::<T>()
    }

    /// The whole array, `[layers, slots, max_pages, heads, width]`.
    pub fn data(&self) -> &CudaSlice<T> {
        &self.data
    }
}

/// The output of [`SelectKernels::quest_topk`] and the scratch it reuses, allocated once for a
/// batch shape and rewritten whole by every launch.
pub struct DeviceTopK {
    /// The selected pages per output row, ascending, -1 padded: rows are (sequence, KV head),
    /// or one per sequence for a head-shared selection made with `per_sequence`.
    pub sel: DeviceSelection,
    /// `[rows]` tokens each row's pages cover (the current, partial page counts its valid
    /// tokens): the KV length of attention over the selected pages gathered in order.
    pub covered: CudaSlice<i32>,
    /// Output rows per selection row (a shared selection written once per KV head, or once).
    copies: usize,
    /// `[selection rows, score_stride]` ordered score keys, zero between launches.
    scores: CudaSlice<u32>,
    score_stride: usize,
    /// `[selection rows]` finished CTAs, zero between launches.
    counters: CudaSlice<i32>,
}

impl DeviceTopK {
    /// Buffers for Quest selections of `num_seqs` sequences of up to `max_tokens` tokens with
    /// `kv_heads` KV heads. A head-shared Quest ([`QuestConfig::shared_heads`]) writes its
    /// selection once per sequence when `per_sequence` (the rows a hot-buffer diff takes), else
    /// once per KV head (the rows attention takes); a per-head Quest needs `per_sequence` false.
    ///
    /// [`QuestConfig::shared_heads`]: crate::QuestConfig::shared_heads
    pub fn new(
        gpu: &Gpu,
        quest: &Quest,
        num_seqs: usize,
        kv_heads: usize,
        max_tokens: usize,
        per_sequence: bool,
    ) -> Result<Self, AlgoError> {
        let shared = quest.config().shared_heads;
        if per_sequence && !shared {
            return Err(AlgoError::Config(
                "one row per sequence needs a head-shared Quest".to_owned(),
            ));
        }
        let sel_rows = if shared {
            num_seqs
        } else {
            num_seqs * kv_heads
        };
        let copies = if !shared || per_sequence { 1 } else { kv_heads };
        let rows = sel_rows * copies;
        let width = quest.row_width();
        let score_stride = max_tokens.div_ceil(quest.config().page_size).max(1);
        Ok(DeviceTopK {
            sel: DeviceSelection::from_device(gpu.zeros(rows * width)?, gpu.zeros(rows)?, width)?,
            covered: gpu.zeros(rows)?,
            copies,
            scores: gpu.zeros(sel_rows * score_stride)?,
            score_stride,
            counters: gpu.zeros(sel_rows)?,
        })
    }
}

/// The index of `T` in [`SelectKernels`]' tables.
fn type_index<T: CudaElement>() -> usize {
    match T::DTYPE {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
    }
}

/// A launch's integer arguments, on the stack: the first error if one does not fit an i32.
fn ints_ok<const N: usize>(ints: [Result<i32, AlgoError>; N]) -> Result<[i32; N], AlgoError> {
    let mut out = [0; N];
    for (o, x) in out.iter_mut().zip(ints) {
        *o = x?;
    }
    Ok(out)
}

impl SelectKernels {
    /// Compiles and loads `kernels/select.cu` for `gpu`'s device.
    pub fn new(gpu: &Gpu) -> Result<Self, AlgoError> {
        let ptx = compile_source("kernels/select.cu", KERNEL_SOURCE, gpu.arch())?;
        let module = gpu.context().load_module(ptx).map_err(device_err)?;
        let load = |name: String| {
            module
                .load_function(&name)
                .map_err(|e| AlgoError::Attn(AttnError::Device(format!("kernel {name}: {e:?}"))))
        };
        let pair = |t: &str| -> Result<(CudaFunction, CudaFunction), AlgoError> {
            Ok((
                load(format!("quest_minmax_{t}"))?,
                load(format!("quest_select_{t}"))?,
            ))
        };
        let quest = [pair("f32")?, pair("f16")?, pair("bf16")?];
        // A selection CTA's dynamic shared memory holds the group's weights, then the row's
        // keys: allow it, once, all the device offers beyond the kernel's static arrays.
        let optin = gpu
            .context()
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(device_err)?;
        let mut select_smem_max = usize::MAX;
        for (_, f) in &quest {
            let fixed = f
                .get_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
                .map_err(device_err)?;
            let free = usize::try_from(optin - fixed).unwrap_or(0);
            f.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                to_i32(free)?,
            )
            .map_err(device_err)?;
            select_smem_max = select_smem_max.min(free);
        }
        Ok(SelectKernels {
            stream: gpu.stream().clone(),
            quest,
            select_smem_max,
        })
    }

    /// Brings the min/max pages of `layer` up to date for the batch `meta` over the keys in
    /// `kv`: sequence `s` (pool slot `slots[s]`) added its last `q_len` tokens this step, so the
    /// pages holding them are recomputed (all of them after a prefill, the current page after a
    /// decode step), as [`Quest::update_representations`] does from the slot's previous length.
    /// A slot outside the pool leaves its sequence untouched.
    ///
    /// [`Quest::update_representations`]: crate::SparseAlgorithm::update_representations
    pub fn update_minmax<T: CudaElement>(
        &self,
        quest: &Quest,
        kv: &DevicePagedKv<T>,
        meta: &DeviceBatch,
        layer: usize,
        slots: &CudaSlice<i32>,
        pool: &mut DeviceRepPool<T>,
    ) -> Result<(), AlgoError> {
        let layout = kv.layout();
        let (kvh, d) = (layout.kv_heads, layout.head_dim);
        self.check_pool(quest, meta, layer, slots, pool, kvh, d)?;
        if meta.layout() != &layout {
            return Err(AlgoError::Invalid(format!(
                "the batch was validated against {:?}, the keys are {layout:?}",
                meta.layout()
            )));
        }
        let ps = quest.config().page_size;
        let vec = 16 / size_of::<T>();
        let items = meta
            .kv_lens()
            .iter()
            .zip(meta.q_lens())
            .map(|(&len, &q)| (len.div_ceil(ps) - (len - q.min(len)) / ps) * kvh * (d / vec))
            .max()
            .unwrap_or(0);
        if items == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (
                to_u32(items.div_ceil(SEL_THREADS))?,
                to_u32(meta.num_seqs())?,
                1,
            ),
            block_dim: (to_u32(SEL_THREADS)?, 1, 1),
            shared_mem_bytes: 0,
        };
        let ints = [
            layout.num_blocks,
            layout.block_size,
            kvh,
            d,
            meta.max_blocks(),
            layer,
            pool.slots,
            pool.max_pages,
            ps,
        ]
        .map(to_i32);
        let ints = ints_ok(ints)?;
        let mut b = self.stream.launch_builder(&self.quest[type_index::<T>()].0);
        b.arg(kv.k())
            .arg(&ints[0])
            .arg(&ints[1])
            .arg(&ints[2])
            .arg(&ints[3])
            .arg(meta.block_table())
            .arg(&ints[4])
            .arg(meta.cu_seqlens_q())
            .arg(meta.seq_lens_kv())
            .arg(slots)
            .arg(&mut pool.data)
            .arg(&ints[5])
            .arg(&ints[6])
            .arg(&ints[7])
            .arg(&ints[8]);
        // SAFETY: the arguments follow `quest_minmax_*` in kernels/select.cu; the batch was
        // validated against the keys' layout (block ids are range-checked in the kernel), the
        // pool holds `[layers, slots, max_pages, kv_heads, 2 d]` with every sequence's pages
        // within max_pages (checked above), slots are range-checked in the kernel, and d is a
        // multiple of the 16-byte vector.
        unsafe { b.launch(cfg) }.map_err(device_err)?;
        Ok(())
    }

    /// Quest's decode selection for the batch `meta` (one query row per sequence; the last
    /// row of each sequence's queries is used), from `q` (`[total_q, q_heads, head_dim]`, the
    /// tensor attention reads) and the min/max pages of `layer`: estimate and top-k in one
    /// launch, written into `out` as [`Quest::retrieve_topk`] answers for the same inputs
    /// (rows equal, padding -1).
    ///
    /// [`Quest::retrieve_topk`]: crate::SparseAlgorithm::retrieve_topk
    #[allow(
        clippy::too_many_arguments,
        reason = "the CPU entry point's inputs, as device buffers"
    )]
    pub fn quest_topk<T: CudaElement>(
        &self,
        quest: &Quest,
        q: &CudaSlice<T>,
        q_heads: usize,
        meta: &DeviceBatch,
        layer: usize,
        slots: &CudaSlice<i32>,
        pool: &DeviceRepPool<T>,
        out: &mut DeviceTopK,
    ) -> Result<(), AlgoError> {
        let layout = *meta.layout();
        let (kvh, d) = (layout.kv_heads, layout.head_dim);
        self.check_pool(quest, meta, layer, slots, pool, kvh, d)?;
        if q_heads == 0 || !q_heads.is_multiple_of(kvh) {
            return Err(AlgoError::Invalid(format!(
                "{q_heads} query heads over {kvh} KV heads"
            )));
        }
        let n = meta.num_seqs();
        crate::error::check_len("q", q.len(), meta.total_q() * q_heads * d)?;
        if let Some(s) = meta.q_lens().iter().position(|&l| l == 0) {
            return Err(AlgoError::Invalid(format!("sequence {s} has no query")));
        }
        let c = quest.config();
        let sel_rows = if c.shared_heads { n } else { n * kvh };
        let width = quest.row_width();
        if out.counters.len() != sel_rows
            || out.sel.rows != sel_rows * out.copies
            || out.sel.max_len != width
        {
            return Err(AlgoError::Invalid(format!(
                "top-k buffers of {} rows of {} for {sel_rows} selection rows of {width}",
                out.sel.rows, out.sel.max_len
            )));
        }
        let max_len = meta.max_kv_len();
        if max_len.div_ceil(c.page_size) > out.score_stride {
            return Err(AlgoError::Invalid(format!(
                "sequences of {max_len} tokens; the top-k buffers were made for {}",
                out.score_stride * c.page_size
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let g = q_heads / kvh;
        let heads = if c.shared_heads { kvh } else { 1 };
        // Threads per page: the fewest that keep a tile of SEL_THREADS / tpp rows within
        // TILE_BYTES.
        let row_bytes = 2 * d * size_of::<T>();
        let mut tpp = 1;
        while tpp < SEL_THREADS && SEL_THREADS / tpp * row_bytes > TILE_BYTES {
            tpp *= 2;
        }
        let tile_pages = SEL_THREADS / tpp;
        let weights = g * d * size_of::<f32>();
        let tile = tile_pages * (row_bytes + 16);
        let keys = out.score_stride * size_of::<u32>();
        let keys_smem = keys <= KEYS_SMEM_MAX;
        let smem = if keys_smem {
            (weights + tile).max(keys)
        } else {
            weights + tile
        };
        if smem > self.select_smem_max {
            return Err(AlgoError::Invalid(format!(
                "a group of {g} query heads of {d} needs {smem} bytes of shared memory; the \
                 device offers {}",
                self.select_smem_max
            )));
        }
        let chunks = max_len.div_ceil(c.page_size).div_ceil(tile_pages).max(1);
        let cfg = LaunchConfig {
            grid_dim: (to_u32(chunks)?, to_u32(sel_rows)?, to_u32(heads)?),
            block_dim: (to_u32(SEL_THREADS)?, 1, 1),
            shared_mem_bytes: to_u32(smem)?,
        };
        let ints = [
            q_heads,
            layer,
            pool.slots,
            pool.max_pages,
            kvh,
            d,
            c.page_size,
            quest.budget_pages(),
            c.always.sink_tokens as usize,
            c.always.recent_tokens as usize,
            usize::from(c.shared_heads),
            tpp,
            out.score_stride,
            usize::from(keys_smem),
            width,
            out.copies,
        ]
        .map(to_i32);
        let ints = ints_ok(ints)?;
        let mut b = self.stream.launch_builder(&self.quest[type_index::<T>()].1);
        b.arg(q)
            .arg(meta.cu_seqlens_q())
            .arg(&ints[0])
            .arg(&pool.data)
            .arg(&ints[1])
            .arg(&ints[2])
            .arg(&ints[3])
            .arg(slots)
            .arg(meta.seq_lens_kv())
            .arg(&ints[4])
            .arg(&ints[5])
            .arg(&ints[6])
            .arg(&ints[7])
            .arg(&ints[8])
            .arg(&ints[9])
            .arg(&ints[10])
            .arg(&ints[11])
            .arg(&mut out.scores)
            .arg(&ints[12])
            .arg(&ints[13])
            .arg(&mut out.counters)
            .arg(&mut out.sel.ids)
            .arg(&mut out.sel.lens)
            .arg(&mut out.covered)
            .arg(&ints[14])
            .arg(&ints[15]);
        // SAFETY: the arguments follow `quest_select_*` in kernels/select.cu; q holds
        // total_q * q_heads * d elements and every sequence has a query row; the pool's shape
        // and extent were checked against the batch; scores hold score_stride keys per
        // selection row, at least every page of the longest sequence; ids, lens and covered
        // hold sel_rows * copies rows of `width`; the dynamic shared memory holds the group's
        // g d queries and a tile of SEL_THREADS / tpp padded rows and, with keys_smem, a
        // row of score_stride keys (within the limit set at load); slots are range-checked in
        // the kernel.
        unsafe { b.launch(cfg) }.map_err(device_err)?;
        Ok(())
    }

    /// Checks a pool against Quest's shape, the layer, the batch's lengths and the slots.
    #[allow(
        clippy::too_many_arguments,
        reason = "everything a pool is checked against"
    )]
    fn check_pool<T: CudaElement>(
        &self,
        quest: &Quest,
        meta: &DeviceBatch,
        layer: usize,
        slots: &CudaSlice<i32>,
        pool: &DeviceRepPool<T>,
        kvh: usize,
        d: usize,
    ) -> Result<(), AlgoError> {
        let want = minmax::shape(quest.config().page_size, kvh, d);
        if pool.shape != want {
            return Err(AlgoError::Invalid(format!(
                "the pool holds {:?}, Quest needs {want:?}",
                pool.shape
            )));
        }
        if !d.is_multiple_of(16) {
            return Err(AlgoError::Invalid(format!(
                "the device kernels take head dims that are multiples of 16, not {d}"
            )));
        }
        if layer >= pool.layers {
            return Err(AlgoError::Invalid(format!(
                "layer {layer} outside a pool of {} layers",
                pool.layers
            )));
        }
        crate::error::check_len("slots", slots.len(), meta.num_seqs())?;
        if meta.max_kv_len() > pool.max_tokens() {
            return Err(AlgoError::Invalid(format!(
                "a sequence of {} tokens exceeds the pool's {} per request",
                meta.max_kv_len(),
                pool.max_tokens()
            )));
        }
        Ok(())
    }
}
