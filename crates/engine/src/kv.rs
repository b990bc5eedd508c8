//! The engine's own paged KV cache (one block tensor per layer) and dense attention over it.

use attn_op::{
    AttnOut, AttnParams, BatchMeta, Element, KvCache, KvLayout, PagedKv, Simd, paged_attention,
};

use crate::EngineError;
use crate::model::{Attention, ModelConfig};

/// K and V of every layer over `num_blocks` blocks of `block_size` tokens, shared by every
/// request through its block table.
#[derive(Clone, Debug)]
pub struct KvStore<T: Element> {
    layers: Vec<PagedKv<T>>,
    params: AttnParams,
}

impl<T: Element> KvStore<T> {
    /// A cache for `config` of `num_blocks` blocks.
    pub fn new(
        config: &ModelConfig,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<Self, EngineError> {
        let layout = KvLayout {
            num_blocks,
            block_size,
            kv_heads: config.kv_heads,
            head_dim: config.head_dim,
        };
        let layers = (0..config.layers)
            .map(|_| PagedKv::new(layout))
            .collect::<Result<_, _>>()?;
        Ok(KvStore {
            layers,
            params: AttnParams::new(config.q_heads, config.head_dim),
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.layers.first().map_or(1, |l| l.layout().block_size)
    }

    /// Layer `layer`'s cache.
    pub fn layer(&self, layer: usize) -> &PagedKv<T> {
        &self.layers[layer]
    }

    /// The attention parameters of every layer.
    pub fn params(&self) -> &AttnParams {
        &self.params
    }

    /// Runs every layer's attention with the CPU build `simd` (attn-op's [`Simd`]).
    pub fn set_simd(&mut self, simd: Simd) {
        self.params.simd = simd;
    }

    /// Writes `k`, `v` (`[tokens, kv_heads, head_dim]`) of layer `layer` into `slots`.
    pub fn write(
        &mut self,
        layer: usize,
        slots: &[i32],
        k: &[T],
        v: &[T],
    ) -> Result<(), EngineError> {
        self.layers[layer].set_kv(slots, k, v)?;
        Ok(())
    }
}

impl<T: Element> KvStore<T> {
    /// Blocks per layer.
    pub fn num_blocks(&self) -> usize {
        self.layers.first().map_or(0, |l| l.layout().num_blocks)
    }

    /// Copies the first `tokens` tokens of block `src` of `from` into block `dst`, every
    /// layer (`from` is another store of the same shape; `None`: this one).
    pub fn copy_block(
        &mut self,
        from: Option<&KvStore<T>>,
        src: usize,
        dst: usize,
        tokens: usize,
    ) -> Result<(), EngineError> {
        let stride = self.layers.first().map_or(0, |l| l.layout().token_stride());
        let bs = self.block_size();
        let src_blocks = from.map_or(self.num_blocks(), KvStore::num_blocks);
        if tokens > bs || src >= src_blocks || dst >= self.num_blocks() {
            return Err(EngineError::Invalid(format!(
                "copy of {tokens} tokens from block {src} of {src_blocks} to block {dst} of {} \
                 (blocks of {bs})",
                self.num_blocks()
            )));
        }
        let (s, d) = (src * bs * stride, dst * bs * stride);
        let len = tokens * stride;
        for (l, layer) in self.layers.iter_mut().enumerate() {
            match from {
                Some(f) => {
                    let (fk, fv) = (f.layers[l].k(), f.layers[l].v());
                    let (k, v) = layer.tensors_mut();
                    k[d..d + len].copy_from_slice(&fk[s..s + len]);
                    v[d..d + len].copy_from_slice(&fv[s..s + len]);
                }
                None => {
                    let (k, v) = layer.tensors_mut();
                    k.copy_within(s..s + len, d);
                    v.copy_within(s..s + len, d);
                }
            }
        }
        Ok(())
    }

    /// K and V of a sequence's first `n` tokens in layer `layer` (`[n, kv_heads, head_dim]`
    /// each), through its block table `table` (a valid block id per `block_size` tokens).
    pub(crate) fn gather(&self, layer: usize, table: &[i32], n: usize) -> (Vec<T>, Vec<T>) {
        let l = &self.layers[layer];
        let stride = l.layout().token_stride();
        let bs = self.block_size();
        let (mut k, mut v) = (
            Vec::with_capacity(n * stride),
            Vec::with_capacity(n * stride),
        );
        for (b, &block) in table.iter().enumerate().take(n.div_ceil(bs)) {
            let len = (n - b * bs).min(bs) * stride;
            let at = block as usize * bs * stride;
            k.extend_from_slice(&l.k()[at..at + len]);
            v.extend_from_slice(&l.v()[at..at + len]);
        }
        (k, v)
    }
}

/// f32 rows narrowed to the cache's element type.
pub(crate) fn narrow<T: Element>(x: &[f32]) -> Vec<T> {
    x.iter().map(|&v| T::from_f32(v)).collect()
}

/// A batch's metadata in the shared contract, owned.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Batch {
    /// `[num_seqs + 1]` prefix sums of the new tokens per sequence.
    pub cu_seqlens_q: Vec<i32>,
    /// `[num_seqs]` KV length per sequence, new tokens included.
    pub seq_lens_kv: Vec<i32>,
    /// `[num_seqs * max_blocks]` block table, -1-padded.
    pub block_table: Vec<i32>,
    /// Columns of the block table.
    pub max_blocks: usize,
    /// `[tokens]` the slot each new token's K and V go to.
    pub slots: Vec<i32>,
}

impl Batch {
    /// Each new token's position: its sequence's length less the tokens after it.
    pub fn positions(&self) -> Vec<usize> {
        (0..self.seq_lens_kv.len())
            .flat_map(|i| {
                let n = (self.cu_seqlens_q[i + 1] - self.cu_seqlens_q[i]) as usize;
                let end = self.seq_lens_kv[i] as usize;
                end - n..end
            })
            .collect()
    }

    /// One sequence whose blocks are `0..blocks` in order (the engine's single-request
    /// runs): the new tokens at positions `pos..end`, each written to the slot of its
    /// position.
    pub fn single(pos: usize, end: usize, blocks: usize) -> Batch {
        Batch {
            cu_seqlens_q: vec![0, (end - pos) as i32],
            seq_lens_kv: vec![end as i32],
            block_table: (0..blocks as i32).collect(),
            max_blocks: blocks,
            slots: (pos as i32..end as i32).collect(),
        }
    }

    /// The borrowed view the attention op takes.
    pub fn meta(&self) -> BatchMeta<'_> {
        BatchMeta {
            cu_seqlens_q: &self.cu_seqlens_q,
            seq_lens_kv: &self.seq_lens_kv,
            block_table: &self.block_table,
            max_blocks: self.max_blocks,
        }
    }
}

/// Dense attention of a batch over a [`KvStore`]: the new tokens are written, then every
/// query attends its sequence's whole causal prefix.
pub struct DenseAttention<'a, T: Element> {
    /// The cache.
    pub store: &'a mut KvStore<T>,
    /// The batch.
    pub batch: &'a Batch,
}

impl<T: Element> Attention for DenseAttention<'_, T> {
    fn attend(
        &mut self,
        layer: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        self.attend_narrowed(layer, q, &narrow(k), &narrow(v), out)
    }
}

impl<T: Element> DenseAttention<'_, T> {
    /// [`Attention::attend`] with K and V already in the cache's element type.
    pub(crate) fn attend_narrowed(
        &mut self,
        layer: usize,
        q: &[f32],
        k: &[T],
        v: &[T],
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        self.store.write(layer, &self.batch.slots, k, v)?;
        let q = narrow::<T>(q);
        paged_attention(
            &q,
            &self.store.layers[layer],
            &self.batch.meta(),
            &self.store.params,
            AttnOut { out, lse: None },
        )?;
        Ok(())
    }
}
