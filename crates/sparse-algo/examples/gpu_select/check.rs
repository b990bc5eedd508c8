//! `gpu_select check`: every device selection against its CPU implementation.

use attn_op::cuda::{CudaElement, DeviceBatch, DevicePagedKv, Gpu};
use attn_op::{AttnError, AttnParams, BatchMeta, Element, KvCache, KvLayout, PagedKv};
use cudarc::driver::CudaSlice;
use half::{bf16, f16};
use sparse_algo::cuda::{DeviceRepPool, DeviceTopK, QuestScoring, SelectKernels};
use sparse_algo::summary;
use sparse_algo::{
    AlgoError, AlwaysInclude, Decode, PagedKeys, Quest, QuestConfig, RepPool, SparseAlgorithm,
    Summary, TopK,
};

use crate::rng::Rng;
use crate::streaming_dsa::{DSA_CASES, STREAMING, check_dsa, check_streaming};

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
        // Shared rows that the page walk attends to (4 query heads a KV head, D 128, pages
        // of 16, decode): a published row's flag serves both its KV heads' rows.
        name: "GQA 8/2 D128, shared, per head, the page walk",
        q_heads: 8,
        kv_heads: 2,
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
pub(crate) const LAYERS: usize = 2;
const POISON: i32 = -777;

pub(crate) fn check(gpu: &Gpu, sk: &mut SelectKernels) -> Result<i32, AlgoError> {
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
pub(crate) fn keys<T: Element>(rng: &mut Rng, n: usize, levels: Option<usize>) -> Vec<T> {
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
pub(crate) fn meta_for(
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
pub(crate) fn poison(gpu: &Gpu, out: &mut DeviceTopK) -> Result<(), AlgoError> {
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
pub(crate) fn compare_rows(
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
