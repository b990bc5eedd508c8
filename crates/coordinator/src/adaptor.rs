//! Backend adaptors: a request's selection and step plan rewritten into attention metadata
//! over the device pool.

use attn_op::{
    AttnOut, AttnParams, BatchMeta, Element, PagedKv, sparse_page_attention, token_sparse_attention,
};
use offload::StepPlan;
use sparse_algo::TopK;

use crate::CoordError;

/// Turns what the algorithm selected (logical ids per KV head) and where the offload layer put
/// it (a [`StepPlan`] over the union of the heads' ids) into the metadata an attention kernel
/// reads: a compact block table of the device pool, the selected tokens' count (the current,
/// partial page counted exactly), and per KV head the ids into that table.
pub trait BackendAdaptor: Send + Sync {
    /// The granularity this adaptor serves.
    fn kind(&self) -> AttnKind;

    /// One request's metadata row. `rows[h]` are KV head `h`'s ascending logical ids, each
    /// in `union` (ascending, unique), and `plan` is the offload step over `union`.
    fn row(&self, rows: &[&[i32]], union: &[i32], plan: StepPlan) -> Result<MetaRow, CoordError> {
        let ids = rows
            .iter()
            .map(|row| {
                row.iter()
                    .map(|p| {
                        union.binary_search(p).map(|i| i as i32).map_err(|_| {
                            CoordError::Invalid(format!("id {p} is not in the step's union"))
                        })
                    })
                    .collect::<Result<Vec<i32>, _>>()
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(MetaRow {
            block_table: plan.block_table,
            seq_len: plan.seq_len,
            ids,
        })
    }
}

/// One request's part of [`AttentionMeta`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetaRow {
    /// Device blocks of the compact table.
    pub block_table: Vec<i32>,
    /// Tokens of the compact table.
    pub seq_len: usize,
    /// Per KV head, ids into the compact table.
    pub ids: Vec<Vec<i32>>,
}

/// Which attention kernel reads the metadata.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnKind {
    /// Sparse page-list attention: ids are pages of the compact table.
    Pages,
    /// Token-level sparse attention over a pool of one-token pages: ids are tokens.
    Tokens,
}

/// The page-table adaptor: logical pages → device blocks; attention reads whole pages.
#[derive(Clone, Copy, Debug, Default)]
pub struct PageTableAdaptor;

impl BackendAdaptor for PageTableAdaptor {
    fn kind(&self) -> AttnKind {
        AttnKind::Pages
    }
}

/// The token-level adaptor (DSA/NSA style): logical tokens → device slots of a pool of
/// one-token pages; attention reads exactly the selected tokens.
#[derive(Clone, Copy, Debug, Default)]
pub struct TokenAdaptor;

impl BackendAdaptor for TokenAdaptor {
    fn kind(&self) -> AttnKind {
        AttnKind::Tokens
    }
}

/// Attention metadata of the sparse-mode decode requests of one layer's batch, one query each,
/// in the data contract's flat arrays.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionMeta {
    /// The kernel that reads it.
    pub kind: AttnKind,
    /// `[n + 1]`: one query per request.
    pub cu_seqlens_q: Vec<i32>,
    /// `[n]`: tokens of each request's compact table.
    pub seq_lens_kv: Vec<i32>,
    /// `[n * max_blocks]` device blocks, -1 padded.
    pub block_table: Vec<i32>,
    /// Row width of `block_table`.
    pub max_blocks: usize,
    /// Per (request, KV head), ids into the request's compact table.
    pub ids: TopK,
}

impl AttentionMeta {
    /// Packs the rows of a batch (one per request, each with `kv_heads` id rows).
    pub fn from_rows(kind: AttnKind, kv_heads: usize, page_size: usize, rows: &[MetaRow]) -> Self {
        let max_blocks = rows.iter().map(|r| r.block_table.len()).max().unwrap_or(0);
        let mut block_table = vec![-1; rows.len() * max_blocks];
        for (s, r) in rows.iter().enumerate() {
            block_table[s * max_blocks..s * max_blocks + r.block_table.len()]
                .copy_from_slice(&r.block_table);
        }
        let ids: Vec<Vec<i32>> = rows.iter().flat_map(|r| r.ids.iter().cloned()).collect();
        AttentionMeta {
            kind,
            cu_seqlens_q: (0..=rows.len() as i32).collect(),
            seq_lens_kv: rows.iter().map(|r| r.seq_len as i32).collect(),
            block_table,
            max_blocks,
            ids: TopK::from_rows(&ids, kv_heads, page_size),
        }
    }

    /// Requests in the batch.
    pub fn num_seqs(&self) -> usize {
        self.seq_lens_kv.len()
    }

    /// The metadata as attn-op's batch view.
    pub fn batch(&self) -> BatchMeta<'_> {
        BatchMeta {
            cu_seqlens_q: &self.cu_seqlens_q,
            seq_lens_kv: &self.seq_lens_kv,
            block_table: &self.block_table,
            max_blocks: self.max_blocks,
        }
    }

    /// Runs the attention this metadata is for: `q` is `[num_seqs, q_heads, head_dim]` and `kv`
    /// the layer's device pool.
    pub fn attend<T: Element>(
        &self,
        q: &[T],
        kv: &PagedKv<T>,
        params: &AttnParams,
        out: AttnOut<'_>,
    ) -> Result<(), CoordError> {
        let sel = self.ids.as_selection();
        match self.kind {
            AttnKind::Pages => sparse_page_attention(q, kv, &self.batch(), &sel, params, out)?,
            AttnKind::Tokens => token_sparse_attention(q, kv, &self.batch(), &sel, params, out)?,
        }
        Ok(())
    }
}
