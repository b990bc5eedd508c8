//! `gpu_step bench`: each stage of the full step timed, and the pipelined schedule against the
//! serial one.

use attn_op::cuda::Gpu;
use cudarc::driver::sys::CUevent_flags;
use sparse_algo::Summary;

use crate::pipeline::{PIPE_LAYERS, bench_pipeline};
use crate::rng::Rng;
use crate::{Cache, Kernels, Res, Shape, Step, drift, err, to_bf16};

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

pub(crate) fn bench(gpu: &Gpu, k: &Kernels, json: Option<&str>) -> Res<()> {
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
