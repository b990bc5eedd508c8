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

mod launch;
mod pool;
mod step;
mod topk;

use std::sync::Arc;

use attn_op::cuda::{CudaElement, DeviceBatch, Gpu, KernelValue, compile_source};
use attn_op::{AttnError, DType};
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaFunction, CudaModule, CudaSlice, CudaStream, DeviceRepr};

pub use pool::DeviceRepPool;
pub use topk::DeviceTopK;

use crate::{AlgoError, AlwaysInclude, Quest};

/// The CUDA C source of sparse-algo's kernels (`kernels/common.cuh`, `kernels/pdl.cuh`,
/// `kernels/mma.cuh`, `kernels/trace.cuh`, then `kernels/select.cu`), embedded at build time.
pub const KERNEL_SOURCE: &str = concat!(
    include_str!("../../../../kernels/common.cuh"),
    include_str!("../../../../kernels/pdl.cuh"),
    include_str!("../../../../kernels/mma.cuh"),
    include_str!("../../../../kernels/trace.cuh"),
    include_str!("../../../../kernels/select.cu")
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
    /// `pick_rows_tagged`: `pick_rows` that also tags a published row's ids for the page walk.
    pick_tagged: CudaFunction,
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
        let pick_tagged = load("pick_rows_tagged".to_owned())?;
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
        let pick_smem_max = allow_all(&pick)?.min(allow_all(&pick_tagged)?);
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
            pick_tagged,
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
}
