//! `gpu_select bench`: the selections' and the step's timings, with the dense decode and the
//! traces in the same run.

use std::sync::Arc;

use attn_op::cuda::{DeviceBatch, DevicePagedKv, Gpu, Timing};
use attn_op::{AttnError, AttnParams, KvLayout};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaContext, CudaGraph, CudaSlice, CudaStream};
use half::bf16;
use sparse_algo::cuda::{DeviceRepPool, DeviceTopK, QuestScoring, SelectKernels};
use sparse_algo::{
    AlgoError, AlwaysInclude, Dsa, DsaConfig, Quest, QuestConfig, SparseAlgorithm, StreamingConfig,
    StreamingLlm, Summary,
};

use crate::check::meta_for;
use crate::report::{self, Row, random_bf16, table};
use crate::rng::Rng;
use crate::streaming_dsa::TableIndexer;
use crate::{cold, steptrace};

pub(crate) const Q_HEADS: usize = 32;
pub(crate) const KV_HEADS: usize = 8;
pub(crate) const D: usize = 128;
pub(crate) const PS: usize = 16;
/// Blocks of the shared pool: 512K tokens, 1 GiB of K and V in bf16.
pub(crate) const POOL_BLOCKS: usize = 32 * 1024;
pub(crate) const RUNS: usize = 50;

pub(crate) fn bench(
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

    let (layout, kv, k) = kv_pool(gpu)?;
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
        let layers = cold::Layers::new(gpu, sk, &shape, &mut cold_rng)?;
        rows.extend(cold::bench_cold(
            gpu,
            sk,
            &shape,
            &layers,
            &mut out_attn,
            &mut traces,
            cold::ColdRun::default(),
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
/// The benches' KV pool ([`POOL_BLOCKS`] blocks of pages of [`PS`], random bf16, K and V
/// alike): its layout, the device pool and the host's copy of K.
pub(crate) fn kv_pool(gpu: &Gpu) -> Result<(KvLayout, DevicePagedKv<bf16>, Vec<bf16>), AlgoError> {
    let layout = KvLayout {
        num_blocks: POOL_BLOCKS,
        block_size: PS,
        kv_heads: KV_HEADS,
        head_dim: D,
    };
    let k = random_bf16(layout.len(), 1);
    let kv = DevicePagedKv::from_host(gpu, layout, &k, &k)?;
    Ok((layout, kv, k))
}

pub(crate) fn quest_2k(summary: Summary) -> Result<Quest, AlgoError> {
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
pub(crate) struct Want {
    pub(crate) ids: Vec<i32>,
    pub(crate) out: Vec<f32>,
}

impl Want {
    /// The step's outputs as they stand.
    pub(crate) fn take(
        gpu: &Gpu,
        top: &DeviceTopK,
        out: &CudaSlice<f32>,
    ) -> Result<Self, AlgoError> {
        Ok(Want {
            ids: gpu.download(&top.sel.ids)?,
            out: gpu.download(out)?,
        })
    }

    /// Fails, naming `what`, unless the outputs now equal these, bit for bit.
    pub(crate) fn check(
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
    pub(crate) fn check_out(
        &self,
        gpu: &Gpu,
        out: &CudaSlice<f32>,
        what: &str,
    ) -> Result<(), AlgoError> {
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
        let graph = capture(&lane, CUgraphInstantiate_flags(0), || s.run(&lane, &sk))?;
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
pub(crate) fn untracked<R>(
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
pub(crate) fn capture(
    lane: &Gpu,
    flags: CUgraphInstantiate_flags,
    enqueue: impl FnOnce() -> Result<(), AlgoError>,
) -> Result<CudaGraph, AlgoError> {
    let stream = lane.stream();
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(AttnError::from)?;
    let enqueued = enqueue();
    let graph = stream.end_capture(flags).map_err(AttnError::from)?;
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
