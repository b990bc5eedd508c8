//! The full hierarchical sparse decode step of one layer on the GPU, for the device bundle
//! (`cargo xtask gpu`): Quest scores and top-k (one selection per sequence, shared by the KV
//! heads), the hot-buffer diff, zero-copy loads of the missed pages from the pinned host pool,
//! and attention over the hot buffer's pages, with no host round trip between them.
//!
//! - `gpu_step check`: a small batch over several decode steps with drifting queries; per step
//!   the diff equals [`HotBuffer::diff`] on the device's selection, and the attention output
//!   equals the CPU's [`sparse_page_attention`] over the whole cache with that selection
//!   (relative error 1e-2 in bf16). Exits 1 on a mismatch.
//!   Then the pipelined schedule (two micro-batches, each one's loads on a copy stream under
//!   the other's compute, ordered by events) against the serial one over 3 layers and 4 steps:
//!   every output equal bit for bit.
//!   Then the coordinator: the same forwards through a `SparseCoordinator`'s CPU hooks and
//!   through its device hooks (`coordinator::cuda`), with equal selections, hits and misses,
//!   and attention outputs (module `coord`).
//! - `gpu_step bench [--json FILE]`: bf16, 32 query / 8 KV heads, D 128, pages of 16, a 2K
//!   budget, a hot buffer of 4K tokens per sequence, B8 L32K: CUDA events around each stage
//!   over 16 steps of drifting queries (after one step that fills the buffers), the share of
//!   each stage and the miss rate the drift gave, with Quest's bounds in bf16 and again in
//!   E4M3 (`sparse_algo::Summary::E4m3`); then 4 layers of two micro-batches of B4,
//!   serial against pipelined, in ms per layer.
//!
//! Without a CUDA driver or device it prints "skipped: no CUDA device" and exits 0.
#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a command-line tool"
)]

mod bench;
mod check;
mod coord;
mod pipeline;
#[path = "../../../attn-op/examples/gpu/report.rs"]
mod report;
#[path = "../../../attn-op/examples/gpu/rng.rs"]
mod rng;

use std::rc::Rc;

use attn_op::cuda::{DeviceArrays, DeviceBatch, DevicePagedKv, Gpu};
use attn_op::{AttnParams, BatchMeta, KvLayout};
use cudarc::driver::{CudaEvent, CudaSlice};
use half::bf16;
use offload::cuda::{DeviceDiff, DeviceHotBuffers, IoKernels, PinnedHostPool};
use offload::{HostLayout, HostPool, HostShape, HostStore, HotBuffer};
use report::random_bf16;
use rng::Rng;
use sparse_algo::cuda::{DeviceRepPool, DeviceTopK, SelectKernels};
use sparse_algo::{Quest, QuestConfig, SparseAlgorithm, Summary};

/// Errors of this tool: every layer's errors as text.
type Res<T> = Result<T, String>;

fn main() {
    report::tool_main("gpu_step", &[], run);
}

fn run(cmd: &str, args: &[String]) -> Res<i32> {
    let gpu = Gpu::new(0).map_err(|e| e.to_string())?;
    // SAFETY: this tool orders its two streams itself: the pipelined schedule records and
    // waits events between them (see `pipelined`), and everything else runs on one stream.
    // cudarc's per-buffer events would add a record and a wait to every launch.
    unsafe { gpu.context().disable_event_tracking() };
    println!("device: {}", gpu.name().map_err(|e| e.to_string())?);
    let k = Kernels {
        select: SelectKernels::new(&gpu).map_err(|e| e.to_string())?,
        io: IoKernels::new(&gpu).map_err(|e| e.to_string())?,
    };
    match cmd {
        "check" => check::check(&gpu, &k),
        "bench" => {
            bench::bench(&gpu, &k, report::json_arg(args))?;
            Ok(0)
        }
        other => {
            eprintln!("unknown command {other}; use check or bench");
            Ok(2)
        }
    }
}

/// The kernels of the step's crates, loaded once.
struct Kernels {
    select: SelectKernels,
    io: IoKernels,
}

/// A step's shape.
#[derive(Clone, Copy)]
struct Shape {
    seqs: usize,
    len: usize,
    kv_heads: usize,
    q_heads: usize,
    dim: usize,
    page: usize,
    budget: usize,
    /// Hot-buffer slots (pages) per sequence.
    hot: usize,
}

impl Shape {
    fn pages(&self) -> usize {
        self.len.div_ceil(self.page)
    }

    /// The whole cache as a block tensor: page p of sequence s in block s * pages + p.
    fn layout(&self) -> KvLayout {
        KvLayout {
            num_blocks: self.seqs * self.pages(),
            block_size: self.page,
            kv_heads: self.kv_heads,
            head_dim: self.dim,
        }
    }
}

/// A batch's KV cache and what a step only reads of it: the pinned host pool, the min/max
/// pages and the decode batch. The pipelined bench's layers share one (every layer reads the
/// same keys and values; each keeps its own hot buffer).
struct Cache {
    shape: Shape,
    quest: Quest,
    /// The decode batch over the whole cache (its block table maps every page; the step reads
    /// only its lengths and query offsets).
    meta: DeviceBatch,
    slots: CudaSlice<i32>,
    reps: DeviceRepPool<bf16>,
    host: PinnedHostPool<bf16>,
    /// `[seqs, pages]`: the host page of each logical page.
    host_table: CudaSlice<i32>,
    /// The whole cache on the host, `[seqs * pages, page, kv_heads, dim]` (K, then V).
    k: Vec<bf16>,
    v: Vec<bf16>,
}

/// Everything one layer's step writes on the device, over a shared [`Cache`].
struct Step {
    cache: Rc<Cache>,
    top: DeviceTopK,
    hot_bufs: DeviceHotBuffers,
    /// `[seqs, hot + 1]`: the device block of each hot slot.
    blocks: CudaSlice<i32>,
    current: CudaSlice<i32>,
    hot_kv: DevicePagedKv<bf16>,
    diff: DeviceDiff,
    /// The batch attention reads: the diff's page table and the covered tokens swapped in.
    attn: DeviceBatch,
    params: AttnParams,
    out: CudaSlice<f32>,
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

impl Cache {
    /// Random keys and values, in a pinned host pool; the min/max pages, stored as `summary`
    /// says, built on the device from a temporary copy of the keys (as after a prefill).
    fn new(gpu: &Gpu, k: &Kernels, shape: Shape, seed: u64, summary: Summary) -> Res<Rc<Self>> {
        let Shape {
            seqs,
            len,
            kv_heads,
            dim,
            page,
            budget,
            ..
        } = shape;
        let pages = shape.pages();
        let layout = shape.layout();
        let kk = random_bf16(layout.len(), seed);
        let vv = random_bf16(layout.len(), seed + 1);
        let table: Vec<i32> = (0..(seqs * pages) as i32).collect();
        let lens = vec![len as i32; seqs];
        let ones: Vec<i32> = (0..=seqs as i32).collect();
        let prefill_cu: Vec<i32> = (0..=seqs).map(|s| (s * len) as i32).collect();
        let upload = |cu: &[i32]| {
            DeviceBatch::upload(
                gpu,
                &BatchMeta {
                    cu_seqlens_q: cu,
                    seq_lens_kv: &lens,
                    block_table: &table,
                    max_blocks: pages,
                },
                &layout,
            )
        };
        let prefill = upload(&prefill_cu).map_err(err)?;
        let meta = upload(&ones).map_err(err)?;
        let quest = Quest::new(QuestConfig {
            page_size: page,
            budget_tokens: budget,
            shared_heads: true,
            summary,
            ..Default::default()
        })
        .map_err(err)?;
        let slots = gpu
            .upload(&(0..seqs as i32).collect::<Vec<_>>())
            .map_err(err)?;
        let rep_shape = quest.rep_shape(kv_heads, dim);
        let mut reps = DeviceRepPool::<bf16>::with_summary(gpu, rep_shape, 1, seqs, len, summary)
            .map_err(err)?;
        {
            let full = DevicePagedKv::from_host(gpu, layout, &kk, &kk).map_err(err)?;
            k.select
                .update_minmax(&quest, &full, &prefill, 0, &slots, &mut reps)
                .map_err(err)?;
            gpu.synchronize().map_err(err)?;
        }
        // The host pool: one layer, page p of sequence s at host page s * pages + p.
        let hshape = HostShape {
            layers: 1,
            pages: seqs * pages,
            page_size: page,
            kv_heads,
            head_dim: dim,
        };
        let mut hpool =
            HostPool::<bf16>::new(hshape, HostLayout::LayerFirst).ok_or("host pool size")?;
        let tok = kv_heads * dim;
        for p in 0..seqs * pages {
            for t in 0..page {
                let at = (p * page + t) * tok;
                hpool.write_token(0, p, t, &kk[at..at + tok], &vv[at..at + tok]);
            }
        }
        let host = PinnedHostPool::from_host(gpu, &hpool).map_err(err)?;
        drop(hpool);
        let host_table = gpu.upload(&table).map_err(err)?;
        Ok(Rc::new(Cache {
            shape,
            quest,
            meta,
            slots,
            reps,
            host,
            host_table,
            k: kk,
            v: vv,
        }))
    }
}

impl Step {
    /// An empty hot buffer over `cache` whose reserved slot holds each sequence's current page
    /// (written there by the step that made the token).
    fn new(gpu: &Gpu, cache: &Rc<Cache>) -> Res<Self> {
        let shape = cache.shape;
        let Shape {
            seqs,
            kv_heads,
            q_heads,
            dim,
            page,
            hot,
            ..
        } = shape;
        let pages = shape.pages();
        let layout = shape.layout();
        let tok = kv_heads * dim;
        let top =
            DeviceTopK::new(gpu, &cache.quest, seqs, kv_heads, shape.len, true).map_err(err)?;
        let hot_bufs =
            DeviceHotBuffers::upload(gpu, &vec![HotBuffer::new(hot); seqs]).map_err(err)?;
        // Slot j of sequence s is device block s * (hot + 1) + j; the reserved slot (hot)
        // holds the current page, written there by the step that made the token.
        let hot_layout = KvLayout {
            num_blocks: seqs * (hot + 1),
            ..layout
        };
        let blocks = gpu
            .upload(&(0..(seqs * (hot + 1)) as i32).collect::<Vec<_>>())
            .map_err(err)?;
        let poison = vec![bf16::NAN; hot_layout.len()];
        let (mut hk, mut hv) = (poison.clone(), poison);
        let per = page * tok;
        for s in 0..seqs {
            let src = (s * pages + pages - 1) * per;
            let dst = (s * (hot + 1) + hot) * per;
            hk[dst..dst + per].copy_from_slice(&cache.k[src..src + per]);
            hv[dst..dst + per].copy_from_slice(&cache.v[src..src + per]);
        }
        let hot_kv = DevicePagedKv::from_host(gpu, hot_layout, &hk, &hv).map_err(err)?;
        let current = gpu.upload(&vec![pages as i32 - 1; seqs]).map_err(err)?;
        let width = cache.quest.row_width();
        let diff = DeviceDiff::new(gpu, seqs, width).map_err(err)?;
        let arrays = DeviceArrays {
            seq_lens_kv: gpu.zeros(seqs).map_err(err)?,
            block_table: gpu.zeros(seqs * width).map_err(err)?,
            max_blocks: width,
        };
        // SAFETY: the KV lengths the batch is used with are a top-k's covered tokens, at most
        // width pages of `page` tokens, the bound given here (zero until then).
        let attn = unsafe {
            DeviceBatch::from_device(gpu, arrays, vec![1; seqs], width * page, &hot_layout)
        }
        .map_err(err)?;
        Ok(Step {
            cache: cache.clone(),
            top,
            hot_bufs,
            blocks,
            current,
            hot_kv,
            diff,
            attn,
            params: AttnParams::new(q_heads, dim),
            out: gpu.zeros(seqs * q_heads * dim).map_err(err)?,
        })
    }

    /// One decode step for the query `q` (`[seqs, q_heads, dim]`) on the GPU's stream, each
    /// stage between two of `ev` (5 events) when given.
    fn run(
        &mut self,
        gpu: &Gpu,
        k: &Kernels,
        q: &CudaSlice<bf16>,
        ev: Option<&[CudaEvent]>,
    ) -> Res<()> {
        let mark = |i: usize| -> Res<()> {
            match ev {
                Some(e) => e[i].record(gpu.stream()).map_err(drv),
                None => Ok(()),
            }
        };
        mark(0)?;
        self.select(k, q)?;
        mark(1)?;
        self.diff(k)?;
        mark(2)?;
        self.load(&k.io)?;
        mark(3)?;
        self.attend(gpu, q)?;
        mark(4)
    }

    /// Quest's estimate and top-k: one selection per sequence.
    fn select(&mut self, k: &Kernels, q: &CudaSlice<bf16>) -> Res<()> {
        let c = &*self.cache;
        k.select
            .quest_topk(
                &c.quest,
                q,
                c.shape.q_heads,
                &c.meta,
                0,
                &c.slots,
                &c.reps,
                &mut self.top,
            )
            .map_err(err)
    }

    /// The hot-buffer diff of the selection.
    fn diff(&mut self, k: &Kernels) -> Res<()> {
        k.io.diff(
            &mut self.hot_bufs,
            &self.top.sel,
            &self.current,
            &self.blocks,
            &mut self.diff,
        )
        .map_err(err)
    }

    /// The loads of the diff's misses, launched by `io` (on its stream).
    fn load(&mut self, io: &IoKernels) -> Res<()> {
        let c = &*self.cache;
        io.load_misses(
            &c.host,
            0,
            &c.host_table,
            c.shape.pages(),
            &self.blocks,
            c.shape.hot,
            &self.diff,
            &mut self.hot_kv,
        )
        .map_err(err)
    }

    /// Attention over the diff's page table with the selection's covered tokens.
    fn attend(&mut self, gpu: &Gpu, q: &CudaSlice<bf16>) -> Res<()> {
        // SAFETY: covered holds each row's tokens over at most row_width pages (the bound the
        // batch was made with); the diff's table has the batch's [seqs, row_width] shape.
        let (lens, table) = unsafe { self.attn.arrays_mut() };
        std::mem::swap(lens, &mut self.top.covered);
        std::mem::swap(table, &mut self.diff.table);
        let res = gpu.paged_attention(
            q,
            &self.hot_kv,
            &self.attn,
            &self.params,
            &mut self.out,
            None,
        );
        // SAFETY: as above; the buffers go back where they came from.
        let (lens, table) = unsafe { self.attn.arrays_mut() };
        std::mem::swap(lens, &mut self.top.covered);
        std::mem::swap(table, &mut self.diff.table);
        res.map_err(err)
    }
}

fn drv(e: cudarc::driver::DriverError) -> String {
    format!("CUDA driver: {e:?}")
}

/// The next query: the last plus noise of `drift` (0: the same; 1: as large as the query).
fn drift(q: &[f32], rng: &mut Rng, drift: f32) -> Vec<f32> {
    q.iter().map(|&x| x + drift * rng.unit()).collect()
}

fn to_bf16(x: &[f32]) -> Vec<bf16> {
    x.iter().map(|&v| bf16::from_f32(v)).collect()
}
