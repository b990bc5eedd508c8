//! What one request reserves of the device and host tiers: the one accounting that the
//! [`Scheduler`](crate::Scheduler) admits requests by and that `hsa capacity` reports.

use coordinator::{Lowered, ModelShape};

/// One request's reservation, from [`footprint`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Footprint {
    /// Whether the request runs in sparse mode.
    pub sparse: bool,
    /// Whether its KV blocks go back after its prefill (every layer is sparse).
    pub drop_blocks: bool,
    /// Device bytes reserved while it prefills.
    pub reserve: u64,
    /// Device bytes reserved while it decodes.
    pub decode_reserve: u64,
    /// Pages it takes of its sparse configuration's host KV pool.
    pub host_pages: usize,
}

/// The engine's KV block geometry: tokens per block and bytes per block over every layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockGeometry {
    /// Tokens per block.
    pub tokens: usize,
    /// Bytes of one block: K and V of every layer for `tokens` tokens.
    pub bytes: u64,
}

impl BlockGeometry {
    /// Bytes of the blocks that hold `tokens` tokens (saturating at `u64::MAX`, as every byte
    /// count here).
    pub fn bytes_for(&self, tokens: usize) -> u64 {
        (tokens.div_ceil(self.tokens) as u64).saturating_mul(self.bytes)
    }

    /// Bytes of `tokens` tokens' K and V over every layer, not rounded up to blocks (a sparse
    /// configuration's host page).
    pub fn token_bytes(&self, tokens: usize) -> u64 {
        let bytes = u128::from(tokens as u64) * u128::from(self.bytes) / self.tokens.max(1) as u128;
        u64::try_from(bytes).unwrap_or(u64::MAX)
    }
}

/// The reservation of a request of `prompt` tokens that may grow to `total`, on a model of
/// `shape` with KV elements of `elem_bytes` bytes.
///
/// `lowered` is its sparse configuration (`None`: dense). A dense request, or one whose prompt
/// is shorter than [`Lowered::min_prompt_tokens`], reserves the blocks of `total` tokens. A
/// sparse-mode one reserves its hot buffers and representations
/// ([`Lowered::sparse_device_bytes`]) plus, when every layer is sparse, its prompt's blocks
/// while it prefills only; with a dense layer it keeps the blocks of `total` tokens (the
/// engine's blocks hold every layer).
pub fn footprint(
    lowered: Option<&Lowered>,
    shape: ModelShape,
    elem_bytes: usize,
    blocks: BlockGeometry,
    prompt: usize,
    total: usize,
) -> Footprint {
    let dense = Footprint {
        sparse: false,
        drop_blocks: false,
        reserve: blocks.bytes_for(total),
        decode_reserve: blocks.bytes_for(total),
        host_pages: 0,
    };
    let Some(lowered) = lowered else {
        return dense;
    };
    if lowered.layers.iter().all(Option::is_none) || prompt < lowered.min_prompt_tokens {
        return dense;
    }
    let sparse = lowered.sparse_device_bytes(shape, elem_bytes, total) as u64;
    let drop_blocks = lowered.layers.iter().all(Option::is_some);
    let held = if drop_blocks {
        0
    } else {
        blocks.bytes_for(total)
    };
    Footprint {
        sparse: true,
        drop_blocks,
        reserve: sparse.saturating_add(held.max(blocks.bytes_for(prompt))),
        decode_reserve: sparse.saturating_add(held),
        host_pages: total.div_ceil(lowered.page_size).saturating_add(1),
    }
}

impl Footprint {
    /// How many such requests run at once within `budget` device bytes when they arrive one
    /// after another: all but the newest decode, the newest prefills.
    pub fn max_concurrent(&self, budget: u64) -> u64 {
        if self.reserve > budget {
            return 0;
        }
        1 + (budget - self.reserve) / self.decode_reserve.max(1)
    }
}
