//! `gpu_engine bench`: capacity and decode throughput of a synthetic Llama-3-8B-class model
//! (32 layers, 32 query / 8 KV heads of 128, random bf16 weights made on the device), dense
//! against hierarchical sparse, at 32K and 128K tokens of context per request.
//!
//! The context is synthetic too: dense requests' KV cache is filled with random values on the
//! device, sparse requests' prompts (random keys and values, see [`Context`]) go through the
//! coordinator's CPU prefill hooks into its host pool, which builds their Quest pages. Every
//! decode step is then a real forward of the whole model (greedy, the next token the model's
//! own) with attention dense over the device cache or through the coordinator's device hooks
//! (module `sparse`). Sparse: every layer sparse, head-shared Quest scored on tensor cores
//! (`QuestScoring::TensorCores`), pages of 16, a 2048-token budget (16 sink and 64 recent
//! tokens always in), a hot buffer of 4096 tokens.
//!
//! Device bytes per request are measured (dense: its blocks of every layer; sparse: the
//! device mirror's representations and hot buffers over its requests); the largest batch each
//! fits is the device's free memory after the weights, less a reserve, over those bytes.
//! Sparse requests also hold their whole KV cache in host memory, which bounds their batch on
//! the lent machine: the largest sparse batch run is the smaller of the device's and the
//! host's (available memory less a margin, over a request's host bytes).

use std::time::Instant;

use attn_op::BatchMeta;
use engine::gpu::{GpuDenseAttention, GpuModel};
use engine::synthetic::LLAMA3_8B;
use half::bf16;

use crate::Res;
use crate::lanes::{self, Meet};
use crate::report;
use crate::sparse::{self, Context};

/// Decode steps timed, after the warm-up steps.
pub(crate) const STEPS: usize = 16;
pub(crate) const WARM: usize = 4;
/// Tokens per block (dense) and per Quest page (sparse).
pub(crate) const PAGE: usize = 16;
/// Device memory kept free of KV for the forward's buffers, cuBLAS and the allocator.
const RESERVE: usize = 4 << 30;
/// Host memory kept free of sparse requests.
const HOST_MARGIN: usize = 16 << 30;
const GIB: f64 = (1u64 << 30) as f64;

/// One measured configuration.
pub(crate) struct Row {
    pub(crate) context: usize,
    pub(crate) mode: &'static str,
    /// The synthetic prompts' keys (sparse; see [`Context`]).
    pub(crate) keys: &'static str,
    pub(crate) batch: usize,
    /// Lanes the batch was split over (module `lanes`): 1, or [`lanes::LANES`].
    pub(crate) lanes: usize,
    /// Device bytes per request (KV, or representations and hot buffers).
    pub(crate) device: usize,
    /// Host bytes per request (the sparse requests' host KV and CPU-side state).
    pub(crate) host: usize,
    /// Largest batch the device memory left after the weights holds.
    pub(crate) device_max: usize,
    pub(crate) step_ms: f64,
    /// Fraction of the selected pages that missed the hot buffer (sparse).
    pub(crate) miss: Option<f64>,
    /// With prefetch (sparse), the pages loaded early per step (every layer's).
    pub(crate) early: Option<f64>,
    /// Device milliseconds per step by stage (sparse, profiled steps).
    pub(crate) stages: Vec<(&'static str, f64)>,
}

pub(crate) fn bench(args: &[String]) -> Res<i32> {
    let with_lanes = args.iter().any(|a| a == "--lanes");
    let gpu = engine::gpu::open_gpu(0).map_err(|e| e.to_string())?;
    let name = gpu.name().map_err(|e| e.to_string())?;
    let s = |e: engine::EngineError| e.to_string();
    let t0 = Instant::now();
    let gm = GpuModel::<bf16>::synthetic(LLAMA3_8B, gpu, 8).map_err(s)?;
    gm.gpu().synchronize().map_err(|e| e.to_string())?;
    println!(
        "synthetic Llama-3-8B-class model on {name}: {:.2} GiB of bf16 weights made in {:.1} s",
        gm.weight_bytes() as f64 / GIB,
        t0.elapsed().as_secs_f64()
    );
    let mut rows = Vec::new();
    for (context, equal) in [(32 * 1024, 16), (128 * 1024, 4)] {
        let (free, _) = gm
            .gpu()
            .context()
            .mem_get_info()
            .map_err(|e| format!("{e:?}"))?;
        let room = free.saturating_sub(RESERVE);
        let per = dense_bytes(&gm, context);
        let device_max = room / per;
        let mut batches = vec![equal.min(device_max)];
        if device_max > equal {
            batches.push(device_max);
        }
        let batches: Vec<usize> = batches.into_iter().filter(|&b| b > 0).collect();
        let row = |batch, lanes, step_ms| Row {
            context,
            mode: "dense",
            keys: "-",
            batch,
            lanes,
            device: per,
            host: 0,
            device_max,
            step_ms,
            miss: None,
            early: None,
            stages: Vec::new(),
        };
        for &batch in &batches {
            let (ms, _) = dense(&gm, context, batch, None)?;
            println!("dense  {context:>6} tokens, batch {batch:>3}: {ms:.2} ms per step");
            rows.push(row(batch, 1, ms));
        }
        for &batch in batches.iter().filter(|&&b| with_lanes && b >= lanes::LANES) {
            let each = lanes::run(&gm, |lane, lm, meet| {
                dense(lm, context, lanes::share(batch, lane), Some(meet))
            })?;
            let ms = each.iter().map(|t| t.1).fold(0.0, f64::max);
            println!(
                "dense  {context:>6} tokens, batch {batch:>3} over {} lanes: {ms:.2} ms per step",
                lanes::LANES
            );
            rows.push(row(batch, lanes::LANES, ms));
        }
        rows.extend(sparse::runs(
            &gm,
            context,
            Context::Random,
            &[equal],
            room,
            false,
        )?);
        // Four runs of decode steps: at the equal batch and at the largest, each without and
        // with prefetch.
        let per_host = sparse::host_bytes(&gm, context, 4);
        let host_max = available_host()?.saturating_sub(HOST_MARGIN) / per_host;
        println!(
            "sparse {context:>6} tokens: {host_max} requests fit the host ({:.2} GiB each)",
            per_host as f64 / GIB
        );
        let mut heavy = vec![equal.min(host_max)];
        if host_max > equal {
            heavy.push(host_max);
        }
        rows.extend(sparse::runs(
            &gm,
            context,
            Context::Heavy,
            &heavy,
            room,
            true,
        )?);
        if with_lanes {
            heavy.retain(|&b| b >= lanes::LANES);
            rows.extend(sparse::lane_runs(
                &gm,
                context,
                Context::Heavy,
                &heavy,
                room,
            )?);
        }
    }
    let table = table(&name, &rows);
    print!("{table}");
    if let Some(path) = report::json_arg(args) {
        let items: Vec<String> = rows
            .iter()
            .map(|r| {
                format!(
                    "{{\"context\":{},\"mode\":{:?},\"keys\":{:?},\"batch\":{},\"lanes\":{},\"device_bytes\":{},\"host_bytes\":{},\"device_max\":{},\"step_ms\":{},\"tokens_per_s\":{},\"miss_rate\":{},\"early_pages\":{},\"stages\":[{}]}}",
                    r.context,
                    r.mode,
                    r.keys,
                    r.batch,
                    r.lanes,
                    r.device,
                    r.host,
                    r.device_max,
                    r.step_ms,
                    r.batch as f64 / r.step_ms * 1e3,
                    r.miss.map_or("null".to_owned(), |m| m.to_string()),
                    r.early.map_or("null".to_owned(), |p| p.to_string()),
                    r.stages
                        .iter()
                        .map(|(l, t)| format!("{{\"stage\":{l:?},\"ms\":{t}}}"))
                        .collect::<Vec<_>>()
                        .join(",")
                )
            })
            .collect();
        let json = format!(
            "{{\"device\":{name:?},\"weight_bytes\":{},\"rows\":[{}]}}\n",
            gm.weight_bytes(),
            items.join(",")
        );
        std::fs::write(path, json).map_err(|e| format!("{path}: {e}"))?;
    }
    Ok(0)
}

/// The table of the runs: per context, dense and sparse side by side, then the sparse
/// runs' device time by stage.
fn table(device: &str, rows: &[Row]) -> String {
    let mut out = format!(
        "synthetic 8B-class decode on {device} (weights and KV bf16; median of {STEPS} steps \
         after {WARM}; lanes > 1: the slowest lane's mean step)\n{:>7} {:>6} {:>6} {:>5} {:>5} {:>14} {:>12} {:>10} {:>9} {:>10} {:>8} {:>6} {:>10}\n",
        "context",
        "mode",
        "keys",
        "batch",
        "lanes",
        "device/req MiB",
        "host/req GiB",
        "device max",
        "ms/step",
        "tokens/s",
        "vs dense",
        "miss",
        "early/step"
    );
    let tps = |r: &Row| r.batch as f64 / r.step_ms * 1e3;
    for r in rows {
        // Against dense at the same batch, in whichever of its lane counts was faster.
        let dense = rows
            .iter()
            .filter(|d| d.mode == "dense" && d.context == r.context && d.batch == r.batch)
            .max_by(|a, b| tps(a).total_cmp(&tps(b)));
        out += &format!(
            "{:>7} {:>6} {:>6} {:>5} {:>5} {:>14.1} {:>12.2} {:>10} {:>9.2} {:>10.1} {:>8} {:>6} {:>10}\n",
            r.context,
            r.mode,
            r.keys,
            r.batch,
            r.lanes,
            r.device as f64 / f64::from(1u32 << 20),
            r.host as f64 / GIB,
            r.device_max,
            r.step_ms,
            tps(r),
            dense.map_or("-".to_owned(), |d| format!("{:.2}x", tps(r) / tps(d))),
            r.miss.map_or("-".to_owned(), |m| format!("{m:.3}")),
            r.early.map_or("-".to_owned(), |p| format!("{p:.0}"))
        );
    }
    for &context in &[32 * 1024, 128 * 1024] {
        let d = rows
            .iter()
            .find(|r| r.context == context && r.mode == "dense");
        let sp = rows
            .iter()
            .find(|r| r.context == context && r.mode == "sparse");
        if let (Some(d), Some(sp)) = (d, sp) {
            out += &format!(
                "{context}: device bytes per request dense/sparse {:.1}x\n",
                d.device as f64 / sp.device.max(1) as f64
            );
        }
        // Each mode at its best: whichever batch (up to its maximum) and lane count was fastest.
        let best = |mode: &str| {
            rows.iter()
                .filter(|r| r.context == context && r.mode == mode)
                .max_by(|a, b| tps(a).total_cmp(&tps(b)))
        };
        if let (Some(d), Some(sp)) = (best("dense"), best("sparse")) {
            out += &format!(
                "{context}: best tokens/s dense {:.1} (B{}, {} lanes), sparse {:.1} (B{}, {} \
                 lanes): {:.2}x\n",
                tps(d),
                d.batch,
                d.lanes,
                tps(sp),
                sp.batch,
                sp.lanes,
                tps(sp) / tps(d)
            );
        }
    }
    out += "sparse decode step by stage, device ms per step (share of the sum):\n";
    for r in rows.iter().filter(|r| !r.stages.is_empty()) {
        let sum: f64 = r.stages.iter().map(|s| s.1).sum();
        let parts: Vec<String> = r
            .stages
            .iter()
            .map(|(l, t)| format!("{l} {t:.2} ({:.0} %)", 100.0 * t / sum.max(1e-9)))
            .collect();
        out += &format!(
            "  {} {} keys batch {}{}: {sum:.2} ms = {}\n",
            r.context,
            r.keys,
            r.batch,
            if r.early.is_some() { ", prefetch" } else { "" },
            parts.join(", ")
        );
    }
    out
}

/// Device bytes of one dense request's KV at `context` tokens (and the steps decoded).
fn dense_bytes(gm: &GpuModel<bf16>, context: usize) -> usize {
    let c = gm.config;
    (context + WARM + STEPS).div_ceil(PAGE) * PAGE * c.kv_bytes_per_token(size_of::<bf16>())
}

/// Steps of `batch` requests decoding at `context` tokens over a random dense cache: the
/// median step and the mean over the timed steps, in ms. In a lane, `meet` starts the timed
/// steps with the other lanes'.
fn dense(
    gm: &GpuModel<bf16>,
    context: usize,
    batch: usize,
    meet: Option<&Meet>,
) -> Res<(f64, f64)> {
    let s = |e: engine::EngineError| e.to_string();
    let c = gm.config;
    let per = (context + WARM + STEPS).div_ceil(PAGE);
    let mut kv = GpuDenseAttention::<bf16>::cache(gm.gpu(), &c, batch * per, PAGE).map_err(s)?;
    for (l, layer) in kv.iter_mut().enumerate() {
        let (k, v) = layer.tensors_mut();
        gm.fill_uniform(k, 2 * l as u64 + 100, 1.0).map_err(s)?;
        gm.fill_uniform(v, 2 * l as u64 + 101, 1.0).map_err(s)?;
    }
    let table: Vec<i32> = (0..batch * per).map(|b| b as i32).collect();
    let cu: Vec<i32> = (0..=batch).map(|i| i as i32).collect();
    let all: Vec<usize> = (0..batch).collect();
    let mut tokens: Vec<u32> = (0..batch).map(|i| (i * 7919 % c.vocab) as u32).collect();
    let mut times = Vec::new();
    let mut window = Instant::now();
    for step in 0..WARM + STEPS {
        if step == WARM {
            if let Some(m) = meet {
                m.wait()?;
            }
            window = Instant::now();
        }
        let pos = context + step;
        let lens = vec![(pos + 1) as i32; batch];
        let slots: Vec<i32> = (0..batch).map(|r| (r * per * PAGE + pos) as i32).collect();
        let meta = BatchMeta {
            cu_seqlens_q: &cu,
            seq_lens_kv: &lens,
            block_table: &table,
            max_blocks: per,
        };
        let t = Instant::now();
        let mut att = GpuDenseAttention::new(gm.gpu(), &c, kv, &meta, &slots).map_err(s)?;
        tokens = gm
            .forward_greedy(&tokens, &vec![pos; batch], &mut att, &all)
            .map_err(s)?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
        kv = att.kv;
    }
    let mean = window.elapsed().as_secs_f64() * 1e3 / STEPS as f64;
    Ok((median(&mut times[WARM..]), mean))
}

/// The host's available memory (`MemAvailable` of /proc/meminfo), in bytes.
fn available_host() -> Res<usize> {
    sparse::proc_bytes("/proc/meminfo", "MemAvailable:")
        .ok_or_else(|| "no MemAvailable in /proc/meminfo".to_owned())
}

pub(crate) fn median(x: &mut [f64]) -> f64 {
    x.sort_by(f64::total_cmp);
    x.get(x.len() / 2).copied().unwrap_or(f64::NAN)
}
