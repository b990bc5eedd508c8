//! The attention kernels of kernels/attn.cu: which are built for which types and head dims,
//! their CTA shapes and shared memory, and the loaded forms a launch picks from.

use cudarc::driver::CudaFunction;

use crate::DType;

/// Head dims the attention kernels are built for.
pub(super) const ATTN_DIMS: [usize; 3] = [64, 128, 256];
/// Warps per attention CTA (`WARPS` in kernels/attn.cu).
pub(crate) const WARPS: usize = 4;
/// The fewest keys a split takes unless [`Gpu::set_min_chunk`](super::Gpu::set_min_chunk) says otherwise: two tiles of 16
/// per warp. On an H200, sparse decode B1 L128K (2048 keys a KV head) measured 20.9 µs with
/// one tile per warp (32 splits), 19.0 with two (16 splits), 21.5 with four and 29.1 with
/// eight: each further round of tiles costs a warp about 2 µs, each split a partial to merge.
pub(super) const MIN_CHUNK: usize = WARPS * 32;

/// One attention kernel of kernels/attn.cu, by the suffix of its name (`attn_{type}_d{dim}_`
/// suffix): which types and head dims it is built for and how many rows a CTA takes.
pub(super) struct AttnSpec {
    pub(super) suffix: &'static str,
    /// Rows (query, head-in-group pairs) per CTA.
    pub(super) rows: usize,
    /// Tensor cores (16-bit types, head dims 64 and 128) or CUDA cores (every type and dim).
    pub(super) tensor_cores: bool,
    /// Only built for bf16, head dim 128: a variant for the bench's sweep.
    pub(super) sweep_only: bool,
}

/// Every attention kernel. The first that applies to a launch is its default: tensor cores
/// where they exist, else 4 or 8 rows per CTA on CUDA cores.
pub(super) const ATTN_SPECS: [AttnSpec; 8] = [
    AttnSpec {
        suffix: "tc",
        rows: 8,
        tensor_cores: true,
        sweep_only: false,
    },
    AttnSpec {
        suffix: "r4",
        rows: 4,
        tensor_cores: false,
        sweep_only: false,
    },
    AttnSpec {
        suffix: "r8",
        rows: 8,
        tensor_cores: false,
        sweep_only: false,
    },
    AttnSpec {
        suffix: "tc2",
        rows: 8,
        tensor_cores: true,
        sweep_only: true,
    },
    AttnSpec {
        suffix: "tct",
        rows: 8,
        tensor_cores: true,
        sweep_only: true,
    },
    AttnSpec {
        suffix: "r4_u4",
        rows: 4,
        tensor_cores: false,
        sweep_only: true,
    },
    AttnSpec {
        suffix: "r4_u4p",
        rows: 4,
        tensor_cores: false,
        sweep_only: true,
    },
    AttnSpec {
        suffix: "r4_u1p",
        rows: 4,
        tensor_cores: false,
        sweep_only: true,
    },
];

impl AttnSpec {
    /// Whether kernels/attn.cu builds this kernel for an element type and head dim.
    pub(super) fn built_for(&self, dtype: DType, d: usize) -> bool {
        if self.sweep_only {
            dtype == DType::BF16 && d == 128
        } else if self.tensor_cores {
            dtype != DType::F32 && d <= 128
        } else {
            true
        }
    }

    /// Dynamic shared memory of a CTA: each stream's accumulators, maxima and sums. A stream
    /// is a warp on tensor cores, and the `d / 8` lanes that share a key on CUDA cores. A
    /// published kernel's table row starts right after (`MERGE_FLOATS` in kernels/attn.cu,
    /// the same size).
    pub(super) fn smem(&self, d: usize) -> usize {
        let streams = if self.tensor_cores {
            WARPS
        } else {
            WARPS * (32 / (d / 8))
        };
        streams * self.rows * (d + 2) * 4
    }
}

/// Which attention kernel: element type, head dim, name suffix.
pub(super) type AttnKey = (DType, usize, &'static str);

/// A loaded attention kernel, its CTA shape and how many of its CTAs one multiprocessor holds
/// at once.
#[derive(Clone)]
pub(crate) struct AttnKernel {
    pub(crate) func: CudaFunction,
    /// The same kernel over a published selection (`NAME_pub`, tensor cores only).
    pub(crate) published: Option<PubKernel>,
    pub(crate) rows: usize,
    pub(crate) smem: usize,
    pub(crate) resident: usize,
}

/// An attention kernel's form over a published selection. Its CTAs stage their sequence's
/// block-table row in dynamic shared memory after the warps' merge state, where the launch
/// gives them room (kernels/attn.cu, `pub_table_start`).
#[derive(Clone)]
pub(crate) struct PubKernel {
    pub(crate) func: CudaFunction,
    /// CTAs per multiprocessor with no table staged.
    pub(crate) resident: usize,
    /// The longest block-table row a launch stages (entries): the longest of
    /// [`PUB_TABLE_ROWS`] at which the kernel still holds as many CTAs a multiprocessor as the
    /// plain kernel, or 0.
    pub(crate) table_cap: usize,
}

/// The block-table row lengths (entries) a published kernel may be given room to stage, the
/// longest first: 8192 pages of 16 tokens is a 128K context (32 KiB), 2048 one of 32K.
pub(super) const PUB_TABLE_ROWS: [usize; 2] = [8192, 2048];
