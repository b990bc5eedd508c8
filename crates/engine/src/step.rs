//! One batched forward's attention: the batch's requests in contiguous groups, each dense
//! over the engine's cache or through its sparse configuration's coordinator.

use std::ops::Range;

use attn_op::Element;
use coordinator::SparseCoordinator;
use kv_blocks::RequestId;
use offload::StepStats;

use crate::EngineError;
use crate::kv::{Batch, DenseAttention, KvStore};
use crate::model::Attention;
use crate::sparse::{SparseAttention, prefetch_next, sub_batch};

/// The attention of a scheduler's forward: each group of requests attends through its own
/// backend over its rows of q, k, v and out.
pub(crate) struct StepAttention<'a, T: Element> {
    /// The device cache every group writes its new tokens to.
    pub(crate) store: &'a mut KvStore<T>,
    /// The coordinators, by index.
    pub(crate) coords: Vec<&'a mut SparseCoordinator<T>>,
    /// The groups, in batch order.
    pub(crate) groups: &'a mut [GroupRun],
    /// The model, whose next layer's queries a prefetching group estimates.
    pub(crate) model: &'a crate::Model,
}

/// Contiguous requests of a batch that share a backend.
pub(crate) struct GroupRun {
    /// The coordinator (`None`: dense).
    pub(crate) coord: Option<usize>,
    /// The index of the group's first request in the batch.
    first: usize,
    /// Its requests and their new tokens.
    pub(crate) requests: Vec<(RequestId, usize)>,
    /// Its part of the batch.
    sub: Batch,
    /// Its token rows in the batch.
    rows: Range<usize>,
}

impl GroupRun {
    /// A group starting at batch request `first`.
    pub(crate) fn new(coord: Option<usize>, first: usize, id: RequestId, n: usize) -> Self {
        GroupRun {
            coord,
            first,
            requests: vec![(id, n)],
            sub: Batch::default(),
            rows: 0..0,
        }
    }

    /// Cuts the group's part out of the whole batch.
    pub(crate) fn prepare(&mut self, batch: &Batch) {
        let (a, b) = (self.first, self.first + self.requests.len());
        self.rows = batch.cu_seqlens_q[a] as usize..batch.cu_seqlens_q[b] as usize;
        let which: Vec<usize> = (a..b).collect();
        let (cu_seqlens_q, seq_lens_kv, block_table) = sub_batch(batch, &which);
        self.sub = Batch {
            cu_seqlens_q,
            seq_lens_kv,
            block_table,
            max_blocks: batch.max_blocks,
            slots: batch.slots[self.rows.clone()].to_vec(),
        };
    }
}

impl<T: Element> Attention for StepAttention<'_, T> {
    /// For each group whose configuration prefetches ([`SparseAttention`]'s `prefetch`), the
    /// next sparse layer's estimated queries from the group's rows of `x`, and their
    /// selection loaded before that layer's step.
    fn layer_input(&mut self, layer: usize, x: &[f32]) -> Result<(), EngineError> {
        let e = self.model.config.embed;
        for g in self.groups.iter() {
            if let Some(c) = g.coord {
                let rows = &x[g.rows.start * e..g.rows.end * e];
                prefetch_next(self.model, self.coords[c], layer, rows, &g.sub)?;
            }
        }
        Ok(())
    }

    fn attend(
        &mut self,
        layer: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        let tokens = self.groups.last().map_or(0, |g| g.rows.end).max(1);
        let (qs, kvs) = (q.len() / tokens, k.len() / tokens);
        for g in self.groups.iter_mut() {
            let r = g.rows.clone();
            let (q, k, v) = (
                &q[r.start * qs..r.end * qs],
                &k[r.start * kvs..r.end * kvs],
                &v[r.start * kvs..r.end * kvs],
            );
            let out = &mut out[r.start * qs..r.end * qs];
            match g.coord {
                None => DenseAttention {
                    store: self.store,
                    batch: &g.sub,
                }
                .attend(layer, q, k, v, out)?,
                Some(c) => SparseAttention {
                    coord: self.coords[c],
                    store: self.store,
                    batch: &g.sub,
                    requests: &g.requests,
                    stats: StepStats::default(),
                    recall: None,
                    recall_seconds: 0.0,
                    prefetch: None,
                    prefetched: StepStats::default(),
                }
                .attend(layer, q, k, v, out)?,
            }
        }
        Ok(())
    }
}
