//! The E4M3 Quest step as an engine meets it: a decode runs one step a layer, and each layer's
//! step reads its own summaries and its own pages. The bench's other step rows repeat one
//! layer's step, so at B1 L128K the 24 MiB it reads (16 MiB of summaries, 8 MiB of pages) can
//! stay in the device's 50 MiB L2 from one run to the next. Here the steps rotate over
//! [`COLD_LAYERS`] layers, each with its own pool layer and its own block table (a fresh
//! permutation of the KV pool's blocks), so that between two steps of one layer the others read
//! seven times as many bytes, and L2 holds none of them.

use attn_op::cuda::{DeviceBatch, DevicePagedKv, Gpu, Timing};
use attn_op::{AttnError, AttnParams, KvLayout};
use cudarc::driver::sys::CUgraphInstantiate_flags;
use cudarc::driver::{CudaGraph, CudaSlice};
use half::bf16;
use sparse_algo::cuda::{DeviceRepPool, DeviceTopK, SelectKernels};
use sparse_algo::{AlgoError, Quest, SparseAlgorithm, Summary};

use super::bench::{
    D, KV_HEADS, POOL_BLOCKS, PS, Q_HEADS, RUNS, Want, capture, quest_2k, untracked,
};
use super::check::meta_for;
use super::report::Row;
use super::rng::Rng;
use super::steptrace::{self, Step};

/// The layers a rotation runs over.
pub(crate) const COLD_LAYERS: usize = 8;

/// One shape's inputs: the KV pool (every layer's pages are blocks of it), its layout, the
/// queries, the sequences' pool slots, the attention's output, `b` sequences of `ctx` tokens,
/// and the shape's tag.
pub(crate) struct Shape<'a> {
    pub kv: &'a DevicePagedKv<bf16>,
    pub layout: &'a KvLayout,
    pub q: &'a CudaSlice<bf16>,
    pub slots: &'a CudaSlice<i32>,
    pub b: usize,
    pub ctx: usize,
    pub tag: &'a str,
}

/// How [`bench_cold`] runs the step.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ColdRun {
    /// The top-k leaves its rows unpublished, and the attention waits for its whole launch
    /// (by default both the page walk and the tensor-core kernel wait for their rows' flags).
    pub unpublished: bool,
    /// The step on a stream of the device's highest priority, its graphs keeping that
    /// priority per node (as `gpu_select spec` runs its walks).
    pub high: bool,
}

/// Times the E4M3 Quest step ([`quest_2k`]), published and replayed from CUDA graphs, on one layer
/// over and over, rotating over [`COLD_LAYERS`] layers (a graph each), and every layer's step in
/// one graph, in one call, and checks that each graph selects and attends as the serialized
/// eager steps do. Answers the three rows, and pushes onto `traces` the trace of a step behind
/// the other layers' steps.
pub(crate) fn bench_cold(
    gpu: &mut Gpu,
    sk: &mut SelectKernels,
    sh: &Shape<'_>,
    l: &Layers,
    out: &mut CudaSlice<f32>,
    traces: &mut Vec<String>,
    run: ColdRun,
) -> Result<Vec<Row>, AlgoError> {
    let (quest, decodes) = (&l.quest, &l.decodes);
    let mut top = DeviceTopK::new(gpu, quest, sh.b, KV_HEADS, sh.ctx, false)?;
    let walks = gpu.page_walk_fits(sh.kv, &decodes[0], &top.sel, &AttnParams::new(Q_HEADS, D));
    let publish = !run.unpublished;
    let attention = if walks {
        "; attention: the page walk"
    } else {
        "; attention: the tensor-core kernel"
    };
    // The one graph's attention outputs, a buffer a layer, so that every layer's is checked.
    let mut outs = (0..COLD_LAYERS)
        .map(|_| gpu.zeros::<f32>(out.len()))
        .collect::<Result<Vec<_>, _>>()?;
    let step_tag = format!(" e4m3 {}", sh.tag);
    let mut step = l.step(sh, &mut top, out, &step_tag);
    // What each layer's graph must reproduce: its step serialized, eager.
    sk.set_publish(false);
    let wants = wants(gpu, sk, &mut step, decodes)?;
    // A stream of its own: the context's default stream cannot be captured.
    let lane = if run.high {
        gpu.fork_with_priority(true)?
    } else {
        gpu.fork()?
    };
    let flags = if run.high {
        CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY
    } else {
        CUgraphInstantiate_flags(0)
    };
    let mut lane_sk = sk.on_stream(lane.stream().clone());
    lane_sk.set_publish(publish);
    // Each layer once uncaptured, so that the lane's attention scratch exists.
    gpu.synchronize()?;
    for (layer, decode) in decodes.iter().enumerate() {
        step.set_layer(layer, decode);
        step.run(&lane, &lane_sk)?;
    }
    lane.synchronize()?;
    let (graphs, whole, one, rotating, all) = untracked(gpu.context(), lane.stream(), || {
        let mut graphs = Vec::with_capacity(COLD_LAYERS);
        for (layer, decode) in decodes.iter().enumerate() {
            step.set_layer(layer, decode);
            graphs.push(capture(&lane, flags, || step.run(&lane, &lane_sk))?);
        }
        // Every layer's step in one graph, as an engine captures a whole decode step: each
        // scoring launch depends programmatically on the attention before it, as in the
        // eager steps, instead of waiting for a graph launch. Each layer attends into its own
        // output; the rows go to the one top-k, as the steps before use it.
        let whole = capture(&lane, flags, || {
            for ((layer, decode), out) in decodes.iter().enumerate().zip(&mut outs) {
                step.for_layer(layer, decode, out).run(&lane, &lane_sk)?;
            }
            Ok(())
        })?;
        let launch = |g: &CudaGraph| g.launch().map_err(|e| AlgoError::from(AttnError::from(e)));
        let one = lane.time(RUNS, || launch(&graphs[0]))?;
        let mut next = 0;
        let rotating = lane.time(RUNS, || {
            let g = &graphs[next % COLD_LAYERS];
            next += 1;
            launch(g)
        })?;
        let all = lane.time(RUNS, || launch(&whole))?;
        Ok((graphs, whole, one, rotating, all))
    })?;
    for (layer, (graph, want)) in graphs.iter().zip(&wants).enumerate() {
        graph.launch().map_err(AttnError::from)?;
        lane.synchronize()?;
        let what = format!("the graph of layer {layer}'s step{step_tag}");
        want.check(gpu, step.top, step.out, &what)?;
    }
    // The one graph leaves every layer's output, and the last layer's ids, behind.
    whole.launch().map_err(AttnError::from)?;
    lane.synchronize()?;
    for (layer, (out, want)) in outs.iter().zip(&wants).enumerate() {
        let what = format!("layer {layer}'s step in the one graph{step_tag}");
        want.check_out(gpu, out, &what)?;
    }
    let what = format!("the last layer's ids in the one graph{step_tag}");
    wants[COLD_LAYERS - 1].check(gpu, step.top, &outs[COLD_LAYERS - 1], &what)?;
    drop((graphs, whole));
    // A published step behind the other layers' steps, traced, with event tracking off while
    // they are enqueued: with it, each eager launch costs the host more than the device takes
    // to run it, and the traced step would wait for its own launches.
    sk.set_publish(true);
    gpu.synchronize()?;
    sk.take_trace()?;
    gpu.take_attn_trace()?;
    let (context, stream) = (gpu.context().clone(), gpu.stream().clone());
    let traced = untracked(&context, &stream, || {
        for layer in (1..COLD_LAYERS).rev() {
            step.set_layer(layer, &decodes[layer]);
            step.run(gpu, sk)?;
        }
        step.set_layer(0, &decodes[0]);
        let name = format!(
            "e4m3 {} published, behind {} other layers' steps",
            sh.tag,
            COLD_LAYERS - 1
        );
        steptrace::trace_next(gpu, sk, &mut step, &name)
    });
    sk.set_publish(false);
    traces.push(traced?);
    let row = |t: Timing, layers: String, note: &str| Row {
        name: format!(
            "quest+sparse attn 2K tc graph{} e4m3 {layers} {}{}",
            if publish { " published" } else { "" },
            sh.tag,
            if run.high { " (high priority)" } else { "" }
        ),
        t,
        bytes: 0.0,
        note: format!("{note}{attention}"),
    };
    Ok(vec![
        row(
            one,
            format!("1 of {COLD_LAYERS} layers"),
            "layer 0's step over and over (its bytes may stay in L2)",
        ),
        row(
            rotating,
            format!("{COLD_LAYERS} layers"),
            "the layers' steps in turn, as a decode runs them (none of a step's bytes in L2)",
        ),
        row(
            Timing {
                synced: all.synced / COLD_LAYERS as f64,
                queued: all.queued / COLD_LAYERS as f64,
            },
            format!("{COLD_LAYERS} layers one graph"),
            "the same steps captured in one graph, as an engine captures a decode; per step",
        ),
    ])
}

/// Every layer's E4M3 Quest step inputs at one shape: the algorithm, its min/max pool (a
/// pool layer each, built from a prefill of the whole context), and each layer's decode
/// metadata and block table (a fresh permutation of the KV pool's blocks).
pub(crate) struct Layers {
    pub quest: Quest,
    pub pool: DeviceRepPool<bf16>,
    pub decodes: Vec<DeviceBatch>,
    pub tables: Vec<Vec<i32>>,
}

impl Layers {
    /// The [`COLD_LAYERS`] layers of `sh`, their tables drawn from `rng`.
    pub(crate) fn new(
        gpu: &Gpu,
        sk: &SelectKernels,
        sh: &Shape<'_>,
        rng: &mut Rng,
    ) -> Result<Self, AlgoError> {
        let quest = quest_2k(Summary::E4m3)?;
        let (b, ctx) = (sh.b, sh.ctx);
        let blocks = ctx / PS;
        let lens = vec![ctx; b];
        let shape = quest.rep_shape(KV_HEADS, D);
        let mut pool =
            DeviceRepPool::<bf16>::with_summary(gpu, shape, COLD_LAYERS, b, ctx, Summary::E4m3)?;
        let mut decodes: Vec<DeviceBatch> = Vec::with_capacity(COLD_LAYERS);
        let mut tables = Vec::with_capacity(COLD_LAYERS);
        for layer in 0..COLD_LAYERS {
            let perm = rng.permutation(POOL_BLOCKS);
            let table: Vec<i32> = perm[..b * blocks].iter().map(|&p| p as i32).collect();
            let prefill = meta_for(gpu, sh.layout, &lens, &lens, &table, blocks)?;
            sk.update_minmax(&quest, sh.kv, &prefill, layer, sh.slots, &mut pool)?;
            decodes.push(meta_for(
                gpu,
                sh.layout,
                &lens,
                &vec![1; b],
                &table,
                blocks,
            )?);
            tables.push(table);
        }
        Ok(Layers {
            quest,
            pool,
            decodes,
            tables,
        })
    }

    /// Layer 0's step at `sh`, selecting into `top` and attending into `out`.
    pub(crate) fn step<'a>(
        &'a self,
        sh: &Shape<'a>,
        top: &'a mut DeviceTopK,
        out: &'a mut CudaSlice<f32>,
        tag: &'a str,
    ) -> Step<'a> {
        Step {
            quest: &self.quest,
            q: sh.q,
            kv: sh.kv,
            decode: &self.decodes[0],
            slots: sh.slots,
            pool: &self.pool,
            layer: 0,
            top,
            out,
            tag,
        }
    }
}

/// What each layer's step must reproduce: its step serialized and eager (`sk` not publishing).
pub(crate) fn wants<'a>(
    gpu: &Gpu,
    sk: &SelectKernels,
    step: &mut Step<'a>,
    decodes: &'a [DeviceBatch],
) -> Result<Vec<Want>, AlgoError> {
    let mut wants = Vec::with_capacity(decodes.len());
    for (layer, decode) in decodes.iter().enumerate() {
        step.set_layer(layer, decode);
        step.run(gpu, sk)?;
        wants.push(Want::take(gpu, step.top, step.out)?);
    }
    Ok(wants)
}
