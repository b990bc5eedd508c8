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

mod coord;
#[path = "../../../attn-op/examples/gpu/report.rs"]
mod report;
#[path = "../../../attn-op/examples/gpu/rng.rs"]
mod rng;

use attn_op::cuda::{DeviceArrays, DeviceBatch, DevicePagedKv, Gpu};
use attn_op::{
    AttnOut, AttnParams, BatchMeta, KvLayout, PagedKv, Selection, sparse_page_attention,
};
use std::rc::Rc;
use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream};
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
        "check" => check(&gpu, &k),
        "bench" => {
            bench(&gpu, &k, report::json_arg(args))?;
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

fn check(gpu: &Gpu, k: &Kernels) -> Res<i32> {
    let mut failed = 0;
    for (shape, steps) in [
        (
            Shape {
                seqs: 3,
                len: 1000,
                kv_heads: 2,
                q_heads: 8,
                dim: 64,
                page: 16,
                budget: 160,
                hot: 16,
            },
            5,
        ),
        (
            Shape {
                seqs: 2,
                len: 4099,
                kv_heads: 8,
                q_heads: 32,
                dim: 128,
                page: 16,
                budget: 512,
                hot: 48,
            },
            4,
        ),
    ] {
        let cache = Cache::new(gpu, k, shape, 7, Summary::Exact)?;
        let mut step = Step::new(gpu, &cache)?;
        let mut cpu = vec![HotBuffer::new(shape.hot); shape.seqs];
        let mut rng = Rng::new(3);
        let n_q = shape.seqs * shape.q_heads * shape.dim;
        let mut qf: Vec<f32> = (0..n_q).map(|_| rng.unit()).collect();
        let pages = shape.pages();
        let full =
            PagedKv::from_tensors(shape.layout(), cache.k.clone(), cache.v.clone()).map_err(err)?;
        let table: Vec<i32> = (0..(shape.seqs * pages) as i32).collect();
        let lens = vec![shape.len as i32; shape.seqs];
        let cu: Vec<i32> = (0..=shape.seqs as i32).collect();
        let meta = BatchMeta {
            cu_seqlens_q: &cu,
            seq_lens_kv: &lens,
            block_table: &table,
            max_blocks: pages,
        };
        for t in 0..steps {
            let qb = to_bf16(&qf);
            let q = gpu.upload(&qb).map_err(err)?;
            step.run(gpu, k, &q, None)?;
            let width = cache.quest.row_width();
            let ids = gpu.download(&step.top.sel.ids).map_err(err)?;
            let sel_lens = gpu.download(&step.top.sel.lens).map_err(err)?;
            let misses = gpu.download(&step.diff.miss_counts).map_err(err)?;
            let slots = gpu.download(&step.diff.slots).map_err(err)?;
            let got = gpu.download(&step.out).map_err(err)?;
            let mut same = true;
            let (mut n_miss, mut n_sel) = (0, 0);
            for s in 0..shape.seqs {
                let row = &ids[s * width..s * width + sel_lens[s] as usize];
                let want = cpu[s].diff(row, pages as i32 - 1);
                same &= misses[s] as usize == want.misses.len()
                    && want
                        .slots
                        .iter()
                        .zip(&slots[s * width..])
                        .all(|(&a, &b)| a as i32 == b);
                n_miss += want.misses.len();
                n_sel += row.len();
            }
            // The CPU reads the selected pages from the whole cache, one row per KV head.
            let mut rows_ids = Vec::new();
            let mut rows_lens = Vec::new();
            for s in 0..shape.seqs {
                for _ in 0..shape.kv_heads {
                    rows_ids.extend_from_slice(&ids[s * width..(s + 1) * width]);
                    rows_lens.push(sel_lens[s]);
                }
            }
            let mut want = vec![0f32; n_q];
            sparse_page_attention(
                &qb,
                &full,
                &meta,
                &Selection {
                    ids: &rows_ids,
                    lens: &rows_lens,
                    max_len: width,
                },
                &step.params,
                AttnOut {
                    out: &mut want,
                    lse: None,
                },
            )
            .map_err(err)?;
            let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
            let worst = got
                .iter()
                .zip(&want)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs() / scale));
            let ok = same && worst <= 1e-2;
            failed += usize::from(!ok);
            println!(
                "{} step B{} L{} kvh {} D {} HOT {} step {t}: {n_miss} of {n_sel} pages missed; \
                 diff equals the CPU's: {same}; attention max rel err {worst:.2e}",
                if ok { "ok  " } else { "FAIL" },
                shape.seqs,
                shape.len,
                shape.kv_heads,
                shape.dim,
                shape.hot,
            );
            qf = drift(&qf, &mut rng, 0.3);
        }
    }
    failed += check_pipeline(gpu, k)?;
    failed += coord::check(gpu)?;
    println!("gpu_step check: {failed} failed");
    Ok(i32::from(failed > 0))
}

/// The stages of a full step, in the order the bench times them.
const STAGES: [&str; 4] = [
    "quest estimate + top-k",
    "hot-buffer diff",
    "loads of misses (PCIe)",
    "attention over the hot buffer",
];

/// Decode steps a stage table averages over.
const STEPS: usize = 16;

/// What [`bench_step`] measured: each stage's total over the steps, the median whole step,
/// and the miss rate.
struct StepTimes {
    stage: [f64; 4],
    median: f64,
    miss_rate: f64,
}

fn bench(gpu: &Gpu, k: &Kernels, json: Option<&str>) -> Res<()> {
    let shape = Shape {
        seqs: 8,
        len: 32 * 1024,
        kv_heads: 8,
        q_heads: 32,
        dim: 128,
        page: 16,
        budget: 2048,
        hot: 256,
    };
    let StepTimes {
        stage,
        median,
        miss_rate,
    } = bench_step(gpu, k, shape, Summary::Exact)?;
    bench_step(gpu, k, shape, Summary::E4m3)?;
    let total: f64 = stage.iter().sum();
    let (serial_ms, pipelined_ms, pipe_miss) = bench_pipeline(gpu, k, shape)?;
    println!(
        "{PIPE_LAYERS} layers, 2 micro-batches of B{}: serial {serial_ms:.4} ms/layer, loads on a \
         copy stream under the other micro-batch's compute {pipelined_ms:.4} ms/layer \
         ({:.2}x; miss rate {:.1}%)",
        shape.seqs / 2,
        serial_ms / pipelined_ms,
        100.0 * pipe_miss
    );
    if let Some(path) = json {
        let mut s = format!(
            "{{\"device\": \"{}\", \"shape\": \"B{} L{}K budget {} HOT {}\", \"miss_rate\": {miss_rate:.4}, \"whole_ms\": {median:.5}, \"serial_ms_per_layer\": {serial_ms:.5}, \"pipelined_ms_per_layer\": {pipelined_ms:.5}, \"stages\": [",
            gpu.name().map_err(err)?,
            shape.seqs,
            shape.len / 1024,
            shape.budget,
            shape.hot * shape.page
        );
        for (i, (n, st)) in STAGES.iter().zip(stage).enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            s.push_str(&format!(
                "{sep}{{\"stage\": \"{n}\", \"ms\": {:.5}, \"share\": {:.4}}}",
                st / STEPS as f64,
                st / total
            ));
        }
        s.push_str("]}\n");
        std::fs::write(path, s).map_err(err)?;
    }
    Ok(())
}

/// One layer's full step at `shape` with Quest's bounds stored as `summary`, over [`STEPS`]
/// drifting queries after a step that fills the hot buffers: prints each stage's time and
/// share, the median whole step and the miss rate.
fn bench_step(gpu: &Gpu, k: &Kernels, shape: Shape, summary: Summary) -> Res<StepTimes> {
    let cache = Cache::new(gpu, k, shape, 21, summary)?;
    let mut step = Step::new(gpu, &cache)?;
    let mut rng = Rng::new(9);
    let n_q = shape.seqs * shape.q_heads * shape.dim;
    let mut qf: Vec<f32> = (0..n_q).map(|_| rng.unit()).collect();
    let mut qs = Vec::new();
    for _ in 0..=STEPS {
        qs.push(gpu.upload(&to_bf16(&qf)).map_err(err)?);
        qf = drift(&qf, &mut rng, 0.15);
    }
    let events: Vec<_> = (0..5)
        .map(|_| {
            gpu.context()
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| format!("{e:?}"))
        })
        .collect::<Res<_>>()?;
    // Step 0 fills the empty hot buffers (every page a miss).
    step.run(gpu, k, &qs[0], None)?;
    gpu.synchronize().map_err(err)?;
    let mut stage = [0f64; 4];
    let mut whole = Vec::new();
    let (mut missed, mut selected) = (0usize, 0usize);
    for q in &qs[1..] {
        step.run(gpu, k, q, Some(&events))?;
        events[4].synchronize().map_err(|e| format!("{e:?}"))?;
        for (i, s) in stage.iter_mut().enumerate() {
            *s += f64::from(
                events[i]
                    .elapsed_ms(&events[i + 1])
                    .map_err(|e| format!("{e:?}"))?,
            );
        }
        whole.push(f64::from(
            events[0]
                .elapsed_ms(&events[4])
                .map_err(|e| format!("{e:?}"))?,
        ));
        let m = gpu.download(&step.diff.miss_counts).map_err(err)?;
        let l = gpu.download(&step.top.sel.lens).map_err(err)?;
        missed += m.iter().map(|&x| x as usize).sum::<usize>();
        selected += l.iter().map(|&x| x as usize).sum::<usize>();
    }
    whole.sort_by(f64::total_cmp);
    let median = whole[whole.len() / 2];
    let total: f64 = stage.iter().sum();
    let miss_rate = missed as f64 / selected as f64;
    let page_bytes = shape.page * shape.kv_heads * shape.dim * 2 * 2;
    let loaded = missed as f64 / STEPS as f64 * page_bytes as f64;
    println!(
        "full hierarchical step, one layer, B{} L{}K, budget {} tokens, HOT {} tokens, {STEPS} \
         steps, Quest's bounds {}",
        shape.seqs,
        shape.len / 1024,
        shape.budget,
        shape.hot * shape.page,
        match summary {
            Summary::Exact => "in bf16 (scored exactly, on CUDA cores)",
            Summary::E4m3 => "in E4M3 (scored on tensor cores)",
        }
    );
    println!("{:<34} {:>10} {:>7}", "stage", "ms/step", "share");
    for (n, s) in STAGES.iter().zip(stage) {
        println!(
            "{n:<34} {:>10.4} {:>6.1}%",
            s / STEPS as f64,
            100.0 * s / total
        );
    }
    println!("{:<34} {:>10.4}", "whole step (median)", median);
    println!(
        "miss rate {:.1}% ({:.1} of {} pages per sequence per step), {:.2} MiB loaded per step ({:.1} GB/s while loading)",
        100.0 * miss_rate,
        missed as f64 / (STEPS * shape.seqs) as f64,
        selected / (STEPS * shape.seqs),
        loaded / f64::from(1u32 << 20),
        loaded / (stage[2] / STEPS as f64) / 1e6
    );
    Ok(StepTimes {
        stage,
        median,
        miss_rate,
    })
}

/// The copy stream, offload's kernels launched on it, and the events that order it against the
/// compute stream (the GPU's).
struct CopyStream {
    stream: Arc<CudaStream>,
    io: IoKernels,
    /// Per micro-batch: its diff is done (compute, then copy waits).
    diffed: [CudaEvent; 2],
    /// Per micro-batch: its loads are done (copy, then compute waits).
    loaded: [CudaEvent; 2],
}

impl CopyStream {
    fn new(gpu: &Gpu, k: &Kernels) -> Res<Self> {
        let stream = gpu.context().new_stream().map_err(drv)?;
        let event = || {
            gpu.context()
                .new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(drv)
        };
        Ok(CopyStream {
            io: k.io.on_stream(stream.clone()),
            stream,
            diffed: [event()?, event()?],
            loaded: [event()?, event()?],
        })
    }
}

/// A decode step's queries: `q[layer][micro-batch]`.
type Queries<'a> = [[&'a CudaSlice<bf16>; 2]];

/// One decode step of every layer and both micro-batches, all on the compute stream.
fn serial(gpu: &Gpu, k: &Kernels, layers: &mut [[Step; 2]], q: &Queries<'_>) -> Res<()> {
    for (pair, q) in layers.iter_mut().zip(q) {
        for (step, q) in pair.iter_mut().zip(q) {
            step.run(gpu, k, q, None)?;
        }
    }
    Ok(())
}

/// The same work with each micro-batch's loads on the copy stream, under the other
/// micro-batch's compute. The compute stream runs, per layer l, micro-batch A's selection
/// and diff, B's attention of layer l - 1, B's selection and diff, then A's attention; the
/// copy stream runs the loads in the order they were diffed. Each load waits for its diff
/// (event `diffed`), each attention for its loads (`loaded`); a micro-batch's layer l + 1
/// starts only after its layer l attention, as in a model, whose next queries come from it.
/// So A's loads of layer l run under B's selection and diff, and B's under A's attention and
/// A's next selection and diff.
fn pipelined(
    gpu: &Gpu,
    k: &Kernels,
    copy: &CopyStream,
    layers: &mut [[Step; 2]],
    q: &Queries<'_>,
) -> Res<()> {
    let compute = gpu.stream();
    let issue = |step: &mut Step, q: &CudaSlice<bf16>, m: usize| -> Res<()> {
        step.select(k, q)?;
        step.diff(k)?;
        copy.diffed[m].record(compute).map_err(drv)?;
        copy.stream.wait(&copy.diffed[m]).map_err(drv)?;
        step.load(&copy.io)?;
        copy.loaded[m].record(&copy.stream).map_err(drv)
    };
    let n = layers.len();
    for l in 0..n {
        issue(&mut layers[l][0], q[l][0], 0)?;
        if l > 0 {
            compute.wait(&copy.loaded[1]).map_err(drv)?;
            layers[l - 1][1].attend(gpu, q[l - 1][1])?;
        }
        issue(&mut layers[l][1], q[l][1], 1)?;
        compute.wait(&copy.loaded[0]).map_err(drv)?;
        layers[l][0].attend(gpu, q[l][0])?;
    }
    if n > 0 {
        compute.wait(&copy.loaded[1]).map_err(drv)?;
        layers[n - 1][1].attend(gpu, q[n - 1][1])?;
    }
    Ok(())
}

/// `layers` layers of two micro-batches, each micro-batch's layers over one shared cache.
fn layer_steps(gpu: &Gpu, caches: &[Rc<Cache>; 2], layers: usize) -> Res<Vec<[Step; 2]>> {
    (0..layers)
        .map(|_| Ok([Step::new(gpu, &caches[0])?, Step::new(gpu, &caches[1])?]))
        .collect()
}

/// Every step's queries of every layer and micro-batch, drifting from step to step:
/// `[step][layer][micro-batch]`.
fn drifting_queries(
    gpu: &Gpu,
    shape: Shape,
    layers: usize,
    steps: usize,
    amount: f32,
    seed: u64,
) -> Res<Vec<Vec<[CudaSlice<bf16>; 2]>>> {
    let mut rng = Rng::new(seed);
    let n_q = shape.seqs * shape.q_heads * shape.dim;
    let mut qf: Vec<Vec<f32>> = (0..2 * layers)
        .map(|_| (0..n_q).map(|_| rng.unit()).collect())
        .collect();
    let mut out = Vec::with_capacity(steps);
    for _ in 0..steps {
        let mut per_layer = Vec::with_capacity(layers);
        for l in 0..layers {
            per_layer.push([
                gpu.upload(&to_bf16(&qf[2 * l])).map_err(err)?,
                gpu.upload(&to_bf16(&qf[2 * l + 1])).map_err(err)?,
            ]);
        }
        out.push(per_layer);
        for q in &mut qf {
            *q = drift(q, &mut rng, amount);
        }
    }
    Ok(out)
}

/// The references of one step's queries, as the schedules take them.
fn refs(q: &[[CudaSlice<bf16>; 2]]) -> Vec<[&CudaSlice<bf16>; 2]> {
    q.iter().map(|[a, b]| [a, b]).collect()
}

/// The pipelined schedule against the serial one: two sets of 3 layers over the same caches,
/// 4 steps of drifting queries; every layer's attention output is the same bit for bit (a
/// missing wait would read a page before its load or overwrite one under attention).
fn check_pipeline(gpu: &Gpu, k: &Kernels) -> Res<usize> {
    const LAYERS: usize = 3;
    const STEPS: usize = 4;
    let shape = Shape {
        seqs: 2,
        len: 3000,
        kv_heads: 4,
        q_heads: 16,
        dim: 128,
        page: 16,
        budget: 512,
        hot: 40,
    };
    let caches = [
        Cache::new(gpu, k, shape, 31, Summary::Exact)?,
        Cache::new(gpu, k, shape, 37, Summary::Exact)?,
    ];
    let mut a = layer_steps(gpu, &caches, LAYERS)?;
    let mut b = layer_steps(gpu, &caches, LAYERS)?;
    let copy = CopyStream::new(gpu, k)?;
    gpu.synchronize().map_err(err)?;
    let qs = drifting_queries(gpu, shape, LAYERS, STEPS, 0.3, 5)?;
    let mut failed = 0;
    for (t, q) in qs.iter().enumerate() {
        let q = refs(q);
        serial(gpu, k, &mut a, &q)?;
        pipelined(gpu, k, &copy, &mut b, &q)?;
        let mut same = true;
        let mut misses = 0;
        for (sa, sb) in a.iter().flatten().zip(b.iter().flatten()) {
            let (x, y) = (
                gpu.download(&sa.out).map_err(err)?,
                gpu.download(&sb.out).map_err(err)?,
            );
            same &= x.iter().zip(&y).all(|(x, y)| x.to_bits() == y.to_bits());
            let m = gpu.download(&sb.diff.miss_counts).map_err(err)?;
            misses += m.iter().map(|&x| x as usize).sum::<usize>();
        }
        failed += usize::from(!same);
        println!(
            "{} pipelined step {t}: {LAYERS} layers x 2 micro-batches of B{} L{}, {misses} \
             pages loaded; every output equals the serial schedule's bit for bit: {same}",
            if same { "ok  " } else { "FAIL" },
            shape.seqs,
            shape.len
        );
    }
    Ok(failed)
}

/// Layers of the pipelined bench.
const PIPE_LAYERS: usize = 4;

/// Serial against pipelined, B8 L32K as two micro-batches of B4 over `PIPE_LAYERS` layers:
/// CUDA events around each schedule's whole step (every layer), alternating the two
/// schedules step by step so both see the same drift; medians per layer.
fn bench_pipeline(gpu: &Gpu, k: &Kernels, full: Shape) -> Res<(f64, f64, f64)> {
    const STEPS: usize = 16;
    let shape = Shape {
        seqs: full.seqs / 2,
        ..full
    };
    let caches = [
        Cache::new(gpu, k, shape, 41, Summary::Exact)?,
        Cache::new(gpu, k, shape, 43, Summary::Exact)?,
    ];
    let mut layers = layer_steps(gpu, &caches, PIPE_LAYERS)?;
    let copy = CopyStream::new(gpu, k)?;
    let qs = drifting_queries(gpu, shape, PIPE_LAYERS, 2 * STEPS + 1, 0.15, 47)?;
    gpu.synchronize().map_err(err)?;
    // Step 0 fills the empty hot buffers.
    serial(gpu, k, &mut layers, &refs(&qs[0]))?;
    let event = || {
        gpu.context()
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv)
    };
    let (a, b) = (event()?, event()?);
    let mut times = [Vec::new(), Vec::new()];
    let (mut missed, mut selected) = (0usize, 0usize);
    for (t, q) in qs[1..].iter().enumerate() {
        let q = refs(q);
        a.record(gpu.stream()).map_err(drv)?;
        if t % 2 == 0 {
            serial(gpu, k, &mut layers, &q)?;
        } else {
            pipelined(gpu, k, &copy, &mut layers, &q)?;
        }
        b.record(gpu.stream()).map_err(drv)?;
        b.synchronize().map_err(drv)?;
        times[t % 2].push(f64::from(a.elapsed_ms(&b).map_err(drv)?));
        for step in layers.iter().flatten() {
            let m = gpu.download(&step.diff.miss_counts).map_err(err)?;
            let l = gpu.download(&step.top.sel.lens).map_err(err)?;
            missed += m.iter().map(|&x| x as usize).sum::<usize>();
            selected += l.iter().map(|&x| x as usize).sum::<usize>();
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2] / PIPE_LAYERS as f64
    };
    let [mut s, mut p] = times;
    Ok((
        median(&mut s),
        median(&mut p),
        missed as f64 / selected as f64,
    ))
}
