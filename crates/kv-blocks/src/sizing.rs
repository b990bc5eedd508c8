//! Memory sizing: how many blocks fit a budget and how many a step needs.

use crate::KvError;

/// The shape of the KV of one window group, for sizing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    /// Layers stored in each block.
    pub layers: u32,
    /// KV heads per layer.
    pub kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Bytes per element (2 for f16 and bf16).
    pub dtype_bytes: u32,
}

impl KvShape {
    /// Bytes of K and V for one token across all layers: `2 * layers * kv_heads * head_dim *
    /// dtype_bytes`.
    pub fn bytes_per_token(&self) -> u64 {
        2 * u64::from(self.layers)
            * u64::from(self.kv_heads)
            * u64::from(self.head_dim)
            * u64::from(self.dtype_bytes)
    }

    /// Bytes of one block of `tokens_per_block` tokens.
    pub fn bytes_per_block(&self, tokens_per_block: u32) -> u64 {
        self.bytes_per_token() * u64::from(tokens_per_block)
    }
}

/// How a pool is sized, with TensorRT-LLM's semantics: a fraction of the free memory, capped by
/// `max_tokens` when given (the lesser of the two wins).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PoolSizing {
    /// Bytes free for the pool before sizing.
    pub free_bytes: u64,
    /// Fraction of `free_bytes` to use, in `(0, 1]` (TensorRT-LLM's default is 0.9).
    pub free_memory_fraction: f64,
    /// Cap on the tokens the pool holds.
    pub max_tokens: Option<u64>,
}

impl PoolSizing {
    /// The number of blocks of `shape` with `tokens_per_block` tokens this sizing allows.
    pub fn blocks(&self, shape: &KvShape, tokens_per_block: u32) -> Result<u32, KvError> {
        let f = self.free_memory_fraction;
        if !(f > 0.0 && f <= 1.0) {
            return Err(KvError::InvalidConfig(format!(
                "free_memory_fraction must be in (0, 1], got {f}"
            )));
        }
        let per_block = shape.bytes_per_block(tokens_per_block);
        if per_block == 0 {
            return Err(KvError::InvalidConfig(
                "a block of zero bytes (a zero in the KV shape or tokens_per_block)".to_owned(),
            ));
        }
        // f64 holds byte counts up to 2^53 exactly, far beyond any memory.
        let budget = (self.free_bytes as f64 * f).floor() as u64;
        let mut blocks = budget / per_block;
        if let Some(max_tokens) = self.max_tokens {
            blocks = blocks.min(max_tokens.div_ceil(u64::from(tokens_per_block)));
        }
        Ok(u32::try_from(blocks)
            .unwrap_or(crate::MAX_BLOCKS_PER_POOL)
            .min(crate::MAX_BLOCKS_PER_POOL))
    }
}

/// Blocks a sequence of `len` tokens occupies.
pub fn blocks_for_tokens(len: u64, tokens_per_block: u32) -> u64 {
    len.div_ceil(u64::from(tokens_per_block.max(1)))
}

/// New blocks a step that grows a sequence from `len` to `len + new_tokens` tokens must allocate;
/// with an attention window the sequence never holds more than the window's blocks plus one.
pub fn blocks_needed_for_step(
    len: u64,
    new_tokens: u64,
    tokens_per_block: u32,
    window: Option<u32>,
) -> u64 {
    let before = blocks_for_tokens(len, tokens_per_block);
    let after = blocks_for_tokens(len + new_tokens, tokens_per_block);
    let grown = after - before;
    match window {
        None => grown,
        Some(w) => grown.min(max_blocks_in_window(w, tokens_per_block)),
    }
}

/// The most blocks a request holds at once in a group with attention window `window`.
pub fn max_blocks_in_window(window: u32, tokens_per_block: u32) -> u64 {
    blocks_for_tokens(u64::from(window), tokens_per_block) + 1
}

/// The longest attention window (in tokens) that `blocks` blocks give each of `sequences`
/// sequences: what a model's `max_attention_window` is capped to when memory is short.
pub fn max_attention_window(blocks: u32, sequences: u32, tokens_per_block: u32) -> u64 {
    if sequences == 0 {
        return 0;
    }
    u64::from(blocks / sequences) * u64::from(tokens_per_block)
}
