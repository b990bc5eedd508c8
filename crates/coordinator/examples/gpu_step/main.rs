//! The full hierarchical sparse decode step of one layer on the GPU, for the device bundle
//! (`cargo xtask gpu`): Quest scores and top-k (one selection per sequence, shared by the KV
//! heads), the hot-buffer diff, zero-copy loads of the missed pages from the pinned host pool,
//! and attention over the hot buffer's pages, with no host round trip between them.
//!
//! - `gpu_step check`: a small batch over several decode steps with drifting queries; per step
//!   the diff equals [`HotBuffer::diff`] on the device's selection, and the attention output
//!   equals the CPU's [`sparse_page_attention`] over the whole cache with that selection
//!   (relative error 1e-2 in bf16). Exits 1 on a mismatch.
//! - `gpu_step bench [--json FILE]`: bf16, 32 query / 8 KV heads, D 128, pages of 16, a 2K
//!   budget, a hot buffer of 4K tokens per sequence, B8 L32K: CUDA events around each stage
//!   over 16 steps of drifting queries (after one step that fills the buffers), the share of
//!   each stage and the miss rate the drift gave.
//!
//! Without a CUDA driver or device it prints "skipped: no CUDA device" and exits 0.
#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a command-line tool"
)]

#[path = "../../../attn-op/examples/gpu/report.rs"]
mod report;
#[path = "../../../attn-op/examples/gpu/rng.rs"]
mod rng;

use attn_op::cuda::{DeviceArrays, DeviceBatch, DevicePagedKv, Gpu};
use attn_op::{
    AttnOut, AttnParams, BatchMeta, KvLayout, PagedKv, Selection, sparse_page_attention,
};
use cudarc::driver::CudaSlice;
use cudarc::driver::sys::CUevent_flags;
use half::bf16;
use offload::cuda::{DeviceDiff, DeviceHotBuffers, IoKernels, PinnedHostPool};
use offload::{HostLayout, HostPool, HostShape, HostStore, HotBuffer};
use report::random_bf16;
use rng::Rng;
use sparse_algo::cuda::{DeviceRepPool, DeviceTopK, SelectKernels};
use sparse_algo::{AlwaysInclude, Quest, QuestConfig, SparseAlgorithm};

/// Errors of this tool: every layer's errors as text.
type Res<T> = Result<T, String>;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cmd = args.first().map_or("check", String::as_str);
    let code = match run(cmd, &args) {
        Ok(code) => code,
        Err(why) if why.contains("no CUDA") => {
            println!("skipped: no CUDA device ({why})");
            0
        }
        Err(e) => {
            eprintln!("gpu_step {cmd}: {e}");
            1
        }
    };
    std::process::exit(code);
}

fn run(cmd: &str, args: &[String]) -> Res<i32> {
    let gpu = Gpu::new(0).map_err(|e| e.to_string())?;
    println!("device: {}", gpu.name().map_err(|e| e.to_string())?);
    let k = Kernels {
        select: SelectKernels::new(&gpu).map_err(|e| e.to_string())?,
        io: IoKernels::new(&gpu).map_err(|e| e.to_string())?,
    };
    match cmd {
        "check" => check(&gpu, &k),
        "bench" => {
            let json = args
                .iter()
                .position(|a| a == "--json")
                .and_then(|i| args.get(i + 1));
            bench(&gpu, &k, json.map(String::as_str))?;
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
}

/// Everything one layer's step reads and writes on the device, and the host pool.
struct Step {
    shape: Shape,
    quest: Quest,
    /// The decode batch over the whole cache (its block table maps every page; the step reads
    /// only its lengths and query offsets).
    meta: DeviceBatch,
    slots: CudaSlice<i32>,
    reps: DeviceRepPool<bf16>,
    top: DeviceTopK,
    host: PinnedHostPool<bf16>,
    /// `[seqs, pages]`: the host page of each logical page.
    host_table: CudaSlice<i32>,
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
    /// The whole cache on the host, `[seqs * pages, page, kv_heads, dim]` (K, then V).
    k: Vec<bf16>,
    v: Vec<bf16>,
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

impl Step {
    /// Random keys and values; the min/max pages built on the device from a temporary copy of
    /// the keys (as after a prefill); an empty hot buffer whose reserved slot holds each
    /// sequence's current page.
    fn new(gpu: &Gpu, k: &Kernels, shape: Shape, seed: u64) -> Res<Self> {
        let Shape {
            seqs,
            len,
            kv_heads,
            q_heads,
            dim,
            page,
            budget,
            hot,
        } = shape;
        let pages = shape.pages();
        let layout = KvLayout {
            num_blocks: seqs * pages,
            block_size: page,
            kv_heads,
            head_dim: dim,
        };
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
            always: AlwaysInclude::default(),
            shared_heads: true,
        })
        .map_err(err)?;
        let slots = gpu
            .upload(&(0..seqs as i32).collect::<Vec<_>>())
            .map_err(err)?;
        let mut reps =
            DeviceRepPool::<bf16>::new(gpu, quest.rep_shape(kv_heads, dim), 1, seqs, len)
                .map_err(err)?;
        {
            let full = DevicePagedKv::from_host(gpu, layout, &kk, &kk).map_err(err)?;
            k.select
                .update_minmax(&quest, &full, &prefill, 0, &slots, &mut reps)
                .map_err(err)?;
            gpu.synchronize().map_err(err)?;
        }
        let top = DeviceTopK::new(gpu, &quest, seqs, kv_heads, len, true).map_err(err)?;
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
            hk[dst..dst + per].copy_from_slice(&kk[src..src + per]);
            hv[dst..dst + per].copy_from_slice(&vv[src..src + per]);
        }
        let hot_kv = DevicePagedKv::from_host(gpu, hot_layout, &hk, &hv).map_err(err)?;
        let current = gpu.upload(&vec![pages as i32 - 1; seqs]).map_err(err)?;
        let width = quest.row_width();
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
            shape,
            quest,
            meta,
            slots,
            reps,
            top,
            host,
            host_table,
            hot_bufs,
            blocks,
            current,
            hot_kv,
            diff,
            attn,
            params: AttnParams::new(q_heads, dim),
            out: gpu.zeros(seqs * q_heads * dim).map_err(err)?,
            k: kk,
            v: vv,
        })
    }

    /// One decode step for the query `q` (`[seqs, q_heads, dim]`), each stage between two of
    /// `ev` (5 events) when given.
    fn run(
        &mut self,
        gpu: &Gpu,
        k: &Kernels,
        q: &CudaSlice<bf16>,
        ev: Option<&[cudarc::driver::CudaEvent]>,
    ) -> Res<()> {
        let mark = |i: usize| -> Res<()> {
            match ev {
                Some(e) => e[i].record(gpu.stream()).map_err(|x| format!("{x:?}")),
                None => Ok(()),
            }
        };
        let sh = self.shape;
        mark(0)?;
        k.select
            .quest_topk(
                &self.quest,
                q,
                sh.q_heads,
                &self.meta,
                0,
                &self.slots,
                &self.reps,
                &mut self.top,
            )
            .map_err(err)?;
        mark(1)?;
        k.io.diff(
            &mut self.hot_bufs,
            &self.top.sel,
            &self.current,
            &self.blocks,
            &mut self.diff,
        )
        .map_err(err)?;
        mark(2)?;
        k.io.load_misses(
            &self.host,
            0,
            &self.host_table,
            sh.pages(),
            &self.blocks,
            sh.hot,
            &self.diff,
            &mut self.hot_kv,
        )
        .map_err(err)?;
        mark(3)?;
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
        res.map_err(err)?;
        mark(4)
    }
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
        let mut step = Step::new(gpu, k, shape, 7)?;
        let mut cpu = vec![HotBuffer::new(shape.hot); shape.seqs];
        let mut rng = Rng::new(3);
        let n_q = shape.seqs * shape.q_heads * shape.dim;
        let mut qf: Vec<f32> = (0..n_q).map(|_| rng.unit()).collect();
        let pages = shape.pages();
        let layout = KvLayout {
            num_blocks: shape.seqs * pages,
            block_size: shape.page,
            kv_heads: shape.kv_heads,
            head_dim: shape.dim,
        };
        let full = PagedKv::from_tensors(layout, step.k.clone(), step.v.clone()).map_err(err)?;
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
            let width = step.quest.row_width();
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
    println!("gpu_step check: {failed} failed");
    Ok(i32::from(failed > 0))
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
    const STEPS: usize = 16;
    let mut step = Step::new(gpu, k, shape, 21)?;
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
    let names = [
        "quest estimate + top-k",
        "hot-buffer diff",
        "loads of misses (PCIe)",
        "attention over the hot buffer",
    ];
    let miss_rate = missed as f64 / selected as f64;
    let page_bytes = shape.page * shape.kv_heads * shape.dim * 2 * 2;
    let loaded = missed as f64 / STEPS as f64 * page_bytes as f64;
    println!(
        "full hierarchical step, one layer, B{} L{}K, budget {} tokens, HOT {} tokens, {STEPS} steps",
        shape.seqs,
        shape.len / 1024,
        shape.budget,
        shape.hot * shape.page
    );
    println!("{:<34} {:>10} {:>7}", "stage", "ms/step", "share");
    for (n, s) in names.iter().zip(stage) {
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
    if let Some(path) = json {
        let mut s = format!(
            "{{\"device\": \"{}\", \"shape\": \"B{} L{}K budget {} HOT {}\", \"miss_rate\": {miss_rate:.4}, \"whole_ms\": {median:.5}, \"stages\": [",
            gpu.name().map_err(err)?,
            shape.seqs,
            shape.len / 1024,
            shape.budget,
            shape.hot * shape.page
        );
        for (i, (n, st)) in names.iter().zip(stage).enumerate() {
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
