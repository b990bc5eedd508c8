//! Representations on the device: [`RepPool`](crate::RepPool)'s layout in the keys' element
//! type, or Quest's E4M3 summaries.

use attn_op::cuda::{CudaElement, Gpu};
use cudarc::driver::CudaSlice;

use crate::pool::pool_extent;
use crate::{AlgoError, RepShape, Summary};

/// [`RepPool`](crate::RepPool)'s flat array `[layers, slots, max_pages, heads, width]` on the
/// device, in element type `T`, or, for Quest's [`Summary::E4m3`], as one E4M3 code per value
/// plus a scale exponent per (page, head) (`[layers, slots, max_pages, heads]`;
/// [`crate::summary`] has the format). Token counts are not kept: the batch metadata says which
/// pages a step touched.
pub struct DeviceRepPool<T: CudaElement> {
    pub(super) shape: RepShape,
    pub(super) layers: usize,
    pub(super) slots: usize,
    pub(super) max_pages: usize,
    /// The values in `T` (one unused element for an E4M3 pool).
    pub(super) data: CudaSlice<T>,
    /// An E4M3 pool's codes and scale exponents.
    pub(super) e4m3: Option<(CudaSlice<u8>, CudaSlice<i8>)>,
}

impl<T: CudaElement> DeviceRepPool<T> {
    /// A zeroed pool for `layers` layers and `slots` requests of up to `max_tokens` tokens.
    pub fn new(
        gpu: &Gpu,
        shape: RepShape,
        layers: usize,
        slots: usize,
        max_tokens: usize,
    ) -> Result<Self, AlgoError> {
        Self::with_summary(gpu, shape, layers, slots, max_tokens, Summary::Exact)
    }

    /// A zeroed pool whose values are stored as `summary` says (Quest's
    /// [`QuestConfig::summary`](crate::QuestConfig::summary)).
    pub fn with_summary(
        gpu: &Gpu,
        shape: RepShape,
        layers: usize,
        slots: usize,
        max_tokens: usize,
        summary: Summary,
    ) -> Result<Self, AlgoError> {
        let (max_pages, len) = pool_extent(shape, layers, slots, max_tokens)?;
        let (data, e4m3) = match summary {
            Summary::Exact => (gpu.zeros(len)?, None),
            Summary::E4m3 => {
                let rows = len / shape.width.max(1);
                (gpu.zeros(1)?, Some((gpu.zeros(len)?, gpu.zeros(rows)?)))
            }
        };
        Ok(DeviceRepPool {
            shape,
            layers,
            slots,
            max_pages,
            data,
            e4m3,
        })
    }

    /// How the pool stores its values.
    pub fn summary(&self) -> Summary {
        if self.e4m3.is_some() {
            Summary::E4m3
        } else {
            Summary::Exact
        }
    }

    /// An E4M3 pool's codes `[layers, slots, max_pages, heads, width]` and scale exponents
    /// `[layers, slots, max_pages, heads]`; `None` for a pool of `T` values.
    pub fn e4m3(&self) -> Option<(&CudaSlice<u8>, &CudaSlice<i8>)> {
        self.e4m3.as_ref().map(|(c, e)| (c, e))
    }

    /// An E4M3 pool's codes and exponents for writers other than this crate's kernels (a
    /// host-built pool's rows uploaded, [`crate::summary::encode_row`]).
    pub fn e4m3_mut(&mut self) -> Option<(&mut CudaSlice<u8>, &mut CudaSlice<i8>)> {
        self.e4m3.as_mut().map(|(c, e)| (c, e))
    }

    /// The per-page shape.
    pub fn shape(&self) -> RepShape {
        self.shape
    }

    /// The longest sequence a slot can summarize.
    pub fn max_tokens(&self) -> usize {
        self.max_pages * self.shape.page_size
    }

    /// Bytes the pool holds on the device.
    pub fn bytes(&self) -> usize {
        match &self.e4m3 {
            Some((codes, exps)) => codes.len() + exps.len(),
            None => self.data.len() * size_of::<T>(),
        }
    }

    /// The whole array, `[layers, slots, max_pages, heads, width]` (one unused element in an
    /// E4M3 pool: see [`Self::e4m3`]).
    pub fn data(&self) -> &CudaSlice<T> {
        &self.data
    }

    /// The whole array, for writers other than this crate's kernels: a model writes its DSA
    /// indexer keys here, token `t` of `(layer, slot)` at row `(layer * slots + slot) *
    /// max_pages + t` of `width` elements (pages are single tokens).
    pub fn data_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.data
    }
}
