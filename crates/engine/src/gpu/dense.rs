//! Dense attention over the engine's device cache, for the forward's dense layers and
//! requests.

use attn_op::cuda::{DeviceBatch, DevicePagedKv, Gpu};
use attn_op::{AttnParams, BatchMeta, KvCache, KvLayout};
use cudarc::driver::CudaSlice;

use super::{GpuAttention, GpuFloat};
use crate::{EngineError, ModelConfig};

/// Dense attention over the engine's device cache: every layer's block tensor, one batch's
/// metadata and the slots its new tokens take.
pub struct GpuDenseAttention<T: GpuFloat> {
    /// Per layer, the KV block tensor.
    pub kv: Vec<DevicePagedKv<T>>,
    /// The batch's metadata over `kv`'s blocks.
    pub meta: DeviceBatch,
    /// The slot of each new token, `[tokens]`.
    pub slots: CudaSlice<i32>,
    /// Heads and softmax scale.
    pub params: AttnParams,
}

impl<T: GpuFloat> GpuDenseAttention<T> {
    /// A cache of `num_blocks` blocks of `block_size` tokens per layer for `config`.
    pub fn cache(
        gpu: &Gpu,
        config: &ModelConfig,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<Vec<DevicePagedKv<T>>, EngineError> {
        let layout = KvLayout {
            num_blocks,
            block_size,
            kv_heads: config.kv_heads,
            head_dim: config.head_dim,
        };
        (0..config.layers)
            .map(|_| Ok(DevicePagedKv::new(gpu, layout)?))
            .collect()
    }

    /// Dense attention of the batch `meta` (over `kv`), its new tokens at `slots`.
    pub fn new(
        gpu: &Gpu,
        config: &ModelConfig,
        kv: Vec<DevicePagedKv<T>>,
        meta: &BatchMeta<'_>,
        slots: &[i32],
    ) -> Result<Self, EngineError> {
        let layout = kv
            .first()
            .map(KvCache::layout)
            .ok_or_else(|| EngineError::Invalid("a cache of no layers".into()))?;
        Ok(GpuDenseAttention {
            meta: DeviceBatch::upload(gpu, meta, &layout)?,
            slots: gpu.upload(slots)?,
            params: AttnParams::new(config.q_heads, config.head_dim),
            kv,
        })
    }
}

impl<T: GpuFloat> GpuAttention<T> for GpuDenseAttention<T> {
    fn attend(
        &mut self,
        gpu: &Gpu,
        layer: usize,
        q: &CudaSlice<T>,
        k: &CudaSlice<T>,
        v: &CudaSlice<T>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), EngineError> {
        let kv = self
            .kv
            .get_mut(layer)
            .ok_or_else(|| EngineError::Invalid(format!("no cache for layer {layer}")))?;
        kv.set_kv(&self.slots, k, v)?;
        gpu.paged_attention(q, kv, &self.meta, &self.params, out, None)?;
        Ok(())
    }
}
