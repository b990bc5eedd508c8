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
use sparse_algo::cuda::QuestScoring;
use sparse_algo::{AlgoConfig, AlwaysInclude, QuestConfig};

use crate::Res;
use crate::lanes;
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
/// its KV in the host pool (bf16) and its Quest pages on the CPU (f32 min and max). The CPU
/// offload manager's hot-buffer pool, which the device path leaves unused, is never written,
/// so its zeroed pages never become resident.
pub(crate) fn host_bytes(gm: &GpuModel<bf16>, context: usize, runs: usize) -> usize {
    let c = gm.config;
    let pages = host_pages(context, runs);
    let kvs = c.kv_heads * c.head_dim;
    let page_kv = PAGE * kvs * 2 * size_of::<bf16>();
    c.layers * pages * (page_kv + 2 * kvs * size_of::<f32>())
}

/// Host pages a request of `context` tokens takes over `runs` runs of decode steps.
fn host_pages(context: usize, runs: usize) -> usize {
    (context + runs * (WARM + STEPS + PROFILED)).div_ceil(PAGE)
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

/// The sparse configuration of every run: head-shared Quest over every layer.
fn config() -> SparseConfig {
    SparseConfig {
        algo: AlgoConfig::Quest(QuestConfig {
            page_size: PAGE,
            budget_tokens: BUDGET,
            always: AlwaysInclude {
                sink_tokens: SINK,
                recent_tokens: RECENT,
            },
            shared_heads: true,
            ..Default::default()
        }),
        hot_tokens: Some(HOT),
        min_prompt_tokens: Some(1),
        dense_layers: Vec::new(),
        layer: Vec::new(),
        host_layout: HostLayout::LayerFirst,
        prefetch: false,
    }
}

/// Requests being decoded through the coordinator's device hooks, and their next tokens and
/// positions.
struct Decoding {
    coord: SparseCoordinator<bf16>,
    dev: DeviceSparse<bf16>,
    ids: Vec<RequestId>,
    tokens: Vec<u32>,
    pos: Vec<usize>,
    params: AttnParams,
    /// The layers the last step prefetched.
    prefetched: Vec<usize>,
}

impl Decoding {
    /// Prefills `n` requests of `context` tokens of `ctx` keys through a new coordinator's CPU
    /// hooks (its host pool sized for `runs` runs of decode steps), then mirrors it on `gm`'s
    /// device.
    fn prefill(
        gm: &GpuModel<bf16>,
        context: usize,
        ctx: Context,
        n: usize,
        runs: usize,
    ) -> Res<Decoding> {
        let e = |e: coordinator::CoordError| e.to_string();
        let c = gm.config;
        let pages = host_pages(context, runs);
        let cap = Capacity {
            max_requests: n,
            max_tokens: pages * PAGE,
            host_pages: n * pages,
            host_alloc: HostAlloc::Own,
        };
        let mut coord =
            SparseCoordinator::<bf16>::from_config(c.shape(), &config(), cap).map_err(e)?;
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
        let ids: Vec<RequestId> = (0..n).map(|r| RequestId(r as u64 + 1)).collect();
        for &id in &ids {
            coord.on_request_begin(id, context).map_err(e)?;
            coord.forward_begin(&[(id, context)]).map_err(e)?;
            for l in 0..c.layers {
                coord.attention_begin(l, &q, &k, &v).map_err(e)?;
                coord.attention_end(l, &k, &v).map_err(e)?;
            }
            coord.forward_end().map_err(e)?;
        }
        let mut dev = DeviceSparse::new(gm.gpu(), &coord).map_err(e)?;
        dev.set_quest_scoring(QuestScoring::TensorCores);
        Ok(Decoding {
            dev,
            coord,
            tokens: (0..n).map(|i| (i * 7919 % c.vocab) as u32).collect(),
            pos: vec![context; n],
            params: AttnParams::new(c.q_heads, c.head_dim),
            ids,
            prefetched: Vec::new(),
        })
    }

    /// One decode step of the first `batch` requests, the next tokens greedy.
    fn step(&mut self, gm: &GpuModel<bf16>, batch: usize) -> Res<()> {
        let e = |e: coordinator::CoordError| e.to_string();
        let all: Vec<usize> = (0..batch).collect();
        let reqs: Vec<(RequestId, usize)> = self.ids[..batch].iter().map(|&id| (id, 1)).collect();
        self.coord.forward_begin(&reqs).map_err(e)?;
        let mut att =
            GpuSparseAttention::new(&mut self.coord, &mut self.dev, self.params.clone(), None);
        let next = gm
            .forward_greedy(&self.tokens[..batch], &self.pos[..batch], &mut att, &all)
            .map_err(|e| e.to_string())?;
        self.prefetched = std::mem::take(&mut att.prefetched);
        self.coord.forward_end().map_err(e)?;
        self.tokens[..batch].copy_from_slice(&next);
        self.pos[..batch].iter_mut().for_each(|p| *p += 1);
        Ok(())
    }

    /// Hits and misses of the last step's selections over every layer, and the pages its
    /// prefetches loaded.
    fn hits(&self, gm: &GpuModel<bf16>) -> Res<(u64, u64, u64)> {
        let (mut hits, mut misses, mut early) = (0, 0, 0);
        for l in 0..gm.config.layers {
            let st = self
                .dev
                .stats(gm.gpu(), &self.coord, l)
                .map_err(|e| e.to_string())?;
            hits += st.hits;
            misses += st.misses;
        }
        for &l in &self.prefetched {
            early += self
                .dev
                .prefetch_stats(&self.coord, l)
                .map_err(|e| e.to_string())?
                .loaded_pages;
        }
        Ok((hits, misses, early))
    }
}

/// Prefills `max(batches)` requests of `context` tokens through the coordinator's CPU hooks,
/// then, for each batch size, times decode steps of the first requests through its device
/// hooks and profiles a few more by stage; with `prefetch`, then the same again with the
/// coordinator's prefetch on.
pub(crate) fn runs(
    gm: &GpuModel<bf16>,
    context: usize,
    ctx: Context,
    batches: &[usize],
    room: usize,
    prefetch: bool,
) -> Res<Vec<Row>> {
    let most = batches.iter().copied().max().unwrap_or(0);
    let rss0 = resident();
    let t0 = Instant::now();
    // Runs of decode steps the requests' pages must hold: one per batch, two with prefetch.
    let step_runs = batches.len() * if prefetch { 2 } else { 1 };
    let mut d = Decoding::prefill(gm, context, ctx, most, step_runs)?;
    println!(
        "sparse {context:>6} tokens, {} keys: {most} prompts into the host pool, pinned and \
         mirrored on the device in {:.1} s; resident host memory {:.2} GiB per request (counted: {:.2})",
        ctx.name(),
        t0.elapsed().as_secs_f64(),
        resident().saturating_sub(rss0) as f64 / most.max(1) as f64 / f64::from(1u32 << 30),
        host_bytes(gm, context, step_runs) as f64 / f64::from(1u32 << 30)
    );
    let device = d.dev.device_bytes() / most.max(1);
    let mut rows = Vec::new();
    for &batch in batches {
        for early in [false, true].into_iter().filter(|&on| !on || prefetch) {
            d.coord.set_prefetch(early);
            let run = d.measure(gm, batch)?;
            println!(
                "sparse {context:>6} tokens, {} keys, batch {batch:>3}{}: {:.2} ms per step, \
                 miss rate {:.3}{}",
                ctx.name(),
                if early { ", prefetch" } else { "" },
                run.step_ms,
                run.miss,
                run.early.map_or(String::new(), |p| format!(
                    ", {p:.0} pages a step loaded early"
                ))
            );
            rows.push(Row {
                context,
                mode: "sparse",
                keys: ctx.name(),
                batch,
                lanes: 1,
                device,
                host: host_bytes(gm, context, step_runs),
                device_max: room / device.max(1),
                step_ms: run.step_ms,
                miss: Some(run.miss),
                early: run.early,
                stages: run.stages,
            });
        }
        d.coord.set_prefetch(false);
    }
    Ok(rows)
}

/// What [`Decoding::measure`] measured.
struct Measured {
    step_ms: f64,
    miss: f64,
    /// With prefetch, the pages loaded early per step.
    early: Option<f64>,
    stages: Vec<(&'static str, f64)>,
}

impl Decoding {
    /// Decode steps of the first `batch` requests: [`WARM`], then [`STEPS`] timed (their
    /// median, and the hit rate over them), then [`PROFILED`] profiled by stage.
    fn measure(&mut self, gm: &GpuModel<bf16>, batch: usize) -> Res<Measured> {
        let e = |e: attn_op::AttnError| e.to_string();
        let mut times = Vec::new();
        let (mut hits, mut misses, mut early) = (0u64, 0u64, 0u64);
        let mut stages: Vec<(&'static str, f64)> = Vec::new();
        for step in 0..WARM + STEPS + PROFILED {
            let profiled = step >= WARM + STEPS;
            if profiled && self.dev.clock_mut().is_none() {
                self.dev.set_clock(Some(StageClock::new(gm.gpu())));
            }
            if let Some(clock) = self.dev.clock_mut() {
                clock.mark("model").map_err(e)?;
            }
            let t = Instant::now();
            self.step(gm, batch)?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            if let Some(clock) = self.dev.clock_mut() {
                clock.mark("model").map_err(e)?;
                for (label, t) in clock.take().map_err(e)? {
                    match stages.iter_mut().find(|(l, _)| *l == label) {
                        Some((_, sum)) => *sum += t / PROFILED as f64,
                        None => stages.push((label, t / PROFILED as f64)),
                    }
                }
            } else if step >= WARM {
                times.push(ms);
                let (h, m, p) = self.hits(gm)?;
                hits += h;
                misses += m;
                early += p;
            }
        }
        self.dev.set_clock(None);
        Ok(Measured {
            step_ms: median(&mut times),
            miss: misses as f64 / (hits + misses).max(1) as f64,
            early: self
                .coord
                .lowered()
                .prefetch
                .then(|| early as f64 / STEPS as f64),
            stages,
        })
    }
}

/// [`runs`] over [`lanes::LANES`] lanes: each lane prefills its share of `max(batches)`
/// requests into a coordinator of its own, then for each batch size decodes its share, all
/// lanes at once. A batch's step time is the slowest lane's mean over the timed steps; the
/// miss rate is counted over a few steps after them.
pub(crate) fn lane_runs(
    gm: &GpuModel<bf16>,
    context: usize,
    ctx: Context,
    batches: &[usize],
    room: usize,
) -> Res<Vec<Row>> {
    let most = batches.iter().copied().max().unwrap_or(0);
    let t0 = Instant::now();
    let per_lane = lanes::run(gm, |lane, lm, meet| {
        let mut d = Decoding::prefill(lm, context, ctx, lanes::share(most, lane), batches.len())?;
        let device = d.dev.device_bytes();
        let mut out = Vec::new();
        for &batch in batches {
            let mine = lanes::share(batch, lane);
            for _ in 0..WARM {
                d.step(lm, mine)?;
            }
            meet.wait()?;
            let t = Instant::now();
            for _ in 0..STEPS {
                d.step(lm, mine)?;
            }
            let ms = t.elapsed().as_secs_f64() * 1e3 / STEPS as f64;
            let (mut hits, mut misses) = (0, 0);
            for _ in 0..PROFILED {
                d.step(lm, mine)?;
                let (h, m, _) = d.hits(lm)?;
                hits += h;
                misses += m;
            }
            out.push((ms, hits, misses));
        }
        Ok((device, out))
    })?;
    println!(
        "sparse {context:>6} tokens, {} keys, {} lanes: {most} prompts prefilled and decoded in \
         {:.1} s",
        ctx.name(),
        lanes::LANES,
        t0.elapsed().as_secs_f64()
    );
    let device = per_lane.iter().map(|l| l.0).sum::<usize>() / most.max(1);
    let mut rows = Vec::new();
    for (i, &batch) in batches.iter().enumerate() {
        let step_ms = per_lane.iter().map(|l| l.1[i].0).fold(0.0, f64::max);
        let hits: u64 = per_lane.iter().map(|l| l.1[i].1).sum();
        let misses: u64 = per_lane.iter().map(|l| l.1[i].2).sum();
        let miss = misses as f64 / (hits + misses).max(1) as f64;
        println!(
            "sparse {context:>6} tokens, {} keys, batch {batch:>3} over {} lanes: {step_ms:.2} ms \
             per step, miss rate {miss:.3}",
            ctx.name(),
            lanes::LANES
        );
        rows.push(Row {
            context,
            mode: "sparse",
            keys: ctx.name(),
            batch,
            lanes: lanes::LANES,
            device,
            host: host_bytes(gm, context, batches.len()),
            device_max: room / device.max(1),
            step_ms,
            miss: Some(miss),
            early: None,
            stages: Vec::new(),
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
