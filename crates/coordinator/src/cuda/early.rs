//! Prefetch on the device: a later layer's selection, diff and loads on a copy stream of
//! their own, enqueued while an earlier layer computes.

use attn_op::cuda::{CudaElement, Gpu};
use cudarc::driver::CudaSlice;
use cudarc::driver::sys::CUevent_flags;
use offload::StepStats;

use super::hooks::{Lane, driver};
use super::{CopyLane, DeviceSparse, EarlyStep, diff_counts, sparse_index};
use crate::{CoordError, SparseCoordinator};

impl<T: CudaElement> SparseCoordinator<T> {
    /// [`prefetch`](Self::prefetch) on the device: before layer `layer`'s
    /// [`attention_begin_device`](Self::attention_begin_device) in the forward in progress,
    /// enqueues on `dev`'s copy stream the selection its Quest would make with `q` (`[tokens,
    /// q_heads, head_dim]` on the device, an estimate of the layer's queries), the diff of
    /// each decode row's pages (the union of its KV heads' for per-head selections) against
    /// its hot buffer, and the loads of the misses. The copy stream starts after the work
    /// enqueued on `gpu`'s stream so far (which wrote `q`), and the layer's own step waits for
    /// its loads. Nothing waits on the host: the work runs under whatever `gpu`'s stream does
    /// meanwhile, the rest of an earlier layer say.
    ///
    /// Answers whether anything was enqueued: a dense layer, or a batch without decode rows,
    /// loads nothing. A layer whose step has begun (or ended) gets [`CoordError::Invalid`].
    /// [`DeviceSparse::prefetch_stats`] counts what was loaded.
    pub fn prefetch_device(
        &mut self,
        gpu: &Gpu,
        dev: &mut DeviceSparse<T>,
        layer: usize,
        q: CudaSlice<T>,
    ) -> Result<bool, CoordError> {
        self.check_mirror(dev)?;
        let Some((sl, rows)) = self.prefetch_rows(layer, q.len())? else {
            return Ok(false);
        };
        let arrays = self.device_rows(gpu, dev, &rows)?;
        let event = || {
            gpu.context()
                .new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(driver)
        };
        if dev.lane.is_none() {
            let lane = gpu.fork()?;
            dev.lane = Some(CopyLane {
                select: dev.select.on_stream(lane.stream().clone()),
                io: dev.io.on_stream(lane.stream().clone()),
                gpu: lane,
                start: event()?,
            });
        }
        let lane = dev.lane.as_ref().expect("made just above");
        let l = &mut dev.layers[sl];
        // An earlier prefetch the layer's step never waited for: the compute stream frees
        // that prefetch's queries and arrays below, so it waits for its work first.
        l.wait_prefetch(gpu)?;
        let last = l.early.take().map(|e| e.selected);
        // The copy stream starts after the compute stream's work so far: q, the rows' arrays,
        // and the layer's last update of its representations and hot buffers.
        lane.start.record(gpu.stream()).map_err(driver)?;
        lane.gpu.stream().wait(&lane.start).map_err(driver)?;
        let selected = Lane {
            gpu: &lane.gpu,
            select: &lane.select,
            io: &lane.io,
        }
        .select_load(
            l,
            &dev.host,
            sl,
            &rows,
            &arrays,
            &q,
            dev.dims,
            &mut dev.early_totals,
            &mut None,
            last,
        )?;
        let done = match l.done.take() {
            Some(done) => done,
            None => event()?,
        };
        done.record(lane.gpu.stream()).map_err(driver)?;
        l.done = Some(done);
        l.pending = true;
        l.early = Some(EarlyStep {
            _q: q,
            _arrays: arrays,
            selected,
        });
        Ok(true)
    }
}

impl<T: CudaElement> DeviceSparse<T> {
    /// What every prefetch so far loaded, over every sparse layer (waits for the copy
    /// stream; zero before the first), counted as
    /// [`prefetch_stats`](Self::prefetch_stats) counts one.
    pub fn prefetch_totals(&self) -> Result<StepStats, CoordError> {
        let Some(lane) = self.lane.as_ref() else {
            return Ok(StepStats::default());
        };
        let (hits, misses) = super::sum_totals(&lane.gpu.download(&self.early_totals)?)?;
        Ok(self.early_stats(hits, misses))
    }

    /// What the last [`SparseCoordinator::prefetch_device`] of `layer` loaded (waits for the
    /// copy stream): `hits` are the pages the hot buffers held already, `misses` and
    /// `loaded_pages` the pages loaded early, `steps` is 0 (as
    /// [`SparseKvCacheManager::prefetch`](offload::SparseKvCacheManager::prefetch) counts).
    /// Answers [`CoordError::Invalid`] where the layer has had no prefetch.
    pub fn prefetch_stats(
        &self,
        coord: &SparseCoordinator<T>,
        layer: usize,
    ) -> Result<StepStats, CoordError> {
        let sl = sparse_index(coord, layer)?;
        let (Some(early), Some(lane)) = (self.layers[sl].early.as_ref(), self.lane.as_ref()) else {
            return Err(CoordError::Invalid(format!(
                "layer {layer} has had no prefetch"
            )));
        };
        let (hits, misses) = diff_counts(&lane.gpu, &early.selected.diff)?;
        Ok(self.early_stats(hits, misses))
    }

    /// A prefetch's counts as [`SparseKvCacheManager::prefetch`](offload::SparseKvCacheManager::prefetch)
    /// answers them: no steps, every miss a whole page loaded.
    fn early_stats(&self, hits: u64, misses: u64) -> StepStats {
        StepStats {
            steps: 0,
            hits,
            misses,
            loaded_pages: misses,
            bytes: misses * self.dims.page_size as u64 * self.token_bytes(),
            reserved_loads: 0,
            reused_plans: 0,
        }
    }
}
