//! The representation pool: per (layer, request slot, page) metadata in one flat array, of f32
//! or, for min/max bounds, of bf16 or f16.

use std::borrow::Cow;

use attn_op::{DType, Element};
use half::{bf16, f16};
use serde::{Deserialize, Serialize};

use crate::AlgoError;

/// What one algorithm stores per page: `heads` vectors of `width` f32 for every `page_size`
/// tokens. Quest, for instance, stores `[kmax ‖ kmin]` (`width = 2 * head_dim`) per KV head.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RepShape {
    /// Tokens summarized by one page of representations (1: one entry per token).
    pub page_size: usize,
    /// Vectors per page (KV heads, or 1 for a head-shared indexer key).
    pub heads: usize,
    /// f32 elements per vector; 0 for algorithms without representations.
    pub width: usize,
}

impl RepShape {
    /// The shape of an algorithm that keeps no representations.
    pub const NONE: RepShape = RepShape {
        page_size: 1,
        heads: 0,
        width: 0,
    };

    /// f32 elements per page (saturating at `usize::MAX`, which no pool accepts).
    pub fn page_len(&self) -> usize {
        self.heads.saturating_mul(self.width)
    }
}

/// Values as a pool stores them: the whole pool ([`RepPool::data`]) or one (layer, slot)'s
/// pages ([`RepPool::reps`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Reps<'a> {
    /// An f32 pool's values.
    F32(&'a [f32]),
    /// A bf16 pool's values.
    Bf16(&'a [bf16]),
    /// An f16 pool's values.
    F16(&'a [f16]),
}

impl<'a> Reps<'a> {
    /// Elements held.
    pub fn len(&self) -> usize {
        match self {
            Reps::F32(v) => v.len(),
            Reps::Bf16(v) => v.len(),
            Reps::F16(v) => v.len(),
        }
    }

    /// Whether no element is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element type of the values.
    pub fn elem(&self) -> DType {
        match self {
            Reps::F32(_) => DType::F32,
            Reps::Bf16(_) => DType::BF16,
            Reps::F16(_) => DType::F16,
        }
    }

    /// Elements `at` of the values.
    fn at(self, at: std::ops::Range<usize>) -> Reps<'a> {
        match self {
            Reps::F32(v) => Reps::F32(&v[at]),
            Reps::Bf16(v) => Reps::Bf16(&v[at]),
            Reps::F16(v) => Reps::F16(&v[at]),
        }
    }

    /// The values as f32: borrowed from an f32 pool, widened (exactly) from a 16-bit one.
    pub fn to_f32(&self) -> Cow<'a, [f32]> {
        /// `v` widened by its element type's own slice conversion.
        fn wide<E: Element>(v: &[E]) -> Vec<f32> {
            let mut out = vec![0.0; v.len()];
            E::slice_to_f32(v, &mut out);
            out
        }
        match *self {
            Reps::F32(v) => Cow::Borrowed(v),
            Reps::Bf16(v) => Cow::Owned(wide(v)),
            Reps::F16(v) => Cow::Owned(wide(v)),
        }
    }
}

/// Representations of every (layer, request slot), preallocated as one flat array
/// `[layers, slots, max_pages, heads, width]` (the layout a device copy of the pool keeps), plus
/// how many tokens each (layer, slot) currently summarizes. Request slots are small integers
/// the caller assigns (RequestTrackers rows); the pool never sees request ids.
#[derive(Clone, Debug)]
pub struct RepPool {
    shape: RepShape,
    layers: usize,
    slots: usize,
    max_pages: usize,
    data: Store,
    tokens: Vec<usize>,
}

/// A pool's values, in its element type.
#[derive(Clone, Debug)]
enum Store {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
}

/// One (layer, slot)'s row of a pool for writing, `[max_pages, heads, width]`, in the pool's
/// element type.
pub(crate) enum RowMut<'a> {
    /// An f32 pool's row.
    F32(&'a mut [f32]),
    /// A bf16 pool's row.
    Bf16(&'a mut [bf16]),
    /// An f16 pool's row.
    F16(&'a mut [f16]),
}

impl RepPool {
    /// An f32 pool for `layers` layers and `slots` requests of up to `max_tokens` tokens each
    /// ([`Self::with_elem`] with [`crate::SparseAlgorithm::rep_elem`] gives the narrowest exact
    /// one).
    pub fn new(
        shape: RepShape,
        layers: usize,
        slots: usize,
        max_tokens: usize,
    ) -> Result<Self, AlgoError> {
        Self::with_elem(shape, DType::F32, layers, slots, max_tokens)
    }

    /// A pool of `elem` values for `layers` layers and `slots` requests of up to `max_tokens`
    /// tokens each. f32 holds any representation exactly. bf16 and f16 take half the bytes and
    /// hold only Quest's and RocketKV's `[kmax ‖ kmin]` bounds, each rounded outward (`kmax`
    /// up, `kmin` down) so that it still bounds every key of its page; the other algorithms
    /// reject them with [`AlgoError::Invalid`]. The rounding changes nothing for keys of the
    /// pool's own type (their minima and maxima are its values), nor for
    /// [`crate::Summary::E4m3`] bounds in bf16 (every scaled E4M3 value is a bf16 value), so
    /// there the scores, and the selections, are those of an f32 pool bit for bit.
    pub fn with_elem(
        shape: RepShape,
        elem: DType,
        layers: usize,
        slots: usize,
        max_tokens: usize,
    ) -> Result<Self, AlgoError> {
        let (max_pages, len) = pool_extent(shape, layers, slots, max_tokens)?;
        let data = match elem {
            DType::F32 => f32::zeros(len).map(Store::F32),
            DType::BF16 => bf16::zeros(len).map(Store::Bf16),
            DType::F16 => f16::zeros(len).map(Store::F16),
        };
        let bytes = len.saturating_mul(elem.size());
        let unallocatable = || {
            AlgoError::Config(format!(
                "a representation pool of {bytes} bytes cannot be allocated"
            ))
        };
        let data = data.ok_or_else(unallocatable)?;
        // `pool_extent` checked that `layers * slots` does not overflow.
        let mut tokens = Vec::new();
        tokens
            .try_reserve_exact(layers * slots)
            .map_err(|_| unallocatable())?;
        tokens.resize(layers * slots, 0);
        Ok(RepPool {
            shape,
            layers,
            slots,
            max_pages,
            data,
            tokens,
        })
    }

    /// The per-page shape.
    pub fn shape(&self) -> RepShape {
        self.shape
    }

    /// Layers in the pool.
    pub fn layers(&self) -> usize {
        self.layers
    }

    /// Request slots in the pool.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// The longest sequence a slot can summarize.
    pub fn max_tokens(&self) -> usize {
        self.max_pages * self.shape.page_size
    }

    /// The element type of the pool's values.
    pub fn elem(&self) -> DType {
        self.data().elem()
    }

    /// Bytes the pool holds.
    pub fn bytes(&self) -> usize {
        self.data().len() * self.elem().size()
    }

    /// The whole flat array `[layers, slots, max_pages, heads, width]`.
    pub fn data(&self) -> Reps<'_> {
        match &self.data {
            Store::F32(v) => Reps::F32(v),
            Store::Bf16(v) => Reps::Bf16(v),
            Store::F16(v) => Reps::F16(v),
        }
    }

    fn index(&self, layer: usize, slot: usize) -> Result<usize, AlgoError> {
        if layer >= self.layers || slot >= self.slots {
            return Err(AlgoError::Invalid(format!(
                "(layer {layer}, slot {slot}) outside a pool of {} layers x {} slots",
                self.layers, self.slots
            )));
        }
        Ok(layer * self.slots + slot)
    }

    /// Tokens summarized for (layer, slot).
    pub fn tokens(&self, layer: usize, slot: usize) -> Result<usize, AlgoError> {
        Ok(self.tokens[self.index(layer, slot)?])
    }

    /// The summarized pages of (layer, slot), `[pages, heads, width]`, as the pool stores them.
    pub fn reps(&self, layer: usize, slot: usize) -> Result<Reps<'_>, AlgoError> {
        let i = self.index(layer, slot)?;
        let row = self.max_pages * self.shape.page_len();
        let pages = self.tokens[i].div_ceil(self.shape.page_size);
        Ok(self
            .data()
            .at(i * row..i * row + pages * self.shape.page_len()))
    }

    /// The summarized pages of (layer, slot), `[pages, heads, width]`, as f32 (widened from a
    /// 16-bit pool).
    pub fn pages(&self, layer: usize, slot: usize) -> Result<Cow<'_, [f32]>, AlgoError> {
        Ok(self.reps(layer, slot)?.to_f32())
    }

    /// Forgets what (layer, slot) summarizes, for a new request in the slot.
    pub fn reset(&mut self, layer: usize, slot: usize) -> Result<(), AlgoError> {
        let i = self.index(layer, slot)?;
        self.tokens[i] = 0;
        Ok(())
    }

    /// Forgets a slot in every layer.
    pub fn reset_slot(&mut self, slot: usize) -> Result<(), AlgoError> {
        for layer in 0..self.layers {
            self.reset(layer, slot)?;
        }
        Ok(())
    }

    /// The full row of (layer, slot) for writing, `[max_pages, heads, width]`, and its token
    /// count. Checks that `upto` tokens fit.
    pub(crate) fn row_mut(
        &mut self,
        layer: usize,
        slot: usize,
        upto: usize,
    ) -> Result<(RowMut<'_>, &mut usize), AlgoError> {
        let i = self.index(layer, slot)?;
        if upto > self.max_tokens() {
            return Err(AlgoError::Invalid(format!(
                "slot {slot}: {upto} tokens exceed the pool's {} per request",
                self.max_tokens()
            )));
        }
        let row = self.max_pages * self.shape.page_len();
        let at = i * row..(i + 1) * row;
        let values = match &mut self.data {
            Store::F32(v) => RowMut::F32(&mut v[at]),
            Store::Bf16(v) => RowMut::Bf16(&mut v[at]),
            Store::F16(v) => RowMut::F16(&mut v[at]),
        };
        Ok((values, &mut self.tokens[i]))
    }

    /// The row of (layer, slot) for writing as f32 (see [`Self::row_mut`]), for the
    /// representations that only an f32 pool holds; `who` names them in the error a 16-bit
    /// pool gets.
    pub(crate) fn row_mut_f32(
        &mut self,
        layer: usize,
        slot: usize,
        upto: usize,
        who: &str,
    ) -> Result<(&mut [f32], &mut usize), AlgoError> {
        match self.row_mut(layer, slot, upto)? {
            (RowMut::F32(row), built) => Ok((row, built)),
            (RowMut::Bf16(_) | RowMut::F16(_), _) => Err(f32_only(who)),
        }
    }
}

/// The error of a 16-bit pool given to representations that only an f32 pool holds.
pub(crate) fn f32_only(who: &str) -> AlgoError {
    AlgoError::Invalid(format!(
        "{who} needs an f32 representation pool (16-bit pools hold min/max bounds only)"
    ))
}

/// Pages per (layer, slot) and elements of a pool of `layers` x `slots` rows of `max_tokens`
/// tokens, rejecting a page size of 0 and sizes that overflow.
pub(crate) fn pool_extent(
    shape: RepShape,
    layers: usize,
    slots: usize,
    max_tokens: usize,
) -> Result<(usize, usize), AlgoError> {
    if shape.page_size == 0 {
        return Err(AlgoError::Config("representation page size 0".to_owned()));
    }
    let max_pages = max_tokens.div_ceil(shape.page_size);
    let len = [layers, slots, max_pages, shape.heads, shape.width]
        .into_iter()
        .try_fold(1usize, usize::checked_mul)
        .ok_or_else(|| AlgoError::Config("representation pool size overflows".to_owned()))?;
    Ok((max_pages, len))
}
