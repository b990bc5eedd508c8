//! Two micro-batches, each one's loads on a copy stream under the other's compute: the
//! schedule, its check against the serial one, and its bench.

use std::rc::Rc;
use std::sync::Arc;

use attn_op::cuda::Gpu;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream};
use half::bf16;
use offload::cuda::IoKernels;
use sparse_algo::Summary;

use crate::rng::Rng;
use crate::{Cache, Kernels, Res, Shape, Step, drift, drv, err, to_bf16};

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
pub(crate) fn check_pipeline(gpu: &Gpu, k: &Kernels) -> Res<usize> {
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
pub(crate) const PIPE_LAYERS: usize = 4;

/// Serial against pipelined, B8 L32K as two micro-batches of B4 over `PIPE_LAYERS` layers:
/// CUDA events around each schedule's whole step (every layer), alternating the two
/// schedules step by step so both see the same drift; medians per layer.
pub(crate) fn bench_pipeline(gpu: &Gpu, k: &Kernels, full: Shape) -> Res<(f64, f64, f64)> {
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
