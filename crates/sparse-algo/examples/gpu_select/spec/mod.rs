//! `gpu_select spec`: attention over a step's pages a warp a page, as partials merged after the
//! top-k (kernels/spec.cu), a prototype for issue 7's B1 L128K step (kernels/NOTES.md,
//! session 74).
//!
//! Each [`Walk`] runs every layer's E4M3 Quest step in one of two ways:
//! - early: a low-priority stream runs `spec_pages` over the pages the step is likely to select
//!   (drawn from the plain step's selection at a set share: the current page kept, the others
//!   partly swapped for pages the row lacks), while the high-priority stream runs the top-k;
//!   then `spec_finish` computes the selected pages the set lacks and merges every selected
//!   page's partial;
//! - late: after the top-k, `spec_pages` over the selection itself, then `spec_finish`.
//!
//! Outputs are checked against the CPU's attention over the same selection, and the 8 layers
//! are timed in one graph beside the shipped step, as `cold.rs` times it.

mod inputs;
mod launch;

use attn_op::PagedKv;
use attn_op::cuda::{DeviceBatch, DeviceSelection, Gpu, Timing};
use attn_op::{AttnError, AttnParams};
use cudarc::driver::CudaSlice;
use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use half::bf16;
use sparse_algo::cuda::{DeviceRepPool, DeviceTopK, SelectKernels};
use sparse_algo::{AlgoError, Quest};

use crate::bench::{D, KV_HEADS, Q_HEADS, RUNS, kv_pool, untracked};
use crate::cold::{self, COLD_LAYERS, Shape};
use crate::report::{self, Row, random_bf16, table};
use crate::rng::Rng;
pub(crate) use inputs::Host;
use inputs::{cpu_reference, likely_sets, worst_diff, worst_of};
use launch::{
    Kernels, Parts, compile, launch_finish, launch_pages, launch_walk_merge, launch_walk_pages,
    launch_warm,
};

/// Which pages a step walks when.
#[derive(Clone, Copy, Debug)]
enum Walk {
    /// The selection's pages after the top-k, a warp each; with `published`, each row's CTAs
    /// start at the row's flag ([`SelectKernels::set_publish`]) instead of the whole top-k's
    /// end.
    Late { published: bool },
    /// Likely pages during the top-k: `count` times the selection's, holding `share` of it.
    /// A count of 1 stands for the previous step's selection, 2 for a hot buffer of twice the
    /// budget. `examples/overlap.rs` of the engine measures the shares on the real model.
    Early { share: f64, count: usize },
    /// Likely pages only asked of L2 during the top-k (`spec_warm`), then the late walk.
    Warm { share: f64, count: usize },
    /// attn-op's page walk (`Gpu::sparse_page_attention`, unpublished) after the top-k: the
    /// shipped step's kernels in this bench's graph, which tells whether the shipped step's
    /// time comes from its kernels or from the cold bench.
    Shipped,
    /// The late walk with attn-op's `walk_pages` (`pages`), its `walk_merge` (`merge`), or
    /// both (compiled in the prototype's module, over its partials' buffer) in place of its own.
    Swapped { pages: bool, merge: bool },
    /// The late walk with `spec_finish_late`, its finish compiled for a late walk only.
    FixedLate,
}

/// The walks the bench times.
const WALKS: [Walk; 14] = [
    Walk::Late { published: false },
    Walk::Late { published: true },
    Walk::Early {
        share: 1.0,
        count: 1,
    },
    Walk::Early {
        share: 0.95,
        count: 1,
    },
    Walk::Early {
        share: 0.9,
        count: 1,
    },
    Walk::Early {
        share: 0.8,
        count: 1,
    },
    Walk::Early {
        share: 0.7,
        count: 1,
    },
    Walk::Early {
        share: 0.5,
        count: 1,
    },
    Walk::Early {
        share: 0.98,
        count: 2,
    },
    Walk::Early {
        share: 0.95,
        count: 2,
    },
    Walk::Early {
        share: 0.88,
        count: 2,
    },
    Walk::Warm {
        share: 1.0,
        count: 1,
    },
    Walk::Warm {
        share: 0.7,
        count: 1,
    },
    Walk::Warm {
        share: 0.88,
        count: 2,
    },
];

/// One shape's inputs and state for the speculative step.
struct Spec<'a> {
    k: &'a Kernels,
    sh: &'a Shape<'a>,
    quest: &'a Quest,
    pool: &'a DeviceRepPool<bf16>,
    decodes: &'a [DeviceBatch],
    hi: &'a Gpu,
    lo: &'a Gpu,
    sk: &'a SelectKernels,
    top: &'a mut DeviceTopK,
    parts: &'a mut Parts,
}

/// `gpu_select spec [--json FILE] [--only B1|B8] [--check] [--late]`: each shape's plain and
/// speculative rows; with `--check`, only the speculative steps' eager outputs against the CPU,
/// with no early walk and with a hot buffer holding 88 % (for compute-sanitizer); with `late`,
/// only the walks after the top-k, timed twice each.
pub(crate) fn run(
    gpu: &mut Gpu,
    sk: &mut SelectKernels,
    json: Option<&str>,
    only: Option<&str>,
    check: bool,
    late: bool,
) -> Result<(), AlgoError> {
    let (layout, kv, k) = kv_pool(gpu)?;
    let host_kv = PagedKv::from_tensors(layout, k.clone(), k)?;
    let mut rows = Vec::new();
    for (b, ctx) in [(1usize, 128 * 1024usize), (8, 32 * 1024)] {
        let tag = format!("B{b} L{}K", ctx / 1024);
        if only.is_some_and(|o| !tag.starts_with(o)) {
            continue;
        }
        let slots = gpu.upload(&(0..b as i32).collect::<Vec<_>>())?;
        let host_q = random_bf16(b * Q_HEADS * D, 3);
        let q = gpu.upload(&host_q)?;
        let sh = Shape {
            kv: &kv,
            layout: &layout,
            q: &q,
            slots: &slots,
            b,
            ctx,
            tag: &tag,
        };
        let host = Host {
            kv: &host_kv,
            q: &host_q,
        };
        let first = rows.len();
        rows.extend(bench_spec(gpu, sk, &sh, &host, 29 + b as u64, check, late)?);
        print!("{}", table(&rows[first..]));
    }
    if let Some(path) = json {
        let body = report::json(&gpu.name()?, &rows);
        std::fs::write(path, body).map_err(|e| AlgoError::Invalid(format!("{path}: {e}")))?;
    }
    Ok(())
}

/// The plain step's rows and the speculative step's for one shape, in one call: the plain ones
/// from [`cold::bench_cold`], then one row per walk; with `check`, only the walks' eager outputs
/// against the CPU.
pub(crate) fn bench_spec(
    gpu: &mut Gpu,
    sk: &mut SelectKernels,
    sh: &Shape<'_>,
    host: &Host<'_>,
    seed: u64,
    check: bool,
    late: bool,
) -> Result<Vec<Row>, AlgoError> {
    let mut out = gpu.zeros::<f32>(sh.b * Q_HEADS * D)?;
    let l = cold::Layers::new(gpu, sk, sh, &mut Rng::new(seed))?;
    // The shipped step as it runs (the page walk where it fits), with the top-k publishing its
    // rows and not, unpublished on a high-priority stream as the walks below run, then with
    // the tensor-core attention kernel throughout.
    let mut rows = Vec::new();
    if !check {
        let runs = [(false, false), (true, false), (true, true)];
        for (unpublished, high) in runs {
            let run = cold::ColdRun { unpublished, high };
            let traces = &mut Vec::new();
            rows.extend(cold::bench_cold(gpu, sk, sh, &l, &mut out, traces, run)?);
        }
        gpu.set_page_walk(false);
        let run = cold::ColdRun::default();
        let off = cold::bench_cold(gpu, sk, sh, &l, &mut out, &mut Vec::new(), run);
        gpu.set_page_walk(true);
        rows.extend(off?.into_iter().map(|mut r| {
            r.name.push_str(" (page walk off)");
            r
        }));
    }
    let (quest, pool, decodes) = (&l.quest, &l.pool, &l.decodes);
    let mut top = DeviceTopK::new(gpu, quest, sh.b, KV_HEADS, sh.ctx, false)?;
    let tag = format!(" e4m3 {}", sh.tag);
    sk.set_publish(false);
    let wants = {
        let mut step = l.step(sh, &mut top, &mut out, &tag);
        cold::wants(gpu, sk, &mut step, decodes)?
    };
    let width = top.sel.max_len;
    let fits = gpu.page_walk_fits(sh.kv, &decodes[0], &top.sel, &AttnParams::new(Q_HEADS, D));
    println!(
        "{}: {} rows of {width} pages; the page walk fits: {fits}",
        sh.tag, top.sel.rows
    );
    let cpu = cpu_reference(host, sh, &l.tables, &wants, width)?;
    let plain_outs: Vec<Vec<f32>> = wants.iter().map(|w| w.out.clone()).collect();
    let plain = worst_of(&plain_outs, &cpu);
    let k = compile(gpu)?;
    let (hi, lo) = (
        gpu.fork_with_priority(true)?,
        gpu.fork_with_priority(false)?,
    );
    let sk_hi = sk.on_stream(hi.stream().clone());
    let mut sk_pub = sk_hi.clone();
    sk_pub.set_publish(true);
    let mut parts = Parts::new(gpu, sh.b * KV_HEADS, 2 * width)?;
    let mut outs = (0..COLD_LAYERS)
        .map(|_| gpu.zeros::<f32>(sh.b * Q_HEADS * D))
        .collect::<Result<Vec<_>, _>>()?;
    let mut spec = Spec {
        k: &k,
        sh,
        quest,
        pool,
        decodes,
        hi: &hi,
        lo: &lo,
        sk: &sk_hi,
        top: &mut top,
        parts: &mut parts,
    };
    gpu.synchronize()?;
    let walks = if check {
        vec![WALKS[1], WALKS[10], WALKS[13]]
    } else if late {
        // The late walk first and last (the call's drift between them), then attn-op's walk,
        // each half of it in the prototype's walk, both halves, and the finish compiled for a
        // late walk only.
        [
            WALKS[0],
            Walk::Shipped,
            Walk::Swapped {
                pages: true,
                merge: false,
            },
            Walk::Swapped {
                pages: false,
                merge: true,
            },
            Walk::FixedLate,
            Walk::Swapped {
                pages: true,
                merge: true,
            },
            WALKS[0],
        ]
        .to_vec()
    } else {
        WALKS.to_vec()
    };
    // Every selected page is late where nothing is walked early.
    let selected = likely_sets(gpu, &wants, WALKS[0], width, sh)?.1;
    for walk in walks {
        let (sets, late) = likely_sets(gpu, &wants, walk, width, sh)?;
        spec.sk = if matches!(walk, Walk::Late { published: true }) {
            &sk_pub
        } else {
            &sk_hi
        };
        // Eager, each layer into its own output, checked against the CPU.
        for (layer, out) in outs.iter_mut().enumerate() {
            spec.step(layer, walk, sets.get(layer), out)?;
        }
        hi.synchronize()?;
        let eager = worst_diff(gpu, &outs, &cpu)?;
        if check {
            let ok = eager < 1e-5;
            println!(
                "spec {} {walk:?}: max |out - cpu| / max |cpu| {eager:.1e} ({})",
                sh.tag,
                if ok { "ok" } else { "FAILED" }
            );
            if !ok {
                return Err(AlgoError::Invalid(
                    "the speculative step differs from the CPU".into(),
                ));
            }
            continue;
        }
        for o in &mut outs {
            gpu.stream().memset_zeros(o).map_err(AttnError::from)?;
        }
        gpu.synchronize()?;
        let t = spec.time_graph(gpu, walk, &sets, &mut outs)?;
        let graph = worst_diff(gpu, &outs, &cpu)?;
        rows.push(Row {
            name: format!("spec step 8 layers one graph, {} {}", walk.name(), sh.tag),
            t: Timing {
                synced: t.synced / COLD_LAYERS as f64,
                queued: t.queued / COLD_LAYERS as f64,
            },
            bytes: 0.0,
            note: format!(
                "{late} of {selected} selected pages computed after the top-k; max |out - \
                 cpu| / max |cpu| {eager:.1e} eager, {graph:.1e} graph (plain step {plain:.1e}); \
                 per step"
            ),
        });
    }
    Ok(rows)
}

impl Walk {
    /// The walk, as its rows name it.
    fn name(self) -> String {
        match self {
            Walk::Late { published: false } => "pages a warp each after the top-k".to_owned(),
            Walk::Late { published: true } => "pages a warp each from each row's flag".to_owned(),
            Walk::Shipped => "attn-op's page walk after the top-k".to_owned(),
            Walk::Swapped { pages, merge } => format!(
                "{} then {}",
                if pages { "walk_pages" } else { "spec_pages" },
                if merge { "walk_merge" } else { "spec_finish" }
            ),
            Walk::FixedLate => "spec_pages then spec_finish_late".to_owned(),
            Walk::Early { share, count } => {
                format!("{count}x pages holding {:.0}%", share * 100.0)
            }
            Walk::Warm { share, count } => format!(
                "pages after the top-k, {count}x pages holding {:.0}% warmed",
                share * 100.0
            ),
        }
    }
}

impl Spec<'_> {
    /// Enqueues layer `layer`'s step attending into `out`: with `likely` pages, their walk on the
    /// low-priority stream beside the top-k, then the finish; without, the top-k, then the
    /// walk of its selection and the finish.
    fn step(
        &mut self,
        layer: usize,
        walk: Walk,
        likely: Option<&DeviceSelection>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), AlgoError> {
        let decode = &self.decodes[layer];
        let (hi, lo) = (self.hi.stream(), self.lo.stream());
        let event = || Some(CUevent_flags::CU_EVENT_DISABLE_TIMING);
        let side = match likely {
            Some(prev) => {
                let start = hi.record_event(event()).map_err(AttnError::from)?;
                lo.wait(&start).map_err(AttnError::from)?;
                if matches!(walk, Walk::Warm { .. }) {
                    launch_warm(self.k, lo, self.sh, decode, prev)?;
                } else {
                    launch_pages(self.k, lo, None, self.sh, decode, prev, self.parts)?;
                }
                Some(lo.record_event(event()).map_err(AttnError::from)?)
            }
            None => None,
        };
        self.sk.quest_topk(
            self.quest,
            self.sh.q,
            Q_HEADS,
            decode,
            layer,
            self.sh.slots,
            self.pool,
            self.top,
        )?;
        match (walk, likely) {
            (Walk::Shipped, _) => {
                let params = AttnParams::new(Q_HEADS, D);
                let sel = &self.top.sel;
                let (q, kv) = (self.sh.q, self.sh.kv);
                self.hi
                    .sparse_page_attention(q, kv, decode, sel, &params, out, None)?;
                Ok(())
            }
            (Walk::FixedLate, _) => {
                let (k, sel) = (self.k.fixed(), &self.top.sel);
                launch_pages(&k, hi, Some(None), self.sh, decode, sel, self.parts)?;
                launch_finish(&k, hi, self.sh, decode, self.top, None, self.parts, out)
            }
            (Walk::Swapped { pages, merge }, _) => {
                let sel = &self.top.sel;
                if pages {
                    launch_walk_pages(self.k, hi, self.sh, decode, sel, self.parts)?;
                } else {
                    launch_pages(self.k, hi, Some(None), self.sh, decode, sel, self.parts)?;
                }
                if merge {
                    let (w, p) = (sel.max_len, &*self.parts);
                    launch_walk_merge(self.k, hi, decode, w, p, out)
                } else {
                    launch_finish(self.k, hi, self.sh, decode, self.top, None, self.parts, out)
                }
            }
            (Walk::Early { .. }, Some(prev)) => {
                if let Some(e) = &side {
                    hi.wait(e).map_err(AttnError::from)?;
                }
                launch_finish(
                    self.k,
                    hi,
                    self.sh,
                    decode,
                    self.top,
                    Some(prev),
                    self.parts,
                    out,
                )
            }
            _ => {
                let sel = &self.top.sel;
                let after = Some(self.top.published());
                launch_pages(self.k, hi, after, self.sh, decode, sel, self.parts)?;
                // The warm's stream rejoins before the finish (it holds no data the finish
                // reads).
                if let Some(e) = &side {
                    hi.wait(e).map_err(AttnError::from)?;
                }
                launch_finish(self.k, hi, self.sh, decode, self.top, None, self.parts, out)
            }
        }
    }

    /// Every layer's step, with `sets` its likely pages (none: a late walk), captured into one
    /// graph on the high-priority stream (node priorities kept) and timed.
    fn time_graph(
        &mut self,
        gpu: &Gpu,
        walk: Walk,
        sets: &[DeviceSelection],
        outs: &mut [CudaSlice<f32>],
    ) -> Result<Timing, AlgoError> {
        let hi = self.hi;
        untracked(gpu.context(), hi.stream(), || {
            let stream = hi.stream();
            stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(AttnError::from)?;
            let enqueued = outs
                .iter_mut()
                .enumerate()
                .try_for_each(|(layer, out)| self.step(layer, walk, sets.get(layer), out));
            let graph = stream
                .end_capture(
                    CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY,
                )
                .map_err(AttnError::from)?;
            enqueued?;
            let graph =
                graph.ok_or_else(|| AlgoError::Invalid("the capture made no graph".into()))?;
            graph.upload().map_err(AttnError::from)?;
            hi.time(RUNS, || {
                graph
                    .launch()
                    .map_err(|e| AlgoError::from(AttnError::from(e)))
            })
        })
    }
}
