//! `gpu_select spec`: attention over the previous step's selection while the top-k runs
//! (kernels/spec.cu), a prototype for issue 7's B1 L128K step (kernels/NOTES.md, session 74).
//!
//! Each layer's step forks a low-priority stream: `spec_pages` writes a partial per page of the
//! row's previous selection, while the high-priority stream runs the E4M3 Quest top-k. Then
//! `spec_finish` computes the pages the new selection adds and merges every selected page's
//! partial. The previous selections are drawn from the new ones at a given overlap (the current
//! page kept, a share of the others swapped for pages the row lacks). The step's output is
//! compared with the plain step's (the same selection), and the 8 layers are timed in one graph,
//! as `cold.rs` times the plain step.

use attn_op::cuda::{DeviceBatch, DeviceSelection, Gpu, Launch, Published, Timing};
use attn_op::{
    AttnError, AttnOut, AttnParams, BatchMeta, PagedKv, Selection, sparse_page_attention,
};
use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use half::bf16;
use sparse_algo::cuda::{DeviceRepPool, DeviceTopK, SelectKernels};
use sparse_algo::{AlgoError, Quest, Summary};

use super::bench::{D, KV_HEADS, PS, Q_HEADS, RUNS, Want, kv_pool, quest_2k, untracked};
use super::cold::{self, COLD_LAYERS, Shape};
use super::report::{self, Row, random_bf16, table};
use super::rng::Rng;
use super::steptrace::Step;

/// The prototype's kernels, after kernels/pdl.cuh.
const SOURCE: &str = concat!(
    include_str!("../../../../kernels/pdl.cuh"),
    include_str!("../../../../kernels/spec.cu")
);

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
}

/// The walks the bench times.
const WALKS: [Walk; 11] = [
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
];

/// The widest row `spec_finish` stages (`SPEC_MAXW` in kernels/spec.cu).
const MAX_WIDTH: usize = 256;

/// The compiled kernels.
struct Kernels {
    pages: CudaFunction,
    finish: CudaFunction,
}

/// The partials per walked page `[rows, width, 4, D]` and their LSEs, and a flag buffer
/// passed where the top-k publishes nothing.
struct Parts {
    prev_o: CudaSlice<f32>,
    prev_lse: CudaSlice<f32>,
    none: CudaSlice<u32>,
}

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

/// `gpu_select spec [--json FILE] [--only B1|B8] [--check]`: each shape's plain and speculative
/// rows; with `--check`, only the speculative steps' eager outputs against the CPU, with no
/// early walk and with a hot buffer holding 88 % (for compute-sanitizer).
pub(crate) fn run(
    gpu: &mut Gpu,
    sk: &mut SelectKernels,
    json: Option<&str>,
    only: Option<&str>,
    check: bool,
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
        rows.extend(bench_spec(gpu, sk, &sh, &host, 29 + b as u64, check)?);
        print!("{}", table(&rows[first..]));
    }
    if let Some(path) = json {
        let body = report::json(&gpu.name()?, &rows);
        std::fs::write(path, body).map_err(|e| AlgoError::Invalid(format!("{path}: {e}")))?;
    }
    Ok(())
}

/// The plain step's rows and the speculative step's for one shape, in one call: the plain ones
/// from [`cold::bench_cold`], then one row per overlap.
pub(crate) fn bench_spec(
    gpu: &mut Gpu,
    sk: &mut SelectKernels,
    sh: &Shape<'_>,
    host: &Host<'_>,
    seed: u64,
    check: bool,
) -> Result<Vec<Row>, AlgoError> {
    let mut out = gpu.zeros::<f32>(sh.b * Q_HEADS * D)?;
    let mut traces = Vec::new();
    let mut rows = if check {
        Vec::new()
    } else {
        cold::bench_cold(gpu, sk, sh, &mut out, &mut Rng::new(seed), &mut traces)?
    };
    // The same layers again (the same generator, so the same tables).
    let quest = &quest_2k(Summary::E4m3)?;
    let (pool, decodes, tables) = cold::layers(gpu, sk, quest, sh, &mut Rng::new(seed))?;
    let mut top = DeviceTopK::new(gpu, quest, sh.b, KV_HEADS, sh.ctx, false)?;
    let tag = format!(" e4m3 {}", sh.tag);
    sk.set_publish(false);
    let wants = {
        let mut step = Step {
            quest,
            q: sh.q,
            kv: sh.kv,
            decode: &decodes[0],
            slots: sh.slots,
            pool: &pool,
            layer: 0,
            top: &mut top,
            out: &mut out,
            tag: &tag,
        };
        cold::wants(gpu, sk, &mut step, &decodes)?
    };
    let cpu = cpu_reference(host, sh, &tables, &wants, top.sel.max_len)?;
    let plain_outs: Vec<Vec<f32>> = wants.iter().map(|w| w.out.clone()).collect();
    let plain = worst_of(&plain_outs, &cpu);
    let width = top.sel.max_len;
    if width > MAX_WIDTH {
        return Err(AlgoError::Invalid(format!(
            "rows of {width} pages; spec_finish stages {MAX_WIDTH}"
        )));
    }
    let k = compile(gpu)?;
    let (hi, lo) = (
        gpu.fork_with_priority(true)?,
        gpu.fork_with_priority(false)?,
    );
    let sk_hi = sk.on_stream(hi.stream().clone());
    let mut sk_pub = sk_hi.clone();
    sk_pub.set_publish(true);
    let n_rows = sh.b * KV_HEADS;
    let most = 2 * width;
    if most > MAX_WIDTH {
        return Err(AlgoError::Invalid(format!(
            "rows of {most} likely pages; spec_finish stages {MAX_WIDTH}"
        )));
    }
    let mut parts = Parts {
        prev_o: gpu.zeros(n_rows * most * 4 * D)?,
        prev_lse: gpu.zeros(n_rows * most * 4)?,
        none: gpu.zeros(1)?,
    };
    let mut outs = (0..COLD_LAYERS)
        .map(|_| gpu.zeros::<f32>(sh.b * Q_HEADS * D))
        .collect::<Result<Vec<_>, _>>()?;
    let mut spec = Spec {
        k: &k,
        sh,
        quest,
        pool: &pool,
        decodes: &decodes,
        hi: &hi,
        lo: &lo,
        sk: &sk_hi,
        top: &mut top,
        parts: &mut parts,
    };
    gpu.synchronize()?;
    let walks = if check {
        vec![WALKS[1], WALKS[10]]
    } else {
        WALKS.to_vec()
    };
    let selected: usize = wants
        .iter()
        .map(|w| w.ids.iter().filter(|&&x| x >= 0).count())
        .sum();
    for walk in walks {
        let mut rng = Rng::new(41);
        let mut prevs = Vec::with_capacity(COLD_LAYERS);
        let mut late = selected;
        if let Walk::Early { share, count } = walk {
            late = 0;
            for want in &wants {
                let (ids, lens, m) = likely(
                    &want.ids,
                    width,
                    count * width,
                    sh.ctx / PS,
                    share,
                    &mut rng,
                );
                late += m;
                prevs.push(DeviceSelection {
                    ids: gpu.upload(&ids)?,
                    lens: gpu.upload(&lens)?,
                    max_len: count * width,
                    rows: n_rows,
                });
            }
        }
        let published = matches!(walk, Walk::Late { published: true });
        spec.sk = if published { &sk_pub } else { &sk_hi };
        // Eager, each layer into its own output, checked against the CPU.
        for (layer, out) in outs.iter_mut().enumerate() {
            spec.step(layer, prevs.get(layer), out)?;
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
        let t = untracked(gpu.context(), hi.stream(), || {
            let stream = hi.stream();
            stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(AttnError::from)?;
            let enqueued = outs
                .iter_mut()
                .enumerate()
                .try_for_each(|(layer, out)| spec.step(layer, prevs.get(layer), out));
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
        })?;
        let graph = worst_diff(gpu, &outs, &cpu)?;
        let what = match walk {
            Walk::Late { published: false } => "pages a warp each after the top-k".to_owned(),
            Walk::Late { published: true } => "pages a warp each from each row's flag".to_owned(),
            Walk::Early { share, count } => {
                format!("{count}x pages holding {:.0}%", share * 100.0)
            }
        };
        rows.push(Row {
            name: format!("spec step 8 layers one graph, {what} {}", sh.tag),
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

impl Spec<'_> {
    /// Enqueues layer `layer`'s step attending into `out`: with `likely` pages, their walk on the
    /// low-priority stream beside the top-k, then the finish; without, the top-k, then the
    /// walk of its selection and the finish.
    fn step(
        &mut self,
        layer: usize,
        likely: Option<&DeviceSelection>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), AlgoError> {
        let decode = &self.decodes[layer];
        let (hi, lo) = (self.hi.stream(), self.lo.stream());
        let event = || Some(CUevent_flags::CU_EVENT_DISABLE_TIMING);
        let walked = match likely {
            Some(prev) => {
                let start = hi.record_event(event()).map_err(AttnError::from)?;
                lo.wait(&start).map_err(AttnError::from)?;
                launch_pages(self.k, lo, None, self.sh, decode, prev, self.parts)?;
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
        match (likely, walked) {
            (Some(prev), Some(walked)) => {
                hi.wait(&walked).map_err(AttnError::from)?;
                launch_finish(self.k, hi, self.sh, decode, self.top, prev, self.parts, out)
            }
            _ => {
                let sel = &self.top.sel;
                let after = Some(self.top.published());
                launch_pages(self.k, hi, after, self.sh, decode, sel, self.parts)?;
                launch_finish(self.k, hi, self.sh, decode, self.top, sel, self.parts, out)
            }
        }
    }
}

fn compile(gpu: &Gpu) -> Result<Kernels, AlgoError> {
    let ctx = gpu.context();
    let (major, minor) = ctx.compute_capability().map_err(AttnError::from)?;
    // NVRTC takes the architecture for the program's life; one compile a process.
    let arch: &'static str = Box::leak(format!("sm_{major}{minor}").into_boxed_str());
    let ptx = attn_op::cuda::compile_source("kernels/spec.cu", SOURCE, arch)?;
    let module = ctx.load_module(ptx).map_err(AttnError::from)?;
    let f = |name: &str| {
        module
            .load_function(name)
            .map_err(|e| AlgoError::from(AttnError::from(e)))
    };
    Ok(Kernels {
        pages: f("spec_pages_bf16_d128")?,
        finish: f("spec_finish_bf16_d128")?,
    })
}

fn int(x: usize) -> Result<i32, AlgoError> {
    i32::try_from(x).map_err(|_| AlgoError::Invalid(format!("{x} does not fit an i32")))
}

/// The softmax scale times log2 e: the kernels' scores are in base 2.
fn scale2() -> f32 {
    AttnParams::new(Q_HEADS, D).scale * std::f32::consts::LOG2_E
}

/// Both kernels' first ten arguments: q, K, V, the decode's metadata and `ints`' first four
/// (max_blocks, num_blocks, kv_heads, q_heads).
fn common_args<'a>(
    l: &mut Launch<'a>,
    sh: &'a Shape<'_>,
    decode: &'a DeviceBatch,
    ints: &'a [i32],
) {
    l.arg(sh.q)
        .arg(sh.kv.k())
        .arg(sh.kv.v())
        .arg(decode.cu_seqlens_q())
        .arg(decode.seq_lens_kv())
        .arg(decode.block_table())
        .arg(&ints[0])
        .arg(&ints[1])
        .arg(&ints[2])
        .arg(&ints[3]);
}

/// `after`: `None` on a stream of its own; else right after the top-k, which published its
/// rows or not.
fn launch_pages(
    k: &Kernels,
    stream: &CudaStream,
    after: Option<Option<Published<'_>>>,
    sh: &Shape<'_>,
    decode: &DeviceBatch,
    prev: &DeviceSelection,
    parts: &mut Parts,
) -> Result<(), AlgoError> {
    let ints = [
        int(decode.max_blocks())?,
        int(sh.layout.num_blocks)?,
        int(KV_HEADS)?,
        int(Q_HEADS)?,
        int(prev.max_len)?,
        i32::from(matches!(after, Some(Some(_)))),
    ];
    let (flags, epoch) = match &after {
        Some(Some(p)) => (p.flags, p.epoch),
        _ => (&parts.none, &parts.none),
    };
    let scale = scale2();
    let cfg = LaunchConfig {
        grid_dim: (
            u32::try_from(prev.max_len.div_ceil(4))
                .map_err(|_| AlgoError::Invalid("grid".into()))?,
            u32::try_from(prev.rows).map_err(|_| AlgoError::Invalid("grid".into()))?,
            1,
        ),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut l = Launch::new(stream, &k.pages);
    l.dependent(after.is_some());
    common_args(&mut l, sh, decode, &ints);
    l.arg(&prev.ids)
        .arg(&prev.lens)
        .arg(&ints[4])
        .arg(&scale)
        .arg(&mut parts.prev_o)
        .arg(&mut parts.prev_lse)
        .arg(flags)
        .arg(epoch)
        .arg(&ints[5]);
    // SAFETY: the arguments follow `spec_pages_bf16_d128` in kernels/spec.cu: bf16 q, K and V of
    // the shape's pool (head dim 128), the decode's metadata, rows of `max_len` page ids and the
    // partials sized for them, and the top-k's flags and step value where it published its
    // rows (one flag a row: a per-head selection); every id and block is range-checked in the
    // kernel.
    unsafe { l.launch(cfg) }?;
    Ok(())
}

#[allow(clippy::too_many_arguments, reason = "a prototype's launch")]
fn launch_finish(
    k: &Kernels,
    stream: &CudaStream,
    sh: &Shape<'_>,
    decode: &DeviceBatch,
    top: &DeviceTopK,
    prev: &DeviceSelection,
    parts: &Parts,
    out: &mut CudaSlice<f32>,
) -> Result<(), AlgoError> {
    let new = &top.sel;
    let ints = [
        int(decode.max_blocks())?,
        int(sh.layout.num_blocks)?,
        int(KV_HEADS)?,
        int(Q_HEADS)?,
        int(new.max_len)?,
        int(prev.max_len)?,
    ];
    let scale = scale2();
    let cfg = LaunchConfig {
        grid_dim: (
            u32::try_from(new.rows).map_err(|_| AlgoError::Invalid("grid".into()))?,
            4,
            1,
        ),
        block_dim: (512, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut l = Launch::new(stream, &k.finish);
    l.dependent(true);
    common_args(&mut l, sh, decode, &ints);
    l.arg(&new.ids)
        .arg(&new.lens)
        .arg(&ints[4])
        .arg(&prev.ids)
        .arg(&prev.lens)
        .arg(&ints[5])
        .arg(&parts.prev_o)
        .arg(&parts.prev_lse)
        .arg(&scale)
        .arg(out);
    // SAFETY: the arguments follow `spec_finish_bf16_d128` in kernels/spec.cu, as for
    // `spec_pages`, with the new selection's rows (at most MAX_WIDTH wide, checked by the
    // caller), the partials `spec_pages` wrote (its stream's event precedes this launch) and
    // the output `[b, q_heads, 128]`. It waits for the top-k (`pdl_wait`) before reading its
    // rows.
    unsafe { l.launch(cfg) }?;
    Ok(())
}

/// Rows of likely pages for the selected rows `ids` (rows of `width`, ascending, -1 padded)
/// over `pages` pages, `count` wide: each keeps its row's last (current) page and `overlap` of
/// the others; the rest of the row, and every place past its pages, gets pages the row lacks.
/// Answers the rows (ascending, `count` wide), their lengths, and how many selected pages they
/// lack.
fn likely(
    ids: &[i32],
    width: usize,
    count: usize,
    pages: usize,
    overlap: f64,
    rng: &mut Rng,
) -> (Vec<i32>, Vec<i32>, usize) {
    let (mut out, mut lens, mut missing) = (Vec::new(), Vec::new(), 0);
    for row in ids.chunks(width) {
        let selected: Vec<i32> = row.iter().copied().filter(|&x| x >= 0).collect();
        let n = selected.len();
        let lack = (n.saturating_sub(1) as f64 * (1.0 - overlap)).round() as usize;
        let dropped = rng.subset(lack, n.saturating_sub(1));
        let mut have: Vec<i32> = selected
            .iter()
            .enumerate()
            .filter(|(i, _)| dropped.binary_search(&(*i as i32)).is_err())
            .map(|(_, &p)| p)
            .collect();
        // Other pages, below the current one, that the selection lacks.
        while have.len() < count.min(pages) {
            let p = rng.range(0, pages - 1) as i32;
            if !selected.contains(&p) && !have.contains(&p) {
                have.push(p);
            }
        }
        have.sort_unstable();
        missing += lack;
        lens.push(have.len() as i32);
        out.extend_from_slice(&have);
        out.resize(out.len() + count - have.len(), -1);
    }
    (out, lens, missing)
}

/// The largest |out - want| over the layers, relative to the largest |want|.
fn worst_diff(gpu: &Gpu, outs: &[CudaSlice<f32>], wants: &[Vec<f32>]) -> Result<f64, AlgoError> {
    let got = outs
        .iter()
        .map(|o| gpu.download(o))
        .collect::<Result<Vec<Vec<f32>>, _>>()?;
    Ok(worst_of(&got, wants))
}

fn worst_of(got: &[Vec<f32>], wants: &[Vec<f32>]) -> f64 {
    let (mut diff, mut scale) = (0.0f64, 0.0f64);
    for (out, want) in got.iter().zip(wants) {
        for (a, b) in out.iter().zip(want) {
            diff = diff.max(f64::from((a - b).abs()));
            scale = scale.max(f64::from(b.abs()));
        }
    }
    if scale > 0.0 { diff / scale } else { diff }
}

/// The host's copies of a shape's inputs: the KV pool and the queries.
pub(crate) struct Host<'a> {
    pub kv: &'a PagedKv<bf16>,
    pub q: &'a [bf16],
}

/// Each layer's attention over its plain step's selection, on the CPU (the specification).
fn cpu_reference(
    host: &Host<'_>,
    sh: &Shape<'_>,
    tables: &[Vec<i32>],
    wants: &[Want],
    width: usize,
) -> Result<Vec<Vec<f32>>, AlgoError> {
    let b = sh.b;
    let cu: Vec<i32> = (0..=b as i32).collect();
    let lens = vec![int(sh.ctx)?; b];
    let params = AttnParams::new(Q_HEADS, D);
    tables
        .iter()
        .zip(wants)
        .map(|(table, want)| {
            let sel_lens: Vec<i32> = want
                .ids
                .chunks(width)
                .map(|r| r.iter().filter(|&&x| x >= 0).count() as i32)
                .collect();
            let meta = BatchMeta {
                cu_seqlens_q: &cu,
                seq_lens_kv: &lens,
                block_table: table,
                max_blocks: sh.ctx / PS,
            };
            let sel = Selection {
                ids: &want.ids,
                lens: &sel_lens,
                max_len: width,
            };
            let mut out = vec![0.0f32; b * Q_HEADS * D];
            sparse_page_attention(
                host.q,
                host.kv,
                &meta,
                &sel,
                &params,
                AttnOut {
                    out: &mut out,
                    lse: None,
                },
            )?;
            Ok(out)
        })
        .collect()
}
