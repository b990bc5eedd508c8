//! The SparseCoordinator and its hooks.

mod checks;
mod select;

use std::sync::Arc;

use attn_op::{Element, KvCache, PagedKv};
use kv_blocks::RequestId;
use offload::{HostAlloc, OffloadConfig, SparseKvCacheManager, StepStats};
use rustc_hash::FxHashMap;
use sparse_algo::{RepPool, TopK};

use crate::adaptor::{AttentionMeta, BackendAdaptor, MetaRow, PageTableAdaptor, TokenAdaptor};
use crate::{CoordError, Lowered, Mode, ModelShape, Phase, RequestTracker, SparseConfig};
pub(crate) use select::head_union;

/// Drives hierarchical sparse attention through an engine's forward passes: see the crate
/// documentation for the order of the hooks.
pub struct SparseCoordinator<T: Element> {
    pub(crate) model: ModelShape,
    pub(crate) lowered: Lowered,
    /// Model layer → index among the sparse layers, and back.
    pub(crate) sparse_of: Vec<Option<usize>>,
    pub(crate) sparse_layers: Vec<usize>,
    /// The hierarchical KV of sparse-mode requests (absent when every layer is dense).
    pub(crate) manager: Option<SparseKvCacheManager<T>>,
    /// Representations per sparse layer: one pool layer, one slot per sparse-mode request.
    pub(crate) pools: Vec<RepPool>,
    free_slots: Vec<usize>,
    /// Per representation slot, how many requests have taken it (a device mirror compares
    /// them to see a new request in a slot).
    pub(crate) slot_epochs: Vec<u64>,
    pub(crate) trackers: FxHashMap<RequestId, RequestTracker>,
    adaptor: Box<dyn BackendAdaptor>,
    pub(crate) forward: Option<Forward>,
}

/// Sizes of the memory a coordinator manages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacity {
    /// Sparse-mode requests at once (device hot buffers and representation slots).
    pub max_requests: usize,
    /// Longest sequence, prompt and generation.
    pub max_tokens: usize,
    /// Pages of the host pool.
    pub host_pages: usize,
    /// Who picks host pages: the manager, or the caller (kv-blocks' host tier).
    pub host_alloc: HostAlloc,
}

/// How one request of the batch attends in one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// Densely, over the engine's own device KV (dense requests and layers, and prefill).
    Dense,
    /// Over the device hot buffer, through row `i` of [`LayerPlan::meta`].
    Sparse(usize),
}

/// What [`SparseCoordinator::attention_begin`] decided for one layer.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerPlan {
    /// Per request of the batch, in batch order.
    pub routes: Vec<Route>,
    /// Attention metadata of the sparse rows over [`SparseCoordinator::device`].
    pub meta: Option<AttentionMeta>,
    /// What the algorithm selected for the sparse rows, in logical ids.
    pub selection: Option<TopK>,
    /// Hits, misses and bytes of the layer's steps.
    pub stats: StepStats,
}

/// A sparse-mode decode request of the forward in progress.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DecodeRow {
    /// Index in the batch.
    pub(crate) index: usize,
    pub(crate) id: RequestId,
    /// Its token row in the batch's q/k/v.
    pub(crate) row: usize,
    /// Tokens before this step's.
    pub(crate) len: usize,
    /// Representation slot.
    pub(crate) slot: usize,
}

/// A sparse-mode request and its representation slot.
pub(crate) type SlotOf = (RequestId, usize);

/// The batch of the forward in progress.
pub(crate) struct Forward {
    pub(crate) batch: Vec<(RequestId, usize)>,
    /// First token row of each request in the batch's q/k/v.
    pub(crate) offsets: Vec<usize>,
    pub(crate) tokens: usize,
    ended: Vec<bool>,
    /// Per layer, whether its step has begun (a prefetch must come before).
    begun: Vec<bool>,
    /// Whether a sparse layer's step has begun: the decode rows' hot buffers may have changed.
    pub(crate) stepped: bool,
    /// Whether a sparse layer has begun to store the new tokens: the sparse-mode requests'
    /// host backups and representations may have changed.
    pub(crate) stored: bool,
}

impl<T: Element> SparseCoordinator<T> {
    /// Lowers `config` and builds the coordinator.
    pub fn from_config(
        model: ModelShape,
        config: &SparseConfig,
        capacity: Capacity,
    ) -> Result<Self, CoordError> {
        Self::new(model, config.lower(model, None)?, capacity)
    }

    /// A coordinator for lowered parameters, with the adaptor the granularity asks for (pages
    /// of one token: [`TokenAdaptor`]; else [`PageTableAdaptor`]).
    pub fn new(
        model: ModelShape,
        lowered: Lowered,
        capacity: Capacity,
    ) -> Result<Self, CoordError> {
        model.validate()?;
        if lowered.layers.len() != model.layers {
            return Err(CoordError::Config(format!(
                "parameters of {} layers for a model of {}",
                lowered.layers.len(),
                model.layers
            )));
        }
        let mut sparse_of = Vec::with_capacity(model.layers);
        let mut sparse_layers = Vec::new();
        let mut pools = Vec::new();
        for (layer, p) in lowered.layers.iter().enumerate() {
            sparse_of.push(p.as_ref().map(|_| pools.len()));
            if let Some(p) = p {
                sparse_layers.push(layer);
                let shape = p.algo.rep_shape(model.kv_heads, model.head_dim);
                pools.push(RepPool::with_elem(
                    shape,
                    p.algo.rep_elem(T::DTYPE),
                    1,
                    capacity.max_requests,
                    capacity.max_tokens,
                )?);
            }
        }
        let manager = if pools.is_empty() {
            None
        } else {
            Some(SparseKvCacheManager::new(OffloadConfig {
                page_size: lowered.page_size,
                hot_pages: lowered.hot_pages,
                layers: pools.len(),
                kv_heads: model.kv_heads,
                head_dim: model.head_dim,
                host_pages: capacity.host_pages,
                max_requests: capacity.max_requests,
                layout: lowered.host_layout,
                host_alloc: capacity.host_alloc,
            })?)
        };
        let adaptor: Box<dyn BackendAdaptor> = if lowered.page_size == 1 {
            Box::new(TokenAdaptor)
        } else {
            Box::new(PageTableAdaptor)
        };
        Ok(SparseCoordinator {
            model,
            lowered,
            sparse_of,
            sparse_layers,
            manager,
            pools,
            free_slots: (0..capacity.max_requests).rev().collect(),
            slot_epochs: vec![0; capacity.max_requests],
            trackers: FxHashMap::default(),
            adaptor,
            forward: None,
        })
    }

    /// Replaces the backend adaptor.
    pub fn with_adaptor(mut self, adaptor: Box<dyn BackendAdaptor>) -> Self {
        self.adaptor = adaptor;
        self
    }

    /// The lowered parameters.
    pub fn lowered(&self) -> &Lowered {
        &self.lowered
    }

    /// A request's tracker.
    pub fn tracker(&self, id: RequestId) -> Option<&RequestTracker> {
        self.trackers.get(&id)
    }

    /// The offload manager (absent when every layer is dense).
    pub fn manager(&self) -> Option<&SparseKvCacheManager<T>> {
        self.manager.as_ref()
    }

    /// The device pool that [`LayerPlan::meta`] of `layer` addresses; `None` for a dense layer.
    pub fn device(&self, layer: usize) -> Option<Arc<parking_lot::RwLock<PagedKv<T>>>> {
        let sl = (*self.sparse_of.get(layer)?)?;
        Some(self.manager.as_ref()?.device(sl))
    }

    /// Device bytes a sparse-mode request holds: see [`Lowered::sparse_device_bytes`].
    pub fn sparse_device_bytes(&self, tokens: usize) -> usize {
        self.lowered
            .sparse_device_bytes(self.model, size_of::<T>(), tokens)
    }

    /// Starts a request: sparse mode if some layer is sparse and the prompt holds at least
    /// [`Lowered::min_prompt_tokens`], dense otherwise.
    pub fn on_request_begin(
        &mut self,
        id: RequestId,
        prompt_len: usize,
    ) -> Result<Mode, CoordError> {
        self.check_new(id, prompt_len)?;
        let mode = self.mode_for(prompt_len);
        let slot = match mode {
            Mode::Dense => None,
            Mode::Sparse => {
                let slot = self.take_slot()?;
                if let Err(e) = self.manager_mut().begin_request(id) {
                    self.free_slots.push(slot);
                    return Err(e.into());
                }
                Some(slot)
            }
        };
        self.trackers.insert(
            id,
            RequestTracker {
                prompt_len,
                len: 0,
                mode,
                phase: Phase::Prefill,
                slot,
                reused_tokens: 0,
                represented: false,
            },
        );
        Ok(mode)
    }

    /// Starts a sparse-mode request whose first `reused_tokens` tokens already lie, every
    /// layer, in the host pool pages `host_pages` (kv-blocks' host-tier blocks of a cached
    /// prefix; [`HostAlloc::External`]). Nothing is recomputed or copied: the representations
    /// are built from the host pool, and the request decodes from there, its remaining prompt
    /// tokens one per forward.
    pub fn on_request_begin_with_prefix(
        &mut self,
        id: RequestId,
        prompt_len: usize,
        host_pages: &[u32],
        reused_tokens: usize,
    ) -> Result<Mode, CoordError> {
        self.check_new(id, prompt_len)?;
        if self.mode_for(prompt_len) != Mode::Sparse {
            return Err(CoordError::Invalid(format!(
                "a prompt of {prompt_len} tokens runs densely; its prefix belongs on the device"
            )));
        }
        if reused_tokens == 0 || reused_tokens >= prompt_len {
            return Err(CoordError::Invalid(format!(
                "{reused_tokens} reused tokens of a {prompt_len}-token prompt (the last one is \
                 always computed)"
            )));
        }
        let slot = self.take_slot()?;
        if let Err(e) = self
            .manager_mut()
            .begin_request_with_prefix(id, host_pages, reused_tokens)
        {
            self.free_slots.push(slot);
            return Err(e.into());
        }
        let built =
            (0..self.pools.len()).try_for_each(|sl| self.build_reps(sl, &[(id, slot)], false));
        if let Err(e) = built {
            self.manager_mut()
                .end_request(id)
                .expect("begun just above, so it is live");
            self.free_slots.push(slot);
            return Err(e);
        }
        self.trackers.insert(
            id,
            RequestTracker {
                prompt_len,
                len: reused_tokens,
                mode: Mode::Sparse,
                phase: Phase::Decode,
                slot: Some(slot),
                reused_tokens,
                represented: true,
            },
        );
        Ok(Mode::Sparse)
    }

    /// Advances a request's prefill by the next `n` prompt tokens whose KV the engine already
    /// holds (a prefix kv-blocks reused on the device): no forward runs for them. In sparse
    /// mode, `kv(layer)` gives each sparse layer's K and V of those tokens
    /// (`[n, kv_heads, head_dim]` each) to back up to the host pool; representations are built
    /// with the rest of the prompt. At least the last prompt token must stay to be computed.
    /// When the host pool is too small nothing changes; K or V of the wrong size is an error
    /// that leaves the earlier sparse layers backed up (end the request then).
    pub fn on_prefix_cached(
        &mut self,
        id: RequestId,
        n: usize,
        mut kv: impl FnMut(usize) -> (Vec<T>, Vec<T>),
    ) -> Result<(), CoordError> {
        let t = *self.tracked(id)?;
        if self.forward.is_some() {
            return Err(CoordError::Invalid("a forward is in progress".into()));
        }
        if t.phase != Phase::Prefill || t.len.saturating_add(n) >= t.prompt_len {
            return Err(CoordError::Invalid(format!(
                "{id:?} ({:?}, {} of {} prompt tokens) cannot skip {n} cached tokens (the last \
                 prompt token is always computed)",
                t.phase, t.len, t.prompt_len
            )));
        }
        if t.mode == Mode::Sparse && n > 0 {
            self.check_host_room(0, &[(id, n)])?;
            let stride = self.model.kv_heads * self.model.head_dim;
            for (sl, &layer) in self.sparse_layers.clone().iter().enumerate() {
                let (k, v) = kv(layer);
                if k.len() != n * stride || v.len() != n * stride {
                    return Err(CoordError::Invalid(format!(
                        "cached K and V of {} and {} elements for {n} tokens of {stride}",
                        k.len(),
                        v.len()
                    )));
                }
                self.manager_mut().append(id, sl, &k, &v)?;
            }
        }
        self.trackers
            .get_mut(&id)
            .expect("tracked, checked above")
            .len += n;
        Ok(())
    }

    /// Gives a sparse-mode request more host pages ([`HostAlloc::External`]): kv-blocks'
    /// host-tier blocks for the tokens it is about to store.
    pub fn extend_host_pages(&mut self, id: RequestId, pages: &[u32]) -> Result<(), CoordError> {
        self.tracked(id)?;
        Ok(self.manager_mut().extend_host_pages(id, pages)?)
    }

    /// Begins a forward over `batch`: each request with its new tokens (a prefill chunk, or one
    /// decode token; a sparse-mode request past its prefill takes one token per forward).
    pub fn forward_begin(&mut self, batch: &[(RequestId, usize)]) -> Result<(), CoordError> {
        if self.forward.is_some() {
            return Err(CoordError::Invalid("a forward is in progress".into()));
        }
        let mut offsets = Vec::with_capacity(batch.len());
        let mut tokens = 0;
        for (i, &(id, n)) in batch.iter().enumerate() {
            let t = self.tracked(id)?;
            if batch[..i].iter().any(|&(other, _)| other == id) {
                return Err(CoordError::Invalid(format!("{id:?} twice in one batch")));
            }
            let ok = match (t.mode, t.phase) {
                (Mode::Dense, _) => n > 0,
                // A prefilling request's length never passes its prompt's.
                (Mode::Sparse, Phase::Prefill) => n > 0 && n <= t.prompt_len - t.len,
                (Mode::Sparse, Phase::Decode) => n == 1,
            };
            if !ok {
                return Err(CoordError::Invalid(format!(
                    "{id:?} ({:?}, {:?}, {} of {} prompt tokens) cannot take {n} new tokens",
                    t.mode, t.phase, t.len, t.prompt_len
                )));
            }
            offsets.push(tokens);
            tokens = usize::checked_add(tokens, n).ok_or_else(|| {
                CoordError::Invalid(format!("the batch's new tokens overflow at {id:?}"))
            })?;
        }
        self.forward = Some(Forward {
            batch: batch.to_vec(),
            offsets,
            tokens,
            ended: vec![false; self.model.layers],
            begun: vec![false; self.model.layers],
            stepped: false,
            stored: false,
        });
        Ok(())
    }

    /// Before layer `layer`'s attention: `q` is the batch's new tokens' queries
    /// `[tokens, q_heads, head_dim]` (f32, as scoring runs in f32), `k` and `v` their keys and
    /// values `[tokens, kv_heads, head_dim]`. For each sparse-mode decode request of a sparse
    /// layer: writes the new token into its device slot, selects, diffs against the hot
    /// buffer, loads the misses, and adds its row to the plan's metadata.
    pub fn attention_begin(
        &mut self,
        layer: usize,
        q: &[f32],
        k: &[T],
        v: &[T],
    ) -> Result<LayerPlan, CoordError> {
        self.check_layer_io(layer, Some(q.len()), k.len(), v.len())?;
        self.mark_begun(layer);
        let f = self.forward.as_ref().expect("checked by check_layer_io");
        let mut routes = vec![Route::Dense; f.batch.len()];
        let Some(sl) = self.sparse_of[layer] else {
            return Ok(LayerPlan {
                routes,
                meta: None,
                selection: None,
                stats: StepStats::default(),
            });
        };
        let rows = self.decode_rows();
        if rows.is_empty() {
            return Ok(LayerPlan {
                routes,
                meta: None,
                selection: None,
                stats: StepStats::default(),
            });
        }
        let m = self.model;
        let kvs = m.kv_heads * m.head_dim;
        let params = self.lowered.layers[layer]
            .as_ref()
            .expect("a sparse layer has parameters");
        let top = self.select_rows(layer, &rows, q, Some(k))?;
        let manager = self.manager.as_mut().expect("sparse layers have a manager");
        let mut meta_rows: Vec<MetaRow> = Vec::with_capacity(rows.len());
        let mut stats = StepStats::default();
        for (j, r) in rows.iter().enumerate() {
            let (heads, union) = head_union(&top, j, m.kv_heads);
            let plan = manager.step_with_new(r.id, sl, &union, 1)?;
            manager.device(sl).write().set_kv(
                &plan.new_slots,
                &k[r.row * kvs..(r.row + 1) * kvs],
                &v[r.row * kvs..(r.row + 1) * kvs],
            )?;
            stats.add(&plan.stats);
            meta_rows.push(self.adaptor.row(&heads, &union, plan)?);
            routes[r.index] = Route::Sparse(j);
        }
        Ok(LayerPlan {
            routes,
            meta: Some(AttentionMeta::from_rows(
                self.adaptor.kind(),
                m.kv_heads,
                params.caps.page_size,
                &meta_rows,
            )),
            selection: Some(top),
            stats,
        })
    }

    /// After layer `layer`'s attention, with the same `k` and `v` as
    /// [`attention_begin`](Self::attention_begin): in a sparse layer, backs every sparse-mode
    /// request's new tokens up to the host pool, updates the representations of decode
    /// requests, and builds them for requests whose prompt this forward completes.
    pub fn attention_end(&mut self, layer: usize, k: &[T], v: &[T]) -> Result<(), CoordError> {
        self.check_layer_io(layer, None, k.len(), v.len())?;
        let kvs = self.model.kv_heads * self.model.head_dim;
        if let Some(sl) = self.sparse_of[layer] {
            let f = self.forward.as_ref().expect("checked by check_layer_io");
            self.check_host_room(sl, &f.batch)?;
            self.mark_stored();
            let f = self.forward.as_ref().expect("checked by check_layer_io");
            let manager = self.manager.as_mut().expect("sparse layers have a manager");
            for (&(id, n), &off) in f.batch.iter().zip(&f.offsets) {
                if self.trackers[&id].mode == Mode::Sparse {
                    let range = off * kvs..(off + n) * kvs;
                    manager.append(id, sl, &k[range.clone()], &v[range])?;
                }
            }
            let (decode, complete) = self.ending();
            self.build_reps(sl, &decode, true)?;
            self.build_reps(sl, &complete, false)?;
        }
        self.mark_ended(layer);
        Ok(())
    }

    /// The sparse-mode requests of the forward in progress as (id, slot): those decoding, and
    /// those whose prompt the forward completes.
    pub(crate) fn ending(&self) -> (Vec<SlotOf>, Vec<SlotOf>) {
        let (mut decode, mut complete) = (Vec::new(), Vec::new());
        for &(id, n) in self.forward.iter().flat_map(|f| &f.batch) {
            let t = &self.trackers[&id];
            let Some(slot) = t.slot else { continue };
            match t.phase {
                Phase::Decode => decode.push((id, slot)),
                Phase::Prefill if t.len + n == t.prompt_len => complete.push((id, slot)),
                Phase::Prefill => {}
            }
        }
        (decode, complete)
    }

    /// Records that `layer` of the forward in progress has begun its step.
    pub(crate) fn mark_begun(&mut self, layer: usize) {
        let sparse = self.sparse_of[layer].is_some();
        let f = self
            .forward
            .as_mut()
            .expect("a layer begins inside a forward");
        f.begun[layer] = true;
        f.stepped |= sparse;
    }

    /// Records that a sparse layer of the forward in progress stores the new tokens.
    pub(crate) fn mark_stored(&mut self) {
        self.forward
            .as_mut()
            .expect("tokens are stored inside a forward")
            .stored = true;
    }

    /// Whether `layer` of the forward in progress has begun its step.
    pub(crate) fn begun(&self, layer: usize) -> bool {
        self.forward.as_ref().is_some_and(|f| f.begun[layer])
    }

    /// Records that `layer` of the forward in progress has ended its attention.
    pub(crate) fn mark_ended(&mut self, layer: usize) {
        self.forward
            .as_mut()
            .expect("checked by check_layer_io")
            .ended[layer] = true;
    }

    /// Ends the forward: every layer must have ended; lengths advance, and sparse-mode
    /// requests whose prompt is complete move to decode.
    pub fn forward_end(&mut self) -> Result<(), CoordError> {
        let f = self
            .forward
            .as_ref()
            .ok_or_else(|| CoordError::Invalid("no forward in progress".into()))?;
        if let Some(l) = f.ended.iter().position(|e| !e) {
            return Err(CoordError::Invalid(format!(
                "layer {l} has not ended its attention"
            )));
        }
        let f = self.forward.take().expect("checked just above");
        for (id, n) in f.batch {
            let t = self
                .trackers
                .get_mut(&id)
                .expect("requests of a forward stay live until it ends");
            t.len = t.len.saturating_add(n);
            if t.phase == Phase::Prefill && t.len == t.prompt_len {
                t.phase = Phase::Decode;
                t.represented = t.mode == Mode::Sparse;
            }
        }
        Ok(())
    }

    /// Abandons the forward in progress, after an error in one of its layers (a full host
    /// pool, a failed kernel): the engine discards what the forward computed. No length
    /// advances. A request whose state the forward has not changed stays as it was and can
    /// be batched again: every dense-mode request, and a sparse-mode one that no sparse layer
    /// has reached. A sparse-mode request that a sparse layer has reached (a decode row's hot
    /// buffers stepped, or new tokens partly backed up to the host pool) is ended, as by
    /// [`on_request_end`](Self::on_request_end), and answered, so that the engine fails it
    /// or starts it again.
    pub fn abort_forward(&mut self) -> Result<Vec<RequestId>, CoordError> {
        let f = self
            .forward
            .take()
            .ok_or_else(|| CoordError::Invalid("no forward in progress".into()))?;
        let mut ended = Vec::new();
        for &(id, _) in &f.batch {
            let t = self.trackers[&id];
            let reached = match (t.mode, t.phase) {
                (Mode::Dense, _) => false,
                (Mode::Sparse, Phase::Prefill) => f.stored,
                (Mode::Sparse, Phase::Decode) => f.stepped || f.stored,
            };
            if reached {
                self.end_tracked(id);
                ended.push(id);
            }
        }
        Ok(ended)
    }

    /// Ends a request: its hot buffers, host pages (unless the caller owns them) and
    /// representation slot go back.
    pub fn on_request_end(&mut self, id: RequestId) -> Result<RequestTracker, CoordError> {
        self.tracked(id)?;
        if self
            .forward
            .as_ref()
            .is_some_and(|f| f.batch.iter().any(|&(b, _)| b == id))
        {
            return Err(CoordError::Invalid(format!(
                "{id:?} is in the forward in progress"
            )));
        }
        Ok(self.end_tracked(id))
    }

    /// Ends a tracked request outside any forward in progress.
    fn end_tracked(&mut self, id: RequestId) -> RequestTracker {
        let t = self
            .trackers
            .remove(&id)
            .expect("the caller checked that the request is tracked");
        if let Some(slot) = t.slot {
            self.manager_mut()
                .end_request(id)
                .expect("a sparse-mode request is live in the manager");
            self.free_slots.push(slot);
        }
        t
    }

    fn mode_for(&self, prompt_len: usize) -> Mode {
        match self.lowered.sparse_from() {
            Some(n) if prompt_len >= n => Mode::Sparse,
            _ => Mode::Dense,
        }
    }

    fn take_slot(&mut self) -> Result<usize, CoordError> {
        let cap = self.pools.first().map_or(0, RepPool::slots);
        let slot = self.free_slots.pop().ok_or(CoordError::Full(cap))?;
        self.slot_epochs[slot] += 1;
        Ok(slot)
    }

    fn manager_mut(&mut self) -> &mut SparseKvCacheManager<T> {
        self.manager
            .as_mut()
            .expect("only sparse-mode requests reach the manager, and they need sparse layers")
    }
}
