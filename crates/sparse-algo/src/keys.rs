//! Read access to a layer's keys in logical positions, whatever holds them.

use attn_op::{Element, KvCache, PagedKv};

use crate::AlgoError;

/// One layer's keys for a batch of sequences, read by logical position. Algorithms build their
/// representations from it and the oracle scores with it; it hides where keys live (a device
/// pool, a host pool in any layout) and their element type.
pub trait KeySource: Sync {
    /// Sequences in the batch.
    fn num_seqs(&self) -> usize;
    /// KV heads per token.
    fn kv_heads(&self) -> usize;
    /// Elements per head vector.
    fn head_dim(&self) -> usize;
    /// Tokens of sequence `seq` (`seq < num_seqs()`).
    fn seq_len(&self, seq: usize) -> usize;
    /// Writes the keys of positions `start..start + n` of `seq`, every KV head, into `dst` as f32
    /// `[n, kv_heads, head_dim]`, where `n = dst.len() / (kv_heads * head_dim)`. Callers keep the
    /// range inside the sequence; implementations may panic otherwise.
    fn read(&self, seq: usize, start: usize, dst: &mut [f32]);
}

/// A [`KeySource`] over attn-op's paged KV tensor and a block table (the shared data contract).
#[derive(Clone, Copy, Debug)]
pub struct PagedKeys<'a, T: Element> {
    kv: &'a PagedKv<T>,
    seq_lens: &'a [i32],
    block_table: &'a [i32],
    max_blocks: usize,
}

impl<'a, T: Element> PagedKeys<'a, T> {
    /// Checks that every sequence's blocks exist in the table and the pool.
    pub fn new(
        kv: &'a PagedKv<T>,
        seq_lens: &'a [i32],
        block_table: &'a [i32],
        max_blocks: usize,
    ) -> Result<Self, AlgoError> {
        let layout = kv.layout();
        crate::error::check_len(
            "block_table",
            block_table.len(),
            &[seq_lens.len(), max_blocks],
        )?;
        for (s, &len) in seq_lens.iter().enumerate() {
            let need = usize::try_from(len)
                .map_err(|_| AlgoError::Invalid(format!("sequence {s}: length {len}")))?
                .div_ceil(layout.block_size);
            if need > max_blocks {
                return Err(AlgoError::Invalid(format!(
                    "sequence {s}: {len} tokens need {need} blocks, the table has {max_blocks}"
                )));
            }
            let row = &block_table[s * max_blocks..s * max_blocks + need];
            if let Some(b) = row
                .iter()
                .find(|&&b| b < 0 || b as usize >= layout.num_blocks)
            {
                return Err(AlgoError::Invalid(format!(
                    "sequence {s}: block {b} outside the pool of {} blocks",
                    layout.num_blocks
                )));
            }
        }
        Ok(PagedKeys {
            kv,
            seq_lens,
            block_table,
            max_blocks,
        })
    }
}

impl<T: Element> KeySource for PagedKeys<'_, T> {
    fn num_seqs(&self) -> usize {
        self.seq_lens.len()
    }

    fn kv_heads(&self) -> usize {
        self.kv.layout().kv_heads
    }

    fn head_dim(&self) -> usize {
        self.kv.layout().head_dim
    }

    fn seq_len(&self, seq: usize) -> usize {
        self.seq_lens[seq] as usize
    }

    fn read(&self, seq: usize, start: usize, dst: &mut [f32]) {
        let layout = self.kv.layout();
        let (bs, stride) = (layout.block_size, layout.token_stride());
        let table = &self.block_table[seq * self.max_blocks..(seq + 1) * self.max_blocks];
        let k = self.kv.k();
        for (i, row) in dst.chunks_exact_mut(stride).enumerate() {
            let pos = start + i;
            let slot = table[pos / bs] as usize * bs + pos % bs;
            T::slice_to_f32(&k[slot * stride..(slot + 1) * stride], row);
        }
    }
}
