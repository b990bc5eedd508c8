//! Loads ahead of a layer's step: while an earlier layer computes, the engine can hand the
//! coordinator an estimate of a later layer's queries, and the pages they select are loaded
//! before that layer's own step needs them.

use attn_op::Element;
use offload::StepStats;

use crate::coord::DecodeRow;
use crate::{CoordError, SparseCoordinator};

impl<T: Element> SparseCoordinator<T> {
    /// Turns prefetch on or off from now on (the configuration's
    /// [`SparseConfig::prefetch`](crate::SparseConfig::prefetch)), for instance to measure
    /// the same requests both ways. It only changes what
    /// [`wants_prefetch`](Self::wants_prefetch) answers.
    pub fn set_prefetch(&mut self, on: bool) {
        self.lowered.prefetch = on;
    }

    /// Whether a prefetch of `layer` now could load anything, so an estimate of its queries
    /// is worth making: the configuration asks for prefetch
    /// ([`SparseConfig::prefetch`](crate::SparseConfig::prefetch)), `layer` is a sparse layer
    /// of the forward in progress whose step has not begun, and the batch has decode rows.
    pub fn wants_prefetch(&self, layer: usize) -> bool {
        self.lowered.prefetch
            && self.check_layer(layer).is_ok()
            && self.sparse_of[layer].is_some()
            && !self.begun(layer)
            && !self.decode_rows().is_empty()
    }

    /// Before layer `layer`'s [`attention_begin`](Self::attention_begin) in the forward in
    /// progress, loads early the pages its algorithm would select with `q` (`[tokens,
    /// q_heads, head_dim]`). `q` is an estimate of the layer's queries, for instance the
    /// layer's query projection applied to an earlier layer's input. For each sparse-mode
    /// decode request, the union over KV heads of that selection goes through
    /// [`SparseKvCacheManager::prefetch`](offload::SparseKvCacheManager::prefetch). The
    /// layer's own step then selects with its real queries and finds what was loaded as hits;
    /// its attention is the same as without the prefetch.
    ///
    /// Answers the pages loaded early. A dense layer, or a batch without decode rows, loads
    /// nothing. An algorithm that reads the new keys gets [`CoordError::Config`], and a
    /// layer whose step has begun (or ended) gets [`CoordError::Invalid`].
    ///
    /// This is the CPU hooks' prefetch, the specification of the device's
    /// (`prefetch_device`, feature `cuda`). A coordinator driven through the device hooks
    /// keeps its hot buffers on the device, so there this would diff stale CPU copies.
    pub fn prefetch(&mut self, layer: usize, q: &[f32]) -> Result<StepStats, CoordError> {
        let m = self.model;
        let mut stats = StepStats::default();
        let Some((sl, rows)) = self.prefetch_rows(layer, q.len())? else {
            return Ok(stats);
        };
        let top = self.select_rows(layer, &rows, q, None)?;
        let manager = self.manager.as_mut().expect("sparse layers have a manager");
        for (j, r) in rows.iter().enumerate() {
            let (_, union) = crate::coord::head_union(&top, j, m.kv_heads);
            stats.add(&manager.prefetch(r.id, sl, &union, 1)?);
        }
        Ok(stats)
    }

    /// The checks of a prefetch of `layer` with `q_len` query values, and what it would
    /// prefetch for: the layer's sparse index and the batch's decode rows (`None`: a dense
    /// layer or no decode rows, nothing to load).
    pub(crate) fn prefetch_rows(
        &self,
        layer: usize,
        q_len: usize,
    ) -> Result<Option<(usize, Vec<DecodeRow>)>, CoordError> {
        let f = self.check_layer(layer)?;
        self.check_rows(f, "q", q_len, self.model.q_heads)?;
        if self.begun(layer) {
            return Err(CoordError::Invalid(format!(
                "layer {layer} has begun its step; a prefetch comes before it"
            )));
        }
        let Some(sl) = self.sparse_of[layer] else {
            return Ok(None);
        };
        let rows = self.decode_rows();
        Ok((!rows.is_empty()).then_some((sl, rows)))
    }
}
