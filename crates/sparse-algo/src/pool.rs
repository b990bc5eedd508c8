//! The representation pool: per (layer, request slot, page) metadata in one flat f32 array.

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

    /// f32 elements per page.
    pub fn page_len(&self) -> usize {
        self.heads * self.width
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
    data: Vec<f32>,
    tokens: Vec<usize>,
}

impl RepPool {
    /// A pool for `layers` layers and `slots` requests of up to `max_tokens` tokens each.
    pub fn new(
        shape: RepShape,
        layers: usize,
        slots: usize,
        max_tokens: usize,
    ) -> Result<Self, AlgoError> {
        let (max_pages, len) = pool_extent(shape, layers, slots, max_tokens)?;
        Ok(RepPool {
            shape,
            layers,
            slots,
            max_pages,
            data: vec![0.0; len],
            tokens: vec![0; layers * slots],
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

    /// Bytes the pool holds.
    pub fn bytes(&self) -> usize {
        self.data.len() * size_of::<f32>()
    }

    /// The whole flat array `[layers, slots, max_pages, heads, width]`.
    pub fn data(&self) -> &[f32] {
        &self.data
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

    /// The summarized pages of (layer, slot), `[pages, heads, width]`.
    pub fn pages(&self, layer: usize, slot: usize) -> Result<&[f32], AlgoError> {
        let i = self.index(layer, slot)?;
        let row = self.max_pages * self.shape.page_len();
        let pages = self.tokens[i].div_ceil(self.shape.page_size);
        Ok(&self.data[i * row..i * row + pages * self.shape.page_len()])
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
    ) -> Result<(&mut [f32], &mut usize), AlgoError> {
        let i = self.index(layer, slot)?;
        if upto > self.max_tokens() {
            return Err(AlgoError::Invalid(format!(
                "slot {slot}: {upto} tokens exceed the pool's {} per request",
                self.max_tokens()
            )));
        }
        let row = self.max_pages * self.shape.page_len();
        Ok((&mut self.data[i * row..(i + 1) * row], &mut self.tokens[i]))
    }
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
