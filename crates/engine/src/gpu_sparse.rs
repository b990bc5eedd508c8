//! Attention of a GPU forward through the sparse coordinator's device hooks (feature `cuda`):
//! per layer, the coordinator enqueues the new tokens' backup to its host pool, selection,
//! diff and loads ([`SparseCoordinator::attention_begin_device`]), attention runs over the hot
//! buffers ([`DeviceSparse::attend`]), and the coordinator ends the layer
//! ([`SparseCoordinator::attention_end_device`]). Queries, keys and values stay on the
//! device, and nothing waits for the stream.
//!
//! It runs decode batches whose every request is in sparse mode and every layer sparse (the
//! capacity and throughput runs); a dense route (a dense layer, a dense-mode request or a
//! prefill) needs the engine's device cache beside it and is answered with
//! [`EngineError::Invalid`].

use attn_op::AttnParams;
use coordinator::cuda::DeviceSparse;
use coordinator::{Route, SparseCoordinator};
use cudarc::driver::CudaSlice;

use crate::EngineError;
use crate::gpu::{GpuAttention, GpuFloat};
use attn_op::cuda::Gpu;

/// One forward's attention through a [`SparseCoordinator`] and its device mirror, between
/// the coordinator's `forward_begin` and `forward_end` (the caller's).
pub struct GpuSparseAttention<'a, T: GpuFloat> {
    /// The coordinator, inside a forward of sparse-mode decode requests.
    pub coord: &'a mut SparseCoordinator<T>,
    /// Its device mirror.
    pub dev: &'a mut DeviceSparse<T>,
    /// Heads and softmax scale.
    pub params: AttnParams,
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
        if let Some(i) = plan
            .routes
            .iter()
            .enumerate()
            .position(|(i, r)| *r != Route::Sparse(i))
        {
            return Err(EngineError::Invalid(format!(
                "layer {layer}: request {i} of the batch is routed {:?}; GPU sparse attention \
                 runs batches of sparse-mode decode requests in sparse layers only",
                plan.routes[i]
            )));
        }
        self.dev
            .attend(gpu, self.coord, layer, q, &self.params, out)?;
        self.coord.attention_end_device(gpu, self.dev, layer)?;
        Ok(())
    }
}
