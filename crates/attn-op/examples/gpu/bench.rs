//! Device benchmarks: copy bandwidth, dense paged decode, sparse page-list decode (with a copy
//! of the same bytes beside it at the acceptance shapes) and the device gather, timed with CUDA
//! events after warm-up (median of many runs).

use attn_op::cuda::{DeviceBatch, DevicePagedKv, DeviceSelection, Gpu, Timing};
use attn_op::{AttnError, AttnParams, BatchMeta, KvLayout, Selection};
use cudarc::driver::CudaSlice;
use cudarc::driver::sys::CUevent_flags;
use half::bf16;

use crate::Rng;
use crate::report::{self, Row, random_bf16, table};
use crate::trace;

const Q_HEADS: usize = 32;
const KV_HEADS: usize = 8;
const D: usize = 128;
const BS: usize = 16;
/// The sparse budget: 128 pages of 16 tokens per (sequence, KV head).
const BUDGET_PAGES: usize = 128;
/// Blocks of the shared pool: 512K tokens, 1 GiB of K and V in bf16.
const POOL_BLOCKS: usize = 32 * 1024;
const RUNS: usize = 50;
/// Selections the sparse rows rotate through: 16 of B1's 8 MiB each (128 MiB) are more than
/// the 50 MiB L2 holds, so a run finds few of its pages there, as a decode's layers would.
/// (With four, B1's 32 MiB stayed in L2 between runs.)
const SELECTIONS: usize = 16;

/// Runs every benchmark, prints the table and writes it as JSON when asked.
pub(crate) fn all(gpu: &mut Gpu, json: Option<&str>, profile: bool) -> Result<(), AttnError> {
    let mut rows = Vec::new();
    let copy = copy_bandwidth(gpu)?;
    rows.push(Row {
        name: "copy d2d 1 GiB".to_owned(),
        t: copy.0,
        bytes: copy.1,
        note: "read + write".to_owned(),
    });
    let bw = copy.1 / copy.0.synced * 1e3;

    let layout = KvLayout {
        num_blocks: POOL_BLOCKS,
        block_size: BS,
        kv_heads: KV_HEADS,
        head_dim: D,
    };
    let (k, v) = (random_bf16(layout.len(), 1), random_bf16(layout.len(), 2));
    let kv = DevicePagedKv::from_host(gpu, layout, &k, &v)?;
    drop((k, v));
    let params = AttnParams::new(Q_HEADS, D);
    let mut rng = Rng::new(7);
    let mut sweep = Vec::new();
    let mut traces = Vec::new();

    // The acceptance shapes first (the ncu launch counts in run.sh assume it), then the
    // report's context sweep at batch 1, then larger batches, whose sparse steps read 4 and
    // 8 times B8's bytes (the pool holds their contexts whole): how the sparse step's time
    // over its bytes floor falls as the launch's fixed costs spread over more bytes.
    let shapes = [
        (8usize, 32usize),
        (1, 128),
        (1, 4),
        (1, 8),
        (1, 16),
        (1, 32),
        (1, 64),
        (32, 16),
        (64, 8),
    ];
    for (i, &(b, k)) in shapes.iter().enumerate() {
        let ctx = k * 1024;
        let acceptance = i < 2;
        let blocks = ctx / BS;
        // Each sequence owns a random set of the pool's blocks.
        let perm = rng.permutation(POOL_BLOCKS);
        let table: Vec<i32> = (0..b * blocks).map(|i| perm[i] as i32).collect();
        let cu: Vec<i32> = (0..=b as i32).collect();
        let lens = vec![ctx as i32; b];
        let meta = BatchMeta {
            cu_seqlens_q: &cu,
            seq_lens_kv: &lens,
            block_table: &table,
            max_blocks: blocks,
        };
        let dmeta = DeviceBatch::upload(gpu, &meta, &layout)?;
        let q = gpu.upload(&random_bf16(b * Q_HEADS * D, 3))?;
        let mut out = gpu.zeros::<f32>(b * Q_HEADS * D)?;
        let mut lse = gpu.zeros::<f32>(b * Q_HEADS)?;
        let kv_bytes = (b * ctx * KV_HEADS * D * 2 * 2) as f64;
        // Sparse: SELECTIONS rotating selections of BUDGET_PAGES pages (the last page always).
        let sels = rotating_selections(gpu, &mut rng, b, blocks, 1)?;
        let sel_bytes = (b * KV_HEADS * BUDGET_PAGES * BS * D * 2 * 2) as f64;
        let floor = sel_bytes / bw * 1e3;
        let step = Step {
            q: &q,
            kv: &kv,
            meta: &dmeta,
            params: &params,
            sels: &sels,
        };
        let g = &*gpu;
        let (dense, sparse) = step.time_pair(g, &mut out, &mut lse)?;
        rows.push(Row {
            name: format!("dense decode B{b} L{}K", ctx / 1024),
            t: dense,
            bytes: kv_bytes,
            note: format!(
                "{:.2} / {:.2} of copy bw",
                kv_bytes / dense.synced * 1e3 / bw,
                kv_bytes / dense.queued * 1e3 / bw
            ),
        });
        rows.push(Row {
            name: format!("sparse decode 2K B{b} L{}K", ctx / 1024),
            t: sparse,
            bytes: sel_bytes,
            note: format!(
                "{:.2} / {:.2} x bytes floor ({floor:.4} ms)",
                sparse.synced / floor,
                sparse.queued / floor
            ),
        });
        // The larger batches also get the copy and the shared lists (not the sweep).
        if !acceptance && b < 32 {
            continue;
        }
        // The device copy of as many bytes (read + write) as the sparse step reads: what
        // one launch of that size costs at the copy's own rate, launch and tail included.
        let t = copy_rotating(gpu, sel_bytes as usize / 8, 4)?;
        rows.push(Row {
            name: format!("copy d2d {} MiB B{b}", (sel_bytes as usize / 2) >> 20),
            t,
            bytes: sel_bytes,
            note: format!(
                "{:.2} / {:.2} x bytes floor: a launch of the sparse step's bytes",
                t.synced / floor,
                t.queued / floor
            ),
        });
        // The same budget with one page list per sequence, shared by its KV heads: the CTAs
        // of a split's heads then read the same blocks, as dense decode's do.
        let shared = rotating_selections(gpu, &mut rng, b, blocks, KV_HEADS)?;
        let shared_step = Step {
            sels: &shared,
            ..step
        };
        let (_, t) = shared_step.time_pair(g, &mut out, &mut lse)?;
        rows.push(Row {
            name: format!("sparse decode 2K shared B{b} L{}K", ctx / 1024),
            t,
            bytes: sel_bytes,
            note: format!(
                "{:.2} / {:.2} x bytes floor; one page list per sequence",
                t.synced / floor,
                t.queued / floor
            ),
        });
        if !acceptance {
            continue;
        }
        let mut i = 0;
        let t = time(g, || {
            i += 1;
            g.gather_page_offsets(&sels[i % sels.len()], BS, &dmeta)
                .map(drop)
        })?;
        rows.push(Row {
            name: format!("gather pages B{b} L{}K", ctx / 1024),
            t,
            bytes: 0.0,
            note: "device gather_page_offsets".to_owned(),
        });
        if profile {
            continue;
        }
        let shape = format!("B{b} L{}K", ctx / 1024);
        for kind in [Kind::Dense, Kind::Sparse] {
            traces.extend(step.trace(gpu, kind, &shape, &mut out, &mut lse)?);
        }
        // The sweep: kernel variants and wave targets, then shorter and longer splits than
        // the default (128 keys at least: more or fewer CTAs, each walking fewer or more tiles,
        // with more or fewer partials to merge); defaults restored after.
        let line = |what: String, dense: Timing, sparse: Timing| {
            format!(
                "sweep B{b} L{}K {what}: dense {:.4} ms ({:.2} of copy), sparse {:.4} ms ({:.2} \
                 x floor); queued {:.4} / {:.4} ms",
                ctx / 1024,
                dense.synced,
                kv_bytes / dense.synced * 1e3 / bw,
                sparse.synced,
                sparse.synced / floor,
                dense.queued,
                sparse.queued,
            )
        };
        for variant in ["tc", "tc2", "r4", "r4_u4", "r4_u4p", "r4_u1p"] {
            for waves in [1, 2, 4] {
                gpu.set_variant(Some(variant))?;
                gpu.set_waves(waves);
                let (dense, sparse) = step.time_pair(gpu, &mut out, &mut lse)?;
                sweep.push(line(format!("{variant:<6} waves {waves}"), dense, sparse));
            }
        }
        gpu.set_variant(None)?;
        gpu.set_waves(1);
        for min_chunk in [64, 256, 512] {
            gpu.set_min_chunk(min_chunk);
            let (dense, sparse) = step.time_pair(gpu, &mut out, &mut lse)?;
            sweep.push(line(format!("tc     chunk >= {min_chunk}"), dense, sparse));
        }
        gpu.set_min_chunk(128);
    }
    for line in &sweep {
        println!("{line}");
    }
    for t in &traces {
        print!("{t}");
    }

    print!("{}", table(&rows));
    if let Some(path) = json {
        let body = report::json(&gpu.name()?, &rows);
        std::fs::write(path, body).map_err(|e| AttnError::Device(format!("{path}: {e}")))?;
    }
    Ok(())
}

/// The inputs of one decode shape: queries, cache, metadata and the sparse selections.
struct Step<'a> {
    q: &'a CudaSlice<bf16>,
    kv: &'a DevicePagedKv<bf16>,
    meta: &'a DeviceBatch,
    params: &'a AttnParams,
    sels: &'a [DeviceSelection],
}

/// Dense decode or sparse decode over a step's selections.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Dense,
    Sparse,
}

impl Step<'_> {
    /// Launches dense decode, or sparse decode over selection `i` (modulo their count).
    fn launch(
        &self,
        g: &Gpu,
        kind: Kind,
        i: usize,
        out: &mut CudaSlice<f32>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<(), AttnError> {
        match kind {
            Kind::Dense => {
                g.paged_attention(self.q, self.kv, self.meta, self.params, out, Some(lse))
            }
            Kind::Sparse => {
                let sel = &self.sels[i % self.sels.len()];
                g.sparse_page_attention(
                    self.q,
                    self.kv,
                    self.meta,
                    sel,
                    self.params,
                    out,
                    Some(lse),
                )
            }
        }
    }

    /// Median times of dense decode and of sparse decode (rotating the selections), in ms.
    fn time_pair(
        &self,
        g: &Gpu,
        out: &mut CudaSlice<f32>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<(Timing, Timing), AttnError> {
        let dense = time(g, || self.launch(g, Kind::Dense, 0, out, lse))?;
        let mut i = 0;
        let sparse = time(g, || {
            i += 1;
            self.launch(g, Kind::Sparse, i, out, lse)
        })?;
        Ok((dense, sparse))
    }

    /// Reports of one launch of `kind` through the traced kernel: alone (after a wait for the
    /// device), then right behind an untraced launch of the same work, as one layer's
    /// attention follows another's.
    fn trace(
        &self,
        gpu: &mut Gpu,
        kind: Kind,
        shape: &str,
        out: &mut CudaSlice<f32>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<Vec<String>, AttnError> {
        let mut reports = Vec::new();
        for behind in [false, true] {
            gpu.set_variant(None)?;
            gpu.take_attn_trace()?;
            let event = || {
                gpu.context()
                    .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(AttnError::from)
            };
            let (a, b) = (event()?, event()?);
            if behind {
                self.launch(gpu, kind, 1, out, lse)?;
            }
            gpu.set_variant(Some("tct"))?;
            a.record(gpu.stream())?;
            self.launch(gpu, kind, 2, out, lse)?;
            b.record(gpu.stream())?;
            b.synchronize()?;
            let ms = f64::from(a.elapsed_ms(&b)?);
            let records = gpu.take_attn_trace()?;
            let name = format!(
                "{kind:?} {shape}{}",
                if behind {
                    ", behind another launch"
                } else {
                    ", alone"
                }
            );
            reports.push(trace::report(&name, &records, ms));
        }
        gpu.set_variant(None)?;
        Ok(reports)
    }
}

/// `RUNS` timed runs of `f` (see [`Timing`]).
fn time(gpu: &Gpu, f: impl FnMut() -> Result<(), AttnError>) -> Result<Timing, AttnError> {
    gpu.time(RUNS, f)
}

/// Device-to-device copy of 1 GiB: (timing, bytes read + written).
fn copy_bandwidth(gpu: &Gpu) -> Result<(Timing, f64), AttnError> {
    let n = 1 << 28;
    Ok((copy_rotating(gpu, n, 1)?, (n * 4 * 2) as f64))
}

/// Times device copies of `n` u32 (`8 n` bytes read + written), rotating over `pairs` buffer
/// pairs. For the sparse rows' copies (four pairs): at B8 (4 x 64 MiB) the 50 MiB L2 cache
/// holds none of a copy's source; at B1 the pairs (32 MiB) fit in it, which can only make the
/// copy faster than one from memory.
fn copy_rotating(gpu: &Gpu, n: usize, pairs: usize) -> Result<Timing, AttnError> {
    let mut bufs = (0..pairs)
        .map(|_| Ok((gpu.zeros::<u32>(n)?, gpu.zeros::<u32>(n)?)))
        .collect::<Result<Vec<(CudaSlice<u32>, CudaSlice<u32>)>, AttnError>>()?;
    let stream = gpu.stream().clone();
    let mut i = 0;
    time(gpu, || {
        i += 1;
        let (src, dst) = &mut bufs[i % pairs];
        Ok(stream.memcpy_dtod(src, dst)?)
    })
}

/// [`SELECTIONS`] selections of [`budget_pages`] on the device, for the bench to rotate through.
fn rotating_selections(
    gpu: &Gpu,
    rng: &mut Rng,
    b: usize,
    blocks: usize,
    alike: usize,
) -> Result<Vec<DeviceSelection>, AttnError> {
    (0..SELECTIONS)
        .map(|_| {
            let (ids, lens) = budget_pages(rng, b, blocks, alike);
            let s = Selection {
                ids: &ids,
                lens: &lens,
                max_len: BUDGET_PAGES,
            };
            DeviceSelection::upload(gpu, &s, b * KV_HEADS)
        })
        .collect()
}

/// Per (sequence, KV head) `BUDGET_PAGES` distinct logical pages, the last page always; each
/// run of `alike` consecutive KV heads shares one list (1: every head has its own).
fn budget_pages(rng: &mut Rng, b: usize, blocks: usize, alike: usize) -> (Vec<i32>, Vec<i32>) {
    let rows = b * KV_HEADS;
    let mut ids = Vec::with_capacity(rows * BUDGET_PAGES);
    for _ in 0..rows / alike {
        let mut pick: Vec<usize> = rng.permutation(blocks - 1)[..BUDGET_PAGES - 1].to_vec();
        pick.push(blocks - 1);
        pick.sort_unstable();
        for _ in 0..alike {
            ids.extend(pick.iter().map(|&p| p as i32));
        }
    }
    (ids, vec![BUDGET_PAGES as i32; rows])
}
