//! `gpu_engine bench`, the sparse half: requests prefilled into the coordinator's host pool,
//! then decoded through its device hooks, timed, and profiled by stage.

use std::time::Instant;

use attn_op::AttnParams;
use attn_op::cuda::StageClock;
use coordinator::cuda::DeviceSparse;
use coordinator::{Capacity, SparseConfig, SparseCoordinator};
use engine::gpu::GpuModel;
use engine::gpu_sparse::GpuSparseAttention;
use half::bf16;
use kv_blocks::RequestId;
use offload::{HostAlloc, HostLayout};
use sparse_algo::{AlgoConfig, AlwaysInclude, QuestConfig};

use crate::Res;
use crate::report::random_bf16;
use crate::synth::{PAGE, Row, STEPS, WARM, median};

/// Quest's token budget, sink and recent tokens, and the hot buffer, in tokens.
const BUDGET: usize = 2048;
const SINK: u32 = 16;
const RECENT: u32 = 64;
const HOT: usize = 4096;
/// Heavy pages of the heavy-hitter context: 7/8 of the pages the budget selects by score.
const HEAVY: usize = (BUDGET - (SINK + RECENT) as usize) / PAGE * 7 / 8;
/// How much larger the heavy pages' keys are than the others'.
const HEAVY_SCALE: f32 = 2.0;
/// Decode steps profiled by stage, after the timed ones.
const PROFILED: usize = 4;

/// What the synthetic prompts' keys look like.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Context {
    /// Uniform random keys: every page is as likely as another, so the selection follows
    /// each step's query and most of it misses the hot buffer (no locality).
    Random,
    /// Uniform random keys, but [`HEAVY`] pages spread over the prompt have keys
    /// [`HEAVY_SCALE`] times larger, so every query scores them highest: heavy hitters that
    /// persist from step to step, as attention to some tokens does in real models. The rest
    /// of the budget still follows the query.
    Heavy,
}

impl Context {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Context::Random => "random",
            Context::Heavy => "heavy",
        }
    }
}

/// Host bytes a sparse request of `context` tokens holds for `runs` runs of decode steps:
/// its KV in the host pool (bf16), its Quest pages on the CPU (f32 min and max), and the CPU
/// offload manager's hot-buffer pool, which the device path leaves unused.
pub(crate) fn host_bytes(gm: &GpuModel<bf16>, context: usize, runs: usize) -> usize {
    let c = gm.config;
    let pages = (context + runs * (WARM + STEPS + PROFILED)).div_ceil(PAGE);
    let kvs = c.kv_heads * c.head_dim;
    let page_kv = PAGE * kvs * 2 * size_of::<bf16>();
    c.layers * (pages * (page_kv + 2 * kvs * size_of::<f32>()) + (HOT / PAGE + 1) * page_kv)
}

/// The process's resident memory (`VmRSS` of /proc/self/status), in bytes; 0 where unknown.
fn resident() -> usize {
    proc_bytes("/proc/self/status", "VmRSS:").unwrap_or(0)
}

/// The value of line `key` (a count of kB) of a /proc file such as /proc/meminfo, in bytes.
pub(crate) fn proc_bytes(path: &str, key: &str) -> Option<usize> {
    std::fs::read_to_string(path)
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse::<usize>().ok())
        .map(|kb| kb << 10)
}

/// Prefills `max(batches)` requests of `context` tokens through the coordinator's CPU hooks,
/// then, for each batch size, times decode steps of the first requests through its device
/// hooks and profiles a few more by stage.
pub(crate) fn runs(
    gm: &GpuModel<bf16>,
    context: usize,
    ctx: Context,
    batches: &[usize],
    room: usize,
) -> Res<Vec<Row>> {
    let e = |e: coordinator::CoordError| e.to_string();
    let s = |e: engine::EngineError| e.to_string();
    let c = gm.config;
    let most = batches.iter().copied().max().unwrap_or(0);
    let config = SparseConfig {
        algo: AlgoConfig::Quest(QuestConfig {
            page_size: PAGE,
            budget_tokens: BUDGET,
            always: AlwaysInclude {
                sink_tokens: SINK,
                recent_tokens: RECENT,
            },
            shared_heads: true,
        }),
        hot_tokens: Some(HOT),
        min_prompt_tokens: Some(1),
        dense_layers: Vec::new(),
        layer: Vec::new(),
        host_layout: HostLayout::LayerFirst,
    };
    let pages = (context + batches.len() * (WARM + STEPS + PROFILED)).div_ceil(PAGE);
    let cap = Capacity {
        max_requests: most,
        max_tokens: pages * PAGE,
        host_pages: most * pages,
        host_alloc: HostAlloc::Own,
    };
    let rss0 = resident();
    let mut coord = SparseCoordinator::<bf16>::from_config(c.shape(), &config, cap).map_err(e)?;
    let kvs = c.kv_heads * c.head_dim;
    let mut k = random_bf16(context * kvs, 11);
    let v = random_bf16(context * kvs, 12);
    if ctx == Context::Heavy {
        for page in heavy_pages(context) {
            for x in &mut k[page * PAGE * kvs..(page + 1) * PAGE * kvs] {
                *x = bf16::from_f32(x.to_f32() * HEAVY_SCALE);
            }
        }
    }
    // Prefill rows are only counted by the coordinator (Quest scores no prompt), so the
    // queries are zeros the allocator need not touch.
    let q = vec![0f32; context * c.q_heads * c.head_dim];
    let t0 = Instant::now();
    let ids: Vec<RequestId> = (0..most).map(|r| RequestId(r as u64 + 1)).collect();
    for &id in &ids {
        coord.on_request_begin(id, context).map_err(e)?;
        coord.forward_begin(&[(id, context)]).map_err(e)?;
        for l in 0..c.layers {
            coord.attention_begin(l, &q, &k, &v).map_err(e)?;
            coord.attention_end(l, &k, &v).map_err(e)?;
        }
        coord.forward_end().map_err(e)?;
    }
    drop((q, k, v));
    println!(
        "sparse {context:>6} tokens, {} keys: {most} prompts into the host pool in {:.1} s; \
         resident host memory {:.2} GiB per request (counted: {:.2})",
        ctx.name(),
        t0.elapsed().as_secs_f64(),
        resident().saturating_sub(rss0) as f64 / most.max(1) as f64 / f64::from(1u32 << 30),
        host_bytes(gm, context, batches.len()) as f64 / f64::from(1u32 << 30)
    );
    let mut dev = DeviceSparse::new(gm.gpu(), &coord).map_err(e)?;
    let device = dev.device_bytes() / most.max(1);
    let params = AttnParams::new(c.q_heads, c.head_dim);
    let mut tokens: Vec<u32> = (0..most).map(|i| (i * 7919 % c.vocab) as u32).collect();
    let mut pos = vec![context; most];
    let mut rows = Vec::new();
    for &batch in batches {
        let all: Vec<usize> = (0..batch).collect();
        let reqs: Vec<(RequestId, usize)> = ids[..batch].iter().map(|&id| (id, 1)).collect();
        let mut times = Vec::new();
        let (mut hits, mut misses) = (0u64, 0u64);
        let mut stages: Vec<(&'static str, f64)> = Vec::new();
        for step in 0..WARM + STEPS + PROFILED {
            let profiled = step >= WARM + STEPS;
            if profiled && dev.clock_mut().is_none() {
                dev.set_clock(Some(StageClock::new(gm.gpu())));
            }
            if let Some(clock) = dev.clock_mut() {
                clock.mark("model").map_err(|e| e.to_string())?;
            }
            let t = Instant::now();
            coord.forward_begin(&reqs).map_err(e)?;
            let mut att = GpuSparseAttention {
                coord: &mut coord,
                dev: &mut dev,
                params: params.clone(),
                dense: None,
            };
            let next = gm
                .forward_greedy(&tokens[..batch], &pos[..batch], &mut att, &all)
                .map_err(s)?;
            coord.forward_end().map_err(e)?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            tokens[..batch].copy_from_slice(&next);
            pos[..batch].iter_mut().for_each(|p| *p += 1);
            if let Some(clock) = dev.clock_mut() {
                clock.mark("model").map_err(|e| e.to_string())?;
                for (label, t) in clock.take().map_err(|e| e.to_string())? {
                    match stages.iter_mut().find(|(l, _)| *l == label) {
                        Some((_, sum)) => *sum += t / PROFILED as f64,
                        None => stages.push((label, t / PROFILED as f64)),
                    }
                }
            } else if step >= WARM {
                times.push(ms);
                for l in 0..c.layers {
                    let st = dev.stats(gm.gpu(), &coord, l).map_err(e)?;
                    hits += st.hits;
                    misses += st.misses;
                }
            }
        }
        dev.set_clock(None);
        let step_ms = median(&mut times);
        println!(
            "sparse {context:>6} tokens, {} keys, batch {batch:>3}: {step_ms:.2} ms per step, \
             miss rate {:.3}",
            ctx.name(),
            misses as f64 / (hits + misses).max(1) as f64
        );
        rows.push(Row {
            context,
            mode: "sparse",
            keys: ctx.name(),
            batch,
            device,
            host: host_bytes(gm, context, batches.len()),
            device_max: room / device.max(1),
            step_ms,
            miss: Some(misses as f64 / (hits + misses).max(1) as f64),
            stages,
        });
    }
    Ok(rows)
}

/// The heavy pages of a `context`-token prompt: [`HEAVY`] distinct pages spread over it by a
/// fixed generator, never the sink's first page nor the recent window's last pages.
fn heavy_pages(context: usize) -> Vec<usize> {
    let first = (SINK as usize).div_ceil(PAGE);
    let span = (context - RECENT as usize) / PAGE - first;
    let mut picked = vec![false; span];
    let mut out = Vec::with_capacity(HEAVY);
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    while out.len() < HEAVY.min(span) {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let p = (state >> 33) as usize % span;
        if !std::mem::replace(&mut picked[p], true) {
            out.push(first + p);
        }
    }
    out
}
