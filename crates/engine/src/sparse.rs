//! Attention through the sparse coordinator: dense requests (and prefills) attend over the
//! engine's own cache, sparse-mode decode requests over the coordinator's device hot buffer.

use attn_op::{AttnOut, BatchMeta, Element, KvCache, paged_attention};
use coordinator::{Route, SparseCoordinator};
use kv_blocks::RequestId;
use offload::StepStats;
use sparse_algo::metrics::mass_recall;
use sparse_algo::{Decode, PagedKeys};

use crate::EngineError;
use crate::kv::{Batch, KvStore, narrow};
use crate::model::Attention;

/// One forward's attention through a [`SparseCoordinator`], between its `forward_begin` and
/// `forward_end` (the caller's).
pub struct SparseAttention<'a, T: Element> {
    /// The coordinator, inside a forward over `requests`.
    pub coord: &'a mut SparseCoordinator<T>,
    /// The engine's own cache: dense requests and prefills read it.
    pub store: &'a mut KvStore<T>,
    /// The batch over `store`, request by request as in `requests`. A sparse-mode decode
    /// token's slot may be -1: it lives on the coordinator's side only.
    pub batch: &'a Batch,
    /// The forward's requests and their new tokens, in batch order.
    pub requests: &'a [(RequestId, usize)],
    /// Hits, misses and bytes moved, summed over the forward's layers.
    pub stats: StepStats,
    /// When set, the attention-mass recall of every sparse row's selection (per query head)
    /// is measured against `store`, which must then hold those requests' every token.
    pub recall: Option<Vec<f64>>,
    /// Seconds spent measuring `recall`: work the forward does only to be evaluated, which a
    /// caller timing the decode takes out.
    pub recall_seconds: f64,
    /// When set, each layer's input gives the next layer's estimated queries
    /// ([`Model::query`](crate::Model::query)), whose selection the coordinator loads
    /// before that layer's step ([`SparseCoordinator::prefetch`]).
    pub prefetch: Option<&'a crate::Model>,
    /// What the prefetches loaded, summed over the forward's layers.
    pub prefetched: StepStats,
}

impl<T: Element> Attention for SparseAttention<'_, T> {
    fn layer_input(&mut self, layer: usize, x: &[f32]) -> Result<(), EngineError> {
        if let Some(model) = self.prefetch {
            let loaded = prefetch_next(model, self.coord, layer, x, self.batch)?;
            self.prefetched.add(&loaded);
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
        let (kt, vt) = (narrow::<T>(k), narrow::<T>(v));
        self.store.write(layer, &self.batch.slots, &kt, &vt)?;
        let plan = self.coord.attention_begin(layer, q, &kt, &vt)?;
        self.stats.add(&plan.stats);
        let qt = narrow::<T>(q);
        let qs = q.len() / self.batch.slots.len().max(1);
        let params = self.store.params().clone();
        // Dense rows: the requests routed dense, as one sub-batch of the engine's cache.
        let dense: Vec<usize> = (0..self.requests.len())
            .filter(|&i| plan.routes[i] == Route::Dense)
            .collect();
        if !dense.is_empty() {
            let sub = sub_batch(self.batch, &dense);
            let rows = rows_of(self.batch, &dense);
            let sq: Vec<T> = rows
                .iter()
                .flat_map(|&r| qt[r * qs..(r + 1) * qs].iter().copied())
                .collect();
            let mut so = vec![0.0f32; sq.len()];
            let meta = BatchMeta {
                cu_seqlens_q: &sub.0,
                seq_lens_kv: &sub.1,
                block_table: &sub.2,
                max_blocks: self.batch.max_blocks,
            };
            paged_attention(
                &sq,
                self.store.layer(layer),
                &meta,
                &params,
                AttnOut {
                    out: &mut so,
                    lse: None,
                },
            )?;
            for (j, &r) in rows.iter().enumerate() {
                out[r * qs..(r + 1) * qs].copy_from_slice(&so[j * qs..(j + 1) * qs]);
            }
        }
        if let (Some(meta), Some(sel)) = (&plan.meta, &plan.selection) {
            // Sparse rows, in the plan's row order: one query each.
            let mut by_row = vec![0usize; meta.seq_lens_kv.len()];
            for (i, r) in plan.routes.iter().enumerate() {
                if let Route::Sparse(j) = *r {
                    by_row[j] = i;
                }
            }
            let order: Vec<usize> = by_row
                .iter()
                .map(|&i| self.batch.cu_seqlens_q[i] as usize)
                .collect();
            let sq: Vec<T> = order
                .iter()
                .flat_map(|&r| qt[r * qs..(r + 1) * qs].iter().copied())
                .collect();
            let mut so = vec![0.0f32; sq.len()];
            let device = self
                .coord
                .device(layer)
                .ok_or_else(|| EngineError::Invalid(format!("layer {layer} has no device pool")))?;
            meta.attend(
                &sq,
                &device.read(),
                &params,
                AttnOut {
                    out: &mut so,
                    lse: None,
                },
            )?;
            for (j, &r) in order.iter().enumerate() {
                out[r * qs..(r + 1) * qs].copy_from_slice(&so[j * qs..(j + 1) * qs]);
            }
            if let Some(recall) = self.recall.as_mut() {
                let t0 = std::time::Instant::now();
                let sub = sub_batch(self.batch, &by_row);
                let qf: Vec<f32> = order
                    .iter()
                    .flat_map(|&r| q[r * qs..(r + 1) * qs].iter().copied())
                    .collect();
                let lens: Vec<usize> = sub.1.iter().map(|&l| l as usize).collect();
                let slots: Vec<usize> = (0..lens.len()).collect();
                let keys = PagedKeys::new(
                    self.store.layer(layer),
                    &sub.1,
                    &sub.2,
                    self.batch.max_blocks,
                )
                .map_err(|e| EngineError::Invalid(format!("recall keys: {e}")))?;
                let step = Decode {
                    layer: 0,
                    q: &qf,
                    q_heads: params.q_heads,
                    kv_heads: self.store.layer(layer).layout().kv_heads,
                    head_dim: qs / params.q_heads,
                    seq_lens: &lens,
                    slots: &slots,
                    keys: Some(&keys),
                };
                recall.extend(
                    mass_recall(&step, sel, params.scale)
                        .map_err(|e| EngineError::Invalid(format!("recall: {e}")))?,
                );
                self.recall_seconds += t0.elapsed().as_secs_f64();
            }
        }
        self.coord.attention_end(layer, &kt, &vt)?;
        Ok(())
    }
}

/// The rows of `batch` that belong to the requests `which`.
fn rows_of(batch: &Batch, which: &[usize]) -> Vec<usize> {
    which
        .iter()
        .flat_map(|&i| batch.cu_seqlens_q[i] as usize..batch.cu_seqlens_q[i + 1] as usize)
        .collect()
}

/// `cu_seqlens_q`, `seq_lens_kv` and `block_table` of the requests `which` of `batch`.
pub(crate) fn sub_batch(batch: &Batch, which: &[usize]) -> (Vec<i32>, Vec<i32>, Vec<i32>) {
    let w = batch.max_blocks;
    let mut cu = vec![0];
    let (mut lens, mut table) = (Vec::new(), Vec::new());
    for &i in which {
        let n = batch.cu_seqlens_q[i + 1] - batch.cu_seqlens_q[i];
        cu.push(cu.last().copied().unwrap_or(0) + n);
        lens.push(batch.seq_lens_kv[i]);
        table.extend_from_slice(&batch.block_table[i * w..(i + 1) * w]);
    }
    (cu, lens, table)
}

/// With layer `layer`'s input `x` (`[tokens, embed]`, the tokens of `batch`): when `coord`
/// wants a prefetch of the next layer ([`SparseCoordinator::wants_prefetch`]: its
/// configuration prefetches, the layer is sparse, a request decodes), the next layer's
/// queries estimated from `x` and their selection loaded before its step. Answers what was
/// loaded.
pub(crate) fn prefetch_next<T: Element>(
    model: &crate::Model,
    coord: &mut SparseCoordinator<T>,
    layer: usize,
    x: &[f32],
    batch: &Batch,
) -> Result<StepStats, EngineError> {
    let next = layer + 1;
    if !coord.wants_prefetch(next) {
        return Ok(StepStats::default());
    }
    let q = model.query(next, x, &batch.positions())?;
    Ok(coord.prefetch(next, &q)?)
}

/// A coordinator for one request `id` of up to `max_tokens` tokens whose prompt holds
/// `prompt_len` (the engine's single-request runs: `generate`, `eval`, the GPU tools), the
/// request begun.
pub fn single_request<T: Element>(
    model: &crate::ModelConfig,
    config: &coordinator::SparseConfig,
    id: RequestId,
    max_tokens: usize,
    prompt_len: usize,
) -> Result<SparseCoordinator<T>, EngineError> {
    let lowered = config.lower(model.shape(), None)?;
    let host_pages = max_tokens.div_ceil(lowered.page_size) + 1;
    let mut coord = SparseCoordinator::<T>::new(
        model.shape(),
        lowered,
        coordinator::Capacity {
            max_requests: 1,
            max_tokens,
            host_pages,
            host_alloc: offload::HostAlloc::Own,
        },
    )?;
    coord.on_request_begin(id, prompt_len)?;
    Ok(coord)
}

/// One forward of request `id`'s new `tokens` through `coord` (`forward_begin` to
/// `forward_end`), with the logits of rows `logits_for`.
#[allow(
    clippy::too_many_arguments,
    reason = "one forward's inputs, each distinct"
)]
pub(crate) fn forward_one<T: Element>(
    model: &crate::Model,
    coord: &mut SparseCoordinator<T>,
    store: &mut KvStore<T>,
    batch: &Batch,
    id: RequestId,
    tokens: &[u32],
    positions: &[usize],
    logits_for: &[usize],
    recall: bool,
) -> Result<OneForward, EngineError> {
    coord.forward_begin(&[(id, tokens.len())])?;
    let mut sa = SparseAttention {
        coord,
        store,
        batch,
        requests: &[(id, tokens.len())],
        stats: StepStats::default(),
        recall: recall.then(Vec::new),
        recall_seconds: 0.0,
        prefetch: None,
        prefetched: StepStats::default(),
    };
    if sa.coord.lowered().prefetch {
        sa.prefetch = Some(model);
    }
    let logits = model.forward(tokens, positions, &mut sa, logits_for)?;
    let (stats, recall, recall_seconds, prefetched) =
        (sa.stats, sa.recall, sa.recall_seconds, sa.prefetched);
    coord.forward_end()?;
    Ok(OneForward {
        logits,
        stats,
        recall,
        recall_seconds,
        prefetched,
    })
}

/// What [`forward_one`] returns.
pub(crate) struct OneForward {
    /// The logits asked for.
    pub(crate) logits: Vec<f32>,
    /// Hits, misses and bytes moved, over the layers.
    pub(crate) stats: StepStats,
    /// The selections' mass recall, when asked.
    pub(crate) recall: Option<Vec<f64>>,
    /// Seconds the recall's measurement took ([`SparseAttention::recall_seconds`]).
    pub(crate) recall_seconds: f64,
    /// What the prefetches loaded (the configuration's `prefetch`).
    pub(crate) prefetched: StepStats,
}
