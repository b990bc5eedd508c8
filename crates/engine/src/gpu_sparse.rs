//! Attention of a GPU forward through the sparse coordinator's device hooks (feature `cuda`):
//! per layer, the coordinator enqueues the new tokens' backup to its host pool, selection,
//! diff and loads ([`SparseCoordinator::attention_begin_device`]), attention runs over the hot
//! buffers ([`DeviceSparse::attend`]) or densely over the engine's device cache
//! ([`GpuDenseAttention`]), and the coordinator ends the layer
//! ([`SparseCoordinator::attention_end_device`]). Queries, keys and values stay on the
//! device, and nothing waits for the stream except the end of a prompt (the coordinator
//! builds its representations from the host pool).
//!
//! With prefetch configured, each layer's start also estimates the next layer's queries
//! from its input and enqueues their pages' loads on a copy stream, under the layer's
//! compute ([`GpuAttention::early_query`]).
//!
//! A layer's batch runs one way: every request sparse (sparse-mode decode requests in a
//! sparse layer), or every request dense (a prefill, a dense layer, dense-mode requests),
//! which needs the dense backend. A batch that mixes the two is answered with
//! [`EngineError::Invalid`].

use attn_op::AttnParams;
use attn_op::cuda::Gpu;
use coordinator::cuda::DeviceSparse;
use coordinator::{Route, SparseCoordinator};
use cudarc::driver::CudaSlice;

use crate::EngineError;
use crate::gpu::{GpuAttention, GpuDenseAttention, GpuFloat};

/// One forward's attention through a [`SparseCoordinator`] and its device mirror, between
/// the coordinator's `forward_begin` and `forward_end` (the caller's).
pub struct GpuSparseAttention<'a, T: GpuFloat> {
    /// The coordinator, inside a forward.
    pub coord: &'a mut SparseCoordinator<T>,
    /// Its device mirror.
    pub dev: &'a mut DeviceSparse<T>,
    /// Heads and softmax scale.
    pub params: AttnParams,
    /// Dense attention over the engine's device cache, for the layers the coordinator routes
    /// densely; `None` where every route must be sparse.
    pub dense: Option<GpuDenseAttention<T>>,
    /// The layers this forward prefetched, in order (read their loads with
    /// [`DeviceSparse::prefetch_stats`]). Prefetch runs where the coordinator's
    /// configuration asks for it ([`SparseCoordinator::wants_prefetch`]): at the start of
    /// each layer, the next layer's queries are estimated from its input and their pages
    /// loaded on a copy stream ([`SparseCoordinator::prefetch_device`]) under the layer's
    /// compute.
    pub prefetched: Vec<usize>,
}

impl<'a, T: GpuFloat> GpuSparseAttention<'a, T> {
    /// One forward's attention through `coord` and its device mirror `dev`, dense layers
    /// through `dense` where given; nothing prefetched yet.
    pub fn new(
        coord: &'a mut SparseCoordinator<T>,
        dev: &'a mut DeviceSparse<T>,
        params: AttnParams,
        dense: Option<GpuDenseAttention<T>>,
    ) -> Self {
        GpuSparseAttention {
            coord,
            dev,
            params,
            dense,
            prefetched: Vec::new(),
        }
    }
}

impl<T: GpuFloat> GpuAttention<T> for GpuSparseAttention<'_, T> {
    fn attend(
        &mut self,
        gpu: &Gpu,
        layer: usize,
        q: &CudaSlice<T>,
        k: &CudaSlice<T>,
        v: &CudaSlice<T>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), EngineError> {
        let plan = self
            .coord
            .attention_begin_device(gpu, self.dev, layer, q, k, v)?;
        let sparse = plan
            .routes
            .iter()
            .filter(|r| matches!(r, Route::Sparse(_)))
            .count();
        if sparse == plan.routes.len() {
            self.dev
                .attend(gpu, self.coord, layer, q, &self.params, out)?;
        } else if sparse == 0 {
            let dense = self.dense.as_mut().ok_or_else(|| {
                EngineError::Invalid(format!(
                    "layer {layer} routes the batch densely, and this forward has no dense \
                     attention"
                ))
            })?;
            dense.attend(gpu, layer, q, k, v, out)?;
        } else {
            return Err(EngineError::Invalid(format!(
                "layer {layer}: {sparse} of {} requests are routed sparse; GPU attention runs a \
                 batch all sparse or all dense",
                plan.routes.len()
            )));
        }
        self.coord.attention_end_device(gpu, self.dev, layer)?;
        Ok(())
    }

    fn early_query(&self, layer: usize) -> Option<usize> {
        let next = layer + 1;
        self.coord.wants_prefetch(next).then_some(next)
    }

    fn early(&mut self, gpu: &Gpu, target: usize, q: CudaSlice<T>) -> Result<(), EngineError> {
        if self.coord.prefetch_device(gpu, self.dev, target, q)? {
            self.prefetched.push(target);
        }
        Ok(())
    }
}
