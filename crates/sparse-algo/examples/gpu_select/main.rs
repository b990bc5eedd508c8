//! The GPU half of sparse-algo's checks and benchmarks, for the device bundle (`cargo xtask gpu`).
//!
//! - `gpu_select check`: Quest's device min/max pages (built after a prefill, then maintained
//!   over decode steps) against [`RepPool`] bit for bit, and the device estimate + top-k against
//!   [`Quest::retrieve_topk`](sparse_algo::SparseAlgorithm::retrieve_topk) row for row (per-head
//!   and head-shared, f32/f16/bf16, GQA 1/4/8, sinks and recent tokens, tied scores, a chunked
//!   prefill's last query row), outputs poisoned first; exits 1 on any mismatch.
//! - `gpu_select bench [--json FILE]`: bf16, 32 query / 8 KV heads, D 128, pages of 16, a 2K
//!   budget: min/max construction, the fused estimate + top-k, and estimate + top-k + sparse
//!   attention at B8 L32K and B1 L128K, with our dense decode in the same run.
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

use attn_op::cuda::{CudaElement, DeviceBatch, DevicePagedKv, Gpu};
use attn_op::{AttnError, AttnParams, BatchMeta, Element, KvLayout, PagedKv};
use half::{bf16, f16};
use report::{Row, random_bf16, table};
use rng::Rng;
use sparse_algo::cuda::{DeviceRepPool, DeviceTopK, SelectKernels};
use sparse_algo::{
    AlgoError, AlwaysInclude, Decode, PagedKeys, Quest, QuestConfig, RepPool, SparseAlgorithm,
};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cmd = args.first().map_or("check", String::as_str);
    let code = match run(cmd, &args) {
        Ok(code) => code,
        Err(AlgoError::Attn(AttnError::Device(why))) if why.starts_with("no CUDA") => {
            println!("skipped: no CUDA device ({why})");
            0
        }
        Err(e) => {
            eprintln!("gpu_select {cmd}: {e}");
            1
        }
    };
    std::process::exit(code);
}

fn run(cmd: &str, args: &[String]) -> Result<i32, AlgoError> {
    let gpu = Gpu::new(0)?;
    println!("device: {}", gpu.name()?);
    let sk = SelectKernels::new(&gpu)?;
    match cmd {
        "check" => check(&gpu, &sk),
        "bench" => {
            let json = args
                .iter()
                .position(|a| a == "--json")
                .and_then(|i| args.get(i + 1));
            bench(&gpu, &sk, json.map(String::as_str))?;
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

fn check(gpu: &Gpu, sk: &SelectKernels) -> Result<i32, AlgoError> {
    let mut failed = 0;
    let mut total = 0;
    for (i, case) in CASES.iter().enumerate() {
        for dtype in ["f32", "f16", "bf16"] {
            let seed = 100 + i as u64;
            let outcome = match dtype {
                "f32" => check_case::<f32>(gpu, sk, case, seed),
                "f16" => check_case::<f16>(gpu, sk, case, seed),
                _ => check_case::<bf16>(gpu, sk, case, seed),
            }?;
            for (what, ok) in outcome {
                total += 1;
                if !ok {
                    failed += 1;
                }
                println!(
                    "{} {dtype:<4} {:<44} {what}",
                    if ok { "ok  " } else { "FAIL" },
                    case.name
                );
            }
        }
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

fn check_case<T: CudaElement>(
    gpu: &Gpu,
    sk: &SelectKernels,
    c: &Case,
    seed: u64,
) -> Result<Vec<(String, bool)>, AlgoError> {
    let mut rng = Rng::new(seed);
    let n = c.lens.len();
    let (kvh, d, bs) = (c.kv_heads, c.d, c.bs);
    let max_len = c.lens.iter().copied().max().unwrap_or(0);
    let max_blocks = max_len.div_ceil(bs);
    let layout = KvLayout {
        num_blocks: n * max_blocks + 3,
        block_size: bs,
        kv_heads: kvh,
        head_dim: d,
    };
    let perm = rng.permutation(layout.num_blocks);
    let table: Vec<i32> = (0..n * max_blocks).map(|i| perm[i] as i32).collect();
    let k: Vec<T> = keys(&mut rng, layout.len(), c.levels);
    let cpu_kv = PagedKv::from_tensors(layout, k.clone(), k.clone())?;
    let dev_kv = DevicePagedKv::from_host(gpu, layout, &k, &k)?;
    drop(k);

    let quest = Quest::new(QuestConfig {
        page_size: 16,
        budget_tokens: c.budget_tokens,
        always: AlwaysInclude {
            sink_tokens: c.sink,
            recent_tokens: c.recent,
        },
        shared_heads: c.shared,
    })?;
    let shape = quest.rep_shape(kvh, d);
    let slots: Vec<usize> = (0..n).map(|s| n - 1 - s).collect();
    let dslots = gpu.upload(&slots.iter().map(|&s| s as i32).collect::<Vec<_>>())?;
    let mut cpu_pool = RepPool::new(shape, LAYERS, n, max_len)?;
    let mut dev_pool = DeviceRepPool::<T>::new(gpu, shape, LAYERS, n, max_len)?;
    let layer = 1;

    // Prefill at len - steps, then one decode token at a time, on both sides.
    let mut lens: Vec<usize> = c.lens.iter().map(|&l| l - c.steps.min(l - 1)).collect();
    let cpu_lens = |lens: &[usize]| lens.iter().map(|&l| l as i32).collect::<Vec<_>>();
    let l32 = cpu_lens(&lens);
    let pk = PagedKeys::new(&cpu_kv, &l32, &table, max_blocks)?;
    quest.construct_representations(layer, &pk, &slots, &mut cpu_pool)?;
    let meta = meta_for(gpu, &layout, &lens, &lens, &table, max_blocks)?;
    sk.update_minmax(&quest, &dev_kv, &meta, layer, &dslots, &mut dev_pool)?;
    for _ in 0..c.steps {
        for (l, &fin) in lens.iter_mut().zip(c.lens) {
            *l = (*l + 1).min(fin);
        }
        let l32 = cpu_lens(&lens);
        let pk = PagedKeys::new(&cpu_kv, &l32, &table, max_blocks)?;
        quest.update_representations(layer, &pk, &slots, &mut cpu_pool)?;
        let meta = meta_for(gpu, &layout, &lens, &vec![1; n], &table, max_blocks)?;
        sk.update_minmax(&quest, &dev_kv, &meta, layer, &dslots, &mut dev_pool)?;
    }
    let mut results = Vec::new();

    // The pools, bit for bit over every page the sequences cover.
    let dev = gpu.download(dev_pool.data())?;
    let page_len = shape.page_len();
    let row = max_len.div_ceil(16) * page_len;
    let mut pool_ok = true;
    for (s, &slot) in slots.iter().enumerate() {
        let want = cpu_pool.pages(layer, slot)?;
        let at = (layer * n + slot) * row;
        let got = &dev[at..at + lens[s].div_ceil(16) * page_len];
        pool_ok &= want.len() == got.len()
            && want
                .iter()
                .zip(got)
                .all(|(w, g)| w.to_bits() == g.to_f32().to_bits());
    }
    results.push(("min/max pages equal the CPU pool".to_owned(), pool_ok));

    // The selection: CPU from the f32 values of the same T queries.
    let q_rows = vec![c.q_rows; n];
    let total_q = n * c.q_rows;
    let q: Vec<T> = (0..total_q * c.q_heads * d)
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
    let step = Decode {
        layer,
        q: &last_q,
        q_heads: c.q_heads,
        kv_heads: kvh,
        head_dim: d,
        seq_lens: &lens,
        slots: &slots,
        keys: None,
    };
    let want = quest.retrieve_topk(&step, &cpu_pool)?;
    let meta = meta_for(gpu, &layout, &lens, &q_rows, &table, max_blocks)?;
    let dq = gpu.upload(&q)?;
    let mut out = DeviceTopK::new(gpu, &quest, n, kvh, max_len, c.per_sequence)?;
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
    // Twice: the second launch finds the scratch the first left (zeroed counters and scores).
    for _ in 0..2 {
        sk.quest_topk(
            &quest, &dq, c.q_heads, &meta, layer, &dslots, &dev_pool, &mut out,
        )?;
    }
    let (ids, dlens, covered) = (
        gpu.download(&out.sel.ids)?,
        gpu.download(&out.sel.lens)?,
        gpu.download(&out.covered)?,
    );
    let per_seq = rows / n;
    let mut sel_ok = true;
    let mut cover_ok = true;
    let mut pad_ok = true;
    for r in 0..rows {
        let (s, h) = (r / per_seq, if per_seq == 1 { 0 } else { r % per_seq });
        let w = want.row(s, h);
        let len = dlens[r];
        let got = &ids[r * width..(r + 1) * width];
        sel_ok &= len == w.len() as i32 && &got[..w.len()] == w;
        pad_ok &= got[w.len().min(width)..].iter().all(|&x| x == -1);
        let tokens: usize = w.iter().map(|&p| (lens[s] - p as usize * 16).min(16)).sum();
        cover_ok &= covered[r] == tokens as i32;
    }
    let picked: usize = (0..rows).map(|r| dlens[r].max(0) as usize).sum::<usize>();
    results.push((
        format!("selection rows equal the CPU's ({rows} rows, {picked} pages)"),
        sel_ok,
    ));
    results.push(("rows padded with -1".to_owned(), pad_ok));
    results.push(("covered tokens".to_owned(), cover_ok));
    Ok(results)
}

const Q_HEADS: usize = 32;
const KV_HEADS: usize = 8;
const D: usize = 128;
const PS: usize = 16;
/// Blocks of the shared pool: 512K tokens, 1 GiB of K and V in bf16.
const POOL_BLOCKS: usize = 32 * 1024;
const RUNS: usize = 50;

fn bench(gpu: &Gpu, sk: &SelectKernels, json: Option<&str>) -> Result<(), AlgoError> {
    let mut rows = Vec::new();
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
                always: AlwaysInclude::default(),
                shared_heads: shared,
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
            let t = gpu.time(RUNS, || {
                sk.quest_topk(&quest, &q, Q_HEADS, &decode, 0, &slots, &pool, &mut top)
            })?;
            rows.push(Row {
                name: format!("quest estimate+top-k{mode} {tag}"),
                t,
                bytes: rep_bytes,
                note: format!(
                    "{:.2} / {:.2} of copy bw",
                    rep_bytes / t.synced / 1e6 / bw,
                    rep_bytes / t.queued / 1e6 / bw
                ),
            });
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
            })?;
            rows.push(Row {
                name: format!("quest+sparse attn 2K{mode} {tag}"),
                t,
                bytes: rep_bytes + (b * KV_HEADS * 2048 * D * 4) as f64,
                note: "estimate, top-k, attention over the selection".to_owned(),
            });
        }
        let t = gpu.time(RUNS, || {
            gpu.paged_attention(&q, &kv, &decode, &params, &mut out_attn, None)
        })?;
        rows.push(Row {
            name: format!("ours dense decode {tag}"),
            t,
            bytes: kv_bytes,
            note: format!("{:.2} of copy bw", kv_bytes / t.synced / 1e6 / bw),
        });
    }

    print!("{}", table(&rows));
    if let Some(path) = json {
        let body = report::json(&gpu.name()?, &rows);
        std::fs::write(path, body).map_err(|e| AlgoError::Invalid(format!("{path}: {e}")))?;
    }
    Ok(())
}
