//! The coordinator's device path (feature `cuda`): the sparse layers' decode step on the GPU,
//! driven through the same hooks as the CPU path.
//!
//! A [`DeviceSparse`] mirrors, per sparse layer, what the device needs: the representations
//! (Quest's min/max pages), the hot buffers' KV and LRU state, and the reserved slot of each
//! request's current page. The host pool stays the offload manager's; it is page-locked in
//! place ([`PinnedHostPool::register`]), so the tokens the coordinator appends on the CPU are
//! the bytes the load kernels read. Per layer,
//! [`SparseCoordinator::attention_begin_device`] refreshes reserved slots, writes the new
//! tokens into them, scores and selects (Quest), diffs against the hot buffers, and loads the
//! misses, all enqueued on the GPU's stream without a round trip; [`DeviceSparse::attend`]
//! runs attention over the result, and [`SparseCoordinator::attention_end_device`] backs the
//! tokens up to the host and brings the current pages' min/max up to date on the device. The
//! request lifecycle, host pages and prompt representations stay the CPU coordinator's (they
//! change once per request or page, not per step); a request's representations are uploaded
//! when it first decodes on the device.
//!
//! The device path runs head-shared Quest (one selection per request, as the device diff
//! takes); other algorithms get [`CoordError::Config`]. A coordinator driven through these
//! hooks must use them for every forward: its CPU copies of decode-time representations and
//! hot buffers are not kept.

use std::sync::Arc;

use attn_op::cuda::{CudaElement, DeviceArrays, DeviceBatch, DevicePagedKv, Gpu};
use attn_op::{AttnParams, BatchMeta, Element, KvCache, KvLayout};
use cudarc::driver::CudaSlice;
use kv_blocks::RequestId;
use offload::cuda::{
    BufRows, DeviceDiff, DeviceHotBuffers, IoKernels, MAX_DIFF_SELECTION, PinnedHostPool,
};
use offload::{HotBuffer, Load, StepStats};
use sparse_algo::cuda::{DeviceRepPool, DeviceTopK, SelectKernels};
use sparse_algo::{AlgoConfig, Quest};

use crate::coord::DecodeRow;
use crate::{CoordError, Route, SparseCoordinator};

/// The device half of a [`SparseCoordinator`]'s sparse layers: see the module documentation.
pub struct DeviceSparse<T: CudaElement> {
    select: SelectKernels,
    io: IoKernels,
    host: PinnedHostPool<T>,
    layers: Vec<DeviceLayer<T>>,
    /// Per slot, the coordinator's epoch of the request whose state the device holds.
    epochs: Vec<u64>,
    kv_heads: usize,
    head_dim: usize,
    q_heads: usize,
    page_size: usize,
    hot: usize,
    /// Pages per request (the representation pools' extent).
    max_pages: usize,
    /// The decode-row arrays of the last forward with sparse rows.
    rows: Option<Arc<RowsArrays>>,
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
}

/// The device buffers of one layer's decode step.
struct LayerStep<T: CudaElement> {
    rows: usize,
    /// The decode rows' queries `[rows, q_heads, head_dim]` (`None`: the batch's q is
    /// exactly them).
    q: Option<CudaSlice<T>>,
    top: DeviceTopK,
    diff: DeviceDiff,
    /// The forward's decode-row arrays, shared by its sparse layers.
    arrays: Arc<RowsArrays>,
    /// The batch attention reads: the diff's table and the selection's covered tokens are
    /// swapped in for the launch.
    attn: DeviceBatch,
    /// Loads that refreshed reserved slots, and their tokens.
    reserved_loads: u64,
    reserved_tokens: u64,
}

/// The device arrays of a forward's sparse decode rows. They are the same in every sparse
/// layer, so the forward's first sparse layer builds and uploads them and the others reuse
/// them.
struct RowsArrays {
    /// What they were built for: per row (request, length, slot, the slot's epoch).
    key: Vec<(RequestId, usize, usize, u64)>,
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
    /// [`CoordError::Config`] without sparse layers, for an algorithm other than head-shared
    /// Quest, or for a host layout other than layer-first.
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
                AlgoConfig::Quest(q) if q.shared_heads => {
                    let quest = Quest::new(*q)?;
                    if quest.row_width() > MAX_DIFF_SELECTION {
                        return Err(CoordError::Config(format!(
                            "layer {l}: selections of {} pages; the device diff takes {}",
                            quest.row_width(),
                            MAX_DIFF_SELECTION
                        )));
                    }
                    quests.push(quest);
                }
                other => {
                    return Err(CoordError::Config(format!(
                        "layer {l}: the device path runs head-shared Quest, not {other:?}"
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
                reps: DeviceRepPool::new(gpu, pool.shape(), 1, slots, pool.max_tokens())?,
                quest,
                kv: DevicePagedKv::new(gpu, layout)?,
                bufs: DeviceHotBuffers::upload(gpu, &vec![HotBuffer::new(c.hot_pages); slots])?,
                reserved: vec![(-1, 0); slots],
                step: None,
            });
        }
        Ok(DeviceSparse {
            select: SelectKernels::new(gpu)?,
            io: IoKernels::new(gpu)?,
            host,
            layers,
            epochs: vec![0; slots],
            kv_heads: m.kv_heads,
            head_dim: m.head_dim,
            q_heads: m.q_heads,
            page_size: c.page_size,
            hot: c.hot_pages,
            max_pages,
            rows: None,
        })
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
        let l = self.layer_mut(coord, layer)?;
        let step = l
            .step
            .as_mut()
            .ok_or_else(|| CoordError::Invalid(format!("layer {layer} has no device step")))?;
        let q = step.q.as_ref().unwrap_or(q);
        // SAFETY: `covered` holds each row's selected tokens, at most row_width pages of
        // page_size tokens (the bound `attn` was made with), and the diff's table has the
        // batch's [rows, row_width] shape; both go back where they came from below.
        let (lens, table) = unsafe { step.attn.arrays_mut() };
        std::mem::swap(lens, &mut step.top.covered);
        std::mem::swap(table, &mut step.diff.table);
        let res = gpu.paged_attention(q, &l.kv, &step.attn, params, out, None);
        // SAFETY: as above.
        let (lens, table) = unsafe { step.attn.arrays_mut() };
        std::mem::swap(lens, &mut step.top.covered);
        std::mem::swap(table, &mut step.diff.table);
        Ok(res?)
    }

    /// The selected pages of `layer`'s last step, one row per sparse row (waits for the
    /// stream).
    pub fn selection(
        &self,
        gpu: &Gpu,
        coord: &SparseCoordinator<T>,
        layer: usize,
    ) -> Result<Vec<Vec<i32>>, CoordError> {
        let step = self.step(coord, layer)?;
        let sel = &step.top.sel;
        let (ids, lens) = (gpu.download(&sel.ids)?, gpu.download(&sel.lens)?);
        Ok((0..step.rows)
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
        let d = &step.diff;
        let (hits, misses) = (gpu.download(&d.hit_counts)?, gpu.download(&d.miss_counts)?);
        if let Some(r) = gpu.download(&d.errors)?.iter().position(|&e| e != 0) {
            return Err(CoordError::Invalid(format!(
                "row {r}'s selection did not fit its hot buffer"
            )));
        }
        let sum = |x: &[i32]| {
            x.iter()
                .map(|&v| u64::try_from(v).unwrap_or(0))
                .sum::<u64>()
        };
        let misses = sum(&misses);
        let token_bytes = (2 * self.kv_heads * self.head_dim * size_of::<T>()) as u64;
        Ok(StepStats {
            steps: step.rows as u64,
            hits: sum(&hits),
            misses,
            loaded_pages: misses,
            bytes: (misses * self.page_size as u64 + step.reserved_tokens) * token_bytes,
            reserved_loads: step.reserved_loads,
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

    fn layer_mut(
        &mut self,
        coord: &SparseCoordinator<T>,
        layer: usize,
    ) -> Result<&mut DeviceLayer<T>, CoordError> {
        let sl = sparse_index(coord, layer)?;
        Ok(&mut self.layers[sl])
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
            let pages: Vec<T> = pool
                .pages(0, slot)?
                .iter()
                .map(|&x| T::from_f32(x))
                .collect();
            if !pages.is_empty() {
                let row = self.max_pages * pool.shape().page_len();
                let at = slot * row;
                gpu.stream()
                    .memcpy_htod(
                        &pages,
                        &mut l.reps.data_mut().slice_mut(at..at + pages.len()),
                    )
                    .map_err(|e| attn_op::AttnError::Device(format!("CUDA driver: {e:?}")))?;
            }
        }
        self.epochs[slot] = coord.slot_epochs[slot];
        Ok(())
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

impl<T: CudaElement> SparseCoordinator<T> {
    /// [`attention_begin`](Self::attention_begin) with the sparse layers' decode step on the
    /// GPU: `q` is the batch's queries `[tokens, q_heads, head_dim]` on the device, `k` and
    /// `v` the new tokens' keys and values on the host. Sparse rows are enqueued on `gpu`'s
    /// stream (reserved-slot refresh, new tokens, Quest scores and top-k, diff, loads); run
    /// [`DeviceSparse::attend`] for their attention.
    pub fn attention_begin_device(
        &mut self,
        gpu: &Gpu,
        dev: &mut DeviceSparse<T>,
        layer: usize,
        q: &CudaSlice<T>,
        k: &[T],
        v: &[T],
    ) -> Result<DeviceLayerPlan, CoordError> {
        self.check_layer_io(layer, None, k, v)?;
        let m = self.model;
        let tokens = k.len() / (m.kv_heads * m.head_dim);
        let qs = m.q_heads * m.head_dim;
        if q.len() != tokens * qs {
            return Err(CoordError::Invalid(format!(
                "q of {} elements for {tokens} tokens of {} heads of {}",
                q.len(),
                m.q_heads,
                m.head_dim
            )));
        }
        if dev.layers.len() != self.sparse_layers.len()
            || dev.epochs.len() != self.slot_epochs.len()
            || (dev.q_heads, dev.kv_heads, dev.head_dim) != (m.q_heads, m.kv_heads, m.head_dim)
        {
            return Err(CoordError::Invalid(
                "a device mirror made for another coordinator".to_owned(),
            ));
        }
        let batch = self.forward.as_ref().map_or(0, |f| f.batch.len());
        let mut routes = vec![Route::Dense; batch];
        let Some(sl) = self.sparse_of[layer] else {
            return Ok(DeviceLayerPlan { routes, rows: 0 });
        };
        let rows = self.decode_rows();
        dev.layers[sl].step = None;
        if rows.is_empty() {
            return Ok(DeviceLayerPlan { routes, rows: 0 });
        }
        for r in &rows {
            if dev.epochs[r.slot] != self.slot_epochs[r.slot] {
                dev.adopt(gpu, self, r.slot)?;
            }
        }
        let manager = self.manager.as_ref().expect("sparse layers have a manager");
        let arrays = dev.rows_arrays(gpu, &rows, &self.slot_epochs, |id| {
            manager.host_pages(id).map(<[u32]>::to_vec)
        })?;
        let step = dev.begin_layer(gpu, sl, &rows, arrays, q, k, v)?;
        dev.layers[sl].step = Some(step);
        for (j, r) in rows.iter().enumerate() {
            routes[r.index] = Route::Sparse(j);
        }
        Ok(DeviceLayerPlan {
            routes,
            rows: rows.len(),
        })
    }

    /// [`attention_end`](Self::attention_end) for a forward whose sparse layers run on the
    /// device: the new tokens go to the host pool (the bytes the device loads from), prompts
    /// completed by this forward get their representations (uploaded when they first decode),
    /// and the device updates the current pages' min/max from the reserved slots.
    pub fn attention_end_device(
        &mut self,
        dev: &mut DeviceSparse<T>,
        layer: usize,
        k: &[T],
        v: &[T],
    ) -> Result<(), CoordError> {
        self.end_layer(layer, k, v, false)?;
        if let Some(sl) = self.sparse_of[layer] {
            let DeviceLayer {
                quest,
                reps,
                kv,
                step,
                ..
            } = &mut dev.layers[sl];
            if let Some(step) = step.as_ref() {
                let a = &step.arrays;
                dev.select
                    .update_minmax(quest, kv, &a.meta, 0, &a.slots, reps)?;
            }
        }
        Ok(())
    }
}

impl<T: CudaElement> DeviceSparse<T> {
    /// The device arrays of this forward's decode rows, built by its first sparse layer and
    /// reused by the others; `host_pages` answers a request's host pages in logical order.
    fn rows_arrays(
        &mut self,
        gpu: &Gpu,
        rows: &[DecodeRow],
        epochs: &[u64],
        host_pages: impl Fn(RequestId) -> Result<Vec<u32>, offload::OffloadError>,
    ) -> Result<Arc<RowsArrays>, CoordError> {
        let key: Vec<_> = rows
            .iter()
            .map(|r| (r.id, r.len, r.slot, epochs[r.slot]))
            .collect();
        if let Some(a) = self.rows.as_ref().filter(|a| a.key == key) {
            return Ok(a.clone());
        }
        let (ps, hot, mp) = (self.page_size, self.hot, self.max_pages);
        let n = rows.len();
        let mut current_host = Vec::with_capacity(n);
        let mut new_slots = Vec::with_capacity(n);
        let mut lens = Vec::with_capacity(n);
        let mut current = Vec::with_capacity(n);
        let mut table = Vec::with_capacity(n * mp);
        let mut host_table = Vec::with_capacity(n * mp);
        let mut blocks = Vec::with_capacity(n * (hot + 1));
        for r in rows {
            let total = r.len + 1;
            if total > mp * ps {
                return Err(CoordError::Invalid(format!(
                    "{:?}: {total} tokens exceed the device's {} per request",
                    r.id,
                    mp * ps
                )));
            }
            let cur = r.len / ps;
            let pages = host_pages(r.id)?;
            let base = r.slot * (hot + 1);
            current_host.push(pages.get(cur).copied());
            new_slots.push(to_i32((base + hot) * ps + total - cur * ps - 1)?);
            lens.push(to_i32(total)?);
            current.push(to_i32(cur)?);
            table.extend(std::iter::repeat_n(to_i32(base + hot)?, mp));
            host_table.extend((0..mp).map(|i| pages.get(i).map_or(-1, |&p| p as i32)));
            for b in base..=base + hot {
                blocks.push(to_i32(b)?);
            }
        }
        let layout = self.layers[0].kv.layout();
        let cu: Vec<i32> = (0..=n).map(to_i32).collect::<Result<_, _>>()?;
        let slots: Vec<i32> = rows
            .iter()
            .map(|r| to_i32(r.slot))
            .collect::<Result<_, _>>()?;
        let buf_rows: Vec<usize> = rows.iter().map(|r| r.slot).collect();
        let arrays = Arc::new(RowsArrays {
            key,
            current_host,
            meta: DeviceBatch::upload(
                gpu,
                &BatchMeta {
                    cu_seqlens_q: &cu,
                    seq_lens_kv: &lens,
                    block_table: &table,
                    max_blocks: mp,
                },
                &layout,
            )?,
            slots: gpu.upload(&slots)?,
            current: gpu.upload(&current)?,
            blocks: gpu.upload(&blocks)?,
            host_table: gpu.upload(&host_table)?,
            buf_rows: BufRows::upload(gpu, &buf_rows, self.layers[0].bufs.rows)?,
            new_slots: gpu.upload(&new_slots)?,
        });
        self.rows = Some(arrays.clone());
        Ok(arrays)
    }

    /// Enqueues sparse layer `sl`'s step for `rows` over the forward's `arrays`.
    #[allow(
        clippy::too_many_arguments,
        reason = "the hook's inputs plus the rows and their arrays"
    )]
    fn begin_layer(
        &mut self,
        gpu: &Gpu,
        sl: usize,
        rows: &[DecodeRow],
        arrays: Arc<RowsArrays>,
        q: &CudaSlice<T>,
        k: &[T],
        v: &[T],
    ) -> Result<LayerStep<T>, CoordError> {
        let (ps, hot, mp) = (self.page_size, self.hot, self.max_pages);
        let kvs = self.kv_heads * self.head_dim;
        let qs = self.q_heads * self.head_dim;
        let n = rows.len();
        let l = &mut self.layers[sl];
        // The reserved slots of this layer: what each lacks of its current page comes from the
        // host, then the new tokens are written into them.
        let mut loads = Vec::new();
        let (mut new_k, mut new_v) = (Vec::with_capacity(n * kvs), Vec::with_capacity(n * kvs));
        let mut reserved_tokens = 0u64;
        for (r, &host_page) in rows.iter().zip(&arrays.current_host) {
            let cur = r.len / ps;
            let (valid, on_host) = (r.len + 1 - cur * ps, r.len - cur * ps);
            let res = &mut l.reserved[r.slot];
            if res.0 != cur as i32 {
                *res = (cur as i32, 0);
            }
            if res.1 < on_host {
                let page = host_page.ok_or_else(|| {
                    CoordError::Invalid(format!("{:?} has no host page {cur}", r.id))
                })?;
                loads.push(Load {
                    layer: sl,
                    host_page: page,
                    first: res.1 as u32,
                    tokens: (on_host - res.1) as u32,
                    device_block: (r.slot * (hot + 1) + hot) as u32,
                });
                reserved_tokens += (on_host - res.1) as u64;
            }
            res.1 = valid;
            new_k.extend_from_slice(&k[r.row * kvs..(r.row + 1) * kvs]);
            new_v.extend_from_slice(&v[r.row * kvs..(r.row + 1) * kvs]);
        }
        self.io.execute_loads(gpu, &self.host, &loads, &mut l.kv)?;
        l.kv.set_kv(
            &arrays.new_slots,
            &gpu.upload(&new_k)?,
            &gpu.upload(&new_v)?,
        )?;
        // The rows' queries, gathered unless the batch is exactly them.
        let direct = q.len() == n * qs && rows.iter().enumerate().all(|(j, r)| r.row == j);
        let q_rows = if direct {
            None
        } else {
            let mut g = gpu.zeros::<T>(n * qs)?;
            for (j, r) in rows.iter().enumerate() {
                gpu.stream()
                    .memcpy_dtod(
                        &q.slice(r.row * qs..(r.row + 1) * qs),
                        &mut g.slice_mut(j * qs..(j + 1) * qs),
                    )
                    .map_err(|e| attn_op::AttnError::Device(format!("CUDA driver: {e:?}")))?;
            }
            Some(g)
        };
        // Quest: scores and top-k, one selection per request.
        let mut top = DeviceTopK::new(gpu, &l.quest, n, self.kv_heads, mp * ps, true)?;
        self.select.quest_topk(
            &l.quest,
            q_rows.as_ref().unwrap_or(q),
            self.q_heads,
            &arrays.meta,
            0,
            &arrays.slots,
            &l.reps,
            &mut top,
        )?;
        // The diff against each request's hot buffer, then the loads of its misses.
        let width = l.quest.row_width();
        let mut diff = DeviceDiff::new(gpu, n, width)?;
        self.io.diff_rows(
            &mut l.bufs,
            &arrays.buf_rows,
            &top.sel,
            &arrays.current,
            &arrays.blocks,
            &mut diff,
        )?;
        self.io.load_misses(
            &self.host,
            sl,
            &arrays.host_table,
            mp,
            &arrays.blocks,
            hot,
            &diff,
            &mut l.kv,
        )?;
        let dev_arrays = DeviceArrays {
            seq_lens_kv: gpu.zeros(n)?,
            block_table: gpu.zeros(n * width)?,
            max_blocks: width,
        };
        // SAFETY: the lengths this batch is used with are a top-k's covered tokens, at most
        // `width` pages of `ps` tokens, the bound given here (zeros until then).
        let attn = unsafe {
            DeviceBatch::from_device(gpu, dev_arrays, vec![1; n], width * ps, &l.kv.layout())
        }?;
        Ok(LayerStep {
            rows: n,
            q: q_rows,
            top,
            diff,
            arrays,
            attn,
            reserved_loads: loads.len() as u64,
            reserved_tokens,
        })
    }
}

fn to_i32(x: usize) -> Result<i32, CoordError> {
    i32::try_from(x).map_err(|_| CoordError::Invalid(format!("{x} does not fit an i32")))
}
