//! A layer's K and V block tensors in device memory, and the kernel that writes new tokens'
//! rows into them.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

use super::{CudaElement, Device, Gpu, to_i32, to_u32};
use crate::error::check_len;
use crate::{AttnError, KvCache, KvLayout};

/// K and V block tensors of one layer in device memory, in the layout of
/// [`PagedKv`](crate::PagedKv).
pub struct DevicePagedKv<T: CudaElement> {
    layout: KvLayout,
    k: CudaSlice<T>,
    v: CudaSlice<T>,
    set_kv: CudaFunction,
    stream: Arc<CudaStream>,
}

impl<T: CudaElement> DevicePagedKv<T> {
    /// A zero-filled cache. The device kernels need `head_dim` to be a multiple of 8 and one of
    /// 64, 128 or 256 for attention.
    pub fn new(gpu: &Gpu, layout: KvLayout) -> Result<Self, AttnError> {
        check_layout::<T>(&layout)?;
        Ok(DevicePagedKv {
            layout,
            k: gpu.zeros(layout.len())?,
            v: gpu.zeros(layout.len())?,
            set_kv: gpu.function("set_kv")?.clone(),
            stream: gpu.stream.clone(),
        })
    }

    /// A cache holding copies of host tensors (each `[num_blocks, block_size, kv_heads,
    /// head_dim]`).
    pub fn from_host(gpu: &Gpu, layout: KvLayout, k: &[T], v: &[T]) -> Result<Self, AttnError> {
        check_layout::<T>(&layout)?;
        check_len("k", k.len(), &[layout.len()])?;
        check_len("v", v.len(), &[layout.len()])?;
        Ok(DevicePagedKv {
            layout,
            k: gpu.upload(k)?,
            v: gpu.upload(v)?,
            set_kv: gpu.function("set_kv")?.clone(),
            stream: gpu.stream.clone(),
        })
    }

    /// The K tensor.
    pub fn k(&self) -> &CudaSlice<T> {
        &self.k
    }

    /// The V tensor.
    pub fn v(&self) -> &CudaSlice<T> {
        &self.v
    }

    /// Both tensors, mutably.
    pub fn tensors_mut(&mut self) -> (&mut CudaSlice<T>, &mut CudaSlice<T>) {
        (&mut self.k, &mut self.v)
    }
}

/// Checks a device layout: the host cache's checks for elements of `T`, a head dim that is a
/// multiple of 8, and slot ids that fit the kernels' `i32`.
fn check_layout<T>(layout: &KvLayout) -> Result<(), AttnError> {
    layout.validate(size_of::<T>())?;
    if !layout.head_dim.is_multiple_of(8) {
        return Err(AttnError::Invalid(format!(
            "a device KV layout needs head_dim a multiple of 8, got {layout:?}"
        )));
    }
    if i32::try_from(layout.num_slots()).is_err() {
        return Err(AttnError::Invalid(format!(
            "{} slots do not fit the kernels' i32 slot ids",
            layout.num_slots()
        )));
    }
    Ok(())
}

impl<T: CudaElement> KvCache<Device> for DevicePagedKv<T> {
    type Elem = T;

    fn layout(&self) -> KvLayout {
        self.layout
    }

    /// As the CPU `set_kv`, except that slots are not read back to be checked: a slot outside the
    /// pool is skipped on the device (never written out of bounds) where the CPU rejects it.
    fn set_kv(
        &mut self,
        slot_mapping: &CudaSlice<i32>,
        k: &CudaSlice<T>,
        v: &CudaSlice<T>,
    ) -> Result<(), AttnError> {
        let stride = self.layout.token_stride();
        let n = slot_mapping.len();
        check_len("k", k.len(), &[n, stride])?;
        check_len("v", v.len(), &[n, stride])?;
        if n == 0 {
            return Ok(());
        }
        let vecs = stride * T::DTYPE.size() / 16;
        let total = n * vecs;
        let (n32, vecs32, slots32) = (to_i32(n)?, to_i32(vecs)?, to_i32(self.layout.num_slots())?);
        let cfg = LaunchConfig {
            grid_dim: (to_u32(total.div_ceil(256))?, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(&self.set_kv);
        b.arg(slot_mapping)
            .arg(&n32)
            .arg(k)
            .arg(v)
            .arg(&mut self.k)
            .arg(&mut self.v)
            .arg(&vecs32)
            .arg(&slots32);
        // SAFETY: the arguments match `set_kv`'s signature in kernels/attn.cu: k and v hold
        // n * vecs 16-byte vectors (checked above; head_dim is a multiple of 8 so a token row is
        // whole vectors), the pool holds num_slots * vecs, and the kernel skips slots outside
        // 0..num_slots.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}
