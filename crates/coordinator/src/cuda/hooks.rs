//! The coordinator's layer hooks with the batch's queries, keys and values on the device, and
//! the per-layer work they enqueue.

use std::sync::Arc;

use attn_op::cuda::{CudaElement, DeviceArrays, DeviceBatch, DeviceSelection, Gpu, StageClock};
use attn_op::{BatchMeta, KvCache};
use cudarc::driver::CudaSlice;
use kv_blocks::RequestId;
use offload::Load;
use offload::cuda::{BufRows, DeviceDiff, IoKernels, PinnedHostPool};
use sparse_algo::cuda::{DeviceTopK, SelectKernels};

use super::{
    Backup, DeviceLayer, DeviceLayerPlan, DeviceSparse, Dims, LayerStep, RowsArrays, to_i32,
};
use crate::coord::DecodeRow;
use crate::{CoordError, Mode, Route, SparseCoordinator};

impl<T: CudaElement> SparseCoordinator<T> {
    /// [`attention_begin`](Self::attention_begin) with the sparse layers' decode step on the
    /// GPU: `q` is the batch's queries `[tokens, q_heads, head_dim]`, `k` and `v` the new
    /// tokens' keys and values `[tokens, kv_heads, head_dim]`, all on the device. In a sparse
    /// layer this enqueues on `gpu`'s stream, without waiting for it: the backup of every
    /// sparse-mode request's new tokens to the host pool, and for decode rows the
    /// reserved-slot refresh, the new token, Quest scores and top-k, the diff and the loads.
    /// Run [`DeviceSparse::attend`] for their attention.
    pub fn attention_begin_device(
        &mut self,
        gpu: &Gpu,
        dev: &mut DeviceSparse<T>,
        layer: usize,
        q: &CudaSlice<T>,
        k: &CudaSlice<T>,
        v: &CudaSlice<T>,
    ) -> Result<DeviceLayerPlan, CoordError> {
        self.check_layer_io(layer, Some(q.len()), k.len(), v.len())?;
        self.mark_begun(layer);
        self.check_mirror(dev)?;
        let f = self.forward.as_ref().expect("checked by check_layer_io");
        let mut routes = vec![Route::Dense; f.batch.len()];
        let Some(sl) = self.sparse_of[layer] else {
            return Ok(DeviceLayerPlan { routes, rows: 0 });
        };
        // The layer's last step's buffers, for this one to reuse.
        let last = dev.layers[sl].step.take();
        dev.mark("model")?;
        self.backup_device(gpu, dev, sl, k, v)?;
        let rows = self.decode_rows();
        if rows.is_empty() {
            dev.mark("write")?;
            return Ok(DeviceLayerPlan { routes, rows: 0 });
        }
        let arrays = self.device_rows(gpu, dev, &rows)?;
        let step = dev.begin_layer(gpu, sl, &rows, arrays, q, k, v, last)?;
        dev.layers[sl].step = Some(step);
        for (j, r) in rows.iter().enumerate() {
            routes[r.index] = Route::Sparse(j);
        }
        Ok(DeviceLayerPlan {
            routes,
            rows: rows.len(),
        })
    }

    /// Answers [`CoordError::Invalid`] where `dev` was made for another coordinator.
    pub(super) fn check_mirror(&self, dev: &DeviceSparse<T>) -> Result<(), CoordError> {
        let m = self.model;
        if dev.layers.len() != self.sparse_layers.len()
            || dev.epochs.len() != self.slot_epochs.len()
            || (dev.dims.q_heads, dev.dims.kv_heads, dev.dims.head_dim)
                != (m.q_heads, m.kv_heads, m.head_dim)
        {
            return Err(CoordError::Invalid(
                "a device mirror made for another coordinator".to_owned(),
            ));
        }
        Ok(())
    }

    /// The device arrays of the forward's decode `rows`, after `dev` has taken over the
    /// requests new in their slots.
    pub(super) fn device_rows(
        &self,
        gpu: &Gpu,
        dev: &mut DeviceSparse<T>,
        rows: &[DecodeRow],
    ) -> Result<Arc<RowsArrays>, CoordError> {
        for r in rows {
            if dev.epochs[r.slot] != self.slot_epochs[r.slot] {
                dev.adopt(gpu, self, r.slot)?;
            }
        }
        let manager = self.manager.as_ref().expect("sparse layers have a manager");
        dev.rows_arrays(gpu, rows, &self.slot_epochs, |id| {
            manager.host_pages(id).map(<[u32]>::to_vec)
        })
    }

    /// [`attention_end`](Self::attention_end) for a forward whose sparse layers run on the
    /// device: the device brings the current pages' min/max up to date from the reserved
    /// slots, and prompts completed by this forward get their representations on the CPU
    /// (which waits for `gpu`'s stream to have written their last tokens to the host pool;
    /// they are uploaded when the request first decodes).
    pub fn attention_end_device(
        &mut self,
        gpu: &Gpu,
        dev: &mut DeviceSparse<T>,
        layer: usize,
    ) -> Result<(), CoordError> {
        self.check_layer(layer)?;
        if let Some(sl) = self.sparse_of[layer] {
            dev.mark("model")?;
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
            dev.mark("update")?;
            let (_, complete) = self.ending();
            if !complete.is_empty() {
                gpu.synchronize()?;
                self.build_reps(sl, &complete, false)?;
            }
        }
        self.mark_ended(layer);
        Ok(())
    }

    /// Takes host positions for the new tokens of every sparse-mode request of the forward in
    /// sparse layer `sl` and enqueues their copy from `k` and `v` to the host pool; nothing is
    /// taken when the pool cannot hold them all.
    fn backup_device(
        &mut self,
        gpu: &Gpu,
        dev: &mut DeviceSparse<T>,
        sl: usize,
        k: &CudaSlice<T>,
        v: &CudaSlice<T>,
    ) -> Result<(), CoordError> {
        let f = self.forward.as_ref().expect("a forward is in progress");
        self.check_host_room(sl, &f.batch)?;
        // The device backs the new tokens up here, in the layer's begin.
        self.mark_stored();
        let f = self.forward.as_ref().expect("a forward is in progress");
        let manager = self.manager.as_mut().expect("sparse layers have a manager");
        let (mut src, mut dst) = (Vec::new(), Vec::new());
        for (&(id, n), &off) in f.batch.iter().zip(&f.offsets) {
            if self.trackers[&id].mode == Mode::Sparse {
                for (i, row) in manager.reserve_tokens(id, sl, n)?.into_iter().enumerate() {
                    src.push(to_i32(off + i)?);
                    dst.push(to_i32(row)?);
                }
            }
        }
        if src.is_empty() {
            return Ok(());
        }
        let reuse = dev
            .backup
            .as_ref()
            .is_some_and(|b| b.src == src && b.dst == dst);
        if !reuse {
            dev.backup = Some(Backup {
                src_dev: gpu.upload(&src)?,
                dst_dev: gpu.upload(&dst)?,
                src,
                dst,
            });
        }
        let b = dev.backup.as_ref().expect("set just above");
        dev.io
            .backup_tokens(k, v, &b.src_dev, &dev.host, sl, &b.dst_dev)?;
        Ok(())
    }
}

impl<T: CudaElement> DeviceSparse<T> {
    /// The device arrays of this forward's decode rows, built by its first sparse layer and
    /// reused by the others; `host_pages` answers a request's host pages in logical order
    /// (the new tokens' pages included).
    pub(super) fn rows_arrays(
        &mut self,
        gpu: &Gpu,
        rows: &[DecodeRow],
        epochs: &[u64],
        host_pages: impl Fn(RequestId) -> Result<Vec<u32>, offload::OffloadError>,
    ) -> Result<Arc<RowsArrays>, CoordError> {
        let key: Vec<_> = rows
            .iter()
            .map(|r| (r.id, r.row, r.len, r.slot, epochs[r.slot]))
            .collect();
        if let Some(a) = self.rows.as_ref().filter(|a| a.key == key) {
            return Ok(a.clone());
        }
        let Dims {
            page_size: ps,
            hot,
            max_pages: mp,
            ..
        } = self.dims;
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
        let token_rows: Vec<i32> = rows
            .iter()
            .map(|r| to_i32(r.row))
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
            token_rows: gpu.upload(&token_rows)?,
            new_slots: gpu.upload(&new_slots)?,
        });
        self.rows = Some(arrays.clone());
        Ok(arrays)
    }

    /// Enqueues sparse layer `sl`'s step for `rows` over the forward's `arrays`, reusing the
    /// buffers of its `last` step where they fit.
    #[allow(
        clippy::too_many_arguments,
        reason = "the hook's inputs plus the rows, their arrays and the last step's buffers"
    )]
    pub(super) fn begin_layer(
        &mut self,
        gpu: &Gpu,
        sl: usize,
        rows: &[DecodeRow],
        arrays: Arc<RowsArrays>,
        q: &CudaSlice<T>,
        k: &CudaSlice<T>,
        v: &CudaSlice<T>,
        last: Option<LayerStep<T>>,
    ) -> Result<LayerStep<T>, CoordError> {
        let (last, last_attn) = last.map(|s| (s.sel, (s.per_head, s.attn))).unzip();
        let Dims {
            page_size: ps,
            hot,
            max_pages: mp,
            ..
        } = self.dims;
        let n = rows.len();
        let l = &mut self.layers[sl];
        // Loads a prefetch enqueued on the copy lane come before this step's reads and writes.
        l.wait_prefetch(gpu)?;
        // The reserved slots of this layer: what each lacks of its current page comes from the
        // host, then the new tokens are written into them.
        let mut loads = Vec::new();
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
        }
        self.io.execute_loads(gpu, &self.host, &loads, &mut l.kv)?;
        self.io
            .scatter_tokens(k, v, &arrays.token_rows, &mut l.kv, &arrays.new_slots)?;
        mark(&mut self.clock, "write")?;
        let dims = self.dims;
        let lane = Lane {
            gpu,
            select: &self.select,
            io: &self.io,
        };
        let sel = lane.select_load(
            l,
            &self.host,
            sl,
            rows,
            &arrays,
            q,
            dims,
            &mut self.totals,
            &mut self.clock,
            last,
        )?;
        let host = &mut self.host_totals;
        host.0 += n as u64;
        host.1 += loads.len() as u64;
        host.2 += reserved_tokens;
        let per_head = sel.union.is_some();
        let width = l.quest.row_width();
        // The attention's batch: the last step's where its shape fits (both are made for the
        // same layer and row count), else a new one of zero lengths (within any bound).
        let cols = if per_head { mp } else { width };
        let mut attn = match last_attn
            .filter(|(was, b)| *was == per_head && b.num_seqs() == n && b.max_blocks() == cols)
        {
            Some((_, b)) => b,
            None => {
                let dev_arrays = DeviceArrays {
                    seq_lens_kv: gpu.zeros(n)?,
                    block_table: gpu.zeros(n * cols)?,
                    max_blocks: cols,
                };
                // SAFETY: zero lengths lie within any bound; what is written below keeps
                // to the bound set with it.
                unsafe { DeviceBatch::from_device(gpu, dev_arrays, vec![1; n], 0, &l.kv.layout()) }?
            }
        };
        match &sel.union {
            Some(u) => {
                // Per head: the rows' own lengths, and a block table of each row's union.
                // SAFETY: the lengths are the rows' batch's (`arrays.meta`, validated with
                // their bound on upload, which is set as this batch's bound), and every table
                // entry is -1 or a block of a row's hot buffer, below the layout's block
                // count; the buffers keep their lengths.
                unsafe {
                    let (lens, table) = attn.arrays_mut();
                    self.io.page_table(u, &sel.diff, mp, table)?;
                    gpu.stream()
                        .memcpy_dtod(arrays.meta.seq_lens_kv(), lens)
                        .map_err(driver)?;
                    attn.set_kv_bound(arrays.meta.max_kv_len())?;
                }
            }
            // SAFETY: the lengths this batch is used with are a top-k's covered tokens, at
            // most `width` pages of `ps` tokens (swapped in by `attend`).
            None => unsafe { attn.set_kv_bound(width * ps) }?,
        }
        Ok(LayerStep {
            rows: n,
            sel,
            per_head,
            arrays,
            attn,
            reserved_loads: loads.len() as u64,
            reserved_tokens,
        })
    }
}

/// Marks the end of a stage on `clock`, if one is set.
pub(super) fn mark(clock: &mut Option<StageClock>, label: &'static str) -> Result<(), CoordError> {
    if let Some(c) = clock {
        c.mark(label)?;
    }
    Ok(())
}

/// Kernels launched on one stream, and the device handle that allocates on it: the compute
/// stream's, or the copy lane's of a prefetch.
pub(super) struct Lane<'a> {
    pub(super) gpu: &'a Gpu,
    pub(super) select: &'a SelectKernels,
    pub(super) io: &'a IoKernels,
}

/// A selection's device buffers after its diff and loads.
pub(super) struct Selected<T: CudaElement> {
    /// The decode rows' queries, gathered from the batch's (`None`: the batch's q is exactly
    /// them).
    pub(super) q: Option<CudaSlice<T>>,
    /// Quest's selection, one row per decode row or per (decode row, KV head).
    pub(super) top: DeviceTopK,
    /// For a per-head selection, the union of each row's heads' pages (what was diffed).
    pub(super) union: Option<DeviceSelection>,
    /// The diff against the rows' hot buffers.
    pub(super) diff: DeviceDiff,
}

impl Lane<'_> {
    /// Enqueues on this lane's stream, for the decode `rows` of sparse layer `sl`: Quest's
    /// scores and top-k from `q` (the batch's queries), one selection per row or per (row, KV
    /// head); the diff of each row's pages (the union of its heads' for per-head selections)
    /// against its hot buffer, its counts added to entry `sl` of `totals`; the loads of the
    /// misses from the host pool. Marks `selection`, `diff` and `loads` on `clock`. The
    /// buffers of `last` (an earlier call's on this stream, for this layer) are reused where
    /// they fit: every launch rewrites its outputs whole.
    #[allow(
        clippy::too_many_arguments,
        reason = "a layer's state, the host pool, the rows, their queries, the totals and the \
                  clock"
    )]
    pub(super) fn select_load<T: CudaElement>(
        &self,
        l: &mut DeviceLayer<T>,
        host: &PinnedHostPool<T>,
        sl: usize,
        rows: &[DecodeRow],
        arrays: &RowsArrays,
        q: &CudaSlice<T>,
        dims: Dims,
        totals: &mut CudaSlice<u64>,
        clock: &mut Option<StageClock>,
        last: Option<Selected<T>>,
    ) -> Result<Selected<T>, CoordError> {
        let Dims {
            q_heads,
            kv_heads,
            head_dim,
            page_size: ps,
            hot,
            max_pages: mp,
        } = dims;
        let gpu = self.gpu;
        let qs = q_heads * head_dim;
        let n = rows.len();
        let per_head = !l.quest.config().shared_heads;
        let union_width = kv_heads * l.quest.row_width();
        let (last_q, last_top, last_union, last_diff) = match last {
            Some(s) => (s.q, Some(s.top), s.union, Some(s.diff)),
            None => (None, None, None, None),
        };
        // The rows' queries, gathered unless the batch is exactly them.
        let direct = q.len() == n * qs && rows.iter().enumerate().all(|(j, r)| r.row == j);
        let q_rows = if direct {
            None
        } else {
            let mut g = match last_q.filter(|g| g.len() == n * qs) {
                Some(g) => g,
                None => gpu.zeros::<T>(n * qs)?,
            };
            for (j, r) in rows.iter().enumerate() {
                gpu.stream()
                    .memcpy_dtod(
                        &q.slice(r.row * qs..(r.row + 1) * qs),
                        &mut g.slice_mut(j * qs..(j + 1) * qs),
                    )
                    .map_err(driver)?;
            }
            Some(g)
        };
        // Quest: scores and top-k, one selection per request or per (request, KV head).
        let top_rows = if per_head { n * kv_heads } else { n };
        let mut top = match last_top.filter(|t| t.sel.rows == top_rows) {
            Some(t) => t,
            None => DeviceTopK::new(gpu, &l.quest, n, kv_heads, mp * ps, !per_head)?,
        };
        self.select.quest_topk(
            &l.quest,
            q_rows.as_ref().unwrap_or(q),
            q_heads,
            &arrays.meta,
            0,
            &arrays.slots,
            &l.reps,
            &mut top,
        )?;
        mark(clock, "selection")?;
        // The diff against each request's hot buffer (of the union of its heads' pages, for
        // per-head selections), then the loads of its misses.
        let union = if per_head {
            let w = union_width;
            let mut u = match last_union.filter(|u| u.rows == n) {
                Some(u) => u,
                None => DeviceSelection::from_device(gpu.zeros(n * w)?, gpu.zeros(n)?, w)?,
            };
            self.io.union_heads(&top.sel, kv_heads, mp, &mut u)?;
            Some(u)
        } else {
            None
        };
        let diffed = union.as_ref().unwrap_or(&top.sel);
        let mut diff = match last_diff.filter(|d| d.rows() == n && d.sel_max == diffed.max_len) {
            Some(d) => d,
            None => DeviceDiff::new(gpu, n, diffed.max_len)?,
        };
        self.io.diff_rows(
            &mut l.bufs,
            &arrays.buf_rows,
            diffed,
            &arrays.current,
            &arrays.blocks,
            &mut diff,
        )?;
        self.io.tally(&diff, totals, sl)?;
        mark(clock, "diff")?;
        self.io.load_misses(
            host,
            sl,
            &arrays.host_table,
            mp,
            &arrays.blocks,
            hot,
            &diff,
            &mut l.kv,
        )?;
        mark(clock, "loads")?;
        Ok(Selected {
            q: q_rows,
            top,
            union,
            diff,
        })
    }
}

/// A CUDA driver error as the coordinator's.
pub(super) fn driver(e: impl std::fmt::Debug) -> CoordError {
    CoordError::Attn(attn_op::AttnError::Device(format!("CUDA driver: {e:?}")))
}
