//! The GPU half of sparse-algo's checks and benchmarks, for the device bundle (`cargo xtask gpu`).
//!
//! - `gpu_select check`: Quest's device min/max pages (built after a prefill, then maintained
//!   over decode steps) against [`RepPool`] bit for bit, and the device estimate + top-k against
//!   [`Quest::retrieve_topk`](sparse_algo::SparseAlgorithm::retrieve_topk) row for row (per-head
//!   and head-shared, f32/f16/bf16, GQA 1/4/8, sinks and recent tokens, tied scores, a chunked
//!   prefill's last query row), outputs poisoned first; StreamingLLM's device rows against
//!   [`StreamingLlm`]'s, and the DSA indexer's device scores + token top-k against [`Dsa`]'s
//!   with a trained indexer (f32/f16/bf16 keys, tied scores, rows longer than shared memory);
//!   attention right after a top-k that publishes its rows against attention after the whole
//!   top-k, bit for bit; the same with Quest's bounds in FP8 E4M3 (`Summary::E4m3`: the device
//!   pool's codes and scales against the CPU pool bit for bit, the tensor-core selection up to
//!   near ties); exits 1 on any mismatch.
//! - `gpu_select bench [--json FILE] [--only B1|B8] [--min-chunk KEYS] [--waves N] [--variant
//!   NAME]`: bf16, 32 query / 8 KV heads, D 128, pages of 16, a 2K budget: min/max construction,
//!   the fused estimate + top-k, and the estimate, top-k and sparse attention together at B8 L32K
//!   and B1 L128K (with and without programmatic dependent launches, captured in a CUDA graph, and
//!   with the rows published to an attention that starts early), the same over E4M3 bounds (with
//!   how many ids it shares with the bf16 bounds' selection), and that step published from
//!   graphs rotating over 8 layers' pools and pages, as a decode runs it (none of its bytes left
//!   in L2 by the run before; a graph a layer, and all 8 in one graph), with our dense decode in
//!   the same run; StreamingLLM's rows, and the DSA indexer (64 heads of 128, DeepSeek V3.2's
//!   shape) + top-2048 + token attention. Then the attention kernel's registers, and a trace of
//!   one step per shape (per-CTA timestamps of the scoring, `pick_rows` and the attention on
//!   one time axis; plain and published, alone, behind another step and behind the other
//!   layers' steps). `--only` keeps the shapes whose tag starts with its value (for profiling
//!   one shape); `--min-chunk` and `--waves` set the attention's split planner (a split's
//!   fewest keys, the waves of CTAs it aims for) and `--variant` its kernel
//!   (`Gpu::set_variant`) for sweeps.
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

mod cold;
mod steptrace;

use attn_op::cuda::{CudaElement, DeviceBatch, DevicePagedKv, Gpu, Timing};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaContext, CudaGraph, CudaSlice, CudaStream};
use std::sync::Arc;

use attn_op::{AttnError, AttnParams, BatchMeta, Element, KvCache, KvLayout, PagedKv};
use half::{bf16, f16};
use report::{Row, random_bf16, table};
use rng::Rng;
use sparse_algo::cuda::{DeviceRepPool, DeviceTopK, QuestScoring, SelectKernels};
use sparse_algo::summary;
use sparse_algo::{
    AlgoError, AlwaysInclude, Decode, Dsa, DsaConfig, Indexer, KeySource, PagedKeys, Quest,
    QuestConfig, RepPool, SparseAlgorithm, StreamingConfig, StreamingLlm, Summary, TopK,
};

fn main() {
    report::tool_main("gpu_select", &[], run);
}

fn run(cmd: &str, args: &[String]) -> Result<i32, AlgoError> {
    let mut gpu = Gpu::new(0)?;
    println!("device: {}", gpu.name()?);
    let mut sk = SelectKernels::new(&gpu)?;
    match cmd {
        "check" => check(&gpu, &mut sk),
        "bench" => {
            let only = report::flag_value(args, "--only");
            // The split planner's knobs, for sweeps (attn_op::cuda::Gpu::set_min_chunk and
            // set_waves): every attention launch of the bench takes them.
            for (flag, set) in [
                ("--min-chunk", Gpu::set_min_chunk as fn(&mut Gpu, usize)),
                ("--waves", Gpu::set_waves),
            ] {
                if let Some(v) = report::flag_value(args, flag) {
                    match v.parse() {
                        Ok(n) => set(&mut gpu, n),
                        Err(_) => {
                            eprintln!("{flag} takes a count, not {v}");
                            return Ok(2);
                        }
                    }
                }
            }
            if let Some(v) = report::flag_value(args, "--variant") {
                gpu.set_variant(Some(v))?;
            }
            bench(&mut gpu, &mut sk, report::json_arg(args), only)?;
            Ok(0)
        }
        other => {
            eprintln!("unknown command {other}; use check or bench");
            Ok(2)
        }
    }
}

/// One checked configuration.
struct Case {
    name: &'static str,
    q_heads: usize,
    kv_heads: usize,
    d: usize,
    /// KV block size (Quest's pages are 16 tokens).
    bs: usize,
    /// Final sequence lengths.
    lens: &'static [usize],
    budget_tokens: usize,
    sink: u32,
    recent: u32,
    shared: bool,
    /// For a shared selection: one output row per sequence instead of one per KV head.
    per_sequence: bool,
    /// Keys drawn from this many levels (many equal pages, so tied scores), or uniform.
    levels: Option<usize>,
    /// Decode steps after the prefill before the selection.
    steps: usize,
    /// Query rows of each sequence in the selection's batch (a chunked prefill has several).
    q_rows: usize,
}

const CASES: &[Case] = &[
    Case {
        name: "GQA 32/8 D128, short and long",
        q_heads: 32,
        kv_heads: 8,
        d: 128,
        bs: 16,
        lens: &[1000, 4099, 37],
        budget_tokens: 256,
        sink: 0,
        recent: 1,
        shared: false,
        per_sequence: false,
        levels: None,
        steps: 3,
        q_rows: 1,
    },
    Case {
        name: "GQA 16/4 D64, sinks + recent, blocks of 8",
        q_heads: 16,
        kv_heads: 4,
        d: 64,
        bs: 8,
        lens: &[2000, 3001],
        budget_tokens: 512,
        sink: 40,
        recent: 70,
        shared: false,
        per_sequence: false,
        levels: None,
        steps: 2,
        q_rows: 1,
    },
    Case {
        name: "MHA 4/4 D64, chunked prefill row",
        q_heads: 4,
        kv_heads: 4,
        d: 64,
        bs: 16,
        lens: &[700, 1500],
        budget_tokens: 128,
        sink: 16,
        recent: 1,
        shared: false,
        per_sequence: false,
        levels: None,
        steps: 1,
        q_rows: 3,
    },
    Case {
        name: "GQA 32/4 D128, shared, per sequence",
        q_heads: 32,
        kv_heads: 4,
        d: 128,
        bs: 16,
        lens: &[5000, 3333],
        budget_tokens: 1024,
        sink: 0,
        recent: 1,
        shared: true,
        per_sequence: true,
        levels: None,
        steps: 2,
        q_rows: 1,
    },
    Case {
        name: "MQA 8/1 D128, shared, per head",
        q_heads: 8,
        kv_heads: 1,
        d: 128,
        bs: 16,
        lens: &[2100, 900],
        budget_tokens: 512,
        sink: 0,
        recent: 20,
        shared: true,
        per_sequence: false,
        levels: None,
        steps: 1,
        q_rows: 1,
    },
    Case {
        name: "GQA 8/2 D64, tied scores (3 levels)",
        q_heads: 8,
        kv_heads: 2,
        d: 64,
        bs: 16,
        lens: &[3000, 2500],
        budget_tokens: 400,
        sink: 0,
        recent: 1,
        shared: false,
        per_sequence: false,
        levels: Some(3),
        steps: 1,
        q_rows: 1,
    },
    Case {
        name: "GQA 32/8 D128, 40K tokens",
        q_heads: 32,
        kv_heads: 8,
        d: 128,
        bs: 16,
        lens: &[40_000],
        budget_tokens: 2048,
        sink: 0,
        recent: 1,
        shared: false,
        per_sequence: false,
        levels: None,
        steps: 1,
        q_rows: 1,
    },
    Case {
        name: "MQA 4/1 D64, 400K tokens (keys in L2)",
        q_heads: 4,
        kv_heads: 1,
        d: 64,
        bs: 16,
        lens: &[400_000],
        budget_tokens: 4096,
        sink: 64,
        recent: 1,
        shared: false,
        per_sequence: false,
        levels: None,
        steps: 1,
        q_rows: 1,
    },
];

/// Layers and slots of the checked pools: the case runs in layer 1, slots in reverse order.
const LAYERS: usize = 2;
const POISON: i32 = -777;

fn check(gpu: &Gpu, sk: &mut SelectKernels) -> Result<i32, AlgoError> {
    let mut failed = 0;
    let mut total = 0;
    let mut tally = |name: &str, dtype: &str, outcome: Vec<(String, bool)>| {
        for (what, ok) in outcome {
            total += 1;
            failed += usize::from(!ok);
            println!(
                "{} {dtype:<4} {name:<44} {what}",
                if ok { "ok  " } else { "FAIL" }
            );
        }
    };
    for (i, case) in CASES.iter().enumerate() {
        let seed = 100 + i as u64;
        tally(case.name, "f32", check_case::<f32>(gpu, sk, case, seed)?);
        tally(case.name, "f16", check_case::<f16>(gpu, sk, case, seed)?);
        tally(case.name, "bf16", check_case::<bf16>(gpu, sk, case, seed)?);
    }
    for (i, case) in STREAMING.iter().enumerate() {
        tally(
            case.name,
            "-",
            check_streaming(gpu, sk, case, 300 + i as u64)?,
        );
    }
    for (i, case) in DSA_CASES.iter().enumerate() {
        let seed = 400 + i as u64;
        tally(case.name, "f32", check_dsa::<f32>(gpu, sk, case, seed)?);
        tally(case.name, "f16", check_dsa::<f16>(gpu, sk, case, seed)?);
        tally(case.name, "bf16", check_dsa::<bf16>(gpu, sk, case, seed)?);
    }
    println!("gpu_select check: {total} checks, {failed} failed");
    Ok(i32::from(failed > 0))
}

/// Random keys of a case as `T` (uniform in [-1, 1), or drawn from a few levels).
fn keys<T: Element>(rng: &mut Rng, n: usize, levels: Option<usize>) -> Vec<T> {
    (0..n)
        .map(|_| {
            let x = match levels {
                Some(l) => (rng.range(0, l) as f32 - (l / 2) as f32) * 0.5,
                None => rng.unit(),
            };
            T::from_f32(x)
        })
        .collect()
}

/// A batch's metadata: `q_rows[s]` query rows per sequence.
fn meta_for(
    gpu: &Gpu,
    layout: &KvLayout,
    lens: &[usize],
    q_rows: &[usize],
    table: &[i32],
    max_blocks: usize,
) -> Result<DeviceBatch, AlgoError> {
    let mut cu = vec![0i32];
    for &q in q_rows {
        cu.push(cu[cu.len() - 1] + q as i32);
    }
    let lens: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
    let meta = BatchMeta {
        cu_seqlens_q: &cu,
        seq_lens_kv: &lens,
        block_table: table,
        max_blocks,
    };
    Ok(DeviceBatch::upload(gpu, &meta, layout)?)
}

/// A case's data on both sides: keys in a shuffled block table (host and device), the pool
/// slots (reversed, so slot and sequence differ), and the selection's queries.
struct Setup<T: CudaElement> {
    layout: KvLayout,
    table: Vec<i32>,
    max_blocks: usize,
    cpu_kv: PagedKv<T>,
    dev_kv: DevicePagedKv<T>,
    slots: Vec<usize>,
    dslots: CudaSlice<i32>,
    /// Every query row, `[n * q_rows, q_heads, d]`, on the device too.
    q: Vec<T>,
    dq: CudaSlice<T>,
    /// Each sequence's last query row, as f32 (what the CPU selects from).
    last_q: Vec<f32>,
    /// Query heads of a row.
    q_heads: usize,
}

/// The layer the checks build and select in (of [`LAYERS`]).
const LAYER: usize = 1;

impl<T: CudaElement> Setup<T> {
    fn new(gpu: &Gpu, c: &Case, rng: &mut Rng) -> Result<Self, AlgoError> {
        let n = c.lens.len();
        let max_len = c.lens.iter().copied().max().unwrap_or(0);
        let max_blocks = max_len.div_ceil(c.bs);
        let layout = KvLayout {
            num_blocks: n * max_blocks + 3,
            block_size: c.bs,
            kv_heads: c.kv_heads,
            head_dim: c.d,
        };
        let perm = rng.permutation(layout.num_blocks);
        let table: Vec<i32> = (0..n * max_blocks).map(|i| perm[i] as i32).collect();
        let k: Vec<T> = keys(rng, layout.len(), c.levels);
        let cpu_kv = PagedKv::from_tensors(layout, k.clone(), k.clone())?;
        let dev_kv = DevicePagedKv::from_host(gpu, layout, &k, &k)?;
        let slots: Vec<usize> = (0..n).map(|s| n - 1 - s).collect();
        let d = c.d;
        let q: Vec<T> = (0..n * c.q_rows * c.q_heads * d)
            .map(|_| T::from_f32(rng.unit() * 2.0))
            .collect();
        let last_q: Vec<f32> = (0..n)
            .flat_map(|s| {
                let r = (s + 1) * c.q_rows - 1;
                q[r * c.q_heads * d..(r + 1) * c.q_heads * d]
                    .iter()
                    .map(|x| x.to_f32())
            })
            .collect();
        Ok(Setup {
            layout,
            table,
            max_blocks,
            cpu_kv,
            dev_kv,
            dslots: slots_upload(gpu, &slots)?,
            slots,
            dq: gpu.upload(&q)?,
            q,
            last_q,
            q_heads: c.q_heads,
        })
    }

    /// `quest`'s pools on both sides, built at each sequence's length minus the case's decode
    /// steps, then maintained one decode token at a time; and the final lengths.
    fn pools(
        &self,
        gpu: &Gpu,
        sk: &SelectKernels,
        c: &Case,
        quest: &Quest,
    ) -> Result<(RepPool, DeviceRepPool<T>, Vec<usize>), AlgoError> {
        let n = c.lens.len();
        let max_len = c.lens.iter().copied().max().unwrap_or(0);
        let shape = quest.rep_shape(c.kv_heads, c.d);
        let mut cpu = RepPool::new(shape, LAYERS, n, max_len)?;
        let summary = quest.config().summary;
        let mut dev = DeviceRepPool::<T>::with_summary(gpu, shape, LAYERS, n, max_len, summary)?;
        let mut lens: Vec<usize> = c.lens.iter().map(|&l| l - c.steps.min(l - 1)).collect();
        let (table, mb) = (&self.table, self.max_blocks);
        let l32 = |lens: &[usize]| lens.iter().map(|&l| l as i32).collect::<Vec<_>>();
        let now = l32(&lens);
        let pk = PagedKeys::new(&self.cpu_kv, &now, table, mb)?;
        quest.construct_representations(LAYER, &pk, &self.slots, &mut cpu)?;
        let meta = meta_for(gpu, &self.layout, &lens, &lens, table, mb)?;
        sk.update_minmax(quest, &self.dev_kv, &meta, LAYER, &self.dslots, &mut dev)?;
        for _ in 0..c.steps {
            for (l, &fin) in lens.iter_mut().zip(c.lens) {
                *l = (*l + 1).min(fin);
            }
            let now = l32(&lens);
            let pk = PagedKeys::new(&self.cpu_kv, &now, table, mb)?;
            quest.update_representations(LAYER, &pk, &self.slots, &mut cpu)?;
            let meta = meta_for(gpu, &self.layout, &lens, &vec![1; n], table, mb)?;
            sk.update_minmax(quest, &self.dev_kv, &meta, LAYER, &self.dslots, &mut dev)?;
        }
        Ok((cpu, dev, lens))
    }

    /// The selection's step on the CPU side.
    fn step<'a>(&'a self, c: &Case, lens: &'a [usize]) -> Decode<'a> {
        Decode {
            layer: LAYER,
            q: &self.last_q,
            q_heads: c.q_heads,
            kv_heads: c.kv_heads,
            head_dim: c.d,
            seq_lens: lens,
            slots: &self.slots,
            keys: None,
        }
    }

    /// The selection's batch on the device: `q_rows` query rows a sequence.
    fn meta(&self, gpu: &Gpu, c: &Case, lens: &[usize]) -> Result<DeviceBatch, AlgoError> {
        let q_rows = vec![c.q_rows; lens.len()];
        meta_for(
            gpu,
            &self.layout,
            lens,
            &q_rows,
            &self.table,
            self.max_blocks,
        )
    }
}

fn slots_upload(gpu: &Gpu, slots: &[usize]) -> Result<CudaSlice<i32>, AlgoError> {
    Ok(gpu.upload(&slots.iter().map(|&s| s as i32).collect::<Vec<_>>())?)
}

/// Whether the device pool's pages of every sequence equal the CPU pool's bit for bit (an
/// E4M3 pool's codes decoded with their scales).
fn pools_equal<T: CudaElement>(
    gpu: &Gpu,
    c: &Case,
    setup: &Setup<T>,
    cpu: &RepPool,
    dev: &DeviceRepPool<T>,
    lens: &[usize],
) -> Result<bool, AlgoError> {
    let n = lens.len();
    let width = cpu.shape().width;
    let page_len = cpu.shape().page_len();
    let max_pages = c.lens.iter().copied().max().unwrap_or(0).div_ceil(16);
    let values: Vec<f32> = match dev.e4m3() {
        None => gpu
            .download(dev.data())?
            .iter()
            .map(|x| x.to_f32())
            .collect(),
        Some((codes, exps)) => {
            let (codes, exps) = (gpu.download(codes)?, gpu.download(exps)?);
            codes
                .iter()
                .enumerate()
                .map(|(i, &x)| summary::e4m3_value(x) * 2f32.powi(i32::from(exps[i / width])))
                .collect()
        }
    };
    let mut ok = true;
    for (s, &slot) in setup.slots.iter().enumerate() {
        let want = cpu.pages(LAYER, slot)?;
        let at = (LAYER * n + slot) * max_pages * page_len;
        let got = &values[at..at + lens[s].div_ceil(16) * page_len];
        ok &= want.len() == got.len()
            && want
                .iter()
                .zip(got)
                .all(|(w, g)| w.to_bits() == g.to_bits());
    }
    Ok(ok)
}

/// The CPU's score of page `p` for row (s, h) as the near-tie rule reads it, from `pool`'s
/// bounds and the f32 queries, in f64: the best over the row's query heads, and the sum of
/// magnitudes that scales the tie tolerance.
fn cpu_score(
    c: &Case,
    pool: &RepPool,
    setup_slots: &[usize],
    last_q: &[f32],
    (s, h, p): (usize, usize, i32),
) -> (f64, f64) {
    let (kvh, d) = (c.kv_heads, c.d);
    let g = c.q_heads / kvh;
    let pages = pool
        .pages(LAYER, setup_slots[s])
        .expect("the check's CPU pool holds every sequence's pages");
    let q = &last_q[s * c.q_heads * d..(s + 1) * c.q_heads * d];
    let heads = if c.shared {
        0..c.q_heads
    } else {
        h * g..(h + 1) * g
    };
    let (mut best, mut mag) = (f64::NEG_INFINITY, 0.0f64);
    for qh in heads {
        // A page past the sequence's end scores +inf, which no near tie allows.
        let at = (p.max(0) as usize * kvh + qh / g) * 2 * d;
        let Some(row) = pages.get(at..at + 2 * d) else {
            return (f64::INFINITY, 0.0);
        };
        let (mut sum, mut abs) = (0.0f64, 0.0f64);
        for (e, &x) in q[qh * d..(qh + 1) * d].iter().enumerate() {
            let k = if x >= 0.0 { row[e] } else { row[d + e] };
            sum += f64::from(x) * f64::from(k);
            abs += f64::from(x.abs()) * f64::from(k.abs());
        }
        best = best.max(sum);
        mag = mag.max(abs);
    }
    (best, mag)
}

fn check_case<T: CudaElement>(
    gpu: &Gpu,
    sk: &mut SelectKernels,
    c: &Case,
    seed: u64,
) -> Result<Vec<(String, bool)>, AlgoError> {
    let mut rng = Rng::new(seed);
    let n = c.lens.len();
    let kvh = c.kv_heads;
    let setup = Setup::<T>::new(gpu, c, &mut rng)?;
    let config = QuestConfig {
        page_size: 16,
        budget_tokens: c.budget_tokens,
        always: AlwaysInclude {
            sink_tokens: c.sink,
            recent_tokens: c.recent,
        },
        shared_heads: c.shared,
        summary: Summary::Exact,
    };
    let quest = Quest::new(config)?;
    let (cpu_pool, dev_pool, lens) = setup.pools(gpu, sk, c, &quest)?;
    let max_len = c.lens.iter().copied().max().unwrap_or(0);
    let mut results = vec![(
        "min/max pages equal the CPU pool".to_owned(),
        pools_equal(gpu, c, &setup, &cpu_pool, &dev_pool, &lens)?,
    )];

    // The selection: CPU from the f32 values of the same T queries.
    let want = quest.retrieve_topk(&setup.step(c, &lens), &cpu_pool)?;
    let meta = setup.meta(gpu, c, &lens)?;
    let (dq, dslots) = (&setup.dq, &setup.dslots);
    let mut out = DeviceTopK::new(gpu, &quest, n, kvh, max_len, c.per_sequence)?;
    poison(gpu, &mut out)?;
    // Twice: the second launch finds the score keys the first left (zeroed).
    for _ in 0..2 {
        sk.quest_topk(
            &quest, dq, c.q_heads, &meta, LAYER, dslots, &dev_pool, &mut out,
        )?;
    }
    results.extend(compare_rows(gpu, &want, &out, &lens, None)?);

    // Tensor-core scores, where the kernel takes the shape: equal up to near ties.
    if tensor_cores_apply::<T>(c) {
        let score = |s: usize, h: usize, p: i32| {
            cpu_score(c, &cpu_pool, &setup.slots, &setup.last_q, (s, h, p))
        };
        sk.set_quest_scoring(QuestScoring::TensorCores);
        poison(gpu, &mut out)?;
        let mut run = || -> Result<(), AlgoError> {
            for _ in 0..2 {
                sk.quest_topk(
                    &quest, dq, c.q_heads, &meta, LAYER, dslots, &dev_pool, &mut out,
                )?;
            }
            Ok(())
        };
        let ran = run();
        sk.set_quest_scoring(QuestScoring::Exact);
        ran?;
        let near = compare_rows(gpu, &want, &out, &lens, Some(&score))?;
        results.extend(
            near.into_iter()
                .map(|(w, ok)| (format!("tensor cores: {w}"), ok)),
        );
        // The exact kernel again, after a tensor-core estimate of other queries on the same
        // buffers: a per-head row's keys are stored and left, and must not leak into the
        // exact kernel's atomicMax.
        let other = gpu.upload(&setup.q.iter().rev().copied().collect::<Vec<T>>())?;
        sk.set_quest_scoring(QuestScoring::TensorCores);
        let ran = sk.quest_topk(
            &quest, &other, c.q_heads, &meta, LAYER, dslots, &dev_pool, &mut out,
        );
        sk.set_quest_scoring(QuestScoring::Exact);
        ran?;
        poison(gpu, &mut out)?;
        sk.quest_topk(
            &quest, dq, c.q_heads, &meta, LAYER, dslots, &dev_pool, &mut out,
        )?;
        let again = compare_rows(gpu, &want, &out, &lens, None)?;
        results.extend(
            again
                .into_iter()
                .map(|(w, ok)| (format!("exact after tensor cores: {w}"), ok)),
        );
    }
    results.extend(check_e4m3(gpu, sk, c, &setup, config, &mut out)?);
    if !c.per_sequence {
        let published = check_published(gpu, sk, &quest, &setup, &meta, &dev_pool, &mut out);
        results.push(published?);
    }
    Ok(results)
}

/// Whether the tensor-core scoring takes a case's shape: f16 or bf16 queries, at most 8 per KV
/// head, head dim 64 or 128.
fn tensor_cores_apply<T: CudaElement>(c: &Case) -> bool {
    let g = c.q_heads / c.kv_heads;
    T::DTYPE != attn_op::DType::F32 && g <= 8 && (c.d == 64 || c.d == 128)
}

/// Quest with E4M3 summaries ([`Summary::E4m3`]): the device pool's codes and scales decode to
/// the CPU pool's values bit for bit, the tensor-core selection equals the CPU's up to near
/// ties, and attention right after its published rows equals attention after the whole top-k.
/// Where the tensor cores do not take the shape (f32 queries, a group past 8 or another head
/// dim), the top-k is refused with an error, and its output left alone.
fn check_e4m3<T: CudaElement>(
    gpu: &Gpu,
    sk: &mut SelectKernels,
    c: &Case,
    setup: &Setup<T>,
    config: QuestConfig,
    out: &mut DeviceTopK,
) -> Result<Vec<(String, bool)>, AlgoError> {
    let quest = Quest::new(QuestConfig {
        summary: Summary::E4m3,
        ..config
    })?;
    let (dq, dslots) = (&setup.dq, &setup.dslots);
    if !tensor_cores_apply::<T>(c) {
        let max_len = c.lens.iter().copied().max().unwrap_or(0);
        let shape = quest.rep_shape(c.kv_heads, c.d);
        let n = c.lens.len();
        let pool = DeviceRepPool::<T>::with_summary(gpu, shape, LAYERS, n, max_len, Summary::E4m3)?;
        let meta = setup.meta(gpu, c, c.lens)?;
        poison(gpu, out)?;
        let refused = sk
            .quest_topk(&quest, dq, c.q_heads, &meta, LAYER, dslots, &pool, out)
            .is_err();
        let untouched = gpu.download(&out.sel.lens)?.iter().all(|&x| x == POISON);
        let what = "e4m3 refused where the tensor cores do not apply, output untouched";
        return Ok(vec![(what.to_owned(), refused && untouched)]);
    }
    let (cpu_pool, dev_pool, lens) = setup.pools(gpu, sk, c, &quest)?;
    let mut results = vec![(
        "e4m3: pages equal the CPU pool".to_owned(),
        pools_equal(gpu, c, setup, &cpu_pool, &dev_pool, &lens)?,
    )];
    let want = quest.retrieve_topk(&setup.step(c, &lens), &cpu_pool)?;
    let meta = setup.meta(gpu, c, &lens)?;
    poison(gpu, out)?;
    for _ in 0..2 {
        sk.quest_topk(&quest, dq, c.q_heads, &meta, LAYER, dslots, &dev_pool, out)?;
    }
    let score = |s: usize, h: usize, p: i32| {
        cpu_score(c, &cpu_pool, &setup.slots, &setup.last_q, (s, h, p))
    };
    let near = compare_rows(gpu, &want, out, &lens, Some(&score))?;
    results.extend(near.into_iter().map(|(w, ok)| (format!("e4m3: {w}"), ok)));
    if !c.per_sequence {
        let (what, ok) = check_published(gpu, sk, &quest, setup, &meta, &dev_pool, out)?;
        results.push((format!("e4m3: {what}"), ok));
    }
    Ok(results)
}

/// Attention right after a published top-k ([`SelectKernels::set_publish`]), each CTA
/// waiting for its own row's flag, against attention after the whole top-k: the same rows,
/// and the same output bits. Twice, so that the second launch finds the first one's flags.
fn check_published<T: CudaElement>(
    gpu: &Gpu,
    sk: &mut SelectKernels,
    quest: &Quest,
    setup: &Setup<T>,
    meta: &DeviceBatch,
    pool: &DeviceRepPool<T>,
    out: &mut DeviceTopK,
) -> Result<(String, bool), AlgoError> {
    let (q, kv, slots) = (&setup.dq, &setup.dev_kv, &setup.dslots);
    let q_heads = setup.q_heads;
    let params = AttnParams::new(q_heads, kv.layout().head_dim);
    let n = q.len();
    sk.quest_topk(quest, q, q_heads, meta, LAYER, slots, pool, out)?;
    let want_ids = gpu.download(&out.sel.ids)?;
    let mut want = gpu.zeros::<f32>(n)?;
    gpu.sparse_page_attention(q, kv, meta, &out.sel, &params, &mut want, None)?;
    let want = gpu.download(&want)?;
    let mut got = gpu.upload(&vec![f32::NAN; n])?;
    sk.set_publish(true);
    let mut run = || -> Result<(), AlgoError> {
        for _ in 0..2 {
            sk.quest_topk(quest, q, q_heads, meta, LAYER, slots, pool, out)?;
            let published = out
                .published()
                .ok_or_else(|| AlgoError::Invalid("a published top-k left no flags".into()))?;
            // SAFETY: the launch right before is the top-k that publishes `out.sel` through
            // these flags, and q, kv and meta were complete before its scoring began.
            unsafe {
                gpu.sparse_page_attention_published(
                    q, kv, meta, &out.sel, published, &params, &mut got, None,
                )
            }?;
        }
        Ok(())
    };
    let ran = run();
    sk.set_publish(false);
    ran?;
    let same_ids = gpu.download(&out.sel.ids)? == want_ids;
    let got = gpu.download(&got)?;
    let same_out = want
        .iter()
        .zip(&got)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    Ok((
        format!("published rows: same rows {same_ids}, attention bit for bit {same_out}"),
        same_ids && same_out,
    ))
}

/// A page's CPU score for a selection row (sequence, KV head) in f64, and the sum of its
/// products' magnitudes (the scale of its rounding).
type ScoreOf<'a> = &'a dyn Fn(usize, usize, i32) -> (f64, f64);

/// Where two selections of one row may differ with tensor-core scores: pages whose f64 scores
/// lie within this fraction of their products' magnitudes of each other (f32 sums of 256
/// terms in two orders differ by far less).
const NEAR_TIE: f64 = 1.0 / 65536.0;

/// Fills a selection's outputs with [`POISON`], so rows the kernels skip show.
fn poison(gpu: &Gpu, out: &mut DeviceTopK) -> Result<(), AlgoError> {
    let (rows, width) = (out.sel.rows, out.sel.max_len);
    let stream = gpu.stream();
    stream
        .memcpy_htod(&vec![POISON; rows * width], &mut out.sel.ids)
        .map_err(AttnError::from)?;
    stream
        .memcpy_htod(&vec![POISON; rows], &mut out.sel.lens)
        .map_err(AttnError::from)?;
    stream
        .memcpy_htod(&vec![POISON; rows], &mut out.covered)
        .map_err(AttnError::from)?;
    Ok(())
}

/// The device rows against the CPU's `want` (one row per sequence or per (sequence, KV head)):
/// ids, -1 padding, and the tokens each row covers in sequences of `lens` tokens. With `near`
/// (the CPU's scores), a row may swap pages whose scores tie within [`NEAR_TIE`].
fn compare_rows(
    gpu: &Gpu,
    want: &TopK,
    out: &DeviceTopK,
    lens: &[usize],
    near: Option<ScoreOf<'_>>,
) -> Result<Vec<(String, bool)>, AlgoError> {
    let (rows, width) = (out.sel.rows, out.sel.max_len);
    let ps = want.page_size;
    let (ids, dlens, covered) = (
        gpu.download(&out.sel.ids)?,
        gpu.download(&out.sel.lens)?,
        gpu.download(&out.covered)?,
    );
    let per_seq = rows / lens.len().max(1);
    let mut sel_ok = true;
    let mut cover_ok = true;
    let mut pad_ok = true;
    let mut swapped = 0;
    for r in 0..rows {
        let (s, h) = (r / per_seq, if per_seq == 1 { 0 } else { r % per_seq });
        let w = want.row(s, h);
        let len = dlens[r];
        let got = &ids[r * width..(r + 1) * width];
        let same = len == w.len() as i32 && w.len() <= width && &got[..w.len()] == w;
        let row_ok = same
            || near.is_some_and(|score| {
                len == w.len() as i32
                    && w.len() <= width
                    && near_tie(w, &got[..w.len()], |p| score(s, h, p))
            });
        swapped += usize::from(row_ok && !same);
        sel_ok &= row_ok;
        pad_ok &= got[w.len().min(width)..].iter().all(|&x| x == -1);
        let tokens: usize = w.iter().map(|&p| (lens[s] - p as usize * ps).min(ps)).sum();
        cover_ok &= covered[r] == tokens as i32;
    }
    let picked: usize = (0..rows).map(|r| dlens[r].max(0) as usize).sum::<usize>();
    let rule = if near.is_some() {
        format!(" but {swapped} with near ties")
    } else {
        String::new()
    };
    Ok(vec![
        (
            format!("selection rows equal the CPU's{rule} ({rows} rows, {picked} ids)"),
            sel_ok,
        ),
        ("rows padded with -1".to_owned(), pad_ok),
        ("covered tokens".to_owned(), cover_ok),
    ])
}

/// Whether a device row `got` differs from the CPU's `want` (both ascending, equal lengths)
/// only by pages whose scores tie within [`NEAR_TIE`]: every page in one and not the other
/// scores within that of all the others. Swapped pages cover whole pages (only mid pages are
/// scored, and those are never a sequence's last), so the covered tokens still agree.
fn near_tie(want: &[i32], got: &[i32], score: impl Fn(i32) -> (f64, f64)) -> bool {
    if got.windows(2).any(|w| w[0] >= w[1]) || got.iter().any(|&p| p < 0) {
        return false;
    }
    let only_want = want.iter().filter(|p| got.binary_search(p).is_err());
    let only_got = got.iter().filter(|p| want.binary_search(p).is_err());
    let odd: Vec<i32> = only_want.chain(only_got).copied().collect();
    let scored: Vec<(f64, f64)> = odd.iter().map(|&p| score(p)).collect();
    let lo = scored.iter().map(|x| x.0).fold(f64::INFINITY, f64::min);
    let hi = scored.iter().map(|x| x.0).fold(f64::NEG_INFINITY, f64::max);
    let mag = scored.iter().map(|x| x.1).fold(0.0, f64::max);
    hi - lo <= NEAR_TIE * mag
}

/// One checked StreamingLLM configuration.
struct StreamingCase {
    name: &'static str,
    kv_heads: usize,
    lens: &'static [usize],
    sink: u32,
    window: u32,
    page_size: usize,
    per_sequence: bool,
}

const STREAMING: &[StreamingCase] = &[
    StreamingCase {
        name: "StreamingLLM 4 + 2044 tokens, kvh 8",
        kv_heads: 8,
        lens: &[5000, 1000, 2049, 1, 2048],
        sink: 4,
        window: 2044,
        page_size: 1,
        per_sequence: false,
    },
    StreamingCase {
        name: "StreamingLLM pages of 16, per sequence",
        kv_heads: 2,
        lens: &[40_000, 777, 16, 17],
        sink: 64,
        window: 1000,
        page_size: 16,
        per_sequence: true,
    },
    StreamingCase {
        name: "StreamingLLM no sinks, window 1, MQA",
        kv_heads: 1,
        lens: &[33, 16, 3],
        sink: 0,
        window: 1,
        page_size: 16,
        per_sequence: false,
    },
];

/// A batch's metadata over an identity block table of blocks of 16 (for the selections that
/// read no KV).
fn plain_meta(gpu: &Gpu, kv_heads: usize, lens: &[usize]) -> Result<DeviceBatch, AlgoError> {
    let max_blocks = lens.iter().copied().max().unwrap_or(0).div_ceil(16).max(1);
    let layout = KvLayout {
        num_blocks: lens.len() * max_blocks,
        block_size: 16,
        kv_heads,
        head_dim: 16,
    };
    let table: Vec<i32> = (0..(lens.len() * max_blocks) as i32).collect();
    meta_for(gpu, &layout, lens, &vec![1; lens.len()], &table, max_blocks)
}

/// A decode step's inputs for the selections that read neither queries nor keys.
fn plain_decode<'a>(
    kv_heads: usize,
    lens: &'a [usize],
    slots: &'a [usize],
    q: &'a [f32],
) -> Decode<'a> {
    Decode {
        layer: 1,
        q,
        q_heads: kv_heads,
        kv_heads,
        head_dim: 16,
        seq_lens: lens,
        slots,
        keys: None,
    }
}

fn check_streaming(
    gpu: &Gpu,
    sk: &SelectKernels,
    c: &StreamingCase,
    seed: u64,
) -> Result<Vec<(String, bool)>, AlgoError> {
    let mut rng = Rng::new(seed);
    let n = c.lens.len();
    let algo = StreamingLlm::new(StreamingConfig {
        sink_tokens: c.sink,
        window_tokens: c.window,
        page_size: c.page_size,
    })?;
    let max_len = c.lens.iter().copied().max().unwrap_or(1);
    let pool = RepPool::new(algo.rep_shape(c.kv_heads, 16), LAYERS, n, max_len)?;
    let slots: Vec<usize> = (0..n).collect();
    let q: Vec<f32> = (0..n * c.kv_heads * 16).map(|_| rng.unit()).collect();
    let want = algo.retrieve_topk(&plain_decode(c.kv_heads, c.lens, &slots, &q), &pool)?;
    let meta = plain_meta(gpu, c.kv_heads, c.lens)?;
    let mut out = DeviceTopK::streaming(gpu, &algo, n, c.kv_heads, c.per_sequence)?;
    poison(gpu, &mut out)?;
    sk.streaming_topk(&algo, &meta, &mut out)?;
    compare_rows(gpu, &want, &out, c.lens, None)
}

/// One checked DSA configuration (a trained indexer; the selection is per sequence).
struct DsaCase {
    name: &'static str,
    heads: usize,
    dim: usize,
    kv_heads: usize,
    lens: &'static [usize],
    topk: usize,
    sink: u32,
    recent: u32,
    /// Keys drawn from this many levels (tied scores), or uniform.
    levels: Option<usize>,
    /// Only this many distinct keys, repeated along each sequence (scores tied exactly).
    distinct: Option<usize>,
    per_sequence: bool,
}

const DSA_CASES: &[DsaCase] = &[
    DsaCase {
        name: "DSA 4 heads of 64, top-256, kvh 2",
        heads: 4,
        dim: 64,
        kv_heads: 2,
        lens: &[3000, 700, 100, 257],
        topk: 256,
        sink: 0,
        recent: 1,
        levels: None,
        distinct: None,
        per_sequence: false,
    },
    DsaCase {
        name: "DSA 16 heads of 128, top-2048, sinks + recent",
        heads: 16,
        dim: 128,
        kv_heads: 1,
        lens: &[40_000, 5000],
        topk: 2048,
        sink: 4,
        recent: 64,
        levels: None,
        distinct: None,
        per_sequence: true,
    },
    DsaCase {
        name: "DSA 8 heads of 32, tied scores (3 levels)",
        heads: 8,
        dim: 32,
        kv_heads: 4,
        lens: &[1500, 2500],
        topk: 100,
        sink: 0,
        recent: 1,
        levels: Some(3),
        distinct: None,
        per_sequence: true,
    },
    DsaCase {
        // 1500 keys tie at the top: more candidates than the selecting CTA keeps.
        name: "DSA 4 heads of 32, 4 distinct keys, 6000 tokens",
        heads: 4,
        dim: 32,
        kv_heads: 2,
        lens: &[6000, 4000],
        topk: 300,
        sink: 0,
        recent: 1,
        levels: None,
        distinct: Some(4),
        per_sequence: false,
    },
    DsaCase {
        // 750 keys tie at the top: all of them candidates.
        name: "DSA 4 heads of 32, 8 distinct keys, 6000 tokens",
        heads: 4,
        dim: 32,
        kv_heads: 1,
        lens: &[6000],
        topk: 300,
        sink: 16,
        recent: 1,
        levels: None,
        distinct: Some(8),
        per_sequence: true,
    },
    DsaCase {
        // Every score, the pick-th largest too, shared by 28 to 38 tokens: ties at the threshold.
        name: "DSA 4 heads of 32, 160 distinct keys, 6000 tokens",
        heads: 4,
        dim: 32,
        kv_heads: 2,
        lens: &[6000, 4500],
        topk: 300,
        sink: 0,
        recent: 1,
        levels: None,
        distinct: Some(160),
        per_sequence: false,
    },
    DsaCase {
        // The same, by 8 to 32 tokens, with sink pages.
        name: "DSA 4 heads of 32, 256 distinct keys, 8000 tokens",
        heads: 4,
        dim: 32,
        kv_heads: 1,
        lens: &[8000, 2100],
        topk: 200,
        sink: 16,
        recent: 1,
        levels: None,
        distinct: Some(256),
        per_sequence: true,
    },
    DsaCase {
        name: "DSA 2 heads of 16, 70K tokens (keys past smem)",
        heads: 2,
        dim: 16,
        kv_heads: 1,
        lens: &[70_000],
        topk: 512,
        sink: 16,
        recent: 1,
        levels: None,
        distinct: None,
        per_sequence: false,
    },
];

/// A trained indexer held in tables: keys `[len, dim]` per sequence, one query `[heads, dim]`
/// and weights `[heads]` per sequence (every layer the same).
struct TableIndexer {
    heads: usize,
    dim: usize,
    keys: Vec<Vec<f32>>,
    q: Vec<f32>,
    w: Vec<f32>,
}

impl Indexer for TableIndexer {
    fn heads(&self) -> usize {
        self.heads
    }
    fn dim(&self) -> usize {
        self.dim
    }
    fn keys(&self, _layer: usize, seq: usize, start: usize, dst: &mut [f32]) {
        dst.copy_from_slice(&self.keys[seq][start * self.dim..start * self.dim + dst.len()]);
    }
    fn queries(&self, _layer: usize, seq: usize, q: &mut [f32], weights: &mut [f32]) {
        let hd = self.heads * self.dim;
        q.copy_from_slice(&self.q[seq * hd..(seq + 1) * hd]);
        weights.copy_from_slice(&self.w[seq * self.heads..(seq + 1) * self.heads]);
    }
}

/// Sequence lengths only: what a trained indexer's representation update asks of the keys.
struct Lengths<'a>(&'a [usize]);

impl KeySource for Lengths<'_> {
    fn num_seqs(&self) -> usize {
        self.0.len()
    }
    fn kv_heads(&self) -> usize {
        1
    }
    fn head_dim(&self) -> usize {
        16
    }
    fn seq_len(&self, seq: usize) -> usize {
        self.0[seq]
    }
    fn read(&self, _seq: usize, _start: usize, dst: &mut [f32]) {
        // A trained indexer builds its representations from its own keys, never these.
        dst.fill(f32::NAN);
    }
}

fn check_dsa<T: CudaElement>(
    gpu: &Gpu,
    sk: &SelectKernels,
    c: &DsaCase,
    seed: u64,
) -> Result<Vec<(String, bool)>, AlgoError> {
    let mut rng = Rng::new(seed);
    let n = c.lens.len();
    // Keys the element type holds exactly, so the CPU's f32 pool and the device's agree.
    let keys_of = |rng: &mut Rng, len: usize| -> Vec<f32> {
        let rows = c.distinct.map_or(len, |d| d.min(len));
        let k: Vec<f32> = keys::<T>(rng, rows * c.dim, c.levels)
            .iter()
            .map(|x| x.to_f32())
            .collect();
        (0..len)
            .flat_map(|t| &k[(t % rows) * c.dim..][..c.dim])
            .copied()
            .collect()
    };
    let ix = TableIndexer {
        heads: c.heads,
        dim: c.dim,
        keys: c.lens.iter().map(|&l| keys_of(&mut rng, l)).collect(),
        q: (0..n * c.heads * c.dim).map(|_| rng.unit()).collect(),
        w: (0..n * c.heads).map(|_| rng.unit()).collect(),
    };
    let (q, w) = (gpu.upload(&ix.q)?, gpu.upload(&ix.w)?);
    let dsa = Dsa::new(
        DsaConfig {
            topk: c.topk,
            always: AlwaysInclude {
                sink_tokens: c.sink,
                recent_tokens: c.recent,
            },
        },
        Some(Arc::new(ix)),
    )?;
    let max_len = c.lens.iter().copied().max().unwrap_or(1);
    let shape = dsa.rep_shape(c.kv_heads, 16);
    let slots: Vec<usize> = (0..n).map(|s| n - 1 - s).collect();
    let mut pool = RepPool::new(shape, LAYERS, n, max_len)?;
    let layer = 1;
    dsa.update_representations(layer, &Lengths(c.lens), &slots, &mut pool)?;
    let mut dev_pool = DeviceRepPool::<T>::new(gpu, shape, LAYERS, n, max_len)?;
    let host: Vec<T> = pool.data().iter().map(|&x| T::from_f32(x)).collect();
    gpu.stream()
        .memcpy_htod(&host, dev_pool.data_mut())
        .map_err(AttnError::from)?;
    let attn_q: Vec<f32> = (0..n * c.kv_heads * 16).map(|_| rng.unit()).collect();
    let step = plain_decode(c.kv_heads, c.lens, &slots, &attn_q);
    let want = dsa.retrieve_topk(&step, &pool)?;
    let meta = plain_meta(gpu, c.kv_heads, c.lens)?;
    let dslots = gpu.upload(&slots.iter().map(|&s| s as i32).collect::<Vec<_>>())?;
    let mut out = DeviceTopK::dsa(gpu, &dsa, n, c.kv_heads, max_len, c.per_sequence)?;
    poison(gpu, &mut out)?;
    // Twice: the second launch finds the score keys the first left.
    for _ in 0..2 {
        sk.dsa_topk(&dsa, &q, &w, &meta, layer, &dslots, &dev_pool, &mut out)?;
    }
    compare_rows(gpu, &want, &out, c.lens, None)
}

const Q_HEADS: usize = 32;
const KV_HEADS: usize = 8;
const D: usize = 128;
const PS: usize = 16;
/// Blocks of the shared pool: 512K tokens, 1 GiB of K and V in bf16.
const POOL_BLOCKS: usize = 32 * 1024;
const RUNS: usize = 50;

fn bench(
    gpu: &mut Gpu,
    sk: &mut SelectKernels,
    json: Option<&str>,
    only: Option<&str>,
) -> Result<(), AlgoError> {
    let mut rows = Vec::new();
    let mut traces: Vec<String> = Vec::new();
    let n = 1usize << 28;
    let src = gpu.zeros::<u32>(n)?;
    let mut dst = gpu.zeros::<u32>(n)?;
    let stream = gpu.stream().clone();
    let copy = gpu.time(RUNS, || {
        stream
            .memcpy_dtod(&src, &mut dst)
            .map_err(|e| AlgoError::from(AttnError::from(e)))
    })?;
    drop((src, dst));
    let bw = (n * 8) as f64 / copy.synced / 1e6;
    rows.push(Row {
        name: "copy d2d 1 GiB".to_owned(),
        t: copy,
        bytes: (n * 8) as f64,
        note: "read + write".to_owned(),
    });

    let layout = KvLayout {
        num_blocks: POOL_BLOCKS,
        block_size: PS,
        kv_heads: KV_HEADS,
        head_dim: D,
    };
    let k = random_bf16(layout.len(), 1);
    let kv = DevicePagedKv::from_host(gpu, layout, &k, &k)?;
    drop(k);
    let params = AttnParams::new(Q_HEADS, D);
    let mut rng = Rng::new(11);
    for (b, ctx) in [(8usize, 32 * 1024usize), (1, 128 * 1024)] {
        let tag = format!("B{b} L{}K", ctx / 1024);
        if only.is_some_and(|o| !tag.starts_with(o)) {
            continue;
        }
        let blocks = ctx / PS;
        let perm = rng.permutation(POOL_BLOCKS);
        let table: Vec<i32> = (0..b * blocks).map(|i| perm[i] as i32).collect();
        let lens = vec![ctx; b];
        let prefill = meta_for(gpu, &layout, &lens, &lens, &table, blocks)?;
        let decode = meta_for(gpu, &layout, &lens, &vec![1; b], &table, blocks)?;
        let slots = gpu.upload(&(0..b as i32).collect::<Vec<_>>())?;
        let q = gpu.upload(&random_bf16(b * Q_HEADS * D, 3))?;
        let mut out_attn = gpu.zeros::<f32>(b * Q_HEADS * D)?;
        let kv_bytes = (b * ctx * KV_HEADS * D * 2 * 2) as f64;
        let rep_bytes = (b * blocks * KV_HEADS * 2 * D * 2) as f64;
        for shared in [false, true] {
            let quest = Quest::new(QuestConfig {
                page_size: PS,
                budget_tokens: 2048,
                shared_heads: shared,
                ..Default::default()
            })?;
            let mode = if shared { " shared" } else { "" };
            let shape = quest.rep_shape(KV_HEADS, D);
            let mut pool = DeviceRepPool::<bf16>::new(gpu, shape, 1, b, ctx)?;
            let mut top = DeviceTopK::new(gpu, &quest, b, KV_HEADS, ctx, false)?;
            if !shared {
                let t = gpu.time(RUNS, || {
                    sk.update_minmax(&quest, &kv, &prefill, 0, &slots, &mut pool)
                })?;
                rows.push(Row {
                    name: format!("quest build min/max {tag}"),
                    t,
                    bytes: kv_bytes / 2.0 + rep_bytes,
                    note: format!(
                        "{:.2} of copy bw",
                        (kv_bytes / 2.0 + rep_bytes) / t.synced / 1e6 / bw
                    ),
                });
                let t = gpu.time(RUNS, || {
                    sk.update_minmax(&quest, &kv, &decode, 0, &slots, &mut pool)
                })?;
                rows.push(Row {
                    name: format!("quest decode min/max {tag}"),
                    t,
                    bytes: 0.0,
                    note: "the current page".to_owned(),
                });
            } else {
                sk.update_minmax(&quest, &kv, &prefill, 0, &slots, &mut pool)?;
            }
            // The exact kernel's ids, against which the tensor-core ones are counted.
            let mut exact_ids: Vec<i32> = Vec::new();
            for scoring in [QuestScoring::Exact, QuestScoring::TensorCores] {
                sk.set_quest_scoring(scoring);
                let how = match scoring {
                    QuestScoring::Exact => "",
                    QuestScoring::TensorCores => " tc",
                };
                let t = gpu.time(RUNS, || {
                    sk.quest_topk(&quest, &q, Q_HEADS, &decode, 0, &slots, &pool, &mut top)
                })?;
                let name = format!("quest estimate+top-k{how}{mode} {tag}");
                rows.push(bw_row(name, t, rep_bytes, bw, ""));
                // With programmatic dependent launches where the device has them (the
                // default), then, for the tensor-core scoring, serialized: what they save.
                let serial_too = scoring == QuestScoring::TensorCores && gpu.dependent_launches();
                for serialized in [false, true] {
                    if serialized && !serial_too {
                        continue;
                    }
                    gpu.set_dependent_launches(!serialized);
                    sk.set_dependent_launches(gpu, !serialized);
                    let t = gpu.time(RUNS, || {
                        sk.quest_topk(&quest, &q, Q_HEADS, &decode, 0, &slots, &pool, &mut top)?;
                        gpu.sparse_page_attention(
                            &q,
                            &kv,
                            &decode,
                            &top.sel,
                            &params,
                            &mut out_attn,
                            None,
                        )?;
                        Ok::<(), AlgoError>(())
                    });
                    gpu.set_dependent_launches(true);
                    sk.set_dependent_launches(gpu, true);
                    let (tag2, note) = if serialized {
                        (
                            " serialized",
                            "the same, without programmatic dependent launches",
                        )
                    } else {
                        ("", "estimate, top-k, attention over the selection")
                    };
                    rows.push(Row {
                        name: format!("quest+sparse attn 2K{how}{mode}{tag2} {tag}"),
                        t: t?,
                        bytes: rep_bytes + (b * KV_HEADS * 2048 * D * 4) as f64,
                        note: note.to_owned(),
                    });
                }
                if scoring == QuestScoring::TensorCores {
                    let step_tag = format!("{mode} {tag}");
                    let mut step = steptrace::Step {
                        quest: &quest,
                        q: &q,
                        kv: &kv,
                        decode: &decode,
                        slots: &slots,
                        pool: &pool,
                        layer: 0,
                        top: &mut top,
                        out: &mut out_attn,
                        tag: &step_tag,
                    };
                    for publish in [false, true] {
                        rows.push(bench_graph(gpu, sk, &mut step, publish)?);
                    }
                    rows.push(bench_published(gpu, sk, &mut step)?);
                    if !shared {
                        traces.extend(steptrace::trace_step(gpu, sk, &mut step)?);
                    }
                }
                let ids = gpu.download(&top.sel.ids)?;
                if scoring == QuestScoring::Exact {
                    exact_ids = ids;
                } else {
                    let (same, all) = same_ids(&exact_ids, &ids, top.sel.max_len);
                    let estimate = format!("quest estimate+top-k{how}{mode} {tag}");
                    if let Some(r) = rows.iter_mut().rev().find(|r| r.name == estimate) {
                        r.note.push_str(&format!("; ids as exact: {same} of {all}"));
                    }
                }
            }
            sk.set_quest_scoring(QuestScoring::Exact);
        }
        rows.extend(bench_e4m3(
            gpu,
            sk,
            &kv,
            (&prefill, &decode),
            &slots,
            &q,
            &mut out_attn,
            (b, ctx),
            &tag,
            bw,
            &mut traces,
        )?);
        let shape = cold::Shape {
            kv: &kv,
            layout: &layout,
            q: &q,
            slots: &slots,
            b,
            ctx,
            tag: &tag,
        };
        // Its own generator, so that the shapes after it keep their tables.
        let mut cold_rng = Rng::new(29 + b as u64);
        rows.extend(cold::bench_cold(
            gpu,
            sk,
            &shape,
            &mut out_attn,
            &mut cold_rng,
            &mut traces,
        )?);
        let t = gpu.time(RUNS, || {
            gpu.paged_attention(&q, &kv, &decode, &params, &mut out_attn, None)
        })?;
        rows.push(Row {
            name: format!("ours dense decode {tag}"),
            t,
            bytes: kv_bytes,
            note: format!("{:.2} of copy bw", kv_bytes / t.synced / 1e6 / bw),
        });
        rows.extend(bench_token_selections(
            gpu, sk, &kv, &decode, &q, &slots, b, ctx, &tag,
        )?);
    }

    print!("{}", table(&rows));
    for published in [false, true] {
        let (regs, local, ctas) = gpu.attention_resources(attn_op::DType::BF16, D, published)?;
        println!(
            "attention kernel (bf16, D {D}{}): {regs} registers, {local} bytes of local memory \
             a thread, {ctas} CTAs a multiprocessor",
            if published { ", published rows" } else { "" }
        );
    }
    for t in &traces {
        print!("{t}");
    }
    if let Some(path) = json {
        let body = report::json(&gpu.name()?, &rows);
        std::fs::write(path, body).map_err(|e| AlgoError::Invalid(format!("{path}: {e}")))?;
    }
    Ok(())
}

/// Quest with E4M3 summaries ([`Summary::E4m3`]) at one shape, `b` sequences of `ctx` tokens:
/// the pool's construction, the estimate + top-k, and the step with attention (eager, from a
/// CUDA graph, and published), each checked as the bf16 steps are; the estimate's row notes
/// how many of its ids the bf16 summaries' tensor-core selection also picks; and the step's
/// trace, into `traces`.
#[allow(
    clippy::too_many_arguments,
    reason = "one shape's inputs, shared with the bf16 steps"
)]
fn bench_e4m3(
    gpu: &mut Gpu,
    sk: &mut SelectKernels,
    kv: &DevicePagedKv<bf16>,
    (prefill, decode): (&DeviceBatch, &DeviceBatch),
    slots: &CudaSlice<i32>,
    q: &CudaSlice<bf16>,
    out: &mut CudaSlice<f32>,
    (b, ctx): (usize, usize),
    tag: &str,
    bw: f64,
    traces: &mut Vec<String>,
) -> Result<Vec<Row>, AlgoError> {
    let bf16_quest = quest_2k(Summary::Exact)?;
    let quest = quest_2k(Summary::E4m3)?;
    let shape = quest.rep_shape(KV_HEADS, D);
    let mut top = DeviceTopK::new(gpu, &quest, b, KV_HEADS, ctx, false)?;
    // The bf16 summaries' tensor-core ids, to count the E4M3 ones against.
    let reference = {
        let mut pool = DeviceRepPool::<bf16>::new(gpu, shape, 1, b, ctx)?;
        sk.update_minmax(&bf16_quest, kv, prefill, 0, slots, &mut pool)?;
        sk.set_quest_scoring(QuestScoring::TensorCores);
        let ran = sk.quest_topk(&bf16_quest, q, Q_HEADS, decode, 0, slots, &pool, &mut top);
        sk.set_quest_scoring(QuestScoring::Exact);
        ran?;
        gpu.download(&top.sel.ids)?
    };
    let mut pool = DeviceRepPool::<bf16>::with_summary(gpu, shape, 1, b, ctx, Summary::E4m3)?;
    let kv_bytes = (b * ctx * KV_HEADS * D * 2 * 2) as f64;
    let rep_bytes = (b * (ctx / PS) * KV_HEADS * (2 * D + 1)) as f64;
    let mut rows = Vec::new();
    let t = gpu.time(RUNS, || {
        sk.update_minmax(&quest, kv, prefill, 0, slots, &mut pool)
    })?;
    let built = kv_bytes / 2.0 + rep_bytes;
    rows.push(Row {
        name: format!("quest build min/max e4m3 {tag}"),
        t,
        bytes: built,
        note: format!("{:.2} of copy bw", built / t.synced / 1e6 / bw),
    });
    let t = gpu.time(RUNS, || {
        sk.quest_topk(&quest, q, Q_HEADS, decode, 0, slots, &pool, &mut top)
    })?;
    let (same, all) = same_ids(&reference, &gpu.download(&top.sel.ids)?, top.sel.max_len);
    let name = format!("quest estimate+top-k e4m3 {tag}");
    let ids = format!("; ids as bf16 tc: {same} of {all}");
    rows.push(bw_row(name, t, rep_bytes, bw, &ids));
    let params = AttnParams::new(Q_HEADS, D);
    let t = gpu.time(RUNS, || {
        sk.quest_topk(&quest, q, Q_HEADS, decode, 0, slots, &pool, &mut top)?;
        gpu.sparse_page_attention(q, kv, decode, &top.sel, &params, out, None)?;
        Ok::<(), AlgoError>(())
    })?;
    rows.push(Row {
        name: format!("quest+sparse attn 2K e4m3 {tag}"),
        t,
        bytes: rep_bytes + (b * KV_HEADS * 2048 * D * 4) as f64,
        note: "estimate, top-k, attention over the selection".to_owned(),
    });
    let step_tag = format!(" e4m3 {tag}");
    let mut step = steptrace::Step {
        quest: &quest,
        q,
        kv,
        decode,
        slots,
        pool: &pool,
        layer: 0,
        top: &mut top,
        out,
        tag: &step_tag,
    };
    for publish in [false, true] {
        rows.push(bench_graph(gpu, sk, &mut step, publish)?);
    }
    rows.push(bench_published(gpu, sk, &mut step)?);
    traces.extend(steptrace::trace_step(gpu, sk, &mut step)?);
    Ok(rows)
}

/// Quest over pages of 16 with a 2K-token budget and bounds kept as `summary`: the E4M3 step's
/// configuration, and the bf16 one it is counted against.
fn quest_2k(summary: Summary) -> Result<Quest, AlgoError> {
    Quest::new(QuestConfig {
        page_size: PS,
        budget_tokens: 2048,
        summary,
        ..Default::default()
    })
}

/// A row that reads `bytes` in `t`, noted as its fractions of the copy bandwidth `bw` (synced
/// / queued), then `more`.
fn bw_row(name: String, t: Timing, bytes: f64, bw: f64, more: &str) -> Row {
    Row {
        name,
        t,
        bytes,
        note: format!(
            "{:.2} / {:.2} of copy bw{more}",
            bytes / t.synced / 1e6 / bw,
            bytes / t.queued / 1e6 / bw
        ),
    }
}

/// A step's selection and output, which a variant of the step must reproduce bit for bit.
struct Want {
    ids: Vec<i32>,
    out: Vec<f32>,
}

impl Want {
    /// The step's outputs as they stand.
    fn take(gpu: &Gpu, top: &DeviceTopK, out: &CudaSlice<f32>) -> Result<Self, AlgoError> {
        Ok(Want {
            ids: gpu.download(&top.sel.ids)?,
            out: gpu.download(out)?,
        })
    }

    /// Fails, naming `what`, unless the outputs now equal these, bit for bit.
    fn check(
        &self,
        gpu: &Gpu,
        top: &DeviceTopK,
        out: &CudaSlice<f32>,
        what: &str,
    ) -> Result<(), AlgoError> {
        let same_ids = gpu.download(&top.sel.ids)? == self.ids;
        let same_out = self.same_out(gpu, out)?;
        if same_ids && same_out {
            Ok(())
        } else {
            Err(AlgoError::Invalid(format!(
                "{what}: ids equal {same_ids}, outputs equal {same_out}"
            )))
        }
    }

    /// Fails, naming `what`, unless `out` now holds these outputs, bit for bit (the ids are not
    /// compared).
    fn check_out(&self, gpu: &Gpu, out: &CudaSlice<f32>, what: &str) -> Result<(), AlgoError> {
        if self.same_out(gpu, out)? {
            Ok(())
        } else {
            Err(AlgoError::Invalid(format!("{what}: outputs differ")))
        }
    }

    /// Whether `out` now holds these outputs, bit for bit.
    fn same_out(&self, gpu: &Gpu, out: &CudaSlice<f32>) -> Result<bool, AlgoError> {
        let now: Vec<f32> = gpu.download(out)?;
        Ok(now.len() == self.out.len()
            && now
                .iter()
                .zip(&self.out)
                .all(|(a, b)| a.to_bits() == b.to_bits()))
    }
}

/// The tensor-core Quest step with its rows published ([`SelectKernels::set_publish`]) and
/// attention over them as they come; checks that it selects the same pages as the step before
/// it (the serialized one, whose outputs `top` and `out` hold) and attends to the same bits.
fn bench_published(
    gpu: &Gpu,
    sk: &mut SelectKernels,
    s: &mut steptrace::Step<'_>,
) -> Result<Row, AlgoError> {
    let want = Want::take(gpu, s.top, s.out)?;
    sk.set_publish(true);
    let t = gpu.time(RUNS, || s.run(gpu, sk));
    sk.set_publish(false);
    let t = t?;
    if s.top.published().is_none() {
        return Err(AlgoError::Invalid(
            "the publishing top-k published nothing".into(),
        ));
    }
    let tag = s.tag;
    want.check(gpu, s.top, s.out, &format!("the published step{tag}"))?;
    Ok(Row {
        name: format!("quest+sparse attn 2K tc published{tag}"),
        t,
        bytes: 0.0,
        note: "rows selected and attended as scored; ids and outputs as serialized".to_owned(),
    })
}

/// The tensor-core step (estimate, top-k, attention; plain, or with its rows published where
/// `publish`) captured once into a CUDA graph and replayed, as an engine replays its decode
/// steps: how much of the step's time is the host's launch work. Checks that the replays
/// select the same pages and attend to the same bits as the step before it, whose outputs
/// `top` and `out` hold.
fn bench_graph(
    gpu: &Gpu,
    sk: &SelectKernels,
    s: &mut steptrace::Step<'_>,
    publish: bool,
) -> Result<Row, AlgoError> {
    let want = Want::take(gpu, s.top, s.out)?;
    // A stream of its own: the context's default stream cannot be captured.
    let lane = gpu.fork()?;
    let mut sk = sk.on_stream(lane.stream().clone());
    sk.set_publish(publish);
    // Once uncaptured, so that the lane's attention scratch exists before the capture.
    gpu.synchronize()?;
    s.run(&lane, &sk)?;
    lane.synchronize()?;
    let t = untracked(gpu.context(), lane.stream(), || {
        let graph = capture(&lane, || s.run(&lane, &sk))?;
        lane.time(RUNS, || {
            graph
                .launch()
                .map_err(|e| AlgoError::from(AttnError::from(e)))
        })
    })?;
    let tag = s.tag;
    want.check(gpu, s.top, s.out, &format!("the graph's step{tag}"))?;
    let how = if publish { "published" } else { "plain" };
    Ok(Row {
        name: format!(
            "quest+sparse attn 2K tc graph{}{tag}",
            if publish { " published" } else { "" }
        ),
        t,
        bytes: 0.0,
        note: format!(
            "the {how} step captured in a CUDA graph, replayed; ids and outputs as plain"
        ),
    })
}

/// Runs `f`, which enqueues work on `stream` alone, with the context `ctx`'s event tracking off
/// (CUDA graph capture needs it off; eager launches cost the host less without it), and
/// synchronizes `stream` before turning tracking back on. Every other stream of the context
/// must be idle when it is called.
fn untracked<R>(
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    f: impl FnOnce() -> Result<R, AlgoError>,
) -> Result<R, AlgoError> {
    stream.synchronize().map_err(AttnError::from)?;
    let tracking = ctx.is_event_tracking();
    // SAFETY: all work so far is finished (the other streams are idle, this one is
    // synchronized), and the work enqueued while tracking is off runs on `stream` alone, which
    // is synchronized before tracking is turned back on.
    unsafe { ctx.disable_event_tracking() };
    let out = f();
    let synced = stream.synchronize();
    if tracking {
        // SAFETY: all work is finished (synchronized just above).
        unsafe { ctx.enable_event_tracking() };
    }
    synced.map_err(AttnError::from)?;
    out
}

/// What `enqueue` enqueues on `lane`'s stream (steps of `steptrace::Step::run`), captured into
/// a CUDA graph and uploaded. The caller has turned the context's event tracking off, and each
/// step has run on `lane` once uncaptured (so that the lane's attention scratch exists).
fn capture(
    lane: &Gpu,
    enqueue: impl FnOnce() -> Result<(), AlgoError>,
) -> Result<CudaGraph, AlgoError> {
    let stream = lane.stream();
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(AttnError::from)?;
    let enqueued = enqueue();
    let graph = stream
        .end_capture(CUgraphInstantiate_flags(0))
        .map_err(AttnError::from)?;
    enqueued?;
    let graph = graph.ok_or_else(|| AlgoError::Invalid("the capture made no graph".into()))?;
    graph.upload().map_err(AttnError::from)?;
    Ok(graph)
}

/// How many of `got`'s selected ids (rows of `width`, -1 padded, ascending) `want`'s row
/// also holds, and how many `got` holds.
fn same_ids(want: &[i32], got: &[i32], width: usize) -> (usize, usize) {
    let (mut same, mut all) = (0, 0);
    for (w, g) in want.chunks(width.max(1)).zip(got.chunks(width.max(1))) {
        let w: Vec<i32> = w.iter().copied().filter(|&x| x >= 0).collect();
        for x in g.iter().filter(|&&x| x >= 0) {
            all += 1;
            same += usize::from(w.binary_search(x).is_ok());
        }
    }
    (same, all)
}

/// DeepSeek V3.2's indexer shape: 64 heads of 128.
const DSA_HEADS: usize = 64;
const DSA_DIM: usize = 128;

/// StreamingLLM (4 sink + 2044 window tokens) and the DSA indexer (top-2048 tokens), each alone
/// and followed by token-level attention over its selection, for `b` sequences of `ctx` tokens.
#[allow(
    clippy::too_many_arguments,
    reason = "the bench's shared inputs for one shape"
)]
fn bench_token_selections(
    gpu: &Gpu,
    sk: &SelectKernels,
    kv: &DevicePagedKv<bf16>,
    decode: &DeviceBatch,
    q: &CudaSlice<bf16>,
    slots: &CudaSlice<i32>,
    b: usize,
    ctx: usize,
    tag: &str,
) -> Result<Vec<Row>, AlgoError> {
    let params = AttnParams::new(Q_HEADS, D);
    let mut out_attn = gpu.zeros::<f32>(b * Q_HEADS * D)?;
    let mut rows = Vec::new();
    let attn_bytes = (b * KV_HEADS * 2048 * D * 2 * 2) as f64;

    let streaming = StreamingLlm::new(StreamingConfig::default())?;
    let mut top = DeviceTopK::streaming(gpu, &streaming, b, KV_HEADS, false)?;
    let t = gpu.time(RUNS, || sk.streaming_topk(&streaming, decode, &mut top))?;
    rows.push(Row {
        name: format!("streaming-llm rows {tag}"),
        t,
        bytes: 0.0,
        note: "4 sink + 2044 window tokens".to_owned(),
    });
    let t = gpu.time(RUNS, || {
        sk.streaming_topk(&streaming, decode, &mut top)?;
        gpu.token_sparse_attention(q, kv, decode, &top.sel, &params, &mut out_attn, None)?;
        Ok::<(), AlgoError>(())
    })?;
    rows.push(Row {
        name: format!("streaming-llm+token attn {tag}"),
        t,
        bytes: attn_bytes,
        note: "rows, attention over 2048 tokens".to_owned(),
    });

    let ix = TableIndexer {
        heads: DSA_HEADS,
        dim: DSA_DIM,
        keys: Vec::new(),
        q: Vec::new(),
        w: Vec::new(),
    };
    let dsa = Dsa::new(
        DsaConfig {
            topk: 2048,
            always: AlwaysInclude::default(),
        },
        Some(Arc::new(ix)),
    )?;
    let shape = dsa.rep_shape(KV_HEADS, D);
    let mut pool = DeviceRepPool::<bf16>::new(gpu, shape, 1, b, ctx)?;
    let keys = random_bf16(pool.data().len(), 21);
    gpu.stream()
        .memcpy_htod(&keys, pool.data_mut())
        .map_err(AttnError::from)?;
    drop(keys);
    let mut rng = Rng::new(23);
    let iq = gpu.upload(
        &(0..b * DSA_HEADS * DSA_DIM)
            .map(|_| rng.unit())
            .collect::<Vec<_>>(),
    )?;
    let iw = gpu.upload(&(0..b * DSA_HEADS).map(|_| rng.unit()).collect::<Vec<_>>())?;
    let mut top = DeviceTopK::dsa(gpu, &dsa, b, KV_HEADS, ctx, false)?;
    let key_bytes = (b * ctx * DSA_DIM * 2) as f64;
    let flops = (b * ctx * DSA_HEADS * DSA_DIM * 2) as f64;
    let t = gpu.time(RUNS, || {
        sk.dsa_topk(&dsa, &iq, &iw, decode, 0, slots, &pool, &mut top)
    })?;
    rows.push(Row {
        name: format!("dsa indexer+top-2048 {tag}"),
        t,
        bytes: key_bytes,
        note: format!(
            "64x128 heads, {:.1} TFLOP/s (no FMA)",
            flops / t.synced / 1e9
        ),
    });
    let t = gpu.time(RUNS, || {
        sk.dsa_topk(&dsa, &iq, &iw, decode, 0, slots, &pool, &mut top)?;
        gpu.token_sparse_attention(q, kv, decode, &top.sel, &params, &mut out_attn, None)?;
        Ok::<(), AlgoError>(())
    })?;
    rows.push(Row {
        name: format!("dsa+token attn {tag}"),
        t,
        bytes: key_bytes + attn_bytes,
        note: "indexer, top-k, attention over 2048 tokens".to_owned(),
    });
    Ok(rows)
}
