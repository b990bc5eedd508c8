//! What a layer's selection needs: the representations built from the host pool, the host
//! room for the new tokens, the decode rows and their top-k.

use attn_op::Element;
use kv_blocks::RequestId;
use offload::{HostAlloc, OffloadError};
use sparse_algo::{Decode, KeySource, TopK};

use super::{DecodeRow, SparseCoordinator};
use crate::keys::{HostKeys, host_seqs};
use crate::{CoordError, Mode, Phase};

impl<T: Element> SparseCoordinator<T> {
    /// Builds (`update` false) or extends the representations of `reqs` in sparse layer `sl`
    /// from the host pool.
    pub(crate) fn build_reps(
        &mut self,
        sl: usize,
        reqs: &[(RequestId, usize)],
        update: bool,
    ) -> Result<(), CoordError> {
        if reqs.is_empty() {
            return Ok(());
        }
        let algo = &self.lowered.layers[self.sparse_layers[sl]]
            .as_ref()
            .expect("a sparse layer has parameters")
            .algo;
        let manager = self.manager.as_ref().expect("sparse layers have a manager");
        let host = manager.host();
        let host = host.read();
        let keys = HostKeys {
            host: &host,
            layer: sl,
            seqs: host_seqs(
                manager,
                reqs.iter()
                    .map(|&(id, _)| Ok((id, manager.len(id, sl)?, &[] as &[T])))
                    .collect::<Result<Vec<_>, CoordError>>()?,
            )?,
        };
        let slots: Vec<usize> = reqs.iter().map(|r| r.1).collect();
        let pool = &mut self.pools[sl];
        if update {
            algo.update_representations(0, &keys, &slots, pool)?;
        } else {
            algo.construct_representations(0, &keys, &slots, pool)?;
        }
        Ok(())
    }

    /// Checks that the host pool can take the new tokens of every sparse-mode request of
    /// `batch` in sparse layer `sl`, so that no request is backed up while another fails.
    pub(crate) fn check_host_room(
        &self,
        sl: usize,
        batch: &[(RequestId, usize)],
    ) -> Result<(), CoordError> {
        let manager = self.manager.as_ref().expect("sparse layers have a manager");
        let mut need = 0;
        for &(id, n) in batch {
            if self.trackers[&id].mode == Mode::Sparse {
                let pages = manager.host_pages_needed(id, sl, n)?;
                if pages > 0 && manager.config().host_alloc == HostAlloc::External {
                    return Err(OffloadError::MissingHostPages { needed: pages }.into());
                }
                need += pages;
            }
        }
        if need > manager.free_host_pages() && manager.config().host_alloc == HostAlloc::Own {
            return Err(OffloadError::HostExhausted {
                needed: need,
                free: manager.free_host_pages(),
            }
            .into());
        }
        Ok(())
    }

    /// The selection of sparse layer `layer` for decode `rows` with the batch's queries `q`
    /// (`[tokens, q_heads, head_dim]`): one row per decode row, over each request's tokens and
    /// its new one. `k` is the batch's new keys, which algorithms that read keys need; without
    /// them such an algorithm is answered with [`CoordError::Config`].
    pub(crate) fn select_rows(
        &self,
        layer: usize,
        rows: &[DecodeRow],
        q: &[f32],
        k: Option<&[T]>,
    ) -> Result<TopK, CoordError> {
        let m = self.model;
        let (qs, kvs) = (m.q_heads * m.head_dim, m.kv_heads * m.head_dim);
        let sl = self.sparse_of[layer].expect("a sparse layer");
        let params = self.lowered.layers[layer]
            .as_ref()
            .expect("a sparse layer has parameters");
        let q_rows: Vec<f32> = rows
            .iter()
            .flat_map(|r| q[r.row * qs..(r.row + 1) * qs].iter().copied())
            .collect();
        let seq_lens: Vec<usize> = rows.iter().map(|r| r.len + 1).collect();
        let slots: Vec<usize> = rows.iter().map(|r| r.slot).collect();
        let manager = self.manager.as_ref().expect("sparse layers have a manager");
        let host = manager.host();
        let host = host.read();
        let keys = match (params.caps.reads_keys, k) {
            (false, _) => None,
            (true, Some(k)) => Some(HostKeys {
                host: &host,
                layer: sl,
                seqs: host_seqs(
                    manager,
                    rows.iter()
                        .map(|r| (r.id, r.len, &k[r.row * kvs..(r.row + 1) * kvs])),
                )?,
            }),
            (true, None) => {
                return Err(CoordError::Config(format!(
                    "layer {layer}: {} reads the new keys, which a selection made ahead of them \
                     lacks",
                    params.caps.name
                )));
            }
        };
        let step = Decode {
            layer: 0,
            q: &q_rows,
            q_heads: m.q_heads,
            kv_heads: m.kv_heads,
            head_dim: m.head_dim,
            seq_lens: &seq_lens,
            slots: &slots,
            keys: keys.as_ref().map(|k| k as &dyn KeySource),
        };
        Ok(params.algo.retrieve_topk(&step, &self.pools[sl])?)
    }

    /// The sparse-mode decode requests of the forward in progress, in batch order.
    pub(crate) fn decode_rows(&self) -> Vec<DecodeRow> {
        let Some(f) = self.forward.as_ref() else {
            return Vec::new();
        };
        f.batch
            .iter()
            .enumerate()
            .filter_map(|(i, &(id, _))| {
                let t = &self.trackers[&id];
                (t.mode == Mode::Sparse && t.phase == Phase::Decode).then(|| DecodeRow {
                    index: i,
                    id,
                    row: f.offsets[i],
                    len: t.len,
                    slot: t.slot.expect("a sparse-mode request holds a slot"),
                })
            })
            .collect()
    }
}

/// Row `j` of `top`: each of its `kv_heads` heads' pages, and their union (ascending, unique),
/// what the request's one hot buffer takes.
pub(crate) fn head_union(top: &TopK, j: usize, kv_heads: usize) -> (Vec<&[i32]>, Vec<i32>) {
    let heads: Vec<&[i32]> = (0..kv_heads).map(|h| top.row(j, h)).collect();
    let mut union: Vec<i32> = heads.iter().flat_map(|h| h.iter().copied()).collect();
    union.sort_unstable();
    union.dedup();
    (heads, union)
}
