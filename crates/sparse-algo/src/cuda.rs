//! The CUDA backend of sparse-algo (feature `cuda`): Quest, StreamingLLM and the DSA indexer on
//! the device, with the same contracts as the CPU implementations.
//!
//! [`SelectKernels`] compiles `kernels/select.cu` once for a [`Gpu`] and runs on its stream.
//! [`DeviceRepPool`] is [`RepPool`](crate::RepPool)'s layout on the device, in the keys' element
//! type (a page's minimum and maximum are keys, so nothing is rounded).
//! [`SelectKernels::update_minmax`] maintains it from the paged keys and the batch metadata:
//! after a prefill it builds every page, after a decode step it recomputes the current page.
//! [`SelectKernels::quest_topk`] scores pages (one launch) and selects the top-k (a second) into
//! a [`DeviceTopK`], whose rows feed [`Gpu::sparse_page_attention`] (or, one row per sequence, the
//! hot-buffer diff) without a round trip to the host. With [`QuestScoring::Exact`] (the default)
//! scores equal the CPU's bit for bit, so the selections are the CPU's, ties included;
//! [`QuestScoring::TensorCores`] scores on tensor cores, equal to the CPU's up to the order of
//! f32 sums (see there). [`SelectKernels::streaming_topk`] writes
//! StreamingLLM's rows through the same selecting kernel, and [`SelectKernels::dsa_topk`]
//! scores every token with a trained indexer (keys in a [`DeviceRepPool`]) before it.

use std::sync::Arc;

use attn_op::cuda::{
    CudaElement, DeviceBatch, DevicePagedKv, DeviceSelection, Gpu, KernelValue, Launch, Published,
    compile_source,
};
use attn_op::{AttnError, DType, KvCache};
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
};

use crate::pool::pool_extent;
use crate::{AlgoError, AlwaysInclude, Dsa, Quest, RepShape, StreamingLlm, Summary, minmax};

/// The CUDA C source of sparse-algo's kernels (`kernels/common.cuh`, `kernels/pdl.cuh`,
/// `kernels/mma.cuh`, `kernels/trace.cuh`, then `kernels/select.cu`), embedded at build time.
pub const KERNEL_SOURCE: &str = concat!(
    include_str!("../../../kernels/common.cuh"),
    include_str!("../../../kernels/pdl.cuh"),
    include_str!("../../../kernels/mma.cuh"),
    include_str!("../../../kernels/trace.cuh"),
    include_str!("../../../kernels/select.cu")
);

/// Threads of a min/max CTA (`SEL_THREADS` in kernels/select.cu).
const SEL_THREADS: usize = 256;
/// Threads of a scoring CTA (`SCORE_THREADS`).
const SCORE_THREADS: usize = 128;
/// Threads of a selecting CTA (`PICK_THREADS`).
const PICK_THREADS: usize = 1024;
/// Dynamic shared memory of a selecting CTA before its row of keys: `select_top`'s two
/// histograms of `SEL_BINS` (4096) ints.
const PICK_HIST_BYTES: usize = 2 * 4096 * size_of::<i32>();
/// The first record of the traced selecting CTAs in the select module's `attn_trace`
/// (`PICK_TRACE_FIRST` in kernels/select.cu); the traced scoring CTAs' start at 0.
pub const PICK_TRACE_FIRST: usize = 2048;
/// Threads of a DSA scoring CTA, one per token (`DSA_THREADS`).
const DSA_THREADS: usize = 128;
/// Bytes of min/max rows in one of a scoring CTA's two tile buffers (`TILE_BYTES`).
const TILE_BYTES: usize = 32 << 10;
/// Warps of a tensor-core scoring CTA (`TC_WARPS`).
const TC_WARPS: usize = 8;
/// Mid pages of one tensor-core scoring item: the MMA's M.
const TC_PAGES: usize = 16;
/// The most query heads per KV head the tensor-core scoring takes: the MMA's N.
const TC_GROUP: usize = 8;

/// How [`SelectKernels::quest_topk`] computes Quest's page scores.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum QuestScoring {
    /// On CUDA cores, every multiply and add rounded on its own in score.rs's order: each score
    /// equals the CPU's bit for bit, so every selection equals the CPU's, ties included.
    #[default]
    Exact,
    /// On tensor cores (a bf16 or f16 MMA of each page's `[kmax ‖ kmin]` row with the group's
    /// `[q+ ; q-]`), for f16 and bf16 keys of head dim 64 or 128 and at most 8 query heads per
    /// KV head; other shapes and f32 keys take [`Exact`](Self::Exact). Products of two 16-bit
    /// elements are exact in f32, so a score differs from the CPU's only by the order of its f32
    /// sums (its last bits), and a selection differs from the CPU's only where pages' scores
    /// tie within that rounding.
    TensorCores,
}

fn device_err(e: impl std::fmt::Debug) -> AlgoError {
    AlgoError::Attn(AttnError::Device(format!("CUDA driver: {e:?}")))
}

fn to_i32(x: usize) -> Result<i32, AlgoError> {
    i32::try_from(x).map_err(|_| AlgoError::Invalid(format!("{x} does not fit an i32")))
}

fn to_u32(x: usize) -> Result<u32, AlgoError> {
    u32::try_from(x).map_err(|_| AlgoError::Invalid(format!("{x} does not fit a u32")))
}

/// sparse-algo's kernels, loaded for one [`Gpu`], launched on its stream (or another stream
/// of its context, through [`SelectKernels::on_stream`]).
#[derive(Clone, Debug)]
pub struct SelectKernels {
    stream: Arc<CudaStream>,
    /// `(quest_minmax, quest_score)` for f32, f16 and bf16, in [`type_index`] order.
    quest: [(CudaFunction, CudaFunction); 3],
    /// `quest_score_tc_*` for f16 and bf16 (outer), head dim 64 and 128 (inner).
    quest_tc: [[CudaFunction; 2]; 2],
    /// `quest_score_tc8_*`, the same over E4M3 summaries.
    quest_tc8: [[CudaFunction; 2]; 2],
    /// Warps of `quest_score_tc_*` the device holds at once.
    tc_resident_warps: usize,
    /// How `quest_topk` scores.
    scoring: QuestScoring,
    /// `dsa_score_*` for f32, f16 and bf16.
    dsa: [CudaFunction; 3],
    /// `pick_rows`, the top-k of every algorithm and element type.
    pick: CudaFunction,
    /// The most dynamic shared memory a Quest scoring CTA may use (set once at load).
    score_smem_max: usize,
    /// The most dynamic shared memory a DSA scoring CTA may use (set once at load).
    dsa_smem_max: usize,
    /// The most dynamic shared memory a selecting CTA may use (set once at load).
    pick_smem_max: usize,
    /// Streaming multiprocessors of the device.
    sms: usize,
    /// Whether the scoring and selecting kernels are programmatic dependent launches
    /// ([`Gpu::dependent_launches`]).
    dependent: bool,
    /// The loaded module (for its `attn_trace` records).
    module: Arc<CudaModule>,
    /// `quest_score_tc_bf16_d128_traced`, `pick_rows_traced` and
    /// `quest_score_tc8_bf16_d128_traced`.
    traced: (CudaFunction, CudaFunction, CudaFunction),
    /// Whether [`quest_topk`](Self::quest_topk) launches the traced kernels where they exist.
    trace: bool,
    /// Whether [`quest_topk`](Self::quest_topk) publishes its rows (see
    /// [`Self::set_publish`]).
    publish: bool,
}

/// `ScoreArgs` of kernels/select.cu: `quest_score_*`'s integer arguments, in its field order.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct ScoreArgs {
    q_heads: i32,
    layer: i32,
    num_slots: i32,
    max_pages: i32,
    kvh: i32,
    d: i32,
    ps: i32,
    budget: i32,
    sink_tokens: i32,
    recent_tokens: i32,
    shared: i32,
    tpp: i32,
    score_stride: i32,
    tiles: i32,
}

// SAFETY: `ScoreArgs` is `#[repr(C)]` plain data of i32 fields, laid out as the kernel's
// struct of the same fields in the same order.
unsafe impl DeviceRepr for ScoreArgs {}

// SAFETY: as above: the kernel's parameter of this type expects exactly these bytes.
unsafe impl KernelValue for ScoreArgs {}

/// `DsaArgs` of kernels/select.cu: `dsa_score_*`'s integer arguments, in its field order.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct DsaArgs {
    heads: i32,
    dim: i32,
    layer: i32,
    num_slots: i32,
    max_tokens: i32,
    topk: i32,
    sink_tokens: i32,
    recent_tokens: i32,
    score_stride: i32,
}

// SAFETY: `DsaArgs` is `#[repr(C)]` plain data of i32 fields, laid out as the kernel's struct
// of the same fields in the same order.
unsafe impl DeviceRepr for DsaArgs {}

/// How `pick_rows` assembles a row: Quest's plan (select.rs, `Plan`) with these settings.
#[derive(Clone, Copy, Debug)]
struct Rule {
    page_size: usize,
    budget_pages: usize,
    always: AlwaysInclude,
}

/// [`RepPool`](crate::RepPool)'s flat array `[layers, slots, max_pages, heads, width]` on the
/// device, in element type `T`, or, for Quest's [`Summary::E4m3`], as one E4M3 code per value
/// plus a scale exponent per (page, head) (`[layers, slots, max_pages, heads]`;
/// [`crate::summary`] has the format). Token counts are not kept: the batch metadata says which
/// pages a step touched.
pub struct DeviceRepPool<T: CudaElement> {
    shape: RepShape,
    layers: usize,
    slots: usize,
    max_pages: usize,
    /// The values in `T` (one unused element for an E4M3 pool).
    data: CudaSlice<T>,
    /// An E4M3 pool's codes and scale exponents.
    e4m3: Option<(CudaSlice<u8>, CudaSlice<i8>)>,
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
        Self::with_summary(gpu, shape, layers, slots, max_tokens, Summary::Exact)
    }

    /// A zeroed pool whose values are stored as `summary` says (Quest's
    /// [`QuestConfig::summary`](crate::QuestConfig::summary)).
    pub fn with_summary(
        gpu: &Gpu,
        shape: RepShape,
        layers: usize,
        slots: usize,
        max_tokens: usize,
        summary: Summary,
    ) -> Result<Self, AlgoError> {
        let (max_pages, len) = pool_extent(shape, layers, slots, max_tokens)?;
        let (data, e4m3) = match summary {
            Summary::Exact => (gpu.zeros(len)?, None),
            Summary::E4m3 => {
                let rows = len / shape.width.max(1);
                (gpu.zeros(1)?, Some((gpu.zeros(len)?, gpu.zeros(rows)?)))
            }
        };
        Ok(DeviceRepPool {
            shape,
            layers,
            slots,
            max_pages,
            data,
            e4m3,
        })
    }

    /// How the pool stores its values.
    pub fn summary(&self) -> Summary {
        if self.e4m3.is_some() {
            Summary::E4m3
        } else {
            Summary::Exact
        }
    }

    /// An E4M3 pool's codes `[layers, slots, max_pages, heads, width]` and scale exponents
    /// `[layers, slots, max_pages, heads]`; `None` for a pool of `T` values.
    pub fn e4m3(&self) -> Option<(&CudaSlice<u8>, &CudaSlice<i8>)> {
        self.e4m3.as_ref().map(|(c, e)| (c, e))
    }

    /// An E4M3 pool's codes and exponents for writers other than this crate's kernels (a
    /// host-built pool's rows uploaded, [`crate::summary::encode_row`]).
    pub fn e4m3_mut(&mut self) -> Option<(&mut CudaSlice<u8>, &mut CudaSlice<i8>)> {
        self.e4m3.as_mut().map(|(c, e)| (c, e))
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
        match &self.e4m3 {
            Some((codes, exps)) => codes.len() + exps.len(),
            None => self.data.len() * size_of::<T>(),
        }
    }

    /// The whole array, `[layers, slots, max_pages, heads, width]` (one unused element in an
    /// E4M3 pool: see [`Self::e4m3`]).
    pub fn data(&self) -> &CudaSlice<T> {
        &self.data
    }

    /// The whole array, for writers other than this crate's kernels: a model writes its DSA
    /// indexer keys here, token `t` of `(layer, slot)` at row `(layer * slots + slot) *
    /// max_pages + t` of `width` elements (pages are single tokens).
    pub fn data_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.data
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
    /// One selection row per sequence (shared by its KV heads), else one per (sequence, head).
    shared: bool,
    /// `[selection rows, score_stride]` ordered score keys, zero between launches unless
    /// `keys_left`.
    scores: CudaSlice<u32>,
    /// The last selection left its keys in `scores` (its scoring kernel stored every key, so
    /// `pick_rows` did not zero them); a scoring kernel that merges by atomicMax needs them
    /// zeroed first.
    keys_left: bool,
    score_stride: usize,
    /// Selection rows (sequences, or (sequence, KV head) pairs).
    sel_rows: usize,
    /// `[selection rows]` flags `pick_rows` sets to the step's value (`epoch`) as it publishes
    /// each row (see [`SelectKernels::set_publish`]).
    ready: CudaSlice<u32>,
    /// `[1]` the step's value, which each publishing scoring launch advances on the device.
    epoch: CudaSlice<u32>,
    /// Whether the last selection was published through `ready` (see [`Self::published`]).
    published: bool,
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
        let stride = max_tokens.div_ceil(quest.config().page_size).max(1);
        let rows = Rows {
            num_seqs,
            kv_heads,
            shared,
            per_sequence,
        };
        Self::alloc(gpu, rows, quest.row_width(), stride)
    }

    /// Buffers for StreamingLLM's rows of `num_seqs` sequences with `kv_heads` KV heads: once
    /// per sequence when `per_sequence`, else once per KV head (every head keeps the same
    /// pages).
    pub fn streaming(
        gpu: &Gpu,
        streaming: &StreamingLlm,
        num_seqs: usize,
        kv_heads: usize,
        per_sequence: bool,
    ) -> Result<Self, AlgoError> {
        let rows = Rows::head_shared(num_seqs, kv_heads, per_sequence);
        // No scores: the rows are forced pages only.
        Self::alloc(gpu, rows, streaming.row_width(), 0)
    }

    /// Buffers for DSA token selections of `num_seqs` sequences of up to `max_tokens` tokens
    /// with `kv_heads` KV heads: once per sequence when `per_sequence`, else once per KV head
    /// (every head gets the same tokens).
    pub fn dsa(
        gpu: &Gpu,
        dsa: &Dsa,
        num_seqs: usize,
        kv_heads: usize,
        max_tokens: usize,
        per_sequence: bool,
    ) -> Result<Self, AlgoError> {
        let rows = Rows::head_shared(num_seqs, kv_heads, per_sequence);
        Self::alloc(gpu, rows, dsa.row_width(), max_tokens.max(1))
    }

    /// Zeroed buffers: `rows`' selection rows of `width` ids and `stride` score keys each.
    fn alloc(gpu: &Gpu, rows: Rows, width: usize, stride: usize) -> Result<Self, AlgoError> {
        let sel_rows = if rows.shared {
            rows.num_seqs
        } else {
            rows.num_seqs * rows.kv_heads
        };
        let copies = if !rows.shared || rows.per_sequence {
            1
        } else {
            rows.kv_heads
        };
        let out_rows = sel_rows * copies;
        Ok(DeviceTopK {
            sel: DeviceSelection::from_device(
                gpu.zeros(out_rows * width)?,
                gpu.zeros(out_rows)?,
                width,
            )?,
            covered: gpu.zeros(out_rows)?,
            copies,
            shared: rows.shared,
            scores: gpu.zeros((sel_rows * stride).max(1))?,
            keys_left: false,
            score_stride: stride,
            sel_rows,
            ready: gpu.zeros(sel_rows.max(1))?,
            epoch: gpu.zeros(1)?,
            published: false,
        })
    }

    /// The flags through which the last [`SelectKernels::quest_topk`] published its rows
    /// ([`SelectKernels::set_publish`]): what [`Gpu::sparse_page_attention_published`] takes
    /// to start before the top-k ends. `None` where the last selection was not published.
    pub fn published(&self) -> Option<Published<'_>> {
        self.published.then_some(Published {
            flags: &self.ready,
            epoch: &self.epoch,
            rows_per_flag: self.copies,
        })
    }

    /// Checks that these buffers were made for `sel_rows` selection rows of `width`, shared or
    /// not, and, where `scored` is `Some((max_len, ps))`, with room for the score keys of
    /// sequences of `max_len` tokens in pages of `ps` tokens.
    fn check(
        &self,
        sel_rows: usize,
        shared: bool,
        width: usize,
        scored: Option<(usize, usize)>,
    ) -> Result<(), AlgoError> {
        if self.sel_rows != sel_rows
            || self.shared != shared
            || self.sel.rows != sel_rows * self.copies
            || self.sel.max_len != width
        {
            return Err(AlgoError::Invalid(format!(
                "top-k buffers of {} rows of {} for {sel_rows} selection rows of {width}",
                self.sel.rows, self.sel.max_len
            )));
        }
        if let Some((max_len, ps)) = scored
            && max_len.div_ceil(ps) > self.score_stride
        {
            return Err(AlgoError::Invalid(format!(
                "sequences of {max_len} tokens; the top-k buffers were made for {}",
                self.score_stride * ps
            )));
        }
        Ok(())
    }
}

/// The shape of a [`DeviceTopK`]'s rows.
#[derive(Clone, Copy, Debug)]
struct Rows {
    num_seqs: usize,
    kv_heads: usize,
    shared: bool,
    per_sequence: bool,
}

impl Rows {
    /// One selection per sequence, shared by its KV heads.
    fn head_shared(num_seqs: usize, kv_heads: usize, per_sequence: bool) -> Rows {
        Rows {
            num_seqs,
            kv_heads,
            shared: true,
            per_sequence,
        }
    }
}

/// [`SelectKernels::quest_topk`]'s inputs, checked by it, for its two launches.
struct Inputs<'a, T: CudaElement> {
    quest: &'a Quest,
    q: &'a CudaSlice<T>,
    q_heads: usize,
    meta: &'a DeviceBatch,
    layer: usize,
    slots: &'a CudaSlice<i32>,
    pool: &'a DeviceRepPool<T>,
    /// The rows are published: the scoring advances the step's value.
    publish: bool,
}

// Derived Clone/Copy would ask T: Copy; every field is a reference or an integer.
impl<T: CudaElement> Clone for Inputs<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T: CudaElement> Copy for Inputs<'_, T> {}

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
                load(format!("quest_score_{t}"))?,
            ))
        };
        let quest = [pair("f32")?, pair("f16")?, pair("bf16")?];
        let tc = |kind: &str| -> Result<[[CudaFunction; 2]; 2], AlgoError> {
            Ok([
                [
                    load(format!("quest_score_{kind}_f16_d64"))?,
                    load(format!("quest_score_{kind}_f16_d128"))?,
                ],
                [
                    load(format!("quest_score_{kind}_bf16_d64"))?,
                    load(format!("quest_score_{kind}_bf16_d128"))?,
                ],
            ])
        };
        let (quest_tc, quest_tc8) = (tc("tc")?, tc("tc8")?);
        // The tensor-core kernels use no dynamic shared memory: one occupancy for every call.
        let mut tc_per_sm = u32::MAX;
        for f in quest_tc.iter().chain(&quest_tc8).flatten() {
            let n = f
                .occupancy_max_active_blocks_per_multiprocessor(to_u32(TC_WARPS * 32)?, 0, None)
                .map_err(device_err)?;
            tc_per_sm = tc_per_sm.min(n);
        }
        let sms = gpu.multiprocessors();
        let tc_resident_warps = (sms * tc_per_sm as usize * TC_WARPS).max(TC_WARPS);
        let dsa = [
            load("dsa_score_f32".to_owned())?,
            load("dsa_score_f16".to_owned())?,
            load("dsa_score_bf16".to_owned())?,
        ];
        let pick = load("pick_rows".to_owned())?;
        let traced = (
            load("quest_score_tc_bf16_d128_traced".to_owned())?,
            load("pick_rows_traced".to_owned())?,
            load("quest_score_tc8_bf16_d128_traced".to_owned())?,
        );
        // Scoring CTAs hold the group's queries and two tiles, a selecting CTA a row's keys:
        // allow them, once, all the device offers beyond the kernels' static arrays.
        let optin = gpu
            .context()
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(device_err)?;
        let allow_all = |f: &CudaFunction| -> Result<usize, AlgoError> {
            let fixed = f
                .get_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
                .map_err(device_err)?;
            let free = usize::try_from(optin - fixed).unwrap_or(0);
            f.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                to_i32(free)?,
            )
            .map_err(device_err)?;
            Ok(free)
        };
        let mut score_smem_max = usize::MAX;
        for (_, f) in &quest {
            score_smem_max = score_smem_max.min(allow_all(f)?);
        }
        let mut dsa_smem_max = usize::MAX;
        for f in &dsa {
            dsa_smem_max = dsa_smem_max.min(allow_all(f)?);
        }
        let pick_smem_max = allow_all(&pick)?;
        allow_all(&traced.1)?;
        Ok(SelectKernels {
            stream: gpu.stream().clone(),
            quest,
            quest_tc,
            quest_tc8,
            tc_resident_warps,
            scoring: QuestScoring::default(),
            dsa,
            pick,
            score_smem_max,
            dsa_smem_max,
            pick_smem_max,
            sms,
            dependent: gpu.dependent_launches(),
            module,
            traced,
            trace: false,
            publish: false,
        })
    }

    /// Has [`quest_topk`](Self::quest_topk) publish each row of its selection, from now on,
    /// through a per-row flag that `pick_rows` sets once it has written the row
    /// ([`DeviceTopK::published`]). Attention launched right after through
    /// [`Gpu::sparse_page_attention_published`] then starts before the top-k ends: its CTAs
    /// read their queries and metadata first, and each waits only for its own row (measured
    /// 0.064 -> 0.061 ms for the Quest step at B8 L32K on an H200, BENCHMARKS.md). The
    /// selections are the same as without. Only with programmatic dependent launches
    /// ([`Self::set_dependent_launches`]) do the two launches run at once. The flags' value is
    /// a counter in device memory that the scoring launch advances, so the step may be
    /// captured in a CUDA graph and replayed.
    pub fn set_publish(&mut self, on: bool) {
        self.publish = on;
    }

    /// Has [`quest_topk`](Self::quest_topk) launch, from now on, the traced scoring kernel
    /// (for bf16 keys at head dim 128 on tensor cores) and the traced selecting kernel, which
    /// write per-CTA timestamps (kernels/trace.cuh) for [`take_trace`](Self::take_trace); `false`
    /// goes back to the untraced ones.
    pub fn set_trace(&mut self, on: bool) {
        self.trace = on;
    }

    /// The records the traced kernels wrote since the last call, as
    /// [`Gpu::take_attn_trace`] returns the attention's
    /// ([`TRACE_WORDS`](attn_op::cuda::TRACE_WORDS) words per CTA): the scoring CTAs' from
    /// record 0, the selecting CTAs' from record [`PICK_TRACE_FIRST`]. Synchronizes this
    /// stream, reads the records and zeroes them.
    pub fn take_trace(&self) -> Result<Vec<u64>, AlgoError> {
        Ok(attn_op::cuda::take_trace(&self.module, &self.stream)?)
    }

    /// Turns programmatic dependent launches of the Quest scoring and selecting kernels on or
    /// off (for the bench's comparison); they start as [`Gpu::dependent_launches`] says, and
    /// stay off on a device without them.
    pub fn set_dependent_launches(&mut self, gpu: &Gpu, on: bool) {
        self.dependent = on && gpu.has_sm90_features();
    }

    /// The same kernels, and the same scoring, launched on `stream`, a stream of the same
    /// context: a selection on a copy stream, say, under compute on another. Ordering work
    /// across the two streams (events) is the caller's.
    pub fn on_stream(&self, stream: Arc<CudaStream>) -> Self {
        SelectKernels {
            stream,
            ..self.clone()
        }
    }

    /// How [`quest_topk`](Self::quest_topk) scores from now on.
    pub fn set_quest_scoring(&mut self, scoring: QuestScoring) {
        self.scoring = scoring;
    }

    /// How [`quest_topk`](Self::quest_topk) scores.
    pub fn quest_scoring(&self) -> QuestScoring {
        self.scoring
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
        if meta.layout() != &layout {
            return Err(AlgoError::Invalid(format!(
                "the batch was validated against {:?}, the keys are {layout:?}",
                meta.layout()
            )));
        }
        let (kvh, d) = self.check_quest_pool(quest, meta, layer, slots, pool)?;
        let ps = quest.config().page_size;
        let vec = 16 / size_of::<T>();
        // An E4M3 row's threads find its scale by shuffles within one warp.
        if pool.e4m3.is_some() && !32usize.is_multiple_of(d / vec) {
            return Err(AlgoError::Invalid(format!(
                "E4M3 summaries on the device take head dims whose {vec}-element vectors \
                 divide 32, not {d}"
            )));
        }
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
        // Null pointers (which the kernel never dereferences) for a pool of T values.
        let none: u64 = 0;
        match &mut pool.e4m3 {
            Some((codes, exps)) => b.arg(codes).arg(exps),
            None => b.arg(&none).arg(&none),
        };
        // SAFETY: the arguments follow `quest_minmax_*` in kernels/select.cu; the batch was
        // validated against the keys' layout (block ids are range-checked in the kernel), the
        // pool holds `[layers, slots, max_pages, kv_heads, 2 d]` with every sequence's pages
        // within max_pages (checked above), slots are range-checked in the kernel, and d is a
        // multiple of the 16-byte vector; an E4M3 pool's codes have the same shape and its
        // exponents one per (page, head), and a row's vectors divide a warp (checked above).
        unsafe { b.launch(cfg) }.map_err(device_err)?;
        Ok(())
    }

    /// Quest's decode selection for the batch `meta` (one query row per sequence; the last
    /// row of each sequence's queries is used), from `q` (`[total_q, q_heads, head_dim]`, the
    /// tensor attention reads) and the min/max pages of `layer`, written into `out` as
    /// [`Quest::retrieve_topk`] answers for the same inputs (rows equal, padding -1). Two
    /// launches: the estimate (scores of every mid page, as [`quest_scoring`](Self::quest_scoring)
    /// says), then the top-k of each row.
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
        let (kvh, d) = self.check_quest_pool(quest, meta, layer, slots, pool)?;
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
        out.check(
            sel_rows,
            c.shared_heads,
            quest.row_width(),
            Some((meta.max_kv_len(), c.page_size)),
        )?;
        // Rows published only by this launch's scoring and pick_rows (none where nothing
        // runs).
        out.published = false;
        if n == 0 {
            return Ok(());
        }
        let inputs = Inputs {
            quest,
            q,
            q_heads,
            meta,
            layer,
            slots,
            pool,
            publish: self.publish,
        };
        let tc = match (pool.summary(), self.scoring) {
            (Summary::E4m3, _) => {
                Some(self.tc_kernel::<T>(q_heads / kvh, d, true).ok_or_else(|| {
                    AlgoError::Invalid(format!(
                        "E4M3 summaries are scored on tensor cores only: f16 or bf16 queries \
                         of head dim 64 or 128, at most {TC_GROUP} per KV head (not {} of \
                         dim {d})",
                        q_heads / kvh
                    ))
                })?)
            }
            (Summary::Exact, QuestScoring::TensorCores) => {
                self.tc_kernel::<T>(q_heads / kvh, d, false)
            }
            (Summary::Exact, QuestScoring::Exact) => None,
        };
        // The tensor-core kernel stores every key of a per-head row; the others merge by
        // atomicMax into zeroed keys.
        let stores_keys = tc.is_some() && !c.shared_heads;
        if !stores_keys && out.keys_left {
            self.stream
                .memset_zeros(&mut out.scores)
                .map_err(device_err)?;
            out.keys_left = false;
        }
        let tc = match (tc, pool.summary()) {
            (Some(_), summary) if self.trace && T::DTYPE == DType::BF16 && d == 128 => {
                Some(match summary {
                    Summary::Exact => &self.traced.0,
                    Summary::E4m3 => &self.traced.2,
                })
            }
            (other, _) => other,
        };
        match tc {
            Some(f) => self.launch_score_tc(f, &inputs, out)?,
            None => self.launch_score(&inputs, out)?,
        }
        let rule = Rule {
            page_size: c.page_size,
            budget_pages: quest.budget_pages(),
            always: c.always,
        };
        self.launch_pick(
            meta,
            Some((slots, pool.slots)),
            rule,
            stores_keys,
            self.publish,
            out,
        )
    }

    /// StreamingLLM's decode selection for the batch `meta`, written into `out` as
    /// [`StreamingLlm::retrieve_topk`] answers (rows equal, padding -1): the sink and window
    /// pages of every sequence, through the selecting kernel with nothing to score.
    ///
    /// [`StreamingLlm::retrieve_topk`]: crate::SparseAlgorithm::retrieve_topk
    pub fn streaming_topk(
        &self,
        streaming: &StreamingLlm,
        meta: &DeviceBatch,
        out: &mut DeviceTopK,
    ) -> Result<(), AlgoError> {
        let c = streaming.config();
        out.check(meta.num_seqs(), true, streaming.row_width(), None)?;
        if meta.num_seqs() == 0 {
            return Ok(());
        }
        let rule = Rule {
            page_size: c.page_size,
            budget_pages: 0,
            always: AlwaysInclude {
                sink_tokens: c.sink_tokens,
                recent_tokens: c.window_tokens,
            },
        };
        // Nothing scored advances the step's value: these rows are never published.
        self.launch_pick(meta, None, rule, false, false, out)
    }

    /// DSA's decode selection with a trained indexer for the batch `meta`, written into `out`
    /// as [`Dsa::retrieve_topk`] answers for the same inputs (rows equal, padding -1). `q` is
    /// `[num_seqs, heads, dim]` indexer queries and `weights` `[num_seqs, heads]` their head
    /// weights (what [`Indexer::queries`] writes), and `pool` holds the indexer keys of
    /// `layer` (see [`DeviceRepPool::data_mut`]); the caller keeps every sequence's keys
    /// written up to its length. Two launches: the scores of every mid token, then the top-k.
    ///
    /// [`Dsa::retrieve_topk`]: crate::SparseAlgorithm::retrieve_topk
    /// [`Indexer::queries`]: crate::Indexer::queries
    #[allow(
        clippy::too_many_arguments,
        reason = "the CPU entry point's inputs, as device buffers"
    )]
    pub fn dsa_topk<T: CudaElement>(
        &self,
        dsa: &Dsa,
        q: &CudaSlice<f32>,
        weights: &CudaSlice<f32>,
        meta: &DeviceBatch,
        layer: usize,
        slots: &CudaSlice<i32>,
        pool: &DeviceRepPool<T>,
        out: &mut DeviceTopK,
    ) -> Result<(), AlgoError> {
        let Some(ix) = dsa.indexer() else {
            return Err(AlgoError::Config(
                "the device DSA needs a trained indexer; the fallback reads every key".to_owned(),
            ));
        };
        let (heads, dim) = (ix.heads(), ix.dim());
        let want = RepShape {
            page_size: 1,
            heads: 1,
            width: dim,
        };
        self.check_pool(want, dim, meta, layer, slots, pool)?;
        let n = meta.num_seqs();
        crate::error::check_len("indexer queries", q.len(), n * heads * dim)?;
        crate::error::check_len("indexer weights", weights.len(), n * heads)?;
        let c = dsa.config();
        out.check(n, true, dsa.row_width(), Some((meta.max_kv_len(), 1)))?;
        if n == 0 {
            return Ok(());
        }
        let tile_at = ((heads * dim + heads) * size_of::<f32>()).div_ceil(16) * 16;
        let smem = tile_at + DSA_THREADS * (dim * size_of::<T>() + 16);
        if smem > self.dsa_smem_max {
            return Err(AlgoError::Invalid(format!(
                "an indexer of {heads} heads of {dim} needs {smem} bytes of shared memory; the \
                 device offers {}",
                self.dsa_smem_max
            )));
        }
        let args = DsaArgs {
            heads: to_i32(heads)?,
            dim: to_i32(dim)?,
            layer: to_i32(layer)?,
            num_slots: to_i32(pool.slots)?,
            max_tokens: to_i32(pool.max_pages)?,
            topk: to_i32(c.topk)?,
            sink_tokens: to_i32(c.always.sink_tokens as usize)?,
            recent_tokens: to_i32(c.always.recent_tokens as usize)?,
            score_stride: to_i32(out.score_stride)?,
        };
        let cfg = LaunchConfig {
            grid_dim: (
                to_u32(meta.max_kv_len().div_ceil(DSA_THREADS).max(1))?,
                to_u32(n)?,
                1,
            ),
            block_dim: (to_u32(DSA_THREADS)?, 1, 1),
            shared_mem_bytes: to_u32(smem)?,
        };
        let mut b = self.stream.launch_builder(&self.dsa[type_index::<T>()]);
        b.arg(q)
            .arg(weights)
            .arg(&pool.data)
            .arg(slots)
            .arg(meta.seq_lens_kv())
            .arg(&args)
            .arg(&mut out.scores);
        // SAFETY: the arguments follow `dsa_score_*` in kernels/select.cu; q and weights hold
        // num_seqs * heads * dim and num_seqs * heads floats (checked above); the pool is
        // `[layers, slots, max_tokens, dim]` with every sequence within max_tokens (checked);
        // scores hold score_stride >= max_kv_len keys per sequence (checked by out.check), and
        // the kernel writes mid tokens below it only; the dynamic shared memory holds the
        // queries, weights and a tile of DSA_THREADS padded key rows (within the limit set at
        // load); dim is a multiple of 16 elements, so rows are 16-byte aligned; slots are
        // range-checked in the kernel.
        unsafe { b.launch(cfg) }.map_err(device_err)?;
        let rule = Rule {
            page_size: 1,
            budget_pages: c.topk,
            always: c.always,
        };
        // `dsa_score_*` stores every mid token's key; the rows are never published (token
        // attention takes no flags).
        self.launch_pick(meta, Some((slots, pool.slots)), rule, true, false, out)
    }

    /// The estimate: `quest_score_*` over every (selection row, head, tile of mid pages).
    fn launch_score<T: CudaElement>(
        &self,
        inputs: &Inputs<'_, T>,
        out: &mut DeviceTopK,
    ) -> Result<(), AlgoError> {
        let Inputs {
            quest,
            q_heads,
            meta,
            ..
        } = *inputs;
        let c = quest.config();
        let (kvh, d) = (meta.layout().kv_heads, meta.layout().head_dim);
        let g = q_heads / kvh;
        let heads = if c.shared_heads { kvh } else { 1 };
        // Threads per page: the fewest that keep a tile of SCORE_THREADS / tpp rows within
        // TILE_BYTES.
        let row_bytes = 2 * d * size_of::<T>();
        let mut tpp = 1;
        while tpp < SCORE_THREADS && SCORE_THREADS / tpp * row_bytes > TILE_BYTES {
            tpp *= 2;
        }
        let tile_pages = SCORE_THREADS / tpp;
        let smem = g * d * (size_of::<f32>() + size_of::<T>()) + 2 * tile_pages * (row_bytes + 16);
        if smem > self.score_smem_max {
            return Err(AlgoError::Invalid(format!(
                "a group of {g} query heads of {d} needs {smem} bytes of shared memory; the \
                 device offers {}",
                self.score_smem_max
            )));
        }
        let tiles = meta
            .max_kv_len()
            .div_ceil(c.page_size)
            .div_ceil(tile_pages)
            .max(1);
        let items = out.sel_rows * heads * tiles;
        // As many CTAs as the device holds at once, each taking a run of consecutive items.
        let func = &self.quest[type_index::<T>()].1;
        let per_sm = func
            .occupancy_max_active_blocks_per_multiprocessor(to_u32(SCORE_THREADS)?, smem, None)
            .map_err(device_err)?;
        let resident = (self.sms * per_sm as usize).max(1);
        let per_cta = items.div_ceil(resident);
        let ctas = items.div_ceil(per_cta);
        let (items, per_cta) = (to_i32(items)?, to_i32(per_cta)?);
        let cfg = LaunchConfig {
            grid_dim: (to_u32(ctas)?, 1, 1),
            block_dim: (to_u32(SCORE_THREADS)?, 1, 1),
            shared_mem_bytes: to_u32(smem)?,
        };
        self.launch_scores(func, inputs, out, (tpp, tiles), (items, per_cta), cfg)
    }

    /// The tensor-core scoring kernel for `T`, a group of `g` query heads and head dim `d`, if
    /// it takes that shape.
    fn tc_kernel<T: CudaElement>(&self, g: usize, d: usize, e4m3: bool) -> Option<&CudaFunction> {
        let table = if e4m3 {
            &self.quest_tc8
        } else {
            &self.quest_tc
        };
        let by_type = match T::DTYPE {
            DType::F32 => return None,
            DType::F16 => &table[0],
            DType::BF16 => &table[1],
        };
        if g > TC_GROUP {
            return None;
        }
        match d {
            64 => Some(&by_type[0]),
            128 => Some(&by_type[1]),
            _ => None,
        }
    }

    /// The estimate on tensor cores: `quest_score_tc_*` (function `func`) over every (selection
    /// row, head, tile of 16 mid pages), each warp taking a run of consecutive items.
    fn launch_score_tc<T: CudaElement>(
        &self,
        func: &CudaFunction,
        inputs: &Inputs<'_, T>,
        out: &mut DeviceTopK,
    ) -> Result<(), AlgoError> {
        let Inputs { quest, meta, .. } = *inputs;
        let c = quest.config();
        let kvh = meta.layout().kv_heads;
        let heads = if c.shared_heads { kvh } else { 1 };
        let tiles = meta
            .max_kv_len()
            .div_ceil(c.page_size)
            .min(out.score_stride)
            .div_ceil(TC_PAGES)
            .max(1);
        let items = out.sel_rows * heads * tiles;
        let per_warp = items.div_ceil(self.tc_resident_warps);
        let ctas = items.div_ceil(per_warp).div_ceil(TC_WARPS);
        let (items, per_warp) = (to_i32(items)?, to_i32(per_warp)?);
        let cfg = LaunchConfig {
            grid_dim: (to_u32(ctas)?, 1, 1),
            block_dim: (to_u32(TC_WARPS * 32)?, 1, 1),
            shared_mem_bytes: 0,
        };
        // tpp is unused there: a warp scores whole pages.
        self.launch_scores(func, inputs, out, (1, tiles), (items, per_warp), cfg)
    }

    /// Launches a Quest scoring kernel (`func`: `quest_score_*` or `quest_score_tc_*`, one
    /// signature) with `tpp` threads per page and `tiles` tiles per (row, head), each CTA
    /// (`quest_score_*`) or warp (`quest_score_tc_*`) taking `per` of the `items`.
    fn launch_scores<T: CudaElement>(
        &self,
        func: &CudaFunction,
        inputs: &Inputs<'_, T>,
        out: &mut DeviceTopK,
        (tpp, tiles): (usize, usize),
        (items, per): (i32, i32),
        cfg: LaunchConfig,
    ) -> Result<(), AlgoError> {
        let (quest, meta, pool) = (inputs.quest, inputs.meta, inputs.pool);
        let c = quest.config();
        let args = ScoreArgs {
            q_heads: to_i32(inputs.q_heads)?,
            layer: to_i32(inputs.layer)?,
            num_slots: to_i32(pool.slots)?,
            max_pages: to_i32(pool.max_pages)?,
            kvh: to_i32(meta.layout().kv_heads)?,
            d: to_i32(meta.layout().head_dim)?,
            ps: to_i32(c.page_size)?,
            budget: to_i32(quest.budget_pages())?,
            sink_tokens: to_i32(c.always.sink_tokens as usize)?,
            recent_tokens: to_i32(c.always.recent_tokens as usize)?,
            shared: i32::from(c.shared_heads),
            tpp: to_i32(tpp)?,
            score_stride: to_i32(out.score_stride)?,
            tiles: to_i32(tiles)?,
        };
        let mut b = Launch::new(&self.stream, func);
        b.dependent(self.dependent);
        b.arg(inputs.q).arg(meta.cu_seqlens_q());
        match &pool.e4m3 {
            Some((codes, _)) => b.arg(codes),
            None => b.arg(&pool.data),
        };
        b.arg(inputs.slots)
            .arg(meta.seq_lens_kv())
            .arg(&args)
            .arg(&items)
            .arg(&per)
            .arg(&mut out.scores);
        // The step's value where the rows are published, else a null pointer, which the
        // kernels never read.
        let no_epoch: u64 = 0;
        if inputs.publish {
            b.arg(&mut out.epoch);
        } else {
            b.arg(&no_epoch);
        }
        // `quest_score_tc8_*`'s last argument: the scale exponents.
        if let Some((_, exps)) = &pool.e4m3 {
            b.arg(exps);
        }
        // SAFETY: the arguments follow `quest_score_*` and `quest_score_tc_*` in
        // kernels/select.cu (the latter compiled for this element type and head dim, with at
        // most 8 heads per group: `tc_kernel`); q holds total_q * q_heads * d elements and
        // every sequence has a query row; the pool's shape and extent were checked against the
        // batch, and the kernels read only pages below a row's mid end; scores hold
        // score_stride keys per selection row and the kernels write below min(mid,
        // score_stride); the callers sized the dynamic shared memory of `quest_score_*` for the
        // group's g d queries, their g d element-sized masks and two tiles of SCORE_THREADS /
        // tpp padded rows (within the limit set at load); slots are range-checked in the
        // kernels; the epoch, where given, holds one value; an E4M3 pool (which only
        // `quest_score_tc8_*` is given, with its exponents last) holds a code per value and an
        // exponent per (page, head).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// The rows: `pick_rows`, one CTA per selection row, selecting `rule`'s pick from the score
    /// keys (none with a budget of 0) of sequences whose slot, where `slots` is given with the
    /// pool's slot count, is valid. With `keys_stored` (the scoring kernel wrote every key a
    /// row reads), the keys are left as they are; else they are zeroed for the next launch.
    /// With `publish` (the scoring just launched advanced the step's value), each row's flag
    /// is set to that value once the row is written. With a budget, the launch right before
    /// must be the rows' scoring kernel: the rows' plan (forced pages, padding, lengths) is
    /// written before the kernel waits for it (kernels/select.cu, `pick_body`).
    #[allow(
        clippy::too_many_arguments,
        reason = "the rows' inputs and how the launch treats its keys and flags"
    )]
    fn launch_pick(
        &self,
        meta: &DeviceBatch,
        slots: Option<(&CudaSlice<i32>, usize)>,
        rule: Rule,
        keys_stored: bool,
        publish: bool,
        out: &mut DeviceTopK,
    ) -> Result<(), AlgoError> {
        let kvh = meta.layout().kv_heads;
        let keys = out.score_stride * size_of::<u32>();
        let keys_smem = PICK_HIST_BYTES + keys <= self.pick_smem_max;
        let cfg = LaunchConfig {
            grid_dim: (to_u32(out.sel_rows)?, 1, 1),
            block_dim: (to_u32(PICK_THREADS)?, 1, 1),
            shared_mem_bytes: to_u32(PICK_HIST_BYTES + if keys_smem { keys } else { 0 })?,
        };
        let ints = [
            slots.map_or(0, |(_, n)| n),
            kvh,
            rule.page_size,
            rule.budget_pages,
            rule.always.sink_tokens as usize,
            rule.always.recent_tokens as usize,
            usize::from(out.shared),
            out.score_stride,
            usize::from(keys_smem),
            out.sel.max_len,
            out.copies,
            usize::from(!keys_stored),
        ]
        .map(to_i32);
        let ints = ints_ok(ints)?;
        // A null pointer where the rows take no slots.
        let no_slots: u64 = 0;
        let pick = if self.trace {
            &self.traced.1
        } else {
            &self.pick
        };
        let mut b = Launch::new(&self.stream, pick);
        b.dependent(self.dependent);
        match slots {
            Some((s, _)) => b.arg(s),
            None => b.arg(&no_slots),
        };
        b.arg(meta.seq_lens_kv())
            .arg(&ints[0])
            .arg(&ints[1])
            .arg(&ints[2])
            .arg(&ints[3])
            .arg(&ints[4])
            .arg(&ints[5])
            .arg(&ints[6])
            .arg(&mut out.scores)
            .arg(&ints[7])
            .arg(&ints[8])
            .arg(&mut out.sel.ids)
            .arg(&mut out.sel.lens)
            .arg(&mut out.covered)
            .arg(&ints[9])
            .arg(&ints[10])
            .arg(&ints[11]);
        // Published rows: each row's flag set to the next epoch once it is written; else a null
        // pointer, which the kernel never reads.
        let no_flags: u64 = 0;
        out.published = publish;
        if publish {
            b.arg(&mut out.ready).arg(&out.epoch);
        } else {
            b.arg(&no_flags).arg(&no_flags);
        }
        // SAFETY: the arguments follow `pick_rows` in kernels/select.cu; scores hold
        // score_stride keys for each of the sel_rows CTAs, checked against the batch by the
        // callers (a budget of 0 reads none); ids, lens and covered hold sel_rows * copies rows
        // of max_len; the dynamic shared memory holds the two histograms, and with keys_smem a
        // row of keys after them (within the limit set at load); slots, where given, hold
        // num_seqs entries and are range-checked in the kernel; the flags, where given, hold
        // sel_rows entries, one per CTA, and the epoch one value; a null pointer is never
        // read.
        unsafe { b.launch(cfg) }?;
        // A budget of 0 reads and writes no keys.
        if rule.budget_pages > 0 {
            out.keys_left = keys_stored;
        }
        Ok(())
    }

    /// Checks a pool against Quest's min/max shape for the batch's layout (see
    /// [`Self::check_pool`]); the layout's KV heads and head dim.
    fn check_quest_pool<T: CudaElement>(
        &self,
        quest: &Quest,
        meta: &DeviceBatch,
        layer: usize,
        slots: &CudaSlice<i32>,
        pool: &DeviceRepPool<T>,
    ) -> Result<(usize, usize), AlgoError> {
        let (kvh, d) = (meta.layout().kv_heads, meta.layout().head_dim);
        let want = minmax::shape(quest.config().page_size, kvh, d);
        self.check_pool(want, d, meta, layer, slots, pool)?;
        if pool.summary() != quest.config().summary {
            return Err(AlgoError::Invalid(format!(
                "the pool stores {:?} summaries, Quest is configured for {:?}",
                pool.summary(),
                quest.config().summary
            )));
        }
        Ok((kvh, d))
    }

    /// Checks a pool against the shape an algorithm needs (`want`, vectors of `dim`
    /// elements), the layer, the batch's lengths and the slots.
    fn check_pool<T: CudaElement>(
        &self,
        want: RepShape,
        dim: usize,
        meta: &DeviceBatch,
        layer: usize,
        slots: &CudaSlice<i32>,
        pool: &DeviceRepPool<T>,
    ) -> Result<(), AlgoError> {
        if pool.shape != want {
            return Err(AlgoError::Invalid(format!(
                "the pool holds {:?}, the algorithm needs {want:?}",
                pool.shape
            )));
        }
        if !dim.is_multiple_of(16) {
            return Err(AlgoError::Invalid(format!(
                "the device kernels take vectors of a multiple of 16 elements, not {dim}"
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
