//! The coordinator's device path (feature `cuda`): the sparse layers' decode step on the GPU,
//! driven through the same hooks as the CPU path.
//!
//! A [`DeviceSparse`] mirrors, per sparse layer, what the device needs: the representations
//! (Quest's min/max pages), the hot buffers' KV and LRU state, and the reserved slot of each
//! request's current page. The host pool stays the offload manager's; it is page-locked in
//! place ([`PinnedHostPool::register`]), so what the device writes there is what the CPU
//! coordinator reads and the other way round. The batch's queries, keys and values stay on
//! the device. Per layer, [`SparseCoordinator::attention_begin_device`] takes host positions
//! for the new tokens (CPU bookkeeping only) and enqueues their backup to the host pool, then
//! for decode rows refreshes reserved slots, writes the new tokens into them, scores and
//! selects (Quest), diffs against the hot buffers and loads the misses;
//! [`DeviceSparse::attend`] runs attention over the result, and
//! [`SparseCoordinator::attention_end_device`] brings the current pages' min/max up to date.
//! Nothing waits for the stream, except the end of a layer in a forward that completes a
//! prompt: its representations are built on the CPU from the host pool (they change once
//! per request or page, not per step) and uploaded when the request first decodes.
//!
//! The device path runs Quest; other algorithms get [`CoordError::Config`]. As on the CPU, a
//! request has one hot buffer per layer: with a selection per KV head, the diff takes the
//! union of the heads' pages, and attention reads each head's own pages through the request's
//! block table. A coordinator driven through these hooks must use them for every forward:
//! its CPU copies of decode-time representations and hot buffers are not kept. Host pool
//! bytes the device writes are complete once the stream has drained ([`Gpu::synchronize`]);
//! read them through the offload manager only then.
//!
//! [`SparseCoordinator::prefetch_device`] is the CPU `prefetch` on the device: before a
//! layer's step, from estimated queries, it enqueues the layer's selection, diff and loads on
//! a copy stream of the mirror's own, ordered against the compute stream by events, so the
//! loads run under an earlier layer's compute and the step finds them as hits.
//!
//! A [`StageClock`] given to [`DeviceSparse::set_clock`] splits the device time of the hooks
//! into stages: `write` (host backup, reserved slots, new tokens), `selection`, `diff`,
//! `loads`, `attention`, `update` (min/max), and `model`, the time between hooks.

mod early;
mod hooks;

use hooks::Selected;

use std::sync::Arc;

use attn_op::cuda::{CudaElement, DeviceBatch, DevicePagedKv, Gpu, StageClock};
use attn_op::{AttnParams, Element, KvCache, KvLayout};
use cudarc::driver::{CudaEvent, CudaSlice};
use kv_blocks::RequestId;
use offload::cuda::{
    BufRows, DeviceDiff, DeviceHotBuffers, IoKernels, MAX_DIFF_SELECTION, PinnedHostPool,
};
use offload::{HotBuffer, StepStats};
use sparse_algo::cuda::{DeviceRepPool, QuestScoring, SelectKernels};
use sparse_algo::summary;
use sparse_algo::{AlgoConfig, Quest};

use crate::{CoordError, Route, SparseCoordinator};

/// The device half of a [`SparseCoordinator`]'s sparse layers: see the module documentation.
pub struct DeviceSparse<T: CudaElement> {
    select: SelectKernels,
    io: IoKernels,
    host: PinnedHostPool<T>,
    layers: Vec<DeviceLayer<T>>,
    /// Per slot, the coordinator's epoch of the request whose state the device holds.
    epochs: Vec<u64>,
    dims: Dims,
    /// The stream prefetches run on, made by the first one.
    lane: Option<CopyLane>,
    /// `[sparse layers, 3]`: per layer, the hits, misses and rows that did not fit of every
    /// decode step's diff so far, added up on the device (`IoKernels::tally`).
    totals: CudaSlice<u64>,
    /// The same for the prefetches' diffs (written on the copy lane).
    early_totals: CudaSlice<u64>,
    /// What the host knows of the decode steps so far: their rows, the loads that refreshed
    /// reserved slots and those loads' tokens.
    host_totals: (u64, u64, u64),
    /// The decode-row arrays of the last forward with sparse rows.
    rows: Option<Arc<RowsArrays>>,
    /// The token and host rows of the last host backup.
    backup: Option<Backup>,
    /// Where stage boundaries are marked, if anywhere.
    clock: Option<StageClock>,
}

/// The model's and the hot buffers' sizes the device path works with.
#[derive(Clone, Copy, Debug)]
struct Dims {
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    page_size: usize,
    /// Hot-buffer pages per request and layer.
    hot: usize,
    /// Pages per request (the representation pools' extent).
    max_pages: usize,
}

/// A stream of its own for prefetches, and the kernels launched on it.
struct CopyLane {
    gpu: Gpu,
    select: SelectKernels,
    io: IoKernels,
    /// Recorded on the compute stream before each prefetch, which the lane waits for.
    start: CudaEvent,
}

/// The index lists of a host backup: batch token rows and the host rows they go to.
struct Backup {
    src: Vec<i32>,
    dst: Vec<i32>,
    src_dev: CudaSlice<i32>,
    dst_dev: CudaSlice<i32>,
}

/// One sparse layer on the device.
struct DeviceLayer<T: CudaElement> {
    quest: Quest,
    reps: DeviceRepPool<T>,
    /// `max_requests * (hot + 1)` blocks: slot `s` owns blocks `s * (hot + 1)..`, the last its
    /// reserved block.
    kv: DevicePagedKv<T>,
    bufs: DeviceHotBuffers,
    /// Per slot: the page in the reserved block (-1: none) and its valid tokens there.
    reserved: Vec<(i32, usize)>,
    /// What the last [`SparseCoordinator::attention_begin_device`] left for attention and
    /// the end of the layer.
    step: Option<LayerStep<T>>,
    /// The last prefetch's buffers (its queries, selection and diff), kept until the next
    /// one: the copy lane may still read them, and [`DeviceSparse::prefetch_stats`] counts
    /// from them.
    early: Option<EarlyStep<T>>,
    /// Recorded on the copy lane after each prefetch's loads (made by the first prefetch).
    done: Option<CudaEvent>,
    /// Whether the compute stream has yet to wait for `done`.
    pending: bool,
}

impl<T: CudaElement> DeviceLayer<T> {
    /// Makes `gpu`'s stream wait for the loads of the layer's last prefetch, where it has
    /// not waited for them yet.
    fn wait_prefetch(&mut self, gpu: &Gpu) -> Result<(), CoordError> {
        if std::mem::take(&mut self.pending)
            && let Some(done) = &self.done
        {
            gpu.stream().wait(done).map_err(hooks::driver)?;
        }
        Ok(())
    }
}

/// The device buffers of a prefetch.
struct EarlyStep<T: CudaElement> {
    /// The estimated queries it selected with, as given.
    _q: CudaSlice<T>,
    /// The rows' arrays it read.
    _arrays: Arc<RowsArrays>,
    /// Its selection, gathered queries and diff.
    selected: Selected<T>,
}

/// The device buffers of one layer's decode step.
struct LayerStep<T: CudaElement> {
    rows: usize,
    /// The rows' gathered queries, selection, union and diff (reused by the layer's next
    /// step where its rows are as many).
    sel: Selected<T>,
    /// Whether the selection is one per (row, KV head); the diff then took their union per
    /// row, and `attn`'s block table maps each row's pages.
    per_head: bool,
    /// The forward's decode-row arrays, shared by its sparse layers.
    arrays: Arc<RowsArrays>,
    /// The batch attention reads. Head-shared: the diff's table and the selection's covered
    /// tokens are swapped in for the launch; per head: the rows' lengths and block tables.
    attn: DeviceBatch,
    /// Loads that refreshed reserved slots, and their tokens.
    reserved_loads: u64,
    reserved_tokens: u64,
}

/// The device arrays of a forward's sparse decode rows. They are the same in every sparse
/// layer, so the forward's first sparse layer builds and uploads them and the others reuse
/// them.
struct RowsArrays {
    /// What they were built for: per row (request, token row, length, slot, the slot's
    /// epoch).
    key: Vec<(RequestId, usize, usize, usize, u64)>,
    /// Per row, the host page of its current page (`None`: not on the host yet).
    current_host: Vec<Option<u32>>,
    /// The decode batch over the hot buffers' KV: one query per row, lengths after the new
    /// token, every table entry the row's reserved block (only the current page is read).
    meta: DeviceBatch,
    /// Representation slots of the rows (also their hot-buffer rows, `buf_rows`).
    slots: CudaSlice<i32>,
    buf_rows: BufRows,
    /// `[rows]`: each row's current page.
    current: CudaSlice<i32>,
    /// `[rows, hot + 1]`: the device block of each of a row's slots.
    blocks: CudaSlice<i32>,
    /// `[rows, max_pages]`: each row's host pages, -1 padded.
    host_table: CudaSlice<i32>,
    /// `[rows]`: each row's token row in the batch's K and V.
    token_rows: CudaSlice<i32>,
    /// `[rows]`: the device slot of each row's new token.
    new_slots: CudaSlice<i32>,
}

/// What [`SparseCoordinator::attention_begin_device`] decided for one layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceLayerPlan {
    /// Per request of the batch, in batch order; [`Route::Sparse`]`(j)` is row `j` of
    /// [`DeviceSparse::attend`]'s output.
    pub routes: Vec<Route>,
    /// Sparse rows (requests attending over the hot buffers).
    pub rows: usize,
}

impl<T: CudaElement> DeviceSparse<T> {
    /// The device mirror of `coord`'s sparse layers: kernels compiled for `gpu`, the host pool
    /// registered in place, zeroed representations and hot buffers. Answers
    /// [`CoordError::Config`] without sparse layers, for an algorithm other than Quest, for
    /// selections wider than the device diff takes, or for a host layout other than
    /// layer-first.
    pub fn new(gpu: &Gpu, coord: &SparseCoordinator<T>) -> Result<Self, CoordError> {
        let manager = coord
            .manager()
            .ok_or_else(|| CoordError::Config("no sparse layers to run on the device".into()))?;
        let c = manager.config();
        let m = coord.model;
        let mut quests = Vec::new();
        for &l in &coord.sparse_layers {
            let p = coord.lowered.layers[l]
                .as_ref()
                .expect("a sparse layer has parameters");
            match &p.config {
                AlgoConfig::Quest(q) => {
                    let quest = Quest::new(*q)?;
                    let width = diff_width(&quest, m.kv_heads);
                    if width > MAX_DIFF_SELECTION {
                        return Err(CoordError::Config(format!(
                            "layer {l}: selections of {width} pages; the device diff takes \
                             {MAX_DIFF_SELECTION}"
                        )));
                    }
                    quests.push(quest);
                }
                other => {
                    return Err(CoordError::Config(format!(
                        "layer {l}: the device path runs Quest, not {other:?}"
                    )));
                }
            }
        }
        let host = PinnedHostPool::register(gpu, manager.host())?;
        let slots = coord.slot_epochs.len();
        let layout = KvLayout {
            num_blocks: slots * (c.hot_pages + 1),
            block_size: c.page_size,
            kv_heads: m.kv_heads,
            head_dim: m.head_dim,
        };
        let mut layers = Vec::with_capacity(quests.len());
        let mut max_pages = 0;
        for (sl, quest) in quests.into_iter().enumerate() {
            let pool = &coord.pools[sl];
            max_pages = pool.max_tokens() / c.page_size;
            layers.push(DeviceLayer {
                reps: DeviceRepPool::with_summary(
                    gpu,
                    pool.shape(),
                    1,
                    slots,
                    pool.max_tokens(),
                    quest.config().summary,
                )?,
                quest,
                kv: DevicePagedKv::new(gpu, layout)?,
                bufs: DeviceHotBuffers::upload(gpu, &vec![HotBuffer::new(c.hot_pages); slots])?,
                reserved: vec![(-1, 0); slots],
                step: None,
                early: None,
                done: None,
                pending: false,
            });
        }
        let n_layers = layers.len();
        Ok(DeviceSparse {
            select: SelectKernels::new(gpu)?,
            io: IoKernels::new(gpu)?,
            host,
            layers,
            epochs: vec![0; slots],
            dims: Dims {
                q_heads: m.q_heads,
                kv_heads: m.kv_heads,
                head_dim: m.head_dim,
                page_size: c.page_size,
                hot: c.hot_pages,
                max_pages,
            },
            lane: None,
            totals: gpu.zeros(3 * n_layers)?,
            early_totals: gpu.zeros(3 * n_layers)?,
            host_totals: (0, 0, 0),
            rows: None,
            backup: None,
            clock: None,
        })
    }

    /// How the sparse layers' Quest scores pages from now on (see [`QuestScoring`]: exact by
    /// default, so selections equal the CPU coordinator's; tensor cores are faster and equal
    /// up to near ties).
    pub fn set_quest_scoring(&mut self, scoring: QuestScoring) {
        self.select.set_quest_scoring(scoring);
        if let Some(lane) = self.lane.as_mut() {
            lane.select.set_quest_scoring(scoring);
        }
    }

    /// Sets (or, with `None`, removes) the clock the hooks mark their stages on, and answers
    /// the one set before.
    pub fn set_clock(&mut self, clock: Option<StageClock>) -> Option<StageClock> {
        std::mem::replace(&mut self.clock, clock)
    }

    /// The clock the hooks mark their stages on.
    pub fn clock_mut(&mut self) -> Option<&mut StageClock> {
        self.clock.as_mut()
    }

    fn mark(&mut self, label: &'static str) -> Result<(), CoordError> {
        hooks::mark(&mut self.clock, label)
    }

    /// Attention of the sparse rows of `layer`'s last
    /// [`attention_begin_device`](SparseCoordinator::attention_begin_device) over the hot
    /// buffers: `q` is the batch's queries as given there, `out` `[rows, q_heads, head_dim]`.
    pub fn attend(
        &mut self,
        gpu: &Gpu,
        coord: &SparseCoordinator<T>,
        layer: usize,
        q: &CudaSlice<T>,
        params: &AttnParams,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CoordError> {
        let sl = sparse_index(coord, layer)?;
        self.mark("model")?;
        let l = &mut self.layers[sl];
        let step = l
            .step
            .as_mut()
            .ok_or_else(|| CoordError::Invalid(format!("layer {layer} has no device step")))?;
        let q = step.sel.q.as_ref().unwrap_or(q);
        if step.per_head {
            // Each KV head's own pages, through the request's block table of the union.
            gpu.sparse_page_attention(q, &l.kv, &step.attn, &step.sel.top.sel, params, out, None)?;
            return self.mark("attention");
        }
        // SAFETY: `covered` holds each row's selected tokens, at most row_width pages of
        // page_size tokens (the bound `attn` was made with), and the diff's table has the
        // batch's [rows, row_width] shape; both go back where they came from below.
        let (lens, table) = unsafe { step.attn.arrays_mut() };
        std::mem::swap(lens, &mut step.sel.top.covered);
        std::mem::swap(table, &mut step.sel.diff.table);
        let res = gpu.paged_attention(q, &l.kv, &step.attn, params, out, None);
        // SAFETY: as above.
        let (lens, table) = unsafe { step.attn.arrays_mut() };
        std::mem::swap(lens, &mut step.sel.top.covered);
        std::mem::swap(table, &mut step.sel.diff.table);
        res?;
        self.mark("attention")
    }

    /// The selected pages of `layer`'s last step, one row per sparse row, or per (sparse
    /// row, KV head) for a per-head Quest (waits for the stream).
    pub fn selection(
        &self,
        gpu: &Gpu,
        coord: &SparseCoordinator<T>,
        layer: usize,
    ) -> Result<Vec<Vec<i32>>, CoordError> {
        let step = self.step(coord, layer)?;
        let sel = &step.sel.top.sel;
        let (ids, lens) = (gpu.download(&sel.ids)?, gpu.download(&sel.lens)?);
        Ok((0..sel.rows)
            .map(|r| {
                let len = usize::try_from(lens[r]).unwrap_or(0).min(sel.max_len);
                ids[r * sel.max_len..r * sel.max_len + len].to_vec()
            })
            .collect())
    }

    /// Hits, misses and bytes of `layer`'s last step (waits for the stream). Answers
    /// [`CoordError::Invalid`] where a row's selection did not fit its hot buffer.
    pub fn stats(
        &self,
        gpu: &Gpu,
        coord: &SparseCoordinator<T>,
        layer: usize,
    ) -> Result<StepStats, CoordError> {
        let step = self.step(coord, layer)?;
        let (hits, misses) = diff_counts(gpu, &step.sel.diff)?;
        Ok(StepStats {
            steps: step.rows as u64,
            hits,
            misses,
            loaded_pages: misses,
            bytes: (misses * self.dims.page_size as u64 + step.reserved_tokens)
                * self.token_bytes(),
            reserved_loads: step.reserved_loads,
            reused_plans: 0,
        })
    }

    /// Bytes of one token's keys and values in a layer.
    fn token_bytes(&self) -> u64 {
        (2 * self.dims.kv_heads * self.dims.head_dim * size_of::<T>()) as u64
    }

    /// Hits, misses and bytes of every decode step of every sparse layer so far (waits for
    /// the stream): one download of counts the device adds up after each diff, where
    /// [`stats`](Self::stats) reads one layer's last step. Answers [`CoordError::Invalid`]
    /// where a row's selection did not fit its hot buffer in any step.
    pub fn totals(&self, gpu: &Gpu) -> Result<StepStats, CoordError> {
        let (hits, misses) = sum_totals(&gpu.download(&self.totals)?)?;
        let (steps, reserved_loads, reserved_tokens) = self.host_totals;
        Ok(StepStats {
            steps,
            hits,
            misses,
            loaded_pages: misses,
            bytes: (misses * self.dims.page_size as u64 + reserved_tokens) * self.token_bytes(),
            reserved_loads,
            reused_plans: 0,
        })
    }

    /// Device bytes of the mirror: representations and hot-buffer KV of every sparse layer.
    pub fn device_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| l.reps.bytes() + 2 * l.kv.layout().len() * size_of::<T>())
            .sum()
    }

    fn step(
        &self,
        coord: &SparseCoordinator<T>,
        layer: usize,
    ) -> Result<&LayerStep<T>, CoordError> {
        let sl = sparse_index(coord, layer)?;
        self.layers[sl]
            .step
            .as_ref()
            .ok_or_else(|| CoordError::Invalid(format!("layer {layer} has no device step")))
    }

    /// Takes over a request that is new in `slot`: empty hot buffers and reserved slots, and
    /// its representations uploaded from the CPU coordinator (built there after its prompt).
    fn adopt(
        &mut self,
        gpu: &Gpu,
        coord: &SparseCoordinator<T>,
        slot: usize,
    ) -> Result<(), CoordError> {
        for (sl, l) in self.layers.iter_mut().enumerate() {
            l.bufs.reset_row(gpu, slot)?;
            l.reserved[slot] = (-1, 0);
            let pool = &coord.pools[sl];
            let values = pool.pages(0, slot)?;
            if values.is_empty() {
                continue;
            }
            let driver = |e| attn_op::AttnError::Device(format!("CUDA driver: {e:?}"));
            let at = slot * self.dims.max_pages * pool.shape().page_len();
            let width = pool.shape().width;
            if let Some((codes, exps)) = l.reps.e4m3_mut() {
                // The CPU pool holds the rounded values; the device keeps their codes.
                let mut bytes = vec![0u8; values.len()];
                let scales: Vec<i8> = values
                    .chunks(width)
                    .zip(bytes.chunks_mut(width))
                    .map(|(row, out)| {
                        i8::try_from(summary::encode_row(row, out))
                            .expect("scale exponents lie in SCALE_EXP_MIN..=SCALE_EXP_MAX")
                    })
                    .collect();
                let stream = gpu.stream();
                stream
                    .memcpy_htod(&bytes, &mut codes.slice_mut(at..at + bytes.len()))
                    .map_err(driver)?;
                let rows = at / width..at / width + scales.len();
                stream
                    .memcpy_htod(&scales, &mut exps.slice_mut(rows))
                    .map_err(driver)?;
            } else {
                let pages: Vec<T> = values.iter().map(|&x| T::from_f32(x)).collect();
                gpu.stream()
                    .memcpy_htod(
                        &pages,
                        &mut l.reps.data_mut().slice_mut(at..at + pages.len()),
                    )
                    .map_err(driver)?;
            }
        }
        self.epochs[slot] = coord.slot_epochs[slot];
        Ok(())
    }
}

/// Hits and misses over the rows of `diff` (waits for `gpu`'s stream, which must be the one
/// that wrote it). Answers [`CoordError::Invalid`] where a row's selection did not fit its
/// hot buffer.
fn diff_counts(gpu: &Gpu, diff: &DeviceDiff) -> Result<(u64, u64), CoordError> {
    let (hits, misses) = (
        gpu.download(&diff.hit_counts)?,
        gpu.download(&diff.miss_counts)?,
    );
    if let Some(r) = gpu.download(&diff.errors)?.iter().position(|&e| e != 0) {
        return Err(CoordError::Invalid(format!(
            "row {r}'s selection did not fit its hot buffer"
        )));
    }
    let sum = |x: &[i32]| {
        x.iter()
            .map(|&v| u64::try_from(v).unwrap_or(0))
            .sum::<u64>()
    };
    Ok((sum(&hits), sum(&misses)))
}

/// Hits and misses summed over `[entries, 3]` totals (`IoKernels::tally`); answers
/// [`CoordError::Invalid`] where a row's selection did not fit.
fn sum_totals(totals: &[u64]) -> Result<(u64, u64), CoordError> {
    let (mut hits, mut misses, mut unfit) = (0, 0, 0);
    for t in totals.chunks_exact(3) {
        hits += t[0];
        misses += t[1];
        unfit += t[2];
    }
    if unfit > 0 {
        return Err(CoordError::Invalid(format!(
            "{unfit} rows' selections did not fit their hot buffers"
        )));
    }
    Ok((hits, misses))
}

/// The widest row the hot-buffer diff of `quest` takes: a head-shared selection, or the union
/// of `kv_heads` per-head selections.
fn diff_width(quest: &Quest, kv_heads: usize) -> usize {
    if quest.config().shared_heads {
        quest.row_width()
    } else {
        kv_heads * quest.row_width()
    }
}

/// The index of `layer` among `coord`'s sparse layers.
fn sparse_index<T: Element>(
    coord: &SparseCoordinator<T>,
    layer: usize,
) -> Result<usize, CoordError> {
    coord
        .sparse_of
        .get(layer)
        .copied()
        .flatten()
        .ok_or_else(|| CoordError::Invalid(format!("layer {layer} is not a sparse layer")))
}

fn to_i32(x: usize) -> Result<i32, CoordError> {
    i32::try_from(x).map_err(|_| CoordError::Invalid(format!("{x} does not fit an i32")))
}
