//! The prototype's kernels (kernels/spec.cu): compiled once, and their launches.

use attn_op::AttnError;
use attn_op::AttnParams;
use attn_op::cuda::{DeviceBatch, DeviceSelection, Gpu, Launch, Published};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use sparse_algo::AlgoError;
use sparse_algo::cuda::DeviceTopK;

use crate::bench::{D, KV_HEADS, Q_HEADS};
use crate::cold::Shape;

/// The prototype's kernels, after kernels/pdl.cuh and the page walk's helpers.
const SOURCE: &str = concat!(
    include_str!("../../../../../kernels/pdl.cuh"),
    include_str!("../../../../../kernels/walk.cu"),
    include_str!("../../../../../kernels/spec.cu")
);

/// The most dynamic shared memory a launch may take without opting in: `spec_pages` stages a
/// block-table row of at most this many bytes.
const SMEM_DEFAULT: usize = 48 * 1024;

/// Warps of a `walk_merge` CTA (`WALK_MERGE_WARPS` in kernels/walk.cu).
const MERGE_WARPS: u32 = 16;

/// The widest row `spec_finish` stages (`SPEC_MAXW` in kernels/spec.cu).
pub(super) const MAX_WIDTH: usize = 256;

/// The compiled kernels.
pub(super) struct Kernels {
    pages: CudaFunction,
    finish: CudaFunction,
    warm: CudaFunction,
    walk_pages: CudaFunction,
    walk_merge: CudaFunction,
    finish_late: CudaFunction,
}

impl Kernels {
    /// The same kernels with the finish of a late walk only (`spec_finish_late`).
    pub(super) fn fixed(&self) -> Kernels {
        Kernels {
            finish: self.finish_late.clone(),
            pages: self.pages.clone(),
            warm: self.warm.clone(),
            walk_pages: self.walk_pages.clone(),
            walk_merge: self.walk_merge.clone(),
            finish_late: self.finish_late.clone(),
        }
    }
}

/// The partials per walked page `[rows, width, 4, D]` and their LSEs, and a flag buffer
/// passed where the top-k publishes nothing.
pub(super) struct Parts {
    pub(super) prev_o: CudaSlice<f32>,
    pub(super) prev_lse: CudaSlice<f32>,
    pub(super) none: CudaSlice<u32>,
}

pub(super) fn compile(gpu: &Gpu) -> Result<Kernels, AlgoError> {
    let ctx = gpu.context();
    let (major, minor) = ctx.compute_capability().map_err(AttnError::from)?;
    // NVRTC takes the architecture for the program's life; one compile a process.
    let arch: &'static str = Box::leak(format!("sm_{major}{minor}").into_boxed_str());
    let ptx = attn_op::cuda::compile_source("kernels/spec.cu", SOURCE, arch)?;
    let module = ctx.load_module(ptx).map_err(AttnError::from)?;
    for name in [
        "spec_pages_bf16_d128",
        "spec_finish_bf16_d128",
        "walk_merge",
    ] {
        use cudarc::driver::sys::CUfunction_attribute as A;
        let func = module.load_function(name).map_err(AttnError::from)?;
        let attr = |a| func.get_attribute(a).map_err(AttnError::from);
        println!(
            "{name}: {} registers, {} bytes of local memory a thread",
            attr(A::CU_FUNC_ATTRIBUTE_NUM_REGS)?,
            attr(A::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)?
        );
    }
    let f = |name: &str| {
        module
            .load_function(name)
            .map_err(|e| AlgoError::from(AttnError::from(e)))
    };
    Ok(Kernels {
        pages: f("spec_pages_bf16_d128")?,
        finish: f("spec_finish_bf16_d128")?,
        warm: f("spec_warm_bf16_d128")?,
        walk_pages: f("walk_pages_bf16")?,
        walk_merge: f("walk_merge")?,
        finish_late: f("spec_finish_late_bf16_d128")?,
    })
}

pub(super) fn int(x: usize) -> Result<i32, AlgoError> {
    i32::try_from(x).map_err(|_| AlgoError::Invalid(format!("{x} does not fit an i32")))
}

/// The softmax scale times log2 e: the kernels' scores are in base 2.
fn scale2() -> f32 {
    AttnParams::new(Q_HEADS, D).scale * std::f32::consts::LOG2_E
}

/// Both kernels' first ten arguments: q, K, V, the decode's metadata and `ints`' first four
/// (max_blocks, num_blocks, kv_heads, q_heads).
fn common_args<'a>(
    l: &mut Launch<'a>,
    sh: &'a Shape<'_>,
    decode: &'a DeviceBatch,
    ints: &'a [i32],
) {
    l.arg(sh.q)
        .arg(sh.kv.k())
        .arg(sh.kv.v())
        .arg(decode.cu_seqlens_q())
        .arg(decode.seq_lens_kv())
        .arg(decode.block_table())
        .arg(&ints[0])
        .arg(&ints[1])
        .arg(&ints[2])
        .arg(&ints[3]);
}

/// A walk's launch over the rows of `sel` (a CTA of 4 warps per 4 places, the block-table row
/// staged in dynamic shared memory where `staged`) and its integers: max_blocks, num_blocks,
/// kv_heads, q_heads, the rows' width, 0 (the caller's), and whether the table is staged.
fn walk_setup(
    kernel: &str,
    sh: &Shape<'_>,
    decode: &DeviceBatch,
    sel: &DeviceSelection,
    staged: bool,
) -> Result<([i32; 7], LaunchConfig), AlgoError> {
    let table = if staged {
        decode.max_blocks() * size_of::<i32>()
    } else {
        0
    };
    if table > SMEM_DEFAULT {
        return Err(AlgoError::Invalid(format!(
            "{kernel} stages a block-table row of at most {SMEM_DEFAULT} bytes, not {table}"
        )));
    }
    let ints = [
        int(decode.max_blocks())?,
        int(sh.layout.num_blocks)?,
        int(KV_HEADS)?,
        int(Q_HEADS)?,
        int(sel.max_len)?,
        0,
        i32::from(staged),
    ];
    let grid = |x: usize| u32::try_from(x).map_err(|_| AlgoError::Invalid("grid".into()));
    let cfg = LaunchConfig {
        grid_dim: (grid(sel.max_len.div_ceil(4))?, grid(sel.rows)?, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: grid(table)?,
    };
    Ok((ints, cfg))
}

/// `after`: `None` on a stream of its own; else right after the top-k, which published its
/// rows or not.
pub(super) fn launch_pages(
    k: &Kernels,
    stream: &CudaStream,
    after: Option<Option<Published<'_>>>,
    sh: &Shape<'_>,
    decode: &DeviceBatch,
    prev: &DeviceSelection,
    parts: &mut Parts,
) -> Result<(), AlgoError> {
    // A walk after the top-k stages its sequence's block-table row in shared memory.
    let (mut ints, cfg) = walk_setup("spec_pages", sh, decode, prev, after.is_some())?;
    ints[5] = i32::from(matches!(after, Some(Some(_))));
    let (flags, epoch) = match &after {
        Some(Some(p)) => (p.flags, p.epoch),
        _ => (&parts.none, &parts.none),
    };
    let scale = scale2();
    let mut l = Launch::new(stream, &k.pages);
    l.dependent(after.is_some());
    common_args(&mut l, sh, decode, &ints);
    l.arg(&prev.ids)
        .arg(&ints[4])
        .arg(&scale)
        .arg(&mut parts.prev_o)
        .arg(&mut parts.prev_lse)
        .arg(flags)
        .arg(epoch)
        .arg(&ints[5])
        .arg(&ints[6]);
    // SAFETY: the arguments follow `spec_pages_bf16_d128` in kernels/spec.cu: bf16 q, K and V of
    // the shape's pool (head dim 128), the decode's metadata, rows of `max_len` page ids (-1
    // padded) and the partials sized for them, and the top-k's flags and step value where it
    // published its rows (one flag a row: a per-head selection); where it is staged, the
    // dynamic shared memory holds the sequence's block-table row; every id and block is
    // range-checked in the kernel.
    unsafe { l.launch(cfg) }?;
    Ok(())
}

#[allow(clippy::too_many_arguments, reason = "a prototype's launch")]
pub(super) fn launch_finish(
    k: &Kernels,
    stream: &CudaStream,
    sh: &Shape<'_>,
    decode: &DeviceBatch,
    top: &DeviceTopK,
    walked: Option<&DeviceSelection>,
    parts: &Parts,
    out: &mut CudaSlice<f32>,
) -> Result<(), AlgoError> {
    let new = &top.sel;
    // None: the walk was of the top-k's own rows, every selected page at its own index.
    let prev = walked.unwrap_or(new);
    let ints = [
        int(decode.max_blocks())?,
        int(sh.layout.num_blocks)?,
        int(KV_HEADS)?,
        int(Q_HEADS)?,
        int(new.max_len)?,
        int(prev.max_len)?,
        i32::from(walked.is_none()),
    ];
    let scale = scale2();
    let cfg = LaunchConfig {
        grid_dim: (
            u32::try_from(new.rows).map_err(|_| AlgoError::Invalid("grid".into()))?,
            4,
            1,
        ),
        block_dim: (512, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut l = Launch::new(stream, &k.finish);
    l.dependent(true);
    common_args(&mut l, sh, decode, &ints);
    l.arg(&new.ids)
        .arg(&new.lens)
        .arg(&ints[4])
        .arg(&prev.ids)
        .arg(&prev.lens)
        .arg(&ints[5])
        .arg(&parts.prev_o)
        .arg(&parts.prev_lse)
        .arg(&ints[6])
        .arg(&scale)
        .arg(out);
    // SAFETY: the arguments follow `spec_finish_bf16_d128` in kernels/spec.cu, as for
    // `spec_pages`, with the new selection's rows (at most MAX_WIDTH wide, checked by the
    // caller), the partials `spec_pages` wrote (its stream's event precedes this launch) and
    // the output `[b, q_heads, 128]`. It waits for the top-k (`pdl_wait`) before reading its
    // rows.
    unsafe { l.launch(cfg) }?;
    Ok(())
}

impl Parts {
    /// Room for `rows` rows of `width` walked pages.
    pub(super) fn new(gpu: &Gpu, rows: usize, width: usize) -> Result<Self, AlgoError> {
        if width > MAX_WIDTH {
            return Err(AlgoError::Invalid(format!(
                "rows of {width} pages; spec_finish stages {MAX_WIDTH}"
            )));
        }
        Ok(Parts {
            prev_o: gpu.zeros(rows * width * 4 * D)?,
            prev_lse: gpu.zeros(rows * width * 4)?,
            none: gpu.zeros(1)?,
        })
    }
}

/// `spec_warm` on `stream` over the rows `likely`.
pub(super) fn launch_warm(
    k: &Kernels,
    stream: &CudaStream,
    sh: &Shape<'_>,
    decode: &DeviceBatch,
    likely: &DeviceSelection,
) -> Result<(), AlgoError> {
    let ints = [
        int(decode.max_blocks())?,
        int(sh.layout.num_blocks)?,
        int(KV_HEADS)?,
        int(likely.max_len)?,
    ];
    let grid = |x: usize| u32::try_from(x).map_err(|_| AlgoError::Invalid("grid".into()));
    let cfg = LaunchConfig {
        grid_dim: (
            grid((likely.max_len * 64).div_ceil(256))?,
            grid(likely.rows)?,
            1,
        ),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut l = Launch::new(stream, &k.warm);
    l.arg(sh.kv.k())
        .arg(sh.kv.v())
        .arg(decode.seq_lens_kv())
        .arg(decode.block_table())
        .arg(&ints[0])
        .arg(&ints[1])
        .arg(&ints[2])
        .arg(&likely.ids)
        .arg(&likely.lens)
        .arg(&ints[3]);
    // SAFETY: the arguments follow `spec_warm_bf16_d128` in kernels/spec.cu: the shape's K and
    // V pool (head dim 128), the decode's lengths and block table, and rows of `max_len` page
    // ids; every id and block is range-checked in the kernel, which only prefetches.
    unsafe { l.launch(cfg) }?;
    Ok(())
}

/// attn-op's `walk_pages_bf16` (compiled in this module) over the top-k's rows, right after it,
/// into `parts`: half of the shipped walk, for the comparison with `spec_pages`.
pub(super) fn launch_walk_pages(
    k: &Kernels,
    stream: &CudaStream,
    sh: &Shape<'_>,
    decode: &DeviceBatch,
    sel: &DeviceSelection,
    parts: &mut Parts,
) -> Result<(), AlgoError> {
    let (ints, cfg) = walk_setup("walk_pages", sh, decode, sel, true)?;
    let scale = scale2();
    let mut l = Launch::new(stream, &k.walk_pages);
    l.dependent(true);
    common_args(&mut l, sh, decode, &ints);
    l.arg(&sel.ids)
        .arg(&sel.lens)
        .arg(&ints[4])
        .arg(&scale)
        .arg(&mut parts.prev_o)
        .arg(&mut parts.prev_lse)
        .arg(&ints[6]);
    // SAFETY: the arguments follow `walk_pages_bf16` in kernels/walk.cu: as for `spec_pages`,
    // with the selection's rows and lengths, the partials sized for rows of `max_len` (Parts
    // holds twice that), and the staged table row's bytes given.
    unsafe { l.launch(cfg) }?;
    Ok(())
}

/// attn-op's `walk_merge` (compiled in this module) over the partials of a late walk of rows
/// `width` wide, into `out`.
pub(super) fn launch_walk_merge(
    k: &Kernels,
    stream: &CudaStream,
    decode: &DeviceBatch,
    width: usize,
    parts: &Parts,
    out: &mut CudaSlice<f32>,
) -> Result<(), AlgoError> {
    let ints = [int(KV_HEADS)?, int(Q_HEADS)?, int(width)?, 0];
    let grid = |x: usize| u32::try_from(x).map_err(|_| AlgoError::Invalid("grid".into()));
    let cfg = LaunchConfig {
        grid_dim: (grid(decode.num_seqs() * KV_HEADS)?, 4, 1),
        block_dim: (MERGE_WARPS * 32, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut l = Launch::new(stream, &k.walk_merge);
    l.dependent(true);
    l.arg(decode.cu_seqlens_q())
        .arg(&ints[0])
        .arg(&ints[1])
        .arg(&ints[2])
        .arg(&parts.prev_o)
        .arg(&parts.prev_lse)
        .arg(out)
        .arg(&parts.none)
        .arg(&ints[3]);
    // SAFETY: the arguments follow `walk_merge` in kernels/walk.cu: the decode's query offsets
    // (one query a sequence), the partials a late walk wrote for rows of `width` just before
    // on this stream, and the output `[b, q_heads, 128]`; with has_lse 0 the kernel never
    // writes the LSE argument (a placeholder).
    unsafe { l.launch(cfg) }?;
    Ok(())
}
